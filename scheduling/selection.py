"""Source selection: which holder serves a reader (DESIGN.md §5.1).

The reference table gathers the *eligible* holders of the (version, shard) a reader needs
(live complete, offload and partial holders; not unpublishing, not excluded for this reader,
never downstream of it) and asks :func:`select_source` to pick one. The policy, in order:

1. the reader's datacenter if any candidate is there (else a cross-datacenter source);
2. the source replica already chosen for the reader's other shards, when it can serve this one
   (one source replica per reader replica keeps a replica's shards on one pipeline);
3. the fewest active readers on the candidate's replica (load is counted per source replica:
   under pipelining each source replica serves about one reader replica at a time);
4. complete (or offload) holders before partial ones;
5. the reader's own host;
6. then a seeded random choice, so equal candidates share the load and runs are reproducible.

This module decides; it holds no state and does no IO.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from .topology import Location

__all__ = ["Candidate", "select_source"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """An eligible source as the policy sees it.

    Attributes:
        key: the table's id for the holder.
        replica: the holder's replica name.
        complete: complete or offload (True) vs partial (False).
        location: where the holder is.
        load: reader replicas its replica is serving now.
    """

    key: int
    replica: str
    complete: bool
    location: Location
    load: int


def select_source(
    reader: Location,
    candidates: Sequence[Candidate],
    rng: random.Random,
    prefer_replica: str | None = None,
) -> Candidate | None:
    """Pick the source for one reader shard, or None if there is no candidate.

    Args:
        reader: the reader's location.
        candidates: eligible holders, in a deterministic order.
        rng: the table's seeded random source (ties only).
        prefer_replica: the source replica chosen for the reader's other shards, if any.
    """
    if not candidates:
        return None
    dc = reader.datacenter
    pool = [c for c in candidates if c.location.datacenter == dc] or list(candidates)
    if prefer_replica is not None:
        for c in pool:
            if c.replica == prefer_replica:
                return c
    best_key = None
    best: list[Candidate] = []
    for c in pool:
        key = (c.load, not c.complete, c.location.host != reader.host)
        if best_key is None or key < best_key:
            best_key, best = key, [c]
        elif key == best_key:
            best.append(c)
    return best[0] if len(best) == 1 else best[rng.randrange(len(best))]
