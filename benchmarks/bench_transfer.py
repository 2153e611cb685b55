"""The data plane, measured: one holder -> reader pull over ``tcp`` against raw sockets, what
packing saves in registrations and transfer operations, what verification costs, what
``publish`` costs the trainer, and how much memory a pull takes on either side.

Two shards, each about ``--size-mib`` MiB (default 1,024), with seeded content:

- ``64x16MiB``: 64 tensors of equal size (16 MiB at full size), uint8 and bfloat16 alternating;
- ``model-500``: 500 tensors of seeded sizes, about half under 64 KiB (norms, biases; fp32 and
  bf16), the rest large bf16 weights, in a shuffled, model-like order.

The holder is a separate process (multiprocessing ``spawn``) that serves from its own memory;
the reader is this process (section 6: separate processes too). The sections (``--sections``, default all) measure:

1. ``plan``: registrations and transfer operations of one pull, with packing (the default
   ``pack_threshold``, 2 MiB) and without (0), from the layout's read plan as the engine uses
   it (``plan_of(layout).reads(max(engine chunk, layout.chunk_bytes))``): ``regions`` (what a
   one-sided transport registers: ``len(ShardBuffers.regions)``), ``reads`` per pull (one
   request each) and ``segments`` (the memory pieces those reads touch: descriptors, for a
   one-sided transport). When the product path runs, the reader handle's ``last_pull``
   (``PullStats``) must agree: after the timed product pulls (packing on) and after one extra
   pull of a copy published with ``$TENSORHUB_PACK_THRESHOLD=0`` (packing off).
   Goal (DESIGN §4: packing keeps registrations and transfer ops near the number of large
   tensors): with packing, ``regions <= large + packs`` (one per tensor of at least 2 MiB, plus
   the packs) and ``reads`` and ``segments <= large + packs + shard / read size`` (every
   region is touched, and a read size cuts the shard into at least that many pieces).
   The ``off`` row is the reference packing is compared with; it has no goal.
2. ``transfer``: for each shard and repeat, between the same two processes:

   - ``baseline``: plain sockets, one connection: the holder ``sendall``s each tensor's memory
     in layout order, the reader ``recv_into``s straight into its preallocated tensors;
   - ``tcp``: ``transports.tcp.TcpTransport`` driven the way the engine drives it: a
     ``ReplicationSession`` over the layout's read plan (whole checksum units per read, of up
     to 8 MiB or ``$TENSORHUB_CHUNK_BYTES``, as in the engine) issues reads in transfer order
     (packs, then large tensors), ``--streams`` at once, each one ``TcpTransport.read`` into the
     reader's ``ShardBuffers``. The holder packed its tiny tensors before serving (as the
     publish job does); the reader unpacks them after the last read, inside the timed pull;
   - ``tcp, no packing`` (only with ``--tcp-unpacked``): the same driver over the same tensors
     laid out with ``pack_threshold`` 0 (no packs, nothing to unpack): what packing costs tcp;
   - ``product``: the full path: a real server (``python -m tensorhub server``), the holder
     process publishes the shard as a trainer (``tensorhub.open`` + ``register`` +
     ``publish(1)``) and this process times ``replicate(1)`` into the same tensors (then
     ``unpublish`` for the next repeat). ``--no-product`` skips it (and sections 4 and 5,
     which need a server).

   Goal: ``tcp >= 0.9 x baseline`` on both shards (the model-like one is the harder: 500
   tensors, half of them tiny). Under each shard a line splits the tcp pull: when its last read
   landed (against the baseline's whole pull), then the unpack, which runs after it.
3. ``verify``: ``tcp+verify`` is the same driver with ``verify=True``: every read that lands is
   hashed in a worker thread (``checksum.first_mismatch`` over the read's checksum units,
   against the xxh3-64 checksums the holder computed with ``checksum.compute`` and sent over the
   control pipe) while the next reads are on the wire, exactly as the engine does; a read
   counts once verified, and its tiny tensors are unpacked right then, in the background, as
   the engine does (plain ``tcp`` unpacks everything after the last read). Goal: ``tcp+verify / tcp <= 1.10`` in time (verification adds at
   most 10 %). To say where the extra time comes from, the table shows when the last read
   landed without and with hashing (hashing threads competing with the transfer for cores
   slow the reads down), the hashing still left after the last read (the tail that does not
   overlap), the time spent in the hashing threads, and the time one thread takes to hash
   the whole shard alone (what verification must add on a host with no spare core: a
   loopback transfer keeps a core busy on each side). Beside it, single-thread speeds
   measured for each shard in rounds that interleave them (``max(5, --repeats)`` after a
   warm-up): the hash of the whole shard (``checksum.compute``, per unit as a publisher
   does), and over as many bytes xxh3 of one buffer and memcpy into preallocated memory (a
   torch ``copy_`` with one intra-op thread, and a ``memoryview`` slice assignment). Goal:
   the shard's hash at least as fast as the faster memcpy (hashing reads the bytes once; a
   copy reads and writes them).
4. ``publish``: the trainer's cost of ``publish(v)`` on a real handle (this process, the
   benchmark's server) for model-like shards of ``--size-mib`` / 16, / 4 and x 1, each
   ``--publish-repeats`` times after a warm-up, in unpublish / publish(v + 1) rounds; and
   separately how long after the call started the background job (pack, hash, declare) has
   declared the checksums (the engine's ``WaitPublished``, what ``unpublish`` waits for).
   The sizes take turns within each round, so that other load on the host hits them alike
   (a model-like shard has at least ~23 MiB: 250 weights of at least 64 KiB; the table shows
   the real sizes). Goal: publish does not grow with the shard: median at the largest size
   ``<= 1.5 x`` the median at the smallest (a 16x size range at the default sizes).
5. ``memory`` (``model-500``): peak RSS minus RSS right after ``register``, in the holder
   process (a window from its trainer's register through the publish job and every pull it
   served afterwards: the timed baseline, tcp and product pulls, and the one below) and in a
   fresh reader process (from its register through one ``replicate`` from that trainer). The peak is the kernel's high-water mark ``VmHWM``,
   reset to the current RSS right after register by writing ``5`` to
   ``/proc/self/clear_refs``, read at the window's end; where that reset is refused, a thread
   samples ``VmRSS`` every 2 ms instead (and may miss a shorter spike); the method used is
   printed. The memory ``register`` itself takes (mostly the pack buffers: a second copy of the
   packed tensors, made resident when they are zeroed) is reported beside it, outside the
   goal. Goal: ``<= 64 MiB`` each.
6. ``rdma``: the one-sided and same-host transports, driven directly (``start``, ``serve``,
   ``expose``, ``read``, as ``tensorhub.testing`` drives them) with their default options, each
   against a baseline: ``nixl`` and ``rdma_copy`` against a raw NIXL READ of the same bytes
   (two bare ``nixl_agent``s with NIXL's defaults: the holder registers the same regions, the
   reader its destination, metadata exchanged, one READ transfer request per read of the plan
   with a descriptor per segment, 4 in flight, polled as the transports poll), ``local``
   against a one-thread torch ``copy_`` of the same regions in one process. One holder process
   (the shard seeded, packed and verified, as a publish job leaves it) and 1, 2 and 4 reader
   processes, each pulling the whole shard at once (released together by a start time on the
   host's monotonic clock): the engine's read plan (whole checksum units of up to 8 MiB), the
   transport's ``streams`` reads in flight (``asyncio.gather`` under a semaphore), each read
   after the first passing the generation the first returned. ``GB/s total`` is all readers'
   bytes over the time from the first start to the last end. The processes (5, started once:
   importing torch costs seconds) serve every shard, reader count and repeat. NIXL agents
   exist only while their own path runs: an idle agent's progress thread keeps about half a
   core busy (the ``idle cores`` column; NIXL's Python API sets no progress-thread delay), and
   two more idle agents in each process cut a raw pull from 1.8 to 0.6 GB/s on 2 cores. So a NIXL
   path and its baseline take turns pull by pull, each turn starting its agents, making its
   connections with one untimed read per reader, pulling once (``--warmup`` more, untimed, on
   the first turn) and closing them; ``local`` and memcpy alternate pull by pull. Registration
   is reported apart from throughput: ``expose()`` of the shard on each transport right after
   its agent started (holder and readers), again ``--repeats`` times after ``withdraw`` in the
   holder, and NIXL ``register_memory`` of the same regions for the raw baseline; ``start()``
   beside it (``rdma_copy`` registers its staging pool there, never the shard). Every pull is
   verified: xxh3-64 of every checksum unit of the reader's transfer space (packs and large
   tensors; the packs are not unpacked) against the holder's. ``--ucx-tls tcp`` runs the NIXL
   phases again with ``$UCX_TLS=tcp`` set in fresh helper processes. Goals (1 GiB shards):
   ``nixl >= 0.9 x`` raw NIXL for every reader count; ``local >= 0.7 x`` memcpy with one
   reader; ``rdma_copy`` has none (its ratio is printed). The section needs no server.

Before every transfer the reader's tensors (and its pack buffers) are zeroed; after it, a CRC-32
of every tensor is compared with the one the holder computed over its seeded content: a
transfer that moved wrong bytes, or verified bytes that failed their checksums, stops the
benchmark with an error (exit status 1). A goal missed is reported (MISS), not an error: the
exit status is 0. Each timed path gets ``--warmup`` untimed transfers (connections,
first-touch effects), then ``--repeats`` timed ones, in an order that rotates each repeat.
Figures are medians in GB/s (10^9 bytes/s) and ratios to what was measured in the same run:
``vs baseline`` is the ratio of the medians (what goals are checked on); ``paired`` is the
median of each repeat's ratio to that same repeat's baseline, steadier when other work on the
host comes and goes. ``CPU s/GB`` is the CPU time that the reader and the holder processes (all
their threads) spent per GB moved, median: the cost of a path, which other load on the host
disturbs less than its speed. ``--json FILE`` writes every figure, every sample behind it and
every verdict.

Usage: python benchmarks/bench_transfer.py [--size-mib N] [--streams S] [--repeats R]
       [--sections plan,transfer,verify,publish,memory,rdma] [--publish-repeats P] [--ucx-tls TLS]
       [--json FILE]
Goals: packing keeps regions/reads/segments near the large tensors; tcp >= 0.9 x baseline;
tcp+verify <= 1.10 x tcp; hash >= memcpy; publish independent of size; <= 64 MiB RSS per side;
nixl >= 0.9 x raw NIXL READ; local >= 0.7 x memcpy (one reader).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import socket
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import xxhash
from server_process import BenchmarkError, Child, start_server, stop_process

from tensorhub import checksum
from tensorhub.actor import new_event_loop
from tensorhub.buffers import DEFAULT_PACK_THRESHOLD, ShardBuffers, layout_of, memory_of
from tensorhub.engine import WaitPublished
from tensorhub.errors import TransportError
from tensorhub.layout import PACK_MAX, Layout
from tensorhub.session import (
    Advance,
    ReadRange,
    ReplicationSession,
    ReportChecksumFailed,
    ReportComplete,
    ReportSourceFailed,
    Verify,
)
from transports.tcp import RangeNotReady, TcpTransport

GOAL_TCP = 0.9  # tcp / baseline, GB/s
GOAL_VERIFY = 1.10  # tcp+verify / tcp, seconds
GOAL_HASH = 1.0  # hash / memcpy, GB/s (one thread each)
GOAL_PUBLISH = 1.5  # publish median at the largest size / at the smallest
GOAL_RSS_MIB = 64.0  # peak RSS - RSS after register, each side
VERSION = 1
REGION = 1  # the holder's packed buffers
REGION_UNPACKED = 2  # the same tensors, laid out with pack_threshold 0 (--tcp-unpacked)
# The engine's read size: 8 MiB unless $TENSORHUB_CHUNK_BYTES says otherwise (as tensorhub.api does).
ENGINE_CHUNK = int(os.environ.get("TENSORHUB_CHUNK_BYTES") or 8 << 20)
POOL_BYTES = 64 << 20  # seeded random bytes that tensor contents are windows of
DTYPES = {"uint8": torch.uint8, "bfloat16": torch.bfloat16, "float32": torch.float32}
SECTIONS = ("plan", "transfer", "verify", "publish", "memory", "rdma")
MEMORY_SHARD = "model-500"
GOAL_NIXL = 0.9  # nixl / raw NIXL READ, GB/s
GOAL_LOCAL = 0.7  # local / one-thread memcpy, GB/s, one reader
RDMA_READERS = (1, 2, 4)  # concurrent reader processes of section 6
RDMA_BASELINE = {"nixl": "raw nixl", "rdma_copy": "raw nixl", "local": "memcpy"}
RAW_INFLIGHT = 4  # READ requests the raw baseline keeps in flight (the transports' default streams)
RDMA_REGION_BASE = 10  # region ids of section 6's shards (one per shard)

Spec = list[tuple[str, str, int]]  # (name, dtype, numel)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


# ---- shards -----------------------------------------------------------------------------------


def uniform_spec(total: int) -> Spec:
    """64 equal tensors, uint8 and bfloat16 alternating."""
    each = max(2, total // 64) & ~1
    spec = []
    for i in range(64):
        dtype = "uint8" if i % 2 == 0 else "bfloat16"
        spec.append((f"layer{i}.weight", dtype, each // (1 if dtype == "uint8" else 2)))
    return spec


def model_spec(total: int, seed: int, n: int = 500) -> Spec:
    """``n`` tensors of seeded sizes adding up to about ``total`` bytes: half small (under 64 KiB,
    fp32 or bf16), half large bf16 weights (log-uniform over a factor of 8, at least 64 KiB)."""
    rng = random.Random(seed)
    small_n = n // 2
    spec: list[tuple[str, str, int]] = []
    small_bytes = 0
    for i in range(small_n):
        dtype = "float32" if i % 2 == 0 else "bfloat16"
        size = DTYPES[dtype].itemsize
        nbytes = int(2 ** rng.uniform(9, 16))  # 512 B .. 64 KiB
        numel = max(1, min(nbytes, (64 << 10) - size) // size)
        spec.append((f"small{i}.{'norm' if dtype == 'float32' else 'bias'}", dtype, numel))
        small_bytes += numel * size
    large_n = n - small_n
    budget = max(total - small_bytes, large_n * (64 << 10))
    weights = [2 ** rng.uniform(0, 3) for _ in range(large_n)]
    scale = budget / sum(weights)
    large = [max(32 << 10, int(w * scale) // 2) for w in weights]  # bf16 elements, >= 64 KiB
    large[-1] = max(32 << 10, large[-1] + (budget // 2 - sum(large)))
    spec += [(f"large{i}.weight", "bfloat16", numel) for i, numel in enumerate(large)]
    rng.shuffle(spec)
    return spec


def spec_bytes(spec: Spec) -> int:
    return sum(numel * DTYPES[dtype].itemsize for _, dtype, numel in spec)


def allocate(spec: Spec) -> dict[str, torch.Tensor]:
    """Zeroed (so: resident) tensors of ``spec``."""
    return {name: torch.zeros(numel, dtype=DTYPES[dtype]) for name, dtype, numel in spec}


def fill_seeded(tensors: dict[str, torch.Tensor], seed: int) -> None:
    """Each tensor's bytes: a window of a seeded random pool, at a tensor-specific offset."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.empty(POOL_BYTES // 8, dtype=torch.int64)
    pool.random_(generator=gen)
    pool8 = pool.view(torch.uint8)
    for i, t in enumerate(tensors.values()):
        dst = t.view(-1).view(torch.uint8)
        pos, start = 0, (i * 1_000_003 + 17) % POOL_BYTES
        while pos < dst.numel():
            n = min(dst.numel() - pos, POOL_BYTES - start)
            dst[pos : pos + n].copy_(pool8[start : start + n])
            pos += n
            start = 0


