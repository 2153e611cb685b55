"""Failure masking on the emulated cluster (the paper's Fig. 7c): a relay SIGKILLed mid-transfer.

Workload: a ``--size-mib`` version on the emulated cluster, pulled along the chain trainer ->
relay -> d1 .. dK over ``tcp``, the relay SIGKILLed at ``--points`` % of d1's pull.
Baseline: each downstream's latency in fault-free runs (relay kept) of the same invocation.
Goal: extra delay <= heartbeat timeout + d1's remaining bytes at the host rate.

The hosts of one datacenter, each a network namespace with its egress shaped to ``--host-rate``
(``benchmarks/cluster.py``): the real server on ``ctl`` (short heartbeats), the trainer on
``t1``, a relay rollout on ``relay`` and ``--downstreams`` rollouts on ``d1`` .. ``dK``; every
byte crosses the emulated links over ``tcp`` (``benchmarks/cluster_jobs.py``).

One run: the trainer publishes version v; a fresh relay process starts ``replicate(v)`` and,
once it verified its first read, the downstreams start theirs one after another (each once the
one before it was granted), so that pipeline replication chains them:
trainer -> relay -> d1 -> d2 ... (checked from each pull's first source). In a *fault* run the
relay's process group is SIGKILLed when d1 has verified ``p`` % of the shard (``--points``,
from d1's progress counter); d1's reads from the relay fail, it is re-granted another source
and resumes from what it verified, and the readers behind it keep reading from it. Fault-free
runs (relay kept) give each downstream's baseline latency (median) in the same invocation.

Reported per downstream: its latency (from its ``replicate`` call to holding v) with and
without the failure, the *extra* delay, and the bound that ``bench_masking.py`` uses: heartbeat
timeout + d1's remaining bytes at the kill at the host rate. Goal: extra <= bound (a SIGKILLed
peer resets its connections, so the readers notice at once; the heartbeat timeout bounds the
silent case). Every downstream's bytes are checked against the trainer's content hash (the
system verifies checksums too), and after the runs no killed relay may still be listed.

Usage: python benchmarks/bench_cluster_masking.py [--size-mib 128] [--host-rate 400mbit]
       [--points 30,50] [--repeat 3] [--downstreams 2] [--heartbeat-timeout 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cluster import Cluster, available, leftovers
from benchmarks.cluster_jobs import (
    MIB,
    Job,
    JobError,
    Proc,
    median,
    publish,
    rate_bytes,
)
from benchmarks.harness import write_json  # noqa: E402


def spec(downstreams: int) -> dict[str, list[str]]:
    return {"dc-a": ["ctl", "t1", "relay", *[f"d{i}" for i in range(1, downstreams + 1)]]}


def one_run(job: Job, server: str, trainer: Proc, downs: Sequence[Proc], version: int, size: int,
            kill_at: float | None, worker_kw: dict[str, Any], timeout: float) -> dict[str, Any]:  # fmt: skip
    """One chain run (a fresh relay); ``kill_at``: fraction of d1's pull at which the relay dies."""
    relay = job.worker("relay", "rollout", f"relay-{version}", server, size, **worker_kw)
    trainer_hash = publish([trainer], version)[0]["hash"]
    m = relay.mark()
    relay.send(f"replicate {version}")
    relay.granted(version, m, timeout, "the relay's first verified read", min_verified=1)
    marks = {}
    for d in downs:
        marks[d.name] = d.mark()
        d.send(f"replicate {version}")
        d.granted(version, marks[d.name], timeout, f"{d.name}'s grant")
    killed = None
    if kill_at is not None:
        downs[0].granted(version, marks[downs[0].name], timeout, f"{downs[0].name} at {kill_at:.0%}",
                 min_verified=int(kill_at * size))  # fmt: skip
        t_kill = time.monotonic()
        relay_at = relay.verified(version)
        relay.kill()
        killed = {"t": t_kill, "d1_verified": downs[0].verified(version), "relay_verified": relay_at}
    pulled = [d.expect("pulled", timeout, since=marks[d.name], version=version) for d in downs]
    if kill_at is None:
        relay.expect("pulled", timeout, since=m, version=version)
        job.stop([relay])
    hosts = []
    for d, ev in zip(downs, pulled):
        hosts.append({"host": d.host, "replica": ev["replica"], "latency_s": ev["latency_s"], "stall_s": ev["stall_s"],
                      "bytes": ev["bytes"], "grants": ev["grants"], "sources": ev["sources"],
                      "transports": ev["transports"], "bytes_ok": ev["hash"] == trainer_hash and ev["bytes"] >= size})  # fmt: skip
    chained = bool(pulled[0]["sources"]) and pulled[0]["sources"][0].startswith(f"relay-{version}/")
    chained = chained and all(ev["sources"] and ev["sources"][0].startswith(f"{prev.name}/")
                              for prev, ev in zip(downs, pulled[1:]))  # fmt: skip
    return {"version": version, "kill_at": kill_at, "killed": killed, "chained": chained, "hosts": hosts,
            "hash": trainer_hash}  # fmt: skip


