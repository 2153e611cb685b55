"""The bucket tier (``tensorhub.runtime.bucket``): anchors and deltas in a content-addressed
fsspec store, written in the background, restored in place and verified.

- round trips over several versions with random sparse changes (hypothesis): every version the
  bucket keeps restores bit for bit, from nothing and from an earlier base;
- chunks are content-addressed: an unchanged chunk of a later anchor is never written again
  (counted on the file system's own writes);
- an anchor every N versions and a delta for every version; retention keeps the last K anchors
  and the deltas after the oldest, and collects exactly the chunks nothing references any more;
- a corrupt chunk (sha256 mismatch) and a missing one are typed errors naming the object; a
  version the bucket does not have is :class:`VersionUnavailable`;
- restoring onto tensors that hold a base fetches only the deltas; a wrong base is refused
  before any byte changes (or falls back to the anchor);
- the deltas in the bucket are TRL delta files that plain ``safetensors`` reads and plain torch
  applies;
- the writer never makes ``put`` wait on the bucket (only on a full queue), owns its snapshot,
  and surfaces its failures, typed, on the next call.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from tensorhub.core.errors import (
    BaseMismatch,
    ChecksumMismatch,
    ContractViolation,
    LayoutMismatch,
    MalformedMessage,
    Timeout,
    TransportError,
    VersionUnavailable,
)
from tensorhub.runtime.bucket import ANCHOR, DELTA, Bucket, BucketReader, BucketWriter, Manifest
from tensorhub.runtime.deltas import bits_of, compute_delta, shard_checksums
from tensorhub.transports.buffers import layout_of


class RecordingFS(MemoryFileSystem):
    """An in-memory file system of its own that counts writes per final key, and can be told
    to fail or to hold its writes (a scriptable fake, not a mock)."""

    cachable = False
    protocol = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.store: dict = {}
        self.pseudo_dirs = [""]
        self.writes: dict[str, int] = {}
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()

    def pipe_file(self, path, value, *args, **kwargs):
        self.gate.wait(10)
        if self.fail:
            raise OSError(28, "No space left on device")
        return super().pipe_file(path, value, *args, **kwargs)

    def mv(self, path1, path2, *args, **kwargs):
        key = self._strip_protocol(path2)
        self.writes[key] = self.writes.get(key, 0) + 1
        return super().mv(path1, path2, *args, **kwargs)

    def chunk_writes(self) -> dict[str, int]:
        return {k: n for k, n in self.writes.items() if "/chunks/" in k}

    def files(self, under: str) -> set[str]:
        return {k for k in self.store if k.startswith(under) and "/.tmp-" not in k}


def new_bucket() -> tuple[Bucket, RecordingFS]:
    fs = RecordingFS()
    return Bucket(f"/b-{uuid.uuid4().hex[:8]}", fs=fs), fs


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits_of(a), bits_of(b))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)


def clone(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in t.items()}


def zeros_like(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in t.items()}


def shard(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A small shard: a large bf16 matrix, a float32 one and tiny (packed) tensors."""
    return {
        "embed.weight": torch.randn(64, 48, generator=gen).to(torch.bfloat16),
        "mlp.weight": torch.randn(40, 24, generator=gen),
        "norm.weight": torch.ones(24, dtype=torch.bfloat16),
        "head.bias": torch.zeros(16),
    }


LAYOUT_KW = {"chunk_bytes": 4096, "pack_threshold": 256}


def step(t: dict[str, torch.Tensor], gen: torch.Generator, fraction: float = 0.01) -> dict[str, torch.Tensor]:
    """The next version: a random ``fraction`` of each tensor's elements moves."""
    nxt = clone(t)
    for v in nxt.values():
        flat = v.view(-1)
        k = max(1, int(flat.numel() * fraction))
        idx = torch.randperm(flat.numel(), generator=gen)[:k]
        flat[idx] = flat[idx] + torch.randn(k, generator=gen).to(flat.dtype)
    return nxt


