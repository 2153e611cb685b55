"""``tensorhub demo``: an RL-shaped job on one machine, on the embedded default server.

A trainer replica of ``--shards`` processes trains a small transformer on synthetic data and
publishes every step (each shard holds every ``--shards``-th parameter tensor, as a stand-in for
tensor parallelism: the shards train identical copies, so their halves agree). ``--rollouts``
rollout replicas of ``--shards`` processes each loop ``update("latest")`` between "inference"
batches. The parent shows live progress, then a summary: versions, bytes moved, per-rollout
stall time, who served whom. At the end every rollout shard's weights are compared with the
trainer's final weights (a digest of the bytes); any difference fails the demo.

With ``--chaos`` a seeded schedule (``--seed``) SIGKILLs a whole rollout replica (all its shard
processes) every one to three seconds while training runs, and restarts it under the same name:
the new incarnation fences the old one on the server, pulls the latest version, and carries on.
Readers that were pulling from a killed replica are re-granted elsewhere. The end is the same
byte-for-byte check; the summary counts the kills.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import queue
import random
import signal
import sys
import time
from collections import defaultdict
from typing import Any

__all__ = ["run_demo"]

MODEL = "demo-policy"


def _build_model(width: int, layers: int, vocab: int = 512) -> Any:
    import torch
    from torch import nn

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            layer = nn.TransformerEncoderLayer(width, nhead=8, dim_feedforward=4 * width, batch_first=True, dropout=0.0)
            self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(self.embed(tokens)))

    torch.manual_seed(0)
    return Policy()


def _owned(model: Any, shard: int, shards: int) -> dict[str, Any]:
    """The parameter tensors shard ``shard`` holds (every ``shards``-th, in a fixed order)."""
    return {name: p.data for i, (name, p) in enumerate(sorted(model.named_parameters())) if i % shards == shard}


def _digest(tensors: dict[str, Any]) -> str:
    import torch

    h = hashlib.sha256()
    for name, t in tensors.items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _trainer(shard: int, a: dict, events: Any, finish: Any) -> None:
    import torch

    import tensorhub

    torch.set_num_threads(1)
    model = _build_model(a["width"], a["layers"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tensors = _owned(model, shard, a["shards"])
    with tensorhub.open(MODEL, "trainer", num_shards=a["shards"], shard_idx=shard, server=a["server"]) as h:
        h.register(tensors)
        gen = torch.Generator().manual_seed(1234)
        for step in range(1, a["steps"] + 1):
            tokens = torch.randint(0, 512, (8, 64), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            t0 = time.monotonic()
            if step > 1:
                h.unpublish()  # readers of the last step drain (or it is offloaded) before we write
            stall = time.monotonic() - t0
            opt.step()  # mutates the registered tensors in place
            h.publish(step)
            events.put(("train", shard, step, loss.item(), stall))
        events.put(("final", "trainer", shard, a["steps"], _digest(tensors)))
        finish.wait(a["timeout"])  # keep serving until every rollout has the last version


def _rollout(replica: str, shard: int, a: dict, events: Any) -> None:
    import torch

    import tensorhub
    from tensorhub.core.errors import UpdateAborted, VersionUnavailable

    torch.set_num_threads(1)
    model = _build_model(a["width"], a["layers"])
    tensors = _owned(model, shard, a["shards"])
    for t in tensors.values():
        t.zero_()  # nothing is known until the first version arrives
    deadline = time.monotonic() + a["timeout"]
    with tensorhub.open(MODEL, replica, num_shards=a["shards"], shard_idx=shard, server=a["server"]) as h:
        h.register(tensors)
        for _ in range(100):
            try:
                h.replicate("latest", timeout=a["timeout"])
                break
            except VersionUnavailable:  # the trainer moved on while we pulled: take the newer one
                events.put(("aborted", replica, shard))
        events.put(("pulled", replica, shard, h.version, 0.0, h.last_pull.bytes, list(h.last_pull.sources)))
        while (h.version or 0) < a["steps"] and time.monotonic() < deadline:
            t0 = time.monotonic()
            try:
                moved = h.update("latest")
            except UpdateAborted:
                # The version we moved to stopped being retained before every shard had it (the
                # trainer is faster than this rollout). The handle is empty: the next update
                # takes the newest version.
                events.put(("aborted", replica, shard))
                continue
            stall = time.monotonic() - t0
            if moved:
                p = h.last_pull
                events.put(("pulled", replica, shard, h.version, stall, p.bytes, list(p.sources)))
            with torch.no_grad():  # an "inference" batch on the weights this shard holds
                for t in list(tensors.values())[:8]:
                    if t.dim() == 2:
                        torch.mm(t, t.t()[:, :64])
            time.sleep(0.02)
        events.put(("final", replica, shard, h.version, _digest(tensors)))


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; 0 on success, 1 with a message on failure."""
    a = {k: getattr(args, k) for k in ("steps", "rollouts", "shards", "width", "layers", "server", "timeout")}
    if a["steps"] < 1 or a["rollouts"] < 1 or a["shards"] < 1 or a["width"] % 8:
        print("tensorhub demo: --steps, --rollouts and --shards must be >= 1, --width a multiple of 8", file=sys.stderr)
        return 1
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensorhub.handles.api"])
    events = ctx.Queue()
    finish = ctx.Event()
    procs = [ctx.Process(target=_trainer, args=(i, a, events, finish), name=f"trainer/{i}") for i in range(a["shards"])]
    rollouts = [f"rollout-{j}" for j in range(a["rollouts"])]

    def rollout_proc(r: str, i: int) -> Any:
        return ctx.Process(target=_rollout, args=(r, i, a, events), name=f"{r}/{i}")

    procs += [rollout_proc(r, i) for r in rollouts for i in range(a["shards"])]
    chaos = bool(getattr(args, "chaos", False))
    seed = getattr(args, "seed", None)
    rng = random.Random(seed if seed is not None else 0)
    kills: list[tuple[float, str]] = []
    print(f"tensorhub demo: trainer x{a['shards']} shards, {a['rollouts']} rollouts x{a['shards']} shards, "
          f"{a['steps']} steps, server {a['server'] or 'embedded default'}"
          + (f", chaos (seed {seed if seed is not None else 0})" if chaos else ""))  # fmt: skip
    t_start = time.monotonic()
    next_kill = t_start + rng.uniform(1.0, 3.0) if chaos else float("inf")
    for p in procs:
        p.start()
    finals: dict[tuple[str, int], tuple[int, str]] = {}
    held: dict[str, int] = defaultdict(int)
    stall: dict[str, float] = defaultdict(float)
    moved_bytes: dict[str, int] = defaultdict(int)
    served: dict[tuple[str, str], int] = defaultdict(int)
    aborted: dict[str, int] = defaultdict(int)
    trained = 0
    trainer_stall = 0.0
    losses: list[float] = []
    deadline = t_start + a["timeout"]
    failure = None
    try:
        while len(finals) < len(procs) and time.monotonic() < deadline:
            if time.monotonic() >= next_kill:
                next_kill = time.monotonic() + rng.uniform(1.0, 3.0)
                alive = [r for r in rollouts if not all((r, i) in finals for i in range(a["shards"]))]
                if alive and trained < a["steps"]:
                    victim = rng.choice(alive)
                    for k, p in enumerate(procs):  # the whole replica dies, and comes back
                        if p.name.startswith(f"{victim}/"):
                            if p.is_alive():
                                os.kill(p.pid, signal.SIGKILL)
                            p.join(10)
                            procs[k] = rollout_proc(victim, int(p.name.rsplit("/", 1)[1]))
                            procs[k].start()
                    kills.append((time.monotonic() - t_start, victim))
                    held.update({f"{victim}/{i}": 0 for i in range(a["shards"])})
                    if not args.quiet:
                        print(f"\r  chaos: SIGKILLed {victim} at {kills[-1][0]:.1f} s; restarting it", flush=True)
            try:
                ev = events.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    failure = f"{dead[0].name} exited with code {dead[0].exitcode}"
                    break
                continue
            if ev[0] == "train":
                _, shard, step, loss, _ = ev
                trainer_stall += ev[4] / a["shards"]
                if shard == 0:
                    trained, losses = step, losses + [loss]
            elif ev[0] == "pulled":
                _, replica, shard, version, s, nbytes, sources = ev
                held[f"{replica}/{shard}"] = version
                stall[replica] = max(stall[replica], 0.0) + s / a["shards"]
                moved_bytes[replica] += nbytes
                for src in sources:
                    served[(src.split("/")[0], replica)] += 1
            elif ev[0] == "aborted":
                aborted[ev[1]] += 1
            elif ev[0] == "final":
                _, replica, shard, version, digest = ev
                finals[(replica, shard)] = (version, digest)
                if all((r, i) in finals for r in rollouts for i in range(a["shards"])):
                    finish.set()
            if not args.quiet:
                versions = " ".join(f"{r}:v{min(held.get(f'{r}/{i}', 0) for i in range(a['shards']))}" for r in rollouts)
                print(f"\r  step {trained}/{a['steps']}  {versions}  moved {sum(moved_bytes.values()) / 1e6:.1f} MB ",
                      end="", flush=True)  # fmt: skip
        else:
            if len(finals) < len(procs):
                failure = f"timed out after {a['timeout']:g} s"
    finally:
        finish.set()
        for p in procs:
            p.join(30)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    if not args.quiet:
        print()
    elapsed = time.monotonic() - t_start
    if failure is None:
        bad = [p.name for p in procs if p.exitcode != 0]
        if bad:
            failure = f"processes failed: {', '.join(bad)}"
    if failure is None:
        for r in rollouts:
            for i in range(a["shards"]):
                got, want = finals[(r, i)], finals[("trainer", i)]
                if got != want:
                    failure = f"{r} shard {i} ends with version {got[0]} digest {got[1]}; the trainer's is v{want[0]} {want[1]}"
    print(f"\nsummary ({elapsed:.1f} s):")
    print(f"  versions published: {trained}   loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "  no step trained")
    print(f"  trainer stall in unpublish (draining readers, offloading the last copy): {trainer_stall:.2f} s")
    print(f"  {'rollout':<12} {'final':>6} {'moved MB':>9} {'stall s':>8} {'aborted':>8}")
    for r in rollouts:
        v = min(finals.get((r, i), (0, ""))[0] for i in range(a["shards"]))
        print(f"  {r:<12} {('v' + str(v)):>6} {moved_bytes[r] / 1e6:>9.1f} {stall[r]:>8.2f} {aborted[r]:>8}")
    if chaos:
        print(f"  chaos: {len(kills)} rollout replicas SIGKILLed mid-run and restarted under their names"
              + (f" ({', '.join(f'{v} at {t:.1f} s' for t, v in kills)})" if kills else ""))  # fmt: skip
    print("  who served whom (shard pulls):")
    for (src, dst), n in sorted(served.items()):
        print(f"    {src:>12} -> {dst:<12} {n}")
    if failure is not None:
        print(f"tensorhub demo FAILED: {failure}", file=sys.stderr)
        return 1
    print("  every rollout holds the trainer's final weights, byte for byte: ok")
    return 0
