"""The reader's side of one shard's pull: grant -> reads -> progress -> complete / source failed.

Theory of operation
-------------------
:class:`ReplicationSession` is sans-IO, like the reference table: the engine feeds it events
(a grant arrived, a read finished or failed, the server revoked the grant) and carries out the
actions it returns (:class:`ReadRange`, :class:`Advance`, :class:`ReportProgress`,
:class:`ReportComplete`, :class:`ReportSourceFailed`). It imports no asyncio, zmq or sockets,
so the simulator and the property tests drive the same code as the real engine.

What it owns: the version and size of the shard being pulled, the current grant, the reads in
flight, and ``verified``: the bytes landed contiguously from the start of the shard. Reads are
issued in layout order, ``chunk_bytes`` each, at most ``max_inflight`` at once; one that lands
out of order waits above ``verified`` until the gap below it closes.

Invariants:

- ``verified`` never decreases; it is what the local progress counter publishes to downstream
  readers (:class:`Advance`), so a partial holder serves only bytes it has whole.
- No read of a new grant starts while a read of an ended grant may still be writing into the
  buffers: a failed or revoked grant is reported (or the next grant started) only after all
  its reads have returned. Reads of an ended grant are ignored when they return; bytes they
  wrote above ``verified`` are read again.
- Every grant ends exactly once from this side: :class:`ReportComplete`, or
  :class:`ReportSourceFailed`, or a revoke from the server (which needs no report).

What it must never do: report complete with a read missing or in flight, or count a read of a
revoked or failed grant as verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from .errors import InvalidArgument

__all__ = [
    "Action",
    "Advance",
    "ReadRange",
    "ReplicationSession",
    "ReportComplete",
    "ReportProgress",
    "ReportSourceFailed",
]


@dataclass(frozen=True, slots=True)
class ReadRange:
    """Read shard bytes ``[offset, offset + length)`` from the grant's source."""

    grant: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Advance:
    """The local progress counter may publish ``verified`` bytes."""

    verified: int


@dataclass(frozen=True, slots=True)
class ReportProgress:
    grant: int
    verified: int


@dataclass(frozen=True, slots=True)
class ReportComplete:
    grant: int


@dataclass(frozen=True, slots=True)
class ReportSourceFailed:
    grant: int
    verified: int
    reason: str


Action = Union[ReadRange, Advance, ReportProgress, ReportComplete, ReportSourceFailed]


@dataclass(frozen=True, slots=True)
class _Grant:
    id: int
    source: Any


