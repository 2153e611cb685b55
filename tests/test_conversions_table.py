"""The reference table's converted models (sans-IO): who converts, who waits, what a failure does.

A 2-shard source model (``w`` sharded by rows) and a 1-shard converted model holding ``w`` whole."""

from __future__ import annotations

import pytest

from tensorhub.core import messages as m
from tensorhub.core.errors import (
    ChecksumMismatch,
    ContractViolation,
    InvalidArgument,
    InvalidPlacement,
    LayoutMismatch,
    VersionUnavailable,
)
from tensorhub.core.invariants import assert_invariants
from tensorhub.core.layout import Layout
from tensorhub.core.placement import ReplicaLayout, Shard, TensorPlacement

from .table_driver import Driver

W = TensorPlacement.of("w", "float32", (8, 4), Shard(0), 2)
SRC = ReplicaLayout.spmd([W], 2)
DST = ReplicaLayout.spmd([TensorPlacement.of("w", "float32", (8, 4))], 1)


def _layout(rl: ReplicaLayout, i: int) -> Layout:
    return rl.layout(i, chunk_bytes=4096, pack_threshold=0)


def trainer(d: Driver, name: str = "trainer") -> list:
    return [
        d.shard(name, i, 2, model="actor", layout=_layout(SRC, i), placements=SRC.shards[i]) for i in range(2)
    ]


def reader(d: Driver, name: str, **kw) -> object:
    kw.setdefault("model", "actor-fp8")
    return d.shard(name, 0, 1, source="actor", layout=_layout(DST, 0), placements=DST.shards[0], **kw)


def publish(shards: list, v: int) -> None:
    for s in shards:
        s.expect_ok(s.publish(v, (100 + v + s.shard_idx,)))


def converted(r, c: m.Convert, sums=(7,)) -> object:
    return r.expect_ok(r.request(m.Converted, r.session, c.term, c.version, sums))


def test_first_reader_converts_the_second_pulls_from_it():
    d = Driver()
    t = trainer(d)
    publish(t, 1)
    a, b = reader(d, "a"), reader(d, "b")
    ra = a.replicate("latest")
    (c,) = a.take(m.Convert)
    assert (c.version, c.source_model, c.source_shards) == (1, "actor", 2)
    assert sorted(s.shard_idx for s in c.sources) == [0, 1]
    assert all(s.source.replica == "trainer" for s in c.sources)
    assert [s.checksums for s in sorted(c.sources, key=lambda s: s.shard_idx)] == [(101,), (102,)]
    assert [s.placements for s in sorted(c.sources, key=lambda s: s.shard_idx)] == [SRC.shards[0], SRC.shards[1]]
    rb = b.replicate("latest")
    assert not b.take(m.Convert) and not b.grants()  # waits for the converter: converted once
    assert_invariants(d.table)
    converted(a, c)
    assert isinstance(a.expect_ok(ra), m.Replicated)
    g = b.grant()
    assert g.source.replica == "a" and g.checksums == (7,)
    b.complete(g)
    assert isinstance(b.expect_ok(rb), m.Replicated)
    assert d.table.stats["conversions"] == 1
    assert_invariants(d.table)


def test_a_failed_source_shard_is_granted_again_alone():
    d = Driver()
    t1, t2 = trainer(d, "t1"), trainer(d, "t2")
    publish(t1, 1)
    publish(t2, 1)
    a = reader(d, "a")
    ra = a.replicate(1)
    (c,) = a.take(m.Convert)
    first = {s.shard_idx: s for s in c.sources}
    failed = first[1]
    a.expect_ok(a.request(m.SourceFailed, a.session, failed.grant, c.term, 0, "test"))
    (again,) = a.take(m.Convert)
    assert [s.shard_idx for s in again.sources] == [1]
    assert again.sources[0].source.session != failed.source.session
    assert_invariants(d.table)
    converted(a, c)
    assert isinstance(a.expect_ok(ra), m.Replicated)
    assert not d.table.grants
    assert_invariants(d.table)


