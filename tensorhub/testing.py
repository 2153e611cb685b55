"""Testing helpers that ship with the library: the transport conformance suite.

Theory of operation
-------------------
:func:`check_transport` takes a transport (a registered name, a ``"module:Class"`` path, a
class, or a factory called with an options dict) and runs named checks against it, each on
fresh instances: a *holder* that serves :class:`~tensorhub.buffers.ShardBuffers` through a
resolver (a dict of ``(region, version) -> buffers``, as the engine's resolver would answer),
and one or more *readers* that read from it over the transport. Every check is bounded (each
read, each close, each command to the holder and each check has a timeout), so a transport that
hangs fails the suite instead of hanging it.

A check never touches the holder directly: it asks its *pair* (``p.hold(shard)``,
``p.reset(shard, version, verified)``, ``p.advance(shard, n)``, ``p.generation(shard)``,
``p.write(shard, offset, data)``, ``p.expose/withdraw(shard)``, ``p.feed(...)``,
``p.close_holder()``...), and the pair runs that on the holder's side, wherever it is: in this
process, or in the holder process (below). The holder's side is :class:`_HolderSide`, the same
code in both places.

What the checks compare is the shard's *transfer byte space*: the holder's space is filled with
seeded random bytes through :meth:`ShardBuffers.views`, and a reader's bytes are read back the
same way. The suite never looks at the tensors themselves (tiny ones live in packs). A shard is
named by a small description (its kind, ``"mixed"`` or ``"large"``, and a seed): both sides
make the same bytes from it, so they are never shipped between processes.

In this process, the holder's buffers are a subclass of ShardBuffers whose
``views``/``copy_out`` can run a hook once, after the transport took the memory to copy it:
that is how the suite changes the generation (``seqlock_during``) or closes the holder
(``peer_death``) *during* a read, deterministically. A transport that never reads the holder's
memory through those methods (a true RDMA transport) cannot be checked this way: those two
checks then fail saying so, and its tests skip them (or run the suite across processes).

Across processes
----------------
With ``holder_process=True`` the holder side of every check runs in a child process, so that a
transport that reads another process's memory (NIXL over UCX, ``process_vm_readv``) is checked
across address spaces. The child makes the holder transport itself, so the transport is given
by its registered name or a ``"module:Class"`` path (a class importable at module level also
does) with msgpack-able options; a name registered at run time with ``register_transport`` is
unknown to the child (use its path). One child serves the whole :func:`check_transport` call,
one holder transport per pair; it is started with the ``spawn`` (or ``forkserver``) method and
replaced only after a check killed it. The checking process talks to it over a pipe, msgpack
frames only (never pickle), one command at a time, each answered within a timeout; the child
exits when the pipe closes, and the suite kills it if it does not answer.

The checks are the same, and fail with the same messages, except:

- ``seqlock_during``: no hook can run inside another process's copy. Instead the holder process
  changes the holding in a tight loop (new generation with nothing verified, the bytes of one
  of two seeded contents chosen by the generation, everything verified) while reads run; every
  read must either fail with a TransportError (not RangeNotReady) or return a generation the
  holder had with exactly that generation's bytes, and a read after the loop stops must return
  the final generation and its bytes. This catches a broken seqlock with high probability, not
  with certainty: whether a given read overlaps a change depends on timing.
- ``peer_death``: instead of closing the holder from inside the copy, the suite SIGKILLs the
  holder process while a large read (up to 64 MiB) of a partial holder, whose progress the
  child advances slowly, is in flight: the read must fail with a TransportError (not
  RangeNotReady) promptly, and so must a read from the dead peer after it. The half that
  closes the holder while a read waits runs as in this process. A fresh child is started at
  once for the checks after it.
- ``endpoint_msgpack`` checks the holder's endpoint in the holder process, where it is made;
  readers here use that endpoint as it came through msgpack.

Transports that only reach their own process (``memory``) cannot be checked across processes.

Randomness comes from one seed (:data:`DEFAULT_SEED`, from ``$TENSORHUB_SEED`` like the test
suite's); each check derives its own generator from the seed and its name, so a check does the
same thing whichever others run. The seed is in every failure message.

Failures are :class:`AssertionError` naming the check (``check 'seqlock_during' failed``), the
transport and the seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import itertools
import math
import multiprocessing
import os
import random
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from transports.base import RangeNotReady, Transport

from .actor import new_event_loop, run
from .buffers import ShardBuffers, layout_of
from .errors import InvalidArgument, TensorHubError, TransportError
from .wire import MAX_OPAQUE_DEPTH

__all__ = ["CHECKS", "DEFAULT_SEED", "TransportFactory", "check_transport", "check_transport_async"]

#: The seed when none is given: ``$TENSORHUB_SEED``, as in the project's tests.
DEFAULT_SEED = 20261121

#: Makes a transport instance from an options dict (a Transport subclass is one).
TransportFactory = Callable[[dict[str, Any]], Any]

# Distinctive numbers, so that an error message naming them is not a coincidence.
REGION, VERSION = 7919, 104729
SENTINEL = 0xAB
_READ_TIMEOUT = 20.0  # seconds any one read may take
_CLOSE_TIMEOUT = 10.0  # seconds any one close may take
_LONG_WAIT = 30.0  # a wait_timeout that a check must not have to sit out
_PROMPT = 10.0  # "promptly": well before _LONG_WAIT
_BOOT_TIMEOUT = 60.0  # seconds a holder process may take to start (spawn imports torch)
_COMMAND_TIMEOUT = 20.0  # seconds the holder process may take to answer a command
_QUIET_TIMEOUT = 5.0  # seconds the holder's background threads may take to stop
_PROTOCOL = 1  # of the pipe between the suite and its holder process
_WRITE_CHUNK = 4 << 20  # bytes of one write command
_MAX_FRAME = 16 << 20  # bytes of one frame on that pipe

#: A shard of many dtypes and odd sizes: tiny tensors (packed), and large ones at odd offsets.
_MIXED = (
    ("emb", torch.float32, (300, 7)),
    ("ln", torch.bfloat16, (333,)),
    ("f8", torch.float8_e4m3fn, (517,)),
    ("ids", torch.int64, (41,)),
    ("q", torch.int8, (77,)),
    ("mask", torch.bool, (10,)),
    ("empty", torch.float16, (0,)),
    ("h", torch.float16, (5, 3)),
    ("wide", torch.bfloat16, (1_100_003,)),
    ("f8big", torch.float8_e4m3fn, (2_500_001,)),
    ("deep", torch.float32, (3, 200_001)),
    ("tail", torch.float64, (1001,)),
)


# --- the shard bytes ----------------------------------------------------------------------------


class _HookedBuffers(ShardBuffers):
    """Holder buffers that run ``hook`` once, right after a transport took memory to copy
    from (``views``) or copied it out (``copy_out``). ``hook_threads`` records where it ran."""

    def arm(self, hook: Callable[[], None]) -> None:
        self._hook_lock = threading.Lock()
        self._hook: Callable[[], None] | None = hook
        self.hook_threads: list[threading.Thread] = []

    def _fire(self) -> None:
        lock = getattr(self, "_hook_lock", None)
        if lock is None:
            return
        with lock:
            hook, self._hook = self._hook, None
        if hook is not None:
            self.hook_threads.append(threading.current_thread())
            hook()

    @property
    def hook_fired(self) -> bool:
        return bool(getattr(self, "hook_threads", None))

    def views(self, offset: int, length: int) -> list[memoryview]:
        out = super().views(offset, length)
        self._fire()
        return out

    def copy_out(self, offset: int, dest: memoryview) -> None:
        super().copy_out(offset, dest)
        self._fire()


def _write(buf: ShardBuffers, offset: int, data: bytes | memoryview) -> None:
    """Put ``data`` at ``offset`` of the transfer space (bypassing any hook)."""
    if buf.on_cuda:
        ShardBuffers.copy_in(buf, offset, memoryview(data))
        return
    pos = 0
    for v in ShardBuffers.views(buf, offset, len(data)):
        v[:] = data[pos : pos + len(v)]
        pos += len(v)


def _bytes(buf: ShardBuffers) -> bytes:
    """The whole transfer space (bypassing any hook)."""
    if buf.on_cuda:
        out = bytearray(buf.total_bytes)
        ShardBuffers.copy_out(buf, 0, memoryview(out))
        return bytes(out)
    return b"".join(bytes(v) for v in ShardBuffers.views(buf, 0, buf.total_bytes))


def _zeros(specs: tuple, device: str) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s, dtype=d, device=device) for n, d, s in specs}


def _tensor_specs(kind: str, nbytes: int) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
    if kind == "mixed":
        return _MIXED
    return (("head", torch.float16, (1001,)), ("big", torch.uint8, (nbytes,)), ("tail", torch.int32, (777,)))


@functools.lru_cache(maxsize=8)
def _geometry(kind: str, nbytes: int) -> tuple[int, tuple[int, ...]]:
    """``(total bytes, region bounds)`` of a shard kind: where one region of the transfer space
    ends and the next begins (from CPU memory: views do not work on CUDA memory)."""
    tensors = {n: torch.empty(s, dtype=d) for n, d, s in _tensor_specs(kind, nbytes)}
    twin = ShardBuffers(tensors, layout_of(tensors))
    bounds, pos = [], 0
    for v in ShardBuffers.views(twin, 0, twin.total_bytes):
        pos += len(v)
        if 0 < pos < twin.total_bytes:
            bounds.append(pos)
    return twin.total_bytes, tuple(sorted(set(bounds)))


@functools.lru_cache(maxsize=4)
def _shard_data(seed: int | str, total: int) -> bytes:
    """The seeded content of a shard (the same in every process: a str seed is hashed with
    SHA-512, not with the per-process string hash)."""
    return random.Random(seed).randbytes(total)


@dataclass(frozen=True, slots=True)
class _ShardSpec:
    """What both sides need to make the same shard: ``key`` names its buffers on the holder's
    side; ``kind`` is ``"mixed"`` (:data:`_MIXED`) or ``"large"`` (``nbytes`` in one tensor
    between two small ones); ``seed`` makes its bytes; ``filled``: the holder's buffers start
    with them (else zeros, for a partial holder to fill); ``in_place``: which side keeps its
    packs in place (``"holder"``, ``"reader"``; "": neither), for transports that gather."""

    key: int
    kind: str
    seed: int
    nbytes: int = 0
    device: str = "cpu"
    filled: bool = True
    in_place: str = ""

    def __post_init__(self) -> None:
        # It also comes off the pipe from the checking process: refuse anything odd.
        ok = (
            type(self.key) is int
            and self.kind in ("mixed", "large")
            and type(self.seed) is int
            and type(self.nbytes) is int
            and 0 <= self.nbytes <= 1 << 34
            and isinstance(self.device, str)
            and (self.device == "cpu" or self.device.startswith("cuda"))
            and type(self.filled) is bool
            and self.in_place in ("", "holder", "reader")
        )
        if not ok:
            raise InvalidArgument(f"bad shard description {self!r}")

    def geometry(self) -> tuple[int, tuple[int, ...]]:
        return _geometry(self.kind, self.nbytes)

    def data(self, which: str = "") -> bytes:
        """The shard's bytes; ``which="churn"``: the other content ``seqlock_during`` writes."""
        return _shard_data(f"{self.seed}:{which}" if which else self.seed, self.geometry()[0])

    def wire(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}

    @classmethod
    def from_wire(cls, d: Any) -> _ShardSpec:
        if not isinstance(d, dict) or set(d) - set(cls.__slots__):
            raise InvalidArgument(f"bad shard description {d!r}")
        return cls(**d)


