"""TensorHub side by side with the alternatives: one suite, one machine, same data, same run.

Workload: a shard (``64x16MiB``, ``model-500``, about ``--size-mib``) from one holder process to
1, 2 and 4 reader processes, by TensorHub and each alternative system.
Baseline: memcpy, a raw socket, gloo, Ray, raw NIXL, Mooncake on the same bytes, same run.
Goal: <= 0.5x gloo and <= 0.7x Ray at 4 readers; >= 0.7x memcpy at 1; holder RSS <= 64 MiB.

``python -m benchmarks [PART ...] [options]`` (PART: ``all``, the default, or any of
``tensorhub``, ``memcpy``, ``floor``, ``socket``, ``gloo``, ``ray``, ``nixl``, ``mooncake``) measures
each system moving a shard from one holder process to 1, 2 and 4 reader processes and writes
``benchmarks/results/<timestamp>.json`` (every sample) and ``<timestamp>.md`` (tables, ratios,
goals) with PNG plots beside it. ``python -m benchmarks report FILE.json`` redraws the report
of an earlier run.

Systems (``benchmarks/suite_systems.py`` has the details of each):

- ``tensorhub[T]``: a reference server, a trainer process that ``publish``es, reader processes
  that ``replicate`` into their registered tensors, over transport ``T`` (``--tensorhub-transports``,
  default ``local``: the same-host transport, ``process_vm_readv``);
- ``memcpy``: one thread copying the shard within one process (one reader only): the limit;
- ``verified copy`` (part ``floor``): the least any design that gives each reader its own
  verified copy does: the holder hashes once and posts its checksums, each reader
  ``process_vm_readv``s and hashes every piece, then compares; no server, no messages;
- ``raw socket``: a TCP connection per reader, ``sendall`` from / ``recv_into`` the tensors;
- ``gloo broadcast`` and ``gloo p2p``: torch.distributed's gloo backend, per tensor;
- ``ray torch`` and ``ray numpy``: Ray's object store, ``put`` then ``get`` and a copy into
  the reader's tensors (torch tensors; numpy views, Ray's zero-copy path on one host);
- ``raw nixl``: bare NIXL agents, one-sided READs;
- ``mooncake``: Mooncake's transfer engine, CPU build, ``tcp`` protocol.

Ray and Mooncake come with the ``bench`` extra, in an environment of their own::

    python -m venv .venv-bench && echo '*' > .venv-bench/.gitignore
    .venv-bench/bin/pip install torch==2.13.0      # first: the CPU build, before anything needs torch
    .venv-bench/bin/pip install -e '.[bench,dev]'
    .venv-bench/bin/python -m benchmarks all

(or ``tox -e bench``, the quick version). A part whose library does not import is skipped, and
the report says why.

Workloads (``--workloads``): ``64x16MiB``, 64 equal tensors; ``model-500``, 500 tensors of
seeded sizes, half under 64 KiB, in a shuffled model-like order; both about ``--size-mib``.

How a figure is measured. Each (system, workload, reader count) is a *group*: fresh processes
(a holder and N readers, spawned), connected once (untimed: process groups, agents,
registrations, connections), then ``--warmup`` untimed rounds and ``--repeats`` timed ones. A
round starts at one instant of the host's monotonic clock in every process; a reader's time is
when the last byte of its shard had landed in its own preallocated tensors (for the stores: put
+ reference + get + copy; for TensorHub: publish + replicate, which includes verification and
unpacking). The round's wall time is the last reader's. Only then, untimed, each reader hashes
every tensor (xxh3-64) against the expected content: a round with one wrong byte fails the
group (and the exit status). The whole sweep runs ``--rounds`` times, the system order rotated
each time, so that other load on this machine falls on all systems alike; figures are medians
over all timed rounds. Memory: each process's peak RSS (``VmHWM`` after ``clear_refs``, as in
``bench_transfer.py``) minus its RSS right after allocating its tensors, over the whole group.
CPU: user + system seconds of all the group's processes per GB delivered.

Goals (issue 9), checked on ``64x16MiB``: TensorHub to 4 readers in <= 0.5 x the gloo broadcast
time and <= 0.7 x Ray's put + get with numpy views; one reader at >= 0.7 x memcpy's GB/s; the
TensorHub holder's RSS beyond its registered tensors <= 64 MiB (every TensorHub group). A goal
that is missed is reported (MISS) with the figures that say why; it is not an error.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import multiprocessing.connection
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

from benchmarks.harness import (
    BenchmarkError,
    Child,
    fork_server,
    free_port,
    git_head,
    median,
    process_cpu,
    start_server,
    stop_process,
    write_json,
)
from benchmarks.harness.shards import WORKLOADS, allocate, fill_seeded, spec_bytes, workload_spec
from benchmarks.suite_report import goals, packed_bytes, write_report
from benchmarks.suite_report import main as report_main
from benchmarks.suite_systems import (
    System,
    hashes_of,
    ray_head_main,
    side_main,
    systems,
)

PARTS = ("tensorhub", "memcpy", "floor", "socket", "gloo", "ray", "nixl", "mooncake")
RESULTS = _HERE / "results"
QUICK = {"size_mib": 64, "readers": "1,2,4", "repeats": 2, "warmup": 1, "rounds": 1}
FULL = {"size_mib": 1024, "readers": "1,2,4", "repeats": 3, "warmup": 1, "rounds": 1}


class SuiteError(ValueError):
    """Bad input to the suite (an unknown part, a bad size...): the message names it."""


# ---- arguments ---------------------------------------------------------------------------------


def _int_list(text: str, what: str, low: int, high: int) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or not low <= int(item) <= high:
            raise SuiteError(
                f"{what}: {item!r} is not an integer in [{low}, {high}] (got {text!r})"
            )
        out.append(int(item))
    if len(set(out)) != len(out):
        raise SuiteError(f"{what}: {text!r} names a value twice")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n")[0]
    )
    ap.add_argument("parts", nargs="*", default=["all"], metavar="PART",
                    help=f"all (default), or any of: {', '.join(PARTS)}")  # fmt: skip
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the quick version (tox -e bench): "
        + ", ".join(f"{k}={v}" for k, v in QUICK.items()),
    )
    ap.add_argument(
        "--size-mib",
        type=int,
        help=f"bytes of each shard, MiB (default {FULL['size_mib']}; quick {QUICK['size_mib']})",
    )
    ap.add_argument(
        "--readers", help=f"reader counts, comma-separated (default {FULL['readers']})"
    )
    ap.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {', '.join(WORKLOADS)}",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        help=f"timed rounds per group and sweep (default {FULL['repeats']})",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        help=f"untimed rounds per group first (default {FULL['warmup']})",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        help=f"sweeps over all groups, system order rotated (default {FULL['rounds']})",
    )
    ap.add_argument("--tensorhub-transports", default="local",
                    help="TensorHub rows: one per transport, comma-separated (local, local-shm: local with every side's "
                         "tensors registered in shared memory, tcp, nixl, rdma_copy); the first is the goals' row")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--timeout", type=float, default=300.0, help="bound on every wait, seconds"
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help="folder for the JSON, markdown and PNGs",
    )
    ap.add_argument(
        "--name", help="file name stem of the outputs (default: the start time)"
    )
    ap.add_argument(
        "--notes",
        type=Path,
        help="a markdown file appended to the report (the reading of the figures)",
    )
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument(
        "--no-thp",
        action="store_true",
        help="leave torch's CPU allocations on 4 KiB pages (default: THP_MEM_ALLOC_ENABLE=1 for every process, "
        "so every system's tensors sit on transparent huge pages alike)",
    )
    args = ap.parse_args(argv)
    mode = QUICK if args.quick else FULL
    for key, value in mode.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    parts = [p.strip().lower() for p in args.parts for p in p.split(",") if p.strip()]
    unknown = [p for p in parts if p not in (*PARTS, "all")]
    if unknown or not parts:
        raise SuiteError(
            f"unknown part {', '.join(map(repr, unknown)) or '(none)'}: choose all or any of {', '.join(PARTS)}"
        )
    args.parts = list(PARTS) if "all" in parts else [p for p in PARTS if p in parts]
    if not 1 <= args.size_mib <= 64 << 10:
        raise SuiteError(f"--size-mib must be in [1, 65536], got {args.size_mib}")
    if (
        not 1 <= args.repeats <= 1000
        or not 0 <= args.warmup <= 100
        or not 1 <= args.rounds <= 100
    ):
        raise SuiteError(f"--repeats must be in [1, 1000], --warmup in [0, 100], --rounds in [1, 100]; "
                         f"got {args.repeats}, {args.warmup}, {args.rounds}")  # fmt: skip
    if not 1 <= args.timeout <= 3600:
        raise SuiteError(f"--timeout must be in [1, 3600] seconds, got {args.timeout}")
    args.readers = sorted(_int_list(str(args.readers), "--readers", 1, 16))
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.workloads:
        raise SuiteError(
            f"--workloads: unknown {', '.join(map(repr, bad)) or '(none)'}; choose from {', '.join(WORKLOADS)}"
        )
    args.tensorhub_transports = [
        t.strip() for t in args.tensorhub_transports.split(",") if t.strip()
    ]
    known = ("local", "local-shm", "tcp", "nixl", "rdma_copy")
    bad = [t for t in args.tensorhub_transports if t not in known]
    if bad or not args.tensorhub_transports:
        raise SuiteError(
            f"--tensorhub-transports: unknown {', '.join(map(repr, bad)) or '(none)'}; choose from {', '.join(known)}"
        )
    if args.notes is not None and not args.notes.is_file():
        raise SuiteError(f"--notes: no such file {str(args.notes)!r}")
    return args


def expected_hashes(spec: list, seed: int) -> list[int]:
    """The xxh3-64 of each tensor of ``spec`` filled with ``seed``'s content, computed here,
    apart from every holder: what a reader must hold after a round."""
    tensors = allocate(spec)
    fill_seeded(tensors, seed)
    out = hashes_of(tensors)
    del tensors
    return out


# ---- one group -------------------------------------------------------------------------------------


def fork_child(name: str, target: Any, args: tuple, timeout: float) -> Child:
    """A helper process (:class:`benchmarks.harness.Child`) started from the fork server, where
    the systems' module (torch with it) is imported once."""
    return Child(name, target, args, timeout, context=fork_server("benchmarks.suite_systems"))


