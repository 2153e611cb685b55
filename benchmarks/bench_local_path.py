"""Where a same-host replicate's time goes: ``tensorhub[local]`` against the copies under it.

Workload: a ``--size-mib`` shard (``--workload``) from one holder process to 1 and 4 reader
processes (``--readers``) by ``tensorhub[local]``, ``--repeats`` timed rounds.
Baseline: in the same processes and run, memcpy and ``process_vm_readv`` (with and without xxh3).
Goal: none of its own: it says where the suite's ``vs_memcpy`` goal (>= 0.7x) is lost.

``python benchmarks/bench_local_path.py [--size-mib 1024] [--readers 1,4] [--repeats 3]
[--workload 64x16MiB] [--kinds ...] [--profile DIR] [--events] [--threads-cpu] [--no-pipeline]``

``--no-pipeline`` starts the server so that only complete holders serve: every reader reads the
holder (a star) instead of the chain of partial readers the server otherwise builds (the same
processes cannot run both, so compare two runs by their ratios to an in-run raw row).
``--threads-cpu`` prints each round's CPU seconds per thread kind (``schedstat``, nanoseconds).

One reference server, one holder process (``tensorhub.open`` + ``register`` + ``publish``, as a
trainer) and N reader processes (``replicate`` into their registered tensors, with verification),
as ``python -m benchmarks`` runs ``tensorhub[local]``; beside it, in the same processes and the
same run, interleaved round by round, the copies a replicate is made of:

- ``memcpy``: one thread's ``copy_`` of the shard inside one process (one reader only; the
  limit the suite's goal is a ratio of);
- ``vm read``: ``process_vm_readv`` of the holder's tensors straight into the reader's, in 4 MiB
  pieces, on 1 thread and on the local transport's copy threads (the kernel's copy, nothing
  else: no description, no progress words, no engine);
- ``vm read + xxh3``: the same, each piece hashed (xxh3-64) right after it landed: the floor of
  a verified copy;
- ``vmT+xxh3@1M`` (not by default): the same on the copy threads in 1 MiB pieces, the
  ``local`` transport's own piece (``piece_bytes``): the floor of exactly what its copy
  workers do, without the engine (``vmT+xxh3`` keeps 4 MiB pieces, so that its figures compare
  with earlier runs; its hash reads a piece back from L3, which a 1 MiB piece mostly is not);
- ``tensorhub-shm``: TensorHub with the holder's and the readers' tensors registered in shared
  memory (``register(..., shared_memory=True)``, a second set of tensors under a second model
  name in the same processes): a reader maps the holder's files and copies with ``memmove``
  instead of ``process_vm_readv``; the columns ``fallbacks`` (regions read the old way) and
  ``mapped`` (files mapped) are the readers' transports' counters summed, since their start (one
  transport per reader process serves both TensorHub rows);
- ``tensorhub-whole`` (not by default): TensorHub with the publisher's checksums declared whole
  once it has hashed the shard, not in parts as it hashes (``$TENSORHUB_CHECKSUM_PART_BYTES=0``
  in the holder for that round): the A/B of the parts, in the same processes;
- ``tensorhub-hash1`` (not by default): TensorHub with the publisher's hash on one thread
  (``$TENSORHUB_HASH_THREADS=1`` in the holder for that round), not one per core: whether the
  publisher's hash threads, competing with the reader's copy threads for the same cores, cost
  the round anything.

Each round starts at one instant in every process (the holder publishes then, the readers
replicate then); a reader's time ends when ``replicate`` returns. Figures per row: the median
wall time over the timed rounds (the last reader's), GB/s per reader, and CPU seconds per GB
delivered: user + system time of every process of the row (the readers', and for TensorHub the
holder's, from the round's start until the last reader returned; the server's is not counted,
as in the suite, but shown apart in the ``server`` column) over the bytes delivered to all
readers; and page faults per GB (holder and readers). After each round every reader's bytes
are checked (xxh3-64 of each tensor against the holder's): one wrong byte fails the run.

``--profile DIR``: one more TensorHub round per reader count after the timed ones, with cProfile
running in every thread of the holder and the readers (the event loop, the transport's read and
copy threads, the hashing threads); DIR gets ``<readers>r-<process>.prof`` and a text summary
of each (the top functions by own time and by cumulative time, all threads merged). Profiled
rounds are not timed.

``--events``: for each TensorHub round, a line per reader: its source (the holder, or which
reader, ``(partial)`` while that one was still pulling), when its first read began and landed,
when the publisher's checksums arrived and its first read was verified, when ``replicate``
returned; the time its reads were in flight, of that waiting on the source's progress words
(``wait``: a partial source not yet covering the range) and copying, the time with no read in
flight, and the median time from a read's return to its verification (the event loop's share).
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import json
import os
import pstats
import resource
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

from benchmarks.harness import BenchmarkError, Child, median, process_cpu, start_server, stop_process, thread_cpu  # noqa: E402
from benchmarks.harness.shards import WORKLOADS, allocate, fill_seeded, hashes_of, spec_bytes, workload_spec  # noqa: E402

PIECE = 4 << 20  # bytes per process_vm_readv in the raw rows (a checksum unit; kept so that figures compare across runs)
PIECE_1M = 1 << 20  # ... in the ``@1M`` rows: the local transport's piece (``piece_bytes``), hashed while it is in L2


# ---- profiling every thread of a process --------------------------------------------------------


class _ThreadProfiles:
    """cProfile in every thread started after :meth:`install` (and in threads that call
    :meth:`join`): a thread's profiler starts at its first profiled event."""

    def __init__(self) -> None:
        self.profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()

    def _start(self, frame: Any, event: str, arg: Any) -> None:
        self.join()

    def join(self) -> None:
        p = cProfile.Profile(time.thread_time)  # CPU time: other processes share these cores
        with self._lock:
            self.profiles.append(p)
        p.enable()

    def install(self) -> None:
        threading.setprofile(self._start)

    def clear(self) -> None:
        with self._lock:
            for p in self.profiles:
                p.clear()

    def snapshot(self) -> pstats.Stats | None:
        """All threads' figures so far, merged (the profilers keep running)."""
        merged: pstats.Stats | None = None
        with self._lock:
            profiles = list(self.profiles)
        for p in profiles:
            p.snapshot_stats()

            class _Done:  # what pstats.Stats takes: an object with .stats and create_stats()
                stats = dict(p.stats)  # noqa: B023 - bound at class creation

                def create_stats(self) -> None:
                    pass

            if not _Done.stats:
                continue
            if merged is None:
                merged = pstats.Stats(_Done())  # type: ignore[arg-type]
            else:
                merged.add(_Done())  # type: ignore[arg-type]
        return merged


