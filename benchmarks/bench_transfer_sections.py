"""Sections 1 to 5 of ``bench_transfer.py`` (plan, transfer, verify, publish, memory): the holder
process and the fresh reader process of section 5, the parent's end of the holder, and the
drivers that take one shard through sections 1, 2, 3 and 5 and time the trainer's ``publish``."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from benchmarks.bench_transfer_baselines import baseline_pull, baseline_serve, single_thread_seconds
from benchmarks.bench_transfer_paths import TcpPull, plan_counts, product_pull, pull_stats_dict, tcp_pull
from benchmarks.harness import BenchmarkError, Child, PeakRss, median, process_cpu, status_bytes
from benchmarks.harness.shards import (
    DTYPES,
    MEMORY_SHARD,
    REGION,
    REGION_UNPACKED,
    VERSION,
    Spec,
    allocate,
    check_bytes,
    crcs_of,
    fill_seeded,
    model_spec,
    pack_threshold_env,
    spec_bytes,
    zero,
)
from tensorhub.runtime import checksum
from tensorhub.runtime.engine import WaitPublished
from tensorhub.transports.buffers import DEFAULT_PACK_THRESHOLD, ShardBuffers, layout_of, memory_of
from tensorhub.transports.tcp import TcpTransport

# ---- helper processes of sections 1-5 -----------------------------------------------------------


def holder_main(conn: Any, spec: Spec, seed: int) -> None:
    """The holder: seeded tensors, served by a raw-socket baseline listener, a standalone
    ``TcpTransport`` over packed ``ShardBuffers``, and (on request) tensorhub handles that
    publish them, one per model."""
    import tensorhub

    tensors = allocate(spec)
    fill_seeded(tensors, seed)
    with ThreadPoolExecutor(2) as pool:
        crcs = crcs_of(tensors, pool)
    buffers = ShardBuffers(tensors, layout_of(tensors, pack_threshold=DEFAULT_PACK_THRESHOLD))
    buffers.pack()  # as the publish job does, before anything is served
    sums = checksum.compute(buffers)
    buffers.progress.reset(VERSION, buffers.total_bytes)
    unpacked = ShardBuffers(tensors, layout_of(tensors, pack_threshold=0))  # no packs: the tensors in place
    unpacked.progress.reset(VERSION, unpacked.total_bytes)
    served = {REGION: buffers, REGION_UNPACKED: unpacked}

    transport = TcpTransport({"host": "127.0.0.1"})
    asyncio.run(transport.start())
    transport.serve(lambda region, version: served.get(region) if version == VERSION else None)

    stop = threading.Event()
    lst = socket.create_server(("127.0.0.1", 0))
    views = [memory_of(t) for t in tensors.values()]
    base = threading.Thread(target=baseline_serve, args=(lst, views, stop), daemon=True)
    base.start()

    handles: dict[str, Any] = {}
    meter: PeakRss | None = None
    rss_before = 0
    conn.send(("ready", transport.port, lst.getsockname()[1], crcs, sums))
    try:
        for _ in range(1 << 30):  # one command at a time until told to quit (or the parent is gone)
            if not conn.poll(1.0):
                if os.getppid() == 1:
                    return
                continue
            cmd = conn.recv()
            try:
                if cmd[0] == "quit":
                    return
                if cmd[0] == "publish":
                    _, server, model, streams, threshold, measure = cmd
                    before = status_bytes("VmRSS")
                    t0 = time.perf_counter()
                    handle = handles[model] = tensorhub.open(model, "trainer", server=server, retain=None,
                                                             transports={"tcp": {"streams": streams}})  # fmt: skip
                    with pack_threshold_env(threshold):
                        handle.register(tensors)
                    if measure:
                        meter = PeakRss()  # RSS right after register; the peak from here on
                        rss_before = before
                    t1 = time.perf_counter()
                    handle.publish(VERSION)
                    conn.send(("published", t1 - t0, time.perf_counter() - t1))
                elif cmd[0] == "close":
                    handle = handles.pop(cmd[1], None)
                    if handle is not None:
                        handle.close()
                    conn.send(("closed",))
                elif cmd[0] == "memory":
                    if meter is None:
                        raise BenchmarkError("no measured publish")
                    conn.send(("memory", rss_before, meter.base, meter.peak(), meter.method))
            except Exception:  # noqa: BLE001 - the parent reports it and stops
                conn.send(("error", traceback.format_exc()))
    except (EOFError, OSError):
        return
    finally:
        stop.set()
        lst.close()
        for handle in handles.values():
            try:
                handle.close()
            except Exception as err:  # noqa: BLE001 - the server may be gone already; we are exiting
                print(f"holder: closing a trainer handle: {err!r}", file=sys.stderr)
        asyncio.run(transport.close())


class Holder(Child):
    """The parent's end of a holder process."""

    def __init__(self, spec: Spec, seed: int, timeout: float) -> None:
        super().__init__("holder", holder_main, (spec, seed), timeout)
        _, self.tcp_port, self.base_port, self.crcs, self.sums = self.expect("ready")

    def ask(self, *cmd: Any) -> tuple:
        self.conn.send(cmd)
        return self.expect({"publish": "published", "close": "closed", "memory": "memory"}[cmd[0]])


