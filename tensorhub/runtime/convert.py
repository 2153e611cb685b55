"""The converter: build a shard of a converted model from the source model's shards.

Theory of operation
-------------------
A handle opened with ``convert_from=`` holds its model in another layout than the source's
(other names, another number of shards, fused projections, FP8). When the server makes its
shard the converter of a version (:mod:`tensorhub.core.table.conversions`), it sends one
``Convert`` naming, per source shard, a holder, that shard's layout and placements, its
checksums and the grant token. :class:`Conversion` then:

1. **plans**, in a worker thread, once per process and layouts (later versions reuse the plan): :func:`tensorhub.scheduling.reshard.plan` of the source
   replica's layout, this shard's placements and the handle's mapping, for this destination shard
   only (``only=``), tasks split so that one fits a quarter of the budget;
2. runs the tasks as a **bounded pipeline**: each task's reads are fetched (grown to whole
   checksum units of the source, so each unit is verified against the source's declared
   checksum before any of its bytes are used: integrity holds for slices too; a transport that
   reports landing has each piece hashed as it lands, while in cache), then gathered,
   transformed (cast, FP8 block quantization) and landed in this shard's registered tensors in
   a worker thread, while the next tasks' reads are on the wire. A task that only moves bytes
   (a copy to its own dtype, each read one run of whole source units that is one contiguous run
   of the destination tensor: a same-dtype rename, a row block of a dim-0 shard) lands its
   reads **in place**: straight into the destination's bytes, verified there, with no staging
   buffer, no gather and no copy after; those units' verified checksums are the destination's
   own (the same bytes), so step 3 hashes only the rest. Such reads that follow each other in a
   source shard's transfer space are one transport read (a run, :meth:`Conversion._schedule`):
   straight into the destination where their bytes follow each other there too (a fused
   parameter's parts), else, for small reads (a checkpoint's norms, end to end in its pack),
   through one staging buffer they are copied out of (and hashed in step 3). Which tasks land
   in place, and the runs, are worked out once per plan and buffers. Reads are staged on the device
   of this shard: a GPU shard's reads land in GPU memory (``local`` copies GPU to GPU, ``tcp``
   through its pinned staging), are verified there (``wordmix-64``: one kernel per read) and
   gathered and quantized by the GPU; nothing but checksums comes back to the CPU. A task starts only when its
   temporary bytes (staged reads + the gathered region + the result) fit in what the budget has
   left, or when nothing else runs (a task larger than the budget runs alone; the peak says so);
3. packs the tiny tensors, hashes its own bytes (those not landed in place) and reports
   ``Converted`` with those checksums.

A consumer that works on a destination tensor as soon as it is whole (vLLM's backend builds a
layer's processed weights while later layers still land) registers a :class:`LandingListener`
for the shard's buffers (:func:`listen`). Each conversion into them calls its ``begin`` first
(whatever it said landed before may be written again from now on), then its ``landed`` once
per destination tensor, when the last task or run that writes it has landed and every byte
of its reads was verified (a unit that failed its checksum was read again first); nothing in
that conversion writes the tensor after. The calls come from the engine's event loop: a
listener only notes them (a queue) and does its work elsewhere.
   From then on the shard is an ordinary complete holder: its peers of the same layout pull the
   converted bytes from it, pipelined, and never convert again.

A read that fails (transport error, dead source) reports ``SourceFailed`` for that source's grant
and waits for the server to grant that source shard again (a ``Convert`` naming only it); a unit
that fails its checksum reports ``ChecksumFailed`` (the server has the source check itself) and
waits the same way. Tasks already landed stay landed: what was verified is kept. Each read is
tried at most ``_ATTEMPTS`` times. Cancelling the conversion (the call failed or was abandoned, a
newer version, the server lost) waits for the reads in flight to end before it returns, so no
late read writes into the buffers; the progress counter says "nothing held" until ``Converted``.

Reads go through the transports that can land a range of a source shard in a staging buffer of
this process (``local``, ``tcp``): a one-sided transport registers whole shards, so an edge that
would use one converts over ``tcp`` instead (the converted copy then moves over the fast path).
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tensorhub.core import messages as m
from tensorhub.core.errors import InvalidArgument, TransportError
from tensorhub.core.layout import Plan, Unit, plan_of
from tensorhub.core.placement import PlacedTensor, ReplicaLayout
from tensorhub.reshard.transforms import run_task, torch_dtype
from tensorhub.scheduling.mapping import COPY, IDENTITY, Mapping
from tensorhub.scheduling.reshard import VALUES, Read, ShardPlan, Task, plan
from tensorhub.transports.buffers import Segment, ShardBuffers, memory_of

from . import checksum, wordmix

if TYPE_CHECKING:
    from tensorhub.transports.base import Transport

__all__ = ["DEFAULT_BUDGET", "Conversion", "ConversionStats", "ConvertSpec", "LandingListener", "listen"]

#: Temporary bytes a conversion may hold at once, by default.
DEFAULT_BUDGET = 512 << 20
#: Tries of one read (a re-granted source counts as a new try).
_ATTEMPTS = 8
#: Transports that land a range of a source shard in a staging buffer.
_STAGED = ("local", "tcp")
#: Plans kept per process, by (source layout, destination layout, mapping, shard, task size).
_PLANS_KEPT = 16
_PLANS: dict[tuple, ShardPlan] = {}
#: Reads that land in place and follow each other in one source shard's transfer space are read
#: as one (a run): straight into the destination where its bytes follow each other there too (up
#: to ``_RUN_BYTES``); else, where each is at most ``_SMALL_READ``, through one staging buffer of at
#: most ``_GROUP_BYTES`` and copied out (a tiny read costs a whole read's bookkeeping, and a
#: checkpoint's norms and small projections sit end to end in its pack region).
_RUN_BYTES = 64 << 20
_GROUP_BYTES = 4 << 20
_SMALL_READ = 1 << 20
#: Per destination buffers, the schedule of the last plan they were converted by (the same every
#: version: built once), with the addresses of the tensors it was worked out for.
_SCHEDULES: weakref.WeakKeyDictionary[ShardBuffers, tuple[ShardPlan, tuple[int, ...], _Schedule]] = weakref.WeakKeyDictionary()
#: Per destination buffers, the listener told of each tensor as it lands (:func:`listen`).
_LISTENERS: weakref.WeakKeyDictionary[ShardBuffers, LandingListener] = weakref.WeakKeyDictionary()


class LandingListener(Protocol):
    """Told, by each conversion into the buffers it listens to, when each destination tensor is
    whole (:func:`listen`). Called from the engine's event loop: note, do not work."""

    def begin(self, version: int) -> None:
        """A conversion of ``version`` starts writing the buffers: tensors said landed before
        (by an earlier conversion) may be written again from now on."""

    def landed(self, version: int, tensor: str) -> None:
        """Every byte of destination ``tensor`` is landed and verified for ``version``; this
        conversion writes it no more."""


