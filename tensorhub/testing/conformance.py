"""The entry points of the conformance suite: :func:`check_transport` and
:func:`check_transport_async`, and :data:`CHECKS`, the checks they run, in order."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import random
from collections.abc import Iterable
from typing import Any

import msgpack

from tensorhub.core.errors import InvalidArgument
from tensorhub.runtime.actor import run
from tensorhub.testing import limits
from tensorhub.testing.assertions import _bounded
from tensorhub.testing.holder_process import _InChild
from tensorhub.testing.holders import _InProcess
from tensorhub.testing.pairs import _Ctx
from tensorhub.testing.registry import _REGISTRY
from tensorhub.testing.shards import _shard_data
from tensorhub.testing.under_test import TransportFactory, _checked, _factory, _path_of, _transport_class

# The checks register as their modules load, and run in that order (see CHECKS): keep this one.
# isort: off
from tensorhub.testing import endpoint_checks, read_checks, seqlock_checks, closing_checks, cuda_checks, grant_checks  # noqa: F401
# isort: on

#: The seed when none is given: ``$TENSORHUB_SEED``, as in the project's tests.
DEFAULT_SEED = 20261121

#: The checks, in the order they run, with what each asserts.
CHECKS: dict[str, str] = {name: " ".join((fn.__doc__ or "").split()) for name, (fn, _) in _REGISTRY.items()}


def _context(mp_context: Any) -> Any:
    """The multiprocessing context that starts holder processes (spawn unless told)."""
    context = mp_context
    if mp_context is None or isinstance(mp_context, str):
        try:
            context = multiprocessing.get_context(mp_context or "spawn")
        except ValueError as err:
            raise InvalidArgument(f"no start method {mp_context!r}: {err}") from err
    method = getattr(context, "get_start_method", lambda: None)()
    if method not in ("spawn", "forkserver"):
        raise InvalidArgument(
            f"the holder process starts with 'spawn' or 'forkserver' (forking a process that runs "
            f"threads is unsafe), not {method!r}"
        )
    return context


def _selected(skip: Iterable[str], only: Iterable[str] | None) -> list[str]:
    skip, chosen = set(skip), set(only) if only is not None else set(_REGISTRY)
    unknown = sorted((skip | chosen) - set(_REGISTRY))
    if unknown:
        raise InvalidArgument(f"unknown conformance checks {unknown}; known: {list(_REGISTRY)}")
    return [name for name in _REGISTRY if name in chosen and name not in skip]


async def check_transport_async(
    transport: str | TransportFactory,
    options: dict[str, Any] | None = None,
    *,
    seed: int | None = None,
    skip: Iterable[str] = (),
    only: Iterable[str] | None = None,
    large_bytes: int = 64 << 20,
    timeout: float = 60.0,
    holder_process: bool = False,
    mp_context: Any = None,
) -> dict[str, str]:
    """:func:`check_transport` on the running event loop."""
    seed = int(os.environ.get("TENSORHUB_SEED", DEFAULT_SEED)) if seed is None else seed
    if type(large_bytes) is not int or large_bytes < 1024:
        raise InvalidArgument(f"large_bytes must be an integer >= 1024, got {large_bytes!r}")
    options = dict(options or {})
    hosting: _InProcess | _InChild
    if holder_process:
        path = _path_of(transport)
        make, label = _checked(_transport_class(path), path), path
        try:
            msgpack.packb(options, use_bin_type=True, strict_types=True)
        except (TypeError, ValueError, OverflowError) as err:
            raise InvalidArgument(f"with holder_process=True the options go to the holder process as msgpack: {err}") from err
        hosting = _InChild(_context(mp_context), path)  # starts its process when a check needs it
    else:
        make, label = _factory(transport)
        hosting = _InProcess()
    names = _selected(skip, only)
    probe = make(dict(options))  # capability flags, and whether the options are accepted
    outcome: dict[str, str] = {}
    loop = asyncio.get_running_loop()
    try:
        for name in names:
            fn, needs = _REGISTRY[name]
            why = needs(probe)
            if why is not None:
                outcome[name] = f"skipped: {why}"
                continue
            ctx = _Ctx(name, random.Random(f"{seed}:{name}"), make, dict(options), large_bytes, loop, hosting,
                       gathers=bool(getattr(probe, "gathers", False)))  # fmt: skip
            prefix = f"check_transport({label}): check {name!r} failed (seed={seed})"
            try:
                await _bounded(fn(ctx), "the check", timeout)
            except AssertionError as err:
                raise AssertionError(f"{prefix}: {err}") from err
            except Exception as err:
                raise AssertionError(f"{prefix}: {type(err).__name__}: {err}") from err
            outcome[name] = "passed"
    finally:
        with contextlib.suppress(Exception):
            await _bounded(probe.close(), "close() of a transport that never started", limits._CLOSE_TIMEOUT)
        await hosting.close()
        _shard_data.cache_clear()
    return outcome


def check_transport(
    transport: str | TransportFactory,
    options: dict[str, Any] | None = None,
    *,
    seed: int | None = None,
    skip: Iterable[str] = (),
    only: Iterable[str] | None = None,
    large_bytes: int = 64 << 20,
    timeout: float = 60.0,
    holder_process: bool = False,
    mp_context: Any = None,
) -> dict[str, str]:
    """Run the transport conformance suite; every transport's tests call this.

    It makes fresh instances for each check (a holder and one or more readers) with
    ``options`` plus a ``wait_timeout`` the check chooses, and runs the checks of
    :data:`CHECKS` in order on an event loop of its own (use :func:`check_transport_async`
    from a running loop). The readers run in this process; the holder too, unless
    ``holder_process``: then it runs in a child process (see "Across processes" in the module
    docstring for the checks that differ), e.g.
    ``check_transport("nixl", {"describe_timeout": 10.0}, holder_process=True)``. With the
    default ``spawn`` the child imports the caller's main module again: a script that calls
    this must do so under ``if __name__ == "__main__":``.

    Args:
        transport: a registered transport name, a ``"module:Class"`` path, a Transport
            subclass, or a factory called with an options dict that returns a Transport
            instance (e.g. one wrapped in faults). With ``holder_process`` only a name, a path
            or a class importable at module level will do: the child makes the holder.
        options: the transport's options (the suite sets ``wait_timeout`` itself); msgpack data
            with ``holder_process``.
        seed: seeds every random choice; default ``$TENSORHUB_SEED`` or :data:`DEFAULT_SEED`.
        skip: names of checks that do not apply to this transport (say why in the caller).
        only: run just these checks.
        large_bytes: size of the large read (default 64 MiB).
        timeout: seconds one check may take.
        holder_process: run the holder side of every check in a child process (one for the
            whole call, replaced after ``peer_death`` kills it; gone when this returns).
        mp_context: how to start that process: ``"spawn"`` (default), ``"forkserver"``, or a
            multiprocessing context of either kind (a test suite's forkserver that preloads
            torch starts it in a fraction of a second).

    Returns:
        ``{check name: "passed" | "skipped: <why>"}``; checks the capability flags or the machine
        rule out (``cuda_buffers`` without a CUDA device) are skipped, not failed.

    Raises:
        AssertionError: a check failed; the message names the check, the transport and the seed.
        InvalidArgument: an unknown check name, a factory that does not make a Transport, or
            (``holder_process``) a transport the child cannot make, options that are not
            msgpack data, or a start method other than spawn or forkserver.
    """
    return run(
        check_transport_async(
            transport,
            options,
            seed=seed,
            skip=skip,
            only=only,
            large_bytes=large_bytes,
            timeout=timeout,
            holder_process=holder_process,
            mp_context=mp_context,
        )
    )
