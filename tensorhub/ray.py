"""``tensorhub.ray``: the reference server as a detached named Ray actor. See
:mod:`tensorhub.integrations.ray`."""

from tensorhub.integrations.ray import NAME, NAMESPACE, ReferenceServer, available, get_server_actor, kill_server, server

__all__ = ["NAME", "NAMESPACE", "ReferenceServer", "available", "get_server_actor", "kill_server", "server"]