def crcs_of(tensors: dict[str, torch.Tensor], pool: ThreadPoolExecutor) -> list[int]:
    """CRC-32 of every tensor's bytes (zlib releases the GIL: the pool runs them in parallel)."""
    return list(pool.map(lambda t: zlib.crc32(memory_of(t)), tensors.values()))


def check_bytes(label: str, got: list[int], expected: list[int], names: Sequence[str]) -> None:
    bad = [name for name, a, b in zip(names, got, expected, strict=True) if a != b]
    if bad:
        raise BenchmarkError(f"{label}: {len(bad)} of {len(names)} tensors hold wrong bytes after the transfer "
                             f"(first: {', '.join(bad[:5])})")  # fmt: skip


def zero(tensors: dict[str, torch.Tensor], *buffers: ShardBuffers | None) -> None:
    """Zero the tensors and the pack buffers of ``buffers``: a pull that skipped a range of a pack
    must not be saved by the bytes an earlier pull left there."""
    for t in tensors.values():
        t.zero_()
    for b in buffers:
        if b is not None:
            for r, t in zip(b.plan.regions, b.regions, strict=True):
                if r.tensor is None:
                    t.zero_()


@contextlib.contextmanager
def pack_threshold_env(threshold: int) -> Iterator[None]:
    """``$TENSORHUB_PACK_THRESHOLD`` set to ``threshold`` (``register`` reads it), then restored."""
    before = os.environ.get("TENSORHUB_PACK_THRESHOLD")
    os.environ["TENSORHUB_PACK_THRESHOLD"] = str(threshold)
    try:
        yield
    finally:
        if before is None:
            del os.environ["TENSORHUB_PACK_THRESHOLD"]
        else:
            os.environ["TENSORHUB_PACK_THRESHOLD"] = before


