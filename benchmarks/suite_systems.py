"""The systems the benchmark suite compares, as they run inside its helper processes.

Theory of operation
-------------------
One *group* measures one system moving one shard from one holder process to ``N`` reader
processes (real OS processes, ``multiprocessing`` spawn). Each process runs :func:`side_main`:

1. imports what its system needs (before the shard exists: code is not what we measure);
2. allocates its tensors: the holder fills them with seeded content, a reader zeroes its own
   (preallocated, resident: every system must land the bytes *in these tensors*);
3. notes its RSS (the base of the memory figure) and starts a :class:`PeakRss` window;
4. a holder builds its side (``Side.__init__``: listening sockets, agents, registrations) and
   answers ``ready`` with ``info`` (what readers need to reach it: ports, addresses, metadata);
   a reader answers ``ready`` at once (all processes start together);
5. then obeys the parent, one command at a time: ``connect`` (a reader builds its side from the
   holder's ``info`` here; then the blocking, all-at-once setup of every process: a gloo process
   group, NIXL metadata, connections), ``prepare`` (untimed, before each round:
   the reader zeroes its tensors, a store frees the previous object, tensorhub unpublishes),
   ``go`` (sleep until the common start time on the host's monotonic clock, run the timed
   transfer, note when it ended; a reader then hashes every tensor, xxh3-64, against the
   expected values and reports the names that differ), ``memory`` (RSS base and peak) and
   ``quit``.

A store's holder hands the readers its object reference through the store's own means (a Ray
actor, as Ray programs do), inside the timed round: the put, the reference's trip and the get
all count.

Nothing here unpickles bytes from a socket in TensorHub's code; the alternatives do what they
do (Ray pickles its references and torch tensors). Every wait is bounded by ``timeout``; every
address is 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

import torch

from benchmarks.bench_transfer_baselines import baseline_pull, raw_nixl_agent, raw_nixl_pull, raw_register
from benchmarks.harness import BenchmarkError, PeakRss, status_bytes
from benchmarks.harness.shards import Spec, allocate, fill_seeded, hashes_of
from tensorhub.transports.buffers import memory_of

#: Ray on 127.0.0.1 (not the host's address), with its token authentication (the head's default)
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
UCX_ENV = {"UCX_NET_DEVICES": "lo"}  # NIXL's UCX: loopback only
PIECE = (
    8 << 20
)  # bytes per NIXL READ request / descriptor piece (the engine's default read size)
RAW_INFLIGHT = 4  # NIXL READ requests in flight (as the transports' default streams)


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a flat uint8 tensor (no copy)."""
    return t.view(-1).view(torch.uint8)


class Side:
    """One process's part of one system. Holders set ``info``; readers get the holder's."""

    info: Any = None

    def connect(self) -> None:
        """The blocking setup that every process of the group runs at the same time."""

    def prepare(self, version: int) -> None:
        """Untimed, before round ``version``."""

    def run(self, version: int) -> dict[str, Any]:
        """The timed part of round ``version``; returns extra figures (JSON-able)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the side holds (best effort: the process is exiting)."""


# ---- memcpy: the machine's limit -------------------------------------------------------------


class MemcpyReader(Side):
    """One process, one thread: ``copy_`` from seeded source tensors into the reader's own."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        source: dict[str, torch.Tensor],
        **_: Any,
    ) -> None:
        self.tensors = tensors
        self.source = source
        torch.set_num_threads(1)

    def run(self, version: int) -> dict[str, Any]:
        for src, dst in zip(self.source.values(), self.tensors.values(), strict=True):
            dst.copy_(src)
        return {}


# ---- raw socket ---------------------------------------------------------------------------------


class SocketHolder(Side):
    """A listener; one thread per reader's connection answers each ``G`` with every tensor's
    bytes, in order (``sendall`` straight from the tensors' memory)."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], n_readers: int, **_: Any
    ) -> None:
        self.views = [memory_of(t) for t in tensors.values()]
        self.stop = threading.Event()
        self.lst = socket.create_server(("127.0.0.1", 0), backlog=n_readers + 1)
        self.lst.settimeout(0.5)
        self.info = {"port": self.lst.getsockname()[1]}
        self.threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, name="accept", daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.lst.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self.threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(None)
            try:
                while not self.stop.is_set() and conn.recv(1) == b"G":
                    for v in self.views:
                        conn.sendall(v)
            except OSError:
                pass

    def run(self, version: int) -> dict[str, Any]:
        return {}  # the serving threads do the work

    def close(self) -> None:
        self.stop.set()
        self.lst.close()


