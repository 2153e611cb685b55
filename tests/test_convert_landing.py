"""A conversion tells a listener of each destination tensor as it becomes whole
(:func:`tensorhub.runtime.convert.listen`): what vLLM's backend builds a layer's processed weights
on while later layers still land. What must hold: ``begin`` first, then each destination tensor
said landed exactly once, and at that moment its bytes are the version's, verified (a unit damaged
on the way was caught and read again before: never said landed with the damaged byte); a listener
that raises does not fail the conversion; bad arguments are typed errors."""

from __future__ import annotations

import threading

import pytest
import torch

import tensorhub
from tensorhub.core.errors import InvalidArgument
from tensorhub.runtime import convert

from .test_reshard_in_place import DEST, MAPPING, _expect, _publish, _register_dest, _source, server  # noqa: F401 (server: a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class _Recorder:
    """Notes each call, and whether the tensor said landed held the expected bytes right then."""

    def __init__(self, dest: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
        self.dest, self.expected = dest, expected
        self.calls: list[tuple] = []
        self.lock = threading.Lock()

    def begin(self, version: int) -> None:
        with self.lock:
            self.calls.append(("begin", version))

    def landed(self, version: int, tensor: str) -> None:
        right = torch.equal(self.dest[tensor], self.expected[tensor])  # the bytes as they are when said landed
        with self.lock:
            self.calls.append(("landed", version, tensor, right))


def _expected(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"w2": full["w"], "c": full["c"].to(torch.bfloat16), "n": full["n"], "e": full["e"]}


def test_each_tensor_is_said_landed_once_with_its_verified_bytes_even_after_a_damaged_read(server):
    # one flipped byte in e (replicated, read in place) of the first read that covers it: caught, read again
    offset = 2 * (2 << 20) + 256 + 1000  # w's and c's local 2 MiB each after the 256-byte pack, then into e
    damaged = {"local": {"faults": [{"op": "corrupt", "at": offset, "times": 1}]}}
    h = tensorhub.open("dst", "infer-1", server=server.address, convert_from="src", mapping=MAPPING, transports=damaged)
    trainer: list = []
    try:
        dest = _register_dest(h)
        full = _source(5)
        rec = _Recorder(dest, _expected(full))
        convert.listen(h.buffers, rec)
        trainer = _publish(server, full, 1)
        assert h.replicate(1, timeout=30) == 1
        _expect(dest, full)
        stats = h.last_conversion
        assert stats is not None and stats.failures == 1, stats  # the damaged read: refused, read again
        assert rec.calls[0] == ("begin", 1)
        landed = rec.calls[1:]
        assert sorted(c[2] for c in landed) == sorted(DEST), rec.calls  # each destination tensor once
        assert all(c[0] == "landed" and c[1] == 1 and c[3] for c in landed), rec.calls  # with its verified bytes

        # the next version into the same buffers: begin again, each tensor again; a listener
        # that raises is logged and told nothing more, and the conversion still lands everything
        full2 = _source(6)
        rec.calls.clear()
        rec.expected = _expected(full2)
        raised: list[str] = []

        class _Raising(_Recorder):
            def landed(self, version: int, tensor: str) -> None:
                raised.append(tensor)
                raise RuntimeError("a consumer's bug")

        convert.listen(h.buffers, _Raising(dest, rec.expected))
        for t in trainer:
            t.close()
        trainer = _publish(server, full2, 2)
        assert h.update(2, timeout=30) and h.version == 2
        _expect(dest, full2)
        assert len(raised) == 1, raised  # told once, then nothing more

        assert convert._LISTENERS.get(h.buffers) is not None
        convert.listen(h.buffers, None)
        assert convert._LISTENERS.get(h.buffers) is None
    finally:
        for x in (h, *trainer):
            x.close()


def test_listen_refuses_what_is_not_a_shard_s_buffers_or_a_listener(server):
    with pytest.raises(InvalidArgument, match="handle.buffers"):
        convert.listen(object(), _Recorder({}, {}))  # type: ignore[arg-type]
    h = tensorhub.open("dst", "infer-1", server=server.address)
    try:
        h.register({"x": torch.zeros(4)})
        with pytest.raises(InvalidArgument, match="begin"):
            convert.listen(h.buffers, object())  # type: ignore[arg-type]
        convert.listen(h.buffers, None)  # removing none: nothing to do
    finally:
        h.close()
