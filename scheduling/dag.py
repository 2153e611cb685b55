"""The replication DAG of a version: who served whom, how many bytes, when (DESIGN.md §5.1).

The reference table records every grant of a version when it ends
(:meth:`tensorhub.core.table.Table.replication_dag`): the reader and source replicas and shards,
their datacenters and hosts, the source's kind (live or offload) and whether it was complete or
still pulling (a pipeline relay), the bytes the reader verified under that grant, start and end
(the table's clock) and how it ended. This module turns that record into what people look at:

- :func:`summary`: per reader its sources and bytes, the depth of the pipeline (longest chain of
  relays), and the bytes per *link class* (same host, same datacenter, across datacenters);
- :func:`to_json`: the record and its summary as JSON;
- :func:`to_dot`: a graphviz ``dot`` graph (replicas as nodes clustered by datacenter, an edge
  per (source, reader) pair labelled with the bytes moved), which
  :func:`tensorhub.tools.graphviz.render` draws as a PNG when graphviz's ``dot`` is installed.

It holds no state and does no IO.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from tensorhub.core.errors import InvalidArgument
from tensorhub.core.topology import LINK_CLASSES

__all__ = ["LINK_CLASSES", "link_class", "summary", "to_dot", "to_json"]

_FIELDS = ("reader", "source", "reader_dc", "source_dc", "reader_host", "source_host", "bytes", "outcome")


def _check(dag: Any) -> list[dict[str, Any]]:
    if not isinstance(dag, dict) or not isinstance(dag.get("edges"), list):
        raise InvalidArgument(f"a replication DAG is a dict with an 'edges' list, got {type(dag).__name__}")
    for k, e in enumerate(dag["edges"]):
        missing = [f for f in _FIELDS if f not in e] if isinstance(e, dict) else list(_FIELDS)
        if missing:
            raise InvalidArgument(f"edge {k} of the replication DAG lacks {missing}")
    edges: list[dict[str, Any]] = dag["edges"]
    return edges


def link_class(edge: dict[str, Any]) -> str:
    """``"host"``, ``"datacenter"`` or ``"remote"``: the link an edge's bytes crossed."""
    if edge["reader_dc"] != edge["source_dc"]:
        return "remote"
    return "host" if edge["reader_host"] == edge["source_host"] else "datacenter"  # as topology.link_class


def summary(dag: dict[str, Any]) -> dict[str, Any]:
    """Per reader replica: its sources (in order) and bytes; bytes per link class; the pipeline
    depth (the longest chain source -> reader -> reader of it ...); grants by outcome.

    Raises:
        InvalidArgument: not a replication DAG (as the table records it).
    """
    edges = _check(dag)
    readers: dict[str, dict[str, Any]] = {}
    by_class = dict.fromkeys(LINK_CLASSES, 0)
    outcomes: dict[str, int] = defaultdict(int)
    parents: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        r = readers.setdefault(e["reader"], {"sources": [], "bytes": 0})
        if e["source"] not in r["sources"]:
            r["sources"].append(e["source"])
        r["bytes"] += e["bytes"]
        by_class[link_class(e)] += e["bytes"]
        outcomes[e["outcome"]] += 1
        if e["outcome"] == "completed":
            parents[e["reader"]].add(e["source"])

    depth_of: dict[str, int] = {}

    def depth(node: str, seen: frozenset[str]) -> int:
        if node in depth_of:
            return depth_of[node]
        ups = [p for p in parents.get(node, ()) if p not in seen]
        d = 1 + max((depth(p, seen | {node}) for p in ups), default=0) if node in parents else 0
        depth_of[node] = d
        return d

    return {
        "readers": readers,
        "bytes_by_link": by_class,
        "pipeline_depth": max((depth(n, frozenset()) for n in parents), default=0),
        "grants": dict(outcomes),
    }


def to_json(dag: dict[str, Any]) -> str:
    """The DAG and its summary, as JSON."""
    return json.dumps({**dag, "summary": summary(dag)}, indent=2, sort_keys=True)


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(dag: dict[str, Any]) -> str:
    """A graphviz ``dot`` graph: replicas clustered by datacenter, one edge per (source,
    reader) with the bytes moved (dashed when no grant on it completed)."""
    edges = _check(dag)
    where: dict[str, str] = {}
    pairs: dict[tuple[str, str], list[int]] = {}
    for e in edges:
        where.setdefault(e["source"], e["source_dc"])
        where.setdefault(e["reader"], e["reader_dc"])
        got = pairs.setdefault((e["source"], e["reader"]), [0, 0])
        got[0] += e["bytes"]
        got[1] += e["outcome"] == "completed"
    title = f"{dag.get('model', '?')} version {dag.get('version', '?')}"
    lines = [f"digraph {_quote(title)} {{", "  rankdir=LR;", f"  label={_quote(title)};"]
    for k, dc in enumerate(sorted(set(where.values()))):
        lines.append(f"  subgraph cluster_{k} {{ label={_quote(dc)};")
        lines += [f"    {_quote(n)};" for n in sorted(n for n, d in where.items() if d == dc)]
        lines.append("  }")
    for (src, dst), (nbytes, done) in sorted(pairs.items()):
        style = "" if done else ", style=dashed"
        lines.append(f"  {_quote(src)} -> {_quote(dst)} [label={_quote(f'{nbytes / 1e6:.1f} MB')}{style}];")
    lines.append("}")
    return "\n".join(lines) + "\n"