class SocketReader(Side):
    def __init__(
        self, tensors: dict[str, torch.Tensor], info: dict, timeout: float, **_: Any
    ) -> None:
        self.views = [memory_of(t) for t in tensors.values()]
        self.port = info["port"]
        self.timeout = timeout
        self.sock: socket.socket | None = None

    def connect(self) -> None:
        self.sock = socket.create_connection(
            ("127.0.0.1", self.port), timeout=self.timeout
        )

    def run(self, version: int) -> dict[str, Any]:
        assert self.sock is not None
        baseline_pull(self.sock, self.views)
        return {}

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


# ---- torch.distributed (gloo) ---------------------------------------------------------------------


class GlooSide(Side):
    """Rank 0 is the holder, readers are ranks 1..N; every tensor moves as a uint8 view of its own
    memory. ``broadcast``: one ``dist.broadcast`` per tensor, in order (what a trainer that
    broadcasts its parameters does). ``p2p``: the holder posts one ``isend`` per (tensor, reader),
    each reader one ``irecv`` per tensor, then all wait."""

    def __init__(self, tensors: dict[str, torch.Tensor], rank: int, n_readers: int, options: dict, timeout: float,
                 mode: str, **_: Any) -> None:  # fmt: skip
        self.views = [bytes_view(t) for t in tensors.values()]
        self.rank, self.world = rank, n_readers + 1
        self.port = options["gloo_port"]
        self.timeout = timeout
        self.mode = mode

    def connect(self) -> None:
        import torch.distributed as dist

        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self.port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=self.timeout))  # fmt: skip

    def run(self, version: int) -> dict[str, Any]:
        import torch.distributed as dist

        if self.mode == "broadcast":
            for v in self.views:
                dist.broadcast(v, src=0)
        elif self.rank == 0:
            reqs = [
                dist.isend(v, dst=r) for v in self.views for r in range(1, self.world)
            ]
            for q in reqs:
                q.wait()
        else:
            reqs = [dist.irecv(v, src=0) for v in self.views]
            for q in reqs:
                q.wait()
        return {}

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


# ---- Ray object store ---------------------------------------------------------------------------


def _ray_init(options: dict) -> Any:
    import ray

    os.environ.update(RAY_ENV)
    ray.init(
        address=options["ray_address"],
        namespace="tensorhub-bench",
        logging_level="ERROR",
        log_to_driver=False,
        configure_logging=False,
    )  # one namespace: the readers find the holder's named actor
    return ray


def _mailbox_class(ray: Any) -> Any:
    """An async actor that passes object references from the holder to the readers (the usual
    way for Ray processes to share a reference: inside a list, so that it is borrowed, not
    fetched). Defined in a function so that Ray ships it by value."""

    class Mailbox:
        def __init__(self) -> None:
            self.boxes: dict[int, list] = {}
            self.events: dict[int, asyncio.Event] = {}

        def _event(self, version: int) -> asyncio.Event:
            return self.events.setdefault(version, asyncio.Event())

        async def put(self, version: int, box: list) -> None:
            self.boxes[version] = box
            self._event(version).set()

        async def get(self, version: int) -> list:
            await self._event(version).wait()
            return self.boxes[version]

        async def drop(self, version: int) -> None:
            self.boxes.pop(version, None)
            self.events.pop(version, None)

    return ray.remote(num_cpus=0)(Mailbox)


