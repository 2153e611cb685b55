"""Network interfaces: which one a GPU tensor's bytes should leave through (NIC affinity,
DESIGN.md §6), and which address a transport listens on and tells its peers to dial.

Theory of operation
-------------------
An RDMA read is fastest when the NIC and the GPU sit under the same PCIe switch: the bytes then
cross the switch peer to peer and never touch the root complex or the inter-socket link. Linux
shows the PCI tree in sysfs: ``/sys/bus/pci/devices/<bdf>`` is a symlink whose target spells the
chain of bridges from the root complex down to the device, e.g.
``/sys/devices/pci0000:00/0000:00:01.0/0000:02:00.0/0000:3b:00.0``. :func:`pci_path` turns that
into ``["pci0000:00", "0000:00:01.0", "0000:02:00.0", "0000:3b:00.0"]``, and
:func:`pci_distance` counts the hops between two devices through their nearest common ancestor.
Devices under different root complexes are :data:`CROSS_ROOT_DISTANCE` apart, farther than any
path inside one tree. So the nearest NIC is, in order: one under the GPU's PCIe switch, then one
on the same root complex, then any other.

:func:`rdma_nics` lists the RDMA devices (``/sys/class/infiniband/*``) and, when asked, the
network interfaces (``/sys/class/net/*``) with the PCI device each sits on. :func:`nearest_nic`
ranks them by distance from the GPU, then prefers one on the GPU's NUMA node (devices on other
root complexes are otherwise all equally far), then takes the smallest name, so the same machine
always gives the same answer. :func:`choose_nic` is the policy a transport calls: explicit
configuration wins, else the NIC nearest the tensor's GPU, else None (UCX picks).
:class:`NicChoice` says which and why, for the log.

This module only reads sysfs (directory listings, symlinks and ``numa_node`` files, under a
``sysfs_root`` that tests point at a fake tree) and asks torch for a GPU's PCI address; it
changes nothing. Names are returned without a port (``mlx5_0``); :func:`ucx_device_name` makes
the ``mlx5_0:1`` form that ``UCX_NET_DEVICES`` takes.

Addresses
---------
A holder's transports put an address in their endpoint; the server hands it to readers, which
may be on other hosts. :func:`choose_address` is the rule every built-in transport follows (and
``tensorhub doctor`` shows), the first that applies:

1. explicit options: ``host`` (the interface to bind) and ``advertise`` (the address peers dial;
   default ``host``). ``advertise`` alone binds every interface (``0.0.0.0``: the address may be
   one the host does not own, behind NAT), or loopback if it is a loopback address;
2. ``$TENSORHUB_ADVERTISE_HOST``: advertised, and bound as ``advertise`` alone is;
3. the servers this process talks to (passed in: the runtime gives each transport the server list
   of the handle that starts it, :meth:`~tensorhub.transports.base.Transport.set_servers`) are
   all on loopback (or ``ipc://``):
   every process of the job reaches that server, so the job is on this host: ``127.0.0.1``,
   bound and advertised, and nothing listens on the network;
4. the address of the interface that routes to the first server (asked of the kernel's routing
   table with an unconnected UDP socket's ``connect``, which sends nothing): the network the job's
   control plane runs on, which its other hosts reach. Bound and advertised;
5. (the server's route cannot be found: an IPv6 or unresolvable address) the interface of the
   default route, else the host's only non-loopback IPv4 interface that is up;
6. ``127.0.0.1``, when no server is known (a transport used alone: tests, benchmarks) or nothing
   else was found: peers on other hosts cannot reach it, and the rule says so.

Every choice carries the rule that made it (:class:`AddressChoice`), for the log and the doctor.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tensorhub.core.errors import InvalidArgument

__all__ = [
    "ADVERTISE_ENV",
    "CROSS_ROOT_DISTANCE",
    "AddressChoice",
    "NicChoice",
    "choose_address",
    "choose_nic",
    "gpu_bdf",
    "nearest_nic",
    "normalize_bdf",
    "pci_distance",
    "pci_path",
    "rdma_nics",
    "ucx_device_name",
]

CROSS_ROOT_DISTANCE = 1000
"""The distance between devices under different root complexes (farther than any real path)."""

# domain (4 to 8 hex digits, optional) : bus (2) : device (5 bits) . function (3 bits)
_BDF = re.compile(r"(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([01][0-9a-f])\.([0-7])")
_ROOT = re.compile(r"pci[0-9a-f]{4,8}:[0-9a-f]{2}")
# one UCX_NET_DEVICES entry: a device name with an optional port ("mlx5_0:1", "eth0", "all")
_UCX_DEVICE = re.compile(r"[A-Za-z0-9_.\-]+(?::[0-9]+)?")
_KINDS = ("infiniband", "net")


def normalize_bdf(bdf: str) -> str:
    """The sysfs spelling of a PCI address: lowercase, with a domain.

    ``3B:00.0``, ``0000:3b:00.0`` and torch's ``00000000:3B:00.0`` all become ``0000:3b:00.0``.

    Raises:
        InvalidArgument: ``bdf`` is not a PCI address.
    """
    m = _BDF.fullmatch(bdf.strip().lower()) if isinstance(bdf, str) else None
    if m is None:
        raise InvalidArgument(f"not a PCI address (domain:bus:device.function): {bdf!r}")
    domain, bus, device, function = m.groups()
    return f"{int(domain or '0', 16):04x}:{bus}:{device}.{function}"


def pci_path(bdf: str, sysfs_root: str = "/sys") -> list[str]:
    """The chain of PCI devices from the root complex down to ``bdf``, both included.

    Args:
        bdf: the device's PCI address, in any form :func:`normalize_bdf` accepts.
        sysfs_root: where sysfs is mounted.

    Returns:
        e.g. ``["pci0000:00", "0000:00:01.0", "0000:02:00.0", "0000:3b:00.0"]``.

    Raises:
        InvalidArgument: ``bdf`` is malformed, is not a device under ``sysfs_root``, or does not
            resolve to a path under a PCI root complex.
    """
    link = os.path.join(sysfs_root, "bus", "pci", "devices", normalize_bdf(bdf))
    try:
        real = os.path.realpath(link, strict=True)
    except OSError as e:
        raise InvalidArgument(f"no PCI device {link}") from e
    parts = real.split(os.sep)
    for i, part in enumerate(parts):
        if _ROOT.fullmatch(part):
            return parts[i:]
    raise InvalidArgument(f"PCI device {link} resolves to {real}, which is under no PCI root complex")


def pci_distance(a_path: list[str], b_path: list[str]) -> int:
    """Hops from one device to the other through their nearest common ancestor.

    0 for the same device; :data:`CROSS_ROOT_DISTANCE` when the root complexes differ.

    Raises:
        InvalidArgument: a path is empty.
    """
    if not a_path or not b_path:
        raise InvalidArgument(f"PCI paths must be non-empty, got {a_path!r} and {b_path!r}")
    common = 0
    for a, b in zip(a_path, b_path):
        if a != b:
            break
        common += 1
    if common == 0:
        return CROSS_ROOT_DISTANCE
    return len(a_path) + len(b_path) - 2 * common


def rdma_nics(sysfs_root: str = "/sys", kind: str = "infiniband") -> dict[str, str]:
    """The NICs of this host and the PCI address of each, sorted by name.

    Args:
        sysfs_root: where sysfs is mounted.
        kind: ``"infiniband"`` for the RDMA devices (``mlx5_0``); ``"net"`` for those and the
            network interfaces with a PCI device (``eth0``; virtual ones have none). An RDMA
            device keeps its entry if an interface has the same name.

    Returns:
        name -> bdf, e.g. ``{"mlx5_0": "0000:3b:00.0"}``; empty when there are none (or no such
        class directory). Devices whose ``device`` link is missing or broken are left out.

    Raises:
        InvalidArgument: ``kind`` is neither ``"infiniband"`` nor ``"net"``.
    """
    if kind not in _KINDS:
        raise InvalidArgument(f"kind must be one of {', '.join(_KINDS)}, got {kind!r}")
    found = _class_devices(sysfs_root, "infiniband")
    if kind == "net":
        for name, bdf in _class_devices(sysfs_root, "net").items():
            found.setdefault(name, bdf)
    return dict(sorted(found.items()))


def _class_devices(sysfs_root: str, cls: str) -> dict[str, str]:
    base = os.path.join(sysfs_root, "class", cls)
    try:
        names = os.listdir(base)
    except OSError:
        return {}
    found = {}
    for name in names:
        try:
            real = os.path.realpath(os.path.join(base, name, "device"), strict=True)
        except OSError:
            continue  # a virtual device (no link) or a broken link
        # the nearest PCI device on the way up (a virtio interface sits below its PCI function)
        for part in reversed(real.split(os.sep)):
            if _BDF.fullmatch(part):
                found[name] = normalize_bdf(part)
                break
    return found


def _numa_node(bdf: str, sysfs_root: str) -> int | None:
    try:
        with open(os.path.join(sysfs_root, "bus", "pci", "devices", bdf, "numa_node")) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None  # -1: the kernel does not know


def _nearest(
    gpu_path: list[str], gpu: str, nics: Mapping[str, str], sysfs_root: str
) -> tuple[str, int] | None:
    gpu_node = _numa_node(gpu, sysfs_root)
    best = None
    for name, bdf in nics.items():
        bdf = normalize_bdf(bdf)
        node = _numa_node(bdf, sysfs_root)
        key = (pci_distance(gpu_path, pci_path(bdf, sysfs_root)), gpu_node is None or node != gpu_node, name)
        if best is None or key < best:
            best = key
    return None if best is None else (best[2], best[0])


def nearest_nic(gpu_bdf: str, nics: Mapping[str, str], sysfs_root: str = "/sys") -> str | None:
    """The NIC closest to a GPU on the PCI tree, or None when ``nics`` is empty.

    Closest by :func:`pci_distance`; among equally close NICs, one on the GPU's NUMA node, then
    the smallest name.

    Args:
        gpu_bdf: the GPU's PCI address.
        nics: name -> bdf, as :func:`rdma_nics` returns.
        sysfs_root: where sysfs is mounted.

    Raises:
        InvalidArgument: the GPU or a NIC is not a PCI device under ``sysfs_root``.
    """
    if not nics:
        return None
    gpu = normalize_bdf(gpu_bdf)
    found = _nearest(pci_path(gpu, sysfs_root), gpu, nics, sysfs_root)
    return None if found is None else found[0]


def gpu_bdf(device_index: int) -> str | None:
    """The PCI address of CUDA device ``device_index``, or None without CUDA (or an old torch).

    Raises:
        InvalidArgument: ``device_index`` is not an index of a visible CUDA device.
    """
    import torch  # here, not at import: the rest of this module needs no torch

    if not isinstance(device_index, int) or isinstance(device_index, bool) or device_index < 0:
        raise InvalidArgument(f"a CUDA device index is an int >= 0, got {device_index!r}")
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if device_index >= count:
        raise InvalidArgument(f"no CUDA device {device_index} ({count} visible)")
    props = torch.cuda.get_device_properties(device_index)
    domain = getattr(props, "pci_domain_id", 0)
    bus = getattr(props, "pci_bus_id", None)
    device = getattr(props, "pci_device_id", None)
    if bus is None or device is None:
        return None
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def ucx_device_name(nic: str, port: int = 1) -> str:
    """The ``UCX_NET_DEVICES`` spelling of an RDMA device's port: ``mlx5_0`` -> ``mlx5_0:1``.

    Raises:
        InvalidArgument: ``nic`` is not a bare device name, or ``port`` is not >= 1.
    """
    if not isinstance(nic, str) or ":" in nic or not _UCX_DEVICE.fullmatch(nic):
        raise InvalidArgument(f"not an RDMA device name (like 'mlx5_0'): {nic!r}")
    if not isinstance(port, int) or isinstance(port, bool) or port < 1:
        raise InvalidArgument(f"an RDMA port number is an int >= 1, got {port!r}")
    return f"{nic}:{port}"


@dataclass(frozen=True, slots=True)
class NicChoice:
    """Which NIC a transport should use, and why (for the log).

    Attributes:
        name: the explicit configuration verbatim (a ``UCX_NET_DEVICES`` list), a bare device
            name (``mlx5_0``), or None to let UCX choose.
        reason: ``"explicit"``, ``"nearest to GPU <bdf> (distance N)"``, ``"no GPU"``,
            ``"GPU <bdf> not found in sysfs"`` or ``"no RDMA NIC found"``.
    """

    name: str | None
    reason: str

    def ucx_net_devices(self, port: int = 1) -> str | None:
        """The value for ``UCX_NET_DEVICES``: explicit configuration as given, a chosen device
        with ``port`` appended, None when UCX should choose."""
        if self.name is None or self.reason == "explicit":
            return self.name
        return ucx_device_name(self.name, port)


def choose_nic(
    explicit: str | None,
    device_index: int | None,
    sysfs_root: str = "/sys",
    *,
    locate_gpu: Callable[[int], str | None] = gpu_bdf,
) -> NicChoice:
    """The NIC for a tensor on CUDA device ``device_index`` (None: a CPU tensor).

    Explicit configuration wins; else the RDMA NIC nearest the GPU; else no choice.

    Args:
        explicit: configured devices in ``UCX_NET_DEVICES`` form (``"mlx5_0:1"``,
            ``"mlx5_0:1,mlx5_1:1"``, ``"eth0"``), or None.
        device_index: the tensor's CUDA device, or None.
        sysfs_root: where sysfs is mounted.
        locate_gpu: device index -> PCI address (:func:`gpu_bdf`; tests pass a fake).

    Raises:
        InvalidArgument: ``explicit`` is empty or not a comma-separated list of device names
            (with optional ``:port``), or ``device_index`` is not a visible CUDA device.
    """
    if explicit is not None:
        entries = explicit.split(",") if isinstance(explicit, str) else None
        if not entries or not all(_UCX_DEVICE.fullmatch(e) for e in entries):
            raise InvalidArgument(
                "explicit NIC must be a comma-separated list of devices like 'mlx5_0:1' or 'eth0'"
                f" (no spaces), got {explicit!r}"
            )
        return NicChoice(explicit, "explicit")
    if device_index is None:
        return NicChoice(None, "no GPU")
    bdf = locate_gpu(device_index)
    if bdf is None:
        return NicChoice(None, "no GPU")
    bdf = normalize_bdf(bdf)
    nics = rdma_nics(sysfs_root)
    if not nics:
        return NicChoice(None, "no RDMA NIC found")
    try:
        gpu_path = pci_path(bdf, sysfs_root)
    except InvalidArgument:
        return NicChoice(None, f"GPU {bdf} not found in sysfs")
    found = _nearest(gpu_path, bdf, nics, sysfs_root)
    if found is None:
        return NicChoice(None, "no RDMA NIC found")
    return NicChoice(found[0], f"nearest to GPU {bdf} (distance {found[1]})")


# ---- addresses ---------------------------------------------------------------------------------

#: The environment variable that names the address a process's transports advertise.
ADVERTISE_ENV = "TENSORHUB_ADVERTISE_HOST"
LOOPBACK = "127.0.0.1"
ANY = "0.0.0.0"
_SIOCGIFADDR, _SIOCGIFFLAGS = 0x8915, 0x8913
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8

@dataclass(frozen=True, slots=True)
class AddressChoice:
    """Where a transport listens and what it advertises.

    Attributes:
        bind: the interface to bind (``0.0.0.0``: all of them).
        advertise: the address peers are told to dial.
        rule: which rule of :func:`choose_address` chose them, in words.
    """

    bind: str
    advertise: str
    rule: str


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _server_host(address: str) -> str | None:
    """The host of a ``tcp://host:port`` address; "" for ``ipc://``/``inproc://`` (this host);
    None when it cannot be read."""
    if address.startswith(("ipc://", "inproc://")):
        return ""
    if not address.startswith("tcp://"):
        return None
    rest = address[len("tcp://") :]
    if rest.startswith("["):  # [v6]:port
        end = rest.find("]")
        return rest[1:end] if end > 0 else None
    host, sep, _ = rest.rpartition(":")
    return host if sep else rest


def route_source(host: str) -> str | None:
    """The local IPv4 address the kernel would send from to reach ``host`` (a name or an IPv4
    address), or None. An unconnected UDP socket's ``connect`` asks the routing table; nothing
    is sent."""
    try:
        infos = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for *_, sockaddr in infos:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.connect(sockaddr)
            src = s.getsockname()[0]
        except OSError:
            continue
        finally:
            s.close()
        if src and src != ANY:
            return str(src)
    return None


def _ioctl_ipv4(name: str, request: int) -> bytes | None:
    import fcntl

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        return fcntl.ioctl(s.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None
    finally:
        s.close()


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` if it is up and not loopback, else None."""
    flags = _ioctl_ipv4(name, _SIOCGIFFLAGS)
    if flags is None:
        return None
    bits = struct.unpack_from("H", flags, 16)[0]
    if not bits & _IFF_UP or bits & _IFF_LOOPBACK:
        return None
    got = _ioctl_ipv4(name, _SIOCGIFADDR)
    return socket.inet_ntoa(got[20:24]) if got is not None else None


