"""The ``local`` transport reading a holder whose tensors are in shared memory
(``register(..., shared_memory=True)``, ``ShardBuffers(shared_memory=True)``): the reader maps
the holder's files (``/proc/<pid>/fd/<fd>``) and copies with ``memmove``, every byte still
checked by the progress words and the landing hash. What is tested: bytes equal (in this
process through a second side server, which hides the holder from the same-process path; from
another process in ``test_transport_local.py``, beside its holder worker), no ``process_vm_readv`` of the bulk, a damaged byte in the shared segment
refused and read again, a withdrawn holder not read from its old mapping, a reused descriptor
number (another file) refused, the fallback to ``process_vm_readv`` when the file cannot be
opened, and bad shared-memory fields refused with a typed error naming the field."""

from __future__ import annotations

import ctypes
import os
import tempfile
from typing import Any

import pytest
import torch

import tensorhub
from tensorhub.core.errors import InvalidArgument, TransportError
from tensorhub.core.placement import Replicate, TensorPlacement
from tensorhub.runtime.actor import run
from tensorhub.transports import local
from tensorhub.transports.buffers import WORD_BYTES, ShardBuffers, layout_of
from tensorhub.transports.local import LocalTransport
from tensorhub.transports.sidechannel import SideServer

from .test_local_same_process import _Spy, _weights, server  # noqa: F401 (server: a fixture)
from .test_transport_local import VERSION, content, same, specs, write

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def shared_buffers(nbig: int, shared: bool = True) -> ShardBuffers:
    tensors = {n: torch.zeros(s, dtype=d) for n, d, s in specs(nbig)}
    return ShardBuffers(tensors, layout_of(tensors), shared_memory=shared)


def held(seed: int, nbig: int = 3 << 20) -> tuple[ShardBuffers, torch.Tensor]:
    buf = shared_buffers(nbig)
    data = content(buf.total_bytes, seed)
    write(buf, data, 0, buf.total_bytes)
    buf.progress.reset(VERSION, buf.total_bytes)
    return buf, data


class Served:
    """A holder in this process, described through a second side server that is not the
    holder's own (so the reader takes it for a holder in another process: no same-process
    ``memmove`` of its buffers; its shared-memory files are what it can map). ``edit`` changes
    each description before it is sent."""

    def __init__(self, buf: ShardBuffers, edit: Any = None) -> None:
        self.buf = buf
        self.edit = edit
        self.holder = LocalTransport()

    async def __aenter__(self) -> Served:
        await self.holder.start()
        self.holder.serve(lambda r, v: self.buf if (r, v) == (1, VERSION) else None)
        self.holder.expose(self.buf)

        def describe(msg: dict[str, Any]) -> dict[str, Any]:
            reply = self.holder._on_describe(msg)
            return self.edit(reply) if self.edit is not None else reply

        self.side = SideServer("shared-holder", {"describe": (describe, True)}, "127.0.0.1")
        self.endpoint = {**self.holder.endpoint(), "side": self.side.address}
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.side.close()
        await self.holder.close()


def read_whole(buf: ShardBuffers, into: ShardBuffers) -> dict[str, int]:
    """One read of all of ``buf`` (served from this process as another) into ``into``; the
    reading transport's stats."""

    async def main() -> dict[str, int]:
        async with Served(buf) as served:
            reader = LocalTransport()
            try:
                await reader.read(served.endpoint, 1, VERSION, 0, buf.total_bytes, into, None)
                return reader.stats()
            finally:
                await reader.close()

    return run(main())


def test_shared_memory_moves_the_cpu_regions_in_place_and_describes_them(seed: int) -> None:
    tensors = {n: torch.full(s, 3, dtype=d) for n, d, s in specs(3 << 20)}
    before = {n: t.data_ptr() for n, t in tensors.items()}
    buf = ShardBuffers(tensors, layout_of(tensors), shared_memory=True)
    regions = [k for k, t in enumerate(buf.regions) if t is not None]
    assert sorted(buf.shared) == regions  # the two large tensors and the (copied) pack
    for name in ("big", "big2"):
        t = tensors[name]
        assert t.data_ptr() != before[name] and t.untyped_storage().is_shared() and bool((t == 3).all())
    for k in regions:
        got = buf.shared_file(k)
        assert got is not None
        st = os.fstat(got.fd)
        assert (st.st_dev, st.st_ino) == (got.dev, got.ino) and got.offset + buf.plan.regions[k].nbytes <= got.size
    big = buf.plan.regions.index(next(r for r in buf.plan.regions if r.tensor is not None))
    buf.regions[big].data = torch.zeros_like(buf.regions[big])  # its memory moved: no longer described as shared
    assert buf.shared_file(big) is None


