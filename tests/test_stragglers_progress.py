"""Stragglers (issue 23), the reader's side: a pull reports its verified prefix at least every
:data:`~tensorhub.core.shard.PROGRESS_INTERVAL` while it grows (not only every eighth of the
shard), under its live grant only, including a grant that waits for a revoked grant's reads to
drain (what lands meanwhile is reported under it)."""

from __future__ import annotations

from typing import Callable

from tensorhub.core import messages as m
from tensorhub.core.session import ReplicationSession
from tensorhub.core.shard import PROGRESS_INTERVAL, IssueRead, ReportProgress, ShardCore, VerifyRead
from tensorhub.core.topology import Location

TOTAL, CHUNK = 64_000, 1_000  # 64 reads: the session's own reports come every 8_000 bytes
HERE = Location("dc1", "h1", "")


def _grant(n: int, complete: bool = True) -> m.Grant:
    src = m.SourceInfo(session=7, replica="trainer", shard_idx=0, kind="live", complete=complete, location=HERE,
                       endpoint={"region": 1})  # fmt: skip
    return m.Grant(0, 1, n, 1, 1, 0, src, None, None)


def _core() -> ShardCore:
    return ShardCore(lambda v: ReplicationSession(v, TOTAL, CHUNK, max_inflight=1, verify=True))


def _land(core: ShardCore, read: IssueRead) -> list:
    """Land ``read`` and verify it good; the actions that follow."""
    out = core.on_read_done(read.pull, read.grant, read.offset)
    verify = [a for a in out if isinstance(a, VerifyRead)]
    rest = [a for a in out if not isinstance(a, VerifyRead)]
    for v in verify:
        rest += core.on_verified(v.pull, v.grant, v.offset, None)
    return rest


def _reads(actions: list) -> list[IssueRead]:
    return [a for a in actions if isinstance(a, IssueRead)]


def test_progress_is_reported_every_interval_while_it_grows_not_only_every_eighth() -> None:
    core = _core()
    (read,) = _reads(core.on_grant(_grant(1)))
    assert core.report_progress(0.0) == []  # nothing verified yet
    out = _land(core, read)
    assert not any(isinstance(a, ReportProgress) for a in out)  # the session reports every eighth only
    assert core.progress_unreported
    assert core.report_progress(0.0) == [ReportProgress((1, 1), CHUNK)]
    assert not core.progress_unreported and core.report_progress(0.1) == []  # reported: nothing new
    (read,) = _reads(out)
    out = _land(core, read)
    assert core.progress_unreported
    assert core.report_progress(PROGRESS_INTERVAL / 2) == []  # too soon: the caller asks again later
    assert core.report_progress(PROGRESS_INTERVAL) == [ReportProgress((1, 1), 2 * CHUNK)]


def test_progress_goes_under_the_live_grant_only_and_drained_bytes_under_the_next() -> None:
    core = _core()
    (read,) = _reads(core.on_grant(_grant(1)))
    assert core.on_revoke(1, 1) == []  # a read is in flight: the grant ends once it returns
    assert core.live_grant is None
    out = core.on_grant(_grant(2))  # the next grant waits for the revoked grant's read to drain
    assert not _reads(out) and core.live_grant == (1, 2)
    out = _land(core, read)  # the drained read lands (its bytes are kept) and the next grant begins
    assert core.report_progress(0.0) == [ReportProgress((1, 2), CHUNK)]
    (read,) = _reads(out)
    assert read.grant == (1, 2)
    core.on_revoke(1, 2)
    _land(core, read)
    assert core.live_grant is None and not core.progress_unreported
    assert core.report_progress(10.0) == []  # revoked, not granted again: nothing to report under


# ---- a caller on a clock (the engine): nothing in a pull's first interval ----------------------


def _timed_core() -> ShardCore:
    return ShardCore(lambda v: ReplicationSession(v, TOTAL, CHUNK, max_inflight=1, verify=True), timed_progress=True)


def _pull(core: ShardCore, times: list[float]) -> list[tuple[float, ReportProgress]]:
    """Land one read at each of ``times`` (as the engine does: the session's own reports, then
    :meth:`ShardCore.report_progress` on the clock); the reports made, with when."""
    (read,) = _reads(core.on_grant(_grant(1)))
    made: list[tuple[float, ReportProgress]] = []
    for t in times:
        out = _land(core, read) + core.report_progress(t)
        made += [(t, a) for a in out if isinstance(a, ReportProgress)]
        reads = _reads(out)
        if not reads:
            break
        (read,) = reads
    return made


