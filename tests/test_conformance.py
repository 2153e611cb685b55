"""The transport conformance suite (``tensorhub.testing.check_transport``) run against every
built-in transport, and run against deliberately broken transports to show that it fails them:
a suite that cannot fail proves nothing. Also the ``memory`` transport's own behaviour beyond
the suite (options, endpoints of other processes, the weak registry, CUDA-style staging).

Every transport a test starts is closed before it ends; every wait is bounded.
"""

from __future__ import annotations

import gc
import os
import re

import pytest
import torch

from tensorhub import testing
from tensorhub.core.errors import InvalidArgument, TransportError
from tensorhub.runtime.actor import run
from tensorhub.testing import CHECKS, check_transport
from tensorhub.transports.base import RangeNotReady
from tensorhub.transports.buffers import ShardBuffers, layout_of
from tensorhub.transports.faults import FaultyTransport, wrap
from tensorhub.transports.memory import MemoryTransport
from tensorhub.transports.registry import get_transport
from tensorhub.transports.tcp import TcpTransport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


# --- the built-in transports pass --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tcp", "memory"])
def test_builtin_transport_conforms(name: str, seed: int) -> None:
    outcome = check_transport(name, seed=seed)
    assert list(outcome) == list(CHECKS)
    open_plane = {"grant_tokens"} if name == "memory" else set()  # in-process only: it checks no tokens
    assert {k for k, v in outcome.items() if v != "passed"} <= {"cuda_buffers"} | open_plane
    if not torch.cuda.is_available():
        assert outcome["cuda_buffers"] == "skipped: no CUDA device"
    if name == "tcp":
        assert outcome["grant_tokens"] == "passed"


def test_a_fault_wrapper_without_faults_conforms_in_place_of_tcp(seed: int) -> None:
    # Smaller large read: the full 64 MiB one already ran for tcp itself.
    outcome = check_transport(lambda options: wrap(TcpTransport(options), []), seed=seed, large_bytes=8 << 20)
    assert set(outcome.values()) <= {"passed", "skipped: no CUDA device"}


def test_selection_and_its_errors(seed: int) -> None:
    assert check_transport("memory", seed=seed, only=["start_endpoint", "tiny_ranges"]) == {
        "start_endpoint": "passed",
        "tiny_ranges": "passed",
    }
    skipped = set(CHECKS) - {"endpoint_msgpack"}
    assert check_transport("memory", seed=seed, skip=skipped) == {"endpoint_msgpack": "passed"}
    with pytest.raises(InvalidArgument, match=r"unknown conformance checks \['nope'\]"):
        check_transport("memory", skip=["nope"])
    with pytest.raises(InvalidArgument, match="no transport named 'nope'"):
        check_transport("nope")
    with pytest.raises(InvalidArgument, match="made a dict, not a Transport"):
        check_transport(lambda options: {}, only=["start_endpoint"])


def test_a_transport_named_by_path_conforms_in_process(seed: int) -> None:
    # The same names check_transport(..., holder_process=True) takes (see test_conformance_processes).
    path = "tensorhub.transports.memory:MemoryTransport"
    assert check_transport(path, seed=seed, only=["odd_ranges"]) == {"odd_ranges": "passed"}
    with pytest.raises(InvalidArgument, match="does not load: ModuleNotFoundError"):
        check_transport("transports.nope:Nope", only=["odd_ranges"])


def test_every_check_says_what_it_asserts() -> None:
    assert all(len(doc) > 40 for doc in CHECKS.values()), CHECKS


# --- broken transports fail -----------------------------------------------------------------------


class IgnoresGeneration(MemoryTransport):
    """Drops the seqlock: neither the caller's generation nor a change during the copy counts."""

    async def read(self, peer, region, version, offset, length, into, generation):  # type: ignore[override]
        return await super().read(peer, region, version, offset, length, into, None)

    def _seqlock(self, src, version, gen, generation, where) -> None:  # type: ignore[override]
        return None


class ReturnsAfterPeerDeath(MemoryTransport):
    """Keeps copying from a holder that closed, and returns normally."""

    def _check_open(self, holder, where) -> None:  # type: ignore[override]
        if self._closed:
            raise TransportError("closed")

    def _copy(self, holder, src, into, offset, length, where) -> None:  # type: ignore[override]
        from tensorhub.transports.memory import _copy_piece

        _copy_piece(src, into, offset, length)


class ReturnsPartialBytes(MemoryTransport):
    """Copies only the first piece of a read and returns normally."""

    def _copy(self, holder, src, into, offset, length, where) -> None:  # type: ignore[override]
        super()._copy(holder, src, into, offset, min(length, 4096), where)


