"""Simulated reference server and clients: the production protocol, in virtual time.

Theory of operation
-------------------
:class:`SimServer` wraps the production :class:`~tensorhub.core.table.ReferenceTable` exactly as
the real server actor does: a message arrives (after the control plane's one-way latency), waits
for the server's CPU (one message at a time, ``server_service`` seconds each), goes through
``table.handle``; what the table returns is delivered to the clients after the same latency;
``table.tick()`` runs at ``table.next_deadline()``. There is no second implementation of any
server decision: source selection, pipelining, retention, consistency, failure handling,
smart skipping and offload seeding are the table's and ``scheduling``'s own code.

:class:`SimShard` is one shard handle (one GPU, or a CPU copy): it speaks the client protocol
(the same :mod:`tensorhub.core.messages`), heartbeats, and pulls with the production shard core
(:class:`~tensorhub.core.shard.ShardCore`, which the real engine drives too: grant handling,
the replication session, draining aborted pulls, call numbering and the offload-seed rule are
its code, not the simulator's). The simulator only carries out the core's actions with
simulated IO. Its reads are flows in the
:class:`~tensorhub.sim.network.Network`: a read from a source that does not hold the range yet (a partial
source, pipeline replication) waits for the source's progress counter, as the real holder does.
A shard pulls in reads of ``1/reads_per_shard`` of the shard, one at a time (the flow runs at the
link's full rate, so more reads in flight would change nothing but the event count).

:class:`SimReplica` groups the shards of a replica and offers the calls of the public API
(``open``, ``publish``, ``unpublish``, ``update``, ``replicate``, ``close``) with a callback
for the replica's answer, and ``crash()``: a process killed, silent at once.

What the simulation checks as it runs (:attr:`SimServer.violations`): the table's invariants
(:func:`tensorhub.core.invariants.check_invariants`, every ``check_every`` events, or after every
event), and the mutability contract from the data plane's side: no shard's buffers change
version while a reader still reads them.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensorhub.core import messages as m
from tensorhub.core.invariants import check_invariants
from tensorhub.core.layout import Layout, TensorSpec
from tensorhub.core.naming import seed_replica
from tensorhub.core.session import ReplicationSession
from tensorhub.core.shard import (
    Advance,
    DropPull,
    IssueRead,
    ReportChecksumFailed,
    ReportComplete,
    ReportProgress,
    ReportSourceFailed,
    RetireSeed,
    ShardCore,
    StartPull,
    StartSeed,
    UseGrant,
    report_message,
    seed_step,
)
from tensorhub.core.table import ReferenceTable, TableConfig
from tensorhub.scheduling.selection import SourceIndex

from .cluster import Cluster, Device
from .core import Simulator, Timer
from .network import Flow

__all__ = ["CallRecord", "SimReplica", "SimServer", "SimShard", "shard_layout"]


def shard_layout(nbytes: int, reads_per_shard: int = 128) -> Layout:
    """A shard of ``nbytes`` as one tensor whose checksum units are the simulator's reads."""
    chunk = max(1, math.ceil(nbytes / reads_per_shard))
    return Layout(
        (TensorSpec("weights", "uint8", (nbytes,), nbytes),), "xxh3-64", chunk, 1
    )


@dataclass
class CallRecord:
    """One call of one replica: when it was made, when every shard had its answer, the answer."""

    replica: str
    kind: str
    start: float
    end: float | None = None
    moved: bool | None = None
    version: int | None = None
    skipped: int | None = None
    error: str | None = None
    shards: int = 1

    @property
    def stall(self) -> float:
        return (self.end if self.end is not None else math.nan) - self.start


