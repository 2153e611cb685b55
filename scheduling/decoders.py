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
every other tensor is FSDP-sharded over all ranks. The trainer's names are the checkpoints' (one
tensor per expert) by default.

**Fused experts** (``fused_experts=True``): transformers 5 keeps a loaded model's routed experts
fused (``mlp.experts.gate_up_proj`` ``[experts, 2 x width, hidden]``, each expert's gate then up
rows, and ``down_proj`` ``[experts, hidden, width]``), so a trainer publishing its
``named_parameters()`` has those names, in vLLM's own ``w13``/``w2`` layout. :func:`hf_tensors`,
:func:`hf_placements` and :func:`hf_layout` then list them (3-D, FSDP over the experts; with ``ep``
group ``g``'s experts sharded over its ranks: ``Shard(0)`` on both mesh dimensions), and
:func:`vllm_placements` describes ``w13``/``w2`` in vLLM's 3-D shape (tensor parallelism: ``w13``
packed along dim 1 with a gate and an up part, ``w2`` split along dim 2; expert parallelism:
``Shard(0)``), so the preset's renames (:func:`~tensorhub.scheduling.mapping.preset`) move each
fused tensor as it is, its 3-D placements kept. Block FP8 quantizes 2-D weights only: FP8 with
fused experts is refused.

