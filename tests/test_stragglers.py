"""Stragglers (issue 23), sans-IO: a source alive but slow, or stalled without closing, is told
from a busy one by the progress its readers report, and its readers are granted elsewhere
keeping what they verified; a reader that caught up with a slow relay moves too."""

from __future__ import annotations

from tensorhub.core import messages as m
from tensorhub.core.invariants import check_invariants
from tensorhub.core.table import TableConfig

from .table_driver import Driver, make_layout

MB = 1_000_000
BIG = make_layout(640 * MB)
TOTAL = BIG.total_bytes
CONFIG = TableConfig(straggler_window=5.0, straggler_ratio=0.25)


def driver() -> Driver:
    d = Driver(config=CONFIG)
    d.advance(11)  # past the start-up grace period
    return d


def source(d: Driver, name: str, version: int = 1):
    s = d.shard(name, layout=BIG)
    s.expect_ok(s.publish(version))
    return s


def run(d: Driver, seconds: float, rates: dict, grants: dict, step: float = 0.5) -> None:
    """Let time pass; each reader in ``rates`` verifies ``rates[reader]`` bytes/s under its
    grant (reporting progress every step) and heartbeats; re-grants land in ``grants``."""
    for _ in range(int(seconds / step)):
        d.clock.t += step
        for r, rate in rates.items():
            for g in r.take(m.Grant):
                grants[r] = g
            g = grants[r]
            verified = d.table.grants[g.grant].reader.verified if g.grant in d.table.grants else 0
            if rate and verified < TOTAL:
                r.progress(g, min(TOTAL, verified + int(rate * step)))
        for s in d.shards.values():
            if s.session in d.table.sessions:
                s.send(m.Heartbeat(0, (s.session,)))
                s.take(m.HeartbeatAck)
        d.deliver(d.table.tick())
        for r in rates:
            for g in r.take(m.Grant):
                grants[r] = g
        check_invariants(d.table)


def test_a_slow_source_loses_its_reader_to_a_fast_one_keeping_what_was_verified():
    d = driver()
    t1, t2 = source(d, "t1"), source(d, "t2")
    r1, r2 = d.shard("r1", layout=BIG), d.shard("r2", layout=BIG)
    r1.replicate(1)
    r2.replicate(1)
    grants = {r1: r1.grant(), r2: r2.grant()}
    assert grants[r1].source.session != grants[r2].source.session  # one reader per source
    slow_src = grants[r2].source.session
    run(d, 6.0, {r1: 5 * MB, r2: 0.2 * MB}, grants)  # t?'s link runs at 4 % of the other's
    revoked = r2.take(m.Revoke)
    assert len(revoked) == 1 and "straggler" in revoked[0].reason, revoked
    assert grants[r2].source.session != slow_src  # moved to the fast source
    moved = d.table.grants[grants[r2].grant]
    assert moved.start >= 1 * MB  # the new grant resumes from what the reader verified, not from zero
    assert d.table.stats["stragglers"] == 1
    assert not r1.take(m.Revoke)


def test_a_busy_source_is_not_slow():
    """Four readers share one source's link, each at 22 % of the other source's single reader
    (each grant alone would look slow): the source's aggregate is 90 % of the reference, so it
    is busy, not slow, and nobody moves."""
    d = Driver(config=TableConfig(straggler_window=5.0, straggler_ratio=0.25, pipeline=False))
    d.advance(11)
    source(d, "t1")
    readers = [d.shard(f"r{i}", layout=BIG) for i in range(4)]
    grants = {}
    for r in readers:
        r.replicate(1)
        grants[r] = r.grant()
    t2 = source(d, "t2")
    fast = d.shard("fast", layout=BIG)
    fast.replicate(1)
    grants[fast] = fast.grant()
    assert grants[fast].source.session == t2.session
    assert {g.source.session for r, g in grants.items() if r is not fast} == {d.shards[next(iter(d.shards))].session}
    rates = {r: 4.5 * MB for r in readers}
    rates[fast] = 20 * MB
    run(d, 8.0, rates, grants)
    assert all(not r.take(m.Revoke) for r in (*readers, fast))
    assert d.table.stats["stragglers"] == 0


def test_a_stalled_source_without_closing_is_left_and_none_is_left_without_a_source():
    d = driver()
    t1, t2 = source(d, "t1"), source(d, "t2")
    r1, r2 = d.shard("r1", layout=BIG), d.shard("r2", layout=BIG)
    r1.replicate(1)
    r2.replicate(1)
    grants = {r1: r1.grant(), r2: r2.grant()}
    run(d, 6.0, {r1: 5 * MB, r2: 0}, grants)  # r2's source stalls (alive, silent) from the start
    assert not r2.take(m.Revoke)  # no first report yet: its source may only be busy, for three windows
    run(d, 10.0, {r1: 5 * MB, r2: 0}, grants)
    (rv,) = r2.take(m.Revoke)
    assert "stalled" in rv.reason
    # alone with a stalled source (no other holder): nothing to move to, so it stays
    d2 = driver()
    source(d2, "t1")
    r = d2.shard("r", layout=BIG)
    r.replicate(1)
    g = {r: r.grant()}
    run(d2, 12.0, {r: 0}, g)
    assert not r.take(m.Revoke)


