"""The test run's time budget: after ``bash scripts/dev test``'s pytest runs, print how long the
whole suite took and its ten slowest tests (from the runs' JUnit XML reports), and fail when it
took longer than its budget, so that growth shows long before CI's limit does.

    python scripts/test_budget.py --started EPOCH_SECONDS --budget SECONDS report.xml...

Exits 1 when the suite took longer than ``--budget`` seconds (wall time since ``--started``),
2 when a report is missing or unreadable (a run that wrote none died before its end), else 0.
"""

from __future__ import annotations

import argparse
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

SLOWEST = 10


def _cases(report: Path) -> list[tuple[float, str]]:
    """(seconds, test id) of every test case of a JUnit XML report: setup, call and teardown."""
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        out.append((float(case.get("time") or 0.0), f"{case.get('classname', '?')}::{case.get('name', '?')}"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--started", type=float, required=True, help="when the first run began (seconds since the epoch)")
    parser.add_argument("--budget", type=float, required=True, help="the most seconds the whole suite may take")
    parser.add_argument("reports", nargs="+", type=Path, help="the runs' JUnit XML reports")
    args = parser.parse_args(argv)
    took = time.time() - args.started
    cases: list[tuple[float, str]] = []
    for report in args.reports:
        try:
            cases += _cases(report)
        except (OSError, ET.ParseError) as err:
            print(f"test budget: cannot read {report}: {err}", file=sys.stderr)
            return 2
    print(f"\n{SLOWEST} slowest tests (setup + call + teardown):")
    for seconds, test in sorted(cases, reverse=True)[:SLOWEST]:
        print(f"  {seconds:7.2f} s  {test}")
    print(f"{len(cases)} tests in {took:.0f} s ({took / 60:.1f} min; budget {args.budget:.0f} s)")
    if took > args.budget:
        print(f"test budget: FAILED: the suite took {took:.0f} s, over its budget of {args.budget:.0f} s "
              f"(make the slowest tests faster, or move long scenarios to benchmarks/)", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
