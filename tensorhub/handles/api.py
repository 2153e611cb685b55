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
import os
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import zmq.asyncio

from tensorhub.core import messages as m
from tensorhub.core.errors import (
    AlreadyRegistered,
    CallInFlight,
    Cancelled,
    ContractViolation,
    InvalidArgument,
    NotRegistered,
    ServerUnavailable,
    TensorHubError,
    Timeout,
    UpdateAborted,
    UsageError,
    VersionConflict,
)
from tensorhub.core.log import get_logger
from tensorhub.core.naming import (
    parse_retain,
    parse_version_spec,
    seed_replica,
    validate_model,
    validate_replica,
    validate_shard,
    validate_version,
)
from tensorhub.core.topology import Location
from tensorhub.runtime.actor import LoopThread
from tensorhub.runtime.client import Call, ClientActor, Exchange
from tensorhub.runtime.embedded import parse_servers, resolve_servers
from tensorhub.runtime.engine import (
    AbortPull,
    AddSlot,
    DropSlot,
    EngineActor,
    Holdings,
    PullStats,
    StartPublish,
    WaitPublished,
)
from tensorhub.scheduling.edges import parse_preference
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
        engine = EngineActor(started, chunk_bytes=int(chunk) if chunk else 8 << 20, preference=preference)
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
        num_shards: int = 1,
        shard_idx: int = 0,
        retain: str | None = "latest",
        server: str | Sequence[str] | None = None,
        location: Location | None = None,
        spot: bool = False,
        transports: dict[str, dict] | None = None,
        connect_timeout: float = 10.0,
        offload_seeding: bool = False,
    ) -> None:
        self.model = validate_model(model)
        self.replica = validate_replica(replica, model=self.model)
        ctx = {"model": self.model, "replica": self.replica}
        self.num_shards, self.shard_idx = validate_shard(num_shards, shard_idx, **ctx)
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
        self._calls = 0
        self._busy: str | None = None
        self._incarnation = uuid.uuid4().hex
        self._endpoint: Any = None  # the engine's endpoint for the registered buffers
        self._answered = 0  # the last call number that got a final answer
        self._answers: collections.deque[m.CallAnswer] = collections.deque(maxlen=_ANSWERS_KEPT)

    # ---- opening and closing -------------------------------------------------------------------

    async def _open(self) -> AsyncShardHandle:
        rt = Runtime.current()
        self._client, self._engine = await rt.acquire(self._server, self._transports)
        self._runtime = rt
        try:
            await self._client.ready(self.connect_timeout)
            self.session, opened = await self._client.ask(Call(self.open_message, adopt=self), timeout=self.connect_timeout)
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
                           self.location, self.spot, self.retain_back)  # fmt: skip

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
        await send(lambda req: m.Register(req, sid, buffers.layout, endpoint))
        await engine.ask(WaitPublished(sid))  # a publish's checksums are known before it is announced
        sums, offloads = await engine.ask(Holdings(sid))  # the checksums and offload copies it knows
        holdings: list[m.Held] = []
        _, held, verified = buffers.progress.snapshot()
        live = held if held is not None and held == self.version and verified >= buffers.total_bytes else None
        if live is not None:
            holdings.append(m.Held(live, m.KIND_NORMAL, sums.get(live)))
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
        self._calls += 1
        return self._calls

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
            if self._calls == n:
                self._calls = n - 1
            raise
        except TensorHubError as err:
            if not isinstance(err, Cancelled):  # the server's answer (Cancelled: this process stopped)
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

    async def register(self, tensors: dict[str, torch.Tensor]) -> None:
        """Register this shard's tensors (used in place: replicate writes into them).

        Raises:
            AlreadyRegistered, InvalidArgument, InvalidName, LayoutMismatch.
        """
        with self._call("register"):
            if self.buffers is not None:
                raise AlreadyRegistered("tensors are already registered: unregister() first", **self.ctx)
            layout = layout_of(tensors, pack_threshold=_pack_threshold(), ctx=self.ctx)
            assert self._engine is not None and self._client is not None
            buffers = ShardBuffers(tensors, layout, packs_in_place=self._engine.packs_in_place)
            endpoint = await self._engine.ask(AddSlot(self.session, buffers, self._client.report, self.ctx, self.location))
            try:
                await self._request(lambda req: m.Register(req, self.session, layout, endpoint))
            except BaseException:
                await self._engine.ask(DropSlot(self.session))
                raise
            self.buffers = buffers
            self._endpoint = endpoint

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

    async def publish(self, version: int) -> None:
        """Make the registered tensors visible as ``version``. Until :meth:`unpublish` returns,
        they must not be modified (the mutability contract).

        Raises:
            NotRegistered, InvalidName, ContractViolation (holding another version), VersionConflict.
        """
        with self._call("publish"):
            validate_version(version, **self.ctx)
            self._need_registered("publish")
            if self.version is not None and self.version != version:
                raise ContractViolation(f"publish({version}) while holding version {self.version}: unpublish() first", **self.ctx)
            buffers = self.buffers
            assert buffers is not None
            held_before = self.version
            if held_before != version:
                # Named before the server can grant it; servable once the engine's publish job
                # has filled the packs (a reader granted first waits for the progress counter).
                buffers.progress.reset(version, 0)
            n = self._next_call()
            try:
                await self._numbered(n, "publish", lambda req: m.Publish(req, self.session, n, version, None), version)
            except BaseException:
                if held_before is None:
                    buffers.progress.reset(None)
                raise
            self.version = version
            assert self._engine is not None
            self._engine.tell(StartPublish(self.session, version))  # pack, hash, declare: in the background

    async def unpublish(self) -> None:
        """Withdraw the held version; returns once no reader is still reading these buffers
        (after an offload copy was made, if it was the last copy of a retained version)."""
        with self._call("unpublish"):
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
            before = self._engine.pull_stats(self.session) if self.session is not None else None
            try:
                reply = await self._pull(m.Update, version, timeout)
            except ServerUnavailable as err:
                self.skipped = None
                if client is None or not client.failing_over(self.session):
                    raise
                if self._engine.pull_stats(self.session) is not before:  # it had begun to move: the handle is empty
                    raise UpdateAborted(f"update aborted: the server was lost mid-pull ({err.message})", **self.ctx) from err
                return False  # lost before it moved: the tensors still hold what they held
            self.skipped = reply.skipped
            if reply.seed is not None:
                self._start_seed(reply.seed)
            elif self._seed is not None and self.version is not None and self.version >= self._seed_version:
                self._retire_seed()  # consumed: others of the datacenter pull from this replica now
            return reply.moved

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
                await seed.register(tensors)
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

    async def _pull(self, cls: type, version: int | str, timeout: float | None) -> Any:
        spec = parse_version_spec(version, **self.ctx).wire()
        self._check_timeout(timeout)
        self._need_registered(cls.__name__.lower())
        assert self._engine is not None and self.session is not None
        before = self._engine.pull_stats(self.session)
        extra = (self.offload_seeding,) if cls is m.Update else ()
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
                await self._engine.ask(AbortPull(self.session))
                if isinstance(err, UpdateAborted) or self._engine.pull_stats(self.session) is not before:
                    self.version = None  # it had begun moving: the server unpublished the old holding
                raise
        if isinstance(reply, m.Replicated) or (isinstance(reply, m.Updated) and reply.moved):
            self.version = reply.version
        return reply

    async def _resume(self, before: PullStats | None, deadline: float | None) -> bool:
        """The server was lost during a replicate/update whose pull had begun: wait (within the
        call's time and the client's failover bound) for the client to move; the handle's
        restore re-announced the pull as a partial holding. True: make the call again."""
        assert self._engine is not None and self.session is not None
        client = self._client
        if client is None or self._engine.pull_stats(self.session) is before:
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

    def register(self, tensors: dict[str, torch.Tensor]) -> None:
        return self._run(self._h.register(tensors))

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
