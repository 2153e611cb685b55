"""Jobs on the emulated cluster (DESIGN §8): the worker program that runs inside a host's
namespace, and the orchestration that the cluster benchmarks share.

Theory of operation
-------------------
A benchmark builds a :class:`~benchmarks.cluster.Cluster`, opens a :class:`Job` on it, starts
the real server (``python -m tensorhub server --bind tcp://<host address>:5557 ...``) in one
host's namespace with :meth:`Job.server`, and real worker processes in others with
:meth:`Job.workers`. Each worker opens one shard with ``tensorhub.open_sync``, declares the
location ``(datacenter, host, "")`` of its host and starts only the ``tcp`` transport, bound to
its namespace's address: every byte crosses the emulated links (``local`` or shared memory
would bypass them: all namespaces share one kernel and one memory).

The worker program (``python benchmarks/cluster_jobs.py worker --role trainer|rollout ...``)
takes one command per line on stdin and writes one JSON object per line on stdout. Every
object carries ``event``, ``host``, ``replica``, ``shard``, ``role`` and ``t`` (CLOCK_MONOTONIC
seconds: one clock for all namespaces, since they share the kernel, so the orchestrator can
compare times taken in different processes).

========================  =====================================================================
command                   what the worker does, and what it prints
========================  =====================================================================
(start)                   open, register ``--size-bytes`` of tensors -> ``ready``
``publish V``             trainer: unpublish what it holds, write version V's content, publish
                          -> ``published`` (``version``, ``hash``, ``publish_s``,
                          ``unpublish_s``)
``series V0 K S``         trainer: ``publish`` V0 .. V0+K-1, one every S seconds (``stop``
                          ends it early) -> ``published`` each, then ``series-done``
``replicate V``           rollout: ``replicate(V)`` now (V an integer or ``latest``)
                          -> ``pulled``
``await V``               rollout: ``wait`` until V is listed (coordination, not counted), then
                          ``replicate(V)`` -> ``pulled``
``poll UNTIL SECONDS``    rollout: ``update("latest")``, then ``--poll-ms`` of "inference", and
                          again, until it holds a version >= UNTIL, SECONDS pass or ``stop``
                          -> ``pulled`` per version moved to, then ``poll-done``
``list``                  -> ``listing`` (``versions``: {version: [replica, ...]})
``exit``                  close the handle -> ``bye``, exit 0 (also at end of stdin)
========================  =====================================================================

``pulled`` holds ``version``, ``mode`` (replicate / await / poll), ``stall_s`` (seconds blocked
inside the ``replicate``/``update`` calls that got this version: for ``poll`` every call since
the previous move, the ones that returned False included), ``latency_s`` (from wanting it until
holding it: for ``replicate``/``await`` from the command / the end of the wait; for ``poll``
null: :meth:`Job.pulled` fills it in from the trainer's publish time), ``move_s`` (the call that
moved alone: for ``poll`` the ``update()`` that pulled; else ``stall_s``), ``calls``, ``t_want``, ``t_end``,
``bytes``, ``grants``, ``sources``, ``transports`` (``last_pull``) and ``hash`` (of the bytes it
holds, computed after the timed call; the trainer prints the same hash for each version).
A failed command prints ``error`` (``op``, ``type``, ``message``) and the worker goes on. With
``--progress-ms`` a thread prints ``progress`` (``version``, ``verified``, ``total``) whenever
the shard's verified prefix moves (read from the handle's progress counter).

**Weights.** By default a shard is float32 tensors and ``publish V`` rewrites every byte (the
version's number added to random base bytes): every version differs everywhere. With
``--change-fraction F`` (and ``--dtype bfloat16``, ``--seed S``) the trainer evolves its weights
as an RL step does: version 1 is seeded random weights (normal, std 0.02), and each later version
moves a seeded random ``F`` of the elements by one unit in the last place (their raw bits +-1;
which ones is drawn per version, tensor and shard from ``S``), so that consecutive versions
differ in about ``F`` of the elements and the same seed gives the same evolution in every run.
``published`` then also carries ``changed`` and ``elements`` (elements changed since the previous
version, of all). With ``--settle-deltas`` (a trainer opened with ``deltas``) ``publish V``
waits for the background delta of V before printing ``published``, which carries ``settle_s``,
``delta_published`` (V's delta was published) and ``delta_failed``. A rollout opened with
``deltas`` adds ``delta`` to ``pulled``: None where the update was a plain pull, else what the
handle's ``last_delta`` says (``versions``, ``bytes``, ``full_bytes``, ``landed``, ``error``,
``pull_s``, ``apply_s``) and ``sources``, where the last delta came from.

Options for ``open(...)`` go through unchanged with ``--open-kw JSON`` (``retain``, ``spot``,
...); a ``transports`` entry there is merged into the default ``{"tcp": {"host": <address>}}``
(``{"transports": {"tcp": {"streams": 1}}}`` adds to it); ``--default-transports`` passes no
``transports=`` at all, as a user who configures nothing (each transport then binds and
advertises by :func:`tensorhub.transports.nic.choose_address`: the interface that routes to the
server). ``ready`` carries ``advertised``: each transport's address in the registered endpoint.
Environment variables (``TENSORHUB_CHUNK_BYTES``...) go in ``env=``.

Invariants: every wait is bounded (a timeout names what did not happen, and the tail of the
process's log); the worker exits by itself after ``--max-seconds`` or when its stdin closes;
every process runs under :meth:`Cluster.run`, so the cluster's teardown kills whatever a
:class:`Job` did not stop. Logs (stderr of every process) go to files in the job's directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations are not evaluated at run time

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "benchmarks" / "cluster_jobs.py"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import BenchmarkError, median  # noqa: E402

__all__ = [
    "MIB",
    "CpuMeter",
    "Job",
    "JobError",
    "Proc",
    "Server",
    "burst",
    "chain_depth",
    "median",
    "publish",
    "publish_times",
    "rate_bytes",
    "worker_main",
]

SERVER_PORT = 5557
MIB = 1 << 20
_LISTENING = re.compile(r"listening on (tcp://\S+)")


class JobError(BenchmarkError):
    """A job could not measure honestly: a process died or printed an error, an event did not
    come in time, bytes differ from the trainer's."""


