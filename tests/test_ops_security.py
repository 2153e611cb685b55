"""CURVE authentication, the loopback rule, session binding and keygen, against real server
processes (real ZeroMQ sockets on 127.0.0.1)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest
import torch
import zmq

import tensorhub
from tensorhub.core import errors as e
from tensorhub.core import messages as m
from tensorhub.core.layout import Layout, TensorSpec
from tensorhub.core.topology import Location
from tensorhub.core.wire import decode, encode
from tensorhub.runtime.metrics import parse_text, scrape
from tensorhub.runtime.security import (
    ClientKeys,
    check_bind,
    client_keys,
    is_loopback,
    keygen,
    load_public,
    load_secret,
)
from tensorhub.tools.admin import server_status

from .procs import ServerProcess

pytestmark = pytest.mark.integration

LAYOUT = Layout((TensorSpec("w", "float32", (4,), 16),), "xxh3-64", 1 << 20, 2 << 20)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    keygen(str(d), "server")
    keygen(str(d / "clients"), "alice")
    keygen(str(d / "clients"), "bob")
    keygen(str(d), "mallory")  # not in the allowed directory
    return d


@pytest.fixture(scope="module")
def server(keys):
    s = ServerProcess("--curve-secret", str(keys / "server.key_secret"), "--curve-clients", str(keys / "clients"),
                      "--metrics-port", "0")  # fmt: skip
    line = s.proc.stdout.readline()
    s.metrics_port = int(re.search(r":(\d+)/metrics", line).group(1))
    yield s
    assert s.alive(), f"the server died: {s.stderr()}"
    assert s.stop() == 0


def client(keys, name: str, where: str = "clients") -> ClientKeys:
    pub, sec = load_secret(str(keys / where / f"{name}.key_secret"))
    return ClientKeys(pub, sec, load_public(str(keys / "server.key")))


def test_client_keys_of_another_kind_are_refused():
    from tensorhub.runtime.client import ClientActor

    with pytest.raises(e.InvalidArgument, match="keys must be ClientKeys, None or 'env'"):
        ClientActor("tcp://127.0.0.1:1", None, None, keys="alice")


def test_keygen_files(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tensorhub", "keygen", "--dir", str(tmp_path), "--name", "w0"],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 0, out.stderr
    pub, sec = load_secret(str(tmp_path / "w0.key_secret"))
    assert load_public(str(tmp_path / "w0.key")) == pub and len(pub) == 40 and len(sec) == 40
    assert stat.S_IMODE(os.stat(tmp_path / "w0.key_secret").st_mode) == 0o600
    again = subprocess.run([sys.executable, "-m", "tensorhub", "keygen", "--dir", str(tmp_path), "--name", "w0"],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
    assert again.returncode == 2 and "exists already" in again.stderr
    with pytest.raises(e.InvalidArgument):
        keygen(str(tmp_path), "../escape")


@pytest.mark.parametrize("address, loopback", [
    ("tcp://127.0.0.1:5557", True), ("tcp://127.0.0.2:1", True), ("tcp://localhost:5557", True),
    ("tcp://[::1]:5557", True), ("ipc:///tmp/x", True), ("inproc://x", True),
    ("tcp://*:5557", False), ("tcp://0.0.0.0:5557", False), ("tcp://10.0.0.1:5557", False), ("tcp://eth0:5557", False),
])  # fmt: skip
def test_is_loopback(address, loopback):
    assert is_loopback(address) is loopback


def test_non_loopback_bind_needs_keys_or_insecure():
    with pytest.raises(e.InvalidArgument, match="--insecure"):
        check_bind("tcp://0.0.0.0:5557", None, insecure=False)
    check_bind("tcp://0.0.0.0:5557", None, insecure=True)
    check_bind("tcp://127.0.0.1:5557", None, insecure=False)
    # The command line refuses before binding anything.
    out = subprocess.run([sys.executable, "-m", "tensorhub", "server", "--bind", "tcp://0.0.0.0:1"],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 2
    assert "refusing to bind tcp://0.0.0.0:1 without authentication" in out.stderr


def test_half_configured_client_keys_are_refused(monkeypatch, keys):
    monkeypatch.setenv("TENSORHUB_CURVE_SERVER_KEY", str(keys / "server.key"))
    monkeypatch.delenv("TENSORHUB_CURVE_SECRET", raising=False)
    with pytest.raises(e.InvalidArgument, match="TENSORHUB_CURVE_SECRET"):
        client_keys()
    monkeypatch.setenv("TENSORHUB_CURVE_SECRET", str(keys / "server.key"))  # a public key only
    with pytest.raises(e.InvalidArgument, match="only a public key"):
        client_keys()


def test_authenticated_clients_work_and_others_are_refused(server, keys, monkeypatch):
    # An allowed key: full service (publish, replicate, the bytes arrive).
    monkeypatch.setenv("TENSORHUB_CURVE_SERVER_KEY", str(keys / "server.key"))
    monkeypatch.setenv("TENSORHUB_CURVE_SECRET", str(keys / "clients" / "alice.key_secret"))
    with tensorhub.open("auth", "trainer", server=server.address) as t, tensorhub.open("auth", "rollout", server=server.address) as r:
        src, dst = {"w": torch.arange(64, dtype=torch.float32)}, {"w": torch.zeros(64)}
        t.register(src)
        r.register(dst)
        t.publish(1)
        assert r.replicate(1, timeout=20) == 1
        assert torch.equal(src["w"], dst["w"])
    assert server_status(server.address, 5.0, client(keys, "alice")).counts["sessions"] == 0
    # No keys at all: the handshake never completes; a typed error, not a hang.
    monkeypatch.delenv("TENSORHUB_CURVE_SERVER_KEY")
    monkeypatch.delenv("TENSORHUB_CURVE_SECRET")
    with pytest.raises(e.ServerUnavailable):
        tensorhub.open("auth", "intruder", server=server.address, connect_timeout=1.0)
    with pytest.raises(e.ServerUnavailable):
        server_status(server.address, 1.0, None)
    # A well-formed key that is not allowed.
    with pytest.raises(e.ServerUnavailable):
        server_status(server.address, 1.0, client(keys, "mallory", where="."))
    monkeypatch.setenv("TENSORHUB_CURVE_SERVER_KEY", str(keys / "server.key"))
    monkeypatch.setenv("TENSORHUB_CURVE_SECRET", str(keys / "mallory.key_secret"))
    with pytest.raises(e.ServerUnavailable):
        tensorhub.open("auth", "intruder", server=server.address, connect_timeout=1.0)
    # The server counted what it refused.
    metrics = parse_text(scrape("127.0.0.1", server.metrics_port))
    auth = {dict(k)["result"]: v for k, v in metrics["tensorhub_auth_total"].items()}
    assert auth.get("denied: key not allowed", 0) >= 2, auth
    events = {dict(k)["event"]: v for k, v in metrics["tensorhub_connections_total"].items()}
    assert events.get("handshake_failed_protocol", 0) + events.get("handshake_failed_auth", 0) >= 1, events
    assert server.alive()


class Peer:
    def __init__(self, address: str, keys: ClientKeys) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        keys.apply(self.sock)
        self.sock.connect(address)

    def ask(self, msg):
        self.sock.send(encode(msg))
        assert self.sock.poll(5000), "no answer"
        return decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_sessions_are_bound_to_the_key_that_opened_them(server, keys):
    alice, bob = Peer(server.address, client(keys, "alice")), Peer(server.address, client(keys, "bob"))
    try:
        opened = alice.ask(m.OpenShard(1, "bound", "r0", 1, 0, "inc-a", Location.default(), False, None))
        assert isinstance(opened, m.Opened)
        sid = opened.session
        # Bob cannot announce transport endpoints (or anything else) for Alice's session...
        for msg in (m.Register(2, sid, LAYOUT, {"region": 1, "tcp": {"host": "127.0.0.1", "port": 9}}),
                    m.Heartbeat(3, (sid,)), m.CloseShard(4, sid), m.Announce(5, sid, (), None, 0, ())):  # fmt: skip
            reply = bob.ask(msg)
            assert isinstance(reply, m.Failed) and reply.code == "unknown_session", reply
            assert "another authenticated client" in reply.message
        # ... nor open a new incarnation of her shard (which would fence her).
        reply = bob.ask(m.OpenShard(6, "bound", "r0", 1, 0, "inc-b", Location.default(), False, None))
        assert isinstance(reply, m.Failed) and reply.code == "contract_violation", reply
        # Alice's session is untouched: she registers her endpoint and closes.
        assert isinstance(alice.ask(m.Register(7, sid, LAYOUT, {"region": 1})), m.Ack)
        assert isinstance(alice.ask(m.CloseShard(8, sid)), m.Ack)
    finally:
        alice.close()
        bob.close()


# ---- issue 36 (3): authorization by model ----------------------------------------------------------

POLICY = """
[[rule]]
models = ["actor", "actor-*"]
publish = ["alice"]
read = ["bob"]