def _summary(stats: pstats.Stats, title: str) -> str:
    out = io.StringIO()
    out.write(f"==== {title}\n")
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    return out.getvalue()


# ---- a timeline of one round ----------------------------------------------------------------------


_HOLDER_MARKS = (("tensorhub.runtime.engine", "EngineActor", "_publish_job", "publish job"),
                 ("tensorhub.runtime.checksum", None, "compute", "holder hash"))  # fmt: skip
_READER_MARKS = (("tensorhub.runtime.engine", "EngineActor", "on_Grant", "grant"),
                 ("tensorhub.runtime.engine", "EngineActor", "_read", "read"),
                 ("tensorhub.runtime.engine", "EngineActor", "_learn_checksums", "checksums learned"),
                 ("tensorhub.runtime.engine", "EngineActor", "on__Verified", "verified"),
                 ("tensorhub.runtime.engine", "EngineActor", "on__Unpacked", "complete sent"))  # fmt: skip


class _Marks:
    """When marked calls began and ended in this process (monotonic: one clock for every process
    of the host), first and last of each, from ``--timeline``: where a round's wall time goes
    between the processes (the publisher's hashing, the grant, the reads, the checksums' arrival,
    the verification and the completion)."""

    def __init__(self, marks: tuple) -> None:
        import importlib
        import inspect

        self.seen: dict[str, list[float]] = {}
        for module, cls, attr, name in marks:
            owner = importlib.import_module(module)
            if cls is not None:
                owner = getattr(owner, cls)
            original = getattr(owner, attr)
            wrapper = self._wrap_async(original, name) if inspect.iscoroutinefunction(original) else self._wrap(original, name)
            setattr(owner, attr, wrapper)

    def _note(self, name: str, t: float) -> None:
        got = self.seen.setdefault(name, [t, t])
        got[0], got[1] = min(got[0], t), max(got[1], t)

    def _wrap(self, original: Any, name: str) -> Any:
        def marked(*args: Any, **kwargs: Any) -> Any:
            self._note(name + " >", time.monotonic())
            try:
                return original(*args, **kwargs)
            finally:
                self._note(name + " <", time.monotonic())

        return marked

    def _wrap_async(self, original: Any, name: str) -> Any:
        async def marked(*args: Any, **kwargs: Any) -> Any:
            self._note(name + " >", time.monotonic())
            try:
                return await original(*args, **kwargs)
            finally:
                self._note(name + " <", time.monotonic())

        return marked

    def take(self, start: float) -> dict[str, tuple[float, float]]:
        """Each mark's first and last time since ``start``, in ms; the marks start over."""
        out = {k: (1e3 * (a - start), 1e3 * (b - start)) for k, (a, b) in self.seen.items()}
        self.seen.clear()
        return out


