"""GPU check: ``nixl``, ``rdma_copy``, ``local`` and ``tcp`` (for reference) moving a shard from
one process's GPU memory into another's, byte-exact, against a device-to-device copy.

Workload: shards of about ``--size-mib`` (``64x16MiB``, ``model-500``) pulled from one
process's GPU memory into another's by each transport, ``--repeats`` timed pulls.
Baseline: a device-to-device ``copy_`` of the same bytes in the reader process, same run.
Goal: every pull byte-exact; the transports' GB/s as ratios to the copy (no threshold here).

For each shard (``--shards``: ``64x16MiB`` and ``model-500``, the shards of
``bench_transfer.py``, about ``--size-mib`` MiB each), two processes (multiprocessing
``spawn``):

- the holder: the shard's tensors on ``cuda:0`` with seeded content (made on the CPU, then
  copied over), packed as a publish job leaves them (the packs on the GPU too), its checksums
  (``tensorhub.runtime.checksum.compute``: xxh3-64 per checksum unit, staged through pinned memory)
  computed on the GPU bytes, complete and verified; served by every transport of
  ``--transports`` at once (started with default options, ``expose``d);
- the reader: zeroed tensors of the same layout on ``cuda:1`` when there are two GPUs, else on
  ``cuda:0`` (``--reader-device`` picks). One transport at a time (started, exposed, used,
  withdrawn and closed before the next, so two NIXL agents never run together): one untimed
  read first (connections, descriptions, CUDA IPC handles opened), ``--warmup`` untimed pulls,
  then ``--repeats`` timed pulls of the whole shard, each as the engine runs one: the layout's
  read plan (whole checksum units, reads of up to 8 MiB), the transport's ``streams`` reads in
  flight, the generation of the first read passed to the others. A pull is timed from its
  first read to ``torch.cuda.synchronize()`` after its last. Before every pull the reader's
  transfer space is zeroed; after it, its checksums are computed on the reader's GPU bytes and
  must equal the holder's, unit for unit (a mismatch fails that transport).

The baseline, in the reader process: ``dst.copy_(src)`` region by region from a copy of the
same bytes on the holder's device into the reader's tensors (a device-to-device copy, over
NVLink or PCIe when the devices differ), timed to ``torch.cuda.synchronize()`` of both
devices, verified the same way. Figures are medians in GB/s (10^9 bytes/s) and the ratio to
the copy's median; ``expose()`` of the shard on each side is reported apart (registration is
never in the GB/s).

``tcp`` stages GPU memory through pinned CPU buffers on both sides (``cuda = False``): it is
the reference a GPU transport should beat. ``local`` uses CUDA IPC (its module says the CUDA
path had not run on a GPU before this check).

Without a CUDA device it prints ``skipped: no CUDA device`` and exits 0 (``--cpu`` runs the same
processes, pulls and checks on CPU memory instead: a dry run of this script, no GPU figures). A transport that
fails (an error, or bytes that do not match) is reported and the check goes on with the next;
the exit status is then 1. ``--json FILE`` writes every figure and sample.

Usage: python benchmarks/gpu_check.py [--size-mib N] [--repeats R] [--warmup W]
       [--shards 64x16MiB,model-500] [--transports nixl,rdma_copy,local,tcp]
       [--reader-device cuda:K] [--cpu] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.bench_transfer_paths import close_transport, start_transport, transport_pull
from benchmarks.harness import BenchmarkError, Child, median, write_json
from benchmarks.harness.shards import (
    DTYPES,
    ENGINE_CHUNK,
    VERSION,
    Spec,
    allocate,
    fill_seeded,
    model_spec,
    spec_bytes,
    uniform_spec,
)
from tensorhub.runtime import checksum
from tensorhub.runtime.actor import new_event_loop
from tensorhub.transports.buffers import DEFAULT_PACK_THRESHOLD, ShardBuffers, layout_of

TRANSPORTS = ("nixl", "rdma_copy", "local", "tcp")
REGION = 1
BASELINE = "d2d copy"


def seeded_on(spec: Spec, seed: int, device: str) -> dict[str, torch.Tensor]:
    """The shard's seeded tensors (``bench_transfer.fill_seeded``) on ``device``."""
    cpu = allocate(spec)
    fill_seeded(cpu, seed)
    return {name: t.to(device) for name, t in cpu.items()}


