"""Stragglers on the emulated cluster (issue 23): a relay slowed to 5 % of its link mid-pull.

Workload: a ``--size-mib`` version on the emulated cluster pulled along trainer -> relay ->
d1 .. dK over ``tcp``, the relay's link slowed to ``--slow-fraction`` mid-pull.
Baseline: fault-free runs of the same layout, alternating with the slow ones in the same run.
Goal: each reader's latency with the slow relay <= 1.5x without (issue 23).

The hosts of one datacenter, each a network namespace with its link shaped to ``--host-rate``
(``benchmarks/cluster.py``; the server's port in a control-plane class of its own): the real
server on ``ctl`` (straggler detection on, ``--straggler-window``), the trainer on ``t1``, a
relay rollout on ``relay`` and ``--readers`` rollouts on ``d1`` .. ``dK``; every byte crosses
the emulated links over ``tcp`` (``benchmarks/cluster_jobs.py``).

One run: the trainer publishes version v; the relay starts ``replicate(v)`` and, once it
verified its first read, the readers start theirs one after another (each once the one before
it was granted), so that pipeline replication chains them: trainer -> relay -> d1 -> d2 ...
(checked from each pull's first source). In a *slow* run, when d1 has verified a seeded
fraction of the shard (drawn in ``--slow-at``), the relay's link is shaped, both ways, to
``--slow-fraction`` of its rate (``Cluster.slow``: alive, nothing closed, nothing dropped). Its
readers are held back by it; the server sees their progress stall, revokes their grants and
grants them a faster source (the trainer), keeping what they verified. Once every reader holds
v the relay is healed and finishes too. Fault-free runs of the same layout alternate with slow
runs in the same invocation (``--rounds`` of each, medians).

Reported: each reader's latency (from its ``replicate`` call to holding v) with and without the
slow relay, their ratio, the longest each reader's pull stood still after the slowing (``stood``:
the detection, the move, and the read it had in flight from the relay, which lands first at the
relay's slowed pace), the ratio of the last reader's completion (from the relay's go), the
server's re-grants (its ``stragglers`` counter, from ``tensorhub status --json``, per run), each
reader's grants, and the seeds. Goal: ratio <= 1.5 (issue 23). Every reader's bytes are checked
against the trainer's content hash.

Usage: python benchmarks/bench_stragglers.py [--size-mib 96] [--host-rate 100mbit] [--readers 2]
       [--rounds 3] [--slow-fraction 0.05] [--slow-at 0.15,0.35] [--straggler-window 2]
       [--seed 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cluster import Cluster, _rate_bits, available, leftovers
from benchmarks.cluster_jobs import MIB, SERVER_PORT, Job, JobError, Proc, publish, rate_bytes
from benchmarks.harness import median, write_json  # noqa: E402

GOAL = 1.5  # issue 23: the slow relay's readers finish within 1.5x of a fault-free run


def spec(readers: int) -> dict[str, list[str]]:
    return {"dc-a": ["ctl", "t1", "relay", *[f"d{i}" for i in range(1, readers + 1)]]}


def server_flags(window: float, ratio: float, seed: int) -> list[str]:
    """Short heartbeats (the server ticks every interval), straggler detection on."""
    return ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "5", "--straggler-window", f"{window:g}",
            "--straggler-ratio", f"{ratio:g}", "--seed", str(seed)]  # fmt: skip


def server_stats(cluster: Cluster, host: str, address: str, timeout: float = 30.0) -> dict[str, int]:
    """The server's counters (``stats`` of ``tensorhub status --json``), asked from ``host``'s
    namespace (the server listens on a namespace address)."""
    proc = cluster.run(host, [sys.executable, "-m", "tensorhub", "status", "--server", address, "--json"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=5)
        raise JobError(f"`tensorhub status` on {host} did not answer within {timeout:g} s") from None
    try:
        return dict(json.loads(out)["stats"])
    except (ValueError, KeyError, TypeError):
        raise JobError(f"`tensorhub status` on {host}: unreadable answer: {out[-300:]} {err[-500:]}") from None


def one_run(cluster: Cluster, trainer: Proc, relay: Proc, readers: Sequence[Proc], version: int, size: int,
            slow_at: float | None, slow_rate: str, timeout: float) -> dict[str, Any]:  # fmt: skip
    """One chain run; ``slow_at``: the fraction of d1's pull at which the relay's link is slowed
    (None: a fault-free run). The readers get ``timeout`` seconds; the relay, healed, as long."""
    trainer_hash = publish([trainer], version)[0]["hash"]
    m = relay.mark()
    t_go = time.monotonic()
    relay.send(f"replicate {version}")
    relay.granted(version, m, timeout, "the relay's first verified read", min_verified=1)
    marks = {}
    for d in readers:
        marks[d.name] = d.mark()
        d.send(f"replicate {version}")
        d.granted(version, marks[d.name], timeout, f"{d.name}'s grant")
    slowed = None
    fault = None
    try:
        if slow_at is not None:
            readers[0].granted(version, marks[readers[0].name], timeout, f"{readers[0].name} at {slow_at:.0%}",
                     min_verified=int(slow_at * size))  # fmt: skip
            relay_at = relay.verified(version)
            fault = cluster.slow("relay", slow_rate)
            slowed = {"t": time.monotonic(), "d1_verified": readers[0].verified(version), "relay_verified": relay_at}
        pulled = [d.expect("pulled", timeout, since=marks[d.name], version=version) for d in readers]
    finally:
        if fault is not None:
            cluster.heal(fault)
    relay_pulled = relay.expect("pulled", timeout, since=m, version=version)
    hosts = []
    for d, ev in zip(readers, pulled):
        hosts.append({"host": d.host, "replica": ev["replica"], "latency_s": ev["latency_s"], "bytes": ev["bytes"],
                      "grants": ev["grants"], "sources": ev["sources"], "transports": ev["transports"],
                      "bytes_ok": ev["hash"] == trainer_hash,
                      "stood_s": _stood(d, version, slowed["t"], ev["t_end"]) if slowed is not None else None})  # fmt: skip
    chained = bool(pulled[0]["sources"]) and pulled[0]["sources"][0].startswith(f"{relay.name}/")
    chained = chained and all(ev["sources"] and ev["sources"][0].startswith(f"{prev.name}/")
                              for prev, ev in zip(readers, pulled[1:]))  # fmt: skip
    return {"version": version, "slow_at": slow_at, "slowed": slowed, "chained": chained, "hosts": hosts,
            "all_s": max(ev["t_end"] for ev in pulled) - t_go, "relay_s": relay_pulled["latency_s"],
            "relay_ok": relay_pulled["hash"] == trainer_hash, "hash": trainer_hash}  # fmt: skip


def _stood(p: Proc, version: int, t0: float, t_end: float) -> float:
    """The longest ``p``'s verified prefix stood still between ``t0`` (the relay slowed) and
    ``t_end`` (it held the version): the detection, the move, and the read it had in flight
    from the relay, which lands first at the relay's slowed pace."""
    times = sorted(ev["t"] for ev in list(p.events) if ev.get("event") == "progress" and ev.get("version") == version
                   and t0 < ev["t"] <= t_end)  # fmt: skip
    marks = [t0, *times, t_end]
    return max(b - a for a, b in itertools.pairwise(marks))


