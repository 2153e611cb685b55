"""Latency of control-plane calls against a real server while many clients are connected.

Workload: ``--iterations`` calls of list, no-op update, publish and unpublish from one handle,
against a real server with ``--clients`` idle handles open in ``--workers`` processes.
Baseline: a raw ZeroMQ DEALER -> ROUTER msgpack echo, timed the same way in the same run.
Goal: p99 < 2 ms for publish, no-op update and list.

A real server (``python -m tensorhub server``) runs with ``--clients`` idle shard handles open
(default 256) in ``--workers`` processes (default 4), each handle on its own event loop thread
and so with its own ZeroMQ DEALER socket (``tensorhub.aio.open``, one replica per handle, in the
measured model): they only stay open and heartbeat. A measuring client in its own process opens a trainer handle
(``retain="latest"``, the default), registers a few small tensors, publishes, and times, with
the sync API (``--api sync``, default) or the async one (``--api async``):

- ``list``: ``list()``;
- ``update``: a no-op ``update("latest")`` (it already holds the latest version: returns False);
- ``publish``: ``publish(v)``, in ``unpublish()`` / ``publish(v + 1)`` pairs; ``unpublish`` is
  reported too. As the handle holds the only copy of the retained latest version, each
  unpublish includes the server's "offload first" round (a CPU copy of the small tensors).

The same-run baseline is a raw ZeroMQ DEALER -> ROUTER echo (a small echo server in another
process that decodes and re-encodes each msgpack frame), timed the same way from the same
process (a blocking socket for ``--api sync``, ``zmq.asyncio`` on the same loop for ``async``),
carrying a ``ListVersions`` frame. The operations run in blocks of ``--block`` iterations, in
an order that rotates each round, until each has run ``--iterations`` times (default 2,000).
At the end (at least one heartbeat timeout after the last handle opened) every idle handle
makes one call, to check that its session stayed alive: a run where heartbeats were starved
fails instead of reporting figures.

Usage: python benchmarks/bench_control.py [--clients N] [--workers W] [--iterations N] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import BenchmarkError, Child, start_server, stop_process, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOAL_P99_MS = 2.0
MODEL = "actor"
GOAL_OPS = ("publish", "update", "list")


# ---- helpers ------------------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile of ``xs`` (``q`` in [0, 100])."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def parent_gone() -> bool:
    return os.getppid() == 1


def _wait_command(conn: Any, limit: float) -> tuple | None:
    """The parent's next command (blocking, bounded by ``limit`` seconds), or None."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if conn.poll(0.5):
            try:
                return conn.recv()
            except EOFError:
                return None
        if parent_gone():
            return None
    return None


# ---- the echo server ------------------------------------------------------------------------------


def echo_main(conn: Any, limit: float) -> None:
    """A ZeroMQ ROUTER that answers each frame with the frame decoded and re-encoded."""
    import msgpack
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    conn.send(("ready", sock.getsockopt_string(zmq.LAST_ENDPOINT)))
    deadline = time.monotonic() + limit
    try:
        while time.monotonic() < deadline:
            if sock.poll(500):
                peer, frame = sock.recv_multipart()
                sock.send_multipart([peer, msgpack.packb(msgpack.unpackb(frame, raw=False), use_bin_type=True)])
            elif conn.poll() or parent_gone():
                return
    finally:
        sock.close(0)
        ctx.term()


# ---- the idle clients -------------------------------------------------------------------------------


