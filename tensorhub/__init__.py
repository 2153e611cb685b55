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

from typing import TYPE_CHECKING, Any

from tensorhub.core.errors import TensorHubError

# the public module (tensorhub/errors.py, the core's errors re-exported): importing the core's
# module under this name made ``tensorhub.errors`` change identity once anything imported
# ``tensorhub.errors`` as a module (``from tensorhub.errors import X``)
from . import errors

if TYPE_CHECKING:  # for type checkers only: importing the handle API at run time imports torch
    from collections.abc import Sequence

    from tensorhub.core.topology import Location
    from tensorhub.handles.api import ShardHandle

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
) -> ShardHandle:
    """Open a shard handle (the synchronous facade of :class:`tensorhub.handles.api.AsyncShardHandle`,
    whose calls block; it runs on the process's background event loop).

    Args:
        model: the model's name.
        replica: this replica's name (its shards share it).
        num_shards: the replica's model-parallel shards (its world size). None: the world size
            of the initialized ``torch.distributed`` process group, else ``$WORLD_SIZE`` (as
            torchrun sets it), else 1.
        shard_idx: which of them this handle is (its rank), in ``[0, num_shards)``. None: the
            process group's rank, else ``$RANK``, else 0.
        retain: the versions that must stay available, counted from the highest version
            published: ``"latest"``, ``"latest-k"``, or None for no declaration.
        server: the reference server's address, or an ordered list of them (a list/tuple, or one
            comma-separated string; the first is the primary). None: ``$TENSORHUB_SERVER``, else
            the embedded default server on ``tcp://127.0.0.1:5557``.
        location: where the shard is (:class:`tensorhub.core.topology.Location`); None: this
            host (``platform.node()``) in the datacenter ``"local"``.
        spot: a spot replica serves reads and makes a version available, but never counts for
            retention.
        transports: the transports this process starts, ``{name: options}``. None: those the
            process's engine already runs, else ``$TENSORHUB_TRANSPORTS``, else every built-in
            transport that works here. One engine serves a process's handles: asking for other
            transports than it runs is refused while it runs.
        connect_timeout: seconds to wait for the server when opening.
        offload_seeding: when this replica would seed a version into its datacenter, pull it
            into a CPU copy in the background instead of stalling ``update()``.
        convert_from: this model holds ``convert_from``'s versions in another layout (other
            names, shard count, fused projections, FP8): its shards register ``placements=``,
            and the first reader of each (version, shard) converts it from ``convert_from``'s
            holders; the next ones pull the converted bytes from it (README "Different layouts").
        mapping: how this model's tensors derive from ``convert_from``'s
            (:class:`tensorhub.scheduling.mapping.Mapping`, e.g. ``preset("qwen3", ...)``);
            None: same names, shapes and dtypes.
        convert_budget: temporary bytes a conversion may hold at once.
        deltas: ship only what changed (README "Deltas"). A trainer's ``publish(v)`` also
            publishes, in the background, the sparse delta from the version it published
            before (``True``: the last 4 deltas stay published; an int: that many); a reader's
            ``update()`` applies the chain of deltas the server plans for it where that is fewer
            bytes than a full pull, verified against the version's checksums (``last_delta``
            says what it did).
        bucket: the bucket tier, an fsspec URL or a directory (README "Deltas"). A trainer's
            shard also writes every version there in the background (an anchor every 8
            versions, deltas between, chunks stored once by content); a reader's pull that no
            peer can serve (unreachable, or no holder left) restores the version from it,
            verified, and then serves it to peers like any holder (``last_bucket``). A write
            that failed is raised, typed (``BucketError``), by the next ``publish()``, and that
            version is not declared to the server.

    Returns:
        the open :class:`~tensorhub.handles.api.ShardHandle`.

    Raises:
        InvalidArgument, InvalidName: a bad argument, or transports the running engine does
            not run (the message names it), or an omitted ``num_shards``/``shard_idx`` whose
            sources disagree (the process group against ``$WORLD_SIZE``/``$RANK``; an explicit
            ``num_shards`` other than the world size with ``shard_idx`` omitted).
        ServerUnavailable: no server answered in ``connect_timeout`` seconds.
        BucketUnavailable: ``bucket`` cannot be used at all (an unknown protocol, a directory
            that cannot be made: under a regular file, in ``/proc``, no permission).
    """
    from tensorhub.handles.api import open_sync

    return open_sync(
        model, replica, num_shards=num_shards, shard_idx=shard_idx, retain=retain, server=server,
        location=location, spot=spot, transports=transports, connect_timeout=connect_timeout,
        offload_seeding=offload_seeding, convert_from=convert_from, mapping=mapping, convert_budget=convert_budget,
        deltas=deltas, bucket=bucket,
    )  # fmt: skip


def __getattr__(name: str) -> Any:
    if name == "aio":
        import importlib

        return importlib.import_module("tensorhub.aio")
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'tensorhub' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(target[0]), target[1])
