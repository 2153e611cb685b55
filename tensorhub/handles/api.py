"""Shard handles: the public API of DESIGN.md §2, async and sync.

:class:`AsyncShardHandle` is the whole API, awaitable; :class:`ShardHandle` is a thin synchronous
facade that runs it on the process's background event loop (one thread). Both are made by
``tensorhub.aio.open`` / ``tensorhub.open``.

Each event loop has one :class:`Runtime`: one :class:`~tensorhub.runtime.engine.EngineActor` with the
process's transports, and one :class:`~tensorhub.runtime.client.ClientActor` per list of server
addresses. It starts with the first handle opened on that loop and stops when the last one closes.

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

import asyncio
import collections
import contextlib
import math
import os
import sys
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import zmq.asyncio

from tensorhub.core import messages as m
from tensorhub.core.errors import (
    AlreadyRegistered,
    BucketUnavailable,
    CallInFlight,
    Cancelled,
    ChecksumsRequired,
    ContractViolation,
    InBucket,
    InvalidArgument,
    InvalidPlacement,
    NotRegistered,
    ServerUnavailable,
    TensorHubError,
    Timeout,
    TransportError,
    UpdateAborted,
    UsageError,
    VersionConflict,
    VersionUnavailable,
)
from tensorhub.core.layout import Layout
from tensorhub.core.log import get_logger
from tensorhub.core.naming import (
    delta_model,
    parse_retain,
    parse_version_spec,
    seed_replica,
    validate_model,
    validate_replica,
    validate_shard,
    validate_version,
)
from tensorhub.core.placement import PlacedTensor, TensorPlacement
from tensorhub.core.shard import give_back, next_call
from tensorhub.handles.deltas import DeltaPublisher, DeltaReader, DeltaStats, restore_from_bucket, ring_size
from tensorhub.runtime.bucket import Bucket, Restored
from tensorhub.core.topology import Location
from tensorhub.runtime.actor import LoopThread
from tensorhub.runtime.client import Call, ClientActor, Exchange
from tensorhub.runtime.convert import DEFAULT_BUDGET, ConversionStats, ConvertSpec
from tensorhub.runtime.embedded import parse_servers, resolve_servers
from tensorhub.runtime.engine import (
    AbortPull,
    AddSlot,
    DropSlot,
    EngineActor,
    HashBuffers,
    Holdings,
    PullStats,
    StartPublish,
    WaitPublished,
)
from tensorhub.scheduling.edges import parse_preference
from tensorhub.scheduling.mapping import IDENTITY, Mapping
from tensorhub.transports.buffers import DEFAULT_PACK_THRESHOLD, ShardBuffers, layout_of

__all__ = ["AsyncShardHandle", "ReplicaInfo", "Runtime", "ShardHandle", "open_async", "open_sync"]

#: What :meth:`AsyncShardHandle.list` maps each (version, replica) to: ``replica``, ``kind``
#: (``"normal"`` or ``"offload"``) and ``spot``.
ReplicaInfo = m.ReplicaEntry
Versions = dict[int, dict[str, m.ReplicaEntry]]

DEFAULT_FAILOVER_TIMEOUT = 120.0
_ANSWERS_KEPT = 16  # model-parallel answers re-announced after a failover
_RESUMES = 3  # failovers one replicate/update call survives mid-pull


def _failover_timeout() -> float:
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


def _pack_threshold() -> int:
    """``$TENSORHUB_PACK_THRESHOLD`` (bytes; 0 turns packing off), else the default 2 MiB."""
    raw = os.environ.get("TENSORHUB_PACK_THRESHOLD")
    if raw is None:
        return DEFAULT_PACK_THRESHOLD
    if not raw.isdigit():
        raise InvalidArgument(f"$TENSORHUB_PACK_THRESHOLD must be an integer >= 0, got {raw!r}")
    return int(raw)


def default_transports() -> dict[str, dict]:
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
    chosen = {n: {} for n, p in probes.items() if p.default}
    skipped = {n: p.reason for n, p in probes.items() if not p.default}
    get_logger().info("default transports", started=list(chosen), not_started=skipped)
    return chosen


def _env_int(name: str, ctx: dict) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument(f"${name} must be an integer (as torchrun sets it), got {raw!r}", **ctx) from None


def default_sharding(num_shards: int | None, shard_idx: int | None, ctx: dict | None = None) -> tuple[object, object]:
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


def _server_from_ray() -> str | None:
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


SHADOW_SUFFIX = "@shadow"
"""The suffix of the replica that registers a handle's shadow set (replicate-then-flip)."""

#: what stays with the user's handle object when a flip swaps the two sessions' state
_KEPT_ACROSS_FLIP = ("_shadow", "_prefetch", "_prefetch_version", "_prefetch_newer", "shadow_bytes", "flips", "_busy", "_owner")


def shadow_replica(replica: str) -> str:
    """The name of the replica that registers ``replica``'s shadow set.

    Raises:
        InvalidName: the result would be too long.
    """
    return validate_replica(replica + SHADOW_SUFFIX)


class _SessionRef:
    """What the client actor keeps for a session (its ``SessionOwner``): the handle object that
    holds that session's state now. A flip moves the state to the other object and re-points it."""

    __slots__ = ("target",)

    def __init__(self, target: AsyncShardHandle) -> None:
        self.target = target

    def open_message(self, req: int) -> m.OpenShard:
        return self.target.open_message(req)

    async def restore(self, send: Exchange) -> None:
        await self.target.restore(send)


