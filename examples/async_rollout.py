"""An asyncio rollout server on the async API (the README's "The async API").

``tensorhub.aio.open`` gives the same handle methods, awaitable, on the caller's event loop. The
server below answers "requests" with the weights it holds and, between them, moves to the
trainer's newest version with ``await h.update("latest", timeout=30)``. One call runs at a time
per handle; cancelling a ``replicate``/``update`` unpublishes the partial copy and returns once
nothing writes into the buffers.

One script, two processes on this machine, on the embedded default server (the first handle
starts it; it exits a minute after the last handle closes): a trainer (replica ``trainer-0``, the
synchronous API) that publishes a new version every step, and this asyncio server (replica
``rollout-3``) in the main process.

    python examples/async_rollout.py [--steps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from typing import Any

import torch

import tensorhub
import tensorhub.aio

MODEL = "example-async-rollout"
SHAPES = {"embed.weight": (256, 64), "head.weight": (64, 256)}


def weights_at(version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``version`` (small integers, so that a float sum is exact)."""
    return {name: (torch.arange(torch.Size(shape).numel()) % 3).float().reshape(shape) + version
            for name, shape in SHAPES.items()}  # fmt: skip


def trainer(steps: int, finished: Any) -> None:
    """The trainer process: publish, let readers pull, unpublish, train, for ``steps`` steps."""
    weights = weights_at(0)
    last = steps - 1
    with tensorhub.open(model=MODEL, replica="trainer-0") as h:
        h.register(weights)
        for step in range(steps):
            h.publish(step)
            time.sleep(0.2)
            if step == last:
                break
            h.unpublish()
            for t in weights.values():
                t.add_(1.0)
        finished.wait(60)  # keep the last version published until the rollout server holds it


async def serve(steps: int) -> int:
    """The rollout server: answers requests, and keeps its weights up to date between them."""
    last = steps - 1
    weights = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    answered = 0
    async with tensorhub.aio.open(model=MODEL, replica="rollout-3") as h:
        await h.register(weights)
        check(weights, await h.replicate("latest", timeout=60))  # waits for a first version
        print(f"rollout-3: serving v{h.version}", flush=True)
        deadline = time.monotonic() + 60
        while h.version != last and time.monotonic() < deadline:
            answered += await answer_requests(weights)
            if await h.update("latest", timeout=30):
                check(weights, h.version)
                print(f"rollout-3: moved to v{h.version} (a real server clears its KV cache here)", flush=True)
        if h.version != last:
            raise SystemExit(f"rollout-3: still at v{h.version} after 60 s; the trainer's last is v{last}")
    print(f"rollout-3: answered {answered} requests; holds v{last}, the trainer's last, byte for byte", flush=True)
    return answered


def check(weights: dict[str, torch.Tensor], version: int | None) -> None:
    if version is None:
        raise SystemExit("rollout-3: the handle holds no version")
    expected = weights_at(version)
    if not all(torch.equal(t, expected[name]) for name, t in weights.items()):
        raise SystemExit(f"rollout-3: v{version} differs from the trainer's")


async def answer_requests(weights: dict[str, torch.Tensor]) -> int:
    """A stand-in for a batch of generation: a few concurrent requests on the weights held."""

    async def one(i: int) -> float:
        await asyncio.sleep(0.01 * i)
        x = torch.full((1, 256), float(i))
        return float((x @ weights["embed.weight"] @ weights["head.weight"]).sum())

    return len(await asyncio.gather(*(one(i) for i in range(4))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    # a fork server that imports torch and tensorhub once: each worker then starts in a fraction
    # of a second instead of importing them again; like spawn, it is safe with CUDA
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "torch", "tensorhub"])
    finished = ctx.Event()
    proc = ctx.Process(target=trainer, args=(args.steps, finished))
    proc.start()
    try:
        asyncio.run(serve(args.steps))
    finally:
        finished.set()
        proc.join(60)
        if proc.exitcode is None:
            proc.kill()
    return 0 if proc.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
