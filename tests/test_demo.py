"""``tensorhub demo`` end to end, small: real processes, the embedded default server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from .test_embedded import _free_port, _servers_bound_to

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_runs_and_verifies_the_weights():
    address = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "TENSORHUB_EMBEDDED_ADDRESS": address}
    env.pop("TENSORHUB_SERVER", None)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "tensorhub", "demo", "--steps", "3", "--rollouts", "2", "--width", "64",
             "--layers", "1", "--quiet", "--timeout", "120"],
            env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        assert "byte for byte: ok" in out.stdout
        assert "rollout-1        v3" in out.stdout
        assert len(_servers_bound_to(address)) == 1, "the demo started exactly one embedded server"
    finally:
        for pid in _servers_bound_to(address):
            os.kill(pid, signal.SIGTERM)


def test_demo_with_chaos_kills_rollouts_and_still_verifies_the_weights():
    address = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "TENSORHUB_EMBEDDED_ADDRESS": address}
    env.pop("TENSORHUB_SERVER", None)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "tensorhub", "demo", "--steps", "40", "--rollouts", "2", "--width", "64",
             "--layers", "1", "--quiet", "--timeout", "120", "--chaos", "--seed", "5"],
            env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        assert "byte for byte: ok" in out.stdout
        kills = [line for line in out.stdout.splitlines() if "chaos:" in line and "SIGKILLed mid-run" in line]
        assert kills and not kills[0].strip().startswith("chaos: 0 "), out.stdout
    finally:
        for pid in _servers_bound_to(address):
            os.kill(pid, signal.SIGTERM)
