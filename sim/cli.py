"""``tensorhub sim SCENARIO [--seed N] [--out DIR] [--quick]`` (and ``python -m tensorhub.sim``).

``tensorhub sim paper`` runs every paper scenario and prints, per headline result, the paper's
value, the simulated one and their ratio, flagging those more than 20 % off. ``tensorhub sim
reshard`` (not a paper scenario) prints resharding at the Perplexity write-up's shapes beside its
published times.

``tensorhub sim crossdc --deltas`` prints, after the paper's Fig. 12 (unchanged), the paper's 1T
case version after version with full seeding and with deltas side by side (issue 21;
:mod:`tensorhub.sim.deltas`): the delta's size is the encoding rule's for ``--unchanged`` of
``--dtype`` (default the measured 98.35 % of bf16), or ``--delta-ratio`` x the shard.
"""

from __future__ import annotations

import argparse
import sys
import time

from tensorhub.core.errors import TensorHubError

from .deltas import MEASURED_UNCHANGED, DeltaInputs, crossdc_deltas
from .report import format_headlines, format_result, save
from .reshard import reshard
from .scenarios import MODELS, SCENARIOS, Result, run

__all__ = ["main"]

PAPER = ["bandwidth", "bursts", "failure", "standalone", "elastic", "crossdc"]
#: scenarios beside the paper's (issue 20's resharding)
OTHERS = {"reshard": reshard}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tensorhub sim",
        description="Simulate the paper's experiments with the production scheduling logic.",
    )
    p.add_argument(
        "scenario",
        choices=[*SCENARIOS, *OTHERS, "paper"],
        help="a scenario, or 'paper' for every paper scenario",
    )
    p.add_argument("--seed", type=int, default=0, help="the run's one seed (default 0)")
    p.add_argument(
        "--out", default=None, help="write <scenario>.json and <scenario>.png here"
    )
    p.add_argument("--quick", action="store_true", help="fewer points per scenario")
    d = p.add_argument_group("deltas (crossdc only; issue 21)")
    d.add_argument(
        "--deltas", action="store_true",
        help="also run the cross-datacenter case version after version, full seeding against deltas",
    )  # fmt: skip
    d.add_argument(
        "--unchanged", type=float, default=MEASURED_UNCHANGED,
        help=f"fraction of elements unchanged per version (default {MEASURED_UNCHANGED}, measured by bench_delta.py)",
    )  # fmt: skip
    d.add_argument("--dtype", default="bfloat16", help="the published weights' dtype (default bfloat16)")
    d.add_argument(
        "--delta-ratio", type=float, default=None,
        help="a delta is this fraction of the full shard (instead of --unchanged and the encoding rule)",
    )  # fmt: skip
    d.add_argument("--model", choices=list(MODELS), default="1T", help="a row of the paper's Table 3 (default 1T)")
    d.add_argument("--versions", type=int, default=3, help="versions published (default 3)")
    d.add_argument(
        "--apply-gbps", type=float, default=2000.0,
        help="GPU memory bandwidth of applying a delta, GB/s of bytes touched (default 2000)",
    )  # fmt: skip
    return p


def _delta_inputs(args: argparse.Namespace) -> DeltaInputs:
    return DeltaInputs(
        unchanged=args.unchanged, dtype=args.dtype, ratio=args.delta_ratio, apply_gbps=args.apply_gbps,
        versions=args.versions, model=args.model,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.deltas and args.scenario != "crossdc":
        parser.error("--deltas goes with the crossdc scenario")
    names = list(PAPER) if args.scenario == "paper" else [args.scenario]
    headlines = []
    violations = 0
    try:
        inputs = _delta_inputs(args) if args.deltas else None  # refused before anything runs
        if inputs is not None:
            names.append("crossdc-deltas")
        for name in names:
            t0 = time.perf_counter()
            other = OTHERS.get(name)
            result: Result
            if name == "crossdc-deltas":
                result = crossdc_deltas(args.seed, quick=args.quick, inputs=inputs)
            elif other:
                result = other(args.seed, quick=args.quick)
            else:
                result = run(name, args.seed, quick=args.quick)
            wall = time.perf_counter() - t0
            print(format_result(result))
            print(f"({wall:.1f} s wall, seed {args.seed})\n", flush=True)
            headlines += result.headlines
            violations += len(result.violations)
            if args.out:
                for path in save(result, args.out, args.seed):
                    print(f"wrote {path}")
    except TensorHubError as err:
        print(f"tensorhub sim: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    if args.scenario == "paper":
        off = [h for h in headlines if h.off]
        print("== the paper against the simulator")
        print(format_headlines(headlines))
        print(
            f"{len(headlines) - len(off)} of {len(headlines)} within 20 %; {len(off)} flagged (README: 'The simulator' says why)"
        )
    if violations:
        print(f"{violations} invariant violations (seed {args.seed})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