def read_bytes_of(layout: Layout) -> int:
    """The read size the engine plans with."""
    return max(ENGINE_CHUNK, layout.chunk_bytes)


# ---- resident memory ------------------------------------------------------------------------------


def status_bytes(field: str) -> int:
    """``field`` (e.g. ``VmRSS``) of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        found = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if found is None:
        raise BenchmarkError(f"/proc/self/status has no {field}")
    return int(found.group(1)) << 10


class PeakRss:
    """This process's peak resident memory from now on, against its RSS now.

    The kernel keeps the high-water mark ``VmHWM``; writing ``5`` to ``/proc/self/clear_refs``
    resets it to the current RSS (Linux >= 4.0), so the window's peak is ``VmHWM`` at its end.
    Where the reset is refused, a daemon thread samples ``VmRSS`` every 2 ms instead."""

    def __init__(self) -> None:
        self.base = status_bytes("VmRSS")
        self._sampled = self.base
        self._stop = threading.Event()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM after clear_refs"
        except OSError:
            self.method = "VmRSS sampled every 2 ms"
            threading.Thread(target=self._sample, name="rss-sampler", daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._sampled = max(self._sampled, status_bytes("VmRSS"))

    def peak(self) -> int:
        if self.method.startswith("VmHWM"):
            return status_bytes("VmHWM")
        return max(self._sampled, status_bytes("VmRSS"))

    def close(self) -> None:
        self._stop.set()


# ---- helper processes ---------------------------------------------------------------------------


def _baseline_serve(lst: socket.socket, views: list[memoryview], stop: threading.Event) -> None:
    """One connection at a time; each b"G" it receives is answered with every tensor's bytes."""
    while not stop.is_set():
        try:
            conn, _ = lst.accept()
        except OSError:
            return
        with conn:
            try:
                while not stop.is_set():
                    req = conn.recv(1)
                    if req != b"G":
                        break
                    for v in views:
                        conn.sendall(v)
            except OSError:
                pass


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
    base = threading.Thread(target=_baseline_serve, args=(lst, views, stop), daemon=True)
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


# ---- the reader's paths -------------------------------------------------------------------------


def baseline_pull(sock: socket.socket, views: list[memoryview]) -> float:
    t0 = time.perf_counter()
    sock.sendall(b"G")
    for v in views:
        got, n = 0, len(v)
        while got < n:
            k = sock.recv_into(v[got:], n - got)
            if k == 0:
                raise BenchmarkError(f"baseline: the holder closed after {got} of {n} bytes")
            got += k
    return time.perf_counter() - t0


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


def single_thread_seconds(into: ShardBuffers, repeats: int) -> dict[str, list[float]]:
    """One thread's seconds, in rounds that interleave them (so that load on the host hits
    them alike): hashing the shard per checksum unit (``checksum.compute``, as the publish job
    does), and, over as many bytes, a memcpy into preallocated memory (torch ``copy_`` with one
    intra-op thread; a memoryview slice assignment) and xxh3 of one buffer."""
    nbytes = into.total_bytes
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.random_(generator=torch.Generator().manual_seed(1))
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    sv, dv = memory_of(src), memory_of(dst)
    steps = {
        "hash_shard_s": lambda: checksum.compute(into),
        "memcpy_torch_s": lambda: dst.copy_(src),
        "memcpy_memoryview_s": lambda: dv.__setitem__(slice(None), sv),
        "xxh3_buffer_s": lambda: xxhash.xxh3_64_intdigest(sv),
    }
    out: dict[str, list[float]] = {key: [] for key in steps}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for r in range(repeats + 1):  # the first round is a warm-up
            for key, step in steps.items():
                t0 = time.perf_counter()
                step()
                dt = time.perf_counter() - t0
                if r:
                    out[key].append(dt)
    finally:
        torch.set_num_threads(threads)
    if not torch.equal(src, dst):
        raise BenchmarkError("memcpy: the copy differs from its source")
    return out


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


# ---- section 6: rdma (nixl, rdma_copy, local) -------------------------------------------------


def _ucx_env(ucx_tls: str | None) -> None:
    """In a helper process, before any NIXL agent exists: UCX reads its environment when an
    agent starts its UCX context."""
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls


def rdma_available() -> bool:
    """Whether NIXL imports here (the nixl, rdma_copy and raw NIXL paths need it)."""
    from transports.nixl import load_nixl

    return load_nixl() is not None


def rdma_phases(ucx_tls: str | None) -> list[tuple[str, str]]:
    """``(baseline, path)`` pairs of one run of section 6, each measured in its own phase.
    Under ``UCX_TLS`` only the NIXL paths change, so ``local`` runs only under UCX's default;
    without NIXL only it runs."""
    nixl = [("raw nixl", "nixl"), ("raw nixl", "rdma_copy")] if rdma_available() else []
    return nixl if ucx_tls else [*nixl, ("memcpy", "local")]


