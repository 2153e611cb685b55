"""Deltas on tensors (``tensorhub.runtime.deltas``): computed bit for bit, applied in place,
checked before and verified after.

- round trips over random dtypes, shapes and sparsities (hypothesis), with arbitrary bit patterns
  (NaN payloads, ``-0.0``, FP8, complex): the delta names exactly the elements whose bytes
  changed, picks the encoding of fewer bytes, and applying it makes the target's bytes;
- chains: applied in order, and squashed into one delta, they make the last version;
- a wrong base, a chain that does not link, a malformed delta (indices out of range, unsorted,
  wrong dtype or count) and tensors of another layout are refused before any byte changes,
  naming the tensor;
- a delta that does not make its target (tampered values, a missing entry) fails verification,
  naming the tensor; registered ``nn.Parameter`` tensors are written in place, never copied.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tensorhub.core.deltas import DENSE, SPARSE, encoding_for
from tensorhub.core.errors import BaseMismatch, ChecksumMismatch, InvalidArgument, LayoutMismatch
from tensorhub.runtime import deltas as rd
from tensorhub.runtime.deltas import Delta, TensorDelta, apply_chain, apply_delta, bits_of, compute_delta, squash
from tensorhub.transports.buffers import layout_of

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn, torch.int8, torch.uint8, torch.int64,
          torch.bool, torch.complex64, torch.complex128, torch.float64]  # fmt: skip


def random_bits(gen: torch.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (any NaN payload; bool stays 0/1)."""
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits_of(a), bits_of(b))


def clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tensors.items()}


