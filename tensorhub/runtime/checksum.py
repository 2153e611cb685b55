"""End-to-end checksums of a shard's checksum units (DESIGN §4, §5.2).

Theory of operation
-------------------
A layout names its checksum algorithm, one 64-bit value per checksum unit (a whole tiny
tensor, or one ``chunk_bytes`` piece of a large one: :class:`~tensorhub.core.layout.Unit`), in
the layout's order. Two are known, and the value depends only on the bytes, wherever they live:

- ``xxh3-64`` (XXH3, 64-bit, seed 0), the default of CPU shards: about 20 GB/s on one core,
  which is what lets a reader verify every byte it receives while the next bytes are still on
  the wire. CPU memory is hashed in place (no copy; the hash releases the GIL, so a worker
  thread hashes while the event loop and the transports' threads go on), also as it lands
  (:class:`LandingHasher`). CUDA memory is staged through a pinned buffer in pieces and hashed
  by the same code: correct, but a device-to-host copy of every byte.
- ``wordmix-64`` (:mod:`tensorhub.runtime.wordmix`), the default of CUDA shards: a sum of mixed
  64-bit words that a GPU computes in one kernel over every unit of a call, at memory speed,
  with nothing but the partial sums leaving the device. CPU memory is hashed with torch's
  integer ops (a few GB/s: right for a CPU reader or an offload copy of a GPU model, not for a
  CPU job, which keeps ``xxh3-64``).

Bad input gets a typed error: an unknown algorithm is :class:`~tensorhub.errors.InvalidArgument`,
a wrong number of expected values too.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

from tensorhub.core.errors import InvalidArgument
from tensorhub.core.layout import Unit
from tensorhub.transports.buffers import ShardBuffers, memory_of

from . import wordmix

__all__ = [
    "ALGORITHMS", "DeviceLanding", "LandingHasher", "compute", "digest", "first_mismatch", "lands", "lands_on_device",
    "place_units",
]

ALGORITHMS = ("xxh3-64", wordmix.NAME)
_STAGE = 8 << 20  # CUDA units are hashed through pinned staging in pieces of this size


class _Staging(threading.local):
    tensor: torch.Tensor | None = None

    def get(self, n: int) -> memoryview:
        if self.tensor is None or self.tensor.numel() < n:
            self.tensor = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return memory_of(self.tensor)[:n]


_staging = _Staging()


#: A buffer of at least this many bytes is hashed through a stream state (``xxh3_64(data)``), not
#: the one-shot function: python-xxhash's ``update`` releases the GIL in every version, its
#: one-shot ``xxh3_64_intdigest`` not in all (3.5.0's holds it for the whole call; 4.1.0's
#: releases it), and the publisher's hash threads, the copy workers hashing what landed and the
#: event loop must run at once. Same value; about a microsecond more per call.
_RELEASE_BYTES = 1 << 16


def digest(data: memoryview | bytes) -> int:
    """The ``xxh3-64`` checksum of ``data`` (the GIL released while a large one is hashed)."""
    n = data.nbytes if isinstance(data, memoryview) else len(data)
    if n >= _RELEASE_BYTES:
        return xxhash.xxh3_64(data).intdigest()
    return xxhash.xxh3_64_intdigest(data)


def _check_algorithm(buffers: ShardBuffers) -> None:
    if buffers.layout.checksum not in ALGORITHMS:
        raise InvalidArgument(f"checksum algorithm {buffers.layout.checksum!r} is not supported (known: {', '.join(ALGORITHMS)})")


def _unit_checksum(buffers: ShardBuffers, u: Unit) -> int:
    if u.length == 0:
        return digest(b"")
    if not buffers.on_cuda:
        (view,) = buffers.views(u.offset, u.length)
        return digest(view)
    h = xxhash.xxh3_64()
    pos = 0
    while pos < u.length:
        n = min(_STAGE, u.length - pos)
        staged = _staging.get(n)
        buffers.copy_out(u.offset + pos, staged)
        h.update(staged)
        pos += n
    return h.intdigest()


def _unit_bytes(buffers: ShardBuffers, u: Unit) -> torch.Tensor:
    """A flat uint8 tensor of unit ``u``'s bytes, where they are (no copy)."""
    if u.length == 0:
        return torch.empty(0, dtype=torch.uint8)
    region = buffers.plan.regions[u.region]
    if buffers.regions[u.region] is not None:
        start = u.offset - region.offset
        return buffers.flat(u.region)[start : start + u.length]
    (view,) = buffers.views(u.offset, u.length)  # a tiny tensor of an in-place pack: CPU memory
    return torch.frombuffer(view, dtype=torch.uint8)


