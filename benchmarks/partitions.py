"""Partitions, not only crashes: a Jepsen-style run on the emulated cluster (issue 23).

Workload: a trainer, relays and rollouts with a primary and a backup server on the emulated
cluster, version after version, under a seeded schedule of cuts, slow links and flaps.
Baseline: none (a correctness harness: no speed figure).
Goal: no corruption, hang, leak or split-brain moment.

Theory of operation
-------------------
One run builds a cluster (:class:`~benchmarks.cluster.Cluster`) of two datacenters: a primary
server on ``p`` and its backup on ``q`` (``--role primary --peer`` / ``--role backup``), a
trainer, relays and rollouts on the other hosts, every worker given both addresses, primary
first. The trainer publishes version after version; every relay and rollout updates to each
(``poll``). Meanwhile a seeded schedule (:func:`schedule`) injects faults, one at a time, each
for a bounded time, then heals it: a one-way cut between a worker and a server, a two-way cut, a
server cut off from its peer, a host isolated, a link slowed to a twentieth of its rate, a flap
(cut, heal, cut, heal). After every version it checks:

- **corruptions**: every replica that says it holds the version has the trainer's bytes (the
  workers hash what they pulled; the trainer prints the hash of what it published);
- **hangs**: no call ran past its bound (each replicate/update has ``--call-timeout``; a worker
  that prints nothing for longer than that plus a margin counts as hung);
- **leaks**: after the job closes cleanly, each server holds no session, holder, grant,
  transaction or wait (``tensorhub status``; retention declarations of replicas that left a
  server without closing there are kept by design, DESIGN 5.3);
- **split-brain moments**: from each server's reigns (:class:`~tensorhub.core.messages.ReignSpan`,
  one monotonic clock for every namespace), two servers that reigned at the same instant, or
  granted in overlapping intervals.

It prints the faults injected, versions completed, corruptions, hangs, leaks, split-brain
moments, and the seeds. ``python benchmarks/partitions.py --seeds 0 1 2 --faults 40``.

Invariants: every wait is bounded; the cluster tears itself down (namespaces, processes) on
every exit; nothing outside its namespaces is touched. It needs root (``available()``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cluster import Cluster, Fault, available  # noqa: E402
from benchmarks.cluster_jobs import MIB, Job, Proc  # noqa: E402
from benchmarks.harness import write_json  # noqa: E402

__all__ = ["Report", "reign_overlaps", "run", "schedule", "server_states"]

SPEC = {"dc-a": ["p", "t", "x1", "r1", "r2"], "dc-b": ["q", "x2", "r3"]}
#: short heartbeats so that a run of many faults takes minutes: loss noticed in 2 s, lease 1 s
SERVER_FLAGS = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "2.0"]
_LEAKS = ("sessions", "holders", "grants", "transactions", "waits")
KINDS = ("one-way-to-server", "one-way-from-server", "two-way", "servers-apart", "isolate", "slow", "flap")

_STATE = r"""
import json, sys
from tensorhub.tools.admin import cluster_state, server_status
out = {}
for a in sys.argv[1:]:
    try:
        cs = cluster_state(a, timeout=3.0, keys=None)
        st = server_status(a, timeout=3.0, keys=None)
        out[a] = {"term": cs.term, "reigns": [[r.term, r.start, r.end, r.first_grant, r.last_grant, r.grants] for r in cs.reigns],
                  "counts": dict(st.counts)}
    except Exception as err:
        out[a] = {"error": f"{type(err).__name__}: {err}"}
