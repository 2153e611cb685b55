"""The systems TensorHub is compared with, as models in the same simulated hardware.

Each baseline's parameters are set once here, for every scenario; no figure tunes its own.
Where a number comes from the paper, it says so; the rest are stated assumptions.

- **NCCL broadcast behind a global barrier** (static membership). The RL framework's driver
  stops every worker (trainers and rollouts) for a weight-transfer stage: it dispatches the
  stage to each worker (``driver_rpc`` each, one after another), the communicator synchronizes
  all ranks (``barrier_per_rank`` per rank), and each shard index is broadcast from one trainer
  along a pipelined chain of its rollout shards, whose rate is its slowest hop's. Every GPU
  stalls until the slowest broadcast ends.
- **UCX point-to-point**: the same driver stage; each rollout shard pulls from one trainer
  shard (trainer replicas assigned round robin), with no relaying: readers share a sender's
  NIC. New (elastic) workers pull from a standalone rollout once it has the weights, because
  trainers are busy training. Its flows run in the flow-level network, so contention is
  modelled, not assumed.
- **Ray object store**: put (GPU -> CPU copy, serialization into the object store), the object
  manager's transfer, get (deserialization, CPU -> GPU copy), one after another, with an object
  size cap past which the store fails (the paper saw it crash past 35 GB per shard).

Data-plane efficiencies come from the paper's bandwidth microbenchmark (§5.1.1): 50 GB per
shard on 25 GB/s RDMA at 22 GB/s for TensorHub, 18.8 for NCCL and 18.1 for UCX, all 8 shards of a
host done. With the stragglers below, the slowest of those 8 shards runs at about 0.92 of a
typical NIC, so each efficiency is its measured throughput / 25 / 0.92 (the ``bandwidth``
scenario checks that it gives the measured numbers back). They are the inputs the other
scenarios are predicted from.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .cluster import GB, Cluster, Device

__all__ = [
    "NCCL",
    "RAY",
    "STRAGGLER_SIGMA",
    "TENSORHUB",
    "UCX",
    "RayParams",
    "SystemParams",
    "nccl_stage",
    "ray_transfer",
]

#: Every GPU NIC's (and VPC NIC's) speed varies by a factor 1 - |N(0, sigma)| per run: the
#: stragglers a barrier waits for. The same for every system.
STRAGGLER_SIGMA = 0.04


@dataclass(frozen=True)
class SystemParams:
    """One weight-transfer system's data plane and coordination costs (seconds)."""

    name: str
    efficiency: float  # achieved / line rate on RDMA
    driver_rpc: float = 0.0  # per worker, dispatched one after another by the RL driver
    barrier_per_rank: float = 0.0  # a communicator-wide synchronization, per rank

    def stage_overhead(self, workers: int) -> float:
        """What a global weight-transfer stage costs before any byte moves."""
        return self.driver_rpc * workers + self.barrier_per_rank * workers


_SLOWEST_OF_8 = 0.92  # the slowest of 8 shards' NIC pairs, relative to a typical one (STRAGGLER_SIGMA)

TENSORHUB = SystemParams("TensorHub", 22.0 / 25.0 / _SLOWEST_OF_8)
NCCL = SystemParams(
    "NCCL", 18.8 / 25.0 / _SLOWEST_OF_8, driver_rpc=0.2e-3, barrier_per_rank=1.0e-3
)
UCX = SystemParams("UCX", 18.1 / 25.0 / _SLOWEST_OF_8, driver_rpc=0.2e-3)


@dataclass(frozen=True)
class RayParams:
    """Ray's object store path for a GPU tensor (GB/s, and the size cap in GB)."""

    d2h_gbs: float = 5.0  # pageable GPU -> CPU copy
    serialize_gbs: float = 1.5  # into the plasma store
    transfer_gbs: float = 0.5  # the object manager's chunked transfer between nodes
    deserialize_gbs: float = 1.5
    h2d_gbs: float = 5.0
    object_cap_gb: float = 35.0  # paper §5.1.1: Ray crashed past 35 GB per shard

    def time(self, nbytes: float) -> float | None:
        """Seconds for one shard of ``nbytes``, or None when the store fails."""
        if nbytes > self.object_cap_gb * GB:
            return None
        per_gb = sum(
            1.0 / r
            for r in (
                self.d2h_gbs,
                self.serialize_gbs,
                self.transfer_gbs,
                self.deserialize_gbs,
                self.h2d_gbs,
            )
        )
        return nbytes / GB * per_gb


RAY = RayParams()


def ray_transfer(nbytes: float) -> float | None:
    return RAY.time(nbytes)


def nccl_stage(
    cluster: Cluster,
    roots: list[list[Device]],
    readers: list[list[Device]],
    nbytes: float,
    workers: int,
) -> float:
    """The NCCL stage's length: overhead, then per shard index a pipelined chain broadcast from
    its root trainer shard through every reader replica's shard, as fast as its slowest hop.

    Args:
        roots: trainer replicas' devices (the first is the broadcast root).
        readers: rollout replicas' devices, one list per replica, a device per shard.
        workers: every GPU that takes part in the stage (trainers and rollouts).
    """
    slowest = 0.0
    for i, root in enumerate(roots[0]):
        chain = [root] + [r[i] for r in readers]
        rate = min(cluster.rate(a, b) for a, b in itertools.pairwise(chain))
        slowest = max(slowest, nbytes / rate + len(chain) * cluster.params.rdma_latency)
    return NCCL.stage_overhead(workers) + slowest