# ``--events``: every marked call with its key (``(module, class, attribute, name, key of the call's
# arguments)``), for a per-reader account of where its time goes.
_READER_EVENTS = (
    ("tensorhub.runtime.engine", "EngineActor", "on_Grant", "grant", lambda a: f"{a[1].source.replica}"
     f"{'' if a[1].source.complete else ' (partial)'}"),
    ("tensorhub.runtime.engine", "EngineActor", "_read", "read", lambda a: a[2].offset),
    ("tensorhub.runtime.engine", "EngineActor", "on__ReadDone", "read done", lambda a: a[1].offset),
    ("tensorhub.runtime.engine", "EngineActor", "_learn_checksums", "checksums", lambda a: None),
    ("tensorhub.runtime.engine", "EngineActor", "_learn_part", "part", lambda a: a[3]),
    ("tensorhub.runtime.engine", "EngineActor", "on__Verified", "verified", lambda a: a[1].offset),
    ("tensorhub.transports.local", "LocalTransport", "_wait", "wait", lambda a: a[3]),
    ("tensorhub.transports.local", "LocalTransport", "_copy", "copy", lambda a: a[3]),
)  # fmt: skip
_HOLDER_EVENTS = (("tensorhub.runtime.checksum", None, "compute", "holder hash", lambda a: None),)


