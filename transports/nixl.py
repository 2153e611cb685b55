"""``nixl``: RDMA direct, one-sided READs of registered tensors through a NIXL agent (UCX).

Theory of operation
-------------------
Each process has one NIXL agent (UCX backend), created at ``start()``. ``expose(buffers)``
registers the buffers' regions (the packs and the large tensors, CPU "DRAM" or CUDA "VRAM") and
the arena chunks of the progress words (:data:`tensorhub.transports.buffers.WORDS`) with it, once: reads
never register anything. ``withdraw`` deregisters them and re-tags the progress words, so a
reader holding an old description fails its next read.

The holder's CPU takes part once per pull, not per read. Its endpoint is ``{"agent": name,
"side": address}`` (the side channel binds and advertises the address
:func:`tensorhub.transports.nic.choose_address` gives: options ``host``/``advertise``, else
``$TENSORHUB_ADVERTISE_HOST``, else loopback for a server on loopback, else the interface that
routes to the server); a reader first asks the holder's side channel to *describe* ``(region,
version)``, showing its grant token (``checks_grants``: a describe without a valid one is
refused, ``unauthorized``, and hands out no memory description): the answer is plain msgpack data, the base address, size and device of every
region, the address and tag of the progress words, and NIXL's partial agent metadata for those
registrations (connection info and memory keys, NIXL's own serialization; never a pickled
descriptor list), which the reader loads with ``add_remote_agent``. The reader keeps the
description until a read of it fails.

A read of ``[offset, offset + length)``, in one of the transport's threads:

1. READ the holder's 32 bytes of progress words (into a registered scratch slot of this
   thread) until the tag is the described one, the version is held and ``verified`` covers the
   range; poll with backoff, bounded by ``wait_timeout`` (-> :class:`RangeNotReady`), failing at
   once if the generation is not the caller's or the holding changed. A pipelined reader thus
   follows a partial holder's progress with READs alone: no holder CPU. The step is skipped when
   the caller names its pull's generation and an earlier read already saw the range covered
   under it (``verified`` never decreases within a generation; step 3 checks the generation).
2. One transfer request of READs, one descriptor per region segment the range covers (the
   layouts are equal, so the reader cuts the range with its own plan), posted at once.
3. READ the words again: the tag, generation and version must not have moved (a seqlock).

Transfer requests are posted and polled by one driver thread per agent (:class:`XferDriver`;
reading threads hand their READs to it and wait, bounded by ``xfer_timeout`` and by the
transport closing); statuses are an enum (:class:`XferStatus`), and the driver releases every
handle as soon as it is final or its waiter gave up. :func:`completion` is the same polling as
an awaitable, for a handle posted elsewhere. Remote agents are dropped (``remove_remote_agent``)
when a read from them fails for the peer's sake, when they were idle for ``peer_idle_s``,
and at close.

NIC affinity: option ``nic`` is a UCX device list (``mlx5_0:1``), ``"auto"`` (the NIC nearest
the GPU of option ``cuda_device`` or the current CUDA device, from sysfs; see
:mod:`tensorhub.transports.nic`) or ``""`` (UCX chooses). The choice is passed to the UCX backend as
``ucx_devices`` and logged.

What it must never do: unpickle NIXL descriptors from a peer (``deserialize_descs``), register
memory per read, leave a transfer handle unreleased, or wait without a bound.

Size: one plugin with its NIXL plumbing (probe, agent, transfer driver, registrations) that
``rdma_copy`` reuses; the plumbing above :class:`NixlTransport` would split off first.
"""

from __future__ import annotations

import asyncio
import ctypes
import enum
import functools
import itertools
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorhub.core.errors import InvalidArgument, TransportError
from tensorhub.core.log import get_logger

from .base import Probe, RangeNotReady, ReadCall, Transport, Unauthorized
from .buffers import WORD_BYTES, WORDS, ShardBuffers, read_words
from .nic import choose_address
from .sidechannel import SideClient, SideError, SideServer
from .sidechannel import field as req_field

__all__ = ["NixlIO", "NixlTransport", "XferDriver", "XferStatus", "completion", "load_nixl", "wait_xfer"]


def nixl_facts() -> tuple[Any, list[tuple[str, str]]]:
    """NIXL's module (or None) and what a probe reports of it: the import, its version, the
    host's RDMA devices and the UCX settings from the environment."""
    from .nic import rdma_nics

    api = load_nixl()
    facts = [("nixl import", api.__name__.split(".")[0] if api is not None else "not importable (pip install nixl-cu12)")]
    if api is not None:
        import importlib.metadata as md

        for dist in ("nixl-cu12", "nixl-cu13", "nixl"):
            try:
                facts.append(("nixl version", f"{dist} {md.version(dist)}"))
                break
            except md.PackageNotFoundError:
                continue
    devices = rdma_nics()
    facts.append(("RDMA devices", ", ".join(devices) if devices else "none (/sys/class/infiniband is empty or absent)"))
    for var in ("UCX_TLS", "UCX_NET_DEVICES"):
        facts.append((f"${var}", os.environ.get(var, "unset")))
    return api, facts


