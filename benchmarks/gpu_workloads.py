"""GPU workloads: the FP8 conversion of a Qwen3-shaped shard and the deltas of a small model, run on
a device, each against its baseline measured in the same run, and checked byte for byte.

Workload: the FP8 conversion of a Qwen3-shaped shard, and the deltas of a small model's
training steps, on a device.
Baseline: a same-layout replicate (device copy) of the same bytes; a training step; same run.
Goal: conversion <= 1.5x the replicate; the delta compare <= 5 % of a step.

:func:`conversion` (issue 32, "conversion on the device"): a Qwen3-shaped model (Hugging Face
names, bf16; ``full``: 3 layers of Qwen3-8B's sizes, hidden 4096, intermediate 12288, 32 heads, 8
KV heads of 128, vocabulary 16384: about 1.4 GB) held by a trainer replica of 4 shards (FSDP's
``Shard(0)``), its tensors made on the device from a seeded generator. The destination is one
vLLM shard (tp=1: ``qkv_proj`` and ``gate_up_proj`` fused, linear weights FP8 e4m3 in 128x128
blocks beside their ``weight_scale_inv``), planned by :func:`tensorhub.scheduling.reshard.plan`
with :func:`tensorhub.scheduling.mapping.preset` ``("qwen3", fp8=True)`` and the converter's task
size (a quarter of its default budget, ``tensorhub.runtime.convert.DEFAULT_BUDGET``). Timed:
:func:`tensorhub.reshard.convert_in_process` on the device (the GPU executor of
``tests/test_reshard_cuda.py``): every read's segments landed in a staging buffer on the device,
viewed, gathered, fused, block-quantized and landed in preallocated destination tensors on the
device, task after task (the runtime's ``Conversion`` stages its reads in CPU memory and runs
these steps there, the landing copies aside: this is the path a converter on the GPU would run).
The baseline: a same-layout replicate of the same source bytes, a device-to-device ``copy_`` of
every source tensor into a preallocated tensor of its shape. Each
repeat runs both, from ``torch.cuda.synchronize()`` to ``torch.cuda.synchronize()``; the
destination is poisoned (0xA5) before each (untimed). Reported: medians after a warm-up, GB/s of
source bytes, the ratio conversion / replicate (goal <= 1.5), one conversion's phases
(synchronized between phases: stage, gather, transform, land), its peak temporary GPU memory
against the budget, and the byte check: every destination byte equals what the CPU path (the
same plan and source bytes, ``convert_in_process`` on the CPU, which the tests pin against
DeepGEMM's reference) produces, at full size.

:func:`deltas` (issue 32, "deltas on the device"): a Qwen3-shaped decoder of Linear layers
(``full``: 12 layers, hidden 1024, about 211M parameters; no rotary embedding, it has no weights)
trained with float32 master weights under bf16 autocast, AdamW at lr 1e-6 (as
``benchmarks/bench_delta.py``: most bf16 weights do not change in a step). A step is
forward + backward over ``accum`` micro-batches of random tokens, the AdamW step, and the bf16
cast of the masters into the trainer's registered tensors (what ``publish`` serves). After each
step, timed apart:

- the compare as the handle does it (``tensorhub.handles.deltas._compare``, called as
  ``DeltaPublisher`` calls it, with the publish job's checksums): the registered GPU tensors
  compared on the GPU against the pinned CPU snapshot of the previous version
  (``compare_and_refresh``: the snapshot's slices stream in a few slots ahead of the comparison
  while the target's bytes stream back over them), only the changes brought back; beside it, the
  first path the handle had (a pageable copy of the tensors to CPU memory, ``compute_delta``
  there), its two parts timed apart;
- ``compute_delta`` on the device with both versions there (the library function on GPU memory);
- the second path the handle had (first device run): each tensor of a pinned CPU snapshot copied
  into a scratch buffer on the device, compared there, only the changed values and indices brought
  back, the snapshot brought forward in place by ``apply_delta`` on the CPU; with the floor of any
  compare against a host snapshot, the host-to-device copy of the whole snapshot;
- the publish job's checksums of the shard (for scale: one hashing pass with the layout's
  algorithm);
- the reader's apply on GPU memory (``apply_delta`` of the handle's delta, values in CPU memory as
  they come off the wire, into the reader's GPU tensors holding the base: base check by hashing,
  ``index_copy_``, verification of the units written), and the write alone on a copy.

Checked each step: the reader's GPU tensors equal the trainer's new bf16 weights bit for bit; the
earlier path's and the on-device deltas equal the handle's, entry for entry; both pinned snapshots
equal the new version; on the first step a reader whose base has one planted flipped bit is refused with
``BaseMismatch`` and nothing is written. Reported: medians over the steps after a warm-up step, the
compare as a % of the step (goal <= 5 %), the fraction of elements changed, delta bytes against the
full bytes.

Without a CUDA device it prints ``skipped: no CUDA device`` and exits 0; ``--cpu`` runs both on
CPU memory at small sizes (a dry run of this script, no GPU figures). A failed byte check, or an
error, makes the exit status 1; a goal not met does not. ``--json FILE`` writes every figure.

Usage: python benchmarks/gpu_workloads.py [--cpu] [--json FILE] [--seed N] [--only conversion|deltas]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: the harness is imported as benchmarks.harness

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.harness import cuda_sync, median, write_json  # noqa: E402
from tensorhub.core.deltas import DENSE, SPARSE, encoding_for
from tensorhub.core.layout import DTYPE_SIZES, Layout
from tensorhub.core.placement import ReplicaLayout
from tensorhub.errors import BaseMismatch, InvalidArgument
from tensorhub.handles.deltas import _compare, _copy_to_cpu
from tensorhub.reshard import allocate, convert_in_process, gather, land, read_view, stage, torch_dtype, transform
from tensorhub.runtime.convert import DEFAULT_BUDGET
from tensorhub.runtime.deltas import (
    Delta,
    TensorDelta,
    apply_delta,
    bits_of,
    changed_indices,
    compute_delta,
    describe,
    shard_checksums,
)
from tensorhub.scheduling.decoders import DecoderShape, hf_placements, vllm_placements
from tensorhub.scheduling.mapping import preset
from tensorhub.scheduling.reshard import FP8, ReshardPlan, plan
from tensorhub.transports.buffers import DEFAULT_CHUNK_BYTES, layout_of

__all__ = ["SCALES", "conversion", "conversion_lines", "delta_lines", "deltas", "main"]

SCALES = ("full", "small")
CONVERSION_GOAL = 1.5  #: conversion / same-layout replicate, at most
COMPARE_GOAL = 0.05  #: the publish-time compare, as a fraction of a training step, at most
SOURCE_SHARDS = 4  #: the trainer replica converted from (FSDP Shard(0))
POISON = 0xA5  #: a byte the data path never writes by chance

CONVERSION_SHAPES: dict[str, dict[str, int]] = {
    "full": dict(layers=3, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, vocab=16384),
    "small": dict(layers=2, hidden=256, intermediate=768, heads=2, kv_heads=1, head_dim=128, vocab=1024),
}
CONVERSION_REPEATS = {"full": (1, 5), "small": (1, 3)}  #: (warm-up, timed) repeats

DELTA_SIZES: dict[str, dict[str, int]] = {
    "full": dict(layers=12, hidden=1024, intermediate=3072, heads=16, kv_heads=4, head_dim=64, vocab=32768,
                 batch=8, seq=1024, accum=4, warmup=1, steps=3),
    "small": dict(layers=2, hidden=64, intermediate=192, heads=4, kv_heads=2, head_dim=16, vocab=512,
                  batch=2, seq=32, accum=1, warmup=1, steps=2),
}  # fmt: skip
LR = 1e-6
INIT_STD = 0.02  #: transformers' initializer_range


# --- common -------------------------------------------------------------------------------------


def _device(device: str, scale: str) -> torch.device:
    if scale not in SCALES:
        raise InvalidArgument(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgument(f"device must be cpu or cuda[:K], got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument("no CUDA device")
    return dev


def device_name(dev: torch.device) -> str:
    return "CPU memory" if dev.type == "cpu" else torch.cuda.get_device_name(dev)


def _timed(dev: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """``fn()`` timed from a synchronized device to a synchronized device."""
    cuda_sync(dev)
    t0 = time.perf_counter()
    out = fn()
    cuda_sync(dev)
    return time.perf_counter() - t0, out


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (``b`` brought to ``a``'s device as bytes: float8 too)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_flat(a), _flat(b).to(a.device))


def _figures(seconds: list[float], nbytes: int) -> dict[str, Any]:
    med = median(seconds)
    return {"seconds": seconds, "median_s": med, "min_s": min(seconds), "max_s": max(seconds),
            "gbps": nbytes / med / 1e9}  # fmt: skip


# --- conversion ---------------------------------------------------------------------------------


def _seeded_shards(layout: ReplicaLayout, seed: int, dev: torch.device) -> list[dict[str, torch.Tensor]]:
    """Every source shard's local tensors, made on ``dev``: weights ~ N(0, 0.02), norms ~ 1."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    out = []
    for tensors in layout.shards:
        shard = {}
        for pt in tensors:
            shape = pt.local_shape()
            x = torch.randn(shape, generator=gen, device=dev, dtype=torch.float32)
            x = x.mul_(INIT_STD) if len(shape) > 1 else x.mul_(0.05).add_(1.0)
            shard[pt.name] = x.to(torch_dtype(pt.placement.dtype))
        out.append(shard)
    return out


