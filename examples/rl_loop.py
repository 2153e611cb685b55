"""A GRPO-like RL loop on CPU: a trainer publishes every step, rollout workers replicate-then-flip.

The task is verifiable: the prompt is ``<bos> d1 d2 d3 =`` with three random digits, and a
completion of three tokens earns the fraction of them that copy the prompt's digits in order.
The policy is a tiny Hugging Face ``transformers`` decoder (Llama architecture, random-initialized
from the config below: no download), which starts at chance (about 0.1) and learns to copy.

One script, three processes by default, on the embedded default server (the first handle
starts it; it exits a minute after the last handle closes):

- the trainer (this process, replica ``trainer-0``) publishes its parameters in place as version
  ``s`` (a reference: nothing is copied); it gathers step ``s``'s rollouts, recomputes their token
  log-probs, and takes a GRPO step: advantages relative to the other samples of the same prompt,
  a clipped policy-gradient loss. Only then does it unpublish (which returns once nobody reads
  the parameters), step the optimizer and publish version ``s + 1``;
- ``--rollouts`` rollout workers (replicas ``rollout-<i>``), each with its own ``transformers``
  model whose parameters are the handle's buffers. Batch ``k`` may use any version from
  ``k - 1`` on (off-policy by at most one step). Between the prompts of a batch a worker calls
  ``prefetch("latest")``, which pulls a newer version into its shadow set in the background while
  it keeps generating; at the next batch boundary ``flip()`` makes it active (the parameters are
  re-pointed at the new set: no copy). The *pause* is the time generation stood still for that
  (the flip, with the rest of a pull still under way when the version is needed); the prefetch
  calls' round trips, and time spent waiting for a trainer that has not yet published the
  needed version, are counted apart.

It prints, per step, the reward, and for each worker the version its batch used and the pause it
saw before that batch; then the mean reward of the first 5 steps against the last 5, and writes a
PNG of reward and pause per step (matplotlib if installed, else a plain chart without text).
``--sync update`` replaces prefetch + flip with ``update("latest")`` at batch boundaries, to
compare the pauses. Exits non-zero if a process failed, or if the reward did not rise over a run
of at least 50 steps.

    python examples/rl_loop.py [--steps 1000] [--seed 0] [--rollouts 2] [--out rl_loop.png]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import queue
import statistics
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import tensorhub

MODEL = "example-rl-loop"
DIGITS, LENGTH = 10, 3  # prompts of LENGTH digits in [0, DIGITS); completions of LENGTH tokens
BOS, SEP = DIGITS, DIGITS + 1  # <bos> d1 d2 d3 =
VOCAB = DIGITS + 2
PROMPT = LENGTH + 2
CLIP = 0.2  # PPO-style clip of the importance ratio (the rollout's version vs. the trainer's)
MIN_STEPS_TO_JUDGE = 50


def policy() -> torch.nn.Module:
    """The tiny decoder, random-initialized from a config written here (seed torch first)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=16, bos_token_id=BOS, eos_token_id=None, pad_token_id=SEP,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None  # always LENGTH new tokens
    model.generation_config.pad_token_id = SEP
    return model