def probe_nixl(what: str) -> Probe:
    """Usable when NIXL imports; a default only on a host with an RDMA device: without one UCX
    moves bulk bytes over TCP or shared memory, slower than the ``tcp`` and ``local`` transports
    (NOTES: UCX over TCP about 0.75 GB/s against a raw socket's 1.7-2.2 GB/s here)."""
    api, facts = nixl_facts()
    if api is None:
        return Probe(False, False, "NIXL does not import (pip install nixl-cu12)", tuple(facts))
    if what == "rdma_copy":
        return Probe(True, False, "started only when named: it pre-registers a staging pool, for tensors "
                     "re-allocated often", tuple(facts))  # fmt: skip
    from .nic import rdma_nics

    if not rdma_nics():
        return Probe(True, False, "no RDMA device on this host: UCX would fall back to TCP, slower than the tcp "
                     "transport (name it to use it anyway)", tuple(facts))  # fmt: skip
    return Probe(True, True, "one-sided RDMA reads of registered tensors", tuple(facts))


def load_nixl() -> Any:
    """NIXL's Python API module (``nixl_cu12._api``, else ``nixl._api``), or None."""
    for name in ("nixl_cu12._api", "nixl._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except Exception:  # noqa: BLE001,S112 - an absent or broken install is "not available"
            continue
    return None


class XferStatus(enum.Enum):
    """A transfer request's state, as NIXL reports it."""

    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


#: The longest pause between two polls of a transfer in progress. Every microsecond of it can
#: be added to a read's latency (an 8 MiB READ takes about 1.5 ms here), and a poll costs
#: about one microsecond.
_POLL_MAX = 50e-6


def wait_xfer(agent: Any, handle: Any, first: str, deadline: float, closed: Callable[[], bool]) -> XferStatus:
    """Poll ``handle`` until it is no longer in progress: spin a little (a short READ finishes
    in microseconds), then sleep with backoff up to 50 us. ``first`` is what ``transfer``
    returned. Returns DONE or ERR; raises :class:`TransportError` past ``deadline`` or when
    ``closed()``. The caller releases the handle. (:class:`XferDriver` does the same for many
    handles at once, from one thread.)"""
    status = XferStatus(first)
    sleep = 0.0
    for spins in itertools.count():  # bounded by the deadline
        if status is not XferStatus.PROC:
            return status
        _check_wait(deadline, closed)
        if spins > 64:
            time.sleep(sleep)
            sleep = min(max(sleep * 2, 10e-6), _POLL_MAX)
        status = XferStatus(agent.check_xfer_state(handle))
    raise AssertionError("unreachable")  # pragma: no cover


def _check_wait(deadline: float, closed: Callable[[], bool]) -> None:
    if closed():
        raise TransportError("the transport closed during the transfer")
    if time.monotonic() > deadline:
        raise TransportError("the transfer did not complete in time (xfer_timeout)")


class _Request:
    """One READ request handed to the driver; ``done`` is set when ``status`` is final."""

    __slots__ = ("cancelled", "done", "error", "kinds", "pairs", "peer", "status")

    def __init__(self, peer: str, pairs: list[tuple[int, int, int, int]], kinds: tuple[tuple[str, int], tuple[str, int]]) -> None:
        self.peer, self.pairs, self.kinds = peer, pairs, kinds
        self.status = XferStatus.PROC
        self.error: BaseException | None = None
        self.cancelled = False
        self.done = threading.Event()


class XferDriver:
    """Every transfer request of an agent, posted and polled by one thread.

    Reader threads hand their READs over (:meth:`run`) and wait; the driver thread (started on
    first use, gone after :meth:`close`) builds the descriptor lists, creates and posts the
    request, polls everything in flight (backing off from 10 us to 50 us while nothing
    completes) and releases each handle as soon as it is final, or when its waiter gave up.
    Only this thread touches transfer handles: several threads posting and polling at once
    contend on the agent's lock (measured: four reading threads reached half the throughput of
    one thread keeping four READs in flight), and a handle can never be polled after its
    release.
    """

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: list[_Request] = []
        self._thread: threading.Thread | None = None
        self._stopped = False

    def run(self, peer: str, pairs: list[tuple[int, int, int, int]], local_kind: tuple[str, int],
            remote_kind: tuple[str, int], deadline: float, closed: Callable[[], bool]) -> XferStatus:  # fmt: skip
        """Post one READ request of ``(local address, remote address, nbytes, _)`` pairs and
        wait for it. Returns DONE or ERR; raises what NIXL raised building or posting it, or
        :class:`TransportError` past ``deadline`` or when ``closed()``."""
        req = _Request(peer, pairs, (local_kind, remote_kind))
        with self._lock:
            if self._stopped:
                raise TransportError("the transport closed before the transfer")
            self._queue.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nixl-xfer-driver", daemon=True)
                self._thread.start()
            self._wake.notify()
        for _ in range(1 << 30):  # bounded by the deadline
            if req.done.wait(0.02):
                if req.error is not None:
                    raise req.error
                return req.status
            try:
                _check_wait(deadline, closed)
            except TransportError:
                req.cancelled = True  # the driver releases its handle on its next pass
                req.done.wait(1.0)  # so that the read's error comes after the release
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _post(self, req: _Request) -> Any:
        (lk, ld), (rk, rd) = req.kinds
        local = self.agent.get_xfer_descs([(a, n, ld) for a, _, n, _ in req.pairs], lk)
        remote = self.agent.get_xfer_descs([(r, n, rd) for _, r, n, _ in req.pairs], rk)
        handle = self.agent.initialize_xfer("READ", local, remote, req.peer)
        try:
            req.status = XferStatus(self.agent.transfer(handle))
        except BaseException:
            self.agent.release_xfer_handle(handle)
            raise
        return handle

    def _finish(self, req: _Request, handle: Any) -> None:
        if handle is not None:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as err:  # noqa: BLE001 - a handle NIXL cannot free fails its transfer
                req.status, req.error = XferStatus.ERR, TransportError(f"NIXL could not release the request: {err}")
        req.done.set()

    def _run(self) -> None:
        inflight: list[tuple[_Request, Any]] = []
        sleep = 0.0
        for _ in itertools.count():  # ends at close
            with self._lock:
                while not self._queue and not inflight and not self._stopped:
                    self._wake.wait(1.0)
                if self._stopped:
                    new, self._queue = self._queue, []
                    for req in new:
                        req.error = TransportError("the transport closed before the transfer")
                        req.done.set()
                    for req, handle in inflight:
                        req.error = TransportError("the transport closed during the transfer")
                        self._finish(req, handle)
                    return
                new, self._queue = self._queue, []
            progressed = bool(new)
            for req in new:
                try:
                    handle = self._post(req)
                except BaseException as err:  # noqa: BLE001 - NIXL's error is this request's
                    req.status, req.error = XferStatus.ERR, err
                    req.done.set()
                    continue
                if req.status is XferStatus.PROC:
                    inflight.append((req, handle))
                else:
                    self._finish(req, handle)
            still = []
            for req, handle in inflight:
                status = req.status
                if not req.cancelled:
                    try:
                        status = XferStatus(self.agent.check_xfer_state(handle))
                    except Exception:  # noqa: BLE001 - a broken handle fails its own transfer
                        status = XferStatus.ERR
                if status is XferStatus.PROC and not req.cancelled:
                    still.append((req, handle))
                    continue
                req.status = status
                self._finish(req, handle)
                progressed = True
            inflight = still
            if progressed:
                sleep = 0.0
            elif inflight:
                time.sleep(sleep)
                sleep = min(max(sleep * 2, 10e-6), _POLL_MAX)

    def close(self) -> None:
        """Fail what is queued or in flight (handles released), and stop the thread."""
        with self._lock:
            self._stopped = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)


