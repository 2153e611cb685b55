"""A bounded run of the chaos harness (benchmarks/chaos.py): a trainer and two rollouts in worker
processes, a real server actor in this process with short heartbeats, real TCP pulls, and a
seeded schedule of SIGKILLs of rollouts mid-update (relays among them) and of the trainer after
its publish. Every replica that completes must hold exactly the version it claims, no command may
hang, no handle may be left empty but by a kill, and once everybody has closed or died the server
must hold nothing. Then the harness's sorting of empty handles, on scripted update results."""

from __future__ import annotations

import json

import pytest

from benchmarks.chaos import Chaos, Options, run_chaos


@pytest.mark.integration
@pytest.mark.slow
def test_chaos_kills_leave_no_corruption_no_hang_no_empty_handle_no_leak(seed):
    s = run_chaos(seed=seed, steps=12, rollouts=2, kill_rate=0.4, trainer_kill_rate=0.25, inproc_server=True, bound=30.0)
    print(s.text())
    assert s.kills_total >= 3, f"the schedule killed too little to test anything: {dict(s.kills)}"
    assert s.corrupted == [], s.corrupted
    assert s.hangs == [], s.hangs
    assert s.empty_handles == [], s.empty_handles
    assert s.leaks == {}, s.leaks
    assert s.unexpected_deaths == [], s.unexpected_deaths
    assert s.availability_violations == [], s.availability_violations
    assert s.updates_completed > 0
    assert "  EMPTY HANDLES: 0 (expected, not counted: " in s.text()
    assert json.loads(json.dumps(s.as_json(), default=str))["empty_handles"] == []


def _result(version: int | None, error: tuple[str, str] | None = None, was_empty: bool = False) -> dict:
    return {"moved": version is not None and error is None, "version": version, "intact": version is not None,
            "sources": [], "error": error, "empty": version is None, "was_empty": was_empty}  # fmt: skip


def test_empty_handles_are_failures_unless_a_kill_explains_them():
    c = Chaos(Options(seed=7, steps=3, rollouts=3, inproc_server=True))
    gone = ("UpdateAborted", "update to version 2 aborted: no holder can serve version 2 any more")
    # Step 1: everybody lands version 1.
    c.check(1, {n: (_result(1), 1.0) for n in ("rollout-0", "rollout-1", "rollout-2")}, {}, True, 0.0, {})
    # Step 2: rollout-0 was SIGKILLed in step 1 and restarted; the trainer is killed mid-pull.
    c.restarted_empty.add("rollout-0")
    results = {
        "rollout-0": (_result(None, gone, was_empty=True), 2.0),  # its own restart: expected
        "rollout-1": (_result(None, gone), 2.0),  # its only source was killed (at 1.5): documented
        "rollout-2": (_result(None, None), 2.0),  # returned, and left the handle empty: a failure
    }
    c.check(2, results, {"trainer": 1.5}, True, 1.2, {"trainer": 1.5})
    assert c.s.empty_after_own_kill == 1
    assert c.s.empty_after_sources_killed == 1
    assert len(c.s.empty_handles) == 1 and "step 2: rollout-2's handle is empty after update() returned False" in c.s.empty_handles[0]
    assert c.s.failed() and "EMPTY HANDLES: 1 (expected, not counted: 1 after the rollout's own SIGKILL" in c.s.text()
    # Step 3: an abort with no kill behind it is a failure; the restarted rollout lands and is no longer excused.
    c.check(3, {"rollout-0": (_result(3), 3.0), "rollout-1": (_result(None, gone), 3.0)}, {}, True, 2.5, {})
    assert "rollout-0" not in c.restarted_empty and len(c.s.empty_handles) == 2
