"""The bucket tier: anchors and deltas of shards kept in a content-addressed object store.

Theory of operation
-------------------
A **bucket** is any fsspec URL (a local directory by default, ``memory://`` in tests, ``s3://``
and the like when their fsspec backend is installed). A reader that reaches no peer (another
region) restores a version from it: the latest anchor at or before the version, then the deltas
after it, verified against the version's own checksums. It holds two kinds of objects::

    chunks/<h[:2]>/<h>                                 bytes whose sha256 is h (hex)
    models/<model>/shard-<i:05d>/<v:020d>.anchor.json  manifest of an anchor of version v
    models/<model>/shard-<i:05d>/<v:020d>.delta.json   manifest of a delta  base -> v

- **Chunks** are the objects' bytes cut every ``chunk_bytes`` (4 MiB by default) and named by
  their sha256: a chunk is written once (its existence is checked first), so an unchanged chunk
  of a later anchor costs nothing but the check, and a reader verifies every chunk it fetches
  against its name (a mismatch is :class:`~tensorhub.errors.ChecksumMismatch` naming the
  chunk, a missing one :class:`~tensorhub.errors.VersionUnavailable` naming it).
- A **manifest** (:class:`Manifest`, JSON, never pickle; immutable once written) says what one
  object of one (model, version, shard) is: ``kind`` ``anchor`` or ``delta``, the base version
  (delta), the shard's layout, its checksums at that version (the
  :mod:`~tensorhub.runtime.checksum` units a holder declares; a delta also carries its base's),
  the ordered chunk list and the byte size.
- An **anchor** is the shard's bytes in the layout's *transfer order* (packs of tiny tensors,
  then the large tensors: :func:`~tensorhub.core.layout.plan_of`), not a safetensors file. Two
  reasons: the bytes of a tensor sit at the same offset in every version, so chunks that did
  not change between two anchors have the same name and are not written again (a safetensors
  header, whose metadata changes every version, would shift every byte after it); and a
  restore copies each verified chunk straight into the registered tensors (CPU or CUDA) with
  no file to parse and no second full buffer. The manifest's layout makes the bytes
  self-describing; ``tensorhub export`` writes TRL anchor files.
- A **delta** is a delta file in TRL's format (:func:`tensorhub.runtime.deltafiles.write_delta`),
  chunked: the concatenation of a delta manifest's chunks is a file that plain ``safetensors``
  and TRL's readers read. It carries its base's and its target's checksums.

Writing (:class:`BucketWriter`). ``put`` takes a snapshot the writer owns (a CPU copy, or
tensors handed over) and enqueues it on a bounded queue; a background thread does everything
else, so a publisher never waits on the bucket except while the queue is full (backpressure:
at most ``max_pending`` snapshots in memory). Per (model, shard) the thread keeps the last
version it stored and its snapshot, and stores for every version a delta from the previous one
(the caller's :class:`~tensorhub.runtime.deltas.Delta` when it has one that fits, else computed
here), and also an anchor when ``anchor_every`` versions have passed since the last anchor. The
first version, and the first after a failure or a layout change broke the chain, is an anchor
alone.
At anchor versions both are stored, so a reader holding the previous version still has a chain
across the anchor. An object is written chunks first, then its manifest (to a temporary name,
then moved into place where the file system has no atomic put), so a reader that sees a
manifest finds every chunk. A failure is kept and raised, typed, by the next ``put``,
``flush`` or ``close`` (IO errors as :class:`~tensorhub.errors.TransportError`, the cause
chained; a :class:`~tensorhub.errors.BucketError`); the shard's chain then restarts with an anchor.
A URL that cannot be used at all (an unknown protocol, a local path under a regular file or where
no directory can be made) is :class:`~tensorhub.errors.BucketUnavailable` when the
:class:`Bucket` is made.

Retention, after each anchor: the last ``keep_anchors`` anchors of the shard and the deltas
after the oldest of them stay; older manifests are deleted, then the chunks they referenced that
no remaining manifest (of any model or shard) references. Only those candidates are deleted, so
chunks another writer has written for a manifest it has not written yet are never touched;
:meth:`Bucket.sweep` collects orphans (chunks of writes that failed) older than a grace period.
A writer whose deduplicated chunks vanished under a concurrent collection rewrites them after
writing its manifest.

Reading (:class:`BucketReader`). ``restore`` fetches and checks every delta of the route before
it writes a byte; from nothing it then streams the anchor's chunks into the tensors, checks them
against the anchor's checksums, and applies the deltas with
:func:`~tensorhub.runtime.deltas.apply_chain`, which verifies the result against the version's
checksums. Given tensors that hold a base ``b`` it applies only the deltas ``b -> v`` when that
chain exists and is fewer bytes, and falls back to the anchor route when that fails: the tensors
do not hold ``b`` (refused before any byte changed), a delta is missing or corrupt (found before
any byte changed), or the result does not verify. Never: present tensors as a version they did
not verify as; after a failure past the first write the tensors hold no version (the caller
treats them as empty, as after a failed pull).

Size: the on-disk format (manifests, content-addressed chunks), its writer, its reader and its
retention share the format's private helpers; the writer/reader seam is where it would split.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import hashlib
import json
import math
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import fsspec
import torch

from tensorhub.core.errors import (
    BucketError,
    BucketUnavailable,
    ChecksumMismatch,
    ContractViolation,
    InvalidArgument,
    MalformedMessage,
    TensorHubError,
    Timeout,
    VersionError,
    VersionUnavailable,
    WireVersionMismatch,
)
from tensorhub.core.layout import DTYPE_SIZES, Layout, TensorSpec, plan_of
from tensorhub.core.naming import validate_model, validate_version
from tensorhub.transports.buffers import ShardBuffers, layout_of

from . import checksum, deltafiles
from .deltas import Delta, apply_chain, check_specs, compute_delta, shard_checksums

__all__ = [
    "ANCHOR",
    "DEFAULT_CHUNK_BYTES",
    "DELTA",
    "FORMAT",
    "FORMAT_VERSION",
    "Bucket",
    "BucketReader",
    "BucketWriter",
    "Manifest",
    "Restored",
]

FORMAT = "tensorhub-bucket"
FORMAT_VERSION = 1
#: Manifest kinds.
ANCHOR = "anchor"
DELTA = "delta"
#: How an object's bytes are encoded (manifest ``encoding``).
SHARD_BYTES = "shard-bytes"  # the shard's transfer space, in order
TRL_DELTA = "trl-safetensors"  # a delta file in TRL's format
DEFAULT_CHUNK_BYTES = 4 << 20
#: Smallest chunk size accepted (tests use small chunks; real buckets want MiBs).
MIN_CHUNK_BYTES = 64
#: Protocols whose single put is atomic already (object stores): no temporary name + move.
_ATOMIC_PUT = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})


# --- manifests --------------------------------------------------------------------------------


def _layout_doc(layout: Layout) -> dict[str, Any]:
    return {
        "tensors": [[t.name, t.dtype, list(t.shape)] for t in layout.tensors],
        "checksum": layout.checksum,
        "chunk_bytes": layout.chunk_bytes,
        "pack_threshold": layout.pack_threshold,
    }


def _layout_from_doc(doc: Any) -> Layout:
    specs = []
    for name, dtype, shape in doc["tensors"]:
        dims = tuple(int(d) for d in shape)
        specs.append(TensorSpec(str(name), str(dtype), dims, math.prod(dims) * DTYPE_SIZES[dtype]))
    return Layout(tuple(specs), str(doc["checksum"]), int(doc["chunk_bytes"]), int(doc["pack_threshold"]))


def _sums_doc(sums: Sequence[int] | None) -> list[str] | None:
    return None if sums is None else [f"{s:016x}" for s in sums]


def _sums_from_doc(doc: Any) -> tuple[int, ...] | None:
    return None if doc is None else tuple(int(s, 16) for s in doc)


@dataclass(frozen=True, slots=True)
class Manifest:
    """What one object of one (model, version, shard) in a bucket is. Immutable once written.

    Attributes:
        model, version, shard: whose object it is.
        kind: :data:`ANCHOR` (the whole shard) or :data:`DELTA` (``base -> version``).
        base: the version a delta applies to (None for an anchor).
        layout: the shard's layout; it fixes the checksum units.
        checksums: the shard's checksum per unit at ``version``.
        base_checksums: at ``base`` (a delta), else None.
        chunks: the sha256 (hex) of each chunk, in order.
        nbytes: the object's size (the chunks' sizes add up to it).
        chunk_bytes: the chunk size (every chunk but the last has it).
        encoding: :data:`SHARD_BYTES` (anchor) or :data:`TRL_DELTA` (delta).
        created: when the writer made it (seconds since the epoch).
    """

    model: str
    version: int
    shard: int
    kind: str
    base: int | None
    layout: Layout
    checksums: tuple[int, ...]
    base_checksums: tuple[int, ...] | None
    chunks: tuple[str, ...]
    nbytes: int
    chunk_bytes: int
    encoding: str
    created: float = 0.0

    def __post_init__(self) -> None:
        ctx: dict[str, Any] = {"model": self.model, "version": self.version, "shard": self.shard}
        if self.kind == ANCHOR:
            ok = self.base is None and self.encoding == SHARD_BYTES and self.nbytes == self.layout.total_bytes
        elif self.kind == DELTA:
            ok = self.base is not None and 0 <= self.base < self.version and self.encoding == TRL_DELTA
        else:
            ok = False
        n = self.layout.checksum_count()
        ok = ok and len(self.checksums) == n and (self.base_checksums is None or len(self.base_checksums) == n)
        ok = ok and self.chunk_bytes >= MIN_CHUNK_BYTES and len(self.chunks) == -(-self.nbytes // self.chunk_bytes)
        ok = ok and all(len(c) == 64 and all(x in "0123456789abcdef" for x in c) for c in self.chunks)
        if not ok:
            raise MalformedMessage(f"an inconsistent bucket manifest ({self.kind} base={self.base}, "
                                   f"{len(self.chunks)} chunks for {self.nbytes} bytes)", **ctx)  # fmt: skip

    def to_json(self) -> bytes:
        """The manifest's bytes (UTF-8 JSON)."""
        return json.dumps({
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "model": self.model, "version": self.version, "shard": self.shard,
            "kind": self.kind, "base": self.base, "layout": _layout_doc(self.layout),
            "checksums": _sums_doc(self.checksums), "base_checksums": _sums_doc(self.base_checksums),
            "chunks": list(self.chunks), "nbytes": self.nbytes, "chunk_bytes": self.chunk_bytes,
            "encoding": self.encoding, "created": self.created,
        }, separators=(",", ":")).encode()  # fmt: skip

    @classmethod
    def from_json(cls, data: bytes, key: str) -> Manifest:
        """Decode and validate a manifest read from ``key``.

        Raises:
            WireVersionMismatch: another format version.
            MalformedMessage: not a manifest of this format, naming ``key``.
        """
        try:
            doc = json.loads(data)
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}")
        except (ValueError, AttributeError) as err:
            raise MalformedMessage(f"bucket object {key} is not a manifest ({err})") from err
        if doc.get("format_version") != FORMAT_VERSION:
            raise WireVersionMismatch(f"bucket object {key} is a manifest of format version "
                                      f"{doc.get('format_version')!r}; this side reads {FORMAT_VERSION}")  # fmt: skip
        try:
            base = doc["base"]
            sums = _sums_from_doc(doc["checksums"])
            assert sums is not None
            return cls(
                str(doc["model"]), int(doc["version"]), int(doc["shard"]), str(doc["kind"]),
                None if base is None else int(base), _layout_from_doc(doc["layout"]), sums,
                _sums_from_doc(doc["base_checksums"]), tuple(str(c) for c in doc["chunks"]),
                int(doc["nbytes"]), int(doc["chunk_bytes"]), str(doc["encoding"]), float(doc.get("created", 0.0)),
            )  # fmt: skip
        except MalformedMessage as err:
            raise MalformedMessage(f"bucket object {key}: {err.message}") from err
        except (KeyError, TypeError, ValueError, AssertionError) as err:
            raise MalformedMessage(f"bucket object {key} is a malformed manifest ({err!r})") from err