def memory_reader_main(conn: Any, spec: Spec, server: str, model: str, streams: int, timeout: float) -> None:
    """A fresh reader process: register zeroed tensors, note RSS, ``replicate`` once, report the
    peak, the CRC-32s and the pull's stats."""
    import tensorhub

    try:
        tensors = allocate(spec)
        before = status_bytes("VmRSS")
        with tensorhub.open(model, "mem-reader", server=server, retain=None,
                            transports={"tcp": {"streams": streams, "io_timeout": timeout}}) as handle:  # fmt: skip
            with pack_threshold_env(DEFAULT_PACK_THRESHOLD):
                handle.register(tensors)
            meter = PeakRss()
            t0 = time.perf_counter()
            handle.replicate(VERSION, timeout=timeout)
            dt = time.perf_counter() - t0
            peak = meter.peak()
            stats = handle.last_pull
            with ThreadPoolExecutor(2) as pool:
                crcs = crcs_of(tensors, pool)
            conn.send(("pulled", before, meter.base, peak, meter.method, dt, crcs, asdict(stats) if stats else None))
    except Exception:  # noqa: BLE001 - the parent reports it and stops
        conn.send(("error", traceback.format_exc()))


# ---- one shard: sections 1, 2, 3, 5 -----------------------------------------------------------


