"""The GPU report: every GPU check of TensorHub in one run, written to ``GPU.json`` and ``GPU.md``.

Workload: every GPU check in one run: transfers of 1 and 8 GiB shards, tcp's bound,
checksums, an FP8 conversion and deltas (sections below).
Baseline: per section, a device-to-device copy, a socket, or a training step, same run and device.
Goal: ``local`` >= 0.8x the copy; ``tcp`` >= 0.8x its bound; conversion <= 1.5x (see "Goals").

Run it on any CUDA host (``bash scripts/gpu_run.sh`` installs what a bare GPU machine lacks and
runs it, with the CUDA tests, in one go; README "GPU"). Each section is measured against a
baseline taken in the same run on the same device, and checks its bytes, not only its time:

- **transfers**: a 1 GiB and an 8 GiB shard (64 tensors, ``gpu_check.py``'s ``64x16MiB`` shape
  scaled) pulled from one process's GPU memory into another's by ``local`` (CUDA IPC), ``nixl``
  (UCX on VRAM) and ``tcp`` (staged through pinned buffers), each as a ratio to a
  device-to-device ``copy_`` of the same bytes; every pull verified with the layout's checksums
  (``wordmix-64``, computed by the GPU), whose throughput is reported beside it;
- **tcp's bound**: what ``tcp`` staging is made of, measured alone: a loopback socket moving the
  same bytes over as many connections as ``tcp`` stripes a read over, pinned host-to-device and
  device-to-host copies; ``tcp`` against the slowest of them;
- **checksums**: ``wordmix-64`` of GPU memory (the Triton kernel) against the device-to-device
  copy of the same bytes, ``xxh3-64`` staged through pinned memory for comparison, the kernel's
  values equal to the CPU's for the same bytes, and a planted flipped byte caught (the unit
  named);
- **conversion** and **deltas** (``gpu_workloads.py``): an FP8 conversion of a Qwen3-shaped
  shard on the GPU against a same-layout replicate of the same bytes; the publish-time delta
  compare and the in-place apply on GPU memory against a training step of a small model.

Goals (issue 32): ``local`` >= 0.8x the copy; ``tcp`` >= 0.8x its bound; checksums no slower
than the transfer they verify; conversion <= 1.5x the replicate; delta compare <= 5 % of a step.
Without a CUDA device it writes nothing and exits 0 (``skipped: no CUDA device``).

Usage: python benchmarks/gpu_report.py [--out DIR] [--sizes-mib 1024,8192] [--transports local,nixl,tcp]
       [--sections transfers,tcp_bound,checksums,conversion,deltas] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: the harness is imported as benchmarks.harness

import torch  # noqa: E402

from benchmarks.harness import cuda_sync, median, timings, write_json  # noqa: E402

SECTIONS = ("transfers", "tcp_bound", "checksums", "conversion", "deltas")
GOALS = {"local": 0.8, "tcp": 0.8, "conversion": 1.5, "delta_compare_pct": 5.0}


def environment() -> dict[str, Any]:
    from tensorhub.runtime import wordmix

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "wordmix_backend": wordmix.backend(torch.device("cuda", 0)),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import importlib.metadata as md

        env["nixl"] = next((f"{d} {md.version(d)}" for d in ("nixl-cu13", "nixl-cu12") if _has_dist(md, d)), None)
    except Exception:  # noqa: BLE001 - a fact, not a check
        env["nixl"] = None
    return env


def _has_dist(md: Any, name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


# ---- transfers ----------------------------------------------------------------------------


def transfers(sizes_mib: list[int], names: list[str], quick: bool, options: dict, device: str = "cuda:0") -> dict[str, Any]:
    """``gpu_check``'s pulls of a uniform shard of each size, verified, against the copy."""
    from benchmarks import gpu_check
    from benchmarks.harness.shards import uniform_spec

    out: dict[str, Any] = {}
    slow: dict[str, float] = {}  # transports too slow to time at the larger sizes within a device lease
    for mib in sizes_mib:
        repeats = 2 if quick else (5 if mib <= 2048 else 3)
        here = [n for n in names if n not in slow]
        args = argparse.Namespace(seed=0, transports=here, timeout=180.0, warmup=1, repeats=repeats, options=options)
        label = f"{mib // 1024} GiB" if mib % 1024 == 0 else f"{mib} MiB"
        print(f"== transfers: {label}", flush=True)
        try:
            out[label] = gpu_check.check_shard(label, uniform_spec(mib << 20), args, device, device)
        except Exception as err:  # noqa: BLE001 - reported; the other sections go on
            out[label] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            continue
        gpu_check.report({label: out[label]}, here)
        for name in here:
            gbps = out[label]["paths"].get(name, {}).get("gbps_median")
            if gbps is not None and gbps < 2.0:
                slow[name] = gbps
        if slow:
            out[label]["not_run_larger"] = {n: f"{g:.2f} GB/s at {label}: not timed at larger sizes" for n, g in slow.items()}
    return out


