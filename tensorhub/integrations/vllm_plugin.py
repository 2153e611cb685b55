"""vLLM's plugin hook for TensorHub: registers the ``tensorhub`` weight-transfer backend.

setup.cfg names :func:`register` in the entry-point group ``vllm.general_plugins``, which vLLM
loads in every one of its processes (``vllm/plugins/__init__.py``: the frontend, the engine core,
each worker) before it builds a weight-transfer engine; so ``weight_transfer_config={"backend":
"tensorhub"}`` works with no import in user code. The backend itself is
:mod:`tensorhub.integrations.vllm_backend`, imported only when vLLM creates it (the factories
register names lazily), so this module costs nothing and imports no vLLM at its top.
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

#: The name of the backend in vLLM's weight-transfer factories.
BACKEND = "tensorhub"
_MODULE = "tensorhub.integrations.vllm_backend"
_TRAINER_MODULE = "tensorhub.integrations.vllm_trainer"


def register() -> None:
    """Register the ``tensorhub`` backend in vLLM's worker-side and trainer-side factories.
    Calling it again (vLLM may load plugins more than once per process) changes nothing."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _MODULE, "TensorHubWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, _TRAINER_MODULE, "TensorHubTrainerWeightTransferEngine")
