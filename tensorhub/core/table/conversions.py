"""Conversions: a model that holds another model's versions in another layout.

Theory of operation
-------------------
A **converted model** is opened with ``source=`` naming the model it is converted from (the
trainer's). Its shards register their own layout and each tensor's placement: other names,
another number of shards, fused projections, FP8. Its versions are its source's: ``latest`` is
the newest version available in either, and any version of the source that is available can be
had in the converted model. Everything else about it is an ordinary model: its holders serve
its readers, pipelined, retained and failed over as any other.

Who converts. A reader of a converted model whose (version, shard) has no holder to pull from
becomes that shard's **converter** unless another holder of the same (version, shard) is
converting it already; then it waits for that one (as a reader waits during the grace period)
and pulls from it once it is whole. So a layout is converted once per version and shard and
then replicated peer to peer. A converter gets one :class:`~tensorhub.core.messages.Convert`:
per source shard, a grant from a complete holder of it, chosen by the same policy as any grant
(partial holders are not eligible: a converter reads ranges anywhere in the shard), with the
source shard's checksums, token, layout and placements. Which byte ranges of which source shard
feed which destination tensor is the converter's plan, a pure function of the layouts and its
mapping (:func:`tensorhub.scheduling.reshard.plan`): the table does not know the mapping.
A converter starts only once every source shard's checksums are declared, so it verifies every
unit it reads.

A converting holder is partial and serves nobody. It reports
:class:`~tensorhub.core.messages.Converted` with the checksums of *its own* bytes; it is then
complete, its grants end, and the readers waiting for it are granted from it. Conversion is
deterministic (same plan, same arithmetic), so two converters of one (version, shard) declare
equal checksums; unequal ones are a :class:`~tensorhub.errors.VersionConflict`.

Failures. A source that fails the converter is excluded for it and that source shard alone is
granted again (a ``Convert`` naming only it); a source whose bytes fail the converter's checks
is handled as for any reader (its self-check, quarantine). A source shard with no holder left
fails the call as a reader's would. A converter that dies or aborts ends its grants; a reader
waiting for it becomes the converter.

Invariants: a converter's grants are in its ``converting`` (one per source shard at most), never
its ``upstream``; ``converting`` is None for every holder that is not converting; a converting
holder is never a source; a source holder counts a converter among its readers (load, drain).

What it must never do: make a second converter of a (version, shard) while one lives, or let
a converter start before the source's checksums are known.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from .. import messages as m
from ..errors import (
    ChecksumMismatch,
    ContractViolation,
    InvalidArgument,
    InvalidPlacement,
    StaleGrant,
    TensorHubError,
    VersionUnavailable,
    error_from_wire,
)
from ..lifecycle import Event
from ..naming import VersionSpec
from .records import _MAX_SOURCE_FAILURES, P, SourcePolicy, U, _Grant, _Holder, _Model, _named
from .state import TableState


class ConversionMixin(TableState):
    """Converted models: their versions, their converters, and the grants those read under. Mixed into
    :class:`~tensorhub.core.table.ReferenceTable`. State
    (:class:`~tensorhub.core.table.state.TableState`): ``rng``, ``term``, ``models``, ``_by_id``,
    ``stats``."""

    def _check_source(self, model: _Model | None, msg: m.OpenShard) -> None:
        """An ``OpenShard`` agrees with what its model is converted from (None: not converted)."""
        ctx: dict[str, Any] = {"model": msg.model, "replica": msg.replica, "shard": msg.shard_idx}
        if model is not None and model.source != msg.source:
            what = f"converted from {model.source!r}" if model.source is not None else "not a converted model"
            raise ContractViolation(f"model {msg.model!r} is {what}; this shard declares source={msg.source!r}", **ctx)
        if msg.source is None:
            return
        src = self.models.get(msg.source)
        if src is not None and src.source is not None:
            raise InvalidArgument(
                f"model {msg.source!r} is itself converted from {src.source!r}: convert from {src.source!r}", **ctx
            )
        for other in self.models.values():
            if other.source == msg.model:
                raise InvalidArgument(f"model {msg.model!r} is the source of {other.name!r}: it cannot be converted", **ctx)

    def _source_of(self, model: _Model) -> _Model | None:
        return self.models.get(model.source) if model.source is not None else None

    def _converted_models(self, model: _Model) -> list[_Model]:
        """The models converted from ``model`` (in the table's order: deterministic)."""
        return [x for x in self.models.values() if x.source == model.name]

    def _resolve_converted(self, model: _Model, spec: VersionSpec, ctx: dict[str, Any]) -> int | None:
        """:meth:`_resolve` for a converted model: its own versions and its source's."""
        src = self._source_of(model)
        newest = max([*model.available[-1:], *(src.available[-1:] if src is not None else ())], default=None)
        v = _named(spec, newest, ctx)
        if v is None:
            return None
        ver = model.versions.get(v)
        if ver is not None and ver.available:
            return v
        sver = src.versions.get(v) if src is not None else None
        if sver is not None and sver.available:
            self._holder_set(model, v, 0)  # the version's record, to hold its converters and readers
            return v
        ever = (ver is not None and ver.ever_available) or (sver is not None and sver.ever_available)
        if ever and not self.in_grace:
            raise VersionUnavailable(f"version {v} is gone: no live holder has every shard of it or of its source", **{**ctx, "version": v})
        return None

    def _convertible(self, h: _Holder) -> bool:
        """``h``'s (version, shard) can still be built: it is converting, or the source version
        is available (a converter can be started)."""
        if h.converting is not None:
            return True
        src = self._source_of(h.session.model)
        sver = src.versions.get(h.version) if src is not None else None
        return sver is not None and sver.available

    def _convert(self, reader: _Holder) -> None:
        """``reader`` (of a converted model) found no holder to pull from: make it the converter,
        grant the source shards it lacks, or park it (another converter lives, or the source's
        checksums are not all declared yet), or fail its call."""
        assert reader.call is not None
        txn, _ = reader.call
        model = reader.session.model
        ctx = reader.session.ctx(reader.version)
        holders = model.versions[reader.version].holders[reader.shard_idx]
        if reader.converting is None and any(h.converting is not None for h in holders.values() if h is not reader):
            self._park(reader)  # converted once: wait for the converter, then pull from it
            return
        src = self._source_of(model)
        sver = src.versions.get(reader.version) if src is not None else None
        if src is None or sver is None or not sver.available:
            if self.in_grace:
                self._park(reader)
                return
            self._fail_txn(txn, VersionUnavailable(
                f"version {reader.version} of {model.source!r}, which {model.name!r} is converted from, has no complete copy",
                **ctx,
            ))  # fmt: skip
            return
        unplaced = [i for i in range(src.num_shards) if src.placements.get(i) is None]
        if unplaced:
            self._fail_txn(txn, InvalidPlacement(
                f"model {src.name!r} shards {unplaced} registered no placements: a converter cannot plan from them", **ctx
            ))  # fmt: skip
            return
        if any(i not in sver.checksums for i in range(src.num_shards)):
            self._park(reader)  # woken when the source declares them (:meth:`_wake_converters`)
            return
        if reader.converting is None:
            reader.converting = {}
            self.stats["conversions"] += 1
        sources: list[m.ConvertSource] = []
        for i in range(src.num_shards):
            if i in reader.converting:
                continue
            pick = self._select_source(reader, sver.index[i])
            if pick is None:
                candidates = list(sver.holders[i].values())
                if any(h.verify_pending and reader.excluded.get(h.id) for h in candidates):
                    self._park(reader)  # a source it blamed is checking itself: wait for the verdict
                    break
                for g in list(reader.converting.values()):
                    self._end_grant(g, "cancelled")
                if any(reader.excluded.get(h.id) for h in candidates) or reader.blamed_bad:
                    err: TensorHubError = ChecksumMismatch(f"every holder of shard {i} of {src.name!r} failed this converter's verification", **ctx)
                else:
                    err = VersionUnavailable(f"no holder of shard {i} of {src.name!r} can serve version {reader.version} to this converter", **ctx)
                self._fail_txn(txn, err)
                return
            g, info, token = self._open_grant(reader, pick)
            reader.converting[i] = g
            layout, _ = src.layouts[i]
            placed = src.placements[i]
            assert placed is not None
            sources.append(m.ConvertSource(g.id, i, info, sver.checksums[i], token, layout, placed))
        else:
            self._unpark(reader)
        if sources:
            s = reader.session
            req = txn.shards[reader.shard_idx].req
            self._send(s, m.Convert(req, s.id, self.term, reader.version, reader.shard_idx, src.name, src.num_shards, tuple(sources)))

    def _select_source(self, reader: _Holder, index: SourcePolicy) -> _Holder | None:
        """A complete holder of a source shard for converter ``reader`` (the grant policy's pick)."""
        excluded = reader.excluded
        by_id = self._by_id
        for retry_failed in (False, True):
            if retry_failed and (not excluded or reader.failures > _MAX_SOURCE_FAILURES):
                break

            def eligible(key: int, retry_failed: bool = retry_failed) -> bool:
                if key in excluded and (excluded[key] or not retry_failed):
                    return False
                h = by_id[key]
                return h.state is not U and h.state is not P

            key = index.select(reader.session.location, self.rng, eligible, None)
            if key is not None:
                return by_id[key]
        return None

    def _park(self, reader: _Holder) -> None:
        reader.waiting = True
        reader.session.model.waiting_readers[reader] = None

    def _unpark(self, reader: _Holder) -> None:
        reader.waiting = False
        reader.session.model.waiting_readers.pop(reader, None)

    def _waiting_of(self, model: _Model) -> list[_Holder]:
        """The parked readers of ``model`` and of the models converted from it (converters wait
        on this model's holders too)."""
        return [*model.waiting_readers, *(r for x in self._converted_models(model) for r in x.waiting_readers)]

    def _wake_converters(self, model: _Model) -> None:
        """Something changed about ``model``'s versions (checksums declared, availability):
        the parked readers of the models converted from it look again."""
        for x in self._converted_models(model):
            self._regrant_waiting(x)

    def _on_converted(self, peer: Hashable, msg: m.Converted) -> None:
        s = self._session(peer, msg.session)
        if msg.term != self.term:
            raise StaleGrant(f"conversion from server term {msg.term}; this server's term is {self.term}", **s.ctx(msg.version))
        h = s.holder
        if h is None or h.version != msg.version or h.state is not P or h.converting is None:
            raise ContractViolation("converted: this shard is not converting that version", **s.ctx(msg.version))
        self._check_checksums(s, msg.version, msg.checksums)
        read = msg.read_bytes
        layout = s.layout
        share = (layout.total_bytes if layout is not None else 0) // max(1, len(h.converting))
        for i, g in list(h.converting.items()):  # each edge with the bytes its source gave (if not said: a share)
            self._end_grant(g, "completed", read[i] if read is not None and i < len(read) else share)
        h.converting = None
        self._fire(h, Event.COMPLETE)
        h.verified = s.total_bytes
        self._set_checksums(h, msg.checksums)
        self._published(s.model, msg.version)
        self._ack(s, msg.req)
        self._regrant_waiting(s.model)  # the readers that waited for this converter pull from it
        self._holding_done(h)

    def _on_convert_failed(self, peer: Hashable, msg: m.ConvertFailed) -> None:
        s = self._session(peer, msg.session)
        if msg.term != self.term:
            raise StaleGrant(f"conversion from server term {msg.term}; this server's term is {self.term}", **s.ctx(msg.version))
        h = s.holder
        if h is None or h.version != msg.version or h.converting is None:
            raise ContractViolation("convert_failed: this shard is not converting that version", **s.ctx(msg.version))
        self._ack(s, msg.req)
        call = h.call
        self._end_conversion(h)
        if call is not None:
            txn, _ = call
            self._fail_txn(txn, error_from_wire(msg.code, f"converting: {msg.message}", **s.ctx(msg.version)))

    def _end_conversion(self, h: _Holder) -> None:
        """End a converter's grants (it stopped: removed, aborted, sources gone)."""
        if h.converting is None:
            return
        for g in list(h.converting.values()):
            self._end_grant(g, "cancelled")
        h.converting = None
        model = h.session.model  # whoever waited for this converter looks again
        model.dirty_shards[(h.version, h.shard_idx)] = None
        self._mark_dirty(model)

    def _grant_ended(self, g: _Grant) -> bool:
        """Forget ``g`` in its reader's conversion grants; True if it was one."""
        conv = g.reader.converting
        if conv is not None and conv.get(g.source.shard_idx) is g:
            del conv[g.source.shard_idx]
            return True
        return False
