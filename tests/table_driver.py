"""Drives a ReferenceTable the way clients would, with a virtual clock: the test side of the
sans-IO core. Each :class:`Shard` is one shard handle's protocol endpoint; what the table sends
it lands in its ``inbox``."""

from __future__ import annotations

import itertools
import random
from typing import Any

from tensorhub.core import messages as m
from tensorhub.core.layout import Layout, TensorSpec
from tensorhub.core.table import ReferenceTable, TableConfig
from tensorhub.core.topology import Location
from tensorhub.scheduling.selection import SourceIndex


class VirtualClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_layout(*sizes: int, chunk: int = 1 << 20) -> Layout:
    return Layout(
        tuple(TensorSpec(f"t{i}", "uint8", (n,), n) for i, n in enumerate(sizes)),
        "xxh3-64",
        chunk,
        2 << 20,
    )


LAYOUT = make_layout(4096, 8192)


class Driver:
    def __init__(self, seed: int = 0, config: TableConfig | None = None, term: int = 1) -> None:
        self.clock = VirtualClock()
        self.table = ReferenceTable(self.clock, random.Random(seed), config or TableConfig(), term=term, sources=SourceIndex)
        self.shards: dict[str, Shard] = {}
        self._req = itertools.count(1)
        self.log: list[tuple[Any, Any]] = []

    def next_req(self) -> int:
        return next(self._req)

    def deliver(self, out: list) -> list:
        for peer, msg in out:
            self.log.append((peer, msg))
            shard = self.shards.get(peer)
            if shard is not None:
                shard.inbox.append(msg)
        return out

    def send(self, peer: str, msg: Any) -> list:
        return self.deliver(self.table.handle(peer, msg))

    def advance(self, dt: float) -> list:
        self.clock.t += dt
        return self.deliver(self.table.tick())

    def run_for(self, dt: float, step: float = 1.0) -> None:
        """Let ``dt`` seconds pass while every open shard heartbeats each ``step``."""
        t_end = self.clock.t + dt
        while self.clock.t < t_end:
            self.advance(min(step, t_end - self.clock.t))
            for s in list(self.shards.values()):
                if s.session in self.table.sessions:
                    self.send(s.peer, m.Heartbeat(0, (s.session,)))
                    s.take(m.HeartbeatAck)

    def shard(self, replica: str, shard_idx: int = 0, num_shards: int = 1, **kw) -> "Shard":
        return Shard(self, replica=replica, shard_idx=shard_idx, num_shards=num_shards, **kw)

    def replica(self, name: str, num_shards: int, **kw) -> list["Shard"]:
        return [self.shard(name, i, num_shards, **kw) for i in range(num_shards)]


