"""``local``: a holder on the same host, read with one copy and no network stack.

Theory of operation
-------------------
A holder's memory is read straight out of its process: ``process_vm_readv(2)`` for CPU memory
(the kernel copies from the holder's pages into the reader's, once), CUDA IPC handles for GPU
memory (a device-to-device copy over NVLink or PCIe). The holder's CPU takes part once per
``(region, version)`` a reader pulls, to *describe* its memory over the side channel
(:mod:`tensorhub.transports.sidechannel`); every read after that is one-sided.

Holder side. :meth:`LocalTransport.start` starts a :class:`~tensorhub.transports.sidechannel.SideServer`
(on ``host``, default 127.0.0.1: its readers are on this host, in this network namespace, which
``reaches`` checks) with one inline op, ``describe {region, version, token}``: it admits the
reader's grant token (``checks_grants``; a describe without a valid one is refused with
``unauthorized`` and hands out no memory description), then resolves the pair through the
engine's resolver and answers ``{"pid", "tag", "words", "regions"}``: the
tag and address of the holding's progress words (:mod:`tensorhub.transports.buffers`), and for each region
of the packing plan, in plan order, ``[address, nbytes, "cpu" | "cuda" | "parts", device index,
extra]``. ``extra`` is None for CPU memory, or, for a region the holder keeps in shared memory
(``ShardBuffers.shared_file``: registered with ``shared_memory=True``), ``{"fd", "dev", "ino",
"offset", "size"}``: its open descriptor of the shared-memory file, the file's device and inode
when it was shared, the region's offset in it and the file's size; for a CUDA region, ``ipc``: the fields of torch's
``_share_cuda_()`` as bytes and integers, the tensor's byte offset in its storage and the GPU's
UUID; for a pack the holder keeps in place (``ShardBuffers.parts``), the ``[address, nbytes]``
of each tiny tensor in pack order (address 0: the region is scattered). It refuses with
``unauthorized``, ``unknown`` (no such holding), ``not_exposed`` (buffers not exposed here) or
``closed``. (The token keeps the description from processes the server did not grant; a process
of the same user that may ptrace the holder could read its memory anyway.)
:meth:`~LocalTransport.withdraw` forgets the buffers and retags their progress words;
:meth:`~LocalTransport.close` retags every exposed buffer and closes the side server. The
holder also calls ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`` once, so that hosts with Yama
``ptrace_scope=1`` let its same-user readers use ``process_vm_readv`` (this widens who may read
the process, to every process of the same user; ``ptrace_scope`` 2 or 3 still refuse).

Reader side. A read of ``[offset, offset + length)`` of ``(region, version)``, in one of the
transport's threads (never on the event loop):

1. describes ``(region, version)`` once per (peer side-channel address, region, version) and
   caches the description (a bounded LRU; a newer version of the same region evicts the older).
   Any failure other than :class:`RangeNotReady` drops the entry, so the next read describes
   again. The described region sizes must equal ``into``'s plan, and the range must be inside
   the shard -> :class:`TransportError` otherwise;
2. reads the holder's 32 bytes of progress words with ``process_vm_readv``: the tag must be
   the described one (else the buffers were withdrawn or replaced), the generation the caller's
   (if given); it polls, with short sleeps growing to 1 ms (or, once the holding's verified
   bytes were seen to grow, most of the time their rate says the range needs, up to 10 ms) and
   at most ``wait_timeout``, until
   the words hold ``version`` with ``verified >= offset + length`` (seen twice alike: a look
   that raced the holder's stores could show words that never held together). Not covered in time ->
   :class:`RangeNotReady`; the generation moved, or the holder held the version and stopped ->
   :class:`TransportError`;
3. copies the range from the described addresses into ``into``'s memory. The layouts are
   equal, so ``into.segments(offset, length)`` cuts both sides alike (a segment's region index
   and start locate the source); a pack kept in place on either side is cut further along its
   tiny tensors, on each side independently (``process_vm_readv`` takes separate local and
   remote iovec lists, so the holder's parts and the reader's need not line up). Pieces of ``piece_bytes`` are copied one after another, with a
   check for a close (of this transport) between pieces; a range larger than 4 MiB is cut into
   parts of about 4 MiB (a big tensor at its start and every 4 MiB of it, where its checksum
   units begin: a part is then one whole unit, hashed through the engine's stream of that unit,
   ``unit_stream``, one update per piece) queued on the transport's ``threads`` copy workers, which every read in flight
   shares (so they stay busy while one read's completion travels through the event loop, and
   never run more copies at once than there are workers); the read's thread waits once for
   all its parts. After each piece that landed in CPU memory the caller's ``landed`` callback,
   if any, hashes it while it is in the copying core's cache (1 MiB pieces by default: a 4 MiB
   piece has left a 512 KiB L2 by the time it is hashed). CPU -> CPU works out a part's
   spans on both sides once, then makes one ``process_vm_readv`` per piece (looping over
   partial transfers and ``IOV_MAX``; one span each side, the usual piece, goes through one
   iovec per side made once per thread); from a holder in this very process (an engine
   beside its trainer) it copies each piece with ``memmove`` out of the buffers the holder
   described, which the copy holds meanwhile (no system call, no page pinning:
   ``process_vm_readv`` of one's own memory cost about 1.5x a ``memmove`` of it,
   ``benchmarks/bench_pull_copy.py``). The engine plans a pull through this transport
   in reads of ``read_bytes`` (32 MiB) unless a chunk size was configured: each read costs a round
   trip through the engine's event loop, which the copy workers, cutting it into parts, do not
   need. CUDA sources are copied by torch from the opened IPC
   memory; a CPU source into CUDA memory is staged through a CPU buffer and ``copy_in``;
4. reads the words again (a seqlock): the tag and generation must be unchanged, the version
   still held and ``verified`` still covering the range -> :class:`TransportError` otherwise.
   It returns the generation.

Shared memory. A region described with shared-memory fields is read from the holder's file
instead of its address space: at describe time the reader opens ``/proc/<pid>/fd/<fd>`` (the
same permission ``process_vm_readv`` needs: ptrace read access to the holder), refuses it unless
its device and inode are the described ones (the descriptor number may name another file since),
maps the whole file read-only with ``MAP_POPULATE`` (``_Mapping``), closes the descriptor, and
copies each piece out of the mapping with ``memmove``, exactly as from a holder in this process:
no system call per piece and no page pinning. The progress words, the seqlock and the landing
hash are unchanged, so a byte the holder changed meanwhile is refused as from any other source.
One mapping per (pid, device, inode), shared by the descriptions that name the file and so kept
across versions (a trainer keeps its storages every step); it is dropped (unmapped once no read
copies out of it) when no cached description holds it any more: a withdraw or tag change seen
by a read, a newer version described with other files, an eviction, a close. A mapping keeps
the holder's file alive while it lasts, as a CUDA IPC handle keeps a block. A region that cannot
be mapped (no such descriptor, not permitted, another file, too small, ``mmap`` failed) is read
with ``process_vm_readv``: logged once per cause and counted (:meth:`LocalTransport.stats`).
Tiny tensors of an in-place pack stay in the holder's heap (``process_vm_readv``).

Invariants: a read returns normally only when every byte of its range was written from memory
that held ``version`` under one generation, with the range covered before and after the copy.
Every error names the peer (its side-channel address and pid), region, version and range. The
words live in a never-freed arena, so reading them never faults; a holder that died gives
``ESRCH`` and memory that was unmapped gives ``EFAULT``, both a :class:`TransportError`.

What it must never do: block the event loop, wait without a bound, unpickle anything (the
description is plain msgpack data), trust a description without checking its types, or read
the memory of a process that is not on this host (the endpoint carries the boot id and PID
namespace; :meth:`LocalTransport.reaches` compares them, and a pid from another namespace
would name another process).

CUDA. A description asked for by another process carries IPC handles: one ``_share_cuda_()``
per region per describe, which puts the holder's block behind a new reference count, as
``torch.multiprocessing`` does for every tensor it sends. The reader opens each handle with
``UntypedStorage._new_shared_cuda`` (torch's allocator maps a handle once per process and
shares the mapping), keeps the storages with the cached description, and, by letting them go
when the description is dropped or evicted, gives the count back; until then the holder's
allocator keeps the block even if the holder frees the tensor, so a stale reader can never
read reused GPU memory. (As with ``torch.multiprocessing``, a reader that dies without letting
go leaves the block held until the holder exits.) A reader in the holder's own process (the
conformance suite) cannot open its own IPC handles: it asks for none and uses the holder's
tensors themselves. GPUs are matched by UUID, so ``CUDA_VISIBLE_DEVICES`` may differ between the
two processes. A range from GPU memory into GPU memory is copied whole on the reading thread:
a ``copy_`` per region segment on a side stream of that thread, then a wait for that stream
alone (a GPU moves a read, 1 GiB into GPU memory, in about a millisecond, less than handing
parts to workers would cost; and the engine's own kernels on the default stream are not waited for).
Other CUDA copies (a GPU source into an in-place pack, CPU memory into GPU memory, staged
through a CPU buffer) go piece by piece, each followed by a synchronize of the devices
involved. The CPU tests exercise the CPU path; ``benchmarks/gpu_report.py`` runs the GPU path on
a CUDA host (``benchmarks/results/GPU.md``).

Size: one plugin: the holder's side (describe, serve), the reader's copy workers and the
CPU/CUDA copy paths share its per-read state; the CUDA copy paths would split off first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import itertools
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorhub.core.errors import InvalidArgument, TransportError
from tensorhub.core.layout import MAX_TENSORS

from .base import Landed, Probe, RangeNotReady, ReadCall, Transport, Unauthorized
from .buffers import WORD_BYTES, ShardBuffers, cut_parts, read_words
from .sidechannel import SideClient, SideError, SideServer, field

__all__ = ["LocalTransport"]

_OPTIONS = {
    # name: (default, minimum, integer)
    "wait_timeout": (5.0, 0.0, False),
    "describe_timeout": (5.0, 0.001, False),
    "piece_bytes": (1 << 20, 1, True),
    "threads": (min(4, os.cpu_count() or 1), 1, True),
    "streams": (4, 1, True),
    "read_bytes": (32 << 20, 1, True),
}
_KNOWN = sorted([*_OPTIONS, "host"])

_IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux UIO_MAXIOV)
_POLL_FIRST = 50e-6  # seconds: first sleep while waiting for a partial holder's progress
_POLL_MAX = 1e-3  # ... doubling up to this
_PACE_MAX = 10e-3  # ... or, once the holding's rate is known, up to this (``LocalTransport._pause``)
_PACE_SHARE = 0.75  # the share of the time that rate says the range needs that a reader sleeps at once
_PACES_MAX = 256  # holdings whose progress rate a reader keeps
_PART_BYTES = 4 << 20  # a read is queued on the copy workers in parts of this size
_DESCRIBED_MAX = 256  # cached descriptions per reader
_CLOSE_WAIT = 2.0  # seconds close() waits for reads in flight to notice it
#: where a reader opens a holder's shared-memory file (the same permission ``process_vm_readv``
#: needs: ptrace read access to the holder)
_PROC_FD = "/proc/{pid}/fd/{fd}"
_SHARED_FIELDS = ("fd", "dev", "ino", "offset", "size")

_log = logging.getLogger(__name__)

_REFUSALS = {
    "unauthorized": "the peer refused the request: no valid grant token for it",
    "unknown": "the peer does not hold that version under that region",
    "not_exposed": "the peer's buffers for it are not exposed",
    "closed": "the peer closed",
    "malformed": "the peer refused the request as malformed",
}

_HOLDERS: weakref.WeakValueDictionary[str, LocalTransport] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def _option(options: dict[str, Any], name: str) -> Any:
    default, minimum, integer = _OPTIONS[name]
    value = options.get(name, default)
    ok = type(value) is int if integer else type(value) in (int, float)
    if not ok or not math.isfinite(value) or value < minimum:
        want = "an integer" if integer else "a finite number"
        raise InvalidArgument(f"local transport option {name!r} must be {want} >= {minimum}, got {value!r}")
    return value


# ---- the system calls ----------------------------------------------------------------------------


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc: Any = None
_ptracer_set = False
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


def _lib() -> Any:
    """libc, with ``process_vm_readv`` typed (loaded on first use; ctypes drops the GIL in it)."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        fn = lib.process_vm_readv
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = lib
    return _libc


