"""The reference table's records: the plain objects that hold its state, its parameters, and the
source policy it is given.

Theory of operation
-------------------
What it owns: the shape of the state. A ``_Model`` has a ``_Version`` per version (the holders of
each shard, and the counts kept in step with them) and a ``_Replica`` per replica, which has a
``_Session`` per open shard; a ``_Holder`` is one session's holding of one version; a ``_Grant``
is reader <- source; a ``_Txn`` is one model-parallel call, with a ``_ShardCall`` per shard that
made it; a ``_Declaration`` is a replica's retention. Also :class:`TableConfig`, the
:class:`SourcePolicy` protocol that the injected source index follows, the table's bounds, and
the few questions that more than one concern asks of the records (``_all_done``,
``_offload_of``, ``_seed_name``).

Invariants: records hold data and answer questions about it; they change nothing themselves.
Every change goes through the table's methods, which keep the indexes and counts in step (a
holder's ``state`` is set only by ``HolderMixin._account``, in :mod:`.holders`).
Sets are dicts with ``None`` values, so iteration follows insertion, never hash order.

What it must never do: import the table or a mixin (they import this module, never the other
way), import IO or anything above the core, or hold a hash-ordered set of strings.
"""

from __future__ import annotations

from collections import deque
import random
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Protocol

from .. import messages as m
from ..errors import InvalidArgument, InvalidTransition, TensorHubError, VersionUnavailable
from ..layout import Layout
from ..lifecycle import HolderState, IdentityEnum
from ..naming import MAX_NAME_LEN, SEED_SUFFIX, VersionSpec, delta_owner, seed_owner, seed_replica
from ..placement import PlacedTensor
from ..topology import Location

P, C, O, U = HolderState.PARTIAL, HolderState.COMPLETE, HolderState.OFFLOAD, HolderState.UNPUBLISHING
SERVING = (C, O)  # states that make a (version, shard) available

Outbox = list[tuple[Hashable, Any]]

_FENCED_MEMORY = 65536  # how many removed session ids are remembered (to answer Fenced)
_OFFERS_KEPT = 8  # listings remembered per undecided wait, for its shards to report satisfied
_MAX_SOURCE_FAILURES = 3  # a reader retries sources that failed it, this many times in all
_GONE_MEMORY = 1024  # how far below the highest published version gone versions are remembered


HISTORY_VERSIONS = 64  #: versions whose replication history the table keeps (all models together)
HISTORY_EDGES = 4096  #: grants kept per version


@dataclass(frozen=True, slots=True)
class TableConfig:
    """Parameters of the table: timings (seconds) and policies.

    Attributes:
        pipeline: partial holders serve readers (pipeline replication, DESIGN §4). False: only
            complete and offload holders are sources, so N readers fan out from the holders of
            the version (the baseline that the burst benchmarks compare against).
        smart_skipping: while a replica of a datacenter is seeding a version (pulling it across
            datacenters), ``update()`` elsewhere in that datacenter answers "not yet" instead of
            queueing behind the slow link (DESIGN §5.6). Only with ``pipeline``.
        pin_timeout: how long a replicate/update that has decided its version keeps that version's
            sources for itself (a *pin*, see :mod:`tensorhub.core.table.pins`) after it decided.
        straggler_window, straggler_ratio: see :mod:`tensorhub.core.table.stragglers`.
        grant_ttl: how long a grant token (:mod:`tensorhub.core.tokens`) admits its reader to
            the source's data plane after the grant; a pull still reading past it is refused by
            the source and granted again (with a fresh token).
    """

    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    drain_timeout: float = 30.0
    pipeline: bool = True
    smart_skipping: bool = True
    pin_timeout: float = 300.0
    grant_ttl: float = 3600.0
    #: stragglers (:mod:`tensorhub.core.table.stragglers`): a grant is judged on its progress over
    #: this many seconds; its source is slow below ``straggler_ratio`` of the reference rate
    #: (0, the default here: no straggler detection; ``tensorhub server`` turns it on at 0.25)
    straggler_window: float = 5.0
    straggler_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0 or self.drain_timeout <= 0 or self.pin_timeout <= 0:
            raise InvalidArgument("heartbeat_interval, drain_timeout and pin_timeout must be > 0")
        if self.straggler_window <= 0 or not 0 <= self.straggler_ratio < 1:
            raise InvalidArgument("straggler_window must be > 0 and straggler_ratio in [0, 1)")
        if not 1.0 <= self.grant_ttl <= 1e6:
            raise InvalidArgument(f"grant_ttl must be in [1, 1e6] seconds, got {self.grant_ttl}")
        if self.heartbeat_timeout < 10 * self.heartbeat_interval:
            raise InvalidArgument(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must be at least 10x "
                f"heartbeat_interval ({self.heartbeat_interval})"
            )


