"""Scheduling: the topology model and the policies the reference table uses to pick sources.

``topology.Location`` says where a worker is; ``selection.select_source`` is the policy that picks
the holder serving a reader, and ``selection.SourceIndex`` applies the same policy incrementally
to one (version, shard)'s holders so the table never scans them all. For readers whose layout
differs from the holders' (issue 20): ``mapping`` says how one naming scheme's tensors derive from
another's (renames, fusions, casts, FP8 block quantization; Hugging Face -> vLLM presets),
``reshard.plan`` plans which source bytes each destination shard needs and what to do with them,
and ``decoders`` lists a decoder's tensors on both sides. No IO.
"""

from tensorhub.core.topology import Location

from .selection import Candidate, SourceIndex, select_source

__all__ = ["Candidate", "Location", "SourceIndex", "select_source"]
