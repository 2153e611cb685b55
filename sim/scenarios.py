"""The paper's experiments (and a churn test), each a function of a seed.

Every scenario builds fresh worlds (one per system compared) on the same seed, so every system
sees the same hardware and the same stragglers, runs them, and returns a :class:`Result`: a table
to print, the data behind it (JSON), and its **headlines**: the numbers the paper reports, next
to the simulated ones. A headline is an *input* when the simulator's parameters were taken from
it (it checks that the model reproduces its own calibration) and a *prediction* otherwise.

The parameters of the workloads are the paper's (§5, Table 3): 8 GPUs per host, 25 GB/s RDMA per
shard, 200 Gbps TCP per host between datacenters, the models' shard counts and sizes and their
trainer and rollout GPU counts.

Size: a catalogue of independent scenarios (one function each, the paper's workloads and their
headlines), not one mechanism: it grows by adding scenarios.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tensorhub.core.errors import InvalidArgument
from tensorhub.core.table import TableConfig

from .actors import CallRecord, SimReplica, SimServer, shard_layout
from .baselines import (
    NCCL,
    RAY,
    STRAGGLER_SIGMA,
    TENSORHUB,
    UCX,
    SystemParams,
    nccl_stage,
)
from .cluster import GB, Cluster, Device, NetParams
from .core import SimStuck, Simulator
from .network import Network

__all__ = ["MODELS", "SCENARIOS", "Headline", "Result", "World", "run"]


@dataclass(frozen=True)
class ModelSpec:
    """A row of the paper's Table 3."""

    name: str
    shards: int
    shard_gb: float
    trainer_gpus: int
    standalone_gpus: int


MODELS = {
    "9B": ModelSpec("9B", 2, 10, 16, 8),
    "36B": ModelSpec("36B", 4, 19, 16, 8),
    "260B": ModelSpec("260B", 8, 34, 64, 16),
    "1T": ModelSpec("1T", 16, 66, 768, 256),
}

RDMA_LINE = 25 * GB  # bytes/s per shard: the paper's "RDMA ideal"


@dataclass
class Headline:
    """One number of the paper against the simulator's."""

    figure: str
    what: str
    paper: float
    sim: float
    unit: str
    role: str = "prediction"  # or "input": a parameter was set from this number

    @property
    def ratio(self) -> float:
        return self.sim / self.paper if self.paper else math.nan

    @property
    def off(self) -> bool:
        return not (0.8 <= self.ratio <= 1.2)


@dataclass
class Result:
    name: str
    title: str
    columns: list[str]
    rows: list[list[Any]]
    data: dict[str, Any]
    headlines: list[Headline] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    digest: str = ""
    events: int = 0
    checks: int = 0
    notes: list[str] = field(default_factory=list)  # printed under the table


