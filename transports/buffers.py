"""A shard's registered memory as one byte space, and the words that guard it.

Theory of operation
-------------------
A shard's bytes are moved as one *transfer byte space*: its pack buffers (the tiny tensors laid
end to end), then its large tensors, in the order the layout's packing plan fixes
(:mod:`tensorhub.core.layout`). Transports move byte ranges of that space;
:meth:`ShardBuffers.views` turns a range into the memory segments it covers, without copying.

:class:`ProgressCounter` holds the two words a reader of this holder checks (DESIGN §4):

- ``verified``: bytes of the held version received (and verified) contiguously from the start.
  It never decreases while one generation lasts.
- ``generation``: bumped whenever the buffers may change (unpublish, abort, a new version
  pulled in). A read is accepted only if the generation did not move across it (a seqlock).

Serving threads of two-sided transports block on the counter until a range is covered, so a
partial holder serves each range as soon as it has it (pipeline replication). Every wait is
bounded by a timeout and ends early when the generation moves.

One-sided readers (``nixl``, ``local``) cannot block on a condition in another process: they
read the counter's *words* instead, four int64 in CPU memory that the counter rewrites on every
change: ``[tag, generation, version + 1 (0: none), verified]``. The words live in slots of a
process-wide arena (:data:`WORDS`) whose chunks are allocated once and never freed, so a
transport registers each chunk once and a stale reader can never read unmapped memory; ``tag``
is a random nonzero number per counter (zeroed when the counter dies), so a reader that cached
the address of a slot later given to another counter sees the tag differ and stops. A reset
stores ``verified = 0`` and the version before the new generation, then the real ``verified``;
``verified`` advances only after the bytes below it are in place (x86 and the PCIe ordering of
a NIC's READ keep stores in that order). A READ of the words is not atomic, so a reader takes
them as covering its range only when two READs in a row agree; it reads them again after its
bytes (a seqlock) and accepts the bytes only if the tag, generation and version did not change
and ``verified`` still covers them.

Size: the byte space, its packs and its shared-memory files are one object every transport
reads through; the progress words would split off first.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import os
import secrets
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorhub.core.errors import InvalidArgument, InvalidName
from tensorhub.core.layout import DTYPE_SIZES, Layout, TensorSpec, plan_of

__all__ = [
    "WORDS", "WORD_BYTES", "ProgressCounter", "Segment", "ShardBuffers", "SharedFile", "Staging", "WordsArena", "layout_of", "memory_of",
    "read_words",
]  # fmt: skip

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_PACK_THRESHOLD = 2 << 20
CHECKSUM_ALGORITHM = "xxh3-64"  #: the default of a shard in CPU memory
CUDA_CHECKSUM_ALGORITHM = "wordmix-64"  #: the default of a shard with tensors in GPU memory
CHECKSUM_ALGORITHMS = (CHECKSUM_ALGORITHM, CUDA_CHECKSUM_ALGORITHM)
#: The least read a pull into GPU memory plans. A GPU copies and hashes 1 GiB in about a
#: millisecond, what a read costs the engine and the transport around the copy (a task, a thread,
#: a wait for the stream, the progress words): on an H100, 8 GiB moved by ``local`` at 484 GB/s
#: in reads of 256 MiB and 850 GB/s in reads of 1 GiB (benchmarks/results/GPU.md).
CUDA_READ_BYTES = 1 << 30


WORD_BYTES = 32  #: one counter's words: tag, generation, version + 1, verified (int64 each)


class WordsArena:
    """Slots of :data:`WORD_BYTES` for progress words, in CPU chunks that are never freed.

    Attributes:
        chunks: the chunks allocated so far (uint8 tensors), in order; a transport that must
            register memory registers each one once.
    """

    def __init__(self, chunk_slots: int = 2048) -> None:
        self.chunk_slots = chunk_slots
        self.chunks: list[torch.Tensor] = []
        self._free: list[int] = []  # addresses of free slots
        # Slots given back, not yet in ``_free``. ``give`` runs from counters' finalizers, that
        # is whenever the garbage collector runs, even inside ``take`` on the same thread: it
        # must not take a lock (a deque's append is atomic).
        self._returned: collections.deque[int] = collections.deque()
        self._lock = threading.Lock()

    def take(self) -> tuple[int, int]:
        """A free slot: ``(address, chunk index)``; its words are zero."""
        with self._lock:
            while self._returned:
                self._free.append(self._returned.popleft())
            if not self._free:
                chunk = torch.zeros(self.chunk_slots * WORD_BYTES, dtype=torch.uint8)
                self.chunks.append(chunk)
                base = chunk.data_ptr()
                self._free = [base + i * WORD_BYTES for i in reversed(range(self.chunk_slots))]
            addr = self._free.pop()
            return addr, self.chunk_of(addr)

    def give(self, addr: int) -> None:
        """Return a slot (its tag is zeroed first, so stale readers see it is not theirs)."""
        ctypes.memset(addr, 0, WORD_BYTES)
        self._returned.append(addr)

    def chunk_of(self, addr: int) -> int:
        for i, c in enumerate(self.chunks):
            if c.data_ptr() <= addr < c.data_ptr() + c.numel():
                return i
        raise InvalidArgument(f"address {addr:#x} is not in the progress-words arena")


#: The process's progress words (see the module docstring).
WORDS = WordsArena()


def read_words(raw: bytes | memoryview) -> tuple[int, int, int | None, int]:
    """``(tag, generation, version, verified)`` from a copy of a counter's 32 words bytes."""
    tag, gen, ver, verified = (int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, 32, 8))
    return tag, gen, (ver - 1 if ver > 0 else None), verified


