"""TensorHub in vLLM: a worker extension that lands new weights in the engine's own parameters.

For vLLM 0.32 and later, prefer the weight-transfer backend
(:mod:`tensorhub.integrations.vllm_backend`, ``weight_transfer_config={"backend": "tensorhub"}``):
any architecture, vLLM's compiled mode, its own API and HTTP routes. This extension is the route
for engines without that API; on vLLM's CPU build it needs ``enforce_eager=True`` (it refuses a
compiled engine, see ``tensorhub_open``).

::

    from vllm import LLM
    llm = LLM(model=DIR, worker_extension_cls="tensorhub.integrations.vllm.WorkerExtension", ...)
    llm.collective_rpc("tensorhub_open", kwargs={"model": "qwen-vllm", "replica": "rollout-0",
                                                 "convert_from": "qwen", "family": "qwen2"})
    llm.collective_rpc("tensorhub_update")        # [True, ...]: every worker moved
    llm.reset_prefix_cache()                      # the KV cache was computed with the old weights

How it works. vLLM runs ``WorkerExtension``'s methods in every worker through its worker RPC
(``LLM.collective_rpc(name, args=, kwargs=)``; ``self`` is the worker, ``self.model_runner.model``
its live model). ``tensorhub_open`` opens one handle per worker: its tensor-parallel rank is the
shard, the tensor-parallel size the shard count. It registers the model's own parameter tensors
(``p.data``: the engine's memory, no staging copy), with vLLM's placements
(:func:`tensorhub.scheduling.decoders.vllm_placements`: fused ``qkv_proj``/``gate_up_proj``, column
and row parallel, optional block FP8), and, with ``convert_from=``, the Hugging Face -> vLLM mapping
preset of the model family (:func:`tensorhub.scheduling.mapping.preset`), so that a trainer that
publishes Hugging Face names in another parallel layout feeds the engine directly.
``tensorhub_update``/``tensorhub_replicate`` pull into those parameters between requests; with
``shadow=True`` at open, ``tensorhub_prefetch`` pulls into a shadow set while the engine keeps
generating and ``tensorhub_flip`` re-points the parameters (``p.data = ...``: no copy; needs
``enforce_eager=True``, as captured CUDA graphs keep the old addresses).

Arguments and results are plain values (strings, numbers, dicts): vLLM's multiprocess mode
serializes them between processes.
"""

from __future__ import annotations

from typing import Any

import torch

import tensorhub
from tensorhub.core.errors import InvalidArgument, MappingMismatch, UsageError
from tensorhub.scheduling.decoders import DecoderShape, vllm_placements
from tensorhub.scheduling.mapping import preset

__all__ = ["WorkerExtension", "decoder_shape"]

EXTENSION = "tensorhub.integrations.vllm.WorkerExtension"
"""What to pass as ``LLM(worker_extension_cls=...)``."""


def decoder_shape(hf_config: Any, family: str) -> DecoderShape:
    """The :class:`DecoderShape` of a Hugging Face decoder config (Llama, Qwen2, Qwen3, their
    mixtures of experts, DeepSeek's MLA): :meth:`DecoderShape.from_config`."""
    return DecoderShape.from_config(hf_config, family)


def _take_over_cpu_linears(net: torch.nn.Module, placements: dict[str, Any] | None, rank: int) -> int:
    """vLLM's CPU backend repacks each linear layer's weight for oneDNN (or AMX kernels) after
    loading and drops the parameter (``weight`` becomes an empty tensor), or keeps it but reads
    a packed copy (``lm_head``): nothing in place to land a new version in. Give each such layer back a weight of its shape, read by a plain
    ``torch.nn.functional.linear`` (so the handle's pulls land where the layer reads), with its
    bias in the weight's dtype. Its content is undefined until the first replicate/update.
    Returns how many layers were taken over."""
    taken = 0
    for name, mod in net.named_modules():
        w = getattr(mod, "weight", None)
        if not hasattr(mod, "cpu_linear") or not isinstance(w, torch.Tensor) or w.device.type != "cpu":
            continue
        if w.numel():  # kept, but read through a packed copy (lm_head): read the weight itself
            mod.cpu_linear = torch.nn.functional.linear
            taken += 1
            continue
        full = f"{name}.weight" if name else "weight"
        if placements is None or full not in placements:
            raise UsageError(f"vLLM's CPU backend dropped {full} (repacked): tensorhub_open needs family= to rebuild it")
        p = placements[full]
        shape = p.local_shape(p.coord_of(rank)) if p.mesh else tuple(p.shape)
        mod.weight = torch.nn.Parameter(torch.zeros(shape, dtype=w.dtype), requires_grad=False)
        bias = getattr(mod, "bias", None)
        if isinstance(bias, torch.Tensor) and bias.dtype != w.dtype:
            bias.data = bias.data.to(w.dtype)
        mod.cpu_linear = torch.nn.functional.linear
        taken += 1
    return taken


