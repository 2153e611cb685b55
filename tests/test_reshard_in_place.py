"""A conversion that only moves bytes lands them in place (:mod:`tensorhub.runtime.convert`):
straight into the destination tensors, verified there, and the verified source checksums become
the converted shard's own where a destination unit is a source unit's bytes. What must hold: the
bytes are right, the in-place tasks are the byte-moving ones only (a cast is staged), the
checksums the converter declares are those of its bytes (a peer pulling from it verifies every
unit against them), and a unit damaged on the way is caught where it landed and read again."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import tensorhub
from tensorhub.core.placement import Replicate, Shard, TensorPlacement
from tensorhub.runtime import checksum
from tensorhub.scheduling.mapping import Cast, Mapping, Rename
from tensorhub.transports.buffers import ShardBuffers, layout_of

from .procs import InprocServer

ROWS = 1024  # each large local tensor is 2 MiB: at the pack threshold, so a region of its own


@pytest.fixture
def server():
    srv = InprocServer()
    yield srv
    srv.close()


def _source(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(ROWS, 1024, generator=g),  # dim-0 shards: two reads, each a row block of the destination
        "c": torch.randn(ROWS, 1024, generator=g),  # cast to bf16 at the destination: staged
        "n": torch.randn(64, generator=g),  # tiny (packed on both sides), dim-0 shards
        "e": torch.randn(ROWS // 2, 1024, generator=g),  # replicated: one read, its units are the destination's
    }


def _placements(shards: int) -> dict[str, TensorPlacement]:
    return {
        "w": TensorPlacement.of("w", "float32", (ROWS, 1024), Shard(0), shards),
        "c": TensorPlacement.of("c", "float32", (ROWS, 1024), Shard(0), shards),
        "n": TensorPlacement.of("n", "float32", (64,), Shard(0), shards),
        "e": TensorPlacement.of("e", "float32", (ROWS // 2, 1024), Replicate(), shards),
    }


MAPPING = Mapping(renames=(Rename("w", "w2"),), casts=(Cast("c", "bfloat16"),))
DEST = {"w2": ((ROWS, 1024), torch.float32), "c": ((ROWS, 1024), torch.bfloat16), "n": ((64,), torch.float32),
        "e": ((ROWS // 2, 1024), torch.float32)}  # fmt: skip


def _publish(server: InprocServer, full: dict[str, torch.Tensor], version: int) -> list:
    trainer = [tensorhub.open("src", "train", num_shards=2, shard_idx=i, server=server.address) for i in range(2)]
    for i, h in enumerate(trainer):
        local = {n: (t if n == "e" else t.chunk(2)[i]).clone() for n, t in full.items()}
        h.register(local, placements=_placements(2))
    threads = [threading.Thread(target=h.publish, args=(version,)) for h in trainer]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return trainer


def _register_dest(h: Any) -> dict[str, torch.Tensor]:
    """Register zeroed destination tensors (DEST, each replicated) on converting handle ``h``."""
    dest = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt) in DEST.items()}
    h.register(dest, placements={n: TensorPlacement.of(n, str(dt).removeprefix("torch."), shape, Replicate(), 1)
                                  for n, (shape, dt) in DEST.items()})  # fmt: skip
    return dest


def _converted(server: InprocServer, replica: str) -> tuple:
    h = tensorhub.open("dst", replica, server=server.address, convert_from="src", mapping=MAPPING)
    return h, _register_dest(h)


def _expect(dest: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    assert torch.equal(dest["w2"], full["w"])
    assert torch.equal(dest["c"], full["c"].to(torch.bfloat16))
    assert torch.equal(dest["n"], full["n"])
    assert torch.equal(dest["e"], full["e"])


def test_a_byte_moving_conversion_lands_in_place_and_declares_its_bytes_checksums(server):
    full = _source(1)
    trainer = _publish(server, full, 1)
    conv, dest = _converted(server, "infer-1")
    peer, peer_dest = _converted(server, "infer-2")
    try:
        assert conv.replicate(1, timeout=30) == 1
        _expect(dest, full)
        stats = conv.last_conversion
        assert stats is not None and stats.failures == 0
        # w (two row-block reads), n (two tiny reads) and e land in place; c is cast: staged
        assert stats.in_place == 3 and stats.tasks == 4, stats
        # The second replica pulls the converted bytes from the first and verifies every unit
        # against the checksums the converter declared (e's are the source's own, w's hashed).
        assert peer.replicate(1, timeout=30) == 1
        _expect(peer_dest, full)
        assert peer.last_conversion is None
        # and directly: the declared checksums are those of the converter's bytes
        b = ShardBuffers(dest, layout_of(dest))
        b.pack()
        assert server.checksums("dst", 1) == tuple(checksum.compute(b))
    finally:
        for h in (peer, conv, *trainer):
            h.close()


def test_a_unit_damaged_on_the_way_is_caught_where_it_landed_and_read_again(server):
    # one flipped byte in the last large tensor of a source shard's transfer space: e's, read in place
    offset = 2 * (2 << 20) + 256 + 1000  # w's and c's local 2 MiB each after the 256-byte pack, then into e
    damaged = {"local": {"faults": [{"op": "corrupt", "at": offset, "times": 1}]}}
    conv, dest = None, None
    full = _source(2)
    # the first handle of this process starts its engine's transports: the damaging one
    conv = tensorhub.open("dst", "infer-1", server=server.address, convert_from="src", mapping=MAPPING, transports=damaged)
    trainer: list = []
    try:
        dest = _register_dest(conv)
        trainer = _publish(server, full, 1)
        assert conv.replicate(1, timeout=30) == 1
        _expect(dest, full)
        stats = conv.last_conversion
        assert stats is not None and stats.in_place == 3
        assert stats.failures == 1, stats  # the damaged read failed its checksum where it landed, and was read again
        fired = [f.op for t in conv._engine.transports.values() for f in getattr(t, "fired", [])]  # type: ignore[attr-defined]
        assert fired == ["corrupt"]
        assert server.stats()["quarantined"] == 0  # the source's self-check passed: nobody blamed
    finally:
        for h in (conv, *trainer):
            h.close()


def _runs_source(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"a": torch.randn(ROWS // 2, 1024, generator=g), "b": torch.randn(ROWS // 2, 1024, generator=g)}
    out.update({f"n{i}": torch.randn(256, generator=g) for i in range(8)})  # tiny: end to end in the pack
    return out


def _runs_dest(full: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``a`` and ``b`` as views of one buffer, end to end (a fused parameter's halves)."""
    fused = torch.zeros(2 * full["a"].numel())
    dest = {"a": fused[: full["a"].numel()].view(full["a"].shape), "b": fused[full["a"].numel() :].view(full["b"].shape)}
    dest.update({n: torch.zeros_like(t) for n, t in full.items() if n not in dest})
    return dest, fused