def _poison(tensors: Mapping[str, torch.Tensor]) -> None:
    for t in tensors.values():
        _flat(t).fill_(POISON)


def _phases(p: ReshardPlan, sources: Sequence[Mapping[str, torch.Tensor]], dest: dict[str, torch.Tensor],
            dev: torch.device) -> dict[str, float]:  # fmt: skip
    """One conversion by ``convert_in_process``'s steps, the device synchronized between them:
    seconds spent staging the reads, gathering, transforming (cast, FP8) and landing."""
    spent = dict.fromkeys(("stage", "gather", "transform", "land"), 0.0)

    def lap(phase: str, t0: float) -> float:
        cuda_sync(dev)
        now = time.perf_counter()
        spent[phase] += now - t0
        return now

    cuda_sync(dev)
    for sp in p.shards:
        for task in sp.tasks:
            t = time.perf_counter()
            views = []
            for read in task.reads:
                raw = _flat(sources[read.shard][read.tensor])
                landed = stage(read, dev)
                pos = 0
                for off, length in read.segments():
                    landed[pos : pos + length].copy_(raw[off : off + length])
                    pos += length
                views.append(read_view(read, landed, task.dtype))
            t = lap("stage", t)
            region = gather(task, views)
            t = lap("gather", t)
            results = transform(task, region)
            t = lap("transform", t)
            land(task, results, dest)
            lap("land", t)
    return spent


