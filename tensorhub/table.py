"""The reference table: everything the reference server decides, with no IO.

Theory of operation
-------------------
The table is the server's whole logic as a plain object. :meth:`ReferenceTable.handle` takes
one decoded client message and the opaque ``peer`` it came from, and returns the messages to
send as ``(peer, message)`` pairs; :meth:`ReferenceTable.tick` does the same for the passage of
time (heartbeat expiry, drain and call deadlines, the failover grace period). The clock and the
random source are injected, so the real server, the simulator and the property tests drive the
*same* code, and one seed gives one sequence of replies.

What it owns:

- **sessions**: one per open shard handle (model, replica, num_shards, shard_idx, location,
  spot, retention declaration, incarnation nonce). A new incarnation of a shard removes the old
  replica; an old incarnation's messages get ``Fenced``. A replica is removed *whole*: a shard
  that expires, is fenced, or crashes takes every holding of its replica with it.
- **layouts** per (model, shard_idx): the first registration fixes it while anyone uses it;
  any other gets ``LayoutMismatch``.
- **holders**: (model, version, shard, replica) in the lifecycle of :mod:`tensorhub.lifecycle`;
  every state change is a transition of that table.
- **grants**: reader holder <- source holder, counted on the source; every grant ends exactly
  once (completed, failed, revoked or cancelled).
- **transactions** per (replica, call number) for the model-parallel calls (publish, unpublish,
  replicate, update, wait, consistent list): the first shard decides, the others get the
  recorded answer; ``replicate``/``update`` answer only when every shard is done or all fail
  alike.
- **retention** declarations per (model, replica), counted from the highest version published,
  lasting until the replica's shards have all closed cleanly.

Invariants (checked by :func:`tensorhub.invariants.check_invariants`):

- no grant is made from an unpublishing, excluded, quarantined, removed or downstream holder,
  so the upstream graph never has a cycle;
- a holder's grant count is exactly its active grants, and nothing frees a holder that has one
  (unpublishing holders are removed only when drained, or after revoking what is left at
  ``drain_timeout``);
- a partial holder exists only while a reader is pulling it (with an active grant, or waiting
  for one), and is failed with ``VersionUnavailable`` once no complete or offload holder of its
  (version, shard) is left;
- when every client has closed, nothing is left: no sessions, holders, grants, transactions.

What it must never do: block, look at the wall clock, iterate a hash-ordered collection of
strings (that would make replies depend on ``PYTHONHASHSEED``), or change anything when it
answers with an error.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable

from scheduling.selection import SourceIndex
from scheduling.topology import LINK_CLASSES, Location, link_class

from . import messages as m
from .errors import (
    Cancelled,
    ChecksumMismatch,
    ContractViolation,
    Fenced,
    InvalidArgument,
    LayoutMismatch,
    NotRegistered,
    ProtocolError,
    ReplicaRemoved,
    StaleGrant,
    TensorHubError,
    Timeout,
    TransportError,
    UnknownGrant,
    UnknownSession,
    UpdateAborted,
    VersionConflict,
    VersionUnavailable,
    error_from_wire,
)
from .layout import Layout
from .lifecycle import Event, HolderState, transition
from .naming import MAX_NAME_LEN, SEED_SUFFIX, VersionSpec, parse_version_spec, seed_owner, seed_replica

__all__ = ["ReferenceTable", "TableConfig", "Outbox"]

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
    """

    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    drain_timeout: float = 30.0
    pipeline: bool = True
    smart_skipping: bool = True

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0 or self.drain_timeout <= 0:
            raise InvalidArgument("heartbeat_interval and drain_timeout must be > 0")
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
        "id", "session", "version", "shard_idx", "state", "kind", "grants", "upstream", "excluded", "failures",
        "verified", "checksums", "reporters", "readmitted", "blamed_bad", "verify_pending", "offload_pending", "drain_deadline",
        "on_drained", "on_offloaded", "call", "waiting", "whole",
    )  # fmt: skip

    def __init__(self, hid: int, session: "_Session", version: int, kind: str) -> None:
        self.id = hid
        self.session = session
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

    @property
    def replica(self) -> "_Replica":
        return self.session.replica

    @property
    def spot(self) -> bool:
        return self.session.spot


class _Session:
    __slots__ = (
        "id", "peer", "model", "replica", "shard_idx", "incarnation", "location", "spot", "retain",
        "last_seen", "layout", "endpoint", "holder", "offloads", "announced", "answered",
    )  # fmt: skip

    def __init__(self, sid: int, peer: Hashable, model: "_Model", replica: "_Replica", msg: m.OpenShard, now: float):
        self.id = sid
        self.peer = peer
        self.model = model
        self.replica = replica
        self.shard_idx = msg.shard_idx
        self.incarnation = msg.incarnation
        self.location: Location = msg.location
        self.spot = msg.spot
        self.retain = msg.retain
        self.last_seen = now
        self.layout: Layout | None = None
        self.endpoint: Any = None
        self.holder: _Holder | None = None  # the holding in the registered buffers
        self.offloads: dict[int, _Holder] = {}  # holder id -> offload holder (CPU copies, draining ones too)
        self.announced = False  # re-announced its state after a failover
        self.answered = 0  # the last call it had an answer for, as it announced

    def ctx(self, version: int | None = None) -> dict[str, Any]:
        return {"model": self.model.name, "replica": self.replica.name, "shard": self.shard_idx, "version": version}


class _ShardCall:
    __slots__ = ("session", "req", "done")

    def __init__(self, session: _Session, req: int) -> None:
        self.session = session
        self.req = req
        self.done = False


class _Txn:
    """One model-parallel call (replica, call number)."""

    __slots__ = (
        "n", "kind", "args", "replica", "decided", "version", "moved", "answer", "error", "deadline",
        "shards", "consumed", "source_replica", "offered", "waiting", "offload_seed", "skipped", "seed",
    )  # fmt: skip

    def __init__(self, n: int, kind: str, args: Any, replica: "_Replica") -> None:
        self.n = n
        self.kind = kind
        self.args = args
        self.replica = replica
        self.decided = False
        self.version: int | None = None
        self.moved = False  # replicate/update started replacing what the replica held
        self.answer: Any = None
        self.error: TensorHubError | None = None
        self.deadline: float | None = None
        self.shards: dict[int, _ShardCall] = {}
        self.consumed: dict[int, None] = {}
        self.source_replica: str | None = None
        self.offered: dict[int, tuple[m.VersionEntry, ...]] = {}
        self.waiting = False  # parked until the version it names exists
        self.offload_seed = False  # update: the replica seeds into a CPU copy rather than stall
        self.skipped: int | None = None  # update: the newer version it skipped (being seeded here)
        self.seed: int | None = None  # update: the version the replica is to offload-seed


class _Replica:
    __slots__ = ("name", "model", "num_shards", "spot", "shards", "txns", "serving", "announce_until")

    def __init__(self, name: str, model: "_Model", num_shards: int, spot: bool) -> None:
        self.name = name
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
        "version", "holders", "ever_available", "checksums", "serving", "shards_serving", "per_replica", "full", "index",
    )  # fmt: skip

    def __init__(self, version: int, num_shards: int) -> None:
        self.version = version
        self.holders: list[dict[int, _Holder]] = [{} for _ in range(num_shards)]
        self.ever_available = False
        self.checksums: dict[int, tuple[int, ...]] = {}  # shard_idx -> the declared checksums
        self.serving = [0] * num_shards  # complete/offload holders per shard
        self.shards_serving = 0  # shards with at least one
        self.per_replica: dict[str, list[int]] = {}  # replica -> [serving shards, of which offload]
        self.full: dict[str, None] = {}  # replicas serving every shard
        self.index = [SourceIndex() for _ in range(num_shards)]  # grantable holders per shard

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
        "offload_holders", "dirty_shards", "retention_changed", "waiting_readers", "gc_needed", "seeds",
    )  # fmt: skip

    def __init__(self, name: str, num_shards: int) -> None:
        self.name = name
        self.num_shards = num_shards
        self.layouts: dict[int, tuple[Layout, int]] = {}  # shard_idx -> (layout, sessions using it)
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
        #: (version, datacenter) -> (replica told to offload-seed it there, until when the
        #: datacenter counts as seeding before its seed replica's pull shows up)
        self.seeds: dict[tuple[int, str], tuple[str, float]] = {}

    def retain_back(self) -> int | None:
        backs = [d.back for d in self.declarations.values()]
        return max(backs) if backs else None

    def retained(self, version: int) -> bool:
        back = self.retain_back()
        return back is not None and self.highest_published is not None and version >= self.highest_published - back


# --- the table ----------------------------------------------------------------------------------


