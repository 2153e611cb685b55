"""A handle's deltas: published by a trainer's shard, planned by the server, landed by a reader's.

Theory of operation
-------------------
A handle opened with ``deltas=True`` (or a ring size) takes part in delta replication
(:mod:`tensorhub.core.table.deltas` has the server's side, :mod:`tensorhub.runtime.deltas` the
arithmetic, :mod:`tensorhub.runtime.deltafiles` the bytes).

**Publishing** (:class:`DeltaPublisher`, a trainer's shard). After ``publish(v)`` returns, in the
background, like the checksums: wait for ``v``'s checksums (the engine's publish job), compare
the registered tensors with a **snapshot** of the version published before, bit for bit, and
publish the delta as version ``v`` of the delta model, one blob per shard, naming its base. The
snapshot is a CPU copy of the shard (its cost: one shard of host memory, pinned for GPU
tensors). CPU tensors are compared in place and the snapshot brought forward by applying the
delta to it (touching only what changed). GPU tensors are compared on their GPU: the snapshot's
slices stream in a few slots ahead of the comparison while the target's bytes stream back over
them (both directions of the bus at once), and only the changed values come back. The comparison reads the registered tensors, which the mutability contract keeps
unchanged until ``unpublish()``: ``unpublish()`` waits for it (the trainer's only added stall;
about one pass over the shard at memory speed). Deltas are published on a **ring** of delta
replicas (``<replica>@d0`` .. ``@d{k-1}``, one session per shard each): each holds one delta, so
the last ``k`` deltas stay available for readers that fell behind (a chain). A failure here
never fails the trainer: it is logged, deltas stop for this handle, and readers pull in full.

**Landing** (:class:`DeltaReader`, a reader's shard). ``update()`` asks with ``deltas``; where
the server planned a chain (every shard of the replica the same versions), each shard:

1. pulls the chain's blobs through its own delta replica (``<replica>@delta``), a replicate of
   the delta model per step (pipelined from any holder; the reader then holds the delta and
   serves it to the next readers);
2. unpublishes what it holds (readers of it drain; the model-parallel sequence is the same on
   every shard whatever happens);
3. applies the chain in place (``index_copy_``, no second full buffer), after checking that the
   tensors hold the chain's base (hashing them: one pass over the shard, so that bytes that
   changed since they were verified are refused too, before anything is written) and verifying
   the units it wrote against the target's checksums;
4. makes ``Replicate(target, held=checksums)``: where they are the target's declared checksums,
   the shard holds the target at once; where anything failed (a pull, a wrong base, a mismatch
   after writing) it claims nothing and pulls the target in full. A delta applied to the wrong
   base is never presented as the target.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorhub.core import messages as m
from tensorhub.core.errors import BaseMismatch, BucketError, InBucket, InvalidArgument, TensorHubError
from tensorhub.core.naming import delta_model
from tensorhub.runtime.bucket import BucketReader, BucketWriter
from tensorhub.runtime.deltafiles import delta_bytes, from_bytes
from tensorhub.runtime.deltas import Delta, TensorDelta, apply_chain, apply_delta, compare_and_refresh, compute_delta
from tensorhub.runtime.engine import Holdings, StartPublish, WaitPublished

__all__ = ["DEFAULT_RING", "DeltaPublisher", "DeltaReader", "DeltaStats", "restore_from_bucket", "ring_size"]

#: deltas a trainer's shard keeps published (readers up to this many versions behind get a chain)
DEFAULT_RING = 4
_BLOB = "delta"  # the one tensor of a delta replica's registration


def ring_size(deltas: object, ctx: dict) -> int:
    """``deltas=`` of a handle: False/0 (off), True (:data:`DEFAULT_RING`), or a ring size."""
    if deltas is True:
        return DEFAULT_RING
    if deltas is False or deltas is None:
        return 0
    if type(deltas) is not int or not 0 <= deltas <= 64:
        raise InvalidArgument(
            f"deltas must be a bool or an int in [0, 64] (deltas kept published), got {deltas!r}", **ctx
        )
    return deltas


@dataclass
class DeltaStats:
    """What the last ``update()`` that the server planned as a delta chain did."""

    target: int
    versions: list[int] = field(default_factory=list)
    bytes: int = 0  #: the blobs pulled
    full_bytes: int = 0  #: a full pull of the shard
    landed: bool = False  #: the shard holds the target through the chain (else it pulled in full)
    error: str | None = None  #: why it fell back to a full pull
    pull_s: float = 0.0
    apply_s: float = 0.0


def _side(owner: Any, replica: str, model: str | None = None) -> Any:
    """A handle of the delta model beside ``owner`` (same shard, place and server)."""
    return type(owner)(
        model or delta_model(owner.model), replica, owner.num_shards, owner.shard_idx, retain=None,
        server=owner._server, location=owner.location, spot=owner.spot, transports=owner._transports,
        connect_timeout=owner.connect_timeout,
    )  # fmt: skip


async def _hold_blob(h: Any, nbytes: int, data: bytes | None = None) -> torch.Tensor:
    """Make ``h`` (a delta replica's shard) hold nothing, registered with a blob of ``nbytes``."""
    if h.version is not None:
        await h.unpublish()
    if h.buffers is not None and h.buffers.layout.total_bytes != nbytes:
        await h.unregister()
    if h.buffers is None:
        blob = (
            torch.empty(nbytes, dtype=torch.uint8)
            if data is None
            else torch.frombuffer(bytearray(data), dtype=torch.uint8)
        )
        await h.register({_BLOB: blob})
    elif data is not None:
        h.tensors[_BLOB].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return h.tensors[_BLOB]


class DeltaPublisher:
    """A trainer shard's deltas (see the module docstring)."""

    def __init__(self, owner: Any, ring: int, bucket: str | None = None) -> None:
        self.owner = owner
        self.ring: list[Any] = [None] * ring
        #: the bucket tier (:mod:`tensorhub.runtime.bucket`): every version (an anchor every
        #: few, deltas between) is also written there, in the background
        self.writer: BucketWriter | None = None  # made at the first write (again after it failed)
        self.bucket = bucket
        #: a version's bucket write that failed (typed, the cause chained): raised by the next
        #: ``publish()`` so that it is never silent; that version was not declared to the server
        self.write_error: TensorHubError | None = None
        self.declaring: set[asyncio.Task] = set()  # telling the server what the bucket holds
        self.turn = 0
        self.snapshot: dict[str, torch.Tensor] | None = None
        self.snapshot_version: int | None = None
        self.snapshot_sums: tuple[int, ...] | None = None
        self.task: asyncio.Task | None = None
        self.failed: str | None = None
        self.published: list[int] = []  #: versions whose delta this shard published

    def announce(self, version: int) -> int | None:
        """The version whose delta to ``version`` this shard will publish (told to the server
        with the publish, so that readers holding it wait for the delta rather than pull in
        full), or None."""
        v = self.snapshot_version
        if not self.ring or self.failed is not None or v is None or v >= version:
            return None
        return v

    def after_publish(self, version: int) -> None:
        if self.task is None:
            self.task = asyncio.ensure_future(self._run(version))

    async def settle(self) -> None:
        """Wait until the background comparison no longer reads the registered tensors."""
        task, self.task = self.task, None
        if task is not None:
            await asyncio.wait([task])

    async def _run(self, version: int) -> None:
        owner = self.owner
        await owner._engine.ask(WaitPublished(owner.session))
        sums_by_version, _ = await owner._engine.ask(Holdings(owner.session))
        sums = sums_by_version.get(version)
        delta = await self._delta(version, sums) if self.ring and self.failed is None else None
        if self.bucket is not None and self.writer is None:
            try:  # made again after a failure: the bucket may be usable again
                self.writer = await asyncio.to_thread(BucketWriter, self.bucket)
            except BucketError as err:
                self._failed(version, err)
        if self.writer is not None:
            try:
                await asyncio.to_thread(
                    self.writer.put, owner.model, version, owner.shard_idx, owner.tensors,
                    layout=owner.buffers.layout, checksums=sums, delta=delta,
                )  # fmt: skip
            except TensorHubError as err:  # an earlier write failed: raised by the next publish()
                self._failed(version, err)
                return
            task = asyncio.ensure_future(self._declare(version))  # not awaited by settle(): no trainer stall
            self.declaring.add(task)
            task.add_done_callback(self.declaring.discard)

    async def _declare(self, version: int) -> None:
        """Once the bucket holds ``version`` (the writer flushed), tell the server, which then
        names the bucket to readers that no peer can serve."""
        owner, writer = self.owner, self.writer
        assert writer is not None and self.bucket is not None
        try:
            await asyncio.to_thread(writer.flush)
        except TensorHubError as err:
            self._failed(version, err)
        if not writer.stored(owner.model, version, owner.shard_idx):  # its own write failed: never declared
            if self.write_error is None:
                self._failed(version, BucketError(f"bucket {self.bucket}: version {version} was not written",
                                                  **{**owner.ctx, "version": version}))  # fmt: skip
            return
        try:
            await owner._request(lambda req: m.BucketStored(req, owner.session, version, self.bucket))
        except TensorHubError as err:
            owner.log.warning("bucket copy not declared", version=version, error=f"{type(err).__name__}: {err.message}")

    def _failed(self, version: int, err: TensorHubError) -> None:
        self.owner.log.warning("bucket write failed", version=version, error=f"{type(err).__name__}: {err.message}")
        if self.write_error is None:
            self.write_error = err

    def take_write_error(self) -> TensorHubError | None:
        """The bucket write failure not yet raised (cleared: raised once)."""
        err, self.write_error = self.write_error, None
        return err

    async def _delta(self, version: int, sums: tuple[int, ...] | None) -> Delta | None:
        owner = self.owner
        delta = None
        try:
            tensors = owner.tensors
            snap = self.snapshot
            if snap is None or self.snapshot_version is None or self.snapshot_version >= version or sums is None:
                self.snapshot = await asyncio.to_thread(_copy_to_cpu, tensors)
            else:
                delta, self.snapshot = await asyncio.to_thread(
                    _compare,
                    snap,
                    tensors,
                    self.snapshot_version,
                    version,
                    owner.buffers.layout,
                    self.snapshot_sums,
                    sums,
                )
                await self._publish(delta)
            self.snapshot_version, self.snapshot_sums = version, sums
        except TensorHubError as err:
            self.failed = f"{type(err).__name__}: {err.message}"
        except Exception as err:  # noqa: BLE001 - a device error, memory: deltas stop, the trainer goes on
            self.failed = repr(err)
        if self.failed is not None:
            owner.log.warning("deltas stop for this handle (readers pull in full)", version=version, error=self.failed)
            self.snapshot = None
        return delta

    async def _publish(self, delta: Delta) -> None:
        data = await asyncio.to_thread(delta_bytes, delta)
        k = self.turn % len(self.ring)
        self.turn += 1
        h = self.ring[k]
        if h is None:
            h = self.ring[k] = _side(self.owner, f"{self.owner.replica}@d{k}")
            await h._open()
        await _hold_blob(h, len(data), data)
        await h._publish(delta.version, base=delta.base)
        self.published.append(delta.version)

    async def close(self) -> None:
        await self.settle()
        for h in self.ring:
            if h is not None:
                await h.close()
        self.ring = [None] * len(self.ring)
        if self.declaring:
            await asyncio.wait(list(self.declaring))
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                await asyncio.to_thread(writer.close)
            except TensorHubError as err:
                self.owner.log.warning(
                    "bucket writer: the last writes failed", error=f"{type(err).__name__}: {err.message}"
                )


def _copy_to_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The snapshot: a CPU copy of the tensors, pinned where a tensor is on a GPU (its slices
    then go back to the GPU fast for the comparison)."""
    out = {}
    for k, t in tensors.items():
        snap = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
        out[k] = snap.copy_(t.detach())
    return out


def _compare(
    snap: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], base: int, version: int, layout: Any,
    base_sums: tuple[int, ...] | None, sums: tuple[int, ...],
) -> tuple[Delta, dict[str, torch.Tensor]]:  # fmt: skip
    """The delta ``snap -> tensors`` (with its values in CPU memory), and the snapshot brought
    to ``tensors`` in place. GPU tensors are compared on their GPU against the pinned snapshot,
    streamed there while the target's bytes stream back over it (:func:`compare_and_refresh`);
    only what changed comes back. CPU tensors are compared in place and the delta applied to the
    snapshot (it writes only what changed)."""
    if any(t.device.type == "cuda" for t in tensors.values()):
        delta = compare_and_refresh(snap, tensors, base_version=base, version=version, layout=layout,
                                    base_checksums=base_sums, checksums=sums)  # fmt: skip
        return delta, snap
    delta = compute_delta(snap, tensors, base_version=base, version=version, layout=layout,
                          base_checksums=base_sums, checksums=sums, with_checksums=False)  # fmt: skip
    if any(e.values.device.type != "cpu" for e in delta.tensors):
        entries = tuple(
            TensorDelta(e.name, e.encoding, e.changed, e.values.cpu(), None if e.indices is None else e.indices.cpu())
            for e in delta.tensors
        )
        delta = Delta(delta.layout, delta.base, delta.version, entries, delta.base_checksums, delta.checksums)
    apply_delta(snap, delta, check_base=False, verify=False)
    return delta, snap


class DeltaReader:
    """A reader shard's side of delta replication (see the module docstring)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.side: Any = None

    async def land(self, reply: m.Updated, timeout: float | None) -> DeltaStats:
        """Pull the planned chain, apply it, and hold the target (or pull it in full)."""
        owner = self.owner
        loop = asyncio.get_running_loop()
        assert reply.deltas is not None and reply.target is not None
        stats = DeltaStats(reply.target, [r.version for r in reply.deltas], sum(r.nbytes for r in reply.deltas))
        stats.full_bytes = owner.buffers.layout.total_bytes
        t0 = loop.time()
        pulled: list[Delta] = []
        deltas: list[Delta] | None = pulled
        try:
            for ref in reply.deltas:
                pulled.append(await self._pull(ref, timeout))
        except TensorHubError as err:
            stats.error = f"pulling the deltas: {type(err).__name__}: {err.message}"
            deltas = None
            await self._drop_side()
        stats.pull_s = loop.time() - t0
        await owner._unpublish_now()
        held = None
        t1 = loop.time()
        if deltas:
            try:
                # The base is checked on the bytes themselves (one hashing pass), not on what
                # was verified when they landed: bytes that rotted since are refused too.
                await _unstoppable(asyncio.to_thread(apply_chain, owner.tensors, deltas, ctx=owner.ctx))
                held = deltas[-1].checksums
            except TensorHubError as err:
                stats.error = f"applying the deltas: {type(err).__name__}: {err.message}"
        stats.apply_s = loop.time() - t1
        if stats.error is not None:
            owner.log.warning("delta chain not landed; pulling in full", target=reply.target, error=stats.error)
        owner.last_delta = stats
        before = owner._engine.pull_mark(owner.session)
        await owner._pull(m.Replicate, reply.target, timeout, held=held)
        stats.landed = _serve_held(owner, reply.target, held, before)
        return stats

    async def _pull(self, ref: m.DeltaRef, timeout: float | None) -> Delta:
        if self.side is None:
            self.side = _side(self.owner, f"{self.owner.replica}@delta")
            await self.side._open()
        blob = await _hold_blob(self.side, ref.nbytes)
        await self.side.replicate(ref.version, timeout)
        self.side.delta_base = (ref.version, ref.base)  # re-announced with the holding after a failover
        got = from_bytes(blob.numpy().tobytes(), layout=self.owner.buffers.layout, where=f"delta {ref.version}")
        if not isinstance(got, Delta) or got.version != ref.version or got.base != ref.base:
            raise _mismatch(ref, got)
        return got

    async def _drop_side(self) -> None:
        side, self.side = self.side, None
        if side is not None:
            await side.close()

    async def close(self) -> None:
        await self._drop_side()


async def restore_from_bucket(owner: Any, url: str, err: TensorHubError, timeout: float | None) -> m.Replicated:
    """No peer could serve ``err.version`` to ``owner`` (unreachable, or gone): restore it from
    the bucket at ``url`` (the latest anchor at or before it, then the deltas after it,
    verified), then ``Replicate(version, held=checksums)`` so that the server takes the shard as
    a holder of it. Every shard of the replica got the same error and makes the same calls: a
    shard whose restore fails claims nothing and pulls again (which fails like the first time,
    for every shard: the first error is raised, the bucket's chained).

    Raises:
        What the pull raises, when the restore failed or the server did not take the claim.
    """
    version = err.version
    assert version is not None
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    held = None
    restored = None
    failure: TensorHubError | None = None
    try:
        restored = await asyncio.to_thread(
            BucketReader(url).restore, owner.model, version, owner.shard_idx, owner.tensors
        )
        held = restored.checksums
    except TensorHubError as berr:
        failure = berr
        owner.log.warning(
            "no peer and no bucket copy",
            version=version,
            error=str(err),
            bucket=f"{type(berr).__name__}: {berr.message}",
        )
    owner.log.info(
        "restored from the bucket" if held else "bucket restore failed",
        version=version,
        seconds=round(loop.time() - t0, 3),
    )
    before = owner._engine.pull_mark(owner.session)
    try:
        reply = await owner._pull_once(m.Replicate, version, timeout, held)
    except TensorHubError as perr:
        if failure is None:
            raise
        raise _with_cause(perr, failure) from failure  # the restore's real cause, in the error itself
    if _serve_held(owner, version, held, before):
        owner.last_bucket = restored
    return reply


def _with_cause(err: TensorHubError, cause: TensorHubError) -> TensorHubError:
    """``err`` (the pull's), of the same class, its message saying why the restore failed."""
    message = f"{err.message}; restoring it from the bucket failed: {type(cause).__name__}: {cause.message}"
    try:
        if isinstance(err, InBucket):
            return InBucket(message, bucket=err.bucket, **err.context())
        return type(err)(message, **err.context())
    except TypeError:  # a class with other required fields: keep it, the cause chained
        return err


async def _unstoppable(work: Any) -> Any:
    """Await ``work`` (a thread writing into the registered tensors); if the caller is
    cancelled meanwhile, the cancellation waits until the thread has stopped writing."""
    fut = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        raise


def _serve_held(owner: Any, version: int, held: tuple[int, ...] | None, before: int) -> bool:
    """After ``Replicate(version, held=...)``: True if the server took the claim (no pull began);
    the engine then serves the buffers as ``version``, with those checksums."""
    if held is None or owner._engine.pull_began(owner.session, before):
        return False
    owner.buffers.progress.reset(version, 0)
    owner._engine.tell(StartPublish(owner.session, version, held))
    return True


def _mismatch(ref: m.DeltaRef, got: object) -> TensorHubError:
    what = f"{getattr(got, 'base', None)} -> {getattr(got, 'version', None)}" if isinstance(got, Delta) else "an anchor"
    return BaseMismatch(f"delta {ref.version} holds {what}, not {ref.base} -> {ref.version}", version=ref.version)
