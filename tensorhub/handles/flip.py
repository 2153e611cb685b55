"""Replicate-then-flip: a second registered set of a shard's tensors (the *shadow* set) pulls
the next version while the active set keeps serving, and a flip swaps the two at a request
boundary (:class:`ShadowBanks`, the state and logic behind the handle's ``register_shadow``,
``prefetch`` and ``flip``).

Theory of operation
-------------------
The shadow set is a handle of its own (a :class:`~tensorhub.handles.session.Sibling`) of the
replica named :func:`shadow_replica` of this one: a normal holder that serves readers like any
other. The two names swap at each flip: a flip moves each handle object's session state to the
other (:func:`swap_sessions`), so the user's handle object is then the session of the set that
holds the new version; what belongs to the user's object (these banks, the call in flight, the
client actor's pointer to it) stays. Both sets stay published: the set that was active serves
its version until the next prefetch pulls into it.

A prefetch is a model-parallel call: it lists the versions (one numbered call, the same answer
on every shard) to fix the target, then pulls it into the shadow set in a background task.
``flip(wait=False)`` flips only where every shard of the replica already holds the target (one
more numbered listing decides it for all). A failed prefetch is dropped and raised at the flip;
the active set is untouched.

The shadow set costs one more copy of the shard (its tensors and pack buffers). It is not
allocated where it does not fit (``max_bytes``, or less than a tenth of the device's free memory
would be left): the banks then stay empty and ``flip()`` is ``update()`` in place.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

from tensorhub.core import messages as m
from tensorhub.core.errors import AlreadyRegistered, InvalidArgument, TensorHubError, VersionUnavailable
from tensorhub.core.naming import parse_version_spec, validate_replica
from tensorhub.core.placement import PlacedTensor, TensorPlacement
from tensorhub.handles.session import ShardSession, Sibling

__all__ = ["KEPT_ACROSS_FLIP", "SHADOW_SUFFIX", "ShadowBanks", "shadow_replica", "swap_sessions"]

SHADOW_SUFFIX = "@shadow"
"""The suffix of the replica that registers a handle's shadow set (replicate-then-flip)."""

#: what stays with the user's handle object when a flip swaps the two sessions' state
KEPT_ACROSS_FLIP = ("_banks", "_busy", "_owner")

B = TypeVar("B", bound=Sibling)


def shadow_replica(replica: str) -> str:
    """The name of the replica that registers ``replica``'s shadow set.

    Raises:
        InvalidName: the result would be too long.
    """
    return validate_replica(replica + SHADOW_SUFFIX)