def _compiled(worker: Any) -> bool:
    """Whether the worker's model runs through torch.compile (vLLM's default; not enforce_eager)."""
    config = getattr(worker, "vllm_config", None)
    mode = getattr(getattr(config, "compilation_config", None), "mode", 0)
    return bool(mode) and not getattr(getattr(config, "model_config", None), "enforce_eager", False)


def _cpu_experts(net: torch.nn.Module) -> list[str]:
    """The fused-MoE layers whose experts live in CPU memory: vLLM's CPU backend prepacks them into
    its grouped-GEMM layout after loading and computes from that copy, so bytes landed in
    ``w13_weight``/``w2_weight`` would never be read."""
    return [
        name
        for name, mod in net.named_modules()
        if isinstance(getattr(mod, "w13_weight", None), torch.Tensor) and mod.w13_weight.device.type == "cpu"
    ]


def _cpu_linears(net: torch.nn.Module) -> bool:
    """Whether any layer computes through vLLM's CPU linear dispatch (``cpu_linear``)."""
    return any(hasattr(mod, "cpu_linear") for mod in net.modules())


class WorkerExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``). Methods run in every worker
    through ``collective_rpc``; each returns this worker's answer."""

    _th: Any = None
    _th_params: dict[str, torch.nn.Parameter] | None = None

    def _th_rank(self) -> tuple[int, int]:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()

    def tensorhub_open(
        self,
        model: str,
        replica: str,
        family: str | None = None,
        convert_from: str | None = None,
        fp8: bool = False,
        server: str | None = None,
        transports: dict[str, dict] | None = None,
        shadow: bool = False,
        retain: str | None = "latest",
    ) -> dict[str, Any]:
        """Open this worker's handle and register the model's parameters in place.

        Args:
            model, replica, server, transports, retain: as :func:`tensorhub.open`; the shard is
                this worker's tensor-parallel rank.
            family: ``"llama"``, ``"qwen2"`` or ``"qwen3"``: registers vLLM's placements of that
                family (needed with ``convert_from``).
            convert_from: the trainer's model (Hugging Face names, any layout): converted with
                the family's preset.
            fp8: the engine's linear weights are block FP8 (``weight_scale_inv`` beside them).
            shadow: also own a shadow set (prefetch/flip); the reply says what it costs.

        Returns:
            ``{"shard": rank, "num_shards": tp, "tensors": n, "bytes": b, "shadow_bytes": s}``.
        """
        if self._th is not None:
            raise UsageError("tensorhub_open: this worker's handle is already open")
        tp, rank = self._th_rank()
        # model_runner: set by vLLM's worker, which this class extends at run time (mypy cannot see it)
        net = self.model_runner.model  # type: ignore[attr-defined]
        params = dict(net.named_parameters())
        placements = None
        mapping = None
        if family is not None:
            shape = decoder_shape(self.model_runner.model_config.hf_config, family)  # type: ignore[attr-defined]
            dtype = str(next(iter(params.values())).dtype).removeprefix("torch.")
            by_name = {p.name: p for p in vllm_placements(shape, tp, dtype, fp8=fp8)}
            missing = sorted(set(params) - set(by_name))
            if missing:
                raise MappingMismatch(f"vLLM parameters with no {family} placement: {missing[:8]}", tensors=tuple(missing[:16]))
            placements = {n: by_name[n] for n in params}
        if convert_from is not None:
            if family is None:
                raise InvalidArgument("convert_from= needs family= (the mapping preset and the placements)")
            mapping = preset(family, fp8=fp8)
        experts = _cpu_experts(net)
        if experts:
            raise UsageError(
                f"tensorhub_open: {experts[0]} (and {len(experts) - 1} more) are fused-MoE layers on vLLM's CPU "
                "backend, which computes from a prepacked copy of the experts: weights landed in place would never be "
                "read. Use the weight-transfer backend, which rebuilds them: "
                'LLM(..., weight_transfer_config={"backend": "tensorhub"}) (README "vLLM")'
            )
        if _compiled(self) and _cpu_linears(net):
            raise UsageError(
                "tensorhub_open: this engine runs vLLM's compiled mode, and its CPU linear layers read repacked "
                "weights through the compiled graph: replacing them (what the worker extension does to land weights "
                "in place) breaks the next generate() ('builtin_function_or_method' object has no attribute "
                "'__closure__'). Start the engine with enforce_eager=True, or use the weight-transfer backend, "
                'which works compiled: LLM(..., weight_transfer_config={"backend": "tensorhub"}) (README "vLLM")'
            )
        taken = _take_over_cpu_linears(net, placements, rank)
        params = dict(net.named_parameters())
        h = tensorhub.open(model, replica, num_shards=tp, shard_idx=rank, server=server, transports=transports,
                           retain=retain, convert_from=convert_from, mapping=mapping)  # fmt: skip
        try:
            h.register({n: p.data for n, p in params.items()}, placements=placements)
            shadow_bytes = h.register_shadow() if shadow else 0
        except BaseException:
            h.close()
            raise
        self._th, self._th_params = h, params
        return {"shard": rank, "num_shards": tp, "tensors": len(params), "cpu_linears_taken_over": taken,
                "bytes": sum(p.numel() * p.element_size() for p in params.values()), "shadow_bytes": shadow_bytes}  # fmt: skip

    def _th_handle(self) -> Any:
        if self._th is None:
            raise UsageError("call tensorhub_open first")
        return self._th

    def tensorhub_replicate(self, version: int | str = "latest", timeout: float | None = None) -> int:
        """Pull ``version`` into the parameters (waiting for it). Returns the version held."""
        return self._th_handle().replicate(version, timeout)

    def tensorhub_update(self, version: int | str = "latest", timeout: float | None = None) -> bool:
        """Move the parameters to ``version`` if it is newer (``update``). Returns whether it moved."""
        return self._th_handle().update(version, timeout)

    def tensorhub_prefetch(self, version: int | str = "latest") -> int | None:
        """Start pulling ``version`` into the shadow set (``prefetch``). Returns the version it
        pulls, or None: nothing to do, or (a converted model, whose ``"latest"`` the server
        resolves when the pull starts) not known yet; poll ``tensorhub_prefetched`` for it."""
        return self._th_handle().prefetch(version)

    def tensorhub_prefetched(self) -> int | None:
        """The version ready in the shadow set (None: none yet)."""
        return self._th_handle().prefetched

    def tensorhub_flip(self, wait: bool = True) -> bool:
        """Make the prefetched version active and re-point the parameters at it (no copy)."""
        h = self._th_handle()
        moved = h.flip(wait)
        if moved and self._th_params is not None:
            for n, t in h.tensors.items():
                self._th_params[n].data = t
        return moved

    def tensorhub_version(self) -> int | None:
        """The version the parameters hold (None: none)."""
        return self._th_handle().version

    def tensorhub_backend(self, build_while_landing: bool | None = None) -> dict[str, Any]:
        """This worker's ``tensorhub`` weight-transfer backend (``weight_transfer_config``), not
        this extension's handle: ``staged``, the version a prefetch made ready to swap in (None:
        none, or still pulling and processing), ``loaded``, the version its parameters hold,
        ``last``, the last update's seconds per phase. What an HTTP client asks through
        ``/collective_rpc`` before it pauses the server for the update. ``build_while_landing``
        (given): whether the next updates build each module as its tensors land, during the pull
        (the default), or after the pull (an A/B: ``bench_vllm.py``'s ``tensorhub-serial``).

        Raises:
            UsageError: the engine has no tensorhub weight-transfer engine.
            InvalidArgument: ``build_while_landing`` is not a bool.
        """
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "staged"):
            raise UsageError('this engine has no tensorhub weight-transfer engine: weight_transfer_config={"backend": "tensorhub"}')
        if build_while_landing is not None:
            if not isinstance(build_while_landing, bool):
                raise InvalidArgument(f"build_while_landing must be true or false, got {build_while_landing!r}")
            engine.build_while_landing = build_while_landing
        return {"staged": engine.staged, "loaded": engine.loaded, "last": dict(engine.last),
                "build_while_landing": engine.build_while_landing}  # fmt: skip

    def tensorhub_close(self) -> None:
        """Close this worker's handle (the parameters keep what they hold)."""
        h, self._th = self._th, None
        if h is not None:
            h.close()