class Group:
    """A holder and ``n`` readers of one system, their processes alive from ``__init__`` to
    :meth:`close`."""

    def __init__(self, system: System, spec: list, expected: list[int], n: int, options: dict, name: str,
                 args: argparse.Namespace) -> None:  # fmt: skip
        self.system, self.n, self.timeout = system, n, args.timeout
        common = (system, spec, args.seed)
        self.holder: Child | None = None
        self.procs: list[Child] = []
        try:
            if system.holder is not None:
                self.holder = fork_child(
                    "holder",
                    side_main,
                    ("holder", *common, 0, n, expected, options, name, args.timeout),
                    args.timeout,
                )
                self.procs.append(self.holder)
            self.readers = []
            for i in range(n):
                self.readers.append(
                    fork_child(
                        f"reader{i}",
                        side_main,
                        (
                            "reader",
                            *common,
                            i,
                            n,
                            expected,
                            options,
                            name,
                            args.timeout,
                        ),
                        args.timeout,
                    )
                )
                self.procs.append(self.readers[-1])
            self.info = self.holder.expect("ready")[1] if self.holder else None
            for r in self.readers:
                r.expect("ready")
        except BaseException:
            self.close()
            raise

    def everyone(self, *cmd: Any, answer: str) -> list[tuple]:
        for p in self.procs:
            p.send(*cmd)
        return [p.expect(answer) for p in self.procs]

    def round(self, version: int) -> dict[str, Any]:
        self.everyone("prepare", version, answer="prepared")
        pids = [p.proc.pid for p in self.procs]
        cpu0 = sum(process_cpu(pid) for pid in pids)
        start_at = time.monotonic() + 0.05 + 0.01 * len(self.procs)
        for p in self.procs:
            p.send("go", version, start_at)
        done = self._gather_done()
        cpu = sum(process_cpu(pid) for pid in pids) - cpu0
        readers = [done[r] for r in self.readers]
        for i, (_, _, _, _, bad) in enumerate(readers):
            if bad:
                raise BenchmarkError(f"{self.system.name}: reader {i} holds wrong bytes in {len(bad)} tensors after "
                                     f"round {version} (first: {', '.join(bad[:3])})")  # fmt: skip
        ends = [end - start_at for _, _, end, _, _ in readers]
        late = max(started - start_at for _, started, _, _, _ in done.values())
        return {"wall_s": max(ends), "reader_s": ends, "late_start_s": late, "cpu_s": cpu,
                "holder": done[self.holder][3] if self.holder else None,
                "readers": [extra for _, _, _, extra, _ in readers]}  # fmt: skip

    def _gather_done(self) -> dict[Child, tuple]:
        pending = {p.conn: p for p in self.procs}
        done: dict[Child, tuple] = {}
        deadline = time.monotonic() + self.timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchmarkError(f"{self.system.name}: {', '.join(p.name for p in pending.values())} did not finish "
                                     f"a round within {self.timeout:g} s")  # fmt: skip
            for conn in multiprocessing.connection.wait(
                list(pending), timeout=min(left, 1.0)
            ):
                p = pending[conn]
                try:
                    msg = conn.recv()
                except EOFError:
                    raise BenchmarkError(
                        f"{self.system.name}: the {p.name} process died (exit code {p.proc.exitcode})"
                    ) from None
                if msg[0] == "error":
                    raise BenchmarkError(
                        f"{self.system.name}: the {p.name} process failed:\n{msg[1]}"
                    )
                if msg[0] != "done":
                    raise BenchmarkError(
                        f"{self.system.name}: the {p.name} process answered {msg[0]!r}, expected 'done'"
                    )
                done[p] = msg
                del pending[conn]
            for conn, p in list(pending.items()):
                if not p.proc.is_alive() and not conn.poll():
                    raise BenchmarkError(
                        f"{self.system.name}: the {p.name} process died (exit code {p.proc.exitcode})"
                    )
        return done

    def memory(self) -> dict[str, Any]:
        got = self.everyone("memory", answer="memory")
        mib = [(peak - base) / (1 << 20) for _, base, peak, _ in got]
        holder = mib[0] if self.holder else None
        return {
            "holder_mib": holder,
            "reader_mib": mib[1:] if self.holder else mib,
            "method": got[0][3],
        }

    def close(self) -> None:
        for p in self.procs:  # all told first: they wind down together
            p.send("quit")
        for p in self.procs:
            try:
                p.stop()
            except Exception as err:  # noqa: BLE001 - go on stopping the others
                print(f"stopping {p.name}: {err!r}", file=sys.stderr)


