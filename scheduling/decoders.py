"""The tensors of a Hugging Face decoder (Llama, Qwen2, Qwen3, and their mixtures of experts) on
both sides of a resharded job.

:func:`hf_placements` lists the trainer's tensors under Hugging Face's names, every one placed
the same way (FSDP's ``Shard(0)`` by default); :func:`vllm_placements` lists an inference
engine's under vLLM's names with vLLM's tensor parallelism: ``qkv_proj`` and ``gate_up_proj``
packed (each rank holds its chunk of every part; KV heads replicated when there are fewer than
ranks), ``o_proj`` and ``down_proj`` row-parallel (``Shard(1)``), embeddings and ``lm_head``
vocabulary-parallel (``Shard(0)``), norms replicated, and with ``fp8`` the linear weights in
``float8_e4m3fn`` beside their ``weight_scale_inv`` block scales. With
:func:`tensorhub.scheduling.mapping.preset` they describe a trainer -> engine reshard; the
benchmark, the simulator and the tests build their layouts from them.

vLLM pads the vocabulary to a multiple of 64 before splitting it over the ranks; a
:class:`DecoderShape` whose vocabulary is not a multiple of 64 and of ``tp`` is refused rather
than padded.

**Mixtures of experts** (``experts`` > 0: Qwen3-MoE, and DeepSeek-V3 / Kimi-K2's routed and
shared experts, attention aside): the trainer holds Hugging Face's per-expert
``mlp.experts.{e}.gate_proj``/``up_proj``/``down_proj``, the router ``mlp.gate.weight`` (and
DeepSeek's ``e_score_correction_bias``), the shared experts' ``mlp.shared_experts.*``; the first
``dense_layers`` layers keep a dense MLP. vLLM stacks the routed experts into
``mlp.experts.routed_experts.w13_weight`` ``[experts, 2 x width, hidden]`` (each expert's gate
then up rows) and ``w2_weight`` ``[experts, hidden, width]``; here they are described flattened
to two dimensions (``[experts x 2 x width, hidden]``, ``[experts x hidden, width]``: the same
bytes; register ``w13_weight.flatten(0, 1)``). Over vLLM's ranks the experts are either cut like
its tensor parallelism (every rank holds a slice of every expert: ``w13`` packed with a gate and
an up part per expert, ``w2`` split along its columns) or, with ``expert_parallel``, whole
(rank ``r`` holds experts ``r x E/tp ...``). On the trainer's side :func:`hf_layout` with ``ep``
places the experts on their own mesh as in the Perplexity write-up: expert-parallel group ``g``
(of ``ep``) holds experts ``g x E/ep ...``, each FSDP-sharded over the group's ranks only, while
every other tensor is FSDP-sharded over all ranks. Multi-head latent attention (DeepSeek,
Kimi) is not described: grouped-query attention of the same head count stands in for it. No IO.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorhub.core.errors import InvalidArgument
from tensorhub.core.placement import REPLICATE, PlacedTensor, ReplicaLayout, TensorPlacement

from .mapping import SCALE_DTYPE, scale_shape

__all__ = ["DecoderShape", "hf_layout", "hf_placements", "hf_tensors", "vllm_placements"]


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """A decoder's sizes (Hugging Face config names).

    Attributes:
        layers, hidden, intermediate, heads, kv_heads, head_dim, vocab: the config's
            ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``,
            ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``vocab_size``.
        qkv_bias: q/k/v projections have biases (Qwen2).
        qk_norm: per-head RMS norms of q and k (Qwen3).
        tie_embeddings: ``lm_head`` is ``embed_tokens`` (no tensor of its own).
        experts: routed experts per MoE layer (``num_experts`` / ``n_routed_experts``); 0: dense.
        expert_intermediate: one expert's width (``moe_intermediate_size``).
        shared_intermediate: the shared experts' width, all of them together
            (``n_shared_experts x moe_intermediate_size``); 0: none (Qwen3-MoE).
        dense_layers: leading layers with a dense MLP of ``intermediate`` (``first_k_dense_replace``).
        router_bias: the router has DeepSeek's ``e_score_correction_bias`` (``noaux_tc``).
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    experts: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    dense_layers: int = 0
    router_bias: bool = False

    def __post_init__(self) -> None:
        if self.experts < 0 or self.dense_layers < 0 or self.shared_intermediate < 0:
            raise InvalidArgument(f"{self}: experts, dense_layers and shared_intermediate must be >= 0")
        if self.experts and self.expert_intermediate < 1:
            raise InvalidArgument(f"{self}: a mixture of experts needs expert_intermediate >= 1")
        if not self.experts and (self.expert_intermediate or self.shared_intermediate or self.dense_layers or self.router_bias):
            raise InvalidArgument(f"{self}: expert sizes without experts")
        if self.dense_layers > self.layers:
            raise InvalidArgument(f"{self}: more dense layers than layers")

    def moe(self, layer: int) -> bool:
        """Whether layer ``layer`` is a mixture of experts."""
        return self.experts > 0 and layer >= self.dense_layers

    @classmethod
    def family(cls, family: str, **sizes: int) -> DecoderShape:
        """A shape with ``family``'s switches (Qwen2: q/k/v biases; Qwen3: q/k norms)."""
        return cls(**sizes, qkv_bias=family == "qwen2", qk_norm=family == "qwen3")  # type: ignore[arg-type]  # sizes: the int fields only


