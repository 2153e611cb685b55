"""The holder in another process (``check_transport(..., holder_process=True)``): the child's
main loop (:func:`_holder_main`, the ``multiprocessing`` target, started with ``spawn`` or
``forkserver``), which answers msgpack commands on a pipe; the checking process's end of it
(:class:`_HolderProcess`); a pair's holder there (:class:`_RemoteHolder`); and the hosting
that keeps one such process for the suite (:class:`_InChild`)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import os
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack

from tensorhub.core.errors import InvalidArgument
from tensorhub.runtime.actor import new_event_loop
from tensorhub.testing import limits
from tensorhub.testing.holders import _HOLDER_COMMANDS, _HolderSide
from tensorhub.testing.limits import _BOOT_TIMEOUT, _MAX_FRAME, _PROTOCOL, _READ_TIMEOUT
from tensorhub.testing.shards import _shard_data, _ShardSpec
from tensorhub.testing.under_test import _transport_class


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(frame: bytes) -> Any:
    return msgpack.unpackb(frame, raw=False)


def _holder_main(conn: Any) -> None:
    """The holder process: answer the checking process's commands on ``conn`` (msgpack frames
    ``{"op", "holder", "args"}``, answered ``{"ok": value}`` or ``{"error": type, "message"}``)
    until it says ``exit`` or goes away, then close every holder transport and exit."""
    code = 0
    loop = new_event_loop()
    try:
        loop.run_until_complete(_answer_commands(conn))
    except BaseException:  # noqa: BLE001 - the process ends here either way; say why
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(OSError):
            conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Not a normal exit: it would wait for transports' worker threads, without a bound.
        os._exit(code)


async def _answer_commands(conn: Any) -> None:
    loop = asyncio.get_running_loop()
    holders: dict[int, _HolderSide] = {}
    pipe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conformance-pipe")
    conn.send_bytes(_pack({"hello": _PROTOCOL, "pid": os.getpid()}))
    try:
        while True:
            try:
                frame = await loop.run_in_executor(pipe, conn.recv_bytes, _MAX_FRAME)
            except (EOFError, OSError):
                return  # the checking process is gone
            msg = _unpack(frame)
            if isinstance(msg, dict) and msg.get("op") == "exit":
                await _close_holders(holders)
                conn.send_bytes(_pack({"ok": None}))
                return
            try:
                reply = {"ok": await _answer(holders, msg)}
            except AssertionError as err:  # a check's own failure: its message as it is
                reply = {"error": "AssertionError", "message": str(err)}
            except Exception as err:  # noqa: BLE001 - whatever the transport raises goes back
                reply = {"error": type(err).__name__, "message": str(err)}
            try:
                out = _pack(reply)
            except (TypeError, ValueError, OverflowError) as err:
                out = _pack({"error": "InvalidArgument", "message": f"the answer is not msgpack data: {err}"})
            try:
                conn.send_bytes(out)
            except OSError:
                return  # the checking process is gone
    finally:
        await _close_holders(holders)
        pipe.shutdown(wait=False)


async def _answer(holders: dict[int, _HolderSide], msg: Any) -> Any:
    if not (isinstance(msg, dict) and isinstance(msg.get("op"), str) and type(msg.get("holder")) is int):
        raise InvalidArgument(f"malformed command {msg!r}")
    op, hid, args = msg["op"], msg["holder"], dict(msg.get("args") or {})
    if "shard" in args:
        args["shard"] = _ShardSpec.from_wire(args["shard"])
    side: _HolderSide | None
    if op == "start":
        if hid in holders:
            raise InvalidArgument(f"holder {hid} exists already")
        side = holders[hid] = _HolderSide(_transport_class(args["transport"])(args["options"]))
        await side.start()
        return {"one_sided": bool(side.transport.one_sided)}
    if op == "forget":
        side = holders.pop(hid, None)
        _shard_data.cache_clear()  # a large shard's bytes are not needed any more
        if side is not None:
            side.quiet()
        return None
    side = holders.get(hid)
    if side is None:
        raise InvalidArgument(f"no holder {hid} in the holder process")
    if op not in _HOLDER_COMMANDS:
        raise InvalidArgument(f"unknown holder command {op!r}")
    value = getattr(side, op)(**args)
    return await value if inspect.isawaitable(value) else value


async def _close_holders(holders: dict[int, _HolderSide]) -> None:
    for hid in list(holders):
        side = holders.pop(hid)
        with contextlib.suppress(Exception):
            side.wake()
        with contextlib.suppress(Exception):
            await side.close(f"close() of {type(side.transport).__name__}")


class _HolderProcess:
    """The checking process's end of one holder process. Commands go one at a time through a
    thread of its own (the pipe blocks); a command not answered in time, or a process that
    died, makes it unusable: it is killed, and the hosting starts another for later checks."""

    NAME = "tensorhub-conformance-holder"

    def __init__(self, context: Any) -> None:
        self._conn, theirs = context.Pipe(duplex=True)
        self.process = context.Process(target=_holder_main, args=(theirs,), name=self.NAME, daemon=True)
        try:
            self.process.start()
        finally:
            theirs.close()
        self.pid: int = self.process.pid
        self.ids = itertools.count(1)
        self.failed: str | None = None  # why it cannot be used any more
        self._booted = False
        self._pipe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conformance-holder-pipe")

    @property
    def usable(self) -> bool:
        return self.failed is None and self.process.is_alive()

    async def call(self, op: str, holder: int, args: dict[str, Any], timeout: float | None = None) -> Any:
        """Send a command, return its answer.

        Raises:
            AssertionError: the holder process failed it (an AssertionError's message as it
                is, another error as ``"the holder process raised <type>: <message>"``), did
                not answer within ``timeout`` (or did not start within the boot timeout), or
                is gone.
        """
        loop = asyncio.get_running_loop()
        msg = {"op": op, "holder": holder, "args": args}
        reply = await loop.run_in_executor(self._pipe, self._exchange, msg, limits._COMMAND_TIMEOUT if timeout is None else timeout)
        if "error" in reply:
            if reply["error"] == "AssertionError":
                raise AssertionError(reply["message"])
            raise AssertionError(f"the holder process raised {reply['error']}: {reply['message']}")
        return reply["ok"]

    def _exchange(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.failed is not None:
            raise AssertionError(self.failed)
        what = f"{msg['op']!r}"
        if not self._booted:
            hello = self._receive(_BOOT_TIMEOUT, "its start")
            if not (isinstance(hello, dict) and hello.get("hello") == _PROTOCOL):
                raise self._give_up(f"the holder process greeted with {hello!r}, not protocol {_PROTOCOL}")
            self._booted = True
        try:
            self._conn.send_bytes(_pack(msg))
        except OSError as err:
            raise self._give_up(f"the holder process is gone ({err}); cannot send {what}") from err
        reply = self._receive(timeout, what)
        if not (isinstance(reply, dict) and ("ok" in reply or "error" in reply)):
            raise self._give_up(f"the holder process answered {what} with {reply!r}")
        return reply

    def _receive(self, timeout: float, what: str) -> Any:
        try:
            if not self._conn.poll(timeout):
                raise self._give_up(f"the holder process did not answer {what} within {timeout:g} s")
            return _unpack(self._conn.recv_bytes(_MAX_FRAME))
        except (EOFError, OSError):
            self.process.join(2.0)
            code = self.process.exitcode
            raise self._give_up(f"the holder process is gone (exit code {code}) before it answered {what}") from None

    def _give_up(self, why: str) -> AssertionError:
        self.failed = self.failed or why
        self._terminate()
        return AssertionError(why)

    def _terminate(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)

    def kill(self) -> None:
        """SIGKILL the process (a check's peer death) and reap it."""
        self.failed = self.failed or "the holder process was killed"
        self._terminate()

    async def exit(self) -> None:
        """Ask the process to close its holders and exit; kill it if it does not."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pipe, self._exit)
        finally:
            self._pipe.shutdown(wait=False)

    def _exit(self) -> None:
        # One that never booted holds nothing: no need to wait for its imports to end it.
        if self._booted and self.failed is None and self.process.is_alive():
            with contextlib.suppress(AssertionError):
                self._exchange({"op": "exit", "holder": 0, "args": {}}, limits._CLOSE_TIMEOUT + 5.0)
            self.process.join(5.0)
        self.failed = self.failed or "the holder process exited"
        self._terminate()
        self._conn.close()


class _RemoteHolder:
    """A pair's holder in the holder process: the same commands, over its pipe."""

    def __init__(self, process: _HolderProcess, transport: str, options: dict[str, Any]) -> None:
        self.process = process
        self.id = next(process.ids)
        self.transport = transport
        self.options = options
        self.one_sided = False
        self.label = transport
        self._peer: dict[str, Any] | None = None

    @property
    def alive(self) -> bool:
        return self.process.usable

    async def start(self) -> None:
        got = await self.process.call("start", self.id, {"transport": self.transport, "options": self.options}, _READ_TIMEOUT + 10.0)
        self.one_sided = bool(got["one_sided"])
        # Fetched now, so that reads after the process was killed still know whom to ask.
        with contextlib.suppress(AssertionError):
            self._peer = await self.do("endpoint")

    async def do(self, command: str, **args: Any) -> Any:
        wire = {k: v.wire() if isinstance(v, _ShardSpec) else v for k, v in args.items()}
        timeout = limits._CLOSE_TIMEOUT + 5.0 if command == "close" else limits._COMMAND_TIMEOUT
        return await self.process.call(command, self.id, wire, timeout)

    async def peer(self) -> dict[str, Any]:
        if self._peer is None:
            self._peer = await self.do("endpoint")
        return self._peer

    async def forget(self) -> None:
        await self.process.call("forget", self.id, {})


class _InChild:
    """Holders in a holder process: one for the whole suite, a new one after a kill."""

    processes = True

    def __init__(self, context: Any, transport: str) -> None:
        self.context = context
        self.transport = transport
        self.current: _HolderProcess | None = None
        self.spawned: list[_HolderProcess] = []

    def _process(self) -> _HolderProcess:
        if self.current is None or not self.current.usable:
            self.current = _HolderProcess(self.context)
            self.spawned.append(self.current)
        return self.current

    def holder(self, make: Callable[[dict[str, Any]], Any], options: dict[str, Any]) -> _RemoteHolder:
        return _RemoteHolder(self._process(), self.transport, options)

    async def kill(self, holder: Any) -> None:
        if not isinstance(holder, _RemoteHolder):
            raise InvalidArgument("only a holder process can be killed")
        holder.process.kill()
        if holder.process is self.current:
            self._process()  # the next checks' process boots while this check goes on

    async def close(self) -> None:
        for proc in self.spawned:
            await proc.exit()