def on_device(device: str) -> None:
    """Make ``device`` this process's current CUDA device (nothing for ``cpu``)."""
    if device != "cpu":
        torch.cuda.set_device(torch.device(device))


def device_name(device: str) -> str:
    return "CPU memory" if device == "cpu" else torch.cuda.get_device_name(torch.device(device))


def mismatches(buffers: ShardBuffers, expected: list[int]) -> int:
    """Checksum units of ``buffers`` whose bytes do not match ``expected``."""
    got = checksum.compute(buffers)
    return sum(1 for a, b in zip(got, expected, strict=True) if a != b)


def holder_main(conn: Any, spec: Spec, seed: int, names: list[str], device: str, timeout: float, options: dict) -> None:
    """The holder: the shard on ``device``, packed, hashed, complete; served by every
    transport of ``names`` that starts (the others are reported) until told to quit."""
    try:
        on_device(device)
        tensors = seeded_on(spec, seed, device)
        buffers = ShardBuffers(tensors, layout_of(tensors, pack_threshold=DEFAULT_PACK_THRESHOLD))
        buffers.pack()  # as the publish job does; the packs live on the GPU too
        sums = checksum.compute(buffers)
        buffers.progress.reset(VERSION, buffers.total_bytes)
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            transports: dict[str, Any] = {}
            endpoints, expose_s, failed = {}, {}, {}
            try:
                for name in names:
                    try:
                        t, _ = start_transport(runner, name, timeout, options.get(name))
                    except Exception as err:  # noqa: BLE001 - reported per transport; the others go on
                        failed[name] = f"start() failed in the holder: {type(err).__name__}: {err}"
                        continue
                    transports[name] = t
                    t.serve(lambda region, version: buffers if (region, version) == (REGION, VERSION) else None)
                    t0 = time.perf_counter()
                    t.expose(buffers)
                    expose_s[name] = time.perf_counter() - t0
                    endpoints[name] = t.endpoint()
                info = {"device": device, "gpu": device_name(device), "bytes": buffers.total_bytes}
                conn.send(("ready", endpoints, sums, expose_s, failed, info))
                while not conn.poll(1.0) or conn.recv()[0] != "quit":
                    if os.getppid() == 1:
                        return
            finally:
                for t in transports.values():
                    t.withdraw(buffers)
                    close_transport(runner, t, timeout)
    except (EOFError, OSError):
        return
    except Exception:  # noqa: BLE001 - the parent reports it
        conn.send(("error", traceback.format_exc()))