def hf_tensors(shape: DecoderShape) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face's parameter names and global shapes, in ``named_parameters`` order."""
    s = shape
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.self_attn.q_proj.weight", (q, s.hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv, s.hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv, s.hidden)),
        ]
        if s.qkv_bias:
            out += [
                (f"{p}.self_attn.q_proj.bias", (q,)),
                (f"{p}.self_attn.k_proj.bias", (kv,)),
                (f"{p}.self_attn.v_proj.bias", (kv,)),
            ]
        out.append((f"{p}.self_attn.o_proj.weight", (s.hidden, q)))
        if s.qk_norm:
            out += [(f"{p}.self_attn.q_norm.weight", (s.head_dim,)), (f"{p}.self_attn.k_norm.weight", (s.head_dim,))]
        if s.moe(i):
            out += _hf_experts(s, p)
        else:
            out += _mlp(f"{p}.mlp", s.intermediate, s.hidden)
        out += [(f"{p}.input_layernorm.weight", (s.hidden,)), (f"{p}.post_attention_layernorm.weight", (s.hidden,))]
    out.append(("model.norm.weight", (s.hidden,)))
    if not s.tie_embeddings:
        out.append(("lm_head.weight", (s.vocab, s.hidden)))
    return out


def _mlp(prefix: str, width: int, hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"{prefix}.gate_proj.weight", (width, hidden)), (f"{prefix}.up_proj.weight", (width, hidden)),
            (f"{prefix}.down_proj.weight", (hidden, width))]  # fmt: skip


def _hf_experts(s: DecoderShape, p: str) -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = [(f"{p}.mlp.gate.weight", (s.experts, s.hidden))]
    if s.router_bias:
        out.append((f"{p}.mlp.gate.e_score_correction_bias", (s.experts,)))
    for e in range(s.experts):
        out += _mlp(f"{p}.mlp.experts.{e}", s.expert_intermediate, s.hidden)
    if s.shared_intermediate:
        out += _mlp(f"{p}.mlp.shared_experts", s.shared_intermediate, s.hidden)
    return out


def _expert_of(name: str) -> int | None:
    """The routed expert a Hugging Face tensor belongs to (``...mlp.experts.{e}...``), else None."""
    head, sep, tail = name.partition(".mlp.experts.")
    if not sep:
        return None
    index = tail.split(".", 1)[0]
    return int(index) if index.isdecimal() else None


