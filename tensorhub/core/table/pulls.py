"""Pulls: ``replicate`` and ``update``: which version a replica moves to, then moving each shard.

Theory of operation
-------------------
What it owns: resolving a version spec against the available versions (``None``: wait, it may
still come; ``VersionUnavailable``: it existed and is gone, or can never exist); the decision the
first shard makes for the replica (replicate waits for its version; update never waits, and may
not move); the cross-datacenter policy of update (smart skipping, offload seeding, DESIGN §5.6);
and advancing each shard: unpublish what it holds, start a partial holder and have it granted a
source, answer once every shard holds the version.

Invariants: a call is decided once, and after a failover only when the replica's shards have
all re-announced (or the grace period ended); a call made again after a failover, whose shards
re-announced a partial pull of a version still available, is decided for that version (the
pull resumes from what it verified). ``Replicated`` and a moving ``Updated`` are sent
only when every shard of the replica holds the version completely; an update that does not move
answers at once with what is held, and with what it skipped or is to seed.

What it must never do: have a call wait, outside the grace period, for a version that existed
and is gone.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

from .. import messages as m
from ..errors import InBucket, NotRegistered, TensorHubError, VersionUnavailable
from ..lifecycle import Event
from ..naming import VersionSpec, parse_version_spec, seed_owner
from .records import C, P, CallState, _all_done, _Model, _named, _seed_name, _Session, _ShardCall, _Txn
from .state import TableState


def _then(step: Callable[[_Txn, _ShardCall], None], txn: _Txn, call: _ShardCall) -> Callable[[], None]:
    """``step(txn, call)``, later. A closure made here, not in the hot caller: a lambda in a
    method makes cells of the variables it captures on every call of that method."""
    return lambda: step(txn, call)


_OPEN, _MOVING = CallState.OPEN, CallState.MOVING


class PullMixin(TableState):
    """Replicate and update. Mixed into :class:`~tensorhub.core.table.ReferenceTable`. State
    (:class:`~tensorhub.core.table.state.TableState`): ``clock``, ``config``, ``sessions``,
    ``stats``."""

    def _resolve(self, model: _Model, spec: VersionSpec, ctx: dict[str, Any]) -> int | None:
        """The absolute version ``spec`` names now, or None to wait for it.

        Raises:
            VersionUnavailable: it existed and is gone, or it can never exist.
        """
        if model.source is not None:
            return self._resolve_converted(model, spec, ctx)
        v = _named(spec, model.available[-1] if model.available else None, ctx)
        if v is None:
            return None
        ver = model.versions.get(v)
        if ver is not None and ver.available:
            return v
        if self.in_grace:
            return None
        url = self._bucket_holds(model, v)
        if url is not None:  # the source of last resort, also once no holder of it is left
            raise InBucket(f"version {v} has no live holder; the bucket at {url} holds it", bucket=url, **{**ctx, "version": v})
        if ver is not None and ver.ever_available:
            raise VersionUnavailable(f"version {v} is gone: no live holder has every shard", **{**ctx, "version": v})
        return None

    def _on_pull(self, peer: Hashable, msg: m.Replicate | m.Update) -> None:
        """``replicate`` and ``update``: one transaction per call number, then each shard pulls."""
        s = self._session(peer, msg.session)
        raw = msg.spec
        spec = parse_version_spec(raw)
        # the canonical form of the spec, which every shard's call n must repeat (an int is its own)
        args = raw if type(raw) is int else spec.wire()
        txn, call = self._join(s, msg.req, msg.call, "replicate" if isinstance(msg, m.Replicate) else "update", args)
        if isinstance(msg, m.Replicate):
            call.held = msg.held
        elif txn.state is _OPEN:
            txn.offload_seed = msg.offload_seed
            txn.deltas = msg.deltas
        if msg.timeout is not None:
            self._set_deadline(txn, msg.timeout)
        self._advance(txn, call)

    def _decide(self, txn: _Txn, s: _Session) -> None:
        """First shard to reach an undecided replicate/update decides for the replica."""
        model = s.model
        spec = parse_version_spec(txn.args)
        ctx = s.ctx()
        resumed = self._resumed(txn, spec)
        if resumed is not None:  # made again after a failover: go on with the pull it announced
            txn.version, txn.moved, txn.waiting, txn.decided = resumed, True, False, True
            self._pin(txn)
            return
        if txn.kind == "replicate":
            try:
                v = self._resolve(model, spec, ctx)
            except InBucket as err:
                # Made again with what a restore from the bucket verified: take that claim.
                call = txn.shards.get(s.shard_idx)
                assert err.version is not None
                if call is None or call.held is None or call.held != self._known_checksums(model, err.version, s.shard_idx):
                    raise
                v = err.version
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
            if moves and v is not None and txn.deltas and self._plan_deltas(txn, v):
                moves = False  # the replica applies a chain of deltas instead (see .deltas)
                if self._delta_seeding_allows(txn, s):
                    self.stats["delta_plans"] += 1
                else:  # a replica of its datacenter is pulling the chain across: next time, from it
                    txn.delta_plan = None
                    self._skip(txn, v)
            elif moves and v is not None and txn.deltas and self._delta_coming(txn, v):
                moves = self._skip(txn, v)  # its delta is on its way: ask again shortly
            elif moves and v is not None:
                moves = self._seeding_allows(txn, s, v)
            txn.version, txn.moved = (v if moves else held), moves
        txn.waiting = False
        txn.decided = True
        if txn.moved:
            self._pin(txn)  # its sources stay until it is answered (see .pins)

    def _resumed(self, txn: _Txn, spec: VersionSpec) -> int | None:
        """The version a replica's shards re-announced as a partial pull (after a failover),
        if they agree on one, it is still available and ``spec`` allows it."""
        found = {
            sh.holder.version for sh in txn.replica.shards.values()
            if sh.holder is not None and sh.holder.state is P and sh.holder.call is None
        }  # fmt: skip
        if len(found) != 1:
            return None
        (v,) = found
        ver = txn.replica.model.versions.get(v)
        if ver is None or not ver.available or not (spec.relative or spec.version == v):
            return None
        return v

    def _seeding_allows(self, txn: _Txn, s: _Session, v: int) -> bool:
        """Cross-datacenter policy for an ``update`` that would move to ``v`` (DESIGN §5.6).

        Where every shard of ``v`` has a whole holder in the reader's datacenter, or the table
        does not skip (no pipelining, or skipping off), it moves. Where a replica of the
        datacenter is seeding ``v`` (some shard has only partial holders there, or a replica
        was told to offload-seed it and its pull has not shown up yet), it does not (smart
        skipping: ``txn.skipped``), and so it does where a replica of the datacenter is landing
        ``v`` through deltas (it holds or pulls a delta to ``v``: :mod:`.deltas`). Where nobody
        there has any shard of ``v``, this replica is
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
        if self._delta_seeding(model, v, dc):
            return self._skip(txn, v)  # a replica here is landing v through deltas: pull it from it next
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
        if txn.state is _OPEN:  # not decided
            if self._awaiting_announcements(txn.replica):
                txn.waiting = True
                s.model.parked[txn] = None
                return
            try:
                self._decide(txn, s)
            except TensorHubError as err:
                self._fail_txn(txn, err)
                return
            if txn.state is _OPEN:
                return  # parked: re-run when versions change
        if txn.state is not _MOVING and txn.kind == "update":  # an update that does not move
            plan = txn.delta_plan
            deltas, target = (plan[1].get(s.shard_idx), plan[0]) if plan is not None else (None, None)
            self._finish_call(txn, call, m.Updated(call.req, False, txn.version, txn.skipped, txn.seed, deltas, target))
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
            self._unpublish(h, _then(self._advance, txn, call))
            return
        if call.held is not None and self._holds_already(s, v, call.held):  # a delta chain applied in place, or a bucket restore (see .deltas)
            h = s.holder = self._new_holder(s, v, m.KIND_NORMAL, Event.PUBLISH)
            if s.model.versions[v].checksums.get(s.shard_idx) is None:
                self._set_checksums(h, call.held)  # known from the bucket copy only: the version's again
            h.checksums = call.held
            self._maybe_answer(txn)
            return
        if s.model.delta_of is not None:  # a reader of a delta model pulls one version's blob
            try:
                self._check_delta_layout(s, v)
            except TensorHubError as err:
                self._fail_txn(txn, err)
                return
        h = s.holder = self._new_holder(s, v, m.KIND_NORMAL, Event.GRANT)
        h.call = (txn, s.shard_idx)
        ver = s.model.versions[v]
        h.checksums = ver.checksums.get(s.shard_idx)
        self._regrant(h)

    def _maybe_answer(self, txn: _Txn) -> None:
        v = txn.version
        if txn.error is not None or v is None or not _all_done(txn):
            return
        self._unpin(txn)
        for call in list(txn.shards.values()):
            reply = m.Replicated(call.req, v) if txn.kind == "replicate" else m.Updated(call.req, True, v)
            self._finish_call(txn, call, reply)

