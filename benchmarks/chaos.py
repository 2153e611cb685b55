"""Chaos harness: a trainer and N rollouts in real processes, real TCP pulls, a seeded schedule
of SIGKILLs, and byte-exact checks of every replica (DESIGN §5).

Workload: a trainer and ``--rollouts`` rollouts in real processes, ``--steps`` versions over
real TCP pulls, under a schedule of SIGKILLs drawn from ``--seed``.
Baseline: none (a correctness harness: no speed figure).
Goal: no corrupted replica, hang, empty handle, leak or availability violation.

Each step the trainer unpublishes version v-1, fills and publishes version v; every rollout calls
``update("latest")`` at once (they pull from the trainer and from each other: pipelined
replication, some rollouts are relays) and then checks that its tensors hold exactly the content
of the version its handle claims (deterministic from the version number, as tests/procs.py
``holds``). Meanwhile a schedule drawn from ``--seed`` (and from nothing else) SIGKILLs:

- rollouts in the middle of their update (relays that others pipeline from among them);
- the trainer between its publish and the rollouts' replication (it restarts under the same
  name, a new incarnation, re-registers and publishes the next version);
- with ``--kill-server``, the primary reference server (clients were opened with
  ``server="primary,backup"``), when the library accepts server lists.

Killed processes restart under their old names and rejoin. Every command to a worker is bounded
in time; one that runs past its bound is a HANG (its process is killed and restarted).
``update()`` raising UpdateAborted, VersionUnavailable, ServerUnavailable or a TransportError is
legitimate under chaos: those are counted by type. At the end every process closes (or is dead),
heartbeats expire, and the server must hold nothing: no sessions, holders, grants or
transactions (LEAKS). With ``--inproc-server`` the server actor runs in this process
(tests/procs.py InprocServer) so its table's counts are read directly; with a server process only
the holders are visible (a fresh handle's ``list()``).

Also checked: retained versions stay available while a live holder exists (a rollout never got
VersionUnavailable for version v while the trainer or a non-spot rollout that had completed v was
alive); and no handle is left EMPTY (``h.empty``: its tensors hold no version) after an update
returned or raised, but for a kill: a rollout SIGKILLed on purpose restarts empty until it lands
a version, and an update that raised UpdateAborted after the schedule SIGKILLed its sources (the
trainer, relays) or the server is empty as documented. Those two are counted apart, as expected.

Exit status 1 on any CORRUPTED replica, HANG, EMPTY HANDLE, LEAK, availability violation or
unexpected death of a process. ``--json PATH`` writes the summary.

    python benchmarks/chaos.py --steps 60 --seed 1
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import fork_server, start_server, stop_process, write_json  # noqa: E402

MODEL = "actor"
HEARTBEAT_INTERVAL = 0.1
HEARTBEAT_TIMEOUT = 1.0
#: errors update() may raise while processes and servers die around it (not corruption)
LEGIT_UPDATE_ERRORS = {"UpdateAborted", "VersionLost", "VersionUnavailable", "ServerUnavailable", "TransportError",
                       "ChecksumMismatch", "ConnectionFailure", "StaleGrant", "Timeout"}  # fmt: skip

#: what an UpdateAborted says when the version it moved to went away (a VersionUnavailable cause)
GONE = ("unavailable", "no holder can serve", "is gone", "lost its last complete holder")



def _version_went_away(err: tuple[str, str]) -> bool:
    kind, message = err
    return kind in ("VersionUnavailable", "VersionLost") or (kind == "UpdateAborted" and any(g in message for g in GONE))


def _mp() -> Any:
    """The fork server's context, preloading torch and the handle API once for every worker."""
    return fork_server("torch", "tensorhub.handles.api", "tests.procs", "benchmarks.chaos")


# ---- the worker process -----------------------------------------------------------------------