def ptrace_scope(path: str = "/proc/sys/kernel/yama/ptrace_scope") -> int | None:
    """Yama's ``ptrace_scope`` (0 to 3), or None when the kernel has no Yama."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _has_cap_sys_ptrace() -> bool:
    """Whether this process's effective capabilities include ``CAP_SYS_PTRACE`` (bit 19)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 19 & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _allow_readers() -> None:
    """``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`` once per process; failure is ignored (no
    Yama: nothing to allow; a stricter ``ptrace_scope``: readers get EPERM and say so)."""
    global _ptracer_set
    if _ptracer_set:
        return
    _ptracer_set = True
    with contextlib.suppress(Exception):
        _lib().prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)


class _VmError(Exception):
    def __init__(self, err: int) -> None:
        super().__init__(err)
        self.errno = err


def _vm_read(pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
    """Copy the bytes of process ``pid`` at ``remote`` (``(address, n)`` spans, in order) into
    ``local`` (spans of this process with the same total, cut independently), looping over
    partial transfers and ``IOV_MAX``. Raises :class:`_VmError`."""
    readv = _lib().process_vm_readv
    if len(local) == 1 and len(remote) == 1:
        _vm_read_span(readv, pid, local[0][0], remote[0][0], local[0][1])
        return
    li = lo = ri = ro = 0  # each side: the span being copied, and the bytes of it already copied
    while li < len(local):
        liov, ln = _iovecs(local, li, lo)
        riov, rn = _iovecs(remote, ri, ro)
        got = readv(pid, liov, ln, riov, rn, 0)
        if got < 0:
            raise _VmError(ctypes.get_errno())
        if got == 0:
            raise _VmError(errno.EFAULT)  # no progress: the remote memory is not there
        li, lo = _advance(local, li, lo, got)
        ri, ro = _advance(remote, ri, ro, got)


class _SpanIovecs(threading.local):
    """One iovec on each side, made once per thread (one span each side is the common read)."""

    def __init__(self) -> None:
        self.local = _Iovec()
        self.remote = _Iovec()


_span_iovecs = _SpanIovecs()


def _vm_read_span(readv: Any, pid: int, local: int, remote: int, n: int) -> None:
    """:func:`_vm_read` of one span each side, with this thread's iovecs."""
    iov = _span_iovecs
    done = 0
    while done < n:
        iov.local.iov_base, iov.local.iov_len = local + done, n - done
        iov.remote.iov_base, iov.remote.iov_len = remote + done, n - done
        got = readv(pid, ctypes.byref(iov.local), 1, ctypes.byref(iov.remote), 1, 0)
        if got < 0:
            raise _VmError(ctypes.get_errno())
        if got == 0:
            raise _VmError(errno.EFAULT)
        done += got


def _memmove(local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
    """Copy this process's memory at ``remote`` (spans, in order) into ``local`` (spans with the
    same total, cut independently). ``ctypes.memmove`` drops the GIL."""
    if len(local) == 1 and len(remote) == 1:
        ctypes.memmove(local[0][0], remote[0][0], local[0][1])
        return
    li = lo = ri = ro = 0
    while li < len(local):
        (la, ln), (ra, rn) = local[li], remote[ri]
        n = min(ln - lo, rn - ro)
        ctypes.memmove(la + lo, ra + ro, n)
        lo, ro = lo + n, ro + n
        if lo == ln:
            li, lo = li + 1, 0
        if ro == rn:
            ri, ro = ri + 1, 0


def _take(spans: list[tuple[int, int]], k: int, done: int, n: int) -> tuple[list[tuple[int, int]], int, int]:
    """The next ``n`` bytes of ``spans`` from span ``k`` (its first ``done`` bytes already
    taken), as spans; and ``(k, done)`` after them."""
    out = []
    while n:
        address, size = spans[k]
        m = min(n, size - done)
        out.append((address + done, m))
        n -= m
        done += m
        if done == size:
            k, done = k + 1, 0
    return out, k, done


def _iovecs(spans: list[tuple[int, int]], k: int, done: int) -> tuple[ctypes.Array, int]:
    """Up to ``IOV_MAX`` iovecs of ``spans`` from span ``k``, its first ``done`` bytes skipped."""
    batch = spans[k : k + _IOV_MAX]
    iov = (_Iovec * len(batch))()
    for i, (address, n) in enumerate(batch):
        skip = done if i == 0 else 0
        iov[i].iov_base, iov[i].iov_len = address + skip, n - skip
    return iov, len(batch)


def _advance(spans: list[tuple[int, int]], k: int, done: int, got: int) -> tuple[int, int]:
    """``(span, bytes of it done)`` after ``got`` more bytes."""
    done += got
    while k < len(spans) and done >= spans[k][1]:
        done -= spans[k][1]
        k += 1
    return k, done


_PROT_READ, _MAP_SHARED, _MAP_POPULATE = 0x1, 0x01, 0x8000
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """A holder's shared-memory file mapped read-only into this process (whole, with its page
    tables filled at once: ``MAP_POPULATE``). ``users``: reads copying out of it now; ``dead``:
    no cached description holds it any more (it is unmapped when its last user lets go; the
    transport's lock guards both). Unmapped too when collected (a description never cached)."""

    __slots__ = ("address", "size", "key", "users", "dead", "__weakref__")

    def __init__(self, fd: int, size: int, key: tuple[int, int, int]) -> None:
        lib = _lib()
        address = lib.mmap(None, size, _PROT_READ, _MAP_SHARED | _MAP_POPULATE, fd, 0)
        if address is None or address == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap of {size} bytes failed: {os.strerror(ctypes.get_errno())}")
        self.address: int = address
        self.size = size
        self.key = key
        self.users = 0
        self.dead = False

    def unmap(self) -> None:
        address, self.address = getattr(self, "address", 0), 0
        if address:
            _lib().munmap(address, self.size)

    def __del__(self) -> None:
        self.unmap()


def _check_shared(extra: Any, nbytes: int) -> tuple[int, int, int, int, int]:
    """A CPU region's shared-memory fields ``{"fd", "dev", "ino", "offset", "size"}`` (see the
    module docstring), as ``(fd, dev, ino, offset, size)``; ValueError naming the bad field."""
    if type(extra) is not dict:
        raise ValueError(f"its shared-memory fields are {str(extra)[:100]}, not a map")
    unknown = sorted(str(k) for k in extra if k not in _SHARED_FIELDS)
    if unknown:
        raise ValueError(f"its shared-memory fields include unknown {unknown}")
    got = []
    for name in _SHARED_FIELDS:
        value = extra.get(name)
        if type(value) is not int or value < 0 or (name == "size" and value == 0):
            least = "positive" if name == "size" else "non-negative"
            raise ValueError(f"its shared-memory field {name!r} is {value!r}, not a {least} integer")
        got.append(value)
    fd, dev, ino, offset, size = got
    if offset + nbytes > size:
        raise ValueError(f"its shared-memory field 'offset' puts its {nbytes} bytes at {offset}, past the file's {size} bytes")
    return fd, dev, ino, offset, size


def _vm_why(err: _VmError, pid: int) -> str:
    if err.errno == errno.ESRCH:
        return f"the holder process {pid} is gone"
    if err.errno == errno.EFAULT:
        return f"the described memory of process {pid} is not mapped (freed or replaced)"
    if err.errno == errno.EPERM:
        return (
            f"not permitted to read the memory of process {pid} (another user, a container boundary, "
            "or Yama ptrace_scope >= 2)"
        )
    return f"process_vm_readv from process {pid} failed: {os.strerror(err.errno)}"


def _address(buf: bytearray | ctypes.Array) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) if isinstance(buf, bytearray) else ctypes.addressof(buf)


def _netns() -> str:
    """This process's network namespace ("" when unknown)."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def _host_ids() -> tuple[str, str]:
    """``(boot id, PID namespace)`` of this process ("" when unknown: nothing reaches then)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return boot, pidns


# ---- descriptions -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Region:
    address: int
    nbytes: int
    cuda: torch.Tensor | None  # for CUDA memory: a flat uint8 tensor of it, usable here
    # A pack kept in place: each part's address, start in the region and size (None otherwise).
    addresses: tuple[int, ...] | None = None
    starts: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    #: ``address`` is this process's: the holder's shared-memory file mapped here (``memmove``)
    mapped: bool = False

    def spans(self, start: int, length: int) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of the holder's memory holding region bytes ``[start, start +
        length)`` (the range is inside the region)."""
        if self.addresses is None:
            return [(self.address + start, length)]
        return [(self.addresses[k] + lo, hi - lo) for k, lo, hi in cut_parts(self.starts, self.sizes, start, length)]


@dataclass(frozen=True, slots=True, weakref_slot=True)
class _Described:
    """What a holder said about one (region, version), checked."""

    pid: int
    tag: int
    words: int
    regions: tuple[_Region, ...]
    total: int
    cpu: bool = False  # every region is in CPU memory (the copy needs no CUDA)
    sizes: tuple[int, ...] = ()  # each region's bytes, in plan order
    #: a holder in this very process: a weak reference to the buffers it described (CPU memory),
    #: which a copy holds while it memmoves out of them; None: another process (``process_vm_readv``)
    own: weakref.ref[ShardBuffers] | None = None
    #: the holder's shared-memory files this description's mapped regions are in (held: a copy
    #: out of them holds its description)
    maps: tuple[_Mapping, ...] = ()


def _checked_description(reply: dict[str, Any], pid: int) -> tuple[int, int, list[list[Any]]]:
    """``(tag, words address, raw regions)`` of a describe reply, or ValueError saying why not."""
    if reply.get("pid") != pid or type(reply.get("pid")) is not int:
        raise ValueError(f"it describes process {reply.get('pid')!r}, its endpoint says {pid}")
    tag, words, regions = reply.get("tag"), reply.get("words"), reply.get("regions")
    if type(tag) is not int or tag == 0 or type(words) is not int or words <= 0 or type(regions) is not list:
        raise ValueError("the description lacks a tag, a words address or a region list")
    for k, r in enumerate(regions):
        if (
            type(r) is not list
            or len(r) != 5
            or type(r[0]) is not int
            or type(r[1]) is not int
            or r[0] < 0
            or r[1] < 0
            or r[2] not in ("cpu", "cuda", "parts")
            or type(r[3]) is not int
            or not (type(r[4]) is list if r[2] == "parts" else r[4] is None or type(r[4]) is dict)
        ):
            raise ValueError(f"a region is described as {str(r)[:200]}")
        if r[2] == "parts":
            _check_parts(r[4], r[1])
        elif r[2] == "cpu" and r[4] is not None:
            try:
                _check_shared(r[4], r[1])
            except ValueError as err:
                raise ValueError(f"region {k} (CPU memory): {err}") from None
    return tag, words, regions


def _check_parts(parts: list[Any], nbytes: int) -> None:
    """An in-place pack's parts: ``[address, nbytes]`` pairs, each non-empty, adding up to the
    region's size. ValueError otherwise."""
    if len(parts) > MAX_TENSORS:
        raise ValueError(f"a pack is described as {len(parts)} parts (at most {MAX_TENSORS})")
    total = 0
    for p in parts:
        if type(p) is not list or len(p) != 2 or type(p[0]) is not int or type(p[1]) is not int or p[0] <= 0 or p[1] <= 0:
            raise ValueError(f"a pack's part is described as {str(p)[:100]}")
        total += p[1]
    if total != nbytes:
        raise ValueError(f"a pack's parts add up to {total} bytes, not its {nbytes}")