def worker_main(conn: Any, server: str, index: int, count: int, limit: float) -> None:
    """``count`` idle shard handles, each on its own event loop thread, so each has its own
    ZeroMQ DEALER socket and heartbeats on its own (as ``count`` separate clients would). They
    stay open until told to quit. They register nothing, so they start no transport."""
    import tensorhub
    from tensorhub.handles.api import open_async
    from tensorhub.runtime.actor import LoopThread

    loops: list[LoopThread] = []
    handles: list[Any] = []
    try:
        for i in range(count):
            lt = LoopThread(f"client-{index}-{i}")
            loops.append(lt)
            handles.append(lt.run(open_async(MODEL, f"rollout-{index}-{i}", retain=None, server=server, transports={})))
        conn.send(("ready", len(handles)))
        cmd = _wait_command(conn, limit)
        if cmd is None or cmd[0] != "check":
            return
        alive, errors = 0, []
        for lt, h in zip(loops, handles):  # one call per handle: its session is still known to the server
            try:
                lt.run(h.list(), timeout=30)
                alive += 1
            except tensorhub.TensorHubError as err:
                errors.append(f"{type(err).__name__}: {err}")
        conn.send(("checked", alive, errors[:3]))
        _wait_command(conn, limit)
    except Exception as err:  # noqa: BLE001 - tell the parent rather than die silently
        try:
            conn.send(("error", f"worker {index}: {type(err).__name__}: {err}"))
        except OSError:
            pass
    finally:
        for lt, h in zip(loops, handles):
            try:
                lt.run(h.close(), timeout=10)
            except Exception as err:  # noqa: BLE001 - closing on the way out; the server cleans up
                print(f"worker {index}: closing a handle: {err!r}", file=sys.stderr)
        for lt in loops:
            lt.close()


# ---- the measuring client -------------------------------------------------------------------------


OPS = ("echo", "list", "update", "publish")  # "publish" also records "unpublish"


def measure_main(conn: Any, server: str, echo: str, api: str, iterations: int, block: int) -> None:
    try:
        if api == "sync":
            samples = measure_sync(server, echo, iterations, block)
        else:
            from tensorhub.runtime.actor import run

            samples = run(measure_async(server, echo, iterations, block))
        conn.send(("samples", samples))
    except Exception as err:  # noqa: BLE001 - report to the parent
        conn.send(("error", f"measuring client: {type(err).__name__}: {err}"))


def _tensors() -> dict:
    import torch

    return {f"w{i}": torch.full((1024,), float(i)) for i in range(8)}  # 8 x 4 KiB


def _echo_payload(i: int) -> bytes:
    from tensorhub.core import messages as m
    from tensorhub.core import wire

    return wire.encode(m.ListVersions(i, 1, None))


def _schedule(iterations: int, block: int) -> list[tuple[str, int]]:
    """(op, n) blocks, op order rotating each round, until each op has ``iterations``."""
    out, done, r = [], 0, 0
    while done < iterations:
        n = min(block, iterations - done)
        order = OPS[r % len(OPS):] + OPS[: r % len(OPS)]
        out += [(op, n) for op in order]
        done += n
        r += 1
    return out


def measure_sync(server: str, echo: str, iterations: int, block: int) -> dict[str, list[float]]:
    import msgpack
    import zmq

    import tensorhub

    samples: dict[str, list[float]] = {k: [] for k in (*OPS, "unpublish")}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(echo)
    h = tensorhub.open(MODEL, "trainer", server=server)
    clock = time.perf_counter
    try:
        h.register(_tensors())
        v = 1
        h.publish(v)
        payload = _echo_payload(7)
        obj = msgpack.unpackb(payload, raw=False)
        for _ in range(50):  # warm-up: connections, caches, first-call paths
            sock.send(msgpack.packb(obj, use_bin_type=True))
            msgpack.unpackb(sock.recv(), raw=False)
            h.list()
            h.update("latest")
        for op, n in _schedule(iterations, block):
            out = samples[op]
            if op == "echo":
                for _ in range(n):
                    t0 = clock()
                    sock.send(msgpack.packb(obj, use_bin_type=True))
                    msgpack.unpackb(sock.recv(), raw=False)
                    out.append(clock() - t0)
            elif op == "list":
                for _ in range(n):
                    t0 = clock()
                    listing = h.list()
                    out.append(clock() - t0)
                if v not in listing:
                    raise BenchmarkError(f"list() does not show the published version {v}: {listing!r}")
            elif op == "update":
                for _ in range(n):
                    t0 = clock()
                    moved = h.update("latest")
                    out.append(clock() - t0)
                    if moved is not False:
                        raise BenchmarkError(f"update('latest') at the latest version returned {moved!r}, not False")
            else:
                unp = samples["unpublish"]
                for _ in range(n):
                    t0 = clock()
                    h.unpublish()
                    t1 = clock()
                    v += 1
                    h.publish(v)
                    out.append(clock() - t1)
                    unp.append(t1 - t0)
        return samples
    finally:
        try:
            h.close()
        finally:
            sock.close(0)
            ctx.term()


