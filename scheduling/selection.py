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
from typing import Callable, Sequence

from tensorhub.core.topology import Location

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


class SourceIndex:
    """The holders of one (version, shard), bucketed so that :meth:`select` follows the same
    policy as :func:`select_source` without looking at every holder.

    Holders live in buckets keyed by (datacenter, load, partial). Selection walks the reader's
    datacenter's buckets in policy order (fewest load, then complete before partial) and stops
    at the first bucket holding an eligible entry; within it the reader's host wins, then a
    seeded random pick. Only when the reader's datacenter has no eligible entry are the other
    datacenters' buckets walked, merged by the same order. Cost: the buckets visited plus the
    ineligible entries skipped, not the number of holders.
    """

    __slots__ = ("_buckets", "_where", "_loc", "_replica", "_by_host", "_by_replica", "_loads")

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, int, bool], list[int]] = {}
        self._where: dict[int, tuple[tuple[str, int, bool], int]] = {}  # key -> (bucket, position)
        self._loc: dict[int, Location] = {}
        self._replica: dict[int, str] = {}
        self._by_host: dict[tuple[str, str], dict[int, None]] = {}
        self._by_replica: dict[str, dict[int, None]] = {}
        self._loads: dict[str, dict[int, int]] = {}  # datacenter -> load -> entries

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: int) -> bool:
        return key in self._where

    def put(self, key: int, replica: str, location: Location, load: int, complete: bool) -> None:
        """Insert ``key`` or move it to the bucket its current load and completeness give."""
        bucket = (location.datacenter, load, not complete)
        where = self._where.get(key)
        if where is not None:
            if where[0] == bucket:
                return
            self._unlink(key)
        entries = self._buckets.get(bucket)
        if entries is None:
            entries = self._buckets[bucket] = []
        self._where[key] = (bucket, len(entries))
        entries.append(key)
        loads = self._loads.setdefault(location.datacenter, {})
        loads[load] = loads.get(load, 0) + 1
        if key not in self._loc:
            self._loc[key] = location
            self._replica[key] = replica
            self._by_host.setdefault((location.datacenter, location.host), {})[key] = None
            self._by_replica.setdefault(replica, {})[key] = None

    def remove(self, key: int) -> None:
        if key not in self._where:
            return
        self._unlink(key)
        loc = self._loc.pop(key)
        replica = self._replica.pop(key)
        host = (loc.datacenter, loc.host)
        del self._by_host[host][key]
        if not self._by_host[host]:
            del self._by_host[host]
        del self._by_replica[replica][key]
        if not self._by_replica[replica]:
            del self._by_replica[replica]

    def _unlink(self, key: int) -> None:
        bucket, pos = self._where.pop(key)
        entries = self._buckets[bucket]
        last = entries.pop()
        if last != key:  # swap-remove: move the last entry into the hole
            entries[pos] = last
            self._where[last] = (bucket, pos)
        if not entries:
            del self._buckets[bucket]
        dc, load, _ = bucket
        loads = self._loads[dc]
        loads[load] -= 1
        if not loads[load]:
            del loads[load]
            if not loads:
                del self._loads[dc]

    def in_datacenter(self, dc: str) -> tuple[bool, bool]:
        """(a complete or offload holder is in ``dc``, a partial holder is in ``dc``), among the
        grantable holders. Cost: the distinct loads in ``dc``."""
        whole = partial = False
        for load in self._loads.get(dc, ()):
            whole = whole or (dc, load, False) in self._buckets
            partial = partial or (dc, load, True) in self._buckets
        return whole, partial

    def select(
        self,
        reader: Location,
        rng: random.Random,
        eligible: Callable[[int], bool],
        prefer_replica: str | None = None,
    ) -> int | None:
        """The key of the source for a reader at ``reader``, or None.

        Args:
            eligible: ``key -> bool``; entries it refuses are skipped (excluded, downstream,
                the reader's own replica, ...).
            prefer_replica: the source replica chosen for the reader's other shards.
        """
        dc = reader.datacenter
        best = self._best(reader, [dc], rng, eligible) if dc in self._loads else None
        same_dc = best is not None
        if best is None:
            others = [d for d in self._loads if d != dc]
            best = self._best(reader, others, rng, eligible) if others else None
            if best is None:
                return None
        if prefer_replica is not None:
            for key in self._by_replica.get(prefer_replica, ()):
                if (self._loc[key].datacenter == dc) == same_dc and eligible(key):
                    return key
        return best

    def _best(self, reader: Location, dcs: list[str], rng: random.Random, eligible: Callable[[int], bool]) -> int | None:
        if len(dcs) == 1:
            loads = sorted(self._loads.get(dcs[0], ()))
        else:
            loads = sorted({load for d in dcs for load in self._loads.get(d, ())})
        local_keys = self._by_host.get((reader.datacenter, reader.host))
        for load in loads:
            for partial in (False, True):
                buckets = [b for d in dcs if (b := self._buckets.get((d, load, partial)))]
                if not buckets:
                    continue
                if local_keys:
                    level = (load, partial)
                    local = [k for k in local_keys if self._where[k][0][1:] == level and eligible(k)]
                    if local:
                        return local[0] if len(local) == 1 else local[rng.randrange(len(local))]
                if len(buckets) == 1:
                    b = buckets[0]
                    total = len(b)
                    start = rng.randrange(total)
                    for step in range(total):
                        key = b[(start + step) % total]
                        if eligible(key):
                            return key
                    continue
                total = sum(len(b) for b in buckets)
                start = rng.randrange(total)
                for step in range(total):
                    i = (start + step) % total
                    for b in buckets:
                        if i < len(b):
                            key = b[i]
                            break
                        i -= len(b)
                    if eligible(key):
                        return key
        return None
