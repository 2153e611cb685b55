"""The transport under test: how a registered name, a ``"module:Class"`` path, a class or a
factory becomes instances, here and (by name or path only) in the holder process."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

from tensorhub.core.errors import InvalidArgument
from tensorhub.transports.base import Transport

#: Makes a transport instance from an options dict (a Transport subclass is one).
TransportFactory = Callable[[dict[str, Any]], Any]


def _transport_class(spec: str) -> type[Transport]:
    """The class a registered name or a ``"module:Class"`` path names.

    Raises:
        InvalidArgument: no such transport, or it does not load or is not a Transport.
    """
    from tensorhub.transports.registry import get_transport

    if not isinstance(spec, str):
        raise InvalidArgument(f"a transport is named by a string, got {type(spec).__name__}")
    if ":" not in spec:
        return get_transport(spec)
    module, _, attr = spec.partition(":")
    if not (module and attr.isidentifier() and all(p.isidentifier() for p in module.split("."))):
        raise InvalidArgument(f"{spec!r} is not a 'package.module:Class' path")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception as err:  # whatever it raises on import, name the path
        raise InvalidArgument(f"transport {spec!r} does not load: {type(err).__name__}: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise InvalidArgument(f"{spec!r} is {cls!r}, not a subclass of tensorhub.Transport")
    return cls


def _checked(make: Callable[[dict[str, Any]], Any], label: str) -> Callable[[dict[str, Any]], Any]:
    def checked(options: dict[str, Any]) -> Any:
        t = make(dict(options))
        if not isinstance(t, Transport):
            raise InvalidArgument(f"the factory {label} made a {type(t).__name__}, not a Transport")
        return t

    return checked


def _factory(transport: str | TransportFactory) -> tuple[Callable[[dict[str, Any]], Any], str]:
    if isinstance(transport, str):
        return _checked(_transport_class(transport), transport), transport
    if callable(transport):
        label = getattr(transport, "__qualname__", repr(transport))
        return _checked(transport, label), label
    raise InvalidArgument(f"check_transport takes a transport name or a factory, got {type(transport).__name__}")


def _path_of(transport: Any) -> str:
    """How the holder process finds ``transport``: its name or path, or the path of a class
    importable at module level."""
    if isinstance(transport, str):
        _transport_class(transport)  # fail here, with the reason, rather than in the child
        return transport
    if isinstance(transport, type) and issubclass(transport, Transport):
        path = f"{transport.__module__}:{transport.__qualname__}"
        if "<" not in path and "." not in transport.__qualname__ and transport.__module__ != "__main__":
            with contextlib.suppress(InvalidArgument):
                if _transport_class(path) is transport:
                    return path
    raise InvalidArgument(
        f"with holder_process=True the holder process makes the transport, so name it by its registered "
        f"name or a 'module:Class' path (or pass a class importable at module level), not {transport!r}"
    )
