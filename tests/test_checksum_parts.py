"""Checksums declared in parts (issue 37): the table relays each part of a publisher's checksums
to the readers pulling without them, keeps the declared prefix for readers granted later, and
refuses a part that leaves a gap, overruns the layout, or differs from what was declared."""

from __future__ import annotations

import itertools

import pytest

from tensorhub.core import errors as e
from tensorhub.core import messages as m
from tensorhub.core.invariants import assert_invariants

from .table_driver import Driver, make_layout

LAYOUT = make_layout(3 << 20, 2 << 20, chunk=1 << 20)  # 5 checksum units
N = LAYOUT.checksum_count()
SUMS = tuple(range(101, 101 + N))


@pytest.fixture
def d() -> Driver:
    drv = Driver()
    drv.advance(11)  # past the start-up grace period
    yield drv
    assert_invariants(drv.table)


def _part(s, version: int, first: int, values: tuple[int, ...]) -> int:
    return s.request(m.DeclareChecksumsPart, s.session, version, first, values)


def _publisher_and_reader(d: Driver):
    t = d.shard("trainer", layout=LAYOUT)
    t.expect_ok(t.publish(1))
    r = d.shard("r", layout=LAYOUT)
    r.replicate(1)
    g = r.grant()
    assert g.checksums is None
    return t, r, g


def test_each_part_reaches_the_reader_pulling_without_checksums_then_the_whole(d):
    assert N == 5
    t, r, g = _publisher_and_reader(d)
    t.expect_ok(_part(t, 1, 0, SUMS[:2]))
    (p,) = r.take(m.ChecksumsPartReady)
    assert (p.grant, p.version, p.first, p.checksums) == (g.grant, 1, 0, SUMS[:2])
    t.expect_ok(_part(t, 1, 1, SUMS[1:4]))  # overlaps what was declared: only the new ones travel
    (p,) = r.take(m.ChecksumsPartReady)
    assert (p.first, p.checksums) == (2, SUMS[2:4])
    t.expect_ok(_part(t, 1, 0, SUMS[:3]))  # nothing new: nothing sent
    assert r.take(m.ChecksumsPartReady) == []
    t.expect_ok(t.request(m.DeclareChecksums, t.session, 1, SUMS))
    (ready,) = r.take(m.ChecksumsReady)
    assert ready.checksums == SUMS
    assert d.table.models["actor"].versions[1].prefix == {}


def test_a_reader_granted_after_parts_gets_the_declared_prefix_with_its_grant(d):
    t = d.shard("trainer", layout=LAYOUT)
    t.expect_ok(t.publish(1))
    t.expect_ok(_part(t, 1, 0, SUMS[:3]))
    r = d.shard("r", layout=LAYOUT)
    r.replicate(1)
    g = r.grant()
    (p,) = r.take(m.ChecksumsPartReady)
    assert (p.grant, p.first, p.checksums) == (g.grant, 0, SUMS[:3])


@pytest.mark.parametrize(
    "first, values, error, words",
    [
        (3, SUMS[3:4], e.InvalidArgument, "gap"),  # 2 declared: unit 2 would be missing
        (4, SUMS[4:] + (9,), e.InvalidArgument, "5 checksum units"),  # past the layout's units
    ],
)
def test_a_part_with_a_gap_or_past_the_layout_is_refused_and_changes_nothing(d, first, values, error, words):
    t, r, _ = _publisher_and_reader(d)
    t.expect_ok(_part(t, 1, 0, SUMS[:2]))
    r.take(m.ChecksumsPartReady)
    err = t.expect_error(_part(t, 1, first, values), error)
    assert words in str(err) and "actor" in str(err)
    assert r.take(m.ChecksumsPartReady) == []
    assert d.table.models["actor"].versions[1].prefix == {0: SUMS[:2]}


def test_a_part_that_differs_from_the_declared_prefix_quarantines_its_holder(d):
    t, r, _ = _publisher_and_reader(d)
    t.expect_ok(_part(t, 1, 0, SUMS[:2]))
    t.expect_error(_part(t, 1, 1, (999, SUMS[2])), e.VersionConflict)
    assert t.take(m.Quarantined)


def test_a_whole_declaration_that_differs_from_the_parts_is_a_conflict(d):
    t, _, _ = _publisher_and_reader(d)
    t.expect_ok(_part(t, 1, 0, SUMS[:2]))
    t.expect_error(t.request(m.DeclareChecksums, t.session, 1, (7,) + SUMS[1:]), e.VersionConflict)
    assert t.take(m.Quarantined)


def test_another_publisher_of_the_version_must_agree_with_the_parts(d):
    t = d.shard("trainer", layout=LAYOUT)
    t.expect_ok(t.publish(1))
    t.expect_ok(_part(t, 1, 0, SUMS[:2]))
    other = d.shard("other", layout=LAYOUT)
    other.expect_ok(other.publish(1))
    other.expect_error(other.request(m.DeclareChecksums, other.session, 1, (5,) * N), e.VersionConflict)


def test_parts_of_a_version_not_published_are_a_contract_violation(d):
    t = d.shard("trainer", layout=LAYOUT)
    t.expect_error(_part(t, 1, 0, SUMS[:1]), e.ContractViolation)
    t.expect_ok(t.publish(1))
    t.expect_error(_part(t, 2, 0, SUMS[:1]), e.ContractViolation)


def test_a_part_after_the_whole_declaration_must_agree_and_is_not_relayed(d):
    t, r, _ = _publisher_and_reader(d)
    t.expect_ok(t.request(m.DeclareChecksums, t.session, 1, SUMS))
    r.take(m.ChecksumsReady)
    t.expect_ok(_part(t, 1, 2, SUMS[2:4]))
    assert r.take(m.ChecksumsPartReady) == []