# --- internal records ---------------------------------------------------------------------------


class _Grant:
    __slots__ = ("id", "reader", "source", "req", "created", "ended", "start")

    def __init__(self, gid: int, reader: "_Holder", source: "_Holder", req: int, created: float) -> None:
        self.id = gid
        self.reader = reader
        self.source = source
        self.req = req
        self.created = created
        self.ended: str | None = None
        self.start = reader.verified  # what the reader had verified when this grant began


class _Holder:
    __slots__ = (
        "id", "session", "replica", "version", "shard_idx", "state", "kind", "grants", "upstream", "excluded", "failures",
        "verified", "checksums", "reporters", "readmitted", "blamed_bad", "verify_pending", "offload_pending", "drain_deadline",
        "on_drained", "on_offloaded", "call", "waiting", "whole", "last_failure", "converting",
    )  # fmt: skip

    def __init__(self, hid: int, session: "_Session", version: int, kind: str) -> None:
        self.id = hid
        self.session = session
        self.replica = session.replica  # a session's replica never changes: kept here, read on every grant
        self.version = version
        self.shard_idx = session.shard_idx
        self.state: HolderState | None = None
        self.kind = kind
        self.grants: dict[int, _Grant] = {}  # active grants where this holder is the source
        self.upstream: _Grant | None = None  # active grant where this holder is the reader
        self.excluded: dict[int, bool] = {}  # source holder id -> failed verification (else: failed)
        self.failures = 0  # sources that failed this reader
        self.verified = 0
        self.checksums: tuple[int, ...] | None = None
        self.reporters: dict[str, None] = {}  # replicas that reported a mismatch on this holder
        self.readmitted: dict[int, None] = {}  # sources this reader blamed whose self-check then passed
        self.blamed_bad = False  # a source this reader blamed failed its self-check (quarantined)
        self.verify_pending = False
        self.offload_pending = False
        self.drain_deadline: float | None = None
        self.on_drained: list[Callable[[], None]] = []
        self.on_offloaded: Callable[[], None] | None = None
        self.call: tuple[_Txn, int] | None = None  # the replicate/update call this partial serves
        self.waiting = False  # a partial holder waiting for a source (grace period)
        self.whole = False  # has held the whole shard (complete or offload), so can finish readers
        self.last_failure = ""  # the reason the last source that failed this reader gave (for its error)
        #: a converter's grants, by source shard (a holder of a converted model building its shard
        #: from the source model's holders: :mod:`.conversions`); empty for every other holder
        self.converting: dict[int, _Grant] | None = None

    @property
    def spot(self) -> bool:
        return self.session.spot