class ServesUncovered(MemoryTransport):
    """Does not wait for a partial holder's progress."""

    def _wait(self, holder, src, version, end, generation, where) -> int:  # type: ignore[override]
        return src.progress.snapshot()[0]

    def _seqlock(self, src, version, gen, generation, where) -> None:  # type: ignore[override]
        return None


class NeverNotReady(MemoryTransport):
    """Reports an uncovered range as a plain failure (the engine would drop a healthy source)."""

    def _wait(self, holder, src, version, end, generation, where) -> int:  # type: ignore[override]
        try:
            return super()._wait(holder, src, version, end, generation, where)
        except RangeNotReady as err:
            raise TransportError(str(err)) from None


class TupleEndpoint(MemoryTransport):
    def endpoint(self) -> dict:
        return {**super().endpoint(), "where": ("host", 1)}


class OffByOne(MemoryTransport):
    """Copies the range one byte late."""

    def _copy(self, holder, src, into, offset, length, where) -> None:  # type: ignore[override]
        if 0 < offset and length:
            super()._copy(holder, src, into, offset - 1, length, where)
        else:
            super()._copy(holder, src, into, offset, length, where)


class SharedEndpoint(MemoryTransport):
    def endpoint(self) -> dict:
        return {"id": "memory-shared", "pid": os.getpid()}


class HangsOnClose(MemoryTransport):
    async def close(self) -> None:
        import asyncio

        await super().close()
        await asyncio.sleep(3600)


@pytest.mark.parametrize(
    ("broken", "check", "match"),
    [
        (IgnoresGeneration, "seqlock_between", "returned normally"),
        (IgnoresGeneration, "seqlock_during", "returned normally"),
        (ReturnsAfterPeerDeath, "peer_death", "a read during which the holder closed: returned normally"),
        (ReturnsPartialBytes, "odd_ranges", "the bytes differ"),
        (ReturnsPartialBytes, "large_range", "the bytes differ"),
        # Either of two correct failures, as the scheduler decides: its reads ended before the
        # holder's first byte (seen 50 ms later), or they ended later, with zeros where the bytes go.
        (ServesUncovered, "partial_holder", "ended before any byte was verified|reads from a partial holder: the bytes differ"),
        (NeverNotReady, "range_not_ready", "not RangeNotReady"),
        (TupleEndpoint, "endpoint_msgpack", r"endpoint\.where is a tuple"),
        (OffByOne, "odd_ranges", "the bytes differ"),
        (SharedEndpoint, "start_endpoint", "have the same endpoint"),
    ],
)
def test_the_suite_fails_a_broken_transport(broken: type, check: str, match: str, seed: int) -> None:
    with pytest.raises(AssertionError) as info:
        check_transport(broken, seed=seed, only=[check], large_bytes=1 << 20)
    text = str(info.value)
    assert text.startswith(f"check_transport({broken.__qualname__}): check {check!r} failed (seed={seed})"), text
    assert re.search(match, text), text


def test_corrupted_bytes_fail_the_suite(seed: int) -> None:
    def corrupting(options: dict) -> FaultyTransport:
        return wrap(MemoryTransport(options), [{"op": "corrupt", "at": 777, "times": 0}])

    with pytest.raises(AssertionError, match=r"check 'odd_ranges' failed .*first difference at transfer byte 777"):
        check_transport(corrupting, seed=seed, only=["odd_ranges"])


def test_a_hanging_close_fails_the_suite_instead_of_hanging_it(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testing.limits, "_CLOSE_TIMEOUT", 0.5)
    with pytest.raises(AssertionError, match=r"check 'start_endpoint' failed .*close\(\) of HangsOnClose did not finish within 0.5 s"):
        check_transport(HangsOnClose, seed=seed, only=["start_endpoint"])


def test_the_full_suite_stops_at_the_first_failing_check(seed: int) -> None:
    with pytest.raises(AssertionError, match="check 'seqlock_between' failed"):
        check_transport(IgnoresGeneration, seed=seed, large_bytes=1 << 20)


# --- the memory transport beyond the suite -----------------------------------------------------------


