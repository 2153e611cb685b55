"""Server-side defects of issue 34, each pinned by a test that failed before its fix.

- A restart fencing race: incarnations are per shard, so a replica killed while only shard 1
  had opened made its restarted shard 1 fence the restarted shard 0 (which had opened first,
  into the replica the dead shard 1 still held).
- A holder did not check a grant token's term: a token of a server the holder no longer
  answers to (a stale primary, a server before a restart) admitted its bearer.
- After a failover, deltas were refused until the next publish: a re-announced holding of a
  delta (``Held``) carried no base, so the next server knew the delta's blob but not what it
  applies to, and planned full pulls.
"""

from __future__ import annotations

import pytest

from tensorhub.core import errors as e
from tensorhub.core import messages as m

from .table_driver import Driver


@pytest.fixture
def d() -> Driver:
    d = Driver()
    d.advance(11)  # past the start-up grace period
    return d


def test_a_restarted_shard_does_not_fence_its_restarted_sibling(d):
    # Incarnation 1 of replica r: only shard 1 opened before the replica was killed.
    old1 = d.shard("r", 1, 2, incarnation="a1")
    d.advance(2)  # it went silent (killed); not yet expired
    # The restart: shard 0 opens first (a fresh slot, into the replica the dead shard 1 holds)...
    new0 = d.shard("r", 0, 2, incarnation="b0")
    d.advance(0.5)
    # ...then shard 1 opens as a new incarnation: the dead one is fenced, its sibling is not.
    new1 = d.shard("r", 1, 2, incarnation="b1")
    assert [x.code for x in old1.take(m.Removed)] == ["fenced"]
    assert new0.take(m.Removed) == []
    assert set(d.table.sessions) == {new0.session, new1.session}
    old1.expect_error(old1.publish(1), e.Fenced)
    # The restarted replica works as one: a model-parallel call numbered from 1 again.
    reqs = [s.publish(1) for s in (new0, new1)]
    for s, req in zip((new0, new1), reqs):
        s.expect_ok(req)
    assert 1 in d.table.models["actor"].available


def test_a_new_incarnation_still_fences_the_whole_old_replica_while_it_lives(d):
    # Both old shards alive and heard from: a new incarnation of one fences the replica whole,
    # also an old shard that opened after the other (it was heard from before the new one came).
    old = [d.shard("r", 0, 2, incarnation="a0")]
    d.advance(0.5)
    old.append(d.shard("r", 1, 2, incarnation="a1"))
    d.run_for(2)
    new1 = d.shard("r", 1, 2, incarnation="b1")
    for s in old:
        assert [x.code for x in s.take(m.Removed)] == ["fenced"]
    assert set(d.table.sessions) == {new1.session}


def test_invariants_hold_after_a_partial_fencing(d):
    from tensorhub.core.invariants import check_invariants

    trainer = d.replica("t", 2, retain=0)
    reqs = [s.publish(1) for s in trainer]
    for s, req in zip(trainer, reqs):
        s.expect_ok(req)
    old1 = d.shard("r", 1, 2, incarnation="a1")
    pull = old1.replicate(1)  # call 1 of the old incarnation, waiting for shard 0
    d.advance(2)
    new0 = d.shard("r", 0, 2, incarnation="b0")
    d.advance(0.5)
    new1 = d.shard("r", 1, 2, incarnation="b1")
    old1.expect_error(pull, e.Fenced)
    assert check_invariants(d.table) == []
    reqs = [s.replicate(1) for s in (new0, new1)]
    for s in (new0, new1):
        for g in s.take(m.Grant):
            s.expect_ok(s.request(m.Complete, s.session, g.grant, g.term))
    for s, req in zip((new0, new1), reqs):
        assert isinstance(s.expect_ok(req), m.Replicated)
    assert check_invariants(d.table) == []


def test_the_token_checker_refuses_a_token_of_another_server_term():
    from tensorhub.core.tokens import GrantToken, InvalidToken, TokenChecker

    key = bytes(range(32))
    checker = TokenChecker(lambda: 100.0)
    old, new = (GrantToken(term, 1, 2, 3, 10.0, 60.0).seal(key) for term in (7, 8))
    assert checker.check(key, new, 3, term=8).term == 8
    with pytest.raises(InvalidToken) as err:
        checker.check(key, old, 3, term=8)
    assert err.value.reason == "stale_term" and "term 7" in str(err.value)
    assert checker.check(key, old, 3).term == 7  # a holder that knows no term yet judges MAC, version, expiry


def test_the_engine_refuses_a_grant_of_a_term_its_session_left():
    from tensorhub.core.tokens import GrantToken
    from tensorhub.runtime.engine import EngineActor, ServerTerm, _Slot
    from tensorhub.transports.base import Transport

    class Quiet(Transport):
        name = "tcp"
        checks_grants = True

    engine = EngineActor({"tcp": Quiet()})
    slot = _Slot(1, 4, None, None, {"replica": "trainer", "shard": 0})  # type: ignore[arg-type]
    engine.regions[4] = slot
    engine.on_ServerTerm(ServerTerm(1, 7))
    stale = GrantToken(7, 1, 2, 3, 10.0, 60.0).seal(slot.key)
    assert engine.admit(4, 3, stale, "tcp from a") is None
    engine.on_ServerTerm(ServerTerm(1, 8))  # the holder's client moved to a server of term 8
    assert engine.admit(4, 3, stale, "tcp from a") is not None
    assert dict(engine.refusals) == {"stale_term": 1}
    assert engine.admit(4, 3, GrantToken(8, 1, 2, 3, 10.0, 60.0).seal(slot.key), "tcp from a") is None


def test_deltas_are_planned_after_a_failover_from_the_re_announced_holdings():
    from tensorhub.core.naming import delta_model

    from .table_driver import make_layout

    full, sums = make_layout(4096, 8192), {1: (1, 2), 2: (2, 3)}
    d = Driver()  # the server the clients moved to: it knows nothing, and is in its grace period

    def announce(s, version: int, checksums: tuple, base: int | None = None) -> None:
        s.expect_ok(s.request(m.Announce, s.session, (m.Held(version, m.KIND_NORMAL, checksums, base),), None, 0, ()))

    trainer = d.shard("T", 0, 1, layout=full)
    announce(trainer, 2, sums[2])
    side = d.shard("T@d0", 0, 1, model=delta_model("actor"), layout=make_layout(300))
    announce(side, 2, (201,), base=1)  # the delta 1 -> 2 the trainer published before the failover
    reader = d.shard("R", 0, 1, layout=full)
    announce(reader, 1, sums[1])
    d.run_for(11)  # the grace period ends (every shard heartbeating)
    req = reader.request(m.Update, reader.session, reader.next_call(), "latest", None, False, True)
    answer = reader.expect_ok(req)
    assert answer.moved is False and answer.target == 2 and answer.deltas == (m.DeltaRef(2, 1, 300),)
    assert d.table.stats["delta_plans"] == 1


def test_a_held_delta_base_must_come_before_its_version():
    with pytest.raises(ValueError, match="base"):
        m.Held(2, m.KIND_NORMAL, None, 2)
