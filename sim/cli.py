"""``tensorhub sim SCENARIO [--seed N] [--out DIR] [--quick]`` (and ``python -m tensorhub.sim``).

``tensorhub sim paper`` runs every paper scenario and prints, per headline result, the paper's
value, the simulated one and their ratio, flagging those more than 20 % off. ``tensorhub sim
reshard`` (not a paper scenario) prints resharding at the Perplexity write-up's shapes beside its
published times.
"""

from __future__ import annotations

import argparse
import sys
import time

from tensorhub.core.errors import TensorHubError

from .report import format_headlines, format_result, save
from .reshard import reshard
from .scenarios import SCENARIOS, run

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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = PAPER if args.scenario == "paper" else [args.scenario]
    headlines = []
    violations = 0
    try:
        for name in names:
            t0 = time.perf_counter()
            other = OTHERS.get(name)
            result = other(args.seed, quick=args.quick) if other else run(name, args.seed, quick=args.quick)
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
