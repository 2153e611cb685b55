"""Resharding with torch: a plan's transforms over tensors, and placements from DTensors.

The planning is sans-IO and torch-free (:mod:`tensorhub.core.placement`,
:mod:`tensorhub.scheduling.mapping`, :mod:`tensorhub.scheduling.reshard`); this package is what
runs a plan where the bytes are. :mod:`.transforms` lands a read's segments, views them as the
box they bring, casts, block-quantizes to FP8 and writes the outputs into destination tensors;
:mod:`.dtensor` describes DTensors (and plain tensors) as placements. It sits in the runtime
layer: it imports torch, and nothing below it imports it.
"""

from .dtensor import placed_tensors, placement_of, replica_layout
from .transforms import (
    allocate,
    convert_in_process,
    gather,
    land,
    quantize_fp8_blocks,
    read_view,
    run_task,
    stage,
    torch_dtype,
    transform,
)

__all__ = [
    "allocate",
    "convert_in_process",
    "gather",
    "land",
    "placed_tensors",
    "placement_of",
    "quantize_fp8_blocks",
    "read_view",
    "replica_layout",
    "run_task",
    "stage",
    "torch_dtype",
    "transform",
]
