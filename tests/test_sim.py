"""The simulator: its network model, determinism, invariants under churn, and the scenarios'
shape (the paper's figures themselves are printed by ``tensorhub sim paper``)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.core.errors import InvalidArgument
from tensorhub.sim import scenarios
from tensorhub.sim.actors import SimReplica
from tensorhub.sim.cli import main as sim_main
from tensorhub.sim.cluster import GB, NetParams
from tensorhub.sim.core import SimStuck, Simulator
from tensorhub.sim.network import Link, Network
from tensorhub.sim.scenarios import World

# ---- the flow-level network -------------------------------------------------------------------


def _net() -> tuple[Simulator, Network]:
    sim = Simulator(0)
    return sim, Network(sim)


def test_two_flows_share_a_link_then_the_survivor_speeds_up() -> None:
    sim, net = _net()
    link = net.link("l", 10.0)
    ends: dict[str, float] = {}
    net.start([link], 10.0, lambda: ends.setdefault("a", sim.now))
    net.start([link], 30.0, lambda: ends.setdefault("b", sim.now))
    sim.run()
    # both at 5/s until a ends at 2 s (10 bytes); b has 20 left, alone at 10/s: ends at 4 s
    assert ends["a"] == pytest.approx(2.0)
    assert ends["b"] == pytest.approx(4.0)
    assert link.bytes == pytest.approx(40.0)


def test_a_capped_flow_leaves_the_rest_to_the_others() -> None:
    sim, net = _net()
    link = net.link("l", 10.0)
    a = net.start([link], 100.0, lambda: None, cap=2.0)
    b = net.start([link], 100.0, lambda: None)
    assert (a.rate, b.rate) == (pytest.approx(2.0), pytest.approx(8.0))
    net.cancel(a)
    assert b.rate == pytest.approx(10.0)
    net.cancel(a)  # twice: nothing


def test_a_flow_is_as_fast_as_its_narrowest_link() -> None:
    sim, net = _net()
    wide, narrow = net.link("wide", 100.0), net.link("narrow", 4.0)
    f = net.start([wide, narrow], 8.0, lambda: None)
    other = net.start([wide], 1000.0, lambda: None)
    assert f.rate == pytest.approx(4.0)
    assert other.rate == pytest.approx(96.0)
    sim.run(until=1.0)
    assert f.done_bytes(sim.now) == pytest.approx(4.0)


@settings(max_examples=60, deadline=None)
@given(
    caps=st.lists(st.floats(1.0, 100.0), min_size=1, max_size=5),
    flows=st.lists(
        st.tuples(st.sets(st.integers(0, 4), min_size=1, max_size=3), st.one_of(st.none(), st.floats(0.5, 50.0))),
        min_size=1,
        max_size=8,
    ),
)
def test_sharing_is_max_min_fair(caps: list[float], flows: list[tuple[set[int], float | None]]) -> None:
    """Feasible (no link above capacity), and every flow has a bottleneck: its cap, or a full
    link on which no other flow is faster."""
    sim, net = _net()
    links = [net.link(f"l{i}", c) for i, c in enumerate(caps)]
    started = []
    for idx, cap in flows:
        path = [links[i] for i in sorted({i % len(links) for i in idx})]
        started.append(net.start(path, 1e9, lambda: None, cap=cap))
    for link in links:
        assert sum(f.rate for f in link.flows) <= link.capacity * (1 + 1e-6)
    for f in started:
        if f.cap is not None and f.rate >= f.cap * (1 - 1e-6):
            continue
        assert any(
            sum(g.rate for g in link.flows) >= link.capacity * (1 - 1e-6) and all(g.rate <= f.rate * (1 + 1e-6) for g in link.flows)
            for link in f.path
        ), f"flow {f} has no bottleneck"


def test_bad_parameters_are_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match="capacity"):
        Link("l", 0.0)
    with pytest.raises(InvalidArgument, match="vpc_efficiency"):
        NetParams(vpc_efficiency=1.5)
    with pytest.raises(InvalidArgument, match="seed"):
        Simulator("7")  # type: ignore[arg-type]
    sim, net = _net()
    with pytest.raises(InvalidArgument, match="link"):
        net.start([], 1.0, lambda: None)
    link = net.link("l", 1.0)
    with pytest.raises(InvalidArgument, match="twice"):
        net.start([link, link], 1.0, lambda: None)
    with pytest.raises(InvalidArgument, match="unknown scenario 'nope'"):
        scenarios.run("nope")


# ---- the simulated deployment ------------------------------------------------------------------


def test_a_pipeline_of_readers_takes_about_one_pull(seed: int) -> None:
    """Four rollouts of one trainer, pipelined: the last is done about one pull after the start,
    not four; without pipelining the trainer's NIC is split four ways."""
    times = {}
    for pipeline in (True, False):
        w = World(seed, config=scenarios.TableConfig(pipeline=pipeline), check_every=1)
        th, rh = w.hosts("dc0", "t", 1), w.hosts("dc0", "r", 4)
        trainer = w.replicas("trainer", th, 8, 10 * GB, reads=32)
        readers = w.replicas("rollout", rh, 8, 10 * GB, reads=32)
        w.open(trainer + readers)
        w.publish(trainer, 1)
        recs = [r.update() for r in readers]
        w.wait(recs, 60.0, "pull")
        assert w.server.violations == [], f"seed {seed}: {w.server.violations}"
        times[pipeline] = max(r.stall for r in recs)
    one_pull = 10 * GB / (25 * GB * scenarios.TENSORHUB.efficiency)
    assert times[True] < 1.3 * one_pull
    assert times[False] > 3.5 * one_pull


