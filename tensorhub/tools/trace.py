"""Transfer traces: one version's replication as a Chrome trace / Perfetto JSON file.

Readers report a span per transfer (their pull under one grant: bytes, reads, transport,
outcome; :class:`~tensorhub.core.messages.TransferSpan`); the server keeps them per version beside
its own record of the grants. :func:`chrome_trace` turns both into the Trace Event Format
(``{"traceEvents": [...]}``, JSON object form) that chrome://tracing and ui.perfetto.dev load:

- one *process* per reader replica, one *thread* per shard; each reported transfer is a
  complete event (``ph: "X"``) named after its source, with bytes, MB/s, transport and outcome
  in ``args``;
- a flow arrow (``ph: "s"`` / ``"f"``) from the source replica's track to the reader's, so
  the pipeline (who pulled from whom) is drawn;
- the server's view of the same grants (start, end, outcome by the server's clock, mapped onto
  the wall clock) on a separate ``server`` process, so a missing or late client report shows.

Times are microseconds from the first event of the file.
"""

from __future__ import annotations

import json
from typing import Any

from tensorhub.core import messages as m

__all__ = ["chrome_trace", "validate_chrome_trace", "write_chrome_trace"]

_SERVER_PID = 1


def chrome_trace(trace: m.Trace) -> dict[str, Any]:
    """The Trace Event Format document for ``trace``."""
    spans = sorted(trace.spans, key=lambda s: (s.start, s.reader, s.reader_shard, s.grant))
    edges = sorted(trace.edges, key=lambda e: (e.start, e.reader, e.reader_shard))
    starts = [s.start for s in spans] + [e.start + trace.clock_offset for e in edges]
    t0 = min(starts) if starts else 0.0

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    pids: dict[str, int] = {}

    def pid(replica: str) -> int:
        if replica not in pids:
            pids[replica] = len(pids) + 2  # 1 is the server
        return pids[replica]

    events: list[dict[str, Any]] = []
    for s in spans:
        pid(s.source)
        pid(s.reader)
    for e in edges:
        pid(e.source)
        pid(e.reader)
    events.append({"ph": "M", "pid": _SERVER_PID, "tid": 0, "name": "process_name", "args": {"name": "server (grants)"}})
    for replica, p in pids.items():
        events.append({"ph": "M", "pid": p, "tid": 0, "name": "process_name", "args": {"name": f"replica {replica}"}})
        events.append({"ph": "M", "pid": p, "tid": 0, "name": "process_sort_index", "args": {"sort_index": p}})
    shards = sorted({(s.reader, s.reader_shard) for s in spans} | {(s.source, s.source_shard) for s in spans})
    for replica, shard in shards:
        events.append({"ph": "M", "pid": pid(replica), "tid": shard, "name": "thread_name", "args": {"name": f"shard {shard}"}})
    for i, s in enumerate(spans):
        dur = max(0.0, s.end - s.start)
        rate = s.bytes / dur / 1e6 if dur > 0 else 0.0
        name = f"v{trace.version} shard {s.reader_shard} <- {s.source}/{s.source_shard}"
        args = {
            "model": trace.model, "version": trace.version, "reader": s.reader, "shard": s.reader_shard,
            "source": s.source, "source_shard": s.source_shard, "grant": s.grant, "transport": s.transport,
            "bytes": s.bytes, "reads": s.reads, "MB/s": round(rate, 2), "outcome": s.outcome,
            "reader_location": f"{s.reader_dc}/{s.reader_host}",
        }  # fmt: skip
        events.append({"ph": "X", "cat": "transfer", "name": name, "pid": pid(s.reader), "tid": s.reader_shard,
                       "ts": us(s.start), "dur": round(dur * 1e6, 3), "args": args})  # fmt: skip
        flow = {"cat": "replication", "name": "pull", "id": i + 1}
        events.append({**flow, "ph": "s", "pid": pid(s.source), "tid": s.source_shard, "ts": us(s.start)})
        events.append({**flow, "ph": "f", "bp": "e", "pid": pid(s.reader), "tid": s.reader_shard, "ts": us(s.start)})
    for j, e in enumerate(edges):
        start = e.start + trace.clock_offset
        end = e.end + trace.clock_offset
        events.append({
            "ph": "X", "cat": "grant", "name": f"grant {e.reader}/{e.reader_shard} <- {e.source}/{e.source_shard}",
            "pid": _SERVER_PID, "tid": j % 64, "ts": us(start), "dur": round(max(0.0, end - start) * 1e6, 3),
            "args": {"bytes": e.bytes, "outcome": e.outcome, "source_kind": e.source_kind,
                     "source_complete": e.source_complete, "link": f"{e.source_dc} -> {e.reader_dc}"},
        })  # fmt: skip
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"model": trace.model, "version": trace.version, "spans": len(spans), "grants": len(edges),
                      "t0_unix_s": t0},  # fmt: skip
    }


def write_chrome_trace(trace: m.Trace, path: str) -> dict[str, Any]:
    """Write :func:`chrome_trace` as JSON to ``path`` ("-": return it only); returns the document."""
    doc = chrome_trace(trace)
    validate_chrome_trace(doc)
    if path != "-":
        with open(path, "w") as f:
            json.dump(doc, f)
    return doc


_PHASES = {"X": ("name", "ts", "dur", "pid", "tid"), "M": ("name", "pid", "args"),
           "s": ("name", "id", "ts", "pid", "tid"), "f": ("name", "id", "ts", "pid", "tid")}  # fmt: skip


def validate_chrome_trace(doc: Any) -> None:
    """Check a document against the Trace Event Format's rules for the phases used here.

    Raises:
        ValueError: naming the first event that breaks them.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError("a Chrome trace is an object with a traceEvents array")
    flows: dict[Any, list[str]] = {}
    for i, ev in enumerate(doc["traceEvents"]):
        if not isinstance(ev, dict) or ev.get("ph") not in _PHASES:
            raise ValueError(f"event {i}: unknown phase {ev.get('ph') if isinstance(ev, dict) else ev!r}")
        for key in _PHASES[ev["ph"]]:
            if key not in ev:
                raise ValueError(f"event {i} ({ev['ph']}): missing {key!r}")
        for key in ("ts", "dur"):
            if key in ev and (not isinstance(ev[key], (int, float)) or ev[key] < 0):
                raise ValueError(f"event {i}: {key} must be a number >= 0, got {ev[key]!r}")
        for key in ("pid", "tid"):
            if key in ev and not isinstance(ev[key], int):
                raise ValueError(f"event {i}: {key} must be an integer")
        if ev["ph"] in ("s", "f"):
            flows.setdefault(ev["id"], []).append(ev["ph"])
    for fid, phases in flows.items():
        if sorted(phases) != ["f", "s"]:
            raise ValueError(f"flow {fid}: needs one start and one finish, got {phases}")
