"""A stranger on the same host (run as its own process by ``tests/test_session_binding.py``):
it knows everything ``tensorhub status --json`` prints and tries, over a raw ZeroMQ socket, to
act for every session and grant it finds there. Prints one JSON document: what each try got."""

from __future__ import annotations

import json
import sys

import zmq

from tensorhub.core import messages as m
from tensorhub.core.layout import Layout, TensorSpec
from tensorhub.core.topology import Location
from tensorhub.core.wire import decode, encode
from tensorhub.tools.admin import cluster_status


def sessions_and_grants(doc: object) -> tuple[set[int], set[int]]:
    """Every value under a ``session`` key, and every grant id, anywhere in the document."""
    sessions: set[int] = set()
    grants: set[int] = set()

    def walk(x: object, key: str = "") -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "session" and isinstance(v, int):
                    sessions.add(v)
                if k in ("grant", "grant_id", "id") and isinstance(v, int) and key == "grants":
                    grants.add(v)
                walk(v, k)
        elif isinstance(x, list):
            for v in x:
                walk(v, key)

    walk(doc)
    return sessions, grants


def main(address: str) -> None:
    doc = cluster_status(address, keys=None)
    sessions, grants = sessions_and_grants(doc)
    layout = Layout((TensorSpec("x", "float32", (64,), 256),), "xxh3-64", 1 << 22, 2 << 20)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    req = 100
    got: list[list[object]] = []

    def ask(msg: object) -> None:
        sock.send(encode(msg))
        if not sock.poll(5000):
            got.append([type(msg).__name__, "no answer"])
            return
        reply = decode(sock.recv())
        got.append([type(msg).__name__, reply.code if isinstance(reply, m.Failed) else type(reply).__name__])

    for sid in sorted(sessions):
        for n in range(1, 4):  # a call number the victim's replica may be at
            req += 1
            ask(m.Unpublish(req, sid, n))
        req += 1
        ask(m.Register(req, sid, layout, {"tcp": {"host": "127.0.0.1", "port": 9}}, None, None))
        req += 1
        ask(m.Announce(req, sid, (m.Held(1, m.KIND_NORMAL, None),), None, 0, ()))
        req += 1
        ask(m.Heartbeat(req, (sid,)))
        for gid in sorted(grants):
            req += 1
            ask(m.SourceFailed(req, sid, gid, doc["term"], 0, "stranger"))
        req += 1
        ask(m.CloseShard(req, sid))
    sock.close(0)
    ctx.term()
    print(json.dumps({"sessions": sorted(sessions), "grants": sorted(grants), "got": got}))


if __name__ == "__main__":
    main(sys.argv[1])