class ReplicationSession:
    """One shard's pull of one version, across however many grants it takes.

    Args:
        version: the version being pulled.
        total_bytes: the shard's size.
        chunk_bytes: the size of one read.
        max_inflight: reads in flight at once (the transport's streams).
        report_every: send the server a progress report each time ``verified`` has grown by
            this much (and never more often).
        max_retries: how many times one range may be re-read after ``not ready`` answers
            (a partial source that is itself waiting) before the source is reported failed.
    """

    def __init__(
        self,
        version: int,
        total_bytes: int,
        chunk_bytes: int = 8 << 20,
        max_inflight: int = 4,
        report_every: int | None = None,
        max_retries: int = 12,
    ) -> None:
        if total_bytes < 0 or chunk_bytes < 1 or max_inflight < 1:
            raise InvalidArgument(f"bad session parameters: {total_bytes=}, {chunk_bytes=}, {max_inflight=}")
        self.version = version
        self.total_bytes = total_bytes
        self.chunk_bytes = chunk_bytes
        self.max_inflight = max_inflight
        self.report_every = report_every or max(chunk_bytes, total_bytes // 8)
        self.max_retries = max_retries
        self.verified = 0
        self.grant: _Grant | None = None
        self.ending: tuple[_Grant, str | None] | None = None  # (grant, failure reason or None if revoked)
        self.pending: _Grant | None = None  # a grant that arrived while the last one's reads drain
        self.inflight: dict[int, tuple[int, int]] = {}  # offset -> (grant id, length)
        self.landed: dict[int, int] = {}  # offset -> length, above verified (current grant)
        self.retries: dict[int, int] = {}
        self.next_offset = 0
        self.reported = 0
        self.done = False
        self.grants_used = 0
        self.sources: list[Any] = []

    # ---- events ------------------------------------------------------------------------------

    def on_grant(self, grant: int, source: Any = None) -> list[Action]:
        """The server granted ``source`` for this pull."""
        if self.done or (self.grant is not None and self.grant.id == grant):
            return []  # a repeated grant changes nothing
        if (self.pending is not None and self.pending.id == grant) or (
            self.ending is not None and self.ending[0].id == grant
        ):
            return []
        g = _Grant(grant, source)
        if self.grant is not None and self.grant.id != grant:
            # The server only grants again after the last grant ended; treat it as revoked.
            self._end(None)
        if self.ending is not None:
            self.pending = g
            return self._maybe_finish_ending()
        return self._begin(g)

    def on_read_done(self, grant: int, offset: int) -> list[Action]:
        """A read issued for ``grant`` at ``offset`` landed whole."""
        entry = self.inflight.pop(offset, None)
        if entry is None or entry[0] != grant:
            if entry is not None:
                self.inflight[offset] = entry
            return []
        if self.grant is None or self.grant.id != grant:
            return self._maybe_finish_ending()
        self.retries.pop(offset, None)
        self.landed[offset] = entry[1]
        out: list[Action] = []
        before = self.verified
        while self.verified in self.landed:
            self.verified += self.landed.pop(self.verified)
        if self.verified > before:
            out.append(Advance(self.verified))
        if self.verified == self.total_bytes and not self.inflight:
            self.done = True
            self.grant = None
            out.append(ReportComplete(grant))
            return out
        if self.verified - self.reported >= self.report_every:
            self.reported = self.verified
            out.append(ReportProgress(grant, self.verified))
        out.extend(self._issue())
        return out

    def on_read_failed(self, grant: int, offset: int, reason: str, retryable: bool = False) -> list[Action]:
        """A read for ``grant`` at ``offset`` failed. ``retryable``: the source answered "not
        ready yet" (a partial source), so the same range is asked again, a bounded number of
        times."""
        entry = self.inflight.pop(offset, None)
        if entry is None or entry[0] != grant:
            if entry is not None:
                self.inflight[offset] = entry
            return []
        if self.grant is None or self.grant.id != grant:
            return self._maybe_finish_ending()
        tries = self.retries.get(offset, 0)
        if retryable and tries < self.max_retries:
            self.retries[offset] = tries + 1
            self.inflight[offset] = entry
            return [ReadRange(grant, offset, entry[1])]
        self._end(reason)
        return self._maybe_finish_ending()

    def on_revoked(self, grant: int) -> list[Action]:
        """The server revoked ``grant`` (the source is going away); it will grant again."""
        if self.pending is not None and self.pending.id == grant:
            self.pending = None  # never started: nothing to drain
            return []
        if self.ending is not None and self.ending[0].id == grant:
            self.ending = (self.ending[0], None)  # the server ended it: it must not be reported failed too
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

    # ---- internals ---------------------------------------------------------------------------

    def _begin(self, g: _Grant) -> list[Action]:
        self.grant = g
        self.grants_used += 1
        self.sources.append(g.source)
        self.landed.clear()
        self.retries.clear()
        self.next_offset = self.verified
        if self.verified == self.total_bytes:
            self.done = True
            self.grant = None
            return [ReportComplete(g.id)]
        return self._issue()

    def _issue(self) -> list[Action]:
        g = self.grant
        assert g is not None
        out: list[Action] = []
        while len(self.inflight) < self.max_inflight and self.next_offset < self.total_bytes:
            n = min(self.chunk_bytes, self.total_bytes - self.next_offset)
            self.inflight[self.next_offset] = (g.id, n)
            out.append(ReadRange(g.id, self.next_offset, n))
            self.next_offset += n
        return out

    def _end(self, reason: str | None) -> None:
        g = self.grant
        assert g is not None
        self.grant = None
        self.landed.clear()
        self.retries.clear()
        self.ending = (g, reason)

    def _maybe_finish_ending(self) -> list[Action]:
        if self.ending is None or self.inflight:
            return []
        g, reason = self.ending
        self.ending = None
        out: list[Action] = []
        if reason is not None:
            out.append(ReportSourceFailed(g.id, self.verified, reason))
        if self.pending is not None and not self.done:
            nxt, self.pending = self.pending, None
            out.extend(self._begin(nxt))
        return out
