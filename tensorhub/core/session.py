"""The reader's side of one shard's pull: grant -> reads -> verify -> progress -> complete.

Theory of operation
-------------------
:class:`ReplicationSession` is sans-IO, like the reference table: the engine feeds it events
(a grant arrived, a read finished or failed, a landed read verified or not, the server revoked
the grant) and carries out the actions it returns (:class:`ReadRange`, :class:`Verify`,
:class:`Advance`, :class:`ReportProgress`, :class:`ReportComplete`, :class:`ReportSourceFailed`,
:class:`ReportChecksumFailed`). It imports no asyncio, zmq or sockets, so the simulator and the
property tests drive the same code as the real engine.

The shard is pulled as a fixed list of reads (the layout's read plan: whole checksum units
each, in transfer order). Each read's range is in one state: *todo*, *in flight* (a transport
is writing it), *landed* (written whole, waiting for its checksums to be checked), or *good*
(verified). ``verified`` is the length of the good prefix: what the local progress counter
publishes to downstream readers (:class:`Advance`), so a partial holder only serves verified
bytes. At most ``max_inflight`` reads are in flight, lowest offsets first; behind a *partial*
source (one still pulling: ``source.complete`` false), one at a time. Concurrent reads share
the link, so none of them lands before all of them: behind a relay each hop of a pipeline
would lag its source by ``max_inflight`` reads, where one read at a time, at the link's full
rate, lags it by one (the burst benchmark on the emulated cluster measures the difference).

Resume: ranges stay good across grants. When a source fails, is revoked, or sends bytes that
fail verification, the next grant reads only the ranges that are not good (or landed and
being checked). A landed range of an ended grant is still checked: the checksums, not the
source, say whether bytes are right; if they fail, nobody is blamed and the range is read again.

Invariants:

- ``verified`` never decreases; every byte below it is in a good range.
- No read of a new grant starts while a read of an ended grant may still be writing into the
  buffers: a failed or revoked grant is reported (or the next grant started) only after all
  its reads have returned.
- Every grant ends exactly once from this side: :class:`ReportComplete`, or
  :class:`ReportSourceFailed`, or :class:`ReportChecksumFailed`, or a revoke from the server.
- With ``verify`` off (no checksums: tests and the simulator), a read that lands is good at once,
  and reads of an ended grant are discarded.

What it must never do: report complete with a range not good, or count bytes that failed
verification, or bytes of a failed or revoked grant that were never verified.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

from .errors import InvalidArgument

__all__ = [
    "Action",
    "Advance",
    "GrantId",
    "ReadRange",
    "ReplicationSession",
    "ReportChecksumFailed",
    "ReportComplete",
    "ReportProgress",
    "ReportSourceFailed",
    "Verify",
]


#: How the caller names a grant: any hashable value (the shard core: ``(term, grant id)``,
#: as grant ids restart with each server start).
GrantId = Any


@dataclass(frozen=True, slots=True)
class ReadRange:
    """Read shard bytes ``[offset, offset + length)`` from the grant's source."""

    grant: GrantId
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Verify:
    """Check the landed bytes ``[offset, offset + length)`` against their checksums, then call
    :meth:`ReplicationSession.on_verified`."""

    grant: GrantId
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Advance:
    """The local progress counter may publish ``verified`` bytes."""

    verified: int


@dataclass(frozen=True, slots=True)
class ReportProgress:
    grant: GrantId
    verified: int


@dataclass(frozen=True, slots=True)
class ReportComplete:
    grant: GrantId


@dataclass(frozen=True, slots=True)
class ReportSourceFailed:
    grant: GrantId
    verified: int
    reason: str


@dataclass(frozen=True, slots=True)
class ReportChecksumFailed:
    """Bytes from the grant's source failed verification in checksum unit ``unit``."""

    grant: GrantId
    verified: int
    unit: int


Action = Union[ReadRange, Verify, Advance, ReportProgress, ReportComplete, ReportSourceFailed, ReportChecksumFailed]

_TODO, _INFLIGHT, _LANDED, _GOOD = range(4)


@dataclass(frozen=True, slots=True)
class _Grant:
    id: GrantId
    source: Any
    inflight: int  # reads in flight at once under this grant


