"""Transformers 5's fused experts for vLLM's loader trace.

A trainer on transformers 5 holds a mixture of experts' routed experts fused, and so publishes
them fused from ``named_parameters()``: ``<layer>.mlp.experts.gate_up_proj`` ``[E, 2W, H]`` (expert
``e``'s gate rows ``[:W]`` then its up rows ``[W:]``) and ``<layer>.mlp.experts.down_proj``
``[E, H, W]``, where checkpoints (and what every vLLM model's ``load_weights`` takes) have
``<layer>.mlp.experts.{e}.gate_proj.weight`` / ``up_proj.weight`` ``[W, H]`` and
``down_proj.weight`` ``[H, W]``. vLLM 0.32's own loaders differ: Qwen3-MoE's (``RoutedExperts``)
takes the fused tensors too (``chunk(2, dim=1)`` then ``unbind``), DeepSeek-V2/V3's hand-written
``load_weights`` matches per-expert names only and passes a fused name over.

So the loader trace drives every loader with per-expert placeholders (:func:`split_fused_experts`)
and then names the fused tensor as each slice's source, the per-expert view prepended to its op
chain (:func:`join_fused_experts`): the engine stages, registers and pulls the fused tensors as
the trainer publishes them, byte for byte.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tensorhub.core.errors import MappingMismatch

__all__ = ["FUSED_EXPERTS", "join_fused_experts", "split_fused_experts"]

#: Name endings of transformers 5's fused routed-expert tensors, with their per-expert parts.
FUSED_EXPERTS = {".mlp.experts.gate_up_proj": ("gate_proj", "up_proj"), ".mlp.experts.down_proj": ("down_proj",)}

Origin = dict[str, tuple[str, tuple]]


def split_fused_experts(
    tensors: dict[str, tuple[str, tuple[int, ...]]],
) -> tuple[dict[str, tuple[str, tuple[int, ...]]], Origin]:
    """``tensors`` (``{name: (dtype, shape)}``) with each fused expert tensor replaced by its
    per-expert checkpoint names, and per such name, the fused tensor it is a view of and the op
    chain of that view (``[e]``, then for gate/up the half's rows).

    Raises:
        MappingMismatch: a fused tensor that is not 3-D, whose gate/up rows are not two equal
            halves, or whose per-expert names the checkpoint also has (naming it).
    """
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    origin: Origin = {}
    bad: list[str] = []
    for name, (dtype, shape) in tensors.items():
        end = next((e for e in FUSED_EXPERTS if name.endswith(e)), None)
        if end is None:
            out[name] = (dtype, shape)
            continue
        parts = FUSED_EXPERTS[end]
        if len(shape) != 3 or shape[0] < 1 or shape[1] % len(parts) or not shape[1]:
            what = "[experts, 2 x width, hidden]" if len(parts) == 2 else "[experts, hidden, width]"
            bad.append(f"{name}: shape {list(shape)} is not {what}")
            continue
        rows = shape[1] // len(parts)
        prefix = name[: -len(end)] + ".mlp.experts"
        for e in range(shape[0]):
            for k, part in enumerate(parts):
                split = f"{prefix}.{e}.{part}.weight"
                chain: tuple = (("__getitem__", (e,), ()),)
                if len(parts) > 1:
                    chain += (("narrow", (0, k * rows, rows), ()),)
                origin[split] = (name, chain)
                out[split] = (dtype, (rows, shape[2]))
    doubled = sorted(n for n in origin if n in tensors)
    if doubled:
        bad.append(f"per-expert tensors and the fused tensor they are part of, both: {doubled[:4]}")
    if bad:
        raise MappingMismatch(
            "the checkpoint's fused expert tensors (transformers 5's mlp.experts.gate_up_proj / down_proj) do not split "
            "into experts:\n  " + "\n  ".join(bad),
            tensors=tuple(b.partition(":")[0] for b in bad if not b.startswith("per-expert")) + tuple(doubled[:8]),
        )
    return out, origin


def join_fused_experts(scatter: Any, origin: Origin) -> Any:
    """A traced scatter (``source``, ``chain``) whose source is a per-expert name that
    :func:`split_fused_experts` made: the same slice, of the fused tensor."""
    got = origin.get(scatter.source)
    if got is None:
        return scatter
    fused, chain = got
    return dataclasses.replace(scatter, source=fused, chain=chain + tuple(scatter.chain))