def hf_layout(shape: DecoderShape, shards: int, dtype: str = "bfloat16", *, ep: int = 1) -> ReplicaLayout:
    """The trainer's layout: :func:`hf_placements` (every tensor FSDP-sharded over all ``shards``)
    or, with ``ep`` > 1, the routed experts on their own mesh: ``ep`` expert-parallel groups of
    ``shards / ep`` consecutive ranks, group ``g`` holding experts ``g x E/ep`` to
    ``(g + 1) x E/ep - 1``, each sharded along dim 0 over its group's ranks only.

    Raises:
        InvalidArgument: ``ep`` does not divide the ranks and the experts.
    """
    if ep == 1:
        return ReplicaLayout.spmd(hf_placements(shape, shards, dtype), shards)
    if ep < 1 or shards % ep or not shape.experts or shape.experts % ep:
        raise InvalidArgument(f"{ep} expert-parallel groups need to divide the {shards} ranks and the {shape.experts} experts")
    fsdp, per_group = shards // ep, shape.experts // ep
    rows: list[list[PlacedTensor]] = [[] for _ in range(shards)]
    for name, dims in hf_tensors(shape):
        e = _expert_of(name)
        if e is None:
            t = TensorPlacement(name, dtype, dims, (shards,), (0,))
            for r in range(shards):
                rows[r].append(PlacedTensor(t, (r,)))
            continue
        t = TensorPlacement(name, dtype, dims, (fsdp,), (0,))
        g = e // per_group
        for f in range(fsdp):
            rows[g * fsdp + f].append(PlacedTensor(t, (f,)))
    return ReplicaLayout(tuple(tuple(r) for r in rows))


def hf_placements(shape: DecoderShape, shards: int, dtype: str = "bfloat16", dim: int = 0) -> list[TensorPlacement]:
    """The trainer's tensors, each ``Shard(dim)`` over ``shards`` shards (FSDP: dim 0);
    1-D tensors are sharded along their only dimension."""
    return [
        TensorPlacement(name, dtype, dims, (shards,), (min(dim, len(dims) - 1),)) for name, dims in hf_tensors(shape)
    ]


