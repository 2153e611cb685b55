"""Sessions: identity, fencing and expiry of the open shard handles, and their layouts.

Theory of operation
-------------------
What it owns: one session per open shard (``sessions``; ``by_slot``: (model, replica, shard) ->
session; ``expiry``: least recently heard first), the layouts registered per (model, shard), the
retention declarations made at open, heartbeats, and the removal of a replica.

Invariants: one session per slot, bound to the connection (``peer``) that opened it: a message
naming it from any other connection is refused with ``UnknownSession`` and changes nothing (its
replies never go elsewhere), and a heartbeat from elsewhere does not keep it alive. A client keeps
one connection identity across reconnects (:mod:`tensorhub.runtime.client`). Opening again with
the same incarnation from the same connection (a retried open) gets the same session; a new incarnation removes the old one's replica whole, and the old session's
late messages get ``Fenced``. A replica is removed whole (expiry, fencing): every shard's
holdings, grants and calls go with it, and its live shards are told; a clean close ends that
shard's session only, failing the calls it had not finished. ``expiry`` holds every session in
the order last heard, so expiry (in :meth:`~tensorhub.core.table.ReferenceTable.tick`) looks
only at its head. Ended session ids are remembered (``_FENCED_MEMORY`` of them) to answer with
``Fenced`` or ``ReplicaRemoved`` rather than ``UnknownSession``. A layout stays fixed while any
session uses it (registered, or holding offload copies it describes).

What it must never do: remove one shard of a crashed, expired or fenced replica and leave the
others, or let a message of an unknown or ended session change anything.
"""

from __future__ import annotations

from typing import Hashable

from .. import messages as m
from ..errors import (
    ContractViolation,
    Fenced,
    InvalidPlacement,
    LayoutMismatch,
    NotRegistered,
    ReplicaRemoved,
    TensorHubError,
    UnknownSession,
)
from ..layout import Layout
from ..lifecycle import Event
from ..placement import PlacedTensor
from .records import _FENCED_MEMORY, _Declaration, _Model, _Replica, _Session, _Txn
from .state import TableState