def test_a_dead_converter_hands_over_to_a_waiting_reader():
    d = Driver()
    t = trainer(d)
    publish(t, 1)
    a, b = reader(d, "a"), reader(d, "b")
    a.replicate(1)
    a.take(m.Convert)
    rb = b.replicate(1)
    assert not b.take(m.Convert)
    a.close()
    (c,) = b.take(m.Convert)
    assert_invariants(d.table)
    converted(b, c)
    assert isinstance(b.expect_ok(rb), m.Replicated)
    assert_invariants(d.table)


def test_conversion_waits_for_the_source_checksums():
    d = Driver()
    t = trainer(d)
    for s in t:
        s.expect_ok(s.publish(1))  # checksums come later (hashed in the background)
    a = reader(d, "a")
    a.replicate(1)
    assert not a.take(m.Convert)
    t[0].expect_ok(t[0].request(m.DeclareChecksums, t[0].session, 1, (5,)))
    assert not a.take(m.Convert)
    t[1].expect_ok(t[1].request(m.DeclareChecksums, t[1].session, 1, (6,)))
    (c,) = a.take(m.Convert)
    assert len(c.sources) == 2
    assert_invariants(d.table)


def test_latest_of_a_converted_model_is_its_sources():
    d = Driver()
    t = trainer(d)
    a = reader(d, "a")
    ra = a.replicate("latest")
    assert not a.take(m.Convert)  # parked: nothing published yet
    publish(t, 3)
    (c,) = a.take(m.Convert)
    assert c.version == 3
    converted(a, c)
    assert a.expect_ok(ra).version == 3
    for s in t:
        s.expect_ok(s.unpublish())
    publish(t, 4)  # the trainer moves on: the converted model's latest follows
    ru = a.update("latest")
    (c,) = a.take(m.Convert)
    assert c.version == 4
    converted(a, c)
    assert a.expect_ok(ru).moved


def test_no_source_copy_fails_the_call():
    d = Driver()
    t = trainer(d)
    publish(t, 1)
    a = reader(d, "a")
    req = a.replicate(1)
    (c,) = a.take(m.Convert)
    for s in t:
        s.close()  # their holdings drain: the converter's grants keep them a while
    assert a.reply(req, pop=False) is None
    d.run_for(d.table.config.drain_timeout + 1)
    assert a.take(m.Revoke)
    a.expect_error(req, VersionUnavailable)
    assert not d.table.grants
    assert_invariants(d.table)


def test_converters_must_agree_on_checksums_and_report_converted():
    d = Driver()
    t = trainer(d)
    publish(t, 1)
    a = reader(d, "a")
    a.replicate(1)
    (c,) = a.take(m.Convert)
    a.expect_error(a.request(m.Complete, a.session, c.sources[0].grant, c.term), ContractViolation)
    a.expect_error(a.request(m.Converted, a.session, c.term, c.version, (1, 2)), InvalidArgument)  # wrong count
    a.expect_error(a.request(m.Converted, a.session, c.term, 2, (1,)), ContractViolation)  # not converting 2
    assert_invariants(d.table)


def test_bad_declarations_are_refused():
    d = Driver()
    trainer(d)
    reader(d, "a")
    with pytest.raises(InvalidArgument):
        d.shard("x", 0, 1, model="actor-2", source="actor-fp8", layout=None)  # no chains: from the original
    with pytest.raises(ContractViolation):
        d.shard("b", 0, 1, model="actor-fp8", layout=None)  # a converted model, opened as a plain one
    with pytest.raises(ContractViolation):
        d.shard("y", 0, 2, model="actor", source="other", layout=None)  # a plain model, opened as a converted one
    d.shard("p", 0, 1, model="p-fp8", source="p", layout=None)
    with pytest.raises(InvalidArgument):
        d.shard("q", 0, 1, model="p", source="other", layout=None)  # what others convert from is not converted
    s = d.shard("c", 0, 1, model="actor-fp8", source="actor", layout=None)
    with pytest.raises(InvalidPlacement):  # a converted model's shard registers placements
        s.expect_ok(s.request(m.Register, s.session, _layout(DST, 0), {"tcp": "x"}, None, None))
    other = ReplicaLayout.spmd([TensorPlacement.of("w", "float32", (8, 4), Shard(1), 2)], 2)
    u = d.shard("u", 0, 2, model="actor", layout=None)
    with pytest.raises(LayoutMismatch):  # same local shape, another placement than the trainer's
        u.expect_ok(u.request(m.Register, u.session, _layout(other, 0), {"tcp": "x"}, None, other.shards[0]))


