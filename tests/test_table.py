"""Unit tests of the reference table, one behaviour of DESIGN.md §5 at a time."""

from __future__ import annotations

import pytest

from tensorhub.core import errors as e
from tensorhub.core import messages as m
from tensorhub.core.invariants import assert_invariants, check_invariants
from tensorhub.core.table import TableConfig

from .table_driver import LAYOUT, Driver, complete_all, make_layout


@pytest.fixture
def d() -> Driver:
    drv = Driver()
    drv.advance(11)  # past the start-up grace period
    yield drv
    assert_invariants(drv.table)


def published(d: Driver, name: str = "trainer", version: int = 1, num_shards: int = 1, **kw):
    shards = d.replica(name, num_shards, **kw)
    for s in shards:
        s.expect_ok(s.publish(version))
    return shards


def close_all(d: Driver) -> None:
    for s in list(d.shards.values()):
        if s.session in d.table.sessions:
            s.expect_ok(s.close())
    assert d.table.counts() == dict.fromkeys(d.table.counts(), 0)


# --- sessions, fencing ------------------------------------------------------------------------


def test_open_gives_session_and_term(d):
    s = d.shard("r")
    assert s.session in d.table.sessions
    again = s.open()  # the same incarnation opening again is the same session
    assert again.session == s.session and again.term == d.table.term


def test_num_shards_must_agree_within_a_model(d):
    d.shard("a", 0, 2)
    with pytest.raises(e.LayoutMismatch, match="num_shards"):
        d.shard("b", 0, 4)
    assert len(d.table.sessions) == 1


def test_new_incarnation_fences_the_old_replica(d):
    old = d.replica("r", 2)
    for s in old:
        s.expect_ok(s.publish(3))
    new0 = d.shard("r", 0, 2, incarnation="i2")
    # Both old shards are told, their holdings are gone, and the old session is fenced.
    for s in old:
        assert [x.code for x in s.take(m.Removed)] == ["fenced"]
    assert d.table.sessions.keys() == {new0.session}
    req = old[1].publish(4)
    old[1].expect_error(req, e.Fenced)
    assert new0.list().versions == ()


def test_unknown_session_is_a_typed_error(d):
    s = d.shard("r", open=False)
    s.session = 999
    s.expect_error(s.publish(1), e.UnknownSession)


def test_stale_session_id_of_another_process_is_unknown_not_adopted():
    """A client of an earlier server process heartbeats its old session id (1) to the new
    process: the id is unknown there (the client re-opens) and no session changes peer."""
    import random

    from tensorhub.core.table import ReferenceTable, random_first_id
    from tensorhub.scheduling.selection import SourceIndex

    first = random_first_id(random.Random(7))
    d = Driver()
    d.table = ReferenceTable(d.clock, random.Random(0), TableConfig(), term=2, sources=SourceIndex, first_id=first)
    d.advance(11)
    s = d.shard("r")
    assert s.session >= first
    ack = d.send("stale-client", m.Heartbeat(1, (1, s.session - first + 1)))[-1][1]
    assert isinstance(ack, m.HeartbeatAck) and set(ack.unknown) == {1, s.session - first + 1} - {s.session}
    assert d.table.sessions[s.session].peer == s.peer
    for bad in (0, 2**52, -3, 1.5):
        with pytest.raises(ValueError, match="first_id"):
            ReferenceTable(d.clock, random.Random(0), TableConfig(), sources=SourceIndex, first_id=bad)


def test_spot_must_agree_within_a_replica(d):
    d.shard("r", 0, 2, spot=True)
    with pytest.raises(e.ContractViolation, match="spot"):
        d.shard("r", 1, 2, spot=False)


# --- layouts ----------------------------------------------------------------------------------


def test_layout_mismatch_changes_nothing(d):
    d.shard("a")
    b = d.shard("b", layout=None)
    err = b.expect_error(b.register(make_layout(4096, 4096)), e.LayoutMismatch)
    assert "t1" in str(err) and "replica='b'" in str(err)
    b.expect_ok(b.register(LAYOUT))


def test_layout_is_forgotten_when_nobody_uses_it(d):
    a = d.shard("a")
    a.expect_ok(a.unregister())
    a.expect_ok(a.register(make_layout(100)))


def test_register_twice_and_unregister_rules(d):
    a = d.shard("a")
    a.expect_error(a.register(LAYOUT), e.ContractViolation)
    a.expect_ok(a.publish(1))
    a.expect_error(a.unregister(), e.ContractViolation)
    b = d.shard("b", layout=None)
    b.expect_error(b.unregister(), e.NotRegistered)


# --- publish and checksums ----------------------------------------------------------------------


def test_publish_before_register(d):
    s = d.shard("a", layout=None)
    s.expect_error(s.publish(1), e.NotRegistered)
    assert d.table.counts()["holders"] == 0


def test_publish_while_holding_another_version(d):
    (s,) = published(d, version=1)
    s.expect_error(s.publish(2), e.ContractViolation)


def test_version_conflict_on_publish(d):
    n = LAYOUT.checksum_count()
    a = d.shard("a")
    a.expect_ok(a.publish(5, (1,) * n))
    b = d.shard("b")
    b.expect_error(b.publish(5, (2,) * n), e.VersionConflict)
    b.expect_error(b.publish(5, (1,) * (n + 1)), e.InvalidArgument)
    assert [h.session.replica.name for h in d.table.holders()] == ["a"]