def reader_main(conn: Any, spec: Spec, seed: int, names: list[str], endpoints: dict[str, Any], sums: list[int],
                device: str, holder_device: str, warmup: int, repeats: int, timeout: float, options: dict) -> None:  # fmt: skip
    """The reader: each transport of ``names`` in turn, then the device-to-device copy."""
    try:
        on_device(device)
        tensors = {name: torch.zeros(numel, dtype=DTYPES[dtype], device=device) for name, dtype, numel in spec}
        into = ShardBuffers(tensors, layout_of(tensors, pack_threshold=DEFAULT_PACK_THRESHOLD))
        if len(sums) != len(into.plan.units):
            raise BenchmarkError(f"the holder sent {len(sums)} checksums for {len(into.plan.units)} units")
        plan_reads = [r for r in into.plan.reads(into.read_bytes(ENGINE_CHUNK)) if r.length]
        reads = [(r.offset, r.length) for r in plan_reads]
        units_of = {r.offset: [into.plan.units[u] for u in r.units] for r in plan_reads}
        devices = {torch.device(d) for d in (device, holder_device) if d != "cpu"}

        def sync() -> None:
            for d in devices:
                torch.cuda.synchronize(d)

        def zero() -> None:
            for t in into.regions:
                t.zero_()
            sync()

        out: dict[str, Any] = {}
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            for name in names:
                out[name] = res = {"seconds": [], "verify_seconds": []}
                t = None
                try:
                    t, res["start_s"] = start_transport(runner, name, timeout, options.get(name))
                    t0 = time.perf_counter()
                    t.expose(into)
                    res["expose_s"] = time.perf_counter() - t0
                    peer = endpoints[name]
                    runner.run(asyncio.wait_for(transport_pull(t, peer, REGION, into, reads[:1], 1), timeout))
                    # As the engine: a transport that reports landing gets a hasher per read
                    # (on a GPU, a DeviceLanding: the copy hashes what it lands), and verifying
                    # is then comparing its digests; what it did not hash is hashed after.
                    fused = t.reports_landing and checksum.FUSED_GPU_COPY and checksum.lands_on_device(into)
                    res["hashed_on_landing"] = 0
                    for rep in range(warmup + repeats):
                        zero()
                        landings: list[Any] = []

                        def landing(offset: int, length: int) -> Any:
                            landings.append(checksum.DeviceLanding(into, units_of[offset]))
                            return landings[-1]

                        t0 = time.perf_counter()
                        runner.run(asyncio.wait_for(
                            transport_pull(t, peer, REGION, into, reads, t.streams, landing if fused else None), timeout
                        ))  # fmt: skip
                        sync()
                        dt = time.perf_counter() - t0
                        t0 = time.perf_counter()
                        hashed = {i: v for h in landings for i, v in h.digests.items()}
                        rest = [i for i in range(len(sums)) if i not in hashed]
                        # the layout's checksum (wordmix-64 on a GPU: the kernel) of what was not hashed landing
                        got = dict(zip(rest, checksum.compute(into, rest))) if rest else {}
                        bad = sum(1 for i, v in {**hashed, **got}.items() if v != sums[i])
                        dv = time.perf_counter() - t0
                        res["hashed_on_landing"] = len(hashed)
                        if bad:
                            raise BenchmarkError(f"pull {rep + 1}: {bad} of {len(sums)} checksum units hold wrong bytes")
                        if rep >= warmup:
                            res["seconds"].append(dt)
                            res["verify_seconds"].append(dv)
                    res["verified"] = True
                    if name == "local" and device != "cpu":
                        try:
                            _local_diagnosis(runner, t, peer, into, sync, timeout, res)
                        except Exception as err:  # noqa: BLE001 - a diagnosis, not a check
                            res["diagnosis_error"] = f"{type(err).__name__}: {err}"
                except Exception as err:  # noqa: BLE001 - reported per transport; the others go on
                    res["error"] = f"{type(err).__name__}: {err}"
                    res["traceback"] = traceback.format_exc()
                finally:
                    if t is not None:
                        t.withdraw(into)
                        close_transport(runner, t, timeout)
        src = seeded_on(spec, seed, holder_device)
        copy = ShardBuffers(src, layout_of(src, pack_threshold=DEFAULT_PACK_THRESHOLD))
        copy.pack()
        res = out[BASELINE] = {"seconds": []}
        for rep in range(warmup + repeats):
            zero()
            t0 = time.perf_counter()
            for dst, s in zip(into.regions, copy.regions, strict=True):
                dst.copy_(s)
            sync()
            dt = time.perf_counter() - t0
            bad = mismatches(into, sums)
            if bad:
                raise BenchmarkError(f"the device-to-device copy left {bad} checksum units wrong: the check itself is broken")
            if rep >= warmup:
                res["seconds"].append(dt)
        res["verified"] = True
        conn.send(("done", out, len(reads), device_name(device)))
    except Exception:  # noqa: BLE001 - the parent reports it
        conn.send(("error", traceback.format_exc()))


