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

from collections.abc import Generator, Sequence
from typing import Any, Protocol

from tensorhub.core.topology import Location
from tensorhub.handles.api import AsyncShardHandle, ReplicaInfo, _AsyncOpen

__all__ = ["AsyncOpen", "AsyncShardHandle", "ReplicaInfo", "open"]


class AsyncOpen(Protocol):
    """What :func:`open` returns: await it for the handle (close it yourself), or enter it with
    ``async with`` (the handle is closed on exit)."""

    def __await__(self) -> Generator[Any, None, AsyncShardHandle]: ...

    async def __aenter__(self) -> AsyncShardHandle: ...

    async def __aexit__(self, *exc: object) -> None: ...


def open(
    model: str,
    replica: str,
    *,
    num_shards: int | None = None,
    shard_idx: int | None = None,
    retain: str | None = "latest",
    server: str | Sequence[str] | None = None,
    location: Location | None = None,
    spot: bool = False,
    transports: dict[str, dict[str, Any]] | None = None,
    connect_timeout: float = 10.0,
    offload_seeding: bool = False,
    convert_from: str | None = None,
    mapping: Any = None,
    convert_budget: int = 512 << 20,
    deltas: bool | int = False,
    bucket: str | None = None,
) -> AsyncOpen:
    """Open a shard handle on the running loop. Arguments as :func:`tensorhub.open`; the
    handle is opened when awaited or entered."""
    kw = {
        "num_shards": num_shards, "shard_idx": shard_idx, "retain": retain, "server": server, "location": location,
        "spot": spot, "transports": transports, "connect_timeout": connect_timeout, "offload_seeding": offload_seeding,
        "convert_from": convert_from, "mapping": mapping, "convert_budget": convert_budget,
        "deltas": deltas, "bucket": bucket,
    }  # fmt: skip
    return _AsyncOpen(model, replica, kw)
