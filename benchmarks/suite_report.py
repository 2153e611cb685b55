"""The benchmark suite's goals and report: each goal checked against the summary rows
(:func:`goals`), markdown tables (with ratios to TensorHub and the goals) and PNG plots, drawn
from the JSON that ``python -m benchmarks`` writes. It imports nothing of ``suite.py``: the suite
imports it.

``python -m benchmarks report RESULTS.json [--out DIR] [--name STEM] [--notes NOTES.md]``
redraws the report of an earlier run (without plots where matplotlib is not installed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

from benchmarks.harness import meets, pyplot, verdict
from benchmarks.harness.shards import workload_spec
from tensorhub.transports.buffers import DEFAULT_PACK_THRESHOLD

WALL_GOAL_READERS = 4
GOAL_GLOO = 0.5  # tensorhub wall / gloo broadcast wall, 4 readers, 64x16MiB
GOAL_RAY = 0.7  # tensorhub wall / ray numpy (put + get) wall, 4 readers, 64x16MiB
GOAL_MEMCPY = 0.7  # tensorhub GB/s / memcpy GB/s, one reader, 64x16MiB
GOAL_RSS_MIB = 64.0  # tensorhub holder peak RSS - RSS after allocating its tensors
GOAL_WORKLOAD = "64x16MiB"


def _f(x: Any, fmt: str = ".2f", none: str = "–") -> str:
    return none if x is None else format(x, fmt)


def write_report(
    results: dict[str, Any],
    out: Path,
    stamp: str,
    plots: bool = True,
    notes: Path | None = None,
) -> Path:
    """Write ``<stamp>.md`` (and ``<stamp>-*.png`` where matplotlib imports) into ``out``."""
    pngs: list[tuple[str, str]] = []
    plot_note = ""
    if plots:
        try:
            pngs = draw_plots(results, out, stamp)
        except ImportError as err:
            plot_note = f"(no plots: {err}; `pip install -e .[bench]`)"
    lines = render(results, pngs, plot_note)
    if notes is not None:
        lines += ["", "## Reading the figures", "", notes.read_text().strip(), ""]
    path = out / f"{stamp}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def render(
    results: dict[str, Any], pngs: list[tuple[str, str]], plot_note: str = ""
) -> list[str]:
    p, m = results["params"], results["machine"]
    th = results["tensorhub_row"]
    rows = results["summary"]
    L = [
        f"# TensorHub side by side with the alternatives ({'quick' if p['quick'] else 'full'} run)",
        "",
    ]
    L.append(f"Run {results['started']} ({results['duration_s']:.0f} s) at commit `{results.get('git')}`: "
             f"`{results['command']}`.  ")  # fmt: skip
    L.append(f"Machine: {m.get('cpus')} CPUs, {m.get('mem_gib')} GiB, Python {m.get('python')}, torch {m.get('torch')}, "
             f"ray {m.get('ray') or 'not installed'}, mooncake {m.get('mooncake') or 'not installed'}, "
             f"nixl {m.get('nixl') or 'not installed'}; {m.get('platform')}; transparent huge pages "
             f"`{m.get('thp_mode')}`, torch allocations on huge pages (THP_MEM_ALLOC_ENABLE=1, every process): "
             f"{'yes' if m.get('thp_alloc') else 'no'}.  ")  # fmt: skip
    wl = ", ".join(f"`{w}` ({v['tensors']} tensors, {v['small_tensors']} under 64 KiB, {v['bytes'] / 2**20:.0f} MiB)"
                   for w, v in results["workloads"].items())  # fmt: skip
    L.append(f"Workloads: {wl}. Readers: {', '.join(map(str, p['readers']))} processes. "
             f"{p['repeats']} timed rounds per group (+{p['warmup']} warm-up) x {p['rounds']} sweeps; figures are medians.")  # fmt: skip
    L += [
        "",
        "## Goals",
        "",
        "| goal | measured | ratio | target | verdict |",
        "|---|---|---|---|---|",
    ]
    for g in results["goals"]:
        L.append(
            f"| {g['goal']} | {g.get('measured', '–')} | {_f(g.get('ratio'))} | {g['target']:g} | **{g['verdict']}** |"
        )
    whys = [g for g in results["goals"] if g.get("why")]
    if whys:
        L.append("")
        for g in whys:
            L.append(f"- {g['verdict']} — {g['goal']}: {g['why']}.")
    for w in p["workloads"]:
        if w not in results["workloads"]:
            continue
        L += ["", f"## `{w}`", "",
              (f"Wall time until every reader holds the shard (stores: put + get + copy; TensorHub: publish + replicate "
               f"with verification); `x {th}` is this row's wall time over {th}'s with as many readers (> 1: slower than "
               f"TensorHub). RSS: peak minus RSS after allocating the tensors, over the group."),
              "",
              "| system | readers | wall s (min–max) | x " + th + " | GB/s per reader | GB/s aggregate | CPU s/GB | holder RSS MiB | reader RSS MiB | rounds |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in sorted(
            (r for r in rows if r["workload"] == w),
            key=lambda r: (r["readers"], _order(results, r["system"])),
        ):
            if "wall_s" not in r:
                L.append(
                    f"| {r['system']} | {r['readers']} | FAILED: {'; '.join(e.splitlines()[0] for e in r['errors'])[:200]} | | | | | | | |"
                )
                continue
            ref = next(
                (
                    x
                    for x in rows
                    if x["system"] == th
                    and x["workload"] == w
                    and x["readers"] == r["readers"]
                    and "wall_s" in x
                ),
                None,
            )
            rel = _f(r["wall_s"] / ref["wall_s"]) if ref else "–"
            L.append(f"| {r['system']} | {r['readers']} | {r['wall_s']:.3f} ({r['wall_min_s']:.3f}–{r['wall_max_s']:.3f}) | {rel} | "
                     f"{r['reader_gbps']:.2f} | {r['aggregate_gbps']:.2f} | {r['cpu_s_per_gb']:.2f} | {_f(r['holder_rss_mib'], '.0f')} | "
                     f"{_f(r['reader_rss_mib'], '.0f')} | {r['rounds']} |")  # fmt: skip
    ctl = [r for r in rows if r.get("control")]
    if ctl:
        L += ["", "## TensorHub: the control plane's share", "",
              ("A reader's time split by when its transport's reads were in flight: before the first read (publish, the "
               "replicate request, the grant), after the last one (the verification tail, unpacking, the completion), "
               "and the share of its time with no read in flight (control plane and bookkeeping; gaps between reads "
               "count here too). `publish` is the trainer's call."), "",
              "| system | workload | readers | publish ms | first read ms | after last read ms | no read in flight |",
              "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in sorted(ctl, key=lambda r: (r["system"], r["workload"], r["readers"])):
            c = r["control"]
            share = (
                None
                if c["outside_reads_share"] is None
                else 100 * c["outside_reads_share"]
            )
            L.append(f"| {r['system']} | {r['workload']} | {r['readers']} | {_f(c['publish_ms'], '.1f')} | {_f(c['first_read_ms'], '.1f')} | "
                     f"{_f(c['after_last_read_ms'], '.1f')} | {_f(share, '.0f')} % |")  # fmt: skip
    ray_rows = [r for r in rows if r.get("put_s") is not None]
    if ray_rows:
        L += [
            "",
            "## Ray: put and get",
            "",
            "| system | workload | readers | put s | get s (per reader) |",
            "|---|---|---:|---:|---:|",
        ]
        for r in sorted(
            ray_rows, key=lambda r: (r["system"], r["workload"], r["readers"])
        ):
            L.append(
                f"| {r['system']} | {r['workload']} | {r['readers']} | {r['put_s']:.3f} | {r['get_s']:.3f} |"
            )
    if pngs or plot_note:
        L += ["", "## Plots", ""]
        L += [f"![{title}]({name})" for title, name in pngs] or [plot_note]
    L += ["", "## Systems", "", "| system | what it does | status |", "|---|---|---|"]
    for name, s in results["systems"].items():
        L.append(
            f"| {name} | {s['describe']} | {'skipped: ' + s['skipped'] if s['skipped'] else 'measured'} |"
        )
    L += ["", ("Every system lands the bytes in the reader's preallocated torch tensors (a zero-copy view of another "
               "process's memory is copied in, and that copy is timed); every round's bytes are checked (xxh3-64 of every "
               "tensor) before it counts. Readers and holders are separate OS processes on this one machine, released together "
               "at one instant of the monotonic clock; setup (process groups, agents, registration, connections) is untimed "
               "for every system alike. See `benchmarks/suite.py`.")]  # fmt: skip
    return L


# ---- the goals -----------------------------------------------------------------------------------


def _row(rows: list[dict], system: str, workload: str, n: int) -> dict | None:
    for r in rows:
        if (
            r["system"] == system
            and r["workload"] == workload
            and r["readers"] == n
            and "wall_s" in r
        ):
            return r
    return None


def packed_bytes(spec: list) -> int:
    """Bytes of the tensors under the default pack threshold (2 MiB). A process whose transports
    do not all gather (``nixl``) keeps a second copy of them in pack buffers; one whose
    transports all do (``local``, ``tcp``) keeps its packs in place (``ShardBuffers``)."""
    sizes = {"uint8": 1, "bfloat16": 2, "float32": 4}
    return sum(
        n * sizes[d] for _, d, n in spec if n * sizes[d] < DEFAULT_PACK_THRESHOLD
    )


def goals(
    rows: list[dict], tensorhub: str, packed: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """The issue's goals, each with the measured figures, the ratio, PASS / MISS (or not
    measured, when a part did not run), and for a miss the figures that say where time went."""
    out = []
    th4 = _row(rows, tensorhub, GOAL_WORKLOAD, 4)
    th1 = _row(rows, tensorhub, GOAL_WORKLOAD, 1)

    def wall_goal(name: str, other: str, target: float) -> dict[str, Any]:
        base = _row(rows, other, GOAL_WORKLOAD, 4)
        g: dict[str, Any] = {"goal": f"{tensorhub} to 4 readers <= {target} x {other} (wall time, {GOAL_WORKLOAD})",
                             "key": name, "target": target}  # fmt: skip
        if th4 is None or base is None:
            return {
                **g,
                "verdict": "NOT MEASURED",
                "why": f"needs {tensorhub} and {other} with 4 readers in this run",
            }
        ratio = th4["wall_s"] / base["wall_s"]
        g.update(measured=f"{th4['wall_s']:.3f} s vs {base['wall_s']:.3f} s", ratio=ratio,
                 verdict=verdict(meets(ratio, target, higher_is_better=False)))  # fmt: skip
        if ratio > target:
            g["why"] = (f"off by {ratio / target:.2f}x; " + _where(th4) +
                        f"; {other}: {base['aggregate_gbps']:.2f} GB/s aggregate, {base['cpu_s_per_gb']:.2f} CPU s/GB")  # fmt: skip
        return _with_floor(g, _row(rows, FLOOR, GOAL_WORKLOAD, 4), base["wall_s"], th4)

    out.append(wall_goal("vs_gloo", "gloo broadcast", GOAL_GLOO))
    out.append(wall_goal("vs_ray", "ray numpy", GOAL_RAY))
    mem = _row(rows, "memcpy", GOAL_WORKLOAD, 1)
    g = {
        "goal": f"{tensorhub}, one reader >= {GOAL_MEMCPY} x memcpy (GB/s, {GOAL_WORKLOAD})",
        "key": "vs_memcpy",
        "target": GOAL_MEMCPY,
    }
    if th1 is None or mem is None:
        g.update(
            verdict="NOT MEASURED",
            why=f"needs {tensorhub} with 1 reader and memcpy in this run",
        )
    else:
        ratio = th1["reader_gbps"] / mem["reader_gbps"]
        g.update(measured=f"{th1['reader_gbps']:.2f} GB/s vs {mem['reader_gbps']:.2f} GB/s", ratio=ratio,
                 verdict=verdict(meets(ratio, GOAL_MEMCPY)))  # fmt: skip
        if ratio < GOAL_MEMCPY:
            g["why"] = f"off by {GOAL_MEMCPY / ratio:.2f}x; " + _where(th1)
        floor = _row(rows, FLOOR, GOAL_WORKLOAD, 1)
        if floor is not None:
            reach = floor["reader_gbps"] / mem["reader_gbps"]
            said = f"{g['why']}; " if g.get("why") else ""
            g["floor"] = reach
            g["why"] = said + (f"the verified copy (the floor of any verified design) reaches {reach:.2f}x memcpy in this run, "
                               f"{th1['cpu_s_per_gb']:.2f} against its {floor['cpu_s_per_gb']:.2f} CPU s/GB")  # fmt: skip
    out.append(g)
    ths = [
        r
        for r in rows
        if r["system"] == tensorhub and r.get("holder_rss_mib") is not None
    ]
    g = {"goal": f"{tensorhub} holder RSS beyond its registered tensors <= {GOAL_RSS_MIB:g} MiB (every group)", "key": "holder_rss",
         "target": GOAL_RSS_MIB}  # fmt: skip
    if not ths:
        g.update(verdict="NOT MEASURED", why=f"needs {tensorhub} in this run")
    else:
        worst = max(ths, key=lambda r: r["holder_rss_mib"])
        g.update(measured=f"{worst['holder_rss_mib']:.1f} MiB ({worst['workload']}, {worst['readers']} readers)",
                 ratio=worst["holder_rss_mib"] / GOAL_RSS_MIB, verdict=verdict(meets(worst["holder_rss_mib"], GOAL_RSS_MIB, higher_is_better=False)))  # fmt: skip
        if worst["holder_rss_mib"] > GOAL_RSS_MIB:
            pack_mib = (packed or {}).get(worst["workload"], 0) / (1 << 20)
            g["why"] = (f"off by {worst['holder_rss_mib'] - GOAL_RSS_MIB:.1f} MiB; the shard has ~{pack_mib:.0f} MiB of tensors "
                        "under 2 MiB, which a transport that registers memory (nixl) needs copied into pack buffers "
                        "(with transports that gather, packs stay in place)")  # fmt: skip
    out.append(g)
    return out


#: the suite's system that does only what any verified design must (``suite_systems.VerifiedCopyReader``)
FLOOR = "verified copy"


def _with_floor(g: dict[str, Any], floor: dict | None, base_wall: float, th: dict) -> dict[str, Any]:
    """A 4-reader goal with the verified copy's ratio to the same baseline, where it ran: whether
    any design that verifies every reader's copy could meet the goal on this machine."""
    if floor is None:
        return g
    reach = floor["wall_s"] / base_wall
    said = f"{g['why']}; " if g.get("why") else ""
    g["floor"] = reach
    g["why"] = said + (f"the verified copy (the floor of any verified design) takes {floor['wall_s']:.3f} s: {reach:.2f}x in this run, "
                       f"{th['cpu_s_per_gb']:.2f} against its {floor['cpu_s_per_gb']:.2f} CPU s/GB")  # fmt: skip
    return g


