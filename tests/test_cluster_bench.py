"""The cluster benchmarks' cores, once each with tiny sizes, on a real emulated cluster: the
real server and worker processes in network namespaces, bytes over ``tcp`` across the shaped
links (``benchmarks/cluster_jobs.py``, ``bench_bursts.py``, ``bench_cluster_masking.py``).
Checks that the results are sane (bytes equal to the trainer's, the chain formed, the figures
finite) and that nothing is left behind."""

from __future__ import annotations

import math

import pytest

from benchmarks import bench_bursts, bench_cluster_masking
from benchmarks.cluster import Cluster, available, leftovers
from benchmarks.cluster_jobs import MIB, Job, chain_depth

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(150)]

_REASON = available()
if _REASON:
    pytestmark.append(pytest.mark.skip(reason=f"no emulated cluster here: {_REASON}"))


def _quiet(_: str) -> None:
    pass


def test_bursts_core_both_modes() -> None:
    size = 8 * MIB
    with Cluster(bench_bursts.spec(2), host_rate="400mbit") as c:
        records = []
        for mode in ("pipeline", "no-pipeline"):
            records += bench_bursts.run_mode(c, mode, [1, 2], 1, size, chunk=4 * MIB, streams=1, warmup=False,
                                             timeout=60.0, log=_quiet)  # fmt: skip
    assert leftovers(c.prefix) == []
    assert [(r["mode"], r["n"]) for r in records] == [("pipeline", 1), ("pipeline", 2), ("no-pipeline", 1), ("no-pipeline", 2)]
    for r in records:
        assert r["bytes_ok"] and r["tcp_only"], r
        assert len(r["hosts"]) == r["n"] and all(h["bytes"] == size for h in r["hosts"])
        assert 0 < r["max_stall_s"] <= r["total_s"] < 30, r
        assert r["cpu_job"] >= 0 and 0 <= r["cpu_machine"] <= 1
    by = {(r["mode"], r["n"]): r for r in records}
    assert by[("pipeline", 2)]["depth"] == 2  # the second reader was served by the first (a partial holder)
    assert by[("no-pipeline", 2)]["depth"] == 1  # only the trainer (the one complete holder) served
    rows = bench_bursts.summarize(records, ["pipeline", "no-pipeline"], [1, 2])
    assert all(math.isfinite(row["ratio"]) and row["ratio"] > 0 for row in rows)
    assert {v["mode"] for v in bench_bursts.verdicts(rows, [1, 2])} == {"pipeline", "no-pipeline"}


def test_masking_core_relay_killed() -> None:
    size = 12 * MIB  # at 80 Mbit/s: ~1.3 s per transfer, read by read of 4 MiB
    with Cluster(bench_cluster_masking.spec(1), host_rate="80mbit") as c:
        result = bench_cluster_masking.run_masking(c, size, [0.3], 1, downstreams=1, heartbeat_timeout=2.0,
                                                   chunk=4 * MIB, streams=1, link=10e6, timeout=60.0, log=_quiet)  # fmt: skip
    assert leftovers(c.prefix) == []
    runs = result["runs"]
    assert [r["kill_at"] for r in runs] == [None, 0.3]
    for r in runs:
        assert r["chained"], r  # d1 was first served by the relay
        assert all(h["bytes_ok"] and h["transports"] == ["tcp"] * len(h["transports"]) for h in r["hosts"]), r
    killed = runs[1]["killed"]
    assert 0 < killed["d1_verified"] < size, killed
    assert runs[1]["hosts"][0]["grants"] >= 2  # re-granted after the relay died
    assert len(runs[1]["hosts"][0]["sources"]) >= 2 and runs[1]["hosts"][0]["sources"][0].startswith("relay-")
    assert result["relays_still_listed"] == []
    fault = [row for row in result["summary"] if row["kill_at"] is not None]
    assert len(fault) == 1 and fault[0]["extra_s"] <= fault[0]["bound_s"], fault


def test_poll_mode_across_datacenters_with_open_kw() -> None:
    """What the cross-datacenter benchmark needs: a trainer in dc-a publishing a series, a
    rollout in dc-b polling ``update("latest")``, ``open()`` options and server flags passed
    through."""
    size = 2 * MIB
    with Cluster({"dc-a": ["ctl", "a1"], "dc-b": ["b1"]}, host_rate="400mbit", inter_dc_rate="100mbit") as c, Job(c) as job:
        srv = job.server("ctl", ["--heartbeat-timeout", "5", "--heartbeat-interval", "0.5"])
        trainer, rollout = job.workers([
            {"host": "a1", "role": "trainer", "replica": "trainer", "server": srv.address, "size_bytes": size},
            {"host": "b1", "role": "rollout", "replica": "b1", "server": srv.address, "size_bytes": size,
             "open_kw": {"retain": "latest", "transports": {"tcp": {"streams": 2}}}, "extra": ["--poll-ms", "50"]},
        ])  # fmt: skip
        m = rollout.mark()
        rollout.send("poll 3 30")
        trainer.send("series 1 3 0.6")
        trainer.expect("series-done", 30.0)
        done = rollout.expect("poll-done", 30.0, since=m)
        pulled = job.pulled([rollout], [trainer], since={rollout.name: m})
        published = {ev["version"]: ev["hash"] for ev in trainer.events if ev.get("event") == "published"}
    assert leftovers(c.prefix) == []
    assert done["reason"] == "reached" and done["held"] == 3
    assert pulled and [ev["version"] for ev in pulled] == sorted({ev["version"] for ev in pulled})
    assert pulled[-1]["version"] == 3
    for ev in pulled:
        assert ev["mode"] == "poll" and ev["hash"] == published[ev["version"]] and ev["bytes"] == size
        assert ev["transports"] == ["tcp"] and ev["host"] == "b1"
        assert 0 < ev["stall_s"] and ev["latency_s"] is not None and 0 < ev["latency_s"] < 10
    assert chain_depth(pulled[-1:]) == 1
