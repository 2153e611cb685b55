"""Printing, saving and drawing scenario results (matplotlib only when drawing)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from .scenarios import Headline, Result

__all__ = ["format_headlines", "format_table", "plot", "save"]


def _cell(x: Any) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.3f}" if abs(x) < 100 else f"{x:.1f}"
    return str(x)


def format_table(columns: list[str], rows: list[list[Any]]) -> str:
    cells = [[_cell(c) for c in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
        for i, h in enumerate(columns)
    ]
    lines = [
        "  ".join(h.rjust(w) for h, w in zip(columns, widths)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def format_result(r: Result) -> str:
    out = [f"== {r.name}: {r.title}", format_table(r.columns, r.rows)]
    out += [f"  {n}" for n in r.notes]
    if r.headlines:
        out.append(format_headlines(r.headlines))
    out.append(
        f"events {r.events}, invariant checks {r.checks}, violations {len(r.violations)}, trace {r.digest[:16]}"
    )
    out += [f"  VIOLATION {v}" for v in r.violations[:20]]
    return "\n".join(out)


def format_headlines(hs: list[Headline]) -> str:
    rows = [
        [
            h.figure,
            h.what,
            h.paper,
            h.sim,
            h.ratio,
            h.role,
            "OFF >20%" if h.off else "ok",
        ]
        for h in hs
    ]
    return format_table(
        ["fig", "result", "paper", "simulated", "ratio", "role", ""], rows
    )


def to_json(r: Result) -> dict[str, Any]:
    return {
        "name": r.name,
        "title": r.title,
        "columns": r.columns,
        "rows": r.rows,
        "data": r.data,
        "headlines": [dict(vars(h), ratio=h.ratio, off=h.off) for h in r.headlines],
        "violations": r.violations,
        "digest": r.digest,
        "events": r.events,
        "invariant_checks": r.checks,
        **({"notes": r.notes} if r.notes else {}),
    }


def save(r: Result, out: str, seed: int) -> list[str]:
    """Write ``<out>/<name>.json`` and the scenario's PNG figure (when matplotlib is there);
    return the paths written."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{r.name}.json")
    with open(path, "w") as f:
        json.dump(dict(to_json(r), seed=seed), f, indent=1, default=_jsonable)
    written = [path]
    png = plot(r, os.path.join(out, f"{r.name}.png"))
    if png:
        written.append(png)
    return written


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)


def plot(r: Result, path: str) -> str | None:
    """Draw the scenario's figure to ``path``; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    d = r.data
    if r.name == "bandwidth":
        for k, v in d["series"].items():
            pts = [(x, y) for x, y in zip(d["sizes_gb"], v) if y is not None]
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=k,
                linestyle="--" if k == "ideal" else "-",
            )
        ax.set(xlabel="shard size (GB)", ylabel="transfer time (s)", yscale="log")
    elif r.name == "bursts":
        for k, v in d["total_stall"].items():
            ax.plot(
                d["groups"],
                v,
                marker="o",
                label=k.replace("_", " "),
                linestyle="--" if k == "ideal" else "-",
            )
        ax.set(xlabel="rollout groups", ylabel="total GPU stall (GPU·s)")
    elif r.name == "failure":
        ax.plot(d["fail_at"], d["b_done_at"], marker="o", label="rollout B done at")
        ax.axhline(d["no_failure"], linestyle="--", color="gray", label="no failure")
        ax.set(xlabel="A fails at (s)", ylabel="B's transfer time (s)")
    elif r.name == "standalone":
        models = [k for k in ("9B", "36B", "260B", "1T") if k in d]
        x = range(len(models))
        for j, (key, label) in enumerate(
            (
                ("nccl_total", "NCCL"),
                ("ucx_total", "UCX"),
                ("tensorhub_total", "TensorHub"),
            )
        ):
            ax.bar(
                [i + (j - 1) * 0.27 for i in x],
                [d[m][key] for m in models],
                width=0.27,
                label=label,
            )
        ax.set_xticks(list(x), models)
        ax.set(xlabel="model", ylabel="total GPU stall per step (GPU·s)", yscale="log")
    elif r.name == "elastic":
        step = d["cdf_step"]
        for key, label in (
            ("tensorhub_stall_per_gpu", "TensorHub"),
            ("ucx_stall_per_gpu", "UCX"),
        ):
            xs = sorted(d[key][step - 1])
            ax.step(
                xs,
                [(i + 1) / len(xs) for i in range(len(xs))],
                where="post",
                label=f"{label}, step {step}",
            )
        ax.set(xlabel="stall per GPU (s)", ylabel="CDF of GPUs")
    elif r.name == "crossdc":
        labels = [row[0] for row in r.rows]
        ax.barh(labels, [row[4] for row in r.rows])
        ax.set(xlabel="total GPU stall (GPU·s)")
    elif r.name == "crossdc-deltas":
        # per version, bars of GB across and of total stall, full against deltas (log scale)
        vs = [row[0] for row in r.rows]
        for j, (col, label) in enumerate(((2, "GB across, full"), (3, "GB across, deltas"),
                                          (9, "GPU·s stall, full"), (10, "GPU·s stall, deltas"))):  # fmt: skip
            ax.bar([v + (j - 1.5) * 0.2 for v in vs], [row[col] for row in r.rows], width=0.2, label=label)
        ax.set_xticks(vs, [f"v{v}" for v in vs])
        ax.set(xlabel="version", ylabel="GB across / total GPU·s", yscale="log")
    elif r.name == "reshard":
        cases = d["cases"]
        y = range(len(cases))
        ours = [c["tensorhub"]["seconds"] for c in cases]
        ax.barh([i - 0.2 for i in y], ours, height=0.4, label="TensorHub (simulated)")
        theirs = [c["published_s"] or 0.0 for c in cases]
        ax.barh([i + 0.2 for i in y], theirs, height=0.4, label="published (Perplexity)")
        ax.set_yticks(list(y), [f"{row[0]}, {row[3]}" for row in r.rows], fontsize=6)
        ax.set(xlabel="update time (s)")
    elif r.name == "churn":
        ax.bar(
            ["updates", "moved", "typed errors", "violations"],
            [d["updates"], d["moved"], d["errors"], len(r.violations)],
        )
    else:
        plt.close(fig)
        return None
    ax.set_title(r.title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