class ReplicationSession:
    """One shard's pull of one version, across however many grants it takes.

    Args:
        version: the version being pulled.
        total_bytes: the shard's size.
        chunk_bytes: the size of one read, when ``reads`` is not given.
        max_inflight: reads in flight at once (the transport's streams).
        report_every: send the server a progress report each time ``verified`` has grown by
            this much (and never more often).
        max_retries: how many times one range may be re-read after ``not ready`` answers
            (a partial source that is itself waiting) before the source is reported failed.
        reads: the read plan, ``(offset, length)`` in order, covering ``[0, total_bytes)``
            without gaps (the layout's :meth:`~tensorhub.core.layout.Plan.reads`).
        verify: whether landed reads must be verified (:class:`Verify`) before they count.
    """

    def __init__(
        self,
        version: int,
        total_bytes: int,
        chunk_bytes: int = 8 << 20,
        max_inflight: int = 4,
        report_every: int | None = None,
        max_retries: int = 12,
        reads: Sequence[tuple[int, int]] | None = None,
        verify: bool = False,
    ) -> None:
        if total_bytes < 0 or chunk_bytes < 1 or max_inflight < 1:
            raise InvalidArgument(f"bad session parameters: {total_bytes=}, {chunk_bytes=}, {max_inflight=}")
        if reads is None:
            reads = [(o, min(chunk_bytes, total_bytes - o)) for o in range(0, total_bytes, chunk_bytes)]
        pos = 0
        for off, n in reads:
            if off != pos or n < 0:
                raise InvalidArgument(f"the read plan must cover the shard in order without gaps; got ({off}, {n}) at {pos}")
            pos += n
        if pos != total_bytes:
            raise InvalidArgument(f"the read plan covers {pos} bytes of a {total_bytes}-byte shard")
        self.version = version
        self.total_bytes = total_bytes
        self.chunk_bytes = chunk_bytes
        self.max_inflight = max_inflight
        self.report_every = report_every or max(chunk_bytes, total_bytes // 8)
        self.max_retries = max_retries
        self.verify = verify
        self.ranges: list[tuple[int, int]] = [(o, n) for o, n in reads if n > 0]
        self.index = {o: i for i, (o, _) in enumerate(self.ranges)}
        self.state = [_TODO] * len(self.ranges)
        self.good_upto = 0  # ranges[:good_upto] are all good
        self.verified = 0
        self.grant: _Grant | None = None
        self.ending: tuple[_Grant, str | None, int | None] | None = None  # (grant, failure reason, bad unit)
        self.pending: _Grant | None = None  # a grant that arrived while the last one's reads drain
        self.inflight: dict[int, tuple[GrantId, int]] = {}  # offset -> (grant id, length)
        self.todo: list[int] = []  # heap of range indices to read under the current grant
        self.retries: dict[int, int] = {}
        self.reported = 0
        self.done = False
        self.grants_used = 0
        self.sources: list[Any] = []

    # ---- events ------------------------------------------------------------------------------

    def on_grant(self, grant: GrantId, source: Any = None) -> list[Action]:
        """The server granted ``source`` for this pull."""
        if self.done or (self.grant is not None and self.grant.id == grant):
            return []  # a repeated grant changes nothing
        if (self.pending is not None and self.pending.id == grant) or (
            self.ending is not None and self.ending[0].id == grant
        ):
            return []
        partial = source is not None and getattr(source, "complete", True) is False
        g = _Grant(grant, source, 1 if partial else self.max_inflight)
        if self.grant is not None and self.grant.id != grant:
            # The server only grants again after the last grant ended; treat it as revoked.
            self._end(None)
        if self.ending is not None:
            self.pending = g
            return self._maybe_finish_ending()
        return self._begin(g)

    def on_read_done(self, grant: GrantId, offset: int) -> list[Action]:
        """A read issued for ``grant`` at ``offset`` landed whole."""
        entry = self.inflight.pop(offset, None)
        if entry is None or entry[0] != grant:
            if entry is not None:
                self.inflight[offset] = entry
            return []
        i = self.index[offset]
        self.retries.pop(offset, None)
        current = self.grant is not None and self.grant.id == grant
        out: list[Action] = []
        if self.done:
            self.state[i] = _TODO
        elif self.verify:
            self.state[i] = _LANDED
            out.append(Verify(grant, offset, entry[1]))
        elif current:
            self.state[i] = _GOOD
            out.extend(self._advance(grant))
            if self.done:
                return out
        else:
            self.state[i] = _TODO  # unverifiable bytes of an ended grant: read them again
        if not current:
            return out + self._maybe_finish_ending()
        out.extend(self._issue())
        return out

    def on_verified(self, grant: GrantId, offset: int, bad_unit: int | None = None) -> list[Action]:
        """The landed read at ``offset`` (of ``grant``) was checked: it matched its checksums
        (``bad_unit`` None), or checksum unit ``bad_unit`` did not."""
        i = self.index.get(offset)
        if i is None or self.state[i] != _LANDED or self.done:
            return []
        current = self.grant is not None and self.grant.id == grant
        if bad_unit is None:
            self.state[i] = _GOOD
            if self.grant is None:
                before = self.verified
                self._move_prefix()
                return [Advance(self.verified)] if self.verified > before else []
            return self._advance(self.grant.id)
        self.state[i] = _TODO
        if self.grant is None:
            return []  # the grant it came from already ended: the next grant reads it again
        heapq.heappush(self.todo, i)
        if current:  # the source sent bad bytes: end its grant and say so
            self._end(None, bad_unit)
            return self._maybe_finish_ending()
        return self._issue()  # bytes of an earlier, ended grant: blame nobody, read again

    def on_read_failed(self, grant: GrantId, offset: int, reason: str, retryable: bool = False) -> list[Action]:
        """A read for ``grant`` at ``offset`` failed. ``retryable``: the source answered "not
        ready yet" (a partial source), so the same range is asked again, a bounded number of
        times."""
        entry = self.inflight.pop(offset, None)
        if entry is None or entry[0] != grant:
            if entry is not None:
                self.inflight[offset] = entry
            return []
        self.state[self.index[offset]] = _TODO
        if self.grant is None or self.grant.id != grant:
            return self._maybe_finish_ending()
        tries = self.retries.get(offset, 0)
        if retryable and tries < self.max_retries:
            self.retries[offset] = tries + 1
            self.inflight[offset] = entry
            self.state[self.index[offset]] = _INFLIGHT
            return [ReadRange(grant, offset, entry[1])]
        self._end(reason)
        return self._maybe_finish_ending()

    def on_revoked(self, grant: GrantId) -> list[Action]:
        """The server revoked ``grant`` (the source is going away); it will grant again."""
        if self.pending is not None and self.pending.id == grant:
            self.pending = None  # never started: nothing to drain
            return []
        if self.ending is not None and self.ending[0].id == grant:
            self.ending = (self.ending[0], None, None)  # the server ended it: it must not be reported failed too
            return self._maybe_finish_ending()
        if self.grant is None or self.grant.id != grant:
            return []
        self._end(None)
        return self._maybe_finish_ending()

    def on_abort(self) -> None:
        """The pull is abandoned (the call failed or was cancelled)."""
        if self.grant is not None:
            self._end(None)
        self.pending = None
        self.done = True

    @property
    def idle(self) -> bool:
        """No read is in flight (the buffers are not being written)."""
        return not self.inflight

    @property
    def complete(self) -> bool:
        """Every range is good."""
        return self.good_upto == len(self.ranges)

    # ---- internals ---------------------------------------------------------------------------

    def _move_prefix(self) -> None:
        while self.good_upto < len(self.ranges) and self.state[self.good_upto] == _GOOD:
            self.verified += self.ranges[self.good_upto][1]
            self.good_upto += 1

    def _advance(self, grant: GrantId) -> list[Action]:
        out: list[Action] = []
        before = self.verified
        self._move_prefix()
        if self.verified > before:
            out.append(Advance(self.verified))
        if self.complete:
            assert not self.inflight
            self.done = True
            self.grant = None
            out.append(ReportComplete(grant))
            return out
        if self.verified - self.reported >= self.report_every:
            self.reported = self.verified
            out.append(ReportProgress(grant, self.verified))
        return out

    def _begin(self, g: _Grant) -> list[Action]:
        self.grant = g
        self.grants_used += 1
        self.sources.append(g.source)
        self.retries.clear()
        if self.complete:
            self.done = True
            self.grant = None
            return [ReportComplete(g.id)]
        self.todo = [i for i in range(self.good_upto, len(self.ranges)) if self.state[i] == _TODO]
        heapq.heapify(self.todo)
        return self._issue()

    def _issue(self) -> list[Action]:
        g = self.grant
        assert g is not None
        out: list[Action] = []
        while len(self.inflight) < g.inflight and self.todo:
            i = heapq.heappop(self.todo)
            if self.state[i] != _TODO:
                continue
            off, n = self.ranges[i]
            self.state[i] = _INFLIGHT
            self.inflight[off] = (g.id, n)
            out.append(ReadRange(g.id, off, n))
        return out

    def _end(self, reason: str | None, bad_unit: int | None = None) -> None:
        g = self.grant
        assert g is not None
        self.grant = None
        self.retries.clear()
        self.todo = []
        self.ending = (g, reason, bad_unit)

    def _maybe_finish_ending(self) -> list[Action]:
        if self.ending is None or self.inflight:
            return []
        g, reason, bad_unit = self.ending
        self.ending = None
        out: list[Action] = []
        if bad_unit is not None:
            out.append(ReportChecksumFailed(g.id, self.verified, bad_unit))
        elif reason is not None:
            out.append(ReportSourceFailed(g.id, self.verified, reason))
        if self.pending is not None and not self.done:
            nxt, self.pending = self.pending, None
            out.extend(self._begin(nxt))
        return out
