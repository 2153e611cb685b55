"""Settling: the consequences of an event, applied once after every ``handle`` and ``tick``.

Theory of operation
-------------------
What it owns: the work that transitions mark as due (``_mark_dirty``, the model's
``dirty_shards`` and its ``changed``, ``availability_changed``, ``retention_changed`` and
``gc_needed`` flags): failing partial holders that can no longer finish, re-granting readers
parked without a source, releasing offload copies no longer needed, bumping the listing epoch
and answering wait long-polls, waking calls parked for a version, moving pinned calls that
landed nothing to a newer version (:mod:`.pins`), and forgetting the versions
and models nothing refers to any more.

Invariants: settling repeats until no model is dirty (a bound turns a livelock into an error);
a version that was available is remembered, so that asking for it raises instead of waiting,
unless it is ``_GONE_MEMORY`` below the highest published; a model is dropped only when no
replica, declaration or holder is left.

What it must never do: fail a partial holder during the grace period, or run in the middle of a
handler (handlers only mark; settling runs after them).
"""

from __future__ import annotations

from .records import _GONE_MEMORY, O, P, _Model
from .state import TableState


class SettleMixin(TableState):
    """What follows from an event, once it is handled. Mixed into
    :class:`~tensorhub.core.table.ReferenceTable`. State
    (:class:`~tensorhub.core.table.state.TableState`): ``models``, ``_dirty_models``, ``reign``."""

    def _settle(self) -> None:
        """After every event: fail partial holders whose (version, shard) has nothing left to
        pull from, release offload copies no longer needed, bump the listing epoch and answer
        long-polls, and wake calls waiting for a version. A primary holding its state (its lease
        ran out; see :class:`~tensorhub.core.table.reign.Reign`) settles nothing: the models stay
        dirty until it reigns again (then every model is settled) or forgets them."""
        if self.reign.held_since is not None:
            return
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
            # loops, not comprehensions: those would make v and i cells on every call
            if not ver.serving[i] and not self.in_grace:
                gone = []
                for h in holders.values():
                    if h.state is P and not self._viable(h):
                        gone.append(h)
                for h in gone:
                    if h.state is P:
                        self._source_gone(h)
            if model.waiting_readers:
                found = []
                for h in model.waiting_readers:
                    if h.version == v and h.shard_idx == i:
                        found.append(h)
                for h in found:
                    self._regrant(h)
            if model.offload_holders:
                found = []
                for h in model.offload_holders.values():
                    if h.version == v and h.shard_idx == i:
                        found.append(h)
                for h in found:
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
            self._redecide(model)
            for x in self._converted_models(model):  # their versions are this model's too
                self._wake_parked(x)
                self._regrant_waiting(x)
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
