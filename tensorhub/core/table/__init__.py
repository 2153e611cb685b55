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
- **holders**: (model, version, shard, replica) in the lifecycle of :mod:`tensorhub.core.lifecycle`;
  every state change is a transition of that table.
- **grants**: reader holder <- source holder, counted on the source; every grant ends exactly
  once (completed, failed, revoked or cancelled).
- **transactions** per (replica, call number) for the model-parallel calls (publish, unpublish,
  replicate, update, wait, consistent list): the first shard decides, the others get the
  recorded answer; ``replicate``/``update`` answer only when every shard is done or all fail
  alike.
- **retention** declarations per (model, replica), counted from the highest version published,
  lasting until the replica's shards have all closed cleanly.

Invariants (checked by :func:`tensorhub.core.invariants.check_invariants`):

- no grant is made from an unpublishing, excluded, quarantined, removed or downstream holder,
  so the upstream graph never has a cycle;
- a holder's grant count is exactly its active grants, and nothing frees a holder that has one
  (unpublishing holders are removed only when drained, or after revoking what is left at
  ``drain_timeout``);
- a partial holder exists only while a reader is pulling it (with an active grant, or waiting
  for one), and is failed with ``VersionUnavailable`` once no complete or offload holder of its
  (version, shard) is left;
- when every client has closed, nothing is left: no sessions, holders, grants, transactions.

No split brain (:class:`~tensorhub.core.table.reign.Reign`): with a primary and a backup, a
table decides only while it *reigns*: while it holds the backup's lease (the primary) or fresh
votes from a majority of the last membership both servers hold (a shard's heartbeats, each
echoing this table's last stamp, count until that stamp plus the lease, and only from a lease
after the shard arrived). The lease is counted by the primary from when it asked, so it ends
before the backup's promise does; two majorities of one membership share a voter, whose votes
never count at two tables at once: at any instant at most one table reigns. A table that does
not reign accepts sessions (and votes) and refuses every call; one that stops reigning steps
down: every session is told ``StepDown`` and the state is forgotten under a new term.

What it must never do: block, look at the wall clock, iterate a hash-ordered collection of
strings (that would make replies depend on ``PYTHONHASHSEED``), or change anything when it
answers with an error.

Where things are
----------------
:class:`ReferenceTable` (in this module) is the one object: the entry points
(:meth:`~ReferenceTable.handle`, :meth:`~ReferenceTable.tick`) and the handler of each message.
Each concern is a mixin class in a module of its own, and the table combines them. Every mixin
subclasses :class:`~.state.TableState`, which sets up all the state in its ``__init__`` and
declares, for the type checker, the methods one concern calls on another; each mixin's
docstring names the records it uses. The mixins import :mod:`.records`, :mod:`.state` and
:mod:`.reign`, nothing else of the table (neither this module nor each other):

- :mod:`.state`: the state, the plumbing (outbox, timers, models to settle), the services;
- :mod:`.records`: the records, :class:`TableConfig`, the :class:`SourcePolicy` protocol, bounds;
- :mod:`.reign`: the no-split-brain rule (:class:`~.reign.Reign`), which the table holds;
- :mod:`.holders`: holder lifecycle transitions and the counts kept in step with them, and the
  abrupt ends of a holding (removal, abort, sources gone);
- :mod:`.sessions`: open, register, close, heartbeats; identity, fencing, expiry, replica removal;
- :mod:`.publishing`: publish, checksums, unpublish and drain, offload, retention;
- :mod:`.grants`: source selection, grants and their ends, progress, completion, source failures,
  checksum failures, verification and quarantine;
- :mod:`.transactions`: the model-parallel calls, and the consistent list and wait built on them;
- :mod:`.conversions`: converted models (another layout of a source model): their versions, the
  converter of each (version, shard), its grants on the source's holders;
- :mod:`.deltas`: a model's deltas as the versions of its delta model (a layout per version), and
  the per-reader plan of an update: a chain of deltas or a full pull;
- :mod:`.pulls`: replicate and update: version resolution, the replica's decision, the
  cross-datacenter policy, moving each shard;
- :mod:`.pins`: a replicate/update in flight keeps the version it decided (a pin), and moves to a
  newer one while nothing of it has landed;
