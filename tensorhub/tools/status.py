"""The cluster's state for operators: built by the server from its table, shown by
``tensorhub status`` as a terminal view (a tree of who pulls from whom) or as JSON.

:func:`tensorhub.runtime.server.cluster_state` reads the table (it changes nothing) in the server;
:func:`as_json` and :func:`render` work on what the server sent, on the operator's side.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from tensorhub.core import messages as m

__all__ = ["as_json", "render"]



def as_json(status: m.ServerStatus, cluster: m.ClusterState) -> dict[str, Any]:
    """One JSON document: the server's counters (``term``, ``counts``, ``stats``,
    ``bytes_by_link``, ``seeding``, as before) and the cluster state (``models``, ``grants``
    with a ``tree`` per (model, version, shard), transfer ``rates``), and who decides:
    ``reigns`` (this server's reigns, oldest first: ``term``, ``start``, ``end`` (null while it
    reigns), ``first_grant``, ``last_grant`` on the server's monotonic clock, and ``grants``),
    ``reigning`` (its last reign is open), and ``membership``: a primary's or backup's voters
    (``{"epoch", "voters"}``: the epoch of the membership it holds, 0 while none is known, and
    how many slots it has), null for a server alone."""
    out: dict[str, Any] = {k: v for k, v in dataclasses.asdict(status).items() if k != "req"}
    c = dataclasses.asdict(cluster)
    out["time"] = c["time"]
    out["models"] = c["models"]
    out["grants"] = c["grants"]
    out["trees"] = grant_trees(cluster)
    out["rates"] = {
        "recent_bytes_per_s": cluster.recent_bytes_per_s,
        "window_s": cluster.window_s,
        "active_bytes_per_s": round(sum(g.bytes_per_s for g in cluster.grants), 1),
    }
    out["reigns"] = c["reigns"]
    out["reigning"] = bool(cluster.reigns) and cluster.reigns[-1].end is None
    out["membership"] = None if cluster.membership is None else {"epoch": cluster.membership, "voters": cluster.voters}
    return json.loads(json.dumps(out))  # plain JSON types (lists, not tuples), as a script reads it


def grant_trees(cluster: m.ClusterState) -> list[dict[str, Any]]:
    """The active grants as trees, one per (model, version, shard): each root is a source that
    is not itself pulling under a grant; its children are the replicas pulling from it, and so
    on down the pipeline."""
    by_key: dict[tuple[str, int, int], list[m.GrantState]] = {}
    for g in cluster.grants:
        by_key.setdefault((g.model, g.version, g.shard_idx), []).append(g)
    trees = []
    for (model, version, shard), gs in sorted(by_key.items()):
        children: dict[str, list[m.GrantState]] = {}
        readers = {g.reader for g in gs}
        for g in gs:
            children.setdefault(g.source, []).append(g)

        def node(name: str, grant: m.GrantState | None, depth: int, children: dict = children) -> dict[str, Any]:
            n: dict[str, Any] = {"replica": name}
            if grant is not None:
                n.update(grant=grant.grant, verified=grant.verified, total_bytes=grant.total_bytes,
                         bytes_per_s=grant.bytes_per_s, source_complete=grant.source_complete)  # fmt: skip
            kids = children.get(name, []) if depth < 64 else []
            n["readers"] = [node(g.reader, g, depth + 1) for g in sorted(kids, key=lambda g: g.reader)]
            return n

        roots = sorted(src for src in children if src not in readers)
        trees.append({"model": model, "version": version, "shard": shard, "roots": [node(r, None, 0) for r in roots]})
    return trees


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def render(doc: dict[str, Any], address: str = "") -> str:
    """The terminal view of :func:`as_json`'s document."""
    lines = [f"tensorhub server {address}  term {doc['term']}  " + time.strftime("%H:%M:%S", time.localtime(doc["time"]))]
    grants = sum(r["grants"] for r in doc["reigns"])
    member = doc["membership"]
    voters = f"; membership epoch {member['epoch']}, {member['voters']} voters" if member is not None else ""
    lines.append(f"  {'reigning' if doc['reigning'] else 'not reigning'} ({len(doc['reigns'])} reigns, {grants} grants in them){voters}")
    c = doc["counts"]
    lines.append(f"  {c['models']} models, {c['sessions']} shards open, {c['holders']} holders, {c['grants']} active grants")
    s = doc["stats"]
    lines.append(f"  grants {s['grants']} (revoked {s['revoked']}), expired {s['expired']}, quarantined {s['quarantined']}, "
                 f"offloads {s['offloads']}")  # fmt: skip
    rates = doc["rates"]
    link = ", ".join(f"{k} {_size(v)}" for k, v in doc["bytes_by_link"].items())
    lines.append(f"  transfer: {_size(rates['active_bytes_per_s'])}/s now, {_size(rates['recent_bytes_per_s'])}/s over the "
                 f"last {rates['window_s']:g} s; moved by link: {link}")  # fmt: skip
    for mo in doc["models"]:
        keep = f"retain latest-{mo['retain_back']}" if mo["retain_back"] is not None else "no retention"
        lines.append("")
        lines.append(f"model {mo['model']}  ({mo['num_shards']} shards, highest published {mo['highest_published']}, {keep})")
        for v in mo["versions"]:
            flags = [f for f, on in (("available", v["available"]), ("retained", v["retained"])) if on]
            if v["offloaded"]:
                flags.append(f"offloaded x{v['offloaded']}")
            if v["partial"]:
                flags.append(f"{v['partial']} pulling")
            held = ", ".join(v["replicas"]) or "-"
            lines.append(f"  v{v['version']:<6} {' '.join(flags) or 'unavailable':<40} held by {held}")
        for r in mo["replicas"]:
            lines.append(f"  replica {r['replica']}{' (spot)' if r['spot'] else ''}")
            for sh in r["shards"]:
                what = "empty" if sh["version"] is None else f"v{sh['version']} {sh['state']}"
                if sh["state"] == "partial" and sh["total_bytes"]:
                    what += f" {100 * sh['verified'] / sh['total_bytes']:.0f}%"
                off = f", offload copies {sh['offloads']}" if sh["offloads"] else ""
                lines.append(f"    shard {sh['shard_idx']}: {what:<24} at {sh['datacenter']}/{sh['host']}{off}")
    if doc["trees"]:
        lines.append("")
        lines.append("active grants (source -> readers):")
        for t in doc["trees"]:
            lines.append(f"  {t['model']} v{t['version']} shard {t['shard']}")

            def walk(n: dict[str, Any], depth: int) -> None:
                label = n["replica"]
                if "grant" in n:
                    pct = 100 * n["verified"] / n["total_bytes"] if n["total_bytes"] else 0.0
                    label += f"  {pct:.0f}% at {_size(n['bytes_per_s'])}/s (grant {n['grant']})"
                lines.append("    " + "  " * depth + ("└─ " if depth else "") + label)
                for k in n["readers"]:
                    walk(k, depth + 1)

            for root in t["roots"]:
                walk(root, 0)
    if doc["seeding"]:
        lines.append("")
        for sd in doc["seeding"]:
            lines.append(f"seeding {sd['model']} v{sd['version']} into {sd['datacenter']}: {', '.join(sd['replicas'])}")
    return "\n".join(lines)
