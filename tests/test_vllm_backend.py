"""The ``tensorhub`` weight-transfer backend in a real vLLM (its CPU build, ``vllm-cpu`` 0.32).

A trainer of 3 shards (Hugging Face names, FSDP-like ``Shard`` placements, float32 master weights)
publishes versions through :class:`TensorHubTrainerWeightTransferEngine`, which drives the engine
through vLLM's own weight-transfer API (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``); the engine was started with
``weight_transfer_config={"backend": "tensorhub"}`` (found through vLLM's plugin entry point) in
vLLM's default compiled mode, from other weights. After each version its greedy tokens equal
those of the same engine loaded directly from that version's safetensors checkpoint by vLLM's
own loader (``reload_weights``), and differ from the version before; vLLM reports the TensorHub
version as its weight version; v2 is prefetched while the engine keeps generating v1. Three models:
dense (Qwen3), mixture-of-experts (Qwen3-MoE: stacked ``w13``/``w2`` experts) and DeepSeek-V3-shaped
(MLA + routed and shared experts). Modes: in-process compiled (all three; the MoE and DeepSeek
trainers publish transformers 5's fused experts, ``named_parameters()`` of the loaded model),
vLLM's multiprocess mode compiled (all three), tensor parallelism 2 (two worker processes; all
three), ``AsyncLLM`` (all three); ``test_vllm_serve.py`` has ``vllm serve``. Bad init and
update info are typed errors, and a checkpoint that does not fill a parameter (or a fused expert
tensor of a bad shape) is a ``MappingMismatch`` naming it, at init, before any byte moves.

Skipped where vLLM is not installed: ``bash scripts/dev test-vllm`` makes its environment and
runs these. One engine per test. A model's checkpoints are saved once per session
(:func:`vllm_support.checkpoints`) and every engine has the same sizes
(:data:`vllm_support.ENGINE_SIZES`), so vLLM compiles each model once (its in-process test) and the
model's later compiled engines load that from vLLM's compile cache.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal as signal_
import subprocess
import sys
import threading
import time

import pytest

for _k, _v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():  # fmt: skip
    os.environ.setdefault(_k, _v)

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/dev test-vllm makes an environment with it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
safetensors = pytest.importorskip("safetensors", reason="safetensors is not installed")
import safetensors.torch  # noqa: E402

import torch  # noqa: E402

from tensorhub.core.errors import ContractViolation, InvalidArgument, MappingMismatch, UsageError  # noqa: E402
from tensorhub.core.placement import REPLICATE, TensorPlacement, chunk_range  # noqa: E402
from tensorhub.integrations.vllm import EXTENSION  # noqa: E402
from tensorhub.integrations.vllm_backend import (  # noqa: E402
    LLMClient,
    TensorHubTrainerInitInfo,
    TensorHubTrainerWeightTransferEngine,
    checkpoint_tensors,
)

from .procs import ServerProcess  # noqa: E402
from .vllm_support import (  # noqa: E402,F401
    PROMPTS,
    ENGINE_SIZES,
    SHARDS,
    Trainer,
    _local,
    checkpoints,
    deepseek_config,
    dense_config,
    hf_parameters,
    model_of,
    moe_config,
    save,
)

pytestmark = [
    pytest.mark.integration,
    # engine start-up (compiling) took 60-290 s per test on two cores shared with other work, and a
    # whole multiprocess test of the MoE or DeepSeek model 220-650 s at load 10-20
    pytest.mark.timeout(1500),
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning",
                               "ignore::ResourceWarning", "ignore::RuntimeWarning",
                               "ignore::pytest.PytestUnraisableExceptionWarning"),
]  # fmt: skip

def generate(llm: vllm.LLM) -> list[list[int]]:
    params = vllm.SamplingParams(temperature=0, max_tokens=12, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reference(llm: vllm.LLM, path: str) -> list[list[int]]:
    """The engine's tokens with ``path``'s checkpoint loaded by vLLM's own loader."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
    llm.reset_prefix_cache()
    return generate(llm)


def engine(path: str, **kw: object) -> vllm.LLM:
    """vLLM's default compiled mode (no enforce_eager), in this process."""
    return vllm.LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", gpu_memory_utilization=0.3, **ENGINE_SIZES,
                    distributed_executor_backend="uni", weight_transfer_config={"backend": "tensorhub"}, **kw)  # fmt: skip


from .vllm_support import _fresh_vllm_process_state  # noqa: E402,F401 - an autouse fixture


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    s.stop()


