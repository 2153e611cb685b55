"""Resharding on CUDA memory: reads landing in GPU buffers, the transforms (views, casts, FP8 block
quantization) running on the GPU, byte for byte equal to the CPU reference.

These run only where a CUDA device is present (the CI machine has none; run them on a GPU host
with ``python -m pytest tests/test_reshard_cuda.py``)."""

from __future__ import annotations

import pytest
import torch

from tensorhub.core.placement import ReplicaLayout
from tensorhub.reshard import quantize_fp8_blocks
from tensorhub.scheduling.decoders import DecoderShape, hf_placements, vllm_placements
from tensorhub.scheduling.mapping import preset
from tensorhub.scheduling.reshard import plan

from .reshard_ref import random_full, reference_quant, run_and_compare, same_bytes

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]

SIZES = dict(layers=2, hidden=512, intermediate=1024, heads=8, kv_heads=2, head_dim=128, vocab=1024)


def test_fp8_block_quantization_on_the_gpu_equals_the_cpu_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    for shape in [(1024, 768), (1000, 300), (129, 129)]:
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            x = (torch.randn(shape, generator=gen) * 20).to(dtype)
            x[:128, :128] = 0
            q, s = quantize_fp8_blocks(x.cuda())
            rq, rs = reference_quant(x)
            assert same_bytes(q.cpu(), rq) and same_bytes(s.cpu(), rs), (shape, dtype)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_hugging_face_to_vllm_on_the_gpu(tp, fp8, seed):
    shape = DecoderShape.family("qwen3", **SIZES)
    src = ReplicaLayout.spmd(hf_placements(shape, 4), 4)
    dst = ReplicaLayout.spmd(vllm_placements(shape, tp, fp8=fp8), tp)
    mapping = preset("qwen3", fp8=fp8)
    p = plan(src, dst, mapping, max_task_bytes=1 << 18)
    run_and_compare(p, src, dst, mapping, random_full(src, torch.Generator().manual_seed(seed)), device="cuda")