async def measure_async(server: str, echo: str, iterations: int, block: int) -> dict[str, list[float]]:
    import msgpack
    import zmq
    import zmq.asyncio

    import tensorhub

    samples: dict[str, list[float]] = {k: [] for k in (*OPS, "unpublish")}
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(echo)
    h = await tensorhub.aio.open(MODEL, "trainer", server=server)
    clock = time.perf_counter

    async def echo_once(obj: Any) -> None:
        await sock.send(msgpack.packb(obj, use_bin_type=True))
        msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10), raw=False)

    try:
        await h.register(_tensors())
        v = 1
        await h.publish(v)
        obj = msgpack.unpackb(_echo_payload(7), raw=False)
        for _ in range(50):
            await echo_once(obj)
            await h.list()
            await h.update("latest")
        for op, n in _schedule(iterations, block):
            out = samples[op]
            if op == "echo":
                for _ in range(n):
                    t0 = clock()
                    await echo_once(obj)
                    out.append(clock() - t0)
            elif op == "list":
                for _ in range(n):
                    t0 = clock()
                    listing = await h.list()
                    out.append(clock() - t0)
                if v not in listing:
                    raise BenchmarkError(f"list() does not show the published version {v}: {listing!r}")
            elif op == "update":
                for _ in range(n):
                    t0 = clock()
                    moved = await h.update("latest")
                    out.append(clock() - t0)
                    if moved is not False:
                        raise BenchmarkError(f"update('latest') at the latest version returned {moved!r}, not False")
            else:
                unp = samples["unpublish"]
                for _ in range(n):
                    t0 = clock()
                    await h.unpublish()
                    t1 = clock()
                    v += 1
                    await h.publish(v)
                    out.append(clock() - t1)
                    unp.append(t1 - t0)
        return samples
    finally:
        try:
            await h.close()
        finally:
            sock.close(0)
            ctx.term()


# ---- the server ---------------------------------------------------------------------------------