def test_late_conflicting_checksums_quarantine_the_holding(d):
    # Both publish before either declared (the race a publish without checksums leaves open).
    n = LAYOUT.checksum_count()
    a = d.shard("a")
    a.expect_ok(a.publish(5))
    b = d.shard("b")
    b.expect_ok(b.publish(5))
    a.expect_ok(a.request(m.DeclareChecksums, a.session, 5, (1,) * n))
    b.expect_error(b.request(m.DeclareChecksums, b.session, 5, (2,) * n), e.VersionConflict)
    assert b.take(m.Quarantined)
    assert [h.session.replica.name for h in d.table.holders()] == ["a"]


def test_publish_of_a_known_version_must_prove_its_bytes(d):
    """Issue 36 (1), (5): a version number whose checksums are known is published only with
    checksums, and other ones are refused with VersionConflict naming model, version, replica."""
    n = LAYOUT.checksum_count()
    a = d.shard("a")
    a.expect_ok(a.publish(5, (1,) * n))
    b = d.shard("b")
    before = d.table.counts()
    call = b.next_call()
    b.expect_error(b.request(m.Publish, b.session, call, 5, None), e.ChecksumsRequired)
    assert d.table.counts() == before  # nothing changed: the same call is made again with checksums
    err = b.expect_error(b.request(m.Publish, b.session, call, 5, (2,) * n), e.VersionConflict)
    assert (err.model, err.version, err.replica) == ("actor", 5, "b")
    assert [h.session.replica.name for h in d.table.holders()] == ["a"]
    c = d.shard("c")
    call = c.next_call()
    c.expect_error(c.request(m.Publish, c.session, call, 5, None), e.ChecksumsRequired)
    c.expect_ok(c.request(m.Publish, c.session, call, 5, (1,) * n))  # the same bytes: a holder like a
    assert sorted(h.session.replica.name for h in d.table.holders()) == ["a", "c"]


def test_republish_after_unpublish_with_other_bytes_is_refused(d):
    """Issue 36 (1): publish(1); unpublish(); <tensors change>; publish(1) is refused while the
    version is known (here kept by its offload copy), and the offload copy stays."""
    n = LAYOUT.checksum_count()
    t = d.shard("t", retain=0)
    t.expect_ok(t.publish(1, (1,) * n))
    req = t.unpublish()
    (ask,) = t.take(m.OffloadRequest)
    t.expect_ok(t.request(m.PublishOffload, t.session, 1, True))
    t.expect_ok(req)
    call = t.next_call()
    t.expect_error(t.request(m.Publish, t.session, call, 1, None), e.ChecksumsRequired)
    t.expect_error(t.request(m.Publish, t.session, call, 1, (9,) * n), e.VersionConflict)
    assert [(h.kind, h.checksums) for h in d.table.holders()] == [(m.KIND_OFFLOAD, (1,) * n)]
    r = d.shard("r")
    r.expect_ok(r.pull(1))  # readers get the version's bytes, never the changed ones


def test_a_reader_of_a_version_that_cannot_complete_fails_without_a_timeout(d):
    """Issue 36 (1): a reader pulling from the only holder, whose bytes then turn out to conflict
    with the version's, ends with a typed error although it gave no timeout."""
    n = LAYOUT.checksum_count()
    a = d.shard("a")
    a.expect_ok(a.publish(3))
    b = d.shard("b")
    b.expect_ok(b.publish(3))
    a.expect_ok(a.request(m.DeclareChecksums, a.session, 3, (1,) * n))
    a.expect_ok(a.close())  # the good copy goes
    r = d.shard("r")
    req = r.replicate(3)  # no timeout
    assert r.grants()  # from b, the only holder left
    b.expect_error(b.request(m.DeclareChecksums, b.session, 3, (2,) * n), e.VersionConflict)
    r.expect_error(req, e.VersionUnavailable)


def test_checksums_reach_readers_that_started_without_them(d):
    n = LAYOUT.checksum_count()
    (t,) = published(d)
    r = d.shard("r")
    r.replicate(1)
    g = r.grant()
    assert g.checksums is None
    t.expect_ok(t.request(m.DeclareChecksums, t.session, 1, (7,) * n))
    (ready,) = r.take(m.ChecksumsReady)
    assert ready.grant == g.grant and ready.checksums == (7,) * n


def test_divergent_publish_across_shards(d):
    a0, a1 = d.replica("t", 2)
    a0.expect_ok(a0.publish(1))
    err = a1.expect_error(a1.publish(2), e.ContractViolation)
    assert "publish(1)" in str(err)


# --- version resolution -------------------------------------------------------------------------


def test_replicate_latest_waits_for_a_first_version(d):
    r = d.shard("r")
    req = r.replicate("latest")
    assert r.inbox == []
    published(d, version=4)
    r.complete(r.grant())
    assert r.expect_ok(req).version == 4


def test_never_seen_version_is_waited_for(d):
    published(d, version=1)
    r = d.shard("r")
    req = r.replicate(7)
    assert r.inbox == []
    published(d, "t2", version=7)
    r.complete(r.grant())
    assert r.expect_ok(req).version == 7


def test_gone_version_raises_at_once(d):
    (t,) = published(d, version=1)
    t.expect_ok(t.unpublish())
    r = d.shard("r")
    r.expect_error(r.replicate(1), e.VersionUnavailable)


