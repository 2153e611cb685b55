"""Views: the version listing, the status, and the replication history.

Theory of operation
-------------------
What it owns: the listing of available versions and the replicas holding each whole (built
lazily, kept until a holder change marks it stale), the server status (counts, stats, bytes per
link class, the datacenters being seeded), and the history of ended grants per version (the
latest ``HISTORY_VERSIONS`` versions, ``HISTORY_EDGES`` grants each) that
:meth:`replication_dag` returns.

Invariants: listings are sorted (versions ascending, replicas by name), so replies never depend
on hash order; a view reflects the state at the moment it is asked.

What it must never do: change a holder, grant, session or transaction. The only things written
here are its own: the listing cache, and the history and byte counters that ``_record`` adds to
when a grant ends.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Iterable

from .. import messages as m
from ..naming import seed_replica
from ..topology import link_class
from .records import HISTORY_EDGES, HISTORY_VERSIONS, P, _Grant, _Holder, _Model
from .state import TableState

#: the fields of a replication history edge, in the order ``_record`` keeps them (those of DagEdge)
EDGE_FIELDS = tuple(f.name for f in dataclasses.fields(m.DagEdge))


class ViewMixin(TableState):
    """Listing, status, replication history. Mixed into :class:`~tensorhub.core.table.ReferenceTable`.
    State (:class:`~tensorhub.core.table.state.TableState`): ``clock``, ``term``, ``models``,
    ``sessions``, ``grants``, ``history``, ``_out``, ``stats``, ``bytes_by_link``."""

    def _listing(self, model: _Model) -> tuple[m.VersionEntry, ...]:
        """The available versions and the replicas holding each completely (built lazily)."""
        if model.listing_stale:
            entries = []
            for v in model.available:
                ver = model.versions[v]
                reps = []
                for name in sorted(ver.full):
                    replica = model.replicas.get(name)
                    kind = m.KIND_OFFLOAD if ver.per_replica[name][1] else m.KIND_NORMAL
                    reps.append(m.ReplicaEntry(name, kind, replica.spot if replica is not None else False))
                entries.append(m.VersionEntry(v, tuple(reps)))
            model.listing = tuple(entries)
            model.listing_stale = False
        return model.listing

    def _record(self, g: _Grant, how: str, reached: int | None) -> str:
        """Add an ended grant to its version's replication history (bounded: the latest
        ``HISTORY_VERSIONS`` versions, ``HISTORY_EDGES`` grants each). Returns the class of the
        link it used (:func:`~tensorhub.core.topology.link_class`)."""
        r, src = g.reader, g.source
        rs, ss = r.session, src.session
        key = (rs.model.name, r.version)
        history = self.history
        edges = history.get(key)
        if edges is None:
            edges = history[key] = []
            while len(history) > HISTORY_VERSIONS:
                history.popitem(last=False)
        if r.converting is not None and g in r.converting.values():
            # One of a converter's grants (one per source shard): the bytes it read from that
            # source (as it said, else a share of its shard), never the whole shard per edge.
            nbytes = max(0, reached) if reached is not None else 0
        else:
            end = rs.total_bytes if how == "completed" else (reached if reached is not None else r.verified)
            nbytes = max(0, end - g.start)
        rloc, sloc = rs.location, ss.location
        link = link_class(rloc, sloc)
        self.bytes_by_link[link] += nbytes
        if len(edges) < HISTORY_EDGES:
            edges.append((
                r.replica.name, r.shard_idx, rloc.datacenter, rloc.host, src.replica.name, src.shard_idx,
                src.kind, src.state is not P, sloc.datacenter, sloc.host, nbytes, g.created, self.clock(), how,
            ))  # fmt: skip  # in EDGE_FIELDS order: a dict per edge only when one is asked for
        return link

    def replication_dag(self, model: str, version: int) -> dict[str, Any]:
        """Who served whom for ``version`` of ``model``: every ended grant (reader, source,
        their locations, bytes moved under it, start, end, outcome), oldest first. See
        :mod:`tensorhub.scheduling.dag` to summarise, export and draw it."""
        return {"model": model, "version": version, "edges": self.dag_edges(model, version)}

    def dag_edges(self, model: str, version: int) -> list[dict[str, Any]]:
        """The ended grants of ``version`` of ``model``, oldest first, each a dict of
        :data:`EDGE_FIELDS` (the fields of :class:`~tensorhub.core.messages.DagEdge`)."""
        return [dict(zip(EDGE_FIELDS, e)) for e in self.history.get((model, version), ())]

    def _on_status(self, peer: Hashable, msg: m.GetStatus) -> None:
        self._out.append((peer, m.ServerStatus(
            msg.req, self.term, self.counts(), dict(self.stats), dict(self.bytes_by_link), tuple(self.seeding()),
        )))  # fmt: skip

    def _on_dag(self, peer: Hashable, msg: m.GetDag) -> None:
        edges = tuple(m.DagEdge(*e) for e in self.history.get((msg.model, msg.version), ()))
        self._out.append((peer, m.Dag(msg.req, msg.model, msg.version, edges)))

    def seeding(self) -> Iterable[m.Seeding]:
        """Versions being seeded into a datacenter now: the replicas there whose pull of the
        version has a source in another datacenter (or that were told to offload-seed it)."""
        across: dict[str, dict[tuple[int, str], dict[str, None]]] = {}  # model -> (version, dc) -> replicas
        for g in self.grants.values():
            r = g.reader
            dc = r.session.location.datacenter
            if dc != g.source.session.location.datacenter:
                across.setdefault(r.session.model.name, {}).setdefault((r.version, dc), {})[r.replica.name] = None
        now = self.clock()
        for model in self.models.values():
            found = across.get(model.name, {})
            for (v, dc), (owner, until) in model.seeds.items():
                if until > now and owner in model.replicas and not found.get((v, dc)):
                    found[(v, dc)] = {seed_replica(owner): None}
            for (v, dc), replicas in sorted(found.items()):
                yield m.Seeding(model.name, v, dc, tuple(replicas))

    def counts(self) -> dict[str, int]:
        """How many of each thing the table holds (all zero once every client has closed)."""
        holders = sum(len(hs) for mo in self.models.values() for ver in mo.versions.values() for hs in ver.holders)
        txns = sum(len(r.txns) for mo in self.models.values() for r in mo.replicas.values())
        return {
            "models": len(self.models),
            "sessions": len(self.sessions),
            "holders": holders,
            "grants": len(self.grants),
            "transactions": txns,
            "waits": sum(len(mo.waits) for mo in self.models.values()),
            "declarations": sum(len(mo.declarations) for mo in self.models.values()),
            #: (version, shard) copies the bucket tier holds, as writers declared (see .deltas)
            "bucket_copies": sum(len(mo.buckets) for mo in self.models.values()),
        }

    def holders(self) -> Iterable[_Holder]:
        for model in self.models.values():
            for ver in model.versions.values():
                for hs in ver.holders:
                    yield from hs.values()
