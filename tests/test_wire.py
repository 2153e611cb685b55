"""Unit and property tests of the control-plane wire format (``tensorhub.core.wire``) and of the
message classes it carries (``tensorhub.core.messages``).

Every bad input must raise the specific :class:`~tensorhub.errors.ProtocolError` subclass the
wire module documents; anything random fed to :func:`~tensorhub.core.wire.decode` must give a
message or a ``ProtocolError``, never another exception.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorhub.core import errors, wire
from tensorhub.core import messages as m
from tensorhub.core.errors import (
    MalformedMessage,
    OversizeMessage,
    ProtocolError,
    UnknownMessageKind,
    WireVersionMismatch,
)
from tensorhub.core.placement import PlacedTensor, ReplicaLayout, Shard, TensorPlacement
from tensorhub.core.layout import DTYPE_SIZES, Layout, TensorSpec
from tensorhub.core.naming import MAX_RELATIVE, MAX_SHARDS, MAX_VERSION
from tensorhub.core.topology import Location
from tensorhub.core.wire import (
    MAX_BYTES,
    MAX_COLLECTION,
    MAX_FRAME_BYTES,
    MAX_OPAQUE_DEPTH,
    MAX_STR,
    WIRE_VERSION,
    Opaque,
)

U64 = 2**64 - 1

# --- fixed samples, one per kind ----------------------------------------------------------------

LOC = Location(datacenter="dc-1", host="host-a", nic="mlx5_0")
LAYOUT = Layout(
    tensors=(
        TensorSpec(name="layers.0.w", dtype="bfloat16", shape=(4, 8), nbytes=64),
        TensorSpec(name="layers.0.b", dtype="float32", shape=(8,), nbytes=32),
        TensorSpec(name="scalar", dtype="int64", shape=(), nbytes=8),
    ),
    checksum="xxh3-64",
    chunk_bytes=1 << 20,
    pack_threshold=4096,
)
ENDPOINT = {
    "agent": "nixl-rollout-1",
    "meta": b"\x00\x01\xff",
    "regions": [{"addr": 0x7F0000001000, "len": 64, "dev": 0}, {"addr": 2**64 - 1, "len": 0, "dev": -1}],
    "rdma": True,
    "bw": 12.5,
    "extra": None,
}
PLACED = ReplicaLayout.spmd(
    [
        TensorPlacement.of("layers.0.w", "bfloat16", (8, 8), Shard(0), 2),
        TensorPlacement.of("layers.0.b", "float32", (8,)),
        TensorPlacement.of("scalar", "int64", ()),
    ],
    2,
).shards[1]
SOURCE = m.SourceInfo(
    session=9, replica="trainer-0", shard_idx=3, kind=m.KIND_NORMAL, complete=True, location=LOC, endpoint=ENDPOINT
)

LISTED = (
    m.VersionEntry(
        version=12,
        replicas=(m.ReplicaEntry("trainer", m.KIND_NORMAL, False), m.ReplicaEntry("rollout-1", m.KIND_OFFLOAD, True)),
    ),
    m.VersionEntry(version=13, replicas=()),
)

SAMPLES: list[Any] = [
    m.OpenShard(
        req=1,
        model="actor",
        replica="rollout-1",
        num_shards=4,
        shard_idx=3,
        incarnation="a1b2c3",
        location=LOC,
        spot=True,
        retain=2,
    ),
    m.Register(req=2, session=7, layout=LAYOUT, endpoint=ENDPOINT, placements=PLACED),
    m.Unregister(req=3, session=7),
    m.Publish(req=4, session=7, call=1, version=12, checksums=(0, 1, U64)),
    m.DeclareChecksums(req=5, session=7, version=12, checksums=(1, 2, 3)),
    m.DeclareChecksumsPart(req=5, session=7, version=12, first=4, checksums=(1, 2, 3)),
    m.Unpublish(req=6, session=7, call=2),
    m.PublishOffload(req=7, session=7, version=12, ok=True),
    m.Replicate(req=8, session=7, call=3, spec="latest-2", timeout=30.5),
    m.BucketStored(req=8, session=7, version=3, url="s3://weights/actor"),
    m.Update(req=9, session=7, call=4, spec="latest", timeout=None, offload_seed=True),
    m.ListVersions(req=10, session=7, call=None),
    m.Wait(req=11, session=7, call=5, known_epoch=3, satisfied_epoch=2, timeout=1.0),
    m.Progress(req=12, session=7, grant=5, term=1, verified=3),
    m.Complete(req=13, session=7, grant=5, term=1),
    m.SourceFailed(req=14, session=7, grant=5, term=1, verified=2, reason="connection reset"),
    m.ChecksumFailed(req=15, session=7, grant=5, term=1, verified=2, unit=4),
    m.VerifyResult(req=16, session=7, version=12, ok=False),
    m.Heartbeat(req=17, sessions=(7, 8, 9)),
    m.Announce(
        req=18,
        session=7,
        holdings=(m.Held(version=12, kind=m.KIND_NORMAL, checksums=(1, 2)), m.Held(11, m.KIND_OFFLOAD, None)),
        partial=m.PartialHeld(version=13, verified=1),
        answered=5,
        answers=(
            m.CallAnswer(call=3, kind="update", version=12, moved=True, epoch=None, listing=None),
            m.CallAnswer(call=4, kind="list", version=None, moved=None, epoch=3, listing=LISTED),
            m.CallAnswer(
                call=5, kind="replicate", version=None, moved=None, epoch=None, listing=None,
                error="version_unavailable", message="version 9 is gone",
            ),
        ),
    ),
    m.CloseShard(req=19, session=7),
    m.Opened(req=1, session=7, term=2, heartbeat_interval=1.0, heartbeat_timeout=10.0),
    m.Ack(req=3),
    m.Failed.of(4, errors.VersionUnavailable("gone", model="actor", version=3, replica="rollout-1", shard=0)),
    m.Grant(req=8, session=7, grant=5, term=1, version=12, shard_idx=3, source=SOURCE, checksums=(5, 6)),
    m.Convert(
        req=8, session=7, term=1, version=12, shard_idx=0, source_model="actor", source_shards=2,
        sources=(m.ConvertSource(5, 1, SOURCE, (1, 2, 3), b"t" * 40, LAYOUT, PLACED),),
    ),
    m.Converted(req=20, session=7, term=1, version=12, checksums=(1, 2, 3)),
    m.ConvertFailed(req=21, session=7, term=1, version=12, code="mapping_mismatch", message="tensor 'w': unfed"),
    m.Revoke(session=7, grant=5, term=1, reason="holder died"),
    m.ChecksumsReady(session=7, grant=5, term=1, version=12, checksums=(5, 6)),
    m.ChecksumsPartReady(session=7, grant=5, term=1, version=12, first=0, checksums=(5, 6)),
    m.OffloadRequest(session=7, version=12),
    m.FreeOffload(session=7, version=12),
    m.VerifyRequest(session=7, version=12),
    m.Quarantined(session=7, version=12),
    m.Removed(session=7, code="fenced", reason="a newer incarnation opened"),
    m.Replicated(req=8, version=12),
    m.Updated(req=9, moved=False, version=None, skipped=13, seed=None),
    m.GetStatus(req=20),
    m.ServerStatus(
        req=20, term=2, counts={"sessions": 3}, stats={"grants": 4}, bytes_by_link={"host": 0, "remote": 10},
        seeding=(m.Seeding(model="actor", version=12, datacenter="dc-b", replicas=("rollout-1",)),),
    ),
    m.GetDag(req=21, model="actor", version=12),
    m.Dag(req=21, model="actor", version=12, edges=(m.DagEdge(
        reader="rollout-1", reader_shard=0, reader_dc="dc-b", reader_host="b1", source="trainer", source_shard=0,
        source_kind="normal", source_complete=True, source_dc="dc-a", source_host="a1", bytes=10, start=1.5,
        end=2.5, outcome="completed",
    ),)),
    m.Listing(
        req=10,
        epoch=3,
        final=True,
        versions=LISTED,
    ),
    m.HeartbeatAck(req=17, unknown=(8,)),
    m.TransferSpan(req=0, session=7, grant=5, version=12, source_replica="trainer", source_shard=0, transport="tcp",
                   bytes=1 << 20, reads=2, start=1.7e9, end=1.7e9 + 0.5, outcome="completed"),
    m.GetTrace(req=22, model="actor", version=12),
    m.Trace(req=22, model="actor", version=12, spans=(m.SpanEntry(
        reader="rollout-1", reader_shard=0, reader_dc="dc-b", reader_host="b1", grant=5, source="trainer",
        source_shard=0, transport="tcp", bytes=10, reads=1, start=1.7e9, end=1.7e9 + 1, outcome="completed",
    ),), edges=(), clock_offset=1.7e9),
    m.GetCluster(req=23),
    m.ClusterState(req=23, term=2, time=1.7e9, models=(m.ModelState(
        model="actor", num_shards=1, highest_published=12, retain_back=0,
        versions=(m.VersionState(version=12, available=True, retained=True, holders=2, partial=1, offloaded=0,
                                 replicas=("trainer",)),),
        replicas=(m.ReplicaState(replica="trainer", num_shards=1, spot=False, shards=(m.ShardState(
            shard_idx=0, session=7, datacenter="dc-a", host="a1", version=12, state="complete", verified=10,
            total_bytes=10, offloads=(), idle_s=0.1,
        ),)),),
    ),), grants=(m.GrantState(
        grant=5, model="actor", version=12, shard_idx=0, reader="rollout-1", source="trainer", source_kind="normal",
        source_complete=True, verified=4, total_bytes=10, age_s=0.5, bytes_per_s=8.0,
    ),), window_s=10.0, recent_bytes_per_s=0.0, reigns=(m.ReignSpan(term=2, start=5.0, end=None, first_grant=6.0,
                                                                     last_grant=7.5, grants=3),)),
    m.LeaseRequest(req=24, term=2, epoch=3, voters=("actor/trainer/0", "actor/rollout-1/0")),
    m.LeaseReply(req=24, term=3, granted=True, lease=5.0, epoch=3, voters=None, reigns=2),
    m.StepDown(session=7, term=2, reason="lost the lease and the majority"),
]
BY_KIND = {type(s).KIND: s for s in SAMPLES}
ANSWER = wire.to_plain(BY_KIND["announce"].answers[0])  # a plain CallAnswer, to spoil


def frame(body: Any, kind: str = "ack", version: Any = WIRE_VERSION) -> bytes:
    """A raw frame built by hand (msgpack of ``[version, kind, body]``)."""
    return msgpack.packb([version, kind, body], use_bin_type=True)


def body_of(msg: Any) -> dict:
    return wire.to_plain(msg)


def changed(msg: Any, **fields: Any) -> bytes:
    """The frame of ``msg`` with some body fields replaced by raw values (no validation)."""
    body = body_of(msg)
    for k, v in fields.items():
        assert k in body, k
        body[k] = v
    return frame(body, type(msg).KIND)


def nested(depth: int, leaf: Any = 1, container: str = "list") -> Any:
    v = leaf
    for _ in range(depth):
        v = [v] if container == "list" else {"k": v}
    return v


# --- basic codec ---------------------------------------------------------------------------------


def test_wire_version_is_one():
    assert WIRE_VERSION == 1
    assert isinstance(WIRE_VERSION, int) and not isinstance(WIRE_VERSION, bool)


def test_samples_cover_every_registered_kind():
    kinds = wire.message_kinds()
    assert len(BY_KIND) == len(SAMPLES), "one sample per kind"
    assert set(BY_KIND) == set(kinds)
    for kind, cls in kinds.items():
        assert type(BY_KIND[kind]) is cls
        assert cls.KIND == kind


def test_message_kinds_is_a_copy():
    kinds = wire.message_kinds()
    kinds["bogus"] = object
    assert "bogus" not in wire.message_kinds()


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).KIND)
def test_every_kind_round_trips(msg):
    data = wire.encode(msg)
    assert isinstance(data, bytes)
    back = wire.decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert wire.encode(back) == data  # deterministic: same message, same bytes


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).KIND)
def test_frame_shape(msg):
    version, kind, body = msgpack.unpackb(wire.encode(msg), raw=False)
    assert version == WIRE_VERSION
    assert kind == type(msg).KIND
    # every field, but one added after earlier peers shipped the message is left out while None
    assert set(body) == {f.name for f in dataclasses.fields(msg) if not (f.metadata.get("added") and getattr(msg, f.name) is None)}


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).KIND)
def test_messages_are_frozen_and_slotted(msg):
    assert dataclasses.is_dataclass(msg)
    assert not hasattr(msg, "__dict__")
    name = dataclasses.fields(msg)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(msg, name, getattr(msg, name))


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_decode_accepts_bytes_like(wrap):
    msg = BY_KIND["grant"]
    assert wire.decode(wrap(wire.encode(msg))) == msg


def test_int_is_accepted_for_a_float_field():
    out = wire.decode(changed(BY_KIND["opened"], heartbeat_interval=5))
    assert out.heartbeat_interval == 5.0 and type(out.heartbeat_interval) is float


def test_to_plain_from_plain_round_trip():
    assert wire.from_plain(Layout, wire.to_plain(LAYOUT)) == LAYOUT
    assert wire.from_plain(m.SourceInfo, wire.to_plain(SOURCE)) == SOURCE
    assert wire.to_plain(5) == 5  # not a struct: returned as is


def test_listing_as_dict():
    d = BY_KIND["listing"].as_dict()
    assert set(d) == {12, 13}
    assert set(d[12]) == {"trainer", "rollout-1"} and d[12]["rollout-1"].spot is True
    assert d[13] == {}


def _stable_id(value: object) -> str:
    """A test id that is the same in every process (pytest-xdist workers must agree)."""
    return "object()" if type(value) is object else repr(value)


@pytest.mark.parametrize("bad", [LOC, object(), None, 5, {"req": 1}], ids=_stable_id)
def test_encode_refuses_what_is_not_a_registered_message(bad):
    with pytest.raises(TypeError):
        wire.encode(bad)


def test_encode_refuses_a_lookalike_class():
    @wire.struct
    class Fake:
        req: int

    Fake.KIND = "ack"  # claims a kind that belongs to another class
    with pytest.raises(TypeError):
        wire.encode(Fake(1))


def test_a_kind_cannot_be_registered_twice():
    before = wire.message_kinds()

    class Dup:
        req: int

    with pytest.raises(TypeError, match="ack"):
        wire.message("ack")(Dup)
    assert wire.message_kinds() == before


# --- frames that are not frames ------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # the one byte msgpack never uses
        b"\xc1\xc1\xc1\xc1",
        b"\x93\x01\xa3ac",  # truncated inside the kind
        b"\x93\x01",  # truncated array
        b"\xdd\x00\x00\x00\x03\x01",  # array32 header, then truncated
        b"\xd9\x10abc",  # str8 claiming 16 bytes, 3 given
        b"\x93\x01\xa3ack\x81\xa3req\xcd",  # truncated uint16
        b"\x93\x01\xa3ack\x81\xa3req\x01\x00",  # trailing byte after a valid frame
        b"\x93\x01\xa3ack\x81\xa3req\x01" * 2,  # two frames glued together
        b"\x93\x01\xa2\xff\xfe\x81\xa3req\x01",  # kind is not valid UTF-8
        b"GET / HTTP/1.1\r\n\r\n",
    ],
)
def test_garbage_bytes_are_malformed(data):
    with pytest.raises(MalformedMessage):
        wire.decode(data)


@pytest.mark.parametrize("bad", ["\x93\x01", None, 5, [1, "ack", {"req": 1}], {"a": 1}], ids=repr)
def test_a_frame_must_be_bytes(bad):
    with pytest.raises(MalformedMessage, match="bytes"):
        wire.decode(bad)


@pytest.mark.parametrize(
    "obj",
    [
        None,
        1,
        "ack",
        b"\x01",
        {"version": 1, "kind": "ack", "body": {"req": 1}},
        [],
        [1],
        [1, "ack"],
        [1, "ack", {"req": 1}, None],
        [[1, "ack", {"req": 1}]],
    ],
    ids=repr,
)
def test_a_frame_must_be_a_three_array(obj):
    with pytest.raises(MalformedMessage, match="array"):
        wire.decode(msgpack.packb(obj, use_bin_type=True))


def test_a_frame_over_the_frame_limit_is_oversize():
    with pytest.raises(OversizeMessage):
        wire.decode(b"\xc1" * (MAX_FRAME_BYTES + 1))
    # Checked first: even a valid message padded past the limit is refused as oversize.
    with pytest.raises(OversizeMessage):
        wire.decode(changed(BY_KIND["revoke"], reason="x" * MAX_FRAME_BYTES))


def test_a_frame_at_the_frame_limit_is_parsed():
    with pytest.raises(MalformedMessage):  # not oversize: parsed, then refused as garbage
        wire.decode(b"\xc1" * MAX_FRAME_BYTES)


# --- wire version --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 2, 99, -1, U64, "1", None, True, 1.0, [1], {"v": 1}, b"\x01"], ids=repr)
def test_wrong_wire_version(version):
    with pytest.raises(WireVersionMismatch) as info:
        wire.decode(frame({"req": 1}, "ack", version))
    assert str(WIRE_VERSION) in str(info.value)


@pytest.mark.parametrize(
    "kind, body",
    [
        ("no-such-kind", {"req": 1}),
        ("ack", "not a map"),
        ("ack", {"req": "not an int", "bogus": 1}),
        (5, None),
        (None, [1, 2, 3]),
        ("open", {}),
    ],
    ids=repr,
)
def test_wire_version_is_checked_before_kind_and_body(kind, body):
    for version in (99, 2, "1", None):
        with pytest.raises(WireVersionMismatch):
            wire.decode(frame(body, kind, version))


@pytest.mark.property
@settings(max_examples=60, deadline=None)
@given(
    version=st.one_of(
        st.integers(min_value=-(2**63), max_value=U64).filter(lambda v: v != WIRE_VERSION),
        st.text(max_size=5),
        st.none(),
        st.booleans(),
        st.floats(),
        st.binary(max_size=5),
    ),
    kind=st.one_of(st.text(max_size=10), st.integers(min_value=-(2**63), max_value=U64), st.none()),
)
def test_any_other_version_is_refused_first(version, kind):
    with pytest.raises(WireVersionMismatch):
        wire.decode(frame({"whatever": [1, 2]}, kind, version))


# --- kind ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["nope", "", "ACK", "ack ", " ack", "Ack", "ack\x00", "ackx"], ids=repr)
def test_unknown_kind(kind):
    with pytest.raises(UnknownMessageKind):
        wire.decode(frame({"req": 1}, kind))


def test_unknown_kind_error_is_bounded():
    with pytest.raises(UnknownMessageKind) as info:
        wire.decode(frame({"req": 1}, "k" * 10_000))
    assert len(str(info.value)) < 200


@pytest.mark.parametrize("kind", [5, None, b"ack", ["ack"], {"ack": 1}, True, 1.5], ids=repr)
def test_kind_must_be_a_str(kind):
    with pytest.raises(MalformedMessage, match="kind"):
        wire.decode(frame({"req": 1}, kind))


# --- body: missing and unknown fields ------------------------------------------------------------


@pytest.mark.parametrize("body", [None, [1], "req", 1, b"req", [["req", 1]]], ids=repr)
def test_body_must_be_a_map(body):
    with pytest.raises(MalformedMessage, match="map"):
        wire.decode(frame(body, "ack"))


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).KIND)
def test_each_missing_field_is_named(msg):
    added = {f.name for f in dataclasses.fields(msg) if f.metadata.get("added")}
    for name in set(body_of(msg)) - added:  # an added field may be absent (an earlier peer's frame)
        body = body_of(msg)
        del body[name]
        with pytest.raises(MalformedMessage, match="missing") as info:
            wire.decode(frame(body, type(msg).KIND))
        assert repr(name) in str(info.value)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).KIND)
def test_an_unknown_field_is_named(msg):
    body = body_of(msg)
    body["surprise_field"] = 1
    with pytest.raises(MalformedMessage, match="unknown") as info:
        wire.decode(frame(body, type(msg).KIND))
    assert "surprise_field" in str(info.value)


def test_an_added_field_is_absent_in_an_earlier_peers_frame_and_left_out_while_none():
    """``LeaseReply.reigns`` came after backups of an earlier release shipped lease replies:
    their frames (without it) decode as None; this side's frame leaves it out while None, so it
    decodes there too; a value is checked like any field."""
    earlier = {"req": 24, "term": 3, "granted": True, "lease": 5.0, "epoch": 3, "voters": None}
    msg = wire.decode(frame(earlier, "lease_reply"))
    assert msg == m.LeaseReply(24, 3, True, 5.0, 3, None) and msg.reigns is None
    assert msgpack.unpackb(wire.encode(msg), raw=False)[2] == earlier  # what an earlier backup sent
    assert wire.decode(frame({**earlier, "reigns": 7}, "lease_reply")).reigns == 7
    with pytest.raises(MalformedMessage, match="reigns"):
        wire.decode(frame({**earlier, "reigns": -1}, "lease_reply"))
    with pytest.raises(MalformedMessage, match="reigns"):
        wire.decode(frame({**earlier, "reigns": "2"}, "lease_reply"))
    with pytest.raises(MalformedMessage, match="'epoch'"):  # only an added field may be absent
        wire.decode(frame({k: v for k, v in earlier.items() if k != "epoch"}, "lease_reply"))
    with pytest.raises(MalformedMessage, match="surprise"):
        wire.decode(frame({**{k: v for k, v in earlier.items() if k != "epoch"}, "surprise": 1}, "lease_reply"))


def test_the_membership_a_cluster_state_names_is_added_and_checked():
    """``ClusterState.membership`` and ``.voters`` (the membership a primary or backup holds)
    came after ``tensorhub status`` of an earlier release read cluster states: a server of that
    release sends neither (None), a server alone leaves them out, and a negative count is
    refused naming the field."""
    earlier = {"req": 2, "term": 3, "time": 1.5, "models": [], "grants": [], "window_s": 10.0,
               "recent_bytes_per_s": 0.0, "reigns": []}  # fmt: skip
    msg = wire.decode(frame(earlier, "cluster_state"))
    assert msg.membership is None and msg.voters is None
    assert msgpack.unpackb(wire.encode(msg), raw=False)[2] == earlier
    later = wire.decode(frame({**earlier, "membership": 4, "voters": 2}, "cluster_state"))
    assert (later.membership, later.voters) == (4, 2)
    for name in ("membership", "voters"):
        with pytest.raises(MalformedMessage, match=name):
            wire.decode(frame({**earlier, "membership": 4, "voters": 2, name: -1}, "cluster_state"))


def test_an_added_field_must_default_to_none():
    @wire.struct
    class Later:
        a: int
        b: int | None = dataclasses.field(default=0, metadata={"added": True})

    with pytest.raises(TypeError, match="added"):
        wire._schema(Later)  # compiled on first use


def test_missing_and_unknown_fields_are_both_named():
    with pytest.raises(MalformedMessage) as info:
        wire.decode(frame({"reqq": 1}, "ack"))
    assert "'req'" in str(info.value) and "'reqq'" in str(info.value)


def test_empty_body_names_every_field():
    with pytest.raises(MalformedMessage) as info:
        wire.decode(frame({}, "open"))
    for f in dataclasses.fields(m.OpenShard):
        assert repr(f.name) in str(info.value)


def test_a_missing_field_of_a_nested_struct_is_named():
    body = body_of(BY_KIND["grant"])
    del body["source"]["endpoint"]
    with pytest.raises(MalformedMessage, match="endpoint") as info:
        wire.decode(frame(body, "grant"))
    assert "source" in str(info.value)  # says where


def test_an_unknown_field_of_a_nested_struct_is_named():
    body = body_of(BY_KIND["open"])
    body["location"]["rack"] = "r12"
    with pytest.raises(MalformedMessage, match="rack"):
        wire.decode(frame(body, "open"))


def test_a_bytes_key_is_not_a_field_name():
    with pytest.raises(MalformedMessage):
        wire.decode(frame({b"req": 1}, "ack"))


def test_non_string_map_keys_are_malformed():
    with pytest.raises(MalformedMessage):
        wire.decode(frame({1: 1}, "ack"))
    with pytest.raises(MalformedMessage):
        wire.decode(frame({"req": 1, None: 2}, "ack"))


# --- body: wrong types ---------------------------------------------------------------------------

WRONG_TYPES = [
    # str / bool / float / None for int
    ("ack", "req", "1"),
    ("ack", "req", True),
    ("ack", "req", False),
    ("ack", "req", 1.0),
    ("ack", "req", None),
    ("ack", "req", [1]),
    ("ack", "req", b"\x01"),
    # int / str / None for bool
    ("offloaded", "ok", 1),
    ("offloaded", "ok", 0),
    ("offloaded", "ok", "true"),
    ("offloaded", "ok", None),
    ("updated", "moved", None),  # bool, not optional
    # non-finite and non-number floats
    ("opened", "heartbeat_interval", math.nan),
    ("opened", "heartbeat_interval", math.inf),
    ("opened", "heartbeat_timeout", -math.inf),
    ("opened", "heartbeat_interval", "1.0"),
    ("opened", "heartbeat_interval", True),
    ("opened", "heartbeat_interval", None),
    ("replicate", "timeout", math.nan),
    ("replicate", "timeout", math.inf),
    ("wait", "timeout", -math.inf),
    # str fields
    ("revoke", "reason", b"bytes"),
    ("revoke", "reason", 5),
    ("revoke", "reason", None),
    # optionals still check the inner type
    ("updated", "version", "1"),
    ("updated", "version", 1.5),
    ("list", "call", "x"),
    ("list", "call", True),
    ("failed", "model", 5),
    ("failed", "shard", "0"),
    ("open", "retain", "latest"),
    # int | str
    ("replicate", "spec", 1.5),
    ("replicate", "spec", None),
    ("replicate", "spec", True),
    ("replicate", "spec", b"latest"),
    ("replicate", "spec", [1]),
    # arrays
    ("heartbeat", "sessions", {"a": 1}),
    ("heartbeat", "sessions", "123"),
    ("heartbeat", "sessions", 1),
    ("heartbeat", "sessions", [1, "2"]),
    ("heartbeat", "sessions", [True]),
    ("heartbeat", "sessions", None),
    ("grant", "checksums", [1.5]),
    ("grant", "checksums", 5),
    # list (or scalar) where a map (nested struct) is expected
    ("open", "location", ["dc-1", "host-a", "mlx5_0"]),
    ("open", "location", "dc-1/host-a"),
    ("open", "location", None),
    ("grant", "source", []),
    ("register", "layout", [[], "xxh3-64", 1 << 20, 0]),
    ("announce", "partial", [13, 1]),
    ("announce", "holdings", {"version": 12}),
]


@pytest.mark.parametrize("kind, name, value", WRONG_TYPES, ids=[f"{k}.{n}={v!r}" for k, n, v in WRONG_TYPES])
def test_wrong_types_are_malformed(kind, name, value):
    with pytest.raises(MalformedMessage) as info:
        wire.decode(changed(BY_KIND[kind], **{name: value}))
    assert name in str(info.value)


def _with_source(**changes: Any) -> dict:
    body = body_of(BY_KIND["grant"])
    body["source"].update(changes)
    return body


NESTED_WRONG = [
    ("grant", _with_source(session="9")),
    ("grant", _with_source(complete=1)),
    ("grant", _with_source(location={"datacenter": "dc", "host": "h", "nic": 3})),
    ("grant", _with_source(location={"datacenter": "dc", "host": "h"})),
    ("open", {**body_of(BY_KIND["open"]), "location": {"datacenter": "dc", "host": None, "nic": ""}}),
    (
        "listing",
        {**body_of(BY_KIND["listing"]), "versions": [{"version": 1, "replicas": [{"replica": "r", "kind": "normal", "spot": 1}]}]},
    ),
    ("listing", {**body_of(BY_KIND["listing"]), "versions": [{"version": "1", "replicas": []}]}),
    ("listing", {**body_of(BY_KIND["listing"]), "versions": [[1, []]]}),
    ("announce", {**body_of(BY_KIND["announce"]), "holdings": [{"version": 1, "kind": "normal", "checksums": ["1"], "base": None}]}),
    ("announce", {**body_of(BY_KIND["announce"]), "answers": [{**ANSWER, "moved": 0}]}),
    ("announce", {**body_of(BY_KIND["announce"]), "answers": [{**ANSWER, "epoch": "3"}]}),
    ("announce", {**body_of(BY_KIND["announce"]), "answers": [{**ANSWER, "listing": {"version": 1}}]}),
    ("announce", {**body_of(BY_KIND["announce"]), "answers": [{**ANSWER, "error": 5}]}),
    ("announce", {**body_of(BY_KIND["announce"]), "answers": ANSWER}),
    ("announce", {**body_of(BY_KIND["announce"]), "answered": None}),
]


@pytest.mark.parametrize("kind, body", NESTED_WRONG, ids=[str(i) for i in range(len(NESTED_WRONG))])
def test_wrong_types_in_nested_structs_are_malformed(kind, body):
    with pytest.raises(MalformedMessage):
        wire.decode(frame(body, kind))


def test_nested_wrong_type_error_gives_the_path():
    with pytest.raises(MalformedMessage, match=r"source\.location\.nic"):
        wire.decode(frame(_with_source(location={"datacenter": "dc", "host": "h", "nic": 3}), "grant"))


def test_layout_with_wrong_tensor_types_is_malformed():
    body = body_of(BY_KIND["register"])
    body["layout"]["tensors"][0]["shape"] = ["4", 8]
    with pytest.raises(MalformedMessage, match="shape"):
        wire.decode(frame(body, "register"))


# --- size limits ---------------------------------------------------------------------------------

OVERSIZE = [
    ("revoke", "reason", "x" * (MAX_STR + 1)),  # global str limit
    ("failed", "message", "é" * (MAX_STR + 1)),  # counted in characters
    ("open", "incarnation", "n" * 65),  # field max_len
    ("source_failed", "reason", "r" * 1025),
    ("failed", "code", "c" * 65),
    ("heartbeat", "sessions", [1] * 65537),
    ("announce", "holdings", [{"version": 1, "kind": "normal", "checksums": None, "base": None}] * 4097),
    ("announce", "answers", [ANSWER] * 65),
    ("announce", "answers", [{**ANSWER, "error": "e" * 65}]),  # max_len inside a nested struct
    ("heartbeat_ack", "unknown", [0] * (MAX_COLLECTION + 1)),  # global collection limit
    ("register", "endpoint", [0] * (MAX_COLLECTION + 1)),
]


@pytest.mark.parametrize("kind, name, value", OVERSIZE, ids=[f"{k}.{n}" for k, n, _ in OVERSIZE])
def test_oversize_fields(kind, name, value):
    with pytest.raises(OversizeMessage):
        wire.decode(changed(BY_KIND[kind], **{name: value}))


AT_LIMIT = [
    ("revoke", "reason", "x" * MAX_STR),
    ("failed", "message", "é" * MAX_STR),
    ("open", "incarnation", "n" * 64),
    ("source_failed", "reason", "r" * 1024),
    ("failed", "code", "c" * 64),
    ("heartbeat", "sessions", [1] * 65536),
    ("announce", "holdings", [{"version": 1, "kind": "normal", "checksums": None, "base": None}] * 4096),
    ("announce", "answers", [ANSWER] * 64),
]


@pytest.mark.parametrize("kind, name, value", AT_LIMIT, ids=[f"{k}.{n}" for k, n, _ in AT_LIMIT])
def test_fields_at_their_limit_are_accepted(kind, name, value):
    msg = wire.decode(changed(BY_KIND[kind], **{name: value}))
    assert len(getattr(msg, name)) == len(value)


def test_field_max_len_in_a_nested_struct_path():
    body = body_of(BY_KIND["open"])
    body["location"]["host"] = "h" * (MAX_STR + 1)
    with pytest.raises(OversizeMessage, match="location.host"):
        wire.decode(frame(body, "open"))


@pytest.mark.parametrize("header", [b"\xdd", b"\xdf"], ids=["array32", "map32"])
def test_a_declared_oversize_collection_is_refused_without_reading_it(header):
    data = b"\x93\x01\xa3ack" + header + (MAX_COLLECTION + 1).to_bytes(4, "big")
    with pytest.raises(OversizeMessage):
        wire.decode(data)


def test_a_declared_huge_string_is_malformed_not_a_crash():
    # str32 claiming 4 GiB in a short frame: truncated, refused before allocating.
    with pytest.raises(MalformedMessage):
        wire.decode(b"\x93\x01\xa3ack\xdb\xff\xff\xff\xff")


# --- msgpack ext types ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [msgpack.ExtType(1, b"x"), msgpack.ExtType(127, b"\x00" * 4), msgpack.Timestamp(1, 0), msgpack.ExtType(5, b"")],
    ids=repr,
)
def test_ext_types_are_refused(value):
    # In an Opaque field (which accepts any plain data) ...
    with pytest.raises(MalformedMessage):
        wire.decode(changed(BY_KIND["register"], endpoint=value))
    with pytest.raises(MalformedMessage):
        wire.decode(changed(BY_KIND["register"], endpoint={"nested": [value]}))
    # ... in a typed field, as the body, as the kind, as the whole frame.
    with pytest.raises(MalformedMessage):
        wire.decode(changed(BY_KIND["ack"], req=value))
    with pytest.raises(MalformedMessage):
        wire.decode(frame(value, "ack"))
    with pytest.raises(MalformedMessage):
        wire.decode(frame({"req": 1}, value))
    with pytest.raises(MalformedMessage):
        wire.decode(msgpack.packb(value))


# --- semantic validation (__post_init__) applies to decoded messages -----------------------------

SEMANTIC = [
    ("open", {"shard_idx": 4}),  # == num_shards
    ("open", {"shard_idx": -1}),
    ("open", {"num_shards": 0, "shard_idx": 0}),
    ("open", {"num_shards": MAX_SHARDS + 1}),
    ("open", {"model": "bad name"}),
    ("open", {"model": ""}),
    ("open", {"model": "-actor"}),
    ("open", {"model": "a" * 129}),
    ("open", {"replica": "rollout/1"}),
    ("open", {"incarnation": ""}),
    ("open", {"retain": -1}),
    ("open", {"location": {"datacenter": "", "host": "h", "nic": ""}}),
    ("open", {"location": {"datacenter": "dc", "host": "h" * 256, "nic": ""}}),
    ("replicate", {"spec": "latest-x"}),
    ("replicate", {"spec": -1}),
    ("replicate", {"spec": "latest--1"}),
    ("replicate", {"spec": "latest-"}),
    ("replicate", {"spec": "3"}),
    ("replicate", {"spec": "newest"}),
    ("replicate", {"spec": f"latest-{MAX_RELATIVE + 1}"}),
    ("replicate", {"spec": MAX_VERSION + 1}),
    ("replicate", {"timeout": -1.0}),
    ("replicate", {"timeout": -1}),
    ("replicate", {"timeout": 1e8}),
    ("update", {"spec": "latest-x"}),
    ("update", {"spec": -1}),
    ("update", {"timeout": -0.5}),
    ("wait", {"timeout": -0.001}),
    ("publish", {"version": -1}),
    ("publish", {"checksums": [-1]}),
    ("checksums", {"version": -1}),
    ("checksums", {"checksums": [1, -2]}),
    ("checksums_part", {"first": -1}),
    ("checksums_part", {"checksums": []}),
    ("checksums_part_ready", {"first": -3}),
    ("checksums_part_ready", {"checksums": []}),
    ("progress", {"verified": -1}),
    ("source_failed", {"verified": -1}),
    ("checksum_failed", {"unit": -1}),
    ("checksum_failed", {"verified": -1}),
    ("announce", {"holdings": [{"version": 1, "kind": "weird", "checksums": None, "base": None}]}),
    ("announce", {"holdings": [{"version": -1, "kind": "normal", "checksums": None, "base": None}]}),
    ("announce", {"holdings": [{"version": 1, "kind": "normal", "checksums": [-5], "base": None}]}),
    ("announce", {"partial": {"version": 1, "verified": -1}}),
    ("announce", {"partial": {"version": -1, "verified": 0}}),
    ("announce", {"answers": [{**ANSWER, "call": 0}]}),
    ("announce", {"answers": [{**ANSWER, "kind": "bogus"}]}),
    ("announce", {"answers": [{**ANSWER, "kind": "open"}]}),
    ("announce", {"answered": 4}),  # an answer to call 5 announced beyond the last answered call
    ("announce", {"answered": 0}),
]


@pytest.mark.parametrize("kind, fields", SEMANTIC, ids=[f"{i}-{k}:{','.join(f)}" for i, (k, f) in enumerate(SEMANTIC)])
def test_semantic_validation_on_decode_is_malformed(kind, fields):
    with pytest.raises(MalformedMessage) as info:
        wire.decode(changed(BY_KIND[kind], **fields))
    assert isinstance(info.value.__cause__, ValueError)  # the message's own validation, chained


def test_invalid_names_on_decode_chain_invalid_name():
    with pytest.raises(MalformedMessage, match="OpenShard") as info:
        wire.decode(changed(BY_KIND["open"], model="bad name"))
    assert isinstance(info.value.__cause__, errors.InvalidName)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda L: L["tensors"][0].update(nbytes=63),
        lambda L: L["tensors"][0].update(dtype="float128"),
        lambda L: L["tensors"][1].update(name=L["tensors"][0]["name"]),
        lambda L: L["tensors"][0].update(name=""),
        lambda L: L["tensors"][0].update(shape=[-4, -8]),
        lambda L: L["tensors"][0].update(shape=[1] * 17, nbytes=2),
        lambda L: L.update(chunk_bytes=100),
        lambda L: L.update(checksum=""),
        lambda L: L.update(pack_threshold=-1),
    ],
)
def test_invalid_layout_on_decode_is_malformed(mutate):
    body = body_of(BY_KIND["register"])
    mutate(body["layout"])
    with pytest.raises(MalformedMessage):
        wire.decode(frame(body, "register"))


def test_building_an_invalid_message_locally_raises_the_local_error():
    with pytest.raises(errors.InvalidName):
        m.OpenShard(1, "actor", "r", 2, 2, "i", LOC, False, None)
    with pytest.raises(errors.InvalidName):
        m.Replicate(1, 1, 1, "latest-x", None)
    with pytest.raises(ValueError, match="timeout"):
        m.Update(1, 1, 1, "latest", -1.0)
    with pytest.raises(ValueError, match="timeout"):
        m.Update(1, 1, 1, "latest", math.nan)
    with pytest.raises(ValueError, match="location"):
        m.OpenShard(1, "actor", "r", 2, 1, "i", None, False, None)
    with pytest.raises(ValueError):
        m.Publish(1, 1, 1, 3, (U64 + 1,))


def test_timeout_bounds_are_inclusive():
    for t in (0.0, 0, 1e7):
        assert wire.decode(changed(BY_KIND["replicate"], timeout=t)).timeout == t


# --- Opaque ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("container", ["list", "map"])
def test_opaque_depth_limit(container):
    ok = nested(MAX_OPAQUE_DEPTH, container=container)  # the leaf sits at depth MAX_OPAQUE_DEPTH
    assert wire.decode(changed(BY_KIND["register"], endpoint=ok)).endpoint == ok
    for depth in (MAX_OPAQUE_DEPTH + 1, MAX_OPAQUE_DEPTH + 5, 200):
        with pytest.raises(MalformedMessage, match="deeper"):
            wire.decode(changed(BY_KIND["register"], endpoint=nested(depth, container=container)))


def test_opaque_depth_limit_in_a_nested_struct():
    body = body_of(BY_KIND["grant"])
    body["source"]["endpoint"] = nested(MAX_OPAQUE_DEPTH + 1)
    with pytest.raises(MalformedMessage, match="source.endpoint"):
        wire.decode(frame(body, "grant"))


@pytest.mark.parametrize(
    "endpoint",
    [{b"key": 1}, {"ok": {b"key": 1}}, [{"a": 1}, {b"b": 2}], {1: "one"}, {"a": [{None: 1}]}, {1.5: 1}],
    ids=repr,
)
def test_opaque_map_keys_must_be_str(endpoint):
    with pytest.raises(MalformedMessage):
        wire.decode(changed(BY_KIND["register"], endpoint=endpoint))


@pytest.mark.parametrize(
    "endpoint",
    [None, True, 0, -(2**63), U64, 1.5, math.inf, "", "s", b"", b"\x00", [], {}, ENDPOINT, [None, [1, [b"x"]], {"a": {}}]],
    ids=repr,
)
def test_opaque_carries_plain_data(endpoint):
    assert wire.decode(changed(BY_KIND["register"], endpoint=endpoint)).endpoint == endpoint


# --- codec features not used by any message yet (checked through test-local structs) -------------


@wire.struct
class Kitchen:
    i: int
    f: float
    b: bool
    s: str
    raw: bytes
    opt: int | None
    ios: int | str
    tags: tuple[str, ...] = field(metadata={"max_len": 3})
    attrs: dict[str, int] = field(metadata={"max_len": 2})
    loc: Location | None
    many: tuple[Location, ...]
    table: dict[str, tuple[int, ...]]
    blob: Opaque


KITCHEN = Kitchen(
    i=-3,
    f=0.5,
    b=False,
    s="ß",
    raw=b"\x00\xff",
    opt=None,
    ios="latest",
    tags=("a", "b"),
    attrs={"x": 1, "y": 2},
    loc=LOC,
    many=(LOC, Location("dc-2", "h", "")),
    table={"k": (1, 2), "": ()},
    blob={"x": [1]},
)


def kitchen(**changes: Any) -> dict:
    plain = wire.to_plain(KITCHEN)
    plain.update(changes)
    return plain


def test_struct_round_trip_through_plain_data_and_msgpack():
    plain = wire.to_plain(KITCHEN)
    assert plain["loc"] == {"datacenter": "dc-1", "host": "host-a", "nic": "mlx5_0"}
    assert plain["many"][1] == {"datacenter": "dc-2", "host": "h", "nic": ""}
    again = msgpack.unpackb(msgpack.packb(plain, use_bin_type=True), raw=False)
    assert wire.from_plain(Kitchen, again) == KITCHEN
    assert wire.from_plain(Kitchen, kitchen(ios=7, opt=5, loc=None)) == dataclasses.replace(
        KITCHEN, ios=7, opt=5, loc=None
    )


@pytest.mark.parametrize(
    "changes, where",
    [
        ({"raw": "text"}, "raw"),
        ({"s": b"bytes"}, "s"),
        ({"ios": True}, "ios"),
        ({"ios": 1.5}, "ios"),
        ({"ios": None}, "ios"),
        ({"opt": "1"}, "opt"),
        ({"attrs": [["x", 1]]}, "attrs"),
        ({"attrs": {"x": "1"}}, "attrs.x"),
        ({"attrs": {b"x": 1}}, "attrs"),
        ({"tags": ["a", 1]}, "tags"),
        ({"tags": ("a",)}, "tags"),  # plain data has lists, not tuples
        ({"many": [{"datacenter": "dc", "host": "h"}]}, "many"),
        ({"table": {"k": [1, "2"]}}, "table.k"),
        ({"loc": "dc-1"}, "loc"),
        ({"f": math.nan}, "f"),
    ],
    ids=repr,
)
def test_struct_wrong_types(changes, where):
    with pytest.raises(MalformedMessage, match=where.replace(".", r"\.")):
        wire.from_plain(Kitchen, kitchen(**changes))


@pytest.mark.parametrize(
    "changes",
    [
        {"raw": b"\x00" * (MAX_BYTES + 1)},
        {"s": "s" * (MAX_STR + 1)},
        {"ios": "s" * (MAX_STR + 1)},
        {"tags": ["a", "b", "c", "d"]},
        {"tags": ["x" * (MAX_STR + 1)]},
        {"attrs": {"a": 1, "b": 2, "c": 3}},
    ],
    ids=lambda c: next(iter(c)),
)
def test_struct_oversize(changes):
    with pytest.raises(OversizeMessage):
        wire.from_plain(Kitchen, kitchen(**changes))


def test_struct_at_limits():
    k = wire.from_plain(Kitchen, kitchen(raw=b"\x00" * MAX_BYTES, tags=["a", "b", "c"], attrs={"a": 1, "b": 2}))
    assert len(k.raw) == MAX_BYTES and k.tags == ("a", "b", "c")


def test_unsupported_annotations_are_refused_when_compiled():
    @wire.struct
    class Listy:
        xs: list[int]

    @wire.struct
    class IntKeys:
        xs: dict[int, str]

    @wire.struct
    class Pair:
        xs: tuple[int, str]

    @wire.struct
    class FloatOrStr:
        xs: float | str

    @wire.struct
    class Anything:
        xs: object

    for cls in (Listy, IntKeys, Pair, FloatOrStr, Anything):
        with pytest.raises(TypeError):
            wire.from_plain(cls, {"xs": None})


# --- property tests -------------------------------------------------------------------------------

INTS = st.integers(min_value=-(2**63), max_value=U64)
NONNEG = st.integers(min_value=0, max_value=U64)
VERSIONS = st.integers(min_value=0, max_value=MAX_VERSION)
U64S = st.integers(min_value=0, max_value=U64)
NAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,20}", fullmatch=True)
SPECS = st.one_of(
    VERSIONS,
    st.just("latest"),
    st.integers(min_value=0, max_value=MAX_RELATIVE).map(lambda k: "latest" if k == 0 else f"latest-{k}"),
)
TIMEOUTS = st.floats(min_value=0.0, max_value=1e7, allow_nan=False)
SHORT_TEXT = st.text(max_size=12)


def _opaque(depth: int = 0) -> st.SearchStrategy:
    scalars = st.one_of(
        st.none(), st.booleans(), INTS, st.floats(allow_nan=False), SHORT_TEXT, st.binary(max_size=8)
    )
    if depth >= 3:
        return scalars
    inner = _opaque(depth + 1)
    return st.one_of(
        scalars, st.lists(inner, max_size=3), st.dictionaries(SHORT_TEXT, inner, max_size=3)
    )


OPAQUE = _opaque()
LOCATIONS = st.builds(
    Location,
    datacenter=st.text(min_size=1, max_size=8),
    host=st.text(min_size=1, max_size=8),
    nic=st.text(max_size=8),
)


@st.composite
def tensor_specs(draw, name: str | None = None) -> TensorSpec:
    dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
    shape = tuple(draw(st.lists(st.integers(min_value=0, max_value=64), max_size=4)))
    return TensorSpec(name or draw(st.text(min_size=1, max_size=12)), dtype, shape, math.prod(shape) * DTYPE_SIZES[dtype])


@st.composite
def layouts(draw) -> Layout:
    names = draw(st.lists(st.text(min_size=1, max_size=12), unique=True, max_size=4))
    tensors = tuple(draw(tensor_specs(n)) for n in names)
    return Layout(
        tensors,
        draw(st.text(min_size=1, max_size=32)),
        draw(st.integers(min_value=4096, max_value=U64)),
        draw(st.integers(min_value=0, max_value=U64)),
    )


@st.composite
def open_shards(draw) -> m.OpenShard:
    num_shards = draw(st.integers(min_value=1, max_value=MAX_SHARDS))
    return m.OpenShard(
        req=draw(INTS),
        model=draw(NAMES),
        replica=draw(NAMES),
        num_shards=num_shards,
        shard_idx=draw(st.integers(min_value=0, max_value=num_shards - 1)),
        incarnation=draw(st.text(min_size=1, max_size=64)),
        location=draw(LOCATIONS),
        spot=draw(st.booleans()),
        retain=draw(st.none() | st.integers(min_value=0, max_value=U64)),
    )


# Strategies for fields whose values the messages' own validation constrains, by field name.
BY_NAME: dict[str, st.SearchStrategy] = {
    "version": VERSIONS,
    "checksums": st.lists(U64S, max_size=5).map(tuple),
    "held": st.lists(U64S, max_size=5).map(tuple),
    "url": st.text(min_size=1, max_size=12),
    "verified": NONNEG,
    "unit": NONNEG,
    "timeout": TIMEOUTS,
    "spec": SPECS,
    "call": st.integers(min_value=1, max_value=U64),
    "grant_key": st.binary(min_size=16, max_size=64),
}
# ... and by (class, field name) where the name alone means different things.
BY_FIELD: dict[tuple[type, str], st.SearchStrategy] = {
    (m.Held, "kind"): st.sampled_from([m.KIND_NORMAL, m.KIND_OFFLOAD]),
    (m.CallAnswer, "kind"): st.sampled_from(["publish", "unpublish", "replicate", "update", "list", "wait"]),
    (m.GetDag, "model"): NAMES,
    (m.GetTrace, "model"): NAMES,
    (m.LeaseRequest, "epoch"): NONNEG,
    (m.LeaseReply, "epoch"): NONNEG,
    (m.LeaseReply, "lease"): st.floats(min_value=0, max_value=1e4),
    (m.LeaseReply, "reigns"): st.none() | NONNEG,
    (m.ClusterState, "membership"): st.none() | NONNEG,
    (m.ClusterState, "voters"): st.none() | NONNEG,
    (m.DeclareChecksumsPart, "first"): NONNEG,
    (m.DeclareChecksumsPart, "checksums"): st.lists(U64S, min_size=1, max_size=5).map(tuple),
    (m.ChecksumsPartReady, "first"): NONNEG,
    (m.ChecksumsPartReady, "checksums"): st.lists(U64S, min_size=1, max_size=5).map(tuple),
}
@st.composite
def announces(draw) -> m.Announce:
    # Answers may only name calls up to the last answered one.
    answered = draw(st.integers(min_value=0, max_value=U64))
    calls = st.integers(min_value=1, max_value=answered) if answered else st.nothing()
    answers = draw(st.lists(message_strategy(m.CallAnswer), max_size=3 if answered else 0))
    return m.Announce(
        req=draw(INTS),
        session=draw(INTS),
        holdings=tuple(draw(st.lists(message_strategy(m.Held), max_size=3))),
        partial=draw(st.none() | message_strategy(m.PartialHeld)),
        answered=answered,
        answers=tuple(dataclasses.replace(a, call=draw(calls)) for a in answers),
    )


@st.composite
def transfer_spans(draw) -> m.TransferSpan:
    start = draw(st.floats(min_value=0, max_value=1e10))
    return m.TransferSpan(
        req=draw(INTS), session=draw(INTS), grant=draw(NONNEG), version=draw(VERSIONS), source_replica=draw(NAMES),
        source_shard=draw(NONNEG), transport=draw(st.text(max_size=64)), bytes=draw(U64S), reads=draw(NONNEG),
        start=start, end=start + draw(st.floats(min_value=0, max_value=1e9)),
        outcome=draw(st.sampled_from(m.SPAN_OUTCOMES)),
    )


@st.composite
def placed_layouts(draw) -> tuple[Layout, tuple[PlacedTensor, ...]]:
    """A layout and its tensors' placements (whole tensors: what a message must keep equal)."""
    names = draw(st.lists(st.text(min_size=1, max_size=12), unique=True, max_size=4))
    placed = tuple(
        PlacedTensor(TensorPlacement.of(n, draw(st.sampled_from(sorted(DTYPE_SIZES))),
                                        draw(st.lists(st.integers(min_value=0, max_value=16), max_size=3))))
        for n in names
    )  # fmt: skip
    chunk = draw(st.integers(min_value=4096, max_value=U64))
    return Layout(tuple(p.spec() for p in placed), "xxh3-64", chunk, draw(st.integers(min_value=0, max_value=U64))), placed


