"""The server process's collector pacing (tensorhub.runtime.collector): passes are watched per
generation, long-lived objects are frozen out of the passes, and frozen cyclic garbage is still
reclaimed, so memory stays bounded."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any, Iterator

import pytest

from tensorhub.errors import InvalidArgument
from tensorhub.runtime.collector import CollectorPacing, CollectorWatch
from tensorhub.runtime.metrics import parse_text
from tensorhub.runtime.server import ServerActor, ServerConfig, serve


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Cycle:
    """A container object in a reference cycle (only the cyclic collector frees it)."""

    __slots__ = ("me", "__weakref__")

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def clean_gc() -> Iterator[None]:
    """The collector's process-wide state as the test found it (no frozen objects, thresholds)."""
    if gc.get_freeze_count():
        pytest.skip("objects already frozen in this process")
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_the_watch_counts_each_generations_passes(clean_gc: None) -> None:
    watch = CollectorWatch()
    watch.install()
    try:
        before = [g.passes for g in watch.generations]
        gc.collect(0)
        gc.collect(1)
        gc.collect(2)
        gc.collect(2)
    finally:
        watch.remove()
    after = [g.passes for g in watch.generations]
    # CPython may run a pass of its own meanwhile; ours are there at least
    assert after[0] - before[0] >= 1 and after[1] - before[1] >= 1 and after[2] - before[2] >= 2
    g2 = watch.generations[2]
    assert g2.seconds > 0 and g2.longest > 0 and g2.cpu_seconds >= 0 and sum(g2.buckets) == g2.passes
    gc.collect(2)  # removed: not counted any more
    assert watch.generations[2].passes == after[2]


def test_pacing_freezes_the_start_up_heap_and_what_survives_each_period(clean_gc: None) -> None:
    clock = _Clock()
    thresholds = gc.get_threshold()
    pacing = CollectorPacing(freeze_every=5.0, full_every=600.0, full_growth=1.5, clock=clock)
    pacing.start()
    try:
        assert pacing.full_passes == 1 and gc.get_freeze_count() > 0
        # generation 2 is the pacing's: CPython runs no full pass of its own
        assert gc.get_threshold()[:2] == thresholds[:2] and gc.get_threshold()[2] >= 1 << 30
        frozen = gc.get_freeze_count()
        kept = [[i] for i in range(5000)]  # long-lived records arrive
        clock.now = 1.0
        assert pacing.tick() is None  # not yet a period
        clock.now = 5.0
        assert pacing.tick() == "freeze"
        assert gc.get_freeze_count() >= frozen + len(kept)
        clock.now = 6.0
        assert pacing.tick() is None
        clock.now = 600.0
        assert pacing.tick() == "full" and pacing.full_passes == 2
    finally:
        pacing.stop()
    assert gc.get_freeze_count() == 0  # stop gives every object back to the collector
    assert gc.get_threshold() == thresholds


def test_frozen_cyclic_garbage_is_reclaimed_and_memory_stays_bounded(clean_gc: None) -> None:
    """Cyclic records frozen while they lived, then dropped, round after round (a churn of
    sessions): the pacing's full passes free them; without them the frozen heap only grows."""

    def churn(pacing: CollectorPacing, clock: _Clock, rounds: int, per_round: int) -> tuple[list[int], Any]:
        counts = []
        first = None
        for r in range(rounds):
            live = [_Cycle() for _ in range(per_round)]
            if first is None:
                first = weakref.ref(live[0])
            clock.now += 5.0
            pacing.tick()  # frozen while alive
            del live  # now cyclic garbage inside the frozen heap
            counts.append(gc.get_freeze_count())
        return counts, first

    rounds = 10
    clock = _Clock()
    pacing = CollectorPacing(freeze_every=5.0, full_every=1e9, full_growth=1.3, full_floor=0, clock=clock)
    pacing.start()
    try:
        base = pacing.frozen_after_full
        # a round is an eighth of the heap frozen at the start, so that 1.3x falls due every few
        # rounds whatever the process holds (an xdist worker of the whole suite: 835k objects)
        per_round = max(10_000, base // 8)
        counts, first = churn(pacing, clock, rounds, per_round)
        full = pacing.full_passes
    finally:
        pacing.stop()
    gc.collect()
    # a full pass falls due once the frozen heap outgrows 1.3x what lived at the last one (one
    # round's records were alive then), and one round's records arrive after the check
    bound = 1.3 * (base + per_round) + per_round
    assert full >= 2, f"no full pass in {rounds} rounds of {per_round} dropped cycles (frozen: {counts})"
    assert max(counts) <= bound, f"the frozen heap grew past {bound:,.0f}: {counts}"
    assert first() is None  # the first round's records were freed

    # the same churn with full passes ruled out: the frozen heap holds every dropped cycle
    clock = _Clock()
    pacing = CollectorPacing(freeze_every=5.0, full_every=1e9, full_growth=1e9, clock=clock)
    pacing.start()
    try:
        base = pacing.frozen_after_full
        counts, first = churn(pacing, clock, rounds, per_round)
        assert counts[-1] >= base + (rounds - 1) * per_round
        assert first() is not None  # still held, frozen
    finally:
        pacing.stop()
    gc.collect()
    assert first() is None


def test_pacing_refuses_bad_periods() -> None:
    with pytest.raises(InvalidArgument, match="freeze_every"):
        CollectorPacing(freeze_every=0)
    with pytest.raises(InvalidArgument, match="full_every"):
        CollectorPacing(full_every=-1)
    with pytest.raises(InvalidArgument, match="full_growth"):
        CollectorPacing(full_growth=1.0)
    with pytest.raises(InvalidArgument, match="full_floor"):
        CollectorPacing(full_floor=-1)


def test_watched_pacing_leaves_the_collector_alone_and_the_server_reports_its_passes(clean_gc: None) -> None:
    pacing = CollectorPacing(pace=False)
    server = ServerActor(ServerConfig(bind="tcp://127.0.0.1:0"), collector=pacing)
    try:
        pacing.start()
        gc.collect(2)
        assert gc.get_freeze_count() == 0 and pacing.tick() is None
        parsed = parse_text(server.registry.render())
        count = parsed["tensorhub_gc_pause_seconds_count"]
        assert count[(("generation", "2"),)] >= 1
        assert parsed["tensorhub_gc_frozen_objects"][()] == 0
        assert (("generation", "0"),) in parsed["tensorhub_gc_cpu_seconds_total"]
    finally:
        pacing.stop()
        server.ctx.term()


def test_serve_refuses_an_unknown_gc_mode() -> None:
    with pytest.raises(InvalidArgument, match="gc_mode"):
        asyncio.run(serve(ServerConfig(bind="tcp://127.0.0.1:0"), gc_mode="off"))