def listen(buffers: ShardBuffers, listener: LandingListener | None) -> None:
    """Tell ``listener`` of each destination tensor of ``buffers`` as a conversion lands it
    (None: stop). One listener per buffers; a conversion takes the one set when it starts.

    Raises:
        InvalidArgument: ``buffers`` is not a shard's buffers, or ``listener`` lacks
            ``begin``/``landed``.
    """
    if not isinstance(buffers, ShardBuffers):
        what = type(buffers).__name__
        raise InvalidArgument(f"listen() takes a shard's registered buffers (handle.buffers), got {what}")
    if listener is None:
        _LISTENERS.pop(buffers, None)
        return
    if not (callable(getattr(listener, "begin", None)) and callable(getattr(listener, "landed", None))):
        what = type(listener).__name__
        raise InvalidArgument(f"a landing listener needs begin(version) and landed(version, tensor), got {what}")
    _LISTENERS[buffers] = listener


@dataclass(frozen=True)
class ConvertSpec:
    """What a converting handle declares: its shard's placements (layout order), its replica's
    number of shards, the mapping from the source's names, and the temporary-memory budget."""

    placements: tuple[PlacedTensor, ...]
    num_shards: int
    shard_idx: int
    mapping: Mapping = IDENTITY
    budget: int = DEFAULT_BUDGET

    def __post_init__(self) -> None:
        if type(self.budget) is not int or self.budget < 1:
            raise InvalidArgument(f"convert_budget must be an int >= 1 (bytes), got {self.budget!r}")
        if not isinstance(self.mapping, Mapping):
            raise InvalidArgument(f"mapping must be a tensorhub.scheduling.mapping.Mapping, got {type(self.mapping).__name__}")