class World:
    """One simulated deployment: clock, network, hardware, and (for TensorHub) the server.

    Args:
        seed: the run's seed.
        system: whose data plane the links carry (its efficiency).
        config: the reference table's configuration (TensorHub).
        check_every: invariant checks (see :class:`~tensorhub.sim.actors.SimServer`).
        params: the hardware.
    """

    def __init__(
        self,
        seed: int,
        system: SystemParams = TENSORHUB,
        config: TableConfig | None = None,
        check_every: int = 1000,
        params: NetParams | None = None,
        trace: bool = False,
    ) -> None:
        self.sim = Simulator(seed, trace)
        self.net = Network(self.sim)
        self.cluster = Cluster(self.net, params or NetParams(), system.efficiency)
        self.system = system
        self.server = SimServer(self.sim, self.cluster, config, check_every)

    def hosts(self, datacenter: str, prefix: str, count: int) -> list[str]:
        return self.cluster.add_hosts(datacenter, prefix, count)

    def stragglers(self) -> None:
        """Draw every NIC's speed factor (call once, after adding every host)."""
        hosts = sorted(self.cluster.hosts)
        self.cluster.draw_stragglers(
            self.sim.child_rng(), STRAGGLER_SIGMA, self.cluster.gpus(hosts)
        )

    def replicas(
        self,
        prefix: str,
        hosts: list[str],
        shards: int,
        nbytes: float,
        count: int | None = None,
        reads: int = 128,
        **kw: Any,
    ) -> list[SimReplica]:
        """Split the GPUs of ``hosts`` into replicas of ``shards`` GPUs (``count`` of them),
        each shard pulled in ``reads`` reads."""
        gpus = self.cluster.gpus(hosts)
        n = len(gpus) // shards if count is None else count
        if n * shards > len(gpus):
            raise InvalidArgument(
                f"{n} replicas of {shards} shards need {n * shards} GPUs; {len(hosts)} hosts have {len(gpus)}"
            )
        layout = shard_layout(int(nbytes), reads)
        return [
            SimReplica(
                self.server,
                "model",
                f"{prefix}{r}",
                gpus[r * shards : (r + 1) * shards],
                layout,
                **kw,
            )
            for r in range(n)
        ]

    def open(self, replicas: list[SimReplica]) -> None:
        for r in replicas:
            r.open()
        self.sim.run_until(
            lambda: all(r.opened for r in replicas), 60.0, "opening replicas"
        )

    def wait(self, records: list[CallRecord], limit: float, what: str) -> None:
        self.sim.run_until(lambda: all(r.end is not None for r in records), limit, what)
        bad = [r for r in records if r.error is not None]
        if bad:
            raise SimStuck(
                f"{what}: {bad[0].replica}'s {bad[0].kind} failed: {bad[0].error} (seed {self.sim.seed})"
            )

    def publish(self, trainers: list[SimReplica], version: int) -> list[CallRecord]:
        recs = [t.publish(version) for t in trainers]
        self.wait(recs, 10.0, f"publishing v{version}")
        return recs

    def flows(
        self,
        pairs: list[tuple[Device, Device]],
        nbytes: float,
        then: Callable[[int, float], None] | None = None,
    ) -> list[float]:
        """Start one read of ``nbytes`` per (source, reader) pair now; return their end times
        once all are done (the simulator runs until then)."""
        ends = [math.nan] * len(pairs)

        def done(i: int) -> None:
            ends[i] = self.sim.now
            if then is not None:
                then(i, self.sim.now)

        for i, (src, dst) in enumerate(pairs):
            links, cap, latency = self.cluster.path(src, dst)
            self.sim.after(
                latency,
                lambda links=links, cap=cap, i=i: self.net.start(
                    links, nbytes, lambda: done(i), cap
                ),
            )
        self.sim.run_until(
            lambda: not any(math.isnan(e) for e in ends), 3600.0, "baseline flows"
        )
        return ends


def _merge(into: Result, world: World) -> None:
    into.violations += world.server.violations
    into.events += world.sim.events
    into.checks += world.server.checks
    into.digest = _combine(into.digest, world.sim.digest)


def _combine(a: str, b: str) -> str:
    import hashlib

    return hashlib.sha256(f"{a}{b}".encode()).hexdigest()


def _stall_per_gpu(records: list[CallRecord]) -> list[float]:
    return [r.stall for r in records for _ in range(r.shards)]


# ---- Fig. 7a: bandwidth --------------------------------------------------------------------