def test_source_without_placements_fails_the_converter():
    d = Driver()
    t = [d.shard("trainer", i, 2, model="actor", layout=_layout(SRC, i)) for i in range(2)]
    publish(t, 1)
    a = reader(d, "a")
    a.expect_error(a.replicate(1), InvalidPlacement)
    assert_invariants(d.table)


def test_a_source_that_fails_the_converters_checksums_checks_itself():
    d = Driver()
    t = trainer(d)
    publish(t, 1)
    a = reader(d, "a")
    req = a.replicate(1)
    (c,) = a.take(m.Convert)
    bad = next(s for s in c.sources if s.shard_idx == 0)
    a.expect_ok(a.request(m.ChecksumFailed, a.session, bad.grant, c.term, 0, 0))
    (vr,) = t[0].take(m.VerifyRequest)  # the blamed source re-hashes its copy; the converter waits
    assert not a.take(m.Convert) and a.reply(req, pop=False) is None
    assert_invariants(d.table)
    t[0].expect_ok(t[0].request(m.VerifyResult, t[0].session, vr.version, True))
    (again,) = a.take(m.Convert)  # sound: damaged on the way; granted again, once
    assert [s.shard_idx for s in again.sources] == [0] and again.sources[0].source.replica == "trainer"
    a.expect_ok(a.request(m.ChecksumFailed, a.session, again.sources[0].grant, c.term, 0, 0))
    (vr,) = t[0].take(m.VerifyRequest)
    t[0].expect_ok(t[0].request(m.VerifyResult, t[0].session, vr.version, False))  # this time the copy is bad
    assert t[0].take(m.Quarantined)
    d.run_for(d.table.config.heartbeat_timeout + 1)  # the grace period after the server's start ends
    a.expect_error(req, VersionUnavailable)  # shard 0's only copy was quarantined
    assert not d.table.grants
    assert_invariants(d.table)


def test_a_conversion_records_the_bytes_each_source_gave():
    """Issue 36 (5): the history (``tensorhub dag``) and the bytes per link counted a conversion
    once per source shard, each with the reader's whole shard size (2x the bytes here)."""
    d = Driver()
    t = trainer(d)
    publish(t, 1)
    a, b = reader(d, "a"), reader(d, "b")
    a.replicate("latest")
    (c,) = a.take(m.Convert)
    a.expect_ok(a.request(m.Converted, a.session, c.term, c.version, (7,), (64, 64)))
    edges = d.table.replication_dag("actor-fp8", 1)["edges"]
    assert sorted((e["source_shard"], e["bytes"]) for e in edges) == [(0, 64), (1, 64)]
    assert sum(d.table.bytes_by_link.values()) == 128  # the shard's 128 bytes, once
    # a converter that does not say: an even share each, never the whole shard per edge
    b.replicate("latest")
    b.complete(b.grant())  # b pulls from a: a plain grant of the whole shard
    assert sum(d.table.bytes_by_link.values()) == 256
    assert_invariants(d.table)


def test_a_converter_that_does_not_say_what_it_read_records_an_even_share():
    d = Driver()
    publish(trainer(d), 1)
    a = reader(d, "a")
    a.replicate("latest")
    converted(a, a.take(m.Convert)[0])
    edges = d.table.replication_dag("actor-fp8", 1)["edges"]
    assert sorted(e["bytes"] for e in edges) == [64, 64]  # not 128 each