def test_a_holder_in_shared_memory_is_mapped_and_copied_with_memmove(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    buf, data = held(seed)
    into = shared_buffers(3 << 20, shared=False)
    spy = _Spy(monkeypatch)

    async def main() -> dict[str, int]:
        async with Served(buf) as served:
            reader = LocalTransport({"piece_bytes": 1 << 20})
            try:
                for _ in range(2):  # the second read reuses the mappings
                    assert await reader.read(served.endpoint, 1, VERSION, 0, buf.total_bytes, into, None) == buf.progress.generation
                return reader.stats()
            finally:
                await reader.close()

    stats = run(main())
    assert same(into, data)
    assert stats["shared_mapped"] == len(buf.shared) == 3 and stats["shared_fallbacks"] == 0, stats
    assert spy.memmoved == 2 * buf.total_bytes, (spy.memmoved, buf.total_bytes)
    assert max(spy.vm_calls) <= WORD_BYTES  # only the progress words go through process_vm_readv


def test_a_withdrawn_holder_is_not_read_from_its_old_mapping(seed: int) -> None:
    buf, data = held(seed)
    into = shared_buffers(3 << 20, shared=False)

    async def main() -> None:
        async with Served(buf) as served:
            reader = LocalTransport()
            try:
                await reader.read(served.endpoint, 1, VERSION, 0, buf.total_bytes, into, None)
                assert reader.stats()["shared_maps_held"] == 3
                served.holder.withdraw(buf)
                with pytest.raises(TransportError, match="withdrawn or replaced"):
                    await reader.read(served.endpoint, 1, VERSION, 0, buf.total_bytes, into, None)
                assert reader.stats()["shared_maps_held"] == 0  # dropped with the description
                with pytest.raises(TransportError, match="not exposed"):
                    await reader.read(served.endpoint, 1, VERSION, 0, buf.total_bytes, into, None)
                served.holder.expose(buf)  # exposed again (a new tag): described and mapped again
                await reader.read(served.endpoint, 1, VERSION, 0, buf.total_bytes, into, None)
                stats = reader.stats()
                assert stats["shared_mapped"] == 6 and stats["shared_maps_held"] == 3, stats
            finally:
                await reader.close()

    run(main())
    assert same(into, data)


def test_a_reused_descriptor_naming_another_file_is_refused(seed: int) -> None:
    buf, data = held(seed)
    into = shared_buffers(3 << 20, shared=False)
    k = next(iter(buf.shared))
    fd = buf.shared[k].fd
    keep = os.dup(fd)  # the storage's own descriptor, put back afterwards
    other = tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    other.truncate(buf.shared[k].size)
    os.dup2(other.fileno(), fd)  # the same number now names another file

    try:
        stats = read_whole(buf, into)
    finally:
        os.dup2(keep, fd)
        os.close(keep)
        other.close()
    assert same(into, data)  # read with process_vm_readv instead, never from the other file
    assert stats["shared_other_file"] == 1 and stats["shared_fallbacks"] == 1 and stats["shared_mapped"] == 2, stats


def test_a_file_that_cannot_be_opened_falls_back_to_process_vm_readv(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    buf, data = held(seed)
    into = shared_buffers(3 << 20, shared=False)
    monkeypatch.setattr(local, "_PROC_FD", "/nonexistent/{pid}/fd/{fd}")
    spy = _Spy(monkeypatch)
    stats = read_whole(buf, into)
    assert same(into, data)
    assert stats["shared_fallbacks"] == 3 and stats["shared_mapped"] == 0, stats
    assert spy.memmoved == 0 and sum(spy.vm_calls) > buf.total_bytes


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"fd": -1}, "'fd'"),
        ({"ino": "7"}, "'ino'"),
        ({"dev": None}, "'dev'"),
        ({"size": 0}, "'size'"),
        ({"offset": 1 << 40}, "'offset'"),
        ({"mode": 1}, "unknown \\['mode'\\]"),
        (None, None),  # a list: refused by the region's shape check, which quotes the region
    ],
)
def test_bad_shared_memory_fields_are_refused_naming_the_field(change: dict | None, field: str | None, seed: int) -> None:
    buf, _ = held(seed)
    into = shared_buffers(3 << 20, shared=False)
    k = next(iter(buf.shared))

    def edit(reply: dict[str, Any]) -> dict[str, Any]:
        extra = reply["regions"][k][4]
        if change is None:
            reply["regions"][k][4] = [1, 2]
        else:
            extra.update(change)
        return reply

    async def main() -> None:
        async with Served(buf, edit) as served:
            reader = LocalTransport()
            try:
                want = f"region {k} \\(CPU memory\\).*{field}" if field is not None else "a region is described as .*'cpu', -1, \\[1, 2\\]"
                with pytest.raises(TransportError, match=f"description is unusable: {want}"):
                    await reader.read(served.endpoint, 1, VERSION, 0, 100, into, None)
            finally:
                await reader.close()

    run(main())


