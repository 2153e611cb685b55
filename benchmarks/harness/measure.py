"""What a benchmark measures with: wall time of a call (:func:`timings`, with a device sync for
CUDA), the median every figure is reported as, ratios against a baseline measured in the same
run and their verdict against a goal, a process's resident memory (``VmRSS``; :class:`PeakRss`,
the peak from a point on) and its CPU time by pid."""

from __future__ import annotations

import math
import os
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from benchmarks.harness.processes import BenchmarkError

__all__ = ["PeakRss", "cuda_sync", "meets", "median", "process_cpu", "ratio", "status_bytes", "thread_cpu", "timings", "verdict"]


# ---- timing, medians, ratios --------------------------------------------------------------------


def median(xs: Iterable[float | None]) -> float:
    """The median of the figures that exist (``None`` dropped; the mean of the two middle ones
    for an even count); NaN where there are none."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else math.nan


def cuda_sync(device: Any = None) -> None:
    """Wait for the CUDA work queued on ``device`` (all of it by default); nothing without CUDA
    or for a CPU device. torch is imported only here, when called."""
    if device is not None and getattr(device, "type", device) == "cpu":
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize(device)


def timings(fn: Callable[[], Any], repeats: int, warmup: int = 0,
            sync: Callable[[], None] | None = None) -> list[float]:  # fmt: skip
    """Seconds of ``fn()``, ``repeats`` times after ``warmup`` untimed calls. ``sync`` (e.g.
    :func:`cuda_sync`) runs before each start and before each stop, so that work ``fn`` queued on
    a device is counted where it runs."""
    if repeats < 1 or warmup < 0:
        raise BenchmarkError(f"timings: repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    out = []
    for i in range(warmup + repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        dt = time.perf_counter() - t0
        if i >= warmup:
            out.append(dt)
    return out


def ratio(value: float | None, baseline: float | None) -> float:
    """``value / baseline``, both measured in the same run; NaN where either is missing or the
    baseline is zero (a figure that was not measured is never a pass)."""
    if value is None or baseline is None or baseline == 0:
        return math.nan
    return value / baseline


def meets(value: float, target: float, higher_is_better: bool = True) -> bool:
    """Whether ``value`` reaches ``target`` (at least it, or at most it when lower is better);
    False for NaN."""
    if math.isnan(value):
        return False
    return value >= target if higher_is_better else value <= target


def verdict(ok: bool) -> str:
    """How a goal is reported: ``PASS`` or ``MISS`` (a miss is a finding, not an error)."""
    return "PASS" if ok else "MISS"


# ---- resident memory ------------------------------------------------------------------------------


def status_bytes(field: str) -> int:
    """``field`` (e.g. ``VmRSS``) of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        found = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if found is None:
        raise BenchmarkError(f"/proc/self/status has no {field}")
    return int(found.group(1)) << 10


class PeakRss:
    """This process's peak resident memory from now on, against its RSS now.

    The kernel keeps the high-water mark ``VmHWM``; writing ``5`` to ``/proc/self/clear_refs``
    resets it to the current RSS (Linux >= 4.0), so the window's peak is ``VmHWM`` at its end.
    Where the reset is refused, a daemon thread samples ``VmRSS`` every 2 ms instead."""

    def __init__(self) -> None:
        self.base = status_bytes("VmRSS")
        self._sampled = self.base
        self._stop = threading.Event()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM after clear_refs"
        except OSError:
            self.method = "VmRSS sampled every 2 ms"
            threading.Thread(target=self._sample, name="rss-sampler", daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._sampled = max(self._sampled, status_bytes("VmRSS"))

    def peak(self) -> int:
        if self.method.startswith("VmHWM"):
            return status_bytes("VmHWM")
        return max(self._sampled, status_bytes("VmRSS"))

    def close(self) -> None:
        self._stop.set()


# ---- CPU time ------------------------------------------------------------------------------------


def process_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far; 0 where /proc is
    missing (the CPU column then counts the reader alone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far, by kind: the Python thread's name without
    its number (``local-copy``, ``asyncio``...), else the kernel's name of the thread (ZeroMQ's).
    From ``/proc/self/task/*/schedstat`` (nanoseconds; ``stat``'s clock ticks are 10 ms, as much
    as a reader's event loop spends in a round)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            name = names.get(int(tid))
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue
        kind = name.rstrip("0123456789_").split(" (")[0].rstrip("-_") or name
        if kind.startswith("Thread-"):
            kind = "Thread"
        out[kind] = out.get(kind, 0.0) + ns / 1e9
    return out