def bandwidth(seed: int, quick: bool = False) -> Result:
    """One trainer host sends to one rollout host, 8 shards; shard size varies (50 MB tensors)."""
    sizes = [1, 5, 10, 20, 35, 50] if not quick else [1, 10, 50]
    res = Result("bandwidth", "Fig. 7a: transfer time of one shard (8 shards, host to host)",
                 ["GB/shard", "TensorHub s", "NCCL s", "UCX s", "Ray s", "ideal s", "TensorHub GB/s"], [], {"sizes_gb": sizes})  # fmt: skip
    series: dict[str, list[float]] = {"TensorHub": [], "NCCL": [], "UCX": [], "ideal": []}
    ray_series: list[float | None] = []  # None: Ray crashed at that size
    for gb in sizes:
        w = World(seed)
        th, rh = w.hosts("dc0", "t", 1), w.hosts("dc0", "r", 1)
        w.stragglers()
        trainer = w.replicas("trainer", th, 8, gb * GB)
        reader = w.replicas("rollout", rh, 8, gb * GB)
        w.open(trainer + reader)
        w.publish(trainer, 1)
        rec = reader[0].update()
        w.wait([rec], 600.0, "bandwidth pull")
        _merge(res, w)
        series["TensorHub"].append(rec.stall)
        for system in (NCCL, UCX):
            b = World(seed, system)
            bt, br = b.hosts("dc0", "t", 1), b.hosts("dc0", "r", 1)
            b.stragglers()
            src, dst = b.cluster.gpus(bt), b.cluster.gpus(br)
            ends = b.flows(list(zip(src, dst)), gb * GB)
            series[system.name].append(max(ends))
            _merge(res, b)
        ray_series.append(RAY.time(gb * GB))
        series["ideal"].append(gb * GB / RDMA_LINE)
    for i, gb in enumerate(sizes):
        ray = ray_series[i]
        res.rows.append([gb, series["TensorHub"][i], series["NCCL"][i], series["UCX"][i], "crash" if ray is None else ray,
                         series["ideal"][i], gb / series["TensorHub"][i]])  # fmt: skip
    res.data["series"] = {"TensorHub": series["TensorHub"], "NCCL": series["NCCL"], "UCX": series["UCX"],
                          "Ray": ray_series, "ideal": series["ideal"]}  # fmt: skip
    last = len(sizes) - 1
    res.headlines += [
        Headline(
            "7a",
            "TensorHub: 50 GB per shard (s)",
            2.2,
            series["TensorHub"][last],
            "s",
            "input",
        ),
        Headline(
            "7a",
            "NCCL throughput at 50 GB (GB/s)",
            18.8,
            50 / series["NCCL"][last],
            "GB/s",
            "input",
        ),
        Headline(
            "7a",
            "UCX throughput at 50 GB (GB/s)",
            18.1,
            50 / series["UCX"][last],
            "GB/s",
            "input",
        ),
    ]
    ray_ok = [(gb, t) for gb, t in zip(sizes, ray_series) if t is not None]
    if ray_ok:
        gb, t = ray_ok[-1]
        res.headlines.append(Headline("7a", f"Ray / TensorHub time at {gb} GB (two orders of magnitude)", 100.0,
                                      t / series["TensorHub"][sizes.index(gb)], "x"))  # fmt: skip
    return res


# ---- Fig. 7b: bursts -------------------------------------------------------------------------


def bursts(seed: int, quick: bool = False) -> Result:
    """1 trainer host, N rollout hosts requesting at once, 50 GB per shard; total GPU stall with
    and without pipeline replication."""
    counts = [1, 2, 4, 6, 8] if not quick else [1, 2, 4]
    gb = 50.0
    res = Result("bursts", "Fig. 7b: total GPU stall of N rollout groups requesting at once (50 GB/shard)",
                 ["groups", "pipelined GPU·s", "no pipelining GPU·s", "ideal GPU·s", "pipelined s/GPU (max)"], [], {"groups": counts})  # fmt: skip
    totals: dict[str, list[float]] = {"pipelined": [], "no_pipelining": [], "ideal": []}
    worst = []
    for n in counts:
        for key, pipeline in (("pipelined", True), ("no_pipelining", False)):
            w = World(seed, config=TableConfig(pipeline=pipeline))
            th, rh = w.hosts("dc0", "t", 1), w.hosts("dc0", "r", n)
            w.stragglers()
            trainer = w.replicas("trainer", th, 8, gb * GB)
            readers = w.replicas("rollout", rh, 8, gb * GB)
            w.open(trainer + readers)
            w.publish(trainer, 1)
            recs = [r.update() for r in readers]
            w.wait(recs, 3600.0, f"burst of {n}")
            _merge(res, w)
            stalls = _stall_per_gpu(recs)
            totals[key].append(sum(stalls))
            if pipeline:
                worst.append(max(stalls))
        totals["ideal"].append(n * 8 * gb * GB / RDMA_LINE)
    for i, n in enumerate(counts):
        res.rows.append(
            [
                n,
                totals["pipelined"][i],
                totals["no_pipelining"][i],
                totals["ideal"][i],
                worst[i],
            ]
        )
    res.data["total_stall"] = totals
    slope = {k: _loglog_slope(counts, v) for k, v in totals.items() if k != "ideal"}
    res.data["growth_exponent"] = slope
    res.headlines += [
        Headline(
            "7b",
            f"pipelined: slowest GPU with {counts[-1]} groups (s)",
            2.2,
            worst[-1],
            "s",
        ),
        Headline(
            "7b",
            "pipelined: growth exponent of total stall (linear = 1)",
            1.0,
            slope["pipelined"],
            "",
        ),
        Headline(
            "7b",
            "no pipelining: growth exponent of total stall (quadratic = 2)",
            2.0,
            slope["no_pipelining"],
            "",
        ),
    ]
    return res


def _loglog_slope(xs: list[int], ys: list[float]) -> float:
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum(
        (a - mx) ** 2 for a in lx
    )


