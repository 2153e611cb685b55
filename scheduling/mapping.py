"""Mappings between naming schemes: how each destination tensor derives from source tensors.

Theory of operation
-------------------
A trainer and an inference engine name and shape the same model differently: Hugging Face's
``model.layers.0.self_attn.q_proj.weight``, ``k_proj`` and ``v_proj`` are vLLM's one
``model.layers.0.self_attn.qkv_proj.weight``; the trainer holds bf16 where the engine wants fp8
with a block scale beside each weight. A :class:`Mapping` says so in a few declarative rules,
applied to whole **global** tensors (placements are the planner's business, not the mapping's):

1. :class:`Rename` ``(source, target)``: the first rename whose pattern matches a source name
   gives its name in the destination's scheme (no match: the name is kept).
2. :class:`Fuse` ``(target, parts, dim)``: renamed tensors matching the parts' patterns with the
   same captures are concatenated along ``dim``, in the parts' order, into ``target``. Parts may
   differ in size along ``dim`` (grouped-query attention's ``q`` vs ``k``/``v``). With ``stack``
   (the name of a capture, e.g. ``"e"``), the tensors of every index ``0, 1, ...`` of that capture
   go into the one ``target``, index after index, each index's parts in the parts' order: a
   mixture of experts' per-expert ``gate_proj``/``up_proj`` become vLLM's stacked ``w13_weight``
   (described flattened to two dimensions, ``[experts x rows, columns]``: the same bytes as vLLM's
   ``[experts, rows, columns]`` parameter, so a packed placement's ``parts`` say where each
   expert's gate and up rows are).
3. :class:`Quantize` ``(target, scale)``: a destination weight matching ``target`` is FP8 e4m3
   with 128x128 blocks; each block's inverse scale (``amax / 448``, float32) lands in the
   destination tensor named by the ``scale`` template: the two are derived together, as a
   bundle. A fused weight is quantized part by part (each part's own block grid), and its scale
   is the parts' scales concatenated, as vLLM loads separate ``q``/``k``/``v`` checkpoints.
4. :class:`Cast` ``(target, dtype)``: destination tensors matching ``target`` are that dtype.

Patterns name one dotted segment with ``{name}`` and any text (dots included) with
``{name:path}``; templates use ``{name}`` for what the pattern captured.

:func:`resolve` checks the mapping against both sides' tensors before any byte moves and returns
one :class:`Derivation` per destination tensor. It refuses, with one
:class:`~tensorhub.errors.MappingMismatch` naming every tensor concerned: a destination tensor no
source feeds, one fed twice, a source that maps to a name the destination lacks (unless
``ignore``d), a fusion with a part missing or parts of unequal shapes, and a derived shape or
dtype other than the destination's. A dtype change needs a :class:`Cast` (or a
:class:`Quantize`): nothing is converted silently.

The presets (:func:`preset`) map the Hugging Face decoders (Llama, Qwen2, Qwen3) to vLLM's names
(``packed_modules_mapping`` in vLLM's ``models/llama.py``, ``qwen2.py``, ``qwen3.py``:
``qkv_proj`` <- ``q_proj, k_proj, v_proj`` and ``gate_up_proj`` <- ``gate_proj, up_proj``; block
FP8 scales are ``weight_scale_inv``). No IO, no torch.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping as TMapping
from dataclasses import dataclass
from typing import Any, Protocol

from tensorhub.core.errors import InvalidArgument, MappingMismatch
from tensorhub.core.layout import DTYPE_SIZES
from tensorhub.core.wire import struct

__all__ = [
    "COPY",
    "FP8_SCALES",
    "FP8_VALUES",
    "SCALE_DTYPE",
    "Cast",
    "Derivation",
    "FAMILIES",
    "Fuse",
    "IDENTITY",
    "Mapping",
    "Part",
    "Quantize",
    "Rename",
    "fused_parts",
    "preset",
    "resolve",
    "scale_shape",
]

#: Derivation kinds: a (cast) copy, an FP8 weight's values, an FP8 weight's block scales.
COPY, FP8_VALUES, FP8_SCALES = "copy", "fp8_values", "fp8_scales"
#: The dtype of FP8 block scales (vLLM's ``weight_scale_inv``).
SCALE_DTYPE = "float32"
#: The FP8 formats a :class:`Quantize` may name.
FP8_DTYPES = ("float8_e4m3fn",)
_FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16"}

#: The names a preset knows (the Hugging Face decoder families).
FAMILIES = ("llama", "qwen2", "qwen3", "deepseek_v3")

_CAPTURE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(:path)?\}")


@dataclass(frozen=True, slots=True)
class _Pattern:
    regex: re.Pattern[str]
    names: frozenset[str]


@functools.lru_cache(maxsize=4096)
def _pattern(pattern: str) -> _Pattern:
    """Compile a name pattern (raises InvalidArgument naming it)."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidArgument(f"a name pattern must be a non-empty string, got {pattern!r}")
    out: list[str] = []
    names: list[str] = []
    pos = 0
    for m in _CAPTURE.finditer(pattern):
        out.append(re.escape(pattern[pos : m.start()]))
        if m.group(1) in names:
            raise InvalidArgument(f"pattern {pattern!r} captures {{{m.group(1)}}} twice")
        names.append(m.group(1))
        out.append(f"(?P<{m.group(1)}>.+)" if m.group(2) else f"(?P<{m.group(1)}>[^.]+)")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    if "{" in _CAPTURE.sub("", pattern) or "}" in _CAPTURE.sub("", pattern):
        raise InvalidArgument(f"pattern {pattern!r} has a brace that is not a {{name}} or {{name:path}} capture")
    return _Pattern(re.compile("".join(out)), frozenset(names))


