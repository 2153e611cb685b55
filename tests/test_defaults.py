"""A new user's first try runs on the fastest path: the default transport set, the probes it is
decided from, and ``tensorhub doctor``, which says the same.

- every built-in transport's probe says whether it can run here and whether it is a default,
  with a reason; ``local`` follows Yama's ptrace scope, ``nixl`` needs an RDMA device to be a
  default (NIXL over UCX without one is slower than ``tcp``), ``tcp`` always is;
- a handle opened with no ``transports=`` and no ``$TENSORHUB_TRANSPORTS`` starts the defaults,
  and a same-host replicate then runs over ``local``; ``$TENSORHUB_TRANSPORTS`` still overrides,
  and an edge the defaults cannot serve falls back to ``tcp``;
- ``tensorhub doctor`` reports the same set, the server and CURVE, and never crashes on a bad
  setting (it reports it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from tensorhub.handles.api import default_transports
from tensorhub.tools.cli import main as cli_main
from tensorhub.transports import local, nic
from tensorhub.transports.base import Probe, Transport
from tensorhub.transports.registry import BUILTIN_ORDER, get_transport, probe_builtins

from .procs import ServerProcess
from .test_integrity import SCALE, publish_and_wait_checksums


def test_every_builtin_has_a_probe_with_a_reason():
    probes = probe_builtins()
    assert list(probes) == list(BUILTIN_ORDER)
    for name, p in probes.items():
        assert isinstance(p, Probe) and p.reason, name
        assert p.usable or not p.default, name
    assert probes["tcp"].default and probes["tcp"].usable
    assert not probes["memory"].default and probes["memory"].usable  # in-process only
    assert not probes["rdma_copy"].default  # staging pools: opt-in


def test_a_probe_cannot_be_a_default_that_does_not_run():
    with pytest.raises(ValueError, match="not usable"):
        Probe(usable=False, default=True, reason="x")


@pytest.mark.parametrize(
    ("scope", "cap", "usable"),
    [(None, False, True), (0, False, True), (1, False, True), (2, False, False), (2, True, True), (3, True, False)],
)
def test_local_follows_the_ptrace_scope(monkeypatch, scope, cap, usable):
    monkeypatch.setattr(local, "ptrace_scope", lambda: scope)
    monkeypatch.setattr(local, "_has_cap_sys_ptrace", lambda: cap)
    p = local.LocalTransport.probe()
    assert (p.usable, p.default) == (usable, usable), p
    assert dict(p.facts)["yama ptrace_scope"] == ("absent (no Yama)" if scope is None else str(scope))
    if not usable:
        assert f"ptrace_scope {scope}" in p.reason


def test_local_is_refused_when_the_system_call_is_filtered(monkeypatch):
    import errno

    def refused(*a):
        raise local._VmError(errno.EPERM)

    monkeypatch.setattr(local, "_vm_read", refused)
    p = local.LocalTransport.probe()
    assert not p.usable and "seccomp" in p.reason and dict(p.facts)["self read"] == os.strerror(errno.EPERM)


def test_nixl_is_a_default_only_with_an_rdma_device(monkeypatch):
    nixl_cls = get_transport("nixl")
    if not nixl_cls.available():
        p = nixl_cls.probe()
        assert not p.usable and "does not import" in p.reason
        return
    monkeypatch.setattr(nic, "rdma_nics", lambda *a, **k: {})
    p = nixl_cls.probe()
    assert p.usable and not p.default and "no RDMA device" in p.reason
    monkeypatch.setattr(nic, "rdma_nics", lambda *a, **k: {"mlx5_0": "0000:3b:00.0"})
    p = nixl_cls.probe()
    assert p.usable and p.default and dict(p.facts)["RDMA devices"] == "mlx5_0"


def test_a_plugin_probe_that_raises_is_unusable_not_fatal():
    class Broken(Transport):
        name = "broken"

        @classmethod
        def available(cls) -> bool:
            raise RuntimeError("driver exploded")

    p = Broken.probe()
    assert not p.usable and not p.default and "RuntimeError: driver exploded" in p.reason


def test_the_default_set_is_every_default_builtin_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv("TENSORHUB_TRANSPORTS", raising=False)
    want = [n for n, p in probe_builtins().items() if p.default]
    assert list(default_transports()) == want
    assert "tcp" in want
    assert ("local" in want) == local.LocalTransport.probe().default
    monkeypatch.setenv("TENSORHUB_TRANSPORTS", " tcp , memory,")
    assert default_transports() == {"tcp": {}, "memory": {}}


@pytest.mark.integration
def test_a_new_users_same_host_replicate_takes_the_fast_path(inproc_server, handles):
    """No transports=, no environment: the holder and the reader start the defaults, and the
    same-host edge runs over local; a reader limited to tcp falls back to it."""
    if not local.LocalTransport.probe().default:
        pytest.skip(f"local is not a default here: {local.LocalTransport.probe().reason}")
    srv = inproc_server
    bare = {"TENSORHUB_TRANSPORTS": None}
    trainer = handles("trainer", server=srv.address, scale=SCALE, env=bare)
    reader = handles("rollout-0", server=srv.address, scale=SCALE, env=bare)
    for h in (trainer, reader):
        h.call("register")
    assert trainer.call("packs") == "in place"  # local and tcp both gather: no pack copies
    publish_and_wait_checksums(srv, trainer, 1)
    assert reader.call("replicate", 1, 60.0) == 1
    assert reader.call("holds", 1)
    assert reader.call("last_transports") == ["local"]
    narrow = handles("rollout-1", server=srv.address, scale=SCALE, env={"TENSORHUB_TRANSPORTS": "tcp"})
    narrow.call("register")
    assert narrow.call("replicate", 1, 60.0) == 1
    assert narrow.call("holds", 1)
    assert narrow.call("last_transports") == ["tcp"]


def _doctor(*args: str, env: dict[str, str | None] | None = None, process: bool = False) -> subprocess.CompletedProcess:
    """``tensorhub doctor ARGS`` with ``env`` changed (None: unset): as its own process when
    ``process``, else through the CLI's ``main`` in this process (the same code, without the
    seconds a fresh process spends importing torch; the environment is put back after)."""
    full = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    if process:
        return subprocess.run([sys.executable, "-m", "tensorhub", "doctor", *args], capture_output=True, text=True,
                              timeout=120, env=full)  # fmt: skip
    saved = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(full)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli_main(["doctor", *args])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["tensorhub", "doctor", *args], rc, out.getvalue(), err.getvalue())


@pytest.mark.integration
def test_doctor_reports_the_transports_the_server_and_curve():
    server = ServerProcess()
    try:
        proc = _doctor("--json", "--server", server.address, "--timeout", "5", env={"TENSORHUB_TRANSPORTS": None})
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["would_start"] == [n for n, p in probe_builtins().items() if p.default]
        assert set(doc["transports"]) >= set(BUILTIN_ORDER)
        assert doc["transports"]["local"]["facts"]["yama ptrace_scope"]
        assert doc["server"]["reachable"] is True and doc["server"]["address"] == server.address
        assert doc["server"]["curve"]["needed"] is False
        assert doc["preference"]["host"][0] == "local"
        assert doc["huge_pages"]["transparent"]
        text = _doctor("--server", server.address, "--timeout", "5", process=True).stdout  # the command itself
        assert "a handle with no transports= starts:" in text and "answering now: yes" in text
    finally:
        server.stop()


@pytest.mark.integration
def test_doctor_reports_bad_settings_instead_of_failing():
    proc = _doctor("--json", "--server", "tcp://127.0.0.1:1", "--timeout", "0.2", env={
        "TENSORHUB_TRANSPORTS": "tcp,nonesuch",
        "TENSORHUB_TRANSPORT_PREFERENCE": "host=",
        "TENSORHUB_CURVE_SERVER_KEY": "/nonexistent.key",
        "TENSORHUB_CURVE_SECRET": None,
    })  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["would_start"] == ["tcp"] and "nonesuch" in doc["would_start_why"]
    assert doc["preference"] is None and "invalid" in doc["preference_source"]
    assert doc["server"]["reachable"] is False
    assert doc["server"]["curve"]["status"].startswith("broken:") and "TENSORHUB_CURVE_SECRET" in doc["server"]["curve"]["status"]
    bad = _doctor("--json", "--server", "not-an-address")
    assert bad.returncode == 0 and json.loads(bad.stdout)["server"]["address"] is None


@pytest.mark.integration
@pytest.mark.slow
def test_the_first_try_benchmark_runs_and_checks_its_bytes(tmp_path, capsys):
    """``benchmarks/bench_first_try.py`` on a tiny shard: it prints every row and the transport
    the unconfigured replicate used (figures are the script's business, not this test's)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "first.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TENSORHUB_TRANSPORTS", "TENSORHUB_SERVER")}
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "bench_first_try.py"), "--size-mib", "8", "--tensors", "8",
         "--rounds", "1", "--timeout", "120", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in ("memcpy (1 thread)", "raw TCP socket", "replicate, no configuration", "replicate, tcp only"):
        assert row in proc.stdout, proc.stdout
    doc = json.loads(out.read_text())
    want = "local" if local.LocalTransport.probe().default else "tcp"
    assert doc["defaults"]["transports"] == [[want]] and doc["tcp_only"]["transports"] == [["tcp"]]
    from benchmarks.bench_first_try import main  # the script's own entry, in this process: it refuses before forking

    with pytest.raises(SystemExit) as bad:
        main(["--size-mib", "0"])
    assert bad.value.code == 2 and "--size-mib" in capsys.readouterr().err


