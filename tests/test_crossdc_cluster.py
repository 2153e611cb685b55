"""Cross-datacenter replication on the emulated cluster, bounded: the real server and worker
processes in network namespaces of two datacenters, over tcp (``benchmarks/bench_crossdc.py``
with tiny sizes). Seeding crosses the slow link once per version; bytes are the trainer's;
nothing is left behind."""

from __future__ import annotations

import pytest

from benchmarks.bench_crossdc import run_mode, spec
from benchmarks.cluster import Cluster, available, leftovers
from benchmarks.cluster_jobs import MIB

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

_REASON = available()
if _REASON:
    pytestmark.append(pytest.mark.skip(reason=f"no emulated cluster here: {_REASON}"))


@pytest.mark.parametrize("mode", ["seeding", "offload"])
def test_one_copy_crosses_per_version_and_the_others_pull_inside_the_datacenter(mode):
    size = 2 * MIB
    with Cluster(spec(2), host_rate="400mbit", inter_dc_rate="100mbit") as c:
        records = run_mode(c, mode, rollouts=2, versions=1, size=size, poll_ms=50, chunk=1 * MIB, timeout=120.0,
                           log=lambda line: None)  # fmt: skip
    assert leftovers(c.prefix) == []
    assert len(records) == 2  # hashes were checked by run_mode
    assert {r["remote_bytes"] for r in records} == {size}  # one copy across, not one per rollout
    assert {t for r in records for t in r["transports"]} == {"tcp"}
    seeders = [r for r in records if r["seeder"]]
    others = [r for r in records if not r["seeder"]]
    assert len(seeders) == 1 and len(others) == 1
    assert all(s.split("/")[0].startswith(("rollout-", "probe")) for s in others[0]["sources"])  # inside dc-b
    if mode == "offload":
        assert seeders[0]["sources"] == [seeders[0]["replica"] + "@seed/0"]


def test_deltas_cross_once_per_version_and_land_on_every_rollout():
    """Issue 21 on the cluster, bounded: the first version is a full pull (seeding); the next one
    lands on both rollouts through the trainer's delta, which crosses the slow link once (about
    1/20 of the shard for bf16 weights with 1.65 % of the elements changing)."""
    size = 2 * MIB
    weights = ["--dtype", "bfloat16", "--change-fraction", "0.0165", "--seed", "7"]
    with Cluster(spec(2), host_rate="400mbit", inter_dc_rate="100mbit") as c:
        records = run_mode(c, "deltas", rollouts=2, versions=2, size=size, poll_ms=50, chunk=1 * MIB, timeout=120.0,
                           log=lambda line: None, weights=weights)  # fmt: skip
    assert leftovers(c.prefix) == []
    first = [r for r in records if r["version"] == 1]
    second = [r for r in records if r["version"] == 2]
    assert len(first) == len(second) == 2  # hashes were checked by run_mode
    assert {r["remote_bytes"] for r in first} == {size} and all(r["delta"] is None for r in first)
    assert all(r["delta"]["landed"] and r["delta"]["versions"] == [2] and r["delta"]["error"] is None for r in second)
    # v2 was announced as publish() returned: rollouts that polled before its delta was out were
    # told "not yet" (Publish.delta_from) rather than planned a full pull
    delta_bytes = second[0]["delta"]["bytes"]
    assert {r["remote_bytes"] for r in second} == {delta_bytes}  # one delta across, not one per rollout
    assert delta_bytes < size / 15
    assert 0.015 < second[0]["changed"] / second[0]["elements"] < 0.018
