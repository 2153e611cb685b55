"""The copy threads of a same-host pull into a vLLM engine's staging, without vLLM.

Workload: ``bench_vllm.py``'s model (a Qwen3 of ``--layers`` layers, hidden ``--hidden``, vocab
``--vocab``: 309 MiB of bf16 by default) registered by a trainer handle in this process and
pulled, ``--rounds`` times, by a converting handle (``convert_from=``) into staging laid out as
the ``tensorhub`` vLLM backend lays it out: q/k/v as views of one fused buffer, gate/up of one,
the rest tensors of their own (what ``bench_vllm.py``'s no-prefetch pull does, engine aside).
Baseline: in the same process and run, the same bytes (trainer tensor -> staging tensor) cut
into the same parts (4 MiB, on the ``local`` transport's copy threads) and pieces (1 MiB):
``memmove`` and ``process_vm_readv`` (``vm``), each alone and with every piece hashed (xxh3-64)
right after it landed (``+xxh3``: the floor of a verified copy).
Goal: none asserted; the figures are the pull's wall time and its copy threads' CPU time, and
their ratios to ``vm+xxh3`` and ``memmove+xxh3`` of the same run. ``tensorhub-vm``: the same pull
with the ``local`` transport's same-process ``memmove`` turned off (its holder lookup answering
None), so every piece is a ``process_vm_readv`` as before that path: the A/B, rounds alternating.

``python benchmarks/bench_pull_copy.py [--rounds 5] [--layers 8 --hidden 1024 --vocab 32000]``

CPU time is per thread (``/proc/self/task/*/schedstat``, nanoseconds): for the pull, the local
transport's read and copy threads (``local-read``, ``local-copy``: the copies and the hashes of
the landing pieces), the engine's event loop and the worker threads (``asyncio.to_thread``)
apart; for the baselines, the worker threads' ``time.thread_time``. After each pull every
staging tensor must equal the trainer's (checked): one wrong byte fails the run.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import xxhash  # noqa: E402

from benchmarks.harness import median, thread_cpu  # noqa: E402

PART = 4 << 20  # the local transport's parts (queued on its copy threads)
PIECE = 1 << 20  # ... and pieces (one copy, then the landing hash)
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_ORDER = list(_FUSED)


def checkpoint(layers: int, hidden: int, vocab: int) -> dict[str, torch.Tensor]:
    """``bench_vllm.py``'s Qwen3 checkpoint shapes (Hugging Face names, sorted as safetensors
    stores them), random bf16 values."""
    inter, kv = 3 * hidden, max(1, hidden // 256) * 64
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
                                          "model.norm.weight": (hidden,)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "self_attn.q_norm.weight": (64,), p + "self_attn.k_norm.weight": (64,),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })  # fmt: skip
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in sorted(shapes.items())}


def staging(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Staging as the vLLM backend lends it: per layer, q/k/v views of one fused buffer and
    gate/up views of another (in that order); the rest tensors of their own. Written once (the
    pages are this process's before the first pull)."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, list[str]] = {}
    for n, t in weights.items():
        part = n.split(".")[-2]
        if part in _FUSED:
            groups.setdefault(n.replace(part, _FUSED[part]), []).append(n)
        else:
            out[n] = torch.zeros_like(t)
    for names in groups.values():
        names.sort(key=lambda n: _ORDER.index(n.split(".")[-2]))
        buf = torch.zeros(sum(weights[n].numel() for n in names), dtype=torch.bfloat16)
        at = 0
        for n in names:
            out[n] = buf[at : at + weights[n].numel()].view(weights[n].shape)
            at += weights[n].numel()
    return out


def raw(kind: str, pairs: list[tuple[int, int, int]], pool: ThreadPoolExecutor) -> tuple[float, float]:
    """One baseline round: every (destination, source, bytes) cut in parts over ``pool``, each
    part copied in pieces (``memmove`` or ``vm``: ``process_vm_readv`` of this process), each
    piece hashed after it landed with ``+xxh3``. Returns (wall seconds, CPU seconds of the workers)."""
    from tensorhub.transports.local import _Iovec, _lib

    readv, pid, hashed, vm = _lib().process_vm_readv, os.getpid(), kind.endswith("+xxh3"), kind.startswith("vm")

    def part(dst: int, src: int, n: int) -> float:
        t = time.thread_time()
        li, ri = _Iovec(), _Iovec()
        for at in range(0, n, PIECE):
            k = min(PIECE, n - at)
            if vm:
                li.iov_base, li.iov_len, ri.iov_base, ri.iov_len = dst + at, k, src + at, k
                if readv(pid, ctypes.byref(li), 1, ctypes.byref(ri), 1, 0) != k:
                    raise OSError(ctypes.get_errno(), "process_vm_readv")
            else:
                ctypes.memmove(dst + at, src + at, k)
            if hashed:
                xxhash.xxh3_64_intdigest((ctypes.c_char * k).from_address(dst + at))
        return time.thread_time() - t

    jobs = [(d + a, s + a, min(PART, n - a)) for d, s, n in pairs for a in range(0, n, PART)]
    t0 = time.perf_counter()
    cpu = sum(pool.map(lambda j: part(*j), jobs))
    return time.perf_counter() - t0, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")

    import tensorhub
    from tensorhub.core.placement import REPLICATE, TensorPlacement
    from tensorhub.scheduling.mapping import Cast, Mapping
    from tensorhub.transports.local import _OPTIONS
    from tests.procs import ServerProcess

    weights = checkpoint(args.layers, args.hidden, args.vocab)
    into = staging(weights)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    threads = int(_OPTIONS["threads"][0])
    print(f"{nbytes / 2**20:.0f} MiB bf16 in {len(weights)} tensors; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"local transport: {threads} copy threads, {PART >> 20} MiB parts, {PIECE >> 20} MiB pieces", flush=True)  # fmt: skip

    def placements(ts: dict[str, torch.Tensor]) -> dict[str, TensorPlacement]:
        return {n: TensorPlacement(n, "bfloat16", tuple(t.shape), (1,), (REPLICATE,)) for n, t in ts.items()}

    server = ServerProcess()
    trainer = reader = None
    from tensorhub.transports.local import LocalTransport

    own_buffers = LocalTransport._own_buffers
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in ("memmove", "memmove+xxh3", "vm", "vm+xxh3", "tensorhub", "tensorhub-vm")}
    parts: list[dict[str, float]] = []
    pool = ThreadPoolExecutor(threads, thread_name_prefix="raw")
    pairs = [(into[n].data_ptr(), t.data_ptr(), t.numel() * t.element_size()) for n, t in weights.items()]
    try:
        trainer = tensorhub.open("bench-pull", "trainer", num_shards=1, shard_idx=0, server=server.address, retain=None)
        trainer.register(weights, placements=placements(weights))
        reader = tensorhub.open("bench-pull:staging", "rollout-0", num_shards=1, shard_idx=0, server=server.address,
                                retain=None, convert_from="bench-pull", mapping=Mapping(casts=(Cast("{name:path}", "bfloat16"),)))  # fmt: skip
        reader.register(into, placements=placements(into))
        for version in range(1, 2 * args.rounds + 2):  # the first pull (describes, plans) is not counted
            route = "tensorhub" if version % 2 == 0 else "tensorhub-vm"
            # each version is described anew: the lookup decides that version's reads
            LocalTransport._own_buffers = own_buffers if route == "tensorhub" else (lambda *_: None)
            if version > 1:
                trainer.unpublish()
            for t in weights.values():
                t.add_(0.01)
            trainer.publish(version)
            _hashes_done()  # the trainer's checksums first: its hash is not the pull's work
            before = thread_cpu()
            t0 = time.perf_counter()
            if reader.version is None:
                reader.replicate(version)
            else:
                reader.update(version)
            wall = time.perf_counter() - t0
            spent = {k: v - before.get(k, 0.0) for k, v in thread_cpu().items() if v - before.get(k, 0.0) > 1e-4}
            bad = [n for n in weights if not torch.equal(into[n], weights[n])]
            if bad:
                print(f"MISMATCH after the pull of v{version}: {bad[:4]}")
                return 1
            if version == 1:
                continue
            copy = spent.get("local-copy", 0.0) + spent.get("local-read", 0.0)
            rows[route].append((wall, copy))
            if route == "tensorhub":
                parts.append(spent)
            shown = ", ".join(f"{k} {v * 1000:.0f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v >= 0.002)
            print(f"round {version // 2} {route:>12}: wall {wall * 1000:6.1f} ms, copy threads {copy * 1000:6.1f} ms CPU  ({shown})",
                  flush=True)  # fmt: skip
            if route == "tensorhub":
                for kind in ("memmove", "memmove+xxh3", "vm", "vm+xxh3"):
                    rows[kind].append(raw(kind, pairs, pool))
    finally:
        LocalTransport._own_buffers = own_buffers
        pool.shutdown()
        if reader is not None:
            reader.close()
        if trainer is not None:
            trainer.close()
        server.stop()
    print(f"\nmedians over {args.rounds} rounds ({nbytes / 2**20:.0f} MiB; same process, same run; load {os.getloadavg()[0]:.1f}):")
    base = {k: (median([w for w, _ in rows[k]]), median([c for _, c in rows[k]])) for k in rows}
    for kind, (wall, cpu) in base.items():
        print(f"  {kind:>13}: wall {wall * 1000:7.1f} ms  copy CPU {cpu * 1000:7.1f} ms   "
              f"CPU ratio to vm+xxh3 {cpu / base['vm+xxh3'][1]:5.2f}, to memmove+xxh3 {cpu / base['memmove+xxh3'][1]:5.2f}")  # fmt: skip
    keys = sorted({k for p in parts for k in p}, key=lambda k: -median([p.get(k, 0.0) for p in parts]))
    print("  tensorhub CPU by thread (median ms): " + ", ".join(f"{k} {median([p.get(k, 0.0) for p in parts]) * 1000:.1f}"
                                                              for k in keys))  # fmt: skip
    return 0


def _hashes_done(timeout: float = 10.0) -> None:
    """Wait (at most ``timeout`` seconds) until the hashing threads' CPU time stops growing: the
    publisher's background hash is over."""
    deadline = time.monotonic() + timeout
    last = -1.0
    while time.monotonic() < deadline:
        now = thread_cpu().get("tensorhub-hash", 0.0)
        if now == last:
            return
        last = now
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
