"""Where a worker is: datacenter, host, and optionally the NIC / device its memory sits near.

Locations are declared by clients at ``open`` and compared by the source-selection policy:
same datacenter first, same host as a tie-break. ``Location.default()`` is the local host in a
datacenter named ``"local"``.
"""

from __future__ import annotations

import platform

from tensorhub.wire import struct

__all__ = ["Location"]


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
