"""TensorHub as a vLLM weight-transfer backend: ``weight_transfer_config={"backend": "tensorhub"}``.

vLLM (0.32) selects a weight-transfer engine by name (``WeightTransferConfig(backend=...)``) from
``vllm.distributed.weight_transfer.factory``; this package registers ``"tensorhub"`` there through
vLLM's plugin entry point (``vllm.general_plugins`` in setup.cfg, :func:`register`), so every vLLM
process (``LLM``, ``AsyncLLM``, ``vllm serve``, each worker) finds it without user code
(:func:`tensorhub.integrations.vllm_plugin.register`)::

    llm = LLM(model=DIR, weight_transfer_config={"backend": "tensorhub"})
    llm.init_weight_transfer_engine({"init_info": {"source_model": "actor", "replica": "rollout-0"}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 3}})
    llm.finish_weight_update(weight_version="3")

Data flow
---------
::

    trainer ranks --publish(v): a reference, no bytes--> reference server
    vLLM worker r --update_weights({"version": v})-->
        PULL    v's bytes from whoever holds them into one of this worker's two STAGING sets
                (checkpoint names and shapes, the engine's dtype), the one the live
                parameters are not: the first engine of a layout converts them from the
                trainer's shards (reshard + cast), every other engine of that layout pulls
                the converted bytes from a peer. A checkpoint tensor that lands whole in a
                parameter (a norm, fused qkv/gate_up, stacked experts, one TP rank) is staged
                IN that parameter's next memory (the set's LENT memory): nothing is copied after
        BUILD   a SHADOW of each module (its lent parameters over the set's memory, the rest
                filled from staging by the loader trace), processed by vLLM's own
                process_weights_after_loading (CPU GEMM dispatch/repacking): beside the live
                modules, which keep serving; each module AS SOON AS the conversion says its
                staging tensors are landed and verified, while later ones still land
        SWAP    the shadow's processed tensors and attributes into the live modules (the live
                parameters are now the set's lent memory; the other set's is the next pull's);
                the modules of other kinds (quantized, fused MoE off the CPU backend) replayed
                here under vLLM's layerwise reload; the attention layers processed

Lifetimes
---------
- **TRACE, once, at** ``init_transfer_engine``: drive the model's own ``load_weights`` with
  vLLM's placeholder tensors (``FakeRDTTensor``, the ``sharded_rdt`` backend's bake) over the
  checkpoint's names and shapes, and record, per leaf module, which slice of which checkpoint
  tensor lands where (fused ``qkv_proj``/``gate_up_proj``, tensor-parallel slices, stacked
  experts ``w13``/``w2``, MLA's ``fused_qkv_a_proj``: whatever that architecture's loader does).
  A parameter the trace does not fill completely is a
  :class:`~tensorhub.errors.MappingMismatch` naming it, before any byte moves. Then decide which
  parameters take the staging memory as it is (:func:`_lent`), allocate the staging sets (two
  where any parameter does, on a platform whose live parameters may take a new storage; else
  one) and open one handle per set (a converted model of ``source_model``: the same names, cast
  to the engine's dtypes; replicas ``<replica>`` and ``<replica>@alt``) and register it.
- **PULL, every update** (``update_weights``): ``replicate``/``update`` into the set the live
  parameters are not (the sets alternate). With ``{"prefetch": true}`` it runs in the
  background and ``update_weights`` returns at once: the engine keeps serving from its
  parameters, which the pull never touches: before each pull, every lent storage of the target
  set must be held by nothing but the set (a storage count; else
  :class:`~tensorhub.errors.ContractViolation` naming the parameter, before any byte moves), so
  a view that a processed layer kept (MLA's matrices derived from ``kv_b_proj``) is never
  overwritten under it.
- **BUILD, every update**: during the pull (with ``{"prefetch": true}`` in the background,
  while the engine serves; else in the update): the pull runs in a thread of its own while the
  calling one builds each module the moment the conversion into the set says (a landing
  listener, :func:`tensorhub.runtime.convert.listen`) that every staging tensor the module is
  filled from is landed and verified (a unit that failed its checksum was read again first, so
  no module is built from bytes not verified); only what no conversion announced (a peer's
  converted bytes) is built after the pull, and a conversion that starts over drops what was
  built (:meth:`TensorHubWeightTransferEngine._pull_and_build`). Per traced module whose weight processing only
  touches the module itself (:func:`_shadowable`: norms, vLLM's unquantized linear and embedding
  methods, its unquantized fused-MoE experts on the CPU backend once their kernel exists), a
  copy of the module is built over the lent memory (the parameters not lent: filled from
  staging, in the buffers the previous swap retired) and processed. Memory: two staging sets,
  one of which is the live parameters (a 309 MiB bf16 Qwen3 on the CPU build: 618 MiB in all,
  where staging + shadow + live took 927 MiB); the first build's buffers are made and written
  at init, with the staging sets.
- **SWAP, every update** (the pause of an update with a finished prefetch): each live parameter
  takes its shadow's storage where no captured graph holds the old one (the CPU build, or CUDA
  graphs off: compiled graphs read the parameters at each call), else the shadow is copied into
  the kernel tensors (vLLM's ``_copy_and_restore_kernel_tensors``: CUDA graphs stay valid;
  nothing is lent there); the attributes processing set (``cpu_linear``) move over. Modules of
  other kinds (quantized methods; fused-MoE backends whose conversion shuffles the experts,
  pads the shared config or stashes layouts on the layer) are loaded and processed in the pause
  as vLLM's layerwise reload does (their live tensors first get memory of their own, if they
  were a staging set's: :meth:`TensorHubWeightTransferEngine._privatize`), then every attention
  layer's ``process_weights_after_loading`` (MLA derives its matrices from ``kv_b_proj``).
  ``swap = False`` on the engine loads every module through vLLM's layerwise reload instead.
- Each staging set stays registered and published until its next pull (whose ``update``
  unpublishes it first, draining its readers): this engine serves the version to its peers, and
  the live set's memory is both the engine's weights and that published copy. Nothing but a
  pull writes it (vLLM's processing only reads the lent memory), so loading other weights into
  the engine by other means (vLLM's ``reload_weights`` copies into the live parameters) breaks
  what it publishes: shut the backend down first.

The weight version vLLM reports (``/weight_info``, each output's ``weight_versions``) is set by
the frontend, not the workers: :class:`TensorHubTrainerWeightTransferEngine` and
:func:`update` pass the TensorHub version as ``finish_weight_update(weight_version=...)``.

Size: the worker engine's phases (pull, build, swap) share its two staging sets, their lent
memory and the rule that nothing live is written; the seam to split along is the loader trace
(:func:`checkpoint_tensors` to :func:`_lent`: what the engine's own loader does with each
checkpoint tensor), which the rest only reads.
"""

from __future__ import annotations