class RayHolder(Side):
    """``ray.put`` of the shard: a dict of torch tensors (Ray's default serialization of torch
    tensors) or of numpy ``uint8`` views of their memory (``numpy``: Ray's zero-copy path)."""

    def __init__(self, tensors: dict[str, torch.Tensor], options: dict, timeout: float, mode: str, group: str,
                 **_: Any) -> None:  # fmt: skip
        self.tensors = tensors
        self.options, self.timeout, self.mode = options, timeout, mode
        self.name = f"mailbox-{group}"
        self.info = {"mailbox": self.name}
        self.ray: Any = None
        self.mailbox: Any = None
        self.ref: Any = None
        self.version: int | None = None

    def connect(self) -> None:
        self.ray = _ray_init(self.options)
        self.mailbox = _mailbox_class(self.ray).options(name=self.name).remote()
        self.ray.get(
            self.mailbox.drop.remote(-1), timeout=self.timeout
        )  # up and answering

    def prepare(self, version: int) -> None:
        if (
            self.version is not None
        ):  # the readers are done with it: let the store free it
            self.ray.get(self.mailbox.drop.remote(self.version), timeout=self.timeout)
            self.ref, self.version = None, None

    def run(self, version: int) -> dict[str, Any]:
        if self.mode == "numpy":
            obj = {name: bytes_view(t).numpy() for name, t in self.tensors.items()}
        else:
            obj = self.tensors
        t0 = time.monotonic()
        self.ref = self.ray.put(obj)
        put_s = time.monotonic() - t0
        self.version = version
        self.ray.get(self.mailbox.put.remote(version, [self.ref]), timeout=self.timeout)
        return {"put_s": put_s}

    def close(self) -> None:
        if self.ray is not None:
            with contextlib.suppress(Exception):
                self.ray.shutdown()


class RayReader(Side):
    def __init__(self, tensors: dict[str, torch.Tensor], info: dict, options: dict, timeout: float, mode: str,
                 **_: Any) -> None:  # fmt: skip
        self.tensors = tensors
        self.name = info["mailbox"]
        self.options, self.timeout, self.mode = options, timeout, mode
        self.ray: Any = None
        self.mailbox: Any = None

    def connect(self) -> None:
        self.ray = _ray_init(self.options)
        deadline = time.monotonic() + self.timeout
        while (
            True
        ):  # the holder names the actor during its own connect: bounded wait for it
            try:
                self.mailbox = self.ray.get_actor(self.name)
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise BenchmarkError(
                        f"ray: no actor {self.name!r} after {self.timeout:g} s"
                    ) from None
                time.sleep(0.05)

    def run(self, version: int) -> dict[str, Any]:
        import numpy as np

        [ref] = self.ray.get(self.mailbox.get.remote(version), timeout=self.timeout)
        t0 = time.monotonic()
        got = self.ray.get(ref, timeout=self.timeout)
        get_s = time.monotonic() - t0
        for name, dst in self.tensors.items():
            if self.mode == "numpy":
                np.copyto(
                    bytes_view(dst).numpy(), got[name]
                )  # a read-only view of the store: copy it
            else:
                dst.copy_(got[name])
        del got, ref
        return {"get_s": get_s}

    def close(self) -> None:
        if self.ray is not None:
            with contextlib.suppress(Exception):
                self.ray.shutdown()


# ---- raw NIXL READ ----------------------------------------------------------------------------------


def _pieces(tensors: dict[str, torch.Tensor]) -> list[tuple[int, int, int]]:
    """(tensor index, byte offset, length) pieces of at most ``PIECE`` bytes, in order."""
    out = []
    for i, t in enumerate(tensors.values()):
        n = t.numel() * t.element_size()
        for off in range(0, n, PIECE):
            out.append((i, off, min(PIECE, n - off)))
    return out


