"""Testing helpers that ship with the library: the transport conformance suite.

Theory of operation
-------------------
:func:`check_transport` takes a transport (a registered name, a class, or a factory called with
an options dict) and runs named checks against it, each on fresh instances: a *holder* that
serves :class:`~tensorhub.buffers.ShardBuffers` through a resolver (a dict of
``(region, version) -> buffers``, as the engine's resolver would answer), and one or more
*readers* that read from it over the transport, all on one event loop in this process. Every
check is bounded (each read, each close and each check has a timeout), so a transport that
hangs fails the suite instead of hanging it.

What the checks compare is the shard's *transfer byte space*: the holder's space is filled with
seeded random bytes through :meth:`ShardBuffers.views`, and a reader's bytes are read back the
same way. The suite never looks at the tensors themselves (tiny ones live in packs).

The holder's buffers are a subclass of ShardBuffers whose ``views``/``copy_out`` can run a hook
once, after the transport took the memory to copy it: that is how the suite changes the
generation (the seqlock checks) or closes the holder (peer death) *during* a read,
deterministically. A transport that never reads the holder's memory through those methods (a
true RDMA transport) cannot be checked this way: those two checks then fail saying so, and its
tests skip them.

Randomness comes from one seed (:data:`DEFAULT_SEED`, from ``$TENSORHUB_SEED`` like the test
suite's); each check derives its own generator from the seed and its name, so a check does the
same thing whichever others run. The seed is in every failure message.

Failures are :class:`AssertionError` naming the check (``check 'seqlock_during' failed``), the
transport and the seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from transports.base import RangeNotReady, Transport

from .actor import run
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


@dataclass
class _Shard:
    """A holder's buffers filled with ``data``, and how to make readers' buffers for it."""

    specs: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
    data: bytes
    buffers: _HookedBuffers
    bounds: list[int]  # where one region of the transfer space ends and the next begins
    device: str = "cpu"

    @property
    def total(self) -> int:
        return len(self.data)

    def fresh(self, device: str | None = None, fill: int = SENTINEL) -> ShardBuffers:
        """Reader buffers of the same layout, every byte ``fill``."""
        tensors = _zeros(self.specs, device or self.device)
        buf = ShardBuffers(tensors, layout_of(tensors))
        _write(buf, 0, bytes([fill]) * buf.total_bytes)
        return buf


def _zeros(specs: tuple, device: str) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s, dtype=d, device=device) for n, d, s in specs}


def _make_shard(specs: tuple, rng: random.Random, device: str = "cpu", filled: bool = True) -> _Shard:
    tensors = _zeros(specs, device)
    buf = _HookedBuffers(tensors, layout_of(tensors))
    data = rng.randbytes(buf.total_bytes)
    if filled:
        _write(buf, 0, data)
    # Region boundaries, from a CPU twin (views do not work on CUDA memory).
    cpu = _zeros(specs, "cpu") if buf.on_cuda else tensors
    twin = buf if not buf.on_cuda else ShardBuffers(cpu, layout_of(cpu))
    bounds, pos = [], 0
    for v in ShardBuffers.views(twin, 0, twin.total_bytes):
        pos += len(v)
        if 0 < pos < twin.total_bytes:
            bounds.append(pos)
    return _Shard(specs, data, buf, sorted(set(bounds)), device)


def _mixed(rng: random.Random, device: str = "cpu", filled: bool = True) -> _Shard:
    return _make_shard(_MIXED, rng, device, filled)


def _large(rng: random.Random, nbytes: int) -> _Shard:
    return _make_shard((("head", torch.float16, (1001,)), ("big", torch.uint8, (nbytes,)), ("tail", torch.int32, (777,))), rng)


def _partition(rng: random.Random, total: int, cuts: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut at ``cuts`` random places: (offset, length) pairs."""
    points = sorted({0, total, *rng.sample(range(1, total), min(cuts, total - 1))})
    return [(a, b - a) for a, b in itertools.pairwise(points)]


def _first_difference(got: bytes, want: bytes) -> str:
    if len(got) != len(want):
        return f"{len(got)} bytes instead of {len(want)}"
    for i in range(0, len(want), 1 << 16):
        if got[i : i + (1 << 16)] != want[i : i + (1 << 16)]:
            j = next(k for k in range(i, min(i + (1 << 16), len(want))) if got[k] != want[k])
            return f"first difference at transfer byte {j}: got {got[j]:#04x}, want {want[j]:#04x}"
    return "no difference"


