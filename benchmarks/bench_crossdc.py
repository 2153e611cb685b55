"""Cross-datacenter replication on the emulated cluster (the paper's Fig. 12): trainers in dc-a,
rollouts in dc-b, every byte over ``tcp`` across the emulated links.

Workload: ``--versions`` versions from trainers in dc-a to the rollouts of dc-b of the emulated
cluster, over ``tcp``, by four modes (``p2p``, ``seeding``, ``offload``, ``deltas``).
Baseline: ``p2p`` (every rollout pulls across), and a probe's intra-dc-b pull, in the same run.
Goal: seeding moves <= 1.2 shard copies across per version; other rollouts stall <= 1.5x the
intra-datacenter pull; deltas move <= 1/20 of a full copy across (see "Goals" below).

Four ways to get each new version to the rollouts of dc-b, each with its own server and
processes on the same cluster:

- ``p2p``: the point-to-point baseline. The server runs ``--no-pipeline``: only complete holders
  serve, so every rollout pulls its copy from the trainer over the slow inter-datacenter link.
- ``seeding``: the default server. The first rollout of dc-b to ``update()`` is the seeder and
  pulls across; while it does, the others' ``update()`` returns False at once (smart skipping);
  once it holds the version they pull it inside dc-b.
- ``offload``: rollouts open with ``offload_seeding=True``. The seeder's ``update()`` returns at
  once too and a CPU copy is pulled across in the background; a later ``update()`` of every
  rollout takes the version inside dc-b (the seeder from its own CPU copy).
- ``deltas`` (issue 21): the trainer and the rollouts open with ``deltas=True``. After each
  ``publish(v)`` the trainer publishes, in the background, the sparse delta from the version
  before; when a rollout holding that version calls ``update()``, the server plans it the
  delta, pulled peer to peer (the first rollout of dc-b pulls it across, the others from it),
  applied in place and verified against v's checksums. The first version is a full pull (with
  seeding, as ``seeding``): no rollout holds a base yet.

Each rollout is a loop of "inference" (``--poll-ms``) and ``update("latest")``, as a rollout
server polls. A rollout's **stall** for a version is the time spent inside ``update()`` calls
from the previous version to this one (the calls that returned False included: that is the
time inference did not run). The trainer publishes ``--versions`` versions one after the other,
each once every rollout holds the previous one. Inter-datacenter bytes per version are read
from the server's status (``tensorhub status``: bytes of ended grants per link class) before
and after. The **intra-datacenter pull** the goals compare with is measured in the same run: a
probe rollout on a host of dc-b replicates each version alone, from a dc-b holder, after the
others hold it.

**Weights.** By default (``--dtype bfloat16 --change-fraction 0.0165``) the trainer evolves bf16
weights as an RL step at lr 1e-6 does: each version changes a seeded random 1.65 % of the
elements (the unchanged fraction ``benchmarks/bench_delta.py`` measures on a real decoder is
98.35 %), the same evolution in every mode of the run (``--seed``). A sparse delta is then int32
indices + bf16 values, 6 bytes per changed element against 2 per element: about 1/20 of a full
copy (1 / (3 x 0.0165) = 20.2) before the file's header.

**Deltas against full seeding** (``--modes seeding,deltas``, both in one run): for every version
after the first, the bytes that crossed (GB), their ratio full/deltas, each rollout's stall
(median, max), the ratio of the medians and of the maxima, and whether each rollout landed the
version through the delta (its ``last_delta``). Goals (issue 21): bytes across at most 1/20 of
full seeding's (ratio >= 20, over the later versions together), the rollouts' stall at most 1/5
(ratio of medians >= 5). The trainer announces a version when ``publish()`` returns, as a
trainer that does not wait: its publish tells the server that the delta will follow
(``Publish.delta_from``), so a rollout that polls before the delta exists is told "not yet"
rather than planned a full pull, and while the first rollout of dc-b pulls the delta across the
others are told "not yet" too and then pull it inside dc-b (smart skipping of deltas).
``--settle-deltas`` announces a version only once its delta is published (the time the trainer
waits for it is reported, ``settle``, as what deltas add to a version's latency).

Goals (the issue's): with seeding, inter-datacenter bytes per version about one copy of the
shard (checked: at most 1.2 copies), not one per rollout; rollouts other than the seeder stall
at most 1.5x an intra-datacenter pull. Bytes are checked too: every rollout's content hash must
equal the trainer's.

Control plane: the shaped links give the server's port a priority class (``Cluster(...,
priority_ports=...)``), as a production network gives its control traffic a class of service;
without it (``--no-control-priority``) every ``update()`` of dc-b waits behind the full queue of
the inter-datacenter link while the seeder fills it (tens of milliseconds each on this
kernel's plain FIFOs), and the polls alone cost about a second per version.

Latency: this kernel may lack ``sch_netem`` (``benchmarks/cluster.py netem_available``); then
the inter-datacenter link is only rate-limited, with no added delay, and the figures are for a
bandwidth-bound link (the case of the paper's Fig. 12: a 200 Gbit/s VPC NIC shared by many
flows). ``--inter-dc-delay`` adds one when the kernel can.

Usage: python benchmarks/bench_crossdc.py [--rollouts 4] [--size-mib 32] [--versions 3]
       [--modes p2p,seeding,offload,deltas] [--host-rate 400mbit] [--inter-dc-rate 100mbit]
       [--inter-dc-delay 10ms] [--poll-ms 100] [--dtype bfloat16] [--change-fraction 0.0165]
       [--seed 0] [--settle-deltas] [--json FILE] [--dag-dir DIR] [--keep-logs]
       python benchmarks/bench_crossdc.py --modes seeding,deltas --versions 5   (issue 21's figure)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cluster import Cluster, available, leftovers, netem_available
from benchmarks.cluster_jobs import MIB, SERVER_PORT, Job, JobError, publish
from benchmarks.harness import median, write_json

MODES: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "p2p": (("--no-pipeline",), {}),
    "seeding": ((), {}),
    "offload": ((), {"offload_seeding": True}),
    "deltas": ((), {"deltas": True}),
}
TRAINER_KW: dict[str, dict[str, Any]] = {"deltas": {"deltas": True}}  # the trainer's open(), per mode
BYTES_GOAL = 1.2  # inter-datacenter bytes per version, in copies of the shard, with seeding
STALL_GOAL = 1.5  # non-seeders' stall, in intra-datacenter pulls
DELTA_BYTES_GOAL = 20.0  # full seeding's bytes across over the deltas' (issue 21: <= 1/20)
DELTA_STALL_GOAL = 5.0  # full seeding's median stall over the deltas' (issue 21: <= 1/5)
UNCHANGED_LR_1E6 = 0.9835  # bench_delta.py's unchanged fraction of bf16 elements per step at lr 1e-6
GB = 1e9


def spec(rollouts: int) -> dict[str, list[str]]:
    return {"dc-a": ["ctl", "t1"], "dc-b": [*[f"b{i}" for i in range(1, rollouts + 1)], "probe"]}


def tensorhub_cli(cluster: Cluster, *args: str, timeout: float = 30.0) -> str:
    """Run ``python -m tensorhub <args>`` inside the server's host (its address exists only in
    the namespaces); its stdout.

    Raises:
        JobError: it failed or did not finish within ``timeout`` seconds.
    """
    what = f"tensorhub {args[0]}"
    proc = cluster.run("ctl", [sys.executable, "-m", "tensorhub", *args],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise JobError(f"{what} did not answer within {timeout:g} s") from None
    if proc.returncode != 0:
        raise JobError(f"{what} failed ({proc.returncode}): {err.strip()[-500:]}")
    return out


def link_bytes(cluster: Cluster, server: str) -> dict[str, int]:
    """The server's bytes per link class (``tensorhub status``)."""
    return json.loads(tensorhub_cli(cluster, "status", "--server", server))["bytes_by_link"]


