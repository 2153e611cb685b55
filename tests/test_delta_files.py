"""Anchors and deltas as files in Hugging Face TRL's format (``tensorhub.runtime.deltafiles``),
both ways, and ``tensorhub export`` / ``tensorhub import``:

- our delta files, read with plain ``safetensors`` and applied with plain torch (``index_copy_``),
  make the target bit for bit; their keys and metadata are TRL's (``<name>.indices`` int32,
  ``<name>.values``, ``sparse``, ``model_version``, ``sparsity``); anchors load as plain
  checkpoints;
- a delta file written independently in that format (TRL's writer's keys and metadata, no
  TensorHub keys, indices unsorted) imports and applies; one with values of another dtype, an
  unknown tensor or half an entry is refused naming the tensor;
- files round-trip through :func:`read` with their checksums, so a delta file applied to the
  wrong base is refused;
- the command line exports an anchor and deltas and imports them back into the last version.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file, save_file

from tensorhub.core.errors import BaseMismatch, InvalidArgument, LayoutMismatch
from tensorhub.runtime.deltafiles import Anchor, delta_bytes, from_bytes, read, read_checkpoint, write_anchor, write_delta
from tensorhub.runtime.deltas import Delta, apply_chain, apply_delta, bits_of, compute_delta
from tensorhub.tools.cli import main
from tensorhub.transports.buffers import layout_of


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits_of(a), bits_of(b))


def model_versions(seed: int, count: int = 3) -> list[dict[str, torch.Tensor]]:
    """Versions of a small bf16 model: each step nudges a few weights; the norm changes whole."""
    gen = torch.Generator().manual_seed(seed)
    v = {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 32, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.ones(32, dtype=torch.bfloat16),
        "lm_head.bias": torch.zeros(64, dtype=torch.float32),
    }
    out = [v]
    for step in range(1, count):
        nxt = {k: t.clone() for k, t in out[-1].items()}
        w = nxt["model.layers.0.mlp.up_proj.weight"].view(-1)
        idx = torch.randperm(w.numel(), generator=gen)[:40]
        w[idx] = w[idx] + 0.25
        nxt["model.norm.weight"] += 0.125 * step
        out.append(nxt)
    return out


def test_our_delta_files_are_trl_files_that_plain_torch_applies(tmp_path, seed):
    v0, v1, _ = model_versions(seed)
    delta = compute_delta(v0, v1, base_version=7, version=8)
    path = tmp_path / "step_000008.safetensors"
    size = write_delta(path, delta)
    assert size == path.stat().st_size and size < delta.full_bytes / 5
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        keys = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    assert meta["sparse"] == "True" and meta["model_version"] == "8" and meta["prev_model_version"] == "7"
    assert meta["format"] == "sparse_weight_patch"
    assert float(meta["sparsity"]) == pytest.approx(delta.sparsity) and 0.5 < float(meta["sparsity"]) < 1
    assert set(json.loads(meta["changed_params"])) == {"model.layers.0.mlp.up_proj.weight", "model.norm.weight"}
    assert keys == {f"{n}{s}" for n in json.loads(meta["changed_params"]) for s in (".indices", ".values")}
    # plain torch, as any reader of TRL's format does it
    work = {k: t.clone() for k, t in v0.items()}
    for name in json.loads(meta["changed_params"]):
        idx, values = tensors[f"{name}.indices"], tensors[f"{name}.values"]
        assert idx.dtype == torch.int32 and values.dtype == v0[name].dtype
        work[name].view(-1).index_copy_(0, idx.long(), values)
    assert all(same_bits(work[k], v1[k]) for k in v1)


def test_delta_bytes_are_the_file_and_read_back(tmp_path, seed):
    """What a delta model's shard holds (a delta's bytes) is its file, read without a file."""
    v0, v1, _ = model_versions(seed)
    delta = compute_delta(v0, v1, base_version=7, version=8)
    data = delta_bytes(delta)
    write_delta(tmp_path / "d.safetensors", delta)
    assert load(data).keys() == load_file(tmp_path / "d.safetensors").keys()  # plain safetensors reads them
    back = from_bytes(bytearray(data))
    assert isinstance(back, Delta) and (back.base, back.version) == (7, 8)
    assert back.checksums == delta.checksums and back.base_checksums == delta.base_checksums
    work = {k: t.clone() for k, t in v0.items()}
    apply_delta(work, back)
    assert all(same_bits(work[k], v1[k]) for k in v1)
    for bad, what in ((b"", "0 bytes"), (b"\xff" * 8 + b"{}", "header"), ((20).to_bytes(8, "little") + b"[not json" + b" " * 11, "not a safetensors")):
        with pytest.raises(InvalidArgument, match=what):
            from_bytes(bad, where="peer")


def test_anchor_files_are_plain_checkpoints(tmp_path, seed):
    (v0,) = model_versions(seed, 1)
    path = tmp_path / "anchor.safetensors"
    written = write_anchor(path, v0, version=5)
    plain = load_file(str(path))
    assert set(plain) == set(v0) and all(same_bits(plain[k], v0[k]) for k in v0)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert (meta["sparse"], meta["model_version"], meta["sparsity"]) == ("False", "5", "0.0")
    got = read(path)
    assert isinstance(got, Anchor) and got.version == 5 and got.checksums == written.checksums
    assert [t.name for t in got.layout.tensors] == list(v0)  # the layout's order, not the file's sorted keys
    work = {k: torch.zeros_like(t) for k, t in v0.items()}
    apply_delta(work, got.as_delta())
    assert all(same_bits(work[k], v0[k]) for k in v0)


def trl_delta(
    path, base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], version: int, shuffle: bool
) -> None:
    """A delta file as TRL's writer makes it (its keys and PatchMetadata fields), by plain
    safetensors and torch, knowing nothing of TensorHub."""
    tensors, changed_params, changed = {}, [], 0
    for name in sorted(target):
        mask = target[name] != base[name]
        if not mask.any():
            continue
        idx = mask.flatten().nonzero().squeeze(1).to(torch.int32)
        if shuffle:
            idx = idx.flip(0)
        changed_params.append(name)
        changed += idx.numel()
        tensors[f"{name}.indices"] = idx
        tensors[f"{name}.values"] = target[name].flatten()[idx.long()]
    total = sum(t.numel() for t in target.values())
    meta = {"format": "sparse_weight_patch", "version": "1", "sparse": "True", "model_version": str(version),
            "num_changed_params": str(len(changed_params)), "total_changed_elements": str(changed),
            "total_elements": str(total), "sparsity": str(1 - changed / total), "encoding": "raw",
            "changed_params": json.dumps(changed_params)}  # fmt: skip
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_delta_file_written_elsewhere_imports_and_applies(tmp_path, seed, shuffle):
    v0, v1, v2 = model_versions(seed)
    layout = layout_of(v0)
    trl_delta(tmp_path / "d1.safetensors", v0, v1, 1, shuffle)
    trl_delta(tmp_path / "d2.safetensors", v1, v2, 2, shuffle)
    with pytest.raises(InvalidArgument, match="does not carry its layout"):
        read(tmp_path / "d1.safetensors")
    d1, d2 = read(tmp_path / "d1.safetensors", layout=layout), read(tmp_path / "d2.safetensors", layout=layout)
    assert isinstance(d1, Delta) and isinstance(d2, Delta)
    assert (d1.base, d1.version, d1.checksums) == (None, 1, None)
    work = {k: t.clone() for k, t in v0.items()}
    apply_chain(work, [d1, d2])  # nothing to check against: applied on trust
    assert all(same_bits(work[k], v2[k]) for k in v2)
    # the same file, with the checksums of what it should make: verified
    expected = compute_delta(v0, v1, base_version=0, version=1)
    work = {k: t.clone() for k, t in v0.items()}
    apply_delta(work, Delta(layout, 0, 1, d1.tensors, expected.base_checksums, expected.checksums))
    assert all(same_bits(work[k], v1[k]) for k in v1)


def test_bad_delta_files_are_refused_naming_the_tensor(tmp_path, seed):
    (v0,) = model_versions(seed, 1)
    layout = layout_of(v0)
    name = "model.layers.0.mlp.up_proj.weight"
    idx = torch.tensor([3, 1], dtype=torch.int32)
    cases = {
        "float32 values": ({f"{name}.indices": idx, f"{name}.values": torch.zeros(2)}, InvalidArgument, name),
        "half an entry": ({f"{name}.indices": idx}, InvalidArgument, name),
        "twice": ({f"{name}.indices": torch.tensor([1, 1], dtype=torch.int32),
                   f"{name}.values": torch.zeros(2, dtype=torch.bfloat16)}, InvalidArgument, name),
        "out of range": ({f"{name}.indices": torch.tensor([0, 99999], dtype=torch.int32),
                          f"{name}.values": torch.zeros(2, dtype=torch.bfloat16)}, InvalidArgument, name),
        "unknown tensor": ({"other.weight.indices": idx, "other.weight.values": torch.zeros(2)}, LayoutMismatch,
                           "other.weight"),
    }  # fmt: skip
    for why, (tensors, error, named) in cases.items():
        path = tmp_path / f"{why}.safetensors"
        save_file(tensors, str(path), metadata={"sparse": "True", "model_version": "3"})
        with pytest.raises(error, match=named.replace(".", r"\.")):
            read(path, layout=layout)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(InvalidArgument, match="not a safetensors file"):
        read(tmp_path / "junk.safetensors")


def test_files_keep_their_checksums_so_a_wrong_base_is_refused(tmp_path, seed):
    v0, v1, v2 = model_versions(seed)
    write_delta(tmp_path / "d12.safetensors", compute_delta(v1, v2, base_version=1, version=2))
    d12 = read(tmp_path / "d12.safetensors")
    assert isinstance(d12, Delta) and d12.base == 1 and d12.base_checksums is not None
    work = {k: t.clone() for k, t in v0.items()}
    with pytest.raises(BaseMismatch) as err:
        apply_delta(work, d12)
    assert "model.layers.0.mlp.up_proj.weight" in err.value.tensors
    assert all(same_bits(work[k], v0[k]) for k in v0)
    with pytest.raises(LayoutMismatch):
        read(tmp_path / "d12.safetensors", layout=layout_of({"x": torch.zeros(3)}))


def test_the_command_line_exports_and_imports(tmp_path, seed, capsys):
    vs = model_versions(seed, 4)
    for i, v in enumerate(vs):
        save_file(v, str(tmp_path / f"v{i}.safetensors"))
    p = lambda name: str(tmp_path / name)
    assert main(["export", p("v0.safetensors"), "--version", "0", "-o", p("anchor0.safetensors")]) == 0
    assert (
        main(
            [
                "export",
                p("v1.safetensors"),
                "--version",
                "1",
                "--base",
                p("anchor0.safetensors"),
                "-o",
                p("d1.safetensors"),
            ]
        )
        == 0
    )
    for i in (2, 3):
        assert main(["export", p(f"v{i}.safetensors"), "--version", str(i), "--base", p(f"v{i - 1}.safetensors"),
                     "--base-version", str(i - 1), "-o", p(f"d{i}.safetensors")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "anchor of version 0" in out and "delta 2 -> 3" in out
    files = [p("anchor0.safetensors"), p("d1.safetensors"), p("d2.safetensors"), p("d3.safetensors")]
    assert main(["import", *files, "-o", p("out.safetensors")]) == 0
    assert "version 3: 4 file(s) applied, verified" in capsys.readouterr().out
    got = read_checkpoint(p("out.safetensors"))
    assert got.version == 3 and all(same_bits(got.tensors[k], vs[3][k]) for k in vs[3])
    assert (
        main(
            [
                "import",
                "--base",
                p("v1.safetensors"),
                p("d2.safetensors"),
                p("d3.safetensors"),
                "-o",
                p("o2.safetensors"),
            ]
        )
        == 0
    )
    # a delta from the wrong base, and a chain with a gap: refused, nothing written
    assert main(["import", "--base", p("v0.safetensors"), p("d2.safetensors"), "-o", p("bad.safetensors")]) == 2
    assert main(["import", p("anchor0.safetensors"), p("d2.safetensors"), "-o", p("bad.safetensors")]) == 2
    assert "BaseMismatch" in capsys.readouterr().err
    assert not (tmp_path / "bad.safetensors").exists()


def test_the_command_line_says_what_is_wrong_in_plain_words(tmp_path, seed, capsys):
    """Issue 36 (5): export to a directory that does not exist is a typed error (exit 2), not a
    traceback; a gap after an anchor names the anchor (not "None -> 1"); a corrupt anchor is
    called corrupt, not a failure "after applying the delta"."""
    vs = model_versions(seed, 3)
    for i, v in enumerate(vs):
        save_file(v, str(tmp_path / f"v{i}.safetensors"))
    p = lambda name: str(tmp_path / name)
    assert main(["export", p("v0.safetensors"), "--version", "0", "-o", str(tmp_path / "no" / "such" / "x")]) == 2
    err = capsys.readouterr().err
    assert "InvalidArgument" in err and "does not exist" in err and "Traceback" not in err
    assert main(["export", p("v1.safetensors"), "--version", "1", "-o", p("anchor1.safetensors")]) == 0
    assert main(["export", p("v2.safetensors"), "--version", "2", "--base", p("v1.safetensors"), "--base-version", "1",
                 "-o", p("d2.safetensors")]) == 0  # fmt: skip
    assert main(["export", p("v0.safetensors"), "--version", "0", "-o", p("anchor0.safetensors")]) == 0
    capsys.readouterr()
    assert main(["import", p("anchor0.safetensors"), p("d2.safetensors"), "-o", p("bad.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "the delta 1 -> 2 does not follow the anchor of version 0" in err and "None" not in err, err
    # an anchor whose bytes rotted after it was written (its checksums are in its metadata)
    from safetensors import safe_open

    with safe_open(p("anchor1.safetensors"), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] += 1
    save_file(tensors, p("rotten.safetensors"), metadata=meta)
    assert main(["import", p("rotten.safetensors"), "-o", p("out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "the anchor of version 1 is corrupt" in err and "after applying" not in err, err
