"""Conformance checks of reads: byte-exact ranges of every size and place (``odd_ranges``,
``tiny_ranges``, ``large_range``, ``concurrent_readers``), a partial holder (``partial_holder``,
``range_not_ready``), and reads that must fail naming themselves (``wrong_version``,
``unknown_region``, ``out_of_range``)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from tensorhub.testing.assertions import _expect, _fails, _names_the_read, _same_bytes
from tensorhub.testing.limits import _PROMPT, REGION, SENTINEL, VERSION
from tensorhub.testing.pairs import _Ctx
from tensorhub.testing.registry import _check
from tensorhub.testing.shards import _bytes, _partition


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
