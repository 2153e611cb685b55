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

Schemas are the messages' type annotations, compiled once per class (on its first use) into a
generated decoder, which checks every field in one function and builds the message as its
``__init__`` would, and a generated encoder; :func:`struct` also gives each class a generated
``__init__`` that sets its slots directly (see ``benchmarks/bench_wire.py`` for what each saves).
Supported annotations: ``int``, ``float``, ``bool``, ``str``, ``bytes``, ``X | None``,
``int | str``, ``tuple[X, ...]``, ``dict[str, X]``, another :func:`struct` class, and
:data:`Opaque` (nested plain msgpack data: transport descriptors). A field may narrow its
limit with ``field(metadata={"max_len": N})``. A field whose value repeats from message to
message (a source shard's layout in every ``Convert``) may ask for its decoded values to be kept,
by their encoded bytes, with ``field(metadata={"memo": N})`` (the last ``N``): equal bytes decode
to an equal frozen value, so a repeat is checked and built once.

A message field whose value (a tuple) is sent unchanged to many peers (a version's checksums,
in every reader's ``Grant``) may ask for its packed bytes to be kept with
``field(metadata={"pack_once": N})``: its map puts that field last, and :func:`encode` packs
the message with it None, then puts in place of that None the value's bytes, packed once per
value (kept by identity, the last ``N``). The frame is byte for byte what packing the message
whole makes (msgpack packs each value on its own), and no decoder can tell.

A field added to a message after peers of an earlier release shipped it is marked
``field(default=None, metadata={"added": True})`` (its type ``X | None``): the encoder leaves it
out of the map while it is None, and the decoder takes its absence as None. So an earlier peer's
frame (without it) still decodes here, and this side's frame decodes there while it carries
None; a value it does carry is refused there as an unknown field (a typed
``MalformedMessage`` naming it). Every other field must be present.
"""

from __future__ import annotations

import dataclasses
import math
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
    "kind_prefix",
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
    """A struct's compiled schema: ``build(body, path)`` checks a decoded map against the
    struct's fields and builds it; ``encode(value)`` makes the map. Both are generated for the
    class (:func:`_compile_build`, :func:`_compile_encode`)."""

    __slots__ = ("cls", "kind", "names", "decoders", "nameset", "build", "encode", "added", "pack_once", "encode_head")

    def __init__(self, cls: type, kind: str | None) -> None:
        self.cls = cls
        self.kind = kind
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        self.names = tuple(f.name for f in fields)
        self.nameset = frozenset(self.names)
        #: fields added after earlier peers shipped the message: absent on the wire means None
        self.added = tuple(f.name for f in fields if f.metadata.get("added"))
        for f in fields:
            if f.metadata.get("added") and f.default is not None:
                raise TypeError(f"{cls.__qualname__}.{f.name}: a field marked added must default to None")
        self.decoders: dict[str, _Conv] = {}
        encoders: dict[str, Callable[[Any], Any]] = {}
        for f in fields:
            max_len = f.metadata.get("max_len")
            self.decoders[f.name] = _compile_decoder(hints[f.name], max_len)
            if f.metadata.get("memo"):
                self.decoders[f.name] = _memoized(self.decoders[f.name], int(f.metadata["memo"]))
            encoders[f.name] = _compile_encoder(hints[f.name])
        self.build: Callable[[Any, str], Any] = _compile_build(self, [(f.name, hints[f.name], f.metadata.get("max_len")) for f in fields])
        once = [f for f in fields if f.metadata.get("pack_once")]
        if once:  # that field last in the map, always: the frame is then what packing it whole makes
            encoders[once[0].name] = encoders.pop(once[0].name)
        self.encode: Callable[[Any], dict[str, Any]] = _compile_encode(self, encoders)
        #: the field packed once per value (see the module docstring): its name, its encoder and
        #: how many packed values are kept; and the encoder that leaves it None
        self.pack_once: tuple[str, Callable[[Any], Any], int] | None = None
        self.encode_head: Callable[[Any], dict[str, Any]] | None = None
        if once:
            if len(once) > 1 or kind is None or self.added:
                raise TypeError(f"{cls.__qualname__}: pack_once is for one field of a message without added fields")
            self.pack_once = (once[0].name, encoders[once[0].name], int(once[0].metadata["pack_once"]))
            self.encode_head = _compile_encode(self, encoders, last_none=once[0].name)


def _memoized(conv: _Conv, kept: int) -> _Conv:
    """``conv`` keeping the last ``kept`` values it built, by their encoded bytes (a value is
    frozen: what a fresh decode of the same bytes would build, checks passed)."""
    cache: dict[bytes, Any] = {}
    pack = msgpack.packb

    def dec(v: Any, path: str) -> Any:
        key = pack(v)
        hit = cache.get(key)
        if hit is not None:
            return hit
        out = conv(v, path)
        cache[key] = out
        while len(cache) > kept:
            del cache[next(iter(cache))]
        return out

    return dec


def _dataclass(cls: type[T]) -> type[T]:
    return dataclasses.dataclass(frozen=True, slots=True)(cls)


def _slot_setters(cls: type) -> list[Callable[[Any, Any], None]] | None:
    """The ``__set__`` of each field's slot (its member descriptor), in field order; None where
    a field is not a plain slot set by ``__init__`` (then the dataclass's own ``__init__`` is kept)."""
    setters = []
    for f in dataclasses.fields(cls):
        slot = next((k.__dict__[f.name] for k in cls.__mro__ if f.name in k.__dict__), None)
        if (
            not f.init or f.kw_only or f.default_factory is not dataclasses.MISSING
            or not isinstance(slot, types.MemberDescriptorType) or not f.name.isidentifier()
        ):  # fmt: skip
            return None
        setters.append(slot.__set__)
    return setters


def _install_init(cls: type) -> None:
    """Give a frozen, slotted dataclass a cheaper ``__init__`` of the same signature: it sets
    each slot through its member descriptor directly, where the dataclass's own goes through
    ``object.__setattr__`` per field (a type lookup each); then ``__post_init__``, as before.
    The instances are the same (frozen: ``__setattr__`` still refuses); about twice as fast to
    build. A class with a default factory, an ``init=False`` or keyword-only field, or a field
    that is not a slot of its own keeps the dataclass's ``__init__``."""
    setters = _slot_setters(cls)
    if setters is None:
        return
    env: dict[str, Any] = {}
    params, sets = [], []
    for i, f in enumerate(dataclasses.fields(cls)):
        env[f"_s{i}"] = setters[i]
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            env[f"_d{i}"] = f.default
            params.append(f"{f.name}=_d{i}")
        sets.append(f"    _s{i}(self, {f.name})")
    if hasattr(cls, "__post_init__"):
        sets.append("    self.__post_init__()")
    src = f"def __init__(self, {', '.join(params)}):\n" + ("\n".join(sets) or "    pass")
    exec(compile(src, f"<fast __init__ of {cls.__qualname__}>", "exec"), env)
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    cls.__init__ = init  # type: ignore[misc]  # replaced on the class, with the same signature


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def struct(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen, slotted dataclass usable as a nested wire value."""
    cls = _dataclass(cls)
    _install_init(cls)
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
        # checked without building paths; only a value that fails is walked again for its path
        return lambda v, path: v if _opaque_ok(v, 0) else _check_opaque(v, path, 0)
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
        if args[0] is int:  # checksums, session ids: checked in one loop, no call per item

            def dec_int_tuple(v: Any, path: str) -> tuple[Any, ...]:
                if type(v) is not list:
                    raise _bad(path, "array", v)
                if len(v) > limit:
                    raise OversizeMessage(f"field {path!r}: {len(v)} items > {limit}")
                for x in v:
                    if type(x) is not int:
                        raise _bad(path, "int", x)
                return tuple(v)

            return dec_int_tuple

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

        built: list[Callable[[Any, str], Any]] = []  # its schema's build, once compiled (lazily)

        def dec_struct(v: Any, path: str) -> Any:
            if not built:
                built.append(_schema(tp).build)
            return built[0](v, path)

        return dec_struct
    raise TypeError(f"unsupported wire annotation {tp!r}")


def _opaque_ok(v: Any, depth: int) -> bool:
    """Whether :func:`_check_opaque` accepts ``v`` (as it is: nothing is copied)."""
    if depth > MAX_OPAQUE_DEPTH:
        return False
    t = type(v)
    if v is None or t in (bool, int, float, str, bytes):
        return True
    if t is list:
        for x in v:
            if not _opaque_ok(x, depth + 1):
                return False
        return True
    if t is dict:
        for k, x in v.items():
            if type(k) is not str or not _opaque_ok(x, depth + 1):
                return False
        return True
    return False


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
    return schema.build(body, path)


def _fields_error(schema: _Schema, body: dict[Any, Any], path: str) -> MalformedMessage:
    """The map's keys are not the struct's fields: say which are missing and which unknown."""
    keys = body.keys()
    missing = sorted(schema.nameset - set(keys))
    unknown = sorted(str(k)[:64] for k in set(keys) - schema.nameset)[:16]
    where = f" in {path!r}" if path else ""
    return MalformedMessage(
        f"{schema.cls.__name__}{where}: "
        + "; ".join(
            p for p in (f"missing fields {missing}" if missing else "", f"unknown fields {unknown}" if unknown else "") if p
        )
    )


def _at(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _too_long(path: str, v: Any, limit: int) -> OversizeMessage:
    return OversizeMessage(f"field {path!r}: {len(v)} > {limit} {'characters' if type(v) is str else 'bytes'}")


def _compile_build(schema: _Schema, fields: list[tuple[str, Any, int | None]]) -> Callable[[Any, str], Any]:
    """Generate the struct's decoder: one function with each field's check written out (no call
    per field for ints, bools, strings, bytes and their optionals; the other fields call their
    compiled converter), the struct then built positionally. The same checks, in field order,
    and the same errors as the converters of :func:`_compile_decoder`."""
    env: dict[str, Any] = {
        "_schema": schema, "_cls": schema.cls, "_bad": _bad, "_fields_error": _fields_error, "_at": _at,
        "_too_long": _too_long, "ProtocolError": ProtocolError, "MalformedMessage": MalformedMessage,
        "_added": schema.added,
    }  # fmt: skip
    loads, checks = [], []
    for i, (name, tp, max_len) in enumerate(fields):
        x = f"x{i}"
        loads.append(f"        {x} = body[{name!r}]")
        optional = False
        inner = tp
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            rest = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(rest) == 1 and len(typing.get_args(tp)) == 2:
                optional, inner = True, rest[0]
        at = f"_at(path, {name!r})"
        guard = f"{x} is not None and " if optional else ""
        if inner is int or inner is bool:
            checks.append(f"    if {guard}type({x}) is not {inner.__name__}:\n        raise _bad({at}, {inner.__name__!r}, {x})")
        elif inner is str or inner is bytes:
            limit = max_len or (MAX_STR if inner is str else MAX_BYTES)
            checks.append(f"    if {guard}type({x}) is not {inner.__name__}:\n        raise _bad({at}, {inner.__name__!r}, {x})")
            checks.append(f"    if {guard}len({x}) > {limit}:\n        raise _too_long({at}, {x}, {limit})")
        elif inner is float and not optional:
            # a finite float passes as is (x - x is nan for inf and nan); the rest goes to the converter
            env[f"_c{i}"] = schema.decoders[name]
            checks.append(f"    if type({x}) is not float or {x} - {x} != 0.0:\n        {x} = _c{i}({x}, {at})")
        else:
            env[f"_c{i}"] = schema.decoders[name]
            checks.append(f"    {x} = _c{i}({x}, path + {'.' + name!r} if path else {name!r})")
    n = len(fields)
    values = "".join(f"x{i}, " for i in range(n))
    setters = _slot_setters(schema.cls)
    if setters is not None:  # built as its __init__ would: each slot set, then __post_init__
        env["_new"] = object.__new__
        env.update({f"_s{i}": fn for i, fn in enumerate(setters)})
        make = ["        v = _new(_cls)", *(f"        _s{i}(v, x{i})" for i in range(n))]
        if hasattr(schema.cls, "__post_init__"):
            make.append("        v.__post_init__()")
        make.append("        return v")
    else:
        make = [f"        return _cls({values})"]
    src = "\n".join([
        "def build(body, path):",
        "    if type(body) is not dict:",
        "        raise _bad(path or 'body', 'map', body)",
        f"    if len(body) != {n}:",
        *([f"        if {n} - len(_added) <= len(body) < {n}:  # an earlier peer's frame: its added fields are absent",
           "            body = {**{k: None for k in _added}, **body}",
           f"        if len(body) != {n}:",
           "            raise _fields_error(_schema, body, path)"]
          if schema.added else ["        raise _fields_error(_schema, body, path)"]),
        *(["    try:", *loads, "    except KeyError:", "        raise _fields_error(_schema, body, path) from None"] if n else []),
        *checks,
        "    try:",
        *make,
        "    except ProtocolError:",
        "        raise",
        "    except (ValueError, TypeError) as e:  # the message's own validation",
        "        raise MalformedMessage(f'{_cls.__name__}: {e}') from e",
    ])  # fmt: skip
    exec(compile(src, f"<wire decoder of {schema.cls.__qualname__}>", "exec"), env)
    build: Callable[[Any, str], Any] = env["build"]
    return build


_unpackb = msgpack.unpackb
#: message kind -> its schema's build: filled on a kind's first frame
_BUILDERS: dict[str, Callable[[Any, str], Any]] = {}


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
        # msgpack >= 1.0's defaults: raw=False, use_list=True, strict_map_key=True, and strings
        # and bytes at most the frame's length (<= MAX_FRAME_BYTES, checked above); each keyword
        # passed costs (a tenth of decoding a small frame for all of them)
        obj = _unpackb(frame, max_array_len=MAX_COLLECTION, max_map_len=MAX_COLLECTION, max_ext_len=0)
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
    build = _BUILDERS.get(kind)
    if build is None:
        cls = _KINDS.get(kind)
        if cls is None:
            raise UnknownMessageKind(f"unknown message kind {kind[:64]!r}")
        build = _BUILDERS[kind] = _schema(cls).build
    return build(body, "")


# --- encoding ---------------------------------------------------------------------------------


def _compile_encoder(tp: Any) -> Callable[[Any], Any]:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and hasattr(tp, "__wire_schema__"):
        return lambda v: _schema(tp).encode(v)
    if origin is tuple:
        inner = _compile_encoder(typing.get_args(tp)[0])
        if inner is _identity:
            return list  # ints, strings...: the same items, no call per item
        return lambda v: [inner(x) for x in v]
    if origin is dict:
        inner = _compile_encoder(typing.get_args(tp)[1])
        if inner is _identity:
            return dict
        return lambda v: {k: inner(x) for k, x in v.items()}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) == 1:
            inner = _compile_encoder(rest[0])
            return lambda v: None if v is None else inner(v)
    return _identity


def _identity(v: Any) -> Any:
    return v


def _compile_encode(
    schema: _Schema, encoders: dict[str, Callable[[Any], Any]], last_none: str | None = None
) -> Callable[[Any], dict[str, Any]]:
    """Generate the struct's encoder: one dict display of its fields, converting only those
    that need it (nested structs, and tuples or maps of them); None stays None. ``last_none``:
    that field is put last, as None (its packed bytes go in after: :func:`encode`)."""
    env: dict[str, Any] = {}
    items = []
    later = []  # fields added after earlier peers shipped the message: left out while None
    for i, (name, enc) in enumerate(encoders.items()):
        if name == last_none:
            continue
        value = f"v.{name}" if enc is _identity else f"_e{i}(v.{name})"
        if enc is not _identity:
            env[f"_e{i}"] = enc
        if name in schema.added:
            later.append(f"    if v.{name} is not None:\n        d[{name!r}] = {value}")
        elif enc is _identity:
            items.append(f"{name!r}: v.{name}")
        else:
            items.append(f"{name!r}: None if v.{name} is None else {value}")
    if last_none is not None:
        items.append(f"{last_none!r}: None")
    if later:
        src = "def encode(v):\n    d = {" + ", ".join(items) + "}\n" + "\n".join(later) + "\n    return d"
    else:
        src = "def encode(v):\n    return {" + ", ".join(items) + "}"
    exec(compile(src, f"<wire encoder of {schema.cls.__qualname__}>", "exec"), env)
    encode: Callable[[Any], dict[str, Any]] = env["encode"]
    return encode


_PACKERS: list[msgpack.Packer] = []  # idle Packers (one is not thread-safe): a frame takes one and puts it back


def _pack(obj: Any) -> bytes:
    """``msgpack.packb(obj, use_bin_type=True)`` through a reused Packer: ``packb`` makes (and
    allocates the buffer of) a new Packer for every frame. ``list.pop`` and ``append`` are atomic,
    so threads packing at once each hold a Packer of their own (no lock, no thread-local: the
    core imports no threading)."""
    try:
        packer = _PACKERS.pop()
    except IndexError:
        packer = msgpack.Packer(use_bin_type=True)
    try:
        frame: bytes = packer.pack(obj)  # autoreset: the buffer is emptied after each frame, or error
    finally:
        _PACKERS.append(packer)
    return frame


#: message class -> (its kind, its schema's encoder): filled on a class's first frame
_ENCODERS: dict[type, tuple[str, Callable[[Any], dict[str, Any]]]] = {}
#: message class -> (its kind, the encoder leaving its pack_once field last and None, the field,
#: its encoder, the packed values kept: id -> (value, bytes), how many): for classes that have one
_ONCE: dict[type, tuple[str, Callable[[Any], dict[str, Any]], str, Callable[[Any], Any], dict[int, tuple[Any, bytes]], int]] = {}


def encode(msg: Any) -> bytes:
    """Encode a message into one frame."""
    cls = type(msg)
    found = _ENCODERS.get(cls)
    if found is None:
        kind = getattr(cls, "KIND", None)
        if kind is None or _KINDS.get(kind) is not cls:
            raise TypeError(f"{cls.__name__} is not a registered wire message")
        schema = _schema(cls)
        if schema.pack_once is not None and schema.encode_head is not None:
            name, field_encoder, most = schema.pack_once
            _ONCE[cls] = (kind, schema.encode_head, name, field_encoder, {}, most)
        found = _ENCODERS[cls] = (kind, schema.encode)
    once = _ONCE.get(cls) if _ONCE else None
    if once is None:
        kind, body = found
        return _pack([WIRE_VERSION, kind, body(msg)])
    kind, head, name, field_encoder, kept, most = once
    value = getattr(msg, name)
    frame = _pack([WIRE_VERSION, kind, head(msg)])
    if value is None:  # packed as it is: None
        return frame
    hit = kept.get(id(value))
    if hit is None or hit[0] is not value:
        hit = kept[id(value)] = (value, _pack(field_encoder(value)))  # holding the value: its id is not reused meanwhile
        if len(kept) > most:
            try:
                del kept[next(iter(kept))]
            except (KeyError, RuntimeError, StopIteration):  # another thread evicted at once: it is bounded either way
                pass
    # the frame ends with the map's last value, that field's None (0xc0): its packed bytes go there
    return frame[:-1] + hit[1]


def kind_prefix(cls: type) -> bytes:
    """The bytes every frame of message class ``cls`` begins with: the array header, the wire
    version and the kind. A reader may sort frames by it before decoding them (the server
    answers heartbeats ahead of the frames queued before them); a frame that begins so is still
    decoded and checked in full, so a frame sorted wrongly is only handled in another order.

    Raises:
        TypeError: ``cls`` is not a registered wire message.
    """
    kind = getattr(cls, "KIND", None)
    if kind is None or _KINDS.get(kind) is not cls:
        raise TypeError(f"{cls.__name__} is not a registered wire message")
    return b"\x93" + _pack(WIRE_VERSION) + _pack(kind)


def to_plain(value: Any) -> Any:
    """A struct (or message) as plain msgpack-able data (for JSON dumps and tests)."""
    if hasattr(type(value), "__wire_schema__"):
        return _schema(type(value)).encode(value)
    return value


def from_plain(cls: type[T], data: Any) -> T:
    """Validate plain data against a struct's schema and build it."""
    built: T = _decode_body(_schema(cls), data, "")
    return built

