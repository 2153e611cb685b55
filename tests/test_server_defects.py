"""Server-side defects of issue 34, each pinned by a test that failed before its fix.

- A restart fencing race: incarnations are per shard, so a replica killed while only shard 1
  had opened made its restarted shard 1 fence the restarted shard 0 (which had opened first,
  into the replica the dead shard 1 still held).
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
