"""A hypothesis state machine driving the reference table with many simulated clients.

Replicas of 2 shards (trainers that publish, rollouts that replicate and update, some spot)
follow per-replica call scripts, one shard at a time so that shards interleave; transfers
complete, fail and report checksum mismatches; clients crash, close, reopen as new
incarnations; time passes; the server fails over to a new term and clients re-announce. After
every step the table's invariants are checked, and so are the promises clients rely on:

- no grant from an unpublishing, excluded, quarantined or removed holder, and no grant cycle;
- every grant ends exactly once (the table refuses a second end);
- an unpublish is answered only when no reader is left on the holding;
- a retained version stays available unless its last holder died;
- all shards of a replica get identical answers per call number;
- once every client has closed, the table holds nothing.

A second machine (:class:`SplitBrainMachine`) drives a primary and a backup table, each with its
:class:`~tensorhub.core.table.failover.Reign`, through partitions (one-way and two-way cuts of
client and peer links), server crashes and restarts and client crashes, and checks at every
quarter second that at most one of them may reign and that neither grants while not reigning;
:func:`test_split_brain_walks` runs long seeded walks of it.

Profiles: ``ci`` (default) and ``long`` (>= 10,000 steps): TENSORHUB_HYPOTHESIS_PROFILE=long.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tensorhub.core import messages as m
from tensorhub.core.invariants import check_invariants
from tensorhub.core.lifecycle import HolderState
from tensorhub.core.table import ReferenceTable, TableConfig
from tensorhub.scheduling.selection import SourceIndex

from .table_driver import LAYOUT, VirtualClock

NUM_SHARDS = 2
TRAINERS = ("trainer-0", "trainer-1")
ROLLOUTS = ("rollout-0", "rollout-1", "rollout-2", "spot-0", "spot-1")
NAMES = TRAINERS + ROLLOUTS
CONFIG = TableConfig(heartbeat_interval=1.0, heartbeat_timeout=10.0, drain_timeout=30.0, pin_timeout=40.0)
SPECS = ("latest", "latest-1", 0, 1, 2, 3, 5)
STEPS = [0]  # hypothesis state-machine steps run in this process (reported at the end of the session)
N_CHECKSUMS = LAYOUT.checksum_count()


@dataclass
class ShardClient:
    """One shard's client side: its protocol state as a real client would keep it."""

    replica: "ReplicaClient"
    idx: int
    session: int | None = None
    cursor: int = 0  # next entry of the replica's script to issue
    inflight: tuple[int, int, tuple] | None = None  # (req, call n, script entry)
    grants: dict[int, m.Grant] = field(default_factory=dict)
    held: int | None = None  # version in the registered buffers, as the client believes
    epoch: int = -1  # for wait long-polls

    @property
    def peer(self) -> str:
        return f"{self.replica.name}/{self.idx}/{self.replica.incarnation}"


@dataclass
class ReplicaClient:
    name: str
    incarnation: int
    spot: bool
    retain: int | None
    shards: list[ShardClient] = field(default_factory=list)
    script: list[tuple] = field(default_factory=list)
    crashed: bool = False
    closed: bool = False
    removed: bool = False

    @property
    def live(self) -> bool:
        return not (self.crashed or self.closed or self.removed)

    def idle(self) -> bool:
        return all(s.inflight is None and s.cursor == len(self.script) for s in self.shards)


class TableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = VirtualClock()
        self.term = 1
        self.table: ReferenceTable | None = None
        self.replicas: dict[str, ReplicaClient] = {}
        self.by_peer: dict[str, ShardClient] = {}
        self.req = 0
        self.next_version = 0
        self.answers: dict[tuple[str, int, int], tuple] = {}  # (replica, incarnation, call) -> answer
        self.unpublishing: dict[int, tuple[ShardClient, int]] = {}  # req -> (shard, session)
        self.step_removed = False  # a crash/expiry/close/quarantine happened in this step
        self.retained_available: set[int] = set()
        self.pinned_available: set[int] = set()
        self.trace: list[str] = []

    # ---- plumbing -----------------------------------------------------------------------------

    @initialize(seed=st.integers(0, 2**32 - 1), retain=st.sampled_from([None, 0, 1]))
    def start(self, seed: int, retain: int | None) -> None:
        self.rng = random.Random(seed)
        self.table = ReferenceTable(self.clock, random.Random(seed), CONFIG, term=self.term, sources=SourceIndex)
        self.time_passes(11.0)  # past the start-up grace period
        for name in ("trainer-0", "rollout-0", "rollout-1", "spot-0"):
            self.open(name, retain)

    def send(self, sc: ShardClient, msg: Any) -> None:
        out = self.table.handle(sc.peer, msg)
        self.deliver(out)

    def new_req(self) -> int:
        self.req += 1
        return self.req

    def deliver(self, out: list) -> None:
        queue = list(out)
        for _ in range(10000):
            if not queue:
                return
            peer, msg = queue.pop(0)
            self.check_message(msg)
            sc = self.by_peer.get(peer)
            if sc is None or not sc.replica.live and not isinstance(msg, m.Opened):
                continue
            more = self.react(sc, msg)
            for x in more:
                queue.extend(self.table.handle(sc.peer, x))
        raise AssertionError("message storm")

    def check_message(self, msg: Any) -> None:
        t = self.table
        if isinstance(msg, m.Grant) and msg.grant in t.grants:
            g = t.grants[msg.grant]
            src = g.source
            assert src.state in (HolderState.COMPLETE, HolderState.OFFLOAD, HolderState.PARTIAL), src.state
            assert src.id not in g.reader.excluded or not g.reader.excluded[src.id], "granted an excluded source"
            assert src.session.id in t.sessions
        if isinstance(msg, m.Ack) and msg.req in self.unpublishing:
            sc, sid = self.unpublishing.pop(msg.req)
            for g in t.grants.values():
                assert not (g.source.session.id == sid and g.source.kind == "normal"), "unpublish answered with a reader left"

    def react(self, sc: ShardClient, msg: Any) -> list:
        """The client's automatic side: what a real client does on each message."""
        sid = sc.session
        if isinstance(msg, m.Opened):
            sc.session = msg.session
            return []
        if isinstance(msg, m.OffloadRequest):
            return [m.PublishOffload(self.new_req(), sid, msg.version, True)]
        if isinstance(msg, m.VerifyRequest):
            return [m.VerifyResult(self.new_req(), sid, msg.version, self.rng.random() < 0.7)]
        if isinstance(msg, m.Grant):
            sc.grants[msg.grant] = msg
            return []
        if isinstance(msg, m.Revoke):
            sc.grants.pop(msg.grant, None)
            return []
        if isinstance(msg, m.Removed):
            sc.replica.removed = True
            self.step_removed = True
            return []
        if isinstance(msg, m.Quarantined):
            self.step_removed = True
            if sc.held == msg.version:
                sc.held = None
            return []
        if isinstance(msg, (m.FreeOffload, m.ChecksumsReady, m.HeartbeatAck)):
            return []
        if isinstance(msg, m.Listing) and not msg.final and sc.inflight is not None:
            req, n, entry = sc.inflight
            if msg.req != req:
                return []
            sc.epoch = msg.epoch
            nreq = self.new_req()
            sc.inflight = (nreq, n, entry)
            satisfied = msg.epoch if msg.versions else None  # predicate: some version is available
            return [m.Wait(nreq, sid, n, msg.epoch, satisfied, entry[1])]
        req = getattr(msg, "req", None)
        if sc.inflight is not None and req == sc.inflight[0]:
            _, n, entry = sc.inflight
            sc.inflight = None
            self.record_answer(sc, n, entry, msg)
            sc.grants.clear()
        return []

    def record_answer(self, sc: ShardClient, n: int, entry: tuple, msg: Any) -> None:
        kind = entry[0]
        if isinstance(msg, m.Failed):
            answer: tuple = ("error", msg.code)
            if kind in ("replicate", "update"):
                sc.held = None if msg.code != "timeout" or sc.held is None else sc.held
        elif isinstance(msg, m.Replicated):
            answer = ("version", msg.version)
            sc.held = msg.version
        elif isinstance(msg, m.Updated):
            answer = ("updated", msg.moved, msg.version)
            if msg.moved:
                sc.held = msg.version
        elif isinstance(msg, m.Listing):
            answer = ("listing", msg.epoch, msg.versions)
        elif isinstance(msg, m.Ack):
            answer = ("ack",)
            if kind == "publish":
                sc.held = entry[1]
            elif kind == "unpublish":
                sc.held = None
        else:
            raise AssertionError(f"unexpected reply {msg}")
        if kind == "publish" and answer[0] == "error":
            return  # publish errors are per shard (the call itself agreed)
        if kind == "unpublish":
            return  # per-shard outcome
        key = (sc.replica.name, sc.replica.incarnation, n)
        if answer[0] == "error" and answer[1] in ("replica_removed", "fenced", "unknown_session"):
            return
        prev = self.answers.setdefault(key, answer)
        assert prev == answer, f"shards of {key} got different answers: {prev} vs {answer}"

    def heartbeat_all(self) -> None:
        for rc in self.replicas.values():
            if rc.live:
                for sc in rc.shards:
                    if sc.session is not None:
                        self.send(sc, m.Heartbeat(self.new_req(), (sc.session,)))

    def open_replica(self, rc: ReplicaClient) -> None:
        for sc in rc.shards:
            self.by_peer[sc.peer] = sc
            self.send(sc, m.OpenShard(self.new_req(), "actor", rc.name, NUM_SHARDS, sc.idx, f"i{rc.incarnation}",
                                      _loc(rc.name), rc.spot, rc.retain))
            if rc.removed or sc.session is None:
                return
            self.send(sc, m.Register(self.new_req(), sc.session, LAYOUT, {"tcp": sc.peer}))

    def issue(self, sc: ShardClient) -> None:
        rc = sc.replica
        entry = rc.script[sc.cursor]
        sc.cursor += 1
        n = sc.cursor
        req = self.new_req()
        sc.inflight = (req, n, entry)
        kind = entry[0]
        if kind == "publish":
            msg: Any = m.Publish(req, sc.session, n, entry[1], (entry[1],) * N_CHECKSUMS)
        elif kind == "unpublish":
            msg = m.Unpublish(req, sc.session, n)
            self.unpublishing[req] = (sc, sc.session)
        elif kind == "replicate":
            msg = m.Replicate(req, sc.session, n, entry[1], entry[2])
        elif kind == "update":
            msg = m.Update(req, sc.session, n, entry[1], entry[2])
        elif kind == "list":
            msg = m.ListVersions(req, sc.session, n)
        else:
            msg = m.Wait(req, sc.session, n, -1, None, entry[1])
        self.send(sc, msg)

    # ---- rules --------------------------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), retain=st.sampled_from([None, 0, 1]))
    def open(self, name: str, retain: int | None) -> None:
        rc = self.replicas.get(name)
        if rc is not None and rc.live:
            return
        inc = rc.incarnation + 1 if rc else 1
        if rc is not None and not rc.closed:
            self.step_removed = True  # a new incarnation fences the old one, as if it crashed
        rc = ReplicaClient(name, inc, name.startswith("spot"), retain if name in TRAINERS else None)
        rc.shards = [ShardClient(rc, i) for i in range(NUM_SHARDS)]
        self.replicas[name] = rc
        self.trace.append(f"open {name}#{inc}")
        self.open_replica(rc)

    @rule(name=st.sampled_from(TRAINERS))
    def trainer_publishes(self, name: str) -> None:
        rc = self.replicas.get(name)
        if rc is None or not rc.live or not rc.idle():
            return
        if rc.shards[0].held is not None:
            rc.script.append(("unpublish",))
        self.next_version += 1
        rc.script.append(("publish", self.next_version))
        self.pump_replica(rc)

    def pump_replica(self, rc: ReplicaClient, order: list[int] | None = None) -> None:
        for idx in order or range(NUM_SHARDS):
            sc = rc.shards[idx]
            if rc.live and sc.inflight is None and sc.cursor < len(rc.script) and sc.session is not None:
                self.issue(sc)

    @rule(mask=st.integers(0, 2 ** len(NAMES) - 1))
    def pump(self, mask: int) -> None:
        """Everyone makes progress: idle rollouts picked by ``mask`` update to the latest
        version (the rollout loop), shards issue their next call, transfers complete."""
        for i, name in enumerate(NAMES):
            rc = self.replicas.get(name)
            if rc is not None and rc.live and name in ROLLOUTS and mask >> i & 1 and rc.idle():
                rc.script.append(("update", "latest", None))
        for rc in list(self.replicas.values()):
            self.pump_replica(rc)
            for sc in rc.shards:
                for g in list(sc.grants.values()):
                    if rc.live and g.grant in sc.grants:
                        del sc.grants[g.grant]
                        self.send(sc, m.Complete(self.new_req(), sc.session, g.grant, g.term))

    @rule(name=st.sampled_from(NAMES), kind=st.sampled_from(["replicate", "update", "update", "unpublish", "list", "wait"]),
          spec=st.sampled_from(SPECS), timeout=st.sampled_from([None, 5.0, 20.0]), now=st.sampled_from([[], [0], [1], [1, 0]]))
    def replica_calls(self, name: str, kind: str, spec: Any, timeout: float | None, now: list[int]) -> None:
        rc = self.replicas.get(name)
        if rc is None or not rc.live or len(rc.script) - min(s.cursor for s in rc.shards) > 2:
            return
        if kind in ("replicate", "update"):
            rc.script.append((kind, spec, timeout))
        elif kind == "wait":
            rc.script.append(("wait", timeout or 20.0))
        else:
            rc.script.append((kind,))
        if now:
            self.pump_replica(rc, now)

    @rule(name=st.sampled_from(NAMES), idx=st.integers(0, NUM_SHARDS - 1))
    def shard_steps(self, name: str, idx: int) -> None:
        rc = self.replicas.get(name)
        if rc is None or not rc.live:
            return
        sc = rc.shards[idx]
        if sc.inflight is None and sc.cursor < len(rc.script) and sc.session is not None:
            self.issue(sc)

    @rule(name=st.sampled_from(NAMES), action=st.sampled_from(["complete", "complete", "complete", "fail", "corrupt", "progress"]))
    def transfer(self, name: str, action: str) -> None:
        rc = self.replicas.get(name)
        if rc is None or not rc.live:
            return
        for sc in rc.shards:
            if not sc.grants:
                continue
            g = next(iter(sc.grants.values()))
            if action != "progress":
                del sc.grants[g.grant]
            req = self.new_req()
            if action == "complete":
                self.send(sc, m.Complete(req, sc.session, g.grant, g.term))
            elif action == "fail":
                self.send(sc, m.SourceFailed(req, sc.session, g.grant, g.term, 4096, "test"))
            elif action == "corrupt":
                self.send(sc, m.ChecksumFailed(req, sc.session, g.grant, g.term, 0, 1))
            else:
                self.send(sc, m.Progress(req, sc.session, g.grant, g.term, 4096))
            return

    @rule(name=st.sampled_from(NAMES), roll=st.integers(0, 3))
    def crash(self, name: str, roll: int) -> None:
        rc = self.replicas.get(name)
        if roll == 0 and rc is not None and rc.live:
            rc.crashed = True
            self.trace.append(f"crash {name}")

    @rule(name=st.sampled_from(NAMES))
    def close(self, name: str) -> None:
        rc = self.replicas.get(name)
        if rc is None or not rc.live or any(s.inflight for s in rc.shards):
            return
        rc.closed = True
        self.step_removed = True
        for sc in rc.shards:
            if sc.session is not None:
                self.send(sc, m.CloseShard(self.new_req(), sc.session))

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 11.0, 31.0]))
    def time_passes(self, dt: float) -> None:
        end = self.clock.t + dt
        while self.clock.t < end:
            self.clock.t = min(end, self.clock.t + 1.0)
            before = self.table.stats["expired"]
            self.deliver(self.table.tick())
            if self.table.stats["expired"] != before:
                self.step_removed = True
            self.heartbeat_all()

    @precondition(lambda self: self.term < 4)
    @rule(roll=st.integers(0, 9))
    def failover(self, roll: int) -> None:
        """The server dies; a new one (next term) starts; live clients re-open, re-register,
        re-announce what they hold and their last answers, then re-send calls in flight."""
        if roll:
            return
        self.term += 1
        self.trace.append(f"failover to term {self.term}")
        self.table = ReferenceTable(self.clock, random.Random(self.term), CONFIG, term=self.term, sources=SourceIndex)
        self.step_removed = True
        self.unpublishing.clear()
        live = [rc for rc in self.replicas.values() if rc.live]
        for rc in live:
            for sc in rc.shards:
                sc.session = None
                sc.grants.clear()
            self.open_replica(rc)
        for rc in live:
            for sc in rc.shards:
                if sc.session is None or not rc.live:
                    continue
                holdings = (m.Held(sc.held, "normal", (sc.held,) * N_CHECKSUMS),) if sc.held is not None else ()
                answered = sc.cursor - (1 if sc.inflight else 0)
                answers = []
                for n in range(max(1, answered - 15), answered + 1):
                    entry = rc.script[n - 1]
                    ans = self.answers.get((rc.name, rc.incarnation, n))
                    if ans is None:
                        continue
                    if ans[0] in ("version", "updated"):
                        answers.append(m.CallAnswer(n, entry[0], ans[1] if ans[0] == "version" else ans[2],
                                                    ans[1] if ans[0] == "updated" else None, None, None))
                    elif ans[0] == "listing":
                        answers.append(m.CallAnswer(n, entry[0], None, None, ans[1], ans[2]))
                    elif ans[0] == "error":
                        answers.append(m.CallAnswer(n, entry[0], None, None, None, None, ans[1], "announced"))
                self.send(sc, m.Announce(self.new_req(), sc.session, holdings, None, answered, tuple(answers)))
        for rc in live:
            for sc in rc.shards:
                if sc.inflight is not None and rc.live and sc.session is not None:
                    sc.cursor -= 1
                    sc.inflight = None
                    self.issue(sc)

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def count_step(self) -> None:
        STEPS[0] += 1

    @invariant()
    def table_invariants(self) -> None:
        if self.table is None:
            return
        bad = check_invariants(self.table)
        assert not bad, "\n".join(bad + self.trace[-20:])
        t = self.table
        assert t.stats["grants"] == t.stats["grants_ended"] + len(t.grants)

    @invariant()
    def retained_versions_stay_available(self) -> None:
        if self.table is None:
            return
        model = self.table.models.get("actor")
        now = set()
        if model is not None:
            # Protected: retained, and every shard has a non-spot copy (spot copies never count).
            now = {
                v for v in model.available
                if model.retained(v) and all(
                    any(h.state in (HolderState.COMPLETE, HolderState.OFFLOAD) and not h.spot for h in hs.values())
                    for hs in model.versions[v].holders
                )
            }
            lost = {v for v in self.retained_available - now if model.retained(v) and v not in model.available}
            assert not lost or self.step_removed, f"retained versions {lost} lost without a holder dying"
        self.retained_available = now
        # Pinned by a replicate/update in flight, in a model that keeps CPU copies, with a
        # non-spot copy of every shard: it stays available while the pin lasts.
        pinned = set()
        if model is not None and model.declarations:
            pinned = {
                v for v in model.available
                if v in model.pins and all(
                    any(h.state in (HolderState.COMPLETE, HolderState.OFFLOAD) and not h.spot for h in hs.values())
                    for hs in model.versions[v].holders
                )
            }
            lost = {v for v in self.pinned_available - pinned if v in model.pins and v not in model.available}
            assert not lost or self.step_removed, f"pinned versions {lost} lost without a holder dying"
        self.pinned_available = pinned
        self.step_removed = False

    def teardown(self) -> None:
        if self.table is None:
            return
        # Every client closes: live ones finish and close; crashed or removed ones restart (a new
        # incarnation, which re-declares their retention) and close cleanly. Nothing may be left.
        for _ in range(200):
            for rc in self.replicas.values():
                if rc.live:
                    for sc in rc.shards:
                        for g in list(sc.grants.values()):
                            sc.grants.pop(g.grant)
                            self.send(sc, m.Complete(self.new_req(), sc.session, g.grant, g.term))
            if all(rc.idle() or not rc.live for rc in self.replicas.values()):
                break
            self.time_passes(1.0)
        for rc in self.replicas.values():
            if rc.live:
                rc.closed = True
                for sc in rc.shards:
                    if sc.session is not None and sc.session in self.table.sessions:
                        self.send(sc, m.CloseShard(self.new_req(), sc.session))
        self.time_passes(11.0)
        for name, rc in list(self.replicas.items()):
            if rc.crashed or rc.removed:
                self.open(name, rc.retain)
                fresh = self.replicas[name]
                fresh.closed = True
                for sc in fresh.shards:
                    if sc.session is not None and sc.session in self.table.sessions:
                        self.send(sc, m.CloseShard(self.new_req(), sc.session))
        self.time_passes(31.0)
        bad = check_invariants(self.table)
        assert not bad, bad
        counts = self.table.counts()
        assert counts == dict.fromkeys(counts, 0), counts


