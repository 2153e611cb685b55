"""A new user's first same-host replicate, as they would try it: no configuration at all.

Workload: a ``--size-mib`` shard of ``--tensors`` tensors replicated between two processes of
one host with no configuration at all, ``--rounds`` rounds.
Baseline: one thread's memcpy and one raw TCP loopback socket of the same bytes, same run.
Goal: none asserted; the ratios to the raw socket and to memcpy are the figures.

Two processes on one host, ``tensorhub.open(...)`` with no ``server=`` (the embedded default
server starts on first use) and no ``transports=`` (``$TENSORHUB_TRANSPORTS`` unset): a holder
registers and publishes a shard, a reader replicates it into preallocated tensors. The replicate
call is timed from the reader's side, bytes checked (xxh3 of every tensor against the holder's)
before a round counts. In the same run, on the same bytes:

- ``memcpy``: one thread copying the shard between two buffers of the reader process
  (``ctypes.memmove``), the ceiling of a one-copy path;
- ``raw socket``: the holder streams the shard over one TCP loopback connection into the
  reader's preallocated tensors (``recv_into``), the ceiling of the tcp transport;
- ``replicate, tcp only``: the same replicate with ``TENSORHUB_TRANSPORTS=tcp`` on both sides,
  which was the default before the default set became every usable built-in.

It prints GB/s (medians over ``--rounds``) and the ratios of each replicate to the raw socket and
to memcpy, and the transport each replicate used (from ``last_pull``).

    python benchmarks/bench_first_try.py                 # 1 GiB in 64 tensors, 3 rounds
    python benchmarks/bench_first_try.py --size-mib 256 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: the harness is imported as benchmarks.harness

import torch  # noqa: E402
import xxhash  # noqa: E402

from benchmarks.bench_transfer_baselines import baseline_pull, baseline_serve  # noqa: E402
from benchmarks.harness import BenchmarkError, fork_server, free_port, median  # noqa: E402

MODEL = "first-try"


def _environment(address: str, transports: str | None) -> None:
    """What a new user has: no server address (the embedded default, on our own free port so a
    running job is never touched) and, unless ``transports`` is given, no transport setting."""
    os.environ["TENSORHUB_EMBEDDED_ADDRESS"] = address
    os.environ.pop("TENSORHUB_SERVER", None)
    os.environ.pop("TENSORHUB_TRANSPORT_PREFERENCE", None)
    if transports is None:
        os.environ.pop("TENSORHUB_TRANSPORTS", None)
    else:
        os.environ["TENSORHUB_TRANSPORTS"] = transports


def _tensors(total: int, count: int, seed: int | None) -> dict[str, torch.Tensor]:
    each = total // count
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    out = {}
    for i in range(count):
        t = torch.empty(each, dtype=torch.uint8)
        if g is None:
            t.zero_()
        else:
            t.random_(0, 256, generator=g)
        out[f"layer{i:03d}.weight"] = t
    return out


def _digests(tensors: dict[str, torch.Tensor]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(t.numpy()) for t in tensors.values()]


def holder_main(conn: Any, address: str, transports: str | None, total: int, count: int) -> None:
    _environment(address, transports)
    import tensorhub

    tensors = _tensors(total, count, seed=20261125)
    h = tensorhub.open(model=MODEL, replica=f"trainer-{transports or 'defaults'}")
    h.register(tensors)
    h.publish(1 if transports is None else 2)
    lst = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    views = [memoryview(t.numpy()) for t in tensors.values()]
    threading.Thread(target=baseline_serve, args=(lst, views, stop), daemon=True).start()
    conn.send((_digests(tensors), lst.getsockname()[1]))
    conn.recv()  # stop
    stop.set()
    lst.close()
    h.close()


def _raw_pull(port: int, tensors: dict[str, torch.Tensor]) -> float:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        return baseline_pull(sock, [memoryview(t.numpy()) for t in tensors.values()])


def _memcpy(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for s, d in zip(src.values(), dst.values()):
        ctypes.memmove(d.data_ptr(), s.data_ptr(), s.numel())
    return time.perf_counter() - t0


def reader_main(conn: Any, address: str, transports: str | None, version: int, total: int, count: int,
                rounds: int, timeout: float, baselines: bool) -> None:  # fmt: skip
    _environment(address, transports)
    import tensorhub

    expected, port = conn.recv()
    out: dict[str, list[Any]] = {"replicate": [], "transports": [], "raw": [], "memcpy": []}
    into = _tensors(total, count, seed=None)
    for i in range(rounds):
        for t in into.values():
            t.zero_()
        h = tensorhub.open(model=MODEL, replica=f"rollout-{transports or 'defaults'}-{i}")
        h.register(into)
        t0 = time.perf_counter()
        h.replicate(version, timeout=timeout)
        out["replicate"].append(time.perf_counter() - t0)
        out["transports"].append(list(h.last_pull.transports) if h.last_pull else [])
        if _digests(into) != expected:
            raise BenchmarkError(f"replicate round {i}: the landed bytes differ from the holder's")
        h.close()
        if baselines:
            for t in into.values():
                t.zero_()
            out["raw"].append(_raw_pull(port, into))
            if _digests(into) != expected:
                raise BenchmarkError(f"raw socket round {i}: the landed bytes differ from the holder's")
            src = _tensors(total, count, seed=i)
            out["memcpy"].append(_memcpy(src, into))
            if _digests(into) != _digests(src):
                raise BenchmarkError(f"memcpy round {i}: wrong bytes")
            del src
    conn.send(out)


def _run(ctx: Any, address: str, transports: str | None, args: argparse.Namespace, baselines: bool) -> dict[str, Any]:
    total = args.size_mib << 20
    hp, hc = ctx.Pipe()
    holder = ctx.Process(target=holder_main, args=(hc, address, transports, total, args.tensors), daemon=True)
    holder.start()
    rp, rc = ctx.Pipe()
    version = 1 if transports is None else 2
    reader = ctx.Process(target=reader_main, args=(rc, address, transports, version, total, args.tensors, args.rounds,
                                                   args.timeout, baselines), daemon=True)  # fmt: skip
    reader.start()
    try:
        if not hp.poll(args.timeout):
            raise BenchmarkError("the holder did not publish in time")
        rp.send(hp.recv())
        if not rp.poll(args.timeout * (args.rounds + 1)):
            raise BenchmarkError("the reader did not finish in time")
        return rp.recv()
    finally:
        for p, pipe in ((reader, None), (holder, hp)):
            if pipe is not None:
                try:
                    pipe.send("stop")
                except OSError:
                    pass
            p.join(30)
            if p.is_alive():
                p.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="shard size (default 1 GiB)")
    ap.add_argument("--tensors", type=int, default=64, help="tensors in the shard (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="replicates per configuration (medians reported)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds any one step may take")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.size_mib < 1 or args.tensors < 1 or args.rounds < 1 or (args.size_mib << 20) % args.tensors:
        ap.error("--size-mib, --tensors and --rounds must be >= 1, and the size a multiple of --tensors bytes")
    ctx = fork_server("torch", "tensorhub.handles.api")
    address = f"tcp://127.0.0.1:{free_port()}"
    first = _run(ctx, address, None, args, baselines=True)
    tcp = _run(ctx, address, "tcp", args, baselines=False)
    size = (args.size_mib << 20) / 1e9

    def gbps(xs: list[float]) -> float:
        return size / median(xs)

    memcpy, raw = gbps(first["memcpy"]), gbps(first["raw"])
    rows = {
        "memcpy (1 thread)": (memcpy, None),
        "raw TCP socket (1 stream)": (raw, None),
        f"replicate, no configuration {sorted({n for t in first['transports'] for n in t})}": (gbps(first["replicate"]), True),
        f"replicate, tcp only (the old default) {sorted({n for t in tcp['transports'] for n in t})}": (gbps(tcp["replicate"]), True),
    }
    print(f"first same-host replicate through the public API: {args.size_mib} MiB in {args.tensors} tensors, "
          f"median of {args.rounds} rounds, embedded server, no TENSORHUB_TRANSPORTS")  # fmt: skip
    for label, (rate, ratio) in rows.items():
        extra = f"   {rate / raw:.2f}x raw socket   {rate / memcpy:.2f}x memcpy" if ratio else ""
        print(f"  {label:<58} {rate:6.2f} GB/s{extra}")
    if args.json:
        doc = {"size_mib": args.size_mib, "tensors": args.tensors, "rounds": args.rounds, "defaults": first, "tcp_only": tcp,
               "gbps": {k: v[0] for k, v in rows.items()}}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    # the embedded server exits by itself once idle (EMBEDDED_IDLE_EXIT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
