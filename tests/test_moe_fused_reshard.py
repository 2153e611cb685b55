"""Transformers 5's fused experts through the presets: a trainer publishing ``named_parameters()``
of a loaded Qwen3-MoE or DeepSeek-V3 model holds ``mlp.experts.gate_up_proj`` ``[E, 2W, H]`` and
``mlp.experts.down_proj`` ``[E, H, W]`` (not the checkpoint's per-expert tensors). The preset
renames them to vLLM's ``w13_weight``/``w2_weight``, whose 3-D layout they already have, and the
production planner and converter move them with their 3-D placements kept: FSDP over the experts
or expert-parallel x FSDP on the trainer; tensor-parallel slices of every expert (``w13`` packed
along dim 1: each rank's chunk of the gate rows, then of the up rows) or whole experts per rank
on the engine.

The reference is written from vLLM's ``FusedMoE`` loading rules (:func:`rank_slice`), applied to
the fused tensor, which is ``w13``/``w2`` whole.
"""

from __future__ import annotations

import pytest
import torch

from tensorhub.core.errors import InvalidArgument, MappingMismatch
from tensorhub.core.placement import ReplicaLayout
from tensorhub.scheduling.decoders import hf_layout, hf_tensors, vllm_placements
from tensorhub.scheduling.mapping import preset, resolve
from tensorhub.scheduling.reshard import plan

from .reshard_ref import convert_poisoned, random_full, same_bytes
from .test_moe_reshard import DEEPSEEK, QWEN3_MOE, rank_slice

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "shape, shards, ep, tp, dp, expert_parallel",
    [(QWEN3_MOE, 3, 1, 2, 1, False), (QWEN3_MOE, 3, 1, 4, 1, True), (DEEPSEEK, 4, 2, 2, 2, True), (DEEPSEEK, 4, 2, 2, 1, False)],
    ids=["qwen3-moe-fsdp3-tp2", "qwen3-moe-fsdp3-ep4", "deepseek-ep2xfsdp2-dp2-tp2-ep4", "deepseek-ep2xfsdp2-tp2"],
)  # fmt: skip
def test_fused_experts_land_as_vllm_holds_them(shape, shards, ep, tp, dp, expert_parallel, seed):
    ranks = tp * dp
    src = hf_layout(shape, shards, ep=ep, fused_experts=True)
    src.check_complete()
    names = {pt.name for row in src.shards for pt in row}
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and not any(".mlp.experts.0." in n for n in names)
    dst = ReplicaLayout.spmd(vllm_placements(shape, tp, expert_parallel=expert_parallel, dp=dp, fused_experts=True), ranks)
    p = plan(src, dst, preset("qwen3"))
    if ep > 1:  # the fused tensors too are read from the group holding those experts only
        fsdp, per_group = shards // ep, shape.experts // ep
        for sp in p.shards:
            for t in sp.tasks:
                if t.source.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    groups = {e // per_group for e in range(t.region.start[0], t.region.stop[0])}
                    assert all(rd.shard // fsdp in groups for rd in t.reads), (t.source, t.region, [rd.shard for rd in t.reads])
    full = random_full(src, torch.Generator().manual_seed(seed))
    got = convert_poisoned(p, src, full)
    moe_layers = [i for i in range(shape.layers) if shape.moe(i)]
    assert moe_layers
    for i in moe_layers:
        m = f"model.layers.{i}.mlp.experts"
        for name, whole in (("w13_weight", full[f"{m}.gate_up_proj"]), ("w2_weight", full[f"{m}.down_proj"])):
            for r in range(ranks):
                want = rank_slice(name, whole, r, ranks if expert_parallel else tp, expert_parallel)
                have = got[r][f"{m}.routed_experts.{name}"]
                assert tuple(have.shape) == tuple(want.shape), (name, r)
                assert same_bytes(have, want), f"layer {i} {name} rank {r} (seed {seed})"
        if shape.shared_intermediate and dp == 1:  # the shared experts still fuse like a dense MLP
            n = shape.shared_intermediate // tp
            gate, up = (full[f"model.layers.{i}.mlp.shared_experts.{k}_proj.weight"] for k in ("gate", "up"))
            for r in range(ranks):
                want = torch.cat([gate[r * n : (r + 1) * n], up[r * n : (r + 1) * n]])
                assert same_bytes(got[r][f"model.layers.{i}.mlp.shared_experts.gate_up_proj.weight"], want)


class _Meta:
    def __init__(self, dtype: str, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, shape


def test_fused_experts_bad_shapes_and_layouts_are_typed_errors():
    fused = {n: _Meta("bfloat16", s) for n, s in hf_tensors(QWEN3_MOE, fused_experts=True)}
    dst3 = {t.name: t for t in vllm_placements(QWEN3_MOE, 2, fused_experts=True)}
    dst2 = {t.name: t for t in vllm_placements(QWEN3_MOE, 2)}
    assert len(resolve(preset("qwen3"), fused, dst3)) == len(dst3)
    # the fused tensors against a destination described flattened (per-expert names' layout)
    with pytest.raises(MappingMismatch, match=r"w13_weight.*has shape \[2048, 256\].*derives \[4, 512, 256\]") as err:
        resolve(preset("qwen3"), fused, dst2)
    assert "model.layers.0.mlp.experts.gate_up_proj" in err.value.tensors
    # a fused tensor of the wrong width (not 2 x the experts' width), or missing one expert
    for bad in ((4, 510, 256), (3, 512, 256)):
        odd = {**fused, "model.layers.1.mlp.experts.gate_up_proj": _Meta("bfloat16", bad)}
        with pytest.raises(MappingMismatch, match=r"model\.layers\.1\.mlp\.experts\.routed_experts\.w13_weight") as err:
            resolve(preset("qwen3"), odd, dst3)
        assert "model.layers.1.mlp.experts.gate_up_proj" in err.value.tensors
    # per-expert and fused tensors of one layer together: its w13 fed twice
    both = {**fused, **{n: _Meta("bfloat16", s) for n, s in hf_tensors(QWEN3_MOE) if ".mlp.experts.0." in n}}
    with pytest.raises(MappingMismatch, match="fed twice|lacks its parts"):
        resolve(preset("qwen3"), both, dst3)
    with pytest.raises(InvalidArgument, match="FP8"):
        vllm_placements(QWEN3_MOE, 2, fp8=True, fused_experts=True)
    with pytest.raises(InvalidArgument, match="expert-parallel groups"):
        hf_layout(QWEN3_MOE, 6, ep=4, fused_experts=True)