class SessionMixin(TableState):
    """Sessions, layouts, heartbeats, replica removal. Mixed into
    :class:`~tensorhub.core.table.ReferenceTable`. State
    (:class:`~tensorhub.core.table.state.TableState`): ``clock``, ``config``, ``term``, ``models``,
    ``sessions``, ``by_slot``, ``fenced``, ``expiry``, ``bucket_memory``, ``reign``, ``_ids``, ``_out``."""

    def _session(self, peer: Hashable, sid: int) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            code = self.fenced.get(sid)
            if code == Fenced.code:
                raise Fenced(f"session {sid} was fenced by a newer incarnation")
            if code is not None:
                raise ReplicaRemoved(f"session {sid} was removed with its replica")
            raise UnknownSession(f"session {sid} is not known to this server (term {self.term}); open again")
        if s.peer != peer:
            # A session is bound to the connection that opened it: knowing its id (status prints
            # it) lets another connection neither act for it nor re-point its replies.
            raise UnknownSession(f"session {sid} was not opened on this connection; it cannot be used from here")
        s.last_seen = self.clock()  # _touch, inline: once per message
        self.expiry.move_to_end(sid)
        return s

    def _touch(self, s: _Session) -> None:
        s.last_seen = self.clock()
        self.expiry.move_to_end(s.id)

    def _on_open(self, peer: Hashable, msg: m.OpenShard) -> None:
        model = self.models.get(msg.model)
        if model is not None and model.num_shards != msg.num_shards:
            raise LayoutMismatch(
                f"model has num_shards={model.num_shards}; this shard declares {msg.num_shards}",
                model=msg.model,
                replica=msg.replica,
                shard=msg.shard_idx,
            )
        self._check_source(model, msg)
        slot = (msg.model, msg.replica, msg.shard_idx)
        old = self.by_slot.get(slot)
        if old is not None and old.incarnation == msg.incarnation:
            if old.peer != peer:  # a retried open comes from the connection that opened it
                raise ContractViolation(
                    "this incarnation of the shard is open on another connection", model=msg.model,
                    replica=msg.replica, shard=msg.shard_idx,
                )  # fmt: skip
            self._touch(old)  # the same incarnation opening again (a retried open): same session
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
            self._fence(old, f"shard {msg.shard_idx} opened as a new incarnation")
            replica = None
            model = self.models.get(msg.model)  # it may have been dropped with the old replica
        if model is None:
            model = self.models[msg.model] = _Model(msg.model, msg.num_shards, msg.source)
            kept = self.bucket_memory.get(msg.model)
            if kept is not None and kept[0] == msg.num_shards:
                model.buckets = kept[1]  # the bucket copies declared before the model's record went
        if replica is None:
            replica = model.replicas.get(msg.replica)
            if replica is None:
                replica = model.replicas[msg.replica] = _Replica(msg.replica, model, msg.num_shards, msg.spot)
        s = _Session(next(self._ids), peer, model, replica, msg, self.clock())
        self.sessions[s.id] = s
        self.by_slot[slot] = s
        self.reign.slot_changes += 1
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
        if model.delta_of is not None:  # a delta model's layouts are per version (see .deltas)
            s.set_layout(msg.layout)
            s.endpoint = msg.endpoint
            s.grant_key = msg.grant_key
            self._ack(s, msg.req)
            return
        known = model.layouts.get(s.shard_idx)
        if known is not None and known[0] != msg.layout:
            raise LayoutMismatch(_layout_diff(known[0], msg.layout), **s.ctx())
        if model.source is not None and msg.placements is None:
            raise InvalidPlacement(
                f"a shard of a model converted from {model.source!r} must register its tensors' placements", **s.ctx()
            )
        placed = model.placements.get(s.shard_idx)
        if known is not None and placed != msg.placements:
            raise LayoutMismatch(_placement_diff(placed, msg.placements), **s.ctx())
        model.layouts[s.shard_idx] = (msg.layout, (known[1] if known else 0) + 1)
        model.placements[s.shard_idx] = msg.placements
        s.set_layout(msg.layout)
        s.endpoint = msg.endpoint
        s.grant_key = msg.grant_key
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
        if model.delta_of is not None:
            s.set_layout(None)
            return
        layout, users = model.layouts[s.shard_idx]
        if users <= 1:
            del model.layouts[s.shard_idx]
            model.placements.pop(s.shard_idx, None)
        else:
            model.layouts[s.shard_idx] = (layout, users - 1)
        s.set_layout(None)

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
            self.reign.slot_changes += 1
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
        err = error(f"replica removed: {reason}", model=replica.model.name, replica=replica.name)
        for txn in list(replica.txns.values()):
            self._drop_removed(txn, err)
        replica.model.waits = [w for w in replica.model.waits if w[0].replica is not replica]
        for s in list(replica.shards.values()):
            self._send(s, m.Removed(s.id, error.code, err.message))
            self._end_session(s, fenced_code=error.code)

    def _drop_removed(self, txn: _Txn, err: TensorHubError) -> None:
        """Drop ``txn`` of a replica being removed: every live shard's call not yet answered gets
        ``err`` at once (no unpublishing: the shards are going)."""
        txn.error = txn.error or err
        for call in txn.shards.values():
            if not call.done and call.session.id in self.sessions:
                self._reply_error(call, err)
                call.done = True
        self._drop_txn(txn)

    def _fence(self, old: _Session, reason: str) -> None:
        """A new incarnation of ``old``'s shard opened: remove the old incarnation of the replica.

        Incarnations are per shard, so the table tells the old incarnation's shards from the
        new one's by time: the shards that opened after ``old`` was last heard from (its process
        had died by then) are the restarted replica's own, opened before this one; they stay.
        Every other shard of the replica, ``old`` included, goes with its holdings and calls, as
        in any removal of a replica; when none stays, that is the whole replica."""
        replica = old.replica
        heard = old.last_seen
        stale = [s for s in replica.shards.values() if s.opened <= heard]
        if len(stale) == len(replica.shards):
            self._remove_replica(replica, Fenced, reason)
            return
        err = Fenced(f"replica removed: {reason}", model=replica.model.name, replica=replica.name)
        gone = {s.id for s in stale}
        for txn in list(replica.txns.values()):
            mine = {idx: call for idx, call in txn.shards.items() if call.session.id in gone}
            if not mine:
                continue
            if len(mine) == len(txn.shards) or txn.decided:  # the old incarnation's call (or one it decided)
                self._drop_removed(txn, err)
            else:  # undecided, joined by the new incarnation: it goes on without the old shards
                for idx, call in mine.items():
                    del txn.shards[idx]
                    txn.consumed.pop(idx, None)
        live_txns = set(map(id, replica.txns.values()))
        replica.model.waits = [w for w in replica.model.waits
                               if w[0].replica is not replica or (id(w[0]) in live_txns and w[1].session.id not in gone)]
        for s in stale:
            self._send(s, m.Removed(s.id, Fenced.code, err.message))
            self._end_session(s, fenced_code=Fenced.code)

    def _on_heartbeat(self, peer: Hashable, msg: m.Heartbeat) -> None:
        now = self.clock()
        unknown = []
        for sid in msg.sessions:
            s = self.sessions.get(sid)
            if s is None or s.peer != peer:  # a session another connection opened is not kept alive from here
                unknown.append(sid)
                continue
            s.last_seen = now
            self.expiry.move_to_end(sid)
        # the term says which start of the server answered (a client that sees it change knows the
        # server restarted, even when no silence said so); a reigning rule adds its stamp and lease
        self._out.append((peer, m.HeartbeatAck(msg.req, tuple(unknown), term=self.term)))


def _layout_diff(known: Layout, got: Layout) -> str:
    if len(known.tensors) != len(got.tensors):
        return f"layout has {len(got.tensors)} tensors; other holders of this shard have {len(known.tensors)}"
    for a, b in zip(known.tensors, got.tensors):
        if a != b:
            return f"tensor {b.name!r} ({b.dtype}{list(b.shape)}) differs from {a.name!r} ({a.dtype}{list(a.shape)})"
    if known.checksum != got.checksum:
        return (f"checksum algorithm {got.checksum!r} differs from other holders' {known.checksum!r} "
                f"(register(..., checksum={known.checksum!r}) to join them)")  # fmt: skip
    return "layout parameters (chunk size, pack threshold) differ from other holders of this shard"


def _placement_diff(known: tuple[PlacedTensor, ...] | None, got: tuple[PlacedTensor, ...] | None) -> str:
    """What differs between two registrations' placements (same layout), for LayoutMismatch."""
    if known is None or got is None:
        which = "without" if known is None else "with"
        return f"this shard's holders registered {which} placements; this registration {'has' if got else 'has none'}"
    for a, b in zip(known, got):
        if a != b:
            return f"tensor {a.name!r}: placement {a.placement} at {a.coord}; this registration says {b.placement} at {b.coord}"
    return "placements differ"