def conversion(device: str, scale: str, *, seed: int = 0) -> dict[str, Any]:
    """The FP8 conversion of a Qwen3-shaped shard on ``device`` against a same-layout replicate
    of the same bytes there (see the module docstring).

    Args:
        device: ``"cuda"``, ``"cuda:K"``, or ``"cpu"`` (a dry run).
        scale: ``"full"`` (about 1.4 GB of bf16 source) or ``"small"``.
        seed: the source tensors' seed.

    Returns:
        A JSON-serializable dict: ``replicate`` and ``conversion`` (seconds, median, GB/s of
        source bytes), ``ratio``, ``phases_s``, ``peak_temp_bytes``, ``exact`` (the byte check
        against the CPU path), the shapes and the plan's figures.

    Raises:
        InvalidArgument: an unknown scale or device.
    """
    dev = _device(device, scale)
    sizes = CONVERSION_SHAPES[scale]
    shape = DecoderShape.family("qwen3", **sizes)
    src = ReplicaLayout.spmd(hf_placements(shape, SOURCE_SHARDS), SOURCE_SHARDS)
    dst = ReplicaLayout.spmd(vllm_placements(shape, 1, fp8=True), 1)
    mapping = preset("qwen3", fp8=True)
    task_bytes = max(DEFAULT_BUDGET // 4, 4 * DEFAULT_CHUNK_BYTES)  # the converter's rule
    plan_s, p = _timed(torch.device("cpu"), lambda: plan(src, dst, mapping, max_task_bytes=task_bytes))
    (sp,) = p.shards

    sources = _seeded_shards(src, seed, dev)
    src_bytes = sum(t.numel() * t.element_size() for s in sources for t in s.values())
    dest = allocate(sp.tensors, dev)
    dest_bytes = sum(t.numel() * t.element_size() for t in dest.values())
    same = [{n: torch.empty_like(t) for n, t in s.items()} for s in sources]

    def replicate() -> None:
        for s, d in zip(sources, same, strict=True):
            for n, t in s.items():
                d[n].copy_(t)

    def convert() -> None:
        convert_in_process(p, sources, {sp.shard: dest}, dev)

    warmup, repeats = CONVERSION_REPEATS[scale]
    rep_s, conv_s = [], []
    for i in range(warmup + repeats):
        for d in same:
            _poison(d)
        _poison(dest)
        dt_rep, _ = _timed(dev, replicate)
        dt_conv, _ = _timed(dev, convert)
        if i >= warmup:
            rep_s.append(dt_rep)
            conv_s.append(dt_conv)
    replicate_exact = all(_same_bytes(d[n], t) for s, d in zip(sources, same) for n, t in s.items())
    del same

    _poison(dest)
    phases = _phases(p, sources, dest, dev)
    peak = None
    _poison(dest)
    if dev.type == "cuda":  # one more conversion, its temporary memory watched; its bytes are checked below
        cuda_sync(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        convert()
        cuda_sync(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
    else:
        convert()

    on_cpu = [{n: t.cpu() for n, t in s.items()} for s in sources]
    ref_s, ref = _timed(dev, lambda: convert_in_process(p, on_cpu)[sp.shard])
    del on_cpu
    differ = [n for n, want in ref.items() if not _same_bytes(want, dest[n])]
    fp8_tasks = sum(1 for t in sp.tasks if t.op == FP8)
    conv, rep = _figures(conv_s, src_bytes), _figures(rep_s, src_bytes)
    return {
        "device": str(dev), "gpu": device_name(dev), "scale": scale, "seed": seed,
        "shape": {"family": "qwen3", **sizes},
        "source": {"shards": SOURCE_SHARDS, "placement": "FSDP Shard(0)", "dtype": "bfloat16",
                   "tensors": sum(len(s) for s in sources), "bytes": src_bytes},
        "dest": {"tp": 1, "fp8": "float8_e4m3fn, 128x128 blocks", "tensors": len(dest), "bytes": dest_bytes},
        "plan": {"tasks": len(sp.tasks), "fp8_tasks": fp8_tasks, "reads": sum(len(t.reads) for t in sp.tasks),
                 "segments": p.num_segments, "read_bytes": sp.read_bytes, "max_task_bytes": task_bytes,
                 "plan_s": plan_s},
        "budget_bytes": DEFAULT_BUDGET, "peak_temp_bytes": peak,
        "warmup": warmup, "repeats": repeats,
        "replicate": {**rep, "path": "copy_ of every source tensor into a same-shape tensor", "exact": replicate_exact},
        "conversion": {**conv, "path": "tensorhub.reshard.convert_in_process on the device"},
        "ratio": conv["median_s"] / rep["median_s"], "goal_ratio": CONVERSION_GOAL,
        "goal_met": conv["median_s"] / rep["median_s"] <= CONVERSION_GOAL,
        "phases_s": phases,
        "exact": {"ok": not differ and replicate_exact, "differ": differ, "tensors": len(ref),
                  "bytes": dest_bytes, "reference_s": ref_s,
                  "reference": "convert_in_process on the CPU, the same plan and source bytes, full size"},
    }  # fmt: skip


# --- deltas -------------------------------------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, s: Mapping[str, int], dev: torch.device) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s["heads"], s["kv_heads"], s["head_dim"]
        q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
        self.q_proj = nn.Linear(s["hidden"], q, bias=False, device=dev)
        self.k_proj = nn.Linear(s["hidden"], kv, bias=False, device=dev)
        self.v_proj = nn.Linear(s["hidden"], kv, bias=False, device=dev)
        self.o_proj = nn.Linear(q, s["hidden"], bias=False, device=dev)
        self.q_norm = nn.RMSNorm(s["head_dim"], eps=1e-6, device=dev)
        self.k_norm = nn.RMSNorm(s["head_dim"], eps=1e-6, device=dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        # the norms in float32 (their weights' dtype: the fused kernel), then back to the autocast dtype
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim).float()).to(v.dtype).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).float()).to(v.dtype).transpose(1, 2)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class _Mlp(nn.Module):
    def __init__(self, s: Mapping[str, int], dev: torch.device) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s["hidden"], s["intermediate"], bias=False, device=dev)
        self.up_proj = nn.Linear(s["hidden"], s["intermediate"], bias=False, device=dev)
        self.down_proj = nn.Linear(s["intermediate"], s["hidden"], bias=False, device=dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, s: Mapping[str, int], dev: torch.device) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(s["hidden"], eps=1e-6, device=dev)
        self.self_attn = _Attention(s, dev)
        self.post_attention_layernorm = nn.RMSNorm(s["hidden"], eps=1e-6, device=dev)
        self.mlp = _Mlp(s, dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, s: Mapping[str, int], dev: torch.device) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s["vocab"], s["hidden"], device=dev)
        self.layers = nn.ModuleList(_Layer(s, dev) for _ in range(s["layers"]))
        self.norm = nn.RMSNorm(s["hidden"], eps=1e-6, device=dev)