def bench_shard(label: str, spec: Spec, args: argparse.Namespace, server: str | None, runner: asyncio.Runner,
                pool: ThreadPoolExecutor) -> dict[str, Any]:  # fmt: skip
    import tensorhub

    sections = args.sections
    total = spec_bytes(spec)
    small = sum(1 for _, d, n in spec if n * DTYPES[d].itemsize < 64 << 10)
    print(f"shard {label}: {len(spec)} tensors ({small} under 64 KiB), {total / 2**20:,.1f} MiB", flush=True)
    res: dict[str, Any] = {"bytes": total, "tensors": len(spec), "small_tensors": small}
    holder = Holder(spec, args.seed, args.timeout)
    sock = None
    transport = None
    handle = None
    try:
        tensors = allocate(spec)
        names = list(tensors)
        into = ShardBuffers(tensors, layout_of(tensors, pack_threshold=DEFAULT_PACK_THRESHOLD))
        if len(holder.sums) != len(into.plan.units):
            raise BenchmarkError(f"the holder sent {len(holder.sums)} checksums for {len(into.plan.units)} units")

        def check(what: str) -> None:
            check_bytes(f"{label} {what}", crcs_of(tensors, pool), holder.crcs, names)

        want_product = server is not None and "transfer" in sections
        if "plan" in sections:
            res["plan"] = {"on": plan_counts(tensors, DEFAULT_PACK_THRESHOLD, into), "off": plan_counts(tensors, 0)}
            # One product pull of a copy published without packing (and, when the timed product
            # path will not run, one with packing): what the engine's PullStats say.
            checks = {"off": 0} if want_product else {"on": DEFAULT_PACK_THRESHOLD, "off": 0}
            for key, threshold in (checks.items() if server is not None else ()):
                model = f"bench-{label}-check-{key}"
                holder.ask("publish", server, model, args.streams, threshold, False)
                with tensorhub.open(model, "reader-check", server=server, retain=None,
                                    transports={"tcp": {"streams": args.streams, "io_timeout": args.timeout}}) as h0:  # fmt: skip
                    with pack_threshold_env(threshold):
                        h0.register(tensors)
                    zero(tensors, h0.buffers)
                    product_pull(h0, args.timeout)
                    check(f"product, pack_threshold {threshold}")
                    res["plan"][key]["product_last_pull"] = pull_stats_dict(h0.last_pull)
                holder.ask("close", model)

        timed = "transfer" in sections or "verify" in sections
        want_memory = server is not None and "memory" in sections and label == MEMORY_SHARD
        paths: dict[str, Any] = {}
        pulls: dict[str, list[TcpPull]] = {"tcp": [], "tcp+verify": [], "tcp unpacked": []}
        if timed:
            views = [memory_of(t) for t in tensors.values()]
            sock = socket.create_connection(("127.0.0.1", holder.base_port), timeout=args.timeout)
            transport = TcpTransport({"streams": args.streams, "io_timeout": args.timeout})
            runner.run(transport.start())
            peer = {"host": "127.0.0.1", "port": holder.tcp_port}

            def tcp(expected: list[int] | None) -> Any:
                return lambda: runner.run(tcp_pull(transport, peer, into, args.streams, args.timeout, expected))

            paths["baseline"] = lambda: baseline_pull(sock, views)
            paths["tcp"] = tcp(None)
            if "verify" in sections:
                paths["tcp+verify"] = tcp(holder.sums)
            if args.tcp_unpacked:
                flat = ShardBuffers(tensors, layout_of(tensors, pack_threshold=0))
                paths["tcp unpacked"] = lambda: runner.run(tcp_pull(transport, peer, flat, args.streams, args.timeout,
                                                                    region=REGION_UNPACKED))  # fmt: skip
        if want_product or want_memory:
            model = f"bench-{label}"
            _, open_s, publish_s = holder.ask("publish", server, model, args.streams, DEFAULT_PACK_THRESHOLD, True)
            res.update(trainer_open_register_s=open_s, trainer_publish_s=publish_s)
            if want_product:
                handle = tensorhub.open(model, "reader", server=server, retain=None,
                                        transports={"tcp": {"streams": args.streams, "io_timeout": args.timeout}})  # fmt: skip
                with pack_threshold_env(DEFAULT_PACK_THRESHOLD):
                    handle.register(tensors)
                paths["product"] = lambda: product_pull(handle, args.timeout)

        times: dict[str, list[float]] = {name: [] for name in paths}
        cpu: dict[str, list[float]] = {name: [] for name in paths}  # CPU seconds, reader + holder
        order_of = list(paths)
        for r in range(args.warmup + args.repeats if paths else 0):
            order = order_of[r % len(order_of):] + order_of[: r % len(order_of)]
            for name in order:
                zero(tensors, into, handle.buffers if handle is not None else None)
                c0, h0c = time.process_time(), process_cpu(holder.proc.pid)
                got = paths[name]()
                c1, h1c = time.process_time(), process_cpu(holder.proc.pid)
                check(f"{name} (transfer {r + 1})")
                if name == "product":
                    handle.unpublish()  # the next repeat pulls again, from the trainer
                dt = got.seconds if isinstance(got, TcpPull) else got
                if r >= args.warmup:
                    times[name].append(dt)
                    cpu[name].append((c1 - c0) + (h1c - h0c))
                    if isinstance(got, TcpPull):
                        pulls[name].append(got)
            if r >= args.warmup:
                line = "  ".join(f"{n} {total / times[n][-1] / 1e9:6.2f}" for n in order_of)
                print(f"  repeat {r - args.warmup + 1}/{args.repeats}: GB/s  {line}", flush=True)
        if paths:
            res.update(seconds={k: sorted(v) for k, v in times.items()}, seconds_by_repeat=times,
                       cpu_seconds_by_repeat=cpu)  # fmt: skip
            res["tcp_pulls"] = {k: [asdict(p) for p in v] for k, v in pulls.items() if v}
        if handle is not None:
            res["product_last_pull"] = pull_stats_dict(handle.last_pull)
            if "plan" in res:
                res["plan"]["on"]["product_last_pull"] = res["product_last_pull"]

        if "verify" in sections:
            res["single_thread_s"] = single_thread_seconds(into, max(5, args.repeats))

        if want_memory:
            res["memory"] = measure_memory(label, spec, args, server, holder, names)
        return res
    finally:
        if handle is not None:
            try:
                handle.close()
            except Exception as err:  # noqa: BLE001 - report, and go on cleaning up
                print(f"  (closing the reader handle: {err!r})", file=sys.stderr)
        if sock is not None:
            sock.close()
        if transport is not None:
            runner.run(transport.close())
        holder.stop()