def test_a_pull_done_within_its_first_interval_reports_no_progress() -> None:
    """A fast pull (the whole shard within PROGRESS_INTERVAL of its first bytes) sends no
    progress, not even the session's eighths: the server would judge none of it."""
    core = _timed_core()
    step = PROGRESS_INTERVAL / 2 / (TOTAL // CHUNK)
    made = _pull(core, [k * step for k in range(TOTAL // CHUNK)])
    assert made == []
    assert core.pull is not None and core.pull.done
    assert core.report_progress(PROGRESS_INTERVAL) == []  # the engine's timer, after it completed


def test_a_longer_pull_reports_from_one_interval_after_its_first_bytes_then_as_before() -> None:
    """A pull of 64 reads, one every 20 ms (1.28 s): its first report comes an interval after its
    first verified bytes; from then on a report goes at least every interval while it grows,
    each under the live grant: here the session's eighths (every 160 ms), which count as the
    interval's report, so no timed report is added between them."""
    core = _timed_core()
    times = [0.02 * k for k in range(TOTAL // CHUNK)]
    made = _pull(core, times)
    first_at = made[0][0]
    assert PROGRESS_INTERVAL <= first_at < PROGRESS_INTERVAL + 0.02  # reads began at t=0
    assert all(r.grant == (1, 1) for _, r in made)
    values = [r.verified for _, r in made]
    assert values == sorted(values) and len(set(values)) == len(values)  # growing, never twice
    at = [t for t, _ in made]
    gaps = [b - a for a, b in zip([0.0, *at], at)]
    assert max(gaps) <= PROGRESS_INTERVAL + 0.02  # never silent longer than an interval while it grows
    steps = [b - a for a, b in zip(values, values[1:])]
    assert steps and set(steps) == {TOTAL // 8}  # only the session's eighths once the first report went
    before = _pull(_core(), times)  # the same pull on the same clock, reporting from its first bytes
    assert before[0][0] == 0.0 and len(made) < len(before)
    # the same pull without a clock (the simulator) reports every eighth from the start
    plain = _core()
    (read,) = _reads(plain.on_grant(_grant(1)))
    seen = []
    for _ in range(TOTAL // CHUNK):
        out = _land(plain, read)
        seen += [a.verified for a in out if isinstance(a, ReportProgress)]
        if not _reads(out):
            break
        (read,) = _reads(out)
    assert seen == [k * (TOTAL // 8) for k in range(1, 8)]


# ---- the scheduler still gets what it acts on ------------------------------------------------

MB = 1_000_000
STEP = 0.05  # seconds between the emulated engine's turns


class _Puller:
    """A reader as the engine drives it: a real :class:`ShardCore` whose reads land at a rate
    (0.1 MB each), asked :meth:`~ShardCore.report_progress` after each landing and on every
    turn (the engine's timer); what it reports goes to the table as ``Progress``."""

    def __init__(self, shard, grant: m.Grant, total: int, timed: bool) -> None:
        self.shard, self.grant, self.total = shard, grant, total
        self.core = ShardCore(lambda v: ReplicationSession(v, total, MB // 10, max_inflight=1, verify=True),
                              timed_progress=timed)  # fmt: skip
        (self.read,) = _reads(self.core.on_grant(grant))
        self.landed = 0
        self.sent = 0  # Progress messages

    def turn(self, now: float, upto: float) -> None:
        out: list = []
        while self.read is not None and self.landed + self.read.length <= upto:
            self.landed += self.read.length
            acts = _land(self.core, self.read) + self.core.report_progress(now)
            out += acts
            reads = _reads(acts)
            self.read = reads[0] if reads else None
        out += self.core.report_progress(now)
        for a in out:
            if isinstance(a, ReportProgress):
                self.sent += 1
                self.shard.progress(self.grant, a.verified)


def _first_move(timed: bool, slow: Callable[[float], float]) -> tuple[float, str, int, int]:
    """Two sources, two readers: r1 at 5 MB/s, r2 at ``slow(t)`` MB/s (t from its grant). The
    first straggler verdict: (when, why, the bytes r2's next grant starts from, Progress sent)."""
    from tensorhub.core.table import TableConfig

    from .table_driver import Driver, make_layout

    big = make_layout(640 * MB)
    d = Driver(config=TableConfig(straggler_window=5.0, straggler_ratio=0.25))
    d.advance(11)  # past the start-up grace period
    for name in ("t1", "t2"):
        s = d.shard(name, layout=big)
        s.expect_ok(s.publish(1))
    r1, r2 = d.shard("r1", layout=big), d.shard("r2", layout=big)
    r1.replicate(1)
    r2.replicate(1)
    pullers = {r1: _Puller(r1, r1.grant(), big.total_bytes, timed), r2: _Puller(r2, r2.grant(), big.total_bytes, timed)}
    done = {r1: 0.0, r2: 0.0}
    t0 = d.clock.t
    for k in range(1, int(12 / STEP)):
        d.clock.t = t0 + k * STEP
        done[r1] += 5 * MB * STEP
        done[r2] += slow(k * STEP) * MB * STEP
        for r, p in pullers.items():
            p.turn(d.clock.t, done[r])
        for s in d.shards.values():
            s.send(m.Heartbeat(0, (s.session,)))
            s.take(m.HeartbeatAck)
        d.deliver(d.table.tick())
        assert not r1.take(m.Revoke)
        revoked = r2.take(m.Revoke)
        if revoked:
            (g,) = r2.grants()
            return round(k * STEP, 2), revoked[0].reason, d.table.grants[g.grant].start, sum(p.sent for p in pullers.values())
    raise AssertionError("no straggler verdict in 12 s")


def test_the_scheduler_moves_a_slow_or_stalled_source_s_reader_as_it_did_with_every_report() -> None:
    """The engine's quieter reports (nothing in a pull's first interval) give the straggler
    check what it acts on: the same verdict at the same moment, the reader resuming from the
    same bytes, for a slow source and for one that stalls after a second; with fewer messages."""
    for slow in (lambda t: 0.2, lambda t: 1.0 if t < 1.0 else 0.0):
        before = _first_move(False, slow)
        after = _first_move(True, slow)
        assert after[:3] == before[:3], (before, after)
        assert after[3] < before[3]
