"""tensorhub.ray: the reference server as a detached named Ray actor, on a real local Ray cluster.

One test (a Ray cluster takes seconds to start): get-or-create returns one actor; a trainer
actor and a rollout actor open handles with no address (they find the actor through Ray) and
replicate through it; the server actor is killed as a crash, Ray restarts it at the same
address, the handles re-announce what they hold, and the next version moves as before.
Skipped, with the reason, where Ray is not installed (the ``ray`` extra) or cannot start here.
"""

from __future__ import annotations

import gc
import os
import time
import warnings

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tensorhub[ray]')")

import tensorhub  # noqa: E402
import tensorhub.ray as thray  # noqa: E402


def _weights(v: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1 << 16,), float(v)), "b": torch.arange(5) * v}


class Worker:
    """A trainer or rollout inside a Ray actor: opens its handle with no server address."""

    def __init__(self, replica: str) -> None:
        os.environ.pop("TENSORHUB_SERVER", None)
        self.w = {k: torch.zeros_like(t) for k, t in _weights(0).items()}
        self.h = tensorhub.open("ray-model", replica, transports={"tcp": {}})
        self.h.register(self.w)

    def server_address(self) -> str | None:
        return self.h.server_address

    def publish(self, v: int) -> None:
        if self.h.version is not None:
            self.h.unpublish()
        for k, t in _weights(v).items():
            self.w[k].copy_(t)
        self.h.publish(v)

    def replicate(self) -> int:
        return self.h.replicate("latest", timeout=60)

    def update(self) -> bool:
        return self.h.update("latest", timeout=60)

    def holds(self, v: int) -> bool:
        return self.h.version == v and all(torch.equal(self.w[k], t) for k, t in _weights(v).items())

    def close(self) -> None:
        self.h.close()


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True, namespace="tensorhub-test",
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})  # fmt: skip
    except Exception as err:  # noqa: BLE001 - any failure to start means: cannot run here
        pytest.skip(f"Ray cannot start a local cluster here: {type(err).__name__}: {err}")
    yield
    thray.kill_server()
    ray.shutdown()
    # Ray kills its node's processes without waiting for them: their Popen objects, collected
    # later during another test, warned "subprocess N is still running", which failed that test
    # (seen at load 15). Collected here, where that is known and harmless.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def test_named_server_actor_survives_a_crash(cluster):
    t0 = time.monotonic()
    address = thray.server(heartbeat_timeout=2.0)
    assert thray.server() == address  # get-or-create: the same actor
    actor = thray.get_server_actor()
    first_pid = ray.get(actor.pid.remote())

    remote = ray.remote(num_cpus=0)(Worker)
    trainer, rollout = remote.remote("trainer"), remote.remote("rollout")
    assert ray.get([trainer.server_address.remote(), rollout.server_address.remote()]) == [address, address]
    ray.get(trainer.publish.remote(1))
    assert ray.get(rollout.replicate.remote()) == 1
    assert ray.get(rollout.holds.remote(1))

    # a crash: Ray restarts the actor, at the same address; the handles re-announce
    thray.kill_server(restart=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            if ray.get(actor.pid.remote(), timeout=5) != first_pid:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "Ray did not restart the server actor"
        time.sleep(0.2)
    assert thray.server() == address
    deadline = time.monotonic() + 30
    while True:  # the handles notice the silence (2 s) and re-announce version 1
        counts = ray.get(actor.counts.remote())
        if counts.get("holders", 0) >= 2 or counts.get("sessions", 0) >= 2:
            break
        assert time.monotonic() < deadline, f"the handles did not re-announce: {counts}"
        time.sleep(0.2)
    for _ in range(100):
        try:
            ray.get(trainer.publish.remote(2))
            break
        except ray.exceptions.RayTaskError as err:  # ServerUnavailable while it reconnects
            if "ServerUnavailable" not in str(err):
                raise
            time.sleep(0.2)
    deadline = time.monotonic() + 30
    while not ray.get(rollout.update.remote()):
        assert time.monotonic() < deadline, "the rollout did not move to version 2 after the restart"
        time.sleep(0.1)
    assert ray.get(rollout.holds.remote(2))
    ray.get([trainer.close.remote(), rollout.close.remote()])
    assert time.monotonic() - t0 < 60
