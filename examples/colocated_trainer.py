"""A co-located trainer publishes its weights while it does not write them (the README's first
quickstart).

Training and rollout take turns on the same workers: each step the trainer's shards publish
their weights (a reference, nothing is copied), generate with them, unpublish (which returns once
nobody reads the buffers any more) and only then train, writing the buffers in place. Meanwhile
other replicas pull the published version straight from the trainer's memory.

One script starts four processes on this machine, on the embedded default server (the first
handle starts it; it exits a minute after the last handle closes):

- the trainer, replica ``trainer-0``, as two model-parallel shards (``num_shards=2``, one
  process per rank, as torchrun would start them);
- an evaluator, replica ``eval-0``, with the same two shards, that pulls every version with
  ``update("latest")`` and checks it byte for byte. The trainer's "rollout" phase waits until
  the evaluator holds the step's version, so that every step is seen (a real trainer would
  not wait for anybody).

    python examples/colocated_trainer.py [--steps 4]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time

import torch

import tensorhub

MODEL = "example-colocated"
WORLD_SIZE = 2
READER = "eval-0"
SHAPES = {"attn.weight": (128, 64), "mlp.weight": (64, 256), "mlp.bias": (256,)}  # one rank's slice


def weights_at(rank: int, version: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights after ``version`` training steps (small integers: exact sums)."""
    return {name: ((torch.arange(torch.Size(shape).numel()) + rank) % 5).float().reshape(shape) + version
            for name, shape in SHAPES.items()}  # fmt: skip


def trainer(rank: int, steps: int) -> None:
    weights = weights_at(rank, 0)  # this rank's parameters (in a real job: dict(model.named_parameters()))
    with tensorhub.open(model=MODEL, replica="trainer-0", num_shards=WORLD_SIZE, shard_idx=rank) as h:
        h.register(weights)  # tensors used in place, CPU or CUDA, contiguous
        for step in range(steps):
            h.publish(step)  # a reference, not a copy: returns at once
            do_rollout(h, weights, step)
            h.unpublish()  # returns once no reader is still reading these buffers
            do_train(weights)  # now the buffers may change
        print(f"trainer-0 rank {rank}: published v0..v{steps - 1}", flush=True)


def do_rollout(h: tensorhub.ShardHandle, weights: dict[str, torch.Tensor], step: int) -> None:
    """Generate with the weights (they must not change now), and, for this example, wait until
    the evaluator holds this step's version."""
    x = torch.ones(4, 128)
    (x @ weights["attn.weight"] @ weights["mlp.weight"]).sum()
    h.wait(lambda versions: READER in versions.get(step, {}), timeout=60)


def do_train(weights: dict[str, torch.Tensor]) -> None:
    """A stand-in for an optimizer step: it writes the registered tensors in place."""
    for t in weights.values():
        t.add_(1.0)


def evaluator(rank: int, steps: int) -> None:
    last = steps - 1
    weights = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    seen = []
    with tensorhub.open(model=MODEL, replica=READER, num_shards=WORLD_SIZE, shard_idx=rank) as h:
        h.register(weights)
        deadline = time.monotonic() + 60
        while h.version != last and time.monotonic() < deadline:
            if h.update("latest", timeout=30):  # every shard of the replica gets the same answer
                expected = weights_at(rank, h.version)
                if not all(torch.equal(t, expected[name]) for name, t in weights.items()):
                    sys.exit(f"{READER} rank {rank}: v{h.version} differs from the trainer's")
                seen.append(h.version)
            time.sleep(0.02)
        if h.version != last:
            sys.exit(f"{READER} rank {rank}: still at v{h.version} after 60 s; the trainer's last is v{last}")
    print(f"{READER} rank {rank}: pulled v{', v'.join(map(str, seen))}, each byte for byte", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    # a fork server that imports torch and tensorhub once: each worker then starts in a fraction
    # of a second instead of importing them again; like spawn, it is safe with CUDA
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "torch", "tensorhub"])
    procs = [ctx.Process(target=role, args=(rank, args.steps)) for role in (trainer, evaluator)
             for rank in range(WORLD_SIZE)]  # fmt: skip
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
