"""The benchmark harness: the pieces every script in ``benchmarks/`` is built from.

- :mod:`benchmarks.harness.processes`: the reference server a benchmark starts on a free
  loopback port (:func:`start_server`, :func:`stop_process`), helper processes spoken to over a
  pipe (:class:`Child`), started by ``spawn`` or from a fork server (:func:`fork_server`), and :class:`BenchmarkError`, raised when a run cannot measure honestly;
- :mod:`benchmarks.harness.measure`: wall time of a call (:func:`timings`), medians, ratios
  against a baseline measured in the same run and their verdict against a goal, resident memory
  (:class:`PeakRss`) and CPU time of a process;
- :mod:`benchmarks.harness.shards`: the shards that are moved (the ``64x16MiB`` and
  ``model-500`` workloads), their seeded content and the check of the bytes that arrived. It
  imports torch, so it is not imported here: ``from benchmarks.harness.shards import ...``;
- :mod:`benchmarks.harness.report`: JSON output, plots, the commit measured.

Every script states near its top, in its module docstring, three lines that
``tests/test_bench_harness.py`` checks::

    Workload: what is moved or called, how much, by how many processes.
    Baseline: what the figure is a ratio against, measured in the same run (or why none).
    Goal: the target the figure is checked against (or why none).

A script run by path (``python benchmarks/NAME.py``) puts the repository root on ``sys.path``
and imports its siblings as ``benchmarks.NAME``, never by bare name: one module, one copy (a
bare-name import beside a package import loads a module twice, with two ``BenchmarkError``
classes that do not catch each other).
"""

from benchmarks.harness.measure import (
    PeakRss,
    cuda_sync,
    median,
    meets,
    process_cpu,
    ratio,
    status_bytes,
    thread_cpu,
    timings,
    verdict,
)
from benchmarks.harness.processes import BenchmarkError, Child, fork_server, free_port, in_checkout, start_server, stop_process
from benchmarks.harness.report import git_head, pyplot, write_json

__all__ = [
    "BenchmarkError",
    "Child",
    "PeakRss",
    "cuda_sync",
    "fork_server",
    "free_port",
    "git_head",
    "meets",
    "median",
    "process_cpu",
    "pyplot",
    "ratio",
    "start_server",
    "status_bytes",
    "thread_cpu",
    "stop_process",
    "timings",
    "verdict",
    "write_json",
]
