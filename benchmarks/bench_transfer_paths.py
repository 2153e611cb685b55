"""The TensorHub side of ``bench_transfer.py``: the pulls it times (the ``tcp`` transport driven
by a ``ReplicationSession`` as the engine drives it; ``replicate`` on a real handle; any
registered transport, started by name, over the engine's read plan) and the read plan's counts
that section 1 checks against the handle's ``last_pull``."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.harness import BenchmarkError
from benchmarks.harness.shards import ENGINE_CHUNK, REGION, VERSION, read_bytes_of
from tensorhub.core.errors import TransportError
from tensorhub.core.layout import PACK_MAX
from tensorhub.core.session import (
    Advance,
    ReadRange,
    ReplicationSession,
    ReportChecksumFailed,
    ReportComplete,
    ReportSourceFailed,
    Verify,
)
from tensorhub.runtime import checksum
from tensorhub.transports.buffers import DEFAULT_PACK_THRESHOLD, ShardBuffers, layout_of
from tensorhub.transports.tcp import RangeNotReady, TcpTransport

# ---- tcp and the product ------------------------------------------------------------------------


@dataclass
class TcpPull:
    seconds: float = 0.0
    reads: int = 0  # reads that landed
    segments: int = 0  # memory pieces they touched
    verify_s: float = 0.0  # seconds in hashing threads (overlapped with the reads)
    landed_s: float = 0.0  # from the start until the last read landed
    verified_s: float = 0.0  # ... until every read was verified (the session reported complete)
    unpack_s: float = 0.0


async def tcp_pull(transport: TcpTransport, peer: dict, into: ShardBuffers, streams: int, timeout: float,
                   expected: Sequence[int] | None = None, region: int = REGION) -> TcpPull:  # fmt: skip
    """One pull of the whole shard, as the engine runs it: the layout's read plan, session
    actions -> transport reads; with ``expected`` checksums, every landed read is verified in a
    worker thread while the next reads run; the packs are unpacked at the end."""
    loop = asyncio.get_running_loop()
    plan = into.plan.reads(read_bytes_of(into.layout))
    units = {r.offset: r.units for r in plan if r.length}
    session = ReplicationSession(VERSION, into.total_bytes, ENGINE_CHUNK, streams,
                                 reads=[(r.offset, r.length) for r in plan], verify=expected is not None)  # fmt: skip
    finished = loop.create_future()
    unpacking: list[asyncio.Task] = []
    tasks: set[asyncio.Task] = set()
    out = TcpPull()

    def fail(err: Exception) -> None:
        if not finished.done():
            finished.set_exception(err)

    def spawn(coro: Any) -> None:
        task = loop.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def run(actions: list) -> None:
        for a in actions:
            if isinstance(a, ReadRange):
                spawn(read(a))
            elif isinstance(a, Verify):
                spawn(check(a))
            elif isinstance(a, Advance):
                into.progress.advance(a.verified)
            elif isinstance(a, ReportComplete):
                out.verified_s = time.perf_counter() - start
                spawn(unpack())
            elif isinstance(a, ReportChecksumFailed):
                fail(BenchmarkError(f"tcp+verify: landed bytes failed their checksum (unit {a.unit})"))
            elif isinstance(a, ReportSourceFailed):
                fail(BenchmarkError(f"tcp: the source failed: {a.reason}"))

    async def read(a: ReadRange) -> None:
        try:
            await transport.read(peer, region, VERSION, a.offset, a.length, into, None)
        except RangeNotReady as err:
            run(session.on_read_failed(a.grant, a.offset, str(err), True))
        except TransportError as err:
            run(session.on_read_failed(a.grant, a.offset, str(err), False))
        else:
            out.reads += 1
            out.segments += len(into.segments(a.offset, a.length))
            out.landed_s = time.perf_counter() - start
            run(session.on_read_done(a.grant, a.offset))

    async def check(a: Verify) -> None:
        assert expected is not None
        t0 = time.perf_counter()
        bad = await asyncio.to_thread(checksum.first_mismatch, into, units[a.offset], expected)
        out.verify_s += time.perf_counter() - t0
        if bad is None and into.packed:  # as the engine: unpack this read's tiny tensors now
            tiny = [into.plan.units[u].tensor for u in units[a.offset] if into.plan.units[u].region >= 0
                    and into.plan.regions[into.plan.units[u].region].tensor is None]  # fmt: skip
            if tiny:
                chain_unpack(tiny)
        run(session.on_verified(a.grant, a.offset, bad))

    def chain_unpack(tensors: list[int] | None) -> None:
        before = unpacking[-1] if unpacking else None

        async def one() -> None:
            if before is not None:
                await before
            await asyncio.to_thread(into.unpack, tensors)

        unpacking.append(loop.create_task(one()))

    async def unpack() -> None:
        t0 = time.perf_counter()
        if into.packed:
            if expected is None:
                chain_unpack(None)  # unverified reads: unpack all at the end
            if unpacking:
                await unpacking[-1]
        out.unpack_s = time.perf_counter() - t0
        if not finished.done():
            finished.set_result(None)

    start = time.perf_counter()
    into.progress.reset(VERSION, 0)
    run(session.on_grant(1, "holder"))
    try:
        await asyncio.wait_for(finished, timeout)
    finally:
        for task in list(tasks):
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    out.seconds = time.perf_counter() - start
    return out


def product_pull(handle: Any, timeout: float) -> float:
    t0 = time.perf_counter()
    v = handle.replicate(VERSION, timeout=timeout)
    dt = time.perf_counter() - t0
    if v != VERSION:
        raise BenchmarkError(f"product: replicate returned version {v}, expected {VERSION}")
    return dt


# ---- section 1: the read plan ------------------------------------------------------------------


def plan_counts(tensors: dict[str, torch.Tensor], threshold: int, buffers: ShardBuffers | None = None) -> dict[str, Any]:
    """Regions, reads and segments of one pull with ``pack_threshold=threshold``, from the
    product's own ``ShardBuffers`` and read plan (built here without copying the tensors), and
    the goal's bound."""
    if buffers is None:
        buffers = ShardBuffers(tensors, layout_of(tensors, pack_threshold=threshold))
    layout = buffers.layout
    rb = read_bytes_of(layout)
    reads = [r for r in buffers.plan.reads(rb) if r.length]
    segments = sum(len(buffers.segments(r.offset, r.length)) for r in reads)
    large = sum(1 for t in layout.tensors if t.nbytes >= DEFAULT_PACK_THRESHOLD)
    tiny_bytes = sum(t.nbytes for t in layout.tensors if 0 < t.nbytes < DEFAULT_PACK_THRESHOLD)
    packs = -(-tiny_bytes // PACK_MAX)  # what packing at the default threshold needs at least
    floor = -(-buffers.total_bytes // rb)
    return {
        "pack_threshold": threshold,
        "read_bytes": rb,
        "tensors": len(layout.tensors),
        "large_tensors": large,
        "packs": sum(1 for r in buffers.plan.regions if r.tensor is None),
        "pack_bytes": sum(r.nbytes for r in buffers.plan.regions if r.tensor is None),
        "regions": len(buffers.regions),
        "reads": len(reads),
        "segments": segments,
        "goal_regions_max": large + packs,
        "goal_ops_max": large + packs + floor,
    }


def pull_stats_dict(stats: Any) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {"reads": stats.reads, "segments": stats.segments, "regions": stats.regions, "grants": stats.grants,
            "bytes": stats.bytes, "verify_s": stats.verify_s}  # fmt: skip


# ---- any transport, by name ---------------------------------------------------------------------


def start_transport(runner: asyncio.Runner, name: str, timeout: float, options: dict | None = None) -> tuple[Any, float]:
    """Transport ``name`` (the registry's class, with ``options``, default: none), started on
    ``runner``'s loop, and the seconds its ``start()`` took."""
    from tensorhub.transports.registry import get_transport

    transport = get_transport(name)(dict(options or {}))
    t0 = time.perf_counter()
    runner.run(asyncio.wait_for(transport.start(), timeout))
    return transport, time.perf_counter() - t0


def close_transport(runner: asyncio.Runner, transport: Any, timeout: float) -> None:
    try:
        runner.run(asyncio.wait_for(transport.close(), timeout))
    except Exception as err:  # noqa: BLE001 - say so and go on: the process is done with it
        print(f"{transport.name}: close failed: {err!r}", file=sys.stderr)


async def transport_pull(transport: Any, peer: dict, region: int, into: ShardBuffers, reads: list[tuple[int, int]],
                         streams: int, landing: Any = None) -> int:  # fmt: skip
    """One pull of the whole shard through ``transport``: the engine's read plan, ``streams``
    reads in flight, each read after the first passing the generation the first returned;
    ``landing(offset, length)``, if given, makes each read's ``landed`` argument (as the engine
    passes a hasher to a transport that reports landing). Returns that generation."""
    gate = asyncio.Semaphore(streams)
    seen: set[int] = set()
    gen: int | None = None

    async def one(offset: int, length: int) -> None:
        nonlocal gen
        async with gate:
            kw = {} if landing is None else {"landed": landing(offset, length)}
            got = await transport.read(peer, region, VERSION, offset, length, into, gen, **kw)
        if gen is None:
            gen = got
        seen.add(got)

    await asyncio.gather(*(one(o, n) for o, n in reads))
    if len(seen) != 1 or gen is None:
        raise BenchmarkError(f"{transport.name}: the reads of one pull returned generations {sorted(seen)}")
    return gen
