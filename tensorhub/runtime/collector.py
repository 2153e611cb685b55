"""The server process's cyclic garbage collector: watched, and kept off the heartbeat path.

Theory of operation
-------------------
CPython's cyclic collector stops the process while it scans. A pass over generation 2 (a full
pass) scans every container object the process holds. A reference server holding thousands of
sessions holds their records for as long as they live (sessions, replicas, holders, layouts,
checksums, votes), plus everything its imports made: at 4,096 sessions a full pass took 40-70 ms
of CPU, and CPython starts one by itself whenever enough objects have outlived the young
generations. Meanwhile the event loop stands still and every heartbeat read waits.

Those long-lived records almost never become cyclic garbage while they live: scanning them
again and again finds nothing (a whole burst through a 4,096-session table leaves none).
:class:`CollectorPacing` therefore takes generation 2 away from CPython's own schedule:

- at start-up, after one full pass, it freezes what survived (``gc.freeze()``: CPython's
  permanent generation, which no pass scans): the imports, the configuration;
- it sets generation 2's threshold out of reach, so that CPython runs no full pass of its own
  (generations 0 and 1, the young objects, keep theirs: they are cheap and reclaim most cycles);
- every ``freeze_every`` seconds (the server's tick calls :meth:`CollectorPacing.tick`) it runs a
  pass over the young generations and freezes what survived it, generation 2 included. A
  burst's records thus land in the frozen heap within a tick instead of piling up in a
  generation 2 that CPython scans whole (50-150 ms of CPU per pass at 4,096 sessions).

What it must never do: let memory grow without bound. A frozen object is still freed by
reference counting, the common case (a closed session's records once nothing refers to them);
but frozen objects that later become *cyclic* garbage are reclaimed only by a pass that scans
them. So a full pass over everything (``gc.unfreeze()``, ``gc.collect()``, freeze again) runs
when the frozen heap has grown ``full_growth`` times (2) past what was alive after the last one
(or past ``full_floor`` objects, whichever is more), and at least every ``full_every`` seconds
(10 minutes): what cyclic garbage can pile up is bounded by that factor of the live heap and by
that time. That pass is the 50-150 ms pause again, but once per ``full_every`` in a steady
state (more often only while the heap grows: as thousands of sessions open) instead of whenever
CPython's thresholds fall due. Its passes are counted apart (``on_purpose``).

:class:`CollectorWatch` counts every pass (``gc.callbacks``): passes, wall and CPU seconds and
the longest, per generation, for the server's metrics and ``benchmarks/server_load.py``.

The thresholds are CPython 3.8-3.13's (three generations, the third run when the second's count
passes its threshold); a CPython with another collector keeps its own schedule and only the
freezes apply.

Both act on the whole process (the collector is one per interpreter), so only the server's own
process uses them (:func:`tensorhub.runtime.server.serve`), never a server embedded in another
program's process.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tensorhub.errors import InvalidArgument

__all__ = ["CollectorPacing", "CollectorWatch", "PAUSE_BUCKETS"]

#: histogram bounds (seconds) of a collector pass
PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass(slots=True)
class _Generation:
    passes: int = 0
    seconds: float = 0.0  #: wall time (what a heartbeat read meanwhile waits)
    cpu_seconds: float = 0.0  #: the thread's CPU time (what no other load on the machine moves)
    longest: float = 0.0
    longest_cpu: float = 0.0
    collected: int = 0
    #: pass counts per bucket of :data:`PAUSE_BUCKETS` (the last: past the last bound)
    buckets: list[int] = field(default_factory=lambda: [0] * (len(PAUSE_BUCKETS) + 1))


class CollectorWatch:
    """Every collector pass of this process, per generation (0, 1, 2), from ``gc.callbacks``.

    ``install()`` adds the callback, ``remove()`` takes it out; the figures stay readable."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.generations = [_Generation() for _ in range(3)]
        #: the full passes :class:`CollectorPacing` runs on purpose (not in ``generations``)
        self.on_purpose = _Generation()
        self.purposeful = False  # set while such a pass runs
        self._started: float | None = None
        self._started_cpu = 0.0
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def remove(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self.clock()
            self._started_cpu = time.thread_time()
            return
        if self._started is None:  # installed during a pass
            return
        took = self.clock() - self._started
        self._started = None
        g = self.on_purpose if self.purposeful else self.generations[min(2, max(0, int(info.get("generation", 2))))]
        g.passes += 1
        g.seconds += took
        cpu = time.thread_time() - self._started_cpu
        g.cpu_seconds += cpu
        if cpu > g.longest_cpu:
            g.longest_cpu = cpu
        g.collected += int(info.get("collected", 0))
        if took > g.longest:
            g.longest = took
        i = 0
        while i < len(PAUSE_BUCKETS) and took > PAUSE_BUCKETS[i]:
            i += 1
        g.buckets[i] += 1


class CollectorPacing:
    """Freezes the process's long-lived objects out of the collector's passes, takes generation
    2 off CPython's schedule, and runs the full pass that reclaims frozen cyclic garbage rarely
    and on purpose (see the module docstring).

    Args:
        freeze_every: seconds between freezes of what survived (the young generations' pass first).
        full_every: a full pass over everything, frozen included, at least this often (seconds).
        full_growth: a full pass as soon as the frozen objects outnumber those alive after the
            last full pass (or ``full_floor``, whichever is more) by this factor (> 1).
        full_floor: the fewest objects the growth is counted from (a heap that small is
            scanned in a few milliseconds).
        clock: monotonic seconds.
        pace: False: only watch the passes, leave the collector as CPython runs it (the
            baseline ``tensorhub server --gc watched`` measures).

    Raises:
        InvalidArgument: a period that is not positive, a growth factor not above 1, or a
            negative floor.
    """

    #: generation 2's threshold while paced: ``gc.collect(1)`` passes before CPython runs a full one
    OUT_OF_REACH = 1 << 30

    def __init__(self, freeze_every: float = 1.0, full_every: float = 600.0, full_growth: float = 2.0,
                 full_floor: int = 50_000, clock: Callable[[], float] = time.monotonic, pace: bool = True) -> None:  # fmt: skip
        if not freeze_every > 0 or not full_every > 0:
            raise InvalidArgument(f"collector pacing: freeze_every and full_every must be > 0 seconds, got {freeze_every!r}, {full_every!r}")
        if not full_growth > 1:
            raise InvalidArgument(f"collector pacing: full_growth must be > 1, got {full_growth!r}")
        if full_floor < 0:
            raise InvalidArgument(f"collector pacing: full_floor must be >= 0 objects, got {full_floor!r}")
        self.freeze_every = freeze_every
        self.full_every = full_every
        self.full_growth = full_growth
        self.full_floor = full_floor
        self.clock = clock
        self.pace = pace
        self.watch = CollectorWatch()
        self.freezes = 0
        self.full_passes = 0  #: the full passes this pacing ran on purpose (not CPython's own)
        self.full_seconds = 0.0
        self.frozen_after_full = 0
        self._frozen_at = self._full_at = 0.0
        self._thresholds: tuple[int, ...] | None = None
        self._started = False

    def start(self) -> None:
        """Install the watch; paced: run one full pass, freeze what survives (the start-up
        heap), and take generation 2 off CPython's schedule."""
        if self._started:
            return
        self._started = True
        self.watch.install()
        if self.pace:
            self._thresholds = gc.get_threshold()
            t0, t1, *_ = self._thresholds
            gc.set_threshold(t0, t1, self.OUT_OF_REACH)
            self._full(self.clock())

    def stop(self) -> None:
        """Give every frozen object back to the collector, its thresholds as they were, and
        take the watch out."""
        if not self._started:
            return
        self._started = False
        if self.pace:
            gc.unfreeze()
            if self._thresholds is not None:
                gc.set_threshold(*self._thresholds)
        self.watch.remove()

    def tick(self) -> str | None:
        """Called by the server's tick. Returns what it did: ``"full"``, ``"freeze"`` or None."""
        if not self._started or not self.pace:
            return None
        now = self.clock()
        frozen = gc.get_freeze_count()
        if now - self._full_at >= self.full_every or frozen > self.full_growth * max(self.frozen_after_full, self.full_floor):
            self._full(now)
            return "full"
        if now - self._frozen_at >= self.freeze_every:
            gc.collect(1)  # young cyclic garbage goes now, not into the frozen heap
            gc.freeze()
            self.freezes += 1
            self._frozen_at = now
            return "freeze"
        return None

    def _full(self, now: float) -> None:
        t0 = time.perf_counter()
        gc.unfreeze()
        self.watch.purposeful = True
        try:
            gc.collect()
        finally:
            self.watch.purposeful = False
        gc.freeze()
        self.full_seconds += time.perf_counter() - t0
        self.full_passes += 1
        self.frozen_after_full = gc.get_freeze_count()
        self._full_at = self._frozen_at = now
