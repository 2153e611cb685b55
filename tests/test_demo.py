"""``tensorhub demo``: end to end, small (real processes, the embedded default server), and the
parent's bookkeeping of staleness and its checks, from scripted events (no processes)."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys

import pytest

from tensorhub.tools import demo
from tensorhub.tools.demo import MAX_STALENESS, _checks, _Progress

from .test_embedded import _free_port, _servers_bound_to


def _demo(*args: str) -> str:
    """Run ``tensorhub demo`` small on a fresh embedded address; stop the server it started."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "TENSORHUB_EMBEDDED_ADDRESS": address}
    env.pop("TENSORHUB_SERVER", None)
    # the demo's own deadline and this one are a hang's bounds (120 s was hit on a loaded machine)
    cmd = [sys.executable, "-m", "tensorhub", "demo", "--rollouts", "2", "--width", "64", "--layers", "1", "--quiet",
           "--timeout", "240", *args]  # fmt: skip
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280, check=False)
        servers = len(_servers_bound_to(address))
    finally:
        for pid in _servers_bound_to(address):
            os.kill(pid, signal.SIGTERM)
    assert out.returncode == 0, out.stdout + out.stderr
    assert servers == 1, "the demo started exactly one embedded server"
    for check in ("every rollout holds the trainer's final weights, byte for byte: ok",
                  "the loss fell (", "no update aborted, no handle left empty",
                  f"no rollout lagged the trainer by more than {MAX_STALENESS} versions at any step (max "):  # fmt: skip
        assert check in out.stdout, out.stdout
    assert "FAILED" not in out.stdout + out.stderr
    return out.stdout


def _step_rows(stdout: str, rollouts: int) -> dict[int, tuple[float, list[str]]]:
    """The per-step table: step -> (loss, each rollout's staleness cell)."""
    rows = {}
    for line in stdout.splitlines():
        m = re.fullmatch(r"\s+(\d+)\s+(\d+\.\d+)" + r"\s+(\d+\*?)" * rollouts, line)
        if m:
            rows[int(m[1])] = (float(m[2]), list(m.groups()[2:]))
    return rows


def _summary_counts(stdout: str) -> dict[str, int]:
    m = re.search(r"aborted updates (\d+), empty handles seen by rollouts (\d+); the server's counters over this run: "
                  r"re-decisions (\d+), pins (\d+), pins expired (\d+)", stdout)  # fmt: skip
    assert m, stdout
    return dict(zip(("aborted", "empty", "redecided", "pins", "pins_expired"), map(int, m.groups()), strict=True))


@pytest.mark.integration
@pytest.mark.slow
def test_demo_learns_and_keeps_every_rollout_within_the_staleness_bound():
    stdout = _demo("--steps", "3")
    assert "rollout-1        v3" in stdout
    rows = _step_rows(stdout, rollouts=2)
    assert sorted(rows) == [1, 2, 3], stdout
    assert all(int(cell) <= MAX_STALENESS for _, cells in rows.values() for cell in cells), stdout
    first, last = map(float, re.search(r"the loss fell \((\d+\.\d+) -> (\d+\.\d+)\): ok", stdout).groups())
    assert last < first and first == rows[1][0]
    counts = _summary_counts(stdout)
    assert counts["aborted"] == 0 and counts["empty"] == 0, counts
    assert counts["pins"] >= 2, "each rollout's pulls pinned their versions"  # the server's counters were read
    for r in ("rollout-0", "rollout-1"):  # the summary's max staleness column, no rollout exempt
        assert int(re.search(rf"^  {r} .* (\d+)$", stdout, re.MULTILINE)[1]) <= MAX_STALENESS


@pytest.mark.integration
@pytest.mark.slow
def test_demo_with_chaos_kills_rollouts_and_still_verifies_the_weights():
    stdout = _demo("--steps", "20", "--chaos", "--seed", "5")  # kills every 1-3 s: several in 20 steps
    kills = [line for line in stdout.splitlines() if "SIGKILLed mid-run" in line]
    assert kills and not kills[0].strip().startswith("chaos: 0 "), stdout
    assert "seeds: model 0, data 1234, chaos 5" in stdout
    rows = _step_rows(stdout, rollouts=2)
    assert sorted(rows) == list(range(1, 21)), stdout
    killed = {m[1] for m in re.finditer(r"(rollout-\d) at \d+\.\d s", kills[0])}
    exempt = "every rollout was SIGKILLed" if len(killed) == 2 else f"{', '.join(sorted(killed))}, SIGKILLed"
    assert killed and f"(not checked: {exempt})" in stdout, stdout
    for j, r in enumerate(("rollout-0", "rollout-1")):  # the bound holds for every rollout not killed
        if r not in killed:
            assert all(int(cells[j]) <= MAX_STALENESS for _, cells in rows.values()), stdout
    assert _summary_counts(stdout)["pins"] > 0


# ---- the parent's bookkeeping, from scripted events --------------------------------------------


def _published(p: _Progress, step: int, loss: float = 1.0) -> None:
    for shard in range(p.shards):
        p.on_event(("train", shard, step, loss, 0.0, 0.0))


def _pulled(p: _Progress, rollout: str, version: int, incarnation: int = 0) -> None:
    for shard in range(p.shards):
        p.on_event(("pulled", rollout, incarnation, shard, version, 0.01, 100, ["trainer/0"]))


def _finished(p: _Progress, digests: dict[int, str], final_loss: float) -> None:
    p.on_event(("eval", 0, final_loss))
    for shard, digest in digests.items():
        p.on_event(("final", "trainer", 0, shard, p.steps, digest))
        for r in p.rollouts:
            p.on_event(("final", r, p.incarnation[r], shard, p.steps, digest))