# ---- Fig. 7c: failure during a transfer ------------------------------------------------------


def failure(seed: int, quick: bool = False) -> Result:
    """trainer -> rollout A -> rollout B, pipelined, 50 GB/shard; A is killed at time t."""
    times = [0.1, 0.5, 1.0, 1.5, 2.0, 2.5] if not quick else [0.5, 2.5]
    gb = 50.0
    res = Result("failure", "Fig. 7c: rollout B's transfer time when A (its source) fails at t",
                 ["A fails at s", "B done at s", "B re-granted", "B's sources"], [], {"fail_at": times})  # fmt: skip
    done_at: list[float] = []
    base: float | None = None
    for t in [None] + times:
        w = World(seed, config=TableConfig(heartbeat_timeout=10.0))
        th, ah, bh = (
            w.hosts("dc0", "t", 1),
            w.hosts("dc0", "a", 1),
            w.hosts("dc0", "b", 1),
        )
        w.stragglers()
        trainer = w.replicas("trainer", th, 8, gb * GB)
        a = w.replicas("A", ah, 8, gb * GB)[0]
        b = w.replicas("B", bh, 8, gb * GB)[0]
        w.open(trainer + [a, b])
        w.publish(trainer, 1)
        a.update()
        w.sim.run(
            until=w.sim.now + 0.002
        )  # A asks first: it is granted the trainer, B is granted A
        rb = b.update()
        start = rb.start
        if t is not None:
            w.sim.at(start + t, a.crash)
        w.wait([rb], 600.0, f"B after A fails at {t}")
        _merge(res, w)
        sources = sorted(
            {s.grant.source.replica for s in b.shards if s.grant is not None}
        )
        took = rb.stall  # w.wait returned: it ended
        if t is None:
            base = took
            res.data["no_failure"] = took
            continue
        assert base is not None  # the first run, without a failure, set it
        done_at.append(took)
        res.rows.append([t, took, took > base + 0.5, ",".join(sources)])
    res.data["b_done_at"] = done_at
    assert base is not None  # the first run, without a failure, set it
    late = [d for t, d in zip(times, done_at) if t >= base]
    early = [(t, d) for t, d in zip(times, done_at) if t < base]
    if early:
        t, d = early[0]
        # B resumes after the transport's timeout, from its progress: detection delay = d - t - rest
        res.headlines.append(Headline("7c", f"B's delay when A fails at {t} s (paper: a ~4 s timeout, then resume) (s)",
                                      4.0, d - base, "s"))  # fmt: skip
    if late:
        res.headlines.append(
            Headline(
                "7c",
                "B's time when A fails after B is done (unaffected) (s)",
                2.2,
                late[-1],
                "s",
            )
        )
    return res


# ---- Fig. 9: standalone rollouts -------------------------------------------------------------


