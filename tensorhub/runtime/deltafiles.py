"""Anchors and deltas as files, in Hugging Face TRL's delta weight sync format (safetensors).

Theory of operation
-------------------
TRL's delta weight sync writes two kinds of safetensors files, and so does this module:

- an **anchor** is a plain checkpoint: every tensor whole under its own name. Metadata
  ``sparse=False``, ``model_version=V``, ``sparsity=0.0``.
- a **delta** holds, for each tensor that changed, ``<name>.indices`` (int32, the flat element
  indices that changed, ascending) and ``<name>.values`` (the new values there, the tensor's
  dtype). Metadata ``sparse=True``, ``model_version=V``, ``sparsity`` (the fraction of elements
  left unchanged), ``prev_model_version=B`` and ``changed_params`` (a JSON list of names).

Both also carry TRL's ``format=sparse_weight_patch``, ``version=1``, ``num_changed_params``,
``total_changed_elements`` and ``total_elements``, and TensorHub's own keys, which other readers
ignore: ``tensorhub.layout`` (the tensors' names, dtypes and shapes in layout order, and the
checksum parameters) and ``tensorhub.checksums`` / ``tensorhub.base_checksums`` (one 64-bit
``xxh3-64`` value per checksum unit, as 16 hex digits), so that an import refuses a wrong base and
verifies what it made exactly as a pull does (:mod:`tensorhub.runtime.deltas`). Every value is a
string, as safetensors requires.

A tensor that a :class:`~tensorhub.runtime.deltas.Delta` carries dense is written as indices
``0 .. numel-1`` and all its values, so that every reader of TRL's format applies it (it costs
the indices' bytes; deltas at RL learning rates have few dense tensors). Only a tensor too large
for int32 indices is written whole under its own name; :func:`read` takes both forms, and files
written elsewhere whose indices are unsorted (sorted here) or int64 (narrowed here). Values must
have the tensor's dtype: applying is a copy of bits, never a cast.

Files are written to a temporary name beside the target and renamed into place, so a reader never
sees half a file. Reading is safetensors' (no pickle anywhere). ``safetensors`` is an optional
dependency (``pip install tensorhub[files]``), imported when a file is read or written.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tensorhub.core.deltas import DENSE, MAX_SPARSE_NUMEL, SPARSE
from tensorhub.core.errors import InvalidArgument, LayoutMismatch
from tensorhub.core.layout import DTYPE_SIZES, Layout, TensorSpec
from tensorhub.transports.buffers import layout_of

from .deltas import Delta, TensorDelta, shard_checksums

__all__ = [
    "FORMAT",
    "Anchor",
    "delta_bytes",
    "from_bytes",
    "read",
    "read_checkpoint",
    "write_anchor",
    "write_delta",
]

#: Layout dtypes that safetensors cannot store (a file of such a tensor is refused, naming it).
NOT_IN_SAFETENSORS = ("complex128",)
FORMAT = "sparse_weight_patch"
FORMAT_VERSION = "1"
INDICES = ".indices"
VALUES = ".values"


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as err:  # pragma: no cover - the dev extra installs it
        raise InvalidArgument("anchor and delta files need safetensors: pip install 'tensorhub[files]'") from err
    return safetensors


@dataclass(frozen=True, eq=False)
class Anchor:
    """A whole version of a shard, read from (or written as) an anchor file.

    Attributes:
        layout: the tensors' layout (from the file's ``tensorhub.layout``, else the file's
            tensors in key order).
        version: the version it is (``model_version``; None for a plain checkpoint).
        tensors: the tensors, in layout order (CPU).
        checksums: one per checksum unit of ``layout`` (None when the file does not say).
    """

    layout: Layout
    version: int | None
    tensors: dict[str, torch.Tensor]
    checksums: tuple[int, ...] | None = None

    def as_delta(self) -> Delta:
        """A delta from nothing that writes every tensor whole: apply it (first in a chain) to
        load the anchor into registered tensors in place and verify it."""
        if self.version is None:
            raise InvalidArgument("an anchor of unknown version cannot start a chain")
        entries = tuple(
            TensorDelta(t.name, DENSE, math.prod(t.shape), self.tensors[t.name].reshape(-1))
            for t in self.layout.tensors
        )
        return Delta(self.layout, None, self.version, entries, None, self.checksums)


# --- metadata ---------------------------------------------------------------------------------


def _layout_json(layout: Layout) -> str:
    return json.dumps({
        "tensors": [[t.name, t.dtype, list(t.shape)] for t in layout.tensors],
        "checksum": layout.checksum,
        "chunk_bytes": layout.chunk_bytes,
        "pack_threshold": layout.pack_threshold,
    }, separators=(",", ":"))  # fmt: skip


def _layout_from_json(text: str, path: str) -> Layout:
    try:
        doc = json.loads(text)
        specs = []
        for name, dtype, shape in doc["tensors"]:
            shape = tuple(int(d) for d in shape)
            specs.append(TensorSpec(name, dtype, shape, math.prod(shape) * DTYPE_SIZES[dtype]))
        return Layout(tuple(specs), doc["checksum"], int(doc["chunk_bytes"]), int(doc["pack_threshold"]))
    except (ValueError, KeyError, TypeError) as err:
        raise InvalidArgument(f"{path}: bad tensorhub.layout metadata ({err})") from err


def _sums_json(sums: Sequence[int]) -> str:
    return json.dumps([f"{s:016x}" for s in sums], separators=(",", ":"))


def _sums_from_json(text: str | None, path: str, key: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(s, 16) for s in json.loads(text))
    except (ValueError, TypeError) as err:
        raise InvalidArgument(f"{path}: bad {key} metadata ({err})") from err


def _int(meta: Mapping[str, str], key: str, path: str) -> int | None:
    text = meta.get(key)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError as err:
        raise InvalidArgument(f"{path}: metadata {key}={text!r} is not an integer") from err


def _common(sparse: bool, version: int, changed_params: int, changed: int, total: int) -> dict[str, str]:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "sparse": str(sparse),
        "model_version": str(version),
        "num_changed_params": str(changed_params),
        "total_changed_elements": str(changed),
        "total_elements": str(total),
        "sparsity": str(1.0 - changed / total if (sparse and total) else 0.0),
    }


def _save(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    st = _safetensors()
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():  # a typo'd -o: say so, not a traceback from the library
        raise InvalidArgument(f"cannot write {str(path)!r}: the directory {str(parent)!r} does not exist")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        st.torch.save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except (OSError, st.SafetensorError) as err:
        raise InvalidArgument(f"cannot write {str(path)!r}: {type(err).__name__}: {err}") from err
    finally:
        if tmp.exists():
            tmp.unlink()


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _writable(layout: Layout, version: int) -> None:
    for t in layout.tensors:
        if t.dtype in NOT_IN_SAFETENSORS:
            raise InvalidArgument(
                f"tensor {t.name!r} is {t.dtype}, which safetensors files cannot hold", version=version
            )


# --- write ------------------------------------------------------------------------------------


def write_anchor(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    *,
    version: int,
    layout: Layout | None = None,
    checksums: Sequence[int] | None = None,
    with_checksums: bool = True,
) -> Anchor:
    """Write ``tensors`` as an anchor file of ``version`` (a plain checkpoint with TRL's and
    TensorHub's metadata).

    Args:
        layout: the tensors' layout (default: their own, in the mapping's order).
        checksums: their checksums when known; else computed when ``with_checksums``.

    Returns:
        What was written, as :func:`read` would give it back (tensors on the CPU).
    """
    layout = layout or layout_of(dict(tensors))
    _writable(layout, version)
    cpu = {t.name: _cpu(tensors[t.name]) for t in layout.tensors}
    if checksums is None and with_checksums:
        checksums = shard_checksums(cpu, layout)
    total = sum(t.numel() for t in cpu.values())
    meta = _common(False, version, len(cpu), total, total)
    meta["tensorhub.layout"] = _layout_json(layout)
    if checksums is not None:
        meta["tensorhub.checksums"] = _sums_json(checksums)
    _save(path, cpu, meta)
    return Anchor(layout, version, cpu, tuple(checksums) if checksums is not None else None)


def write_delta(path: str | os.PathLike, delta: Delta) -> int:
    """Write ``delta`` as a delta file in TRL's format.

    Returns:
        The file's size in bytes.

    Raises:
        InvalidArgument: two tensors' file names collide (``x`` and ``x.indices``).
    """
    out, meta = _delta_payload(delta)
    _save(path, out, meta)
    return os.path.getsize(path)


def delta_bytes(delta: Delta) -> bytes:
    """``delta`` as the bytes of its delta file (what a delta model's shard holds and serves:
    :mod:`tensorhub.core.table.deltas`). :func:`from_bytes` reads them back.

    Raises:
        InvalidArgument: as :func:`write_delta`.
    """
    out, meta = _delta_payload(delta)
    return bytes(_safetensors().torch.save(out, metadata=meta))


def _delta_payload(delta: Delta) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    _writable(delta.layout, delta.version)
    out: dict[str, torch.Tensor] = {}
    names = []
    for e in delta.tensors:
        names.append(e.name)
        values = _cpu(e.values)
        if e.encoding == SPARSE:
            assert e.indices is not None
            keys = {e.name + INDICES: _cpu(e.indices), e.name + VALUES: values}
        elif values.numel() <= MAX_SPARSE_NUMEL:  # dense, as every index: any TRL reader applies it
            keys = {e.name + INDICES: torch.arange(values.numel(), dtype=torch.int32), e.name + VALUES: values}
        else:
            keys = {e.name: values}
        for k, v in keys.items():
            if k in out:
                raise InvalidArgument(f"tensor names collide in the delta file: {k!r}", version=delta.version)
            out[k] = v
    meta = _common(True, delta.version, len(delta.tensors), delta.changed_elements, delta.total_elements)
    meta["prev_model_version"] = str(delta.base if delta.base is not None else -1)
    meta["changed_params"] = json.dumps(names)
    meta["tensorhub.layout"] = _layout_json(delta.layout)
    if delta.checksums is not None:
        meta["tensorhub.checksums"] = _sums_json(delta.checksums)
    if delta.base_checksums is not None:
        meta["tensorhub.base_checksums"] = _sums_json(delta.base_checksums)
    return out, meta


# --- read -------------------------------------------------------------------------------------


def _check_same_specs(file_layout: Layout, layout: Layout, path: str) -> None:
    have = {t.name: t for t in file_layout.tensors}
    for t in layout.tensors:
        got = have.get(t.name)
        if got is None or (got.dtype, got.shape) != (t.dtype, t.shape):
            what = "lacks it" if got is None else f"says {got.dtype}{list(got.shape)}"
            raise LayoutMismatch(f"{path}: tensor {t.name!r} is {t.dtype}{list(t.shape)} here; the file {what}")
    extra = [n for n in have if n not in {t.name for t in layout.tensors}]
    if extra:
        raise LayoutMismatch(f"{path}: the file has tensor {extra[0]!r}, which the tensors do not")


def _sparse_entry(spec: TensorSpec, idx: torch.Tensor, values: torch.Tensor, path: str, version: int) -> TensorDelta:
    ctx: dict[str, Any] = {"version": version}
    numel = math.prod(spec.shape)
    want = getattr(torch, spec.dtype)
    if values.dtype != want:
        raise InvalidArgument(f"{path}: tensor {spec.name!r} has {values.dtype} values for a {spec.dtype} tensor "
                              f"(a delta is applied bit for bit, never cast)", **ctx)  # fmt: skip
    idx, values = idx.reshape(-1), values.reshape(-1)
    if idx.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8) or idx.numel() != values.numel():
        raise InvalidArgument(
            f"{path}: tensor {spec.name!r} has {idx.numel()} {idx.dtype} indices for {values.numel()} values", **ctx
        )
    if idx.numel():
        if int(idx.min()) < 0 or int(idx.max()) >= numel:
            raise InvalidArgument(f"{path}: tensor {spec.name!r} has indices outside [0, {numel})", **ctx)
        idx = idx.to(torch.int64)
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            order = torch.sort(idx, stable=True).indices
            idx, values = idx[order], values[order]
            if bool((idx[1:] == idx[:-1]).any()):
                raise InvalidArgument(f"{path}: tensor {spec.name!r} names an element twice", **ctx)
    if idx.numel() == numel and numel:  # every element (strictly ascending, in range): dense
        return TensorDelta(spec.name, DENSE, numel, values)
    return TensorDelta(spec.name, SPARSE, idx.numel(), values, idx.to(torch.int32))


def read(path: str | os.PathLike, *, layout: Layout | None = None) -> Anchor | Delta:
    """Read an anchor or a delta file (``sparse`` metadata says which; a file without it is a
    plain checkpoint, read as an anchor of unknown version).

    Args:
        layout: the layout of the tensors the file is for. Needed for a delta that does not
            carry ``tensorhub.layout`` (one written elsewhere: its indices do not say the
            tensors' shapes); when both are known they must agree.

    Raises:
        InvalidArgument: not a file in this format, bad metadata, malformed entries (naming the
            tensor), or a delta with no layout to go by.
        LayoutMismatch: the file's tensors are not ``layout``'s (naming the tensor).
    """
    st = _safetensors()
    where = str(path)
    try:
        handle = st.safe_open(where, framework="pt", device="cpu")
    except Exception as err:  # safetensors raises its own error type (and OSError)
        raise InvalidArgument(f"{where}: not a safetensors file ({err})") from err
    with handle as f:
        return _parse(where, f.metadata() or {}, list(f.keys()), f.get_tensor, layout)


#: The largest header :func:`from_bytes` reads (safetensors' own limit).
MAX_HEADER = 100 << 20


def from_bytes(data: bytes | bytearray | memoryview, *, layout: Layout | None = None, where: str = "delta bytes") -> Anchor | Delta:
    """Read an anchor or a delta from a file's bytes (pulled from a peer, read from a bucket):
    :func:`read` without the file. Parsed as safetensors (a length, a JSON header, raw tensor
    bytes), never unpickled.

    Raises:
        InvalidArgument: not the bytes of a file in this format (naming ``where``), and what
            :func:`read` raises.
    """
    st = _safetensors()
    buf = bytes(data)
    if len(buf) < 8:
        raise InvalidArgument(f"{where}: {len(buf)} bytes are no safetensors file")
    n = int.from_bytes(buf[:8], "little")
    if n > MAX_HEADER or 8 + n > len(buf):
        raise InvalidArgument(f"{where}: a header of {n} bytes in {len(buf)} bytes")
    try:
        header = json.loads(buf[8 : 8 + n])
        tensors = st.torch.load(buf)
    except Exception as err:  # safetensors raises its own error type
        raise InvalidArgument(f"{where}: not a safetensors file ({err})") from err
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InvalidArgument(f"{where}: the metadata must map strings to strings")
    return _parse(where, meta, list(tensors), tensors.__getitem__, layout)


def _parse(
    where: str, meta: Mapping[str, str], keys: list[str], get_tensor: Any, layout: Layout | None
) -> Anchor | Delta:
    sparse = meta.get("sparse", "False").strip().lower() in ("true", "1")
    version = _int(meta, "model_version", where)
    file_layout = _layout_from_json(meta["tensorhub.layout"], where) if "tensorhub.layout" in meta else None
    if file_layout is not None and layout is not None:
        _check_same_specs(file_layout, layout, where)
    checksums = _sums_from_json(meta.get("tensorhub.checksums"), where, "tensorhub.checksums")
    if not sparse:
        tensors = {k: get_tensor(k).contiguous() for k in keys}
        if not tensors:
            raise InvalidArgument(f"{where}: a checkpoint without tensors")
        anchor_layout = layout_of(tensors)
        if file_layout is not None:  # the file's tensors are what its layout says, in its order
            _check_same_specs(anchor_layout, file_layout, where)
            tensors = {t.name: tensors[t.name] for t in file_layout.tensors}
            anchor_layout = file_layout
        if layout is not None:
            _check_same_specs(anchor_layout, layout, where)
        return Anchor(anchor_layout, version, tensors, checksums)
    if version is None:
        raise InvalidArgument(f"{where}: a delta file without model_version")
    layout = file_layout or layout
    if layout is None:
        raise InvalidArgument(f"{where}: this delta file does not carry its layout: give the layout of the "
                              f"tensors it applies to (the checkpoint or anchor it is based on)", version=version)  # fmt: skip
    specs = {t.name: t for t in layout.tensors}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for k in keys:
        if k.endswith(INDICES) and k[: -len(INDICES)] in specs:
            parts.setdefault(k[: -len(INDICES)], {})["indices"] = get_tensor(k)
        elif k.endswith(VALUES) and k[: -len(VALUES)] in specs:
            parts.setdefault(k[: -len(VALUES)], {})["values"] = get_tensor(k)
        elif k in specs:
            parts.setdefault(k, {})["whole"] = get_tensor(k)
        else:
            raise LayoutMismatch(f"{where}: the delta has tensor {k!r}, which the layout does not", version=version)
    base = _int(meta, "prev_model_version", where)
    base_checksums = _sums_from_json(meta.get("tensorhub.base_checksums"), where, "tensorhub.base_checksums")
    entries = []
    for name, got in parts.items():
        spec = specs[name]
        if "whole" in got:
            if len(got) > 1:
                raise InvalidArgument(f"{where}: tensor {name!r} is both whole and sparse", version=version)
            whole = got["whole"]
            if str(whole.dtype).removeprefix("torch.") != spec.dtype or tuple(whole.shape) != spec.shape:
                raise LayoutMismatch(f"{where}: tensor {name!r} is {whole.dtype}{list(whole.shape)}, the layout says "
                                     f"{spec.dtype}{list(spec.shape)}", version=version)  # fmt: skip
            entries.append(TensorDelta(name, DENSE, math.prod(spec.shape), whole.contiguous().reshape(-1)))
            continue
        if set(got) != {"indices", "values"}:
            raise InvalidArgument(
                f"{where}: tensor {name!r} has {name}{INDICES} and {name}{VALUES} not both", version=version
            )
        entries.append(_sparse_entry(spec, got["indices"], got["values"], where, version))
    return Delta(
        layout, base if base is not None and base >= 0 else None, version, tuple(entries), base_checksums, checksums
    )


def read_checkpoint(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> Anchor:
    """A checkpoint to start from or compare with: an anchor file, a plain safetensors state
    dict, or several (a directory of ``*.safetensors``, or a list), merged in order.

    Raises:
        InvalidArgument: a delta file, no file, or two files with the same tensor.
    """
    if isinstance(paths, (str, os.PathLike)):
        p = Path(paths)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    else:
        files = [Path(x) for x in paths]
    if not files:
        raise InvalidArgument(f"no safetensors file in {paths}")
    if len(files) == 1:
        got = read(files[0])
        if not isinstance(got, Anchor):
            raise InvalidArgument(f"{files[0]}: a delta file, not a checkpoint")
        return got
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        got = read(file)
        if not isinstance(got, Anchor):
            raise InvalidArgument(f"{file}: a delta file, not a checkpoint")
        for k, v in got.tensors.items():
            if k in tensors:
                raise InvalidArgument(f"{file}: tensor {k!r} is in two files")
            tensors[k] = v
    return Anchor(layout_of(tensors), None, tensors, None)