import gc
import glob
import json
import math
import os
import queue
import struct as _struct
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import tensorhub
from tensorhub.core.errors import ContractViolation, InvalidArgument, MappingMismatch, UsageError
from tensorhub.core.naming import validate_replica
from tensorhub.core.placement import REPLICATE, TensorPlacement
from tensorhub.integrations.vllm_experts import join_fused_experts, split_fused_experts
from tensorhub.integrations.vllm_plugin import BACKEND
from tensorhub.integrations.vllm_shadow import (
    _MISSING,
    _MODULE_STATE,
    _copy_module,
    _dispatch_kept,
    _materialize,
    _over,
    _same_layout,
    _Shadow,
    _shadowable,
    _unshared,
    _use_count,
)
from tensorhub.runtime.convert import listen
from tensorhub.integrations.vllm_trainer import (  # the trainer side, named here too
    LLMClient,
    TensorHubTrainerInitInfo,
    TensorHubTrainerWeightTransferEngine,
    _version,
    latest_version,
    update,
)
from tensorhub.scheduling.mapping import Cast, Mapping

if TYPE_CHECKING:
    from tensorhub.handles.api import ShardHandle

__all__ = [
    "BACKEND",
    "LoaderTrace",
    "TensorHubInitInfo",
    "TensorHubTrainerInitInfo",
    "TensorHubTrainerWeightTransferEngine",
    "TensorHubUpdateInfo",
    "TensorHubWeightTransferEngine",
    "LLMClient",
    "checkpoint_tensors",
    "latest_version",
    "trace_loader",
    "update",
]

from vllm.distributed.weight_transfer.base import (  # noqa: E402 - vLLM is this module's premise
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                      torch.float8_e4m3fn, torch.int8, torch.uint8, torch.int32, torch.int64)}  # fmt: skip
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
                       "I8": "int8", "U8": "uint8", "I32": "int32", "I64": "int64"}  # fmt: skip


# --- init and update info ----------------------------------------------------------------------


@dataclass
class TensorHubInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine``'s ``init_info`` for the ``tensorhub`` backend.

    Attributes:
        source_model: the TensorHub model the trainer publishes (Hugging Face checkpoint names).
        replica: this engine's replica name (all its workers share it; ``-dp<i>`` is appended
            per data-parallel rank when there are several).
        model: the converted model this engine holds (default ``<source_model>:vllm-<dtype>-w<n>``:
            one name per layout, so engines of one layout serve each other).
        server: the reference server's address (None: ``$TENSORHUB_SERVER`` or the embedded default).
        retain: as :func:`tensorhub.open`; default None: the engine's copy of a version is a
            cache of the trainer's, whose retention is the source model's. With ``"latest"``,
            the unpublish of the engine's last copy of the version it moves past makes a CPU
            offload copy of the whole shard first, inside every update's pause.
        timeout: seconds an update may wait for its version and pull it (None: no bound).
        names, dtype_names, shapes: the checkpoint's tensors the trainer publishes (full shapes),
            as vLLM's ``sharded_rdt`` backend takes them; empty: read from the safetensors
            files of the model's directory.
        ignore: name patterns of published tensors this engine does not take
            (:class:`~tensorhub.scheduling.mapping.Mapping` ``ignore``).
        transports: as :func:`tensorhub.open`.
    """

    source_model: str = ""
    replica: str = ""
    model: str = ""
    server: str | None = None
    retain: str | None = None
    timeout: float | None = 600.0
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    transports: dict[str, dict] | None = None

    def __post_init__(self) -> None:
        for what in ("source_model", "replica"):
            if not isinstance(getattr(self, what), str) or not getattr(self, what):
                raise InvalidArgument(f"tensorhub init_info needs {what}= (a name), got {getattr(self, what)!r}")
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise InvalidArgument(f"tensorhub init_info: names ({len(self.names)}), dtype_names ({len(self.dtype_names)}) "
                                  f"and shapes ({len(self.shapes)}) must have one entry per tensor")  # fmt: skip
        bad = [d for d in self.dtype_names if d not in _DTYPES]
        if bad:
            raise InvalidArgument(f"tensorhub init_info: unknown dtype_names {sorted(set(bad))}; known: {sorted(_DTYPES)}")
        if self.timeout is not None and not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise InvalidArgument(f"tensorhub init_info: timeout must be > 0 seconds or None, got {self.timeout!r}")


@dataclass
class TensorHubUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights``'s ``update_info`` for the ``tensorhub`` backend.

    Attributes:
        version: the TensorHub version to load (an integer, or ``"latest"``).
        prefetch: only start pulling it into staging, in the background, and return at once
            (the engine keeps serving); a later ``update_weights`` of the same version loads it.
    """

    version: int | str = "latest"
    prefetch: bool = False

    def __post_init__(self) -> None:
        self.version = _version(self.version, "tensorhub update_info")
        if not isinstance(self.prefetch, bool):
            raise InvalidArgument(f"tensorhub update_info: prefetch must be true or false, got {self.prefetch!r}")


# --- the checkpoint's tensors -------------------------------------------------------------------


