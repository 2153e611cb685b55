"""Cross-datacenter replication with deltas (issue 21, item 6): full seeding against delta
seeding, version after version, for the paper's 1T case.

Theory of operation
-------------------
Trainers (one datacenter) publish a version per RL step; standalone rollouts (another
datacenter, reachable only over each host's TCP VPC NIC) move to it. Two worlds run on the same
seed, the same hardware and the same stragglers:

- **full**: today's TensorHub (the existing ``crossdc`` scenario's smart skipping, over several
  versions): the first rollout replica to ask seeds the datacenter by pulling every shard
  across; the others are told "not yet" until it holds the shards, then pull them from it
  inside the datacenter, pipelined.
- **deltas**: each trainer replica also publishes the delta ``v-1 -> v`` of its shards (as
  ``publish(v, deltas=True)`` would). Each rollout replica decides per version with the
  production rule :func:`tensorhub.core.deltas.plan_pull`: holding ``v-1``, it pulls the delta;
  holding nothing (a replica started late), it pulls the full shard. A delta is replicated like
  a shard, so its pull goes through the production table and its cross-datacenter policy too:
  the first replica to ask seeds the datacenter with the delta (the only bytes that cross), the
  others are told "not yet" and then pull the delta from it peer to peer, pipelined. A replica
  that holds the delta unpublishes ``v-1``, applies the delta in place (a timed step, below)
  and publishes ``v``; from then on it serves ``v`` in full to replicas that hold nothing.

How much is simulated and how much is stood in for:

- The table does not plan deltas yet (item 2 of the issue), so a delta is a second model in the
  production table (``model.delta``, its shards sized by the encoding rule), held by a second
  replica on the same GPUs as the rollout (and the trainer) it belongs to. Source selection,
  seeding, smart skipping and pipelining of the delta are therefore the table's own.
- One rule the table would need to know about deltas is stood in for here: a replica that must
  pull in full while a delta of ``v`` is being seeded in its datacenter and nobody there holds
  ``v`` yet is told "not yet" (one control round trip), as smart skipping tells a replica while
  a full seed runs; without it, it would seed the datacenter in full across the slow link.
- **Bytes** of a shard's delta are the encoding rule's (:func:`tensorhub.core.deltas.entry_bytes`
  with :func:`~tensorhub.core.deltas.encoding_for`): the shard is cut into tensors of
  ``tensor_numel`` elements (default one Kimi-K2 expert projection, 7168 x 2048), of which a
  fraction ``1 - unchanged`` changed (default 98.35 % unchanged bf16, what
  ``benchmarks/bench_delta.py`` measured at lr 1e-6); sparse costs ``4 + itemsize`` bytes per
  changed element, dense ``itemsize`` per element, whichever is fewer per tensor. ``ratio``
  overrides this with ``delta = ratio x full``.
- **Applying** costs ``touched / apply_gbps`` seconds on each GPU (every shard of a replica in
  parallel): a sparse tensor's delta is read once and each changed element costs one
  ``sector_bytes`` sector read and written back (an upper bound: each change in its own
  sector); a dense tensor is read and written once. Default 2,000 GB/s: 60 % of an H100's
  3.35 TB/s of HBM3, for a scatter. Verifying against ``v``'s checksums is not modelled, in
  either world (the simulator's full pulls do not verify either).

The stall of a rollout replica is the time it spends in calls until it holds ``v``: every
``update()`` answer (a "not yet" is a control round trip), and with deltas the unpublish, the
apply and the publish. Between "not yet" answers it polls every ``poll_s`` seconds, as in
``crossdc``. Bytes across are the table's count of bytes granted across datacenters (the same
figure the ``crossdc`` table prints); the network's own count of bytes received over the
rollout hosts' VPC NICs is kept beside it in the data.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass
from typing import Any

from tensorhub.core.deltas import (
    DELTAS,
    SPARSE,
    DeltaStep,
    PullPlan,
    encoding_for,
    entry_bytes,
    plan_pull,
)
from tensorhub.core.errors import InvalidArgument
from tensorhub.core.layout import DTYPE_SIZES
from tensorhub.core.table import TableConfig

from .actors import CallRecord, SimReplica, shard_layout
from .cluster import GB
from .scenarios import MODELS, ModelSpec, Result, World, _merge

__all__ = [
    "KIMI_K2_TENSOR_NUMEL",
    "MEASURED_UNCHANGED",
    "DeltaInputs",
    "DeltaSize",
    "apply_seconds",
    "crossdc_deltas",
    "shard_delta",
]

#: The fraction of bf16 elements unchanged per step that ``benchmarks/bench_delta.py`` measured
#: (a random-initialized decoder, Adam at lr 1e-6, float32 masters; issue 21).
MEASURED_UNCHANGED = 0.9835
#: One Kimi-K2 routed expert's projection (hidden 7168 x expert width 2048): the tensor size a
#: shard is cut into when the encoding rule is applied per tensor.
KIMI_K2_TENSOR_NUMEL = 7168 * 2048

DELTA_MODEL = "model.delta"
_MIN_CHUNK = 4096  # tensorhub.core.layout's smallest chunk


@dataclass(frozen=True)
class DeltaInputs:
    """What the deltas scenario is given (see the module docstring for where each comes from).

    Args:
        unchanged: the fraction of elements unchanged between consecutive versions.
        dtype: the published weights' dtype (a :data:`tensorhub.core.layout.DTYPE_SIZES` name).
        ratio: when set, a delta is ``ratio`` x the full shard (``unchanged`` is then unused
            for the bytes).
        tensor_numel: elements per tensor when the shard is cut into tensors.
        apply_gbps: memory bandwidth of applying a delta on a GPU (GB/s, bytes touched).
        sector_bytes: the memory sector a scattered write reads and writes back.
        versions: versions published (the first is pulled in full by everybody).
        join_at: the version at which one rollout replica starts, holding nothing (None: all
            start at the first).
        model: a row of the paper's Table 3 (``MODELS``).
        poll_s: a rollout's update() period while it is told "not yet".
    """

    unchanged: float = MEASURED_UNCHANGED
    dtype: str = "bfloat16"
    ratio: float | None = None
    tensor_numel: int = KIMI_K2_TENSOR_NUMEL
    apply_gbps: float = 2000.0
    sector_bytes: int = 32
    versions: int = 3
    join_at: int | None = 2
    model: str = "1T"
    poll_s: float = 1.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise InvalidArgument(f"unknown dtype {self.dtype!r} (known: {', '.join(DTYPE_SIZES)})")
        if not 0.0 <= self.unchanged <= 1.0:
            raise InvalidArgument(f"the unchanged fraction must be in [0, 1], got {self.unchanged!r}")
        if self.ratio is not None and not 0.0 <= self.ratio:
            raise InvalidArgument(f"a delta ratio must be >= 0, got {self.ratio!r}")
        if self.tensor_numel < 1 or self.sector_bytes < 1 or not self.apply_gbps > 0:
            raise InvalidArgument(
                f"tensor_numel, sector_bytes and apply_gbps must be > 0, got "
                f"{self.tensor_numel}, {self.sector_bytes}, {self.apply_gbps}"
            )
        if self.versions < 2:
            raise InvalidArgument(f"deltas need at least 2 versions, got {self.versions}")
        if self.join_at is not None and not 1 <= self.join_at <= self.versions:
            raise InvalidArgument(f"join_at must be a version in 1..{self.versions}, got {self.join_at}")
        if self.model not in MODELS:
            raise InvalidArgument(f"unknown model {self.model!r} (known: {', '.join(MODELS)})")
        if not self.poll_s > 0:
            raise InvalidArgument(f"poll_s must be > 0, got {self.poll_s!r}")

    def describe(self) -> str:
        if self.ratio is not None:
            return f"delta = {self.ratio:g} x full ({self.dtype})"
        return f"{self.unchanged * 100:.2f} % of {self.dtype} elements unchanged per version"


@dataclass(frozen=True)
class DeltaSize:
    """One shard's delta by the encoding rule.

    Attributes:
        full_bytes: the shard.
        nbytes: its delta (what a delta pull moves).
        changed: elements that changed.
        tensors: tensors the shard was cut into.
        sparse_tensors: of which encoded sparse.
        sparse_bytes: the delta's bytes in sparse entries (the rest is dense).
    """

    full_bytes: int
    nbytes: int
    changed: int
    tensors: int
    sparse_tensors: int
    sparse_bytes: int

    @property
    def ratio(self) -> float:
        return self.nbytes / self.full_bytes if self.full_bytes else math.nan


def shard_delta(full_bytes: int, inputs: DeltaInputs) -> DeltaSize:
    """The delta of one shard of ``full_bytes``: per tensor, the encoding rule's bytes (or
    ``ratio`` x full when ``inputs.ratio`` is set)."""
    itemsize = DTYPE_SIZES[inputs.dtype]
    numel = full_bytes // itemsize
    if inputs.ratio is not None:
        nbytes = round(full_bytes * inputs.ratio)
        sparse = inputs.ratio < itemsize / (4 + itemsize)
        changed = min(numel, nbytes // (4 + itemsize)) if sparse else numel
        return DeltaSize(full_bytes, nbytes, changed, 1, int(sparse), nbytes if sparse else 0)
    whole, rest = divmod(numel, inputs.tensor_numel)
    nbytes = changed = sparse_tensors = sparse_bytes = 0
    for n, count in ((inputs.tensor_numel, whole), (rest, 1 if rest else 0)):
        if not count:
            continue
        c = round(n * (1.0 - inputs.unchanged))
        enc = encoding_for(c, n, itemsize)
        b = entry_bytes(enc, c, n, itemsize)
        nbytes += count * b
        changed += count * c
        if enc == SPARSE:
            sparse_tensors += count
            sparse_bytes += count * b
    return DeltaSize(full_bytes, nbytes, changed, whole + (1 if rest else 0), sparse_tensors, sparse_bytes)


def apply_seconds(size: DeltaSize, inputs: DeltaInputs) -> float:
    """Seconds to apply one shard's delta in place on its GPU (see the module docstring)."""
    itemsize = DTYPE_SIZES[inputs.dtype]
    sparse_changed = size.sparse_bytes // (4 + itemsize)
    dense = size.nbytes - size.sparse_bytes
    touched = size.sparse_bytes + sparse_changed * 2 * inputs.sector_bytes + 2 * dense
    return touched / (inputs.apply_gbps * GB)