def standalone(
    seed: int, quick: bool = False, models: list[str] | None = None
) -> Result:
    """Trainers publish; standalone rollouts pull at once. TensorHub against NCCL (a global
    barrier stage) and UCX (point-to-point from trainers), per model of Table 3."""
    names = models or (["9B", "36B", "260B", "1T"] if not quick else ["9B", "260B"])
    res = Result("standalone", "Fig. 9: total GPU stall per step, standalone rollouts",
                 ["model", "GPUs", "NCCL GPU·s", "UCX GPU·s", "TensorHub GPU·s", "NCCL s", "UCX s", "TensorHub mean s",
                  "TensorHub max s", "ideal s", "NCCL / TensorHub"], [], {})  # fmt: skip
    for name in names:
        spec = MODELS[name]
        nbytes = spec.shard_gb * GB
        gpus = spec.trainer_gpus + spec.standalone_gpus
        # TensorHub
        w = World(seed)
        th = w.hosts("dc0", "t", math.ceil(spec.trainer_gpus / 8))
        rh = w.hosts("dc0", "r", math.ceil(spec.standalone_gpus / 8))
        w.stragglers()
        trainers = w.replicas(
            "trainer",
            th,
            spec.shards,
            nbytes,
            spec.trainer_gpus // spec.shards,
            retain=0,
        )
        rollouts = w.replicas(
            "rollout", rh, spec.shards, nbytes, spec.standalone_gpus // spec.shards
        )
        w.open(trainers + rollouts)
        pubs = w.publish(trainers, 1)
        recs = [r.update() for r in rollouts]
        w.wait(recs, 600.0, f"{name} standalone")
        _merge(res, w)
        stalls = _stall_per_gpu(recs)
        th_total = sum(stalls) + sum(_stall_per_gpu(pubs))
        # NCCL: a stage for every GPU
        nc = World(seed, NCCL)
        nt, nr = nc.hosts("dc0", "t", len(th)), nc.hosts("dc0", "r", len(rh))
        nc.stragglers()
        tg, rg = nc.cluster.gpus(nt), nc.cluster.gpus(nr)
        roots = [
            tg[r * spec.shards : (r + 1) * spec.shards]
            for r in range(spec.trainer_gpus // spec.shards)
        ]
        readers = [
            rg[r * spec.shards : (r + 1) * spec.shards]
            for r in range(spec.standalone_gpus // spec.shards)
        ]
        nccl_s = nccl_stage(nc.cluster, roots, readers, nbytes, gpus)
        # UCX: each rollout replica pulls from one trainer replica; the stage ends with the slowest
        uc = World(seed, UCX)
        ut, ur = uc.hosts("dc0", "t", len(th)), uc.hosts("dc0", "r", len(rh))
        uc.stragglers()
        tg, rg = uc.cluster.gpus(ut), uc.cluster.gpus(ur)
        ntr = spec.trainer_gpus // spec.shards
        pairs = [
            (tg[(r % ntr) * spec.shards + i], rg[r * spec.shards + i])
            for r in range(len(readers))
            for i in range(spec.shards)
        ]
        ucx_s = UCX.stage_overhead(gpus) + max(uc.flows(pairs, nbytes))
        _merge(res, uc)
        ideal = nbytes / RDMA_LINE
        row = {
            "gpus": gpus, "nccl_total": nccl_s * gpus, "ucx_total": ucx_s * gpus, "tensorhub_total": th_total,
            "nccl_s": nccl_s, "ucx_s": ucx_s, "tensorhub_mean": statistics.fmean(stalls), "tensorhub_max": max(stalls),
            "ideal": ideal,
        }  # fmt: skip
        res.data[name] = row
        res.rows.append([name, gpus, row["nccl_total"], row["ucx_total"], th_total, nccl_s, ucx_s, row["tensorhub_mean"],
                         row["tensorhub_max"], ideal, row["nccl_total"] / th_total])  # fmt: skip
        if name == "1T":
            res.headlines += [
                Headline("9", "1T: NCCL stall per GPU (s)", 5.3, nccl_s, "s"),
                Headline("9", "1T: UCX stall per GPU (s)", 4.0, ucx_s, "s"),
                Headline(
                    "9",
                    "1T: TensorHub mean standalone stall (s)",
                    3.1,
                    row["tensorhub_mean"],
                    "s",
                ),
                Headline("9", "1T: RDMA ideal (s)", 2.6, ideal, "s", "input"),
                Headline(
                    "9",
                    "1T: total GPU stall, NCCL / TensorHub (x)",
                    6.7,
                    row["nccl_total"] / th_total,
                    "x",
                ),
            ]
    return res


# ---- Fig. 11: elastic rollouts on spot instances ---------------------------------------------


ELASTIC_SCHEDULE = [
    0,
    1,
    1,
    2,
    2,
    3,
    3,
    2,
    3,
    3,
    1,
    1,
]  # elastic replicas per step (steps 1..12)


def elastic(seed: int, quick: bool = False) -> Result:
    """260B: 1 standalone replica (8 GPUs) and 0-3 elastic spot replicas (8 GPUs each) over
    training steps; scale-down kills random elastic replicas at a random moment of the step."""
    spec = MODELS["260B"]
    nbytes = spec.shard_gb * GB
    schedule = ELASTIC_SCHEDULE if not quick else [0, 1, 3, 2]
    step_s = 20.0
    res = Result("elastic", "Fig. 11: stall per step with elastic spot rollouts (260B)",
                 ["step", "elastic", "TensorHub GPU·s", "UCX GPU·s", "TensorHub max s", "UCX max s"], [], {"schedule": schedule})  # fmt: skip
    w = World(seed)
    th = w.hosts("dc0", "t", spec.trainer_gpus // 8)
    sh = w.hosts("dc0", "s", 1)
    eh = w.hosts("dc0", "e", 3)
    w.stragglers()
    rng = w.sim.child_rng()
    trainers = w.replicas("trainer", th, spec.shards, nbytes, retain=0)
    standalone = w.replicas("standalone", sh, spec.shards, nbytes)[0]
    w.open(trainers + [standalone])
    elastic_up: dict[int, SimReplica] = {}  # elastic host slot -> replica
    born = 0
    th_steps: list[list[float]] = []
    for step, want in enumerate(schedule, start=1):
        t0 = w.sim.now
        # scale up: new spot replicas on free elastic hosts; scale down: kill random ones mid-step
        free = [i for i in range(3) if i not in elastic_up]
        new = []
        while len(elastic_up) < want and free:
            slot = free.pop(0)
            born += 1
            rep = SimReplica(
                w.server,
                "model",
                f"elastic{born}",
                w.cluster.gpus([eh[slot]]),
                standalone.layout,
                spot=True,
            )
            elastic_up[slot] = rep
            new.append(rep)
        if new:
            w.open(new)
        kill = []
        if len(elastic_up) > want:
            kill = rng.sample(sorted(elastic_up), len(elastic_up) - want)
        if step > 1:
            recs = [t.unpublish() for t in trainers]
            w.wait(recs, 60.0, "trainers unpublish")
        w.publish(trainers, step)
        readers = [standalone] + [elastic_up[i] for i in sorted(elastic_up)]
        recs = [r.update() for r in readers]
        for slot in kill:  # killed during the transfer, at a random moment
            w.sim.after(rng.uniform(0.0, 1.5), elastic_up[slot].crash)
        # run_until asks the predicate only before it returns: this step's recs and readers
        w.sim.run_until(lambda: all(r.end is not None for r, rep in zip(recs, readers) if rep.alive),
                        600.0, f"step {step}")  # fmt: skip
        for slot in kill:
            del elastic_up[slot]
        live = [r for r, rep in zip(recs, readers) if rep.alive]
        bad = [r for r in live if r.error is not None]
        if bad:
            raise SimStuck(
                f"elastic step {step}: {bad[0].replica} failed: {bad[0].error} (seed {seed})"
            )
        th_steps.append(_stall_per_gpu(live))
        w.sim.run(until=t0 + step_s)
    _merge(res, w)
    # UCX: the standalone pulls from a trainer, then every elastic pulls from the standalone
    ucx_steps: list[list[float]] = []
    u = World(seed, UCX)
    ut, us, ue = (
        u.hosts("dc0", "t", spec.trainer_gpus // 8),
        u.hosts("dc0", "s", 1),
        u.hosts("dc0", "e", 3),
    )
    u.stragglers()
    tg, sg, eg = u.cluster.gpus(ut), u.cluster.gpus(us), u.cluster.gpus(ue)
    for n_el in [min(n, 3) for n in schedule]:
        over = UCX.stage_overhead(
            spec.standalone_gpus // 2 * (1 + n_el) + spec.trainer_gpus
        )
        start = u.sim.now
        t_s = max(u.flows(list(zip(tg[:8], sg)), nbytes)) - start
        stalls = [over + t_s] * 8
        if n_el:
            start = u.sim.now
            ends = u.flows(
                [(sg[i], eg[e * 8 + i]) for e in range(n_el) for i in range(8)], nbytes
            )
            stalls += [over + t_s + (e - start) for e in ends]
        ucx_steps.append(stalls)
    _merge(res, u)
    for i, want in enumerate(schedule):
        res.rows.append(
            [
                i + 1,
                want,
                sum(th_steps[i]),
                sum(ucx_steps[i]),
                max(th_steps[i]),
                max(ucx_steps[i]),
            ]
        )
    res.data["tensorhub_stall_per_gpu"] = th_steps
    res.data["ucx_stall_per_gpu"] = ucx_steps
    at = 9 if len(schedule) >= 10 else len(schedule) - 1
    while schedule[at] < 3 and at > 0:
        at -= 1
    res.data["cdf_step"] = at + 1
    flat = [max(s) for s in th_steps]
    res.headlines += [
        Headline("11", "TensorHub stall per GPU, worst step (s)", 1.5, max(flat), "s"),
        Headline(
            "11",
            f"UCX slowest GPU at step {at + 1} with 3 elastic (s)",
            7.2,
            max(ucx_steps[at]),
            "s",
        ),
    ]
    return res


# ---- Fig. 12: cross-datacenter ---------------------------------------------------------------


def crossdc(seed: int, quick: bool = False) -> Result:
    """9B: trainers (16 GPUs) in one datacenter, standalone rollouts (8 GPUs, 4 replicas) in
    another, reachable only over each host's 200 Gbps VPC NIC. Rollouts call update() when the
    version is published and then once per rollout step until they move."""
    spec = MODELS["9B"]
    nbytes = spec.shard_gb * GB
    poll_s = 1.0
    res = Result("crossdc", "Fig. 12: cross-datacenter rollouts (9B)",
                 ["system", "seeder s", "others s (mean)", "max s", "total GPU·s", "cross-DC GB"], [], {})  # fmt: skip
    modes = [("TensorHub, no skipping", TableConfig(smart_skipping=False), False),
             ("TensorHub, smart skipping", TableConfig(), False),
             ("TensorHub, offload seeding", TableConfig(), True)]  # fmt: skip
    for label, config, offload in modes:
        w, stall, first = _crossdc_tensorhub(seed, spec, config, offload, poll_s, label)
        _merge(res, w)
        remote = w.server.table.bytes_by_link["remote"] / GB
        others = [v for k, v in stall.items() if k != first]
        per_gpu = [v for v in stall.values() for _ in range(spec.shards)]
        res.data[label] = {"stall": stall, "seeder": first, "remote_gb": remote}
        res.rows.append(
            [
                label,
                stall[first],
                statistics.fmean(others),
                max(stall.values()),
                sum(per_gpu),
                remote,
            ]
        )
        if label.endswith("smart skipping"):
            res.headlines += [
                Headline(
                    "12",
                    "TensorHub seeding replica's stall (s)",
                    2.5,
                    stall[first],
                    "s",
                    "input",
                ),
                Headline(
                    "12",
                    "TensorHub other replicas' stall (s)",
                    0.45,
                    statistics.fmean(others),
                    "s",
                ),
            ]
        if offload:
            res.data["offload_max_stall"] = max(stall.values())
    # UCX over TCP: every rollout GPU pulls from a trainer across the datacenters
    u = World(seed, UCX)
    ut, ur = u.hosts("train", "t", 2), u.hosts("infer", "r", 1)
    u.stragglers()
    tg, rg = u.cluster.gpus(ut), u.cluster.gpus(ur)
    start = u.sim.now
    ends = u.flows([(tg[i], rg[i]) for i in range(len(rg))], nbytes)
    over = UCX.stage_overhead(len(tg) + len(rg))
    ucx = [over + e - start for e in ends]
    _merge(res, u)
    res.rows.append(
        [
            "UCX (TCP)",
            max(ucx),
            statistics.fmean(ucx),
            max(ucx),
            sum(ucx),
            len(rg) * nbytes / GB,
        ]
    )
    res.data["UCX"] = {"stall_per_gpu": ucx}
    res.headlines.insert(
        0,
        Headline(
            "12",
            "UCX stall per GPU over TCP (s)",
            7.8,
            statistics.fmean(ucx),
            "s",
            "input",
        ),
    )
    return res


def _crossdc_tensorhub(
    seed: int,
    spec: ModelSpec,
    config: TableConfig,
    offload: bool,
    poll_s: float,
    label: str,
) -> tuple[World, dict[str, float], str]:
    """One TensorHub run of the cross-datacenter scenario: each rollout replica's total stall
    (every update() call until it holds the version), and which replica seeded."""
    nbytes = spec.shard_gb * GB
    w = World(seed, config=config)
    th, rh = w.hosts("train", "t", 2), w.hosts("infer", "r", 1)
    w.stragglers()
    trainers = w.replicas("trainer", th, spec.shards, nbytes, retain=0)
    rollouts = w.replicas("rollout", rh, spec.shards, nbytes, offload_seeding=offload)
    w.open(trainers + rollouts)
    w.publish(trainers, 1)
    stall = {r.name: 0.0 for r in rollouts}
    seeder: list[str] = []
    done: set[str] = set()

    def poll(r: SimReplica) -> None:
        def answered(rec: CallRecord, _: list) -> None:
            stall[r.name] += rec.stall
            if rec.moved and rec.stall > 1.0 and not seeder:
                seeder.append(r.name)  # the one that pulled across the datacenters
            if r.version == 1:
                done.add(r.name)
            else:
                w.sim.after(poll_s, poll, r)

        r.update(then=answered)

    for r in rollouts:
        poll(r)
    w.sim.run_until(lambda: len(done) == len(rollouts), 600.0, label)
    w.sim.run(until=w.sim.now + 5.0)  # let offload seeds retire
    first = seeder[0] if seeder else max(stall, key=lambda k: stall[k])
    return w, stall, first


# ---- churn: random failures, invariants on every event ---------------------------------------


def churn(
    seed: int, quick: bool = False, steps: int | None = None, check_every: int = 1
) -> Result:
    """Trainers publish a version per step; rollouts (some spot) update; replicas crash at
    random moments (mid-transfer too) and come back as new incarnations. The table's invariants
    are checked after every event; every update must be answered (moved, or a typed error when
    every holder of what it wanted died)."""
    steps = steps or (30 if not quick else 8)
    nbytes = 2 * GB
    res = Result("churn", "Churn: random crashes while versions replicate (invariants after every event)",
                 ["steps", "crashes", "updates", "moved", "typed errors", "violations", "events"], [], {})  # fmt: skip
    w = World(
        seed,
        check_every=check_every,
        config=TableConfig(heartbeat_interval=0.2, heartbeat_timeout=2.0),
    )
    th, rh = w.hosts("dc0", "t", 1), w.hosts("dc0", "r", 3)
    w.hosts("dc1", "x", 1)
    w.stragglers()
    rng = w.sim.child_rng()
    trainers = w.replicas("trainer", th, 4, nbytes, retain=2, reads=16)
    rollouts = w.replicas("rollout", rh, 4, nbytes, reads=16)
    for i, r in enumerate(rollouts):
        r.spot = i % 3 == 2
    remote = w.replicas("remote", ["x0"], 4, nbytes, count=1, reads=16)
    w.open(trainers + rollouts + remote)
    crashes = updates = moved = errors = 0
    live: list[SimReplica] = rollouts + remote
    born = 0
    for step in range(1, steps + 1):
        up = [t for t in trainers if t.alive]
        if step > 1:
            w.wait([t.unpublish() for t in up], 120.0, f"unpublish at step {step}")
        w.publish(up, step)
        recs = []
        for r in live:
            recs.append((r, r.update()))
        victims = [r for r in live if rng.random() < 0.15]
        for v in victims:
            w.sim.after(rng.uniform(0.0, 0.2), v.crash)
        if rng.random() < 0.1 and len(up) > 1:
            victim = rng.choice(up)
            w.sim.after(rng.uniform(0.0, 0.2), victim.crash)
        w.sim.run_until(
            lambda: all(rec.end is not None or not r.alive for r, rec in recs),  # asked before it returns
            120.0,
            f"churn step {step}",
        )
        for r, rec in recs:
            if not r.alive:
                continue
            updates += 1
            if rec.error is not None:
                if rec.error not in ("version_unavailable", "timeout"):
                    w.server.violation(f"{r.name}: update failed with {rec.error}")
                errors += 1
            elif rec.moved:
                moved += 1
        # the dead come back (new incarnations on the same GPUs)
        for group in (trainers, live):
            for i, r in enumerate(group):
                if not r.alive:
                    crashes += 1
                    born += 1
                    devices = [s.device for s in r.shards]
                    group[i] = SimReplica(
                        w.server,
                        r.model,
                        r.name,
                        devices,
                        r.layout,
                        spot=r.spot,
                        retain=r.retain,
                    )
                    w.open([group[i]])
                    if group is trainers:
                        w.wait(
                            [group[i].publish(step)],
                            30.0,
                            "a restarted trainer republishes",
                        )
        w.sim.run(until=w.sim.now + 0.5)
    _merge(res, w)
    w.server.check()
    res.violations = list(dict.fromkeys(res.violations + w.server.violations))
    res.rows.append(
        [steps, crashes, updates, moved, errors, len(res.violations), w.sim.events]
    )
    res.data.update(crashes=crashes, updates=updates, moved=moved, errors=errors)
    return res


SCENARIOS: dict[str, Callable[..., Result]] = {
    "bandwidth": bandwidth,
    "bursts": bursts,
    "failure": failure,
    "standalone": standalone,
    "elastic": elastic,
    "crossdc": crossdc,
    "churn": churn,
}


def run(name: str, seed: int = 0, quick: bool = False) -> Result:
    """Run scenario ``name``."""
    fn = SCENARIOS.get(name)
    if fn is None:
        raise InvalidArgument(
            f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)} or 'paper'"
        )
    return fn(seed, quick=quick)
