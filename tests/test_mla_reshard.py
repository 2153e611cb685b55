"""Multi-head latent attention through the presets: a Hugging Face DeepSeek-V3 / Kimi-K2 trainer's
``q_a_proj``, ``kv_a_proj_with_mqa``, ``q_b_proj``, ``kv_b_proj``, ``o_proj`` and latent norms into
vLLM's ``DeepseekV2MLAAttention`` (bf16 and block FP8, tensor-parallel and data-parallel
attention), planned by the production planner and converted by the real converter.

The reference is written from vLLM's loading rules, not from the mapping: ``fused_qkv_a_proj`` is
a ``MergedColumnParallelLinear`` with ``disable_tp`` (every rank holds ``q_a_proj``'s rows then
``kv_a_proj_with_mqa``'s, whole); ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` are column-parallel
(rank ``r`` holds the ``r``-th chunk of the rows), ``o_proj`` row-parallel (the ``r``-th chunk of
the columns); FP8 weights are the checkpoint's per-tensor block quantization, sliced the same way
(the blocks' scales with them).
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from tensorhub.core.errors import InvalidArgument
from tensorhub.core.placement import ReplicaLayout
from tensorhub.scheduling.decoders import DecoderShape, hf_layout, hf_tensors, vllm_placements
from tensorhub.scheduling.mapping import FAMILIES, preset
from tensorhub.scheduling.reshard import plan

from .reshard_ref import convert_poisoned, random_full, reference_quant, same_bytes

pytestmark = pytest.mark.timeout(120)

# DeepSeek-V3-shaped: MLA (a compressed query; a latent KV of 128 plus 64 rotary dims: 192 rows,
# a block and a half), a dense first layer, routed experts, a shared expert, the router's bias.
MLA = DecoderShape(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=4, head_dim=128, vocab=128,
                   experts=4, expert_intermediate=128, shared_intermediate=256, dense_layers=1, router_bias=True,
                   kv_lora_rank=128, q_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)  # fmt: skip
NO_Q_LORA = dataclasses.replace(MLA, q_lora_rank=0)  # DeepSeek-V2-Lite's queries: one q_proj


def want(name: str, full: dict[str, torch.Tensor], r: int, tp: int, fp8: bool) -> dict[str, torch.Tensor]:
    """What vLLM's loaders put on tensor-parallel rank ``r`` for attention tensor ``name``
    (``{layer}.self_attn.X``, vLLM's name): the weight, and with FP8 its scales."""
    head, _, module = name.rpartition(".")
    hf = lambda n: full[f"{head}.{n}.weight"]  # noqa: E731 - a name lookup

    def quant(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return reference_quant(t) if fp8 else (t, torch.empty(0))

    if module == "fused_qkv_a_proj":  # replicated: q_a's rows then kv_a's, each quantized on its own
        (qa, qs), (ka, ks) = quant(hf("q_a_proj")), quant(hf("kv_a_proj_with_mqa"))
        w, s = torch.cat([qa, ka]), torch.cat([qs, ks])
    elif module == "kv_a_proj_with_mqa":  # replicated
        w, s = quant(hf(module))
    elif module in ("q_b_proj", "q_proj", "kv_b_proj"):  # column-parallel: a chunk of the rows
        w, s = quant(hf(module))
        w = w.chunk(tp)[r]
        s = s.chunk(tp)[r] if fp8 else s
    else:  # o_proj, row-parallel: a chunk of the columns
        w, s = quant(hf(module))
        w = w.chunk(tp, 1)[r]
        s = s.chunk(tp, 1)[r] if fp8 else s
    out = {f"{name}.weight": w}
    if fp8:
        out[f"{name}.weight_scale_inv"] = s
    return out


@pytest.mark.parametrize(
    "shape, tp, dp, fp8",
    [(MLA, 2, 1, False), (MLA, 2, 1, True), (MLA, 1, 2, True), (NO_Q_LORA, 2, 1, True)],
    ids=["tp2", "tp2-fp8", "dp2-attention-fp8", "no-q-lora-tp2-fp8"],
)
def test_hugging_face_mla_lands_as_vllm_loads_it(shape, tp, dp, fp8, seed):
    ranks = tp * dp
    src = hf_layout(shape, 3)
    dst = ReplicaLayout.spmd(vllm_placements(shape, tp, fp8=fp8, expert_parallel=True, dp=dp), ranks)
    full = random_full(src, torch.Generator().manual_seed(seed))
    got = convert_poisoned(plan(src, dst, preset("deepseek_v3", fp8=fp8)), src, full)
    modules = ["fused_qkv_a_proj", "q_b_proj"] if shape.q_lora_rank else ["q_proj", "kv_a_proj_with_mqa"]
    for i in range(shape.layers):
        a = f"model.layers.{i}.self_attn"
        for rank in range(ranks):
            r = rank % tp  # its tensor-parallel rank: the same slice in every data-parallel group
            for module in (*modules, "kv_b_proj", "o_proj"):
                for name, w in want(f"{a}.{module}", full, r, tp, fp8).items():
                    have = got[rank][name]
                    assert have.dtype == w.dtype and have.shape == w.shape, (name, rank, have.shape, w.shape)
                    assert same_bytes(have, w), f"{name} rank {rank} (seed {seed})"
            norms = ["kv_a_layernorm"] + (["q_a_layernorm"] if shape.q_lora_rank else [])
            for norm in norms:
                assert same_bytes(got[rank][f"{a}.{norm}.weight"], full[f"{a}.{norm}.weight"]), (norm, rank)
    # vLLM keeps the router's score-correction bias in float32: cast from the trainer's bf16
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert got[0][bias].dtype == torch.float32
    assert torch.equal(got[0][bias], full[bias].float())


def test_mla_names_and_shapes_follow_hugging_face():
    """The trainer's attention tensors as ``DeepseekV3ForCausalLM.state_dict()`` lists them (checked
    once against transformers 5.24 with the config of tests/test_vllm_backend.py); vLLM's are the
    fused and cut ones, and no GQA name is left on either side."""
    names = dict(hf_tensors(MLA))
    a = "model.layers.0.self_attn"
    assert names[f"{a}.q_a_proj.weight"] == (128, 256)
    assert names[f"{a}.q_b_proj.weight"] == (4 * 128, 128)
    assert names[f"{a}.kv_a_proj_with_mqa.weight"] == (128 + 64, 256)
    assert names[f"{a}.kv_b_proj.weight"] == (4 * 128, 128)
    assert names[f"{a}.o_proj.weight"] == (256, 4 * 64)
    assert not any(k.endswith(("k_proj.weight", "v_proj.weight")) for k in names)
    assert f"{a}.q_proj.weight" in dict(hf_tensors(NO_Q_LORA)) and f"{a}.q_a_proj.weight" not in dict(hf_tensors(NO_Q_LORA))
    engine = {p.name: p for p in vllm_placements(MLA, 2)}
    assert engine[f"{a}.fused_qkv_a_proj.weight"].shape == (128 + 128 + 64, 256)
    assert not any("qkv_proj" in k and "fused" not in k for k in engine)
    assert "deepseek_v3" in FAMILIES


def test_mla_shapes_vllm_cannot_serve_are_refused():
    with pytest.raises(InvalidArgument, match="MLA sizes without kv_lora_rank"):
        dataclasses.replace(MLA, kv_lora_rank=0)
    with pytest.raises(InvalidArgument, match="multi-head latent attention needs"):
        dataclasses.replace(MLA, v_head_dim=0)
    with pytest.raises(InvalidArgument, match="multi-head latent attention needs"):
        dataclasses.replace(MLA, qk_norm=True)
    with pytest.raises(InvalidArgument, match="cannot shard"):
        vllm_placements(MLA, 8)  # 4 heads over 8 ranks
    # FP8: a query rank that splits a block, and heads whose per-rank rows split one
    with pytest.raises(InvalidArgument, match="whole 128-blocks"):
        vllm_placements(dataclasses.replace(MLA, q_lora_rank=64), 2, fp8=True)
    with pytest.raises(InvalidArgument, match="whole 128-blocks"):
        vllm_placements(MLA, 4, fp8=True)  # one head per rank: 128 rows of q_b, but 64 columns of o_proj


def _config(**fields):  # a Hugging Face config's attributes (transformers costs seconds to import)
    return types.SimpleNamespace(**fields)


# the attributes of tests/test_vllm_backend.py's DeepseekV3Config and of a Qwen3MoeConfig; the
# shapes they give were checked once against transformers 5.24's models built on the meta device
# (every tensor but the routed experts, which transformers 5 keeps fused: see the module docstring
# of tensorhub.scheduling.decoders)
DEEPSEEK_V3 = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=4, head_dim=64, vocab_size=512, tie_word_embeddings=False,
                   n_routed_experts=4, moe_intermediate_size=128, n_shared_experts=1, first_k_dense_replace=1,
                   moe_layer_freq=1, topk_method="noaux_tc", q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=64,
                   qk_rope_head_dim=64, v_head_dim=64, attention_bias=False)  # fmt: skip
QWEN3_MOE = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, vocab_size=512, tie_word_embeddings=False, num_experts=4, moe_intermediate_size=128,
                 decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip


def test_shapes_read_from_hugging_face_configs():
    ds = DecoderShape.from_config(_config(**DEEPSEEK_V3), "deepseek_v3")
    assert (ds.experts, ds.expert_intermediate, ds.shared_intermediate, ds.dense_layers, ds.router_bias) == (4, 128, 128, 1, True)
    assert (ds.kv_lora_rank, ds.q_lora_rank, ds.qk_nope_head_dim, ds.qk_rope_head_dim, ds.v_head_dim) == (512, 64, 64, 64, 64)
    names = dict(hf_tensors(ds))
    assert names["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (576, 256)
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    lite = DecoderShape.from_config(_config(**{**DEEPSEEK_V3, "q_lora_rank": None}), "deepseek_v3")
    assert lite.q_lora_rank == 0 and "model.layers.0.self_attn.q_proj.weight" in dict(hf_tensors(lite))
    qm = DecoderShape.from_config(_config(**QWEN3_MOE), "qwen3")
    assert (qm.experts, qm.expert_intermediate, qm.dense_layers, qm.qk_norm, qm.mla) == (4, 128, 0, True, False)
    dense = DecoderShape.from_config(_config(**{k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}), "qwen3")
    assert dense.experts == 0 and dense.moe(1) is False
    with pytest.raises(InvalidArgument, match="mlp_only_layers"):
        DecoderShape.from_config(_config(**{**QWEN3_MOE, "mlp_only_layers": [0]}), "qwen3")
    with pytest.raises(InvalidArgument, match="attention_bias"):
        DecoderShape.from_config(_config(**{**DEEPSEEK_V3, "attention_bias": True}), "deepseek_v3")
