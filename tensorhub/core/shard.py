"""The shard core: what one shard handle decides about its pulls, without IO.

Theory of operation
-------------------
:class:`ShardCore` is sans-IO, like the reference table and the
:class:`~tensorhub.core.session.ReplicationSession` it drives: it takes events and returns
actions, and imports no asyncio, threads or sockets. The engine
(:mod:`tensorhub.runtime.engine`: transports and worker threads) and the simulator
(``sim/actors.py``: flows in virtual time) both feed it and carry out what it returns, so a rule
written here holds in both.

Events: a grant (:meth:`ShardCore.on_grant`), a revoke (:meth:`~ShardCore.on_revoke`), the server lost
(:meth:`~ShardCore.on_suspend`), a read landed (:meth:`~ShardCore.on_read_done`) or failed
(:meth:`~ShardCore.on_read_failed`), a landed read checked (:meth:`~ShardCore.on_verified`), the
handle's call ending the pull (:meth:`~ShardCore.on_abort`), a conversion beginning to write the
buffers (:meth:`~ShardCore.on_conversion`), and the handle's model-parallel calls
(:meth:`~ShardCore.next_call`, :meth:`~ShardCore.give_back`).

Actions: :class:`DropPull`, :class:`StartPull`, :class:`UseGrant`, :class:`IssueRead`,
:class:`VerifyRead`, :class:`~tensorhub.core.session.Advance`, the session's reports
(:class:`~tensorhub.core.session.ReportProgress`, ``ReportComplete``, ``ReportSourceFailed``,
``ReportChecksumFailed``; :func:`report_message` makes each the wire message), and
:class:`Drained`.

The rules it owns:

- **Grants.** A grant for the version of the pull in progress continues that pull (it resumes
  from the ranges already good). A grant for another version, or after the pull finished,
  starts a new pull, and aborts one still in progress first. A grant whose source this process
  cannot reach (no transport fits; the caller says so) is reported failed at once. A pull knows
  a grant by ``(term, grant id)``: ids restart with each server start.
- **Draining.** A pull ended while reads of it are in flight (aborted) is kept until they
  return: reads of the next pull are held back until then, so two pulls never write into the
  buffers at once. A held read whose grant ended meanwhile is never issued: the session is told
  it failed unstarted, and reads the range again under its next grant. :class:`Drained` says no aborted pull writes any more (an abort is answered
  then).
- **Outcomes.** :attr:`ShardCore.began` counts the pulls (and conversions) that began writing
  into the buffers: a call that marked it before it began knows, from :meth:`~ShardCore.on_abort`'s
  :class:`PullOutcome`, whether it had begun moving (the buffers then hold no version).
- **Call numbering.** Every shard of a replica numbers its numbered calls 1, 2, 3, ... in the
  same order, so the server can match the shards' calls; a call the server never answered
  because it was lost gives its number back (made again on the next server, it gets what the
  other shards were given).
- **Progress reports.** Besides the session's reports (every eighth of the shard), a pull
  whose verified prefix grew reports it at least every :data:`PROGRESS_INTERVAL` seconds
  (:meth:`ShardCore.report_progress`; the caller's clock drives it), under its live grant only:
  the server judges stragglers on these reports, and one every eighth is minutes apart on a slow
  link. A grant waiting for the last grant's reads to drain is live (what lands meanwhile is
  reported under it); a revoked or failed one is not. A caller that drives the clock
  (``timed_progress``: the engine) reports nothing in a pull's first :data:`PROGRESS_INTERVAL`
  after its first verified bytes, the session's per-eighth reports included: the server judges
  no grant before its straggler window (seconds), so those reports are never acted on, and a
  burst of fast pulls (each done within the interval) sends no progress at all, only grants and
  completions. A pull that lasts longer reports as before from then on.
- **Offload seeding** (:func:`seed_step`): an ``update`` answer that names a seed version starts
  a seed (retiring an older one); once the replica itself holds the seed's version or a newer
  one, the seed is retired.

Invariants:

- :class:`IssueRead` is returned only for the current pull, under the grant it was given last
  that is still live, and never while an aborted pull has a read in flight.
- Events of a pull that is neither current nor draining change nothing; actions of a draining
  pull are dropped (its bytes are abandoned), except that its returning reads end the draining.

What it must never do: let a new pull's read start before an aborted pull's reads returned, or
report anything for a pull that is not current.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from . import messages as m
from .session import (
    Advance,
    ReadRange,
    ReplicationSession,
    ReportChecksumFailed,
    ReportComplete,
    ReportProgress,
    ReportSourceFailed,
    Verify,
)

__all__ = [
    "PROGRESS_INTERVAL",
    "Advance",
    "Drained",
    "DropPull",
    "GrantKey",
    "IssueRead",
    "PullOutcome",
    "ReportChecksumFailed",
    "ReportComplete",
    "ReportProgress",
    "ReportSourceFailed",
    "RetireSeed",
    "ShardAction",
    "ShardCore",
    "StartPull",
    "StartSeed",
    "UseGrant",
    "VerifyRead",
    "report_message",
    "seed_step",
]

#: How a pull knows a grant: ``(term, grant id)``.
GrantKey = tuple[int, int]

#: Seconds: a pull whose verified prefix grew reports it at least this often (see the module
#: docstring). A fraction of any sensible straggler window (the server's default is 5 s), so
#: the server reads rates over many reports and tells a silent grant from a late report soon;
#: at most a few messages a second per pulling shard.
PROGRESS_INTERVAL = 0.5


@dataclass(frozen=True, slots=True)
class StartPull:
    """A new pull of ``version`` begins: the buffers now receive it from byte 0 (reset their
    progress counter to ``version``, 0 bytes)."""

    pull: int
    version: int


@dataclass(frozen=True, slots=True)
class DropPull:
    """The pull in progress ended without success: the buffers hold no version now.
    ``drained``: no read of it is in flight (else :class:`Drained` follows when they return)."""

    pull: int
    version: int
    drained: bool


@dataclass(frozen=True, slots=True)
class UseGrant:
    """Reads of the current pull go to ``grant``'s source from now on."""

    grant: m.Grant