- :mod:`.failover`: the grace period and re-announcements; the no-split-brain rule applied;
- :mod:`.stragglers`: a source alive but slow, told from a busy one by progress, and its readers moved;
- :mod:`.settling`: the consequences applied after every event, and garbage collection;
- :mod:`.views`: the listing, status, and the replication history.
"""

from __future__ import annotations

import heapq
import random
from typing import Any, Callable, Hashable

from .. import messages as m
from ..errors import ProtocolError, ReplicaRemoved, TensorHubError
from .conversions import ConversionMixin
from .deltas import DeltaMixin
from .failover import FailoverMixin, ReignMixin
from .grants import GrantMixin
from .holders import HolderMixin
from .pins import PinMixin
from .publishing import PublishMixin
from .pulls import PullMixin

# re-exported: the server and the invariants import these from here
from .records import HISTORY_EDGES as HISTORY_EDGES
from .records import HISTORY_VERSIONS as HISTORY_VERSIONS
from .records import SERVING as SERVING
from .records import Outbox, SourcePolicy, TableConfig
from .reign import Reign
from .sessions import SessionMixin
from .stragglers import StragglerMixin
from .settling import SettleMixin
from .state import _MAX_FIRST_ID, TableState
from .transactions import TransactionMixin
from .views import ViewMixin

__all__ = ["ReferenceTable", "TableConfig", "Outbox", "random_first_id"]


def random_first_id(rng: random.Random) -> int:
    """A first id for a server process's table: random in [1, 2**52). A stale session id of
    another process falls among this one's first n ids with odds n / 2**52 (below one in a
    billion while n stays under four million)."""
    return 1 + rng.randrange(_MAX_FIRST_ID - 1)


class ReferenceTable(
    StragglerMixin,
    SessionMixin,
    HolderMixin,
    PublishMixin,
    GrantMixin,
    ConversionMixin,
    DeltaMixin,
    TransactionMixin,
    PullMixin,
    PinMixin,
    FailoverMixin,
    ReignMixin,
    SettleMixin,
    ViewMixin,
    TableState,
):
    """The reference server's state and decisions (sans-IO).

    Args:
        clock: returns the current time in seconds (monotonic); injected.
        rng: the one random source (tie-breaks); injected and seeded by the caller.
        config: timeouts.
        term: this server start's term; grants carry it, and a grant of another term is void.
        reign: the no-split-brain rule (:class:`~tensorhub.core.table.reign.Reign`) of a primary
            or a backup server; None: a server alone, which always decides.
        sources: makes the index of one (version, shard)'s grantable holders, which also picks
            the source for a reader: the scheduling policy, injected because the core sits below
            the scheduling layer (the server, the simulator and the tests pass
            :class:`tensorhub.scheduling.selection.SourceIndex`).
        first_id: the first session, holder and grant id this table gives. A server process
            starts it at random (:func:`random_first_id`), so that a stale client of an earlier
            process, naming its old session id in a heartbeat, finds it unknown (and re-opens)
            instead of adopting another client's session; the simulator and tests start at 1.
    """

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
        super().__init__(clock, rng, config, term, sources=sources, reign=reign, first_id=first_id)
        self._handlers: dict[type, Callable[[Hashable, Any], None]] = {
            m.OpenShard: self._on_open,
            m.Register: self._on_register,
            m.Unregister: self._on_unregister,
            m.Publish: self._on_publish,
            m.DeclareChecksums: self._on_checksums,
            m.DeclareChecksumsPart: self._on_checksums_part,
            m.Unpublish: self._on_unpublish,
            m.PublishOffload: self._on_offloaded,
            m.Replicate: self._on_pull,
            m.BucketStored: self._on_bucket_stored,
            m.Update: self._on_pull,
            m.ListVersions: self._on_list,
            m.Wait: self._on_wait,
            m.Progress: self._on_progress,
            m.Complete: self._on_complete,
            m.SourceFailed: self._on_source_failed,
            m.Converted: self._on_converted,
            m.ConvertFailed: self._on_convert_failed,
            m.ChecksumFailed: self._on_checksum_failed,
            m.VerifyResult: self._on_verify_result,
            m.Heartbeat: self._on_heartbeat,
            m.Announce: self._on_announce,
            m.CloseShard: self._on_close,
            m.GetStatus: self._on_status,
            m.GetDag: self._on_dag,
            m.LeaseRequest: self._on_lease_request,
            m.LeaseReply: self._on_lease_reply,
        }

    # ---- entry points --------------------------------------------------------------------------

    def handle(self, peer: Hashable, msg: Any) -> Outbox:
        """Process one message from ``peer``; return the messages to send.

        A message the table cannot accept gets a :class:`~tensorhub.core.messages.Failed` reply
        with a typed error, and changes nothing.
        """
        handler = self._handlers.get(type(msg))
        solo = self.reign.role == "solo"
        try:
            if handler is None:
                raise ProtocolError(f"{type(msg).__name__} is not a request a server accepts")
            if not solo:
                msg = self._reign_check(peer, msg)  # no decision while this server does not reign
            handler(peer, msg)
        except TensorHubError as err:
            self._out.append((peer, m.Failed.of(getattr(msg, "req", 0), err)))
        if self._dirty_models:
            self._settle()
        out, self._out = self._out, []
        if solo:  # what _reign_after does for a server alone, inline: count the grants
            if self._grants_sent:
                self._count_grants(self.clock())
            return out
        return self._reign_after(peer, msg, out)

    def heartbeat(self, peer: Hashable, msg: m.Heartbeat) -> Outbox:
        """:meth:`handle` of a heartbeat without the dispatch around it: the same effect and the
        same answer, for the server's socket reader, which answers heartbeats as it reads them.

        A heartbeat only refreshes deadlines: each session's expiry and, with a reign, the vote
        of the connection that opened it (until the echoed stamp plus the lease). What else a
        heartbeat may meet (the reign beginning or ending now, a session a step-down dropped) is
        left to :meth:`handle` itself, so that those paths stay one.
        """
        reign = self.reign
        if reign.role == "solo":
            self._on_heartbeat(peer, msg)
            return self._flush()  # a heartbeat answers its sender once and changes nothing to settle
        self._check_reign()
        dropped = reign.dropped
        dirty = self._dirty_models and reign.held_since is None  # a holding primary settles nothing
        if self._out or dirty or (dropped and any(sid in dropped for sid in msg.sessions)):
            return self.handle(peer, msg)  # checking the rule again changes nothing: it just ran
        now = self.clock()
        sessions, owner, expiry, vote = self.sessions, reign.owner, self.expiry, reign.vote
        term = self.term
        stamp = msg.stamp if msg.stamp_term == term and msg.stamp > 0 else None
        unknown = []
        for sid in msg.sessions:
            s = sessions.get(sid)
            if s is None:
                unknown.append(sid)
                continue
            if owner.get(sid) == peer:  # only the connection that opened a session votes for it
                vote(sid, s.slot, now, stamp)
            if s.peer != peer:  # a session another connection opened is not kept alive from here
                unknown.append(sid)
                continue
            s.last_seen = now
            expiry.move_to_end(sid)
        return [(peer, m.HeartbeatAck(msg.req, tuple(unknown), term, now, reign.lease, reign.reigning))]

    def tick(self) -> Outbox:
        """Apply the passage of time up to ``clock()``; return the messages to send."""
        now = self.clock()
        if self.reign.role != "solo":
            self._check_reign()  # a reign that ran out steps down before anything else happens
            if self.reign.held_since is not None:
                # a primary holding its state decides nothing, time-driven decisions included
                # (expiries, deadlines): they come due once it reigns again (Reign: "holds")
                return self._flush()
        if self.reign.reigning:
            self._check_stragglers(now)
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
            elif what == "pin":
                self._pin_expired(obj, now)
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
        out = self._flush()
        self._count_grants(now)
        return out

    def credit_stall(self, seconds: float) -> None:
        """The server stood still for ``seconds`` (its process was not scheduled, or its loop was
        busy): the heartbeats it could not read meanwhile are not held against the sessions. Each
        session's silence is shortened by that much, never past now, which keeps their order in
        :attr:`expiry`. A session that really went silent is removed that much later; a primary
        holding its state waits for its backup's word that much longer."""
        if seconds <= 0:
            return
        now = self.clock()
        for s in self.expiry.values():
            s.last_seen = min(s.last_seen + seconds, now)
        self.reign.credit_hold(seconds, now)  # a holding primary waits for the backup's word that much longer
        self.stats["stalls_credited"] += 1

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (None: only on new messages)."""
        times = []
        if self.expiry:
            times.append(next(iter(self.expiry.values())).last_seen + self.config.heartbeat_timeout)
        if self._timers:
            times.append(self._timers[0][0])
        if self.grace_until is not None:
            times.append(self.grace_until)
        change = self.reign.next_change(self.clock()) if self.reign.role != "solo" else None
        if change is not None:
            times.append(change)
        return min(times) if times else None