def _loc(name: str) -> m.Location:
    dc = "dc1" if name.endswith("2") else "dc0"
    return m.Location(dc, f"host-{name}", "")


TestTableStateMachine = TableMachine.TestCase


def random_walk(seed: int, steps: int) -> str:
    """Drive the machine's rules with a seeded random choice (no hypothesis): a longer soak
    than the hypothesis examples, and a reproducible trace. Returns a digest of every message
    the table sent, in order."""
    import hashlib

    r = random.Random(seed)
    machine = TableMachine()
    digest = hashlib.sha256()
    deliver = machine.deliver

    def recording(out: list) -> None:
        for peer, msg in out:
            digest.update(repr((peer, msg)).encode())
        deliver(out)

    machine.deliver = recording  # type: ignore[method-assign]
    machine.start(seed=seed, retain=r.choice([None, 0, 1]))
    kinds = ["replicate", "update", "update", "unpublish", "list", "wait"]
    for step in range(steps):
        name = r.choice(NAMES)
        k = r.randrange(9)
        try:
            if k == 0:
                machine.open(name, r.choice([None, 0, 1]))
            elif k == 1:
                machine.trainer_publishes(r.choice(TRAINERS))
            elif k == 2:
                machine.pump(r.randrange(2 ** len(NAMES)))
            elif k == 3:
                machine.replica_calls(name, r.choice(kinds), r.choice(SPECS), r.choice([None, 5.0, 20.0]),
                                      r.choice([[], [0], [1], [1, 0]]))
            elif k == 4:
                machine.shard_steps(name, r.randrange(NUM_SHARDS))
            elif k == 5:
                machine.transfer(name, r.choice(["complete", "complete", "fail", "corrupt", "progress"]))
            elif k == 6:
                machine.crash(name, r.randrange(4))
            elif k == 7:
                machine.time_passes(r.choice([0.5, 1.0, 3.0, 11.0, 31.0]))
            elif k == 8 and machine.term < 4:
                machine.failover(r.randrange(10))
            machine.table_invariants()
            machine.retained_versions_stay_available()
        except Exception as exc:
            raise AssertionError(f"random walk seed={seed} failed at step {step}: {exc}") from exc
    machine.teardown()
    return digest.hexdigest()