@dataclass(frozen=True, slots=True)
class IssueRead:
    """Read shard bytes ``[offset, offset + length)`` of ``version`` (pull ``pull``) from
    ``grant``'s source; report the result with :meth:`ShardCore.on_read_done` or
    :meth:`ShardCore.on_read_failed`."""

    pull: int
    version: int
    grant: GrantKey
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class VerifyRead:
    """Check the landed bytes ``[offset, offset + length)`` of ``version`` against its checksums;
    report the result with :meth:`ShardCore.on_verified`."""

    pull: int
    version: int
    grant: GrantKey
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Drained:
    """No aborted pull's read can write into the buffers any more."""


@dataclass(frozen=True, slots=True)
class PullOutcome:
    """How a pull ended for the call that ended it (:meth:`ShardCore.on_abort`).

    Attributes:
        began: a pull (or conversion) began writing into the buffers since the call's mark:
            they hold no version now.
        aborted: a pull was in progress and is aborted by this call.
    """

    began: bool
    aborted: bool


@dataclass(frozen=True, slots=True)
class StartSeed:
    """Start an offload seed of ``version`` (retiring the handle's older seed first)."""

    version: int


@dataclass(frozen=True, slots=True)
class RetireSeed:
    """Unpublish and close the handle's offload seed: the replica itself holds its version now."""


ShardAction = (
    StartPull | DropPull | UseGrant | IssueRead | VerifyRead | Advance | Drained
    | ReportProgress | ReportComplete | ReportSourceFailed | ReportChecksumFailed
)

#: ``new_pull(version)``: a replication session for a new pull of ``version`` (the read plan,
#: streams and verification are the caller's: they depend on its buffers and transports).
NewPull = Callable[[int], ReplicationSession]


