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

    Holders live in buckets keyed by datacenter, then by level ``(load, partial)`` (kept as the
    int ``2 * load + partial``, which sorts the same). Selection
    walks the reader's datacenter's levels in policy order (fewest load, then complete before
    partial: the levels' sort order) and stops at the first bucket holding an eligible entry;
    within it the reader's host wins, then a seeded random pick. Only when the reader's
    datacenter has no eligible entry are the other datacenters' buckets walked, merged by the
    same order. Cost: the levels visited plus the ineligible entries skipped, not the number of
    holders. A holder whose level is unchanged costs one lookup to :meth:`put` (the table puts
    on every state and load change).
    """

    __slots__ = ("_dcs", "_where", "_loc", "_replica", "_by_host", "_by_replica")

    def __init__(self) -> None:
        # A level is one int, ``2 * load + partial``: ints sort as the (load, partial) pairs do,
        # and cost no tuple per put.
        self._dcs: dict[str, dict[int, list[int]]] = {}  # datacenter -> level -> entries
        self._where: dict[int, tuple[str, int, int]] = {}  # key -> (datacenter, level, position)
        self._loc: dict[int, Location] = {}
        self._replica: dict[int, str] = {}
        self._by_host: dict[tuple[str, str], dict[int, None]] = {}
        self._by_replica: dict[str, dict[int, None]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: int) -> bool:
        return key in self._where

    def put(self, key: int, replica: str, location: Location, load: int, complete: bool) -> None:
        """Insert ``key`` or move it to the bucket its current load and completeness give."""
        level = load + load if complete else load + load + 1
        dc = location.datacenter
        where_of = self._where
        where = where_of.get(key)
        if where is not None:
            old_dc, old, pos = where
            if old == level and old_dc == dc:
                return
            # _unlink, inline (a move is the common put: a load or state change)
            was_in = self._dcs[old_dc]
            bucket = was_in[old]
            last = bucket.pop()
            if last != key:  # swap-remove: move the last entry into the hole
                bucket[pos] = last
                where_of[last] = (old_dc, old, pos)
            elif not bucket:
                del was_in[old]
                if not was_in:
                    del self._dcs[old_dc]
        else:
            self._loc[key] = location
            self._replica[key] = replica
            host = (dc, location.host)
            by_host = self._by_host.get(host)
            if by_host is None:
                by_host = self._by_host[host] = {}
            by_host[key] = None
            by_replica = self._by_replica.get(replica)
            if by_replica is None:
                by_replica = self._by_replica[replica] = {}
            by_replica[key] = None
        levels = self._dcs.get(dc)
        if levels is None:
            levels = self._dcs[dc] = {}
        entries = levels.get(level)
        if entries is None:
            levels[level] = [key]
            where_of[key] = (dc, level, 0)
        else:
            where_of[key] = (dc, level, len(entries))
            entries.append(key)

    def remove(self, key: int) -> None:
        where = self._where.get(key)
        if where is None:
            return
        self._unlink(key, where)
        loc = self._loc.pop(key)
        replica = self._replica.pop(key)
        host = (loc.datacenter, loc.host)
        del self._by_host[host][key]
        if not self._by_host[host]:
            del self._by_host[host]
        del self._by_replica[replica][key]
        if not self._by_replica[replica]:
            del self._by_replica[replica]

    def _unlink(self, key: int, where: tuple[str, int, int]) -> None:
        dc, level, pos = where
        del self._where[key]
        levels = self._dcs[dc]
        entries = levels[level]
        last = entries.pop()
        if last != key:  # swap-remove: move the last entry into the hole
            entries[pos] = last
            self._where[last] = (dc, level, pos)
        elif not entries:
            del levels[level]
            if not levels:
                del self._dcs[dc]

    def in_datacenter(self, dc: str) -> tuple[bool, bool]:
        """(a complete or offload holder is in ``dc``, a partial holder is in ``dc``), among the
        grantable holders. Cost: the distinct levels in ``dc``."""
        whole = partial = False
        for level in self._dcs.get(dc, ()):
            if level & 1:
                partial = True
            else:
                whole = True
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
        levels = self._dcs.get(dc)
        best = self._best_in(reader, levels, rng, eligible) if levels is not None else None
        same_dc = best is not None
        if best is None:
            others = [d for d in self._dcs if d != dc]
            best = self._best_across(reader, others, rng, eligible) if others else None
            if best is None:
                return None
        if prefer_replica is not None:
            for key in self._by_replica.get(prefer_replica, ()):
                if (self._loc[key].datacenter == dc) == same_dc and eligible(key):
                    return key
        return best

    def _local(self, reader: Location, eligible: Callable[[int], bool]) -> dict[int, list[int]] | None:
        """The eligible entries on the reader's host, by level (None: none there), in the host's
        insertion order: looked at once per selection, not once per level walked."""
        local_keys = self._by_host.get((reader.datacenter, reader.host))
        if not local_keys:
            return None
        where = self._where
        by_level: dict[int, list[int]] = {}
        for k in local_keys:
            if eligible(k):
                level = where[k][1]
                keys = by_level.get(level)
                if keys is None:
                    by_level[level] = [k]
                else:
                    keys.append(k)
        return by_level

    def _best_in(
        self, reader: Location, levels: dict[int, list[int]], rng: random.Random, eligible: Callable[[int], bool]
    ) -> int | None:
        """The pick among one datacenter's buckets (the reader's: the common case)."""
        local = self._local(reader, eligible)
        for level in sorted(levels):
            if local:
                here = local.get(level)
                if here:
                    return here[0] if len(here) == 1 else here[rng.randrange(len(here))]
            b = levels[level]
            total = len(b)
            start = rng.randrange(total)
            for step in range(total):
                key = b[(start + step) % total]
                if eligible(key):
                    return key
        return None

    def _best_across(self, reader: Location, dcs: list[str], rng: random.Random, eligible: Callable[[int], bool]) -> int | None:
        """The pick among several datacenters' buckets, merged level by level."""
        if len(dcs) == 1:
            return self._best_in(reader, self._dcs[dcs[0]], rng, eligible)
        all_levels = [self._dcs[d] for d in dcs]
        local = self._local(reader, eligible)
        for level in sorted({level for levels in all_levels for level in levels}):
            buckets = [b for levels in all_levels if (b := levels.get(level))]
            if local:
                here = local.get(level)
                if here:
                    return here[0] if len(here) == 1 else here[rng.randrange(len(here))]
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
