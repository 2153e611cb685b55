"""One shard's session on the server: the state a handle carries, and what every call uses.

Theory of operation
-------------------
:class:`ShardSession` declares the state of a handle in one place (what it was opened with,
filled in and checked by :class:`~tensorhub.handles.shard.AsyncShardHandle`; and what its session
holds now), so that the checker and a reader see what each part of the handle reads and writes.
Its methods are the plumbing every call goes through:

- **one call at a time** (:meth:`ShardSession._call`): a second call while one runs raises
  :class:`~tensorhub.errors.CallInFlight`; a call on a closed handle raises
  :class:`~tensorhub.errors.UsageError`;
- **opening** (:meth:`ShardSession._open`): acquire the loop's
  :class:`~tensorhub.handles.actors.Runtime` (its client for this server list, its engine) and
  open the session; a server that does not answer is :class:`~tensorhub.errors.ServerUnavailable`;
- **model-parallel calls** (:meth:`ShardSession._numbered`): every shard of a replica numbers its
  calls 1, 2, 3, ... (:func:`tensorhub.core.shard.next_call`) and the server gives each shard of
  the replica the same answer to the same call. The last answers are kept (a bounded deque),
  to be re-announced after a failover;
- **failover** (:meth:`ShardSession.restore`, called by the client actor once it moved to the
  next server): register the layout again and announce what the shard holds (the version its
  buffers hold whole, its offload copies, each with the checksums this process knows), a pull the
  loss suspended, and the kept answers, so that the new server answers the replica's other shards
  what this one was told. A call whose answer was lost gives its number back
  (:func:`tensorhub.core.shard.give_back`): made again on the new server, it gets the answer the
  other shards were given.

It never touches the registered tensors' bytes (the engine does), and it holds no second copy of
anything: a flip (:mod:`tensorhub.handles.flip`) moves a whole session's state from one handle
object to another, and :class:`SessionRef` follows it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, Self, TypedDict

import torch

from tensorhub.core import messages as m
from tensorhub.core.errors import (
    BucketUnavailable,
    CallInFlight,
    Cancelled,
    ChecksumsRequired,
    InvalidArgument,
    NotRegistered,
    ServerUnavailable,
    TensorHubError,
    Timeout,
    UsageError,
    VersionConflict,
)
from tensorhub.core.log import get_logger
from tensorhub.core.placement import PlacedTensor, TensorPlacement
from tensorhub.core.shard import give_back, next_call
from tensorhub.core.topology import Location
from tensorhub.handles.actors import Runtime
from tensorhub.handles.defaults import server_from_ray
from tensorhub.handles.deltas import DeltaPublisher, DeltaReader, DeltaStats
from tensorhub.runtime.bucket import Bucket, Restored
from tensorhub.runtime.client import Call, ClientActor, Exchange
from tensorhub.runtime.convert import ConversionStats
from tensorhub.runtime.engine import EngineActor, Holdings, PullStats, WaitPublished
from tensorhub.scheduling.mapping import Mapping
from tensorhub.transports.buffers import ShardBuffers

__all__ = ["ANSWERS_KEPT", "SessionRef", "ShardContext", "ShardSession", "Sibling"]

ANSWERS_KEPT = 16
"""Model-parallel answers a shard keeps, re-announced after a failover."""


class ShardContext(TypedDict):
    """What names a shard in its errors and log lines (the keywords of
    :class:`~tensorhub.errors.TensorHubError`)."""

    model: str
    replica: str
    shard: int


class Sibling(Protocol):
    """A handle of another replica of this shard, as the handle's parts use one (a shadow
    bank, an offload seed, a delta replica): :class:`~tensorhub.handles.shard.AsyncShardHandle`
    is one."""

    replica: str
    version: int | None
    closed: bool
    log: Any

    @property
    def busy(self) -> str | None: ...

    async def _open(self) -> Self: ...

    async def register(
        self,
        tensors: dict[str, torch.Tensor],
        placements: dict[str, TensorPlacement | PlacedTensor] | None = None,
        *,
        checksum: str | None = None,
    ) -> None: ...

    async def replicate(self, version: int | str = "latest", timeout: float | None = None) -> int: ...

    async def update(self, version: int | str = "latest", timeout: float | None = None) -> bool: ...

    async def unpublish(self) -> None: ...

    async def close(self) -> None: ...


class SessionRef:
    """What the client actor keeps for a session (its ``SessionOwner``): the handle object that
    holds that session's state now. A flip moves the state to the other object and re-points it."""

    __slots__ = ("target",)

    def __init__(self, target: ShardSession) -> None:
        self.target = target

    def open_message(self, req: int) -> m.OpenShard:
        return self.target.open_message(req)

    async def restore(self, send: Exchange) -> None:
        await self.target.restore(send)


