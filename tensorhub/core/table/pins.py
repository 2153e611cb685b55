"""Pins: a replicate/update in flight keeps the version it decided, and moves to a newer one
while nothing of it has landed.

Theory of operation
-------------------
In asynchronous RL the trainer publishes faster than rollouts pull: an ``update("latest")`` decides
``v``, and before every shard of the replica has a source the trainer publishes ``v+1``, ``v`` stops
being retained, its last copy (the trainer's offload copy) is released, and the update would fail
with every shard left empty, exactly when the trainer is fastest.

What it owns: one **pin** per replicate/update transaction that has decided to move to a version,
from that decision until the call is answered (every shard holds the version), fails, or is
dropped with its replica, bounded by ``TableConfig.pin_timeout`` after the decision. While a
version is pinned, an offload copy of it is not released (``_Model.kept``), and, in a model
that keeps CPU copies at all (some replica declared retention), the last non-spot complete copy
of it is offloaded before its owner unpublishes it, as for a retained version
(``_Model.offloads``). In a model without retention a pin makes no copy: the holder's unpublish
drains the grants it has, as before. That is the whole cost: at most one CPU copy of each
pinned (version, shard), the trainer's offload copy (or the one it makes when it unpublishes),
held by the client that unpublished the last copy, for as long as the pin lasts. Retention,
listings and version resolution are unchanged for every other call.

**Re-deciding.** When a newer version becomes available and a pinned call resolves to it (its
spec is relative: ``"latest"``, ``"latest-k"``) while none of its shards has verified a byte of the
pinned version (and none holds it whole), the call moves to the newer version instead: its
partial holdings of the old one are aborted (they hold nothing), the pin moves, and each shard
advances as if the call had decided the newer version first. An update whose target datacenter
is still seeding the newer version (smart skipping, DESIGN §5.6) keeps its pin.

Invariants (checked by :func:`tensorhub.core.invariants.check_invariants`): a pin belongs to a
live, decided, moving replicate/update transaction with no error, on exactly the version that
transaction decided, with a deadline; a transaction pins at most one version.

What it must never do: re-decide a call after any of its shards has verified bytes of the pinned
version, keep a pin past its deadline, or change what other calls resolve to.
"""

from __future__ import annotations

from ..errors import TensorHubError
from ..naming import parse_version_spec
from .records import C, P, _Model, _Txn
from .state import TableState


class PinMixin(TableState):
    """Pins and re-decisions. Mixed into :class:`~tensorhub.core.table.ReferenceTable`. State
    (:class:`~tensorhub.core.table.state.TableState`): ``clock``, ``config``, ``stats``."""

    def _pin(self, txn: _Txn) -> None:
        """Pin the version ``txn`` decided to move to (for ``pin_timeout`` at most)."""
        assert txn.version is not None and txn.moved
        model = txn.replica.model
        model.pins.setdefault(txn.version, {})[txn] = None
        txn.pinned_until = self.clock() + self.config.pin_timeout
        self._timer(txn.pinned_until, "pin", txn)
        self.stats["pins"] += 1

    def _unpin(self, txn: _Txn) -> None:
        """Drop ``txn``'s pin, if it has one; the version's copies may be released again."""
        if txn.pinned_until is None:
            return
        txn.pinned_until = None
        model = txn.replica.model
        if txn.version is None:
            return
        pinned = model.pins.get(txn.version)
        if pinned is not None:
            pinned.pop(txn, None)
            if not pinned:
                del model.pins[txn.version]
                self._retention_moved(model)

    def _pin_expired(self, txn: _Txn, now: float) -> None:
        if txn.pinned_until is None or txn.pinned_until > now:
            return
        self.stats["pins_expired"] += 1
        self._unpin(txn)

    def _landed(self, txn: _Txn) -> bool:
        """Whether any shard of ``txn`` holds bytes of its version (verified, or whole)."""
        for call in txn.shards.values():
            h = call.session.holder
            if h is not None and h.version == txn.version and (h.state is C or (h.state is P and h.verified > 0)):
                return True
        return False

    def _redecide(self, model: _Model) -> None:
        """Move pinned relative calls that have landed nothing to the newest version they resolve to."""
        if not model.pins or not model.available:
            return
        newest = model.available[-1]
        for v in [v for v in model.pins if v < newest]:
            for txn in list(model.pins.get(v, ())):
                if txn.error is not None or txn.replica.txns.get(txn.n) is not txn:
                    continue
                try:
                    spec = parse_version_spec(txn.args)
                    if not spec.relative or self._landed(txn):
                        continue
                    target = self._resolve(model, spec, {"model": model.name, "replica": txn.replica.name})
                except TensorHubError:
                    continue
                if target is None or target <= v or not self._local_everywhere(txn, target):
                    continue
                self._move_pin(txn, target)

    def _local_everywhere(self, txn: _Txn, v: int) -> bool:
        """Every shard of ``v`` has a whole holder in the replica's datacenter (so re-deciding
        never starts a cross-datacenter pull that smart skipping would have avoided)."""
        sessions = [c.session for c in txn.shards.values()] or list(txn.replica.shards.values())
        if not sessions:
            return False
        dc = sessions[0].location.datacenter
        return all(index.in_datacenter(dc)[0] for index in txn.replica.model.versions[v].index)

    def _move_pin(self, txn: _Txn, v: int) -> None:
        old = txn.version
        self._unpin(txn)
        txn.version = v
        txn.source_replica = None
        self._pin(txn)
        self.stats["redecided"] += 1
        # Shards with a partial holding of the old version abort it (it holds nothing) and start
        # on the new one; the others have not reached it yet (their unpublish of what they held
        # is draining, or their call has not come): they advance to the new version by themselves.
        kick = []
        for call in txn.shards.values():
            h = call.session.holder
            if not call.done and h is not None and h.version == old and h.state is P:
                if h.call is not None and h.call[0] is txn:
                    h.call = None  # aborting the old holding must not fail the call
                kick.append(call)
        for call in kick:
            self._advance(txn, call)