def raw_nixl_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend configured as the transports configure theirs (the
    progress thread's pause; see ``transports.nixl.default_agent``), for the raw READ baseline:
    the comparison is of what the transport does with an agent, not of agent settings."""
    from transports.nixl import default_agent, load_nixl

    if load_nixl() is None:
        raise BenchmarkError("NIXL is not installed (pip install nixl-cu12)")
    return default_agent(name, None)


def raw_register(agent: Any, regions: list[torch.Tensor]) -> Any:
    """Register the regions (CPU memory) with a bare agent, as ``NixlIO.register`` does."""
    descs = [(t.data_ptr(), t.numel() * t.element_size(), 0, "") for t in regions if t.numel()]
    return agent.register_memory(agent.get_reg_descs(descs, "DRAM"))


def start_transport(runner: asyncio.Runner, name: str, timeout: float) -> tuple[Any, float]:
    """Transport ``name`` (the registry's class, default options), started on ``runner``'s
    loop, and the seconds its ``start()`` took."""
    from transports.registry import get_transport

    transport = get_transport(name)({})
    t0 = time.perf_counter()
    runner.run(asyncio.wait_for(transport.start(), timeout))
    return transport, time.perf_counter() - t0


def close_transport(runner: asyncio.Runner, transport: Any, timeout: float) -> None:
    try:
        runner.run(asyncio.wait_for(transport.close(), timeout))
    except Exception as err:  # noqa: BLE001 - say so and go on: the process is done with it
        print(f"{transport.name}: close failed: {err!r}", file=sys.stderr)


def _serve_commands(conn: Any, side: Any) -> None:
    """Run ``side.<command>(*args)`` for each ``(command, *args)`` the parent sends, answering
    ``(command, *result)``, until ``quit`` (or the parent is gone)."""
    for _ in range(1 << 30):
        if not conn.poll(1.0):
            if os.getppid() == 1:
                return
            continue
        try:
            cmd = conn.recv()
        except (EOFError, OSError):
            return
        if cmd[0] == "quit":
            return
        conn.send((cmd[0], *getattr(side, "do_" + cmd[0])(*cmd[1:])))


def _rdma_process(conn: Any, make: Any, ucx_tls: str | None, timeout: float) -> None:
    """The body of section 6's helper processes: ``make(runner)`` builds the side (holder or
    reader), whose ``ready()`` is sent first; then commands until ``quit``."""
    _ucx_env(ucx_tls)
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            side = make(runner)
            try:
                conn.send(("ready", *side.ready()))
                _serve_commands(conn, side)
            finally:
                side.close()
    except Exception:  # noqa: BLE001 - the parent reports it and stops
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))


class RdmaHolder:
    """The holder process of section 6: one shard at a time, seeded and packed as the publish
    job leaves it, complete and verified; served by ``local`` (started once) and by the NIXL
    paths of a phase (``up``: started and exposed; ``down``: withdrawn and closed), so that no
    agent outlives its phase (an idle NIXL agent keeps a progress thread busy)."""

    def __init__(self, runner: asyncio.Runner, timeout: float) -> None:
        self.runner, self.timeout = runner, timeout
        self.region = 0
        self.buffers: ShardBuffers | None = None
        self.transports: dict[str, Any] = {}
        self.raw: Any = None
        self.raw_name = ""
        self.raw_dlist: Any = None
        self._ids = itertools.count()
        local, self.local_start = start_transport(runner, "local", timeout)
        local.serve(self.resolve)
        self.transports["local"] = local

    def resolve(self, region: int, version: int) -> ShardBuffers | None:
        return self.buffers if (region, version) == (self.region, VERSION) else None

    def ready(self) -> tuple:
        return self.transports["local"].endpoint(), self.local_start

    def do_load(self, region: int, spec: Spec, seed: int) -> tuple:
        tensors = allocate(spec)
        fill_seeded(tensors, seed)
        buffers = ShardBuffers(tensors, layout_of(tensors, pack_threshold=DEFAULT_PACK_THRESHOLD))
        buffers.pack()  # as the publish job does, before anything is served
        sums = checksum.compute(buffers)
        buffers.progress.reset(VERSION, buffers.total_bytes)  # a complete, verified holding
        self.region, self.buffers = region, buffers
        t0 = time.perf_counter()
        self.transports["local"].expose(buffers)
        return sums, time.perf_counter() - t0

    def do_unload(self) -> tuple:
        if self.buffers is not None:
            self.transports["local"].withdraw(self.buffers)
        self.buffers = None
        return ()

    def do_up(self, names: list[str]) -> tuple:
        """Start the agents of ``names`` and register the shard; their endpoints, the seconds
        each start and each registration took, and what a raw reader needs."""
        assert self.buffers is not None
        start_s, expose_s = {}, {}
        raw_info = None
        for name in names:
            if name == "raw nixl":
                t0 = time.perf_counter()
                self.raw_name = f"bench-raw-holder-{os.getpid()}-{next(self._ids)}"
                self.raw = raw_nixl_agent(self.raw_name)
                start_s[name] = time.perf_counter() - t0
                t0 = time.perf_counter()
                self.raw_dlist = raw_register(self.raw, self.buffers.regions)
                expose_s[name] = time.perf_counter() - t0
                rows = [(t.data_ptr(), t.numel() * t.element_size()) for t in self.buffers.regions]
                raw_info = (self.raw_name, bytes(self.raw.get_agent_metadata()), rows)
            else:
                t, start_s[name] = start_transport(self.runner, name, self.timeout)
                t.serve(self.resolve)
                self.transports[name] = t
                t0 = time.perf_counter()
                t.expose(self.buffers)
                expose_s[name] = time.perf_counter() - t0
        endpoints = {n: self.transports[n].endpoint() for n in names if n in self.transports}
        return endpoints, start_s, expose_s, raw_info

    def do_down(self, names: list[str], again: int) -> tuple:
        """Withdraw and close the agents of ``names``; first, ``again`` times, withdraw and
        expose (deregister and register) the shard: registration once first-touch effects are
        gone. Returns those seconds per name."""
        buffers = self.buffers
        secs: dict[str, list[float]] = {}
        for name in names:
            times = secs[name] = []
            if name == "raw nixl":
                for _ in range(again if buffers is not None else 0):
                    self.raw.deregister_memory(self.raw_dlist)
                    t0 = time.perf_counter()
                    self.raw_dlist = raw_register(self.raw, buffers.regions)
                    times.append(time.perf_counter() - t0)
                self._drop_raw()
            else:
                t = self.transports.pop(name)
                for _ in range(again if buffers is not None else 0):
                    t.withdraw(buffers)
                    t0 = time.perf_counter()
                    t.expose(buffers)
                    times.append(time.perf_counter() - t0)
                if buffers is not None:
                    t.withdraw(buffers)
                close_transport(self.runner, t, self.timeout)
        return (secs,)

    def _drop_raw(self) -> None:
        if self.raw is not None and self.raw_dlist is not None:
            self.raw.deregister_memory(self.raw_dlist)
        self.raw = self.raw_dlist = None  # the agent goes with its last reference

    def close(self) -> None:
        self._drop_raw()
        for t in self.transports.values():
            close_transport(self.runner, t, self.timeout)
        self.transports.clear()


class RdmaReader:
    """A reader process of section 6: its ``local`` transport (started once) and, per phase,
    the NIXL paths' agents; zeroes its shard, pulls it whole when told ``go``, verifies it."""

    def __init__(self, runner: asyncio.Runner, index: int, timeout: float) -> None:
        torch.set_num_threads(1)  # the memcpy baseline is one thread; nothing else here uses torch's pool
        self.runner, self.index, self.timeout = runner, index, timeout
        self.transports: dict[str, Any] = {}
        self.peers: dict[str, Any] = {}
        self.region = 0
        self.into: ShardBuffers | None = None
        self.src: ShardBuffers | None = None  # the same bytes, for the memcpy baseline
        self.sums: list[int] = []
        self.reads: list[tuple[int, int]] = []  # the engine's read plan: (offset, length)
        self.raw: Any = None
        self.raw_peer = ""
        self.raw_dlist: Any = None
        self.raw_reads: list[tuple[list, list]] = []  # per read: local, remote descriptors
        self._ids = itertools.count()
        self.transports["local"], self.local_start = start_transport(runner, "local", timeout)

    def ready(self) -> tuple:
        return (self.local_start,)

    def do_load(self, region: int, spec: Spec, seed: int, sums: list[int], memcpy: bool, local_peer: dict) -> tuple:
        tensors = allocate(spec)
        into = ShardBuffers(tensors, layout_of(tensors, pack_threshold=DEFAULT_PACK_THRESHOLD))
        if len(sums) != len(into.plan.units):
            raise BenchmarkError(f"the holder sent {len(sums)} checksums for {len(into.plan.units)} units")
        self.region, self.into, self.sums, self.peers["local"] = region, into, sums, local_peer
        self.reads = [(r.offset, r.length) for r in into.plan.reads(read_bytes_of(into.layout)) if r.length]
        t0 = time.perf_counter()
        self.transports["local"].expose(into)
        expose_s = time.perf_counter() - t0
        if memcpy:
            src = allocate(spec)
            fill_seeded(src, seed)
            self.src = ShardBuffers(src, layout_of(src, pack_threshold=DEFAULT_PACK_THRESHOLD))
            self.src.pack()
        segments = sum(len(into.segments(o, n)) for o, n in self.reads)
        return expose_s, len(self.reads), segments

    def do_unload(self) -> tuple:
        if self.into is not None:
            self.transports["local"].withdraw(self.into)
        self.into = self.src = None
        return ()

    def do_up(self, names: list[str], endpoints: dict[str, Any], raw_info: tuple | None) -> tuple:
        assert self.into is not None
        start_s, expose_s = {}, {}
        for name in names:
            if name == "raw nixl":
                assert raw_info is not None
                self.raw_peer, md, rows = raw_info
                t0 = time.perf_counter()
                self.raw = raw_nixl_agent(f"bench-raw-reader{self.index}-{os.getpid()}-{next(self._ids)}")
                start_s[name] = time.perf_counter() - t0
                t0 = time.perf_counter()
                self.raw_dlist = raw_register(self.raw, self.into.regions)
                expose_s[name] = time.perf_counter() - t0
                self.raw.add_remote_agent(md)
                if len(rows) != len(self.into.regions):
                    raise BenchmarkError(f"the holder has {len(rows)} regions, this reader {len(self.into.regions)}")
                self.raw_reads = []
                for offset, length in self.reads:  # what a one-sided reader posts: a descriptor per segment
                    segs = self.into.segments(offset, length)
                    local = [(self.into.regions[s.index].data_ptr() + s.start, s.length, 0) for s in segs]
                    remote = [(rows[s.index][0] + s.start, s.length, 0) for s in segs]
                    self.raw_reads.append((local, remote))
            else:
                t, start_s[name] = start_transport(self.runner, name, self.timeout)
                self.transports[name] = t
                self.peers[name] = endpoints[name]
                t0 = time.perf_counter()
                t.expose(self.into)
                expose_s[name] = time.perf_counter() - t0
        return start_s, expose_s

    def do_down(self, names: list[str]) -> tuple:
        for name in names:
            if name == "raw nixl":
                self._drop_raw()
            else:
                t = self.transports.pop(name)
                if self.into is not None:
                    t.withdraw(self.into)
                close_transport(self.runner, t, self.timeout)
        return ()

    def _drop_raw(self) -> None:
        if self.raw is not None:
            if self.raw_dlist is not None:
                self.raw.deregister_memory(self.raw_dlist)
            with contextlib.suppress(Exception):
                self.raw.remove_remote_agent(self.raw_peer)
        self.raw = self.raw_dlist = None

    def do_prep(self) -> tuple:
        assert self.into is not None
        for t in self.into.regions:  # a pull that skipped bytes must not be saved by an earlier one
            t.zero_()
        return ()

    def do_touch(self, path: str) -> tuple:
        """The first read of the plan along ``path``, untimed: connections and descriptions are
        made here, not in a timed pull."""
        assert self.into is not None
        if path == "raw nixl":
            raw_nixl_pull(self.raw, self.raw_peer, self.raw_reads[:1], 1, time.monotonic() + self.timeout)
        elif path != "memcpy":
            t = self.transports[path]
            pull = transport_pull(t, self.peers[path], self.region, self.into, self.reads[:1], 1)
            self.runner.run(asyncio.wait_for(pull, self.timeout))
        return ()

    def do_go(self, path: str, start_at: float) -> tuple:
        """One timed pull of the whole shard along ``path``, started at ``start_at`` (the
        monotonic clock is the host's: the readers of a round start together)."""
        into = self.into
        assert into is not None
        time.sleep(max(0.0, start_at - time.monotonic()))
        c0, t0 = time.process_time(), time.monotonic()
        if path == "memcpy":
            assert self.src is not None
            for dst, src in zip(into.regions, self.src.regions, strict=True):
                dst.copy_(src)
        elif path == "raw nixl":
            raw_nixl_pull(self.raw, self.raw_peer, self.raw_reads, RAW_INFLIGHT, time.monotonic() + self.timeout)
        else:
            t = self.transports[path]
            pull = transport_pull(t, self.peers[path], self.region, into, self.reads, t.streams)
            self.runner.run(asyncio.wait_for(pull, self.timeout))
        return t0, time.monotonic(), time.process_time() - c0

    def do_verify(self) -> tuple:
        assert self.into is not None
        got = checksum.compute(self.into)
        return (sum(1 for a, b in zip(got, self.sums, strict=True) if a != b),)

    def close(self) -> None:
        self._drop_raw()
        for t in self.transports.values():
            close_transport(self.runner, t, self.timeout)
        self.transports.clear()


def rdma_holder_main(conn: Any, ucx_tls: str | None, timeout: float) -> None:
    _rdma_process(conn, lambda runner: RdmaHolder(runner, timeout), ucx_tls, timeout)


def rdma_reader_main(conn: Any, index: int, ucx_tls: str | None, timeout: float) -> None:
    _rdma_process(conn, lambda runner: RdmaReader(runner, index, timeout), ucx_tls, timeout)


async def transport_pull(transport: Any, peer: dict, region: int, into: ShardBuffers, reads: list[tuple[int, int]],
                         streams: int) -> int:  # fmt: skip
    """One pull of the whole shard through ``transport``: the engine's read plan, ``streams``
    reads in flight, each read after the first passing the generation the first returned.
    Returns that generation."""
    gate = asyncio.Semaphore(streams)
    seen: set[int] = set()
    gen: int | None = None

    async def one(offset: int, length: int) -> None:
        nonlocal gen
        async with gate:
            got = await transport.read(peer, region, VERSION, offset, length, into, gen)
        if gen is None:
            gen = got
        seen.add(got)

    await asyncio.gather(*(one(o, n) for o, n in reads))
    if len(seen) != 1 or gen is None:
        raise BenchmarkError(f"{transport.name}: the reads of one pull returned generations {sorted(seen)}")
    return gen


def raw_nixl_pull(agent: Any, peer: str, reads: list[tuple[list, list]], inflight: int, deadline: float) -> None:
    """The raw baseline: one READ transfer request per read of the plan (a descriptor per
    segment), ``inflight`` of them posted at once from this thread, completion polled as the
    transports poll it (spin a little, then sleep with backoff up to 0.5 ms)."""
    pending = iter(reads)
    nxt = next(pending, None)
    active: list[Any] = []
    spins, sleep = 0, 0.0
    try:
        while nxt is not None or active:
            while nxt is not None and len(active) < inflight:
                local, remote = nxt
                handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), peer)
                active.append(handle)
                if agent.transfer(handle) == "ERR":
                    raise BenchmarkError("raw nixl: a READ failed to post")
                nxt = next(pending, None)
            still = []
            for handle in active:
                state = agent.check_xfer_state(handle)
                if state == "DONE":
                    agent.release_xfer_handle(handle)
                elif state == "PROC":
                    still.append(handle)
                else:
                    raise BenchmarkError(f"raw nixl: a READ ended in state {state}")
            done = len(still) < len(active)
            active = still
            if done:
                spins, sleep = 0, 0.0
                continue
            if time.monotonic() > deadline:
                raise BenchmarkError("raw nixl: the pull did not complete in time")
            spins += 1
            if spins > 64:
                time.sleep(sleep)
                sleep = min(max(sleep * 2, 20e-6), 5e-4)
    finally:
        for handle in active:
            with contextlib.suppress(Exception):
                agent.release_xfer_handle(handle)


