"""The holder's side of a pair (:class:`_HolderSide`: a transport serving a dict of holdings,
and the commands checks give it, the same code in this process and in the holder process),
and the default hosting, with holders in the checking process."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

from tensorhub.core.errors import InvalidArgument
from tensorhub.testing import limits
from tensorhub.testing.assertions import _bounded, _check_endpoint
from tensorhub.testing.limits import _QUIET_TIMEOUT
from tensorhub.testing.shards import _HookedBuffers, _ShardSpec, _tensor_specs, _write, _zeros
from tensorhub.transports.buffers import ShardBuffers, layout_of


class _HolderSide:
    """The holder of one pair: a transport serving a dict of holdings, and what checks do to
    them. The same code runs in the checking process and in the holder process; its public
    methods (:data:`_HOLDER_COMMANDS`) are the commands the pipe carries, with the same
    arguments (a shard as its :class:`_ShardSpec`)."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.started = False
        self.holdings: dict[tuple[int, int], ShardBuffers] = {}
        self._buffers: dict[int, tuple[_ShardSpec, _HookedBuffers]] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._errors: list[str] = []  # of background threads, raised by quiet()
        self.refused: list[tuple[int, int, str]] = []  # requests the installed grant check refused

    async def start(self) -> None:
        await _bounded(self.transport.start(), "holder start()")
        self.started = True
        self.transport.serve(lambda region, version: self.holdings.get((region, version)))

    def endpoint(self) -> dict[str, Any]:
        return self.transport.endpoint()

    def check_endpoint(self) -> None:
        _check_endpoint(self.transport.endpoint(), "holder")

    def guard(self, token: bytes) -> None:
        """Install a grant check (as the engine does) that admits requests showing ``token`` and
        refuses, counting them, every other (no token included)."""
        refused = self.refused

        def check(region: int, version: int, shown: bytes | None, who: str) -> str | None:
            if shown == token:
                return None
            refused.append((region, version, who))
            return "refused: not the token the conformance suite granted"

        self.transport.guard(check)

    def refusals(self) -> int:
        """How many requests the grant check refused."""
        return len(self.refused)

    def buffers(self, shard: _ShardSpec) -> _HookedBuffers:
        """The buffers of ``shard`` on this side (made on first use)."""
        got = self._buffers.get(shard.key)
        if got is None:
            tensors = _zeros(_tensor_specs(shard.kind, shard.nbytes), shard.device)
            buf = _HookedBuffers(tensors, layout_of(tensors), packs_in_place=shard.in_place == "holder")
            if shard.filled:
                _write(buf, 0, shard.data())
            got = self._buffers[shard.key] = (shard, buf)
        elif got[0] != shard:
            raise InvalidArgument(f"shard {shard.key} was {got[0]!r}, now {shard!r}")
        return got[1]

    def _held(self, shard: _ShardSpec) -> _HookedBuffers:
        if shard.key not in self._buffers:
            raise InvalidArgument(f"the holder has no buffers for shard {shard.key}; hold it first")
        return self.buffers(shard)

    def hold(self, shard: _ShardSpec, region: int, version: int, verified: int | None) -> int:
        """Serve ``shard`` as (region, version), verified up to ``verified`` (all if None).
        Returns the generation."""
        buf = self.buffers(shard)
        self.holdings[(region, version)] = buf
        self.transport.expose(buf)
        return buf.progress.reset(version, buf.total_bytes if verified is None else verified)

    def reset(self, shard: _ShardSpec, version: int | None, verified: int) -> int:
        return self._held(shard).progress.reset(version, verified)

    def advance(self, shard: _ShardSpec, verified: int) -> None:
        self._held(shard).progress.advance(verified)

    def generation(self, shard: _ShardSpec) -> int:
        return self._held(shard).progress.generation

    def write(self, shard: _ShardSpec, offset: int, data: bytes) -> None:
        buf = self._held(shard)
        if not (isinstance(data, bytes) and 0 <= offset <= offset + len(data) <= buf.total_bytes):
            raise InvalidArgument(f"cannot write {len(data)} bytes at {offset} of a {buf.total_bytes}-byte shard")
        _write(buf, offset, data)

    def expose(self, shard: _ShardSpec) -> None:
        self.transport.expose(self._held(shard))

    def withdraw(self, shard: _ShardSpec) -> None:
        self.transport.withdraw(self._held(shard))

    def arm_change(self, shard: _ShardSpec, version: int) -> None:
        """Once, right after the transport next takes the holder's memory of ``shard`` to copy
        it (``views``/``copy_out``, on whichever thread serves the read), the holding moves to
        a new generation of ``version``, all verified: a change *during* that read, whatever
        the timing."""
        buf = self._held(shard)
        buf.arm(lambda: buf.progress.reset(version, buf.total_bytes))

    def disarm(self, shard: _ShardSpec) -> bool:
        """No hook on ``shard``'s buffers any more; returns whether the armed one ran (the
        transport read them through ``views``/``copy_out`` in this process)."""
        return self._held(shard).disarm()

    def feed(self, shard: _ShardSpec, steps: list[int], delay: float) -> None:
        """In a thread: for each ``end`` of ``steps``, after ``delay`` seconds, write the
        shard's bytes up to ``end`` and advance its progress there (a partial holder filling)."""
        buf, data = self._held(shard), memoryview(shard.data())

        def fill(stop: threading.Event) -> None:
            done = 0
            for end in steps:
                if stop.wait(delay):
                    return
                _write(buf, done, data[done:end])
                buf.progress.advance(end)
                done = end

        self._background(fill, "conformance-feed")

    def churn(self, shard: _ShardSpec, version: int, pause: float) -> int:
        """In a thread, until :meth:`quiet`: the holding changes over and over (a new
        generation with nothing verified, then the bytes of generation ``g``: the shard's own
        if ``g - first`` is even, its ``"churn"`` content if odd, then all of them verified).
        Returns ``first``, the generation before the first change."""
        buf = self._held(shard)
        contents = (shard.data(), shard.data("churn"))
        first = buf.progress.generation

        def change(stop: threading.Event) -> None:
            while not stop.is_set():
                g = buf.progress.reset(version, 0)
                _write(buf, 0, contents[(g - first) % 2])
                buf.progress.advance(buf.total_bytes)
                stop.wait(pause)

        self._background(change, "conformance-churn")
        return first

    def _background(self, fn: Callable[[threading.Event], None], name: str) -> None:
        stop = self._stop

        def main() -> None:
            try:
                fn(stop)
            except Exception as err:  # noqa: BLE001 - reported by quiet()
                self._errors.append(f"{name}: {type(err).__name__}: {err}")

        t = threading.Thread(target=main, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def quiet(self) -> None:
        """Stop the background threads (feed, churn) and wait for them; raise what failed."""
        self._stop.set()
        threads, self._threads, self._stop = self._threads, [], threading.Event()
        deadline = time.monotonic() + _QUIET_TIMEOUT
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        errors, self._errors = self._errors, []
        if stuck:
            errors.append(f"threads {stuck} did not stop within {_QUIET_TIMEOUT:g} s")
        if errors:
            raise AssertionError(f"the holder's background work failed: {'; '.join(errors)}")

    def wake(self) -> None:
        """Stop the background threads, then wake whatever still waits on a holding."""
        try:
            self.quiet()
        finally:
            for buf in self.holdings.values():
                buf.progress.reset(None)

    async def close(self, what: str) -> None:
        """Close the transport (bounded); nothing if it never started."""
        if self.started:
            await _bounded(self.transport.close(), what, limits._CLOSE_TIMEOUT)


#: The holder's methods the pipe may call (``start`` and ``forget`` are the holder process's).
_HOLDER_COMMANDS = frozenset(
    {"endpoint", "check_endpoint", "hold", "reset", "advance", "generation", "write", "expose", "withdraw",
     "arm_change", "disarm", "feed", "churn", "quiet", "wake", "close", "guard", "refusals"}
)  # fmt: skip


class _LocalHolder:
    """A pair's holder in this process."""

    alive = True

    def __init__(self, transport: Any) -> None:
        self.side = _HolderSide(transport)
        self.one_sided = bool(getattr(transport, "one_sided", False))
        self.label = type(transport).__name__

    async def start(self) -> None:
        await self.side.start()

    async def do(self, command: str, **args: Any) -> Any:
        if command not in _HOLDER_COMMANDS:
            raise InvalidArgument(f"unknown holder command {command!r}")
        value = getattr(self.side, command)(**args)
        return await value if inspect.isawaitable(value) else value

    async def peer(self) -> dict[str, Any]:
        return self.side.transport.endpoint()

    async def forget(self) -> None:
        self.side.quiet()


class _InProcess:
    """Holders in the checking process (the default)."""

    processes = False

    def holder(self, make: Callable[[dict[str, Any]], Any], options: dict[str, Any]) -> _LocalHolder:
        return _LocalHolder(make(options))

    async def kill(self, holder: Any) -> None:
        raise InvalidArgument("only a holder process can be killed (check_transport(..., holder_process=True))")

    async def close(self) -> None:
        pass