class ProgressCounter:
    """``(generation, verified)`` of one holding, safe to read and wait on from any thread, and
    mirrored into progress words for one-sided readers (see the module docstring).

    Attributes:
        tag: this counter's nonzero random tag (first of its words).
        words_address: where its words are (in :data:`WORDS`).
        words_chunk: the index of the arena chunk that holds them.
    """

    __slots__ = ("__weakref__", "_cond", "_words", "generation", "tag", "verified", "version", "words_address", "words_chunk")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self.generation = 1
        self.verified = 0
        self.version: int | None = None
        self.tag = secrets.randbits(62) + 1
        self.words_address, self.words_chunk = WORDS.take()
        self._words = (ctypes.c_int64 * 4).from_address(self.words_address)
        self._words[1] = 1
        self._words[0] = self.tag  # last: a reader that sees the tag sees the rest
        weakref.finalize(self, WORDS.give, self.words_address)

    def retag(self) -> int:
        """Give the words a new tag: one-sided readers that described these buffers before
        fail their next read and must describe them again (a one-sided transport calls it when
        it withdraws the buffers). Returns the new tag."""
        with self._cond:
            self.tag = secrets.randbits(62) + 1
            self._words[0] = self.tag
            return self.tag

    def words(self) -> bytes:
        """A copy of the 32 bytes of words (what a one-sided reader reads)."""
        return ctypes.string_at(self.words_address, WORD_BYTES)

    def _mirror(self) -> None:
        """Write the words after a reset (under the lock): ``verified`` to 0 and the version
        first, then the generation, then the real ``verified``, so that a reader that sees the
        new generation never sees the old holding's progress with it."""
        w = self._words
        w[3] = 0
        w[2] = 0 if self.version is None else self.version + 1
        w[1] = self.generation
        w[3] = self.verified

    def snapshot(self) -> tuple[int, int | None, int]:
        """``(generation, version, verified)`` read together."""
        with self._cond:
            return self.generation, self.version, self.verified

    def reset(self, version: int | None, verified: int = 0) -> int:
        """The buffers now hold ``version`` (None: nothing) with ``verified`` bytes valid; bumps
        the generation so that reads across the change are discarded. Returns the new generation."""
        with self._cond:
            self.generation += 1
            self.version = version
            self.verified = verified
            self._mirror()
            self._cond.notify_all()
            return self.generation

    def advance(self, verified: int) -> None:
        """Raise ``verified`` (never lowers it)."""
        with self._cond:
            if verified > self.verified:
                self.verified = verified
                self._words[3] = verified
                self._cond.notify_all()

    def wait_covered(self, version: int, end: int, generation: int | None, timeout: float) -> tuple[int, bool]:
        """Block until ``verified >= end`` for ``version``, or until ``timeout`` passes, or the
        holding changes: the generation differs from ``generation`` (if given), or the buffers
        held ``version`` during the wait and then stopped. Buffers that do not hold ``version``
        yet are waited for: a reader may be granted a partial holder before that holder's own
        grant has reached it. Returns ``(generation, covered)``."""
        deadline = time.monotonic() + timeout
        seen = False
        with self._cond:
            while True:
                if generation is not None and self.generation != generation:
                    return self.generation, False
                if self.version == version:
                    seen = True
                    if self.verified >= end:
                        return self.generation, True
                elif seen:
                    return self.generation, False
                left = deadline - time.monotonic()
                if left <= 0:
                    return self.generation, False
                self._cond.wait(left)


