"""The error tree: every failure TensorHub reports is a :class:`TensorHubError`.

The tree is split by who is at fault, so callers can catch the kind they can act on:

- :class:`UsageError`: the caller misused the API (bad names, calls out of order, a layout that
  does not match, divergent model-parallel calls). Fix the calling code.
- :class:`ProtocolError`: a peer sent something this side cannot accept (a malformed frame, a
  wrong wire version, a holder transition that does not exist). Raised on the receiving side;
  it changes nothing.
- :class:`VersionError`: the version asked for cannot be served (gone, conflicting, an update
  that had to give up).
- :class:`SessionError`: this shard's session is no longer valid (fenced by a newer incarnation,
  its replica removed, a grant from an older server term).
- :class:`ConnectionFailure`: something outside broke (the server, a transport, corrupted bytes).

Every error carries the ``model``, ``version``, ``replica`` and ``shard`` it concerns (``None``
where not applicable) and names them in its message. Errors travel over the wire as a ``code``
plus those fields; :func:`error_from_wire` rebuilds the same class on the other side.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "TensorHubError",
    "UsageError",
    "InvalidName",
    "InvalidArgument",
    "NotRegistered",
    "AlreadyRegistered",
    "ContractViolation",
    "LayoutMismatch",
    "InvalidPlacement",
    "MappingMismatch",
    "Cancelled",
    "CallInFlight",
    "PermissionDenied",
    "ProtocolError",
    "MalformedMessage",
    "WireVersionMismatch",
    "UnknownMessageKind",
    "OversizeMessage",
    "InvalidTransition",
    "UnknownSession",
    "UnknownGrant",
    "VersionError",
    "VersionUnavailable",
    "InBucket",
    "VersionConflict",
    "ChecksumsRequired",
    "UpdateAborted",
    "VersionLost",
    "BaseMismatch",
    "SessionError",
    "Fenced",
    "ReplicaRemoved",
    "StaleGrant",
    "ConnectionFailure",
    "ServerUnavailable",
    "TransportError",
    "BucketError",
    "BucketUnavailable",
    "ChecksumMismatch",
    "Timeout",
    "error_from_wire",
]

_REGISTRY: dict[str, type["TensorHubError"]] = {}


class TensorHubError(Exception):
    """Base of every TensorHub error.

    Args:
        message: what went wrong, in words.
        model, version, replica, shard: what it concerns; appended to the message when set.
    """

    code: ClassVar[str] = "error"

    def __init__(
        self,
        message: str,
        *,
        model: str | None = None,
        version: int | None = None,
        replica: str | None = None,
        shard: int | None = None,
    ) -> None:
        self.message = message
        self.model = model
        self.version = version
        self.replica = replica
        self.shard = shard
        super().__init__(self._render())

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if code is None:
            raise TypeError(f"{cls.__name__} must define a wire code")
        if code in _REGISTRY:
            raise TypeError(f"duplicate error code {code!r} ({cls.__name__}, {_REGISTRY[code].__name__})")
        _REGISTRY[code] = cls

    def context(self) -> dict[str, Any]:
        """The fields naming what this error concerns (None where not applicable)."""
        return {"model": self.model, "version": self.version, "replica": self.replica, "shard": self.shard}

    def _render(self) -> str:
        parts = [f"{k}={v!r}" for k, v in self.context().items() if v is not None]
        return f"{self.message} [{', '.join(parts)}]" if parts else self.message

    def __reduce__(self) -> tuple[Any, ...]:  # keep errors picklable for multiprocessing in tests (never on a wire)
        return (_rebuild, (type(self).code, self.message, self.context()))


_REGISTRY[TensorHubError.code] = TensorHubError


def _rebuild(code: str, message: str, context: dict[str, Any]) -> TensorHubError:
    return error_from_wire(code, message, **context)


def error_from_wire(code: str, message: str, **context: Any) -> TensorHubError:
    """Rebuild an error received from a peer; an unknown code becomes a plain TensorHubError."""
    cls = _REGISTRY.get(code, TensorHubError)
    return cls(message, **context)


# --- local misuse ---------------------------------------------------------------------------


class UsageError(TensorHubError):
    """The caller used the API wrongly."""

    code = "usage"


class InvalidName(UsageError, ValueError):
    """A model, replica, version or shard designation is not valid."""

    code = "invalid_name"


class InvalidArgument(UsageError, ValueError):
    """An argument has the wrong type or value."""

    code = "invalid_argument"


class NotRegistered(UsageError):
    """The call needs registered tensors (``register`` first)."""

    code = "not_registered"


class AlreadyRegistered(UsageError):
    """Tensors are already registered on this handle (``unregister`` first)."""

    code = "already_registered"


class ContractViolation(UsageError):
    """A call breaks the contract: out of order, while published, or diverging from the other
    shards of the replica for the same call number."""

    code = "contract_violation"


class LayoutMismatch(UsageError):
    """A shard's layout differs from the one other holders of the same shard index declared."""

    code = "layout_mismatch"


class InvalidPlacement(InvalidArgument):
    """A tensor's placement cannot be: a shard dimension or mesh coordinate out of range, packed
    parts that do not add up, shards of one replica that disagree on a tensor, or a tensor that
    no shard (or no usable shard) holds all of.

    Attributes:
        tensors: the names of the tensors concerned.
    """

    code = "invalid_placement"

    def __init__(self, message: str, *, tensors: tuple[str, ...] = (), **context: Any) -> None:
        self.tensors = tuple(tensors)
        super().__init__(message, **context)


