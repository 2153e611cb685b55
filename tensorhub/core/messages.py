"""Control-plane messages between shard clients and the reference server.

Every message is a frozen, slotted dataclass registered under a wire kind (see
:mod:`tensorhub.core.wire`). Requests carry ``req``, a client-chosen id that the reply echoes
(0 for none), and ``session``, the id the server gave the shard at :class:`OpenShard`.
Model-parallel calls (§5.4 of the design) carry ``call``: the replica-wide call number, counted
by each shard from 1.

A request gets exactly one final reply: :class:`Ack`, :class:`Failed` or the call's own answer
(:class:`Opened`, :class:`Replicated`, :class:`Updated`, :class:`Listing` with ``final``,
:class:`HeartbeatAck`). Notifications (:class:`Grant`, :class:`Revoke`, :class:`OffloadRequest`,
...) may arrive at any time; those tied to a request echo its ``req``.

Size: the whole wire schema, one frozen dataclass per message (about 70) with its checks, kept
in one module so that the protocol is read, versioned and decoded in one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from .errors import TensorHubError
from .layout import Layout
from .naming import parse_version_spec, validate_model, validate_replica, validate_shard, validate_version
from .placement import PlacedTensor
from .tokens import valid_key
from .topology import Location
from .wire import Opaque, message, struct

U64 = (1 << 64) - 1

#: Holder kinds as the wire names them.
KIND_NORMAL = "normal"
KIND_OFFLOAD = "offload"


def _nonneg(what: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")


def _timeout(value: float | None) -> None:
    if value is not None and not 0 <= value <= 1e7:
        raise ValueError(f"timeout must be None or in [0, 1e7] seconds, got {value}")


def _checksums(values: tuple[int, ...] | None) -> None:
    if values is not None:
        for v in values:
            if not 0 <= v <= U64:
                raise ValueError("checksums must be unsigned 64-bit integers")


def _version_spec(spec: int | str) -> None:
    parse_version_spec(spec)


# --- nested structs ---------------------------------------------------------------------------


@struct
class SourceInfo:
    """Where a granted reader pulls from."""

    session: int
    replica: str
    shard_idx: int
    kind: str
    complete: bool
    location: Location
    endpoint: Opaque


@struct
class ReplicaEntry:
    """One replica holding a version completely (all its shards)."""

    replica: str
    kind: str
    spot: bool


@struct
class VersionEntry:
    """One available version and the replicas that hold it completely."""

    version: int
    replicas: tuple[ReplicaEntry, ...]


@struct
class DeltaRef:
    """One delta of a shard, as a reader pulls it: version ``version`` of the delta model, the
    delta ``base -> version`` of ``nbytes`` bytes (its blob's size: the layout to register)."""

    version: int
    base: int
    nbytes: int

    def __post_init__(self) -> None:
        validate_version(self.version)
        validate_version(self.base)
        _nonneg("nbytes", self.nbytes)
        if self.base >= self.version:
            raise ValueError(f"a delta goes forward: base {self.base} is not before version {self.version}")


@struct
class Held:
    """A holding re-announced after failover. ``base``: a delta model's holding names the
    version its delta applies to, as its publish did (the next server plans deltas with it)."""

    version: int
    kind: str
    checksums: tuple[int, ...] | None
    base: int | None = None

    def __post_init__(self) -> None:
        validate_version(self.version)
        if self.base is not None:
            validate_version(self.base)
            if self.base >= self.version:
                raise ValueError(f"a delta goes forward: base {self.base} is not before version {self.version}")
        if self.kind not in (KIND_NORMAL, KIND_OFFLOAD):
            raise ValueError(f"holding kind must be normal or offload, got {self.kind!r}")
        _checksums(self.checksums)


@struct
class PartialHeld:
    """A partial holding re-announced after failover: what was verified so far."""

    version: int
    verified: int

    def __post_init__(self) -> None:
        validate_version(self.version)
        _nonneg("verified", self.verified)


@struct
class CallAnswer:
    """The answer a shard last got for a model-parallel call, re-announced after failover so that
    the other shards get the same one."""

    call: int
    kind: str
    version: int | None
    moved: bool | None
    epoch: int | None
    listing: tuple[VersionEntry, ...] | None
    error: str | None = field(default=None, metadata={"max_len": 64})
    message: str | None = None

    def __post_init__(self) -> None:
        if self.call < 1:
            raise ValueError(f"call numbers start at 1, got {self.call}")
        if self.kind not in ("publish", "unpublish", "replicate", "update", "list", "wait"):
            raise ValueError(f"not a model-parallel call: {self.kind!r}")


# --- client -> server -------------------------------------------------------------------------


@message("open")
class OpenShard:
    req: int
    model: str
    replica: str
    num_shards: int
    shard_idx: int
    incarnation: str = field(metadata={"max_len": 64})
    location: Location
    spot: bool
    retain: int | None
    #: the model this one is converted from (a converted layout of it: :mod:`tensorhub.core.table.conversions`)
    source: str | None = None

    def __post_init__(self) -> None:
        validate_model(self.model)
        validate_replica(self.replica, model=self.model)
        validate_shard(self.num_shards, self.shard_idx, model=self.model, replica=self.replica)
        if not self.incarnation:
            raise ValueError("incarnation must be a non-empty nonce")
        if not isinstance(self.location, Location):
            raise ValueError("location is required")
        if self.retain is not None:
            _nonneg("retain", self.retain)
        if self.source is not None:
            validate_model(self.source)
            if self.source == self.model:
                raise ValueError(f"model {self.model!r} cannot be converted from itself")


#: Where an engine's endpoint carries the holder slot's grant key until :class:`Register` takes it out.
GRANT_KEY = "grant_key"


@message("register")
class Register:
    """Register a shard's layout and its transports' ``endpoint`` (which the server hands, as it
    is, to the readers it grants from this shard). ``grant_key``: the key the server signs this
    holder's grant tokens with (:mod:`tensorhub.core.tokens`); readers never see it. An endpoint
    made by the engine carries it under :data:`GRANT_KEY`: building the message moves it out of
    the endpoint into this field, so the endpoint the server keeps and hands out never holds it.
    None: a holder that checks no tokens (its grants carry none)."""

    req: int
    session: int
    layout: Layout
    endpoint: Opaque
    grant_key: bytes | None = field(default=None, metadata={"max_len": 64})
    #: each tensor's placement in the replica (layout order), or None: what a converter plans on
    placements: tuple[PlacedTensor, ...] | None = None

    def __post_init__(self) -> None:
        if self.placements is not None:
            if len(self.placements) != len(self.layout.tensors):
                raise ValueError(f"{len(self.placements)} placements for a layout of {len(self.layout.tensors)} tensors")
            for pt, spec in zip(self.placements, self.layout.tensors):
                if pt.spec() != spec:
                    raise ValueError(f"tensor {spec.name!r}: its placement describes {pt.spec()}, the layout {spec}")
        ep = self.endpoint
        if isinstance(ep, dict) and GRANT_KEY in ep:
            if self.grant_key is not None:
                raise ValueError(f"the grant key is given twice (the field and the endpoint's {GRANT_KEY!r})")
            object.__setattr__(self, "grant_key", ep[GRANT_KEY])
            object.__setattr__(self, "endpoint", {k: v for k, v in ep.items() if k != GRANT_KEY})
        if self.grant_key is not None and not valid_key(self.grant_key):
            raise ValueError("grant_key must be None or 16 to 64 bytes")


@message("unregister")
class Unregister:
    req: int
    session: int


@message("publish")
class Publish:
    """``base``: a shard of a delta model (:func:`tensorhub.core.naming.delta_model`) publishes
    the delta that takes its model's shard from version ``base`` to ``version`` (required there,
    refused elsewhere). ``delta_from``: a shard of any other model says that the delta from
    ``delta_from`` to ``version`` is being computed and will be published shortly."""

    req: int
    session: int
    call: int
    version: int
    checksums: tuple[int, ...] | None
    base: int | None = None
    delta_from: int | None = None

    def __post_init__(self) -> None:
        validate_version(self.version)
        _checksums(self.checksums)
        for prev in (self.base, self.delta_from):
            if prev is not None:
                validate_version(prev)
                if prev >= self.version:
                    raise ValueError(f"a delta goes forward: base {prev} is not before version {self.version}")
        if self.base is not None and self.delta_from is not None:
            raise ValueError("a publish is of a delta (base) or announces one (delta_from), not both")


@message("checksums")
class DeclareChecksums:
    req: int
    session: int
    version: int
    checksums: tuple[int, ...]

    def __post_init__(self) -> None:
        validate_version(self.version)
        _checksums(self.checksums)


def _part(first: int, checksums: tuple[int, ...]) -> None:
    _nonneg("first", first)
    if not checksums:
        raise ValueError("a part of the checksums holds at least one value")
    _checksums(checksums)


@message("checksums_part")
class DeclareChecksumsPart:
    """Checksums ``[first, first + len(checksums))`` of a published version's units, declared
    while the publisher is still hashing the rest, in order (each part continues the last;
    :class:`DeclareChecksums` with all of them follows, and must agree): readers verify what
    they pulled of that prefix without waiting for the whole shard's hash."""

    req: int
    session: int
    version: int
    first: int
    checksums: tuple[int, ...]

    def __post_init__(self) -> None:
        validate_version(self.version)
        _part(self.first, self.checksums)


@message("unpublish")
class Unpublish:
    req: int
    session: int
    call: int


@message("offloaded")
class PublishOffload:
    """The answer to :class:`OffloadRequest`: the copy is in CPU memory (``ok``), or could not be
    made."""

    req: int
    session: int
    version: int
    ok: bool


#: The longest bucket URL the wire carries.
MAX_BUCKET_URL = 1024


@message("bucket_stored")
class BucketStored:
    """A shard's copy of ``version`` is in the bucket tier at ``url`` (its writer stored it: an
    anchor, or a delta after one): the server may send readers that no peer can serve there."""

    req: int
    session: int
    version: int
    url: str = field(metadata={"max_len": MAX_BUCKET_URL})

    def __post_init__(self) -> None:
        validate_version(self.version)
        if not self.url:
            raise ValueError("a bucket URL is a non-empty string")


@message("replicate")
class Replicate:
    """``held``: the checksums of what this shard's registered buffers already hold (a delta
    chain applied in place: :mod:`tensorhub.core.table.deltas`). Where they are the version's
    declared checksums the shard holds it at once; else it pulls as usual."""

    req: int
    session: int
    call: int
    spec: int | str
    timeout: float | None
    held: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _version_spec(self.spec)
        _timeout(self.timeout)
        _checksums(self.held)


@message("update")
class Update:
    """``offload_seed``: if this replica would be the first of its datacenter to pull the version
    across datacenters, do not move; answer ``seed`` instead, and the client pulls into a CPU copy
    in the background (offload seeding, DESIGN §5.6)."""

    req: int
    session: int
    call: int
    spec: int | str
    timeout: float | None
    offload_seed: bool = False
    #: the replica can apply deltas: the server may answer with a delta chain to pull instead of
    #: moving (:class:`Updated` ``deltas``)
    deltas: bool = False

    def __post_init__(self) -> None:
        _version_spec(self.spec)
        _timeout(self.timeout)


@message("list")
class ListVersions:
    """``call`` is set for ``list(consistent=True)`` (a model-parallel transaction), else None."""

    req: int
    session: int
    call: int | None


@message("wait")
class Wait:
    """Long-poll for a listing newer than ``known_epoch``; ``satisfied_epoch`` reports that the
    predicate held on the listing of that epoch, which then becomes the replica's answer."""

    req: int
    session: int
    call: int
    known_epoch: int
    satisfied_epoch: int | None
    timeout: float | None

    def __post_init__(self) -> None:
        _timeout(self.timeout)


@message("progress")
class Progress:
    req: int
    session: int
    grant: int
    term: int
    verified: int

    def __post_init__(self) -> None:
        _nonneg("verified", self.verified)


@message("complete")
class Complete:
    req: int
    session: int
    grant: int
    term: int


@message("source_failed")
class SourceFailed:
    req: int
    session: int
    grant: int
    term: int
    verified: int
    reason: str = field(metadata={"max_len": 1024})

    def __post_init__(self) -> None:
        _nonneg("verified", self.verified)


@message("converted")
class Converted:
    """A converter built its shard of ``version``: it now holds it whole, with these checksums
    of its own bytes (its conversion grants end). ``read_bytes``: the bytes it read from each
    source shard (by source shard index), which the replication history records per grant."""

    req: int
    session: int
    term: int
    version: int
    checksums: tuple[int, ...]
    read_bytes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        validate_version(self.version)
        _checksums(self.checksums)


@message("convert_failed")
class ConvertFailed:
    """A converter cannot build ``version`` (its mapping does not fit the source's layout, a
    transform failed locally): the replica's call fails with this error."""

    req: int
    session: int
    term: int
    version: int
    code: str = field(metadata={"max_len": 64})
    message: str = field(default="", metadata={"max_len": 4096})

    def __post_init__(self) -> None:
        validate_version(self.version)


@message("checksum_failed")
class ChecksumFailed:
    req: int
    session: int
    grant: int
    term: int
    verified: int
    unit: int

    def __post_init__(self) -> None:
        _nonneg("verified", self.verified)
        _nonneg("unit", self.unit)


@message("verify_result")
class VerifyResult:
    req: int
    session: int
    version: int
    ok: bool


@message("heartbeat")
class Heartbeat:
    req: int
    sessions: tuple[int, ...] = field(metadata={"max_len": 65536})
    #: the latest ``HeartbeatAck.stamp`` of this server and its ``term`` (0: none yet): a vote
    #: for this server until stamp + lease (server clock; see :mod:`tensorhub.core.table.failover`)
    stamp: float = 0.0
    stamp_term: int = 0


@message("announce")
class Announce:
    req: int
    session: int
    holdings: tuple[Held, ...] = field(metadata={"max_len": 4096})
    partial: PartialHeld | None
    answered: int  # the last call number this shard got a final answer for (0: none)
    answers: tuple[CallAnswer, ...] = field(metadata={"max_len": 64})  # its most recent answers

    def __post_init__(self) -> None:
        for a in self.answers:
            if a.call > self.answered:
                raise ValueError(f"answer to call {a.call} announced beyond the last answered call {self.answered}")


@message("close")
class CloseShard:
    req: int
    session: int


# --- server -> client -------------------------------------------------------------------------


@message("opened")
class Opened:
    req: int
    session: int
    term: int
    heartbeat_interval: float
    heartbeat_timeout: float


@message("ack")
class Ack:
    req: int


@message("failed")
class Failed:
    """A typed error reply; :meth:`error` rebuilds the exception."""

    req: int
    code: str = field(metadata={"max_len": 64})
    message: str = ""
    model: str | None = None
    version: int | None = None
    replica: str | None = None
    shard: int | None = None
    #: :class:`~tensorhub.core.errors.InBucket`: the bucket's URL
    bucket: str | None = field(default=None, metadata={"max_len": MAX_BUCKET_URL})

    @classmethod
    def of(cls, req: int, err: TensorHubError) -> "Failed":
        bucket = getattr(err, "bucket", None)
        return cls(req, type(err).code, err.message, err.model, err.version, err.replica, err.shard, bucket)

    def error(self) -> TensorHubError:
        from .errors import InBucket, error_from_wire

        err = error_from_wire(
            self.code, self.message, model=self.model, version=self.version, replica=self.replica, shard=self.shard
        )
        if isinstance(err, InBucket):
            err.bucket = self.bucket
        return err


@message("grant")
class Grant:
    """Pull ``shard_idx`` of ``version`` from ``source``. Echoes the replicate/update ``req``.
    ``token``: the grant token the reader shows the source's transports
    (:mod:`tensorhub.core.tokens`), None when the source registered no grant key."""

    req: int
    session: int
    grant: int
    term: int
    version: int
    shard_idx: int
    source: SourceInfo
    #: the version's checksums of the shard: the same for every reader, so packed once per version
    checksums: tuple[int, ...] | None = field(metadata={"pack_once": 64})
    token: bytes | None = field(default=None, metadata={"max_len": 256})  #: to show the source (None: it checks none)


@struct
class ConvertSource:
    """One source shard a converter reads: its grant, holder, checksums, token and layout."""

    grant: int
    shard_idx: int
    source: SourceInfo
    checksums: tuple[int, ...]
    token: bytes | None = field(metadata={"max_len": 256})
    layout: Layout = field(metadata={"memo": 16})  # the same every version: decoded once
    placements: tuple[PlacedTensor, ...] = field(metadata={"memo": 16})

    def __post_init__(self) -> None:
        _checksums(self.checksums)
        if len(self.placements) != len(self.layout.tensors):
            raise ValueError(f"{len(self.placements)} placements for a layout of {len(self.layout.tensors)} tensors")


@message("convert")
class Convert:
    """Build ``shard_idx`` of ``version`` (of this converted model) from the source model's
    shards in ``sources``: one grant per source shard. A later ``Convert`` for the same version
    replaces the sources it names (a source shard re-granted after a failure). Echoes the
    replicate/update ``req``. ``source_shards``: how many shards the source replica has."""

    req: int
    session: int
    term: int
    version: int
    shard_idx: int
    source_model: str
    source_shards: int
    sources: tuple[ConvertSource, ...]


@message("revoke")
class Revoke:
    """The grant is void: discard what was not verified; a new grant (or the call's error)
    follows."""

    session: int
    grant: int
    term: int
    reason: str


@message("checksums_ready")
class ChecksumsReady:
    session: int
    grant: int
    term: int
    version: int
    checksums: tuple[int, ...] = field(metadata={"pack_once": 64})  # the same for every reader waiting


@message("checksums_part_ready")
class ChecksumsPartReady:
    """Checksums ``[first, first + len(checksums))`` of the version being pulled, from a publisher
    still hashing the rest (:class:`DeclareChecksumsPart`): verify what they cover now;
    :class:`ChecksumsReady` brings all of them later."""

    session: int
    grant: int
    term: int
    version: int
    first: int
    checksums: tuple[int, ...]

    def __post_init__(self) -> None:
        validate_version(self.version)
        _part(self.first, self.checksums)


@message("offload_request")
class OffloadRequest:
    """Your holding is the last non-spot copy of a retained version: copy it to CPU memory and
    answer with :class:`PublishOffload` before the unpublish can go on."""

    session: int
    version: int


@message("free_offload")
class FreeOffload:
    """Your offload copy of ``version`` is no longer needed and no reader is using it: free it."""

    session: int
    version: int


@message("verify_request")
class VerifyRequest:
    """A reader reported a checksum mismatch on your copy: re-verify it and answer with
    :class:`VerifyResult`."""

    session: int
    version: int


@message("quarantined")
class Quarantined:
    """Your copy of ``version`` failed verification and is no longer served."""

    session: int
    version: int


@message("removed")
class Removed:
    """Your session is void (its replica was removed, or a newer incarnation opened)."""

    session: int
    code: str
    reason: str


@message("replicated")
class Replicated:
    req: int
    version: int


@message("updated")
class Updated:
    """``skipped``: a newer version exists, but a replica of this datacenter is still seeding it
    across datacenters (smart skipping): ask again later. ``seed``: seed that version into a CPU
    copy in the background (offload seeding; the replica named
    :func:`tensorhub.core.naming.seed_replica` of this one)."""

    req: int
    moved: bool
    version: int | None
    skipped: int | None = None
    seed: int | None = None
    #: the server planned a delta chain to ``target`` for this replica (an update with
    #: ``deltas``): pull these versions of the delta model, in order, apply them, then
    #: ``Replicate(target, held=...)``. The call did not move (``moved`` False).
    deltas: tuple[DeltaRef, ...] | None = None
    target: int | None = None


@message("get_status")
class GetStatus:
    """Ask the server for its state (no session needed): :class:`ServerStatus`."""

    req: int


@struct
class Seeding:
    """A version being seeded into a datacenter: the replicas there that pull it across."""

    model: str
    version: int
    datacenter: str
    replicas: tuple[str, ...]


@message("server_status")
class ServerStatus:
    """Counts of what the table holds, event counters, bytes moved per link class (``host``,
    ``datacenter``, ``remote``: bytes of ended grants), and the seeding in progress."""

    req: int
    term: int
    counts: dict[str, int]
    stats: dict[str, int]
    bytes_by_link: dict[str, int]
    seeding: tuple[Seeding, ...]


@message("get_dag")
class GetDag:
    """Ask for the replication DAG of one version (no session needed): :class:`Dag`."""

    req: int
    model: str
    version: int

    def __post_init__(self) -> None:
        validate_model(self.model)
        validate_version(self.version)


@struct
class DagEdge:
    """One ended grant: who served whom, the bytes moved under it, when (server clock), how it ended."""

    reader: str
    reader_shard: int
    reader_dc: str
    reader_host: str
    source: str
    source_shard: int
    source_kind: str
    source_complete: bool
    source_dc: str
    source_host: str
    bytes: int
    start: float
    end: float
    outcome: str


@message("dag")
class Dag:
    req: int
    model: str
    version: int
    edges: tuple[DagEdge, ...]

    def as_dict(self) -> dict[str, Any]:
        """The form :mod:`tensorhub.scheduling.dag` takes."""
        return {"model": self.model, "version": self.version, "edges": [dataclasses.asdict(e) for e in self.edges]}


@message("listing")
class Listing:
    req: int
    epoch: int
    final: bool
    versions: tuple[VersionEntry, ...]

    def as_dict(self) -> dict[int, dict[str, ReplicaEntry]]:
        return {v.version: {r.replica: r for r in v.replicas} for v in self.versions}


@message("heartbeat_ack")
class HeartbeatAck:
    req: int
    unknown: tuple[int, ...]
    #: this server's term and clock when it answered: the client echoes them in its heartbeats
    term: int = 0
    stamp: float = 0.0
    #: how long an echoed stamp counts as a vote (0: this server needs no votes)
    lease: float = 0.0
    #: whether this server decides now (False: calls are refused until it reigns)
    reigning: bool = True


# --- operations: transfer spans, cluster state, traces ------------------------------------------

#: How a reader's transfer under one grant ended, as it reports it.
SPAN_OUTCOMES = ("completed", "failed", "checksum_failed", "revoked", "aborted")


@message("transfer_span")
class TransferSpan:
    """A reader's report of one transfer (its pull under one grant), sent when the grant ends
    on its side. Times are the reader's wall clock (seconds since the epoch). The server answers
    only an error (send with ``req`` 0)."""

    req: int
    session: int
    grant: int
    version: int
    source_replica: str
    source_shard: int
    transport: str = field(metadata={"max_len": 64})
    bytes: int
    reads: int
    start: float
    end: float
    outcome: str = field(metadata={"max_len": 32})

    def __post_init__(self) -> None:
        validate_version(self.version)
        validate_replica(self.source_replica)
        for what in ("grant", "source_shard", "bytes", "reads"):
            _nonneg(what, getattr(self, what))
        if self.bytes > U64:
            raise ValueError("bytes must fit in 64 bits")
        if not 0 <= self.start <= self.end <= 1e11:
            raise ValueError(f"a span needs 0 <= start <= end (seconds since the epoch), got {self.start}..{self.end}")
        if self.outcome not in SPAN_OUTCOMES:
            raise ValueError(f"outcome must be one of {SPAN_OUTCOMES}, got {self.outcome!r}")


@struct
class SpanEntry:
    """A transfer span as the server keeps it: the reader named by the server (its session),
    the rest as the reader reported."""

    reader: str
    reader_shard: int
    reader_dc: str
    reader_host: str
    grant: int
    source: str
    source_shard: int
    transport: str
    bytes: int
    reads: int
    start: float
    end: float
    outcome: str


@message("get_trace")
class GetTrace:
    """Ask for what the server knows of one version's replication: :class:`Trace`."""

    req: int
    model: str
    version: int

    def __post_init__(self) -> None:
        validate_model(self.model)
        validate_version(self.version)


@message("trace")
class Trace:
    """The reported transfer spans of a version and the server's record of its grants (edges:
    server clock; ``clock_offset`` turns that clock into seconds since the epoch)."""

    req: int
    model: str
    version: int
    spans: tuple[SpanEntry, ...]
    edges: tuple[DagEdge, ...]
    clock_offset: float


@message("get_cluster")
class GetCluster:
    """Ask for the cluster's state (no session needed): :class:`ClusterState`."""

    req: int


@struct
class ShardState:
    """One open shard (session) of a replica: where it is and what its buffers hold."""

    shard_idx: int
    session: int
    datacenter: str
    host: str
    version: int | None  # the version its registered buffers hold or are pulling (None: none)
    state: str  # "partial", "complete", "unpublishing", or "" (nothing held)
    verified: int  # bytes verified of that version
    total_bytes: int  # the shard's size (0: not registered)
    offloads: tuple[int, ...]  # versions held as offload (CPU) copies
    idle_s: float  # seconds since the server last heard from it


@struct
class ReplicaState:
    replica: str
    num_shards: int
    spot: bool
    shards: tuple[ShardState, ...]


@struct
class VersionState:
    version: int
    available: bool
    retained: bool
    holders: int  # complete or offload holders, all shards
    partial: int  # readers pulling it
    offloaded: int  # offload copies among the holders
    replicas: tuple[str, ...]  # replicas holding it completely (all shards)


@struct
class ModelState:
    model: str
    num_shards: int
    highest_published: int | None
    retain_back: int | None
    versions: tuple[VersionState, ...]
    replicas: tuple[ReplicaState, ...]


@struct
class GrantState:
    """An active grant: ``reader`` pulls shard ``shard_idx`` of ``version`` from ``source``."""

    grant: int
    model: str
    version: int
    shard_idx: int
    reader: str
    source: str
    source_kind: str
    source_complete: bool
    verified: int
    total_bytes: int
    age_s: float
    bytes_per_s: float  # verified under this grant, per second since it began


@message("cluster_state")
class ClusterState:
    """What the server knows now: models, their versions and replicas, the active grants, and
    the transfer rate of recent reported spans (bytes per second over ``window_s``)."""

    req: int
    term: int
    time: float  # the server's wall clock
    models: tuple[ModelState, ...]
    grants: tuple[GrantState, ...]
    window_s: float
    recent_bytes_per_s: float
    reigns: tuple[ReignSpan, ...] = ()  #: this server's reigns, oldest first (bounded)
    #: a primary's or backup's voters (None: a server alone): the epoch of the membership it holds
    #: (a primary: the one its backup acknowledged; 0: none known yet) and how many slots it has
    membership: int | None = field(default=None, metadata={"added": True})
    voters: int | None = field(default=None, metadata={"added": True})

    def __post_init__(self) -> None:
        if self.membership is not None:
            _nonneg("membership", self.membership)
        if self.voters is not None:
            _nonneg("voters", self.voters)


# --- between a primary and its backup; stepping down (issue 23) -----------------------------------


@struct
class ReignSpan:
    """One reign of a server (:mod:`tensorhub.core.table.failover`), on its monotonic clock:
    when it began and ended (None: still reigning), and when it first and last granted."""

    term: int
    start: float
    end: float | None
    first_grant: float | None
    last_grant: float | None
    grants: int


@message("lease_request")
class LeaseRequest:
    """Primary -> backup: "promise not to reign for ``lease`` seconds". ``voters``: the
    membership of ``epoch`` when the backup may not have it yet (None: unchanged)."""

    req: int
    term: int
    epoch: int
    voters: tuple[str, ...] | None = field(default=None, metadata={"max_len": 1 << 20})

    def __post_init__(self) -> None:
        _nonneg("epoch", self.epoch)


@message("lease_reply")
class LeaseReply:
    """Backup -> primary: the promise is made (``granted``) from when the request arrived;
    ``epoch`` is the membership the backup holds, with its ``voters`` when newer than the
    request's. ``reigns``: how many reigns the backup (this process, of ``term``'s line) has
    begun so far; a primary whose lease ran out forgets its sessions only if that changed since
    the last reply it had (None: a backup of an earlier release, which does not say: the
    primary forgets them, as before)."""

    req: int
    term: int
    granted: bool
    lease: float
    epoch: int
    voters: tuple[str, ...] | None = field(default=None, metadata={"max_len": 1 << 20})
    reigns: int | None = field(default=None, metadata={"added": True})

    def __post_init__(self) -> None:
        _nonneg("epoch", self.epoch)
        if self.reigns is not None:
            _nonneg("reigns", self.reigns)
        if not 0 <= self.lease <= 1e4:
            raise ValueError(f"lease must be in [0, 1e4] seconds, got {self.lease}")


@message("step_down")
class StepDown:
    """The server stopped deciding (it lost its lease and its majority, or the primary is
    back): the session is gone there; move to another server of the list and re-announce."""

    session: int
    term: int
    reason: str = ""