def _where(row: dict) -> str:
    c = row.get("control") or {}
    parts = [
        f"{row['aggregate_gbps']:.2f} GB/s aggregate",
        f"{row['cpu_s_per_gb']:.2f} CPU s/GB on {os.cpu_count()} cores",
    ]
    if c.get("first_read_ms") is not None:
        parts.append(f"first read {c['first_read_ms']:.0f} ms after the start, {c['after_last_read_ms']:.0f} ms after the "
                     f"last read, no read in flight {100 * c['outside_reads_share']:.0f} % of a reader's time")  # fmt: skip
    return "; ".join(parts)


# ---- the plots -----------------------------------------------------------------------------------


def _order(results: dict[str, Any], name: str) -> int:
    names = list(results["systems"])
    return names.index(name) if name in names else len(names)


def draw_plots(results: dict[str, Any], out: Path, stamp: str) -> list[tuple[str, str]]:
    """Three PNGs: wall time and aggregate GB/s against readers (one panel per workload), and
    RSS beyond the tensors at the largest reader count. Raises ImportError without matplotlib."""
    plt = pyplot()

    rows = [r for r in results["summary"] if "wall_s" in r]
    workloads = [
        w
        for w in results["params"]["workloads"]
        if any(r["workload"] == w for r in rows)
    ]
    names = [n for n in results["systems"] if any(r["system"] == n for r in rows)]
    made = []
    for key, title, ylabel, log in (("wall_s", "wall time until every reader has the version", "seconds", True),
                                    ("aggregate_gbps", "aggregate throughput", "GB/s (all readers)", False)):  # fmt: skip
        fig, axes = plt.subplots(
            1,
            max(1, len(workloads)),
            figsize=(5.5 * max(1, len(workloads)), 4),
            squeeze=False,
        )
        for ax, w in zip(axes[0], workloads, strict=False):
            for n in names:
                pts = sorted(
                    (r["readers"], r[key])
                    for r in rows
                    if r["system"] == n and r["workload"] == w
                )
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=n,
                            linewidth=2.5 if n == results["tensorhub_row"] else 1.2)  # fmt: skip
            ax.set_title(f"{w}")
            ax.set_xlabel("reader processes")
            ax.set_ylabel(ylabel)
            ax.set_xticks(results["params"]["readers"])
            if log:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(title)
        fig.tight_layout()
        name = f"{stamp}-{key.split('_')[0]}.png"
        fig.savefig(out / name, dpi=80)
        plt.close(fig)
        made.append((title, name))
    nmax = max(results["params"]["readers"])
    fig, axes = plt.subplots(
        1,
        max(1, len(workloads)),
        figsize=(5.5 * max(1, len(workloads)), 4),
        squeeze=False,
    )
    for ax, w in zip(axes[0], workloads, strict=False):
        sel = [
            r
            for r in rows
            if r["workload"] == w and (r["readers"] == nmax or r["system"] == "memcpy")
        ]
        sel.sort(key=lambda r: names.index(r["system"]))
        xs = range(len(sel))
        ax.bar(
            [x - 0.2 for x in xs],
            [r["holder_rss_mib"] or 0 for r in sel],
            width=0.4,
            label="holder",
        )
        ax.bar(
            [x + 0.2 for x in xs],
            [r["reader_rss_mib"] or 0 for r in sel],
            width=0.4,
            label="reader (max)",
        )
        ax.set_xticks(
            list(xs), [r["system"] for r in sel], rotation=45, ha="right", fontsize=7
        )
        ax.set_ylabel("MiB beyond the tensors")
        ax.set_title(f"{w}, {nmax} readers")
        ax.axhline(64, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3, axis="y")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("peak RSS minus RSS after allocating the tensors")
    fig.tight_layout()
    name = f"{stamp}-rss.png"
    fig.savefig(out / name, dpi=80)
    plt.close(fig)
    made.append(("peak RSS beyond the tensors", name))
    return made


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks report",
        description="redraw a suite report from its JSON",
    )
    ap.add_argument("json", type=Path)
    ap.add_argument(
        "--out",
        type=Path,
        help="folder for the markdown and PNGs (default: the JSON's)",
    )
    ap.add_argument("--name", help="file name stem (default: the JSON's)")
    ap.add_argument("--notes", type=Path, help="a markdown file appended to the report")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    try:
        results = json.loads(args.json.read_text())
    except (OSError, ValueError) as err:
        print(
            f"python -m benchmarks report: error: cannot read {str(args.json)!r}: {err}",
            file=sys.stderr,
        )
        return 2
    if (
        not isinstance(results, dict)
        or "summary" not in results
        or "goals" not in results
    ):
        print(
            f"python -m benchmarks report: error: {str(args.json)!r} is not a suite results file",
            file=sys.stderr,
        )
        return 2
    if args.notes is not None and not args.notes.is_file():
        print(
            f"python -m benchmarks report: error: --notes: no such file {str(args.notes)!r}",
            file=sys.stderr,
        )
        return 2
    p = results.get("params", {})
    specs = {w: workload_spec(w, p.get("size_mib", 1024) << 20, p.get("seed", 0)) for w in results["workloads"]}
    packed = {w: packed_bytes(spec) for w, spec in specs.items()}
    results["goals"] = goals(
        results["summary"], results["tensorhub_row"], packed
    )  # with this version's explanations
    out = args.out or args.json.parent
    out.mkdir(parents=True, exist_ok=True)
    path = write_report(
        results,
        out,
        args.name or args.json.stem,
        plots=not args.no_plots,
        notes=args.notes,
    )
    print(f"wrote {path}")
    return 0