def test_seeded_random_walks(seed: int) -> None:
    """A bounded soak: a few long seeded walks (the seed is printed on failure)."""
    for k in range(4):
        random_walk(seed + k, 1500)


# ---- two servers and partitions: the no-split-brain rule (issue 23) ---------------------------

from tensorhub.core.table.failover import Reign  # noqa: E402

LEASE = 5.0
VOTER_NAMES = ("trainer-0", "rollout-0", "rollout-1", "rollout-2", "rollout-3")
SERVER_NAMES = ("P", "B")
LINKS = tuple(
    [(c, s) for c in VOTER_NAMES for s in SERVER_NAMES] + [(s, c) for c in VOTER_NAMES for s in SERVER_NAMES]
    + [("P", "B"), ("B", "P")]
)  # fmt: skip
SPLIT_STEPS = [0, 0]  # steps run, steps in which the backup reigned


@dataclass
class VoterClient:
    """One single-shard replica's client: its server, session and the stamp it echoes."""

    name: str
    at: str | None = None
    session: int | None = None
    stamp: tuple[int, float] | None = None  # (term, stamp) of the server it is on
    heard: float = 0.0
    alive: bool = True
    incarnation: int = 1
    tried: int = 0  # servers tried while looking for one
    version: int = 0  # the trainer's next version