**Multi-head latent attention** (``kv_lora_rank`` > 0: DeepSeek-V2/V3, Kimi-K2): the trainer holds
Hugging Face's ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` (or, without ``q_lora_rank``, one
``q_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` and ``o_proj``. vLLM fuses
``q_a_proj`` and ``kv_a_proj_with_mqa`` along dim 0 into ``fused_qkv_a_proj`` and replicates it
on every rank (as the two norms), cuts ``q_b_proj`` / ``q_proj`` and ``kv_b_proj`` by heads (rows)
and ``o_proj`` by its columns. The router's score-correction bias is float32 on both sides, as
in the checkpoints and in vLLM. No IO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
        kv_lora_rank: multi-head latent attention's compressed KV width; 0: not MLA (then the
            four sizes below are 0 too). With MLA, ``kv_heads`` and ``head_dim`` are not used.
        q_lora_rank: MLA's compressed query width; 0: queries projected directly (``q_proj``).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA's per-head widths.
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
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        mla = (self.q_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if self.kv_lora_rank < 0 or any(n < 0 for n in mla):
            raise InvalidArgument(f"{self}: MLA's sizes must be >= 0")
        if self.kv_lora_rank and (min(mla[1:]) < 1 or self.qkv_bias or self.qk_norm):
            raise InvalidArgument(
                f"{self}: multi-head latent attention needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim >= 1 "
                "(and has no q/k/v biases or q/k norms)"
            )
        if not self.kv_lora_rank and any(mla):
            raise InvalidArgument(f"{self}: MLA sizes without kv_lora_rank")
        if self.experts < 0 or self.dense_layers < 0 or self.shared_intermediate < 0:
            raise InvalidArgument(f"{self}: experts, dense_layers and shared_intermediate must be >= 0")
        if self.experts and self.expert_intermediate < 1:
            raise InvalidArgument(f"{self}: a mixture of experts needs expert_intermediate >= 1")
        if not self.experts and (self.expert_intermediate or self.shared_intermediate or self.dense_layers or self.router_bias):
            raise InvalidArgument(f"{self}: expert sizes without experts")
        if self.dense_layers > self.layers:
            raise InvalidArgument(f"{self}: more dense layers than layers")

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention."""
        return self.kv_lora_rank > 0

    def moe(self, layer: int) -> bool:
        """Whether layer ``layer`` is a mixture of experts."""
        return self.experts > 0 and layer >= self.dense_layers

    @classmethod
    def family(cls, family: str, **sizes: int) -> DecoderShape:
        """A shape with ``family``'s switches (Qwen2: q/k/v biases; Qwen3: q/k norms)."""
        return cls(**sizes, qkv_bias=family == "qwen2", qk_norm=family == "qwen3")  # type: ignore[arg-type]  # sizes: the int fields only

    @classmethod
    def from_config(cls, config: Any, family: str) -> DecoderShape:
        """The shape of a Hugging Face config (any object with its attributes): Llama, Qwen2,
        Qwen3, Qwen3-MoE (``num_experts``), DeepSeek-V2/V3 and Kimi-K2 (``n_routed_experts``, MLA).

        Raises:
            InvalidArgument: a config these shapes do not describe (MoE layers that are not
                "every layer after the first k", attention biases with MLA), naming the field.
        """
        c = config
        heads = c.num_attention_heads

        def get(name: str, default: Any = 0) -> Any:  # None and 0 alike
            return getattr(c, name, None) or default

        sizes: dict[str, Any] = dict(
            layers=c.num_hidden_layers, hidden=c.hidden_size, intermediate=c.intermediate_size, heads=heads,
            kv_heads=get("num_key_value_heads", heads), head_dim=get("head_dim", c.hidden_size // heads),
            vocab=c.vocab_size, tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
        )  # fmt: skip
        experts = get("num_experts") or get("n_routed_experts")
        if experts:
            if get("mlp_only_layers", []) or get("decoder_sparse_step", 1) != 1 or get("moe_layer_freq", 1) != 1:
                raise InvalidArgument(
                    f"{type(c).__name__}: mixture-of-experts layers other than every layer after the first "
                    "first_k_dense_replace (mlp_only_layers, decoder_sparse_step, moe_layer_freq) are not described"
                )
            sizes.update(experts=experts, expert_intermediate=c.moe_intermediate_size,
                         shared_intermediate=get("n_shared_experts") * c.moe_intermediate_size,
                         dense_layers=get("first_k_dense_replace"), router_bias=getattr(c, "topk_method", None) == "noaux_tc")  # fmt: skip
        if get("kv_lora_rank"):
            if getattr(c, "attention_bias", False):
                raise InvalidArgument(f"{type(c).__name__}: attention_bias with multi-head latent attention is not described")
            sizes.update(kv_lora_rank=c.kv_lora_rank, q_lora_rank=get("q_lora_rank"), qk_nope_head_dim=c.qk_nope_head_dim,
                         qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, qkv_bias=False, qk_norm=False)  # fmt: skip
        return cls(**sizes)


def hf_tensors(shape: DecoderShape, *, fused_experts: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face's parameter names and global shapes, in ``named_parameters`` order (the
    checkpoint's per-expert tensors; with ``fused_experts``, transformers 5's fused ones)."""
    s = shape
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}"
        if s.mla:
            out += _hf_mla(s, p)
        else:
            out += _hf_attention(s, p)
        if s.moe(i):
            out += _hf_experts(s, p, fused_experts)
        else:
            out += _mlp(f"{p}.mlp", s.intermediate, s.hidden)
        out += [(f"{p}.input_layernorm.weight", (s.hidden,)), (f"{p}.post_attention_layernorm.weight", (s.hidden,))]
    out.append(("model.norm.weight", (s.hidden,)))
    if not s.tie_embeddings:
        out.append(("lm_head.weight", (s.vocab, s.hidden)))
    return out


def _hf_attention(s: DecoderShape, p: str) -> list[tuple[str, tuple[int, ...]]]:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [
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
    return out


def _hf_mla(s: DecoderShape, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face's DeepSeek attention tensors, in ``named_parameters`` order."""
    a, qk = f"{p}.self_attn", s.heads * (s.qk_nope_head_dim + s.qk_rope_head_dim)
    out: list[tuple[str, tuple[int, ...]]] = []
    if s.q_lora_rank:
        out += [(f"{a}.q_a_proj.weight", (s.q_lora_rank, s.hidden)), (f"{a}.q_a_layernorm.weight", (s.q_lora_rank,)),
                (f"{a}.q_b_proj.weight", (qk, s.q_lora_rank))]  # fmt: skip
    else:
        out.append((f"{a}.q_proj.weight", (qk, s.hidden)))
    return out + [
        (f"{a}.kv_a_proj_with_mqa.weight", (s.kv_lora_rank + s.qk_rope_head_dim, s.hidden)),
        (f"{a}.kv_a_layernorm.weight", (s.kv_lora_rank,)),
        (f"{a}.kv_b_proj.weight", (s.heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)),
        (f"{a}.o_proj.weight", (s.hidden, s.heads * s.v_head_dim)),
    ]


def _mlp(prefix: str, width: int, hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"{prefix}.gate_proj.weight", (width, hidden)), (f"{prefix}.up_proj.weight", (width, hidden)),
            (f"{prefix}.down_proj.weight", (hidden, width))]  # fmt: skip


def _hf_experts(s: DecoderShape, p: str, fused: bool) -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = [(f"{p}.mlp.gate.weight", (s.experts, s.hidden))]
    if s.router_bias:
        out.append((f"{p}.mlp.gate.e_score_correction_bias", (s.experts,)))
    e, w, h = s.experts, s.expert_intermediate, s.hidden
    if fused:  # transformers 5's Qwen3MoeExperts / DeepseekV3NaiveMoe: gate_up_proj, then down_proj
        out += [(f"{p}.mlp.experts.gate_up_proj", (e, 2 * w, h)), (f"{p}.mlp.experts.down_proj", (e, h, w))]
    else:
        for i in range(e):
            out += _mlp(f"{p}.mlp.experts.{i}", w, h)
    if s.shared_intermediate:
        out += _mlp(f"{p}.mlp.shared_experts", s.shared_intermediate, s.hidden)
    return out


def _expert_of(name: str) -> int | str | None:
    """The routed expert a Hugging Face tensor belongs to (``...mlp.experts.{e}...``), ``"all"``
    for a fused tensor of every expert (``...mlp.experts.gate_up_proj``), else None."""
    head, sep, tail = name.partition(".mlp.experts.")
    if not sep:
        return None
    index = tail.split(".", 1)[0]
    return int(index) if index.isdecimal() else "all"


def hf_layout(
    shape: DecoderShape, shards: int, dtype: str = "bfloat16", *, ep: int = 1, fused_experts: bool = False
) -> ReplicaLayout:
    """The trainer's layout: :func:`hf_placements` (every tensor FSDP-sharded over all ``shards``)
    or, with ``ep`` > 1, the routed experts on their own mesh: ``ep`` expert-parallel groups of
    ``shards / ep`` consecutive ranks, group ``g`` holding experts ``g x E/ep`` to
    ``(g + 1) x E/ep - 1``, each sharded along dim 0 over its group's ranks only (with
    ``fused_experts``: the fused tensors ``Shard(0)`` over the mesh ``(ep, shards / ep)``, the
    same experts on the same ranks).

    Raises:
        InvalidArgument: ``ep`` does not divide the ranks and the experts.
    """
    if ep == 1:
        return ReplicaLayout.spmd(hf_placements(shape, shards, dtype, fused_experts=fused_experts), shards)
    if ep < 1 or shards % ep or not shape.experts or shape.experts % ep:
        raise InvalidArgument(f"{ep} expert-parallel groups need to divide the {shards} ranks and the {shape.experts} experts")
    fsdp, per_group = shards // ep, shape.experts // ep
    rows: list[list[PlacedTensor]] = [[] for _ in range(shards)]
    for name, dims in hf_tensors(shape, fused_experts=fused_experts):
        e = _expert_of(name)
        if e == "all":  # every expert in one tensor: group g's experts, sharded over its ranks
            t = TensorPlacement(name, dtype, dims, (ep, fsdp), (0, 0))
            for r in range(shards):
                rows[r].append(PlacedTensor(t, (r // fsdp, r % fsdp)))
            continue
        if e is None:
            t = TensorPlacement(name, dtype, dims, (shards,), (0,))
            for r in range(shards):
                rows[r].append(PlacedTensor(t, (r,)))
            continue
        t = TensorPlacement(name, dtype, dims, (fsdp,), (0,))
        assert isinstance(e, int)
        g = e // per_group
        for f in range(fsdp):
            rows[g * fsdp + f].append(PlacedTensor(t, (f,)))
    return ReplicaLayout(tuple(tuple(r) for r in rows))


def hf_placements(
    shape: DecoderShape, shards: int, dtype: str = "bfloat16", dim: int = 0, *, fused_experts: bool = False
) -> list[TensorPlacement]:
    """The trainer's tensors, each ``Shard(dim)`` over ``shards`` shards (FSDP: dim 0);
    1-D tensors are sharded along their only dimension."""
    return [
        TensorPlacement(name, dtype, dims, (shards,), (min(dim, len(dims) - 1),))
        for name, dims in hf_tensors(shape, fused_experts=fused_experts)
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
    fused_experts: bool = False,
) -> list[TensorPlacement]:
    """An inference engine's tensors under vLLM's names and tensor parallelism over ``tp`` ranks
    (with ``expert_parallel``, the routed experts whole, ``experts / tp`` per rank).

    ``fused_experts`` describes the routed experts' ``w13_weight``/``w2_weight`` in vLLM's 3-D
    shape (``[experts, 2 x width, hidden]``, ``[experts, hidden, width]``), for a trainer holding
    transformers 5's fused ``gate_up_proj``/``down_proj`` (see the module's docstring); without
    it they are flattened to 2-D, for per-expert checkpoint names.

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
    if fused_experts and fp8 and s.experts:
        raise InvalidArgument(f"{s}: block FP8 quantizes 2-D weights: fused (3-D) experts cannot be FP8 here")
    ranks = dp * tp
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    dense = s.experts == 0 or s.dense_layers > 0
    kv_split = not s.mla and s.kv_heads % tp and tp % s.kv_heads
    if s.heads % tp or kv_split or (dense and s.intermediate % tp) or s.vocab % 64 or s.vocab % tp:
        raise InvalidArgument(
            f"vLLM cannot shard {s} over {tp} ranks (heads, KV heads, intermediate size, vocabulary / 64)"
        )
    widths: tuple[int, ...]
    if s.mla:  # each rank's rows of q_b/q_proj and kv_b, its columns of o_proj; fused_qkv_a's q part
        local = s.heads // tp
        widths = (local * (s.qk_nope_head_dim + s.qk_rope_head_dim), local * (s.qk_nope_head_dim + s.v_head_dim),
                  local * s.v_head_dim, s.q_lora_rank)  # fmt: skip
    else:
        widths = (s.head_dim, q // tp)
    if fp8 and (any(w % block for w in widths) or (dense and (s.intermediate // tp) % block)):
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
        if s.router_bias:  # float32 in vLLM whatever the model's dtype
            out.append(TensorPlacement(f"{p}.mlp.gate.e_score_correction_bias", "float32", (e,), mesh, rep))
        routed = f"{p}.mlp.experts.routed_experts"
        if fused_experts:  # vLLM's own 3-D parameters
            if expert_parallel:
                return out + [TensorPlacement(f"{routed}.w13_weight", wdtype, (e, 2 * w, h), (ranks,), (0,)),
                              TensorPlacement(f"{routed}.w2_weight", wdtype, (e, h, w), (ranks,), (0,))] + shared_experts(p)  # fmt: skip
            across = (REPLICATE,) * (len(mesh) - 1)  # tensor parallelism: the last mesh dimension
            return out + [TensorPlacement(f"{routed}.w13_weight", wdtype, (e, 2 * w, h), mesh, (*across, 1), (w, w), 1),
                          TensorPlacement(f"{routed}.w2_weight", wdtype, (e, h, w), mesh, (*across, 2))] + shared_experts(p)  # fmt: skip
        if expert_parallel:  # rank r: experts r*E/ranks ... whole
            out += stacked(f"{routed}.w13_weight", (e * 2 * w, h), (0,), (), (ranks,))
            out += stacked(f"{routed}.w2_weight", (e * h, w), (0,), (), (ranks,))
        else:  # every rank: its slice of every expert's gate and up rows, and of its down columns
            out += stacked(f"{routed}.w13_weight", (e * 2 * w, h), col, (w,) * (2 * e), mesh)
            out += stacked(f"{routed}.w2_weight", (e * h, w), row, (), mesh)
        return out + shared_experts(p)

    def shared_experts(p: str) -> list[TensorPlacement]:
        if not s.shared_intermediate:
            return []
        n, h = s.shared_intermediate, s.hidden
        return linear(f"{p}.mlp.shared_experts.gate_up_proj", (2 * n, h), col, (n, n)) + linear(
            f"{p}.mlp.shared_experts.down_proj", (h, n), row
        )

    def attention(p: str) -> list[TensorPlacement]:
        out = linear(f"{p}.self_attn.qkv_proj", (q + 2 * kv, s.hidden), col, (q, kv, kv), s.head_dim)
        if s.qkv_bias:
            out.append(
                TensorPlacement(
                    f"{p}.self_attn.qkv_proj.bias", dtype, (q + 2 * kv,), mesh, col, (q, kv, kv), 0, s.head_dim
                )
            )
        out += linear(f"{p}.self_attn.o_proj", (s.hidden, q), row)
        if s.qk_norm:
            out += [TensorPlacement(f"{p}.self_attn.{n}_norm.weight", dtype, (s.head_dim,), mesh, rep) for n in "qk"]
        return out

    def mla(p: str) -> list[TensorPlacement]:
        a, h = f"{p}.self_attn", s.hidden
        qk, kv_b = s.heads * (s.qk_nope_head_dim + s.qk_rope_head_dim), s.heads * (s.qk_nope_head_dim + s.v_head_dim)
        kv_a = s.kv_lora_rank + s.qk_rope_head_dim
        if s.q_lora_rank:  # q_a and kv_a fused, the same on every rank
            out = linear(f"{a}.fused_qkv_a_proj", (s.q_lora_rank + kv_a, h), rep)
            out.append(TensorPlacement(f"{a}.q_a_layernorm.weight", dtype, (s.q_lora_rank,), mesh, rep))
            out += linear(f"{a}.q_b_proj", (qk, s.q_lora_rank), col)
        else:
            out = linear(f"{a}.q_proj", (qk, h), col) + linear(f"{a}.kv_a_proj_with_mqa", (kv_a, h), rep)
        out.append(TensorPlacement(f"{a}.kv_a_layernorm.weight", dtype, (s.kv_lora_rank,), mesh, rep))
        out += linear(f"{a}.kv_b_proj", (kv_b, s.kv_lora_rank), col)
        return out + linear(f"{a}.o_proj", (h, s.heads * s.v_head_dim), row)

    out = [TensorPlacement("model.embed_tokens.weight", dtype, (s.vocab, s.hidden), mesh, col)]
    for i in range(s.layers):
        p = f"model.layers.{i}"
        out += mla(p) if s.mla else attention(p)
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