# --- the store --------------------------------------------------------------------------------


class Bucket:
    """A bucket's objects at an fsspec URL: chunks by sha256, manifests by (model, shard, version).

    Thread-safe for one writer thread and any number of reading threads. Manifests are cached
    once read (they never change).

    Args:
        url: where the bucket lives: a local directory path, ``file://...``, ``memory://...``,
            ``s3://...`` (with its fsspec backend installed).
        storage_options: passed to the fsspec file system (credentials, endpoints).
        fs: a file system to use instead of the one the URL names (then ``url`` is the root
            path inside it).

    Attributes:
        stats: counters: ``chunks_written``, ``chunks_reused`` (found already there),
            ``bytes_written`` (chunk bytes), ``manifests_written``, ``manifests_deleted``,
            ``chunks_deleted``.
    """

    def __init__(
        self, url: str, *, storage_options: Mapping[str, Any] | None = None, fs: fsspec.AbstractFileSystem | None = None
    ) -> None:
        if fs is None:
            try:
                fs, root = fsspec.core.url_to_fs(str(url), **dict(storage_options or {}))
            except (ValueError, ImportError, OSError, TypeError) as err:  # unknown protocol, backend missing
                raise BucketUnavailable(f"bucket {url}: cannot open it ({type(err).__name__}: {err})") from err
        else:
            root = str(url)
        self.url = str(url)
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
        self._atomic_put = any(p in _ATOMIC_PUT for p in protocols)
        self._local = any(p in ("file", "local") for p in protocols)
        self._dirs: set[str] = set()
        self._manifests: dict[str, Manifest] = {}
        self._lock = threading.Lock()
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "chunks_written",
                "chunks_reused",
                "bytes_written",
                "manifests_written",
                "manifests_deleted",
                "chunks_deleted",
            ),
            0,
        )
        if self._local:
            try:
                fs.makedirs(self.root, exist_ok=True)
                if not fs.isdir(self.root):
                    raise NotADirectoryError(f"{self.root} is not a directory")
            except OSError as err:  # under a regular file, in /proc, no permission...
                raise BucketUnavailable(f"bucket {url}: cannot make its directory {self.root} "
                                        f"({type(err).__name__}: {err})") from err  # fmt: skip

    def __repr__(self) -> str:
        return f"Bucket({self.url!r})"

    # keys

    def chunk_key(self, name: str) -> str:
        return f"{self.root}/chunks/{name[:2]}/{name}"

    def shard_dir(self, model: str, shard: int) -> str:
        return f"{self.root}/models/{model}/shard-{shard:05d}"

    def manifest_key(self, model: str, version: int, shard: int, kind: str) -> str:
        return f"{self.shard_dir(model, shard)}/{version:020d}.{kind}.json"

    # bytes

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.stats[what] += n

    def _put(self, key: str, data: bytes) -> None:
        """Put ``data`` at ``key`` so that a reader sees all of it or nothing."""
        parent = key.rpartition("/")[0]
        if self._local and parent not in self._dirs:
            self.fs.makedirs(parent, exist_ok=True)
            self._dirs.add(parent)
        if self._atomic_put:
            self.fs.pipe_file(key, data)
            return
        tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, key)
        except BaseException:
            with contextlib.suppress(OSError):
                self.fs.rm_file(tmp)
            raise

    def _get(self, key: str, what: str, ctx: Mapping[str, Any]) -> bytes:
        try:
            return bytes(self.fs.cat_file(key))
        except FileNotFoundError as err:
            raise VersionUnavailable(f"bucket {self.url}: {what} {key} is missing", **ctx) from err
        except OSError as err:
            raise BucketError(f"bucket {self.url}: reading {what} {key} failed ({err})", **ctx) from err

    def has_chunk(self, name: str) -> bool:
        return bool(self.fs.exists(self.chunk_key(name)))

    def put_chunk(self, data: bytes | memoryview, name: str | None = None) -> tuple[str, bool]:
        """Store one chunk unless a chunk of that name is already there.

        Returns:
            ``(sha256 hex, written)``: ``written`` is False when it was there already.
        """
        name = name or hashlib.sha256(data).hexdigest()
        if self.has_chunk(name):
            self._count("chunks_reused")
            return name, False
        self._put(self.chunk_key(name), bytes(data))
        self._count("chunks_written")
        self._count("bytes_written", len(data))
        return name, True

    def get_chunk(self, name: str, size: int | None = None, ctx: Mapping[str, Any] | None = None) -> bytes:
        """Fetch one chunk and verify it against its name (and ``size`` when given).

        Raises:
            VersionUnavailable: the chunk is missing (naming it).
            ChecksumMismatch: its bytes are not what its name says (naming it).
            TransportError: the file system failed.
        """
        ctx = dict(ctx or {})
        key = self.chunk_key(name)
        return self._verified(name, key, self._get(key, "chunk", ctx), size, ctx)

    def get_chunks(
        self, chunks: Sequence[tuple[str, int]], ctx: Mapping[str, Any] | None = None, *, batch: int = 8
    ) -> Iterator[bytes]:
        """Fetch ``(name, size)`` chunks in order, verified, ``batch`` at a time (file systems
        with an async API, object stores, fetch a batch concurrently).

        Raises:
            As :meth:`get_chunk`, for the first chunk that fails.
        """
        ctx = dict(ctx or {})
        for i in range(0, len(chunks), batch):
            part = chunks[i : i + batch]
            if len(part) == 1:
                yield self.get_chunk(part[0][0], part[0][1], ctx)
                continue
            keys = [self.chunk_key(name) for name, _ in part]
            try:
                got = self.fs.cat(keys, on_error="return")
            except OSError as err:
                raise BucketError(f"bucket {self.url}: reading chunks {keys[0]}... failed ({err})", **ctx) from err
            for (name, size), key in zip(part, keys):
                data = got.get(key) if isinstance(got, dict) else None
                if data is None or isinstance(data, FileNotFoundError):
                    yield self.get_chunk(name, size, ctx)  # one at a time: names what is wrong
                elif isinstance(data, BaseException):
                    raise BucketError(f"bucket {self.url}: reading chunk {key} failed ({data})", **ctx) from data
                else:
                    yield self._verified(name, key, bytes(data), size, ctx)

    def _verified(self, name: str, key: str, data: bytes, size: int | None, ctx: Mapping[str, Any]) -> bytes:
        if (size is not None and len(data) != size) or hashlib.sha256(data).hexdigest() != name:
            raise ChecksumMismatch(f"bucket {self.url}: chunk {key} is corrupt (its {len(data)} bytes do not hash "
                                   f"to its name)", **ctx)  # fmt: skip
        return data

    def put_manifest(self, m: Manifest) -> None:
        key = self.manifest_key(m.model, m.version, m.shard, m.kind)
        self._put(key, m.to_json())
        with self._lock:
            self._manifests[key] = m
        self._count("manifests_written")

    def manifest(self, model: str, version: int, shard: int, kind: str) -> Manifest:
        """The manifest of one object.

        Raises:
            VersionUnavailable: no such object.
            MalformedMessage: the object is not a valid manifest, or not the one its key says.
        """
        key = self.manifest_key(model, version, shard, kind)
        with self._lock:
            got = self._manifests.get(key)
        if got is not None:
            return got
        ctx: dict[str, Any] = {"model": model, "version": version, "shard": shard}
        m = Manifest.from_json(self._get(key, "manifest", ctx), key)
        if (m.model, m.version, m.shard, m.kind) != (model, version, shard, kind):
            raise MalformedMessage(f"bucket object {key} holds the manifest of {m.model} v{m.version} shard "
                                   f"{m.shard} ({m.kind})", **ctx)  # fmt: skip
        with self._lock:
            self._manifests[key] = m
        return m

    def entries(self, model: str, shard: int) -> dict[int, frozenset[str]]:
        """The objects stored for one shard of a model: ``{version: {kinds}}``."""
        try:
            names = self.fs.ls(self.shard_dir(model, shard), detail=False)
        except FileNotFoundError:
            return {}
        out: dict[int, set[str]] = {}
        for name in names:
            base = str(name).rstrip("/").rpartition("/")[2]
            parts = base.split(".")
            if len(parts) == 3 and parts[2] == "json" and parts[1] in (ANCHOR, DELTA) and parts[0].isdigit():
                out.setdefault(int(parts[0]), set()).add(parts[1])
        return {v: frozenset(k) for v, k in sorted(out.items())}

    def models(self) -> list[str]:
        return sorted(self._children(f"{self.root}/models"))

    def shards(self, model: str) -> list[int]:
        found = self._children(f"{self.root}/models/{model}")
        return sorted(int(n[6:]) for n in found if n.startswith("shard-") and n[6:].isdigit())

    def _children(self, path: str) -> list[str]:
        try:
            names = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return [str(n).rstrip("/").rpartition("/")[2] for n in names]

    def all_manifests(self) -> list[Manifest]:
        """Every manifest in the bucket (all models and shards)."""
        out: list[Manifest] = []
        for model in self.models():
            for shard in self.shards(model):
                for version, kinds in self.entries(model, shard).items():
                    out.extend(self.manifest(model, version, shard, kind) for kind in sorted(kinds))
        return out

    def delete_manifests(self, manifests: Iterable[Manifest]) -> None:
        keys = [self.manifest_key(m.model, m.version, m.shard, m.kind) for m in manifests]
        if not keys:
            return
        self.fs.rm(keys)
        with self._lock:
            for k in keys:
                self._manifests.pop(k, None)
        self._count("manifests_deleted", len(keys))

    def collect(self, candidates: Iterable[str]) -> int:
        """Delete those of the chunks ``candidates`` that no manifest references.

        Returns:
            How many were deleted.
        """
        wanted = set(candidates)
        if not wanted:
            return 0
        for m in self.all_manifests():
            wanted.difference_update(m.chunks)
        keys = [self.chunk_key(c) for c in sorted(wanted)]
        if keys:
            self.fs.rm(keys)
            self._count("chunks_deleted", len(keys))
        return len(keys)

    def sweep(self, older_than_s: float = 3600.0) -> int:
        """Delete every chunk that no manifest references and that is older than
        ``older_than_s`` (the orphans of failed writes; younger ones may belong to a manifest
        being written). Chunks whose age the file system does not tell are kept.

        Returns:
            How many were deleted.
        """
        referenced: set[str] = set()
        for m in self.all_manifests():
            referenced.update(m.chunks)
        try:
            keys = self.fs.find(f"{self.root}/chunks")
        except FileNotFoundError:
            return 0
        now = time.time()
        doomed = []
        for key in keys:
            name = str(key).rpartition("/")[2]
            if name in referenced:
                continue
            try:
                age = now - self.fs.modified(key).timestamp()
            except (NotImplementedError, OSError, AttributeError):
                continue
            if age >= older_than_s:
                doomed.append(key)
        if doomed:
            self.fs.rm(doomed)
            self._count("chunks_deleted", len(doomed))
        return len(doomed)


