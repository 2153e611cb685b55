"""TensorHub on Ray: the reference server as a detached, named Ray actor.

::

    import ray
    import tensorhub.ray

    ray.init()
    address = tensorhub.ray.server()   # get-or-create the actor "tensorhub-server" (namespace "tensorhub")

    @ray.remote
    class Rollout:
        def __init__(self):
            self.h = tensorhub.open("actor", "rollout-0")   # no address: it finds the actor

How it behaves:

- **get-or-create by name.** :func:`server` returns the running actor's address, or creates the
  actor (``lifetime="detached"``: it outlives the driver that made it; ``get_if_exists``: two
  drivers racing get one actor) pinned to the creating node, bound to a port chosen once.
- **restarted after a crash.** The actor has ``max_restarts=-1``: Ray starts it again (same node,
  same arguments, so the same address) after its process dies. The handles see the server go
  silent, reconnect to the same address and re-announce what they hold, exactly as after a
  failover to a backup (README "A primary and a backup server"): their tensors stay valid, and
  a pull under way resumes.
- **found with no address.** In a process where Ray is initialized (the driver, any task or
  actor), ``tensorhub.open(...)`` with no ``server=`` and no ``$TENSORHUB_SERVER`` asks Ray for
  this actor and uses its address (before falling back to the embedded default server).
- The server runs inside the actor's process (its own event loop thread), so it dies with it:
  no orphan server holds the port when Ray restarts the actor.

Multi-node: pass ``host=`` the node's address reachable by the job (the server refuses a
non-loopback bind without CURVE keys unless ``insecure=True``, on a network you trust).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from tensorhub.core.errors import InvalidArgument, ServerUnavailable, UsageError
from tensorhub.handles.api import RAY_SERVER_ACTOR

__all__ = ["NAME", "NAMESPACE", "ReferenceServer", "available", "get_server_actor", "kill_server", "server"]

NAMESPACE, NAME = RAY_SERVER_ACTOR


def available() -> str | None:
    """None if Ray can be used here, else why not."""
    try:
        import ray  # noqa: F401
    except ImportError as err:
        return f"ray is not installed ({err}); pip install 'tensorhub[ray]'"
    return None


class ReferenceServer:
    """The actor's class: a :class:`~tensorhub.runtime.server.ServerActor` on a loop thread of
    the actor's process. Methods are called through Ray (``actor.address.remote()``)."""

    def __init__(self, bind: str, insecure: bool, heartbeat_timeout: float | None) -> None:
        from tensorhub.core.table import TableConfig
        from tensorhub.runtime.actor import LoopThread
        from tensorhub.runtime.server import ServerActor, ServerConfig

        table = TableConfig() if heartbeat_timeout is None else TableConfig(
            heartbeat_interval=min(1.0, heartbeat_timeout / 10), heartbeat_timeout=heartbeat_timeout
        )  # fmt: skip
        self._loop = LoopThread("tensorhub-ray-server")
        self._server = ServerActor(ServerConfig(bind=bind, insecure=insecure, table=table))
        self._loop.run(self._server.start())

    def address(self) -> str:
        return self._server.address

    def pid(self) -> int:
        return os.getpid()

    def counts(self) -> dict[str, int]:
        async def get() -> dict[str, int]:
            return self._server.table.counts()

        return self._loop.run(get())


def _ray() -> Any:
    why = available()
    if why is not None:
        raise UsageError(why)
    import ray

    if not ray.is_initialized():
        raise UsageError("Ray is not initialized in this process: call ray.init() first")
    return ray


def get_server_actor(name: str = NAME, namespace: str = NAMESPACE) -> Any | None:
    """The server actor's Ray handle, or None if there is none."""
    ray = _ray()
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server(
    name: str = NAME,
    namespace: str = NAMESPACE,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    insecure: bool = False,
    heartbeat_timeout: float | None = None,
    timeout: float = 60.0,
) -> str:
    """Get or create the reference server actor; return its address.

    Args:
        name, namespace: the actor's Ray name (the defaults are what handles look for).
        host: the address to bind (loopback: a single-node job).
        port: the port (None: a free one, chosen once: a restart binds it again).
        insecure: allow a non-loopback ``host`` without CURVE keys.
        heartbeat_timeout: the server's heartbeat timeout (None: the default, 10 s): how long
            handles take to notice a crash and re-announce.
        timeout: seconds to wait for the actor to answer.

    Raises:
        UsageError: Ray is missing or not initialized. InvalidArgument: a bad argument.
        ServerUnavailable: the actor did not answer in time.
    """
    ray = _ray()
    if port is not None and not (type(port) is int and 0 < port < 65536):
        raise InvalidArgument(f"port must be an int in [1, 65535] or None, got {port!r}")
    actor = get_server_actor(name, namespace)
    if actor is None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        bind = f"tcp://{host}:{port or _free_port(host)}"
        cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(ReferenceServer)
        here = ray.get_runtime_context().get_node_id()
        actor = cls.options(
            name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        ).remote(bind, insecure, heartbeat_timeout)  # fmt: skip
    try:
        return ray.get(actor.address.remote(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise ServerUnavailable(f"the Ray actor {namespace}/{name} did not answer in {timeout:g} s") from None


def kill_server(name: str = NAME, namespace: str = NAMESPACE, restart: bool = False) -> bool:
    """Kill the server actor (``restart=True``: as a crash, Ray starts it again; False: for good).
    Returns whether there was one."""
    ray = _ray()
    actor = get_server_actor(name, namespace)
    if actor is None:
        return False
    ray.kill(actor, no_restart=not restart)
    return True
