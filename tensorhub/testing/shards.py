"""The shards the checks read: their layouts (:data:`_MIXED`, or one large tensor), their seeded
bytes, the holder's buffers that run a hook during a copy, reading and writing a shard's
transfer byte space, and random cuts of it."""

from __future__ import annotations

import functools
import itertools
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tensorhub.core.errors import InvalidArgument
from tensorhub.testing.limits import SENTINEL
from tensorhub.transports.buffers import ShardBuffers, layout_of

#: A shard of many dtypes and odd sizes: tiny tensors (packed), and large ones at odd offsets.
_MIXED = (
    ("emb", torch.float32, (300, 7)),
    ("ln", torch.bfloat16, (333,)),
    ("f8", torch.float8_e4m3fn, (517,)),
    ("ids", torch.int64, (41,)),
    ("q", torch.int8, (77,)),
    ("mask", torch.bool, (10,)),
    ("empty", torch.float16, (0,)),
    ("h", torch.float16, (5, 3)),
    ("wide", torch.bfloat16, (1_100_003,)),
    ("f8big", torch.float8_e4m3fn, (2_500_001,)),
    ("deep", torch.float32, (3, 200_001)),
    ("tail", torch.float64, (1001,)),
)


class _HookedBuffers(ShardBuffers):
    """Holder buffers that run ``hook`` once, right after a transport took memory to copy
    from (``views``) or copied it out (``copy_out``). ``hook_threads`` records where it ran."""

    def arm(self, hook: Callable[[], object]) -> None:
        self._hook_lock = threading.Lock()
        self._hook: Callable[[], object] | None = hook
        self.hook_threads: list[threading.Thread] = []

    def _fire(self) -> None:
        lock = getattr(self, "_hook_lock", None)
        if lock is None:
            return
        with lock:
            hook, self._hook = self._hook, None
        if hook is not None:
            self.hook_threads.append(threading.current_thread())
            hook()

    def disarm(self) -> bool:
        """No hook from now on; returns whether the armed one ran."""
        lock = getattr(self, "_hook_lock", None)
        if lock is not None:
            with lock:
                self._hook = None
        return self.hook_fired

    @property
    def hook_fired(self) -> bool:
        return bool(getattr(self, "hook_threads", None))

    def views(self, offset: int, length: int) -> list[memoryview]:
        out = super().views(offset, length)
        self._fire()
        return out

    def copy_out(self, offset: int, dest: memoryview) -> None:
        super().copy_out(offset, dest)
        self._fire()


def _write(buf: ShardBuffers, offset: int, data: bytes | memoryview) -> None:
    """Put ``data`` at ``offset`` of the transfer space (bypassing any hook)."""
    if buf.on_cuda:
        ShardBuffers.copy_in(buf, offset, memoryview(data))
        return
    pos = 0
    for v in ShardBuffers.views(buf, offset, len(data)):
        v[:] = data[pos : pos + len(v)]
        pos += len(v)


def _bytes(buf: ShardBuffers) -> bytes:
    """The whole transfer space (bypassing any hook)."""
    if buf.on_cuda:
        out = bytearray(buf.total_bytes)
        ShardBuffers.copy_out(buf, 0, memoryview(out))
        return bytes(out)
    return b"".join(bytes(v) for v in ShardBuffers.views(buf, 0, buf.total_bytes))


def _zeros(specs: tuple, device: str) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s, dtype=d, device=device) for n, d, s in specs}


def _tensor_specs(kind: str, nbytes: int) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
    if kind == "mixed":
        return _MIXED
    return (("head", torch.float16, (1001,)), ("big", torch.uint8, (nbytes,)), ("tail", torch.int32, (777,)))


