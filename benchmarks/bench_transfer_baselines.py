"""What ``bench_transfer.py`` measures TensorHub against: the raw-socket pull (both ends: the
holder's listener and the reader's ``recv_into``), one thread's hash and memcpy of a shard's
bytes, and a raw NIXL READ of the same bytes between two bare agents."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import torch
import xxhash

from benchmarks.harness import BenchmarkError
from tensorhub.runtime import checksum
from tensorhub.transports.buffers import ShardBuffers, memory_of

RAW_INFLIGHT = 4  # READ requests the raw baseline keeps in flight (the transports' default streams)


# ---- raw sockets --------------------------------------------------------------------------------


def baseline_serve(lst: socket.socket, views: list[memoryview], stop: threading.Event) -> None:
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


# ---- one thread: hash and memcpy ----------------------------------------------------------------


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


# ---- raw NIXL -----------------------------------------------------------------------------------


def raw_nixl_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend configured as the transports configure theirs (the
    progress thread's pause; see ``tensorhub.transports.nixl.default_agent``), for the raw READ baseline:
    the comparison is of what the transport does with an agent, not of agent settings."""
    from tensorhub.transports.nixl import default_agent, load_nixl

    if load_nixl() is None:
        raise BenchmarkError("NIXL is not installed (pip install nixl-cu12)")
    return default_agent(name, None)


def raw_register(agent: Any, regions: list[torch.Tensor]) -> Any:
    """Register the regions (CPU memory) with a bare agent, as ``NixlIO.register`` does."""
    descs = [(t.data_ptr(), t.numel() * t.element_size(), 0, "") for t in regions if t.numel()]
    return agent.register_memory(agent.get_reg_descs(descs, "DRAM"))


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