def save_dag(cluster: Cluster, server: str, version: int, stem: Path) -> None:
    """The replication DAG of ``version`` as ``stem``.json and .dot (and .png where graphviz's
    ``dot`` is installed), from ``tensorhub dag``."""
    args = ["dag", "--server", server, "--model", "actor", "--version", str(version), "--json", f"{stem}.json",
            "--dot", f"{stem}.dot"]  # fmt: skip
    if shutil.which("dot"):
        args += ["--png", f"{stem}.png"]
    tensorhub_cli(cluster, *args)


def _first_source(ev: dict[str, Any]) -> str | None:
    """The replica a rollout's version came from first: the delta's source where it landed
    through a delta, else its pull's."""
    d = ev.get("delta")
    sources = d["sources"] if d and d["landed"] else ev["sources"]
    return sources[0].split("/")[0] if sources else None


def run_mode(cluster: Cluster, mode: str, rollouts: int, versions: int, size: int, *, poll_ms: int,
             chunk: int, timeout: float = 300.0, keep_logs: bool = False, dag_dir: Path | None = None,
             log: Callable[[str], None] = print, weights: Sequence[str] = (),
             settle_deltas: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """Every version of one mode; one record per (version, rollout), and the probe's pulls.
    With ``dag_dir``, the replication DAG of the last version goes there (``<mode>.json``,
    ``.dot``, ``.png``).

    Args:
        weights: worker options of the weights' evolution (``--dtype``, ``--change-fraction``,
            ``--seed``: see ``cluster_jobs``), the same for every worker (the dtype) and mode;
            none: float32, every byte changing per version.
        settle_deltas: (``deltas``) the trainer announces a version once its delta is published.

    Raises:
        JobError: a process failed or a version did not arrive within ``timeout``.
    """
    flags, open_kw = MODES[mode]
    env = {"TENSORHUB_CHUNK_BYTES": str(chunk)}
    records: list[dict[str, Any]] = []
    with Job(cluster, env=env, keep_logs=keep_logs) as job:
        srv = job.server("ctl", flags)
        hosts = [f"b{i}" for i in range(1, rollouts + 1)]
        settle = ["--settle-deltas"] if settle_deltas and mode in TRAINER_KW else []
        specs = [{"host": "t1", "role": "trainer", "replica": "trainer", "server": srv.address, "size_bytes": size,
                  "open_kw": TRAINER_KW.get(mode), "extra": [*weights, *settle]}]  # fmt: skip
        specs += [{"host": h, "role": "rollout", "replica": f"rollout-{h}", "server": srv.address, "size_bytes": size,
                   "open_kw": open_kw, "extra": ["--poll-ms", str(poll_ms), *weights]} for h in hosts]  # fmt: skip
        specs.append({"host": "probe", "role": "rollout", "replica": "probe", "server": srv.address, "size_bytes": size,
                      "extra": list(weights)})  # fmt: skip
        procs = job.workers(specs, timeout=240.0)
        trainer, rs, probe = procs[0], procs[1:-1], procs[-1]
        for v in range(1, versions + 1):
            before = link_bytes(cluster, srv.address)
            marks = {p.name: p.mark() for p in rs}
            published = publish([trainer], v)
            for p in rs:  # rollouts were idle: from now on each polls, as a rollout server would
                p.send(f"poll {v} {timeout:g}")
            deadline = time.monotonic() + timeout
            for p in rs:
                p.expect("poll-done", max(1.0, deadline - time.monotonic()), since=marks[p.name])
            pulled = job.pulled(rs, [trainer], since=marks)
            pm = probe.mark()
            probe.send(f"replicate {v}")
            alone = probe.expect("pulled", timeout, since=pm, version=v)
            after = link_bytes(cluster, srv.address)
            remote = after["remote"] - before["remote"]
            mine = [ev for ev in pulled if ev["version"] == v]
            if len(mine) != len(rs):
                raise JobError(f"{mode} v{v}: {len(mine)} of {len(rs)} rollouts reported version {v}")
            bad = [ev["replica"] for ev in [*mine, alone] if ev["hash"] != published[0]["hash"]]
            if bad:
                raise JobError(f"{mode} v{v}: content differs from the trainer's on {bad}")
            # the seeder: pulled across itself (the version, or its delta from the trainer's ring
            # of delta replicas), or from its own CPU copy (p2p: everyone pulls across)
            seeders = [ev["replica"] for ev in mine
                       if (_first_source(ev) or "").split("@d")[0] == "trainer" or _first_source(ev) == ev["replica"] + "@seed"]  # fmt: skip
            seeder = seeders[0] if mode != "p2p" and len(seeders) == 1 else None
            if mode not in ("p2p", "deltas") and seeder is None:
                raise JobError(f"{mode} v{v}: expected one seeder in dc-b, got {seeders}: {[ev['sources'] for ev in mine]}")
            for ev in mine:
                records.append({
                    "mode": mode, "version": v, "replica": ev["replica"], "stall_s": ev["stall_s"],
                    "move_s": ev["move_s"], "calls": ev["calls"], "polls_s": ev["stall_s"] - ev["move_s"],
                    "latency_s": ev["latency_s"], "sources": ev["sources"], "transports": ev["transports"],
                    "seeder": ev["replica"] == seeder, "intra_pull_s": alone["stall_s"],
                    "intra_sources": alone["sources"], "remote_bytes": remote, "size": size,
                    "delta": ev.get("delta"), "seeders": len(seeders), "changed": published[0].get("changed"),
                    "elements": published[0].get("elements"), "settle_s": published[0].get("settle_s"),
                    "delta_published": published[0].get("delta_published"),
                })  # fmt: skip
            stalls = ", ".join(f"{ev['replica'].split('-')[-1]} {ev['stall_s']:.2f}"
                               + ("" if ev.get("delta") is None else " (delta)" if ev["delta"]["landed"] else " (delta failed)")
                               for ev in mine)  # fmt: skip
            settled = published[0].get("settle_s") if published[0].get("delta_published") else None
            log(f"  {mode:8s} v{v}: stall s [{stalls}]; intra pull {alone['stall_s']:.2f} s; across {remote / size:.3f} "
                f"copies" + (f"; the trainer's delta was out {settled:.2f} s after publish()" if settled is not None else ""))  # fmt: skip
        if dag_dir is not None:
            dag_dir.mkdir(parents=True, exist_ok=True)
            save_dag(cluster, srv.address, versions, dag_dir.resolve() / mode)
    return records


def table(records: list[dict[str, Any]], rollouts: int) -> tuple[str, list[str], bool]:
    """The printed table, the PASS/FAIL lines and whether every goal was met. Per mode, medians
    over versions: the seeder's stall, the other rollouts' stall, split into the ``update()``
    that pulled (*pull*) and the calls that returned False before it (*polls*), the probe's
    intra-datacenter pull, and copies of the shard that crossed per version."""
    head = ("mode", "seeder stall", "others stall", "others pull", "others polls", "max stall", "intra pull",
            "stall/intra", "pull/intra", "across copies/v")  # fmt: skip
    lines = ["  ".join(f"{h:>12s}" if i else f"{h:9s}" for i, h in enumerate(head))]
    summary: dict[str, dict[str, float]] = {}
    for mode in MODES:
        rs = [r for r in records if r["mode"] == mode]
        if not rs:
            continue
        seeders = [r for r in rs if r["seeder"]]
        others = [r for r in rs if not r["seeder"]]
        intra = median(r["intra_pull_s"] for r in rs)
        per_version = {r["version"]: r["remote_bytes"] / r["size"] for r in rs}
        s = summary[mode] = {
            "seeder": median(r["stall_s"] for r in seeders), "others": median(r["stall_s"] for r in others),
            "pull": median(r["move_s"] for r in others), "polls": median(r["polls_s"] for r in others),
            "max": max(r["stall_s"] for r in rs), "intra": intra, "copies": median(per_version.values()),
        }  # fmt: skip
        s["ratio"] = s["others"] / intra if intra else math.nan
        s["pull_ratio"] = s["pull"] / intra if intra else math.nan
        cells = [s[k] for k in ("seeder", "others", "pull", "polls", "max", "intra", "ratio", "pull_ratio", "copies")]
        lines.append(f"{mode:9s}  " + "  ".join(f"{x:12.2f}" for x in cells))
    verdicts, ok = [], True
    for mode in ("seeding", "offload"):
        s = summary.get(mode)
        if s is None:
            continue
        good = s["copies"] <= BYTES_GOAL
        ok &= good
        verdicts.append(f"{'PASS' if good else 'FAIL'}: {mode}: {s['copies']:.2f} copies across per version "
                        f"(goal <= {BYTES_GOAL}, not one per rollout: {rollouts})")  # fmt: skip
        good = s["ratio"] <= STALL_GOAL
        ok &= good
        verdicts.append(f"{'PASS' if good else 'FAIL'}: {mode}: non-seeders stall {s['ratio']:.2f}x an intra-datacenter "
                        f"pull (goal <= {STALL_GOAL}); the pulling update() alone {s['pull_ratio']:.2f}x, the "
                        f"polls before it {s['polls']:.2f} s")  # fmt: skip
    if "p2p" in summary and "seeding" in summary:
        p, q = summary["p2p"], summary["seeding"]
        verdicts.append(f"info: p2p moved {p['copies']:.2f} copies across per version, every rollout stalling "
                        f"{p['others']:.2f} s (median); seeding: the seeder {q['seeder']:.2f} s, the others {q['others']:.2f} s")  # fmt: skip
    return "\n".join(lines), verdicts, ok


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.inf if a else math.nan


def deltas_table(records: list[dict[str, Any]]) -> tuple[str, list[str], bool]:
    """Deltas against full seeding (issue 21), version by version: the printed table, the
    PASS/MISS lines and whether both goals were met. The first version is a full pull in both
    modes and is shown apart; the goals are over the later versions together (bytes: their sums;
    stall: the medians of every rollout's stall)."""
    full = {(r["version"], r["replica"]): r for r in records if r["mode"] == "seeding"}
    delta = {(r["version"], r["replica"]): r for r in records if r["mode"] == "deltas"}
    versions = sorted({v for v, _ in full} & {v for v, _ in delta})
    if not versions:
        return "", [], True
    head = (f"{'version':10s} {'full GB':>9s} {'deltas GB':>10s} {'ratio':>7s}   {'full stall med/max s':>21s}   "
            f"{'deltas stall med/max s':>23s}   {'ratio med/max':>13s}   landed via delta")  # fmt: skip
    lines = [head]
    later_full, later_delta, fb, db, landed, total = [], [], 0, 0, 0, 0
    for v in versions:
        f = [r for (w, _), r in sorted(full.items()) if w == v]
        d = [r for (w, _), r in sorted(delta.items()) if w == v]
        fs, ds = [r["stall_s"] for r in f], [r["stall_s"] for r in d]
        got = [r for r in d if r["delta"] and r["delta"]["landed"]]
        label = f"v{v}" + (" (first)" if v == versions[0] else "")
        lines.append(f"{label:10s} {f[0]['remote_bytes'] / GB:9.4f} {d[0]['remote_bytes'] / GB:10.4f} "
                     f"{_ratio(f[0]['remote_bytes'], d[0]['remote_bytes']):7.1f}   "
                     f"{median(fs):10.2f} /{max(fs):8.2f}   {median(ds):11.2f} /{max(ds):9.2f}   "
                     f"{_ratio(median(fs), median(ds)):6.1f} /{_ratio(max(fs), max(ds)):5.1f}   "
                     f"{len(got)}/{len(d)}")  # fmt: skip
        lines.append(" " * 11 + "stalls: full [" + ", ".join(f"{r['replica'].split('-')[-1]} {r['stall_s']:.2f}" for r in f)
                     + "]; deltas [" + ", ".join(f"{r['replica'].split('-')[-1]} {r['stall_s']:.2f}"
                                                 + ("" if r["delta"] and r["delta"]["landed"] else " FULL") for r in d) + "]")  # fmt: skip
        if v == versions[0]:
            continue
        later_full += fs
        later_delta += ds
        fb += f[0]["remote_bytes"]
        db += d[0]["remote_bytes"]
        landed += len(got)
        total += len(d)
    if len(versions) < 2:
        return "\n".join(lines), ["MISS: deltas vs full seeding: no version after the first (--versions >= 2)"], False
    later = [r for r in delta.values() if r["version"] != versions[0]]
    changed = [r["changed"] / r["elements"] for r in later if r.get("changed") is not None and r.get("elements")]
    settles = [r["settle_s"] for r in later if r.get("settle_s") is not None and r.get("delta_published")]
    blobs = [r["delta"] for r in later if r["delta"]]
    b_ratio = _ratio(fb, db)
    s_ratio = _ratio(median(later_full), median(later_delta))
    m_ratio = _ratio(max(later_full), max(later_delta))
    verdicts = [
        (f"{'PASS' if b_ratio >= DELTA_BYTES_GOAL else 'MISS'}: deltas: bytes across per version {db / GB / (len(versions) - 1):.4f} GB "
        f"against full seeding's {fb / GB / (len(versions) - 1):.4f} GB: {b_ratio:.1f}x fewer (goal >= {DELTA_BYTES_GOAL:g}x)"),
        (f"{'PASS' if s_ratio >= DELTA_STALL_GOAL else 'MISS'}: deltas: rollouts' update stall, median {median(later_delta):.2f} s "
        f"against full seeding's {median(later_full):.2f} s: {s_ratio:.1f}x less (goal >= {DELTA_STALL_GOAL:g}x); "
        f"max {max(later_delta):.2f} s against {max(later_full):.2f} s: {m_ratio:.1f}x"),
        (f"{'PASS' if landed == total else 'MISS'}: deltas: {landed} of {total} rollout updates after the first version "
        "landed through a delta (the others pulled in full)"),
        "PASS: content hash of every rollout equal to the trainer's, every version, both modes",
    ]  # fmt: skip
    if changed:
        verdicts.append(f"info: elements changed per version {100 * median(changed):.2f} % (bench_delta.py at lr 1e-6: "
                        f"{100 * (1 - UNCHANGED_LR_1E6):.2f} %)")  # fmt: skip
    if blobs:
        verdicts.append(f"info: a delta blob is {median(b['bytes'] for b in blobs) / 1e6:.2f} MB, "
                        f"{median(b['bytes'] / b['full_bytes'] for b in blobs):.4f} of the shard (sparse: int32 index + value)")  # fmt: skip
        verdicts.append(f"info: in the deltas' update, pulling the delta {median(b['pull_s'] for b in blobs):.2f} s, applying "
                        f"(base check, index_copy_, verify) {median(b['apply_s'] for b in blobs):.2f} s (medians)")  # fmt: skip
    if settles:
        verdicts.append(f"info: the trainer's delta was published {median(settles):.2f} s (median, max {max(settles):.2f} s) "
                        "after publish() returned; versions were announced then (--settle-deltas)")  # fmt: skip
    ok = b_ratio >= DELTA_BYTES_GOAL and s_ratio >= DELTA_STALL_GOAL and landed == total
    return "\n".join(lines), verdicts, ok


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=4, help="rollout hosts in dc-b (one replica each)")
    ap.add_argument("--size-mib", type=float, default=32.0, help="bytes per version (one shard)")
    ap.add_argument("--versions", type=int, default=3, help="versions published per mode (repetitions)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--host-rate", default="400mbit", help="every host's egress rate")
    ap.add_argument("--inter-dc-rate", default="100mbit", help="the inter-datacenter link's rate")
    ap.add_argument("--inter-dc-delay", default=None, help="one-way delay across (needs sch_netem)")
    ap.add_argument("--poll-ms", type=int, default=100, help="a rollout's inference time between update() calls")
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="$TENSORHUB_CHUNK_BYTES")
    ap.add_argument("--timeout", type=float, default=300.0, help="per version")
    ap.add_argument("--json", default=None, help="write the records and the summary here")
    ap.add_argument("--dag-dir", default=None, help="write each mode's replication DAG of its last version here (JSON, dot, PNG)")
    ap.add_argument("--no-control-priority", action="store_true",
                    help="the server's port gets no priority class on the shaped links (its RPCs queue behind bulk bytes)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="the weights' dtype")
    ap.add_argument("--change-fraction", type=float, default=1 - UNCHANGED_LR_1E6,
                    help="elements the trainer changes per version (seeded; the same evolution in every mode)")
    ap.add_argument("--seed", type=int, default=0, help="the seed of the weights and of the elements that change")
    ap.add_argument("--settle-deltas", action="store_true",
                    help="deltas: announce a version once its delta is published, not when publish() returns")
    ap.add_argument("--keep-logs", action="store_true")
    a = ap.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes or a.rollouts < 2 or a.versions < 1:
        ap.error(f"need known modes (got {unknown or modes}), --rollouts >= 2 and --versions >= 1")
    why = available()
    if why is not None:
        print(f"skipped: the emulated cluster cannot be built here: {why}")
        return 0
    if a.inter_dc_delay and not netem_available():
        ap.error("--inter-dc-delay needs the kernel's sch_netem, which this kernel lacks")
    size = int(a.size_mib * MIB)
    delay = a.inter_dc_delay or "none (rate only)"
    print(f"cross-datacenter: trainer in dc-a, {a.rollouts} rollouts in dc-b; {size / MIB:.0f} MiB per version; "
          f"hosts {a.host_rate}, inter-datacenter {a.inter_dc_rate}, delay {delay}; poll every {a.poll_ms} ms; "
          f"{a.dtype} weights, {100 * a.change_fraction:.2f} % of elements changing per version (seed {a.seed})")  # fmt: skip
    weights = ["--dtype", a.dtype, "--change-fraction", str(a.change_fraction), "--seed", str(a.seed)]
    records: list[dict[str, Any]] = []
    with Cluster(spec(a.rollouts), host_rate=a.host_rate, inter_dc_rate=a.inter_dc_rate, inter_dc_delay=a.inter_dc_delay,
                 priority_ports=() if a.no_control_priority else (SERVER_PORT,)) as c:
        prefix = c.prefix
        for mode in modes:
            records += run_mode(c, mode, a.rollouts, a.versions, size, poll_ms=a.poll_ms, chunk=int(a.chunk_mib * MIB),
                                timeout=a.timeout, keep_logs=a.keep_logs, weights=weights,
                                settle_deltas=a.settle_deltas,
                                dag_dir=Path(a.dag_dir) if a.dag_dir else None)  # fmt: skip
    left = leftovers(prefix)
    text, verdicts, ok = table(records, a.rollouts)
    print()
    print(text)
    print()
    print("\n".join(verdicts))
    dtext, dverdicts, dok = deltas_table(records)
    if dtext:
        print()
        print("deltas against full seeding (issue 21), per version:")
        print(dtext)
        print()
        print("\n".join(dverdicts))
        verdicts += dverdicts
        ok &= dok
    if left:
        print(f"FAIL: the cluster left {left}")
        ok = False
    if a.json:
        write_json(a.json, {"args": vars(a), "records": records, "verdicts": verdicts, "ok": ok}, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
