"""Resharding end to end, in real processes, through the real server.

A Qwen3-shaped trainer replica of 4 shards (Hugging Face names, bf16, FSDP ``Shard(0)``)
publishes; two inference replicas of 2 shards each (vLLM names, fused ``qkv_proj`` and
``gate_up_proj``, FP8 block weights, tensor parallelism) replicate and update. The first one
converts (once per shard); the second pulls the converted bytes from the first, not from the
trainer. A trainer shard SIGKILLed while the first one converts from it is masked: the source
shard is granted again from the other trainer replica. Every shard's bytes are compared with a
conversion of the trainer's full tensors done in this process."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from tensorhub.core.placement import PlacedTensor, ReplicaLayout
from tensorhub.reshard import convert_in_process, torch_dtype
from tensorhub.scheduling.decoders import DecoderShape, hf_placements, vllm_placements
from tensorhub.scheduling.mapping import preset
from tensorhub.scheduling.reshard import plan

from .procs import RemoteHandle, ServerProcess

pytestmark = pytest.mark.integration

SHAPE = DecoderShape.family("qwen3", layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=128, vocab=512)
TRAIN, TP = 4, 2
SRC = ReplicaLayout.spmd(hf_placements(SHAPE, TRAIN), TRAIN)
DST = ReplicaLayout.spmd(vllm_placements(SHAPE, TP, fp8=True), TP)
MAPPING = preset("qwen3", fp8=True)


def _full(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * version)
    return {t.name: (torch.randn(t.shape, generator=g) * 0.05).to(torch_dtype(t.dtype)) for t in SRC.tensors().values()}


def _source_shards(version: int) -> list[dict[str, torch.Tensor]]:
    full = _full(version)
    out = []
    for tensors in SRC.shards:
        shard = {}
        for pt in tensors:
            (piece,) = pt.pieces()
            shard[pt.name] = full[pt.name][tuple(slice(a, b) for a, b in zip(piece.box.start, piece.box.stop))].clone()
        out.append(shard)
    return out


def _expected(version: int) -> list[dict[str, str]]:
    shards = _source_shards(version)
    got = convert_in_process(plan(SRC, DST, MAPPING), shards)
    return [{k: _digest(t) for k, t in got[j].items()} for j in range(TP)]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _placed(rl: ReplicaLayout, i: int) -> dict[str, PlacedTensor]:
    return {pt.name: pt for pt in rl.shards[i]}


@pytest.fixture
def server():
    srv = ServerProcess("--heartbeat-interval", "0.3", "--heartbeat-timeout", "3")
    yield srv
    srv.stop()


def test_trainer_to_fp8_tensor_parallel_with_a_source_killed(server):
    addr = server.address
    handles: list[RemoteHandle] = []

    def open_(**kw) -> RemoteHandle:
        h = RemoteHandle(server=addr, **kw)
        handles.append(h)
        return h

    try:
        trainer_a = [open_(model="qwen", replica="train-a", num_shards=TRAIN, shard_idx=i) for i in range(TRAIN)]
        trainer_b = [open_(model="qwen", replica="train-b", num_shards=TRAIN, shard_idx=i) for i in range(TRAIN)]
        for side in (trainer_a, trainer_b):
            for i, h in enumerate(side):
                h.call("register_placed", _placed(SRC, i))
        v1 = _source_shards(1)
        for i, h in enumerate(trainer_b):
            h.call("fill_tensors", v1[i])
        for h in trainer_b:
            h.send("publish", 1)
        for h in trainer_b:
            h.result()

        # The first inference replica converts, slowly (every read delayed), from train-b only.
        slow = {"tcp": {"faults": [{"op": "delay", "seconds": 0.1}]}}
        kw = {"model": "qwen-vllm", "num_shards": TP, "convert_from": "qwen", "mapping": MAPPING, "convert_budget": 1 << 20}
        r1 = [open_(replica="infer-1", shard_idx=j, transports=slow, **kw) for j in range(TP)]
        r2 = [open_(replica="infer-2", shard_idx=j, **kw) for j in range(TP)]
        for side in (r1, r2):
            for j, h in enumerate(side):
                h.call("register_placed", _placed(DST, j))
        # train-a gets the same bytes now, and publishes them once the conversion is under way;
        # then a train-b shard dies mid-conversion. (Filling train-a after the conversion began
        # gave it time to finish its reads from the shard about to die, on a loaded machine.)
        for i, h in enumerate(trainer_a):
            h.call("fill_tensors", v1[i])
        for h in r1:
            h.send("replicate", 1, 120.0)
        for h in trainer_a:
            h.send("publish", 1)
        for h in trainer_a:
            h.result()
        trainer_b[1].kill()
        assert [h.result(timeout=120) for h in r1] == [1, 1]
        want = _expected(1)
        for j, h in enumerate(r1):
            assert h.call("digests") == want[j], f"infer-1 shard {j} differs from the reference conversion"
        convs = [h.call("last_conversion") for h in r1]
        assert all(c is not None and c["version"] == 1 for c in convs)
        assert sum(c["failures"] for c in convs) >= 1, convs  # a read from the killed shard failed ...
        assert any(s.startswith("train-a/") for c in convs for s in c["sources"]), convs  # ... and was granted again
        assert all(c["peak"] <= c["budget"] or c["tasks"] for c in convs)

        # The second replica pulls the converted bytes from the first: no conversion of its own.
        for h in r2:
            h.send("replicate", 1, 60.0)
        assert [h.result(timeout=60) for h in r2] == [1, 1]
        for j, h in enumerate(r2):
            assert h.call("digests") == want[j]
            assert h.call("last_conversion") is None
            assert all(s.startswith("infer-1/") for s in h.call("last_sources")), h.call("last_sources")

        # The trainer moves on: both inference replicas update (the first converts, again once).
        v2 = _source_shards(2)
        for i, h in enumerate(trainer_a):
            h.call("fill_tensors", v2[i])
            h.call("unpublish")
        for h in trainer_a:
            h.send("publish", 2)
        for h in trainer_a:
            h.result()
        for h in r1:
            h.send("update", "latest", 120.0)
        assert [h.result(timeout=120) for h in r1] == [True, True]
        for h in r2:
            h.send("update", "latest", 60.0)
        assert [h.result(timeout=60) for h in r2] == [True, True]
        want = _expected(2)
        for side in (r1, r2):
            for j, h in enumerate(side):
                assert h.call("digests") == want[j]
        assert all(h.call("last_conversion") is None for h in r2)
        assert math.isfinite(float(len(want)))
    finally:
        for h in handles:
            h.kill()
