"""The tensors of a Hugging Face decoder (Llama, Qwen2, Qwen3) on both sides of a resharded job.

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
than padded. Mixture-of-experts layers (vLLM
stacks the experts into ``w13_weight``/``w2_weight``) are not described. No IO.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorhub.core.errors import InvalidArgument
from tensorhub.core.placement import REPLICATE, TensorPlacement

from .mapping import SCALE_DTYPE, scale_shape

__all__ = ["DecoderShape", "hf_placements", "hf_tensors", "vllm_placements"]


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
        out += [
            (f"{p}.mlp.gate_proj.weight", (s.intermediate, s.hidden)),
            (f"{p}.mlp.up_proj.weight", (s.intermediate, s.hidden)),
            (f"{p}.mlp.down_proj.weight", (s.hidden, s.intermediate)),
            (f"{p}.input_layernorm.weight", (s.hidden,)),
            (f"{p}.post_attention_layernorm.weight", (s.hidden,)),
        ]
    out.append(("model.norm.weight", (s.hidden,)))
    if not s.tie_embeddings:
        out.append(("lm_head.weight", (s.vocab, s.hidden)))
    return out


def hf_placements(shape: DecoderShape, shards: int, dtype: str = "bfloat16", dim: int = 0) -> list[TensorPlacement]:
    """The trainer's tensors, each ``Shard(dim)`` over ``shards`` shards (FSDP: dim 0);
    1-D tensors are sharded along their only dimension."""
    return [
        TensorPlacement(name, dtype, dims, (shards,), (min(dim, len(dims) - 1),)) for name, dims in hf_tensors(shape)
    ]


def vllm_placements(
    shape: DecoderShape, tp: int, dtype: str = "bfloat16", *, fp8: bool = False, block: int = 128
) -> list[TensorPlacement]:
    """An inference engine's tensors under vLLM's names and tensor parallelism over ``tp`` ranks.

    Raises:
        InvalidArgument: sizes vLLM's tensor parallelism (or its block FP8) could not shard.
    """
    s = shape
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    if s.heads % tp or (s.kv_heads % tp and tp % s.kv_heads) or s.intermediate % tp or s.vocab % 64 or s.vocab % tp:
        raise InvalidArgument(
            f"vLLM cannot shard {s} over {tp} ranks (heads, KV heads, intermediate size, vocabulary / 64)"
        )
    if fp8 and (s.head_dim % block or (q // tp) % block or (s.intermediate // tp) % block):
        raise InvalidArgument(
            f"block FP8 needs every rank's rows and columns in whole {block}-blocks: {s} over {tp} ranks"
        )
    mesh, col, row, rep = (tp,), (0,), (1,), (REPLICATE,)
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
