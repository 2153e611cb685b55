"""The transfer engine: registered buffers, serving them, and pulling versions into them.

Theory of operation
-------------------
:class:`EngineActor` is one per process and event loop. It owns:

- the process's transports (started once; their endpoints go into every registration);
- one :class:`_Slot` per registered shard handle (server session): the handle's
  :class:`~tensorhub.transports.buffers.ShardBuffers`, a region id that names them to peers, the offload
  copies the server asked this shard to keep, and the :class:`~tensorhub.core.session.ReplicationSession`
  of a pull in progress.

Serving: transports call :meth:`EngineActor.resolve` from their threads with (region, version);
it returns the buffers that hold that version now (the live buffers if their progress counter
says so, else an offload copy), or None. Whether a range may be served is the progress counter's
business (:mod:`tensorhub.transports.buffers`), so partial holders serve as they fill.

Publishing: once the server has taken a publish, :class:`StartPublish` runs the holder's
background job in a worker thread: copy the tiny tensors into their packs (copied packs only:
in-place ones are the tensors; see :class:`~tensorhub.transports.buffers.ShardBuffers`; then the whole
shard is servable), hash every checksum unit, and declare the checksums to the server, which
hands them to readers. ``publish`` never waits for it; ``unpublish`` does
(:class:`WaitPublished`).

Pulling: a ``Grant`` from the server starts (or continues) the slot's session; the engine
carries out its actions: reads run as tasks on the transport (whose bulk work is in threads);
each read that lands is verified against the version's checksums in a worker thread while the
next reads are on the wire (or parked until the checksums arrive: a reader may be granted
before the publisher has hashed). A transport that reports landing (``local``) lets the engine
hash each piece in the thread that copied it, while it is still in that core's cache
(:class:`~tensorhub.runtime.checksum.LandingHasher`); verifying such a read is then only comparing its
digests with the declared checksums; verified bytes advance the progress counter; progress,
complete, source-failed and checksum-failed go to the server through the client actor (progress
at least every :data:`~tensorhub.core.shard.PROGRESS_INTERVAL` while it grows, from one interval
after a pull's first verified bytes: the server judges stragglers on it, never on a grant that
young). Before
complete is reported, copied packs are copied out into the caller's tiny tensors (in-place
packs received into them directly; :attr:`EngineActor.packs_in_place`). A pull that is
aborted (its call failed or was cancelled) is finished only when none of its reads can still
write into the buffers.

Self-check: when a reader reports a mismatch against this holder's copy, the server asks it to
re-verify (``VerifyRequest``); the engine re-hashes the held copy and answers.

Grant tokens (the authenticated data plane, :mod:`tensorhub.core.tokens`): each slot draws a
random key, which goes to the server inside the slot's endpoint (``Register`` moves it out of the
endpoint before anything else sees it). Transports that check grants (``checks_grants``) ask
:meth:`EngineActor.admit` from their threads before they serve anything of a region, bytes or a
memory description: the token must verify under the region's key, be for the version asked for
and not have expired. A refusal is counted (:attr:`EngineActor.refusals`, by reason) and
logged (the first of each reason, then at most one line per reason every 10 s with the count).
As a reader, the engine passes each grant's token to the transport it reads with.

What it must never do: serve a version the buffers do not hold (the progress counter's version
and generation are set before a publish is sent and bumped when an unpublish returns), or run
two pulls' reads into one set of buffers at once.

Size: one actor over one state (the slots and their pulls): its message handlers share that
state and its invariants; the seam to split along, if it grows, is serving vs. pulling.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import os
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

from tensorhub.core import messages as m
from tensorhub.core.errors import InvalidArgument, NotRegistered, TensorHubError, TransportError
from tensorhub.core.layout import Read
from tensorhub.core.messages import GRANT_KEY
from tensorhub.core.session import ReplicationSession
from tensorhub.core.shard import (
    PROGRESS_INTERVAL,
    Advance,
    Drained,
    DropPull,
    GrantKey,
    IssueRead,
    PullOutcome,
    ReportChecksumFailed,
    ReportComplete,
    ReportProgress,
    ReportSourceFailed,
    ShardCore,
    StartPull,
    UseGrant,
    VerifyRead,
    report_message,
)
from tensorhub.core.tokens import KEY_BYTES, InvalidToken, TokenChecker
from tensorhub.core.topology import Location
from tensorhub.scheduling.edges import choose_transport
from tensorhub.transports.buffers import ShardBuffers

from . import checksum
from .actor import Actor
from .convert import _STAGED, Conversion, ConversionStats, ConvertSpec

if TYPE_CHECKING:
    from tensorhub.transports.base import Transport

__all__ = ["EngineActor", "PullOutcome", "PullStats"]

#: ``report(build, unanswered)``: send ``build(req)`` to the server for a slot's shard; errors in
#: the answer are logged (``unanswered``: the server answers only an error, as for progress).
Report = Callable[[Callable[[int], Any], bool], None]


@dataclass
class PullStats:
    """What one pull moved, and from whom (for the demo's summary and the benchmarks)."""

    version: int
    bytes: int = 0
    grants: int = 0
    sources: list[str] = field(default_factory=list)
    transports: list[str] = field(default_factory=list)  #: the transport of each grant's edge
    reads: int = 0  #: transfer operations that landed (one request each)
    segments: int = 0  #: memory regions those reads touched (descriptors, for a one-sided transport)
    regions: int = 0  #: regions of the shard (what a one-sided transport registers)
    verify_s: float = 0.0  #: seconds spent hashing landed bytes (in worker threads, overlapped)
    hashed_on_landing: int = 0  #: reads whose bytes were hashed as they landed (no second pass)
    #: reads verified against checksums declared in parts, before the publisher had hashed the rest
    verified_early: int = 0


class _Slot:
    __slots__ = (
        "buffers",
        "checksums",
        "conversion",
        "convert",
        "core",
        "report",
        "ctx",
        "idle_waiters",
        "key",
        "landed",
        "location",
        "offloads",
        "parked",
        "peer",
        "prefixes",
        "packed",
        "peer_generation",
        "progress_timer",
        "read_hint",
        "publishing",
        "reads",
        "region",
        "session",
        "span",
        "stats",
        "token",
        "unpacking",
    )  # fmt: skip

    def __init__(
        self, session: int, region: int, buffers: ShardBuffers, report: Report, ctx: dict,
        new_pull: Callable[[int], ReplicationSession] | None = None,
    ) -> None:  # fmt: skip
        self.location: Location | None = None
        self.session = session
        self.region = region
        self.buffers = buffers
        self.report = report
        self.offloads: dict[int, ShardBuffers] = {}
        #: the slot's pulls, grants, draining and outcomes (sans-IO: the engine carries out its actions)
        self.core = ShardCore(new_pull or _no_pulls)
        self.peer: tuple[Transport, dict, int] | None = None
        self.idle_waiters: list[tuple[asyncio.Future, PullOutcome]] = []  # AbortPull answers once drained
        self.stats: PullStats | None = None
        self.ctx = ctx
        self.checksums: dict[int, tuple[int, ...]] = {}  # version -> its checksums, once known
        #: version -> its checksums declared so far in parts (a prefix of the units), until all are known
        self.prefixes: dict[int, list[int]] = {}
        self.parked: list[VerifyRead] = []  # landed reads waiting for checksums
        #: ((grant, term), offset) -> the digests of that read's units, hashed as they landed
        self.landed: dict[tuple[GrantKey, int], dict[int, int]] = {}
        self.reads: dict[int, Read] = {}  # offset -> the read plan's read (its checksum units)
        self.peer_generation: int | None = None  # the current grant's source generation
        self.publishing: asyncio.Task | None = None  # the publish job (pack, hash, declare)
        self.unpacking: asyncio.Task | None = None  # the last of the slot's unpacks (they run in order)
        self.span: _Span | None = None  # the transfer under the current grant, reported when it ends
        self.key = secrets.token_bytes(KEY_BYTES)  # grant tokens for this slot's region are sealed with it
        self.token: bytes | None = None  # the current grant's token, shown to its source
        self.convert: ConvertSpec | None = None  # a converted model's shard: how it converts
        self.conversion: Conversion | None = None  # its conversion in progress (or the last one)
        self.progress_timer: asyncio.TimerHandle | None = None  # a time-based progress report pending
        self.packed: bool | None = None  # buffers.packed, fixed at registration (asked after every verified read)
        self.read_hint = 0  # the read size the transport of the grant being taken asks for (0: none)


def _no_pulls(version: int) -> ReplicationSession:
    raise InvalidArgument(f"this slot has no buffers to pull version {version} into")


@dataclass(slots=True)
class _Span:
    """A transfer under one grant, as the reader saw it (reported to the server when it ends)."""

    grant: GrantKey
    version: int
    source: str
    source_shard: int
    transport: str
    start: float  # wall clock
    bytes0: int  # the pull's landed bytes and reads when the grant began
    reads0: int


#: ``$TENSORHUB_SPANS=0`` turns transfer reports off (e.g. against a server that predates them).
_SPANS = os.environ.get("TENSORHUB_SPANS", "1") != "0"


# ---- messages the engine takes -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddSlot:
    """Serve and pull a shard's buffers. ``report`` sends the slot's reports to the server
    (``report(build, unanswered)``: :meth:`tensorhub.runtime.client.ClientActor.report`); the
    engine knows no client."""

    session: int
    buffers: ShardBuffers
    report: Report
    ctx: dict
    location: Location | None = None
    convert: ConvertSpec | None = None  #: a shard of a converted model: how it converts (:mod:`.convert`)


@dataclass(frozen=True, slots=True)
class DropSlot:
    session: int


@dataclass(frozen=True, slots=True)
class Holdings:
    """Ask: ``(checksums by version, offload versions)`` a shard's slot knows (what a failover
    re-announces)."""

    session: int


@dataclass(frozen=True, slots=True)
class ServerTerm:
    """The client opened (or re-opened) ``session`` on a server of ``term``: the holder admits
    only grant tokens of that term from now on (a grant of a server it left is void)."""

    session: int
    term: int


@dataclass(frozen=True, slots=True)
class SuspendPull:
    """The server was lost: the slot's grant is void (its term is gone), but what the pull
    verified stays. Reads stop; the pull waits for a grant from the server the client moves to
    (the handle re-announces it as a partial holding) and resumes from its verified ranges."""

    session: int


@dataclass(frozen=True, slots=True)
class AbortPull:
    """The slot's pull ended without success: answered, once no read can write its buffers,
    with a :class:`PullOutcome` (``began``: a pull or conversion began writing the buffers since
    ``since``, a mark taken with :meth:`EngineActor.pull_mark` when the call started; they hold
    no version then)."""

    session: int
    since: int | None = None


@dataclass(frozen=True, slots=True)
class StartPublish:
    """The server took ``version`` from this slot: pack, hash and declare it in the background.
    ``checksums``: already known (a delta chain applied and verified in place, which the server
    took as the version): pack, and serve with them; nothing to hash or declare."""

    session: int
    version: int
    checksums: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class HashBuffers:
    """Ask: ``(the checksums of the slot's registered buffers now, packed first; the checksums
    this slot knew for version ``version`` before, or None)``. A publish of a version number the
    slot or the server has seen before proves its bytes with them (no version number may name
    two contents). Only while the buffers hold no published version (nobody reads them)."""

    session: int
    version: int


@dataclass(frozen=True, slots=True)
class WaitPublished:
    """Answer once the slot's publish job (if any) has ended."""

    session: int


@dataclass(frozen=True, slots=True)
class _ReadDone:
    session: int
    pull: int
    grant: GrantKey
    offset: int
    length: int
    generation: int | None
    digests: dict[int, int] | None = None  # the read's units hashed as they landed (fused)


@dataclass(frozen=True, slots=True)
class _Verified:
    session: int
    pull: int
    grant: GrantKey
    offset: int
    bad_unit: int | None


@dataclass(frozen=True, slots=True)
class _Unpacked:
    session: int
    pull: int
    grant: GrantKey
    error: str | None


@dataclass(frozen=True, slots=True)
class _ReadFailed:
    session: int
    pull: int
    grant: GrantKey
    offset: int
    reason: str
    retryable: bool


@dataclass(frozen=True, slots=True)
class _Offloaded:
    session: int
    version: int
    copy: ShardBuffers | None
    error: str | None


class EngineActor(Actor):
    """Args:
    transports: started transports by name (the order breaks ties when no preferred one fits).
    chunk_bytes: size of one read of a pull; None (the default): 8 MiB, or what the transport
        of a pull's first grant asks for (``Transport.read_bytes``) when that is more.
    preference: edge kind -> transport names (:func:`tensorhub.scheduling.edges.parse_preference`);
        None: the defaults (same host ``local``, same datacenter ``nixl``, else ``tcp``).
    """

    def __init__(
        self, transports: dict[str, Transport], chunk_bytes: int | None = None, preference: dict[str, list[str]] | None = None
    ) -> None:
        super().__init__("engine")
        #: whether the read size was given (then transports' ``read_bytes`` do not change it)
        self.chunk_fixed = chunk_bytes is not None
        if chunk_bytes is None:
            chunk_bytes = 8 << 20
        if chunk_bytes < 1:
            raise InvalidArgument(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.transports = transports
        #: Whether this process keeps packs in place (every transport gathers; see
        #: ``Transport.gathers``). Fixed at construction: the API reads it when it registers.
        self.packs_in_place = bool(transports) and all(t.gathers for t in transports.values())
        self.preference = preference
        self._fallbacks_logged: set[tuple[str, str, str]] = set()
        self.chunk_bytes = chunk_bytes
        self.slots: dict[int, _Slot] = {}
        self.regions: dict[int, _Slot] = {}
        self._regions = itertools.count(1)
        #: data-plane requests refused for want of a valid grant token, by reason (thread-safe reads)
        self.refusals: Counter[str] = Counter()
        self._tokens = TokenChecker(time.monotonic)
        self._terms: dict[int, int] = {}  # session -> the term of the server it is open on (ServerTerm)
        self._admit_lock = threading.Lock()
        self._refusal_logged: dict[str, float] = {}
        for t in transports.values():
            t.serve(self.resolve)
            t.guard(self.admit)
            if not getattr(t, "checks_grants", False) and t.cross_host:
                self.log.warning("this transport checks no grant tokens: whoever reaches its endpoint can read what "
                                 "it serves", transport=t.name)  # fmt: skip

    async def on_stop(self) -> None:
        for t in self.transports.values():
            await t.close()

    def endpoint(self, region: int) -> dict[str, Any]:
        return {"region": region, **{name: t.endpoint() for name, t in self.transports.items()}}

    @property
    def refused_total(self) -> int:
        """Data-plane requests refused for want of a valid grant token, all reasons."""
        with self._admit_lock:
            return sum(self.refusals.values())

    def admit(self, region: int, version: int, token: bytes | None, who: str) -> str | None:
        """The grant check transports run (from their threads) before serving anything of
        ``(region, version)``: None to serve, else why not (the refusal is counted and logged).

        Args:
            region: the region asked for (names a slot, and so its key).
            version: the version asked for (the token must be for it).
            token: what the request carried (None: nothing).
            who: the transport and the peer's address, for the log.
        """
        slot = self.regions.get(region)
        with self._admit_lock:
            try:
                if slot is None:
                    raise InvalidToken("unknown_region", f"no registered shard has region {region}")
                self._tokens.check(slot.key, token, version, self._terms.get(slot.session))
                return None
            except InvalidToken as err:
                self.refusals[err.reason] += 1
                count = self.refusals[err.reason]
                now = time.monotonic()
                last = self._refusal_logged.get(err.reason)
                log = last is None or now - last >= 10.0
                if log:
                    self._refusal_logged[err.reason] = now
                why = str(err)
        if log:
            ctx = {k: v for k, v in (slot.ctx if slot is not None else {}).items() if k in ("model", "replica", "shard")}
            self.log.warning("data-plane request without a valid grant token refused", who=who, region=region,
                             version=version, reason=why, refused=count, **ctx)  # fmt: skip
        return f"refused: {why}"

    def resolve(self, region: int, version: int) -> ShardBuffers | None:
        """Called from transport threads: the buffers that hold (or are about to hold)
        ``version`` under ``region``, or None for an unknown region."""
        slot = self.regions.get(region)
        if slot is None:
            return None
        live = slot.buffers
        if live.progress.version != version:
            copy = slot.offloads.get(version)
            if copy is not None:
                return copy
        # The live buffers, even if they do not hold ``version`` yet: the server may grant this
        # shard as a partial source before its own grant has arrived; the transport waits.
        return live

    # ---- slots -------------------------------------------------------------------------------

    def on_AddSlot(self, msg: AddSlot) -> dict[str, Any]:
        if msg.session in self.slots:
            raise InvalidArgument("this shard already has registered buffers", **msg.ctx)
        region = next(self._regions)
        slot = _Slot(msg.session, region, msg.buffers, msg.report, msg.ctx)
        # the engine reports progress on its clock (_report_progress): a pull's reports wait for
        # its first PROGRESS_INTERVAL (see ShardCore), so a burst of fast pulls sends none
        slot.core = ShardCore(functools.partial(self._new_pull, slot), timed_progress=True)
        slot.location = msg.location
        slot.convert = msg.convert
        self.slots[msg.session] = slot
        self.regions[region] = slot
        for t in self.transports.values():
            t.expose(msg.buffers)
        # The key rides in the endpoint to the handle's Register, which moves it into its own
        # field: the server keeps it, and the endpoint it hands to readers never holds it.
        return {**self.endpoint(region), GRANT_KEY: slot.key}

    def on_Holdings(self, msg: Holdings) -> tuple[dict[int, tuple[int, ...]], list[int]]:
        slot = self.slots.get(msg.session)
        if slot is None:
            return {}, []
        return dict(slot.checksums), sorted(slot.offloads)

    def on_DropSlot(self, msg: DropSlot) -> None:
        slot = self.slots.pop(msg.session, None)
        if slot is None:
            return
        if slot.publishing is not None:
            slot.publishing.cancel()
        if slot.conversion is not None and slot.conversion.task is not None:
            slot.conversion.task.cancel()
        self.regions.pop(slot.region, None)
        slot.buffers.progress.reset(None)
        for copy in slot.offloads.values():
            copy.progress.reset(None)
        for t in self.transports.values():
            t.withdraw(slot.buffers)
            for copy in slot.offloads.values():
                t.withdraw(copy)
        slot.offloads.clear()

    def pull_stats(self, session: int) -> PullStats | None:
        slot = self.slots.get(session)
        return slot.stats if slot is not None else None

    def pull_mark(self, session: int) -> int:
        """A mark of the pulls (and conversions) the shard's buffers have begun: a call takes it
        when it starts and gives it to :class:`AbortPull` or :meth:`pull_began`."""
        slot = self.slots.get(session)
        return slot.core.began if slot is not None else 0

    def pull_began(self, session: int, since: int) -> bool:
        """Whether a pull or conversion began writing the shard's buffers since mark ``since``
        (they then hold no version until it completes)."""
        slot = self.slots.get(session)
        return slot is not None and slot.core.began > since

    # ---- pulls -------------------------------------------------------------------------------

    def on_Grant(self, g: m.Grant) -> None:
        slot = self.slots.get(g.session)
        if slot is None:
            self.log.warning("grant for a shard with no buffers; ignored", session=g.session)
            return
        conv = slot.conversion
        if conv is not None and conv.task is not None and not conv.task.done():
            # the server moved this shard from converting to pulling: the conversion's reads end
            # before the pull's begin (both write these buffers)
            async def after() -> None:
                await conv.cancel()
                self.tell(g)

            self.spawn(after(), "convert")
            return
        try:
            peer, unreachable = self._pick(slot, g.source), None
        except TransportError as err:
            peer, unreachable = None, str(err)[:1000]
        # A pull this grant starts plans its reads with the size its transport asks for.
        slot.read_hint = getattr(peer[0], "read_bytes", 0) if peer is not None else 0
        actions = slot.core.on_grant(g, unreachable)
        if peer is not None:
            slot.peer = peer
        self._run(slot, actions)
        if g.checksums is not None:
            self._learn_checksums(slot, g.version, g.checksums)
        pull = slot.core.pull
        if pull is not None:
            self.log.debug("grant", grant=g.grant, version=g.version, source=g.source.replica, verified=pull.verified,
                           inflight=len(pull.inflight), **slot.ctx)  # fmt: skip

    def _use_grant(self, slot: _Slot, g: m.Grant) -> None:
        """Reads of the slot's pull go to ``g``'s source from now on (``slot.peer``, picked)."""
        assert slot.stats is not None and slot.peer is not None
        slot.token = g.token
        slot.peer_generation = None
        slot.stats.grants += 1
        slot.stats.sources.append(f"{g.source.replica}/{g.source.shard_idx}")
        slot.stats.transports.append(slot.peer[0].name)
        self._end_span(slot, "failed")  # a grant that was replaced without a word (normally reported already)
        slot.span = _Span((g.term, g.grant), g.version, g.source.replica, g.source.shard_idx, slot.peer[0].name, time.time(),
                          slot.stats.bytes, slot.stats.reads)  # fmt: skip

    def _new_pull(self, slot: _Slot, version: int) -> ReplicationSession:
        b = slot.buffers
        # The reads of a pull: the engine's chunk, or more where the first grant's transport
        # asks for it (``Transport.read_bytes``: local's reads each cost a round trip through
        # this loop, which its copy workers do not need).
        hint = slot.read_hint
        chunk = max(self.chunk_bytes, hint if type(hint) is int and not self.chunk_fixed else 0)
        plan = b.plan.reads(b.read_bytes(chunk))
        slot.reads = {r.offset: r for r in plan if r.length}
        return ReplicationSession(
            version, b.total_bytes, chunk, self._streams(), reads=[(r.offset, r.length) for r in plan], verify=True
        )

    def _start_pull(self, slot: _Slot, version: int) -> None:
        b = slot.buffers
        slot.parked.clear()
        slot.landed.clear()
        slot.stats = PullStats(version, regions=len(b.regions))
        b.progress.reset(version, 0)
        slot.checksums = {v: c for v, c in slot.checksums.items() if v in slot.offloads}
        slot.prefixes.clear()

    def _learn_checksums(self, slot: _Slot, version: int, checksums: tuple[int, ...]) -> None:
        if len(checksums) != len(slot.buffers.plan.units):
            self.log.error("checksums of the wrong length; ignored", version=version, got=len(checksums), **slot.ctx)
            return
        slot.checksums[version] = checksums
        slot.prefixes.pop(version, None)
        parked, slot.parked = slot.parked, []
        for a in parked:
            self._verify(slot, a)

    def _learn_part(self, slot: _Slot, version: int, first: int, values: tuple[int, ...]) -> None:
        """Checksums ``[first, first + len(values))`` of ``version``, declared while its publisher
        hashes the rest: parked reads whose units they cover are verified now. A part that
        leaves a gap or overruns the layout is logged and ignored (the whole set still comes)."""
        if version in slot.checksums:
            return
        got = slot.prefixes.setdefault(version, [])
        count = len(slot.buffers.plan.units)
        if first > len(got) or first + len(values) > count:
            self.log.error("a part of the checksums that does not continue the declared ones; ignored", version=version,
                           first=first, got=len(values), declared=len(got), units=count, **slot.ctx)  # fmt: skip
            return
        if first + len(values) <= len(got):
            return
        got.extend(values[len(got) - first :])
        parked, slot.parked = slot.parked, []
        for a in parked:
            self._verify(slot, a)

    def _streams(self) -> int:
        """Reads of a pull in flight at once: what the transports ask for (``reads_in_flight``,
        else ``streams``: a transport that stripes each read wants fewer)."""
        return max((getattr(t, "reads_in_flight", getattr(t, "streams", 1)) for t in self.transports.values()), default=1)

    def _pick(self, slot: _Slot, source: m.SourceInfo) -> tuple[Transport, dict, int]:
        """The transport for this (reader, holder) edge (:func:`tensorhub.scheduling.edges.choose_transport`),
        the holder's endpoint for it, and the holder's region id. A fallback from the preferred
        transport is logged once per (edge kind, preferred, chosen)."""
        endpoint = source.endpoint
        if not isinstance(endpoint, dict) or type(endpoint.get("region")) is not int:
            raise TransportError(f"source endpoint {endpoint!r} names no region")
        offered = [k for k, v in endpoint.items() if k != "region" and isinstance(v, dict)]

        def reaches(name: str) -> bool:
            probe = getattr(self.transports[name], "reaches", None)
            return probe is None or bool(probe(endpoint[name]))

        reader = slot.location or source.location
        choice = choose_transport(reader, source.location, offered, list(self.transports), self.preference, reaches)
        if choice.fallback:
            key = (choice.kind, choice.preferred, choice.name)
            if key not in self._fallbacks_logged:
                self._fallbacks_logged.add(key)
                # A warning when one side has the preferred transport (somebody meant to use
                # it); when neither does, it was not configured here, and that is no news.
                expected = choice.preferred in offered or choice.preferred in self.transports
                (self.log.warning if expected else self.log.info)(choice.describe(), **slot.ctx)
        return self.transports[choice.name], endpoint[choice.name], endpoint["region"]

    def _end_span(self, slot: _Slot, outcome: str, grant: GrantKey | None = None) -> None:
        """Report the transfer under the slot's current grant (if it is ``grant``, when given)."""
        span = slot.span
        if span is None or (grant is not None and span.grant != grant):
            return
        slot.span = None
        if not _SPANS:
            return
        stats = slot.stats
        moved = max(0, stats.bytes - span.bytes0) if stats is not None else 0
        reads = max(0, stats.reads - span.reads0) if stats is not None else 0
        end = max(time.time(), span.start)
        self._report(slot, lambda req: m.TransferSpan(req, slot.session, span.grant[1], span.version, span.source, span.source_shard,
                                                      span.transport, moved, reads, span.start, end, outcome), True)  # fmt: skip

    # ---- conversions (a converted model's shard built from the source's: :mod:`.convert`) ----

    def on_Convert(self, msg: m.Convert) -> None:
        slot = self.slots.get(msg.session)
        if slot is None:
            self.log.warning("convert for a shard with no buffers; ignored", session=msg.session)
            return
        if slot.convert is None:
            self.log.error("convert for a shard opened without convert_from; ignored", **slot.ctx)
            return
        conv = slot.conversion
        if conv is not None and conv.version == msg.version and not conv.done and conv.task is not None and not conv.task.done():
            try:
                conv.regrant(msg)
            except InvalidArgument as err:
                self.log.error("bad convert message; ignored", error=str(err), **slot.ctx)
            return
        self._run(slot, slot.core.on_abort()[0])
        self.spawn(self._start_conversion(slot, msg), "convert")

    async def _start_conversion(self, slot: _Slot, msg: m.Convert) -> None:
        old = slot.conversion
        if old is not None:
            await old.cancel()  # its reads end before the new one writes
        if slot.core.draining:  # so do an aborted pull's
            idle = asyncio.get_running_loop().create_future()
            slot.idle_waiters.append((idle, PullOutcome(False, False)))
            await idle
        assert slot.convert is not None
        try:
            conv = Conversion(slot.session, msg, slot.convert, slot.buffers, slot.report,
                              lambda info: self._pick_staged(slot, info), self.log.bind(**slot.ctx))  # fmt: skip
        except InvalidArgument as err:
            self.log.error("bad convert message; ignored", error=str(err), **slot.ctx)
            return
        slot.conversion = conv
        self._run(slot, slot.core.on_conversion())  # it begins writing the buffers (what the API looks at)
        slot.stats = PullStats(msg.version, regions=len(slot.buffers.regions))
        slot.checksums.pop(msg.version, None)
        task = conv.start()
        self.log.info("converting", version=msg.version, source=msg.source_model, sources=len(msg.sources), **slot.ctx)
        try:
            await asyncio.wait([task])
        finally:
            failure = task.exception() if task.done() and not task.cancelled() else None
            if failure is not None:
                self.log.error("conversion failed", version=msg.version, error=f"{type(failure).__name__}: {failure}", **slot.ctx)
                code = type(failure).code if isinstance(failure, TensorHubError) else TransportError.code
                text = failure.message if isinstance(failure, TensorHubError) else f"{type(failure).__name__}: {failure}"
                self._report(slot, lambda req: m.ConvertFailed(req, slot.session, conv.term, conv.version, code, text[:4000]))
        if conv.done and conv.sums is not None:
            slot.checksums[conv.version] = conv.sums
            st = slot.stats
            if st is not None and st.version == conv.version:
                st.bytes, st.grants, st.sources = conv.stats.read_bytes, len(conv.stats.sources), list(conv.stats.sources)
            self.log.info("converted", version=conv.version, tasks=conv.stats.tasks, read_bytes=conv.stats.read_bytes,
                          peak=conv.stats.peak_bytes, seconds=round(conv.stats.seconds, 3), **slot.ctx)  # fmt: skip

    def _pick_staged(self, slot: _Slot, source: m.SourceInfo) -> tuple[Transport, dict, int]:
        """:meth:`_pick` among the transports that read into a staging window (a conversion's)."""
        endpoint = source.endpoint
        if not isinstance(endpoint, dict):
            raise TransportError(f"source endpoint {endpoint!r} names no region")
        narrowed = {k: v for k, v in endpoint.items() if k == "region" or k in _STAGED}
        if not any(k in _STAGED and k in self.transports for k in narrowed):
            raise TransportError(f"no transport shared with {source.replica} can read into a staging buffer (need one of {_STAGED})")
        return self._pick(slot, dataclasses.replace(source, endpoint=narrowed))

    def conversion_stats(self, session: int) -> ConversionStats | None:
        slot = self.slots.get(session)
        return slot.conversion.stats if slot is not None and slot.conversion is not None else None

    def on_Revoke(self, msg: m.Revoke) -> None:
        slot = self.slots.get(msg.session)
        if slot is not None and slot.conversion is not None and slot.conversion.revoke(msg.term, msg.grant):
            self.log.info("conversion grant revoked", grant=msg.grant, reason=msg.reason, **slot.ctx)
            return
        if slot is not None and slot.core.pull is not None:
            key = (msg.term, msg.grant)
            reading = any(g == key for g, _ in slot.core.pull.inflight.values())
            self._end_span(slot, "revoked", key)
            self.log.info("grant revoked", grant=msg.grant, reason=msg.reason, version=slot.core.pull.version, **slot.ctx)
            self._run(slot, slot.core.on_revoke(msg.term, msg.grant))
            if reading:  # behind a slow source the next grant would wait a whole read for them
                self._abort_reads(slot, "its grant was revoked")

    def _abort_reads(self, slot: _Slot, why: str) -> None:
        """End the reads in flight into the slot's buffers where the transport can
        (:meth:`~tensorhub.transports.base.Transport.abort_reads`). Called only when every read in
        flight into them is of an ended grant or an aborted pull (the core holds a new grant's
        reads until those return): each one aborted comes back as a failed read of it, so the
        core sees it return before the range is read again, and nothing is blamed."""
        ended = 0
        for t in self.transports.values():
            try:
                ended += t.abort_reads(slot.buffers)
            except Exception:  # noqa: BLE001 - a plugin's bug leaves its reads to finish, as before
                self.log.exception("transport abort_reads raised", transport=t.name, **slot.ctx)
        if ended:
            self.log.info("reads in flight aborted", reads=ended, why=why, **slot.ctx)

    def on_ServerTerm(self, msg: ServerTerm) -> None:
        with self._admit_lock:  # admit() reads it from transport threads
            self._terms[msg.session] = msg.term
            if len(self._terms) > 4 * len(self.slots) + 1024:  # closed sessions' entries
                self._terms = {s: t for s, t in self._terms.items() if s in self.slots}

    def on_SuspendPull(self, msg: SuspendPull) -> None:
        slot = self.slots.get(msg.session)
        if slot is not None and slot.conversion is not None and not slot.conversion.done:
            self.spawn(slot.conversion.cancel(), "convert")  # the next server makes a converter again
        if slot is None or not slot.core.pulling or slot.core.grant_key is None:
            return
        pull = slot.core.pull
        assert pull is not None
        self._end_span(slot, "suspended", slot.core.grant_key)
        self.log.info("server lost mid-pull; suspended until the next grant", version=pull.version,
                      verified=pull.verified, **slot.ctx)  # fmt: skip
        self._run(slot, slot.core.on_suspend())

    def on_AbortPull(self, msg: AbortPull) -> asyncio.Future:
        slot = self.slots.get(msg.session)
        fut = asyncio.get_running_loop().create_future()
        if slot is None:
            fut.set_result(PullOutcome(False, False))
            return fut
        conv = slot.conversion
        if conv is not None and not conv.done:
            began = msg.since is None or slot.core.began > msg.since
            return asyncio.ensure_future(_cancelled(conv, PullOutcome(began, True)))  # answered once no read can land
        actions, outcome = slot.core.on_abort(msg.since)
        self._run(slot, actions)
        if slot.core.draining:
            slot.idle_waiters.append((fut, outcome))
        else:
            fut.set_result(outcome)
        return fut

    def _drop_pull(self, slot: _Slot, drained: bool) -> None:
        """The slot's pull was aborted: its bytes are no version's (its reads in flight, unless
        ``drained``, are ended where the transport can, else may still land)."""
        self._end_span(slot, "aborted")
        slot.parked.clear()
        slot.landed.clear()
        slot.buffers.progress.reset(None)
        if not drained:  # the next pull, or the abort's answer, waits for them
            self._abort_reads(slot, "its pull was aborted")

    def _run(self, slot: _Slot, actions: list) -> None:
        """Carry out the slot's core's actions (the IO: reads, hashing, reports)."""
        core = slot.core
        for a in actions:
            if isinstance(a, IssueRead):
                self.spawn(self._read(slot, a), "read")
            elif isinstance(a, VerifyRead):
                self._verify(slot, a)
            elif isinstance(a, Advance):
                slot.buffers.progress.advance(a.verified)
                self._report_progress(slot)
            elif isinstance(a, ReportProgress):
                self._report(slot, lambda req, a=a: report_message(a, slot.session, req), True)
            elif isinstance(a, ReportComplete):
                self.spawn(self._unpack(slot, core.serial, a.grant), "unpack")
            elif isinstance(a, StartPull):
                self._start_pull(slot, a.version)
            elif isinstance(a, UseGrant):
                self._use_grant(slot, a.grant)
            elif isinstance(a, DropPull):
                self._drop_pull(slot, a.drained)
            elif isinstance(a, Drained):
                waiters, slot.idle_waiters = slot.idle_waiters, []
                for fut, outcome in waiters:
                    if not fut.done():
                        fut.set_result(outcome)
            elif isinstance(a, (ReportChecksumFailed, ReportSourceFailed)):
                pull = core.pull
                src = pull.sources[-1] if pull is not None and pull.sources else None
                where = f"{src.replica}/{src.shard_idx} ({src.kind})" if src is not None else "?"
                version = pull.version if pull is not None else None
                if isinstance(a, ReportChecksumFailed):
                    self._end_span(slot, "checksum_failed", a.grant)
                    self.log.error("bytes from a source failed verification", grant=a.grant[1], source=where, unit=a.unit,
                                   version=version, **slot.ctx)  # fmt: skip
                else:
                    self._end_span(slot, "failed", a.grant)
                    self.log.warning("source failed", grant=a.grant[1], source=where, verified=a.verified, reason=a.reason,
                                     version=version, **slot.ctx)  # fmt: skip
                self._report(slot, lambda req, a=a: report_message(a, slot.session, req))

    def _report_progress(self, slot: _Slot) -> None:
        """Report the pull's progress now if a report is due (:meth:`ShardCore.report_progress`),
        else once :data:`PROGRESS_INTERVAL` allows, while it has grown unreported: the server judges
        stragglers on these reports, so they must not wait for the next eighth of the shard."""
        core = slot.core
        now = time.monotonic()
        self._run(slot, core.report_progress(now))
        if slot.progress_timer is not None or not core.progress_unreported:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven without a loop (a test): the next advance reports
            return

        def due() -> None:
            slot.progress_timer = None
            if self.slots.get(slot.session) is slot:
                self._report_progress(slot)

        wait = PROGRESS_INTERVAL - (now - core.reported_at) if core.reported_at is not None else 0.0
        slot.progress_timer = loop.call_later(max(wait, 0.0), due)

    def _verify(self, slot: _Slot, a: VerifyRead) -> None:
        expected: Sequence[int] | None = slot.checksums.get(a.version)
        units = slot.reads[a.offset].units
        if expected is None:
            # Declared in parts so far: enough if they reach this read's last unit.
            expected = slot.prefixes.get(a.version)
            if expected is None or not units or max(units) >= len(expected):
                slot.parked.append(a)  # the publisher has not declared them yet
                return
            if slot.stats is not None and slot.core.is_current(a.pull):
                slot.stats.verified_early += 1
        digests = slot.landed.pop((a.grant, a.offset), None)
        if digests is not None:  # hashed as the bytes landed: only the comparison is left
            if slot.stats is not None and slot.core.is_current(a.pull):
                slot.stats.hashed_on_landing += 1
            bad = next((u for u in units if digests.get(u) != expected[u]), None)
            self.tell(_Verified(slot.session, a.pull, a.grant, a.offset, bad))
            return
        self.spawn(self._check(slot, a, expected), "verify")

    async def _check(self, slot: _Slot, a: VerifyRead, expected: Sequence[int]) -> None:
        units = slot.reads[a.offset].units
        t0 = time.perf_counter()
        try:
            bad = await asyncio.to_thread(checksum.first_mismatch, slot.buffers, units, expected, True)
        except (RuntimeError, OSError, InvalidArgument) as err:  # e.g. a CUDA error staging the bytes
            # Never accept bytes that were not checked: count the read as bad (it is read again).
            self.log.error("verifying landed bytes failed locally", error=repr(err), **slot.ctx)
            bad = units[0]
        if slot.stats is not None and slot.core.is_current(a.pull):
            slot.stats.verify_s += time.perf_counter() - t0
        self.tell(_Verified(slot.session, a.pull, a.grant, a.offset, bad))

    def on__Verified(self, msg: _Verified) -> None:
        slot = self.slots.get(msg.session)
        if slot is None or not slot.core.is_current(msg.pull):
            return
        packed = slot.packed
        if packed is None:
            packed = slot.packed = slot.buffers.packed
        if msg.bad_unit is None and packed:
            # Its tiny tensors are final: copy them out now, overlapped with the rest of the pull.
            units = slot.buffers.plan.units
            tiny = [units[u].tensor for u in slot.reads[msg.offset].units if units[u].region >= 0
                    and slot.buffers.plan.regions[units[u].region].tensor is None]  # fmt: skip
            if tiny:
                self._chain_unpack(slot, tiny)
        self._run(slot, slot.core.on_verified(msg.pull, msg.grant, msg.offset, msg.bad_unit))

    def _chain_unpack(self, slot: _Slot, tensors: list[int] | None) -> asyncio.Task:
        """Unpack ``tensors`` (None: all) in a worker thread, after the slot's earlier unpacks
        (so that an aborted pull's late copy never lands after a newer one's)."""
        before = slot.unpacking

        async def run() -> str | None:
            if before is not None:
                await asyncio.wait([before])
            try:
                await asyncio.to_thread(slot.buffers.unpack, tensors)
            except (RuntimeError, ValueError) as err:
                return f"{type(err).__name__}: {err}"
            return None

        task = slot.unpacking = self.spawn(run(), "unpack")
        return task

    async def _unpack(self, slot: _Slot, pull: int, grant: GrantKey) -> None:
        error = None
        if slot.buffers.packed and slot.unpacking is not None:
            last = slot.unpacking
            await asyncio.wait([last])
            error = last.result()
        self.tell(_Unpacked(slot.session, pull, grant, error))

    def on__Unpacked(self, msg: _Unpacked) -> None:
        slot = self.slots.get(msg.session)
        if slot is None or not slot.core.is_current(msg.pull):
            return
        if msg.error is not None:
            self._end_span(slot, "failed", msg.grant)
            self.log.error("unpacking the pulled tiny tensors failed", error=msg.error, **slot.ctx)
            reason = f"unpacking failed locally: {msg.error}"[:1000]
            self._report(slot, lambda req: m.SourceFailed(req, slot.session, msg.grant[1], msg.grant[0], 0, reason))
            return
        self._report(slot, lambda req: m.Complete(req, slot.session, msg.grant[1], msg.grant[0]))
        self._end_span(slot, "completed", msg.grant)

    def _report(self, slot: _Slot, build: Any, unanswered: bool = False) -> None:
        slot.report(build, unanswered)

    async def _read(self, slot: _Slot, a: IssueRead) -> None:
        from tensorhub.transports.base import RangeNotReady

        assert slot.peer is not None
        if not self._read_live(slot, a):
            # Its grant ended (revoked: its reads were aborted) or its pull was aborted before
            # this task ran: it never starts, as the core never issues such a held read.
            self.tell(_ReadFailed(slot.session, a.pull, a.grant, a.offset, "its grant ended before the read started", False))
            return
        transport, peer, region = slot.peer
        generation = slot.peer_generation
        kw: dict[str, Any] = {}
        hasher: checksum.LandingHasher | checksum.DeviceLanding | None = None
        if getattr(transport, "reports_landing", False) and a.offset in slot.reads:
            units = slot.buffers.plan.units
            mine = [units[u] for u in slot.reads[a.offset].units]
            if checksum.lands(slot.buffers):
                hasher = checksum.LandingHasher(slot.buffers, mine)
                kw["landed"] = hasher  # callable; ``local`` also uses its ``unit_stream``
            elif checksum.FUSED_GPU_COPY and checksum.lands_on_device(slot.buffers):  # the GPU copy hashes what it lands
                hasher = checksum.DeviceLanding(slot.buffers, mine)
                kw["landed"] = hasher
        if getattr(transport, "checks_grants", False):
            kw["token"] = slot.token  # a plugin that predates tokens is not given the argument
        try:
            gen = await transport.read(peer, region, a.version, a.offset, a.length, slot.buffers, generation, **kw)
        except RangeNotReady as err:
            self.tell(_ReadFailed(slot.session, a.pull, a.grant, a.offset, str(err), True))
        except (TransportError, InvalidArgument) as err:
            src = slot.core.grant.source if slot.core.grant is not None else None
            holder = f"holder {src.replica}/{src.shard_idx}: " if src is not None else ""
            self.tell(_ReadFailed(slot.session, a.pull, a.grant, a.offset, f"{holder}{err}", False))
        except Exception as err:  # noqa: BLE001 - a transport's bug fails this source, not the engine
            self.log.exception("transport read raised", transport=transport.name, **slot.ctx)
            self.tell(_ReadFailed(slot.session, a.pull, a.grant, a.offset, f"{type(err).__name__}: {err}", False))
        else:
            digests = hasher.digests if hasher is not None and hasher.complete else None
            self.tell(_ReadDone(slot.session, a.pull, a.grant, a.offset, a.length, gen, digests))

    @staticmethod
    def _read_live(slot: _Slot, a: IssueRead) -> bool:
        """Whether ``a``'s pull is current and its grant is the one the pull reads with."""
        pull = slot.core.pull
        return (slot.core.is_current(a.pull) and pull is not None and not pull.done and pull.grant is not None
                and pull.grant.id == a.grant)  # fmt: skip

    def on__ReadDone(self, msg: _ReadDone) -> None:
        slot = self.slots.get(msg.session)
        if slot is None:
            return
        core = slot.core
        if msg.digests is not None and core.is_current(msg.pull):
            slot.landed[(msg.grant, msg.offset)] = msg.digests
        counts = slot.stats is not None and core.is_current(msg.pull, msg.grant)
        actions = core.on_read_done(msg.pull, msg.grant, msg.offset)
        if counts and slot.stats is not None:
            slot.stats.bytes += msg.length
            slot.stats.reads += 1
            slot.stats.segments += len(slot.buffers.segments(msg.offset, msg.length))
            if slot.peer_generation is None and isinstance(msg.generation, int):
                slot.peer_generation = msg.generation  # later reads of this grant insist on it
        self._run(slot, actions)

    def on__ReadFailed(self, msg: _ReadFailed) -> None:
        slot = self.slots.get(msg.session)
        if slot is None:
            return
        self._run(slot, slot.core.on_read_failed(msg.pull, msg.grant, msg.offset, msg.reason, msg.retryable))



    # ---- what the server asks of a holder ---------------------------------------------------

    def on_OffloadRequest(self, msg: m.OffloadRequest) -> None:
        slot = self.slots.get(msg.session)
        if slot is None:
            return
        self.log.info("offloading the last retained copy to CPU", version=msg.version, **slot.ctx)
        self.spawn(self._offload(slot, msg.version), "offload")

    async def _offload(self, slot: _Slot, version: int) -> None:
        try:
            copy = await asyncio.to_thread(slot.buffers.clone_cpu)
        except (RuntimeError, MemoryError) as err:
            self.tell(_Offloaded(slot.session, version, None, repr(err)))
            return
        self.tell(_Offloaded(slot.session, version, copy, None))

    def on__Offloaded(self, msg: _Offloaded) -> None:
        slot = self.slots.get(msg.session)
        if slot is None:
            return
        ok = msg.copy is not None
        if msg.copy is not None:
            msg.copy.progress.reset(msg.version, msg.copy.total_bytes)
            for t in self.transports.values():  # registered before anyone can resolve to it
                t.expose(msg.copy)
            slot.offloads[msg.version] = msg.copy
        else:
            self.log.error("offload failed", version=msg.version, error=msg.error, **slot.ctx)
        self._report(slot, lambda req: m.PublishOffload(req, slot.session, msg.version, ok))

    def on_FreeOffload(self, msg: m.FreeOffload) -> None:
        slot = self.slots.get(msg.session)
        copy = slot.offloads.pop(msg.version, None) if slot is not None else None
        if copy is not None:
            copy.progress.reset(None)
            for t in self.transports.values():
                t.withdraw(copy)

    def on_VerifyRequest(self, msg: m.VerifyRequest) -> None:
        slot = self.slots.get(msg.session)
        if slot is None:
            return
        self.spawn(self._self_check(slot, msg.version), "self-check")

    async def _self_check(self, slot: _Slot, version: int) -> None:
        live = slot.buffers
        held = live if live.progress.version == version else slot.offloads.get(version)
        expected = slot.checksums.get(version)
        if slot.publishing is not None and not slot.publishing.done():
            await asyncio.wait([slot.publishing])
            expected = slot.checksums.get(version)
        if held is None or expected is None:
            # Nothing to judge (the holding went away, or its checksums were never known).
            self.log.warning("verify request for a copy that cannot be checked", version=version, **slot.ctx)
            ok = held is not None
        else:
            units = range(len(held.plan.units))
            bad = await asyncio.to_thread(checksum.first_mismatch, held, units, expected)
            ok = bad is None
            if not ok:
                self.log.error("self-check failed: this holder's copy is corrupt", version=version, unit=bad, **slot.ctx)
        self._report(slot, lambda req: m.VerifyResult(req, slot.session, version, ok))

    def on_ChecksumsReady(self, msg: m.ChecksumsReady) -> None:
        slot = self.slots.get(msg.session)
        if slot is not None:
            self._learn_checksums(slot, msg.version, msg.checksums)

    def on_ChecksumsPartReady(self, msg: m.ChecksumsPartReady) -> None:
        slot = self.slots.get(msg.session)
        if slot is not None:
            self._learn_part(slot, msg.version, msg.first, msg.checksums)

    # ---- publishing --------------------------------------------------------------------------

    def on_StartPublish(self, msg: StartPublish) -> None:
        slot = self.slots.get(msg.session)
        if slot is None:
            return
        if slot.publishing is not None and not slot.publishing.done():
            return  # the same version again while its job runs
        _, held, verified = slot.buffers.progress.snapshot()
        if msg.version in slot.checksums and held == msg.version and verified >= slot.buffers.total_bytes:
            return  # published again while held: already packed, hashed and declared
        # Otherwise (a version number published again after an unpublish: the buffers may have
        # changed since) it is packed again and served only once the packs are filled; its
        # checksums come with the publish (``msg.checksums``) or are computed again.
        slot.publishing = self.spawn(self._publish_job(slot, msg.version, msg.checksums), "publish")

    async def _publish_job(self, slot: _Slot, version: int, known: tuple[int, ...] | None = None) -> None:
        b = slot.buffers
        gen = b.progress.snapshot()[0]
        try:
            if b.packed:
                await asyncio.to_thread(b.pack)
            if b.progress.snapshot()[:2] != (gen, version):
                return  # unpublished meanwhile
            if known is not None:
                self._learn_checksums(slot, version, known)
            b.progress.advance(b.total_bytes)
            if known is not None:
                return
            loop = asyncio.get_running_loop()

            def part(first: int, values: list[int]) -> None:  # from a hashing thread
                loop.call_soon_threadsafe(self._declare_part, slot, version, gen, first, tuple(values))

            sums = tuple(await asyncio.to_thread(checksum.compute, b, None, part))
        except (RuntimeError, ValueError, InvalidArgument) as err:
            self.log.error("publish job failed: the version stays without checksums", version=version, error=repr(err), **slot.ctx)
            return
        if b.progress.snapshot()[:2] != (gen, version):
            return
        slot.checksums[version] = sums
        self._report(slot, lambda req: m.DeclareChecksums(req, slot.session, version, sums))

    def _declare_part(self, slot: _Slot, version: int, gen: int, first: int, values: tuple[int, ...]) -> None:
        """Declare a part of the checksums the publish job is computing (readers verify the bytes
        it covers without waiting for the rest), unless the slot no longer holds that version."""
        if self.slots.get(slot.session) is slot and slot.buffers.progress.snapshot()[:2] == (gen, version):
            self._report(slot, lambda req: m.DeclareChecksumsPart(req, slot.session, version, first, values))

    def on_HashBuffers(self, msg: HashBuffers) -> Any:
        slot = self.slots.get(msg.session)
        if slot is None:
            raise NotRegistered("the shard's buffers are not registered with the engine")
        known = slot.checksums.get(msg.version)

        async def run() -> tuple[tuple[int, ...], tuple[int, ...] | None]:
            b = slot.buffers
            if b.packed:
                await asyncio.to_thread(b.pack)
            return tuple(await asyncio.to_thread(checksum.compute, b)), known

        return asyncio.ensure_future(run())

    def on_WaitPublished(self, msg: WaitPublished) -> Any:
        slot = self.slots.get(msg.session)
        if slot is None or slot.publishing is None or slot.publishing.done():
            return None
        return asyncio.ensure_future(asyncio.wait([slot.publishing]))

    def on_Quarantined(self, msg: m.Quarantined) -> None:
        slot = self.slots.get(msg.session)
        if slot is None:
            return
        self.log.error("copy quarantined by the server", version=msg.version, **slot.ctx)
        if slot.buffers.progress.version == msg.version:
            slot.buffers.progress.reset(None)
        copy = slot.offloads.pop(msg.version, None)
        if copy is not None:
            copy.progress.reset(None)

    def on_Removed(self, msg: m.Removed) -> None:
        slot = self.slots.get(msg.session)
        if slot is None:
            return
        self.log.warning("session removed by the server", code=msg.code, reason=msg.reason, **slot.ctx)
        self._run(slot, slot.core.on_abort()[0])
        slot.buffers.progress.reset(None)
        for copy in slot.offloads.values():
            copy.progress.reset(None)
        slot.offloads.clear()


async def _cancelled(conv: Conversion, outcome: PullOutcome) -> PullOutcome:
    await conv.cancel()
    return outcome
