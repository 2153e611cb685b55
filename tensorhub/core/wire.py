"""The control-plane wire format: frozen dataclasses <-> msgpack frames, validated both ways.

A frame is the msgpack array ``[WIRE_VERSION, kind, body]`` where ``body`` maps field names to
values. Decoding refuses, with a typed :class:`~tensorhub.errors.ProtocolError` and before
building anything:

- a frame over :data:`MAX_FRAME_BYTES`, strings, bytes or collections over their limits
  (:class:`OversizeMessage`);
- a wire version other than ours, checked before the rest is looked at (:class:`WireVersionMismatch`);
- a kind nobody registered (:class:`UnknownMessageKind`);
- missing or unknown fields, wrong types, and values the message's own ``__post_init__``
  refuses (:class:`MalformedMessage`).

Nothing here ever unpickles: msgpack with ext types disabled, and a schema per kind.

Schemas are the messages' type annotations, compiled once per class into converter functions.
Supported annotations: ``int``, ``float``, ``bool``, ``str``, ``bytes``, ``X | None``,
``int | str``, ``tuple[X, ...]``, ``dict[str, X]``, another :func:`struct` class, and
:data:`Opaque` (nested plain msgpack data: transport descriptors). A field may narrow its
limit with ``field(metadata={"max_len": N})``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import types
import typing
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import msgpack

from .errors import MalformedMessage, OversizeMessage, ProtocolError, UnknownMessageKind, WireVersionMismatch

__all__ = [
    "WIRE_VERSION",
    "MAX_FRAME_BYTES",
    "MAX_COLLECTION",
    "MAX_STR",
    "MAX_BYTES",
    "Opaque",
    "struct",
    "message",
    "encode",
    "decode",
    "message_kinds",
]

WIRE_VERSION = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_COLLECTION = 1 << 20
MAX_STR = 64 * 1024
MAX_BYTES = 4 * 1024 * 1024
MAX_OPAQUE_DEPTH = 6


if TYPE_CHECKING:  # to a type checker, any value: the decoder checks what it is
    Opaque = Any
else:

    class Opaque:
        """Annotation for nested plain msgpack data (None, bool, int, float, str, bytes, lists
        and str-keyed maps) of bounded depth. Used for transport descriptors the control plane
        carries without interpreting."""


T = TypeVar("T")

_Conv = Callable[[Any, str], Any]
_KINDS: dict[str, type] = {}

if TYPE_CHECKING:  # tells type checkers that struct/message make frozen dataclasses (PEP 681)
    from typing_extensions import dataclass_transform
else:

    def dataclass_transform(**_: Any) -> Callable[[T], T]:
        return lambda f: f


class _Schema:
    __slots__ = ("cls", "kind", "names", "decoders", "encoders", "nameset", "getter", "converted")

    def __init__(self, cls: type, kind: str | None) -> None:
        self.cls = cls
        self.kind = kind
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        self.names = tuple(f.name for f in fields)
        self.nameset = frozenset(self.names)
        self.decoders: dict[str, _Conv] = {}
        self.encoders: dict[str, Callable[[Any], Any]] = {}
        for f in fields:
            max_len = f.metadata.get("max_len")
            self.decoders[f.name] = _compile_decoder(hints[f.name], max_len)
            self.encoders[f.name] = _compile_encoder(hints[f.name])
        # encoding reads every field at once (in C) and converts only the fields that need it
        self.getter: Callable[[Any], tuple[Any, ...]] | None = None
        if len(self.names) == 1:
            one = operator.attrgetter(self.names[0])
            self.getter = lambda v: (one(v),)
        elif self.names:
            self.getter = operator.attrgetter(*self.names)
        self.converted = tuple((i, enc) for i, enc in enumerate(self.encoders.values()) if enc is not _identity)


def _dataclass(cls: type[T]) -> type[T]:
    return dataclasses.dataclass(frozen=True, slots=True)(cls)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def struct(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen, slotted dataclass usable as a nested wire value."""
    cls = _dataclass(cls)
    # compiled lazily: annotations may name classes defined later
    cls.__wire_schema__ = None  # type: ignore[attr-defined]  # set on the class here, not declared by it
    return cls


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def message(kind: str) -> Callable[[type[T]], type[T]]:
    """Make ``cls`` a frozen, slotted dataclass sent on the wire under ``kind``."""

    def wrap(cls: type[T]) -> type[T]:
        if kind in _KINDS:
            raise TypeError(f"message kind {kind!r} already registered by {_KINDS[kind].__name__}")
        cls = struct(cls)
        cls.KIND = kind  # type: ignore[attr-defined]  # set on the class here, not declared by it
        _KINDS[kind] = cls
        return cls

    return wrap


