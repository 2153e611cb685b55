"""A flow-level network: links with capacities, flows over paths, max-min fair sharing.

Theory of operation
-------------------
A :class:`Link` is one direction of something that carries bytes: a GPU NIC's send side or its
receive side (NICs are full duplex, so the two are separate links), a host's datacenter-facing
(VPC) NIC, an inter-datacenter link. Its ``capacity`` is in bytes per second and already
includes the protocol's efficiency (what the transfer actually achieves of the line rate).

A :class:`Flow` moves ``size`` bytes over a path of links, optionally capped (one TCP stream
reaches only so much however idle the links are). Concurrent flows share links **max-min
fairly**: rates are raised together until a link is full or a flow reaches its cap; the flows
of that link (or that flow) are fixed, and the rest keep rising (progressive filling).

Only the flows that share a link, transitively, with a flow that starts or ends can change
rate, so a start or an end re-solves only that connected component. A thousand GPUs each
pulling over their own NIC pair are a thousand components of one flow: each event costs the
same as in a two-GPU network.

A flow's progress is linear between rate changes; :meth:`Flow.done_bytes` reads it at any time.
Each flow has one completion timer, re-armed whenever its rate changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tensorhub.core.errors import InvalidArgument

from .core import Simulator, Timer

__all__ = ["Flow", "Link", "Network"]

_EPS = 1e-9


class Link:
    """One direction of a link. ``capacity``: bytes per second (efficiency included)."""

    __slots__ = ("bytes", "capacity", "flows", "name")

    def __init__(self, name: str, capacity: float) -> None:
        if not capacity > 0:
            raise InvalidArgument(
                f"link {name!r} needs a positive capacity, got {capacity!r}"
            )
        self.name = name
        self.capacity = float(capacity)
        self.flows: set[Flow] = set()
        self.bytes = 0.0  # carried by ended flows

    def __repr__(self) -> str:
        return f"Link({self.name!r}, {self.capacity / 1e9:.2f} GB/s, {len(self.flows)} flows)"


class Flow:
    """``size`` bytes over ``path``; ``on_done()`` runs when the last byte arrives."""

    __slots__ = (
        "base",
        "cap",
        "id",
        "on_done",
        "path",
        "rate",
        "since",
        "size",
        "started",
        "tag",
        "timer",
    )

    def __init__(
        self,
        fid: int,
        path: Sequence[Link],
        size: float,
        cap: float | None,
        on_done: Callable[[], Any],
        now: float,
        tag: Any,
    ) -> None:
        self.id = fid
        self.path = tuple(path)
        self.size = float(size)
        self.cap = cap
        self.on_done = on_done
        self.rate = 0.0
        self.base = 0.0  # bytes done at ``since``
        self.since = now
        self.timer: Timer | None = None
        self.started = now
        self.tag = tag

    def done_bytes(self, now: float) -> float:
        return min(self.size, self.base + self.rate * (now - self.since))

    def __hash__(self) -> int:
        return self.id

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        return f"Flow({self.id}, {self.size / 1e9:.3f} GB at {self.rate / 1e9:.2f} GB/s, tag={self.tag!r})"


class Network:
    """The links and the flows on them, in one :class:`~tensorhub.sim.core.Simulator`'s time."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.links: dict[str, Link] = {}
        self.flows: set[Flow] = set()
        self._ids = 0
        self.solves = 0

    def link(self, name: str, capacity: float) -> Link:
        """The link ``name``, made with ``capacity`` the first time it is asked for."""
        got = self.links.get(name)
        if got is None:
            got = self.links[name] = Link(name, capacity)
        return got

    def start(
        self,
        path: Sequence[Link],
        size: float,
        on_done: Callable[[], Any],
        cap: float | None = None,
        tag: Any = None,
    ) -> Flow:
        """Start a flow now. A zero-byte flow ends at once (still through the event queue)."""
        if size < 0:
            raise InvalidArgument(f"a flow of {size} bytes")
        if not path:
            raise InvalidArgument("a flow needs at least one link")
        if len(set(path)) != len(path):
            raise InvalidArgument(f"a flow's path crosses a link twice: {[link.name for link in path]}")
        self._ids += 1
        f = Flow(self._ids, path, size, cap, on_done, self.sim.now, tag)
        self.flows.add(f)
        for link in f.path:
            link.flows.add(f)
        self._solve(f.path)
        return f

    def cancel(self, f: Flow) -> None:
        """Stop a flow; its ``on_done`` never runs."""
        if f not in self.flows:
            return
        self._remove(f)

    def _remove(self, f: Flow) -> None:
        now = self.sim.now
        done = f.done_bytes(now)
        self.flows.discard(f)
        if f.timer is not None:
            f.timer.cancel()
            f.timer = None
        for link in f.path:
            link.flows.discard(f)
            link.bytes += done
        self._solve(f.path)

    def _finish(self, f: Flow) -> None:
        f.timer = None
        if f not in self.flows:
            return
        self._remove(f)
        f.on_done()

    # ---- max-min fair sharing --------------------------------------------------------------

    def _component(self, links: Sequence[Link]) -> tuple[list[Flow], list[Link]]:
        flows: dict[Flow, None] = {}
        seen: dict[Link, None] = dict.fromkeys(links)
        stack = list(links)
        while stack:
            link = stack.pop()
            for f in link.flows:
                if f in flows:
                    continue
                flows[f] = None
                for other in f.path:
                    if other not in seen:
                        seen[other] = None
                        stack.append(other)
        # a deterministic order: sets iterate by hash (flow ids), but be explicit
        return sorted(flows, key=lambda f: f.id), list(seen)

    def _solve(self, links: Sequence[Link]) -> None:
        flows, comp_links = self._component(links)
        if not flows:
            return
        self.solves += 1
        now = self.sim.now
        rate: dict[Flow, float] = {}
        left = {link: link.capacity for link in comp_links}
        active = {link: [f for f in link.flows] for link in comp_links}
        unfixed = set(flows)
        for _ in range(len(flows) + len(comp_links) + 1):
            if not unfixed:
                break
            # the lowest level at which a link fills or a flow reaches its cap
            level = float("inf")
            for link, fs in active.items():
                n = sum(1 for f in fs if f in unfixed)
                if n:
                    level = min(level, left[link] / n)
            for f in unfixed:
                if f.cap is not None:
                    level = min(level, f.cap)
            fixed = [f for f in unfixed if f.cap is not None and f.cap <= level + _EPS]
            for link, fs in active.items():
                n = sum(1 for f in fs if f in unfixed)
                if n and left[link] / n <= level + _EPS:
                    fixed.extend(f for f in fs if f in unfixed)
            for f in fixed:
                if f not in unfixed:
                    continue
                unfixed.discard(f)
                rate[f] = max(level, 0.0)
                for link in f.path:
                    left[link] -= rate[f]
        for f in flows:
            r = rate.get(f, 0.0)
            if abs(r - f.rate) <= _EPS * max(r, 1.0) and f.timer is not None:
                continue
            f.base = f.done_bytes(now)
            f.since = now
            f.rate = r
            if f.timer is not None:
                f.timer.cancel()
                f.timer = None
            if r > 0:
                f.timer = self.sim.after((f.size - f.base) / r, self._finish, f)
            elif f.size - f.base <= 0:
                f.timer = self.sim.after(0.0, self._finish, f)