# --- end to end: a publisher declaring parts, readers verifying against them --------------------

MIB = 1 << 20


def _weights(seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    # six 2 MiB tensors (not packed): one checksum unit each
    return {f"w{i}": torch.randint(0, 255, (2 * MIB,), dtype=torch.uint8, generator=g) for i in range(6)}


@pytest.mark.parametrize("unit", [0, 3, 5])  # in the first part, in the last part, in the units declared only whole
def test_reads_are_verified_against_parts_and_a_byte_flipped_in_any_part_is_refused(inproc_server, monkeypatch, seed, unit):
    """The publisher's hash stops after its parts (units 0-3 of 6) until the test lets it go on:
    the reader verifies what those parts cover meanwhile, and a byte flipped as it lands (in unit
    ``unit``) is refused, whether its unit's checksum came in a part or only with the whole;
    the reader ends with the publishers' bytes."""
    import threading

    import torch

    import tensorhub
    from tensorhub.runtime import checksum

    from .procs import wait_until

    srv = inproc_server
    monkeypatch.setattr(checksum, "_PART_FIRST", 2 * MIB)  # parts: units [0, 1), [1, 2), [2, 4)
    release = threading.Event()
    real = checksum._unit_checksum

    def stalled(buffers, u):
        if u.index >= 4:  # the publishers' hash waits here (bounded) until the test releases it
            release.wait(30)
        return real(buffers, u)

    monkeypatch.setattr(checksum, "_unit_checksum", stalled)
    at = unit * 2 * MIB + 12345 + seed % 1000
    monkeypatch.setenv("TENSORHUB_CHUNK_BYTES", str(2 * MIB))  # reads of one unit each
    transports = {"local": {"faults": [{"op": "corrupt", "at": at, "times": 1}]}}
    want = _weights(seed)
    handles = []
    try:
        for name in ("trainer", "trainer-b"):
            h = tensorhub.open(model="actor", replica=name, server=srv.address, retain=None, transports=transports)
            handles.append(h)
            tensors = _weights(seed)
            h.register(tensors)
            h.publish(1)
        r = tensorhub.open(model="actor", replica="rollout", server=srv.address, retain=None, transports=transports)
        handles.append(r)
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        r.register(got)
        out: list = []
        t = threading.Thread(target=lambda: out.append(r.replicate(1, timeout=60)), daemon=True)
        t.start()
        # Units 0-3 (8 MiB) verified while the publishers have not hashed units 4-5.
        wait_until(lambda: r.buffers.progress.snapshot()[2] >= 8 * MIB, 30, "the reader's prefix verified from the parts")
        assert srv.checksums("actor", 1) is None, "the whole checksums were declared: nothing tested the parts"
        assert r.buffers.progress.snapshot()[2] == 8 * MIB  # and nothing the parts do not cover
        release.set()
        t.join(60)
        assert out == [1]
        assert all(torch.equal(got[k], want[k]) for k in want), "the reader holds bytes that are not version 1"
        stats = r.last_pull
        assert stats is not None and stats.verified_early >= 2  # the reads of units 0-3 (4 MiB each)
        assert len(stats.sources) == 2, f"the flipped byte at {at} was not refused: {stats.sources}"
        assert srv.stats()["quarantined"] == 0
    finally:
        release.set()
        for h in reversed(handles):
            h.close()


@pytest.mark.parametrize("raw, words", [("lots", "whole number"), ("-1", ">= 0")])
def test_a_bad_part_size_is_refused_with_a_typed_error(monkeypatch, raw, words):
    from tensorhub.runtime import checksum

    monkeypatch.setenv("TENSORHUB_CHECKSUM_PART_BYTES", raw)
    with pytest.raises(e.InvalidArgument, match=words) as info:
        checksum._part_first()
    assert "TENSORHUB_CHECKSUM_PART_BYTES" in str(info.value)


def test_parts_cover_the_units_in_order_and_leave_the_last_to_the_whole(monkeypatch):
    """The parts handed out while hashing are consecutive, each at least as large as the ones
    before (up to the cap), and never include the last units: those come with the whole set."""
    import torch

    from tensorhub.runtime import checksum
    from tensorhub.transports.buffers import ShardBuffers, layout_of

    monkeypatch.setenv("TENSORHUB_CHECKSUM_PART_BYTES", str(1 << 20))
    monkeypatch.setenv("TENSORHUB_HASH_THREADS", "2")
    tensors = {f"w{i}": torch.full((3 << 19,), i, dtype=torch.uint8) for i in range(11)}  # 1.5 MiB each
    b = ShardBuffers(tensors, layout_of(tensors, chunk_bytes=1 << 20, pack_threshold=4096))
    parts: list[tuple[int, list[int]]] = []
    whole = checksum.compute(b, None, lambda first, values: parts.append((first, list(values))))
    assert whole == checksum.compute(b)
    assert [p[0] for p in parts] == [0, *itertools.accumulate(len(p[1]) for p in parts[:-1])]
    assert sum(len(p[1]) for p in parts) < len(whole) and parts[0][0] == 0
    assert [v for p in parts for v in p[1]] == whole[: sum(len(p[1]) for p in parts)]
    assert len(parts) >= 3
    monkeypatch.setenv("TENSORHUB_CHECKSUM_PART_BYTES", "0")  # no parts
    parts.clear()
    assert checksum.compute(b, None, lambda first, values: parts.append((first, values))) == whole and parts == []