print(json.dumps(out))
"""


def server_states(cluster: Cluster, host: str, addresses: Sequence[str], timeout: float = 20.0) -> dict[str, Any]:
    """Each server's term, reigns and counts, asked from ``host``'s namespace (the servers
    listen on namespace addresses, which the root namespace does not reach)."""
    import subprocess

    proc = cluster.run(host, [sys.executable, "-c", _STATE, *addresses], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, cwd=str(Path(__file__).resolve().parent.parent))  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=5)
        return {a: {"error": "no answer"} for a in addresses}
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {a: {"error": f"unreadable: {out[-300:]} {err[-300:]}"} for a in addresses}


def reign_overlaps(states: dict[str, Any], now: float) -> list[str]:
    """Split-brain moments: two servers whose reigns overlap in time, or whose grants do."""
    spans = [(a, r) for a, s in states.items() for r in s.get("reigns", ())]
    bad = []
    for i, (a, x) in enumerate(spans):
        for b, y in spans[i + 1:]:
            if a == b:
                continue
            x_end = x[2] if x[2] is not None else now
            y_end = y[2] if y[2] is not None else now
            if x[1] < y_end and y[1] < x_end:
                bad.append(f"reigns overlap: {a} term {x[0]} [{x[1]:.3f}, {x_end:.3f}] and {b} term {y[0]} [{y[1]:.3f}, {y_end:.3f}]")
            if x[3] is not None and y[3] is not None and x[3] <= y[4] and y[3] <= x[4]:
                bad.append(f"grants overlap: {a} term {x[0]} and {b} term {y[0]}")
    return bad


def schedule(seed: int, hosts: Sequence[str], count: int, kinds: Sequence[str] = KINDS) -> list[tuple[str, tuple[str, ...], float]]:
    """A seeded fault schedule: ``count`` faults ``(kind, hosts involved, seconds held)``.
    The same seed gives the same schedule."""
    r = random.Random(seed)
    workers = [h for h in hosts if h not in ("p", "q")]
    out = []
    for _ in range(count):
        kind = r.choice(list(kinds))
        server = r.choice(["p", "q"])
        if kind in ("one-way-to-server", "one-way-from-server", "two-way"):
            picked: tuple[str, ...] = (r.choice(workers), server)
        elif kind == "servers-apart":
            picked = ("p", "q")
        elif kind == "isolate":
            picked = (r.choice([*workers, "p", "q"]),)
        elif kind == "slow":
            picked = (r.choice([*workers, "p", "q"]),)
        else:
            picked = (r.choice(workers), server)
        out.append((kind, picked, round(r.uniform(0.5, 4.0), 2)))
    return out


def inject(cluster: Cluster, kind: str, hosts: tuple[str, ...], hold: float, flap_every: float = 0.5) -> list[Fault]:
    """Put one scheduled fault in force (a flap cuts and heals in place for ``hold`` s and
    returns nothing in force); the caller heals what is returned after ``hold``."""
    if kind == "one-way-to-server":
        return [cluster.cut(hosts[0], hosts[1])]
    if kind == "one-way-from-server":
        return [cluster.cut(hosts[1], hosts[0])]
    if kind in ("two-way", "servers-apart"):
        return [cluster.cut(hosts[0], hosts[1]), cluster.cut(hosts[1], hosts[0])]
    if kind == "isolate":
        return cluster.isolate(hosts[0])
    if kind == "slow":
        return [cluster.slow(hosts[0], "20mbit")]
    end = time.monotonic() + hold  # flap
    for _ in range(64):
        if time.monotonic() >= end:
            break
        fs = [cluster.cut(hosts[0], hosts[1]), cluster.cut(hosts[1], hosts[0])]
        time.sleep(min(flap_every, max(0.0, end - time.monotonic())))
        for f in fs:
            cluster.heal(f)
        time.sleep(min(flap_every, max(0.0, end - time.monotonic())))
    return []


@dataclass
class Report:
    seed: int
    faults: int = 0
    versions: int = 0
    corruptions: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    split_brain: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)  # clean call failures by type (expected under faults)
    seconds: float = 0.0

    def line(self) -> str:
        return (f"seed {self.seed}: {self.faults} faults injected, {self.versions} versions completed, "
                f"{len(self.corruptions)} corruptions, {len(self.hangs)} hangs, {len(self.leaks)} leaks, "
                f"{len(self.split_brain)} split-brain moments, clean call failures {self.errors or '{}'}, "
                f"{self.seconds:.0f} s")  # fmt: skip


def run(seed: int, faults: int, size_bytes: int = 2 * MIB, call_timeout: float = 20.0, log: Any = print) -> Report:
    """One seeded run of ``faults`` faults (see the module docstring); returns what it found."""
    rep = Report(seed)
    t0 = time.monotonic()
    plan = schedule(seed, [h for hosts in SPEC.values() for h in hosts], faults)
    with Cluster(SPEC, host_rate="400mbit", inter_dc_rate="100mbit", priority_ports=(5557,)) as c:
        with Job(c, env={"TENSORHUB_FAILOVER_TIMEOUT": "600"}) as job:
            backup = job.server("q", [*SERVER_FLAGS, "--role", "backup"], name="backup")
            primary = job.server("p", [*SERVER_FLAGS, "--role", "primary", "--peer", backup.address], name="primary")
            servers = f"{primary.address},{backup.address}"
            extra = ["--call-timeout", str(call_timeout), "--poll-ms", "100"]
            kw = {"server": servers, "size_bytes": size_bytes, "extra": extra}
            trainer = job.worker("t", "trainer", "trainer", **kw)
            readers = job.workers([{"host": h, "role": "rollout", "replica": f"{'relay' if h.startswith('x') else 'rollout'}-{h}", **kw}
                                   for h in ("x1", "x2", "r1", "r2", "r3")])  # fmt: skip
            hashes: dict[int, str] = {}
            version = 0
            for kind, hosts, hold in plan:
                version += 1
                published = _publish(trainer, version, call_timeout, rep)
                if published is not None:
                    hashes[version] = published
                marks = {r.name: r.mark() for r in readers}
                for r in readers:
                    r.send(f"poll {version} {call_timeout}")
                in_force = inject(c, kind, hosts, hold)
                rep.faults += 1
                log(f"  fault {rep.faults}: {kind} {' '.join(hosts)} for {hold:.1f} s (version {version})")
                time.sleep(hold if in_force else 0.0)
                for f in in_force:
                    c.heal(f)
                complete = published is not None
                for r in readers:
                    got = _poll_done(r, marks[r.name], call_timeout, rep)
                    complete = complete and got is not None and got >= version
                    _check_pulls(r, marks[r.name], hashes, rep)
                rep.versions += complete
                now = time.monotonic()
                states = server_states(c, "t", [primary.address, backup.address])
                for moment in reign_overlaps(states, now):
                    if moment not in rep.split_brain:
                        rep.split_brain.append(moment)
            job.stop([trainer, *readers])
            time.sleep(3.5)  # past the heartbeat timeout: a session left behind on the other server expires
            states = server_states(c, "t", [primary.address, backup.address])
            for a, s in states.items():
                counts = s.get("counts") or {}
                # retention declarations (and their model) outlive replicas that did not close
                # there (they moved away: to that server, a crash), by design (DESIGN 5.3)
                left = {k: v for k, v in counts.items() if v and k in _LEAKS}
                if left:
                    rep.leaks.append(f"{a}: {left}")
            for moment in reign_overlaps(states, time.monotonic()):
                if moment not in rep.split_brain:
                    rep.split_brain.append(moment)
            for srv in (primary, backup):
                if not srv.alive:
                    rep.hangs.append(f"server {srv.name} died: {srv.tail(5)}")
    rep.seconds = time.monotonic() - t0
    return rep


def _publish(trainer: Proc, version: int, timeout: float, rep: Report) -> str | None:
    mark = trainer.mark()
    trainer.send(f"publish {version}")
    try:
        ev = trainer.wait_event(lambda e: e.get("event") in ("published", "error"), timeout + 10, f"publish {version}", since=mark)
    except Exception as err:  # noqa: BLE001 - a bounded wait that ran out is a hang
        rep.hangs.append(f"trainer publish {version}: {err}")
        return None
    if ev["event"] == "error":
        rep.errors[ev.get("type", "?")] = rep.errors.get(ev.get("type", "?"), 0) + 1
        return None
    return str(ev["hash"])


def _poll_done(r: Proc, mark: int, timeout: float, rep: Report) -> int | None:
    try:
        ev = r.wait_event(lambda e: e.get("event") in ("poll-done", "error"), 2 * timeout + 15, "poll-done", since=mark,
                          errors=False)  # fmt: skip
    except Exception as err:  # noqa: BLE001
        rep.hangs.append(f"{r.name}: {err}")
        return None
    for e in r.events[mark:]:
        if e.get("event") == "error":
            rep.errors[e.get("type", "?")] = rep.errors.get(e.get("type", "?"), 0) + 1
    if ev["event"] == "error":  # a clean failure (counted above); what it holds is asked next time
        return None
    held = ev.get("held")
    return int(held) if held is not None else None


def _check_pulls(r: Proc, mark: int, hashes: dict[int, str], rep: Report) -> None:
    for e in r.events[mark:]:
        if e.get("event") == "pulled" and e.get("hash") is not None:
            want = hashes.get(e["version"])
            if want is not None and e["hash"] != want:
                rep.corruptions.append(f"{r.name} version {e['version']}: {e['hash'][:12]} != trainer's {want[:12]}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--faults", type=int, default=35, help="faults per seed")
    parser.add_argument("--size-mib", type=float, default=2.0)
    parser.add_argument("--call-timeout", type=float, default=20.0)
    parser.add_argument("--json", type=Path, help="also write every seed's report here")
    args = parser.parse_args(argv)
    reason = available()
    if reason:
        print(f"cannot build an emulated cluster here: {reason}", file=sys.stderr)
        return 2
    reports = []
    for seed in args.seeds:
        print(f"seed {seed}: schedule {schedule(seed, [h for hs in SPEC.values() for h in hs], args.faults)[:3]} ...", flush=True)
        rep = run(seed, args.faults, int(args.size_mib * MIB), args.call_timeout, log=lambda s: print(s, flush=True))
        print(rep.line(), flush=True)
        for what in ("corruptions", "hangs", "leaks", "split_brain"):
            for x in getattr(rep, what)[:5]:
                print(f"  {what}: {x}")
        reports.append(rep)
    total = {k: sum(len(getattr(r, k)) for r in reports) for k in ("corruptions", "hangs", "leaks", "split_brain")}
    print(f"total: {sum(r.faults for r in reports)} faults injected, {sum(r.versions for r in reports)} versions completed, "
          f"{total['corruptions']} corruptions, {total['hangs']} hangs, {total['leaks']} leaks, "
          f"{total['split_brain']} split-brain moments; seeds {args.seeds}")  # fmt: skip
    if args.json:
        write_json(args.json, {"seeds": args.seeds, "total": total, "reports": [asdict(r) for r in reports]})
    return 0 if not any(total.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
