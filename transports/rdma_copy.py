"""``rdma_copy``: RDMA through pre-registered staging buffers, for tensors re-allocated often.

Theory of operation
-------------------
``nixl`` registers the user's tensors; a trainer or a rollout engine that re-allocates its
weights every step would pay for registration each time (and pin memory it frees). This
transport never registers user memory. At ``start()`` each side allocates a staging pool of
``staging_bytes`` (pinned when CUDA is present), cut into slots of ``slot_bytes``, and registers
it with its NIXL agent once; that is all the memory it ever registers, so staging is bounded
and configurable.

A read of ``[offset, offset + length)`` is cut into pieces of at most ``slot_bytes``. For each
piece, in one of the reader's threads:

1. take a free local slot (bounded wait);
2. ask the holder's side channel to *stage* the piece. A holder worker thread resolves
   ``(region, version)``, waits (in slices, bounded by ``wait_timeout``; ``not_ready`` past it)
   until the holder's progress covers the piece, takes a free staging slot (a lease, reclaimed
   after ``lease_s`` if the reader never releases it), copies the piece into it
   (:meth:`~tensorhub.transports.buffers.ShardBuffers.copy_out`; CUDA memory on a side stream), and checks
   that the generation and version did not move across the copy (a seqlock, on the holder:
   once in the slot the bytes cannot change). It answers with the slot's address, the lease and
   the generation, and the first answer to a reader carries the pool's NIXL metadata;
3. READ the slot into the local slot with one NIXL transfer request, then tell the holder the
   slot is free (a one-way message);
4. copy the local slot into ``into`` (:meth:`~tensorhub.transports.buffers.ShardBuffers.copy_in`).

Every piece of a read must come from one generation, and the caller's if it gave one.

Grant tokens (``checks_grants``): every stage request carries the reader's grant token, and
the holder admits it (:meth:`~tensorhub.transports.base.Transport.admit`) before it resolves
anything, takes a slot or hands out the pool's metadata; a refusal (``unauthorized``) carries
nothing else. Lease tokens are random, so only the reader a slot was staged for can release it.
The side channel binds and advertises what :func:`tensorhub.transports.nic.choose_address` says
(options ``host``/``advertise`` first).

What it must never do: register or pin user tensors, hold more staging than configured, keep a
holder slot leased without a bound, or unpickle anything from a peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tensorhub.core.errors import InvalidArgument, TransportError
from tensorhub.core.log import get_logger

from .base import Probe, RangeNotReady, ReadCall, Transport, Unauthorized
from .buffers import ShardBuffers, memory_of
from .nic import choose_address
from .nixl import NixlIO, default_agent, load_nixl, options_of, probe_nixl, start_agent
from .sidechannel import Handler, SideClient, SideError, SideServer
from .sidechannel import field as req_field

__all__ = ["RdmaCopyTransport", "StagingPool"]

_SLICE = 0.02  # seconds between looks at "closed?" while a holder waits

_OPTIONS = {
    "host": ("", None, str),
    "advertise": ("", None, str),
    "wait_timeout": (5.0, 0.0, float),
    "xfer_timeout": (30.0, 0.001, float),
    "lease_s": (10.0, 0.01, float),
    "staging_bytes": (64 << 20, 4096, int),
    "slot_bytes": (8 << 20, 4096, int),
    "copy_threads": (4, 1, int),
    "threads": (8, 1, int),
    "streams": (4, 1, int),
    "nic": ("auto", None, str),
    "cuda_device": (-1, -1, int),
    "progress_delay_us": (100, 0, int),
}


class StagingPool:
    """``count`` slots of ``slot_bytes`` in one allocation; slots are leased and given back.

    A lease is ``(slot, token)``; giving back a stale token (the lease expired and the slot was
    leased again) does nothing.
    """

    def __init__(self, total: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.count = max(1, total // slot_bytes)
        pinned = torch.cuda.is_available()
        self.tensor = torch.empty(self.count * slot_bytes, dtype=torch.uint8, pin_memory=pinned)
        self.base = self.tensor.data_ptr()
        self._view = memory_of(self.tensor)
        self._cond = threading.Condition()
        self._leases: dict[int, tuple[int, float]] = {}  # slot -> (token, expiry)

    def take(self, timeout: float, lease_s: float, closed: Callable[[], bool]) -> tuple[int, int] | None:
        """A free slot ``(slot, token)``, waiting up to ``timeout``; expired leases are
        reclaimed. None if none freed up in time or ``closed()``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            for _ in range(1 << 30):  # bounded by the deadline
                now = time.monotonic()
                for slot, (_, expiry) in list(self._leases.items()):
                    if expiry < now:
                        del self._leases[slot]
                free = next((s for s in range(self.count) if s not in self._leases), None)
                if free is not None:
                    token = secrets.randbits(62) | 1  # unguessable: a lease is released only by its reader
                    self._leases[free] = (token, now + lease_s)
                    return free, token
                left = deadline - now
                if left <= 0 or closed():
                    return None
                self._cond.wait(min(left, _SLICE))
        return None  # pragma: no cover

    def give(self, slot: int, token: int) -> bool:
        with self._cond:
            if self._leases.get(slot, (None,))[0] != token:
                return False
            del self._leases[slot]
            self._cond.notify()
            return True

    def view(self, slot: int, n: int) -> memoryview:
        start = slot * self.slot_bytes
        return self._view[start : start + n]

    def address(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes

    @property
    def leased(self) -> int:
        with self._cond:
            return len(self._leases)


class RdmaCopyTransport(Transport):
    """RDMA through staging buffers. See the module docstring.

    Options: ``host``/``advertise`` (the side channel's interface and the address peers dial;
    default: :func:`~tensorhub.transports.nic.choose_address`'s rule), ``wait_timeout`` (default 5 s),
    ``xfer_timeout`` (default 30 s), ``lease_s`` (a holder slot's lease, default 10 s),
    ``staging_bytes`` (per side, default 64 MiB), ``slot_bytes`` (default 8 MiB),
    ``copy_threads`` (holder copies at once, default 4), ``threads`` (reads at once, default 8),
    ``streams`` (concurrent reads per pull, default 4), ``nic``, ``cuda_device``,
    ``progress_delay_us`` (as ``nixl``).

    Raises:
        InvalidArgument: an unknown option or a bad value.
    """

    name = "rdma_copy"
    one_sided = False
    cuda = True
    cross_host = True
    gathers = True
    checks_grants = True

    def __init__(self, options: dict[str, Any] | None = None, agent_factory: Callable[[str, str | None], Any] | None = None) -> None:
        super().__init__(options)
        o = options_of(self.name, self.options, _OPTIONS)
        if o["slot_bytes"] > o["staging_bytes"]:
            raise InvalidArgument(f"rdma_copy option slot_bytes ({o['slot_bytes']}) exceeds staging_bytes ({o['staging_bytes']})")
        self.o = o
        self.wait_timeout, self.streams = o["wait_timeout"], o["streams"]
        self.agent_name = f"tensorhub-copy-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._factory = agent_factory or functools.partial(default_agent, progress_delay_us=o["progress_delay_us"])
        self.io: NixlIO | None = None
        self.pool: StagingPool | None = None
        self._pool_dlists: list[Any] = []
        self._pool_md: list[bytes] | None = None
        self._known: set[str] = set()  # holders whose pool metadata is loaded
        self._executor: ThreadPoolExecutor | None = None
        self._side: SideServer | None = None
        self._client: SideClient | None = None
        self._closed = False
        self._streams_local = threading.local()
        self.log = get_logger(transport=self.name)

    @classmethod
    def available(cls) -> bool:
        return load_nixl() is not None

    @classmethod
    def probe(cls) -> Probe:
        return probe_nixl("rdma_copy")

    async def start(self) -> None:
        """Create the agent, allocate and register the staging pool, start the side channel.

        Raises:
            TransportError: NIXL is missing or the agent cannot be created; it was closed.
        """
        if self._closed:
            raise TransportError(f"rdma_copy transport {self.agent_name} is closed; it cannot start again")
        if self.io is not None:
            return
        self.io, _ = await start_agent(self.name, self._factory, self.agent_name, self.o["nic"], self.o["cuda_device"], self.log)
        self.pool = StagingPool(self.o["staging_bytes"], self.o["slot_bytes"])
        self._pool_dlists, _ = self.io.register([self.pool.tensor])
        self._executor = ThreadPoolExecutor(max_workers=self.o["threads"], thread_name_prefix="rdma-copy-read")
        self._client = SideClient(f"rdma_copy reader {self.agent_name}")
        handlers: dict[str, tuple[Handler, bool]] = {"stage": (self._stage, False), "release": (self._release, True)}
        where = choose_address(self.o["host"] or None, self.o["advertise"] or None, self.servers)
        self._side = SideServer(f"rdma-copy-{os.getpid()}", handlers, where.bind, workers=self.o["copy_threads"], advertise=where.advertise)
        self.log.info("rdma_copy side channel listening", address=self._side.address, bind=where.bind, rule=where.rule)

    def endpoint(self) -> dict[str, Any]:
        if self._side is None:
            raise TransportError("the rdma_copy transport is not started")
        return {"agent": self.agent_name, "side": self._side.address}

    async def close(self) -> None:
        """Stop serving, fail reads in flight, deregister the pool. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._side is not None:
            await asyncio.to_thread(self._side.close)
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, True, cancel_futures=True)
        if self._client is not None:
            self._client.close()
        io, self.io = self.io, None
        if io is not None:
            io.deregister(self._pool_dlists)
            io.close()

    def _is_closed(self) -> bool:
        return self._closed

    # ---- holder side ---------------------------------------------------------------------------

    def _stage(self, msg: dict[str, Any]) -> dict[str, Any]:
        region = req_field(msg, "region", int, 0)
        version = req_field(msg, "version", int, 0)
        offset = req_field(msg, "offset", int, 0)
        length = req_field(msg, "length", int, 0)
        want = msg.get("generation")
        if want is not None and type(want) is not int:
            raise SideError("malformed", f"field 'generation' must be an int or nil, got {want!r}")
        refused = self.admit(region, version, msg.get("token"), msg.get("_from", ""))
        if refused is not None:
            raise SideError("unauthorized", refused)
        pool, io = self.pool, self.io
        if pool is None or io is None or self._closed:
            raise SideError("closed", "the holder's rdma_copy transport is closed")
        if length > pool.slot_bytes:
            raise SideError("malformed", f"a piece of {length} bytes exceeds the holder's slot of {pool.slot_bytes}")
        try:
            buffers = self.resolve(region, version)
        except Exception as err:  # noqa: BLE001 - the resolver's failure is this request's
            raise SideError("internal", f"the resolver raised {type(err).__name__}: {err}") from None
        if buffers is None:
            raise SideError("unknown", f"no holding of region {region} version {version}")
        if offset + length > buffers.total_bytes:
            raise SideError("range", f"bytes [{offset}, {offset + length}) are outside the shard's {buffers.total_bytes}")
        gen = self._wait(buffers, version, offset + length, want)
        lease = pool.take(self.wait_timeout + 1.0, self.o["lease_s"], self._is_closed)
        if lease is None:
            raise SideError("busy" if not self._closed else "closed", "no staging slot freed up in time")
        slot, token = lease
        try:
            self._copy_out(buffers, offset, pool.view(slot, length))
            after, held, _ = buffers.progress.snapshot()
            if after != gen or held != version:
                raise SideError("changed", f"the holding changed during the copy (generation {gen} -> {after})")
            if self._closed:
                raise SideError("closed", "the holder closed during the copy")
        except BaseException:
            pool.give(slot, token)
            raise
        reply: dict[str, Any] = {"slot": slot, "token": token, "address": pool.address(slot), "generation": gen}
        if msg.get("metadata") is True:
            if self._pool_md is None:
                self._pool_md = io.metadata(self._pool_dlists)
            reply["md"] = self._pool_md
        return reply

    def _wait(self, buffers: ShardBuffers, version: int, end: int, want: int | None) -> int:
        deadline = time.monotonic() + self.wait_timeout
        p = buffers.progress
        _, v0, _ = p.snapshot()
        seen = v0 == version
        for _ in range(1 << 30):  # bounded by the deadline
            left = deadline - time.monotonic()
            gen, covered = p.wait_covered(version, end, want, min(_SLICE, max(left, 0.0)))
            if covered:
                return gen
            g, v, verified = p.snapshot()
            if want is not None and g != want:
                raise SideError("changed", f"the holding changed (generation {g}, the pull began at {want})")
            if v == version:
                seen = True
            elif seen:
                raise SideError("changed", "the holding changed (it no longer holds the version)")
            if self._closed:
                raise SideError("closed", "the holder closed while the piece waited for its progress")
            if left <= 0:
                state = f"{verified} bytes verified" if v == version else "it does not hold the version yet"
                raise SideError("not_ready", f"the progress did not cover the piece in time ({state})")
        raise AssertionError("unreachable")  # pragma: no cover

    def _copy_out(self, buffers: ShardBuffers, offset: int, dest: memoryview) -> None:
        if not buffers.on_cuda:
            buffers.copy_out(offset, dest)
            return
        stream = getattr(self._streams_local, "stream", None)
        if stream is None:
            stream = self._streams_local.stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            buffers.copy_out(offset, dest)
        stream.synchronize()

    def _release(self, msg: dict[str, Any]) -> dict[str, Any]:
        slot, token = req_field(msg, "slot", int, 0), req_field(msg, "token", int, 0)
        pool = self.pool
        return {"freed": pool.give(slot, token) if pool is not None else False}

    # ---- reader side ---------------------------------------------------------------------------

    def describe_read(self, peer: Any, region: int, version: int, offset: int, length: int) -> str:
        name = peer.get("agent") if isinstance(peer, dict) else peer
        return f"rdma_copy peer {name!r} region {region} version {version} bytes [{offset}, {offset + length})"

    def check_read(self, peer: Any, where: str, offset: int, length: int, token: bytes | None) -> dict:
        if not (isinstance(peer, dict) and type(peer.get("agent")) is str and type(peer.get("side")) is str):
            raise TransportError(f"read of {where}: the endpoint {peer!r} lacks 'agent' and 'side' strings")
        return peer

    def read_blocking(self, call: ReadCall) -> int:
        """Copy ``[offset, offset + length)`` of ``version`` from the peer into ``into`` through
        staging, showing the grant's token with every stage request. Returns the holder's
        generation.

        Raises:
            RangeNotReady: a partial holder's progress did not cover a piece in time.
            Unauthorized: the holder refused the token.
            PeerUnreachable: the side channel's address could not be connected to.
            TransportError: anything else that kept the read from completing.
        """
        into = call.into
        if call.offset + call.length > into.total_bytes:
            raise TransportError(f"read of {call.where}: the range is outside the destination's {into.total_bytes} bytes")
        return self._read_blocking(call.peer, call.where, call.region, call.version, call.offset, call.length, into,
                                   call.generation, call.token)  # fmt: skip

    def _read_blocking(
        self, peer: dict, where: str, region: int, version: int, offset: int, length: int, into: ShardBuffers, generation: int | None,
        token: bytes | None = None,
    ) -> int:  # fmt: skip
        pool, io, client = self.pool, self.io, self._client
        if pool is None or io is None or client is None:
            raise TransportError(f"read of {where}: the rdma_copy transport closed")
        gen = generation
        pos, end = offset, offset + length
        for _ in range(max(1, -(-length // pool.slot_bytes))):
            n = min(pool.slot_bytes, end - pos)
            got = self._piece(io, pool, client, peer, where, region, version, pos, n, into, gen, token)
            if gen is not None and got != gen:
                raise TransportError(f"read of {where}: the holder's generation moved from {gen} to {got} between pieces")
            gen = got
            pos += n
        assert gen is not None
        return gen

    def _piece(
        self, io: NixlIO, pool: StagingPool, client: SideClient, peer: dict, where: str,
        region: int, version: int, offset: int, n: int, into: ShardBuffers, generation: int | None, token: bytes | None = None,
    ) -> int:  # fmt: skip
        agent, side = peer["agent"], peer["side"]
        local = pool.take(self.o["xfer_timeout"], self.o["xfer_timeout"] * 2, self._is_closed)
        if local is None:
            raise TransportError(f"read of {where}: no local staging slot freed up in time" + (" (closed)" if self._closed else ""))
        try:
            fields = {"region": region, "version": version, "offset": offset, "length": n, "generation": generation, "token": token}
            if agent not in self._known:
                fields["metadata"] = True
            timeout = self.wait_timeout + self.o["xfer_timeout"]
            try:
                reply = client.call(side, "stage", fields, timeout, self._is_closed)
            except SideError as err:
                if err.code == "not_ready":
                    raise RangeNotReady(f"read of {where}: {err}") from err
                cls = Unauthorized if err.code == "unauthorized" else TransportError
                raise cls(f"read of {where}: the holder refused to stage bytes [{offset}, {offset + n}) ({err.code}: {err})") from err
            except TransportError as err:
                raise type(err)(f"read of {where}: {err}") from err  # keeps PeerUnreachable
            slot, token, address, gen = (reply.get(k) for k in ("slot", "token", "address", "generation"))
            if not (type(slot) is int and type(token) is int and type(address) is int and type(gen) is int):
                raise TransportError(f"read of {where}: the holder's stage reply is malformed")
            read = False
            try:
                if "md" in reply:
                    md = reply["md"]
                    io.load_peer(agent, md if isinstance(md, list) else [md])
                    self._known.add(agent)
                if n:
                    io.read(agent, [(pool.address(local[0]), address, n, 0)], ("DRAM", 0), ("DRAM", 0),
                            time.monotonic() + self.o["xfer_timeout"], self._is_closed)  # fmt: skip
                read = True
            except TransportError as err:
                raise TransportError(f"read of {where}: {err}") from err
            except Exception as err:
                self._known.discard(agent)
                io.drop_peer(agent)
                raise TransportError(f"read of {where}: NIXL raised {type(err).__name__}: {err}") from err
            finally:
                if not read:
                    with contextlib.suppress(Exception):
                        client.notify(side, "release", {"slot": slot, "token": token})
            # The lease must still have been ours when the read ended: one that expired (a read
            # slower than lease_s, as on a loaded machine) let the holder stage another piece
            # into the slot while we read it, and these bytes cannot be trusted.
            try:
                freed = client.call(side, "release", {"slot": slot, "token": token}, self.o["xfer_timeout"],
                                    self._is_closed).get("freed")  # fmt: skip
            except SideError as err:
                raise TransportError(f"read of {where}: releasing the holder's staging slot failed ({err.code}: {err})") from err
            except TransportError as err:
                raise type(err)(f"read of {where}: releasing the holder's staging slot: {err}") from err
            if freed is not True:
                raise TransportError(f"read of {where}: the holder's lease of the staging slot for bytes [{offset}, "
                                     f"{offset + n}) expired before the read ended; its bytes may have been reused")  # fmt: skip
            if n:
                into.copy_in(offset, pool.view(local[0], n))
            return gen
        finally:
            pool.give(*local)