def _bucket(where: Bucket | str, storage_options: Mapping[str, Any] | None) -> Bucket:
    return where if isinstance(where, Bucket) else Bucket(str(where), storage_options=storage_options)


def _transfer_chunks(tensors: Mapping[str, torch.Tensor], layout: Layout, size: int) -> Iterable[memoryview | bytes]:
    """The shard's transfer space (CPU tensors), cut every ``size`` bytes."""
    buffers = ShardBuffers(dict(tensors), layout, packs_in_place=True)
    total = buffers.total_bytes
    for off in range(0, total, size):
        views = buffers.views(off, min(size, total - off))
        yield views[0] if len(views) == 1 else b"".join(views)


def _cut(data: bytes, size: int) -> Iterable[memoryview]:
    view = memoryview(data)
    for off in range(0, len(data), size):
        yield view[off : off + size]


def _delta_bytes(delta: Delta) -> bytes:
    return deltafiles.delta_bytes(delta)


def _delta_from_bytes(data: bytes, layout: Layout, where: str) -> Delta:
    try:
        got = deltafiles.from_bytes(data, layout=layout, where=where)
    except InvalidArgument as err:
        raise MalformedMessage(err.message) from err
    if not isinstance(got, Delta):
        raise MalformedMessage(f"{where}: an anchor file where a delta file was expected")
    return got