def _requests(pieces: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Pieces grouped into requests of at most ``PIECE`` bytes (tiny tensors share one)."""
    reqs: list[list[tuple[int, int, int]]] = []
    size = PIECE
    for p in pieces:
        if size + p[2] > PIECE:
            reqs.append([])
            size = 0
        reqs[-1].append(p)
        size += p[2]
    return reqs


class NixlHolder(Side):
    """A bare NIXL agent (UCX backend, as the transports configure theirs) with every tensor
    registered; readers READ them one-sided."""

    def __init__(self, tensors: dict[str, torch.Tensor], group: str, **_: Any) -> None:
        self.agent = raw_nixl_agent(f"suite-holder-{group}-{os.getpid()}")
        self.dlist = raw_register(self.agent, list(tensors.values()))
        rows = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors.values()]
        self.info = {
            "name": self.agent.name,
            "meta": bytes(self.agent.get_agent_metadata()),
            "rows": rows,
        }

    def run(self, version: int) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self.dlist)


class NixlReader(Side):
    def __init__(self, tensors: dict[str, torch.Tensor], info: dict, index: int, group: str, timeout: float,
                 **_: Any) -> None:  # fmt: skip
        self.timeout = timeout
        self.agent = raw_nixl_agent(f"suite-reader{index}-{group}-{os.getpid()}")
        regions = list(tensors.values())
        self.dlist = raw_register(self.agent, regions)
        self.peer = self.agent.add_remote_agent(info["meta"])
        if isinstance(self.peer, bytes):
            self.peer = self.peer.decode()
        rows = info["rows"]
        if len(rows) != len(regions):
            raise BenchmarkError(
                f"raw nixl: the holder has {len(rows)} tensors, this reader {len(regions)}"
            )
        self.reads = []
        for req in _requests(_pieces(tensors)):
            local = [(regions[i].data_ptr() + off, n, 0) for i, off, n in req]
            remote = [(rows[i][0] + off, n, 0) for i, off, n in req]
            self.reads.append((local, remote))

    def connect(self) -> None:  # the first READ makes the connection: untimed
        raw_nixl_pull(
            self.agent, self.peer, self.reads[:1], 1, time.monotonic() + self.timeout
        )

    def run(self, version: int) -> dict[str, Any]:
        raw_nixl_pull(
            self.agent,
            self.peer,
            self.reads,
            RAW_INFLIGHT,
            time.monotonic() + self.timeout,
        )
        return {"requests": len(self.reads)}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self.dlist)


# ---- the verified-copy floor: what any design that gives each reader its own verified copy does -----

FLOOR_PIECE = 1 << 20  # bytes per process_vm_readv and per hash (the local transport's piece)
_FLOOR_POLL = (50e-6, 1e-3)  # a reader's first and longest sleep while it waits for the checksums


def floor_pieces(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(address, nbytes)`` pieces of at most :data:`FLOOR_PIECE` bytes of each ``(address,
    nbytes)`` span (a tensor), in order: a piece never crosses tensors, so holder and reader
    cut alike."""
    return [(base + off, min(FLOOR_PIECE, n - off)) for base, n in spans for off in range(0, n, FLOOR_PIECE)]


def _spans(tensors: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors.values()]


def _piece_hashes(pieces: list[tuple[int, int]], out: Any, lo: int, hi: int) -> None:
    import ctypes

    import xxhash

    for k in range(lo, hi):
        address, n = pieces[k]
        out[k] = xxhash.xxh3_64_intdigest((ctypes.c_char * n).from_address(address))


def _floor_threads(most: int) -> int:
    return max(1, min(most, len(os.sched_getaffinity(0))))


class VerifiedCopyHolder(Side):
    """The publisher of the floor: each round it hashes its shard once (xxh3-64 of each piece, split
    over as many threads as TensorHub's publisher uses: the cores, up to 8) and posts the
    checksums in its own memory, the round's number last; readers read them with
    ``process_vm_readv``. No server, no messages, no description: nothing but the passes over
    memory that verification needs (the publisher's hash, each reader's copy and hash)."""

    def __init__(self, tensors: dict[str, torch.Tensor], **_: Any) -> None:
        import numpy as np
        from concurrent.futures import ThreadPoolExecutor

        self.tensors = tensors  # the pieces are addresses in them
        self.pieces = floor_pieces(_spans(tensors))
        self.posted = np.zeros(1 + len(self.pieces), dtype=np.uint64)  # [0]: round posted; then the checksums
        self.threads = _floor_threads(8)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="floor-hash")
        self.info = {"pid": os.getpid(), "posted": int(self.posted.ctypes.data), "pieces": len(self.pieces),
                     "tensors": [list(span) for span in _spans(tensors)]}  # fmt: skip

    def prepare(self, version: int) -> None:
        self.posted[0] = 0

    def run(self, version: int) -> dict[str, Any]:
        sums = self.posted[1:]
        n, k = len(self.pieces), self.threads
        cuts = [n * i // k for i in range(k + 1)]
        futures = [self.pool.submit(_piece_hashes, self.pieces, sums, cuts[i], cuts[i + 1]) for i in range(1, k)]
        _piece_hashes(self.pieces, sums, cuts[0], cuts[1])
        for f in futures:
            f.result()
        self.posted[0] = version  # after the checksums (x86 keeps stores in order)
        return {}

    def close(self) -> None:
        self.pool.shutdown()


class VerifiedCopyReader(Side):
    """A reader of the floor: ``process_vm_readv`` of the holder's tensors into its own, piece by
    piece on as many threads as ``local``'s copy workers (the cores, up to 4), each piece hashed
    right after it landed (still in the core's cache); then it waits for the holder's checksums
    and compares every piece. A mismatch fails the round."""

    def __init__(self, tensors: dict[str, torch.Tensor], info: dict, timeout: float, **_: Any) -> None:
        import numpy as np
        from concurrent.futures import ThreadPoolExecutor

        self.timeout = timeout
        self.pid, self.posted = int(info["pid"]), int(info["posted"])
        theirs = [(int(a), int(n)) for a, n in info["tensors"]]
        if [n for _, n in theirs] != [n for _, n in _spans(tensors)]:
            raise BenchmarkError("verified copy: the holder's tensors differ from this reader's")
        self.tensors = tensors  # the pieces are addresses in them
        self.local, self.remote = floor_pieces(_spans(tensors)), floor_pieces(theirs)
        if len(self.remote) != int(info["pieces"]):
            raise BenchmarkError("verified copy: the holder cuts its shard into other pieces")
        self.digests = np.zeros(len(self.local), dtype=np.uint64)
        self.words = np.zeros(1 + len(self.local), dtype=np.uint64)
        self.threads = _floor_threads(4)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="floor-copy")

    def _copy(self, lo: int, hi: int) -> None:
        import ctypes

        import xxhash

        from tensorhub.transports.local import _vm_read

        for k in range(lo, hi):
            (dst, n), src = self.local[k], self.remote[k]
            _vm_read(self.pid, [(dst, n)], [src])
            self.digests[k] = xxhash.xxh3_64_intdigest((ctypes.c_char * n).from_address(dst))

    def run(self, version: int) -> dict[str, Any]:
        from tensorhub.transports.local import _vm_read

        n = len(self.local)
        parts = [(lo, min(lo + 4, n)) for lo in range(0, n, 4)]  # 4 MiB parts on a shared queue, as local's
        for f in [self.pool.submit(self._copy, lo, hi) for lo, hi in parts]:
            f.result()
        deadline, delay = time.monotonic() + self.timeout, _FLOOR_POLL[0]
        first = (self.words.ctypes.data, 8)
        while True:
            _vm_read(self.pid, [first], [(self.posted, 8)])
            if int(self.words[0]) == version:
                break
            if time.monotonic() > deadline:
                raise BenchmarkError(f"verified copy: the holder posted no checksums for round {version} in {self.timeout:g} s")
            time.sleep(delay)
            delay = min(2 * delay, _FLOOR_POLL[1])
        _vm_read(self.pid, [(self.words.ctypes.data, 8 * (n + 1))], [(self.posted, 8 * (n + 1))])
        bad = int((self.words[1:] != self.digests).sum())
        if bad or int(self.words[0]) != version:
            raise BenchmarkError(f"verified copy: {bad} of {n} pieces differ from the holder's checksums (round {version})")
        return {"pieces": n}

    def close(self) -> None:
        self.pool.shutdown()