def default_route_interface(proc_route: str = "/proc/net/route") -> str | None:
    """The interface of the IPv4 default route (``/proc/net/route``), or None."""
    try:
        with open(proc_route) as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        cols = line.split()
        if len(cols) >= 4 and cols[1] == "00000000" and int(cols[3], 16) & 0x1:  # RTF_UP
            return cols[0]
    return None


def host_interfaces() -> dict[str, str]:
    """The host's IPv4 interfaces that are up and not loopback: name -> address."""
    found = {}
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return {}
    for name in sorted(names):
        addr = interface_address(name)
        if addr is not None:
            found[name] = addr
    return found


def choose_address(
    host: str | None = None, advertise: str | None = None, servers: Sequence[str] | None = None
) -> AddressChoice:
    """Where a transport listens and what it advertises (the rule of the module docstring).

    Args:
        host: the transport's ``host`` option (None or "": not given).
        advertise: its ``advertise`` option (None or "": not given).
        servers: the control-plane servers this process talks to, primary first (None or empty:
            none known).

    Raises:
        InvalidArgument: ``host`` or ``advertise`` is not a string.
    """
    for what, v in (("host", host), ("advertise", advertise)):
        if v is not None and not isinstance(v, str):
            raise InvalidArgument(f"transport option {what!r} must be a string (an address), got {v!r}")
    if host:
        return AddressChoice(host, advertise or (host if host != ANY else _fallback(servers)[0]),
                             "the transport's host/advertise options")  # fmt: skip
    if advertise:
        return AddressChoice(LOOPBACK if _is_loopback(advertise) else ANY, advertise, "the transport's advertise option")
    env = os.environ.get(ADVERTISE_ENV, "").strip()
    if env:
        return AddressChoice(LOOPBACK if _is_loopback(env) else ANY, env, f"${ADVERTISE_ENV}")
    addr, rule = _fallback(servers)
    return AddressChoice(addr, addr, rule)


def _fallback(servers: Sequence[str] | None) -> tuple[str, str]:
    """Rules 3 to 6: ``(address, rule)``."""
    servers = tuple(servers or ())
    if not servers:
        return LOOPBACK, "no server known (a transport used alone): loopback, unreachable from other hosts"
    hosts = [_server_host(a) for a in servers]
    if all(h is not None and (h == "" or _is_loopback(h)) for h in hosts):
        return LOOPBACK, f"the server ({servers[0]}) is on loopback, so the job is on this host"
    first = next((h for h in hosts if h and not _is_loopback(h)), None)
    if first is not None:
        src = route_source(first)
        if src is not None:
            return src, f"the interface that routes to the server {first}"
    name = default_route_interface()
    addr = interface_address(name) if name else None
    if addr is not None:
        return addr, f"the default route's interface {name} (no IPv4 route to the server found)"
    ifaces = host_interfaces()
    if len(ifaces) == 1:
        name, addr = next(iter(ifaces.items()))
        return addr, f"the host's only network interface {name} (no IPv4 route to the server found)"
    return LOOPBACK, f"no interface found that reaches the server ({servers[0]}): loopback, unreachable from other hosts"