@dataclass(frozen=True, slots=True)
class Segment:
    """``length`` bytes at shard offset ``offset``: part of tensor ``index``, from its byte
    ``start``."""

    index: int
    start: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class SharedFile:
    """Where a region in shared memory lives: the holder's open file descriptor ``fd`` of the
    shared-memory file (``st_dev``, ``st_ino`` as they were when it was shared: a reader that
    opens ``/proc/<pid>/fd/<fd>`` and finds another file refuses it), the file's ``size``, the
    region's byte ``offset`` in it, and the region's ``address`` in this process then (a tensor
    whose memory moved since is not described as shared)."""

    fd: int
    dev: int
    ino: int
    size: int
    offset: int
    address: int

    def extra(self) -> dict[str, int]:
        """The msgpack-safe fields ``local`` describes (see transports/local.py)."""
        return {"fd": self.fd, "dev": self.dev, "ino": self.ino, "offset": self.offset, "size": self.size}


def share_memory(t: torch.Tensor) -> SharedFile:
    """Move ``t``'s storage into shared memory in place (torch's ``share_memory_()``: the bytes
    are copied once into a new shared-memory file and ``t.data_ptr()`` changes; every view of the
    storage follows), and say where it lives. A storage already in shared memory is not copied.

    Raises:
        InvalidArgument: ``t`` is not in CPU memory, or torch's sharing strategy is not
            ``file_descriptor`` (the files of ``file_system`` have no descriptor to describe).
    """
    import torch.multiprocessing as tmp

    if t.device.type != "cpu":
        raise InvalidArgument(f"shared memory is for CPU tensors; this one is on {t.device}")
    strategy = tmp.get_sharing_strategy()
    if strategy != "file_descriptor":
        raise InvalidArgument(f"shared memory needs torch's 'file_descriptor' sharing strategy; it is {strategy!r}")
    storage = t.untyped_storage()
    if not storage.is_shared():
        t.share_memory_()
        storage = t.untyped_storage()
    fd, size = storage._share_fd_cpu_()
    st = os.fstat(fd)
    offset = t.data_ptr() - storage.data_ptr()
    return SharedFile(int(fd), int(st.st_dev), int(st.st_ino), int(size), offset, t.data_ptr())


class _Parts:
    """An in-place pack's tiny tensors with bytes: where each starts in the pack, a view of its
    memory and its address."""

    __slots__ = ("addresses", "sizes", "starts", "views")

    def __init__(self, starts: list[int], views: list[memoryview], addresses: list[int]) -> None:
        self.starts, self.views, self.addresses = starts, views, addresses
        self.sizes = [len(v) for v in views]

    def cut(self, start: int, length: int) -> list[tuple[int, int, int]]:
        return cut_parts(self.starts, self.sizes, start, length)


def cut_parts(starts: Sequence[int], sizes: Sequence[int], start: int, length: int) -> list[tuple[int, int, int]]:
    """``(part, from, to)``: the byte ranges of parts laid end to end (part ``k`` from
    ``starts[k]``, ``sizes[k]`` bytes) that bytes ``[start, start + length)`` cover, in order.
    The range must lie inside the parts."""
    out = []
    k = max(0, bisect.bisect_right(starts, start) - 1)
    pos, end = start, start + length
    while pos < end:
        lo = pos - starts[k]
        hi = min(sizes[k], end - starts[k])
        if hi > lo:
            out.append((k, lo, hi))
            pos = starts[k] + hi
        k += 1
    return out