def run_group(system: System, workload: str, spec: list, expected: list[int], n: int, options: dict,
              args: argparse.Namespace, name: str) -> dict[str, Any]:  # fmt: skip
    """Connect, warm up, time ``args.repeats`` rounds; returns the samples and the memory."""
    t0 = time.monotonic()
    group = Group(system, spec, expected, n, options, name, args)
    try:
        group.everyone("connect", group.info, answer="connected")
        setup_s = time.monotonic() - t0
        samples = []
        for k in range(args.warmup + args.repeats):
            sample = group.round(k + 1)
            if k >= args.warmup:
                samples.append(sample)
        memory = group.memory()
    finally:
        group.close()
    return {
        "system": system.name,
        "workload": workload,
        "readers": n,
        "setup_s": setup_s,
        "samples": samples,
        **memory,
    }


# ---- summary and goals -------------------------------------------------------------------------------


def summarize(
    groups: list[dict[str, Any]], nbytes: dict[str, int]
) -> list[dict[str, Any]]:
    """One row per (system, workload, readers): medians over every timed round of every sweep."""
    keyed: dict[tuple, list[dict]] = {}
    for g in groups:
        keyed.setdefault((g["system"], g["workload"], g["readers"]), []).append(g)
    rows = []
    for (sysname, workload, n), gs in keyed.items():
        errors = [g["error"] for g in gs if "error" in g]
        samples = [s for g in gs if "error" not in g for s in g["samples"]]
        row: dict[str, Any] = {"system": sysname, "workload": workload, "readers": n, "bytes": nbytes[workload],
                               "rounds": len(samples), "errors": errors}  # fmt: skip
        if samples:
            b = nbytes[workload]
            wall = median([s["wall_s"] for s in samples])
            per_reader = [b / t / 1e9 for s in samples for t in s["reader_s"]]
            row.update(wall_s=wall, wall_min_s=min(s["wall_s"] for s in samples), wall_max_s=max(s["wall_s"] for s in samples),
                       reader_gbps=median(per_reader), aggregate_gbps=n * b / wall / 1e9,
                       cpu_s_per_gb=median([s["cpu_s"] / (n * b / 1e9) for s in samples]),
                       late_start_ms=1e3 * max(s["late_start_s"] for s in samples))  # fmt: skip
            holder = [g["holder_mib"] for g in gs if g.get("holder_mib") is not None]
            reader = [m for g in gs for m in g.get("reader_mib", [])]
            row["holder_rss_mib"] = max(holder) if holder else None
            row["reader_rss_mib"] = max(reader) if reader else None
            if sysname.startswith("tensorhub"):
                row["control"] = _control(samples)
            if sysname.startswith("ray"):
                row["put_s"] = median([s["holder"]["put_s"] for s in samples])
                row["get_s"] = median(
                    [r["get_s"] for s in samples for r in s["readers"]]
                )
        rows.append(row)
    return rows