class ShardSession:
    """The state of one shard handle and the plumbing of its calls (see the module docstring).

    The options are set and checked by :class:`~tensorhub.handles.shard.AsyncShardHandle`
    before this ``__init__`` runs; this sets what a session holds before it is opened.
    """

    # ---- what it was opened with (AsyncShardHandle.__init__ checks and sets these) -------------
    model: str
    replica: str
    num_shards: int
    shard_idx: int
    ctx: ShardContext
    retain_back: int | None
    location: Location
    spot: bool
    offload_seeding: bool
    convert_from: str | None
    mapping: Mapping
    convert_budget: int
    connect_timeout: float
    _delta_ring: int  # deltas kept published (0: no deltas)
    _bucket: str | None  # the bucket URL (None: none)
    _server: str | Sequence[str] | None  # as given (None: $TENSORHUB_SERVER, Ray, or embedded)
    _transports: dict[str, dict[str, Any]] | None

    def __init__(self) -> None:
        self.log: Any = get_logger(**self.ctx)
        self.session: int | None = None
        self.version: int | None = None  # the version the registered buffers hold (published or replicated)
        self.buffers: ShardBuffers | None = None
        self.placements: tuple[PlacedTensor, ...] | None = None  # registered with the tensors, if given
        self.closed = False
        self._runtime: Runtime | None = None
        self._client: ClientActor | None = None
        self._engine: EngineActor | None = None
        self._endpoint: Any = None  # the engine's endpoint for the registered buffers
        self._busy: str | None = None  # the call in flight
        self._incarnation = uuid.uuid4().hex
        self.calls = 0  # the last model-parallel call number given (tensorhub.core.shard.next_call)
        self._answered = 0  # the last call number that got a final answer
        self._answers: collections.deque[m.CallAnswer] = collections.deque(maxlen=ANSWERS_KEPT)
        # What the client actor holds for this session; a flip moves the state and re-points it.
        self._owner = SessionRef(self)
        self._base_replica = self.replica  # the name the user opened (the banks: it and its shadow replica)
        #: a delta model's shard: (the version its buffers hold, the base its delta applies to),
        #: re-announced after a failover so that the next server plans deltas with it
        self.delta_base: tuple[int, int] | None = None
        #: the newer version the last ``update()`` skipped because this datacenter is seeding it
        self.skipped: int | None = None
        #: what the last pull that fell back to the bucket restored (None: none did)
        self.last_bucket: Restored | None = None
        #: what the last update() planned as a delta chain did (None: it pulled in full, or no update yet)
        self.last_delta: DeltaStats | None = None
        self._delta_pub: DeltaPublisher | None = None
        self._delta_reader: DeltaReader | None = None

    # ---- opening ---------------------------------------------------------------------------------

    async def _open(self) -> Self:
        if self._bucket is not None:  # a URL that cannot work fails here, typed, not at every publish()
            try:
                await asyncio.to_thread(Bucket, self._bucket)
            except BucketUnavailable as err:
                raise BucketUnavailable(err.message, **self.ctx) from err.__cause__
        rt = Runtime.current()
        if self._server is None and not os.environ.get("TENSORHUB_SERVER"):
            self._server = await asyncio.to_thread(server_from_ray)  # None: not in a Ray job with one
        client, self._engine = await rt.acquire(self._server, self._transports)
        self._client, self._runtime = client, rt
        try:
            await client.ready(self.connect_timeout)
            self.session, opened = await client.ask(Call(self.open_message, adopt=self._owner), timeout=self.connect_timeout)
        except Timeout:
            await self._release()
            raise ServerUnavailable(f"no answer from the server at {client.address} in {self.connect_timeout:g} s", **self.ctx) from None
        except ServerUnavailable as err:
            await self._release()
            raise ServerUnavailable(err.message, **self.ctx) from None
        except BaseException:
            await self._release()
            raise
        self.log = self.log.bind(session=self.session)
        self.log.debug("opened", server=client.address, term=opened.term)
        return self

    async def _release(self) -> None:
        rt, self._runtime = self._runtime, None
        if rt is not None:
            await rt.release()

    # ---- what it holds -------------------------------------------------------------------------

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

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The registered tensors by name (after a flip: the set now active). Empty if none."""
        b = self.buffers
        return {} if b is None else {spec.name: t for spec, t in zip(b.layout.tensors, b.tensors)}

    @property
    def busy(self) -> str | None:
        """The name of the call in flight on this handle (None: none)."""
        return self._busy

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
        if buffers is None or self._endpoint is None or engine is None or sid is None or self.closed:
            return
        endpoint, placements = self._endpoint, self.placements
        await send(lambda req: m.Register(req, sid, buffers.layout, endpoint, None, placements))
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

    @property
    def _sid(self) -> int:
        """The session's id on the server (read when a request is built: a failover keeps it)."""
        if self.session is None:
            raise UsageError("the handle is not open (open it with tensorhub.open or tensorhub.aio.open)", **self.ctx)
        return self.session

    def _next_call(self) -> int:
        return next_call(self)  # the shard core's rule (tensorhub.core.shard): one numbering for all

    async def _request(self, build: Callable[[int], Any]) -> Any:
        if self._client is None:
            raise UsageError("the handle is not open (open it with tensorhub.open or tensorhub.aio.open)", **self.ctx)
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

    def _need_engine(self) -> EngineActor:
        if self._engine is None:
            raise UsageError("the handle is not open (open it with tensorhub.open or tensorhub.aio.open)", **self.ctx)
        return self._engine

    def _check_timeout(self, timeout: float | None) -> None:
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise InvalidArgument(f"timeout must be a number >= 0 or None, got {timeout!r}", **self.ctx)
