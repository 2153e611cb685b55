"""What ``bench_transfer.py`` (and the suite beside it) measures a process with: its resident
memory (``VmRSS``; ``PeakRss``, the peak from a point on), its CPU time by pid, and the median
that every figure is reported as."""

from __future__ import annotations

import os
import re
import threading

from server_process import BenchmarkError

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


# ---- CPU time, medians --------------------------------------------------------------------------


def process_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far; 0 where /proc is
    missing (the CPU column then counts the reader alone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2
