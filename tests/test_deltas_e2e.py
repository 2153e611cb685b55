"""Deltas end to end (issue 21): a real server actor, shard handles in worker processes, real
TCP pulls, a real SIGKILL.

- a trainer opened with ``deltas=True`` publishes each version's delta in the background; a
  rollout that holds the version before lands the next one through one delta, one that fell
  behind through a chain, bytes equal to the trainer's (sha256 per tensor); a rollout that holds
  nothing pulls in full;
- a rollout whose tensors do not hold the chain's base (bit rot behind our back) refuses the
  delta before writing (BaseMismatch) and pulls the version in full: it is never presented as the
  version;
- a relay pulling a delta is SIGKILLed while the next rollout pipelines the delta from it: that
  rollout's delta pull is re-granted from the trainer and it lands the version through the delta.
"""

from __future__ import annotations

import time

import pytest

from .procs import InprocServer, RemoteError, wait_until
from .test_integrity import MANY, SCALE, publish_and_wait_checksums

pytestmark = pytest.mark.integration

SLOW = {"tcp": {"max_rate": 2.5e6}}


@pytest.fixture
def srv():
    s = InprocServer(heartbeat_interval=0.5, heartbeat_timeout=5.0)  # lenient: a loaded machine stays in
    yield s
    s.close()


def next_version(srv, trainer, version: int, fraction: float, seed: int) -> list[int]:
    """The trainer steps: a few elements change, then ``publish(version)``; returns once its
    delta is published (the versions whose delta it published)."""
    trainer.call("unpublish")
    trainer.call("nudge", seed + version, fraction)
    trainer.call("publish", version)
    wait_until(lambda: srv.checksums("actor", version) is not None, 30, "the trainer's checksums")
    published, failed = trainer.call("settle_deltas", timeout=60.0)
    assert failed is None, failed
    return published


def test_updates_land_through_deltas_and_chains_and_bad_bases_pull_in_full(srv, handles, seed):
    trainer = handles("trainer", server=srv.address, scale=SCALE, deltas=True)
    near = handles("near", server=srv.address, scale=SCALE, deltas=True)
    far = handles("far", server=srv.address, scale=SCALE, deltas=True)
    for h in (trainer, near, far):
        h.call("register")
    publish_and_wait_checksums(srv, trainer, 1)
    for h in (near, far):
        assert h.call("replicate", 1, 30.0) == 1
    assert trainer.call("settle_deltas")[0] == []  # the first version has no delta: a snapshot only

    assert next_version(srv, trainer, 2, 0.01, seed) == [2]
    assert near.call("update", "latest", 30.0) is True
    d = near.call("last_delta")
    assert d["landed"] and d["versions"] == [2] and d["error"] is None
    assert d["bytes"] < d["full"] / 10, d  # 1 % of float32 elements: about 2 % of the bytes
    assert near.call("digests") == trainer.call("digests")

    for v in (3, 4):
        next_version(srv, trainer, v, 0.01, seed)
    assert near.call("update", "latest", 30.0) is True  # two behind: a chain of two
    assert near.call("last_delta")["versions"] == [3, 4] and near.call("last_delta")["landed"]
    assert far.call("update", "latest", 30.0) is True  # three behind
    assert far.call("last_delta")["versions"] == [2, 3, 4] and far.call("last_delta")["landed"]
    want = trainer.call("digests")
    assert near.call("digests") == want and far.call("digests") == want

    # a rollout that holds nothing pulls in full
    fresh = handles("fresh", server=srv.address, scale=SCALE, deltas=True)
    fresh.call("register")
    assert fresh.call("update", "latest", 30.0) is True
    assert fresh.call("last_delta") is None and fresh.call("digests") == want

    # bit rot behind our back: the chain's base is not what near holds -> refused, full pull
    near.call("corrupt", 0)
    next_version(srv, trainer, 5, 0.01, seed)
    assert near.call("update", "latest", 30.0) is True
    d = near.call("last_delta")
    assert not d["landed"] and "BaseMismatch" in d["error"], d
    assert near.call("digests") == trainer.call("digests")
    assert far.call("update", "latest", 30.0) is True and far.call("last_delta")["landed"]
    assert far.call("digests") == trainer.call("digests")
    stats = srv.stats()
    assert stats["delta_plans"] >= 5 and stats["deltas_landed"] >= 4, stats


