"""The floor of a same-host replicate: the least wall time any design that gives each reader its
own verified copy can reach on this machine, from the measured cost of each pass over memory.

Workload: a ``--size-mib`` shard of ``64x16MiB`` (the suite's goal workload); 1 and 4 readers.
Baseline: a one-thread memcpy measured in this run; with ``--systems`` (the default), the suite's
``gloo broadcast`` and ``ray numpy`` (when Ray imports) at 4 readers, in the same run.
Goal: none of its own. It says whether the suite's goals (one reader >= 0.7x memcpy; 4 readers
<= 0.5x gloo broadcast and <= 0.7x Ray numpy) can be met at all while every byte is verified.

``python benchmarks/bench_floor.py [--size-mib 1024] [--repeats 3] [--no-systems] [--questions]``

Part 1, the passes (one thread each, in this process and a helper process that holds the
source, interleaved round by round; medians of wall and CPU seconds per GB):

- ``memcpy``: torch ``copy_`` into a resident destination (the suite's memcpy);
- ``memcpy, fresh destination``: into a new allocation, so the copy takes the page faults too
  (the difference is what first touching a destination costs);
- ``vm copy``: ``process_vm_readv`` of the helper's tensors in 1 MiB pieces (``local``'s copy);
- ``vm copy + hash``: the same, each piece hashed (xxh3-64) right after it landed (the
  difference is a reader's verification);
- ``publisher hash``: xxh3-64 of a cold shard in 4 MiB units (the publisher's pass);
- ``vm copy + hash, 2 threads``: two threads, half the shard each: what the second core adds
  (``2 threads`` over ``1``: the cores this machine gives a copy, at most 2 here).

``--questions`` adds, interleaved with those rows, the alternatives that could lower the floor:
the reader's copy + hash in 256 KiB and 4 MiB pieces, and the copy alone at those sizes (does a
piece that stays in L2 save the hash's reads, and what do smaller pieces cost the copy?), a
reader's copy trailing the publisher's hash of the same bytes on the other core against the two
sharing nothing (does the shared L3 let one DRAM read serve both?), xxh3 of a buffer that stays in L2 (the hash's own cost: what one fused pass
could at best leave), the copy with the hash on a second thread one piece behind, the
publisher's hash on 2 threads (does xxh3 release the GIL?), and ``wordmix-64`` on the CPU (the
other algorithm the checksum module allows).

Part 2, the arithmetic: CPU work per GB delivered (``n`` readers: ``n`` x (copy + hash) + one
publisher hash), spread over 2 cores and over the cores the 2-thread row measured, against
memcpy's CPU seconds (its wall time on a core of its own) and (with ``--systems``) the 4-reader
goals.

Part 3 (``--systems``): the suite's ``verified copy`` system (the floor as a real run: a holder
process that hashes once and posts its checksums, reader processes that copy, hash and compare;
no server, no messages), ``tensorhub[local]``, memcpy, gloo broadcast and Ray numpy, through the
suite's own group runner (``benchmarks/suite.py``), in this run. ``tensorhub[local]`` over
``verified copy`` is what TensorHub adds to the floor; ``verified copy`` over 0.5x gloo or 0.7x
Ray says whether the goal is reachable by any verified design here.

Load: other processes on the machine take cores from every row alike only if they run all
along; the load average at the start and the end is printed, and the CPU seconds move less
with load than wall times do.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

from benchmarks.harness import BenchmarkError, Child, median  # noqa: E402
from benchmarks.harness.shards import allocate, fill_seeded, spec_bytes, workload_spec  # noqa: E402

PIECE = 1 << 20  # a reader's piece (local's piece_bytes)
UNIT = 4 << 20  # a publisher's checksum unit (the layout's default chunk)
WORKLOAD = "64x16MiB"


def _spans(tensors: dict) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors.values()]


def _cut(spans: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    return [(a + off, min(size, n - off)) for a, n in spans for off in range(0, n, size)]


def source_main(conn: Any, spec: list, seed: int) -> None:
    """The helper: holds the seeded shard (resident) until ``quit``."""
    try:
        tensors = allocate(spec)
        fill_seeded(tensors, seed)
        conn.send(("ready", os.getpid(), _spans(tensors)))
        for _ in range(1 << 30):
            if conn.poll(1.0) and conn.recv()[0] == "quit":
                break
            if os.getppid() == 1:
                break
    except Exception:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))


class Passes:
    """The single passes over memory, each a callable timed by :meth:`measure`."""

    def __init__(self, spec: list, seed: int, pid: int, remote: list[tuple[int, int]]) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.spec = spec
        self.source = allocate(spec)
        fill_seeded(self.source, seed)
        self.cold = allocate(spec)  # the publisher's shard: hashed, never copied (a pass from DRAM)
        fill_seeded(self.cold, seed + 1)
        self.dest = allocate(spec)  # resident
        self.pid = pid
        self.local = _cut(_spans(self.dest), PIECE)
        self.remote = _cut(remote, PIECE)
        self.units = _cut(_spans(self.cold), UNIT)
        self.units_dst = _cut(_spans(self.dest), UNIT)  # the reader's units (``local``'s streams)
        self.units_src = _cut(remote, UNIT)
        self.units_src_local = _cut(_spans(self.source), UNIT)  # the same bytes in this process
        self.total = sum(n for _, n in self.local)
        self.pool = ThreadPoolExecutor(2)

    def memcpy(self) -> None:
        for s, d in zip(self.source.values(), self.dest.values(), strict=True):
            d.copy_(s)

    def memcpy_fresh(self) -> None:
        import mmap

        total = sum(n for _, n in _spans(self.source))
        with mmap.mmap(-1, total) as buf:  # new pages (on huge pages where allowed, as torch's): the copy faults them in
            if hasattr(mmap, "MADV_HUGEPAGE"):
                buf.madvise(mmap.MADV_HUGEPAGE)
            flat = self.torch.frombuffer(buf, dtype=self.torch.uint8)
            pos = 0
            for s in self.source.values():
                n = s.numel() * s.element_size()
                flat[pos : pos + n].copy_(s.view(-1).view(self.torch.uint8))
                pos += n
            del flat

    def _vm(self, lo: int, hi: int, hash_it: bool) -> None:
        import xxhash

        from tensorhub.transports.local import _vm_read

        for k in range(lo, hi):
            dst, n = self.local[k]
            _vm_read(self.pid, [(dst, n)], [self.remote[k]])
            if hash_it:
                xxhash.xxh3_64_intdigest((ctypes.c_char * n).from_address(dst))

    def vm_copy(self) -> None:
        self._vm(0, len(self.local), False)

    def vm_copy_hash(self) -> None:
        self._vm(0, len(self.local), True)

    def vm_copy_hash_2t(self) -> None:
        half = len(self.local) // 2
        f = self.pool.submit(self._vm, half, len(self.local), True)
        self._vm(0, half, True)
        f.result()

    def publisher_hash(self) -> None:
        import xxhash

        for a, n in self.units:
            xxhash.xxh3_64_intdigest((ctypes.c_char * n).from_address(a))

    # ---- the questions of the floor (``--questions``) ----

    def _vm_pieces(self, piece: int, hash_it: bool = True) -> None:
        """vm copy + hash as ``local`` does it, in ``piece``-byte pieces: each 4 MiB unit a stream
        of xxh3 updates, one per piece, right after it landed (the loop kept minimal); without
        ``hash_it``, the same copies alone (what the hash adds at that piece size is the difference)."""
        import xxhash

        from tensorhub.transports.local import _vm_read

        for (dst, n), (src, _) in zip(self.units_dst, self.units_src, strict=True):
            view = memoryview((ctypes.c_char * n).from_address(dst)).cast("B")
            state = xxhash.xxh3_64()
            for off in range(0, n, piece):
                k = min(piece, n - off)
                _vm_read(self.pid, [(dst + off, k)], [(src + off, k)])
                if hash_it:
                    state.update(view[off : off + k])
            state.intdigest()

    def vm_copy_hash_256k(self) -> None:
        self._vm_pieces(256 << 10)

    def vm_copy_hash_4m(self) -> None:
        self._vm_pieces(4 << 20)

    def vm_copy_256k(self) -> None:
        self._vm_pieces(256 << 10, False)

    def vm_copy_4m(self) -> None:
        self._vm_pieces(4 << 20, False)

    def _copy_beside_hash(self, trail: bool) -> None:
        """A reader's copy + hash (``memmove`` of ``source`` into ``dest``, 1 MiB pieces, each
        hashed as it landed) on this thread while the publisher's hash runs on a second one. With
        ``trail``, the publisher hashes ``source`` itself, unit by unit, and the copy of a unit
        waits until the hash has passed it (so the copy reads bytes the other core has just
        brought in, from the shared L3, if they are still there); without, the publisher hashes
        another shard (``cold``) and the two passes share nothing. Same work either way: the
        CPU difference is what a publisher's hash that stays just ahead of a same-host reader
        could save."""
        import threading

        import xxhash

        done = [0]
        units = self.units_src_local if trail else self.units
        ready = threading.Event()

        def publisher() -> None:
            for k, (a, n) in enumerate(units):
                xxhash.xxh3_64(memoryview((ctypes.c_char * n).from_address(a)).cast("B")).intdigest()
                done[0] = k + 1
            ready.set()

        f = self.pool.submit(publisher)
        for k, ((dst, n), (src, _)) in enumerate(zip(self.units_dst, self.units_src_local, strict=True)):
            for _ in range(1_000_000):  # bounded: the hash passes each unit in microseconds to milliseconds
                if not trail or done[0] > k or ready.is_set():
                    break
                time.sleep(20e-6)
            view = memoryview((ctypes.c_char * n).from_address(dst)).cast("B")
            state = xxhash.xxh3_64()
            for off in range(0, n, PIECE):
                m = min(PIECE, n - off)
                ctypes.memmove(dst + off, src + off, m)
                state.update(view[off : off + m])
            state.intdigest()
        f.result()

    def copy_beside_hash(self) -> None:
        self._copy_beside_hash(False)

    def copy_trailing_hash(self) -> None:
        self._copy_beside_hash(True)

    def hash_in_l2(self) -> None:
        """xxh3 of one 256 KiB buffer (it stays in L2), as many times as the shard has bytes:
        the hash's own speed, with no memory traffic."""
        import xxhash

        a, _ = self.local[0]
        n = 256 << 10
        view = memoryview((ctypes.c_char * n).from_address(a)).cast("B")
        for _ in range(self.total // n):
            xxhash.xxh3_64_intdigest(view)

    def vm_copy_hash_pipelined(self) -> None:
        """This thread copies piece k while a second thread hashes piece k - 1 (the copy and the
        hash on two cores, one piece apart)."""
        import queue

        import xxhash

        from tensorhub.transports.local import _vm_read

        q: queue.SimpleQueue = queue.SimpleQueue()

        def hasher() -> None:
            for _ in range(len(self.local) + 1):
                item = q.get()
                if item is None:
                    return
                xxhash.xxh3_64_intdigest((ctypes.c_char * item[1]).from_address(item[0]))

        f = self.pool.submit(hasher)
        try:
            for k in range(len(self.local)):
                _vm_read(self.pid, [self.local[k]], [self.remote[k]])
                q.put(self.local[k])
        finally:
            q.put(None)
        f.result()

    def publisher_hash_2t(self) -> None:
        """The publisher's hash on two threads, half the units each: the wall time says whether
        xxh3 releases the GIL (it runs in parallel) or the threads take turns."""
        import xxhash

        def run(units: list[tuple[int, int]]) -> None:
            for a, n in units:
                xxhash.xxh3_64_intdigest((ctypes.c_char * n).from_address(a))

        half = len(self.units) // 2
        f = self.pool.submit(run, self.units[half:])
        run(self.units[:half])
        f.result()

    def wordmix_hash(self) -> None:
        """The other algorithm the checksum module allows, ``wordmix-64``, on the CPU (torch's
        integer ops), over the first ``WORDMIX_SHARE`` of the publisher's units, scaled to the
        shard (it is slow: a whole shard would take seconds per round)."""
        from tensorhub.runtime import wordmix

        k = max(1, len(self.units) // WORDMIX_SHARE)
        flat = [self.torch.frombuffer((ctypes.c_char * n).from_address(a), dtype=self.torch.uint8) for a, n in self.units[:k]]
        for _ in range(len(self.units) // k):  # the same units again: as many bytes as the shard
            wordmix.sums(flat)


ROWS = (
    ("memcpy", "memcpy"),
    ("memcpy, fresh destination", "memcpy_fresh"),
    ("vm copy", "vm_copy"),
    ("vm copy + hash", "vm_copy_hash"),
    ("publisher hash", "publisher_hash"),
    ("vm copy + hash, 2 threads", "vm_copy_hash_2t"),
)
#: ``--questions``: could the floor be lower? (see :func:`questions`)
QUESTIONS = (
    ("vm copy + hash, 256 KiB pieces", "vm_copy_hash_256k"),
    ("vm copy + hash, 4 MiB pieces", "vm_copy_hash_4m"),
    ("vm copy, 256 KiB pieces", "vm_copy_256k"),
    ("vm copy, 4 MiB pieces", "vm_copy_4m"),
    ("copy + hash | publisher hash", "copy_beside_hash"),
    ("copy + hash trailing publisher", "copy_trailing_hash"),
    ("hash from L2 (256 KiB, again)", "hash_in_l2"),
    ("copy | hash on 2nd thread", "vm_copy_hash_pipelined"),
    ("publisher hash, 2 threads", "publisher_hash_2t"),
    ("wordmix-64 hash (CPU)", "wordmix_hash"),
)
WORDMIX_SHARE = 16  # the wordmix row hashes 1/16 of the units 16 times


def measure(passes: Passes, repeats: int, gb: float, rows: tuple[tuple[str, str], ...] = ROWS) -> dict[str, tuple[float, float]]:
    """Each row's median (wall, CPU) seconds per GB, the rows interleaved round by round (one
    warm-up round first)."""
    got: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in rows}
    for r in range(repeats + 1):
        for name, attr in rows:
            fn = getattr(passes, attr)
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            w, c = time.perf_counter() - w0, time.process_time() - c0
            if r:
                got[name].append((w / gb, c / gb))
    return {k: (median([w for w, _ in v]), median([c for _, c in v])) for k, v in got.items()}


def arithmetic(rows: dict[str, tuple[float, float]], readers: list[int]) -> tuple[list[str], dict[str, float]]:
    """The floor per reader count, from the passes' CPU seconds per GB (see the module doc)."""
    cpu = {k: c for k, (_, c) in rows.items()}
    copy = cpu["vm copy"]
    hash_r = max(0.0, cpu["vm copy + hash"] - copy)
    hash_p = cpu["publisher hash"]
    fault = max(0.0, cpu["memcpy, fresh destination"] - cpu["memcpy"])
    # A one-thread copy's wall time on a core of its own is its CPU time (its wall time here also
    # counts the cores other processes took from it).
    mem_alone = cpu["memcpy"]
    one_t = rows["vm copy + hash"][0]
    two_t = rows["vm copy + hash, 2 threads"][0]
    cores = max(1.0, min(2.0, one_t / two_t)) if two_t > 0 else 1.0
    lines = [
        "per GB delivered, CPU seconds (one thread each):",
        f"  memcpy {cpu['memcpy']:.3f}   vm copy {copy:.3f}   a reader's hash of what landed {hash_r:.3f}   "
        f"the publisher's cold hash {hash_p:.3f}   page faults of a fresh destination {fault:.3f}",
        f"  cores a copy gets here: {cores:.2f} (vm copy + hash on 2 threads runs {cores:.2f}x one thread's rate)",
    ]
    out = {"copy": copy, "hash_reader": hash_r, "hash_publisher": hash_p, "faults": fault, "cores": cores,
           "memcpy": mem_alone}  # fmt: skip
    for n in readers:
        work = n * (copy + hash_r) + hash_p
        for label, c in (("2 cores", 2.0), (f"{cores:.2f} cores (measured)", cores)):
            floor = work / c
            out[f"floor_{n}_{'2' if c == 2.0 else 'measured'}"] = floor
            line = (f"  {n} reader{'s' if n > 1 else ''}: {n} x ({copy:.3f} + {hash_r:.3f}) + {hash_p:.3f} = {work:.3f} CPU s/GB; "
                    f"on {label}: >= {floor:.3f} s per GB")  # fmt: skip
            if n == 1:
                line += f" = {mem_alone / floor:.2f}x memcpy's rate ({mem_alone:.3f} s per GB on a core of its own; goal >= 0.7)"
            lines.append(line)
    return lines, out


def gil_released(passes: Passes) -> tuple[float, float]:
    """Whether xxh3 lets another thread run Python while it hashes: one call over a 256 MiB
    buffer in a second thread while this thread notes the longest gap between two of its own
    loop turns. ``(longest gap, the call's seconds)``: a call that holds the GIL makes the gap
    about the whole call (no other thread runs Python until it returns); one that releases it
    leaves only the scheduler's gaps. It asks whether, which a wall-time ratio under load cannot."""
    import threading

    import xxhash

    buf = passes.torch.ones(256 << 20, dtype=passes.torch.uint8)
    view = memoryview(buf.numpy()).cast("B")
    took: list[float] = []

    def run() -> None:
        t = time.perf_counter()
        xxhash.xxh3_64_intdigest(view)
        took.append(time.perf_counter() - t)

    th = threading.Thread(target=run)
    last = time.perf_counter()
    gap = 0.0
    th.start()
    for _ in range(1 << 32):
        if took:
            break
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    th.join()
    return gap, took[0]


def questions(rows: dict[str, tuple[float, float]], gil: tuple[float, float] | None = None) -> list[str]:
    """What the ``--questions`` rows say about lowering the floor: each alternative's CPU (and,
    where it is about using the second core, wall) seconds per GB against the floor's own pass
    measured in the same rounds."""
    cpu = {k: c for k, (_, c) in rows.items()}
    wall = {k: w for k, (w, _) in rows.items()}
    copy, serial = cpu["vm copy"], cpu["vm copy + hash"]
    landed = max(0.0, serial - copy)
    sizes = {"256 KiB": cpu["vm copy + hash, 256 KiB pieces"], "1 MiB": serial, "4 MiB": cpu["vm copy + hash, 4 MiB pieces"]}
    alone = {"256 KiB": cpu["vm copy, 256 KiB pieces"], "1 MiB": copy, "4 MiB": cpu["vm copy, 4 MiB pieces"]}
    best = min(sizes, key=lambda k: sizes[k])
    beside, trailing = cpu["copy + hash | publisher hash"], cpu["copy + hash trailing publisher"]
    l2 = cpu["hash from L2 (256 KiB, again)"]
    piped = cpu["copy | hash on 2nd thread"]
    two = wall["publisher hash"] / wall["publisher hash, 2 threads"] if wall["publisher hash, 2 threads"] > 0 else 0.0
    wm = cpu["wordmix-64 hash (CPU)"]
    return [
        "could the floor be lower? (CPU s/GB, same rounds)",
        "  pieces: copy + hash " + "   ".join(f"{k} {v:.3f}" for k, v in sizes.items()) + f"   -> least CPU: {best} pieces",
        "  pieces: the copy alone " + "   ".join(f"{k} {v:.3f}" for k, v in alone.items()) + ";  the hash's share (h/c) "
        + "   ".join(f"{k} {sizes[k] - alone[k]:.3f} ({(sizes[k] - alone[k]) / alone[k]:.2f})" for k in sizes if alone[k] > 0),
        f"  the publisher's hash just ahead of a reader's copy (two cores, shared L3): {trailing:.3f} CPU s/GB for both "
        f"against {beside:.3f} when they share nothing ({trailing / beside - 1:+.0%})" if beside > 0 else "",
        f"  one pass: the hash of a landed piece costs {landed:.3f} over the copy; xxh3 from L2 alone {l2:.3f}: "
        f"a copy fused with the hash in one pass could save at most {max(0.0, landed - l2):.3f} "
        f"({max(0.0, landed - l2) / serial:.0%} of a reader's copy + hash)" if serial > 0 else "",
        f"  hash on the other core, one piece behind: {piped:.3f} CPU against {serial:.3f} serial "
        f"({piped / serial - 1:+.0%} CPU; wall {wall['copy | hash on 2nd thread']:.3f} against {wall['vm copy + hash']:.3f})"
        if serial > 0 else "",
        f"  GIL: the publisher's hash on 2 threads runs {two:.2f}x one thread's rate"
        + (f"; while one thread hashed 256 MiB in {gil[1] * 1e3:.0f} ms, another ran Python with gaps of at most "
           f"{gil[0] * 1e3:.0f} ms ({'xxh3 releases the GIL' if gil[0] < gil[1] / 2 else 'xxh3 holds the GIL: hash threads take turns'})"
           if gil is not None else ""),
        f"  wordmix-64 on the CPU: {wm:.3f} against xxh3's cold pass {cpu['publisher hash']:.3f} "
        f"({wm / cpu['publisher hash']:.1f}x)" if cpu["publisher hash"] > 0 else "",
    ]


def systems_run(args: argparse.Namespace, readers: list[int]) -> dict[tuple[str, int], dict[str, Any]]:
    """The suite's groups, in this run: (system, readers) -> the suite's summary row."""
    from benchmarks import suite
    from benchmarks.harness import free_port, start_server, stop_process
    from benchmarks.suite_systems import ray_head_main, systems

    spec = workload_spec(WORKLOAD, args.size_mib << 20, args.seed)
    nbytes = spec_bytes(spec)
    expected = suite.expected_hashes(spec, args.seed)
    wanted = {"memcpy": [1], "verified copy": readers, "tensorhub[local]": readers, "gloo broadcast": [n for n in readers if n > 1],
              "ray numpy": [n for n in readers if n > 1]}  # fmt: skip
    chosen = [s for s in systems(["local"]) if s.name in wanted and not s.missing()]
    for s in systems(["local"]):
        if s.name in wanted and s.missing():
            print(f"  skipping {s.name}: {s.missing()}")
    opts = argparse.Namespace(timeout=args.timeout, seed=args.seed, warmup=1, repeats=args.repeats)
    options: dict[str, Any] = {}
    server = ray_head = None
    groups = []
    try:
        server, options["tensorhub_server"] = start_server(args.timeout, echo_all=False)
        if any(s.part == "ray" for s in chosen):
            ray_head = suite.fork_child("ray-head", ray_head_main, (max(2 << 30, int(2.5 * nbytes)),), args.timeout)
            _, options["ray_address"] = ray_head.expect("ready")
        serial = 0
        for s in chosen:
            for n in wanted[s.name]:
                serial += 1
                options["gloo_port"] = free_port()
                g = suite.run_group(s, WORKLOAD, spec, expected, n, options, opts, f"floor-{os.getpid()}-{serial}")
                groups.append(g)
                walls = [x["wall_s"] for x in g["samples"]]
                print(f"  {s.name:16} x{n}: wall {median(walls):.3f} s (median of {len(walls)})", flush=True)
    finally:
        if ray_head is not None:
            ray_head.stop()
        if server is not None:
            stop_process(server)
    return {(r["system"], r["readers"]): r for r in suite.summarize(groups, {WORKLOAD: nbytes})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--readers", default="1,4")
    ap.add_argument("--no-systems", action="store_true", help="the passes and the arithmetic only (part 3 off)")
    ap.add_argument("--questions", action="store_true",
                    help="also time the alternatives to the floor's passes (piece sizes, a hash from L2, the hash on a "
                         "second thread, the publisher's hash on 2 threads, wordmix-64), interleaved with them")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    readers = sorted({int(x) for x in args.readers.split(",") if x.strip()})
    if not 16 <= args.size_mib <= 16384 or not 1 <= args.repeats <= 50 or not readers or not all(1 <= n <= 16 for n in readers):
        raise SystemExit("--size-mib in [16, 16384], --repeats in [1, 50], --readers counts in [1, 16]")
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the suite: tensors on huge pages
    spec = workload_spec(WORKLOAD, args.size_mib << 20, args.seed)
    gb = spec_bytes(spec) / 1e9
    print(f"{WORKLOAD}, {spec_bytes(spec) / 2**20:.0f} MiB; load average at the start {os.getloadavg()[0]:.2f}; "
          f"{len(os.sched_getaffinity(0))} cores")  # fmt: skip
    helper = Child("source", source_main, (spec, args.seed), args.timeout)
    try:
        _, pid, remote = helper.expect("ready")
        passes = Passes(spec, args.seed, pid, remote)
        rows = measure(passes, args.repeats, gb, ROWS + QUESTIONS if args.questions else ROWS)
        gil = gil_released(passes) if args.questions else None
    finally:
        helper.stop()
    print(f"\n{'pass (one thread unless said)':<32} {'wall s/GB':>10} {'CPU s/GB':>9}")
    for name, _ in ROWS + QUESTIONS if args.questions else ROWS:
        w, c = rows[name]
        print(f"{name:<32} {w:>10.3f} {c:>9.3f}")
    lines, floor = arithmetic(rows, readers)
    print()
    print("\n".join(lines))
    if args.questions:
        print()
        print("\n".join(line for line in questions(rows, gil) if line))
    if not args.no_systems:
        print("\nthe suite's systems, same run:")
        got = systems_run(args, readers)
        mem = got.get(("memcpy", 1))
        print(f"\n{'system':<18} {'readers':>7} {'wall s':>8} {'CPU s/GB':>9}")
        for (name, n), r in sorted(got.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            print(f"{name:<18} {n:>7} {r['wall_s']:>8.3f} {r['cpu_s_per_gb']:>9.3f}")
        for n in readers:
            vc, th = got.get(("verified copy", n)), got.get(("tensorhub[local]", n))
            if vc and th:
                print(f"{n} reader(s): tensorhub[local] takes {th['wall_s'] / vc['wall_s']:.2f}x the verified copy's wall time "
                      f"({th['cpu_s_per_gb'] - vc['cpu_s_per_gb']:+.3f} CPU s/GB)")  # fmt: skip
            if n == 1 and vc and mem:
                print(f"  one reader: the verified copy runs at {mem['wall_s'] / vc['wall_s']:.2f}x memcpy's rate (goal >= 0.7), "
                      f"tensorhub[local] at {mem['wall_s'] / th['wall_s']:.2f}x" if th else "")  # fmt: skip
            for base, goal in (("gloo broadcast", 0.5), ("ray numpy", 0.7)):
                b = got.get((base, n))
                if b and vc and n > 1:
                    print(f"  {n} readers: the verified copy takes {vc['wall_s'] / b['wall_s']:.2f}x {base}'s wall time "
                          f"(goal <= {goal}); tensorhub[local] {th['wall_s'] / b['wall_s']:.2f}x" if th else "")  # fmt: skip
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