def test_gone_version_waits_during_the_grace_period():
    d = Driver()
    (t,) = published(d, version=1)
    t.expect_ok(t.unpublish())
    r = d.shard("r")
    req = r.replicate(1)
    assert r.reply(req) is None
    d.run_for(5)
    assert r.reply(req) is None
    d.run_for(6)  # the grace period is over: gone
    r.expect_error(req, e.VersionUnavailable)


def test_relative_versions(d):
    for name, v in (("a", 3), ("b", 4), ("c", 5)):
        published(d, name, version=v)
    r = d.shard("r")
    req = r.pull("latest-1")
    assert r.expect_ok(req).version == 4
    q = d.shard("q")
    q.expect_error(q.replicate("latest-9"), e.VersionUnavailable)


def test_replicate_timeout_is_decided_by_the_transaction(d):
    r0, r1 = d.replica("r", 2)
    q0 = r0.replicate(3, timeout=5)
    d.advance(6)
    r0.expect_error(q0, e.Timeout)
    q1 = r1.replicate(3)  # the other shard joins late: same answer
    r1.expect_error(q1, e.Timeout)
    assert d.table.counts()["transactions"] == 0


# --- source selection ---------------------------------------------------------------------------


def test_pipeline_chain_in_a_burst(d):
    published(d)
    readers = [d.shard(f"r{i}") for i in range(4)]
    grants = []
    for r in readers:
        r.replicate(1)
        grants.append(r.grant())
    assert [g.source.replica for g in grants] == ["trainer", "r0", "r1", "r2"]
    for r, g in zip(readers, grants):
        r.complete(g)
    for r in readers:
        assert isinstance(r.take(m.Replicated)[0], m.Replicated)


def test_same_datacenter_first_then_cross(d):
    published(d, "t-east", dc="east")
    published(d, "t-west", dc="west")
    r = d.shard("r", dc="west")
    r.replicate(1)
    assert r.grant().source.replica == "t-west"
    far = d.shard("far", dc="north")
    far.replicate(1)
    assert far.grant().source.replica in ("t-east", "t-west")


def test_complete_holders_win_ties_then_same_host(d):
    published(d, "t1", host="h1")
    published(d, "t2", host="h2")
    r = d.shard("r", host="h2")
    r.replicate(1)
    assert r.grant().source.replica == "t2"


def test_one_source_replica_per_reader_replica(d):
    published(d, "a", num_shards=2)
    published(d, "b", num_shards=2)
    r = d.replica("r", 2)
    for s in r:
        s.replicate(1)
    chosen = {s.grant().source.replica for s in r}
    assert len(chosen) == 1


def test_never_a_source_downstream_of_the_reader(d):
    (t,) = published(d)
    a, b = d.shard("a"), d.shard("b")
    a.replicate(1)
    ga = a.grant()
    b.replicate(1)
    assert b.grant().source.replica == "a"
    # a's source fails: a must not be re-granted b (b pulls from a); it retries the trainer.
    a.source_failed(ga)
    g = a.grant()
    assert g.source.replica == "trainer"
    for _ in range(5):  # the only possible source keeps failing a: a retries a bounded number of times
        a.source_failed(g)
        gs = a.grants()
        if not gs:
            break
        g = gs[0]
    assert isinstance(a.take(m.Failed)[0].error(), e.TransportError)
    # b, downstream of a, is told and pulls from the trainer instead.
    assert b.take(m.Revoke)
    assert b.grant().source.replica == "trainer"


# --- complete, failures, checksums --------------------------------------------------------------


def test_source_failure_regrants_and_keeps_progress(d):
    published(d, "t1")
    published(d, "t2")
    r = d.shard("r")
    req = r.replicate(1)
    g1 = r.grant()
    r.progress(g1, 4096)
    r.source_failed(g1, verified=4096)
    g2 = r.grant()
    assert g2.source.replica != g1.source.replica
    reader = d.table.sessions[r.session].holder
    assert reader.verified == 4096 and g1.source.session in [h.session.id for h in d.table.holders()]
    r.complete(g2)
    assert r.expect_ok(req).version == 1


def test_checksum_mismatch_excludes_then_self_check_quarantines(d):
    t1 = published(d, "t1")[0]
    published(d, "t2")
    r = d.shard("r")
    req = r.replicate(1)
    g1 = r.grant()
    bad = d.shards[[p for p, s in d.shards.items() if s.session == g1.source.session][0]]
    r.checksum_failed(g1)
    g2 = r.grant()
    assert g2.source.session != g1.source.session
    (vr,) = bad.take(m.VerifyRequest)
    bad.expect_ok(bad.request(m.VerifyResult, bad.session, 1, False))
    assert bad.take(m.Quarantined)
    assert bad.session not in [h.session.id for h in d.table.holders()]
    r.complete(g2)
    r.expect_ok(req)
    assert t1 is not None


def test_two_replicas_reporting_quarantine_without_self_check(d):
    bad = published(d, "t1", dc="dc0")[0]
    published(d, "t2", dc="dc1")
    r1, r2 = d.shard("r1", dc="dc0"), d.shard("r2", dc="dc0")
    q1 = r1.replicate(1)
    g1 = r1.grant()
    assert g1.source.replica == "t1"  # same datacenter
    r1.checksum_failed(g1)
    assert r1.grant().source.replica == "t2"  # excluded for r1 only
    assert bad.take(m.VerifyRequest)  # t1 is asked to check itself; it does not answer yet
    r2.replicate(1)
    g2 = r2.grant()
    assert g2.source.replica == "t1"  # still serving others: one report is not enough
    r2.checksum_failed(g2)
    assert d.table.stats["quarantined"] == 1 and bad.take(m.Quarantined)
    assert r2.grant().source.replica in ("t2", "r1")
    assert r1.reply(q1) is None