def rewards(digits: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    """The verifiable reward: the fraction of completion tokens that copy the prompt's digits."""
    return (completions == digits).float().mean(dim=1)


def prompt_ids(digits: torch.Tensor) -> torch.Tensor:
    n = digits.shape[0]
    return torch.cat([torch.full((n, 1), BOS), digits, torch.full((n, 1), SEP)], dim=1)


# ---- rollout workers ----------------------------------------------------------------------------


def rollout(rank: int, args: argparse.Namespace, batches: Any) -> None:
    """A rollout worker: ``args.steps`` batches of ``args.prompts`` prompts x ``args.group`` samples."""
    torch.set_num_threads(1)
    torch.manual_seed(args.seed * 1000 + rank + 1)  # sampling
    prompts = torch.Generator().manual_seed(args.seed * 1000 + rank + 500)
    model = policy().eval().requires_grad_(False)
    params = dict(model.named_parameters())
    name = f"rollout-{rank}"
    with tensorhub.open(model=MODEL, replica=name, retain="latest") as h:
        h.register({k: p.data for k, p in params.items()})  # the model's own tensors: pulls land in place
        h.replicate("latest", timeout=60)
        repoint(params, h.tensors)
        if args.sync == "flip":
            h.register_shadow()  # one more copy of the weights (0: it did not fit; flip() then updates)
        for step in range(args.steps):
            pause, waited, ready = sync(h, params, max(0, step - 1), args.sync)
            version, calls = h.version, 0.0
            seqs, logps = [], []
            for i in range(args.prompts):
                if i and args.sync == "flip":  # (the boundary just took the newest version)
                    t = time.perf_counter()
                    h.prefetch("latest")  # one round trip; the pull goes on while we generate
                    calls += time.perf_counter() - t
                digits = torch.randint(0, DIGITS, (1, LENGTH), generator=prompts).repeat(args.group, 1)
                s, lp = generate(model, prompt_ids(digits))
                seqs.append(s)
                logps.append(lp)
            batches.put({"rank": rank, "step": step, "version": version, "pause": pause, "waited": waited,
                         "calls": calls, "ready": ready, "sequences": torch.cat(seqs).tolist(),
                         "logprobs": torch.cat(logps).tolist()})  # fmt: skip


def sync(h: Any, params: dict[str, torch.nn.Parameter], need: int, how: str) -> tuple[float, float, bool | None]:
    """At a batch boundary: make the newest pulled version active, and at least version ``need``.

    Returns:
        (pause, waited, ready): seconds generation stood still to flip or update (the
        weight-sync pause); seconds it waited for the trainer to publish version ``need`` at
        all; whether every flip found its version pulled already (None: no flip).
    """
    pause = waited = 0.0
    ready: bool | None = None
    deadline = time.monotonic() + 120
    while True:
        t = time.perf_counter()
        if how == "update" or not h.shadow_bytes:
            moved = h.update("latest")  # in place: the whole pull is a pause
        elif h.prefetched is not None or (h.version < need and h.prefetch("latest") is not None):
            ready = h.prefetched is not None and ready is not False
            moved = h.flip()  # waits for the prefetch's rest, if any
        else:
            moved = False
        if moved:
            repoint(params, h.tensors)  # a real engine would clear its KV cache here
        if moved or h.version >= need:
            pause += time.perf_counter() - t
        else:
            waited += time.perf_counter() - t
        if h.version >= need:
            return pause, waited, ready
        if time.monotonic() > deadline:
            sys.exit(f"{h.replica}: version {need} not published after 120 s (holding v{h.version})")
        t = time.perf_counter()
        time.sleep(0.002)
        waited += time.perf_counter() - t


def repoint(params: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor]) -> None:
    for k, p in params.items():
        p.data = tensors[k]  # no copy


def generate(model: Any, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample LENGTH tokens per row with ``transformers``; returns the sequences and the
    sampled tokens' log-probs (temperature 1, no truncation: the policy's own distribution)."""
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
        max_new_tokens=LENGTH, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    tokens = out.sequences[:, PROMPT:]
    logps = torch.stack([F.log_softmax(x.float(), dim=-1) for x in out.logits], dim=1)
    return out.sequences, logps.gather(-1, tokens[..., None])[..., 0]


# ---- the trainer --------------------------------------------------------------------------------


def grpo_loss(
    model: torch.nn.Module, seqs: torch.Tensor, old: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GRPO objective over rows grouped ``group`` by ``group`` (the samples of one prompt).

    Returns:
        (loss, rewards): the clipped policy-gradient loss on the token log-probs recomputed
        here, and each row's reward.
    """
    tokens = seqs[:, PROMPT:]
    reward = rewards(seqs[:, 1 : 1 + LENGTH], tokens)
    r = reward.view(-1, group)
    adv = ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)).view(-1, 1)
    logits = model(seqs).logits[:, PROMPT - 1 : -1]
    new = F.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None])[..., 0]
    ratio = torch.exp(new - old)
    loss = -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()
    return loss, reward


