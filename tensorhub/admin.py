"""Asking a running server about itself: its status and the replication DAG of a version.

These need no session: one DEALER socket, one request, one validated reply (msgpack with a
schema, like every control-plane frame). For scripts, benchmarks and the ``tensorhub status``
and ``tensorhub dag`` commands; a worker's handles never need them.
"""

from __future__ import annotations

import itertools
from typing import Any

import zmq

from . import messages as m
from .errors import ServerUnavailable, TensorHubError
from .wire import decode, encode

__all__ = ["replication_dag", "server_status"]

_reqs = itertools.count(1)


def _ask(address: str, build: Any, expect: type, timeout: float) -> Any:
    if not isinstance(address, str) or not address:
        raise ServerUnavailable(f"a server address like tcp://127.0.0.1:5557 is needed, got {address!r}")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        req = next(_reqs)
        sock.send(encode(build(req)))
        if not sock.poll(int(timeout * 1000)):
            raise ServerUnavailable(f"no answer from the server at {address} in {timeout:g} s")
        reply = decode(sock.recv())
    finally:
        sock.close()
    if isinstance(reply, m.Failed):
        raise reply.error()
    if not isinstance(reply, expect) or reply.req != req:
        raise TensorHubError(f"the server at {address} answered {type(reply).__name__}, not {expect.__name__}")
    return reply


def server_status(address: str, timeout: float = 5.0) -> m.ServerStatus:
    """The server's :class:`~tensorhub.messages.ServerStatus`: counts, event counters, bytes
    per link class, and the versions being seeded into datacenters.

    Raises:
        ServerUnavailable: no answer within ``timeout`` seconds.
    """
    return _ask(address, lambda req: m.GetStatus(req), m.ServerStatus, timeout)


def replication_dag(address: str, model: str, version: int, timeout: float = 5.0) -> dict[str, Any]:
    """Who served whom for ``version`` of ``model`` (see :mod:`scheduling.dag`).

    Raises:
        ServerUnavailable: no answer within ``timeout`` seconds.
        InvalidName: a bad model name or version.
    """
    from .naming import validate_model, validate_version

    validate_model(model)
    validate_version(version)
    return _ask(address, lambda req: m.GetDag(req, model, version), m.Dag, timeout).as_dict()
