"""Failure masking, measured: a chain trainer -> A -> B where A dies during B's pull.

Workload: a ``--size-mib`` shard pulled along trainer -> A -> B, reads paced at ``--rate-mbs``,
A SIGKILLed at ``--points`` % of B's pull (server actor in process, short heartbeats).
Baseline: B's replicate time in fault-free runs of the same invocation (median).
Goal: extra delay <= heartbeat timeout + the remaining transfer time at the paced rate.

Every run: a server actor with short heartbeats, a trainer that publishes a fresh version, a
relay A that replicates it (its reads paced at ``--rate-mbs``), and a reader B that replicates it
while A is still partial, so that the server grants A to B (pipeline replication) and B's reads
are paced at the same rate. In a *fault* run, A is SIGKILLed when B has verified ``p`` % of the
shard (``--points``, read from the server's table); B's reads from A fail, B reports, is granted
the trainer and resumes from what it verified. B's *extra delay* is its ``replicate`` time minus
the median of the fault-free runs.

Goal (the issue's): extra delay <= heartbeat timeout + the remaining transfer time, where the
remaining transfer time is what B had left at the kill, at the paced rate. (A SIGKILLed peer
resets its connections, so B usually notices at once; the heartbeat timeout bounds the silent
case.) B's bytes are checked against the version's content after every run.

Usage: python benchmarks/bench_masking.py [--size-mib 64] [--rate-mbs 40] [--points 10,50,90]
       [--repeats 3] [--heartbeat-timeout 1.0] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import median, write_json  # noqa: E402
from tests.procs import InprocServer, RemoteHandle, wait_until

BASE_BYTES = 41_600  # bytes of the test shard at scale 1 (tests/procs.py SHAPES)
ENV = {"TENSORHUB_PACK_THRESHOLD": "0", "TENSORHUB_CHUNK_BYTES": str(256 << 10)}


def b_verified(srv: InprocServer, replica: str) -> int:
    """What the server knows replica ``replica`` verified of its pull (0 before a grant)."""

    def get(t: Any) -> int:
        for s in t.sessions.values():
            if s.replica.name == replica and s.holder is not None:
                return s.holder.verified
        return 0

    return srv._look(get)


def one_run(srv: InprocServer, trainer: RemoteHandle, version: int, scale: int, rate: float, kill_at: float | None,
            timeout: float) -> dict[str, float]:  # fmt: skip
    """One chain run; returns B's replicate time and, for a fault run, where A was killed."""
    paced = {"tcp": {"max_rate": rate}}
    # One region per tensor and reads of at most one 4 MiB checksum unit: B's verified prefix
    # (what the server sees) moves in small steps, so the kill lands near its mark.
    kw = {"server": srv.address, "scale": scale, "transports": paced, "env": ENV}
    relay = RemoteHandle(model="actor", replica=f"relay-{version}", **kw)
    reader = RemoteHandle(model="actor", replica=f"reader-{version}", **kw)
    total = BASE_BYTES * scale
    b_name = f"reader-{version}"
    try:
        for h in (relay, reader):
            h.call("register")
        if version > 1:
            trainer.call("unpublish")
        trainer.call("fill", version)
        trainer.call("publish", version)
        grants = srv.counts()["grants"]
        relay.send("replicate", version, timeout)
        wait_until(lambda: srv.counts()["grants"] > grants, timeout, "the relay's grant")
        t0 = time.monotonic()
        reader.send("replicate", version, timeout)
        killed_at = None
        if kill_at is not None:
            wait_until(lambda: b_verified(srv, b_name) >= kill_at * total, timeout, "B's progress")
            killed_at = b_verified(srv, b_name) / total
            relay.kill()
        got = reader.result(timeout)
        took = time.monotonic() - t0
        if got != version or not reader.call("holds", version):
            raise RuntimeError(f"B does not hold version {version} byte-exact after the run")
        sources = reader.call("last_sources")
        if sources[0] != f"relay-{version}/0":
            raise RuntimeError(f"B was not served by the relay first (sources {sources}); the chain was not formed")
        if kill_at is None:
            relay.result(timeout)
        return {"seconds": took, "killed_at": killed_at if killed_at is not None else -1.0, "grants": float(len(sources))}
    finally:
        for h in (relay, reader):
            h.exit()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=64.0)
    ap.add_argument("--rate-mbs", type=float, default=40.0, help="pace of A's and B's reads, MB/s")
    ap.add_argument("--points", default="10,50,90", help="percent of B's pull at which A dies")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heartbeat-timeout", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    points = [int(p) for p in a.points.split(",")]
    if not points or any(not 0 < p < 100 for p in points) or a.repeats < 1 or a.rate_mbs <= 0 or a.size_mib <= 0:
        ap.error("points must be percentages in (0, 100), repeats >= 1, rate and size > 0")
    scale = max(1, round(a.size_mib * (1 << 20) / BASE_BYTES))
    total = BASE_BYTES * scale
    rate = a.rate_mbs * 1e6
    srv = InprocServer(heartbeat_interval=a.heartbeat_timeout / 10, heartbeat_timeout=a.heartbeat_timeout)
    trainer = RemoteHandle(model="actor", replica="trainer", server=srv.address, scale=scale, env=ENV)
    print(f"chain trainer -> A -> B, {total / 2**20:.1f} MiB shard, reads paced at {a.rate_mbs:g} MB/s, "
          f"heartbeat timeout {a.heartbeat_timeout:g} s, {a.repeats} repeats", flush=True)  # fmt: skip
    results: dict[str, Any] = {"size_bytes": total, "rate": rate, "heartbeat_timeout": a.heartbeat_timeout, "runs": []}
    ok = True
    try:
        trainer.call("register")
        version = 0
        base = []
        for _ in range(a.repeats):
            version += 1
            r = one_run(srv, trainer, version, scale, rate, None, a.timeout)
            base.append(r["seconds"])
            results["runs"].append({"kill_at": None, **r})
        t0 = median(base)
        print(f"  fault-free: B's replicate {t0:.2f} s (median; {min(base):.2f}-{max(base):.2f})")
        print(f"  {'A killed at':>12} {'B took (s)':>11} {'extra (s)':>10} {'bound (s)':>10}  goal")
        for p in points:
            extras, bounds = [], []
            for _ in range(a.repeats):
                version += 1
                r = one_run(srv, trainer, version, scale, rate, p / 100, a.timeout)
                extra = r["seconds"] - t0
                bound = a.heartbeat_timeout + (1 - r["killed_at"]) * total / rate
                extras.append(extra)
                bounds.append(bound)
                results["runs"].append({"kill_at": p, **r, "extra": extra, "bound": bound})
            e, b = median(extras), median(bounds)
            verdict = "PASS" if e <= b else "MISS"
            ok = ok and verdict == "PASS"
            print(f"  {p:>11}% {t0 + e:>11.2f} {e:>10.2f} {b:>10.2f}  extra <= bound: {verdict}", flush=True)
            results[f"at_{p}"] = {"extra_median": e, "bound_median": b, "verdict": verdict}
        # Every relay and reader is gone (exited, or killed and expired): only the trainer's
        # session, its holding and no grant or transaction may be left.
        deadline = time.monotonic() + 5 * a.heartbeat_timeout + 5
        while time.monotonic() < deadline and srv.counts()["sessions"] > 1:
            time.sleep(0.1)
        counts = srv.counts()
        leaks = {k: v for k, v in counts.items() if (k in ("grants", "transactions") and v) or (k == "sessions" and v != 1)}
        print(f"  server after the runs: {counts} (left behind: {leaks or 'nothing'})")
        results["server_after"] = counts
        ok = ok and not leaks
    finally:
        trainer.exit()
        srv.close()
    if a.json:
        write_json(a.json, results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
