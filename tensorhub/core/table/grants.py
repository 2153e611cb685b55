"""Grants: who reads from whom, and what happens when a read goes wrong.

Theory of operation
-------------------
What it owns: picking a reader's source through the injected source index (``sources=``, the
scheduling policy: the table only says which holders are eligible), making grants and ending
them (completed, failed, revoked or cancelled), the load per source replica that the index
sorts by, the readers' progress and completion reports, and the failure paths. A source that
failed a reader is excluded for it (tried again up to ``_MAX_SOURCE_FAILURES`` failures in all);
one whose bytes failed the reader's checksums is excluded for good and asked to verify its copy:
a second reporter or a failed self-check quarantines it, a passed one re-admits it to the
readers that blamed it, once.

Each grant from a source that registered a grant key carries a token sealed with that key
(:mod:`tensorhub.core.tokens`): the reader shows it to the source's transports, which refuse a
read without one. The token binds the term, grant id, reader session and version, and expires
``TableConfig.grant_ttl`` after the grant (server clock); it is a pure function of the table's
state, so the same seed gives the same tokens.

Invariants: no grant from an unpublishing holder, the reader's own replica, a holder downstream
of the reader (so the upstream graph has no cycle) or, without ``pipeline``, a partial holder.
A holder's ``grants`` are exactly its active grants, and its replica's ``serving`` counts them
per reader replica. Every grant ends exactly once (``_end_grant``). A revoked grant id is
remembered, so a mismatch reported on it blames nobody. A reader with no source waits (in the
grace period, or while a source it blamed is checking itself) or fails its call with the reason.

What it must never do: pick the source itself (that is the policy's), or grant a reader a source
it excluded.
"""

from __future__ import annotations

from typing import Hashable

from .. import messages as m
from ..errors import (
    ChecksumMismatch,
    ContractViolation,
    InvalidArgument,
    StaleGrant,
    TensorHubError,
    TransportError,
    UnknownGrant,
    VersionUnavailable,
)
from ..lifecycle import Event
from ..tokens import GrantToken
from .records import (
    _FENCED_MEMORY,
    _MAX_SOURCE_FAILURES,
    SERVING,
    P,
    U,
    _Grant,
    _Holder,
    _Model,
    _offload_of,
    _Replica,
    _Session,
    _Txn,
)
from .state import TableState


