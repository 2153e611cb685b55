"""Processes a benchmark runs: the reference server (``python -m tensorhub server`` on a free
loopback port, started and stopped), helper processes spoken to over a pipe (:class:`Child`), and
the error every benchmark raises when it cannot measure honestly."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["BenchmarkError", "Child", "fork_server", "free_port", "in_checkout", "start_server", "stop_process"]


class BenchmarkError(RuntimeError):
    """The benchmark could not measure honestly (wrong bytes, a dead helper process, a call
    that answered wrongly...)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(timeout: float, *extra: str, echo_all: bool = True,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start a server (``extra``: more ``tensorhub server`` arguments; ``env``: more environment
    variables) and wait until it listens. Its output is relayed to stderr afterwards (only
    warnings and errors unless ``echo_all``)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "tensorhub", "server", "--bind", address, "--log-level", "warning", *extra]
    full_env = {**os.environ, **env} if env else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=full_env)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            seen.append(line)
            if "tensorhub server listening on" in line:
                threading.Thread(target=_relay, args=(proc.stdout, echo_all), daemon=True).start()
                return proc, address
        if proc.poll() is not None:
            break
    stop_process(proc)
    raise BenchmarkError(f"the server did not start at {address}: {''.join(seen)[-2000:]}")


def _relay(stream: Any, echo_all: bool) -> None:
    try:
        for line in stream:  # keep the pipe from filling up; show what the server complains about
            if echo_all or "warning" in line or "error" in line:
                sys.stderr.write("[server] " + line)
    except (ValueError, OSError):  # closed by stop_process
        pass


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s. Never raises for a process slow to go (a starved
    machine can take more than seconds to reap a big one): the caller has others to stop."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                sys.stderr.write(f"pid {proc.pid} still there 60 s after SIGKILL\n")
    if proc.stdout is not None:
        proc.stdout.close()


def in_checkout(script: str | os.PathLike[str], root: str | os.PathLike[str], args: list[str], timeout: float) -> Any:
    """Run ``script --child --tree ROOT *args`` in a fresh process that imports tensorhub from
    ``root`` (the checkout ``--against`` names, or this one) and return the JSON its last line of
    output holds: how the ``--against`` benchmarks measure two trees alternately.

    Raises:
        BenchmarkError: the process failed or printed no JSON (its stderr's tail is in the message).
    """
    cmd = [sys.executable, str(script), "--child", "--tree", str(root), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(root)},
                         check=False)  # fmt: skip
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise BenchmarkError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr[-2000:]}")
    try:
        return json.loads(lines[-1])
    except ValueError as err:
        raise BenchmarkError(f"{' '.join(cmd)} printed no JSON last: {lines[-1][:200]!r}") from err


def fork_server(*preload: str) -> Any:
    """The ``forkserver`` multiprocessing context, with the modules ``preload`` imported once in
    the server: a helper process then starts in a fraction of a second instead of importing torch
    again (seconds, on two cores). Nothing else (no thread, no agent, no loop) exists in the server
    when it forks. The preload of the call made before the first process starts holds."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


class Child:
    """The parent's end of a helper process, talking over a pipe: ``target(conn, *args)`` in the
    child. A child that fails answers ``("error", text)``. ``context``: the multiprocessing
    context that starts it (default ``spawn``; the suite passes its fork server)."""

    def __init__(self, name: str, target: Any, args: tuple, timeout: float, context: Any = None) -> None:
        ctx: Any = mp.get_context("spawn") if context is None else context
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.timeout = timeout
        self.proc.start()
        child.close()

    def expect(self, what: str, timeout: float | None = None) -> tuple:
        """The child's next message, which must be ``(what, ...)``; bounded by ``timeout``
        (default: the child's)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.conn.poll(0.2):
                try:
                    msg = self.conn.recv()
                except EOFError:
                    self.proc.join(5)
                    raise BenchmarkError(f"the {self.name} process died (exit code {self.proc.exitcode})") from None
                if msg[0] == "error":
                    raise BenchmarkError(f"the {self.name} process failed:\n{msg[1]}")
                if msg[0] != what:
                    raise BenchmarkError(f"the {self.name} process answered {msg[0]!r}, expected {what!r}")
                return msg
            if not self.proc.is_alive():
                raise BenchmarkError(f"the {self.name} process died (exit code {self.proc.exitcode})")
        raise BenchmarkError(f"the {self.name} process did not answer {what!r} within {limit:g} s")

    def send(self, *msg: Any) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError):
            pass

    def stop(self) -> None:
        self.send("quit")
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
