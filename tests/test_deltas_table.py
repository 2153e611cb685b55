"""Deltas in the reference table (sans-IO): the delta model (a layout per version, a base per
delta), the per-reader plan of an update, and landing a chain (``Replicate(held=...)``).

The plan's decisions are property-tested against :func:`tensorhub.core.deltas.plan_pull` per
shard: random published deltas (which versions, which shards, which sizes), random held
versions; hypothesis takes its seed from ``tests/conftest.py``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorhub.core import messages as m
from tensorhub.core.deltas import DELTAS, DeltaStep, plan_pull
from tensorhub.core.errors import InBucket, InvalidArgument, LayoutMismatch, VersionConflict, VersionUnavailable
from tensorhub.core.invariants import check_invariants
from tensorhub.core.naming import delta_model

from .table_driver import Driver, make_layout

MODEL = "actor"
DM = delta_model(MODEL)
FULL = make_layout(4096, 8192)  # 12288 bytes a shard
SUMS = {v: (v, v + 1) for v in range(1, 40)}  # a version's checksums (two units of FULL)


def blob(nbytes: int):
    return make_layout(nbytes)


def publish_delta(d: Driver, replica: str, shards: int, version: int, base: int, sizes: list[int]) -> list:
    """A trainer's delta side: one shard per delta version (the ring of the handles), publishing
    ``base -> version`` blobs of ``sizes[i]`` bytes."""
    out = []
    for i in range(shards):
        s = d.shard(f"{replica}@delta{version}", i, shards, model=DM, layout=blob(sizes[i]))
        s.expect_ok(s.request(m.Publish, s.session, s.next_call(), version, (version * 100 + i,), base))
        out.append(s)
    return out


def trainer_publish(trainer, version: int) -> None:
    for s in trainer:
        if s.call:
            s.expect_ok(s.unpublish())
        s.expect_ok(s.publish(version, SUMS[version]))


def update_deltas(shards) -> list:
    reqs = [s.request(m.Update, s.session, s.next_call(), "latest", None, False, True) for s in shards]
    return [s.expect_ok(r) for s, r in zip(shards, reqs)]


def test_plan_pull_apply_then_held_replicate_lands_without_bytes():
    d = Driver()
    trainer = d.replica("T", 2, layout=FULL)
    reader = d.replica("R", 2, layout=FULL)
    trainer_publish(trainer, 1)
    reqs = [s.pull(1) for s in reader]
    for s, r in zip(reader, reqs):
        assert s.expect_ok(r) == m.Replicated(r, 1)
    trainer_publish(trainer, 2)
    publish_delta(d, "T", 2, 2, 1, [300, 500])

    answers = update_deltas(reader)
    for i, a in enumerate(answers):
        assert a.moved is False and a.version == 1 and a.target == 2
        assert a.deltas == (m.DeltaRef(2, 1, [300, 500][i]),)
    assert d.table.stats["delta_plans"] == 1

    # pull the deltas (the delta model, the blob's layout), unpublish, claim what was applied
    side = [d.shard("R@delta", i, 2, model=DM, layout=blob([300, 500][i])) for i in range(2)]
    reqs = [s.pull(2) for s in side]
    for s, r in zip(side, reqs):
        assert s.expect_ok(r) == m.Replicated(r, 2)
    for s in reader:
        s.expect_ok(s.unpublish())
    reqs = [s.request(m.Replicate, s.session, s.next_call(), 2, None, SUMS[2]) for s in reader]
    assert not any(s.grants() for s in reader)  # nothing to pull: the buffers hold it
    for s, r in zip(reader, reqs):
        assert s.expect_ok(r) == m.Replicated(r, 2)
    assert d.table.stats["deltas_landed"] == 2
    # the reader holds v2 whole: a third replica can pull it from the reader
    listing = reader[0].list()
    assert {e.replica for v in listing.versions if v.version == 2 for e in v.replicas} >= {"R", "T"}
    check_invariants(d.table)


def test_held_claim_that_is_not_the_version_pulls_in_full():
    d = Driver()
    trainer = d.replica("T", 1, layout=FULL)
    reader = d.replica("R", 1, layout=FULL)
    trainer_publish(trainer, 1)
    trainer_publish(trainer, 2)
    (r,) = reader
    req = r.request(m.Replicate, r.session, r.next_call(), 2, None, (7, 7))
    g = r.grant()  # refused: a full pull
    assert g.version == 2
    r.complete(g)
    assert r.expect_ok(req) == m.Replicated(req, 2)
    assert d.table.stats["deltas_refused"] == 1 and d.table.stats["deltas_landed"] == 0


def test_without_deltas_or_without_a_chain_the_update_moves():
    d = Driver()
    trainer = d.replica("T", 1, layout=FULL)
    (r,) = d.replica("R", 1, layout=FULL)
    trainer_publish(trainer, 1)
    r.expect_ok(r.pull(1))
    trainer_publish(trainer, 2)
    publish_delta(d, "T", 1, 2, 1, [100])
    req = r.update()  # no deltas flag: a full pull
    r.complete(r.grant())
    assert r.expect_ok(req) == m.Updated(req, True, 2)
    trainer_publish(trainer, 3)
    publish_delta(d, "T", 1, 3, 2, [20000])  # bigger than the shard: full
    req = r.request(m.Update, r.session, r.next_call(), "latest", None, False, True)
    r.complete(r.grant())
    assert r.expect_ok(req) == m.Updated(req, True, 3)
    assert d.table.stats["delta_plans"] == 0


def test_shards_with_different_chains_pull_in_full():
    d = Driver()
    trainer = d.replica("T", 2, layout=FULL)
    reader = d.replica("R", 2, layout=FULL)
    trainer_publish(trainer, 1)
    for s, r in zip(reader, [s.pull(1) for s in reader]):
        s.expect_ok(r)
    trainer_publish(trainer, 2)
    # only shard 0 has a delta: shard 1 would pull full, so the replica moves in full
    s0 = d.shard("T@delta2", 0, 2, model=DM, layout=blob(100))
    s0.expect_ok(s0.request(m.Publish, s0.session, s0.next_call(), 2, (1,), 1))
    reqs = [s.request(m.Update, s.session, s.next_call(), "latest", None, False, True) for s in reader]
    for s in reader:
        s.complete(s.grant())
    for s, r in zip(reader, reqs):
        assert s.expect_ok(r) == m.Updated(r, True, 2)


def test_delta_model_publish_and_register_errors():
    d = Driver()
    (t,) = d.replica("T", 1, layout=FULL)
    err = t.expect_error(t.request(m.Publish, t.session, t.next_call(), 1, None, 0), InvalidArgument)
    assert "only a delta model" in str(err)
    (x,) = d.replica("X", 1, model=DM, layout=blob(100))
    err = x.expect_error(x.request(m.Publish, x.session, x.next_call(), 2, None), InvalidArgument)
    assert "base" in str(err)
    x.expect_ok(x.request(m.Publish, x.session, x.next_call(), 2, (5,), 1))
    (y,) = d.replica("Y", 1, model=DM, layout=blob(100))
    y.expect_error(y.request(m.Publish, y.session, y.next_call(), 2, (5,), 0), VersionConflict)
    (z,) = d.replica("Z", 1, model=DM, layout=blob(64))  # a delta model registers any blob layout
    z.expect_error(z.request(m.Publish, z.session, z.next_call(), 2, (5,), 1), LayoutMismatch)
    err = z.expect_error(z.replicate(2), LayoutMismatch)  # a reader must register the delta's own layout
    assert "100 bytes" in str(err)
    with pytest.raises(ValueError, match="goes forward"):
        m.Publish(1, 1, 1, 2, None, 2)


@given(
    shards=st.integers(1, 3),
    held=st.integers(0, 4),
    wanted_ahead=st.integers(1, 4),
    chain_sizes=st.none() | st.lists(st.integers(1, 6000), min_size=12, max_size=12),
    deltas=st.lists(
        st.tuples(st.integers(0, 8), st.integers(1, 3), st.integers(0, 2), st.integers(1, 15000)),
        max_size=6,
    ),
)
def test_plan_matches_plan_pull_per_shard(shards, held, wanted_ahead, chain_sizes, deltas):
    """Property: the replica gets a chain exactly when plan_pull gives every shard a chain, the
    same versions for all; each shard's refs are its own chain's steps."""
    d = Driver()
    wanted = held + wanted_ahead
    trainer = d.replica("T", shards, layout=FULL)
    reader = d.replica("R", shards, layout=FULL)
    trainer_publish(trainer, held + 1)  # SUMS index from 1
    for s, r in zip(reader, [s.pull(held + 1) for s in reader]):
        s.expect_ok(r)
    trainer_publish(trainer, wanted + 1)
    published: dict[tuple[int, int], tuple[int, int]] = {}  # (version, shard) -> (base, size)
    if chain_sizes is not None:  # one-step deltas held -> ... -> wanted on every shard
        deltas = [
            (v, 1, i, chain_sizes[(v - held) * 3 + i]) for v in range(held, wanted) for i in range(shards)
        ] + deltas
    for k, (base, span, shard, size) in enumerate(deltas):
        version = base + span + 1
        base += 1
        shard %= shards
        if (version, shard) in published:
            continue
        published[(version, shard)] = (base, size)
        s = d.shard(f"D{k}", shard, shards, model=DM, layout=blob(size))
        s.expect_ok(s.request(m.Publish, s.session, s.next_call(), version, (1,), base))
    plans = [
        plan_pull(held + 1, wanted + 1,
                  [DeltaStep(b, v, n) for (v, i), (b, n) in published.items() if i == idx], FULL.total_bytes)
        for idx in range(shards)
    ]  # fmt: skip
    chains = {tuple(st.version for st in p.steps) for p in plans}
    expect = all(p.kind == DELTAS for p in plans) and len(chains) == 1
    answers = update_deltas(reader) if expect else None
    if expect:
        for idx, a in enumerate(answers):
            assert a.moved is False and a.target == wanted + 1
            assert a.deltas == tuple(m.DeltaRef(st.version, st.base, st.nbytes) for st in plans[idx].steps)
    else:
        reqs = [s.request(m.Update, s.session, s.next_call(), "latest", None, False, True) for s in reader]
        for s in reader:
            s.complete(s.grant())
        for s, r in zip(reader, reqs):
            assert s.expect_ok(r) == m.Updated(r, True, wanted + 1)
    assert d.table.stats["delta_plans"] == int(expect)
    check_invariants(d.table)


def test_a_full_pull_waits_while_its_datacenter_lands_the_version_through_deltas():
    d = Driver()
    trainer = d.replica("T", 1, layout=FULL, dc="a")
    (b1,) = d.replica("B1", 1, layout=FULL, dc="b")
    (b2,) = d.replica("B2", 1, layout=FULL, dc="b")  # holds nothing: must pull in full
    trainer_publish(trainer, 1)
    b1.expect_ok(b1.pull(1))
    trainer_publish(trainer, 2)
    publish_delta(d, "T", 1, 2, 1, [100])
    (a,) = update_deltas([b1])
    assert a.deltas == (m.DeltaRef(2, 1, 100),)
    (side,) = [d.shard("B1@delta", 0, 1, model=DM, layout=blob(100), dc="b")]
    req = side.replicate(2)  # pulling the delta across: a partial delta holder in dc b
    g = side.grant()
    r = b2.update()
    assert b2.expect_ok(r) == m.Updated(r, False, None, 2)  # skipped: dc b is landing 2 through deltas
    side.complete(g)
    side.expect_ok(req)
    b1.expect_ok(b1.unpublish())
    r1 = b1.request(m.Replicate, b1.session, b1.next_call(), 2, None, SUMS[2])
    b1.expect_ok(r1)
    r = b2.update()  # now a holder of 2 is in dc b: pull from it
    g = b2.grant()
    assert g.source.replica == "B1"
    b2.complete(g)
    assert b2.expect_ok(r) == m.Updated(r, True, 2)


def test_readers_wait_for_an_announced_delta_then_plan_it_and_skip_behind_their_datacenter():
    d = Driver()
    (t,) = d.replica("T", 1, layout=FULL, dc="a")
    (b1,) = d.replica("B1", 1, layout=FULL, dc="b")
    (b2,) = d.replica("B2", 1, layout=FULL, dc="b")
    trainer_publish([t], 1)
    for b in (b1, b2):
        b.expect_ok(b.pull(1))
    t.expect_ok(t.unpublish())
    t.expect_ok(t.request(m.Publish, t.session, t.next_call(), 2, SUMS[2], None, 1))  # its delta follows
    (a,) = update_deltas([b1])
    assert a == m.Updated(a.req, False, 1, 2)  # not yet: the delta is on its way
    publish_delta(d, "T", 1, 2, 1, [100])
    (a,) = update_deltas([b1])
    assert a.deltas == (m.DeltaRef(2, 1, 100),)
    side = d.shard("B1@delta", 0, 1, model=DM, layout=blob(100), dc="b")
    req = side.replicate(2)
    g = side.grant()  # across, from dc a
    (a,) = update_deltas([b2])
    assert a.deltas is None and a.skipped == 2  # dc b is pulling the delta across: wait for it
    side.complete(g)
    side.expect_ok(req)
    (a,) = update_deltas([b2])
    assert a.deltas == (m.DeltaRef(2, 1, 100),)
    side2 = d.shard("B2@delta", 0, 1, model=DM, layout=blob(100), dc="b")
    req = side2.replicate(2)
    g = side2.grant()
    assert g.source.replica == "B1@delta"  # inside dc b
    d.clock.t += 60
    trainer_publish([t], 3)  # announced nothing: no wait
    t2 = d.table.models[MODEL].versions[3]
    assert not t2.delta_pending


def test_an_announced_delta_that_never_comes_is_waited_for_a_bounded_time():
    d = Driver()
    (t,) = d.replica("T", 1, layout=FULL)
    (r,) = d.replica("R", 1, layout=FULL)
    trainer_publish([t], 1)
    r.expect_ok(r.pull(1))
    t.expect_ok(t.unpublish())
    t.expect_ok(t.request(m.Publish, t.session, t.next_call(), 2, SUMS[2], None, 1))
    (a,) = update_deltas([r])
    assert a.skipped == 2
    d.run_for(d.table.config.heartbeat_timeout + 1)
    t.heartbeat()
    r.heartbeat()
    req = r.request(m.Update, r.session, r.next_call(), "latest", None, False, True)
    r.complete(r.grant())
    assert r.expect_ok(req) == m.Updated(req, True, 2)


def test_the_first_replica_of_a_datacenter_planned_a_chain_is_its_delta_seeder_at_once():
    """Its pull shows up only after a few round trips: the others skip from the plan on."""
    d = Driver()
    (t,) = d.replica("T", 1, layout=FULL, dc="a")
    b = [d.replica(f"B{i}", 1, layout=FULL, dc="b")[0] for i in range(3)]
    trainer_publish([t], 1)
    for x in b:
        x.expect_ok(x.pull(1))
    trainer_publish([t], 2)
    publish_delta(d, "T", 1, 2, 1, [100])
    (a0,) = update_deltas([b[0]])
    assert a0.deltas == (m.DeltaRef(2, 1, 100),)  # the seeder: nothing of the chain in dc b yet
    (a1,) = update_deltas([b[1]])
    assert a1.deltas is None and a1.skipped == 2  # before the seeder's pull even began
    side = d.shard("B0@delta", 0, 1, model=DM, layout=blob(100), dc="b")
    side.expect_ok(side.pull(2))  # the delta is whole in dc b now
    for x in b[1:]:
        (a,) = update_deltas([x])
        assert a.deltas == (m.DeltaRef(2, 1, 100),)
    assert not d.table.models[MODEL].delta_seeds  # forgotten once the chain is in the datacenter


def test_the_bucket_is_a_source_of_last_resort_named_when_no_peer_can_serve():
    d = Driver()
    (t,) = d.replica("T", 1, layout=FULL)
    trainer_publish([t], 1)
    url = "s3://weights/actor"
    t.expect_ok(t.request(m.BucketStored, t.session, 1, url))
    (r,) = d.replica("R", 1, layout=FULL)
    req = r.replicate(1)
    g = r.grant()  # a peer that can serve comes first
    assert g.source.replica == "T"
    for _ in range(10):  # the peer is unreachable from this reader: every try fails
        r.source_failed(g)
        gs = r.grants()
        if not gs:
            break
        (g,) = gs
    err = r.expect_error(req, InBucket)
    assert err.bucket == url and err.version == 1 and url in str(err)
    assert isinstance(err, VersionUnavailable)
    (x,) = d.replica("X", 1, model=DM, layout=blob(10))
    x.expect_error(x.request(m.BucketStored, x.session, 1, url), InvalidArgument)
    with pytest.raises(ValueError):
        m.BucketStored(1, 1, 1, "")
    for v in range(2, 2 + 70):  # the newest 64 versions are remembered
        t.expect_ok(t.request(m.BucketStored, t.session, v, url))
    assert min(d.table.models[MODEL].buckets) == (70 + 2 - 64, 0)


def test_the_bucket_is_offered_after_the_last_holder_has_gone():
    """Issue 36 (4): once the only peer holder of a version has closed, a replicate of it (no
    timeout) is told InBucket at once rather than waiting, and the restore's claim is taken."""
    d = Driver()
    d.advance(11)  # past the start-up grace period (during it, a missing version may still be announced)
    (t,) = d.replica("T", 1, layout=FULL)
    trainer_publish([t], 1)
    url = "file:///weights"
    t.expect_ok(t.request(m.BucketStored, t.session, 1, url))
    (r,) = d.replica("R", 1, layout=FULL)
    t.expect_ok(t.close())  # the last holder is gone
    err = r.expect_error(r.replicate(1), InBucket)
    assert err.bucket == url and err.version == 1
    bad = tuple(x + 1 for x in SUMS[1])  # a restore that does not hold version 1: not taken
    r.expect_error(r.request(m.Replicate, r.session, r.next_call(), 1, None, bad), InBucket)
    reply = r.expect_ok(r.request(m.Replicate, r.session, r.next_call(), 1, None, SUMS[1]))
    assert isinstance(reply, m.Replicated) and reply.version == 1
    assert [v.version for v in r.list().versions] == [1]  # available again, from the restored copy
    (q,) = d.replica("Q", 1, layout=FULL)
    q.expect_ok(q.pull(1))  # and served to peers


def test_bucket_copies_are_remembered_after_every_session_closed():
    """A reader that opens after every holder (and every session) of the model left is still
    told InBucket for a version the bucket holds."""
    d = Driver()
    d.advance(11)
    (t,) = d.replica("T", 1, layout=FULL)
    trainer_publish([t], 1)
    t.expect_ok(t.request(m.BucketStored, t.session, 1, "file:///weights"))
    t.expect_ok(t.close())
    assert MODEL not in d.table.models  # its record is gone
    (r,) = d.replica("R", 1, layout=FULL)
    assert r.expect_error(r.replicate(1), InBucket).bucket == "file:///weights"
    r.expect_ok(r.request(m.Replicate, r.session, r.next_call(), 1, None, SUMS[1]))
