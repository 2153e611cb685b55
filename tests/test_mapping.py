"""Mappings between naming schemes (``tensorhub.scheduling.mapping``): the Hugging Face -> vLLM
presets, and every way a mapping is refused before a byte moves, with the tensors named."""

from __future__ import annotations

import pytest

from tensorhub.core import wire
from tensorhub.core.errors import InvalidArgument, LayoutMismatch, MappingMismatch
from tensorhub.core.placement import TensorPlacement
from tensorhub.scheduling.decoders import DecoderShape, hf_placements, hf_tensors, vllm_placements
from tensorhub.scheduling.mapping import (
    COPY,
    FAMILIES,
    FP8_SCALES,
    FP8_VALUES,
    IDENTITY,
    Cast,
    Fuse,
    Mapping,
    Part,
    Quantize,
    Rename,
    preset,
    resolve,
)

SIZES = dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=1, head_dim=128, vocab=512)


def by_name(placements) -> dict[str, TensorPlacement]:
    return {t.name: t for t in placements}


def metas(**tensors) -> dict[str, TensorPlacement]:
    """name=(dtype, shape) -> placements (dots written as __)."""
    return {k.replace("__", "."): TensorPlacement(k.replace("__", "."), d, s) for k, (d, s) in tensors.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fp8", [False, True])
def test_presets_map_hugging_face_names_to_vllms(family, fp8):
    shape = DecoderShape.family(family, **SIZES)
    src = by_name(hf_placements(shape, 4))
    dst = by_name(vllm_placements(shape, 2, fp8=fp8))
    got = resolve(preset(family, fp8=fp8), src, dst)
    assert list(got) == list(dst)
    qkv = got["model.layers.1.self_attn.qkv_proj.weight"]
    assert [p.source for p in qkv.parts] == [f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv"]
    assert [(p.start, p.size) for p in qkv.parts] == [(0, 512), (512, 128), (640, 128)]  # GQA: q 4 heads, k/v 1 head
    gate_up = got["model.layers.0.mlp.gate_up_proj.weight"]
    assert [p.source for p in gate_up.parts] == [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]
    assert got["model.layers.0.mlp.down_proj.weight"].parts == (Part("model.layers.0.mlp.down_proj.weight", 0, 256),)
    assert got["model.norm.weight"].kind == COPY
    if fp8:
        assert qkv.kind == FP8_VALUES and qkv.dtype == "float8_e4m3fn" and qkv.block == (128, 128)
        scale = got["model.layers.1.self_attn.qkv_proj.weight_scale_inv"]
        assert scale.kind == FP8_SCALES and scale.partner == qkv.target and qkv.partner == scale.target
        assert [(p.start, p.size) for p in scale.parts] == [(0, 4), (4, 1), (5, 1)]  # in 128-row blocks
        assert scale.shape == (6, 2) and scale.dtype == "float32"
        assert got["model.embed_tokens.weight"].kind == COPY  # embeddings and lm_head stay bf16
    if family == "qwen2":
        assert [p.source for p in got["model.layers.0.self_attn.qkv_proj.bias"].parts][
            1
        ] == "model.layers.0.self_attn.k_proj.bias"
    if family == "qwen3":
        assert got["model.layers.0.self_attn.q_norm.weight"].kind == COPY


def test_a_cast_preset_and_the_dtype_check():
    shape = DecoderShape.family("llama", **SIZES)
    src = by_name(hf_placements(shape, 4, dtype="float32"))
    dst = by_name(vllm_placements(shape, 2, dtype="bfloat16"))
    with pytest.raises(MappingMismatch, match="add a Cast") as info:
        resolve(preset("llama"), src, dst)
    assert "model.norm.weight" in info.value.tensors and isinstance(info.value, LayoutMismatch)
    got = resolve(preset("llama", dtype="bfloat16"), src, dst)
    assert {d.dtype for d in got.values()} == {"bfloat16"}


def test_renames_with_layer_captures():
    m = Mapping(renames=(Rename("decoder.layers.{i}.mlp.linear_fc2.weight", "model.layers.{i}.mlp.down_proj.weight"),
                         Rename("{rest:path}", "model.{rest}")))  # fmt: skip
    src = metas(decoder__layers__7__mlp__linear_fc2__weight=("bfloat16", (4, 8)), norm__weight=("bfloat16", (4,)))
    dst = metas(model__layers__7__mlp__down_proj__weight=("bfloat16", (4, 8)), model__norm__weight=("bfloat16", (4,)))
    got = resolve(m, src, dst)
    assert got["model.layers.7.mlp.down_proj.weight"].parts[0].source == "decoder.layers.7.mlp.linear_fc2.weight"
    assert got["model.norm.weight"].parts[0].source == "norm.weight"


def test_ignored_sources_feed_nothing():
    src = metas(a=("float32", (2,)), b__rotary_emb__inv_freq=("float32", (2,)))
    dst = metas(a=("float32", (2,)))
    with pytest.raises(MappingMismatch, match="not a tensor of the destination"):
        resolve(IDENTITY, src, dst)
    assert list(resolve(Mapping(ignore=("{p:path}.rotary_emb.inv_freq",)), src, dst)) == ["a"]


# --- refusals ----------------------------------------------------------------------------------

QKV = Fuse("l.{i}.qkv", ("l.{i}.q", "l.{i}.k", "l.{i}.v"))


def refused(mapping, src, dst) -> MappingMismatch:
    with pytest.raises(MappingMismatch) as info:
        resolve(mapping, src, dst)
    return info.value


def test_an_unfed_destination_tensor_is_named():
    err = refused(IDENTITY, metas(a=("float32", (2,))), metas(a=("float32", (2,)), layers__3__b=("float32", (2,))))
    assert err.tensors == ("layers.3.b",) and "'layers.3.b' is fed by no source" in str(err)


def test_a_tensor_fed_twice_is_named_with_both_sources():
    m = Mapping(renames=(Rename("old.{x}", "new.{x}"),))
    err = refused(m, metas(old__w=("float32", (2,)), new__w=("float32", (2,))), metas(new__w=("float32", (2,))))
    assert "'new.w' is fed twice" in str(err)
    assert set(err.tensors) == {"new.w", "old.w"}


def test_a_scale_fed_by_a_source_and_by_quantization_is_fed_twice():
    m = Mapping(quantize=(Quantize("{w}.weight", "{w}.weight_scale_inv"),))
    src = metas(p__weight=("bfloat16", (128, 128)), p__weight_scale_inv=("float32", (1, 1)))
    dst = metas(p__weight=("float8_e4m3fn", (128, 128)), p__weight_scale_inv=("float32", (1, 1)))
    assert "'p.weight_scale_inv' is fed twice" in str(refused(m, src, dst))


def test_a_fusion_missing_a_part_names_it():
    src = metas(l__0__q=("float32", (4, 2)), l__0__v=("float32", (2, 2)))
    err = refused(Mapping(fusions=(QKV,)), src, metas(l__0__qkv=("float32", (8, 2))))
    assert "lacks its parts ['l.0.k']" in str(err) and "l.0.k" in err.tensors and "l.0.qkv" in err.tensors


def test_an_optional_fusion_the_destination_lacks_leaves_its_parts_alone():
    """As vLLM's DeepSeek loader: ``fused_qkv_a_proj`` only when the model has it."""
    opt = Fuse("l.{i}.qkv", ("l.{i}.q", "l.{i}.k", "l.{i}.v"), optional=True)
    src = metas(l__0__q=("float32", (4, 2)), l__0__k=("float32", (2, 2)), l__0__v=("float32", (2, 2)))
    fused = resolve(Mapping(fusions=(opt,)), src, metas(l__0__qkv=("float32", (8, 2))))
    assert [p.source for p in fused["l.0.qkv"].parts] == ["l.0.q", "l.0.k", "l.0.v"]
    apart = resolve(Mapping(fusions=(opt,)), src, dict(src))
    assert {n: [p.source for p in d.parts] for n, d in apart.items()} == {n: [n] for n in src}
    # neither the fused tensor nor the parts: each part is named, not silently dropped
    err = refused(Mapping(fusions=(opt,)), src, metas(l__0__q=("float32", (4, 2))))
    assert "'l.0.k' (from 'l.0.k') is not a tensor of the destination" in str(err) and "l.0.v" in err.tensors
    # the fused tensor is there and a part is missing: refused as for any fusion
    err = refused(Mapping(fusions=(opt,)), metas(l__0__q=("float32", (4, 2))), metas(l__0__qkv=("float32", (8, 2))))
    assert "lacks its parts" in str(err)
    with pytest.raises(InvalidArgument, match="stacking fusion cannot be optional"):
        Fuse("w", ("e.{e}.a",), stack="e", optional=True)


def test_fusion_parts_that_do_not_concatenate():
    src = metas(l__0__q=("float32", (4, 2)), l__0__k=("float32", (2, 3)), l__0__v=("float32", (2, 2)))
    err = refused(Mapping(fusions=(QKV,)), src, metas(l__0__qkv=("float32", (8, 2))))
    assert "do not concatenate along dim 0" in str(err)
    src = metas(l__0__q=("float32", (4, 2)), l__0__k=("bfloat16", (2, 2)), l__0__v=("float32", (2, 2)))
    assert "different dtypes" in str(refused(Mapping(fusions=(QKV,)), src, metas(l__0__qkv=("float32", (8, 2)))))


def test_shape_and_dtype_mismatches_name_both_sides():
    src = metas(l__0__q=("float32", (4, 2)), l__0__k=("float32", (2, 2)), l__0__v=("float32", (2, 2)))
    err = refused(Mapping(fusions=(QKV,)), src, metas(l__0__qkv=("bfloat16", (9, 2))))
    text = str(err)
    assert "has shape [9, 2], the mapping derives [8, 2]" in text and "is bfloat16" in text and "2 problems" in text
    assert set(err.tensors) == {"l.0.qkv", "l.0.q", "l.0.k", "l.0.v"}
    ok = Mapping(fusions=(QKV,), casts=(Cast("l.{i}.qkv", "bfloat16"),))
    assert resolve(ok, src, metas(l__0__qkv=("bfloat16", (8, 2))))["l.0.qkv"].dtype == "bfloat16"


def test_quantization_needs_a_2d_float_weight_and_its_scale():
    q = Mapping(quantize=(Quantize("{w}", "{w}_scale"),))
    assert "2-D floating-point" in str(
        refused(q, metas(b=("bfloat16", (128,))), metas(b=("float8_e4m3fn", (128,)), b_scale=("float32", (1,))))
    )
    err = refused(q, metas(w=("bfloat16", (200, 300))), metas(w=("float8_e4m3fn", (200, 300))))
    assert "'w_scale' (the scale of 'w') is not a tensor of the destination" in str(err)
    got = resolve(
        q, metas(w=("bfloat16", (200, 300))), metas(w=("float8_e4m3fn", (200, 300)), w_scale=("float32", (2, 3)))
    )
    assert got["w_scale"].shape == (2, 3)


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: Rename("a.{x}", "b.{y}"), "does not capture"),
        (lambda: Rename("a.{x}.{x}", "b.{x}"), "twice"),
        (lambda: Rename("a.{x", "b"), "brace"),
        (lambda: Rename("a.{x:path}", "b.{x:path}"), "not {x:path}"),
        (lambda: Fuse("t.{i}", ("a.{i}", "b.{j}")), "same names"),
        (lambda: Fuse("t", ()), "at least one"),
        (lambda: Fuse("t", ("a", "b"), dim=-1), "dim"),
        (lambda: Quantize("{w}", "{w}_s", dtype="float8_e5m2"), "float8_e4m3fn"),
        (lambda: Quantize("{w}", "{w}_s", block=(128,)), "block"),
        (lambda: Cast("{w}", "float128"), "dtype"),
        (lambda: Mapping(ignore=("",)), "non-empty"),
    ],
)
def test_malformed_rules_are_refused_when_built(build, words):
    with pytest.raises(InvalidArgument, match=words.replace("{", r"\{").replace("}", r"\}")):
        build()


def test_mappings_travel_as_plain_data():
    m = preset("qwen3", fp8=True, dtype="bfloat16", renames=(Rename("_orig_mod.{r:path}", "{r}"),))
    assert wire.from_plain(Mapping, wire.to_plain(m)) == m
    names = [n for n, _ in hf_tensors(DecoderShape.family("qwen3", **SIZES))]
    assert len(names) == len(set(names))