def test_mismatch_on_a_revoked_grant_blames_nobody(d):
    published(d, "t1")
    published(d, "t2")
    r = d.shard("r")
    r.replicate(1)
    g = r.grant()
    src = next(s for s in d.shards.values() if s.session == g.source.session)
    src.unpublish()
    d.run_for(31)  # drain timeout: the grant is revoked
    assert r.take(m.Revoke)
    r.checksum_failed(g)
    assert not src.take(m.VerifyRequest) and d.table.stats["quarantined"] == 0


def test_partial_fails_when_no_complete_holder_is_left(d):
    (t,) = published(d)
    r = d.shard("r")
    req = r.replicate(1)
    r.grant()
    d.advance(9)
    r.heartbeat()
    d.advance(2)  # the trainer missed its heartbeats
    r.expect_error(req, e.VersionUnavailable)
    assert d.table.counts()["holders"] == 0


# --- unpublish and drain ------------------------------------------------------------------------


def test_unpublish_waits_for_readers_to_drain(d):
    (t,) = published(d)
    r = d.shard("r")
    r.replicate(1)
    g = r.grant()
    req = t.unpublish()
    assert t.reply(req) is None
    rr = d.shard("late")
    rr.expect_error(rr.replicate(1), e.VersionUnavailable)  # unpublishing: no new grants; r is partial
    r.complete(g)
    t.expect_ok(req)


def test_drain_timeout_revokes(d):
    (t,) = published(d)
    published(d, "t2")
    r = d.shard("r")
    r.replicate(1)
    g = r.grant()
    src = next(s for s in d.shards.values() if s.session == g.source.session)
    req = src.unpublish()
    d.run_for(29)
    assert src.reply(req) is None
    d.run_for(2)
    src.expect_ok(req)
    assert [x.grant for x in r.take(m.Revoke)] == [g.grant]
    assert r.grant().source.session != src.session


# --- retention and offload ----------------------------------------------------------------------


def test_last_retained_copy_is_offloaded_first(d):
    (t,) = published(d, retain=0)
    req = t.unpublish()
    (o,) = t.take(m.OffloadRequest)
    assert t.reply(req) is None
    t.expect_ok(t.request(m.PublishOffload, t.session, o.version, True))
    t.expect_ok(req)
    listing = d.shard("x").list()
    assert listing.versions[0].replicas[0].kind == "offload"
    # A reader gets it from the offload copy; the copy is then released.
    r = d.shard("r")
    q = r.replicate(1)
    g = r.grant()
    assert g.source.kind == "offload"
    r.complete(g)
    r.expect_ok(q)
    assert t.take(m.FreeOffload) == [m.FreeOffload(t.session, 1)]


def test_newer_version_releases_offload_copies(d):
    (t,) = published(d, retain=0)
    req = t.unpublish()
    t.expect_ok(t.request(m.PublishOffload, t.session, 1, True))
    t.expect_ok(req)
    t.expect_ok(t.publish(2))
    assert t.take(m.FreeOffload) == [m.FreeOffload(t.session, 1)]


def _unpublish_with_offload(t, version: int) -> int:
    """The trainer shard unpublishes ``version``, the last copy of it: it is asked to offload
    first and does. Returns the unpublish request (answered once its readers drained)."""
    req = t.unpublish()
    (o,) = t.take(m.OffloadRequest)
    assert o.version == version
    t.expect_ok(t.request(m.PublishOffload, t.session, version, True))
    return req


def _race(d):
    """A rollout of 2 shards updates while a 2-shard trainer (retaining the latest version)
    moves from v1 to v2: shard 0 pulls v1 from the trainer, shard 1 comes late."""
    t0, t1 = published(d, num_shards=2, retain=0)
    r0, r1 = d.replica("r", 2)
    q0 = r0.update("latest")
    g0 = r0.grant()
    r0.progress(g0, 4096)
    t1.expect_ok(_unpublish_with_offload(t1, 1))
    req0 = _unpublish_with_offload(t0, 1)  # drains r0's read first
    r0.complete(g0)
    t0.expect_ok(req0)
    for t in (t0, t1):
        t.expect_ok(t.publish(2))  # v1 is no longer retained
    return t0, t1, r0, r1, q0


def test_an_update_in_flight_keeps_its_version_when_the_trainer_moves_on(d):
    """The pin keeps v1's shard-1 offload copy until the late shard has it: no abort."""
    t0, t1, r0, r1, q0 = _race(d)
    assert t1.take(m.FreeOffload) == []  # pinned: not released
    assert set(d.table.models["actor"].pins) == {1}
    q1 = r1.update("latest")
    g1 = r1.grant()
    assert g1.version == 1 and g1.source.kind == "offload"
    r1.complete(g1)
    assert r0.expect_ok(q0) == m.Updated(q0, True, 1)
    assert r1.expect_ok(q1) == m.Updated(q1, True, 1)
    assert t1.take(m.FreeOffload) == [m.FreeOffload(t1.session, 1)]  # unpinned: released now
    assert d.table.models["actor"].pins == {}
    assert d.table.stats["pins"] == 1 and d.table.stats["redecided"] == 0
    assert check_invariants(d.table) == []


