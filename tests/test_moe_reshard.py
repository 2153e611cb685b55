"""Mixtures of experts through the presets: a Hugging Face trainer's per-expert tensors (FSDP over
every rank, or expert-parallel x FSDP as in the Perplexity write-up) into vLLM's stacked
``w13_weight`` / ``w2_weight`` (tensor-parallel slices of every expert, or whole experts per rank),
bf16 and block FP8, planned by the production planner and converted by the real converter.

The reference is written from vLLM's ``FusedMoE`` loading rules, not from the mapping: ``w13[e]``
is expert ``e``'s ``gate_proj`` rows then its ``up_proj`` rows (a rank's chunk of each under tensor
parallelism), ``w2[e]`` its ``down_proj`` (a rank's chunk of the columns); with expert parallelism
rank ``r`` holds experts ``r * E / tp ...`` whole; FP8 scales are each expert's own block scales,
stacked the same way.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tensorhub.core.errors import InvalidArgument, MappingMismatch
from tensorhub.core.placement import ReplicaLayout
from tensorhub.scheduling.decoders import DecoderShape, hf_layout, hf_tensors, vllm_placements
from tensorhub.scheduling.mapping import Fuse, Mapping, preset, resolve
from tensorhub.scheduling.reshard import plan

from .reshard_ref import convert_poisoned, random_full, reference_quant, same_bytes

pytestmark = pytest.mark.timeout(120)

# Qwen3-MoE-like (no shared expert) and DeepSeek-V3-like (a dense first layer, a shared expert,
# the router's score-correction bias); attention is grouped-query in both.
QWEN3_MOE = DecoderShape(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=128, vocab=128,
                         qk_norm=True, experts=4, expert_intermediate=256)  # fmt: skip
DEEPSEEK = DecoderShape(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=128, vocab=128,
                        experts=4, expert_intermediate=256, shared_intermediate=512, dense_layers=1,
                        router_bias=True)  # fmt: skip


def vllm_experts(full: dict[str, torch.Tensor], layer: int, experts: int, fp8: bool) -> dict[str, torch.Tensor]:
    """vLLM's 3-D ``w13_weight``/``w2_weight`` (and FP8 scales) of one layer, whole, from the
    Hugging Face tensors: each expert's gate then up rows; its down projection."""
    p = f"model.layers.{layer}.mlp.experts"
    out: dict[str, list[torch.Tensor]] = {"w13_weight": [], "w2_weight": [], "w13_weight_scale_inv": [], "w2_weight_scale_inv": []}
    for e in range(experts):
        gate, up, down = (full[f"{p}.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
        if not fp8:
            out["w13_weight"].append(torch.cat([gate, up]))
            out["w2_weight"].append(down)
            continue
        (gq, gs), (uq, us), (dq, ds) = (reference_quant(t) for t in (gate, up, down))
        out["w13_weight"].append(torch.cat([gq, uq]))
        out["w13_weight_scale_inv"].append(torch.cat([gs, us]))
        out["w2_weight"].append(dq)
        out["w2_weight_scale_inv"].append(ds)
    return {k: torch.stack(v) for k, v in out.items() if v}


def rank_slice(name: str, whole: torch.Tensor, rank: int, tp: int, expert_parallel: bool) -> torch.Tensor:
    """What vLLM's ``FusedMoE`` weight loader puts on ``rank`` of ``tp`` (3-D)."""
    if expert_parallel:
        n = whole.shape[0] // tp
        return whole[rank * n : (rank + 1) * n]
    if name.startswith("w13"):  # gate and up halves, each chunked over the ranks
        half = whole.shape[1] // 2
        c = half // tp
        return torch.cat([whole[:, rank * c : (rank + 1) * c], whole[:, half + rank * c : half + (rank + 1) * c]], 1)
    c = whole.shape[2] // tp  # w2: the columns (the expert's width)
    return whole[:, :, rank * c : (rank + 1) * c]


def convert(src: ReplicaLayout, dst: ReplicaLayout, mapping: Mapping, seed: int) -> tuple[dict, dict[int, dict]]:
    full = random_full(src, torch.Generator().manual_seed(seed))
    return full, convert_poisoned(plan(src, dst, mapping), src, full)


@pytest.mark.parametrize(
    "shape, tp, dp, expert_parallel, fp8",
    [
        (QWEN3_MOE, 2, 1, False, False),
        (QWEN3_MOE, 4, 1, True, False),
        (QWEN3_MOE, 2, 1, False, True),
        (QWEN3_MOE, 2, 1, True, True),
        (DEEPSEEK, 2, 1, True, False),
        (DEEPSEEK, 4, 1, True, True),
        (DEEPSEEK, 2, 2, True, False),
    ],
    ids=["qwen3-moe-tp2", "qwen3-moe-ep4", "qwen3-moe-tp2-fp8", "qwen3-moe-ep2-fp8", "deepseek-ep2", "deepseek-ep4-fp8",
         "deepseek-dp2-tp2-ep4"],  # fmt: skip
)
def test_hugging_face_experts_land_as_vllm_stacks_them(shape, tp, dp, expert_parallel, fp8, seed):
    """(With ``dp``: vLLM's data-parallel attention, experts over all ``dp x tp`` ranks, every
    other tensor cut by ``tp`` within each data-parallel group.)"""
    ranks = tp * dp
    src = hf_layout(shape, 3)
    dst = ReplicaLayout.spmd(vllm_placements(shape, tp, fp8=fp8, expert_parallel=expert_parallel, dp=dp), ranks)
    full, got = convert(src, dst, preset("qwen3", fp8=fp8), seed)
    moe_layers = [i for i in range(shape.layers) if shape.moe(i)]
    assert moe_layers
    for i in moe_layers:
        whole = vllm_experts(full, i, shape.experts, fp8)
        for name, w in whole.items():
            for r in range(ranks):
                want = rank_slice(name, w, r, ranks, expert_parallel)
                have = got[r][f"model.layers.{i}.mlp.experts.routed_experts.{name}"]
                assert have.dtype == want.dtype and have.numel() == want.numel(), (name, r)
                assert same_bytes(have.reshape(want.shape), want), f"layer {i} {name} rank {r} (seed {seed})"
        for r in range(ranks):  # the router is whole on every rank
            assert same_bytes(got[r][f"model.layers.{i}.mlp.gate.weight"], full[f"model.layers.{i}.mlp.gate.weight"])
    if shape.shared_intermediate:  # the shared experts fuse like a dense MLP, tensor-parallel
        i, n = moe_layers[0], shape.shared_intermediate // tp
        gate, up = (full[f"model.layers.{i}.mlp.shared_experts.{k}_proj.weight"] for k in ("gate", "up"))
        for rank in range(ranks):
            r = rank % tp  # its tensor-parallel rank: the same slice in every data-parallel group
            have = got[rank][f"model.layers.{i}.mlp.shared_experts.gate_up_proj.weight"]
            if fp8:
                want = torch.cat([reference_quant(gate[r * n : (r + 1) * n])[0], reference_quant(up[r * n : (r + 1) * n])[0]])
            else:
                want = torch.cat([gate[r * n : (r + 1) * n], up[r * n : (r + 1) * n]])
            assert same_bytes(have, want), f"shared experts rank {rank} (seed {seed})"


@pytest.mark.parametrize("ep", [2, 4])
def test_experts_on_their_own_mesh_are_read_from_their_group_only(ep, seed):
    """Expert-parallel x FSDP on the trainer: group ``g`` of ``8 / ep`` ranks holds experts
    ``g * 4 / ep ...``, each sharded over the group only; every other tensor over all 8 ranks."""
    src = hf_layout(QWEN3_MOE, 8, ep=ep)
    fsdp, per_group = 8 // ep, QWEN3_MOE.experts // ep
    for r, tensors in enumerate(src.shards):
        experts = {int(pt.name.split(".mlp.experts.")[1].split(".")[0]) for pt in tensors if ".mlp.experts." in pt.name}
        assert experts == set(range((r // fsdp) * per_group, (r // fsdp + 1) * per_group))
    src.check_complete()
    dst = ReplicaLayout.spmd(vllm_placements(QWEN3_MOE, 2, expert_parallel=True), 2)
    p = plan(src, dst, preset("qwen3"))
    for sp in p.shards:
        for t in sp.tasks:
            if ".mlp.experts." in t.source:
                e = int(t.source.split(".mlp.experts.")[1].split(".")[0])
                group = range((e // per_group) * fsdp, (e // per_group + 1) * fsdp)
                assert all(rd.shard in group for rd in t.reads), (t.source, [rd.shard for rd in t.reads])
    full, got = convert(src, dst, preset("qwen3"), seed)
    whole = vllm_experts(full, 1, QWEN3_MOE.experts, False)
    for r in range(2):
        have = got[r]["model.layers.1.mlp.experts.routed_experts.w13_weight"]
        assert same_bytes(have.reshape(2, -1, QWEN3_MOE.hidden), whole["w13_weight"][2 * r : 2 * r + 2])


def test_stacking_orders_experts_by_number_not_by_name():
    shape = DecoderShape(layers=1, hidden=8, intermediate=16, heads=1, kv_heads=1, head_dim=8, vocab=64, experts=12,
                         expert_intermediate=4)  # fmt: skip
    src = hf_layout(shape, 1).tensors()
    dst = ReplicaLayout.spmd(vllm_placements(shape, 1), 1).tensors()
    d = resolve(preset("llama"), src, dst)["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    order = [p.source.split(".mlp.experts.")[1] for p in d.parts]
    assert order[:4] == ["0.gate_proj.weight", "0.up_proj.weight", "1.gate_proj.weight", "1.up_proj.weight"]
    assert order[-2:] == ["11.gate_proj.weight", "11.up_proj.weight"]  # "10" and "11" after "9"
    assert [p.start for p in d.parts] == [4 * k for k in range(24)] and d.shape == (96, 8)


def test_a_missing_or_misnumbered_expert_is_named_before_any_byte_moves():
    src = dict(hf_layout(QWEN3_MOE, 1).tensors())
    dst = ReplicaLayout.spmd(vllm_placements(QWEN3_MOE, 1), 1).tensors()
    gone = src.pop("model.layers.0.mlp.experts.2.up_proj.weight")
    with pytest.raises(MappingMismatch, match=r"experts\.2\.up_proj") as info:
        resolve(preset("qwen3"), src, dst)
    assert "model.layers.0.mlp.experts.2.up_proj.weight" in info.value.tensors
    # experts 0, 1, 3 only: the gap is named, not closed up
    src = dict(hf_layout(QWEN3_MOE, 1).tensors())
    for n in ("gate", "up", "down"):
        src.pop(f"model.layers.1.mlp.experts.2.{n}_proj.weight")
    with pytest.raises(MappingMismatch, match=r"layers\.1\.mlp\.experts\.2\.gate_proj"):
        resolve(preset("qwen3"), src, dst)
    # an index that is not a number
    src = dict(hf_layout(QWEN3_MOE, 1).tensors())
    src["model.layers.0.mlp.experts.x.down_proj.weight"] = gone
    with pytest.raises(MappingMismatch, match="not numbers"):
        resolve(preset("qwen3"), src, dst)


def test_bad_stacking_rules_and_shapes_are_refused_with_typed_errors():
    with pytest.raises(InvalidArgument, match="not captured"):
        Fuse("w13", ("l.{i}.e.{e}.gate",), stack="k")
    with pytest.raises(InvalidArgument, match="may not use the stacked capture"):
        Fuse("l.{i}.w13.{e}", ("l.{i}.e.{e}.gate",), stack="e")
    with pytest.raises(InvalidArgument, match="stack must be"):
        Fuse("l.{i}.w13", ("l.{i}.e.{e}.gate",), stack=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="expert_intermediate"):
        DecoderShape(layers=1, hidden=8, intermediate=16, heads=1, kv_heads=1, head_dim=8, vocab=64, experts=4)
    with pytest.raises(InvalidArgument, match="without experts"):
        DecoderShape(layers=1, hidden=8, intermediate=16, heads=1, kv_heads=1, head_dim=8, vocab=64, dense_layers=1)
    with pytest.raises(InvalidArgument, match="data-parallel attention"):
        vllm_placements(QWEN3_MOE, 2, dp=2)
    with pytest.raises(InvalidArgument, match="4 experts over 8"):
        vllm_placements(QWEN3_MOE, 4, expert_parallel=True, dp=2)
    with pytest.raises(InvalidArgument, match="6 experts"):
        vllm_placements(dataclasses.replace(QWEN3_MOE, experts=6), 4, expert_parallel=True)
    with pytest.raises(InvalidArgument, match="expert-parallel groups"):
        hf_layout(QWEN3_MOE, 6, ep=4)


def test_hugging_face_names_of_a_deepseek_shaped_layer():
    names = [n for n, _ in hf_tensors(DEEPSEEK)]
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense first layer
    assert "model.layers.0.mlp.gate.weight" not in names
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"} <= set(names)  # fmt: skip
