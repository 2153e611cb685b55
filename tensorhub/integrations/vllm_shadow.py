"""The shadow of a vLLM worker's model: the next version's processed layers, built beside the
live ones while the engine serves (:mod:`tensorhub.integrations.vllm_backend`'s BUILD and SWAP).

What is here decides which modules may be built beside the live ones (:func:`_shadowable`) and
which need not be processed again (:func:`_dispatch_kept`), makes
their tensors real in the storages a previous swap retired (:func:`_materialize`, never one that a
view still shares: :func:`_unshared`), copies a module without its tensors (:func:`_copy_module`)
and compares layouts (:func:`_same_layout`); it builds a parameter over a staging set's memory
(:func:`_over`) and counts who holds a storage (:func:`_use_count`). The engine does the
building and the swapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: what a module's ``__dict__`` holds of its tensors and children (not attributes processing set)
_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
_MISSING = object()

__all__ = ["_MISSING", "_MODULE_STATE", "_Shadow", "_copy_module", "_dispatch_kept", "_materialize", "_over",
           "_same_layout", "_shadowable", "_unshared", "_use_count"]


@dataclass
class _Shadow:
    """The processed layers of one staged version, waiting to be swapped in.

    Attributes:
        swaps: per module, (module, its processed parameters, buffers, the attributes its
            processing set, the attributes it removed).
        pending: modules of kinds processed in the pause instead (:func:`_shadowable`).
        nbytes: the shadow's tensors (what the CPU kernels pack, e.g. oneDNN's copy of a
            weight, is not counted: it lives in the kernel's handle).
        lent: the bytes of weights processed where the pull landed them (not copied).
    """

    version: int
    swaps: list[tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], set[str]]] = field(default_factory=list)  # fmt: skip
    pending: list[Any] = field(default_factory=list)
    nbytes: int = 0
    lent: int = 0  #: bytes of weights built where the pull landed them (the staging set's memory): not copied
    seconds: float = 0.0


def _shadowable(mod: torch.nn.Module) -> bool:
    """Whether ``mod``'s weight processing may run on a copy of it while it serves: no
    processing at all (norms), or vLLM's unquantized linear and embedding methods, whose
    ``process_weights_after_loading`` (vLLM 0.32) reads the layer's own tensors and sets the
    layer's own attributes only (CPU: ``dispatch_cpu_unquantized_gemm``), or the unquantized
    fused-MoE method on a weight update (:func:`_experts_alone`). Other methods keep state of
    their own or read other layers (attention): those modules are processed in the pause."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.meta import SKIP_MODULES

    if is_deferred_attention_layer(mod) or type(mod).__name__ in SKIP_MODULES:
        return False
    quant = getattr(mod, "quant_method", None)
    if not isinstance(quant, QuantizeMethodBase) or type(quant) in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
        return True
    return _experts_alone(quant)


def _experts_alone(quant: Any) -> bool:
    """Whether a fused-MoE layer's processing, run again, touches only that layer's own tensors:
    vLLM's (0.32) ``UnquantizedFusedMoEMethod`` once its kernel exists (a weight update: it then
    converts the layer's ``w13``/``w2`` into its kernel's format, copied into the layer's own
    parameters, and neither rebuilds the kernel nor prepacks), weights not pre-processed (which
    rebuilds the kernel), on the CPU backend, whose conversion only makes them contiguous (other
    backends shuffle, pad the shared config or stash layouts on the layer: processed in the pause)."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.utils import is_weights_pre_processed

    return (type(quant) is UnquantizedFusedMoEMethod and getattr(quant, "moe_kernel", None) is not None
            and getattr(quant, "unquantized_backend", None) == UnquantizedMoeBackend.CPU
            and not is_weights_pre_processed())  # fmt: skip


def _dispatch_kept(mod: torch.nn.Module, quant: Any) -> bool:
    """Whether processing ``mod`` again would set only what it holds now, so that its copy may
    skip ``process_weights_after_loading``: vLLM's (0.32) unquantized linear and embedding
    methods on CPU do nothing but ``dispatch_cpu_unquantized_gemm``, and for ``mod`` that
    dispatch fell back to ``torch.nn.functional.linear`` (its lambda, which closes over nothing:
    no packed copy of the weight, the weight kept as it is; oneDNN's, sgl's and zentorch's
    close over their packed weight or handle and are built again). The dispatch decides by the
    platform and the weight's shape and dtype, which an update keeps (the swap checks the
    layout), so the fallback it chose stays the answer; on a CPU where oneDNN cannot build the
    matmul (AVX2 with bf16) every attempt costs about 0.7 ms and fails again."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    if type(quant) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod) or not current_platform.is_cpu():
        return False
    fn = vars(mod).get("cpu_linear")
    code = getattr(fn, "__code__", None)
    weight = getattr(mod, "weight", None)
    return (code is not None and not code.co_freevars and getattr(fn, "__module__", None) == "vllm.model_executor.layers.utils"
            and getattr(fn, "__qualname__", "") == "dispatch_cpu_unquantized_gemm.<locals>.<lambda>"
            and isinstance(weight, torch.Tensor) and weight.numel() > 0)  # fmt: skip


def _over(meta: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``meta``'s parameter (its class and attributes: the weight loader...) over ``buffer``'s
    memory, as a tensor object of its own: what processing replaces or rebinds is this object,
    never ``buffer``."""
    t = buffer.detach()
    t.__class__ = meta.__class__
    t.__dict__ = meta.__dict__.copy()
    return t


def _use_count(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) hold ``t``'s storage, this call's own included.
    Unknown (a torch without the counter): a large number (held)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return int(count(t.untyped_storage()._cdata)) if count is not None else 1 << 30


def _materialize(meta: torch.Tensor, spare: torch.Tensor | None) -> torch.Tensor:
    """``meta`` (a parameter or buffer in the checkpoint layout, on the meta device) made real:
    in ``spare``'s storage when it has that layout (the tensor a swap retired), else new."""
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

    if (spare is None or spare.shape != meta.shape or spare.stride() != meta.stride() or spare.dtype != meta.dtype
            or not _unshared(spare)):  # fmt: skip
        return materialize_meta_tensor(meta)
    spare.__class__ = meta.__class__
    spare.__dict__ = meta.__dict__.copy()
    return spare


def _unshared(t: torch.Tensor, known: int = 0) -> bool:
    """Whether nothing but ``t`` (and ``known`` other tensors: the parameter whose ``.data`` it
    is) holds its storage: no view of it lives on (MLA's processing keeps views of
    ``kv_b_proj``'s weight in the attention layer). Unknown (a torch without the counter): no."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return False
    return bool(count(t.untyped_storage()._cdata) <= 2 + known)  # t, the storage object asked here


def _copy_module(mod: torch.nn.Module) -> Any:
    """A copy of ``mod`` sharing its attributes and children, with no tensors of its own yet
    (what processing assigns lands on the copy)."""
    copy = mod.__class__.__new__(mod.__class__)
    copy.__dict__.update(vars(mod))
    copy.__dict__.update(_parameters={}, _buffers={}, _modules=dict(mod._modules),
                         _non_persistent_buffers_set=set(mod._non_persistent_buffers_set))  # fmt: skip
    return copy


def _same_layout(new: dict[str, torch.Tensor], live: dict[str, torch.Tensor], exact: bool) -> bool:
    """Whether every tensor of ``new`` has its live counterpart's shape and dtype (and, with
    ``exact``, the same names)."""
    if exact and set(new) != set(live):
        return False
    return all(n in live and live[n].shape == t.shape and live[n].dtype == t.dtype for n, t in new.items())