@st.composite
def registers(draw) -> m.Register:
    layout, placed = draw(placed_layouts())
    return m.Register(draw(INTS), draw(INTS), layout, draw(OPAQUE), None, draw(st.none() | st.just(placed)))


@st.composite
def convert_sources(draw) -> m.ConvertSource:
    layout, placed = draw(placed_layouts())
    return m.ConvertSource(draw(NONNEG), draw(NONNEG), draw(message_strategy(m.SourceInfo)),
                           tuple(draw(st.lists(U64S, max_size=4))), draw(st.none() | st.binary(max_size=64)), layout, placed)  # fmt: skip


@st.composite
def publishes(draw) -> m.Publish:
    version = draw(VERSIONS)
    prev = draw(st.none() | st.integers(0, version - 1)) if version else None
    base, delta_from = (prev, None) if draw(st.booleans()) else (None, prev)
    sums = draw(st.none() | st.lists(U64S, max_size=4).map(tuple))
    return m.Publish(draw(INTS), draw(INTS), draw(INTS), version, sums, base, delta_from)


@st.composite
def delta_refs(draw) -> m.DeltaRef:
    version = draw(st.integers(1, MAX_VERSION))
    return m.DeltaRef(version, draw(st.integers(0, version - 1)), draw(NONNEG))