def _round_trip(llm: vllm.LLM, ck: tuple, server, model: str, cls: type, after_init=lambda: None, fused: bool = False) -> dict:
    """v1 and v2 from a trainer of SHARDS shards; each equals the engine loaded from its checkpoint.
    v2 is prefetched and swapped in; returns that update's phases (the backend's ``last``). After
    each update no live tensor of the engine shares memory with the staging set (which the next
    pull overwrites), and a peer pulling v2 from the engine gets exactly v2's bytes, verified
    against the checksums the engine declared when it converted them (the build did not write
    into the memory it publishes). With ``fused``, the trainer publishes what transformers 5 holds
    (:func:`hf_parameters`: the routed experts fused), not the checkpoint's per-expert tensors."""
    d, weights = ck  # the model's checkpoints (vllm_support.checkpoints)
    w1, w2 = weights[1], weights[2]
    if fused:
        w1, w2 = hf_parameters(cls, str(d / "v1")), hf_parameters(cls, str(d / "v2"))
        assert "model.layers.1.mlp.experts.gate_up_proj" in w1 and not any(".mlp.experts.0." in n for n in w1)
    before = generate(llm)
    trainer = Trainer(model, w1, server.address, LLMClient(llm), {"replica": f"rollout-{model}", "timeout": 120})
    try:
        trainer.send(1, w1)
        assert live_sharing_staging(llm) == []
        after_init()
        llm.reset_prefix_cache()
        got1 = generate(llm)
        assert llm.get_weight_version() == "1"
        assert got1 != before
        assert got1 == reference(llm, str(d / "v1"))
        # v2 while serving: the pull lands in staging while the engine generates from v1
        trainer.send(2, w2, drive=False)
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": 2, "prefetch": True}})  # returns at once
        assert generate(llm) == got1
        # the prefetch pulls v2 and builds its processed layers beside the live ones: still v1 served
        deadline = time.monotonic() + 300
        while backend(llm).staged != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend(llm).staged == 2
        assert generate(llm) == got1
        llm.update_weights({"update_info": {"version": 2}})  # the swap (and what is processed in the pause)
        llm.finish_weight_update(weight_version="2")
        last = dict(backend(llm).last)
        assert "swap_s" in last, last  # swapped in, not replayed
        llm.reset_prefix_cache()
        got2 = generate(llm)
        assert llm.get_weight_version() == "2"
        assert got2 != got1
        assert got2 == reference(llm, str(d / "v2"))
        assert live_sharing_staging(llm) == []
        _peer_pulls(backend(llm), server, w2)
        return last
    finally:
        llm.shutdown_weight_transfer_engine()
        trainer.close()


def _refuses_held(b) -> None:  # noqa: ANN001 - a TensorHubWeightTransferEngine holding v1
    """A pull into a staging set whose memory something else holds (a view kept by a processed
    layer, say) is refused before anything moves, naming the parameter."""
    st = b.sets[b._target()]
    assert st is not b.sets[b._pulled] and st.handle.version is None  # the other set, empty
    (mod, name), memory = next(iter(st.lent.items()))
    held = memory[:1]  # noqa: F841 - held while the pull is tried
    names = {id(m): n for n, m in b.model.named_modules()}
    with pytest.raises(ContractViolation, match=re.escape(f"{names[id(mod)]}.{name}")):
        b._pull(99)
    del held
    assert b.staged == 1 and st.handle.version is None


def live_sharing_staging(llm: vllm.LLM) -> list[str]:
    """The engine's live tensors (parameters, buffers, tensor attributes of its modules and of
    the objects they hold, such as an attention layer's ``impl`` with MLA's matrices derived from
    ``kv_b_proj``) whose memory is the staging set the next pull lands in: what it would
    overwrite under the engine."""
    b = backend(llm)
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
             for t in b.sets[b._target()].tensors.values()]  # fmt: skip
    out = []
    for name, mod in b.model.named_modules():
        found = [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
        for k, v in vars(mod).items():
            if isinstance(v, torch.Tensor):
                found.append((k, v))
            elif not isinstance(v, (torch.nn.Module, dict, list, tuple)) and hasattr(v, "__dict__"):
                found += [(f"{k}.{k2}", v2) for k2, v2 in vars(v).items() if isinstance(v2, torch.Tensor)]
        for k, t in found:
            st = t.untyped_storage()
            lo, hi = st.data_ptr(), st.data_ptr() + st.nbytes()
            if lo != hi and any(a < hi and lo < z for a, z in spans):
                out.append(f"{name}.{k}")
    return out


def _peer_pulls(b, server, weights: dict[str, torch.Tensor]) -> None:  # noqa: ANN001 - a TensorHubWeightTransferEngine
    """A plain handle of the engine's converted model pulls the version the engine holds (from
    the engine: nobody else holds it) and gets the trainer's bytes in the engine's dtypes."""
    import tensorhub

    h = b.handle
    version = h.version
    # of the same converted model (its declaration too), so a peer of the engine's layout
    peer = tensorhub.open(h.model, "peer", num_shards=1, shard_idx=0, server=server.address, convert_from=h.convert_from,
                          mapping=h.mapping)  # fmt: skip
    try:
        tensors = {n: torch.empty_like(t) for n, t in b.staging.items()}
        peer.register(tensors, placements={n: TensorPlacement(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), (1,),
                                                              (REPLICATE,)) for n, t in tensors.items()})  # fmt: skip
        assert peer.replicate(version, 60) == version
        for n, t in tensors.items():
            assert torch.equal(t, weights[n].to(t.dtype)), n
    finally:
        peer.close()