def _template(template: str, known: frozenset[str], what: str) -> None:
    """Check that ``template`` fills only captures in ``known``."""
    if not isinstance(template, str) or not template:
        raise InvalidArgument(f"{what}: a template must be a non-empty string, got {template!r}")
    rest = _CAPTURE.sub("", template)
    if "{" in rest or "}" in rest:
        raise InvalidArgument(f"{what}: template {template!r} has a brace that is not a {{name}}")
    for m in _CAPTURE.finditer(template):
        if m.group(2):
            raise InvalidArgument(f"{what}: template {template!r}: write {{{m.group(1)}}}, not {{{m.group(1)}:path}}")
        if m.group(1) not in known:
            raise InvalidArgument(
                f"{what}: template {template!r} uses {{{m.group(1)}}}, which its pattern does not capture"
            )


def _fill(template: str, captures: TMapping[str, str]) -> str:
    return _CAPTURE.sub(lambda m: captures[m.group(1)], template)


def _match(pattern: str, name: str) -> dict[str, str] | None:
    m = _pattern(pattern).regex.fullmatch(name)
    return None if m is None else m.groupdict()


# --- the rules ----------------------------------------------------------------------------------


@struct
class Rename:
    """Source tensors whose name matches ``source`` are named ``target`` (a template) in the
    destination's scheme. The first matching rename applies."""

    source: str
    target: str

    def __post_init__(self) -> None:
        _template(self.target, _pattern(self.source).names, f"Rename({self.source!r})")


