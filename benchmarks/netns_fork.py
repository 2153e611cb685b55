"""Processes forked into a host's namespace from a server that imported torch once.

``ip netns exec NS python worker.py`` costs a Python start and a torch import per process:
about 3 CPU-seconds each on this kind of machine, which was most of what a cluster test spent.
:func:`start` asks a ``forkserver`` (preloading ``torch``, ``tensorhub`` and the target's
module) for a child that then does what ``ip netns exec`` does before running the target:

- it enters the namespace (``setns(CLONE_NEWNET)`` on ``/var/run/netns/NS``);
- it takes a mount namespace of its own, marks ``/`` as a slave mount and mounts a fresh
  ``sysfs`` on ``/sys``, so that ``/sys/class/net`` lists the namespace's interfaces;
- it starts a session of its own (its pid is its process group, for ``killpg``);
- it takes the environment it is given, whole, and the working directory;
- stdin and stdout are pipes to the parent, stderr is the log file.

The result, :class:`ForkedProcess`, has the part of :class:`subprocess.Popen` that the cluster
code uses (``pid``, ``stdin``, ``stdout``, ``poll``, ``wait``, ``returncode``), so a test
cannot tell the two apart except by the time it saves. A child killed by a signal reports
``-signal`` as Popen does.

Modules imported by the fork server read environment variables at import time from the
server's environment, not the child's: the few that do (``TENSORHUB_SPANS``,
``TENSORHUB_FUSED_GPU_COPY``) are refused in ``env`` when they differ from the server's, rather
than silently ignored.
"""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing as mp
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

__all__ = ["ForkedProcess", "start"]

_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE = 0x4000, 0x80000
_MNT_DETACH = 2
_IMPORT_TIME_ENV = ("TENSORHUB_SPANS", "TENSORHUB_FUSED_GPU_COPY")
_ctx: Any = None


def _context(module: str) -> Any:
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        # one fork server per process: name every module a test's children may want
        _ctx.set_forkserver_preload(["torch", "tensorhub", "tensorhub.handles.api", module])
    return _ctx


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    for name in ("setns", "unshare", "mount", "umount2"):
        getattr(libc, name).restype = ctypes.c_int
    return libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _enter(ns: str) -> None:
    """What ``ip netns exec`` does before it execs (iproute2's ``netns_switch``)."""
    libc = _libc()
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(libc.setns(fd, _CLONE_NEWNET), f"setns into {ns}")
    finally:
        os.close(fd)
    _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(b"", b"/", b"none", _MS_SLAVE | _MS_REC, None), "mount / as a slave")
    libc.umount2(b"/sys", _MNT_DETACH)  # absent or busy: the fresh mount still lands on top
    _check(libc.mount(ns.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


def _child(ns: str, env: dict[str, str], cwd: str, log: str, stdin: Any, stdout: Any, target: str,
           argv: list[str]) -> None:  # fmt: skip
    os.setsid()
    _enter(ns)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    err = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(stdin.fileno(), 0)
    os.dup2(stdout.fileno(), 1)
    os.dup2(err, 2)
    for fd in (err, stdin.fileno(), stdout.fileno()):
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own streams, for its life)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    module, _, func = target.partition(":")
    sys.exit(getattr(importlib.import_module(module), func)(argv))


class ForkedProcess:
    """A forked child, seen as the part of a :class:`subprocess.Popen` the cluster code uses."""

    def __init__(self, proc: Any, stdin: IO[str], stdout: IO[str], args: list[str]) -> None:
        self._proc = proc
        self.pid: int = proc.pid
        self.stdin: IO[str] | None = stdin
        self.stdout: IO[str] | None = stdout
        self.stderr: IO[str] | None = None
        self.args = args

    @property
    def returncode(self) -> int | None:
        code: int | None = self._proc.exitcode
        return code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code


def start(ns: str, target: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, log: str) -> ForkedProcess:
    """Fork ``target`` (``"package.module:function"``, called with ``argv``; its return value is
    the exit status) into namespace ``ns`` with exactly ``env`` as its environment.

    Raises:
        ValueError: ``env`` sets a variable that a preloaded module reads at import time to a
            value other than the fork server's.
    """
    for name in _IMPORT_TIME_ENV:
        if env.get(name) != os.environ.get(name):
            raise ValueError(f"{name} is read when tensorhub is imported: a forked worker cannot take "
                             f"{env.get(name)!r} (its fork server has {os.environ.get(name)!r}); start it with exec")  # fmt: skip
    ctx = _context(target.partition(":")[0])
    in_r, in_w = ctx.Pipe(duplex=False)
    out_r, out_w = ctx.Pipe(duplex=False)
    name = f"{ns}:{target}"
    proc = ctx.Process(target=_child, args=(ns, dict(env), cwd, log, in_r, out_w, target, list(argv)), name=name,
                       daemon=True)  # fmt: skip
    proc.start()
    in_r.close()
    out_w.close()
    stdin = open(os.dup(in_w.fileno()), "w", buffering=1)  # noqa: SIM115 (owned by the ForkedProcess)
    stdout = open(os.dup(out_r.fileno()))  # noqa: SIM115
    in_w.close()
    out_r.close()
    return ForkedProcess(proc, stdin, stdout, [name, *argv])