def backend(llm: vllm.LLM):  # noqa: ANN201 - the in-process worker's TensorHubWeightTransferEngine
    return llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine


def test_dense_compiled_in_process(tmp_path_factory, server):
    ck = checkpoints("dense", tmp_path_factory)
    d, base = ck[0], ck[1][0]
    llm = engine(str(d / "v0"), worker_extension_cls=EXTENSION)
    try:
        # bad info is a typed error naming what was wrong
        with pytest.raises(InvalidArgument, match="source_model"):
            llm.init_weight_transfer_engine({"init_info": {"replica": "r"}})
        with pytest.raises(InvalidArgument, match="unexpected keyword"):
            llm.init_weight_transfer_engine({"init_info": {"source_model": "qwen", "replica": "r", "sever": "x"}})
        # a checkpoint without one of the engine's tensors: refused at init, naming the parameter
        tensors = checkpoint_tensors(str(d / "v0"))
        del tensors["model.layers.1.mlp.down_proj.weight"]
        short = {"source_model": "qwen", "replica": "r", "server": server.address, "names": list(tensors),
                 "dtype_names": [d for d, _ in tensors.values()], "shapes": [list(s) for _, s in tensors.values()]}  # fmt: skip
        with pytest.raises(MappingMismatch, match=r"model\.layers\.1\.mlp\.down_proj") as err:
            llm.init_weight_transfer_engine({"init_info": short})
        assert "model.layers.1.mlp.down_proj.weight" in err.value.tensors
        with pytest.raises(UsageError, match="init_weight_transfer_engine first"):
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": 1}})
        # the worker extension refuses compiled mode clearly (it would break the next generate())
        with pytest.raises(UsageError, match="enforce_eager"):
            llm.collective_rpc("tensorhub_open", kwargs={"model": "qwen-x", "replica": "x", "family": "qwen3",
                                                          "convert_from": "qwen", "server": server.address})  # fmt: skip
        assert generate(llm)  # still serving
        last = _round_trip(llm, ck, server, "qwen", transformers.Qwen3ForCausalLM, after_init=lambda: _refuses_held(backend(llm)))
        assert last["in_pause_modules"] == 0  # every module of a dense model processed during the prefetch
        # every parameter was built where the pull landed it, nothing copied: two staging sets
        assert last["lent_mib"] * 2**20 == sum(t.numel() * 2 for t in base.values())
        # the tensorhub backend's state, as an HTTP client reads it through /collective_rpc (shut down: nothing staged)
        (state,) = llm.collective_rpc("tensorhub_backend")
        assert state["loaded"] == 2 and state["staged"] is None and "swap_s" in state["last"]
        assert state["build_while_landing"] is True  # the default: each module built as its tensors land
        (state,) = llm.collective_rpc("tensorhub_backend", kwargs={"build_while_landing": False})
        assert state["build_while_landing"] is False and backend(llm).build_while_landing is False
        (state,) = llm.collective_rpc("tensorhub_backend", kwargs={"build_while_landing": True})
        assert state["build_while_landing"] is True
        with pytest.raises(InvalidArgument, match="build_while_landing"):
            llm.collective_rpc("tensorhub_backend", kwargs={"build_while_landing": "no"})
        with pytest.raises(InvalidArgument, match="version"):
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": -1}})
        _built_as_landed_with_a_damaged_byte(llm, ck, server)
    finally:
        llm.shutdown_weight_transfer_engine()
        del llm


