"""Failure paths end to end (DESIGN §5.2-5.4): a real server actor with short heartbeats, shard
handles in worker processes, real TCP pulls, real SIGKILLs.

- a reader killed mid-pull: its grant is released, the holder can unpublish, nothing of it stays;
- a relay killed in a chain trainer -> A -> B while B pipelines from A: B finishes from the
  trainer, resuming from what it verified;
- the last holder of a retained version unpublishes and overwrites its tensors: it keeps an
  offload copy in CPU memory, and a later reader gets the old version from it;
- a version whose last holders were spot replicas that died: VersionUnavailable, promptly;
- an ``update("latest")`` whose version loses its last holder mid-pull (the trainer dropped it for
  a newer one): it moves on to the newest version instead of leaving the handle empty;
- a rollout restarted under its old name while the old incarnation is still known: the new one
  fences the old and works;
- a lone holder blamed for bytes damaged on the way: its self-check passes, it serves again;
- an unpublish while a slow reader pulls: the reader is revoked at the drain timeout and resumes
  from another holder.

(Holders killed mid-pull are in test_integrity.py and test_transports_e2e.py; server failover in
test_failover.py.)
"""

from __future__ import annotations

import time

import pytest

from .procs import InprocServer, RemoteError, wait_until
from .test_integrity import BIG, MANY, SCALE, publish_and_wait_checksums, shard_bytes

pytestmark = pytest.mark.integration

SLOW = {"tcp": {"max_rate": 2.5e6}}  # about 1.6 s for a shard at SCALE: kills land mid-pull


@pytest.fixture
def srv():
    s = InprocServer(heartbeat_interval=0.1, heartbeat_timeout=1.0)
    yield s
    s.close()


def test_a_reader_killed_mid_pull_releases_its_grant(srv, handles):
    trainer = handles("trainer", server=srv.address, scale=SCALE)
    reader = handles("rollout", server=srv.address, scale=SCALE, transports=SLOW)
    for h in (trainer, reader):
        h.call("register")
    publish_and_wait_checksums(srv, trainer, 1)
    reader.send("replicate", 1, 60.0)
    wait_until(lambda: srv.counts()["grants"] == 1, 30, "the reader's grant")
    reader.kill()
    wait_until(lambda: srv.counts()["grants"] == 0, 10, "the dead reader's grant to be released")
    t0 = time.monotonic()
    trainer.call("unpublish", timeout=20.0)  # would wait for the reader if its grant stayed
    assert time.monotonic() - t0 < 10
    wait_until(lambda: srv.counts()["sessions"] == 1, 10, "the dead reader's session to go")


def test_a_relay_killed_while_the_next_pipelines_from_it(srv, handles):
    trainer = handles("trainer", server=srv.address, scale=SCALE, env=BIG)
    relay = handles("relay", server=srv.address, scale=SCALE, env=BIG, transports=SLOW)
    last = handles("last", server=srv.address, scale=SCALE, env=MANY)
    for h in (trainer, relay, last):
        h.call("register")
    publish_and_wait_checksums(srv, trainer, 1)
    relay.send("replicate", 1, 60.0)
    wait_until(lambda: srv.counts()["grants"] == 1, 30, "the relay's grant")
    # The trainer serves the relay; the relay (partial, no readers) is the least loaded source.
    last.send("replicate", 1, 60.0)
    wait_until(lambda: srv.counts()["grants"] == 2, 30, "the last reader's grant")
    time.sleep(0.4)  # the last reader has what the relay verified so far
    relay.kill()
    assert last.result(60.0) == 1
    assert last.call("holds", 1)
    sources = last.call("last_sources")
    assert sources[0] == "relay/0" and sources[-1] == "trainer/0", sources
    assert last.call("pulled") < 2 * shard_bytes()  # resumed, not restarted


def test_a_retained_version_outlives_its_last_holder_as_an_offload_copy(srv, handles):
    trainer = handles("trainer", server=srv.address, scale=SCALE, retain="latest")
    trainer.call("register")
    publish_and_wait_checksums(srv, trainer, 1)
    trainer.call("unpublish")
    trainer.call("fill", 2)  # the live tensors no longer hold version 1
    reader = handles("rollout", server=srv.address, scale=SCALE)
    reader.call("register")
    assert reader.call("replicate", 1, 30.0) == 1
    assert reader.call("holds", 1)  # byte-exact version 1: from the CPU copy, not the tensors
    assert reader.call("last_sources") == ["trainer/0"]


def test_a_version_held_only_by_dead_spot_replicas_is_unavailable(srv, handles):
    # Nobody retains anything (a retention declaration of any handle would make the trainer
    # keep an offload copy when it unpublishes: spot copies never count).
    trainer = handles("trainer", server=srv.address, scale=SCALE, retain=None)
    spot = handles("spot", server=srv.address, scale=SCALE, spot=True, retain=None)
    for h in (trainer, spot):
        h.call("register")
    publish_and_wait_checksums(srv, trainer, 1)
    assert spot.call("replicate", 1, 30.0) == 1
    trainer.call("unpublish")
    spot.kill()
    wait_until(lambda: srv.counts()["sessions"] == 1, 10, "the dead spot replica to go")
    reader = handles("rollout", server=srv.address, scale=SCALE, retain=None)
    reader.call("register")
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as err:
        reader.call("replicate", 1, 30.0)
    assert err.value.kind == "VersionUnavailable"
    assert time.monotonic() - t0 < 10


