"""Asking a running server about itself: its status and the replication DAG of a version.

These need no session: one DEALER socket, one request, one validated reply (msgpack with a
schema, like every control-plane frame). For scripts, benchmarks and the ``tensorhub status``,
``tensorhub dag`` and ``tensorhub trace`` commands; a worker's handles never need them.

Against a server that requires CURVE authentication, pass ``keys``
(:func:`tensorhub.runtime.security.client_keys`); by default they come from
``$TENSORHUB_CURVE_SERVER_KEY`` and ``$TENSORHUB_CURVE_SECRET`` when those are set.
"""

from __future__ import annotations

import itertools
from typing import Any

import zmq

from tensorhub.core import messages as m
from tensorhub.core.errors import ServerUnavailable, TensorHubError
from tensorhub.core.wire import decode, encode
from tensorhub.runtime.security import ClientKeys, apply_client, client_keys

__all__ = ["cluster_status", "replication_dag", "server_status", "transfer_trace"]

_FROM_ENV: Any = object()

_reqs = itertools.count(1)


def _ask(address: str, build: Any, expect: type[Any], timeout: float, keys: ClientKeys | None = _FROM_ENV) -> Any:
    if not isinstance(address, str) or not address:
        raise ServerUnavailable(f"a server address like tcp://127.0.0.1:5557 is needed, got {address!r}")
    if keys is _FROM_ENV:
        keys = client_keys()
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        apply_client(sock, keys)
        sock.connect(address)
        req = next(_reqs)
        sock.send(encode(build(req)))
        if not sock.poll(int(timeout * 1000)):
            hint = "" if keys is not None else " (if it requires CURVE keys, set $TENSORHUB_CURVE_SERVER_KEY and $TENSORHUB_CURVE_SECRET)"
            raise ServerUnavailable(f"no answer from the server at {address} in {timeout:g} s{hint}")
        reply: Any = decode(sock.recv())
    finally:
        sock.close()
    if isinstance(reply, m.Failed):
        raise reply.error()
    if not isinstance(reply, expect) or reply.req != req:
        raise TensorHubError(f"the server at {address} answered {type(reply).__name__}, not {expect.__name__}")
    return reply


def server_status(address: str, timeout: float = 5.0, keys: ClientKeys | None = _FROM_ENV) -> m.ServerStatus:
    """The server's :class:`~tensorhub.core.messages.ServerStatus`: counts, event counters, bytes
    per link class, and the versions being seeded into datacenters.

    Raises:
        ServerUnavailable: no answer within ``timeout`` seconds.
    """
    return _ask(address, lambda req: m.GetStatus(req), m.ServerStatus, timeout, keys)


def replication_dag(
    address: str, model: str, version: int, timeout: float = 5.0, keys: ClientKeys | None = _FROM_ENV
) -> dict[str, Any]:
    """Who served whom for ``version`` of ``model`` (see :mod:`tensorhub.scheduling.dag`).

    Raises:
        ServerUnavailable: no answer within ``timeout`` seconds.
        InvalidName: a bad model name or version.
    """
    from tensorhub.core.naming import validate_model, validate_version

    validate_model(model)
    validate_version(version)
    return _ask(address, lambda req: m.GetDag(req, model, version), m.Dag, timeout, keys).as_dict()


def cluster_state(address: str, timeout: float = 5.0, keys: ClientKeys | None = _FROM_ENV) -> m.ClusterState:
    """The server's :class:`~tensorhub.core.messages.ClusterState`: models, versions, replicas and
    shards, active grants, recent transfer rate.

    Raises:
        ServerUnavailable: no answer within ``timeout`` seconds.
    """
    return _ask(address, lambda req: m.GetCluster(req), m.ClusterState, timeout, keys)


def cluster_status(address: str, timeout: float = 5.0, keys: ClientKeys | None = _FROM_ENV) -> dict[str, Any]:
    """What ``tensorhub status --json`` prints: :func:`server_status` and :func:`cluster_state`
    in one document (see :func:`tensorhub.tools.status.as_json`).

    Raises:
        ServerUnavailable: no answer within ``timeout`` seconds.
    """
    from .status import as_json

    if keys is _FROM_ENV:
        keys = client_keys()
    return as_json(server_status(address, timeout, keys), cluster_state(address, timeout, keys))


def transfer_trace(
    address: str, model: str, version: int, timeout: float = 5.0, keys: ClientKeys | None = _FROM_ENV
) -> m.Trace:
    """The transfer spans readers reported for ``version`` of ``model`` and the server's grants
    (see :mod:`tensorhub.tools.trace` to write a Chrome trace).

    Raises:
        ServerUnavailable: no answer within ``timeout`` seconds.
        InvalidName: a bad model name or version.
    """
    from tensorhub.core.naming import validate_model, validate_version

    validate_model(model)
    validate_version(version)
    return _ask(address, lambda req: m.GetTrace(req, model, version), m.Trace, timeout, keys)