class Shard:
    def __init__(
        self,
        driver: Driver,
        replica: str,
        shard_idx: int,
        num_shards: int,
        model: str = "actor",
        dc: str = "dc0",
        host: str | None = None,
        spot: bool = False,
        retain: int | None = None,
        incarnation: str = "i1",
        layout: Layout | None = LAYOUT,
        open: bool = True,
        source: str | None = None,
        placements: tuple | None = None,
    ) -> None:
        self.d = driver
        self.model = model
        self.replica = replica
        self.shard_idx = shard_idx
        self.num_shards = num_shards
        self.location = Location(dc, host or f"{replica}-host", "")
        self.spot = spot
        self.retain = retain
        self.incarnation = incarnation
        self.source = source
        self.placements = placements
        self.peer = f"{model}/{replica}/{shard_idx}/{incarnation}"
        driver.shards[self.peer] = self
        self.inbox: list[Any] = []
        self.session: int | None = None
        self.call = 0
        if open:
            self.open()
            if layout is not None:
                self.expect_ok(self.register(layout))

    # -- sending ---------------------------------------------------------------------------
    def send(self, msg: Any) -> list:
        return self.d.send(self.peer, msg)

    def request(self, cls, *args, **kw) -> int:
        req = self.d.next_req()
        self.send(cls(req, *args, **kw))
        return req

    def reply(self, req: int, *, pop: bool = True) -> Any:
        """The final reply to ``req`` if it has arrived (None if not yet)."""
        for i, msg in enumerate(self.inbox):
            if getattr(msg, "req", None) == req and not isinstance(msg, m.Grant) and not (
                isinstance(msg, m.Listing) and not msg.final
            ):
                return self.inbox.pop(i) if pop else msg
        return None

    def expect_ok(self, req: int) -> Any:
        r = self.reply(req)
        assert r is not None, f"no reply to request {req}; inbox: {self.inbox}"
        if isinstance(r, m.Failed):
            raise r.error()
        return r

    def expect_error(self, req: int, cls: type) -> Exception:
        r = self.reply(req)
        assert isinstance(r, m.Failed), f"expected {cls.__name__}, got {r}"
        err = r.error()
        assert isinstance(err, cls), f"expected {cls.__name__}, got {type(err).__name__}: {err}"
        return err

    def take(self, cls) -> list:
        got = [x for x in self.inbox if isinstance(x, cls)]
        self.inbox = [x for x in self.inbox if not isinstance(x, cls)]
        return got

    def next_call(self) -> int:
        self.call += 1
        return self.call

    # -- the protocol ------------------------------------------------------------------------
    def open(self) -> m.Opened:
        req = self.d.next_req()
        self.send(
            m.OpenShard(
                req, self.model, self.replica, self.num_shards, self.shard_idx, self.incarnation, self.location,
                self.spot, self.retain, self.source,
            )
        )
        r = self.expect_ok(req)
        self.session = r.session
        return r

    def register(self, layout: Layout = LAYOUT, endpoint: Any = None) -> int:
        return self.request(
            m.Register, self.session, layout, endpoint or {"tcp": f"{self.peer}"}, None, self.placements
        )

    def unregister(self) -> int:
        return self.request(m.Unregister, self.session)

    def publish(self, version: int, checksums=None) -> int:
        return self.request(m.Publish, self.session, self.next_call(), version, checksums)

    def unpublish(self) -> int:
        return self.request(m.Unpublish, self.session, self.next_call())

    def replicate(self, spec, timeout=None) -> int:
        return self.request(m.Replicate, self.session, self.next_call(), spec, timeout)

    def update(self, spec="latest", timeout=None, offload_seed: bool = False) -> int:
        return self.request(m.Update, self.session, self.next_call(), spec, timeout, offload_seed)

    def list(self, consistent: bool = False) -> m.Listing:
        req = self.request(m.ListVersions, self.session, self.next_call() if consistent else None)
        return self.expect_ok(req)

    def close(self) -> int:
        return self.request(m.CloseShard, self.session)

    def heartbeat(self) -> m.HeartbeatAck:
        return self.expect_ok(self.request(m.Heartbeat, (self.session,)))

    def grants(self) -> list[m.Grant]:
        return self.take(m.Grant)

    def grant(self) -> m.Grant:
        gs = self.grants()
        assert len(gs) == 1, f"expected one grant, got {gs}; inbox {self.inbox}"
        return gs[0]

    def complete(self, g: m.Grant) -> Any:
        return self.expect_ok(self.request(m.Complete, self.session, g.grant, g.term))

    def pull(self, spec, timeout=None) -> Any:
        """replicate(spec) and complete every grant that arrives: the happy path."""
        req = self.replicate(spec, timeout)
        for g in self.grants():
            self.complete(g)
        return req

    def progress(self, g: m.Grant, verified: int) -> list:
        return self.send(m.Progress(0, self.session, g.grant, g.term, verified))

    def source_failed(self, g: m.Grant, verified: int = 0) -> Any:
        return self.expect_ok(self.request(m.SourceFailed, self.session, g.grant, g.term, verified, "test"))

    def checksum_failed(self, g: m.Grant, verified: int = 0) -> Any:
        return self.expect_ok(self.request(m.ChecksumFailed, self.session, g.grant, g.term, verified, 0))


def complete_all(shards: list[Shard]) -> None:
    """Complete every grant waiting in these shards' inboxes, until none is left."""
    for _ in range(1000):
        progressed = False
        for s in shards:
            for g in s.grants():
                s.complete(g)
                progressed = True
        if not progressed:
            return
    raise AssertionError("grants kept coming")