class Decoder(nn.Module):
    """A Qwen3-shaped causal decoder under Hugging Face's parameter names (q/k norms, grouped KV
    heads, SwiGLU MLP, untied ``lm_head``; no rotary embedding: it has no weights)."""

    def __init__(self, s: Mapping[str, int], dev: torch.device, seed: int) -> None:
        super().__init__()
        self.model = _Body(s, dev)
        self.lm_head = nn.Linear(s["hidden"], s["vocab"], bias=False, device=dev)
        gen = torch.Generator(device=dev).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not name.endswith("norm.weight"):
                    p.normal_(0.0, INIT_STD, generator=gen)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        logits = self.lm_head(self.model.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _compare_streamed(
    snap: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], layout: Layout, base: int, version: int,
    base_sums: tuple[int, ...], sums: tuple[int, ...], scratch: torch.Tensor,
) -> Delta:  # fmt: skip
    """The handle's delta computed on the device (a prototype, not the library's path): each
    tensor of ``snap`` (pinned CPU) copied into ``scratch`` on the device and compared there,
    only the changed values and indices brought back; ``snap`` is then brought forward in place
    (``apply_delta`` on the CPU: it writes only what changed)."""
    entries = []
    for spec in layout.tensors:
        cur, old = tensors[spec.name], snap[spec.name]
        prev = scratch[: old.numel() * old.element_size()].view(old.dtype).view(old.shape)
        prev.copy_(old, non_blocking=True)
        idx = changed_indices(prev, cur)  # the count is read back: a sync per slice
        k = idx.numel()
        if not k:
            continue
        if encoding_for(k, cur.numel(), DTYPE_SIZES[spec.dtype]) == SPARSE:
            values = bits_of(cur).index_select(0, idx).view(cur.dtype).cpu()
            entries.append(TensorDelta(spec.name, SPARSE, k, values, idx.to(torch.int32).cpu()))
        else:
            entries.append(TensorDelta(spec.name, DENSE, k, cur.detach().reshape(-1).to("cpu", copy=True)))
    delta = Delta(layout, base, version, tuple(entries), base_sums, sums)
    apply_delta(snap, delta, check_base=False, verify=False)
    return delta


