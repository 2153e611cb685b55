"""Conformance checks of a started transport's endpoint (``start_endpoint``,
``endpoint_msgpack``) and of ``expose``/``withdraw`` (``expose_withdraw``)."""

from __future__ import annotations

from tensorhub.testing.assertions import _check_endpoint, _expect, _fails, _same_bytes
from tensorhub.testing.pairs import _Ctx
from tensorhub.testing.registry import _check
from tensorhub.testing.shards import _bytes


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
