"""The async face of the API, for asyncio rollout servers::

    async with tensorhub.aio.open(model="actor", replica="rollout-3") as h:
        await h.register(tensors)
        await h.replicate("latest")
        moved = await h.update("latest")

``open(...)`` is both awaitable (returns an :class:`~tensorhub.handles.api.AsyncShardHandle`; close it
yourself) and an async context manager (closes on exit). Handles run on the calling event
loop; uvloop is used if the application installed it as the loop.
"""

from __future__ import annotations

from typing import Any

from tensorhub.handles.api import AsyncShardHandle, ReplicaInfo, _AsyncOpen

__all__ = ["AsyncShardHandle", "ReplicaInfo", "open"]


def open(model: str, replica: str, **kw: Any) -> _AsyncOpen:
    """Open a shard handle on the running loop. Arguments as :func:`tensorhub.open`."""
    return _AsyncOpen(model, replica, kw)