def _same_delta(a: Delta, b: Delta) -> bool:
    if [e.name for e in a.tensors] != [e.name for e in b.tensors]:
        return False
    for x, y in zip(a.tensors, b.tensors):
        if (x.encoding, x.changed) != (y.encoding, y.changed) or not _same_bytes(x.values.cpu(), y.values):
            return False
        if (x.indices is None) != (y.indices is None):
            return False
        if x.indices is not None and not _same_bytes(x.indices.cpu(), y.indices):  # type: ignore[arg-type]
            return False
    return True


def _same_tensors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bits_of(a[n]), bits_of(b[n]).to(a[n].device)) for n in a)


def _clone(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in tensors.items()}


def _planted_base(rd: dict[str, torch.Tensor], delta: Delta) -> dict[str, Any]:
    """Apply ``delta`` to a copy of ``rd`` with one bit flipped: refused, nothing written?"""
    bad = _clone(rd)
    name = max(bad, key=lambda n: bad[n].numel())
    flat = bits_of(bad[name])
    at = flat.numel() // 2 + 1
    flat[at : at + 1].bitwise_xor_(1)
    try:
        apply_delta(bad, delta)
        refused, named = False, []
    except BaseMismatch as err:
        refused, named = True, list(err.tensors)
    flat[at : at + 1].bitwise_xor_(1)
    untouched = _same_tensors(bad, rd)
    return {"tensor": name, "element": at, "refused": refused, "named": named, "untouched": untouched,
            "ok": refused and untouched and named == [name]}  # fmt: skip