class _Events:
    """Every call of the marked functions in this process: ``(name, key, began, ended)`` on the
    monotonic clock (one clock for every process of the host), from ``--events``."""

    def __init__(self, marks: tuple) -> None:
        import importlib
        import inspect

        self.seen: list[tuple[str, Any, float, float]] = []
        for module, cls, attr, name, key in marks:
            owner = importlib.import_module(module)
            if cls is not None:
                owner = getattr(owner, cls)
            original = getattr(owner, attr)
            wrap = self._wrap_async if inspect.iscoroutinefunction(original) else self._wrap
            setattr(owner, attr, wrap(original, name, key))

    def _wrap(self, original: Any, name: str, key: Any) -> Any:
        def marked(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                self.seen.append((name, key(args), t0, time.monotonic()))

        return marked

    def _wrap_async(self, original: Any, name: str, key: Any) -> Any:
        async def marked(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                return await original(*args, **kwargs)
            finally:
                self.seen.append((name, key(args), t0, time.monotonic()))

        return marked

    def take(self, start: float) -> list[tuple[str, Any, float, float]]:
        """The calls since the last take, times in ms since ``start``."""
        out = [(n, k, 1e3 * (a - start), 1e3 * (b - start)) for n, k, a, b in self.seen]
        self.seen = []
        return out


def _busy(spans: list[tuple[float, float]]) -> float:
    """Milliseconds covered by the union of ``spans``."""
    total, end = 0.0, -1e18
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _account(events: list[tuple[str, Any, float, float]], returned: float) -> str:
    """One reader's round, in one line: its source, when its reads began and the checksums came,
    the time its reads were in flight, waited on the source's progress, copied, and the time
    from a read's return to its verification (the event loop's share)."""
    by: dict[str, list] = {}
    for e in events:
        by.setdefault(e[0], []).append(e)
    grant = by.get("grant", [])
    reads = by.get("read", [])
    done = {k: a for _, k, a, _ in by.get("read done", [])}
    verified = {k: a for _, k, a, _ in by.get("verified", [])}
    ret = {k: b for _, k, _, b in reads}
    loop_lag = [verified[k] - ret[k] for k in ret if k in verified]
    done_lag = [done[k] - ret[k] for k in ret if k in done]
    sums = by.get("checksums", [])
    part = min((a for _, _, a, _ in by.get("part", [])), default=-1.0)
    flight = _busy([(a, b) for _, _, a, b in reads])
    wait = sum(b - a for _, _, a, b in by.get("wait", []))
    copy = _busy([(a, b) for _, _, a, b in by.get("copy", [])])
    first = min((a for _, _, a, _ in reads), default=0.0)
    landed = min((b for _, _, _, b in reads), default=0.0)
    v = sorted(verified.values())
    src = ",".join(str(g[1]) for g in grant)
    return (f"from {src:<24} reads {len(reads):>3} first {first:6.0f} first-landed {landed:6.0f} sums {sums[0][2] if sums else -1:6.0f} "
            f"first part {part:6.0f} first-verified {v[0] if v else -1:6.0f} returned {returned:6.0f} | in flight {flight:6.0f} wait {wait:6.0f} "
            f"copy {copy:6.0f} idle {returned - first - flight:6.0f} | ret->done {median(done_lag) if done_lag else 0:5.1f} "
            f"ret->verified {median(loop_lag) if loop_lag else 0:5.1f} (max {max(loop_lag) if loop_lag else 0:5.0f}) ms")  # fmt: skip


def _timeline(rows: list[dict[str, tuple[float, float]]]) -> list[str]:
    """Median first and last ms of each mark over the rounds, in time order."""
    names = sorted({k for r in rows for k in r}, key=lambda k: median([r[k][0] for r in rows if k in r]))
    out = []
    for k in names:
        first = median([r[k][0] for r in rows if k in r])
        last = median([r[k][1] for r in rows if k in r])
        out.append(f"    {k:<24} first {first:8.1f} ms   last {last:8.1f} ms")
    return out


# ---- the processes ----------------------------------------------------------------------------------


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _faults() -> int:
    """Page faults this process took so far (minor and major)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt + r.ru_majflt


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _spans(tensors: dict) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors.values()]


def _pieces(local: list[tuple[int, int]], remote: list[tuple[int, int]], size: int = PIECE) -> list[tuple[list, list]]:
    """The shard cut into pieces of at most ``size`` bytes: ``(local spans, remote spans)`` each
    (the layouts are equal, so the tensors pair up one to one)."""
    out: list[tuple[list, list]] = []
    cur_l: list = []
    cur_r: list = []
    room = size
    for (la, n), (ra, rn) in zip(local, remote, strict=True):
        assert n == rn
        pos = 0
        while pos < n:
            k = min(room, n - pos)
            cur_l.append((la + pos, k))
            cur_r.append((ra + pos, k))
            pos += k
            room -= k
            if room == 0:
                out.append((cur_l, cur_r))
                cur_l, cur_r, room = [], [], size
    if cur_l:
        out.append((cur_l, cur_r))
    return out


def _local_stats(handle: Any) -> dict[str, int]:
    """The shared-memory counters of a handle's ``local`` transport (empty if unknown)."""
    engine = getattr(getattr(handle, "_h", None), "_engine", None)
    t = getattr(engine, "transports", {}).get("local")
    stats = getattr(t, "stats", None)
    return stats() if stats is not None else {}


def holder_main(conn: Any, spec: list, seed: int, server: str, profile: bool, local: dict, timeline: bool = False,
                events: bool = False, shm: bool = False) -> None:  # fmt: skip
    try:
        profiles = _ThreadProfiles()
        if profile:
            profiles.install()
        import tensorhub

        marks = _Marks(_HOLDER_MARKS) if timeline else None
        calls = _Events(_HOLDER_EVENTS) if events else None

        tensors = allocate(spec)
        fill_seeded(tensors, seed)
        handle = tensorhub.open("bench-local-path", "trainer", server=server, retain=None,
                                transports={"local": {"host": "127.0.0.1", **local}})  # fmt: skip
        handle.register(tensors)
        handles = {"tensorhub": handle, "tensorhub-whole": handle, "tensorhub-hash1": handle}
        if shm:  # a second set of the same bytes, in shared memory, under a second model name
            shared = allocate(spec)
            fill_seeded(shared, seed)
            handles["tensorhub-shm"] = tensorhub.open("bench-local-path-shm", "trainer", server=server, retain=None,
                                                      transports={"local": {"host": "127.0.0.1", **local}})  # fmt: skip
            handles["tensorhub-shm"].register(shared, shared_memory=True)
        conn.send(("ready", os.getpid(), _spans(tensors), hashes_of(tensors)))
        for _ in range(100_000):
            msg = conn.recv()
            if msg[0] == "quit":
                break
            if msg[0] == "prepare":
                for h in set(handles.values()):
                    if h.version is not None:
                        h.unpublish()
                if msg[1]:
                    profiles.clear()
                conn.send(("prepared",))
            elif msg[0] == "publish":
                _, version, start, kind = msg
                whole = kind == "tensorhub-whole"
                handle = handles[kind]
                if whole:  # the checksums declared whole, once hashed (as before issue 37's parts)
                    os.environ["TENSORHUB_CHECKSUM_PART_BYTES"] = "0"
                else:
                    os.environ.pop("TENSORHUB_CHECKSUM_PART_BYTES", None)
                if kind == "tensorhub-hash1":  # the publisher's hash on one thread
                    os.environ["TENSORHUB_HASH_THREADS"] = "1"
                else:
                    os.environ.pop("TENSORHUB_HASH_THREADS", None)
                _sleep_until(start)
                c0, t0, f0 = _cpu(), thread_cpu(), _faults()
                handle.publish(version)
                conn.send(("published", c0))
            elif msg[0] == "cpu":
                conn.send(("cpu", _cpu(), _diff(thread_cpu(), t0), marks.take(start) if marks is not None else None,
                           _faults() - f0, calls.take(start) if calls is not None else None))  # fmt: skip
            elif msg[0] == "profile":
                stats = profiles.snapshot()
                text = ""
                if stats is not None:
                    stats.dump_stats(msg[1])
                    text = _summary(stats, "holder")
                conn.send(("profile", text))
        for h in set(handles.values()):
            h.close()
    except Exception:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))