@st.composite
def helds(draw) -> m.Held:
    held = draw(st.builds(m.Held, version=st.integers(0, MAX_VERSION), kind=st.sampled_from([m.KIND_NORMAL, m.KIND_OFFLOAD]),
                          checksums=st.none() | st.tuples(NONNEG).map(tuple), base=st.none()))  # fmt: skip
    if held.version > 0 and draw(st.booleans()):  # a delta's holding names its base
        held = dataclasses.replace(held, base=draw(st.integers(0, held.version - 1)))
    return held


BY_CLASS: dict[type, st.SearchStrategy] = {
    m.Held: helds(),
    m.Publish: publishes(),
    m.DeltaRef: delta_refs(),
    m.Register: registers(),
    m.ConvertSource: convert_sources(),
    Location: LOCATIONS,
    m.TransferSpan: transfer_spans(),
    Layout: layouts(),
    TensorSpec: tensor_specs(),
    m.OpenShard: open_shards(),
    m.Announce: announces(),
}


def strategy_for(
    tp: Any, name: str | None = None, max_len: int | None = None, owner: type | None = None
) -> st.SearchStrategy:
    import types
    import typing

    if (owner, name) in BY_FIELD:
        return BY_FIELD[owner, name]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            inner = strategy_for(rest[0], name, max_len)
        elif name in BY_NAME:
            inner = BY_NAME[name]
        else:
            inner = st.one_of(*(strategy_for(a, None, max_len) for a in rest))
        return st.none() | inner if type(None) in args else inner
    if name in BY_NAME:
        return BY_NAME[name]
    if tp in BY_CLASS:
        return BY_CLASS[tp]
    if tp is int:
        return INTS
    if tp is bool:
        return st.booleans()
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    if tp is str:
        return st.text(max_size=min(max_len or 12, 12))
    if tp is bytes:
        return st.binary(max_size=12)
    if tp is Opaque:
        return OPAQUE
    if origin is tuple:
        return st.lists(strategy_for(typing.get_args(tp)[0]), max_size=min(max_len or 4, 4)).map(tuple)
    if origin is dict:
        return st.dictionaries(SHORT_TEXT, strategy_for(typing.get_args(tp)[1]), max_size=3)
    if hasattr(tp, "__wire_schema__"):
        return message_strategy(tp)
    raise AssertionError(f"no strategy for {tp!r}")