def test_reads_that_follow_each_other_in_the_source_are_read_as_one(server):
    """Reads landing in place that follow each other in the source's transfer space are one
    transport read: ``a`` and ``b`` into their fused buffer, the eight tiny tensors through one
    staging buffer and copied out. The bytes, the declared checksums and a damaged byte in the
    tiny run (caught, read again) hold as for single reads."""
    full = _runs_source(3)
    places = {n: TensorPlacement.of(n, "float32", tuple(t.shape), Replicate(), 1) for n, t in full.items()}
    # a byte of the pack at the start of the source's transfer space (n0..n7, 1 KiB each): the tiny run
    damaged = {"local": {"faults": [{"op": "corrupt", "at": 512 + 3, "times": 1}]}}
    conv = tensorhub.open("dstr", "infer-1", server=server.address, convert_from="srcr", transports=damaged)
    trainer = tensorhub.open("srcr", "train", server=server.address)
    peer = None
    try:
        dest, fused = _runs_dest(full)
        conv.register(dest, placements=places)
        trainer.register({n: t.clone() for n, t in full.items()}, placements=places)
        trainer.publish(1)
        assert conv.replicate(1, timeout=30) == 1
        for n, t in full.items():
            assert torch.equal(dest[n], t), n
        assert torch.equal(fused, torch.cat([full["a"].reshape(-1), full["b"].reshape(-1)]))
        stats = conv.last_conversion
        assert stats is not None and stats.in_place == 10 and stats.tasks == 10, stats
        # a|b in place (one read), n0..n7 staged (one read), and the damaged run read again
        assert stats.failures == 1 and stats.reads == 3, stats
        # the declared checksums are those of the converter's bytes: a peer verifies them all
        peer = tensorhub.open("dstr", "infer-2", server=server.address, convert_from="srcr")
        peer_dest, _ = _runs_dest(full)
        peer.register(peer_dest, placements=places)
        assert peer.replicate(1, timeout=30) == 1
        for n, t in full.items():
            assert torch.equal(peer_dest[n], t), n
        assert peer.last_conversion is None  # pulled the converted bytes, verified against those checksums
    finally:
        for h in (peer, conv, trainer):
            if h is not None:
                h.close()
