"""Hostile input against a real server: at least 100,000 random and mutated frames while honest
clients keep publishing and replicating (see :mod:`tensorhub.testing.fuzzing`).

Workload: ``--frames`` (>= 100,000) random and mutated frames sent to a real server while honest
clients keep publishing and replicating.
Baseline: none (a robustness harness: no speed figure).
Goal: 0 internal errors, 0 honest-client errors, the server alive and answering.

    python benchmarks/fuzz_server.py                     # 100,000 frames, CURVE on, seed 20261121
    python benchmarks/fuzz_server.py --frames 200000 --seed 7 --json out.json

Prints the figures (frames sent by mutation; frames the server handled, by outcome: ok or the
typed error it answered; frames dropped before the server (over the size limit, or from a socket
without keys) and the connection events that counted them; internal errors (must be 0);
replies the server could not deliver; the honest clients' rounds and errors (must be 0);
whether the server is alive and answering) and PASS or FAIL; exits 1 on FAIL.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import write_json  # noqa: E402
from tensorhub.testing.fuzzing import run_fuzz  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=100_000, help="frames to send (default 100,000)")
    p.add_argument("--seed", type=int, default=int(os.environ.get("TENSORHUB_SEED", "20261121")))
    p.add_argument("--window", type=int, default=64, help="frames sent between reply drains")
    p.add_argument("--sockets", type=int, default=4, help="fuzzing DEALER sockets (distinct peers)")
    p.add_argument("--huge-every", type=int, default=25_000, help="one frame over the size limit every N frames (0: none)")
    p.add_argument("--max-seconds", type=float, default=1200.0, help="stop sending after this long")
    p.add_argument("--no-curve", action="store_true", help="no authentication (and so no honest clients)")
    p.add_argument("--json", default=None, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    print(f"fuzzing a real server with {args.frames:,} frames (seed {args.seed}, CURVE {'off' if args.no_curve else 'on'})",
          flush=True)  # fmt: skip
    report = run_fuzz(
        args.frames, args.seed, curve=not args.no_curve, window=args.window, sockets=args.sockets,
        huge_every=args.huge_every, max_seconds=args.max_seconds, honest_clients=not args.no_curve,
        log=lambda line: print(line, flush=True),
    )  # fmt: skip
    print("\n".join(report.lines()))
    if args.json:
        write_json(args.json, report.as_dict())
    return 0 if report.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