async def completion(agent: Any, handle: Any, first: str, timeout: float) -> XferStatus:
    """:func:`wait_xfer` as an awaitable (polled in a worker thread, off the event loop)."""
    deadline = time.monotonic() + timeout
    return await asyncio.to_thread(wait_xfer, agent, handle, first, deadline, lambda: False)


def memtype(t: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor."""
    return ("VRAM", t.device.index or 0) if t.device.type == "cuda" else ("DRAM", 0)


@dataclass
class _Registration:
    """What ``expose`` registered for one set of buffers."""

    buffers: ShardBuffers
    dlists: list[Any]  # reg descriptor lists, per memory type
    metadata: list[bytes] | None = None  # partial agent metadata (built at the first describe)
    regions: list[list[Any]] = field(default_factory=list)  # [address, nbytes, memtype, device]


class NixlIO:
    """One NIXL agent and the memory this process registered with it (the plumbing both
    NIXL transports share). ``agent`` is duck-typed: NIXL's ``nixl_agent`` or a test fake with
    the same methods.
    """

    def __init__(self, agent: Any, name: str) -> None:
        self.agent = agent
        self.name = name
        self.driver = XferDriver(agent)
        self.lock = threading.Lock()
        self._words_chunks: dict[int, Any] = {}  # arena chunk index -> reg dlist
        self._peers: dict[str, float] = {}  # remote agent name -> last use (monotonic)

    # ---- registration ----------------------------------------------------------------------

    def register(self, tensors: list[torch.Tensor]) -> tuple[list[Any], list[list[Any]]]:
        """Register the tensors (grouped per memory type). Returns the reg descriptor lists and
        ``[address, nbytes, memtype, device]`` per tensor."""
        rows: list[list[Any]] = []
        groups: dict[str, list[tuple[int, int, int, str]]] = {}
        for t in tensors:
            addr, n, (kind, dev) = t.data_ptr(), t.numel() * t.element_size(), memtype(t)
            rows.append([addr, n, kind, dev])
            if n:
                groups.setdefault(kind, []).append((addr, n, dev, ""))
        dlists = []
        try:
            for kind, descs in groups.items():
                dlists.append(self.agent.register_memory(self.agent.get_reg_descs(descs, kind)))
        except Exception:
            for d in dlists:
                self.agent.deregister_memory(d)
            raise
        return dlists, rows

    def deregister(self, dlists: list[Any]) -> None:
        for d in dlists:
            self.agent.deregister_memory(d)

    def words_dlist(self, chunk: int) -> Any:
        """The reg descriptor list of a progress-words arena chunk (registered on first use)."""
        with self.lock:
            got = self._words_chunks.get(chunk)
            if got is None:
                t = WORDS.chunks[chunk]
                got = self._words_chunks[chunk] = self.agent.register_memory(
                    self.agent.get_reg_descs([(t.data_ptr(), t.numel(), 0, "")], "DRAM")
                )
            return got

    def metadata(self, dlists: list[Any]) -> list[bytes]:
        """Partial agent metadata (with connection info) for these registrations."""
        return [bytes(self.agent.get_partial_agent_metadata(d, True)) for d in dlists]

    # ---- peers -----------------------------------------------------------------------------

    def load_peer(self, expected: str, blobs: list[Any]) -> None:
        """Load a peer's metadata blobs; each must name the agent ``expected``."""
        for md in blobs:
            if not isinstance(md, bytes):
                raise TransportError(f"agent metadata of {expected!r} is {type(md).__name__}, not bytes")
            got = self.agent.add_remote_agent(md)
            got = got.decode() if isinstance(got, bytes) else str(got)
            if got != expected:
                self.drop_peer(got)
                raise TransportError(f"the metadata names agent {got!r}, the endpoint {expected!r}")
        self._peers[expected] = time.monotonic()

    def touch(self, peer: str) -> None:
        self._peers[peer] = time.monotonic()

    def drop_peer(self, peer: str) -> None:
        """Forget a remote agent (its metadata and connection)."""
        self._peers.pop(peer, None)
        try:
            self.agent.remove_remote_agent(peer)
        except Exception:  # noqa: BLE001,S110 - already gone is fine
            pass

    def drop_idle(self, idle_s: float) -> list[str]:
        now = time.monotonic()
        old = [p for p, t in self._peers.items() if now - t > idle_s]
        for p in old:
            self.drop_peer(p)
        return old

    # ---- transfers -------------------------------------------------------------------------

    def read(
        self,
        peer: str,
        pairs: list[tuple[int, int, int, int]],
        local_kind: tuple[str, int],
        remote_kind: tuple[str, int],
        deadline: float,
        closed: Callable[[], bool],
    ) -> None:
        """One transfer request of READs: ``(local address, remote address, nbytes, _)`` pairs,
        all of one local and one remote memory type, posted by the driver thread; raises
        :class:`TransportError` unless it completes. The handle is released on every path."""
        status = self.driver.run(peer, pairs, local_kind, remote_kind, deadline, closed)
        if status is not XferStatus.DONE:
            raise TransportError(f"the READ from agent {peer!r} failed (status {status.value})")

    def close(self) -> None:
        self.driver.close()
        for p in list(self._peers):
            self.drop_peer(p)
        with self.lock:
            chunks, self._words_chunks = self._words_chunks, {}
        for d in chunks.values():
            self.agent.deregister_memory(d)


_AGENT_LOCK = threading.Lock()


def default_agent(name: str, ucx_devices: str | None, progress_delay_us: int = 100) -> Any:
    """A NIXL agent with the UCX backend, thread-safe (several reader threads use it).

    Its progress thread (which answers peers' READs under UCX's emulated RMA) sleeps
    ``progress_delay_us`` between rounds: NIXL's Python API leaves it at 0, a busy loop that
    burns a core while idle; 100 us cost nothing measurable in throughput here and bring an
    idle agent from 1.0 core to 0.04 (``benchmarks/bench_transfer.py``).
    """
    api = load_nixl()
    if api is None:
        raise TransportError("NIXL is not installed (pip install nixl-cu12)")
    bind = api.nixlBind
    make = bind.nixlAgent

    def with_delay(agent_name: str, cfg: Any) -> Any:
        cfg.pthrDelay = progress_delay_us  # the wrapper hard-codes 0 and offers no setting
        return make(agent_name, cfg)

    config = api.nixl_agent_config(backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
    with _AGENT_LOCK:
        bind.nixlAgent = with_delay
        try:
            agent = api.nixl_agent(name, config)
        finally:
            bind.nixlAgent = make
    agent.create_backend("UCX", {"ucx_devices": ucx_devices} if ucx_devices else {})
    return agent


_OPTIONS = {
    # name: (default, minimum, kind)
    "host": ("", None, str),
    "advertise": ("", None, str),
    "wait_timeout": (5.0, 0.0, float),
    "xfer_timeout": (30.0, 0.001, float),
    "describe_timeout": (15.0, 0.001, float),
    "peer_idle_s": (300.0, 0.0, float),
    "threads": (8, 1, int),
    "streams": (4, 1, int),
    "nic": ("auto", None, str),
    "cuda_device": (-1, -1, int),
    "progress_delay_us": (100, 0, int),
}


def options_of(kind: str, options: dict[str, Any], table: dict[str, tuple[Any, Any, type]]) -> dict[str, Any]:
    """Validated options with defaults. Raises :class:`InvalidArgument` naming a bad one."""
    unknown = sorted(str(k) for k in options if k not in table)
    if unknown:
        raise InvalidArgument(f"unknown {kind} transport options {unknown}; known: {sorted(table)}")
    out = {}
    for name, (default, minimum, want) in table.items():
        v = options.get(name, default)
        if want is str:
            ok = type(v) is str
        elif want is int:
            ok = type(v) is int and v >= minimum
        else:
            ok = type(v) in (int, float) and math.isfinite(v) and v >= minimum
        if not ok:
            what = "a string" if want is str else f"{'an integer' if want is int else 'a finite number'} >= {minimum}"
            raise InvalidArgument(f"{kind} transport option {name!r} must be {what}, got {v!r}")
        out[name] = float(v) if want is float else v
    return out


def choose_ucx_devices(nic: str, cuda_device: int) -> tuple[str | None, str]:
    """(UCX device list or None, why) for the ``nic`` option (see the module docstring)."""
    from .nic import choose_nic

    if nic not in ("auto", ""):
        choice = choose_nic(nic, None)
        return choice.ucx_net_devices(), choice.reason
    if nic == "":
        return None, "UCX chooses (nic option empty)"
    device = cuda_device if cuda_device >= 0 else (torch.cuda.current_device() if torch.cuda.is_available() else None)
    choice = choose_nic(None, device)
    return choice.ucx_net_devices(), choice.reason


async def start_agent(
    kind: str, factory: Callable[[str, str | None], Any], name: str, nic: str, cuda_device: int, log: Any
) -> tuple[NixlIO, str | None]:
    """Choose the NIC (logged), create the agent off the event loop; ``(its NixlIO, the UCX
    device list)``. Raises :class:`TransportError` naming what NIXL raised."""
    devices, why = choose_ucx_devices(nic, cuda_device)
    log.info(f"{kind} nic", ucx_devices=devices or "(UCX default)", reason=why)
    try:
        agent = await asyncio.to_thread(factory, name, devices)
    except TransportError:
        raise
    except Exception as err:  # whatever NIXL raises, name it
        raise TransportError(f"cannot create the NIXL agent: {type(err).__name__}: {err}") from err
    return NixlIO(agent, name), devices


@dataclass
class _Described:
    """A holder's description of one (region, version), as a reader caches it."""

    agent: str
    tag: int
    words: int
    regions: list[list[Any]]
    seen: tuple[int, int] | None = None  # (generation, verified) of the last words READ that covered


class NixlTransport(Transport):
    """RDMA direct over NIXL. See the module docstring.

    Options: ``host`` (the side channel's interface) and ``advertise`` (the address peers dial;
    both default to :func:`~tensorhub.transports.nic.choose_address`'s rule), ``wait_timeout``
    (seconds a read waits for a partial holder, default 5), ``xfer_timeout`` (one transfer,
    default 30), ``describe_timeout`` (default 15), ``peer_idle_s`` (drop a remote agent unused
    this long, default 300), ``threads`` (reads at once, default 8), ``streams`` (concurrent
    reads per pull the engine runs, default 4), ``nic`` (default "auto"), ``cuda_device``,
    ``progress_delay_us`` (the agent's progress thread's pause, default 100).

    Args:
        agent_factory: ``factory(name, ucx_devices) -> agent`` (tests pass a fake agent).

    Raises:
        InvalidArgument: an unknown option or a bad value.
    """

    name = "nixl"
    one_sided = True
    cuda = True
    cross_host = True
    checks_grants = True

    def __init__(self, options: dict[str, Any] | None = None, agent_factory: Callable[[str, str | None], Any] | None = None) -> None:
        super().__init__(options)
        o = options_of(self.name, self.options, _OPTIONS)
        self.host = o["host"]
        self.advertise = o["advertise"]
        self.wait_timeout = o["wait_timeout"]
        self.xfer_timeout = o["xfer_timeout"]
        self.describe_timeout = o["describe_timeout"]
        self.peer_idle_s = o["peer_idle_s"]
        self.threads = o["threads"]
        self.streams = o["streams"]
        self.nic, self.cuda_device = o["nic"], o["cuda_device"]
        self.agent_name = f"tensorhub-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._factory = agent_factory or functools.partial(default_agent, progress_delay_us=o["progress_delay_us"])
        self.io: NixlIO | None = None
        self.log = get_logger(transport=self.name)
        self._lock = threading.Lock()
        self._exposed: dict[int, _Registration] = {}
        self._described: dict[tuple[str, int, int], _Described] = {}
        self._scratch: torch.Tensor | None = None
        self._slots = threading.local()
        self._slot_ids = itertools.count()
        self._executor: ThreadPoolExecutor | None = None
        self._side: SideServer | None = None
        self._client: SideClient | None = None
        self._closed = False
        self.ucx_devices: str | None = None

    @classmethod
    def available(cls) -> bool:
        return load_nixl() is not None

    @classmethod
    def probe(cls) -> Probe:
        return probe_nixl("nixl")

    # ---- both sides ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the agent (and its scratch words), start the side channel.

        Raises:
            TransportError: NIXL is missing or the agent cannot be created; it was closed.
        """
        if self._closed:
            raise TransportError(f"nixl transport {self.agent_name} is closed; it cannot start again")
        if self.io is not None:
            return
        self.io, self.ucx_devices = await start_agent(self.name, self._factory, self.agent_name, self.nic, self.cuda_device, self.log)
        self._scratch = torch.zeros((self.threads + 1) * WORD_BYTES, dtype=torch.uint8)
        self._scratch_dlists, _ = self.io.register([self._scratch])
        self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="nixl-read")
        self._client = SideClient(f"nixl reader {self.agent_name}")
        where = choose_address(self.host or None, self.advertise or None, self.servers)
        self._side = SideServer(f"nixl-{os.getpid()}", {"describe": (self._describe, True)}, where.bind, advertise=where.advertise)
        self.log.info("nixl side channel listening", address=self._side.address, bind=where.bind, rule=where.rule)

    def endpoint(self) -> dict[str, Any]:
        if self._side is None:
            raise TransportError("the nixl transport is not started")
        return {"agent": self.agent_name, "side": self._side.address}

    def expose(self, buffers: ShardBuffers) -> None:
        """Register the buffers' regions and their progress words' arena chunk (once)."""
        io = self._require()
        with self._lock:
            if id(buffers) in self._exposed:
                return
        if buffers.packs_in_place:
            raise InvalidArgument("nixl registers pack buffers: these buffers keep their packs in place (nixl does not gather)")
        dlists, rows = io.register([buffers.region_tensor(k) for k in range(len(buffers.regions))])
        io.words_dlist(buffers.progress.words_chunk)
        with self._lock:
            self._exposed[id(buffers)] = _Registration(buffers, dlists, regions=rows)

    def withdraw(self, buffers: ShardBuffers) -> None:
        """Deregister the buffers; re-tag their words so that cached descriptions fail."""
        with self._lock:
            reg = self._exposed.get(id(buffers))
            if reg is None or reg.buffers is not buffers:
                return
            del self._exposed[id(buffers)]
        buffers.progress.retag()
        if self.io is not None:
            self.io.deregister(reg.dlists)

    async def close(self) -> None:
        """Stop serving (exposed buffers are re-tagged and deregistered), fail reads in flight,
        drop remote agents and release the agent. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            regs, self._exposed = list(self._exposed.values()), {}
        for reg in regs:
            reg.buffers.progress.retag()
        if self._side is not None:
            await asyncio.to_thread(self._side.close)
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, True, cancel_futures=True)
        if self._client is not None:
            self._client.close()
        io, self.io = self.io, None
        if io is not None:
            for reg in regs:
                io.deregister(reg.dlists)
            io.deregister(self._scratch_dlists)
            io.close()
            del io  # the agent goes with its last reference

    def _require(self) -> NixlIO:
        if self.io is None:
            raise TransportError(f"nixl transport {self.agent_name} is {'closed' if self._closed else 'not started'}")
        return self.io

    # ---- holder side: describe -----------------------------------------------------------------

    def _describe(self, msg: dict[str, Any]) -> dict[str, Any]:
        region = req_field(msg, "region", int, 0)
        version = req_field(msg, "version", int, 0)
        refused = self.admit(region, version, msg.get("token"), msg.get("_from", ""))
        if refused is not None:
            raise SideError("unauthorized", refused)
        io = self.io
        if io is None or self._closed:
            raise SideError("closed", "the holder's nixl transport is closed")
        try:
            buffers = self.resolve(region, version)
        except Exception as err:  # noqa: BLE001 - the resolver's failure is this request's
            raise SideError("internal", f"the resolver raised {type(err).__name__}: {err}") from None
        if buffers is None:
            raise SideError("unknown", f"no holding of region {region} version {version}")
        with self._lock:
            reg = self._exposed.get(id(buffers))
            if reg is None or reg.buffers is not buffers:
                raise SideError("not_exposed", f"the buffers of region {region} version {version} are not exposed")
            if reg.metadata is None:
                reg.metadata = io.metadata([*reg.dlists, io.words_dlist(buffers.progress.words_chunk)])
            md = reg.metadata
        p = buffers.progress
        return {"agent": self.agent_name, "tag": p.tag, "words": p.words_address, "regions": reg.regions, "md": md}

    # ---- reader side ---------------------------------------------------------------------------

    def describe_read(self, peer: Any, region: int, version: int, offset: int, length: int) -> str:
        name = peer.get("agent") if isinstance(peer, dict) else peer
        return f"nixl peer {name!r} region {region} version {version} bytes [{offset}, {offset + length})"

    def check_read(self, peer: Any, where: str, offset: int, length: int, token: bytes | None) -> dict:
        if not (isinstance(peer, dict) and type(peer.get("agent")) is str and type(peer.get("side")) is str):
            raise TransportError(f"read of {where}: the endpoint {peer!r} lacks 'agent' and 'side' strings")
        return peer

    def read_blocking(self, call: ReadCall) -> int:
        """Copy ``[offset, offset + length)`` of ``version`` from the peer into ``into`` (see the
        module docstring), showing the grant's token when it asks for the description. Returns
        the holder's generation.

        Raises:
            RangeNotReady: a partial holder's progress did not cover the range in time.
            Unauthorized: the holder refused the token.
            PeerUnreachable: the side channel's address could not be connected to.
            TransportError: anything else that kept the read from completing.
        """
        return self._read_blocking(call.peer, call.where, call.region, call.version, call.offset, call.length, call.into,
                                   call.generation, call.token)  # fmt: skip

    def _read_blocking(
        self, peer: dict, where: str, region: int, version: int, offset: int, length: int, into: ShardBuffers, generation: int | None,
        token: bytes | None = None,
    ) -> int:  # fmt: skip
        io = self._require()
        agent = peer["agent"]
        key = (peer["side"], region, version)
        if offset < 0 or length < 0 or offset + length > into.total_bytes:
            raise TransportError(f"read of {where}: the range is outside the destination's {into.total_bytes} bytes")
        with self._lock:
            if id(into) not in self._exposed:
                raise TransportError(f"read of {where}: the destination buffers are not exposed on this transport (expose() them first)")
        try:
            d = self._described.get(key) or self._describe_peer(io, peer, key, where, into, token)
            if length == 0:
                return self._covered(io, d, where, version, 0, generation)[0]
            gen = self._wait_covered(io, d, where, version, offset + length, generation)
            self._transfer(io, d, where, into, offset, length)
            tag, after, held, verified = self._words(io, d, where)
            if tag != d.tag:
                raise TransportError("the holder withdrew or replaced these buffers during the read (their tag changed)")
            if after != gen or held != version or verified < offset + length:
                raise TransportError(f"the peer's holding changed during the read (generation {gen} -> {after})")
            io.touch(agent)
            return gen
        except RangeNotReady:
            raise
        except TransportError as err:
            self._described.pop(key, None)
            raise type(err)(f"read of {where}: {err}") from err  # keeps Unauthorized, PeerUnreachable
        except Exception as err:
            self._described.pop(key, None)
            io.drop_peer(agent)
            raise TransportError(f"read of {where}: NIXL raised {type(err).__name__}: {err}") from err

    def _describe_peer(self, io: NixlIO, peer: dict, key: tuple, where: str, into: ShardBuffers, token: bytes | None = None) -> _Described:
        for dropped in io.drop_idle(self.peer_idle_s):
            self.log.info("dropped idle remote agent", agent=dropped)
        assert self._client is not None
        request = {"region": key[1], "version": key[2], "token": token}
        try:
            reply = self._client.call(peer["side"], "describe", request, self.describe_timeout, lambda: self._closed)
        except SideError as err:
            cls = Unauthorized if err.code == "unauthorized" else TransportError
            raise cls(f"the holder refused to describe it ({err.code}: {err})") from err
        regions, words, tag, md = reply.get("regions"), reply.get("words"), reply.get("tag"), reply.get("md")
        if not (
            isinstance(regions, list)
            and len(regions) == len(into.plan.regions)
            and all(
                isinstance(r, list) and len(r) == 4 and type(r[0]) is int and type(r[1]) is int and r[2] in ("DRAM", "VRAM") and type(r[3]) is int
                for r in regions
            )
            and type(words) is int
            and type(tag) is int
            and isinstance(md, list)
        ):
            raise TransportError("the holder's description is malformed or has a different number of regions")
        for r, mine in zip(regions, into.plan.regions):
            if r[1] != mine.nbytes:
                raise TransportError(f"the holder's region of {r[1]} bytes is {mine.nbytes} bytes here (layouts differ)")
        io.load_peer(peer["agent"], md)
        d = _Described(peer["agent"], tag, words, regions)
        self._described[key] = d
        return d

    def _scratch_address(self) -> int:
        slot = getattr(self._slots, "index", None)
        if slot is None:
            slot = self._slots.index = next(self._slot_ids) % (self.threads + 1)
        assert self._scratch is not None
        return self._scratch.data_ptr() + slot * WORD_BYTES

    def _words(self, io: NixlIO, d: _Described, where: str) -> tuple[int, int, int | None, int]:
        local = self._scratch_address()
        io.read(d.agent, [(local, d.words, WORD_BYTES, 0)], ("DRAM", 0), ("DRAM", 0), time.monotonic() + self.xfer_timeout, lambda: self._closed)
        return read_words(ctypes.string_at(local, WORD_BYTES))

    def _covered(
        self, io: NixlIO, d: _Described, where: str, version: int, end: int, generation: int | None
    ) -> tuple[int, bool, bool, int]:
        """Words READs: (generation, covered, holds the version, verified). "Covered" needs two READs in a
        row to agree: a READ of the words is not atomic, and one that overlaps the holder's
        writes could combine a new generation with an old version."""
        words = self._words(io, d, where)
        for _ in range(8):
            again = self._words(io, d, where)
            if again == words:
                break
            words = again
        else:
            return words[1], False, words[2] == version, 0
        tag, gen, held, verified = words
        if tag != d.tag:
            raise TransportError("the holder withdrew or replaced these buffers (their tag changed)")
        if generation is not None and gen != generation:
            raise TransportError(f"the peer's holding changed (generation {gen}, the pull began at {generation})")
        return gen, held == version and verified >= end, held == version, verified

    def _wait_covered(self, io: NixlIO, d: _Described, where: str, version: int, end: int, generation: int | None) -> int:
        if generation is not None and d.seen is not None and d.seen[0] == generation and d.seen[1] >= end:
            return generation  # this pull's generation covered it before; step 3 checks it held
        deadline = time.monotonic() + self.wait_timeout
        seen_version, sleep = False, 0.0005
        for _ in range(1 << 30):  # bounded by the deadline
            gen, covered, holds, verified = self._covered(io, d, where, version, end, generation)
            if covered:
                d.seen = (gen, verified)  # what the holder had verified: later reads below it skip this
                return gen
            if holds:
                seen_version = True
            elif seen_version:
                raise TransportError("the peer's holding changed (it no longer holds the version)")
            if self._closed:
                raise TransportError("the nixl transport closed while waiting for the holder's progress")
            if time.monotonic() > deadline:
                state = "its progress does not cover the range" if holds else "it does not hold the version yet"
                raise RangeNotReady(f"read of {where}: not covered within {self.wait_timeout:g} s ({state})")
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.005)
        raise AssertionError("unreachable")  # pragma: no cover

    def _transfer(self, io: NixlIO, d: _Described, where: str, into: ShardBuffers, offset: int, length: int) -> None:
        groups: dict[tuple[tuple[str, int], tuple[str, int]], list[tuple[int, int, int, int]]] = {}
        for seg in into.segments(offset, length):
            mine = into.region_tensor(seg.index)  # exposed buffers keep no pack in place
            addr, _, kind, dev = d.regions[seg.index]
            key = (memtype(mine), (kind, dev))
            groups.setdefault(key, []).append((mine.data_ptr() + seg.start, addr + seg.start, seg.length, seg.index))
        deadline = time.monotonic() + self.xfer_timeout
        for (local_kind, remote_kind), pairs in groups.items():
            io.read(d.agent, pairs, local_kind, remote_kind, deadline, lambda: self._closed)