def _local_diagnosis(runner: Any, t: Any, peer: Any, into: ShardBuffers, sync: Any, timeout: float, out: dict[str, Any]) -> None:
    """Where ``local``'s time goes on a GPU: the whole shard as one read, reads of 256 MiB, the
    planned reads called directly (no event loop; profiled), and the CUDA IPC copy alone (the
    opened description's memory into the reader's, batched and a ``copy_`` each)."""
    from tensorhub.transports import local

    total = into.total_bytes
    one: list[float] = []
    for _ in range(3):
        t0 = time.perf_counter()
        runner.run(asyncio.wait_for(transport_pull(t, peer, REGION, into, [(0, total)], 1), timeout))
        sync()
        one.append(time.perf_counter() - t0)
    out["one_read_gbps"] = total / median(one) / 1e9
    big = [(r.offset, r.length) for r in into.plan.reads(256 << 20) if r.length]  # reads of 256 MiB, 4 in flight
    gig: list[float] = []
    for _ in range(3):
        t0 = time.perf_counter()
        runner.run(asyncio.wait_for(transport_pull(t, peer, REGION, into, big, t.streams), timeout))
        sync()
        gig.append(time.perf_counter() - t0)
    out["reads_256mib_gbps"] = total / median(gig) / 1e9
    # Where the planned reads spend their time without the event loop: called directly, profiled.
    import cProfile
    import io
    import pstats

    plan = [(r.offset, r.length) for r in into.plan.reads(into.read_bytes(ENGINE_CHUNK)) if r.length]
    side, pid = t.check_read(peer, "diagnosis", 0, total, None)
    direct: list[float] = []
    prof = cProfile.Profile()
    for _ in range(3):  # the planned reads one after another in this thread: no event loop, no pool
        prof.enable()
        t0 = time.perf_counter()
        for off, n in plan:
            t._read_blocking(side, pid, "diagnosis", REGION, VERSION, off, n, into, None)
        sync()
        direct.append(time.perf_counter() - t0)
        prof.disable()
    out["direct_reads_gbps"] = total / median(direct) / 1e9
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    out["profile"] = text.getvalue()[-3000:]
    desc = next(iter(t._described.values()))  # the shard's description, opened by the reads above
    for key, batched in (("ipc_copy_gbps", False), ("ipc_copy_batched_gbps", True)):  # a copy_ each (the library's); batched
        raw: list[float] = []
        for _ in range(3):
            t0 = time.perf_counter()
            local._copy_gpu(desc, into, 0, total, batched=batched)
            raw.append(time.perf_counter() - t0)
        out[key] = total / median(raw) / 1e9


def check_shard(label: str, spec: Spec, args: argparse.Namespace, holder_device: str, reader_device: str) -> dict[str, Any]:
    total = spec_bytes(spec)
    print(f"shard {label}: {len(spec)} tensors, {total / 2**20:,.1f} MiB; holder {holder_device}, reader {reader_device}", flush=True)
    holder = Child("gpu holder", holder_main, (spec, args.seed, args.transports, holder_device, args.timeout, args.options), args.timeout)
    try:
        _, endpoints, sums, holder_expose, failed, info = holder.expect("ready")
        names = [n for n in args.transports if n in endpoints]
        reader = Child("gpu reader", reader_main, (spec, args.seed, names, endpoints, sums, reader_device, holder_device,
                                                   args.warmup, args.repeats, args.timeout, args.options), args.timeout)  # fmt: skip
        try:
            _, out, reads, reader_gpu = reader.expect("done", args.timeout * (2 + len(names)) * (args.warmup + args.repeats))
        finally:
            reader.stop()
    finally:
        holder.stop()
    for name, why in failed.items():
        out[name] = {"seconds": [], "error": why}
    for name, res in out.items():
        if name in holder_expose:
            res["holder_expose_s"] = holder_expose[name]
        if res["seconds"]:
            res["gbps"] = sorted(total / s / 1e9 for s in res["seconds"])
            res["gbps_median"] = total / median(res["seconds"]) / 1e9
        if res.get("verify_seconds"):
            res["verify_gbps_median"] = total / median(res["verify_seconds"]) / 1e9
    return {"bytes": total, "tensors": len(spec), "reads_per_pull": reads, "holder": info,
            "reader": {"device": reader_device, "gpu": reader_gpu}, "paths": out}  # fmt: skip


