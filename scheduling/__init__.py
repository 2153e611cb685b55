"""Scheduling: the topology model and the policies the reference table uses to pick sources.

``topology.Location`` says where a worker is; ``selection.select_source`` picks the holder that
serves a reader. Pure functions of their inputs: no state, no IO.
"""

from .selection import Candidate, select_source
from .topology import Location

__all__ = ["Candidate", "Location", "select_source"]