def changed_truth(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    size = a.element_size()
    x = bits_of(a).reshape(-1).view(torch.uint8).numpy().reshape(-1, size)
    y = bits_of(b).reshape(-1).view(torch.uint8).numpy().reshape(-1, size)
    return np.nonzero((x != y).any(axis=1))[0]


@st.composite
def versions(draw, count: int = 2):
    """``count`` versions of a shard of 1 to 3 tensors, each version changing a random fraction
    of each tensor's elements to random bits."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    specs = []
    for i in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 12), min_size=0, max_size=3)))
        specs.append((f"layer.{i}.weight", dtype, shape))
    out = [{name: random_bits(gen, dtype, shape) for name, dtype, shape in specs}]
    for _ in range(count - 1):
        nxt = clone(out[-1])
        for name, dtype, shape in specs:
            p = draw(st.sampled_from([0.0, 0.01, 0.2, 0.34, 0.6, 1.0]))
            bits = bits_of(nxt[name])  # written as bits: FP8 has no masked fill
            mask = torch.rand(bits.shape[0], generator=gen) < p
            if mask.any():
                bits[mask] = bits_of(random_bits(gen, dtype, (int(mask.sum()),)))
        out.append(nxt)
    return out


@pytest.mark.property
@given(versions())
def test_round_trip_is_bit_exact_and_names_exactly_what_changed(vs):
    base, target = vs
    before = clone(base)
    delta = compute_delta(base, target, base_version=3, version=4)
    assert all(same_bits(before[k], base[k]) for k in base)  # computing reads only
    by_name = {e.name: e for e in delta.tensors}
    for name in base:
        truth = changed_truth(base[name], target[name])
        e = by_name.get(name)
        if not len(truth):
            assert e is None
            continue
        assert e is not None and e.changed == len(truth)
        assert e.encoding == encoding_for(len(truth), base[name].numel(), base[name].element_size())
        if e.encoding == SPARSE:
            assert e.indices is not None and e.indices.dtype == torch.int32
            assert e.indices.tolist() == truth.tolist()
    assert delta.changed_elements == sum(len(changed_truth(base[k], target[k])) for k in base)
    assert delta.nbytes == sum(e.nbytes for e in delta.tensors) and delta.full_bytes == sum(
        t.nbytes for t in delta.layout.tensors
    )
    work = clone(base)
    apply_delta(work, delta)
    assert all(same_bits(work[k], target[k]) for k in base)


@pytest.mark.property
@given(versions(count=4))
def test_chains_apply_in_order_and_squash_to_one(vs):
    chain = [compute_delta(a, b, base_version=i, version=i + 1) for i, (a, b) in enumerate(itertools.pairwise(vs))]
    work = clone(vs[0])
    apply_chain(work, chain)
    assert all(same_bits(work[k], vs[-1][k]) for k in work)
    one = squash(chain)
    assert (one.base, one.version, one.base_checksums, one.checksums) == (
        0,
        3,
        chain[0].base_checksums,
        chain[-1].checksums,
    )
    work = clone(vs[0])
    apply_delta(work, one)
    assert all(same_bits(work[k], vs[-1][k]) for k in work)
    # each step alone, from what the previous made
    work = clone(vs[0])
    for d in chain:
        apply_delta(work, d)
    assert all(same_bits(work[k], vs[-1][k]) for k in work)


def test_nan_payloads_and_signed_zeros_are_bytes():
    nan_a = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    nan_b = torch.tensor([0x7FC00002], dtype=torch.int32).view(torch.float32)
    base = {"w": torch.cat([torch.tensor([0.0, 1.0, float("nan")]), nan_a, nan_a])}
    target = {"w": torch.cat([torch.tensor([-0.0, 1.0, float("nan")]), nan_b, nan_a])}
    delta = compute_delta(base, target, base_version=0, version=1)
    (e,) = delta.tensors
    assert e.encoding == SPARSE and e.indices is not None and e.indices.tolist() == [0, 3]
    work = clone(base)
    apply_delta(work, delta)
    assert same_bits(work["w"], target["w"])
    assert bits_of(work["w"])[3].item() == 0x7FC00002  # the payload itself, not a canonical NaN


def test_large_tensors_are_scanned_in_slices_and_verified_per_chunk(monkeypatch, seed):
    monkeypatch.setattr(rd, "SCAN_ELEMENTS", 1000)
    gen = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(300, 100, generator=gen).to(torch.bfloat16), "b": torch.randn(10, generator=gen)}
    target = clone(base)
    target["w"].view(-1)[[5, 999, 1000, 25_000, 29_999]] += 1
    layout = layout_of(base, chunk_bytes=4096)  # 60 KB of w: 15 checksum units
    delta = compute_delta(base, target, base_version=0, version=1, layout=layout)
    (e,) = delta.tensors
    assert e.indices is not None and e.indices.tolist() == [5, 999, 1000, 25_000, 29_999]
    assert rd._touched_units(delta) == {0, 12, 14}  # bytes 10..2001, 50_000 and 59_998 of w, in 4096-byte units
    work = clone(base)
    apply_delta(work, delta)
    assert same_bits(work["w"], target["w"])


def test_dense_when_most_elements_change(seed):
    gen = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(64, generator=gen).to(torch.bfloat16)}
    target = {"w": base["w"] + 1}
    delta = compute_delta(base, target, base_version=0, version=1)
    (e,) = delta.tensors
    assert e.encoding == DENSE and e.indices is None and e.nbytes == 128
    work = clone(base)
    apply_delta(work, delta)
    assert same_bits(work["w"], target["w"])


def same_delta(a: Delta, b: Delta) -> bool:
    """Entry for entry: names, encodings, counts, values' bits and indices."""
    if [(e.name, e.encoding, e.changed) for e in a.tensors] != [(e.name, e.encoding, e.changed) for e in b.tensors]:
        return False
    for x, y in zip(a.tensors, b.tensors):
        if not same_bits(x.values.cpu(), y.values.cpu()):
            return False
        if (x.indices is None) != (y.indices is None) or (
            x.indices is not None and not torch.equal(x.indices.cpu(), y.indices.cpu())  # type: ignore[union-attr]
        ):
            return False
    return True


@pytest.mark.property
@given(versions(), st.sampled_from([16, 40, 1 << 20]), st.sampled_from([1, 7, 1 << 26]))
def test_the_streamed_compare_equals_compute_delta_and_refreshes_the_snapshot(vs, slot_bytes, window):
    """compare_and_refresh (the publisher's compare of GPU tensors, here its CPU run) gives
    compute_delta's delta entry for entry, values on the CPU, and leaves the snapshot holding the
    target, whatever the slices (slots of 16 and 40 bytes cut every tensor into many)."""
    base, target = vs
    want = compute_delta(base, target, base_version=3, version=4, with_checksums=False)
    snap, before = clone(base), clone(target)
    got = rd.compare_and_refresh(snap, target, base_version=3, version=4, slot_bytes=slot_bytes,
                                 window_elements=window)  # fmt: skip
    assert same_delta(got, want)
    assert all(e.values.device.type == "cpu" for e in got.tensors)
    assert all(same_bits(snap[k], target[k]) and same_bits(before[k], target[k]) for k in target)
    work = clone(base)
    apply_delta(work, got, check_base=False, verify=False)
    assert all(same_bits(work[k], target[k]) for k in target)


def test_the_streamed_compare_refuses_bad_input_naming_it(seed):
    v0, v1, _ = fixture_versions(seed)
    with pytest.raises(InvalidArgument, match="slot_bytes 2 is smaller than one element"):
        rd.compare_and_refresh(clone(v0), v1, base_version=0, version=1, slot_bytes=2)
    with pytest.raises(InvalidArgument, match="window_elements must be at least 1"):
        rd.compare_and_refresh(clone(v0), v1, base_version=0, version=1, window_elements=0)
    other = clone(v0)
    other["a"] = other["a"].float()
    with pytest.raises(LayoutMismatch, match="'a'"):
        rd.compare_and_refresh(other, v1, base_version=0, version=1)
    snap = clone(v0)
    with pytest.raises(LayoutMismatch, match="'c'"):
        rd.compare_and_refresh(snap, {k: v for k, v in v1.items() if k != "c"}, base_version=0, version=1,
                               layout=layout_of(v1))  # fmt: skip
    assert all(same_bits(snap[k], v0[k]) for k in v0)  # refused before anything was written


def fixture_versions(seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    v0 = {
        "a": torch.randn(40, 30, generator=gen).to(torch.bfloat16),
        "b": torch.randn(50, generator=gen),
        "c": torch.zeros(4),
    }
    v1 = clone(v0)
    v1["a"].view(-1)[::37] += 1
    v1["b"][7] = 3.0
    v2 = clone(v1)
    v2["a"].view(-1)[3::41] -= 1
    return [v0, v1, v2]


def test_a_wrong_base_is_refused_before_any_byte_changes(seed):
    v0, v1, v2 = fixture_versions(seed)
    delta = compute_delta(v1, v2, base_version=1, version=2)
    work = clone(v0)
    with pytest.raises(BaseMismatch, match="base version 1: tensor 'a' differs") as err:
        apply_delta(work, delta, ctx={"model": "actor", "shard": 0})
    assert err.value.tensors == ("a", "b") and err.value.model == "actor" and err.value.version == 1
    assert all(same_bits(work[k], v0[k]) for k in work)
    # the checksums the holder already verified stand in for hashing its tensors
    with pytest.raises(BaseMismatch):
        apply_delta(clone(v1), delta, held_checksums=rd.shard_checksums(v0, delta.layout))
    work = clone(v1)
    apply_delta(work, delta, held_checksums=delta.base_checksums)
    assert all(same_bits(work[k], v2[k]) for k in work)


def test_a_chain_that_does_not_link_is_refused(seed):
    v0, v1, v2 = fixture_versions(seed)
    d01 = compute_delta(v0, v1, base_version=0, version=1)
    d02 = compute_delta(v0, v2, base_version=0, version=2)
    d12 = compute_delta(v1, v2, base_version=1, version=2)
    work = clone(v0)
    with pytest.raises(BaseMismatch, match="does not follow"):
        apply_chain(work, [d01, d02])
    other = Delta(d12.layout, 1, 2, d12.tensors, d02.base_checksums, d12.checksums)  # says base 1, has v0's sums
    with pytest.raises(BaseMismatch, match="is not based on") as err:
        apply_chain(work, [d01, other])
    assert err.value.tensors == ("a", "b")
    with pytest.raises(BaseMismatch):
        squash([d01, other])
    assert all(same_bits(work[k], v0[k]) for k in work)


def test_malformed_deltas_are_refused_naming_the_tensor_and_nothing_is_written(seed):
    v0, v1, _ = fixture_versions(seed)
    good = compute_delta(v0, v1, base_version=0, version=1)
    a = next(e for e in good.tensors if e.name == "a")
    assert a.indices is not None
    bad_entries = {
        "out of range": TensorDelta("a", SPARSE, a.changed, a.values, a.indices + 1200),
        "not ascending": TensorDelta("a", SPARSE, a.changed, a.values, a.indices.flip(0)),
        "int64 indices": TensorDelta("a", SPARSE, a.changed, a.values, a.indices.long()),
        "wrong dtype": TensorDelta("a", SPARSE, a.changed, a.values.float(), a.indices),
        "wrong count": TensorDelta("a", SPARSE, a.changed, a.values[:-1], a.indices),
        "dense too short": TensorDelta("a", DENSE, 5, a.values),
    }
    for why, entry in bad_entries.items():
        delta = Delta(good.layout, 0, 1, (entry,), good.base_checksums, good.checksums)
        work = clone(v0)
        with pytest.raises(InvalidArgument, match="tensor 'a'"):
            apply_delta(work, delta)
        assert all(same_bits(work[k], v0[k]) for k in work), why
    with pytest.raises(LayoutMismatch, match="'zz'"):
        Delta(good.layout, 0, 1, (TensorDelta("zz", DENSE, 1, a.values),))
    with pytest.raises(InvalidArgument):
        TensorDelta("a", SPARSE, 1, a.values)  # sparse without indices


def test_tensors_of_another_layout_are_refused(seed):
    v0, v1, _ = fixture_versions(seed)
    delta = compute_delta(v0, v1, base_version=0, version=1)
    work = clone(v0)
    work["b"] = torch.zeros(51)
    with pytest.raises(LayoutMismatch, match="tensor 'b' is float32\\[51\\]"):
        apply_delta(work, delta)
    del work["b"]
    with pytest.raises(LayoutMismatch, match="'b' of the delta's layout is missing"):
        apply_delta(work, delta)
    with pytest.raises(LayoutMismatch, match="tensor 'b'"):
        compute_delta(v0, {**v1, "b": torch.zeros(5)}, base_version=0, version=1)


def test_a_delta_that_does_not_make_its_target_fails_verification(seed):
    v0, v1, _ = fixture_versions(seed)
    good = compute_delta(v0, v1, base_version=0, version=1)
    a = next(e for e in good.tensors if e.name == "a")
    tampered_values = a.values.clone()
    tampered_values[0] += 1
    tampered = Delta(good.layout, 0, 1, tuple(TensorDelta("a", a.encoding, a.changed, tampered_values, a.indices)
                                              if e.name == "a" else e for e in good.tensors),
                     good.base_checksums, good.checksums)  # fmt: skip
    with pytest.raises(ChecksumMismatch, match="tensor 'a'") as err:
        apply_delta(clone(v0), tampered)
    assert err.value.version == 1
    missing = Delta(
        good.layout, 0, 1, tuple(e for e in good.tensors if e.name != "b"), good.base_checksums, good.checksums
    )
    work = clone(v0)
    with pytest.raises(ChecksumMismatch, match="tensor 'b' changes .* but the deltas do not write it"):
        apply_delta(work, missing)
    assert all(same_bits(work[k], v0[k]) for k in work)  # refused before writing
    # without base checksums (a file written elsewhere), the whole result is verified
    trusting = Delta(good.layout, 0, 1, missing.tensors, None, good.checksums)
    with pytest.raises(ChecksumMismatch, match="tensor 'b'"):
        apply_delta(clone(v0), trusting)
    apply_delta(clone(v0), trusting, verify=False)  # on trust, when asked


def test_parameters_are_written_in_place(seed):
    v0, v1, _ = fixture_versions(seed)
    delta = compute_delta(v0, v1, base_version=0, version=1)
    params = {k: torch.nn.Parameter(v.clone(), requires_grad=v.is_floating_point()) for k, v in v0.items()}
    ptrs = {k: p.data_ptr() for k, p in params.items()}
    apply_delta(params, delta)
    assert all(same_bits(params[k].detach(), v1[k]) for k in params)
    assert {k: p.data_ptr() for k, p in params.items()} == ptrs
    assert delta.step().nbytes == delta.nbytes and (delta.step().base, delta.step().version) == (0, 1)
    assert rd.describe(delta)["changed_tensors"] == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_take_a_cpu_delta(seed):
    v0, v1, _ = fixture_versions(seed)
    delta = compute_delta(v0, v1, base_version=0, version=1)
    work = {k: v.cuda() for k, v in v0.items()}
    apply_delta(work, delta)
    assert all(same_bits(work[k].cpu(), v1[k]) for k in work)
    gpu0, gpu1 = {k: v.cuda() for k, v in v0.items()}, {k: v.cuda() for k, v in v1.items()}
    on_gpu = compute_delta(gpu0, gpu1, base_version=0, version=1, layout=delta.layout)  # the CPU's layout: xxh3-64
    assert on_gpu.checksums == delta.checksums and on_gpu.base_checksums == delta.base_checksums
    work = clone(v0)
    apply_delta(work, on_gpu)
    assert all(same_bits(work[k], v1[k]) for k in work)
    # By default GPU tensors take the GPU's checksum (wordmix-64), the same values on the CPU.
    native = compute_delta(gpu0, gpu1, base_version=0, version=1)
    assert native.layout.checksum == "wordmix-64"
    cpu_same = compute_delta(v0, v1, base_version=0, version=1, layout=native.layout)
    assert native.checksums == cpu_same.checksums and native.base_checksums == cpu_same.base_checksums
    work = clone(v0)
    apply_delta(work, native)  # a GPU delta applied to CPU tensors: verified with wordmix-64 on the CPU
    assert all(same_bits(work[k], v1[k]) for k in work)
    # The publisher's streamed compare against a pinned snapshot, in slots that cut the tensors.
    snap = {k: v.clone().pin_memory() for k, v in v0.items()}
    streamed = rd.compare_and_refresh(snap, gpu1, base_version=0, version=1, layout=native.layout, slot_bytes=64)
    assert same_delta(streamed, compute_delta(v0, v1, base_version=0, version=1, with_checksums=False))
    assert all(same_bits(snap[k], v1[k]) for k in snap)
    # many changes: a dense entry, its values taken from the refreshed snapshot
    gpu2 = {k: (v + 1 if v.is_floating_point() else v) for k, v in gpu1.items()}
    streamed = rd.compare_and_refresh(snap, gpu2, base_version=1, version=2, layout=native.layout)
    assert {e.encoding for e in streamed.tensors} == {DENSE}
    assert all(same_bits(snap[k], gpu2[k].cpu()) for k in snap)