def memory_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy). The caller keeps
    ``t`` alive while the view is used."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def layout_of(
    tensors: dict[str, torch.Tensor],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    pack_threshold: int = DEFAULT_PACK_THRESHOLD,
    checksum: str | None = None,
    ctx: dict | None = None,
) -> Layout:
    """The layout of named tensors, in the dict's order. ``checksum`` names the checksum
    algorithm; by default ``wordmix-64`` if a tensor is in GPU memory (a GPU hashes it at memory
    speed), else ``xxh3-64``.

    Raises:
        InvalidArgument: not a dict of contiguous tensors of a supported dtype, or an unknown
            checksum algorithm.
        InvalidName: a name that is not a non-empty string.
    """
    ctx = ctx or {}
    if checksum is not None and checksum not in CHECKSUM_ALGORITHMS:
        raise InvalidArgument(f"unknown checksum algorithm {checksum!r} (known: {', '.join(CHECKSUM_ALGORITHMS)})", **ctx)
    if not isinstance(tensors, dict) or not tensors:
        raise InvalidArgument(f"register takes a non-empty dict of name -> torch.Tensor, got {type(tensors).__name__}", **ctx)
    specs = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or len(name) > 1024:
            raise InvalidName(f"tensor names must be strings of 1 to 1024 characters, got {name!r}", **ctx)
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor", **ctx)
        if not t.is_contiguous():
            raise InvalidArgument(f"tensor {name!r} is not contiguous; register contiguous tensors", **ctx)
        if t.device.type not in ("cpu", "cuda"):
            raise InvalidArgument(f"tensor {name!r} is on {t.device}; CPU and CUDA tensors are supported", **ctx)
        dtype = _dtype_name(t)
        if dtype not in DTYPE_SIZES:
            raise InvalidArgument(f"tensor {name!r} has dtype {dtype}, which layouts cannot name", **ctx)
        specs.append(TensorSpec(name, dtype, tuple(int(d) for d in t.shape), t.numel() * t.element_size()))
    if checksum is None:
        on_gpu = any(t.device.type == "cuda" for t in tensors.values())
        checksum = CUDA_CHECKSUM_ALGORITHM if on_gpu else CHECKSUM_ALGORITHM
    return Layout(tuple(specs), checksum, chunk_bytes, pack_threshold)


