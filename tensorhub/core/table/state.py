"""The reference table's state, and what its concerns offer each other: declared in one class,
:class:`TableState`, that every concern of the table subclasses.

Theory of operation
-------------------
The table is one object (:class:`~tensorhub.core.table.ReferenceTable`) whose concerns live in
modules of their own, each a mixin class. They share one state, and call each other. This
module is where a reader and the type checker see both:

- **the state**: :meth:`TableState.__init__` sets up every record the table keeps, typed, with
  what it holds; each concern's docstring names the records it uses ("State: ...", kept true by
  ``tests/test_table_state.py``);
- **the plumbing** that every concern uses: the outbox (:meth:`~TableState._send`), timers,
  the models to settle;
- **the services**: the methods one concern calls on another, as signatures grouped by the
  module that implements them (only for the checker: they are not defined at run time, so the
  method resolution order of the table is that of its concerns alone). mypy checks every
  implementation against its signature here, and every call against it.

Invariants: the state is set up here only (the table's ``__init__``, and a step-down that
forgets it under a new term); a concern adds no state of its own beyond class-level constants.

What it must never do: import a concern of the table (they import this module), or IO.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Callable, Hashable

from .. import messages as m
from ..errors import TensorHubError
from ..lifecycle import Event
from ..naming import VersionSpec
from ..topology import LINK_CLASSES
from .records import Outbox, SourcePolicy, TableConfig, _Grant, _Holder, _Model, _Pace, _Replica, _Session, _ShardCall, _Txn
from .reign import Reign

_MAX_FIRST_ID = 2**52  # ids stay below 2**53 (exact as JSON numbers) for 2**52 ids after it

#: what a bucket tier holds of one model: its num_shards, and its ``_Model.buckets``
BucketMemory = tuple[int, dict[tuple[int, int], tuple[str, tuple[int, ...] | None]]]


class TableState:
    """The table's state and plumbing (see the module's docstring). Args as for
    :class:`~tensorhub.core.table.ReferenceTable`."""

    def __init__(
        self,
        clock: Callable[[], float],
        rng: random.Random,
        config: TableConfig | None = None,
        term: int = 1,
        *,
        sources: Callable[[], SourcePolicy],
        reign: Reign | None = None,
        first_id: int = 1,
    ) -> None:
        if type(first_id) is not int or not 1 <= first_id < _MAX_FIRST_ID:
            raise ValueError(f"first_id must be an int in [1, 2**52), got {first_id!r}")
        # -- what the table is given
        self.clock = clock
        self.sources = sources
        self.rng = rng
        self.config = config or TableConfig()
        self.term = term
        self.reign = reign if reign is not None else Reign()
        if self.reign.role == "solo" and not self.reign.reigning:
            self.reign.began(term, clock())
        # -- the records
        self.models: dict[str, _Model] = {}
        self.sessions: dict[int, _Session] = {}
        self.by_slot: dict[tuple[str, str, int], _Session] = {}  # (model, replica, shard) -> its session
        self.fenced: OrderedDict[int, str] = OrderedDict()  # removed session id -> error code
        self.expiry: OrderedDict[int, _Session] = OrderedDict()  # sessions by last_seen
        self.grants: dict[int, _Grant] = {}  # active grants by id
        #: model name -> (its num_shards, its ``buckets``): what the bucket tier holds outlives the
        #: model's record (a reader may come after every holder left); the newest models kept
        self.bucket_memory: OrderedDict[str, BucketMemory] = OrderedDict()
        self._by_id: dict[int, _Holder] = {}  # every holder in the table, by id
        self.revoked: OrderedDict[int, None] = OrderedDict()  # recently revoked grant ids
        #: the failover grace period's end (None: over; see :mod:`.failover`)
        self.grace_until: float | None = clock() + self.config.heartbeat_timeout
        #: (model, version) -> its ended grants, oldest first, each a tuple of the fields of
        #: :class:`~tensorhub.core.messages.DagEdge` in order (see ``replication_dag``)
        self.history: OrderedDict[tuple[str, int], list[tuple[Any, ...]]] = OrderedDict()
        self._ids = itertools.count(first_id)  # session, holder and grant ids
        #: (when, sequence, what, its record): "drain" a holder, "txn"/"pin" a call, "announce" a replica
        self._timers: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._out: Outbox = []
        self._grants_sent = 0  # Grant messages put in the outbox since the reign last counted them
        self._dirty_models: dict[str, _Model] = {}  # models to settle after this event
        self.stats = {
            "grants": 0, "grants_ended": 0, "revoked": 0, "expired": 0, "quarantined": 0, "offloads": 0,
            "updates_skipped": 0, "offload_seeds": 0, "pins": 0, "pins_expired": 0, "redecided": 0,
            "conversions": 0, "stragglers": 0, "delta_plans": 0, "deltas_landed": 0, "deltas_refused": 0,
            "stalls_credited": 0,
        }  # fmt: skip
        self.pace: dict[int, _Pace] = {}  # grant id -> its recent progress (see :mod:`.stragglers`)
        #: (model, link class) -> completed grants' rates (bytes/s), the newest last
        self.pace_recent: dict[tuple[str, str], deque[float]] = {}
        #: bytes moved under ended grants, per link class (:data:`tensorhub.core.topology.LINK_CLASSES`)
        self.bytes_by_link = dict.fromkeys(LINK_CLASSES, 0)
        #: the sessions of the heartbeat being handled that may vote (see :mod:`.failover`)
        self._voting: tuple[int, ...] = ()

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

    # ---- the services: what one concern calls on another, by the module that implements it ----
    # (signatures for the checker only; see the module's docstring)

    if TYPE_CHECKING:
        # .holders
        def _holder_set(self, model: _Model, version: int, shard_idx: int) -> dict[int, _Holder]: ...
        def _new_holder(self, s: _Session, version: int, kind: str, event: Event) -> _Holder: ...
        def _fire(self, h: _Holder, event: Event) -> None: ...
        def _remove_holder(self, h: _Holder, event: Event, reason: str) -> None: ...
        def _abort_partial(self, h: _Holder) -> None: ...
        def _viable(self, h: _Holder) -> bool: ...
        def _source_gone(self, h: _Holder) -> None: ...

        # .sessions
        def _session(self, peer: Hashable, sid: int) -> _Session: ...
        def _ack(self, s: _Session, req: int) -> None: ...

        # .publishing
        def _published(self, model: _Model, version: int) -> None: ...
        def _retention_moved(self, model: _Model) -> None: ...
        def _check_checksums(self, s: _Session, version: int, checksums: tuple[int, ...]) -> None: ...
        def _set_checksums(self, h: _Holder, checksums: tuple[int, ...]) -> None: ...
        def _unpublish(self, h: _Holder, then: Callable[[], None]) -> None: ...
        def _drained(self, h: _Holder) -> None: ...
        def _maybe_release(self, h: _Holder, holders: dict[int, _Holder]) -> None: ...

        # .grants
        def _downstream(self, h: _Holder) -> dict[int, None]: ...
        def _select(self, reader: _Holder, prefer: str | None, retry_failed: bool) -> _Holder | None: ...
        def _regrant(self, reader: _Holder) -> None: ...
        def _open_grant(self, reader: _Holder, source: _Holder) -> tuple[_Grant, m.SourceInfo, bytes | None]: ...
        def _load(self, replica: _Replica) -> int: ...
        def _regrant_waiting(self, model: _Model) -> None: ...
        def _revoke(self, g: _Grant, reason: str) -> None: ...
        def _end_grant(self, g: _Grant, how: str, reached: int | None = None) -> None: ...
        def _holding_done(self, h: _Holder) -> None: ...
        def _fail_pulls(self, s: _Session, version: int, err: TensorHubError) -> None: ...
        def _on_progress(self, peer: Hashable, msg: m.Progress) -> None: ...  # wrapped by .stragglers

        # .transactions
        def _join(self, s: _Session, req: int, n: int, kind: str, args: Any) -> tuple[_Txn, _ShardCall]: ...
        def _finish_call(self, txn: _Txn, call: _ShardCall, reply: Any) -> None: ...
        def _drop_txn(self, txn: _Txn) -> None: ...
        def _fail_txn(self, txn: _Txn, err: TensorHubError) -> None: ...
        def _error_shard(self, txn: _Txn, call: _ShardCall) -> None: ...
        def _set_deadline(self, txn: _Txn, timeout: float | None) -> None: ...
        def _offer(self, txn: _Txn, call: _ShardCall, model: _Model) -> None: ...

        # .conversions
        def _check_source(self, model: _Model | None, msg: m.OpenShard) -> None: ...
        def _converted_models(self, model: _Model) -> list[_Model]: ...
        def _resolve_converted(self, model: _Model, spec: VersionSpec, ctx: dict[str, Any]) -> int | None: ...
        def _convertible(self, h: _Holder) -> bool: ...
        def _convert(self, reader: _Holder) -> None: ...
        def _waiting_of(self, model: _Model) -> list[_Holder]: ...
        def _wake_converters(self, model: _Model) -> None: ...
        def _end_conversion(self, h: _Holder) -> None: ...
        def _grant_ended(self, g: _Grant) -> bool: ...

        # .deltas
        def _check_delta_publish(self, s: _Session, version: int, base: int | None) -> None: ...
        def _record_delta(self, s: _Session, version: int, base: int | None, delta_from: int | None) -> None: ...
        def _check_delta_layout(self, s: _Session, version: int) -> None: ...
        def _plan_deltas(self, txn: _Txn, v: int) -> bool: ...
        def _delta_coming(self, txn: _Txn, v: int) -> bool: ...
        def _delta_seeding_allows(self, txn: _Txn, s: _Session) -> bool: ...
        def _delta_seeding(self, model: _Model, version: int, dc: str) -> bool: ...
        def _in_bucket(self, reader: _Holder, err: TensorHubError) -> TensorHubError: ...
        def _bucket_holds(self, model: _Model, version: int) -> str | None: ...
        def _known_checksums(self, model: _Model, version: int, shard: int) -> tuple[int, ...] | None: ...
        def _holds_already(self, s: _Session, version: int, held: tuple[int, ...] | None) -> bool: ...

        # .pulls
        def _resolve(self, model: _Model, spec: VersionSpec, ctx: dict[str, Any]) -> int | None: ...
        def _advance(self, txn: _Txn, call: _ShardCall) -> None: ...
        def _maybe_answer(self, txn: _Txn) -> None: ...

        # .pins
        def _pin(self, txn: _Txn) -> None: ...
        def _unpin(self, txn: _Txn) -> None: ...
        def _redecide(self, model: _Model) -> None: ...

        # .failover
        @property
        def in_grace(self) -> bool: ...
        def _awaiting_announcements(self, replica: _Replica) -> bool: ...

        # .settling
        def _gc_model(self, model: _Model) -> None: ...

        # .views (and .stragglers, which wraps it)
        def _listing(self, model: _Model) -> tuple[m.VersionEntry, ...]: ...
        def _record(self, g: _Grant, how: str, reached: int | None) -> str: ...