def _built_as_landed_with_a_damaged_byte(llm: vllm.LLM, ck: tuple, server) -> None:  # noqa: ANN001
    """An update without a prefetch builds each module's processed weights as soon as the
    conversion says its staging tensors are landed and verified, while later ones land
    (:meth:`TensorHubWeightTransferEngine._pull_and_build`). One byte of the trainer's bytes is
    damaged on the way (the first read that covers it): that read fails its checksum and is read
    again, and no module is built from bytes other than the version's (checked at the start of
    every build; three reads are held back so that a build which did not wait for all of its
    module's tensors would see one missing); the tokens equal vLLM's own load of the same weights."""
    from tensorhub.transports import faults

    d, weights = ck
    w3 = weights[1]  # the engine holds v2 (_round_trip's): back to v1's weights, a new trainer's version 1
    trainer = Trainer("qwen-dmg", w3, server.address, LLMClient(llm), {"replica": "rollout-dmg", "timeout": 120})
    b = backend(llm)
    engine_ = b.handle._engine  # this process's TensorHub engine: the trainer's and the backend's
    inner = engine_.transports["local"]
    at = trainer.engines[0].handle.buffers.total_bytes // 2  # the middle of trainer shard 0's bytes: a layer's tensor
    # and three reads held back 0.5 s each: the modules filled from them wait for them (checked at
    # every build's start), while the others are built meanwhile, during the pull
    late = [{"op": "delay", "seconds": 0.5, "after": k, "times": 1} for k in (3, 11, 19)]
    wrapped = faults.wrap(inner, [{"op": "corrupt", "at": at, "times": 1}, *late])
    wrong: list[str] = []
    build = b._build_module

    def checked(mod, scatters, info, lent):  # noqa: ANN001, ANN202 - _build_module's own
        for src in {sc.source for sc in scatters}:
            if not torch.equal(b.staging[src], w3[src].to(b.staging[src].dtype)):
                wrong.append(src)
        return build(mod, scatters, info, lent)

    b._build_module = checked
    engine_.transports["local"] = wrapped
    try:
        trainer.send(1, w3)  # start, update (no prefetch), finish
        last = dict(b.last)
        conv = b.handle.last_conversion
        assert sorted(f.op for f in wrapped.fired) == ["corrupt", "delay", "delay", "delay"]
        assert conv is not None and conv.failures == 1, conv  # the damaged read, refused and read again
        assert wrong == [], wrong  # every build saw the version's verified bytes
        # every module built beside the live one was built as its tensors were said landed
        assert last["built_landing"] == len(b._needs) > 0, last
        assert last["built_while_pulling"] > 0, last  # some while a held-back read had not landed yet
        assert [e for e in b.landing_log if e[0] == "begin"] == [("begin", "1")]
        llm.reset_prefix_cache()
        got = generate(llm)
        assert got == reference(llm, str(d / "v1"))
    finally:
        engine_.transports["local"] = inner
        del b._build_module
        llm.shutdown_weight_transfer_engine()
        trainer.close()


def traced(llm: vllm.LLM) -> set[str]:
    """The parameters the in-process worker's loader trace fills (``module.param``)."""
    backend = llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine
    names = {id(m): n for n, m in backend.model.named_modules()}
    return {f"{names[id(mod)]}.{s.param}" for mod, scatters in backend.trace.modules.items() for s in scatters}


def _fused_refusals(llm: vllm.LLM, d, server, cls: type) -> None:
    """transformers 5's fused expert tensors of a bad shape: a MappingMismatch at init, naming them."""
    params = hf_parameters(cls, str(d / "v0"))
    for bad, named in (((4, 255, 256), "model.layers.1.mlp.experts.gate_up_proj"),
                       ((3, 256, 128), r"model\.layers\.1\.mlp\.experts")):  # fmt: skip
        shapes = {n: list(t.shape) for n, t in params.items()}
        shapes["model.layers.1.mlp.experts.down_proj" if bad[0] == 3 else "model.layers.1.mlp.experts.gate_up_proj"] = list(bad)
        info = {"source_model": "bad", "replica": "r", "server": server.address, "names": list(shapes),
                "dtype_names": ["float32"] * len(shapes), "shapes": list(shapes.values())}  # fmt: skip
        with pytest.raises(MappingMismatch, match=named) as err:
            llm.init_weight_transfer_engine({"init_info": info})
        assert any(re.match(named, t) for t in err.value.tensors), err.value.tensors


def test_moe_compiled_in_process(tmp_path_factory, server):
    """Qwen3-MoE, its trainer on transformers 5: the routed experts published fused."""
    ck = checkpoints("moe", tmp_path_factory)
    llm = engine(str(ck[0] / "v0"))
    try:
        _fused_refusals(llm, ck[0], server, transformers.Qwen3MoeForCausalLM)
        seen: set[str] = set()
        last = _round_trip(llm, ck, server, "qwen-moe", transformers.Qwen3MoeForCausalLM, lambda: seen.update(traced(llm)),
                           fused=True)  # fmt: skip
        # the experts too are built beside the live ones (vLLM's fused-MoE method on CPU, once
        # its kernel exists, converts only the layer's own tensors): nothing processed in the pause
        assert last["in_pause_modules"] == 0, last
        # the experts, stacked: gate and up of every expert in w13, down in w2
        assert {p for p in seen if p.endswith(("w13_weight", "w2_weight"))} >= {
            f"model.layers.{i}.mlp.experts.routed_experts.{w}" for i in range(2) for w in ("w13_weight", "w2_weight")}
    finally:
        del llm


