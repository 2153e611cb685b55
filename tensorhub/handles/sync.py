"""The synchronous facade: :class:`ShardHandle` runs each call of an
:class:`~tensorhub.handles.shard.AsyncShardHandle` on the process's background event loop (one
thread, :class:`~tensorhub.runtime.actor.LoopThread`, started with the first handle and again if
it died), and blocks until it returns. ``tensorhub.open`` is :func:`open_sync`.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch

from tensorhub.handles.calls import Versions
from tensorhub.handles.shard import AsyncShardHandle, open_async
from tensorhub.runtime.actor import LoopThread

__all__ = ["ShardHandle", "open_sync"]

T = TypeVar("T")

_loop_thread: LoopThread | None = None


def _loop() -> LoopThread:
    global _loop_thread
    if _loop_thread is None or not _loop_thread.thread.is_alive():
        _loop_thread = LoopThread()
    return _loop_thread


class ShardHandle:
    """The synchronous face of :class:`AsyncShardHandle` (same methods, blocking). Its calls run
    on the process's background event loop; an interrupted call (KeyboardInterrupt) is
    cancelled like an async one."""

    def __init__(self, handle: AsyncShardHandle, loop: LoopThread) -> None:
        self._h = handle
        self._loop = loop

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    def register(
        self,
        tensors: dict[str, torch.Tensor],
        placements: dict[str, Any] | None = None,
        *,
        checksum: str | None = None,
        shared_memory: bool = False,
    ) -> None:
        return self._run(self._h.register(tensors, placements, checksum=checksum, shared_memory=shared_memory))

    def unregister(self) -> None:
        return self._run(self._h.unregister())

    def publish(self, version: int) -> None:
        return self._run(self._h.publish(version))

    def unpublish(self) -> None:
        return self._run(self._h.unpublish())

    def replicate(self, version: int | str = "latest", timeout: float | None = None) -> int:
        return self._run(self._h.replicate(version, timeout))

    def update(self, version: int | str = "latest", timeout: float | None = None) -> bool:
        return self._run(self._h.update(version, timeout))

    def list(self, consistent: bool = False) -> Versions:
        return self._run(self._h.list(consistent))

    def wait(self, predicate: Callable[[Versions], bool], timeout: float | None = None) -> Versions:
        return self._run(self._h.wait(predicate, timeout))

    def register_shadow(self, tensors: dict[str, torch.Tensor] | None = None, max_bytes: int | None = None) -> int:
        return self._run(self._h.register_shadow(tensors, max_bytes))

    def prefetch(self, version: int | str = "latest", timeout: float | None = None) -> int | None:
        return self._run(self._h.prefetch(version, timeout))

    def flip(self, wait: bool = True, timeout: float | None = None) -> bool:
        return self._run(self._h.flip(wait, timeout))

    def close(self) -> None:
        return self._run(self._h.close())

    def __enter__(self) -> ShardHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:  # model, replica, version, session, last_pull, ...
        return getattr(self._h, name)


def open_sync(model: str, replica: str, **kw: Any) -> ShardHandle:
    loop = _loop()
    return ShardHandle(loop.run(open_async(model, replica, **kw)), loop)
