"""A small asyncio actor runtime: the shape of the server, client and engine.

Theory of operation
-------------------
An :class:`Actor` owns its state and changes it only in :meth:`Actor.receive`, which its one
mailbox task calls for each message, in order. Others talk to it by message only:

- ``tell(msg)``: fire and forget;
- ``await ask(msg, timeout)``: request/reply. A handler that cannot answer at once returns an
  :class:`asyncio.Future` and resolves it later (for example when the server's reply arrives);
  the mailbox goes on meanwhile, so a slow request never blocks the actor;
- timers (``after``, ``every``) deliver messages into the mailbox;
- ``spawn(coro)``: a supervised task (socket readers, transfers). If one dies of an unexpected
  exception the actor is told with :class:`TaskCrashed`; by default it logs and stops.

Handlers must not block: bulk work (copies, socket reads, checksums) runs in threads
(``asyncio.to_thread`` or a transport's executor), so timers such as heartbeats are never
starved. ``stop()`` ends the mailbox, cancels timers and supervised tasks, and waits for them.

:func:`new_event_loop` makes a loop on uvloop when it is installed; :class:`LoopThread` runs
one in a background thread for the synchronous facade.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from tensorhub.core.errors import Cancelled, Timeout
from tensorhub.core.log import get_logger

__all__ = ["Actor", "LoopThread", "TaskCrashed", "new_event_loop"]

try:  # uvloop when installed; the standard loop otherwise
    import uvloop as _uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
    _uvloop = None  # type: ignore[assignment]  # the name is typed as the module: None says it is absent


def new_event_loop() -> asyncio.AbstractEventLoop:
    return _uvloop.new_event_loop() if _uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run`` on uvloop when installed."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


@dataclass(frozen=True, slots=True)
class TaskCrashed:
    """A supervised task of this actor died of ``error``."""

    name: str
    error: BaseException


_STOP = object()


class Actor:
    """Base of the asyncio actors. Subclasses implement ``on_<MessageClass>`` handlers (or
    override :meth:`receive`), and may override :meth:`on_start` / :meth:`on_stop`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.log = get_logger(actor=name)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._mailbox: asyncio.Queue[tuple[Any, asyncio.Future | None]] | None = None
        self._main: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self._askers: set[asyncio.Future] = set()
        self._handling: asyncio.Future | None = None  # the asker of the message being handled
        self._stopping: asyncio.Future | None = None
        self.stopped = False

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._mailbox = asyncio.Queue()
        self._main = self.loop.create_task(self._mailbox_loop(), name=f"{self.name}-mailbox")
        await self.on_start()

    async def on_start(self) -> None:
        """Called once the mailbox runs."""

    async def on_stop(self) -> None:
        """Called once the mailbox, timers and tasks have ended."""

    async def stop(self) -> None:
        """End the mailbox (after the messages already in it), timers and supervised tasks.
        Asks still waiting get :class:`Cancelled`. A second call waits for the first to finish
        (unless made from inside the actor, which the first is busy cancelling)."""
        if self._mailbox is None:
            return
        if self._stopping is not None:
            current = asyncio.current_task()
            if current is not self._main and current not in self._tasks:
                await asyncio.shield(self._stopping)
            return
        self._stopping = asyncio.get_running_loop().create_future()
        try:
            await self._stop()
        finally:
            self._stopping.set_result(None)

    async def _stop(self) -> None:
        assert self._mailbox is not None
        self.stopped = True
        for h in self._timers:
            h.cancel()
        self._timers.clear()
        self._mailbox.put_nowait((_STOP, None))
        current = asyncio.current_task()
        if self._main is not None and self._main is not current:
            await self._main
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for fut in list(self._askers):  # deferred answers that will never come
            if not fut.done() and fut is not self._handling:
                fut.set_exception(Cancelled(f"actor {self.name} stopped"))
        await self.on_stop()

    # ---- messaging ---------------------------------------------------------------------------

    def tell(self, msg: Any) -> None:
        """Deliver ``msg`` to the mailbox (from the actor's own loop)."""
        if self._mailbox is None or self.stopped:
            return
        self._mailbox.put_nowait((msg, None))

    async def ask(self, msg: Any, timeout: float | None = None) -> Any:
        """Deliver ``msg`` and wait for the handler's answer.

        Raises:
            Timeout: no answer within ``timeout`` seconds.
            Cancelled: the actor stopped first.
            Whatever the handler raised.
        """
        if self._mailbox is None or self.stopped:
            raise Cancelled(f"actor {self.name} is stopped")
        fut = asyncio.get_running_loop().create_future()
        self._mailbox.put_nowait((msg, fut))
        self._askers.add(fut)
        fut.add_done_callback(self._askers.discard)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            if not fut.cancelled():
                raise  # the handler's own answer was a timeout error: pass it on as it is
            raise Timeout(f"actor {self.name} did not answer {type(msg).__name__} in {timeout} s") from None

    def receive(self, msg: Any) -> Any:
        """Handle one message; the default dispatches to ``on_<type name>``."""
        handler = getattr(self, "on_" + type(msg).__name__, None)
        if handler is None:
            raise TypeError(f"actor {self.name} has no handler for {type(msg).__name__}")
        return handler(msg)

    async def _mailbox_loop(self) -> None:
        assert self._mailbox is not None
        while True:
            self._handling = None
            msg, fut = await self._mailbox.get()
            if msg is _STOP:
                break
            self._handling = fut
            try:
                result = self.receive(msg)
                if asyncio.iscoroutine(result):
                    result = await result
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the mailbox itself is being cancelled
                # Something the handler awaited was cancelled: that is its answer, not our end.
                if fut is not None and not fut.done():
                    fut.set_exception(Cancelled(f"{type(msg).__name__} was cancelled in actor {self.name}"))
                continue
            except Exception as err:  # noqa: BLE001 - a handler's failure is its caller's answer
                if fut is not None:
                    if not fut.done():
                        fut.set_exception(err)
                else:
                    self.log.exception("handler failed", message=type(msg).__name__)
                continue
            if fut is None or fut.done():
                continue
            if isinstance(result, asyncio.Future):
                _chain(result, fut)
            else:
                fut.set_result(result)
        # Whoever still waits on the mailbox is told it is closed.
        while not self._mailbox.empty():
            _, fut = self._mailbox.get_nowait()
            if fut is not None and not fut.done():
                fut.set_exception(Cancelled(f"actor {self.name} stopped"))

    # ---- timers and tasks --------------------------------------------------------------------

    def after(self, delay: float, msg: Any) -> asyncio.TimerHandle:
        """Deliver ``msg`` after ``delay`` seconds (cancel with the returned handle)."""
        assert self.loop is not None
        handle: asyncio.TimerHandle

        def fire() -> None:
            self._timers.discard(handle)
            self.tell(msg)

        handle = self.loop.call_later(delay, fire)
        self._timers.add(handle)
        return handle

    def every(self, interval: float, make: Callable[[], Any]) -> asyncio.Task:
        """Deliver ``make()`` every ``interval`` seconds until the actor stops."""

        async def tick() -> None:
            while not self.stopped:
                await asyncio.sleep(interval)
                self.tell(make())

        return self.spawn(tick(), f"{self.name}-every")

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a supervised task of this actor."""
        assert self.loop is not None
        task = self.loop.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        err = task.exception()
        if err is not None and not self.stopped:
            self.tell(TaskCrashed(task.get_name(), err))

    def on_TaskCrashed(self, msg: TaskCrashed) -> None:
        self.log.error("supervised task crashed; stopping", task=msg.name, error=repr(msg.error))
        self.spawn(self.stop(), f"{self.name}-stop")


def _chain(src: asyncio.Future, dst: asyncio.Future) -> None:
    def done(f: asyncio.Future) -> None:
        if dst.done():
            return
        if f.cancelled():
            dst.cancel()
        elif (err := f.exception()) is not None:
            dst.set_exception(err)
        else:
            dst.set_result(f.result())

    src.add_done_callback(done)
    # An asker that gives up (timeout, cancellation) cancels the handler's future too, so that
    # its later answer is not an unretrieved exception.
    dst.add_done_callback(lambda d: src.cancel() if d.cancelled() and not src.done() else None)


class LoopThread:
    """An event loop running in a daemon thread, for the synchronous facade."""

    def __init__(self, name: str = "tensorhub-loop") -> None:
        self.loop = new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run ``coro`` on the loop and wait for its result from this (other) thread. If the
        waiting thread is interrupted (or ``timeout`` passes), the coroutine is cancelled."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except BaseException:
            if not fut.done():
                fut.cancel()
            raise

    def close(self, timeout: float = 5.0) -> None:
        if not self.loop.is_running():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.loop.close()