class _Session:
    __slots__ = (
        "id", "peer", "model", "replica", "shard_idx", "incarnation", "location", "spot", "retain",
        "last_seen", "opened", "layout", "total_bytes", "endpoint", "slot", "grant_key", "holder", "offloads", "announced", "answered",
    )  # fmt: skip

    def __init__(self, sid: int, peer: Hashable, model: "_Model", replica: "_Replica", msg: m.OpenShard, now: float):
        self.id = sid
        self.peer = peer
        self.model = model
        self.replica = replica
        self.shard_idx = msg.shard_idx
        self.slot = f"{model.name}/{replica.name}/{msg.shard_idx}"  # as the reign's membership names it
        self.incarnation = msg.incarnation
        self.location: Location = msg.location
        self.spot = msg.spot
        self.retain = msg.retain
        self.last_seen = now
        self.opened = now  # when it opened (a fencing keeps the replica's shards opened after the fenced one went silent)
        self.layout: Layout | None = None
        self.total_bytes = 0  # the registered layout's bytes (0: none), kept by set_layout
        self.endpoint: Any = None
        self.grant_key: bytes | None = None  # signs the tokens of grants from this session (never sent out)
        self.holder: _Holder | None = None  # the holding in the registered buffers
        self.offloads: dict[int, _Holder] = {}  # holder id -> offload holder (CPU copies, draining ones too)
        self.announced = False  # re-announced its state after a failover
        self.answered = 0  # the last call it had an answer for, as it announced

    def set_layout(self, layout: Layout | None) -> None:
        """Register ``layout`` (None: unregister), and its size with it."""
        self.layout = layout
        self.total_bytes = layout.total_bytes if layout is not None else 0

    def ctx(self, version: int | None = None) -> dict[str, Any]:
        return {"model": self.model.name, "replica": self.replica.name, "shard": self.shard_idx, "version": version}


class _ShardCall:
    __slots__ = ("session", "req", "done", "held")

    def __init__(self, session: _Session, req: int) -> None:
        self.session = session
        self.req = req
        self.done = False
        #: replicate: the checksums the shard's buffers already hold (a delta chain applied)
        self.held: tuple[int, ...] | None = None


class CallState(IdentityEnum):
    """Where a model-parallel call is in deciding its answer (:data:`CALL_TRANSITIONS`)."""

    OPEN = "open"  # undecided: collecting its shards, looking for (or parked until) its version
    DECIDED = "decided"  # its answer is decided and it does not move (publish, list, an update that stays)
    MOVING = "moving"  # a replicate/update that decided a version and replaces what the replica held


class CallEvent(IdentityEnum):
    DECIDE = "decide"  # its answer (or error) is decided
    MOVE = "move"  # it decided to replace the replica's holding with a version
    STAY = "stay"  # it decided (or will decide) not to move


_O, _D, _M = CallState.OPEN, CallState.DECIDED, CallState.MOVING

#: ``{(state, event): next state}`` of a call; an event with no entry raises InvalidTransition and
#: changes nothing. An error is data beside the state (``_Txn.error``, like its answer), and so is
#: ``waiting`` (the call is in its model's parked set, to be woken when versions change; a call
#: restored decided by a failover may still be parked).
CALL_TRANSITIONS: dict[tuple[CallState, CallEvent], CallState] = {
    (_O, CallEvent.DECIDE): _D,
    (_D, CallEvent.DECIDE): _D,
    (_M, CallEvent.DECIDE): _M,
    (_O, CallEvent.MOVE): _M,  # decided (or about to be) to move
    (_D, CallEvent.MOVE): _M,  # a call restored after a failover: decided, then told it moved
    (_M, CallEvent.MOVE): _M,  # its pin moved to a newer version
    (_O, CallEvent.STAY): _O,
    (_D, CallEvent.STAY): _D,
}