def message_kinds() -> dict[str, type]:
    """All registered message kinds (kind -> class)."""
    return dict(_KINDS)


def _schema(cls: type) -> _Schema:
    s: _Schema | None = cls.__wire_schema__  # type: ignore[attr-defined]  # set by @struct
    if s is None:
        s = _Schema(cls, getattr(cls, "KIND", None))
        cls.__wire_schema__ = s  # type: ignore[attr-defined]  # set by @struct
    return s


# --- decoding ---------------------------------------------------------------------------------


def _bad(path: str, want: str, got: Any) -> MalformedMessage:
    return MalformedMessage(f"field {path!r}: expected {want}, got {type(got).__name__}")


def _compile_decoder(tp: Any, max_len: int | None = None) -> _Conv:
    origin = typing.get_origin(tp)
    if tp is int:

        def dec_int(v: Any, path: str) -> int:
            if type(v) is not int:
                raise _bad(path, "int", v)
            return v

        return dec_int
    if tp is bool:

        def dec_bool(v: Any, path: str) -> bool:
            if type(v) is not bool:
                raise _bad(path, "bool", v)
            return v

        return dec_bool
    if tp is float:

        def dec_float(v: Any, path: str) -> float:
            if type(v) is int:
                v = float(v)
            elif type(v) is not float:
                raise _bad(path, "float", v)
            if not math.isfinite(v):
                raise MalformedMessage(f"field {path!r}: expected a finite float, got {v!r}")
            f: float = v
            return f

        return dec_float
    if tp is str or tp is bytes:
        limit = max_len or (MAX_STR if tp is str else MAX_BYTES)

        def dec_strbytes(v: Any, path: str) -> Any:
            if type(v) is not tp:
                raise _bad(path, tp.__name__, v)
            if len(v) > limit:
                raise OversizeMessage(f"field {path!r}: {len(v)} > {limit} {'characters' if tp is str else 'bytes'}")
            return v

        return dec_strbytes
    if tp is Opaque:
        return lambda v, path: _check_opaque(v, path, 0)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            inner = _compile_decoder(rest[0], max_len)

            def dec_optional(v: Any, path: str) -> Any:
                return None if v is None else inner(v, path)

            return dec_optional
        if set(rest) <= {int, str}:
            dec_i, dec_s = _compile_decoder(int), _compile_decoder(str, max_len)

            def dec_int_or_str(v: Any, path: str) -> Any:
                if v is None and optional:
                    return None
                return dec_s(v, path) if type(v) is str else dec_i(v, path)

            return dec_int_or_str
        raise TypeError(f"unsupported union on the wire: {tp!r}")
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"only tuple[X, ...] is supported on the wire, not {tp!r}")
        inner = _compile_decoder(args[0])
        limit = max_len or MAX_COLLECTION

        def dec_tuple(v: Any, path: str) -> tuple[Any, ...]:
            if type(v) is not list:
                raise _bad(path, "array", v)
            if len(v) > limit:
                raise OversizeMessage(f"field {path!r}: {len(v)} items > {limit}")
            return tuple([inner(x, path) for x in v])

        return dec_tuple
    if origin is dict:
        kt, vt = typing.get_args(tp)
        if kt is not str:
            raise TypeError("only str-keyed maps are supported on the wire")
        inner = _compile_decoder(vt)
        limit = max_len or MAX_COLLECTION

        def dec_dict(v: Any, path: str) -> dict[str, Any]:
            if type(v) is not dict:
                raise _bad(path, "map", v)
            if len(v) > limit:
                raise OversizeMessage(f"field {path!r}: {len(v)} entries > {limit}")
            out = {}
            for k, x in v.items():
                if type(k) is not str:
                    raise _bad(f"{path}.<key>", "str", k)
                if len(k) > MAX_STR:
                    raise OversizeMessage(f"field {path!r}: a key of {len(k)} characters > {MAX_STR}")
                out[k] = inner(x, f"{path}.{k}")
            return out

        return dec_dict
    if isinstance(tp, type) and hasattr(tp, "__wire_schema__"):

        def dec_struct(v: Any, path: str) -> Any:
            return _decode_body(_schema(tp), v, path)

        return dec_struct
    raise TypeError(f"unsupported wire annotation {tp!r}")


def _check_opaque(v: Any, path: str, depth: int) -> Any:
    if depth > MAX_OPAQUE_DEPTH:
        raise MalformedMessage(f"field {path!r}: nested deeper than {MAX_OPAQUE_DEPTH}")
    t = type(v)
    if v is None or t in (bool, int, float, str, bytes):
        return v
    if t is list:
        return [_check_opaque(x, path, depth + 1) for x in v]
    if t is dict:
        for k in v:
            if type(k) is not str:
                raise _bad(f"{path}.<key>", "str", k)
        return {k: _check_opaque(x, f"{path}.{k}", depth + 1) for k, x in v.items()}
    raise _bad(path, "plain msgpack data", v)