@dataclass
class _Version:
    """What one world measured for one version."""

    version: int
    remote_bytes: float  # the table's count of bytes granted across datacenters
    wire_bytes: float  # the network's: bytes received over the rollout hosts' VPC NICs
    stall: dict[str, float]  # rollout replica -> its stall
    plan: dict[str, str]  # rollout replica -> FULL or DELTAS (full world: FULL)
    seeder: str | None  # the replica that pulled across
    joiner: str | None  # the replica that started at this version, holding nothing
    seconds: float  # from publish until every rollout held the version


def crossdc_deltas(seed: int, quick: bool = False, inputs: DeltaInputs | None = None,
                   spec: ModelSpec | None = None) -> Result:  # fmt: skip
    """Full seeding against delta seeding, per version (see the module docstring).

    Args:
        seed: the run's one seed (both worlds are built on it).
        quick: two versions instead of ``inputs.versions``.
        inputs: the delta's size, the apply cost and the schedule.
        spec: the workload (default ``MODELS[inputs.model]``, the paper's Table 3 row).

    Returns:
        The per-version table: bytes across and stall, full against deltas, and their ratios.
    """
    inputs = inputs or DeltaInputs()
    if quick:
        inputs = DeltaInputs(**{**vars(inputs), "versions": 2, "join_at": inputs.join_at and min(inputs.join_at, 2)})
    spec = spec or MODELS[inputs.model]
    full_bytes = int(spec.shard_gb * GB)
    size = shard_delta(full_bytes, inputs)
    apply_s = apply_seconds(size, inputs)
    res = Result(
        "crossdc-deltas",
        f"cross-datacenter rollouts per version, full seeding against deltas ({spec.name}: "
        f"{spec.trainer_gpus} trainer + {spec.standalone_gpus} rollout GPUs)",
        ["v", "pulls (deltas)", "GB across full", "GB across deltas", "bytes full/deltas", "seeder s full",
         "seeder s deltas", "others s full", "others s deltas", "GPU·s full", "GPU·s deltas", "stall full/deltas"],
        [], {},
    )  # fmt: skip
    worlds = {}
    for mode in ("full", "deltas"):
        w, per_version = _run(seed, spec, size, apply_s, inputs, deltas=mode == "deltas")
        _merge(res, w)
        worlds[mode] = per_version
    full, delta = worlds["full"], worlds["deltas"]
    res.data.update(
        model=spec.name, shards=spec.shards, shard_bytes=full_bytes, delta_bytes=size.nbytes,
        delta_ratio=size.ratio, changed=size.changed, tensors=size.tensors, sparse_tensors=size.sparse_tensors,
        apply_s=apply_s, inputs=dict(vars(inputs)),
        versions={mode: [_as_json(x, spec.shards) for x in vs] for mode, vs in worlds.items()},
    )  # fmt: skip
    for f, d in zip(full, delta):
        ff, dd = _summary(f, spec.shards), _summary(d, spec.shards)
        pulls = ", ".join(f"{n} {k}" for k, n in sorted(_count(d.plan.values()).items()))
        res.rows.append([
            f.version, pulls, f.remote_bytes / GB, d.remote_bytes / GB, _ratio(f.remote_bytes, d.remote_bytes),
            ff["seeder_s"], dd["seeder_s"], ff["others_s"], dd["others_s"], ff["total_gpu_s"], dd["total_gpu_s"],
            _ratio(ff["total_gpu_s"], dd["total_gpu_s"]),
        ])  # fmt: skip
    later = [(f, d) for f, d in zip(full, delta) if f.version > 1]
    across_full = sum(f.remote_bytes for f, _ in later)
    across_deltas = sum(d.remote_bytes for _, d in later)
    stall_full = sum(_summary(f, spec.shards)["total_gpu_s"] for f, _ in later)
    stall_deltas = sum(_summary(d, spec.shards)["total_gpu_s"] for _, d in later)
    res.data["after_first"] = {
        "bytes_full": across_full, "bytes_deltas": across_deltas, "bytes_ratio": _ratio(across_full, across_deltas),
        "stall_full": stall_full, "stall_deltas": stall_deltas, "stall_ratio": _ratio(stall_full, stall_deltas),
    }  # fmt: skip
    encoding = (
        f"; {size.sparse_tensors} of {size.tensors} tensors sparse at {4 + DTYPE_SIZES[inputs.dtype]} B per "
        "changed element"
        if inputs.ratio is None
        else ""
    )
    res.notes += [
        (
            f"delta per {spec.shard_gb:g} GB shard: {size.nbytes / GB:.3f} GB, {_ratio(1.0, size.ratio):.1f}x smaller "
            f"({inputs.describe()}{encoding}); applied in place in {apply_s * 1e3:.1f} ms "
            f"per GPU at {inputs.apply_gbps:g} GB/s"
        ),
        (
            f"versions 2..{len(full)}: {across_full / GB:.1f} GB across in full against {across_deltas / GB:.2f} GB "
            f"with deltas ({_ratio(across_full, across_deltas):.1f}x fewer; issue 21's goal >= 20x), "
            f"{stall_full:.1f} against {stall_deltas:.1f} GPU·s of rollout stall "
            f"({_ratio(stall_full, stall_deltas):.1f}x less; goal >= 5x)"
        ),
        (
            "v1: every replica holds nothing, both worlds pull in full. 'others': the mean stall of the replicas "
            "that neither seeded the datacenter nor started late; a replica started late pulls in full in both "
            "(data: 'versions')"
        ),
    ]
    return res


