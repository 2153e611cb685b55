"""A reshard plan's tasks, run over torch tensors: land, view, transform, write out.

Theory of operation
-------------------
A :class:`~tensorhub.scheduling.reshard.Task` is run in four pure steps, each a function here,
so a data path (the engine's fetch -> transform -> land pipeline) only calls them:

1. :func:`stage` gives a read's landing buffer (``read.nbytes`` bytes); the transport writes the
   read's segments into it back to back, in :meth:`Read.segments` order.
2. :func:`read_view` views the landed bytes as the box the read brings (``read.strides``; no
   copy: the hole bytes a merged segment carries are never looked at).
3. :func:`gather` puts a task's read views together into its region (no copy when one read
   brings the whole region), and :func:`transform` casts it or block-quantizes it to FP8
   (values and inverse scales).
4. :func:`land` writes each output box into the destination tensor at its local index.

FP8 block quantization is DeepSeek-V3's (DeepGEMM's ``per_block_cast_to_fp8``): per 128x128
block, ``amax = max|x|`` (computed in float32, at least 1e-4), values ``x * (448 / amax)`` cast
to ``float8_e4m3fn``, inverse scale ``amax / 448`` (float32). A task's region covers whole blocks
of the source tensor (clipped at its edges), so its blocks are the whole tensor's blocks and the
bytes equal those of quantizing the whole tensor and slicing. The bytes are the same on the CPU
and on a GPU (``tests/test_reshard_cuda.py``): two holders that convert the same version to the
same layout declare the same checksums.

:func:`convert_in_process` runs a whole plan in one process, cutting each read's segments from
the source shards' local tensors' bytes as a transport would: the tests' data path, and a way to
convert when one process holds both sides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tensorhub.core.errors import InvalidArgument
from tensorhub.core.layout import TensorSpec
from tensorhub.scheduling.mapping import COPY
from tensorhub.scheduling.reshard import FP8, SCALES, VALUES, Read, ReshardPlan, Task

__all__ = [
    "AMAX_FLOOR",
    "FP8_MAX",
    "allocate",
    "convert_in_process",
    "gather",
    "land",
    "quantize_fp8_blocks",
    "read_view",
    "run_task",
    "stage",
    "torch_dtype",
    "transform",
]

#: The largest finite float8_e4m3fn value.
FP8_MAX = 448.0
#: A block's amax is at least this, so an all-zero block gets a finite scale.
AMAX_FLOOR = 1e-4
#: Block rows quantized per step (bounds the float32 temporary).
_QUANT_ROWS = 8


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a layout names (``"bfloat16"`` -> ``torch.bfloat16``).

    Raises:
        InvalidArgument: not a dtype of this torch.
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"{name!r} is not a torch dtype")
    return dtype


def _slices(start: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(start, shape))


def quantize_fp8_blocks(
    x: torch.Tensor, block: Sequence[int] = (128, 128), dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a 2-D tensor to FP8.

    Args:
        x: the weight (any floating dtype; any strides).
        block: the block's (rows, columns).
        dtype: the FP8 dtype.

    Returns:
        ``(values, scales)``: ``values`` of ``x``'s shape in ``dtype``; ``scales`` (float32) of
        shape ``ceil(rows / block[0]), ceil(cols / block[1])``, each block's ``amax / 448``
        (``values * scale`` approximates ``x``).

    Raises:
        InvalidArgument: ``x`` is not 2-D.
    """
    if x.dim() != 2:
        raise InvalidArgument(f"block quantization takes a 2-D tensor, not {tuple(x.shape)}")
    m, n = x.shape
    br, bc = block
    rows, cols = -(-m // br), -(-n // bc)
    if m % br or n % bc or not x.is_contiguous():
        padded = x.new_zeros((rows * br, cols * bc))  # zeros change no block's amax
        padded[:m, :n] = x
    else:
        padded = x  # whole blocks already: no copy
    blocks = padded.view(rows, br, cols, bc)
    # |x| and max are exact in any float dtype: reduce in x's own dtype (half the bytes of
    # float32 for bf16), innermost dimension first, then widen the per-block maxima
    amax = blocks.abs().amax(dim=3).amax(dim=1).float().clamp(AMAX_FLOOR).view(rows, 1, cols, 1)
    inv = FP8_MAX / amax
    values = torch.empty((rows, br, cols, bc), dtype=dtype, device=x.device)
    for r in range(0, rows, _QUANT_ROWS):  # a few block rows at a time: the float32 product stays in cache
        values[r : r + _QUANT_ROWS] = (blocks[r : r + _QUANT_ROWS] * inv[r : r + _QUANT_ROWS]).to(dtype)
    # divide by a tensor, not a Python number: CUDA turns division by a CPU scalar into a
    # multiplication by its reciprocal, a bit off the CPU's division (and every converter of a
    # layout must produce the same bytes, whatever its device)
    scales = amax / torch.full_like(amax, FP8_MAX)
    return values.view(rows * br, cols * bc)[:m, :n].contiguous(), scales.view(rows, cols)


def stage(read: Read, device: torch.device | str | None = None) -> torch.Tensor:
    """A landing buffer for ``read``'s segments (``read.nbytes`` bytes, uninitialized, on
    ``device``: where the task will run)."""
    return torch.empty(read.nbytes, dtype=torch.uint8, device=device)


def read_view(read: Read, landed: torch.Tensor, dtype: str) -> torch.Tensor:
    """The box ``read`` brings, viewed in its landed bytes (segments back to back).

    Args:
        read: the read.
        landed: ``read.nbytes`` bytes (uint8, contiguous), e.g. from :func:`stage`.
        dtype: the source tensor's dtype.
    """
    if landed.dtype != torch.uint8 or landed.numel() != read.nbytes or not landed.is_contiguous():
        raise InvalidArgument(
            f"read of {read.tensor!r}: {read.nbytes} contiguous uint8 bytes expected, got {landed.dtype} x {landed.numel()}"
        )
    return landed.view(torch_dtype(dtype)).as_strided(read.box.shape, read.strides)


def gather(task: Task, views: Sequence[torch.Tensor]) -> torch.Tensor:
    """A task's region from its reads' views (in ``task.reads`` order); a view itself when one
    read brings the whole region."""
    if len(views) != len(task.reads):
        raise InvalidArgument(f"task on {task.source!r}: {len(task.reads)} read views expected, got {len(views)}")
    if len(views) == 1 and task.reads[0].box == task.region:
        return views[0]
    region = torch.empty(task.region.shape, dtype=torch_dtype(task.dtype), device=views[0].device if views else None)
    origin = task.region.start
    for read, view in zip(task.reads, views):
        region[_slices([a - o for a, o in zip(read.box.start, origin)], read.box.shape)] = view
    return region


def transform(task: Task, region: torch.Tensor) -> dict[str, torch.Tensor]:
    """The task's results from its region: ``{VALUES: ...}``, plus ``SCALES`` for FP8."""
    if task.op == COPY:
        return {VALUES: region.to(torch_dtype(task.out_dtype))}
    if task.op == FP8:
        values, scales = quantize_fp8_blocks(region, task.block, torch_dtype(task.out_dtype))
        return {VALUES: values, SCALES: scales}
    raise InvalidArgument(f"task on {task.source!r}: unknown operation {task.op!r}")


def land(task: Task, results: Mapping[str, torch.Tensor], dest: Mapping[str, torch.Tensor]) -> None:
    """Write the task's outputs into the destination shard's local tensors (by name)."""
    for o in task.outputs:
        src = results[o.kind][_slices(o.take.start, o.take.shape)]
        out = dest[o.tensor][_slices(o.at, o.take.shape)]
        if out.dtype != src.dtype:
            raise InvalidArgument(f"destination tensor {o.tensor!r} is {out.dtype}, the task gives {src.dtype}")
        if src.element_size() == 1:  # copy float8 as bytes (not every build copies float8 on every device)
            out, src = out.view(torch.uint8), src.view(torch.uint8)
        out.copy_(src)


def run_task(task: Task, views: Sequence[torch.Tensor], dest: Mapping[str, torch.Tensor]) -> None:
    """:func:`gather`, :func:`transform` and :func:`land`, in one call."""
    land(task, transform(task, gather(task, views)), dest)


def allocate(specs: Sequence[TensorSpec], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Empty local tensors for a destination shard (``ShardPlan.tensors``), by name."""
    return {s.name: torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=device) for s in specs}


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def convert_in_process(
    plan: ReshardPlan,
    sources: Sequence[Mapping[str, torch.Tensor]],
    dest: Mapping[int, dict[str, torch.Tensor]] | Sequence[dict[str, torch.Tensor]] | None = None,
    device: torch.device | str | None = None,
) -> dict[int, dict[str, torch.Tensor]]:
    """Run ``plan`` in this process.

    Args:
        plan: the plan.
        sources: per source shard, its local tensors by name (on any device).
        dest: per destination shard planned, its local tensors by name (a sequence is indexed
            by destination shard); allocated on ``device`` when None.
        device: where reads land and tasks run (default: the CPU).

    Returns:
        The destination shards' local tensors, by destination shard.
    """
    if dest is None:
        out = {s.shard: allocate(s.tensors, device) for s in plan.shards}
    else:
        out = dict(dest) if isinstance(dest, Mapping) else dict(enumerate(dest))
    for sp in plan.shards:
        for task in sp.tasks:
            views = []
            for read in task.reads:
                raw = _bytes_of(sources[read.shard][read.tensor])
                landed = stage(read, device)
                pos = 0
                for off, length in read.segments():  # what a transport does, segment by segment
                    landed[pos : pos + length].copy_(raw[off : off + length])
                    pos += length
                views.append(read_view(read, landed, task.dtype))
            run_task(task, views, out[sp.shard])
    return out