def test_a_silent_source_is_given_up_after_the_transfer_timeout(seed: int) -> None:
    w = World(seed, check_every=1)
    th, ah, bh = w.hosts("dc0", "t", 1), w.hosts("dc0", "a", 1), w.hosts("dc0", "b", 1)
    trainer = w.replicas("trainer", th, 2, 10 * GB, count=1, reads=16)
    a = w.replicas("A", ah, 2, 10 * GB, count=1, reads=16)[0]
    b = w.replicas("B", bh, 2, 10 * GB, count=1, reads=16)[0]
    w.open(trainer + [a, b])
    w.publish(trainer, 1)
    a.update()
    w.sim.run(until=w.sim.now + 0.002)
    rb = b.update()
    w.sim.at(rb.start + 0.1, a.crash)
    w.wait([rb], 60.0, "B")
    timeout = w.cluster.params.transfer_timeout
    assert rb.stall > timeout  # it waited for the transport to give up on A
    assert rb.stall < timeout + 2 * (10 * GB / (25 * GB * scenarios.TENSORHUB.efficiency))
    assert {s.grant.source.replica for s in b.shards} == {"trainer0"}
    assert w.server.violations == []


def test_waiting_for_what_never_comes_is_an_error_not_a_hang() -> None:
    w = World(1)
    th = w.hosts("dc0", "t", 1)
    (r,) = w.replicas("rollout", th, 8, GB, count=1)
    w.open([r])
    rec = r.replicate(5)  # nobody will ever publish version 5
    with pytest.raises(SimStuck, match="seed 1"):
        w.wait([rec], 30.0, "replicate v5")


def test_the_invariant_checker_sees_a_corrupt_table(seed: int) -> None:
    w = World(seed)
    th, rh = w.hosts("dc0", "t", 1), w.hosts("dc0", "r", 1)
    trainer = w.replicas("trainer", th, 8, GB, reads=8)
    (reader,) = w.replicas("rollout", rh, 8, GB, reads=8)
    w.open(trainer + [reader])
    w.publish(trainer, 1)
    reader.update()
    w.sim.run(until=w.sim.now + 0.01)  # mid-pull: grants are active
    assert w.server.table.grants
    w.server.check()
    assert w.server.violations == []
    grant = next(iter(w.server.table.grants.values()))
    grant.source.grants.pop(grant.id)  # a grant its source no longer counts
    w.server.check()
    assert any("missing from its source" in v for v in w.server.violations)


