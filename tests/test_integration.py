"""The running system end to end: a real server process (or a real in-process server actor
where the test inspects its table), shard handles in real worker processes, real ZeroMQ and
real TCP pulls on 127.0.0.1. Bytes are compared with what the publisher wrote."""

from __future__ import annotations

import time

import pytest

from .procs import RemoteError, ServerProcess, wait_until

pytestmark = pytest.mark.integration

SLOW = {"TENSORHUB_CHUNK_BYTES": str(256 << 10)}  # many chunks per pull, so that pulls can be watched
SCALE = 100  # ~4 MB shards


@pytest.fixture
def server():
    s = ServerProcess()
    yield s
    assert s.alive(), f"the server died: {s.stderr()}"
    assert s.stop() == 0


def test_trainer_publishes_rollouts_replicate_and_update(server, handles):
    trainer = handles("trainer", server=server.address)
    rollouts = [handles(f"rollout-{i}", server=server.address) for i in range(3)]
    for h in (trainer, *rollouts):
        h.call("register")
    trainer.call("fill", 1)
    trainer.call("publish", 1)
    for r in rollouts:
        r.send("replicate", "latest", 30.0)
    for r in rollouts:
        assert r.result() == 1
        assert r.call("holds", 1)
    # A new step: the trainer unpublishes (rollouts hold v1, so no offload is needed), mutates, publishes.
    trainer.call("unpublish")
    trainer.call("fill", 2)
    trainer.call("publish", 2)
    for r in rollouts:
        r.send("update", "latest")
    assert [r.result() for r in rollouts] == [True, True, True]
    for r in rollouts:
        assert r.call("holds", 2)
        assert r.call("update", "latest") is False  # already at the latest
    listing = trainer.call("list")
    assert sorted(listing) == [2]
    assert listing[2] == sorted(["trainer", "rollout-0", "rollout-1", "rollout-2"])


def test_relative_versions_wait_and_list(server, handles):
    trainer = handles("trainer", server=server.address)
    other = handles("trainer-b", server=server.address)  # a second publisher keeps v1 alive
    reader = handles("rollout", server=server.address)
    for h in (trainer, other, reader):
        h.call("register")
    reader.send("wait_for", 2, 30.0)  # blocks until version 2 is available
    other.call("fill", 1)
    other.call("publish", 1)
    trainer.call("fill", 2)
    trainer.call("publish", 2)
    assert reader.result() == [1, 2]
    assert reader.call("replicate", "latest-1", 30.0) == 1
    assert reader.call("holds", 1)
    assert reader.call("update", "latest") is True
    assert reader.call("holds", 2)
    assert reader.call("update", "latest-1") is True  # an absolute target that differs: moves back
    assert reader.call("holds", 1)
    listing = reader.call("list")
    assert listing == {1: ["rollout", "trainer-b"], 2: ["trainer"]}
    with pytest.raises(RemoteError) as e:  # version 5 was never seen: waited for, within the timeout
        reader.call("replicate", 5, 0.5)
    assert e.value.kind == "Timeout"


def test_unpublish_blocks_while_a_reader_pulls(inproc_server, handles):
    addr = inproc_server.address
    holder = handles("trainer", server=addr, scale=SCALE)
    reader = handles("rollout", server=addr, scale=SCALE, env=SLOW, transports={"tcp": {"max_rate": 2.5e6}})
    holder.call("register")
    reader.call("register")
    holder.call("fill", 1)
    holder.call("publish", 1)
    reader.send("replicate", 1, 60.0)
    wait_until(lambda: inproc_server.counts()["grants"] == 1, 30, "the reader's grant")  # a ~1.7 s pull begins
    started = time.monotonic()
    holder.send("unpublish")
    assert reader.result() == 1
    pulled_at = reader.done_at
    holder.result()
    unpublished_at = holder.done_at
    assert unpublished_at - started > 0.5, "unpublish returned while the reader was still pulling"
    assert unpublished_at >= pulled_at - 0.1
    holder.call("fill", 2)  # the holder may write now; the reader's copy is its own
    assert reader.call("holds", 1)


def test_third_reader_is_served_by_a_partial_holder(inproc_server, handles):
    addr = inproc_server.address
    holder = handles("trainer", server=addr, scale=SCALE)
    slow = handles("rollout-slow", server=addr, scale=SCALE, env=SLOW, transports={"tcp": {"max_rate": 2.5e6}})
    fast = handles("rollout-fast", server=addr, scale=SCALE, env=SLOW)
    for h in (holder, slow, fast):
        h.call("register")
    holder.call("fill", 1)
    holder.call("publish", 1)
    slow.send("replicate", 1, 60.0)
    wait_until(lambda: inproc_server.counts()["grants"] == 1, 30, "the slow reader's grant")
    # The holder serves one reader; the partial holder none: the least loaded source is the partial one.
    assert fast.call("replicate", 1, 60.0) == 1
    assert slow.result() == 1
    assert fast.call("last_sources") == ["rollout-slow/0"]
    assert fast.call("holds", 1)
    assert slow.call("holds", 1)
    assert fast.done_at is not None


def test_model_parallel_replicas(server, handles):
    trainer = [handles("trainer", server=server.address, num_shards=2, shard_idx=i) for i in range(2)]
    rollout = [handles("rollout", server=server.address, num_shards=2, shard_idx=i) for i in range(2)]
    for h in (*trainer, *rollout):
        h.call("register")
    for h in trainer:
        h.call("fill", 3)
        h.send("publish", 3)
    for h in trainer:
        h.result()
    for h in rollout:
        h.send("replicate", "latest", 30.0)
    assert [h.result() for h in rollout] == [3, 3]
    assert all(h.call("holds", 3) for h in rollout)
    assert rollout[0].call("list") == {3: ["rollout", "trainer"]}


def test_close_leaves_nothing_behind_on_the_server(inproc_server, handles):
    addr = inproc_server.address
    trainer = handles("trainer", server=addr)
    rollouts = [handles(f"rollout-{i}", server=addr) for i in range(2)]
    for h in (trainer, *rollouts):
        h.call("register")
    trainer.call("fill", 1)
    trainer.call("publish", 1)
    for r in rollouts:
        assert r.call("replicate", 1, 30.0) == 1
    assert inproc_server.counts()["sessions"] == 3
    for h in (*rollouts, trainer):
        h.call("close")
    counts = inproc_server.counts()
    assert counts == {k: 0 for k in counts}, counts


def test_a_closed_handle_refuses_calls(server, handles):
    h = handles("rollout", server=server.address)
    h.call("close")
    with pytest.raises(RemoteError) as e:
        h.call("list")
    assert e.value.kind == "UsageError"


def test_a_source_with_no_transport_in_common_fails_the_pull_with_a_typed_error(server, handles):
    holder = handles("trainer", server=server.address)
    reader = handles("rollout", server=server.address, transports={})  # speaks no transport at all
    holder.call("register")
    reader.call("register")
    holder.call("fill", 1)
    holder.call("publish", 1)
    with pytest.raises(RemoteError) as e:
        reader.call("replicate", 1, 30.0)
    assert e.value.kind == "TransportError" and "rollout" in str(e.value)
    assert reader.call("list") == {1: ["trainer"]}  # nothing half-pulled is listed
