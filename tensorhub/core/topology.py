"""The topology model: where a worker is, and what kind of link joins two workers.

A worker declares at ``open`` its :class:`Location`: the datacenter (a failure and bandwidth
domain), the host, and optionally the NIC its shard's memory sits nearest (see
:mod:`tensorhub.transports.nic`). Whether it is a **spot** worker (preemptible: it serves reads but never
counts for retention) is declared next to it, per replica (``open(..., spot=True)``).

Two locations are joined by one of the :data:`LINK_CLASSES`, nearest first (:func:`link_class`):

- ``"host"``: the same host (shared memory, NVLink/PCIe: the ``local`` transport);
- ``"datacenter"``: the same datacenter, another host (the RDMA fabric: ``nixl``, ``rdma_copy``);
- ``"remote"``: another datacenter (the slow, shared inter-datacenter link: ``tcp``).

The source-selection policy (:mod:`tensorhub.scheduling.selection`) prefers the reader's datacenter, then
its host; the transport of an edge is chosen by its link class (:mod:`tensorhub.scheduling.edges`); the
server accounts the bytes it moved per link class, and the cross-datacenter policy (seeding,
smart skipping, offload seeding: ``tensorhub.core.table``) keeps ``remote`` bytes to about one copy
per datacenter. ``Location.default()`` is the local host in a datacenter named ``"local"``.
"""

from __future__ import annotations

import platform

from .wire import struct

__all__ = ["LINK_CLASSES", "Location", "link_class"]

LINK_CLASSES = ("host", "datacenter", "remote")
"""Link classes, nearest first."""


@struct
class Location:
    """A worker's place in the topology.

    Attributes:
        datacenter: the datacenter (a failure and bandwidth domain).
        host: the host name within the datacenter.
        nic: the NIC nearest the shard's memory, or "" if unknown.
    """

    datacenter: str
    host: str
    nic: str

    def __post_init__(self) -> None:
        for what in ("datacenter", "host", "nic"):
            value = getattr(self, what)
            if len(value) > 255:
                raise ValueError(f"location {what} longer than 255 characters")
        if not self.datacenter or not self.host:
            raise ValueError("a location needs a datacenter and a host")

    @classmethod
    def default(cls) -> "Location":
        return cls(datacenter="local", host=platform.node() or "localhost", nic="")


def link_class(a: Location, b: Location) -> str:
    """``"host"``, ``"datacenter"`` or ``"remote"``: the link between two locations."""
    if a.datacenter != b.datacenter:
        return "remote"
    return "host" if a.host == b.host else "datacenter"
