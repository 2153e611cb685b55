"""The emulated cluster (DESIGN §8): hosts as network namespaces, datacenters as bridges, links
shaped by ``tc``, real processes inside; it tears itself down completely.

Workload: ``--check``: a 2-datacenter emulated cluster built, ``--mbytes`` MB sent across each
kind of link, torn down.
Baseline: the intra-datacenter rate (a1 -> a2), measured in the same run.
Goal: both inter-datacenter rates < 0.6x the intra one (the shaping shows); nothing left behind.

Theory of operation
-------------------
A :class:`Cluster` owns, for one run, everything whose name carries its random ``prefix``
(``th`` + 4 hex digits unless given):

- one *switch* namespace ``<prefix>-sw`` holding a Linux bridge ``<prefix>b<d>`` per datacenter;
- one namespace ``<prefix>-<host>`` per host, with ``lo`` up and one veth pair into its
  datacenter's bridge: ``<prefix>h<n>`` on the host side (address ``10.<x>.<d>.<i>/16``, egress
  shaped by ``htb`` at the host rate) and ``<prefix>s<n>`` on the bridge side;
- one veth pair per inter-datacenter link, ``<prefix>x<d>a`` / ``<prefix>x<d>b``, between the
  bridge of datacenter ``d`` and the bridge of the first datacenter (a star, so the layer-2 graph
  has no loop). Both ends are shaped: ``htb`` at the inter-datacenter rate, with a ``netem``
  child adding the one-way delay when one is asked for (a round trip costs twice the delay;
  kernels without sch_netem can only shape the rate).
- the processes :meth:`Cluster.run` started (each in its own process group, each carrying
  ``TENSORHUB_CLUSTER=<prefix>`` in its environment so that its descendants can be found too).

Faults (issue 23): :meth:`Cluster.cut` drops, silently, what one host sends to another (or to
everyone): a ``u32`` filter on the host's side of its veth sends those packets to an htb class
whose qdisc is a ``blackhole`` (this kernel has no netem and no ``gact`` drop action, and a
blackhole drops without telling the sender). Two cuts make a two-way partition; one is a
one-way cut. :meth:`Cluster.slow` shapes a host's link, both ways, to a fraction of its rate;
:meth:`Cluster.heal` undoes one fault or all. Fault filters take priorities 1..89, ahead of the
control-plane class (90). Schedules (seeded, bounded) are built on these by
``benchmarks/partitions.py``.

Every veth is created directly inside its namespaces, so nothing is added to the root
namespace: its links and routes stay untouched. All hosts share one /16 and one layer-2
domain, so any host reaches any other by address.

Invariants: every ``ip``/``tc`` command runs under a timeout and raises :class:`ClusterError`
naming the command and its stderr when it fails; teardown (context exit, an exception inside
the ``with``, SIGINT/SIGTERM while active, ``atexit``) kills the processes (SIGTERM to their
process groups, SIGKILL after a grace period, then SIGKILL to whatever still lives in the
namespaces) before deleting the namespaces, which deletes the veths, bridges and qdiscs with
them. :func:`leftovers` lists anything carrying a prefix that survived. It must never touch a
namespace, link or process that does not carry its prefix.

Memory and CPU are shared by all hosts: use transports that cross the links (``tcp``, NIXL with
``UCX_TLS=tcp``), not ``local`` or shared memory.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: the harness is imported as benchmarks.harness

from benchmarks.harness import BenchmarkError, ratio  # noqa: E402

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations are not evaluated at run time

__all__ = ["Cluster", "ClusterError", "Fault", "available", "cleanup", "leftovers", "measure_throughput", "netem_available", "tcp_check"]

MARKER = "TENSORHUB_CLUSTER"  # environment variable carrying the prefix into every process
_COMMAND_TIMEOUT = 15.0
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")
_PREFIX = re.compile(r"^[a-z][a-z0-9]{1,7}$")  # <= 8 chars: every interface name stays <= 15
_PRIO_PORTS = 90  # the tc filter priority of the control-plane class; fault filters come first (1..89)
_DROP = "1:66"  # the htb class whose qdisc (blackhole) drops every packet: where a cut sends them


class ClusterError(BenchmarkError):
    """The emulated cluster could not be built, used or torn down (a failed ``ip``/``tc``
    command, a bad spec, a host that does not exist...)."""


def available() -> str | None:
    """None if this machine can build a cluster, else the reason it cannot."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces, veths and tc need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is missing (iproute2)"
    try:
        r = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"`ip netns list` failed: {err}"
    if r.returncode != 0:
        return f"`ip netns list` failed: {r.stderr.strip()}"
    return None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (needed for an inter-datacenter delay). Probed on
    a throwaway veth pair in a throwaway namespace."""
    ns = f"thprobe{secrets.token_hex(2)}"
    try:
        _cmd(["ip", "netns", "add", ns])
    except ClusterError:
        return False
    try:
        _cmd(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _cmd(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms"])
        return True
    except ClusterError:
        return False
    finally:
        _cmd(["ip", "netns", "del", ns], check=False)


def _cmd(argv: Sequence[str], timeout: float = _COMMAND_TIMEOUT, check: bool = True) -> str:
    """Run one bounded command; raise ClusterError naming it and its stderr when it fails."""
    try:
        r = subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise ClusterError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from err
    except OSError as err:
        raise ClusterError(f"`{' '.join(argv)}` could not run: {err}") from err
    if check and r.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed (exit {r.returncode}): {r.stderr.strip()}")
    return r.stdout


def _netns_names() -> list[str]:
    out = _cmd(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    out = _cmd(["ip", "netns", "pids", ns], check=False)
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _marked_pids(prefix: str, by_cmdline: bool = False) -> list[int]:
    """Processes whose environment carries ``MARKER=prefix`` (or, with ``by_cmdline``, whose
    command line names the prefix: reported as leftovers, never killed on that ground alone)."""
    found = []
    want_env = f"{MARKER}={prefix}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        if want_env in env or (by_cmdline and prefix.encode() in cmdline):
            found.append(int(entry))
    return found


def leftovers(prefix: str) -> list[str]:
    """Everything carrying ``prefix`` that still exists: namespaces (and the processes in them),
    links and qdiscs in the root namespace, and processes marked with the prefix.

    Returns:
        one line per thing, e.g. ``"netns th1a2b-a1"``, ``"process 1234: python3 ..."``; empty
        when the cluster was torn down completely.
    """
    if not prefix:
        raise ValueError("leftovers needs a non-empty prefix")
    found = []
    for ns in _netns_names():
        if prefix in ns:
            found.append(f"netns {ns}")
            found.extend(f"process {pid} in netns {ns}" for pid in _netns_pids(ns))
    for line in _cmd(["ip", "-o", "link", "show"], check=False).splitlines():
        fields = line.split(":", 2)  # "7: name@peer: <FLAGS> ..."
        if len(fields) == 3 and fields[1].strip().startswith(prefix):
            found.append("link " + line.split("\\")[0].strip())
    for line in _cmd(["tc", "qdisc", "show"], check=False).splitlines():
        words = line.split()
        if "dev" in words[:-1] and words[words.index("dev") + 1].startswith(prefix):
            found.append("qdisc " + line.strip())
    for pid in _marked_pids(prefix, by_cmdline=True):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        found.append(f"process {pid}: {cmdline[:200]}")
    return found


def cleanup(prefix: str) -> list[str]:
    """Remove what a run that could not tear itself down (SIGKILLed, power cut...) left behind:
    SIGKILL the processes in its namespaces or marked with its prefix, delete its namespaces.

    Args:
        prefix: a run's full prefix (e.g. ``"th1a2b"``), as :class:`Cluster` validates it;
            only namespaces named ``<prefix>-...`` are deleted.

    Returns:
        :func:`leftovers` afterwards (empty when everything is gone).
    """
    if not _PREFIX.match(prefix):
        raise ClusterError(f"prefix {prefix!r} is not a cluster prefix")
    namespaces = [ns for ns in _netns_names() if ns.startswith(prefix + "-")]
    pids = set(_marked_pids(prefix))
    for ns in namespaces:
        pids.update(_netns_pids(ns))
    pids.discard(os.getpid())
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    time.sleep(0.2)
    for ns in namespaces:
        _cmd(["ip", "netns", "del", ns], check=False)
    return leftovers(prefix)


def _htb(dev: str, rate: str, priority_ports: Sequence[int] = ()) -> list[list[str]]:
    """A root htb at ``rate`` with one default class (handles GSO packets, unlike a small tbf).
    With ``priority_ports``: under one class at ``rate``, packets to or from those TCP ports go
    to a class served first (``prio 0``; a tenth of the rate guaranteed, all of it borrowable),
    the rest to the default class: the control plane's small messages do not wait behind a
    queue of bulk transfer (the kernel here has no fq_codel or sfq to keep that queue short)."""
    if not priority_ports:
        return [
            ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
            ["class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate],
        ]
    bits = _rate_bits(rate)
    out = [
        ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
        ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate],
        ["class", "add", "dev", dev, "parent", "1:1", "classid", "1:5", "htb", "rate", f"{max(bits // 10, 8000)}bit",
         "ceil", rate, "prio", "0"],
        ["class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", "rate", f"{max(bits - bits // 10, 8000)}bit",
         "ceil", rate, "prio", "1"],
    ]  # fmt: skip
    for port in priority_ports:
        for field in ("dport", "sport"):
            out.append(["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", str(_PRIO_PORTS), "u32",
                        "match", "ip", field, str(port), "0xffff", "flowid", "1:5"])  # fmt: skip
    return out


def _htb_rates(dev: str, rate: str, priority_ports: Sequence[int] = ()) -> list[list[str]]:
    """``tc class change`` commands that set the classes :func:`_htb` made to ``rate``."""
    if not priority_ports:
        return [["class", "change", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate]]
    bits = _rate_bits(rate)
    return [
        ["class", "change", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate],
        ["class", "change", "dev", dev, "parent", "1:1", "classid", "1:5", "htb", "rate", f"{max(bits // 10, 8000)}bit",
         "ceil", rate, "prio", "0"],
        ["class", "change", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", "rate", f"{max(bits - bits // 10, 8000)}bit",
         "ceil", rate, "prio", "1"],
    ]  # fmt: skip


def _rate_bits(rate: str) -> int:
    """A ``tc`` rate in bits per second (``400mbit``, ``1gbit``, ``50mbps``)."""
    m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise ClusterError(f"cannot read the rate {rate!r} (e.g. 400mbit, 1gbit)")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return int(value * 8 if m.group(3) == "bps" else value)


@dataclass(frozen=True)
class Fault:
    """A fault in force on a :class:`Cluster`: ``cut`` (packets from ``src`` to ``dst``, or to
    everyone when ``dst`` is None, dropped silently) or ``slow`` (``src``'s link shaped to
    ``rate`` both ways). Undo it with :meth:`Cluster.heal`."""

    id: int
    kind: str
    src: str
    dst: str | None
    rate: str | None = None
    prio: int = 0

    def __str__(self) -> str:
        if self.kind == "cut":
            return f"cut {self.src} -> {self.dst or 'everyone'}"
        return f"slow {self.src} to {self.rate}"


class Cluster:
    """An emulated cluster: a context manager that builds it on entry and tears it down on exit.

    Args:
        spec: ``{datacenter: [host, ...]}``, e.g. ``{"dc-a": ["a1", "a2"], "dc-b": ["b1"]}``;
            host names are unique across datacenters.
        prefix: the run's name prefix (default ``th`` + 4 random hex digits); 2-8 lowercase
            letters and digits starting with a letter.
        host_rate: every host's egress rate (a ``tc`` rate, e.g. ``"400mbit"``).
        inter_dc_rate: the rate of each inter-datacenter link, each direction.
        inter_dc_delay: the one-way delay of each inter-datacenter link, e.g. ``"20ms"`` (a
            round trip across costs twice that); None for none. It needs the kernel's netem
            qdisc (:func:`netem_available`).
        grace: seconds between SIGTERM and SIGKILL at teardown.
        priority_ports: TCP ports whose packets every shaped link sends first (a control-plane
            class of service, e.g. the server's port), so that they do not queue behind bulk
            transfers.

    Raises:
        ClusterError: a bad spec, or a command that failed while building (whatever was built
            is torn down first).
    """

    def __init__(
        self,
        spec: Mapping[str, Sequence[str]],
        prefix: str | None = None,
        *,
        host_rate: str = "400mbit",
        inter_dc_rate: str = "100mbit",
        inter_dc_delay: str | None = None,
        grace: float = 2.0,
        priority_ports: Sequence[int] = (),
    ) -> None:
        self.prefix = prefix if prefix is not None else "th" + secrets.token_hex(2)
        if not _PREFIX.match(self.prefix):
            raise ClusterError(f"prefix {self.prefix!r}: 2-8 lowercase letters/digits, starting with a letter")
        if not spec:
            raise ClusterError("a cluster needs at least one datacenter")
        if len(spec) > 250:
            raise ClusterError("at most 250 datacenters")
        self.spec = {dc: list(hosts) for dc, hosts in spec.items()}
        self.host_rate = host_rate
        self.inter_dc_rate = inter_dc_rate
        self.inter_dc_delay = inter_dc_delay
        self.priority_ports = tuple(int(p) for p in priority_ports)
        if any(not 0 < p < 65536 for p in self.priority_ports):
            raise ClusterError(f"priority_ports must be TCP ports, got {priority_ports!r}")
        self.grace = grace
        # the second octet from the prefix: concurrent runs get different subnets (cosmetic:
        # their namespaces are isolated anyway)
        self._net = 16 + int.from_bytes(self.prefix.encode(), "little") % 224
        self._hosts: dict[str, tuple[str, int, int]] = {}  # host -> (dc, dc index, host index)
        n = 0
        for d, (dc, hosts) in enumerate(self.spec.items(), start=1):
            if not dc or not hosts:
                raise ClusterError(f"datacenter {dc!r} needs a name and at least one host")
            if len(hosts) > 250:
                raise ClusterError(f"datacenter {dc!r}: at most 250 hosts")
            for i, host in enumerate(hosts, start=1):
                if not _NAME.match(host):
                    raise ClusterError(f"host name {host!r}: 1-40 letters, digits, '_', '.', '-'")
                if host in self._hosts:
                    raise ClusterError(f"host {host!r} appears twice")
                n += 1
                self._hosts[host] = (dc, d, i)
        self._index = {host: k for k, host in enumerate(self._hosts)}
        self._procs: list[Any] = []
        self._namespaces: list[str] = []
        self._faults: dict[int, Fault] = {}  # active faults by id
        self._fault_ids = 0
        self._prios: dict[str, list[int]] = {}  # device -> free fault filter priorities
        self._ingress: dict[str, int] = {}  # host -> slowdowns shaping the bridge side of its link
        self._active = False
        self._lock = threading.RLock()
        self._old_handlers: dict[int, Any] = {}

    # ---- names ---------------------------------------------------------------------------

    @property
    def switch(self) -> str:
        """The namespace holding the datacenter bridges."""
        return f"{self.prefix}-sw"

    @property
    def hosts(self) -> list[str]:
        return list(self._hosts)

    def namespace(self, host: str) -> str:
        """The network namespace of ``host``."""
        self._check_host(host)
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        """The IPv4 address of ``host`` (reachable from every other host)."""
        _, d, i = self._check_host(host)
        return f"10.{self._net}.{d}.{i}"

    def datacenter(self, host: str) -> str:
        return self._check_host(host)[0]

    def location(self, host: str) -> Any:
        """``Location(datacenter, host, "")`` for a worker on ``host``."""
        from tensorhub.core.topology import Location

        return Location(datacenter=self.datacenter(host), host=host, nic="")

    def _check_host(self, host: str) -> tuple[str, int, int]:
        try:
            return self._hosts[host]
        except KeyError:
            raise ClusterError(f"no host {host!r} in this cluster (hosts: {', '.join(self._hosts)})") from None

    # ---- building ------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        left = self.close()
        if left and exc_type is None:
            raise ClusterError(f"teardown of {self.prefix} left: {'; '.join(left)}")

    def start(self) -> None:
        """Build the cluster (what ``with`` does); on failure tear down what was built."""
        with self._lock:
            if self._active:
                raise ClusterError(f"cluster {self.prefix} is already started")
            self._active = True
            atexit.register(self.close)
            self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _ns_add(self, ns: str) -> None:
        self._namespaces.append(ns)  # before creating: a half-made namespace still gets deleted
        _cmd(["ip", "netns", "add", ns])

    def _ip(self, ns: str, *args: str) -> None:
        _cmd(["ip", "-n", ns, *args])

    def _tc(self, ns: str, *args: str) -> None:
        _cmd(["ip", "netns", "exec", ns, "tc", *args])

    def _build(self) -> None:
        p, sw = self.prefix, self.switch
        self._ns_add(sw)
        self._ip(sw, "link", "set", "lo", "up")
        for d, _dc in enumerate(self.spec, start=1):
            br = f"{p}b{d}"
            self._ip(sw, "link", "add", br, "type", "bridge")
            self._ip(sw, "link", "set", br, "up")
        # inter-datacenter links: a star around the first datacenter
        for d in range(2, len(self.spec) + 1):
            a, b = f"{p}x{d}a", f"{p}x{d}b"
            self._ip(sw, "link", "add", a, "type", "veth", "peer", "name", b)
            for end, br in ((a, f"{p}b1"), (b, f"{p}b{d}")):
                self._ip(sw, "link", "set", end, "master", br)
                self._ip(sw, "link", "set", end, "up")
                for args in _htb(end, self.inter_dc_rate, self.priority_ports):
                    self._tc(sw, *args)
                if self.inter_dc_delay:
                    self._add_delay(end)
        for host, (_dc, d, _i) in self._hosts.items():
            ns, n = self.namespace(host), self._index[host]
            h, s = f"{p}h{n}", f"{p}s{n}"
            self._ns_add(ns)
            self._ip(ns, "link", "set", "lo", "up")
            _cmd(["ip", "link", "add", h, "netns", ns, "type", "veth", "peer", "name", s, "netns", sw])
            self._ip(sw, "link", "set", s, "master", f"{p}b{d}")
            self._ip(sw, "link", "set", s, "up")
            self._ip(ns, "addr", "add", f"{self.address(host)}/16", "dev", h)
            self._ip(ns, "link", "set", h, "up")
            for args in _htb(h, self.host_rate, self.priority_ports):
                self._tc(ns, *args)
            # the class a cut sends packets to: a blackhole (drops silently, no error to anyone)
            self._tc(ns, "class", "add", "dev", h, "parent", "1:", "classid", _DROP, "htb", "rate", "8kbit")
            self._tc(ns, "qdisc", "add", "dev", h, "parent", _DROP, "handle", "66:", "blackhole")
        self._wait_links_up()

    def _add_delay(self, dev: str) -> None:
        try:
            for cls in ("10", "5") if self.priority_ports else ("10",):  # the control class is delayed too
                self._tc(self.switch, "qdisc", "add", "dev", dev, "parent", f"1:{cls}", "handle", f"{cls}:",
                         "netem", "delay", str(self.inter_dc_delay), "limit", "10000")  # fmt: skip
        except ClusterError as err:
            if "unknown" not in str(err).lower():
                raise
            raise ClusterError(
                f"inter_dc_delay={self.inter_dc_delay!r} needs the netem qdisc, which this kernel lacks "
                f"(sch_netem); build the cluster with inter_dc_delay=None: {err}"
            ) from err

    def _wait_links_up(self, timeout: float = 10.0) -> None:
        """Wait until every veth in the switch namespace is up (both ends of each pair are)."""
        deadline = time.monotonic() + timeout
        while True:
            out = _cmd(["ip", "-n", self.switch, "-o", "link", "show", "type", "veth"])
            lines = out.splitlines()
            if lines and all("state UP" in line for line in lines):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"the links of {self.prefix} did not come up within {timeout:.0f} s: {out}")
            time.sleep(0.05)

    # ---- faults --------------------------------------------------------------------------

    def cut(self, src: str, dst: str | None = None) -> Fault:
        """Drop silently every packet ``src`` sends to ``dst`` (None: to every other host):
        a one-way cut (``dst`` still reaches ``src``; TCP on ``src`` retransmits into the void,
        nobody gets a reset). Cut both ways with two calls. Undo with :meth:`heal`.

        Raises:
            ClusterError: an unknown host, or ``tc`` failed.
        """
        self._check_host(src)
        match = ["match", "ip", "dst", f"{self.address(dst)}/32"] if dst is not None else ["match", "u32", "0", "0"]
        dev, ns = self._host_dev(src), self.namespace(src)
        prio = self._take_prio(dev)
        try:
            self._tc(ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", str(prio), "u32", *match,
                     "flowid", _DROP)  # fmt: skip
        except BaseException:
            self._prios[dev].append(prio)
            raise
        return self._add_fault(Fault(0, "cut", src, dst, prio=prio))

    def isolate(self, host: str) -> list[Fault]:
        """Cut ``host`` off from everyone, both ways (its packets and everyone's to it)."""
        faults = [self.cut(host)]
        faults += [self.cut(other, host) for other in self.hosts if other != host]
        return faults

    def slow(self, host: str, rate: str) -> Fault:
        """Shape ``host``'s link to ``rate`` both ways (e.g. a NIC at a tenth of its speed);
        :meth:`heal` gives it back its rate.

        Raises:
            ClusterError: an unknown host, a bad rate, or ``tc`` failed.
        """
        self._check_host(host)
        _rate_bits(rate)
        n = self._index[host]
        if any(f.kind == "slow" and f.src == host for f in self._faults.values()):
            raise ClusterError(f"host {host!r} is already slowed; heal it first")
        for args in _htb_rates(self._host_dev(host), rate, self.priority_ports):
            self._tc(self.namespace(host), *args)
        bridge_side = f"{self.prefix}s{n}"
        for args in _htb(bridge_side, rate, self.priority_ports):  # the control plane ahead of bulk, as on the host side
            self._tc(self.switch, *args)
        return self._add_fault(Fault(0, "slow", host, None, rate=rate))

    def heal(self, fault: Fault | None = None) -> None:
        """Undo one fault (None: every active fault). Idempotent."""
        faults = [fault] if fault is not None else list(self._faults.values())
        for f in faults:
            if self._faults.pop(f.id, None) is None:
                continue
            if f.kind == "cut":
                dev = self._host_dev(f.src)
                _cmd(["ip", "netns", "exec", self.namespace(f.src), "tc", "filter", "del", "dev", dev, "parent", "1:",
                      "prio", str(f.prio)], check=False)  # fmt: skip
                self._prios[dev].append(f.prio)
            elif f.kind == "slow":
                for args in _htb_rates(self._host_dev(f.src), self.host_rate, self.priority_ports):
                    self._tc(self.namespace(f.src), *args)
                _cmd(["ip", "netns", "exec", self.switch, "tc", "qdisc", "del", "dev",
                      f"{self.prefix}s{self._index[f.src]}", "root"], check=False)  # fmt: skip

    @property
    def faults(self) -> list[Fault]:
        """The faults in force, oldest first."""
        return list(self._faults.values())

    def _host_dev(self, host: str) -> str:
        return f"{self.prefix}h{self._index[host]}"

    def _take_prio(self, dev: str) -> int:
        free = self._prios.setdefault(dev, list(range(_PRIO_PORTS - 1, 0, -1)))
        if not free:
            raise ClusterError(f"too many cuts on {dev} at once (at most {_PRIO_PORTS - 1})")
        return free.pop()

    def _add_fault(self, f: Fault) -> Fault:
        self._fault_ids += 1
        f = Fault(self._fault_ids, f.kind, f.src, f.dst, f.rate, f.prio)
        self._faults[f.id] = f
        return f

    # ---- processes -----------------------------------------------------------------------

    def run(self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None, **popen_kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace, in a process group of its own.

        Args:
            host: a host of this cluster.
            argv: the command.
            env: variables added to (and overriding) this process's environment.
            popen_kw: more :class:`subprocess.Popen` arguments (``stdout``, ``text``...).

        Returns:
            the Popen; teardown kills it (and its process group) if it still runs.

        Raises:
            ClusterError: the cluster is not active, or the host does not exist.
        """
        ns = self.namespace(host)
        with self._lock:
            if not self._active:
                raise ClusterError(f"cluster {self.prefix} is not active")
            full_env = dict(os.environ)
            full_env.update(env or {})
            full_env[MARKER] = self.prefix
            popen_kw.setdefault("start_new_session", True)
            proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=full_env, **popen_kw)
            self._procs.append(proc)
            return proc

    def fork(self, host: str, target: str, argv: Sequence[str], log: str | Path, env: Mapping[str, str] | None = None,
             cwd: str | Path = ROOT) -> Any:  # fmt: skip
        """Like :meth:`run` for a Python function, without a Python start and a torch import per
        process: ``target`` (``"module:function"``, given ``argv``, returning the exit status) runs
        in a child of a fork server that imported them once (``benchmarks/netns_fork.py``), inside
        ``host``'s namespace, in a session of its own, stdin and stdout piped, stderr appended to
        ``log``.

        Returns:
            a :class:`~benchmarks.netns_fork.ForkedProcess` (``pid``, ``stdin``, ``stdout``,
            ``poll``, ``wait``); teardown kills it as it kills what :meth:`run` started.
        """
        from benchmarks import netns_fork

        ns = self.namespace(host)
        with self._lock:
            if not self._active:
                raise ClusterError(f"cluster {self.prefix} is not active")
            full_env = {**os.environ, **(env or {}), MARKER: self.prefix}
            proc = netns_fork.start(ns, target, argv, full_env, str(cwd), str(log))
            self._procs.append(proc)
            return proc

    # ---- teardown ------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Tear everything down (idempotent, never raises for a failed step).

        Returns:
            :func:`leftovers` after teardown: empty when everything is gone.
        """
        with self._lock:
            if not self._active:
                return []
            self._active = False
            self._faults.clear()  # they go with the namespaces
            self._restore_signal_handlers()
            atexit.unregister(self.close)
            self._kill_processes()
            for ns in reversed(self._namespaces):
                _cmd(["ip", "netns", "del", ns], check=False)
            self._namespaces.clear()
            for _ in range(50):  # namespaces die when their last process and reference go
                left = leftovers(self.prefix)
                if not left:
                    return []
                time.sleep(0.1)
            return left

    def _kill_processes(self) -> None:
        groups = set()
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    groups.add(os.getpgid(proc.pid))
                except ProcessLookupError:
                    pass
        own = os.getpgrp()
        groups.discard(own)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pgid in groups:
                try:
                    os.killpg(pgid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + (self.grace if sig == signal.SIGTERM else 5.0)
            while time.monotonic() < deadline and any(p.poll() is None for p in self._procs):
                time.sleep(0.02)
        # whatever escaped its group: anything inside our namespaces or marked with our prefix
        stray = set(_marked_pids(self.prefix))
        for ns in self._namespaces:
            stray.update(_netns_pids(ns))
        stray.discard(os.getpid())
        for pid in stray:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self._procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(_netns_pids(ns) for ns in self._namespaces):
            time.sleep(0.05)
        self._procs.clear()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit still holds
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):  # not the main thread / a handler set from C
                pass
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        self.close()  # restores the old handlers
        if callable(old):
            old(signum, frame)  # SIGINT's default raises KeyboardInterrupt
        elif old == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


# ---- checks shared by the CLI and the tests ------------------------------------------------------

_SERVER = r"""
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(1)
s.settimeout(float(sys.argv[2]))
print("ready", flush=True)
c, _ = s.accept()
c.settimeout(float(sys.argv[2]))
t0 = time.monotonic()
n = 0
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    n += len(b)
dt = time.monotonic() - t0
c.sendall(b"k")
c.close()
print(n, dt, flush=True)
"""

_CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
n = int(sys.argv[3])
buf = b"x" * min(n, 1 << 20)
left = n
while left > 0:
    k = min(left, len(buf))
    c.sendall(buf[:k])
    left -= k
c.shutdown(socket.SHUT_WR)
assert c.recv(1) == b"k"
print("sent", n, flush=True)
"""


def measure_throughput(cluster: Cluster, src: str, dst: str, nbytes: int, timeout: float = 20.0, port: int = 5201) -> float:
    """Send ``nbytes`` over TCP from ``src`` to ``dst``; return the receiver's rate in bits/s
    (from accept to end of stream). ``nbytes=1`` makes it a connectivity check.

    Raises:
        ClusterError: either side failed or ran past ``timeout``.
    """
    server = cluster.run(dst, [sys.executable, "-c", _SERVER, str(port), str(timeout)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        import select

        deadline = time.monotonic() + timeout
        assert server.stdout is not None
        ready = ""
        while time.monotonic() < deadline and server.poll() is None:
            r, _, _ = select.select([server.stdout], [], [], 0.1)
            if r:
                ready = server.stdout.readline()
                break
        if ready.strip() != "ready":
            raise ClusterError(f"the test server on {dst} did not start: {ready!r} {_stderr(server)}")
        client = cluster.run(src, [sys.executable, "-c", _CLIENT, cluster.address(dst), str(port), str(nbytes), str(timeout)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            _, cerr = client.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            client.kill()
            raise ClusterError(f"sending {nbytes} bytes {src} -> {dst} ran past {timeout} s") from None
        if client.returncode != 0:
            raise ClusterError(f"the client on {src} failed: {cerr[-1000:]}")
        try:
            out, serr = server.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise ClusterError(f"the test server on {dst} ran past {timeout} s") from None
        if server.returncode != 0:
            raise ClusterError(f"the test server on {dst} failed: {serr[-1000:]}")
        got, seconds = out.split()
        if int(got) != nbytes:
            raise ClusterError(f"{dst} received {got} bytes of {nbytes}")
        return nbytes * 8 / max(float(seconds), 1e-9)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(5)


def _stderr(proc: subprocess.Popen) -> str:
    if proc.poll() is None or proc.stderr is None:
        return ""
    return proc.stderr.read()[-1000:]


def tcp_check(cluster: Cluster, src: str, dst: str, timeout: float = 10.0) -> None:
    """A TCP connection from ``src`` to ``dst`` carries a byte and its answer (raises otherwise)."""
    measure_throughput(cluster, src, dst, 1, timeout)


def _check(args: argparse.Namespace) -> int:
    spec = {"dc-a": ["a1", "a2"], "dc-b": ["b1", "b2"]}
    nbytes = int(args.mbytes * 1e6)
    with Cluster(spec, host_rate=args.host_rate, inter_dc_rate=args.inter_rate, inter_dc_delay=args.delay or None) as c:
        prefix = c.prefix
        print(f"cluster {prefix}: " + ", ".join(f"{h}={c.address(h)} ({c.datacenter(h)})" for h in c.hosts))
        for src, dst in (("a1", "a2"), ("a1", "b1"), ("b2", "a2")):
            tcp_check(c, src, dst)
            print(f"tcp {src} -> {dst}: ok")
        intra = measure_throughput(c, "a1", "a2", nbytes)
        inter = measure_throughput(c, "a1", "b1", nbytes)
        back = measure_throughput(c, "b1", "a1", nbytes)
        print(f"intra-DC a1 -> a2: {intra / 1e6:.0f} Mbit/s (host egress {args.host_rate})")
        print(f"inter-DC a1 -> b1: {inter / 1e6:.0f} Mbit/s, b1 -> a1: {back / 1e6:.0f} Mbit/s "
              f"(link {args.inter_rate}, {args.delay or 'no'} delay each way)")  # fmt: skip
    left = leftovers(prefix)
    print(f"teardown: {'clean' if not left else 'LEFT ' + '; '.join(left)}")
    ok = not left and ratio(inter, intra) < 0.6 and ratio(back, intra) < 0.6
    print("check: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="build a 2-DC cluster, check it, tear it down")
    parser.add_argument("--leftovers", metavar="PREFIX", help="list what a run with PREFIX left behind")
    parser.add_argument("--host-rate", default="400mbit")
    parser.add_argument("--inter-rate", default="50mbit")
    parser.add_argument("--delay", default=None, help="one-way inter-datacenter delay, e.g. 10ms (needs netem; "
                        "default: 10ms where the kernel has netem, else none)")
    parser.add_argument("--mbytes", type=float, default=4.0, help="bytes per throughput measurement (MB)")
    parser.add_argument("--cleanup", metavar="PREFIX", help="remove what a run with PREFIX left behind")
    args = parser.parse_args(argv)
    if args.cleanup:
        left = cleanup(args.cleanup)
        print("\n".join(left) or "clean")
        return 1 if left else 0
    if args.leftovers:
        left = leftovers(args.leftovers)
        print("\n".join(left) or "nothing")
        return 1 if left else 0
    if not args.check:
        parser.print_help()
        return 2
    reason = available()
    if reason:
        print(f"cannot build an emulated cluster here: {reason}", file=sys.stderr)
        return 2
    if args.delay is None:
        args.delay = "10ms" if netem_available() else ""
    return _check(args)


if __name__ == "__main__":
    sys.exit(main())