[[rule]]
models = "open-*"
read = "*"
"""


def test_model_policy_rules(keys):
    from tensorhub.runtime.security import ModelPolicy, _key_names

    names = _key_names(str(keys / "clients"))
    alice, bob = names["alice"], names["bob"]
    p = ModelPolicy.parse(POLICY, names)
    assert p.allows(alice, "actor", "publish") and p.allows(alice, "actor", "read")  # publishing implies reading
    assert not p.allows(bob, "actor", "publish") and p.allows(bob, "actor-7", "read")
    assert p.allows(alice, "actor@delta", "publish") and not p.allows(bob, "actor@delta", "publish")  # m@delta follows m
    assert p.allows(bob, "open-x", "read") and not p.allows(bob, "open-x", "publish")
    assert not p.allows(alice, "elsewhere", "read")  # no rule: refused to everyone
    for bad, what in (("x = 1", "unknown top-level"), ("", "no [[rule]]"), ("[[rule]]\npublish = ['alice']", "'models'"),
                      ("[[rule]]\nmodels = 'a'\npublish = ['carol']", "'carol'"), ("[[rule", "not TOML")):  # fmt: skip
        with pytest.raises(e.InvalidArgument, match=re.escape(what)):
            ModelPolicy.parse(bad, names)


def test_a_key_without_the_right_to_publish_a_model_is_refused(keys, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    s = ServerProcess("--curve-secret", str(keys / "server.key_secret"), "--curve-clients", str(keys / "clients"),
                      "--metrics-port", "0", "--model-policy", str(policy))  # fmt: skip
    port = int(re.search(r":(\d+)/metrics", s.proc.stdout.readline()).group(1))
    alice, bob = Peer(s.address, client(keys, "alice")), Peer(s.address, client(keys, "bob"))
    try:
        a = alice.ask(m.OpenShard(1, "actor", "trainer", 1, 0, "inc-a", Location.default(), False, None)).session
        assert isinstance(alice.ask(m.Register(2, a, LAYOUT, {"region": 1})), m.Ack)
        assert isinstance(alice.ask(m.Publish(3, a, 1, 1, None)), m.Ack)
        b = bob.ask(m.OpenShard(4, "actor", "rollout", 1, 0, "inc-b", Location.default(), False, None)).session
        assert isinstance(bob.ask(m.Register(5, b, LAYOUT, {"region": 2})), m.Ack)
        reply = bob.ask(m.Publish(6, b, 1, 2, None))  # bob may read "actor", not publish it
        assert isinstance(reply, m.Failed) and isinstance(reply.error(), e.PermissionDenied), reply
        err = reply.error()
        assert (err.model, err.replica) == ("actor", "rollout") and "publish" in err.message
        listing = bob.ask(m.ListVersions(7, b, None))
        assert isinstance(listing, m.Listing) and [v.version for v in listing.versions] == [1]  # nothing of bob's
        reply = bob.ask(m.OpenShard(8, "secret-model", "r", 1, 0, "inc-c", Location.default(), False, None))
        assert isinstance(reply, m.Failed) and isinstance(reply.error(), e.PermissionDenied), reply  # no rule: no access
        # A read-only key's re-announced holdings are not taken as the model's versions.
        c = bob.ask(m.OpenShard(9, "open-x", "r", 1, 0, "inc-d", Location.default(), False, None)).session
        assert isinstance(bob.ask(m.Register(10, c, LAYOUT, {"region": 3})), m.Ack)
        assert isinstance(bob.ask(m.Announce(11, c, (m.Held(5, m.KIND_NORMAL, None),), None, 0, ())), m.Ack)
        assert not bob.ask(m.ListVersions(12, c, None)).versions
        metrics = parse_text(scrape("127.0.0.1", port))
        refused = {tuple(sorted(dict(k).items())): v for k, v in metrics["tensorhub_policy_refusals_total"].items()}
        assert sum(v for k, v in refused.items() if ("right", "publish") in k) == 1, refused
        assert sum(v for k, v in refused.items() if ("right", "read") in k) == 1, refused
    finally:
        alice.close()
        bob.close()
        assert s.stop() == 0
