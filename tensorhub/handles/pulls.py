"""The pull path of a handle: ``replicate()`` and ``update()`` (:func:`pull`, :func:`update`),
through server failover and down to the bucket tier.

- A pull is one numbered call (``Replicate`` or ``Update``); the engine moves the bytes. A pull
  cancelled by its caller unpublishes the partial holding (which fails the call for the whole
  replica) and waits until nothing writes into the buffers (:func:`_abandon`).
- **Failover mid-pull**: when the server is lost after the pull began, the call waits (within
  its own time and the client's failover bound) for the client to move, and is made again, with
  the same number, on the next server, which resumes the pull from the partial holding the
  handle re-announced (at most :data:`RESUMES` times). A pull that cannot go on after it began
  leaves the handle empty (``version`` None): the server unpublished the old holding.
- ``update()`` while no server is connected returns False at once (no newer version is known);
  one refused by a server that does not decide (a backup while the primary holds the lease) asks
  the one that does. Lost before it moved, it returns False (the tensors still hold what they
  held); lost after, it raises :class:`~tensorhub.errors.UpdateAborted`. An update to ``"latest"``
  whose version lost its last holder mid-pull asks again for the newest one
  (:class:`~tensorhub.errors.VersionLost`, :data:`LOST_RETRIES`).
- Where the server planned a chain of deltas for the replica, :class:`~tensorhub.handles.deltas.DeltaReader`
  lands it. Where no peer can serve the version, the bucket (the one the server names, or the
  handle's own) restores it (:func:`~tensorhub.handles.deltas.restore_from_bucket`), never before
  a peer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tensorhub.core import messages as m
from tensorhub.core.errors import (
    InBucket,
    ServerUnavailable,
    TensorHubError,
    TransportError,
    UpdateAborted,
    VersionLost,
    VersionUnavailable,
)
from tensorhub.core.naming import parse_version_spec
from tensorhub.handles.deltas import DeltaReader, restore_from_bucket
from tensorhub.handles.session import ShardSession
from tensorhub.runtime.engine import AbortPull

__all__ = ["LOST_RETRIES", "RESUMES", "pull", "pull_once", "update"]

RESUMES = 3
"""Failovers one replicate/update call survives mid-pull."""

LOST_RETRIES = 2
"""Times one ``update("latest")`` asks again after its version was lost mid-pull."""

#: the numbered pull calls: what they are named in the kept answers and the one-call guard
Pull = type[m.Replicate] | type[m.Update]


async def pull(h: ShardSession, cls: Pull, version: int | str, timeout: float | None,
               held: tuple[int, ...] | None = None) -> Any:  # fmt: skip
    """One pull (:func:`pull_once`), falling back to the bucket tier when no peer could serve it.

    Returns:
        The server's ``Replicated`` or ``Updated``.
    """
    try:
        return await pull_once(h, cls, version, timeout, held)
    except (TransportError, VersionUnavailable, UpdateAborted) as err:
        url = err.bucket if isinstance(err, InBucket) and err.bucket else h._bucket
        if url is None or held is not None or err.version is None:
            raise
        # No peer could serve it (unreachable, or gone): the bucket tier (the server names
        # it, InBucket, or this handle's own), never before a peer.
        reply = await restore_from_bucket(h, url, err, timeout)
        return m.Updated(reply.req, True, reply.version) if cls is m.Update else reply


async def pull_once(h: ShardSession, cls: Pull, version: int | str, timeout: float | None,
                    held: tuple[int, ...] | None) -> Any:  # fmt: skip
    """The numbered pull call, made again on the next server after a failover mid-pull.
    ``held``: (``Replicate`` only) the checksums of what the buffers already hold (a delta
    chain landed them); where they are the version's, the shard holds it at once."""
    spec = parse_version_spec(version, **h.ctx).wire()
    h._check_timeout(timeout)
    h._need_registered(cls.__name__.lower())
    engine, sid = h._need_engine(), h._sid
    before = engine.pull_mark(sid)
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    for attempt in range(RESUMES + 1):
        left = None if deadline is None else max(0.0, deadline - loop.time())
        n = h._next_call()

        def build(req: int, n: int = n, left: float | None = left) -> m.Replicate | m.Update:
            if cls is m.Update:
                return m.Update(req, h._sid, n, spec, left, h.offload_seeding, h._delta_ring > 0)
            return m.Replicate(req, h._sid, n, spec, left, held)

        try:
            reply = await h._numbered(n, cls.__name__.lower(), build)
            break
        except asyncio.CancelledError:
            await asyncio.shield(_abandon(h))
            raise
        except TensorHubError as err:
            if isinstance(err, ServerUnavailable) and attempt < RESUMES and await _resume(h, before, deadline):
                continue  # the same call (its number given back) on the next server, which resumes the pull
            outcome = await engine.ask(AbortPull(sid, before))
            if isinstance(err, UpdateAborted) or outcome.began:
                h.version = None  # it had begun moving: the server unpublished the old holding
            raise
    if isinstance(reply, m.Replicated) or (isinstance(reply, m.Updated) and reply.moved):
        h.version = reply.version
    return reply


