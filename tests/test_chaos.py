"""A bounded run of the chaos harness (benchmarks/chaos.py): a trainer and two rollouts in worker
processes, a real server actor in this process with short heartbeats, real TCP pulls, and a
seeded schedule of SIGKILLs of rollouts mid-update (relays among them) and of the trainer after
its publish. Every replica that completes must hold exactly the version it claims, no command may
hang, and once everybody has closed or died the server must hold nothing."""

from __future__ import annotations

import pytest

from benchmarks.chaos import run_chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_chaos_kills_leave_no_corruption_no_hang_no_leak(seed):
    s = run_chaos(seed=seed, steps=12, rollouts=2, kill_rate=0.4, trainer_kill_rate=0.25, inproc_server=True, bound=30.0)
    print(s.text())
    assert s.kills_total >= 3, f"the schedule killed too little to test anything: {dict(s.kills)}"
    assert s.corrupted == [], s.corrupted
    assert s.hangs == [], s.hangs
    assert s.leaks == {}, s.leaks
    assert s.unexpected_deaths == [], s.unexpected_deaths
    assert s.availability_violations == [], s.availability_violations
    assert s.updates_completed > 0