def _count(xs: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.inf


def _summary(x: _Version, shards: int) -> dict[str, float]:
    others = [s for name, s in x.stall.items() if name not in (x.seeder, x.joiner)]
    return {
        "seeder_s": x.stall[x.seeder] if x.seeder is not None else math.nan,
        "others_s": statistics.fmean(others) if others else math.nan,
        "joiner_s": x.stall[x.joiner] if x.joiner is not None else math.nan,
        "max_s": max(x.stall.values()),
        "total_gpu_s": sum(x.stall.values()) * shards,
    }


def _as_json(x: _Version, shards: int) -> dict[str, Any]:
    return dict(vars(x), **_summary(x, shards))


def _run(seed: int, spec: ModelSpec, size: DeltaSize, apply_s: float, inputs: DeltaInputs,
         deltas: bool) -> tuple[World, list[_Version]]:  # fmt: skip
    """One world: trainers publish ``inputs.versions`` versions; the rollouts follow."""
    full_bytes = size.full_bytes
    w = World(seed, config=TableConfig())
    th = w.hosts("train", "t", math.ceil(spec.trainer_gpus / 8))
    rh = w.hosts("infer", "r", math.ceil(spec.standalone_gpus / 8))
    w.stragglers()
    trainers = w.replicas("trainer", th, spec.shards, full_bytes, spec.trainer_gpus // spec.shards, retain=0)
    rollouts = w.replicas("rollout", rh, spec.shards, full_bytes, spec.standalone_gpus // spec.shards)
    # the delta of each replica lives on that replica's GPUs, as a replica of the delta model
    delta_of: dict[str, SimReplica] = {}
    if deltas:
        # a layout's chunk is at least 4 KiB: a delta smaller than 128 chunks is pulled in fewer reads
        layout = shard_layout(max(size.nbytes, _MIN_CHUNK), max(1, min(128, size.nbytes // _MIN_CHUNK)))
        for r in trainers + rollouts:
            delta_of[r.name] = SimReplica(
                w.server, DELTA_MODEL, f"{r.name}.delta", [s.device for s in r.shards], layout
            )
    joiner = rollouts[-1] if inputs.join_at is not None and len(rollouts) > 1 else None
    started = [r for r in rollouts if r is not joiner]
    trainer_deltas = [delta_of[t.name] for t in trainers] if deltas else []
    w.open(trainers + trainer_deltas + started + [delta_of[r.name] for r in started if deltas])
    out: list[_Version] = []
    for v in range(1, inputs.versions + 1):
        if joiner is not None and v == inputs.join_at:
            w.open([joiner] + ([delta_of[joiner.name]] if deltas else []))
            started.append(joiner)
        if v > 1:
            held = trainers + (trainer_deltas if v > 2 else [])
            w.wait([t.unpublish() for t in held], 120.0, f"trainers unpublish v{v - 1}")
        w.publish(trainers, v)
        if deltas and v > 1:
            w.publish(trainer_deltas, v)
        remote0 = w.server.table.bytes_by_link["remote"]
        wire0 = _wire_bytes(w, rh)
        steps = [DeltaStep(v - 1, v, size.nbytes)] if deltas and v > 1 else []
        rnd = _Round(w, v, steps, full_bytes, delta_of, apply_s, inputs.poll_s)
        for r in started:
            rnd.poll(r)
        w.sim.run_until(
            functools.partial(rnd.all_hold, len(started)), 3600.0, f"v{v} ({'deltas' if deltas else 'full'})"
        )
        seconds = w.sim.now - rnd.t0
        w.sim.run(until=w.sim.now + 1.0)  # reports and drains land before the next version
        out.append(
            _Version(
                v,
                w.server.table.bytes_by_link["remote"] - remote0,
                _wire_bytes(w, rh) - wire0,
                rnd.stall,
                {name: p.kind for name, p in sorted(rnd.plans.items())},
                rnd.crossed[0] if rnd.crossed else None,
                joiner.name if joiner is not None and v == inputs.join_at else None,
                seconds,
            )
        )
    return w, out


class _Round:
    """The rollouts' calls for one version, until each holds it (see the module docstring)."""

    def __init__(self, w: World, v: int, steps: list[DeltaStep], full_bytes: int,
                 delta_of: dict[str, SimReplica], apply_s: float, poll_s: float) -> None:  # fmt: skip
        self.w = w
        self.sim = w.sim
        self.v = v
        self.steps = steps
        self.full_bytes = full_bytes
        self.delta_of = delta_of
        self.apply_s = apply_s
        self.poll_s = poll_s
        params = w.cluster.params
        self.rtt = 2 * params.control_latency + params.server_service  # a "not yet" answer
        self.t0 = w.sim.now
        self.stall: dict[str, float] = {}
        self.plans: dict[str, PullPlan] = {}
        self.holds: set[str] = set()  # replicas that hold v
        self.crossed: list[str] = []  # replicas whose pull of v (or of its delta) came across

    def all_hold(self, n: int) -> bool:
        return len(self.holds) == n

    def poll(self, r: SimReplica) -> None:
        """``r`` asks for ``v``: the production rule says delta or full."""
        self.stall.setdefault(r.name, 0.0)
        plan = plan_pull(r.version, self.v, self.steps, self.full_bytes)
        self.plans.setdefault(r.name, plan)
        if plan.kind == DELTAS:
            self._pull_delta(r)
            return
        if not self.holds and any(p.kind == DELTAS for p in self.plans.values()):
            # stand-in for the table: a delta of v seeds this datacenter and nobody here holds v
            self.stall[r.name] += self.rtt
            self.sim.after(self.rtt + self.poll_s, self.poll, r)
            return

        def answered(rec: CallRecord, _: list) -> None:
            self.stall[r.name] += rec.stall
            if rec.error is not None:
                self.w.server.violation(f"{r.name}: update to v{self.v} failed: {rec.error}")
            elif r.version == self.v:
                if _crossed(r):
                    self.crossed.append(r.name)
                self.holds.add(r.name)
            else:
                self.sim.after(self.poll_s, self.poll, r)

        r.update(then=answered)

    def _pull_delta(self, r: SimReplica) -> None:
        """``r`` holds ``v - 1``: its delta replica moves to the delta of ``v`` (the table seeds
        and pipelines it), then ``r`` unpublishes ``v - 1``, applies the delta and publishes ``v``."""
        d, v = self.delta_of[r.name], self.v

        def answered(rec: CallRecord, _: list) -> None:
            self.stall[r.name] += rec.stall
            if rec.error is not None:
                self.w.server.violation(f"{d.name}: update to the delta of v{v} failed: {rec.error}")
                return
            if d.version != v:
                self.sim.after(self.poll_s, self._pull_delta, r)
                return
            if _crossed(d):
                self.crossed.append(r.name)
            start = self.sim.now

            def unpublished(rec: CallRecord, _: list) -> None:
                if rec.error is not None:
                    self.w.server.violation(f"{r.name}: unpublish of v{v - 1} failed: {rec.error}")
                    return
                self.sim.record("apply", f"{r.name} v{v - 1}->v{v}")
                self.sim.after(self.apply_s, r.publish, v, published)

            def published(rec: CallRecord, _: list) -> None:
                if rec.error is not None:
                    self.w.server.violation(f"{r.name}: publish of v{v} failed: {rec.error}")
                    return
                self.stall[r.name] += self.sim.now - start
                self.holds.add(r.name)

            r.unpublish(then=unpublished)

        d.update(then=answered)


def _crossed(r: SimReplica) -> bool:
    """Whether ``r``'s last pull came from across the datacenters (it seeded its datacenter)."""
    dc = r.shards[0].device.datacenter
    for s in r.shards:
        g = s.grant
        if g is None:
            continue
        src = s.server.by_session.get(g.source.session)
        if src is not None and src.device.datacenter != dc:
            return True
    return False


def _wire_bytes(w: World, hosts: list[str]) -> float:
    """Bytes received so far over these hosts' VPC NICs (by flows that ended)."""
    return sum(link.bytes for h in hosts if (link := w.net.links.get(f"vpc:{h}:rx")) is not None)
