"""The vLLM worker extension refuses what it cannot serve before any byte moves (no vLLM needed:
a stand-in worker with a torch module where vLLM's model would be)."""

from __future__ import annotations

import types

import pytest
import torch

from tensorhub.core.errors import UsageError
from tensorhub.integrations.vllm import WorkerExtension, _cpu_experts


class _Experts(torch.nn.Module):
    """The parameters of vLLM's fused-MoE layer (``RoutedExperts``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(4, 16, 8), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(4, 8, 8), requires_grad=False)


def _worker(net: torch.nn.Module) -> WorkerExtension:
    w = WorkerExtension()
    w.model_runner = types.SimpleNamespace(model=net)  # type: ignore[attr-defined]
    w._th_rank = lambda: (1, 0)  # type: ignore[method-assign]  # no vLLM process group here
    return w


def test_fused_experts_on_cpu_are_refused_with_the_route_that_serves_them():
    net = torch.nn.Module()
    net.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Module()])
    net.layers[1].experts = _Experts()
    with pytest.raises(UsageError, match=r"layers\.1\.experts .*prepacked.*weight_transfer_config"):
        _worker(net).tensorhub_open("m", "rollout-0")
    # nothing else is taken for experts: a dense model, or experts not in CPU memory
    assert _cpu_experts(net.layers[0]) == []
    on_meta = _Experts().to("meta")
    assert _cpu_experts(on_meta) == [] and _cpu_experts(net) == ["layers.1.experts"]