@pytest.mark.integration
def test_a_second_handle_asking_for_other_transports_is_refused_not_ignored(inproc_server, monkeypatch):
    """One transfer engine per process: a second handle gets the transports it asks for (the
    same as the running ones) or a typed error naming both, never silently others."""
    import tensorhub
    from tensorhub.core.errors import InvalidArgument

    monkeypatch.delenv("TENSORHUB_TRANSPORTS", raising=False)
    first = tensorhub.open("two", "a", server=inproc_server.address, transports={"tcp": {}})
    try:
        same = tensorhub.open("two", "b", server=inproc_server.address, transports={"tcp": {}})
        same.close()
        inherit = tensorhub.open("two", "c", server=inproc_server.address)  # None: the process's
        inherit.close()
        with pytest.raises(InvalidArgument, match=r"already runs transports \['tcp'\].*asking for \{'local': \{\}\}"):
            tensorhub.open("two", "d", server=inproc_server.address, transports={"local": {}})
        with pytest.raises(InvalidArgument, match="must ask for the same ones"):
            tensorhub.open("two", "e", server=inproc_server.address, transports={"tcp": {"streams": 2}})
    finally:
        first.close()
    # every handle closed: the engine stopped, and a new one may start with another set
    again = tensorhub.open("two", "f", server=inproc_server.address, transports={"memory": {}, "tcp": {}})
    again.close()