def train(args: argparse.Namespace, ctx: Any) -> tuple[list[float], dict[int, list[float]], list[str]]:
    """Run the loop. Returns the reward per step, each worker's pause per step, and failures."""
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = policy()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    batches = ctx.Queue()
    workers = [ctx.Process(target=rollout, args=(i, args, batches), name=f"rollout-{i}") for i in range(args.rollouts)]
    reward_per_step: list[float] = []
    pauses: dict[int, list[float]] = {i: [] for i in range(args.rollouts)}
    waited = [0.0] * args.rollouts
    calls = [0.0] * args.rollouts
    staleness: list[int] = []
    flips: dict[bool, list[float]] = {True: [], False: []}  # found the version pulled already: pauses
    early: dict[int, list[dict]] = {}
    with tensorhub.open(model=MODEL, replica="trainer-0") as h:
        h.register(dict(model.named_parameters()))  # used in place: publishing copies nothing
        h.publish(0)
        for w in workers:
            w.start()
        t0 = time.monotonic()
        for step in range(args.steps):
            got = early.pop(step, [])
            while len(got) < args.rollouts:
                try:
                    b = batches.get(timeout=1.0)
                except queue.Empty:
                    dead = [w.name for w in workers if w.exitcode not in (None, 0)]
                    if dead or time.monotonic() - t0 > 60 + 5 * args.steps:
                        return reward_per_step, pauses, [f"{', '.join(dead) or 'rollouts'} failed at step {step}"]
                    continue
                (got if b["step"] == step else early.setdefault(b["step"], [])).append(b)
            got.sort(key=lambda b: b["rank"])
            assert all(step - 1 <= b["version"] <= step for b in got), "off-policy by more than one step"
            seqs = torch.tensor([s for b in got for s in b["sequences"]])
            old = torch.tensor([lp for b in got for lp in b["logprobs"]])
            loss, reward = grpo_loss(model, seqs, old, args.group)
            opt.zero_grad()
            loss.backward()  # reads the published parameters: allowed
            h.unpublish()  # returns once no reader reads them: now they may change
            opt.step()
            h.publish(step + 1)
            reward_per_step.append(reward.mean().item())
            for b in got:
                pauses[b["rank"]].append(b["pause"])
                waited[b["rank"]] += b["waited"]
                calls[b["rank"]] += b["calls"]
                staleness.append(step - b["version"])
                if b["ready"] is not None:
                    flips[b["ready"]].append(b["pause"])
            workers_line = "  ".join(
                f"rollout-{b['rank']} v{b['version']} pause {b['pause'] * 1e3:6.2f} ms" for b in got
            )
            print(
                f"step {step:4d}  reward {reward_per_step[-1]:.3f}  loss {loss.item():+.4f}  {workers_line}", flush=True
            )
        for w in workers:
            w.join(60)
        failed = [f"{w.name} exited with {w.exitcode}" for w in workers if w.exitcode != 0]
        for w in workers:
            if w.exitcode is None:
                w.kill()
    all_pauses = [p for ps in pauses.values() for p in ps]
    if all_pauses:
        print(
            f"sync pause ({args.sync}) per batch: median {_ms(all_pauses)}, max {max(all_pauses) * 1e3:.2f} ms, "
            f"total {sum(all_pauses):.2f} s over {len(all_pauses)} batches in {time.monotonic() - t0:.0f} s",
            flush=True,
        )
        if flips[True] or flips[False]:
            print(
                f"  flips that found the version pulled already: {len(flips[True])} (median {_ms(flips[True])}); "
                f"that waited for the rest of its pull: {len(flips[False])} (median {_ms(flips[False])})",
                flush=True,
            )
        print(f"  not counted as pause: prefetch calls {sum(calls) / len(all_pauses) * 1e3:.2f} ms per batch; "
              f"waiting for the trainer to publish {sum(waited):.1f} s in all; "
              f"batches one version behind the trainer: {sum(staleness)} of {len(staleness)}", flush=True)  # fmt: skip
    return reward_per_step, pauses, failed


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:.2f} ms" if seconds else "-"


# ---- the chart ----------------------------------------------------------------------------------