def run_stragglers(cluster: Cluster, size: int, rounds: int, *, readers: int, slow_fraction: float,
                   slow_at: tuple[float, float], window: float, ratio: float, seed: int, chunk: int,
                   timeout: float = 300.0, keep_logs: bool = False, warmup: bool = True,
                   log: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """``rounds`` fault-free runs and ``rounds`` slow runs, alternating (a fault-free run first,
    so the server has the link's rate; with ``warmup``, one more before them, not counted: the
    first pulls of fresh processes are slower); returns every run, the server's re-grants per run and a
    summary (see the module docstring).

    Raises:
        JobError: a process failed, or an event did not come in time.
    """
    rng = random.Random(seed)
    slow_rate = f"{max(int(_rate_bits(cluster.host_rate) * slow_fraction), 8000)}bit"
    env = {"TENSORHUB_CHUNK_BYTES": str(chunk)}
    worker_kw = {"open_kw": {"transports": {"tcp": {"streams": 1}}}, "extra": ["--progress-ms", "10"]}
    runs: list[dict[str, Any]] = []
    with Job(cluster, env=env, keep_logs=keep_logs) as job:
        srv = job.server("ctl", server_flags(window, ratio, seed))
        specs = [{"host": "t1", "role": "trainer", "replica": "trainer", "server": srv.address, "size_bytes": size,
                  "open_kw": worker_kw["open_kw"]},
                 {"host": "relay", "role": "rollout", "replica": "relay", "server": srv.address, "size_bytes": size,
                  **worker_kw}]  # fmt: skip
        specs += [{"host": f"d{i}", "role": "rollout", "replica": f"d{i}", "server": srv.address, "size_bytes": size,
                   **worker_kw} for i in range(1, readers + 1)]  # fmt: skip
        trainer, relay, *downs = job.workers(specs)
        first = 1
        if warmup:
            w = one_run(cluster, trainer, relay, downs, first, size, None, slow_rate, timeout)
            log(f"  v{first}: warm-up (not counted), all {w['all_s']:.2f} s")
            first += 1
        before = server_stats(cluster, "ctl", srv.address)
        for version in range(first, first + 2 * rounds):
            at = None if (version - first) % 2 == 0 else round(rng.uniform(*slow_at), 3)
            r = one_run(cluster, trainer, relay, downs, version, size, at, slow_rate, timeout)
            after = server_stats(cluster, "ctl", srv.address)
            r["regrants"] = after.get("stragglers", 0) - before.get("stragglers", 0)
            r["revoked"] = after.get("revoked", 0) - before.get("revoked", 0)
            before = after
            runs.append(r)
            what = (f"relay slowed to {slow_rate} at d1 {r['slowed']['d1_verified'] / size:.0%} "
                    f"(relay {r['slowed']['relay_verified'] / size:.0%})" if r["slowed"] else "no fault")  # fmt: skip
            log(f"  v{version}: {what}: " + ", ".join(f"{h['host']} {h['latency_s']:.2f} s ({h['grants']} grants"
                                                      + (f", stood still {h['stood_s']:.1f} s" if h["stood_s"] is not None else "")
                                                      + ")" for h in r["hosts"])
                + f", all {r['all_s']:.2f} s, relay {r['relay_s']:.2f} s, re-grants {r['regrants']}"
                + ("" if r["chained"] else "  (NOT CHAINED)")
                + ("" if all(h["bytes_ok"] for h in r["hosts"]) and r["relay_ok"] else "  WRONG BYTES"))  # fmt: skip
        totals = before
    return {"runs": runs, "summary": summarize(runs, readers), "slow_rate": slow_rate, "server_stats": totals}


def summarize(runs: Sequence[dict[str, Any]], readers: int) -> dict[str, Any]:
    """Per reader and for the last reader's completion: the fault-free and slow medians and
    their ratio; the re-grants in slow and in fault-free runs."""
    free = [r for r in runs if r["slow_at"] is None]
    slow = [r for r in runs if r["slow_at"] is not None]
    rows = []
    for i in range(readers):
        a = median(r["hosts"][i]["latency_s"] for r in free)
        b = median(r["hosts"][i]["latency_s"] for r in slow)
        stood = [r["hosts"][i]["stood_s"] for r in slow if r["hosts"][i].get("stood_s") is not None]
        rows.append({"reader": f"d{i + 1}", "free_s": a, "slow_s": b, "ratio": b / a,
                     "grants": median(r["hosts"][i]["grants"] for r in slow),
                     "stood_s": median(stood) if stood else None})  # fmt: skip
    a, b = median(r["all_s"] for r in free), median(r["all_s"] for r in slow)
    return {"readers": rows, "all": {"free_s": a, "slow_s": b, "ratio": b / a},
            "ratio": max([b / a, *(row["ratio"] for row in rows)]),
            "regrants_slow": [r["regrants"] for r in slow], "regrants_free": [r["regrants"] for r in free]}  # fmt: skip


def print_table(summary: dict[str, Any], out: Callable[[str], None] = print) -> None:
    out(f"  {'reader':<12} {'fault-free s':>12} {'relay slow s':>12} {'ratio':>6} {'grants':>6} {'stood s':>8}")
    for row in summary["readers"]:
        stood = f"{row['stood_s']:>8.2f}" if row.get("stood_s") is not None else f"{'-':>8}"
        out(f"  {row['reader']:<12} {row['free_s']:>12.2f} {row['slow_s']:>12.2f} {row['ratio']:>6.2f} {row['grants']:>6.0f} {stood}")
    a = summary["all"]
    out(f"  {'all readers':<12} {a['free_s']:>12.2f} {a['slow_s']:>12.2f} {a['ratio']:>6.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=96.0, help="bytes per version (one shard), MiB")
    ap.add_argument("--host-rate", default="100mbit", help="every host's link rate (tc)")
    ap.add_argument("--readers", type=int, default=2, help="readers chained behind the relay")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each kind, alternating (medians are reported)")
    ap.add_argument("--slow-fraction", type=float, default=0.05, help="the slowed relay's rate, a fraction of its link's")
    ap.add_argument("--slow-at", default="0.15,0.35", help="d1's pull fraction at which the relay slows: drawn in LO,HI")
    ap.add_argument("--straggler-window", type=float, default=2.0, help="the server's --straggler-window, seconds")
    ap.add_argument("--straggler-ratio", type=float, default=0.25, help="the server's --straggler-ratio")
    ap.add_argument("--seed", type=int, default=0, help="the server's scheduling seed and the slow points' seed")
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="$TENSORHUB_CHUNK_BYTES, MiB")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep-logs", action="store_true")
    a = ap.parse_args(argv)
    lo, hi = (float(x) for x in a.slow_at.split(","))
    if not 0 < lo <= hi < 1 or not 0 < a.slow_fraction < 1 or a.rounds < 1 or a.readers < 1 or a.size_mib <= 0:
        ap.error("--slow-at LO,HI in (0, 1); --slow-fraction in (0, 1); --rounds, --readers >= 1; --size-mib > 0")
    reason = available()
    if reason:
        print(f"cannot build an emulated cluster here: {reason}", file=sys.stderr)
        return 2
    size, link = int(a.size_mib * MIB), rate_bytes(a.host_rate)
    chain = " -> ".join(["trainer", "relay", *[f"d{i}" for i in range(1, a.readers + 1)]])
    print(f"stragglers: {chain}, {size / MIB:g} MiB, hosts at {a.host_rate} (one transfer ideally {size / link:.2f} s), "
          f"relay slowed to {a.slow_fraction:.0%} of its link at {lo:.0%}..{hi:.0%} of d1's pull, straggler window "
          f"{a.straggler_window:g} s, ratio {a.straggler_ratio:g}, {a.rounds} rounds, seed {a.seed}", flush=True)  # fmt: skip
    with Cluster(spec(a.readers), host_rate=a.host_rate, priority_ports=(SERVER_PORT,)) as cluster:
        prefix = cluster.prefix
        try:
            result = run_stragglers(cluster, size, a.rounds, readers=a.readers, slow_fraction=a.slow_fraction,
                                    slow_at=(lo, hi), window=a.straggler_window, ratio=a.straggler_ratio, seed=a.seed,
                                    chunk=int(a.chunk_mib * MIB), timeout=a.timeout, keep_logs=a.keep_logs,
                                    log=lambda s: print(s, flush=True))  # fmt: skip
        except JobError as err:
            print(f"FAILED: {err}", file=sys.stderr)
            return 1
    left = leftovers(prefix)
    s, runs = result["summary"], result["runs"]
    print()
    print_table(s)
    ok = s["ratio"] <= GOAL
    moved = all(n >= 1 for n in s["regrants_slow"])
    bad_bytes = [r["version"] for r in runs if not (all(h["bytes_ok"] for h in r["hosts"]) and r["relay_ok"])]
    unchained = [r["version"] for r in runs if not r["chained"]]
    tcp = all(set(h["transports"]) <= {"tcp"} for r in runs for h in r["hosts"])
    print(f"ratio (slowest of the readers and of all readers): {s['ratio']:.2f}")
    print(f"{'PASS' if ok else 'FAIL'}: the slow relay's readers finish within {GOAL:g}x of a fault-free run "
          f"({s['ratio']:.2f}x)")  # fmt: skip
    print(f"{'PASS' if moved else 'FAIL'}: the server re-granted readers in every slow run (re-grants per slow run "
          f"{s['regrants_slow']}, per fault-free run {s['regrants_free']}; server stats: stragglers "
          f"{result['server_stats'].get('stragglers')}, revoked {result['server_stats'].get('revoked')})")  # fmt: skip
    print(f"{'PASS' if not bad_bytes and tcp else 'FAIL'}: every reader and the relay hold the trainer's bytes "
          f"(content hash), over tcp{'' if not bad_bytes else f'; wrong in versions {bad_bytes}'}")  # fmt: skip
    print(f"{'PASS' if not unchained else 'FAIL'}: the chain {chain} formed in every run"
          + ("" if not unchained else f" (not in versions {unchained})"))  # fmt: skip
    print(f"seeds: --seed {a.seed} (server scheduling, slow points "
          + ", ".join(f"v{r['version']} {r['slow_at']:.3f}" for r in runs if r["slow_at"] is not None) + f"); cluster {prefix}")
    print(f"teardown: {'clean' if not left else 'LEFT ' + '; '.join(left)}")
    if a.json:
        result.update(config={"size_bytes": size, "host_rate": a.host_rate, "readers": a.readers, "rounds": a.rounds,
                              "slow_fraction": a.slow_fraction, "slow_at": [lo, hi], "window": a.straggler_window,
                              "ratio": a.straggler_ratio, "seed": a.seed, "prefix": prefix}, leftovers=left)  # fmt: skip
        write_json(a.json, result)
    return 0 if ok and moved and not bad_bytes and tcp and not unchained and not left else 1


if __name__ == "__main__":
    sys.exit(main())