def _sharing_storage(tensors: dict[str, torch.Tensor], others: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """The pairs (name in ``tensors``, name in ``others``) whose storages overlap (views of one
    allocation, or the same tensors), sorted."""
    spans = []
    for name, t in others.items():
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.nbytes():
                spans.append((t.device, st.data_ptr(), st.data_ptr() + st.nbytes(), name))
    pairs = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            continue
        st = t.untyped_storage()
        lo, hi = st.data_ptr(), st.data_ptr() + st.nbytes()
        if lo == hi:
            continue
        pairs.extend((name, other) for dev, a, b, other in spans if dev == t.device and a < hi and lo < b)
    return sorted(pairs)


def _shadow_does_not_fit(need: int, devices: Sequence[torch.device], max_bytes: int | None) -> str | None:
    """Why a second copy of ``need`` bytes should not be allocated (None: it fits). The free
    memory of each device used must keep a tenth (CPU: of ``MemAvailable``) to spare."""
    if max_bytes is not None and need > max_bytes:
        return f"it needs {need} bytes, over max_bytes={max_bytes}"
    for dev in set(devices):
        free: int | None = None
        if dev.type == "cuda":
            free = torch.cuda.mem_get_info(dev)[0]
        elif dev.type == "cpu":
            free = _mem_available()
        if free is None:
            continue
        if need > 0.9 * free:
            return f"it needs {need} bytes and {dev} has {free} free"
    return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Runtime:
    """The actors of one event loop: an engine and a client per list of server addresses."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Runtime] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.ctx: zmq.asyncio.Context | None = None
        self.engine: EngineActor | None = None
        self.transports: dict[str, dict] | None = None  # what the first handle asked for (None: defaults)
        self.clients: dict[str, ClientActor] = {}
        self.handles = 0
        self._lock = asyncio.Lock()

    @classmethod
    def current(cls) -> Runtime:
        loop = asyncio.get_running_loop()
        rt = cls._by_loop.get(loop)
        if rt is None:
            rt = cls._by_loop[loop] = cls()
        return rt

    async def acquire(
        self, server: str | Sequence[str] | None, transports: dict[str, dict] | None
    ) -> tuple[ClientActor, EngineActor]:
        async with self._lock:
            self.handles += 1
            try:
                if self.ctx is None:
                    self.ctx = zmq.asyncio.Context()
                addresses = await resolve_servers(self.ctx, server)
                failover_timeout = _failover_timeout()
                if self.engine is None:
                    self.engine = await self._start_engine(transports)
                    self.transports = {n: dict(o or {}) for n, o in (transports or {}).items()} if transports else None
                elif transports is not None and self._differs(transports):
                    raise InvalidArgument(
                        f"this process's transfer engine already runs transports {sorted(self.engine.transports)} "
                        f"(started by its first handle{' with ' + repr(self.transports) if self.transports else ''}); "
                        f"a handle asking for {transports!r} must ask for the same ones, or pass transports=None to "
                        "use the process's (one engine per process; close every handle to start another set)"
                    )
                key = ",".join(addresses)
                client = self.clients.get(key)
                if client is None or client.stopped or client.gave_up is not None:
                    if client is not None:
                        await client.stop()
                    client = self.clients[key] = ClientActor(addresses, self.ctx, self.engine, failover_timeout)
                    await client.start()
                return client, self.engine
            except BaseException:
                self.handles -= 1
                await self._maybe_stop()
                raise

    def _differs(self, transports: dict[str, dict]) -> bool:
        """Whether ``transports`` (a handle's explicit request) is not what the engine runs."""
        assert self.engine is not None
        want = {n: dict(o or {}) for n, o in transports.items()} if isinstance(transports, dict) else transports
        if self.transports is not None:
            return want != self.transports
        return not isinstance(want, dict) or set(want) != set(self.engine.transports) or any(want.values())

    async def _start_engine(self, transports: dict[str, dict] | None) -> EngineActor:
        from tensorhub.transports.registry import get_transport

        defaults = transports is None
        if transports is None:
            transports = default_transports()
        started = {}
        try:
            for name, options in transports.items():
                if defaults and not (probe := get_transport(name).probe()).usable:
                    get_logger().info("transport unavailable here; not started", transport=name, why=probe.reason)
                    continue
                options = dict(options or {})
                faults = options.pop("faults", None)  # wrap it in fault injection (testing integrations)
                t = get_transport(name)(options)
                if faults is not None:
                    from tensorhub.transports.faults import wrap

                    t = wrap(t, faults)
                await t.start()
                started[name] = t
        except BaseException:
            for t in started.values():
                await t.close()
            raise
        chunk = os.environ.get("TENSORHUB_CHUNK_BYTES")
        if chunk is not None and (not chunk.isdigit() or int(chunk) < 4096):
            raise InvalidArgument(f"$TENSORHUB_CHUNK_BYTES must be an integer >= 4096, got {chunk!r}")
        try:
            preference = parse_preference(os.environ.get("TENSORHUB_TRANSPORT_PREFERENCE", ""))
        except InvalidArgument as err:
            raise InvalidArgument(f"$TENSORHUB_TRANSPORT_PREFERENCE: {err}") from None
        engine = EngineActor(started, chunk_bytes=int(chunk) if chunk else None, preference=preference)
        await engine.start()
        return engine

    async def release(self) -> None:
        async with self._lock:
            self.handles -= 1
            await self._maybe_stop()

    async def _maybe_stop(self) -> None:
        if self.handles > 0:
            return
        for c in self.clients.values():
            await c.stop()
        self.clients.clear()
        if self.engine is not None:
            await self.engine.stop()
            self.engine = None
            self.transports = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None


class AsyncShardHandle:
    """One shard of one replica of one model, as this process holds it. See DESIGN.md §2.

    Only one call runs at a time on a handle; a second concurrent call raises
    :class:`~tensorhub.errors.CallInFlight`.

    ``server``: an address, or an ordered list of them (a list/tuple, or one comma-separated
    string): the primary first, then the servers to fail over to (see the module docstring).
    None: ``$TENSORHUB_SERVER`` (same forms), else the embedded default server.
    """

    def __init__(
        self,
        model: str,
        replica: str,
        num_shards: int | None = None,
        shard_idx: int | None = None,
        retain: str | None = "latest",
        server: str | Sequence[str] | None = None,
        location: Location | None = None,
        spot: bool = False,
        transports: dict[str, dict] | None = None,
        connect_timeout: float = 10.0,
        offload_seeding: bool = False,
        convert_from: str | None = None,
        mapping: Mapping | None = None,
        convert_budget: int = DEFAULT_BUDGET,
        deltas: bool | int = False,
        bucket: str | None = None,
    ) -> None:
        self.model = validate_model(model)
        self.replica = validate_replica(replica, model=self.model)
        ctx = {"model": self.model, "replica": self.replica}
        self.num_shards, self.shard_idx = validate_shard(*default_sharding(num_shards, shard_idx, ctx), **ctx)
        self.ctx = {**ctx, "shard": self.shard_idx}
        self.retain_back = parse_retain(retain, **self.ctx)
        if location is not None and not isinstance(location, Location):
            raise InvalidArgument(f"location must be a tensorhub.core.topology.Location, got {type(location).__name__}", **self.ctx)
        self.location = location or Location.default()
        if not isinstance(spot, bool):
            raise InvalidArgument(f"spot must be a bool, got {spot!r}", **self.ctx)
        self.spot = spot
        if not isinstance(offload_seeding, bool):
            raise InvalidArgument(f"offload_seeding must be a bool, got {offload_seeding!r}", **self.ctx)
        if offload_seeding:
            seed_replica(self.replica)  # the seed's name must be valid too
        self.offload_seeding = offload_seeding
        # A converted model (another layout of ``convert_from``'s weights): see tensorhub.runtime.convert.
        if convert_from is not None:
            validate_model(convert_from)
            if convert_from == self.model:
                raise InvalidArgument(f"model {self.model!r} cannot be converted from itself", **self.ctx)
        elif mapping is not None:
            raise InvalidArgument("mapping= needs convert_from= (the model whose names it maps from)", **self.ctx)
        if mapping is not None and not isinstance(mapping, Mapping):
            raise InvalidArgument(f"mapping must be a tensorhub.scheduling.mapping.Mapping, got {type(mapping).__name__}", **self.ctx)
        if type(convert_budget) is not int or convert_budget < 1:
            raise InvalidArgument(f"convert_budget must be an int >= 1 (bytes), got {convert_budget!r}", **self.ctx)
        self.convert_from = convert_from
        self.mapping = mapping if mapping is not None else IDENTITY
        self.convert_budget = convert_budget
        # Deltas (tensorhub.handles.deltas): published after each publish, applied by update().
        ring = ring_size(deltas, self.ctx)
        if ring and convert_from is not None:
            raise InvalidArgument("deltas= and convert_from= do not go together: a converted model pulls in full", **self.ctx)
        if ring:
            delta_model(self.model)  # the delta model's name must be valid too
        self._delta_ring = ring
        if bucket is not None and (not isinstance(bucket, str) or not bucket):
            raise InvalidArgument(f"bucket must be an fsspec URL or a directory (a non-empty str), got {bucket!r}", **self.ctx)
        self._bucket = bucket
        #: what the last pull that fell back to the bucket restored (None: none did)
        self.last_bucket: Restored | None = None
        self._delta_pub: DeltaPublisher | None = None
        self._delta_reader: DeltaReader | None = None
        #: what the last update() planned as a delta chain did (None: it pulled in full, or no update yet)
        self.last_delta: DeltaStats | None = None
        self.placements: tuple[PlacedTensor, ...] | None = None  # registered with the tensors, if given
        #: the newer version the last ``update()`` skipped because this datacenter is seeding it
        self.skipped: int | None = None
        self._seed: AsyncShardHandle | None = None  # the offload seed (a CPU copy), what it pulls, its task
        self._seed_version: int | None = None
        self._seed_task: asyncio.Task | None = None
        self._retiring: set[asyncio.Future] = set()  # seeds being freed
        if server is not None:
            try:
                parse_servers(server)
            except InvalidArgument as err:
                raise InvalidArgument(err.message, **self.ctx) from None
        self._server = server
        self._transports = transports
        self.connect_timeout = connect_timeout
        self.log = get_logger(**self.ctx)
        self.session: int | None = None
        self.version: int | None = None  # the version the registered buffers hold (published or replicated)
        self.buffers: ShardBuffers | None = None
        self.closed = False
        self._runtime: Runtime | None = None
        self._client: ClientActor | None = None
        self._engine: EngineActor | None = None
        self.calls = 0  # the last model-parallel call number given (tensorhub.core.shard.next_call)
        self._busy: str | None = None
        self._incarnation = uuid.uuid4().hex
        self._endpoint: Any = None  # the engine's endpoint for the registered buffers
        self._answered = 0  # the last call number that got a final answer
        self._answers: collections.deque[m.CallAnswer] = collections.deque(maxlen=_ANSWERS_KEPT)
        # Replicate-then-flip (see "Replicate-then-flip" below). What the client actor holds for
        # this session; a flip moves the session's state to the other handle object and re-points it.
        self._owner = _SessionRef(self)
        self._base_replica = self.replica  # the name the user opened (the banks: it and its shadow replica)
        #: a delta model's shard: (the version its buffers hold, the base its delta applies to),
        #: re-announced after a failover so that the next server plans deltas with it
        self.delta_base: tuple[int, int] | None = None
        self._shadow: AsyncShardHandle | None = None  # the standby bank (None: no shadow set)
        self._prefetch: asyncio.Future | None = None  # the standby's pull of the next version
        self._prefetch_version: int | None = None
        self._prefetch_newer = True  # the prefetch was relative: flip only to a newer version
        #: bytes the shadow set costs (its tensors and pack buffers); 0: none (flip() updates in place)
        self.shadow_bytes = 0
        #: how many times flip() swapped the sets
        self.flips = 0

    # ---- opening and closing -------------------------------------------------------------------

    async def _open(self) -> AsyncShardHandle:
        if self._bucket is not None:  # a URL that cannot work fails here, typed, not at every publish()
            try:
                await asyncio.to_thread(Bucket, self._bucket)
            except BucketUnavailable as err:
                raise BucketUnavailable(err.message, **self.ctx) from err.__cause__
        rt = Runtime.current()
        if self._server is None and not os.environ.get("TENSORHUB_SERVER"):
            self._server = await asyncio.to_thread(_server_from_ray)  # None: not in a Ray job with one
        self._client, self._engine = await rt.acquire(self._server, self._transports)
        self._runtime = rt
        try:
            await self._client.ready(self.connect_timeout)
            self.session, opened = await self._client.ask(Call(self.open_message, adopt=self._owner), timeout=self.connect_timeout)
        except Timeout:
            await self._release()
            raise ServerUnavailable(f"no answer from the server at {self._client.address} in {self.connect_timeout:g} s", **self.ctx) from None
        except ServerUnavailable as err:
            await self._release()
            raise ServerUnavailable(err.message, **self.ctx) from None
        except BaseException:
            await self._release()
            raise
        self.log = self.log.bind(session=self.session)
        self.log.debug("opened", server=self._client.address, term=opened.term)
        return self

    @property
    def empty(self) -> bool:
        """True when the registered tensors hold no version: nothing was published or pulled
        into them yet, or a replicate/update that had begun moving failed (``version`` is then
        None). Do not serve from an empty handle; pull again (or keep serving from a second set
        of buffers, once replicate-then-flip exists)."""
        return self.version is None

    @property
    def server_address(self) -> str | None:
        """The address of the server this handle's session is on now (None: none connected)."""
        client = self._client
        return client.address if client is not None and client.lost is None else None

    # ---- failover (called by the client actor) ---------------------------------------------------

    def open_message(self, req: int) -> m.OpenShard:
        """This shard's ``OpenShard``: the same incarnation each time (a failover re-opens it)."""
        return m.OpenShard(req, self.model, self.replica, self.num_shards, self.shard_idx, self._incarnation,
                           self.location, self.spot, self.retain_back, self.convert_from)  # fmt: skip

    async def restore(self, send: Exchange) -> None:
        """Re-open this shard on the server the client moved to (its ``OpenShard`` was answered):
        register the layout again and announce what the shard holds: the version in the
        registered buffers if they hold it whole, its offload copies, each with the checksums
        this process knows, and its last model-parallel answers. Called by the client actor.

        Raises:
            ServerUnavailable: that server did not answer (the client tries the next).
            ContractViolation: that server still has this session (nothing to announce).
        """
        buffers, engine, sid = self.buffers, self._engine, self.session
        if buffers is None or self._endpoint is None or engine is None or self.closed:
            return
        endpoint = self._endpoint
        await send(lambda req: m.Register(req, sid, buffers.layout, endpoint, None, self.placements))
        await engine.ask(WaitPublished(sid))  # a publish's checksums are known before it is announced
        sums, offloads = await engine.ask(Holdings(sid))  # the checksums and offload copies it knows
        holdings: list[m.Held] = []
        _, held, verified = buffers.progress.snapshot()
        live = held if held is not None and held == self.version and verified >= buffers.total_bytes else None
        if live is not None:
            base = self.delta_base[1] if self.delta_base is not None and self.delta_base[0] == live else None
            holdings.append(m.Held(live, m.KIND_NORMAL, sums.get(live), base))
        holdings.extend(m.Held(v, m.KIND_OFFLOAD, sums.get(v)) for v in offloads)
        partial = None
        if live is None and held is not None and verified < buffers.total_bytes and self._busy in ("replicate", "update"):
            partial = m.PartialHeld(held, verified)  # a pull the loss suspended: its call comes again
        answered, answers = self._answered, tuple(self._answers)
        try:
            await send(lambda req: m.Announce(req, sid, tuple(holdings), partial, answered, answers))
        except VersionConflict as err:
            # The server dropped holdings whose checksums disagree with what others declared.
            self.log.error("failover: a re-announced holding conflicts with other holders; dropped", error=str(err))
            if live is not None and err.version == live:
                buffers.progress.reset(None)
                self.version = None
        self.log.info("re-announced after failover", held=live, offloads=offloads, answered=answered,
                      partial=None if partial is None else (partial.version, partial.verified))  # fmt: skip

    async def _release(self) -> None:
        rt, self._runtime = self._runtime, None
        if rt is not None:
            await rt.release()

    async def close(self) -> None:
        """Close the session: the server drops this shard's holdings (their readers are
        re-granted elsewhere), registration and retention declaration. Idempotent."""
        if self.closed:
            return
        if self._busy is not None:
            raise CallInFlight(f"close() while {self._busy}() is in flight; await it or cancel it first", **self.ctx)
        self.closed = True
        client, engine, sid = self._client, self._engine, self.session
        try:
            if client is not None and sid is not None and client.lost is None:
                # The server removes this shard's holdings (readers are re-granted elsewhere),
                # its layout and its retention declaration, and fails its unfinished calls.
                await self._request(lambda req: m.CloseShard(req, sid))
        except TensorHubError as err:
            self.log.warning("close: the server did not confirm; closing locally", error=str(err))
        finally:
            if engine is not None and sid is not None:
                await engine.ask(AbortPull(sid))
                await engine.ask(DropSlot(sid))
            if client is not None and sid is not None:
                client.drop_session(sid)
            self.version = None
            self.buffers = None
            await self._drop_seed()
            await self._drop_shadow()
            await self._drop_deltas()
            await self._release()

    async def __aenter__(self) -> AsyncShardHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- plumbing ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _call(self, name: str) -> Iterator[None]:
        if self.closed:
            raise UsageError(f"{name}() on a closed handle", **self.ctx)
        if self._busy is not None:
            raise CallInFlight(f"{name}() while {self._busy}() is in flight: one call at a time per handle", **self.ctx)
        self._busy = name
        try:
            yield
        finally:
            self._busy = None

    def _next_call(self) -> int:
        return next_call(self)  # the shard core's rule (tensorhub.core.shard): one numbering for all

    async def _request(self, build: Callable[[int], Any]) -> Any:
        assert self._client is not None
        return await self._client.ask(Call(build, self.session))

    async def _numbered(self, n: int, kind: str, build: Callable[[int], Any], version: int | None = None) -> Any:
        """A model-parallel call ``n``: its answer (or typed error) is kept, to be re-announced
        after a failover. A call that got no answer because the server was lost gives its number
        back: made again on the next server, it gets what the other shards were given."""
        try:
            reply = await self._request(build)
        except ServerUnavailable:
            give_back(self, n)
            raise
        except TensorHubError as err:
            if not isinstance(err, (Cancelled, ChecksumsRequired)):  # the server's answer (Cancelled: this
                # process stopped; ChecksumsRequired: the same call is made again with checksums)
                self._keep(m.CallAnswer(n, kind, None, None, None, None, type(err).code[:64], err.message[:1000]))
            raise
        if isinstance(reply, m.Listing):
            if reply.final:
                self._keep(m.CallAnswer(n, kind, None, None, reply.epoch, reply.versions))
        elif isinstance(reply, m.Replicated):
            self._keep(m.CallAnswer(n, kind, reply.version, None, None, None))
        elif isinstance(reply, m.Updated):
            self._keep(m.CallAnswer(n, kind, reply.version, reply.moved, None, None))
        else:
            self._keep(m.CallAnswer(n, kind, version, None, None, None))
        return reply

    def _keep(self, answer: m.CallAnswer) -> None:
        self._answers.append(answer)
        self._answered = max(self._answered, answer.call)

    def _need_registered(self, what: str) -> ShardBuffers:
        if self.buffers is None:
            raise NotRegistered(f"{what}() needs registered tensors: call register() first", **self.ctx)
        return self.buffers

    # ---- the API -------------------------------------------------------------------------------

    async def register(
        self,
        tensors: dict[str, torch.Tensor],
        placements: dict[str, TensorPlacement | PlacedTensor] | None = None,
        *,
        checksum: str | None = None,
    ) -> None:
        """Register this shard's tensors (used in place: replicate writes into them).

        ``checksum``: the algorithm of the shard's checksums, the same for every replica of the
        model (a registration that differs gets ``LayoutMismatch``). None: ``wordmix-64`` if the
        tensors are in GPU memory (hashed by the GPU at memory speed), else ``xxh3-64``; a CPU
        replica of a GPU-trained model names the GPU's (``checksum="wordmix-64"``).

        DTensors (torch.distributed) are registered as their local tensors (in place), with the
        placements they carry: no ``placements`` needed.

        ``placements``: per tensor name, what it is a part of in the whole model: a
        :class:`~tensorhub.core.placement.TensorPlacement` (global shape, ``Shard``/``Replicate``
        over a mesh; this shard sits at mesh position ``shard_idx``) or a
        :class:`~tensorhub.core.placement.PlacedTensor` (an explicit mesh coordinate). A trainer
        gives them so that converted models can be built from it; a converted model's shard
        must give them (see ``convert_from``).

        Raises:
            AlreadyRegistered, InvalidArgument, InvalidName, InvalidPlacement, LayoutMismatch.
        """
        with self._call("register"):
            if self.buffers is not None:
                raise AlreadyRegistered("tensors are already registered: unregister() first", **self.ctx)
            tensors, placements = _from_dtensors(tensors, placements, self.ctx)
            layout = layout_of(tensors, pack_threshold=_pack_threshold(), checksum=checksum, ctx=self.ctx)
            placed = None if placements is None else _placed(layout, placements, self.shard_idx, self.ctx, self.num_shards)
            if placed is None and self.convert_from is not None:
                raise InvalidPlacement(f"a shard converted from {self.convert_from!r} must register placements=", **self.ctx)
            convert = None
            if self.convert_from is not None:
                assert placed is not None
                convert = ConvertSpec(placed, self.num_shards, self.shard_idx, self.mapping, self.convert_budget)
            assert self._engine is not None and self._client is not None
            buffers = ShardBuffers(tensors, layout, packs_in_place=self._engine.packs_in_place)
            endpoint = await self._engine.ask(
                AddSlot(self.session, buffers, self._client.report, self.ctx, self.location, convert)
            )
            try:
                await self._request(lambda req: m.Register(req, self.session, layout, endpoint, None, placed))
            except BaseException:
                await self._engine.ask(DropSlot(self.session))
                raise
            self.buffers = buffers
            self._endpoint = endpoint
            self.placements = placed

    async def unregister(self) -> None:
        """Forget the registered tensors. Refused while they hold a published version."""
        with self._call("unregister"):
            self._need_registered("unregister")
            if self.version is not None:
                raise ContractViolation(f"unregister() while holding version {self.version}: unpublish() first", **self.ctx)
            await self._request(lambda req: m.Unregister(req, self.session))
            assert self._engine is not None
            await self._engine.ask(DropSlot(self.session))
            self.buffers = None
            self._endpoint = None
            await self._drop_shadow()

    async def publish(self, version: int) -> None:
        """Make the registered tensors visible as ``version``. Until :meth:`unpublish` returns,
        they must not be modified (the mutability contract). With ``deltas``, the delta from the
        version published before is computed and published in the background (see
        :mod:`tensorhub.handles.deltas`).

        Raises:
            NotRegistered, InvalidName, ContractViolation (holding another version), VersionConflict.
        """
        pub = self._delta_pub
        failed = pub.take_write_error() if pub is not None else None
        if failed is not None:  # never silent: a version the bucket did not store (the next is written as an anchor)
            raise failed
        await self._publish(version, delta_from=pub.announce(version) if pub is not None else None)
        if (self._delta_ring or self._bucket is not None) and self.session is not None:
            if self._delta_pub is None:
                self._delta_pub = DeltaPublisher(self, self._delta_ring, self._bucket)
            self._delta_pub.after_publish(version)

    async def _publish(self, version: int, base: int | None = None, delta_from: int | None = None) -> None:
        """:meth:`publish`; ``base``: a delta model's shard names the version its delta applies to;
        ``delta_from``: the delta from that version to this one will follow (readers wait for it)."""
        with self._call("publish"):
            validate_version(version, **self.ctx)
            self._need_registered("publish")
            if self.version is not None and self.version != version:
                raise ContractViolation(f"publish({version}) while holding version {self.version}: unpublish() first", **self.ctx)
            buffers = self.buffers
            assert buffers is not None
            held_before = self.version
            engine = self._engine
            assert engine is not None
            if held_before != version:
                # Named before the server can grant it; servable once the engine's publish job
                # has filled the packs (a reader granted first waits for the progress counter).
                buffers.progress.reset(version, 0)
            proof: tuple[int, ...] | None = None
            try:
                if held_before != version and version in (await engine.ask(Holdings(self.session)))[0]:
                    proof = await self._prove(version)  # this shard had the number before: same bytes?
                n = self._next_call()

                def publish(req: int) -> m.Publish:
                    return m.Publish(req, self.session, n, version, proof, base, delta_from)

                if base is not None:
                    self.delta_base = (version, base)

                try:
                    await self._numbered(n, "publish", publish, version)
                except ChecksumsRequired:  # the server knows the number's checksums: prove these bytes
                    proof = await self._prove(version)
                    await self._numbered(n, "publish", publish, version)
            except BaseException:
                if held_before is None:
                    buffers.progress.reset(None)
                raise
            self.version = version
            engine.tell(StartPublish(self.session, version, proof))  # pack, hash, declare: in the background

    async def _prove(self, version: int) -> tuple[int, ...]:
        """The checksums of the registered buffers, to publish ``version`` with. A version number
        names one content: if this shard knew other checksums for it (it published or pulled it
        before), the publish is refused here.

        Raises:
            VersionConflict: this shard held ``version`` before with other bytes.
        """
        assert self._engine is not None
        sums, known = await self._engine.ask(HashBuffers(self.session, version))
        if known is not None and known != sums:
            raise VersionConflict(
                f"publish({version}) refused: this shard held version {version} before with other bytes, and a "
                "version number names one content (publish the changed tensors as a new version)",
                **{**self.ctx, "version": version},
            )
        return sums

    async def unpublish(self) -> None:
        """Withdraw the held version; returns once no reader is still reading these buffers
        (after an offload copy was made, if it was the last copy of a retained version)."""
        with self._call("unpublish"):
            if self._delta_pub is not None:
                await self._delta_pub.settle()  # the delta's comparison reads the tensors
            await self._unpublish_now()

    async def _unpublish_now(self) -> None:
        if self._engine is not None and self.session is not None:
            await self._engine.ask(WaitPublished(self.session))  # its checksums are declared first
        n = self._next_call()
        await self._numbered(n, "unpublish", lambda req: m.Unpublish(req, self.session, n))
        if self.buffers is not None:
            self.buffers.progress.reset(None)  # readers across this change discard their bytes
        self.version = None

    async def replicate(self, version: int | str = "latest", timeout: float | None = None) -> int:
        """Pull ``version`` into the registered tensors (waiting for it to exist), and hold it.

        Returns:
            The absolute version now held.
        Raises:
            NotRegistered, InvalidName, VersionUnavailable, Timeout, Cancelled, TransportError...
        """
        with self._call("replicate"):
            reply = await self._pull(m.Replicate, version, timeout)
            return reply.version

    async def update(self, version: int | str = "latest", timeout: float | None = None) -> bool:
        """Move to ``version`` if it resolves to an available version other than the one held
        (for ``"latest"``: a newer one). Returns whether it moved; never raises because no
        version is available. While the client fails over to another server it returns False
        (the tensors keep what they hold).

        A call that has decided its version keeps it available until it is done (a *pin*: the
        trainer publishing newer versions meanwhile does not take it away), and one that has
        landed nothing yet moves to the newer version instead.

        Raises:
            UpdateAborted: it had started moving and failed for a real cause, named in the message
                (every source died, the server was lost mid-pull, a timeout): the handle now
                holds nothing (``empty`` is True, ``version`` None).
            ServerUnavailable: the client gave up looking for a server.
        """
        with self._call("update"):
            client = self._client
            if client is not None and client.failing_over(self.session):
                # No server now (failing over): no newer version is known. Arguments are still checked.
                parse_version_spec(version, **self.ctx)
                self._check_timeout(timeout)
                self._need_registered("update")
                return False
            assert self._engine is not None
            before = self._engine.pull_mark(self.session) if self.session is not None else 0
            try:
                try:
                    reply = await self._pull(m.Update, version, timeout)
                except ServerUnavailable:
                    # Refused by a server that does not decide (a backup while the primary holds
                    # the lease): find the one that does, and ask it instead.
                    began = self.session is not None and self._engine.pull_began(self.session, before)
                    if client is None or client.lost is not None or client.gave_up is not None or began:
                        raise
                    wait = client.failover_timeout if timeout is None else min(timeout, client.failover_timeout)
                    if not await client.seek_reign(wait):
                        return False  # nothing decides now: no newer version is known
                    reply = await self._pull(m.Update, version, timeout)
                if reply.deltas is not None:  # the server planned a chain of deltas for this replica
                    if self._delta_reader is None:
                        self._delta_reader = DeltaReader(self)
                    await self._delta_reader.land(reply, timeout)
                    self.skipped = None
                    return True
            except ServerUnavailable as err:
                self.skipped = None
                if client is None or not client.failing_over(self.session):
                    raise
                if self.session is not None and self._engine.pull_began(self.session, before):  # it had begun to move: the handle is empty
                    raise UpdateAborted(f"update aborted: the server was lost mid-pull ({err.message})", **self.ctx) from err
                return False  # lost before it moved: the tensors still hold what they held
            self.skipped = reply.skipped
            if reply.seed is not None:
                self._start_seed(reply.seed)
            elif self._seed is not None and self.version is not None and self.version >= self._seed_version:
                self._retire_seed()  # consumed: others of the datacenter pull from this replica now
            return reply.moved

    # ---- replicate-then-flip -------------------------------------------------------------------

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The registered tensors by name (after a flip: the set now active). Empty if none."""
        b = self.buffers
        return {} if b is None else {spec.name: t for spec, t in zip(b.layout.tensors, b.tensors)}

    @property
    def prefetched(self) -> int | None:
        """The version a finished :meth:`prefetch` holds in the shadow set, ready for
        :meth:`flip` (this shard's view; None: none, or still pulling, or failed)."""
        task = self._prefetch
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return task.result()

    async def register_shadow(self, tensors: dict[str, torch.Tensor] | None = None, max_bytes: int | None = None) -> int:
        """Own a second registered set of this shard's tensors (the *shadow* set), for
        :meth:`prefetch` and :meth:`flip`. It costs one more copy of the shard in its memory:
        the registered tensors' bytes plus their pack buffers (the return value, also
        :attr:`shadow_bytes`). The set is registered on the server as another replica (this
        replica's name with ``@shadow``; the two names swap at each flip), a normal holder that
        serves readers like any other.

        Args:
            tensors: the shadow set (same names, shapes and dtypes as the registered ones).
                None: allocated here, like the registered ones, on their devices.
            max_bytes: do not allocate more than this.

        Returns:
            The bytes the shadow set costs; 0 when it does not fit (``max_bytes``, the free
            memory of the device, or an allocation that failed): nothing is registered, and
            :meth:`flip` falls back to :meth:`update` in place (its pause is then the pull).

        Raises:
            NotRegistered, AlreadyRegistered, LayoutMismatch, InvalidArgument.
        """
        with self._call("register_shadow"):
            buffers = self._need_registered("register_shadow")
            if self._shadow is not None:
                raise AlreadyRegistered("a shadow set is already registered", **self.ctx)
            if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 0):
                raise InvalidArgument(f"max_bytes must be an int >= 0 or None, got {max_bytes!r}", **self.ctx)
            active = self.tensors
            packs = sum(r.numel() for r, p in zip(buffers.regions, buffers.plan.regions) if r is not None and p.tensor is None)
            if tensors is None:
                need = sum(t.numel() * t.element_size() for t in active.values()) + packs
                why = _shadow_does_not_fit(need, [t.device for t in active.values()], max_bytes)
                if why is None:
                    try:
                        tensors = {k: torch.empty(t.shape, dtype=t.dtype, device=t.device) for k, t in active.items()}
                    except torch.OutOfMemoryError as err:
                        why = f"allocating it failed ({err})"
                if why is not None:
                    self.log.warning("no shadow set: flip() will update in place", needs_bytes=need, why=why)
                    return 0
            else:
                if not isinstance(tensors, dict) or set(tensors) != set(active):
                    raise InvalidArgument("the shadow set must have the registered tensors' names", **self.ctx)
                shared = _sharing_storage(tensors, active)
                if shared:
                    a, b = shared[0]
                    raise InvalidArgument(
                        f"the shadow set must be memory of its own: shadow tensor {a!r} shares storage with the "
                        f"registered tensor {b!r} ({len(shared)} such pairs); a pull into it would overwrite the "
                        "version the active set holds and serves. Pass new tensors, or none (allocated here)",
                        **self.ctx,
                    )
                need = sum(t.numel() * t.element_size() for t in tensors.values()) + packs
            assert tensors is not None
            names = (self._base_replica, shadow_replica(self._base_replica))
            shadow = AsyncShardHandle(
                self.model, names[1] if self.replica == names[0] else names[0], self.num_shards, self.shard_idx,
                retain=None, server=self._server, location=self.location, spot=self.spot, transports=self._transports,
                connect_timeout=self.connect_timeout, convert_from=self.convert_from,
                mapping=self.mapping if self.convert_from is not None else None, convert_budget=self.convert_budget,
                deltas=self._delta_ring, bucket=self._bucket,
            )  # fmt: skip
            shadow._base_replica = self._base_replica
            await shadow._open()
            try:
                placements = None if self.placements is None else {p.name: p for p in self.placements}
                await shadow.register({k: tensors[k] for k in active}, placements, checksum=buffers.layout.checksum)
            except BaseException:
                await shadow.close()
                raise
            self._shadow, self.shadow_bytes = shadow, need
            self.log.info("shadow set registered", bytes=need, replica=shadow.replica)
            return need

    async def prefetch(self, version: int | str = "latest", timeout: float | None = None) -> int | None:
        """Start pulling ``version`` into the shadow set in the background, while the active
        set keeps serving (and stays published); :meth:`flip` then makes it active. A
        model-parallel call: every shard of the replica makes it, and all start the same version.

        Returns at once (after one round trip that fixes the version for every shard):
        the version being prefetched (the one already pending, if a prefetch has not been
        flipped yet), or None: nothing to do (for ``"latest"``: nothing newer than the active
        set; or no shadow set, where :meth:`flip` updates in place instead).

        Raises:
            NotRegistered, InvalidName, VersionUnavailable (``"latest-k"`` past version 0).
        """
        with self._call("prefetch"):
            spec = parse_version_spec(version, **self.ctx)
            self._check_timeout(timeout)
            self._need_registered("prefetch")
            if self._shadow is None:
                return None
            if self._prefetch is not None:
                return self._prefetch_version
            shadow = self._shadow
            if spec.relative and self.convert_from is not None:
                # A converted model's "latest" is decided by the server at pull time (from the
                # source's versions): the shadow set updates to it; flip() skips it if not newer.
                self._prefetch_version, self._prefetch_newer = None, True
                self._prefetch = asyncio.ensure_future(_update_into(shadow, spec.wire(), timeout))
                return None
            n = self._next_call()
            reply = await self._numbered(n, "list", lambda req: m.ListVersions(req, self.session, n))
            versions = reply.as_dict()
            if spec.relative:
                if not versions:
                    return None
                target = spec.resolve(max(versions))
                if target < 0:
                    raise VersionUnavailable(f"{spec} is before version 0 (latest is {max(versions)})", **self.ctx)
                if self.version is not None and target <= self.version:
                    return None
            else:
                target = spec.resolve(0)
                if target == self.version:
                    return None
            self._prefetch_version, self._prefetch_newer = target, spec.relative
            # With deltas, an update: the server may plan the standby set a chain from what it holds.
            pull = _update_into(shadow, target, timeout) if self._delta_ring else shadow.replicate(target, timeout)
            self._prefetch = asyncio.ensure_future(pull)
            self.log.debug("prefetching", version=target, into=shadow.replica)
            return target

    async def flip(self, wait: bool = True, timeout: float | None = None) -> bool:
        """Make the prefetched version active: swap the active and the shadow set, at a
        request boundary (between two uses of :attr:`tensors`), for every shard of the replica
        at the same call. Afterwards :attr:`tensors`, :attr:`version` and :attr:`buffers` are the
        new active set's; point the engine's parameters at :attr:`tensors` (e.g.
        ``p.data = h.tensors[name]``: no copy). The set that was active becomes the shadow set,
        still published with its version (it keeps serving readers) until the next prefetch
        pulls into it.

        Args:
            wait: True: wait for the pending prefetch to finish (the prefetch's own result is
                the same on every shard). False: flip only if every shard of the replica already
                holds it (decided once for all shards: a round trip), else return False at once.
            timeout: for the fallback ``update`` alone.

        Returns:
            Whether the active set changed. With no shadow set (it did not fit) this is
            :meth:`update` ("latest") in place.

        Raises:
            The pending prefetch's error (VersionUnavailable, Timeout, ...): the prefetch is
            dropped, the active set untouched; prefetch again.
        """
        if self._shadow is None:
            return await self.update("latest", timeout)
        with self._call("flip"):
            task, shadow = self._prefetch, self._shadow
            if not wait:
                n = self._next_call()  # on every shard, pending or not: the replica's calls stay in step
                reply = await self._numbered(n, "list", lambda req: m.ListVersions(req, self.session, n))
                listing = reply.as_dict()
                want = self._prefetch_version
                ready = want in listing and shadow.replica in listing[want] if want is not None else any(
                    shadow.replica in reps and (self.version is None or v > self.version) for v, reps in listing.items()
                )  # a converted model's prefetch: whatever newer version the shadow set holds whole
                if task is None or not ready:
                    if task is not None and task.done() and (task.cancelled() or task.exception() is not None):
                        await self._flip_failed(task)
                    return False
            if task is None:
                return False
            try:
                target = await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.done():
                    raise  # this call was cancelled; the prefetch goes on
                await self._flip_failed(task)
                raise
            except TensorHubError:
                await self._flip_failed(task)
                raise
            self._prefetch = None
            if target is None:
                return False
            if self.version is not None and (target == self.version or (self._prefetch_newer and target < self.version)):
                return False  # the active set moved past it meanwhile (update())
            self._swap_banks()
            self.flips += 1
            self.log.info("flipped", version=self.version, previous=self._shadow.version if self._shadow else None)
            return True

    async def _flip_failed(self, task: asyncio.Future) -> None:
        self._prefetch = None
        self.log.warning("prefetch failed; the active set is untouched", version=self._prefetch_version,
                         error=repr(task.exception()) if not task.cancelled() else "cancelled")  # fmt: skip

    def _swap_banks(self) -> None:
        """Swap the sessions of this handle and its shadow: everything a session owns moves with
        it (its name, server session, registered buffers, held version, call numbers); what the
        user's handle owns (the shadow link, the prefetch, the call in flight) stays."""
        other = self._shadow
        assert other is not None and other._busy is None
        mine = {k: self.__dict__.pop(k) for k in _KEPT_ACROSS_FLIP}
        theirs = {k: other.__dict__.pop(k) for k in _KEPT_ACROSS_FLIP}
        self.__dict__, other.__dict__ = other.__dict__, self.__dict__
        self.__dict__.update(mine)
        other.__dict__.update(theirs)
        self._owner.target, other._owner.target = self, other
        for h in (self, other):  # a bank's delta sides go with its session
            for side in (h._delta_pub, h._delta_reader):
                if side is not None:
                    side.owner = h

    async def _drop_shadow(self) -> None:
        """Stop a prefetch and close the shadow set (its readers are re-granted elsewhere)."""
        shadow, task = self._shadow, self._prefetch
        self._shadow = self._prefetch = None
        self.shadow_bytes = 0
        if task is not None and not task.done():
            task.cancel()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, TensorHubError):
                await task
        if shadow is not None:
            await shadow.close()

    # ---- offload seeding -----------------------------------------------------------------------

    @property
    def seeding(self) -> int | None:
        """The version this handle's offload seed holds or is pulling (None: no seed)."""
        return self._seed_version if self._seed is not None else None

    def _start_seed(self, version: int) -> None:
        """Pull ``version`` into a CPU copy of the shard in the background (the server chose this
        replica to offload-seed it into its datacenter)."""
        old_seed, old_task = self._seed, self._seed_task
        assert self.buffers is not None
        layout = self.buffers.layout
        pin = torch.cuda.is_available()
        tensors = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype), pin_memory=pin) for t in layout.tensors}
        seed = AsyncShardHandle(
            self.model, seed_replica(self.replica), self.num_shards, self.shard_idx, retain=None, server=self._server,
            location=self.location, spot=True, transports=self._transports, connect_timeout=self.connect_timeout,
        )  # fmt: skip
        self._seed, self._seed_version = seed, version

        async def run() -> None:
            if old_seed is not None:
                await _close_seed(old_seed, old_task)
            t0 = asyncio.get_running_loop().time()
            try:
                await seed._open()
                await seed.register(tensors, checksum=layout.checksum)
                await seed.replicate(version)
            except TensorHubError as err:
                self.log.warning("offload seeding failed; a later update() seeds again", version=version, error=str(err))
                if self._seed is seed:
                    self._seed = None
                await seed.close()
                return
            self.log.info("offload seed ready", version=version, seconds=round(asyncio.get_running_loop().time() - t0, 3))

        self._seed_task = asyncio.ensure_future(run())

    def _retire_seed(self) -> None:
        seed, task = self._seed, self._seed_task
        self._seed = self._seed_task = None
        if seed is not None:
            fut = asyncio.ensure_future(_close_seed(seed, task))
            self._retiring.add(fut)
            fut.add_done_callback(self._retiring.discard)

    async def _drop_deltas(self) -> None:
        pub, reader = self._delta_pub, self._delta_reader
        self._delta_pub = self._delta_reader = None
        if pub is not None:
            await pub.close()
        if reader is not None:
            await reader.close()

    async def _drop_seed(self) -> None:
        seed, task = self._seed, self._seed_task
        self._seed = self._seed_task = None
        if seed is not None:
            await _close_seed(seed, task)
        if self._retiring:
            await asyncio.wait(list(self._retiring))

    def _check_timeout(self, timeout: float | None) -> None:
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise InvalidArgument(f"timeout must be a number >= 0 or None, got {timeout!r}", **self.ctx)

    async def _pull(self, cls: type, version: int | str, timeout: float | None, held: tuple[int, ...] | None = None) -> Any:
        try:
            return await self._pull_once(cls, version, timeout, held)
        except (TransportError, VersionUnavailable, UpdateAborted) as err:
            url = err.bucket if isinstance(err, InBucket) and err.bucket else self._bucket
            if url is None or held is not None or err.version is None:
                raise
            # No peer could serve it (unreachable, or gone): the bucket tier (the server names
            # it, InBucket, or this handle's own), never before a peer.
            reply = await restore_from_bucket(self, url, err, timeout)
            return m.Updated(reply.req, True, reply.version) if cls is m.Update else reply

    async def _pull_once(self, cls: type, version: int | str, timeout: float | None, held: tuple[int, ...] | None) -> Any:
        spec = parse_version_spec(version, **self.ctx).wire()
        self._check_timeout(timeout)
        self._need_registered(cls.__name__.lower())
        assert self._engine is not None and self.session is not None
        before = self._engine.pull_mark(self.session)
        extra = (self.offload_seeding, self._delta_ring > 0) if cls is m.Update else (held,)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        for attempt in range(_RESUMES + 1):
            left = None if deadline is None else max(0.0, deadline - loop.time())
            n = self._next_call()
            try:
                reply = await self._numbered(n, cls.__name__.lower(), lambda req, n=n, left=left: cls(req, self.session, n, spec, left, *extra))
                break
            except asyncio.CancelledError:
                await asyncio.shield(self._abandon())
                raise
            except TensorHubError as err:
                if isinstance(err, ServerUnavailable) and attempt < _RESUMES and await self._resume(before, deadline):
                    continue  # the same call (its number given back) on the next server, which resumes the pull
                outcome = await self._engine.ask(AbortPull(self.session, before))
                if isinstance(err, UpdateAborted) or outcome.began:
                    self.version = None  # it had begun moving: the server unpublished the old holding
                raise
        if isinstance(reply, m.Replicated) or (isinstance(reply, m.Updated) and reply.moved):
            self.version = reply.version
        return reply

    async def _resume(self, before: int, deadline: float | None) -> bool:
        """The server was lost during a replicate/update whose pull had begun: wait (within the
        call's time and the client's failover bound) for the client to move; the handle's
        restore re-announced the pull as a partial holding. True: make the call again."""
        assert self._engine is not None and self.session is not None
        client = self._client
        if client is None or not self._engine.pull_began(self.session, before):
            return False
        wait = client.failover_timeout
        if deadline is not None:
            wait = min(wait, deadline - asyncio.get_running_loop().time())
        if wait <= 0:
            return False
        try:
            await client.ready(wait)
        except ServerUnavailable:
            return False
        self.log.info("server lost mid-pull; resuming on the next one", server=client.address)
        return True

    async def _abandon(self) -> None:
        """A cancelled replicate/update: unpublish the partial holding (which fails the call
        for the whole replica) and wait until nothing writes into the buffers."""
        assert self._engine is not None
        n = self._next_call()
        try:
            await self._request(lambda req: m.Unpublish(req, self.session, n))
        except TensorHubError as err:
            self.log.warning("cancelled pull: unpublish refused", error=str(err))
        await self._engine.ask(AbortPull(self.session))
        if self.buffers is not None:
            self.buffers.progress.reset(None)
        self.version = None

    async def list(self, consistent: bool = False) -> Versions:
        """``{version: {replica: ReplicaInfo}}`` of the available versions (a replica is listed
        once all its shards hold the version completely). ``consistent=True``: every shard of
        this replica gets the same answer (a model-parallel call)."""
        with self._call("list"):
            n = self._next_call() if consistent else None
            if n is None:
                reply = await self._request(lambda req: m.ListVersions(req, self.session, None))
            else:
                reply = await self._numbered(n, "list", lambda req: m.ListVersions(req, self.session, n))
            return reply.as_dict()

    async def wait(self, predicate: Callable[[Versions], bool], timeout: float | None = None) -> Versions:
        """Wait until ``predicate(list())`` is true, and return that listing. All shards of the
        replica return the same listing (the first shard to see the predicate true decides).

        Raises:
            Timeout: not true within ``timeout`` seconds.
        """
        with self._call("wait"):
            if not callable(predicate):
                raise InvalidArgument(f"wait() takes a predicate over list(), got {type(predicate).__name__}", **self.ctx)
            n = self._next_call()
            known = -1
            satisfied: int | None = None
            for _ in range(1 << 30):  # each turn waits for the listing to change: bounded by time
                reply = await self._numbered(n, "wait", lambda req, k=known, sat=satisfied: m.Wait(req, self.session, n, k, sat, timeout))
                if reply.final:
                    return reply.as_dict()
                versions = reply.as_dict()
                known = reply.epoch
                satisfied = reply.epoch if predicate(versions) else None
            raise AssertionError("unreachable")  # pragma: no cover

    @property
    def last_pull(self) -> PullStats | None:
        """What the latest pull into this handle moved, and which sources served it."""
        if self._engine is None or self.session is None:
            return None
        return self._engine.pull_stats(self.session)

    @property
    def last_conversion(self) -> ConversionStats | None:
        """What the latest conversion this shard ran did (None: it never converted: it pulled
        converted bytes from a peer, or it is not a converted model's shard)."""
        if self._engine is None or self.session is None:
            return None
        return self._engine.conversion_stats(self.session)