def reader_main(conn: Any, spec: list, seed: int, server: str, index: int, holder: tuple, threads: int,
                profile: bool, local: dict, timeline: bool = False, events: bool = False, shm: bool = False) -> None:  # fmt: skip
    try:
        profiles = _ThreadProfiles()
        if profile:
            profiles.install()
        import torch
        import xxhash

        import tensorhub

        marks = _Marks(_READER_MARKS) if timeline else None
        calls = _Events(_READER_EVENTS) if events else None
        from tensorhub.transports.local import _vm_read

        pid, remote, expected = holder
        tensors = allocate(spec)
        handle = tensorhub.open("bench-local-path", f"reader-{index}", server=server, retain=None,
                                transports={"local": {"host": "127.0.0.1", **local}})  # fmt: skip
        handle.register(tensors)
        handles = {"tensorhub": handle, "tensorhub-whole": handle, "tensorhub-hash1": handle}
        into = {"tensorhub": tensors, "tensorhub-whole": tensors, "tensorhub-hash1": tensors}
        if shm:  # its tensors in shared memory too: the next reader of a chain maps them
            into["tensorhub-shm"] = allocate(spec)
            handles["tensorhub-shm"] = tensorhub.open("bench-local-path-shm", f"reader-{index}", server=server, retain=None,
                                                      transports={"local": {"host": "127.0.0.1", **local}})  # fmt: skip
            handles["tensorhub-shm"].register(into["tensorhub-shm"], shared_memory=True)
        pieces = _pieces(_spans(tensors), remote)
        pieces_1m = _pieces(_spans(tensors), remote, PIECE_1M)
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="raw")
        source: dict | None = None

        def raw(hash_it: bool, piece: tuple[list, list]) -> int:
            local, rem = piece
            _vm_read(pid, local, rem)
            if not hash_it:
                return 0
            h = 0
            for address, n in local:
                h ^= xxhash.xxh3_64_intdigest((ctypes.c_char * n).from_address(address))
            return h

        conn.send(("ready",))
        for _ in range(100_000):
            msg = conn.recv()
            if msg[0] == "quit":
                break
            if msg[0] == "prepare":
                for h in set(handles.values()):
                    if h.version is not None:
                        h.unpublish()  # before the tensors are zeroed: the mutability contract
                for t in into.get(msg[1], tensors).values():
                    t.zero_()
                if msg[1] == "memcpy" and source is None:
                    source = allocate(spec)
                    fill_seeded(source, seed)
                if msg[2]:
                    profiles.clear()
                conn.send(("prepared",))
            elif msg[0] == "run":
                _, kind, version, start = msg
                _sleep_until(start)
                c0, t0, f0 = _cpu(), thread_cpu(), _faults()
                if kind.startswith("tensorhub"):
                    handles[kind].replicate(version, timeout=300)
                elif kind == "memcpy":
                    assert source is not None
                    torch.set_num_threads(1)
                    for src, dst in zip(source.values(), tensors.values(), strict=True):
                        dst.copy_(src)
                elif kind in ("vm1", "vm1+xxh3"):
                    for p in pieces:
                        raw(kind.endswith("xxh3"), p)
                elif kind in ("vmT", "vmT+xxh3"):
                    list(pool.map(lambda p, h=kind.endswith("xxh3"): raw(h, p), pieces))
                elif kind == "vmT+xxh3@1M":
                    list(pool.map(lambda p: raw(True, p), pieces_1m))
                else:
                    raise ValueError(f"unknown kind {kind!r}")
                end = time.monotonic()
                c1, t1, f1 = _cpu(), thread_cpu(), _faults()
                ok = hashes_of(into.get(kind, tensors)) == expected  # untimed
                stats = handles[kind].last_pull if kind.startswith("tensorhub") else None
                extra: dict[str, Any] = {}
                if kind.startswith("tensorhub"):
                    local_stats = _local_stats(handles[kind])
                    extra["fallbacks"] = local_stats.get("shared_fallbacks", 0)
                    extra["mapped"] = local_stats.get("shared_mapped", 0)
                if stats is not None:
                    extra.update(reads=stats.reads, verify_s=stats.verify_s, hashed_on_landing=stats.hashed_on_landing)
                extra["threads"] = _diff(t1, t0)
                extra["faults"] = f1 - f0
                if marks is not None:
                    extra["marks"] = marks.take(start)
                    extra["marks"]["replicate returned"] = (1e3 * (end - start),) * 2
                if calls is not None:
                    extra["events"] = calls.take(start)
                    extra["returned"] = 1e3 * (end - start)
                conn.send(("done", end - start, c1 - c0, ok, extra))
            elif msg[0] == "profile":
                stats = profiles.snapshot()
                text = ""
                if stats is not None:
                    stats.dump_stats(msg[1])
                    text = _summary(stats, f"reader {index}")
                conn.send(("profile", text))
        pool.shutdown()
        for h in set(handles.values()):
            h.close()
    except Exception:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))