class ReferenceTable:
    """The reference server's state and decisions (sans-IO).

    Args:
        clock: returns the current time in seconds (monotonic); injected.
        rng: the one random source (tie-breaks); injected and seeded by the caller.
        config: timeouts.
        term: this server start's term; grants carry it, and a grant of another term is void.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        rng: random.Random,
        config: TableConfig | None = None,
        term: int = 1,
    ) -> None:
        self.clock = clock
        self.rng = rng
        self.config = config or TableConfig()
        self.term = term
        self.models: dict[str, _Model] = {}
        self.sessions: dict[int, _Session] = {}
        self.by_slot: dict[tuple[str, str, int], _Session] = {}
        self.fenced: OrderedDict[int, str] = OrderedDict()  # removed session id -> error code
        self.expiry: OrderedDict[int, _Session] = OrderedDict()  # sessions by last_seen
        self.grants: dict[int, _Grant] = {}
        self._by_id: dict[int, _Holder] = {}  # every holder in the table, by id
        self.revoked: OrderedDict[int, None] = OrderedDict()  # recently revoked grant ids
        self.grace_until = clock() + self.config.heartbeat_timeout
        #: (model, version) -> its ended grants, oldest first (see :meth:`replication_dag`)
        self.history: OrderedDict[tuple[str, int], list[dict[str, Any]]] = OrderedDict()
        self._ids = itertools.count(1)
        self._timers: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._out: Outbox = []
        self._dirty_models: dict[str, _Model] = {}
        self.stats = {
            "grants": 0, "grants_ended": 0, "revoked": 0, "expired": 0, "quarantined": 0, "offloads": 0,
            "updates_skipped": 0, "offload_seeds": 0,
        }  # fmt: skip
        #: bytes moved under ended grants, per link class (:data:`scheduling.topology.LINK_CLASSES`)
        self.bytes_by_link = dict.fromkeys(LINK_CLASSES, 0)
        self._handlers: dict[type, Callable[[Hashable, Any], None]] = {
            m.OpenShard: self._on_open,
            m.Register: self._on_register,
            m.Unregister: self._on_unregister,
            m.Publish: self._on_publish,
            m.DeclareChecksums: self._on_checksums,
            m.Unpublish: self._on_unpublish,
            m.PublishOffload: self._on_offloaded,
            m.Replicate: self._on_pull,
            m.Update: self._on_pull,
            m.ListVersions: self._on_list,
            m.Wait: self._on_wait,
            m.Progress: self._on_progress,
            m.Complete: self._on_complete,
            m.SourceFailed: self._on_source_failed,
            m.ChecksumFailed: self._on_checksum_failed,
            m.VerifyResult: self._on_verify_result,
            m.Heartbeat: self._on_heartbeat,
            m.Announce: self._on_announce,
            m.CloseShard: self._on_close,
            m.GetStatus: self._on_status,
            m.GetDag: self._on_dag,
        }

    # ---- entry points --------------------------------------------------------------------------

    def handle(self, peer: Hashable, msg: Any) -> Outbox:
        """Process one message from ``peer``; return the messages to send.

        A message the table cannot accept gets a :class:`~tensorhub.messages.Failed` reply
        with a typed error, and changes nothing.
        """
        handler = self._handlers.get(type(msg))
        try:
            if handler is None:
                raise ProtocolError(f"{type(msg).__name__} is not a request a server accepts")
            handler(peer, msg)
        except TensorHubError as err:
            self._out.append((peer, m.Failed.of(getattr(msg, "req", 0), err)))
        self._settle()
        return self._flush()

    def tick(self) -> Outbox:
        """Apply the passage of time up to ``clock()``; return the messages to send."""
        now = self.clock()
        while self.expiry:
            sid, s = next(iter(self.expiry.items()))
            if s.last_seen + self.config.heartbeat_timeout > now:
                break
            self.stats["expired"] += 1
            self._remove_replica(s.replica, ReplicaRemoved, f"shard {s.shard_idx} missed heartbeats")
        while self._timers and self._timers[0][0] <= now:
            _, _, what, obj = heapq.heappop(self._timers)
            if what == "drain":
                self._drain_expired(obj, now)
            elif what == "txn":
                self._txn_expired(obj, now)
            elif what == "announce":
                obj.announce_until = None  # its shards had their time: decide without the rest
                obj.model.availability_changed = True
                self._mark_dirty(obj.model)
        if self.grace_until is not None and now >= self.grace_until:
            self.grace_until = None
            for model in list(self.models.values()):  # what waited out the grace period may fail now
                for v, ver in model.versions.items():
                    for i in range(model.num_shards):
                        if not ver.serving[i] and ver.holders[i]:
                            model.dirty_shards[(v, i)] = None
                model.availability_changed = True
                self._mark_dirty(model)
                self._regrant_waiting(model)
        self._settle()
        return self._flush()

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (None: only on new messages)."""
        times = []
        if self.expiry:
            times.append(next(iter(self.expiry.values())).last_seen + self.config.heartbeat_timeout)
        if self._timers:
            times.append(self._timers[0][0])
        if self.grace_until is not None:
            times.append(self.grace_until)
        return min(times) if times else None

    @property
    def in_grace(self) -> bool:
        return self.grace_until is not None

    # ---- plumbing ----------------------------------------------------------------------------

    def _flush(self) -> Outbox:
        out, self._out = self._out, []
        return out

    def _send(self, session: _Session, msg: Any) -> None:
        self._out.append((session.peer, msg))

    def _reply_error(self, call: _ShardCall, err: TensorHubError) -> None:
        self._send(call.session, m.Failed.of(call.req, err))

    def _timer(self, when: float, what: str, obj: Any) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), what, obj))

    def _mark_dirty(self, model: _Model) -> None:
        self._dirty_models[model.name] = model

    def _retention_moved(self, model: _Model) -> None:
        model.retention_changed = True
        self._mark_dirty(model)

    def _session(self, peer: Hashable, sid: int) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            code = self.fenced.get(sid)
            if code == Fenced.code:
                raise Fenced(f"session {sid} was fenced by a newer incarnation")
            if code is not None:
                raise ReplicaRemoved(f"session {sid} was removed with its replica")
            raise UnknownSession(f"session {sid} is not known to this server (term {self.term}); open again")
        s.peer = peer
        self._touch(s)
        return s

    def _touch(self, s: _Session) -> None:
        s.last_seen = self.clock()
        self.expiry.move_to_end(s.id)

    def _holder_set(self, model: _Model, version: int, shard_idx: int) -> dict[int, _Holder]:
        ver = model.versions.get(version)
        if ver is None:
            ver = model.versions[version] = _Version(version, model.num_shards)
        return ver.holders[shard_idx]

    def _new_holder(self, s: _Session, version: int, kind: str, event: Event) -> _Holder:
        h = _Holder(next(self._ids), s, version, kind)
        state = transition(None, event, **s.ctx(version))
        self._holder_set(s.model, version, s.shard_idx)[h.id] = h
        self._by_id[h.id] = h
        if kind == m.KIND_OFFLOAD:
            s.model.offload_holders[h.id] = h
        self._account(h, state)
        return h

    def _fire(self, h: _Holder, event: Event) -> None:
        """Apply a lifecycle event; removal drops the holder from every index."""
        state = transition(h.state, event, **h.session.ctx(h.version))
        self._account(h, state)
        if state is None:
            model = h.session.model
            model.versions[h.version].holders[h.shard_idx].pop(h.id, None)
            model.offload_holders.pop(h.id, None)
            del self._by_id[h.id]
            model.gc_needed = True
            self._mark_dirty(model)
            s = h.session
            if s.holder is h:
                s.holder = None
            s.offloads.pop(h.id, None)
            h.call = None
            h.waiting = False
            model.waiting_readers.pop(h, None)

    def _account(self, h: _Holder, state: HolderState | None) -> None:
        """Set ``h.state`` and keep the version's counts (availability, listing) in step."""
        old, h.state = h.state, state
        was, now = old in SERVING, state in SERVING
        if now:
            h.whole = True
        model = h.session.model
        index = model.versions[h.version].index[h.shard_idx]
        if state is None or state is U:
            index.remove(h.id)
        else:
            index.put(h.id, h.replica.name, h.session.location, self._load(h.replica), state is not P)
        if state is C or was != now:
            model.dirty_shards[(h.version, h.shard_idx)] = None
            self._mark_dirty(model)
        if was == now:
            return
        ver = model.versions[h.version]
        d = 1 if now else -1
        i = h.shard_idx
        ver.serving[i] += d
        if ver.serving[i] == (1 if now else 0):
            before = ver.available
            ver.shards_serving += d
            if ver.available != before:
                model.availability_changed = model.changed = model.listing_stale = True
                if now:
                    ver.ever_available = True
                    bisect.insort(model.available, h.version)
                else:
                    model.available.remove(h.version)
        name = h.replica.name
        row = ver.per_replica.get(name)
        if row is None:
            row = ver.per_replica[name] = [0, 0]
        row[0] += d
        if h.kind == m.KIND_OFFLOAD:
            row[1] += d
        full = row[0] == model.num_shards
        if full or name in ver.full:
            model.changed = model.listing_stale = True
            if full:
                ver.full[name] = None
            else:
                del ver.full[name]
        if not row[0]:
            del ver.per_replica[name]

    # ---- open, register, close -----------------------------------------------------------------

    def _on_open(self, peer: Hashable, msg: m.OpenShard) -> None:
        model = self.models.get(msg.model)
        if model is not None and model.num_shards != msg.num_shards:
            raise LayoutMismatch(
                f"model has num_shards={model.num_shards}; this shard declares {msg.num_shards}",
                model=msg.model,
                replica=msg.replica,
                shard=msg.shard_idx,
            )
        slot = (msg.model, msg.replica, msg.shard_idx)
        old = self.by_slot.get(slot)
        if old is not None and old.incarnation == msg.incarnation:
            old.peer = peer  # the same incarnation opening again (a retried open): same session
            self._touch(old)
            self._send(old, self._opened(msg.req, old))
            return
        replica = model.replicas.get(msg.replica) if model is not None else None
        if replica is not None and replica.spot != msg.spot:
            raise ContractViolation(
                f"replica is {'spot' if replica.spot else 'not spot'}; shard declares spot={msg.spot}",
                model=msg.model,
                replica=msg.replica,
                shard=msg.shard_idx,
            )
        if old is not None:
            self._remove_replica(old.replica, Fenced, f"shard {msg.shard_idx} opened as a new incarnation")
            replica = None
            model = self.models.get(msg.model)  # it may have been dropped with the old replica
        if model is None:
            model = self.models[msg.model] = _Model(msg.model, msg.num_shards)
        if replica is None:
            replica = model.replicas.get(msg.replica)
            if replica is None:
                replica = model.replicas[msg.replica] = _Replica(msg.replica, model, msg.num_shards, msg.spot)
        s = _Session(next(self._ids), peer, model, replica, msg, self.clock())
        self.sessions[s.id] = s
        self.by_slot[slot] = s
        self.expiry[s.id] = s
        replica.shards[s.shard_idx] = s
        if msg.retain is not None:
            decl = model.declarations.get(msg.replica)
            if decl is None:
                decl = model.declarations[msg.replica] = _Declaration(msg.retain)
            decl.back = msg.retain
            decl.open_shards[s.shard_idx] = None
            self._retention_moved(model)
        self._send(s, self._opened(msg.req, s))

    def _opened(self, req: int, s: _Session) -> m.Opened:
        cfg = self.config
        return m.Opened(req, s.id, self.term, cfg.heartbeat_interval, cfg.heartbeat_timeout)

    def _on_register(self, peer: Hashable, msg: m.Register) -> None:
        s = self._session(peer, msg.session)
        if s.layout is not None:
            raise ContractViolation("already registered: unregister first", **s.ctx())
        model = s.model
        known = model.layouts.get(s.shard_idx)
        if known is not None and known[0] != msg.layout:
            raise LayoutMismatch(_layout_diff(known[0], msg.layout), **s.ctx())
        model.layouts[s.shard_idx] = (msg.layout, (known[1] if known else 0) + 1)
        s.layout = msg.layout
        s.endpoint = msg.endpoint
        self._ack(s, msg.req)

    def _on_unregister(self, peer: Hashable, msg: m.Unregister) -> None:
        s = self._session(peer, msg.session)
        if s.layout is None:
            raise NotRegistered("nothing is registered", **s.ctx())
        if s.holder is not None:
            raise ContractViolation(
                f"unregister refused while version {s.holder.version} is published: unpublish first",
                **s.ctx(s.holder.version),
            )
        if s.offloads:  # the layout describes them too: it stays pinned until they are freed
            versions = sorted({h.version for h in s.offloads.values()})
            raise ContractViolation(f"unregister refused while offload copies of versions {versions} are held", **s.ctx())
        self._drop_layout(s)
        self._ack(s, msg.req)

    def _drop_layout(self, s: _Session) -> None:
        if s.layout is None:
            return
        model = s.model
        layout, users = model.layouts[s.shard_idx]
        if users <= 1:
            del model.layouts[s.shard_idx]
        else:
            model.layouts[s.shard_idx] = (layout, users - 1)
        s.layout = None

    def _ack(self, s: _Session, req: int) -> None:
        self._send(s, m.Ack(req))

    def _on_close(self, peer: Hashable, msg: m.CloseShard) -> None:
        s = self._session(peer, msg.session)
        replica, model = s.replica, s.model
        decl = model.declarations.get(replica.name)
        if decl is not None:
            decl.open_shards.pop(s.shard_idx, None)
            if not decl.open_shards:
                del model.declarations[replica.name]
                self._retention_moved(model)
        for txn in list(replica.txns.values()):
            if s.shard_idx not in txn.consumed:
                self._fail_txn(txn, ContractViolation(f"shard {s.shard_idx} closed before finishing call {txn.n}", **s.ctx()))
        self._end_session(s)
        self._send(s, m.Ack(msg.req))

    def _end_session(self, s: _Session, fenced_code: str | None = None) -> None:
        """Drop a session and every holding it has (readers of them are revoked)."""
        for _ in range(1000):  # removing one holding can run callbacks; repeat until none is left
            h = s.holder or next(iter(s.offloads.values()), None)
            if h is None:
                break
            self._remove_holder(h, Event.REMOVED, "its replica is gone")
        self._drop_layout(s)
        del self.sessions[s.id]
        self.expiry.pop(s.id, None)
        slot = (s.model.name, s.replica.name, s.shard_idx)
        if self.by_slot.get(slot) is s:
            del self.by_slot[slot]
        replica = s.replica
        if replica.shards.get(s.shard_idx) is s:
            del replica.shards[s.shard_idx]
        if fenced_code is not None:
            self.fenced[s.id] = fenced_code
            if len(self.fenced) > _FENCED_MEMORY:
                self.fenced.popitem(last=False)
        if not replica.shards:
            for txn in list(replica.txns.values()):
                self._drop_txn(txn)
            del replica.model.replicas[replica.name]
        self._gc_model(s.model)

    def _remove_replica(self, replica: _Replica, error: type[TensorHubError], reason: str) -> None:
        """Remove a replica whole (crash, expiry, fencing): its shards' holdings, partial
        holdings, grants and transactions. Live shards are told."""
        ctx = {"model": replica.model.name, "replica": replica.name}
        err = error(f"replica removed: {reason}", **ctx)
        for txn in list(replica.txns.values()):
            txn.error = txn.error or err
            for call in txn.shards.values():
                if not call.done and call.session.id in self.sessions:
                    self._reply_error(call, err)
                    call.done = True
            self._drop_txn(txn)
        replica.model.waits = [w for w in replica.model.waits if w[0].replica is not replica]
        for s in list(replica.shards.values()):
            self._send(s, m.Removed(s.id, error.code, err.message))
            self._end_session(s, fenced_code=error.code)

    # ---- holders: removal, drain, revocation ---------------------------------------------------

    def _remove_holder(self, h: _Holder, event: Event, reason: str) -> None:
        """Remove ``h`` now (crash, fencing, quarantine, close): end its upstream grant and
        revoke its readers, who get re-granted elsewhere."""
        if h.state is None:
            return  # already gone (a cascade of this same removal got to it first)
        if h.upstream is not None:
            self._end_grant(h.upstream, "cancelled")
        readers = [g.reader for g in h.grants.values()]
        for g in list(h.grants.values()):
            self._revoke(g, reason)
        if h.state is not None:  # an unpublishing holder is gone once its last grant is revoked
            self._fire(h, event)
            h.offload_pending = False
            h.on_offloaded = None
            callbacks, h.on_drained = h.on_drained, []
            for cb in callbacks:  # whatever waited for this holding to go away goes on
                cb()
        for r in readers:
            self._regrant(r)

    def _revoke(self, g: _Grant, reason: str) -> None:
        self.stats["revoked"] += 1
        self.revoked[g.id] = None
        if len(self.revoked) > _FENCED_MEMORY:
            self.revoked.popitem(last=False)
        reader = g.reader
        self._end_grant(g, "revoked")
        self._send(reader.session, m.Revoke(reader.session.id, g.id, self.term, reason))

    def _end_grant(self, g: _Grant, how: str, reached: int | None = None) -> None:
        """End a grant (``how``: completed, failed, revoked, cancelled); ``reached``: what the
        reader had verified at its end, if the reader said so (for the replication history)."""
        if g.ended is not None:
            raise AssertionError(f"grant {g.id} ended twice ({g.ended}, {how})")
        g.ended = how
        self._record(g, how, reached)
        self.stats["grants_ended"] += 1
        del self.grants[g.id]
        src = g.source
        del src.grants[g.id]
        if g.reader.upstream is g:
            g.reader.upstream = None
        serving = src.replica.serving
        key = g.reader.replica.name
        serving[key] -= 1
        if not serving[key]:
            del serving[key]
            self._reindex(src.replica)
        if src.state is U and not src.grants:
            self._drained(src)

    def _record(self, g: _Grant, how: str, reached: int | None) -> None:
        """Add an ended grant to its version's replication history (bounded: the latest
        ``HISTORY_VERSIONS`` versions, ``HISTORY_EDGES`` grants each)."""
        r, src = g.reader, g.source
        model = r.session.model
        key = (model.name, r.version)
        edges = self.history.get(key)
        if edges is None:
            edges = self.history[key] = []
            while len(self.history) > HISTORY_VERSIONS:
                self.history.popitem(last=False)
        layout = r.session.layout
        total = layout.total_bytes if layout is not None else 0
        end = total if how == "completed" else (reached if reached is not None else r.verified)
        nbytes = max(0, end - g.start)
        self.bytes_by_link[link_class(r.session.location, src.session.location)] += nbytes
        if len(edges) >= HISTORY_EDGES:
            return
        edges.append({
            "reader": r.replica.name, "reader_shard": r.shard_idx, "reader_dc": r.session.location.datacenter,
            "reader_host": r.session.location.host, "source": src.replica.name, "source_shard": src.shard_idx,
            "source_kind": src.kind, "source_complete": src.state is not P, "source_dc": src.session.location.datacenter,
            "source_host": src.session.location.host, "bytes": nbytes, "start": g.created,
            "end": self.clock(), "outcome": how,
        })  # fmt: skip

    def replication_dag(self, model: str, version: int) -> dict[str, Any]:
        """Who served whom for ``version`` of ``model``: every ended grant (reader, source,
        their locations, bytes moved under it, start, end, outcome), oldest first. See
        :mod:`scheduling.dag` to summarise, export and draw it."""
        return {"model": model, "version": version, "edges": [dict(e) for e in self.history.get((model, version), [])]}

    def _drained(self, h: _Holder) -> None:
        callbacks, h.on_drained = h.on_drained, []
        owner = h.session
        was_offload = h.kind == m.KIND_OFFLOAD
        self._fire(h, Event.DRAINED)
        if was_offload and owner.id in self.sessions:
            self._send(owner, m.FreeOffload(owner.id, h.version))
        for cb in callbacks:
            cb()

    def _begin_drain(self, h: _Holder) -> None:
        if not h.grants:
            self._drained(h)
            return
        h.drain_deadline = self.clock() + self.config.drain_timeout
        self._timer(h.drain_deadline, "drain", h)

    def _drain_expired(self, h: _Holder, now: float) -> None:
        if h.state is not U or h.drain_deadline is None or h.drain_deadline > now:
            return
        readers = [g.reader for g in h.grants.values()]
        for g in list(h.grants.values()):
            self._revoke(g, "drain timeout: the holder is unpublishing")
        for r in readers:
            self._regrant(r)

    def _unpublish(self, h: _Holder, then: Callable[[], None]) -> None:
        """Unpublish a holder of the registered buffers: offload first if it is the last
        non-spot copy of a retained version; then no new grants, drain, and call ``then``."""
        if h.state is U:
            h.on_drained.append(then)
            return
        if h.state is P:
            self._abort_partial(h)
            if h.state is U:
                h.on_drained.append(then)
            else:
                then()
            return
        if h.offload_pending:
            h.on_drained.append(then)
            return
        if self._last_retained(h):
            self._fire(h, Event.UNPUBLISH_LAST_RETAINED)
            h.offload_pending = True
            h.on_drained.append(then)
            h.on_offloaded = lambda: self._unpublish_now(h)
            self.stats["offloads"] += 1
            self._send(h.session, m.OffloadRequest(h.session.id, h.version))
            return
        self._unpublish_now(h, then)

    def _unpublish_now(self, h: _Holder, then: Callable[[], None] | None = None) -> None:
        if then is not None:
            h.on_drained.append(then)
        self._fire(h, Event.UNPUBLISH)
        self._begin_drain(h)

    def _last_retained(self, h: _Holder) -> bool:
        if h.spot or h.kind != m.KIND_NORMAL or not h.session.model.retained(h.version):
            return False
        holders = self._holder_set(h.session.model, h.version, h.shard_idx)
        return not any(o is not h and o.state in SERVING and not o.spot for o in holders.values())

    def _abort_partial(self, h: _Holder) -> None:
        """Abort a partial holding: its own pull stops and readers of it are told at once (it
        will never progress, so they could not finish from it)."""
        if h.upstream is not None:
            self._end_grant(h.upstream, "cancelled")
        h.waiting = False
        h.session.model.waiting_readers.pop(h, None)
        call, h.call = h.call, None
        self._fire(h, Event.ABORT)
        readers = [g.reader for g in h.grants.values()]
        for g in list(h.grants.values()):
            self._revoke(g, "the partial holder it pulled from was aborted")
        if h.state is U and not h.grants:
            self._drained(h)
        for r in readers:
            self._regrant(r)
        if call is not None:  # the replica's call cannot finish without this shard
            txn, idx = call
            self._fail_txn(txn, Cancelled(f"shard {idx} abandoned call {txn.n}", **h.session.ctx(h.version)))

    # ---- publish, checksums, unpublish, offload ------------------------------------------------

    def _on_publish(self, peer: Hashable, msg: m.Publish) -> None:
        s = self._session(peer, msg.session)
        txn, call = self._join(s, msg.req, msg.call, "publish", msg.version)
        ctx = s.ctx(msg.version)
        try:
            if s.layout is None:
                raise NotRegistered("publish needs registered tensors: register first", **ctx)
            h = s.holder
            if h is not None and not (h.version == msg.version and h.state is C):
                raise ContractViolation(
                    f"publish({msg.version}) while holding version {h.version} ({h.state.value}): unpublish first", **ctx
                )
            if msg.checksums is not None:
                self._check_checksums(s, msg.version, msg.checksums)
        except TensorHubError as err:
            self._finish_call(txn, call, m.Failed.of(msg.req, err))
            return
        if h is None:
            h = self._new_holder(s, msg.version, m.KIND_NORMAL, Event.PUBLISH)
            s.holder = h
            self._published(s.model, msg.version)
        if msg.checksums is not None:
            self._set_checksums(h, msg.checksums)
        self._finish_call(txn, call, m.Ack(msg.req))

    def _published(self, model: _Model, version: int) -> None:
        if model.highest_published is None or version > model.highest_published:
            model.highest_published = version
            self._retention_moved(model)  # offload copies may no longer be needed

    def _check_checksums(self, s: _Session, version: int, checksums: tuple[int, ...]) -> None:
        ctx = s.ctx(version)
        assert s.layout is not None
        want = s.layout.checksum_count()
        if len(checksums) != want:
            raise InvalidArgument(f"{len(checksums)} checksums declared; the layout has {want} checksum units", **ctx)
        ver = s.model.versions.get(version)
        known = ver.checksums.get(s.shard_idx) if ver is not None else None
        if known is not None and known != checksums:
            raise VersionConflict("another holder of this version and shard declared different checksums", **ctx)

    def _set_checksums(self, h: _Holder, checksums: tuple[int, ...]) -> None:
        h.checksums = checksums
        ver = h.session.model.versions[h.version]
        if h.shard_idx in ver.checksums:
            return
        ver.checksums[h.shard_idx] = checksums
        for other in ver.holders[h.shard_idx].values():  # readers pulling without them get them now
            if other.state is P and other.checksums is None:
                other.checksums = checksums
                g = other.upstream
                if g is not None:
                    self._send(
                        other.session, m.ChecksumsReady(other.session.id, g.id, self.term, other.version, checksums)
                    )

    def _on_checksums(self, peer: Hashable, msg: m.DeclareChecksums) -> None:
        s = self._session(peer, msg.session)
        h = s.holder if s.holder is not None and s.holder.version == msg.version else _offload_of(s, msg.version)
        if h is None or h.state is P:
            raise ContractViolation("checksums declared for a version this shard has not published", **s.ctx(msg.version))
        if h.checksums is not None and h.checksums != msg.checksums:
            raise ContractViolation("checksums already declared with other values", **s.ctx(msg.version))
        try:
            self._check_checksums(s, msg.version, msg.checksums)
        except VersionConflict:
            # The holding is not the version others hold under that number: it must not serve.
            self._remove_holder(h, Event.QUARANTINE, "the holder's checksums conflict with the version's")
            self._send(s, m.Quarantined(s.id, msg.version))
            self._fail_pulls(s, msg.version, VersionConflict("this shard's copy conflicts with the version", **s.ctx(msg.version)))
            raise
        self._set_checksums(h, msg.checksums)
        self._ack(s, msg.req)

    def _on_unpublish(self, peer: Hashable, msg: m.Unpublish) -> None:
        s = self._session(peer, msg.session)
        txn, call = self._join(s, msg.req, msg.call, "unpublish", None)
        h = s.holder
        if h is None:
            self._finish_call(txn, call, m.Ack(msg.req))
            return
        self._unpublish(h, lambda: self._finish_call(txn, call, m.Ack(msg.req)))

    def _on_offloaded(self, peer: Hashable, msg: m.PublishOffload) -> None:
        s = self._session(peer, msg.session)
        h = s.holder
        if h is None or h.version != msg.version or not h.offload_pending:
            raise ContractViolation("no offload was requested for this version", **s.ctx(msg.version))
        if msg.ok:
            if _offload_of(s, msg.version) is not None:
                raise ContractViolation("this shard already holds an offload copy of the version", **s.ctx(msg.version))
            o = self._new_holder(s, msg.version, m.KIND_OFFLOAD, Event.PUBLISH_OFFLOAD)
            o.checksums = h.checksums
            s.offloads[o.id] = o
        h.offload_pending = False
        then, h.on_offloaded = h.on_offloaded, None
        self._ack(s, msg.req)
        if then is not None:
            then()

    # ---- transactions ------------------------------------------------------------------------

    def _join(self, s: _Session, req: int, n: int, kind: str, args: Any) -> tuple[_Txn, _ShardCall]:
        """Join call ``n`` of the session's replica (opening it if first).

        Raises:
            ContractViolation: the call diverges from the one recorded for ``n``, or this shard
                already made it (nothing changes).
        """
        ctx = s.ctx()
        if n < 1:
            raise InvalidArgument(f"call numbers start at 1, got {n}", **ctx)
        replica = s.replica
        txn = replica.txns.get(n)
        if txn is None:
            txn = replica.txns[n] = _Txn(n, kind, args, replica)
        elif txn.kind != kind or txn.args != args:
            raise ContractViolation(
                f"call {n} is {_describe(txn.kind, txn.args)} on another shard; this shard calls {_describe(kind, args)}",
                **ctx,
            )
        if s.shard_idx in txn.consumed:
            raise ContractViolation(f"call {n} was already answered for this shard", **ctx)
        prev = txn.shards.get(s.shard_idx)
        if prev is not None and not prev.done and kind != "wait":
            raise ContractViolation(f"call {n} is already in flight for this shard", **ctx)
        call = txn.shards[s.shard_idx] = _ShardCall(s, req)
        return txn, call

    def _finish_call(self, txn: _Txn, call: _ShardCall, reply: Any) -> None:
        """Send a shard its final answer for ``txn``; drop the txn once every shard has one."""
        if call.done:
            return
        call.done = True
        self._send(call.session, reply)
        txn.consumed[call.session.shard_idx] = None
        if len(txn.consumed) >= txn.replica.num_shards:
            self._drop_txn(txn)

    def _drop_txn(self, txn: _Txn) -> None:
        if txn.replica.txns.get(txn.n) is txn:
            del txn.replica.txns[txn.n]
        for call in txn.shards.values():
            h = call.session.holder
            if h is not None and h.call is not None and h.call[0] is txn:
                h.call = None

    def _fail_txn(self, txn: _Txn, err: TensorHubError) -> None:
        """Every shard of the call gets the same error. A replicate/update that had started
        moving leaves each shard empty: partial or new holdings are aborted first."""
        if txn.error is not None:
            return
        if txn.kind == "update" and txn.moved and not isinstance(err, UpdateAborted):
            err = UpdateAborted(f"update to version {txn.version} aborted: {err.message}", **err.context())
        txn.error = err
        txn.decided = True
        if txn.kind == "wait":
            model = txn.replica.model
            model.waits = [w for w in model.waits if w[0] is not txn]
        for call in list(txn.shards.values()):
            self._error_shard(txn, call)

    def _error_shard(self, txn: _Txn, call: _ShardCall) -> None:
        assert txn.error is not None
        if call.done:
            return
        reply = m.Failed.of(call.req, txn.error)
        h = call.session.holder
        if not txn.moved or h is None or txn.kind not in ("replicate", "update"):
            self._finish_call(txn, call, reply)
        else:  # the shard ends empty, and nobody reads its buffers when the call returns
            self._unpublish(h, lambda: self._finish_call(txn, call, reply))

    def _txn_expired(self, txn: _Txn, now: float) -> None:
        if txn.replica.txns.get(txn.n) is not txn or txn.deadline is None or txn.deadline > now:
            return
        if txn.error is not None:
            return
        if txn.kind == "wait":
            if txn.decided:
                return
        elif txn.kind in ("replicate", "update"):
            if (txn.decided and not txn.moved) or _all_done(txn):
                return
        else:
            return
        what = f"version {txn.version}" if txn.version is not None else _describe(txn.kind, txn.args)
        ctx = {"model": txn.replica.model.name, "replica": txn.replica.name}
        self._fail_txn(txn, Timeout(f"timed out waiting for {what}", **ctx))

    def _set_deadline(self, txn: _Txn, timeout: float | None) -> None:
        if timeout is not None and txn.deadline is None:
            txn.deadline = self.clock() + timeout
            self._timer(txn.deadline, "txn", txn)

    # ---- version resolution ------------------------------------------------------------------

    def _listing(self, model: _Model) -> tuple[m.VersionEntry, ...]:
        """The available versions and the replicas holding each completely (built lazily)."""
        if model.listing_stale:
            entries = []
            for v in model.available:
                ver = model.versions[v]
                reps = []
                for name in sorted(ver.full):
                    replica = model.replicas.get(name)
                    kind = m.KIND_OFFLOAD if ver.per_replica[name][1] else m.KIND_NORMAL
                    reps.append(m.ReplicaEntry(name, kind, replica.spot if replica is not None else False))
                entries.append(m.VersionEntry(v, tuple(reps)))
            model.listing = tuple(entries)
            model.listing_stale = False
        return model.listing

    def _resolve(self, model: _Model, spec: VersionSpec, ctx: dict) -> int | None:
        """The absolute version ``spec`` names now, or None to wait for it.

        Raises:
            VersionUnavailable: it existed and is gone, or it can never exist.
        """
        available = model.available
        if spec.relative:
            if not available:
                return None
            v = spec.resolve(available[-1])
            if v < 0:
                raise VersionUnavailable(f"{spec} is before version 0 (latest is {available[-1]})", **ctx)
        else:
            v = spec.version
        assert v is not None
        ver = model.versions.get(v)
        if ver is not None and ver.available:
            return v
        if ver is not None and ver.ever_available and not self.in_grace:
            raise VersionUnavailable(f"version {v} is gone: no live holder has every shard", **{**ctx, "version": v})
        return None

    # ---- replicate and update ------------------------------------------------------------------

    def _on_pull(self, peer: Hashable, msg: m.Replicate | m.Update) -> None:
        """``replicate`` and ``update``: one transaction per call number, then each shard pulls."""
        s = self._session(peer, msg.session)
        spec = parse_version_spec(msg.spec)
        kind = "replicate" if type(msg) is m.Replicate else "update"
        txn, call = self._join(s, msg.req, msg.call, kind, spec.wire())
        if kind == "update" and not txn.decided:
            txn.offload_seed = msg.offload_seed
        self._set_deadline(txn, msg.timeout)
        self._advance(txn, call)

    def _decide(self, txn: _Txn, s: _Session) -> None:
        """First shard to reach an undecided replicate/update decides for the replica."""
        model = s.model
        spec = parse_version_spec(txn.args)
        ctx = s.ctx()
        if txn.kind == "replicate":
            v = self._resolve(model, spec, ctx)
            if v is None:
                txn.waiting = True
                model.parked[txn] = None
                return
            txn.version, txn.moved = v, True
        else:  # update never waits: no available version, or the one held, means "did not move"
            try:
                v = self._resolve(model, spec, ctx)
            except VersionUnavailable:
                v = None
            held = s.holder.version if s.holder is not None and s.holder.state is C else None
            if v is None:
                moves = False
            elif spec.relative and spec.back == 0:  # "latest": only a newer version
                moves = held is None or v > held
            else:
                moves = v != held
            if moves and v is not None:
                moves = self._seeding_allows(txn, s, v)
            txn.version, txn.moved = (v if moves else held), moves
        txn.waiting = False
        txn.decided = True

    def _seeding_allows(self, txn: _Txn, s: _Session, v: int) -> bool:
        """Cross-datacenter policy for an ``update`` that would move to ``v`` (DESIGN §5.6).

        Where every shard of ``v`` has a whole holder in the reader's datacenter, or the table
        does not skip (no pipelining, or skipping off), it moves. Where a replica of the
        datacenter is seeding ``v`` (some shard has only partial holders there, or a replica
        was told to offload-seed it and its pull has not shown up yet), it does not (smart
        skipping: ``txn.skipped``). Where nobody there has any shard of ``v``, this replica is
        the seeder: it moves (pulls across), or with offload seeding it is told to seed into a
        CPU copy in the background (``txn.seed``) and does not move. When the replica's own seed
        holds ``v``, its shards are pulled from it.
        """
        model = s.model
        dc = s.location.datacenter
        ver = model.versions[v]
        seed = _seed_name(txn.replica.name)
        if seed is not None and seed in ver.full:
            txn.source_replica = seed  # the replica's own CPU copy, next to it
        if not (self.config.pipeline and self.config.smart_skipping):
            return True
        absent = False
        for index in ver.index:
            whole, partial = index.in_datacenter(dc)
            if whole:
                continue
            if partial:
                return self._skip(txn, v)
            absent = True
        if not absent:
            model.seeds.pop((v, dc), None)
            return True
        reserved = model.seeds.get((v, dc))
        if reserved is not None:
            owner, until = reserved
            if until > self.clock() and owner in model.replicas:
                return self._skip(txn, v)
            del model.seeds[(v, dc)]
        if not txn.offload_seed or seed is None or seed_owner(txn.replica.name) is not None:
            return True  # this replica seeds the datacenter itself, pulling across
        model.seeds[(v, dc)] = (txn.replica.name, self.clock() + self.config.heartbeat_timeout)
        for key in [k for k in model.seeds if k[0] < v and k[1] == dc]:
            del model.seeds[key]  # older versions' seeds are of no more interest
        txn.seed = v
        self.stats["offload_seeds"] += 1
        return False

    def _skip(self, txn: _Txn, v: int) -> bool:
        txn.skipped = v
        self.stats["updates_skipped"] += 1
        return False

    def _advance(self, txn: _Txn, call: _ShardCall) -> None:
        """Move one shard's replicate/update call forward as far as it can go now."""
        if call.done or txn.replica.txns.get(txn.n) is not txn or call.session.id not in self.sessions:
            return  # answered, or dropped with its replica, while this step waited
        if txn.error is not None:
            self._error_shard(txn, call)
            return
        s = call.session
        if not txn.decided and self._awaiting_announcements(txn.replica):
            txn.waiting = True
            s.model.parked[txn] = None
            return
        if not txn.decided:
            try:
                self._decide(txn, s)
            except TensorHubError as err:
                self._fail_txn(txn, err)
                return
            if not txn.decided:
                return  # parked: re-run when versions change
        if txn.kind == "update" and not txn.moved:
            self._finish_call(txn, call, m.Updated(call.req, False, txn.version, txn.skipped, txn.seed))
            return
        v = txn.version
        assert v is not None
        if s.layout is None:
            self._fail_txn(txn, NotRegistered("replicate needs registered tensors: register first", **s.ctx(v)))
            return
        h = s.holder
        if h is not None and h.version == v and h.state is C:
            self._maybe_answer(txn)
            return
        if h is not None and h.version == v and h.state is P:
            h.call = (txn, s.shard_idx)
            if h.upstream is None:
                self._regrant(h)
            return
        if h is not None:
            self._unpublish(h, lambda: self._advance(txn, call))
            return
        h = s.holder = self._new_holder(s, v, m.KIND_NORMAL, Event.GRANT)
        h.call = (txn, s.shard_idx)
        ver = s.model.versions[v]
        h.checksums = ver.checksums.get(s.shard_idx)
        self._regrant(h)

    def _awaiting_announcements(self, replica: _Replica) -> bool:
        """After a failover, a replica that existed before decides nothing until all its shards
        have re-announced (their last answers may fix this decision), or the grace period ends:
        the server's own (it started recently) or the replica's (its first shard announced less
        than a heartbeat timeout ago: a backup that was up long before the failover)."""
        if not self.in_grace and replica.announce_until is None:
            return False
        shards = replica.shards.values()
        return any(s.announced for s in shards) and not (
            len(replica.shards) == replica.num_shards and all(s.announced for s in shards)
        )

    def _maybe_answer(self, txn: _Txn) -> None:
        if txn.error is not None or not _all_done(txn):
            return
        for call in list(txn.shards.values()):
            reply = m.Replicated(call.req, txn.version) if txn.kind == "replicate" else m.Updated(call.req, True, txn.version)
            self._finish_call(txn, call, reply)

    # ---- grants ------------------------------------------------------------------------------

    def _downstream(self, h: _Holder) -> dict[int, None]:
        seen: dict[int, None] = {h.id: None}
        stack = [h]
        while stack:
            x = stack.pop()
            for g in x.grants.values():
                if g.reader.id not in seen:
                    seen[g.reader.id] = None
                    stack.append(g.reader)
        return seen

    def _select(self, reader: _Holder, prefer: str | None, retry_failed: bool) -> _Holder | None:
        """The source for ``reader`` by the policy of :mod:`scheduling.selection`. Eligible:
        not unpublishing, not downstream of the reader, not of its replica, not excluded (a
        source that failed it is eligible again only on ``retry_failed``; one that failed
        verification never)."""
        model = reader.session.model
        index = model.versions[reader.version].index[reader.shard_idx]
        below = self._downstream(reader) if reader.grants else {reader.id: None}
        own = reader.replica
        excluded = reader.excluded
        by_id = self._by_id
        pipeline = self.config.pipeline

        def eligible(key: int) -> bool:
            if key in below or (key in excluded and (excluded[key] or not retry_failed)):
                return False
            h = by_id[key]
            return h.replica is not own and h.state is not U and (pipeline or h.state is not P)

        key = index.select(reader.session.location, self.rng, eligible, prefer)
        return by_id[key] if key is not None else None

    def _regrant(self, reader: _Holder) -> None:
        """Give a partial holder (whose call is in flight) a source, or fail / park its call."""
        if reader.state is not P or reader.upstream is not None or reader.call is None:
            return
        txn, _ = reader.call
        pick = self._select(reader, txn.source_replica, retry_failed=False)
        if pick is None and reader.excluded and reader.failures <= _MAX_SOURCE_FAILURES:
            pick = self._select(reader, txn.source_replica, retry_failed=True)
        if pick is None:
            ctx = reader.session.ctx(reader.version)
            holders = self._holder_set(reader.session.model, reader.version, reader.shard_idx)
            serving_excluded = [reader.excluded[h.id] for h in holders.values() if h.state in SERVING and h.id in reader.excluded]
            checking = [h for h in holders.values() if h.state in SERVING and reader.excluded.get(h.id) and h.verify_pending]
            if checking:
                # A source this reader found a mismatch on is re-hashing its copy: wait for the
                # verdict (a pass re-admits it: the bytes were damaged on the way).
                reader.waiting = True
                reader.session.model.waiting_readers[reader] = None
                return
            if any(serving_excluded) or reader.blamed_bad:
                err: TensorHubError = ChecksumMismatch("every remaining holder of this shard failed verification", **ctx)
            elif serving_excluded:
                err = TransportError(f"every remaining source failed this reader ({reader.failures} failures)", **ctx)
            elif self.in_grace:
                reader.waiting = True
                reader.session.model.waiting_readers[reader] = None
                return
            else:
                err = VersionUnavailable(f"no holder can serve version {reader.version} any more", **ctx)
            self._fail_txn(txn, err)
            return
        source = pick
        if txn.source_replica is None:
            txn.source_replica = source.replica.name
        reader.waiting = False
        reader.session.model.waiting_readers.pop(reader, None)
        g = _Grant(next(self._ids), reader, source, txn.shards[reader.shard_idx].req, self.clock())
        self.grants[g.id] = g
        self.stats["grants"] += 1
        source.grants[g.id] = g
        reader.upstream = g
        serving = source.replica.serving
        count = serving.get(reader.replica.name, 0)
        serving[reader.replica.name] = count + 1
        if not count:
            self._reindex(source.replica)
        src_session = source.session
        info = m.SourceInfo(
            src_session.id,
            source.replica.name,
            source.shard_idx,
            source.kind,
            source.state is not P,
            src_session.location,
            src_session.endpoint,
        )
        s = reader.session
        self._send(s, m.Grant(g.req, s.id, g.id, self.term, reader.version, reader.shard_idx, info, reader.checksums))

    def _twin(self, replica: _Replica) -> _Replica | None:
        """The replica that shares ``replica``'s host and link: its offload seed replica, or the
        replica a seed replica seeds for."""
        replicas = replica.model.replicas
        name = seed_owner(replica.name) or _seed_name(replica.name)
        return replicas.get(name) if name is not None else None

    def _load(self, replica: _Replica) -> int:
        """A source replica's load for selection: the reader replicas it serves, plus those its
        twin (:meth:`_twin`) serves: they send over the same link."""
        twin = self._twin(replica)
        return len(replica.serving) + (len(twin.serving) if twin is not None else 0)

    def _reindex(self, replica: _Replica) -> None:
        """The replica's load changed: move its grantable holders (and its twin's) to their new
        buckets."""
        twin = self._twin(replica)
        for r in (replica, twin) if twin is not None else (replica,):
            load = self._load(r)
            versions = r.model.versions
            for s in r.shards.values():
                for h in (s.holder, *s.offloads.values()):
                    if h is not None and h.state is not None and h.state is not U:
                        versions[h.version].index[h.shard_idx].put(h.id, r.name, s.location, load, h.state is not P)

    def _regrant_waiting(self, model: _Model) -> None:
        for h in list(model.waiting_readers):
            self._regrant(h)

    def _reader_grant(self, s: _Session, grant: int, term: int) -> _Grant:
        if term != self.term:
            raise StaleGrant(f"grant {grant} is from server term {term}; this server's term is {self.term}", **s.ctx())
        g = self.grants.get(grant)
        if g is None or g.reader.session is not s:
            raise UnknownGrant(f"grant {grant} is not an active grant of this session", **s.ctx())
        return g

    def _on_progress(self, peer: Hashable, msg: m.Progress) -> None:
        s = self._session(peer, msg.session)
        g = self._reader_grant(s, msg.grant, msg.term)
        total = s.layout.total_bytes if s.layout else 0
        if msg.verified > total:
            raise InvalidArgument(f"progress {msg.verified} beyond the shard's {total} bytes", **s.ctx(g.reader.version))
        g.reader.verified = max(g.reader.verified, msg.verified)

    def _on_complete(self, peer: Hashable, msg: m.Complete) -> None:
        s = self._session(peer, msg.session)
        g = self._reader_grant(s, msg.grant, msg.term)
        reader = g.reader
        self._end_grant(g, "completed")
        self._fire(reader, Event.COMPLETE)
        reader.verified = s.layout.total_bytes if s.layout else 0
        ver = s.model.versions[reader.version]
        reader.checksums = ver.checksums.get(reader.shard_idx, reader.checksums)
        self._ack(s, msg.req)
        # Readers pulling from this holder now see a complete source.
        call = reader.call
        reader.call = None
        if call is not None:
            txn, idx = call
            if txn.replica.txns.get(txn.n) is txn and idx in txn.shards:
                self._maybe_answer(txn)

    def _on_source_failed(self, peer: Hashable, msg: m.SourceFailed) -> None:
        s = self._session(peer, msg.session)
        g = self._reader_grant(s, msg.grant, msg.term)
        reader = g.reader
        reader.excluded[g.source.id] = False
        reader.failures += 1
        self._end_grant(g, "failed", max(reader.verified, msg.verified))
        self._fire(reader, Event.SOURCE_FAILED)
        reader.verified = max(reader.verified, msg.verified)
        self._ack(s, msg.req)
        self._regrant(reader)

    def _on_checksum_failed(self, peer: Hashable, msg: m.ChecksumFailed) -> None:
        s = self._session(peer, msg.session)
        if msg.term == self.term and msg.grant in self.revoked:
            self._ack(s, msg.req)  # a mismatch on a revoked grant blames nobody
            return
        g = self._reader_grant(s, msg.grant, msg.term)
        reader, source = g.reader, g.source
        reader.excluded[source.id] = True
        self._end_grant(g, "failed", min(reader.verified, msg.verified))
        self._fire(reader, Event.SOURCE_FAILED)
        reader.verified = min(reader.verified, msg.verified)
        source.reporters[reader.replica.name] = None
        self._ack(s, msg.req)
        if len(source.reporters) >= 2:
            self._quarantine(source)
        elif not source.verify_pending and source.state is not P:
            source.verify_pending = True
            self._send(source.session, m.VerifyRequest(source.session.id, source.version))
        self._regrant(reader)

    def _on_verify_result(self, peer: Hashable, msg: m.VerifyResult) -> None:
        s = self._session(peer, msg.session)
        h = s.holder if s.holder is not None and s.holder.version == msg.version else _offload_of(s, msg.version)
        if h is None:  # the holding went away meanwhile: nothing left to judge
            self._ack(s, msg.req)
            return
        if not h.verify_pending:
            raise ContractViolation("no verification was requested for this version", **s.ctx(msg.version))
        h.verify_pending = False
        self._ack(s, msg.req)
        model = s.model
        if not msg.ok:
            for r in model.waiting_readers:
                if r.excluded.get(h.id) is True:
                    r.blamed_bad = True  # if nothing else can serve it, say why: the copy was bad
            self._quarantine(h)
        else:
            # Its copy is sound: the readers that blamed it saw bytes damaged on the way. Each
            # may use it again, once (a second mismatch from the same reader excludes it for
            # good: ``readmitted``), as a source that failed rather than one that lied.
            for r in list(model.waiting_readers):
                if r.excluded.get(h.id) is True and h.id not in r.readmitted:
                    r.excluded[h.id] = False
                    r.readmitted[h.id] = None
            h.reporters.clear()
        self._regrant_waiting(model)

    def _quarantine(self, h: _Holder) -> None:
        self.stats["quarantined"] += 1
        s = h.session
        self._send(s, m.Quarantined(s.id, h.version))
        self._remove_holder(h, Event.QUARANTINE, "the holder failed verification")
        err = ChecksumMismatch("this shard's copy failed verification", **s.ctx(h.version))
        self._fail_pulls(s, h.version, err)

    def _fail_pulls(self, s: _Session, version: int, err: TensorHubError) -> None:
        """A shard lost its holding of ``version``: a replicate/update of the replica that
        counted on it (in flight, or done for this shard and waiting for the others) fails."""
        for txn in list(s.replica.txns.values()):
            call = txn.shards.get(s.shard_idx)
            if txn.kind in ("replicate", "update") and txn.version == version and call is not None and not call.done:
                self._fail_txn(txn, err)

    # ---- list and wait -----------------------------------------------------------------------

    def _on_list(self, peer: Hashable, msg: m.ListVersions) -> None:
        s = self._session(peer, msg.session)
        model = s.model
        if msg.call is None:
            self._send(s, m.Listing(msg.req, model.epoch, True, self._listing(model)))
            return
        txn, call = self._join(s, msg.req, msg.call, "list", None)
        if not txn.decided:
            txn.answer = (model.epoch, self._listing(model))
            txn.decided = True
        epoch, snap = txn.answer
        self._finish_call(txn, call, m.Listing(msg.req, epoch, True, snap))

    def _on_wait(self, peer: Hashable, msg: m.Wait) -> None:
        s = self._session(peer, msg.session)
        model = s.model
        known = s.replica.txns.get(msg.call)
        if msg.satisfied_epoch is not None and not (
            known is not None and (known.decided or msg.satisfied_epoch in known.offered)
        ):
            raise ContractViolation(f"epoch {msg.satisfied_epoch} was never offered to call {msg.call}", **s.ctx())
        txn, call = self._join(s, msg.req, msg.call, "wait", None)
        self._set_deadline(txn, msg.timeout)
        if txn.error is not None:
            self._error_shard(txn, call)
            return
        if not txn.decided and msg.satisfied_epoch is not None:
            snap = txn.offered[msg.satisfied_epoch]
            txn.answer = (msg.satisfied_epoch, snap)
            txn.decided = True
            txn.offered.clear()
            parked = [w for w in model.waits if w[0] is txn]
            model.waits = [w for w in model.waits if w[0] is not txn]
            for _, other, _ in parked:
                self._finish_call(txn, other, m.Listing(other.req, msg.satisfied_epoch, True, snap))
        if txn.decided:
            epoch, snap = txn.answer
            self._finish_call(txn, call, m.Listing(msg.req, epoch, True, snap))
            return
        self._listing(model)
        if model.epoch > msg.known_epoch or msg.known_epoch < 0:
            self._offer(txn, call, model)
        else:
            model.waits.append((txn, call, msg.known_epoch))

    def _offer(self, txn: _Txn, call: _ShardCall, model: _Model) -> None:
        snap = self._listing(model)
        txn.offered[model.epoch] = snap
        while len(txn.offered) > _OFFERS_KEPT:  # a shard answers about the latest few offers
            del txn.offered[next(iter(txn.offered))]
        call.done = True  # this request is answered; the shard polls again with a new one
        self._send(call.session, m.Listing(call.req, model.epoch, False, snap))

    # ---- heartbeats and failover ---------------------------------------------------------------

    def _on_heartbeat(self, peer: Hashable, msg: m.Heartbeat) -> None:
        now = self.clock()
        unknown = []
        for sid in msg.sessions:
            s = self.sessions.get(sid)
            if s is None:
                unknown.append(sid)
                continue
            s.peer = peer
            s.last_seen = now
            self.expiry.move_to_end(sid)
        self._out.append((peer, m.HeartbeatAck(msg.req, tuple(unknown))))

    def _on_announce(self, peer: Hashable, msg: m.Announce) -> None:
        """A client re-announces, after failover, what it holds: complete and offload copies
        (conflicting ones are dropped), a partial pull (to be re-granted when its call comes
        again), and the answer it last got for a model-parallel call."""
        s = self._session(peer, msg.session)
        if s.layout is None:
            raise NotRegistered("announce needs the layout: register first", **s.ctx())
        if s.holder is not None or s.offloads:
            raise ContractViolation("announce must come right after open and register", **s.ctx())
        normal = [x for x in msg.holdings if x.kind == m.KIND_NORMAL]
        if len(normal) + (msg.partial is not None) > 1:
            raise ContractViolation("a shard holds at most one version in its registered buffers", **s.ctx())
        offl = [x.version for x in msg.holdings if x.kind == m.KIND_OFFLOAD]
        if len(set(offl)) != len(offl):
            raise ContractViolation("duplicate offload holdings announced", **s.ctx())
        dropped = []
        for held in msg.holdings:
            try:
                if held.checksums is not None:
                    self._check_checksums(s, held.version, held.checksums)
            except TensorHubError:
                dropped.append(held.version)
                continue
            if held.kind == m.KIND_NORMAL:
                h = s.holder = self._new_holder(s, held.version, m.KIND_NORMAL, Event.PUBLISH)
            else:
                h = self._new_holder(s, held.version, m.KIND_OFFLOAD, Event.PUBLISH_OFFLOAD)
                s.offloads[h.id] = h
            if held.checksums is not None:
                self._set_checksums(h, held.checksums)
            self._published(s.model, held.version)
        if msg.partial is not None:
            h = s.holder = self._new_holder(s, msg.partial.version, m.KIND_NORMAL, Event.GRANT)
            h.verified = min(msg.partial.verified, s.layout.total_bytes)
            h.checksums = s.model.versions[h.version].checksums.get(s.shard_idx)
        # The answers this shard got may be ones its siblings have yet to get: record them, so a
        # sibling re-sending that call gets the same answer. Calls at or below a shard's last
        # answered one are consumed for it.
        s.answered = msg.answered
        s.announced = True
        replica = s.replica
        if not self.in_grace and replica.announce_until is None:
            replica.announce_until = self.clock() + self.config.heartbeat_timeout
            self._timer(replica.announce_until, "announce", replica)
        for last in msg.answers:
            txn = replica.txns.get(last.call)
            if txn is not None and (txn.decided or txn.kind != last.kind):
                continue  # decided here already (or another call: the shards diverged; it will fail)
            if txn is None:
                txn = replica.txns[last.call] = _Txn(last.call, last.kind, _AnnouncedArgs(), replica)
            # else: a sibling's call waiting for this very answer (parked until all announced)
            moved = last.moved if last.moved is not None else last.kind == "replicate" and last.error is None
            txn.decided, txn.version, txn.moved = True, last.version, moved
            if last.kind in ("list", "wait"):
                txn.answer = (last.epoch or 0, last.listing or ())
            if last.error is not None:
                txn.error = error_from_wire(last.error, last.message or "the call failed before the failover", **s.ctx())
        for txn in list(replica.txns.values()):
            for sib in replica.shards.values():
                if sib.announced and txn.n <= sib.answered:
                    txn.consumed[sib.shard_idx] = None
            if len(txn.consumed) >= replica.num_shards:
                self._drop_txn(txn)
        s.model.availability_changed = True  # wake calls parked until the replica re-announced
        self._mark_dirty(s.model)
        self._regrant_waiting(s.model)
        if dropped:
            raise VersionConflict(
                f"announced holdings of versions {dropped} conflict with checksums others declared; dropped",
                **s.ctx(dropped[0]),
            )
        self._ack(s, msg.req)

    # ---- settling --------------------------------------------------------------------------------

    def _settle(self) -> None:
        """After every event: fail partial holders whose (version, shard) has nothing left to
        pull from, release offload copies no longer needed, bump the listing epoch and answer
        long-polls, and wake calls waiting for a version."""
        rounds = 0
        while self._dirty_models:
            rounds += 1
            if rounds > 100000:
                raise AssertionError("settling did not converge")
            _, model = self._dirty_models.popitem()
            self._settle_model(model)

    def _settle_model(self, model: _Model) -> None:
        while model.dirty_shards:
            (v, i), _ = model.dirty_shards.popitem()
            ver = model.versions.get(v)
            if ver is None:
                continue
            holders = ver.holders[i]
            if not ver.serving[i] and not self.in_grace:
                for h in [h for h in holders.values() if h.state is P and not self._viable(h)]:
                    if h.state is P:
                        self._source_gone(h)
            for h in [h for h in model.waiting_readers if h.version == v and h.shard_idx == i]:
                self._regrant(h)
            for h in [h for h in model.offload_holders.values() if h.version == v and h.shard_idx == i]:
                if h.state is O:
                    self._maybe_release(h, holders)
        if model.retention_changed:
            model.retention_changed = False
            for h in list(model.offload_holders.values()):
                if h.state is O:
                    self._maybe_release(h, model.versions[h.version].holders[h.shard_idx])
        if model.changed:
            model.changed = False
            model.epoch += 1
            waits, model.waits = model.waits, []
            for txn, call, _ in waits:
                if not txn.decided and txn.error is None:
                    self._offer(txn, call, model)
        if model.availability_changed:
            model.availability_changed = False
            self._wake_parked(model)
        if model.gc_needed:
            model.gc_needed = False
            self._gc_versions(model)
            self._gc_model(model)

    def _wake_parked(self, model: _Model) -> None:
        parked, model.parked = model.parked, {}
        for txn in parked:
            if txn.waiting and txn.error is None and txn.replica.txns.get(txn.n) is txn:
                txn.waiting = False
                for call in list(txn.shards.values()):
                    if not call.done:
                        self._advance(txn, call)

    def _maybe_release(self, h: _Holder, holders: dict[int, _Holder]) -> None:
        """Release an offload copy once the version is no longer retained or another non-spot
        holder has completed it. Its readers drain first; then its owner frees it."""
        model = h.session.model
        if model.retained(h.version) and not any(
            o.state is C and not o.spot and not o.offload_pending for o in holders.values()
        ):
            return
        self._fire(h, Event.RELEASE)
        self._begin_drain(h)

    def _viable(self, h: _Holder) -> bool:
        """A partial holder can still finish: its chain of sources ends at a holder of the whole
        shard (one that is unpublishing finishes the grants it has)."""
        x = h
        for _ in range(1 << 20):
            if x.upstream is None:
                return x.whole and x.state is not None
            x = x.upstream.source
        raise AssertionError("grant cycle")

    def _source_gone(self, h: _Holder) -> None:
        call = h.call
        ctx = h.session.ctx(h.version)
        if h.upstream is not None:
            self._end_grant(h.upstream, "cancelled")
        readers = [g.reader for g in h.grants.values()]
        for g in list(h.grants.values()):
            self._revoke(g, "its source has no complete copy left")
        h.call = None
        self._fire(h, Event.SOURCES_GONE)
        if call is not None:
            self._fail_txn(call[0], VersionUnavailable(f"version {h.version} lost its last complete holder", **ctx))
        for r in readers:
            self._regrant(r)

    def _gc_versions(self, model: _Model) -> None:
        """Forget versions with no holders. The record of one that was available is kept (so
        that asking for it raises instead of waiting) unless it is far below the top."""
        top = model.highest_published
        for v in [v for v, ver in model.versions.items() if not any(ver.holders)]:
            ver = model.versions[v]
            if not ver.ever_available or top is None or v < top - _GONE_MEMORY:
                del model.versions[v]
        for key in [k for k in model.seeds if k[0] not in model.versions]:
            del model.seeds[key]

    def _gc_model(self, model: _Model) -> None:
        if self.models.get(model.name) is not model:
            return
        if not model.replicas and not model.declarations and not any(any(v.holders) for v in model.versions.values()):
            del self.models[model.name]
            self._dirty_models.pop(model.name, None)

    # ---- introspection (tests, status) ---------------------------------------------------------

    def _on_status(self, peer: Hashable, msg: m.GetStatus) -> None:
        self._out.append((peer, m.ServerStatus(
            msg.req, self.term, self.counts(), dict(self.stats), dict(self.bytes_by_link), tuple(self.seeding()),
        )))  # fmt: skip

    def _on_dag(self, peer: Hashable, msg: m.GetDag) -> None:
        edges = tuple(m.DagEdge(**e) for e in self.history.get((msg.model, msg.version), ()))
        self._out.append((peer, m.Dag(msg.req, msg.model, msg.version, edges)))

    def seeding(self) -> Iterable[m.Seeding]:
        """Versions being seeded into a datacenter now: the replicas there whose pull of the
        version has a source in another datacenter (or that were told to offload-seed it)."""
        across: dict[str, dict[tuple[int, str], dict[str, None]]] = {}  # model -> (version, dc) -> replicas
        for g in self.grants.values():
            r = g.reader
            dc = r.session.location.datacenter
            if dc != g.source.session.location.datacenter:
                across.setdefault(r.session.model.name, {}).setdefault((r.version, dc), {})[r.replica.name] = None
        now = self.clock()
        for model in self.models.values():
            found = across.get(model.name, {})
            for (v, dc), (owner, until) in model.seeds.items():
                if until > now and owner in model.replicas and not found.get((v, dc)):
                    found[(v, dc)] = {seed_replica(owner): None}
            for (v, dc), replicas in sorted(found.items()):
                yield m.Seeding(model.name, v, dc, tuple(replicas))

    def counts(self) -> dict[str, int]:
        """How many of each thing the table holds (all zero once every client has closed)."""
        holders = sum(len(hs) for mo in self.models.values() for ver in mo.versions.values() for hs in ver.holders)
        txns = sum(len(r.txns) for mo in self.models.values() for r in mo.replicas.values())
        return {
            "models": len(self.models),
            "sessions": len(self.sessions),
            "holders": holders,
            "grants": len(self.grants),
            "transactions": txns,
            "waits": sum(len(mo.waits) for mo in self.models.values()),
            "declarations": sum(len(mo.declarations) for mo in self.models.values()),
        }

    def holders(self) -> Iterable[_Holder]:
        for model in self.models.values():
            for ver in model.versions.values():
                for hs in ver.holders:
                    yield from hs.values()


class _AnnouncedArgs:
    """Matches any args: a transaction re-created from an announcement knows its answer, not the
    exact spec the shards passed."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]


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


def _describe(kind: str, args: Any) -> str:
    return f"{kind}({args})" if args is not None and not isinstance(args, _AnnouncedArgs) else kind


def _layout_diff(known: Layout, got: Layout) -> str:
    if len(known.tensors) != len(got.tensors):
        return f"layout has {len(got.tensors)} tensors; other holders of this shard have {len(known.tensors)}"
    for a, b in zip(known.tensors, got.tensors):
        if a != b:
            return f"tensor {b.name!r} ({b.dtype}{list(b.shape)}) differs from {a.name!r} ({a.dtype}{list(a.shape)})"
    return "layout parameters (checksum, chunk size, pack threshold) differ from other holders of this shard"
