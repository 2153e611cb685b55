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

import dataclasses
import itertools
from collections import OrderedDict, deque
from typing import Any, Hashable, Iterable

from .. import messages as m
from ..errors import ContractViolation, NotRegistered, ServerUnavailable, TensorHubError, VersionConflict, error_from_wire
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
                if s.model.delta_of is not None and held.base is not None:
                    self._check_delta_publish(s, held.version, held.base)
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
            if held.kind == m.KIND_NORMAL:  # a delta's base and blob layout, as its publish recorded them
                self._record_delta(s, held.version, held.base, None)
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


# ---- the no-split-brain rule ------------------------------------------------------------------

ROLES = ("solo", "primary", "backup")
_DRIFT = 0.02  # the primary counts its lease this much shorter: clock rates may differ a little
_REQUESTS_KEPT = 64  # lease requests whose send time the primary remembers
_SPANS_KEPT = 64  # reigns remembered (for the cluster state and the partition harness)
_DROPPED_KEPT = 65536  # session ids remembered after a step-down (answered with StepDown)


class Reign:
    """Whether this server may decide now: the no-split-brain rule, sans-IO.

    Theory of operation
    -------------------
    A job may run a *primary* and a *backup* server (a server alone is ``solo`` and always
    reigns). A server **reigns** (decides anything: answers calls, grants, revokes) only while
    it holds one of:

    1. *the lease* (primary only): the backup's promise not to reign. The primary asks every
       ``lease / 5`` s (:class:`~tensorhub.core.messages.LeaseRequest`); the backup, which
       always yields to the primary (if it reigns, it steps down first: "clients move back to
       the primary when it returns"), promises not to reign until ``lease`` s after the request
       *arrived*; the primary counts the lease from when it *sent* the request, shortened by
       ``_DRIFT``, so it always ends first.
    2. *a majority of the voters*: the shard slots (``model/replica/shard``) of the last
       membership both servers hold. The primary ships its sessions' slots with its lease
       requests (one change outstanding at a time, numbered by ``epoch``); a change counts once
       the backup acknowledged it, and until then the primary needs a majority of both the old
       and the new membership; a primary that starts first learns the backup's membership and
       numbers its changes from there. While the servers cannot talk, the membership is frozen. A slot
       votes for the server its session heartbeats to (from the connection that opened it): each ``HeartbeatAck`` carries a stamp of
       the server's clock, the client echoes the latest in its next heartbeat (and forgets it
       when it moves), and the vote counts until stamp + ``lease``, but only from ``lease``
       after a heartbeat with no stamp of this server's (an arrival). A client that leaves a
       server received its last stamp there before it left, so that vote has ended before its
       new one counts; a process that crashed and came back elsewhere likewise (its
       predecessor's stamps are older than its first heartbeat).

    The backup additionally never reigns while its promise runs. So at any instant at most one
    server reigns: the lease excludes the backup, and two majorities of one membership share a
    voter, whose two votes never overlap in time. This needs bounded clock-rate drift (not
    synchronized clocks) and nothing about message delays: a late heartbeat carries an old stamp.

    A server that stops reigning **steps down**: every session is told ``StepDown`` (clients
    move to the next server of their list at once), and the table forgets its state under a new
    term, so nothing it granted before is honoured by it again. A server that does not reign
    accepts sessions (open, register, announce, heartbeats: votes) and refuses every call with
    ``ServerUnavailable``.

    What it costs: a backup takes over ``lease`` after a majority of the voters reached it; a
    server with a peer that never held the lease (a primary started while its backup is down,
    or restarted while its backup is unreachable) knows no membership and does not reign until
    it reaches the backup; a membership frozen while the backup is down loses its majority if
    most of its voters go away meanwhile.
    """

    __slots__ = (
        "role", "lease", "lease_until", "promised_until", "epoch", "voters", "pending", "votes", "requests",
        "dropped", "spans", "reigning", "violations", "synced", "peer_epoch", "owner", "_majority_until", "_why",
    )  # fmt: skip

    def __init__(self, role: str = "solo", lease: float = 5.0) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not 0 < lease <= 1e4:
            raise ValueError(f"lease must be in (0, 1e4] seconds, got {lease}")
        self.role = role
        self.lease = lease
        self.lease_until = float("-inf")  # primary: the backup's promise, as the primary counts it
        self.promised_until = float("-inf")  # backup: it may not reign before this
        self.epoch = 0  # the membership both hold (the primary: acknowledged)
        self.voters: tuple[str, ...] = ()
        self.pending: tuple[int, tuple[str, ...]] | None = None  # primary: sent, not acknowledged
        self.synced = False  # primary: it learned the backup's membership since it started
        self.peer_epoch = -1  # primary: the membership the backup said it holds
        #: session id -> [slot, first heartbeat here, vote valid until]
        self.votes: dict[int, list] = {}
        self.owner: dict[int, Hashable] = {}  # session id -> the connection that opened it
        self.requests: OrderedDict[int, float] = OrderedDict()  # primary: lease request req -> sent at
        self.dropped: OrderedDict[int, None] = OrderedDict()  # session ids dropped by a step-down
        #: reigns, oldest first: [term, start, end, first grant, last grant, grants]
        self.spans: deque[list] = deque(maxlen=_SPANS_KEPT)
        self.reigning = False
        self.violations = 0  # grants made while not reigning (never, by construction)
        self._majority_until: float | None = None  # a majority holds until then (cached)
        self._why = "not evaluated yet"

    # ---- the rule ----------------------------------------------------------------------------

    def may_reign(self, now: float) -> bool:
        """Whether the rule lets this server reign at ``now``."""
        if self.role == "solo":
            return True
        if self.role == "primary" and now < self.lease_until:
            return True
        if self.role == "backup" and now < self.promised_until:
            self._why = f"the backup promised the primary not to reign for {self.promised_until - now:.1f} s more"
            return False
        if self._majority_until is not None and now < self._majority_until:
            return True
        self._majority_until = self._majority(now)
        return self._majority_until is not None

    def why_not(self) -> str:
        return self._why

    def _majority(self, now: float) -> float | None:
        """Until when a majority of every membership that counts holds (None: none now)."""
        sets = [self.voters]
        if self.role == "primary" and self.pending is not None:
            sets.append(self.pending[1])
        fresh: dict[str, float] = {}
        for slot, since, until in self.votes.values():
            if since <= now < until and until > fresh.get(slot, now):
                fresh[slot] = until
        ends = []
        for voters in sets:
            if not voters:
                self._why = "no membership known yet (it comes from the primary while the two can talk)"
                return None
            need = len(voters) // 2 + 1
            untils = sorted(fresh[v] for v in voters if v in fresh)
            if len(untils) < need:
                self._why = f"{len(untils)} of {len(voters)} voters are with this server; a majority needs {need}"
                return None
            ends.append(untils[len(untils) - need])  # when the last vote it needs runs out
        return min(ends)

    def next_change(self, now: float) -> float | None:
        """When time alone may change :meth:`may_reign` (None: only messages can)."""
        times = [t for t in (self.lease_until, self.promised_until, self._majority_until) if t is not None and t > now]
        return min(times) if times else None

    # ---- votes -------------------------------------------------------------------------------

    def vote(self, sid: int, slot: str, now: float, stamp: float | None) -> None:
        """Session ``sid`` (shard ``slot``) heartbeated at ``now``, echoing this server's
        ``stamp`` (None: no stamp of this server's term: the client just came here, and
        forgets its stamps whenever it moves)."""
        v = self.votes.get(sid)
        if v is None or stamp is None:
            # An arrival (a client that comes from elsewhere echoes no stamp of ours first): its
            # votes count from a lease on, when whatever it voted elsewhere has run out.
            self.votes[sid] = [slot, now + self.lease, float("-inf")]
            self._majority_until = None
            return
        if stamp <= now:
            v[2] = max(v[2], stamp + self.lease)
        if self._majority_until is None:
            return  # no majority cached: the next check recounts
        if len(self.votes) > 4 * max(len(self.voters), 1) + 1024:
            self.votes = {k: x for k, x in self.votes.items() if x[2] > now}

    # ---- the primary's side ------------------------------------------------------------------

    def lease_request(self, req: int, now: float, term: int, slots: tuple[str, ...]) -> m.LeaseRequest:
        """The next lease request (with the membership ``slots`` when it changed)."""
        self.requests[req] = now
        while len(self.requests) > _REQUESTS_KEPT:
            self.requests.popitem(last=False)
        if not self.synced:  # first learn which membership the backup holds: epochs are numbered on
            return m.LeaseRequest(req, term, 0, None)  # from there, never reused
        if self.pending is None and (slots != self.voters or self.peer_epoch != self.epoch):
            self.pending = (self.epoch + 1, slots)
            self._majority_until = None
        if self.pending is not None:
            return m.LeaseRequest(req, term, self.pending[0], self.pending[1])
        return m.LeaseRequest(req, term, self.epoch, None)

    def on_reply(self, msg: m.LeaseReply) -> None:
        sent = self.requests.pop(msg.req, None)
        if sent is None:
            return  # not ours, or too late to count from
        if not self.synced:
            if msg.epoch > self.epoch:  # what the backup holds (a restarted primary knows nothing)
                self.epoch, self.voters = msg.epoch, msg.voters or ()
            self.synced = True
            self._majority_until = None
        elif self.pending is not None and msg.epoch >= self.pending[0]:
            self.epoch, self.voters = self.pending
            self.pending = None
            self._majority_until = None
        self.peer_epoch = msg.epoch
        if msg.granted:
            self.lease_until = max(self.lease_until, sent + min(msg.lease, self.lease) * (1 - _DRIFT))

    # ---- the backup's side -------------------------------------------------------------------

    def on_request(self, msg: m.LeaseRequest, now: float, term: int) -> m.LeaseReply:
        """Promise the primary not to reign for ``lease`` s from ``now``; keep its membership."""
        if msg.voters is not None and msg.epoch > self.epoch:
            self.epoch, self.voters = msg.epoch, msg.voters
            self._majority_until = None
        self.promised_until = max(self.promised_until, now + self.lease)
        self._majority_until = None
        newer = self.voters if self.epoch > msg.epoch else None
        return m.LeaseReply(msg.req, term, True, self.lease, self.epoch, newer)

    # ---- bookkeeping -------------------------------------------------------------------------

    def began(self, term: int, now: float) -> None:
        self.reigning = True
        self.spans.append([term, now, None, None, None, 0])

    def ended(self, now: float) -> None:
        self.reigning = False
        if self.spans and self.spans[-1][2] is None:
            self.spans[-1][2] = now

    def granted(self, now: float, n: int) -> None:
        span = self.spans[-1]
        if span[3] is None:
            span[3] = now
        span[4] = now
        span[5] += n

    def own(self, sid: int, peer: Hashable) -> None:
        """Session ``sid`` was opened (again) by connection ``peer``: only it votes for it."""
        if self.owner.get(sid) != peer:
            self.owner[sid] = peer
            self.votes.pop(sid, None)
            self._majority_until = None
        if len(self.owner) > 4 * max(len(self.voters), 1) + 1024:
            live = self.votes
            self.owner = {k: p for k, p in self.owner.items() if k in live or k == sid}

    def forget(self, sids: Iterable[int]) -> None:
        for sid in sids:
            self.dropped[sid] = None
            self.votes.pop(sid, None)
            self.owner.pop(sid, None)
        while len(self.dropped) > _DROPPED_KEPT:
            self.dropped.popitem(last=False)
        self._majority_until = None


