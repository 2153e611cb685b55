"""The resharding scenario (issue 20, item 6): the Perplexity write-up's shapes give finite,
plausible figures; the figures move the right way with the stated inputs; one conversion
happens per target layout and every other replica copies peer to peer."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from tensorhub.core.errors import InvalidArgument
from tensorhub.core.placement import ReplicaLayout
from tensorhub.scheduling.decoders import DecoderShape, hf_layout, hf_placements, hf_tensors, vllm_placements
from tensorhub.scheduling.mapping import preset
from tensorhub.scheduling.reshard import plan
from tensorhub.sim.cli import OTHERS
from tensorhub.sim.cli import main as sim_main
from tensorhub.sim.cluster import GB
from tensorhub.sim.reshard import MODELS, Decoder, ReshardInputs, Target, demand, reshard, simulate

#: a Qwen3-shaped decoder small enough to plan in milliseconds (TP 2 and 4 fit vLLM's block FP8)
SMALL = Decoder(
    "small",
    "qwen3",
    DecoderShape.family(
        "qwen3", layers=3, hidden=512, intermediate=1024, heads=8, kv_heads=2, head_dim=128, vocab=1024
    ),
)
#: a small model's shards are megabytes: slow links and conversion keep the times in the
#: range where latencies do not hide the bandwidths
SLOW = ReshardInputs(nic_gbps=1.0, convert_gbps=1.0, chunks=16)


def test_the_write_ups_shapes_give_finite_plausible_figures(capsys, monkeypatch) -> None:
    """Through ``tensorhub sim reshard --quick``: it prints the table, and the result behind it
    (the same run: it takes a while) has finite, plausible figures."""
    runs = []

    def kept(seed: int, quick: bool):
        runs.append(reshard(seed, quick=quick))
        return runs[-1]

    monkeypatch.setitem(OTHERS, "reshard", kept)
    assert sim_main(["reshard", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "== reshard" in out and "published s" in out and "Kimi-K2 1T" in out
    (r,) = runs
    assert [c["model"] for c in r.data["cases"]] == ["Qwen3-235B", "Kimi-K2 1T"]
    for c in r.data["cases"]:
        ours, each = c["tensorhub"], c["each_converts"]
        inputs = ReshardInputs(**c["inputs"])
        assert 230e9 < c["params"] < 240e9 if c["model"] == "Qwen3-235B" else 1.0e12 < c["params"] < 1.1e12
        for o in (ours, each):
            assert math.isfinite(o["seconds"]) and o["seconds"] > 0
            # no faster than the converting GPU's bytes at the NIC's line rate, and not absurd
            assert o["seconds"] > o["read_per_gpu"] / (inputs.nic_gbps / 8 * GB)
        assert 0.05 < c["ratio"] < 20
        assert ours["conversions"] == 1 and each["conversions"] == ours["replicas"]
        # bf16 read per fp8 byte held: about two, plus what the planner reads through
        assert 1.9 < ours["read_per_gpu"] / ours["landed_per_gpu"] < 3.0
    assert r.violations == []


def same_as_planning_every_layer(d, src: ReplicaLayout, dst: ReplicaLayout, family: str) -> None:
    """``d`` (one layer of each kind, multiplied) has the bytes, reads and tasks of a plan of all."""
    full = plan(src, dst, preset(family, fp8=True), max_task_bytes=256 << 20)
    for j, sp in enumerate(full.shards):
        row = [0] * src.num_shards
        for t in sp.tasks:
            for rd in t.reads:
                row[rd.shard] += rd.nbytes
        assert tuple(row) == d.reads[j]
        assert sum(s.nbytes for s in sp.tensors) == d.landed[j]
        assert len(sp.tasks) == d.tasks[j]


def test_layers_extrapolate_exactly() -> None:
    """The scenario plans one layer and multiplies: the same bytes as planning them all."""
    src = ReplicaLayout.spmd(hf_placements(SMALL.shape, 8), 8)
    dst = ReplicaLayout.spmd(vllm_placements(SMALL.shape, 4, fp8=True), 4)
    same_as_planning_every_layer(demand(SMALL, 8, 4), src, dst, "qwen3")


#: a mixture of experts with a dense first layer and a shared expert (Kimi-K2's kinds of layer)
SMALL_MOE = Decoder(
    "small-moe",
    "llama",
    DecoderShape(layers=4, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=128, vocab=256, experts=8,
                 expert_intermediate=256, shared_intermediate=256, dense_layers=1, router_bias=True),  # fmt: skip
)


@pytest.mark.parametrize("source_ep", [1, 2])
def test_layers_of_experts_extrapolate_exactly(source_ep: int) -> None:
    """A dense first layer and layers of experts: planning one of each and multiplying gives the
    bytes of planning them all, whether the trainer's experts are FSDP-sharded over every GPU or
    on their own expert-parallel mesh."""
    src = hf_layout(SMALL_MOE.shape, 4, ep=source_ep)
    dst = ReplicaLayout.spmd(vllm_placements(SMALL_MOE.shape, 2, fp8=True, expert_parallel=True), 2)
    same_as_planning_every_layer(demand(SMALL_MOE, 4, 2, source_ep=source_ep), src, dst, "llama")
    e, w, h = 8, 256, 256
    assert SMALL_MOE.params == sum(math.prod(s) for _, s in hf_tensors(SMALL_MOE.shape))
    assert SMALL_MOE.params > 3 * e * 3 * w * h  # the experts are in it


def test_faster_links_and_conversion_are_faster() -> None:
    def seconds(**kw: float) -> float:
        return simulate(SMALL, 8, (Target(2, 3),), dataclasses.replace(SLOW, **kw), seed=1).seconds

    by_nic = [seconds(nic_gbps=g, convert_gbps=100.0) for g in (0.5, 1.0, 2.0, 4.0)]
    assert all(a > b for a, b in itertools.pairwise(by_nic)), by_nic
    by_conv = [seconds(convert_gbps=g) for g in (0.02, 0.05, 0.2, 1.0)]
    assert all(a >= b for a, b in itertools.pairwise(by_conv)), by_conv
    # conversion-bound: about the converting GPU's bytes at the conversion rate
    read = simulate(SMALL, 8, (Target(2),), SLOW).read_per_gpu
    assert by_conv[0] == pytest.approx(read / (0.02 * GB), rel=0.05)
    # fewer, less efficient NICs are slower; more replicas never make it faster
    assert seconds(efficiency=0.5) > seconds()
    one = simulate(SMALL, 8, (Target(2, 1),), SLOW, seed=1).seconds
    assert seconds() >= one


def test_one_conversion_per_target_layout_then_peer_to_peer() -> None:
    targets = (Target(2, 3), Target(4, 2))
    ours = simulate(SMALL, 8, targets, SLOW, seed=2)
    each = simulate(SMALL, 8, targets, SLOW, seed=2, convert_once=False)
    per_layout = [sum(demand(SMALL, 8, t.tp).loads) for t in targets]
    landed = [sum(demand(SMALL, 8, t.tp).landed) for t in targets]
    assert (ours.conversions, ours.replicas) == (2, 5)
    assert each.conversions == 5
    # the trainers send one replica's plan per layout; the rest moves between inference GPUs
    assert ours.source_bytes == pytest.approx(sum(per_layout))
    assert ours.peer_bytes == pytest.approx(2 * landed[0] + 1 * landed[1])
    assert each.source_bytes == pytest.approx(3 * per_layout[0] + 2 * per_layout[1])
    assert each.peer_bytes == 0
    assert sorted(ours.replica_done) == ["TP2.r0", "TP2.r1", "TP2.r2", "TP4.r0", "TP4.r1"]
    # a chain: each replica done after the one it copies from, pipelined (not one pull per hop)
    done = ours.replica_done
    assert done["TP2.r0"] < done["TP2.r1"] < done["TP2.r2"] < 1.5 * done["TP2.r0"]
    assert done["TP4.r0"] < done["TP4.r1"]


def test_same_seed_same_figures() -> None:
    a = simulate(SMALL, 8, (Target(2, 3),), SLOW, seed=5)
    b = simulate(SMALL, 8, (Target(2, 3),), SLOW, seed=5)
    assert (a.seconds, a.digest) == (b.seconds, b.digest)


def test_bad_inputs_are_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match="nic_gbps"):
        ReshardInputs(nic_gbps=0)
    with pytest.raises(InvalidArgument, match="efficiency"):
        ReshardInputs(efficiency=1.5)
    with pytest.raises(InvalidArgument, match="targets"):
        simulate(SMALL, 8, ())
    with pytest.raises(InvalidArgument, match="cannot shard"):
        simulate(MODELS["Kimi-K2 1T"], 256, (Target(128),))
    with pytest.raises(InvalidArgument, match="block FP8"):  # its dense first layer's 18432 / 32
        simulate(MODELS["Kimi-K2 1T"], 256, (Target(32, 4),))


