"""The model-parallel calls that publish and list: :func:`publish`, :func:`unpublish`,
:func:`list_versions` and :func:`wait_for`, the bodies of the handle's methods of those names
(:class:`~tensorhub.handles.shard.AsyncShardHandle` holds the one-call guard and the docstrings).

Each is a numbered call (:meth:`~tensorhub.handles.session.ShardSession._numbered`): every shard
of the replica makes it, with the same number, and gets the same answer. A publish names the
registered buffers' version before the engine has hashed them (readers granted meanwhile wait for
the progress counter); a version number names one content, so a shard that held the number
before proves its bytes with their checksums (:func:`prove`).
"""

from __future__ import annotations

from collections.abc import Callable

from tensorhub.core import messages as m
from tensorhub.core.errors import ChecksumsRequired, ContractViolation, InvalidArgument, VersionConflict
from tensorhub.core.naming import validate_version
from tensorhub.handles.session import ShardSession
from tensorhub.runtime.engine import HashBuffers, Holdings, StartPublish, WaitPublished

__all__ = ["ReplicaInfo", "Versions", "list_versions", "prove", "publish", "unpublish", "wait_for"]

#: What :meth:`AsyncShardHandle.list` maps each (version, replica) to: ``replica``, ``kind``
#: (``"normal"`` or ``"offload"``) and ``spot``.
ReplicaInfo = m.ReplicaEntry
Versions = dict[int, dict[str, m.ReplicaEntry]]


async def publish(h: ShardSession, version: int, base: int | None = None, delta_from: int | None = None) -> None:
    """Name the registered buffers' bytes ``version`` and start the engine's publish job (pack,
    hash, declare) in the background. ``base``: a delta model's shard names the version its
    delta applies to; ``delta_from``: the delta from that version to this one will follow
    (readers wait for it).

    Raises:
        NotRegistered, InvalidName, ContractViolation (holding another version), VersionConflict.
    """
    validate_version(version, **h.ctx)
    buffers = h._need_registered("publish")
    if h.version is not None and h.version != version:
        raise ContractViolation(f"publish({version}) while holding version {h.version}: unpublish() first", **h.ctx)
    held_before = h.version
    engine = h._need_engine()
    sid = h._sid
    if held_before != version:
        # Named before the server can grant it; servable once the engine's publish job
        # has filled the packs (a reader granted first waits for the progress counter).
        buffers.progress.reset(version, 0)
    proof: tuple[int, ...] | None = None
    try:
        if held_before != version and version in (await engine.ask(Holdings(sid)))[0]:
            proof = await prove(h, version)  # this shard had the number before: same bytes?
        n = h._next_call()

        def build(req: int) -> m.Publish:
            return m.Publish(req, h._sid, n, version, proof, base, delta_from)

        if base is not None:
            h.delta_base = (version, base)

        try:
            await h._numbered(n, "publish", build, version)
        except ChecksumsRequired:  # the server knows the number's checksums: prove these bytes
            proof = await prove(h, version)
            await h._numbered(n, "publish", build, version)
    except BaseException:
        if held_before is None:
            buffers.progress.reset(None)
        raise
    h.version = version
    engine.tell(StartPublish(sid, version, proof))  # pack, hash, declare: in the background


async def prove(h: ShardSession, version: int) -> tuple[int, ...]:
    """The checksums of the registered buffers, to publish ``version`` with. A version number
    names one content: if this shard knew other checksums for it (it published or pulled it
    before), the publish is refused here.

    Raises:
        VersionConflict: this shard held ``version`` before with other bytes.
    """
    sums, known = await h._need_engine().ask(HashBuffers(h._sid, version))
    if known is not None and known != sums:
        raise VersionConflict(
            f"publish({version}) refused: this shard held version {version} before with other bytes, and a "
            "version number names one content (publish the changed tensors as a new version)",
            version=version, **h.ctx,
        )  # fmt: skip
    return sums


async def unpublish(h: ShardSession) -> None:
    """Withdraw the held version (its checksums are declared first); readers across this change
    discard their bytes."""
    if h._engine is not None and h.session is not None:
        await h._engine.ask(WaitPublished(h.session))  # its checksums are declared first
    n = h._next_call()
    await h._numbered(n, "unpublish", lambda req: m.Unpublish(req, h._sid, n))
    if h.buffers is not None:
        h.buffers.progress.reset(None)  # readers across this change discard their bytes
    h.version = None


async def list_versions(h: ShardSession, consistent: bool) -> Versions:
    """The available versions; ``consistent``: the same answer on every shard of the replica."""
    if not consistent:
        reply = await h._request(lambda req: m.ListVersions(req, h._sid, None))
    else:
        n = h._next_call()
        reply = await h._numbered(n, "list", lambda req: m.ListVersions(req, h._sid, n))
    versions: Versions = reply.as_dict()
    return versions


async def wait_for(h: ShardSession, predicate: Callable[[Versions], bool], timeout: float | None) -> Versions:
    """The first listing for which ``predicate`` is true (the first shard to see it decides).

    Raises:
        InvalidArgument: ``predicate`` is not callable.
        Timeout: not true within ``timeout`` seconds.
    """
    if not callable(predicate):
        raise InvalidArgument(f"wait() takes a predicate over list(), got {type(predicate).__name__}", **h.ctx)
    n = h._next_call()
    known = -1
    satisfied: int | None = None
    for _ in range(1 << 30):  # each turn waits for the listing to change: bounded by time

        def build(req: int, k: int = known, sat: int | None = satisfied) -> m.Wait:
            return m.Wait(req, h._sid, n, k, sat, timeout)

        reply = await h._numbered(n, "wait", build)
        versions: Versions = reply.as_dict()
        if reply.final:
            return versions
        known = reply.epoch
        satisfied = reply.epoch if predicate(versions) else None
    raise AssertionError("unreachable")  # pragma: no cover
