"""Operating a real server process: ``tensorhub status`` (JSON and the terminal view) against a
known cluster state, Prometheus metrics scraped and checked, and a transfer trace that loads as
Chrome-trace JSON with the expected spans."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
import zmq

import tensorhub
from tensorhub.core import messages as m
from tensorhub.core.layout import Layout, TensorSpec
from tensorhub.core.topology import Location
from tensorhub.core.wire import decode, encode
from tensorhub.runtime.metrics import parse_text, scrape
from tensorhub.tools.admin import cluster_status, transfer_trace
from tensorhub.tools.status import render
from tensorhub.tools.trace import validate_chrome_trace
from tensorhub.transports.local import LocalTransport

from .procs import ServerProcess

pytestmark = pytest.mark.integration

LAYOUT = Layout((TensorSpec("w", "float32", (4,), 16),), "xxh3-64", 1 << 20, 2 << 20)


class Peer:
    """A raw DEALER speaking the protocol: holders and readers whose state the test decides."""

    def __init__(self, address: str, model: str, replica: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.req = 0
        opened = self.ask(lambda r: m.OpenShard(r, model, replica, 1, 0, "inc-" + replica,
                                                Location("dc-a", "host-" + replica, ""), False, 0))  # fmt: skip
        assert isinstance(opened, m.Opened), opened
        self.session = opened.session
        assert isinstance(self.ask(lambda r: m.Register(r, self.session, LAYOUT, {"region": 1})), m.Ack)

    def ask(self, build, want: type | None = None):
        self.req += 1
        self.sock.send(encode(build(self.req)))
        for _ in range(20):
            assert self.sock.poll(60_000), "no answer"  # a hang's bound (5 s was hit on a loaded machine)
            reply = decode(self.sock.recv())
            if want is None or isinstance(reply, want):
                return reply
            # this request refused: say so now, not after 20 more polls (another call's end may come first)
            assert not (isinstance(reply, m.Failed) and reply.req == self.req), f"refused: {reply}"
        raise AssertionError(f"no {want}")

    def send(self, msg) -> None:
        self.sock.send(encode(msg))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def server():
    # These raw peers do not heartbeat: a timeout well past any test's length keeps their sessions
    # (at the default 10 s a loaded machine expired them, and every close was refused)
    s = ServerProcess("--metrics-port", "0", "--heartbeat-timeout", "600")
    s.metrics_port = int(re.search(r":(\d+)/metrics", s.proc.stdout.readline()).group(1))
    yield s
    assert s.alive(), f"the server died: {s.stderr()}"
    assert s.stop() == 0


@pytest.fixture
def pipeline(server):
    """A known state: ``trainer`` holds v1 of ``ops``; ``r1`` pulls it from the trainer (8 of 16
    bytes verified); ``r2`` pulls it from ``r1`` (a partial source: pipeline replication)."""
    peers = []
    try:
        t = Peer(server.address, "ops", "trainer")
        peers.append(t)
        assert isinstance(t.ask(lambda r: m.Publish(r, t.session, 1, 1, (7,))), m.Ack)
        r1 = Peer(server.address, "ops", "r1")
        peers.append(r1)
        g1 = r1.ask(lambda r: m.Replicate(r, r1.session, 1, 1, None), m.Grant)
        assert g1.source.replica == "trainer"
        r1.send(m.Progress(0, r1.session, g1.grant, g1.term, 8))
        r2 = Peer(server.address, "ops", "r2")
        peers.append(r2)
        g2 = r2.ask(lambda r: m.Replicate(r, r2.session, 1, 1, None), m.Grant)
        assert g2.source.replica == "r1" and not g2.source.complete
        yield {"grants": (g1.grant, g2.grant), "sessions": (t.session, r1.session, r2.session)}
    finally:
        failed = []
        for p in reversed(peers):  # every peer's socket closed, even after one's close failed
            try:
                p.ask(lambda r, p=p: m.CloseShard(r, p.session), m.Ack)
            except AssertionError as err:
                failed.append(err)
            finally:
                p.close()
        assert not failed, failed


def test_status_json_matches_the_known_state(server, pipeline):
    doc = cluster_status(server.address)
    assert doc["counts"]["sessions"] == 3 and doc["counts"]["grants"] == 2 and doc["counts"]["holders"] == 3
    assert {"term", "stats", "bytes_by_link", "seeding"} <= set(doc)  # what scripts read before
    (model,) = [mo for mo in doc["models"] if mo["model"] == "ops"]
    assert model["highest_published"] == 1 and model["retain_back"] == 0
    (v1,) = model["versions"]
    assert v1 == {"version": 1, "available": True, "retained": True, "holders": 1, "partial": 2, "offloaded": 0,
                  "replicas": ["trainer"]}  # fmt: skip
    shards = {r["replica"]: r["shards"][0] for r in model["replicas"]}
    assert shards["trainer"]["state"] == "complete" and shards["trainer"]["verified"] == 16
    assert shards["r1"]["state"] == "partial" and shards["r1"]["verified"] == 8 and shards["r1"]["total_bytes"] == 16
    assert shards["r2"]["state"] == "partial" and shards["r2"]["verified"] == 0
    assert shards["r1"]["datacenter"] == "dc-a" and shards["r1"]["host"] == "host-r1"
    assert [sh["session"] for sh in (shards["trainer"], shards["r1"], shards["r2"])] == list(pipeline["sessions"])
    grants = {(g["source"], g["reader"]): g for g in doc["grants"]}
    assert set(grants) == {("trainer", "r1"), ("r1", "r2")}
    assert grants[("trainer", "r1")]["verified"] == 8 and grants[("trainer", "r1")]["source_complete"]
    assert not grants[("r1", "r2")]["source_complete"]
    assert sorted(g["grant"] for g in doc["grants"]) == sorted(pipeline["grants"])
    # The tree of who pulls from whom: trainer -> r1 -> r2.
    (tree,) = doc["trees"]
    assert (tree["model"], tree["version"], tree["shard"]) == ("ops", 1, 0)
    (root,) = tree["roots"]
    assert root["replica"] == "trainer"
    (child,) = root["readers"]
    assert child["replica"] == "r1" and child["verified"] == 8
    assert [g["replica"] for g in child["readers"]] == ["r2"] and child["readers"][0]["readers"] == []
    assert set(doc["rates"]) == {"recent_bytes_per_s", "window_s", "active_bytes_per_s"}
    # Who decides: a server alone reigns from its start (one open reign that made both grants)
    # and has no membership (it has no backup to share voters with).
    (reign,) = doc["reigns"]
    assert reign["term"] == doc["term"] and reign["end"] is None and reign["grants"] == 2
    assert reign["first_grant"] is not None and reign["start"] <= reign["first_grant"] <= reign["last_grant"]
    assert doc["reigning"] is True and doc["membership"] is None
    view = render(doc, server.address)
    assert "model ops" in view and "v1" in view and "shard 0: v1 partial 50%" in view
    assert "  reigning (1 reigns, 2 grants in them)" in view.splitlines()
    lines = view.splitlines()
    i = lines.index("    trainer")
    assert lines[i + 1].startswith("      └─ r1  50%") and lines[i + 2].startswith("        └─ r2  0%")


def test_status_command_json_and_watch(server, pipeline):
    out = subprocess.run([sys.executable, "-m", "tensorhub", "status", "--server", server.address, "--json"],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["counts"]["grants"] == 2 and doc["trees"][0]["roots"][0]["replica"] == "trainer"
    watch = subprocess.run([sys.executable, "-m", "tensorhub", "status", "--server", server.address, "--watch", "--json",
                            "--count", "2", "--interval", "0.1"], capture_output=True, text=True, timeout=30)  # fmt: skip
    assert watch.returncode == 0, watch.stderr
    docs = [json.loads(line) for line in watch.stdout.splitlines()]
    assert len(docs) == 2 and all(d["counts"]["sessions"] == 3 for d in docs)
    down = subprocess.run([sys.executable, "-m", "tensorhub", "status", "--server", "tcp://127.0.0.1:1", "--timeout", "0.3"],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert down.returncode == 2 and "ServerUnavailable" in down.stderr


def _samples(text: str, name: str) -> dict[tuple, float]:
    return parse_text(text).get(name, {})


def test_metrics_are_scraped_and_right(server, pipeline):
    # Garbage too: it is counted by the error code it was answered with.
    raw = Peer(server.address, "ops-metrics", "raw")
    try:
        raw.sock.send(b"\xc1garbage")
        assert raw.sock.poll(60_000)
        raw.sock.recv()
    finally:
        raw.ask(lambda r: m.CloseShard(r, raw.session), m.Ack)
        raw.close()
    text = scrape("127.0.0.1", server.metrics_port)
    parse_text(text)  # every line is a valid exposition line
    holders = _samples(text, "tensorhub_holders")
    assert holders[(("model", "ops"), ("state", "complete"))] == 1
    assert holders[(("model", "ops"), ("state", "partial"))] == 2
    assert _samples(text, "tensorhub_grants_active")[(("model", "ops"),)] == 2
    assert _samples(text, "tensorhub_sessions")[()] == 3
    assert _samples(text, "tensorhub_grants_total")[()] >= 2
    assert _samples(text, "tensorhub_frames_total")[(("outcome", "malformed"),)] >= 1
    opens = _samples(text, "tensorhub_request_seconds_count")[(("kind", "open"),)]
    assert opens >= 4
    buckets = _samples(text, "tensorhub_request_seconds_bucket")
    assert buckets[(("kind", "open"), ("le", "+Inf"))] == opens
    for name in ("tensorhub_expiries_total", "tensorhub_quarantines_total", "tensorhub_offloads_total",
                 "tensorhub_revocations_total", "tensorhub_bytes_granted_total", "tensorhub_transfer_failures_total"):  # fmt: skip
        assert f"# TYPE {name} counter" in text, name
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/nothing", timeout=5)
    assert info.value.code == 404
    info.value.close()


def test_trace_of_a_real_replication(server, tmp_path):
    n = 1 << 18
    with tensorhub.open("traced", "trainer", server=server.address) as t, \
            tensorhub.open("traced", "r1", server=server.address) as r1, \
            tensorhub.open("traced", "r2", server=server.address) as r2:  # fmt: skip
        t.register({"w": torch.arange(n, dtype=torch.float32)})
        r1.register({"w": torch.zeros(n)})
        r2.register({"w": torch.zeros(n)})
        t.publish(3)
        assert r1.replicate(3, timeout=20) == 3
        assert r2.replicate(3, timeout=20) == 3
        # Spans are reported when each grant ends; wait until the server has both.
        for _ in range(100):
            trace = transfer_trace(server.address, "traced", 3)
            if len(trace.spans) >= 2:
                break
            time.sleep(0.05)
    out = tmp_path / "trace.json"
    cli = subprocess.run([sys.executable, "-m", "tensorhub", "trace", "--server", server.address, "--model", "traced",
                          "--version", "3", "--out", str(out)], capture_output=True, text=True, timeout=30)  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    doc = json.loads(out.read_text())
    validate_chrome_trace(doc)
    transfers = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "transfer"]
    assert sorted(e["args"]["reader"] for e in transfers) == ["r1", "r2"]
    fast = "local" if LocalTransport.probe().default else "tcp"  # the default set's same-host edge
    for e in transfers:
        assert e["args"]["outcome"] == "completed" and e["args"]["bytes"] == 4 * n and e["args"]["transport"] == fast
        assert e["args"]["source"] in ("trainer", "r1") and e["args"]["source"] != e["args"]["reader"]
        assert e["dur"] > 0 and e["args"]["reads"] >= 1
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"replica trainer", "replica r1", "replica r2", "server (grants)"} <= names
    flows = [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]
    assert len(flows) == 4
    grants = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "grant"]
    assert len(grants) == 2 and all(e["args"]["outcome"] == "completed" for e in grants)
    # The transfer metrics saw the same spans.
    text = scrape("127.0.0.1", server.metrics_port)
    assert _samples(text, "tensorhub_transfer_seconds_count")[(("outcome", "completed"), ("transport", fast))] >= 2
