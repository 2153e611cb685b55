"""The simulator's own figures: wall time of the 1,024-GPU standalone scenario (1T model), and a
churn soak over many seeds with the table's invariants checked after every event.

Workload: the simulator's 1,024-GPU standalone scenario (1T model), then a churn soak over
``--seeds`` seeds of ``--steps`` versions each.
Baseline: none (a wall-time bound and a correctness soak, no ratio).
Goal: the scenario under 30 s of wall time; no invariant violation in the soak.

    python benchmarks/bench_sim.py [--seeds 50] [--steps 20] [--seed 0]

Prints the wall time against the 30 s goal, and per churn seed its crashes, updates and
violations (the soak must find none; a violation prints its seed, and exits 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: the harness is imported as benchmarks.harness

from benchmarks.harness import meets, verdict  # noqa: E402
from tensorhub.sim import scenarios  # noqa: E402

GOAL_S = 30.0  # wall time of the 1T standalone scenario


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=50, help="churn seeds to soak (0: skip the soak)")
    p.add_argument("--steps", type=int, default=20, help="versions published per churn run")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    r = scenarios.standalone(args.seed, models=["1T"])
    wall = time.perf_counter() - t0
    d = r.data["1T"]
    print(f"1T standalone, {d['gpus']} GPUs (TensorHub world + NCCL and UCX models): {wall:.1f} s wall "
          f"(goal <= {GOAL_S:g} s: {verdict(meets(wall, GOAL_S, higher_is_better=False))}); {r.events} events, {r.checks} invariant checks, "
          f"{len(r.violations)} violations")  # fmt: skip
    print(f"  stall per GPU: TensorHub mean {d['tensorhub_mean']:.2f} s, NCCL {d['nccl_s']:.2f} s, UCX {d['ucx_s']:.2f} s, "
          f"ideal {d['ideal']:.2f} s")  # fmt: skip
    bad = len(r.violations)

    if args.seeds:
        t0 = time.perf_counter()
        totals = {"crashes": 0, "updates": 0, "moved": 0, "errors": 0, "events": 0}
        for i in range(args.seeds):
            seed = args.seed + i
            c = scenarios.churn(seed, steps=args.steps, check_every=1)
            for k in ("crashes", "updates", "moved", "errors"):
                totals[k] += c.data[k]
            totals["events"] += c.events
            if c.violations:
                bad += len(c.violations)
                print(f"  churn seed {seed}: {len(c.violations)} violations; first: {c.violations[0]}")
        print(f"churn soak: {args.seeds} seeds x {args.steps} steps in {time.perf_counter() - t0:.1f} s: "
              f"{totals['crashes']} crashes, {totals['updates']} updates ({totals['moved']} moved, {totals['errors']} typed errors), "
              f"{totals['events']} events each followed by an invariant check, violations {bad}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
