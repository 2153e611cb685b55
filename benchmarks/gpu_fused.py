"""Where the fused copy-and-hash kernel's time goes (issue 32): one process, one GPU.

Workload: a 1 GiB buffer cut as the local transport's 1 GiB read of ``gpu_check``'s uniform
shard (64 segments of 16 MiB, 256 checksum units of 4 MiB), on one GPU.
Baseline: the segments' ``copy_`` and the hashing kernel alone (``sums_at``), same run.
Goal: the fused kernel no slower than ``copy_`` + hashing, ideally near ``copy_`` alone.

The baselines are what ``local`` does without a landing (``copy_``) and what verification does
after it (``sums_at``). Measured: ``copy_sums_at`` as shipped, the same kernel launched with
other warps and sub-block sizes, and ``DeviceLanding.copy`` (the Python around it). Prints a
table and, with ``--json``, writes the figures. Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: the harness is imported as benchmarks.harness

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.harness import cuda_sync, median, timings, write_json  # noqa: E402
from tensorhub.runtime import checksum, wordmix
from tensorhub.transports.buffers import ShardBuffers, layout_of


def timed(fn, repeats: int = 7) -> float:
    """Median seconds of ``fn()`` from a synchronized device to a synchronized device, after one
    untimed call."""
    return median(timings(fn, repeats, warmup=1, sync=cuda_sync))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    dev = torch.device("cuda", 0)
    total = args.mib << 20
    seg = 16 << 20
    src_t = {f"t{i}": torch.randint(0, 255, (seg,), dtype=torch.uint8, device=dev) for i in range(total // seg)}
    dst_t = {k: torch.zeros_like(v) for k, v in src_t.items()}
    src, dst = ShardBuffers(src_t, layout_of(src_t)), ShardBuffers(dst_t, layout_of(dst_t))
    segs = [(a.offset, src.gpu_bytes(a), dst.gpu_bytes(b)) for a, b in zip(src.segments(0, total), dst.segments(0, total))]
    units = list(dst.plan.units)
    s_addr = np.array([src.gpu_bytes(src.segments(u.offset, u.length)[0]).data_ptr() for u in units], dtype=np.int64)
    d_addr = np.array([dst.gpu_bytes(dst.segments(u.offset, u.length)[0]).data_ptr() for u in units], dtype=np.int64)
    sizes = np.array([u.length for u in units], dtype=np.int64)
    declared = checksum.compute(src)
    rows: dict[str, float] = {}
    rows["copy_ per segment"] = timed(lambda: [d.copy_(s) for _, s, d in segs])
    rows["one copy_ of the whole buffer (flat)"] = timed(lambda: dst.flat(0).copy_(src.flat(0))) if len(segs) == 1 else float("nan")
    rows["hashing kernel alone (sums_at)"] = timed(lambda: wordmix.sums_at(s_addr, sizes, dev))
    rows["fused copy_sums_at as shipped"] = timed(lambda: wordmix.copy_sums_at(s_addr, d_addr, sizes, dev))
    assert wordmix.copy_sums_at(s_addr, d_addr, sizes, dev) == [declared[u.index] for u in units]
    _, copy_kernel = wordmix._kernels()
    hash_kernel = wordmix._kernels()[0]

    def variant(kernel, addrs, warps: int, piece: int, sub: int) -> float:
        pieces = np.maximum(1, -(-sizes // piece))
        firsts = np.cumsum(pieces) - pieces
        owner = np.repeat(np.arange(len(sizes)), pieces)
        starts = (np.arange(len(owner)) - firsts[owner]) * piece
        params = torch.from_numpy(np.stack([*(a[owner] + starts for a in addrs), np.minimum(piece, sizes[owner] - starts),
                                            starts // 8])).to(dev)  # fmt: skip
        out = torch.empty(len(owner), dtype=torch.int64, device=dev)
        return timed(lambda: kernel[(len(owner),)](*params, out, SUB=sub, NSUB=piece // (8 * sub), num_warps=warps))

    for warps in (4, 8, 16):
        for piece, sub in ((256 << 10, 1024), (256 << 10, 2048), (1 << 20, 1024), (64 << 10, 1024)):
            try:
                rows[f"fused kernel only, {warps} warps, pieces {piece >> 10} KiB, sub {sub}"] = variant(
                    copy_kernel, [s_addr, d_addr], warps, piece, sub)
            except Exception as err:  # noqa: BLE001 - a variant that does not compile is reported
                print(f"variant {warps}/{piece}/{sub}: {type(err).__name__}: {err}")
        rows[f"hash kernel only, {warps} warps, pieces 256 KiB, sub 1024"] = variant(hash_kernel, [s_addr], warps, 256 << 10, 1024)

    def landing() -> None:
        h = checksum.DeviceLanding(dst, units)
        h.copy(segs)
        assert h.complete

    rows["DeviceLanding.copy (Python included)"] = timed(landing)
    arrays = [np.array(c, dtype=np.int64) for c in zip(*((o, s.numel(), s.data_ptr(), d.data_ptr()) for o, s, d in segs))]

    def ranges() -> None:
        h = checksum.DeviceLanding(dst, units)
        h.copy_ranges(*arrays, dev)
        assert h.complete

    rows["DeviceLanding.copy_ranges (as local calls it)"] = timed(ranges)
    base = rows["copy_ per segment"]
    print(f"{args.mib} MiB on {torch.cuda.get_device_name(dev)}: {len(segs)} segments, {len(units)} units")
    print(f"  {'path':<62} {'ms':>8} {'GB/s':>8} {'vs copy_':>9}")
    for k, v in rows.items():
        print(f"  {k:<62} {v * 1e3:>8.3f} {total / v / 1e9:>8.0f} {base / v:>8.2f}x")
    if args.json:
        write_json(args.json, {"mib": args.mib, "gpu": torch.cuda.get_device_name(dev), "seconds": rows}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