def test_without_the_pin_the_same_race_aborts(d):
    """The baseline the pin fixes: once the pin has expired, v1's shard-1 copy goes when v2 is
    published, and the late shard's update fails for the whole replica."""
    d.table.config = TableConfig(heartbeat_interval=1.0, heartbeat_timeout=10.0, drain_timeout=30.0, pin_timeout=0.5)
    t0, t1, r0, r1, q0 = _race(d)
    d.run_for(1)
    assert d.table.stats["pins_expired"] == 1 and d.table.models["actor"].pins == {}
    assert t1.take(m.FreeOffload) == [m.FreeOffload(t1.session, 1)]
    q1 = r1.update("latest")
    r0.expect_error(q0, e.UpdateAborted)
    r1.expect_error(q1, e.UpdateAborted)


def test_a_pin_in_a_model_without_retention_makes_no_copy(d):
    """No replica declared retention: the trainer's unpublish is not turned into an offload by a
    pin; it drains the active grant, as before."""
    (t,) = published(d)
    r = d.shard("r")
    q = r.replicate(1)
    g = r.grant()
    req = t.unpublish()
    assert t.take(m.OffloadRequest) == [] and t.reply(req) is None
    r.complete(g)
    r.expect_ok(q)
    t.expect_ok(req)


def test_pin_timeout_must_be_positive():
    with pytest.raises(e.InvalidArgument, match="pin_timeout"):
        TableConfig(pin_timeout=0)


def test_spot_holders_do_not_count_for_retention(d):
    (t,) = published(d, retain=0)
    s = d.shard("spot", spot=True)
    s.pull(1)
    t.unpublish()
    assert t.take(m.OffloadRequest)


def test_unretained_versions_are_not_offloaded(d):
    (t,) = published(d)
    t.expect_ok(t.unpublish())
    assert not t.take(m.OffloadRequest)


def test_offload_refused_still_unpublishes(d):
    (t,) = published(d, retain=0)
    req = t.unpublish()
    t.expect_ok(t.request(m.PublishOffload, t.session, 1, False))
    t.expect_ok(req)
    assert d.shard("x").list().versions == ()


def test_declaration_survives_a_crash_not_a_clean_close(d):
    t = d.shard("t", retain=0)
    t.expect_ok(t.publish(1))
    r = d.shard("r")
    r.pull(1)
    r.take(m.Replicated)
    d.advance(11)  # t crashes (no heartbeats); r too, so heartbeat it
    assert d.table.models["actor"].declarations
    r.open()  # r's session expired as well; open a fresh one
    assert d.table.models["actor"].declarations


# --- update -------------------------------------------------------------------------------------


def test_update_without_versions_returns_false(d):
    r = d.shard("r")
    u = r.expect_ok(r.update())
    assert (u.moved, u.version) == (False, None)


def test_update_moves_only_to_a_newer_latest(d):
    a = published(d, "a", version=1)[0]
    r = d.shard("r")
    req = r.update()
    complete_all([r])
    assert r.expect_ok(req).moved and d.table.sessions[r.session].holder.version == 1
    req = r.update()
    u = r.expect_ok(req)
    assert (u.moved, u.version) == (False, 1)
    a.expect_ok(a.unpublish())
    b = published(d, "b", version=2)[0]
    req = r.update()
    complete_all([r])
    assert r.expect_ok(req) == m.Updated(req, True, 2)
    assert b.session


def test_update_aborted_leaves_the_handle_empty(d):
    (t,) = published(d, version=1)
    r = d.shard("r")
    r.pull(1)
    r.take(m.Replicated)
    t.expect_ok(t.unpublish())
    t2 = published(d, "t2", version=2)[0]
    req = r.update()
    r.grant()
    # The only source of version 2 crashes mid-pull.
    d.advance(9)
    r.heartbeat()
    d.advance(2)
    r.expect_error(req, e.UpdateAborted)
    assert d.table.sessions[r.session].holder is None
    assert t2.session not in d.table.sessions


# --- model-parallel transactions ----------------------------------------------------------------


def test_shards_see_one_latest(d):
    """The paper's Figure 6: shard 0 resolves latest=12 and starts pulling; 13 is published;
    shard 1 gets 12 too."""
    published(d, "t12", version=12, num_shards=2)
    r0, r1 = d.replica("r", 2)
    q0 = r0.replicate("latest")
    g0 = r0.grant()
    r0.progress(g0, 4096)  # bytes of 12 landed: the call stays on 12
    published(d, "t13", version=13, num_shards=2)
    q1 = r1.replicate("latest")
    r0.complete(g0)
    r1.complete(r1.grant())
    assert r0.expect_ok(q0).version == r1.expect_ok(q1).version == 12
    assert d.table.stats["redecided"] == 0


def test_a_call_that_landed_nothing_moves_to_the_newer_latest(d):
    """Shard 0 resolves latest=12 but nothing lands before 13 is published: the whole replica
    re-decides to 13 (one version for every shard), and 12's grant is cancelled."""
    published(d, "t12", version=12, num_shards=2)
    r0, r1 = d.replica("r", 2)
    q0 = r0.replicate("latest")
    g12 = r0.grant()
    assert g12.version == 12
    published(d, "t13", version=13, num_shards=2)
    q1 = r1.replicate("latest")
    g = r0.grant()
    assert g.version == 13 and g.grant != g12.grant
    r0.complete(g)
    r1.complete(r1.grant())
    assert r0.expect_ok(q0).version == r1.expect_ok(q1).version == 13
    assert d.table.stats["redecided"] == 1
    assert check_invariants(d.table) == []


