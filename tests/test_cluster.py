"""The emulated cluster (benchmarks/cluster.py): hosts reach each other within and across
datacenters, the inter-datacenter link is the slow one, and teardown leaves nothing behind
(after a normal exit, an exception inside the ``with``, and with processes still running)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.cluster import (
    Cluster,
    ClusterError,
    available,
    cleanup,
    leftovers,
    measure_throughput,
    netem_available,
    tcp_check,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

_REASON = available()
if _REASON:
    pytestmark.append(pytest.mark.skip(reason=f"no emulated cluster here: {_REASON}"))

SPEC = {"dc-a": ["a1", "a2"], "dc-b": ["b1", "b2"]}
MB = 1_000_000


@pytest.fixture(scope="module")
def cluster():
    with Cluster(SPEC, host_rate="400mbit", inter_dc_rate="50mbit") as c:
        yield c
    assert leftovers(c.prefix) == []


def test_names_addresses_locations(cluster: Cluster) -> None:
    assert cluster.prefix.startswith("th") and len(cluster.prefix) == 6
    addresses = {cluster.address(h) for h in cluster.hosts}
    assert len(addresses) == 4
    assert cluster.location("b2").datacenter == "dc-b" and cluster.location("b2").host == "b2"
    assert cluster.location("a1").nic == ""
    with pytest.raises(ClusterError, match="no host 'zz'"):
        cluster.address("zz")
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True, timeout=10).stdout
    assert all(cluster.namespace(h) in out for h in cluster.hosts)


@pytest.mark.parametrize(("src", "dst"), [("a1", "a2"), ("a2", "b1"), ("b2", "a1"), ("b1", "b2")])
def test_tcp_within_and_across_datacenters(cluster: Cluster, src: str, dst: str) -> None:
    tcp_check(cluster, src, dst, timeout=10)


def test_inter_datacenter_link_is_slower(cluster: Cluster) -> None:
    intra = measure_throughput(cluster, "a1", "a2", 4 * MB, timeout=15)
    inter = measure_throughput(cluster, "a1", "b1", 2 * MB, timeout=15)
    back = measure_throughput(cluster, "b2", "a2", 2 * MB, timeout=15)
    print(f"intra {intra / 1e6:.0f} Mbit/s, inter {inter / 1e6:.0f} / {back / 1e6:.0f} Mbit/s")
    assert inter < 0.6 * intra and back < 0.6 * intra, (intra, inter, back)
    assert inter < 60e6 and back < 60e6  # the 50mbit link shapes both directions


def probe(argv: list[str]) -> int:
    """A forked process's view (``Cluster.fork``): prints what it sees, exits with the status read
    from stdin."""
    print(json.dumps({
        "argv": argv, "netns": os.stat("/proc/self/ns/net").st_ino, "sys": sorted(os.listdir("/sys/class/net")),
        "links": sorted(name for _, name in socket.if_nameindex()), "env": os.environ.get("PROBE"), "cwd": os.getcwd(),
        "group": os.getpgid(0) == os.getpid(), "ppid": os.getppid(),
    }))  # fmt: skip
    print("to the log", file=sys.stderr)
    return int(sys.stdin.readline())


def test_a_forked_process_runs_in_its_host_namespace_as_a_popen_would(cluster: Cluster, tmp_path: Path) -> None:
    """``Cluster.fork`` does what ``ip netns exec`` does (network and sysfs of the host, a session
    of its own, the environment and directory given) and reports its exit like a Popen."""
    log = tmp_path / "probe.log"
    proc = cluster.fork("a2", "tests.test_cluster:probe", ["x", "y"], log, env={"PROBE": "yes"}, cwd=tmp_path)
    assert proc.stdout is not None and proc.stdin is not None
    seen = json.loads(proc.stdout.readline())
    ns = cluster.namespace("a2")
    want = subprocess.run(["ip", "netns", "exec", ns, "ls", "/sys/class/net"], check=True, capture_output=True,
                          text=True, timeout=10).stdout.split()  # fmt: skip
    inode = int(subprocess.run(["ip", "netns", "exec", ns, "stat", "-Lc", "%i", "/proc/self/ns/net"], check=True,
                               capture_output=True, text=True, timeout=10).stdout)  # fmt: skip
    assert seen["netns"] == inode != os.stat("/proc/self/ns/net").st_ino
    assert seen["sys"] == sorted(want) == seen["links"]
    assert (seen["argv"], seen["env"], seen["cwd"], seen["group"]) == (["x", "y"], "yes", str(tmp_path), True)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.1)
    proc.stdin.write("3\n")
    proc.stdin.flush()
    assert proc.wait(30) == 3 == proc.returncode
    assert "to the log" in log.read_text()

    killed = cluster.fork("a1", "tests.test_cluster:probe", [], tmp_path / "killed.log")
    assert killed.stdout is not None and json.loads(killed.stdout.readline())["env"] is None
    os.killpg(killed.pid, signal.SIGKILL)
    assert killed.wait(30) == -signal.SIGKILL

    with pytest.raises(ValueError, match="TENSORHUB_SPANS is read when tensorhub is imported"):
        cluster.fork("a1", "tests.test_cluster:probe", [], log, env={"TENSORHUB_SPANS": "0"})


def test_processes_killed_and_everything_removed_at_teardown() -> None:
    with Cluster({"x": ["x1"], "y": ["y1"]}) as c:
        # one process ignores SIGTERM and has a child in its group: SIGKILL after the grace period
        code = (
            "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
        )
        stubborn = c.run("x1", [sys.executable, "-c", code])
        polite = c.run("y1", ["sleep", "600"])
        time.sleep(0.3)
        assert stubborn.poll() is None and polite.poll() is None
        assert any(line.startswith("process") for line in leftovers(c.prefix))
        c.grace = 0.5
    assert stubborn.poll() is not None and polite.poll() is not None
    assert leftovers(c.prefix) == []


def test_exception_inside_with_tears_down() -> None:
    with pytest.raises(RuntimeError, match="boom"), Cluster({"x": ["x1", "x2"]}) as c:
        proc = c.run("x2", ["sleep", "600"])
        raise RuntimeError("boom")
    assert proc.poll() is not None
    assert leftovers(c.prefix) == []
    with pytest.raises(ClusterError, match="not active"):
        c.run("x1", ["true"])


def test_failed_build_tears_down_and_names_the_command() -> None:
    c = Cluster({"x": ["x1"], "y": ["y1"]}, host_rate="fast")
    with pytest.raises(ClusterError, match=r"`ip netns exec th\w+-x1 tc class add .*fast"), c:
        pass
    assert leftovers(c.prefix) == []


def test_signal_handlers_installed_and_restored() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with Cluster({"x": ["x1"]}) as c:
        assert signal.getsignal(signal.SIGTERM) == c._on_signal
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_sigterm_to_a_script_tears_down() -> None:
    script = (
        "import sys, time\nfrom benchmarks.cluster import Cluster\n"
        "with Cluster({'x': ['x1']}) as c:\n"
        "    c.run('x1', ['sleep', '600'])\n"
        "    print(c.prefix, flush=True)\n"
        "    time.sleep(60)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        prefix = proc.stdout.readline().strip() if proc.stdout else ""
        assert prefix.startswith("th"), prefix
        assert leftovers(prefix)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        if proc.stdout:
            proc.stdout.close()
    assert leftovers(prefix) == []


@pytest.mark.skipif(not _REASON and not netem_available(), reason="this kernel has no netem qdisc (sch_netem)")
def test_inter_datacenter_delay() -> None:
    with Cluster({"x": ["x1"], "y": ["y1"]}, inter_dc_delay="20ms") as c:
        out = subprocess.run(["ip", "netns", "exec", c.namespace("x1"), "ping", "-c", "3", "-i", "0.2", "-W", "2",
                              c.address("y1")], capture_output=True, text=True, timeout=15, check=True).stdout  # fmt: skip
        avg = float(out.rsplit("=", 1)[1].split("/")[1])
        assert 35 < avg < 200, out


def test_cleanup_after_a_run_killed_outright() -> None:
    """A SIGKILLed run cannot tear down (no atexit): leftovers() sees it, cleanup() removes it."""
    script = (
        "import time\nfrom benchmarks.cluster import Cluster\n"
        "c = Cluster({'x': ['x1'], 'y': ['y1']}).__enter__()\n"
        "c.run('x1', ['sleep', '600'])\n"
        "print(c.prefix, flush=True)\n"
        "time.sleep(60)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, text=True)
    prefix = ""
    try:
        prefix = proc.stdout.readline().strip() if proc.stdout else ""
        assert prefix.startswith("th"), prefix
        proc.kill()
        proc.wait(10)
        left = leftovers(prefix)
        assert any(x.startswith("netns") for x in left) and any(x.startswith("process") for x in left), left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        if proc.stdout:
            proc.stdout.close()
        if prefix:
            assert cleanup(prefix) == []


def test_priority_ports_get_a_class_served_first() -> None:
    from benchmarks.cluster import _htb, _rate_bits

    assert _rate_bits("400mbit") == 400_000_000 and _rate_bits("50mbps") == 400_000_000
    with pytest.raises(ClusterError, match="cannot read the rate"):
        _rate_bits("fast")
    plain = _htb("v0", "100mbit")
    assert len(plain) == 2 and plain[1][-4:] == ["rate", "100mbit", "ceil", "100mbit"]
    cmds = [" ".join(c) for c in _htb("v0", "100mbit", (5557,))]
    assert "class add dev v0 parent 1:1 classid 1:5 htb rate 10000000bit ceil 100mbit prio 0" in cmds
    assert any("match ip dport 5557 0xffff flowid 1:5" in c for c in cmds)
    assert any("match ip sport 5557 0xffff flowid 1:5" in c for c in cmds)
    with pytest.raises(ClusterError, match="priority_ports"):
        Cluster(SPEC, priority_ports=(0,))