def vllm_placements(
    shape: DecoderShape,
    tp: int,
    dtype: str = "bfloat16",
    *,
    fp8: bool = False,
    block: int = 128,
    expert_parallel: bool = False,
    dp: int = 1,
) -> list[TensorPlacement]:
    """An inference engine's tensors under vLLM's names and tensor parallelism over ``tp`` ranks
    (with ``expert_parallel``, the routed experts whole, ``experts / tp`` per rank).

    ``dp`` > 1 is vLLM's data-parallel attention with expert parallelism (``--data-parallel-size
    dp --enable-expert-parallel``): ``dp x tp`` ranks, rank ``r`` at ``(r // tp, r % tp)``; every
    tensor but the routed experts is cut by ``tp`` and the same on each of the ``dp`` groups,
    the routed experts are whole, ``experts / (dp x tp)`` per rank.

    Raises:
        InvalidArgument: sizes vLLM's tensor parallelism (or its block FP8) could not shard.
    """
    s = shape
    if type(dp) is not int or dp < 1 or (dp > 1 and not (expert_parallel and s.experts)):
        raise InvalidArgument(f"dp={dp!r}: data-parallel attention is for experts spread over every rank (expert_parallel)")
    ranks = dp * tp
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    dense = s.experts == 0 or s.dense_layers > 0
    if s.heads % tp or (s.kv_heads % tp and tp % s.kv_heads) or (dense and s.intermediate % tp) or s.vocab % 64 or s.vocab % tp:
        raise InvalidArgument(
            f"vLLM cannot shard {s} over {tp} ranks (heads, KV heads, intermediate size, vocabulary / 64)"
        )
    if fp8 and (s.head_dim % block or (q // tp) % block or (dense and (s.intermediate // tp) % block)):
        raise InvalidArgument(
            f"block FP8 needs every rank's rows and columns in whole {block}-blocks: {s} over {tp} ranks"
        )
    if s.experts:
        width, shared = s.expert_intermediate, s.shared_intermediate
        if (expert_parallel and s.experts % ranks) or (not expert_parallel and width % tp) or shared % tp:
            how = f"{s.experts} experts over {ranks}" if expert_parallel else f"experts of width {width} over {tp}"
            raise InvalidArgument(f"vLLM cannot shard {how} ranks (shared width {shared}, tensor parallelism {tp})")
        if fp8 and (width % block or (not expert_parallel and (width // tp) % block) or (shared // tp) % block):
            raise InvalidArgument(
                f"block FP8 needs every rank's expert rows and columns in whole {block}-blocks: {s} over {tp} ranks"
            )
    mesh: tuple[int, ...] = (tp,)
    col: tuple[int, ...] = (0,)
    row: tuple[int, ...] = (1,)
    rep: tuple[int, ...] = (REPLICATE,)
    if dp > 1:  # the same on every data-parallel group
        mesh, col, row, rep = (dp, tp), (REPLICATE, 0), (REPLICATE, 1), (REPLICATE, REPLICATE)
    wdtype = "float8_e4m3fn" if fp8 else dtype

    def linear(
        name: str, dims: tuple[int, int], placement: tuple[int, ...], parts: tuple[int, ...] = (), unit: int = 1
    ) -> list[TensorPlacement]:
        out = [TensorPlacement(name + ".weight", wdtype, dims, mesh, placement, parts, 0, unit)]
        if fp8:
            sparts = tuple(-(-p // block) for p in parts)
            sunit = max(1, unit // block) if parts else 1
            out.append(
                TensorPlacement(
                    name + ".weight_scale_inv",
                    SCALE_DTYPE,
                    scale_shape(dims, (block, block)),
                    mesh,
                    placement,
                    sparts,
                    0,
                    sunit,
                )
            )
        return out

    def stacked(
        name: str, dims: tuple[int, int], placement: tuple[int, ...], parts: tuple[int, ...], on: tuple[int, ...]
    ) -> list[TensorPlacement]:
        """A stacked expert tensor (flattened to 2-D) on mesh ``on`` and, with FP8, its block scales."""
        out = [TensorPlacement(name, wdtype, dims, on, placement, parts)]
        if fp8:
            sdims = scale_shape(dims, (block, block))
            sparts = tuple(-(-n // block) for n in parts)
            out.append(TensorPlacement(name + "_scale_inv", SCALE_DTYPE, sdims, on, placement, sparts))
        return out

    def experts(p: str) -> list[TensorPlacement]:
        e, w, h = s.experts, s.expert_intermediate, s.hidden
        out = [TensorPlacement(f"{p}.mlp.gate.weight", dtype, (e, h), mesh, rep)]
        if s.router_bias:
            out.append(TensorPlacement(f"{p}.mlp.gate.e_score_correction_bias", dtype, (e,), mesh, rep))
        routed = f"{p}.mlp.experts.routed_experts"
        if expert_parallel:  # rank r: experts r*E/ranks ... whole
            out += stacked(f"{routed}.w13_weight", (e * 2 * w, h), (0,), (), (ranks,))
            out += stacked(f"{routed}.w2_weight", (e * h, w), (0,), (), (ranks,))
        else:  # every rank: its slice of every expert's gate and up rows, and of its down columns
            out += stacked(f"{routed}.w13_weight", (e * 2 * w, h), col, (w,) * (2 * e), mesh)
            out += stacked(f"{routed}.w2_weight", (e * h, w), row, (), mesh)
        if s.shared_intermediate:
            n = s.shared_intermediate
            out += linear(f"{p}.mlp.shared_experts.gate_up_proj", (2 * n, h), col, (n, n))
            out += linear(f"{p}.mlp.shared_experts.down_proj", (h, n), row)
        return out

    out = [TensorPlacement("model.embed_tokens.weight", dtype, (s.vocab, s.hidden), mesh, col)]
    for i in range(s.layers):
        p = f"model.layers.{i}"
        out += linear(f"{p}.self_attn.qkv_proj", (q + 2 * kv, s.hidden), col, (q, kv, kv), s.head_dim)
        if s.qkv_bias:
            out.append(
                TensorPlacement(
                    f"{p}.self_attn.qkv_proj.bias", dtype, (q + 2 * kv,), mesh, col, (q, kv, kv), 0, s.head_dim
                )
            )
        out += linear(f"{p}.self_attn.o_proj", (s.hidden, q), row)
        if s.qk_norm:
            out += [TensorPlacement(f"{p}.self_attn.{n}_norm.weight", dtype, (s.head_dim,), mesh, rep) for n in "qk"]
        if s.moe(i):
            out += experts(p)
        else:
            out += linear(f"{p}.mlp.gate_up_proj", (2 * s.intermediate, s.hidden), col, (s.intermediate, s.intermediate))
            out += linear(f"{p}.mlp.down_proj", (s.hidden, s.intermediate), row)
        out += [
            TensorPlacement(f"{p}.{n}.weight", dtype, (s.hidden,), mesh, rep)
            for n in ("input_layernorm", "post_attention_layernorm")
        ]
    out.append(TensorPlacement("model.norm.weight", dtype, (s.hidden,), mesh, rep))
    if not s.tie_embeddings:
        out.append(TensorPlacement("lm_head.weight", dtype, (s.vocab, s.hidden), mesh, col))
    return out
