"""Unit tests of the error tree (``tensorhub.errors``): its shape, the context every error names,
and the trip over the wire as :class:`tensorhub.core.messages.Failed`."""

from __future__ import annotations

import inspect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorhub
from tensorhub.core import errors, wire
from tensorhub.core import messages as m
from tensorhub.core.errors import TensorHubError, error_from_wire

ALL_ERRORS: list[type[TensorHubError]] = [
    obj for obj in vars(errors).values() if inspect.isclass(obj) and issubclass(obj, TensorHubError)
]
CONTEXT = {"model": "actor", "version": 17, "replica": "rollout-3", "shard": 2}

# The tree, by who is at fault (DESIGN.md §2, errors.py docstring).
PARENTS = {
    errors.UsageError: errors.TensorHubError,
    errors.InvalidName: errors.UsageError,
    errors.InvalidArgument: errors.UsageError,
    errors.NotRegistered: errors.UsageError,
    errors.AlreadyRegistered: errors.UsageError,
    errors.ContractViolation: errors.UsageError,
    errors.LayoutMismatch: errors.UsageError,
    errors.InvalidPlacement: errors.InvalidArgument,
    errors.MappingMismatch: errors.LayoutMismatch,
    errors.Cancelled: errors.UsageError,
    errors.CallInFlight: errors.UsageError,
    errors.PermissionDenied: errors.UsageError,
    errors.ProtocolError: errors.TensorHubError,
    errors.MalformedMessage: errors.ProtocolError,
    errors.WireVersionMismatch: errors.ProtocolError,
    errors.UnknownMessageKind: errors.ProtocolError,
    errors.OversizeMessage: errors.ProtocolError,
    errors.InvalidTransition: errors.ProtocolError,
    errors.UnknownSession: errors.ProtocolError,
    errors.UnknownGrant: errors.ProtocolError,
    errors.VersionError: errors.TensorHubError,
    errors.VersionUnavailable: errors.VersionError,
    errors.VersionConflict: errors.VersionError,
    errors.ChecksumsRequired: errors.VersionError,
    errors.UpdateAborted: errors.VersionError,
    errors.VersionLost: errors.UpdateAborted,
    errors.InBucket: errors.VersionUnavailable,
    errors.BaseMismatch: errors.VersionError,
    errors.SessionError: errors.TensorHubError,
    errors.Fenced: errors.SessionError,
    errors.ReplicaRemoved: errors.SessionError,
    errors.StaleGrant: errors.SessionError,
    errors.ConnectionFailure: errors.TensorHubError,
    errors.ServerUnavailable: errors.ConnectionFailure,
    errors.TransportError: errors.ConnectionFailure,
    errors.BucketError: errors.TransportError,
    errors.BucketUnavailable: errors.BucketError,
    errors.ChecksumMismatch: errors.ConnectionFailure,
    errors.Timeout: errors.TensorHubError,
}

ids = [c.__name__ for c in ALL_ERRORS]


def test_all_errors_are_exported_and_found():
    exported = {name for name in errors.__all__ if name != "error_from_wire"}
    assert exported == {c.__name__ for c in ALL_ERRORS}
    assert set(PARENTS) | {TensorHubError} == set(ALL_ERRORS)
    assert tensorhub.TensorHubError is TensorHubError
    # the public module, whatever was imported first, re-exporting the core's classes themselves
    import tensorhub.errors as public

    assert tensorhub.errors is public and all(getattr(public, name) is getattr(errors, name) for name in errors.__all__)


@pytest.mark.parametrize("cls", list(PARENTS), ids=lambda c: c.__name__)
def test_tree_shape(cls):
    assert cls.__bases__[0] is PARENTS[cls]
    assert issubclass(cls, TensorHubError) and issubclass(cls, Exception)


def test_fault_families_are_disjoint():
    families = [errors.UsageError, errors.ProtocolError, errors.VersionError, errors.SessionError, errors.ConnectionFailure,
                errors.Timeout]
    for cls in ALL_ERRORS:
        if cls in (TensorHubError,):
            continue
        assert sum(issubclass(cls, f) for f in families) == 1, cls


def test_builtin_bases_for_callers_that_catch_those():
    assert issubclass(errors.InvalidName, ValueError)
    assert issubclass(errors.InvalidArgument, ValueError)
    assert issubclass(errors.Timeout, TimeoutError)
    assert not issubclass(errors.ProtocolError, ValueError)


def test_codes_are_unique():
    codes = [c.code for c in ALL_ERRORS]
    assert len(codes) == len(set(codes))
    for cls in ALL_ERRORS:
        assert "code" in cls.__dict__, cls  # each class names its own, none inherits one
        assert isinstance(cls.code, str) and 0 < len(cls.code) <= 64


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=ids)
def test_every_error_names_what_it_concerns(cls):
    err = cls("something failed", **CONTEXT)
    text = str(err)
    assert text.startswith("something failed")
    for value in ("model='actor'", "version=17", "replica='rollout-3'", "shard=2"):
        assert value in text, (cls, text)
    assert err.message == "something failed"
    assert err.context() == CONTEXT
    assert (err.model, err.version, err.replica, err.shard) == ("actor", 17, "rollout-3", 2)
    assert err.args == (text,)


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=ids)
def test_unset_context_is_left_out(cls):
    assert str(cls("plain")) == "plain"
    err = cls("only a model", model="actor")
    assert str(err) == "only a model [model='actor']"
    assert err.context() == {"model": "actor", "version": None, "replica": None, "shard": None}