class SimServer:
    """The production reference table behind a simulated control plane.

    Args:
        sim: the clock and event queue.
        cluster: the hardware (for its control-plane timings).
        config: the table's configuration.
        check_every: check the table's invariants every this many events (0: never; 1: after
            every event of the simulation, not only the server's).
    """

    def __init__(
        self,
        sim: Simulator,
        cluster: Cluster,
        config: TableConfig | None = None,
        check_every: int = 1000,
    ) -> None:
        self.sim = sim
        self.cluster = cluster
        self.params = cluster.params
        self.table = ReferenceTable(
            lambda: sim.now, sim.child_rng(), config or TableConfig(), term=1, sources=SourceIndex
        )
        self.shards: dict[str, SimShard] = {}  # peer -> shard
        self.by_session: dict[int, SimShard] = {}
        self.incarnations = itertools.count(1)  # per server, so that a run's names do not depend on earlier runs
        self.busy_until = 0.0
        self.messages = 0
        self._tick: Timer | None = None
        self.violations: list[str] = []
        self.checks = 0
        self.check_every = check_every
        if check_every == 1:
            sim.after_event.append(self.check)
        elif check_every > 1:
            self._countdown = check_every
            sim.after_event.append(self._maybe_check)

    # ---- invariants ------------------------------------------------------------------------

    def check(self) -> None:
        self.checks += 1
        for v in check_invariants(self.table):
            self.violation(f"table: {v}")

    def _maybe_check(self) -> None:
        self._countdown -= 1
        if self._countdown <= 0:
            self._countdown = self.check_every
            self.check()

    def violation(self, what: str) -> None:
        if len(self.violations) < 100:
            self.violations.append(f"t={self.sim.now:.6f}: {what}")
            self.sim.record("violation", what)

    # ---- the control plane -----------------------------------------------------------------

    def send(self, shard: SimShard, msg: Any) -> None:
        """``shard`` sends ``msg``; it reaches the table after the latency and the queue."""
        arrive = self.sim.now + self.params.control_latency
        start = max(arrive, self.busy_until)
        self.busy_until = start + self.params.server_service
        self.sim.at(self.busy_until, self._handle, shard.peer, msg)

    def _handle(self, peer: str, msg: Any) -> None:
        self.messages += 1
        self._deliver(self.table.handle(peer, msg))

    def _deliver(self, out: list) -> None:
        for peer, msg in out:
            shard = self.shards.get(peer)
            if shard is not None:
                self.sim.after(self.params.control_latency, shard.receive, msg)
        self._arm()

    def _arm(self) -> None:
        when = self.table.next_deadline()
        if when is None:
            return
        if (
            self._tick is not None
            and not self._tick.cancelled
            and self._tick.time <= when
        ):
            return
        if self._tick is not None:
            self._tick.cancel()
        self._tick = self.sim.at(when, self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        self._deliver(self.table.tick())


class SimShard:
    """One shard handle of one replica (see the module docstring)."""

    def __init__(self, replica: SimReplica, shard_idx: int, device: Device) -> None:
        self.replica = replica
        self.server = replica.server
        self.sim = replica.sim
        self.shard_idx = shard_idx
        self.device = device
        self.peer = f"{replica.model}/{replica.name}/{shard_idx}/{replica.incarnation}"
        self.server.shards[self.peer] = self
        self.session: int | None = None
        self.alive = True
        self.removed: str | None = None
        self._reqs = replica.reqs
        self.waiting: dict[int, Callable[[Any], None]] = {}
        # what the shard decides: the production core, fed the simulated IO's events
        self.core = ShardCore(self._new_pull)
        # the simulated progress counter: the complete version the live buffers hold
        self.holding: int | None = None
        self.offloads: set[int] = set()
        # reads of this shard's memory: flow -> (reader, how its read fails)
        self.serving: dict[Flow, tuple[SimShard, Callable[[str], None]]] = {}
        # reads waiting for this shard's progress: (version, end, start_read, reader, pull, fail)
        self.waiters: list[tuple[int, int, Callable[[], None], SimShard, int, Callable[[str], None]]] = []
        self.reading: dict[Flow, SimShard] = {}  # flow -> its source
        self.timers: list[Timer] = []

    def _new_pull(self, version: int) -> ReplicationSession:
        layout = self.replica.layout
        return ReplicationSession(version, layout.total_bytes, layout.chunk_bytes, max_inflight=1)

    @property
    def sid(self) -> int:
        """The session id the server gave this shard; 0 before it opened (never an id the
        table gives, so a call made then gets ``UnknownSession``, as the real client would)."""
        return self.session if self.session is not None else 0

    @property
    def grant(self) -> m.Grant | None:
        """The grant the shard was given last."""
        return self.core.grant

    # ---- sending -----------------------------------------------------------------------------

    def request(
        self, build: Callable[[int], Any], then: Callable[[Any], None] | None = None
    ) -> None:
        req = next(self._reqs)
        if then is not None:
            self.waiting[req] = then
        self.server.send(self, build(req))

    def receive(self, msg: Any) -> None:
        if not self.alive:
            return
        req = getattr(msg, "req", None)
        if req is not None and req in self.waiting and not isinstance(msg, m.Grant):
            self.waiting.pop(req)(msg)
            return
        handler = getattr(self, f"on_{type(msg).__name__}", None)
        if handler is not None:
            handler(msg)

    # ---- what the server tells a shard -------------------------------------------------------

    def on_Grant(self, g: m.Grant) -> None:
        self._do(self.core.on_grant(g))

    def on_Revoke(self, msg: m.Revoke) -> None:
        self._do(self.core.on_revoke(msg.term, msg.grant))

    def on_OffloadRequest(self, msg: m.OffloadRequest) -> None:
        copy_s = self.replica.layout.total_bytes / (
            self.cluster.params.pcie_gbps / 8 * 1e9
        )

        def done() -> None:
            if self.alive and self.session == msg.session:
                self.offloads.add(msg.version)
                self.request(
                    lambda req: m.PublishOffload(req, self.sid, msg.version, True)
                )

        self.timers.append(self.sim.after(copy_s, done))

    def on_FreeOffload(self, msg: m.FreeOffload) -> None:
        if self._has_readers(msg.version, offload=True):
            self.server.violation(
                f"{self.peer} is told to free its offload copy of v{msg.version} while it is read"
            )
        self.offloads.discard(msg.version)

    def on_VerifyRequest(self, msg: m.VerifyRequest) -> None:
        self.request(lambda req: m.VerifyResult(req, self.sid, msg.version, True))

    def on_Removed(self, msg: m.Removed) -> None:
        self.removed = msg.code
        self.sim.record("removed", f"{self.peer} {msg.code}")

    # ---- carrying out the core's actions (simulated IO) --------------------------------------

    @property
    def cluster(self) -> Cluster:
        return self.replica.cluster

    def _do(self, actions: list) -> None:
        for a in actions:
            if not self.alive:
                return
            if isinstance(a, IssueRead):
                self._read(a)
            elif isinstance(a, Advance):
                assert self.core.pull is not None
                self._advanced(self.core.pull.version, a.verified)
            elif isinstance(a, StartPull):
                if self.holding is not None and self._has_readers(self.holding):
                    self.server.violation(
                        f"{self.peer} is granted v{a.version} while readers still read its v{self.holding}"
                    )
                self.holding = None
            elif isinstance(a, UseGrant):
                g = a.grant
                self.sim.record(
                    "grant",
                    f"{self.peer} v{g.version} from {g.source.replica}/{g.source.shard_idx} {g.source.kind}",
                )
            elif isinstance(a, DropPull):
                self._abandon_waiting(a.pull)
            elif isinstance(a, ReportProgress):
                self.server.send(self, report_message(a, self.sid, 0))
            elif isinstance(a, ReportComplete):
                assert self.core.pull is not None
                self.holding = self.core.pull.version
                self.sim.record("complete", f"{self.peer} v{self.holding}")
                self.request(lambda req: report_message(a, self.sid, req), self._ignore)
            elif isinstance(a, ReportSourceFailed):
                self.sim.record(
                    "source_failed", f"{self.peer} grant {a.grant[1]}: {a.reason}"
                )
                self.request(lambda req: report_message(a, self.sid, req), self._ignore)
            elif isinstance(
                a, ReportChecksumFailed
            ):  # pragma: no cover - the simulator does not verify
                self.server.violation(
                    f"{self.peer}: a checksum failure with verification off: {a}"
                )

    def _ignore(self, reply: Any) -> None:
        if isinstance(reply, m.Failed) and reply.code not in (
            "fenced",
            "replica_removed",
            "unknown_grant",
            "stale_grant",
        ):
            self.server.violation(
                f"{self.peer}: a data-plane report was refused: {reply.code}: {reply.message}"
            )

    def _read(self, a: IssueRead) -> None:
        g, version = self.grant, a.version
        assert g is not None
        src = self.server.by_session.get(g.source.session)
        offload = g.source.kind == m.KIND_OFFLOAD
        end = a.offset + a.length
        core = self.core

        def fail(reason: str) -> None:
            if self.alive:
                self._do(core.on_read_failed(a.pull, a.grant, a.offset, reason))

        def time_out(reason: str) -> None:
            # a silent peer: the transport gives up after its timeout
            self.timers.append(self.sim.after(self.cluster.params.transfer_timeout, fail, reason))

        if src is None or not src.alive:
            time_out("transfer timeout: the source is silent")
            return

        def start() -> None:
            if not self.alive:
                return
            if not core.is_current(a.pull):
                fail("the pull was aborted before the read started")
                return
            if not src.alive:
                time_out("transfer timeout")
                return
            src_dev = self.cluster.cpu(src.device.host) if offload else src.device
            links, cap, latency = self.cluster.path(src_dev, self.device)
            flow: Flow | None = None  # the transfer, once begun

            def landed() -> None:
                if flow is not None:  # always: begin started the transfer that calls this
                    src.serving.pop(flow, None)
                    self.reading.pop(flow, None)
                if self.alive:
                    self._do(core.on_read_done(a.pull, a.grant, a.offset))

            def begin() -> None:
                nonlocal flow
                if not self.alive:
                    return
                if not core.is_current(a.pull):
                    fail("the pull was aborted before the read started")
                    return
                if not src.alive:
                    time_out("transfer timeout")
                    return
                flow = self.cluster.net.start(
                    links,
                    a.length,
                    landed,
                    cap,
                    tag=(a.grant[1], version, a.offset, offload),
                )
                src.serving[flow] = (self, fail)
                self.reading[flow] = src

            self.timers.append(self.sim.after(latency, begin))

        if offload or src.available(version) >= end:
            start()
        else:
            src.waiters.append((version, end, start, self, a.pull, fail))

    def _abandon_waiting(self, pull: int) -> None:
        """An aborted pull's reads that wait for a partial source's progress never start: they
        fail (after this event, so that the core sees them once its grant is handled)."""
        for src in self.server.by_session.values():
            mine = [w for w in src.waiters if w[3] is self and w[4] == pull]
            if mine:
                src.waiters = [w for w in src.waiters if not (w[3] is self and w[4] == pull)]
                for w in mine:
                    self.timers.append(self.sim.after(0.0, w[5], "the pull was aborted before the read started"))

    def available(self, version: int) -> int:
        """Bytes of ``version`` this shard's live buffers hold (its progress counter)."""
        if self.holding == version:
            return self.replica.layout.total_bytes
        pull = self.core.pull
        if pull is not None and pull.version == version:
            return pull.verified
        return 0

    def _advanced(self, version: int, verified: int) -> None:
        if not self.waiters:
            return
        ready = [w for w in self.waiters if w[0] == version and w[1] <= verified]
        if ready:
            self.waiters = [
                w for w in self.waiters if not (w[0] == version and w[1] <= verified)
            ]
            for w in ready:
                w[2]()

    def _has_readers(self, version: int, offload: bool = False) -> bool:
        """A read of this version is in flight under a grant the table still counts as active
        (a read of a revoked grant may still run: its bytes are discarded, DESIGN §5.2)."""
        grants = self.server.table.grants
        return any(
            f.tag[1] == version and f.tag[3] == offload and f.tag[0] in grants
            for f in self.serving
        )

    # ---- dying -------------------------------------------------------------------------------

    def crash(self) -> None:
        """The process is gone: no heartbeat, no answer; its readers' reads time out."""
        if not self.alive:
            return
        self.alive = False
        self.sim.record("crash", self.peer)
        for t in self.timers:
            t.cancel()
        self.timers.clear()
        net = self.cluster.net
        for f, src in list(self.reading.items()):
            net.cancel(f)
            src.serving.pop(f, None)
        self.reading.clear()
        timeout = self.cluster.params.transfer_timeout
        for f, (reader, fail) in list(self.serving.items()):
            net.cancel(f)
            reader.reading.pop(f, None)
            reader.timers.append(
                self.sim.after(
                    timeout, fail, "transfer timeout: the source went silent"
                )
            )
        self.serving.clear()
        for _, _, start, reader, _, _ in self.waiters:
            reader.timers.append(
                self.sim.after(timeout, start)
            )  # start() sees the source dead and fails the read
        self.waiters.clear()
        self.core.on_abort()


class SimReplica:
    """The shards of one replica, and the public API's calls on them (see the module docstring).

    Args:
        server: the simulated server.
        cluster: the hardware.
        model: the model's name.
        name: the replica's name.
        devices: one per shard (its GPU, or a host's CPU for an offload seed).
        layout: every shard's layout (the simulator's shards are equal in size).
        spot: a spot replica (serves, never counts for retention).
        retain: the retention declaration (``open(retain=...)``), as the wire carries it.
        offload_seeding: ``open(offload_seeding=True)``.
    """

    def __init__(
        self,
        server: SimServer,
        model: str,
        name: str,
        devices: list[Device],
        layout: Layout,
        spot: bool = False,
        retain: int | None = None,
        offload_seeding: bool = False,
    ) -> None:
        self.server = server
        self.sim = server.sim
        self.cluster = server.cluster
        self.model = model
        self.name = name
        self.layout = layout
        self.spot = spot
        self.retain = retain
        self.offload_seeding = offload_seeding
        self.incarnation = f"i{next(server.incarnations)}"
        self.reqs = itertools.count(1)
        self.shards = [SimShard(self, i, d) for i, d in enumerate(devices)]
        self.records: list[CallRecord] = []
        self.opened = False
        self.version: int | None = (
            None  # what its buffers hold, as the last answer said
        )
        self.seed: SimReplica | None = None
        self.seed_version: int | None = None
        self.heartbeat: Timer | None = None

    @property
    def alive(self) -> bool:
        return all(s.alive for s in self.shards)

    def _all(
        self,
        kind: str,
        build: Callable[[SimShard, int, int], Any],
        then: Callable[[CallRecord, list], None] | None,
    ) -> CallRecord:
        """A numbered call on every shard; ``then(record, replies)`` once every shard has its answer."""
        rec = CallRecord(self.name, kind, self.sim.now, shards=len(self.shards))
        self.records.append(rec)
        replies: list[Any] = [None] * len(self.shards)
        left = [len(self.shards)]

        def got(i: int, reply: Any) -> None:
            replies[i] = reply
            left[0] -= 1
            if left[0] == 0:
                rec.end = self.sim.now
                errors = [r for r in replies if isinstance(r, m.Failed)]
                if errors:
                    rec.error = errors[0].code
                self.sim.record("answer", f"{self.name} {kind} {rec.error or ''}")
                if then is not None:
                    then(rec, replies)

        for s in self.shards:
            call = s.core.next_call()
            s.request(
                lambda req: build(s, req, call),  # built at once (see request)
                functools.partial(got, s.shard_idx),
            )
        return rec

    # ---- the API -------------------------------------------------------------------------------

    def open(self, then: Callable[[], object] | None = None) -> None:
        """``tensorhub.open(...)`` then ``register(tensors)`` on every shard."""
        left = [len(self.shards)]
        loc_of = {s.shard_idx: s.device.location for s in self.shards}

        def registered(s: SimShard, reply: Any) -> None:
            if isinstance(reply, m.Failed):
                self.server.violation(
                    f"{s.peer}: register refused: {reply.code}: {reply.message}"
                )
                return
            left[0] -= 1
            if left[0] == 0:
                self.opened = True
                self._heartbeat()
                if then is not None:
                    then()

        def opened(s: SimShard, reply: Any) -> None:
            if isinstance(reply, m.Failed):
                self.server.violation(
                    f"{s.peer}: open refused: {reply.code}: {reply.message}"
                )
                return
            s.session = reply.session
            self.server.by_session[reply.session] = s
            s.request(
                lambda req: m.Register(
                    req, s.sid, self.layout, {"sim": s.peer, "region": 0}
                ),
                lambda r: registered(s, r),
            )

        for s in self.shards:
            s.request(
                lambda req: m.OpenShard(
                    req, self.model, self.name, len(self.shards), s.shard_idx, self.incarnation, loc_of[s.shard_idx],
                    self.spot, self.retain,
                ),
                functools.partial(opened, s),
            )  # fmt: skip

    def _heartbeat(self) -> None:
        if not self.alive:
            return
        for s in self.shards:
            if s.session is not None:
                s.request(lambda req: m.Heartbeat(req, (s.sid,)), _noop)
        self.heartbeat = self.sim.after(
            self.server.table.config.heartbeat_interval, self._heartbeat
        )

    def publish(
        self, version: int, then: Callable[[CallRecord, list], None] | None = None
    ) -> CallRecord:
        """Every shard's buffers now hold ``version``; publish references to them."""
        count = self.layout.checksum_count()
        for s in self.shards:
            s.holding = version
        self.version = version
        return self._all(
            "publish",
            lambda s, req, call: m.Publish(req, s.sid, call, version, (0,) * count),
            then,
        )

    def unpublish(
        self, then: Callable[[CallRecord, list], None] | None = None
    ) -> CallRecord:
        def done(rec: CallRecord, replies: list) -> None:
            if rec.error is None:
                for s in self.shards:
                    s.holding = None
            if then is not None:
                then(rec, replies)

        return self._all(
            "unpublish", lambda s, req, call: m.Unpublish(req, s.sid, call), done
        )

    def update(
        self,
        spec: int | str = "latest",
        then: Callable[[CallRecord, list], None] | None = None,
        timeout: float | None = None,
    ) -> CallRecord:
        """``update(spec)``: the record's ``moved``, ``version`` and ``skipped`` are the answer."""

        def done(rec: CallRecord, replies: list) -> None:
            first = replies[0]
            if isinstance(first, m.Updated):
                rec.moved, rec.version, rec.skipped = (
                    first.moved,
                    first.version,
                    first.skipped,
                )
                if first.moved:
                    self.version = first.version
                seeding = self.seed_version if self.seed is not None else None
                step = seed_step(seeding, self.version, first.seed)
                if isinstance(step, StartSeed):
                    self._start_seed(step.version)
                elif isinstance(step, RetireSeed):
                    self._retire_seed()
            if then is not None:
                then(rec, replies)

        offload = self.offload_seeding
        return self._all(
            "update",
            lambda s, req, call: m.Update(req, s.sid, call, spec, timeout, offload),
            done,
        )

    def replicate(
        self,
        spec: int | str,
        then: Callable[[CallRecord, list], None] | None = None,
        timeout: float | None = None,
    ) -> CallRecord:
        def done(rec: CallRecord, replies: list) -> None:
            first = replies[0]
            if isinstance(first, m.Replicated):
                rec.moved, rec.version = True, first.version
                self.version = first.version
            if then is not None:
                then(rec, replies)

        return self._all(
            "replicate",
            lambda s, req, call: m.Replicate(req, s.sid, call, spec, timeout),
            done,
        )

    def close(self, then: Callable[[], None] | None = None) -> None:
        left = [len(self.shards)]

        def closed(_: Any) -> None:
            left[0] -= 1
            if left[0] == 0:
                self._stop()
                if then is not None:
                    then()

        if self.seed is not None:
            self._retire_seed()
        for s in self.shards:
            s.request(lambda req: m.CloseShard(req, s.sid), closed)

    def _stop(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.cancel()
            self.heartbeat = None
        for s in self.shards:
            s.alive = False
            self.server.shards.pop(s.peer, None)

    def crash(self) -> None:
        """SIGKILL: every shard's process is gone at once (and the replica's offload seed)."""
        if self.heartbeat is not None:
            self.heartbeat.cancel()
            self.heartbeat = None
        for s in self.shards:
            s.crash()
        if self.seed is not None:
            self.seed.crash()

    # ---- offload seeding (the rule is :func:`tensorhub.core.shard.seed_step`) -------------------

    def _start_seed(self, version: int) -> None:
        if self.seed is not None:
            self._retire_seed()
        devices = [self.cluster.cpu(s.device.host) for s in self.shards]
        seed = SimReplica(
            self.server,
            self.model,
            seed_replica(self.name),
            devices,
            self.layout,
            spot=True,
        )
        self.seed, self.seed_version = seed, version
        self.sim.record("seed", f"{seed.name} v{version}")
        seed.open(
            lambda: seed.replicate(version) if self.seed is seed else seed.close()
        )

    def _retire_seed(self) -> None:
        seed, self.seed, self.seed_version = self.seed, None, None
        if seed is None or not seed.alive or not seed.opened:
            return  # one still opening closes itself when it is opened
        seed.unpublish(lambda rec, replies: seed.close())


def _noop(_: Any) -> None:
    pass
