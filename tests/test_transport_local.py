"""The ``local`` transport: the conformance suite in this process, then real cross-process reads
(``process_vm_readv`` from a holder in a worker process): byte-exact reads, a partial holder
read while it advances (pipelined), withdraw and generation changes seen through the progress
words, a holder SIGKILLed mid-read, bad endpoints and descriptions, ``reaches``, and a rough
throughput report (printed, never asserted).

Processes are few (importing torch costs seconds): one holder worker for the module, and one
more that the kill test kills. Every transport a test makes is closed; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import itertools
import os
import queue
import random
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tensorhub.core.errors import InvalidArgument, TransportError
from tensorhub.runtime.actor import run
from tensorhub.testing import CHECKS, check_transport
from tensorhub.transports import local
from tensorhub.transports.base import RangeNotReady
from tensorhub.transports.buffers import WORD_BYTES, ShardBuffers, layout_of, memory_of
from tensorhub.transports.local import LocalTransport
from tensorhub.transports.registry import get_transport
from tensorhub.transports.sidechannel import SideServer

from .procs import mp

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

VERSION = 5

#: Checks the suite cannot run on a one-sided transport: their hooks fire only when a transport
#: copies through the holder's ShardBuffers.views()/copy_out(), and this one reads raw memory.
#: Their substance is tested below (a hooked copy loop, and a real holder process killed).
SKIPPED = {
    "seqlock_during": "the suite's hook fires only through ShardBuffers.views/copy_out; this transport reads raw memory",
    "peer_death": "the suite's hook fires only through ShardBuffers.views/copy_out; this transport reads raw memory",
}


# --- the suite -----------------------------------------------------------------------------------


def test_local_is_registered_and_available() -> None:
    assert get_transport("local") is LocalTransport
    assert LocalTransport.available()
    assert (LocalTransport.one_sided, LocalTransport.cross_host) == (True, False)


def test_local_conforms(seed: int) -> None:
    outcome = check_transport("local", {"describe_timeout": 5.0}, seed=seed, skip=SKIPPED)
    assert list(outcome) == [c for c in CHECKS if c not in SKIPPED]
    assert {k for k, v in outcome.items() if v != "passed"} <= {"cuda_buffers"}


def test_local_conforms_across_processes(seed: int) -> None:
    """The whole suite with the holder in another process: real ``process_vm_readv`` between
    address spaces, with packs kept in place on one side or the other."""
    outcome = check_transport("local", {"describe_timeout": 5.0}, seed=seed, holder_process=True, mp_context=mp())
    assert list(outcome) == list(CHECKS)
    assert {k for k, v in outcome.items() if v != "passed"} <= {"cuda_buffers"}


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"bogus": 1}, r"unknown local transport options \['bogus'\]"),
        ({"host": ""}, "'host' must be a non-empty string"),
        ({"host": 5}, "'host' must be a non-empty string"),
        ({"wait_timeout": -1}, "'wait_timeout' must be a finite number >= 0.0, got -1"),
        ({"wait_timeout": float("nan")}, "'wait_timeout' must be a finite number"),
        ({"describe_timeout": 0}, "'describe_timeout' must be a finite number >= 0.001"),
        ({"piece_bytes": 0}, "'piece_bytes' must be an integer >= 1"),
        ({"piece_bytes": 2.0}, "'piece_bytes' must be an integer"),
        ({"threads": 0}, "'threads' must be an integer >= 1"),
        ({"streams": True}, "'streams' must be an integer"),
        ({"read_bytes": 0}, "'read_bytes' must be an integer >= 1"),
        ({"read_bytes": 1.5}, "'read_bytes' must be an integer"),
    ],
)
def test_options_are_validated(options: dict, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        LocalTransport(options)


def test_a_pull_through_local_is_planned_in_its_read_size_unless_a_chunk_size_was_given() -> None:
    """Each read costs the engine a round trip through its loop: a pull whose grant goes through
    ``local`` reads 32 MiB at a time (whole checksum units), unless the engine was given a chunk."""
    from tensorhub.runtime.engine import EngineActor, _Slot

    buf = new_buffers(100 << 20)
    t = LocalTransport({"read_bytes": 24 << 20})
    try:
        for chunk, want in ((None, 24 << 20), (8 << 20, 8 << 20)):
            engine = EngineActor({"local": t}, chunk_bytes=chunk)
            slot = _Slot(1, 1, buf, lambda build, unanswered: None, {})
            slot.read_hint = t.read_bytes
            pull = engine._new_pull(slot, VERSION)
            sizes = [n for _, n in pull.ranges]
            assert sum(sizes) == buf.total_bytes and max(sizes) == want, (chunk, sizes)
            slot.read_hint = 0  # a transport that asks for nothing: the engine's 8 MiB
            assert max(n for _, n in engine._new_pull(slot, VERSION).ranges) == 8 << 20
    finally:
        run(t.close())


def test_streams_option_sets_the_engines_concurrency() -> None:
    t = LocalTransport({"streams": 7})
    assert t.streams == 7 and LocalTransport.streams == 4
    run(t.close())


# --- shards shared by the holder process and the tests ---------------------------------------------


def specs(nbig: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Tiny tensors (one pack) and two large ones at odd sizes."""
    return [
        ("head", torch.float16, (1001,)),
        ("ids", torch.int32, (100,)),
        ("big", torch.uint8, (nbig,)),
        ("tail", torch.int32, (777,)),
        ("big2", torch.bfloat16, (1_500_007,)),
    ]