class SplitBrainMachine(RuleBasedStateMachine):
    """A primary and a backup (real tables with their :class:`Reign`), five voters, and a
    network whose directed links drop everything while cut. Servers crash and restart (with
    nothing), clients crash and come back as new incarnations, time passes in quarter seconds.
    At every quarter second at most one server may reign, and no server grants while it does
    not reign."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = VirtualClock()
        self.tables: dict[str, ReferenceTable | None] = {}
        self.terms = {"P": 1, "B": 2}
        self.cut: set[tuple[str, str]] = set()
        self.clients: dict[str, VoterClient] = {}
        self.req = 0
        self.next_beat = 0.0
        self.reigned_b = False
        self.stalled: set[str] = set()  # servers standing still: nothing handled, what comes is queued
        self.queued: list[tuple[VoterClient, str, Any]] = []
        self.backup_release = "now"  # "earlier": the backup's lease replies say nothing of its reigns
        self.eager = True  # False: lease requests only every second, as before issue 34's fix

    @initialize(seed=st.integers(0, 2**32 - 1))
    def start(self, seed: int) -> None:
        self.rng = random.Random(seed)
        for name in SERVER_NAMES:
            self.tables[name] = self.new_table(name)
        for name in VOTER_NAMES:
            self.clients[name] = VoterClient(name)
            self.connect(self.clients[name], "P")
        self.advance(8.0)

    def new_table(self, name: str) -> ReferenceTable:
        self.terms[name] += 10
        reign = Reign("primary" if name == "P" else "backup", LEASE)
        return ReferenceTable(self.clock, random.Random(self.terms[name]), CONFIG, term=self.terms[name],
                              sources=SourceIndex, reign=reign)  # fmt: skip

    def up(self, a: str, b: str) -> bool:
        return (a, b) not in self.cut

    def new_req(self) -> int:
        self.req += 1
        return self.req

    # ---- the network --------------------------------------------------------------------------

    def to_server(self, c: VoterClient, srv: str, msg: Any) -> None:
        if srv in self.stalled:
            self.queued.append((c, srv, msg))
            return
        t = self.tables.get(srv)
        if t is None or not c.alive or not self.up(c.name, srv):
            return
        if isinstance(msg, m.Heartbeat) and msg.req % 2:  # the server's socket reader's path (half of them)
            self.deliver(srv, t.heartbeat(c.name, msg))
        else:
            self.deliver(srv, t.handle(c.name, msg))
        if srv == "P":
            self.eager_lease()

    def eager_lease(self) -> None:
        """The primary's lease request ahead of the periodic ones, as its actor sends it after
        every batch and tick: its sessions' slots changed (``lease_due``)."""
        p = self.tables["P"]
        if p is not None and "P" not in self.stalled and self.eager:
            due = p.lease_due()
            if due is not None and due <= self.clock.t:
                self.lease_exchange()

    def deliver(self, srv: str, out: list) -> None:
        t = self.tables[srv]
        assert t is not None
        for peer, msg in out:
            if isinstance(msg, m.Grant):
                assert t.reign.reigning, f"server {srv} granted while not reigning"
            c = self.clients.get(peer)
            if c is None or not c.alive or not self.up(srv, c.name):
                continue
            if isinstance(msg, m.Opened) and c.at is None and c.session is None:
                c.at, c.session, c.heard, c.tried = srv, msg.session, self.clock.t, 0
                self.to_server(c, srv, m.Register(self.new_req(), msg.session, LAYOUT, {"tcp": c.name}))
            elif c.at != srv or msg is None:
                continue
            elif isinstance(msg, m.HeartbeatAck):
                c.heard = self.clock.t
                if c.session in msg.unknown:  # the server restarted meanwhile: open there again
                    self.connect(c, srv)
                    continue
                if msg.term:
                    c.stamp = (msg.term, msg.stamp)
            elif isinstance(msg, m.StepDown):
                self.move(c)
            elif isinstance(msg, m.Grant) and c.session is not None:
                self.to_server(c, srv, m.Complete(self.new_req(), c.session, msg.grant, msg.term))
            else:
                c.heard = self.clock.t

    def connect(self, c: VoterClient, srv: str) -> None:
        c.at, c.session, c.stamp = None, None, None  # a client forgets its stamps when it moves
        self.to_server(c, srv, m.OpenShard(self.new_req(), "actor", c.name, 1, 0, f"i{c.incarnation}",
                                           _loc(c.name), False, None))  # fmt: skip

    def move(self, c: VoterClient) -> None:
        """Leave the current server for the next one of the list (wrapping around)."""
        last = c.at or SERVER_NAMES[c.tried % 2]
        c.tried += 1
        self.connect(c, "B" if last == "P" else "P")

    def stall(self, srv: str) -> None:
        """The server's process stops being scheduled: no tick, nothing read, nothing sent."""
        self.stalled.add(srv)

    def wake(self, srv: str) -> None:
        """It runs again and reads what came meanwhile, in order."""
        self.stalled.discard(srv)
        queued, self.queued = [q for q in self.queued if q[1] == srv], [q for q in self.queued if q[1] != srv]
        t = self.tables[srv]
        if t is not None:
            self.deliver(srv, t.tick())  # its tick first, as the actor's stall credit runs
        for c, _, msg in queued:
            self.to_server(c, srv, msg)

    def lease_exchange(self) -> None:
        p, b = self.tables["P"], self.tables["B"]
        if p is None or "P" in self.stalled:
            return
        request = p.lease_request(self.new_req())
        if b is None or not self.up("P", "B"):
            return
        for peer, reply in b.handle("peer-P", request):
            if isinstance(reply, m.LeaseReply) and self.backup_release == "earlier":
                reply = dataclasses.replace(reply, reigns=None)  # what a backup of an earlier release says
            if isinstance(reply, m.LeaseReply):
                if self.up("B", "P"):
                    self.deliver("P", p.handle("peer-B", reply))
            else:
                self.deliver("B", [(peer, reply)])

    def advance(self, dt: float) -> None:
        end = self.clock.t + dt
        while self.clock.t < end - 1e-9:
            self.clock.t += 0.25
            for srv in SERVER_NAMES:
                if self.tables[srv] is not None and srv not in self.stalled:
                    self.deliver(srv, self.tables[srv].tick())
            self.eager_lease()
            if self.clock.t >= self.next_beat:
                self.next_beat = self.clock.t + 1.0
                self.lease_exchange()
                for c in self.clients.values():
                    if not c.alive:
                        continue
                    if c.at is None:
                        self.move(c)
                    elif self.clock.t - c.heard > CONFIG.heartbeat_timeout:
                        self.move(c)
                    elif c.session is not None:
                        term, stamp = c.stamp or (0, 0.0)
                        self.to_server(c, c.at, m.Heartbeat(self.new_req(), (c.session,), stamp, term))
            self.one_reign()

    # ---- rules --------------------------------------------------------------------------------

    @rule(link=st.sampled_from(LINKS))
    def cut_link(self, link: tuple[str, str]) -> None:
        self.cut.add(link)

    @rule(srv=st.sampled_from(SERVER_NAMES), mask=st.integers(1, 2 ** len(VOTER_NAMES) - 1),
          way=st.sampled_from(["both", "to", "from"]), peers=st.booleans())  # fmt: skip
    def partition(self, srv: str, mask: int, way: str, peers: bool) -> None:
        """Cut a group of clients off one server (one way or both), and maybe the servers apart."""
        for i, name in enumerate(VOTER_NAMES):
            if mask >> i & 1:
                if way != "from":
                    self.cut.add((srv, name))
                if way != "to":
                    self.cut.add((name, srv))
        if peers:
            self.cut.update({("P", "B"), ("B", "P")})

    @rule(pair=st.sampled_from(LINKS), everything=st.booleans())
    def heal(self, pair: tuple[str, str], everything: bool) -> None:
        if everything:
            self.cut.clear()
        else:
            self.cut.discard(pair)
            self.cut.discard((pair[1], pair[0]))

    @rule(dt=st.sampled_from([0.5, 1.0, 2.0, 5.0, 11.0, 20.0]))
    def time_passes(self, dt: float) -> None:
        self.advance(dt)

    @rule(name=st.sampled_from(VOTER_NAMES))
    def call(self, name: str) -> None:
        c = self.clients[name]
        if c.at is None or c.session is None:
            return
        n = self.new_req()
        if name.startswith("trainer"):
            c.version += 1
            self.to_server(c, c.at, m.Publish(n, c.session, n, c.version, (c.version,) * N_CHECKSUMS))
        else:
            self.to_server(c, c.at, m.Replicate(n, c.session, n, "latest", 3.0))

    @rule(srv=st.sampled_from(SERVER_NAMES), restart=st.booleans())
    def server_crash(self, srv: str, restart: bool) -> None:
        self.tables[srv] = self.new_table(srv) if restart else None

    @rule(srv=st.sampled_from(SERVER_NAMES))
    def server_restart(self, srv: str) -> None:
        if self.tables[srv] is None:
            self.tables[srv] = self.new_table(srv)

    @rule(name=st.sampled_from(VOTER_NAMES), back=st.booleans())
    def client_crash(self, name: str, back: bool) -> None:
        c = self.clients[name]
        c.alive = False
        c.at = c.session = c.stamp = None
        if back:  # a new process: a new incarnation, the primary first
            c.alive, c.incarnation, c.tried = True, c.incarnation + 1, 0
            self.connect(c, "P")

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def one_reign(self) -> None:
        now = self.clock.t
        reigning = [s for s, t in self.tables.items() if t is not None and t.reign.may_reign(now)]
        assert len(reigning) <= 1, f"two servers may reign at t={now}: {reigning}; cut={sorted(self.cut)}"
        for s, t in self.tables.items():
            if t is not None:
                assert t.reign.violations == 0, f"{s} granted while not reigning"
        if "B" in reigning:
            self.reigned_b = True

    def teardown(self) -> None:
        SPLIT_STEPS[0] += 1
        SPLIT_STEPS[1] += self.reigned_b


