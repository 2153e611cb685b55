"""Publishing: how holdings enter and leave service: publish, checksums, unpublish and drain,
offload, retention.

Theory of operation
-------------------
What it owns: publishing the holding of a shard's registered buffers and declaring its
checksums; unpublishing it (no new grants, the active ones drain, then it is freed, and what
is left at ``drain_timeout`` is revoked); offloading the last non-spot copy of a retained
version into a CPU copy before it goes; releasing offload copies once retention no longer needs
them; the highest published version, from which retention counts.

Invariants: the checksums of a (version, shard) are declared once (a publisher may declare them
in parts while it hashes, in order, each relayed at once to the readers pulling without them;
the whole declaration that follows, or anyone else's, must agree with the parts); a publish with
other ones is refused (``VersionConflict``), a publish without them of a (version, shard) whose checksums are
known is refused with ``ChecksumsRequired`` (the handle hashes and makes the call again with
them), and a holding declaring other ones is quarantined. An unpublishing holder gets no new
grants and is freed only when drained. The last non-spot complete copy of a retained version (or
of a pinned one, in a model that keeps CPU copies: :meth:`_Model.offloads`) is offloaded before
it unpublishes; an offload copy is released only once its version is not
kept (retained, or pinned by a replicate/update in flight) or another non-spot holder has
completed it. An unpublish is answered only when the
holding is gone.

What it must never do: free a holder that has active grants, or answer an unpublish early.
"""

from __future__ import annotations

from typing import Callable, Hashable

from .. import messages as m
from ..errors import ChecksumsRequired, ContractViolation, InvalidArgument, NotRegistered, TensorHubError, VersionConflict
from ..lifecycle import Event
from .records import SERVING, C, P, U, _Holder, _Model, _offload_of, _Session
from .state import TableState


