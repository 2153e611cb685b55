"""Finding the server: ``server=``, ``$TENSORHUB_SERVER``, or the embedded default on this machine.

``server=`` (and ``$TENSORHUB_SERVER``) is an ordered list of addresses: a list or tuple of
strings, or one string with the addresses separated by commas
(``"tcp://a:5557,tcp://b:5557"``). The first is the primary; the client moves to the next when
the one it uses is lost (see :mod:`tensorhub.runtime.client`). Each entry must be a ZeroMQ address
(``tcp://``, ``ipc://`` or ``inproc://``); a bad one is refused with
:class:`~tensorhub.errors.InvalidArgument` naming it.

With ``server=None`` and no ``$TENSORHUB_SERVER``, a handle connects to a well-known local
address (``$TENSORHUB_EMBEDDED_ADDRESS``, default ``tcp://127.0.0.1:5557``). If nobody answers
there, it starts a detached server process on it. Several processes doing this at once are
serialized by an exclusive lock on a file named after the address: the first starts the server,
the others find it when they get the lock. The holder removes the file as it lets go, so none is
left behind per address used. A server bound there refuses a second bind anyway, so exactly one
runs. The embedded server exits after ``EMBEDDED_IDLE_EXIT`` seconds with no
session open, so it does not outlive the jobs that started it.

In a multi-node job (torchrun's ``WORLD_SIZE`` > ``LOCAL_WORLD_SIZE``) the embedded default is
refused: one server per node would split the job.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from tensorhub.core import messages as m
from tensorhub.core.errors import InvalidArgument, ServerUnavailable
from tensorhub.core.wire import decode, encode

__all__ = ["EMBEDDED_ADDRESS", "EMBEDDED_IDLE_EXIT", "parse_servers", "probe", "resolve_server", "resolve_servers"]

EMBEDDED_ADDRESS = "tcp://127.0.0.1:5557"
EMBEDDED_IDLE_EXIT = 60.0
_START_TIMEOUT = 30.0


def embedded_address() -> str:
    return os.environ.get("TENSORHUB_EMBEDDED_ADDRESS", EMBEDDED_ADDRESS)


async def probe(ctx: zmq.asyncio.Context, address: str, timeout: float = 0.5, keys: Any = None, reigning: bool = False) -> bool:
    """Whether a TensorHub server answers at ``address`` within ``timeout`` seconds (through
    CURVE with ``keys``, a :class:`~tensorhub.runtime.security.ClientKeys`, when given); with
    ``reigning``, one that also says it decides now (a primary or backup may not)."""
    from .security import apply_client

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        apply_client(sock, keys)
        sock.connect(address)
        await sock.send(encode(m.Heartbeat(1, ())))
        if not await sock.poll(int(timeout * 1000)):
            return False
        try:
            ack = decode(await sock.recv())
            return isinstance(ack, m.HeartbeatAck) and (ack.reigning or not reigning)
        except Exception:  # noqa: BLE001 - something answered, but not a TensorHub server
            return False
    finally:
        sock.close(0)


_ADDRESS = re.compile(r"^(tcp|ipc|inproc)://\S+$")
MAX_SERVERS = 16


def parse_servers(server: object, what: str = "server") -> tuple[str, ...]:
    """The ordered addresses that ``server`` names (see the module docstring).

    Raises:
        InvalidArgument: not a string or a list/tuple of strings, no address at all, an entry
            that is not a ZeroMQ address (named), or an address given twice.
    """
    if isinstance(server, str):
        entries: list[object] = [e.strip() for e in server.split(",")]
    elif isinstance(server, (list, tuple)):
        entries = [e.strip() if isinstance(e, str) else e for e in server]
    else:
        raise InvalidArgument(
            f"{what} must be an address like tcp://host:port, a comma-separated string of them, or a list; "
            f"got {type(server).__name__}"
        )
    if not entries or entries == [""]:
        raise InvalidArgument(f"{what} names no address: give at least one, like tcp://host:port")
    if len(entries) > MAX_SERVERS:
        raise InvalidArgument(f"{what} names {len(entries)} addresses; at most {MAX_SERVERS}")
    seen: dict[str, None] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, str) or not _ADDRESS.match(entry):
            raise InvalidArgument(f"{what} entry {i} ({entry!r}) is not a ZeroMQ address like tcp://host:port")
        if entry in seen:
            raise InvalidArgument(f"{what} entry {i} ({entry!r}) repeats an earlier address")
        seen[entry] = None
    return tuple(seen)


async def resolve_server(ctx: zmq.asyncio.Context, server: str | Sequence[str] | None) -> str:
    """:func:`resolve_servers`, as one comma-separated string."""
    return ",".join(await resolve_servers(ctx, server))


async def resolve_servers(ctx: zmq.asyncio.Context, server: str | Sequence[str] | None) -> tuple[str, ...]:
    """The addresses a handle should use, in order (starting the embedded server if none is given).
    The caller passes them on to what needs them: the client, and the transports, which choose
    the address they advertise by them (:func:`tensorhub.transports.nic.choose_address`).

    Raises:
        InvalidArgument: ``server=None`` in a multi-node job, or a malformed address list.
        ServerUnavailable: the embedded server could not be started.
    """
    if server is not None:
        return parse_servers(server)
    env = os.environ.get("TENSORHUB_SERVER") or None
    if env is not None:
        return parse_servers(env, "$TENSORHUB_SERVER")
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if world and local and world.isdigit() and local.isdigit() and int(world) > int(local):
        raise InvalidArgument(
            f"this is a multi-node job (WORLD_SIZE={world} > LOCAL_WORLD_SIZE={local}): pass server= or set "
            "$TENSORHUB_SERVER to one server's address instead of starting one embedded server per node"
        )
    address = embedded_address()
    if await probe(ctx, address):
        return (address,)
    lock_path = _lock_path(address)
    fd = await _lock(lock_path)
    try:
        if await probe(ctx, address):
            return (address,)  # another process started it while we waited for the lock
        await _start_detached(ctx, address)
        return (address,)
    finally:
        os.unlink(lock_path)  # while still held: a waiter on this inode sees it is gone and retries
        os.close(fd)  # releases the lock


def _lock_path(address: str) -> str:
    return os.path.join(tempfile.gettempdir(), "tensorhub-" + re.sub(r"[^A-Za-z0-9]+", "_", address) + ".lock")


async def _lock(path: str) -> int:
    """An exclusive lock on the file at ``path``; its descriptor. Its holder removes the file before it
    lets go (so that one is not left behind per address ever used), hence a waiter that gets the lock
    on a file that is no longer at ``path`` (or is another file there now) opens it again."""
    for _ in range(_LOCK_TRIES):
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            try:
                current = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                current = False
        except BaseException:
            os.close(fd)
            raise
        if current:
            return fd
        os.close(fd)
    raise ServerUnavailable(f"could not lock {path} to start the embedded server: it was replaced {_LOCK_TRIES} times")


#: Times to reopen the start-up lock after its file was removed by its previous holder.
_LOCK_TRIES = 64


async def _start_detached(ctx: zmq.asyncio.Context, address: str) -> None:
    log_path = os.path.join(tempfile.gettempdir(), "tensorhub-embedded-server.log")
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tensorhub", "server", "--bind", address, "--idle-exit", str(EMBEDDED_IDLE_EXIT)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,  # detached: it outlives this process, and our signals
            close_fds=True,
        )
    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline:
        if await probe(ctx, address, timeout=0.5):
            return
        if proc.poll() is not None:
            raise ServerUnavailable(
                f"the embedded server for {address} exited with code {proc.returncode}; see {log_path}"
            )
    raise ServerUnavailable(f"the embedded server for {address} did not answer within {_START_TIMEOUT:g} s; see {log_path}")