def deltas(device: str, scale: str, *, seed: int = 0) -> dict[str, Any]:
    """A small model's training step on ``device``, and its deltas there: the publish-time
    compare as the handle does it (and two on-device alternatives), the reader's in-place apply
    on GPU memory; byte-exact (see the module docstring).

    Args:
        device: ``"cuda"``, ``"cuda:K"``, or ``"cpu"`` (a dry run).
        scale: ``"full"`` (about 211M parameters) or ``"small"``.
        seed: the model's and the tokens' seed.

    Returns:
        A JSON-serializable dict: per-step figures (``rows``), their medians in ms
        (``median_ms``), the compare as a fraction of the step, the fraction of elements changed,
        delta and full bytes, and ``exact`` (every check).

    Raises:
        InvalidArgument: an unknown scale or device.
    """
    dev = _device(device, scale)
    s = DELTA_SIZES[scale]
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(seed)
    model = Decoder(s, dev, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=cuda)
    params = dict(model.named_parameters())
    total_steps = s["warmup"] + s["steps"]
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, s["vocab"], (total_steps, s["accum"], s["batch"], s["seq"]), generator=gen).to(dev)

    # What the trainer registers and publishes: the bf16 cast of the masters.
    pub = {n: torch.empty(p.shape, dtype=torch.bfloat16, device=dev) for n, p in params.items()}

    def cast() -> None:
        with torch.no_grad():
            for n, p in params.items():
                pub[n].copy_(p)

    def train_step(k: int) -> float:
        for micro in tokens[k]:
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
                loss = model(micro) / s["accum"]
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cast()
        return float(loss.detach()) * s["accum"]

    cast()
    layout = layout_of(pub)
    sums = shard_checksums(pub, layout)  # the publish job's, version 0
    snap = _copy_to_cpu(pub)  # the handle's first snapshot
    pinned = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for n, t in pub.items()}
    for n, t in pinned.items():
        t.copy_(pub[n])
    scratch = torch.empty(max(t.numel() * t.element_size() for t in pub.values()), dtype=torch.uint8, device=dev)
    rd = _clone(pub)  # the reader, holding version 0 in GPU memory
    prev = _clone(pub)  # version v-1 on the device, for compute_delta there
    n_params = sum(t.numel() for t in pub.values())

    rows: list[dict[str, Any]] = []
    checks: dict[str, Any] = {"reader_equals_trainer": True, "streamed_equals_handle": True,
                              "device_equals_handle": True, "snapshot_brought_forward": True}  # fmt: skip
    for k in range(total_steps):
        base, version = k, k + 1
        for n, t in prev.items():
            t.copy_(pub[n])
        step_s, loss = _timed(dev, lambda: train_step(k))
        sums_s, new_sums = _timed(dev, lambda: shard_checksums(pub, layout))
        # The path the handle had before (a pageable copy to CPU memory, compared there), then the
        # handle's compare as DeltaPublisher calls it (on the GPU, against the pinned snapshot).
        copy_s, current = _timed(dev, lambda: {n: t.detach().to("cpu", copy=True) for n, t in pub.items()})
        known = dict(base_version=base, version=version, layout=layout, base_checksums=sums, checksums=new_sums,
                     with_checksums=False)  # fmt: skip
        cpu_cmp_s, _ = _timed(dev, lambda: compute_delta(snap, current, **known))
        del current
        if k == total_steps - 1 and os.environ.get("TENSORHUB_PROFILE_COMPARE") == "1":  # where the compare's time goes
            import cProfile
            import pstats

            spare = {n: t.clone().pin_memory() if cuda else t.clone() for n, t in snap.items()}
            with cProfile.Profile() as prof:
                _compare(spare, pub, base, version, layout, sums, new_sums)
                cuda_sync(dev)
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
            del spare
        handle_s, (delta, snap) = _timed(dev, lambda: _compare(snap, pub, base, version, layout, sums, new_sums))
        gpu_s, on_device = _timed(dev, lambda: compute_delta(prev, pub, **known))
        h2d_s, _ = _timed(dev, lambda: [scratch[: t.numel() * t.element_size()].copy_(_flat(t), non_blocking=True)
                                        for t in pinned.values()])  # fmt: skip
        streamed_s, streamed = _timed(
            dev, lambda: _compare_streamed(pinned, pub, layout, base, version, sums, new_sums, scratch)
        )
        checks["device_equals_handle"] &= _same_delta(on_device, delta)
        checks["streamed_equals_handle"] &= _same_delta(streamed, delta)
        checks["snapshot_brought_forward"] &= _same_tensors(pinned, pub) and _same_tensors(snap, pub)
        del on_device, streamed
        if k == 0:
            checks["planted_base"] = _planted_base(rd, delta)
        spare = _clone(rd)
        write_s, _ = _timed(dev, lambda: apply_delta(spare, delta, check_base=False, verify=False))
        del spare
        apply_s, _ = _timed(dev, lambda: apply_delta(rd, delta))
        checks["reader_equals_trainer"] &= _same_tensors(rd, pub)
        d = describe(delta)
        rows.append({
            "step": version, "warmup": k < s["warmup"], "loss": loss, "step_s": step_s,
            "compare_handle_s": handle_s, "compare_handle_copy_s": copy_s, "compare_handle_cpu_s": cpu_cmp_s,
            "compare_device_s": gpu_s, "compare_streamed_s": streamed_s, "snapshot_h2d_s": h2d_s,
            "publish_checksums_s": sums_s, "apply_s": apply_s, "apply_write_s": write_s,
            "changed_fraction": d["changed_elements"] / d["total_elements"], "delta_bytes": d["nbytes"],
            "full_bytes": d["full_bytes"], "sparse": d["sparse"], "dense": d["dense"],
        })  # fmt: skip
        sums = new_sums

    timed = [r for r in rows if not r["warmup"]]
    keys = [k for k, v in timed[0].items() if k.endswith("_s")]
    median_ms = {k.removesuffix("_s"): median(r[k] for r in timed) * 1e3 for k in keys}
    step = median_ms["step"]
    checks["ok"] = all(v for k, v in checks.items() if k != "planted_base") and checks["planted_base"]["ok"]
    return {
        "device": str(dev), "gpu": device_name(dev), "scale": scale, "seed": seed,
        "model": {"shape": "qwen3-like", **{k: s[k] for k in ("layers", "hidden", "intermediate", "heads", "kv_heads",
                                                             "head_dim", "vocab")},
                  "parameters": n_params, "tensors": len(pub), "published_dtype": "bfloat16", "masters": "float32"},
        "train": {"optimizer": "AdamW", "lr": LR, "weight_decay": 0.0, "micro_batch": [s["batch"], s["seq"]],
                  "accum": s["accum"], "tokens_per_step": s["batch"] * s["seq"] * s["accum"], "autocast": "bfloat16"},
        "checksum": layout.checksum, "warmup_steps": s["warmup"], "steps": s["steps"],
        "median_ms": median_ms,
        "compare_fraction_of_step": median_ms["compare_handle"] / step,
        "streamed_fraction_of_step": median_ms["compare_streamed"] / step,
        "device_fraction_of_step": median_ms["compare_device"] / step,
        "goal_fraction": COMPARE_GOAL, "goal_met": median_ms["compare_handle"] / step <= COMPARE_GOAL,
        "changed_fraction": median(r["changed_fraction"] for r in timed),
        "delta_bytes": median(r["delta_bytes"] for r in timed), "full_bytes": rows[-1]["full_bytes"],
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
        "rows": rows, "exact": checks,
    }  # fmt: skip


