"""Resharding, byte for byte: each scenario plans (``tensorhub.scheduling.reshard``), then runs
the plan as the data path would (``tensorhub.reshard``: cut the plan's byte segments out of the
source shards' bytes, land them, transform, write into poisoned destination buffers) and
compares every destination byte with the reference: gather the full tensors, transform them
(concatenate, cast, DeepGEMM's block quantizer), slice them as DTensor and vLLM shard them."""

from __future__ import annotations

import pytest
import torch

from tensorhub.core import wire
from tensorhub.core.errors import InvalidPlacement, MappingMismatch
from tensorhub.core.placement import REPLICATE, PlacedTensor, ReplicaLayout, Replicate, Shard, TensorPlacement
from tensorhub.reshard import convert_in_process, quantize_fp8_blocks
from tensorhub.scheduling.decoders import DecoderShape, hf_placements, vllm_placements
from tensorhub.scheduling.mapping import IDENTITY, Cast, Fuse, Mapping, Quantize, preset
from tensorhub.scheduling.reshard import FP8, SCALES, plan, segments_of

from .reshard_ref import random_full, reference_quant, run_and_compare, same_bytes, shard_all

pytestmark = pytest.mark.timeout(120)


def spmd(shards: int, *tensors: TensorPlacement) -> ReplicaLayout:
    return ReplicaLayout.spmd(list(tensors), shards)


