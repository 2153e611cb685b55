"""The serving pause per weight update of a vLLM engine: TensorHub's backend against vLLM's own route.

Workload: one vLLM engine (CPU build) serving a random-initialized Qwen3 decoder of a few hundred
MB; a trainer in this process publishes a new version per round.
Baseline: vLLM's own ``reload_weights`` from a safetensors checkpoint, in the same run.
Goal: none asserted; the pauses' ratios to the baseline are the figures.

One vLLM engine (the CPU build, in this process, vLLM's default compiled mode) serves a
random-initialized Qwen3 decoder of a few hundred MB. A trainer (one shard, in this process,
bf16) publishes a new version per round. Three ways to bring the engine to it, each timed as the
pause: the time during which the engine cannot generate:

- ``vllm-reload``: vLLM's own fastest route that runs here without a GPU: the trainer's weights
  written as a safetensors checkpoint (not counted) and reloaded in place by vLLM's
  ``reload_weights`` (its layerwise reload from disk, page cache warm);
- ``tensorhub``: ``start_weight_update`` + ``update_weights({"version": v})`` +
  ``finish_weight_update`` through the ``tensorhub`` backend (pull from the trainer + load);
- ``tensorhub-prefetch``: the pull started by ``update_weights({"version": v, "prefetch": true})``
  while the engine keeps generating (not counted), then the same three calls: the pause is the load.

After each round the engine's greedy tokens must equal the ``vllm-reload`` ones of that version
(checked). Prints the median pause of each and their ratios to ``vllm-reload`` measured in the
same run. Run it with the vLLM environment: ``bash scripts/vllm_env.sh python benchmarks/bench_vllm.py``.
Not ``vllm serve``'s HTTP path: the same worker calls, without the HTTP hop.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time

for _k, _v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():  # fmt: skip
    os.environ.setdefault(_k, _v)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.harness import median  # noqa: E402

PROMPTS = [[1, 2, 3, 4], [100, 7, 300, 9, 11], [42]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (default: vLLM's compiled mode)")
    args = ap.parse_args()

    import safetensors.torch
    import torch
    import transformers
    import vllm

    import tensorhub
    from tensorhub.core.placement import REPLICATE, TensorPlacement
    from tests.procs import ServerProcess

    config = transformers.Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
                                      max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="bench_vllm-")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(os.path.join(tmp, "v0"))
    (ckpt,) = glob.glob(os.path.join(tmp, "v0", "*.safetensors"))
    weights = {n: t.contiguous() for n, t in safetensors.torch.load_file(ckpt).items()}
    del model
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"model: Qwen3 {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {nbytes / 2**20:.0f} MiB bf16, "
          f"{len(weights)} tensors; {'eager' if args.eager else 'compiled'}", flush=True)  # fmt: skip

    server = ServerProcess()
    trainer = tensorhub.open("bench", "trainer", num_shards=1, shard_idx=0, server=server.address)
    trainer.register(weights, placements={n: TensorPlacement(n, "bfloat16", tuple(t.shape), (1,), (REPLICATE,))
                                          for n, t in weights.items()})  # fmt: skip
    t0 = time.perf_counter()
    llm = vllm.LLM(model=os.path.join(tmp, "v0"), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128,
                   gpu_memory_utilization=0.3, distributed_executor_backend="uni", enforce_eager=args.eager,
                   max_num_seqs=8, max_num_batched_tokens=256,  # a short warm-up on two cores
                   weight_transfer_config={"backend": "tensorhub"})  # fmt: skip
    print(f"engine up in {time.perf_counter() - t0:.1f} s", flush=True)
    params = vllm.SamplingParams(temperature=0, max_tokens=8, detokenize=False, ignore_eos=True)

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]

    llm.init_weight_transfer_engine({"init_info": {"source_model": "bench", "replica": "rollout-0", "server": server.address}})
    pauses: dict[str, list[float]] = {"vllm-reload": [], "tensorhub": [], "tensorhub-prefetch": []}
    version = 0
    try:
        for rnd in range(args.rounds):
            for route in pauses:
                version += 1
                # the trainer's next version: new values in its registered tensors, then publish
                if version > 1:
                    trainer.unpublish()
                g = torch.Generator().manual_seed(version)
                for t in weights.values():
                    t.add_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype), alpha=0.01)
                trainer.publish(version)
                path = os.path.join(tmp, f"v{version}")
                os.makedirs(path, exist_ok=True)
                safetensors.torch.save_file(weights, os.path.join(path, "model.safetensors"))
                for f in ("config.json", "generation_config.json"):
                    if os.path.exists(os.path.join(tmp, "v0", f)):
                        os.link(os.path.join(tmp, "v0", f), os.path.join(path, f))
                if route == "tensorhub-prefetch":
                    llm.start_weight_update()
                    llm.update_weights({"update_info": {"version": version, "prefetch": True}})
                    deadline = time.monotonic() + 120
                    while _staged(llm) != version and time.monotonic() < deadline:
                        generate()  # the engine keeps serving while the pull runs
                    t0 = time.perf_counter()
                    llm.update_weights({"update_info": {"version": version}})
                    llm.finish_weight_update(weight_version=str(version))
                    pause = time.perf_counter() - t0
                elif route == "tensorhub":
                    t0 = time.perf_counter()
                    llm.start_weight_update()
                    llm.update_weights({"update_info": {"version": version}})
                    llm.finish_weight_update(weight_version=str(version))
                    pause = time.perf_counter() - t0
                else:
                    t0 = time.perf_counter()
                    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
                    pause = time.perf_counter() - t0
                llm.reset_prefix_cache()
                got = generate()
                if route != "vllm-reload":
                    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
                    llm.reset_prefix_cache()
                    if generate() != got:
                        print(f"MISMATCH: {route} v{version} differs from vLLM's own load of the same weights")
                        return 1
                pauses[route].append(pause)
                print(f"round {rnd} {route:>19} v{version}: pause {pause * 1000:8.1f} ms", flush=True)
    finally:
        llm.shutdown_weight_transfer_engine()
        trainer.close()
        server.stop()
    base = median(pauses["vllm-reload"])
    print(f"\nmedian pause per update ({nbytes / 2**20:.0f} MiB, {args.rounds} rounds; same engine, same run):")
    for route, xs in pauses.items():
        m = median(xs)
        print(f"  {route:>19}: {m * 1000:8.1f} ms   ratio to vllm-reload {m / base:5.2f}")
    return 0


def _staged(llm: object) -> int | None:
    """The version the in-process worker's staging set holds (None: none, or still pulling)."""
    worker = llm.llm_engine.model_executor.driver_worker.worker  # type: ignore[attr-defined]
    return worker.weight_transfer_engine.staged


if __name__ == "__main__":
    sys.exit(main())