# ---- the driver -------------------------------------------------------------------------------------


def run_group(args: argparse.Namespace, spec: list, server: str, n: int, kinds: list[str]) -> dict[str, list[dict]]:
    """One holder and ``n`` readers; every kind in ``kinds`` for ``args.repeats`` rounds, the
    kinds interleaved round by round; then, with ``--profile``, one profiled TensorHub round."""
    profile = args.profile is not None
    shm = "tensorhub-shm" in kinds
    holder = Child("holder", holder_main, (spec, args.seed, server, profile, args.local_options, args.timeline, args.events, shm),
                   args.timeout)  # fmt: skip
    readers: list[Child] = []
    try:
        _, pid, remote, expected = holder.expect("ready")
        for i in range(n):
            readers.append(Child(f"reader{i}", reader_main, (spec, args.seed, server, i, (pid, remote, expected),
                                                              args.threads, profile, args.local_options, args.timeline,
                                                              args.events, shm),
                                 args.timeout))  # fmt: skip
        for r in readers:
            r.expect("ready")
        results: dict[str, list[dict]] = {k: [] for k in kinds}
        version = 0
        rounds = [(k, False) for _ in range(args.warmup + args.repeats) for k in kinds]
        if profile:
            rounds.append(("tensorhub", True))
        seen: dict[str, int] = {}
        for kind, profiled in rounds:
            version += 1
            holder.send("prepare", profiled)
            holder.expect("prepared")
            for r in readers:
                r.send("prepare", kind, profiled)
            for r in readers:
                r.expect("prepared")
            start = time.monotonic() + 0.05
            server0 = process_cpu(args.server_pid)
            if kind.startswith("tensorhub"):
                holder.send("publish", version, start, kind)
            for r in readers:
                r.send("run", kind, version, start)
            done = [r.expect("done") for r in readers]
            server_cpu = process_cpu(args.server_pid) - server0  # the reference server's (10 ms ticks)
            hold_cpu = 0.0
            hold_faults = 0
            holder_marks = None
            if kind.startswith("tensorhub"):
                c0 = holder.expect("published")[1]
                holder.send("cpu")
                got = holder.expect("cpu")
                hold_cpu = got[1] - c0
                holder_marks = got[3]
                hold_faults = got[4]
                if args.events and not profiled:
                    hashes = [(a, b) for name, _, a, b in got[5] if name == "holder hash"]
                    what = f"  events, {kind}, {n} readers, round {version}"
                    print(f"{what}: holder hash {hashes[0][0]:.0f}-{hashes[0][1]:.0f} ms" if hashes else f"{what}: no holder hash")
                    for i, d in enumerate(done):
                        print(f"    reader {i}: {_account(d[4]['events'], d[4]['returned'])}")
                if args.threads_cpu:
                    print(f"  {kind} {n}r holder threads: {got[2]}")
            if args.threads_cpu:
                for i, d in enumerate(done):
                    print(f"  {kind} {n}r reader{i} threads: {d[4].get('threads')}")
            bad = [i for i, d in enumerate(done) if not d[3]]
            if bad:
                raise BenchmarkError(f"{kind}, {n} readers: readers {bad} hold wrong bytes after the round")
            if profiled:
                for who, child in [("holder", holder), *[(f"reader{i}", r) for i, r in enumerate(readers)]]:
                    path = args.profile / f"{n}r-{who}.prof"
                    child.send("profile", str(path))
                    text = child.expect("profile")[1]
                    (args.profile / f"{n}r-{who}.txt").write_text(text)
                continue
            seen[kind] = seen.get(kind, 0) + 1
            if seen[kind] <= args.warmup:
                continue
            results[kind].append({
                "wall_s": max(d[1] for d in done),
                "reader_cpu_s": sum(d[2] for d in done),
                "holder_cpu_s": hold_cpu,
                "extra": [d[4] for d in done],
                "holder_marks": holder_marks,
                "faults": sum(d[4]["faults"] for d in done) + hold_faults,
                "server_cpu_s": server_cpu,
                "fallbacks": sum(d[4].get("fallbacks", 0) for d in done),
                "mapped": sum(d[4].get("mapped", 0) for d in done),
            })  # fmt: skip
        return results
    finally:
        for c in [*readers, holder]:
            c.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--readers", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--workload", default="64x16MiB", choices=WORKLOADS)
    ap.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1),
                    help="threads of the vmT rows (default: the local transport's copy threads)")  # fmt: skip
    ap.add_argument("--kinds", default="tensorhub,tensorhub-shm,memcpy,vm1,vmT,vm1+xxh3,vmT+xxh3")
    ap.add_argument("--profile", type=Path, help="folder for the cProfile output of one extra round")
    ap.add_argument("--threads-cpu", action="store_true", help="print each round's CPU seconds by thread kind")
    ap.add_argument("--timeline", action="store_true",
                    help="print when the holder's and the first and last reader's steps happened (median ms after the start)")  # fmt: skip
    ap.add_argument("--events", action="store_true",
                    help="print, for each TensorHub round, each reader's source, when its reads began, landed and were "
                         "verified, and how long they waited, copied and idled")  # fmt: skip
    ap.add_argument("--local-options", type=json.loads, default={},
                    help='options of the local transport, as JSON (e.g. \'{"piece_bytes": 4194304}\')')  # fmt: skip
    ap.add_argument("--no-pipeline", action="store_true",
                    help="start the server with --no-pipeline: only complete holders serve, so every reader reads the "
                         "holder (a star) instead of a chain of partial readers")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    readers = [int(x) for x in args.readers.split(",") if x.strip()]
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    known = ("tensorhub", "tensorhub-shm", "tensorhub-whole", "tensorhub-hash1", "memcpy", "vm1", "vmT", "vm1+xxh3", "vmT+xxh3",
             "vmT+xxh3@1M")
    if any(k not in known for k in kinds) or not kinds:
        raise SystemExit(f"--kinds: choose from {', '.join(known)}")
    if not readers or any(not 1 <= n <= 16 for n in readers) or not 1 <= args.size_mib <= 65536:
        raise SystemExit("--readers: counts in [1, 16]; --size-mib in [1, 65536]")
    if not 1 <= args.repeats <= 100 or not 0 <= args.warmup <= 10 or not 1 <= args.threads <= 64:
        raise SystemExit("--repeats in [1, 100], --warmup in [0, 10], --threads in [1, 64]")
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the suite: tensors on huge pages
    spec = workload_spec(args.workload, args.size_mib << 20, args.seed)
    gb = spec_bytes(spec) / 1e9
    proc, server = start_server(args.timeout, *(["--no-pipeline"] if args.no_pipeline else []), echo_all=False)
    args.server_pid = proc.pid
    try:
        print(f"{args.workload}, {spec_bytes(spec) / 2**20:.0f} MiB, {args.repeats} timed rounds (+{args.warmup}), "
              f"medians; CPU s/GB: every process of the row but the server, over the bytes delivered")  # fmt: skip
        print(f"{'row':<22} {'readers':>7} {'wall s':>8} {'GB/s/reader':>12} {'CPU s/GB':>9} {'reader':>7} {'holder':>7} {'faults/GB':>9} "
              f"{'server':>7} {'fallbacks':>9} {'mapped':>6}")  # fmt: skip
        for n in readers:
            ks = [k for k in kinds if k != "memcpy" or n == 1]
            res = run_group(args, spec, server, n, ks)
            for k in ks:
                rows = res[k]
                wall = median([r["wall_s"] for r in rows])
                rc = median([r["reader_cpu_s"] for r in rows]) / (gb * n)
                hc = median([r["holder_cpu_s"] for r in rows]) / (gb * n)
                faults = median([r["faults"] for r in rows]) / (gb * n)
                sc = median([r["server_cpu_s"] for r in rows]) / (gb * n)
                fb, mapped = max(r["fallbacks"] for r in rows), max(r["mapped"] for r in rows)
                print(f"{k:<22} {n:>7} {wall:>8.3f} {gb / wall:>12.2f} {rc + hc:>9.3f} {rc:>7.3f} {hc:>7.3f} {faults:>9.0f} {sc:>7.3f} {fb:>9} "
                      f"{mapped:>6}")  # fmt: skip
                if args.timeline and k.startswith("tensorhub"):
                    print("  holder")
                    print("\n".join(_timeline([r["holder_marks"] for r in rows if r["holder_marks"]])))
                    for i in sorted({0, n - 1}):
                        print(f"  reader {i}")
                        print("\n".join(_timeline([r["extra"][i]["marks"] for r in rows])))
            sys.stdout.flush()
    finally:
        stop_process(proc)
    if args.profile is not None:
        print(f"profiles in {args.profile}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