def tensors_on(shards: int, placement, dtype: str = "bfloat16") -> list[TensorPlacement]:
    """A weight, a bias and a norm, the weight and bias placed by ``placement``, the norm replicated."""
    p = placement if isinstance(placement, tuple) else (placement,)
    mesh = (shards,) if len(p) == 1 else (2, shards // 2)
    bias_dims = tuple(0 if isinstance(x, Shard) and x.dim == 0 else REPLICATE for x in p)
    return [
        TensorPlacement.of("w", dtype, (60, 44), p, mesh),
        TensorPlacement("b", dtype, (60,), mesh, bias_dims),
        TensorPlacement("norm", "float32", (44,), mesh, (REPLICATE,) * len(mesh)),
    ]


def check(source: ReplicaLayout, dest: ReplicaLayout, mapping=IDENTITY, seed: int = 0, **kw):
    p = plan(source, dest, mapping, **kw)
    full = random_full(source, torch.Generator().manual_seed(seed))
    run_and_compare(p, source, dest, mapping, full)
    return p


# --- tensor parallelism, even and uneven --------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("n_src, n_dst", [(8, 4), (4, 8), (2, 3), (3, 2), (1, 5)])
def test_tensor_parallel_to_tensor_parallel(n_src, n_dst, dim, seed):
    p = check(spmd(n_src, *tensors_on(n_src, Shard(dim))), spmd(n_dst, *tensors_on(n_dst, Shard(dim))), seed=seed)
    assert sum(p.loads) >= 60 * 44 * 2


def test_an_uneven_split_keeps_empty_trailing_shards(seed):
    # 4 rows over 3 shards: [0,2) [2,4) [4,4) (DTensor's rule; torch.chunk gives only two chunks)
    src = spmd(2, TensorPlacement.of("w", "float32", (4, 5), Shard(1), 2))
    dst = spmd(3, TensorPlacement.of("w", "float32", (4, 5), Shard(0), 3))
    p = check(src, dst, seed=seed)
    assert p.shards[2].tensors[0].shape == (0, 5) and p.shards[2].tasks == ()


@pytest.mark.parametrize("to", ["column", "row", "2d"])
def test_fsdp_to_column_and_row_parallel(to, seed):
    src = spmd(8, *tensors_on(8, Shard(0)))
    placement = {"column": Shard(0), "row": Shard(1), "2d": (Shard(0), Shard(1))}[to]
    dst = spmd(4 if to == "2d" else 2, *tensors_on(4 if to == "2d" else 2, placement))
    check(src, dst, seed=seed)


def test_hsdp_2d_source_to_tensor_parallel(seed):
    # (Replicate, Shard(0)) over a 2x4 mesh: each piece on two shards, reads balanced over both
    src = spmd(8, *tensors_on(8, (Replicate(), Shard(0))))
    p = check(src, spmd(2, *tensors_on(2, Shard(1))), seed=seed)
    assert max(p.loads) - min(p.loads) <= max(r.nbytes for s in p.shards for t in s.tasks for r in t.reads)


def test_replicated_sources_share_the_load(seed):
    src = spmd(4, *tensors_on(4, Replicate()))
    p = check(src, spmd(4, *tensors_on(4, Shard(0))), seed=seed)
    reads = [r for s in p.shards for t in s.tasks for r in t.reads]
    assert max(p.loads) - min(p.loads) <= max(r.nbytes for r in reads)
    assert len({r.shard for r in reads if r.tensor == "w"}) == 4  # four destination shards, four sources
    check(src, spmd(3, *tensors_on(3, Replicate())), seed=seed)  # and to a replicated destination


def test_excluded_sources_are_not_read(seed):
    src = spmd(4, *tensors_on(4, (Replicate(), Shard(0))))
    p = check(src, spmd(2, *tensors_on(2, Shard(1))), exclude={0, 3}, seed=seed)
    assert {r.shard for s in p.shards for t in s.tasks for r in t.reads} == {1, 2}
    assert p.loads[0] == p.loads[3] == 0
    with pytest.raises(InvalidPlacement, match="not reading from shards \\[0, 2\\]") as info:
        plan(src, spmd(2, *tensors_on(2, Shard(1))), exclude={0, 2})
    assert info.value.tensors == ("w",)


# --- segments -----------------------------------------------------------------------------------


def test_strided_column_slices_read_whole_rows_or_one_run_per_row():
    src = spmd(4, TensorPlacement.of("w", "bfloat16", (64, 512), Shard(1), 4))
    dst = spmd(8, TensorPlacement.of("w", "bfloat16", (64, 512), Shard(1), 8))
    # each destination shard needs half of each row of one source shard (128 of 256 bytes)
    merged = plan(src, dst)
    for s in merged.shards:
        ((read,),) = [t.reads for t in s.tasks]
        assert read.num_segments == 1 and read.nbytes == 63 * 256 + 128  # whole rows, sliced on landing
    exact = plan(src, dst, max_gap=64)
    for s in exact.shards:
        ((read,),) = [t.reads for t in s.tasks]
        assert (read.counts, read.length, read.pitches) == ((64,), 128, (256,))  # one run per row
    assert merged.num_segments == 8 and exact.num_segments == 8 * 64
    # whole source shards (8 -> 4 along columns) and row blocks are one segment each, with no hole
    for a, b, placement in [(8, 4, Shard(1)), (2, 8, Shard(0))]:
        p = plan(
            spmd(a, TensorPlacement.of("w", "bfloat16", (64, 512), placement, a)),
            spmd(b, TensorPlacement.of("w", "bfloat16", (64, 512), placement, b)),
            max_gap=0,
        )
        assert all(r.num_segments == 1 for s in p.shards for t in s.tasks for r in t.reads)
        assert sum(p.loads) == 64 * 512 * 2


def test_segment_geometry_of_a_3d_box():
    from tensorhub.core.placement import Box

    # dims: 4 x 6 x 10 float32; box [1,3) x [1,5) x [2,5): runs of 3 elements, 2 x 4 of them
    box = Box((1, 1, 2), (3, 5, 5))
    start, length, counts, pitches, strides = segments_of(box, (4, 6, 10), 4, 0)
    assert (start, length, counts, pitches, strides) == ((60 + 10 + 2) * 4, 12, (2, 4), (240, 40), (12, 3, 1))
    # the 7-element (28-byte) holes between a row's runs merge at max_gap=28; the 27-element
    # hole between the two blocks of rows does not
    start, length, counts, pitches, strides = segments_of(box, (4, 6, 10), 4, 28)
    assert (start, length, counts, pitches, strides) == ((60 + 10 + 2) * 4, (3 * 10 + 3) * 4, (2,), (240,), (33, 10, 1))
    assert segments_of(box, (4, 6, 10), 4, 108)[1:3] == ((60 + 33) * 4, ())


# --- fused projections -------------------------------------------------------------------------

SIZES = dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=1, head_dim=128, vocab=512)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hugging_face_fsdp_to_vllm_tensor_parallel(family, tp, seed):
    # GQA: 4 query heads, 1 KV head: at tp 2 and 4 every rank holds the one KV head (replicated)
    shape = DecoderShape.family(family, **{**SIZES, "kv_heads": 2 if family == "llama" else 1})
    src = ReplicaLayout.spmd(hf_placements(shape, 4), 4)
    dst = ReplicaLayout.spmd(vllm_placements(shape, tp), tp)
    check(src, dst, preset(family), seed=seed)


def test_vllm_to_vllm_tensor_parallel(seed):
    # packed to packed: TP 4 (KV replicated) -> TP 2 (KV chunked) and back
    shape = DecoderShape.family("qwen2", **{**SIZES, "kv_heads": 2})
    for a, b in [(4, 2), (2, 4), (1, 4)]:
        check(
            ReplicaLayout.spmd(vllm_placements(shape, a), a),
            ReplicaLayout.spmd(vllm_placements(shape, b), b),
            seed=seed,
        )