def _expect(ok: object, message: str) -> None:
    """A check's assertion (not ``assert``: the suite must also fail under ``python -O``)."""
    if not ok:
        raise AssertionError(message)


def _same_bytes(got: bytes, want: bytes, what: str) -> None:
    if got != want:
        raise AssertionError(f"{what}: the bytes differ ({_first_difference(got, want)})")


# --- transports under test ----------------------------------------------------------------------


@dataclass
class _Ctx:
    """What a check gets: its random source, and how to make transports."""

    name: str
    rng: random.Random
    make: Callable[[dict[str, Any]], Any]
    options: dict[str, Any]
    large_bytes: int
    loop: asyncio.AbstractEventLoop

    def new(self, wait_timeout: float) -> Any:
        return self.make({**self.options, "wait_timeout": wait_timeout})

    @contextlib.asynccontextmanager
    async def pair(self, wait_timeout: float = 5.0, readers: int = 1) -> AsyncIterator[_Pair]:
        """A started holder serving a dict of holdings, and started readers; all closed after."""
        pair = _Pair(self)
        try:
            pair.holder = self.new(wait_timeout)
            await _bounded(pair.holder.start(), "holder start()")
            pair.started.append(pair.holder)
            pair.holder.serve(lambda region, version: pair.holdings.get((region, version)))
            for _ in range(readers):
                r = self.new(wait_timeout)
                await _bounded(r.start(), "reader start()")
                pair.started.append(r)
                pair.readers.append(r)
            yield pair
        except BaseException:
            await pair.teardown(quiet=True)  # the check's own failure is the one to report
            raise
        await pair.teardown(quiet=False)


@dataclass
class _Pair:
    ctx: _Ctx
    holder: Any = None
    readers: list[Any] = field(default_factory=list)
    started: list[Any] = field(default_factory=list)
    holdings: dict[tuple[int, int], ShardBuffers] = field(default_factory=dict)

    @property
    def reader(self) -> Any:
        return self.readers[0]

    async def teardown(self, quiet: bool) -> None:
        """Wake whatever still waits on a holding, then close every transport (each bounded);
        raise the first close that failed unless ``quiet``."""
        for buf in self.holdings.values():
            buf.progress.reset(None)
        failed: BaseException | None = None
        for t in reversed(self.started):
            try:
                await _bounded(t.close(), f"close() of {type(t).__name__}", _CLOSE_TIMEOUT)
            except Exception as err:  # noqa: BLE001 - close the others first, then report it
                failed = failed or err
        if failed is not None and not quiet:
            raise failed

    def hold(self, buf: ShardBuffers, region: int = REGION, version: int = VERSION, verified: int | None = None) -> int:
        """Serve ``buf`` as (region, version), verified up to ``verified`` (all by default)."""
        self.holdings[(region, version)] = buf
        self.holder.expose(buf)
        return buf.progress.reset(version, buf.total_bytes if verified is None else verified)

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
        peer = self.holder.endpoint()
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
        if not_ready is True and not isinstance(err, RangeNotReady):
            raise AssertionError(f"{what}: raised {type(err).__name__} ({err}), not RangeNotReady") from err
        if not_ready is False and isinstance(err, RangeNotReady):
            raise AssertionError(f"{what}: raised RangeNotReady ({err}); a retry cannot help here") from err
        return err
    except AssertionError:
        raise
    except Exception as err:
        raise AssertionError(f"{what}: raised {type(err).__name__} ({err}), not a TransportError") from err
    raise AssertionError(f"{what}: returned normally; it must raise TransportError")


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
        ep = p.holder.endpoint()
        _expect(isinstance(ep, dict) and ep, f"endpoint() must be a non-empty dict, got {ep!r}")
        again = p.holder.endpoint()
        _expect(again == ep, f"endpoint() changed between two calls: {ep!r} then {again!r}")
        other = p.reader.endpoint()
        _expect(other != ep, f"two started instances have the same endpoint {ep!r}: readers could not tell them apart")


