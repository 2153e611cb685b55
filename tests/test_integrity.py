"""End-to-end integrity and resume (DESIGN §4, §5.2), with a real server actor, shard handles in
worker processes, real TCP pulls and real checksums:

- a holder whose served bytes rot after it declared its checksums: a reader detects the
  mismatch, the server asks the holder to re-verify, quarantines it, and the reader gets correct
  bytes from another holder;
- bytes corrupted on the way (the fault-injecting wrapper; over tcp, and over local where they
  are hashed as they land): the reader re-pulls, nobody is quarantined;
- a source that dies mid-pull (fault at byte N, at several points): the reader keeps what it
  verified and resumes from the next source; and a source SIGKILLed mid-pull.

Every wait is bounded; the expected bytes are recomputed from the version number.
"""

from __future__ import annotations

import pytest

from .procs import SHAPES, RemoteError, wait_until

pytestmark = pytest.mark.integration

SCALE = 100  # ~4 MB shards (every tensor under 2 MiB: one pack)
BIG = {"TENSORHUB_PACK_THRESHOLD": "0"}  # no packing: one region per tensor
# and reads of one 4 MiB checksum unit at most (several per pull at twice the scale)
MANY = {**BIG, "TENSORHUB_CHUNK_BYTES": str(64 << 10)}


def shard_bytes(scale: int = SCALE) -> int:
    total = 0
    for shape in SHAPES.values():
        n = 4
        for i, d in enumerate(shape):
            n *= d * scale if i == 0 else d
        total += n
    return total


def publish_and_wait_checksums(srv, h, version: int) -> None:
    h.call("fill", version)
    h.call("publish", version)
    wait_until(lambda: srv.checksums("actor", version) is not None, 30, "the publisher's checksums")


def test_rotten_holder_is_quarantined_and_the_reader_gets_good_bytes_elsewhere(inproc_server, handles):
    srv = inproc_server
    bad = handles("trainer", server=srv.address, scale=SCALE)
    # The reader's first read waits a moment, so that a second holder exists when it reports.
    reader = handles("rollout", server=srv.address, scale=SCALE, transports={"tcp": {"faults": [{"op": "delay", "seconds": 1.0}]}})
    good = handles("trainer-b", server=srv.address, scale=SCALE)
    for h in (bad, reader, good):
        h.call("register")
    publish_and_wait_checksums(srv, bad, 1)
    bad.call("corrupt", 12345)  # after the checksums were declared: the served copy is now wrong
    reader.send("replicate", 1, 60.0)
    wait_until(lambda: srv.counts()["grants"] == 1, 30, "the reader's grant from the rotten holder")
    good.call("fill", 1)
    good.call("publish", 1)
    assert reader.result() == 1
    assert reader.call("holds", 1), "the reader holds bytes that are not version 1"
    assert reader.call("last_sources") == ["trainer/0", "trainer-b/0"]
    wait_until(lambda: srv.stats()["quarantined"] == 1, 30, "the rotten holder's quarantine")
    listing = reader.call("list")
    assert listing == {1: ["rollout", "trainer-b"]}, "the quarantined copy is still listed"


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_bytes_corrupted_on_the_way_are_pulled_again_and_nobody_is_quarantined(inproc_server, handles, transport):
    """``tcp`` verifies each read after it landed; ``local`` reports landing, so the reader hashes
    each piece in the copying thread: a byte flipped as its piece lands must still fail its unit."""
    srv = inproc_server
    env = {"TENSORHUB_TRANSPORTS": transport}
    holder = handles("trainer", server=srv.address, scale=2 * SCALE, env={**BIG, **env})
    other = handles("trainer-b", server=srv.address, scale=2 * SCALE, env={**BIG, **env})
    faults = [{"op": "corrupt", "at": 777}]
    reader = handles("rollout", server=srv.address, scale=2 * SCALE, env={**MANY, **env}, transports={transport: {"faults": faults}})
    for h in (holder, other, reader):
        h.call("register")
    publish_and_wait_checksums(srv, holder, 1)
    publish_and_wait_checksums(srv, other, 1)
    assert reader.call("replicate", 1, 60.0) == 1
    assert reader.call("holds", 1)
    assert reader.call("fired") == ["corrupt"]
    assert reader.call("last_transports") == [transport, transport]
    if transport == "local":
        assert reader.call("hashed_on_landing") > 0, "no read was verified from its landing digests"
    sources = reader.call("last_sources")
    assert len(sources) == 2 and sources[0] != sources[1], "the reader did not move to the other holder"
    assert reader.call("pulled") < 2 * shard_bytes(2 * SCALE), "more than the corrupted read was pulled again"
    assert srv.stats()["quarantined"] == 0  # the first holder's self-check passed
    assert reader.call("list") == {1: ["rollout", "trainer", "trainer-b"]}