def test_readers_caught_up_with_a_slow_relay_move_to_a_faster_source():
    """A relay pulls slowly (its link at 4 % of another reader's); a reader pipelined behind it
    has verified all the relay has: it is held back by the relay's own pull, and moves to a
    complete source."""
    d = driver()
    source(d, "t")
    relay = d.shard("relay", layout=BIG)
    relay.replicate(1)
    grants = {relay: relay.grant()}
    run(d, 1.0, {relay: 0.4 * MB}, grants)
    down = d.shard("down", layout=BIG)
    down.replicate(1)
    grants[down] = down.grant()
    assert grants[down].source.replica == "relay"  # pipelined behind the relay
    source(d, "t2")
    ref = d.shard("ref", layout=BIG)  # another reader, at the links' real rate: the reference
    ref.replicate(1)
    grants[ref] = ref.grant()
    run(d, 7.0, {relay: 0.4 * MB, down: 0.4 * MB, ref: 10 * MB}, grants)
    revoked = down.take(m.Revoke)
    assert revoked and "straggler" in revoked[0].reason, revoked
    assert grants[down].source.replica != "relay"
    assert d.table.grants[grants[down].grant].start > 0  # it keeps what it verified behind the relay


def test_behind_a_relay_with_a_slow_link_the_first_reader_moves_and_the_rest_follow_it():
    """trainer -> relay -> d1 -> d2, the relay's own link slowed (its pull stalls; nothing else
    serves but the trainer): d1 moves to the trainer; d2, behind d1, follows it and is never
    granted the slow relay (it used to be, then moved a second time a window later)."""
    d = driver()
    source(d, "t")
    relay = d.shard("relay", layout=BIG)
    relay.replicate(1)
    grants = {relay: relay.grant()}
    run(d, 1.0, {relay: 10 * MB}, grants)
    d1 = d.shard("d1", layout=BIG)
    d1.replicate(1)
    grants[d1] = d1.grant()
    d2 = d.shard("d2", layout=BIG)
    d2.replicate(1)
    grants[d2] = d2.grant()
    assert (grants[d1].source.replica, grants[d2].source.replica) == ("relay", "d1")  # the pipelined chain
    run(d, 6.0, {relay: 0, d1: 0, d2: 0}, grants)  # the relay's link at next to nothing: everyone stalls
    (rv,) = d1.take(m.Revoke)
    assert "straggler" in rv.reason and "relay" not in grants[d1].source.replica
    assert grants[d1].source.replica == "t"
    assert not d2.take(m.Revoke) and grants[d2].source.replica == "d1"  # it follows d1
    run(d, 6.0, {relay: 0, d1: 10 * MB, d2: 10 * MB}, grants)
    assert not d2.take(m.Revoke) and not d1.take(m.Revoke)  # (the stalled relay may move, behind them)


def test_a_reader_that_stays_behind_a_slow_puller_avoids_it_when_it_moves():
    """The relay's pull is slow and the relay itself moves (another complete source exists):
    its caught-up reader still moves, and not to the relay (moving a holder whose own link is
    slow does not make it fast), keeping what it verified."""
    d = driver()
    source(d, "t")
    relay = d.shard("relay", layout=BIG)
    relay.replicate(1)
    grants = {relay: relay.grant()}
    run(d, 1.0, {relay: 0.4 * MB}, grants)
    down = d.shard("down", layout=BIG)
    down.replicate(1)
    grants[down] = down.grant()
    source(d, "t2")
    ref = d.shard("ref", layout=BIG)
    ref.replicate(1)
    grants[ref] = ref.grant()
    run(d, 7.0, {relay: 0.4 * MB, down: 0.4 * MB, ref: 10 * MB}, grants)
    assert [r.reason for r in down.take(m.Revoke)][:1] and grants[down].source.replica not in ("relay",)
    assert d.table.grants[grants[down].grant].start > 0


def test_a_late_progress_report_is_not_a_stall():
    """A reader reports every eighth of the shard: seconds of silence between two reports at a
    steady rate are not a stall, even with a window shorter than a report interval."""
    d = Driver(config=TableConfig(straggler_window=1.0, straggler_ratio=0.25))
    d.advance(11)
    source(d, "t1")
    source(d, "t2")
    r1, r2 = d.shard("r1", layout=BIG), d.shard("r2", layout=BIG)
    r1.replicate(1)
    r2.replicate(1)
    grants = {r1: r1.grant(), r2: r2.grant()}
    step = TOTAL // 8

    def wait(ticks: int) -> None:
        for _ in range(ticks):
            d.clock.t += 0.4
            for s in d.shards.values():
                s.send(m.Heartbeat(0, (s.session,)))
                s.take(m.HeartbeatAck)
            d.deliver(d.table.tick())

    for k in range(1, 7):  # the first eighth after 0.8 s, then one every 1.6 s (slower: a busy machine)
        wait(2 if k == 1 else 4)
        for r in (r1, r2):
            r.progress(grants[r], k * step)
    assert not r1.take(m.Revoke) and not r2.take(m.Revoke)
    assert d.table.stats["stragglers"] == 0
    wait(2)
    r1.progress(grants[r1], 7 * step)
    wait(8)  # r2's source went silent: 4 s without a report (twice its intervals) is a stall
    assert any("stalled" in rv.reason for rv in r2.take(m.Revoke))