@struct
class Fuse:
    """Renamed tensors matching ``parts`` (patterns capturing the same names) are concatenated
    along ``dim``, in the parts' order, into ``target`` (a template). With ``stack`` (a capture
    of the parts that the target does not use), every index ``0..n-1`` of that capture goes into
    the one target, in index order (see the module's docstring). An ``optional`` fusion whose
    target the destination does not have leaves its parts to the other rules, one by one (as
    vLLM loads ``q_a_proj`` and ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj`` only when the
    model has it)."""

    target: str
    parts: tuple[str, ...]
    dim: int = 0
    stack: str = ""
    optional: bool = False

    def __post_init__(self) -> None:
        what = f"Fuse({self.target!r})"
        if not self.parts:
            raise InvalidArgument(f"{what}: needs at least one part")
        names = {_pattern(p).names for p in self.parts}
        if len(names) != 1:
            raise InvalidArgument(f"{what}: its parts {list(self.parts)} must capture the same names")
        if len(set(self.parts)) != len(self.parts):
            raise InvalidArgument(f"{what}: a part is named twice")
        if type(self.dim) is not int or self.dim < 0:
            raise InvalidArgument(f"{what}: dim must be >= 0, got {self.dim!r}")
        captured = names.pop()
        if type(self.stack) is not str:
            raise InvalidArgument(f"{what}: stack must be the name of a capture, got {self.stack!r}")
        if self.stack:
            if self.stack not in captured:
                raise InvalidArgument(f"{what}: stack {self.stack!r} is not captured by its parts {list(self.parts)}")
            if self.optional:
                raise InvalidArgument(f"{what}: a stacking fusion cannot be optional")
            if any(m.group(1) == self.stack for m in _CAPTURE.finditer(self.target)):
                raise InvalidArgument(f"{what}: the target may not use the stacked capture {{{self.stack}}}")
            captured = captured - {self.stack}
        _template(self.target, captured, what)


@struct
class Cast:
    """Destination tensors whose name matches ``target`` are ``dtype`` (converted from the
    source's dtype)."""

    target: str
    dtype: str

    def __post_init__(self) -> None:
        _pattern(self.target)
        if self.dtype not in DTYPE_SIZES:
            raise InvalidArgument(f"Cast({self.target!r}): unknown dtype {self.dtype!r}")


@struct
class Quantize:
    """Destination weights whose name matches ``target`` are block-quantized to ``dtype``; each
    block's inverse scale (``amax / 448``, float32) goes to the destination tensor named by the
    template ``scale``.

    Attributes:
        block: the block's (rows, columns); 128x128 as DeepSeek-V3 and Qwen3's FP8 checkpoints.
    """

    target: str
    scale: str
    dtype: str = "float8_e4m3fn"
    block: tuple[int, ...] = (128, 128)

    def __post_init__(self) -> None:
        what = f"Quantize({self.target!r})"
        _template(self.scale, _pattern(self.target).names, what)
        if self.dtype not in FP8_DTYPES:
            raise InvalidArgument(f"{what}: quantizes to {list(FP8_DTYPES)}, not {self.dtype!r}")
        if len(self.block) != 2 or any(type(b) is not int or b < 1 for b in self.block):
            raise InvalidArgument(f"{what}: block must be two sizes >= 1, got {self.block!r}")


@struct
class Mapping:
    """A mapping from one naming scheme to another (see the module's docstring).

    Attributes:
        renames, fusions, quantize, casts: the rules, each list in priority order.
        ignore: patterns of source tensors the destination does not take (they feed nothing).
    """

    renames: tuple[Rename, ...] = ()
    fusions: tuple[Fuse, ...] = ()
    quantize: tuple[Quantize, ...] = ()
    casts: tuple[Cast, ...] = ()
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for p in self.ignore:
            _pattern(p)


IDENTITY = Mapping()


# --- resolution ---------------------------------------------------------------------------------


class TensorMeta(Protocol):
    """What :func:`resolve` reads of a tensor (a :class:`~tensorhub.core.placement.TensorPlacement`
    has it): its dtype and global shape."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@struct
class Part:
    """One source tensor's place in a derived tensor: ``[start, start + size)`` along the
    derivation's ``dim`` (in blocks for FP8 scales)."""

    source: str
    start: int
    size: int


@struct
class Derivation:
    """How one destination tensor derives from source tensors (global shapes, no placements).

    Attributes:
        target: the destination tensor.
        kind: :data:`COPY` (concatenate the parts, cast to ``dtype``), :data:`FP8_VALUES` (quantize
            each part by ``block``, concatenate the values) or :data:`FP8_SCALES` (the same
            quantization's inverse scales, concatenated).
        dtype, shape: the destination tensor's dtype and global shape.
        dim: the dimension the parts are concatenated along.
        parts: the source tensors, in order along ``dim``.
        block: for FP8: the block's (rows, columns).
        partner: for FP8: the other tensor of the bundle (a weight's scale, a scale's weight).
    """

    target: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    dim: int
    parts: tuple[Part, ...]
    block: tuple[int, ...] = ()
    partner: str = ""

    def __post_init__(self) -> None:
        if self.kind not in (COPY, FP8_VALUES, FP8_SCALES):
            raise ValueError(f"derivation of {self.target!r}: unknown kind {self.kind!r}")
        if not self.parts or (self.shape and not 0 <= self.dim < len(self.shape)):
            raise ValueError(f"derivation of {self.target!r}: bad parts or dim")