def test_version_zero_and_shard_zero_are_named():
    assert str(errors.VersionUnavailable("gone", version=0, shard=0)) == "gone [version=0, shard=0]"


def test_context_is_keyword_only():
    with pytest.raises(TypeError):
        errors.Fenced("x", "actor")  # type: ignore[misc]


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=ids)
def test_error_from_wire_rebuilds_the_same_class(cls):
    err = cls("boom", **CONTEXT)
    back = error_from_wire(cls.code, err.message, **err.context())
    assert type(back) is cls
    assert str(back) == str(err) and back.context() == err.context() and back.message == err.message


def test_unknown_code_becomes_a_plain_tensorhub_error():
    err = error_from_wire("from_the_future", "newer peer", model="actor", shard=1)
    assert type(err) is TensorHubError
    assert str(err) == "newer peer [model='actor', shard=1]"


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=ids)
def test_failed_reply_round_trips_every_error(cls):
    err = cls(f"{cls.__name__} happened", **CONTEXT)
    reply = m.Failed.of(41, err)
    assert (reply.req, reply.code, reply.message) == (41, cls.code, err.message)
    back = wire.decode(wire.encode(reply))
    assert back == reply
    rebuilt = back.error()
    assert type(rebuilt) is cls
    assert str(rebuilt) == str(err)
    assert rebuilt.context() == err.context()


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=ids)
def test_failed_reply_round_trips_without_context(cls):
    reply = m.Failed.of(0, cls("bare"))
    assert (reply.model, reply.version, reply.replica, reply.shard) == (None, None, None, None)
    rebuilt = wire.decode(wire.encode(reply)).error()
    assert type(rebuilt) is cls and str(rebuilt) == "bare"


def test_failed_with_an_unknown_code_rebuilds_a_plain_error():
    reply = wire.decode(wire.encode(m.Failed(req=1, code="no_such_code", message="?", version=3)))
    err = reply.error()
    assert type(err) is TensorHubError and err.version == 3


@pytest.mark.property
@settings(max_examples=100, deadline=None)
@given(
    cls=st.sampled_from(ALL_ERRORS),
    message=st.text(max_size=40),
    model=st.none() | st.text(max_size=10),
    version=st.none() | st.integers(min_value=0, max_value=2**63 - 1),
    replica=st.none() | st.text(max_size=10),
    shard=st.none() | st.integers(min_value=0, max_value=65535),
)
def test_failed_round_trip_property(cls, message, model, version, replica, shard):
    err = cls(message, model=model, version=version, replica=replica, shard=shard)
    rebuilt = wire.decode(wire.encode(m.Failed.of(7, err))).error()
    assert type(rebuilt) is cls
    assert rebuilt.message == message
    assert rebuilt.context() == err.context()
    assert str(rebuilt) == str(err)


def test_rebuild_hook_keeps_class_and_context():
    # __reduce__ (for multiprocessing) goes through error_from_wire; called directly here.
    err = errors.ChecksumMismatch("bad bytes", **CONTEXT)
    fn, args = err.__reduce__()
    back = fn(*args)
    assert type(back) is errors.ChecksumMismatch and str(back) == str(err)


def test_errors_can_be_raised_and_caught_by_family():
    with pytest.raises(errors.VersionError):
        raise errors.VersionUnavailable("gone", version=3)
    with pytest.raises(TimeoutError):
        raise errors.Timeout("too slow", model="actor")
    with pytest.raises(ValueError):
        raise errors.InvalidName("bad", model="actor")


def test_cause_is_chained():
    try:
        try:
            raise OSError("connection refused")
        except OSError as e:
            raise errors.ServerUnavailable("no server", model="actor") from e
    except errors.ServerUnavailable as err:
        assert isinstance(err.__cause__, OSError)


def test_a_subclass_must_define_a_code():
    with pytest.raises(TypeError, match="wire code"):

        class NoCode(errors.ProtocolError):
            pass


def test_a_code_cannot_be_taken_twice():
    with pytest.raises(TypeError, match="duplicate"):

        class Twice(errors.ProtocolError):
            code = "malformed"

    assert error_from_wire("malformed", "x").__class__ is errors.MalformedMessage


def test_a_new_subclass_is_registered(monkeypatch):
    monkeypatch.setattr(errors, "_REGISTRY", dict(errors._REGISTRY))

    class Custom(errors.SessionError):
        code = "test_custom_code"

    err = error_from_wire("test_custom_code", "custom", model="m")
    assert type(err) is Custom and isinstance(err, errors.SessionError)