def test_replicate_answers_only_when_every_shard_is_done(d):
    published(d, num_shards=2)
    r0, r1 = d.replica("r", 2)
    q0 = r0.replicate(1)
    r0.complete(r0.grant())
    assert r0.reply(q0) is None
    q1 = r1.replicate(1)
    r1.complete(r1.grant())
    assert r0.expect_ok(q0).version == r1.expect_ok(q1).version == 1
    assert d.table.counts()["transactions"] == 0


def test_divergent_calls_are_contract_violations(d):
    published(d, num_shards=2)
    r0, r1 = d.replica("r", 2)
    r0.replicate(1)
    err = r1.expect_error(r1.update("latest"), e.ContractViolation)
    assert "call 1" in str(err)


def test_wait_is_one_transaction(d):
    d.shard("t", 0, 2)  # a 2-shard model
    r0, r1 = d.replica("r", 2)
    w0 = r0.request(m.Wait, r0.session, 1, -1, None, None)
    first = r0.inbox.pop()
    assert isinstance(first, m.Listing) and not first.final and first.versions == ()
    w0 = r0.request(m.Wait, r0.session, 1, first.epoch, None, None)
    assert r0.reply(w0) is None  # parked until the listing changes
    published(d, version=3, num_shards=2)
    offer = r0.inbox.pop()
    assert offer.versions[0].version == 3
    r0.expect_ok(r0.request(m.Wait, r0.session, 1, offer.epoch, offer.epoch, None))
    published(d, "t2", version=4, num_shards=2)
    # shard 1 arrives later, when the listing is different: it gets the recorded snapshot.
    q = r1.request(m.Wait, r1.session, 1, -1, None, None)
    got = r1.expect_ok(q)
    assert got.final and [v.version for v in got.versions] == [3]
    assert d.table.counts()["transactions"] == 0


def test_consistent_list(d):
    published(d, version=1, num_shards=2)
    r0, r1 = d.replica("r", 2)
    r0.call = r1.call = 0
    a = r0.list(consistent=True)
    published(d, "t2", version=2, num_shards=2)
    b = r1.list(consistent=True)
    assert a.versions == b.versions and a.epoch == b.epoch


# --- heartbeats ---------------------------------------------------------------------------------


def test_expiry_removes_the_whole_replica_and_readers_move_on(d):
    published(d, "t1")
    t2 = published(d, "t2")[0]
    r = d.shard("reader")
    q = r.replicate(1)
    g = r.grant()
    src = next(s for s in d.shards.values() if s.session == g.source.session)
    others = [s for s in d.shards.values() if s is not src]
    d.advance(9)
    for s in others:
        s.heartbeat()
    d.advance(2)
    assert r.take(m.Revoke)
    g2 = r.grant()
    r.complete(g2)
    r.expect_ok(q)
    assert src.session not in d.table.sessions
    hb = src.request(m.Heartbeat, (src.session,))
    assert src.expect_ok(hb).unknown == (src.session,)
    assert t2


def test_expiry_of_one_shard_removes_its_live_sibling(d):
    r0, r1 = d.replica("r", 2)
    d.advance(9)
    r1.heartbeat()
    d.advance(2)
    assert [x.code for x in r1.take(m.Removed)] == ["replica_removed"]
    r1.expect_error(r1.publish(1), e.ReplicaRemoved)


# --- failover re-announce -----------------------------------------------------------------------


def test_announce_restores_holdings_and_last_answers():
    d = Driver(term=2)
    n = LAYOUT.checksum_count()
    for t in d.replica("t", 2):
        t.expect_ok(t.request(m.Announce, t.session, (m.Held(5, "normal", (3,) * n),), None, 0, ()))
    r0, r1 = d.replica("r", 2)
    # Shard 0 had got the answer "version 5" to its call 1 on the old server; shard 1 had not.
    answer = m.CallAnswer(1, "replicate", 5, None, None, None)
    r0.expect_ok(r0.request(m.Announce, r0.session, (m.Held(5, "normal", None),), None, 1, (answer,)))
    r1.call = 0
    q = r1.replicate("latest")
    published(d, "t9", version=9, num_shards=2)
    r1.complete(r1.grant())
    assert r1.expect_ok(q).version == 5
    # A conflicting announcement is dropped.
    x = d.shard("x", 0, 2)
    x.expect_error(x.request(m.Announce, x.session, (m.Held(5, "normal", (4,) * n),), None, 0, ()), e.VersionConflict)
    assert d.table.sessions[x.session].holder is None


def test_a_backup_up_long_before_the_failover_waits_for_every_shard_to_announce():
    """Past the server's own grace period, a replica whose first shard re-announced decides
    nothing until its other shards have announced too (their last answers may fix it)."""
    d = Driver(term=2)
    d.advance(30)  # the backup has been up for a while
    n = LAYOUT.checksum_count()
    for t in d.replica("t", 2):
        t.expect_ok(t.request(m.Announce, t.session, (m.Held(5, "normal", (3,) * n),), None, 0, ()))
    published(d, "t9", version=9, num_shards=2)
    r0, r1 = d.replica("r", 2)
    r1.expect_ok(r1.request(m.Announce, r1.session, (), None, 0, ()))
    r1.call = 0
    q = r1.replicate("latest")  # shard 0 had the answer "version 5" to call 1: not known yet
    assert not r1.take(m.Grant)
    answer = m.CallAnswer(1, "replicate", 5, None, None, None)
    r0.expect_ok(r0.request(m.Announce, r0.session, (m.Held(5, "normal", None),), None, 1, (answer,)))
    r1.complete(r1.grant())
    assert r1.expect_ok(q).version == 5