def write_versions(bucket: Bucket, versions: list[dict[str, torch.Tensor]], **writer_kw) -> BucketWriter:
    layout = layout_of(versions[0], **LAYOUT_KW)
    with BucketWriter(bucket, **writer_kw) as w:
        for v, t in enumerate(versions):
            w.put("actor", v, 0, t, layout=layout)
    return w


@st.composite
def histories(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    versions = [shard(gen)]
    for _ in range(draw(st.integers(1, 6))):
        versions.append(step(versions[-1], gen, draw(st.sampled_from([0.0005, 0.01, 0.05, 0.5]))))
    kw = {
        "anchor_every": draw(st.integers(1, 4)),
        "keep_anchors": draw(st.integers(0, 3)),
        "chunk_bytes": draw(st.sampled_from([64, 1000, 4096, 1 << 20])),
    }
    return versions, kw, draw(st.randoms(use_true_random=False))


@pytest.mark.property
@settings(max_examples=20)
@given(histories())
def test_every_kept_version_restores_bit_for_bit_from_nothing_and_from_a_base(history):
    versions, kw, rnd = history
    bucket, _ = new_bucket()
    write_versions(bucket, versions, **kw)
    reader = BucketReader(bucket)
    kept = reader.versions("actor", 0)
    assert kept and kept[-1] == len(versions) - 1
    for v in kept:
        into = zeros_like(versions[0])
        got = reader.restore("actor", v, 0, into)
        assert same(into, versions[v]), v
        assert got.version == v and got.anchor is not None and got.anchor <= v
        assert got.checksums == shard_checksums(versions[v], layout_of(versions[0], **LAYOUT_KW))
        base = rnd.choice(kept[: kept.index(v) + 1])
        into = clone(versions[base])
        got = reader.restore("actor", v, 0, into, held=base)
        assert same(into, versions[v]), (base, v)


def test_an_unchanged_chunk_is_written_once(seed):
    gen = torch.Generator().manual_seed(seed)
    t = {"w": torch.randn(64 * 1024, generator=gen)}  # 256 KiB: 16 chunks of 16 KiB
    bucket, fs = new_bucket()
    with BucketWriter(bucket, anchor_every=1, keep_anchors=0, chunk_bytes=16 << 10) as w:
        w.put("actor", 0, 0, t)
        w.flush()
        assert len(fs.chunk_writes()) == 16
        for v in range(1, 4):
            t["w"][v * 100] += 1.0  # inside chunk 0 only
            w.put("actor", v, 0, t)
    writes = fs.chunk_writes()
    assert max(writes.values()) == 1  # no chunk was ever written twice
    reader = BucketReader(bucket)
    delta_chunks = {c for v in (1, 2, 3) for c in bucket.manifest("actor", v, 0, DELTA).chunks}
    anchors = [bucket.manifest("actor", v, 0, ANCHOR) for v in range(4)]
    assert all(a.chunks[1:] == anchors[0].chunks[1:] for a in anchors)  # 15 shared chunks
    assert len({a.chunks[0] for a in anchors}) == 4
    assert len(writes) == 16 + 3 + len(delta_chunks)
    assert bucket.stats["chunks_reused"] >= 3 * 15
    into = zeros_like(t)
    reader.restore("actor", 3, 0, into)
    assert same(into, t)


def test_an_anchor_every_n_versions_and_a_delta_for_every_version(seed):
    gen = torch.Generator().manual_seed(seed)
    versions = [shard(gen)]
    for _ in range(9):
        versions.append(step(versions[-1], gen))
    bucket, _ = new_bucket()
    write_versions(bucket, versions, anchor_every=4, keep_anchors=0, chunk_bytes=1024)
    entries = bucket.entries("actor", 0)
    assert [v for v, k in entries.items() if ANCHOR in k] == [0, 4, 8]
    assert [v for v, k in entries.items() if DELTA in k] == list(range(1, 10))
    m = bucket.manifest("actor", 6, 0, DELTA)
    assert (m.kind, m.base, m.encoding) == (DELTA, 5, "trl-safetensors")
    got = BucketReader(bucket).restore("actor", 7, 0, zeros_like(versions[0]))
    assert (got.anchor, got.deltas) == (4, ((4, 5), (5, 6), (6, 7)))
    # the manifest is plain JSON (never pickle), and says what the object is
    doc = json.loads(bucket.fs.cat_file(bucket.manifest_key("actor", 4, 0, ANCHOR)))
    assert (
        doc["kind"] == ANCHOR
        and doc["base"] is None
        and doc["nbytes"] == sum(t.numel() * t.element_size() for t in versions[0].values())
    )
    assert len(doc["chunks"]) == -(-doc["nbytes"] // 1024) and len(doc["checksums"]) == len(m.checksums)


def test_retention_keeps_the_last_anchors_and_collects_the_chunks_nothing_references(seed):
    gen = torch.Generator().manual_seed(seed)
    versions = [shard(gen)]
    for _ in range(9):
        versions.append(step(versions[-1], gen, 0.2))
    bucket, fs = new_bucket()
    write_versions(bucket, versions, anchor_every=3, keep_anchors=2, chunk_bytes=1024)
    # anchors at 0, 3, 6, 9: 6 and 9 stay, with the deltas after 6
    entries = bucket.entries("actor", 0)
    assert {v: sorted(k) for v, k in entries.items()} == {6: [ANCHOR], 7: [DELTA], 8: [DELTA], 9: [ANCHOR, DELTA]}
    referenced = {bucket.chunk_key(c) for m in bucket.all_manifests() for c in m.chunks}
    assert fs.files(f"{bucket.root}/chunks/") == {fs._strip_protocol(k) for k in referenced}
    assert bucket.stats["chunks_deleted"] > 0
    reader = BucketReader(bucket)
    assert reader.versions("actor", 0) == [6, 7, 8, 9]
    with pytest.raises(VersionUnavailable):
        reader.restore("actor", 5, 0, zeros_like(versions[0]))
    into = zeros_like(versions[0])
    reader.restore("actor", 8, 0, into)
    assert same(into, versions[8])


def test_a_corrupt_or_missing_chunk_is_a_typed_error_naming_it(seed):
    gen = torch.Generator().manual_seed(seed)
    versions = [shard(gen), None]
    versions[1] = step(versions[0], gen)
    bucket, fs = new_bucket()
    write_versions(bucket, versions, anchor_every=8, chunk_bytes=1024)
    reader = BucketReader(bucket)
    anchor = bucket.manifest("actor", 0, 0, ANCHOR)
    key = bucket.chunk_key(anchor.chunks[2])
    good = fs.cat_file(key)
    fs.pipe_file(key, bytes([good[0] ^ 1]) + good[1:])  # one flipped bit
    with pytest.raises(ChecksumMismatch, match=anchor.chunks[2]) as err:
        reader.restore("actor", 1, 0, zeros_like(versions[0]))
    assert (err.value.model, err.value.version, err.value.shard) == ("actor", 0, 0)
    fs.rm_file(key)
    with pytest.raises(VersionUnavailable, match=anchor.chunks[2]):
        reader.restore("actor", 0, 0, zeros_like(versions[0]))
    # a corrupt delta chunk is found before a byte of the tensors changes
    fs.pipe_file(key, good)
    delta = bucket.manifest("actor", 1, 0, DELTA)
    dkey = bucket.chunk_key(delta.chunks[0])
    fs.pipe_file(dkey, b"\0" + fs.cat_file(dkey)[1:])
    into = clone(versions[0])
    with pytest.raises(ChecksumMismatch, match=delta.chunks[0]):
        reader.restore("actor", 1, 0, into, held=0)
    assert same(into, versions[0])
    # a manifest that is not one
    mkey = bucket.manifest_key("actor", 0, 0, ANCHOR)
    fs.pipe_file(mkey, b"\x80\x04not json")
    with pytest.raises(MalformedMessage, match="is not a manifest"):
        BucketReader(Bucket(bucket.root, fs=fs)).restore("actor", 0, 0, zeros_like(versions[0]))


def test_a_version_the_bucket_does_not_have_is_version_unavailable(seed):
    gen = torch.Generator().manual_seed(seed)
    versions = [shard(gen)]
    bucket, _ = new_bucket()
    write_versions(bucket, versions)
    reader = BucketReader(bucket)
    with pytest.raises(VersionUnavailable, match="holds versions 0..0") as err:
        reader.restore("actor", 3, 0, zeros_like(versions[0]))
    assert (err.value.model, err.value.version, err.value.shard) == ("actor", 3, 0)
    with pytest.raises(VersionUnavailable, match="holds no version"):
        reader.restore("critic", 0, 0, zeros_like(versions[0]))
    with pytest.raises(VersionUnavailable):
        reader.restore("actor", 0, 1, zeros_like(versions[0]))
    assert reader.list("actor") == {0: (0,)} and reader.list("critic") == {}


def test_restoring_onto_a_base_fetches_only_the_deltas_and_refuses_a_wrong_base(seed):
    gen = torch.Generator().manual_seed(seed)
    versions = [shard(gen)]
    for _ in range(5):
        versions.append(step(versions[-1], gen, 0.002))
    bucket, _ = new_bucket()
    write_versions(bucket, versions, anchor_every=4, keep_anchors=0, chunk_bytes=1024)
    reader = BucketReader(bucket)
    layout = layout_of(versions[0], **LAYOUT_KW)
    into = clone(versions[2])
    got = reader.restore("actor", 5, 0, into, held=2, held_checksums=shard_checksums(versions[2], layout))
    assert same(into, versions[5])
    # across the anchor at 4: the delta 3 -> 4 is there too
    assert (got.anchor, got.deltas) == (None, ((2, 3), (3, 4), (4, 5)))
    assert got.nbytes < bucket.manifest("actor", 4, 0, ANCHOR).nbytes
    # already there: nothing fetched
    got = reader.restore("actor", 5, 0, into, held=5, held_checksums=got.checksums)
    assert (got.anchor, got.deltas, got.nbytes) == (None, (), 0)
    # tensors that do not hold the base they claim: refused with nothing written, or the anchor route
    wrong = clone(versions[1])
    with pytest.raises(BaseMismatch):
        reader.restore("actor", 5, 0, wrong, held=2, fallback=False)
    assert same(wrong, versions[1])
    got = reader.restore("actor", 5, 0, wrong, held=2)
    assert same(wrong, versions[5]) and got.anchor == 4
    # a delta of the chain from the base is gone: the anchor route instead (or the typed error)
    gone = bucket.manifest("actor", 3, 0, DELTA).chunks[0]
    bucket.fs.rm_file(bucket.chunk_key(gone))
    into = clone(versions[2])
    with pytest.raises(VersionUnavailable, match=gone):
        reader.restore("actor", 5, 0, into, held=2, fallback=False)
    assert same(into, versions[2])
    got = reader.restore("actor", 5, 0, into, held=2)
    assert same(into, versions[5]) and (got.anchor, got.deltas) == (4, ((4, 5),))
    # tensors of another layout are refused, naming the tensor
    other = clone(versions[0])
    other["mlp.weight"] = torch.zeros(24, 40)
    with pytest.raises(LayoutMismatch, match="mlp.weight"):
        reader.restore("actor", 5, 0, other)


def test_the_deltas_in_the_bucket_are_trl_files_that_plain_safetensors_reads(tmp_path, seed):
    gen = torch.Generator().manual_seed(seed)
    versions = [shard(gen)]
    versions.append(step(versions[0], gen, 0.01))
    bucket = Bucket(str(tmp_path / "bucket"))  # a local directory
    write_versions(bucket, versions, chunk_bytes=512)
    m = bucket.manifest("actor", 1, 0, DELTA)
    assert len(m.chunks) > 1
    path = tmp_path / "delta.safetensors"
    path.write_bytes(b"".join((tmp_path / "bucket" / "chunks" / c[:2] / c).read_bytes() for c in m.chunks))
    rebuilt = clone(versions[0])
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert (meta["sparse"], meta["model_version"], meta["prev_model_version"]) == ("True", "1", "0")
        assert 0.0 < float(meta["sparsity"]) < 1.0
        for name, t in rebuilt.items():
            if f"{name}.indices" not in set(f.keys()):
                continue
            idx = f.get_tensor(f"{name}.indices")
            assert idx.dtype == torch.int32
            t.view(-1).index_copy_(0, idx.long(), f.get_tensor(f"{name}.values"))
    assert same(rebuilt, versions[1])


def test_a_local_directory_and_a_file_url_hold_the_same_bucket(tmp_path, seed):
    gen = torch.Generator().manual_seed(seed)
    versions = [shard(gen)]
    versions.append(step(versions[0], gen))
    write_versions(Bucket(str(tmp_path)), versions, chunk_bytes=2048)
    reader = BucketReader(f"file://{tmp_path}")
    into = zeros_like(versions[0])
    reader.restore("actor", 1, 0, into)
    assert same(into, versions[1])
    assert not list(tmp_path.rglob(".tmp-*"))  # every temporary name was moved into place
    # an orphan (a chunk of a write that failed before its manifest) goes with a sweep
    orphan = tmp_path / "chunks" / "00" / ("00" * 32)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"x")
    bucket = Bucket(str(tmp_path))
    assert bucket.sweep(older_than_s=3600) == 0 and orphan.exists()
    assert bucket.sweep(older_than_s=0) == 1 and not orphan.exists()
    reader.restore("actor", 1, 0, into)


def test_writer_failures_surface_typed_on_the_next_call_and_the_chain_restarts(seed):
    gen = torch.Generator().manual_seed(seed)
    versions = [shard(gen)]
    for _ in range(3):
        versions.append(step(versions[-1], gen))
    bucket, fs = new_bucket()
    w = BucketWriter(bucket, anchor_every=8, chunk_bytes=1024)
    w.put("actor", 0, 0, versions[0])
    w.flush()
    fs.fail = True
    w.put("actor", 1, 0, versions[1])  # returns: the failure is the writer thread's
    with pytest.raises(TransportError, match="No space left") as err:
        w.flush()
    assert isinstance(err.value.__cause__, OSError)
    assert (err.value.model, err.value.version, err.value.shard) == ("actor", 1, 0)
    w.flush()  # raised once
    w.put("actor", 2, 0, versions[2])
    deadline = time.monotonic() + 10
    while w.pending and time.monotonic() < deadline:
        time.sleep(0.005)
    fs.fail = False
    with pytest.raises(TransportError):
        w.put("actor", 3, 0, versions[3])  # the failure of version 2, on the next call
    w.put("actor", 3, 0, versions[3])
    w.close()
    # version 3 starts a new chain with an anchor; 1 and 2 are not in the bucket
    assert {v: sorted(k) for v, k in bucket.entries("actor", 0).items()} == {0: [ANCHOR], 3: [ANCHOR]}
    into = zeros_like(versions[0])
    BucketReader(bucket).restore("actor", 3, 0, into)
    assert same(into, versions[3])
    with pytest.raises(ContractViolation):
        w.put("actor", 4, 0, versions[3])


def test_put_waits_only_for_room_in_the_queue_and_owns_its_snapshot(seed):
    gen = torch.Generator().manual_seed(seed)
    versions = [shard(gen)]
    versions.append(step(versions[0], gen))
    bucket, fs = new_bucket()
    fs.gate.clear()  # the bucket hangs
    w = BucketWriter(bucket, max_pending=1, chunk_bytes=1024)
    live = clone(versions[0])
    w.put("actor", 0, 0, live, timeout=5)  # taken by the writer thread, which hangs
    for k in live:  # the publisher moves on and writes its buffers: the snapshot is the writer's
        live[k].copy_(versions[1][k])
    w.put("actor", 1, 0, live, timeout=5)  # queued
    with pytest.raises(Timeout):
        w.put("actor", 2, 0, live, timeout=0.2)
    with pytest.raises(Timeout):
        w.flush(timeout=0.2)
    with pytest.raises(ContractViolation, match="after version 1"):
        w.put("actor", 1, 0, live)
    fs.gate.set()
    w.close()
    assert list(bucket.entries("actor", 0)) == [0, 1]
    into = zeros_like(versions[0])
    BucketReader(bucket).restore("actor", 0, 0, into)
    assert same(into, versions[0])


def test_the_callers_delta_is_stored_when_it_fits(seed):
    gen = torch.Generator().manual_seed(seed)
    v0 = shard(gen)
    v1 = step(v0, gen, 0.001)
    layout = layout_of(v0, **LAYOUT_KW)
    given_delta = compute_delta(v0, v1, base_version=0, version=1, layout=layout)
    stale = compute_delta(v1, v1, base_version=5, version=1, layout=layout)
    bucket, _ = new_bucket()
    with BucketWriter(bucket, chunk_bytes=1 << 20) as w:
        w.put("actor", 0, 0, v0, layout=layout)
        w.put("actor", 1, 0, v1, layout=layout, delta=given_delta)
    reader = BucketReader(bucket)
    (stored,) = reader._fetch_deltas([bucket.manifest("actor", 1, 0, DELTA)], {})
    assert [e.name for e in stored.tensors] == [e.name for e in given_delta.tensors]
    # a delta from another base is not used: the writer computes its own
    bucket2, _ = new_bucket()
    with BucketWriter(bucket2) as w:
        w.put("actor", 0, 0, v0, layout=layout)
        w.put("actor", 1, 0, v1, layout=layout, delta=stale)
    into = clone(v0)
    BucketReader(bucket2).restore("actor", 1, 0, into, held=0)
    assert same(into, v1)


def test_a_manifest_that_does_not_add_up_is_refused():
    layout = layout_of({"w": torch.zeros(8)})
    ok = {"model": "actor", "version": 1, "shard": 0, "kind": ANCHOR, "base": None, "layout": layout,
          "checksums": (1,), "base_checksums": None, "chunks": ("0" * 64,), "nbytes": 32, "chunk_bytes": 64,
          "encoding": "shard-bytes"}  # fmt: skip
    m = Manifest(**ok)
    assert Manifest.from_json(m.to_json(), "k") == m
    bads = [{"kind": "full"}, {"base": 0}, {"chunks": ()}, {"checksums": (1, 2)}, {"nbytes": 33},
            {"kind": DELTA, "base": 1, "encoding": "trl-safetensors"}]  # fmt: skip
    for bad in bads:
        with pytest.raises(MalformedMessage):
            Manifest(**{**ok, **bad})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_written_and_restored_in_place(seed):
    gen = torch.Generator().manual_seed(seed)
    versions = [shard(gen)]
    for _ in range(3):
        versions.append(step(versions[-1], gen))
    layout = layout_of(versions[0], **LAYOUT_KW)
    bucket, _ = new_bucket()
    with BucketWriter(bucket, anchor_every=2, chunk_bytes=1024) as w:
        for v, t in enumerate(versions):
            w.put("actor", v, 0, {k: x.cuda() for k, x in t.items()}, layout=layout)
    reader = BucketReader(bucket)
    into = {k: torch.zeros_like(x, device="cuda") for k, x in versions[0].items()}
    ptrs = {k: x.data_ptr() for k, x in into.items()}
    reader.restore("actor", 1, 0, into)  # the anchor's tiny tensors land through a pack buffer
    assert same({k: x.cpu() for k, x in into.items()}, versions[1])
    got = reader.restore("actor", 3, 0, into, held=1)
    assert got.anchor is None and same({k: x.cpu() for k, x in into.items()}, versions[3])
    assert {k: x.data_ptr() for k, x in into.items()} == ptrs