def _decode_body(schema: _Schema, body: Any, path: str) -> Any:
    if type(body) is not dict:
        raise _bad(path or "body", "map", body)
    keys = body.keys()
    if keys != schema.nameset:
        missing = sorted(schema.nameset - set(keys))
        unknown = sorted(str(k)[:64] for k in set(keys) - schema.nameset)[:16]
        where = f" in {path!r}" if path else ""
        raise MalformedMessage(
            f"{schema.cls.__name__}{where}: "
            + "; ".join(
                p for p in (f"missing fields {missing}" if missing else "", f"unknown fields {unknown}" if unknown else "") if p
            )
        )
    prefix = f"{path}." if path else ""
    kwargs = {name: dec(body[name], prefix + name) for name, dec in schema.decoders.items()}
    try:
        return schema.cls(**kwargs)
    except ProtocolError:
        raise
    except (ValueError, TypeError) as e:  # the message's own validation
        raise MalformedMessage(f"{schema.cls.__name__}: {e}") from e


def decode(frame: bytes) -> Any:
    """Decode one frame into its message.

    Raises:
        OversizeMessage, WireVersionMismatch, UnknownMessageKind, MalformedMessage.
    """
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise MalformedMessage(f"a frame must be bytes, got {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        raise OversizeMessage(f"frame of {len(frame)} bytes > {MAX_FRAME_BYTES}")
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=MAX_FRAME_BYTES,
            max_bin_len=MAX_FRAME_BYTES,
            max_array_len=MAX_COLLECTION,
            max_map_len=MAX_COLLECTION,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        # msgpack enforces the collection limits itself, as a plain ValueError naming the limit.
        if isinstance(e, ValueError) and ("max_array_len" in str(e) or "max_map_len" in str(e)):
            raise OversizeMessage(f"frame holds a collection over {MAX_COLLECTION} items: {e}") from None
        raise MalformedMessage(f"frame is not valid msgpack: {e}") from None
    if type(obj) is not list or len(obj) != 3:
        raise MalformedMessage("a frame must be the array [wire_version, kind, body]")
    version, kind, body = obj
    if version != WIRE_VERSION or type(version) is not int:
        raise WireVersionMismatch(f"peer speaks wire version {version!r}, this side speaks {WIRE_VERSION}")
    if type(kind) is not str:
        raise MalformedMessage(f"message kind must be a str, got {type(kind).__name__}")
    cls = _KINDS.get(kind)
    if cls is None:
        raise UnknownMessageKind(f"unknown message kind {kind[:64]!r}")
    return _decode_body(_schema(cls), body, "")


# --- encoding ---------------------------------------------------------------------------------


def _compile_encoder(tp: Any) -> Callable[[Any], Any]:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and hasattr(tp, "__wire_schema__"):
        return lambda v: _encode_body(_schema(tp), v)
    if origin is tuple:
        inner = _compile_encoder(typing.get_args(tp)[0])
        return lambda v: [inner(x) for x in v]
    if origin is dict:
        inner = _compile_encoder(typing.get_args(tp)[1])
        return lambda v: {k: inner(x) for k, x in v.items()}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) == 1:
            inner = _compile_encoder(rest[0])
            return lambda v: None if v is None else inner(v)
    return _identity


def _identity(v: Any) -> Any:
    return v


def _encode_body(schema: _Schema, msg: Any) -> dict[str, Any]:
    if schema.getter is None:
        return {}
    values = schema.getter(msg)
    if not schema.converted:
        return dict(zip(schema.names, values))
    out = list(values)
    for i, enc in schema.converted:
        v = out[i]
        if v is not None:
            out[i] = enc(v)
    return dict(zip(schema.names, out))


def encode(msg: Any) -> bytes:
    """Encode a message into one frame."""
    cls = type(msg)
    kind = getattr(cls, "KIND", None)
    if kind is None or _KINDS.get(kind) is not cls:
        raise TypeError(f"{cls.__name__} is not a registered wire message")
    frame: bytes = msgpack.packb([WIRE_VERSION, kind, _encode_body(_schema(cls), msg)], use_bin_type=True)
    return frame


def to_plain(value: Any) -> Any:
    """A struct (or message) as plain msgpack-able data (for JSON dumps and tests)."""
    if hasattr(type(value), "__wire_schema__"):
        return _encode_body(_schema(type(value)), value)
    return value


def from_plain(cls: type[T], data: Any) -> T:
    """Validate plain data against a struct's schema and build it."""
    built: T = _decode_body(_schema(cls), data, "")
    return built