@pytest.mark.parametrize("where", [0.0, 0.45, 0.999])
def test_a_source_dying_mid_pull_is_resumed_from_what_was_verified(inproc_server, handles, where):
    srv = inproc_server
    total = shard_bytes(2 * SCALE)  # three reads
    at = min(total - 1, int(total * where))
    env = MANY
    first = handles("trainer", server=srv.address, scale=2 * SCALE, env=BIG)
    second = handles("trainer-b", server=srv.address, scale=2 * SCALE, env=BIG)
    faults = [{"op": "fail", "at": at}]
    reader = handles("rollout", server=srv.address, scale=2 * SCALE, env=env, transports={"tcp": {"faults": faults}})
    for h in (first, second, reader):
        h.call("register")
    publish_and_wait_checksums(srv, first, 1)
    publish_and_wait_checksums(srv, second, 1)
    assert reader.call("replicate", 1, 60.0) == 1
    assert reader.call("holds", 1)
    assert reader.call("fired") == ["fail"]
    sources = reader.call("last_sources")
    assert len(sources) == 2 and sources[0] != sources[1]
    # Resumed, not restarted: every byte landed once (the failed read does not count).
    assert reader.call("pulled") == total
    assert srv.stats()["quarantined"] == 0


def test_a_source_killed_mid_pull_leaves_the_reader_to_finish_from_another(inproc_server, handles):
    srv = inproc_server
    env = MANY
    victim = handles("trainer", server=srv.address, scale=SCALE, env=BIG)
    backup = handles("trainer-b", server=srv.address, scale=SCALE, env=BIG)
    # Slow enough (about 1.6 s for the shard) that the kill lands mid-pull.
    reader = handles("rollout", server=srv.address, scale=SCALE, env=env, transports={"tcp": {"max_rate": 2.5e6}})
    for h in (victim, backup, reader):
        h.call("register")
    publish_and_wait_checksums(srv, victim, 1)
    reader.send("replicate", 1, 60.0)
    wait_until(lambda: srv.counts()["grants"] == 1, 30, "the reader's grant")
    publish_and_wait_checksums(srv, backup, 1)
    victim.kill()
    assert reader.result(90.0) == 1
    assert reader.call("holds", 1)
    sources = reader.call("last_sources")
    assert sources[0] == "trainer/0" and sources[-1] == "trainer-b/0"


def test_replicate_never_returns_bytes_that_failed_verification(inproc_server, handles):
    """The only holder is rotten: the reader's replicate fails with a typed error and the
    reader does not claim the version."""
    srv = inproc_server
    bad = handles("trainer", server=srv.address, scale=SCALE)
    reader = handles("rollout", server=srv.address, scale=SCALE)
    for h in (bad, reader):
        h.call("register")
    publish_and_wait_checksums(srv, bad, 1)
    bad.call("corrupt", 4242)
    with pytest.raises(RemoteError) as err:
        reader.call("replicate", 1, 30.0)
    assert err.value.kind == "ChecksumMismatch"
    assert 1 not in reader.call("list") or "rollout" not in reader.call("list")[1]