def message_strategy(cls: type) -> st.SearchStrategy:
    import typing

    if cls in BY_CLASS:
        return BY_CLASS[cls]
    hints = typing.get_type_hints(cls)
    return st.builds(
        cls,
        **{
            f.name: strategy_for(hints[f.name], f.name, f.metadata.get("max_len"), cls)
            for f in dataclasses.fields(cls)
        },
    )


KINDS = sorted(wire.message_kinds())
ANY_MESSAGE = st.sampled_from(KINDS).flatmap(lambda k: message_strategy(wire.message_kinds()[k]))


@pytest.mark.property
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_generated_messages_of_every_kind_round_trip(kind, data):
    msg = data.draw(message_strategy(wire.message_kinds()[kind]))
    encoded = wire.encode(msg)
    back = wire.decode(encoded)
    assert type(back) is type(msg) and back == msg
    assert wire.encode(back) == encoded


def _decode_or_protocol_error(data: bytes) -> Any:
    """decode() must return a registered message or raise a ProtocolError: nothing else."""
    try:
        msg = wire.decode(data)
    except ProtocolError:
        return None
    assert type(msg) in wire.message_kinds().values()
    assert wire.decode(wire.encode(msg)) == msg  # what decodes re-encodes to the same message
    return msg


@pytest.mark.property
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_the_error_tree(data):
    _decode_or_protocol_error(data)


