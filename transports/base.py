"""The transport plugin interface.

A transport moves byte ranges of a shard from a holder's memory into a reader's memory. It does
nothing else: the engine owns registration of the tensors, the layout, progress counters,
chunking, retries and talking to the server. Bulk bytes never go through ZeroMQ or the server.

The plugin author's manual
--------------------------
**Lifecycle.** The process's engine creates one instance per transport name, with the options
the user configured (a dict of msgpack-able values), tells it the servers the process talks to
(``set_servers``: the control plane's addresses, primary first; the base class stores them as
``servers``, empty when none is known, as for a transport used alone), then:

1. ``await start()`` once, on the engine's event loop. A two-sided transport starts serving
   here (a listener, its threads); a one-sided one creates its agent.
2. ``endpoint()``: a msgpack-able dict that tells peers how to reach this process (host, port,
   agent metadata...). The server hands it, unread, to the readers it grants. Never put pickled
   or otherwise executable bytes in it. An address in it must be one that readers on *other
   hosts* can dial: take it from :func:`tensorhub.transports.nic.choose_address`, passing it
   ``self.servers`` (the rule, for every built-in: an explicit ``host``/``advertise`` option,
   else ``$TENSORHUB_ADVERTISE_HOST``, else loopback when the server is on loopback, else the
   address of the interface that routes to the server), and bind what it says.
3. Holder side: ``serve(resolver)`` is called once before any reader can come. For each read a
   peer asks for, call ``resolver(region, version)``: it returns the :class:`ShardBuffers` that
   hold (or are about to hold: a partial holder can be granted to a reader before its own grant
   reaches it) that version under that region id, or None. Serve only bytes of that version
   below ``buffers.progress.verified`` (block on ``progress.wait_covered``, bounded), and
   report the generation you saw before and after the copy, so the reader can discard a read
   across which the holding changed. ``expose(buffers)`` / ``withdraw(buffers)`` are called on
   every transport of the process when a shard's buffers start / stop being in use (both the
   buffers it serves and those it pulls into); one-sided transports register and deregister
   memory there, and refuse to serve buffers that are not exposed; two-sided ones may ignore
   them.
4. Reader side: ``await read(peer, region, version, offset, length, into, generation)`` copies
   shard bytes ``[offset, offset + length)`` of ``version`` from the peer into the same range of
   ``into``, and returns the holder's generation. ``generation`` is what an earlier read of this
   pull returned (None on the first): if the holder's generation differs, fail. Many reads of one
   pull run concurrently; a read must be safe to run from several tasks at once.

   ``read`` is a *template method*; do not override it. It checks the arguments every transport
   shares (offset, length and generation in range, a token that is bytes: else
   :class:`~tensorhub.errors.InvalidArgument`), names the read for messages
   (:meth:`Transport.describe_read`), asks the plugin to check the peer's endpoint
   (:meth:`Transport.check_read`: it returns the endpoint as the plugin wants it, or raises
   :class:`TransportError`), refuses a closed transport (:meth:`Transport.read_closed`), then
   awaits :meth:`Transport.read_range` with a :class:`ReadCall`, and calls
   :meth:`Transport.release_read` in ``finally`` whatever happened. ``read_range`` runs
   :meth:`Transport.read_blocking` (the plugin's bulk work, **the one method a reader side must
   override**) in the pool :meth:`Transport.read_executor` names, off the event loop, so that
   heartbeats are never starved; a pool already shut down is a closed transport. A plugin whose
   bulk work is not a blocking call (its library's own progress engine, or one read split into
   stripes) overrides ``read_range`` instead; one that holds something per read (a staging slot, a
   connection) releases it in ``release_read``.
5. ``await close()``: stop serving, close connections, release registrations. Reads still
   running on either side (this process reading, or peers reading from it) fail with
   :class:`TransportError`; reads started later fail with it too. A second ``close()``, or one
   after a ``start()`` that failed, does nothing.

**Grant tokens** (optional, ``checks_grants = True``; every built-in that crosses a process
boundary does). The server gives each reader, with each grant, a token that proves it was
granted that version of that holder's shard (:mod:`tensorhub.core.tokens`). A transport that
checks grants takes ``token`` (bytes or None, keyword-only) in ``read`` and carries it to the
holder with the request (no extra round trip: in the request, or in the describe that hands out
the memory description); the holder side calls ``self.admit(region, version, token, who)`` before it
serves *anything* of the region (bytes, a memory description, a staging slot) and, if it returns
a reason, answers with a refusal that carries nothing else, which the reader raises as
:class:`Unauthorized`. ``admit`` asks the check the engine installed with ``guard()`` (it counts
and logs refusals); with none installed (a transport used alone, as in the conformance suite's
ordinary checks) everything is admitted. A plugin that leaves ``checks_grants`` False is never
passed ``token`` and keeps working, but its data plane is open to whoever reaches its endpoint
(the engine logs that once).

**Reachability.** A read that cannot connect to the peer's advertised address raises
:class:`PeerUnreachable` (a :class:`TransportError`) naming the address and the setting that
chooses it on the holder (``$TENSORHUB_ADVERTISE_HOST``, or the transport's ``advertise``
option); the engine adds the holder's name.

**Partial holders.** A transport that waits for a holder's progress takes the option
``wait_timeout`` (seconds): how long a read waits for the range to be covered. When it is not
covered by then, the read raises :class:`RangeNotReady`, a :class:`TransportError`: the holder
is healthy but behind, and the engine retries the range (from the same source or another)
instead of reporting the source as failed.

**Errors.** A read that cannot complete raises :class:`~tensorhub.errors.TransportError` (or a
subclass) naming the peer, the region, the version and the range; the engine reports the source
as failed and the server re-grants from elsewhere. That covers: a peer that is unknown,
unreachable or closed (also when it closes while the read runs), a region or version the peer
does not hold, a range outside the shard, and a generation that moved (or is not the one the
caller passed). Never return normally with bytes that were not all written, nor with bytes
read across a generation change.

**What must be overridden:** ``start``, ``endpoint``, ``read_blocking`` (or ``read_range``),
``close``; two-sided transports also use ``serve``. **What may be:** the read's hooks
(``describe_read``, ``check_read``, ``read_closed``, ``read_executor``, ``release_read``, above),
``abort_reads`` (below), ``available`` (a probe of optional libraries; import them
only inside the plugin), ``probe`` (below), ``expose``/``withdraw``, and
``guard`` (rarely: the base class stores the check ``admit`` asks), and
``reaches(peer_endpoint) -> bool`` (can
this process read from that peer at all: ``local`` checks that the peer shares this host's
kernel, ``memory`` this process; the engine skips a transport that does not reach).

**Which transport serves an edge** is not the transport's decision: the engine asks
:func:`tensorhub.scheduling.edges.choose_transport` with both ends' locations, the transports the holder's
endpoint offers, the ones this process started, and ``reaches``.

**Talking to the holder** without bulk bytes (describing registered memory, asking for a
staged slice) goes over :mod:`tensorhub.transports.sidechannel`: msgpack requests to a ZeroMQ ROUTER the
holder runs, never pickled objects.

**Capability flags** (class attributes): ``one_sided`` (reads need no holder CPU),
``cuda`` (reads and serves CUDA memory without staging), ``cross_host`` (works between hosts;
``local`` does not), ``reports_landing`` (``read`` takes a ``landed`` callback, below),
``gathers`` (below), ``checks_grants`` (``read`` takes ``token``; the holder side admits, above). The engine picks a transport per (reader, holder) edge from these and both
sides' endpoints. Two optional integer attributes size a pull: ``reads_in_flight`` (else
``streams``), how many reads of a pull the engine keeps going at once, and ``read_bytes``, the
size of the reads of a pull whose first grant goes through this transport, when that is more
than the engine's chunk and no chunk size was configured (``local``: 32 MiB; each read costs a
round trip through the engine's event loop).

**Gathering** (optional, ``gathers = True``). A transport that reaches a range's memory only
through :meth:`ShardBuffers.views`, :meth:`~ShardBuffers.spans`, :meth:`~ShardBuffers.copy_in`
and :meth:`~ShardBuffers.copy_out` (and ``ShardBuffers.parts`` for what it describes to peers)
copes with a range scattered over many tensors. When every transport of a process gathers, the
engine keeps that process's packs *in place* (:class:`~tensorhub.transports.buffers.ShardBuffers`): the
tiny tensors are not copied into pack buffers at publish nor out of them after a pull, and the
process does not hold a second copy of them. A transport that registers ``ShardBuffers.regions``
(NIXL) leaves it False: it needs a pack to be one buffer; ``regions`` holds None for a pack kept
in place.

**Landing reports** (optional, ``reports_landing = True``). The engine verifies every byte a
reader receives against the publisher's checksums. A transport that copies with the CPU can let
it hash each piece while the piece is still in the cache of the core that copied it, instead of
in a second pass over memory: ``read`` then accepts ``landed``, a callable, and calls
``landed(offset, length)`` in the copying thread right after shard bytes ``[offset, offset +
length)`` of the read were written into ``into``'s CPU memory, covering every byte of the read
exactly once (pieces in any order, from any threads). Never report bytes that are not final
(a later write to the same range would go unhashed). A callback that raises fails the read.
The engine's callback (a :class:`~tensorhub.runtime.checksum.LandingHasher`) also has
``unit_stream(offset, length)``: for a range that is exactly one whole checksum unit it returns
a ``sink(start, end)`` to call instead, piece after piece in order from one thread (one hash
update per piece, no search), or None (report with ``landed``); ``local`` uses it for its parts.
For CUDA destinations under ``wordmix-64`` the engine passes a
:class:`~tensorhub.runtime.checksum.DeviceLanding` as ``landed`` instead: calling it does
nothing, but a transport that copies GPU memory to GPU memory itself may hand it the read's
segments instead of copying them: ``copy([(transfer offset, source bytes, destination bytes),
...])`` with tensors, or, where ``kernel_runs_on(device)``, ``copy_ranges(offsets, lengths,
source addresses, destination addresses, device)`` with numpy arrays (``local`` keeps a table of
the regions' addresses and finds a read's segments without a Python loop). Either copies on the
current stream with a kernel that hashes each unit from the registers it writes (verification's
pass over the bytes is gone) and waits for the copy.

**Aborting reads** (optional: ``abort_reads(into)``). When the server revokes a grant (its
source is going away, or is too slow: a straggler), the engine waits for the grant's reads in
flight to return before the next grant reads those ranges; behind a slow source that is a whole
read at the slow rate. A transport that can end its reads early implements
:meth:`Transport.abort_reads`: end every read of this process running into ``into`` now. Each
read it ends must raise :class:`TransportError` (the engine counts it a failed read of the old
grant and reads the range again under the next one: nothing is blamed, checksums are unchanged),
must not write into ``into`` after it raised, and must not leave anything it used for another
read (a connection, a staging slot) in a state that a later read could trip on. A read that
already returned, or returns meanwhile, is not counted. It is called on the event loop: it must
not block. The engine calls it only when the revoked grant still has reads in flight (or a pull
is aborted with reads in flight). The base implementation ends nothing and returns 0: the engine
then simply waits for the reads, as before. ``tcp`` implements it.

**Probing** (``probe()``, a classmethod; cheap, no side effects, never raises). It answers
three things as a :class:`Probe`: whether the transport can run in this process at all
(``usable``: the libraries import, the system calls are allowed), whether it is worth starting
when the user configured nothing (``default``), and ``reason``, one line saying why not (or
what it will do), with ``facts``: what it checked, for ``tensorhub doctor``. A handle opened
without ``transports=`` and without ``$TENSORHUB_TRANSPORTS`` starts every *built-in* transport
whose probe says ``default``; plugins from entry points are started only when named. The base
implementation derives ``usable`` from :meth:`Transport.available` and leaves ``default`` False.

Every transport must pass :func:`tensorhub.testing.check_transport` (the conformance suite);
its tests call it, skipping (and saying why) only checks the transport cannot take part in.
The capability flags steer it: a one-sided transport must refuse withdrawn buffers.
:func:`tensorhub.transports.faults.wrap` stands a fault-injecting wrapper in for any transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from tensorhub.core.errors import InvalidArgument, TransportError

if TYPE_CHECKING:
    from .buffers import ShardBuffers

__all__ = ["Guard", "Landed", "PeerUnreachable", "Probe", "RangeNotReady", "ReadCall", "Resolver", "Transport", "Unauthorized"]

#: ``resolver(region, version)``: the buffers holding ``version`` under ``region``, or None.
Resolver = Callable[[int, int], Optional["ShardBuffers"]]

#: ``guard(region, version, token, who)``: None to serve the request, else why it is refused
#: (:meth:`tensorhub.runtime.engine.EngineActor.admit`; ``who``: transport and peer, for the log).
Guard = Callable[[int, int, Optional[bytes], str], Optional[str]]

#: ``landed(offset, length)``: shard bytes that a read just wrote into the reader's CPU memory.
Landed = Callable[[int, int], None]


class RangeNotReady(TransportError):
    """A partial holder did not have the range yet (its progress did not cover it within the
    read's ``wait_timeout``). The holder is not at fault: the engine retries the range."""

    code = "range_not_ready"


class Unauthorized(TransportError):
    """The holder refused the request: it carried no valid grant token for that version of that
    region (missing, made for another holder or version, altered, or expired). Nothing was
    served. The engine reports the source as failed; the server grants again, with a new token."""

    code = "unauthorized"


class PeerUnreachable(TransportError):
    """The peer's advertised address could not be connected to. The message names the address
    and the setting on the holder that chooses it (``$TENSORHUB_ADVERTISE_HOST`` or the
    transport's ``advertise``/``host`` options); the engine adds the holder's name."""

    code = "peer_unreachable"


#: What a reader is told to change when a holder's address cannot be dialled.
UNREACHABLE_HINT = (
    "the holder advertised this address: either it went away, or it runs and this address does not reach it "
    "from here; then set $TENSORHUB_ADVERTISE_HOST (an address of the holder's host that its peers can dial) in "
    "the holder's environment, or give its transport the 'advertise' (and 'host') option"
)


@dataclass(frozen=True, slots=True)
class ReadCall:
    """One read, as :meth:`Transport.read` checked it: what its hooks are given.

    Attributes:
        peer: the peer's endpoint, as :meth:`Transport.check_read` returned it.
        where: the read named for messages (:meth:`Transport.describe_read`).
        landed: the landing callback (only for a transport with ``reports_landing``), or None.
        token: the grant token to show the holder (only for one with ``checks_grants``), or None.
    """

    peer: Any
    region: int
    version: int
    offset: int
    length: int
    into: ShardBuffers
    generation: int | None
    landed: Landed | None
    token: bytes | None
    where: str


@dataclass(frozen=True, slots=True)
class Probe:
    """What a transport found about this process (:meth:`Transport.probe`).

    Attributes:
        usable: ``start()`` can work here (libraries import, system calls allowed).
        default: worth starting when nothing is configured (implies ``usable``).
        reason: one line: why it is not usable or not a default, or what it will use.
        facts: ``(what was checked, what was found)`` pairs, in a fixed order.
    """

    usable: bool
    default: bool
    reason: str
    facts: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.default and not self.usable:
            raise ValueError("a transport that is not usable cannot be a default")


class Transport:
    """Base class of transport plugins. See the module docstring for the manual."""

    name: ClassVar[str] = ""
    one_sided: ClassVar[bool] = False
    cuda: ClassVar[bool] = False
    cross_host: ClassVar[bool] = True
    reports_landing: ClassVar[bool] = False
    gathers: ClassVar[bool] = False
    checks_grants: ClassVar[bool] = False
    #: the control-plane servers this process talks to, primary first (:meth:`set_servers`;
    #: empty: none known, a transport used alone)
    servers: tuple[str, ...] = ()

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})
        self._resolver: Resolver | None = None
        self._guard: Guard | None = None

    def set_servers(self, servers: Sequence[str]) -> None:
        """The servers this process talks to (ZeroMQ addresses, primary first), before
        ``start()``: a transport advertises the address of the interface that reaches them
        (:func:`tensorhub.transports.nic.choose_address`)."""
        self.servers = tuple(str(a) for a in servers)

    @classmethod
    def available(cls) -> bool:
        """Whether this transport can run here (its optional libraries import)."""
        return True

    @classmethod
    def probe(cls) -> Probe:
        """Whether it can run here and whether to start it by default (see the manual)."""
        try:
            usable = bool(cls.available())
        except Exception as err:  # a plugin's probe must not take the process down
            return Probe(False, False, f"available() raised {type(err).__name__}: {err}")
        return Probe(usable, False, "started only when named" if usable else "available() is False here")

    async def start(self) -> None:
        raise NotImplementedError

    def endpoint(self) -> dict[str, Any]:
        raise NotImplementedError

    def serve(self, resolver: Resolver) -> None:
        self._resolver = resolver

    def resolve(self, region: int, version: int) -> ShardBuffers | None:
        r = self._resolver
        return r(region, version) if r is not None else None

    def guard(self, check: Guard) -> None:
        """Install the grant check :meth:`admit` asks (the engine's, once, beside ``serve``)."""
        self._guard = check

    def admit(self, region: int, version: int, token: bytes | None, who: str = "") -> str | None:
        """Whether to serve a request for ``(region, version)`` that carried ``token``: None to
        serve it, else why not (refuse it, serving nothing). Everything is admitted while no
        check is installed. Never raises."""
        check = getattr(self, "_guard", None)  # a plugin that skipped __init__ has none
        if check is None:
            return None
        try:
            return check(region, version, token, f"{self.name} {who}".strip())
        except Exception as err:  # noqa: BLE001 - a broken check refuses, it does not serve
            return f"refused: the grant check raised {type(err).__name__}: {err}"

    def expose(self, buffers: ShardBuffers) -> None:
        """``buffers`` may be served from now on (one-sided transports register them)."""

    def withdraw(self, buffers: ShardBuffers) -> None:
        """``buffers`` will not be served any more (one-sided transports deregister them)."""

    async def read(
        self,
        peer: dict[str, Any],
        region: int,
        version: int,
        offset: int,
        length: int,
        into: ShardBuffers,
        generation: int | None,
        landed: Landed | None = None,
        *,
        token: bytes | None = None,
    ) -> int:
        """Copy ``[offset, offset + length)`` of ``version`` from ``peer`` into ``into``; the
        template method of the manual (step 4): the shared checks, then :meth:`read_range`, then
        :meth:`release_read` in ``finally``.

        Returns:
            The holder's generation the bytes were read under.
        Raises:
            InvalidArgument: a negative offset or length, a generation out of range, a token
                that is not bytes.
            RangeNotReady: a partial holder's progress did not cover the range in time.
            TransportError: anything else that kept the read from completing (a bad endpoint, a
                closed transport, the plugin's own failures).
        """
        where = self.describe_read(peer, region, version, offset, length)
        if offset < 0 or length < 0 or (generation is not None and not 0 <= generation < 1 << 64):
            raise InvalidArgument(f"bad read of {where}: offset {offset}, length {length}, generation {generation}")
        if token is not None and not isinstance(token, bytes):
            raise InvalidArgument(f"a grant token is bytes, got {type(token).__name__} (read of {where})")
        checked = self.check_read(peer, where, offset, length, token)
        call = ReadCall(checked, region, version, offset, length, into, generation, landed, token, where)
        if self.read_closed():
            raise TransportError(f"read of {where}: the {self.name} transport is closed; not started")
        try:
            return await self.read_range(call)
        finally:
            self.release_read(call)

    def describe_read(self, peer: Any, region: int, version: int, offset: int, length: int) -> str:
        """The read named for messages (a hook of :meth:`read`): the peer, region, version and range."""
        return f"{self.name} peer {peer!r} region {region} version {version} bytes [{offset}, {offset + length})"

    def check_read(self, peer: Any, where: str, offset: int, length: int, token: bytes | None) -> Any:
        """Check the peer's endpoint (and the range and token) for this transport, and return the
        endpoint as :meth:`read_blocking` wants it (a hook of :meth:`read`).

        Raises:
            TransportError: an endpoint this transport cannot read from; InvalidArgument: a read
                this transport refuses (too large, say).
        """
        return peer

    def read_closed(self) -> bool:
        """Whether the transport is closed (a hook of :meth:`read`: a read then fails at once)."""
        return bool(getattr(self, "_closed", False))

    def read_executor(self) -> Executor | None:
        """The pool :meth:`read_blocking` runs in (a hook of :meth:`read_range`); None: not started."""
        return getattr(self, "_executor", None)

    async def read_range(self, call: ReadCall) -> int:
        """Run :meth:`read_blocking` in :meth:`read_executor`'s pool (override for bulk work that
        is not one blocking call). Returns the holder's generation."""
        pool = self.read_executor()
        if pool is None:
            raise TransportError(f"read of {call.where}: the {self.name} transport is not started")
        try:
            fut = asyncio.get_running_loop().run_in_executor(pool, self.read_blocking, call)
        except RuntimeError as err:  # the pool shut down: closed meanwhile
            raise TransportError(f"read of {call.where}: the {self.name} transport is closed; not started") from err
        return await fut

    def read_blocking(self, call: ReadCall) -> int:
        """The read's bulk work, in a worker thread: copy the range into ``call.into`` and return
        the holder's generation (see the manual for what it must check)."""
        raise NotImplementedError

    def release_read(self, call: ReadCall) -> None:
        """Release what the read held (a hook of :meth:`read`, called in ``finally``, once)."""

    def abort_reads(self, into: ShardBuffers) -> int:
        """Optional: end this process's reads running into ``into`` now (see "Aborting reads" in
        the manual). Called on the event loop; must not block.

        Each read it ends raises :class:`TransportError` from :meth:`read`, writes nothing into
        ``into`` once it raised, and leaves nothing it used (a pooled connection) to a later read.

        Args:
            into: the buffers whose reads end (reads into other buffers go on).
        Returns:
            How many reads it ended. The base implementation ends none and returns 0.
        """
        return 0

    async def close(self) -> None:
        raise NotImplementedError