def test_staleness_is_the_most_a_rollout_was_behind_while_a_step_was_the_newest():
    p = _Progress(steps=4, shards=2, rollouts=["a", "b"])
    p.on_event(("train", 0, 1, 6.0, 0.0, 0.0))
    assert p.latest == 0, "a version is out when every trainer shard published it"
    p.on_event(("train", 1, 1, 6.0, 0.0, 0.0))
    assert p.latest == 1 and p.lag[1] == {"a": 1, "b": 1}
    _pulled(p, "a", 1)
    _published(p, 2, 3.0)
    assert p.newly_closed() == [1]
    _published(p, 3, 2.0)  # b still holds nothing: 3 behind
    _pulled(p, "a", 3)
    _pulled(p, "b", 3)
    assert p.lag[2] == {"a": 1, "b": 2} and p.lag[3] == {"a": 2, "b": 3}
    assert p.max_lag("a") == 2 and p.max_lag("b") == 3
    assert p.row(3).split() == ["3", "2.000", "2", "3"]
    _published(p, 4, 1.0)
    _finished(p, {0: "x", 1: "y"}, final_loss=0.5)
    assert p.newly_closed() == [2, 3, 4] and p.done()
    checks = {line: (ok, why) for ok, line, why in _checks(p, shards=2)}
    assert checks["every rollout holds the trainer's final weights, byte for byte"] == (True, "")
    assert checks["the loss fell (6.000 -> 0.500)"][0]
    lag_line = next(line for line in checks if line.startswith("no rollout lagged"))
    assert checks[lag_line] == (False, "b lagged 3 versions at step 3"), "a lag over the bound fails the demo, named"


def test_the_trainer_is_allowed_at_most_max_staleness_ahead_of_every_rollout_but_a_restarting_one():
    p = _Progress(steps=10, shards=1, rollouts=["a", "b"])
    assert p.allowed() == MAX_STALENESS
    _published(p, 1)
    _pulled(p, "a", 1)
    assert p.allowed() == MAX_STALENESS, "b holds nothing yet"
    _pulled(p, "b", 1)
    assert p.allowed() == 1 + MAX_STALENESS
    p.kill("b", at=1.0)
    assert p.allowed() == 1 + MAX_STALENESS and "b" in p.recovering
    _pulled(p, "b", 1)  # from the killed incarnation, arriving late: ignored
    assert p.holds("b") == 0 and "b" in p.recovering
    _published(p, 2)
    _pulled(p, "a", 2)
    assert p.allowed() == 2 + MAX_STALENESS, "a restarting rollout is not waited for"
    _pulled(p, "b", 2, incarnation=1)
    assert "b" not in p.recovering and p.cell(2, "b") == "2*"


def test_the_checks_exempt_a_killed_rollout_from_the_bounds_but_not_from_the_weights():
    p = _Progress(steps=2, shards=1, rollouts=["a", "b"])
    _published(p, 1, 5.0)
    _pulled(p, "a", 1)
    _pulled(p, "b", 1)
    p.on_event(("aborted", "b", 0, 0, "update aborted: every source died"))
    p.on_event(("empty", "b", 0, 0))
    p.kill("b", at=1.0)
    _published(p, 2, 4.0)
    _pulled(p, "a", 2)
    _pulled(p, "b", 2, incarnation=1)
    _finished(p, {0: "x"}, final_loss=4.5)
    p.finals[("b", 0)] = (2, "other bytes")
    checks = _checks(p, shards=1)
    assert [ok for ok, _, _ in checks] == [False, True, True, True], checks
    assert "b shard 0 ends with version 2 digest other bytes" in checks[0][2]
    assert checks[2][1] == "no update aborted, no handle left empty (not checked: b, SIGKILLed)"
    p.kill("a", at=2.0)
    assert "not checked: every rollout was SIGKILLed" in _checks(p, shards=1)[2][1]


def test_an_aborted_update_fails_the_demo_naming_it():
    p = _Progress(steps=1, shards=1, rollouts=["a"])
    _published(p, 1, 5.0)
    p.on_event(("aborted", "a", 0, 0, "update aborted: every source died"))
    p.on_event(("empty", "a", 0, 0))
    _pulled(p, "a", 1)
    _finished(p, {0: "x"}, final_loss=4.0)
    ok, _, why = _checks(p, shards=1)[2]
    assert not ok and why == "1 aborted updates, 1 empty handles: a/0: update aborted: every source died"


def test_the_plain_view_prints_a_row_per_step_and_works_without_rich(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich", None)  # as if it were not installed
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    p = _Progress(steps=2, shards=1, rollouts=["a"])
    view = demo._view(p, quiet=False, chaos=False)
    assert type(view) is demo._PlainView
    _published(p, 1, 6.0)
    _pulled(p, "a", 1)
    _published(p, 2, 5.0)
    view.refresh(p.newly_closed())
    view.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].split() == ["step", "loss", "a"] and lines[-1].split() == ["1", "6.000", "1"]


def test_the_rich_view_renders_the_steps_and_the_counts():
    pytest.importorskip("rich")
    from rich.console import Console

    p = _Progress(steps=3, shards=1, rollouts=["rollout-0"])
    _published(p, 1, 6.0)
    _pulled(p, "rollout-0", 1)
    _published(p, 2, 5.0)
    p.newly_closed()
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(demo._rich_view(p))
    text = console.file.getvalue()
    assert "rollout-0" in text and "6.000" in text and "1 v1" in text, text
    assert "trainer v2/3" in text and "aborted 0   empty 0" in text, text
