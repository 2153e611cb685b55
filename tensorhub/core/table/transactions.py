"""Transactions: the model-parallel calls, one per (replica, call number).

Theory of operation
-------------------
What it owns: joining a shard to call ``n`` of its replica (the first shard opens it, the others
must make the same call), answering each shard, failing every shard alike, call deadlines; and
the two calls that are only a shared decision: the consistent ``list`` (every shard gets the
listing the first one got) and the ``wait`` long-poll (each shard is offered listings and
reports which one satisfied it; the first report decides for all).

Invariants: every shard of a call gets the same answer or the same error; a shard gets one
final answer per call (``consumed``), and the transaction is dropped once every shard has one or
its replica is gone. A call that diverges from the recorded one is refused with
``ContractViolation`` and changes nothing. A replicate or update that fails after it started
moving leaves each shard empty (update says ``UpdateAborted``; ``VersionLost`` where the version
itself lost its last complete holder).

What it must never do: answer a shard twice, or decide differently for different shards.
"""

from __future__ import annotations

from typing import Any, Hashable

from .. import messages as m
from ..errors import (
    ContractViolation,
    InBucket,
    InvalidArgument,
    TensorHubError,
    Timeout,
    UpdateAborted,
    VersionLost,
    VersionUnavailable,
)
from .records import _OFFERS_KEPT, _all_done, _AnnouncedArgs, _Model, _Session, _ShardCall, _Txn
from .state import TableState


