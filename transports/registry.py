"""Transport registry: built-ins by name, third-party plugins from entry points.

Built-ins are registered lazily as ``name -> "module:Class"`` so that an optional library is
imported only when its transport is asked for. Third-party transports come from the entry-point
group ``tensorhub.transports`` (``name = "package.module:Class"``) or from
:func:`register_transport`. A name is registered once; a duplicate is refused.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from tensorhub.core.errors import InvalidArgument

from .base import Probe, Transport

__all__ = ["BUILTIN_ORDER", "ENTRY_POINT_GROUP", "probe_builtins", "get_transport", "register_transport", "transport_names"]

ENTRY_POINT_GROUP = "tensorhub.transports"

_BUILTIN: dict[str, str] = {
    "local": "tensorhub.transports.local:LocalTransport",
    "memory": "tensorhub.transports.memory:MemoryTransport",
    "nixl": "tensorhub.transports.nixl:NixlTransport",
    "rdma_copy": "tensorhub.transports.rdma_copy:RdmaCopyTransport",
    "tcp": "tensorhub.transports.tcp:TcpTransport",
}
_registered: dict[str, type[Transport] | str] = dict(_BUILTIN)

#: the built-ins in the order a handle configured with nothing starts them (the engine's own
#: order, used when an edge's preference list has no fit)
BUILTIN_ORDER = ("local", "nixl", "rdma_copy", "tcp", "memory")
_entry_points_loaded = False


def register_transport(name: str, cls: type[Transport] | str) -> None:
    """Register a transport class (or a lazy ``"module:Class"`` path) under ``name``.

    Raises:
        InvalidArgument: the name is taken, or ``cls`` is not a Transport subclass.
    """
    _load_entry_points()
    if not isinstance(name, str) or not name.isidentifier():
        raise InvalidArgument(f"transport names are identifiers, got {name!r}")
    if name in _registered:
        raise InvalidArgument(f"a transport named {name!r} is already registered ({_describe(_registered[name])})")
    if isinstance(cls, str):
        _check_path(name, cls)
    else:
        _check(name, cls)
    _registered[name] = cls


def transport_names() -> list[str]:
    _load_entry_points()
    return sorted(_registered)


def get_transport(name: str) -> type[Transport]:
    """The transport class registered as ``name`` (importing it on first use).

    Raises:
        InvalidArgument: no such transport, or its plugin does not load or is not a Transport.
    """
    _load_entry_points()
    entry = _registered.get(name)
    if entry is None:
        raise InvalidArgument(f"no transport named {name!r}; known: {', '.join(sorted(_registered))}")
    if isinstance(entry, str):
        _check_path(name, entry)
        module, _, attr = entry.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except Exception as err:  # noqa: BLE001 - whatever a plugin raises on import, name the plugin
            raise InvalidArgument(f"transport {name!r} ({entry}) does not load: {type(err).__name__}: {err}") from err
        _check(name, cls)
        _registered[name] = entry = cls
    return entry


def probe_builtins() -> dict[str, Probe]:
    """Every built-in transport's :meth:`~Transport.probe`, in :data:`BUILTIN_ORDER`. The
    default transport set (a handle opened without ``transports=`` and without
    ``$TENSORHUB_TRANSPORTS``) is the names whose probe says ``default``; ``tcp`` always does."""
    found = {}
    for name in BUILTIN_ORDER:
        try:
            found[name] = get_transport(name).probe()
        except InvalidArgument as err:  # the module does not load (a broken optional library)
            found[name] = Probe(False, False, str(err))
    return found


def _check(name: str, cls: object) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise InvalidArgument(f"transport plugin {name!r} is {cls!r}, not a subclass of tensorhub.Transport")
    if cls.name and cls.name != name:
        raise InvalidArgument(f"transport plugin {name!r} is class {cls.__name__} whose name is {cls.name!r}")


def _check_path(name: str, path: str) -> None:
    module, sep, attr = path.partition(":")
    if not (sep and module and attr and all(p.isidentifier() for p in module.split(".")) and attr.isidentifier()):
        raise InvalidArgument(f"transport {name!r}: {path!r} is not a 'package.module:Class' path")


def _describe(entry: type[Transport] | str) -> str:
    return entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    found: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _registered or ep.name in found:
            clash = _describe(_registered[ep.name]) if ep.name in _registered else found[ep.name]
            raise InvalidArgument(
                f"entry point {ep.name!r} = {ep.value!r} of group {ENTRY_POINT_GROUP} clashes with transport {clash}"
            )
        found[ep.name] = ep.value
    _registered.update(found)  # all or nothing: a clash is raised again on every call
    _entry_points_loaded = True