class ShardBuffers:
    """The registered tensors of one shard handle, addressed as one transfer byte space.

    The space is laid out by the layout's packing plan (:func:`~tensorhub.core.layout.plan_of`): pack
    regions (the tiny tensors end to end) and then the large tensors, used in place. A pack is
    either *copied* or *in place*:

    - copied (the default): a pack buffer is allocated here, on the device of its first tiny
      tensor; :meth:`pack` copies the tiny tensors into it (a publisher, before serving) and
      :meth:`unpack` copies them back out (a reader, after its pull). Transports that register
      memory (NIXL) need this: one registration and one transfer operation per pack.
    - in place (``packs_in_place=True``, for packs whose tiny tensors are all in CPU memory): no
      buffer; the pack region is a list of *parts*, the tiny tensors' own memory, and
      :meth:`views`, :meth:`spans`, :meth:`copy_in` and :meth:`copy_out` cut a range of it
      along the tensors. Publishing copies nothing and a pull lands straight in the tensors: no
      second copy of the tiny tensors in memory, no pack or unpack pass. For transports that
      gather (``Transport.gathers``): the engine asks for it when all of its transports do.

    Both kinds give the same transfer space, units and checksums: a reader with copied packs
    reads a holder with in-place ones and the other way round.

    ``shared_memory=True`` moves every region in CPU memory (the large tensors and copied pack
    buffers; not the tiny tensors of an in-place pack) into shared-memory files, in place and
    once (:func:`share_memory`: a copy of the bytes, and the tensors' ``data_ptr()`` change;
    one open file descriptor per storage while it lives), so that ``local`` readers on this
    host map them and copy in user space instead of through ``process_vm_readv``.

    Attributes:
        layout: the shard's layout (what the server compares across holders).
        plan: its packing plan.
        tensors: the caller's tensors, in layout order (empty for an offload copy).
        regions: the packs and large tensors, in transfer order (flat byte tensors or the
            caller's own tensors; None for a pack kept in place).
        progress: the holding's :class:`ProgressCounter`.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        layout: Layout,
        *,
        regions: list[torch.Tensor] | None = None,
        packs_in_place: bool = False,
        shared_memory: bool = False,
    ) -> None:
        self.layout = layout
        self.plan = plan = plan_of(layout)
        self.tensors = list(tensors.values())
        built: list[torch.Tensor | None] = []
        if regions is None:
            if len(self.tensors) != len(layout.tensors):
                raise InvalidArgument(f"{len(self.tensors)} tensors for a layout of {len(layout.tensors)}")
            for r in plan.regions:
                if r.tensor is not None:
                    built.append(self.tensors[r.tensor])
                elif packs_in_place and all(self.tensors[i].device.type == "cpu" for i, _ in r.members):
                    built.append(None)
                else:
                    device = self.tensors[r.members[0][0]].device
                    built.append(torch.zeros(r.nbytes, dtype=torch.uint8, device=device))
        elif len(regions) != len(plan.regions) or any(
            t.numel() * t.element_size() != r.nbytes for t, r in zip(regions, plan.regions)
        ):
            raise InvalidArgument("regions do not match the layout's packing plan")
        else:
            built = list(regions)
        self.regions = built
        #: region index -> its :class:`SharedFile` (``shared_memory=True``: every region in CPU
        #: memory but the in-place packs, moved into shared memory here, before anything views it)
        self.shared: dict[int, SharedFile] = {}
        if shared_memory:
            for k, t in enumerate(built):
                if t is not None and t.device.type == "cpu" and t.numel():
                    self.shared[k] = share_memory(t)
        self.starts = [r.offset for r in plan.regions]
        self.total_bytes = plan.total_bytes
        self.on_cuda = any(t is not None and t.device.type == "cuda" for t in built)
        # CPU memory, viewed once: serving, receiving and hashing slice these.
        self._views = [memory_of(t) if t is not None and t.device.type == "cpu" else None for t in built]
        # The in-place packs: region index -> its parts (start in the region, view, address).
        self._parts: dict[int, _Parts] = {k: self._parts_of(k) for k, t in enumerate(built) if t is None}
        self._member_views: dict[int, tuple[Any, Any]] | None = None
        self.progress = ProgressCounter()

    def _parts_of(self, k: int) -> _Parts:
        starts: list[int] = []
        views: list[memoryview] = []
        addresses: list[int] = []
        for i, off in self.plan.regions[k].members:
            t = self.tensors[i]
            if self.layout.tensors[i].nbytes:
                starts.append(off)
                views.append(memory_of(t))
                addresses.append(t.data_ptr())
        return _Parts(starts, views, addresses)

    def read_bytes(self, chunk_bytes: int) -> int:
        """The size of the reads a pull into these buffers plans with: ``chunk_bytes`` (the
        engine's), at least one checksum unit, and at least :data:`CUDA_READ_BYTES` in GPU memory."""
        least = CUDA_READ_BYTES if self.on_cuda else 0
        return max(chunk_bytes, self.layout.chunk_bytes, least)

    @property
    def cuda_device(self) -> torch.device:
        """The GPU of the (first) region in GPU memory."""
        return next(t.device for t in self.regions if t is not None and t.device.type == "cuda")

    @property
    def packed(self) -> bool:
        """Whether tiny tensors go through copied pack buffers (:meth:`pack` before serving,
        :meth:`unpack` after a pull); False when there are none, or all packs are in place."""
        return any(t is not None and r.tensor is None for t, r in zip(self.regions, self.plan.regions))

    @property
    def packs_in_place(self) -> bool:
        """Whether some pack is kept in place (a list of the tiny tensors' own memory)."""
        return bool(self._parts)

    def parts(self, region: int) -> list[tuple[int, int]] | None:
        """An in-place pack's parts, ``(address, nbytes)`` of each tiny tensor with bytes in
        pack order (what ``local`` describes to its readers); None for any other region."""
        got = self._parts.get(region)
        if got is None:
            return None
        return list(zip(got.addresses, got.sizes))

    def shared_file(self, region: int) -> SharedFile | None:
        """Where region ``region`` lives in shared memory (what ``local`` describes, so that a
        reader on this host maps it and copies with ``memmove``); None when it is not there, or
        its tensor's memory moved since it was shared (``param.data = ...``)."""
        got = self.shared.get(region)
        t = self.regions[region]
        if got is None or t is None or t.data_ptr() != got.address:
            return None
        return got

    def segments(self, offset: int, length: int) -> list[Segment]:
        """The pieces of regions that transfer bytes ``[offset, offset + length)`` cover
        (``Segment.index`` is the region's index).

        Raises:
            InvalidArgument: the range is not inside the shard.
        """
        if offset < 0 or length < 0 or offset + length > self.total_bytes:
            raise InvalidArgument(f"byte range [{offset}, {offset + length}) is outside the shard's {self.total_bytes} bytes")
        out = []
        i = max(0, bisect.bisect_right(self.starts, offset) - 1)
        pos, end = offset, offset + length
        regions = self.plan.regions
        while pos < end:
            while regions[i].offset + regions[i].nbytes <= pos:
                i += 1
            start = pos - regions[i].offset
            n = min(end, regions[i].offset + regions[i].nbytes) - pos
            out.append(Segment(i, start, pos, n))
            pos += n
        return out

    def views(self, offset: int, length: int) -> list[memoryview]:
        """Writable views of CPU memory covering ``[offset, offset + length)`` (no copy).

        Raises:
            InvalidArgument: the range is outside the shard, or covers CUDA memory (use
                :meth:`copy_out` / :meth:`copy_in` and a staging buffer for those).
        """
        out: list[memoryview] = []
        for seg in self.segments(offset, length):
            if not self._cpu_views(seg, out):
                raise InvalidArgument(f"{self._describe(seg.index)} is on CUDA; stage it")
        return out

    def spans(self, offset: int, length: int) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of the CPU memory covering ``[offset, offset + length)``, in
        order (an in-place pack gives one span per tiny tensor it crosses).

        Raises:
            InvalidArgument: the range is outside the shard, or covers CUDA memory.
        """
        out: list[tuple[int, int]] = []
        for seg in self.segments(offset, length):
            parts = self._parts.get(seg.index)
            if parts is not None:
                for k, lo, hi in parts.cut(seg.start, seg.length):
                    out.append((parts.addresses[k] + lo, hi - lo))
                continue
            t = self.regions[seg.index]
            assert t is not None
            if t.device.type != "cpu":
                raise InvalidArgument(f"{self._describe(seg.index)} is on CUDA; stage it")
            out.append((t.data_ptr() + seg.start, seg.length))
        return out

    def _cpu_views(self, seg: Segment, out: list[memoryview]) -> bool:
        """Append views of ``seg``'s bytes to ``out``; False (nothing appended) if they are in
        CUDA memory."""
        parts = self._parts.get(seg.index)
        if parts is not None:
            out.extend(parts.views[k][lo:hi] for k, lo, hi in parts.cut(seg.start, seg.length))
            return True
        v = self._views[seg.index]
        if v is None:
            return False
        out.append(v[seg.start : seg.start + seg.length])
        return True

    def _describe(self, region: int) -> str:
        r = self.plan.regions[region]
        return f"tensor {self.layout.tensors[r.tensor].name!r}" if r.tensor is not None else f"pack {region}"

    def region_bytes(self, seg: Segment) -> torch.Tensor:
        """Segment ``seg``'s bytes in its region's buffer: a flat uint8 tensor (no copy; not for
        an in-place pack)."""
        return self.flat(seg.index)[seg.start : seg.start + seg.length]

    def gpu_bytes(self, seg: Segment) -> torch.Tensor | None:
        """Segment ``seg``'s bytes if they are in GPU memory (as :meth:`region_bytes`), else None."""
        t = self.regions[seg.index]
        return None if t is None or t.device.type != "cuda" else self.region_bytes(seg)

    def flat(self, region: int) -> torch.Tensor:
        """Region ``region``'s buffer as a flat uint8 tensor (no copy; not for an in-place pack)."""
        return self.region_tensor(region).reshape(-1).view(torch.uint8)

    def region_tensor(self, region: int) -> torch.Tensor:
        """Region ``region``'s buffer as it is (the caller's tensor or a pack buffer).

        Raises:
            InvalidArgument: the region is a pack kept in place, which has no buffer.
        """
        t = self.regions[region]
        if t is None:
            raise InvalidArgument(f"region {region} is a pack kept in place: it has no buffer of its own")
        return t

    def copy_out(self, offset: int, dest: memoryview) -> None:
        """Copy transfer bytes starting at ``offset`` into ``dest`` (used for CUDA staging)."""
        pos = 0
        for seg in self.segments(offset, len(dest)):
            views: list[memoryview] = []
            if self._cpu_views(seg, views):
                for v in views:
                    dest[pos : pos + len(v)] = v
                    pos += len(v)
                continue
            staged = torch.frombuffer(dest[pos : pos + seg.length], dtype=torch.uint8)
            staged.copy_(self.region_bytes(seg))
            pos += seg.length

    def copy_in(self, offset: int, src: memoryview) -> None:
        """Copy ``src`` into transfer bytes starting at ``offset`` (used for CUDA staging)."""
        pos = 0
        for seg in self.segments(offset, len(src)):
            views: list[memoryview] = []
            if self._cpu_views(seg, views):
                for v in views:
                    v[:] = src[pos : pos + len(v)]
                    pos += len(v)
                continue
            flat = self.region_bytes(seg)
            piece = src[pos : pos + seg.length]
            if piece.readonly:  # torch warns of (and would allow writes to) a read-only buffer
                piece = memoryview(bytearray(piece))
            flat.copy_(torch.frombuffer(piece, dtype=torch.uint8))
            pos += seg.length
        if self.on_cuda:
            torch.cuda.synchronize()

    def copy_in_async(self, offset: int, src: torch.Tensor, stream: Any) -> None:
        """Enqueue the copy of pinned CPU bytes ``src`` (a flat uint8 tensor) into transfer bytes
        from ``offset`` on CUDA ``stream``; CPU segments are copied at once. The caller keeps
        ``src`` unchanged until the stream has done it (:class:`Staging`)."""
        pos = 0
        for seg in self.segments(offset, src.numel()):
            views: list[memoryview] = []
            if self._cpu_views(seg, views):
                piece = memory_of(src[pos : pos + seg.length])
                for v in views:
                    v[:] = piece[: len(v)]
                    piece = piece[len(v) :]
                pos += seg.length
                continue
            dst = self.region_bytes(seg)
            with torch.cuda.stream(stream):  # another GPU's memory than the stream's: a copy that waits
                dst.copy_(src[pos : pos + seg.length], non_blocking=dst.device == stream.device)
            pos += seg.length

    def copy_out_async(self, offset: int, dest: torch.Tensor, stream: Any) -> None:
        """Enqueue the copy of transfer bytes from ``offset`` into pinned CPU ``dest`` (a flat
        uint8 tensor) on CUDA ``stream``; CPU segments are copied at once."""
        pos = 0
        for seg in self.segments(offset, dest.numel()):
            views: list[memoryview] = []
            if self._cpu_views(seg, views):
                piece = memory_of(dest[pos : pos + seg.length])
                for v in views:
                    piece[: len(v)] = v
                    piece = piece[len(v) :]
                pos += seg.length
                continue
            src = self.region_bytes(seg)
            with torch.cuda.stream(stream):  # another GPU's memory than the stream's: a copy that waits
                dest[pos : pos + seg.length].copy_(src, non_blocking=src.device == stream.device)
            pos += seg.length

    def _members(self) -> dict[int, tuple[Any, Any]]:
        """For every packed tensor with bytes, by layout index: ``(its bytes, its slice of the
        pack)``, as memoryviews when both are in CPU memory (a plain memcpy, no torch dispatch
        per tiny tensor), else as flat uint8 tensors. Built once."""
        got = self._member_views
        if got is not None:
            return got
        got = {}
        for k, r in enumerate(self.plan.regions):
            if r.tensor is not None or self.regions[k] is None:  # a large tensor, or in place
                continue
            pack = self.flat(k)
            pv = self._views[k]
            for i, off in r.members:
                t = self.tensors[i]
                n = self.layout.tensors[i].nbytes
                if not n:
                    continue
                if pv is not None and t.device.type == "cpu":
                    got[i] = (memory_of(t), pv[off : off + n])
                else:
                    got[i] = (t.reshape(-1).view(torch.uint8), pack[off : off + n])
        self._member_views = got
        return got

    def pack(self) -> None:
        """Copy the tiny tensors into their packs (before the buffers are served)."""
        if not self.tensors:
            return
        for t, slot in self._members().values():
            if isinstance(slot, memoryview):
                slot[:] = t
            else:
                slot.copy_(t)
        if self.on_cuda:
            torch.cuda.synchronize()

    def unpack(self, tensors: Iterable[int] | None = None) -> None:
        """Copy packs out into the tiny tensors (after a pull landed them): those with layout
        indices ``tensors`` (the others are skipped), or all."""
        if not self.tensors:
            return
        members = self._members()
        picked = members.values() if tensors is None else [members[i] for i in tensors if i in members]
        for t, slot in picked:
            if isinstance(t, memoryview):
                t[:] = slot
            else:
                t.copy_(slot)
        if self.on_cuda:
            torch.cuda.synchronize()

    def clone_cpu(self) -> ShardBuffers:
        """A CPU copy of these buffers' transfer space (an offload copy: it only serves). Copies
        of CUDA memory go to pinned memory (faster to fill, and what a NIC or a CUDA copy
        reads best)."""
        copies = []
        for k, t in enumerate(self.regions):
            if t is None:  # an in-place pack: the copy is a pack buffer
                pack = torch.empty(self.plan.regions[k].nbytes, dtype=torch.uint8)
                self.copy_out(self.plan.regions[k].offset, memory_of(pack))
                copies.append(pack)
                continue
            flat = t.detach().reshape(-1).view(torch.uint8)
            if flat.device.type == "cuda":
                pinned = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
                pinned.copy_(flat)
                copies.append(pinned)
            else:
                copies.append(flat.to("cpu", copy=True))
        if self.on_cuda:
            torch.cuda.synchronize()
        return ShardBuffers({}, self.layout, regions=copies)


class Staging(threading.local):
    """GPU memory through pinned CPU buffers, with the copies overlapped with the socket.

    Per thread: two pinned buffers of ``piece`` bytes, a CUDA stream of the buffers' (first) GPU
    and an event per buffer (memory of another GPU, in a shard that spans two, is copied by
    copies that wait).
    :meth:`into` fills one buffer (``fill``: a socket's ``recv_into``) while the other one's
    host-to-device copy runs; :meth:`out_of` sends one (``drain``) while the device-to-host
    copy of the next piece runs. A buffer is reused only after its last copy finished, and both
    return only once every copy they enqueued has finished, so the bytes are in place (or sent)
    when they return and no copy outlives the call.
    """

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._stream: Any = None

    def _ready(self, buffers: ShardBuffers, piece: int) -> None:
        if not self._bufs or self._bufs[0].numel() < piece:
            self._bufs = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        device = buffers.cuda_device
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
            self._events = [torch.cuda.Event(), torch.cuda.Event()]

    def into(self, buffers: ShardBuffers, offset: int, length: int, piece: int, fill: Any) -> None:
        """Transfer bytes ``[offset, offset + length)`` of ``buffers`` from ``fill(view)`` calls
        (each fills a memoryview of the next piece, in order)."""
        self._ready(buffers, piece)
        pos, k = 0, 0
        try:
            while pos < length:
                n = min(piece, length - pos)
                buf, done = self._bufs[k % 2], self._events[k % 2]
                done.synchronize()  # its previous host-to-device copy has read it
                fill(memory_of(buf)[:n])
                buffers.copy_in_async(offset + pos, buf[:n], self._stream)
                done.record(self._stream)
                pos, k = pos + n, k + 1
        finally:
            self._stream.synchronize()

    def out_of(self, buffers: ShardBuffers, offset: int, length: int, piece: int, drain: Any) -> None:
        """Transfer bytes ``[offset, offset + length)`` of ``buffers`` to ``drain(view)`` calls,
        piece by piece in order."""
        self._ready(buffers, piece)
        cuts = [(pos, min(piece, length - pos)) for pos in range(0, length, piece)]
        try:
            if cuts:
                buffers.copy_out_async(offset, self._bufs[0][: cuts[0][1]], self._stream)
                self._events[0].record(self._stream)
            for k, (pos, n) in enumerate(cuts):
                if k + 1 < len(cuts):  # the next piece comes down while this one is sent
                    npos, nn = cuts[k + 1]
                    nxt = (k + 1) % 2
                    buffers.copy_out_async(offset + npos, self._bufs[nxt][:nn], self._stream)
                    self._events[nxt].record(self._stream)
                self._events[k % 2].synchronize()
                drain(memory_of(self._bufs[k % 2])[:n])
        finally:
            self._stream.synchronize()
