"""Stragglers: a source that is alive but slow, told apart from a busy one by progress.

Theory of operation
-------------------
What it owns: each active grant's recent progress (the reader's ``Progress`` reports, with the
time they arrived), the rates of recently completed grants per (model, link class), and the
decision, at every :meth:`~tensorhub.core.table.ReferenceTable.tick`, to move a reader off a
source that is too slow.

How slow is told from busy. A grant is judged only after ``straggler_window`` seconds, on the
bytes its reader verified over the last window (a grant without any progress report yet only
after three windows: a busy source takes longer to a reader's first report). A source serving several readers splits its
link between them, so each of its grants is slow while the source is not: what is judged is the
source's **aggregate** rate (the sum over its judged grants), against the **reference** rate of
the same model and link class (the best of the recently completed grants' rates and of the
other sources' aggregates). Below ``straggler_ratio`` of it the source is slow; a grant with no
progress at all over the window is stalled whatever the reference. A reader that has caught up
with a partial source (it has verified what the source has) is held back by the source's own
upstream, not by the source: it is judged as its source's own pull is (a slow relay's
downstream readers move too, to a faster source, so a slow reader holds back its downstream
readers for at most about a window).

A slow or stalled grant whose reader has another eligible source is revoked (the reader keeps
what it verified, as with any revoke) and the reader is granted elsewhere, with the slow source
excluded for it like a source that failed it; with no alternative it stays.

Invariants: only active grants are judged; a reader is moved at most once per window (its new
grant is judged after a window of its own); nothing here changes a holder's state but through
the grant paths of :mod:`.grants` (revoke, regrant).

What it must never do: judge a grant on the wall clock, or move a reader to nowhere.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Sequence

from .. import messages as m
from ..topology import link_class
from .records import P, _Grant, _Holder

_SAMPLES = 32  # progress reports kept per grant
_RECENT = 16  # completed-grant rates kept per (model, link class)
#: Windows a grant may go without its first progress report before it counts as stalled (a
#: first report comes after about an eighth of the shard, which a source whose link is shared by
#: several readers takes several times longer to move: busy, not slow).
_FIRST_REPORT = 3


class StragglerMixin:
    """Straggler detection. Mixed into :class:`~tensorhub.core.table.ReferenceTable` ahead of
    the grant and view mixins (it wraps their ``_on_progress`` and ``_record``); the table's
    ``__init__`` sets ``pace`` and ``pace_recent``."""

    def _on_progress(self, peer: Hashable, msg: m.Progress) -> None:
        super()._on_progress(peer, msg)  # type: ignore[misc]
        g = self.grants.get(msg.grant)
        if g is not None:
            samples = self.pace.get(g.id)
            if samples is None:
                samples = self.pace[g.id] = deque(maxlen=_SAMPLES)
            samples.append((self.clock(), g.reader.verified))

    def _record(self, g: _Grant, how: str, reached: int | None) -> None:
        super()._record(g, how, reached)  # type: ignore[misc]
        self.pace.pop(g.id, None)
        if how != "completed":
            return
        layout = g.reader.session.layout
        took = self.clock() - g.created
        moved = (layout.total_bytes if layout is not None else 0) - g.start
        if took > 0 and moved > 0:
            key = (g.reader.session.model.name, link_class(g.reader.session.location, g.source.session.location))
            recent = self.pace_recent.get(key)
            if recent is None:
                recent = self.pace_recent[key] = deque(maxlen=_RECENT)
            recent.append(moved / took)

    def _rate(self, g: _Grant, now: float, window: float) -> float:
        """Bytes per second the reader verified under ``g`` over (at least) the last window;
        0 when it is stalled.

        A reader reports its progress in steps (about an eighth of the shard), so between two
        reports its rate read on the clock falls to nothing and jumps back: the rate is read
        over whole report intervals, up to the last report, and the grant is stalled only once
        the silence since its last report exceeds both the window and twice the longest
        interval between its earlier reports (a late report, not a slow one)."""
        samples = self.pace.get(g.id)
        if not samples:
            return max(0, g.reader.verified - g.start) / max(now - g.created, 1e-9)
        gap, prev = 0.0, g.created
        for t, _ in samples:
            gap, prev = max(gap, t - prev), t
        t_last, v_last = samples[-1]
        if now - t_last > max(window, 2 * gap):
            return 0.0
        t0, v0 = g.created, g.start
        for t, v in samples:
            if t > t_last - window:
                break
            t0, v0 = t, v
        return max(0, v_last - v0) / max(t_last - t0, 1e-9)

    def _check_stragglers(self, now: float) -> None:
        cfg = self.config
        if not cfg.straggler_ratio or not self.grants:
            return
        window = cfg.straggler_window
        judged: dict[int, tuple[float, bool]] = {}  # grant id -> (rate, caught up with its source)
        aggregate: dict[int, float] = {}  # source holder id -> the sum of its judged grants' rates
        for gid, g in self.grants.items():
            if now - g.created < window:
                continue
            src, r = g.source, g.reader
            layout = r.session.layout
            slack = (layout.total_bytes // 8) if layout is not None else 0  # a reader reports every ~1/8
            caught_up = src.state is P and r.verified + slack >= src.verified
            if not caught_up and g.id not in self.pace and now - g.created < _FIRST_REPORT * window:
                continue  # no report yet: a source sharing its link may take longer to a first eighth
            rate = self._rate(g, now, window)
            judged[gid] = (rate, caught_up)
            if not caught_up:
                aggregate[src.id] = aggregate.get(src.id, 0.0) + rate
        if not judged:
            return
        slow: dict[int, str] = {}
        for gid, (rate, caught_up) in judged.items():
            if caught_up:
                continue
            g = self.grants[gid]
            if rate <= 0:
                slow[gid] = f"stalled: no progress in {window:g} s or more"
                continue
            key = (g.reader.session.model.name, link_class(g.reader.session.location, g.source.session.location))
            ref = max(self.pace_recent.get(key, ()), default=0.0)
            for other in self.grants.values():  # the other sources serving this model over this link class
                s = other.source
                if s is not g.source and s.id in aggregate and other.reader.session.model is g.reader.session.model and (
                    link_class(other.reader.session.location, s.session.location) == key[1]
                ):
                    ref = max(ref, aggregate[s.id])
            agg = aggregate.get(g.source.id, 0.0)
            if ref > 0 and agg < cfg.straggler_ratio * ref:
                slow[gid] = f"slow source: {agg / 1e6:.1f} MB/s against {ref / 1e6:.1f} MB/s"
        pullers = {self.grants[gid].reader.id: why for gid, why in slow.items()}  # holders whose own pull is slow
        behind: list[tuple[int, int]] = []  # (depth, grant id) of caught-up readers held back
        for gid, (_, caught_up) in judged.items():
            if caught_up and self._held_back(self.grants[gid], slow, pullers, judged) is not None:
                behind.append((self._depth(self.grants[gid]), gid))
        for gid in list(slow):
            g = self.grants.get(gid)
            if g is not None:
                self._move_reader(g, slow[gid])
        # Upstream first, judged again as the grants now stand: a reader whose source was only
        # held back and has just moved to a faster source follows it and stays; one still held
        # back (or behind a slow puller, moved or not) avoids the whole slow chain.
        for _, gid in sorted(behind):
            g = self.grants.get(gid)
            held = self._held_back(g, slow, pullers, judged) if g is not None else None
            if g is not None and held is not None:
                self._move_reader(g, f"its source's own pull is {held[1]}", avoid=held[0])

    def _held_back(self, g: _Grant, slow: dict[int, str], pullers: dict[int, str],
                   judged: dict[int, tuple[float, bool]]) -> tuple[list[_Holder], str] | None:  # fmt: skip
        """Whether the caught-up reader of ``g`` is held back by a slow pull up its chain, as the
        grants stand now: the partial holders between it and that pull (its source first, the
        slow puller last) and why that pull is slow; None if it is not. A pull is slow if its
        grant was judged slow (``slow``), or if it is a new grant of a holder whose pull was
        (``pullers``): moving a holder whose own link is slow does not make it fast."""
        chain = [g.source]
        up = g.source.upstream
        for _ in range(64):
            if up is None:
                return None
            if up.id in slow:
                return chain, slow[up.id]
            if up.id not in judged:  # a new grant: of a slow puller, or of a reader that was only held back
                return (chain, pullers[up.reader.id]) if up.reader.id in pullers else None
            if not judged[up.id][1]:
                return None
            chain.append(up.source)
            up = up.source.upstream
        return None

    @staticmethod
    def _depth(g: _Grant) -> int:
        """How many pulls are above ``g`` (0: its source pulls from nobody)."""
        n, up = 0, g.source.upstream
        while up is not None and n < 64:
            n, up = n + 1, up.source.upstream
        return n

    def _move_reader(self, g: _Grant, why: str, avoid: Sequence[_Holder] = ()) -> None:
        """Re-grant ``g``'s reader elsewhere, if it has another eligible source (not ``g``'s
        source, nor a holder in ``avoid``: they stay excluded for it once it moved)."""
        reader, source = g.reader, g.source
        if reader.call is None:
            return
        added = []
        for h in (source, *avoid):
            if h.id not in reader.excluded:
                reader.excluded[h.id] = False
                added.append(h.id)
        alt = self._select(reader, None, retry_failed=False)
        if alt is None or alt is source:
            for hid in added:
                del reader.excluded[hid]
            return
        self.stats["stragglers"] += 1
        self._revoke(g, f"straggler: {why}")
        self._regrant(reader)