def report(results: dict[str, Any], transports: list[str]) -> list[str]:
    """Print the table; returns what failed."""
    failures = []
    print(f"\n{'shard':<10} {'path':<30} {'GB/s median':>11} {'min':>7} {'max':>7} {'vs d2d':>7} "
          f"{'expose ms holder/reader':>23}  bytes")  # fmt: skip
    for label, res in results.items():
        paths = res["paths"]
        base = paths[BASELINE].get("gbps_median")
        where = f"{res['holder']['device']} -> {res['reader']['device']}"
        for name in [BASELINE, *transports]:
            p = paths.get(name)
            if p is None:
                continue
            title = f"d2d copy ({where})" if name == BASELINE else name
            if "error" in p:
                failures.append(f"{label} {name}")
                print(f"{label:<10} {title:<30} FAILED: {p['error']}")
                continue
            ratio = p["gbps_median"] / base if base else float("nan")
            p["ratio_to_d2d"] = ratio
            expose = (f"{p['holder_expose_s'] * 1e3:.2f}/{p['expose_s'] * 1e3:.2f}" if "expose_s" in p else "-")
            verify = f" (checksums {p['verify_gbps_median']:.0f} GB/s)" if "verify_gbps_median" in p else ""
            if "ipc_copy_batched_gbps" in p:
                verify += (f" (direct reads {p['direct_reads_gbps']:.0f} GB/s, reads of 256 MiB {p['reads_256mib_gbps']:.0f} GB/s, one read {p['one_read_gbps']:.0f} GB/s; the IPC copy alone {p['ipc_copy_gbps']:.0f} GB/s "
                           f"a copy_ each, {p['ipc_copy_batched_gbps']:.0f} batched)")  # fmt: skip
            print(f"{label:<10} {title:<30} {p['gbps_median']:>11.2f} {p['gbps'][0]:>7.2f} {p['gbps'][-1]:>7.2f} "
                  f"{ratio:>6.2f}x {expose:>23}  verified{verify}")  # fmt: skip
        print(f"{'':<10} ({res['reads_per_pull']} reads per pull; holder {res['holder']['gpu']}, reader {res['reader']['gpu']})")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="bytes of each shard, in MiB (default 1024)")
    ap.add_argument("--repeats", type=int, default=5, help="timed pulls per path (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed pulls per path first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", default="64x16MiB,model-500", help="comma-separated subset of: 64x16MiB, model-500")
    ap.add_argument("--transports", default=",".join(TRANSPORTS), help=f"comma-separated subset of: {', '.join(TRANSPORTS)}")
    ap.add_argument("--reader-device", default="", help="the reader's GPU (default cuda:1 if there are two, else cuda:0)")
    ap.add_argument("--timeout", type=float, default=120.0, help="bound on every wait, in seconds")
    ap.add_argument("--cpu", action="store_true", help="a dry run of this check on CPU memory (where no GPU is): "
                                                        "the same processes, pulls and checks; no GPU figures")  # fmt: skip
    ap.add_argument("--options", default="{}", help='transport options as JSON, e.g. \'{"nixl": {"nic": ""}}\'')
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        args.options = json.loads(args.options)
        if not isinstance(args.options, dict) or not all(isinstance(v, dict) for v in args.options.values()):
            raise ValueError("not an object of objects")
    except ValueError as err:
        ap.error(f"--options takes a JSON object {{transport: {{option: value}}}}: {err}")
    if args.size_mib < 1 or args.repeats < 1 or args.warmup < 0:
        ap.error("--size-mib and --repeats must be >= 1, --warmup >= 0")
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not args.transports or any(t not in TRANSPORTS for t in args.transports):
        ap.error(f"--transports takes a subset of {', '.join(TRANSPORTS)}")
    total = args.size_mib << 20
    shards = {"64x16MiB": uniform_spec(total), "model-500": model_spec(total, args.seed)}
    wanted = [s.strip() for s in args.shards.split(",") if s.strip()]
    if not wanted or any(s not in shards for s in wanted):
        ap.error(f"--shards takes a subset of {', '.join(shards)}")

    if args.cpu:
        count, holder_device, reader_device = 0, "cpu", "cpu"
    elif not torch.cuda.is_available():
        print("skipped: no CUDA device")
        if args.json:
            write_json(args.json, {"skipped": "no CUDA device"})
        return 0
    else:
        count, holder_device = torch.cuda.device_count(), "cuda:0"
        reader_device = args.reader_device or ("cuda:1" if count > 1 else "cuda:0")
        if not reader_device.startswith("cuda:") or not reader_device[5:].isdigit() or int(reader_device[5:]) >= count:
            ap.error(f"--reader-device must be cuda:K with K < {count}")
    print(f"GPU check{' (dry run on CPU memory)' if args.cpu else ''}: {count} CUDA device(s), {args.size_mib} MiB shards, transports {', '.join(args.transports)}, "
          f"{args.repeats} repeats (+{args.warmup} warm-up), seed {args.seed}")  # fmt: skip
    results: dict[str, Any] = {}
    try:
        for label in wanted:
            results[label] = check_shard(label, shards[label], args, holder_device, reader_device)
    except BenchmarkError as err:
        print(f"FAILED: {err}", file=sys.stderr)
        return 1
    failures = report(results, args.transports)
    print()
    print("every pull verified: the reader's checksums matched the holder's, unit for unit" if not failures else
          f"FAILED: {'; '.join(failures)} (errors above; --json has the tracebacks)")  # fmt: skip
    if args.json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        write_json(args.json, {"config": config, "shards": results, "failures": failures})
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
