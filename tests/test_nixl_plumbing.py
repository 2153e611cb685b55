"""The NIXL plumbing of the ``nixl`` and ``rdma_copy`` transports, against a scriptable fake agent.

:class:`FakeAgent` is duck-typed on the part of NIXL's ``nixl_agent`` the transports use. It
keeps NIXL's rules that matter here: a transfer needs both sides' memory registered (the remote
side's known through metadata loaded with ``add_remote_agent``), metadata is opaque bytes, and a
handle must be released. Its transfers really copy (the agents live in this process), and its
statuses can be scripted: stay in progress, fail, raise on post. No mocks: every assertion is on
what the fake saw or on the bytes that landed.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from dataclasses import dataclass, field

import msgpack
import pytest
import torch

from tensorhub.core.errors import InvalidArgument, TransportError
from tensorhub.transports.base import RangeNotReady
from tensorhub.transports.buffers import ShardBuffers, layout_of
from tensorhub.transports.nixl import NixlTransport, XferStatus, completion, wait_xfer
from tensorhub.transports.rdma_copy import RdmaCopyTransport

REGION, VERSION = 11, 3

_AGENTS: dict[str, FakeAgent] = {}


class Disconnected(Exception):
    """What the fake raises for a peer that is gone (NIXL raises nixlRemoteDisconnectError)."""


class Forever(list):
    """A status script that stays in progress."""

    def __bool__(self) -> bool:
        return True

    def pop(self, index: int = -1) -> str:
        return "PROC"

    def copy(self) -> Forever:
        return self


@dataclass
class Descs:
    kind: str
    rows: list[tuple[int, int, int]]


@dataclass
class Xfer:
    local: Descs
    remote: Descs
    peer: str
    script: list[str]
    released: bool = False


@dataclass
class FakeAgent:
    name: str
    registered: list[tuple[int, int, str]] = field(default_factory=list)
    remote: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)
    xfers: list[Xfer] = field(default_factory=list)
    registrations: int = 0
    metadata_loads: int = 0
    removed: list[str] = field(default_factory=list)
    script: list[str] = field(default_factory=list)  # statuses of the next transfers' polls
    raise_on_post: Exception | None = None
    ucx_devices: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def get_reg_descs(self, rows, kind):
        return Descs(kind, [(a, n, d) for a, n, d, _ in rows])

    def get_xfer_descs(self, rows, kind):
        return Descs(kind, list(rows))

    def register_memory(self, descs):
        with self.lock:
            self.registrations += 1
            self.registered += [(a, n, descs.kind) for a, n, _ in descs.rows]
        return descs

    def deregister_memory(self, descs):
        with self.lock:
            for a, n, _ in descs.rows:
                self.registered.remove((a, n, descs.kind))

    def get_partial_agent_metadata(self, descs, inc_conn_info):
        return msgpack.packb({"agent": self.name, "rows": [[a, n, descs.kind] for a, n, _ in descs.rows]})

    def add_remote_agent(self, md):
        got = msgpack.unpackb(md)
        with self.lock:
            self.metadata_loads += 1
            self.remote.setdefault(got["agent"], []).extend(tuple(r) for r in got["rows"])
        return got["agent"].encode()

    def remove_remote_agent(self, name):
        with self.lock:
            self.removed.append(name)
            self.remote.pop(name, None)

    def initialize_xfer(self, op, local, remote, peer):
        assert op == "READ"
        with self.lock:
            if peer not in self.remote:
                raise Disconnected(f"metadata for remote agent {peer!r} not found")
            for a, n, _ in local.rows:
                _inside(self.registered, a, n, local.kind, "local")
            for a, n, _ in remote.rows:
                _inside(self.remote[peer], a, n, remote.kind, "remote")
            x = Xfer(local, remote, peer, self.script.copy())
            self.xfers.append(x)
        return x

    def transfer(self, x):
        if self.raise_on_post is not None:
            raise self.raise_on_post
        return self._step(x)

    def check_xfer_state(self, x):
        assert not x.released, "polled a released handle"
        return self._step(x)

    def _step(self, x):
        status = x.script.pop(0) if x.script else "DONE"
        if status == "DONE":
            if x.peer not in _AGENTS:
                return "ERR"
            for (la, n, _), (ra, _, _) in zip(x.local.rows, x.remote.rows):
                ctypes.memmove(la, ra, n)
        return status

    def release_xfer_handle(self, x):
        assert not x.released, "released twice"
        x.released = True


def _inside(ranges, a, n, kind, side):
    if not any(k == kind and s <= a and a + n <= s + m for s, m, k in ranges):
        raise Disconnected(f"{side} range [{a:#x}, +{n}) of {kind} is not registered")


def fake_factory(made: list[FakeAgent]):
    def make(name: str, ucx_devices: str | None) -> FakeAgent:
        agent = FakeAgent(name, ucx_devices=ucx_devices)
        _AGENTS[name] = agent
        made.append(agent)
        return agent

    return make


def _shard(fill: int | None = None) -> ShardBuffers:
    g = torch.Generator().manual_seed(7)
    tensors = {
        "a": torch.randint(0, 255, (3 << 20,), dtype=torch.uint8, generator=g),  # large: its own region
        "b": torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=g),  # tiny: packed
        "c": torch.randint(0, 255, (5 << 20,), dtype=torch.uint8, generator=g),
    }
    if fill is not None:
        tensors = {k: torch.full_like(v, fill) for k, v in tensors.items()}
    buf = ShardBuffers(tensors, layout_of(tensors))
    buf.pack()
    return buf


def _bytes(buf: ShardBuffers) -> bytes:
    return b"".join(bytes(v) for v in buf.views(0, buf.total_bytes))


class Pair:
    def __init__(self, cls=NixlTransport, **options) -> None:
        self.made: list[FakeAgent] = []
        self.holder = cls(options, agent_factory=fake_factory(self.made))
        self.reader = cls(options, agent_factory=fake_factory(self.made))
        self.holdings: dict[tuple[int, int], ShardBuffers] = {}

    async def __aenter__(self) -> Pair:
        await self.holder.start()
        await self.reader.start()
        self.holder.serve(lambda r, v: self.holdings.get((r, v)))
        return self

    async def __aexit__(self, *exc) -> None:
        for buf in self.holdings.values():
            buf.progress.reset(None)
        await self.reader.close()
        await self.holder.close()
        for a in self.made:
            _AGENTS.pop(a.name, None)

    @property
    def holder_agent(self) -> FakeAgent:
        return self.made[0]

    @property
    def reader_agent(self) -> FakeAgent:
        return self.made[1]

    def hold(self, buf: ShardBuffers, verified: int | None = None) -> int:
        self.holdings[(REGION, VERSION)] = buf
        self.holder.expose(buf)
        return buf.progress.reset(VERSION, buf.total_bytes if verified is None else verified)

    def into(self) -> ShardBuffers:
        buf = _shard(fill=0)
        self.reader.expose(buf)
        return buf

    async def read(self, into, offset, length, generation=None) -> int:
        return await asyncio.wait_for(self.reader.read(self.holder.endpoint(), REGION, VERSION, offset, length, into, generation), 20)


def run(coro):
    return asyncio.run(coro)


# ---- registration -------------------------------------------------------------------------------


def test_expose_registers_once_and_reads_never_register():
    async def main():
        async with Pair() as p:
            src = _shard()
            p.hold(src)
            into = p.into()
            before = (p.holder_agent.registrations, p.reader_agent.registrations)
            for off in range(0, into.total_bytes, 1 << 20):
                await p.read(into, off, min(1 << 20, into.total_bytes - off))
            assert (p.holder_agent.registrations, p.reader_agent.registrations) == before
            assert _bytes(into) == _bytes(src)
            p.holder.expose(src)  # exposing again registers nothing
            assert p.holder_agent.registrations == before[0]

    run(main())


def test_a_read_is_one_batched_request_between_two_progress_word_reads():
    async def main():
        async with Pair() as p:
            src = _shard()
            p.hold(src)
            into = p.into()
            await p.read(into, 0, into.total_bytes)
            xs = p.reader_agent.xfers
            # words twice (two READs must agree), the data (one descriptor per region: pack + two
            # tensors), words after
            assert [len(x.local.rows) for x in xs] == [1, 1, len(into.regions), 1]
            assert {x.local.rows[0][1] for k, x in enumerate(xs) if k != 2} == {32}
            assert xs[2].remote.rows[0][0] == src.regions[0].data_ptr()  # the described address
            # a later read of this pull (its generation named) of a range already seen covered
            # skips the first words READs
            await p.read(into, 0, 4096, generation=src.progress.generation)
            assert [len(x.local.rows) for x in xs[4:]] == [len(into.segments(0, 4096)), 1]
            assert _bytes(into) == _bytes(src)
            assert all(x.released for x in xs)

    run(main())


def test_descriptors_are_msgpack_fields_and_metadata_is_loaded_once_per_description():
    async def main():
        async with Pair() as p:
            src = _shard()
            p.hold(src)
            into = p.into()
            await p.read(into, 0, 100)
            loads = p.reader_agent.metadata_loads  # one blob per memory registration described
            for _ in range(3):
                await p.read(into, 0, 100)
            assert p.reader_agent.metadata_loads == loads
            assert not hasattr(p.reader_agent, "deserialize_descs")  # could not have been called

    run(main())


# ---- completion and handles ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "want"), [(["PROC", "PROC", "DONE"], XferStatus.DONE), (["PROC", "ERR"], XferStatus.ERR), ([], XferStatus.DONE)]
)
def test_wait_xfer_follows_the_status(script, want):
    a = FakeAgent("solo")
    x = Xfer(Descs("DRAM", []), Descs("DRAM", []), "solo", script)
    _AGENTS["solo"] = a
    try:
        assert wait_xfer(a, x, a.transfer(x), time.monotonic() + 5, lambda: False) is want
    finally:
        _AGENTS.pop("solo")


def test_wait_xfer_is_bounded_by_its_deadline_and_by_close():
    a = FakeAgent("stuck")
    x = Xfer(Descs("DRAM", []), Descs("DRAM", []), "stuck", Forever())
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="did not complete in time"):
        wait_xfer(a, x, "PROC", time.monotonic() + 0.1, lambda: False)
    assert time.monotonic() - t0 < 5
    with pytest.raises(TransportError, match="closed"):
        wait_xfer(a, x, "PROC", time.monotonic() + 5, lambda: True)


def test_completion_is_an_awaitable_with_an_enum_status():
    a = FakeAgent("aw")
    x = Xfer(Descs("DRAM", []), Descs("DRAM", []), "aw", ["PROC", "DONE"])
    _AGENTS["aw"] = a
    try:
        assert run(completion(a, x, "PROC", 5.0)) is XferStatus.DONE
    finally:
        _AGENTS.pop("aw")


@pytest.mark.parametrize("failure", ["err", "timeout", "raise"])
def test_every_handle_is_released_whatever_happens(failure):
    async def main():
        async with Pair(xfer_timeout=0.2) as p:
            src = _shard()
            p.hold(src)
            into = p.into()
            await p.read(into, 0, 100)  # describe, words: all fine
            if failure == "err":
                p.reader_agent.script = ["PROC", "ERR"]
            elif failure == "timeout":
                p.reader_agent.script = Forever()
            else:
                p.reader_agent.raise_on_post = Disconnected("remote agent was disconnected")
            with pytest.raises(TransportError):
                await p.read(into, 0, into.total_bytes)
            assert p.reader_agent.xfers and all(x.released for x in p.reader_agent.xfers)

    run(main())


# ---- peers --------------------------------------------------------------------------------------


def test_a_peer_whose_transfer_raised_is_dropped_and_described_again():
    async def main():
        async with Pair() as p:
            src = _shard()
            p.hold(src)
            into = p.into()
            await p.read(into, 0, 100)
            loads = p.reader_agent.metadata_loads
            holder = p.holder_agent.name
            p.reader_agent.raise_on_post = Disconnected("remote agent was disconnected")
            with pytest.raises(TransportError, match="Disconnected"):
                await p.read(into, 0, 100)
            assert p.reader_agent.removed == [holder] and holder not in p.reader_agent.remote
            p.reader_agent.raise_on_post = None
            await p.read(into, 0, into.total_bytes)  # described and loaded again
            assert p.reader_agent.metadata_loads == 2 * loads
            assert _bytes(into) == _bytes(src)

    run(main())


def test_idle_peers_are_dropped_and_close_drops_them_all():
    async def main():
        async with Pair(peer_idle_s=0.0) as p:
            first, second = _shard(), _shard(fill=9)
            p.hold(first)
            into = p.into()
            await p.read(into, 0, 100)
            holder = p.holder_agent.name
            p.holdings[(REGION + 1, VERSION)] = second
            p.holder.expose(second)
            second.progress.reset(VERSION, second.total_bytes)
            await asyncio.sleep(0.01)
            await p.reader.read(p.holder.endpoint(), REGION + 1, VERSION, 0, 100, into, None)
            assert p.reader_agent.removed == [holder]  # idle past peer_idle_s before the new describe
            await p.reader.close()
            assert p.reader_agent.removed == [holder, holder]

    run(main())


# ---- progress words -----------------------------------------------------------------------------


def test_a_partial_holder_is_followed_through_its_progress_words():
    async def main():
        async with Pair(wait_timeout=10.0) as p:
            src = _shard()
            p.hold(src, verified=0)
            into = p.into()
            total = src.total_bytes

            def advance():
                for k in range(1, 9):
                    time.sleep(0.02)
                    src.progress.advance(total * k // 8)

            t = threading.Thread(target=advance)
            t.start()
            await asyncio.gather(*(p.read(into, off, total // 8) for off in range(0, total - total // 8 + 1, total // 8)))
            t.join()
            assert _bytes(into)[: 8 * (total // 8)] == _bytes(src)[: 8 * (total // 8)]
            assert p.holder_agent.xfers == []  # the holder's agent did nothing: one-sided

    run(main())


def test_not_covered_in_time_is_range_not_ready_and_a_moved_generation_fails():
    async def main():
        async with Pair(wait_timeout=0.2) as p:
            src = _shard()
            gen = p.hold(src, verified=10)
            into = p.into()
            with pytest.raises(RangeNotReady):
                await p.read(into, 0, 100)
            await p.read(into, 0, 10)
            with pytest.raises(TransportError, match="generation"):
                await p.read(into, 0, 10, generation=gen + 1)

    run(main())


def test_withdrawn_buffers_fail_a_cached_description():
    async def main():
        async with Pair() as p:
            src = _shard()
            p.hold(src)
            into = p.into()
            await p.read(into, 0, 100)
            p.holder.withdraw(src)
            with pytest.raises(TransportError, match="withdrew|not exposed|registered"):
                await p.read(into, 0, 100)
            p.holder.expose(src)
            await p.read(into, 0, into.total_bytes)
            assert _bytes(into) == _bytes(src)

    run(main())


# ---- rdma_copy ----------------------------------------------------------------------------------


def test_rdma_copy_registers_only_its_staging_and_bounds_it():
    async def main():
        async with Pair(RdmaCopyTransport, staging_bytes=2 << 20, slot_bytes=1 << 20) as p:
            src = _shard()
            p.holdings[(REGION, VERSION)] = src
            src.progress.reset(VERSION, src.total_bytes)
            into = _shard(fill=0)
            await asyncio.gather(*(p.read(into, off, min(3 << 20, into.total_bytes - off)) for off in range(0, into.total_bytes, 3 << 20)))
            assert _bytes(into) == _bytes(src)
            for agent in p.made:
                assert agent.registrations == 1  # the staging pool, at start; never a user tensor
                assert agent.registered == [(agent.registered[0][0], 2 << 20, "DRAM")]
            # Every holder slot is given back: the release is a one-way message, which the holder
            # may take a moment after the read returned to handle (bounded wait).
            for _ in range(500):
                if p.holder.pool.leased == 0:
                    break
                await asyncio.sleep(0.01)
            assert p.holder.pool.leased == 0
            assert all(x.released for x in p.reader_agent.xfers)
            assert max(len(x.local.rows) for x in p.reader_agent.xfers) == 1

    run(main())


def test_rdma_copy_fails_a_read_that_outlived_its_holder_slot_lease():
    """A read slower than the holder's slot lease (lease_s) fails: the holder may have staged
    another piece into the slot meanwhile (seen as wrong bytes on a loaded machine). Nothing
    lands in the destination; the next read, in time, is exact."""

    async def main():
        async with Pair(RdmaCopyTransport, staging_bytes=2 << 20, slot_bytes=1 << 20, lease_s=0.05) as p:
            src = _shard()
            p.holdings[(REGION, VERSION)] = src
            src.progress.reset(VERSION, src.total_bytes)
            into = _shard(fill=0)
            io = p.reader.io
            real = io.read

            def slow(*args, **kw):
                time.sleep(0.3)  # past the 50 ms lease: the holder stages other pieces into every slot
                pool = p.holder.pool
                taken = [pool.take(1.0, 10.0, lambda: False) for _ in range(pool.count)]
                for slot, token in taken:  # type: ignore[misc]
                    pool.view(slot, pool.slot_bytes)[:] = b"\xee" * pool.slot_bytes
                    pool.give(slot, token)
                return real(*args, **kw)

            io.read = slow
            with pytest.raises(TransportError, match="lease of the staging slot .* expired"):
                await p.read(into, 0, 1 << 20)
            assert _bytes(into) == bytes(into.total_bytes)  # nothing landed
            io.read = real
            await p.read(into, 0, into.total_bytes)
            assert _bytes(into) == _bytes(src)

    run(main())


def test_rdma_copy_options_are_checked():
    with pytest.raises(InvalidArgument, match="slot_bytes"):
        RdmaCopyTransport({"staging_bytes": 1 << 20, "slot_bytes": 2 << 20})
    with pytest.raises(InvalidArgument, match="unknown rdma_copy transport options"):
        RdmaCopyTransport({"stagin_bytes": 1})


# ---- NIC affinity -------------------------------------------------------------------------------


@pytest.mark.parametrize(("nic", "want"), [("mlx5_1:1", "mlx5_1:1"), ("", None), ("auto", None)])
def test_the_nic_choice_reaches_the_agent(nic, want):
    made: list[FakeAgent] = []
    t = NixlTransport({"nic": nic}, agent_factory=fake_factory(made))

    async def main():
        await t.start()
        await t.close()

    run(main())
    assert made[0].ucx_devices == want  # "auto" without a GPU: UCX chooses
    _AGENTS.pop(made[0].name, None)


def test_nixl_options_are_checked():
    with pytest.raises(InvalidArgument, match="'threads' must be an integer >= 1"):
        NixlTransport({"threads": 0})
    with pytest.raises(InvalidArgument, match="'nic' must be a string"):
        NixlTransport({"nic": 3})
    with pytest.raises(InvalidArgument, match="unknown nixl transport options"):
        NixlTransport({"wait": 1})