class _Txn:
    """One model-parallel call (replica, call number). Its decision is a state
    (:class:`CallState`) changed only by :meth:`fire` through :data:`CALL_TRANSITIONS`;
    ``decided`` and ``moved`` are views of it (assigning one fires its event)."""

    __slots__ = (
        "n", "kind", "args", "replica", "state", "version", "answer", "error", "deadline",
        "shards", "consumed", "source_replica", "offered", "waiting", "offload_seed", "skipped", "seed", "pinned_until",
        "deltas", "delta_plan",
    )  # fmt: skip

    def __init__(self, n: int, kind: str, args: Any, replica: "_Replica") -> None:
        self.n = n
        self.kind = kind
        self.args = args
        self.replica = replica
        self.state = CallState.OPEN
        self.version: int | None = None
        self.answer: Any = None
        self.error: TensorHubError | None = None
        self.deadline: float | None = None
        self.shards: dict[int, _ShardCall] = {}
        self.consumed: dict[int, None] = {}
        self.source_replica: str | None = None
        self.offered: dict[int, tuple[m.VersionEntry, ...]] = {}
        self.waiting = False  # parked until the version it names exists (or a failover settles)
        self.offload_seed = False  # update: the replica seeds into a CPU copy rather than stall
        self.skipped: int | None = None  # update: the newer version it skipped (being seeded here)
        self.seed: int | None = None  # update: the version the replica is to offload-seed
        self.pinned_until: float | None = None  # replicate/update: its version is pinned until then
        self.deltas = False  # update: the replica can apply deltas (the table may plan a chain)
        #: update: the delta chain planned for the replica (see .deltas): the target, and each
        #: shard's deltas to pull (the same versions for every shard)
        self.delta_plan: tuple[int, dict[int, tuple[m.DeltaRef, ...]]] | None = None

    def fire(self, event: CallEvent) -> None:
        """Apply ``event``.

        Raises:
            InvalidTransition: the call has no transition on it in its state; nothing changes.
        """
        try:
            self.state = CALL_TRANSITIONS[(self.state, event)]
        except KeyError:
            raise InvalidTransition(
                f"call {self.n} ({self.kind}) in state {self.state.value!r} has no transition on {event.value!r}"
            ) from None

    @property
    def decided(self) -> bool:
        return self.state is CallState.DECIDED or self.state is CallState.MOVING

    @decided.setter
    def decided(self, value: bool) -> None:
        if not value:
            raise InvalidTransition(f"call {self.n} ({self.kind}): a decision is never taken back")
        self.fire(CallEvent.DECIDE)

    @property
    def moved(self) -> bool:
        """A replicate/update that started replacing what the replica held."""
        return self.state is CallState.MOVING

    @moved.setter
    def moved(self, value: bool) -> None:
        self.fire(CallEvent.MOVE if value else CallEvent.STAY)


class _Replica:
    __slots__ = ("name", "model", "num_shards", "spot", "shards", "txns", "serving", "announce_until", "twin")

    def __init__(self, name: str, model: "_Model", num_shards: int, spot: bool) -> None:
        self.name = name
        #: the name of the replica that shares this one's host and link: the replica an offload
        #: seed replica seeds for, or this replica's seed (None: its name is too long for one)
        self.twin = seed_owner(name) or _seed_name(name)
        self.model = model
        self.num_shards = num_shards
        self.spot = spot
        self.shards: dict[int, _Session] = {}
        self.txns: dict[int, _Txn] = {}
        self.serving: dict[str, int] = {}  # reader replica -> active grants from this replica
        self.announce_until: float | None = None  # its shards are re-announcing (after a failover)


class _Version:
    """One version of a model: its holders per shard, and counts kept up to date on every
    holder transition so that availability and the listing cost O(1) per event."""

    __slots__ = (
        "version", "holders", "ever_available", "checksums", "prefix", "serving", "shards_serving", "per_replica", "full",
        "index", "bases", "layouts", "delta_pending",
    )  # fmt: skip

    def __init__(self, version: int, num_shards: int, sources: Callable[[], "SourcePolicy"]) -> None:
        self.version = version
        self.holders: list[dict[int, _Holder]] = [{} for _ in range(num_shards)]
        self.ever_available = False
        self.checksums: dict[int, tuple[int, ...]] = {}  # shard_idx -> the declared checksums
        #: shard_idx -> the checksums declared so far in parts (a prefix of the units), until all are
        self.prefix: dict[int, tuple[int, ...]] = {}
        self.serving = [0] * num_shards  # complete/offload holders per shard
        self.shards_serving = 0  # shards with at least one
        self.per_replica: dict[str, list[int]] = {}  # replica -> [serving shards, of which offload]
        self.full: dict[str, None] = {}  # replicas serving every shard
        self.index = [sources() for _ in range(num_shards)]  # grantable holders per shard
        #: a delta model's version (:mod:`.deltas`): per shard, the version its delta applies
        #: to and the layout of its blob (fixed per version, not per model)
        self.bases: dict[int, int] = {}
        self.layouts: dict[int, Layout] = {}
        #: per shard, (base, until): its publisher computes the delta base -> this version
        self.delta_pending: dict[int, tuple[int, float]] = {}

    @property
    def available(self) -> bool:
        return self.shards_serving == len(self.serving)