def test_deepseek_v3_shaped_compiled_in_process(tmp_path_factory, server):
    ck = checkpoints("deepseek", tmp_path_factory)
    llm = engine(str(ck[0] / "v0"))
    try:
        seen: set[str] = set()
        lent: set[str] = set()

        def after_init() -> None:
            seen.update(traced(llm))
            names = {id(m): n for n, m in backend(llm).model.named_modules()}
            lent.update(f"{names[id(m)]}.{p}" for m, p in backend(llm).sets[0].lent)

        # its trainer on transformers 5 too: vLLM's DeepSeek loader takes per-expert names only
        last = _round_trip(llm, ck, server, "deepseek", transformers.DeepseekV3ForCausalLM, after_init, fused=True)
        assert "model.layers.1.self_attn.fused_qkv_a_proj.weight" in seen  # MLA's fused q_a + kv_a
        # kv_b_proj's weight too is built where the pull lands it, and MLA's attention derives its
        # matrices from it: _round_trip checked, after each update, that no live tensor (the
        # attention layers' included) shares the memory the next pull lands in, and that the
        # engine served v1 unchanged while v2 was pulled and built
        assert {"model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.self_attn.q_b_proj.weight",
                "model.layers.1.mlp.shared_experts.down_proj.weight"} <= lent, sorted(lent)
        assert last["lent_mib"] > 0
    finally:
        del llm


ENGINE_SCRIPT = r"""
import json, os, sys, time
import vllm
from tensorhub.integrations.vllm_backend import LLMClient, update
from tensorhub.tools.admin import cluster_state

def main():
    base, server, model, v1, v2, signal = sys.argv[1:7]
    prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[7])]
    sizes = json.loads(sys.argv[8])
    tp, mode = int(sys.argv[9]), sys.argv[10]
    llm = vllm.LLM(model=base, skip_tokenizer_init=True, dtype="bfloat16", gpu_memory_utilization=0.3, **sizes,
                   weight_transfer_config={"backend": "tensorhub"}, tensor_parallel_size=tp, enforce_eager=mode == "eager")
    params = vllm.SamplingParams(temperature=0, max_tokens=12, detokenize=False, ignore_eos=True)
    gen = lambda: [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    out = {"before": gen()}
    llm.init_weight_transfer_engine({"init_info": {"source_model": model, "replica": f"rollout-tp{tp}", "server": server}})
    # "latest", resolved before the workers load it, so that vLLM's weight version names it
    assert update(LLMClient(llm), "latest", source_model=model, server=server) == 1
    llm.reset_prefix_cache()
    out["got1"], out["version1"] = gen(), llm.get_weight_version()
    # the shards of the engine's converted model, as the reference server sees them: one per worker
    out["shards"] = {m.model: [[r.replica, [[sh.shard_idx, sh.version, sh.state] for sh in r.shards]] for r in m.replicas]
                     for m in cluster_state(server, 10).models}
    # v2 prefetched (the workers wait for the trainer to publish it, told to by the signal file)
    # while the engine keeps generating from v1, then swapped in
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 2, "prefetch": True}})
    with open(signal, "w") as f:
        f.write("v1 loaded")
    out["during"] = gen()
    llm.update_weights({"update_info": {"version": 2}})
    llm.finish_weight_update(weight_version="2")
    llm.reset_prefix_cache()
    out["got2"], out["version2"] = gen(), llm.get_weight_version()
    llm.shutdown_weight_transfer_engine()
    for v, path in (("1", v1), ("2", v2)):  # vLLM's own loader, the same checkpoints
        llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        llm.reset_prefix_cache()
        out["reference" + v] = gen()
    print("RESULT " + json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
"""


