"""TensorHub: reference-oriented storage for model weights in RL jobs.

The reference server stores no weights, only who holds which version; workers publish
references to tensors in their own memory and replicate versions by pulling directly from any
holder, becoming holders themselves.

``import tensorhub`` is light (the server process never imports torch); the handle API is
loaded on first use::

    h = tensorhub.open(model="actor", replica="rollout-1")         # sync
    async with tensorhub.aio.open(model="actor", replica="r") as h:  # async
"""

from __future__ import annotations

from typing import Any

from tensorhub.core.errors import TensorHubError

from .core import errors

__version__ = "0.1.0"

__all__ = [
    "AsyncShardHandle",
    "ReplicaInfo",
    "ShardHandle",
    "TensorHubError",
    "Transport",
    "__version__",
    "aio",
    "errors",
    "open",
    "register_transport",
]  # fmt: skip

_LAZY = {
    "ShardHandle": ("tensorhub.handles.api", "ShardHandle"),
    "AsyncShardHandle": ("tensorhub.handles.api", "AsyncShardHandle"),
    "ReplicaInfo": ("tensorhub.handles.api", "ReplicaInfo"),
    "Transport": ("tensorhub.transports.base", "Transport"),
    "register_transport": ("tensorhub.transports.registry", "register_transport"),
}


def open(model: str, replica: str, **kw: Any) -> Any:
    """Open a shard handle (synchronous facade). See :class:`tensorhub.handles.api.AsyncShardHandle`
    for the arguments: ``num_shards``, ``shard_idx``, ``retain``, ``server``, ``location``,
    ``spot``, ``transports``, ``connect_timeout``, ``offload_seeding``."""
    from tensorhub.handles.api import open_sync

    return open_sync(model, replica, **kw)


def __getattr__(name: str) -> Any:
    if name == "aio":
        import importlib

        return importlib.import_module("tensorhub.aio")
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'tensorhub' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(target[0]), target[1])