#: What a server that does not reign still accepts: what builds sessions (and carries votes).
_SESSION_KINDS = (
    m.OpenShard, m.Register, m.Unregister, m.Announce, m.Heartbeat, m.CloseShard, m.GetStatus, m.GetDag,
    m.LeaseRequest, m.LeaseReply,
)  # fmt: skip


class ReignMixin:
    """The no-split-brain rule applied to the table (see :class:`Reign`). Mixed into
    :class:`~tensorhub.core.table.ReferenceTable`, whose ``__init__`` sets ``reign``."""

    _voting: tuple[int, ...] = ()  # the sessions of the heartbeat being handled that may vote

    def _reign_gate(self, peer: Hashable, msg: Any) -> Any:
        """Before a message is handled: step down if the reign just ended; refuse a call while
        not reigning; answer a session a step-down dropped with ``StepDown``. Returns the
        message to handle (a heartbeat loses the dropped sessions)."""
        reign = self.reign
        if reign.role == "solo":
            return msg
        self._check_reign()
        if isinstance(msg, m.Heartbeat):
            sids: tuple = msg.sessions
        else:
            sid = getattr(msg, "session", None)
            sids = (sid,) if type(sid) is int else ()
        gone = [sid for sid in sids if sid in reign.dropped]
        for sid in gone:
            self._out.append((peer, m.StepDown(sid, self.term, "this server stepped down; move to another")))
        if gone:
            if not isinstance(msg, m.Heartbeat):
                raise ServerUnavailable("this server stepped down: the session is gone here; move to another server")
            msg = dataclasses.replace(msg, sessions=tuple(s for s in msg.sessions if s not in reign.dropped))
        if isinstance(msg, m.Heartbeat):
            # Only the connection that opened a session votes for it: a stale client naming a
            # session id that a restarted server gave someone else must not vote in its name.
            owner = reign.owner
            self._voting = tuple(sid for sid in msg.sessions if owner.get(sid) == peer)
        if not reign.reigning and not isinstance(msg, _SESSION_KINDS):
            raise ServerUnavailable(f"this server does not decide now: {reign.why_not()}")
        return msg

    def _reign_after(self, peer: Hashable, msg: Any, out: list) -> list:
        """After a message: record a heartbeat's votes, stamp heartbeat acks, count grants."""
        reign = self.reign
        now = self.clock()
        if reign.role != "solo":
            if isinstance(msg, m.OpenShard):
                for p, x in out:
                    if p == peer and isinstance(x, m.Opened) and x.req == msg.req:
                        reign.own(x.session, peer)
            elif isinstance(msg, m.Heartbeat):
                stamp = msg.stamp if msg.stamp_term == self.term and msg.stamp > 0 else None
                voting, self._voting = self._voting, ()
                for sid in voting:
                    s = self.sessions.get(sid)
                    if s is not None:
                        reign.vote(sid, f"{s.model.name}/{s.replica.name}/{s.shard_idx}", now, stamp)
            lease = reign.lease
            out = [
                (p, dataclasses.replace(x, term=self.term, stamp=now, lease=lease, reigning=reign.reigning))
                if isinstance(x, m.HeartbeatAck) else (p, x)
                for p, x in out
            ]  # fmt: skip
        self._count_grants(out, now)
        return out

    def _count_grants(self, out: list, now: float) -> None:
        n = sum(1 for _, x in out if isinstance(x, m.Grant))
        if n:
            if not self.reign.reigning:
                self.reign.violations += n  # the rule's own check: the tests want 0
            else:
                self.reign.granted(now, n)

    def _check_reign(self) -> None:
        """Apply the rule at ``clock()``: begin a reign, or step down from one."""
        reign = self.reign
        now = self.clock()
        may = reign.may_reign(now)
        if may and not reign.reigning:
            reign.began(self.term, now)
            # what waited for a decision may go on now
            for model in list(self.models.values()):
                model.availability_changed = True
                self._mark_dirty(model)
        elif not may and reign.reigning:
            self._step_down(reign.why_not())

    def _step_down(self, reason: str) -> None:
        """Stop deciding: tell every session to move, forget everything under a new term."""
        t: Any = self  # the table: its __init__ makes the state afresh
        reign = t.reign
        reign.ended(t.clock())
        out = t._out
        out.extend((s.peer, m.StepDown(s.id, t.term, reason[:500])) for s in t.sessions.values())
        reign.forget(list(t.sessions))
        # the counters and session ids go on (an id is never given twice by one server process)
        stats, by_link, next_id = t.stats, t.bytes_by_link, next(t._ids)
        type(t).__init__(t, t.clock, t.rng, t.config, t.term + 1, sources=t.sources, reign=reign)
        t.stats, t.bytes_by_link, t._ids = stats, by_link, itertools.count(next_id)
        t._out = out

    def _on_lease_request(self, peer: Hashable, msg: m.LeaseRequest) -> None:
        reign = self.reign
        if reign.role != "backup":
            raise ContractViolation(f"a lease request reached a server whose role is {reign.role}, not backup")
        reply = reign.on_request(msg, self.clock(), self.term)
        self._check_reign()  # the primary is back: step down (clients move back to it)
        self._out.append((peer, reply))

    def _on_lease_reply(self, peer: Hashable, msg: m.LeaseReply) -> None:
        if self.reign.role != "primary":
            raise ContractViolation(f"a lease reply reached a server whose role is {self.reign.role}, not primary")
        self.reign.on_reply(msg)
        self._check_reign()

    def lease_request(self, req: int) -> m.LeaseRequest:
        """The primary's next request to its backup (the server actor sends it)."""
        slots = tuple(sorted(f"{model}/{replica}/{shard}" for model, replica, shard in self.by_slot))
        return self.reign.lease_request(req, self.clock(), self.term, slots)