class _Shard:
    """The checking process's view of a shard: its description, bytes and geometry, and how
    to make readers' buffers for it. The holder's buffers live on the holder's side."""

    def __init__(self, spec: _ShardSpec) -> None:
        self.spec = spec
        self.specs = _tensor_specs(spec.kind, spec.nbytes)
        self.total, bounds = spec.geometry()
        self.bounds = list(bounds)
        self.device = spec.device

    @property
    def data(self) -> bytes:
        return self.spec.data()

    def fresh(self, device: str | None = None, fill: int = SENTINEL) -> ShardBuffers:
        """Reader buffers of the same layout, every byte ``fill``."""
        tensors = _zeros(self.specs, device or self.device)
        buf = ShardBuffers(tensors, layout_of(tensors), packs_in_place=self.spec.in_place == "reader")
        _write(buf, 0, bytes([fill]) * buf.total_bytes)
        return buf

    def sibling(self, key: int) -> _Shard:
        """Other holder buffers of the same layout, not filled."""
        s = self.spec
        return _Shard(_ShardSpec(key, s.kind, s.seed, s.nbytes, s.device, False, s.in_place))


def _partition(rng: random.Random, total: int, cuts: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut at ``cuts`` random places: (offset, length) pairs."""
    points = sorted({0, total, *rng.sample(range(1, total), min(cuts, total - 1))})
    return [(a, b - a) for a, b in itertools.pairwise(points)]


def _first_difference(got: bytes, want: bytes, base: int = 0) -> str:
    """Where ``got`` first differs from ``want``, which start at transfer byte ``base``."""
    if len(got) != len(want):
        return f"{len(got)} bytes instead of {len(want)}"
    for i in range(0, len(want), 1 << 16):
        if got[i : i + (1 << 16)] != want[i : i + (1 << 16)]:
            j = next(k for k in range(i, min(i + (1 << 16), len(want))) if got[k] != want[k])
            return f"first difference at transfer byte {base + j}: got {got[j]:#04x}, want {want[j]:#04x}"
    return "no difference"


def _expect(ok: object, message: str) -> None:
    """A check's assertion (not ``assert``: the suite must also fail under ``python -O``)."""
    if not ok:
        raise AssertionError(message)


def _same_bytes(got: bytes, want: bytes, what: str, base: int = 0) -> None:
    if got != want:
        raise AssertionError(f"{what}: the bytes differ ({_first_difference(got, want, base)})")


# --- the holder's side --------------------------------------------------------------------------


class _HolderSide:
    """The holder of one pair: a transport serving a dict of holdings, and what checks do to
    them. The same code runs in the checking process and in the holder process; its public
    methods (:data:`_HOLDER_COMMANDS`) are the commands the pipe carries, with the same
    arguments (a shard as its :class:`_ShardSpec`)."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.started = False
        self.holdings: dict[tuple[int, int], ShardBuffers] = {}
        self._buffers: dict[int, tuple[_ShardSpec, _HookedBuffers]] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._errors: list[str] = []  # of background threads, raised by quiet()

    async def start(self) -> None:
        await _bounded(self.transport.start(), "holder start()")
        self.started = True
        self.transport.serve(lambda region, version: self.holdings.get((region, version)))

    def endpoint(self) -> dict[str, Any]:
        return self.transport.endpoint()

    def check_endpoint(self) -> None:
        _check_endpoint(self.transport.endpoint(), "holder")

    def buffers(self, shard: _ShardSpec) -> _HookedBuffers:
        """The buffers of ``shard`` on this side (made on first use)."""
        got = self._buffers.get(shard.key)
        if got is None:
            tensors = _zeros(_tensor_specs(shard.kind, shard.nbytes), shard.device)
            buf = _HookedBuffers(tensors, layout_of(tensors), packs_in_place=shard.in_place == "holder")
            if shard.filled:
                _write(buf, 0, shard.data())
            got = self._buffers[shard.key] = (shard, buf)
        elif got[0] != shard:
            raise InvalidArgument(f"shard {shard.key} was {got[0]!r}, now {shard!r}")
        return got[1]

    def _held(self, shard: _ShardSpec) -> _HookedBuffers:
        if shard.key not in self._buffers:
            raise InvalidArgument(f"the holder has no buffers for shard {shard.key}; hold it first")
        return self.buffers(shard)

    def hold(self, shard: _ShardSpec, region: int, version: int, verified: int | None) -> int:
        """Serve ``shard`` as (region, version), verified up to ``verified`` (all if None).
        Returns the generation."""
        buf = self.buffers(shard)
        self.holdings[(region, version)] = buf
        self.transport.expose(buf)
        return buf.progress.reset(version, buf.total_bytes if verified is None else verified)

    def reset(self, shard: _ShardSpec, version: int | None, verified: int) -> int:
        return self._held(shard).progress.reset(version, verified)

    def advance(self, shard: _ShardSpec, verified: int) -> None:
        self._held(shard).progress.advance(verified)

    def generation(self, shard: _ShardSpec) -> int:
        return self._held(shard).progress.generation

    def write(self, shard: _ShardSpec, offset: int, data: bytes) -> None:
        buf = self._held(shard)
        if not (isinstance(data, bytes) and 0 <= offset <= offset + len(data) <= buf.total_bytes):
            raise InvalidArgument(f"cannot write {len(data)} bytes at {offset} of a {buf.total_bytes}-byte shard")
        _write(buf, offset, data)

    def expose(self, shard: _ShardSpec) -> None:
        self.transport.expose(self._held(shard))

    def withdraw(self, shard: _ShardSpec) -> None:
        self.transport.withdraw(self._held(shard))

    def feed(self, shard: _ShardSpec, steps: list[int], delay: float) -> None:
        """In a thread: for each ``end`` of ``steps``, after ``delay`` seconds, write the
        shard's bytes up to ``end`` and advance its progress there (a partial holder filling)."""
        buf, data = self._held(shard), memoryview(shard.data())

        def fill(stop: threading.Event) -> None:
            done = 0
            for end in steps:
                if stop.wait(delay):
                    return
                _write(buf, done, data[done:end])
                buf.progress.advance(end)
                done = end

        self._background(fill, "conformance-feed")

    def churn(self, shard: _ShardSpec, version: int, pause: float) -> int:
        """In a thread, until :meth:`quiet`: the holding changes over and over (a new
        generation with nothing verified, then the bytes of generation ``g``: the shard's own
        if ``g - first`` is even, its ``"churn"`` content if odd, then all of them verified).
        Returns ``first``, the generation before the first change."""
        buf = self._held(shard)
        contents = (shard.data(), shard.data("churn"))
        first = buf.progress.generation

        def change(stop: threading.Event) -> None:
            while not stop.is_set():
                g = buf.progress.reset(version, 0)
                _write(buf, 0, contents[(g - first) % 2])
                buf.progress.advance(buf.total_bytes)
                stop.wait(pause)

        self._background(change, "conformance-churn")
        return first

    def _background(self, fn: Callable[[threading.Event], None], name: str) -> None:
        stop = self._stop

        def main() -> None:
            try:
                fn(stop)
            except Exception as err:  # noqa: BLE001 - reported by quiet()
                self._errors.append(f"{name}: {type(err).__name__}: {err}")

        t = threading.Thread(target=main, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def quiet(self) -> None:
        """Stop the background threads (feed, churn) and wait for them; raise what failed."""
        self._stop.set()
        threads, self._threads, self._stop = self._threads, [], threading.Event()
        deadline = time.monotonic() + _QUIET_TIMEOUT
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        errors, self._errors = self._errors, []
        if stuck:
            errors.append(f"threads {stuck} did not stop within {_QUIET_TIMEOUT:g} s")
        if errors:
            raise AssertionError(f"the holder's background work failed: {'; '.join(errors)}")

    def wake(self) -> None:
        """Stop the background threads, then wake whatever still waits on a holding."""
        try:
            self.quiet()
        finally:
            for buf in self.holdings.values():
                buf.progress.reset(None)

    async def close(self, what: str) -> None:
        """Close the transport (bounded); nothing if it never started."""
        if self.started:
            await _bounded(self.transport.close(), what, _CLOSE_TIMEOUT)


#: The holder's methods the pipe may call (``start`` and ``forget`` are the holder process's).
_HOLDER_COMMANDS = frozenset(
    {"endpoint", "check_endpoint", "hold", "reset", "advance", "generation", "write", "expose", "withdraw",
     "feed", "churn", "quiet", "wake", "close"}
)  # fmt: skip


class _LocalHolder:
    """A pair's holder in this process."""

    alive = True

    def __init__(self, transport: Any) -> None:
        self.side = _HolderSide(transport)
        self.one_sided = bool(getattr(transport, "one_sided", False))
        self.label = type(transport).__name__

    async def start(self) -> None:
        await self.side.start()

    async def do(self, command: str, **args: Any) -> Any:
        if command not in _HOLDER_COMMANDS:
            raise InvalidArgument(f"unknown holder command {command!r}")
        value = getattr(self.side, command)(**args)
        return await value if inspect.isawaitable(value) else value

    async def peer(self) -> dict[str, Any]:
        return self.side.transport.endpoint()

    async def forget(self) -> None:
        self.side.quiet()


class _InProcess:
    """Holders in the checking process (the default)."""

    processes = False

    def holder(self, make: Callable[[dict[str, Any]], Any], options: dict[str, Any]) -> _LocalHolder:
        return _LocalHolder(make(options))

    async def kill(self, holder: Any) -> None:
        raise InvalidArgument("only a holder process can be killed (check_transport(..., holder_process=True))")

    async def close(self) -> None:
        pass


# --- the holder process -------------------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(frame: bytes) -> Any:
    return msgpack.unpackb(frame, raw=False)


def _holder_main(conn: Any) -> None:
    """The holder process: answer the checking process's commands on ``conn`` (msgpack frames
    ``{"op", "holder", "args"}``, answered ``{"ok": value}`` or ``{"error": type, "message"}``)
    until it says ``exit`` or goes away, then close every holder transport and exit."""
    code = 0
    loop = new_event_loop()
    try:
        loop.run_until_complete(_answer_commands(conn))
    except BaseException:  # noqa: BLE001 - the process ends here either way; say why
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(OSError):
            conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Not a normal exit: it would wait for transports' worker threads, without a bound.
        os._exit(code)


async def _answer_commands(conn: Any) -> None:
    loop = asyncio.get_running_loop()
    holders: dict[int, _HolderSide] = {}
    pipe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conformance-pipe")
    conn.send_bytes(_pack({"hello": _PROTOCOL, "pid": os.getpid()}))
    try:
        while True:
            try:
                frame = await loop.run_in_executor(pipe, conn.recv_bytes, _MAX_FRAME)
            except (EOFError, OSError):
                return  # the checking process is gone
            msg = _unpack(frame)
            if isinstance(msg, dict) and msg.get("op") == "exit":
                await _close_holders(holders)
                conn.send_bytes(_pack({"ok": None}))
                return
            try:
                reply = {"ok": await _answer(holders, msg)}
            except AssertionError as err:  # a check's own failure: its message as it is
                reply = {"error": "AssertionError", "message": str(err)}
            except Exception as err:  # noqa: BLE001 - whatever the transport raises goes back
                reply = {"error": type(err).__name__, "message": str(err)}
            try:
                out = _pack(reply)
            except (TypeError, ValueError, OverflowError) as err:
                out = _pack({"error": "InvalidArgument", "message": f"the answer is not msgpack data: {err}"})
            try:
                conn.send_bytes(out)
            except OSError:
                return  # the checking process is gone
    finally:
        await _close_holders(holders)
        pipe.shutdown(wait=False)


async def _answer(holders: dict[int, _HolderSide], msg: Any) -> Any:
    if not (isinstance(msg, dict) and isinstance(msg.get("op"), str) and type(msg.get("holder")) is int):
        raise InvalidArgument(f"malformed command {msg!r}")
    op, hid, args = msg["op"], msg["holder"], dict(msg.get("args") or {})
    if "shard" in args:
        args["shard"] = _ShardSpec.from_wire(args["shard"])
    if op == "start":
        if hid in holders:
            raise InvalidArgument(f"holder {hid} exists already")
        side = holders[hid] = _HolderSide(_transport_class(args["transport"])(args["options"]))
        await side.start()
        return {"one_sided": bool(side.transport.one_sided)}
    if op == "forget":
        side = holders.pop(hid, None)
        _shard_data.cache_clear()  # a large shard's bytes are not needed any more
        if side is not None:
            side.quiet()
        return None
    side = holders.get(hid)
    if side is None:
        raise InvalidArgument(f"no holder {hid} in the holder process")
    if op not in _HOLDER_COMMANDS:
        raise InvalidArgument(f"unknown holder command {op!r}")
    value = getattr(side, op)(**args)
    return await value if inspect.isawaitable(value) else value


async def _close_holders(holders: dict[int, _HolderSide]) -> None:
    for hid in list(holders):
        side = holders.pop(hid)
        with contextlib.suppress(Exception):
            side.wake()
        with contextlib.suppress(Exception):
            await side.close(f"close() of {type(side.transport).__name__}")


class _HolderProcess:
    """The checking process's end of one holder process. Commands go one at a time through a
    thread of its own (the pipe blocks); a command not answered in time, or a process that
    died, makes it unusable: it is killed, and the hosting starts another for later checks."""

    NAME = "tensorhub-conformance-holder"

    def __init__(self, context: Any) -> None:
        self._conn, theirs = context.Pipe(duplex=True)
        self.process = context.Process(target=_holder_main, args=(theirs,), name=self.NAME, daemon=True)
        try:
            self.process.start()
        finally:
            theirs.close()
        self.pid: int = self.process.pid
        self.ids = itertools.count(1)
        self.failed: str | None = None  # why it cannot be used any more
        self._booted = False
        self._pipe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conformance-holder-pipe")

    @property
    def usable(self) -> bool:
        return self.failed is None and self.process.is_alive()

    async def call(self, op: str, holder: int, args: dict[str, Any], timeout: float | None = None) -> Any:
        """Send a command, return its answer.

        Raises:
            AssertionError: the holder process failed it (an AssertionError's message as it
                is, another error as ``"the holder process raised <type>: <message>"``), did
                not answer within ``timeout`` (or did not start within the boot timeout), or
                is gone.
        """
        loop = asyncio.get_running_loop()
        msg = {"op": op, "holder": holder, "args": args}
        reply = await loop.run_in_executor(self._pipe, self._exchange, msg, _COMMAND_TIMEOUT if timeout is None else timeout)
        if "error" in reply:
            if reply["error"] == "AssertionError":
                raise AssertionError(reply["message"])
            raise AssertionError(f"the holder process raised {reply['error']}: {reply['message']}")
        return reply["ok"]

    def _exchange(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.failed is not None:
            raise AssertionError(self.failed)
        what = f"{msg['op']!r}"
        if not self._booted:
            hello = self._receive(_BOOT_TIMEOUT, "its start")
            if not (isinstance(hello, dict) and hello.get("hello") == _PROTOCOL):
                raise self._give_up(f"the holder process greeted with {hello!r}, not protocol {_PROTOCOL}")
            self._booted = True
        try:
            self._conn.send_bytes(_pack(msg))
        except OSError as err:
            raise self._give_up(f"the holder process is gone ({err}); cannot send {what}") from err
        reply = self._receive(timeout, what)
        if not (isinstance(reply, dict) and ("ok" in reply or "error" in reply)):
            raise self._give_up(f"the holder process answered {what} with {reply!r}")
        return reply

    def _receive(self, timeout: float, what: str) -> Any:
        try:
            if not self._conn.poll(timeout):
                raise self._give_up(f"the holder process did not answer {what} within {timeout:g} s")
            return _unpack(self._conn.recv_bytes(_MAX_FRAME))
        except (EOFError, OSError):
            self.process.join(2.0)
            code = self.process.exitcode
            raise self._give_up(f"the holder process is gone (exit code {code}) before it answered {what}") from None

    def _give_up(self, why: str) -> AssertionError:
        self.failed = self.failed or why
        self._terminate()
        return AssertionError(why)

    def _terminate(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)

    def kill(self) -> None:
        """SIGKILL the process (a check's peer death) and reap it."""
        self.failed = self.failed or "the holder process was killed"
        self._terminate()

    async def exit(self) -> None:
        """Ask the process to close its holders and exit; kill it if it does not."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pipe, self._exit)
        finally:
            self._pipe.shutdown(wait=False)

    def _exit(self) -> None:
        # One that never booted holds nothing: no need to wait for its imports to end it.
        if self._booted and self.failed is None and self.process.is_alive():
            with contextlib.suppress(AssertionError):
                self._exchange({"op": "exit", "holder": 0, "args": {}}, _CLOSE_TIMEOUT + 5.0)
            self.process.join(5.0)
        self.failed = self.failed or "the holder process exited"
        self._terminate()
        self._conn.close()


class _RemoteHolder:
    """A pair's holder in the holder process: the same commands, over its pipe."""

    def __init__(self, process: _HolderProcess, transport: str, options: dict[str, Any]) -> None:
        self.process = process
        self.id = next(process.ids)
        self.transport = transport
        self.options = options
        self.one_sided = False
        self.label = transport
        self._peer: dict[str, Any] | None = None

    @property
    def alive(self) -> bool:
        return self.process.usable

    async def start(self) -> None:
        got = await self.process.call("start", self.id, {"transport": self.transport, "options": self.options}, _READ_TIMEOUT + 10.0)
        self.one_sided = bool(got["one_sided"])
        # Fetched now, so that reads after the process was killed still know whom to ask.
        with contextlib.suppress(AssertionError):
            self._peer = await self.do("endpoint")

    async def do(self, command: str, **args: Any) -> Any:
        wire = {k: v.wire() if isinstance(v, _ShardSpec) else v for k, v in args.items()}
        timeout = _CLOSE_TIMEOUT + 5.0 if command == "close" else _COMMAND_TIMEOUT
        return await self.process.call(command, self.id, wire, timeout)

    async def peer(self) -> dict[str, Any]:
        if self._peer is None:
            self._peer = await self.do("endpoint")
        return self._peer

    async def forget(self) -> None:
        await self.process.call("forget", self.id, {})


class _InChild:
    """Holders in a holder process: one for the whole suite, a new one after a kill."""

    processes = True

    def __init__(self, context: Any, transport: str) -> None:
        self.context = context
        self.transport = transport
        self.current: _HolderProcess | None = None
        self.spawned: list[_HolderProcess] = []

    def _process(self) -> _HolderProcess:
        if self.current is None or not self.current.usable:
            self.current = _HolderProcess(self.context)
            self.spawned.append(self.current)
        return self.current

    def holder(self, make: Callable[[dict[str, Any]], Any], options: dict[str, Any]) -> _RemoteHolder:
        return _RemoteHolder(self._process(), self.transport, options)

    async def kill(self, holder: Any) -> None:
        if not isinstance(holder, _RemoteHolder):
            raise InvalidArgument("only a holder process can be killed")
        holder.process.kill()
        if holder.process is self.current:
            self._process()  # the next checks' process boots while this check goes on

    async def close(self) -> None:
        for proc in self.spawned:
            await proc.exit()


# --- transports under test ----------------------------------------------------------------------


@dataclass
class _Ctx:
    """What a check gets: its random source, and how to make transports and shards."""

    name: str
    rng: random.Random
    make: Callable[[dict[str, Any]], Any]
    options: dict[str, Any]
    large_bytes: int
    loop: asyncio.AbstractEventLoop
    hosting: Any = field(default_factory=_InProcess)
    keys: Iterator[int] = field(default_factory=itertools.count)
    gathers: bool = False  # the transport gathers: shards alternate which side keeps packs in place

    @property
    def processes(self) -> bool:
        """Whether the holder runs in a holder process."""
        return self.hosting.processes

    def new(self, wait_timeout: float) -> Any:
        return self.make({**self.options, "wait_timeout": wait_timeout})

    def shard(self, kind: str = "mixed", nbytes: int = 0, device: str = "cpu", filled: bool = True) -> _Shard:
        """A new shard: seeded from this check's generator; holder buffers made when held. For a
        transport that gathers, every other shard keeps its packs in place on the holder's side,
        the others on the readers' side (each side must cope with the other's kind)."""
        key = next(self.keys)
        in_place = ("holder", "reader")[key % 2] if self.gathers else ""
        return _Shard(_ShardSpec(key, kind, self.rng.getrandbits(63), nbytes, device, filled, in_place))

    @contextlib.asynccontextmanager
    async def pair(self, wait_timeout: float = 5.0, readers: int = 1) -> AsyncIterator[_Pair]:
        """A started holder serving a dict of holdings, and started readers; all closed after."""
        pair = _Pair(self)
        try:
            pair.holder = self.hosting.holder(self.make, {**self.options, "wait_timeout": wait_timeout})
            await pair.holder.start()
            for _ in range(readers):
                r = self.new(wait_timeout)
                await _bounded(r.start(), "reader start()")
                pair.readers.append(r)
            yield pair
        except BaseException:
            await pair.teardown(quiet=True)  # the check's own failure is the one to report
            raise
        await pair.teardown(quiet=False)


@dataclass
class _Pair:
    """A holder (here or in the holder process) and readers (here). Checks change the holder
    only through these methods; a shard names its buffers on the holder's side."""

    ctx: _Ctx
    holder: Any = None
    readers: list[Any] = field(default_factory=list)

    @property
    def reader(self) -> Any:
        return self.readers[0]

    async def teardown(self, quiet: bool) -> None:
        """Stop the holder's background work and wake whatever still waits on a holding, then
        close every transport (each bounded); raise the first failure unless ``quiet``."""
        failed: BaseException | None = None
        holder = self.holder
        if holder is not None and holder.alive:
            try:
                await holder.do("wake")
            except Exception as err:  # noqa: BLE001 - close the transports first, then report it
                failed = err
        for t in reversed(self.readers):
            try:
                await _bounded(t.close(), f"close() of {type(t).__name__}", _CLOSE_TIMEOUT)
            except Exception as err:  # noqa: BLE001 - close the others first, then report it
                failed = failed or err
        if holder is not None and holder.alive:
            try:
                await holder.do("close", what=f"close() of {holder.label}")
            except Exception as err:  # noqa: BLE001 - as above
                failed = failed or err
            with contextlib.suppress(Exception):
                await holder.forget()
        if failed is not None and not quiet:
            raise failed

    # The holder's side.

    async def hold(self, shard: _Shard, region: int = REGION, version: int = VERSION, verified: int | None = None) -> int:
        """Serve ``shard`` as (region, version), verified up to ``verified`` (all by default).
        Returns the holder's generation."""
        return await self.holder.do("hold", shard=shard.spec, region=region, version=version, verified=verified)

    async def reset(self, shard: _Shard, version: int | None, verified: int = 0) -> int:
        """The holder's buffers of ``shard`` now hold ``version``; returns the new generation."""
        return await self.holder.do("reset", shard=shard.spec, version=version, verified=verified)

    async def advance(self, shard: _Shard, verified: int) -> None:
        await self.holder.do("advance", shard=shard.spec, verified=verified)

    async def generation(self, shard: _Shard) -> int:
        return await self.holder.do("generation", shard=shard.spec)

    async def write(self, shard: _Shard, offset: int, data: bytes) -> None:
        """Put ``data`` at ``offset`` of the holder's buffers of ``shard`` (in pieces)."""
        for pos in range(0, max(len(data), 1), _WRITE_CHUNK):
            piece = bytes(data[pos : pos + _WRITE_CHUNK])
            await self.holder.do("write", shard=shard.spec, offset=offset + pos, data=piece)

    async def expose(self, shard: _Shard) -> None:
        await self.holder.do("expose", shard=shard.spec)

    async def withdraw(self, shard: _Shard) -> None:
        await self.holder.do("withdraw", shard=shard.spec)

    async def feed(self, shard: _Shard, steps: list[int], delay: float) -> None:
        """The holder fills ``shard`` up to each of ``steps`` in turn, ``delay`` s apart."""
        await self.holder.do("feed", shard=shard.spec, steps=steps, delay=delay)

    async def churn(self, shard: _Shard, version: int = VERSION, pause: float = 0.002) -> int:
        """The holder changes ``shard``'s holding over and over (see :meth:`_HolderSide.churn`);
        returns the generation before the first change."""
        return await self.holder.do("churn", shard=shard.spec, version=version, pause=pause)

    async def quiet(self) -> None:
        """Stop the holder's feed and churn."""
        await self.holder.do("quiet")

    async def endpoint(self) -> dict[str, Any]:
        """The holder's ``endpoint()``, asked now."""
        return await self.holder.do("endpoint")

    async def check_holder_endpoint(self) -> None:
        """The ``endpoint_msgpack`` assertions on the holder's endpoint, where it is made."""
        await self.holder.do("check_endpoint")

    async def close_holder(self, what: str = "holder close()") -> None:
        await self.holder.do("close", what=what)

    async def kill_holder(self) -> None:
        """SIGKILL the holder process (process mode only)."""
        await self.ctx.hosting.kill(self.holder)

    def hooked(self, shard: _Shard) -> _HookedBuffers:
        """The holder's buffers of ``shard``, to arm a hook on (in-process mode only)."""
        if not isinstance(self.holder, _LocalHolder):
            raise InvalidArgument("the holder's buffers are in the holder process")
        return self.holder.side.buffers(shard.spec)

    # The readers' side.

    def into(self, shard: _Shard, reader: Any = None, device: str | None = None) -> ShardBuffers:
        buf = shard.fresh(device)
        (reader or self.reader).expose(buf)
        return buf

    async def read(
        self,
        into: ShardBuffers,
        offset: int,
        length: int,
        generation: int | None = None,
        *,
        reader: Any = None,
        region: int = REGION,
        version: int = VERSION,
    ) -> int:
        what = f"read of region {region} version {version} bytes [{offset}, {offset + length})"
        peer = await self.holder.peer()
        return await _bounded((reader or self.reader).read(peer, region, version, offset, length, into, generation), what)


async def _bounded(aw: Awaitable[Any], what: str, timeout: float = _READ_TIMEOUT) -> Any:
    try:
        return await asyncio.wait_for(aw, timeout)
    except TimeoutError as err:
        if isinstance(err, TensorHubError):
            raise
        raise AssertionError(f"{what} did not finish within {timeout:g} s") from err


async def _fails(aw: Awaitable[Any], what: str, not_ready: bool | None = False) -> TransportError:
    """``aw`` must raise TransportError: a RangeNotReady if ``not_ready``, anything but one if
    False, either if None."""
    try:
        await aw
    except TransportError as err:
        _failed_as_expected(err, what, not_ready)
        return err
    except AssertionError:
        raise
    except Exception as err:
        raise AssertionError(f"{what}: raised {type(err).__name__} ({err}), not a TransportError") from err
    raise AssertionError(f"{what}: returned normally; it must raise TransportError")


def _failed_as_expected(err: BaseException, what: str, not_ready: bool | None = False) -> None:
    """``err`` is the TransportError :func:`_fails` wants, else an AssertionError saying why."""
    if isinstance(err, AssertionError):
        raise err
    if not isinstance(err, TransportError):
        raise AssertionError(f"{what}: raised {type(err).__name__} ({err}), not a TransportError") from err  # noqa: TRY004 - a check's failure
    if not_ready is True and not isinstance(err, RangeNotReady):
        raise AssertionError(f"{what}: raised {type(err).__name__} ({err}), not RangeNotReady") from err
    if not_ready is False and isinstance(err, RangeNotReady):
        raise AssertionError(f"{what}: raised RangeNotReady ({err}); a retry cannot help here") from err


def _names_the_read(err: Exception, peer: Any, region: int, version: int, offset: int, what: str) -> None:
    text = str(err)
    missing = [w for w, s in (("region", region), ("version", version), ("range", offset)) if str(s) not in text]
    strings = [s for s in _scalars(peer) if isinstance(s, str) and s]
    if strings and not any(s in text for s in strings):
        missing.append("peer")
    if missing:
        raise AssertionError(
            f"{what}: the error {text!r} does not name the {', '.join(missing)} "
            f"(region {region}, version {version}, offset {offset}, peer {peer!r})"
        )


def _scalars(v: Any) -> list[Any]:
    """The leaf values of nested data (not the keys: those name fields, not this peer)."""
    if isinstance(v, dict):
        return [x for item in v.values() for x in _scalars(item)]
    if isinstance(v, list | tuple):
        return [x for item in v for x in _scalars(item)]
    return [v]


# --- the checks ---------------------------------------------------------------------------------

_Check = Callable[[_Ctx], Awaitable[None]]
_REGISTRY: dict[str, tuple[_Check, Callable[[Any], str | None]]] = {}


def _check(name: str, needs: Callable[[Any], str | None] = lambda t: None) -> Callable[[_Check], _Check]:
    """Register a check; ``needs(transport_instance)`` returns why it does not apply, or None."""

    def register(fn: _Check) -> _Check:
        _REGISTRY[name] = (fn, needs)
        return fn

    return register


@_check("start_endpoint")
async def _start_endpoint(ctx: _Ctx) -> None:
    """Instances start; ``endpoint()`` is a non-empty dict, the same on every call, and differs
    between two started instances."""
    async with ctx.pair() as p:
        ep = await p.endpoint()
        _expect(isinstance(ep, dict) and ep, f"endpoint() must be a non-empty dict, got {ep!r}")
        again = await p.endpoint()
        _expect(again == ep, f"endpoint() changed between two calls: {ep!r} then {again!r}")
        other = p.reader.endpoint()
        _expect(other != ep, f"two started instances have the same endpoint {ep!r}: readers could not tell them apart")


@_check("endpoint_msgpack")
async def _endpoint_msgpack(ctx: _Ctx) -> None:
    """The endpoint is plain msgpack data (None, bool, int, float, str, bytes, lists, str-keyed
    maps; no tuples, no objects, nested at most as deep as the control plane carries) and
    comes back from a strict msgpack round trip unchanged, types included."""
    async with ctx.pair() as p:
        await p.check_holder_endpoint()
        _check_endpoint(p.reader.endpoint(), "reader")


def _check_endpoint(ep: Any, who: str) -> None:
    _plain(ep, f"{who} endpoint", 1)  # the engine nests it one level down (by transport name)
    try:
        packed = msgpack.packb(ep, use_bin_type=True, strict_types=True)
    except (TypeError, ValueError, OverflowError) as err:
        raise AssertionError(f"{who} endpoint {ep!r} does not pack as msgpack: {err}") from err
    back = msgpack.unpackb(packed, raw=False, strict_map_key=True, use_list=True)
    _expect(_typed(back) == _typed(ep), f"{who} endpoint {ep!r} came back from msgpack as {back!r}")


def _plain(v: Any, path: str, depth: int) -> None:
    if depth > MAX_OPAQUE_DEPTH:
        raise AssertionError(f"{path} is nested deeper than the control plane carries ({MAX_OPAQUE_DEPTH})")
    t = type(v)
    if v is None or t in (bool, str, bytes):
        return
    if t is int:
        _expect(-(2**63) <= v < 2**64, f"{path} = {v} does not fit a msgpack integer")
        return
    if t is float:
        return
    if t is list:
        for i, x in enumerate(v):
            _plain(x, f"{path}[{i}]", depth + 1)
        return
    if t is dict:
        for k, x in v.items():
            _expect(type(k) is str, f"{path} has a key {k!r} of type {type(k).__name__}; keys must be str")
            _plain(x, f"{path}.{k}", depth + 1)
        return
    raise AssertionError(f"{path} is a {t.__name__} ({v!r}), not plain msgpack data")


def _typed(v: Any) -> Any:
    """``v`` with every value paired with its type, so that equality also compares types."""
    if type(v) is dict:
        return ("dict", tuple((k, _typed(x)) for k, x in v.items()))
    if type(v) is list:
        return ("list", tuple(_typed(x) for x in v))
    if type(v) is float and math.isnan(v):
        return ("float", "nan")
    return (type(v).__name__, v)


@_check("expose_withdraw")
async def _expose_withdraw(ctx: _Ctx) -> None:
    """``expose``/``withdraw`` may be called on either side and again after one another; a
    buffer exposed again is served again. A one-sided transport refuses to serve buffers that
    were withdrawn (TransportError, not RangeNotReady)."""
    shard = ctx.shard()
    async with ctx.pair() as p:
        await p.hold(shard)
        into = p.into(shard)
        await p.read(into, 0, 100)
        await p.withdraw(shard)
        if p.holder.one_sided:
            await _fails(p.read(into, 0, 100), "a one-sided read of withdrawn buffers")
        await p.expose(shard)
        gen = await p.generation(shard)
        got = await p.read(into, 0, shard.total)
        _expect(got == gen, f"the read returned generation {got}, the holder's is {gen}")
        _same_bytes(_bytes(into), shard.data, "a read after withdraw and expose again")
        p.reader.withdraw(into)
        await p.withdraw(shard)


@_check("odd_ranges")
async def _odd_ranges(ctx: _Ctx) -> None:
    """Reads of seeded random cuts of a shard of many dtypes (float32, bfloat16, float8_e4m3fn,
    int64, int8, bool, float16, float64, an empty tensor; packed tiny tensors and large ones),
    all at once, land byte-exact and return the holder's generation; reads straddling every
    region boundary land exactly their bytes and nothing outside them."""
    shard = ctx.shard()
    async with ctx.pair() as p:
        gen = await p.hold(shard)
        into = p.into(shard)
        ranges = _partition(ctx.rng, shard.total, 40)
        got = await asyncio.gather(*(p.read(into, o, n) for o, n in ranges))
        _expect(set(got) == {gen}, f"reads returned generations {sorted(set(got))}, the holder's is {gen}")
        _same_bytes(_bytes(into), shard.data, f"{len(ranges)} concurrent reads covering the shard")

        into = p.into(shard)
        want = bytearray([SENTINEL]) * shard.total
        straddles = []
        for b in shard.bounds:
            a = b - ctx.rng.randint(1, min(61, b))
            e = b + ctx.rng.randint(1, min(67, shard.total - b))
            straddles.append((a, e - a))
            want[a:e] = shard.data[a:e]
        await asyncio.gather(*(p.read(into, o, n) for o, n in straddles))
        _same_bytes(_bytes(into), bytes(want), f"reads straddling the region boundaries {shard.bounds}")


@_check("tiny_ranges")
async def _tiny_ranges(ctx: _Ctx) -> None:
    """Zero-length reads (at the start, a boundary, the end) return the generation and write
    nothing; 1-byte reads at the first and last byte and on both sides of every region
    boundary land exactly that byte."""
    shard = ctx.shard()
    async with ctx.pair() as p:
        gen = await p.hold(shard)
        into = p.into(shard)
        for offset in (0, shard.bounds[0], shard.total):
            got = await p.read(into, offset, 0)
            _expect(got == gen, f"a zero-length read at {offset} returned generation {got}, the holder's is {gen}")
        _same_bytes(_bytes(into), bytes([SENTINEL]) * shard.total, "zero-length reads (they must write nothing)")
        want = bytearray([SENTINEL]) * shard.total
        singles = sorted({0, shard.total - 1, *(x for b in shard.bounds for x in (b - 1, b))})
        for offset in singles:
            await p.read(into, offset, 1)
            want[offset] = shard.data[offset]
        _same_bytes(_bytes(into), bytes(want), f"1-byte reads at {singles}")


@_check("large_range")
async def _large_range(ctx: _Ctx) -> None:
    """One read of a large range (``large_bytes``, 64 MiB by default) crossing two region
    boundaries lands byte-exact."""
    shard = ctx.shard("large", ctx.large_bytes)
    async with ctx.pair() as p:
        gen = await p.hold(shard)
        into = p.into(shard)
        got = await p.read(into, 1, shard.total - 2)
        _expect(got == gen, f"the read returned generation {got}, the holder's is {gen}")
        want = bytes([SENTINEL]) + shard.data[1:-1] + bytes([SENTINEL])
        _same_bytes(_bytes(into), want, f"a read of {shard.total - 2} bytes")


@_check("concurrent_readers")
async def _concurrent_readers(ctx: _Ctx) -> None:
    """Four reader instances read the whole shard at once, each in its own random cuts, all
    their reads in flight together; every reader gets every byte."""
    shard = ctx.shard()
    async with ctx.pair(readers=4) as p:
        gen = await p.hold(shard)
        intos = [p.into(shard, reader=r) for r in p.readers]
        reads = [
            p.read(into, o, n, reader=r)
            for r, into in zip(p.readers, intos)
            for o, n in _partition(ctx.rng, shard.total, 8)
        ]
        got = await asyncio.gather(*reads)
        _expect(set(got) == {gen}, f"reads returned generations {sorted(set(got))}, the holder's is {gen}")
        for k, into in enumerate(intos):
            _same_bytes(_bytes(into), shard.data, f"reader {k} of 4")


@_check("partial_holder")
async def _partial_holder(ctx: _Ctx) -> None:
    """A partial holder (progress 0, its bytes not there yet) is read while another thread
    writes its bytes and advances its progress in uneven steps: no read ends before its range
    is covered, and every read completes with the right bytes (never bytes from before they
    were covered)."""
    shard = ctx.shard(filled=False)
    feed_rng = random.Random(ctx.rng.random())
    steps = sorted({shard.total, *feed_rng.sample(range(1, shard.total), 23)})

    async with ctx.pair(wait_timeout=5.0) as p:
        gen = await p.hold(shard, verified=0)
        into = p.into(shard)
        ranges = _partition(ctx.rng, shard.total, 12)
        tasks = [asyncio.ensure_future(p.read(into, o, n)) for o, n in ranges]
        try:
            await asyncio.sleep(0.05)
            early = [ranges[k] for k, t in enumerate(tasks) if t.done()]
            _expect(not early, f"reads of {early} ended before any byte was verified")
            await p.feed(shard, steps, 0.005)  # a thread on the holder's side
            got = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await p.quiet()
        _expect(set(got) == {gen}, f"reads returned generations {sorted(set(got))}, the holder's is {gen}")
        _same_bytes(_bytes(into), shard.data, "reads from a partial holder")


@_check("range_not_ready")
async def _range_not_ready(ctx: _Ctx) -> None:
    """With ``wait_timeout`` 0.3 s: a range past the holder's progress raises RangeNotReady,
    soon after the wait; so does a read from buffers that do not hold the version yet (a
    partial holder granted before its own grant reached it); the covered prefix still reads."""
    wait = 0.3
    shard = ctx.shard()
    half = shard.total // 2
    async with ctx.pair(wait_timeout=wait) as p:
        await p.hold(shard, verified=half)
        not_yet = shard.sibling(next(ctx.keys))
        await p.hold(not_yet, region=REGION + 1)
        await p.reset(not_yet, None)
        into = p.into(shard)
        for region, offset in ((REGION, half - 10), (REGION + 1, 0)):
            t0 = time.monotonic()
            await _fails(p.read(into, offset, 20, region=region), f"a read of uncovered bytes of region {region}", True)
            took = time.monotonic() - t0
            _expect(took < wait + _PROMPT, f"RangeNotReady took {took:.1f} s with a wait_timeout of {wait} s")
        await p.read(into, 0, half)
        want = shard.data[:half] + bytes([SENTINEL]) * (shard.total - half)
        _same_bytes(_bytes(into), want, "the covered prefix of a partial holder")


async def _bad_reads(ctx: _Ctx, what: str, region: int, version: int, ranges: Callable[[int], list[tuple[int, int]]]) -> None:
    """Reads that must fail with a TransportError (not RangeNotReady) naming them; the
    transport goes on serving good reads afterwards. ``ranges(total)`` gives (offset, length)."""
    shard = ctx.shard()
    async with ctx.pair(wait_timeout=0.5) as p:
        await p.hold(shard)
        into = p.into(shard)
        for offset, length in ranges(shard.total):
            where = f"{what} (bytes [{offset}, {offset + length}) of a {shard.total}-byte shard)"
            for _ in range(2):  # twice: the first failure must not leave the connection broken
                err = await _fails(p.read(into, offset, length, region=region, version=version), where)
                _names_the_read(err, await p.holder.peer(), region, version, offset, where)
        await p.read(into, 0, 1000)
        _same_bytes(_bytes(into)[:1000], shard.data[:1000], f"a good read after {what}")


@_check("wrong_version")
async def _wrong_version(ctx: _Ctx) -> None:
    """A read of a version the holder does not hold raises TransportError (not RangeNotReady)
    naming the peer, region, version and range; good reads still work after it."""
    await _bad_reads(ctx, "a read of a version the holder does not hold", REGION, VERSION + 1, lambda total: [(4321, 100)])


@_check("unknown_region")
async def _unknown_region(ctx: _Ctx) -> None:
    """Likewise for a region the holder does not know."""
    await _bad_reads(ctx, "a read of an unknown region", REGION + 2, VERSION, lambda total: [(4321, 100)])


@_check("out_of_range")
async def _out_of_range(ctx: _Ctx) -> None:
    """Likewise for ranges past the end of the shard (straddling the end, starting at it,
    starting beyond it, one byte too long)."""
    await _bad_reads(
        ctx,
        "a read past the end of the shard",
        REGION,
        VERSION,
        lambda total: [(total - 10, 11), (total, 1), (total + 100, 5), (0, total + 1)],
    )


@_check("seqlock_between")
async def _seqlock_between(ctx: _Ctx) -> None:
    """The ``generation`` argument is honoured: after the holder's generation moves, a read
    passing the old one (or one it never had) raises TransportError (not RangeNotReady); a read
    passing None or the new one returns the new one."""
    shard = ctx.shard()
    async with ctx.pair() as p:
        g1 = await p.hold(shard)
        into = p.into(shard)
        got = await p.read(into, 0, 100, g1)
        _expect(got == g1, f"a read passing generation {g1} returned {got}")
        g2 = await p.reset(shard, VERSION, shard.total)
        await _fails(p.read(into, 0, 100, g1), f"a read passing generation {g1} after the holder moved to {g2}")
        await _fails(p.read(into, 0, 100, g2 + 1000), f"a read passing generation {g2 + 1000}, the holder's is {g2}")
        got = await p.read(into, 0, 100)
        _expect(got == g2, f"a read passing None returned generation {got}, the holder's is {g2}")
        got = await p.read(into, 100, 100, g2)
        _expect(got == g2, f"a read passing generation {g2} returned {got}")


@_check("seqlock_during")
async def _seqlock_during(ctx: _Ctx) -> None:
    """A read across which the holder's generation moves (bumped after the transport took the
    holder's memory to copy it) raises TransportError (not RangeNotReady); the same read
    afterwards returns the new generation with the right bytes. Across processes: while the
    holder process changes its holding in a tight loop, every read fails so or returns a
    generation the holder had with exactly that generation's bytes."""
    if ctx.processes:
        await _seqlock_churn(ctx)
        return
    shard = ctx.shard()
    async with ctx.pair() as p:
        before = await p.hold(shard)
        buf = p.hooked(shard)
        into = p.into(shard)
        buf.arm(lambda: buf.progress.reset(VERSION, shard.total))
        await _fails(p.read(into, 0, shard.total), "a read across which the holder's generation moved")
        _expect(buf.hook_fired, (
            "the transport never read the holder's memory through ShardBuffers.views()/copy_out(), so "
            "the suite cannot move the generation during a read; skip 'seqlock_during' for it"
        ))
        got = await p.read(into, 0, shard.total)
        _expect(got == before + 1, f"the read after the change returned generation {got}, the holder's is {before + 1}")
        _same_bytes(_bytes(into), shard.data, "the read after the generation change")


_CHURN_ROUNDS = 6  # rounds of reads while the holder process churns


async def _seqlock_churn(ctx: _Ctx) -> None:
    """``seqlock_during`` across processes (see the module docstring)."""
    shard = ctx.shard()
    contents = (shard.data, shard.spec.data("churn"))
    async with ctx.pair() as p:
        await p.hold(shard)
        into, whole = p.into(shard), p.into(shard)
        await p.read(into, 0, 100)  # connections made before the holding starts to move
        first = await p.churn(shard)
        seen: list[int] = []
        try:
            for _ in range(_CHURN_ROUNDS):
                ranges = [*_partition(ctx.rng, shard.total, 12), (0, shard.total)]
                results = await asyncio.gather(
                    *(p.read(whole if n == shard.total else into, o, n) for o, n in ranges), return_exceptions=True
                )
                got_into, got_whole = _bytes(into), _bytes(whole)
                for (o, n), r in zip(ranges, results):
                    what = f"a read of bytes [{o}, {o + n}) while the holder's generation moved"
                    if isinstance(r, BaseException):
                        _failed_as_expected(r, what)
                        continue
                    _expect(type(r) is int and r >= first, f"{what} returned generation {r}; it was {first} before the changes")
                    seen.append(r)
                    got = (got_whole if n == shard.total else got_into)[o : o + n]
                    _same_bytes(got, contents[(r - first) % 2][o : o + n], f"{what}, returning generation {r}", o)
        finally:
            await p.quiet()
        last = await p.generation(shard)
        _expect(all(g <= last for g in seen), f"reads returned generations {sorted(set(seen))}; the holder's last is {last}")
        got = await p.read(whole, 0, shard.total)
        _expect(got == last, f"the read after the changes stopped returned generation {got}, the holder's is {last}")
        _same_bytes(_bytes(whole), contents[(last - first) % 2], "the read after the changes stopped")


@_check("peer_death")
async def _peer_death(ctx: _Ctx) -> None:
    """The holder closes while a large read copies from it: the read raises TransportError
    (not RangeNotReady), does not hang and does not return normally; the holder closing while a
    read waits for a partial holder's progress fails that read too, promptly (not
    RangeNotReady). Across processes: the holder process is SIGKILLed while a large read of a
    partial holder it fills slowly is in flight; that read and the next fail promptly so."""
    if ctx.processes:
        async with ctx.pair(wait_timeout=_LONG_WAIT) as p:
            await _close_while_waiting(ctx, p, "holder")
        await _killed_while_reading(ctx)
        return
    shard = ctx.shard("large", min(ctx.large_bytes, 8 << 20))
    loop = ctx.loop

    async with ctx.pair(wait_timeout=_LONG_WAIT) as dying:
        transport = dying.holder.side.transport

        def close_holder() -> None:
            # Runs in whichever thread copies the holder's memory; the close runs on the loop.
            if _on_loop(loop):
                loop.create_task(transport.close())  # cannot block the loop; the read then returns normally
                return
            done = asyncio.run_coroutine_threadsafe(transport.close(), loop)
            with contextlib.suppress(Exception):
                done.result(_CLOSE_TIMEOUT)

        await dying.hold(shard)
        buf = dying.hooked(shard)
        into = dying.into(shard)
        buf.arm(close_holder)
        await _fails(dying.read(into, 0, shard.total), "a read during which the holder closed")
        _expect(buf.hook_fired, (
            "the transport never read the holder's memory through ShardBuffers.views()/copy_out(), so "
            "the suite cannot close the holder during a read; skip 'peer_death' for it"
        ))

    async with ctx.pair(wait_timeout=_LONG_WAIT) as p:
        await _close_while_waiting(ctx, p, "holder")


async def _killed_while_reading(ctx: _Ctx) -> None:
    """SIGKILL the holder process during a large read of a partial holder it fills slowly."""
    shard = ctx.shard("large", min(ctx.large_bytes, 64 << 20), filled=False)
    async with ctx.pair(wait_timeout=_LONG_WAIT) as p:
        await p.hold(shard, verified=0)
        into = p.into(shard)
        half = shard.total // 2
        await p.feed(shard, [half * k // 32 for k in range(1, 33)], 0.1)  # half of it in 3.2 s
        task = asyncio.ensure_future(p.read(into, 0, shard.total))
        await asyncio.sleep(0.3)
        if task.done():
            err = task.exception()
            raise AssertionError(
                "a read of a partial holder ended before its holder process was killed: "
                + (f"raised {type(err).__name__} ({err})" if err else f"returned {task.result()}")
            )
        t0 = time.monotonic()
        await p.kill_holder()
        what = "a read in flight when its holder process was killed"
        await _fails(_bounded(task, what, _PROMPT), what)
        took = time.monotonic() - t0
        _expect(took < _PROMPT, f"the read took {took:.1f} s to fail after the holder process was killed")
        what = "a read from a holder whose process was killed"
        await _fails(_bounded(p.read(into, 0, 100), what, _PROMPT), what)


async def _close_while_waiting(ctx: _Ctx, p: _Pair, side: str) -> tuple[_Shard, ShardBuffers]:
    """Start a read of a range the holder does not have yet, close ``side`` ("holder" or
    "reader") while it waits, and expect the read to fail promptly. Returns (shard, into)."""
    shard = ctx.shard()
    await p.hold(shard, verified=0)
    into = p.into(shard)
    task = asyncio.ensure_future(p.read(into, 0, 100))
    await asyncio.sleep(0.1)
    _expect(not task.done(), "a read of an uncovered range ended before the wait")
    t0 = time.monotonic()
    if side == "holder":
        await p.close_holder()
    else:
        await _bounded(p.reader.close(), f"{side} close()", _CLOSE_TIMEOUT)
    what = f"a read waiting when its {side} closed"
    await _fails(_bounded(task, what, _PROMPT), what)
    took = time.monotonic() - t0
    _expect(took < _PROMPT, f"the read took {took:.1f} s to fail after the {side} closed")
    return shard, into


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


@_check("close_reader")
async def _close_reader(ctx: _Ctx) -> None:
    """Closing a reader fails its read in flight promptly (TransportError, not RangeNotReady,
    long before a 30 s wait); reads after close raise TransportError; a second close() is
    harmless."""
    async with ctx.pair(wait_timeout=_LONG_WAIT) as p:
        shard, into = await _close_while_waiting(ctx, p, "reader")
        await p.advance(shard, shard.total)
        await _fails(p.read(into, 0, 100), "a read on a closed reader")
        await _bounded(p.reader.close(), "a second reader close()", _CLOSE_TIMEOUT)


@_check("close_holder")
async def _close_holder(ctx: _Ctx) -> None:
    """Reads from a holder that closed raise TransportError (not RangeNotReady), from a
    connection made before the close and from a new one; a second close() is harmless."""
    shard = ctx.shard()
    async with ctx.pair() as p:
        await p.hold(shard)
        into = p.into(shard)
        await p.read(into, 0, 100)
        await p.close_holder()
        for k in range(2):
            await _fails(p.read(into, 0, 100), f"read {k + 1} from a closed holder")
        await p.close_holder("a second holder close()")


def _no_cuda(t: Any) -> str | None:
    return None if torch.cuda.is_available() else "no CUDA device"


@_check("cuda_buffers", needs=_no_cuda)
async def _cuda_buffers(ctx: _Ctx) -> None:
    """With CUDA memory on the holder, the reader, or both, reads of random cuts land
    byte-exact (a transport without ``cuda`` stages through CPU memory)."""
    for src_dev, dst_dev in (("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")):
        shard = ctx.shard(device=src_dev)
        async with ctx.pair() as p:
            gen = await p.hold(shard)
            into = p.into(shard, device=dst_dev)
            got = await asyncio.gather(*(p.read(into, o, n) for o, n in _partition(ctx.rng, shard.total, 16)))
            _expect(set(got) == {gen}, f"reads returned generations {sorted(set(got))}, the holder's is {gen}")
            _same_bytes(_bytes(into), shard.data, f"reads from {src_dev} memory into {dst_dev} memory")


#: The checks, in the order they run, with what each asserts.
CHECKS: dict[str, str] = {name: " ".join((fn.__doc__ or "").split()) for name, (fn, _) in _REGISTRY.items()}


# --- the entry points ---------------------------------------------------------------------------


def _transport_class(spec: str) -> type[Transport]:
    """The class a registered name or a ``"module:Class"`` path names.

    Raises:
        InvalidArgument: no such transport, or it does not load or is not a Transport.
    """
    from transports.registry import get_transport

    if not isinstance(spec, str):
        raise InvalidArgument(f"a transport is named by a string, got {type(spec).__name__}")
    if ":" not in spec:
        return get_transport(spec)
    module, _, attr = spec.partition(":")
    if not (module and attr.isidentifier() and all(p.isidentifier() for p in module.split("."))):
        raise InvalidArgument(f"{spec!r} is not a 'package.module:Class' path")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception as err:  # whatever it raises on import, name the path
        raise InvalidArgument(f"transport {spec!r} does not load: {type(err).__name__}: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise InvalidArgument(f"{spec!r} is {cls!r}, not a subclass of tensorhub.Transport")
    return cls


def _checked(make: Callable[[dict[str, Any]], Any], label: str) -> Callable[[dict[str, Any]], Any]:
    def checked(options: dict[str, Any]) -> Any:
        t = make(dict(options))
        if not isinstance(t, Transport):
            raise InvalidArgument(f"the factory {label} made a {type(t).__name__}, not a Transport")
        return t

    return checked


def _factory(transport: str | TransportFactory) -> tuple[Callable[[dict[str, Any]], Any], str]:
    if isinstance(transport, str):
        return _checked(_transport_class(transport), transport), transport
    if callable(transport):
        label = getattr(transport, "__qualname__", repr(transport))
        return _checked(transport, label), label
    raise InvalidArgument(f"check_transport takes a transport name or a factory, got {type(transport).__name__}")


def _path_of(transport: Any) -> str:
    """How the holder process finds ``transport``: its name or path, or the path of a class
    importable at module level."""
    if isinstance(transport, str):
        _transport_class(transport)  # fail here, with the reason, rather than in the child
        return transport
    if isinstance(transport, type) and issubclass(transport, Transport):
        path = f"{transport.__module__}:{transport.__qualname__}"
        if "<" not in path and "." not in transport.__qualname__ and transport.__module__ != "__main__":
            with contextlib.suppress(InvalidArgument):
                if _transport_class(path) is transport:
                    return path
    raise InvalidArgument(
        f"with holder_process=True the holder process makes the transport, so name it by its registered "
        f"name or a 'module:Class' path (or pass a class importable at module level), not {transport!r}"
    )


def _context(mp_context: Any) -> Any:
    """The multiprocessing context that starts holder processes (spawn unless told)."""
    context = mp_context
    if mp_context is None or isinstance(mp_context, str):
        try:
            context = multiprocessing.get_context(mp_context or "spawn")
        except ValueError as err:
            raise InvalidArgument(f"no start method {mp_context!r}: {err}") from err
    method = getattr(context, "get_start_method", lambda: None)()
    if method not in ("spawn", "forkserver"):
        raise InvalidArgument(
            f"the holder process starts with 'spawn' or 'forkserver' (forking a process that runs "
            f"threads is unsafe), not {method!r}"
        )
    return context


def _selected(skip: Iterable[str], only: Iterable[str] | None) -> list[str]:
    skip, chosen = set(skip), set(only) if only is not None else set(_REGISTRY)
    unknown = sorted((skip | chosen) - set(_REGISTRY))
    if unknown:
        raise InvalidArgument(f"unknown conformance checks {unknown}; known: {list(_REGISTRY)}")
    return [name for name in _REGISTRY if name in chosen and name not in skip]


async def check_transport_async(
    transport: str | TransportFactory,
    options: dict[str, Any] | None = None,
    *,
    seed: int | None = None,
    skip: Iterable[str] = (),
    only: Iterable[str] | None = None,
    large_bytes: int = 64 << 20,
    timeout: float = 60.0,
    holder_process: bool = False,
    mp_context: Any = None,
) -> dict[str, str]:
    """:func:`check_transport` on the running event loop."""
    seed = int(os.environ.get("TENSORHUB_SEED", DEFAULT_SEED)) if seed is None else seed
    if type(large_bytes) is not int or large_bytes < 1024:
        raise InvalidArgument(f"large_bytes must be an integer >= 1024, got {large_bytes!r}")
    options = dict(options or {})
    hosting: _InProcess | _InChild
    if holder_process:
        path = _path_of(transport)
        make, label = _checked(_transport_class(path), path), path
        try:
            msgpack.packb(options, use_bin_type=True, strict_types=True)
        except (TypeError, ValueError, OverflowError) as err:
            raise InvalidArgument(f"with holder_process=True the options go to the holder process as msgpack: {err}") from err
        hosting = _InChild(_context(mp_context), path)  # starts its process when a check needs it
    else:
        make, label = _factory(transport)
        hosting = _InProcess()
    names = _selected(skip, only)
    probe = make(dict(options))  # capability flags, and whether the options are accepted
    outcome: dict[str, str] = {}
    loop = asyncio.get_running_loop()
    try:
        for name in names:
            fn, needs = _REGISTRY[name]
            why = needs(probe)
            if why is not None:
                outcome[name] = f"skipped: {why}"
                continue
            ctx = _Ctx(name, random.Random(f"{seed}:{name}"), make, dict(options), large_bytes, loop, hosting,
                       gathers=bool(getattr(probe, "gathers", False)))  # fmt: skip
            prefix = f"check_transport({label}): check {name!r} failed (seed={seed})"
            try:
                await _bounded(fn(ctx), "the check", timeout)
            except AssertionError as err:
                raise AssertionError(f"{prefix}: {err}") from err
            except Exception as err:
                raise AssertionError(f"{prefix}: {type(err).__name__}: {err}") from err
            outcome[name] = "passed"
    finally:
        with contextlib.suppress(Exception):
            await _bounded(probe.close(), "close() of a transport that never started", _CLOSE_TIMEOUT)
        await hosting.close()
        _shard_data.cache_clear()
    return outcome


def check_transport(
    transport: str | TransportFactory,
    options: dict[str, Any] | None = None,
    *,
    seed: int | None = None,
    skip: Iterable[str] = (),
    only: Iterable[str] | None = None,
    large_bytes: int = 64 << 20,
    timeout: float = 60.0,
    holder_process: bool = False,
    mp_context: Any = None,
) -> dict[str, str]:
    """Run the transport conformance suite; every transport's tests call this.

    It makes fresh instances for each check (a holder and one or more readers) with
    ``options`` plus a ``wait_timeout`` the check chooses, and runs the checks of
    :data:`CHECKS` in order on an event loop of its own (use :func:`check_transport_async`
    from a running loop). The readers run in this process; the holder too, unless
    ``holder_process``: then it runs in a child process (see "Across processes" in the module
    docstring for the checks that differ), e.g.
    ``check_transport("nixl", {"describe_timeout": 10.0}, holder_process=True)``. With the
    default ``spawn`` the child imports the caller's main module again: a script that calls
    this must do so under ``if __name__ == "__main__":``.

    Args:
        transport: a registered transport name, a ``"module:Class"`` path, a Transport
            subclass, or a factory called with an options dict that returns a Transport
            instance (e.g. one wrapped in faults). With ``holder_process`` only a name, a path
            or a class importable at module level will do: the child makes the holder.
        options: the transport's options (the suite sets ``wait_timeout`` itself); msgpack data
            with ``holder_process``.
        seed: seeds every random choice; default ``$TENSORHUB_SEED`` or :data:`DEFAULT_SEED`.
        skip: names of checks that do not apply to this transport (say why in the caller).
        only: run just these checks.
        large_bytes: size of the large read (default 64 MiB).
        timeout: seconds one check may take.
        holder_process: run the holder side of every check in a child process (one for the
            whole call, replaced after ``peer_death`` kills it; gone when this returns).
        mp_context: how to start that process: ``"spawn"`` (default), ``"forkserver"``, or a
            multiprocessing context of either kind (a test suite's forkserver that preloads
            torch starts it in a fraction of a second).

    Returns:
        ``{check name: "passed" | "skipped: <why>"}``; checks the capability flags or the machine
        rule out (``cuda_buffers`` without a CUDA device) are skipped, not failed.

    Raises:
        AssertionError: a check failed; the message names the check, the transport and the seed.
        InvalidArgument: an unknown check name, a factory that does not make a Transport, or
            (``holder_process``) a transport the child cannot make, options that are not
            msgpack data, or a start method other than spawn or forkserver.
    """
    return run(
        check_transport_async(
            transport,
            options,
            seed=seed,
            skip=skip,
            only=only,
            large_bytes=large_bytes,
            timeout=timeout,
            holder_process=holder_process,
            mp_context=mp_context,
        )
    )
