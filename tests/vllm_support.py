"""What the vLLM test modules share (imported by them; vLLM itself imported only when used)."""

from __future__ import annotations

import pytest


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