def _slow_relay_chain() -> tuple[Driver, dict, object, object, object]:
    """trainer -> relay -> d1 -> d2; the relay verified 10 MB, then its link all but stops: d1
    moves to the trainer (d2 follows d1). Returns the driver, the grants and relay, d1, d2."""
    d = driver()
    source(d, "t")
    relay = d.shard("relay", layout=BIG)
    relay.replicate(1)
    grants = {relay: relay.grant()}
    run(d, 1.0, {relay: 10 * MB}, grants)
    d1, d2 = d.shard("d1", layout=BIG), d.shard("d2", layout=BIG)
    for r in (d1, d2):
        r.replicate(1)
        grants[r] = r.grant()
    assert (grants[d1].source.replica, grants[d2].source.replica) == ("relay", "d1")
    run(d, 6.0, {relay: 0, d1: 0, d2: 0}, grants)
    assert d1.take(m.Revoke) and grants[d1].source.replica == "t"
    assert not d2.take(m.Revoke) and grants[d2].source.replica == "d1"
    return d, grants, relay, d1, d2


def test_a_reader_moved_off_a_slow_relay_may_drain_its_reads_from_it_before_reporting():
    """d1's read in flight from the slowed relay lands at the relay's pace before its new grant's
    reads begin: its first report on the new grant comes late. Neither it nor d2, behind it, is
    moved for that (d2 used to be, to the trainer beside d1: two pulls on one link instead of a
    pipeline); they move on once the reports come."""
    d, grants, relay, d1, d2 = _slow_relay_chain()
    run(d, 25.0, {relay: 0, d1: 0, d2: 0}, grants)  # five windows without a report from d1
    assert not d1.take(m.Revoke) and not d2.take(m.Revoke)
    assert grants[d2].source.replica == "d1" and d.table.stats["stragglers"] == 1
    run(d, 10.0, {relay: 0, d1: 10 * MB, d2: 10 * MB}, grants)
    assert not d1.take(m.Revoke) and not d2.take(m.Revoke)


def test_a_slow_relay_is_not_moved_onto_readers_that_have_less_than_it():
    """The stalled relay's own pull has no fast alternative: d1 (moved to the trainer) and d2 are
    partial and behind it, so pulling from them would only hold it back again; it stays (it used
    to be moved to d1 as soon as d1 left it)."""
    d, grants, relay, d1, d2 = _slow_relay_chain()
    run(d, 6.0, {relay: 0, d1: 1 * MB, d2: 1 * MB}, grants)  # d1 at ~6 MB: behind the relay's 10 MB
    assert not relay.take(m.Revoke) and grants[relay].source.replica == "t"
    assert d.table.stats["stragglers"] == 1


def test_behind_a_relay_far_ahead_whose_link_slows_the_next_reader_moves_and_the_rest_follow_it():
    """trainer -> relay -> d1 -> d2 with the relay far ahead of d1 (d1 is judged on its own pull,
    not as caught up); the relay's link stops both ways: its own pull and d1's from it stall.
    d1's pull is slow because its source's is (the relay's link explains both): d1 moves to the
    trainer and d2, behind d1, follows it; nobody is granted the relay (d2 used to avoid d1 and be
    granted the relay, the least loaded holder)."""
    d = driver()
    source(d, "t")
    relay = d.shard("relay", layout=BIG)
    relay.replicate(1)
    grants = {relay: relay.grant()}
    run(d, 9.0, {relay: 10 * MB}, grants)  # 90 MB: more than a report step ahead of d1
    d1, d2 = d.shard("d1", layout=BIG), d.shard("d2", layout=BIG)
    for r in (d1, d2):
        r.replicate(1)
        grants[r] = r.grant()
    assert (grants[d1].source.replica, grants[d2].source.replica) == ("relay", "d1")
    run(d, 2.0, {relay: 10 * MB, d1: 10 * MB, d2: 10 * MB}, grants)
    run(d, 10.0, {relay: 0, d1: 0, d2: 0}, grants)
    (rv,) = d1.take(m.Revoke)
    assert "straggler" in rv.reason and grants[d1].source.replica == "t"
    assert not d2.take(m.Revoke) and grants[d2].source.replica == "d1"  # it follows d1
    assert not relay.take(m.Revoke)  # d1 and d2 have less than the relay: no faster source for it
    assert not any(g.source.replica.name == "relay" for g in d.table.grants.values())
    assert d.table.stats["stragglers"] == 1
