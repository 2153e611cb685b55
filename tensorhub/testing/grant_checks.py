"""Conformance checks of grant tokens (``grant_tokens``), for transports that check them
(``checks_grants``; see "Grant tokens" in the plugin author's manual)."""

from __future__ import annotations

from typing import Any

from tensorhub.testing.assertions import _expect, _fails, _same_bytes
from tensorhub.testing.limits import SENTINEL, VERSION
from tensorhub.testing.pairs import _Ctx
from tensorhub.testing.registry import _check
from tensorhub.testing.shards import _bytes
from tensorhub.transports.base import Unauthorized

#: The token the suite's grant check admits (any bytes do: the transport only carries them).
GRANTED = b"conformance-granted-" + bytes(range(41))


def _checks_grants(t: Any) -> str | None:
    if getattr(t, "checks_grants", False):
        return None
    return "the transport checks no grant tokens (checks_grants is False): its data plane is open"


@_check("grant_tokens", _checks_grants)
async def _grant_tokens(ctx: _Ctx) -> None:
    """With a grant check installed on the holder (``guard``), a read that shows no token, or
    another token, fails with Unauthorized (not RangeNotReady), writes nothing into the
    destination, and reaches the check (which counts it); a read that shows the admitted token
    lands byte-exact, also after the refusals (a refused reader is not locked out). Without a
    check installed, reads with or without a token are served."""
    shard = ctx.shard()
    async with ctx.pair(readers=2) as p:
        gen = await p.hold(shard)
        # (another reader: one that was served keeps what it was told, as one-sided ones do)
        other = p.readers[1]
        early = p.into(shard, reader=other)
        got = await p.read(early, 0, 64, token=None, reader=other)  # no check installed: all admitted
        _expect(got == gen, f"a read returned generation {got}, the holder's is {gen}")
        other.withdraw(early)

        await p.guard(GRANTED)
        into = p.into(shard)
        for token, what in ((None, "a read without a token"), (b"forged-" + GRANTED[7:], "a read with a forged token")):
            err = await _fails(p.read(into, 0, shard.total, token=token), what)
            _expect(isinstance(err, Unauthorized), f"{what} raised {type(err).__name__} ({err}), not Unauthorized")
        _same_bytes(_bytes(into), bytes([SENTINEL]) * shard.total, "the destination after refused reads (nothing may land)")
        refused = await p.refusals()
        _expect(refused >= 2, f"the holder's grant check saw {refused} refusals of 2 refused reads: the transport served "
                              "without asking it")  # fmt: skip

        got = await p.read(into, 0, shard.total, token=GRANTED, version=VERSION)
        _expect(got == gen, f"a read with the admitted token returned generation {got}, the holder's is {gen}")
        _same_bytes(_bytes(into), shard.data, "a read with the admitted token")
        p.reader.withdraw(into)
