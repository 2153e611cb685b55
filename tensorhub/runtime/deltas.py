"""Deltas on tensors: computed bit-exactly, applied in place, verified against checksums.

Theory of operation
-------------------
A :class:`Delta` takes one shard's tensors from version ``base`` to ``version``. It holds, for
each tensor that changed, a :class:`TensorDelta`: ``sparse`` (int32 flat element indices,
strictly ascending, and the new values there) or ``dense`` (the new values whole), whichever is
fewer bytes (:func:`tensorhub.core.deltas.encoding_for`: sparse while fewer than
``itemsize / (4 + itemsize)`` of the elements changed, a third for bf16). Values are new values,
never differences.

- **Bit-exact.** Tensors are compared, gathered and written as their raw bits (integers of the
  element's width, :func:`bits_of`), never as floats: a NaN payload, ``-0.0`` against ``0.0``,
  an FP8 or a complex value is a change exactly when its bytes changed, and applying writes the
  very bytes the target had. The comparison runs in slices of :data:`SCAN_ELEMENTS` elements,
  so its transient mask stays small whatever the tensor's size.
- **In place.** :func:`apply_delta` writes into the caller's tensors (a handle's registered
  buffers) with ``index_copy_`` (sparse) or ``copy_`` (dense): no second full buffer. Values may
  live on another device than the tensors (a delta read from a file onto CUDA buffers).
- **Checked before, verified after.** A delta records the checksums of its base and of its
  target, one per checksum unit of its layout, by :mod:`tensorhub.runtime.checksum` (the same
  values a holder declares to the server). Before any byte changes, apply checks the delta
  itself (indices in range and ascending, values of the right dtype and count) and that the
  tensors hold the base (their checksums, or the ``held_checksums`` the caller already verified
  for them, equal the base's); a wrong base is refused with
  :class:`~tensorhub.errors.BaseMismatch` naming the tensors that differ, leaving the tensors
  untouched. The units no entry writes keep the base's bytes, so the delta's own checksums must
  say they do not change (else it is refused, still before writing). After writing, it verifies
  the units the delta wrote against the target's checksums; a mismatch raises
  :class:`~tensorhub.errors.ChecksumMismatch` naming the tensor. A delta without base checksums
  (a file written elsewhere) is applied on trust and verified whole, if it has target checksums.
- **Chains.** :func:`apply_chain` checks that the deltas link (each base is the previous
  version, each base's checksums are the previous target's) before touching anything, applies
  them in order and verifies once, at the end. :func:`squash` folds a chain into one delta
  ``first base -> last version`` (later values win).

Never: mutate a tensor before the checks pass; present tensors that failed verification as the
target. A failure after the first write (a verification mismatch, a device error) leaves the
tensors holding neither version: the caller treats them as empty (and pulls in full). The
decisions about *when* to use a delta are the core's (:func:`tensorhub.core.deltas.plan_pull`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorhub.core.deltas import DENSE, SPARSE, DeltaStep, encoding_for
from tensorhub.core.errors import BaseMismatch, ChecksumMismatch, InvalidArgument, LayoutMismatch
from tensorhub.core.layout import DTYPE_SIZES, Layout, TensorSpec, plan_of
from tensorhub.transports.buffers import ShardBuffers, layout_of

from . import checksum

__all__ = [
    "SCAN_ELEMENTS",
    "Delta",
    "TensorDelta",
    "apply_chain",
    "apply_delta",
    "bits_of",
    "changed_indices",
    "check_specs",
    "compare_and_refresh",
    "compute_delta",
    "describe",
    "shard_checksums",
    "squash",
]

#: Elements compared per slice when looking for changes (bounds the transient mask).
SCAN_ELEMENTS = 1 << 24
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"{name!r} is not a torch dtype")
    return dtype


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of contiguous ``t``, flat, as integers of the element's width (shares its
    memory): shape ``(numel,)``, or ``(numel, words)`` of int64 for 16-byte elements."""
    size = t.element_size()
    flat = t.detach().reshape(-1)
    word = _WORDS.get(size)
    if word is not None:
        return flat.view(word)
    if size % 8 == 0:
        return flat.view(torch.int64).view(-1, size // 8)
    raise InvalidArgument(f"elements of {size} bytes have no integer view")


def _from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return bits.reshape(-1).view(dtype)


def _bits_from_bytes(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Flat uint8 ``raw`` as the integer bits of ``dtype`` (a copy when not aligned for them)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if raw.data_ptr() % size:
        raw = raw.clone()
    return raw.view(_WORDS[size] if size in _WORDS else torch.int64)


def changed_indices(base: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The flat indices (int64, ascending, on the target's device) of the elements whose bytes
    differ between ``base`` and ``target`` (same dtype and shape, contiguous; the same device,
    or ``base`` in CPU memory and ``target`` on a GPU: then each slice of ``base`` is copied to
    the GPU and compared there, so a pinned snapshot of a GPU tensor costs one host-to-device
    pass and no comparison on the CPU)."""
    a, b = bits_of(base), bits_of(target)
    n = a.shape[0]
    found = []
    moved = a.device != b.device
    for start in range(0, n, SCAN_ELEMENTS):
        piece = a[start : start + SCAN_ELEMENTS]
        if moved:
            piece = piece.to(b.device, non_blocking=True)
        ne = piece != b[start : start + SCAN_ELEMENTS]
        if ne.dim() == 2:
            ne = ne.any(dim=1)
        idx = ne.nonzero().reshape(-1)
        if idx.numel():
            found.append(idx + start if start else idx)
    if not found:
        return torch.empty(0, dtype=torch.int64, device=base.device)
    return found[0] if len(found) == 1 else torch.cat(found)


@dataclass(frozen=True, eq=False, slots=True)
class TensorDelta:
    """One tensor's part of a delta.

    Attributes:
        name: the tensor's name in the layout.
        encoding: ``"sparse"`` or ``"dense"``.
        changed: how many elements changed (for an imported dense entry, all of them).
        values: 1-D, the tensor's dtype: the new values at ``indices`` (sparse), or the whole
            new tensor, flat (dense).
        indices: 1-D int32, strictly ascending flat element indices (sparse; None for dense).
    """

    name: str
    encoding: str
    changed: int
    values: torch.Tensor
    indices: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.encoding not in (SPARSE, DENSE):
            raise InvalidArgument(f"tensor {self.name!r}: unknown delta encoding {self.encoding!r}")
        if (self.indices is None) != (self.encoding == DENSE):
            raise InvalidArgument(f"tensor {self.name!r}: a sparse entry has indices, a dense one none")

    @property
    def nbytes(self) -> int:
        """The entry's bytes: values, plus indices when sparse."""
        n = self.values.numel() * self.values.element_size()
        if self.indices is not None:
            n += self.indices.numel() * self.indices.element_size()
        return n


@dataclass(frozen=True, eq=False)
class Delta:
    """One shard's delta from version ``base`` to ``version``.

    Attributes:
        layout: the shard's layout (both versions have it); it fixes the checksum units.
        base: the version it applies to (None: unknown, e.g. a file that does not say).
        version: the version it makes.
        tensors: the entries of the tensors that changed, in layout order.
        base_checksums: the base's checksum per unit of ``layout`` (None: unknown).
        checksums: the target's checksum per unit of ``layout`` (None: unknown).
    """

    layout: Layout
    base: int | None
    version: int
    tensors: tuple[TensorDelta, ...]
    base_checksums: tuple[int, ...] | None = None
    checksums: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        index = {t.name: i for i, t in enumerate(self.layout.tensors)}
        seen: set[str] = set()
        for e in self.tensors:
            if e.name not in index:
                raise LayoutMismatch(
                    f"the delta has tensor {e.name!r}, which its layout does not", version=self.version
                )
            if e.name in seen:
                raise InvalidArgument(f"the delta has tensor {e.name!r} twice", version=self.version)
            seen.add(e.name)
        object.__setattr__(self, "tensors", tuple(sorted(self.tensors, key=lambda e: index[e.name])))
        n = self.layout.checksum_count()
        for what, sums in (("base", self.base_checksums), ("target", self.checksums)):
            if sums is not None and len(sums) != n:
                raise InvalidArgument(
                    f"{len(sums)} {what} checksums for a layout of {n} checksum units", version=self.version
                )

    @property
    def total_elements(self) -> int:
        """Elements of the whole shard."""
        return sum(math.prod(t.shape) for t in self.layout.tensors)

    @property
    def changed_elements(self) -> int:
        return sum(e.changed for e in self.tensors)

    @property
    def sparsity(self) -> float:
        """The fraction of the shard's elements left unchanged (TRL's ``sparsity``)."""
        total = self.total_elements
        return 1.0 - self.changed_elements / total if total else 1.0

    @property
    def nbytes(self) -> int:
        """The bytes a reader pulls: every entry's indices and values."""
        return sum(e.nbytes for e in self.tensors)

    @property
    def full_bytes(self) -> int:
        """The bytes of a full pull of the shard."""
        return self.layout.total_bytes

    def step(self) -> DeltaStep:
        """What the core plans with: ``base -> version`` in :attr:`nbytes`.

        Raises:
            InvalidArgument: the base is unknown.
        """
        if self.base is None:
            raise InvalidArgument("a delta of unknown base is no step of a chain", version=self.version)
        return DeltaStep(self.base, self.version, self.nbytes)

    def check(self, ctx: dict | None = None) -> None:
        """Check every entry against the layout: dtype, counts, indices in range and strictly
        ascending. Reads the indices once (a device sync for CUDA ones).

        Raises:
            InvalidArgument: naming the first bad tensor.
        """
        ctx = {"version": self.version, **(ctx or {})}
        specs = {t.name: t for t in self.layout.tensors}
        for e in self.tensors:
            spec = specs[e.name]
            numel = math.prod(spec.shape)
            dtype = _torch_dtype(spec.dtype)
            if e.values.dtype != dtype or e.values.dim() != 1:
                raise InvalidArgument(f"tensor {e.name!r}: delta values are {e.values.dtype}{list(e.values.shape)}, "
                                      f"not 1-D {dtype}", **ctx)  # fmt: skip
            if e.encoding == DENSE:
                if e.values.numel() != numel:
                    raise InvalidArgument(
                        f"tensor {e.name!r}: a dense delta of {e.values.numel()} values for {numel} elements", **ctx
                    )
                continue
            idx = e.indices
            assert idx is not None
            if idx.dtype != torch.int32 or idx.dim() != 1 or idx.numel() != e.values.numel():
                raise InvalidArgument(f"tensor {e.name!r}: delta indices are {idx.dtype}{list(idx.shape)} for "
                                      f"{e.values.numel()} values (want 1-D int32, one per value)", **ctx)  # fmt: skip
            if not idx.numel():
                continue
            if int(idx[0]) < 0 or int(idx[-1]) >= numel or (idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all())):
                raise InvalidArgument(
                    f"tensor {e.name!r}: delta indices must be strictly ascending, in [0, {numel})", **ctx
                )


# --- checksums --------------------------------------------------------------------------------


def _ordered(tensors: Mapping[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    return {t.name: tensors[t.name] for t in layout.tensors}


def check_specs(tensors: Mapping[str, torch.Tensor], layout: Layout, ctx: dict, whose: str = "the delta's") -> None:
    """Raise LayoutMismatch naming the first tensor whose name, dtype or shape is not the layout's
    (``whose`` layout, in the message), InvalidArgument for one that is not contiguous."""
    names = {t.name for t in layout.tensors}
    extra = [n for n in tensors if n not in names]
    if extra:
        raise LayoutMismatch(f"tensor {extra[0]!r} is not in {whose} layout", **ctx)
    for spec in layout.tensors:
        t = tensors.get(spec.name)
        if t is None:
            raise LayoutMismatch(f"tensor {spec.name!r} of {whose} layout is missing", **ctx)
        got = (str(t.dtype).removeprefix("torch."), tuple(t.shape))
        if got != (spec.dtype, spec.shape):
            raise LayoutMismatch(f"tensor {spec.name!r} is {got[0]}{list(got[1])}, {whose} layout says "
                                 f"{spec.dtype}{list(spec.shape)}", **ctx)  # fmt: skip
        if not t.is_contiguous():
            raise InvalidArgument(f"tensor {spec.name!r} is not contiguous", **ctx)


def _buffers(tensors: Mapping[str, torch.Tensor], layout: Layout) -> ShardBuffers:
    buffers = ShardBuffers(_ordered(tensors, layout), layout, packs_in_place=True)
    if buffers.packed:  # tiny CUDA tensors go through a pack buffer: fill it first
        buffers.pack()
    return buffers


def shard_checksums(tensors: Mapping[str, torch.Tensor], layout: Layout | None = None) -> tuple[int, ...]:
    """The checksum of every unit of ``layout`` (default: the tensors' own layout, in the dict's
    order), from the tensors' bytes: the values a holder of these bytes declares. Blocking."""
    layout = layout or layout_of(dict(tensors))
    return tuple(checksum.compute(_buffers(tensors, layout)))


def _unit_name(layout: Layout, unit: int) -> str:
    u = plan_of(layout).units[unit]
    return layout.tensors[u.tensor].name


# --- compute ----------------------------------------------------------------------------------


def compute_delta(
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    *,
    base_version: int | None,
    version: int,
    layout: Layout | None = None,
    base_checksums: Sequence[int] | None = None,
    checksums: Sequence[int] | None = None,
    with_checksums: bool = True,
) -> Delta:
    """The delta that takes ``base`` to ``target``, tensor by tensor, comparing raw bits.

    Args:
        base, target: the two versions' tensors (same names, dtypes and shapes; contiguous; the
            same device per tensor, or a CPU base of a GPU target: compared on the GPU, see
            :func:`changed_indices`). Neither is modified; the delta's values are new tensors on
            the target's devices.
        base_version, version: the versions they are.
        layout: the shard's layout (it fixes the checksum units); default: the target's own.
        base_checksums, checksums: the versions' checksums when already known (a publisher
            has them); else computed here when ``with_checksums``.
        with_checksums: compute the missing checksums (one hashing pass over each version).

    Returns:
        The delta; unchanged tensors have no entry.

    Raises:
        LayoutMismatch: the two versions' tensors differ in name, dtype or shape (naming it).
    """
    layout = layout or layout_of(dict(target))
    ctx: dict[str, Any] = {"version": version}
    check_specs(target, layout, ctx)
    check_specs(base, layout, {"version": base_version})
    entries = []
    for spec in layout.tensors:
        a, b = base[spec.name], target[spec.name]
        if a.device != b.device and not (a.device.type == "cpu" and b.device.type == "cuda"):
            raise InvalidArgument(f"tensor {spec.name!r}: base on {a.device}, target on {b.device}", **ctx)
        idx = changed_indices(a, b)
        k = idx.numel()
        if not k:
            continue
        numel = b.numel()
        if encoding_for(k, numel, DTYPE_SIZES[spec.dtype]) == SPARSE:
            values = _from_bits(bits_of(b).index_select(0, idx), b.dtype)
            entries.append(TensorDelta(spec.name, SPARSE, k, values, idx.to(torch.int32)))
        else:
            entries.append(TensorDelta(spec.name, DENSE, k, _from_bits(bits_of(b).clone(), b.dtype)))
    if with_checksums:
        base_checksums = base_checksums if base_checksums is not None else shard_checksums(base, layout)
        checksums = checksums if checksums is not None else shard_checksums(target, layout)
    return Delta(
        layout, base_version, version, tuple(entries),
        tuple(base_checksums) if base_checksums is not None else None,
        tuple(checksums) if checksums is not None else None,
    )  # fmt: skip


#: bytes of the staging slot of :func:`compare_and_refresh` on the device (one slice of the snapshot)
STREAM_SLOT_BYTES = 32 << 20
#: elements whose "changed" flags :func:`compare_and_refresh` collects before one readback
STREAM_WINDOW_ELEMENTS = 1 << 26


def compare_and_refresh(
    snapshot: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    *,
    base_version: int | None,
    version: int,
    layout: Layout | None = None,
    base_checksums: Sequence[int] | None = None,
    checksums: Sequence[int] | None = None,
    slot_bytes: int = STREAM_SLOT_BYTES,
    window_elements: int = STREAM_WINDOW_ELEMENTS,
) -> Delta:
    """The delta ``snapshot -> target`` with its values in CPU memory, and ``snapshot`` brought to
    ``target``'s bytes in place: a publisher's compare against its host snapshot of GPU tensors.

    The snapshot (CPU memory, pinned for GPU targets) is copied to the target's device slice by
    slice (slices of at most ``slot_bytes``, into one staging slot) and compared there, on a side
    stream: the caller's stream (a trainer's next step) neither waits for it nor delays it, and
    the host enqueues slice after slice without waiting for the device. The slices' "changed"
    flags gather in a window mask read back once per window (one ``nonzero``); then the target's
    bytes of the window's slices go out over the snapshot on a second stream, while the next
    window's slices come in (the two directions of the bus at once), so the snapshot holds
    ``target`` when this returns. Only the changed values and their indices come back, all
    tensors' at once. For CPU targets the same steps run in order, on the CPU.

    Args:
        snapshot: the base, CPU tensors (same names, dtypes, shapes as ``target``; contiguous).
            Overwritten with ``target``'s bytes.
        target: the version to reach (its tensors are only read; their bytes must be final on
            the device: the side streams do not wait for work queued on the caller's stream,
            which a publisher's next step may already fill; its checksums were computed first).
        base_version, version, layout, base_checksums, checksums: as :func:`compute_delta`
            (checksums are not computed here).
        slot_bytes: bytes of the staging slot (the largest slice).
        window_elements: elements whose flags are collected before one readback of the changed
            indices (at least one slice's: a mask of this many bytes on the device).

    Returns:
        The delta, equal entry for entry to :func:`compute_delta`'s, values and indices on the CPU.

    Raises:
        LayoutMismatch: the two differ in name, dtype or shape (naming the tensor).
        InvalidArgument: a snapshot tensor not in CPU memory, tensors on several GPUs, or a
            ``slot_bytes`` smaller than one element.
    """
    layout = layout or layout_of(dict(target))
    ctx: dict[str, Any] = {"version": version}
    check_specs(target, layout, ctx)
    check_specs(snapshot, layout, {"version": base_version})
    devices = {target[t.name].device for t in layout.tensors}
    if len(devices) > 1:
        raise InvalidArgument(f"the target's tensors are on {sorted(map(str, devices))}: one device at a time", **ctx)
    bad = [t.name for t in layout.tensors if snapshot[t.name].device.type != "cpu"]
    if bad:
        raise InvalidArgument(f"snapshot tensor {bad[0]!r} is on {snapshot[bad[0]].device}, not in CPU memory", **ctx)
    widest = max((DTYPE_SIZES[t.dtype] for t in layout.tensors), default=1)
    if slot_bytes < widest:
        raise InvalidArgument(f"slot_bytes {slot_bytes} is smaller than one element ({widest} bytes)", **ctx)
    if window_elements < 1:
        raise InvalidArgument(f"window_elements must be at least 1, got {window_elements}", **ctx)
    device = devices.pop() if devices else torch.device("cpu")
    cuda = device.type == "cuda"
    jobs: list[tuple[str, int, int]] = []  # (tensor name, first element, end element): at most a slot each
    for spec in layout.tensors:
        rows = bits_of(target[spec.name]).shape[0]
        step = max(1, slot_bytes // DTYPE_SIZES[spec.dtype])
        jobs.extend((spec.name, s, min(rows, s + step)) for s in range(0, rows, step))
    # The slot, the comparison and the readbacks run on one side stream (in its order: a slot
    # is written again only once compared); the refresh on another, so that it moves while the
    # next slices come in.
    work = torch.cuda.Stream(device) if cuda else None
    out = torch.cuda.Stream(device) if cuda else None
    with torch.cuda.stream(work) if work is not None else contextlib.nullcontext():
        entries = _compare_slices(snapshot, target, layout, jobs, device, out, window_elements)
        if work is not None and out is not None:
            out.synchronize()
            work.synchronize()
    return Delta(
        layout, base_version, version, tuple(entries),
        tuple(base_checksums) if base_checksums is not None else None,
        tuple(checksums) if checksums is not None else None,
    )  # fmt: skip


def _compare_slices(
    snapshot: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], layout: Layout,
    jobs: list[tuple[str, int, int]], device: torch.device, out: Any, window_elements: int,
) -> list[TensorDelta]:  # fmt: skip
    """:func:`compare_and_refresh`'s work, on the current stream (``out``: the refresh's stream,
    None on the CPU)."""
    if not jobs:
        return []
    width = {spec.name: bits_of(target[spec.name]) for spec in layout.tensors}
    slot = torch.empty(max((hi - lo) * width[n][lo:hi].element_size() * (width[n].shape[1] if width[n].dim() == 2 else 1)
                           for n, lo, hi in jobs), dtype=torch.uint8, device=device)  # fmt: skip
    # Each slice's "changed" flags go into a window mask (nothing read back per slice): one
    # nonzero() per window, then the indices cut by slice with one small readback of the cuts.
    window = max(min(window_elements, sum(hi - lo for _, lo, hi in jobs)), *(hi - lo for _, lo, hi in jobs))
    mask = torch.empty(window, dtype=torch.bool, device=device)
    found: dict[str, list[torch.Tensor]] = {}
    placed: list[tuple[str, int, int, int]] = []  # in the window: (tensor, first element, at, count)

    def flush() -> None:
        at = placed[-1][2] + placed[-1][3]
        # The window's slices of the snapshot have come in: the target's bytes go over them.
        if out is not None:
            came_in = torch.cuda.Event()
            came_in.record(torch.cuda.current_stream(device))
            out.wait_event(came_in)
        with torch.cuda.stream(out) if out is not None else contextlib.nullcontext():
            for name, lo, _, n in placed:
                bits_of(snapshot[name])[lo : lo + n].copy_(width[name][lo : lo + n], non_blocking=True)
        idx = mask[:at].nonzero().reshape(-1)  # waits for its count
        starts = torch.tensor([p[2] for p in placed] + [at], dtype=torch.int64, device=device)
        bounds = torch.searchsorted(idx, starts).tolist()
        for (name, lo, pos, _), b0, b1 in zip(placed, bounds, bounds[1:]):
            if b1 > b0:
                found.setdefault(name, []).append(idx[b0:b1] - (pos - lo))
        placed.clear()

    for name, lo, hi in jobs:
        at = placed[-1][2] + placed[-1][3] if placed else 0
        if at + (hi - lo) > window:
            flush()
            at = 0
        old, cur = bits_of(snapshot[name])[lo:hi], width[name][lo:hi]
        prev = slot[: old.numel() * old.element_size()].view(old.dtype).view(old.shape)
        prev.copy_(old, non_blocking=True)
        flags = mask[at : at + (hi - lo)]
        if cur.dim() == 2:
            flags.copy_((prev != cur).any(dim=1))
        else:
            torch.ne(prev, cur, out=flags)
        placed.append((name, lo, at, hi - lo))
    flush()
    # The changed values of the sparse tensors gathered on the device, read back in one go.
    entries: list[TensorDelta | None] = []
    sparse: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (entry, indices, raw bytes of the values)
    named: list[str] = []
    for spec in layout.tensors:
        parts = found.get(spec.name)
        if not parts:
            continue
        named.append(spec.name)
        k, numel = sum(p.numel() for p in parts), target[spec.name].numel()
        if encoding_for(k, numel, DTYPE_SIZES[spec.dtype]) == SPARSE:
            idx = parts[0] if len(parts) == 1 else torch.cat(parts)
            sparse.append((len(entries), idx.to(torch.int32), width[spec.name].index_select(0, idx).reshape(-1).view(torch.uint8)))
            entries.append(None)
        else:  # the refreshed snapshot holds the values
            if out is not None:
                out.synchronize()
            dtype = target[spec.name].dtype
            entries.append(TensorDelta(spec.name, DENSE, k, _from_bits(bits_of(snapshot[spec.name]).clone(), dtype)))
    if sparse:
        all_idx = torch.cat([i for _, i, _ in sparse]).cpu()
        all_vals = torch.cat([v for _, _, v in sparse]).cpu()
        i = v = 0
        for e, idx, vals in sparse:
            n, nb = idx.numel(), vals.numel()
            dtype = target[named[e]].dtype
            entries[e] = TensorDelta(named[e], SPARSE, n, _from_bits(_bits_from_bytes(all_vals[v : v + nb], dtype), dtype),
                                     all_idx[i : i + n])  # fmt: skip
            i, v = i + n, v + nb
    return [e for e in entries if e is not None]


# --- apply ------------------------------------------------------------------------------------


def _link(prev: Delta, nxt: Delta, ctx: dict) -> None:
    """Raise unless ``nxt`` applies to what ``prev`` makes."""
    if tuple(prev.layout.tensors) != tuple(nxt.layout.tensors) or prev.layout.chunk_bytes != nxt.layout.chunk_bytes:
        raise LayoutMismatch(
            f"the deltas {prev.base} -> {prev.version} and {nxt.base} -> {nxt.version} have different layouts", **ctx
        )
    if nxt.base is not None and nxt.base != prev.version:
        raise BaseMismatch(
            f"{_what(nxt)} does not follow {_what(prev)}: it applies to version {nxt.base}, not {prev.version}", **ctx
        )
    if nxt.base_checksums is not None and prev.checksums is not None and nxt.base_checksums != prev.checksums:
        names = _differing(nxt.layout, prev.checksums, nxt.base_checksums)
        raise BaseMismatch(f"{_what(nxt)} is not based on what {_what(prev)} makes: "
                           f"tensor {names[0]!r} differs", tensors=names, **ctx)  # fmt: skip


def _what(d: Delta) -> str:
    """A delta in words: an anchor loaded as a chain's first link has no base."""
    return f"the anchor of version {d.version}" if d.base is None else f"the delta {d.base} -> {d.version}"


def _differing(layout: Layout, have: Sequence[int], want: Sequence[int]) -> tuple[str, ...]:
    names: dict[str, None] = {}
    for i, (a, b) in enumerate(zip(have, want)):
        if a != b:
            names[_unit_name(layout, i)] = None
    return tuple(names)


def _touched_units(delta: Delta) -> set[int]:
    """The checksum units of ``delta.layout`` whose bytes the delta may write."""
    plan = plan_of(delta.layout)
    first: dict[int, int] = {}
    for u in plan.units:
        first.setdefault(u.tensor, u.index)
    index = {t.name: i for i, t in enumerate(delta.layout.tensors)}
    chunk = delta.layout.chunk_bytes
    out: set[int] = set()
    for e in delta.tensors:
        i = index[e.name]
        spec = delta.layout.tensors[i]
        units = max(1, -(-spec.nbytes // chunk))
        if e.encoding == DENSE or units == 1:
            out.update(range(first[i], first[i] + units))
            continue
        assert e.indices is not None
        size = DTYPE_SIZES[spec.dtype]
        hit = torch.unique(e.indices.to(torch.int64) * size // chunk).tolist()
        out.update(first[i] + int(k) for k in hit)
    return out


def _write(tensors: Mapping[str, torch.Tensor], delta: Delta) -> None:
    cuda = False
    for e in delta.tensors:
        t = tensors[e.name]
        bits = bits_of(t)
        values = bits_of(e.values).to(t.device)
        if e.encoding == DENSE:
            bits.copy_(values.view(bits.shape))
        else:
            assert e.indices is not None
            bits.index_copy_(0, e.indices.to(device=t.device, dtype=torch.int64), values)
        cuda = cuda or t.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()


def apply_chain(
    tensors: Mapping[str, torch.Tensor],
    deltas: Sequence[Delta],
    *,
    held_checksums: Sequence[int] | None = None,
    check_base: bool = True,
    verify: bool = True,
    ctx: dict | None = None,
) -> None:
    """Apply ``deltas`` in order to ``tensors``, in place, then verify the result.

    Args:
        tensors: the shard's tensors (a handle's registered buffers), holding the first delta's
            base; CPU or CUDA.
        deltas: a chain: each one's base is the previous one's version.
        held_checksums: the checksums the tensors are already known to hold (verified when they
            were pulled): the base check compares lists instead of hashing the tensors.
        check_base: refuse tensors that do not hold the first base (when it has checksums).
        verify: verify the result against the last delta's checksums (when it has them).
        ctx: model/replica/shard for the errors' context.

    Raises:
        LayoutMismatch: the tensors or the deltas do not have the deltas' layout (naming the
            tensor). Nothing was written.
        InvalidArgument: a malformed delta (naming the tensor). Nothing was written.
        BaseMismatch: the tensors do not hold the first base, or the chain does not link
            (naming the tensors that differ). Nothing was written.
        ChecksumMismatch: the result is not the last delta's version (naming the tensor). The
            tensors hold neither version: treat them as empty.
    """
    if not deltas:
        return
    ctx = {k: v for k, v in (ctx or {}).items() if k != "version"}  # each error names its own version
    first, last = deltas[0], deltas[-1]
    layout = first.layout
    check_specs(tensors, layout, {"version": first.base, **ctx})
    for prev, nxt in itertools.pairwise(deltas):
        _link(prev, nxt, {"version": nxt.version, **ctx})
    for d in deltas:
        d.check(ctx)
    base_checked = False
    if check_base and first.base_checksums is not None:
        have = tuple(held_checksums) if held_checksums is not None else shard_checksums(tensors, layout)
        if len(have) != len(first.base_checksums):
            raise InvalidArgument(
                f"{len(have)} held checksums for a layout of {len(first.base_checksums)} checksum units", **ctx
            )
        if have != first.base_checksums:
            names = _differing(layout, have, first.base_checksums)
            raise BaseMismatch(f"these tensors do not hold the delta's base version {first.base}: tensor {names[0]!r} differs "
                               f"(nothing was written)", tensors=names, version=first.base, **ctx)  # fmt: skip
        base_checked = True
    expected = last.checksums if verify else None
    units: Iterable[int] = range(len(expected)) if expected is not None else ()
    if expected is not None and base_checked:
        # Units no delta writes keep the base's bytes: the chain must say they do not change.
        touched: set[int] = set()
        for d in deltas:
            touched |= _touched_units(d)
        assert first.base_checksums is not None
        for i, (a, b) in enumerate(zip(first.base_checksums, expected)):
            if i not in touched and a != b:
                raise ChecksumMismatch(f"tensor {_unit_name(layout, i)!r} changes between versions {first.base} and "
                                       f"{last.version} but the deltas do not write it (nothing was written)",
                                       version=last.version, **ctx)  # fmt: skip
        units = sorted(touched)
    for d in deltas:
        _write(tensors, d)
    if expected is None:
        return
    bad = checksum.first_mismatch(_buffers(tensors, layout), units, expected)
    if bad is not None:
        u = plan_of(layout).units[bad]
        name = layout.tensors[u.tensor].name
        if len(deltas) == 1 and first.base is None:  # an anchor alone: its own bytes are wrong
            raise ChecksumMismatch(f"the anchor of version {last.version} is corrupt: tensor {name!r} (bytes {u.start}.."
                                   f"{u.start + u.length}) does not match its checksum", version=last.version, **ctx)  # fmt: skip
        raise ChecksumMismatch(f"after applying {' then '.join(_what(d) for d in deltas)}, tensor {name!r} "
                               f"(bytes {u.start}..{u.start + u.length}) does not match version {last.version}'s checksum: "
                               f"the tensors hold neither version", version=last.version, **ctx)  # fmt: skip


def apply_delta(
    tensors: Mapping[str, torch.Tensor],
    delta: Delta,
    *,
    held_checksums: Sequence[int] | None = None,
    check_base: bool = True,
    verify: bool = True,
    ctx: dict | None = None,
) -> None:
    """Apply one delta in place and verify it: :func:`apply_chain` of one."""
    apply_chain(tensors, [delta], held_checksums=held_checksums, check_base=check_base, verify=verify, ctx=ctx)


# --- chains -----------------------------------------------------------------------------------


def _squash_entries(spec: TensorSpec, entries: list[TensorDelta]) -> TensorDelta:
    dtype = _torch_dtype(spec.dtype)
    # the last dense entry is the tensor whole; the sparse ones after it are laid over it
    k = max((i for i, e in enumerate(entries) if e.encoding == DENSE), default=-1)
    if k >= 0:
        whole = bits_of(entries[k].values).clone()
        for e in entries[k + 1 :]:
            assert e.indices is not None
            whole.index_copy_(
                0, e.indices.to(device=whole.device, dtype=torch.int64), bits_of(e.values).to(whole.device)
            )
        return TensorDelta(spec.name, DENSE, math.prod(spec.shape), _from_bits(whole, dtype))
    device = entries[-1].values.device
    idx = torch.cat([e.indices.to(device=device, dtype=torch.int64) for e in entries if e.indices is not None])
    vals = torch.cat([bits_of(e.values).to(device) for e in entries])
    order = torch.sort(idx, stable=True).indices
    idx, vals = idx[order], vals[order]
    last = torch.ones_like(idx, dtype=torch.bool)  # the last write of each index wins
    last[:-1] = idx[1:] != idx[:-1]
    idx, vals = idx[last], vals[last]
    return TensorDelta(spec.name, SPARSE, idx.numel(), _from_bits(vals, dtype), idx.to(torch.int32))


def squash(deltas: Sequence[Delta]) -> Delta:
    """One delta equal to applying ``deltas`` (a chain) in order: ``first base -> last version``.

    An element changed by several deltas takes the last value; one that changed and changed
    back stays in (applying it is still exact). A tensor that any delta carries dense is dense.

    Raises:
        InvalidArgument: no deltas.
        LayoutMismatch, BaseMismatch: the deltas do not form a chain.
    """
    if not deltas:
        raise InvalidArgument("nothing to squash")
    for prev, nxt in itertools.pairwise(deltas):
        _link(prev, nxt, {"version": nxt.version})
    first, last = deltas[0], deltas[-1]
    by_name: dict[str, list[TensorDelta]] = {}
    for d in deltas:
        for e in d.tensors:
            by_name.setdefault(e.name, []).append(e)
    entries = tuple(_squash_entries(spec, by_name[spec.name]) for spec in first.layout.tensors if spec.name in by_name)
    return Delta(first.layout, first.base, last.version, entries, first.base_checksums, last.checksums)


def describe(delta: Delta) -> dict[str, Any]:
    """A summary for logs and the command line: versions, bytes, sparsity, entries by encoding."""
    return {
        "base": delta.base,
        "version": delta.version,
        "tensors": len(delta.layout.tensors),
        "changed_tensors": len(delta.tensors),
        "sparse": sum(e.encoding == SPARSE for e in delta.tensors),
        "dense": sum(e.encoding == DENSE for e in delta.tensors),
        "changed_elements": delta.changed_elements,
        "total_elements": delta.total_elements,
        "sparsity": delta.sparsity,
        "nbytes": delta.nbytes,
        "full_bytes": delta.full_bytes,
    }