@pytest.mark.property
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=60))
def test_random_bytes_after_a_frame_header_never_escape(tail):
    # A valid header makes the random tail reach the body decoders more often.
    for kind in ("ack", "open", "grant", "register", "announce"):
        _decode_or_protocol_error(b"\x93\x01" + msgpack.packb(kind) + tail)


@st.composite
def mutated_frames(draw) -> bytes:
    base = bytearray(wire.encode(draw(st.sampled_from(SAMPLES) | ANY_MESSAGE)))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        op = draw(st.sampled_from(["flip", "truncate", "set", "insert", "delete", "duplicate"]))
        if not base:
            break
        i = draw(st.integers(min_value=0, max_value=len(base) - 1))
        if op == "flip":
            base[i] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif op == "truncate":
            del base[i:]
        elif op == "set":
            base[i] = draw(st.integers(min_value=0, max_value=255))
        elif op == "insert":
            base[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del base[i : i + draw(st.integers(min_value=1, max_value=4))]
        else:
            j = draw(st.integers(min_value=i, max_value=len(base)))
            base[j:j] = base[i:j]
    return bytes(base)


@pytest.mark.property
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_frames())
def test_mutated_frames_never_escape_the_error_tree(data):
    _decode_or_protocol_error(data)


PLAIN = _opaque(1)  # any plain msgpack value, shallow