@_check("endpoint_msgpack")
async def _endpoint_msgpack(ctx: _Ctx) -> None:
    """The endpoint is plain msgpack data (None, bool, int, float, str, bytes, lists, str-keyed
    maps; no tuples, no objects, nested at most as deep as the control plane carries) and
    comes back from a strict msgpack round trip unchanged, types included."""
    async with ctx.pair() as p:
        for who, t in (("holder", p.holder), ("reader", p.reader)):
            ep = t.endpoint()
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
    shard = _mixed(ctx.rng)
    async with ctx.pair() as p:
        p.hold(shard.buffers)
        into = p.into(shard)
        await p.read(into, 0, 100)
        p.holder.withdraw(shard.buffers)
        if p.holder.one_sided:
            await _fails(p.read(into, 0, 100), "a one-sided read of withdrawn buffers")
        p.holder.expose(shard.buffers)
        gen = shard.buffers.progress.generation
        got = await p.read(into, 0, shard.total)
        _expect(got == gen, f"the read returned generation {got}, the holder's is {gen}")
        _same_bytes(_bytes(into), shard.data, "a read after withdraw and expose again")
        p.reader.withdraw(into)
        p.holder.withdraw(shard.buffers)


@_check("odd_ranges")
async def _odd_ranges(ctx: _Ctx) -> None:
    """Reads of seeded random cuts of a shard of many dtypes (float32, bfloat16, float8_e4m3fn,
    int64, int8, bool, float16, float64, an empty tensor; packed tiny tensors and large ones),
    all at once, land byte-exact and return the holder's generation; reads straddling every
    region boundary land exactly their bytes and nothing outside them."""
    shard = _mixed(ctx.rng)
    async with ctx.pair() as p:
        gen = p.hold(shard.buffers)
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
    shard = _mixed(ctx.rng)
    async with ctx.pair() as p:
        gen = p.hold(shard.buffers)
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
    shard = _large(ctx.rng, ctx.large_bytes)
    async with ctx.pair() as p:
        gen = p.hold(shard.buffers)
        into = p.into(shard)
        got = await p.read(into, 1, shard.total - 2)
        _expect(got == gen, f"the read returned generation {got}, the holder's is {gen}")
        want = bytes([SENTINEL]) + shard.data[1:-1] + bytes([SENTINEL])
        _same_bytes(_bytes(into), want, f"a read of {shard.total - 2} bytes")


@_check("concurrent_readers")
async def _concurrent_readers(ctx: _Ctx) -> None:
    """Four reader instances read the whole shard at once, each in its own random cuts, all
    their reads in flight together; every reader gets every byte."""
    shard = _mixed(ctx.rng)
    async with ctx.pair(readers=4) as p:
        gen = p.hold(shard.buffers)
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
    shard = _mixed(ctx.rng, filled=False)
    feed_rng = random.Random(ctx.rng.random())
    steps = sorted({shard.total, *feed_rng.sample(range(1, shard.total), 23)})
    stop = threading.Event()
    buf = shard.buffers

    def feed() -> None:
        done = 0
        for end in steps:
            if stop.wait(0.005):
                return
            _write(buf, done, shard.data[done:end])
            buf.progress.advance(end)
            done = end

    async with ctx.pair(wait_timeout=5.0) as p:
        gen = p.hold(buf, verified=0)
        into = p.into(shard)
        ranges = _partition(ctx.rng, shard.total, 12)
        tasks = [asyncio.ensure_future(p.read(into, o, n)) for o, n in ranges]
        feeder = threading.Thread(target=feed, name="conformance-feed", daemon=True)
        try:
            await asyncio.sleep(0.05)
            early = [ranges[k] for k, t in enumerate(tasks) if t.done()]
            _expect(not early, f"reads of {early} ended before any byte was verified")
            feeder.start()
            got = await asyncio.gather(*tasks)
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if feeder.is_alive():
                feeder.join(5.0)
        _expect(set(got) == {gen}, f"reads returned generations {sorted(set(got))}, the holder's is {gen}")
        _same_bytes(_bytes(into), shard.data, "reads from a partial holder")


