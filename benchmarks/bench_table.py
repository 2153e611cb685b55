"""Operations per second of the reference table alone (no IO), with many clients open.

Workload: the reference table alone (no IO) with ``--clients`` sessions open: heartbeats,
listings, no-op updates, a burst of grants and completes, unpublishes, ``--rounds`` rounds.
Baseline: decoding the same number of frames (``wire decode``), in the same run; with
``--against DIR`` also another checkout's table, its rounds alternating with this tree's.
Goal: >= 50,000 simple operations per second of CPU time (heartbeat, list, grant + complete).

The table is the server's logic; this measures whether it could ever be the server's
bottleneck. Rates are per second of the process's CPU time (``time.process_time``: one core,
whatever else the machine runs); the wall-clock rate is printed beside it. With ``--clients`` sessions open (default 1,024: one 2-shard trainer replica and
511 2-shard rollout replicas), it times, on one core:

- heartbeat: one ``Heartbeat`` per session;
- list: a ``ListVersions`` per session (the listing is cached between changes);
- no-op update: ``Update("latest")`` when the replica already holds the latest version;
- grant + complete: a version is published and every rollout replicates it (``Replicate`` ->
  grant, ``Complete`` -> answer), as a burst that pipelines into chains; each message handled
  counts as one operation;
- unpublish: every rollout unpublishes (drain bookkeeping, retention checks).

``--against DIR`` runs each round in a fresh process, alternating between this tree and the
checkout at ``DIR`` (e.g. ``git worktree add /tmp/base main``), this script's workload against
each tree's ``tensorhub``, and prints the ratio of their grant + complete rates. ``--tree DIR``
measures DIR's ``tensorhub`` in this process.

A figure that no other load on the machine moves: ``--instructions`` runs one grant + complete
burst (after a first one) inside ``itertools.starmap``, so that valgrind counts the instructions
of that burst alone; divide by the messages it prints::

    valgrind --tool=callgrind --toggle-collect=starmap_next --callgrind-out-file=/dev/null \\
        python benchmarks/bench_table.py --instructions [--tree DIR]

Usage: python benchmarks/bench_table.py [--clients N] [--rounds R] [--against DIR | --tree DIR] [--instructions] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
from collections import deque
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_TREE = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv[:-1] else None
if _TREE is not None:  # measure that checkout's tensorhub (first on the path), with this workload
    sys.path.insert(0, _TREE)
sys.path.insert(1 if _TREE is not None else 0, str(ROOT))

from benchmarks.harness import median, meets, ratio, write_json  # noqa: E402
from tensorhub.core import messages as m  # noqa: E402
from tensorhub.core import wire  # noqa: E402
from tensorhub.core.invariants import check_invariants  # noqa: E402
from tensorhub.core.layout import Layout, TensorSpec  # noqa: E402
from tensorhub.core.table import ReferenceTable, TableConfig  # noqa: E402
from tensorhub.core.topology import Location  # noqa: E402
from tensorhub.scheduling.selection import SourceIndex

GOAL = 50_000

#: (operation, messages handled, CPU seconds, wall seconds)
Row = tuple[str, int, float, float]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Bench:
    def __init__(self, clients: int, seed: int) -> None:
        self.clock = Clock()
        self.table = ReferenceTable(self.clock, random.Random(seed), TableConfig(), term=1, sources=SourceIndex)
        self.req = itertools.count(1)
        self.clock.t = 100.0
        self.table.tick()  # past the start-up grace period
        layout = Layout(tuple(TensorSpec(f"w{i}", "bfloat16", (1024, 1024), 2 << 20) for i in range(8)), "xxh3-64", 4 << 20, 2 << 20)
        self.n_checksums = layout.checksum_count()
        self.shards: list[tuple[str, int, int]] = []  # (replica, shard_idx, session)
        replicas = clients // 2
        for r in range(replicas):
            name = "trainer" if r == 0 else f"rollout-{r}"
            for i in range(2):
                peer = f"{name}/{i}"
                loc = Location(f"dc{r % 2}", f"host-{r // 4}", "")
                out = self.table.handle(peer, m.OpenShard(next(self.req), "actor", name, 2, i, "n1", loc, False, 0 if r == 0 else None))
                sid = out[0][1].session
                self.table.handle(peer, m.Register(next(self.req), sid, layout, {"tcp": {"host": "127.0.0.1", "port": 1000 + r}}))
                self.shards.append((name, i, sid))
        self.calls: dict[int, int] = {sid: 0 for _, _, sid in self.shards}

    def call(self, sid: int) -> int:
        self.calls[sid] += 1
        return self.calls[sid]

    def timed(self, label: str, msgs: list[tuple[str, object]]) -> Row:
        handle = self.table.handle
        t0, c0 = time.perf_counter(), time.process_time()
        for peer, msg in msgs:
            handle(peer, msg)
        return label, len(msgs), time.process_time() - c0, time.perf_counter() - t0

    def heartbeat(self) -> Row:
        return self.timed("heartbeat", [(f"{n}/{i}", m.Heartbeat(next(self.req), (sid,))) for n, i, sid in self.shards])

    def listing(self) -> Row:
        return self.timed("list", [(f"{n}/{i}", m.ListVersions(next(self.req), sid, None)) for n, i, sid in self.shards])

    def noop_update(self) -> Row:
        msgs = [(f"{n}/{i}", m.Update(next(self.req), sid, self.call(sid), "latest", None)) for n, i, sid in self.shards if n != "trainer"]
        return self.timed("no-op update", msgs)

    def publish(self, version: int) -> None:
        for n, i, sid in self.shards:
            if n == "trainer":
                peer = f"{n}/{i}"
                for msg in (m.Unpublish(next(self.req), sid, self.call(sid)),
                            m.Publish(next(self.req), sid, self.call(sid), version, (version,) * self.n_checksums)):
                    for p, out in self.table.handle(peer, msg):
                        if isinstance(out, m.OffloadRequest):  # the trainer offloads its retained version
                            self.table.handle(p, m.PublishOffload(next(self.req), out.session, out.version, True))
                        elif isinstance(out, m.Failed):
                            raise out.error()

    def grant_complete(self, version: int) -> Row:
        """Every rollout shard replicates ``version``; grants are completed in the order they
        were made (pipelining chains), each Complete possibly unblocking answers."""
        handle = self.table.handle
        ops = 0
        requests = [
            (f"{n}/{i}", m.Replicate(next(self.req), sid, self.call(sid), version, None))
            for n, i, sid in self.shards
            if n != "trainer"
        ]
        t0, c0 = time.perf_counter(), time.process_time()
        pending: deque[tuple[str, int, m.Grant]] = deque()
        for peer, request in requests:
            sid = request.session
            for _, msg in handle(peer, request):
                if isinstance(msg, m.Grant):
                    pending.append((peer, sid, msg))
            ops += 1
        while pending:
            peer, sid, g = pending.popleft()
            for p, msg in handle(peer, m.Complete(next(self.req), sid, g.grant, g.term)):
                if isinstance(msg, m.Grant):
                    pending.append((p, msg.session, msg))
            ops += 1
        return "grant + complete", ops, time.process_time() - c0, time.perf_counter() - t0

    def decode_baseline(self) -> Row:
        """The same run's baseline: decoding and validating one frame per rollout of the kinds
        above (what the server pays per message before the table sees it)."""
        frames = []
        for n, i, sid in self.shards:
            frames.append(wire.encode(m.Replicate(1, sid, 1, "latest", None)))
            frames.append(wire.encode(m.Complete(2, sid, 7, 1)))
            frames.append(wire.encode(m.Heartbeat(3, (sid,))))
        decode = wire.decode
        t0, c0 = time.perf_counter(), time.process_time()
        for f in frames:
            decode(f)
        return "wire decode", len(frames), time.process_time() - c0, time.perf_counter() - t0

    def unpublish_all(self) -> Row:
        msgs = [(f"{n}/{i}", m.Unpublish(next(self.req), sid, self.call(sid))) for n, i, sid in self.shards if n != "trainer"]
        return self.timed("unpublish", msgs)


def run(clients: int, rounds: int, seed: int, gc_mode: str | None = None) -> dict[str, dict[str, list[float]]]:
    """``rounds`` rounds in this process: operation -> {"cpu": rates, "wall": rates} (ops/s).

    ``gc_mode`` (``paced`` or ``watched``): the server process's collector pacing runs as in
    ``tensorhub server --gc MODE`` (started before the sessions open, ticked once per operation,
    each a second of its clock), and ``"gc"`` holds, per generation, the passes, their CPU
    milliseconds and the longest pass's (in the rounds, after the sessions opened)."""
    pacing = None
    if gc_mode is not None:
        from tensorhub.runtime.collector import CollectorPacing

        pacing_clock = Clock()
        pacing = CollectorPacing(clock=pacing_clock, pace=gc_mode == "paced")
        pacing.start()
    bench = Bench(clients, seed)
    results: dict[str, dict[str, list[float]]] = {}
    version = 0
    if pacing is not None:
        pacing_clock.t += 1.0
        pacing.tick()
        watched = [*pacing.watch.generations, pacing.watch.on_purpose]
        gens0 = [(g.passes, g.cpu_seconds) for g in watched]
        for g in watched:
            g.longest_cpu = 0.0
    for _ in range(rounds):
        version += 1
        bench.publish(version)
        rows = []
        for phase in (lambda: bench.grant_complete(version), bench.heartbeat, bench.listing, bench.noop_update,
                      bench.unpublish_all, bench.decode_baseline):  # fmt: skip
            rows.append(phase())
            if pacing is not None:  # the server's tick, between messages
                pacing_clock.t += 1.0
                pacing.tick()
        for label, ops, cpu, wall in rows:
            r = results.setdefault(label, {"cpu": [], "wall": []})
            r["cpu"].append(ops / cpu if cpu > 0 else float("nan"))
            r["wall"].append(ops / wall)
    if pacing is not None:
        names = ["generation 0", "generation 1", "generation 2", "full on purpose"]
        results["gc"] = {
            name: [g.passes - p0, (g.cpu_seconds - c0) * 1000, g.longest_cpu * 1000]
            for name, g, (p0, c0) in zip(names, watched, gens0)
        }
        pacing.stop()
    bad = check_invariants(bench.table)
    if bad:
        raise SystemExit("invariants violated:\n  " + "\n  ".join(bad))
    return results