def write_png(path: Path, reward: list[float], pauses: dict[int, list[float]]) -> str:
    """Reward and pause (ms) per step; with matplotlib if it is installed, else a plain chart.

    Returns:
        how it was drawn.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plain_png(path, reward, [[p * 1e3 for p in ps] for ps in pauses.values()])
        return "a plain chart: reward (top, blue), pause per worker (bottom); matplotlib is not installed"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(reward, color="tab:blue")
    top.set_ylabel("reward (mean)")
    top.set_ylim(0, 1)
    top.set_title("GRPO on TensorHub: reward and weight-sync pause per step")
    for rank, ps in pauses.items():
        bottom.plot([p * 1e3 for p in ps], label=f"rollout-{rank}", linewidth=0.8)
    bottom.set_ylabel("pause before the batch (ms)")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


def _plain_png(path: Path, reward: list[float], series: list[list[float]]) -> None:
    """Two panels of polylines, no text: a PNG written with zlib and struct alone."""
    w, h, pad = 640, 480, 20
    img = bytearray(b"\xff" * (w * h * 3))
    colors = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189)]

    def dot(x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < w and 0 <= y < h:
            img[3 * (y * w + x) : 3 * (y * w + x) + 3] = bytes(c)

    def panel(top: int, bottom: int, lines: list[list[float]], hi: float, offset: int) -> None:
        for x in range(pad, w - pad):
            dot(x, bottom, (0, 0, 0))
        for y in range(top, bottom + 1):
            dot(pad, y, (0, 0, 0))
        for i, ys in enumerate(lines):
            n = max(len(ys) - 1, 1)
            pts = [
                (pad + round(j * (w - 2 * pad) / n), bottom - round(min(v / hi, 1.0) * (bottom - top)))
                for j, v in enumerate(ys)
            ]
            for (x0, y0), (x1, y1) in itertools.pairwise(pts):
                k = max(abs(x1 - x0), abs(y1 - y0), 1)
                for s in range(k + 1):
                    dot(
                        x0 + round(s * (x1 - x0) / k), y0 + round(s * (y1 - y0) / k), colors[(i + offset) % len(colors)]
                    )

    panel(pad, h // 2 - pad, [reward], 1.0, 0)
    panel(h // 2 + pad, h - pad, series, max([v for s in series for v in s], default=0.0) or 1.0, 1)
    raw = b"".join(b"\x00" + bytes(img[3 * w * y : 3 * w * (y + 1)]) for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    )


# ---- main ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="trainer steps (one batch per worker each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rollouts", type=int, default=2, help="rollout worker processes")
    parser.add_argument("--out", type=Path, default=Path("rl_loop.png"), help="the PNG of reward and pause")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per worker batch")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO's group)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sync", choices=("flip", "update"), default="flip", help="how workers take a new version")
    args = parser.parse_args()
    if args.steps < 1 or args.rollouts < 1 or args.prompts < 1 or args.group < 2:
        parser.error("--steps, --rollouts and --prompts must be >= 1, --group >= 2")
    print(f"rl_loop: seed {args.seed}, {args.steps} steps, {args.rollouts} rollout workers x {args.prompts} prompts "
          f"x {args.group} samples, sync by {args.sync}; task: copy {LENGTH} digits", flush=True)  # fmt: skip
    # a fork server that imports torch and tensorhub once: each worker then starts in a fraction of a
    # second instead of importing them again; like spawn, it is safe with CUDA
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "torch", "tensorhub", "transformers.models.llama.modeling_llama"])
    reward, pauses, failed = train(args, ctx)
    for why in failed:
        print(f"FAILED: {why}", flush=True)
    if reward:
        k = min(5, len(reward))
        first, last = statistics.fmean(reward[:k]), statistics.fmean(reward[-k:])
        rose = last > first
        verdict = "rose" if rose else "did not rise"
        if len(reward) < MIN_STEPS_TO_JUDGE:
            verdict += f" (not judged: fewer than {MIN_STEPS_TO_JUDGE} steps)"
        elif not rose:
            failed.append("reward did not rise")
        print(f"reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}: {verdict}", flush=True)
        how = write_png(args.out, reward, pauses)
        print(f"wrote {args.out} ({how})", flush=True)
    return 1 if failed or not reward else 0


if __name__ == "__main__":
    sys.exit(main())