class ShadowBanks(Generic[B]):
    """A handle's shadow set and its pending prefetch (see the module docstring). ``B``: the
    handle's own class (the shadow set is one)."""

    def __init__(self) -> None:
        self.shadow: B | None = None  # the standby bank (None: no shadow set)
        self.prefetch_task: asyncio.Future[int | None] | None = None  # the standby's pull of the next version
        self.prefetch_version: int | None = None
        self.prefetch_newer = True  # the prefetch was relative: flip only to a newer version
        #: bytes the shadow set costs (its tensors and pack buffers); 0: none (flip() updates in place)
        self.shadow_bytes = 0
        #: how many times flip() swapped the sets
        self.flips = 0

    @property
    def prefetched(self) -> int | None:
        """The version a finished prefetch holds in the shadow set (None: none, still pulling, failed)."""
        task = self.prefetch_task
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return task.result()

    async def register(
        self,
        owner: ShardSession,
        tensors: dict[str, torch.Tensor] | None,
        max_bytes: int | None,
        make_bank: Callable[[str], B],
    ) -> int:
        """Allocate (``tensors`` None) or check the shadow set, open its handle (made by
        ``make_bank(replica)``) and register the set there. Returns its cost in bytes (0: it does
        not fit, nothing registered). See ``AsyncShardHandle.register_shadow``."""
        buffers = owner._need_registered("register_shadow")
        if self.shadow is not None:
            raise AlreadyRegistered("a shadow set is already registered", **owner.ctx)
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 0):
            raise InvalidArgument(f"max_bytes must be an int >= 0 or None, got {max_bytes!r}", **owner.ctx)
        active = owner.tensors
        packs = sum(r.numel() for r, p in zip(buffers.regions, buffers.plan.regions) if r is not None and p.tensor is None)
        if tensors is None:
            need = sum(t.numel() * t.element_size() for t in active.values()) + packs
            why = _does_not_fit(need, [t.device for t in active.values()], max_bytes)
            if why is None:
                try:
                    tensors = {k: torch.empty(t.shape, dtype=t.dtype, device=t.device) for k, t in active.items()}
                except torch.OutOfMemoryError as err:
                    why = f"allocating it failed ({err})"
            if why is not None or tensors is None:
                owner.log.warning("no shadow set: flip() will update in place", needs_bytes=need, why=why)
                return 0
        else:
            if not isinstance(tensors, dict) or set(tensors) != set(active):
                raise InvalidArgument("the shadow set must have the registered tensors' names", **owner.ctx)
            shared = _sharing_storage(tensors, active)
            if shared:
                a, b = shared[0]
                raise InvalidArgument(
                    f"the shadow set must be memory of its own: shadow tensor {a!r} shares storage with the "
                    f"registered tensor {b!r} ({len(shared)} such pairs); a pull into it would overwrite the "
                    "version the active set holds and serves. Pass new tensors, or none (allocated here)",
                    **owner.ctx,
                )
            need = sum(t.numel() * t.element_size() for t in tensors.values()) + packs
        names = (owner._base_replica, shadow_replica(owner._base_replica))
        shadow = make_bank(names[1] if owner.replica == names[0] else names[0])
        await shadow._open()
        try:
            placements: dict[str, TensorPlacement | PlacedTensor] | None = (
                None if owner.placements is None else {p.name: p for p in owner.placements}
            )
            await shadow.register({k: tensors[k] for k in active}, placements, checksum=buffers.layout.checksum)
        except BaseException:
            await shadow.close()
            raise
        self.shadow, self.shadow_bytes = shadow, need
        owner.log.info("shadow set registered", bytes=need, replica=shadow.replica)
        return need

    async def prefetch(self, owner: ShardSession, version: int | str, timeout: float | None) -> int | None:
        """Start pulling ``version`` into the shadow set; the version being prefetched, or None
        (nothing to do, or decided at pull time). See ``AsyncShardHandle.prefetch``."""
        spec = parse_version_spec(version, **owner.ctx)
        owner._check_timeout(timeout)
        owner._need_registered("prefetch")
        shadow = self.shadow
        if shadow is None:
            return None
        if self.prefetch_task is not None:
            return self.prefetch_version
        if spec.relative and owner.convert_from is not None:
            # A converted model's "latest" is decided by the server at pull time (from the
            # source's versions): the shadow set updates to it; flip() skips it if not newer.
            self.prefetch_version, self.prefetch_newer = None, True
            self.prefetch_task = asyncio.ensure_future(_pull_into(shadow, spec.wire(), timeout, update=True))
            return None
        n = owner._next_call()
        reply = await owner._numbered(n, "list", lambda req: m.ListVersions(req, owner._sid, n))
        versions = reply.as_dict()
        if spec.relative:
            if not versions:
                return None
            target = spec.resolve(max(versions))
            if target < 0:
                raise VersionUnavailable(f"{spec} is before version 0 (latest is {max(versions)})", **owner.ctx)
            if owner.version is not None and target <= owner.version:
                return None
        else:
            target = spec.resolve(0)
            if target == owner.version:
                return None
        self.prefetch_version, self.prefetch_newer = target, spec.relative
        # With deltas, an update: the server may plan the standby set a chain from what it holds.
        self.prefetch_task = asyncio.ensure_future(_pull_into(shadow, target, timeout, update=owner._delta_ring > 0))
        owner.log.debug("prefetching", version=target, into=shadow.replica)
        return target

    async def flip(self, owner: ShardSession, wait: bool, swap: Callable[[], None]) -> bool:
        """Swap the sets (``swap()``) if the prefetch finished with a version to flip to.
        See ``AsyncShardHandle.flip``."""
        task, shadow = self.prefetch_task, self.shadow
        assert shadow is not None  # the handle updates in place without a shadow set
        if not wait:
            n = owner._next_call()  # on every shard, pending or not: the replica's calls stay in step
            reply = await owner._numbered(n, "list", lambda req: m.ListVersions(req, owner._sid, n))
            listing = reply.as_dict()
            want = self.prefetch_version
            ready = want in listing and shadow.replica in listing[want] if want is not None else any(
                shadow.replica in reps and (owner.version is None or v > owner.version) for v, reps in listing.items()
            )  # a converted model's prefetch: whatever newer version the shadow set holds whole
            if task is None or not ready:
                if task is not None and task.done() and (task.cancelled() or task.exception() is not None):
                    self._failed(owner, task)
                return False
        if task is None:
            return False
        try:
            target = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                raise  # this call was cancelled; the prefetch goes on
            self._failed(owner, task)
            raise
        except TensorHubError:
            self._failed(owner, task)
            raise
        self.prefetch_task = None
        if target is None:
            return False
        if owner.version is not None and (target == owner.version or (self.prefetch_newer and target < owner.version)):
            return False  # the active set moved past it meanwhile (update())
        swap()
        self.flips += 1
        owner.log.info("flipped", version=owner.version, previous=shadow.version)
        return True

    def _failed(self, owner: ShardSession, task: asyncio.Future[int | None]) -> None:
        self.prefetch_task = None
        owner.log.warning("prefetch failed; the active set is untouched", version=self.prefetch_version,
                          error=repr(task.exception()) if not task.cancelled() else "cancelled")  # fmt: skip

    async def drop(self) -> None:
        """Stop a prefetch and close the shadow set (its readers are re-granted elsewhere)."""
        shadow, task = self.shadow, self.prefetch_task
        self.shadow = self.prefetch_task = None
        self.shadow_bytes = 0
        if task is not None and not task.done():
            task.cancel()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, TensorHubError):
                await task
        if shadow is not None:
            await shadow.close()