TestSplitBrainMachine = SplitBrainMachine.TestCase


def split_brain_walk(seed: int, steps: int) -> tuple[int, int]:
    """Drive :class:`SplitBrainMachine` with a seeded random choice of rules (no hypothesis):
    long runs of partitions, crashes and time. Returns (quarter seconds in which the primary
    reigned, those in which the backup did)."""
    r = random.Random(seed)
    machine = SplitBrainMachine()
    machine.start(seed=seed)
    reigned = {"P": 0, "B": 0}
    for step in range(steps):
        k = r.randrange(10)
        try:
            if k == 0:
                machine.partition(r.choice(SERVER_NAMES), r.randrange(1, 32), r.choice(["both", "to", "from"]), r.random() < 0.3)
            elif k == 1:
                machine.cut_link(r.choice(LINKS))
            elif k == 2:
                machine.heal(r.choice(LINKS), r.random() < 0.3)
            elif k in (3, 4, 5):
                machine.time_passes(r.choice([0.5, 1.0, 2.0, 5.0, 11.0, 20.0]))
            elif k == 6:
                machine.call(r.choice(VOTER_NAMES))
            elif k == 7 and r.random() < 0.3:
                machine.server_crash(r.choice(SERVER_NAMES), r.random() < 0.5)
            elif k == 8:
                machine.server_restart(r.choice(SERVER_NAMES))
            elif k == 9 and r.random() < 0.3:
                machine.client_crash(r.choice(VOTER_NAMES), r.random() < 0.8)
            machine.one_reign()
        except Exception as exc:
            raise AssertionError(f"split-brain walk seed={seed} failed at step {step}: {exc}") from exc
        for s in SERVER_NAMES:
            t = machine.tables[s]
            reigned[s] += t is not None and t.reign.reigning
    return reigned["P"], reigned["B"]


def test_split_brain_walks(seed: int) -> None:
    """A bounded soak of the two-server machine (the seed is printed on failure); it must also
    see the backup take over, or it proves little."""
    backup = 0
    for k in range(100):  # about 7 s; each of the rule's parts, broken on purpose, fails within it
        _, b = split_brain_walk(seed + k, 400)
        backup += b
    assert backup > 0, "the backup never reigned: the walks exercise nothing"


def test_a_primary_killed_right_after_the_first_opens_leaves_a_backup_that_takes_over(seed: int) -> None:
    """The backup learns who votes (the membership) from the primary's lease requests. The
    primary sends one as soon as its sessions' slots change, so a primary that dies at once
    after its clients opened leaves a backup that knows its voters and takes over. (Before, the
    slots went with the next periodic request, a fifth of a lease later: killed in between,
    the primary left a backup that said "no membership known yet" for ever; ``eager=False``
    shows it.)"""
    for eager in (False, True):
        machine = SplitBrainMachine()
        machine.eager = eager
        machine.rng = random.Random(seed)
        for name in SERVER_NAMES:
            machine.tables[name] = machine.new_table(name)
        machine.advance(2.0)  # the primary has learned the backup's (empty) membership and reigns
        p, b = machine.tables["P"], machine.tables["B"]
        assert p is not None and b is not None and p.reign.reigning and p.reign.synced
        assert machine.next_beat > machine.clock.t  # no periodic request before the kill
        for name in VOTER_NAMES:
            machine.clients[name] = VoterClient(name)
            machine.connect(machine.clients[name], "P")
        assert len(p.sessions) == len(VOTER_NAMES)
        machine.server_crash("P", restart=False)  # killed at once, before any periodic request
        machine.advance(3 * CONFIG.heartbeat_timeout)  # the clients move; the backup takes over
        if not eager:
            assert not b.reign.reigning and "no membership known yet" in b.reign.why_not(), f"seed={seed}"
            continue
        assert b.reign.epoch >= 1 and "actor/trainer-0/0" in b.reign.voters, f"seed={seed}: {b.reign.voters}"
        assert b.reign.reigning, f"seed={seed}: the backup did not take over: {b.reign.why_not()}"
        assert all(c.at == "B" for c in machine.clients.values())
        assert sorted(s.replica.name for s in b.sessions.values()) == sorted(VOTER_NAMES)