def test_a_relay_killed_mid_delta_while_the_next_pipelines_from_it(srv, handles, seed):
    trainer = handles("trainer", server=srv.address, scale=SCALE, env=MANY, deltas=True)
    relay = handles("relay", server=srv.address, scale=SCALE, env=MANY, deltas=True, transports=SLOW)
    last = handles("last", server=srv.address, scale=SCALE, env=MANY, deltas=True)
    for h in (trainer, relay, last):
        h.call("register")
    publish_and_wait_checksums(srv, trainer, 1)
    for h in (relay, last):
        assert h.call("replicate", 1, 60.0) == 1
    # 40 % of the float32 elements change: a sparse delta of about 80 % of the shard, which
    # the slow relay pulls in about a second
    next_version(srv, trainer, 2, 0.4, seed)
    relay.send("update", "latest", 60.0)
    wait_until(lambda: srv.counts()["grants"] == 1, 30, "the relay's delta grant")
    last.send("update", "latest", 60.0)
    wait_until(lambda: srv.counts()["grants"] == 2, 30, "the last rollout's delta grant")
    time.sleep(0.4)  # the last rollout has what the relay verified so far
    relay.kill()
    assert last.result(60.0) is True
    d = last.call("last_delta")
    assert d["landed"] and d["versions"] == [2], d
    sources = last.call("delta_sources")
    assert sources[0] == "relay@delta/0" and sources[-1] == "trainer@d0/0", sources
    assert last.call("digests") == trainer.call("digests")


UNREACHABLE = {"tcp": {"faults": [{"op": "stall", "seconds": 0.01, "times": 0}]}}  # every read fails: no peer reachable


def test_a_reader_that_reaches_no_peer_restores_from_the_bucket_the_server_names(srv, handles, seed, tmp_path):
    bucket = str(tmp_path / "bucket")
    trainer = handles("trainer", server=srv.address, scale=SCALE, deltas=True, bucket=bucket)
    near = handles("near", server=srv.address, scale=SCALE)
    far = handles("far", server=srv.address, scale=SCALE, transports=UNREACHABLE)  # no bucket of its own
    for h in (trainer, near, far):
        h.call("register")
    publish_and_wait_checksums(srv, trainer, 1)
    trainer.call("settle_deltas")
    for v in (2, 3):
        next_version(srv, trainer, v, 0.01, seed)
    # the trainer's shard tells the server once its writer stored a version in the bucket
    wait_until(lambda: (3, 0) in srv._look(lambda t: dict(t.models["actor"].buckets)), 30, "the bucket copy of 3")
    # a reader that reaches a peer never uses the bucket
    assert near.call("replicate", 3, 30.0) == 3
    assert near.call("last_bucket") is None
    # one that reaches none is told where the bucket is (InBucket) and restores from it: the
    # anchor of version 1, then the deltas, verified
    assert far.call("replicate", 3, 30.0) == 3
    assert far.call("last_bucket") == {"version": 3, "anchor": 1, "deltas": [[1, 2], [2, 3]]}
    want = trainer.call("digests")
    assert far.call("digests") == want and near.call("digests") == want
    assert far.call("state") == (3, False)
    assert "far" in near.call("list")[3]  # the server took it as a holder of version 3: it serves peers

    # a model with no bucket copy: the same pull fails, typed
    other = handles("trainer", model="other", server=srv.address, scale=SCALE)
    blind = handles("blind", model="other", server=srv.address, scale=SCALE, transports=UNREACHABLE)
    for h in (other, blind):
        h.call("register")
    other.call("fill", 1)
    other.call("publish", 1)
    wait_until(lambda: srv.checksums("other", 1) is not None, 30, "the checksums of other")
    with pytest.raises(RemoteError) as err:
        blind.call("replicate", 1, 30.0)
    assert err.value.kind == "TransportError"