def checkpoint_tensors(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of the safetensors files in the directory ``path`` (headers
    only: no tensor is read).

    Raises:
        InvalidArgument: no safetensors file there, or a header that does not parse.
    """
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else []
    if not files:
        raise InvalidArgument(
            f"no *.safetensors in {path!r} to read the checkpoint's tensor names from: pass names=, "
            "dtype_names= and shapes= in the tensorhub init_info"
        )
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                (n,) = _struct.unpack("<Q", fh.read(8))
                if n > 100 << 20:
                    raise ValueError(f"header of {n} bytes")
                header = json.loads(fh.read(n))
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                out[name] = (_SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"]), tuple(int(x) for x in meta["shape"]))
        except (OSError, ValueError, KeyError, TypeError, _struct.error) as err:
            raise InvalidArgument(f"cannot read the safetensors header of {f!r}: {err}") from err
    return out


# --- the trace ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scatter:
    """One recorded copy: the slice ``chain`` of checkpoint tensor ``source`` lands in the
    region (``shape``, ``stride``, ``offset``) of parameter ``param`` of ``module``."""

    source: str
    chain: tuple
    module: Any
    param: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype  # the destination parameter's dtype (what staging holds)


@dataclass
class LoaderTrace:
    """What :func:`trace_loader` found.

    Attributes:
        modules: per leaf module the loader fills, its scatters, in load order.
        staged: per checkpoint tensor that lands somewhere, its (dtype, shape) in staging:
            the dtype of the parameters it lands in, the checkpoint's shape.
        skipped: checkpoint tensors the loader read but put nowhere (e.g. ``rotary_emb.inv_freq``).
        seconds: how long the trace took.
    """

    modules: dict[Any, list[Scatter]]
    staged: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    skipped: list[str]
    seconds: float


def _module_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in model.named_modules()}


def trace_loader(
    model: torch.nn.Module, device: torch.device, tensors: dict[str, tuple[str, tuple[int, ...]]]
) -> LoaderTrace:
    """Drive ``model.load_weights`` with placeholders of ``tensors`` and record where each slice
    lands (the ``sharded_rdt`` backend's bake, with its placeholder tensors and loader stamps).
    The model is left as it was.

    Raises:
        MappingMismatch: a loader did something with a placeholder that is not a slice (naming
            the tensor), or a parameter the loader did not fill completely, or at all (naming it).
    """
    from vllm.distributed.weight_transfer.sharded_rdt_engine import ShardedRDTWeightTransferEngine as _Bake
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink, FakeRDTTensor
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_size

    t0 = time.perf_counter()
    given = tensors  # transformers 5's fused experts traced as the per-expert tensors they hold
    tensors, origin = split_fused_experts(given)
    names = _module_names(model)
    # Parameters several modules share (tied embeddings): one of them loads it.
    owners: dict[int, list[Any]] = {}
    for mod in model.modules():
        for p in get_layer_params_buffers(mod)[0].values():
            owners.setdefault(id(p), []).append(mod)
    kernel_params = {mod: {n: id(p) for n, p in get_layer_params_buffers(mod)[0].items()} for mod in model.modules()}
    recorder = BakeSink()
    sizes: dict[Any, int] = {}
    loadable: dict[Any, list[str]] = {}
    with torch.device(device):
        initialize_layerwise_reload(model)
        try:
            # The bake's stamps and restore do not use the engine's state (vLLM 0.32): reused as they are.
            _Bake._install_recording_stamps(None, model, recorder)
            fakes = [(n, FakeRDTTensor(name=n, shape=torch.Size(shape), dtype=_DTYPES[dt] if dt in _DTYPES else torch.float32,
                                       device=device, sink=recorder)) for n, (dt, shape) in tensors.items()]  # fmt: skip
            try:
                with disable_mtp_completeness_check():
                    model.load_weights(fakes)  # type: ignore[operator]  # vLLM models have it
            except NotImplementedError as err:
                raise MappingMismatch(f"vLLM's loader does something other than slicing a checkpoint tensor: {err}") from err
            for mod in model.modules():
                sizes[mod] = get_layer_size(mod)
                loadable[mod] = [n for n in get_layer_params_buffers(mod)[0] if n not in SKIP_LOAD_TENSORS]
        finally:
            _Bake._restore_after_dry_run(None, model)
    modules: dict[Any, list[Scatter]] = {}
    problems: list[str] = []
    missing: list[str] = []
    for mod, recorded in recorder.copies_by_layer.items():
        where = names.get(id(mod), type(mod).__name__)
        if any(c is None for c in recorded):
            problems.append(f"{where}: a copy the trace could not attribute to a parameter")
            continue
        copied = sum(int(torch.Size(c.shape).numel()) for c in recorded)
        if copied < sizes.get(mod, 0):
            problems.append(f"{where}: the loader fills {copied} of its {sizes[mod]} elements")
            missing += [f"{where}.{n}" for n in loadable.get(mod, ())]
            continue
        modules[mod] = [
            join_fused_experts(Scatter(c.src[0], tuple(c.src[1]), mod, c.param_name, tuple(c.shape), tuple(c.stride),
                                       int(c.offset), getattr(mod, c.param_name).dtype), origin)  # fmt: skip
            for c in recorded
        ]
    filled = {id(m) for m in modules}
    for mod in model.modules():
        if mod in modules or not loadable.get(mod):
            continue
        # a parameter another, filled, module owns too (tied embeddings) is loaded through it
        unfilled = [n for n in loadable[mod] if not any(id(o) in filled for o in owners.get(kernel_params[mod].get(n, -1), ()))]
        if unfilled:
            where = names.get(id(mod), type(mod).__name__)
            missing += [f"{where}.{n}" for n in unfilled]
            problems.append(f"{where}: no checkpoint tensor lands in {unfilled}")
    if problems:
        shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
        raise MappingMismatch(
            "vLLM's loader, driven with the checkpoint's tensors, does not fill every parameter of the engine "
            "(is init_info's source model this engine's architecture?):\n  " + "\n  ".join(shown),
            tensors=tuple(missing[:64]),
        )
    staged: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for scatters in modules.values():
        for s in scatters:
            staged.setdefault(s.source, (s.dtype, tuple(given[s.source][1])))
    skipped = [n for n in given if n not in staged]
    return LoaderTrace(modules, staged, skipped, time.perf_counter() - t0)


def _replay(t: torch.Tensor, chain: Sequence[tuple]) -> torch.Tensor:
    """Apply a recorded op chain (views and slices from vLLM's allowlist) to a staged tensor."""
    from vllm.distributed.weight_transfer.sharded_rdt_common import ALLOWED_OPS

    for op, args, kwargs in chain:
        if op not in ALLOWED_OPS:
            raise MappingMismatch(f"a recorded op {op!r} is not one of vLLM's slicing ops {sorted(ALLOWED_OPS)}")
        t = getattr(t, op)(*args, **dict(kwargs))
    return t


def _casts(staged: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[Cast, ...]:
    """Cast rules giving each staged tensor its dtype: the common dtype for every name, the
    others by exact name first (few rules, so resolving stays linear)."""
    dtypes = {n: str(d).removeprefix("torch.") for n, (d, _) in staged.items()}
    if not dtypes:
        return ()
    common = Counter(dtypes.values()).most_common(1)[0][0]
    return (*(Cast(n, d) for n, d in dtypes.items() if d != common), Cast("{name:path}", common))


def _lent(trace: LoaderTrace) -> dict[tuple[Any, str], tuple[torch.Tensor, list[Scatter]]]:
    """The parameters a staging set lends its memory to: per (module, parameter name), the
    parameter's meta tensor (the checkpoint layout the build fills) and the scatters that fill it.
    A parameter qualifies when its module is built beside the live one (:func:`_shadowable`) and
    every scatter into it moves a whole checkpoint tensor, as it is (no slice, no cast), into one
    contiguous run of it, the runs together covering it once (a norm, an embedding, fused
    ``qkv_proj`` and ``gate_up_proj``, stacked experts, with one tensor-parallel rank): each of
    those checkpoint tensors' staging tensor is then that run itself, and the build copies nothing
    for the parameter."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    out: dict[tuple[Any, str], tuple[torch.Tensor, list[Scatter]]] = {}
    used: set[str] = set()
    for mod, scatters in trace.modules.items():
        info = LAYERWISE_INFO.get(mod)
        if info is None or not _shadowable(mod):
            continue
        for name, meta in info.restore_metadata[0].items():
            into = [sc for sc in scatters if sc.param == name]
            if not into or not meta.is_contiguous():
                continue
            whole = torch.empty_strided(meta.size(), meta.stride(), dtype=meta.dtype, device="meta")
            runs: list[tuple[int, int]] = []
            for sc in into:
                if sc.source in used or sc.dtype != meta.dtype or trace.staged.get(sc.source) != (meta.dtype, tuple(sc.shape)):
                    break
                try:
                    src = _replay(torch.empty(sc.shape, dtype=meta.dtype, device="meta"), sc.chain)
                except Exception:  # noqa: BLE001 - an op the meta device does not take: not lent
                    break
                if tuple(src.shape) != tuple(sc.shape) or not src.is_contiguous() or src.storage_offset() != 0:
                    break
                if not whole.as_strided(sc.shape, sc.stride, sc.offset).is_contiguous():
                    break
                runs.append((sc.offset, math.prod(sc.shape)))
            else:
                runs.sort()
                if [a for a, _ in runs] == [0] + [a + n for a, n in runs[:-1]] and sum(n for _, n in runs) == meta.numel():
                    out[(mod, name)] = (meta, into)
                    used.update(sc.source for sc in into)
    return out


@dataclass
class _StagingSet:
    """One of the engine's staging sets: the checkpoint's tensors (names, shapes, the engine's
    dtypes) registered with a handle of its own, and the lent parameters' memory they are views of.

    Attributes:
        handle: this set's handle (replica ``<replica>`` for the first set, ``<replica>@alt`` for
            the second).
        tensors: per checkpoint tensor, its staging tensor (a view of ``lent`` memory, or its own).
        lent: per lent parameter (:func:`_lent`), its memory in the checkpoint layout: the pull
            lands there, the build processes it there, and after the swap the live parameter is it.
        refs: per lent parameter, how many holders its storage had when only this set (its
            tensors, its handle) held it: measured at registration and after each pull into it.
    """

    handle: ShardHandle
    tensors: dict[str, torch.Tensor]
    lent: dict[tuple[Any, str], torch.Tensor]
    refs: dict[tuple[Any, str], int] = field(default_factory=dict)

    def count(self) -> None:
        """Note each lent storage's holders now (nothing but this set holds them)."""
        self.refs = {k: _use_count(t) for k, t in self.lent.items()}

    def held(self) -> list[tuple[Any, str]]:
        """The lent parameters whose memory something other than this set holds now."""
        return [k for k, t in self.lent.items() if _use_count(t) > self.refs[k]]


def _first_spares(trace: LoaderTrace, lent: dict[tuple[Any, str], Any]) -> dict[tuple[int, str, str], torch.Tensor]:
    """The first build's buffers, made and written at init (the memory every later build reuses,
    :meth:`TensorHubWeightTransferEngine._swap`): per module built beside the live one, its
    tensors in the checkpoint layout. Without them the first update's build first-touches a copy
    of those layers (~300 ms for 309 MiB here) in the pause."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

    out: dict[tuple[int, str, str], torch.Tensor] = {}
    for mod in trace.modules:
        info = LAYERWISE_INFO.get(mod)
        if info is None or not _shadowable(mod):
            continue
        restore_params, restore_buffers = info.restore_metadata
        with info.restore_device:
            for kind, metas in (("p", restore_params), ("b", restore_buffers)):
                for n, meta in metas.items():
                    if kind == "p" and (mod, n) in lent:
                        continue  # the staging sets' memory
                    t = materialize_meta_tensor(meta)
                    t.data.zero_()
                    out[(id(mod), kind, n)] = t
    return out


class _GcTime:
    """The time Python's cyclic garbage collector ran (any thread) from its making to :meth:`stop`."""

    def __init__(self, start: bool = True) -> None:
        self.seconds, self.count, self._t = 0.0, 0, 0.0
        self.marked: tuple[float, int] | None = None
        self._on = False
        if start:
            gc.callbacks.append(self._note)
            self._on = True

    def mark(self) -> None:
        """Note the figures so far (what came after is told apart)."""
        self.marked = (self.seconds, self.count)

    def stop(self) -> None:
        if self._on:
            gc.callbacks.remove(self._note)
            self._on = False

    def _note(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t:
            self.seconds += time.perf_counter() - self._t
            self.count += 1
            self._t = 0.0


class _Landings:
    """What a conversion says as it lands a staging set (a
    :class:`~tensorhub.runtime.convert.LandingListener`), queued for the thread that builds:
    ``("begin", version, "")`` and ``("landed", version, tensor)``, then the end."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, int, str] | None] = queue.SimpleQueue()

    def begin(self, version: int) -> None:
        self._queue.put(("begin", version, ""))

    def landed(self, version: int, tensor: str) -> None:
        self._queue.put(("landed", version, tensor))

    def close(self) -> None:
        self._queue.put(None)

    def events(self, puller: threading.Thread) -> Iterator[tuple[str, int, str]]:
        """The events until :meth:`close` (the pull's thread calls it as it ends); also ends if
        that thread is gone without it."""
        while True:
            try:
                event = self._queue.get(timeout=1.0)
            except queue.Empty:
                if puller.is_alive():
                    continue
                return
            if event is None:
                return
            yield event


# --- the worker-side engine ---------------------------------------------------------------------


class TensorHubWeightTransferEngine(WeightTransferEngine[TensorHubInitInfo, TensorHubUpdateInfo]):
    """The worker side: one TensorHub handle per vLLM worker (its rank in the engine is the
    shard), a staging set in checkpoint names, and the loader trace replayed from it into
    processed copies of the model's modules, swapped in at the update."""

    init_info_cls = TensorHubInitInfo
    update_info_cls = TensorHubUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.trace: LoaderTrace | None = None
        #: the staging sets: two where parameters take the staging memory the pull landed in
        #: (:func:`_lent`; pulls alternate between them), else one
        self.sets: list[_StagingSet] = []
        self._pulled = 0  # the set the last pull went into
        self._live: int | None = None  # the set whose lent memory the live parameters are (None: their own)
        self.loaded: int | None = None  #: the version the model's parameters hold
        self.last: dict[str, float] = {}  #: the last update's phases (``*_s``: seconds): pull, build, swap...
        self._timeout: float | None = None
        self._lock = threading.Lock()  # one pull, build or swap at a time (the handle takes one call)
        self._prefetch: threading.Thread | None = None
        self._prefetch_error: BaseException | None = None
        self._moved = False  # the last _pull moved a set to another version
        #: build a version's processed layers beside the live ones (during a prefetch, or in the
        #: update) and swap them in; False: the update loads staging into the live parameters through
        #: vLLM's layerwise reload (materialize, process, copy into the kernel tensors)
        self.swap = True
        #: build each module as the conversion says its tensors landed, during the pull; False: the
        #: whole build after the pull (what bench_vllm.py's ``tensorhub-serial`` route compares with)
        self.build_while_landing = True
        #: modules of the last build whose processing was skipped: vLLM's F.linear fallback stands (:func:`_dispatch_kept`)
        self._kept = 0
        self._shadow: _Shadow | None = None
        #: the storages the last swap replaced, by (module, kind, name): the next build's buffers
        #: (freeing them in the pause cost ~0.1 ms per MiB; reusing them saves the page faults too)
        self._spare: dict[tuple[int, str, str], torch.Tensor] = {}
        #: live storages the swap replaced that no build reuses (vLLM's own, at the first update):
        #: freed at the next pull, not in the pause
        self._retired: list[torch.Tensor] = []
        #: per module built beside the live one, the staging tensors it is filled from; per staging
        #: tensor, those modules (a module is built once all of its have landed: :meth:`_pull_and_build`)
        self._needs: dict[Any, frozenset[str]] = {}
        self._waiting_on: dict[str, list[Any]] = {}
        self._names: dict[int, str] = {}
        #: the last pull's landings and builds, in order: ("begin", version), ("landed", tensor),
        #: ("built", module): what was built while what landed
        self.landing_log: list[tuple[str, str]] = []
        self._gc_time = _GcTime(start=False)  # collections from an update to its finish_weight_update

    @property
    def handle(self) -> ShardHandle | None:
        """The handle of the staging set the last pull went into (None: not initialized)."""
        return self.sets[self._pulled].handle if self.sets else None

    @property
    def staging(self) -> dict[str, torch.Tensor]:
        """The staging tensors the last pull went into, by checkpoint name."""
        return self.sets[self._pulled].tensors if self.sets else {}

    def _target(self) -> int:
        """The set the next pull goes into: never the one the live parameters are."""
        return 0 if len(self.sets) == 1 or self._live is None else 1 - self._live

    # rank and shard count of this worker in its engine (tensor x pipeline parallel)
    def _shard(self) -> tuple[int, int]:
        from vllm.distributed import parallel_state as ps

        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        pp, pp_rank = ps.get_pp_group().world_size, ps.get_pp_group().rank_in_group
        return tp * pp, pp_rank * tp + tp_rank

    def init_transfer_engine(self, init_info: TensorHubInitInfo) -> None:
        """Trace the loader, allocate the staging set and open and register the handle.

        Raises:
            UsageError: called twice.
            InvalidArgument: no checkpoint tensors to trace with.
            MappingMismatch: a parameter the trace cannot place (naming it).
        """
        if self.sets:
            raise UsageError("the tensorhub weight-transfer engine is already initialized: shut it down first")
        info = init_info
        if info.names:
            tensors = {n: (d, tuple(s)) for n, d, s in zip(info.names, info.dtype_names, info.shapes)}
        else:
            tensors = checkpoint_tensors(str(self.model_config.model))
        trace = trace_loader(self.model, self.device, tensors)
        num_shards, shard = self._shard()
        dp = self.parallel_config.data_parallel_size
        replica = info.replica if dp <= 1 else f"{info.replica}-dp{self.parallel_config.data_parallel_rank}"
        dtype = str(self.model_config.dtype).removeprefix("torch.")
        model = info.model or f"{info.source_model}:vllm-{dtype}-w{num_shards}"
        lent = _lent(trace) if self.swap and self._rebind_storage() else {}
        mapping = Mapping(casts=_casts(trace.staged), ignore=(*(n for n in trace.skipped), *info.ignore))
        try:
            for k in range(2 if lent else 1):
                name = replica if k == 0 else validate_replica(f"{replica}@alt")
                self.sets.append(self._staging_set(trace, lent, model, name, num_shards, shard, mapping, info))
        except BaseException:
            self._close_sets()
            raise
        self.trace, self._timeout, self._pulled, self._live = trace, info.timeout, 0, None
        self._names = _module_names(self.model)
        self._needs = {mod: frozenset(sc.source for sc in scatters) for mod, scatters in trace.modules.items()
                       if self._info(mod) is not None and _shadowable(mod)}  # fmt: skip
        self._waiting_on = {}
        for mod, needs in self._needs.items():
            for name in needs:
                self._waiting_on.setdefault(name, []).append(mod)
        if self.swap:
            self._spare.update(_first_spares(trace, lent))

    def _staging_set(self, trace: LoaderTrace, lent: dict[tuple[Any, str], tuple[torch.Tensor, list[Scatter]]], model: str,
                     replica: str, num_shards: int, shard: int, mapping: Mapping, info: TensorHubInitInfo) -> _StagingSet:  # fmt: skip
        """Allocate a staging set (the lent parameters' memory, the other tensors' own), open its
        handle and register it."""
        # written once here: the pages are this process's before the first pull lands in them
        # (a first touch costs ~1 ms per MiB on the CPU: in the first update's pause otherwise)
        memory: dict[tuple[Any, str], torch.Tensor] = {}
        views: dict[str, torch.Tensor] = {}
        for key, (meta, into) in lent.items():
            memory[key] = buf = torch.empty_strided(meta.size(), meta.stride(), dtype=meta.dtype, device=self.device).zero_()
            views.update((sc.source, buf.as_strided(sc.shape, sc.stride, sc.offset)) for sc in into)
        staging = {n: views[n] if n in views else torch.empty(shape, dtype=d, device=self.device).zero_()
                   for n, (d, shape) in trace.staged.items()}  # fmt: skip
        del views
        placements = {n: TensorPlacement(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), (num_shards,), (REPLICATE,))
                      for n, t in staging.items()}  # fmt: skip
        h = tensorhub.open(model, replica, num_shards=num_shards, shard_idx=shard, server=info.server, retain=info.retain,
                           transports=info.transports, convert_from=info.source_model, mapping=mapping)  # fmt: skip
        try:
            h.register(staging, placements=placements)
        except BaseException:
            h.close()
            raise
        out = _StagingSet(h, staging, memory)
        out.count()
        return out

    def _close_sets(self) -> None:
        sets, self.sets = self.sets, []
        for st in sets:
            st.handle.close()

    def start_weight_update(self) -> None:
        """Nothing to prepare: the parameters are only touched by ``update_weights``' swap."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def parse_update_info(self, update_dict: dict[str, Any]) -> TensorHubUpdateInfo:
        try:
            return TensorHubUpdateInfo(**update_dict)
        except TypeError as err:
            raise InvalidArgument(f"tensorhub update_info: {err} (it takes version= and prefetch=)") from err

    def parse_init_info(self, init_dict: dict[str, Any]) -> TensorHubInitInfo:
        try:
            return TensorHubInitInfo(**init_dict)
        except TypeError as err:
            raise InvalidArgument(f"tensorhub init_info: {err}") from err

    def _need_handle(self) -> ShardHandle:
        if not self.sets:
            raise UsageError("the tensorhub weight-transfer engine is not initialized: call init_weight_transfer_engine first")
        return self.sets[self._pulled].handle

    def _pull(self, version: int | str, landings: _Landings | None = None) -> int:
        """Bring a staging set to ``version`` (waiting for it): the set the last pull went into
        if it holds it already, else the set the live parameters are not (:meth:`_target`).
        Returns the version staged. ``landings``: told of each staging tensor as the conversion
        into the set lands it (:func:`tensorhub.runtime.convert.listen`; a pull of a peer's
        converted bytes tells nothing).

        Raises:
            ContractViolation: something other than that set holds its memory (naming the
                parameters): the pull would overwrite what the engine serves. Nothing moved.
        """
        self._need_handle()
        self._moved = False
        staged = self.sets[self._pulled].handle.version
        if staged is not None and staged == version:
            return staged  # staged already (a prefetch), or loaded already
        if self._shadow is not None and self._shadow.version != version:
            self._shadow = None  # built from another version: its memory back before this pull
        self._retired.clear()
        k = self._target()
        st = self.sets[k]
        held = st.held()
        if held:
            names = _module_names(self.model)
            raise ContractViolation(
                "the tensorhub staging set the next pull lands in is still held by the engine at "
                f"{', '.join(f'{names.get(id(m), type(m).__name__)}.{n}' for m, n in held[:8])}: "
                "the pull would overwrite what the engine serves"
            )
        self._pulled = k
        h = st.handle
        before = h.version
        if landings is not None:
            listen(h.buffers, landings)
        try:
            if h.version is None:
                return h.replicate(version, self._timeout)
            h.update(version, self._timeout)
            if isinstance(version, int) and h.version != version:
                h.replicate(version, self._timeout)
            assert h.version is not None
            return h.version
        finally:
            if landings is not None:
                listen(h.buffers, None)
            self._moved = h.version != before
            st.count()

    @property
    def staged(self) -> int | None:
        """The version the staging set holds (None: none yet, or a prefetch still running)."""
        t = self._prefetch
        h = self.handle
        if h is None or (t is not None and t.is_alive()):
            return None
        return h.version

    def _join_prefetch(self) -> None:
        t, self._prefetch = self._prefetch, None
        if t is not None:
            t.join()
        err, self._prefetch_error = self._prefetch_error, None
        if err is not None:
            raise err

    def receive_weights(self, update_info: TensorHubUpdateInfo) -> None:
        """Pull ``update_info.version`` into staging and build its processed layers (or start
        to, in the background, with ``prefetch``), then swap them in."""
        self._need_handle()
        self._join_prefetch()
        if update_info.prefetch:

            def run() -> None:
                try:
                    with self._lock:
                        self._shadow = None  # the one before, first: one shadow at a time in memory
                        self._pull_and_build(update_info.version)
                except BaseException as err:  # noqa: BLE001 - raised by the next update_weights
                    self._prefetch_error = err

            self._prefetch = threading.Thread(target=run, name="tensorhub-prefetch", daemon=True)
            self._prefetch.start()
            return
        self._gc_time.stop()
        gc_time = self._gc_time = _GcTime()  # until finish_weight_update
        with self._lock:
            t0 = time.perf_counter()
            version, phases = self._pull_and_build(update_info.version)
            t1 = time.perf_counter()
            self.last = {"pull_s": phases.get("pull_s", t1 - t0)}
            conv = self._need_handle().last_conversion
            if self._moved and conv is not None and conv.version == version:  # converted here, now (else: a peer's bytes)
                # before_convert/after_convert: the pull's time around the conversion (the server's round trips)
                self.last.update(convert_s=conv.seconds, convert_tasks=float(conv.tasks), in_place_tasks=float(conv.in_place),
                                 reads=float(conv.reads), before_convert_s=conv.created - t0,
                                 convert_setup_s=conv.started - conv.created,
                                 after_convert_s=t0 + self.last["pull_s"] - conv.started - conv.seconds)  # fmt: skip
            self.last.update(phases)
            shadow, self._shadow = self._shadow, None
            if shadow is None or shadow.version != version:
                shadow = self._build_shadow(version) if self.swap else None
            if shadow is not None:
                self._swap(shadow)
            else:
                self._spare.clear()
                self._privatize(list(self.model.modules()))
                self._replay_all()
            self.loaded = version
            self.last["replay_s"] = time.perf_counter() - t1
        # Python's cyclic collections during the update (any thread's: each stops every Python thread)
        self.last.update(gc_s=gc_time.seconds, gc_collections=float(gc_time.count))
        gc_time.mark()

    @torch.no_grad()
    def _replay_all(self, only: list[Any] | None = None) -> None:
        """Staging -> parameters, as vLLM's layerwise reload processes a checkpoint load: every
        traced module and then the others (attention), or the modules ``only`` (the rest is the
        caller's)."""
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import (
            LAYERWISE_INFO,
            _copy_and_restore_kernel_tensors,
            _place_kernel_tensors,
            get_layerwise_info,
        )
        from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta
        from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

        assert self.trace is not None
        model = self.model
        modules = self.trace.modules if only is None else {m: self.trace.modules[m] for m in only}
        clock = time.perf_counter
        phases = dict.fromkeys(("init_s", "scatter_s", "process_s", "restore_s", "finalize_s"), 0.0)
        with torch.device(self.device):
            t = clock()
            if only is None:
                initialize_layerwise_reload(model)
            else:
                for mod in modules:  # what initialize_layerwise_reload does, for these modules only
                    info = get_layerwise_info(mod)
                    info.kernel_tensors = get_layer_params_buffers(mod)
                    info.kernel_non_persistent_buffers = set(mod._non_persistent_buffers_set)
                    restore_layer_on_meta(mod, info)
            phases["init_s"] += clock() - t
            try:
                for mod, scatters in modules.items():
                    info = LAYERWISE_INFO.get(mod)
                    if info is None or (only is None and not info.can_load()):
                        raise UsageError(f"vLLM's layerwise reload did not set up {type(mod).__name__} for loading")
                    t = clock()
                    materialize_layer(mod, info)
                    for sc in scatters:
                        dst = getattr(mod, sc.param).data.as_strided(sc.shape, sc.stride, sc.offset)
                        dst.copy_(_replay(self.staging[sc.source], sc.chain))
                    t1 = clock()
                    if hasattr(mod, "_already_called_process_weights_after_loading"):
                        delattr(mod, "_already_called_process_weights_after_loading")
                    quant = getattr(mod, "quant_method", None)
                    if isinstance(quant, QuantizeMethodBase):
                        quant.process_weights_after_loading(mod)
                        if hasattr(mod, "update_param_tp_status"):
                            mod.update_param_tp_status()
                    t2 = clock()
                    if info.kernel_tensors is not None:
                        _copy_and_restore_kernel_tensors(mod, info)
                    info.reset()
                    phases["scatter_s"] += t1 - t
                    phases["process_s"] += t2 - t1
                    phases["restore_s"] += clock() - t2
            finally:
                t = clock()
                if only is None:
                    # the modules not replayed (no checkpoint tensor, attention) get their kernel tensors back
                    finalize_layerwise_reload(model, self.model_config)
                else:
                    for mod in modules:  # any left on meta by an error: its kernel tensors back
                        info = LAYERWISE_INFO.get(mod)
                        if info is not None and info.kernel_tensors is not None:
                            _place_kernel_tensors(mod, info)
                            info.reset()
                phases["finalize_s"] += clock() - t
        self.last.update(phases)

    @torch.no_grad()
    def _pull_and_build(self, version: int | str) -> tuple[int, dict[str, float]]:
        """Pull ``version`` into staging (:meth:`_pull`) and build its processed layers into
        ``self._shadow`` (:meth:`_build_shadow`) AS THEY LAND: the pull runs in a thread of its
        own, and this one builds each module the moment the conversion says (:class:`_Landings`)
        that every staging tensor it is filled from is landed and verified (a unit that failed
        its checksum was read again before that: no module is built from bytes not verified),
        while later ones still land. What no conversion announced (a peer's converted bytes; a
        version staged already) is built after the pull, as are all modules again when a
        conversion starts over (what was built from before is dropped: its bytes may be written
        again). A shadow of the version staged already is kept. Returns the version staged and
        the phases: ``pull_s`` (the pull's wall time), ``build_s`` (building, in all),
        ``build_after_pull_s`` (from the pull's end to the last build's: the builds that lagged
        the landings and what was left), ``built_landing`` (modules built as
        their tensors were said landed), ``built_while_pulling`` (of those, the ones whose build
        began before the pull had returned).

        Raises:
            whatever the pull raised (after the modules being built are dropped), or a build's
            error (once the pull has ended: nothing writes staging behind the caller).
        """
        clock = time.perf_counter
        self._kept = 0
        if not (self.swap and self.build_while_landing):  # the pull, then (swap) the build
            t = clock()
            got = self._pull(version)
            t1 = clock()
            phases = {"pull_s": t1 - t}
            if self.swap and (self._shadow is None or self._shadow.version != got):
                self._shadow = None
                self._shadow = self._build_shadow(got)
                phases.update(build_s=self._shadow.seconds, build_after_pull_s=clock() - t1, kept_dispatch=float(self._kept))
            return got, phases
        assert self.trace is not None
        landings = _Landings()
        result: list[Any] = []
        ended: list[float] = []

        def pull() -> None:
            try:
                result.append(self._pull(version, landings))
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                result.append(err)
            finally:
                ended.append(clock())
                landings.close()

        t0 = clock()
        puller = threading.Thread(target=pull, name="tensorhub-pull", daemon=True)
        puller.start()
        built: dict[Any, Any] = {}
        landed: set[str] = set()
        at: int | None = None  # the version the conversion in progress lands
        build_s, failure, overlapped = 0.0, None, 0
        self.landing_log = []
        for kind, v, name in landings.events(puller):
            if kind == "begin":  # (again): what was built from before may be written again
                built.clear()
                landed.clear()
                at, overlapped = v, 0
                self.landing_log.append(("begin", str(v)))
                continue
            if v != at:
                continue
            landed.add(name)
            self.landing_log.append(("landed", name))
            for mod in self._waiting_on.get(name, ()):
                if failure is None and mod not in built and self._needs[mod] <= landed:
                    overlapped += puller.is_alive()
                    t = clock()
                    try:
                        lent = self.sets[self._pulled].lent
                        built[mod] = self._build_module(mod, self.trace.modules[mod], self._info(mod), lent)
                    except BaseException as err:  # noqa: BLE001 - raised once the pull has ended
                        failure = err
                    build_s += clock() - t
                    self.landing_log.append(("built", self._names.get(id(mod), type(mod).__name__)))
                    if puller.is_alive():
                        # the interpreter lock, handed over between modules (a build is ~0.5 ms of
                        # Python): the pull's copy threads take it for each piece's landing hash,
                        # and would otherwise wait up to a switch interval (5 ms) each time
                        time.sleep(0)
        puller.join()
        (got,) = result
        if isinstance(got, BaseException):
            raise got
        if failure is not None:
            raise failure
        t1 = ended[0]  # the pull's end: what the builds took beyond it (they lagged the landings) is in the pause too
        phases = {"pull_s": t1 - t0, "built_landing": float(len(built) if at == got else 0),
                  "built_while_pulling": float(overlapped if at == got else 0)}  # fmt: skip
        if self._shadow is not None and self._shadow.version == got:
            return got, phases  # staged and built already (a prefetch's)
        self._shadow = None
        self._shadow = self._build_shadow(got, built if at == got else {})
        self._shadow.seconds += build_s
        phases.update(build_s=self._shadow.seconds, build_after_pull_s=clock() - t1, kept_dispatch=float(self._kept))
        return got, phases

    def _info(self, mod: Any) -> Any:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        return LAYERWISE_INFO.get(mod)

    @torch.no_grad()
    def _build_shadow(self, version: int, built: dict[Any, Any] | None = None) -> _Shadow:
        """The staged ``version`` as the engine's processed layers, built beside the live ones
        (which keep serving): per traced module of a kind whose weight processing only touches the
        module itself (:func:`_shadowable`), a copy of the module with tensors of its own in the
        checkpoint layout (in the spare buffers of the last swap where they fit), filled from
        staging and processed by vLLM's own ``process_weights_after_loading`` (CPU: the GEMM
        dispatch, oneDNN/sgl packing). A module processed into another layout than its live one,
        and the modules of other kinds, are left to :meth:`_swap`, which loads them in the pause.
        ``built``: modules built already, as their tensors landed (:meth:`_pull_and_build`)."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        assert self.trace is not None
        t0 = time.perf_counter()
        shadow = _Shadow(version)
        lent = self.sets[self._pulled].lent
        shadow.lent = sum(t.numel() * t.element_size() for t in lent.values())
        for mod, scatters in self.trace.modules.items():
            info = LAYERWISE_INFO.get(mod)
            if info is None or not _shadowable(mod):
                shadow.pending.append(mod)
                continue
            built_ = built.pop(mod) if built and mod in built else self._build_module(mod, scatters, info, lent)
            if built_ is None:
                shadow.pending.append(mod)  # processed into another layout than the live one: in the pause
                continue
            shadow.swaps.append(built_)
            params, buffers = built_[1], built_[2]
            shadow.nbytes += sum(t.numel() * t.element_size() for t in (*params.values(), *buffers.values()))
        self._spare.clear()  # what no module took (another layout): freed
        shadow.seconds = time.perf_counter() - t0
        return shadow

    def _build_module(
        self, mod: Any, scatters: list[Scatter], info: Any, lent: dict[tuple[Any, str], torch.Tensor]
    ) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], set[str]] | None:
        """One module of :meth:`_build_shadow`: a copy of ``mod`` with tensors of its own in the
        checkpoint layout (its ``lent`` parameters over the staging set's memory the pull landed
        in: nothing to copy; the rest in spare buffers, filled from staging), processed.
        Returns what :meth:`_swap` takes, or None: processed into another layout than the live one."""
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS, materialize_meta_tensor, to_meta_tensor
        from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

        restore_params, restore_buffers = info.restore_metadata
        copy = _copy_module(mod)
        with info.restore_device:
            for n, meta in restore_params.items():
                if (mod, n) in lent:
                    copy._parameters[n] = _over(meta, lent[(mod, n)])
                else:
                    copy._parameters[n] = _materialize(meta, self._spare.pop((id(mod), "p", n), None))
            for n, meta in restore_buffers.items():
                copy._buffers[n] = _materialize(meta, self._spare.pop((id(mod), "b", n), None))
            # tensors vLLM's reload leaves as they are (SKIP_TENSORS: bias): a copy of the live one
            for where, live in ((copy._parameters, mod._parameters), (copy._buffers, mod._buffers)):
                for n, t in live.items():
                    if n in SKIP_TENSORS and t is not None and n not in where:
                        fresh = materialize_meta_tensor(to_meta_tensor(t))
                        fresh.copy_(t)
                        where[n] = fresh
        for sc in scatters:
            if (mod, sc.param) in lent:
                continue  # landed there by the pull
            dst = getattr(copy, sc.param).data.as_strided(sc.shape, sc.stride, sc.offset)
            dst.copy_(_replay(self.staging[sc.source], sc.chain))
        if hasattr(copy, "_already_called_process_weights_after_loading"):
            delattr(copy, "_already_called_process_weights_after_loading")
        before = dict(vars(copy))
        quant = getattr(copy, "quant_method", None)
        if isinstance(quant, QuantizeMethodBase):
            if _dispatch_kept(mod, quant):
                self._kept += 1  # the live module's F.linear fallback stands (the copy shares it)
            else:
                quant.process_weights_after_loading(copy)
            if hasattr(copy, "update_param_tp_status"):
                copy.update_param_tp_status()
        params, buffers = get_layer_params_buffers(copy)
        live_params, live_buffers = get_layer_params_buffers(mod)
        loaded = {sc.param for sc in scatters}
        buffers = {n: b for n, b in buffers.items() if n in live_buffers and
                   not (n in mod._non_persistent_buffers_set and n not in loaded)}  # fmt: skip
        if not (_same_layout(params, live_params, exact=True) and _same_layout(buffers, live_buffers, exact=False)):
            return None
        after = vars(copy)
        attrs = {k: v for k, v in after.items() if k not in _MODULE_STATE and before.get(k, _MISSING) is not v}
        removed = {k for k in vars(mod) if k not in after and k not in _MODULE_STATE}
        return (mod, params, buffers, attrs, removed)

    @torch.no_grad()
    def _swap(self, shadow: _Shadow) -> None:
        """Make the shadow's processed layers the live ones: each live parameter takes the
        shadow's storage (no captured graph holds the old one: CPU, or no CUDA graphs) or a copy
        of it (kept storage, as vLLM's reload: CUDA graphs stay valid), and the module the
        attributes its processing set (the CPU GEMM dispatch); then the modules of other kinds are
        reloaded and processed here, and the attention layers processed, as vLLM's reload does."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

        clock = time.perf_counter
        t = clock()
        rebind = self._rebind_storage()
        owned = self._owned()
        lent = self.sets[self._pulled].lent
        for mod, params, buffers, attrs, removed in shadow.swaps:
            live_params, live_buffers = get_layer_params_buffers(mod)
            for new, live in ((params, live_params), (buffers, live_buffers)):
                for n, src in new.items():
                    old = live[n].data
                    if old.untyped_storage().data_ptr() in owned:
                        live[n].data = src.data  # a staging set's memory: never written here
                    # a storage that views share keeps its data (copied into), as vLLM's reload does
                    elif rebind and _unshared(old, known=1):
                        if new is params and (mod, n) in lent:
                            self._retired.append(old)  # the staging sets' memory serves it from now on
                        else:  # not freed here (~0.1 ms per MiB in the pause): the next build's buffer
                            self._spare[(id(mod), "p" if new is params else "b", n)] = old
                        live[n].data = src.data
                    else:
                        old.copy_(src)
                    del old
            mod.__dict__.update(attrs)
            for k in removed:
                mod.__dict__.pop(k, None)
        if len(self.sets) > 1:
            self._live = self._pulled  # the next pull goes into the other set
        t1 = clock()
        if shadow.pending:
            self._privatize(shadow.pending)
            self._replay_all(shadow.pending)
        t2 = clock()
        for layer in self.model.modules():
            if is_deferred_attention_layer(layer):
                layer.process_weights_after_loading(self.model_config.dtype)
        self.last.update(swap_s=t1 - t, in_pause_s=t2 - t1, attention_s=clock() - t2, shadow_build_s=shadow.seconds,
                         shadow_mib=shadow.nbytes / 2**20, lent_mib=shadow.lent / 2**20, in_pause_modules=float(len(shadow.pending)))  # fmt: skip

    def _owned(self) -> set[int]:
        """The data pointers of the staging sets' lent memory."""
        return {t.untyped_storage().data_ptr() for st in self.sets for t in st.lent.values()}

    def _privatize(self, modules: Sequence[Any]) -> None:
        """Give each live tensor of ``modules`` that is a staging set's memory a copy of its own,
        before vLLM's reload writes the next version into them (it copies into the live tensors):
        a staging set's memory is only ever written by a pull."""
        from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

        owned = self._owned()
        for mod in modules:
            for group in get_layer_params_buffers(mod):
                for t in group.values():
                    if t.untyped_storage().data_ptr() in owned:
                        t.data = t.data.clone()

    def _rebind_storage(self) -> bool:
        """Whether a live parameter may take a new storage: nothing captured the old one (the CPU
        build, or CUDA graphs off)."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return True
        mode = getattr(self.vllm_config.compilation_config, "cudagraph_mode", None)
        return mode is not None and str(getattr(mode, "name", mode)) == "NONE"

    def finish_weight_update(self) -> None:
        """Nothing left: ``update_weights`` loaded the whole model. (The version vLLM reports
        is the frontend's: ``finish_weight_update(weight_version=...)``.)"""
        gc_time, self._gc_time = self._gc_time, _GcTime()
        gc_time.stop()
        if gc_time.marked is not None:  # collections between the update's end and this call
            seconds, count = gc_time.marked
            self.last.update(gc_after_s=gc_time.seconds - seconds, gc_after_collections=float(gc_time.count - count))

    def shutdown(self) -> None:
        """Close the handle (the parameters keep what they hold)."""
        try:
            self._join_prefetch()
        except BaseException:  # noqa: BLE001 - shutting down: the error was the prefetch's
            pass
        self._shadow = None
        self._spare.clear()
        self._retired.clear()
        self._gc_time.stop()
        self._close_sets()
