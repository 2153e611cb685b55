"""Operations per second of the reference table alone (no IO), with many clients open.

Workload: the reference table alone (no IO) with ``--clients`` sessions open: heartbeats,
listings, no-op updates, a burst of grants and completes, unpublishes, ``--rounds`` rounds.
Baseline: decoding the same number of frames (``wire decode``), in the same run.
Goal: >= 50,000 simple operations per second (heartbeat, list, grant + complete).

The table is the server's logic; this measures whether it could ever be the server's
bottleneck. With ``--clients`` sessions open (default 1,024: one 2-shard trainer replica and
511 2-shard rollout replicas), it times, on one core:

- heartbeat: one ``Heartbeat`` per session;
- list: a ``ListVersions`` per session (the listing is cached between changes);
- no-op update: ``Update("latest")`` when the replica already holds the latest version;
- grant + complete: a version is published and every rollout replicates it (``Replicate`` ->
  grant, ``Complete`` -> answer), as a burst that pipelines into chains; each message handled
  counts as one operation;
- unpublish: every rollout unpublishes (drain bookkeeping, retention checks).

Usage: python benchmarks/bench_table.py [--clients N] [--rounds R] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import median, meets, ratio, write_json  # noqa: E402
from tensorhub.core import messages as m  # noqa: E402
from tensorhub.core import wire  # noqa: E402
from tensorhub.core.invariants import check_invariants  # noqa: E402
from tensorhub.core.layout import Layout, TensorSpec  # noqa: E402
from tensorhub.core.table import ReferenceTable, TableConfig  # noqa: E402
from tensorhub.core.topology import Location  # noqa: E402
from tensorhub.scheduling.selection import SourceIndex

GOAL = 50_000


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

    def timed(self, label: str, msgs: list[tuple[str, object]]) -> tuple[str, int, float]:
        handle = self.table.handle
        t0 = time.perf_counter()
        for peer, msg in msgs:
            handle(peer, msg)
        dt = time.perf_counter() - t0
        return label, len(msgs), dt

    def heartbeat(self) -> tuple[str, int, float]:
        return self.timed("heartbeat", [(f"{n}/{i}", m.Heartbeat(next(self.req), (sid,))) for n, i, sid in self.shards])

    def listing(self) -> tuple[str, int, float]:
        return self.timed("list", [(f"{n}/{i}", m.ListVersions(next(self.req), sid, None)) for n, i, sid in self.shards])

    def noop_update(self) -> tuple[str, int, float]:
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

    def grant_complete(self, version: int) -> tuple[str, int, float]:
        """Every rollout shard replicates ``version``; grants are completed in the order they
        were made (pipelining chains), each Complete possibly unblocking answers."""
        handle = self.table.handle
        ops = 0
        requests = [
            (f"{n}/{i}", m.Replicate(next(self.req), sid, self.call(sid), version, None))
            for n, i, sid in self.shards
            if n != "trainer"
        ]
        t0 = time.perf_counter()
        pending: list[tuple[str, int, m.Grant]] = []
        for peer, request in requests:
            sid = request.session
            for _, msg in handle(peer, request):
                if isinstance(msg, m.Grant):
                    pending.append((peer, sid, msg))
            ops += 1
        while pending:
            peer, sid, g = pending.pop(0)
            for p, msg in handle(peer, m.Complete(next(self.req), sid, g.grant, g.term)):
                if isinstance(msg, m.Grant):
                    pending.append((p, msg.session, msg))
            ops += 1
        dt = time.perf_counter() - t0
        return "grant + complete", ops, dt

    def decode_baseline(self) -> tuple[str, int, float]:
        """The same run's baseline: decoding and validating one frame per rollout of the kinds
        above (what the server pays per message before the table sees it)."""
        frames = []
        for n, i, sid in self.shards:
            frames.append(wire.encode(m.Replicate(1, sid, 1, "latest", None)))
            frames.append(wire.encode(m.Complete(2, sid, 7, 1)))
            frames.append(wire.encode(m.Heartbeat(3, (sid,))))
        decode = wire.decode
        t0 = time.perf_counter()
        for f in frames:
            decode(f)
        return "wire decode", len(frames), time.perf_counter() - t0

    def unpublish_all(self) -> tuple[str, int, float]:
        msgs = [(f"{n}/{i}", m.Unpublish(next(self.req), sid, self.call(sid))) for n, i, sid in self.shards if n != "trainer"]
        return self.timed("unpublish", msgs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    bench = Bench(args.clients, args.seed)
    results: dict[str, list[float]] = {}
    version = 0
    for _ in range(args.rounds):
        version += 1
        bench.publish(version)
        rows = [
            bench.grant_complete(version), bench.heartbeat(), bench.listing(), bench.noop_update(), bench.unpublish_all(),
            bench.decode_baseline(),
        ]
        for label, ops, dt in rows:
            results.setdefault(label, []).append(ops / dt)
    bad = check_invariants(bench.table)
    if bad:
        print("invariants violated:", *bad, sep="\n  ")
        return 1

    print(f"reference table, {args.clients} clients ({args.clients // 2} replicas of 2 shards), {args.rounds} rounds, one core")
    print(f"{'operation':<18} {'ops/s (median)':>15} {'min':>12} {'max':>12}")
    for label, rates in results.items():
        rates.sort()
        print(f"{label:<18} {median(rates):>15,.0f} {rates[0]:>12,.0f} {rates[-1]:>12,.0f}")
    medians = {label: median(results[label]) for label in ("grant + complete", "heartbeat", "list")}
    slowest = min(medians, key=medians.get)
    floor = medians[slowest]
    print(f"slowest simple operation: {slowest}, median {floor:,.0f} ops/s; goal >= {GOAL:,} -> {'met' if meets(floor, GOAL) else 'NOT met'}")
    base = median(results["wire decode"])
    print(f"against decoding the frames alone in the same run ({base:,.0f} frames/s): {slowest} runs at {ratio(floor, base):.2f}x")
    if args.json:
        write_json(args.json, {k: sorted(v) for k, v in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