def _worker(conn: Any, open_kw: dict, scale: int) -> None:
    """A shard handle driven by commands over ``conn``; each answer ends with the time it was
    done (monotonic, comparable across the processes of this machine)."""
    import tensorhub
    from tensorhub.core.errors import TensorHubError
    from tests.procs import holds, weights, zeros_like_weights

    try:
        h = tensorhub.open(**open_kw)
    except TensorHubError as err:
        conn.send(("err", type(err).__name__, str(err), time.monotonic()))
        return
    except Exception as err:  # noqa: BLE001 - an unexpected error is reported, not hidden
        conn.send(("err", type(err).__name__, str(err), time.monotonic()))
        return
    conn.send(("ok", h.session, time.monotonic()))
    tensors = zeros_like_weights(0, scale)
    while True:
        try:
            cmd, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if cmd == "exit":
                h.close()
                conn.send(("ok", None, time.monotonic()))
                return
            if cmd == "register":
                value: Any = h.register(tensors)
            elif cmd == "publish":  # fill version args[0]'s content, then publish it
                for k, v in weights(args[0], 0, scale).items():
                    tensors[k].copy_(v)
                h.publish(args[0])
                value = args[0]
            elif cmd == "unpublish":
                value = h.unpublish()
            elif cmd == "update":  # update("latest"), then check the bytes of what we claim
                error = None
                moved = False
                was_empty = h.empty
                try:
                    moved = h.update("latest", timeout=args[0])
                except TensorHubError as err:
                    error = (type(err).__name__, str(err))
                version = h.version
                intact = None if version is None else holds(tensors, version, 0, scale)
                pull = h.last_pull
                sources = list(pull.sources) if (moved and pull is not None) else []
                value = {"moved": moved, "version": version, "intact": intact, "sources": sources, "error": error,
                         "empty": h.empty, "was_empty": was_empty}  # fmt: skip
            elif cmd == "list":
                value = {v: sorted(reps) for v, reps in h.list().items()}
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", value, time.monotonic()))
        except TensorHubError as err:
            conn.send(("err", type(err).__name__, str(err), time.monotonic()))


class Hang(Exception):
    pass


class Died(Exception):
    pass


class CommandError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class Worker:
    """The harness's end of one worker process; every wait is bounded."""

    def __init__(self, name: str, open_kw: dict, scale: int) -> None:
        ctx = _mp()
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, {"model": MODEL, "replica": name, **open_kw}, scale), daemon=True)
        self.proc.start()
        child.close()
        self.pending: tuple[str, float] | None = ("open", 0.0)
        self.killed_at: float | None = None

    def send(self, cmd: str, *args: Any) -> None:
        self.conn.send((cmd, args))
        self.pending = (cmd, time.monotonic())

    def poll(self) -> tuple | None:
        """The answer to the pending command if there is one now (raises Died if the process is
        gone without answering)."""
        try:
            if self.conn.poll(0):
                msg = self.conn.recv()
                self.pending = None
                return msg
        except (EOFError, OSError):
            self.pending = None
            raise Died(f"{self.name}: the process died (exit code {self.proc.exitcode})") from None
        return None

    def wait(self, bound: float) -> Any:
        """The pending command's value; raises Hang past ``bound`` s, CommandError for a
        TensorHub error, Died if the process died."""
        deadline = time.monotonic() + bound
        while True:
            try:
                ready = self.conn.poll(min(0.05, max(0.0, deadline - time.monotonic())))
            except (EOFError, OSError):
                ready = True
            if ready:
                msg = self.poll()
                assert msg is not None
                if msg[0] == "err":
                    raise CommandError(msg[1], msg[2])
                self.done_at = msg[-1]
                return msg[1]
            if time.monotonic() >= deadline:
                raise Hang(f"{self.name}: {self.pending[0] if self.pending else '?'} gave no answer in {bound:g} s")

    def call(self, cmd: str, *args: Any, bound: float) -> Any:
        self.send(cmd, *args)
        return self.wait(bound)

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.killed_at = time.monotonic()
        self.proc.join(10)
        self.conn.close()

    def exit(self, bound: float) -> bool:
        """Close the handle cleanly; False if it did not answer in time (then it is killed)."""
        ok = True
        if self.proc.is_alive():
            try:
                self.call("exit", bound=bound)
            except Hang:
                ok = False
            except (Died, CommandError, OSError, BrokenPipeError):
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(5)
        self.conn.close()
        return ok


# ---- the run ----------------------------------------------------------------------------------