class _Declaration:
    __slots__ = ("back", "open_shards")

    def __init__(self, back: int) -> None:
        self.back = back
        self.open_shards: dict[int, None] = {}  # shards that declared and have not closed cleanly


class _Model:
    __slots__ = (
        "name", "num_shards", "layouts", "versions", "highest_published", "replicas", "declarations",
        "epoch", "listing", "available", "listing_stale", "changed", "availability_changed", "waits", "parked",
        "offload_holders", "dirty_shards", "retention_changed", "waiting_readers", "gc_needed", "seeds", "pins",
        "source", "placements", "delta_of", "delta_seeds", "buckets",
    )  # fmt: skip

    def __init__(self, name: str, num_shards: int, source: str | None = None) -> None:
        self.name = name
        self.num_shards = num_shards
        self.source = source  # the model this one is a converted layout of (:mod:`.conversions`)
        self.delta_of = delta_owner(name)  # the model whose deltas this one holds (:mod:`.deltas`)
        #: (version, datacenter) -> (the replica planned to pull the delta chain to it across, until
        #: when the datacenter counts as seeding it before that pull shows up): see .deltas
        self.delta_seeds: dict[tuple[int, str], tuple[str, float]] = {}
        #: (version, shard) -> (the bucket tier's URL that holds that shard of that version, as its
        #: writer declared; the shard's checksums at that version, when known): a source of last
        #: resort, also once no holder of the version is left (see .deltas)
        self.buckets: dict[tuple[int, int], tuple[str, tuple[int, ...] | None]] = {}
        self.layouts: dict[int, tuple[Layout, int]] = {}  # shard_idx -> (layout, sessions using it)
        #: shard_idx -> the placements registered with its layout (None: registered without)
        self.placements: dict[int, tuple[PlacedTensor, ...] | None] = {}
        self.versions: dict[int, _Version] = {}
        self.highest_published: int | None = None
        self.replicas: dict[str, _Replica] = {}
        self.declarations: dict[str, _Declaration] = {}
        self.epoch = 0
        self.listing: tuple[m.VersionEntry, ...] = ()
        self.available: list[int] = []  # sorted available versions
        self.listing_stale = False
        self.changed = False  # the listing changed since the epoch was last bumped
        self.availability_changed = False
        self.waits: list[tuple[_Txn, _ShardCall, int]] = []  # parked wait long-polls (txn, call, known_epoch)
        self.parked: dict[_Txn, None] = {}  # replicate calls waiting for their version to exist
        self.offload_holders: dict[int, _Holder] = {}
        self.dirty_shards: dict[tuple[int, int], None] = {}  # (version, shard) to re-check when settling
        self.retention_changed = False
        self.gc_needed = False  # a holder or replica went away: forget what is no longer needed
        self.waiting_readers: dict[_Holder, None] = {}  # partial holders parked without a source (grace)
        self.pins: dict[int, dict[_Txn, None]] = {}  # version -> the replicate/update calls pinning it
        #: (version, datacenter) -> (replica told to offload-seed it there, until when the
        #: datacenter counts as seeding before its seed replica's pull shows up)
        self.seeds: dict[tuple[int, str], tuple[str, float]] = {}

    def retain_back(self) -> int | None:
        backs = [d.back for d in self.declarations.values()]
        return max(backs) if backs else None

    def retained(self, version: int) -> bool:
        back = self.retain_back()
        return back is not None and self.highest_published is not None and version >= self.highest_published - back

    def kept(self, version: int) -> bool:
        """Retained, or pinned by a replicate/update in flight: an offload copy of it is not
        released (while no other non-spot holder has it whole)."""
        return version in self.pins or self.retained(version)

    def offloads(self, version: int) -> bool:
        """Whether the last non-spot copy of ``version`` is offloaded before it is unpublished:
        it is retained, or it is pinned and the model keeps CPU copies at all (some replica
        declared retention). A pin never makes a copy where retention would make none."""
        return self.retained(version) or (version in self.pins and bool(self.declarations))


