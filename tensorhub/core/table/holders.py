"""Holders: every change of a holder's state, the counts kept in step with it, and the abrupt ends.

Theory of operation
-------------------
What it owns: making holders (``_new_holder``), applying lifecycle events (``_fire``, through
:func:`tensorhub.core.lifecycle.transition`), and the accounting of every transition
(``_account``): the source index entry of the holder, the serving (complete or offload) holders
per shard, the version's availability and the sorted available list, the replicas serving every
shard, and the marks that tell settling what to look at. Also the ends that are not a drain:
removing a holder at once (crash, fencing, quarantine, close), aborting a partial one, and a
partial holder whose chain of sources no longer ends at a whole copy (``_viable``,
``_source_gone``).

Invariants: ``h.state`` is set only by ``_account``, and only through ``_new_holder`` and
``_fire``, so the counts, the available list and the source index always agree with the
holders; a holder that is gone is in no index (its version's holders, the model's offload
holders, ``_by_id``, the waiting readers); ending a holding first ends its own upstream grant
and revokes its readers' grants, then re-grants those readers elsewhere.

What it must never do: set ``h.state`` directly, or drop a holder that still has active grants.
"""

from __future__ import annotations

import bisect

from .. import messages as m
from ..errors import Cancelled, VersionUnavailable
from ..lifecycle import TRANSITIONS, Event, HolderState, transition
from .records import SERVING, C, P, U, _Holder, _Model, _Session, _Version
from .state import TableState


class HolderMixin(TableState):
    """Holder transitions and their accounting. Mixed into
    :class:`~tensorhub.core.table.ReferenceTable`. State
    (:class:`~tensorhub.core.table.state.TableState`): ``sources``, ``_by_id``, ``_ids``."""

    def _holder_set(self, model: _Model, version: int, shard_idx: int) -> dict[int, _Holder]:
        ver = model.versions.get(version)
        if ver is None:
            ver = model.versions[version] = _Version(version, model.num_shards, self.sources)
        return ver.holders[shard_idx]

    def _new_holder(self, s: _Session, version: int, kind: str, event: Event) -> _Holder:
        h = _Holder(next(self._ids), s, version, kind)
        try:
            state = TRANSITIONS[(None, event)]
        except KeyError:  # transition() raises, with the context (built only for the error)
            state = transition(None, event, **s.ctx(version))
        self._holder_set(s.model, version, s.shard_idx)[h.id] = h
        self._by_id[h.id] = h
        if kind == m.KIND_OFFLOAD:
            s.model.offload_holders[h.id] = h
        self._account(h, state)
        return h

    def _fire(self, h: _Holder, event: Event) -> None:
        """Apply a lifecycle event; removal drops the holder from every index."""
        try:
            state = TRANSITIONS[(h.state, event)]
        except KeyError:  # transition() raises, with the context (built only for the error)
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

    def _remove_holder(self, h: _Holder, event: Event, reason: str) -> None:
        """Remove ``h`` now (crash, fencing, quarantine, close): end its upstream grant and
        revoke its readers, who get re-granted elsewhere."""
        if h.state is None:
            return  # already gone (a cascade of this same removal got to it first)
        if h.upstream is not None:
            self._end_grant(h.upstream, "cancelled")
        self._end_conversion(h)
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

    def _abort_partial(self, h: _Holder) -> None:
        """Abort a partial holding: its own pull stops and readers of it are told at once (it
        will never progress, so they could not finish from it)."""
        if h.upstream is not None:
            self._end_grant(h.upstream, "cancelled")
        self._end_conversion(h)
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

    def _viable(self, h: _Holder) -> bool:
        """A partial holder can still finish: its chain of sources ends at a holder of the whole
        shard (one that is unpublishing finishes the grants it has)."""
        x = h
        for _ in range(1 << 20):
            if x.upstream is None:
                return (x.whole or self._convertible(x)) and x.state is not None
            x = x.upstream.source
        raise AssertionError("grant cycle")

    def _source_gone(self, h: _Holder) -> None:
        call = h.call
        ctx = h.session.ctx(h.version)
        if h.upstream is not None:
            self._end_grant(h.upstream, "cancelled")
        self._end_conversion(h)
        readers = [g.reader for g in h.grants.values()]
        for g in list(h.grants.values()):
            self._revoke(g, "its source has no complete copy left")
        h.call = None
        self._fire(h, Event.SOURCES_GONE)
        if call is not None:
            self._fail_txn(call[0], VersionUnavailable(f"version {h.version} lost its last complete holder", **ctx))
        for r in readers:
            self._regrant(r)
