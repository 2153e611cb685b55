"""The holder lifecycle of DESIGN.md §5.0, as data.

A holder is one (model, version, shard, replica). Its states and the events that move it are
the table :data:`TRANSITIONS`; :func:`transition` applies one event and raises
:class:`~tensorhub.errors.InvalidTransition` (changing nothing) for a pair with no entry. The
reference table evaluates the conditions of §5.0 ("last non-spot copy of a retained version",
"no complete or offload holder left") and then fires the matching event, so every state change
of a holder goes through this table.

``None`` stands for "no holder" (before creation, after removal).
"""

from __future__ import annotations

import enum
from typing import Any

from .errors import InvalidTransition

__all__ = ["HolderState", "Event", "IdentityEnum", "TRANSITIONS", "transition"]


class IdentityEnum(enum.Enum):
    """An enum hashed by identity. ``Enum.__hash__`` is a Python function (``hash(self._name_)``)
    run on every lookup of a ``(state, event)`` key; a member is a singleton, so its identity is
    as good a hash and costs no call. Dicts keep insertion order, so no iteration order moves."""

    __hash__ = object.__hash__


class HolderState(IdentityEnum):
    PARTIAL = "partial"  # being pulled; serves its verified prefix
    COMPLETE = "complete"  # holds the whole shard (published or pulled)
    OFFLOAD = "offload"  # a CPU copy kept for retention
    UNPUBLISHING = "unpublishing"  # no new grants; waits for its grants to drain


class Event(IdentityEnum):
    PUBLISH = "publish"
    GRANT = "grant"  # a reader was granted: it becomes a partial holder
    PUBLISH_OFFLOAD = "publish_offload"
    COMPLETE = "complete"
    SOURCE_FAILED = "source_failed"  # source failed or revoked; re-granted, progress kept
    SOURCES_GONE = "sources_gone"  # no complete or offload holder of (v, i) left
    ABORT = "abort"  # replicate aborted (timeout, cancel, close, failure)
    UNPUBLISH_LAST_RETAINED = "unpublish_last_retained"  # answered "offload first"
    UNPUBLISH = "unpublish"
    RELEASE = "release"  # offload copy no longer needed
    DRAINED = "drained"  # its grants drained (or were revoked after drain_timeout)
    QUARANTINE = "quarantine"  # failed verification
    REMOVED = "removed"  # its replica removed (crash, expiry, fencing, close)


P, C, O, U = HolderState.PARTIAL, HolderState.COMPLETE, HolderState.OFFLOAD, HolderState.UNPUBLISHING

TRANSITIONS: dict[tuple[HolderState | None, Event], HolderState | None] = {
    (None, Event.PUBLISH): C,
    (None, Event.GRANT): P,
    (None, Event.PUBLISH_OFFLOAD): O,
    (P, Event.COMPLETE): C,
    (P, Event.SOURCE_FAILED): P,
    (P, Event.SOURCES_GONE): None,
    (P, Event.ABORT): U,
    (C, Event.UNPUBLISH_LAST_RETAINED): C,
    (C, Event.UNPUBLISH): U,
    (O, Event.RELEASE): U,
    (U, Event.DRAINED): None,
    (P, Event.QUARANTINE): None,
    (C, Event.QUARANTINE): None,
    (O, Event.QUARANTINE): None,
    (P, Event.REMOVED): None,
    (C, Event.REMOVED): None,
    (O, Event.REMOVED): None,
    (U, Event.REMOVED): None,
}


def transition(state: HolderState | None, event: Event, **context: Any) -> HolderState | None:
    """The state after ``event`` in ``state``.

    Raises:
        InvalidTransition: the lifecycle has no such transition; nothing changes.
    """
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        name = state.value if state is not None else "none"
        raise InvalidTransition(f"holder in state {name!r} has no transition on {event.value!r}", **context) from None
