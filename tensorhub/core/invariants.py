"""The reference table's invariants, checked from the outside.

:func:`check_invariants` walks a :class:`~tensorhub.core.table.ReferenceTable` and returns every
violation it finds as a sentence (an empty list when all hold). The property tests and the
simulator call it after every step; it never changes the table.
"""

from __future__ import annotations

from .lifecycle import HolderState
from .table import SERVING, ReferenceTable

__all__ = ["check_invariants", "assert_invariants"]

P, C, O, U = HolderState.PARTIAL, HolderState.COMPLETE, HolderState.OFFLOAD, HolderState.UNPUBLISHING


def check_invariants(table: ReferenceTable) -> list[str]:
    bad: list[str] = []
    holders = {h.id: h for h in table.holders()}

    # Grants: both ends live and indexed; counted exactly once on each side.
    for gid, g in table.grants.items():
        if g.ended is not None:
            bad.append(f"grant {gid} is active but ended ({g.ended})")
        if holders.get(g.source.id) is not g.source:
            bad.append(f"grant {gid}: its source holder {g.source.id} is not in the table")
        if holders.get(g.reader.id) is not g.reader:
            bad.append(f"grant {gid}: its reader holder {g.reader.id} is not in the table")
        if g.source.grants.get(gid) is not g:
            bad.append(f"grant {gid} is missing from its source's grants")
        conv = g.reader.converting
        if g.reader.upstream is not g and (conv is None or conv.get(g.source.shard_idx) is not g):
            bad.append(f"grant {gid} is neither its reader's upstream nor one of its conversion grants")
        if conv is not None and g.reader.upstream is not None:
            bad.append(f"converter {g.reader.id} has an upstream grant")
        if g.reader.state is not P:
            bad.append(f"grant {gid}: reader {g.reader.id} is {g.reader.state}, not partial")
        if g.source.session.replica is g.reader.session.replica:
            bad.append(f"grant {gid}: a replica pulls from itself")
    for h in holders.values():
        for gid, g in h.grants.items():
            if table.grants.get(gid) is not g:
                bad.append(f"holder {h.id} counts grant {gid} that is not active")
        if h.upstream is not None and table.grants.get(h.upstream.id) is not h.upstream:
            bad.append(f"holder {h.id} has an upstream grant {h.upstream.id} that is not active")
        if h.state is None:
            bad.append(f"holder {h.id} is indexed with no state")
        if h.state is not P and h.upstream is not None:
            bad.append(f"holder {h.id} is {h.state.value if h.state else None} but still has an upstream grant")
        if h.converting is not None and h.state is not P:
            bad.append(f"holder {h.id} is {h.state.value if h.state else None} but still converting")
        if h.converting is not None and h.grants:
            bad.append(f"converting holder {h.id} is a source of grants")
        if h.state is P and h.upstream is None and h.converting is None and not h.waiting and h.call is not None:
            bad.append(f"partial holder {h.id} has a call in flight but neither a source nor a place in line")
        if h.state is U and not h.grants and not h.offload_pending:
            bad.append(f"unpublishing holder {h.id} has drained but was not removed")
        if h.session.id not in table.sessions:
            bad.append(f"holder {h.id} belongs to session {h.session.id}, which is gone")
        s = h.session
        if h.kind == "normal" and s.holder is not h:
            bad.append(f"holder {h.id} is not its session's holding")
        if h.kind == "offload" and s.offloads.get(h.id) is not h:
            bad.append(f"offload holder {h.id} is not among its session's offloads")

    # Serving counts per replica: the number of active grants from each replica to each reader.
    for model in table.models.values():
        for replica in model.replicas.values():
            counted: dict[str, int] = {}
            for s in replica.shards.values():
                for held in [s.holder, *s.offloads.values()]:
                    if held is not None:
                        for g in held.grants.values():
                            counted[g.reader.session.replica.name] = counted.get(g.reader.session.replica.name, 0) + 1
            if counted != replica.serving:
                bad.append(f"replica {replica.name}: serving counts {replica.serving} != active grants {counted}")
        for v, ver in model.versions.items():
            for i, hs in enumerate(ver.holders):
                n = sum(1 for h in hs.values() if h.state in SERVING)
                if n != ver.serving[i]:
                    bad.append(f"model {model.name} v{v} shard {i}: serving count {ver.serving[i]} != {n}")
                if n == 0 and not table.in_grace and any(h.state is P and not table._viable(h) for h in hs.values()):
                    bad.append(f"model {model.name} v{v} shard {i}: partial holders with no complete source")
                offl = [h for h in hs.values() if h.kind == "offload" and h.state is not U]
                if len(offl) > 1:
                    bad.append(f"model {model.name} v{v} shard {i}: {len(offl)} offload copies")
            if ver.available != (v in model.available):
                bad.append(f"model {model.name} v{v}: availability index disagrees")

    # Pins: each belongs to a live, decided, moving replicate/update with no error, on the version
    # it decided; a transaction pins one version at most, and an offload copy of a version that is
    # neither retained nor pinned is being released.
    for model in table.models.values():
        pinning: dict[int, int] = {}
        for v, txns in model.pins.items():
            if not txns:
                bad.append(f"model {model.name} v{v}: an empty pin set")
            for txn in txns:
                where = f"model {model.name} v{v}: pin of {txn.replica.name} call {txn.n}"
                if txn.replica.txns.get(txn.n) is not txn or txn.replica.model is not model:
                    bad.append(f"{where} belongs to no live transaction")
                if txn.kind not in ("replicate", "update") or not (txn.decided and txn.moved) or txn.error is not None:
                    bad.append(f"{where}: not a decided, moving, unfailed replicate/update")
                if txn.version != v or txn.pinned_until is None:
                    bad.append(f"{where}: pins v{txn.version} until {txn.pinned_until}")
                pinning[id(txn)] = pinning.get(id(txn), 0) + 1
        if any(n > 1 for n in pinning.values()):
            bad.append(f"model {model.name}: a transaction pins several versions")
        for replica in model.replicas.values():
            for txn in replica.txns.values():
                # (a pinning transaction with no version finds no pins: reported too)
                pins = model.pins.get(txn.version, ()) if txn.version is not None else ()
                if txn.pinned_until is not None and txn not in pins:
                    bad.append(f"model {model.name}: {replica.name} call {txn.n} thinks it pins v{txn.version}")
        for h in model.offload_holders.values():
            if h.state is O and not model.kept(h.version) and not table._dirty_models.get(model.name):
                bad.append(f"model {model.name} v{h.version}: an offload copy neither retained nor pinned is not released")

    # No cycle in the upstream graph.
    for h in holders.values():
        seen = set()
        x = h
        while x is not None and x.upstream is not None:
            if x.id in seen:
                bad.append(f"grant cycle through holder {h.id}")
                break
            seen.add(x.id)
            x = x.upstream.source

    # Sessions and indexes agree.
    for sid, s in table.sessions.items():
        if table.by_slot.get((s.model.name, s.replica.name, s.shard_idx)) is not s:
            bad.append(f"session {sid} is not indexed by its slot")
        if s.replica.shards.get(s.shard_idx) is not s:
            bad.append(f"session {sid} is not its replica's shard {s.shard_idx}")
        if table.models.get(s.model.name) is not s.model:
            bad.append(f"session {sid}: its model is not in the table")
    if len(table.expiry) != len(table.sessions):
        bad.append("the expiry index and the sessions disagree")
    return bad


def assert_invariants(table: ReferenceTable) -> None:
    """Raise AssertionError listing every violated invariant."""
    bad = check_invariants(table)
    if bad:
        raise AssertionError("reference table invariants violated:\n  " + "\n  ".join(bad))