# ---- Mooncake transfer engine (tcp) ------------------------------------------------------------------


def _mooncake_engine() -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise BenchmarkError(f"mooncake: TransferEngine.initialize returned {rc}")
    return engine


def _mooncake_register(
    engine: Any, tensors: dict[str, torch.Tensor]
) -> list[tuple[int, int]]:
    rows = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors.values()]
    rc = engine.batch_register_memory([a for a, _ in rows], [n for _, n in rows])
    if rc != 0:
        raise BenchmarkError(f"mooncake: batch_register_memory returned {rc}")
    return rows


class MooncakeHolder(Side):
    """Mooncake's transfer engine, P2P handshake (no metadata server), ``tcp`` protocol, every
    tensor registered; readers issue one batch read of all of them."""

    def __init__(self, tensors: dict[str, torch.Tensor], **_: Any) -> None:
        self.engine = _mooncake_engine()
        rows = _mooncake_register(self.engine, tensors)
        self.info = {"target": f"127.0.0.1:{self.engine.get_rpc_port()}", "rows": rows}

    def run(self, version: int) -> dict[str, Any]:
        return {}


class MooncakeReader(Side):
    def __init__(self, tensors: dict[str, torch.Tensor], info: dict, **_: Any) -> None:
        self.engine = _mooncake_engine()
        local = _mooncake_register(self.engine, tensors)
        remote = info["rows"]
        if [n for _, n in local] != [n for _, n in remote]:
            raise BenchmarkError(
                "mooncake: the holder's tensors differ from this reader's"
            )
        pieces = [(la + off, ra + off, min(PIECE, n - off)) for (la, n), (ra, _) in zip(local, remote, strict=True)
                  for off in range(0, n, PIECE)]  # fmt: skip
        self.target = info["target"]
        self.local = [p[0] for p in pieces]
        self.remote = [p[1] for p in pieces]
        self.lengths = [p[2] for p in pieces]

    def connect(self) -> None:  # opens the segment (the handshake): untimed
        rc = self.engine.transfer_sync_read(
            self.target, self.local[0], self.remote[0], min(self.lengths[0], 4096)
        )
        if rc != 0:
            raise BenchmarkError(
                f"mooncake: the first read from {self.target} returned {rc}"
            )

    def run(self, version: int) -> dict[str, Any]:
        rc = self.engine.batch_transfer_sync_read(
            self.target, self.local, self.remote, self.lengths
        )
        if rc != 0:
            raise BenchmarkError(
                f"mooncake: batch_transfer_sync_read from {self.target} returned {rc}"
            )
        return {"pieces": len(self.lengths)}


