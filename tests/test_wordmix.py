"""The GPU checksum ``wordmix-64`` (tensorhub.runtime.wordmix): the CPU implementation equals the
definition on every size and alignment, catches what a checksum must, and is a layout's choice
that every path of the checksum module honours. The kernel's equality with the definition runs
on a CUDA host (tests/test_cuda.py)."""

from __future__ import annotations

import random

import pytest
import torch

from tensorhub.core.errors import InvalidArgument
from tensorhub.runtime import checksum, wordmix
from tensorhub.transports.buffers import ShardBuffers, layout_of


def _random_bytes(rng: random.Random, n: int) -> torch.Tensor:
    return torch.tensor(list(rng.randbytes(n)), dtype=torch.uint8)


def test_the_cpu_path_equals_the_definition_at_every_size_and_alignment(seed: int) -> None:
    rng = random.Random(seed)
    raw = _random_bytes(rng, 4200)
    for n in [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4096]:
        for start in [0, 1, 3, 7, 8, 13]:
            piece = raw[start : start + n]
            assert wordmix.sums_torch([piece]) == [wordmix.reference(bytes(piece.tolist()))], (n, start)


def test_one_changed_byte_swapped_words_and_trailing_zeros_change_the_value(seed: int) -> None:
    rng = random.Random(seed)
    raw = _random_bytes(rng, 4096)
    base = wordmix.sums_torch([raw])[0]
    for _ in range(50):
        at, bit = rng.randrange(4096), 1 << rng.randrange(8)
        flipped = raw.clone()
        flipped[at] ^= bit
        assert wordmix.sums_torch([flipped])[0] != base, (at, bit)
    swapped = raw.clone()
    swapped[0:8], swapped[8:16] = raw[8:16].clone(), raw[0:8].clone()
    assert wordmix.sums_torch([swapped])[0] != base
    zeros = torch.zeros(24, dtype=torch.uint8)
    assert len({wordmix.sums_torch([zeros[:n]])[0] for n in (0, 1, 8, 16, 24)}) == 5


def test_a_layout_names_it_and_the_checksum_module_computes_and_verifies_it(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "tiny": torch.randn(777, generator=g),  # packed at odd offsets
        "odd": torch.randn(1001, generator=g).to(torch.bfloat16),
        "big": torch.randn(3 << 20, generator=g).to(torch.bfloat16),  # two checksum units
    }
    assert layout_of(tensors).checksum == "xxh3-64"  # CPU memory keeps the CPU's hash
    layout = layout_of(tensors, checksum="wordmix-64")
    buffers = ShardBuffers(tensors, layout)
    buffers.pack()
    sums = checksum.compute(buffers)
    assert len(sums) == layout.checksum_count() and len(set(sums)) == len(sums)
    flat = {n: t.reshape(-1).view(torch.uint8) for n, t in tensors.items()}
    assert sums[0] == wordmix.reference(bytes(flat["tiny"].tolist()))
    assert sums[-1] == wordmix.sums_torch([flat["big"][4 << 20 :]])[0]
    assert checksum.first_mismatch(buffers, range(len(sums)), sums) is None
    tensors["big"].view(-1)[(4 << 20) // 2 + 5] += 1  # in the second unit of "big"
    assert checksum.first_mismatch(buffers, range(len(sums)), sums) == len(sums) - 1
    with pytest.raises(InvalidArgument, match="landing hashes"):
        checksum.LandingHasher(buffers, list(buffers.plan.units))


def test_an_unknown_checksum_algorithm_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match="unknown checksum algorithm 'md5'"):
        layout_of({"w": torch.zeros(4)}, checksum="md5")


def test_a_cpu_range_is_hashed_without_triton() -> None:
    assert wordmix.backend(torch.device("cpu")) == "torch"


def test_a_replica_of_another_checksum_is_refused_and_told_which_to_name(inproc_server) -> None:
    import tensorhub
    from tensorhub.core.errors import LayoutMismatch

    opts = dict(server=inproc_server.address)  # local (which reports landing) where it works, and tcp
    with tensorhub.open("sums", "gpu-trainer", **opts) as a, tensorhub.open("sums", "cpu-reader", **opts) as b:
        a.register({"w": torch.zeros(4)}, checksum="wordmix-64")  # as a GPU trainer's default
        with pytest.raises(LayoutMismatch, match=r"checksum algorithm 'xxh3-64' differs .* checksum='wordmix-64'"):
            b.register({"w": torch.zeros(4)})
        b.register({"w": torch.zeros(4)}, checksum="wordmix-64")
        a.publish(1)
        assert b.replicate(1, timeout=30) == 1


_INTERPRETED = """
import contextlib, sys
import numpy as np, torch
from tensorhub.runtime import wordmix as wm
torch.cuda.device = lambda d: contextlib.nullcontext()  # the interpreter runs on CPU memory
wm.PIECE_BYTES, wm._SUB, wm._NSUB = 2048, 64, 4  # small pieces: several per range
seed = int(sys.argv[1])
raw = torch.randint(0, 256, (5 * 2048 + 4099,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
out = torch.zeros(6 * 2048 + 9000, dtype=torch.uint8)
spans = [(0, 0, 0), (1, 1, 7), (3, 13, 2061), (8, 2080, 4096), (16, 6208, 7), (40, 6275, 3000), (9000, 14336, 4101)]
src = np.array([raw.data_ptr() + a for a, _, _ in spans], dtype=np.int64)
dst = np.array([out.data_ptr() + b for _, b, _ in spans], dtype=np.int64)
sizes = np.array([n for _, _, n in spans], dtype=np.int64)
want = [wm.reference(bytes(raw[a : a + n].numpy())) for a, _, n in spans]
assert wm.sums_at(src, sizes, torch.device("cpu")) == want, "sums_at"
assert wm.copy_sums_at(src, dst, sizes, torch.device("cpu")) == want, "copy_sums_at: checksums"
assert all(torch.equal(out[b : b + n], raw[a : a + n]) for a, b, n in spans), "copy_sums_at: bytes"
assert wm._copy_self_check(torch.device("cpu")), "the self-check"
print("ok")
"""


def test_the_triton_kernels_under_the_interpreter(seed: int) -> None:
    """The hashing kernel and the fused copy-and-hash kernel, run by Triton's interpreter on CPU
    memory (where Triton is installed; CI has none, a GPU host runs them compiled): the values
    equal the definition on aligned and misaligned, multi-piece ranges, and every byte is copied."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    got = subprocess.run([sys.executable, "-c", _INTERPRETED, str(seed)], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr[-2000:]