def _control(samples: list[dict]) -> dict[str, Any]:
    """TensorHub's pulls split: before the first read (publish, replicate's request, the grant),
    after the last read (verification tail, unpacking, completion), and the share of each
    reader's time with no read in flight."""
    firsts, tails, shares = [], [], []
    for s in samples:
        for t, r in zip(s["reader_s"], s["readers"], strict=True):
            if r.get("reads"):
                firsts.append(r["first_read_s"])
                tails.append(r["after_last_read_s"])
                shares.append(1 - r["reads_busy_s"] / t if t > 0 else 0.0)
    pub = [s["holder"]["publish_s"] for s in samples if s.get("holder")]
    return {"publish_ms": 1e3 * median(pub) if pub else None,
            "first_read_ms": 1e3 * median(firsts) if firsts else None,
            "after_last_read_ms": 1e3 * median(tails) if tails else None,
            "outside_reads_share": median(shares) if shares else None}  # fmt: skip


# ---- the run -------------------------------------------------------------------------------------------


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), if known."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return next((w.strip("[]") for w in f.read().split() if w.startswith("[")), None)
    except OSError:
        return None


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                            "platform": platform.platform(), "executable": sys.executable,
                            "thp_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1", "thp_mode": _thp_mode()}  # fmt: skip
    try:
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    for mod, dist in (
        ("ray", "ray"),
        ("mooncake", "mooncake-transfer-engine-non-cuda"),
        ("nixl", "nixl-cu12"),
    ):
        try:
            from importlib.metadata import version

            info[mod] = version(dist)
        except Exception:  # noqa: BLE001 - not installed
            info[mod] = None
    return info


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        return report_main(argv[1:])
    try:
        args = parse_args(argv)
    except SuiteError as err:
        print(f"python -m benchmarks: error: {err}", file=sys.stderr)
        return 2
    if not args.no_thp:
        # Before the fork server starts (its children inherit it) and before this process's
        # torch allocates: torch's CPU allocator then puts allocations >= 2 MiB on transparent
        # huge pages (madvise), for every system alike. process_vm_readv pins the holder's
        # pages one by one, so 2 MiB pages roughly double TensorHub's `local` copy rate here;
        # memcpy, sockets and the stores gain less.
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    stamp = args.name or datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    specs = {w: workload_spec(w, args.size_mib << 20, args.seed) for w in args.workloads}
    nbytes = {w: spec_bytes(s) for w, s in specs.items()}
    every = [s for s in systems(args.tensorhub_transports) if s.part in args.parts]
    skipped = {s.name: s.missing() for s in every if s.missing()}
    chosen = [s for s in every if s.name not in skipped]
    for name, why in skipped.items():
        print(f"skipping {name}: {why}", flush=True)
    print(f"suite: {', '.join(s.name for s in chosen) or '(nothing)'}; workloads {', '.join(f'{w} ({nbytes[w] / 2**20:.0f} MiB)' for w in specs)}; "
          f"readers {args.readers}; {args.repeats} repeats (+{args.warmup} warm-up) x {args.rounds} rounds; {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    t_start = time.time()
    expected = {w: expected_hashes(s, args.seed) for w, s in specs.items()}
    options: dict[str, Any] = {}
    server = ray_head = None
    groups: list[dict[str, Any]] = []
    failed = False
    try:
        if any(s.part == "tensorhub" for s in chosen):
            server, options["tensorhub_server"] = start_server(
                args.timeout, echo_all=False
            )
        if any(s.part == "ray" for s in chosen):
            store = max(2 << 30, int(2.5 * max(nbytes.values())))
            ray_head = fork_child("ray-head", ray_head_main, (store,), args.timeout)
            _, options["ray_address"] = ray_head.expect("ready")
        plan = [
            (s, w, n)
            for s in chosen
            for w in specs
            for n in args.readers
            if s.holder is not None or n == 1
        ]
        serial = 0
        broken: dict[
            str, str
        ] = {}  # a system that failed once is not started again (each try costs its timeout)
        for rnd in range(args.rounds):
            shift = rnd * len(chosen) // args.rounds if chosen else 0
            order = chosen[shift:] + chosen[:shift]
            for system in order:
                for s, w, n in plan:
                    if s is not system:
                        continue
                    if s.name in broken:
                        groups.append({"system": s.name, "workload": w, "readers": n, "round": rnd,
                                       "error": f"not run: {broken[s.name]}"})  # fmt: skip
                        continue
                    serial += 1
                    name = f"suite-{os.getpid()}-{serial}"
                    options["gloo_port"] = free_port()
                    t0 = time.monotonic()
                    try:
                        g = run_group(
                            s, w, specs[w], expected[w], n, options, args, name
                        )
                    except BenchmarkError as err:
                        failed = True
                        g = {
                            "system": s.name,
                            "workload": w,
                            "readers": n,
                            "error": str(err),
                        }
                        broken[s.name] = (
                            f"an earlier group of {s.name} failed ({w}, {n} readers)"
                        )
                        print(
                            f"  {s.name:16} {w:10} x{n}: FAILED: {err}",
                            file=sys.stderr,
                            flush=True,
                        )
                    else:
                        walls = [x["wall_s"] for x in g["samples"]]
                        print(f"  {s.name:16} {w:10} x{n}: wall {median(walls):.3f} s (median of {len(walls)}), "
                              f"{n * nbytes[w] / median(walls) / 1e9:.2f} GB/s aggregate, holder +{g['holder_mib'] or 0:.0f} MiB, "
                              f"readers +{max(g['reader_mib']):.0f} MiB  [{time.monotonic() - t0:.0f} s]", flush=True)  # fmt: skip
                    g["round"] = rnd
                    groups.append(g)
    finally:
        if ray_head is not None:
            ray_head.stop()
        if server is not None:
            stop_process(server)
    rows = summarize(groups, nbytes)
    tensorhub = f"tensorhub[{args.tensorhub_transports[0]}]"
    results = {
        "suite": "tensorhub benchmarks suite", "started": datetime.datetime.fromtimestamp(t_start).isoformat(timespec="seconds"),
        "duration_s": round(time.time() - t_start, 1), "command": " ".join(["python -m benchmarks", *argv]),
        "machine": machine(), "git": git_head(),
        "params": {"parts": args.parts, "size_mib": args.size_mib, "workloads": args.workloads, "readers": args.readers,
                   "repeats": args.repeats, "warmup": args.warmup, "rounds": args.rounds, "seed": args.seed,
                   "tensorhub_transports": args.tensorhub_transports, "quick": args.quick},
        "systems": {s.name: {"part": s.part, "describe": s.describe, "skipped": skipped.get(s.name)} for s in every},
        "workloads": {w: {"bytes": nbytes[w], "tensors": len(specs[w]), "small_tensors": sum(1 for _, d, k in specs[w] if k * (4 if d == "float32" else 2 if d == "bfloat16" else 1) < 64 << 10), "packed_bytes": packed_bytes(specs[w])} for w in specs},
        "groups": groups, "summary": rows, "goals": goals(rows, tensorhub, {w: packed_bytes(specs[w]) for w in specs}), "tensorhub_row": tensorhub,
    }  # fmt: skip
    json_path = args.out / f"{stamp}.json"
    write_json(json_path, results, indent=1)
    md_path = write_report(
        results, args.out, stamp, plots=not args.no_plots, notes=args.notes
    )
    print(f"wrote {json_path} and {md_path}")
    for g in results["goals"]:
        ratio = f" (ratio {g['ratio']:.2f})" if "ratio" in g else ""
        print(
            f"  {g['verdict']:12} {g['goal']}{ratio}{': ' + g['why'] if g.get('why') else ''}"
        )
    return 1 if failed else 0
