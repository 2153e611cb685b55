"""What a check asserts, and how: bytes equal (saying where they first differ), a bounded wait,
a read that must fail with a TransportError (naming the read), an endpoint that is plain
msgpack data. Failures are AssertionErrors (never ``assert``: the suite must also fail under
``python -O``)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import Any

import msgpack

from tensorhub.core.errors import TensorHubError, TransportError
from tensorhub.core.wire import MAX_OPAQUE_DEPTH
from tensorhub.testing.limits import _READ_TIMEOUT
from tensorhub.transports.base import RangeNotReady


def _first_difference(got: bytes, want: bytes, base: int = 0) -> str:
    """Where ``got`` first differs from ``want``, which start at transfer byte ``base``."""
    if len(got) != len(want):
        return f"{len(got)} bytes instead of {len(want)}"
    for i in range(0, len(want), 1 << 16):
        if got[i : i + (1 << 16)] != want[i : i + (1 << 16)]:
            j = next(k for k in range(i, min(i + (1 << 16), len(want))) if got[k] != want[k])
            return f"first difference at transfer byte {base + j}: got {got[j]:#04x}, want {want[j]:#04x}"
    return "no difference"


def _expect(ok: object, message: str) -> None:
    """A check's assertion (not ``assert``: the suite must also fail under ``python -O``)."""
    if not ok:
        raise AssertionError(message)


def _same_bytes(got: bytes, want: bytes, what: str, base: int = 0) -> None:
    if got != want:
        raise AssertionError(f"{what}: the bytes differ ({_first_difference(got, want, base)})")


async def _bounded(aw: Awaitable[Any], what: str, timeout: float = _READ_TIMEOUT) -> Any:
    try:
        return await asyncio.wait_for(aw, timeout)
    except TimeoutError as err:
        if isinstance(err, TensorHubError):
            raise
        raise AssertionError(f"{what} did not finish within {timeout:g} s") from err


async def _fails(aw: Awaitable[Any], what: str, not_ready: bool | None = False) -> TransportError:
    """``aw`` must raise TransportError: a RangeNotReady if ``not_ready``, anything but one if
    False, either if None."""
    try:
        await aw
    except TransportError as err:
        _failed_as_expected(err, what, not_ready)
        return err
    except AssertionError:
        raise
    except Exception as err:
        raise AssertionError(f"{what}: raised {type(err).__name__} ({err}), not a TransportError") from err
    raise AssertionError(f"{what}: returned normally; it must raise TransportError")


def _failed_as_expected(err: BaseException, what: str, not_ready: bool | None = False) -> None:
    """``err`` is the TransportError :func:`_fails` wants, else an AssertionError saying why."""
    if isinstance(err, AssertionError):
        raise err
    if not isinstance(err, TransportError):
        raise AssertionError(f"{what}: raised {type(err).__name__} ({err}), not a TransportError") from err  # noqa: TRY004 - a check's failure
    if not_ready is True and not isinstance(err, RangeNotReady):
        raise AssertionError(f"{what}: raised {type(err).__name__} ({err}), not RangeNotReady") from err
    if not_ready is False and isinstance(err, RangeNotReady):
        raise AssertionError(f"{what}: raised RangeNotReady ({err}); a retry cannot help here") from err


def _names_the_read(err: Exception, peer: Any, region: int, version: int, offset: int, what: str) -> None:
    text = str(err)
    missing = [w for w, s in (("region", region), ("version", version), ("range", offset)) if str(s) not in text]
    strings = [s for s in _scalars(peer) if isinstance(s, str) and s]
    if strings and not any(s in text for s in strings):
        missing.append("peer")
    if missing:
        raise AssertionError(
            f"{what}: the error {text!r} does not name the {', '.join(missing)} "
            f"(region {region}, version {version}, offset {offset}, peer {peer!r})"
        )


def _scalars(v: Any) -> list[Any]:
    """The leaf values of nested data (not the keys: those name fields, not this peer)."""
    if isinstance(v, dict):
        return [x for item in v.values() for x in _scalars(item)]
    if isinstance(v, list | tuple):
        return [x for item in v for x in _scalars(item)]
    return [v]


def _check_endpoint(ep: Any, who: str) -> None:
    _plain(ep, f"{who} endpoint", 1)  # the engine nests it one level down (by transport name)
    try:
        packed = msgpack.packb(ep, use_bin_type=True, strict_types=True)
    except (TypeError, ValueError, OverflowError) as err:
        raise AssertionError(f"{who} endpoint {ep!r} does not pack as msgpack: {err}") from err
    back = msgpack.unpackb(packed, raw=False, strict_map_key=True, use_list=True)
    _expect(_typed(back) == _typed(ep), f"{who} endpoint {ep!r} came back from msgpack as {back!r}")


def _plain(v: Any, path: str, depth: int) -> None:
    if depth > MAX_OPAQUE_DEPTH:
        raise AssertionError(f"{path} is nested deeper than the control plane carries ({MAX_OPAQUE_DEPTH})")
    t = type(v)
    if v is None or t in (bool, str, bytes):
        return
    if t is int:
        _expect(-(2**63) <= v < 2**64, f"{path} = {v} does not fit a msgpack integer")
        return
    if t is float:
        return
    if t is list:
        for i, x in enumerate(v):
            _plain(x, f"{path}[{i}]", depth + 1)
        return
    if t is dict:
        for k, x in v.items():
            _expect(type(k) is str, f"{path} has a key {k!r} of type {type(k).__name__}; keys must be str")
            _plain(x, f"{path}.{k}", depth + 1)
        return
    raise AssertionError(f"{path} is a {t.__name__} ({v!r}), not plain msgpack data")


def _typed(v: Any) -> Any:
    """``v`` with every value paired with its type, so that equality also compares types."""
    if type(v) is dict:
        return ("dict", tuple((k, _typed(x)) for k, x in v.items()))
    if type(v) is list:
        return ("list", tuple(_typed(x) for x in v))
    if type(v) is float and math.isnan(v):
        return ("float", "nan")
    return (type(v).__name__, v)