class MappingMismatch(LayoutMismatch):
    """A mapping between two naming schemes does not connect the two layouts: a destination
    tensor fed by no source or by two, a source that feeds a tensor the destination lacks, or
    shapes or dtypes that do not match what the mapping derives. Refused before any byte moves.

    Attributes:
        tensors: the names of the tensors concerned (source and destination names).
    """

    code = "mapping_mismatch"

    def __init__(self, message: str, *, tensors: tuple[str, ...] = (), **context: Any) -> None:
        self.tensors = tuple(tensors)
        super().__init__(message, **context)


class Cancelled(UsageError):
    """The call was abandoned (by this shard or a sibling of the same replica)."""

    code = "cancelled"


class CallInFlight(UsageError):
    """A second call on a handle while one is still running."""

    code = "call_in_flight"


class PermissionDenied(UsageError):
    """The server's model policy does not let this client's key do this to this model (publish,
    or read). Nothing was changed; the refusal is counted on the server."""

    code = "permission_denied"


# --- remote protocol errors -----------------------------------------------------------------


class ProtocolError(TensorHubError):
    """A peer sent something that cannot be accepted. Nothing was changed."""

    code = "protocol"


class MalformedMessage(ProtocolError):
    """A frame is not a valid message: bad msgpack, wrong types, missing or unknown fields."""

    code = "malformed"


class WireVersionMismatch(ProtocolError):
    """The peer speaks another wire version."""

    code = "wire_version"


class UnknownMessageKind(ProtocolError):
    """A frame names a message kind this side does not know."""

    code = "unknown_kind"


class OversizeMessage(ProtocolError):
    """A frame, string or collection exceeds its size limit."""

    code = "oversize"


class InvalidTransition(ProtocolError):
    """An event that the holder lifecycle has no transition for in the holder's current state."""

    code = "invalid_transition"


class UnknownSession(ProtocolError):
    """The session is not known to this server (e.g. after a failover): open again."""

    code = "unknown_session"


class UnknownGrant(ProtocolError):
    """The grant named is not an active grant of this session."""

    code = "unknown_grant"


# --- versions ---------------------------------------------------------------------------------


class VersionError(TensorHubError):
    """The version asked for cannot be served."""

    code = "version"


class VersionUnavailable(VersionError):
    """The version existed and is gone (or can never exist): no live holder can serve it."""

    code = "version_unavailable"


class InBucket(VersionUnavailable):
    """No live holder can serve the version to this reader, but the bucket tier holds it:
    ``bucket`` is its URL (the handle restores from it, verified: see
    :mod:`tensorhub.core.table.deltas`)."""

    code = "in_bucket"

    def __init__(self, message: str, *, bucket: str | None = None, **context: Any) -> None:
        super().__init__(message, **context)
        self.bucket = bucket


class VersionConflict(VersionError):
    """Another holder of the same (version, shard) declared different checksums."""

    code = "version_conflict"


class ChecksumsRequired(VersionError):
    """A publish of a version whose checksums the server already knows (another holder declared
    them, or an earlier publish of the same number) must carry this shard's checksums, so that
    other bytes under the same number are refused (:class:`VersionConflict`) before anyone can
    read them. The handle answers it itself: it hashes its buffers and makes the same call again
    with them. Nothing changed on the server."""

    code = "checksums_required"


class UpdateAborted(VersionError):
    """An update gave up after unpublishing; the handle is left empty."""

    code = "update_aborted"


class VersionLost(UpdateAborted):
    """An update's version lost its last complete holder while the update was moving it (every
    shard of the replica is told, and each is left empty). An ``update("latest")`` (or any
    version relative to the newest) answers it itself: it asks again, for the newest version
    then (:func:`tensorhub.handles.pulls.update`); an update to a numbered version raises it.
    (A peer of an older release, which has no such code, rebuilds it as a plain
    :class:`TensorHubError`.)"""

    code = "version_lost"


class BaseMismatch(VersionError):
    """A delta was offered to tensors that do not hold its base version (their checksums are not
    the base's, or a chain's links do not meet). Refused before any byte changed.

    Attributes:
        tensors: the names of the tensors that differ from the base.
    """

    code = "base_mismatch"

    def __init__(self, message: str, *, tensors: tuple[str, ...] = (), **context: Any) -> None:
        self.tensors = tuple(tensors)
        super().__init__(message, **context)


# --- sessions ---------------------------------------------------------------------------------


class SessionError(TensorHubError):
    """This shard's session is no longer valid."""

    code = "session"


class Fenced(SessionError):
    """A newer incarnation of this (model, replica, shard) opened; this one is void."""

    code = "fenced"


class ReplicaRemoved(SessionError):
    """The replica was removed (a shard died, expired or was fenced); its holdings are gone."""

    code = "replica_removed"


class StaleGrant(SessionError):
    """The grant was issued by an older server term and is void."""

    code = "stale_grant"


# --- broken by something outside --------------------------------------------------------------


class ConnectionFailure(TensorHubError):
    """Something outside this process failed."""

    code = "connection"


class ServerUnavailable(ConnectionFailure):
    """No reference server answered."""

    code = "server_unavailable"


class TransportError(ConnectionFailure):
    """A data-plane transfer failed."""

    code = "transport"


class BucketError(TransportError):
    """The bucket tier failed: reading or writing one of its objects (the cause chained), or a
    version whose write failed (raised by the next ``publish()``)."""

    code = "bucket"


class BucketUnavailable(BucketError):
    """The bucket URL cannot be used at all: an unknown protocol, a path under a regular file or
    where no directory can be made, no permission. Raised by ``open()`` where it can tell."""

    code = "bucket_unavailable"


class ChecksumMismatch(ConnectionFailure):
    """Bytes did not verify against their declared checksum."""

    code = "checksum_mismatch"


class Timeout(TensorHubError, TimeoutError):
    """A call's ``timeout=`` ran out."""

    code = "timeout"