@dataclass
class ConversionStats:
    """What one conversion did (``AsyncShardHandle.last_conversion``)."""

    version: int
    tasks: int = 0
    in_place: int = 0  #: tasks whose reads landed in the destination's bytes as they are
    read_bytes: int = 0  #: bytes fetched from sources (whole checksum units)
    needed_bytes: int = 0  #: bytes the plan's reads needed
    peak_bytes: int = 0  #: the most temporary bytes held at once (accounted)
    budget: int = 0
    plan_s: float = 0.0
    seconds: float = 0.0
    failures: int = 0  #: reads that failed or failed verification (and were tried again)
    reads: int = 0  #: transport reads made (a run of the plan's reads read as one counts once)
    sources: list[str] = field(default_factory=list)
    #: ``time.perf_counter()`` when its ``Convert`` was taken, and when its work began (this
    #: process's clock: for a caller's phases)
    created: float = 0.0
    started: float = 0.0


class _Window(ShardBuffers):
    """A source shard's transfer space with only ``[base, base + len(staging))`` backed, by a
    staging buffer of this process: what a transport reads a range of a source shard into."""

    def __init__(self, plan_: Plan, base: int, staging: torch.Tensor) -> None:
        self.layout = plan_.layout
        self.plan = plan_
        self.tensors = []
        self.regions = [None] * len(plan_.regions)
        self.starts = [r.offset for r in plan_.regions]
        self.total_bytes = plan_.total_bytes
        self.on_cuda = staging.is_cuda  # then transports land GPU bytes through gpu_bytes/region_bytes
        self._parts = {}
        self._views = [None] * len(plan_.regions)
        self._base = base
        self._staging = staging
        self._view = None if staging.is_cuda else memory_of(staging)

    @property
    def cuda_device(self) -> torch.device:
        return self._staging.device

    def _at(self, offset: int, length: int) -> int:
        at = offset - self._base
        if at < 0 or at + length > self._staging.numel():
            raise InvalidArgument(f"byte range [{offset}, {offset + length}) is outside the staged window")
        return at

    def _cpu_views(self, seg: Segment, out: list[memoryview]) -> bool:
        if self._view is None:
            return False
        out.extend(self.views(seg.offset, seg.length))
        return True

    def views(self, offset: int, length: int) -> list[memoryview]:
        if self._view is None:
            raise InvalidArgument("the staged window is GPU memory; stage it")
        at = self._at(offset, length)
        return [self._view[at : at + length]]

    def spans(self, offset: int, length: int) -> list[tuple[int, int]]:
        if self._view is None:
            raise InvalidArgument("the staged window is GPU memory; stage it")
        return [(self._staging.data_ptr() + self._at(offset, length), length)]

    def region_bytes(self, seg: Segment) -> torch.Tensor:
        at = self._at(seg.offset, seg.length)
        return self._staging[at : at + seg.length]

    def gpu_bytes(self, seg: Segment) -> torch.Tensor | None:
        return self.region_bytes(seg) if self._view is None else None

    def copy_in(self, offset: int, src: memoryview) -> None:
        at = self._at(offset, len(src))
        if self._view is not None:
            self._view[at : at + len(src)] = src
            return
        if src.readonly:
            src = memoryview(bytearray(src))
        self._staging[at : at + len(src)].copy_(torch.frombuffer(src, dtype=torch.uint8))


@dataclass
class _Source:
    grant: int
    term: int
    info: m.SourceInfo
    checksums: tuple[int, ...]
    token: bytes | None
    plan: Plan
    peer: tuple[Transport, dict, int] | None = None
    generation: int | None = None


@dataclass(frozen=True)
class _Landing:
    """A read of a task that lands in place: its source shard, the source units it covers
    (whole), their first transfer offset and bytes, where they land (a flat uint8 view of the
    destination's bytes), and the destination tensor and byte offset there of the first byte."""

    shard: int
    units: tuple[Unit, ...]
    base: int
    n: int
    place: torch.Tensor
    tensor: str
    at: int
    needed: int  #: the plan's bytes for the read


@dataclass(frozen=True)
class _Run:
    """Landings read with one transport read: ``[base, base + n)`` of source shard ``shard``.
    ``place``: their destination bytes, one contiguous run (the read lands there); None: they
    are apart there, and the read goes through a staging buffer they are copied out of."""

    shard: int
    base: int
    n: int
    members: tuple[_Landing, ...]
    place: torch.Tensor | None

    @property
    def units(self) -> list[Unit]:
        return [u for m in self.members for u in m.units]