def test_a_primarys_eager_lease_requests_are_coalesced_and_spaced() -> None:
    """The eager requests (see :meth:`Reign.eager_at`): none while the slots are shipped and
    acknowledged, none while the last request awaits its answer (the answer brings the next
    look), and each at least ``min(lease / 25, 0.1)`` s after the one before, however many
    opens came meanwhile."""
    reign = Reign("primary", 5.0)
    assert reign.eager_at(0.0, 0) == 0.0  # not synced yet: ask at once
    reign.lease_request(1, 0.0, 3, (), 0)
    assert reign.eager_at(0.01, 0) is None  # awaiting the answer
    reign.on_reply(m.LeaseReply(1, 9, True, 5.0, 0, None, 0))
    assert reign.synced and reign.eager_at(0.02, 0) == 0.1  # synced: the slots are looked at, after the gap
    reign.lease_request(2, 0.1, 3, (), 0)
    reign.on_reply(m.LeaseReply(2, 9, True, 5.0, 0, None, 0))
    assert reign.eager_at(0.2, 0) is None  # nothing changed
    assert reign.eager_at(0.2, 5) == 0.2  # five opens since: one request now
    request = reign.lease_request(3, 0.2, 3, ("a/r/0",), 5)
    assert request.epoch == 1 and request.voters == ("a/r/0",)
    assert reign.eager_at(0.21, 9) is None  # a change on its way: the answer brings the next look
    reign.on_reply(m.LeaseReply(3, 9, True, 5.0, 1, None, 0))
    assert reign.epoch == 1 and reign.eager_at(0.21, 9) == 0.2 + 0.1  # the gap from the last one
    # a periodic request while a change is on its way repeats that change: the later slots wait
    # for its answer, then go at once
    request = reign.lease_request(4, 0.3, 3, ("a/r/0", "a/r/1"), 9)
    assert request.epoch == 2 and request.voters == ("a/r/0", "a/r/1")
    reign.lease_request(5, 0.35, 3, ("a/r/0", "a/r/1", "a/r/2"), 12)  # the tick: epoch 2 again
    reign.on_reply(m.LeaseReply(4, 9, True, 5.0, 2, None, 0))
    assert reign.epoch == 2 and reign.eager_at(0.5, 12) is None  # the tick's answer is awaited
    reign.on_reply(m.LeaseReply(5, 9, True, 5.0, 2, None, 0))
    assert reign.eager_at(0.5, 12) == 0.5  # slot change 12 still to ship: at once
    request = reign.lease_request(6, 0.5, 3, ("a/r/0", "a/r/1", "a/r/2"), 12)
    assert request.epoch == 3 and len(request.voters) == 3
    reign.on_reply(m.LeaseReply(6, 9, True, 5.0, 3, None, 0))
    reign.lease_request(7, 0.6, 3, ("a/r/0", "a/r/1", "a/r/2"), 13)
    reign.unsent(7)  # the backup went away: retried at the periodic requests' pace, not at once
    assert reign.eager_at(0.61, 13) is None and reign.eager_at(0.61, 14) == 0.6 + 1.0  # a change since
    assert Reign("backup", 5.0).eager_at(0.0, 3) is None and Reign("solo").eager_at(0.0, 3) is None
    assert Reign("primary", 1.0).eager_at(0.0, 0) == 0.0
    slow = Reign("primary", 1.0)
    slow.lease_request(1, 0.0, 3, (), 0)
    slow.unsent(1)  # not heard the backup yet (it is not connected): asked again after the gap
    assert slow.eager_at(0.0, 0) == 1.0 / 25  # a short lease: a shorter gap
    slow.lease_request(2, 0.04, 3, (), 0)
    assert slow.eager_at(0.05, 0) is None  # sent: its answer is awaited


def test_a_session_the_primary_kept_alive_is_not_removed_by_the_backup_taking_over(seed: int) -> None:
    """Heartbeats are votes that refresh deadlines, nothing more: after the primary dies, the
    backup that takes over keeps every session its clients bring (none of them expires there),
    and the primary never removed one it heard from. Seeded; the seed is printed on failure."""
    machine = SplitBrainMachine()
    machine.start(seed=seed)
    p, b = machine.tables["P"], machine.tables["B"]
    assert p is not None and b is not None
    machine.advance(12.0)  # past a heartbeat timeout: every session kept alive by heartbeats alone
    assert p.reign.reigning and set(p.reign.votes) == set(p.sessions)
    assert sorted(s.replica.name for s in p.sessions.values()) == sorted(VOTER_NAMES)
    assert p.stats["expired"] == 0, f"seed={seed}: the primary removed a session it heard from"
    machine.cut.update({("P", "B"), ("B", "P")})  # the primary alone: it reigns by its votes (lease gone)
    machine.advance(12.0)
    assert p.reign.reigning and p.stats["expired"] == 0, f"seed={seed}: {p.reign.why_not()}"
    machine.server_crash("P", restart=False)
    machine.cut.clear()
    machine.advance(3 * CONFIG.heartbeat_timeout)  # the clients move; the backup takes over
    assert b.reign.reigning, f"seed={seed}: the backup did not take over: {b.reign.why_not()}"
    assert all(c.at == "B" for c in machine.clients.values())
    at_takeover = {sid: s.replica.name for sid, s in b.sessions.items()}
    assert sorted(at_takeover.values()) == sorted(VOTER_NAMES)
    machine.advance(3 * CONFIG.heartbeat_timeout)
    assert {sid: s.replica.name for sid, s in b.sessions.items()} == at_takeover, f"seed={seed}"
    assert b.stats["expired"] == 0, f"seed={seed}: the backup removed a session that heartbeats"


def _primary_reigning_with_every_session(seed: int) -> tuple[SplitBrainMachine, ReferenceTable, ReferenceTable, dict[int, str]]:
    machine = SplitBrainMachine()
    machine.start(seed=seed)
    p, b = machine.tables["P"], machine.tables["B"]
    assert p is not None and b is not None
    machine.advance(8.0)
    assert p.reign.reigning and p.reign.lease_until > machine.clock.t, f"seed={seed}: {p.reign.why_not()}"
    sessions = {sid: s.replica.name for sid, s in p.sessions.items()}
    assert sorted(sessions.values()) == sorted(VOTER_NAMES)
    return machine, p, b, sessions


