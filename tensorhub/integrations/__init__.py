"""Integrations with the frameworks a job runs in: Ray (:mod:`tensorhub.integrations.ray`,
also :mod:`tensorhub.ray`) and vLLM (:mod:`tensorhub.integrations.vllm`). Each imports its
framework only when used; the framework comes with an extra (``tensorhub[ray]``,
``tensorhub[vllm]``), never with the base install. torchrun needs no integration:
``tensorhub.open`` takes ``num_shards``/``shard_idx`` from ``$WORLD_SIZE``/``$RANK``."""