@dataclass(frozen=True)
class _Schedule:
    """A plan's work for one destination: the tasks that are staged (cast, gather, quantize) and
    the runs that land the other tasks' reads in place."""

    staged: tuple[Task, ...]
    runs: tuple[_Run, ...]
    in_place: int  #: tasks landing in place


class _Budget:
    """Temporary bytes: a task waits until its bytes fit, or until nothing else is held."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._cond = asyncio.Condition()

    async def take(self, n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
            self.peak = max(self.peak, self.used)

    async def give(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


Report = Callable[[Callable[[int], Any], bool], None]
Pick = Callable[[m.SourceInfo], "tuple[Transport, dict, int]"]


class Conversion:
    """One conversion of ``version`` into ``buffers``. :meth:`start` it, feed it further
    ``Convert`` messages with :meth:`regrant` and revocations with :meth:`revoke`; :meth:`cancel`
    stops it (and waits for its reads)."""

    def __init__(
        self, session: int, msg: m.Convert, spec: ConvertSpec, buffers: ShardBuffers, report: Report, pick: Pick, log: Any
    ) -> None:
        self.session = session
        self.version = msg.version
        self.term = msg.term
        self.spec = spec
        self.buffers = buffers
        # Reads are staged (and verified, gathered, quantized) where the shard lives: on its GPU.
        self._device = buffers.cuda_device if buffers.on_cuda else torch.device("cpu")
        self.report = report
        self.pick = pick
        self.log = log
        self.source_shards = msg.source_shards
        self.sources: dict[int, _Source] = {}
        self.ready: dict[int, asyncio.Event] = {i: asyncio.Event() for i in range(msg.source_shards)}
        self.stats = ConversionStats(msg.version, budget=spec.budget, created=time.perf_counter())
        self.read_by_source: dict[int, int] = {}  # source shard -> bytes read from it (for the history)
        self.task: asyncio.Task | None = None
        self.done = False
        self._layouts: dict[int, tuple[PlacedTensor, ...]] = {}  # each source shard's placements
        self._plans: dict[int, Plan] = {}  # and packing plan (the same for every holder of the shard)
        self._names: dict[int, dict[str, int]] = {}
        #: per source shard, per tensor index: its units' starts and the units, by start (what
        #: ``_span`` looks up for every read: a scan of every unit per read grew with the shard's
        #: units times its reads)
        self._units: dict[int, dict[int, tuple[list[int], list[Unit]]]] = {}
        #: the verified checksums of units landed in place, by (destination tensor, byte start, length)
        self._landed: dict[tuple[str, int, int], int] = {}
        self.sums: tuple[int, ...] | None = None
        self._listener: LandingListener | None = None  # told of each destination tensor as it lands (listen())
        self._writers: Counter[str] = Counter()  # per destination tensor, its jobs not yet landed
        self.regrant(msg)

    # ---- messages ------------------------------------------------------------------------------

    def regrant(self, msg: m.Convert) -> None:
        """Take the sources a ``Convert`` names (the first one, or a re-grant of some)."""
        if msg.version != self.version or msg.source_shards != self.source_shards:
            raise InvalidArgument(f"convert for version {msg.version} of {msg.source_shards} shards during that of {self.version}")
        self.term = msg.term
        for s in msg.sources:
            if not 0 <= s.shard_idx < self.source_shards:
                raise InvalidArgument(f"convert names source shard {s.shard_idx} of {self.source_shards}")
            self._layouts[s.shard_idx] = s.placements
            self._plans[s.shard_idx] = plan_of(s.layout)
            self._names[s.shard_idx] = {t.name: i for i, t in enumerate(s.layout.tensors)}
            self._units[s.shard_idx] = _units_by_tensor(self._plans[s.shard_idx])
            self.sources[s.shard_idx] = _Source(s.grant, msg.term, s.source, s.checksums, s.token, self._plans[s.shard_idx])
            self.stats.sources.append(f"{s.source.replica}/{s.source.shard_idx}")
            self.ready[s.shard_idx].set()

    def revoke(self, term: int, grant: int) -> bool:
        """The server revoked a grant: if it is one of ours, wait for that shard's next one."""
        for i, src in self.sources.items():
            if (src.term, src.grant) == (term, grant):
                del self.sources[i]
                self.ready[i].clear()
                return True
        return False

    def start(self) -> asyncio.Task:
        self.task = asyncio.ensure_future(self._run())
        return self.task

    async def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.wait([self.task])

    # ---- the work ------------------------------------------------------------------------------

    async def _run(self) -> None:
        t0 = self.stats.started = time.perf_counter()
        b = self.buffers
        b.progress.reset(self.version, 0)
        source = ReplicaLayout(tuple(self._layouts[i] for i in range(self.source_shards)))
        shards: list[tuple[PlacedTensor, ...]] = [() for _ in range(self.spec.num_shards)]
        shards[self.spec.shard_idx] = self.spec.placements
        dest = ReplicaLayout(tuple(shards))
        chunk = max(p.layout.chunk_bytes for p in self._plans.values())
        task_bytes = max(self.spec.budget // 4, 4 * chunk)
        key = (source, dest, self.spec.mapping, self.spec.shard_idx, task_bytes)
        shard_plan = _PLANS.get(key)
        if shard_plan is None:  # the same layouts every version: planned once
            shard_plan = (
                await asyncio.to_thread(plan, source, dest, self.spec.mapping, only=(self.spec.shard_idx,), max_task_bytes=task_bytes)
            ).shards[0]
            _PLANS[key] = shard_plan
            while len(_PLANS) > _PLANS_KEPT:
                del _PLANS[next(iter(_PLANS))]
        self.stats.plan_s = time.perf_counter() - t0
        self.stats.tasks = len(shard_plan.tasks)
        dest_tensors = {spec.name: t for spec, t in zip(b.layout.tensors, b.tensors)}
        budget = _Budget(self.spec.budget)
        running: set[asyncio.Task] = set()
        # decided before any read starts (this Python work would otherwise contend for the
        # interpreter with the copy threads of the reads in flight), once per plan and buffers
        # (its runs hold views of the destination: kept only while every tensor is where it was)
        ptrs = tuple(t.data_ptr() for t in b.tensors)
        cached = _SCHEDULES.get(b)
        if cached is not None and cached[0] is shard_plan and cached[1] == ptrs:
            schedule = cached[2]
        else:
            schedule = self._schedule(shard_plan, dest_tensors)
            _SCHEDULES[b] = (shard_plan, ptrs, schedule)
        self.stats.in_place = schedule.in_place
        work: list[tuple[int, Callable[[], Any], tuple[str, ...]]] = [
            *((0 if r.place is not None else r.n, lambda r=r: self._land_run(r), tuple({x.tensor: 0 for x in r.members}))
              for r in schedule.runs),
            *((self._cost(t), lambda t=t: self._task(t, dest_tensors), tuple({o.tensor: 0 for o in t.outputs}))
              for t in schedule.staged),
        ]  # fmt: skip
        self._listener = _LISTENERS.get(b)
        if self._listener is not None:
            self._writers = Counter(name for _, _, names in work for name in names)
            self._tell("begin", self.version)
        try:
            for cost, job, names in work:
                await budget.take(cost)
                t = asyncio.ensure_future(self._job(job, budget, cost, names))
                running.add(t)
                t.add_done_callback(running.discard)
                failed = [err for x in list(running) if x.done() and (err := x.exception()) is not None]
                if failed:
                    raise failed[0]
            if running:
                await asyncio.gather(*running)
        except BaseException:
            for t in running:
                t.cancel()
            if running:
                await asyncio.wait(running)  # no read may land after we return
            b.progress.reset(None)
            raise
        if b.packed:
            await asyncio.to_thread(b.pack)
        b.progress.advance(b.total_bytes)
        sums = tuple(await asyncio.to_thread(self._own_sums, b))
        self.stats.peak_bytes = budget.peak
        self.stats.seconds = time.perf_counter() - t0
        self.done = True
        version, term, session = self.version, self.term, self.session
        per_source = tuple(self.read_by_source.get(i, 0) for i in range(max(self.read_by_source, default=-1) + 1))
        self.report(lambda req: m.Converted(req, session, term, version, sums, per_source), False)
        self.sums = sums

    def _own_sums(self, b: ShardBuffers) -> list[int]:
        """This shard's checksums: a unit landed in place has its verified source unit's (the
        same bytes under the same algorithm); the others are hashed."""
        names = [t.name for t in b.layout.tensors]
        units = b.plan.units
        sums: list[int | None] = [self._landed.get((names[u.tensor], u.start, u.length)) for u in units]
        rest = [u.index for u in units if sums[u.index] is None]
        for i, v in zip(rest, checksum.compute(b, rest) if rest else ()):
            sums[i] = v
        return [v for v in sums if v is not None]

    def _schedule(self, shard_plan: ShardPlan, dest: dict[str, torch.Tensor]) -> _Schedule:
        """Which tasks land in place (:meth:`_in_place`), and their reads as runs: sorted by
        source transfer offset, a read joins the run before it when it starts where that run ends
        (whole units both) and either its destination bytes follow the run's (then the run lands
        in place, up to ``_RUN_BYTES``) or the run goes through staging (each read at most
        ``_SMALL_READ``, the run at most ``_GROUP_BYTES``)."""
        staged: list[Task] = []
        landings: list[_Landing] = []
        in_place = 0
        for task in shard_plan.tasks:
            places = self._in_place(task, dest)
            if places is None:
                staged.append(task)
                continue
            in_place += 1
            tensor = task.outputs[0].tensor
            origin = dest[tensor].data_ptr()
            for read, place in zip(task.reads, places):
                units, base, n = self._span(read)
                landings.append(_Landing(read.shard, tuple(units), base, n, place, tensor, place.data_ptr() - origin, read.nbytes))
        landings.sort(key=lambda x: (x.shard, x.base))
        runs: list[_Run] = []
        group: list[_Landing] = []
        through_staging = False

        def close() -> None:
            if not group:
                return
            first = group[0]
            total = sum(x.n for x in group)
            place = None
            if not through_staging:  # one contiguous run of the destination: a view over it
                place = first.place if len(group) == 1 else first.place.as_strided((total,), (1,), first.place.storage_offset())
            runs.append(_Run(first.shard, first.base, total, tuple(group), place))

        for x in landings:
            if group:
                last = group[-1]
                total = sum(y.n for y in group) + x.n
                follows = x.shard == last.shard and x.n and last.n and x.base == last.base + last.n
                adjacent = (follows and x.place.device == last.place.device
                            and x.place.untyped_storage().data_ptr() == last.place.untyped_storage().data_ptr()
                            and x.place.data_ptr() == last.place.data_ptr() + last.n)  # fmt: skip
                small = follows and x.n <= _SMALL_READ and all(y.n <= _SMALL_READ for y in group) and total <= _GROUP_BYTES
                if not through_staging and adjacent and total <= _RUN_BYTES:
                    group.append(x)
                    continue
                if small:
                    through_staging = True
                    group.append(x)
                    continue
            close()
            group, through_staging = [x], False
        close()
        return _Schedule(tuple(staged), tuple(runs), in_place)

    def _in_place(self, task: Task, dest: dict[str, torch.Tensor]) -> list[torch.Tensor] | None:
        """Per read of ``task``, the destination bytes it lands in as they are (flat uint8
        views), or None when the task must be staged: it casts or quantizes, its output is not
        its whole region, or a read is not one run of whole source units (then its bytes could
        not all be verified where they land) that is one contiguous run of the destination."""
        if task.op != COPY or task.out_dtype != task.dtype or len(task.outputs) != 1:
            return None
        (o,) = task.outputs
        shape = task.region.shape
        if o.kind != VALUES or any(o.take.start) or tuple(o.take.shape) != tuple(shape):
            return None
        whole = dest.get(o.tensor)
        if whole is None or whole.dtype != torch_dtype(task.dtype) or whole.device != self._device:
            return None
        out = whole[tuple(slice(a, a + n) for a, n in zip(o.at, shape))]
        places = []
        for read in task.reads:
            units, _base, n = self._span(read)
            box = read.box.shape
            if read.counts or n != read.length or (units and units[0].start != read.start) or read.strides != _row_major(box):
                return None
            at = out[tuple(slice(a - r, a - r + k) for a, r, k in zip(read.box.start, task.region.start, box))]
            if not at.is_contiguous() or at.numel() * at.element_size() != n:
                return None
            places.append(at.reshape(-1).view(torch.uint8))
        return places

    def _cost(self, task: Task) -> int:
        staged = sum(self._span(r)[2] for r in task.reads)
        out = sum(math.prod(o.take.shape) for o in task.outputs) * 4
        return staged + task.nbytes + out

    def _span(self, read: Read) -> tuple[list[Unit], int, int]:
        """The source units covering ``read``, their first transfer offset and total bytes."""
        index = self._names[read.shard][read.tensor]
        end = read.start + sum((c - 1) * p for c, p in zip(read.counts, read.pitches)) + read.length
        starts, of_tensor = self._units[read.shard].get(index, ([], []))
        lo = max(bisect.bisect_right(starts, read.start) - 1, 0)  # the unit holding read.start, or the first after
        hi = bisect.bisect_left(starts, end)
        units = [u for u in of_tensor[lo:hi] if u.start + u.length > read.start]
        if not units:
            return [], 0, 0
        first = units[0].offset
        return units, first, units[-1].offset + units[-1].length - first

    async def _job(self, job: Callable[[], Any], budget: _Budget, cost: int, names: tuple[str, ...]) -> None:
        try:
            await job()
        finally:
            await budget.give(cost)
        if self._listener is not None:  # landed and verified: the tensors it was the last writer of are whole
            for name in names:
                self._writers[name] -= 1
                if self._writers[name] == 0:
                    self._tell("landed", self.version, name)

    def _tell(self, what: str, *args: Any) -> None:
        """Call the landing listener; one that raises is logged and told nothing more (the
        conversion goes on: its bytes are not the listener's)."""
        try:
            getattr(self._listener, what)(*args)
        except Exception as err:  # noqa: BLE001 - a consumer's bug must not fail the shard's conversion
            self.log.error("landing listener failed; it is told nothing more", error=f"{type(err).__name__}: {err}")
            self._listener = None

    async def _task(self, task: Task, dest: dict[str, torch.Tensor]) -> None:
        """A staged task: its reads fetched and verified in staging, then transformed into ``dest``."""
        views = [await self._fetch(read, task.dtype) for read in task.reads]
        await asyncio.to_thread(run_task, task, views, dest)

    async def _land_run(self, run: _Run) -> None:
        """Read ``run`` (one transport read), verified where it lands: in the destination's bytes
        (whose units' verified checksums are then noted as this shard's own), or in staging,
        copied out after (those bytes are hashed with the rest of the shard's own)."""
        staging = run.place if run.place is not None else torch.empty(run.n, dtype=torch.uint8, device=self._device)
        what = run.members[0].tensor if len(run.members) == 1 else f"{len(run.members)} tensors from {run.members[0].tensor!r}"
        src = await self._verified(run.shard, run.units, run.base, run.n, staging, what)
        self.stats.needed_bytes += sum(x.needed for x in run.members)
        if run.place is None:
            for x in run.members:
                at = x.base - run.base
                x.place.copy_(staging[at : at + x.n])
        elif src.plan.layout.checksum == self.buffers.layout.checksum:
            for x in run.members:
                for u in x.units:  # verified where they stay: these bytes' checksums, as the source declared them
                    self._landed[(x.tensor, x.at + u.start - x.units[0].start, u.length)] = src.checksums[u.index]

    async def _fetch(self, read: Read, dtype: str) -> torch.Tensor:
        """``read``'s box of the source tensor, as a view of verified staged bytes."""
        self.stats.needed_bytes += read.nbytes
        units, base, n = self._span(read)
        staging = torch.empty(n, dtype=torch.uint8, device=self._device)
        await self._verified(read.shard, units, base, n, staging, read.tensor)
        elem = torch.empty((), dtype=torch_dtype(dtype)).element_size()
        tensor = staging.view(torch_dtype(dtype)) if n else torch.empty(0, dtype=torch_dtype(dtype))
        offset = (read.start - (units[0].start if units else 0)) // elem
        local = self._local_strides(read)
        return tensor.as_strided(read.box.shape, local, offset)

    async def _verified(self, shard: int, units: Sequence[Unit], base: int, n: int, staging: torch.Tensor, what: str) -> _Source:
        """Read the source shard's bytes ``[base, base + n)`` (whole ``units``) into ``staging``
        and verify each unit against the source's declared checksum, trying again (after the
        server grants the shard again) on a failed read or a failed unit. Returns the source read."""
        for _attempt in range(_ATTEMPTS):
            await self.ready[shard].wait()
            src = self.sources[shard]
            try:
                self.stats.reads += 1
                digests = await self._read(src, base, staging, units) if n else None
                if digests is not None:  # hashed as it landed, while in cache: only compared here
                    bad = next((u.index for u in units if digests.get(u.index) != src.checksums[u.index]), None)
                else:
                    bad = await asyncio.to_thread(_first_bad, staging, base, units, src.checksums, src.plan.layout.checksum)
            except (TransportError, InvalidArgument) as err:
                reason = str(err)[:1000]
                self._failed(shard, src, lambda req: m.SourceFailed(req, self.session, src.grant, src.term, 0, reason))
                continue
            if bad is not None:
                self.log.error("source bytes failed verification while converting", source=src.info.replica,
                               shard=shard, unit=bad)  # fmt: skip
                unit = bad
                self._failed(shard, src, lambda req: m.ChecksumFailed(req, self.session, src.grant, src.term, 0, unit))
                continue
            self.stats.read_bytes += n
            self.read_by_source[shard] = self.read_by_source.get(shard, 0) + n
            return src
        raise TransportError(f"source shard {shard}: {_ATTEMPTS} reads of {what!r} failed")

    def _local_strides(self, read: Read) -> tuple[int, ...]:
        """Row-major element strides of the read's source shard's local tensor."""
        layout = self._layouts[read.shard]
        pt = next(p for p in layout if p.name == read.tensor)
        shape = pt.local_shape()
        strides, acc = [], 1
        for d in reversed(shape):
            strides.append(acc)
            acc *= d
        return tuple(reversed(strides))

    def _failed(self, shard: int, src: _Source, build: Callable[[int], Any]) -> None:
        """A source failed a read: tell the server once per grant, and wait for the next grant."""
        self.stats.failures += 1
        if self.sources.get(shard) is src:
            del self.sources[shard]
            self.ready[shard].clear()
            self.report(build, False)

    async def _read(self, src: _Source, base: int, staging: torch.Tensor, units: Sequence[Unit]) -> dict[int, int] | None:
        """Read the source's bytes ``[base, base + len(staging))`` into ``staging``. Returns the
        units' checksums when the transport reported each piece as it landed (hashed then, while
        in cache: :class:`~tensorhub.runtime.checksum.LandingHasher`), else None (verify after)."""
        if src.peer is None:
            src.peer = self.pick(src.info)
        transport, peer, region = src.peer
        kw: dict[str, Any] = {}
        if getattr(transport, "checks_grants", False):
            kw["token"] = src.token
        window = _Window(src.plan, base, staging)
        hasher = None
        if getattr(transport, "reports_landing", False) and checksum.lands(window):
            hasher = checksum.LandingHasher(window, units)
            kw["landed"] = hasher.landed
        gen = await transport.read(peer, region, self.version, base, staging.numel(), window, src.generation, **kw)
        if src.generation is None and isinstance(gen, int):
            src.generation = gen
        return hasher.digests if hasher is not None and hasher.complete else None


def _units_by_tensor(plan_: Plan) -> dict[int, tuple[list[int], list[Unit]]]:
    """``plan_``'s units grouped by tensor, each group by start (a tensor's units do not
    overlap): with their starts, for bisecting."""
    groups: dict[int, list[Unit]] = {}
    for u in plan_.units:
        groups.setdefault(u.tensor, []).append(u)
    out = {}
    for t, us in groups.items():
        us.sort(key=lambda u: u.start)
        out[t] = ([u.start for u in us], us)
    return out


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def _first_bad(staging: torch.Tensor, base: int, units: Sequence[Unit], expected: Sequence[int], algorithm: str) -> int | None:
    """The first unit whose staged bytes do not hash to its declared checksum (under the source
    layout's ``algorithm``), or None."""
    if algorithm == wordmix.NAME:  # on the GPU where the staging is: one kernel for the read
        got = wordmix.sums([staging[u.offset - base : u.offset - base + u.length] for u in units])
        return next((u.index for u, v in zip(units, got) if v != expected[u.index]), None)
    if algorithm not in checksum.ALGORITHMS:
        raise InvalidArgument(f"checksum algorithm {algorithm!r} is not supported (known: {', '.join(checksum.ALGORITHMS)})")
    host = staging.cpu() if staging.is_cuda else staging  # xxh3-64 of GPU bytes: hashed on the CPU
    view = memory_of(host) if host.numel() else memoryview(b"")
    for u in units:
        at = u.offset - base
        if checksum.digest(view[at : at + u.length]) != expected[u.index]:
            return u.index
    return None