def measure_memory(label: str, spec: Spec, args: argparse.Namespace, server: str, holder: Holder,
                   names: list[str]) -> dict[str, Any]:  # fmt: skip
    """Section 5: a fresh reader process pulls once from the holder's trainer; both report their
    peak RSS over RSS right after register."""
    reader = Child("memory reader", memory_reader_main, (spec, server, f"bench-{label}", args.streams, args.timeout),
                   args.timeout)  # fmt: skip
    try:
        _, before, base, peak, method, dt, crcs, stats = reader.expect("pulled")
    finally:
        reader.stop()
    check_bytes(f"{label} memory reader's pull", crcs, holder.crcs, names)
    _, h_before, h_base, h_peak, h_method = holder.ask("memory")
    reader_figures = {"rss_before_register": before, "rss_after_register": base, "peak": peak, "method": method,
                      "pull_s": dt, "last_pull": stats}  # fmt: skip
    holder_figures = {"rss_before_register": h_before, "rss_after_register": h_base, "peak": h_peak, "method": h_method}
    return {"reader": reader_figures, "holder": holder_figures}


# ---- section 4: publish -------------------------------------------------------------------------


def bench_publish(args: argparse.Namespace, server: str) -> dict[str, Any]:
    """The trainer's ``publish`` on model-like shards of three sizes, one handle each, in rounds
    that rotate over the sizes (so that load on the host hits them alike); and when each
    publish job has declared its checksums."""
    import tensorhub

    sizes = sorted({max(1, args.size_mib // 16), max(1, args.size_mib // 4), args.size_mib})
    specs = {mib: model_spec(mib << 20, args.seed) for mib in sizes}
    times: dict[int, tuple[list[float], list[float]]] = {mib: ([], []) for mib in sizes}
    handles: dict[int, Any] = {}
    try:
        for mib in sizes:
            tensors = allocate(specs[mib])
            fill_seeded(tensors, args.seed)
            h = handles[mib] = tensorhub.open(f"bench-publish-{mib}", "trainer", server=server, retain=None)
            with pack_threshold_env(DEFAULT_PACK_THRESHOLD):
                h.register(tensors)  # the handle keeps the tensors alive
        for r in range(1 + args.publish_repeats):  # round 0 is a warm-up
            v = r + 1
            for mib in sizes[r % len(sizes):] + sizes[: r % len(sizes)]:
                h = handles[mib]
                engine, session = h._engine, h.session
                t0 = time.perf_counter()
                h.publish(v)
                t1 = time.perf_counter()
                h._loop.run(engine.ask(WaitPublished(session)), args.timeout)
                t2 = time.perf_counter()
                slot = engine.slots.get(session)
                if slot is None or v not in slot.checksums:
                    raise BenchmarkError(f"publish {mib} MiB: version {v} has no checksums after its publish job")
                h.unpublish()
                if r:
                    times[mib][0].append(t1 - t0)
                    times[mib][1].append(t2 - t0)
    finally:
        for h in handles.values():
            h.close()
    out: dict[str, Any] = {}
    for mib in sizes:
        publish_s, declared_s = times[mib]
        out[str(mib)] = {"bytes": spec_bytes(specs[mib]), "tensors": len(specs[mib]), "publish_s": sorted(publish_s),
                         "declared_s": sorted(declared_s)}  # fmt: skip
        print(f"  publish {spec_bytes(specs[mib]) / 2**20:,.1f} MiB: median {median(publish_s) * 1e3:.2f} ms, declared "
              f"after {median(declared_s) * 1e3:.1f} ms", flush=True)  # fmt: skip
    return out
