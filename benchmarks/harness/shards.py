"""The shards benchmarks move: their specs (the workloads ``64x16MiB`` and ``model-500``), seeded
content, the CRC-32 check of the bytes that arrived, and what a pull is planned with (the
engine's read size, the regions the holder serves)."""

from __future__ import annotations

import contextlib
import os
import random
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from benchmarks.harness.processes import BenchmarkError
from tensorhub.core.layout import Layout
from tensorhub.transports.buffers import ShardBuffers, memory_of

VERSION = 1
REGION = 1  # the holder's packed buffers
REGION_UNPACKED = 2  # the same tensors, laid out with pack_threshold 0 (--tcp-unpacked)
# The engine's read size: 8 MiB unless $TENSORHUB_CHUNK_BYTES says otherwise (as tensorhub.handles.api does).
ENGINE_CHUNK = int(os.environ.get("TENSORHUB_CHUNK_BYTES") or 8 << 20)
POOL_BYTES = 64 << 20  # seeded random bytes that tensor contents are windows of
DTYPES = {"uint8": torch.uint8, "bfloat16": torch.bfloat16, "float32": torch.float32}
MEMORY_SHARD = "model-500"  # the shard section 5 (memory) measures

Spec = list[tuple[str, str, int]]  # (name, dtype, numel)


# ---- shards -----------------------------------------------------------------------------------


def uniform_spec(total: int) -> Spec:
    """64 equal tensors, uint8 and bfloat16 alternating."""
    each = max(2, total // 64) & ~1
    spec = []
    for i in range(64):
        dtype = "uint8" if i % 2 == 0 else "bfloat16"
        spec.append((f"layer{i}.weight", dtype, each // (1 if dtype == "uint8" else 2)))
    return spec


def model_spec(total: int, seed: int, n: int = 500) -> Spec:
    """``n`` tensors of seeded sizes adding up to about ``total`` bytes: half small (under 64 KiB,
    fp32 or bf16), half large bf16 weights (log-uniform over a factor of 8, at least 64 KiB)."""
    rng = random.Random(seed)
    small_n = n // 2
    spec: list[tuple[str, str, int]] = []
    small_bytes = 0
    for i in range(small_n):
        dtype = "float32" if i % 2 == 0 else "bfloat16"
        size = DTYPES[dtype].itemsize
        nbytes = int(2 ** rng.uniform(9, 16))  # 512 B .. 64 KiB
        numel = max(1, min(nbytes, (64 << 10) - size) // size)
        spec.append((f"small{i}.{'norm' if dtype == 'float32' else 'bias'}", dtype, numel))
        small_bytes += numel * size
    large_n = n - small_n
    budget = max(total - small_bytes, large_n * (64 << 10))
    weights = [2 ** rng.uniform(0, 3) for _ in range(large_n)]
    scale = budget / sum(weights)
    large = [max(32 << 10, int(w * scale) // 2) for w in weights]  # bf16 elements, >= 64 KiB
    large[-1] = max(32 << 10, large[-1] + (budget // 2 - sum(large)))
    spec += [(f"large{i}.weight", "bfloat16", numel) for i, numel in enumerate(large)]
    rng.shuffle(spec)
    return spec


WORKLOADS = ("64x16MiB", "model-500")


def workload_spec(name: str, total: int, seed: int) -> Spec:
    """The spec of workload ``name`` (one of :data:`WORKLOADS`) at about ``total`` bytes."""
    if name == "64x16MiB":
        return uniform_spec(total)
    if name == "model-500":
        return model_spec(total, seed)
    raise BenchmarkError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def spec_bytes(spec: Spec) -> int:
    return sum(numel * DTYPES[dtype].itemsize for _, dtype, numel in spec)


def allocate(spec: Spec) -> dict[str, torch.Tensor]:
    """Zeroed (so: resident) tensors of ``spec``."""
    return {name: torch.zeros(numel, dtype=DTYPES[dtype]) for name, dtype, numel in spec}


def fill_seeded(tensors: dict[str, torch.Tensor], seed: int) -> None:
    """Each tensor's bytes: a window of a seeded random pool, at a tensor-specific offset."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.empty(POOL_BYTES // 8, dtype=torch.int64)
    pool.random_(generator=gen)
    pool8 = pool.view(torch.uint8)
    for i, t in enumerate(tensors.values()):
        dst = t.view(-1).view(torch.uint8)
        pos, start = 0, (i * 1_000_003 + 17) % POOL_BYTES
        while pos < dst.numel():
            n = min(dst.numel() - pos, POOL_BYTES - start)
            dst[pos : pos + n].copy_(pool8[start : start + n])
            pos += n
            start = 0


def crcs_of(tensors: dict[str, torch.Tensor], pool: ThreadPoolExecutor) -> list[int]:
    """CRC-32 of every tensor's bytes (zlib releases the GIL: the pool runs them in parallel)."""
    return list(pool.map(lambda t: zlib.crc32(memory_of(t)), tensors.values()))


def hashes_of(tensors: dict[str, torch.Tensor]) -> list[int]:
    """xxh3-64 of every tensor's bytes, in order: what a reader's round is checked with."""
    return [xxhash.xxh3_64_intdigest(memory_of(t)) for t in tensors.values()]


def check_bytes(label: str, got: list[int], expected: list[int], names: Sequence[str]) -> None:
    bad = [name for name, a, b in zip(names, got, expected, strict=True) if a != b]
    if bad:
        raise BenchmarkError(f"{label}: {len(bad)} of {len(names)} tensors hold wrong bytes after the transfer "
                             f"(first: {', '.join(bad[:5])})")  # fmt: skip


def zero(tensors: dict[str, torch.Tensor], *buffers: ShardBuffers | None) -> None:
    """Zero the tensors and the pack buffers of ``buffers``: a pull that skipped a range of a pack
    must not be saved by the bytes an earlier pull left there. A pack kept in place (its region
    None) is the tiny tensors themselves, zeroed with the rest."""
    for t in tensors.values():
        t.zero_()
    for b in buffers:
        if b is not None:
            for r, t in zip(b.plan.regions, b.regions, strict=True):
                if r.tensor is None and t is not None:
                    t.zero_()


@contextlib.contextmanager
def pack_threshold_env(threshold: int) -> Iterator[None]:
    """``$TENSORHUB_PACK_THRESHOLD`` set to ``threshold`` (``register`` reads it), then restored."""
    before = os.environ.get("TENSORHUB_PACK_THRESHOLD")
    os.environ["TENSORHUB_PACK_THRESHOLD"] = str(threshold)
    try:
        yield
    finally:
        if before is None:
            del os.environ["TENSORHUB_PACK_THRESHOLD"]
        else:
            os.environ["TENSORHUB_PACK_THRESHOLD"] = before


def read_bytes_of(layout: Layout) -> int:
    """The read size the engine plans with."""
    return max(ENGINE_CHUNK, layout.chunk_bytes)