@st.composite
def plain_bodies(draw) -> tuple[str, dict]:
    """A registered kind and a body with exactly its field names (sometimes one more or less),
    holding random plain values: exercises every field decoder and __post_init__ with junk."""
    kind = draw(st.sampled_from(KINDS))
    msg = draw(message_strategy(wire.message_kinds()[kind]))
    body = wire.to_plain(msg)
    for name in draw(st.lists(st.sampled_from(sorted(body)), max_size=3)):
        body[name] = draw(PLAIN)
    if draw(st.integers(min_value=0, max_value=9)) == 0:
        body.pop(draw(st.sampled_from(sorted(body))))
    return kind, body


@pytest.mark.property
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain_bodies())
def test_junk_field_values_never_escape_the_error_tree(kind_body):
    kind, body = kind_body
    _decode_or_protocol_error(frame(body, kind))


# --- the generated constructors, decoders and encoders (issue 34: the server's CPU per message) ---


def test_every_message_class_is_built_by_its_generated_init_and_stays_frozen():
    for kind, cls in wire.message_kinds().items():
        assert cls.__init__.__code__.co_filename == f"<fast __init__ of {cls.__qualname__}>", kind
    g = BY_KIND["grant"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.req = 1  # type: ignore[misc]
    # keywords, defaults and the class's own checks, as the dataclass's __init__ had them
    assert m.Failed(req=3, code="x") == m.Failed(3, "x", "", None, None, None, None, None)
    with pytest.raises(ValueError, match="timeout"):
        m.Replicate(1, 2, 3, "latest", -1.0)
    with pytest.raises(TypeError):
        m.Ack()  # type: ignore[call-arg]


def test_a_struct_with_a_default_factory_keeps_the_dataclass_init():
    @wire.struct
    class Bag:
        n: int
        items: tuple[int, ...] = field(default_factory=tuple)

    assert not Bag.__init__.__code__.co_filename.startswith("<fast")
    assert Bag(1) == Bag(1, ()) and wire.from_plain(Bag, {"n": 2, "items": [3]}) == Bag(2, (3,))
    with pytest.raises(MalformedMessage, match="items"):
        wire.from_plain(Bag, {"n": 2, "items": ["x"]})


def test_a_frame_that_failed_to_pack_leaves_nothing_in_the_reused_packer():
    bad = dataclasses.replace(BY_KIND["register"], endpoint={"x": object()})  # not msgpack data
    good = BY_KIND["grant"]
    before = wire.encode(good)
    with pytest.raises(TypeError):
        wire.encode(bad)
    assert wire.encode(good) == before == msgpack.packb([WIRE_VERSION, "grant", wire.to_plain(good)], use_bin_type=True)


def test_threads_encode_the_same_frames_with_a_packer_each():
    import threading

    want = {kind: wire.encode(s) for kind, s in BY_KIND.items()}
    got: list[dict[str, bytes]] = []
    errors_seen: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(50):
                frames = {kind: wire.encode(s) for kind, s in BY_KIND.items()}
            got.append(frames)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors_seen.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors_seen and len(got) == 4 and all(frames == want for frames in got)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, "1.0", True])
