"""``tensorhub demo`` end to end, small: real processes, the embedded default server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from .test_embedded import _free_port, _servers_bound_to

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _demo(*args: str) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``tensorhub demo`` small on a fresh embedded address; stop the server it started."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "TENSORHUB_EMBEDDED_ADDRESS": address}
    env.pop("TENSORHUB_SERVER", None)
    cmd = [sys.executable, "-m", "tensorhub", "demo", "--rollouts", "2", "--width", "64", "--layers", "1", "--quiet",
           "--timeout", "120", *args]  # fmt: skip
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, check=False)
        servers = len(_servers_bound_to(address))
    finally:
        for pid in _servers_bound_to(address):
            os.kill(pid, signal.SIGTERM)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "byte for byte: ok" in out.stdout
    assert servers == 1, "the demo started exactly one embedded server"
    return out, out.stdout


def test_demo_runs_and_verifies_the_weights():
    _, stdout = _demo("--steps", "3")
    assert "rollout-1        v3" in stdout


def test_demo_with_chaos_kills_rollouts_and_still_verifies_the_weights():
    _, stdout = _demo("--steps", "40", "--chaos", "--seed", "5")
    kills = [line for line in stdout.splitlines() if "SIGKILLed mid-run" in line]
    assert kills and not kills[0].strip().startswith("chaos: 0 "), stdout
