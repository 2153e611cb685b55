"""Unit tests of the actor runtime (``tensorhub.runtime.actor``): tell/ask, deferred replies, handler
errors, timers, supervision, stop, and the loop thread of the synchronous facade.

Every test is bounded: asks carry small timeouts, waits poll a bounded number of times.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from tensorhub.core.errors import Cancelled, Timeout
from tensorhub.runtime.actor import Actor, LoopThread, TaskCrashed, new_event_loop, run

pytestmark = pytest.mark.timeout(20)

T = 2.0  # an ask timeout that a healthy actor never gets near


@dataclass(frozen=True)
class Ping:
    n: int = 0


@dataclass(frozen=True)
class Slow:
    delay: float


@dataclass(frozen=True)
class Defer:
    key: str


@dataclass(frozen=True)
class Resolve:
    key: str
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Boom:
    error: BaseException


@dataclass(frozen=True)
class Unhandled:
    pass


@dataclass(frozen=True)
class Tick:
    n: int


class Recorder(Actor):
    """Records what it handles; answers Ping with n + 1; defers Defer until Resolve."""

    def __init__(self, name: str = "rec") -> None:
        super().__init__(name)
        self.seen: list[Any] = []
        self.deferred: dict[str, asyncio.Future] = {}
        self.started = 0
        self.stopped_calls = 0
        self.crashes: list[TaskCrashed] = []

    async def on_start(self) -> None:
        self.started += 1

    async def on_stop(self) -> None:
        self.stopped_calls += 1

    def on_Ping(self, msg: Ping) -> int:
        self.seen.append(msg)
        return msg.n + 1

    async def on_Slow(self, msg: Slow) -> str:
        self.seen.append(msg)
        await asyncio.sleep(msg.delay)
        return "slow done"

    def on_Defer(self, msg: Defer) -> asyncio.Future:
        assert self.loop is not None
        fut = self.loop.create_future()
        self.deferred[msg.key] = fut
        return fut

    def on_Resolve(self, msg: Resolve) -> None:
        fut = self.deferred.pop(msg.key)
        if fut.done():
            return
        if msg.error is not None:
            fut.set_exception(msg.error)
        else:
            fut.set_result(msg.value)

    def on_Boom(self, msg: Boom) -> None:
        raise msg.error

    def on_Tick(self, msg: Tick) -> None:
        self.seen.append(msg)


async def started(actor: Actor) -> Actor:
    await actor.start()
    return actor


async def wait_for(pred, what: str, timeout: float = 2.0) -> None:
    """Poll ``pred`` on the loop, a bounded number of times."""
    for _ in range(int(timeout / 0.005)):
        if pred():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


# --- tell / ask --------------------------------------------------------------------------------


def test_tell_is_handled_in_order() -> None:
    async def main() -> None:
        a = await started(Recorder())
        for i in range(50):
            a.tell(Ping(i))
        assert await a.ask(Ping(99), T) == 100  # the mailbox is FIFO: all 50 were handled first
        assert a.seen == [Ping(i) for i in range(50)] + [Ping(99)]
        assert a.started == 1
        await a.stop()

    run(main())


def test_ask_returns_sync_and_async_handler_results() -> None:
    async def main() -> None:
        a = await started(Recorder())
        assert await a.ask(Ping(1), T) == 2
        assert await a.ask(Slow(0.01), T) == "slow done"
        await a.stop()

    run(main())


def test_ask_timeout_raises_tensorhub_timeout_quickly() -> None:
    async def main() -> None:
        a = await started(Recorder())
        t0 = time.monotonic()
        with pytest.raises(Timeout, match="did not answer Defer") as info:
            await a.ask(Defer("k"), 0.05)
        assert time.monotonic() - t0 < 10.0
        assert isinstance(info.value, TimeoutError)  # the error tree's Timeout is a TimeoutError
        # The asker gave up: the handler's future is cancelled, so a late answer goes nowhere.
        await wait_for(lambda: a.deferred["k"].cancelled(), "the deferred future to be cancelled")
        a.tell(Resolve("k", 1))
        assert await a.ask(Ping(0), T) == 1  # the actor goes on
        await a.stop()

    run(main())


def test_ask_timeout_while_a_slow_handler_runs_then_the_late_result_is_dropped() -> None:
    async def main() -> None:
        a = await started(Recorder())
        with pytest.raises(Timeout):
            await a.ask(Slow(0.2), 0.02)
        assert await a.ask(Ping(5), T) == 6  # answered after the slow handler finished
        await a.stop()

    run(main())


def test_deferred_reply_does_not_block_the_mailbox() -> None:
    async def main() -> None:
        a = await started(Recorder())
        pending = asyncio.ensure_future(a.ask(Defer("x"), T))
        # Other requests are answered while Defer waits.
        assert await a.ask(Ping(1), T) == 2
        assert await a.ask(Ping(2), T) == 3
        assert not pending.done()
        a.tell(Resolve("x", "late answer"))
        assert await pending == "late answer"
        await a.stop()

    run(main())


def test_deferred_reply_exception_goes_to_the_asker() -> None:
    async def main() -> None:
        a = await started(Recorder())
        pending = asyncio.ensure_future(a.ask(Defer("x"), T))
        await a.ask(Ping(0), T)  # Defer was handled
        a.tell(Resolve("x", error=KeyError("nope")))
        with pytest.raises(KeyError, match="nope"):
            await pending
        await a.stop()

    run(main())


def test_deferred_reply_cancelled_by_the_handler_cancels_the_asker() -> None:
    async def main() -> None:
        a = await started(Recorder())
        pending = asyncio.ensure_future(a.ask(Defer("x"), T))
        await a.ask(Ping(0), T)
        a.deferred["x"].cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await a.stop()

    run(main())


def test_handler_that_returns_an_already_done_future() -> None:
    class A(Actor):
        def on_Ping(self, msg: Ping) -> asyncio.Future:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(msg.n * 10)
            return fut

    async def main() -> None:
        a = await started(A("a"))
        assert await a.ask(Ping(4), T) == 40
        await a.stop()

    run(main())


def test_handler_exception_goes_to_the_asker_and_the_actor_goes_on() -> None:
    async def main() -> None:
        a = await started(Recorder())
        err = ValueError("bad request")
        with pytest.raises(ValueError, match="bad request") as info:
            await a.ask(Boom(err), T)
        assert info.value is err
        assert await a.ask(Ping(1), T) == 2
        assert not a.stopped
        await a.stop()

    run(main())


def test_handler_exception_from_a_tell_is_logged_and_the_actor_goes_on() -> None:
    async def main() -> None:
        a = await started(Recorder())
        a.tell(Boom(RuntimeError("nobody asked")))
        assert await a.ask(Ping(1), T) == 2
        assert not a.stopped
        await a.stop()

    run(main())


def test_async_handler_exception_goes_to_the_asker() -> None:
    class A(Actor):
        async def on_Ping(self, msg: Ping) -> None:
            await asyncio.sleep(0)
            raise LookupError(f"no {msg.n}")

    async def main() -> None:
        a = await started(A("a"))
        with pytest.raises(LookupError, match="no 3"):
            await a.ask(Ping(3), T)
        await a.stop()

    run(main())


def test_message_without_a_handler_is_a_type_error_for_the_asker() -> None:
    async def main() -> None:
        a = await started(Recorder())
        with pytest.raises(TypeError, match="rec has no handler for Unhandled"):
            await a.ask(Unhandled(), T)
        a.tell(Unhandled())  # logged, not fatal
        assert await a.ask(Ping(0), T) == 1
        await a.stop()

    run(main())


def test_receive_may_be_overridden() -> None:
    class Echo(Actor):
        def receive(self, msg: Any) -> Any:
            return ("echo", msg)

    async def main() -> None:
        a = await started(Echo("echo"))
        assert await a.ask(42, T) == ("echo", 42)
        await a.stop()

    run(main())


def test_a_timeout_raised_by_the_handler_reaches_the_asker_unchanged() -> None:
    async def main() -> None:
        a = await started(Recorder())
        err = Timeout("the server did not answer Subscribe in 1.0 s", model="m")
        with pytest.raises(Timeout) as info:
            await a.ask(Boom(err), T)
        await a.stop()
        assert info.value is err

    run(main())


# --- timers --------------------------------------------------------------------------------------


def test_after_delivers_once_after_the_delay() -> None:
    async def main() -> None:
        a = await started(Recorder())
        t0 = time.monotonic()
        a.after(0.05, Tick(1))
        await wait_for(lambda: Tick(1) in a.seen, "the timer")
        assert time.monotonic() - t0 >= 0.04
        await asyncio.sleep(0.05)
        assert a.seen.count(Tick(1)) == 1
        assert not a._timers  # a fired timer is forgotten
        await a.stop()

    run(main())


def test_after_can_be_cancelled() -> None:
    async def main() -> None:
        a = await started(Recorder())
        h = a.after(0.02, Tick(1))
        a.after(0.04, Tick(2))
        h.cancel()
        await wait_for(lambda: Tick(2) in a.seen, "the second timer")
        assert Tick(1) not in a.seen
        await a.stop()

    run(main())


def test_every_delivers_repeatedly_until_stop() -> None:
    async def main() -> None:
        a = await started(Recorder())
        count = iter(range(1000))
        a.every(0.01, lambda: Tick(next(count)))
        await wait_for(lambda: len(a.seen) >= 3, "three ticks")
        assert a.seen[:3] == [Tick(0), Tick(1), Tick(2)]
        await a.stop()
        n = len(a.seen)
        await asyncio.sleep(0.05)
        assert len(a.seen) == n
        assert not a._tasks

    run(main())


def test_stop_cancels_pending_timers() -> None:
    async def main() -> None:
        a = await started(Recorder())
        a.after(0.05, Tick(1))
        await a.stop()
        await asyncio.sleep(0.1)
        assert Tick(1) not in a.seen and not a._timers

    run(main())


# --- supervision ---------------------------------------------------------------------------------


def test_a_crashing_task_stops_the_actor_by_default() -> None:
    async def main() -> None:
        a = await started(Recorder())
        other_cancelled = asyncio.Event()

        async def crash() -> None:
            await asyncio.sleep(0.01)
            raise RuntimeError("socket reader died")

        async def forever() -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                other_cancelled.set()
                raise

        a.spawn(forever(), "forever")
        a.spawn(crash(), "reader")
        await wait_for(lambda: a.stopped_calls == 1, "the actor to stop")
        assert a.stopped and other_cancelled.is_set()
        with pytest.raises(Cancelled):
            await a.ask(Ping(0), T)
        await wait_for(lambda: not a._tasks, "the stop task to end")

    run(main())


def test_task_crashed_can_be_handled_differently() -> None:
    class Tolerant(Recorder):
        def on_TaskCrashed(self, msg: TaskCrashed) -> None:
            self.crashes.append(msg)

    async def main() -> None:
        a = await started(Tolerant())
        err = OSError("transient")

        async def crash() -> None:
            raise err

        a.spawn(crash(), "flaky")
        await wait_for(lambda: a.crashes, "TaskCrashed")
        assert a.crashes == [TaskCrashed("flaky", err)]
        assert not a.stopped
        assert await a.ask(Ping(1), T) == 2
        await a.stop()

    run(main())


def test_tasks_that_end_normally_or_are_cancelled_are_not_crashes() -> None:
    class Tolerant(Recorder):
        def on_TaskCrashed(self, msg: TaskCrashed) -> None:
            self.crashes.append(msg)

    async def main() -> None:
        a = await started(Tolerant())

        async def fine() -> int:
            return 1

        t1 = a.spawn(fine(), "fine")
        t2 = a.spawn(asyncio.sleep(60), "sleeper")
        t2.cancel()
        await asyncio.gather(t1, t2, return_exceptions=True)
        await a.ask(Ping(0), T)  # any TaskCrashed would be in the mailbox before this
        assert a.crashes == [] and not a._tasks
        await a.stop()

    run(main())


# --- stop ----------------------------------------------------------------------------------------


def test_stop_handles_queued_messages_then_refuses_new_ones() -> None:
    async def main() -> None:
        a = await started(Recorder())
        for i in range(5):
            a.tell(Ping(i))
        await a.stop()
        assert a.seen == [Ping(i) for i in range(5)]
        assert a.stopped and a.stopped_calls == 1
        a.tell(Ping(9))  # dropped silently
        with pytest.raises(Cancelled, match="stopped"):
            await a.ask(Ping(9), T)
        assert Ping(9) not in a.seen
        await a.stop()  # idempotent
        assert a.stopped_calls == 1

    run(main())


def test_stop_before_start_is_a_no_op() -> None:
    async def main() -> None:
        a = Recorder()
        await a.stop()
        assert a.stopped_calls == 0
        with pytest.raises(Cancelled):
            await a.ask(Ping(0), T)

    run(main())


def test_stop_cancels_supervised_tasks_and_waits_for_them() -> None:
    async def main() -> None:
        a = await started(Recorder())
        cleaned = []

        async def worker(i: int) -> None:
            try:
                await asyncio.sleep(60)
            finally:
                await asyncio.sleep(0.01)  # a cleanup that takes a moment
                cleaned.append(i)

        for i in range(3):
            a.spawn(worker(i), f"w{i}")
        await asyncio.sleep(0)
        await a.stop()
        assert sorted(cleaned) == [0, 1, 2]
        assert not a._tasks

    run(main())


def test_stop_from_inside_a_handler_does_not_deadlock() -> None:
    class SelfStopping(Recorder):
        async def on_Ping(self, msg: Ping) -> str:
            await self.stop()
            return "bye"

    async def main() -> None:
        a = await started(SelfStopping())
        assert await asyncio.wait_for(a.ask(Ping(0), T), T) == "bye"
        await wait_for(lambda: a._main is not None and a._main.done(), "the mailbox to end")
        assert a.stopped and a.stopped_calls == 1

    run(main())


def test_stop_cancels_asks_waiting_on_a_deferred_reply() -> None:
    async def main() -> None:
        a = await started(Recorder())
        pending = asyncio.ensure_future(a.ask(Defer("x"), 0.5))
        await a.ask(Ping(0), T)  # Defer was handled; its reply is deferred
        await a.stop()
        with pytest.raises(Cancelled):
            await pending

    run(main())


def test_a_concurrent_stop_waits_until_the_actor_has_stopped() -> None:
    async def main() -> None:
        a = await started(Recorder())

        async def stubborn() -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                await asyncio.sleep(0.1)  # slow cleanup
                raise

        a.spawn(stubborn(), "stubborn")
        await asyncio.sleep(0)
        first = asyncio.ensure_future(a.stop())
        await wait_for(lambda: a.stopped, "the first stop to begin")
        await a.stop()
        try:
            assert a.stopped_calls == 1, "stop() returned before the actor had stopped"
        finally:
            await first

    run(main())


def test_a_handler_awaiting_a_cancelled_future_does_not_kill_the_mailbox() -> None:
    class A(Recorder):
        async def on_Slow(self, msg: Slow) -> None:
            fut = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(msg.delay, fut.cancel)
            await fut  # e.g. another actor's deferred reply, cancelled when it stopped

    async def main() -> None:
        a = await started(A())
        try:
            with pytest.raises((Cancelled, asyncio.CancelledError)):
                await a.ask(Slow(0.01), 0.5)
            assert await a.ask(Ping(1), 0.5) == 2
        finally:
            if a._main is not None and not a._main.done():
                await a.stop()

    run(main())


# --- loops ---------------------------------------------------------------------------------------


def test_run_and_new_event_loop_use_uvloop_when_installed() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def main() -> type:
        return type(asyncio.get_running_loop())

    assert run(main()) is uvloop.Loop
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_loop_thread_runs_coroutines_from_another_thread() -> None:
    lt = LoopThread("test-loop")
    try:
        assert lt.thread.is_alive() and lt.thread is not threading.current_thread()

        async def where() -> str:
            await asyncio.sleep(0)
            return threading.current_thread().name

        assert lt.run(where(), timeout=T) == "test-loop"

        async def fail() -> None:
            raise ValueError("from the loop")

        with pytest.raises(ValueError, match="from the loop"):
            lt.run(fail(), timeout=T)
    finally:
        lt.close()
    assert not lt.thread.is_alive() and lt.loop.is_closed()
    lt.close()  # a second close is harmless


def test_loop_thread_timeout_cancels_the_coroutine() -> None:
    lt = LoopThread()
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        t0 = time.monotonic()
        with pytest.raises(concurrent.futures.TimeoutError):
            lt.run(forever(), timeout=0.05)
        assert time.monotonic() - t0 < 10.0
        assert cancelled.wait(1.0), "the coroutine was not cancelled"
    finally:
        lt.close()


def test_actor_on_a_loop_thread_driven_from_this_thread() -> None:
    lt = LoopThread()
    try:
        a = Recorder()
        lt.run(a.start(), timeout=T)
        assert lt.run(a.ask(Ping(41), T), timeout=T) == 42
        pending = concurrent.futures.Future()

        def ask_deferred() -> None:
            try:
                pending.set_result(lt.run(a.ask(Defer("d"), T), timeout=T))
            except BaseException as err:  # pragma: no cover - reported below
                pending.set_exception(err)

        t = threading.Thread(target=ask_deferred)
        t.start()
        for _ in range(200):
            if "d" in a.deferred:
                break
            time.sleep(0.005)
        lt.loop.call_soon_threadsafe(a.tell, Resolve("d", "from afar"))
        assert pending.result(T) == "from afar"
        t.join(T)
        lt.run(a.stop(), timeout=T)
        assert a.stopped_calls == 1
    finally:
        lt.close()