def _child(root: Path, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Two rounds in a fresh process, this script's workload against ``root``'s tensorhub."""
    from benchmarks.harness.processes import in_checkout  # here: the child imports the other tree's harness

    figures: dict[str, dict[str, list[float]]] = in_checkout(Path(__file__).resolve(), root, [
        "--clients", str(args.clients), "--rounds", "2", "--seed", str(args.seed)], timeout=600)  # fmt: skip
    return figures


def _gc_report(args: argparse.Namespace) -> int:
    """``--gc``: the collector's passes over the rounds, paced against watched (CPython's own
    thresholds), alternating in fresh processes (``--rounds`` processes each)."""
    from benchmarks.harness.processes import in_checkout

    modes = ("paced", "watched") if args.gc == "both" else (args.gc,)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            runs[mode].append(in_checkout(Path(__file__).resolve(), ROOT, [
                "--clients", str(args.clients), "--rounds", "3", "--seed", str(args.seed), "--gc", mode], timeout=600))  # fmt: skip
    print(f"reference table, {args.clients} clients, 3 bursts per process, {args.rounds} processes per mode; the server's "
          f"collector (load average {os.getloadavg()[0]:.1f}); CPU time, so the machine's load moves it little")  # fmt: skip
    print(f"{'mode':<8} {'generation':<16} {'passes':>8} {'CPU ms':>8} {'longest ms':>11}   (per process, median)")
    for mode, rs in runs.items():
        for gen in ("generation 0", "generation 1", "generation 2", "full on purpose"):
            rows = [r["gc"][gen] for r in rs]
            print(f"{mode:<8} {gen:<16} {median([x[0] for x in rows]):>8.0f} {median([x[1] for x in rows]):>8.1f} "
                  f"{median([x[2] for x in rows]):>11.1f}")  # fmt: skip
        gcr = median([median(r["grant + complete"]["cpu"]) for r in rs])
        hb = median([median(r["heartbeat"]["cpu"]) for r in rs])
        print(f"{mode:<8} grant + complete {gcr:,.0f} ops/s, heartbeat {hb:,.0f} ops/s (CPU)")
    if len(modes) == 2:
        p, w = (median([sum(x[1] for x in r["gc"].values()) for r in runs[m]]) for m in modes)
        lp, lw = (median([max(x[2] for x in r["gc"].values()) for r in runs[m]]) for m in modes)
        print(f"paced against watched: collector CPU {p:.1f} vs {w:.1f} ms per process ({ratio(w, p):.2f}x less); "
              f"longest pass {lp:.1f} vs {lw:.1f} ms ({ratio(lw, lp):.2f}x shorter)")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--against", type=Path, help="another checkout to measure, alternating with this one")
    ap.add_argument("--tree", type=Path, help="measure this checkout's tensorhub instead of this tree's")
    ap.add_argument("--instructions", action="store_true", help="one burst in itertools.starmap, for valgrind")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--gc", choices=("paced", "watched", "both"),
                    help="the server's collector pacing beside the table (both: paced and watched alternating, each in a fresh "
                         "process): the collector's passes per generation, CPU ms and the longest pass")  # fmt: skip
    args = ap.parse_args(argv)
    if args.clients < 4 or args.rounds < 1:
        ap.error("--clients must be >= 4 and --rounds >= 1")
    if args.instructions:
        bench = Bench(args.clients, args.seed)
        bench.publish(1)
        bench.grant_complete(1)
        bench.unpublish_all()
        bench.publish(2)
        ((_, ops, _, _),) = itertools.starmap(bench.grant_complete, [(2,)])  # what callgrind counts
        where = Path(sys.modules[ReferenceTable.__module__].__file__ or "?").parents[3]
        print(f"one grant + complete burst of {where}'s table: {ops} messages handled (divide callgrind's Collected by it)")
        return 0
    if args.child:
        print(json.dumps(run(args.clients, args.rounds, args.seed, args.gc)))
        return 0
    if args.gc is not None:
        return _gc_report(args)
    if args.against is not None and not (args.against / "tensorhub" / "core" / "table").is_dir():
        ap.error(f"--against {args.against}: not a checkout of this project (no tensorhub/core/table)")

    if args.against is None:
        trees = {"this tree": run(args.clients, args.rounds, args.seed)}
    else:
        trees = {"this tree": {}, "against": {}}
        for _ in range(args.rounds):  # alternating, so that a busy spell hits both alike
            for tree, root in (("this tree", ROOT), ("against", args.against.resolve())):
                for label, r in _child(root, args).items():
                    into = trees[tree].setdefault(label, {"cpu": [], "wall": []})
                    into["cpu"] += r["cpu"]
                    into["wall"] += r["wall"]

    load = os.getloadavg()[0]
    print(f"reference table, {args.clients} clients ({args.clients // 2} replicas of 2 shards), {args.rounds} rounds, "
          f"one core; rates per CPU second (load average {load:.1f})")  # fmt: skip
    for tree, results in trees.items():
        if len(trees) > 1:
            print(f"-- {tree}{'' if tree == 'this tree' else ' ' + str(args.against)}")
        print(f"{'operation':<18} {'ops/s (median)':>15} {'min':>12} {'max':>12} {'wall ops/s':>12}")
        for label, r in results.items():
            cpu = sorted(r["cpu"])
            print(f"{label:<18} {median(cpu):>15,.0f} {cpu[0]:>12,.0f} {cpu[-1]:>12,.0f} {median(r['wall']):>12,.0f}")
    results = trees["this tree"]
    medians = {label: median(results[label]["cpu"]) for label in ("grant + complete", "heartbeat", "list")}
    slowest = min(medians, key=lambda k: medians[k])
    floor = medians[slowest]
    print(f"slowest simple operation: {slowest}, median {floor:,.0f} ops/s; goal >= {GOAL:,} -> {'met' if meets(floor, GOAL) else 'NOT met'}")
    base = median(results["wire decode"]["cpu"])
    print(f"against decoding the frames alone in the same run ({base:,.0f} frames/s): {slowest} runs at {ratio(floor, base):.2f}x")
    if "against" in trees:
        old = median(trees["against"]["grant + complete"]["cpu"])
        new = median(results["grant + complete"]["cpu"])
        print(f"grant + complete against {args.against}: {new:,.0f} vs {old:,.0f} ops/s -> {ratio(new, old):.2f}x")
    if args.json:
        write_json(args.json, {"load": load, "trees": trees})
    return 0


if __name__ == "__main__":
    sys.exit(main())