def _two_versions(tmp_path, tmp_path_factory, server, model: str, kind: str, script: str, *args: str,
                  timeout: float = 1300) -> dict:  # fmt: skip
    """``script`` (ENGINE_SCRIPT or ASYNC_SCRIPT) in a process of its own, in vLLM's multiprocess
    mode, started from the ``kind`` model's v0 checkpoint: a trainer of SHARDS publishes v1; once the
    engine holds it and has started prefetching v2 (its signal file), the trainer publishes v2.
    Checks that each version's greedy tokens equal vLLM's own load of its checkpoint, differ from
    the version before, and that vLLM reports it; returns the script's result."""
    d, weights = checkpoints(kind, tmp_path_factory)
    w1, w2 = weights[1], weights[2]
    trainer = Trainer(model, w1, server.address, None, None)
    (tmp_path / "engine.py").write_text(script)
    signal, log = tmp_path / "v1-loaded", tmp_path / "engine.log"
    proc = None
    try:
        trainer.send(1, w1, drive=False)
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        with open(log, "w") as out:  # a file, not a pipe nobody reads while the engine starts
            proc = subprocess.Popen([sys.executable, str(tmp_path / "engine.py"), str(d / "v0"), server.address, model,
                                     str(d / "v1"), str(d / "v2"), str(signal), json.dumps(PROMPTS), json.dumps(ENGINE_SIZES),
                                     *args],
                                    stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + timeout
        while not signal.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        if signal.exists():
            trainer.send(2, w2, drive=False)
        proc.wait(max(1.0, deadline - time.monotonic()))
        text = log.read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"the engine process failed ({proc.returncode}):\n{text[-6000:]}"
    finally:
        if proc is not None and proc.poll() is None:  # its engine core and workers too (its process group)
            os.killpg(proc.pid, signal_.SIGKILL)
            proc.wait(60)
        trainer.close()
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert (out["version1"], out["version2"]) == ("1", "2")
    assert out["during"] == out["got1"]  # generation went on from v1 while v2 was prefetched
    assert out["got1"] != out["before"] and out["got2"] != out["got1"]
    assert out["got1"] == out["reference1"]
    assert out["got2"] == out["reference2"]
    return out


def _engine_process(tmp_path, tmp_path_factory, server, model: str, tp: int, mode: str, kind: str = "dense") -> dict:
    """ENGINE_SCRIPT (an offline ``LLM``) with ``tp`` workers, ``mode`` "compiled" or "eager":
    v1 loaded as "latest", v2 prefetched while generating, each equal to vLLM's own load."""
    return _two_versions(tmp_path, tmp_path_factory, server, model, kind, ENGINE_SCRIPT, str(tp), mode)


def test_dense_multiprocess(tmp_path, tmp_path_factory, server):
    """vLLM's default multiprocess mode: the engine core and its worker in another process."""
    out = _engine_process(tmp_path, tmp_path_factory, server, "qwen-mp", 1, "compiled")
    _one_holding(out["shards"]["qwen-mp:vllm-bfloat16-w1"], "rollout-tp1", [[0, 1, "complete"]])


def test_dense_tensor_parallel_2(tmp_path, tmp_path_factory, server):
    """Tensor parallelism 2 on the CPU build: two worker processes, two shards of one replica of
    the converted model, each traced from its own loader (its tensor-parallel slices)."""
    out = _engine_process(tmp_path, tmp_path_factory, server, "qwen-tp", 2, "eager")
    _one_holding(out["shards"]["qwen-tp:vllm-bfloat16-w2"], "rollout-tp2", [[0, 1, "complete"], [1, 1, "complete"]])


def test_moe_multiprocess(tmp_path, tmp_path_factory, server):
    """Qwen3-MoE in vLLM's default mode: multiprocess, compiled."""
    out = _engine_process(tmp_path, tmp_path_factory, server, "moe-mp", 1, "compiled", "moe")
    _one_holding(out["shards"]["moe-mp:vllm-bfloat16-w1"], "rollout-tp1", [[0, 1, "complete"]])


def test_moe_tensor_parallel_2(tmp_path, tmp_path_factory, server):
    """Qwen3-MoE with tensor parallelism 2: every expert's w13/w2 cut in two, one half per worker
    process (vLLM's fused-MoE tensor parallelism), traced from each worker's own loader."""
    out = _engine_process(tmp_path, tmp_path_factory, server, "moe-tp", 2, "eager", "moe")
    _one_holding(out["shards"]["moe-tp:vllm-bfloat16-w2"], "rollout-tp2", [[0, 1, "complete"], [1, 1, "complete"]])


def test_deepseek_v3_shaped_multiprocess(tmp_path, tmp_path_factory, server):
    """MLA + experts + a shared expert, multiprocess and compiled."""
    out = _engine_process(tmp_path, tmp_path_factory, server, "ds-mp", 1, "compiled", "deepseek")
    _one_holding(out["shards"]["ds-mp:vllm-bfloat16-w1"], "rollout-tp1", [[0, 1, "complete"]])


def test_deepseek_v3_shaped_tensor_parallel_2(tmp_path, tmp_path_factory, server):
    """MLA with tensor parallelism 2 (q_b/kv_b cut by rows, o_proj by columns; fused_qkv_a_proj
    whole on each rank) and its experts cut in two."""
    out = _engine_process(tmp_path, tmp_path_factory, server, "ds-tp", 2, "eager", "deepseek")
    _one_holding(out["shards"]["ds-tp:vllm-bfloat16-w2"], "rollout-tp2", [[0, 1, "complete"], [1, 1, "complete"]])


def _one_holding(replicas: list, replica: str, shards: list) -> None:
    """The converted model's replicas on the server: the engine's first staging set (``replica``)
    holds the version in every shard; its second (``replica@alt``), if any, holds nothing yet."""
    got = {r: s for r, s in replicas}
    assert got[replica] == shards, replicas
    assert set(got) <= {replica, f"{replica}@alt"}, replicas
    assert not any(st == "complete" for _, _, st in got.get(f"{replica}@alt", [])), replicas


class _Recorder:
    """A VLLMWeightSyncClient that records the calls (no engine)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append(("init", init_info))

    def start_weight_update(self) -> None:
        self.calls.append(("start",))

    def update_weights(self, update_info: dict) -> None:
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))


def test_info_and_trainer_bad_input_and_calls(tmp_path, server):
    """No engine: the info classes, the checkpoint reader, update() and the trainer engine."""
    from tensorhub.integrations.vllm_backend import TensorHubInitInfo, TensorHubUpdateInfo, latest_version, update

    for bad in ({"version": -1}, {"version": "newest"}, {"version": True}, {"version": 1, "prefetch": "yes"}):
        with pytest.raises(InvalidArgument, match="version|prefetch"):
            TensorHubUpdateInfo(**bad)
    assert TensorHubUpdateInfo(version="7").version == 7
    with pytest.raises(InvalidArgument, match="replica"):
        TensorHubInitInfo(source_model="m")
    with pytest.raises(InvalidArgument, match="one entry per tensor"):
        TensorHubInitInfo(source_model="m", replica="r", names=["a"], dtype_names=[], shapes=[])
    with pytest.raises(InvalidArgument, match="unknown dtype_names"):
        TensorHubInitInfo(source_model="m", replica="r", names=["a"], dtype_names=["float7"], shapes=[[1]])
    with pytest.raises(InvalidArgument, match="no \\*.safetensors"):
        checkpoint_tensors(str(tmp_path))
    (tmp_path / "x.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(InvalidArgument, match="cannot read the safetensors header"):
        checkpoint_tensors(str(tmp_path))
    with pytest.raises(InvalidArgument, match="source_model"):
        update(_Recorder(), "latest")
    with pytest.raises(InvalidArgument, match="model="):
        TensorHubTrainerWeightTransferEngine.trainer_init(TensorHubTrainerInitInfo(rank=0), tensors={})
    # vLLM's factories find both sides by the backend's name (the plugin registers module paths)
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from tensorhub.integrations.vllm_backend import TensorHubWeightTransferEngine
    from tensorhub.integrations.vllm_plugin import register

    register()
    assert WeightTransferEngineFactory._registry["tensorhub"]() is TensorHubWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["tensorhub"]() is TensorHubTrainerWeightTransferEngine

    # a one-shard trainer: it sends the engine its tensors' names and shapes, publishes a
    # reference, and drives start / update / finish with the version as vLLM's weight version
    client = _Recorder()
    weights = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b.bias": torch.ones(5)}
    info = TensorHubTrainerInitInfo(rank=0, model="tiny", num_shards=1, shard_idx=0, server=server.address,
                                    engine={"replica": "rollout-9"})  # fmt: skip
    trainer = TensorHubTrainerWeightTransferEngine.trainer_init(info, client=client, tensors=weights)
    try:
        ((what, init),) = client.calls
        assert what == "init" and init["source_model"] == "tiny" and init["replica"] == "rollout-9"
        assert init["names"] == ["a.weight", "b.bias"] and init["shapes"] == [[3, 4], [5]]
        assert latest_version("tiny", server.address) is None
        trainer.send_weights(4)
        assert client.calls[1:] == [("start",), ("update", {"version": 4}), ("finish", "4")]
        assert latest_version("tiny", server.address) == 4
        assert update(client, "latest", source_model="tiny", server=server.address) == 4
        assert client.calls[-1] == ("finish", "4")
    finally:
        trainer.shutdown()
    # shared_memory: the same tensors, moved into shared-memory files (a same-host engine in
    # another process maps them); a value that is not a bool is refused, naming the option
    shm = {"c.weight": torch.ones(1024, 1024)}  # 4 MiB, not packed (tiny tensors stay packed in place)
    info = TensorHubTrainerInitInfo(rank=0, model="tiny-shm", num_shards=1, shard_idx=0, server=server.address, shared_memory=True)
    trainer = TensorHubTrainerWeightTransferEngine.trainer_init(info, tensors=shm)
    try:
        assert shm["c.weight"].is_shared() and trainer.tensors["c.weight"] is shm["c.weight"]
        assert trainer.publish() == 1 and latest_version("tiny-shm", server.address) == 1
    finally:
        trainer.shutdown()
    bad = TensorHubTrainerInitInfo(rank=0, model="tiny-bad", num_shards=1, shard_idx=0, server=server.address, shared_memory="yes")
    with pytest.raises(InvalidArgument, match="shared_memory"):
        TensorHubTrainerWeightTransferEngine.trainer_init(bad, tensors={"d": torch.ones(2)})


def test_dispatch_kept_only_for_the_linear_fallback(monkeypatch):
    """A build skips a module's processing only where vLLM's CPU GEMM dispatch fell back to
    F.linear (nothing packed); a dispatch that packed the weight into a handle is redone."""
    from vllm.model_executor.layers import utils as lu
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from tensorhub.integrations.vllm_shadow import _dispatch_kept

    def layer() -> torch.nn.Module:
        mod = torch.nn.Module()
        mod.weight = torch.nn.Parameter(torch.randn(64, 32).to(torch.bfloat16), requires_grad=False)
        return mod

    monkeypatch.setattr(lu, "check_cpu_sgl_kernel", lambda *a: False)
    fallback = layer()
    assert not _dispatch_kept(fallback, UnquantizedLinearMethod())  # not dispatched yet
    monkeypatch.setattr(lu.ops, "_supports_onednn", False)
    lu.dispatch_cpu_unquantized_gemm(fallback, remove_weight=True)
    assert _dispatch_kept(fallback, UnquantizedLinearMethod()) and _dispatch_kept(fallback, UnquantizedEmbeddingMethod())
    x = torch.randn(3, 32).to(torch.bfloat16)
    assert torch.equal(fallback.cpu_linear(x, fallback.weight, None), torch.nn.functional.linear(x, fallback.weight))
    assert not _dispatch_kept(fallback, object())  # another method: processed again

    # oneDNN's dispatch closes over its handle (a packed copy of the weight): built again
    monkeypatch.setattr(lu.ops, "_supports_onednn", True)
    monkeypatch.setattr(lu.ops, "create_onednn_mm", lambda weight, cache: ("handle", weight.shape))
    packed = layer()
    lu.dispatch_cpu_unquantized_gemm(packed, remove_weight=True)
    assert packed.cpu_linear.__code__.co_freevars and not _dispatch_kept(packed, UnquantizedLinearMethod())


ASYNC_SCRIPT = r"""
import asyncio, itertools, json, sys
import vllm
from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM

async def amain():
    base, server, model, v1, v2, signal = sys.argv[1:7]
    prompts = json.loads(sys.argv[7])
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=base, skip_tokenizer_init=True, dtype="bfloat16", gpu_memory_utilization=0.3, **json.loads(sys.argv[8]),
        weight_transfer_config={"backend": "tensorhub"}))
    params = vllm.SamplingParams(temperature=0, max_tokens=12, detokenize=False, ignore_eos=True)
    ids = itertools.count()

    async def one(p):
        final = None
        async for out in engine.generate({"prompt_token_ids": p}, params, request_id=f"r{next(ids)}"):
            final = out
        return list(final.outputs[0].token_ids)

    async def gen():
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def load(version):
        await engine.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))
        await engine.finish_weight_update(weight_version=str(version))
        await engine.reset_prefix_cache()
        return await gen(), await engine.get_weight_version()

    out = {}
    try:
        out["before"] = await gen()
        await engine.init_weight_transfer_engine(WeightTransferInitRequest(
            init_info={"source_model": model, "replica": "rollout-async", "server": server}))
        # v1 prefetched while the rollout server keeps generating (from the engine's own weights)
        await engine.start_weight_update()
        await engine.update_weights(WeightTransferUpdateRequest(update_info={"version": 1, "prefetch": True}))
        out["during1"] = await gen()
        out["got1"], out["version1"] = await load(1)
        # v2: the prefetch waits for the trainer (told by the signal file) while requests go on from v1
        await engine.start_weight_update()
        await engine.update_weights(WeightTransferUpdateRequest(update_info={"version": 2, "prefetch": True}))
        with open(signal, "w") as f:
            f.write("v1 loaded")
        out["during"] = await gen()
        out["got2"], out["version2"] = await load(2)
        await engine.shutdown_weight_transfer_engine()
        for v, path in (("1", v1), ("2", v2)):  # vLLM's own loader, the same checkpoints
            await engine.collective_rpc("reload_weights", kwargs={"weights_path": path})
            await engine.reset_prefix_cache()
            out["reference" + v] = await gen()
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps(out), flush=True)

if __name__ == "__main__":
    asyncio.run(amain())
"""


def test_dense_async_llm(tmp_path, tmp_path_factory, server):
    """AsyncLLM (an asyncio rollout server's engine): each version prefetched while it keeps
    generating from the one before."""
    out = _two_versions(tmp_path, tmp_path_factory, server, "qwen-async", "dense", ASYNC_SCRIPT)
    assert out["during1"] == out["before"]


def test_moe_async_llm(tmp_path, tmp_path_factory, server):
    """AsyncLLM serving Qwen3-MoE: the same two versions, experts and all."""
    out = _two_versions(tmp_path, tmp_path_factory, server, "moe-async", "moe", ASYNC_SCRIPT)
    assert out["during1"] == out["before"]


def test_deepseek_v3_shaped_async_llm(tmp_path, tmp_path_factory, server):
    """AsyncLLM serving the DeepSeek-V3-shaped model (MLA, routed and shared experts)."""
    out = _two_versions(tmp_path, tmp_path_factory, server, "ds-async", "deepseek", ASYNC_SCRIPT)
    assert out["during1"] == out["before"]