def report_message(a: Any, session: int, req: int) -> Any:
    """The wire message of a report action ``a`` for the shard's server session ``session``.

    Raises:
        TypeError: ``a`` is not a report.
    """
    term, grant = a.grant
    if isinstance(a, ReportProgress):
        return m.Progress(req, session, grant, term, a.verified)
    if isinstance(a, ReportComplete):
        return m.Complete(req, session, grant, term)
    if isinstance(a, ReportSourceFailed):
        return m.SourceFailed(req, session, grant, term, a.verified, a.reason[:1000])
    if isinstance(a, ReportChecksumFailed):
        return m.ChecksumFailed(req, session, grant, term, a.verified, a.unit)
    raise TypeError(f"not a report: {a!r}")


def seed_step(seed: int | None, held: int | None, answer_seed: int | None) -> StartSeed | RetireSeed | None:
    """The offload-seeding rule after an ``update`` answer.

    Args:
        seed: the version the handle's seed holds or pulls (None: no seed).
        held: the version the handle holds after the answer.
        answer_seed: the answer's ``seed`` (the server chose this replica to seed it).
    Returns:
        What to do with the seed, or None.
    """
    if answer_seed is not None:
        return StartSeed(answer_seed)
    if seed is not None and held is not None and held >= seed:
        return RetireSeed()
    return None


class Numbered(Protocol):
    """Anything that numbers a shard's model-parallel calls (a core, a handle): its ``calls``."""

    calls: int


def next_call(owner: Numbered) -> int:
    """The number of ``owner``'s next model-parallel call (1, 2, 3, ... on every shard)."""
    owner.calls += 1
    return owner.calls


def give_back(owner: Numbered, n: int) -> None:
    """Call ``n`` got no answer because the server was lost: made again, it takes ``n`` (the
    number the other shards' same call has)."""
    if owner.calls == n:
        owner.calls = n - 1


