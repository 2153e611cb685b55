"""The resharding plan: which source bytes each destination shard needs, and what to do with them.

Theory of operation
-------------------
:func:`plan` is a pure function of three declarations: the source replica's layout (every source
shard's tensors with their global shapes and placements, a
:class:`~tensorhub.core.placement.ReplicaLayout`), the destination replica's layout, and the
:class:`~tensorhub.scheduling.mapping.Mapping` between their names. It returns a
:class:`ReshardPlan`: per destination shard, the **tasks** that produce its local tensors. It is
computed once per (source layout, destination layout, mapping), before any byte moves; a mapping
or layout that does not fit is refused then, with a typed error naming the tensors.

A :class:`Task` takes one box (its ``region``) of one source tensor's global index space, brought
by one or more :class:`Read` s, transforms it (``op``: a copy, cast to ``out_dtype``; or FP8 block
quantization), and lands :class:`Output` boxes of the result in destination tensors at given local
indices. Fusion needs no operation of its own: each part of a fused tensor is a task of its own
that lands at its offset in the destination (the write-up's "add an offset"). A quantized weight
and its scale, when the destination shard holds both, come from one task: one quantization, two
outputs (the bundle). Tasks of a quantized weight cover whole 128x128 blocks of the source part
(clipped at its edges), so each block's scale is computed over the same elements as a quantizer
of the whole tensor would.

Reads and segments
~~~~~~~~~~~~~~~~~~
Every holder of a source tensor declares the same placement, so two source shards' pieces of it
are the same box or disjoint: a region splits into one read per distinct piece it meets, which is
the fewest reads any plan can have. A read is a box of one source shard's row-major local tensor,
and its bytes are the box's contiguous **runs** (a ``Shard(1)`` slice of a matrix is one run per
row). Runs are merged, level by level from the innermost, while the hole between two consecutive
ones is at most ``max_gap`` bytes (the holes at a level are all equal, and they only grow outwards,
so this merges whole levels): a 4 -> 8 reshard of a column-sharded matrix reads each source row
whole and the landing side drops the unneeded half, instead of one transfer per half-row. The
result is ``counts`` x ``pitches`` segments of ``length`` bytes each: the fewest segments of any
read that fetches no hole longer than ``max_gap``. Landed back to back, a read's segments are
viewed as the box by the read's ``strides`` (elements): no copy, no hole bytes kept apart from
those inside a segment.

Balancing
~~~~~~~~~
A piece held by several source shards (``Replicate``) can be read from any of them. Reads are
assigned largest first to the candidate whose load (bytes it serves in this plan) ends lowest;
then, while a read on a most loaded shard can move to another candidate and end below the
maximum load (without costing more bytes), it moves. At the end no read on a most loaded shard
can move to a candidate ``t`` with ``load[t] + bytes < max load``: with full replication, the
loads differ by at most one read. Ties go to the lower shard index: plans are deterministic.

Offsets in reads are relative to the source shard's local tensor; the transfer-space offset is
``plan_of(layout).tensor_offset[i] + offset`` for that shard's layout. Plans are wire structs
(msgpack-able through :func:`tensorhub.core.wire.to_plain`). No IO, no torch.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tensorhub.core.errors import InvalidArgument, InvalidPlacement
from tensorhub.core.layout import DTYPE_SIZES, TensorSpec
from tensorhub.core.placement import Box, Piece, ReplicaLayout, _box
from tensorhub.core.wire import struct

from .mapping import COPY, FP8_SCALES, FP8_VALUES, IDENTITY, Derivation, Mapping, resolve

__all__ = [
    "DEFAULT_MAX_GAP",
    "FP8",
    "SCALES",
    "VALUES",
    "Output",
    "Read",
    "ReshardPlan",
    "ShardPlan",
    "Task",
    "plan",
    "segments_of",
]

#: Holes of at most this many bytes between two runs of a read are read through (about the
#: bytes a 25 GB/s link moves in the time one more transfer costs).
DEFAULT_MAX_GAP = 64 << 10
#: Task operations: a copy (cast to ``out_dtype``), FP8 block quantization.
FP8 = "fp8"
#: Output kinds: a task's values, an FP8 task's inverse scales.
VALUES, SCALES = "values", "scales"


@struct
class Read:
    """Bytes of one source shard's local tensor that bring the box ``box`` of the task's region.

    Attributes:
        shard: the source shard index.
        tensor: the source tensor's name.
        box: what it brings, in the source tensor's global indices (inside the task's region).
        start: byte offset of the first segment in that shard's local tensor.
        length: bytes per segment.
        counts, pitches: segments per level and bytes between consecutive segments of each
            level, outermost first (``()``: one segment).
        strides: the box's element strides in the segments landed back to back.
    """

    shard: int
    tensor: str
    box: Box
    start: int
    length: int
    counts: tuple[int, ...]
    pitches: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes fetched (the segments' total, holes inside segments included)."""
        return self.length * math.prod(self.counts)

    @property
    def num_segments(self) -> int:
        return math.prod(self.counts)

    def segments(self) -> Iterator[tuple[int, int]]:
        """``(offset, length)`` of every segment in the local tensor, in landing order."""
        for i in range(self.num_segments):
            off, rest = self.start, i
            for n, pitch in zip(reversed(self.counts), reversed(self.pitches)):
                rest, r = divmod(rest, n)
                off += r * pitch
            yield off, self.length