class SourcePolicy(Protocol):
    """The grantable holders of one (version, shard), and the policy that picks a reader's source
    among them (DESIGN.md §5.1). The table calls :meth:`put` whenever a holder's load or
    completeness changes and :meth:`remove` when it stops being grantable."""

    def __len__(self) -> int: ...

    def __contains__(self, key: int) -> bool: ...

    def put(self, key: int, replica: str, location: Location, load: int, complete: bool) -> None: ...

    def remove(self, key: int) -> None: ...

    def in_datacenter(self, dc: str) -> tuple[bool, bool]:
        """(a complete or offload holder is in ``dc``, a partial holder is in ``dc``)."""

    def select(
        self, reader: Location, rng: random.Random, eligible: Callable[[int], bool], prefer_replica: str | None = None
    ) -> int | None:
        """The key of the source for a reader at ``reader``, or None."""


# --- the pace of a grant, as straggler detection (:mod:`.stragglers`) sees it ---------------

_SAMPLES = 64  # progress reports kept per grant (a window's worth at a report every half second)
#: Windows a grant may go without its first progress report before it counts as stalled (a
#: first report comes with the first verified read, which a source whose link is shared by
#: several readers takes several times longer to move: busy, not slow).
_FIRST_REPORT = 3
#: The same for the grant of a reader just moved off a straggler: its reads in flight from the
#: slow source land before the new grant's begin (they are kept), at the slow source's pace, which
#: no other source makes faster (a whole read at a few percent of a link: many seconds). Until
#: then it is not judged, so the readers pipelined behind it stay behind it too; the bound is for
#: a new source that is itself stalled.
_FIRST_REPORT_MOVED = 10


class _Pace:
    """A grant's progress as the table saw it: ``(arrival time, reader's verified)`` per
    report; ``drains``: its reader was moved off a straggler, so what it verified up to its
    first report under this grant came from the slow source (rates count from that report)."""

    __slots__ = ("drains", "samples")

    def __init__(self, drains: bool = False) -> None:
        self.samples: deque[tuple[float, int]] = deque(maxlen=_SAMPLES)
        self.drains = drains

    @property
    def first(self) -> int:
        """Windows the grant may go without a first report before it counts as stalled."""
        return _FIRST_REPORT_MOVED if self.drains else _FIRST_REPORT



# --- questions asked of the records, by more than one concern ----------------------------------


class _AnnouncedArgs:
    """Matches any args: a transaction re-created from an announcement knows its answer, not the
    exact spec the shards passed."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]  # unhashable, as equal to everything: typeshed wants a method


def _seed_name(replica: str) -> str | None:
    """The offload seed replica's name for ``replica``, or None where it would be too long."""
    return seed_replica(replica) if len(replica) + len(SEED_SUFFIX) <= MAX_NAME_LEN else None


def _offload_of(s: _Session, version: int) -> _Holder | None:
    """The session's live (not draining) offload copy of ``version``."""
    for h in s.offloads.values():
        if h.version == version and h.state is O:
            return h
    return None


def _all_done(txn: _Txn) -> bool:
    """Every shard of the replica holds the call's version completely (or was answered)."""
    for idx in range(txn.replica.num_shards):
        if idx in txn.consumed:
            continue
        call = txn.shards.get(idx)
        if call is None:
            return False
        h = call.session.holder
        if h is None or h.version != txn.version or h.state is not C:
            return False
    return True

def _named(spec: VersionSpec, newest: int | None, ctx: dict[str, Any]) -> int | None:
    """The version ``spec`` names when ``newest`` is the latest available (None: a relative spec
    with nothing available yet: wait).

    Raises:
        VersionUnavailable: a relative spec that reaches below version 0.
    """
    if not spec.relative:
        assert spec.version is not None
        return spec.version
    if newest is None:
        return None
    v = spec.resolve(newest)
    if v < 0:
        raise VersionUnavailable(f"{spec} is before version 0 (latest is {newest})", **ctx)
    return v
