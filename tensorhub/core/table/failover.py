"""Failover: a new server rebuilding the table from what its clients re-announce.

Theory of operation
-------------------
What it owns: the grace period after the server starts (``grace_until``, a heartbeat timeout;
while :attr:`in_grace`, a version or source that is missing makes calls wait instead of fail,
and its end is applied in :meth:`~tensorhub.core.table.ReferenceTable.tick`); each shard's
re-announcement (its complete and offload holdings, a partial pull, and the answers it last got
for model-parallel calls); and a replica's own announce window (``announce_until``), for a
server that was up long before the failover.

Invariants: a re-announced holding is admitted only if its checksums agree with the version's
(the others are dropped and reported with ``VersionConflict``); the answer one shard announces
for a call is the answer its siblings get; calls at or below a shard's last answered one count
as consumed for it; once one shard of a replica has announced, the replica decides no new call
until all its shards have, or the grace period or its window ends.

What it must never do: fail a pull for want of a source during the grace period, or accept an
announcement from a shard that already holds something (it comes right after open and register).
"""

from __future__ import annotations

from typing import Hashable

from .. import messages as m
from ..errors import ContractViolation, NotRegistered, TensorHubError, VersionConflict, error_from_wire
from ..lifecycle import Event
from .records import _AnnouncedArgs, _Replica, _Txn


class FailoverMixin:
    """The grace period and re-announcements. Mixed into
    :class:`~tensorhub.core.table.ReferenceTable`, whose ``__init__`` sets up the state it uses."""

    @property
    def in_grace(self) -> bool:
        return self.grace_until is not None

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