# --- the report -------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def conversion_lines(r: dict[str, Any]) -> list[str]:
    """:func:`conversion`'s result as a compact table."""
    sh, pl, src, dst = r["shape"], r["plan"], r["source"], r["dest"]
    out = [
        f"conversion on {r['device']} ({r['gpu']}): Qwen3-shaped, {sh['layers']} layers, hidden {sh['hidden']}, "
        f"intermediate {sh['intermediate']}, heads {sh['heads']}/{sh['kv_heads']}x{sh['head_dim']}, "
        f"vocab {sh['vocab']}",
        f"  {_mib(src['bytes'])} bf16 in {src['shards']} source shards ({src['placement']}) -> 1 shard, vLLM names, "
        f"FP8 e4m3 128x128 blocks ({_mib(dst['bytes'])}, {dst['tensors']} tensors)",
        f"  plan: {pl['tasks']} tasks ({pl['fp8_tasks']} FP8), {pl['reads']} reads, {pl['segments']} segments, "
        f"tasks <= {_mib(pl['max_task_bytes'])} (budget {_mib(r['budget_bytes'])}), "
        f"planned in {pl['plan_s'] * 1e3:.0f} ms",
        f"  {'path':<44} {'median ms':>10} {'min':>8} {'max':>8} {'GB/s':>8}  vs replicate",
    ]
    paths = (("replicate", "same-layout replicate (d2d copy_)"), ("conversion", "FP8 conversion (convert_in_process)"))
    for key, title in paths:
        f = r[key]
        ratio = f"{f['median_s'] / r['replicate']['median_s']:.2f}x"
        out.append(f"  {title:<44} {f['median_s'] * 1e3:>10.2f} {f['min_s'] * 1e3:>8.2f} {f['max_s'] * 1e3:>8.2f} "
                   f"{f['gbps']:>8.2f}  {ratio}")  # fmt: skip
    out.append(f"  ratio {r['ratio']:.2f}x (goal <= {r['goal_ratio']}x: {'met' if r['goal_met'] else 'NOT met'}); "
               f"median of {r['repeats']} after {r['warmup']} warm-up")  # fmt: skip
    ph = r["phases_s"]
    spent = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in ph.items())
    out.append(f"  one conversion, synchronized between phases: {spent} (total {sum(ph.values()) * 1e3:.2f} ms)")
    if r["peak_temp_bytes"] is not None:
        out.append(f"  peak temporary GPU memory {_mib(r['peak_temp_bytes'])} (budget {_mib(r['budget_bytes'])})")
    ex = r["exact"]
    out.append(
        f"  bytes: {'every' if ex['ok'] else 'NOT every'} destination byte equals the CPU path's "
        f"({ex['tensors']} tensors, {_mib(ex['bytes'])}; {ex['reference']}, {ex['reference_s']:.1f} s)"
        + (f"; differ: {', '.join(ex['differ'][:5])}" if ex["differ"] else "")
        + ("" if r["replicate"]["exact"] else "; the replicate's copy differs: the check itself is broken")
    )
    return out


