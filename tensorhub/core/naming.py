"""Names: models, replicas, shards, absolute and relative versions, retention declarations.

A *version spec* is what callers pass to ``replicate``/``update``: an absolute version (an
``int`` >= 0), ``"latest"``, or ``"latest-k"``. :func:`parse_version_spec` turns it into a
:class:`VersionSpec`; its wire form is the canonical string (``"latest"``, ``"latest-2"``) or
the integer itself.

A *retention declaration* (``retain=`` at open) is ``None`` (retain nothing), ``"latest"`` or
``"latest-k"``: the highest published version and the k before it must stay available. It is
carried as the integer k (``None`` for no declaration).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeGuard

from .errors import InvalidName

__all__ = [
    "MAX_NAME_LEN",
    "MAX_SHARDS",
    "MAX_VERSION",
    "DELTA_SUFFIX",
    "SEED_SUFFIX",
    "VersionSpec",
    "parse_version_spec",
    "parse_retain",
    "retain_to_str",
    "delta_model",
    "delta_owner",
    "seed_owner",
    "seed_replica",
    "validate_model",
    "validate_replica",
    "validate_shard",
    "validate_version",
]

MAX_NAME_LEN = 128
MAX_SHARDS = 65536
MAX_VERSION = 2**63 - 1
MAX_RELATIVE = 1 << 20

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]*\Z")
_LATEST_RE = re.compile(r"latest(?:-([0-9]{1,7}))?\Z")


def _validate_name(what: str, name: object, **ctx: Any) -> str:
    if not isinstance(name, str):
        raise InvalidName(f"{what} name must be a str, got {type(name).__name__}", **ctx)
    if not name or len(name) > MAX_NAME_LEN:
        raise InvalidName(f"{what} name must have 1 to {MAX_NAME_LEN} characters, got {len(name)}", **ctx)
    if not _NAME_RE.match(name):
        raise InvalidName(
            f"{what} name {name!r} may only hold letters, digits and . _ : @ + - "
            "and must start with a letter or digit",
            **ctx,
        )
    return name


def validate_model(model: object) -> str:
    """Return ``model`` if it is a valid model name, else raise :class:`InvalidName`."""
    return _validate_name("model", model)


def validate_replica(replica: object, *, model: str | None = None) -> str:
    """Return ``replica`` if it is a valid replica name, else raise :class:`InvalidName`."""
    return _validate_name("replica", replica, model=model)


SEED_SUFFIX = "@seed"
"""The suffix of the replica that offload-seeds versions for a replica (DESIGN §5.6)."""


def seed_replica(replica: str) -> str:
    """The name of the offload seed replica of ``replica``.

    Raises:
        InvalidName: the result would be longer than :data:`MAX_NAME_LEN`.
    """
    name = replica + SEED_SUFFIX
    if len(name) > MAX_NAME_LEN:
        raise InvalidName(f"replica name {replica!r} is too long for offload seeding (at most {MAX_NAME_LEN - len(SEED_SUFFIX)} characters)")
    return name


def seed_owner(replica: str) -> str | None:
    """The replica an offload seed replica seeds for, or None if ``replica`` is not one."""
    return replica[: -len(SEED_SUFFIX)] or None if replica.endswith(SEED_SUFFIX) else None


DELTA_SUFFIX = "@delta"
"""The suffix of the model that holds a model's deltas (:mod:`tensorhub.core.table.deltas`):
version ``v`` of ``m@delta``, shard ``i``, is the delta that takes shard ``i`` of ``m`` from the
version published before ``v`` to ``v``, as one blob (a delta file's bytes)."""


def delta_model(model: str) -> str:
    """The name of the model holding ``model``'s deltas.

    Raises:
        InvalidName: the result would be longer than :data:`MAX_NAME_LEN`, or ``model`` is
            itself a delta model.
    """
    if model.endswith(DELTA_SUFFIX):
        raise InvalidName(f"model {model!r} is a delta model: deltas have no deltas of their own")
    name = model + DELTA_SUFFIX
    if len(name) > MAX_NAME_LEN:
        raise InvalidName(f"model name {model!r} is too long for deltas (at most {MAX_NAME_LEN - len(DELTA_SUFFIX)} characters)")
    return name


def delta_owner(model: str) -> str | None:
    """The model whose deltas ``model`` holds, or None if it is not a delta model."""
    return model[: -len(DELTA_SUFFIX)] or None if model.endswith(DELTA_SUFFIX) else None


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_shard(num_shards: object, shard_idx: object, **ctx: Any) -> tuple[int, int]:
    """Check ``num_shards`` in [1, MAX_SHARDS] and ``shard_idx`` in [0, num_shards)."""
    if not _is_int(num_shards) or not 1 <= num_shards <= MAX_SHARDS:
        raise InvalidName(f"num_shards must be an int in [1, {MAX_SHARDS}], got {num_shards!r}", **ctx)
    if not _is_int(shard_idx) or not 0 <= shard_idx < num_shards:
        raise InvalidName(f"shard_idx must be an int in [0, {num_shards}), got {shard_idx!r}", **ctx)
    return num_shards, shard_idx


def validate_version(version: object, **ctx: Any) -> int:
    """Return ``version`` if it is an absolute version (int in [0, 2**63)), else raise."""
    if not _is_int(version) or not 0 <= version <= MAX_VERSION:
        raise InvalidName(f"a version must be an int in [0, 2**63), got {version!r}", **ctx)
    return version


@dataclass(frozen=True, slots=True)
class VersionSpec:
    """A parsed version spec: absolute (``version`` set) or relative (``back`` versions before
    the latest available one)."""

    version: int | None = None
    back: int | None = None

    @property
    def relative(self) -> bool:
        return self.back is not None

    def resolve(self, latest: int) -> int:
        """The absolute version this spec names when ``latest`` is the highest available one.
        May be negative for ``latest-k`` past version 0 (the caller reports that)."""
        return latest - self.back if self.back is not None else self.absolute

    def wire(self) -> int | str:
        """The canonical form: the int, ``"latest"`` or ``"latest-k"``."""
        if self.back is None:
            return self.absolute
        return "latest" if self.back == 0 else f"latest-{self.back}"

    @property
    def absolute(self) -> int:
        """The version an absolute spec names.

        Raises:
            InvalidName: the spec is relative (or names nothing).
        """
        if self.version is None:
            raise InvalidName(f"{self!r} is not an absolute version spec")
        return self.version

    def __str__(self) -> str:
        return str(self.wire())


LATEST = VersionSpec(back=0)
_SPEC_CACHE: dict[str, VersionSpec] = {}  # relative specs seen so far (a handful in practice)
_INT_SPECS: dict[int, VersionSpec] = {}  # absolute specs seen lately (emptied when full)
_INT_SPECS_KEPT = 4096


def parse_version_spec(spec: object, **ctx: Any) -> VersionSpec:
    """Parse a version spec: an int >= 0, ``"latest"`` or ``"latest-k"`` (k >= 0).

    Raises:
        InvalidName: anything else, naming what was given.
    """
    if isinstance(spec, VersionSpec):
        return spec
    if type(spec) is int and 0 <= spec <= MAX_VERSION:
        found = _INT_SPECS.get(spec)
        if found is None:  # a frozen dataclass is slow to build: the table parses a spec per call
            if len(_INT_SPECS) >= _INT_SPECS_KEPT:
                _INT_SPECS.clear()
            found = _INT_SPECS[spec] = VersionSpec(version=spec)
        return found
    if type(spec) is str and not ctx:
        cached = _SPEC_CACHE.get(spec)
        if cached is not None:
            return cached
    if _is_int(spec):
        return VersionSpec(version=validate_version(spec, **ctx))
    if isinstance(spec, str):
        m = _LATEST_RE.match(spec)
        if m:
            back = int(m.group(1) or 0)
            if back <= MAX_RELATIVE:
                parsed = VersionSpec(back=back)
                if len(_SPEC_CACHE) < 4096:
                    _SPEC_CACHE[spec] = parsed
                return parsed
    raise InvalidName(
        f"a version must be an int >= 0, 'latest' or 'latest-k' (0 <= k <= {MAX_RELATIVE}), got {spec!r}", **ctx
    )


def parse_retain(retain: object, **ctx: Any) -> int | None:
    """Parse ``retain=``: ``None`` -> None; ``"latest"`` -> 0; ``"latest-k"`` -> k."""
    if retain is None:
        return None
    if isinstance(retain, str):
        spec = parse_version_spec(retain, **ctx) if retain.startswith("latest") else None
        if spec is not None:
            return spec.back
    raise InvalidName(f"retain must be None, 'latest' or 'latest-k', got {retain!r}", **ctx)


def retain_to_str(back: int | None) -> str | None:
    """Inverse of :func:`parse_retain`."""
    if back is None:
        return None
    return str(VersionSpec(back=back))
