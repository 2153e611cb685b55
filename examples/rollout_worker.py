"""A standalone rollout worker keeps up with a trainer (the README's second quickstart).

One script starts two processes on this machine, both on the embedded default server (the first
handle starts it; it exits a minute after the last handle closes):

- a trainer (replica ``trainer-0``, one shard) that publishes its weights every step, and
  unpublishes them before it writes them (its last copy of a retained version is offloaded to
  CPU memory first, so readers can still pull it);
- a rollout worker (replica ``rollout-1``, one shard) that pulls the first version it finds
  with ``replicate("latest")``, then calls ``update("latest")`` between "batches" until it holds
  the trainer's last version, and checks every version it moved to, byte for byte.

    python examples/rollout_worker.py [--steps 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from typing import Any

import torch

import tensorhub

MODEL = "example-rollout-worker"
SHAPES = {"embed.weight": (256, 64), "layer.weight": (64, 64), "layer.bias": (64,)}


def weights_at(version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``version``: small integers, so that a float sum is exact."""
    return {name: (torch.arange(torch.Size(shape).numel()) % 7).float().reshape(shape) + version
            for name, shape in SHAPES.items()}  # fmt: skip


def trainer(steps: int, finished: Any) -> None:
    weights = weights_at(0)
    last = steps - 1
    with tensorhub.open(model=MODEL, replica="trainer-0") as h:
        h.register(weights)  # used in place: nothing is copied
        for step in range(steps):
            h.publish(step)  # a reference, not a copy: returns at once
            time.sleep(0.2)  # the rest of the step; readers pull meanwhile
            if step == last:
                break
            h.unpublish()  # returns once no reader reads these buffers (or they were offloaded)
            for t in weights.values():  # a stand-in for an optimizer step: now the buffers may change
                t.add_(1.0)
        # Keep the last version published until the rollout worker holds it.
        h.wait(lambda versions: "rollout-1" in versions.get(last, {}), timeout=60)
        print(f"trainer-0: published v0..v{last}; rollout-1 holds v{last}", flush=True)
    finished.set()


def rollout(steps: int, finished: Any) -> None:
    last = steps - 1
    weights = {name: torch.zeros(shape) for name, shape in SHAPES.items()}  # the inference engine's buffers
    with tensorhub.open(model=MODEL, replica="rollout-1", retain="latest") as h:
        h.register(weights)
        version = h.replicate("latest", timeout=60)  # waits for a first version, pulls it into `weights`
        check(weights, version)
        deadline = time.monotonic() + 60
        while h.version != last and time.monotonic() < deadline:
            if h.update("latest", timeout=30):  # moved to a newer version (atomically), or False
                check(weights, h.version)  # a real worker would clear its KV cache here
            generate(weights)
        if h.version != last:
            sys.exit(f"rollout-1: still at v{h.version} after 60 s; the trainer's last is v{last}")
        print(f"rollout-1 holds v{last}, the trainer's last version, byte for byte", flush=True)
        finished.wait(60)  # until the trainer saw it (a worker would go on serving here)


def check(weights: dict[str, torch.Tensor], version: int) -> None:
    expected = weights_at(version)
    for name, t in weights.items():
        if not torch.equal(t, expected[name]):
            sys.exit(f"rollout-1: {name} differs from the trainer's v{version}")
    print(f"rollout-1: moved to v{version}", flush=True)


def generate(weights: dict[str, torch.Tensor]) -> None:
    """A stand-in for a batch of inference on the weights held."""
    x = torch.ones(8, 64)
    (x @ weights["layer.weight"] + weights["layer.bias"]).sum()
    time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    # a fork server that imports torch and tensorhub once: each worker then starts in a fraction
    # of a second instead of importing them again; like spawn, it is safe with CUDA
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "torch", "tensorhub"])
    finished = ctx.Event()
    procs = [ctx.Process(target=trainer, args=(args.steps, finished)),
             ctx.Process(target=rollout, args=(args.steps, finished))]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    failed = [p for p in procs if p.exitcode != 0]
    for p in failed:
        p.kill()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
