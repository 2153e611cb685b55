"""Stragglers: a source that is alive but slow, told apart from a busy one by progress.

Theory of operation
-------------------
What it owns: each active grant's recent progress (the reader's ``Progress`` reports, with the
time they arrived), the rates of recently completed grants per (model, link class), and the
decision, at every :meth:`~tensorhub.core.table.ReferenceTable.tick`, to move a reader off a
source that is too slow.

How slow is told from busy. A reader reports its verified prefix at least every half second
while it grows (:data:`tensorhub.core.shard.PROGRESS_INTERVAL`, and every eighth of the shard),
from half a second after its first verified bytes (a younger grant is never judged: a pull done
within it reports nothing); the prefix grows in whole reads. A grant is judged only after ``straggler_window`` seconds, on
the bytes its reader verified over the last window, read over whole report intervals. A grant
without any progress report yet is judged only after three windows (a source sharing its link
with several readers takes that many times longer to a reader's first verified read), or ten
for a reader just moved off a straggler (its reads in flight from the slow source land first,
at that source's pace, and its rate counts from its first report). A source serving several
readers splits its link between them, so each of its grants is slow while the source is not:
what is judged is the source's **aggregate** rate (the sum over its judged grants), against the
**reference** rate of the same model and link class (the best of the recently completed grants'
rates and of the other sources' aggregates). Below ``straggler_ratio`` of it the source is
slow. A grant with no progress at all is stalled whatever the reference: its silence since its
last report exceeds both the window and twice its longest interval between reports (a busy
machine reports late, not never). A reader that has caught up with a partial source (it has
verified what the source has) is held back by the source's own upstream, not by the source: it
is judged as its source's own pull is.

Where a reader moves. A slow or stalled grant whose reader has another eligible source is
revoked (the reader keeps what it verified, as with any revoke) and the reader is granted
elsewhere, with the slow source excluded for it like a source that failed it; with no
alternative it stays. The readers held back by a slow pull move in the same tick, upstream
first: the first reader below the slow pull goes straight to a fast source, and the readers
pipelined behind it follow it (they stay; one still held back avoids the whole slow chain). A
reader whose own pull is slow is a *slow puller* (moving it may not make it fast: its own link
may be what is slow), unless the holder it pulls from has a slow pull too (then that holder's
link explains both, and the readers behind it follow it wherever it moves). A moved reader is
never granted a slow puller, a holder below the slow pull (a sibling held back by the same
pull), nor a partial holder that has not verified more than it has (it would be held back by
that holder's pull at once: a relay whose own link is slow is not helped by pulling from its
own downstream readers); these are barred for that move only.

Invariants: only active grants are judged; a reader is moved at most once per window (its new
grant is judged after a window of its own); nothing here changes a holder's state but through
the grant paths of :mod:`.grants` (revoke, regrant).

What it must never do: judge a grant on the wall clock, or move a reader to nowhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Hashable, Sequence

from .. import messages as m
from ..topology import link_class
from .records import _FIRST_REPORT, P, _Grant, _Holder, _Pace
from .state import TableState

_RECENT = 16  # completed-grant rates kept per (model, link class)


class StragglerMixin(TableState):
    """Straggler detection. Mixed into :class:`~tensorhub.core.table.ReferenceTable` ahead of the grant
    and view mixins (it wraps their ``_on_progress`` and ``_record``). State
    (:class:`~tensorhub.core.table.state.TableState`): ``clock``, ``config``, ``grants``, ``stats``,
    ``pace``, ``pace_recent``."""

    def _on_progress(self, peer: Hashable, msg: m.Progress) -> None:
        super()._on_progress(peer, msg)
        g = self.grants.get(msg.grant)
        if g is not None:
            pace = self.pace.get(g.id)
            if pace is None:
                pace = self.pace[g.id] = _Pace()
            pace.samples.append((self.clock(), g.reader.verified))

    def _record(self, g: _Grant, how: str, reached: int | None) -> str:
        link = super()._record(g, how, reached)
        pace = self.pace.pop(g.id, None) if self.pace else None
        if how != "completed":
            return link
        now = self.clock()
        took = now - g.created
        moved = g.reader.session.total_bytes - g.start
        if pace is not None and pace.drains and pace.samples:  # from its first report (see _Pace)
            took, moved = now - pace.samples[0][0], moved - (pace.samples[0][1] - g.start)
        if took > 0 and moved > 0:
            key = (g.reader.session.model.name, link)
            recent = self.pace_recent.get(key)
            if recent is None:
                recent = self.pace_recent[key] = deque(maxlen=_RECENT)
            recent.append(moved / took)
        return link

    def _rate(self, g: _Grant, now: float, window: float) -> float:
        """Bytes per second the reader verified under ``g`` over (at least) the last window;
        0 when it is stalled.

        A reader's verified prefix grows in whole reads and is reported at intervals, so
        between two reports its rate read on the clock falls to nothing and jumps back: the
        rate is read over whole report intervals, up to the last report, and the grant is
        stalled only once the silence since its last report exceeds both the window and twice
        the longest interval between its earlier reports (a late report, not a slow one). The
        grant of a reader moved off a straggler counts from its first report (see
        :class:`_Pace`)."""
        pace = self.pace.get(g.id)
        if pace is None or not pace.samples:
            return max(0, g.reader.verified - g.start) / max(now - g.created, 1e-9)
        samples = pace.samples
        origin = samples[0] if pace.drains else (g.created, g.start)
        gap, prev = 0.0, origin[0]
        for t, _ in samples:
            gap, prev = max(gap, t - prev), t
        t_last, v_last = samples[-1]
        if now - t_last > max(window, 2 * gap):
            return 0.0
        t0, v0 = origin
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
            slack = (layout.total_bytes // 8) if layout is not None else 0  # at most a report step behind
            caught_up = src.state is P and r.verified + slack >= src.verified
            pace = self.pace.get(gid)
            if not caught_up and (pace is None or not pace.samples):
                first = pace.first if pace is not None else _FIRST_REPORT
                if now - g.created < first * window:
                    continue  # no report yet: a source sharing its link takes longer to a first read
            elif not caught_up and pace is not None and pace.drains and now - pace.samples[0][0] < window:
                continue  # moved off a straggler: judged a window after its first report
            rate = self._rate(g, now, window)
            judged[gid] = (rate, caught_up)
            if not caught_up:
                aggregate[src.id] = aggregate.get(src.id, 0.0) + rate
        if not judged:
            return
        slow: dict[int, str] = {}
        # The two fastest judged sources per (model, link class), so that each grant's reference
        # (the fastest *other* source of its kind) costs a lookup, not a scan of every grant.
        best: dict[tuple[str, str], list[tuple[float, int]]] = {}
        for other in self.grants.values():
            src = other.source
            if src.id not in aggregate:
                continue
            k = (other.reader.session.model.name, link_class(other.reader.session.location, src.session.location))
            top = best.setdefault(k, [])
            entry = (aggregate[src.id], src.id)
            if entry not in top:
                top.append(entry)
                top.sort(reverse=True)
                del top[2:]
        for gid, (rate, caught_up) in judged.items():
            if caught_up:
                continue
            g = self.grants[gid]
            if rate <= 0:
                slow[gid] = f"stalled: no progress in {window:g} s or more"
                continue
            key = (g.reader.session.model.name, link_class(g.reader.session.location, g.source.session.location))
            ref = max(self.pace_recent.get(key, ()), default=0.0)
            for agg_other, sid in best.get(key, ()):  # the other sources serving this model over this link class
                if sid != g.source.id:
                    ref = max(ref, agg_other)
                    break
            agg = aggregate.get(g.source.id, 0.0)
            if ref > 0 and agg < cfg.straggler_ratio * ref:
                slow[gid] = f"slow source: {agg / 1e6:.1f} MB/s against {ref / 1e6:.1f} MB/s"
        # Holders whose own pull is slow, as far as the table can tell: a reader pulling from a
        # holder whose own pull is slow too is explained by it (the holder's link, both ways),
        # and is fast again once it moves.
        pullers: dict[int, str] = {}
        for gid, why in slow.items():
            up = self.grants[gid].source.upstream
            if up is None or up.id not in slow:
                pullers[self.grants[gid].reader.id] = why
        behind: list[tuple[int, int]] = []  # (depth, grant id) of caught-up readers held back
        for gid, (_, caught_up) in judged.items():
            if caught_up and self._held_back(self.grants[gid], slow, pullers, judged) is not None:
                behind.append((self._depth(self.grants[gid]), gid))
        for _, gid in sorted((self._depth(self.grants[gid]), gid) for gid in slow):  # upstream first
            still = self.grants.get(gid)
            if still is not None:
                self._move_reader(still, slow[gid], barred=pullers)
        # Upstream first, judged again as the grants now stand: a reader whose source was only
        # held back and has just moved to a faster source follows it and stays; one still held
        # back (or behind a slow puller, moved or not) avoids the whole slow chain.
        for _, gid in sorted(behind):
            still = self.grants.get(gid)
            held = self._held_back(still, slow, pullers, judged) if still is not None else None
            if still is not None and held is not None:
                self._move_reader(still, f"its source's own pull is {held[1]}", avoid=held[0], barred=pullers)

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

    def _move_reader(self, g: _Grant, why: str, avoid: Sequence[_Holder] = (), barred: Collection[int] = ()) -> None:
        """Re-grant ``g``'s reader elsewhere, if it has another eligible source: not ``g``'s
        source, nor a holder in ``avoid`` (``g``'s source first, the slow puller last); they
        stay excluded for it once it moved. Barred for this move only: the holders in
        ``barred`` (ids: the slow pullers of this tick), the holders below the slow pull
        (``avoid``'s last, else ``g``'s source) and the partial holders that have not verified
        more than the reader (see the module docstring)."""
        reader, source = g.reader, g.source
        if reader.call is None:
            return
        below = self._downstream(avoid[-1] if avoid else source)
        holders = self._holder_set(reader.session.model, reader.version, reader.shard_idx)
        bar = [h for h in holders.values() if h.state is P and (
            h.id in below or h.id in barred or h.verified <= reader.verified)]  # fmt: skip
        kept: list[int] = []  # stay excluded once it moved
        added: list[int] = []  # barred for this move only
        for i, h in enumerate((source, *avoid, *bar)):
            if h.id not in reader.excluded:
                reader.excluded[h.id] = False
                (kept if i <= len(avoid) else added).append(h.id)
        alt = self._select(reader, None, retry_failed=False)
        if alt is None or alt is source:
            for hid in (*kept, *added):
                del reader.excluded[hid]
            return
        self.stats["stragglers"] += 1
        self._revoke(g, f"straggler: {why}")
        self._regrant(reader)
        for hid in added:
            del reader.excluded[hid]
        if reader.upstream is not None:  # its reads in flight from the slow source land first
            self.pace[reader.upstream.id] = _Pace(drains=True)