#: Types of the ``_share_cuda_()`` fields (what ``_new_shared_cuda`` takes back): device,
#: handle, storage bytes, storage offset in its block, ref counter file, ref counter offset,
#: event handle, event sync required.
_IPC_TYPES = (int, bytes, int, int, bytes, int, bytes, bool)


def _open_ipc(ipc: dict[str, Any], nbytes: int) -> torch.Tensor:
    """The CUDA memory another process shared (``_share_cuda_()`` fields), as a flat uint8
    tensor of ``nbytes`` here. Untested on a GPU (see the module docstring)."""
    fields = ipc.get("fields")
    offset = ipc.get("offset")
    if (
        type(fields) is not list
        or len(fields) != len(_IPC_TYPES)
        or any(type(v) is not t for v, t in zip(fields, _IPC_TYPES))
        or type(offset) is not int
        or offset < 0
    ):
        raise ValueError("malformed CUDA IPC fields")
    device = _local_device(ipc.get("uuid"), fields[0])
    storage = torch.UntypedStorage._new_shared_cuda(device, *fields[1:])
    if offset + nbytes > storage.nbytes():
        raise ValueError(f"CUDA region of {nbytes} bytes at {offset} overruns its {storage.nbytes()}-byte storage")
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage, offset, (nbytes,), (1,))


def _device_uuid(index: int) -> str | None:
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if uuid is None else str(uuid)