def _check_into(into: Mapping[str, torch.Tensor], layout: Layout, ctx: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``into`` in layout order, after checking it has the layout's tensors (naming the first
    that differs)."""
    check_specs(into, layout, dict(ctx), whose="the bucket's")
    return {spec.name: into[spec.name] for spec in layout.tensors}


# --- writing ----------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Job:
    model: str
    version: int
    shard: int
    tensors: dict[str, torch.Tensor]  # the writer's own snapshot, CPU, layout order
    layout: Layout
    checksums: tuple[int, ...] | None
    delta: Delta | None


@dataclass(eq=False, slots=True)
class _Chain:
    """What the writer thread keeps per (model, shard): the last version stored, and its bytes."""

    version: int
    anchor: int
    layout: Layout
    tensors: dict[str, torch.Tensor]
    checksums: tuple[int, ...]


class BucketWriter:
    """Keeps a bucket's anchors and deltas of the versions it is fed, in the background.

    Args:
        bucket: a :class:`Bucket` or its URL.
        anchor_every: store an anchor when this many versions passed since the shard's last one
            (a delta is stored for every version; at most ``anchor_every - 1`` deltas follow an
            anchor in a restore).
        keep_anchors: retention: the last this many anchors of a shard and the deltas after the
            oldest of them stay; older objects go, and their chunks that nothing else references.
            0 keeps everything.
        max_pending: the most snapshots queued (``put`` waits while the queue is full).
        chunk_bytes: the chunk size of new objects.
        storage_options: for the URL's file system.

    Memory: per (model, shard) the snapshot of the last version stored (the base of the next
    delta), plus up to ``max_pending`` queued snapshots and the one being written: CPU copies of
    the shard. One thread per writer; one writer may serve many models and shards. The thread is
    a daemon: versions still queued when the process exits without :meth:`close` are lost (the
    bucket stays consistent: a version is there with its manifest, or not at all).

    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        bucket: Bucket | str,
        *,
        anchor_every: int = 8,
        keep_anchors: int = 2,
        max_pending: int = 2,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        for name, value, low in (("anchor_every", anchor_every, 1), ("keep_anchors", keep_anchors, 0),
                                 ("max_pending", max_pending, 1), ("chunk_bytes", chunk_bytes, MIN_CHUNK_BYTES)):  # fmt: skip
            if type(value) is not int or value < low:
                raise InvalidArgument(f"{name} must be an int >= {low}, got {value!r}")
        self.bucket = _bucket(bucket, storage_options)
        self.anchor_every = anchor_every
        self.keep_anchors = keep_anchors
        self.chunk_bytes = chunk_bytes
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_pending)
        self._cond = threading.Condition()
        self._pending = 0
        self._failure: TensorHubError | None = None
        self._closed = False
        self._last_put: dict[tuple[str, int], int] = {}
        self._chains: dict[tuple[str, int], _Chain] = {}  # the writer thread's own
        self._stored: collections.OrderedDict[tuple[str, int, int], None] = collections.OrderedDict()  # recent
        self._thread = threading.Thread(
            target=self._run, name=f"tensorhub-bucket-writer {self.bucket.url}", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pending(self) -> int:
        """Versions put and not yet written (or failed)."""
        with self._cond:
            return self._pending

    def stored(self, model: str, version: int, shard_idx: int) -> bool:
        """Whether this writer wrote ``version`` of the shard (among its last 1,024 writes): what
        may be declared to a server, whatever failure another version's write raised."""
        with self._cond:
            return (model, shard_idx, version) in self._stored

    @property
    def stats(self) -> dict[str, int]:
        """The bucket's counters (see :class:`Bucket`)."""
        return dict(self.bucket.stats)

    def put(
        self,
        model: str,
        version: int,
        shard_idx: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        layout: Layout | None = None,
        checksums: Sequence[int] | None = None,
        delta: Delta | None = None,
        copy: bool = True,
        timeout: float | None = None,
    ) -> None:
        """Enqueue ``version`` of one shard for the bucket; returns once the writer owns a snapshot.

        Args:
            model, version, shard_idx: what it is; versions of a shard must increase.
            tensors: the shard's tensors (CPU or CUDA, contiguous).
            layout: their layout (a handle's); default: the tensors' own, in the mapping's order.
            checksums: their checksums as the holder declares them; computed in the background
                when None.
            delta: the delta from the previous version put for this shard, when the caller has
                one (used when its base and checksums fit; else the writer computes its own).
            copy: snapshot the tensors (a CPU copy, made here). False hands them over: the caller
                promises they are CPU tensors it never mutates again.
            timeout: the longest to wait for room in the queue.

        Raises:
            TensorHubError: an earlier write failed (raised once; this version is not enqueued).
            ContractViolation: the writer is closed, or ``version`` is not after the shard's last.
            InvalidArgument, InvalidName, LayoutMismatch: bad arguments.
            Timeout: the queue stayed full for ``timeout`` seconds.
        """
        self._raise_failure()
        if self._closed:
            raise ContractViolation("the bucket writer is closed", model=model, version=version, shard=shard_idx)
        model = validate_model(model)
        version = validate_version(version, model=model)
        ctx: dict[str, Any] = {"model": model, "version": version, "shard": shard_idx}
        if type(shard_idx) is not int or shard_idx < 0:
            raise InvalidArgument(f"shard_idx must be an int >= 0, got {shard_idx!r}", **ctx)
        layout = layout or layout_of(dict(tensors), ctx=ctx)
        ordered = _check_into(tensors, layout, ctx)
        if checksums is not None and len(checksums) != layout.checksum_count():
            raise InvalidArgument(f"{len(checksums)} checksums for a layout of {layout.checksum_count()} units", **ctx)
        if delta is not None and delta.version != version:
            raise InvalidArgument(f"the delta makes version {delta.version}, not {version}", **ctx)
        key = (model, shard_idx)
        with self._cond:
            last = self._last_put.get(key)
            if last is not None and version <= last:
                raise ContractViolation(f"version {version} put after version {last} of the same shard", **ctx)
        if copy:
            snapshot = {n: t.detach().to("cpu", copy=True) for n, t in ordered.items()}
        else:
            if any(t.device.type != "cpu" for t in ordered.values()):
                raise InvalidArgument("copy=False hands over CPU tensors; these are not all on the CPU", **ctx)
            snapshot = {n: t.detach() for n, t in ordered.items()}
        job = _Job(
            model, version, shard_idx, snapshot, layout, tuple(checksums) if checksums is not None else None, delta
        )
        with self._cond:
            self._last_put[key] = version
            self._pending += 1
        try:
            self._queue.put(job, timeout=timeout)
        except queue.Full:
            with self._cond:
                self._pending -= 1
                if last is None:
                    self._last_put.pop(key, None)
                else:
                    self._last_put[key] = last
            raise Timeout(f"the bucket writer's queue stayed full for {timeout} s", **ctx) from None

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything put so far is in the bucket (or failed).

        Raises:
            TensorHubError: a write failed (raised once).
            Timeout: still writing after ``timeout`` seconds.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending == 0, timeout):
                raise Timeout(f"the bucket writer still has {self._pending} versions to write after {timeout} s")
        self._raise_failure()

    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the writer thread. Idempotent.

        Raises:
            TensorHubError: a write failed and was not raised yet.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.flush(timeout)
        finally:
            self._queue.put(None)
            self._thread.join(timeout)

    def _raise_failure(self) -> None:
        with self._cond:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    # the writer thread

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
                with self._cond:
                    self._stored[(job.model, job.shard, job.version)] = None
                    while len(self._stored) > 1024:
                        self._stored.popitem(last=False)
            except BaseException as err:  # noqa: BLE001 - kept for the caller's next call, typed
                self._chains.pop((job.model, job.shard), None)  # the chain restarts with an anchor
                self._fail(job, err)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _fail(self, job: _Job, err: BaseException) -> None:
        ctx: dict[str, Any] = {"model": job.model, "version": job.version, "shard": job.shard}
        if isinstance(err, TensorHubError):
            error = err
        else:
            error = BucketError(f"bucket {self.bucket.url}: writing version {job.version} failed: "
                                f"{type(err).__name__}: {err}", **ctx)  # fmt: skip
            error.__cause__ = err
        with self._cond:
            if self._failure is None:  # the first failure is the one to report
                self._failure = error

    def _write(self, job: _Job) -> None:
        key = (job.model, job.shard)
        chain = self._chains.get(key)
        if chain is not None and chain.layout != job.layout:
            chain = None  # a new layout starts a new chain
        sums = job.checksums if job.checksums is not None else shard_checksums(job.tensors, job.layout)
        if chain is not None:
            delta = job.delta
            fits = (
                delta is not None and delta.base == chain.version and delta.layout == job.layout
                and delta.base_checksums in (None, chain.checksums) and delta.checksums in (None, sums)
            )  # fmt: skip
            if delta is not None and fits:
                delta = Delta(job.layout, chain.version, job.version, delta.tensors, chain.checksums, sums)
            else:
                delta = compute_delta(chain.tensors, job.tensors, base_version=chain.version, version=job.version,
                                      layout=job.layout, base_checksums=chain.checksums, checksums=sums)  # fmt: skip
            data = _delta_bytes(delta)
            self._store(job, DELTA, chain.version, chain.checksums, sums, _cut(data, self.chunk_bytes), len(data))
        anchored = chain is None or job.version - chain.anchor >= self.anchor_every
        if anchored:
            chunks = _transfer_chunks(job.tensors, job.layout, self.chunk_bytes)
            self._store(job, ANCHOR, None, None, sums, chunks, job.layout.total_bytes)
        last_anchor = job.version if anchored or chain is None else chain.anchor
        self._chains[key] = _Chain(job.version, last_anchor, job.layout, job.tensors, sums)
        if anchored and self.keep_anchors:
            self._retain(job.model, job.shard)

    def _store(
        self,
        job: _Job,
        kind: str,
        base: int | None,
        base_sums: tuple[int, ...] | None,
        sums: tuple[int, ...],
        pieces: Iterable[memoryview | bytes],
        nbytes: int,
    ) -> None:
        names: list[str] = []
        reused: dict[str, memoryview | bytes] = {}
        for piece in pieces:
            name, written = self.bucket.put_chunk(piece)
            names.append(name)
            if not written:
                reused[name] = piece
        m = Manifest(job.model, job.version, job.shard, kind, base, job.layout, sums, base_sums, tuple(names), nbytes,
                     self.chunk_bytes, SHARD_BYTES if kind == ANCHOR else TRL_DELTA, time.time())  # fmt: skip
        self.bucket.put_manifest(m)
        # A concurrent collection may have deleted a chunk found there before the manifest
        # referenced it: put back any that went missing.
        for name, piece in reused.items():
            if not self.bucket.has_chunk(name):
                self.bucket.put_chunk(piece, name)

    def _retain(self, model: str, shard: int) -> None:
        entries = self.bucket.entries(model, shard)
        anchors = [v for v, kinds in entries.items() if ANCHOR in kinds]
        if len(anchors) <= self.keep_anchors:
            return
        oldest = anchors[-self.keep_anchors]
        doomed = [
            self.bucket.manifest(model, v, shard, kind)
            for v, kinds in entries.items()
            for kind in sorted(kinds)
            if v < oldest or (v == oldest and kind == DELTA)
        ]
        self.bucket.delete_manifests(doomed)
        self.bucket.collect(c for m in doomed for c in m.chunks)


