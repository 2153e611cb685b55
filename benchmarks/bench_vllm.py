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
  ``reload_weights`` (its layerwise reload of a checkpoint in memory: ``/dev/shm``, or a warm page cache);
- ``tensorhub``: ``start_weight_update`` + ``update_weights({"version": v})`` +
  ``finish_weight_update`` through the ``tensorhub`` backend (pull from the trainer + load);
- ``tensorhub-prefetch``: the pull started by ``update_weights({"version": v, "prefetch": true})``
  while the engine keeps generating (not counted; the prefetch also builds the version's processed
  layers), then the same three calls: the pause is the swap.

``--experts N``: a Qwen3-MoE with N experts per layer instead (stacked ``w13``/``w2``: the fused-MoE
layers' processing is part of each route).

After each round the engine's greedy tokens must equal the ``vllm-reload`` ones of that version
(checked). ``--warmup`` rounds (default 1) of every route run first and are not counted: the first
update after an engine starts faults in the second staging set's memory, which every later one
reuses, and vLLM's first reload warms its own paths. Prints the median pause of each and their ratios to ``vllm-reload`` measured in the
same run. Run it with the vLLM environment: ``bash scripts/vllm_env.sh python benchmarks/bench_vllm.py``.

``--serve``: the same through vLLM's OpenAI-compatible server (what ``vllm serve`` runs, with
``VLLM_SERVER_DEV_MODE=1`` for its RL routes), over HTTP from this process, each pause measured
from ``/pause`` to the end of ``/resume``:

- ``vllm-reload``: ``/pause`` -> ``/collective_rpc`` ``reload_weights`` -> ``/resume``;
- ``tensorhub``: ``/pause`` -> ``/start_weight_update`` -> ``/update_weights`` ->
  ``/finish_weight_update`` -> ``/resume``;
- ``tensorhub-serial``: the same with the backend building the processed layers after the pull
  (``build_while_landing`` off through ``/collective_rpc`` ``tensorhub_backend``, not timed), not
  as each module's tensors land during it: the A/B of that overlap, in the same run and round
  (the two in the other order every other round);
- ``tensorhub-flip``: ``/start_weight_update`` + ``/update_weights {"prefetch": true}`` while
  the server keeps answering completions (not counted) until every worker says (through
  ``/collective_rpc`` ``tensorhub_backend``) that the version is staged and its processed layers
  built, then ``/pause`` -> ``/update_weights`` (the swap) ->
  ``/finish_weight_update`` -> ``/resume``;
- ``tensorhub-live``: update while serving, no ``/pause``: the same prefetch, then, while a
  streamed completion is generating, ``/update_weights`` (the swap) -> ``/finish_weight_update``.
  vLLM runs both as utility calls of its engine core, between two engine steps (its busy loop
  handles its input queue between steps; the CPU platform turns async scheduling off, so no step
  is in flight then): a step runs on the old weights or the new ones, never a mix. Requests in
  flight go on with the new weights over the KV cache of the old ones (what update-while-serving
  means; ``/pause`` with ``mode=keep`` or ``wait`` is the choice where that must not happen). The
  figure is the longest gap between two tokens of that stream that overlaps the calls (one engine
  step included: generation, not stall), printed beside the stream's typical gap, the excess over
  it (what the flip added) and the calls' own time; the excess's median closes the report.
- ``pause-resume``: ``/pause`` -> ``/resume``, nothing between: what the HTTP calls and the
  engine's own pause cost, the floor of every route that pauses.