def _landed(srv, replica: str, version: int) -> int:
    """Bytes of ``version`` the server knows ``replica``'s shard 0 verified (0: none, or another version)."""
    return srv._look(lambda t: next((s.holder.verified for s in t.sessions.values() if s.replica.name == replica
                                     and s.holder is not None and s.holder.version == version), 0))  # fmt: skip


def test_an_update_to_latest_whose_version_dies_mid_pull_moves_on_to_the_newest(srv, handles):
    # Seen in the chaos demo: the only complete holder of the version an update was pulling was
    # killed after the trainer had moved on; the update, which had landed bytes, aborted and left
    # the handle empty. (One that landed nothing is moved to the newer version by the server.)
    old = handles("trainer", server=srv.address, scale=4 * SCALE, retain=None, env=BIG)
    new = handles("trainer-b", server=srv.address, scale=4 * SCALE, retain=None, env=BIG)
    # Its pulls of versions 1 and 3 land 2 reads (of 5: 4 MiB checksum units), then one read
    # waits 3 s: the holder dies then.
    stalls = [{"op": "delay", "seconds": 3.0, "version": v, "after": 2, "times": 1} for v in (1, 3)]
    reader = handles("rollout", server=srv.address, scale=4 * SCALE, retain=None, transports={"tcp": {"faults": stalls}}, env=BIG)
    for h in (old, new, reader):
        h.call("register")
    publish_and_wait_checksums(srv, old, 1)
    new.call("fill", 2)
    reader.send("update", "latest", 60.0)
    wait_until(lambda: _landed(srv, "rollout", 1) > 0, 30, "the reader to land bytes of version 1")
    new.call("publish", 2)
    old.kill()  # version 1's last holder, mid-pull
    assert reader.result(60.0)  # moved: to version 2, not aborted
    assert reader.call("state") == (2, False)
    assert reader.call("holds", 2)
    assert reader.call("last_sources") == ["trainer-b/0"]
    # With no newer version to move on to, it says so, typed: the handle is empty (a False, "did
    # not move", would say it still held version 2; the chaos test caught that).
    new.call("unpublish")
    publish_and_wait_checksums(srv, new, 3)
    reader.send("update", "latest", 60.0)
    wait_until(lambda: _landed(srv, "rollout", 3) > 0, 30, "the reader to land bytes of version 3")
    new.kill()
    with pytest.raises(RemoteError) as err:
        reader.result(60.0)
    assert err.value.kind == "VersionLost", err.value
    assert reader.call("state") == (None, True)


def test_a_rollout_restarted_under_its_old_name_fences_the_old_incarnation(srv, handles):
    trainer = handles("trainer", server=srv.address, scale=SCALE)
    old = handles("rollout", server=srv.address, scale=SCALE)
    for h in (trainer, old):
        h.call("register")
    publish_and_wait_checksums(srv, trainer, 1)
    assert old.call("replicate", 1, 30.0) == 1
    old.kill()  # the server still knows it (heartbeats expire in 1 s)
    new = handles("rollout", server=srv.address, scale=SCALE)
    new.call("register")
    assert new.call("replicate", 1, 30.0) == 1
    assert new.call("holds", 1)
    trainer.call("unpublish")
    publish_and_wait_checksums(srv, trainer, 2)
    assert new.call("update", "latest", 30.0) is True
    assert new.call("holds", 2)
    wait_until(lambda: srv.counts()["sessions"] == 2, 10, "only the trainer and the new rollout")


def test_a_lone_holder_blamed_for_wire_damage_is_readmitted_once_its_self_check_passes(srv, handles):
    trainer = handles("trainer", server=srv.address, scale=SCALE)
    damaged = {"tcp": {"faults": [{"op": "corrupt", "at": 1000, "times": 1}]}}  # one flipped byte on the way
    reader = handles("rollout", server=srv.address, scale=SCALE, transports=damaged)
    for h in (trainer, reader):
        h.call("register")
    publish_and_wait_checksums(srv, trainer, 1)
    assert reader.call("replicate", 1, 30.0) == 1  # waited for the self-check, then read it again
    assert reader.call("holds", 1)
    assert reader.call("fired") == ["corrupt"]
    assert reader.call("last_sources") == ["trainer/0", "trainer/0"]
    assert srv.stats()["quarantined"] == 0


@pytest.fixture
def srv_quick_drain():
    s = InprocServer(heartbeat_interval=0.1, heartbeat_timeout=1.0, drain_timeout=0.5)
    yield s
    s.close()


def test_an_unpublish_revokes_a_slow_reader_at_the_drain_timeout_and_it_resumes_elsewhere(srv_quick_drain, handles):
    srv = srv_quick_drain
    trainer = handles("trainer", server=srv.address, scale=SCALE, env=BIG)
    backup = handles("trainer-b", server=srv.address, scale=SCALE, env=BIG)
    reader = handles("rollout", server=srv.address, scale=SCALE, env=MANY, transports=SLOW)
    for h in (trainer, backup, reader):
        h.call("register")
    publish_and_wait_checksums(srv, trainer, 1)
    reader.send("replicate", 1, 60.0)
    wait_until(lambda: srv.counts()["grants"] == 1, 30, "the reader's grant")
    publish_and_wait_checksums(srv, backup, 1)
    t0 = time.monotonic()
    trainer.call("unpublish", timeout=20.0)  # the reader still pulls: revoked at 0.5 s
    assert time.monotonic() - t0 < 15  # a hang's bound (the call's timeout is 20 s)
    assert reader.result(60.0) == 1
    assert reader.call("holds", 1)
    assert reader.call("last_sources") == ["trainer/0", "trainer-b/0"]
    assert srv.stats()["revoked"] >= 1
