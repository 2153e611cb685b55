"""Logs: JSON lines by flag or environment variable, with the model / version / replica / shard
a line is about, from a real server process and a real worker process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import zmq

from tensorhub.core import messages as m
from tensorhub.core.topology import Location
from tensorhub.core.wire import decode, encode

pytestmark = pytest.mark.integration


def _json_lines(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # every line is a JSON object


def test_server_json_lines_name_what_a_refusal_concerns():
    proc = subprocess.Popen([sys.executable, "-m", "tensorhub", "server", "--bind", "tcp://127.0.0.1:*",
                             "--log-format", "json", "--log-level", "debug"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        address = re.search(r"listening on (tcp://\S+)", proc.stdout.readline()).group(1)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            sock.send(encode(m.OpenShard(1, "logged", "rollout-7", 2, 1, "inc", Location.default(), False, None)))
            assert sock.poll(5000)
            sid = decode(sock.recv()).session
            sock.send(encode(m.Publish(2, sid, 1, 5, None)))  # before register: NotRegistered
            assert sock.poll(5000)
            assert decode(sock.recv()).code == "not_registered"
        finally:
            sock.close(0)
            ctx.term()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    records = _json_lines(err)
    assert any(r["event"] == "server listening" and r["level"] == "info" and "timestamp" in r for r in records)
    (refused,) = [r for r in records if r["event"] == "request refused"]
    assert refused["code"] == "not_registered" and refused["kind"] == "publish"
    assert (refused["model"], refused["replica"], refused["shard"]) == ("logged", "rollout-7", 1)
    assert refused["version"] == 5  # the version the refused publish named


def test_worker_json_lines_by_environment_variable(tmp_path):
    script = (
        "import tensorhub, torch\n"
        "from tests.procs import ServerProcess\n"
        "s = ServerProcess()\n"
        "try:\n"
        "    with tensorhub.open('logged', 'trainer', server=s.address) as h:\n"
        "        h.register({'w': torch.zeros(4)})\n"
        "        h.publish(3)\n"
        "finally:\n"
        "    s.stop()\n"
    )
    env = dict(os.environ, TENSORHUB_LOG_FORMAT="json", TENSORHUB_LOG_LEVEL="debug")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fmt: skip
    assert out.returncode == 0, out.stderr
    records = _json_lines(out.stderr)
    shard_lines = [r for r in records if r.get("replica") == "trainer"]
    assert shard_lines, records
    for r in shard_lines:
        assert r["model"] == "logged" and r["shard"] == 0, r