def _local_device(uuid: Any, index: int) -> int:
    """This process's index of the GPU with ``uuid`` (``index`` when no UUID is given)."""
    if not torch.cuda.is_available():
        raise ValueError("the holder's region is CUDA memory and this process has no CUDA device")
    if not isinstance(uuid, str):
        return index
    for i in range(torch.cuda.device_count()):
        if _device_uuid(i) == uuid:
            return i
    raise ValueError(f"the holder's GPU {uuid} is not visible to this process")


# ---- the transport ------------------------------------------------------------------------------


class LocalTransport(Transport):
    """Same-host transport: ``process_vm_readv`` for CPU memory (``memmove`` out of a holder's
    shared-memory files, or out of a holder in this process), CUDA IPC for GPU memory.

    Options: ``host`` (the side channel's interface, default "127.0.0.1"), ``wait_timeout``
    (seconds a read waits for a partial holder's progress, default 5), ``describe_timeout``
    (seconds a describe may take, default 5), ``piece_bytes`` (bytes copied between two checks
    for a close, and hashed at once when the engine verifies on landing, default 1 MiB: small
    enough to be hashed from the copying core's L2 cache), ``threads`` (copy workers shared by
    the reads in flight, default the CPU count up to 4), ``streams`` (reads of one pull the
    engine runs at once, default 4), ``read_bytes`` (the size of the reads a pull from a holder
    through this transport is planned with, default 32 MiB: each read costs the engine a round
    trip through its event loop, and the copy workers cut it into parts anyway).

    Only exposed buffers are described; withdrawing them (or closing) retags their progress
    words, so that readers holding a description fail and describe again.

    Raises:
        InvalidArgument: an unknown option, or a bad value.
    """

    name = "local"
    one_sided = True
    cuda = True
    cross_host = False
    reports_landing = True
    gathers = True
    checks_grants = True
    streams: int = 4
    read_bytes: int = 32 << 20

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        unknown = sorted(str(k) for k in self.options if k not in _KNOWN)
        if unknown:
            raise InvalidArgument(f"unknown local transport options {unknown}; known: {_KNOWN}")
        host = self.options.get("host", "127.0.0.1")
        if type(host) is not str or not host:
            raise InvalidArgument(f"local transport option 'host' must be a non-empty string, got {host!r}")
        self.host = host
        self.wait_timeout = float(_option(self.options, "wait_timeout"))
        self.describe_timeout = float(_option(self.options, "describe_timeout"))
        self.piece_bytes = int(_option(self.options, "piece_bytes"))
        self.threads = int(_option(self.options, "threads"))
        self.streams = int(_option(self.options, "streams"))
        self.read_bytes = int(_option(self.options, "read_bytes"))
        self.id = f"local-{os.getpid()}-{next(_IDS)}"
        self._lock = threading.Lock()
        self._exposed: dict[int, ShardBuffers] = {}
        self._side: SideServer | None = None
        self._client = SideClient(self.id)
        self._described: OrderedDict[tuple[str, int, int], _Described] = OrderedDict()
        #: (pid, words, tag, version, generation) -> (when ``verified`` last grew, its value then,
        #: bytes per second between the last two growths or None): partial holdings' pace
        self._paces: OrderedDict[tuple[int, int, int, int, int], tuple[float, int, float | None]] = OrderedDict()
        self._describing: dict[tuple[str, int, int], threading.Lock] = {}
        self._reads = ThreadPoolExecutor(max_workers=max(8, 2 * self.streams), thread_name_prefix="local-read")
        self._helpers = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="local-copy") if self.threads > 1 else None
        self._tls = threading.local()
        #: destination -> the description its layout was last matched with (weakly: a description
        #: holds the holder's shared-memory mappings, which go when it is dropped)
        self._matched: weakref.WeakKeyDictionary[ShardBuffers, weakref.ref[_Described]] = weakref.WeakKeyDictionary()
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._boot_id, self._pidns = _host_ids()
        self._netns = _netns()
        #: (pid, st_dev, st_ino) -> a holder's shared-memory file mapped here, while a cached
        #: description or a copy holds it (so kept across the versions of a region)
        self._maps: weakref.WeakValueDictionary[tuple[int, int, int], _Mapping] = weakref.WeakValueDictionary()
        self._counts = {"shared_mapped": 0, "shared_fallbacks": 0, "shared_other_file": 0}
        self._warned: set[str] = set()

    @classmethod
    def available(cls) -> bool:
        """Linux with ``process_vm_readv`` in libc."""
        if not sys.platform.startswith("linux"):
            return False
        try:
            return _lib() is not None
        except (OSError, AttributeError):  # no libc to load, or one without process_vm_readv
            return False

    @classmethod
    def probe(cls) -> Probe:
        """Usable (and a default) on Linux when ``process_vm_readv`` exists, is not filtered
        (a read of this process's own memory succeeds: container seccomp profiles refuse it
        without ``CAP_SYS_PTRACE``) and Yama lets a same-user reader attach (``ptrace_scope``
        0 or 1; 2 only with ``CAP_SYS_PTRACE``; 3 never)."""
        facts: list[tuple[str, str]] = [("platform", sys.platform)]
        if not cls.available():
            return Probe(False, False, "needs Linux and process_vm_readv in libc", tuple(facts))
        facts.append(("process_vm_readv", "in libc"))
        src, dst = ctypes.create_string_buffer(b"tensorhub", 16), ctypes.create_string_buffer(16)
        try:
            _vm_read(os.getpid(), [(ctypes.addressof(dst), 16)], [(ctypes.addressof(src), 16)])
        except _VmError as err:
            facts.append(("self read", os.strerror(err.errno)))
            return Probe(False, False, f"process_vm_readv is refused here ({os.strerror(err.errno)}: a seccomp "
                         "filter, e.g. a container without CAP_SYS_PTRACE)", tuple(facts))  # fmt: skip
        facts.append(("self read", "ok" if dst.raw == src.raw else "wrong bytes"))
        scope, cap = ptrace_scope(), _has_cap_sys_ptrace()
        facts.append(("yama ptrace_scope", "absent (no Yama)" if scope is None else str(scope)))
        facts.append(("CAP_SYS_PTRACE", "yes" if cap else "no"))
        if scope == 3 or (scope == 2 and not cap):
            why = "3 forbids it" if scope == 3 else "2 needs CAP_SYS_PTRACE, which this process lacks"
            return Probe(False, False, f"Yama ptrace_scope {scope}: reading another process's memory is refused ({why})", tuple(facts))
        note = "; holders allow same-user readers (PR_SET_PTRACER)" if scope == 1 else ""
        return Probe(True, True, f"same-host reads with one copy (process_vm_readv){note}", tuple(facts))

    def stats(self) -> dict[str, int]:
        """Counters of the reader's shared-memory path: ``shared_mapped`` (holders' files mapped
        here), ``shared_fallbacks`` (regions described in shared memory that were read with
        ``process_vm_readv`` instead: the file could not be opened, was another file, or could
        not be mapped), ``shared_other_file`` (of those, the descriptor named another file than
        the one described: a descriptor number reused), ``shared_maps_held`` (mappings held now)."""
        with self._lock:
            return {**self._counts, "shared_maps_held": len(self._maps)}

    # ---- both sides ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the side channel (peers can describe this process's buffers from now on).

        Raises:
            TransportError: it was closed, or the side channel cannot bind.
        """
        if self._closed:
            raise TransportError(f"local transport {self.id} is closed; it cannot start again")
        if self._side is not None:
            return
        _allow_readers()
        self._side = SideServer(self.id, {"describe": (self._on_describe, True)}, self.host)
        _HOLDERS[self._side.address] = self

    def endpoint(self) -> dict[str, Any]:
        """``{"side", "pid", "boot_id", "pidns", "netns"}``: plain msgpack data.

        Raises:
            TransportError: not started.
        """
        if self._side is None:
            raise TransportError(f"local transport {self.id} has no endpoint before start()")
        return {"side": self._side.address, "pid": os.getpid(), "boot_id": self._boot_id, "pidns": self._pidns,
                "netns": self._netns}  # fmt: skip

    def reaches(self, peer: dict[str, Any]) -> bool:
        """Whether ``peer`` (an endpoint of this transport) is on this host and in this PID
        namespace, so that its pid names the process it says, and in this network namespace, so
        that its side channel's loopback address is ours (containers, emulated hosts)."""
        if not isinstance(peer, dict) or not self._boot_id or not self._pidns:
            return False
        return peer.get("boot_id") == self._boot_id and peer.get("pidns") == self._pidns and peer.get("netns", self._netns) == self._netns

    def expose(self, buffers: ShardBuffers) -> None:
        with self._lock:
            self._exposed[id(buffers)] = buffers

    def withdraw(self, buffers: ShardBuffers) -> None:
        """Forget ``buffers`` and retag their words: readers holding a description fail."""
        with self._lock:
            if self._exposed.get(id(buffers)) is buffers:
                del self._exposed[id(buffers)]
        buffers.progress.retag()

    async def close(self) -> None:
        """Stop describing, retag every exposed buffer (readers of them fail), fail this side's
        reads in flight (they notice between pieces, wait slices and side-channel slices). A
        second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            exposed = list(self._exposed.values())
            self._exposed.clear()
            dropped = list(self._described.values())
            self._described.clear()
            self._dropped(dropped)
        for buf in exposed:
            buf.progress.retag()
        side = self._side
        if side is not None and _HOLDERS.get(side.address) is self:
            with contextlib.suppress(KeyError):
                del _HOLDERS[side.address]
        # Reads queued behind the running ones start, see the transport closed, and fail.
        self._reads.shutdown(wait=False)
        if self._helpers is not None:
            self._helpers.shutdown(wait=False)
        await asyncio.get_running_loop().run_in_executor(None, self._close_blocking, side)

    def _close_blocking(self, side: SideServer | None) -> None:
        if side is not None:
            side.close()
        # The side client's sockets belong to the read threads: let them notice the close first.
        deadline = time.monotonic() + _CLOSE_WAIT
        with self._idle:
            while self._inflight and time.monotonic() < deadline:
                self._idle.wait(0.05)
        self._client.close()

    # ---- holder side ---------------------------------------------------------------------------

    def _on_describe(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The ``describe`` op (inline on the side server's thread: no waiting here)."""
        region = field(msg, "region", int)
        version = field(msg, "version", int, 0)
        share = msg.get("ipc") is True
        refused = self.admit(region, version, msg.get("token"), msg.get("_from", ""))
        if refused is not None:
            raise SideError("unauthorized", refused)
        if self._closed:
            raise SideError("closed", f"local transport {self.id} closed")
        try:
            buf = self.resolve(region, version)
        except Exception as err:  # noqa: BLE001 - the resolver's failure is this request's
            raise SideError("internal", f"the resolver raised {type(err).__name__}: {err}") from None
        if buf is None:
            raise SideError("unknown", f"no holding of version {version} under region {region}")
        with self._lock:
            if self._exposed.get(id(buf)) is not buf:
                raise SideError("not_exposed", f"the buffers of region {region} version {version} are not exposed")
        tag = buf.progress.tag  # first: a withdraw from now on makes the reader's first look fail
        return {
            "pid": os.getpid(),
            "tag": tag,
            "words": buf.progress.words_address,
            "regions": [_describe_region(buf, k, share) for k in range(len(buf.regions))],
        }

    # ---- reader side ---------------------------------------------------------------------------

    def describe_read(self, peer: Any, region: int, version: int, offset: int, length: int) -> str:
        span = f"region {region} version {version} bytes [{offset}, {offset + length})"
        side = peer.get("side") if isinstance(peer, dict) else None
        pid = peer.get("pid") if isinstance(peer, dict) else None
        return f"local peer {side} (pid {pid}) {span}"

    def check_read(self, peer: Any, where: str, offset: int, length: int, token: bytes | None) -> tuple[str, int]:
        side = peer.get("side") if isinstance(peer, dict) else None
        pid = peer.get("pid") if isinstance(peer, dict) else None
        if type(side) is not str or not side or type(pid) is not int or pid <= 0:
            raise TransportError(f"local endpoint {peer!r} lacks a side-channel address or a pid (reading {where})")
        return side, pid

    def read_executor(self) -> ThreadPoolExecutor:
        return self._reads

    def read_blocking(self, call: ReadCall) -> int:
        """Copy ``[offset, offset + length)`` of ``version`` from the peer into ``into``; see the
        module docstring for the steps. ``call.landed(offset, length)`` is called from this
        thread after each piece copied into CPU memory (the engine hashes it while it is hot).
        The grant's token goes with the describe.

        Returns:
            The holder's generation the bytes were read under.

        Raises:
            RangeNotReady: the holder's progress did not cover the range within the wait.
            TransportError: anything else that kept the read from completing (it names the
                peer, region, version and range).
        """
        side, pid = call.peer
        return self._read_blocking(side, pid, call.where, call.region, call.version, call.offset, call.length, call.into,
                                   call.generation, call.landed, call.token)  # fmt: skip

    def _read_blocking(
        self,
        side: str,
        pid: int,
        where: str,
        region: int,
        version: int,
        offset: int,
        length: int,
        into: ShardBuffers,
        generation: int | None,
        landed: Landed | None = None,
        token: bytes | None = None,
    ) -> int:
        with self._idle:
            self._inflight += 1
        key = (side, region, version)
        desc: _Described | None = None
        try:
            self._check_open(where)
            desc = self._description(key, pid, where, token)
            if offset < 0 or length < 0 or offset + length > desc.total:
                raise TransportError(f"read of {where}: the range is outside the shard's {desc.total} bytes")
            self._match(desc, into, where)
            end = offset + length
            gen = self._wait(desc, version, end, generation, where)
            if length:
                self._copy(desc, into, offset, length, where, landed)
            self._seqlock(desc, version, end, gen, where)
            return gen
        except RangeNotReady:
            raise  # the holder is fine, only behind: keep its description
        except TransportError:
            self._forget(key, desc)
            raise
        except Exception as err:  # a CUDA copy's or a bug's failure is this read's
            self._forget(key, desc)
            raise TransportError(f"read of {where}: {type(err).__name__}: {err}") from err
        finally:
            if desc is not None:
                self._let_go(desc)
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    def _check_open(self, where: str) -> None:
        if self._closed:
            raise TransportError(f"local transport {self.id} closed during the read of {where}")

    def _description(self, key: tuple[str, int, int], pid: int, where: str, token: bytes | None = None) -> _Described:
        """The cached description of ``key``, or a new one (one describe at a time per key)."""
        with self._lock:
            desc = self._described.get(key)
            if desc is not None and desc.pid == pid and self._hold(desc):
                self._described.move_to_end(key)
                return desc
            gate = self._describing.setdefault(key, threading.Lock())
        with gate:
            with self._lock:
                desc = self._described.get(key)
                if desc is not None and desc.pid == pid and self._hold(desc):
                    return desc
            try:
                desc = self._describe(key, pid, where, token)
            finally:
                with self._lock:
                    self._describing.pop(key, None)
        with self._lock:
            if self._closed:
                raise TransportError(f"local transport {self.id} closed during the read of {where}")
            if not self._hold(desc):  # a mapping it reused was dropped meanwhile (a race; rare)
                raise TransportError(f"read of {where}: the holder's shared memory was unmapped during its describe; read again")
            side, region, version = key
            dropped = [self._described.pop(k) for k in [k for k in self._described if k[:2] == (side, region) and k[2] != version]]
            old = self._described.pop(key, None)  # the region moved on to another version, or described again
            self._described[key] = desc
            while len(self._described) > _DESCRIBED_MAX:
                dropped.append(self._described.popitem(last=False)[1])
            self._dropped([*dropped, *([old] if old is not None else [])])
        return desc

    def _forget(self, key: tuple[str, int, int], desc: _Described | None) -> None:
        with self._lock:
            if desc is not None and self._described.get(key) is desc:
                del self._described[key]
                self._dropped([desc])

    # The holder's shared-memory files mapped here live while a cached description holds them
    # (across versions: a trainer keeps its storage), and are unmapped once none does and no
    # read copies out of them: so a withdrawn or replaced holder's files are let go at once (not
    # when an exception's traceback that holds the description is collected).

    def _hold(self, desc: _Described) -> bool:
        """A read copies out of ``desc``'s mappings from now on (under the lock); False: one of
        them was dropped (describe again)."""
        if any(m.dead for m in desc.maps):
            return False
        for m in desc.maps:
            m.users += 1
        return True

    def _let_go(self, desc: _Described) -> None:
        """The read that held ``desc``'s mappings is done with them."""
        if not desc.maps:
            return
        with self._lock:
            for m in desc.maps:
                m.users -= 1
                if m.dead and m.users == 0:
                    m.unmap()

    def _dropped(self, descs: list[_Described]) -> None:
        """``descs`` left the cache (under the lock): their mappings that no cached description
        holds are dead, unmapped now or when their last read lets go."""
        maps = {id(m): m for d in descs for m in d.maps}
        if not maps:
            return
        kept = {id(m) for d in self._described.values() for m in d.maps}
        for i, m in maps.items():
            if i in kept or m.dead:
                continue
            m.dead = True
            if self._maps.get(m.key) is m:
                del self._maps[m.key]
            if m.users == 0:
                m.unmap()

    def _describe(self, key: tuple[str, int, int], pid: int, where: str, token: bytes | None = None) -> _Described:
        side, region, version = key
        in_process = pid == os.getpid()
        request = {"region": region, "version": version, "ipc": not in_process and torch.cuda.is_available(), "token": token}
        try:
            reply = self._client.call(side, "describe", request, self.describe_timeout, closed=lambda: self._closed)
        except SideError as err:
            why = _REFUSALS.get(err.code, f"the peer refused to describe it ({err.code})")
            cls = Unauthorized if err.code == "unauthorized" else TransportError
            raise cls(f"read of {where}: {why}: {err}") from None
        except TransportError as err:
            raise type(err)(f"read of {where}: {err}") from err  # keeps PeerUnreachable
        try:
            tag, words, raw = _checked_description(reply, pid)
            regions = []
            for k, (address, nbytes, kind, _index, ipc) in enumerate(raw):
                if kind == "parts":
                    starts = tuple(itertools.accumulate((n for _, n in ipc[:-1]), initial=0))
                    regions.append(_Region(0, nbytes, None, tuple(a for a, _ in ipc), starts, tuple(n for _, n in ipc)))
                    continue
                cuda = None
                if kind == "cuda" and nbytes:
                    if in_process:
                        cuda = self._own_cuda(side, words, k)
                    elif ipc is not None:
                        cuda = _open_ipc(ipc, nbytes)
                    elif not request["ipc"]:
                        raise ValueError(f"region {k} is CUDA memory and this process has no CUDA device to open it")
                    if cuda is None:
                        raise ValueError(f"region {k} is CUDA memory and came without a usable IPC handle")
                regions.append(_Region(address, nbytes, cuda))
        except ValueError as err:
            raise TransportError(f"read of {where}: the peer's description is unusable: {err}") from None
        sizes = tuple(r.nbytes for r in regions)
        cpu = all(r.cuda is None for r in regions)
        own = self._own_buffers(side, words, tag) if in_process and cpu else None
        maps: list[_Mapping] = []
        if own is None:  # a holder in shared memory: its files mapped here, copied with memmove
            for k, (address, nbytes, kind, _index, extra) in enumerate(raw):
                if kind == "cpu" and extra is not None and nbytes:
                    mapping = self._map(pid, _check_shared(extra, nbytes), nbytes, k, where)
                    if mapping is not None:
                        maps.append(mapping)
                        regions[k] = _Region(mapping.address + extra["offset"], nbytes, None, mapped=True)
        return _Described(pid, tag, words, tuple(regions), sum(sizes), cpu, sizes, own, tuple(maps))

    def _map(self, pid: int, shared: tuple[int, int, int, int, int], nbytes: int, k: int, where: str) -> _Mapping | None:
        """The holder's shared-memory file of region ``k`` mapped here (one mapping per file,
        kept while a description holds it), or None: read it with ``process_vm_readv`` (logged
        once per cause, counted). The file is opened by its descriptor in the holder's process,
        and refused unless it is the file described (device and inode: the descriptor's number
        may have been reused for another file since)."""
        fd, dev, ino, offset, _size = shared
        key = (pid, dev, ino)
        with self._lock:
            mapping = self._maps.get(key)
        if mapping is not None and not mapping.dead and offset + nbytes <= mapping.size:
            return mapping  # the same inode, held open by this mapping: the same file
        path = _PROC_FD.format(pid=pid, fd=fd)
        try:
            opened = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            self._fallback("open", f"cannot open {path} ({err.strerror})", k, where)
            return None
        try:
            st = os.fstat(opened)
            if (st.st_dev, st.st_ino) != (dev, ino):
                with self._lock:
                    self._counts["shared_other_file"] += 1
                self._fallback("other", f"{path} is another file than the one described (its descriptor was reused)", k, where)
                return None
            if offset + nbytes > st.st_size:
                self._fallback("size", f"{path} has {st.st_size} bytes, fewer than the region needs", k, where)
                return None
            try:
                mapping = _Mapping(opened, st.st_size, key)
            except OSError as err:
                self._fallback("mmap", f"{path}: {err}", k, where)
                return None
        finally:
            os.close(opened)
        with self._lock:
            self._counts["shared_mapped"] += 1
            self._maps[key] = mapping
        return mapping

    def _fallback(self, cause: str, why: str, k: int, where: str) -> None:
        with self._lock:
            self._counts["shared_fallbacks"] += 1
            first = cause not in self._warned
            self._warned.add(cause)
        if first:
            _log.warning("local transport %s: region %d of %s is in shared memory, but %s: it is read with "
                         "process_vm_readv (logged once per cause)", self.id, k, where, why)  # fmt: skip

    def _own_buffers(self, side: str, words: int, tag: int) -> weakref.ref[ShardBuffers] | None:
        """The buffers a holder in this very process described (its words and tag), weakly: a
        copy out of them is a ``memmove`` (no system call, no page pinning: ``process_vm_readv``
        of one's own memory costs about 1.5x a ``memmove`` of it here); None: not found."""
        holder = _HOLDERS.get(side)
        if holder is None:
            return None
        with holder._lock:
            found = [b for b in holder._exposed.values() if b.progress.words_address == words and b.progress.tag == tag]
        return weakref.ref(found[0]) if found else None

    def _own_cuda(self, side: str, words: int, k: int) -> torch.Tensor | None:
        """Region ``k`` of the buffers a holder in this very process described (CUDA IPC
        handles cannot be opened by the process that made them)."""
        holder = _HOLDERS.get(side)
        if holder is None:
            return None
        with holder._lock:
            found = [b for b in holder._exposed.values() if b.progress.words_address == words]
        return found[0].flat(k) if found else None

    def _match(self, desc: _Described, into: ShardBuffers, where: str) -> None:
        """The described region sizes must be ``into``'s plan's (checked once per pair: the
        reads of a pull share both)."""
        with self._lock:
            matched = self._matched.get(into)
            if matched is not None and matched() is desc:
                return
        if desc.sizes != tuple(r.nbytes for r in into.plan.regions):
            raise TransportError(f"read of {where}: the peer's regions do not match the destination's layout")
        with self._lock:
            self._matched[into] = weakref.ref(desc)

    def _words(self, desc: _Described, where: str) -> tuple[int, int | None, int]:
        """``(generation, version, verified)`` from the holder's words, the tag checked."""
        buf = getattr(self._tls, "words", None)
        if buf is None:
            buf = self._tls.words = ctypes.create_string_buffer(WORD_BYTES)
        try:
            _vm_read(desc.pid, [(ctypes.addressof(buf), WORD_BYTES)], [(desc.words, WORD_BYTES)])
        except _VmError as err:
            raise TransportError(f"read of {where}: {_vm_why(err, desc.pid)}") from None
        tag, gen, ver, verified = read_words(buf.raw)
        if tag != desc.tag:
            raise TransportError(f"read of {where}: the peer's buffers were withdrawn or replaced (their tag changed)")
        return gen, ver, verified

    def _wait(self, desc: _Described, version: int, end: int, generation: int | None, where: str) -> int:
        """The generation under which the holder holds ``version`` with ``[0, end)`` covered."""
        deadline = time.monotonic() + self.wait_timeout
        delay = _POLL_FIRST
        gen, ver, verified = self._words(desc, where)
        g0, v0 = gen, ver
        seen = False
        while True:
            if generation is not None and gen != generation:
                raise TransportError(f"read of {where}: the peer's holding changed (generation {gen}, the pull began at {generation})")
            if ver == version:
                # A look that raced the holder's stores may show words that never held together
                # (they are stored one by one, and a copy need not read each word whole); a
                # second look that agrees rules that out.
                if verified >= end and self._words(desc, where) == (gen, ver, verified):
                    return gen
                seen = True
            elif seen or (gen != g0 and v0 == version):
                raise TransportError(f"read of {where}: the peer's holding changed (it no longer holds the version)")
            self._check_open(where)
            if time.monotonic() >= deadline:
                state = f"{verified} bytes verified" if ver == version else "it does not hold the version yet"
                raise RangeNotReady(f"read of {where}: the peer's progress did not cover the range in time ({state})")
            pause = self._pause(desc, version, gen, verified, end, delay) if ver == version else delay
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
            delay = min(2 * delay, _POLL_MAX)
            gen, ver, verified = self._words(desc, where)

    def _pause(self, desc: _Described, version: int, gen: int, verified: int, end: int, backoff: float) -> float:
        """How long a read waiting for ``[0, end)`` of a partial holding sleeps before its next
        look: ``backoff`` (the doubling poll), or, once the holding's ``verified`` was seen to
        grow, most of the time its latest rate says the rest needs (at most ``_PACE_MAX``).
        Each look is a ``process_vm_readv`` that takes the holder's memory map lock, which the
        copies out of it take too: a downstream reader of a chain looked every millisecond
        through most of a pull (about 20 looks per 32 MiB read at 4 readers); paced, it looks a
        few times per read. Shared by the reads of the holding (any thread)."""
        key = (desc.pid, desc.words, desc.tag, version, gen)
        now = time.monotonic()
        with self._lock:
            seen = self._paces.get(key)
            if seen is None or verified > seen[1]:
                rate = (verified - seen[1]) / (now - seen[0]) if seen is not None and now > seen[0] else None
                self._paces[key] = (now, verified, rate if rate is not None else (seen[2] if seen else None))
                self._paces.move_to_end(key)
                while len(self._paces) > _PACES_MAX:
                    self._paces.popitem(last=False)
            rate = self._paces[key][2]
        if not rate:
            return backoff
        return min(max(_PACE_SHARE * (end - verified) / rate, backoff), _PACE_MAX)

    def _seqlock(self, desc: _Described, version: int, end: int, gen: int, where: str) -> None:
        after, held, verified = self._words(desc, where)
        # ``verified`` cannot fall within a generation; checking it again also rejects a first
        # look that caught a reset half-written (new generation, old ``verified``).
        if after != gen or held != version or verified < end:
            raise TransportError(f"read of {where}: the peer's holding changed during the read (generation {gen} -> {after})")

    def _copy(self, desc: _Described, into: ShardBuffers, offset: int, length: int, where: str, landed: Landed | None) -> None:
        """Copy the range: in this thread if it is one part, else as parts of ``_PART_BYTES``
        queued on the transport's ``threads`` copy workers. The workers are shared by every read
        in flight, so they stay busy across the gaps between one read and the next (a read's
        completion goes through the event loop before the next is issued) without running more
        copies at once than there are workers."""
        if into.on_cuda and _gpu_to_gpu(desc, into, offset, length):
            # A GPU copies the whole range faster than a thread can hand over a part: one copy_
            # per region segment on this thread's stream, then one wait for that stream.
            self._check_open(where)
            _copy_gpu(desc, into, offset, length, landed=landed)
            return
        parts = _parts(into, offset, length) if self._helpers is not None and length > _PART_BYTES else [(offset, length)]
        if len(parts) == 1 or self._helpers is None:
            self._copy_part(desc, into, offset, length, where, None, landed)
            return
        stop = threading.Event()
        futures: list[Future[None]] = []
        try:
            for pos, n in parts:
                futures.append(self._helpers.submit(self._copy_part, desc, into, pos, n, where, stop, landed))
        except RuntimeError:  # the pool shut down: closed meanwhile
            stop.set()
            self._check_open(where)
            raise
        # One wake-up for the whole read (not one per part), unless a part fails: then the
        # others stop at their next piece, and the first failure is the one reported.
        done, rest = wait(futures, return_when=FIRST_EXCEPTION)
        if rest:
            stop.set()
            wait(rest)
        failure = next((f.exception() for f in futures if f.exception() is not None), None)
        if failure is not None:
            raise failure

    def _copy_part(
        self, desc: _Described, into: ShardBuffers, offset: int, length: int, where: str, stop: threading.Event | None, landed: Landed | None
    ) -> None:
        if desc.cpu and not into.on_cuda:
            self._copy_cpu(desc, into, offset, length, where, stop, landed)
            return
        pos, end = offset, offset + length
        while pos < end:
            self._check_open(where)
            if stop is not None and stop.is_set():
                raise TransportError(f"read of {where}: another part of the read failed")
            n = min(self.piece_bytes, end - pos)
            self._copy_piece(desc, into, pos, n, where)
            if landed is not None and not into.on_cuda:
                landed(pos, n)
            pos += n

    def _copy_cpu(
        self, desc: _Described, into: ShardBuffers, offset: int, length: int, where: str, stop: threading.Event | None, landed: Landed | None
    ) -> None:
        """CPU memory into CPU memory: the part's spans on both sides worked out once, then one
        ``process_vm_readv`` per piece, each piece reported landed right after it is copied
        (``piece_bytes``, 1 MiB by default: the piece is still in this core's L2 cache when the
        engine hashes it, which a 4 MiB piece is not)."""
        # A holder in this process: its buffers, held for the copy (their memory stays mapped; a
        # withdraw or a new generation meanwhile fails the seqlock after it, as for another process).
        own = desc.own() if desc.own is not None else None
        # Runs of segments copied alike: (in user space, their bytes, local spans, remote spans).
        # A region mapped from a holder's shared-memory file (``_Region.mapped``) is in user
        # space as a holder in this process is; the rest goes through ``process_vm_readv``.
        runs: list[tuple[bool, int, list[tuple[int, int]], list[tuple[int, int]]]] = []
        for seg in into.segments(offset, length):
            src = desc.regions[seg.index]
            user = own is not None or src.mapped
            theirs = own.spans(seg.offset, seg.length) if own is not None else src.spans(seg.start, seg.length)
            if runs and runs[-1][0] == user:
                _, n, mine, remote = runs[-1]
                mine += into.spans(seg.offset, seg.length)
                remote += theirs
                runs[-1] = (user, n + seg.length, mine, remote)
            else:
                runs.append((user, seg.length, into.spans(seg.offset, seg.length), theirs))
        # A part that is one whole checksum unit (the usual: 4 MiB parts of 4 MiB units) is
        # hashed through the hasher's stream of that unit: one update per piece, no search.
        unit_stream = getattr(landed, "unit_stream", None)
        sink = unit_stream(offset, length) if unit_stream is not None else None
        pos, piece = offset, self.piece_bytes
        for user, run_bytes, local, remote in runs:
            li = lo = ri = ro = 0
            end = pos + run_bytes
            while pos < end:
                if self._closed:
                    self._check_open(where)
                if stop is not None and stop.is_set():
                    raise TransportError(f"read of {where}: another part of the read failed")
                n = min(piece, end - pos)
                mine, li, lo = _take(local, li, lo, n)
                theirs, ri, ro = _take(remote, ri, ro, n)
                self._vm_copy(desc, mine, theirs, where, user)
                if sink is not None:
                    sink(pos, pos + n)
                elif landed is not None:
                    landed(pos, n)
                pos += n

    def _copy_piece(self, desc: _Described, into: ShardBuffers, offset: int, n: int, where: str) -> None:
        local: list[tuple[int, int]] = []
        remote: list[tuple[int, int]] = []
        synced: set[torch.device] = set()
        for seg in into.segments(offset, n):
            src = desc.regions[seg.index]
            dst = into.gpu_bytes(seg)  # None: CPU memory (a pack kept in place too)
            if src.cuda is not None:  # GPU memory of the holder: torch copies it
                piece = src.cuda[seg.start : seg.start + seg.length]
                if dst is None:
                    into.copy_in(seg.offset, piece.cpu().numpy().data)
                    continue
                dst.copy_(piece)
                synced.update(t.device for t in (dst, src.cuda) if t.device.type == "cuda")
            elif dst is None and src.mapped:
                self._vm_copy(desc, into.spans(seg.offset, seg.length), src.spans(seg.start, seg.length), where, True)
            elif dst is None:
                local += into.spans(seg.offset, seg.length)
                remote += src.spans(seg.start, seg.length)
            else:  # CPU memory into GPU memory: stage it
                staged = bytearray(seg.length)
                self._vm_copy(desc, [(_address(staged), seg.length)], src.spans(seg.start, seg.length), where, src.mapped)
                into.copy_in(seg.offset, memoryview(staged))
        if local:
            self._vm_copy(desc, local, remote, where)
        for device in synced:
            torch.cuda.synchronize(device)

    def _vm_copy(
        self, desc: _Described, local: list[tuple[int, int]], remote: list[tuple[int, int]], where: str, user: bool = False
    ) -> None:
        """Copy the holder's ``remote`` spans into this process's ``local`` ones: with
        ``process_vm_readv``, or, ``user`` (``remote`` is memory of this process, held by the
        caller for the copy: the holder's buffers in this very process, or its shared-memory
        files mapped here), with ``memmove``."""
        if user:
            _memmove(local, remote)
            return
        try:
            _vm_read(desc.pid, local, remote)
        except _VmError as err:
            raise TransportError(f"read of {where}: {_vm_why(err, desc.pid)}") from None