def _from_dtensors(
    tensors: dict[str, torch.Tensor], placements: dict[str, Any] | None, ctx: dict
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """DTensors become their local tensors, and their placements those they carry (unless given)."""
    # A DTensor exists only once its module is imported: importing it here would cost the first
    # register about a second of the loop (it pulls in sympy), long enough to miss heartbeats.
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    if not isinstance(tensors, dict) or dtensor_module is None:
        return tensors, placements
    DTensor = dtensor_module.DTensor

    if not any(isinstance(t, DTensor) for t in tensors.values()):
        return tensors, placements
    from tensorhub.reshard.dtensor import placed_tensors

    if placements is None:
        placements = {pt.name: pt for pt in placed_tensors(tensors.items())}
    return {k: t.to_local() if isinstance(t, DTensor) else t for k, t in tensors.items()}, placements


def _placed(
    layout: Layout, placements: dict[str, TensorPlacement | PlacedTensor], shard_idx: int, ctx: dict,
    num_shards: int | None = None,
) -> tuple[PlacedTensor, ...]:
    """Every registered tensor's placement, in layout order, checked against its local tensor
    and (``num_shards``) against the replica: a mesh is laid over its shards, as many as they."""
    if not isinstance(placements, dict):
        raise InvalidArgument(f"placements must be a dict of tensor name -> placement, got {type(placements).__name__}", **ctx)
    extra = sorted(set(placements) - {t.name for t in layout.tensors})
    if extra:
        raise InvalidPlacement(f"placements name tensors that are not registered: {extra[:5]}", tensors=tuple(extra[:16]), **ctx)
    out = []
    for spec in layout.tensors:
        p = placements.get(spec.name)
        if p is None:
            raise InvalidPlacement(f"tensor {spec.name!r} has no placement", tensors=(spec.name,), **ctx)
        if isinstance(p, TensorPlacement):
            if p.mesh and not 0 <= shard_idx < math.prod(p.mesh):
                raise InvalidPlacement(f"tensor {spec.name!r}: shard {shard_idx} is outside its mesh {list(p.mesh)}", tensors=(spec.name,), **ctx)
            p = PlacedTensor(p, p.coord_of(shard_idx) if p.mesh else ())
        elif not isinstance(p, PlacedTensor):
            raise InvalidPlacement(f"tensor {spec.name!r}: a placement must be a TensorPlacement or PlacedTensor, got {type(p).__name__}", tensors=(spec.name,), **ctx)
        if p.name != spec.name:
            raise InvalidPlacement(f"tensor {spec.name!r}: its placement is named {p.name!r}", tensors=(spec.name,), **ctx)
        mesh = p.placement.mesh
        if num_shards is not None and mesh and math.prod(mesh) != num_shards:
            raise InvalidPlacement(
                f"tensor {spec.name!r}: its mesh {list(mesh)} has {math.prod(mesh)} positions, but the replica has "
                f"num_shards={num_shards} shards (a mesh is laid over the replica's shards, one position each)",
                tensors=(spec.name,), **ctx,
            )  # fmt: skip
        if p.spec() != spec:
            raise InvalidPlacement(
                f"tensor {spec.name!r} is {spec.dtype}{list(spec.shape)}; its placement gives {p.spec().dtype}{list(p.spec().shape)} here",
                tensors=(spec.name,), **ctx,
            )  # fmt: skip
        out.append(p)
    return tuple(out)


async def _update_into(shadow: AsyncShardHandle, version: int | str, timeout: float | None) -> int | None:
    await shadow.update(version, timeout)
    return shadow.version


async def _close_seed(seed: AsyncShardHandle, task: asyncio.Task | None) -> None:
    """Free an offload seed: stop its pull, let its readers drain (unpublish), close it."""
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TensorHubError):
            await task
    if seed.closed:
        return
    try:
        if seed.version is not None and seed._busy is None:
            await seed.unpublish()
    except TensorHubError as err:
        seed.log.warning("offload seed: unpublish refused; closing", error=str(err))
    await seed.close()


async def open_async(model: str, replica: str, **kw: Any) -> AsyncShardHandle:
    h = AsyncShardHandle(model, replica, **kw)
    return await h._open()


class _AsyncOpen:
    """``tensorhub.aio.open(...)``: awaitable, or an async context manager that closes."""

    def __init__(self, model: str, replica: str, kw: dict) -> None:
        self._args = (model, replica, kw)
        self._handle: AsyncShardHandle | None = None

    def __await__(self) -> Any:
        model, replica, kw = self._args
        return open_async(model, replica, **kw).__await__()

    async def __aenter__(self) -> AsyncShardHandle:
        model, replica, kw = self._args
        self._handle = await open_async(model, replica, **kw)
        return self._handle

    async def __aexit__(self, *exc: object) -> None:
        if self._handle is not None:
            await self._handle.close()


# ---- the synchronous facade ----------------------------------------------------------------------

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

    def _run(self, coro: Any) -> Any:
        return self._loop.run(coro)

    def register(
        self, tensors: dict[str, torch.Tensor], placements: dict[str, Any] | None = None, *, checksum: str | None = None
    ) -> None:
        return self._run(self._h.register(tensors, placements, checksum=checksum))

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
