"""The benchmark suite (``python -m benchmarks``): its quick mode on tiny shards for TensorHub, the
raw socket and memcpy (no Ray or Mooncake needed), its outputs, and its refusals of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def run_suite(*args: str, timeout: float = 280) -> subprocess.CompletedProcess:
    """A hang's bound (under pytest-timeout's 300 s): 120 s was hit on a loaded machine."""
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def test_quick_suite_writes_json_and_report(tmp_path: Path) -> None:
    out = run_suite("tensorhub", "socket", "memcpy", "--quick", "--size-mib", "4", "--readers", "1,2",
                    "--workloads", "64x16MiB", "--repeats", "1", "--warmup", "0", "--timeout", "60",
                    "--out", str(tmp_path), "--name", "tiny")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads((tmp_path / "tiny.json").read_text())
    assert results["params"]["parts"] == ["tensorhub", "memcpy", "socket"]
    rows = {(r["system"], r["readers"]): r for r in results["summary"]}
    assert set(rows) == {
        ("tensorhub[local]", 1),
        ("tensorhub[local]", 2),
        ("raw socket", 1),
        ("raw socket", 2),
        ("memcpy", 1),
    }
    for row in rows.values():
        assert not row["errors"], row["errors"]
        assert row["rounds"] == 1
        assert row["bytes"] == 4 << 20
        assert 0 < row["wall_s"] < 60
        assert row["aggregate_gbps"] == pytest.approx(
            row["readers"] * row["bytes"] / row["wall_s"] / 1e9
        )
        assert row["reader_rss_mib"] is not None
    th = rows[("tensorhub[local]", 2)]
    assert th["holder_rss_mib"] is not None
    assert (
        th["control"]["first_read_ms"] is not None
        and 0 <= th["control"]["outside_reads_share"] <= 1
    )
    for g in results["groups"]:
        assert (
            len(g["samples"]) == 1 and len(g["samples"][0]["reader_s"]) == g["readers"]
        )
    goals = {g["key"]: g for g in results["goals"]}
    assert (
        goals["vs_gloo"]["verdict"] == "NOT MEASURED"
        and goals["vs_ray"]["verdict"] == "NOT MEASURED"
    )
    assert (
        goals["vs_memcpy"]["verdict"] in ("PASS", "MISS")
        and goals["vs_memcpy"]["ratio"] > 0
    )
    assert goals["holder_rss"]["verdict"] in ("PASS", "MISS")
    skipped = {name for name, s in results["systems"].items() if s["skipped"]}
    assert skipped <= {"ray torch", "ray numpy", "mooncake"} or not skipped
    report = (tmp_path / "tiny.md").read_text()
    assert (
        "## Goals" in report
        and "| tensorhub[local] | 2 |" in report
        and "| raw socket | 1 |" in report
    )
    assert "NOT MEASURED" in report
    for line in report.splitlines():
        if line.startswith("![") and "](" in line:
            assert (tmp_path / line.split("](")[1].rstrip(")")).is_file()
    from benchmarks.suite import main  # the same entry point as `python -m benchmarks report`, in this process

    assert main(["report", str(tmp_path / "tiny.json"), "--name", "redrawn"]) == 0
    assert (tmp_path / "redrawn.md").read_text().split("## Plots")[0] == report.split(
        "## Plots"
    )[0]


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["bogus"], "unknown part 'bogus'"),
        (["--size-mib", "0"], "--size-mib"),
        (["--readers", "1,two"], "--readers: 'two'"),
        (["--readers", "0"], "--readers: '0'"),
        (["--workloads", "huge"], "--workloads: unknown 'huge'"),
        (
            ["--tensorhub-transports", "pigeon"],
            "--tensorhub-transports: unknown 'pigeon'",
        ),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_bad_input_is_refused_by_name(
    args: list[str], names: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from benchmarks.suite import main

    assert main([*args, "--out", str(tmp_path)]) == 2
    assert names in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_report_of_a_file_that_is_not_results(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from benchmarks.suite import main

    bad = tmp_path / "x.json"
    bad.write_text('{"a": 1}')
    assert main(["report", str(bad)]) == 2
    assert "not a suite results file" in capsys.readouterr().err