NIXL_PATHS = ("raw nixl", "nixl", "rdma_copy")  # the paths that need NIXL agents


def bench_rdma(args: argparse.Namespace, shards: dict[str, Spec], wanted: list[str], ucx_tls: str | None) -> dict[str, Any]:
    """Section 6 under one UCX setting: one holder process and ``max(RDMA_READERS)`` reader
    processes, started once and reused for every shard, phase, reader count and repeat."""
    phases = rdma_phases(ucx_tls)
    env = f"UCX_TLS={ucx_tls}" if ucx_tls else "UCX default transports"
    print(f"section rdma ({env}): 1 holder and {max(RDMA_READERS)} reader processes; phases "
          f"{', '.join(f'{p} vs {b}' for b, p in phases)}", flush=True)  # fmt: skip
    procs: list[Child] = []
    out: dict[str, Any] = {"ucx_tls": ucx_tls, "phases": phases, "shards": {}}
    try:
        holder = Child("rdma holder", rdma_holder_main, (ucx_tls, args.timeout), args.timeout)
        procs.append(holder)
        readers = [Child(f"rdma reader {i}", rdma_reader_main, (i, ucx_tls, args.timeout), args.timeout)
                   for i in range(max(RDMA_READERS))]  # fmt: skip
        procs += readers
        _, local_peer, holder_local_start = holder.expect("ready")
        reader_local_start = [r.expect("ready")[1] for r in readers]
        out["local_start_s"] = {"holder": holder_local_start, "readers": reader_local_start}
        for k, label in enumerate(wanted):
            rig = _RdmaRig(holder, readers, local_peer, args)
            out["shards"][label] = rig.shard(label, RDMA_REGION_BASE + k, shards[label], phases)
    finally:
        for p in procs:
            p.stop()
    return out


@dataclass
class _RdmaRig:
    """The parent's side of section 6 for one shard."""

    holder: Child
    readers: list[Child]
    local_peer: dict
    args: argparse.Namespace
    reg: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # registration seconds, per name and key

    def ask(self, procs: list[Child], *cmd: Any, timeout: float | None = None) -> list[tuple]:
        """Send ``cmd`` to every process of ``procs`` at once, then collect their answers."""
        for p in procs:
            p.send(*cmd)
        return [p.expect(cmd[0], timeout) for p in procs]

    def shard(self, label: str, region: int, spec: Spec, phases: list[tuple[str, str]]) -> dict[str, Any]:
        args = self.args
        total = spec_bytes(spec)
        print(f"  shard {label}: {len(spec)} tensors, {total / 2**20:,.1f} MiB", flush=True)
        (_, sums, holder_local), = self.ask([self.holder], "load", region, spec, args.seed)  # fmt: skip
        memcpy = any(b == "memcpy" for b, _ in phases)
        loaded = self.ask(self.readers, "load", region, spec, args.seed, sums, memcpy, self.local_peer)
        self.reg = {}
        if any(p == "local" for _, p in phases):
            self.note("local", "holder_expose_s", holder_local)
            self.note("local", "readers_expose_s", *(x[1] for x in loaded))
        res: dict[str, Any] = {"bytes": total, "tensors": len(spec), "reads_per_pull": loaded[0][2],
                               "segments_per_pull": loaded[0][3], "registration": self.reg, "phases": {}}  # fmt: skip
        try:
            for baseline, path in phases:
                phase = res["phases"][path] = {"baseline": baseline, "by_readers": {}}
                for k in RDMA_READERS:
                    phase["by_readers"][str(k)] = self.phase(label, total, self.readers[:k], (baseline, path))
        finally:
            self.ask(self.readers, "unload")
            self.ask([self.holder], "unload")
        return res

    def note(self, name: str, key: str, *secs: float) -> None:
        self.reg.setdefault(name, {}).setdefault(key, []).extend(secs)

    def phase(self, label: str, total: int, group: list[Child], paths: tuple[str, str]) -> dict[str, Any]:
        """Both paths of a phase with the readers of ``group``: ``--warmup`` untimed pulls,
        then ``--repeats`` timed pulls each, taking turns (baseline first, then the order
        alternates). A NIXL path's agents exist only for its own turn: every turn starts them,
        makes the connections with one untimed read per reader, pulls, and closes them (an
        idle agent keeps a progress thread busy, which slows whatever else runs on 2 cores)."""
        args = self.args
        out: dict[str, Any] = {"seconds_by_repeat": {p: [] for p in paths}, "cpu_seconds_by_repeat": {p: [] for p in paths},
                               "idle_cores": {}}  # fmt: skip
        for rep in range(args.repeats):
            for path in paths if rep % 2 == 0 else paths[::-1]:
                names = [path] if path in NIXL_PATHS else []
                self.up(group, names)
                try:
                    self.ask(group, "touch", path)
                    if rep == 0:
                        out["idle_cores"][path] = self.idle_cores(group)
                    for _ in range(args.warmup if rep == 0 else 0):
                        self.pull(label, total, group, path, None)
                    self.pull(label, total, group, path, out)
                finally:
                    again = args.repeats if rep == 0 and len(group) == RDMA_READERS[0] else 0
                    self.down(group, names, again)
        k = len(group)
        line = "  ".join(f"{p} {median([k * total / s / 1e9 for s in out['seconds_by_repeat'][p]]):5.2f}" for p in paths)
        print(f"    {k} reader{'s' if k > 1 else ' '}: median GB/s  {line}", flush=True)
        return out

    def up(self, group: list[Child], names: list[str]) -> None:
        if not names:
            return
        (_, endpoints, start_s, expose_s, raw_info), = self.ask([self.holder], "up", names)  # fmt: skip
        ups = self.ask(group, "up", names, endpoints, raw_info)
        for n in names:
            self.note(n, "holder_start_s", start_s[n])
            self.note(n, "holder_expose_s", expose_s[n])
            self.note(n, "readers_start_s", *(u[1][n] for u in ups))
            self.note(n, "readers_expose_s", *(u[2][n] for u in ups))

    def down(self, group: list[Child], names: list[str], again: int) -> None:
        if not names:
            return
        self.ask(group, "down", names)  # readers first: they drop the holder's agent before it goes
        (_, secs), = self.ask([self.holder], "down", names, again)  # fmt: skip
        for n in names:
            self.note(n, "holder_again_s", *secs[n])

    def pull(self, label: str, total: int, group: list[Child], path: str, out: dict[str, Any] | None) -> None:
        """One round: every reader of ``group`` zeroes its shard, all pull it at once along
        ``path``, all verify it; timed into ``out`` unless None."""
        k = len(group)
        self.ask(group, "prep")
        h0 = process_cpu(self.holder.proc.pid)
        got = self.ask(group, "go", path, time.monotonic() + 0.05, timeout=self.args.timeout * (1 + k))
        h1 = process_cpu(self.holder.proc.pid)
        bad = sum(v[1] for v in self.ask(group, "verify"))
        if bad:
            raise BenchmarkError(f"rdma {label} {path}, {k} readers: {bad} checksum units hold wrong bytes after the pull")
        if out is not None:
            out["seconds_by_repeat"][path].append(max(g[2] for g in got) - min(g[1] for g in got))
            out["cpu_seconds_by_repeat"][path].append(sum(g[3] for g in got) + (h1 - h0))

    def idle_cores(self, group: list[Child], window: float = 0.5) -> float:
        """Cores that the holder and the readers of ``group`` keep busy doing nothing (NIXL
        progress threads), over ``window`` seconds."""
        pids = [self.holder.proc.pid, *(r.proc.pid for r in group)]
        c0, t0 = sum(process_cpu(p) for p in pids), time.monotonic()
        time.sleep(window)
        return (sum(process_cpu(p) for p in pids) - c0) / (time.monotonic() - t0)