@struct
class Output:
    """A box of a task's result landing in a destination tensor.

    Attributes:
        tensor: the destination tensor (of this destination shard).
        kind: :data:`VALUES`, or :data:`SCALES` for an FP8 task's inverse scales.
        take: the box of the result, relative to the task's region (scales: in blocks).
        at: the destination local index where ``take``'s first element lands.
    """

    tensor: str
    kind: str
    take: Box
    at: tuple[int, ...]


@struct
class Task:
    """One source region in, transformed, out to one or more destination boxes.

    Attributes:
        source: the source tensor.
        dtype: its dtype.
        region: the box of its global index space the task needs (block-aligned for FP8).
        reads: the reads that bring it; their boxes tile ``region``.
        op: :data:`~tensorhub.scheduling.mapping.COPY` (cast to ``out_dtype``) or :data:`FP8`.
        out_dtype: the result's dtype (for FP8: the values' dtype; scales are float32).
        block: for FP8: the block's (rows, columns).
        outputs: where the result lands.
    """

    source: str
    dtype: str
    region: Box
    reads: tuple[Read, ...]
    op: str
    out_dtype: str
    block: tuple[int, ...]
    outputs: tuple[Output, ...]

    @property
    def nbytes(self) -> int:
        """The region's size in the source dtype (the temporary memory the task needs, about)."""
        return self.region.volume * DTYPE_SIZES[self.dtype]


@struct
class ShardPlan:
    """What one destination shard does: its local tensors (layout order) and its tasks."""

    shard: int
    tensors: tuple[TensorSpec, ...]
    tasks: tuple[Task, ...]

    def sources(self) -> tuple[int, ...]:
        """The source shards it reads from (what a grant must name)."""
        return tuple(sorted({r.shard for t in self.tasks for r in t.reads}))

    @property
    def read_bytes(self) -> int:
        return sum(r.nbytes for t in self.tasks for r in t.reads)


@struct
class ReshardPlan:
    """The plan of one (source layout, destination layout, mapping).

    Attributes:
        shards: one per destination shard planned, in order.
        loads: bytes each source shard serves (the ``loads`` the plan was made on included).
        max_gap: the hole size the segments were merged over.
    """

    shards: tuple[ShardPlan, ...]
    loads: tuple[int, ...]
    max_gap: int

    @property
    def read_bytes(self) -> int:
        return sum(self.loads)

    @property
    def num_segments(self) -> int:
        return sum(r.num_segments for s in self.shards for t in s.tasks for r in t.reads)


# --- segments -----------------------------------------------------------------------------------


