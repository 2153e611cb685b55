"""Issue 36 (5): the smaller hard edges, in-process (a real server actor, handles in this process)."""

from __future__ import annotations

import json
import time

import structlog.testing
import torch
import zmq

import tensorhub
from tensorhub.core import errors as e
from tensorhub.core import messages as m
from tensorhub.core.topology import Location
from tensorhub.core.wire import decode, encode
from tensorhub.tools.cli import main

from .procs import InprocServer


def test_status_without_server_finds_it_as_handles_do(monkeypatch, capsys):
    """``tensorhub status`` with no --server uses $TENSORHUB_SERVER, else the embedded default's
    address, as handles and ``doctor`` do (it exited 2)."""
    srv = InprocServer()
    try:
        monkeypatch.setenv("TENSORHUB_SERVER", srv.address)
        assert main(["status", "--json"]) == 0
        assert "term" in json.loads(capsys.readouterr().out)
        monkeypatch.delenv("TENSORHUB_SERVER")
        monkeypatch.setenv("TENSORHUB_EMBEDDED_ADDRESS", srv.address)
        assert main(["status", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["counts"]["sessions"] == 0
    finally:
        srv.close()


def test_a_fenced_handle_says_so_once():
    """A handle fenced by a new incarnation of its shard logs "session removed" once, not at
    every heartbeat until it is closed; its calls raise Fenced."""
    srv = InprocServer(heartbeat_interval=0.05, heartbeat_timeout=5.0)
    capture = structlog.testing.capture_logs()
    logs = capture.__enter__()

    def removed() -> int:
        return sum(1 for r in list(logs) if r.get("event") == "session removed by the server")

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        h = tensorhub.open("fence", "r", server=srv.address)
        h.register({"x": torch.zeros(8)})
        sock.connect(srv.address)
        sock.send(encode(m.OpenShard(1, "fence", "r", 1, 0, "a-new-incarnation", Location.default(), False, None)))
        assert sock.poll(5000) and isinstance(decode(sock.recv()), m.Opened)
        deadline = time.monotonic() + 10
        while not removed():
            assert time.monotonic() < deadline, "the handle was never told"
            time.sleep(0.02)
        time.sleep(0.5)  # ten heartbeat intervals
        assert removed() == 1, [r for r in logs if "removed" in str(r.get("event"))]
        try:
            h.publish(1)
        except e.SessionError:
            pass
        else:
            raise AssertionError("a fenced handle published")
        h.close()
    finally:
        capture.__exit__(None, None, None)
        sock.close(0)
        ctx.term()
        srv.close()