@dataclass
class Summary:
    seed: int
    steps: int
    rollouts: int
    server_mode: str
    kills: Counter = field(default_factory=Counter)
    kills_total: int = 0
    updates_completed: int = 0
    updates_moved: int = 0
    update_errors: Counter = field(default_factory=Counter)
    error_samples: dict = field(default_factory=dict)  #: the first message of each update error type
    other_errors: Counter = field(default_factory=Counter)
    corrupted: list = field(default_factory=list)
    hangs: list = field(default_factory=list)
    #: updates after which the handle was empty (``h.empty``) and no kill explains it: must be none
    empty_handles: list = field(default_factory=list)
    #: updates after which the handle was empty because the rollout was SIGKILLed on purpose and
    #: restarted, and has held no version since (a restart starts empty): expected
    empty_after_own_kill: int = 0
    #: updates that raised UpdateAborted, leaving the handle empty, after the schedule SIGKILLed
    #: the processes they pulled from (the trainer, relays) or the server: expected (documented)
    empty_after_sources_killed: int = 0
    leaks: dict = field(default_factory=dict)
    availability_violations: list = field(default_factory=list)
    unexpected_deaths: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    final_counts: dict = field(default_factory=dict)
    seconds: float = 0.0

    def failed(self) -> bool:
        nothing_tested = self.steps > 0 and self.updates_completed == 0
        return bool(self.corrupted or self.hangs or self.empty_handles or self.leaks or self.availability_violations
                    or self.unexpected_deaths or nothing_tested)  # fmt: skip

    def as_json(self) -> dict:
        d = asdict(self)
        d["kills"] = dict(self.kills)
        d["update_errors"] = dict(self.update_errors)
        d["other_errors"] = dict(self.other_errors)
        d["passed"] = not self.failed()
        return d

    def text(self) -> str:
        lines = [
            f"chaos: seed={self.seed} steps={self.steps} rollouts={self.rollouts} server={self.server_mode} ({self.seconds:.1f} s)",
            f"  kills: {self.kills_total} total  " + " ".join(f"{k}={v}" for k, v in sorted(self.kills.items())),
            f"  updates completed: {self.updates_completed} (moved {self.updates_moved})",
            "  update errors: " + (" ".join(f"{k}={v}" for k, v in sorted(self.update_errors.items())) or "none"),
            "  other errors: " + (" ".join(f"{k}={v}" for k, v in sorted(self.other_errors.items())) or "none"),
            f"  CORRUPTED: {len(self.corrupted)}",
            f"  HANGS: {len(self.hangs)}",
            (f"  EMPTY HANDLES: {len(self.empty_handles)} (expected, not counted: {self.empty_after_own_kill} after the "
             f"rollout's own SIGKILL and restart, {self.empty_after_sources_killed} after UpdateAborted when its "
             "sources were SIGKILLed)"),
            f"  LEAKS: {len(self.leaks)} {self.leaks if self.leaks else ''}".rstrip(),
            f"  availability violations: {len(self.availability_violations)}",
            f"  unexpected deaths: {len(self.unexpected_deaths)}",
            f"  final server counts: {self.final_counts}",
        ]
        for kind, message in sorted(self.error_samples.items()):
            lines.append(f"    e.g. {kind}: {message}")
        for what in ("corrupted", "hangs", "empty_handles", "availability_violations", "unexpected_deaths"):
            for item in getattr(self, what)[:10]:
                lines.append(f"    {what}: {item}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        lines.append("  PASSED" if not self.failed() else f"  FAILED (rerun: --seed {self.seed})")
        return "\n".join(lines)


@dataclass
class Options:
    seed: int = 1
    steps: int = 60
    rollouts: int = 4
    kill_rate: float = 0.3  # per rollout per step
    trainer_kill_rate: float = 0.1  # per step
    kill_server: bool = False
    inproc_server: bool = False
    scale: int = 25  # about 1 MB shards
    max_rate: float = 2e6  # rollouts read at most this many bytes/s: a pull takes ~0.5 s
    update_timeout: float = 20.0
    bound: float = 40.0  # seconds any command may take before it is a HANG
    spot_last: bool = True  # the last rollout (of 3 or more) is a spot replica
    verbose: bool = False


class Chaos:
    def __init__(self, opt: Options) -> None:
        self.opt = opt
        self.rng = random.Random(opt.seed)
        mode = "inproc" if opt.inproc_server else "process"
        self.s = Summary(seed=opt.seed, steps=opt.steps, rollouts=opt.rollouts, server_mode=mode)
        self.inproc: Any = None
        self.servers: list[Any] = []  # server processes: [primary, backup]
        self.server_addr = ""
        self.trainer: Worker | None = None
        self.trainer_version: int | None = None  # what the live trainer holds (published)
        self.rollouts: dict[str, Worker | None] = {}
        self.spot: set[str] = set()
        #: rollouts SIGKILLed on purpose that have held no version since their restart
        self.restarted_empty: set[str] = set()
        self.server_kill_step: int | None = None

    def log(self, msg: str) -> None:
        if self.opt.verbose:
            print(f"[chaos {time.monotonic():.2f}] {msg}", flush=True)

    # -- setup and teardown --

    def start_servers(self) -> None:
        flags = ("--heartbeat-interval", str(HEARTBEAT_INTERVAL), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT))
        if self.opt.inproc_server:
            from tests.procs import InprocServer

            self.inproc = InprocServer(heartbeat_interval=HEARTBEAT_INTERVAL, heartbeat_timeout=HEARTBEAT_TIMEOUT)
            self.server_addr = self.inproc.address
            if self.opt.kill_server:
                self.s.notes.append("--kill-server needs server processes: no server kills with --inproc-server")
            return

        proc, addr = start_server(30, *flags, "--seed", str(self.opt.seed), echo_all=False)
        self.servers.append(proc)
        self.server_addr = addr
        if not self.opt.kill_server:
            return
        proc_b, addr_b = start_server(30, *flags, "--seed", str(self.opt.seed + 1), echo_all=False)
        self.servers.append(proc_b)
        probe = Worker("chaos-probe", {"server": f"{addr},{addr_b}", "retain": None}, self.opt.scale)
        try:
            probe.wait(30)
        except CommandError as err:
            self.s.notes.append(f"server lists are not supported ({err}): no server kills")
            return
        except (Hang, Died) as err:
            self.s.notes.append(f"server-list probe failed ({err}): no server kills")
            return
        finally:
            probe.exit(10)
        self.server_addr = f"{addr},{addr_b}"
        self.server_kill_step = self.rng.randrange(max(1, self.opt.steps // 4), max(2, 3 * self.opt.steps // 4))

    def open_kw(self, name: str) -> dict:
        kw: dict = {"server": self.server_addr}
        if name != "trainer":
            kw["transports"] = {"tcp": {"max_rate": self.opt.max_rate}}
            kw["spot"] = name in self.spot
        return kw

    def start(self, names: list[str]) -> None:
        """Start (or restart) workers under these names, in parallel: open, then register."""
        made = {n: Worker(n, self.open_kw(n), self.opt.scale) for n in names}
        for step in ("open", "register"):
            for n, w in list(made.items()):
                try:
                    if step == "register":
                        w.send("register")
                    w.wait(self.opt.bound)
                except Hang as err:
                    self.s.hangs.append(f"{step} {err}")
                    w.kill()
                    made[n] = None  # type: ignore[assignment]
                except (CommandError, Died) as err:
                    kind = err.kind if isinstance(err, CommandError) else "Died"
                    self.s.other_errors[f"{step}:{kind}"] += 1
                    self.log(f"{n}: {step} failed: {err}")
                    w.kill()
                    made[n] = None  # type: ignore[assignment]
            made = {n: w for n, w in made.items() if w is not None}
        for n in names:
            w = made.get(n)
            if n == "trainer":
                self.trainer = w
                self.trainer_version = None
            else:
                self.rollouts[n] = w

    def kill(self, name: str, kind: str) -> None:
        w = self.trainer if name == "trainer" else self.rollouts.get(name)
        if w is None:
            return
        w.kill()
        self.s.kills[kind] += 1
        self.log(f"SIGKILL {name} ({kind})")

    # -- one step --

    def publish(self, v: int) -> None:
        t = self.trainer
        if t is None:
            self.start(["trainer"])
            t = self.trainer
            if t is None:
                return
        try:
            if self.trainer_version is not None:
                t.call("unpublish", bound=self.opt.bound)
                self.trainer_version = None
            t.call("publish", v, bound=self.opt.bound)
            self.trainer_version = v
        except Hang as err:
            self.s.hangs.append(f"step {v}: trainer {err}")
            t.kill()
            self.trainer = None
        except CommandError as err:
            self.s.other_errors[f"trainer:{err.kind}"] += 1
            self.log(f"trainer: {err}")
        except Died as err:
            self.s.unexpected_deaths.append(f"step {v}: {err}")
            t.kill()
            self.trainer = None

    def step(self, v: int) -> None:
        opt = self.opt
        self.publish(v)
        published_at = time.monotonic()
        trainer_holds_v = self.trainer is not None and self.trainer_version == v
        # The schedule: drawn in a fixed order whatever happened, so a seed gives one schedule.
        window = 1.3 * self._pull_seconds()
        plan: list[tuple[float, str]] = []
        kill_trainer = self.rng.random() < opt.trainer_kill_rate
        trainer_delay = self.rng.uniform(0.0, 0.5 * window)
        if kill_trainer:
            plan.append((trainer_delay, "trainer"))
        for name in sorted(self.rollouts):
            hit = self.rng.random() < opt.kill_rate
            delay = self.rng.uniform(0.02, window)
            if hit:
                plan.append((delay, name))
        if v == self.server_kill_step:
            plan.append((self.rng.uniform(0.0, window), "server"))
        plan.sort()

        t0 = time.monotonic()
        busy: dict[str, Worker] = {}
        for name, w in sorted(self.rollouts.items()):
            if w is not None:
                w.send("update", opt.update_timeout)
                busy[name] = w
        results: dict[str, tuple[dict, float]] = {}
        killed: dict[str, float] = {}
        deliberate: dict[str, float] = {}  # what the schedule SIGKILLed while updates ran, and when
        while busy:
            now = time.monotonic()
            while plan and now - t0 >= plan[0][0]:
                _, target = plan.pop(0)
                if target == "server":
                    self.kill_server()
                    deliberate["server"] = time.monotonic()
                elif target == "trainer":
                    if self.trainer is not None:
                        self.kill("trainer", "trainer-after-publish")
                        killed["trainer"] = deliberate["trainer"] = time.monotonic()
                        self.trainer = None
                elif target in busy:  # only rollouts still in the middle of their update
                    self.kill(target, "rollout-mid-update")
                    self.restarted_empty.add(target)
                    killed[target] = deliberate[target] = time.monotonic()
                    del busy[target]
            for name, w in list(busy.items()):
                try:
                    msg = w.poll()
                except Died as err:
                    self.s.unexpected_deaths.append(f"step {v}: {err}")
                    killed[name] = time.monotonic()
                    del busy[name]
                    continue
                if msg is None:
                    if time.monotonic() - t0 > opt.bound:
                        self.s.hangs.append(f"step {v}: {name}: update gave no answer in {opt.bound:g} s")
                        w.kill()
                        killed[name] = time.monotonic()
                        del busy[name]
                    continue
                del busy[name]
                if msg[0] == "err":
                    self.s.other_errors[f"update:{msg[1]}"] += 1
                    continue
                results[name] = (msg[1], msg[-1])
            time.sleep(0.005)
        for _, target in plan:  # kills scheduled after everybody answered: trainer and server only
            if target == "server":
                self.kill_server()
            elif target == "trainer" and self.trainer is not None:
                self.kill("trainer", "trainer-after-publish")
                killed["trainer"] = time.monotonic()
                self.trainer = None

        self.check(v, results, killed, trainer_holds_v, published_at, deliberate)
        # Relays: killed rollouts that a survivor pulled from in this step.
        served = {src.split("/")[0] for res, _ in results.values() for src in res["sources"]}
        for name in killed:
            if name != "trainer" and name in served:
                self.s.kills["of-which-relays"] += 1
        restart = [n for n in killed if n != "trainer"] + [n for n, w in self.rollouts.items() if w is None and n not in killed]
        if "trainer" in killed:
            restart.append("trainer")
        for n in killed:
            if n != "trainer":
                self.rollouts[n] = None
        if restart:
            self.start(sorted(set(restart)))

    def check(self, v: int, results: dict, killed: dict, trainer_holds_v: bool, published_at: float,
              deliberate: dict | None = None) -> None:  # fmt: skip
        completed_at: dict[str, float] = {}
        for name, (res, done_at) in results.items():
            if res["error"] is None:
                self.s.updates_completed += 1
                self.s.updates_moved += bool(res["moved"])
                if res["version"] == v:
                    completed_at[name] = done_at
            else:
                self.s.update_errors[res["error"][0]] += 1
                self.s.error_samples.setdefault(res["error"][0], res["error"][1][:300])
                if res["error"][0] not in LEGIT_UPDATE_ERRORS:
                    self.s.notes.append(f"step {v}: {name}: unexpected update error {res['error']}")
            if res["version"] is not None:
                self.restarted_empty.discard(name)
            elif name in self.restarted_empty:
                self.s.empty_after_own_kill += 1
            elif res["error"] is not None and res["error"][0] in ("UpdateAborted", "VersionLost") and any(
                    t <= done_at for n, t in (deliberate or {}).items() if n != name):  # fmt: skip
                # Documented: an update that began moving and lost every holder of its version (or
                # the server) aborts and leaves the handle empty. That no live holder was left is
                # the availability check's business (below).
                self.s.empty_after_sources_killed += 1
            else:
                before = "it was empty before the call too" if res["was_empty"] else "it held a version before the call"
                outcome = f"raised {res['error'][0]}: {res['error'][1][:160]}" if res["error"] else f"returned {res['moved']}"
                self.s.empty_handles.append(f"seed {self.opt.seed} step {v}: {name}'s handle is empty after update() {outcome} "
                                            f"({before})")  # fmt: skip
            if res["version"] is not None and res["intact"] is False:
                self.s.corrupted.append(f"seed {self.opt.seed} step {v}: {name} claims version {res['version']} "
                                        f"but its bytes differ (update error: {res['error']})")  # fmt: skip
        # Availability: VersionUnavailable while a live non-spot holder of v existed.
        for name, (res, done_at) in results.items():
            err = res["error"]
            if err is None or not _version_went_away(err):
                continue
            live = []
            if trainer_holds_v and killed.get("trainer", float("inf")) > done_at:
                live.append("trainer")
            for other, at in completed_at.items():
                if other != name and other not in self.spot and at < done_at and killed.get(other, float("inf")) > done_at:
                    live.append(other)
            if live:
                self.s.availability_violations.append(
                    f"seed {self.opt.seed} step {v}: {name} got {err[0]} ({err[1][:160]}) while {live} held version {v}")

    def _pull_seconds(self) -> float:
        elements = (64 * 32 + 32 * 128 + 128 + 128 * 32 + 32) * self.opt.scale
        return 4 * elements / self.opt.max_rate

    def kill_server(self) -> None:
        if self.servers and self.servers[0].poll() is None:
            self.servers[0].kill()
            self.servers[0].wait(10)
            self.s.kills["server"] += 1
            self.log("SIGKILL the primary server")

    # -- the end --

    def finish(self) -> None:
        names = (["trainer"] if self.trainer is not None else []) + sorted(n for n, w in self.rollouts.items() if w is not None)
        for n in names:
            w = self.trainer if n == "trainer" else self.rollouts[n]
            assert w is not None
            if not w.exit(self.opt.bound):
                self.s.hangs.append(f"close: {n} gave no answer in {self.opt.bound:g} s")
        self.trainer = None
        self.rollouts = {n: None for n in self.rollouts}
        want = ("sessions", "holders", "grants", "transactions")
        if self.inproc is not None:
            deadline = time.monotonic() + 3 * HEARTBEAT_TIMEOUT + 5
            counts = self.inproc.counts()
            while time.monotonic() < deadline and any(counts[k] for k in want):
                time.sleep(0.1)
                counts = self.inproc.counts()
            self.s.final_counts = counts
            self.s.leaks = {k: counts[k] for k in want if counts[k]}
            return
        alive = [p for p in self.servers if p.poll() is None]
        if not alive:
            self.s.notes.append("no server left alive to check for leaks")
            return
        time.sleep(3 * HEARTBEAT_TIMEOUT)
        probe = Worker("chaos-leak-probe", {"server": self.server_addr, "retain": None}, self.opt.scale)
        try:
            probe.wait(30)
            listing = probe.call("list", bound=30)
        except (Hang, Died, CommandError) as err:
            self.s.notes.append(f"leak probe failed: {err}")
            listing = None
        finally:
            probe.exit(10)
        if listing is not None:
            holders = sum(len(reps) for reps in listing.values())
            self.s.final_counts = {"holders": holders}
            if holders:
                self.s.leaks = {"holders": holders, "listing": {str(k): v for k, v in listing.items()}}
        self.s.notes.append("server process mode: only holders are visible; --inproc-server checks sessions, grants and transactions too")

    def close(self) -> None:

        for w in [self.trainer, *self.rollouts.values()]:
            if w is not None:
                w.kill()
        for p in self.servers:
            stop_process(p)
        if self.inproc is not None:
            self.inproc.close()

    def run(self) -> Summary:
        t0 = time.monotonic()
        print(f"chaos: seed={self.opt.seed} steps={self.opt.steps} rollouts={self.opt.rollouts}", flush=True)
        try:
            self.start_servers()
            names = [f"rollout-{i}" for i in range(self.opt.rollouts)]
            if self.opt.spot_last and len(names) >= 3:
                self.spot.add(names[-1])
            self.start(["trainer", *names])
            for v in range(1, self.opt.steps + 1):
                self.step(v)
                self.log(f"step {v} done; kills so far {sum(self.s.kills.values())}")
            self.finish()
        finally:
            self.close()
        self.s.kills_total = sum(n for k, n in self.s.kills.items() if k != "of-which-relays")
        self.s.seconds = time.monotonic() - t0
        return self.s


def run_chaos(**kw: Any) -> Summary:
    """Run the harness with these :class:`Options`; returns the summary."""
    return Chaos(Options(**kw)).run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, action="append", help="seed of the kill schedule (repeat for several runs; default 1)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--kill-rate", type=float, default=0.3, help="chance that a rollout is killed mid-update, per step")
    p.add_argument("--trainer-kill-rate", type=float, default=0.1, help="chance that the trainer is killed after a publish, per step")
    p.add_argument("--kill-server", action="store_true", help="kill the primary server once (needs server lists)")
    p.add_argument("--inproc-server", action="store_true", help="run the server actor in this process and read its counts")
    p.add_argument("--scale", type=int, default=25, help="shard size multiplier (25: about 1 MB)")
    p.add_argument("--max-rate", type=float, default=2e6, help="bytes/s a rollout reads at most (makes kills land mid-pull)")
    p.add_argument("--json", help="write the summaries here")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    if not a.verbose:  # the workers' "source failed" warnings are the point of the exercise
        os.environ.setdefault("TENSORHUB_LOG_LEVEL", "error")
    summaries = []
    for seed in a.seed or [1]:
        s = run_chaos(seed=seed, steps=a.steps, rollouts=a.rollouts, kill_rate=a.kill_rate, trainer_kill_rate=a.trainer_kill_rate,
                      kill_server=a.kill_server, inproc_server=a.inproc_server, scale=a.scale, max_rate=a.max_rate,
                      verbose=a.verbose)  # fmt: skip
        print(s.text(), flush=True)
        summaries.append(s)
    if len(summaries) > 1:
        print(f"chaos: {len(summaries)} seeds, {sum(s.kills_total for s in summaries)} kills in all, "
              f"{sum(len(s.corrupted) for s in summaries)} corrupted, {sum(len(s.hangs) for s in summaries)} hangs, "
              f"{sum(len(s.empty_handles) for s in summaries)} empty handles, "
              f"{sum(bool(s.leaks) for s in summaries)} runs with leaks")  # fmt: skip
    if a.json:
        write_json(a.json, [s.as_json() for s in summaries], default=str)
    return 1 if any(s.failed() for s in summaries) else 0


if __name__ == "__main__":
    # Run as the importable module, so that the workers' target unpickles in the forkserver.
    from benchmarks.chaos import main as _main

    sys.exit(_main())