Each round's line gives the time of each HTTP call of the timed part, then the worker's
recorded phases of that update (the backend's ``last``): ``pull`` (its wall time) with
``convert`` (the conversion itself) and ``before_convert``/``after_convert`` (the pull's time
around it: the server's round trips), ``build`` (the processed layers, in all),
``built_while_pulling`` (modules whose build began while the pull still landed later ones) and
``build_after_pull`` (the part of the build left after the pull), ``swap``, ``attention``; and
the machine's load averages (timings here share two cores with whatever else runs).

The trainer (in this process) keeps no offload copy (``retain=None``): with ``"latest"`` each
round's unpublish copied its 309 MiB to CPU memory in this process, work of neither route that
only added CPU noise (in the offline mode the engine shares this process).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import time
from typing import Any

for _k, _v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():  # fmt: skip
    os.environ.setdefault(_k, _v)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.harness import median  # noqa: E402

PROMPTS = [[1, 2, 3, 4], [100, 7, 300, 9, 11], [42]]


def _next_version(trainer: Any, weights: dict[str, Any], version: int, tmp: str) -> str:
    """The trainer's next version: new values in its registered tensors, published; the same
    weights written as a checkpoint (vLLM's reload route reads it). Returns its folder."""
    import safetensors.torch
    import torch

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
    return path


def _scratch() -> str:
    """A folder for the checkpoints: in memory (``/dev/shm``, where it has 2 GiB free) so that
    writing one per version puts no disk writeback beside the timed rounds (vLLM's reload reads
    it from memory either way, as from a warm page cache); else the system's temporary folder.
    Each version's checkpoint is removed after its round."""
    shm = "/dev/shm"
    try:
        st = os.statvfs(shm)
        if st.f_bavail * st.f_frsize >= 2 << 30:
            return tempfile.mkdtemp(prefix="bench_vllm-", dir=shm)
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="bench_vllm-")


def _round(rnd: int) -> str:
    """A round's label: ``round N``, or ``warm-up`` (its pauses are not in the medians)."""
    return f"round {rnd}" if rnd >= 0 else "warm-up"


def _drop_warmup(pauses: dict[str, list[float]], warmup: int, *more: list[float]) -> None:
    """Each route's first ``warmup`` pauses (and of ``more``) out: the warm-up rounds'."""
    for xs in (*pauses.values(), *more):
        del xs[:warmup]


def _load() -> str:
    """The machine's load averages (1, 5, 15 min): timings here are shared with whatever else runs."""
    return "load " + "/".join(f"{x:.1f}" for x in os.getloadavg())


def _print_medians(pauses: dict[str, list[float]], how: str, width: int) -> None:
    """Each route's median pause and its ratio to vLLM's own reload (the baseline, same run)."""
    base = median(pauses["vllm-reload"])
    print(f"\nmedian pause per update {how}; {_load()}:")
    for route, xs in pauses.items():
        m = median(xs)
        print(f"  {route:>{width}}: {m * 1000:8.1f} ms   ratio to vllm-reload {m / base:6.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE with this many experts per layer (0: dense Qwen3)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed rounds of every route first (the first update after an engine starts faults in "
                         "memory that every later one reuses; vLLM's first reload warms its own paths)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (default: vLLM's compiled mode)")
    ap.add_argument("--serve", action="store_true", help="through vLLM's HTTP server and its RL routes")
    ap.add_argument("--trainer-shared-memory", action="store_true",
                    help="register the trainer's tensors with shared_memory=True (a reader in another process maps them "
                         "and copies with memmove instead of process_vm_readv)")  # fmt: skip
    args = ap.parse_args()
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    if args.serve:
        return serve_main(args)

    import vllm

    import tensorhub
    from tensorhub.core.placement import REPLICATE, TensorPlacement
    from tests.procs import ServerProcess

    tmp = _scratch()
    weights = _model(args, tmp)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"model: {_what(args)}: {nbytes / 2**20:.0f} MiB bf16, {len(weights)} tensors; "
          f"{'eager' if args.eager else 'compiled'}", flush=True)  # fmt: skip

    server = ServerProcess()
    # no offload copy at each unpublish (the trainer's retention is not either route's work)
    trainer = tensorhub.open("bench", "trainer", num_shards=1, shard_idx=0, server=server.address, retain=None)
    trainer.register(weights, placements={n: TensorPlacement(n, "bfloat16", tuple(t.shape), (1,), (REPLICATE,))
                                          for n, t in weights.items()}, shared_memory=args.trainer_shared_memory)  # fmt: skip
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
        for rnd in range(-args.warmup, args.rounds):  # rounds < 0: warm-up, not counted
            for route in pauses:
                version += 1
                path = _next_version(trainer, weights, version, tmp)
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
                shutil.rmtree(path, ignore_errors=True)  # its round is over
                pauses[route].append(pause)
                phases = "" if route == "vllm-reload" else _phases(_backend(llm).last)
                print(f"{_round(rnd)} {route:>19} v{version}: pause {pause * 1000:8.1f} ms{phases} [{_load()}]", flush=True)
    finally:
        llm.shutdown_weight_transfer_engine()
        trainer.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # the model folder and what a failed round left
    _drop_warmup(pauses, args.warmup)
    _print_medians(pauses, f"({nbytes / 2**20:.0f} MiB, {args.rounds} rounds after {args.warmup} warm-up; same engine, same run)", 19)
    return 0