# --- through the engine: register(shared_memory=True), verification --------------------------------




def test_a_damaged_byte_in_the_shared_segment_is_refused_and_read_again(server, seed, monkeypatch) -> None:
    """Trainer and reader in this process, the same-process path turned off: the reader maps the
    trainer's shared-memory files. A byte of the shared segment is damaged during the first copy
    out of it (and repaired right after): the landing hash refuses it and the range is read again."""
    monkeypatch.setattr(LocalTransport, "_own_buffers", lambda self, side, words, tag: None)
    full = _weights(seed)
    places = {n: TensorPlacement.of(n, "float32", tuple(t.shape), Replicate(), 1) for n, t in full.items()}
    trainer = tensorhub.open("shm", "train", server=server.address, transports={"local": {}})
    reader = tensorhub.open("shm", "infer", server=server.address, transports={"local": {}})
    damaged: list[int] = []
    try:
        mine = {n: t.clone() for n, t in full.items()}
        w2 = mine["w2"].data_ptr()
        trainer.register(mine, placements=places, shared_memory=True)
        assert mine["w2"].data_ptr() != w2 and mine["w2"].untyped_storage().is_shared()
        ino = os.fstat(mine["w2"].untyped_storage()._share_fd_cpu_()[0]).st_ino
        memmove = local._memmove
        moved = [0]

        def damaging(dst: list[tuple[int, int]], src: list[tuple[int, int]]) -> None:
            moved[0] += sum(n for _, n in dst)
            base = None if damaged else _reader_mapping(ino)
            if base is not None and src[0][0] <= base + 100 < src[0][0] + src[0][1]:
                byte = ctypes.c_uint8.from_address(mine["w2"].data_ptr() + 100)
                damaged.append(byte.value)
                byte.value ^= 0xFF  # the holder's byte: the reader's mapping of its file sees it
                try:
                    memmove(dst, src)
                finally:
                    byte.value ^= 0xFF
                return
            memmove(dst, src)

        monkeypatch.setattr(local, "_memmove", damaging)
        into = {n: torch.zeros_like(t) for n, t in full.items()}
        reader.register(into, placements=places)
        trainer.publish(1)
        assert reader.replicate(1, timeout=30) == 1
        stats = reader.last_pull
        assert stats is not None and set(stats.transports) == {"local"}, stats
    finally:
        reader.close()
        trainer.close()
    assert damaged, "no copy out of w2's shared segment was seen"
    total = sum(t.numel() * t.element_size() for t in full.values())
    assert moved[0] > total, (moved[0], total)  # the damaged range was read again
    for n, t in full.items():
        assert torch.equal(into[n], t), n


def _reader_mapping(ino: int) -> int | None:
    """The start of this process's read-only mapping of the shared-memory file ``ino`` (what
    the reader's transport mapped; the holder's own mapping is writable), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and parts[1] == "r--s" and parts[4] == str(ino):
                return int(parts[0].split("-")[0], 16)
    return None


def test_register_shared_memory_is_checked(server) -> None:
    h = tensorhub.open("shm2", "train", server=server.address, transports={"local": {}})
    try:
        with pytest.raises(InvalidArgument, match="shared_memory must be True or False"):
            h.register({"w": torch.zeros(4)}, shared_memory=1)
        import torch.multiprocessing as tmp

        before = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        try:
            with pytest.raises(InvalidArgument, match="'file_descriptor' sharing strategy"):
                h.register({"w": torch.zeros(1 << 20)}, shared_memory=True)
        finally:
            tmp.set_sharing_strategy(before)
    finally:
        h.close()
