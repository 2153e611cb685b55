"""Bursts on the emulated cluster: one trainer host and N rollout hosts pull one version at once,
with pipeline replication on and off.

Workload: one version of ``--size-mib`` pulled at once by N = 1, 2, 4, 6 rollout hosts of the
emulated cluster, over ``tcp`` at ``--host-rate``, pipelining on and off, ``--repeat`` rounds.
Baseline: N = 1 of the same mode in the same run.
Goal: with pipelining, N = 6 within 1.3x N = 1; without, about Nx (0.75 N .. 1.25 N).

Every host is a network namespace of one datacenter with its egress shaped to ``--host-rate``
(``benchmarks/cluster.py``); the real server runs on a host of its own (``ctl``), the trainer on
``t1``, one rollout replica per host on ``r1`` .. ``rN``; every byte moves over ``tcp`` across
the emulated links (``benchmarks/cluster_jobs.py``). For each mode (the server with and without
``--no-pipeline``) one set of processes is started, a warm-up burst at the largest N is run,
then ``--repeat`` rounds of N = 1, 2, 4, 6 (interleaved, so drift hits every N alike). A burst:
the trainer publishes version v; once published, every rollout of the burst is told
``replicate v`` at once; *total* is the time from that go until the last rollout holds v, a
host's *stall* the time inside its ``replicate`` call. The median over rounds is reported, and
its ratio to N = 1 of the same mode.

Goal (the issue's): with pipelining, N = 6 within 1.3x the time of N = 1; without, about Nx
(checked as 0.75 N .. 1.25 N).

Choices (measured here, pipelining on, N = 6 against N = 1, median of 3):

- ``$TENSORHUB_CHUNK_BYTES`` = 4 MiB (the checksum unit, so the smallest read the engine
  makes) and ``streams`` = 1 (a ``tcp`` transport option, passed through
  ``open(transports=...)``). A partial holder serves a read only once it has verified all of
  it, and a reader runs ``streams`` reads at once, so each hop of a chain lags its upstream by
  about ``streams x read`` bytes: 4 MiB, ~84 ms at 400 Mbit/s (measured: ~0.13 s per hop). With
  the defaults (4 streams x 8 MiB reads) a hop costs ~0.7 s: N = 6 took 2.31x N = 1 at
  128 MiB. One stream still pulls at ~94 % of the host rate.
- 128 MiB per version (2.7 s at 400 Mbit/s): N = 6 took 1.23x. At 64 MiB it took 1.39x (the
  five hops weigh twice as much), at 256 MiB 1.13x (but the no-pipeline N = 6 burst takes 34 s
  instead of 17 s).

Bytes are checked: every rollout's content hash must equal the trainer's for that version, and
every edge must be ``tcp``. CPU use from the go to the last pull is reported as a fraction of
all cores (all hosts share them): ``job`` is the user + system time of this job's processes,
``all`` the whole machine (the kernel's forwarding between namespaces, and anything else that
runs here meanwhile). ``all`` near 100 % means the figures measure the CPU, not the links.

Usage: python benchmarks/bench_bursts.py [--size-mib 128] [--ns 1,2,4,6] [--repeat 3]
       [--modes pipeline,no-pipeline] [--host-rate 400mbit] [--chunk-mib 4] [--streams 1]
       [--json FILE] [--keep-logs]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cluster import (
    Cluster,
    ClusterError,
    available,
    leftovers,
    measure_throughput,
)
from benchmarks.cluster_jobs import (
    MIB,
    CpuMeter,
    Job,
    JobError,
    burst,
    chain_depth,
    median,
    rate_bytes,
)
from benchmarks.harness import write_json  # noqa: E402

MODES = {"pipeline": (), "no-pipeline": ("--no-pipeline",)}
PIPELINE_GOAL = 1.3  # N = max within this many times N = 1, with pipelining
FANOUT_BAND = (0.75, 1.25)  # without: ratio within this many times N


def spec(n_max: int) -> dict[str, list[str]]:
    return {"dc-a": ["ctl", "t1", *[f"r{i}" for i in range(1, n_max + 1)]]}


def run_mode(cluster: Cluster, mode: str, ns: Sequence[int], repeat: int, size: int, *, chunk: int, streams: int,
             warmup: bool = True, timeout: float = 300.0, keep_logs: bool = False,
             log: Callable[[str], None] = print) -> list[dict[str, Any]]:  # fmt: skip
    """All bursts of one mode on ``cluster`` (built from :func:`spec`); one record per burst.

    Raises:
        JobError: a process failed, or a burst did not finish within ``timeout``.
    """
    env = {"TENSORHUB_CHUNK_BYTES": str(chunk)}
    open_kw = {"transports": {"tcp": {"streams": streams}}}
    n_max = max(ns)
    records: list[dict[str, Any]] = []
    with Job(cluster, env=env, keep_logs=keep_logs) as job:
        srv = job.server("ctl", MODES[mode])
        specs = [{"host": "t1", "role": "trainer", "replica": "trainer", "server": srv.address, "size_bytes": size,
                  "open_kw": open_kw}]  # fmt: skip
        specs += [{"host": f"r{i}", "role": "rollout", "replica": f"r{i}", "server": srv.address, "size_bytes": size,
                   "open_kw": open_kw} for i in range(1, n_max + 1)]  # fmt: skip
        t0 = time.monotonic()
        trainer, *rollouts = job.workers(specs, timeout=60.0 + 10.0 * len(specs))
        pids = [p.popen.pid for p in job.procs]
        log(f"  [{mode}] server on ctl, trainer and {len(rollouts)} rollouts ready in {time.monotonic() - t0:.1f} s")
        plan = ([(n_max, -1)] if warmup else []) + [(n, rep) for rep in range(repeat) for n in ns]
        for version, (n, rep) in enumerate(plan, start=1):
            b = burst([trainer], rollouts[:n], version, timeout=timeout, cpu=CpuMeter(pids))
            rec = _record(mode, n, rep, b, size)
            if rep >= 0:
                records.append(rec)
            log(f"  [{mode}] N={n} {'warm-up' if rep < 0 else f'round {rep + 1}'}: total {rec['total_s']:.2f} s, "
                f"max stall {rec['max_stall_s']:.2f} s, depth {rec['depth']}, "
                f"cpu job {rec['cpu_job']:.0%} / machine {rec['cpu_machine']:.0%}"
                + ("" if rec["bytes_ok"] else "  WRONG BYTES"))  # fmt: skip
    return records


def _record(mode: str, n: int, rep: int, b: dict[str, Any], size: int) -> dict[str, Any]:
    stalls = [ev["stall_s"] for ev in b["pulled"]]
    return {
        "mode": mode, "n": n, "round": rep, "version": b["version"], "total_s": b["total_s"],
        "mean_stall_s": sum(stalls) / len(stalls), "max_stall_s": max(stalls),
        "cpu_job": b["cpu"]["job"], "cpu_machine": b["cpu"]["machine"],
        "depth": chain_depth(b["pulled"]),
        "bytes_ok": all(ev["hash"] == b["hash"] and ev["bytes"] >= size for ev in b["pulled"]),
        "tcp_only": all(set(ev["transports"]) <= {"tcp"} and ev["transports"] for ev in b["pulled"]),
        "hosts": [{k: ev[k] for k in ("host", "stall_s", "latency_s", "bytes", "grants", "sources", "transports", "hash")}
                  for ev in b["pulled"]],
    }  # fmt: skip


def summarize(records: Sequence[dict[str, Any]], modes: Sequence[str], ns: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for mode in modes:
        base = median(r["total_s"] for r in records if r["mode"] == mode and r["n"] == min(ns))
        for n in ns:
            rs = [r for r in records if r["mode"] == mode and r["n"] == n]
            total = median(r["total_s"] for r in rs)
            rows.append({"mode": mode, "n": n, "runs": len(rs), "total_s": total,
                         "mean_stall_s": median(r["mean_stall_s"] for r in rs),
                         "max_stall_s": median(r["max_stall_s"] for r in rs),
                         "ratio": total / base if base and not math.isnan(base) else math.nan,
                         "depth": max((r["depth"] for r in rs), default=0),
                         "cpu_job": median(r["cpu_job"] for r in rs),
                         "cpu_machine": median(r["cpu_machine"] for r in rs)})  # fmt: skip
    return rows


def verdicts(rows: Sequence[dict[str, Any]], ns: Sequence[int]) -> list[dict[str, Any]]:
    n = max(ns)
    out = []
    for row in rows:
        if row["n"] != n or min(ns) != 1 or n == 1:
            continue
        if row["mode"] == "pipeline":
            ok = row["ratio"] <= PIPELINE_GOAL
            what = f"pipelining: N={n} took {row['ratio']:.2f}x N=1 (goal <= {PIPELINE_GOAL})"
        else:
            lo, hi = FANOUT_BAND[0] * n, FANOUT_BAND[1] * n
            ok = lo <= row["ratio"] <= hi
            what = f"no pipelining: N={n} took {row['ratio']:.2f}x N=1 (goal about {n}x: {lo:.1f}..{hi:.1f})"
        out.append({"mode": row["mode"], "ok": ok, "what": what})
    return out


def print_table(rows: Sequence[dict[str, Any]], out: Callable[[str], None] = print) -> None:
    out(f"  {'N':>2}  {'pipelining':<10} {'total s':>8} {'mean stall':>10} {'max stall':>9} {'x N=1':>6} "
        f"{'depth':>5} {'cpu job/all':>11}  runs")  # fmt: skip
    for r in rows:
        out(f"  {r['n']:>2}  {('on' if r['mode'] == 'pipeline' else 'off'):<10} {r['total_s']:>8.2f} "
            f"{r['mean_stall_s']:>10.2f} {r['max_stall_s']:>9.2f} {r['ratio']:>6.2f} {r['depth']:>5} "
            f"{r['cpu_job']:>6.0%}/{r['cpu_machine']:<4.0%}  {r['runs']}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=128.0, help="bytes per version (one shard), MiB")
    ap.add_argument("--ns", default="1,2,4,6", help="rollout hosts per burst")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (the median is reported)")
    ap.add_argument("--modes", default="pipeline,no-pipeline")
    ap.add_argument("--host-rate", default="400mbit", help="every host's egress rate (tc)")
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="$TENSORHUB_CHUNK_BYTES, MiB")
    ap.add_argument("--streams", type=int, default=1, help="tcp streams per pull")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--timeout", type=float, default=300.0, help="per burst, seconds")
    ap.add_argument("--json", default=None, help="write every burst and the summary here")
    ap.add_argument("--keep-logs", action="store_true", help="keep every process's log")
    a = ap.parse_args(argv)
    ns = sorted({int(x) for x in a.ns.split(",")})
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not ns or ns[0] < 1 or a.repeat < 1 or a.size_mib <= 0 or any(m not in MODES for m in modes):
        ap.error(f"--ns: integers >= 1; --repeat >= 1; --size-mib > 0; --modes among {', '.join(MODES)}")
    reason = available()
    if reason:
        print(f"cannot build an emulated cluster here: {reason}", file=sys.stderr)
        return 2
    size = int(a.size_mib * MIB)
    chunk = int(a.chunk_mib * MIB)
    link = rate_bytes(a.host_rate)
    print(f"bursts: 1 trainer -> N rollouts (one per host, one datacenter), {size / MIB:g} MiB per version, "
          f"hosts at {a.host_rate} (one transfer ideally {size / link:.2f} s), $TENSORHUB_CHUNK_BYTES={chunk}, "
          f"{a.streams} tcp stream(s) per pull, median of {a.repeat}", flush=True)  # fmt: skip
    records: list[dict[str, Any]] = []
    with Cluster(spec(max(ns)), host_rate=a.host_rate) as cluster:
        prefix = cluster.prefix
        try:
            raw = measure_throughput(cluster, "t1", "r1", min(size, 64 * MIB), timeout=60.0) / 8
            print(f"  raw tcp t1 -> r1 (one socket, sendall/recv): {raw / 1e6:.1f} MB/s = {raw / link:.0%} of the host rate",
                  flush=True)  # fmt: skip
            for mode in modes:
                records += run_mode(cluster, mode, ns, a.repeat, size, chunk=chunk, streams=a.streams,
                                    warmup=not a.no_warmup, timeout=a.timeout, keep_logs=a.keep_logs,
                                    log=lambda s: print(s, flush=True))  # fmt: skip
        except (JobError, ClusterError) as err:
            print(f"FAILED: {err}", file=sys.stderr)
            return 1
    left = leftovers(prefix)
    rows = summarize(records, modes, ns)
    print()
    print_table(rows)
    single = [r for r in rows if r["n"] == 1]
    for r in single:
        got = size / r["total_s"]
        print(f"  one rollout ({'pipelining ' + ('on' if r['mode'] == 'pipeline' else 'off')}): {got / 1e6:.1f} MB/s "
              f"= {got / link:.0%} of the host rate, {got / raw:.0%} of raw tcp (go to holding, all included)")  # fmt: skip
    ok = True
    checks = verdicts(rows, ns)
    for v in checks:
        print(f"{'PASS' if v['ok'] else 'FAIL'}: {v['what']}")
        ok = ok and v["ok"]
    bad = [r for r in records if not r["bytes_ok"] or not r["tcp_only"]]
    print(f"{'PASS' if not bad else 'FAIL'}: every rollout holds the trainer's bytes over tcp "
          f"({len(records)} bursts{'' if not bad else ', ' + str(len(bad)) + ' wrong'})")  # fmt: skip
    print(f"teardown: {'clean' if not left else 'LEFT ' + '; '.join(left)}")
    ok = ok and not bad and not left
    if a.json:
        config = {"size_bytes": size, "ns": ns, "repeat": a.repeat, "modes": modes, "host_rate": a.host_rate,
                  "chunk_bytes": chunk, "streams": a.streams, "prefix": prefix}  # fmt: skip
        result = {"config": config, "raw_tcp_bytes_per_s": raw, "bursts": records, "summary": rows,
                  "verdicts": checks, "leftovers": left}  # fmt: skip
        write_json(a.json, result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