class PublishMixin(TableState):
    """Publish, checksums, unpublish, drain, offload, retention. Mixed into
    :class:`~tensorhub.core.table.ReferenceTable`. State
    (:class:`~tensorhub.core.table.state.TableState`): ``clock``, ``config``, ``term``,
    ``sessions``, ``stats``."""

    def _on_publish(self, peer: Hashable, msg: m.Publish) -> None:
        s = self._session(peer, msg.session)
        if msg.checksums is None and s.holder is None and s.layout is not None:
            ver = s.model.versions.get(msg.version)
            if ver is not None and ver.checksums.get(s.shard_idx) is not None:
                # The number names a content already: these bytes must prove they are it before
                # anyone can be granted them (else a reader verifies against the wrong sums forever).
                raise ChecksumsRequired(
                    "the version's checksums are known: publish it with this shard's checksums", **s.ctx(msg.version)
                )
        txn, call = self._join(s, msg.req, msg.call, "publish", msg.version)
        ctx = s.ctx(msg.version)
        try:
            if s.layout is None:
                raise NotRegistered("publish needs registered tensors: register first", **ctx)
            h = s.holder
            if h is not None and not (h.version == msg.version and h.state is C):
                raise ContractViolation(
                    f"publish({msg.version}) while holding version {h.version} ({h.state.value if h.state is not None else 'gone'}): unpublish first", **ctx
                )
            if msg.checksums is not None:
                self._check_checksums(s, msg.version, msg.checksums)
            self._check_delta_publish(s, msg.version, msg.base)
        except TensorHubError as err:
            self._finish_call(txn, call, m.Failed.of(msg.req, err))
            return
        if h is None:
            h = self._new_holder(s, msg.version, m.KIND_NORMAL, Event.PUBLISH)
            s.holder = h
            self._record_delta(s, msg.version, msg.base, msg.delta_from)
            self._published(s.model, msg.version)
        if msg.checksums is not None:
            self._set_checksums(h, msg.checksums)
        self._finish_call(txn, call, m.Ack(msg.req))

    def _published(self, model: _Model, version: int) -> None:
        if model.highest_published is None or version > model.highest_published:
            model.highest_published = version
            self._retention_moved(model)  # offload copies may no longer be needed

    def _retention_moved(self, model: _Model) -> None:
        model.retention_changed = True
        self._mark_dirty(model)

    def _check_checksums(self, s: _Session, version: int, checksums: tuple[int, ...]) -> None:
        ctx = s.ctx(version)
        assert s.layout is not None
        want = s.layout.checksum_count()
        if len(checksums) != want:
            raise InvalidArgument(f"{len(checksums)} checksums declared; the layout has {want} checksum units", **ctx)
        ver = s.model.versions.get(version)
        known = ver.checksums.get(s.shard_idx) if ver is not None else None
        if known is not None and known != checksums:
            raise VersionConflict("another holder of this version and shard declared different checksums", **ctx)
        prefix = ver.prefix.get(s.shard_idx) if ver is not None and known is None else None
        if prefix is not None and checksums[: len(prefix)] != prefix:
            raise VersionConflict("the checksums differ from those declared in parts for this version and shard", **ctx)

    def _set_checksums(self, h: _Holder, checksums: tuple[int, ...]) -> None:
        h.checksums = checksums
        ver = h.session.model.versions[h.version]
        if h.shard_idx in ver.checksums:
            return
        ver.checksums[h.shard_idx] = checksums
        ver.prefix.pop(h.shard_idx, None)
        self._wake_converters(h.session.model)  # a converter waits for every source shard's checksums
        for other in ver.holders[h.shard_idx].values():  # readers pulling without them get them now
            if other.state is P and other.checksums is None:
                other.checksums = checksums
                g = other.upstream
                if g is not None:
                    self._send(
                        other.session, m.ChecksumsReady(other.session.id, g.id, self.term, other.version, checksums)
                    )

    def _on_checksums(self, peer: Hashable, msg: m.DeclareChecksums) -> None:
        s = self._session(peer, msg.session)
        h = s.holder if s.holder is not None and s.holder.version == msg.version else _offload_of(s, msg.version)
        if h is None or h.state is P:
            raise ContractViolation("checksums declared for a version this shard has not published", **s.ctx(msg.version))
        if h.checksums is not None and h.checksums != msg.checksums:
            raise ContractViolation("checksums already declared with other values", **s.ctx(msg.version))
        try:
            self._check_checksums(s, msg.version, msg.checksums)
        except VersionConflict:
            self._conflicting(s, h, msg.version)
            raise
        self._set_checksums(h, msg.checksums)
        self._ack(s, msg.req)

    def _conflicting(self, s: _Session, h: _Holder, version: int) -> None:
        """The holding is not the version others hold under that number: it must not serve."""
        self._remove_holder(h, Event.QUARANTINE, "the holder's checksums conflict with the version's")
        self._send(s, m.Quarantined(s.id, version))
        self._fail_pulls(s, version, VersionConflict("this shard's copy conflicts with the version", **s.ctx(version)))

    def _on_checksums_part(self, peer: Hashable, msg: m.DeclareChecksumsPart) -> None:
        """Checksums ``[first, end)`` of a version this shard published and is hashing: they
        extend the (version, shard)'s declared prefix (a part may repeat what it holds, never
        differ from it or leave a gap), and the new ones go to every reader pulling without them."""
        s = self._session(peer, msg.session)
        h = s.holder
        ctx = s.ctx(msg.version)
        if h is None or h.version != msg.version or h.state is P:
            raise ContractViolation("checksums declared for a version this shard has not published", **ctx)
        if s.layout is None:
            raise NotRegistered("checksums declared in parts before tensors were registered", **ctx)
        count, end = s.layout.checksum_count(), msg.first + len(msg.checksums)
        if end > count:
            raise InvalidArgument(f"checksums [{msg.first}, {end}) declared in a part; the layout has {count} checksum units", **ctx)
        ver = s.model.versions[msg.version]
        known = ver.checksums.get(s.shard_idx)
        prefix = known if known is not None else ver.prefix.get(s.shard_idx, ())
        if msg.first > len(prefix):
            raise InvalidArgument(f"a part of the checksums from unit {msg.first} leaves a gap: {len(prefix)} are declared", **ctx)
        held = prefix[msg.first : end]
        if held != msg.checksums[: len(held)]:
            self._conflicting(s, h, msg.version)
            raise VersionConflict("the part's checksums differ from those declared for this version and shard", **ctx)
        new = msg.checksums[len(held) :]
        self._ack(s, msg.req)
        if not new or known is not None:
            return
        first = len(prefix)
        ver.prefix[s.shard_idx] = prefix + new
        for other in ver.holders[s.shard_idx].values():  # readers pulling without checksums verify these now
            g = other.upstream
            if other.state is P and other.checksums is None and g is not None:
                self._send(other.session, m.ChecksumsPartReady(other.session.id, g.id, self.term, other.version, first, new))

    def _on_unpublish(self, peer: Hashable, msg: m.Unpublish) -> None:
        s = self._session(peer, msg.session)
        txn, call = self._join(s, msg.req, msg.call, "unpublish", None)
        h = s.holder
        if h is None:
            self._finish_call(txn, call, m.Ack(msg.req))
            return
        self._unpublish(h, lambda: self._finish_call(txn, call, m.Ack(msg.req)))

    def _on_offloaded(self, peer: Hashable, msg: m.PublishOffload) -> None:
        s = self._session(peer, msg.session)
        h = s.holder
        if h is None or h.version != msg.version or not h.offload_pending:
            raise ContractViolation("no offload was requested for this version", **s.ctx(msg.version))
        if msg.ok:
            if _offload_of(s, msg.version) is not None:
                raise ContractViolation("this shard already holds an offload copy of the version", **s.ctx(msg.version))
            o = self._new_holder(s, msg.version, m.KIND_OFFLOAD, Event.PUBLISH_OFFLOAD)
            o.checksums = h.checksums
            s.offloads[o.id] = o
        h.offload_pending = False
        then, h.on_offloaded = h.on_offloaded, None
        self._ack(s, msg.req)
        if then is not None:
            then()

    def _unpublish(self, h: _Holder, then: Callable[[], None]) -> None:
        """Unpublish a holder of the registered buffers: offload first if it is the last
        non-spot copy of a retained version; then no new grants, drain, and call ``then``."""
        if h.state is U:
            h.on_drained.append(then)
            return
        if h.state is P:
            self._abort_partial(h)
            if h.state is U:
                h.on_drained.append(then)
            else:
                then()
            return
        if h.offload_pending:
            h.on_drained.append(then)
            return
        if self._last_retained(h):
            self._fire(h, Event.UNPUBLISH_LAST_RETAINED)
            h.offload_pending = True
            h.on_drained.append(then)
            h.on_offloaded = lambda: self._unpublish_now(h)
            self.stats["offloads"] += 1
            self._send(h.session, m.OffloadRequest(h.session.id, h.version))
            return
        self._unpublish_now(h, then)

    def _unpublish_now(self, h: _Holder, then: Callable[[], None] | None = None) -> None:
        if then is not None:
            h.on_drained.append(then)
        self._fire(h, Event.UNPUBLISH)
        self._begin_drain(h)

    def _last_retained(self, h: _Holder) -> bool:
        if h.spot or h.kind != m.KIND_NORMAL or not h.session.model.offloads(h.version):
            return False
        holders = self._holder_set(h.session.model, h.version, h.shard_idx)
        return not any(o is not h and o.state in SERVING and not o.spot for o in holders.values())

    def _drained(self, h: _Holder) -> None:
        callbacks, h.on_drained = h.on_drained, []
        owner = h.session
        was_offload = h.kind == m.KIND_OFFLOAD
        self._fire(h, Event.DRAINED)
        if was_offload and owner.id in self.sessions:
            self._send(owner, m.FreeOffload(owner.id, h.version))
        for cb in callbacks:
            cb()

    def _begin_drain(self, h: _Holder) -> None:
        if not h.grants:
            self._drained(h)
            return
        h.drain_deadline = self.clock() + self.config.drain_timeout
        self._timer(h.drain_deadline, "drain", h)

    def _drain_expired(self, h: _Holder, now: float) -> None:
        if h.state is not U or h.drain_deadline is None or h.drain_deadline > now:
            return
        readers = [g.reader for g in h.grants.values()]
        for g in list(h.grants.values()):
            self._revoke(g, "drain timeout: the holder is unpublishing")
        for r in readers:
            self._regrant(r)

    def _maybe_release(self, h: _Holder, holders: dict[int, _Holder]) -> None:
        """Release an offload copy once the version is no longer kept (retained or pinned) or
        another non-spot holder has completed it. Its readers drain first; then its owner frees it."""
        model = h.session.model
        if model.kept(h.version) and not any(
            o.state is C and not o.spot and not o.offload_pending for o in holders.values()
        ):
            return
        self._fire(h, Event.RELEASE)
        self._begin_drain(h)