def swap_sessions(a: ShardSession, b: ShardSession) -> None:
    """Swap the sessions of two handle objects: everything a session owns moves with it (its
    name, server session, registered buffers, held version, call numbers, delta sides); what
    the user's object owns (:data:`KEPT_ACROSS_FLIP`) stays."""
    assert b._busy is None
    mine = {k: a.__dict__.pop(k) for k in KEPT_ACROSS_FLIP}
    theirs = {k: b.__dict__.pop(k) for k in KEPT_ACROSS_FLIP}
    a.__dict__, b.__dict__ = b.__dict__, a.__dict__
    a.__dict__.update(mine)
    b.__dict__.update(theirs)
    a._owner.target, b._owner.target = a, b
    for h in (a, b):  # a bank's delta sides go with its session
        for side in (h._delta_pub, h._delta_reader):
            if side is not None:
                side.owner = h


async def _pull_into(shadow: Sibling, version: int | str, timeout: float | None, update: bool) -> int | None:
    if update:
        await shadow.update(version, timeout)
        return shadow.version
    return await shadow.replicate(version, timeout)


def _sharing_storage(tensors: dict[str, torch.Tensor], others: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """The pairs (name in ``tensors``, name in ``others``) whose storages overlap (views of one
    allocation, or the same tensors), sorted."""
    spans = []
    for name, t in others.items():
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.nbytes():
                spans.append((t.device, st.data_ptr(), st.data_ptr() + st.nbytes(), name))
    pairs: list[tuple[str, str]] = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            continue
        st = t.untyped_storage()
        lo, hi = st.data_ptr(), st.data_ptr() + st.nbytes()
        if lo == hi:
            continue
        pairs.extend((name, other) for dev, a, b, other in spans if dev == t.device and a < hi and lo < b)
    return sorted(pairs)


def _does_not_fit(need: int, devices: Sequence[torch.device], max_bytes: int | None) -> str | None:
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
