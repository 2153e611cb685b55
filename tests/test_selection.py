"""Source selection: the bucketed SourceIndex picks what the reference policy picks."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from tensorhub.core.topology import Location
from tensorhub.scheduling.selection import Candidate, SourceIndex, select_source

LOCS = [Location(dc, f"{dc}-h{h}", "") for dc in ("east", "west") for h in range(3)]

candidate = st.tuples(st.sampled_from(range(len(LOCS))), st.integers(0, 3), st.booleans(), st.sampled_from("abcdefgh"))


def _class(c: Candidate, reader: Location) -> tuple:
    return (c.location.datacenter != reader.datacenter, c.load, not c.complete, c.location.host != reader.host)


@given(
    pop=st.lists(candidate, max_size=30),
    reader=st.sampled_from(LOCS),
    ineligible=st.sets(st.integers(0, 29)),
    prefer=st.none() | st.sampled_from("abcdefgh"),
    seed=st.integers(0, 1000),
)
def test_index_follows_the_policy(pop, reader, ineligible, prefer, seed):
    cands, index = [], SourceIndex()
    for key, (loc, load, complete, replica) in enumerate(pop):
        c = Candidate(key, replica, complete, LOCS[loc], load)
        index.put(key, replica, c.location, 0, True)  # put, then move to the real bucket
        index.put(key, replica, c.location, load, complete)
        cands.append(c)
    eligible = [c for c in cands if c.key not in ineligible]
    ref = select_source(reader, eligible, random.Random(seed), prefer)
    got = index.select(reader, random.Random(seed), lambda k: k not in ineligible, prefer)
    if ref is None:
        assert got is None
        return
    assert got is not None and got not in ineligible
    chosen = cands[got]
    if prefer is not None and ref.replica == prefer:
        assert chosen.replica == prefer
        assert (chosen.location.datacenter == reader.datacenter) == (ref.location.datacenter == reader.datacenter)
    else:
        assert _class(chosen, reader) == _class(ref, reader)


@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(0, 2), st.booleans()), max_size=60))
def test_index_stays_consistent_under_moves_and_removals(ops):
    index, live = SourceIndex(), {}
    for add, key, load, complete in ops:
        if add:
            index.put(key, f"r{key}", LOCS[key % len(LOCS)], load, complete)
            live[key] = (load, complete)
        else:
            index.remove(key)
            live.pop(key, None)
    assert len(index) == len(live)
    for key in range(10):
        assert (key in index) == (key in live)
    seen = set()
    for _ in range(len(live) + 1):
        k = index.select(LOCS[0], random.Random(len(seen)), lambda k: k not in seen)
        if k is None:
            break
        seen.add(k)
    assert seen == set(live)


def test_same_datacenter_then_load_then_complete_then_host():
    reader = LOCS[0]
    far = Candidate(1, "far", True, LOCS[3], 0)
    busy = Candidate(2, "busy", True, LOCS[1], 2)
    partial = Candidate(3, "partial", False, LOCS[1], 0)
    idle = Candidate(4, "idle", True, LOCS[2], 0)
    local = Candidate(5, "local", True, LOCS[0], 0)
    rng = random.Random(0)
    assert select_source(reader, [far], rng) is far
    assert select_source(reader, [far, busy], rng) is busy
    assert select_source(reader, [busy, partial], rng) is partial
    assert select_source(reader, [partial, idle], rng) is idle
    assert select_source(reader, [idle, local], rng) is local
    assert select_source(reader, [idle, local], rng, prefer_replica="idle") is idle
    assert select_source(reader, [], rng) is None