@functools.lru_cache(maxsize=8)
def _geometry(kind: str, nbytes: int) -> tuple[int, tuple[int, ...]]:
    """``(total bytes, region bounds)`` of a shard kind: where one region of the transfer space
    ends and the next begins (from CPU memory: views do not work on CUDA memory)."""
    tensors = {n: torch.empty(s, dtype=d) for n, d, s in _tensor_specs(kind, nbytes)}
    twin = ShardBuffers(tensors, layout_of(tensors))
    bounds, pos = [], 0
    for v in ShardBuffers.views(twin, 0, twin.total_bytes):
        pos += len(v)
        if 0 < pos < twin.total_bytes:
            bounds.append(pos)
    return twin.total_bytes, tuple(sorted(set(bounds)))


@functools.lru_cache(maxsize=4)
def _shard_data(seed: int | str, total: int) -> bytes:
    """The seeded content of a shard (the same in every process: a str seed is hashed with
    SHA-512, not with the per-process string hash)."""
    return random.Random(seed).randbytes(total)


@dataclass(frozen=True, slots=True)
class _ShardSpec:
    """What both sides need to make the same shard: ``key`` names its buffers on the holder's
    side; ``kind`` is ``"mixed"`` (:data:`_MIXED`) or ``"large"`` (``nbytes`` in one tensor
    between two small ones); ``seed`` makes its bytes; ``filled``: the holder's buffers start
    with them (else zeros, for a partial holder to fill); ``in_place``: which side keeps its
    packs in place (``"holder"``, ``"reader"``; "": neither), for transports that gather."""

    key: int
    kind: str
    seed: int
    nbytes: int = 0
    device: str = "cpu"
    filled: bool = True
    in_place: str = ""

    def __post_init__(self) -> None:
        # It also comes off the pipe from the checking process: refuse anything odd.
        ok = (
            type(self.key) is int
            and self.kind in ("mixed", "large")
            and type(self.seed) is int
            and type(self.nbytes) is int
            and 0 <= self.nbytes <= 1 << 34
            and isinstance(self.device, str)
            and (self.device == "cpu" or self.device.startswith("cuda"))
            and type(self.filled) is bool
            and self.in_place in ("", "holder", "reader")
        )
        if not ok:
            raise InvalidArgument(f"bad shard description {self!r}")

    def geometry(self) -> tuple[int, tuple[int, ...]]:
        return _geometry(self.kind, self.nbytes)

    def data(self, which: str = "") -> bytes:
        """The shard's bytes; ``which="churn"``: the other content ``seqlock_during`` writes."""
        return _shard_data(f"{self.seed}:{which}" if which else self.seed, self.geometry()[0])

    def wire(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}

    @classmethod
    def from_wire(cls, d: Any) -> _ShardSpec:
        if not isinstance(d, dict) or set(d) - set(cls.__slots__):
            raise InvalidArgument(f"bad shard description {d!r}")
        return cls(**d)


class _Shard:
    """The checking process's view of a shard: its description, bytes and geometry, and how
    to make readers' buffers for it. The holder's buffers live on the holder's side."""

    def __init__(self, spec: _ShardSpec) -> None:
        self.spec = spec
        self.specs = _tensor_specs(spec.kind, spec.nbytes)
        self.total, bounds = spec.geometry()
        self.bounds = list(bounds)
        self.device = spec.device

    @property
    def data(self) -> bytes:
        return self.spec.data()

    def fresh(self, device: str | None = None, fill: int = SENTINEL) -> ShardBuffers:
        """Reader buffers of the same layout, every byte ``fill``."""
        tensors = _zeros(self.specs, device or self.device)
        buf = ShardBuffers(tensors, layout_of(tensors), packs_in_place=self.spec.in_place == "reader")
        _write(buf, 0, bytes([fill]) * buf.total_bytes)
        return buf

    def sibling(self, key: int) -> _Shard:
        """Other holder buffers of the same layout, not filled."""
        s = self.spec
        return _Shard(_ShardSpec(key, s.kind, s.seed, s.nbytes, s.device, False, s.in_place))


def _partition(rng: random.Random, total: int, cuts: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut at ``cuts`` random places: (offset, length) pairs."""
    points = sorted({0, total, *rng.sample(range(1, total), min(cuts, total - 1))})
    return [(a, b - a) for a, b in itertools.pairwise(points)]
