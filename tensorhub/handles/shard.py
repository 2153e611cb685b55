"""The shard handle, :class:`AsyncShardHandle`: the public API of DESIGN.md §2, awaitable.

It checks its arguments and holds the one-call guard and the docstrings of every method; the
bodies live by seam (``tensorhub.handles.api`` has the map): the session's state and plumbing in
:mod:`~tensorhub.handles.session` (its base class), registration's checks in
:mod:`~tensorhub.handles.placements`, the publishing and listing calls in
:mod:`~tensorhub.handles.calls`, the pulls in :mod:`~tensorhub.handles.pulls`, replicate-then-flip
in :mod:`~tensorhub.handles.flip`, offload seeding in :mod:`~tensorhub.handles.seeding`, deltas
and the bucket in :mod:`~tensorhub.handles.deltas`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tensorhub.core import messages as m
from tensorhub.core.errors import (
    AlreadyRegistered,
    CallInFlight,
    ContractViolation,
    InvalidArgument,
    InvalidPlacement,
    TensorHubError,
)
from tensorhub.core.naming import (
    delta_model,
    parse_retain,
    seed_replica,
    validate_model,
    validate_replica,
    validate_shard,
)
from tensorhub.core.placement import PlacedTensor, TensorPlacement
from tensorhub.core.topology import Location
from tensorhub.handles import calls, pulls
from tensorhub.handles.calls import Versions
from tensorhub.handles.defaults import default_sharding, pack_threshold
from tensorhub.handles.deltas import DeltaPublisher, ring_size
from tensorhub.handles.flip import ShadowBanks, swap_sessions
from tensorhub.handles.placements import local_tensors, placed_tensors
from tensorhub.handles.seeding import OffloadSeed
from tensorhub.handles.session import ShardContext, ShardSession
from tensorhub.runtime.convert import DEFAULT_BUDGET, ConvertSpec
from tensorhub.runtime.embedded import parse_servers
from tensorhub.runtime.engine import AbortPull, AddSlot, DropSlot
from tensorhub.scheduling.mapping import IDENTITY, Mapping
from tensorhub.transports.buffers import ShardBuffers, layout_of

__all__ = ["AsyncShardHandle", "PendingOpen", "open_async"]


class AsyncShardHandle(ShardSession):
    """One shard of one replica of one model, as this process holds it. See DESIGN.md §2.

    Only one call runs at a time on a handle; a second concurrent call raises
    :class:`~tensorhub.errors.CallInFlight`.

    ``server``: an address, or an ordered list of them (a list/tuple, or one comma-separated
    string): the primary first, then the servers to fail over to (see :mod:`tensorhub.handles.api`).
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
        self.num_shards, self.shard_idx = validate_shard(*default_sharding(num_shards, shard_idx, dict(ctx)), **ctx)
        self.ctx = ShardContext(model=self.model, replica=self.replica, shard=self.shard_idx)
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
        ring = ring_size(deltas, dict(self.ctx))
        if ring and convert_from is not None:
            raise InvalidArgument("deltas= and convert_from= do not go together: a converted model pulls in full", **self.ctx)
        if ring:
            delta_model(self.model)  # the delta model's name must be valid too
        self._delta_ring = ring
        if bucket is not None and (not isinstance(bucket, str) or not bucket):
            raise InvalidArgument(f"bucket must be an fsspec URL or a directory (a non-empty str), got {bucket!r}", **self.ctx)
        self._bucket = bucket
        if server is not None:
            try:
                parse_servers(server)
            except InvalidArgument as err:
                raise InvalidArgument(err.message, **self.ctx) from None
        self._server = server
        self._transports = transports
        self.connect_timeout = connect_timeout
        super().__init__()
        self._banks: ShadowBanks[AsyncShardHandle] = ShadowBanks()  # replicate-then-flip (kept across a flip)
        self._seeds: OffloadSeed[AsyncShardHandle] = OffloadSeed()  # offload seeding (goes with the session)

    # ---- opening and closing -------------------------------------------------------------------

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
            await self._seeds.drop()
            await self._banks.drop()
            await self._drop_deltas()
            await self._release()

    async def __aenter__(self) -> AsyncShardHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _drop_deltas(self) -> None:
        pub, reader = self._delta_pub, self._delta_reader
        self._delta_pub = self._delta_reader = None
        if pub is not None:
            await pub.close()
        if reader is not None:
            await reader.close()

    # ---- registration ----------------------------------------------------------------------------

    async def register(
        self,
        tensors: dict[str, torch.Tensor],
        placements: dict[str, TensorPlacement | PlacedTensor] | None = None,
        *,
        checksum: str | None = None,
        shared_memory: bool = False,
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

        ``shared_memory=True`` (CPU tensors, same-host readers): the tensors' storages are moved
        into shared-memory files once, here, in place (torch's ``share_memory_()``: one copy of
        their bytes, their ``data_ptr()`` changes, views of them follow; one open file
        descriptor per storage), so that the ``local`` transport's readers on this host map
        them and copy with ``memmove`` instead of ``process_vm_readv`` (which pins every page:
        about 1.5x the CPU of a ``memmove``). A reader that registers so serves the next reader
        of a chain the same way. Tiny tensors kept in place in a pack stay where they are (read
        with ``process_vm_readv``). Tensors in GPU memory are not affected.

        Raises:
            AlreadyRegistered, InvalidArgument (also: ``shared_memory`` with torch's sharing
            strategy other than ``file_descriptor``), InvalidName, InvalidPlacement, LayoutMismatch.
        """
        with self._call("register"):
            if self.buffers is not None:
                raise AlreadyRegistered("tensors are already registered: unregister() first", **self.ctx)
            if type(shared_memory) is not bool:
                raise InvalidArgument(f"shared_memory must be True or False, got {shared_memory!r}", **self.ctx)
            tensors, given = local_tensors(tensors, placements, dict(self.ctx))
            layout = layout_of(tensors, pack_threshold=pack_threshold(), checksum=checksum, ctx=dict(self.ctx))
            placed = None if given is None else placed_tensors(layout, given, self.shard_idx, dict(self.ctx), self.num_shards)
            convert = None
            if self.convert_from is not None:
                if placed is None:
                    raise InvalidPlacement(f"a shard converted from {self.convert_from!r} must register placements=", **self.ctx)
                convert = ConvertSpec(placed, self.num_shards, self.shard_idx, self.mapping, self.convert_budget)
            engine, sid = self._need_engine(), self._sid
            assert self._client is not None
            if shared_memory:  # a copy of every byte into shared memory: off the event loop (torch drops the GIL)
                buffers = await asyncio.to_thread(ShardBuffers, tensors, layout, packs_in_place=engine.packs_in_place, shared_memory=True)
            else:
                buffers = ShardBuffers(tensors, layout, packs_in_place=engine.packs_in_place)
            endpoint = await engine.ask(AddSlot(sid, buffers, self._client.report, dict(self.ctx), self.location, convert))
            try:
                await self._request(lambda req: m.Register(req, sid, layout, endpoint, None, placed))
            except BaseException:
                await engine.ask(DropSlot(sid))
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
            await self._request(lambda req: m.Unregister(req, self._sid))
            await self._need_engine().ask(DropSlot(self._sid))
            self.buffers = None
            self._endpoint = None
            await self._banks.drop()

    # ---- publishing and listing (tensorhub.handles.calls) ----------------------------------------

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
        """:meth:`publish` without the deltas (:func:`tensorhub.handles.calls.publish`)."""
        with self._call("publish"):
            await calls.publish(self, version, base, delta_from)

    async def unpublish(self) -> None:
        """Withdraw the held version; returns once no reader is still reading these buffers
        (after an offload copy was made, if it was the last copy of a retained version)."""
        with self._call("unpublish"):
            if self._delta_pub is not None:
                await self._delta_pub.settle()  # the delta's comparison reads the tensors
            await self._unpublish_now()

    async def _unpublish_now(self) -> None:
        await calls.unpublish(self)

    async def list(self, consistent: bool = False) -> Versions:
        """``{version: {replica: ReplicaInfo}}`` of the available versions (a replica is listed
        once all its shards hold the version completely). ``consistent=True``: every shard of
        this replica gets the same answer (a model-parallel call)."""
        with self._call("list"):
            return await calls.list_versions(self, consistent)

    async def wait(self, predicate: Callable[[Versions], bool], timeout: float | None = None) -> Versions:
        """Wait until ``predicate(list())`` is true, and return that listing. All shards of the
        replica return the same listing (the first shard to see the predicate true decides).

        Raises:
            Timeout: not true within ``timeout`` seconds.
        """
        with self._call("wait"):
            return await calls.wait_for(self, predicate, timeout)

    # ---- pulling (tensorhub.handles.pulls) -------------------------------------------------------

    async def replicate(self, version: int | str = "latest", timeout: float | None = None) -> int:
        """Pull ``version`` into the registered tensors (waiting for it to exist), and hold it.

        Returns:
            The absolute version now held.
        Raises:
            NotRegistered, InvalidName, VersionUnavailable, Timeout, Cancelled, TransportError...
        """
        with self._call("replicate"):
            reply = await self._pull(m.Replicate, version, timeout)
            held: int = reply.version
            return held

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
            reply = await pulls.update(self, version, timeout)
            if isinstance(reply, bool):
                return reply
            self._seeds.after_update(self, reply.seed, self._make_seed)
            return reply.moved

    async def _pull(self, cls: pulls.Pull, version: int | str, timeout: float | None,
                    held: tuple[int, ...] | None = None) -> Any:  # fmt: skip
        return await pulls.pull(self, cls, version, timeout, held)

    async def _pull_once(self, cls: pulls.Pull, version: int | str, timeout: float | None,
                         held: tuple[int, ...] | None) -> Any:  # fmt: skip
        return await pulls.pull_once(self, cls, version, timeout, held)

    # ---- replicate-then-flip (tensorhub.handles.flip) --------------------------------------------

    @property
    def prefetched(self) -> int | None:
        """The version a finished :meth:`prefetch` holds in the shadow set, ready for
        :meth:`flip` (this shard's view; None: none, or still pulling, or failed)."""
        return self._banks.prefetched

    @property
    def shadow_bytes(self) -> int:
        """Bytes the shadow set costs (its tensors and pack buffers); 0: none (flip() updates in place)."""
        return self._banks.shadow_bytes

    @property
    def flips(self) -> int:
        """How many times :meth:`flip` swapped the sets."""
        return self._banks.flips

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
            return await self._banks.register(self, tensors, max_bytes, self._make_bank)

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
            return await self._banks.prefetch(self, version, timeout)

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
        shadow = self._banks.shadow
        if shadow is None:
            return await self.update("latest", timeout)
        with self._call("flip"):
            return await self._banks.flip(self, wait, lambda: swap_sessions(self, shadow))

    def _make_bank(self, replica: str) -> AsyncShardHandle:
        """The shadow set's handle (not opened): this shard, under the other bank's name."""
        bank = AsyncShardHandle(
            self.model, replica, self.num_shards, self.shard_idx, retain=None, server=self._server,
            location=self.location, spot=self.spot, transports=self._transports, connect_timeout=self.connect_timeout,
            convert_from=self.convert_from, mapping=self.mapping if self.convert_from is not None else None,
            convert_budget=self.convert_budget, deltas=self._delta_ring, bucket=self._bucket,
        )  # fmt: skip
        bank._base_replica = self._base_replica
        return bank

    # ---- offload seeding (tensorhub.handles.seeding) ---------------------------------------------

    @property
    def seeding(self) -> int | None:
        """The version this handle's offload seed holds or is pulling (None: no seed)."""
        return self._seeds.seeding

    def _make_seed(self) -> AsyncShardHandle:
        """The offload seed's handle (not opened): a spot replica of this shard, a CPU copy."""
        return AsyncShardHandle(
            self.model, seed_replica(self.replica), self.num_shards, self.shard_idx, retain=None, server=self._server,
            location=self.location, spot=True, transports=self._transports, connect_timeout=self.connect_timeout,
        )  # fmt: skip


async def open_async(model: str, replica: str, **kw: Any) -> AsyncShardHandle:
    """An open :class:`AsyncShardHandle` (``tensorhub.aio.open`` with its arguments)."""
    h = AsyncShardHandle(model, replica, **kw)
    return await h._open()


class PendingOpen:
    """``tensorhub.aio.open(...)``: awaitable, or an async context manager that closes."""

    def __init__(self, model: str, replica: str, kw: dict[str, Any]) -> None:
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