def _address_table(buffers: ShardBuffers) -> tuple[np.ndarray, np.ndarray] | None:
    """Every unit's ``(address, size)``, by index, when all of them are in the GPU memory of one
    device (what the kernel takes without a tensor per unit); else None."""
    regions, starts, device = buffers.regions, buffers.plan.regions, None
    addrs = np.zeros(len(buffers.plan.units), dtype=np.int64)
    sizes = np.zeros(len(buffers.plan.units), dtype=np.int64)
    for u in buffers.plan.units:
        if not u.length:
            continue
        t = regions[u.region]
        if t is None or t.device.type != "cuda" or device not in (None, t.device):
            return None
        device = t.device
        addrs[u.index] = t.data_ptr() + u.offset - starts[u.region].offset
        sizes[u.index] = u.length
    return addrs, sizes


def _hash_threads() -> int:
    """Threads a large CPU hash is split over: the cores this process may run on, up to 8
    (``$TENSORHUB_HASH_THREADS`` overrides it; 1 hashes in the calling thread)."""
    raw = os.environ.get("TENSORHUB_HASH_THREADS")
    if raw is not None:
        try:
            n = int(raw)
        except ValueError:
            raise InvalidArgument(f"TENSORHUB_HASH_THREADS must be a whole number, got {raw!r}") from None
        if not 1 <= n <= 256:
            raise InvalidArgument(f"TENSORHUB_HASH_THREADS must be in [1, 256], got {n}")
        return n
    return max(1, min(8, len(os.sched_getaffinity(0))))


_PARALLEL_BYTES = 64 << 20  # a CPU hash of at least this many bytes is split over threads
_GROUP_MIN = 16 << 20  # ... in groups of at least this many bytes each
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_forget_pool)