def process_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far; 0 where /proc is
    missing (the CPU column then counts the reader alone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2


# ---- the report ---------------------------------------------------------------------------------


class Report:
    """Prints figures with their goals and keeps every verdict."""

    def __init__(self) -> None:
        self.verdicts: list[tuple[str, bool]] = []

    def goal(self, what: str, ok: bool) -> str:
        self.verdicts.append((what, ok))
        return verdict(ok)


def report_plan(results: dict[str, Any], rep: Report) -> None:
    rows = [(label, res["plan"]) for label, res in results.items() if "plan" in res]
    if not rows:
        return
    rb = rows[0][1]["on"]["read_bytes"]
    print(f"\n1. registrations and transfer operations per pull ({rb >> 20} MiB reads; large = tensors of at least "
          f"{DEFAULT_PACK_THRESHOLD >> 20} MiB; goal with packing: regions <= large + packs, reads and segments <= "
          f"large + packs + shard/read size)")  # fmt: skip
    print(f"{'shard':<10} {'packing':<12} {'tensors':>7} {'large':>5} {'packs':>5} {'packed MiB':>10} {'regions':>7} "
          f"{'reads':>5} {'segments':>8}  {'goal':<20} {'':4}  product last_pull (reads/segments/regions)")  # fmt: skip
    for label, plan in rows:
        for key, name in (("on", f"on (< {DEFAULT_PACK_THRESHOLD >> 20} MiB)"), ("off", "off (0)")):
            p = plan[key]
            if key == "on":
                met = p["regions"] <= p["goal_regions_max"] and max(p["reads"], p["segments"]) <= p["goal_ops_max"]
                goal = f"<= {p['goal_regions_max']}, <= {p['goal_ops_max']}"
                mark = rep.goal(f"{label} regions, reads and segments with packing", met)
            else:
                goal, mark = "(reference)", "-"
            stats = p.get("product_last_pull")
            if stats is None:
                agree = "(product path not run)"
            else:
                same = (stats["reads"], stats["segments"], stats["regions"]) == (p["reads"], p["segments"], p["regions"])
                agree = (f"{stats['reads']}/{stats['segments']}/{stats['regions']}: "
                         f"{'agrees' if same else 'DIFFERS'}, {rep.goal(f'{label} {key} plan vs last_pull', same)}")  # fmt: skip
            print(f"{label:<10} {name:<12} {p['tensors']:>7} {p['large_tensors']:>5} {p['packs']:>5} "
                  f"{p['pack_bytes'] / 2**20:>10.1f} {p['regions']:>7} {p['reads']:>5} {p['segments']:>8}  {goal:<20} "
                  f"{mark:4}  {agree}")  # fmt: skip
        on, off = plan["on"], plan["off"]
        print(f"{'':<10} packing: {off['regions'] / on['regions']:.1f}x fewer regions, "
              f"{off['segments'] / on['segments']:.1f}x fewer segments, {off['reads'] / on['reads']:.2f}x the reads")  # fmt: skip


def report_transfer(results: dict[str, Any], args: argparse.Namespace, rep: Report) -> None:
    rows = [(label, res) for label, res in results.items() if "seconds" in res]
    if not rows:
        return
    print(f"\n2. one pull, holder -> reader on 127.0.0.1 (goal: tcp >= {GOAL_TCP:.2f} x baseline)")
    print(f"{'shard':<10} {'path':<34} {'GB/s median':>11} {'min':>7} {'max':>7} {'vs baseline':>11} {'paired':>7} "
          f"{'CPU s/GB':>8}  goal")  # fmt: skip
    describe = {"baseline": "baseline (raw socket, 1 conn)", "tcp": f"tcp transport ({args.streams} streams)",
                "tcp+verify": f"tcp + verify ({args.streams} streams)",
                "tcp unpacked": f"tcp, no packing ({args.streams} streams)",
                "product": "product (server+publish+replicate)"}  # fmt: skip
    for label, res in rows:
        nbytes = res["bytes"]
        secs = res["seconds"]
        rates = {k: [nbytes / s / 1e9 for s in v] for k, v in secs.items()}
        med = {k: nbytes / median(v) / 1e9 for k, v in secs.items()}
        res["gbps"] = {k: sorted(v) for k, v in rates.items()}
        res["gbps_median"] = med
        res["ratio_to_baseline"] = {k: med[k] / med["baseline"] for k in med}
        # Paired: each repeat's ratio to the baseline of the same repeat (steadier on a noisy host).
        res["paired_ratio_median"] = {k: median([b / t for t, b in zip(res["seconds_by_repeat"][k], res["seconds_by_repeat"]["baseline"], strict=True)])
                                      for k in secs}  # fmt: skip
        res["cpu_s_per_gb_median"] = {k: median(v) / (nbytes / 1e9) for k, v in res["cpu_seconds_by_repeat"].items()}
        for k in secs:
            ratio = res["ratio_to_baseline"][k]
            note = "-"
            if k == "tcp":
                met = ratio >= GOAL_TCP
                res["goal_tcp_met"] = met
                note = f">= {GOAL_TCP:.2f}: {rep.goal(f'{label} tcp vs baseline', met)}"
            print(f"{label:<10} {describe[k]:<34} {med[k]:>11.2f} {min(rates[k]):>7.2f} {max(rates[k]):>7.2f} "
                  f"{ratio:>10.2f}x {res['paired_ratio_median'][k]:>6.2f}x {res['cpu_s_per_gb_median'][k]:>8.3f}  {note}")
        pulls = res.get("tcp_pulls", {}).get("tcp")
        if pulls:
            # Where a tcp pull's time goes: the reads, then the unpack (serial, after the last read).
            landed, unpack = median([p["landed_s"] for p in pulls]), median([p["unpack_s"] for p in pulls])
            res["tcp_landed_s_median"], res["tcp_unpack_s_median"] = landed, unpack
            print(f"{'':<10} (tcp: {pulls[0]['reads']} reads, {pulls[0]['segments']} segments per pull; last read landed "
                  f"after {landed * 1e3:.1f} ms = {median(secs['baseline']) / landed:.2f}x baseline's speed; then unpack "
                  f"{unpack * 1e3:.1f} ms = {unpack / median(secs['tcp']):.0%} of the pull)")  # fmt: skip
        if "trainer_publish_s" in res:
            print(f"{'':<10} (trainer: open+register {res['trainer_open_register_s'] * 1e3:.1f} ms, publish {res['trainer_publish_s'] * 1e3:.1f} ms)")
    if args.size_mib != 1024:
        print(f"(the goals are stated for 1 GiB shards; this run used {args.size_mib} MiB)")


def report_verify(results: dict[str, Any], rep: Report) -> None:
    rows = [(label, res) for label, res in results.items() if "tcp+verify" in res.get("seconds", {})]
    if not rows:
        return
    print(f"\n3. what verification adds to a tcp pull (goal: tcp+verify / tcp <= {GOAL_VERIFY:.2f} in time)")
    print(f"{'shard':<10} {'tcp ms':>7} {'+verify':>7} {'ratio':>6} {'paired':>6} {'landed ms':>13} {'tail ms':>7} "
          f"{'hashing ms':>10} {'1-thread hash ms':>16} {'CPU s/GB':>13}  goal")  # fmt: skip
    for label, res in rows:
        t, tv = median(res["seconds"]["tcp"]), median(res["seconds"]["tcp+verify"])
        paired = median([b / a for a, b in zip(res["seconds_by_repeat"]["tcp"], res["seconds_by_repeat"]["tcp+verify"], strict=True)])
        plain, checked = res["tcp_pulls"]["tcp"], res["tcp_pulls"]["tcp+verify"]
        landed = median([p["landed_s"] for p in plain]), median([p["landed_s"] for p in checked])
        tail = median([p["verified_s"] - p["landed_s"] for p in checked])  # hashing left after the last read
        hashing = median([p["verify_s"] for p in checked])  # summed over the hashing threads
        alone = median(res["single_thread_s"]["hash_shard_s"])
        cpu = res["cpu_s_per_gb_median"]
        res.update(verify_ratio=tv / t, verify_ratio_paired=paired, verify_landed_s=landed, verify_tail_s=tail,
                   verify_thread_s=hashing)  # fmt: skip
        met = tv / t <= GOAL_VERIFY
        print(f"{label:<10} {t * 1e3:>7.1f} {tv * 1e3:>7.1f} {tv / t:>5.2f}x {paired:>5.2f}x "
              f"{landed[0] * 1e3:>6.1f}->{landed[1] * 1e3:<6.1f} {tail * 1e3:>7.1f} {hashing * 1e3:>10.1f} "
              f"{alone * 1e3:>7.1f} ({alone / t:>4.0%}) {cpu['tcp']:>6.3f}->{cpu['tcp+verify']:<6.3f}  "
              f"<= {GOAL_VERIFY:.2f}: {rep.goal(f'{label} verify overhead', met)}")  # fmt: skip
    print("(landed: when the last read landed, tcp -> tcp+verify; tail: hashing still to do after it; hashing: time "
          "in the hashing threads, summed; 1-thread hash: checksum.compute of the whole shard alone, and its share "
          "of the tcp pull: what verification adds where no core is spare)")  # fmt: skip
    print(f"one thread, interleaved rounds over each shard's bytes (goal: the shard's hash >= {GOAL_HASH:.1f} x the faster "
          "memcpy)")  # fmt: skip
    print(f"{'shard':<10} {'hash of the shard':>17} {'xxh3, 1 buffer':>14} {'memcpy torch':>12} {'memcpy memoryview':>17} "
          f"{'hash/memcpy':>11}  goal")  # fmt: skip
    for label, res in rows:
        gbps = {k.removesuffix("_s"): res["bytes"] / median(v) / 1e9 for k, v in res["single_thread_s"].items()}
        ratio = gbps["hash_shard"] / max(gbps["memcpy_torch"], gbps["memcpy_memoryview"])
        res["single_thread_gbps_median"], res["hash_vs_memcpy"] = gbps, ratio
        print(f"{label:<10} {gbps['hash_shard']:>12.2f} GB/s {gbps['xxh3_buffer']:>9.2f} GB/s {gbps['memcpy_torch']:>7.2f} GB/s "
              f"{gbps['memcpy_memoryview']:>12.2f} GB/s {ratio:>10.2f}x  {rep.goal(f'{label} hash vs memcpy', ratio >= GOAL_HASH)}")


def report_publish(pub: dict[str, Any], rep: Report) -> None:
    print(f"\n4. the trainer's publish(v) (goal: median at the largest size <= {GOAL_PUBLISH:.1f} x at the smallest)")
    print(f"{'shard MiB':>9} {'tensors':>7} {'publish ms median':>17} {'max':>7} {'declared ms median':>18} {'job GB/s':>8}")
    for p in pub.values():
        p["publish_ms_median"] = median(p["publish_s"]) * 1e3
        p["declared_ms_median"] = median(p["declared_s"]) * 1e3
        print(f"{p['bytes'] / 2**20:>9,.1f} {p['tensors']:>7} {p['publish_ms_median']:>17.2f} {max(p['publish_s']) * 1e3:>7.2f} "
              f"{p['declared_ms_median']:>18.1f} {p['bytes'] / median(p['declared_s']) / 1e9:>8.2f}")  # fmt: skip
    keys = list(pub)
    lo, hi = pub[keys[0]], pub[keys[-1]]
    ratio = hi["publish_ms_median"] / lo["publish_ms_median"]
    dratio = hi["declared_ms_median"] / lo["declared_ms_median"]
    pub_summary = {"publish_ratio": ratio, "declared_ratio": dratio}
    pub["summary"] = pub_summary
    print(f"largest/smallest ({hi['bytes'] / 2**20:,.1f}/{lo['bytes'] / 2**20:,.1f} MiB): publish {ratio:.2f}x  goal <= {GOAL_PUBLISH:.1f}: "
          f"{rep.goal('publish independent of size', ratio <= GOAL_PUBLISH)}; declared {dratio:.1f}x (no goal: "
          f"the background job reads every byte)")  # fmt: skip


def report_memory(results: dict[str, Any], rep: Report) -> None:
    mem = results.get(MEMORY_SHARD, {}).get("memory")
    if mem is None:
        return
    mib = 2**20
    print(f"\n5. resident memory of a pull, {MEMORY_SHARD} (goal: peak - RSS after register <= {GOAL_RSS_MIB:.0f} MiB each)")
    print(f"{'process':<8} {'after register MiB':>18} {'peak MiB':>9} {'peak - after MiB':>16}  {'method':<23} goal")
    for side in ("holder", "reader"):
        m = mem[side]
        m["delta"] = m["peak"] - m["rss_after_register"]
        met = m["delta"] / mib <= GOAL_RSS_MIB
        print(f"{side:<8} {m['rss_after_register'] / mib:>18.1f} {m['peak'] / mib:>9.1f} {m['delta'] / mib:>16.1f}  "
              f"{m['method']:<23} {rep.goal(f'{side} RSS', met)}")  # fmt: skip
    r, h = mem["reader"], mem["holder"]
    print(f"(not in the goal: register itself took {(h['rss_after_register'] - h['rss_before_register']) / mib:.1f} MiB "
          f"in the holder, {(r['rss_after_register'] - r['rss_before_register']) / mib:.1f} MiB in the reader: mostly "
          f"the pack buffers, a second copy of the packed tensors. Holder window: register, the publish job and every "
          f"pull it served; reader window: one replicate, {r['pull_s']:.2f} s)")  # fmt: skip


RDMA_DESCRIBE = {"raw nixl": f"raw NIXL READ ({RAW_INFLIGHT} in flight)", "nixl": "nixl transport",
                 "rdma_copy": "rdma_copy transport", "memcpy": "memcpy (torch, 1 thread)",
                 "local": "local transport"}  # fmt: skip


def report_rdma(rdma: dict[str, Any], args: argparse.Namespace, rep: Report) -> None:
    for run in rdma.values():
        env = f"UCX_TLS={run['ucx_tls']}" if run["ucx_tls"] else "UCX default transports"
        print(f"\n6. one holder process -> {', '.join(map(str, RDMA_READERS))} reader processes, each pulling the whole "
              f"shard [{env}]: the engine's read plan ({ENGINE_CHUNK >> 20} MiB reads), the transport's streams in "
              f"flight; each transport in its own phase with its baseline (goals: nixl >= {GOAL_NIXL:.2f} x raw NIXL "
              f"READ; local >= {GOAL_LOCAL:.2f} x memcpy with one reader)")  # fmt: skip
        print(f"{'shard':<10} {'readers':>7} {'path':<27} {'GB/s total':>10} {'per reader':>10} {'min':>6} {'max':>6} "
              f"{'vs baseline':>11} {'paired':>7} {'CPU s/GB':>8} {'idle cores':>10}  goal")  # fmt: skip
        for label, res in run["shards"].items():
            for path, phase in res["phases"].items():
                base = phase["baseline"]
                for k, kres in phase["by_readers"].items():
                    moved = int(k) * res["bytes"]
                    secs = kres["seconds_by_repeat"]
                    rates = {p: sorted(moved / s / 1e9 for s in v) for p, v in secs.items()}
                    med = {p: moved / median(v) / 1e9 for p, v in secs.items()}
                    cpu = {p: median(v) / (moved / 1e9) for p, v in kres["cpu_seconds_by_repeat"].items()}
                    ratio = med[path] / med[base]
                    paired = median([b / t for t, b in zip(secs[path], secs[base], strict=True)])
                    kres.update(gbps=rates, gbps_median=med, cpu_s_per_gb_median=cpu, ratio_to_baseline=ratio,
                                paired_ratio_median=paired)  # fmt: skip
                    note = "(no goal)"
                    readers = f"{k} reader{'s' if k != '1' else ''}"
                    if path == "nixl":
                        met = kres["goal_met"] = ratio >= GOAL_NIXL
                        note = f">= {GOAL_NIXL:.2f}: {rep.goal(f'{label} {readers} nixl vs raw NIXL ({env})', met)}"
                    elif path == "local" and k == "1":
                        met = kres["goal_met"] = ratio >= GOAL_LOCAL
                        note = f">= {GOAL_LOCAL:.2f}: {rep.goal(f'{label} local vs memcpy, one reader', met)}"
                    for p, vs, goal in ((base, f"{'(baseline)':>11} {'':>7}", "-"),
                                        (path, f"{ratio:>10.2f}x {paired:>6.2f}x", note)):  # fmt: skip
                        print(f"{label:<10} {k:>7} {RDMA_DESCRIBE[p]:<27} {med[p]:>10.2f} {med[p] / int(k):>10.2f} "
                              f"{rates[p][0]:>6.2f} {rates[p][-1]:>6.2f} {vs} {cpu[p]:>8.3f} {kres['idle_cores'][p]:>10.2f}  {goal}")  # fmt: skip
            print(f"{'':<10} ({res['reads_per_pull']} reads, {res['segments_per_pull']} segments per pull)")
        print("(GB/s total: bytes of all readers / from the first start to the last end; paired: median of each round's "
              "ratio; CPU s/GB: holder + readers, all threads; idle cores: what the holder and the readers burn with "
              "nothing to do, that path's agents up and connected: NIXL progress threads)")  # fmt: skip
        print(f"registration, not in the GB/s above (ms, median): expose() of the shard on each transport, raw: NIXL "
              f"register_memory of the same regions; first: right after the agent started (once per phase and reader "
              f"count); again: withdraw + expose {args.repeats} times; start(): the agent (rdma_copy registers its staging "
              f"pool there, never the shard)")  # fmt: skip
        print(f"{'shard':<10} {'what':<26} {'holder first':>12} {'holder again':>12} {'readers first':>13} "
              f"{'holder start()':>14} {'readers start()':>15}")  # fmt: skip
        for label, res in run["shards"].items():
            res["registration_ms_median"] = {}
            for name, reg in res["registration"].items():
                ms = {key: median(v) * 1e3 for key, v in reg.items() if v}
                res["registration_ms_median"][name] = ms
                what = "raw NIXL register_memory" if name == "raw nixl" else f"{name} expose()"
                cells = [f"{ms[key]:>{w}.2f}" if key in ms else f"{'-':>{w}}" for key, w in
                         (("holder_expose_s", 12), ("holder_again_s", 12), ("readers_expose_s", 13),
                          ("holder_start_s", 14), ("readers_start_s", 15))]  # fmt: skip
                print(f"{label:<10} {what:<26} {' '.join(cells)}")
    if rdma and args.size_mib != 1024:
        print(f"(the rdma goals are stated for 1 GiB shards; this run used {args.size_mib} MiB)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="bytes of each shard, in MiB (default 1024)")
    ap.add_argument("--streams", type=int, default=4, help="concurrent reads of one pull (tcp transport option)")
    ap.add_argument("--repeats", type=int, default=5, help="timed transfers per path (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed transfers per path first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", default="64x16MiB,model-500", help="comma-separated subset of: 64x16MiB, model-500")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of: {', '.join(SECTIONS)}")
    ap.add_argument("--tcp-unpacked", action="store_true", help="also time tcp pulls of the shard laid out without "
                                                                 "packing (pack_threshold 0): what packing costs tcp")  # fmt: skip
    ap.add_argument("--publish-repeats", type=int, default=10, help="timed publishes per size (section publish)")
    ap.add_argument("--no-product", action="store_true", help="skip the full path (server + publish + replicate), "
                                                               "and the sections that need it (publish, memory)")  # fmt: skip
    ap.add_argument("--ucx-tls", default="", help="section rdma: run it again with $UCX_TLS set to this in its "
                                                   "processes (e.g. tcp), after the run with UCX's default transports")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=120.0, help="bound on every wait, in seconds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.size_mib < 1 or args.streams < 1 or args.repeats < 1 or args.warmup < 0 or args.publish_repeats < 1:
        ap.error("--size-mib, --streams, --repeats and --publish-repeats must be >= 1, --warmup >= 0")
    total = args.size_mib << 20
    shards = {"64x16MiB": uniform_spec(total), "model-500": model_spec(total, args.seed)}
    wanted = [s.strip() for s in args.shards.split(",") if s.strip()]
    if not wanted or any(s not in shards for s in wanted):
        ap.error(f"--shards takes a subset of {', '.join(shards)}")
    args.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if not args.sections or not args.sections <= set(SECTIONS):
        ap.error(f"--sections takes a subset of {', '.join(SECTIONS)}")
    if args.no_product and args.sections & {"publish", "memory"}:
        print(f"(--no-product: skipping {', '.join(sorted(args.sections & {'publish', 'memory'}))})")
        args.sections -= {"publish", "memory"}

    if "rdma" in args.sections and not rdma_available():
        print("(section rdma: NIXL is not installed; running local against memcpy only)")
    print(f"holder -> reader on 127.0.0.1, {args.size_mib} MiB shards, tcp streams {args.streams}, chunk "
          f"{ENGINE_CHUNK >> 20} MiB, {args.repeats} repeats (+{args.warmup} warm-up), seed {args.seed}, {os.cpu_count()} CPUs, "
          f"sections {','.join(s for s in SECTIONS if s in args.sections)}")  # fmt: skip
    server_proc = None
    server = None
    results: dict[str, Any] = {}
    pub = None
    rdma: dict[str, Any] = {}
    try:
        if not args.no_product and args.sections & {"plan", "transfer", "publish", "memory"}:
            server_proc, server = start_server(args.timeout, echo_all=False)
        with asyncio.Runner(loop_factory=new_event_loop) as runner, ThreadPoolExecutor(2) as pool:
            if args.sections & {"plan", "transfer", "verify", "memory"}:
                for label in wanted:
                    results[label] = bench_shard(label, shards[label], args, server, runner, pool)
        if "publish" in args.sections and server is not None:
            pub = bench_publish(args, server)
        if "rdma" in args.sections:
            for tls in [None, *([args.ucx_tls] if args.ucx_tls else [])]:
                if tls and not rdma_available():
                    continue
                rdma[tls or "default"] = bench_rdma(args, shards, wanted, tls)
    except BenchmarkError as err:
        print(f"FAILED: {err}", file=sys.stderr)
        return 1
    finally:
        if server_proc is not None:
            stop_process(server_proc)

    rep = Report()
    report_plan(results, rep)
    report_transfer(results, args, rep)
    if "verify" in args.sections:
        report_verify(results, rep)
    if pub is not None:
        report_publish(pub, rep)
    report_memory(results, rep)
    report_rdma(rdma, args, rep)
    print()
    if args.sections & {"plan", "transfer", "verify", "memory"}:
        print("all transfers verified: every tensor's CRC-32 matched the holder's")
    if rdma:
        print("all rdma pulls verified: every checksum unit's xxh3-64 matched the holder's")
    missed = [what for what, ok in rep.verdicts if not ok]
    print(f"goals: {len(rep.verdicts) - len(missed)} PASS, {len(missed)} MISS" + (f" ({'; '.join(missed)})" if missed else ""))
    if args.json:
        config = {k: (str(v) if isinstance(v, Path) else sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()}
        out = {"config": config, "goals": {"tcp_vs_baseline_min": GOAL_TCP, "verify_ratio_max": GOAL_VERIFY,
                                           "hash_vs_memcpy_min": GOAL_HASH, "publish_ratio_max": GOAL_PUBLISH,
                                           "rss_delta_mib_max": GOAL_RSS_MIB, "nixl_vs_raw_min": GOAL_NIXL,
                                           "local_vs_memcpy_min": GOAL_LOCAL},
               "verdicts": [{"goal": what, "met": ok} for what, ok in rep.verdicts],
               "shards": results, "publish": pub, "rdma": rdma or None}  # fmt: skip
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
