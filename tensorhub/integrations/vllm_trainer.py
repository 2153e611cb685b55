"""TensorHub's vLLM weight-transfer backend, the trainer's side: ``TensorHubTrainerWeightTransferEngine``
(``WeightTransferTrainerFactory.trainer_init`` with ``backend="tensorhub"``), the offline
``LLM``'s client, and :func:`update` / :func:`latest_version` for any of vLLM's clients.

A trainer rank registers its tensors once and publishes a reference per version; no bytes move
at publish. The engines (:mod:`tensorhub.integrations.vllm_backend`, the worker side) pull the
version from whoever holds it. This module imports none of the worker side, so a trainer process
builds no loader trace and imports no vLLM model code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

import tensorhub
from tensorhub.core.errors import InvalidArgument
from tensorhub.core.placement import REPLICATE, TensorPlacement
from tensorhub.integrations.vllm_plugin import BACKEND

if TYPE_CHECKING:
    from tensorhub.handles.api import ShardHandle

__all__ = ["LLMClient", "TensorHubTrainerInitInfo", "TensorHubTrainerWeightTransferEngine", "latest_version", "update"]

from vllm.distributed.weight_transfer.base import (  # noqa: E402 - vLLM is this module's premise
    TrainerInitInfo,
    TrainerWeightTransferEngine,
)


def _version(value: Any, what: str) -> int | str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"{what}: a version is an integer >= 0 or 'latest', got {value!r}")
    if isinstance(value, int) and value < 0:
        raise InvalidArgument(f"{what}: a version is an integer >= 0 or 'latest', got {value!r}")
    if isinstance(value, str) and value != "latest" and not value.startswith("latest-"):
        if not value.isdigit():
            raise InvalidArgument(f"{what}: a version is an integer >= 0 or 'latest', got {value!r}")
        return int(value)
    return value


# --- the trainer-side engine --------------------------------------------------------------------


@dataclass
class TensorHubTrainerInitInfo(TrainerInitInfo):
    """The trainer side's init info (``WeightTransferTrainerFactory.trainer_init``).

    Attributes:
        model: the TensorHub model this trainer publishes (Hugging Face names).
        replica: the trainer's replica name.
        num_shards, shard_idx: this rank's shard of the replica (None: torchrun's world and rank).
        server: the reference server.
        engine: the ``init_info`` to send the inference engines (``source_model`` defaults to
            ``model``); None: do not initialize them (they were).
        first_version: the version the first ``send_weights`` publishes.
        shared_memory: register the tensors in shared memory (``ShardHandle.register(...,
            shared_memory=True)``: moved there once, in place): an engine on the same host, in
            another process (``vllm serve``, vLLM's multiprocess engine), then copies them with
            ``memmove`` out of a mapping of the trainer's files instead of ``process_vm_readv``
            (``benchmarks/bench_vllm.py --serve --trainer-shared-memory``). The tensors stay the
            same objects (views of them follow); their ``data_ptr()`` changes.
    """

    backend: ClassVar[str] = BACKEND

    model: str = ""
    replica: str = "trainer"
    num_shards: int | None = None
    shard_idx: int | None = None
    server: str | None = None
    engine: dict[str, Any] | None = None
    first_version: int = 1
    shared_memory: bool = False


class TensorHubTrainerWeightTransferEngine(TrainerWeightTransferEngine[TensorHubTrainerInitInfo]):
    """The trainer side: registers this rank's tensors once and publishes a reference per
    version (no bytes move at publish); the sender then drives the engines' update through
    vLLM's client (``start_weight_update``, ``update_weights({"version": v})``,
    ``finish_weight_update(weight_version=str(v))``), where the engines pull the version.

    ``source``: a :class:`~vllm.distributed.weight_transfer.base.WeightSource` (its tensors are
    materialized once and registered: the buffers are reused in place, so the caller copies
    new weights into :attr:`tensors`), or pass ``tensors=`` and ``placements=`` (a rank's local
    shards, as :meth:`tensorhub.ShardHandle.register`) to :meth:`trainer_init`.
    """

    init_info_cls = TensorHubTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.handle: ShardHandle | None = None
        self.version: int | None = None  #: the version published last
        self.next_version = 1
        self.published = False

    @classmethod
    def trainer_init(
        cls,
        init_info: TensorHubTrainerInitInfo,
        *,
        client: Any = None,
        source: Any = None,
        tensors: dict[str, torch.Tensor] | None = None,
        placements: dict[str, Any] | None = None,
    ) -> TensorHubTrainerWeightTransferEngine:
        """Open this rank's handle, register its tensors and (sender) initialize the engines.

        Raises:
            InvalidArgument: neither ``source`` nor ``tensors``, or both; no model name.
        """
        if not init_info.model:
            raise InvalidArgument("TensorHubTrainerInitInfo needs model= (the TensorHub model to publish)")
        if (source is None) == (tensors is None):
            raise InvalidArgument("trainer_init takes the weights as source= (a WeightSource) or tensors=, exactly one")
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        if tensors is None:
            tensors = {n: t.detach().contiguous() for n, t in source}
        if placements is None and (init_info.num_shards or 1) == 1:
            # one shard holds every tensor whole: what a converter needs to plan from it
            placements = {n: TensorPlacement(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), (1,), (REPLICATE,))
                          for n, t in tensors.items()}  # fmt: skip
        self.handle = tensorhub.open(init_info.model, init_info.replica, num_shards=init_info.num_shards,
                                     shard_idx=init_info.shard_idx, server=init_info.server)  # fmt: skip
        try:
            self.handle.register(tensors, placements=placements, shared_memory=init_info.shared_memory)
        except BaseException:
            self.handle.close()
            raise
        self.next_version = init_info.first_version
        if init_info.engine is not None and self.is_sender and client is not None:
            engine = {"source_model": init_info.model, **init_info.engine}
            if "names" not in engine:
                # the engines trace their loader with the tensors this trainer publishes (global shapes)
                shapes = {n: _global_shape(t, (placements or {}).get(n)) for n, t in tensors.items()}
                engine.update(names=list(tensors), dtype_names=[str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                              shapes=[list(shapes[n]) for n in tensors])  # fmt: skip
            if init_info.server is not None:
                engine.setdefault("server", init_info.server)
            client.init_weight_transfer_engine(engine)
        return self

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The registered tensors (write the next version's weights into them, then publish)."""
        assert self.handle is not None
        return self.handle.tensors

    def unpublish(self) -> None:
        """Withdraw the published version; returns once no reader reads the tensors, which may
        then be written (the next version's weights: the optimizer step)."""
        assert self.handle is not None
        if self.published:
            self.handle.unpublish()
            self.published = False

    def publish(self, version: int | None = None) -> int:
        """Publish the registered tensors as ``version`` (default: the one after the last).
        Returns at once: a reference, no bytes move; the tensors must not change until
        :meth:`unpublish` (called here first if the previous version is still published: write
        new weights only after unpublishing)."""
        assert self.handle is not None
        v = self.next_version if version is None else version
        self.unpublish()
        self.handle.publish(v)
        self.version, self.next_version, self.published = v, v + 1, True
        return v

    def send_weights(self, version: int | None = None) -> None:
        """Publish, then (sender, with a client) have the engines load that version and
        report it as their weight version. Call on every trainer rank."""
        v = self.publish(version)
        if self.is_sender and self.client is not None:
            self.client.start_weight_update()
            self.client.update_weights({"version": v})
            self.client.finish_weight_update(weight_version=str(v))

    def shutdown(self) -> None:
        h, self.handle = self.handle, None
        if h is not None:
            h.close()