def test_a_float_field_refuses_what_is_not_a_finite_number(value):
    with pytest.raises(MalformedMessage, match="stamp"):
        wire.decode(changed(BY_KIND["heartbeat"], stamp=value))


def test_a_float_field_takes_an_int():
    assert wire.decode(changed(BY_KIND["heartbeat"], stamp=3)).stamp == 3.0


def test_a_kind_prefix_begins_every_frame_of_its_kind_and_no_other():
    beat = wire.kind_prefix(m.Heartbeat)
    assert wire.encode(m.Heartbeat(7, (1, 2), 3.5, 9)).startswith(beat)
    assert wire.encode(m.Heartbeat(1 << 40, ())).startswith(beat)
    assert not wire.encode(m.HeartbeatAck(7, (), 1, 0.0, 0.0, True)).startswith(beat)  # "heartbeat_ack" is another kind
    assert not wire.encode(m.Ack(7)).startswith(beat)
    with pytest.raises(TypeError, match="not a registered wire message"):
        wire.kind_prefix(int)


def test_a_convert_sources_layout_is_decoded_once_and_bad_bytes_are_still_refused():
    """``ConvertSource.layout`` and ``placements`` are kept by their encoded bytes: the same
    bytes in the next version's ``Convert`` give the very value decoded before; other bytes are
    decoded (and checked) afresh."""
    src = m.ConvertSource(5, 1, SOURCE, (1, 2, 3), b"t" * 40, LAYOUT, PLACED)
    first = wire.decode(wire.encode(m.Convert(1, 2, 3, 4, 0, "src", 1, (src,))))
    again = wire.decode(wire.encode(m.Convert(9, 2, 3, 5, 0, "src", 1, (dataclasses.replace(src, grant=6, checksums=(4, 5, 6)),))))
    assert again.sources[0].layout is first.sources[0].layout
    assert again.sources[0].placements is first.sources[0].placements
    assert again.sources[0].checksums == (4, 5, 6) and again.version == 5
    body = body_of(m.Convert(1, 2, 3, 4, 0, "src", 1, (src,)))
    body["sources"][0]["layout"]["tensors"][0]["dtype"] = "no-such-dtype"
    with pytest.raises(MalformedMessage):
        wire.decode(msgpack.packb([WIRE_VERSION, "convert", body]))