@_check("range_not_ready")
async def _range_not_ready(ctx: _Ctx) -> None:
    """With ``wait_timeout`` 0.3 s: a range past the holder's progress raises RangeNotReady,
    soon after the wait; so does a read from buffers that do not hold the version yet (a
    partial holder granted before its own grant reached it); the covered prefix still reads."""
    wait = 0.3
    shard = _mixed(ctx.rng)
    half = shard.total // 2
    async with ctx.pair(wait_timeout=wait) as p:
        p.hold(shard.buffers, verified=half)
        not_yet = shard.fresh()
        p.hold(not_yet, region=REGION + 1)
        not_yet.progress.reset(None)
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
    shard = _mixed(ctx.rng)
    async with ctx.pair(wait_timeout=0.5) as p:
        p.hold(shard.buffers)
        into = p.into(shard)
        for offset, length in ranges(shard.total):
            where = f"{what} (bytes [{offset}, {offset + length}) of a {shard.total}-byte shard)"
            for _ in range(2):  # twice: the first failure must not leave the connection broken
                err = await _fails(p.read(into, offset, length, region=region, version=version), where)
                _names_the_read(err, p.holder.endpoint(), region, version, offset, where)
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
    shard = _mixed(ctx.rng)
    async with ctx.pair() as p:
        g1 = p.hold(shard.buffers)
        into = p.into(shard)
        got = await p.read(into, 0, 100, g1)
        _expect(got == g1, f"a read passing generation {g1} returned {got}")
        g2 = shard.buffers.progress.reset(VERSION, shard.total)
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
    afterwards returns the new generation with the right bytes."""
    shard = _mixed(ctx.rng)
    buf = shard.buffers
    async with ctx.pair() as p:
        before = p.hold(buf)
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


@_check("peer_death")
async def _peer_death(ctx: _Ctx) -> None:
    """The holder closes while a large read copies from it: the read raises TransportError
    (not RangeNotReady), does not hang and does not return normally; the holder closing while a
    read waits for a partial holder's progress fails that read too, promptly (not
    RangeNotReady)."""
    shard = _large(ctx.rng, min(ctx.large_bytes, 8 << 20))
    buf = shard.buffers
    loop = ctx.loop

    async with ctx.pair(wait_timeout=_LONG_WAIT) as dying:

        def close_holder() -> None:
            # Runs in whichever thread copies the holder's memory; the close runs on the loop.
            if _on_loop(loop):
                loop.create_task(dying.holder.close())  # cannot block the loop; the read then returns normally
                return
            done = asyncio.run_coroutine_threadsafe(dying.holder.close(), loop)
            with contextlib.suppress(Exception):
                done.result(_CLOSE_TIMEOUT)

        dying.hold(buf)
        into = dying.into(shard)
        buf.arm(close_holder)
        await _fails(dying.read(into, 0, shard.total), "a read during which the holder closed")
        _expect(buf.hook_fired, (
            "the transport never read the holder's memory through ShardBuffers.views()/copy_out(), so "
            "the suite cannot close the holder during a read; skip 'peer_death' for it"
        ))

    async with ctx.pair(wait_timeout=_LONG_WAIT) as p:
        await _close_while_waiting(ctx, p, "holder")


async def _close_while_waiting(ctx: _Ctx, p: Any, side: str) -> tuple[Any, ShardBuffers]:
    """Start a read of a range the holder does not have yet, close ``side`` ("holder" or
    "reader") while it waits, and expect the read to fail promptly. Returns (shard, into)."""
    shard = _mixed(ctx.rng)
    p.hold(shard.buffers, verified=0)
    into = p.into(shard)
    task = asyncio.ensure_future(p.read(into, 0, 100))
    await asyncio.sleep(0.1)
    _expect(not task.done(), "a read of an uncovered range ended before the wait")
    t0 = time.monotonic()
    await _bounded(getattr(p, side).close(), f"{side} close()", _CLOSE_TIMEOUT)
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
        shard.buffers.progress.advance(shard.total)
        await _fails(p.read(into, 0, 100), "a read on a closed reader")
        await _bounded(p.reader.close(), "a second reader close()", _CLOSE_TIMEOUT)


@_check("close_holder")
async def _close_holder(ctx: _Ctx) -> None:
    """Reads from a holder that closed raise TransportError (not RangeNotReady), from a
    connection made before the close and from a new one; a second close() is harmless."""
    shard = _mixed(ctx.rng)
    async with ctx.pair() as p:
        p.hold(shard.buffers)
        into = p.into(shard)
        await p.read(into, 0, 100)
        await _bounded(p.holder.close(), "holder close()", _CLOSE_TIMEOUT)
        for k in range(2):
            await _fails(p.read(into, 0, 100), f"read {k + 1} from a closed holder")
        await _bounded(p.holder.close(), "a second holder close()", _CLOSE_TIMEOUT)


def _no_cuda(t: Any) -> str | None:
    return None if torch.cuda.is_available() else "no CUDA device"


@_check("cuda_buffers", needs=_no_cuda)
async def _cuda_buffers(ctx: _Ctx) -> None:
    """With CUDA memory on the holder, the reader, or both, reads of random cuts land
    byte-exact (a transport without ``cuda`` stages through CPU memory)."""
    for src_dev, dst_dev in (("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")):
        shard = _mixed(ctx.rng, device=src_dev)
        async with ctx.pair() as p:
            gen = p.hold(shard.buffers)
            into = p.into(shard, device=dst_dev)
            got = await asyncio.gather(*(p.read(into, o, n) for o, n in _partition(ctx.rng, shard.total, 16)))
            _expect(set(got) == {gen}, f"reads returned generations {sorted(set(got))}, the holder's is {gen}")
            _same_bytes(_bytes(into), shard.data, f"reads from {src_dev} memory into {dst_dev} memory")


#: The checks, in the order they run, with what each asserts.
CHECKS: dict[str, str] = {name: " ".join((fn.__doc__ or "").split()) for name, (fn, _) in _REGISTRY.items()}


# --- the entry points ---------------------------------------------------------------------------


def _factory(transport: str | TransportFactory) -> tuple[Callable[[dict[str, Any]], Any], str]:
    from transports.registry import get_transport

    if isinstance(transport, str):
        cls = get_transport(transport)
        label = transport
        make: Callable[[dict[str, Any]], Any] = cls
    elif callable(transport):
        make = transport
        label = getattr(transport, "__qualname__", repr(transport))
    else:
        raise InvalidArgument(f"check_transport takes a transport name or a factory, got {type(transport).__name__}")

    def checked(options: dict[str, Any]) -> Any:
        t = make(dict(options))
        if not isinstance(t, Transport):
            raise InvalidArgument(f"the factory {label} made a {type(t).__name__}, not a Transport")
        return t

    return checked, label


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
) -> dict[str, str]:
    """:func:`check_transport` on the running event loop."""
    seed = int(os.environ.get("TENSORHUB_SEED", DEFAULT_SEED)) if seed is None else seed
    if type(large_bytes) is not int or large_bytes < 1024:
        raise InvalidArgument(f"large_bytes must be an integer >= 1024, got {large_bytes!r}")
    make, label = _factory(transport)
    names = _selected(skip, only)
    probe = make(dict(options or {}))  # capability flags, and whether the options are accepted
    outcome: dict[str, str] = {}
    loop = asyncio.get_running_loop()
    try:
        for name in names:
            fn, needs = _REGISTRY[name]
            why = needs(probe)
            if why is not None:
                outcome[name] = f"skipped: {why}"
                continue
            ctx = _Ctx(name, random.Random(f"{seed}:{name}"), make, dict(options or {}), large_bytes, loop)
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
) -> dict[str, str]:
    """Run the transport conformance suite; every transport's tests call this.

    It makes fresh instances for each check (a holder and one or more readers, in this process)
    with ``options`` plus a ``wait_timeout`` the check chooses, and runs the checks of
    :data:`CHECKS` in order on an event loop of its own (use :func:`check_transport_async`
    from a running loop).

    Args:
        transport: a registered transport name, a Transport subclass, or a factory called with
            an options dict that returns a Transport instance (e.g. one wrapped in faults).
        options: the transport's options (the suite sets ``wait_timeout`` itself).
        seed: seeds every random choice; default ``$TENSORHUB_SEED`` or :data:`DEFAULT_SEED`.
        skip: names of checks that do not apply to this transport (say why in the caller).
        only: run just these checks.
        large_bytes: size of the large read (default 64 MiB).
        timeout: seconds one check may take.

    Returns:
        ``{check name: "passed" | "skipped: <why>"}``; checks the capability flags or the machine
        rule out (``cuda_buffers`` without a CUDA device) are skipped, not failed.

    Raises:
        AssertionError: a check failed; the message names the check, the transport and the seed.
        InvalidArgument: an unknown check name, or a factory that does not make a Transport.
    """
    return run(
        check_transport_async(
            transport, options, seed=seed, skip=skip, only=only, large_bytes=large_bytes, timeout=timeout
        )
    )