class ShardCore:
    """One shard handle's pulls and calls (see the module docstring).

    Args:
        new_pull: makes the replication session of a new pull of a version.
        timed_progress: the caller calls :meth:`report_progress` on its clock while a pull
            grows (the engine does; the simulator does not): a pull's reports, the session's
            per-eighth ones too, wait until :data:`PROGRESS_INTERVAL` after its first verified
            bytes (see the module docstring).
    """

    def __init__(self, new_pull: NewPull, timed_progress: bool = False) -> None:
        self._new_pull = new_pull
        self.timed_progress = timed_progress
        #: the pull (serial) whose reports go out: with ``timed_progress``, set by its first
        #: timed report (until then its first interval runs, from ``reported_at``)
        self.reporting = 0
        self.armed = 0  #: with ``timed_progress``: the pull whose first verified bytes set ``reported_at``
        self.told = 0  #: with ``timed_progress``: the verified prefix the current pull's reports last told
        self.pull: ReplicationSession | None = None  #: the current pull (done once it completed)
        self.serial = 0  #: the current pull's number (what its actions carry)
        self.grant: m.Grant | None = None  #: the grant given last (live or not)
        self.aborted: dict[int, ReplicationSession] = {}  # aborted pulls whose reads are in flight
        self.held: list[IssueRead] = []  # reads of the current pull that wait for the draining
        self.began = 0  #: pulls and conversions begun (see :class:`PullOutcome`)
        self.calls = 0  #: the last model-parallel call number given
        self.reported_at: float | None = None  #: when :meth:`report_progress` last reported

    # ---- queries -------------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        """An aborted pull still has reads in flight."""
        return bool(self.aborted)

    @property
    def pulling(self) -> bool:
        """A pull is in progress (begun, neither complete nor aborted)."""
        return self.pull is not None and not self.pull.done

    def is_current(self, pull: int, grant: GrantKey | None = None) -> bool:
        """Whether ``pull`` is the current pull (and ``grant``, when given, the last grant)."""
        if self.pull is None or pull != self.serial:
            return False
        return grant is None or (self.grant is not None and grant == (self.grant.term, self.grant.grant))

    @property
    def grant_key(self) -> GrantKey | None:
        g = self.grant
        return (g.term, g.grant) if g is not None else None

    @property
    def live_grant(self) -> GrantKey | None:
        """The grant the current pull may report progress under: the one it reads with, or the
        one waiting for the last grant's reads to drain; None when it has neither (revoked and not
        granted again, failed, done)."""
        pull, key = self.pull, self.grant_key
        if pull is None or pull.done or key is None:
            return None
        for g in (pull.grant, pull.pending):
            if g is not None and g.id == key:
                return key
        return None

    @property
    def progress_unreported(self) -> bool:
        """The current pull verified more than it last reported, under a live grant."""
        pull = self.pull
        return pull is not None and self.live_grant is not None and pull.verified > pull.reported

    def report_progress(self, now: float) -> list[ShardAction]:
        """A progress report of the current pull, if one is due at ``now``: its verified prefix
        grew since the last report, under a live grant, and the last report made here is at
        least :data:`PROGRESS_INTERVAL` old (the caller asks again later while
        :attr:`progress_unreported`). With ``timed_progress``, the session's own reports count
        as reports made here (a report every interval is what is wanted, whichever sends it),
        and the pull's first interval sends nothing.

        Args:
            now: the caller's clock, in seconds (monotonic).
        Returns:
            ``[ReportProgress]`` or nothing.
        """
        pull, key = self.pull, self.live_grant
        if pull is None or key is None:
            return []
        if self.timed_progress and self.reporting == self.serial and pull.reported != self.told:
            # The session reported (an eighth) since the last look: that is this interval's report.
            self.told = pull.reported
            self.reported_at = now
        if pull.verified <= pull.reported:
            return []
        if self.timed_progress and self.armed != self.serial:
            # The pull's first verified bytes: its first report is due an interval from now (a
            # pull done by then reports none; the server judges no grant that young).
            self.armed = self.serial
            self.reported_at = now
            return []
        if self.reported_at is not None and now - self.reported_at < PROGRESS_INTERVAL:
            return []
        self.reported_at = now
        self.reporting = self.serial
        pull.reported = self.told = pull.verified  # the session's own per-eighth reports count from here
        return [ReportProgress(key, pull.verified)]

    # ---- what the server says ------------------------------------------------------------------

    def on_grant(self, g: m.Grant, unreachable: str | None = None) -> list[ShardAction]:
        """The server granted ``g.source`` for ``g.version``.

        Args:
            g: the grant.
            unreachable: why this process cannot read from the source (no transport reaches
                it); the grant is then reported failed at once.
        Returns:
            The actions, in order.
        """
        out: list[ShardAction] = []
        pull = self.pull
        if pull is None or pull.version != g.version or pull.done:
            if pull is not None and not pull.done:
                out.append(self._drop())
            pull = self._start(g.version, out)
        self.grant = g
        key = (g.term, g.grant)
        if unreachable is not None:
            out.append(ReportSourceFailed(key, pull.verified, unreachable))
            return out
        out.append(UseGrant(g))
        return out + self._run(self.serial, pull.on_grant(key, g.source))

    def on_revoke(self, term: int, grant: int) -> list[ShardAction]:
        """The server revoked grant ``(term, grant)`` (its source is going away)."""
        if self.pull is None:
            return []
        return self._run(self.serial, self.pull.on_revoked((term, grant)))

    def on_suspend(self) -> list[ShardAction]:
        """The server was lost: the current grant is void, what the pull verified stays; it
        resumes under the next server's grant."""
        pull, key = self.pull, self.grant_key
        if pull is None or pull.done or key is None:
            return []
        return self._run(self.serial, pull.on_revoked(key))

    # ---- what the IO reports -------------------------------------------------------------------

    def on_read_done(self, pull: int, grant: GrantKey, offset: int) -> list[ShardAction]:
        """A read of ``pull`` issued for ``grant`` at ``offset`` landed whole."""
        session = self._session(pull)
        if session is None:
            return []
        out = self._run(pull, session.on_read_done(grant, offset))
        return out + self._check_drained()

    def on_read_failed(self, pull: int, grant: GrantKey, offset: int, reason: str, retryable: bool = False) -> list[ShardAction]:
        """A read of ``pull`` for ``grant`` at ``offset`` failed (``retryable``: the source
        answered "not ready yet")."""
        session = self._session(pull)
        if session is None:
            return []
        out = self._run(pull, session.on_read_failed(grant, offset, reason, retryable))
        return out + self._check_drained()

    def on_verified(self, pull: int, grant: GrantKey, offset: int, bad_unit: int | None) -> list[ShardAction]:
        """The landed read at ``offset`` was checked (``bad_unit`` None: it matched)."""
        if self.pull is None or pull != self.serial:
            return []
        return self._run(pull, self.pull.on_verified(grant, offset, bad_unit))

    # ---- what the handle does ------------------------------------------------------------------

    def on_abort(self, since: int | None = None) -> tuple[list[ShardAction], PullOutcome]:
        """The handle's call ended the pull (it failed or was cancelled).

        Args:
            since: :attr:`began` when the call started (None: not known).
        Returns:
            The actions, and the outcome. The call is over once :attr:`draining` is False
            (a :class:`Drained` action says when).
        """
        out: list[ShardAction] = []
        aborted = self.pulling
        if aborted:
            out.append(self._drop())
        began = aborted if since is None else self.began > since
        return out, PullOutcome(began, aborted)

    def on_conversion(self) -> list[ShardAction]:
        """A conversion takes over the buffers: a pull in progress is aborted first."""
        out: list[ShardAction] = [self._drop()] if self.pulling else []
        self.began += 1
        return out

    def next_call(self) -> int:
        """The number of the handle's next model-parallel call."""
        return next_call(self)

    def give_back(self, n: int) -> None:
        """Call ``n`` got no answer because the server was lost: made again, it takes ``n``."""
        give_back(self, n)

    # ---- internals -----------------------------------------------------------------------------

    def _session(self, pull: int) -> ReplicationSession | None:
        if self.pull is not None and pull == self.serial:
            return self.pull
        return self.aborted.get(pull)

    def _start(self, version: int, out: list[ShardAction]) -> ReplicationSession:
        self.serial += 1
        self.began += 1
        self.held = []
        out.append(StartPull(self.serial, version))
        self.pull = self._new_pull(version)
        return self.pull

    def _drop(self) -> DropPull:
        pull = self.pull
        assert pull is not None
        pull.on_abort()
        for r in self.held:  # never started: nothing of them can land
            pull.on_read_failed(r.grant, r.offset, "the pull was aborted before the read started")
        self.pull = None
        self.held = []
        if not pull.idle:
            self.aborted[self.serial] = pull
        return DropPull(self.serial, pull.version, pull.idle)

    def _check_drained(self) -> list[ShardAction]:
        if not self.aborted:
            return []
        self.aborted = {k: p for k, p in self.aborted.items() if not p.idle}
        if self.aborted:
            return []
        held, self.held = self.held, []
        out: list[ShardAction] = []
        pull = self.pull
        for r in held:
            if pull is None or r.pull != self.serial:
                continue
            if pull.grant is not None and pull.grant.id == r.grant:
                out.append(r)
            else:  # its grant ended while it waited: it never started (the session reads it again)
                out.extend(self._run(r.pull, pull.on_read_failed(r.grant, r.offset, "its grant ended before the read started")))
        out.append(Drained())
        return out

    def _run(self, pull: int, actions: list[Any]) -> list[ShardAction]:
        """The session's actions, as the IO carries them out (those of a pull that is not
        current are dropped; reads wait while an aborted pull drains)."""
        if self.pull is None or pull != self.serial:
            return []
        version = self.pull.version
        out: list[ShardAction] = []
        for a in actions:
            if isinstance(a, ReadRange):
                read = IssueRead(pull, version, a.grant, a.offset, a.length)
                (self.held if self.aborted else out).append(read)
            elif isinstance(a, Verify):
                out.append(VerifyRead(pull, version, a.grant, a.offset, a.length))
            elif isinstance(a, ReportProgress) and self.timed_progress and self.reporting != pull:
                # Within the pull's first interval: not sent (see report_progress), and the pull
                # has told the server nothing yet, which its next timed report goes by.
                self.pull.reported = 0
            else:
                out.append(a)
        return out