def _what(args: argparse.Namespace) -> str:
    kind = f"Qwen3-MoE ({args.experts} experts, 2 per token)" if args.experts else "Qwen3"
    return f"{kind} {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}"


def _model(args: argparse.Namespace, tmp: str) -> dict:
    """A random-initialized Qwen3 (or Qwen3-MoE with ``--experts``, each expert's width
    ``hidden / 2``) saved in ``tmp``/v0; its tensors (bf16)."""
    import safetensors.torch
    import torch
    import transformers

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
                  max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    if args.experts:
        config = transformers.Qwen3MoeConfig(intermediate_size=3 * args.hidden, moe_intermediate_size=args.hidden // 2,
                                             num_experts=args.experts, num_experts_per_tok=2, decoder_sparse_step=1,
                                             mlp_only_layers=[], **common)  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=3 * args.hidden, **common)).to(torch.bfloat16)
    model.save_pretrained(os.path.join(tmp, "v0"))
    (ckpt,) = glob.glob(os.path.join(tmp, "v0", "*.safetensors"))
    return {n: t.contiguous() for n, t in safetensors.torch.load_file(ckpt).items()}


def serve_main(args: argparse.Namespace) -> int:
    """The pauses through vLLM's OpenAI-compatible server, driven over HTTP."""
    import json
    import socket
    import subprocess
    import threading

    import requests
    import safetensors.torch
    import torch

    import tensorhub
    from tensorhub.core.placement import REPLICATE, TensorPlacement
    from tensorhub.integrations.vllm import EXTENSION
    from tests.procs import ServerProcess

    tmp = _scratch()
    weights = _model(args, tmp)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"model: {_what(args)}: {nbytes / 2**20:.0f} MiB bf16, {len(weights)} tensors; "
          f"{'eager' if args.eager else 'compiled'}; through vLLM's HTTP server", flush=True)  # fmt: skip
    server = ServerProcess()
    # no offload copy at each unpublish (the trainer's retention is not either route's work)
    trainer = tensorhub.open("bench", "trainer", num_shards=1, shard_idx=0, server=server.address, retain=None)
    trainer.register(weights, placements={n: TensorPlacement(n, "bfloat16", tuple(t.shape), (1,), (REPLICATE,))
                                          for n, t in weights.items()}, shared_memory=args.trainer_shared_memory)  # fmt: skip
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    log = open(os.path.join(tmp, "serve.log"), "w+b")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", os.path.join(tmp, "v0"),
           "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16",
           "--max-model-len", "128", "--gpu-memory-utilization", "0.3", "--max-num-seqs", "8",
           "--max-num-batched-tokens", "256", "--weight-transfer-config", json.dumps({"backend": "tensorhub"}),
           "--worker-extension-cls", EXTENSION,  # tensorhub_backend: the workers' state, read before a pause
           *(["--enforce-eager"] if args.eager else [])]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    calls: list[tuple[str, float]] = []  # each call of the round's timed part: its route and seconds

    def post(route: str, body: dict | None = None, **params: object) -> dict:
        t = time.perf_counter()
        r = requests.post(f"{url}{route}", json=body, params=params or None, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"POST {route}: {r.status_code} {r.text[:2000]}")
        calls.append((route, time.perf_counter() - t))
        return r.json() if r.content else {}

    try:
        deadline = time.monotonic() + 1800
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                print(f"the vLLM server did not start:\n{log.read().decode(errors='replace')[-4000:]}")
                return 1
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(2)
        print(f"server up in {time.perf_counter() - t0:.1f} s", flush=True)
        served = requests.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]

        def generate() -> list[list[int]]:
            return [requests.post(f"{url}/v1/completions", json={"model": served, "prompt": p, "max_tokens": 8,
                                                                  "temperature": 0, "ignore_eos": True,
                                                                  "return_token_ids": True},
                                  timeout=600).json()["choices"][0]["token_ids"] for p in PROMPTS]  # fmt: skip

        def backends() -> list[dict]:
            return post("/collective_rpc", {"method": "tensorhub_backend"})["results"]

        def staged(version: int) -> bool:
            """Every worker holds ``version`` in staging and its processed layers are built."""
            return all(b["staged"] == version for b in backends())

        post("/init_weight_transfer_engine", {"init_info": {"source_model": "bench", "replica": "rollout-0",
                                                            "server": server.address}})  # fmt: skip
        def stream(arrivals: list[float], going: threading.Event) -> None:
            """A streamed completion: each token's arrival time (one SSE event per engine step)."""
            body = {"model": served, "prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            try:
                with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as r:
                    for line in r.iter_lines(chunk_size=None):
                        if line.startswith(b"data: ") and line != b"data: [DONE]":
                            arrivals.append(time.perf_counter())
                            if len(arrivals) >= 8:
                                going.set()
            finally:
                going.set()

        pauses: dict[str, list[float]] = {"vllm-reload": [], "tensorhub": [], "tensorhub-serial": [], "tensorhub-flip": [],
                                          "tensorhub-live": [], "pause-resume": []}  # fmt: skip
        excess: list[float] = []  # tensorhub-live: the longest gap across the calls less the stream's typical gap
        version = 0
        for rnd in range(-args.warmup, args.rounds):  # rounds < 0: warm-up, not counted
            order = list(pauses)
            if rnd % 2:  # the A/B's two routes in the other order every other round (the earlier one ran first)
                a, b = order.index("tensorhub"), order.index("tensorhub-serial")
                order[a], order[b] = order[b], order[a]
            for route in order:
                if route == "pause-resume":  # the floor: two of the calls every route makes, nothing between
                    t0 = time.perf_counter()
                    post("/pause", mode="wait")
                    post("/resume")
                    pauses[route].append(time.perf_counter() - t0)
                    print(f"{_round(rnd)} {route:>16}: pause {pauses[route][-1] * 1000:8.1f} ms [{_load()}]", flush=True)
                    continue
                version += 1
                path = _next_version(trainer, weights, version, tmp)
                live = ""
                if route == "tensorhub-live":
                    post("/start_weight_update")
                    post("/update_weights", {"update_info": {"version": version, "prefetch": True}})
                    deadline = time.monotonic() + 300
                    while not staged(version) and time.monotonic() < deadline:
                        generate()
                    arrivals: list[float] = []
                    going = threading.Event()
                    streaming = threading.Thread(target=stream, args=(arrivals, going), daemon=True)
                    streaming.start()
                    going.wait(120)
                    calls.clear()
                    t0 = time.perf_counter()
                    post("/update_weights", {"update_info": {"version": version}})
                    post("/finish_weight_update", {"weight_version": str(version)})
                    t1 = time.perf_counter()
                    streaming.join(600)
                    gaps = [(a, b) for a, b in zip(arrivals, arrivals[1:])]
                    during = [b - a for a, b in gaps if b > t0 and a < t1]
                    other = [b - a for a, b in gaps if not (b > t0 and a < t1)]
                    if not during or not arrivals or arrivals[-1] < t1:
                        print(f"the stream ended before the flip did ({len(arrivals)} tokens): make it longer")
                        return 1
                    pauses[route].append(max(during))
                    # the gap holds one engine step too (generation, not stall): what the flip added is the excess
                    excess.append(max(during) - median(other))
                    live = (f"  (calls {(t1 - t0) * 1000:.1f} ms; typical gap {median(other) * 1000:.1f} ms, so the flip "
                            f"added {excess[-1] * 1000:.1f} ms; longest gap elsewhere {max(other) * 1000:.1f} ms)")  # fmt: skip
                elif route == "tensorhub-flip":
                    post("/start_weight_update")
                    post("/update_weights", {"update_info": {"version": version, "prefetch": True}})
                    deadline = time.monotonic() + 300
                    while not staged(version) and time.monotonic() < deadline:
                        generate()  # the server keeps answering while the pull runs
                    calls.clear()
                    t0 = time.perf_counter()
                    post("/pause", mode="wait")
                    post("/update_weights", {"update_info": {"version": version}})
                    post("/finish_weight_update", {"weight_version": str(version)})
                    post("/resume")
                elif route in ("tensorhub", "tensorhub-serial"):
                    serial = route == "tensorhub-serial"
                    if serial:  # the A/B: the whole build after the pull, as before the build overlapped it
                        post("/collective_rpc", {"method": "tensorhub_backend", "kwargs": {"build_while_landing": False}})
                    calls.clear()
                    t0 = time.perf_counter()
                    post("/pause", mode="wait")
                    post("/start_weight_update")
                    post("/update_weights", {"update_info": {"version": version}})
                    post("/finish_weight_update", {"weight_version": str(version)})
                    post("/resume")
                    pause_ = time.perf_counter() - t0
                    if serial:
                        post("/collective_rpc", {"method": "tensorhub_backend", "kwargs": {"build_while_landing": True}})
                else:
                    calls.clear()
                    t0 = time.perf_counter()
                    post("/pause", mode="wait")
                    post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
                    post("/resume")
                pause = pauses[route].pop() if live else pause_ if route in ("tensorhub", "tensorhub-serial") else time.perf_counter() - t0
                timed = " (" + ", ".join(f"{r.lstrip('/')} {x * 1000:.1f}" for r, x in calls) + " ms)"
                post("/reset_prefix_cache")
                got = generate()
                if route != "vllm-reload":
                    post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
                    post("/reset_prefix_cache")
                    if generate() != got:
                        print(f"MISMATCH: {route} v{version} differs from vLLM's own load of the same weights")
                        return 1
                shutil.rmtree(path, ignore_errors=True)  # its round is over
                pauses[route].append(pause)
                phases = "" if route == "vllm-reload" else _phases(backends()[0]["last"])
                print(f"{_round(rnd)} {route:>16} v{version}: pause {pause * 1000:8.1f} ms{timed}{live}{phases} [{_load()}]", flush=True)
        post("/shutdown_weight_transfer_engine")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()
        trainer.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # the model folder and what a failed round left
    _drop_warmup(pauses, args.warmup, excess)
    _print_medians(pauses, f"through the HTTP server ({nbytes / 2**20:.0f} MiB, {args.rounds} rounds after {args.warmup} warm-up; "
                           "same server, same run)", 16)  # fmt: skip
    print("  (tensorhub-live: no /pause; the longest gap between a streamed completion's tokens across the calls,")
    print(f"   one engine step included; less the stream's typical gap, median {median(excess) * 1000:.1f} ms: "
          f"ratio to vllm-reload {median(excess) / median(pauses['vllm-reload']):.3f})")  # fmt: skip
    return 0


def _phases(last: dict[str, float]) -> str:
    """A worker's last update, per phase: seconds (``*_s``) as ms, the rest as they are."""
    return "  (" + ", ".join(f"{k.removesuffix('_s')} {v * 1000:.1f} ms" if k.endswith("_s") else f"{k} {v:g}"
                             for k, v in last.items()) + ")"  # fmt: skip


def _backend(llm: object) -> Any:
    """The in-process worker's tensorhub weight-transfer engine."""
    return llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine  # type: ignore[attr-defined]


def _staged(llm: object) -> int | None:
    """The version the in-process worker's staging set holds (None: none, or still pulling)."""
    return _backend(llm).staged


if __name__ == "__main__":
    sys.exit(main())