def test_same_seed_same_trace() -> None:
    a = scenarios.churn(11, steps=3)
    b = scenarios.churn(11, steps=3)
    c = scenarios.churn(12, steps=3)
    assert a.digest == b.digest
    assert a.rows == b.rows
    assert c.digest != a.digest


@pytest.mark.slow
def test_churn_finds_no_violation_over_many_seeds(seed: int) -> None:
    """Random crashes (mid-transfer too) and restarts; the table's invariants after every event.
    Three seeds here (about 2 s of CPU each); the soak over 50 seeds of 20 steps is
    ``benchmarks/bench_sim.py``."""
    total_crashes = 0
    for i in range(3):
        s = seed + i
        r = scenarios.churn(s, steps=4, check_every=1)
        assert r.violations == [], f"seed {s}: {r.violations}"
        assert r.checks >= r.events > 0
        assert r.data["updates"] > 0
        total_crashes += r.data["crashes"]
    assert total_crashes > 0  # the test did kill replicas


# ---- scenarios and the command line -------------------------------------------------------------


def test_cross_datacenter_moves_one_copy_per_datacenter(seed: int) -> None:
    r = scenarios.crossdc(seed)
    rows = {row[0]: row for row in r.rows}
    skipping, offload, ucx = rows["TensorHub, smart skipping"], rows["TensorHub, offload seeding"], rows["UCX (TCP)"]
    assert skipping[5] == pytest.approx(20.0)  # one copy of both 10 GB shards crossed
    assert offload[5] == pytest.approx(20.0)
    assert ucx[5] == pytest.approx(80.0)  # every rollout replica pulled its own
    assert skipping[2] < skipping[1] / 3  # the others pull locally after the seeder
    assert offload[3] < skipping[1]  # nobody waits for the slow link with offload seeding
    assert r.violations == []


def test_standalone_small_models(seed: int) -> None:
    r = scenarios.standalone(seed, models=["9B", "36B"])
    for name in ("9B", "36B"):
        d = r.data[name]
        assert d["ideal"] < d["tensorhub_mean"] < d["ucx_s"]
        assert d["tensorhub_total"] < d["nccl_total"] and d["tensorhub_total"] < d["ucx_total"]
    assert r.violations == []


def test_cli_prints_the_table_and_writes_json_and_png(tmp_path, capsys) -> None:
    assert sim_main(["failure", "--quick", "--seed", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "A fails at s" in out and "B done at s" in out
    data = json.loads((tmp_path / "failure.json").read_text())
    assert data["seed"] == 3 and data["violations"] == []
    assert all(math.isfinite(x) for x in data["data"]["b_done_at"])
    pytest.importorskip("matplotlib")
    assert (tmp_path / "failure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_an_unknown_scenario(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        sim_main(["nope"])
    assert exc.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_a_replica_with_too_few_gpus_is_refused() -> None:
    w = World(0)
    th = w.hosts("dc0", "t", 1)
    with pytest.raises(InvalidArgument, match="need 16 GPUs"):
        w.replicas("trainer", th, 8, GB, count=2, reads=1) + w.replicas("x", th, 16, GB, count=1)
    assert isinstance(w.replicas("ok", th, 8, GB, count=1)[0], SimReplica)


def test_tensorhub_sim_goes_to_the_simulator(capsys) -> None:
    from tensorhub.tools.cli import main as tensorhub_main

    with pytest.raises(SystemExit) as exc:
        tensorhub_main(["sim", "--help"])
    assert exc.value.code == 0
    assert "tensorhub sim" in capsys.readouterr().out
    assert tensorhub_main(["sim", "crossdc", "--seed", "2"]) == 0
    assert "smart skipping" in capsys.readouterr().out