def _parts(into: ShardBuffers, offset: int, length: int) -> list[tuple[int, int]]:
    """``[offset, offset + length)`` cut into the parts queued on the copy workers: a region of
    at least ``_PART_BYTES`` is cut at its start and at each ``_PART_BYTES`` of it (where its
    checksum units begin, with the layout's default 4 MiB chunks, wherever the read begins: a
    part is then one whole unit, hashed through its stream, and no unit is split between two
    workers); smaller regions (tiny tensors, packs) stay with the bytes before them until a
    part reaches ``_PART_BYTES``. The parts are in order and cover the range exactly."""
    end = offset + length
    out: list[tuple[int, int]] = []
    start = offset
    regions = into.plan.regions
    for seg in into.segments(offset, length):
        seg_end = seg.offset + seg.length
        if regions[seg.index].nbytes < _PART_BYTES:
            if seg_end - start >= _PART_BYTES:
                out.append((start, seg_end - start))
                start = seg_end
            continue
        if seg.offset > start:
            out.append((start, seg.offset - start))
        pos, rel = seg.offset, seg.start
        while pos < seg_end:
            n = min(seg_end - pos, _PART_BYTES - rel % _PART_BYTES)
            out.append((pos, n))
            pos, rel = pos + n, rel + n
        start = seg_end
    if start < end:
        out.append((start, end - start))
    return out