def delta_lines(r: dict[str, Any]) -> list[str]:
    """:func:`deltas`'s result as a compact table."""
    m, tr, ms = r["model"], r["train"], r["median_ms"]
    step = ms["step"]
    mb, ts = tr["micro_batch"], tr["tokens_per_step"]
    out = [
        f"deltas on {r['device']} ({r['gpu']}): Qwen3-shaped decoder, {m['layers']} layers, hidden {m['hidden']}, "
        f"{m['parameters'] / 1e6:.1f}M parameters ({_mib(r['full_bytes'])} bf16 published, float32 masters)",
        f"  step: {tr['accum']} x {mb[0]}x{mb[1]} tokens ({ts} per step), bf16 autocast, AdamW lr {tr['lr']:g}; "
        f"layout checksum {r['checksum']}; median of {r['steps']} steps after {r['warmup_steps']} warm-up",
        f"  {'':<58} {'ms':>9} {'% of step':>10}",
    ]

    def row(title: str, key: str, goal: str = "") -> None:
        out.append(f"  {title:<58} {ms[key]:>9.2f} {ms[key] / step:>9.1%}{goal}")

    out.append(f"  {'training step (fwd+bwd, AdamW, bf16 cast)':<58} {step:>9.2f}")
    ok = "met" if r["goal_met"] else "NOT met"
    row("compare as the handle does it (_compare)", "compare_handle", f"  (goal <= {r['goal_fraction']:.0%}: {ok})")
    row("  the first path: copy of the GPU tensors to CPU memory", "compare_handle_copy")
    row("                  then compute_delta on the CPU", "compare_handle_cpu")
    row("compute_delta on the device (both versions there)", "compare_device")
    row("  the second path: slices copied over, apply on the CPU", "compare_streamed")
    row("  its floor: host-to-device copy of the snapshot", "snapshot_h2d")
    row(f"publish checksums ({r['checksum']}, one pass, for scale)", "publish_checksums")
    row("apply on the device (base check, write, verify)", "apply")
    row("  the write alone (no base check, no verify)", "apply_write")
    smaller = r["full_bytes"] / max(r["delta_bytes"], 1)
    out.append(f"  changed: {r['changed_fraction']:.3%} of elements; delta {_mib(r['delta_bytes'])} "
               f"vs {_mib(r['full_bytes'])} full ({smaller:.1f}x smaller)")  # fmt: skip
    ex = r["exact"]
    pb = ex["planted_base"]
    planted = (f"a planted wrong base ({pb['tensor']}) refused with BaseMismatch naming {pb['named']}, nothing written"
               if pb["ok"] else f"planted wrong base NOT handled: {pb}")  # fmt: skip
    out.append("  bytes: " + ("; ".join(
        f"{k.replace('_', ' ')}: {'yes' if v else 'NO'}" for k, v in ex.items() if k not in ("planted_base", "ok")
    )) + f"; {planted}")  # fmt: skip
    if r["peak_gpu_bytes"] is not None:
        out.append(f"  peak GPU memory {_mib(r['peak_gpu_bytes'])}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="a dry run on CPU memory at small sizes (no GPU figures)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("conversion", "deltas"), help="run one workload")
    args = ap.parse_args(argv)
    if args.cpu:
        device, scale = "cpu", "small"
    elif not torch.cuda.is_available():
        print("skipped: no CUDA device")
        if args.json:
            write_json(args.json, {"skipped": "no CUDA device"})
        return 0
    else:
        device, scale = "cuda", "full"
    print(f"GPU workloads{' (dry run on CPU memory)' if args.cpu else ''}: {device}, scale {scale}, seed {args.seed}, "
          f"torch {torch.__version__}", flush=True)  # fmt: skip
    results: dict[str, Any] = {"device": device, "scale": scale, "seed": args.seed, "torch": torch.__version__,
                               "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}  # fmt: skip
    failures = []
    workloads = {"conversion": (conversion, conversion_lines), "deltas": (deltas, delta_lines)}
    for name, (run, lines) in workloads.items():
        if args.only and name != args.only:
            continue
        t0 = time.perf_counter()
        try:
            res = run(device, scale, seed=args.seed)
        except Exception as err:  # noqa: BLE001 - reported; the other workload goes on
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            failures.append(name)
            print(f"\n{name} FAILED: {type(err).__name__}: {err}", file=sys.stderr)
            continue
        res["wall_s"] = time.perf_counter() - t0
        results[name] = res
        print()
        print("\n".join(lines(res)))
        print(f"  ({res['wall_s']:.1f} s)", flush=True)
        if not res["exact"]["ok"]:
            failures.append(f"{name} bytes")
    print()
    print("FAILED: " + "; ".join(failures) if failures else "every byte check passed")
    if args.json:
        write_json(args.json, results)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