# ---- TensorHub ------------------------------------------------------------------------------------


class _ReadSpans:
    """Instrumentation of one transport class in a reader process: when each ``read`` started
    and ended (monotonic), to split a pull into data plane and the rest."""

    def __init__(self, name: str) -> None:
        from tensorhub.transports.registry import get_transport

        cls = get_transport(name)
        original = cls.read
        self.spans: list[tuple[float, float]] = []
        spans = self.spans

        async def read(transport: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                return await original(transport, *args, **kwargs)
            finally:
                spans.append((t0, time.monotonic()))

        cls.read = read

    def summary(self, start: float, end: float) -> dict[str, Any]:
        spans = sorted(self.spans)
        self.spans.clear()
        if not spans:
            return {"reads": 0}
        busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
        for s, e in spans[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        return {"reads": len(spans), "first_read_s": spans[0][0] - start, "after_last_read_s": end - cur_e,
                "reads_busy_s": busy}  # fmt: skip


def _tensorhub_transports(name: str) -> dict[str, dict]:
    """``local-shm`` is the ``local`` transport with every side's tensors registered in shared
    memory (``register(..., shared_memory=True)``: readers map and ``memmove``)."""
    if name == "local-shm":
        return {"local": {"host": "127.0.0.1"}}
    return {name: {"host": "127.0.0.1"}} if name in ("tcp", "local") else {name: {}}


class TensorHubHolder(Side):
    """A trainer: ``tensorhub.open`` + ``register`` once; each round ``publish(version)`` (timed:
    the readers' clock starts with it) after an untimed ``unpublish`` of the previous one."""

    def __init__(self, tensors: dict[str, torch.Tensor], options: dict, group: str, timeout: float, transport: str,
                 **_: Any) -> None:  # fmt: skip
        import tensorhub

        self.timeout = timeout
        self.handle = tensorhub.open(group, "trainer", server=options["tensorhub_server"], retain=None,
                                     transports=_tensorhub_transports(transport))  # fmt: skip
        self.handle.register(tensors, shared_memory=transport == "local-shm")
        self.info = {"model": group}

    def prepare(self, version: int) -> None:
        if self.handle.version is not None:
            self.handle.unpublish()

    def run(self, version: int) -> dict[str, Any]:
        t0 = time.monotonic()
        self.handle.publish(version)
        return {"publish_s": time.monotonic() - t0}

    def close(self) -> None:
        self.handle.close()


class TensorHubReader(Side):
    """A rollout worker: ``open`` + ``register`` its preallocated tensors once; each round
    ``replicate(version)`` (which waits for the version to be published, then pulls, verifies
    against the publisher's checksums and unpacks) after an untimed ``unpublish`` and zeroing."""

    def __init__(self, tensors: dict[str, torch.Tensor], info: dict, index: int, options: dict, timeout: float,
                 transport: str, **_: Any) -> None:  # fmt: skip
        import tensorhub

        self.timeout = timeout
        self.spans = _ReadSpans(next(iter(_tensorhub_transports(transport))))
        self.handle = tensorhub.open(info["model"], f"reader-{index}", server=options["tensorhub_server"], retain=None,
                                     transports=_tensorhub_transports(transport))  # fmt: skip
        self.handle.register(tensors, shared_memory=transport == "local-shm")

    def prepare(self, version: int) -> None:
        if self.handle.version is not None:
            self.handle.unpublish()  # before the tensors are zeroed: the mutability contract

    def run(self, version: int) -> dict[str, Any]:
        start = time.monotonic()
        self.handle.replicate(version, timeout=self.timeout)
        end = time.monotonic()
        out = self.spans.summary(start, end)
        stats = self.handle.last_pull
        if stats is not None:
            out.update(grants=stats.grants, sources=list(stats.sources), transports=list(stats.transports),
                       verify_s=stats.verify_s)  # fmt: skip
        return out

    def close(self) -> None:
        self.handle.close()


# ---- the systems ------------------------------------------------------------------------------------


class System:
    """A row of the report: how to build its holder and reader sides, and what it needs."""

    def __init__(self, name: str, part: str, holder: Any, reader: Any, needs: str | None = None,
                 describe: str = "", source: bool = False, env: dict[str, str] | None = None, **extra: Any) -> None:  # fmt: skip
        self.name, self.part = name, part
        self.env = env or {}  # set in its processes before anything is imported
        self.source = source  # the reader process holds the seeded source too (memcpy)
        self.holder, self.reader = holder, reader
        self.needs = needs  # a module that must import, else the system is skipped
        self.describe = describe
        self.extra = extra  # keyword arguments for both sides (mode, transport)

    def missing(self) -> str | None:
        """Why this system cannot run here, or None."""
        if self.needs is None:
            return None
        if self.needs == "nixl":
            from tensorhub.transports.nixl import load_nixl

            return (
                None
                if load_nixl() is not None
                else "NIXL is not installed (pip install nixl-cu12)"
            )
        try:
            __import__(self.needs)
        except Exception as err:  # noqa: BLE001 - absent or broken: either way it cannot run
            return f"{self.needs} does not import here ({type(err).__name__}: {err}); pip install -e .[bench]"
        return None


def systems(tensorhub_transports: list[str]) -> list[System]:
    """Every system the suite knows, in report order."""
    out = [System(f"tensorhub[{t}]", "tensorhub", TensorHubHolder, TensorHubReader,
                  needs="nixl" if t in ("nixl", "rdma_copy") else None,
                  describe=f"TensorHub: publish + replicate through a reference server, `{t}` transport" if t != "local-shm"
                  else "TensorHub: publish + replicate through a reference server, `local` transport, every side's tensors "
                       "registered in shared memory (readers map the holder's files and `memmove`; a reader's RSS counts "
                       "the holder's pages it maps, which are shared, not copies)",
                  env=UCX_ENV, transport=t) for t in tensorhub_transports]  # fmt: skip
    out += [
        System("memcpy", "memcpy", None, MemcpyReader, source=True, describe="one-thread torch `copy_` in one process: the machine's limit"),
        System("raw socket", "socket", SocketHolder, SocketReader, describe="one TCP connection per reader, `sendall` / `recv_into` the tensors"),
        System("gloo broadcast", "gloo", GlooSide, GlooSide, describe="torch.distributed gloo, one `broadcast` per tensor", mode="broadcast"),
        System("gloo p2p", "gloo", GlooSide, GlooSide, describe="torch.distributed gloo, `isend` per (tensor, reader) / `irecv`", mode="p2p"),
        System("ray torch", "ray", RayHolder, RayReader, needs="ray", env=RAY_ENV, describe="Ray object store: `put` a dict of torch tensors, `get`, `copy_`", mode="torch"),
        System("ray numpy", "ray", RayHolder, RayReader, needs="ray", env=RAY_ENV, describe="Ray object store: `put` numpy views, zero-copy `get`, copy into the tensors", mode="numpy"),
        System("verified copy", "floor", VerifiedCopyHolder, VerifiedCopyReader,
               describe="the floor of a verified copy per reader: the holder hashes once, each reader `process_vm_readv`s "
                        "and hashes every 1 MiB piece, then compares (no server, no messages)"),
        System("raw nixl", "nixl", NixlHolder, NixlReader, needs="nixl", env=UCX_ENV, describe=f"bare NIXL agents (UCX), one-sided READ, {RAW_INFLIGHT} requests of <= 8 MiB in flight"),
        System("mooncake", "mooncake", MooncakeHolder, MooncakeReader, needs="mooncake.engine",
               env={"GLOG_minloglevel": "2"}, describe="Mooncake transfer engine (P2P handshake, tcp), one batch read"),
    ]  # fmt: skip
    return out


# ---- the helper process ----------------------------------------------------------------------------


def side_main(conn: Any, role: str, system: System, spec: Spec, seed: int, index: int, n_readers: int,
              expected: list[int], options: dict, group: str, timeout: float) -> None:  # fmt: skip
    """The body of a holder (``role`` "holder", rank 0) or reader (index ``index``, rank
    ``index + 1``) process. See the module docstring."""
    side: Side | None = None
    os.environ.update(system.env)
    try:
        if system.needs and system.needs != "nixl":
            __import__(system.needs)
        import tensorhub  # noqa: F401 - code is imported before the base of the memory figure

        tensors = allocate(spec)
        if role == "holder":
            fill_seeded(tensors, seed)
        source = None
        if (
            system.source and role != "holder"
        ):  # memcpy: the seeded source lives in the reader's process
            source = allocate(spec)
            fill_seeded(source, seed)
        base = status_bytes("VmRSS")
        meter = PeakRss()
        kw = dict(tensors=tensors, spec=spec, seed=seed, index=index, rank=0 if role == "holder" else index + 1,
                  n_readers=n_readers, options=options, group=group, timeout=timeout, source=source, **system.extra)  # fmt: skip
        if role == "holder":
            side = system.holder(info=None, **kw)
        conn.send(("ready", side.info if side is not None else None, base))

        for _ in range(
            1 << 20
        ):  # one command at a time until quit (or the parent is gone)
            if not conn.poll(1.0):
                if os.getppid() == 1:
                    return
                continue
            cmd = conn.recv()
            if cmd[0] == "quit":
                return
            if (
                cmd[0] == "connect"
            ):  # a reader builds its side here: it needs the holder's info
                if side is None:
                    side = system.reader(info=cmd[1], **kw)
                side.connect()
                conn.send(("connected",))
            elif cmd[0] == "prepare":
                side.prepare(cmd[1])
                if role != "holder":
                    for t in tensors.values():
                        t.zero_()
                conn.send(("prepared",))
            elif cmd[0] == "go":
                _, version, start_at = cmd
                time.sleep(max(0.0, start_at - time.monotonic()))
                started = time.monotonic()
                extra = side.run(version)
                ended = time.monotonic()
                bad: list[str] = []
                if role != "holder":
                    got = hashes_of(tensors)
                    bad = [
                        n
                        for n, a, b in zip(tensors, got, expected, strict=True)
                        if a != b
                    ]
                conn.send(("done", started, ended, extra, bad))
            elif cmd[0] == "memory":
                conn.send(("memory", base, meter.peak(), meter.method))
            else:
                raise BenchmarkError(f"{role}: unknown command {cmd[0]!r}")
    except Exception:  # noqa: BLE001 - the parent reports it and stops the group
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        if side is not None:
            try:
                side.close()
            except Exception as err:  # noqa: BLE001 - exiting anyway; say so
                print(f"{role}: close failed: {err!r}", file=sys.stderr)


def ray_head_main(conn: Any, store_bytes: int) -> None:
    """A process that starts a one-node Ray cluster on 127.0.0.1 and keeps it until ``quit``."""
    try:
        os.environ.update(RAY_ENV)
        import ray

        ctx = ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=1, logging_level="ERROR",
                       log_to_driver=False, object_store_memory=store_bytes, configure_logging=False)  # fmt: skip
        conn.send(("ready", ctx.address_info["gcs_address"]))
        for _ in range(1 << 30):
            if conn.poll(1.0):
                break
            if os.getppid() == 1:
                break
        ray.shutdown()
    except Exception:  # noqa: BLE001 - the parent reports it
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