def _blocks(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-n // b) for n, b in zip(shape, block))


class _Problems:
    """Every reason a mapping is refused, gathered so one error names them all."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.tensors: dict[str, None] = {}

    def add(self, text: str, *tensors: str) -> None:
        self.lines.append(text)
        self.tensors.update(dict.fromkeys(tensors))

    def raise_if_any(self) -> None:
        if self.lines:
            shown = self.lines[:20] + ([f"... and {len(self.lines) - 20} more"] if len(self.lines) > 20 else [])
            raise MappingMismatch(
                f"the mapping does not connect the layouts ({len(self.lines)} problems):\n  " + "\n  ".join(shown),
                tensors=tuple(self.tensors),
            )


def resolve(mapping: Mapping, sources: TMapping[str, Any], targets: TMapping[str, Any]) -> dict[str, Derivation]:
    """Check ``mapping`` against both sides' tensors and derive every destination tensor.

    Args:
        mapping: the rules.
        sources: the source tensors by name (anything with ``dtype`` and global ``shape``, e.g.
            :meth:`ReplicaLayout.tensors() <tensorhub.core.placement.ReplicaLayout.tensors>`).
        targets: the destination tensors by name, likewise.

    Returns:
        One :class:`Derivation` per destination tensor, in ``targets``' order.

    Raises:
        MappingMismatch: naming every tensor concerned (see the module's docstring).
    """
    bad = _Problems()
    # 1. renames
    renamed: list[tuple[str, str]] = []
    for src in sources:
        if any(_match(p, src) is not None for p in mapping.ignore):
            continue
        new = src
        for r in mapping.renames:
            caps = _match(r.source, src)
            if caps is not None:
                new = _fill(r.target, caps)
                break
        renamed.append((src, new))
    # 2. fusions: group parts by (rule, captures), each by (stacked index, part)
    groups: dict[tuple[int, tuple[tuple[str, str], ...]], dict[tuple[str, int], list[str]]] = {}
    plain: dict[str, list[str]] = {}
    new_name = dict(renamed)
    for src, new in renamed:
        for fi, f in enumerate(mapping.fusions):
            hit = next(((pi, c) for pi, p in enumerate(f.parts) if (c := _match(p, new)) is not None), None)
            if hit is not None:
                pi, caps = hit
                index = caps.pop(f.stack) if f.stack else ""
                groups.setdefault((fi, tuple(sorted(caps.items()))), {}).setdefault((index, pi), []).append(src)
                break
        else:
            plain.setdefault(new, []).append(src)
    for key in [k for k in groups if mapping.fusions[k[0]].optional]:
        if _fill(mapping.fusions[key[0]].target, dict(key[1])) not in targets:
            for src in (s for srcs in groups.pop(key).values() for s in srcs):
                plain.setdefault(new_name[src], []).append(src)
    derived: dict[str, list[Derivation]] = {}

    def copy_of(target: str, dim: int, part_names: list[str]) -> Derivation | None:
        metas = [sources[s] for s in part_names]
        shapes = [tuple(m.shape) for m in metas]
        dtypes = {m.dtype for m in metas}
        if len(part_names) == 1:  # a plain (renamed) tensor, scalars included
            size = shapes[0][0] if shapes[0] else 1
            return Derivation(target, COPY, metas[0].dtype, shapes[0], 0, (Part(part_names[0], 0, size),))
        if len(dtypes) != 1:
            bad.add(
                f"fusion {target!r}: parts {part_names} have different dtypes {sorted(dtypes)}", target, *part_names
            )
            return None
        rest = [s[:dim] + s[dim + 1 :] for s in shapes]
        if any(not dim < len(s) for s in shapes) or len(set(rest)) != 1 or len({len(s) for s in shapes}) != 1:
            bad.add(
                f"fusion {target!r}: parts {part_names} of shapes {shapes} do not concatenate along dim {dim}",
                target,
                *part_names,
            )
            return None
        parts, at = [], 0
        for s, shape in zip(part_names, shapes):
            parts.append(Part(s, at, shape[dim]))
            at += shape[dim]
        return Derivation(target, COPY, dtypes.pop(), shapes[0][:dim] + (at,) + shapes[0][dim + 1 :], dim, tuple(parts))

    for new, srcs in plain.items():
        for s in srcs:
            d = copy_of(new, 0, [s])
            if d is not None:
                derived.setdefault(new, []).append(d)
    for (fi, caps_t), by_part in groups.items():
        f, caps = mapping.fusions[fi], dict(caps_t)
        target = _fill(f.target, caps)
        got = [s for srcs in by_part.values() for s in srcs]
        indices = [""]
        if f.stack:
            seen = {index for index, _ in by_part}
            odd = sorted(i for i in seen if not (i.isdecimal() and str(int(i)) == i))
            if odd:
                bad.add(f"fusion {target!r} stacks {f.stack!r} indices that are not numbers 0, 1, ...: {odd}", target, *got)
                continue
            indices = [str(i) for i in range(max(int(i) for i in seen) + 1)]
        keys = [(index, pi) for index in indices for pi in range(len(f.parts))]
        missing = [_fill(f.parts[pi], {**caps, f.stack: index} if f.stack else caps) for index, pi in keys if (index, pi) not in by_part]
        doubled = [srcs for srcs in by_part.values() if len(srcs) > 1]
        if missing:
            shown = missing[:8] + ([f"... {len(missing) - 8} more"] if len(missing) > 8 else [])
            bad.add(f"fusion {target!r} lacks its parts {shown} (it has {len(got)}: {got[:8]}{' ...' if len(got) > 8 else ''})",
                    target, *missing, *got)  # fmt: skip
            continue
        if doubled:
            bad.add(f"fusion {target!r}: one part is fed by several sources {doubled}", target, *doubled[0])
            continue
        d = copy_of(target, f.dim, [by_part[k][0] for k in keys])
        if d is not None:
            derived.setdefault(target, []).append(d)
    # 3. quantization bundles and casts
    out: dict[str, list[Derivation]] = {}
    for target, ds in derived.items():
        for d in ds:
            q, caps = next(
                ((q, c) for q in mapping.quantize if (c := _match(q.target, target)) is not None), (None, None)
            )
            if q is None or caps is None:
                cast = next((c for c in mapping.casts if _match(c.target, target) is not None), None)
                out.setdefault(target, []).append(d if cast is None else _replace_dtype(d, cast.dtype))
                continue
            scale = _fill(q.scale, caps)
            names = [p.source for p in d.parts]
            if len(d.shape) != 2 or d.dtype not in _FLOAT_DTYPES:
                bad.add(
                    f"{target!r}: block quantization takes 2-D floating-point weights, not {d.dtype}{list(d.shape)} from {names}",
                    target,
                    *names,
                )
                continue
            sparts, at = [], 0
            for p in d.parts:
                n = _blocks((sources[p.source].shape[d.dim],), (q.block[d.dim],))[0]
                sparts.append(Part(p.source, at, n))
                at += n
            sshape = _blocks(d.shape, q.block)
            sshape = sshape[: d.dim] + (at,) + sshape[d.dim + 1 :]
            out.setdefault(target, []).append(
                Derivation(target, FP8_VALUES, q.dtype, d.shape, d.dim, d.parts, q.block, scale)
            )
            out.setdefault(scale, []).append(
                Derivation(scale, FP8_SCALES, SCALE_DTYPE, sshape, d.dim, tuple(sparts), q.block, target)
            )
    # 4. against the destination
    for target, ds in out.items():
        if len(ds) > 1:
            srcs = [p.source for d in ds for p in d.parts]
            bad.add(
                f"destination tensor {target!r} is fed twice: by {[[p.source for p in d.parts] for d in ds]}",
                target,
                *srcs,
            )
            continue
        d = ds[0]
        srcs = [p.source for p in d.parts]
        if target not in targets:
            what = "the scale of " + repr(d.partner) if d.kind == FP8_SCALES else "from " + ", ".join(map(repr, srcs))
            bad.add(f"{target!r} ({what}) is not a tensor of the destination", target, *srcs)
            continue
        meta = targets[target]
        if tuple(meta.shape) != d.shape:
            bad.add(
                f"destination tensor {target!r} has shape {list(meta.shape)}, the mapping derives {list(d.shape)} from {srcs}",
                target,
                *srcs,
            )
        if meta.dtype != d.dtype:
            how = "a cast rule" if d.kind == COPY else "the quantization"
            bad.add(
                f"destination tensor {target!r} is {meta.dtype}, {how} gives {d.dtype} (from {srcs}); add a Cast?",
                target,
                *srcs,
            )
    for target in targets:
        if target not in out:
            bad.add(f"destination tensor {target!r} is fed by no source tensor", target)
    bad.raise_if_any()
    return {t: out[t][0] for t in targets}


def _replace_dtype(d: Derivation, dtype: str) -> Derivation:
    return Derivation(d.target, d.kind, dtype, d.shape, d.dim, d.parts, d.block, d.partner)


# --- presets ------------------------------------------------------------------------------------


def preset(
    family: str,
    *,
    fp8: bool = False,
    dtype: str | None = None,
    renames: tuple[Rename, ...] = (),
    ignore: tuple[str, ...] = (),
) -> Mapping:
    """Hugging Face decoder names -> vLLM names, for ``family`` in :data:`FAMILIES`.

    The families share vLLM's ``packed_modules_mapping``: ``q_proj, k_proj, v_proj`` ->
    ``qkv_proj`` (weights, and Qwen2's biases) and ``gate_proj, up_proj`` -> ``gate_up_proj``,
    fused along dim 0; every other name (norms, Qwen3's ``q_norm``/``k_norm``, embeddings,
    ``lm_head``, ``o_proj``, ``down_proj``) is kept. A destination sharded by tensor parallelism
    declares its fused tensors packed (``parts``), as vLLM's ranks hold them.

    Their mixtures of experts (Qwen3-MoE; DeepSeek-V3's experts) too, as vLLM's ``FusedMoE``
    loads them: every expert's ``mlp.experts.{e}.gate_proj, up_proj`` stacked into
    ``mlp.experts.routed_experts.w13_weight`` and its ``down_proj`` into ``w2_weight`` (both
    flattened to 2-D: :mod:`tensorhub.scheduling.decoders`), the shared experts' ``gate_proj,
    up_proj`` into ``mlp.shared_experts.gate_up_proj``; the router is kept. With ``fp8`` the
    stacked weights are quantized expert by expert, their scales in ``w13_weight_scale_inv`` /
    ``w2_weight_scale_inv`` (vLLM's block-FP8 names), as the routed experts' linear layers.
    DeepSeek's router bias (``mlp.gate.e_score_correction_bias``) is cast to float32, as vLLM
    holds it. A trainer on transformers 5 holds the routed experts fused (``mlp.experts.gate_up_proj``
    ``[experts, 2 x width, hidden]``, gate rows then up rows per expert, and ``mlp.experts.down_proj``
    ``[experts, hidden, width]``): vLLM's ``w13_weight``/``w2_weight`` as they are, so those are
    renamed and moved whole, for a destination that describes them in that 3-D shape
    (:func:`~tensorhub.scheduling.decoders.vllm_placements` ``fused_experts=True``); against the
    2-D description the shapes differ and :func:`resolve` names them.

    And multi-head latent attention (``deepseek_v3``: DeepSeek-V2/V3, Kimi-K2): ``q_a_proj,
    kv_a_proj_with_mqa`` -> ``fused_qkv_a_proj`` along dim 0; ``q_b_proj``, ``kv_b_proj``, the
    two latent norms and ``o_proj`` kept (with ``fp8``, each linear weight quantized as above).
    The two attention fusions are optional, as in vLLM: a model without a compressed query
    (DeepSeek-V2-Lite) keeps ``q_proj`` and ``kv_a_proj_with_mqa`` as they are.

    Args:
        fp8: quantize every linear layer's weight (``*_proj.weight``) to FP8 e4m3 with 128x128
            blocks, the inverse scales in ``*_proj.weight_scale_inv`` (vLLM's block-FP8 name).
        dtype: cast every other tensor to this dtype (e.g. the trainer's float32 to bfloat16).
        renames: renames applied first (e.g. a training wrapper's prefixes).
        ignore: source tensors the destination does not take (e.g. a tied ``lm_head.weight``).

    Raises:
        InvalidArgument: an unknown family.
    """
    if family not in FAMILIES:
        raise InvalidArgument(f"no preset for {family!r}; known: {list(FAMILIES)}")
    layer = "{prefix:path}.layers.{i}"
    out = "{prefix}.layers.{i}"
    expert = layer + ".mlp.experts.{e}"
    routed = out + ".mlp.experts.routed_experts"
    # transformers 5's fused experts (3-D), after the caller's renames
    renames = (*renames, Rename(layer + ".mlp.experts.gate_up_proj", routed + ".w13_weight"),
               Rename(layer + ".mlp.experts.down_proj", routed + ".w2_weight"))  # fmt: skip
    fusions = (
        Fuse(out + ".self_attn.qkv_proj.{t}", tuple(f"{layer}.self_attn.{p}_proj.{{t}}" for p in "qkv"), optional=True),
        Fuse(out + ".self_attn.fused_qkv_a_proj.{t}",
             (layer + ".self_attn.q_a_proj.{t}", layer + ".self_attn.kv_a_proj_with_mqa.{t}"), optional=True),
        Fuse(out + ".mlp.gate_up_proj.{t}", (layer + ".mlp.gate_proj.{t}", layer + ".mlp.up_proj.{t}")),
        Fuse(out + ".mlp.shared_experts.gate_up_proj.{t}",
             (layer + ".mlp.shared_experts.gate_proj.{t}", layer + ".mlp.shared_experts.up_proj.{t}")),
        Fuse(routed + ".w13_weight", (expert + ".gate_proj.weight", expert + ".up_proj.weight"), stack="e"),
        Fuse(routed + ".w2_weight", (expert + ".down_proj.weight",), stack="e"),
    )  # fmt: skip
    quantize = (
        (
            Quantize(layer + ".{block}.{proj}_proj.weight", out + ".{block}.{proj}_proj.weight_scale_inv"),
            Quantize(layer + ".self_attn.kv_a_proj_with_mqa.weight", out + ".self_attn.kv_a_proj_with_mqa.weight_scale_inv"),
            Quantize(layer + ".mlp.shared_experts.{proj}_proj.weight", out + ".mlp.shared_experts.{proj}_proj.weight_scale_inv"),
            Quantize(layer + ".mlp.experts.routed_experts.{w}_weight", out + ".mlp.experts.routed_experts.{w}_weight_scale_inv"),
        )
        if fp8
        else ()
    )  # fmt: skip
    # vLLM keeps DeepSeek's router bias in float32 whatever the model's dtype
    casts = (Cast(layer + ".mlp.gate.e_score_correction_bias", "float32"),) + ((Cast("{name:path}", dtype),) if dtype else ())
    return Mapping(tuple(renames), fusions, quantize, casts, ("{prefix:path}.rotary_emb.inv_freq", *ignore))


def fused_parts(derivation: Derivation) -> tuple[int, ...]:
    """The sizes of a fused derivation's parts along its dim: a packed destination's ``parts``."""
    return tuple(p.size for p in derivation.parts)


def scale_shape(shape: tuple[int, ...], block: tuple[int, ...] = (128, 128)) -> tuple[int, ...]:
    """The shape of the inverse-scale tensor of a weight of ``shape`` quantized by ``block``."""
    return _blocks(shape, block)