async def update(h: ShardSession, version: int | str, timeout: float | None) -> m.Updated | bool:
    """The body of ``update()`` (see its docstring), but for offload seeding.

    Returns:
        The server's ``Updated`` (its ``moved``, ``skipped`` and ``seed`` are for the handle to
        act on), or whether it moved where it finished without one (False: no server decides
        now, or it was lost before the pull began; True: a delta chain landed).
    """
    client = h._client
    if client is not None and client.failing_over(h.session):
        # No server now (failing over): no newer version is known. Arguments are still checked.
        parse_version_spec(version, **h.ctx)
        h._check_timeout(timeout)
        h._need_registered("update")
        return False
    engine = h._need_engine()
    before = engine.pull_mark(h.session) if h.session is not None else 0
    try:
        try:
            reply = await _update_moving_on(h, version, timeout)
        except ServerUnavailable:
            # Refused by a server that does not decide (a backup while the primary holds
            # the lease): find the one that does, and ask it instead.
            began = h.session is not None and engine.pull_began(h.session, before)
            if client is None or client.lost is not None or client.gave_up is not None or began:
                raise
            wait = client.failover_timeout if timeout is None else min(timeout, client.failover_timeout)
            if not await client.seek_reign(wait):
                return False  # nothing decides now: no newer version is known
            reply = await _update_moving_on(h, version, timeout)
        if reply.deltas is not None:  # the server planned a chain of deltas for this replica
            if h._delta_reader is None:
                h._delta_reader = DeltaReader(h)
            await h._delta_reader.land(reply, timeout)
            h.skipped = None
            return True
    except ServerUnavailable as err:
        h.skipped = None
        if client is None or not client.failing_over(h.session):
            raise
        if h.session is not None and engine.pull_began(h.session, before):  # it had begun to move: the handle is empty
            raise UpdateAborted(f"update aborted: the server was lost mid-pull ({err.message})", **h.ctx) from err
        return False  # lost before it moved: the tensors still hold what they held
    h.skipped = reply.skipped
    updated: m.Updated = reply
    return updated


async def _update_moving_on(h: ShardSession, version: int | str, timeout: float | None) -> Any:
    """The update's pull; one relative to the newest version (``"latest"``) whose version lost
    its last complete holder mid-pull (:class:`~tensorhub.errors.VersionLost`: every shard of
    the replica is told alike, each left empty, so all of them ask again, with the same next
    call number) asks again for the newest version then, at most :data:`LOST_RETRIES` times and
    within the call's time; where there is none to move to, it raises the loss (the handle is
    empty). An update to a numbered version raises it: that version is gone."""
    relative = parse_version_spec(version, **h.ctx).relative
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    left, lost = timeout, None
    for attempt in range(LOST_RETRIES + 1):
        try:
            reply = await pull(h, m.Update, version, left)
        except VersionLost as err:
            left = None if deadline is None else deadline - loop.time()
            if not relative or attempt == LOST_RETRIES or (left is not None and left <= 0):
                raise
            h.log.warning("the update's version was lost mid-pull; asking for the newest", lost=err.version, attempt=attempt + 1)
            lost = err
            continue
        if lost is not None and not reply.moved and reply.deltas is None:
            # Nothing to move on to: the handle is still empty, which "did not move" would hide.
            raise lost
        return reply
    raise AssertionError("unreachable")


async def _resume(h: ShardSession, before: int, deadline: float | None) -> bool:
    """The server was lost during a replicate/update whose pull had begun: wait (within the
    call's time and the client's failover bound) for the client to move; the handle's
    restore re-announced the pull as a partial holding. True: make the call again."""
    client = h._client
    if client is None or not h._need_engine().pull_began(h._sid, before):
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
    h.log.info("server lost mid-pull; resuming on the next one", server=client.address)
    return True


async def _abandon(h: ShardSession) -> None:
    """A cancelled replicate/update: unpublish the partial holding (which fails the call
    for the whole replica) and wait until nothing writes into the buffers."""
    engine = h._need_engine()
    n = h._next_call()
    try:
        await h._request(lambda req: m.Unpublish(req, h._sid, n))
    except TensorHubError as err:
        h.log.warning("cancelled pull: unpublish refused", error=str(err))
    await engine.ask(AbortPull(h._sid))
    if h.buffers is not None:
        h.buffers.progress.reset(None)
    h.version = None