def test_memory_is_registered() -> None:
    assert get_transport("memory") is MemoryTransport


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"bogus": 1}, r"unknown memory transport options \['bogus'\]"),
        ({"wait_timeout": -1}, "'wait_timeout' must be a finite number >= 0.0, got -1"),
        ({"wait_timeout": float("inf")}, "'wait_timeout' must be a finite number"),
        ({"wait_timeout": "5"}, "'wait_timeout' must be a finite number"),
        ({"piece_bytes": 0}, "'piece_bytes' must be an integer >= 1"),
        ({"piece_bytes": 1.5}, "'piece_bytes' must be an integer"),
        ({"threads": 0}, "'threads' must be an integer >= 1"),
    ],
)
def test_memory_options_are_validated(options: dict, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        MemoryTransport(options)


def shard(held_cls: type[ShardBuffers] = ShardBuffers, into_cls: type[ShardBuffers] = ShardBuffers) -> tuple[ShardBuffers, ShardBuffers, bytes]:
    """A holder of version 3 (an int32 tensor that gets packed, and a 3 MiB one), and zeroed
    reader buffers of the same layout."""

    def tensors() -> dict[str, torch.Tensor]:
        return {"a": torch.zeros(5000, dtype=torch.int32), "b": torch.zeros(3 << 20, dtype=torch.uint8)}

    t = tensors()
    held = held_cls(t, layout_of(t))
    data = bytes(range(1, 256)) * (held.total_bytes // 255) + bytes(range(1, 256))[: held.total_bytes % 255]
    pos = 0
    for v in ShardBuffers.views(held, 0, held.total_bytes):
        v[:] = data[pos : pos + len(v)]
        pos += len(v)
    held.progress.reset(3, held.total_bytes)
    z = tensors()
    return held, into_cls(z, layout_of(z)), data


def test_memory_refuses_endpoints_it_cannot_reach() -> None:
    held, into, _ = shard()

    async def main() -> None:
        holder, reader = MemoryTransport(), MemoryTransport()
        await holder.start()
        holder.serve(lambda r, v: held)
        holder.expose(held)
        try:
            ep = holder.endpoint()
            for peer, match in (
                ({}, "has no id"),
                (None, "has no id"),
                ({**ep, "pid": ep["pid"] + 1}, f"the peer is in process {ep['pid'] + 1}, this is {os.getpid()}"),
                ({**ep, "id": "memory-0-0"}, "region 1 version 3 bytes \\[0, 10\\): no such peer in this process"),
            ):
                with pytest.raises(TransportError, match=match):
                    await reader.read(peer, 1, 3, 0, 10, into, None)  # type: ignore[arg-type]
            assert await reader.read(ep, 1, 3, 0, 10, into, None) == held.progress.generation
        finally:
            await reader.close()
            await holder.close()

    run(main())


def test_memory_registry_does_not_keep_a_dropped_transport_alive() -> None:
    held, into, _ = shard()

    async def main() -> None:
        holder, reader = MemoryTransport(), MemoryTransport()
        await holder.start()
        holder.serve(lambda r, v: held)
        holder.expose(held)
        ep = holder.endpoint()
        await reader.read(ep, 1, 3, 0, 10, into, None)
        del holder
        gc.collect()
        with pytest.raises(TransportError, match="no such peer"):
            await reader.read(ep, 1, 3, 0, 10, into, None)
        await reader.close()

    run(main())


class StagedOnly(ShardBuffers):
    """CPU buffers that behave like CUDA memory: no views, only copy_out / copy_in."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_cuda = True

    def views(self, offset: int, length: int) -> list[memoryview]:
        raise InvalidArgument("CUDA memory; stage it")

    def copy_out(self, offset: int, dest: memoryview) -> None:
        pos = 0
        for v in ShardBuffers.views(self, offset, len(dest)):
            dest[pos : pos + len(v)] = v
            pos += len(v)

    def copy_in(self, offset: int, src: memoryview) -> None:
        pos = 0
        for v in ShardBuffers.views(self, offset, len(src)):
            v[:] = src[pos : pos + len(v)]
            pos += len(v)


@pytest.mark.parametrize(("src_staged", "dst_staged"), [(True, False), (False, True), (True, True)])
def test_memory_stages_buffers_without_views(src_staged: bool, dst_staged: bool) -> None:
    held, into, data = shard(StagedOnly if src_staged else ShardBuffers, StagedOnly if dst_staged else ShardBuffers)

    async def main() -> None:
        holder, reader = MemoryTransport({"piece_bytes": 100_000}), MemoryTransport()
        await holder.start()
        holder.serve(lambda r, v: held)
        holder.expose(held)
        try:
            got = await reader.read(holder.endpoint(), 1, 3, 7, held.total_bytes - 9, into, None)
            assert got == held.progress.generation
        finally:
            await reader.close()
            await holder.close()

    run(main())
    out = b"".join(bytes(v) for v in ShardBuffers.views(into, 0, into.total_bytes))
    assert out[7:-2] == data[7:-2] and out[:7] == bytes(7) and out[-2:] == bytes(2)
