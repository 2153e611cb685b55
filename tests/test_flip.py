"""Replicate-then-flip: a handle owns a second (shadow) registered set.

- ``register_shadow()`` allocates it like the registered tensors and says what it costs;
  where it does not fit (``max_bytes``, the device's free memory) it registers nothing and
  returns 0, and ``flip()`` is then ``update()`` in place;
- ``prefetch("latest")`` pulls the next version into the shadow set in the background while
  the active tensors keep their version, untouched; ``flip()`` swaps the sets: ``tensors`` and
  ``version`` are then the new ones, and after two flips the original tensors are active
  again; the set left behind still holds (and serves) its version;
- across the shards of a replica, prefetch and ``flip(wait=False)`` decide once for all:
  every shard flips at the same call, to the same version;
- a prefetch of a version that goes away is raised by flip(), the active set untouched;
- close() and unregister() drop the shadow set on the server too.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tensorhub.core.errors import VersionUnavailable
from tensorhub.handles.api import open_async, shadow_replica

from .procs import ServerProcess

TRANSPORTS = {"tcp": {}}


def content(version: int, shard: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * version + shard)
    return {"big": torch.randn(1 << 18, generator=g), "tiny": torch.randn(5, generator=g), "ids": torch.arange(9) * version}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b)


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s.address
    assert s.stop() == 0


async def _trainer(addr: str, model: str, num_shards: int = 1):
    ts, ws = [], []
    for i in range(num_shards):
        t = await open_async(model, "trainer", num_shards=num_shards, shard_idx=i, server=addr, transports=TRANSPORTS)
        w = {k: torch.zeros_like(v) for k, v in content(0, i).items()}
        await t.register(w)
        ts.append(t)
        ws.append(w)

    async def publish(v: int) -> None:
        async def one(i: int) -> None:
            if ts[i].version is not None:
                await ts[i].unpublish()
            for k, x in content(v, i).items():
                ws[i][k].copy_(x)
            await ts[i].publish(v)

        await asyncio.gather(*(one(i) for i in range(num_shards)))

    return ts, publish


def test_prefetch_keeps_serving_and_flip_swaps(server):
    async def main() -> None:
        ts, publish = await _trainer(server, "flip1")
        await publish(1)
        mine = {k: torch.zeros_like(v) for k, v in content(0).items()}
        r = await open_async("flip1", "r", server=server, transports=TRANSPORTS)
        await r.register(mine)
        assert await r.replicate("latest") == 1
        assert await r.prefetch() is None  # no shadow set yet: nothing to prefetch into
        cost = await r.register_shadow()
        assert cost == r.shadow_bytes >= sum(t.nbytes for t in mine.values())
        assert await r.prefetch() is None  # nothing newer than the active version
        assert await r.flip() is False

        await publish(2)
        assert await r.prefetch("latest") == 2
        assert await r.prefetch("latest") == 2  # pending: the same one, no second pull
        assert r.version == 1 and same(r.tensors, content(1))  # the active set keeps serving
        assert r.tensors["big"] is mine["big"]
        assert await r.flip() is True
        assert r.version == 2 and same(r.tensors, content(2)) and r.flips == 1
        assert r.tensors["big"] is not mine["big"] and same(mine, content(1))  # the old set still holds 1
        listing = await r.list()
        assert shadow_replica("r") in listing[2] and "r" in listing[1]  # both sets are holders
        assert r.replica == shadow_replica("r")  # the active set's replica on the server

        await publish(3)
        assert await r.prefetch() == 3
        await asyncio.wait_for(_until(lambda: r.prefetched == 3), 30)
        assert await r.flip(wait=False) is True
        assert r.version == 3 and r.tensors["big"] is mine["big"] and same(mine, content(3))
        assert r.replica == "r"

        # update() still works on the active set, and a stale prefetch is then not flipped to
        await publish(4)
        assert await r.prefetch() == 4
        await asyncio.wait_for(_until(lambda: r.prefetched == 4), 30)
        await publish(5)
        assert await r.update() is True and r.version == 5
        assert await r.flip() is False and r.version == 5 and same(r.tensors, content(5))

        await r.close()
        await _until_async(lambda: _not_listed(ts[0], shadow_replica("r")))
        for t in ts:
            await t.close()

    asyncio.run(main())


def test_shards_of_a_replica_flip_together(server):
    async def main() -> None:
        ts, publish = await _trainer(server, "flip2", num_shards=2)
        await publish(1)
        rs, sets = [], []
        for i in range(2):
            h = await open_async("flip2", "r", num_shards=2, shard_idx=i, server=server, transports=TRANSPORTS)
            sets.append({k: torch.zeros_like(v) for k, v in content(0, i).items()})
            await h.register(sets[-1])
            rs.append(h)
        assert await asyncio.gather(*(h.replicate(1) for h in rs)) == [1, 1]
        assert all([c > 0 for c in await asyncio.gather(*(h.register_shadow() for h in rs))])
        await publish(2)
        assert await asyncio.gather(*(h.prefetch() for h in rs)) == [2, 2]
        # wait=False: every shard gets the same answer, ready or not, at every call
        for _ in range(400):
            flipped = await asyncio.gather(*(h.flip(wait=False) for h in rs))
            assert flipped[0] == flipped[1]
            if flipped[0]:
                break
            await asyncio.sleep(0.02)
        assert [h.version for h in rs] == [2, 2]
        assert all(same(h.tensors, content(2, i)) for i, h in enumerate(rs))
        for h in (*rs, *ts):
            await h.close()

    asyncio.run(main())


def test_without_room_for_a_shadow_set_flip_updates_in_place(server):
    async def main() -> None:
        ts, publish = await _trainer(server, "flip3")
        await publish(1)
        mine = {k: torch.zeros_like(v) for k, v in content(0).items()}
        r = await open_async("flip3", "r", server=server, transports=TRANSPORTS)
        await r.register(mine)
        await r.replicate(1)
        assert await r.register_shadow(max_bytes=1024) == 0 and r.shadow_bytes == 0
        await publish(2)
        assert await r.prefetch() is None
        assert await r.flip() is True  # update("latest") in place
        assert r.version == 2 and r.tensors["big"] is mine["big"] and same(mine, content(2))
        assert await r.flip() is False
        for h in (r, *ts):
            await h.close()

    asyncio.run(main())


def test_a_prefetch_that_fails_is_raised_by_flip_and_changes_nothing(server):
    async def main() -> None:
        ts, publish = await _trainer(server, "flip4")
        await publish(1)
        r = await open_async("flip4", "r", server=server, transports=TRANSPORTS)
        await r.register({k: torch.zeros_like(v) for k, v in content(0).items()})
        await r.replicate(1)
        await r.register_shadow()
        await publish(2)  # version 1 now lives in r alone
        assert await r.prefetch(1) is None  # already active
        await ts[0].close()  # version 2 is gone before anyone pulled it
        assert await r.prefetch(2) == 2
        with pytest.raises(VersionUnavailable):
            await r.flip()
        assert r.version == 1 and same(r.tensors, content(1))
        assert await r.prefetch(2) is not None  # the failed one was dropped: a new one starts
        with pytest.raises(VersionUnavailable):
            await r.flip()
        await r.close()

    asyncio.run(main())


async def _until(pred) -> None:
    while not pred():
        await asyncio.sleep(0.01)


async def _until_async(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def _not_listed(h, replica: str) -> bool:
    return all(replica not in reps for reps in (await h.list()).values())
