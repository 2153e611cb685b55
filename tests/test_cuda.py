"""The data plane on CUDA memory: packs on the GPU, checksums equal to the CPU's for the same
bytes, and tcp reads into and out of GPU tensors through pinned staging.

These run only where a CUDA device is present (the CI machine has none; run them on a GPU
host with ``python -m pytest tests/test_cuda.py``)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tensorhub.core.errors import InvalidArgument
from tensorhub.runtime import checksum, wordmix
from tensorhub.transports.buffers import ShardBuffers, layout_of
from tensorhub.transports.tcp import TcpTransport

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]


def tensors(device: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cpu = {
        "norm": torch.randn(4096, generator=g).to(torch.bfloat16),
        "bias": torch.randn(777, generator=g),
        "fp8": torch.randn(1000, generator=g).to(torch.float8_e4m3fn),
        "w": torch.randn(3 << 20, generator=g).to(torch.bfloat16),  # 6 MiB: two checksum units
        "scalar": torch.tensor(7, dtype=torch.int64),
    }
    return {k: v.to(device) for k, v in cpu.items()}


@pytest.mark.parametrize("algorithm", ["xxh3-64", "wordmix-64"])
def test_checksums_are_the_same_on_cpu_and_gpu(algorithm: str, seed: int) -> None:
    cpu_t = tensors("cpu", seed)
    cpu = ShardBuffers(cpu_t, layout_of(cpu_t, checksum=algorithm))
    gpu_t = tensors("cuda", seed)
    gpu = ShardBuffers(gpu_t, layout_of(gpu_t, checksum=algorithm))
    assert gpu.on_cuda and gpu.layout == cpu.layout
    cpu.pack()
    gpu.pack()
    assert checksum.compute(gpu) == checksum.compute(cpu)
    expected = checksum.compute(cpu)
    assert checksum.first_mismatch(gpu, range(len(expected)), expected) is None
    gpu_t["w"].view(-1)[12345] += 1
    w_first = next(u.index for u in gpu.plan.units if gpu.layout.tensors[u.tensor].name == "w")
    assert checksum.first_mismatch(gpu, range(len(expected)), expected) == w_first


def test_gpu_shards_default_to_the_gpu_checksum_computed_by_the_kernel(seed: int) -> None:
    gpu_t = tensors("cuda", seed)
    assert layout_of(gpu_t).checksum == "wordmix-64" and layout_of(tensors("cpu", seed)).checksum == "xxh3-64"
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("no Triton: the GPU checksum runs as torch ops")
    assert wordmix.backend(torch.device("cuda", torch.cuda.current_device())) == "triton"
    # Misaligned, odd-sized, multi-piece ranges: the kernel equals the definition.
    raw = torch.randint(0, 256, (3 * wordmix.PIECE_BYTES + 77,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    cut = [(0, 0), (1, 9), (5, 2 * wordmix.PIECE_BYTES + 3), (8, wordmix.PIECE_BYTES), (16, 3 * wordmix.PIECE_BYTES + 61)]
    gpu = raw.cuda()
    assert wordmix.sums_triton([gpu[a : a + n] for a, n in cut]) == [wordmix.reference(bytes(raw[a : a + n].tolist())) if n < 4096
                                                                    else wordmix.sums_torch([raw[a : a + n]])[0] for a, n in cut]  # fmt: skip


def test_a_device_landing_copies_exactly_and_hashes_what_it_wrote(seed: int) -> None:
    """DeviceLanding.copy (the local transport's GPU to GPU path): every byte copied; each unit
    wholly inside a segment hashed by the fused kernel (equal to hashing the destination after),
    a unit cut by a segment's end copied but not hashed; a byte flipped at the source changes
    that unit's digest and no other."""
    src_t = tensors("cuda", seed)
    dst_t = {k: torch.zeros_like(v) for k, v in src_t.items()}
    src, dst = ShardBuffers(src_t, layout_of(src_t)), ShardBuffers(dst_t, layout_of(dst_t))
    src.pack()
    declared = checksum.compute(src)
    total = src.layout.total_bytes
    units = list(dst.plan.units)
    big = max(units, key=lambda u: u.length)
    cut = big.offset + big.length // 2  # two segments cut the largest unit in two
    segs = []
    for lo, hi in ((0, cut), (cut, total)):
        for a, b in zip(src.segments(lo, hi - lo), dst.segments(lo, hi - lo)):
            s_bytes, d_bytes = src.gpu_bytes(a), dst.gpu_bytes(b)
            assert s_bytes is not None and d_bytes is not None
            segs.append((a.offset, s_bytes, d_bytes))
    landing = checksum.DeviceLanding(dst, units)
    landing.copy(segs)
    dst.unpack()
    assert all(torch.equal(src_t[k], dst_t[k]) for k in src_t)
    device = torch.device("cuda", torch.cuda.current_device())
    if wordmix.copy_backend(device) != "triton":
        assert all(not u.length for u in units if u.index in landing.digests)
        pytest.skip(f"no fused copy on {device}: copied with copy_, hashed after")
    assert big.index not in landing.digests and not landing.complete
    assert landing.digests == {u.index: declared[u.index] for u in units if u.index != big.index}
    # a flipped source byte: the digest is of the flipped bytes, as they landed
    other = next(u for u in units if u.index != big.index and u.length)
    (seg,), (dseg,) = src.segments(other.offset, other.length), dst.segments(other.offset, other.length)
    s_bytes, d_bytes = src.gpu_bytes(seg), dst.gpu_bytes(dseg)
    assert s_bytes is not None and d_bytes is not None
    s_bytes[0] ^= 0xFF
    again = checksum.DeviceLanding(dst, [other])
    again.copy([(seg.offset, s_bytes, d_bytes)])
    assert again.complete and again.digests[other.index] != declared[other.index]
    assert again.digests[other.index] == checksum.compute(dst, [other.index])[0]
    with pytest.raises(InvalidArgument, match="device landing needs GPU buffers"):
        checksum.DeviceLanding(ShardBuffers(tensors("cpu", seed), layout_of(tensors("cpu", seed))), units)

def test_tcp_moves_gpu_packs_and_tensors_byte_exact(seed: int) -> None:
    src = tensors("cuda", seed)
    held = ShardBuffers(src, layout_of(src))
    held.pack()
    held.progress.reset(1, held.total_bytes)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    into = ShardBuffers(dst, held.layout)

    async def main() -> None:
        holder, reader = TcpTransport(), TcpTransport()
        await holder.start()
        await reader.start()
        holder.serve(lambda region, version: held if (region, version) == (1, 1) else None)
        try:
            await reader.read(holder.endpoint(), 1, 1, 0, held.total_bytes, into, None)
        finally:
            await reader.close()
            await holder.close()

    asyncio.run(main())
    into.unpack()
    for k in src:
        assert torch.equal(dst[k].reshape(-1).view(torch.uint8), src[k].reshape(-1).view(torch.uint8)), k
    assert checksum.compute(into) == checksum.compute(held)


def test_a_conversion_through_the_server_lands_on_the_gpu_byte_exact(seed: int) -> None:
    """A converted model whose shard is in GPU memory converts on the GPU (reads staged there,
    verified with wordmix-64, quantized by the GPU) and lands what the CPU reference makes."""
    import threading

    import tensorhub
    from tensorhub.core.placement import ReplicaLayout
    from tensorhub.reshard import convert_in_process, torch_dtype
    from tensorhub.scheduling.decoders import DecoderShape, hf_placements, vllm_placements
    from tensorhub.scheduling.mapping import preset
    from tensorhub.scheduling.reshard import plan

    from .procs import InprocServer
    from .reshard_ref import random_full, same_bytes, shard_all

    shape = DecoderShape.family("qwen3", layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=128, vocab=512)
    src, dst = ReplicaLayout.spmd(hf_placements(shape, 2), 2), ReplicaLayout.spmd(vllm_placements(shape, 1, fp8=True), 1)
    mapping = preset("qwen3", fp8=True)
    shards = shard_all(src, random_full(src, torch.Generator().manual_seed(seed)))
    want = convert_in_process(plan(src, dst, mapping), shards)[0]
    srv = InprocServer()
    trainer = [tensorhub.open("q", "t", num_shards=2, shard_idx=i, server=srv.address) for i in range(2)]
    try:
        for i, h in enumerate(trainer):
            h.register({k: v.cuda() for k, v in shards[i].items()}, placements={pt.name: pt for pt in src.shards[i]})
        threads = [threading.Thread(target=h.publish, args=(1,)) for h in trainer]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        with tensorhub.open("q-vllm", "r", convert_from="q", mapping=mapping, server=srv.address) as r:
            dest = {pt.name: torch.full(pt.local_shape(), 7, dtype=torch_dtype(pt.placement.dtype), device="cuda") for pt in dst.shards[0]}
            r.register(dest, placements={pt.name: pt for pt in dst.shards[0]})
            assert r.replicate(1, timeout=60) == 1
            assert r.last_conversion is not None and r.last_conversion.version == 1
            assert all(same_bytes(dest[k].cpu(), want[k]) for k in want)
    finally:
        for h in trainer:
            h.close()
        srv.close()


def test_a_gpu_publisher_compares_on_the_gpu_against_a_pinned_snapshot(seed: int) -> None:
    from tensorhub.handles.deltas import _compare, _copy_to_cpu
    from tensorhub.runtime.deltas import compute_delta

    v0 = tensors("cpu", seed)
    v1 = {k: v.clone() for k, v in v0.items()}
    v1["w"].view(-1)[::1000] += 1  # sparse
    v1["bias"].add_(1)  # dense
    gpu = {k: v.cuda() for k, v in v0.items()}
    snap = _copy_to_cpu(gpu)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in snap.values())
    for k, t in gpu.items():
        t.copy_(v1[k])
    layout = layout_of(gpu)
    delta, snap2 = _compare(snap, gpu, 0, 1, layout, None, None)
    want = compute_delta(v0, v1, base_version=0, version=1, layout=layout, with_checksums=False)
    assert [(e.name, e.encoding, e.changed) for e in delta.tensors] == [(e.name, e.encoding, e.changed) for e in want.tensors]
    for got, exp in zip(delta.tensors, want.tensors):
        assert got.values.device.type == "cpu" and torch.equal(got.values.view(torch.uint8), exp.values.view(torch.uint8))
        assert (got.indices is None) == (exp.indices is None)
        assert got.indices is None or torch.equal(got.indices, exp.indices)
    assert snap2 is snap and all(torch.equal(snap[k].view(-1).view(torch.uint8), v1[k].view(-1).view(torch.uint8)) for k in v1)