# ---- a field packed once per value (a version's checksums in every reader's Grant; issue 34) ---


def _whole(msg: Any) -> bytes:
    """The frame as packing the whole message at once makes it."""
    return msgpack.packb([WIRE_VERSION, type(msg).KIND, wire.to_plain(msg)], use_bin_type=True)


def test_a_field_packed_once_gives_the_bytes_of_packing_it_whole():
    """``Grant.checksums`` is packed once per tuple and spliced in: each frame equals, byte for
    byte, packing the message whole, and decodes to the message, whether the tuple was packed
    before (the same object), is equal but another object, or is None."""
    src = m.SourceInfo(1, "trainer", 0, m.KIND_NORMAL, True, Location("dc0", "h", ""), {})
    sums = tuple(range(2**64 - 300, 2**64 - 44))  # 256 uint64, the biggest msgpack ints
    grants = [m.Grant(1, 2, 3, 4, 5, 0, src, sums, b"t" * 32), m.Grant(9, 8, 7, 6, 5, 1, src, sums, None),
              m.Grant(1, 2, 3, 4, 5, 0, src, tuple(list(sums)), None), m.Grant(1, 2, 3, 4, 5, 0, src, None, None),
              m.Grant(1, 2, 3, 4, 5, 0, src, (), None), m.Grant(1, 2, 3, 4, 5, 0, src, (7,), None)]  # fmt: skip
    for g in grants:
        frame = wire.encode(g)
        assert wire.decode(frame) == g
        assert frame == _whole(g)
        assert frame.endswith(msgpack.packb("checksums") + msgpack.packb(g.checksums))  # the field last
    ready = m.ChecksumsReady(1, 2, 3, 4, sums)
    assert wire.decode(wire.encode(ready)) == ready and wire.encode(ready) == _whole(ready)


def test_the_packed_values_kept_are_bounded_and_never_mistaken_for_another():
    src = m.SourceInfo(1, "trainer", 0, m.KIND_NORMAL, True, Location("dc0", "h", ""), {})
    for i in range(200):  # fresh tuples, each dropped after its frame: a reused id must not hit
        sums = (i, i + 1, i + 2)
        assert wire.decode(wire.encode(m.Grant(1, 2, 3, 4, 5, 0, src, sums, None))).checksums == (i, i + 1, i + 2)
    kind, _, name, _, kept, most = wire._ONCE[m.Grant]
    assert (kind, name, most) == ("grant", "checksums", 64) and 0 < len(kept) <= most


def test_pack_once_is_refused_where_it_cannot_be_spliced():
    @wire.struct
    class NotAMessage:  # nested in another struct, its bytes are not the frame's last
        sums: tuple[int, ...] = field(metadata={"pack_once": 4})

    with pytest.raises(TypeError, match="pack_once"):
        wire.to_plain(NotAMessage((1,)))
