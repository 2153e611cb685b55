"""Issue 36 (3): a session is bound to the connection that opened it.

Without CURVE (the default loopback server) any process on the host reaches the server, and
``tensorhub status --json`` prints every session id. Knowing one must not let another process
act for that session: unpublish or close it, register endpoints into it, keep it alive, or
re-point its replies (an ``OffloadRequest`` meant for the victim going to the stranger).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import tensorhub
from tensorhub.core import errors as e
from tensorhub.core import messages as m

from .procs import InprocServer
from .table_driver import LAYOUT, Driver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _table_view(t) -> dict:
    """What the table says about every session: its connection, layout, endpoint and holdings."""
    return {
        sid: (s.peer, s.replica.name, s.layout, s.endpoint, s.holder.version if s.holder else None,
              s.holder.state if s.holder else None, sorted(o.version for o in s.offloads.values()))
        for sid, s in t.sessions.items()
    }  # fmt: skip


def test_messages_for_a_session_from_another_connection_change_nothing():
    d = Driver()
    d.advance(11)
    t = d.shard("trainer")
    t.expect_ok(t.publish(1))
    before = _table_view(d.table)
    stranger = "stranger"
    n = 0

    def refused(msg, cls=e.UnknownSession):
        nonlocal n
        n += 1
        out = d.send(stranger, msg)
        (reply,) = [r for p, r in out if p == stranger]
        assert isinstance(reply, m.Failed) and isinstance(reply.error(), cls), reply
        assert all(p == stranger for p, _ in out), out  # nothing went to the victim, nor moved
        return reply

    sid = t.session
    refused(m.Unpublish(901, sid, 2))
    refused(m.CloseShard(902, sid))
    refused(m.Register(903, sid, LAYOUT, {"tcp": "evil"}, None, None))
    refused(m.Publish(904, sid, 2, 2, None))
    refused(m.Announce(905, sid, (), None, 0, ()))
    refused(m.DeclareChecksums(906, sid, 1, (1,) * LAYOUT.checksum_count()))
    out = d.send(stranger, m.Heartbeat(907, (sid,)))
    assert out == [(stranger, m.HeartbeatAck(907, (sid,), term=d.table.term))]  # unknown to it: not kept alive
    refused(m.OpenShard(908, "actor", "trainer", 1, 0, t.incarnation, t.location, False, None), e.ContractViolation)
    assert _table_view(d.table) == before
    # The victim still acts for its session, and its replies (an offload request) come to it.
    t.expect_ok(t.unpublish())
    assert t.session in d.table.sessions


def test_a_stranger_process_knowing_the_status_changes_nothing():
    """A second local process with everything ``tensorhub status --json`` prints tries
    Unpublish, CloseShard, Register (endpoints into another replica), Announce, heartbeats and
    SourceFailed for every session it sees, over a raw ZeroMQ socket: all refused, nothing
    changes, and the victims go on working."""
    server = InprocServer()
    try:
        w = {"x": torch.arange(64, dtype=torch.float32)}
        t = tensorhub.open("victim", "trainer", server=server.address, retain="latest")
        r = tensorhub.open("victim", "rollout", server=server.address)
        t.register(w)
        t.publish(1)
        dst = {"x": torch.zeros(64)}
        r.register(dst)
        assert r.replicate(1, timeout=30) == 1
        before = server._look(_table_view)
        run = subprocess.run([sys.executable, "-m", "tests._stranger", server.address], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert run.returncode == 0, run.stderr
        report = json.loads(run.stdout.strip().splitlines()[-1])
        assert set(report["sessions"]) == {t.session, r.session}  # it saw both sessions
        kinds = {kind for kind, _ in report["got"]}
        assert {"Unpublish", "CloseShard", "Register", "Announce", "Heartbeat"} <= kinds
        for kind, outcome in report["got"]:
            assert outcome == ("HeartbeatAck" if kind == "Heartbeat" else "unknown_session"), (kind, outcome)
        assert server._look(_table_view) == before
        # The victims work on: the trainer's unpublish of the last non-spot copy... (the rollout
        # holds v1 too), a new version, and the rollout's update, byte-exact.
        t.unpublish()
        w["x"].mul_(3)
        t.publish(2)
        assert r.update("latest", timeout=30)
        assert torch.equal(dst["x"], w["x"])
        r.close()
        t.close()
        assert server.counts()["sessions"] == 0
    finally:
        server.close()
