"""Transformers 5's fused experts split for vLLM's loader trace and joined back
(:mod:`tensorhub.integrations.vllm_experts`): no vLLM needed. The engines' end-to-end check (a
trainer publishing a loaded transformers 5 model's ``named_parameters()``) is in
``tests/test_vllm_backend.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tensorhub.core.errors import MappingMismatch
from tensorhub.integrations.vllm_experts import join_fused_experts, split_fused_experts


@dataclasses.dataclass(frozen=True)
class _Scatter:
    source: str
    chain: tuple


def _replay(t: torch.Tensor, chain: tuple) -> torch.Tensor:
    for op, args, kwargs in chain:
        t = getattr(t, op)(*args, **dict(kwargs))
    return t


def test_fused_experts_split_into_the_checkpoint_names_and_join_back_byte_exact(seed):
    e, w, h = 3, 4, 6
    g = torch.Generator().manual_seed(seed)
    gate, up, down = (torch.randn(e, w, h, generator=g), torch.randn(e, w, h, generator=g), torch.randn(e, h, w, generator=g))
    # transformers 5's layout: per expert, gate rows then up rows (Qwen3MoeExperts: .chunk(2, dim=-1))
    fused = {"model.layers.3.mlp.experts.gate_up_proj": torch.cat([gate, up], 1), "model.layers.3.mlp.experts.down_proj": down}
    tensors = {"model.layers.3.mlp.gate.weight": ("bfloat16", (e, h)),
               **{n: ("bfloat16", tuple(t.shape)) for n, t in fused.items()}}  # fmt: skip
    split, origin = split_fused_experts(tensors)
    want = {f"model.layers.3.mlp.experts.{i}.{p}.weight": t[i] for i in range(e) for p, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))}  # fmt: skip
    assert set(split) == {"model.layers.3.mlp.gate.weight", *want}
    assert split["model.layers.3.mlp.gate.weight"] == ("bfloat16", (e, h))
    for name, t in want.items():
        assert split[name] == ("bfloat16", tuple(t.shape))
        # a loader's slice of the per-expert tensor (here: a tensor-parallel half of its rows)
        half = (("narrow", (0, t.shape[0] // 2, t.shape[0] // 2), ()),)
        joined = join_fused_experts(_Scatter(name, half), origin)
        assert joined.source in fused
        got = _replay(fused[joined.source], joined.chain)
        assert got.data_ptr() != 0 and torch.equal(got, _replay(t, half)), (name, seed)
    other = _Scatter("model.layers.3.mlp.gate.weight", ())
    assert join_fused_experts(other, origin) is other


@pytest.mark.parametrize(
    "name, shape, what",
    [("m.layers.0.mlp.experts.gate_up_proj", (4, 7, 8), r"\[experts, 2 x width, hidden\]"),
     ("m.layers.0.mlp.experts.gate_up_proj", (8, 8), r"\[experts, 2 x width, hidden\]"),
     ("m.layers.0.mlp.experts.down_proj", (0, 8, 4), r"\[experts, hidden, width\]")],
)  # fmt: skip
def test_fused_experts_of_bad_shapes_are_named(name, shape, what):
    with pytest.raises(MappingMismatch, match=what) as err:
        split_fused_experts({name: ("bfloat16", shape)})
    assert err.value.tensors == (name,)


def test_per_expert_and_fused_tensors_together_are_refused():
    tensors = {"m.layers.0.mlp.experts.down_proj": ("bfloat16", (2, 8, 4)),
               "m.layers.0.mlp.experts.1.down_proj.weight": ("bfloat16", (8, 4))}  # fmt: skip
    with pytest.raises(MappingMismatch, match="both") as err:
        split_fused_experts(tensors)
    assert "m.layers.0.mlp.experts.1.down_proj.weight" in err.value.tensors
