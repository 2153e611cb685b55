"""Shard handles: the public API of DESIGN.md §2, async and sync; the names users import.

:class:`AsyncShardHandle` is the whole API, awaitable; :class:`ShardHandle` is a thin synchronous
facade that runs it on the process's background event loop (one thread). Both are made by
``tensorhub.aio.open`` / ``tensorhub.open``.

Each event loop has one :class:`Runtime`: one :class:`~tensorhub.runtime.engine.EngineActor` with the
process's transports, and one :class:`~tensorhub.runtime.client.ClientActor` per list of server
addresses. It starts with the first handle opened on that loop and stops when the last one closes.

Where things are (this module re-exports the public names):

- :mod:`tensorhub.handles.shard`: :class:`AsyncShardHandle` (arguments, the one-call guard, the
  docstrings), ``open_async``;
- :mod:`tensorhub.handles.session`: the state a handle carries, its calls' plumbing, the
  numbered model-parallel calls and the re-announcement after a failover;
- :mod:`tensorhub.handles.calls`: publish, unpublish, list, wait;
- :mod:`tensorhub.handles.pulls`: replicate and update, through failover, to the bucket;
- :mod:`tensorhub.handles.flip`: replicate-then-flip (the shadow set);
- :mod:`tensorhub.handles.seeding`: offload seeding across datacenters;
- :mod:`tensorhub.handles.deltas`: deltas and the bucket tier;
- :mod:`tensorhub.handles.placements`: registration's DTensor and placement checks;
- :mod:`tensorhub.handles.actors`: the per-loop :class:`Runtime` (engine, clients);
- :mod:`tensorhub.handles.defaults`: what is taken from the environment (sharding, server,
  transports);
- :mod:`tensorhub.handles.sync`: :class:`ShardHandle`, ``open_sync``.

Server failover (DESIGN.md §5.5). ``server=`` may name several servers in order; when the one in
use is lost, the client moves to the next and restores every handle's session there
(:meth:`AsyncShardHandle.restore`). Handles survive the move. What each call does meanwhile:

- a call waiting for its answer at the moment of loss fails with ``ServerUnavailable``, and
  is not re-sent (it may have been decided by the lost server); its call number is given back,
  so that the same call made again on the new server gets the answer that the replica's other
  shards were given (they re-announce it). ``update()`` is the exception: if it had not started
  pulling it returns False (the tensors still hold the old version); if it had, it raises
  ``UpdateAborted`` and the handle holds nothing;
- while no server is connected, ``update()`` returns False at once (no newer version is known),
  and every other call raises ``ServerUnavailable``. The registered tensors are never touched;
- once moved, calls work again; ``update()`` moves when the new server knows a newer version.

Across datacenters (DESIGN.md §5.6). ``update()`` does not move while another replica of this
datacenter is seeding the newer version across datacenters (smart skipping: it returns False
and :attr:`AsyncShardHandle.skipped` names the version; ask again later, the pull will then be
local). A handle opened with ``offload_seeding=True`` that would itself be the seeder does not
stall on the slow link either: ``update()`` returns False at once and a background task pulls
the version into a CPU copy of the shard, held by a spot replica named
:func:`~tensorhub.core.naming.seed_replica` of this one (at most one per datacenter: the server
decides). A later ``update()`` moves, pulling from that copy; the copy is then unpublished
(its readers drain first) and freed. One seed per handle at a time; ``close()`` frees it.
"""

from __future__ import annotations

from tensorhub.handles.actors import Runtime
from tensorhub.handles.calls import ReplicaInfo, Versions
from tensorhub.handles.defaults import RAY_SERVER_ACTOR, default_sharding, default_transports
from tensorhub.handles.flip import SHADOW_SUFFIX, shadow_replica
from tensorhub.handles.shard import AsyncShardHandle, PendingOpen, open_async
from tensorhub.handles.sync import ShardHandle, open_sync

__all__ = [
    "RAY_SERVER_ACTOR",
    "SHADOW_SUFFIX",
    "AsyncShardHandle",
    "ReplicaInfo",
    "Runtime",
    "ShardHandle",
    "Versions",
    "default_sharding",
    "default_transports",
    "open_async",
    "open_sync",
    "shadow_replica",
]

#: ``tensorhub.aio.open``'s result (its old name, which :mod:`tensorhub.aio` imports)
_AsyncOpen = PendingOpen
