"""The register of conformance checks: :func:`_check` adds one, with what it needs of the
transport; the suite runs them in the order they were added."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from tensorhub.testing.pairs import _Ctx

_Check = Callable[[_Ctx], Awaitable[None]]
_REGISTRY: dict[str, tuple[_Check, Callable[[Any], str | None]]] = {}


def _check(name: str, needs: Callable[[Any], str | None] = lambda t: None) -> Callable[[_Check], _Check]:
    """Register a check; ``needs(transport_instance)`` returns why it does not apply, or None."""

    def register(fn: _Check) -> _Check:
        _REGISTRY[name] = (fn, needs)
        return fn

    return register