# ---- tcp's bound ---------------------------------------------------------------------------


def _socket_gbps(total: int, streams: int, piece: int) -> float:
    """A loopback socket moving ``total`` bytes from pinned memory into pinned memory over
    ``streams`` connections (one sender and one receiver thread each), in GB/s."""
    src = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    dst = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(streams)]
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    each = total // streams
    errors: list[BaseException] = []

    def send() -> None:
        try:
            with socket.create_connection(("127.0.0.1", port)) as s:
                view = memoryview(src.numpy())
                left = each
                while left:
                    n = min(piece, left)
                    s.sendall(view[:n])
                    left -= n
        except BaseException as err:  # noqa: BLE001 - reported by the caller
            errors.append(err)

    def recv(conn: socket.socket, buf: torch.Tensor) -> None:
        try:
            view = memoryview(buf.numpy())
            left = each
            while left:
                k = conn.recv_into(view[: min(piece, left)])
                if not k:
                    raise ConnectionError("closed early")
                left -= k
            conn.close()
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    senders = [threading.Thread(target=send) for _ in range(streams)]
    t0 = time.perf_counter()
    for t in senders:
        t.start()
    conns = [lsock.accept()[0] for _ in range(streams)]
    receivers = [threading.Thread(target=recv, args=(c, dst[i])) for i, c in enumerate(conns)]
    for t in receivers:
        t.start()
    for t in senders + receivers:
        t.join(300)
    dt = time.perf_counter() - t0
    lsock.close()
    if errors:
        raise RuntimeError(f"loopback socket: {errors[0]!r}")
    return each * streams / dt / 1e9


def tcp_bound(sizes_mib: list[int], quick: bool) -> dict[str, Any]:
    from tensorhub.transports.tcp import TcpTransport

    probe = TcpTransport({})
    streams, piece = probe.streams, probe.staging_bytes
    out: dict[str, Any] = {"streams": streams, "staging_bytes": piece}
    for mib in sizes_mib:
        total = mib << 20
        gpu = torch.empty(total, dtype=torch.uint8, device="cuda")
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        reps = 2 if quick else 3

        def h2d() -> None:
            gpu.copy_(host, non_blocking=True)
            torch.cuda.synchronize()

        def d2h() -> None:
            host.copy_(gpu, non_blocking=True)
            torch.cuda.synchronize()

        res = {
            "socket_gbps": median([_socket_gbps(total, streams, piece) for _ in range(reps)]),
            "h2d_gbps": total / median(timings(h2d, reps, warmup=1)) / 1e9,
            "d2h_gbps": total / median(timings(d2h, reps, warmup=1)) / 1e9,
        }
        res["bound_gbps"] = min(res.values())
        out[f"{mib} MiB"] = res
        print(f"== tcp bound, {mib} MiB: socket {res['socket_gbps']:.2f} GB/s ({streams} connections), pinned h2d "
              f"{res['h2d_gbps']:.1f}, d2h {res['d2h_gbps']:.1f} -> bound {res['bound_gbps']:.2f} GB/s", flush=True)  # fmt: skip
        del gpu, host
        torch.cuda.empty_cache()
    return out