class TransactionMixin(TableState):
    """Model-parallel calls, and list and wait. Mixed into
    :class:`~tensorhub.core.table.ReferenceTable`. State
    (:class:`~tensorhub.core.table.state.TableState`): ``clock``."""

    def _join(self, s: _Session, req: int, n: int, kind: str, args: Any) -> tuple[_Txn, _ShardCall]:
        """Join call ``n`` of the session's replica (opening it if first).

        Raises:
            ContractViolation: the call diverges from the one recorded for ``n``, or this shard
                already made it (nothing changes).
        """
        if n < 1:
            raise InvalidArgument(f"call numbers start at 1, got {n}", **s.ctx())
        replica = s.replica
        txn = replica.txns.get(n)
        if txn is None:
            txn = replica.txns[n] = _Txn(n, kind, args, replica)
        elif txn.kind != kind or txn.args != args:
            raise ContractViolation(
                f"call {n} is {_describe(txn.kind, txn.args)} on another shard; this shard calls {_describe(kind, args)}",
                **s.ctx(),
            )
        if s.shard_idx in txn.consumed:
            raise ContractViolation(f"call {n} was already answered for this shard", **s.ctx())
        prev = txn.shards.get(s.shard_idx)
        if prev is not None and not prev.done and kind != "wait":
            raise ContractViolation(f"call {n} is already in flight for this shard", **s.ctx())
        call = txn.shards[s.shard_idx] = _ShardCall(s, req)
        return txn, call

    def _finish_call(self, txn: _Txn, call: _ShardCall, reply: Any) -> None:
        """Send a shard its final answer for ``txn``; drop the txn once every shard has one."""
        if call.done:
            return
        call.done = True
        self._send(call.session, reply)
        txn.consumed[call.session.shard_idx] = None
        if len(txn.consumed) >= txn.replica.num_shards:
            self._drop_txn(txn)

    def _drop_txn(self, txn: _Txn) -> None:
        self._unpin(txn)
        if txn.replica.txns.get(txn.n) is txn:
            del txn.replica.txns[txn.n]
        for call in txn.shards.values():
            h = call.session.holder
            if h is not None and h.call is not None and h.call[0] is txn:
                h.call = None

    def _fail_txn(self, txn: _Txn, err: TensorHubError) -> None:
        """Every shard of the call gets the same error. A replicate/update that had started
        moving leaves each shard empty: partial or new holdings are aborted first."""
        if txn.error is not None:
            return
        if txn.kind == "update" and txn.moved and not isinstance(err, (UpdateAborted, InBucket)):
            # The version itself is gone (its last complete holder died mid-pull): a typed
            # abort, which an update to "latest" answers by asking again (handles.pulls).
            lost = VersionLost if isinstance(err, VersionUnavailable) else UpdateAborted
            err = lost(f"update to version {txn.version} aborted: {err.message}", **err.context())
        txn.error = err
        txn.decided = True
        self._unpin(txn)
        if txn.kind == "wait":
            model = txn.replica.model
            model.waits = [w for w in model.waits if w[0] is not txn]
        for call in list(txn.shards.values()):
            self._error_shard(txn, call)

    def _error_shard(self, txn: _Txn, call: _ShardCall) -> None:
        assert txn.error is not None
        if call.done:
            return
        reply = m.Failed.of(call.req, txn.error)
        h = call.session.holder
        if not txn.moved or h is None or txn.kind not in ("replicate", "update"):
            self._finish_call(txn, call, reply)
        else:  # the shard ends empty, and nobody reads its buffers when the call returns
            self._unpublish(h, lambda: self._finish_call(txn, call, reply))

    def _txn_expired(self, txn: _Txn, now: float) -> None:
        if txn.replica.txns.get(txn.n) is not txn or txn.deadline is None or txn.deadline > now:
            return
        if txn.error is not None:
            return
        if txn.kind == "wait":
            if txn.decided:
                return
        elif txn.kind in ("replicate", "update"):
            if (txn.decided and not txn.moved) or _all_done(txn):
                return
        else:
            return
        what = f"version {txn.version}" if txn.version is not None else _describe(txn.kind, txn.args)
        err = Timeout(f"timed out waiting for {what}", model=txn.replica.model.name, replica=txn.replica.name)
        self._fail_txn(txn, err)

    def _set_deadline(self, txn: _Txn, timeout: float | None) -> None:
        if timeout is not None and txn.deadline is None:
            txn.deadline = self.clock() + timeout
            self._timer(txn.deadline, "txn", txn)

    def _on_list(self, peer: Hashable, msg: m.ListVersions) -> None:
        s = self._session(peer, msg.session)
        model = s.model
        if msg.call is None:
            self._send(s, m.Listing(msg.req, model.epoch, True, self._listing(model)))
            return
        txn, call = self._join(s, msg.req, msg.call, "list", None)
        if not txn.decided:
            txn.answer = (model.epoch, self._listing(model))
            txn.decided = True
        epoch, snap = txn.answer
        self._finish_call(txn, call, m.Listing(msg.req, epoch, True, snap))

    def _on_wait(self, peer: Hashable, msg: m.Wait) -> None:
        s = self._session(peer, msg.session)
        model = s.model
        known = s.replica.txns.get(msg.call)
        if msg.satisfied_epoch is not None and not (
            known is not None and (known.decided or msg.satisfied_epoch in known.offered)
        ):
            raise ContractViolation(f"epoch {msg.satisfied_epoch} was never offered to call {msg.call}", **s.ctx())
        txn, call = self._join(s, msg.req, msg.call, "wait", None)
        self._set_deadline(txn, msg.timeout)
        if txn.error is not None:
            self._error_shard(txn, call)
            return
        if not txn.decided and msg.satisfied_epoch is not None:
            snap = txn.offered[msg.satisfied_epoch]
            txn.answer = (msg.satisfied_epoch, snap)
            txn.decided = True
            txn.offered.clear()
            parked = [w for w in model.waits if w[0] is txn]
            model.waits = [w for w in model.waits if w[0] is not txn]
            for _, other, _ in parked:
                self._finish_call(txn, other, m.Listing(other.req, msg.satisfied_epoch, True, snap))
        if txn.decided:
            epoch, snap = txn.answer
            self._finish_call(txn, call, m.Listing(msg.req, epoch, True, snap))
            return
        self._listing(model)
        if model.epoch > msg.known_epoch or msg.known_epoch < 0:
            self._offer(txn, call, model)
        else:
            model.waits.append((txn, call, msg.known_epoch))

    def _offer(self, txn: _Txn, call: _ShardCall, model: _Model) -> None:
        snap = self._listing(model)
        txn.offered[model.epoch] = snap
        while len(txn.offered) > _OFFERS_KEPT:  # a shard answers about the latest few offers
            del txn.offered[next(iter(txn.offered))]
        call.done = True  # this request is answered; the shard polls again with a new one
        self._send(call.session, m.Listing(call.req, model.epoch, False, snap))


def _describe(kind: str, args: Any) -> str:
    return f"{kind}({args})" if args is not None and not isinstance(args, _AnnouncedArgs) else kind
