"""Scheduling: the topology model and the policies the reference table uses to pick sources.

``topology.Location`` says where a worker is; ``selection.select_source`` is the policy that picks
the holder serving a reader, and ``selection.SourceIndex`` applies the same policy incrementally
to one (version, shard)'s holders so the table never scans them all. No IO.
"""

from tensorhub.core.topology import Location

from .selection import Candidate, SourceIndex, select_source

__all__ = ["Candidate", "Location", "SourceIndex", "select_source"]
