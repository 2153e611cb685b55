"""Conformance checks of the seqlock: the ``generation`` argument (``seqlock_between``) and a
generation that moves during a read (``seqlock_during``: moved by a hook inside the holder's
copy; across processes, also a holder that changes its holding in a tight loop)."""

from __future__ import annotations

import asyncio

from tensorhub.testing.assertions import _expect, _failed_as_expected, _fails, _same_bytes
from tensorhub.testing.limits import VERSION
from tensorhub.testing.pairs import _Ctx
from tensorhub.testing.registry import _check
from tensorhub.testing.shards import _bytes, _partition


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
    """A read across which the holder's generation moves (bumped by a hook on the holder's
    buffers right after the transport took their memory to copy it, in this process or in the
    holder process: deterministic, not a race) raises TransportError (not RangeNotReady), be it
    a small read (one request) or the whole shard (which a transport may split); the same read
    afterwards returns the new generation with the right bytes. Across processes, then also:
    while the holder process changes its holding in a tight loop, every read fails so or
    returns a generation the holder had with exactly that generation's bytes (a one-sided
    transport, which runs no holder code during a read, gets only this part)."""
    shard = ctx.shard()
    async with ctx.pair() as p:
        before = await p.hold(shard)
        into = p.into(shard)
        fired = []
        for offset, length in ((0, min(_ONE_REQUEST, shard.total)), (0, shard.total)):
            await p.arm_change(shard)
            outcome: int | BaseException
            try:
                outcome = await p.read(into, offset, length)
            except AssertionError:
                raise
            except Exception as err:  # noqa: BLE001 - judged below, once it is known whether the hook ran
                outcome = err
            what = f"a read of bytes [{offset}, {offset + length}) across which the holder's generation moved"
            if await p.disarm(shard):
                fired.append(length)
                if not isinstance(outcome, BaseException):
                    raise AssertionError(f"{what}: returned normally; it must raise TransportError")
                _failed_as_expected(outcome, what)
            elif isinstance(outcome, BaseException):  # nothing changed, so it had to succeed
                raise AssertionError(f"a read of bytes [{offset}, {offset + length}) of a holding that did not change "
                                     f"raised {type(outcome).__name__}: {outcome}") from outcome  # fmt: skip
        if fired:
            got = await p.read(into, 0, shard.total)
            _expect(got == before + len(fired), f"the read after the changes returned generation {got}, "
                                                f"the holder's is {before + len(fired)}")  # fmt: skip
            _same_bytes(_bytes(into), shard.data, "the read after the generation changes")
        else:
            _expect(ctx.processes, (
                "the transport never read the holder's memory through ShardBuffers.views()/copy_out(), so "
                "the suite cannot move the generation during a read; skip 'seqlock_during' for it"
            ))
    if ctx.processes:
        await _seqlock_churn(ctx)


_ONE_REQUEST = 4096  # a read no transport splits: a change inside one request's copy


_CHURN_ROUNDS = 6  # rounds of reads while the holder process churns


async def _seqlock_churn(ctx: _Ctx) -> None:
    """``seqlock_during`` across processes (see "Across processes" in the package docstring)."""
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
        gen = await p.read(whole, 0, shard.total)
        _expect(gen == last, f"the read after the changes stopped returned generation {gen}, the holder's is {last}")
        _same_bytes(_bytes(whole), contents[(last - first) % 2], "the read after the changes stopped")
