"""The floor of a verified same-host copy (``benchmarks/bench_floor.py`` and the suite's
``verified copy`` system): the system copies and verifies for real (a flipped byte, checksums
that never come and another layout are refused by name), and the floor's arithmetic adds the
passes up as its docstring says."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_floor import arithmetic, questions
from benchmarks.harness import BenchmarkError
from benchmarks.suite_systems import FLOOR_PIECE, VerifiedCopyHolder, VerifiedCopyReader, floor_pieces


def _shard(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = [3 * FLOOR_PIECE + 5, 17, FLOOR_PIECE]  # a tail piece, a tiny tensor, one whole piece
    return {f"t{i}": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g) for i, n in enumerate(sizes)}


def test_pieces_never_cross_tensors() -> None:
    spans = [(1000, 2 * FLOOR_PIECE + 1), (9_000_000, 3)]
    assert floor_pieces(spans) == [(1000, FLOOR_PIECE), (1000 + FLOOR_PIECE, FLOOR_PIECE), (1000 + 2 * FLOOR_PIECE, 1), (9_000_000, 3)]


def test_verified_copy_lands_the_bytes_and_refuses_a_flipped_one(seed: int) -> None:
    source = _shard(seed)
    holder = VerifiedCopyHolder(source)
    dest = {k: torch.zeros_like(v) for k, v in source.items()}
    reader = VerifiedCopyReader(dest, holder.info, timeout=5.0)  # this process's own pid: process_vm_readv works alike
    try:
        holder.prepare(1)
        holder.run(1)
        assert reader.run(1) == {"pieces": len(floor_pieces([(0, t.numel()) for t in source.values()]))}
        assert all(torch.equal(dest[k], source[k]) for k in source)
        holder.prepare(2)
        holder.run(2)  # checksums of the bytes as they are now ...
        source["t0"][FLOOR_PIECE + 7] ^= 0xFF  # ... then one byte changes before the reader copies it
        with pytest.raises(BenchmarkError, match=r"1 of 6 pieces differ from the holder's checksums \(round 2\)"):
            reader.run(2)
    finally:
        holder.close()
        reader.close()


def test_verified_copy_waits_for_the_checksums_within_its_bound(seed: int) -> None:
    source = _shard(seed)
    holder = VerifiedCopyHolder(source)
    reader = VerifiedCopyReader({k: torch.zeros_like(v) for k, v in source.items()}, holder.info, timeout=0.2)
    try:
        holder.prepare(3)  # nothing posted for round 3
        with pytest.raises(BenchmarkError, match="posted no checksums for round 3"):
            reader.run(3)
    finally:
        holder.close()
        reader.close()


def test_verified_copy_refuses_another_layout(seed: int) -> None:
    source = _shard(seed)
    holder = VerifiedCopyHolder(source)
    try:
        with pytest.raises(BenchmarkError, match="tensors differ"):
            VerifiedCopyReader({"t0": torch.zeros(8, dtype=torch.uint8)}, holder.info, timeout=1.0)
    finally:
        holder.close()


def test_floor_arithmetic_adds_the_passes() -> None:
    # (wall, CPU) seconds per GB of each pass, made up so that every term is visible
    rows = {"memcpy": (0.20, 0.20), "memcpy, fresh destination": (0.50, 0.45), "vm copy": (0.25, 0.24),
            "vm copy + hash": (0.30, 0.30), "publisher hash": (0.10, 0.10), "vm copy + hash, 2 threads": (0.20, 0.30)}  # fmt: skip
    lines, got = arithmetic(rows, [1, 4])
    assert got["hash_reader"] == pytest.approx(0.06) and got["faults"] == pytest.approx(0.25)
    assert got["cores"] == pytest.approx(1.5)  # 0.30 s one thread, 0.20 s on two
    assert got["floor_1_2"] == pytest.approx((0.24 + 0.06 + 0.10) / 2)
    assert got["floor_4_measured"] == pytest.approx((4 * 0.30 + 0.10) / 1.5)
    assert any("= 1.00x memcpy's rate" in line for line in lines)  # 0.20 CPU s of memcpy against a 0.20 s floor on 2 cores
    rows["vm copy + hash, 2 threads"] = (0.05, 0.30)  # a faster 2-thread run than 2 cores allow is capped at 2
    assert arithmetic(rows, [1])[1]["cores"] == 2.0


def test_the_questions_split_the_hash_from_the_copy_per_piece_size() -> None:
    # (wall, CPU) seconds per GB, made up: the hash adds 0.05 at 256 KiB, 0.03 at 1 MiB, 0.08 at 4 MiB
    rows = {"vm copy": (0.20, 0.20), "vm copy + hash": (0.23, 0.23), "vm copy + hash, 256 KiB pieces": (0.30, 0.30),
            "vm copy + hash, 4 MiB pieces": (0.28, 0.28), "vm copy, 256 KiB pieces": (0.25, 0.25),
            "vm copy, 4 MiB pieces": (0.20, 0.20), "copy + hash | publisher hash": (0.40, 0.40),
            "copy + hash trailing publisher": (0.30, 0.30), "hash from L2 (256 KiB, again)": (0.02, 0.02),
            "copy | hash on 2nd thread": (0.20, 0.25), "publisher hash": (0.10, 0.10), "publisher hash, 2 threads": (0.05, 0.10),
            "wordmix-64 hash (CPU)": (2.0, 2.0)}  # fmt: skip
    text = "\n".join(questions(rows))
    assert "256 KiB 0.050 (0.20)   1 MiB 0.030 (0.15)   4 MiB 0.080 (0.40)" in text  # h and h/c per piece size
    assert "least CPU: 1 MiB pieces" in text
    assert "0.300 CPU s/GB for both against 0.400 when they share nothing (-25%)" in text


def test_the_goals_say_how_far_the_verified_copy_gets() -> None:
    from benchmarks.suite_report import goals

    def row(system: str, n: int, wall: float, cpu: float, gbps: float = 0.0) -> dict:
        return {"system": system, "workload": "64x16MiB", "readers": n, "wall_s": wall, "aggregate_gbps": n * gbps,
                "reader_gbps": gbps, "cpu_s_per_gb": cpu, "holder_rss_mib": 19.0}  # fmt: skip

    rows = [row("tensorhub[local]", 4, 1.2, 0.6), row("gloo broadcast", 4, 1.6, 0.8), row("verified copy", 4, 1.0, 0.45),
            row("tensorhub[local]", 1, 0.35, 0.7, 3.0), row("memcpy", 1, 0.2, 0.3, 5.0), row("verified copy", 1, 0.3, 0.5, 4.0)]  # fmt: skip
    got = {g["key"]: g for g in goals(rows, "tensorhub[local]")}
    assert got["vs_gloo"]["floor"] == pytest.approx(1.0 / 1.6) and "takes 1.000 s: 0.62x" in got["vs_gloo"]["why"]
    assert got["vs_memcpy"]["floor"] == pytest.approx(0.8) and "reaches 0.80x memcpy" in got["vs_memcpy"]["why"]
    assert "floor" not in got["vs_ray"]  # Ray did not run: nothing to compare the floor with
    without = {g["key"]: g for g in goals([r for r in rows if r["system"] != "verified copy"], "tensorhub[local]")}
    assert "floor" not in without["vs_gloo"] and "verified copy" not in without["vs_gloo"].get("why", "")
