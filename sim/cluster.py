"""The simulated hardware: datacenters of hosts of GPUs, their NICs, and the paths between them.

Every number here is a parameter of the whole simulator, set once for every scenario and every
system (TensorHub and the baselines alike); where it comes from is said next to it.

- Each GPU has its own RDMA NIC share, full duplex: the paper's hosts have 8 GPUs and 4 RDMA NICs
  of 400 Gbps, so 200 Gbps (25 GB/s) per GPU each way, the paper's "RDMA ideal" per shard.
- A transfer reaches ``efficiency`` of the line rate. The efficiency is the data plane's, so it
  belongs to the system being simulated (:class:`tensorhub.sim.baselines.SystemParams`): TensorHub's is
  the paper's measured 22 of 25 GB/s.
- Within a datacenter, a read between two GPUs crosses the sender's NIC (send side) and the
  receiver's NIC (receive side), also between GPUs of one host (the paper's deployment moves
  weights over RDMA even there).
- Across datacenters, bytes go through each host's one VPC NIC (200 Gbps) over TCP. A host's
  VPC NIC achieves ``vpc_efficiency`` of its line rate in aggregate, and one TCP stream at most
  ``tcp_stream_gbps``; one stream per shard pull.
- CPU memory (offload copies, offload seeds) is read at the host's memory bandwidth
  (``host_memory_gbps``, shared by every reader of it) into each GPU over that GPU's own link;
  a GPU's offload copy is written over PCIe at ``pcie_gbps``. A reader on another host also
  crosses the NIC nearest the CPU copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorhub.core.errors import InvalidArgument
from tensorhub.core.topology import Location

from .network import Link, Network

__all__ = ["GB", "Cluster", "Device", "NetParams"]

GB = 1e9


@dataclass(frozen=True)
class NetParams:
    """The network's parameters (bandwidths in Gbit/s, times in seconds).

    ``vpc_efficiency`` and ``tcp_stream_gbps`` are not stated by the paper; they are the two
    numbers that make its cross-datacenter baseline (8 GPUs of one host pulling 10 GB each over
    TCP: 7.8 s) and its seeding replica (2 streams: 2.5 s) consistent with a 200 Gbps VPC NIC, and
    are then used by every system in every scenario.
    """

    gpus_per_host: int = 8
    gpu_nic_gbps: float = 200.0
    vpc_nic_gbps: float = 200.0
    vpc_efficiency: float = 0.41
    tcp_stream_gbps: float = 32.0
    wan_gbps: float | None = (
        None  # the inter-datacenter link itself (None: not the bottleneck)
    )
    pcie_gbps: float = 200.0
    host_memory_gbps: float = 1600.0
    rdma_latency: float = 20e-6  # one read's round trip within a datacenter
    wan_latency: float = 2e-3  # one read's round trip across datacenters
    control_latency: float = 0.5e-3  # one way, client <-> reference server
    server_service: float = (
        40e-6  # the server's CPU per message (messages queue behind it)
    )
    transfer_timeout: float = (
        4.0  # the RDMA layer's conservative timeout on a silent peer (paper §5.1.3)
    )

    def __post_init__(self) -> None:
        for name in (
            "gpu_nic_gbps",
            "vpc_nic_gbps",
            "tcp_stream_gbps",
            "pcie_gbps",
            "host_memory_gbps",
        ):
            if not getattr(self, name) > 0:
                raise InvalidArgument(
                    f"NetParams.{name} must be > 0, got {getattr(self, name)!r}"
                )
        if not 0 < self.vpc_efficiency <= 1:
            raise InvalidArgument(
                f"NetParams.vpc_efficiency must be in (0, 1], got {self.vpc_efficiency!r}"
            )
        if self.gpus_per_host < 1:
            raise InvalidArgument(
                f"NetParams.gpus_per_host must be >= 1, got {self.gpus_per_host!r}"
            )


@dataclass(frozen=True)
class Device:
    """Where a shard's bytes live: a GPU (``gpu`` >= 0) or the host's CPU memory (``gpu`` -1)."""

    datacenter: str
    host: str
    gpu: int

    @property
    def location(self) -> Location:
        return Location(
            self.datacenter, self.host, f"gpu{self.gpu}" if self.gpu >= 0 else "cpu"
        )

    def __str__(self) -> str:
        return f"{self.datacenter}/{self.host}/{'cpu' if self.gpu < 0 else f'gpu{self.gpu}'}"


class Cluster:
    """Hosts in datacenters, and the links of a :class:`~tensorhub.sim.network.Network` between them.

    Args:
        network: where the links live.
        params: the hardware.
        efficiency: the simulated system's data-plane efficiency on RDMA (0 < e <= 1).
    """

    def __init__(self, network: Network, params: NetParams, efficiency: float) -> None:
        if not 0 < efficiency <= 1:
            raise InvalidArgument(
                f"a data-plane efficiency must be in (0, 1], got {efficiency!r}"
            )
        self.net = network
        self.params = params
        self.efficiency = efficiency
        self.hosts: dict[str, str] = {}  # host -> datacenter
        self.jitter: dict[
            str, float
        ] = {}  # GPU or host -> its NIC's speed factor (stragglers)

    def add_hosts(self, datacenter: str, prefix: str, count: int) -> list[str]:
        """Add ``count`` hosts named ``{prefix}{i}`` to ``datacenter``; return their names."""
        names = []
        for i in range(count):
            name = f"{prefix}{i}"
            if name in self.hosts:
                raise InvalidArgument(f"host {name!r} added twice")
            self.hosts[name] = datacenter
            names.append(name)
        return names

    def gpus(self, hosts: list[str]) -> list[Device]:
        """Every GPU of these hosts, host by host."""
        return [
            Device(self.hosts[h], h, g)
            for h in hosts
            for g in range(self.params.gpus_per_host)
        ]

    def cpu(self, host: str) -> Device:
        return Device(self.hosts[host], host, -1)

    # ---- links -------------------------------------------------------------------------------

    def _nic(self, d: Device, side: str) -> Link:
        p = self.params
        if d.gpu < 0:
            return self.net.link(
                f"memory:{d.host}:{side}", p.host_memory_gbps / 8 * GB * self.efficiency
            )
        key = f"{d.host}/{d.gpu}"
        return self.net.link(
            f"nic:{key}:{side}",
            p.gpu_nic_gbps / 8 * GB * self.efficiency * self.jitter.get(key, 1.0),
        )

    def _vpc(self, host: str, side: str) -> Link:
        p = self.params
        return self.net.link(
            f"vpc:{host}:{side}",
            p.vpc_nic_gbps / 8 * GB * p.vpc_efficiency * self.jitter.get(host, 1.0),
        )

    def path(self, src: Device, dst: Device) -> tuple[list[Link], float | None, float]:
        """The links a read from ``src`` into ``dst`` crosses, its per-flow cap (bytes/s, None:
        none) and its round-trip latency."""
        p = self.params
        if src.datacenter == dst.datacenter:
            links = [self._nic(src, "tx"), self._nic(dst, "rx")]
            if src.gpu < 0 and src.host != dst.host:
                links.append(
                    self.net.link(
                        f"nic:{src.host}/cpu:tx",
                        p.gpu_nic_gbps / 8 * GB * self.efficiency,
                    )
                )
            return links, None, p.rdma_latency
        links = [self._vpc(src.host, "tx"), self._vpc(dst.host, "rx")]
        if p.wan_gbps is not None:
            a, b = sorted((src.datacenter, dst.datacenter))
            links.insert(
                1, self.net.link(f"wan:{a}-{b}:{src.datacenter}", p.wan_gbps / 8 * GB)
            )
        return links, p.tcp_stream_gbps / 8 * GB, p.wan_latency

    def rate(self, src: Device, dst: Device) -> float:
        """The rate of one lone read from ``src`` into ``dst`` (bytes/s)."""
        links, cap, _ = self.path(src, dst)
        return min(
            [link.capacity for link in links] + ([cap] if cap is not None else [])
        )

    def draw_stragglers(self, rng, sigma: float, devices: list[Device]) -> None:
        """Give each GPU NIC (and each host's VPC NIC) a speed factor ``1 - |N(0, sigma)|``, at
        least 0.5: the slow links that make the slowest of many transfers slower than the mean."""
        for d in devices:
            self.jitter[f"{d.host}/{d.gpu}"] = max(
                0.5, 1.0 - abs(rng.gauss(0.0, sigma))
            )
        for h in sorted({d.host for d in devices}):
            self.jitter[h] = max(0.5, 1.0 - abs(rng.gauss(0.0, sigma)))
