"""Resharding at the Perplexity write-up's shapes: a bf16 trainer to an fp8 inference engine.

Theory of operation
-------------------
The write-up (Perplexity's "Weight Transfer for RL Post-Training in under 2 seconds",
research.perplexity.ai, and its author's "Journey to 2-second Inter-node RL Weight Transfer")
moves Qwen3-235B from 128 training GPUs (bf16, FSDP) to 32 inference GPUs (fp8) in about 2 s,
and Kimi-K2 (1T) from 256 to 128 GPUs in 1.3 s. This scenario runs the same shapes through
the design of issue 20: each destination GPU of the **first** replica of a target layout pulls the bf16 source
slices it needs straight from the FSDP shards and converts them (gather, fuse, FP8 block
quantize) into its own buffers; every further replica of that layout pulls the converted fp8
shard **peer to peer**, pipelined, from the replica before it. One conversion per target
layout, however many replicas.

What comes from where:

- **Bytes** are the production planner's (:func:`tensorhub.scheduling.reshard.plan`) for the
  real tensor names and widths (:mod:`tensorhub.scheduling.decoders`, the ``preset`` mappings):
  per destination shard, the bytes it reads from each source shard (strided slices and the
  holes the planner reads through included) and the bytes it lands. The planner is run on
  **one layer** of the model and the layers are extrapolated: every layer has the same tensors
  and FSDP shards each tensor on its own, so a layer's reads are the same in every layer (the
  extrapolation is exact, and keeps a 1T plan to about a second).
- **Mixture of experts** as the checkpoints have it and vLLM loads it
  (:mod:`tensorhub.scheduling.decoders`): the trainer's per-expert ``gate_proj``/``up_proj``/
  ``down_proj``, the router, Kimi-K2's shared expert and dense first layer; the engine's stacked
  ``w13``/``w2`` under expert parallelism (each inference GPU holds ``experts / tp`` whole
  experts, their block-FP8 scales beside them; attention and the shared expert tensor-parallel).
  On the trainer the experts are FSDP-sharded over every GPU, or (``source_ep``) on their own
  expert-parallel mesh as in the write-up: each expert only on its group's GPUs.
- **Multi-head latent attention** as Kimi-K2 has it: the trainer's ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` fused into vLLM's replicated ``fused_qkv_a_proj`` (every inference GPU
  reads it whole), ``q_b_proj``/``kv_b_proj`` cut by heads, ``o_proj`` by columns. The parameter
  counts are printed.
- **Hardware and conversion** are stated inputs (:class:`ReshardInputs`), not measurements: a
  NIC per GPU each way at ``nic_gbps`` (the write-up's 400 Gbps), the data plane's
  ``efficiency``, and conversion at ``convert_gbps`` of source bytes per GPU, overlapped with
  the transfer (a pipeline of tasks of at most ``task_bytes``: the last one's conversion is
  the tail that does not overlap).

The simulation is the flow-level network of :mod:`tensorhub.sim.network` in virtual time. A
converting GPU pulls its source bytes in ``chunks`` consecutive reads over its NIC's receive
side and its converter (a link of ``convert_gbps``): the slower of the two sets the rate. The
source GPUs' NICs enter as a cap on each converting GPU: it cannot be served faster than the
most loaded source GPU (by the plan's loads, summed over every conversion running at once)
can send its share. A peer reader takes chunk ``k`` of its shard from the replica before it
once that one holds it (converted, for the first replica), one read at a time: a hop lags by one
chunk, as the table's pipelined bursts do. The comparison **every replica converts** runs the
same model with each replica pulling from the trainers and converting on its own.

Not modelled: the reference server's choice of sources (the chain is what it builds for a
burst of readers of one layout), per-kernel launch costs (fold them into ``convert_gbps``),
failures. No IO: the scenario returns a :class:`~tensorhub.sim.scenarios.Result` that
``tensorhub sim reshard`` prints.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tensorhub.core.errors import InvalidArgument
from tensorhub.core.placement import ReplicaLayout
from tensorhub.scheduling.decoders import DecoderShape, hf_layout, hf_tensors, vllm_placements
from tensorhub.scheduling.mapping import preset
from tensorhub.scheduling.reshard import DEFAULT_MAX_GAP, plan

from .baselines import STRAGGLER_SIGMA, TENSORHUB
from .cluster import GB
from .core import Simulator
from .network import Link, Network
from .scenarios import Result

__all__ = [
    "CASES",
    "MODELS",
    "Decoder",
    "LayoutDemand",
    "ReshardCase",
    "ReshardInputs",
    "ReshardOutcome",
    "Target",
    "demand",
    "reshard",
    "simulate",
]


@dataclass(frozen=True)
class Decoder:
    """A model as the planner sees it: a decoder family (for the name mapping) and its sizes."""

    name: str
    family: str
    shape: DecoderShape

    @property
    def params(self) -> int:
        one = dataclasses.replace(self.shape, layers=1)
        sizes = {n: math.prod(s) for n, s in hf_tensors(one)}
        per_layer = sum(v for n, v in sizes.items() if ".layers.0." in n)
        rest = sum(v for n, v in sizes.items() if ".layers.0." not in n)
        if not self.shape.dense_layers:
            return rest + self.shape.layers * per_layer
        d = self.shape.dense_layers  # the first d layers are dense, the rest experts
        two = dataclasses.replace(self.shape, layers=d + 1)
        sizes = {n: math.prod(s) for n, s in hf_tensors(two)}
        moe = sum(v for n, v in sizes.items() if f".layers.{d}." in n)
        return sum(sizes.values()) + (self.shape.layers - d - 1) * moe


MODELS = {
    # Qwen3-235B-A22B's config: 94 layers, hidden 4096, 64 query and 4 KV heads of 128, 128
    # experts of width 1536 in every layer (no shared expert), vocabulary 151,936, untied
    # embeddings.
    "Qwen3-235B": Decoder(
        "Qwen3-235B",
        "qwen3",
        DecoderShape(layers=94, hidden=4096, intermediate=12288, heads=64, kv_heads=4, head_dim=128, vocab=151936,
                     qk_norm=True, experts=128, expert_intermediate=1536),  # fmt: skip
    ),
    # Kimi-K2's config: 61 layers, hidden 7168, 64 heads, 384 routed experts of width 2048 and one
    # shared expert, the first layer dense (width 18432), the router's score-correction bias,
    # vocabulary 163,840; multi-head latent attention (queries compressed to 1536, keys and values
    # to 512, heads of 128 + 64 rotary, values of 128).
    "Kimi-K2 1T": Decoder(
        "Kimi-K2 1T",
        "deepseek_v3",
        DecoderShape(layers=61, hidden=7168, intermediate=18432, heads=64, kv_heads=64, head_dim=192, vocab=163840,
                     experts=384, expert_intermediate=2048, shared_intermediate=2048, dense_layers=1,
                     router_bias=True, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                     v_head_dim=128),  # fmt: skip
    ),
}


@dataclass(frozen=True)
class ReshardInputs:
    """The stated inputs (bandwidths per GPU, each way).

    Attributes:
        nic_gbps: a GPU's RDMA NIC share, Gbit/s (the write-up: 400 Gbps, about 50 GB/s).
        efficiency: the fraction of the line rate a transfer reaches: the simulator's one
            TensorHub data plane (with the stragglers every scenario draws, the paper's 22 of
            25 GB/s). The write-up's first test reached 36 of 50 GB/s.
        convert_gbps: gather + fuse + FP8 quantize, GB/s of source (bf16) bytes per GPU,
            launch costs included; overlapped with the transfer.
        task_bytes: the largest task of the conversion pipeline (the planner's
            ``max_task_bytes``); its conversion is the tail that does not overlap.
        chunks: reads per shard (the pipeline's grain: a peer hop lags by one).
        rdma_latency: one read's round trip, seconds.
        grant_latency: asking the reference server for a grant before the first read, seconds.
        max_gap: holes the planner reads through (its default).
    """

    nic_gbps: float = 400.0
    efficiency: float = TENSORHUB.efficiency
    convert_gbps: float = 100.0
    task_bytes: int = 256 << 20
    chunks: int = 128
    rdma_latency: float = 20e-6
    grant_latency: float = 1e-3
    max_gap: int = DEFAULT_MAX_GAP

    def __post_init__(self) -> None:
        for name in ("nic_gbps", "convert_gbps"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"ReshardInputs.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.efficiency <= 1:
            raise InvalidArgument(f"ReshardInputs.efficiency must be in (0, 1], got {self.efficiency!r}")
        if self.chunks < 1 or self.task_bytes < 1 or self.max_gap < 0:
            raise InvalidArgument(f"ReshardInputs: chunks and task_bytes must be >= 1, max_gap >= 0: {self!r}")
        if self.rdma_latency < 0 or self.grant_latency < 0:
            raise InvalidArgument(f"ReshardInputs: latencies must be >= 0: {self!r}")

    @property
    def nic_rate(self) -> float:
        """Bytes per second a NIC moves each way."""
        return self.nic_gbps / 8 * GB * self.efficiency


@dataclass(frozen=True)
class Target:
    """One target layout: ``replicas`` inference replicas of tensor parallelism ``tp``, fp8; with
    ``dp`` > 1, each replica is ``dp`` data-parallel attention groups of ``tp`` with the experts
    spread over all ``dp x tp`` GPUs (vLLM's DP attention + expert parallelism)."""

    tp: int
    replicas: int = 1
    dp: int = 1

    @property
    def ranks(self) -> int:
        """GPUs per replica."""
        return self.tp * self.dp

    @property
    def gpus(self) -> int:
        return self.ranks * self.replicas

    @property
    def label(self) -> str:
        return f"TP{self.tp}" if self.dp == 1 else f"DP{self.dp}TP{self.tp}"

    def __str__(self) -> str:
        return f"{self.replicas}x TP{self.tp}" if self.dp == 1 else f"{self.replicas}x DP{self.dp} TP{self.tp} EP{self.ranks}"


@dataclass(frozen=True)
class ReshardCase:
    """A row of the table: a model, its trainer, its engine's layouts, and the published time."""

    label: str
    model: Decoder
    source_gpus: int
    targets: tuple[Target, ...]
    published_s: float | None = None
    inputs: ReshardInputs = ReshardInputs()
    source_ep: int = 1


# ---- what each destination shard reads (the production planner) ---------------------------------


@dataclass(frozen=True)
class LayoutDemand:
    """What the shards of one replica of a target layout read and land (all layers).

    Attributes:
        reads: per destination shard, bytes read from each source shard.
        landed: per destination shard, bytes of its own tensors (fp8 weights, scales, the rest).
        tasks: per destination shard, the plan's tasks.
        segments: per destination shard, the RDMA segments of its reads.
        largest_task: the largest task's source bytes.
    """

    reads: tuple[tuple[int, ...], ...]
    landed: tuple[int, ...]
    tasks: tuple[int, ...]
    segments: tuple[int, ...]
    largest_task: int

    @property
    def loads(self) -> tuple[int, ...]:
        """Bytes each source shard serves to one replica."""
        return tuple(map(sum, zip(*self.reads)))

    def read_bytes(self, j: int) -> int:
        return sum(self.reads[j])


@functools.lru_cache(maxsize=32)
def demand(
    model: Decoder,
    source_gpus: int,
    tp: int,
    max_gap: int = DEFAULT_MAX_GAP,
    task_bytes: int = 256 << 20,
    source_ep: int = 1,
    dp: int = 1,
) -> LayoutDemand:
    """Plan one layer of ``model`` (each kind of layer: a dense first one, then one of experts)
    from an FSDP trainer of ``source_gpus`` (bf16, ``Shard(0)``; ``source_ep`` > 1: the experts
    on their own expert-parallel mesh) to a vLLM engine of tensor parallelism ``tp`` (fp8 block
    scales; experts expert-parallel) and extrapolate to every layer (exact: see the module
    docstring). Pure; cached.

    Raises:
        InvalidArgument: a layout vLLM could not shard (e.g. heads not divisible by ``tp``).
    """
    shape = model.shape
    d = shape.dense_layers
    one = dataclasses.replace(shape, layers=d + 1)
    dst = ReplicaLayout.spmd(vllm_placements(one, tp, fp8=True, expert_parallel=shape.experts > 0, dp=dp), tp * dp)
    src = hf_layout(one, source_gpus, ep=source_ep)  # after: a layout vLLM refuses is refused at once
    p = plan(src, dst, preset(model.family, fp8=True), max_gap=max_gap, max_task_bytes=task_bytes)
    layers = shape.layers
    repeated = f".layers.{d}."

    def times(name: str) -> int:
        return layers - d if repeated in name else 1

    reads, landed, tasks, segments = [], [], [], []
    largest = 0
    for sp in p.shards:
        row = [0] * source_gpus
        n_tasks = n_segments = 0
        for t in sp.tasks:
            k = times(t.source)
            n_tasks += k
            largest = max(largest, t.nbytes)
            for r in t.reads:
                row[r.shard] += k * r.nbytes
                n_segments += k * r.num_segments
        reads.append(tuple(row))
        landed.append(sum(times(s.name) * s.nbytes for s in sp.tensors))
        tasks.append(n_tasks)
        segments.append(n_segments)
    return LayoutDemand(tuple(reads), tuple(landed), tuple(tasks), tuple(segments), largest)


# ---- the simulation ------------------------------------------------------------------------------


@dataclass
class ReshardOutcome:
    """One simulated update of every inference GPU.

    Attributes:
        seconds: until the last inference GPU holds its converted shard.
        conversions: replicas that converted (pulled from the trainers).
        replicas: inference replicas in all.
        source_bytes: bytes that left the trainers.
        peer_bytes: bytes inference GPUs pulled from each other.
        read_per_gpu: the most a converting GPU read from the trainers.
        landed_per_gpu: the most bytes an inference GPU holds.
        replica_done: per replica (``"TP8.r0"`` ...), when its last GPU was done.
    """

    seconds: float
    conversions: int
    replicas: int
    source_bytes: float
    peer_bytes: float
    read_per_gpu: float
    landed_per_gpu: float
    replica_done: dict[str, float] = field(default_factory=dict)
    events: int = 0
    digest: str = ""


def simulate(
    model: Decoder,
    source_gpus: int,
    targets: tuple[Target, ...],
    inputs: ReshardInputs = ReshardInputs(),
    seed: int = 0,
    *,
    convert_once: bool = True,
    source_ep: int = 1,
) -> ReshardOutcome:
    """Update every inference GPU of ``targets`` from a trainer of ``source_gpus``.

    Args:
        model: the model.
        source_gpus: the trainer's GPUs (bf16, FSDP ``Shard(0)``).
        targets: the inference layouts (their GPUs are distinct).
        inputs: the stated hardware and conversion costs.
        seed: draws the inference NICs' stragglers (as every scenario does).
        convert_once: TensorHub: one replica per layout converts, the others pull from peers;
            False: every replica pulls from the trainers and converts.
        source_ep: the trainer's expert-parallel groups (its experts on their own mesh).

    Returns:
        The outcome.

    Raises:
        InvalidArgument: no target, or a layout vLLM could not shard.
        SimStuck: a GPU never got its shard (a bug, not a slow network).
    """
    if not targets or any(t.tp < 1 or t.replicas < 1 or t.dp < 1 for t in targets):
        raise InvalidArgument(f"targets must be at least one layout of tp, dp and replicas >= 1, got {targets!r}")
    sim = Simulator(seed)
    net = Network(sim)
    rng = sim.child_rng()
    need = [demand(model, source_gpus, t.tp, inputs.max_gap, inputs.task_bytes, source_ep, t.dp) for t in targets]
    conv_rate = inputs.convert_gbps * GB
    k_chunks = inputs.chunks

    # the trainers' side: every conversion running at once adds its loads to the source NICs
    loads = [0.0] * source_gpus
    for t, d in zip(targets, need):
        for s, served in enumerate(d.loads):
            loads[s] += served * (1 if convert_once else t.replicas)
    source_time = max(loads) / inputs.nic_rate  # the most loaded source NIC, alone

    links: dict[str, tuple[Link, Link]] = {}

    def nic(gpu: str) -> tuple[Link, Link]:  # (tx, rx): one straggler factor per NIC
        got = links.get(gpu)
        if got is None:
            f = max(0.5, 1.0 - abs(rng.gauss(0.0, STRAGGLER_SIGMA)))
            got = links[gpu] = (
                net.link(f"nic:{gpu}:tx", inputs.nic_rate * f),
                net.link(f"nic:{gpu}:rx", inputs.nic_rate * f),
            )
        return got

    held: dict[str, int] = {}  # gpu -> chunks it holds (converted)
    waiting: dict[str, list[Callable[[], None]]] = {}
    finished: dict[str, float] = {}
    out = ReshardOutcome(0.0, 0, sum(t.replicas for t in targets), 0.0, 0.0, 0.0, 0.0)

    def have(gpu: str, k: int) -> None:
        held[gpu] = k
        if k == k_chunks:
            finished[gpu] = sim.now
            sim.record("done", gpu)
        for wake in waiting.pop(gpu, []):
            wake()

    def convert(gpu: str, nbytes: float, tail: float) -> None:
        """Pull ``nbytes`` from the trainers in chunks through this GPU's NIC and converter."""
        rx = nic(gpu)[1]
        cv = net.link(f"convert:{gpu}", conv_rate)
        cap = nbytes / source_time if source_time > 0 else None

        def chunk(k: int) -> None:
            def arrived() -> None:
                sim.after(tail, have, gpu, k + 1)  # converted one task's tail after its last byte
                if k + 1 < k_chunks:
                    chunk(k + 1)

            net.start([rx, cv], nbytes / k_chunks, arrived, cap)

        sim.after(inputs.rdma_latency, chunk, 0)

    def copy(gpu: str, upstream: str, nbytes: float) -> None:
        """Pull the converted shard from ``upstream``, chunk by chunk, once it holds each."""
        path = [nic(upstream)[0], nic(gpu)[1]]

        def chunk() -> None:
            k = held.get(gpu, 0)
            if k == k_chunks:
                return
            if held.get(upstream, 0) <= k:
                waiting.setdefault(upstream, []).append(chunk)
                return

            def arrived() -> None:
                have(gpu, k + 1)
                chunk()

            sim.after(inputs.rdma_latency, net.start, path, nbytes / k_chunks, arrived)

        chunk()

    gpus: list[str] = []
    for t, d in zip(targets, need):
        for r in range(t.replicas):
            converts = r == 0 or not convert_once
            out.conversions += converts
            for j in range(t.ranks):
                gpu = f"{t.label}.r{r}.{j}"
                gpus.append(gpu)
                held[gpu] = 0
                landed = float(d.landed[j])
                out.landed_per_gpu = max(out.landed_per_gpu, landed)
                if converts:
                    b = float(d.read_bytes(j))
                    out.source_bytes += b
                    out.read_per_gpu = max(out.read_per_gpu, b)
                    task = min(d.largest_task, inputs.task_bytes, b)
                    tail = task / max(inputs.nic_rate, conv_rate)  # a two-stage pipeline's last stage
                    sim.after(inputs.grant_latency, convert, gpu, b, tail)
                else:
                    out.peer_bytes += landed
                    sim.after(inputs.grant_latency, copy, gpu, f"{t.label}.r{r - 1}.{j}", landed)
    sim.run_until(lambda: len(finished) == len(gpus), 3600.0, "resharding")
    out.seconds = max(finished.values())
    for g in gpus:
        rep = g.rsplit(".", 1)[0]
        out.replica_done[rep] = max(out.replica_done.get(rep, 0.0), finished[g])
    out.events = sim.events
    out.digest = sim.digest
    return out


# ---- the scenario --------------------------------------------------------------------------------

_QWEN, _KIMI = MODELS["Qwen3-235B"], MODELS["Kimi-K2 1T"]

#: The rows: the write-up's two results, then the inputs varied one at a time. The write-up does
#: not give its engine's layout: "1x TP32" spreads one copy over the 32 GPUs (its ~5 GB/s per
#: GPU fits that), "4x TP8" is a replica per 8-GPU host. vLLM's block FP8 needs each rank's rows
#: in whole 128-blocks and the heads divisible by TP: Kimi-K2's dense first layer (width 18432)
#: and shared expert (2048) allow TP 16 (8 replicas on the 128 GPUs), not TP 32 or 64. The
#: write-up places the trainer's experts on their own mesh (8 groups of 32 here), and a 1T model
#: on 128 GPUs is served as one replica: data-parallel attention with the experts spread over all
#: 128 (3 per GPU), the last two rows.
CASES: tuple[ReshardCase, ...] = (
    ReshardCase("Qwen3-235B", _QWEN, 128, (Target(32),), 2.0),
    ReshardCase("Qwen3-235B", _QWEN, 128, (Target(8, 4),), 2.0),
    ReshardCase("Qwen3-235B, NIC at 72 %", _QWEN, 128, (Target(32),), 2.0, ReshardInputs(efficiency=0.72)),
    ReshardCase("Qwen3-235B, convert 10 GB/s", _QWEN, 128, (Target(32),), 2.0, ReshardInputs(convert_gbps=10.0)),
    ReshardCase("Qwen3-235B, no read-through", _QWEN, 128, (Target(32),), 2.0, ReshardInputs(max_gap=0)),
    ReshardCase("Kimi-K2 1T", _KIMI, 256, (Target(16, 8),), 1.3),
    ReshardCase("Kimi-K2 1T, trainer experts EP 8", _KIMI, 256, (Target(16, 8),), 1.3, source_ep=8),
    ReshardCase("Kimi-K2 1T, engine DP attention + EP 128", _KIMI, 256, (Target(1, 1, 128),), 1.3, source_ep=8),
    ReshardCase("Kimi-K2 1T, engine DP16 x TP8, EP 128", _KIMI, 256, (Target(8, 1, 16),), 1.3, source_ep=8),
)
#: ``--quick``: the write-up's two results only (Kimi-K2 with its trainer's experts on their own
#: mesh, as the write-up has them: a tenth of the reads of every expert FSDP-sharded over 256).
QUICK = (0, 6)


def reshard(seed: int, quick: bool = False, cases: tuple[ReshardCase, ...] | None = None) -> Result:
    """The write-up's shapes, converted once per target layout then copied peer to peer,
    against every replica converting, and against the write-up's published times."""
    if cases is None:
        cases = tuple(CASES[i] for i in QUICK) if quick else CASES
    res = Result(
        "reshard",
        "Resharding bf16 -> fp8 at the Perplexity write-up's shapes (convert once per layout, then peer to peer)",
        ["scenario", "params", "GPUs", "engine", "read GB/GPU", "trainers sent GB", "conversions", "TensorHub s", "each converts s", "published s", "ratio"],
        [],
        {"cases": []},
    )  # fmt: skip
    for case in cases:
        inputs = dataclasses.replace(case.inputs, chunks=32) if quick else case.inputs
        ours = simulate(case.model, case.source_gpus, case.targets, inputs, seed, source_ep=case.source_ep)
        each = simulate(case.model, case.source_gpus, case.targets, inputs, seed, convert_once=False, source_ep=case.source_ep)
        ratio = ours.seconds / case.published_s if case.published_s else math.nan
        res.rows.append(
            [
                case.label,
                f"{case.model.params / 1e9:.0f}B",
                f"{case.source_gpus} -> {sum(t.gpus for t in case.targets)}",
                " + ".join(map(str, case.targets)) + " fp8",
                ours.read_per_gpu / GB,
                f"{ours.source_bytes / GB:.0f} (each: {each.source_bytes / GB:.0f})",
                f"{ours.conversions} (of {ours.replicas})",
                ours.seconds,
                each.seconds,
                case.published_s if case.published_s is not None else math.nan,
                ratio,
            ]
        )
        res.data["cases"].append(_case_data(case, inputs, ours, each, ratio))
        for o in (ours, each):
            res.events += o.events
            res.digest = hashlib.sha256(f"{res.digest}{o.digest}".encode()).hexdigest()
    return res


def _case_data(
    case: ReshardCase, inputs: ReshardInputs, ours: ReshardOutcome, each: ReshardOutcome, ratio: float
) -> dict[str, Any]:
    return {
        "label": case.label,
        "model": case.model.name,
        "params": case.model.params,
        "source_gpus": case.source_gpus,
        "source_ep": case.source_ep,
        "targets": [dataclasses.asdict(t) for t in case.targets],
        "inputs": dataclasses.asdict(inputs),
        "published_s": case.published_s,
        "ratio": ratio,
        "tensorhub": dataclasses.asdict(ours),
        "each_converts": dataclasses.asdict(each),
    }
