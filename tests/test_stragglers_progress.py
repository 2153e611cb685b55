"""Stragglers (issue 23), the reader's side: a pull reports its verified prefix at least every
:data:`~tensorhub.core.shard.PROGRESS_INTERVAL` while it grows (not only every eighth of the
shard), under its live grant only, including a grant that waits for a revoked grant's reads to
drain (what lands meanwhile is reported under it)."""

from __future__ import annotations

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
