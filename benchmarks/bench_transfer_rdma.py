"""Section 6 of ``bench_transfer.py`` (rdma): the one-sided and same-host transports (``nixl``,
``rdma_copy``, ``local``), each against its baseline (raw NIXL READ, one-thread memcpy), between
one holder process and 1, 2 and 4 reader processes: those helper processes and the parent's rig
that drives them."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.bench_transfer_baselines import RAW_INFLIGHT, raw_nixl_agent, raw_nixl_pull, raw_register
from benchmarks.bench_transfer_paths import close_transport, start_transport, transport_pull
from benchmarks.harness import BenchmarkError, Child, median, process_cpu
from benchmarks.harness.shards import VERSION, Spec, allocate, fill_seeded, read_bytes_of, spec_bytes
from tensorhub.runtime import checksum
from tensorhub.runtime.actor import new_event_loop
from tensorhub.transports.buffers import DEFAULT_PACK_THRESHOLD, ShardBuffers, layout_of

RDMA_READERS = (1, 2, 4)  # concurrent reader processes of section 6
RDMA_BASELINE = {"nixl": "raw nixl", "rdma_copy": "raw nixl", "local": "memcpy"}
RDMA_REGION_BASE = 10  # region ids of section 6's shards (one per shard)


def _ucx_env(ucx_tls: str | None) -> None:
    """In a helper process, before any NIXL agent exists: UCX reads its environment when an
    agent starts its UCX context."""
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls


def rdma_available() -> bool:
    """Whether NIXL imports here (the nixl, rdma_copy and raw NIXL paths need it)."""
    from tensorhub.transports.nixl import load_nixl

    return load_nixl() is not None


def rdma_phases(ucx_tls: str | None) -> list[tuple[str, str]]:
    """``(baseline, path)`` pairs of one run of section 6, each measured in its own phase.
    Under ``UCX_TLS`` only the NIXL paths change, so ``local`` runs only under UCX's default;
    without NIXL only it runs."""
    nixl = [("raw nixl", "nixl"), ("raw nixl", "rdma_copy")] if rdma_available() else []
    return nixl if ucx_tls else [*nixl, ("memcpy", "local")]


# ---- the helper processes -----------------------------------------------------------------------


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


# ---- the parent's side --------------------------------------------------------------------------


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
