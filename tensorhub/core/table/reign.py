"""The no-split-brain rule (:class:`Reign`): whether a server may decide now, sans-IO.

The table holds one (``ReferenceTable.reign``) and applies it through
:class:`~tensorhub.core.table.failover.ReignMixin`; the server actor makes one per its role.
This module imports neither the table nor a concern of it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Hashable, Iterable

from .. import messages as m

ROLES = ("solo", "primary", "backup")
_DRIFT = 0.02  # the primary counts its lease this much shorter: clock rates may differ a little
_REQUESTS_KEPT = 64  # lease requests whose send time the primary remembers
_SPANS_KEPT = 64  # reigns remembered (for the cluster state and the partition harness)
_DROPPED_KEPT = 65536  # session ids remembered after a step-down (answered with StepDown)
#: the primary's eager lease requests (a membership change, its first) are at least this much of
#: a lease apart, and at most _EAGER_GAP_MAX s: a storm of opens ships its slots a few times a
#: second, not once per open
_EAGER_GAP = 1 / 25
_EAGER_GAP_MAX = 0.1


class Reign:
    """Whether this server may decide now: the no-split-brain rule, sans-IO.

    Theory of operation
    -------------------
    A job may run a *primary* and a *backup* server (a server alone is ``solo`` and always
    reigns). A server **reigns** (decides anything: answers calls, grants, revokes) only while
    it holds one of:

    1. *the lease* (primary only): the backup's promise not to reign. The primary asks every
       ``lease / 5`` s (:class:`~tensorhub.core.messages.LeaseRequest`), and at once when its
       sessions' slots changed (see 2.) or it has not heard the backup yet; the backup, which
       always yields to the primary (if it reigns, it steps down first: "clients move back to
       the primary when it returns"), promises not to reign until ``lease`` s after the request
       *arrived*; the primary counts the lease from when it *sent* the request, shortened by
       ``_DRIFT``, so it always ends first.
    2. *a majority of the voters*: the shard slots (``model/replica/shard``) of the last
       membership both servers hold. The primary ships its sessions' slots with its lease
       requests (one change outstanding at a time, numbered by ``epoch``), sending one as soon
       as the slots changed (:meth:`eager_at`: coalesced, the next once the last is answered, and
       at most one per ``min(lease / 25, 0.1)`` s), so that a backup knows the voters a round trip
       after an open, not up to a fifth of a lease later (a primary killed in between left a
       backup that could never decide); a change counts once
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
    term, so nothing it granted before is honoured by it again.

    A primary whose lease ran out (and its majority with it: it stood still past its lease, or
    lost the backup's replies) first **holds** instead: it stops deciding at once but keeps its
    state and says nothing to its sessions, and waits for the backup's word: at most two leases
    of its own running time (a stall of its process is not counted, as for heartbeats). The backup's
    ``LeaseReply`` says how many reigns the backup has begun (``reigns``, with its
    ``term``: a restarted backup counts from 0 under another term). A granted reply whose count
    is the one the primary last had before it held means the backup began no reign in between:
    nobody else decided, and the promise covers the primary from the reply on, so it reigns
    again with its sessions and its term. A reply that differs (the backup reigned: clients may
    hold its grants), one that does not say (a backup of an earlier release), or no granted
    reply in that time, and the primary steps down as above. A majority of votes alone
    does not end the hold: it says nothing about whether the backup reigned meanwhile. While it
    holds, the table decides nothing, time-driven decisions included (they come due once it
    reigns again), and neither does a session message: a close, or an open of a new incarnation
    of an open shard (it would fence the old one), is refused with ``ServerUnavailable``.

    A server that does not reign accepts sessions (open, register, announce, heartbeats: votes)
    and refuses every call with ``ServerUnavailable``.

    What it costs: a backup takes over ``lease`` after a majority of the voters reached it; a
    server with a peer that never held the lease (a primary started while its backup is down,
    or restarted while its backup is unreachable) knows no membership and does not reign until
    it reaches the backup; a membership frozen while the backup is down loses its majority if
    most of its voters go away meanwhile.
    """

    __slots__ = (
        "role", "lease", "lease_until", "promised_until", "epoch", "voters", "pending", "votes", "requests",
        "dropped", "spans", "reigning", "violations", "synced", "peer_epoch", "owner", "_majority_until", "_why",
        "begun", "peer_reigns", "held_since", "held_for", "confirmed", "denied", "shipped", "last_sent",
        "unsent_last", "slot_changes",
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
        self.votes: dict[int, list[Any]] = {}  # session id -> [slot, counts from, counts until]
        self.owner: dict[int, Hashable] = {}  # session id -> the connection that opened it
        self.requests: OrderedDict[int, float] = OrderedDict()  # primary: lease request req -> sent at
        self.dropped: OrderedDict[int, None] = OrderedDict()  # session ids dropped by a step-down
        #: reigns, oldest first: [term, start, end, first grant, last grant, grants]
        self.spans: deque[list[Any]] = deque(maxlen=_SPANS_KEPT)
        self.reigning = False
        self.violations = 0  # grants made while not reigning (never, by construction)
        self._majority_until: float | None = None  # a majority holds until then (cached)
        self._why = "not evaluated yet"
        self.begun = 0  # reigns this server began (a backup says so in each LeaseReply)
        self.peer_reigns: tuple[int, int] | None = None  # primary: the backup's (term, reigns), last reply
        self.held_since: float | None = None  # primary: its lease ran out; holding its state since
        self.held_for: tuple[int, int] | None = None  # the backup's (term, reigns) when it began to hold
        self.confirmed = False  # holding: a granted reply said the backup began no reign since
        self.denied = False  # holding: a reply said it did (or could not say)
        #: how many times the table added a slot to its sessions or took one away (kept here, not
        #: on the table: a table attribute more costs every message; see :meth:`eager_at`)
        self.slot_changes = 0
        self.shipped = -1  # primary: slot_changes when it last built a lease request
        self.last_sent = float("-inf")  # primary: when it last tried to send one (sent or not)
        self.unsent_last = False  # primary: the last one could not be sent (the backup is not connected)

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
        held_until = self.held_since + self.hold_limit if self.held_since is not None else None
        times = [t for t in (self.lease_until, self.promised_until, self._majority_until, held_until) if t is not None and t > now]
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

    def lease_request(self, req: int, now: float, term: int, slots: tuple[str, ...], changes: int = -1) -> m.LeaseRequest:
        """The next lease request (with the membership ``slots`` when it changed). ``changes``:
        the table's count of slot changes that ``slots`` reflects (see :meth:`eager_at`)."""
        self.requests[req] = now
        self.last_sent = now
        self.unsent_last = False
        while len(self.requests) > _REQUESTS_KEPT:
            self.requests.popitem(last=False)
        if not self.synced:  # first learn which membership the backup holds: epochs are numbered on
            return m.LeaseRequest(req, term, 0, None)  # from there, never reused
        if self.pending is None:  # the slots of these changes are compared (and shipped if they differ)
            self.shipped = changes  # (not while an older change is on its way: they go after it)
            if slots != self.voters or self.peer_epoch != self.epoch:
                self.pending = (self.epoch + 1, slots)
                self._majority_until = None
        if self.pending is not None:
            return m.LeaseRequest(req, term, self.pending[0], self.pending[1])
        return m.LeaseRequest(req, term, self.epoch, None)

    def unsent(self, req: int) -> None:
        """Lease request ``req`` could not be sent (the backup is not connected): no answer is
        awaited for it. The next eager one waits the gap until the primary first heard the
        backup, then a fifth of a lease, the periodic requests' pace (:meth:`eager_at`)."""
        self.requests.pop(req, None)
        self.unsent_last = True

    def eager_at(self, now: float, changes: int) -> float | None:
        """When the primary should send a lease request ahead of its periodic ones (None: the
        ticks suffice): it has not learned the backup's membership yet, or its sessions' slots
        changed (``changes``: the table's count of slot changes) or the backup holds another
        epoch, and no change is on its way. Coalesced: nothing while the latest request awaits
        its answer (for a fifth of a lease: then the ticks carry on), and each at least
        ``min(lease / 25, 0.1)`` s after the one before."""
        if self.role != "primary":
            return None
        if self.synced and self.pending is None and changes == self.shipped and self.peer_epoch == self.epoch:
            return None  # nothing new for the backup
        if self.requests and not self.unsent_last:
            sent = self.requests[next(reversed(self.requests))]
            if now - sent < self.lease / 5:
                return None  # its answer is awaited, and with it the next look (see on_reply)
        if self.unsent_last and self.synced:
            return max(now, self.last_sent + self.lease / 5)  # the backup went away: no faster than the ticks
        return max(now, self.last_sent + min(self.lease * _EAGER_GAP, _EAGER_GAP_MAX))

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
        seen = (msg.term, msg.reigns) if msg.reigns is not None else None
        if self.held_since is not None:
            if seen is None or seen != self.held_for:
                self.denied = True  # the backup reigned meanwhile, or cannot say
            elif msg.granted:
                self.confirmed = True
        self.peer_reigns = seen
        if msg.granted:
            self.lease_until = max(self.lease_until, sent + min(msg.lease, self.lease) * (1 - _DRIFT))

    def hold(self, now: float) -> None:
        """The primary's reign ran out: stop deciding, keep the state, wait for the backup's word
        (see the class docstring)."""
        self.ended(now)
        self.held_since, self.held_for = now, self.peer_reigns
        self.confirmed = self.denied = False
        self._why = (f"its lease ran out ({self.why_not()}); it holds its sessions until the backup says whether it "
                     f"reigned meanwhile (at most {self.hold_limit:g} s)")  # fmt: skip

    def held_verdict(self, now: float) -> str | None:
        """While holding: ``"resume"`` (the backup began no reign since, and its promise holds
        now), ``"forget"`` (it did, or cannot say, or said nothing in time), None (wait)."""
        if self.held_since is None:
            return None
        if self.denied or now >= self.held_since + self.hold_limit:
            return "forget"
        if self.confirmed and now < self.lease_until:
            return "resume"
        return None

    @property
    def hold_limit(self) -> float:
        """How long a primary holds without the backup's word (its own running time: see
        :meth:`credit_hold`): two leases, ten of its lease requests."""
        return 2 * self.lease

    def credit_hold(self, seconds: float, now: float) -> None:
        """The server stood still ``seconds``: a lease reply that came meanwhile may still sit
        unread, so that time is not held against the backup."""
        if self.held_since is not None and seconds > 0:
            self.held_since = min(self.held_since + seconds, now)

    def release(self) -> None:
        self.held_since = self.held_for = None
        self.confirmed = self.denied = False

    # ---- the backup's side -------------------------------------------------------------------

    def on_request(self, msg: m.LeaseRequest, now: float, term: int) -> m.LeaseReply:
        """Promise the primary not to reign for ``lease`` s from ``now``; keep its membership."""
        if msg.voters is not None and msg.epoch > self.epoch:
            self.epoch, self.voters = msg.epoch, msg.voters
            self._majority_until = None
        self.promised_until = max(self.promised_until, now + self.lease)
        self._majority_until = None
        newer = self.voters if self.epoch > msg.epoch else None
        return m.LeaseReply(msg.req, term, True, self.lease, self.epoch, newer, self.begun)

    # ---- bookkeeping -------------------------------------------------------------------------

    def began(self, term: int, now: float) -> None:
        self.reigning = True
        self.begun += 1
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