def test_grant_from_an_older_term_is_stale(d):
    (t,) = published(d)
    r = d.shard("r")
    r.replicate(1)
    g = r.grant()
    r.expect_error(r.request(m.Complete, r.session, g.grant, g.term + 1), e.StaleGrant)
    r.expect_error(r.request(m.Complete, r.session, g.grant + 100, g.term), e.UnknownGrant)


# --- bad input ----------------------------------------------------------------------------------


def test_bad_requests_change_nothing(d):
    (t,) = published(d)
    r = d.shard("r")
    r.replicate(1)
    g = r.grant()
    before = d.table.counts()
    r.expect_error(r.request(m.Progress, r.session, g.grant, g.term, 10**12), e.InvalidArgument)
    r.expect_error(r.request(m.PublishOffload, r.session, 1, True), e.ContractViolation)
    r.expect_error(r.request(m.VerifyResult, r.session, 1, False), e.ContractViolation)
    r.expect_error(r.request(m.Replicate, r.session, 0, 1, None), e.InvalidArgument)
    t.expect_error(t.request(m.DeclareChecksums, t.session, 9, (1,)), e.ContractViolation)
    out = d.send("stranger", m.Ack(77))
    assert isinstance(out[0][1], m.Failed) and out[0][1].error().__class__ is e.ProtocolError
    assert d.table.counts() == before


def test_close_leaves_nothing(d):
    published(d, num_shards=2, retain=1)
    r = d.replica("r", 2)
    for s in r:
        s.replicate(1)
    complete_all(r)
    close_all(d)


def test_config_requires_heartbeat_margin():
    with pytest.raises(e.InvalidArgument):
        TableConfig(heartbeat_interval=1.0, heartbeat_timeout=5.0)


# --- regressions found in review -------------------------------------------------------------


def test_replica_removed_while_its_update_drains_leaves_nothing(d):
    (t,) = published(d)
    r = d.shard("r")
    r.pull(1)
    r.take(m.Replicated)
    x = d.shard("x")
    x.replicate(1)
    assert x.grant().source.replica == "r"  # pipelining: r is less loaded than the trainer
    published(d, "t2", version=2)
    r.update("latest")  # unpublishes v1, which still serves x
    d.shard("r", incarnation="i2")  # a new incarnation fences r mid-drain
    assert not any(g.reader.session.replica.name == "r" for g in d.table.grants.values())


def test_quarantine_of_a_finished_shard_fails_the_whole_replicate(d):
    published(d, num_shards=2)
    r0, r1 = d.replica("R", 2)
    q0, q1 = r0.replicate(1), r1.replicate(1)
    r0.complete(r0.grant())
    r1.grant()
    x = d.shard("x", 0, 2)
    x.replicate(1)
    gx = x.grant()
    if gx.source.replica != "R":
        x.source_failed(gx)
        gx = x.grant()
    assert gx.source.replica == "R"
    x.checksum_failed(gx)
    assert r0.take(m.VerifyRequest)
    r0.expect_ok(r0.request(m.VerifyResult, r0.session, 1, False))  # R0 quarantined
    r0.expect_error(q0, e.ChecksumMismatch)
    r1.expect_error(q1, e.ChecksumMismatch)  # same error for every shard, nothing left hanging
    assert not d.table.models["actor"].replicas["R"].txns


def test_quarantine_while_offload_pending_answers_the_unpublish(d):
    (t,) = published(d, retain=0)
    r = d.shard("r")
    r.replicate(1)
    r.checksum_failed(r.grant())
    assert t.take(m.VerifyRequest)
    u = t.unpublish()
    assert t.take(m.OffloadRequest)
    t.expect_ok(t.request(m.VerifyResult, t.session, 1, False))
    t.expect_ok(u)
    # The client answers the offload request it had got: refused, the holding is gone.
    t.expect_error(t.request(m.PublishOffload, t.session, 1, True), e.ContractViolation)
    assert d.table.counts()["transactions"] == 0


def test_a_shard_abandoning_its_replicate_fails_its_siblings(d):
    published(d, num_shards=2)
    r0, r1 = d.replica("R", 2)
    q0, q1 = r0.replicate(1), r1.replicate(1)
    r0.grant()
    r1.grant()
    r0.expect_ok(r0.unpublish())  # shard 0 cancels: its partial holding is unpublished
    r0.expect_error(q0, e.Cancelled)
    r1.expect_error(q1, e.Cancelled)
    r1.expect_ok(r1.unpublish())  # SPMD: shard 1 makes the same call 2
    assert d.table.counts()["grants"] == 0 and not d.table.models["actor"].replicas["R"].txns


def test_wait_with_an_epoch_never_offered_changes_nothing(d):
    r = d.shard("r")
    r.expect_error(r.request(m.Wait, r.session, 1, -1, 5, 10.0), e.ContractViolation)
    assert d.table.counts()["transactions"] == 0
    d.run_for(11)
    assert r.inbox == []