def run_masking(cluster: Cluster, size: int, points: Sequence[float], repeat: int, *, downstreams: int,
                heartbeat_timeout: float, chunk: int, streams: int, link: float, timeout: float = 300.0,
                keep_logs: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Fault-free runs and fault runs at each point, ``repeat`` times each, interleaved;
    returns every run and a summary per point (see the module docstring).

    Raises:
        JobError: a process failed, or an event did not come in time.
    """
    env = {"TENSORHUB_CHUNK_BYTES": str(chunk)}
    worker_kw = {"open_kw": {"transports": {"tcp": {"streams": streams}}}, "extra": ["--progress-ms", "10"]}
    flags = ["--heartbeat-timeout", f"{heartbeat_timeout:g}", "--heartbeat-interval", f"{heartbeat_timeout / 10:g}"]
    runs: list[dict[str, Any]] = []
    with Job(cluster, env=env, keep_logs=keep_logs) as job:
        srv = job.server("ctl", flags)
        specs = [{"host": "t1", "role": "trainer", "replica": "trainer", "server": srv.address, "size_bytes": size,
                  "open_kw": worker_kw["open_kw"]}]  # fmt: skip
        specs += [{"host": f"d{i}", "role": "rollout", "replica": f"d{i}", "server": srv.address, "size_bytes": size,
                   **worker_kw} for i in range(1, downstreams + 1)]  # fmt: skip
        trainer, *downs = job.workers(specs)
        plan = [None, *points] * repeat
        for version, kill_at in enumerate(plan, start=1):
            r = one_run(job, srv.address, trainer, downs, version, size, kill_at, worker_kw, timeout)
            runs.append(r)
            d1 = r["hosts"][0]
            at = (f"killed at d1 {r['killed']['d1_verified'] / size:.0%} / relay {r['killed']['relay_verified'] / size:.0%}"
                  if r["killed"] else "no failure")  # fmt: skip
            log(f"  v{version}: {at}: " + ", ".join(f"{h['host']} {h['latency_s']:.2f} s" for h in r["hosts"])
                + f", d1 sources {d1['sources']}" + ("" if r["chained"] else "  (NOT CHAINED)")
                + ("" if all(h["bytes_ok"] for h in r["hosts"]) else "  WRONG BYTES"))  # fmt: skip
        # the killed relays' replicas are removed after the heartbeat timeout: none may stay listed
        listed: list[str] = []
        deadline = time.monotonic() + 3 * heartbeat_timeout + 5
        for _ in range(200):
            m = trainer.mark()
            trainer.send("list")
            ev = trainer.expect("listing", 30.0, since=m)
            listed = sorted({r for reps in ev["versions"].values() for r in reps if r.startswith("relay-")})
            if not listed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    return {"runs": runs, "summary": summarize(runs, points, downstreams, size, heartbeat_timeout, link),
            "relays_still_listed": listed}  # fmt: skip


def summarize(runs: Sequence[dict[str, Any]], points: Sequence[float], downstreams: int, size: int,
              heartbeat_timeout: float, link: float) -> list[dict[str, Any]]:  # fmt: skip
    base = {i: median(r["hosts"][i]["latency_s"] for r in runs if r["kill_at"] is None) for i in range(downstreams)}
    rows = [{"kill_at": None, "host": f"d{i + 1}", "latency_s": base[i], "extra_s": 0.0, "bound_s": None,
             "runs": sum(1 for r in runs if r["kill_at"] is None)} for i in range(downstreams)]  # fmt: skip
    for p in points:
        rs = [r for r in runs if r["kill_at"] == p]
        for i in range(downstreams):
            lat = median(r["hosts"][i]["latency_s"] for r in rs)
            bound = median(heartbeat_timeout + (size - r["killed"]["d1_verified"]) / link for r in rs)
            rows.append({"kill_at": p, "host": f"d{i + 1}", "latency_s": lat, "extra_s": lat - base[i],
                         "bound_s": bound, "killed_at_d1": median(r["killed"]["d1_verified"] / size for r in rs),
                         "killed_at_relay": median(r["killed"]["relay_verified"] / size for r in rs),
                         "regrants": median(r["hosts"][i]["grants"] for r in rs), "runs": len(rs)})  # fmt: skip
    return rows


def print_table(rows: Sequence[dict[str, Any]], out: Callable[[str], None] = print) -> None:
    out(f"  {'relay killed':<14} {'reader':<6} {'latency s':>9} {'extra s':>8} {'bound s':>8} {'grants':>6}  goal")
    for r in rows:
        if r["kill_at"] is None:
            out(f"  {'never':<14} {r['host']:<6} {r['latency_s']:>9.2f} {'-':>8} {'-':>8} {1:>6}")
            continue
        at = f"at {r['killed_at_d1']:.0%} (d1)"
        ok = r["extra_s"] <= r["bound_s"]
        out(f"  {at:<14} {r['host']:<6} {r['latency_s']:>9.2f} {r['extra_s']:>8.2f} {r['bound_s']:>8.2f} "
            f"{r['regrants']:>6.0f}  extra <= bound: {'PASS' if ok else 'FAIL'}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=128.0, help="bytes per version (one shard), MiB")
    ap.add_argument("--host-rate", default="400mbit", help="every host's egress rate (tc)")
    ap.add_argument("--points", default="30,50", help="percent of d1's pull at which the relay dies")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each kind (the median is reported)")
    ap.add_argument("--downstreams", type=int, default=2, help="readers chained behind the relay")
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0, help="the server's (interval: a tenth)")
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="$TENSORHUB_CHUNK_BYTES, MiB")
    ap.add_argument("--streams", type=int, default=1, help="tcp streams per pull")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep-logs", action="store_true")
    a = ap.parse_args(argv)
    points = [int(p) / 100 for p in a.points.split(",") if p.strip()]
    if not points or any(not 0 < p < 1 for p in points) or a.repeat < 1 or a.downstreams < 1 or a.size_mib <= 0:
        ap.error("points: percentages in (0, 100); --repeat, --downstreams >= 1; --size-mib > 0")
    reason = available()
    if reason:
        print(f"cannot build an emulated cluster here: {reason}", file=sys.stderr)
        return 2
    size, link = int(a.size_mib * MIB), rate_bytes(a.host_rate)
    chain = " -> ".join(["trainer", "relay", *[f"d{i}" for i in range(1, a.downstreams + 1)]])
    print(f"failure masking: {chain}, {size / MIB:g} MiB, hosts at {a.host_rate} (one transfer ideally "
          f"{size / link:.2f} s), relay SIGKILLed at {', '.join(f'{p:.0%}' for p in points)} of d1's pull, "
          f"heartbeat timeout {a.heartbeat_timeout:g} s, {a.repeat} runs each", flush=True)  # fmt: skip
    with Cluster(spec(a.downstreams), host_rate=a.host_rate) as cluster:
        prefix = cluster.prefix
        try:
            result = run_masking(cluster, size, points, a.repeat, downstreams=a.downstreams,
                                 heartbeat_timeout=a.heartbeat_timeout, chunk=int(a.chunk_mib * MIB),
                                 streams=a.streams, link=link, timeout=a.timeout, keep_logs=a.keep_logs,
                                 log=lambda s: print(s, flush=True))  # fmt: skip
        except JobError as err:
            print(f"FAILED: {err}", file=sys.stderr)
            return 1
    left = leftovers(prefix)
    print()
    print_table(result["summary"])
    runs = result["runs"]
    ok = all(r["extra_s"] <= r["bound_s"] for r in result["summary"] if r["kill_at"] is not None)
    bad_bytes = [r["version"] for r in runs if not all(h["bytes_ok"] for h in r["hosts"])]
    unchained = [r["version"] for r in runs if not r["chained"]]
    tcp = all(set(h["transports"]) <= {"tcp"} for r in runs for h in r["hosts"])
    print(f"{'PASS' if ok else 'FAIL'}: every reader's extra delay <= heartbeat timeout + d1's remaining transfer")
    print(f"{'PASS' if not bad_bytes and tcp else 'FAIL'}: every reader holds the trainer's bytes (content hash), "
          f"over tcp{'' if not bad_bytes else f'; wrong in versions {bad_bytes}'}")  # fmt: skip
    print(f"{'PASS' if not unchained else 'FAIL'}: the chain trainer -> relay -> d1 ... formed in every run"
          + ("" if not unchained else f" (not in versions {unchained})"))  # fmt: skip
    listed = result["relays_still_listed"]
    print(f"{'PASS' if not listed else 'FAIL'}: no killed relay still listed by the server"
          + ("" if not listed else f" ({', '.join(listed)})"))  # fmt: skip
    print(f"teardown: {'clean' if not left else 'LEFT ' + '; '.join(left)}")
    if a.json:
        result.update(config={"size_bytes": size, "host_rate": a.host_rate, "points": points, "repeat": a.repeat,
                              "downstreams": a.downstreams, "heartbeat_timeout": a.heartbeat_timeout,
                              "chunk_bytes": int(a.chunk_mib * MIB), "streams": a.streams, "prefix": prefix},
                      leftovers=left)  # fmt: skip
        write_json(a.json, result)
    return 0 if ok and not bad_bytes and tcp and not unchained and not listed and not left else 1


if __name__ == "__main__":
    sys.exit(main())