# --- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Restored:
    """What :meth:`BucketReader.restore` did.

    Attributes:
        model, version, shard: what the tensors now hold (verified).
        anchor: the anchor's version it started from, or None when it applied deltas to the
            base the tensors held (or did nothing).
        deltas: ``(base, version)`` of each delta applied, in order.
        nbytes: object bytes fetched from the bucket.
        checksums: the version's checksums (what a holder of it declares).
    """

    model: str
    version: int
    shard: int
    anchor: int | None
    deltas: tuple[tuple[int, int], ...]
    nbytes: int
    checksums: tuple[int, ...]


class BucketReader:
    """Restores versions of shards from a bucket into registered tensors, verified.

    Args:
        bucket: a :class:`Bucket` or its URL.
        storage_options: for the URL's file system.
    """

    def __init__(self, bucket: Bucket | str, *, storage_options: Mapping[str, Any] | None = None) -> None:
        self.bucket = _bucket(bucket, storage_options)

    def list(self, model: str) -> dict[int, tuple[int, ...]]:
        """``{version: (shard_idx, ...)}``: the shards of ``model`` the bucket has an object of,
        per version (whether a restore succeeds also needs the chain behind it)."""
        out: dict[int, set[int]] = {}
        for shard in self.bucket.shards(validate_model(model)):
            for v in self.bucket.entries(model, shard):
                out.setdefault(v, set()).add(shard)
        return {v: tuple(sorted(s)) for v, s in sorted(out.items())}

    def versions(self, model: str, shard_idx: int) -> builtins.list[int]:
        """The versions of one shard the bucket has an object of, ascending."""
        return list(self.bucket.entries(validate_model(model), shard_idx))

    def route(
        self, model: str, version: int, shard_idx: int, *, held: int | None = None
    ) -> tuple[Manifest | None, tuple[Manifest, ...]]:
        """The objects a restore of ``version`` fetches: ``(anchor, deltas)``; the anchor is None
        when the deltas start at ``held`` (that chain exists and is fewer bytes).

        Raises:
            VersionUnavailable: the bucket cannot make ``version`` (naming what is missing).
        """
        model = validate_model(model)
        ctx: dict[str, Any] = {"model": model, "version": version, "shard": shard_idx}
        entries = self.bucket.entries(model, shard_idx)
        if version not in entries:
            have = list(entries)
            held_text = f"versions {have[0]}..{have[-1]}" if have else "no version"
            raise VersionUnavailable(f"bucket {self.bucket.url} has no object of this version (it holds {held_text} "
                                     f"of this shard)", **ctx)  # fmt: skip
        from_held = self._chain_from(model, version, shard_idx, held, entries) if held is not None else None
        try:
            anchor, deltas = self._anchor_route(model, version, shard_idx, entries, ctx)
        except VersionUnavailable:
            if from_held is None:
                raise
            return None, from_held
        if from_held is not None and sum(m.nbytes for m in from_held) < anchor.nbytes + sum(m.nbytes for m in deltas):
            return None, from_held
        return anchor, deltas

    def _chain_from(
        self, model: str, version: int, shard: int, held: int, entries: Mapping[int, frozenset[str]]
    ) -> tuple[Manifest, ...] | None:
        chain: list[Manifest] = []
        cur = version
        while cur > held:
            if DELTA not in entries.get(cur, ()):
                return None
            m = self.bucket.manifest(model, cur, shard, DELTA)
            chain.append(m)
            assert m.base is not None
            cur = m.base
        return tuple(reversed(chain)) if cur == held and chain else None

    def _anchor_route(
        self, model: str, version: int, shard: int, entries: Mapping[int, frozenset[str]], ctx: dict[str, Any]
    ) -> tuple[Manifest, tuple[Manifest, ...]]:
        chain: list[Manifest] = []
        cur = version
        while True:
            kinds = entries.get(cur, frozenset())
            if ANCHOR in kinds:
                return self.bucket.manifest(model, cur, shard, ANCHOR), tuple(reversed(chain))
            if DELTA not in kinds:
                raise VersionUnavailable(f"bucket {self.bucket.url} cannot make this version: version {cur} of its "
                                         f"chain is gone (retention) and no anchor is after it", **ctx)  # fmt: skip
            m = self.bucket.manifest(model, cur, shard, DELTA)
            chain.append(m)
            assert m.base is not None
            cur = m.base

    def restore(
        self,
        model: str,
        version: int,
        shard_idx: int,
        into: Mapping[str, torch.Tensor],
        *,
        held: int | None = None,
        held_checksums: Sequence[int] | None = None,
        fallback: bool = True,
    ) -> Restored:
        """Make ``into`` (registered tensors, CPU or CUDA) hold ``version`` of one shard, in
        place, verified against the version's checksums.

        Args:
            into: the shard's tensors, of the bucket's layout (names, dtypes, shapes).
            held: the version the tensors hold now, if any: only the deltas ``held -> version``
                are fetched and applied when that chain is in the bucket and smaller than the
                anchor route.
            held_checksums: the checksums the tensors are known to hold (verified when they got
                them); else they are hashed to check they hold ``held``.
            fallback: when the deltas from ``held`` fail (the tensors do not hold ``held``, a
                delta is missing or corrupt, or the result does not verify), restore from the
                anchor instead of raising.

        Returns:
            What was fetched and applied.

        Raises:
            VersionUnavailable: the bucket cannot make the version, or a chunk or manifest it
                needs is missing (naming it).
            ChecksumMismatch: a chunk is corrupt (naming it), or the result does not verify.
            BaseMismatch: the tensors do not hold ``held`` and ``fallback`` is False (nothing
                was written).
            Without ``fallback``, any of these from the deltas after ``held``; a missing or
            corrupt delta is found before any byte changed.
            LayoutMismatch: ``into`` is not of the bucket's layout (nothing was written).
            MalformedMessage: a manifest or delta file is malformed (naming it).
            TransportError: the file system failed.
            After a failure past the first write (a corrupt anchor chunk, a failed
            verification) the tensors hold no version: treat them as empty.
        """
        model = validate_model(model)
        version = validate_version(version, model=model, shard=shard_idx)
        ctx: dict[str, Any] = {"model": model, "version": version, "shard": shard_idx}
        if held is not None and held == version and held_checksums is not None:
            m = self._any_manifest(model, version, shard_idx, ctx)
            if tuple(held_checksums) == m.checksums:
                _check_into(into, m.layout, ctx)
                return Restored(model, version, shard_idx, None, (), 0, m.checksums)
        anchor, chain = self.route(
            model, version, shard_idx, held=held if held is not None and held < version else None
        )
        layout = (anchor or chain[0]).layout
        ordered = _check_into(into, layout, ctx)
        if anchor is None:
            try:
                deltas = self._fetch_deltas(chain, ctx)
                apply_chain(ordered, deltas, held_checksums=held_checksums, ctx={"model": model, "shard": shard_idx})
            except (VersionError, ChecksumMismatch, MalformedMessage):
                # a wrong base or a bad delta (refused before any write), or a result that did not
                # verify (the tensors hold no version): the anchor route rewrites every byte
                if not fallback:
                    raise
                anchor, chain = self._anchor_route(
                    model, version, shard_idx, self.bucket.entries(model, shard_idx), ctx
                )
            else:
                return Restored(model, version, shard_idx, None, tuple((d.base, d.version) for d in chain if d.base is not None),
                                sum(m.nbytes for m in chain), chain[-1].checksums)  # fmt: skip
        deltas = self._fetch_deltas(chain, ctx)
        self._load_anchor(anchor, ordered, ctx)
        apply_chain(ordered, deltas, held_checksums=anchor.checksums, ctx={"model": model, "shard": shard_idx})
        last = chain[-1] if chain else anchor
        return Restored(model, version, shard_idx, anchor.version, tuple((m.base, m.version) for m in chain if m.base is not None),
                        anchor.nbytes + sum(m.nbytes for m in chain), last.checksums)  # fmt: skip

    def _any_manifest(self, model: str, version: int, shard: int, ctx: dict[str, Any]) -> Manifest:
        kinds = self.bucket.entries(model, shard).get(version)
        if not kinds:
            raise VersionUnavailable(f"bucket {self.bucket.url} has no object of this version", **ctx)
        return self.bucket.manifest(model, version, shard, min(kinds))

    def _fetch(self, m: Manifest, ctx: dict[str, Any]) -> Iterator[bytes]:
        sized = [(name, min(m.chunk_bytes, m.nbytes - k * m.chunk_bytes)) for k, name in enumerate(m.chunks)]
        return self.bucket.get_chunks(sized, {**ctx, "version": m.version})

    def _fetch_deltas(self, chain: Sequence[Manifest], ctx: dict[str, Any]) -> builtins.list[Delta]:
        out = []
        for m in chain:
            key = self.bucket.manifest_key(m.model, m.version, m.shard, m.kind)
            delta = _delta_from_bytes(b"".join(self._fetch(m, ctx)), m.layout, key)
            if (delta.base, delta.version, delta.checksums, delta.base_checksums) != (
                m.base,
                m.version,
                m.checksums,
                m.base_checksums,
            ):
                raise ChecksumMismatch(f"bucket object {key}: the delta file is not the one its manifest describes",
                                       **{**ctx, "version": m.version})  # fmt: skip
            out.append(delta)
        return out

    def _load_anchor(self, m: Manifest, tensors: dict[str, torch.Tensor], ctx: dict[str, Any]) -> None:
        ctx = {**ctx, "version": m.version}
        buffers = ShardBuffers(tensors, m.layout, packs_in_place=True)
        pos = 0
        for data in self._fetch(m, ctx):
            buffers.copy_in(pos, memoryview(data))
            pos += len(data)
        if buffers.packed:  # tiny CUDA tensors landed in a pack buffer (what is hashed below)
            buffers.unpack()
        bad = checksum.first_mismatch(buffers, range(len(m.checksums)), m.checksums)
        if bad is not None:
            u = plan_of(m.layout).units[bad]
            raise ChecksumMismatch(f"bucket {self.bucket.url}: the anchor of version {m.version} does not verify: "
                                   f"tensor {m.layout.tensors[u.tensor].name!r} does not match its checksum; the "
                                   f"tensors hold no version", **ctx)  # fmt: skip
