"""The embedded default server: ``server=None`` with no ``$TENSORHUB_SERVER``."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import socket

import pytest
import zmq.asyncio

from tensorhub.core.errors import InvalidArgument
from tensorhub.runtime.embedded import _lock, _lock_path, resolve_server

from .procs import RemoteHandle

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _servers_bound_to(address: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"server" in argv and address.encode() in argv:
            pids.append(int(pid))
    return pids


def test_several_processes_open_at_once_and_exactly_one_server_starts(monkeypatch):
    address = f"tcp://127.0.0.1:{_free_port()}"
    env = {"TENSORHUB_EMBEDDED_ADDRESS": address, "TENSORHUB_SERVER": ""}
    monkeypatch.delenv("TENSORHUB_SERVER", raising=False)
    handles: list[RemoteHandle] = []
    try:
        handles = [RemoteHandle(model="actor", replica=f"r{i}", env=env) for i in range(4)]
        sessions = {h.session for h in handles}
        assert len(sessions) == 4, "every process got its own session on one server"
        assert len(_servers_bound_to(address)) == 1
        handles[0].call("register")
        handles[0].call("fill", 1)
        handles[0].call("publish", 1)
        handles[1].call("register")
        assert handles[1].call("replicate", 1, 30.0) == 1
        assert handles[1].call("holds", 1)
        assert not os.path.exists(_lock_path(address)), "the start-up lock's file is removed by its last holder"
    finally:
        for h in handles:
            h.exit()
        for pid in _servers_bound_to(address):
            os.kill(pid, signal.SIGTERM)


def test_multi_node_job_refuses_the_embedded_default(monkeypatch):
    monkeypatch.delenv("TENSORHUB_SERVER", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            with pytest.raises(InvalidArgument, match="multi-node"):
                await resolve_server(ctx, None)
            # An explicit address is fine in a multi-node job.
            assert await resolve_server(ctx, "tcp://10.0.0.1:5557") == "tcp://10.0.0.1:5557"
        finally:
            ctx.term()

    asyncio.run(main())


def test_server_from_the_environment(monkeypatch):
    monkeypatch.setenv("TENSORHUB_SERVER", "tcp://127.0.0.1:6001")

    async def main() -> str:
        ctx = zmq.asyncio.Context()
        try:
            return await resolve_server(ctx, None)
        finally:
            ctx.term()

    assert asyncio.run(main()) == "tcp://127.0.0.1:6001"


def test_a_waiter_on_a_removed_lock_file_takes_the_new_one(tmp_path):
    """The start-up lock's holder removes its file before letting go: a process that was waiting on
    that file must not think it holds the lock (a third one may have made a new file and locked it)."""
    path = str(tmp_path / "start.lock")

    async def main() -> None:
        first = await _lock(path)
        waiter = asyncio.ensure_future(_lock(path))
        await asyncio.sleep(0.2)  # the waiter has opened the file and blocks in flock
        assert not waiter.done()
        third = os.open(path + ".new", os.O_CREAT | os.O_RDWR, 0o600)
        os.unlink(path)
        os.rename(path + ".new", path)  # a new file at the path, as a third process would make
        fcntl.flock(third, fcntl.LOCK_EX)  # ... and lock
        os.close(first)  # the waiter gets the old, removed file's lock: it must open the path again
        await asyncio.sleep(0.2)
        assert not waiter.done(), "the waiter took the lock of a file no longer at the path"
        os.unlink(path)
        os.close(third)
        fd = await asyncio.wait_for(waiter, 5)
        try:
            assert os.fstat(fd).st_ino == os.stat(path).st_ino
        finally:
            os.unlink(path)
            os.close(fd)

    asyncio.run(main())