def _global_shape(t: torch.Tensor, placement: Any) -> tuple[int, ...]:
    """The whole tensor's shape: its placement's (a TensorPlacement, or a PlacedTensor's), a
    DTensor's, or the tensor's own."""
    placement = getattr(placement, "placement", placement)
    return tuple(getattr(placement, "shape", None) or t.shape)


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` over an offline ``LLM`` (vLLM ships HTTP and Ray ones):
    what :class:`TensorHubTrainerWeightTransferEngine` drives when the engine is in-process."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)


def latest_version(source_model: str, server: str | None = None, timeout: float = 5.0) -> int | None:
    """The highest available version of ``source_model`` on the server (None: none), asked
    without opening a shard: what ``"latest"`` would resolve to now.

    ``server``: an address (None: ``$TENSORHUB_SERVER``, else the embedded default's).

    Raises:
        ServerUnavailable: no answer within ``timeout`` seconds.
    """
    from tensorhub.runtime.embedded import embedded_address, parse_servers
    from tensorhub.tools.admin import cluster_state

    address = parse_servers(server)[0] if server else (os.environ.get("TENSORHUB_SERVER") or embedded_address()).split(",")[0]
    for model in cluster_state(address, timeout).models:
        if model.model == source_model:
            versions = [v.version for v in model.versions if v.available]
            return max(versions) if versions else None
    return None


def update(client: Any, version: int | str = "latest", *, source_model: str = "", server: str | None = None) -> int:
    """Bring the engines behind ``client`` (a ``VLLMWeightSyncClient``: :class:`LLMClient`,
    vLLM's HTTP or Ray client) to ``version`` and make it vLLM's weight version: ``"latest"`` is
    resolved here first (:func:`latest_version` of ``source_model``), so every worker loads the
    same number and ``/weight_info`` names it. Returns the version.

    Raises:
        InvalidArgument: ``"latest"`` without ``source_model``, or nothing published yet.
    """
    v = _version(version, "update")
    if not isinstance(v, int):
        if not source_model:
            raise InvalidArgument('update(version="latest") needs source_model= (the model whose latest version to load)')
        latest = latest_version(source_model, server)
        k = int(v.partition("-")[2] or 0)
        if latest is None or latest - k < 0:
            raise InvalidArgument(f"update: {source_model!r} has no available version to resolve {v!r} against")
        v = latest - k
    client.start_weight_update()
    client.update_weights({"version": v})
    client.finish_weight_update(weight_version=str(v))
    return v