def test_announced_error_without_a_move_keeps_sibling_holdings():
    d = Driver(term=2)
    r0, r1 = d.replica("r", 2)
    ann = m.CallAnswer(2, "replicate", None, False, None, None, "version_unavailable", "version 7 is gone")
    r0.expect_ok(r0.request(m.Announce, r0.session, (m.Held(5, "normal", None),), None, 2, (ann,)))
    r1.expect_ok(r1.request(m.Announce, r1.session, (m.Held(5, "normal", None),), None, 1, ()))
    r1.call = 1
    r1.expect_error(r1.replicate(7), e.VersionUnavailable)
    assert d.table.sessions[r1.session].holder.version == 5


def test_unregister_refused_while_offload_copies_pin_the_layout(d):
    (t,) = published(d, retain=0)
    u = t.unpublish()
    t.expect_ok(t.request(m.PublishOffload, t.session, 1, True))
    t.expect_ok(u)
    t.expect_error(t.unregister(), e.ContractViolation)
    late = d.shard("late", layout=None)
    late.expect_error(late.register(make_layout(64)), e.LayoutMismatch)


def test_second_offload_while_the_first_drains(d):
    s = d.shard("trainer", retain=0)
    s.expect_ok(s.publish(1))
    u = s.unpublish()
    s.expect_ok(s.request(m.PublishOffload, s.session, 1, True))
    s.expect_ok(u)
    x = d.shard("x")
    qx = x.replicate(1)
    gx = x.grant()
    assert gx.source.kind == "offload"
    s.expect_ok(s.publish(1))  # v1 again: the first offload copy is released, still draining x
    u2 = s.unpublish()
    assert s.take(m.OffloadRequest)
    s.expect_ok(s.request(m.PublishOffload, s.session, 1, True))
    s.expect_ok(u2)
    x.complete(gx)
    x.expect_ok(qx)


def test_heartbeat_entry_answers_as_handle_does():
    """``ReferenceTable.heartbeat`` (the server's read path) is ``handle`` of a heartbeat: the
    same acknowledgement, the same session kept alive."""
    a, b = Driver(), Driver()
    sa, sb = a.shard("r"), b.shard("r")
    for drv in (a, b):
        drv.advance(5)
    msg = m.Heartbeat(9, (sa.session, 4242))
    via_handle = a.send(sa.peer, msg)
    via_entry = b.table.heartbeat(sb.peer, m.Heartbeat(9, (sb.session, 4242)))
    assert via_handle == [(sa.peer, m.HeartbeatAck(9, (4242,), a.table.term))]
    assert via_entry == [(sb.peer, m.HeartbeatAck(9, (4242,), b.table.term))]
    assert a.table.sessions[sa.session].last_seen == b.table.sessions[sb.session].last_seen == b.clock()
    assert b.table.heartbeat("someone-else", m.Heartbeat(10, (sb.session,))) == [
        ("someone-else", m.HeartbeatAck(10, (sb.session,), b.table.term))
    ]


def test_heartbeat_entry_with_a_reign_votes_as_handle_does():
    """A primary's heartbeats are votes: ``heartbeat()`` records the same votes, keeps the same
    sessions alive and stamps the same acknowledgement as ``handle()``, for an arrival (no
    stamp), a stamp echoed, a stamp of another term, another connection naming the session, and
    a session a step-down dropped (answered ``StepDown``)."""
    import random

    from tensorhub.core.table import ReferenceTable
    from tensorhub.core.table.reign import Reign
    from tensorhub.scheduling.selection import SourceIndex

    tables = []
    for _ in range(2):
        clock = Driver().clock
        t = ReferenceTable(clock, random.Random(0), TableConfig(), term=7, sources=SourceIndex, reign=Reign("primary", 5.0))
        t.reign.lease_until = clock.t + 100.0
        t.tick()
        sids = [t.handle(f"p{i}", m.OpenShard(1, "actor", f"r{i}", 1, 0, "i1", m.Location("dc0", "h", ""), False, None))[0][1].session
                for i in range(3)]  # fmt: skip
        tables.append((clock, t, sids))
    (ca, a, sa), (cb, b, sb) = tables
    assert a.reign.reigning and sa == sb
    steps = [
        ("p0", m.Heartbeat(1, (sa[0],))),  # an arrival
        ("p1", m.Heartbeat(2, (sa[1], 999), 0.0, 7)),
        ("p0", m.Heartbeat(3, (sa[0],), 1001.0, 7)),  # echoes a stamp of this term
        ("p1", m.Heartbeat(4, (sa[1],), 1001.2, 7)),
        ("p0", m.Heartbeat(5, (sa[0],), 1001.5, 6)),  # a stamp of another term: an arrival again
        ("p2", m.Heartbeat(6, (sa[0], sa[2]), 1002.0, 7)),  # another connection names p0's session
    ]
    for peer, msg in steps:
        for clock in (ca, cb):
            clock.t += 0.5
        assert a.handle(peer, msg) == b.heartbeat(peer, msg)
        assert a.reign.votes == b.reign.votes and a.reign._majority_until == b.reign._majority_until
        assert [(s.last_seen, s.peer) for s in a.sessions.values()] == [(s.last_seen, s.peer) for s in b.sessions.values()]
    for t in (a, b):
        t.reign.forget([sa[1]])  # as a step-down leaves it: the session is answered StepDown
    msg = m.Heartbeat(7, (sa[1], sa[0]), 1002.5, 7)
    via_handle, via_entry = a.handle("p1", msg), b.heartbeat("p1", msg)
    assert via_handle == via_entry and any(isinstance(x, m.StepDown) for _, x in via_entry)