def heartbeat_timeout(interval: float) -> float:
    return max(10.0, 10 * interval)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=256, help="idle shard handles kept open (default 256)")
    ap.add_argument("--workers", type=int, default=4, help="processes holding them, one event loop each")
    ap.add_argument("--iterations", type=int, default=2000, help="timed calls per operation")
    ap.add_argument("--block", type=int, default=100, help="calls of one operation in a row")
    ap.add_argument("--api", choices=("sync", "async"), default="sync", help="which face of the API to time")
    ap.add_argument("--heartbeat-interval", type=float, default=1.0, help="the server's heartbeat interval (s)")
    ap.add_argument("--timeout", type=float, default=300.0, help="bound on every wait, in seconds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.clients < 0 or args.workers < 1 or args.iterations < 1 or args.block < 1 or args.heartbeat_interval <= 0:
        ap.error("--clients >= 0; --workers, --iterations, --block >= 1; --heartbeat-interval > 0")

    shares = [args.clients // args.workers + (1 if w < args.clients % args.workers else 0) for w in range(args.workers)]
    shares = [n for n in shares if n > 0]
    server_proc = None
    children: list[Child] = []
    workers: list[Child] = []
    try:
        server_proc, server = start_server(args.timeout, "--heartbeat-interval", str(args.heartbeat_interval),
                                           "--heartbeat-timeout", str(heartbeat_timeout(args.heartbeat_interval)))
        echo_child = Child("echo server", echo_main, (args.timeout * 4,), args.timeout)
        children.append(echo_child)
        _, echo = echo_child.expect("ready", args.timeout)
        t0 = time.perf_counter()
        for w, n in enumerate(shares):
            workers.append(Child(f"worker {w}", worker_main, (server, w, n, args.timeout * 4), args.timeout))
        children += workers
        opened = sum(c.expect("ready", args.timeout)[1] for c in workers)
        all_open = time.monotonic()
        print(f"control plane: server {server}, {opened} idle clients open in {len(workers)} processes "
              f"({time.perf_counter() - t0:.1f} s to start), heartbeat every {args.heartbeat_interval:g} s; "
              f"api {args.api}, {args.iterations} calls per operation, {os.cpu_count()} CPUs", flush=True)  # fmt: skip
        meas = Child("measuring client", measure_main, (server, echo, args.api, args.iterations, args.block), args.timeout)
        children.append(meas)
        t0 = time.perf_counter()
        _, samples = meas.expect("samples", args.timeout)
        elapsed = time.perf_counter() - t0
        # The liveness check means something only once a session that never heartbeat would have
        # expired: wait out the rest of one heartbeat timeout since the last handle opened.
        time.sleep(max(0.0, all_open + heartbeat_timeout(args.heartbeat_interval) + 1.0 - time.monotonic()))
        alive, errors = 0, []
        for c in workers:
            c.send("check")
        for c in workers:
            _, a, e = c.expect("checked", args.timeout)
            alive += a
            errors += e
    except BenchmarkError as err:
        print(f"FAILED: {err}", file=sys.stderr)
        return 1
    finally:
        for c in reversed(children):
            c.stop()
        if server_proc is not None:
            stop_process(server_proc)

    if alive != opened:
        print(f"FAILED: only {alive} of {opened} idle sessions were still alive after the run: {errors}", file=sys.stderr)
        return 1

    stats = {}
    for op, xs in samples.items():
        ms = [x * 1e3 for x in xs]
        stats[op] = {"n": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": max(ms),
                     "mean_ms": sum(ms) / len(ms)}  # fmt: skip
    echo_p50, echo_p99 = stats["echo"]["p50_ms"], stats["echo"]["p99_ms"]
    print(f"measured in {elapsed:.1f} s (measuring process start included); all {alive} idle sessions still alive "
          f"{heartbeat_timeout(args.heartbeat_interval):g}+ s after they opened")
    print()
    print(f"{'operation':<26} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p50/echo':>9} {'p99/echo':>9}  p99 < {GOAL_P99_MS:g} ms")
    labels = {"echo": "raw zmq echo (baseline)", "list": "list()", "update": 'update("latest") no-op',
              "publish": "publish(v)", "unpublish": "unpublish() (+offload)"}  # fmt: skip
    for op in ("echo", "list", "update", "publish", "unpublish"):
        s = stats[op]
        s["p50_vs_echo"] = s["p50_ms"] / echo_p50
        s["p99_vs_echo"] = s["p99_ms"] / echo_p99
        goal = ("yes" if s["p99_ms"] < GOAL_P99_MS else "NO") if op in GOAL_OPS else "(not a goal)" if op != "echo" else ""
        print(f"{labels[op]:<26} {s['p50_ms']:>8.3f} {s['p99_ms']:>8.3f} {s['max_ms']:>8.2f} {s['p50_vs_echo']:>8.1f}x "
              f"{s['p99_vs_echo']:>8.1f}x  {goal}")  # fmt: skip
    met = all(stats[op]["p99_ms"] < GOAL_P99_MS for op in GOAL_OPS)
    worst = max(GOAL_OPS, key=lambda op: stats[op]["p99_ms"])
    print(f"goal p99 < {GOAL_P99_MS:g} ms for publish, no-op update and list with {opened} clients: "
          f"{'met' if met else 'NOT met'} (worst: {worst}, p99 {stats[worst]['p99_ms']:.3f} ms)")
    if args.json:
        out = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "clients_open": opened, "goal_p99_ms": GOAL_P99_MS, "goal_met": met, "stats": stats,
               "samples_ms": {op: [x * 1e3 for x in xs] for op, xs in samples.items()}}  # fmt: skip
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