def test_a_primary_that_stood_still_past_its_lease_keeps_its_sessions_when_the_backup_did_not_reign(seed: int) -> None:
    """The primary's process stands still for longer than its lease (its lease and its votes run
    out) but less than a heartbeat timeout: its clients stay, so the backup never gains a
    majority and never reigns. On waking the primary holds (decides nothing), and the backup's
    next lease reply says it began no reign: the primary reigns again with every session and its
    term; no client is told to move. (Before: it stepped down and forgot every session.)"""
    machine, p, b, sessions = _primary_reigning_with_every_session(seed)
    for name in VOTER_NAMES:  # a version published and replicated: state worth keeping
        machine.call(name)
    machine.advance(1.0)
    held = {(s.replica.name, s.holder.version, s.holder.state) for s in p.sessions.values() if s.holder is not None}
    assert ("trainer-0", 1, HolderState.COMPLETE) in held
    term = p.term
    machine.stall("P")
    machine.advance(LEASE + 2.0)  # past the lease, within the heartbeat timeout
    assert not b.reign.reigning and b.reign.begun == 0
    machine.wake("P")
    assert not p.reign.reigning and p.reign.held_since is not None, f"seed={seed}: {p.reign.why_not()}"
    assert "holds its sessions" in p.reign.why_not()
    assert p.tick() == []  # holding: it decides nothing, time-driven decisions included
    machine.call("rollout-0")  # refused while it holds (ServerUnavailable), not decided
    machine.advance(2.0)  # the next lease exchange
    assert p.reign.reigning, f"seed={seed}: {p.reign.why_not()}"
    assert p.term == term and {sid: s.replica.name for sid, s in p.sessions.items()} == sessions
    assert held <= {(s.replica.name, s.holder.version, s.holder.state) for s in p.sessions.values() if s.holder is not None}
    assert not p.reign.dropped and p.stats["expired"] == 0
    assert all(c.at == "P" and c.session in sessions for c in machine.clients.values()), f"seed={seed}: a client moved"
    assert p.reign.violations == 0 and b.reign.violations == 0


def test_a_holding_primary_removes_no_replica_on_a_close_or_a_new_incarnation_s_open(seed: int) -> None:
    """While a primary holds (it stood still past its lease and waits for its backup's word), a
    close and a new incarnation's open would each remove a replica at once: its holders, the
    grants they serve. Both are refused (``ServerUnavailable``) and change nothing; a retried
    open of the same incarnation is still answered. Once the primary reigns again, both go
    through. (Before: both removed the replica while it held.)"""
    machine, p, b, sessions = _primary_reigning_with_every_session(seed)
    for name in VOTER_NAMES:
        machine.call(name)
    machine.advance(1.0)
    machine.stall("P")
    machine.advance(LEASE + 2.0)
    machine.wake("P")
    assert p.reign.held_since is not None, f"seed={seed}: {p.reign.why_not()}"
    trainer, rollout = machine.clients["trainer-0"], machine.clients["rollout-0"]
    before = {sid: (s.replica.name, s.holder.state if s.holder is not None else None) for sid, s in p.sessions.items()}
    assert before[trainer.session][1] is HolderState.COMPLETE
    loc = _loc("rollout-0")
    refused = [
        p.handle("trainer-0", m.CloseShard(machine.new_req(), trainer.session)),
        p.handle("rollout-0", m.OpenShard(machine.new_req(), "actor", "rollout-0", 1, 0, "i99", loc, False, None)),
    ]
    for out in refused:
        (peer, failed), = out
        assert isinstance(failed, m.Failed) and failed.code == "server_unavailable", f"seed={seed}: {failed}"
        assert "waits for that answer" in failed.message
    assert {sid: (s.replica.name, s.holder.state if s.holder is not None else None) for sid, s in p.sessions.items()} == before
    assert p.stats["revoked"] == 0 and set(p.sessions) == set(sessions)
    same = p.handle("rollout-0", m.OpenShard(machine.new_req(), "actor", "rollout-0", 1, 0, f"i{rollout.incarnation}", loc, False, None))
    assert [type(x) for _, x in same] == [m.Opened] and same[0][1].session == rollout.session  # a retried open: answered
    machine.advance(2.0)  # the next lease exchange: the backup did not reign, the primary reigns again
    assert p.reign.reigning, f"seed={seed}: {p.reign.why_not()}"
    closed = p.handle("trainer-0", m.CloseShard(machine.new_req(), trainer.session))
    assert any(isinstance(x, m.Ack) for _, x in closed) and trainer.session not in p.sessions
    fenced = p.handle("rollout-0", m.OpenShard(machine.new_req(), "actor", "rollout-0", 1, 0, "i99", loc, False, None))
    assert any(isinstance(x, m.Opened) for _, x in fenced) and rollout.session not in p.sessions


def test_a_primary_past_its_lease_forgets_its_sessions_when_the_backup_reigned_meanwhile(seed: int) -> None:
    """The old rule where it is needed: the primary stands still long enough for its clients to
    move to the backup, which reigns. On waking, the backup's reply counts a reign the primary
    had not seen: the primary steps down under a new term, its old sessions told ``StepDown``
    and answered so from then on."""
    machine, p, b, sessions = _primary_reigning_with_every_session(seed)
    term = p.term
    machine.stall("P")
    machine.advance(3 * CONFIG.heartbeat_timeout)  # the clients move; the backup takes over
    assert b.reign.reigning and b.reign.begun == 1, f"seed={seed}: {b.reign.why_not()}"
    machine.wake("P")  # (its old sessions expire on waking here: this machine credits no stall)
    assert not p.reign.reigning and p.reign.held_since is not None
    held = set(p.sessions)  # what it holds now: the clients the backup's step-down sends back
    machine.advance(1.0)  # the next lease exchange: the backup's count changed
    assert p.reign.held_since is None and p.term == term + 1, f"seed={seed}: {p.reign.why_not()}"
    assert held <= set(p.reign.dropped) and not set(sessions) & set(p.sessions)
    assert p.reign.violations == 0 and b.reign.violations == 0


def test_a_primary_past_its_lease_forgets_when_the_backup_cannot_say_or_says_nothing(seed: int) -> None:
    """A backup of an earlier release (its replies carry no count of reigns), and a backup
    that does not answer at all within two leases: the primary cannot know, so it forgets, as
    before."""
    machine, p, _, sessions = _primary_reigning_with_every_session(seed)
    machine.backup_release = "earlier"
    term = p.term
    machine.stall("P")
    machine.advance(LEASE + 2.0)
    machine.wake("P")
    machine.advance(1.0)
    assert p.reign.held_since is None and p.term == term + 1 and set(sessions) <= set(p.reign.dropped)

    machine, p, _, sessions = _primary_reigning_with_every_session(seed)
    term = p.term
    machine.stall("P")
    machine.advance(LEASE + 2.0)
    machine.cut.update({("P", "B"), ("B", "P")})  # the backup is out of reach from now on
    machine.wake("P")
    machine.advance(LEASE)
    assert not p.reign.reigning and p.reign.held_since is not None and p.term == term  # still holding
    p.credit_stall(LEASE / 2)  # a stall of its own is not held against the backup
    machine.advance(LEASE)
    assert p.reign.held_since is not None and p.term == term
    machine.advance(LEASE / 2 + 0.5)
    assert p.reign.held_since is None and p.term == term + 1 and set(sessions) <= set(p.reign.dropped)
