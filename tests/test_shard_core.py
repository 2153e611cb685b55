"""The shard core alone (:mod:`tensorhub.core.shard`), driven through random sequences of
grants, revokes, read failures, verification results, aborts and server losses by a fake IO
that lands reads in any order.

What it checks, at every step: no read is issued outside a live grant of the current pull, none
while an aborted pull still has a read in flight, and no range is read by two reads at once (so
no buffer is written outside a live grant, nor by two pulls); when a pull completes, every range
of it was accepted exactly once. Hypothesis is seeded from ``tests/conftest.py``
(``TENSORHUB_SEED``, printed in the report of a failure).
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tensorhub.core import messages as m
from tensorhub.core.session import ReplicationSession
from tensorhub.core.shard import (
    Advance,
    Drained,
    DropPull,
    IssueRead,
    ReportChecksumFailed,
    ReportComplete,
    ReportProgress,
    ReportSourceFailed,
    RetireSeed,
    ShardCore,
    StartPull,
    StartSeed,
    UseGrant,
    VerifyRead,
    report_message,
    seed_step,
)
from tensorhub.core.topology import Location

TOTAL, CHUNK = 4_000, 1_000
_GOOD = 3  # a range's state in the session: verified
HERE = Location("dc1", "h1", "")


def _source(complete: bool) -> m.SourceInfo:
    return m.SourceInfo(session=7, replica="trainer", shard_idx=0, kind="live", complete=complete, location=HERE,
                        endpoint={"region": 1})  # fmt: skip


class ShardCoreMachine(RuleBasedStateMachine):
    """A fake IO around one :class:`ShardCore`: reads in flight are a set the rules land or fail."""

    def __init__(self) -> None:
        super().__init__()
        self.verify = False
        self.core = ShardCore(self._new_pull)
        self.term, self.next_grant = 1, 0
        self.live: dict[int, tuple[int, int]] = {}  # pull -> its live grant (term, id), as the server sees it
        self.version = 0
        self.inflight: dict[tuple[int, int], IssueRead] = {}  # (pull, offset) -> read
        self.verifying: list[VerifyRead] = []
        self.accepted: dict[int, dict[int, int]] = {}  # pull -> offset -> times accepted into the prefix
        self.started: list[int] = []
        self.completed: dict[int, int] = {}  # pull -> version
        self.draining_pulls: set[int] = set()
        self.dropped: set[int] = set()

    def _new_pull(self, version: int) -> ReplicationSession:
        return ReplicationSession(version, TOTAL, CHUNK, max_inflight=3, verify=self.verify)

    @rule(verify=st.booleans())
    @precondition(lambda self: self.core.pull is None and not self.started)
    def choose_mode(self, verify: bool) -> None:
        self.verify = verify

    # ---- carrying out actions ------------------------------------------------------------------

    def _do(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, StartPull):
                self.started.append(a.pull)
                self.accepted[a.pull] = {}
            elif isinstance(a, DropPull):
                self.dropped.add(a.pull)
                self.live.pop(a.pull, None)
                if not a.drained:
                    self.draining_pulls.add(a.pull)
            elif isinstance(a, IssueRead):
                assert self.core.is_current(a.pull), f"read of pull {a.pull}, which is not current"
                assert self.live.get(a.pull) == a.grant, f"read under {a.grant}, the live grant is {self.live.get(a.pull)}"
                assert not any(p in self.draining_pulls for p, _ in self.inflight), "read while an aborted pull still writes"
                assert all(o != a.offset for _, o in self.inflight), f"range {a.offset} read twice at once"
                assert a.offset not in self.accepted[a.pull], f"range {a.offset} read again after it was accepted"
                self.inflight[(a.pull, a.offset)] = a
            elif isinstance(a, VerifyRead):
                self.verifying.append(a)
            elif isinstance(a, ReportComplete):
                pull = self.core.serial
                assert self.live.get(pull) == a.grant
                counts = self.accepted[pull]
                assert sorted(counts) == list(range(0, TOTAL, CHUNK)), f"complete with ranges {sorted(counts)}"
                assert set(counts.values()) == {1}, f"a range was accepted more than once: {counts}"
                self.completed[pull] = self.core.pull.version if self.core.pull else -1
                self.live.pop(pull, None)
                report_message(a, 3, 1)
            elif isinstance(a, (ReportSourceFailed, ReportChecksumFailed)):
                assert self.core.is_current(self.core.serial)
                if self.live.get(self.core.serial) == a.grant:
                    self.live.pop(self.core.serial)  # the server ends the grant and grants again
                report_message(a, 3, 1)
            elif isinstance(a, Drained):
                assert not any(p in self.draining_pulls for p, _ in self.inflight)
                self.draining_pulls.clear()
            else:
                assert isinstance(a, (Advance, ReportProgress, UseGrant)), a

    # ---- the server ----------------------------------------------------------------------------

    @rule(new_version=st.booleans(), partial=st.booleans(), unreachable=st.booleans())
    def grant(self, new_version: bool, partial: bool, unreachable: bool) -> None:
        pull = self.core.pull
        if pull is not None and self.core.pulling and self.live.get(self.core.serial) is not None and not new_version:
            return  # the server grants a pull again only after its grant ended
        if new_version or pull is None:
            self.version += 1
        self.next_grant += 1
        g = m.Grant(1, 3, self.next_grant, self.term, self.version, 0, _source(not partial), None)
        actions = self.core.on_grant(g, "no transport reaches it" if unreachable else None)
        if not unreachable:
            self.live[self.core.serial] = (self.term, self.next_grant)
        self._do(actions)

    @rule()
    def revoke(self) -> None:
        key = self.live.pop(self.core.serial, None)
        if key is not None:
            self._do(self.core.on_revoke(*key))

    @rule()
    def server_lost(self) -> None:
        self.term += 1
        self.live.pop(self.core.serial, None)
        self._do(self.core.on_suspend())

    # ---- the IO --------------------------------------------------------------------------------

    def _good(self) -> tuple[int, set[int]]:
        pull = self.core.pull
        if pull is None:
            return self.core.serial, set()
        return self.core.serial, {o for i, (o, _) in enumerate(pull.ranges) if pull.state[i] == _GOOD}

    def _feed(self, actions_of: Callable[[], list]) -> None:
        """Call the core, counting the ranges its current pull accepted into the good set."""
        serial, before = self._good()
        actions = actions_of()
        after_serial, after = self._good()
        if after_serial == serial:
            for o in after - before:
                self.accepted[serial][o] = self.accepted[serial].get(o, 0) + 1
        self._do(actions)

    @rule(data=st.data())
    @precondition(lambda self: self.inflight)
    def land(self, data: st.DataObject) -> None:
        a = self.inflight.pop(data.draw(st.sampled_from(sorted(self.inflight))))
        self._feed(lambda: self.core.on_read_done(a.pull, a.grant, a.offset))

    @rule(data=st.data(), retryable=st.booleans())
    @precondition(lambda self: self.inflight)
    def fail(self, data: st.DataObject, retryable: bool) -> None:
        a = self.inflight.pop(data.draw(st.sampled_from(sorted(self.inflight))))
        self._feed(lambda: self.core.on_read_failed(a.pull, a.grant, a.offset, "injected", retryable))

    @rule(data=st.data(), good=st.booleans())
    @precondition(lambda self: self.verifying)
    def check(self, data: st.DataObject, good: bool) -> None:
        a = self.verifying.pop(data.draw(st.integers(0, len(self.verifying) - 1)))
        self._feed(lambda: self.core.on_verified(a.pull, a.grant, a.offset, None if good else 0))

    # ---- the handle ----------------------------------------------------------------------------

    @rule(marked=st.booleans())
    def abort(self, marked: bool) -> None:
        mark = self.core.began if marked else None
        pulling = self.core.pulling
        actions, outcome = self.core.on_abort(mark)
        assert outcome.aborted == pulling
        assert outcome.began == (False if marked else pulling)  # marked just now: nothing began since
        self.live.pop(self.core.serial, None)
        self._do(actions)

    @invariant()
    def numbers_follow_each_other(self) -> None:
        assert self.core.began == len(self.started)

    @invariant()
    def draining_is_true(self) -> None:
        assert self.core.draining == any(p in self.draining_pulls for p, _ in self.inflight)


TestShardCore = ShardCoreMachine.TestCase


def test_call_numbers_are_given_back_only_by_the_last_call() -> None:
    core = ShardCore(lambda v: ReplicationSession(v, 1, 1))
    assert [core.next_call() for _ in range(3)] == [1, 2, 3]
    core.give_back(2)  # not the last: kept
    assert core.next_call() == 4
    core.give_back(4)
    assert core.next_call() == 4


def test_seed_rule() -> None:
    assert seed_step(None, 3, 5) == StartSeed(5)
    assert seed_step(4, 3, 5) == StartSeed(5)
    assert seed_step(5, 5, None) == RetireSeed()
    assert seed_step(5, 4, None) is None
    assert seed_step(None, 9, None) is None


def test_an_abort_says_whether_the_call_began_moving() -> None:
    core = ShardCore(lambda v: ReplicationSession(v, 4, 2, verify=False))
    mark = core.began
    _, outcome = core.on_abort(mark)
    assert not outcome.began and not outcome.aborted
    g = m.Grant(1, 3, 1, 1, 5, 0, _source(True), None)
    actions = core.on_grant(g)
    assert [type(a) for a in actions][:2] == [StartPull, UseGrant]
    actions, outcome = core.on_abort(mark)
    assert outcome.began and outcome.aborted and core.draining
    assert isinstance(actions[0], DropPull) and not actions[0].drained
