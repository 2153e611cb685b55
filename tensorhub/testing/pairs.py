"""What a check gets: :class:`_Ctx` (its random source, and how to make transports and shards)
and :class:`_Pair` (a started holder, here or in the holder process, and readers here; checks
change the holder only through it)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tensorhub.core.errors import InvalidArgument
from tensorhub.testing import limits
from tensorhub.testing.assertions import _bounded
from tensorhub.testing.holders import _InProcess, _LocalHolder
from tensorhub.testing.limits import _WRITE_CHUNK, REGION, VERSION
from tensorhub.testing.shards import _HookedBuffers, _Shard, _ShardSpec
from tensorhub.transports.buffers import ShardBuffers


_NO_TOKEN = object()  # a read given no token argument at all


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
                await _bounded(t.close(), f"close() of {type(t).__name__}", limits._CLOSE_TIMEOUT)
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

    async def arm_change(self, shard: _Shard, version: int = VERSION) -> None:
        """The holding of ``shard`` moves to a new generation right after the transport next
        takes its memory to copy it (see :meth:`_HolderSide.arm_change`), here or in the
        holder process."""
        await self.holder.do("arm_change", shard=shard.spec, version=version)

    async def disarm(self, shard: _Shard) -> bool:
        """No hook on the holder's buffers of ``shard`` any more; returns whether the armed one
        ran."""
        return await self.holder.do("disarm", shard=shard.spec)

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

    async def guard(self, token: bytes) -> None:
        """The holder admits only requests that show ``token`` from now on (a grant check)."""
        await self.holder.do("guard", token=token)

    async def refusals(self) -> int:
        """How many requests the holder's grant check refused."""
        return await self.holder.do("refusals")

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
        token: Any = _NO_TOKEN,
    ) -> int:
        """A read by ``reader`` (the first by default); ``token`` is passed only when given (a
        transport that checks no grants takes no such argument)."""
        what = f"read of region {region} version {version} bytes [{offset}, {offset + length})"
        peer = await self.holder.peer()
        kw = {} if token is _NO_TOKEN else {"token": token}
        return await _bounded((reader or self.reader).read(peer, region, version, offset, length, into, generation, **kw), what)
