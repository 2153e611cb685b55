"""Real processes for integration tests: a reference server subprocess, and shard handles in
worker processes driven by commands.

Workers come from one forkserver that preloads torch and the handle API, so each costs a fork,
not a torch import. A :class:`RemoteHandle` sends a command (a method name and arguments) to
its worker and returns the result, or raises the typed TensorHub error the worker got.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import re
import signal
import subprocess
import sys
import time
from typing import Any

import torch

SHAPES = {"embed": (64, 32), "w1": (32, 128), "b1": (128,), "w2": (128, 32), "norm": (32,)}

_ctx = None


def mp() -> Any:
    """The forkserver context (preloading torch and tensorhub once for all workers)."""
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(["torch", "tensorhub.handles.api", "tests.procs"])
    return _ctx


def weights(version: int, shard: int = 0, scale: int = 1) -> dict[str, torch.Tensor]:
    """The expected content of ``version`` of shard ``shard`` (deterministic)."""
    g = torch.Generator().manual_seed(1_000_003 * version + shard)
    return {name: torch.randn(tuple(d * scale if i == 0 else d for i, d in enumerate(shape)), generator=g)
            for name, shape in SHAPES.items()}  # fmt: skip


def zeros_like_weights(shard: int = 0, scale: int = 1) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in weights(0, shard, scale).items()}


def holds(tensors: dict[str, torch.Tensor], version: int, shard: int = 0, scale: int = 1) -> bool:
    want = weights(version, shard, scale)
    return all(torch.equal(tensors[k], want[k]) for k in want)


# ---- the server ------------------------------------------------------------------------------


class ServerProcess:
    """``python -m tensorhub server`` on a random loopback port."""

    def __init__(self, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorhub", "server", "--bind", "tcp://127.0.0.1:*", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        match = re.search(r"listening on (tcp://\S+)", line)
        if not match:
            self.stop()
            raise RuntimeError(f"server did not start: {line!r} {self.stderr()}")
        self.address = match.group(1)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return ""
        return self.proc.stderr.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        return self.proc.returncode


# ---- workers ---------------------------------------------------------------------------------


def _worker(cmds: Any, results: Any, open_kw: dict) -> None:
    import tensorhub
    from tensorhub.core.errors import TensorHubError

    for key, value in open_kw.pop("env", {}).items():  # None: unset it
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    scale = open_kw.pop("scale", 1)
    shard = open_kw.get("shard_idx", 0)
    try:
        h = tensorhub.open(**open_kw)
    except TensorHubError as err:
        results.put(("err", type(err).__name__, str(err)))
        return
    results.put(("ok", h.session))
    tensors: dict[str, torch.Tensor] = {}
    for _ in range(100_000):
        cmd, args = cmds.get()
        try:
            if cmd == "exit":
                results.put(("ok", None))
                return
            if cmd == "register":
                tensors = zeros_like_weights(shard, scale)
                value = h.register(tensors)
            elif cmd == "fill":  # write version ``args[0]``'s content into the buffers
                for k, v in weights(args[0], shard, scale).items():
                    tensors[k].copy_(v)
                value = None
            elif cmd == "holds":
                value = holds(tensors, args[0], shard, scale)
            elif cmd == "wait_for":
                value = sorted(h.wait(lambda vs, v=args[0]: v in vs, timeout=args[1]))
            elif cmd == "corrupt":  # flip one byte of the served copy (bit rot behind our back)
                (view,) = h.buffers.views(args[0], 1)
                view[0] ^= 0xFF
                value = None
            elif cmd == "fired":  # what the fault-injecting wrapper did
                value = [f.op for t in h._engine.transports.values() for f in getattr(t, "fired", [])]
            elif cmd == "pulled":  # bytes the latest pull landed (re-reads count again)
                value = h.last_pull.bytes if h.last_pull else 0
            elif cmd == "last_sources":
                value = list(h.last_pull.sources) if h.last_pull else []
            elif cmd == "hashed_on_landing":  # reads of the latest pull verified from landing digests
                value = h.last_pull.hashed_on_landing if h.last_pull else 0
            elif cmd == "packs":  # how the registered buffers keep their tiny tensors
                value = "in place" if h.buffers.packs_in_place else "copied" if h.buffers.packed else "none"
            elif cmd == "last_transports":  # the transport of each grant of the latest pull
                value = list(h.last_pull.transports) if h.last_pull else []
            elif cmd == "server_address":  # the server the handle is on now (None: failing over)
                value = h.server_address
            elif cmd == "state":  # (version held, empty)
                value = (h.version, h.empty)
            elif cmd == "register_placed":  # (placements by name): zeros of each local shape
                from tensorhub.reshard import torch_dtype

                placed = args[0]
                tensors = {n: torch.zeros(p.local_shape(), dtype=torch_dtype(p.placement.dtype)) for n, p in placed.items()}
                value = h.register(tensors, placed)
            elif cmd == "fill_tensors":  # {name: tensor}: copy into the registered tensors
                for k, v in args[0].items():
                    tensors[k].copy_(v)
                value = None
            elif cmd == "digests":  # sha256 of each registered tensor's bytes
                import hashlib

                value = {k: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                         for k, t in tensors.items()}  # fmt: skip
            elif cmd == "nudge":  # (seed, fraction): add 1 to that fraction of each tensor's elements
                g = torch.Generator().manual_seed(args[0])
                for t in tensors.values():
                    flat = t.view(-1)
                    idx = torch.randperm(flat.numel(), generator=g)[: int(flat.numel() * args[1])]
                    flat[idx] += 1
                value = None
            elif cmd == "settle_deltas":  # wait for the background delta of the last publish
                pub = h._delta_pub
                value = None if pub is None else (h._run(pub.settle()), list(pub.published), pub.failed)[1:]
            elif cmd == "last_delta":
                d = h.last_delta
                value = None if d is None else {"target": d.target, "versions": d.versions, "bytes": d.bytes,
                                                "full": d.full_bytes, "landed": d.landed, "error": d.error}  # fmt: skip
            elif cmd == "last_bucket":  # what the last pull restored from the bucket
                b = h.last_bucket
                value = None if b is None else {"version": b.version, "anchor": b.anchor, "deltas": [list(d) for d in b.deltas]}
            elif cmd == "delta_sources":  # the sources of the last delta pulled through the reader's side
                side = h._delta_reader.side if h._delta_reader is not None else None
                value = list(side.last_pull.sources) if side is not None and side.last_pull else []
            elif cmd == "last_conversion":
                c = h.last_conversion
                value = None if c is None else {"version": c.version, "failures": c.failures, "sources": list(c.sources),
                                                "peak": c.peak_bytes, "budget": c.budget, "tasks": c.tasks}  # fmt: skip
            else:
                value = getattr(h, cmd)(*args)
                if cmd == "list" and isinstance(value, dict):
                    value = {v: sorted(reps) for v, reps in value.items()}
            results.put(("ok", value, time.monotonic()))
        except TensorHubError as err:
            results.put(("err", type(err).__name__, str(err), time.monotonic()))


class RemoteError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class RemoteHandle:
    """A shard handle in a worker process."""

    def __init__(self, **open_kw: Any) -> None:
        ctx = mp()
        self.cmds = ctx.Queue()
        self.results = ctx.Queue()
        self.proc = ctx.Process(target=_worker, args=(self.cmds, self.results, open_kw), daemon=True)
        self.proc.start()
        self.session = self._result(60.0)

    def _result(self, timeout: float) -> Any:
        try:
            got = self.results.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"worker {self.proc.pid} gave no answer in {timeout} s") from None
        timed = 3 if got[0] == "ok" else 4  # command results end with the time they were done
        self.done_at: float | None = got[-1] if len(got) == timed else None
        if got[0] == "err":
            raise RemoteError(got[1], got[2])
        return got[1]

    def send(self, cmd: str, *args: Any) -> None:
        """Start a command; collect its result with :meth:`result`."""
        self.cmds.put((cmd, args))

    def result(self, timeout: float = 60.0) -> Any:
        return self._result(timeout)

    def call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        self.send(cmd, *args)
        return self.result(timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def exit(self) -> None:
        if self.proc.is_alive():
            self.cmds.put(("exit", ()))
            self.proc.join(20)
        if self.proc.is_alive():
            self.kill()
        self.cmds.close()
        self.results.close()


def wait_until(pred: Any, timeout: float, what: str, step: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class InprocServer:
    """A real server actor (real ROUTER socket) on a loop thread of the test process, so that
    the test can look into its table."""

    def __init__(self, **table: float) -> None:
        """``table``: TableConfig fields (heartbeat_interval, heartbeat_timeout, drain_timeout)."""
        from tensorhub.core.table import TableConfig
        from tensorhub.runtime.actor import LoopThread
        from tensorhub.runtime.server import ServerActor, ServerConfig

        self.loop = LoopThread("test-server")
        self.actor = ServerActor(ServerConfig(bind="tcp://127.0.0.1:*", seed=7, table=TableConfig(**table)))
        self.loop.run(self.actor.start())
        self.address = self.actor.address

    def _look(self, fn: Any) -> Any:
        async def get() -> Any:
            return fn(self.actor.table)

        return self.loop.run(get())

    def counts(self) -> dict[str, int]:
        return self._look(lambda t: t.counts())

    def stats(self) -> dict[str, int]:
        """The table's running totals (grants made, revoked, quarantined...)."""
        return self._look(lambda t: dict(t.stats))

    def checksums(self, model: str, version: int, shard: int = 0) -> tuple[int, ...] | None:
        """The checksums declared for a version's shard, once its publisher has hashed it."""

        def get(t: Any) -> Any:
            mo = t.models.get(model)
            ver = mo.versions.get(version) if mo is not None else None
            return ver.checksums.get(shard) if ver is not None else None

        return self._look(get)

    def close(self) -> None:
        self.loop.run(self.actor.stop())
        self.loop.close()
