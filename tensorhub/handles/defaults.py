"""What a handle takes from its surroundings when its caller leaves an argument out.

- the sharding (:func:`default_sharding`): an initialized ``torch.distributed`` process group,
  else torchrun's ``$WORLD_SIZE``/``$RANK``, else one shard;
- the server (:func:`server_from_ray`): in a Ray job, the reference server that
  :mod:`tensorhub.ray` runs as a named actor (else ``$TENSORHUB_SERVER`` or the embedded server:
  :mod:`tensorhub.runtime.embedded`);
- the transports (:func:`default_transports`): ``$TENSORHUB_TRANSPORTS``, else the built-ins
  whose probe says they are a default here;
- ``$TENSORHUB_PACK_THRESHOLD`` (:func:`pack_threshold`) and ``$TENSORHUB_FAILOVER_TIMEOUT``
  (:func:`failover_timeout`).

A value that cannot be used is refused with :class:`~tensorhub.errors.InvalidArgument` naming
the setting it came from.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from tensorhub.core.errors import InvalidArgument
from tensorhub.core.log import get_logger
from tensorhub.transports.buffers import DEFAULT_PACK_THRESHOLD

__all__ = [
    "DEFAULT_FAILOVER_TIMEOUT",
    "RAY_SERVER_ACTOR",
    "default_sharding",
    "default_transports",
    "failover_timeout",
    "pack_threshold",
    "server_from_ray",
]

DEFAULT_FAILOVER_TIMEOUT = 120.0


def failover_timeout() -> float:
    """``$TENSORHUB_FAILOVER_TIMEOUT`` (seconds a client looks for a server before giving up)."""
    raw = os.environ.get("TENSORHUB_FAILOVER_TIMEOUT")
    if raw is None:
        return DEFAULT_FAILOVER_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1e6:
        raise InvalidArgument(f"$TENSORHUB_FAILOVER_TIMEOUT must be a number of seconds > 0, got {raw!r}")
    return value


def pack_threshold() -> int:
    """``$TENSORHUB_PACK_THRESHOLD`` (bytes; 0 turns packing off), else the default 2 MiB."""
    raw = os.environ.get("TENSORHUB_PACK_THRESHOLD")
    if raw is None:
        return DEFAULT_PACK_THRESHOLD
    if not raw.isdigit():
        raise InvalidArgument(f"$TENSORHUB_PACK_THRESHOLD must be an integer >= 0, got {raw!r}")
    return int(raw)


def default_transports() -> dict[str, dict[str, Any]]:
    """The transports a process starts when its first handle names none: ``$TENSORHUB_TRANSPORTS``
    (comma-separated names) if set, else every built-in whose probe says it is a default here
    (:func:`tensorhub.transports.registry.probe_builtins`: ``local`` where process_vm_readv is
    allowed, ``nixl`` where it imports and the host has an RDMA device, always ``tcp``). One log
    line says what was started and why the others were not (``tensorhub doctor`` says the same)."""
    from tensorhub.transports.registry import probe_builtins

    env = os.environ.get("TENSORHUB_TRANSPORTS")
    if env is not None:
        return {n: {} for n in (n.strip() for n in env.split(",")) if n}
    probes = probe_builtins()
    chosen: dict[str, dict[str, Any]] = {n: {} for n, p in probes.items() if p.default}
    skipped = {n: p.reason for n, p in probes.items() if not p.default}
    get_logger().info("default transports", started=list(chosen), not_started=skipped)
    return chosen


def _env_int(name: str, ctx: dict[str, Any]) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument(f"${name} must be an integer (as torchrun sets it), got {raw!r}", **ctx) from None


def default_sharding(
    num_shards: int | None, shard_idx: int | None, ctx: dict[str, Any] | None = None
) -> tuple[object, object]:
    """``num_shards`` and ``shard_idx`` with what was omitted (None) taken from the job: an
    initialized ``torch.distributed`` process group (its world size and rank), else torchrun's
    ``$WORLD_SIZE`` and ``$RANK``, else 1 and 0. Values given explicitly are kept (and checked
    by :func:`~tensorhub.core.naming.validate_shard`).

    Raises:
        InvalidArgument: the sources disagree (the process group against ``$WORLD_SIZE``/``$RANK``),
            only one of ``$WORLD_SIZE``/``$RANK`` is set or one is not an integer, or
            ``shard_idx`` is omitted while an explicit ``num_shards`` differs from the job's
            world size (the rank then says nothing about the shard: pass ``shard_idx``), or
            omitted with an explicit ``num_shards`` above 1 and no job to take a rank from.
    """
    ctx = ctx or {}
    if num_shards is not None and shard_idx is not None:
        return num_shards, shard_idx
    env_world, env_rank = _env_int("WORLD_SIZE", ctx), _env_int("RANK", ctx)
    if (env_world is None) != (env_rank is None):
        have, missing = ("WORLD_SIZE", "RANK") if env_rank is None else ("RANK", "WORLD_SIZE")
        raise InvalidArgument(f"${have} is set but ${missing} is not: pass num_shards= and shard_idx=, or set both", **ctx)
    world, rank, source = env_world, env_rank, "$WORLD_SIZE/$RANK"
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        pg_world, pg_rank = dist.get_world_size(), dist.get_rank()
        if env_world is not None and (env_world, env_rank) != (pg_world, pg_rank):
            raise InvalidArgument(
                f"the torch.distributed process group (world size {pg_world}, rank {pg_rank}) disagrees with "
                f"$WORLD_SIZE={env_world}, $RANK={env_rank}: pass num_shards= and shard_idx=", **ctx,
            )  # fmt: skip
        world, rank, source = pg_world, pg_rank, "the torch.distributed process group"
    if world is None or rank is None:
        if shard_idx is None and num_shards is not None and num_shards != 1:
            # Every process would be shard 0: nothing says which shard this one is.
            raise InvalidArgument(
                f"shard_idx omitted with num_shards={num_shards}, and no process group, $WORLD_SIZE or $RANK "
                "says which shard this process is: pass shard_idx=", **ctx,
            )  # fmt: skip
        return (1 if num_shards is None else num_shards), (0 if shard_idx is None else shard_idx)
    if not 1 <= world or not 0 <= rank < world:
        raise InvalidArgument(f"{source} gives rank {rank} of world size {world}, which is not a rank of that world", **ctx)
    if shard_idx is None and num_shards is not None and num_shards != world:
        raise InvalidArgument(
            f"shard_idx omitted, but num_shards={num_shards} is not the world size {world} of {source}: "
            "the rank does not say which shard this is; pass shard_idx=", **ctx,
        )  # fmt: skip
    return (world if num_shards is None else num_shards), (rank if shard_idx is None else shard_idx)


#: (namespace, name) of the Ray actor that runs the reference server (tensorhub.ray)
RAY_SERVER_ACTOR = ("tensorhub", "tensorhub-server")


def server_from_ray() -> str | None:
    """In a process where Ray is imported and initialized (a Ray driver, task or actor): the
    address of the reference server that :mod:`tensorhub.ray` runs as a named actor, if there
    is one. Ray is never imported here: only a process already using it is asked."""
    ray = sys.modules.get("ray")
    if ray is None or not callable(getattr(ray, "is_initialized", None)) or not ray.is_initialized():
        return None
    namespace, name = RAY_SERVER_ACTOR
    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
    address = ray.get(actor.address.remote(), timeout=60)
    get_logger().info("reference server from Ray", actor=f"{namespace}/{name}", address=address)
    return address
