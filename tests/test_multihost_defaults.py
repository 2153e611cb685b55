"""A job across hosts with no transport options (the emulated cluster: hosts as network
namespaces, ``benchmarks/cluster.py``): every process starts what a user who configures nothing
gets, each endpoint advertises its host's address (the interface that routes to the server, not
loopback), and versions replicate and update byte-exact across hosts and datacenters, over
``tcp`` and, named without options (``$TENSORHUB_TRANSPORTS=nixl,tcp``, UCX over TCP), over
``nixl`` and its side channel. A holder that advertises an address its readers cannot dial gets
them a typed error naming the holder, the address and the setting to change."""

from __future__ import annotations

import pytest

from benchmarks.cluster import Cluster, available, leftovers
from benchmarks.cluster_jobs import MIB, Job, publish
from tensorhub.transports.registry import get_transport

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

_REASON = available()
if _REASON:
    pytestmark.append(pytest.mark.skip(reason=f"no emulated cluster here: {_REASON}"))

SPEC = {"dc-a": ["a1", "a2"], "dc-b": ["b1"]}
SIZE = 3 * MIB
DEFAULTS = ["--default-transports"]


def _run(c: Cluster, env: dict[str, str], want: dict[str, str]) -> None:
    """Trainer on a1 (the server's host), rollouts on a2 (same datacenter) and b1 (the other):
    replicate version 1, then update to 2; bytes compared with the trainer's; ``want``: the
    transport each rollout's pulls must use."""
    with Job(c, env=env) as job:
        srv = job.server("a1")
        kw = {"server": srv.address, "size_bytes": SIZE, "extra": DEFAULTS}
        trainer = job.worker("a1", "trainer", "trainer", **kw)
        rollouts = job.workers([{"host": h, "role": "rollout", "replica": f"rollout-{h}", **kw} for h in ("a2", "b1")])
        for p in (trainer, *rollouts):
            ready = next(e for e in p.events if e.get("event") == "ready")
            addr = c.address(p.host)
            cross = {n: a for n, a in ready["advertised"].items() if n != "local"}
            assert cross and all(addr in a for a in cross.values()), (p.name, ready["advertised"], addr)
            if "local" in ready["advertised"]:
                assert "127.0.0.1" in ready["advertised"]["local"]  # same host only
        published = {}
        for version in (1, 2):
            (ev,) = publish([trainer], version)
            published[version] = ev["hash"]
            for r in rollouts:
                r.send("replicate 1" if version == 1 else "poll 2 60")
            for r in rollouts:
                got = r.expect("pulled", 90, version=version)
                assert got["hash"] == published[version], (r.name, version)
                assert got["transports"] and set(got["transports"]) == {want[r.host]}, (r.name, got["transports"])
                assert got["bytes"] >= SIZE
            for r in rollouts:
                if version == 2:
                    r.expect("poll-done", 30)


def test_a_job_across_hosts_with_no_transport_options_replicates_and_updates_over_tcp():
    with Cluster(SPEC, host_rate="400mbit", inter_dc_rate="200mbit") as c:
        _run(c, {}, {"a2": "tcp", "b1": "tcp"})
    assert leftovers(c.prefix) == []


@pytest.mark.skipif(not get_transport("nixl").probe().usable, reason="NIXL does not import here")
def test_nixl_named_without_options_reaches_across_hosts_over_its_side_channel():
    env = {"TENSORHUB_TRANSPORTS": "nixl,tcp", "UCX_TLS": "tcp"}
    with Cluster(SPEC, host_rate="400mbit", inter_dc_rate="200mbit") as c:
        # Same datacenter: nixl (its side channel and UCX over the hosts' link); across: tcp.
        _run(c, env, {"a2": "nixl", "b1": "tcp"})
    assert leftovers(c.prefix) == []


def test_a_holder_advertising_an_address_its_readers_cannot_reach_names_it_and_the_setting():
    with Cluster({"dc-a": ["a1", "a2"]}, host_rate="400mbit") as c:
        with Job(c) as job:
            srv = job.server("a1")
            kw = {"server": srv.address, "size_bytes": 1 * MIB, "extra": DEFAULTS}
            # The trainer says "dial me at 127.0.0.1": true only inside its own namespace.
            trainer = job.worker("a1", "trainer", "trainer", env={"TENSORHUB_ADVERTISE_HOST": "127.0.0.1",
                                                                  "TENSORHUB_TRANSPORTS": "tcp"}, **kw)  # fmt: skip
            rollout = job.worker("a2", "rollout", "rollout-a2", env={"TENSORHUB_TRANSPORTS": "tcp"}, **kw)
            publish([trainer], 1)
            rollout.send("replicate 1")
            err = rollout.expect("error", 120, op="replicate")
            msg = err["message"]
            assert "holder trainer/0" in msg and "127.0.0.1:" in msg and "TENSORHUB_ADVERTISE_HOST" in msg, msg
    assert leftovers(c.prefix) == []