def segments_of(
    box: Box, shape: tuple[int, ...], itemsize: int, max_gap: int
) -> tuple[int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The segments that read ``box`` of a row-major tensor of ``shape``.

    Returns:
        ``(start, length, counts, pitches, strides)`` as in :class:`Read`.
    """
    n = len(shape)
    if n == 0:
        return 0, itemsize, (), (), ()
    s = [1] * n
    for d in range(n - 2, -1, -1):
        s[d] = s[d + 1] * shape[d + 1]
    lo, ext = box.start, box.shape
    k = n - 1  # the innermost dimension the box does not span whole; every one after it is whole
    while k > 0 and lo[k] == 0 and ext[k] == shape[k]:
        k -= 1
    span = ext[k] * s[k]  # elements from a segment's first to its last
    split = k  # dimensions [split, n) lie inside a segment; [0, split) are loops over segments
    for d in range(k - 1, -1, -1):
        if ext[d] > 1 and (s[d] - span) * itemsize > max_gap:
            break
        span += (ext[d] - 1) * s[d]
        split = d
    start = sum(a * b for a, b in zip(lo, s)) * itemsize
    counts = tuple(ext[d] for d in range(split) if ext[d] > 1)
    pitches = tuple(s[d] * itemsize for d in range(split) if ext[d] > 1)
    strides = list(s)
    compact = span
    for d in range(split - 1, -1, -1):
        strides[d] = compact
        compact *= ext[d]
    return start, span * itemsize, counts, pitches, tuple(strides)


# --- planning -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Holding:
    """A distinct piece of a source tensor and the shards that hold it."""

    box: Box
    holders: list[tuple[int, Piece, tuple[int, ...]]]  # (shard, its piece, its local shape)


@dataclass(slots=True)
class _Option:
    shard: int
    nbytes: int
    geometry: tuple[int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass(slots=True)
class _Slot:
    """A read still to assign to one of its candidate shards."""

    tensor: str
    box: Box
    options: list[_Option]
    chosen: int = -1


def _index(source: ReplicaLayout, exclude: frozenset[int]) -> dict[str, list[_Holding]]:
    out: dict[str, dict[Box, _Holding]] = {}
    for i, tensors in enumerate(source.shards):
        if i in exclude:
            continue
        for pt in tensors:
            pieces = pt.pieces()
            if not pieces:
                continue
            # one piece of a plain placement is the whole local tensor (no second box worked out)
            local = pieces[0].box.shape if len(pieces) == 1 and not pt.placement.packed else pt.local_shape()
            for piece in pieces:
                h = out.setdefault(pt.name, {}).get(piece.box)
                if h is None:
                    h = out[pt.name][piece.box] = _Holding(piece.box, [])
                h.holders.append((i, piece, local))
    return {name: list(by_box.values()) for name, by_box in out.items()}


def _expand(box: Box, block: tuple[int, ...], shape: tuple[int, ...]) -> Box:
    """``box`` grown to whole blocks, clipped to ``shape``."""
    return Box(
        tuple(a // b * b for a, b in zip(box.start, block)),
        tuple(min(-(-z // b) * b, n) for z, b, n in zip(box.stop, block, shape)),
    )


def plan(
    source: ReplicaLayout,
    dest: ReplicaLayout,
    mapping: Mapping = IDENTITY,
    *,
    max_gap: int = DEFAULT_MAX_GAP,
    max_task_bytes: int | None = None,
    exclude: frozenset[int] | set[int] = frozenset(),
    only: Collection[int] | None = None,
    loads: Sequence[int] = (),
) -> ReshardPlan:
    """Plan how ``dest``'s shards get their tensors from ``source``'s.

    Args:
        source: the source replica's layout; every tensor must be wholly held.
        dest: the destination replica's layout.
        mapping: how destination tensors derive from source tensors (default: same names,
            shapes and dtypes; placements may differ).
        max_gap: holes of at most this many bytes are read through (see the module docstring).
        max_task_bytes: split tasks whose region is larger along dimension 0 (at block
            boundaries for FP8), so a pipeline under a memory budget can hold one; None: no split.
        exclude: source shards not to read from (dead or busy); what only they hold is refused.
        only: plan these destination shards only (e.g. the one a grant is for); None: all.
        loads: bytes the source shards already serve (from plans made before), balanced on.

    Returns:
        The plan (``shards`` in destination shard order, only those asked for).

    Raises:
        InvalidPlacement: a source tensor not wholly held by the shards not excluded.
        MappingMismatch: the mapping does not connect the layouts (names every tensor concerned).
        InvalidArgument: a bad ``max_gap``, ``max_task_bytes``, ``only`` or ``loads``.
    """
    if type(max_gap) is not int or max_gap < 0:
        raise InvalidArgument(f"max_gap must be an int >= 0, got {max_gap!r}")
    if max_task_bytes is not None and (type(max_task_bytes) is not int or max_task_bytes < 1):
        raise InvalidArgument(f"max_task_bytes must be an int >= 1 or None, got {max_task_bytes!r}")
    if loads and (len(loads) != source.num_shards or any(type(x) is not int or x < 0 for x in loads)):
        raise InvalidArgument(f"loads must give {source.num_shards} byte counts >= 0, got {list(loads)!r:.200}")
    if only is not None and any(type(j) is not int or not 0 <= j < dest.num_shards for j in only):
        raise InvalidArgument(f"only must name destination shards in [0, {dest.num_shards}), got {sorted(only)!r:.200}")
    exclude = frozenset(exclude)
    src = source.tensors()
    derivations = resolve(mapping, src, dest.tensors())
    index = _index(source, exclude)
    used = {p.source for d in derivations.values() for p in d.parts}
    for name in (n for n in src if n in used):  # in layout order: the same error every run
        have = sum(h.box.volume for h in index.get(name, ()))  # a replica's pieces are equal or disjoint
        if have != math.prod(src[name].shape):
            whom = f" (not reading from shards {sorted(exclude)})" if exclude else ""
            raise InvalidPlacement(
                f"source tensor {name!r}: the source shards{whom} hold {have} of its {math.prod(src[name].shape)} elements",
                tensors=(name,),
            )
    rows: dict[str, tuple[list[_Holding], list[int], int, list[int]]] = {}
    slots: list[_Slot] = []
    drafts: list[tuple[int, tuple[TensorSpec, ...], list[tuple[Task, list[int]]]]] = []
    geometry: dict[tuple[Any, ...], tuple[int, Any]] = {}  # many reads share a geometry: compute it once
    # Destination shards with the same piece of a tensor (data-parallel attention: 128 ranks each
    # holding every replicated tensor whole) cut the same region into the same reads: cut once.
    cuts: dict[tuple[Any, ...], list[tuple[Box, list[_Option]]]] = {}
    for j, tensors in enumerate(dest.shards):
        if only is not None and j not in only:
            continue
        held = {pt.name: pt for pt in tensors}
        done: set[str] = set()
        tasks: list[tuple[Task, list[int]]] = []
        for pt in tensors:
            if pt.name in done:
                continue
            d = derivations[pt.name]
            members = [(pt, d)]
            if d.partner in held:
                members.append((held[d.partner], derivations[d.partner]))
            done.update(m.name for m, _ in members)
            for task in _tasks_of(members, derivations, src, max_task_bytes):
                lo, hi = task.region.start, task.region.stop
                key = (task.source, lo, hi)
                cut = cuts.get(key)
                if cut is None:
                    cut = cuts[key] = []
                    for h in _overlapping(rows, index, task.source, lo, hi):
                        start = tuple(map(max, lo, h.box.start))
                        stop = tuple(map(min, hi, h.box.stop))
                        if all(a < b for a, b in zip(start, stop)):
                            box = _box(start, stop)
                            cut.append((box, _options(box, h, DTYPE_SIZES[task.dtype], max_gap, geometry)))
                ids = list(range(len(slots), len(slots) + len(cut)))
                slots.extend(_Slot(task.source, box, options) for box, options in cut)  # options: shared, read-only
                tasks.append((task, ids))
        drafts.append((j, tuple(pt.spec() for pt in tensors), tasks))
    final = _balance(slots, list(loads) if loads else [0] * source.num_shards)
    shards = []
    for j, specs, tasks in drafts:
        out = []
        for task, ids in tasks:
            reads = []
            for i in ids:
                slot = slots[i]
                o = slot.options[slot.chosen]
                reads.append(Read(o.shard, slot.tensor, slot.box, *o.geometry))
            out.append(
                Task(
                    task.source,
                    task.dtype,
                    task.region,
                    tuple(reads),
                    task.op,
                    task.out_dtype,
                    task.block,
                    task.outputs,
                )
            )
        shards.append(ShardPlan(j, specs, tuple(out)))
    return ReshardPlan(tuple(shards), tuple(final), max_gap)


def _overlapping(
    rows: dict[str, tuple[list[_Holding], list[int], int, list[int]]],
    index: dict[str, list[_Holding]],
    tensor: str,
    lo: tuple[int, ...],
    hi: tuple[int, ...],
) -> list[_Holding]:
    """The holdings of ``tensor`` that may overlap ``[lo, hi)``, in the index's order: those
    whose first row is within the tallest holding's height of the region. The holdings of one
    tensor are disjoint boxes (equal pieces are one holding), so nothing else can overlap, and an
    expert sharded over hundreds of ranks is looked up without visiting them all."""
    if not lo:  # a scalar
        return index[tensor]
    got = rows.get(tensor)
    if got is None:
        holdings = index[tensor]
        order = sorted(range(len(holdings)), key=lambda k: (holdings[k].box.start[0], k))
        got = rows[tensor] = ([holdings[k] for k in order], [holdings[k].box.start[0] for k in order],
                              max(h.box.stop[0] - h.box.start[0] for h in holdings), order)  # fmt: skip
    by_row, starts, tallest, order = got
    a = bisect.bisect_right(starts, lo[0] - tallest)
    b = bisect.bisect_left(starts, hi[0])
    if b - a <= 1:
        return by_row[a:b]
    return [by_row[k] for k in sorted(range(a, b), key=order.__getitem__)]  # the index's order: balancing's ties follow it


def _options(
    box: Box, h: _Holding, itemsize: int, max_gap: int, cache: dict[tuple[Any, ...], tuple[int, Any]]
) -> list[_Option]:
    """Where ``box`` (inside holding ``h``) can be read from: one option per holder."""
    options: list[_Option] = []
    for shard, piece, local in h.holders:
        start = tuple(a - b + c for a, b, c in zip(box.start, piece.box.start, piece.at))
        shape = tuple(map(operator.sub, box.stop, box.start))
        key = (start, shape, local, itemsize)
        got = cache.get(key)
        if got is None:
            moved = _box(start, tuple(map(operator.add, start, shape)))
            geometry = segments_of(moved, local, itemsize, max_gap)
            got = cache[key] = (geometry[1] * math.prod(geometry[2]), geometry)
        options.append(_Option(shard, got[0], got[1]))
    return options


def _tasks_of(members: list[Any], derivations: dict[str, Derivation], src: dict[str, Any], max_task_bytes: int | None) -> list[Task]:
    """The tasks that feed one destination tensor (or an FP8 bundle) on one shard, without reads."""
    d0: Derivation = members[0][1]
    fp8 = d0.kind in (FP8_VALUES, FP8_SCALES)
    dim = d0.dim
    grouped: dict[tuple[int, Box], list[Output]] = {}
    for pt, d in members:
        kind = SCALES if d.kind == FP8_SCALES else VALUES
        for piece in pt.pieces():
            if not piece.box.start:  # a scalar
                grouped.setdefault((0, piece.box), []).append(Output(pt.name, kind, piece.box, ()))
                continue
            for pi, part in enumerate(d.parts):
                a = max(piece.box.start[dim], part.start)
                b = min(piece.box.stop[dim], part.start + part.size)
                if a >= b:
                    continue
                sub = piece.box.with_dim(dim, a - part.start, b - part.start)  # in the part's indices
                at = tuple(x + (a if i == dim else s) - s for i, (x, s) in enumerate(zip(piece.at, piece.box.start)))
                shape = tuple(src[part.source].shape)
                if d.kind == FP8_VALUES:
                    region = _expand(sub, d.block, shape)
                    take = sub.shift(tuple(-x for x in region.start))
                elif d.kind == FP8_SCALES:
                    region = Box(
                        tuple(x * k for x, k in zip(sub.start, d.block)),
                        tuple(min(x * k, n) for x, k, n in zip(sub.stop, d.block, shape)),
                    )
                    take = Box.whole(sub.shape)
                else:
                    region, take = sub, Box.whole(sub.shape)
                grouped.setdefault((pi, region), []).append(Output(pt.name, kind, take, at))
    out = []
    for (pi, region), outputs in grouped.items():
        part = d0.parts[pi]
        dtype = src[part.source].dtype
        op = FP8 if fp8 else COPY
        out_dtype = derivations[d0.partner].dtype if d0.kind == FP8_SCALES else d0.dtype
        task = Task(part.source, dtype, region, (), op, out_dtype, d0.block if fp8 else (), tuple(outputs))
        out.extend(_split(task, max_task_bytes))
    return out


def _split(task: Task, max_task_bytes: int | None) -> list[Task]:
    """``task`` cut along dimension 0 into tasks of at most ``max_task_bytes`` (whole blocks)."""
    region = task.region
    if max_task_bytes is None or task.nbytes <= max_task_bytes or not region.start or region.shape[0] <= 1:
        return [task]
    row = task.nbytes // region.shape[0]
    rows = max(1, max_task_bytes // row) if row else region.shape[0]
    if task.op == FP8:
        rows = max(task.block[0], rows // task.block[0] * task.block[0])
    out = []
    for r0 in range(0, region.shape[0], rows):
        r1 = min(r0 + rows, region.shape[0])
        outputs = []
        for o in task.outputs:
            lo, hi = (r0, r1) if o.kind == VALUES else (r0 // task.block[0], -(-r1 // task.block[0]))
            a, b = max(o.take.start[0], lo), min(o.take.stop[0], hi)
            if a >= b:
                continue
            take = o.take.with_dim(0, a - lo, b - lo)
            at = (o.at[0] + a - o.take.start[0],) + o.at[1:]
            outputs.append(Output(o.tensor, o.kind, take, at))
        if outputs:
            sub = region.with_dim(0, region.start[0] + r0, region.start[0] + r1)
            out.append(Task(task.source, task.dtype, sub, (), task.op, task.out_dtype, task.block, tuple(outputs)))
    return out


def _balance(slots: list[_Slot], load: list[int]) -> list[int]:
    """Assign every slot to one of its options (see "Balancing" in the module docstring),
    adding to ``load`` (bytes per source shard)."""
    num_shards = len(load)
    # on[s]: the slots on shard s that could move (a read with one holder never can)
    on: list[set[int]] = [set() for _ in range(num_shards)]
    largest = [-max(o.nbytes for o in slot.options) if len(slot.options) > 1 else -slot.options[0].nbytes for slot in slots]
    for i in sorted(range(len(slots)), key=largest.__getitem__):  # stable: ties in slot order
        slot = slots[i]
        options = slot.options
        if len(options) == 1:
            slot.chosen = 0
            o = options[0]
            load[o.shard] += o.nbytes
            continue
        best = min(range(len(options)), key=lambda k: (load[options[k].shard] + options[k].nbytes, options[k].shard))
        slot.chosen = best
        o = options[best]
        load[o.shard] += o.nbytes
        on[o.shard].add(i)
    for _ in range(8 * len(slots) + 64):  # each move lowers the sum of squared loads: this ends
        peak = max(load)
        move = None
        for top in (s for s in range(num_shards) if load[s] == peak):
            for i in sorted(on[top]):
                slot = slots[i]
                here = slot.options[slot.chosen].nbytes
                for k, o in enumerate(slot.options):
                    if o.shard != top and o.nbytes <= here and load[o.shard] + o.nbytes < peak:
                        worst = max(peak - here, load[o.shard] + o.nbytes)
                        if move is None or (worst, o.shard, i) < move[0]:
                            move = ((worst, o.shard, i), i, k)
        if move is None:
            break
        _, i, k = move
        slot = slots[i]
        old = slot.options[slot.chosen]
        load[old.shard] -= old.nbytes
        on[old.shard].discard(i)
        slot.chosen = k
        new = slot.options[k]
        load[new.shard] += new.nbytes
        on[new.shard].add(i)
    return load
