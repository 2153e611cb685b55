"""A rollout never loses its weights because the trainer is fast (real server, real processes).

A 2-shard trainer that retains only its latest version publishes a new version every few tens
of milliseconds. Two 2-shard rollout replicas loop ``update("latest")``, shard 1 calling a
little after shard 0 (model-parallel shards never call at the same instant), so the trainer
regularly publishes ``v+1`` after a rollout decided ``v`` and before its second shard has a
source. Without pins that race aborts the update and leaves the replica empty; with them:

- 0 aborted updates and 0 empty handles over every version;
- every rollout ends byte-identical to the trainer's last version;
- every update ends at a version at least as new as the trainer's latest published version when
  the update was called (an update never goes back in time, whatever the machine's load);
- each rollout's staleness (the trainer's latest published version minus the version it holds
  after an update) is printed: how far the trainer ran ahead during the update depends on how
  fast this machine runs the rollout, so it is not asserted.

The same run against a server whose pins expire at once (``--pin-timeout``) is the baseline:
it is printed, not asserted (whether the race is hit is up to the scheduler).
"""

from __future__ import annotations

import threading
import time

import pytest

from tensorhub.tools.admin import server_status

from .procs import RemoteError, ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VERSIONS = 12


def _run(handles, server: ServerProcess) -> dict:
    trainer = [handles("trainer", server=server.address, num_shards=2, shard_idx=i, retain="latest") for i in range(2)]
    rollouts = {
        name: [handles(name, server=server.address, num_shards=2, shard_idx=i, retain=None) for i in range(2)]
        for name in ("rollout-0", "rollout-1")
    }
    for h in [*trainer, *(s for shards in rollouts.values() for s in shards)]:
        h.call("register")
    published = [0]
    done = threading.Event()
    errors: list[BaseException] = []
    report = {name: {"aborts": 0, "empty": 0, "staleness": [], "behind_call": [], "rounds": 0} for name in rollouts}

    def train() -> None:
        try:
            for v in range(1, VERSIONS + 1):
                for t in trainer:
                    if v > 1:
                        t.send("unpublish")
                for t in trainer:
                    if v > 1:
                        t.result(60)
                    t.call("fill", v)
                for t in trainer:
                    t.send("publish", v)
                for t in trainer:
                    t.result(60)
                published[0] = v
                time.sleep(0.03)  # a training step
        except BaseException as err:  # noqa: BLE001 - reported by the test thread
            errors.append(err)
        finally:
            done.set()

    def roll(name: str) -> None:
        s0, s1 = rollouts[name]
        r = report[name]
        held_once = [False, False]
        try:
            for _ in range(2000):
                if done.is_set() and all(s.call("state")[0] == VERSIONS for s in (s0, s1)):
                    return
                at_call = published[0]
                s0.send("update", "latest", 60.0)
                time.sleep(0.02)  # shard 1 comes a little later
                s1.send("update", "latest", 60.0)
                for s in (s0, s1):
                    try:
                        s.result(90)
                    except RemoteError as err:
                        if err.kind not in ("UpdateAborted", "VersionLost"):
                            raise
                        r["aborts"] += 1
                states = [s.call("state") for s in (s0, s1)]
                # empty after having held a version: weights lost (before the first version
                # exists a rollout simply has none yet)
                r["empty"] += sum(1 for i, (_, empty) in enumerate(states) if empty and held_once[i])
                held_once = [h or not e for h, (_, e) in zip(held_once, states)]
                held = states[0][0]
                if held is not None:
                    r["staleness"].append(published[0] - held)
                    r["behind_call"].append(at_call - held)
                r["rounds"] += 1
                time.sleep(0.01)  # inference
            raise AssertionError(f"{name} did not reach version {VERSIONS} in 2000 rounds")
        except BaseException as err:  # noqa: BLE001 - reported by the test thread
            errors.append(err)

    threads = [threading.Thread(target=train, daemon=True)] + [
        threading.Thread(target=roll, args=(name,), daemon=True) for name in rollouts
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
        assert not t.is_alive(), "a loop did not finish in 240 s"
    if errors:
        raise errors[0]
    for name, shards in rollouts.items():
        report[name]["identical"] = all(s.call("holds", VERSIONS) for s in shards)
    stats = server_status(server.address).stats
    return {"rollouts": report, "server": {k: stats.get(k, 0) for k in ("pins", "redecided", "pins_expired", "offloads")}}


def _show(title: str, result: dict) -> None:
    print(f"{title} server: {result['server']}")
    for name, r in result["rollouts"].items():
        worst = max(r["staleness"], default=None)
        print(f"  {name}: {r['rounds']} rounds, {r['aborts']} aborted updates, {r['empty']} empty handles, "
              f"max staleness {worst} versions, ends identical: {r.get('identical')}")  # fmt: skip


def test_a_fast_trainer_never_leaves_a_rollout_empty(handles):
    server = ServerProcess()
    try:
        report = _run(handles, server)
    finally:
        server.stop()
    _show(f"pinned ({VERSIONS} versions):", report)
    assert report["server"]["pins"] > 0 and report["server"]["pins_expired"] == 0
    for name, r in report["rollouts"].items():
        assert r["aborts"] == 0 and r["empty"] == 0, (name, r)
        assert r["identical"], name
        # "latest" resolves on the server when shard 0 asks, after the trainer's publish of
        # ``at_call`` was acknowledged: an update that returns an older version went back in time
        assert r["behind_call"] and max(r["behind_call"]) <= 0, (name, r["behind_call"])


def test_the_same_job_without_pins_is_the_baseline(handles):
    """Pins that expire at once: the race may abort updates and leave replicas empty. Printed for
    comparison; only the final state is asserted (a later update always recovers)."""
    server = ServerProcess("--pin-timeout", "0.001")
    try:
        report = _run(handles, server)
    finally:
        server.stop()
    _show(f"pins expiring at once ({VERSIONS} versions):", report)
    for name, r in report["rollouts"].items():
        assert r["identical"], name