def _hash_pool(threads: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < threads:
            if _pool is not None:
                _pool.shutdown(wait=False)  # its idle threads leave; running hashes finish
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tensorhub-hash")
        return _pool


def _groups(units: Sequence[Unit], k: int) -> list[Sequence[Unit]]:
    """``units`` cut into at most ``k`` runs of consecutive units of about equal bytes."""
    total = sum(u.length for u in units)
    out: list[Sequence[Unit]] = []
    start, acc = 0, 0
    for i, u in enumerate(units):
        acc += u.length
        if acc * k >= total * (len(out) + 1) and len(out) < k - 1:
            out.append(units[start : i + 1])
            start = i + 1
    out.append(units[start:])
    return [g for g in out if g]


def _xxh3_sums(buffers: ShardBuffers, units: Sequence[Unit]) -> list[int]:
    """``xxh3-64`` of CPU units, split over :func:`_hash_threads` threads when they are large
    (the hash releases the GIL): a publisher's checksums gate every partial holder's serving,
    so a big shard's hash must not wait on one core. Same values, in the same order."""
    threads = 1 if buffers.on_cuda else _hash_threads()
    total = sum(u.length for u in units) if threads > 1 else 0
    k = min(threads, total // _GROUP_MIN)
    if threads == 1 or total < _PARALLEL_BYTES or k < 2:
        return [_unit_checksum(buffers, u) for u in units]
    groups = _groups(units, k)

    def run(group: Sequence[Unit]) -> list[int]:
        return [_unit_checksum(buffers, u) for u in group]

    futures = [_hash_pool(threads).submit(run, g) for g in groups[1:]]
    out = run(groups[0])  # this thread takes the first group
    for f in futures:
        out += f.result()
    return out


def _checksums(buffers: ShardBuffers, units: Sequence[Unit]) -> list[int]:
    if buffers.layout.checksum != wordmix.NAME:
        return _xxh3_sums(buffers, units)
    if buffers.on_cuda and wordmix.backend(buffers.cuda_device) == "triton":
        table = buffers.__dict__.get("_wordmix_table", False)
        if table is False:  # built once per buffers: a 1 TB model's units cost no tensor each
            table = buffers.__dict__["_wordmix_table"] = _address_table(buffers)
        if table is not None:
            idx = np.fromiter((u.index for u in units), dtype=np.int64, count=len(units))
            return wordmix.sums_at(table[0][idx], table[1][idx], buffers.cuda_device)
    return wordmix.sums([_unit_bytes(buffers, u) for u in units])


#: A publisher's checksums in parts (:func:`compute` with ``on_part``): the first part covers this
#: many bytes (a pull's first read through ``local``; ``$TENSORHUB_CHECKSUM_PART_BYTES`` overrides
#: it, 0: no parts), each next one as many as all before it, up to :data:`_PART_MAX`; a shard
#: under twice the first part is declared whole.
_PART_FIRST = 32 << 20
_PART_MAX = 256 << 20
_BATCH = 16 << 20  # ... hashed in order, in runs of this many bytes, on the hash threads


def _part_first() -> int:
    """The first part's bytes (:data:`_PART_FIRST`, or ``$TENSORHUB_CHECKSUM_PART_BYTES``; 0: none)."""
    raw = os.environ.get("TENSORHUB_CHECKSUM_PART_BYTES")
    if raw is None:
        return _PART_FIRST
    try:
        n = int(raw)
    except ValueError:
        raise InvalidArgument(f"TENSORHUB_CHECKSUM_PART_BYTES must be a whole number of bytes, got {raw!r}") from None
    if n < 0:
        raise InvalidArgument(f"TENSORHUB_CHECKSUM_PART_BYTES must be >= 0 (0: no parts), got {n}")
    return n


def _batches(units: Sequence[Unit], size: int) -> list[Sequence[Unit]]:
    """``units`` cut, in order, into runs of at least ``size`` bytes (the last may be less)."""
    out: list[Sequence[Unit]] = []
    start = acc = 0
    for i, u in enumerate(units):
        acc += u.length
        if acc >= size:
            out.append(units[start : i + 1])
            start, acc = i + 1, 0
    if start < len(units):
        out.append(units[start:])
    return out


def _xxh3_in_parts(
    buffers: ShardBuffers, units: Sequence[Unit], on_part: Callable[[int, list[int]], None], first: int
) -> list[int]:
    """:func:`_xxh3_sums` of all the plan's units, hashed in order (runs of :data:`_BATCH` bytes
    on the hash threads, so the hashed prefix grows at their joint pace) and handed to
    ``on_part(first, values)`` each time the prefix has grown by the next part's bytes (see
    :data:`_PART_FIRST`); the last part is not handed over: the caller declares the whole."""
    threads = _hash_threads()
    batches = _batches(units, min(_BATCH, first))

    def run(batch: Sequence[Unit]) -> list[int]:
        return [_unit_checksum(buffers, u) for u in batch]

    results = _hash_pool(threads).map(run, batches) if threads > 1 and len(batches) > 1 else map(run, batches)
    out: list[int] = []
    sent = hashed = 0
    due = first
    for batch, sums in zip(batches, results):
        out += sums
        hashed += sum(u.length for u in batch)
        if hashed >= due and len(out) < len(units):
            on_part(sent, out[sent:])
            sent = len(out)
            due = hashed + min(max(hashed, first), _PART_MAX)
    return out


def compute(
    buffers: ShardBuffers, units: Iterable[int] | None = None, on_part: Callable[[int, list[int]], None] | None = None
) -> list[int]:
    """The checksums of ``units`` (indices into the plan's units; all of them by default), in
    that order. Blocking: run it in a worker thread.

    ``on_part(first, values)``: for all the units of a CPU shard under ``xxh3-64`` of at least
    twice :data:`_PART_FIRST` bytes (:func:`_part_first`), called (from this or a hash thread) with each part of the
    checksums as soon as the hash has reached its end, parts in order, the last one excepted
    (the return value has all of them): a publisher declares them so that readers verify what
    they pulled without waiting for the whole shard's hash. Not called otherwise."""
    _check_algorithm(buffers)
    all_units = buffers.plan.units
    if on_part is not None and units is None and buffers.layout.checksum == "xxh3-64" and not buffers.on_cuda:
        first = _part_first()
        if first and buffers.total_bytes >= 2 * first:
            return _xxh3_in_parts(buffers, all_units, on_part, first)
    picked = all_units if units is None else [all_units[i] for i in units]
    return _checksums(buffers, picked)


def first_mismatch(buffers: ShardBuffers, units: Iterable[int], expected: Sequence[int], prefix: bool = False) -> int | None:
    """The index of the first of ``units`` whose bytes do not match ``expected`` (the layout's
    declared checksums, all of them; with ``prefix``, the first of them, as declared in parts so
    far, covering ``units``), or None if all match. Blocking: run it in a worker thread.

    Raises:
        InvalidArgument: ``expected`` does not have one value per checksum unit (with ``prefix``:
            has more, or does not reach one of ``units``).
    """
    _check_algorithm(buffers)
    all_units = buffers.plan.units
    picked = list(units)
    if len(expected) != len(all_units) and not (
        prefix and len(expected) <= len(all_units) and all(0 <= i < len(expected) for i in picked)
    ):
        raise InvalidArgument(f"{len(expected)} checksums for a layout of {len(all_units)} checksum units")
    if buffers.layout.checksum == wordmix.NAME:  # all at once: one kernel on a GPU
        got = _checksums(buffers, [all_units[i] for i in picked])
        return next((i for i, v in zip(picked, got) if v != expected[i]), None)
    for i in picked:
        if _unit_checksum(buffers, all_units[i]) != expected[i]:
            return i
    return None


def lands(buffers: ShardBuffers) -> bool:
    """Whether reads into ``buffers`` can be hashed as they land (:class:`LandingHasher`): CPU
    memory under ``xxh3-64``, whose stream state follows a unit piece by piece."""
    return not buffers.on_cuda and buffers.layout.checksum == "xxh3-64"


class LandingHasher:
    """The checksums of one read's units, computed as the read's bytes land (fused with the copy).

    A transport that reports landing (``Transport.reports_landing``) calls :meth:`landed` from
    the thread that has just copied a piece of the range into the reader's CPU memory, so the
    piece is hashed while it is still in that core's cache instead of being read back from
    memory by a separate pass. Pieces of one unit may land out of order and from several
    threads (a read split over threads is cut where the transport likes): each unit is hashed
    as a stream, in order, by whichever thread lands the piece that continues it; a piece that
    lands ahead of its unit's hashed prefix waits (by its start) until the prefix reaches it.

    Cost: a landing costs one lock round per unit it touches plus the hash (a transport that
    copies a whole unit by itself reports it through :meth:`unit_stream`: one hash update per
    piece, no lock until the last); each unit's bytes are viewed once (a unit is one contiguous run of memory: a chunk of one tensor, a tiny
    tensor, or a piece of a copied pack), so nothing per landing grows with the shard's tensors.

    Invariants: a unit's digest exists only once every byte of it was hashed exactly once, in
    order; :attr:`complete` is True only when every unit has one. The hasher never judges the
    bytes: the engine compares :attr:`digests` with the declared checksums (which may arrive
    later) and reads again whatever does not match. A read that fails or is revoked just drops
    its hasher.
    """

    __slots__ = ("_buffers", "_busy", "_count", "_ends", "_lock", "_next", "_pending", "_states", "_starts", "_units",
                 "_views", "digests")  # fmt: skip

    def __init__(self, buffers: ShardBuffers, units: Sequence[Unit]) -> None:
        if not lands(buffers):
            what = "CUDA memory" if buffers.on_cuda else f"{buffers.layout.checksum!r} units"
            raise InvalidArgument(f"landing hashes need CPU buffers under xxh3-64; {what} are verified after the read")
        _check_algorithm(buffers)
        self._buffers = buffers
        self._lock = threading.Lock()
        self._count = len({u.index for u in units})
        self.digests: dict[int, int] = {}
        real = sorted((u for u in units if u.length), key=lambda u: u.offset)
        for u in units:
            if not u.length:
                self.digests[u.index] = digest(b"")
        self._units = real
        self._starts = [u.offset for u in real]
        self._ends = [u.offset + u.length for u in real]
        self._next = list(self._starts)  # each unit is hashed up to here (transfer offset)
        self._pending: list[dict[int, int] | None] = [None] * len(real)  # landed ahead: start -> end
        self._busy = [False] * len(real)  # a thread is hashing this unit now
        self._states: list[xxhash.xxh3_64 | None] = [None] * len(real)
        self._views: list[memoryview | None] = [None] * len(real)  # each unit's bytes, viewed on first landing

    @property
    def complete(self) -> bool:
        """Every unit of the read has its digest."""
        with self._lock:
            return len(self.digests) == self._count

    def __call__(self, offset: int, length: int) -> None:
        """:meth:`landed` (the hasher is the transport's ``landed`` callback)."""
        self.landed(offset, length)

    def unit_stream(self, offset: int, length: int) -> Callable[[int, int], None] | None:
        """A faster way to report a copy of exactly one whole unit: if ``[offset, offset +
        length)`` is one unit of this read, its bytes one run of memory, none of it reported
        yet, returns ``sink``; the caller then calls ``sink(start, end)`` for consecutive pieces
        ``[start, end)`` from ``offset`` to ``offset + length``, in order, from one thread, each
        right after it landed (instead of :meth:`landed`), and the last one gives the unit its
        digest. Per piece that is one slice and one hash update: no search, no lock. Else None
        (report with :meth:`landed`). A piece out of order raises :class:`InvalidArgument`
        (a callback that raises fails the read)."""
        k = bisect.bisect_left(self._starts, offset)
        if k >= len(self._starts) or self._starts[k] != offset or self._ends[k] != offset + length:
            return None
        views = self._buffers.views(offset, length)
        if len(views) != 1:
            return None
        with self._lock:
            if self._busy[k] or self._next[k] != offset or self._pending[k]:
                return None
            self._busy[k] = True  # the sink's own: a landed() of this unit parks its piece (then no digest)
        view, state, index, end = views[0], xxhash.xxh3_64(), self._units[k].index, offset + length
        at = [offset]

        def sink(start: int, stop: int) -> None:
            if start != at[0] or not start < stop <= end:
                raise InvalidArgument(f"unit at transfer byte {offset}: piece [{start}, {stop}) reported, [{at[0]}, ...) expected")
            state.update(view[start - offset : stop - offset])
            at[0] = stop
            if stop == end:
                with self._lock:
                    self.digests[index] = state.intdigest()
                    self._next[k] = end
                    self._busy[k] = False

        return sink

    def landed(self, offset: int, length: int) -> None:
        """Bytes ``[offset, offset + length)`` of the transfer space just landed: hash what now
        continues a unit's hashed prefix. Called from transport threads."""
        end = offset + length
        starts, ends = self._starts, self._ends
        k = max(0, bisect.bisect_right(starts, offset) - 1)
        while k < len(starts) and starts[k] < end:
            s, e = max(offset, starts[k]), min(end, ends[k])
            if s < e:
                self._land(k, s, e)
            k += 1

    def _land(self, k: int, s: int, e: int) -> None:
        with self._lock:
            if self._busy[k] or self._next[k] != s:
                pending = self._pending[k]
                if pending is None:
                    pending = self._pending[k] = {}
                pending[s] = e  # its unit's prefix has not reached it, or another thread is on it
                return
            self._busy[k] = True
        while True:
            self._hash(k, s, e)
            with self._lock:
                self._next[k] = e
                pending = self._pending[k]
                nxt = pending.pop(e, None) if pending else None
                if nxt is None:
                    self._busy[k] = False
                    return
            s, e = e, nxt

    def _hash(self, k: int, s: int, e: int) -> None:
        """Hash unit ``k``'s bytes ``[s, e)`` (the next of its stream; only this thread is on it)."""
        u = self._units[k]
        view = self._views[k]
        if view is None:
            views = self._buffers.views(u.offset, u.length)
            if len(views) == 1:
                view = self._views[k] = views[0]
        lo, hi = s - u.offset, e - u.offset
        pieces = [view[lo:hi]] if view is not None else self._buffers.views(s, e - s)
        if lo == 0 and hi == u.length and len(pieces) == 1:  # the whole unit in one piece: no stream state
            value: int | None = digest(pieces[0])
        else:
            state = self._states[k]
            if state is None:
                state = self._states[k] = xxhash.xxh3_64()
            for piece in pieces:
                state.update(piece)
            value = state.intdigest() if hi == u.length else None
        if value is not None:
            with self._lock:
                self.digests[u.index] = value
                self._states[k] = None
                self._views[k] = None


#: Whether the engine hands GPU reads a :class:`DeviceLanding` (``TENSORHUB_FUSED_GPU_COPY=1``).
#: Off by default. On an H100 the kernel alone copies and hashes 1 GiB in 0.87 ms, against 0.93 ms
#: for the segments' ``copy_`` and 0.97 more for hashing them after (``benchmarks/gpu_fused.py``),
#: but a landing's ``copy_ranges`` takes 1.8 ms (Triton's launch and the bookkeeping around it),
#: and ``local`` pulls through it measured 295 and 405 GB/s for 1 and 8 GiB, against 277 and 763
#: copying then hashing (benchmarks/results/GPU.md). Until the launch costs less, copy then hash.
FUSED_GPU_COPY = os.environ.get("TENSORHUB_FUSED_GPU_COPY", "0") == "1"


def lands_on_device(buffers: ShardBuffers) -> bool:
    """Whether reads into ``buffers`` can be hashed by the copy that lands them on the GPU
    (:class:`DeviceLanding`): GPU memory under ``wordmix-64``."""
    return buffers.on_cuda and buffers.layout.checksum == wordmix.NAME


class DeviceLanding:
    """The ``wordmix-64`` checksums of one read's units into GPU memory, computed by the copy that
    lands them (:func:`~tensorhub.runtime.wordmix.copy_sums_at`: one kernel reads each byte once,
    writes it and hashes it from the same registers), so that verifying the read costs no second
    pass over the bytes.

    A transport that reports landing and copies GPU memory to GPU memory itself (``local`` over
    CUDA IPC) calls :meth:`copy` with the read's segments instead of copying them: each unit
    wholly inside one segment (same device at both ends) is copied by the kernel and gets its
    digest; every other byte is copied with ``copy_``. Without the kernel on this device (no
    Triton, or its self-check failed) everything is copied with ``copy_`` and no digest is
    computed: the engine then hashes the read after it landed, as for any transport.

    Invariants: a unit's digest exists only if the kernel wrote every byte of it from the values
    it hashed; the engine compares :attr:`digests` with the declared checksums and reads again
    what does not match. Calling the object as a CPU landing callback (``landed(offset, length)``)
    does nothing: bytes landed another way are hashed after the read.
    """

    __slots__ = ("_count", "_ends", "_index", "_lengths", "_offsets", "digests")

    def __init__(self, buffers: ShardBuffers, units: Sequence[Unit]) -> None:
        if not lands_on_device(buffers):
            what = "CPU memory" if not buffers.on_cuda else f"{buffers.layout.checksum!r} units"
            raise InvalidArgument(f"device landing needs GPU buffers under {wordmix.NAME}; {what} are verified after the read")
        self._count = len({u.index for u in units})
        self.digests: dict[int, int] = {u.index: wordmix.reference(b"") for u in units if not u.length}
        real = sorted((u for u in units if u.length), key=lambda u: u.offset)
        self._offsets = np.array([u.offset for u in real], dtype=np.int64)
        self._lengths = np.array([u.length for u in real], dtype=np.int64)
        self._ends = self._offsets + self._lengths
        self._index = [u.index for u in real]

    @property
    def complete(self) -> bool:
        """Every unit of the read has its digest."""
        return len(self.digests) == self._count

    def __call__(self, offset: int, length: int) -> None:
        """A CPU landing report: not hashed here (see the class docstring)."""

    def copy(self, segments: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Copy ``(transfer offset, source, destination)`` segments (flat uint8 CUDA tensors of
        equal lengths) on the current stream and wait for them; hash the units on the way
        (:meth:`copy_ranges`, where the kernel runs on the destination's device; else ``copy_``).

        Raises:
            InvalidArgument: a segment whose two ends differ in length or are not CUDA bytes.
        """
        devices = set()
        for offset, src, dst in segments:
            if src.numel() != dst.numel() or src.device.type != "cuda" or dst.device.type != "cuda":
                raise InvalidArgument(f"segment at transfer byte {offset}: {src.numel()} bytes on {src.device} "
                                      f"to {dst.numel()} on {dst.device}")  # fmt: skip
            devices.add((src.device, dst.device))
        if len(devices) == 1 and (pair := devices.pop())[0] == pair[1] and self.kernel_runs_on(pair[1]):
            offs, lens, srcs, dsts = (np.array(col, dtype=np.int64) for col in zip(
                *((o, s.numel(), s.data_ptr(), d.data_ptr()) for o, s, d in segments)
            ))  # fmt: skip
            self.copy_ranges(offs, lens, srcs, dsts, pair[1])
            return
        for _, src, dst in segments:
            dst.copy_(src, non_blocking=True)
        for _, _, dst in segments:
            torch.cuda.current_stream(dst.device).synchronize()

    @staticmethod
    def kernel_runs_on(device: torch.device) -> bool:
        """Whether :meth:`copy_ranges` can run on ``device`` (the fused kernel passed its
        self-check there)."""
        return wordmix.copy_backend(device) == "triton"

    def copy_ranges(self, offsets: np.ndarray, lengths: np.ndarray, src: np.ndarray, dst: np.ndarray, device: torch.device) -> None:
        """Copy segments given as arrays (transfer offsets, lengths, source and destination
        addresses, all GPU memory of ``device``) with the fused kernel, one launch for the units
        wholly inside a segment (their digests recorded) and one for the segments they do not
        cover; on the current stream, waited for. The caller checked
        ``wordmix.copy_backend(device) == "triton"`` and keeps the memory alive."""
        units, u_src, u_dst, u_len, rest = place_units(self._offsets, self._lengths, offsets, lengths, src, dst)
        if len(rest):  # bytes outside whole units (none where reads are whole units): copied, not hashed
            wordmix.copy_sums_at(src[rest], dst[rest], lengths[rest], device)
        if len(units):
            got = wordmix.copy_sums_at(u_src, u_dst, u_len, device)
            self.digests.update(zip((self._index[k] for k in units.tolist()), got))
        torch.cuda.current_stream(device).synchronize()


def place_units(
    unit_offsets: np.ndarray, unit_lengths: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
    src: np.ndarray, dst: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Where each unit lies in a read's segments, without a Python loop over either.

    Args:
        unit_offsets, unit_lengths: the units (transfer offsets, ascending, not overlapping).
        offsets, lengths, src, dst: the segments (transfer offsets, ascending, not overlapping;
            lengths; source and destination addresses of their first bytes).

    Returns:
        ``(units, src, dst, lengths, rest)``: the positions of the units wholly inside one
        segment, their source and destination addresses and lengths, and the positions of the
        segments those units do not cover entirely.
    """
    seg = np.searchsorted(offsets, unit_offsets, side="right") - 1
    inside = seg >= 0
    safe = np.where(inside, seg, 0)
    inside &= unit_offsets + unit_lengths <= offsets[safe] + lengths[safe]
    units = np.flatnonzero(inside)
    owner = seg[units]
    rel = unit_offsets[units] - offsets[owner]
    covered = np.bincount(owner, weights=unit_lengths[units], minlength=len(offsets))
    rest = np.flatnonzero(covered < lengths)
    return units, src[owner] + rel, dst[owner] + rel, unit_lengths[units], rest