def new_buffers(nbig: int, shared: bool = False) -> ShardBuffers:
    tensors = {n: torch.zeros(s, dtype=d) for n, d, s in specs(nbig)}
    return ShardBuffers(tensors, layout_of(tensors), shared_memory=shared)


def content(total: int, seed: int) -> torch.Tensor:
    """Seeded bytes of the transfer space (a random tile of prime length, repeated)."""
    g = torch.Generator().manual_seed(seed)
    tile = torch.randint(0, 256, (1_048_583,), dtype=torch.uint8, generator=g)
    return tile.repeat(total // tile.numel() + 1)[:total].contiguous()


def write(buf: ShardBuffers, data: torch.Tensor, start: int, end: int) -> None:
    src = memory_of(data)
    pos = start
    for v in buf.views(start, end - start):
        v[:] = src[pos : pos + len(v)]
        pos += len(v)


def space(buf: ShardBuffers) -> torch.Tensor:
    """A copy of the whole transfer space."""
    return torch.cat([torch.frombuffer(v, dtype=torch.uint8).clone() for v in buf.views(0, buf.total_bytes)])


def same(buf: ShardBuffers, data: torch.Tensor) -> bool:
    return torch.equal(space(buf), data)


# --- the holder process ------------------------------------------------------------------------------


def _holder_main(cmds: Any, results: Any, options: dict) -> None:
    """A holder worker: one LocalTransport serving named shards, driven by commands."""
    loop = asyncio.new_event_loop()
    t = LocalTransport(options)
    loop.run_until_complete(t.start())
    held: dict[str, tuple[ShardBuffers, torch.Tensor, int]] = {}
    feeds: dict[str, tuple[threading.Thread, list[tuple[int, float]]]] = {}

    def resolve(region: int, version: int) -> ShardBuffers | None:
        return next((b for b, _, r in held.values() if r == region and version == VERSION), None)

    t.serve(resolve)
    results.put(("ok", t.endpoint()))

    def feed(buf: ShardBuffers, data: torch.Tensor, steps: list[int], interval: float, times: list) -> None:
        done = 0
        for end in steps:
            time.sleep(interval)
            write(buf, data, done, end)
            buf.progress.advance(end)
            times.append((end, time.monotonic()))
            done = end

    for _ in range(100_000):
        cmd, args = cmds.get()
        try:
            if cmd == "exit":
                break
            if cmd == "hold":  # name, nbig, region, seed, verified (None: all)[, in shared memory]
                name, nbig, region, seed, verified, *shared = args
                buf = new_buffers(nbig, shared=bool(shared and shared[0]))
                data = content(buf.total_bytes, seed)
                verified = buf.total_bytes if verified is None else verified
                write(buf, data, 0, verified)
                held[name] = (buf, data, region)
                t.expose(buf)
                value: Any = buf.progress.reset(VERSION, verified)
            elif cmd == "feed":  # name, steps, interval: write and advance in a thread
                name, steps, interval = args
                buf, data, _ = held[name]
                times: list[tuple[int, float]] = []
                th = threading.Thread(target=feed, args=(buf, data, steps, interval, times), daemon=True)
                th.start()
                feeds[name] = (th, times)
                value = None
            elif cmd == "times":
                th, times = feeds.pop(args[0])
                th.join(30)
                value = list(times)
            elif cmd == "withdraw":
                t.withdraw(held[args[0]][0])
                value = None
            elif cmd == "expose":
                t.expose(held[args[0]][0])
                value = None
            elif cmd == "bump":  # the generation moves, same version, all verified
                buf = held[args[0]][0]
                value = buf.progress.reset(VERSION, buf.total_bytes)
            elif cmd == "drop":
                buf = held.pop(args[0])[0]
                t.withdraw(buf)
                value = None
            else:
                raise ValueError(f"unknown command {cmd!r}")
            results.put(("ok", value))
        except Exception as err:  # noqa: BLE001 - reported to the test
            results.put(("err", f"{type(err).__name__}: {err}"))
    loop.run_until_complete(t.close())
    results.put(("ok", None))


class Holder:
    """A holder worker process."""

    def __init__(self, options: dict | None = None) -> None:
        ctx = mp()
        self.cmds, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_holder_main, args=(self.cmds, self.results, options or {}), daemon=True)
        self.proc.start()
        self.endpoint = self._result(120.0)

    def _result(self, timeout: float) -> Any:
        try:
            got = self.results.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"holder {self.proc.pid} gave no answer in {timeout} s") from None
        if got[0] == "err":
            raise RuntimeError(got[1])
        return got[1]

    def call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        self.cmds.put((cmd, args))
        return self._result(timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def exit(self) -> None:
        if self.proc.is_alive():
            self.cmds.put(("exit", ()))
            self.proc.join(20)
        self.kill()
        self.cmds.close()
        self.results.close()


@pytest.fixture(scope="module")
def holder() -> Iterator[Holder]:
    h = Holder()
    yield h
    h.exit()


_REGIONS = iter(range(100, 10_000))


def hold(h: Holder, nbig: int, seed: int, verified: int | None = None, shared: bool = False) -> tuple[str, int, int, torch.Tensor]:
    """A new shard on ``h`` (its CPU regions in shared memory if ``shared``): (name, region,
    generation, its bytes)."""
    region = next(_REGIONS)
    name = f"s{region}"
    gen = h.call("hold", name, nbig, region, seed, verified, shared)
    return name, region, gen, content(new_buffers(nbig).total_bytes, seed)


# --- cross-process reads ---------------------------------------------------------------------------


def test_reads_from_another_process_are_byte_exact(holder: Holder, seed: int) -> None:
    name, region, gen, data = hold(holder, 8 << 20, seed)
    into = new_buffers(8 << 20)
    total = into.total_bytes
    rng = random.Random(seed)
    cuts = sorted({0, total, *rng.sample(range(1, total), 30)})

    async def main() -> None:
        reader = LocalTransport({"piece_bytes": 1 << 20})
        try:
            got = await asyncio.gather(
                *(reader.read(holder.endpoint, region, VERSION, a, b - a, into, None) for a, b in itertools.pairwise(cuts))
            )
            assert set(got) == {gen}
            assert await reader.read(holder.endpoint, region, VERSION, 0, 0, into, gen) == gen
        finally:
            await reader.close()

    run(main())
    assert holder.endpoint["pid"] != os.getpid()
    assert same(into, data)
    holder.call("drop", name)


def test_a_holder_in_shared_memory_in_another_process_is_mapped_and_read_byte_exact(
    holder: Holder, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder's regions in shared memory: the reader maps its files and copies them with
    ``memmove``; only the 32 bytes of progress words go through ``process_vm_readv``."""
    name, region, gen, data = hold(holder, 5 << 20, seed, shared=True)
    into = new_buffers(5 << 20)
    moved: list[int] = []
    vm_calls: list[int] = []
    memmove, vm_span = local._memmove, local._vm_read_span

    def spy_memmove(dst: list[tuple[int, int]], src: list[tuple[int, int]]) -> None:
        moved.append(sum(n for _, n in dst))
        memmove(dst, src)

    def spy_vm_span(readv: Any, pid: int, dst: int, src: int, n: int) -> None:
        vm_calls.append(n)
        vm_span(readv, pid, dst, src, n)

    monkeypatch.setattr(local, "_memmove", spy_memmove)
    monkeypatch.setattr(local, "_vm_read_span", spy_vm_span)

    async def main() -> dict[str, int]:
        reader = LocalTransport()
        try:
            assert await reader.read(holder.endpoint, region, VERSION, 0, into.total_bytes, into, None) == gen
            return reader.stats()
        finally:
            await reader.close()

    stats = run(main())
    holder.call("drop", name)
    assert holder.endpoint["pid"] != os.getpid()
    assert same(into, data)
    assert stats["shared_mapped"] == 3 and stats["shared_fallbacks"] == 0, stats  # the pack and two large tensors
    assert sum(moved) == into.total_bytes and max(vm_calls) <= WORD_BYTES, (sum(moved), max(vm_calls))


def test_a_partial_holder_is_read_as_it_advances(holder: Holder, seed: int) -> None:
    """Reads wait for the holder's progress and finish as it covers them, not at the end."""
    name, region, gen, data = hold(holder, 4 << 20, seed, verified=0)
    into = new_buffers(4 << 20)
    total = into.total_bytes
    steps = [total * k // 16 for k in range(1, 17)]
    ranges = [(total * k // 8, total * (k + 1) // 8 - total * k // 8) for k in range(8)]
    finished: dict[int, float] = {}

    async def main() -> None:
        reader = LocalTransport({"wait_timeout": 30.0, "streams": 8})

        async def one(k: int, offset: int, length: int) -> int:
            got = await reader.read(holder.endpoint, region, VERSION, offset, length, into, gen)
            finished[k] = time.monotonic()
            return got

        try:
            tasks = [asyncio.ensure_future(one(k, o, n)) for k, (o, n) in enumerate(ranges)]
            await asyncio.sleep(0.2)
            assert not any(t.done() for t in tasks), "a read ended before any byte was verified"
            await asyncio.get_running_loop().run_in_executor(None, holder.call, "feed", name, steps, 0.1)
            assert set(await asyncio.gather(*tasks)) == {gen}
        finally:
            await reader.close()

    run(main())
    times = dict(holder.call("times", name))
    assert same(into, data)
    for k, (offset, length) in enumerate(ranges):
        covered_at = min(t for end, t in times.items() if end >= offset + length)
        assert finished[k] >= covered_at, f"read {k} ended before the holder covered it"
    # Pipelined: the first range landed long before the holder finished (16 steps of 0.1 s).
    assert finished[0] < times[total] - 0.5, (finished, times)
    holder.call("drop", name)


def test_a_read_behind_a_partial_holder_paces_its_looks_by_the_holders_rate(holder: Holder, seed: int) -> None:
    """A read waiting for a range far ahead of a holder that advances steadily looks at the
    holder's words a few times per step once it has seen the rate, not every millisecond (each
    look takes the holder's memory map lock), and still ends soon after the range is covered."""
    name, region, gen, data = hold(holder, 4 << 20, seed, verified=0)
    into = new_buffers(4 << 20)
    total = into.total_bytes
    steps = [total * k // 20 for k in range(1, 21)]  # 20 steps of 40 ms: about 0.8 s
    offset = total * 7 // 8
    looks = 0
    finished = 0.0

    async def main() -> None:
        nonlocal finished
        reader = LocalTransport({"wait_timeout": 30.0})
        words = reader._words

        def counted(*args: Any) -> Any:
            nonlocal looks
            looks += 1
            return words(*args)

        reader._words = counted  # type: ignore[method-assign]
        try:
            task = asyncio.ensure_future(reader.read(holder.endpoint, region, VERSION, offset, total - offset, into, gen))
            await asyncio.get_running_loop().run_in_executor(None, holder.call, "feed", name, steps, 0.04)
            assert await task == gen
            finished = time.monotonic()
        finally:
            await reader.close()

    run(main())
    times = dict(holder.call("times", name))
    covered_at = times[total]
    fed_for = covered_at - min(times.values())
    assert torch.equal(space(into)[offset:], data[offset:])
    # Polling every millisecond would look about 1,000 times per second of waiting.
    assert looks < 250 * max(fed_for, 0.8), f"{looks} looks in {fed_for:.2f} s of feeding"
    assert 0 <= finished - covered_at < 0.5, f"the read ended {finished - covered_at:.3f} s after its range was covered"
    holder.call("drop", name)


def test_withdraw_and_generation_changes_in_the_holder_fail_readers(holder: Holder, seed: int) -> None:
    name, region, gen, data = hold(holder, 1 << 20, seed)
    into = new_buffers(1 << 20)
    ep = holder.endpoint

    async def main() -> None:
        reader = LocalTransport({"wait_timeout": 0.5})
        try:
            assert await reader.read(ep, region, VERSION, 0, 1000, into, None) == gen
            holder.call("withdraw", name)  # the reader's cached description is stale now
            with pytest.raises(TransportError, match="withdrawn or replaced") as info:
                await reader.read(ep, region, VERSION, 0, 1000, into, gen)
            assert not isinstance(info.value, RangeNotReady)
            with pytest.raises(TransportError, match="not exposed"):
                await reader.read(ep, region, VERSION, 0, 1000, into, gen)
            holder.call("expose", name)
            assert await reader.read(ep, region, VERSION, 0, into.total_bytes, into, gen) == gen
            g2 = holder.call("bump", name)
            with pytest.raises(TransportError, match=f"generation {g2}, the pull began at {gen}"):
                await reader.read(ep, region, VERSION, 0, 1000, into, gen)
            assert await reader.read(ep, region, VERSION, 0, 1000, into, None) == g2
            with pytest.raises(TransportError, match="does not hold that version under that region"):
                await reader.read(ep, region, VERSION + 1, 0, 1000, into, None)
            with pytest.raises(TransportError, match="outside the shard"):
                await reader.read(ep, region, VERSION, into.total_bytes - 5, 6, into, None)
            other = new_buffers(2 << 20)
            with pytest.raises(TransportError, match="do not match the destination's layout"):
                await reader.read(ep, region, VERSION, 0, 10, other, None)
        finally:
            await reader.close()

    run(main())
    assert same(into, data)
    holder.call("drop", name)


def test_a_holder_killed_mid_read_fails_the_reads(seed: int) -> None:
    """SIGKILL while one read waits for progress and another is copying: both raise
    TransportError (ESRCH), promptly, and not RangeNotReady."""
    h = Holder()
    try:
        nbig = 64 << 20
        _, region, gen, _ = hold(h, nbig, seed, verified=(nbig // 2))
        waiting_into, copying_into = new_buffers(nbig), new_buffers(nbig)
        total = waiting_into.total_bytes
        first = copying_into.regions[0]  # the pack: written first

        async def main() -> None:
            waiter = LocalTransport({"wait_timeout": 60.0})
            copier = LocalTransport({"piece_bytes": 512, "threads": 1})  # slow: many small pieces
            try:
                waiting = asyncio.ensure_future(waiter.read(h.endpoint, region, VERSION, 0, total, waiting_into, gen))
                copying = asyncio.ensure_future(copier.read(h.endpoint, region, VERSION, 0, nbig // 2, copying_into, gen))
                for _ in range(2000):  # until the copy has begun and the waiter has its description
                    began = first.view(torch.uint8)[:512].any()
                    if (began and waiter._described) or copying.done():  # (else the kill can hit its describe)
                        break
                    await asyncio.sleep(0.001)
                assert waiter._described, "the waiting read never got its description"
                assert not copying.done(), "the copy finished before the kill; make it slower"
                assert not waiting.done()
                t0 = time.monotonic()
                h.kill()
                for what, task in (("waiting", waiting), ("copying", copying)):
                    with pytest.raises(TransportError) as info:
                        await asyncio.wait_for(task, 10.0)
                    assert not isinstance(info.value, RangeNotReady), what
                    assert f"holder process {h.endpoint['pid']} is gone" in str(info.value), str(info.value)
                    assert f"region {region} version {VERSION}" in str(info.value)
                assert time.monotonic() - t0 < 5.0
            finally:
                await waiter.close()
                await copier.close()

        run(main())
    finally:
        h.exit()


def test_reaches_only_this_host_and_pid_namespace(holder: Holder) -> None:
    async def main() -> None:
        t = LocalTransport()
        await t.start()
        try:
            ep = t.endpoint()
            assert t.reaches(ep) and t.reaches(holder.endpoint)
            assert not t.reaches({**ep, "boot_id": "00000000-0000-0000-0000-000000000000"})
            assert not t.reaches({**ep, "pidns": "pid:[1]"})
            assert not t.reaches({k: v for k, v in ep.items() if k != "boot_id"})
            assert not t.reaches({})
            assert not t.reaches(None)  # type: ignore[arg-type]
        finally:
            await t.close()

    run(main())


# --- bad endpoints and descriptions ----------------------------------------------------------------


def test_bad_endpoints_fail_with_transport_errors(holder: Holder, seed: int) -> None:
    name, region, gen, _ = hold(holder, 1 << 20, seed)
    into = new_buffers(1 << 20)
    ep = holder.endpoint

    async def main() -> None:
        reader = LocalTransport({"describe_timeout": 3.0})
        try:
            for peer, match in (
                (None, "lacks a side-channel address or a pid"),
                ({}, "lacks a side-channel address or a pid"),
                ({"pid": ep["pid"]}, "lacks a side-channel address"),
                ({**ep, "side": 5}, "lacks a side-channel address"),
                ({**ep, "side": ""}, "lacks a side-channel address"),
                ({**ep, "pid": str(ep["pid"])}, "or a pid"),
                ({**ep, "pid": True}, "or a pid"),
                ({**ep, "pid": -3}, "or a pid"),
                ({**ep, "pid": ep["pid"] + 1}, f"it describes process {ep['pid']}, its endpoint says {ep['pid'] + 1}"),
                # Nothing listens there: the side channel notices (the connection is refused), or
                # its describe_timeout ends; either way it says which setting chose the address.
                ({**ep, "side": "tcp://127.0.0.1:1"}, "cannot connect to the side channel at tcp://127.0.0.1:1 .*ADVERTISE_HOST"),
            ):
                with pytest.raises(TransportError, match=match) as info:
                    await reader.read(peer, region, VERSION, 0, 10, into, None)  # type: ignore[arg-type]
                assert f"region {region} version {VERSION} bytes [0, 10)" in str(info.value)
            assert await reader.read(ep, region, VERSION, 0, 10, into, None) == gen
        finally:
            await reader.close()

    run(main())
    holder.call("drop", name)


@pytest.mark.parametrize(
    "reply",
    [
        {"tag": 1, "words": 4096, "regions": []},  # no pid
        {"pid": "me", "tag": 1, "words": 4096, "regions": []},
        {"pid": None, "tag": 0, "words": 4096, "regions": []},  # pid filled in below; tag 0
        {"pid": None, "tag": 1, "words": -1, "regions": []},
        {"pid": None, "tag": 1, "words": 4096, "regions": {}},
        {"pid": None, "tag": 1, "words": 4096, "regions": [[1, 2, "cpu", -1]]},
        {"pid": None, "tag": 1, "words": 4096, "regions": [[1, -2, "cpu", -1, None]]},
        {"pid": None, "tag": 1, "words": 4096, "regions": [[1, 2, "tpu", -1, None]]},
        {"pid": None, "tag": 1, "words": 4096, "regions": [[1, 2, "cuda", 0, None]]},
        {"pid": None, "tag": 1, "words": 4096, "regions": [[1, 2, "cuda", 0, {"fields": [1, 2]}]]},
        {"pid": None, "tag": 1, "words": 4096, "regions": [[0, 2, "parts", -1, None]]},  # parts without a list
        {"pid": None, "tag": 1, "words": 4096, "regions": [[0, 2, "parts", -1, [[4096, 1]]]]},  # 1 byte of 2
        {"pid": None, "tag": 1, "words": 4096, "regions": [[0, 2, "parts", -1, [[0, 2]]]]},  # address 0
        {"pid": None, "tag": 1, "words": 4096, "regions": [[0, 2, "parts", -1, [[4096, 2, 3]]]]},
        {"pid": None, "tag": 1, "words": 4096, "regions": [[0, 2, "parts", -1, [[4096, 0], [4096, 2]]]]},  # an empty part
        {"pid": None, "tag": 1, "words": 4096, "regions": [[1, 2, "cpu", -1, [[4096, 2]]]]},  # parts on a plain region
    ],
)
def test_malformed_descriptions_fail_with_transport_errors(reply: dict) -> None:
    """A side server that answers describe with nonsense: the reader refuses to use it."""
    pid = os.getpid() + 1  # another process: CUDA regions need IPC fields
    answer = {**reply, "pid": pid} if "pid" in reply and reply["pid"] is None else reply
    server = SideServer("fake-holder", {"describe": (lambda msg: dict(answer), True)}, "127.0.0.1")
    into = new_buffers(1 << 20)

    async def main() -> None:
        reader = LocalTransport({"describe_timeout": 30.0})
        try:
            with pytest.raises(TransportError, match="description is unusable|it describes process"):
                await reader.read({"side": server.address, "pid": pid}, 1, VERSION, 0, 10, into, None)
        finally:
            await reader.close()

    try:
        run(main())
    finally:
        server.close()


# --- in-process: the seqlock and closes during a copy ----------------------------------------------


class HookedLocal(LocalTransport):
    """Runs ``hook`` once, after the first piece of a copy (what the suite's hooked buffers do
    for transports that copy through ShardBuffers.views): CPU memory is copied piece by piece
    with ``_vm_copy``."""

    hook: Any = None

    def _vm_copy(self, *args: Any) -> None:
        super()._vm_copy(*args)
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()


def in_process_holder(seed: int) -> tuple[ShardBuffers, torch.Tensor]:
    buf = new_buffers(1 << 20)
    data = content(buf.total_bytes, seed)
    write(buf, data, 0, buf.total_bytes)
    buf.progress.reset(VERSION, buf.total_bytes)
    return buf, data


def test_a_generation_change_during_the_copy_fails_the_read(seed: int) -> None:
    held, data = in_process_holder(seed)
    into = new_buffers(1 << 20)

    async def main() -> None:
        holder, reader = LocalTransport(), HookedLocal({"piece_bytes": 64 << 10, "threads": 1})
        await holder.start()
        holder.serve(lambda r, v: held if (r, v) == (1, VERSION) else None)
        holder.expose(held)
        try:
            ep = holder.endpoint()
            before = held.progress.generation
            reader.hook = lambda: held.progress.reset(VERSION, held.total_bytes)
            with pytest.raises(TransportError, match=f"changed during the read \\(generation {before} -> {before + 1}\\)"):
                await reader.read(ep, 1, VERSION, 0, held.total_bytes, into, None)
            assert await reader.read(ep, 1, VERSION, 0, held.total_bytes, into, None) == before + 1
        finally:
            await reader.close()
            await holder.close()

    run(main())
    assert same(into, data)


@pytest.mark.parametrize("side", ["holder", "reader"])
def test_a_close_during_the_copy_fails_the_read(side: str, seed: int) -> None:
    held, _ = in_process_holder(seed)
    into = new_buffers(1 << 20)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        holder, reader = LocalTransport(), HookedLocal({"piece_bytes": 64 << 10, "threads": 2})
        await holder.start()
        holder.serve(lambda r, v: held)
        holder.expose(held)
        closing = holder if side == "holder" else reader
        reader.hook = lambda: asyncio.run_coroutine_threadsafe(closing.close(), loop).result(10)
        try:
            with pytest.raises(TransportError) as info:
                await asyncio.wait_for(reader.read(holder.endpoint(), 1, VERSION, 0, held.total_bytes, into, None), 10)
            assert not isinstance(info.value, RangeNotReady)
            with pytest.raises(TransportError):
                await reader.read(holder.endpoint(), 1, VERSION, 0, 10, into, None)
        finally:
            await reader.close()
            await holder.close()

    run(main())


def test_a_waiting_read_leaves_the_event_loop_free(seed: int) -> None:
    held, _ = in_process_holder(seed)
    held.progress.reset(VERSION, 0)
    into = new_buffers(1 << 20)
    ticks = [0]

    async def main() -> None:
        holder, reader = LocalTransport(), LocalTransport({"wait_timeout": 0.5})
        await holder.start()
        holder.serve(lambda r, v: held)
        holder.expose(held)

        async def tick() -> None:
            while True:
                await asyncio.sleep(0.01)
                ticks[0] += 1

        ticker = asyncio.ensure_future(tick())
        try:
            with pytest.raises(RangeNotReady, match="did not cover the range in time \\(0 bytes verified\\)"):
                await reader.read(holder.endpoint(), 1, VERSION, 0, 100, into, None)
        finally:
            ticker.cancel()
            await reader.close()
            await holder.close()

    run(main())
    assert ticks[0] >= 20


# --- the system call wrapper ---------------------------------------------------------------------------


def test_vm_read_loops_over_iov_max_and_reports_faults() -> None:
    src = bytearray(random.Random(1).randbytes(3000 * 7))
    dst = bytearray(len(src))
    sa, da = local._address(src), local._address(dst)
    spans = [(7 * i, 7) for i in range(3000)]  # three calls' worth of iovecs
    local._vm_read(os.getpid(), [(da + a, n) for a, n in spans], [(sa + a, n) for a, n in spans])
    assert dst == src
    # The two sides cut differently: 7-byte pieces into one span, and 13-byte pieces from 11-byte ones.
    for cut_local, cut_remote in ((21000, 7), (13, 11)):
        dst[:] = bytes(len(dst))
        lspans = [(da + a, min(cut_local, len(src) - a)) for a in range(0, len(src), cut_local)]
        rspans = [(sa + a, min(cut_remote, len(src) - a)) for a in range(0, len(src), cut_remote)]
        local._vm_read(os.getpid(), lspans, rspans)
        assert dst == src, (cut_local, cut_remote)
    good = ctypes.create_string_buffer(b"x" * 4096)
    out = ctypes.create_string_buffer(8192)
    with pytest.raises(local._VmError) as info:  # a partial transfer, then the fault
        local._vm_read(os.getpid(), [(ctypes.addressof(out), 8192)], [(ctypes.addressof(good), 4096), (8, 4096)])
    assert info.value.errno == errno.EFAULT
    assert out.raw[:4096] == good.raw[:4096]


# --- throughput (reported, not asserted) -------------------------------------------------------------


def test_throughput_report(holder: Holder, seed: int, capsys: pytest.CaptureFixture[str]) -> None:
    """A 256 MiB read from the holder process, against one thread's torch copy of as much."""
    nbig = 256 << 20
    name, region, gen, data = hold(holder, nbig, seed)
    into = new_buffers(nbig)
    total = into.total_bytes
    rates: dict[str, float] = {}

    async def timed(options: dict) -> float:
        reader = LocalTransport(options)
        try:
            await reader.read(holder.endpoint, region, VERSION, 0, 4096, into, None)  # describe, fault pages in
            best = 0.0
            for _ in range(3):
                t0 = time.perf_counter()
                await reader.read(holder.endpoint, region, VERSION, 0, total, into, gen)
                best = max(best, total / (time.perf_counter() - t0) / 1e9)
            return best
        finally:
            await reader.close()

    rates["local, 4 threads"] = run(timed({}))
    rates["local, 1 thread"] = run(timed({"threads": 1}))
    assert same(into, data)
    src, dst = data.clone(), torch.empty_like(data)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dst.copy_(src)
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = max(best, total / (time.perf_counter() - t0) / 1e9)
    finally:
        torch.set_num_threads(threads)
    rates["torch copy_, 1 thread"] = best
    with capsys.disabled():
        line = ", ".join(f"{k}: {v:.1f} GB/s" for k, v in rates.items())
        print(f"\nlocal transport, {total / 2**20:.0f} MiB read from another process: {line}; "
              f"ratio to one-thread memcpy {rates['local, 4 threads'] / best:.2f}x (4 threads), "
              f"{rates['local, 1 thread'] / best:.2f}x (1 thread)")
    holder.call("drop", name)


def test_a_part_that_is_one_unit_is_hashed_through_its_stream_and_a_damaged_byte_shows(seed: int) -> None:
    """A read into CPU memory through ``local`` with the engine's landing hasher: parts that are
    whole checksum units go through ``unit_stream`` (one hash update per piece), the others
    through ``landed``; the digests equal the holder's checksums, and a byte damaged in the
    holder's memory shows in its unit's digest (the engine then refuses the read)."""
    from tensorhub.runtime.checksum import LandingHasher, compute

    tensors = {f"w{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate([8 << 20, (4 << 20) + 4096, 4 << 20])}
    tensors["tiny"] = torch.zeros(999, dtype=torch.uint8)
    held = ShardBuffers(tensors, layout_of(tensors, chunk_bytes=4 << 20))
    held.pack()
    data = content(held.total_bytes, seed)
    write(held, data, 0, held.total_bytes)
    held.progress.reset(VERSION, held.total_bytes)
    declared = compute(held)
    into = ShardBuffers({k: torch.zeros_like(v) for k, v in tensors.items()}, layout_of(tensors, chunk_bytes=4 << 20))
    streams: list[int] = []

    class Spy(LandingHasher):
        __slots__ = ()

        def unit_stream(self, offset: int, length: int) -> Any:
            sink = super().unit_stream(offset, length)
            if sink is not None:
                streams.append(offset)
            return sink

    async def main() -> dict[int, int]:
        holder, reader = LocalTransport(), LocalTransport({"piece_bytes": 256 << 10, "threads": 2})
        await holder.start()
        holder.serve(lambda r, v: held if (r, v) == (1, VERSION) else None)
        holder.expose(held)
        try:
            ep = holder.endpoint()
            hasher = Spy(into, into.plan.units)
            await reader.read(ep, 1, VERSION, 0, held.total_bytes, into, None, landed=hasher)
            assert hasher.complete and [hasher.digests[u.index] for u in into.plan.units] == declared
            assert same(into, data)
            # Parts begin where the big tensors' 4 MiB units begin, though the pack comes first.
            units = {(u.offset, u.length) for u in into.plan.units}
            whole = sorted(p for p, n in local._parts(into, 0, into.total_bytes) if (p, n) in units)
            assert {u.offset for u in into.plan.units if u.length == 4 << 20} <= set(whole)
            assert sorted(streams) == whole, f"parts that are one unit {whole}, streamed {streams}"
            bad = into.plan.units[len(into.plan.units) // 2]
            (v,) = held.views(bad.offset + bad.length // 3, 1)
            v[0] ^= 0xFF  # damaged in the holder's memory after its checksums were declared
            again = Spy(into, into.plan.units)
            await reader.read(ep, 1, VERSION, 0, held.total_bytes, into, None, landed=again)
            return {u.index: again.digests[u.index] for u in into.plan.units}
        finally:
            await reader.close()
            await holder.close()

    got = run(main())
    assert [i for i in got if got[i] != declared[i]] == [into.plan.units[len(into.plan.units) // 2].index]
