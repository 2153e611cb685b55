"""How small are the deltas between RL steps? A real Hugging Face decoder, a few Adam steps.

Workload: a random-initialized Hugging Face decoder (tens of millions of parameters) trained
``--steps`` Adam steps at RL learning rates; the bf16 weights after each step against the last.
Baseline: the full bf16 copy of the weights (bytes), measured from the same model.
Goal: none asserted; PULSE reports >= 98 % unchanged, TRL 35-60x smaller files than full.

A ``transformers`` decoder (Qwen2 or Llama) is random-initialized from a config written here (no
download), tens of millions of parameters, and trained for a few Adam steps at RL learning rates
(default 1e-6 and 3e-6) on random tokens, with float32 master weights as mixed-precision trainers
keep them. After every step the weights a trainer would publish, the bf16 cast of the masters,
are compared with the previous step's (``tensorhub.runtime.deltas.compute_delta``: raw bits,
per tensor sparse or dense), and the benchmark prints, per step:

- unchanged: the fraction of elements whose bf16 bytes did not change (PULSE reports ~99 % over
  Qwen, Llama and Gemma, never below 98 %);
- delta: the delta's bytes (sparse int32 indices + values, or dense values, per tensor), the
  TRL-format file's bytes (``tensorhub.runtime.deltafiles.write_delta``), and the full bf16 size
  over the file's (TRL reports 20-35 MB against 1.2 GB for Qwen3-0.6B, 35-60x);
- the time to compute the delta (with both versions' checksums) and to apply it in place to the
  previous version and verify it; the result is checked bit for bit against the target.

``--pure-bf16`` trains the bf16 weights themselves (no master copy): updates below half a bf16
spacing are then lost rather than accumulated, and far fewer elements change.

Usage: python benchmarks/bench_delta.py [--arch qwen2|llama] [--lr 1e-6 3e-6] [--steps 8]
       [--hidden 512] [--layers 8] [--vocab 32000] [--json FILE]
Needs ``pip install -e '.[bench]'`` (transformers, safetensors).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import write_json  # noqa: E402
from tensorhub.runtime.deltafiles import write_anchor, write_delta  # noqa: E402
from tensorhub.runtime.deltas import apply_delta, bits_of, compute_delta, describe  # noqa: E402

PULSE_UNCHANGED = 0.99
TRL_RATIO = (35, 60)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    try:
        import transformers
    except ImportError:
        sys.exit("bench_delta needs transformers: pip install -e '.[bench]'")
    common = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=2 * args.seq, tie_word_embeddings=False, initializer_range=args.init_std,
    )  # fmt: skip
    if args.arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    return model.to(torch.bfloat16 if args.pure_bf16 else torch.float32)


def published(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a trainer publishes after a step: the bf16 weights (a cast of the masters)."""
    return {n: p.detach().to(torch.bfloat16).contiguous().clone() for n, p in model.named_parameters()}


def run(args: argparse.Namespace, lr: float, out: Path) -> list[dict]:
    torch.manual_seed(args.seed)
    model = build_model(args)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 1)
    prev = published(model)
    n_params = sum(t.numel() for t in prev.values())
    anchor = out / "anchor.safetensors"
    write_anchor(anchor, prev, version=0)
    print(f"\n{args.arch}: {n_params / 1e6:.1f}M parameters, {len(prev)} tensors, bf16 {n_params * 2 / 1e6:.1f} MB "
          f"(anchor file {anchor.stat().st_size / 1e6:.1f} MB); Adam lr={lr:g}, {args.batch}x{args.seq} random tokens, "
          f"{'pure bf16' if args.pure_bf16 else 'float32 masters'}")  # fmt: skip
    print(f"{'step':>4} {'loss':>7} {'unchanged':>10} {'delta MB':>9} {'file MB':>8} {'full MB':>8} {'full/file':>9} "
          f"{'sparse':>6} {'dense':>5} {'diff s':>6} {'apply s':>7}")  # fmt: skip
    rows = []
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        cur = published(model)
        t0 = time.perf_counter()
        delta = compute_delta(prev, cur, base_version=step - 1, version=step)
        t_diff = time.perf_counter() - t0
        path = out / f"delta_{step:04d}.safetensors"
        file_bytes = write_delta(path, delta)
        t0 = time.perf_counter()
        apply_delta(prev, delta)  # in place on the previous version, then verified
        t_apply = time.perf_counter() - t0
        assert all(torch.equal(bits_of(prev[k]), bits_of(cur[k])) for k in cur), "the delta did not make the target"
        d = describe(delta)
        row = dict(arch=args.arch, lr=lr, step=step, loss=float(loss.detach()), unchanged=d["sparsity"], delta_bytes=d["nbytes"],
                   file_bytes=file_bytes, full_bytes=d["full_bytes"], ratio=d["full_bytes"] / file_bytes,
                   sparse_tensors=d["sparse"], dense_tensors=d["dense"], changed_tensors=d["changed_tensors"],
                   diff_s=t_diff, apply_s=t_apply)  # fmt: skip
        rows.append(row)
        print(f"{step:>4} {row['loss']:>7.3f} {row['unchanged']:>9.3%} {d['nbytes'] / 1e6:>9.2f} {file_bytes / 1e6:>8.2f} "
              f"{d['full_bytes'] / 1e6:>8.1f} {row['ratio']:>8.1f}x {d['sparse']:>6} {d['dense']:>5} "
              f"{t_diff:>6.2f} {t_apply:>7.2f}")  # fmt: skip
        prev = cur
    unchanged = sum(r["unchanged"] for r in rows) / len(rows)
    worst = min(r["unchanged"] for r in rows)
    ratio = sum(r["ratio"] for r in rows) / len(rows)
    print(f"lr={lr:g}: unchanged {unchanged:.2%} on average (worst step {worst:.2%}; PULSE ~{PULSE_UNCHANGED:.0%}), "
          f"file {ratio:.1f}x smaller than the full weights on average (TRL {TRL_RATIO[0]}-{TRL_RATIO[1]}x)")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    p.add_argument("--lr", type=float, nargs="+", default=[1e-6, 3e-6], help="learning rates, one run each")
    p.add_argument("--steps", type=int, default=8, help="Adam steps per run")
    p.add_argument(
        "--init-std", type=float, default=0.02, help="the weights' initializer_range (transformers' default)"
    )
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pure-bf16", action="store_true", help="train the bf16 weights themselves (no float32 masters)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_delta_") as tmp:
        for lr in args.lr:
            rows += run(args, lr, Path(tmp))
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