class GrantMixin(TableState):
    """Source selection, grants, and the reports readers make under them. Mixed into
    :class:`~tensorhub.core.table.ReferenceTable`. State
    (:class:`~tensorhub.core.table.state.TableState`): ``clock``, ``rng``, ``config``, ``term``,
    ``grants``, ``_by_id``, ``revoked``, ``_ids``, ``stats``, ``_out``, ``_grants_sent``."""

    def _downstream(self, h: _Holder) -> dict[int, None]:
        seen: dict[int, None] = {h.id: None}
        stack = [h]
        while stack:
            x = stack.pop()
            for g in x.grants.values():
                if g.reader.id not in seen:
                    seen[g.reader.id] = None
                    stack.append(g.reader)
        return seen

    def _select(self, reader: _Holder, prefer: str | None, retry_failed: bool) -> _Holder | None:
        """The source for ``reader`` by the policy of :mod:`tensorhub.scheduling.selection`. Eligible:
        not unpublishing, not downstream of the reader, not of its replica, not excluded (a
        source that failed it is eligible again only on ``retry_failed``; one that failed
        verification never)."""
        model = reader.session.model
        index = model.versions[reader.version].index[reader.shard_idx]
        below = self._downstream(reader) if reader.grants else {reader.id: None}
        own = reader.replica
        excluded = reader.excluded
        by_id = self._by_id
        pipeline = self.config.pipeline

        def eligible(key: int) -> bool:
            if key in below or (key in excluded and (excluded[key] or not retry_failed)):
                return False
            h = by_id[key]
            return h.replica is not own and h.state is not U and (pipeline or h.state is not P) and h.converting is None

        key = index.select(reader.session.location, self.rng, eligible, prefer)
        return by_id[key] if key is not None else None

    def _regrant(self, reader: _Holder) -> None:
        """Give a partial holder (whose call is in flight) a source, or fail / park its call."""
        if reader.state is not P or reader.upstream is not None or reader.call is None:
            return
        if reader.converting is not None:  # a converter: grant the source shards it lacks
            self._convert(reader)
            return
        txn, _ = reader.call
        pick = self._select(reader, txn.source_replica, retry_failed=False)
        if pick is None and reader.excluded and reader.failures <= _MAX_SOURCE_FAILURES:
            pick = self._select(reader, txn.source_replica, retry_failed=True)
        if pick is None and reader.session.model.source is not None:
            self._convert(reader)  # nobody holds this converted shard: convert it, or wait for its converter
            return
        if pick is None:
            self._no_source(reader, txn)
            return
        source = pick
        if txn.source_replica is None:
            txn.source_replica = source.replica.name
        reader.waiting = False
        reader.session.model.waiting_readers.pop(reader, None)
        g, info, token = self._open_grant(reader, source)
        reader.upstream = g
        s = reader.session
        self._out.append((s.peer, m.Grant(g.req, s.id, g.id, self.term, reader.version, reader.shard_idx, info, reader.checksums, token)))
        if reader.checksums is None:  # the publisher is still hashing: what it declared so far
            prefix = s.model.versions[reader.version].prefix.get(reader.shard_idx)
            if prefix:
                self._out.append((s.peer, m.ChecksumsPartReady(s.id, g.id, self.term, reader.version, 0, prefix)))
        self._grants_sent += 1

    def _no_source(self, reader: _Holder, txn: _Txn) -> None:
        """No eligible source for ``reader``: wait (grace period, or a blamed source checking
        itself), or fail its call with the reason."""
        ctx = reader.session.ctx(reader.version)
        holders = self._holder_set(reader.session.model, reader.version, reader.shard_idx)
        serving_excluded = [reader.excluded[h.id] for h in holders.values() if h.state in SERVING and h.id in reader.excluded]
        checking = [h for h in holders.values() if h.state in SERVING and reader.excluded.get(h.id) and h.verify_pending]
        if checking:
            # A source this reader found a mismatch on is re-hashing its copy: wait for the
            # verdict (a pass re-admits it: the bytes were damaged on the way).
            reader.waiting = True
            reader.session.model.waiting_readers[reader] = None
            return
        if any(serving_excluded) or reader.blamed_bad:
            err: TensorHubError = ChecksumMismatch("every remaining holder of this shard failed verification", **ctx)
        elif serving_excluded:
            last = f"; the last said: {reader.last_failure}" if reader.last_failure else ""
            err = TransportError(f"every remaining source failed this reader ({reader.failures} failures){last}", **ctx)
        elif self.in_grace:
            reader.waiting = True
            reader.session.model.waiting_readers[reader] = None
            return
        else:
            err = VersionUnavailable(f"no holder can serve version {reader.version} any more", **ctx)
        self._fail_txn(txn, self._in_bucket(reader, err))

    def _open_grant(self, reader: _Holder, source: _Holder) -> tuple[_Grant, m.SourceInfo, bytes | None]:
        """Make a grant of ``source`` to ``reader`` (counted on the source), with what the reader
        is told of the source and the token it shows it. The caller links it to the reader."""
        assert reader.call is not None
        txn, _ = reader.call
        g = _Grant(next(self._ids), reader, source, txn.shards[reader.shard_idx].req, self.clock())
        self.grants[g.id] = g
        self.stats["grants"] += 1
        source.grants[g.id] = g
        serving = source.replica.serving
        count = serving.get(reader.replica.name, 0)
        serving[reader.replica.name] = count + 1
        if not count:
            self._reindex(source.replica)
        src_session = source.session
        info = m.SourceInfo(
            src_session.id,
            source.replica.name,
            source.shard_idx,
            source.kind,
            source.state is not P,
            src_session.location,
            src_session.endpoint,
        )
        key = src_session.grant_key
        s = reader.session
        token = None if key is None else GrantToken(self.term, g.id, s.id, reader.version, g.created, self.config.grant_ttl).seal(key)
        return g, info, token

    def _load(self, replica: _Replica) -> int:
        """A source replica's load for selection: the reader replicas it serves, plus those its
        twin serves (``_Replica.twin``: its offload seed replica, or the replica a seed replica
        seeds for): they send over the same host and link."""
        name = replica.twin
        twin = replica.model.replicas.get(name) if name is not None else None
        return len(replica.serving) + (len(twin.serving) if twin is not None else 0)

    def _reindex(self, replica: _Replica) -> None:
        """The replica's load changed: move its grantable holders (and its twin's) to their new
        buckets."""
        name = replica.twin
        twin = replica.model.replicas.get(name) if name is not None else None
        if twin is None:
            self._reindex_one(replica, len(replica.serving))
            return
        self._reindex_one(replica, len(replica.serving) + len(twin.serving))
        self._reindex_one(twin, self._load(twin))

    def _reindex_one(self, r: _Replica, load: int) -> None:
        versions = r.model.versions
        name = r.name
        for s in r.shards.values():
            h = s.holder
            if h is not None:
                state = h.state
                if state is not None and state is not U:
                    versions[h.version].index[h.shard_idx].put(h.id, name, s.location, load, state is not P)
            if s.offloads:
                for h in s.offloads.values():
                    state = h.state
                    if state is not None and state is not U:
                        versions[h.version].index[h.shard_idx].put(h.id, name, s.location, load, state is not P)

    def _regrant_waiting(self, model: _Model) -> None:
        for h in list(model.waiting_readers):
            self._regrant(h)

    def _revoke(self, g: _Grant, reason: str) -> None:
        self.stats["revoked"] += 1
        self.revoked[g.id] = None
        if len(self.revoked) > _FENCED_MEMORY:
            self.revoked.popitem(last=False)
        reader = g.reader
        self._end_grant(g, "revoked")
        self._send(reader.session, m.Revoke(reader.session.id, g.id, self.term, reason))

    def _end_grant(self, g: _Grant, how: str, reached: int | None = None) -> None:
        """End a grant (``how``: completed, failed, revoked, cancelled); ``reached``: what the
        reader had verified at its end, if the reader said so (for the replication history)."""
        if g.ended is not None:
            raise AssertionError(f"grant {g.id} ended twice ({g.ended}, {how})")
        g.ended = how
        self._record(g, how, reached)
        self.stats["grants_ended"] += 1
        del self.grants[g.id]
        src = g.source
        del src.grants[g.id]
        if g.reader.upstream is g:
            g.reader.upstream = None
        else:
            self._grant_ended(g)
        serving = src.replica.serving
        key = g.reader.replica.name
        serving[key] -= 1
        if not serving[key]:
            del serving[key]
            self._reindex(src.replica)
        if src.state is U and not src.grants:
            self._drained(src)

    def _reader_grant(self, s: _Session, grant: int, term: int) -> _Grant:
        if term != self.term:
            raise StaleGrant(f"grant {grant} is from server term {term}; this server's term is {self.term}", **s.ctx())
        g = self.grants.get(grant)
        if g is None or g.reader.session is not s:
            raise UnknownGrant(f"grant {grant} is not an active grant of this session", **s.ctx())
        return g

    def _on_progress(self, peer: Hashable, msg: m.Progress) -> None:
        s = self._session(peer, msg.session)
        g = self._reader_grant(s, msg.grant, msg.term)
        total = s.total_bytes
        if msg.verified > total:
            raise InvalidArgument(f"progress {msg.verified} beyond the shard's {total} bytes", **s.ctx(g.reader.version))
        g.reader.verified = max(g.reader.verified, msg.verified)

    def _on_complete(self, peer: Hashable, msg: m.Complete) -> None:
        s = self._session(peer, msg.session)
        g = self._reader_grant(s, msg.grant, msg.term)
        reader = g.reader
        if reader.converting is not None:
            raise ContractViolation("a converter reports converted, not complete", **s.ctx(reader.version))
        self._end_grant(g, "completed")
        self._fire(reader, Event.COMPLETE)
        reader.verified = s.total_bytes
        ver = s.model.versions[reader.version]
        reader.checksums = ver.checksums.get(reader.shard_idx, reader.checksums)
        self._ack(s, msg.req)
        # Readers pulling from this holder now see a complete source.
        self._holding_done(reader)

    def _holding_done(self, h: _Holder) -> None:
        """``h`` holds its version whole now (pulled or converted): its call may be answered."""
        call, h.call = h.call, None
        if call is not None:
            txn, idx = call
            if txn.replica.txns.get(txn.n) is txn and idx in txn.shards:
                self._maybe_answer(txn)

    def _on_source_failed(self, peer: Hashable, msg: m.SourceFailed) -> None:
        s = self._session(peer, msg.session)
        g = self._reader_grant(s, msg.grant, msg.term)
        reader = g.reader
        reader.excluded[g.source.id] = False
        reader.failures += 1
        reader.last_failure = msg.reason[:500]
        self._end_grant(g, "failed", max(reader.verified, msg.verified))
        self._fire(reader, Event.SOURCE_FAILED)
        reader.verified = max(reader.verified, msg.verified)
        self._ack(s, msg.req)
        self._regrant(reader)

    def _on_checksum_failed(self, peer: Hashable, msg: m.ChecksumFailed) -> None:
        s = self._session(peer, msg.session)
        if msg.term == self.term and msg.grant in self.revoked:
            self._ack(s, msg.req)  # a mismatch on a revoked grant blames nobody
            return
        g = self._reader_grant(s, msg.grant, msg.term)
        reader, source = g.reader, g.source
        reader.excluded[source.id] = True
        self._end_grant(g, "failed", min(reader.verified, msg.verified))
        self._fire(reader, Event.SOURCE_FAILED)
        reader.verified = min(reader.verified, msg.verified)
        source.reporters[reader.replica.name] = None
        self._ack(s, msg.req)
        if len(source.reporters) >= 2:
            self._quarantine(source)
        elif not source.verify_pending and source.state is not P:
            source.verify_pending = True
            self._send(source.session, m.VerifyRequest(source.session.id, source.version))
        self._regrant(reader)

    def _on_verify_result(self, peer: Hashable, msg: m.VerifyResult) -> None:
        s = self._session(peer, msg.session)
        h = s.holder if s.holder is not None and s.holder.version == msg.version else _offload_of(s, msg.version)
        if h is None:  # the holding went away meanwhile: nothing left to judge
            self._ack(s, msg.req)
            return
        if not h.verify_pending:
            raise ContractViolation("no verification was requested for this version", **s.ctx(msg.version))
        h.verify_pending = False
        self._ack(s, msg.req)
        model = s.model
        waiting = self._waiting_of(model)  # converters of models converted from it wait on it too
        if not msg.ok:
            for r in waiting:
                if r.excluded.get(h.id) is True:
                    r.blamed_bad = True  # if nothing else can serve it, say why: the copy was bad
            self._quarantine(h)
        else:
            # Its copy is sound: the readers that blamed it saw bytes damaged on the way. Each
            # may use it again, once (a second mismatch from the same reader excludes it for
            # good: ``readmitted``), as a source that failed rather than one that lied.
            for r in waiting:
                if r.excluded.get(h.id) is True and h.id not in r.readmitted:
                    r.excluded[h.id] = False
                    r.readmitted[h.id] = None
            h.reporters.clear()
        self._regrant_waiting(model)
        self._wake_converters(model)

    def _quarantine(self, h: _Holder) -> None:
        self.stats["quarantined"] += 1
        s = h.session
        self._send(s, m.Quarantined(s.id, h.version))
        self._remove_holder(h, Event.QUARANTINE, "the holder failed verification")
        err = ChecksumMismatch("this shard's copy failed verification", **s.ctx(h.version))
        self._fail_pulls(s, h.version, err)

    def _fail_pulls(self, s: _Session, version: int, err: TensorHubError) -> None:
        """A shard lost its holding of ``version``: a replicate/update of the replica that
        counted on it (in flight, or done for this shard and waiting for the others) fails."""
        for txn in list(s.replica.txns.values()):
            call = txn.shards.get(s.shard_idx)
            if txn.kind in ("replicate", "update") and txn.version == version and call is not None and not call.done:
                self._fail_txn(txn, err)
