"""The discrete-event core: a virtual clock, an event queue, one seeded random source, a trace.

Events are callbacks at virtual times. Two events at the same time run in the order they were
scheduled (a sequence number breaks the tie), so a run is a pure function of its seed: the same
seed gives the same trace, event for event, and :attr:`Simulator.digest` says so in one string.

A run ends when the queue is empty, at ``until``, or after ``max_events`` (a bound, never a hang).
A simulation that goes idle while something still waits for an answer is a failure, not a hang:
scenarios call :meth:`Simulator.run` and then check what they waited for (:class:`SimStuck`).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import random
from collections.abc import Callable
from typing import Any

from tensorhub.core.errors import InvalidArgument, TensorHubError

__all__ = ["SimStuck", "Simulator", "Timer"]


class SimStuck(TensorHubError):
    """The simulation ran out of events (or hit its bound) with work still pending."""

    code = "sim_stuck"


class Timer:
    """A scheduled event that can be cancelled (cancelling twice, or after it ran, is a no-op)."""

    __slots__ = ("args", "cancelled", "fn", "time")

    def __init__(self, time: float, fn: Callable[..., Any], args: tuple) -> None:
        self.time = time
        self.fn = fn
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Simulator:
    """Virtual time and the event queue.

    Args:
        seed: the one seed of the run; :attr:`rng` is the only random source, and every
            component that needs randomness (the reference table's tie-breaks included) draws
            its own generator from it at construction.
        trace: keep the trace (``(time, kind, detail)``) in memory; the digest is kept anyway.
    """

    def __init__(self, seed: int = 0, trace: bool = False) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise InvalidArgument(f"the simulation seed must be an int, got {seed!r}")
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0
        self.events = 0
        self._queue: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._hash = hashlib.sha256()
        self.keep_trace = trace
        self.trace: list[tuple[float, str, str]] = []
        #: called after every event (the churn tests check the table's invariants there)
        self.after_event: list[Callable[[], None]] = []

    def child_rng(self) -> random.Random:
        """A generator for one component, drawn from the run's one source."""
        return random.Random(self.rng.getrandbits(64))

    def at(self, time: float, fn: Callable[..., Any], *args: Any) -> Timer:
        """Run ``fn(*args)`` at virtual time ``time`` (not before now)."""
        t = Timer(max(time, self.now), fn, args)
        heapq.heappush(self._queue, (t.time, next(self._seq), t))
        return t

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> Timer:
        """Run ``fn(*args)`` ``delay`` seconds from now."""
        return self.at(self.now + max(delay, 0.0), fn, *args)

    def record(self, kind: str, detail: str = "") -> None:
        """Add a line to the trace (and to the digest)."""
        self._hash.update(f"{self.now:.9f} {kind} {detail}\n".encode())
        if self.keep_trace:
            self.trace.append((self.now, kind, detail))

    @property
    def digest(self) -> str:
        """A hash of the trace so far: equal for equal seeds and scenarios."""
        return self._hash.hexdigest()

    def _step(self, until: float | None) -> bool:
        """Run the next event if there is one due by ``until``; False when there is none."""
        while self._queue:
            time, _, timer = self._queue[0]
            if until is not None and time > until:
                return False
            heapq.heappop(self._queue)
            if timer.cancelled:
                continue
            self.now = time
            self.events += 1
            timer.fn(*timer.args)
            for hook in self.after_event:
                hook()
            return True
        return False

    def run(self, until: float | None = None, max_events: int = 50_000_000) -> None:
        """Process events in time order until the queue is empty, virtual time passes ``until``,
        or ``max_events`` events have run in this call (then :class:`SimStuck`)."""
        for _ in range(max_events):
            if not self._step(until):
                if until is not None and self._queue:
                    self.now = until  # the next event is later: time still passes to ``until``
                return
        raise SimStuck(f"the simulation did not settle within {max_events} events (virtual time {self.now:.3f} s)")

    def run_until(self, done: Callable[[], bool], limit: float, what: str) -> None:
        """Run until ``done()`` holds; :class:`SimStuck` if the queue empties or virtual time
        passes ``now + limit`` first."""
        deadline = self.now + limit
        for _ in range(10_000_000):
            if done() or not self._step(deadline):
                break
        if done():
            return
        state = "no event left" if not self._queue else f"nothing done by virtual time {deadline:.3f} s"
        raise SimStuck(f"{what}: {state} (seed {self.seed})")
