"""The ``local`` transport reading a holder in this very process (an engine beside its trainer,
as ``bench_vllm.py`` runs them): each piece is a ``memmove`` out of the holder's buffers, with
no ``process_vm_readv`` of the bulk (only of the 32 bytes of progress words), every byte still
verified as it lands (a damaged byte is refused and read again)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tensorhub
from tensorhub.core.placement import Replicate, TensorPlacement
from tensorhub.transports import local
from tensorhub.transports.buffers import WORD_BYTES

from .procs import InprocServer
from .test_reshard_in_place import server  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # 12 MiB: reads of more than one 4 MiB part (the copy threads), and a few tiny tensors (a pack)
    out = {"w1": torch.randn(1536, 1024, generator=g), "w2": torch.randn(1536, 1024, generator=g)}
    out.update({f"n{i}": torch.randn(64, generator=g) for i in range(4)})
    return out


class _Spy:
    """Bytes moved by ``memmove`` and by ``process_vm_readv`` (by call size) in the transport."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.memmoved = 0
        self.vm_calls: list[int] = []
        memmove, vm_read, vm_span = local._memmove, local._vm_read, local._vm_read_span

        def spy_memmove(dst: list[tuple[int, int]], src: list[tuple[int, int]]) -> None:
            self.memmoved += sum(n for _, n in dst)
            memmove(dst, src)

        def spy_vm_read(pid: int, dst: list[tuple[int, int]], src: list[tuple[int, int]]) -> None:
            self.vm_calls.append(sum(n for _, n in dst))
            vm_read(pid, dst, src)

        def spy_vm_span(readv: Any, pid: int, dst: int, src: int, n: int) -> None:
            self.vm_calls.append(n)
            vm_span(readv, pid, dst, src, n)

        monkeypatch.setattr(local, "_memmove", spy_memmove)
        monkeypatch.setattr(local, "_vm_read", spy_vm_read)
        monkeypatch.setattr(local, "_vm_read_span", spy_vm_span)


def _pull(server: InprocServer, transports: dict, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    full = _weights(seed)
    places = {n: TensorPlacement.of(n, "float32", tuple(t.shape), Replicate(), 1) for n, t in full.items()}
    trainer = tensorhub.open("same", "train", server=server.address, transports=transports)  # one engine per process
    reader = tensorhub.open("same", "infer", server=server.address, transports=transports)
    try:
        trainer.register({n: t.clone() for n, t in full.items()}, placements=places)
        into = {n: torch.zeros_like(t) for n, t in full.items()}
        reader.register(into, placements=places)
        trainer.publish(1)
        assert reader.replicate(1, timeout=30) == 1
        stats = reader.last_pull
        assert stats is not None and stats.transports and set(stats.transports) == {"local"}, stats
        total = sum(t.numel() * t.element_size() for t in full.values())
        return full, into, total
    finally:
        reader.close()
        trainer.close()


def test_a_holder_in_this_process_is_copied_with_memmove_not_process_vm_readv(server, seed, monkeypatch):
    spy = _Spy(monkeypatch)
    full, into, total = _pull(server, {"local": {}}, seed)
    for n, t in full.items():
        assert torch.equal(into[n], t), n
    assert spy.memmoved == total, (spy.memmoved, total)  # every byte once, by memmove
    assert spy.vm_calls and max(spy.vm_calls) <= WORD_BYTES, sorted(spy.vm_calls)[-4:]  # only progress words


def test_a_damaged_byte_copied_from_this_process_is_refused_and_read_again(server, seed, monkeypatch):
    spy = _Spy(monkeypatch)
    # a byte of w2 (the second large tensor: after the pack and w1 in the transfer space)
    damaged = {"local": {"faults": [{"op": "corrupt", "at": 6 << 20, "times": 1}]}}
    full, into, total = _pull(server, damaged, seed)
    for n, t in full.items():
        assert torch.equal(into[n], t), n
    assert spy.memmoved > total, (spy.memmoved, total)  # the damaged read was refused and read again
    assert max(spy.vm_calls) <= WORD_BYTES