def test_gate_up_fused_along_columns_and_cast(seed):
    m = Mapping(fusions=(Fuse("gate_up", ("gate", "up"), dim=1),), casts=(Cast("gate_up", "float16"),))
    src = spmd(
        3,
        TensorPlacement.of("gate", "float32", (10, 6), Shard(0), 3),
        TensorPlacement.of("up", "float32", (10, 9), Shard(1), 3),
    )
    for dst in [
        spmd(2, TensorPlacement.of("gate_up", "float16", (10, 15), Shard(1), 2)),
        spmd(2, TensorPlacement.of("gate_up", "float16", (10, 15), Shard(1), 2, parts=(6, 9), parts_dim=1, unit=3)),
        spmd(
            4,
            TensorPlacement.of("gate_up", "float16", (10, 15), (Shard(0), Shard(1)), (2, 2), parts=(6, 9), parts_dim=1),
        ),
    ]:
        check(src, dst, m, seed=seed)


# --- FP8 ---------------------------------------------------------------------------------------


def test_quantizer_equals_the_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    for shape, block in [((256, 384), (128, 128)), ((200, 300), (128, 128)), ((7, 5), (2, 3))]:
        x = (torch.randn(shape, generator=gen) * 10).to(torch.bfloat16)
        x[: block[0], : block[1]] = 0  # an all-zero block: amax floored, scale finite
        q, s = quantize_fp8_blocks(x, block)
        rq, rs = reference_quant(x, block)
        assert same_bytes(q, rq) and same_bytes(s, rs) and s.dtype == torch.float32
        assert torch.isfinite(s).all() and q.dtype == torch.float8_e4m3fn
        # and the transform is a quantization: values * scale is close to x
        deq = (
            q.float().view(-1, block[0], q.shape[1] // block[1], block[1])
            if shape[0] % block[0] == 0 and shape[1] % block[1] == 0
            else None
        )
        if deq is not None:
            back = (deq * s[:, None, :, None]).view(shape)
            assert torch.allclose(back, x.float(), rtol=0.07, atol=1e-3)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hugging_face_bf16_to_vllm_fp8(family, tp, seed):
    shape = DecoderShape.family(family, **{**SIZES, "heads": 8, "kv_heads": 2, "intermediate": 1024})
    src = ReplicaLayout.spmd(hf_placements(shape, 4), 4)
    dst = ReplicaLayout.spmd(vllm_placements(shape, tp, fp8=True), tp)
    p = check(src, dst, preset(family, fp8=True), seed=seed)
    fp8 = [t for s in p.shards for t in s.tasks if t.op == FP8]
    assert fp8 and all({o.kind for o in t.outputs} == {"values", SCALES} for t in fp8)  # weight and scale bundled


def test_fp8_when_shards_do_not_align_with_blocks(seed):
    # 200 rows over 2 shards are 100 + 100, the 2 block rows 1 + 1: weight and scale tasks differ
    m = Mapping(quantize=(Quantize("{w}.weight", "{w}.scale"),))
    src = spmd(3, TensorPlacement.of("a.weight", "bfloat16", (200, 300), Shard(1), 3))
    dst = spmd(2, TensorPlacement.of("a.weight", "float8_e4m3fn", (200, 300), Shard(0), 2),
               TensorPlacement.of("a.scale", "float32", (2, 3), Shard(0), 2))  # fmt: skip
    p = check(src, dst, m, seed=seed)
    (second,) = [s for s in p.shards if s.shard == 1]
    assert sorted(t.region.start[0] for t in second.tasks) == [0, 128]  # rows 100.. need block 0 whole


def test_tasks_split_under_a_memory_bound(seed):
    shape = DecoderShape.family("qwen3", **SIZES)
    src = ReplicaLayout.spmd(hf_placements(shape, 4), 4)
    dst = ReplicaLayout.spmd(vllm_placements(shape, 2, fp8=True), 2)
    whole = plan(src, dst, preset("qwen3", fp8=True))
    bound = 64 << 10
    split = check(src, dst, preset("qwen3", fp8=True), max_task_bytes=bound, seed=seed)
    assert max(t.nbytes for s in split.shards for t in s.tasks) <= bound  # 128 bf16 rows of 256 = 64 KiB
    assert sum(len(s.tasks) for s in split.shards) > sum(len(s.tasks) for s in whole.shards)
    assert split.read_bytes == whole.read_bytes


# --- plans as data ------------------------------------------------------------------------------


def test_plans_are_deterministic_plain_data():
    import msgpack

    shape = DecoderShape.family("qwen3", **SIZES)
    src = ReplicaLayout.spmd(hf_placements(shape, 4), 4)
    dst = ReplicaLayout.spmd(vllm_placements(shape, 2, fp8=True), 2)
    p = plan(src, dst, preset("qwen3", fp8=True))
    assert plan(src, dst, preset("qwen3", fp8=True)) == p
    data = msgpack.packb(wire.to_plain(p), use_bin_type=True)
    assert wire.from_plain(type(p), msgpack.unpackb(data, raw=False)) == p
    assert p.shards[1].sources() == (0, 1, 2, 3)


def test_bad_mappings_are_refused_before_planning():
    shape = DecoderShape.family("qwen3", **SIZES)
    src = ReplicaLayout.spmd(hf_placements(shape, 4), 4)
    dst = ReplicaLayout.spmd(vllm_placements(shape, 2, fp8=True), 2)
    with pytest.raises(MappingMismatch) as info:
        plan(src, dst, preset("qwen3"))  # no fp8: the destination's fp8 weights and scales do not fit
    assert "model.layers.0.self_attn.qkv_proj.weight_scale_inv" in info.value.tensors
    incomplete = ReplicaLayout(tuple(tuple(PlacedTensor(t.placement, t.coord) for t in s) for s in src.shards[:3]))
    with pytest.raises(InvalidPlacement, match="model.embed_tokens.weight"):
        plan(incomplete, dst, preset("qwen3", fp8=True))


def test_converting_sources_that_are_views(seed):
    # source tensors registered as non-contiguous views are read by their bytes in layout order
    src = spmd(2, TensorPlacement.of("w", "float32", (6, 4), Shard(0), 2))
    dst = spmd(1, TensorPlacement("w", "float32", (6, 4)))
    full = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
    sources = [{"w": full.t().contiguous().t()[3 * i : 3 * i + 3]} for i in range(2)]
    out = convert_in_process(plan(src, dst), sources)[0]
    assert torch.equal(out["w"], full)
    assert shard_all(dst, {"w": full})[0]["w"].equal(full)


def test_planning_one_destination_shard_at_a_time(seed):
    # a server planning per grant: each destination shard alone, balancing on the loads so far
    src = spmd(4, *tensors_on(4, Replicate()))
    dst = spmd(3, *tensors_on(3, Shard(1)))
    whole = plan(src, dst)
    loads: tuple[int, ...] = ()
    shards = []
    for j in range(3):
        one = plan(src, dst, only={j}, loads=loads)
        assert [s.shard for s in one.shards] == [j]
        shards.append(one.shards[0])
        loads = one.loads
    assembled = type(whole)(tuple(shards), loads, whole.max_gap)
    run_and_compare(assembled, src, dst, IDENTITY, random_full(src, torch.Generator().manual_seed(seed)))
    assert sum(loads) == whole.read_bytes
    assert max(loads) - min(loads) <= max(r.nbytes for s in shards for t in s.tasks for r in t.reads)
    with pytest.raises(Exception, match="loads must give 4"):
        plan(src, dst, loads=(1, 2))
    with pytest.raises(Exception, match="only must name"):
        plan(src, dst, only={3})


def test_the_same_plan_under_any_hash_seed(tmp_path):
    # sets and dicts of names must not order anything: two interpreters, two hash seeds, one plan
    import os
    import subprocess
    import sys

    script = (
        "import hashlib, msgpack\n"
        "from tensorhub.core import wire\n"
        "from tensorhub.core.placement import ReplicaLayout\n"
        "from tensorhub.scheduling.decoders import DecoderShape, hf_placements, vllm_placements\n"
        "from tensorhub.scheduling.mapping import preset\n"
        "from tensorhub.scheduling.reshard import plan\n"
        f"shape = DecoderShape.family('qwen2', **{SIZES!r})\n"
        "src = ReplicaLayout.spmd(hf_placements(shape, 4), 4)\n"
        "dst = ReplicaLayout.spmd(vllm_placements(shape, 2, fp8=True), 2)\n"
        "p = plan(src, dst, preset('qwen2', fp8=True), max_task_bytes=1 << 16)\n"
        "print(hashlib.sha256(msgpack.packb(wire.to_plain(p))).hexdigest())\n"
    )
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
        )
        assert out.returncode == 0, out.stderr[-2000:]
        digests.add(out.stdout.strip())
    assert len(digests) == 1