def _gpu_to_gpu(desc: _Described, into: ShardBuffers, offset: int, length: int) -> bool:
    """Whether every byte of the range goes from the holder's GPU memory to this reader's."""
    return all(desc.regions[seg.index].cuda is not None and into.gpu_bytes(seg) is not None for seg in into.segments(offset, length))


_copy_streams = threading.local()  # per thread: device index -> the side stream its copies run on


def _stream_for(device: torch.device) -> torch.cuda.Stream:
    streams = getattr(_copy_streams, "by_device", None)
    if streams is None:
        streams = _copy_streams.by_device = {}
    s = streams.get(device.index)
    if s is None:
        s = streams[device.index] = torch.cuda.Stream(device)
    return s


def _copy_gpu(
    desc: _Described, into: ShardBuffers, offset: int, length: int, batched: bool = False, landed: Any = None
) -> None:
    """GPU memory to GPU memory: the range's segments copied on a side stream of this thread
    (the engine's own kernels on the default stream neither wait for it nor delay it), waited
    for before returning, so the bytes are in place when the read reports them landed. With a
    device landing from the engine (``landed.copy``, :class:`tensorhub.runtime.checksum.DeviceLanding`)
    the landing copies the segments itself, hashing the units on the way (one kernel, no second
    pass for verification). Else one ``copy_`` per segment; ``batched``: one
    ``torch._foreach_copy_`` for all of them instead (fewer launches, but a slower copy on an H100:
    792 against 1,329 GB/s for 8 GiB of 128 MiB tensors, benchmarks/results/GPU.md; kept for the
    diagnosis of gpu_check.py)."""
    if not batched and _copy_kernel(desc, into, offset, length, landed):
        return
    by_device: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], list[int]]] = {}
    for seg in into.segments(offset, length):
        src = desc.regions[seg.index].cuda
        dst = into.gpu_bytes(seg)
        assert src is not None and dst is not None
        dsts, srcs, offsets = by_device.setdefault(dst.device.index, ([], [], []))
        dsts.append(dst)
        srcs.append(src[seg.start : seg.start + seg.length])
        offsets.append(seg.offset)
    device_landing = getattr(landed, "copy", None) if len(by_device) == 1 else None
    streams = []
    for dsts, srcs, offsets in by_device.values():
        device = dsts[0].device
        stream = _stream_for(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # earlier work on the buffers comes first
        with torch.cuda.stream(stream):
            if device_landing is not None:
                device_landing(list(zip(offsets, srcs, dsts)))
            elif batched and _FOREACH_COPY is not None:
                _FOREACH_COPY(dsts, srcs, non_blocking=True)
            else:
                for d, s in zip(dsts, srcs):
                    d.copy_(s, non_blocking=True)
        streams.append(stream)
    for stream in streams:
        stream.synchronize()


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


@dataclass(frozen=True, slots=True)
class _GpuTable:
    """A described holder's regions beside the reader's, as arrays (for one kernel launch per
    read instead of Python per segment): transfer offsets and ends, source and destination
    addresses; None where not every region is GPU memory of one device at both ends."""

    desc: _Described
    offsets: np.ndarray
    ends: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    device: torch.device


def _gpu_table(desc: _Described, into: ShardBuffers) -> _GpuTable | None:
    cached = into.__dict__.get("_local_gpu_table")
    if cached is not None and cached[0] is desc:
        return cached[1]
    table = None
    srcs = [r.cuda for r in desc.regions]
    dsts = into.regions
    devices = {t.device for t in (*srcs, *dsts) if t is not None}
    if len(devices) == 1 and all(t is not None for t in (*srcs, *dsts)) and next(iter(devices)).type == "cuda":
        regions = into.plan.regions
        offsets = np.array([r.offset for r in regions], dtype=np.int64)
        table = _GpuTable(
            desc, offsets, offsets + np.array([r.nbytes for r in regions], dtype=np.int64),
            np.array([t.data_ptr() for t in srcs if t is not None], dtype=np.int64),
            np.array([t.data_ptr() for t in dsts if t is not None], dtype=np.int64),
            next(iter(devices)),
        )  # fmt: skip
    into.__dict__["_local_gpu_table"] = (desc, table)
    return table


def _copy_kernel(desc: _Described, into: ShardBuffers, offset: int, length: int, landed: Any) -> bool:
    """GPU to GPU on one device through the engine's device landing (``landed.copy_ranges``, see
    transports/base.py "Landing reports"): one kernel launch copies the read's segments, found
    with numpy from a table of the regions, and hashes its units on the way. On a side stream of
    this thread, waited for. False (nothing done) without such a landing, or where its kernel
    cannot run (regions not all GPU memory of one device, no Triton)."""
    copy_ranges = getattr(landed, "copy_ranges", None)
    runs_on = getattr(landed, "kernel_runs_on", None)
    if copy_ranges is None or runs_on is None:
        return False
    table = _gpu_table(desc, into)
    if table is None or not runs_on(table.device):
        return False
    end = offset + length
    k0 = int(np.searchsorted(table.ends, offset, side="right"))
    k1 = int(np.searchsorted(table.offsets, end, side="left"))
    starts = np.maximum(table.offsets[k0:k1], offset)
    lengths = np.minimum(table.ends[k0:k1], end) - starts
    rel = starts - table.offsets[k0:k1]
    stream = _stream_for(table.device)
    stream.wait_stream(torch.cuda.current_stream(table.device))  # earlier work on the buffers comes first
    with torch.cuda.stream(stream):
        copy_ranges(starts, lengths, table.src[k0:k1] + rel, table.dst[k0:k1] + rel, table.device)
    stream.synchronize()
    return True


def _describe_region(buf: ShardBuffers, k: int, share: bool) -> list[Any]:
    """``[address, nbytes, kind, device index, extra]`` of region ``k`` (see the module
    docstring); CUDA IPC fields only when the reader asked for them (another process)."""
    t = buf.regions[k]
    if t is None:  # a pack kept in place
        parts = buf.parts(k) or []
        return [0, buf.plan.regions[k].nbytes, "parts", -1, [[a, n] for a, n in parts]]
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cuda":
        shared = buf.shared_file(k)
        return [t.data_ptr(), nbytes, "cpu", -1, None if shared is None else shared.extra()]
    ipc = None
    if share and nbytes:
        fields = list(t.untyped_storage()._share_cuda_())
        ipc = {"fields": fields, "offset": t.storage_offset() * t.element_size(), "uuid": _device_uuid(t.device.index)}
    return [t.data_ptr(), nbytes, "cuda", t.device.index, ipc]