# ---- checksums -----------------------------------------------------------------------------


def checksums(sizes_mib: list[int], quick: bool, device: str = "cuda", seed: int = 0) -> dict[str, Any]:
    """``wordmix-64`` on GPU memory against the copy of the same bytes; ``xxh3-64`` staged; the
    kernel against the CPU; a flipped byte caught."""
    from benchmarks.harness.shards import allocate, fill_seeded, uniform_spec
    from tensorhub.runtime import checksum, wordmix
    from tensorhub.transports.buffers import ShardBuffers, layout_of

    out: dict[str, Any] = {"backend": wordmix.backend(torch.device(device, 0) if device == "cuda" else torch.device("cpu"))}
    for mib in sizes_mib:
        spec = uniform_spec(mib << 20)
        cpu = allocate(spec)
        fill_seeded(cpu, seed)
        gpu = {k: v.to(device) for k, v in cpu.items()}
        twin = {k: torch.empty_like(v) for k, v in gpu.items()}
        buffers = ShardBuffers(gpu, layout_of(gpu, checksum=wordmix.NAME))
        buffers.pack()  # tensors under the pack threshold are hashed (and served) from their pack
        assert buffers.layout.checksum == wordmix.NAME
        total = buffers.total_bytes
        reps = 2 if quick else 5

        def copy() -> None:
            for a, b in zip(twin.values(), gpu.values()):
                a.copy_(b)
            cuda_sync()

        sums: list[int] = []

        def kernel() -> None:
            sums[:] = checksum.compute(buffers)  # returns values on the CPU: synchronized

        res: dict[str, Any] = {
            "copy_gbps": total / median(timings(copy, reps, warmup=1)) / 1e9,
            "wordmix_gbps": total / median(timings(kernel, reps, warmup=1)) / 1e9,
            "units": len(buffers.plan.units),
        }
        res["wordmix_vs_copy"] = res["wordmix_gbps"] / res["copy_gbps"]
        # The kernel's values are the CPU's for the same bytes; a flipped byte is caught in its unit.
        units = buffers.plan.units

        def unit_bytes(u: Any) -> torch.Tensor:
            at = u.offset - buffers.plan.regions[u.region].offset
            return buffers.flat(u.region)[at : at + u.length]

        picked = [units[0], units[len(units) // 2], units[-1]]
        res["equal_to_cpu"] = [sums[u.index] for u in picked] == wordmix.sums_torch([unit_bytes(u).cpu() for u in picked])
        victim = units[len(units) // 2]
        byte = unit_bytes(victim)[victim.length // 3 :][:1]
        byte ^= 0x10
        bad = checksum.first_mismatch(buffers, range(len(sums)), sums)
        byte ^= 0x10
        res["flip_caught"] = bad == victim.index and checksum.first_mismatch(buffers, range(len(sums)), sums) is None
        if mib <= 1024:  # the CPU hash through pinned staging, for comparison (slow: once)
            staged = ShardBuffers(gpu, layout_of(gpu, checksum="xxh3-64"))
            staged.pack()
            res["xxh3_staged_gbps"] = total / median(timings(lambda: checksum.compute(staged), 1, warmup=1)) / 1e9
        out[f"{mib} MiB"] = res
        print(f"== checksums, {mib} MiB: wordmix-64 ({out['backend']}) {res['wordmix_gbps']:.0f} GB/s, copy "
              f"{res['copy_gbps']:.0f} GB/s ({res['wordmix_vs_copy']:.2f}x); equal to the CPU's: {res['equal_to_cpu']}; "
              f"flipped byte caught: {res['flip_caught']}"
              + (f"; xxh3-64 staged {res['xxh3_staged_gbps']:.1f} GB/s" if "xxh3_staged_gbps" in res else ""), flush=True)  # fmt: skip
        del gpu, twin, buffers, cpu
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


# ---- the report ----------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def render(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# GPU report",
        "",
        f"{env['gpu']} ({env['gpus']} device(s)), torch {env['torch']} (CUDA {env['cuda']}), Triton {env.get('triton')}, "
        f"{env.get('nixl') or 'no nixl'}; {env['date']}. Made by `python benchmarks/gpu_report.py` "
        "(`bash scripts/gpu_run.sh` on a bare CUDA host); every figure is a median, against a baseline of the same run.",
        "",
    ]
    tr = report.get("transfers") or {}
    bound = report.get("tcp_bound") or {}
    if tr:
        lines += ["## Transfers between two processes on one GPU", "",
                  "| shard | path | GB/s | vs d2d copy | goal | checksums GB/s | bytes |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for label, res in tr.items():
            if "error" in res:
                lines.append(f"| {label} | all | failed: {res['error']} | | | | |")
                continue
            base = res["paths"]["d2d copy"].get("gbps_median")
            for name, p in res["paths"].items():
                if "error" in p:
                    lines.append(f"| {label} | {name} | failed: {p['error'].splitlines()[0]} | | | | |")
                    continue
                ratio = p["gbps_median"] / base if base else None
                goal = f">= {GOALS[name]}x" if name == "local" else ""
                if name == "tcp":
                    b = bound.get(f"{res['bytes'] >> 20} MiB", {}).get("bound_gbps")
                    goal = f">= 0.8x bound: {p['gbps_median'] / b:.2f}x of {b:.2f}" if b else ""
                sums = _fmt(p.get("verify_gbps_median"), ".0f")
                if p.get("hashed_on_landing"):  # the copy hashed what it landed: verifying compared digests
                    sums = f"hashed by the copy ({p['hashed_on_landing']} units); then {sums}"
                lines.append(f"| {label} | {name} | {p['gbps_median']:.2f} | {_fmt(ratio)}x | {goal} | "
                             f"{sums} | verified |")  # fmt: skip
        lines.append("")
    if bound:
        lines += ["### What tcp staging is made of, measured alone", "",
                  "| bytes | loopback socket | pinned h2d | pinned d2h | bound |", "|---|---|---|---|---|"]  # fmt: skip
        for label, b in bound.items():
            if isinstance(b, dict):
                lines.append(f"| {label} | {b['socket_gbps']:.2f} | {b['h2d_gbps']:.1f} | {b['d2h_gbps']:.1f} | {b['bound_gbps']:.2f} |")
        lines += ["", f"(GB/s; the socket over {bound.get('streams')} connections, as tcp stripes a read.)", ""]
    cs = report.get("checksums") or {}
    if cs:
        lines += [f"## Checksums of GPU memory (`wordmix-64`, {cs.get('backend')})", "",
                  "| bytes | wordmix-64 GB/s | d2d copy GB/s | ratio | equal to CPU | flipped byte caught | xxh3-64 staged GB/s |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for label, c in cs.items():
            if isinstance(c, dict):
                lines.append(f"| {label} | {c['wordmix_gbps']:.0f} | {c['copy_gbps']:.0f} | {c['wordmix_vs_copy']:.2f}x | "
                             f"{c['equal_to_cpu']} | {c['flip_caught']} | {_fmt(c.get('xxh3_staged_gbps'), '.1f')} |")  # fmt: skip
        lines.append("")
    prev = report.get("tcp_at_256mib_reads_previous_run")
    if prev:
        lines += ["### tcp, from the run before (reads of 256 MiB)", "", prev["why"], "",
                  "| shard | tcp GB/s | bound (socket alone) | ratio | checksums GB/s |", "|---|---|---|---|---|"]  # fmt: skip
        for label, t in prev["transfers"].items():
            p = t["tcp"]
            b = prev["tcp_bound"].get(f"{int(label.split()[0]) * 1024} MiB", {}).get("bound_gbps")
            ratio = f"{p['gbps_median'] / b:.2f}x" if b else "-"
            lines.append(f"| {label} | {p['gbps_median']:.2f} | {_fmt(b)} | {ratio} | {_fmt(p.get('verify_gbps_median'), '.0f')} |")
        lines.append("")
    from benchmarks import gpu_workloads

    for key, fmt in (("conversion", gpu_workloads.conversion_lines), ("deltas", gpu_workloads.delta_lines)):
        sec = report.get(key)
        if sec and "error" not in sec:
            lines += [f"## {key.capitalize()}", "", "```", *fmt(sec), "```", ""]
        elif sec:
            lines += [f"## {key.capitalize()}", "", f"failed: {sec['error']}", ""]
    fails = report.get("failures") or []
    lines += ["## Checks", "", "every section ran and every byte check passed" if not fails else "failed: " + "; ".join(fails), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--sizes-mib", default="1024,8192")
    ap.add_argument("--transports", default="local,nixl,tcp")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--options", default="{}", help="transport options as JSON (see gpu_check.py)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a first look)")
    ap.add_argument("--cpu", action="store_true", help="a dry run of the transfers and checksums sections on CPU memory "
                                                        "(no GPU figures; writes nothing unless --out is given)")  # fmt: skip
    ap.add_argument("--render", type=Path, help="write the Markdown of a GPU.json again (beside it), and nothing else")
    args = ap.parse_args(argv)
    if args.render:
        report = json.loads(args.render.read_text())
        (args.render.parent / "GPU.md").write_text(render(report))
        return 0
    if args.cpu:
        print(json.dumps(transfers([int(x) for x in args.sizes_mib.split(",")], ["local", "tcp"], True, {}, "cpu"), default=str)[:2000])
        print(json.dumps(checksums([int(x) for x in args.sizes_mib.split(",")], True, "cpu")))
        return 0
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    sizes = [int(x) for x in args.sizes_mib.split(",") if x.strip()]
    names = [x.strip() for x in args.transports.split(",") if x.strip()]
    wanted = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = [w for w in wanted if w not in SECTIONS]
    if unknown or not sizes or any(s < 1 for s in sizes):
        ap.error(f"--sections takes a subset of {', '.join(SECTIONS)}; --sizes-mib positive integers")
    report: dict[str, Any] = {"environment": environment(), "failures": []}
    print(json.dumps(report["environment"]), flush=True)
    for section in wanted:
        t0 = time.perf_counter()
        try:
            if section == "transfers":
                report[section] = transfers(sizes, names, args.quick, json.loads(args.options))
            elif section == "tcp_bound":
                report[section] = tcp_bound(sizes, args.quick)
            elif section == "checksums":
                report[section] = checksums(sizes, args.quick)
            else:
                from benchmarks import gpu_workloads

                fn = getattr(gpu_workloads, section)
                report[section] = fn("cuda", "small" if args.quick else "full")
        except Exception as err:  # noqa: BLE001 - reported; the next section runs
            report[section] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            print(f"== {section} FAILED: {err}\n{traceback.format_exc()}", flush=True)
        report.setdefault("seconds", {})[section] = time.perf_counter() - t0
    report["failures"] = _failures(report)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "GPU.json", report, indent=1, default=str)
    (args.out / "GPU.md").write_text(render(report))
    print(render(report))
    return 1 if report["failures"] else 0


def _failures(report: dict[str, Any]) -> list[str]:
    fails = [f"{k}: {v['error']}" for k, v in report.items() if isinstance(v, dict) and "error" in v]
    for label, res in (report.get("transfers") or {}).items():
        for name, p in (res.get("paths") or {}).items():
            if "error" in p:
                fails.append(f"transfers {label} {name}: {p['error'].splitlines()[0]}")
    for label, c in (report.get("checksums") or {}).items():
        if isinstance(c, dict) and not (c.get("equal_to_cpu") and c.get("flip_caught")):
            fails.append(f"checksums {label}: equal_to_cpu={c.get('equal_to_cpu')} flip_caught={c.get('flip_caught')}")
    return fails


if __name__ == "__main__":
    sys.exit(main())
