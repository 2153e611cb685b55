"""Offload seeding (DESIGN.md §5.6): a handle opened with ``offload_seeding=True`` that the
server chose to bring a version into its datacenter does not stall its own ``update()`` on the
slow link. :class:`OffloadSeed` pulls the version in the background into a CPU copy of the shard
(pinned where CUDA is present), held by a spot replica named
:func:`~tensorhub.core.naming.seed_replica` of this one; a later ``update()`` of the handle
pulls from that copy, and the copy is then retired: unpublished (its readers drain first) and
closed. One seed per handle at a time; a failed seed is logged and dropped (a later
``update()`` seeds again); ``close()`` frees it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from tensorhub.core.errors import TensorHubError
from tensorhub.handles.session import ShardSession, Sibling

__all__ = ["OffloadSeed"]

S = TypeVar("S", bound=Sibling)


class OffloadSeed(Generic[S]):
    """A handle's offload seed: the CPU copy's handle (``S``: the handle's own class), the
    version it pulls, its background task, and the seeds being retired."""

    def __init__(self) -> None:
        self.seed: S | None = None
        self.version: int | None = None
        self.task: asyncio.Task[None] | None = None
        self._retiring: set[asyncio.Future[None]] = set()

    @property
    def seeding(self) -> int | None:
        """The version the seed holds or is pulling (None: no seed)."""
        return self.version if self.seed is not None else None

    def after_update(self, owner: ShardSession, seed: int | None, make_seed: Callable[[], S]) -> None:
        """What an ``update()`` answer asks: ``seed`` (a version): start seeding it, into the
        handle ``make_seed()`` makes (not opened yet); else retire a seed the handle now holds
        the version of (others of the datacenter pull from the handle now)."""
        if seed is not None:
            self._start(owner, seed, make_seed())
        elif self.seed is not None and self.version is not None and owner.version is not None and owner.version >= self.version:
            self.retire()

    def _start(self, owner: ShardSession, version: int, seed: S) -> None:
        """Pull ``version`` into a CPU copy of the shard, through ``seed``, in the background."""
        old_seed, old_task = self.seed, self.task
        assert owner.buffers is not None
        layout = owner.buffers.layout
        pin = torch.cuda.is_available()
        tensors = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype), pin_memory=pin) for t in layout.tensors}
        self.seed, self.version = seed, version

        async def run() -> None:
            if old_seed is not None:
                await _close_seed(old_seed, old_task)
            t0 = asyncio.get_running_loop().time()
            try:
                await seed._open()
                await seed.register(tensors, checksum=layout.checksum)
                await seed.replicate(version)
            except TensorHubError as err:
                owner.log.warning("offload seeding failed; a later update() seeds again", version=version, error=str(err))
                if self.seed is seed:
                    self.seed = None
                await seed.close()
                return
            owner.log.info("offload seed ready", version=version, seconds=round(asyncio.get_running_loop().time() - t0, 3))

        self.task = asyncio.ensure_future(run())

    def retire(self) -> None:
        """Free the seed in the background (its readers drain first)."""
        seed, task = self.seed, self.task
        self.seed = self.task = None
        if seed is not None:
            fut = asyncio.ensure_future(_close_seed(seed, task))
            self._retiring.add(fut)
            fut.add_done_callback(self._retiring.discard)

    async def drop(self) -> None:
        """Free the seed and wait for every seed being retired (``close()``)."""
        seed, task = self.seed, self.task
        self.seed = self.task = None
        if seed is not None:
            await _close_seed(seed, task)
        if self._retiring:
            await asyncio.wait(list(self._retiring))


async def _close_seed(seed: Sibling, task: asyncio.Task[None] | None) -> None:
    """Free an offload seed: stop its pull, let its readers drain (unpublish), close it."""
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TensorHubError):
            await task
    if seed.closed:
        return
    try:
        if seed.version is not None and seed.busy is None:
            await seed.unpublish()
    except TensorHubError as err:
        seed.log.warning("offload seed: unpublish refused; closing", error=str(err))
    await seed.close()