# ======================================================================================
# the worker program (runs inside a host's namespace)
# ======================================================================================


def _shapes(size_bytes: int, tensor_bytes: int, tiny: int) -> list[tuple[str, int]]:
    """``(name, float32 elements)`` of the shard: ``tiny`` 4 KiB tensors (packed together), then
    large tensors of ``tensor_bytes`` (the last one smaller) up to ``size_bytes`` in all."""
    out = [(f"norm{i}", 1024) for i in range(tiny)]
    left = max(4, size_bytes - 4096 * tiny)
    per = max(4, tensor_bytes)
    n = max(1, math.ceil(left / per))
    for i in range(n):
        nbytes = min(per, left - i * per)
        out.append((f"w{i:03d}", max(1, nbytes // 4)))
    return out


class _Worker:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.t_start = time.monotonic()
        self.out_lock = threading.Lock()
        self.commands: queue.Queue[str] = queue.Queue()
        self.h: Any = None
        self.tensors: dict[str, Any] = {}
        self.base: dict[str, Any] = {}
        self.total = 0
        self.stop_progress = threading.Event()
        self.content_version: int | None = None  # the version the evolving weights hold (--change-fraction)
        self.changed = 0  # elements changed by the last step of the evolution

    # ---- output ------------------------------------------------------------------------

    def emit(self, event: str, **fields: Any) -> None:
        rec = {"event": event, "host": self.a.host, "replica": self.a.replica, "shard": self.a.shard_idx,
               "role": self.a.role, "t": time.monotonic(), **fields}  # fmt: skip
        line = json.dumps(rec, default=str)
        with self.out_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def error(self, op: str, err: BaseException) -> None:
        self.emit("error", op=op, type=type(err).__name__, message=str(err)[:2000])

    # ---- setup -------------------------------------------------------------------------

    def open(self) -> None:
        import torch

        import tensorhub
        from tensorhub.core.topology import Location

        a = self.a
        kw: dict[str, Any] = json.loads(a.open_kw) if a.open_kw else {}
        if not isinstance(kw, dict):
            raise SystemExit("--open-kw must be a JSON object")
        transports: dict[str, dict] | None = {"tcp": {"host": a.addr}}
        for name, options in (kw.pop("transports", None) or {}).items():
            transports.setdefault(name, {}).update(options or {})
        if a.default_transports:  # what a user who configures nothing gets (addresses by the default rule)
            transports = None
        kw.setdefault("num_shards", a.num_shards)
        kw.setdefault("shard_idx", a.shard_idx)
        kw.setdefault("location", Location(datacenter=a.datacenter, host=a.host, nic=a.nic))
        t0 = time.monotonic()
        self.h = tensorhub.open(a.model, a.replica, server=a.server, transports=transports, **kw)
        t1 = time.monotonic()
        dtype = getattr(torch, a.dtype)
        per4 = 4 // torch.empty(0, dtype=dtype).element_size()  # elements per float32 element's bytes
        for name, numel in _shapes(a.size_bytes, a.tensor_bytes, a.tiny):
            self.tensors[name] = torch.zeros(numel * per4, dtype=dtype)
        if a.role == "trainer" and a.change_fraction <= 0:
            for i, (name, t) in enumerate(self.tensors.items()):
                g = torch.Generator().manual_seed(1_000_003 * (a.shard_idx + 1) + i)
                self.base[name] = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
        self.total = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self.h.register(self.tensors)
        endpoint = getattr(self.h, "_endpoint", None) or {}
        advertised = {name: f"{ep['host']}:{ep['port']}" if "host" in ep else ep.get("side")
                      for name, ep in endpoint.items() if isinstance(ep, dict)}  # fmt: skip
        self.emit("ready", bytes=self.total, tensors=len(self.tensors), open_s=t1 - t0, advertised=advertised,
                  register_s=time.monotonic() - t1, startup_s=time.monotonic() - self.t_start)  # fmt: skip
        if a.progress_ms > 0:
            threading.Thread(target=self._progress, daemon=True, name="progress").start()

    def content_hash(self) -> str:
        import torch
        import xxhash

        h = xxhash.xxh3_128()
        for t in self.tensors.values():
            h.update(t.view(-1).view(torch.uint8).numpy())  # raw bytes: numpy has no bfloat16
        return h.hexdigest()

    def _progress(self) -> None:
        last: tuple[Any, int] | None = None
        period = self.a.progress_ms / 1000
        while not self.stop_progress.wait(period):
            buffers = getattr(self.h, "buffers", None) if self.h is not None else None
            if buffers is None:
                continue
            _, version, verified = buffers.progress.snapshot()
            if (version, verified) != last:
                last = (version, verified)
                self.emit("progress", version=version, verified=verified, total=self.total)

    # ---- commands ----------------------------------------------------------------------

    def publish(self, version: int) -> None:
        import torch

        h = self.h
        t0 = time.monotonic()
        if h.version is not None:
            h.unpublish()
        t1 = time.monotonic()
        more: dict[str, Any] = {}
        if self.a.change_fraction > 0:
            self._evolve(version)
            more = {"changed": self.changed, "elements": sum(t.numel() for t in self.tensors.values())}
        else:
            for name, t in self.tensors.items():
                u8 = t.view(-1).view(torch.uint8)
                u8.copy_(self.base[name])
                u8.add_(version % 251)
        digest = self.content_hash()
        t2 = time.monotonic()
        h.publish(version)
        t3 = time.monotonic()
        pub = getattr(h, "_delta_pub", None)
        if self.a.settle_deltas and pub is not None:  # the version is announced once its delta is out
            h._run(pub.settle())
            more.update(settle_s=time.monotonic() - t3, delta_published=version in pub.published,
                        delta_failed=pub.failed)  # fmt: skip
        self.emit("published", version=version, hash=digest, unpublish_s=t1 - t0, publish_s=t3 - t2, t_published=t3,
                  **more)  # fmt: skip

    def _evolve(self, version: int) -> None:
        """Bring the tensors to ``version`` of the seeded evolution (see the module docstring):
        one step from the version before, else from version 1."""
        import torch

        a = self.a
        if self.content_version is None or self.content_version != version - 1 or version <= 1:
            for i, t in enumerate(self.tensors.values()):
                g = torch.Generator().manual_seed(a.seed * 7_919 + 1_000_003 * (a.shard_idx + 1) + i)
                t.copy_(torch.randn(t.numel(), generator=g).mul_(0.02).to(t.dtype))
            self.content_version, self.changed = 1, 0
        words = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        for v in range(self.content_version + 1, version + 1):
            changed = 0
            for i, t in enumerate(self.tensors.values()):
                g = torch.Generator().manual_seed(((a.seed * 1_000_003 + v) * 1_009 + a.shard_idx) * 4_099 + i)
                idx = (torch.rand(t.numel(), generator=g) < a.change_fraction).nonzero().view(-1)
                step = torch.randint(0, 2, (idx.numel(),), generator=g, dtype=torch.int64).mul_(2).sub_(1)
                bits = t.view(-1).view(words[t.element_size()])
                bits.index_copy_(0, idx, (bits.index_select(0, idx).to(torch.int64) + step).to(bits.dtype))
                changed += idx.numel()
            self.content_version, self.changed = v, changed

    def series(self, first: int, count: int, interval: float) -> None:
        t0 = time.monotonic()
        for k in range(count):
            due = t0 + k * interval
            if self._stop_requested(max(0.0, due - time.monotonic())):
                break
            self.publish(first + k)
        self.emit("series-done", last=self.h.version)

    def _stop_requested(self, wait: float) -> bool:
        """Sleep up to ``wait`` seconds; True if ``stop`` (or ``exit``) arrived meanwhile."""
        try:
            cmd = self.commands.get(timeout=wait) if wait > 0 else self.commands.get_nowait()
        except queue.Empty:
            return False
        if cmd.split()[:1] == ["exit"]:
            self.commands.put(cmd)  # the main loop exits after this command
        return True

    def _pulled(self, mode: str, version: int, stall: float, t_want: float | None, t_end: float,
                calls: int, move: float | None = None, delta_before: Any = None) -> None:  # fmt: skip
        p = self.h.last_pull
        digest = self.content_hash() if not self.a.no_hash else None
        d = getattr(self.h, "last_delta", None)
        delta = None
        if d is not None and d is not delta_before and d.target == version:  # this call planned a chain
            reader = getattr(self.h, "_delta_reader", None)
            side = reader.side if reader is not None else None
            delta = {"versions": list(d.versions), "bytes": d.bytes, "full_bytes": d.full_bytes, "landed": d.landed,
                     "error": d.error, "pull_s": d.pull_s, "apply_s": d.apply_s,
                     "sources": list(side.last_pull.sources) if side is not None and side.last_pull else []}  # fmt: skip
        self.emit("pulled", mode=mode, version=version, stall_s=stall,
                  latency_s=(t_end - t_want) if t_want is not None else None, t_want=t_want, t_end=t_end,
                  bytes=p.bytes if p else 0, grants=p.grants if p else 0, sources=list(p.sources) if p else [],
                  transports=list(p.transports) if p else [], reads=p.reads if p else 0,
                  verify_s=p.verify_s if p else 0.0, calls=calls, move_s=stall if move is None else move,
                  hash=digest, delta=delta)  # fmt: skip

    def replicate(self, spec: str, wait_first: bool) -> None:
        version: int | str = int(spec) if spec.lstrip("-").isdigit() else spec
        t_want = time.monotonic()
        if wait_first:
            if not isinstance(version, int):
                raise ValueError("await takes an integer version")
            self.h.wait(lambda vs, v=version: v in vs, timeout=self.a.call_timeout)
            t_want = time.monotonic()
        before = getattr(self.h, "last_delta", None)
        t0 = time.monotonic()
        got = self.h.replicate(version, timeout=self.a.call_timeout)
        t1 = time.monotonic()
        self._pulled("await" if wait_first else "replicate", got, t1 - t0, t_want, t1, 1, delta_before=before)

    def poll(self, until: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        period = self.a.poll_ms / 1000
        stall, calls, reason = 0.0, 0, "deadline"
        for _ in range(int(seconds / max(period, 1e-3)) + 2):  # bounded by count and by time
            before = getattr(self.h, "last_delta", None)
            t0 = time.monotonic()
            moved = self.h.update("latest", timeout=self.a.call_timeout)
            t1 = time.monotonic()
            stall += t1 - t0
            calls += 1
            if moved:
                self._pulled("poll", self.h.version, stall, None, t1, calls, t1 - t0, delta_before=before)
                stall, calls = 0.0, 0
            if self.h.version is not None and self.h.version >= until:
                reason = "reached"
                break
            if time.monotonic() >= deadline:
                break
            if self._stop_requested(min(period, max(0.0, deadline - time.monotonic()))):
                reason = "stopped"
                break
        self.emit("poll-done", reason=reason, held=self.h.version, calls=calls, stall_s=stall)

    def listing(self) -> None:
        versions = self.h.list()
        self.emit("listing", versions={str(v): sorted(r) for v, r in versions.items()})

    def run(self) -> int:
        threading.Thread(target=self._read_stdin, daemon=True, name="stdin").start()
        try:
            self.open()
        except BaseException as err:  # noqa: BLE001 -- reported to the orchestrator, then exit
            self.error("open", err)
            return 1
        deadline = self.t_start + self.a.max_seconds
        code = 0
        for _ in range(1_000_000):  # bounded by count and by --max-seconds
            left = deadline - time.monotonic()
            if left <= 0:
                self.emit("error", op="run", type="Timeout", message=f"--max-seconds {self.a.max_seconds:g} passed")
                code = 1
                break
            try:
                line = self.commands.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            words = line.split()
            if not words or words[0] == "stop":
                continue
            if words[0] == "exit":
                break
            try:
                self.dispatch(words)
            except Exception as err:  # noqa: BLE001 -- every failure is reported, the worker goes on
                self.error(words[0], err)
        self.stop_progress.set()
        self._close()
        self.emit("bye", code=code)
        return code

    def dispatch(self, words: list[str]) -> None:
        role, cmd, args = self.a.role, words[0], words[1:]
        if cmd == "list":
            self.listing()
        elif role == "trainer" and cmd == "publish" and len(args) == 1:
            self.publish(int(args[0]))
        elif role == "trainer" and cmd == "series" and len(args) == 3:
            self.series(int(args[0]), int(args[1]), float(args[2]))
        elif role == "rollout" and cmd in ("replicate", "await") and len(args) == 1:
            self.replicate(args[0], wait_first=cmd == "await")
        elif role == "rollout" and cmd == "poll" and len(args) == 2:
            self.poll(int(args[0]), float(args[1]))
        else:
            raise ValueError(f"unknown command for a {role}: {' '.join(words)!r}")

    def _read_stdin(self) -> None:
        for line in sys.stdin:
            self.commands.put(line.strip())
        self.commands.put("exit")

    def _close(self) -> None:
        if self.h is None:
            return
        done = threading.Event()

        def close() -> None:
            try:
                self.h.close()
            except Exception as err:  # noqa: BLE001 -- reported; the process exits anyway
                self.error("close", err)
            finally:
                done.set()

        threading.Thread(target=close, daemon=True, name="close").start()
        if not done.wait(15.0):
            self.emit("error", op="close", type="Timeout", message="close() did not return within 15 s")


def worker_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="cluster_jobs.py worker", description="one shard handle on a cluster host")
    p.add_argument("--role", choices=("trainer", "rollout"), required=True)
    p.add_argument("--server", required=True, help="the server's address (tcp://...)")
    p.add_argument("--host", required=True, help="this host's name (the location's host)")
    p.add_argument("--datacenter", required=True, help="this host's datacenter")
    p.add_argument("--addr", required=True, help="this host's address (the tcp transport binds it)")
    p.add_argument("--nic", default="")
    p.add_argument("--model", default="actor")
    p.add_argument("--replica", required=True)
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument("--shard-idx", type=int, default=0)
    p.add_argument("--size-bytes", type=int, required=True, help="bytes of tensors in this shard")
    p.add_argument("--tensor-bytes", type=int, default=16 * MIB, help="size of each large tensor")
    p.add_argument("--tiny", type=int, default=8, help="4 KiB tensors (packed together)")
    p.add_argument("--open-kw", default=None, help="more open() keyword arguments, as a JSON object")
    p.add_argument("--default-transports", action="store_true",
                   help="open with no transports= at all (the defaults, or $TENSORHUB_TRANSPORTS; no host/advertise)")
    p.add_argument("--poll-ms", type=float, default=100.0, help="'inference' between update() calls in poll mode")
    p.add_argument("--call-timeout", type=float, default=300.0, help="timeout of each replicate/update/wait call")
    p.add_argument("--progress-ms", type=float, default=0.0, help="print the verified prefix this often (0: never)")
    p.add_argument("--no-hash", action="store_true", help="do not hash the pulled bytes")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="the tensors' dtype")
    p.add_argument("--change-fraction", type=float, default=0.0,
                   help="trainer: evolve seeded weights, this fraction of elements changing per version (0: every byte)")
    p.add_argument("--seed", type=int, default=0, help="trainer: the seed of the evolving weights")
    p.add_argument("--settle-deltas", action="store_true",
                   help="trainer with deltas: print published once the version's delta is published")
    p.add_argument("--max-seconds", type=float, default=3600.0, help="exit after this long whatever happens")
    a = p.parse_args(argv)
    return _Worker(a).run()


# ======================================================================================
# orchestration (runs in the root namespace)
# ======================================================================================


class Proc:
    """A process started in a host's namespace: its stdout parsed line by line (JSON objects
    become events, other lines are kept as text), its stderr in a log file.

    Attributes:
        name: a label (``server``, the replica name...).
        host: the cluster host it runs on.
        popen: the process (``ip netns exec`` execs the command: same pid).
        events: the JSON objects it printed, in order.
        lines: its other stdout lines.
        log: the file holding its stderr.
    """

    def __init__(self, name: str, host: str, popen: subprocess.Popen, log: Path) -> None:
        self.name, self.host, self.popen, self.log = name, host, popen, log
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"read-{name}")
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            line = line.rstrip("\n")
            event = None
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
            with self._cond:
                if isinstance(event, dict):
                    self.events.append(event)
                else:
                    self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def mark(self) -> int:
        """The index of the next event (pass it to :meth:`wait_event` as ``since``)."""
        with self._cond:
            return len(self.events)

    def send(self, line: str) -> None:
        """Write one command line to its stdin."""
        if self.popen.stdin is None:
            raise JobError(f"{self.name} has no stdin")
        try:
            self.popen.stdin.write(line + "\n")
            self.popen.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as err:
            raise JobError(f"{self.name} on {self.host}: cannot send {line!r}: {err}; {self.tail()}") from err

    def tail(self, n: int = 15) -> str:
        """The last lines of its log (for error messages)."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            lines = []
        return f"log {self.log}: " + (" | ".join(lines) if lines else "(empty)")

    def wait_event(self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str, since: int = 0,
                   errors: bool = True) -> dict[str, Any]:  # fmt: skip
        """The first event at index >= ``since`` for which ``pred`` is true.

        Raises:
            JobError: none within ``timeout`` seconds, the process ended first, or (``errors``)
                it printed an ``error`` event first.
        """
        deadline = time.monotonic() + timeout
        i = since
        with self._cond:
            while True:
                while i < len(self.events):
                    ev = self.events[i]
                    i += 1
                    if pred(ev):
                        return ev
                    if errors and ev.get("event") == "error":
                        raise JobError(f"{self.name} on {self.host} failed while waiting for {what}: "
                                       f"{ev.get('op')}: {ev.get('type')}: {ev.get('message')}")  # fmt: skip
                if self._eof:
                    self.popen.poll()
                    raise JobError(f"{self.name} on {self.host} exited ({self.popen.returncode}) before {what}; {self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise JobError(f"{self.name} on {self.host}: no {what} within {timeout:g} s; {self.tail()}")
                self._cond.wait(min(left, 0.5))

    def expect(self, event: str, timeout: float, since: int = 0, **match: Any) -> dict[str, Any]:
        """The first ``event`` at index >= ``since`` whose fields equal ``match``."""
        what = event + (f" {match}" if match else "")
        return self.wait_event(lambda ev: ev.get("event") == event and all(ev.get(k) == v for k, v in match.items()),
                               timeout, what, since)  # fmt: skip

    def granted(self, version: int, since: int, timeout: float, what: str, min_verified: int = 0) -> dict[str, Any]:
        """The first ``progress`` event of ``version`` after mark ``since`` with at least
        ``min_verified`` bytes verified: the pull was granted (and got that far)."""
        return self.wait_event(lambda ev: ev.get("event") == "progress" and ev.get("version") == version
                               and ev.get("verified", 0) >= min_verified, timeout, what, since)  # fmt: skip

    def verified(self, version: int) -> int:
        """The most bytes of ``version`` this process reported verified so far (0: none yet)."""
        seen = [ev["verified"] for ev in list(self.events) if ev.get("event") == "progress" and ev.get("version") == version]
        return max(seen, default=0)

    def kill(self) -> None:
        """SIGKILL its process group (it runs in a session of its own)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    #: how it is asked to end: ``exit`` on stdin (None), or this signal first
    polite_signal: int | None = None

    def stop(self, timeout: float = 20.0) -> int | None:
        """Ask it to end (a worker: ``exit`` on stdin, and it closes its handle; the server:
        SIGTERM), wait up to ``timeout``, then SIGTERM and SIGKILL; returns its exit status
        (None if even SIGKILL did not end it)."""
        if self.alive and self.popen.stdin is not None:
            with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                if self.polite_signal is None:
                    self.popen.stdin.write("exit\n")
                self.popen.stdin.close()
        first = self.polite_signal
        for sig, wait in ((first, timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if sig is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self._reader.join(5.0)
        return self.popen.poll()


class Server(Proc):
    """The real ``tensorhub server`` in a host's namespace; ``address`` is what it listens on.
    It stops on SIGTERM."""

    address = ""
    polite_signal = signal.SIGTERM


class Job:
    """The processes of one benchmark on one cluster: a server or more, and workers.

    Args:
        cluster: an active :class:`~benchmarks.cluster.Cluster`.
        workdir: where logs go (default: a new temporary directory, removed at close unless
            ``keep_logs`` or a failure).
        env: environment variables for every worker (``TENSORHUB_CHUNK_BYTES``...).
        keep_logs: keep the directory of logs after close.
        fork_workers: start each worker as a fork of a server that imported torch once
            (:meth:`Cluster.fork <benchmarks.cluster.Cluster.fork>`) rather than as ``python
            cluster_jobs.py worker`` (seconds of CPU each); the same program either way.

    :meth:`close` (and leaving the ``with``) stops every process it started: ``exit`` first,
    signals after a bounded wait; the cluster's own teardown kills anything left.
    """

    def __init__(self, cluster: Any, workdir: str | Path | None = None, env: Mapping[str, str] | None = None,
                 keep_logs: bool = False, fork_workers: bool = True) -> None:  # fmt: skip
        self.cluster = cluster
        self._tmp = workdir is None
        self.dir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=f"{cluster.prefix}-job-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env or {})
        self.keep_logs = keep_logs
        self.fork_workers = fork_workers
        self.procs: list[Proc] = []
        self.failed = False

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.failed = True
        self.close()

    def _spawn(self, cls: type[Proc], name: str, host: str, argv: Sequence[str], env: Mapping[str, str]) -> Proc:
        log = self.dir / f"{name}.log"
        with open(log, "w") as err:
            if self.fork_workers and cls is Proc and list(argv[1:3]) == [str(WORKER), "worker"]:
                # the same program, forked from a server that imported torch once (netns_fork)
                popen = self.cluster.fork(host, "benchmarks.cluster_jobs:worker_main", argv[3:], log,
                                          env={"PYTHONUNBUFFERED": "1", **env}, cwd=ROOT)  # fmt: skip
            else:
                popen = self.cluster.run(host, list(argv), env={"PYTHONUNBUFFERED": "1", **env}, cwd=str(ROOT),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         bufsize=1)  # fmt: skip
        proc = cls(name, host, popen, log)
        self.procs.append(proc)
        return proc

    def server(self, host: str, flags: Sequence[str] = (), port: int = SERVER_PORT, name: str = "server",
               timeout: float = 30.0, log_level: str = "warning") -> Server:  # fmt: skip
        """Start ``python -m tensorhub server --bind tcp://<host address>:<port> <flags>`` in
        ``host``'s namespace and wait until it listens.

        Raises:
            JobError: it did not print its listening line within ``timeout`` seconds.
        """
        bind = f"tcp://{self.cluster.address(host)}:{port}"
        # the namespaces are private to this machine: no CURVE keys, so say so (a non-loopback bind needs it)
        argv = [sys.executable, "-m", "tensorhub", "server", "--bind", bind, "--insecure", "--log-level", log_level, *flags]
        srv = self._spawn(Server, name, host, argv, {})
        assert isinstance(srv, Server)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [m.group(1) for m in map(_LISTENING.search, list(srv.lines)) if m]
            if found:
                srv.address = found[0]
                return srv
            if not srv.alive:
                break
            time.sleep(0.05)
        raise JobError(f"the server on {host} did not listen on {bind} within {timeout:g} s: {srv.lines[-5:]} {srv.tail()}")

    def worker_argv(self, host: str, role: str, replica: str, server: str, size_bytes: int,
                    open_kw: Mapping[str, Any] | None = None, extra: Sequence[str] = ()) -> list[str]:  # fmt: skip
        c = self.cluster
        argv = [sys.executable, str(WORKER), "worker", "--role", role,
                "--server", server, "--host", host, "--datacenter", c.datacenter(host), "--addr", c.address(host),
                "--replica", replica, "--size-bytes", str(size_bytes)]  # fmt: skip
        if open_kw:
            argv += ["--open-kw", json.dumps(dict(open_kw))]
        return argv + list(extra)

    def workers(self, specs: Iterable[Mapping[str, Any]], timeout: float = 120.0) -> list[Proc]:
        """Start workers at once and wait until each is ``ready``.

        Args:
            specs: per worker: ``host``, ``role``, ``replica``, ``server`` (address),
                ``size_bytes``; optional ``open_kw`` (dict), ``extra`` (more worker options,
                e.g. ``["--poll-ms", "50"]``), ``env`` (on top of the job's), ``shard`` and
                ``num_shards`` (a model-parallel replica: one worker per shard; the process is
                named ``<replica>.<shard>``).
            timeout: for all of them to be ready (they import torch: seconds each, and they
                share the machine's cores).

        Raises:
            JobError: one failed to open or register, or was not ready in time.
        """
        started = []
        for s in specs:
            extra = list(s.get("extra", ()))
            if "shard" in s:
                extra += ["--num-shards", str(s["num_shards"]), "--shard-idx", str(s["shard"])]
            argv = self.worker_argv(s["host"], s["role"], s["replica"], s["server"], s["size_bytes"],
                                    s.get("open_kw"), extra)  # fmt: skip
            env = {**self.env, **s.get("env", {})}
            started.append(self._spawn(Proc, s["replica"] + (f".{s['shard']}" if "shard" in s else ""), s["host"], argv, env))
        deadline = time.monotonic() + timeout
        for p in started:
            p.expect("ready", max(1.0, deadline - time.monotonic()))
        return started

    def worker(self, host: str, role: str, replica: str, server: str, size_bytes: int, timeout: float = 120.0,
               **kw: Any) -> Proc:  # fmt: skip
        """One worker (see :meth:`workers`)."""
        spec = {"host": host, "role": role, "replica": replica, "server": server, "size_bytes": size_bytes, **kw}
        return self.workers([spec], timeout)[0]

    def stop(self, procs: Iterable[Proc], timeout: float = 20.0) -> None:
        """Stop these processes (all at once: ``exit`` to each, then wait for each)."""
        procs = list(procs)
        for p in procs:
            if p.alive and p.popen.stdin is not None and p.polite_signal is None:
                with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                    p.popen.stdin.write("exit\n")
                    p.popen.stdin.flush()
        for p in procs:
            p.stop(timeout)

    def close(self) -> None:
        workers = [p for p in self.procs if not isinstance(p, Server)]
        self.stop(workers)
        self.stop([p for p in self.procs if isinstance(p, Server)], timeout=5.0)
        if self._tmp and not self.keep_logs and not self.failed:
            for f in self.dir.iterdir():
                with contextlib.suppress(OSError):
                    f.unlink()
            with contextlib.suppress(OSError):
                self.dir.rmdir()

    def pulled(self, rollouts: Iterable[Proc], trainers: Iterable[Proc], since: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
        """Every ``pulled`` event of ``rollouts`` (from their ``since`` marks, by name), each with
        ``since_publish_s`` (its end minus the time the version became available: see
        :func:`publish_times`), and for ``poll`` records ``latency_s`` set to it."""
        published = publish_times(trainers)
        out = []
        for p in rollouts:
            for ev in p.events[(since or {}).get(p.name, 0):]:
                if ev.get("event") != "pulled":
                    continue
                ev = dict(ev)
                t_pub = published.get(ev["version"])
                ev["since_publish_s"] = ev["t_end"] - t_pub if t_pub is not None else None
                if ev.get("latency_s") is None:
                    ev["latency_s"] = ev["since_publish_s"]
                out.append(ev)
        return out


def publish_times(trainers: Iterable[Proc]) -> dict[int, float]:
    """When each version became available: per trainer replica, the last of its shards'
    ``published`` times; across replicas, the first."""
    per: dict[tuple[int, str], float] = {}
    for p in trainers:
        for ev in p.events:
            if ev.get("event") == "published":
                key = (ev["version"], ev["replica"])
                per[key] = max(per.get(key, 0.0), ev["t_published"])
    out: dict[int, float] = {}
    for (v, _), t in per.items():
        out[v] = min(out.get(v, math.inf), t)
    return out


def publish(trainers: Sequence[Proc], version: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    """``publish V`` on every trainer process (all at once); their ``published`` events."""
    marks = [p.mark() for p in trainers]
    for p in trainers:
        p.send(f"publish {version}")
    return [p.expect("published", timeout, since=m, version=version) for p, m in zip(trainers, marks)]


def burst(trainers: Sequence[Proc], rollouts: Sequence[Proc], version: int, timeout: float = 300.0,
          command: str = "replicate", cpu: CpuMeter | None = None) -> dict[str, Any]:  # fmt: skip
    """One burst: the trainers publish ``version``; once published, every rollout is told
    ``replicate V`` at once (the go; the publish is not counted); wait for every ``pulled``.

    Returns:
        ``{"version", "t_go", "published": [...], "pulled": [...] (in rollout order),
        "total_s": last rollout's end minus the go, "hash", "cpu"}`` (``cpu``: ``cpu``'s
        reading from the go to the last ``pulled``, or None).

    Raises:
        JobError: a rollout failed or did not finish within ``timeout``.
    """
    published = publish(trainers, version, timeout=min(timeout, 120.0))
    marks = [p.mark() for p in rollouts]
    if cpu is not None:
        cpu.start()
    t_go = time.monotonic()
    for p in rollouts:
        p.send(f"{command} {version}")
    deadline = time.monotonic() + timeout
    pulled = [p.expect("pulled", max(1.0, deadline - time.monotonic()), since=m, version=version)
              for p, m in zip(rollouts, marks)]  # fmt: skip
    return {"version": version, "t_go": t_go, "published": published, "pulled": pulled,
            "total_s": max(ev["t_end"] for ev in pulled) - t_go, "hash": published[0]["hash"],
            "cpu": cpu.stop() if cpu is not None else None}  # fmt: skip


def chain_depth(pulled: Iterable[Mapping[str, Any]]) -> int:
    """The depth of the replication DAG of one version among these pulls: 1 when every reader
    was served by a non-reader (the trainer), n for a chain of n readers (by first source)."""
    first = {ev["replica"]: (ev["sources"][0].split("/")[0] if ev.get("sources") else None) for ev in pulled}
    depth: dict[str, int] = {}

    def d(r: str, seen: frozenset[str]) -> int:
        if r in depth:
            return depth[r]
        src = first.get(r)
        k = 1 + (d(src, seen | {r}) if src in first and src not in seen else 0)
        depth[r] = k
        return k

    return max((d(r, frozenset()) for r in first), default=0)


def rate_bytes(rate: str) -> float:
    """A ``tc`` rate (``400mbit``, ``1gbit``, ``50mbps``) in bytes per second."""
    m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise ValueError(f"cannot read the rate {rate!r}")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    value = float(m.group(1)) * scale
    return value / 8 if m.group(3) == "bit" else value


class CpuMeter:
    """CPU use between :meth:`start` and :meth:`stop`, as a fraction of all the machine's cores
    (1.0 = every core busy): ``machine`` from ``/proc/stat`` (every process, ours or not: the
    namespaces share the cores, and other work on the machine shows here too) and ``job``, the
    user + system time of the given processes (the kernel's packet forwarding between
    namespaces runs partly in softirq context and is counted in ``machine`` only)."""

    def __init__(self, pids: Iterable[int] = ()) -> None:
        self.pids = list(pids)
        self._t0: tuple[float, int, int, int] | None = None

    @staticmethod
    def _machine() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0) + (fields[7] if len(fields) > 7 else 0)  # steal: not ours
        return sum(fields[:8]), idle

    def _job(self) -> int:
        ticks = 0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # gone: its time is lost (a killed process)
                continue
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks

    def start(self) -> None:
        total, idle = self._machine()
        self._t0 = (time.monotonic(), total, idle, self._job())

    def stop(self) -> dict[str, float]:
        """``{"machine": fraction, "job": fraction}`` since :meth:`start` (NaN if never started)."""
        if self._t0 is None:
            return {"machine": math.nan, "job": math.nan}
        t0, total0, idle0, job0 = self._t0
        total, idle = self._machine()
        dt, di = total - total0, idle - idle0
        wall = time.monotonic() - t0
        hz = os.sysconf("SC_CLK_TCK")
        ncpu = os.cpu_count() or 1
        return {"machine": (dt - di) / dt if dt > 0 else math.nan,
                "job": (self._job() - job0) / hz / (wall * ncpu) if wall > 0 else math.nan}  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "worker":
        sys.exit(worker_main(sys.argv[2:]))
    print("usage: python benchmarks/cluster_jobs.py worker --role trainer|rollout ... (see the module docstring)",
          file=sys.stderr)  # fmt: skip
    sys.exit(2)
