"""The files in examples/ run as the README says: each as its own process, on a fresh embedded
default server, to a zero exit status and the line that says it did what it shows."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from .test_embedded import _free_port, _servers_bound_to

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

#: example -> (its arguments, a line its output must contain)
RUNS = {
    "colocated_trainer.py": (["--steps", "3"], "eval-0 rank 1: pulled v0, v1, v2, each byte for byte"),
    "rollout_worker.py": (["--steps", "3"], "rollout-1 holds v2, the trainer's last version, byte for byte"),
    "async_rollout.py": (["--steps", "3"], "holds v2, the trainer's last, byte for byte"),
    "custom_transport.py": ([], "conformance checks passed or skipped"),
}


#: examples with a test of their own below
OWN_TESTS = ["rl_loop.py"]


def test_every_example_is_run_here() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted([*RUNS, *OWN_TESTS])


def _run(name: str, args: list[str], timeout: float = 280) -> subprocess.CompletedProcess[str]:
    """Run an example on a fresh embedded default server, stopped afterwards. The bound is a
    hang's (under pytest-timeout's 300 s): 180 s was hit on a loaded machine."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "TENSORHUB_EMBEDDED_ADDRESS": address}
    env.pop("TENSORHUB_SERVER", None)
    try:
        out = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env, capture_output=True, text=True,
                             timeout=timeout, check=False)  # fmt: skip
    finally:
        for pid in _servers_bound_to(address):  # the embedded server it started
            os.kill(pid, signal.SIGTERM)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return out


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs(name: str) -> None:
    args, expected = RUNS[name]
    out = _run(name, args)
    assert expected in out.stdout, out.stdout + out.stderr


@pytest.mark.timeout(300)
def test_rl_loop_prints_reward_and_pause_per_step_and_draws_them(tmp_path: Path, seed: int) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")
    png = tmp_path / "rl.png"
    steps = 4  # off-policy by one step and the reward line show from the third step on
    args = [
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--rollouts",
        "2",
        "--prompts",
        "2",
        "--group",
        "4",
        "--out",
        str(png),
    ]
    out = _run("rl_loop.py", args, timeout=280)  # a hang's bound: about 50 s idle, 120 s was hit beside two busy loops
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == steps, out.stdout
    for step, line in enumerate(lines):
        # each worker's version is the trainer's or the one before (off-policy by at most one step)
        used = [int(v) for v in re.findall(r"rollout-[01] v(\d+) pause +\d+\.\d+ ms", line)]
        assert len(used) == 2 and all(max(0, step - 1) <= v <= step for v in used), line
        assert re.search(r"reward [01]\.\d{3}", line), line
    assert re.search(rf"reward: first {steps} steps \d\.\d{{3}} -> last {steps} steps \d\.\d{{3}}", out.stdout), out.stdout
    assert "sync pause (flip) per batch" in out.stdout, out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rl_loop_draws_without_matplotlib(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("rl_loop", EXAMPLES / "rl_loop.py")
    assert spec is not None and spec.loader is not None
    rl_loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rl_loop)
    png = tmp_path / "plain.png"
    rl_loop._plain_png(png, [0.1, 0.2, 0.5, 0.4], [[1.0, 3.0, 2.0, 0.5], [2.0, 1.0, 4.0, 1.5]])
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat_len = struct.unpack(">I", data[33:37])[0]
    assert data[37:41] == b"IDAT"
    raw = zlib.decompress(data[41 : 41 + idat_len])
    assert len(raw) == height * (1 + 3 * width)
    pixels = b"".join(raw[y * (1 + 3 * width) + 1 : (y + 1) * (1 + 3 * width)] for y in range(height))
    assert set(pixels) != {0xFF}  # something was drawn on the white
