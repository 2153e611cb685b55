"""The files in examples/ run as the README says: each as its own process, on a fresh embedded
default server, to a zero exit status and the line that says it did what it shows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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


def test_every_example_is_run_here() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs(name: str) -> None:
    args, expected = RUNS[name]
    address = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "TENSORHUB_EMBEDDED_ADDRESS": address}
    env.pop("TENSORHUB_SERVER", None)
    try:
        out = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env, capture_output=True, text=True,
                             timeout=180, check=False)  # fmt: skip
    finally:
        for pid in _servers_bound_to(address):  # the embedded server it started
            os.kill(pid, signal.SIGTERM)
    assert out.returncode == 0, out.stdout + out.stderr
    assert expected in out.stdout, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
