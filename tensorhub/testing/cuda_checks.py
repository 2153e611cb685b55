"""The conformance check of CUDA memory on either side (``cuda_buffers``; skipped without a
CUDA device)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from tensorhub.testing.assertions import _expect, _same_bytes
from tensorhub.testing.pairs import _Ctx
from tensorhub.testing.registry import _check
from tensorhub.testing.shards import _bytes, _partition


def _no_cuda(t: Any) -> str | None:
    return None if torch.cuda.is_available() else "no CUDA device"


@_check("cuda_buffers", needs=_no_cuda)
async def _cuda_buffers(ctx: _Ctx) -> None:
    """With CUDA memory on the holder, the reader, or both, reads of random cuts land
    byte-exact (a transport without ``cuda`` stages through CPU memory)."""
    for src_dev, dst_dev in (("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")):
        shard = ctx.shard(device=src_dev)
        async with ctx.pair() as p:
            gen = await p.hold(shard)
            into = p.into(shard, device=dst_dev)
            got = await asyncio.gather(*(p.read(into, o, n) for o, n in _partition(ctx.rng, shard.total, 16)))
            _expect(set(got) == {gen}, f"reads returned generations {sorted(set(got))}, the holder's is {gen}")
            _same_bytes(_bytes(into), shard.data, f"reads from {src_dev} memory into {dst_dev} memory")
