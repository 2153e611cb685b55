"""Which transport serves a (reader, holder) edge (DESIGN.md §6).

Theory of operation
-------------------
Every pull runs over one edge: a reader reading a holder's shard. The edge's *kind* comes from
the two locations (:func:`edge_kind`): the same host (``"host"``), the same datacenter on
another host (``"datacenter"``), or another datacenter (``"remote"``). Host names are scoped to
their datacenter, so equal host names in different datacenters make a ``"remote"`` edge.

Each kind has a preference list of transport names (:data:`DEFAULT_PREFERENCE`, or one built
by :func:`parse_preference` from configuration). :func:`choose_transport` takes the first name
on the list that the holder offers (its endpoint), that this process started, and that passes
the optional ``reaches`` check (e.g. ``local`` confirming that the peer really is on this host:
locations are declared, not proven). If no listed name fits, it falls back to the first name in
this process's own order that the holder offers and that reaches, so an edge is served whenever
the two sides share a transport at all. Nothing shared raises :class:`TransportError`.

The answer is a :class:`Choice` that keeps what it was decided from, so ``describe()`` can say
in one log line why the preferred transport was not used. The choice depends only on the
arguments (never on set iteration order or on the holder's order), ``reaches`` is asked at most
once per name and only for names both sides have. This module holds no state and does no IO.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from tensorhub.core.errors import InvalidArgument, TransportError
from tensorhub.core.topology import LINK_CLASSES, Location, link_class

__all__ = ["DEFAULT_PREFERENCE", "EDGE_KINDS", "Choice", "choose_transport", "edge_kind", "parse_preference"]

EDGE_KINDS = LINK_CLASSES
"""Edge kinds, nearest first: the link classes of :mod:`tensorhub.core.topology`."""

DEFAULT_PREFERENCE: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        # "memory" serves only readers in the holder's own process; last, behind the real ones
        "host": ("local", "nixl", "rdma_copy", "tcp", "memory"),
        "datacenter": ("nixl", "rdma_copy", "tcp"),
        "remote": ("tcp",),
    }
)
"""Edge kind -> transport names, most preferred first."""

_LABELS = {"host": "same host", "datacenter": "same datacenter", "remote": "across datacenters"}


def edge_kind(reader: Location, holder: Location) -> str:
    """``"host"``, ``"datacenter"`` or ``"remote"``: how near ``holder`` is to ``reader``."""
    return link_class(reader, holder)


@dataclass(frozen=True, slots=True)
class Choice:
    """The transport for one edge, and what it was chosen from.

    Attributes:
        name: the chosen transport.
        kind: the edge kind (:data:`EDGE_KINDS`).
        preferred: the first name of the preference list for ``kind``.
        fallback: True when ``name`` is not ``preferred``.
        reader, holder: the edge's two ends.
        offered: the transports the holder offers (deduplicated, in its order).
        local: the transports this process started (in its order).
        listed: whether ``name`` is on the preference list for ``kind`` (False: taken from
            ``local`` because no listed transport fits).
        unreached: names both sides have that the ``reaches`` check refused.
    """

    name: str
    kind: str
    preferred: str
    fallback: bool
    reader: Location
    holder: Location
    offered: tuple[str, ...]
    local: tuple[str, ...]
    listed: bool = True
    unreached: tuple[str, ...] = ()

    def describe(self) -> str:
        """One log line: the edge, and why this transport (e.g. why not the preferred one)."""
        edge = f"edge {_where(self.reader)}->{_where(self.holder)} ({_LABELS[self.kind]})"
        if not self.fallback:
            return f"{edge}: using preferred transport {self.name!r}"
        p = self.preferred
        if p not in self.local:
            why = f"is unavailable here (this process has: {', '.join(self.local)})"
        elif p not in self.offered:
            why = f"is not offered by the holder (it offers: {', '.join(self.offered)})"
        else:
            why = "does not reach the holder"
        how = (
            f"using {self.name!r}" if self.listed else f"none of its list fits; falling back to {self.name!r}"
        )
        return f"{edge}: preferred transport {p!r} {why}; {how}"


def _where(loc: Location) -> str:
    return f"{loc.datacenter}/{loc.host}"


def choose_transport(
    reader: Location,
    holder: Location,
    offered: Iterable[str],
    local: Sequence[str],
    preference: Mapping[str, Sequence[str]] | None = None,
    reaches: Callable[[str], bool] | None = None,
) -> Choice:
    """The transport this process (the reader) uses to read from ``holder``.

    Args:
        reader: this process's location.
        holder: the holder's location.
        offered: the transport names in the holder's endpoint.
        local: the transport names this process started, in the user's order.
        preference: edge kind -> names, most preferred first; kinds left out keep
            :data:`DEFAULT_PREFERENCE` (validated as by :func:`parse_preference`).
        reaches: an extra check that a transport can reach the holder; asked at most once per
            name, only for names both sides have.

    Returns:
        The first name on the kind's preference list that both sides have and that reaches;
        else the first such name in ``local`` (``listed=False``).

    Raises:
        InvalidArgument: ``offered`` or ``local`` is not a collection of non-empty names, or
            ``preference`` is malformed.
        TransportError: no transport both sides have reaches the holder; the message names the
            edge kind, what the holder offers and what this process has.
    """
    have = _names(offered, "offered")
    mine = _names(local, "local")
    ranked = DEFAULT_PREFERENCE if preference is None else parse_preference(preference)
    kind = edge_kind(reader, holder)
    listed = tuple(ranked[kind])
    unreached: list[str] = []

    def fits(name: str) -> bool:
        if name not in have or name not in mine:
            return False
        if reaches is not None and not reaches(name):
            unreached.append(name)
            return False
        return True

    found = next((n for n in listed if fits(n)), None)
    in_list = found is not None
    if found is None:
        found = next((n for n in mine if n not in listed and fits(n)), None)
    if found is None:
        refused = f"; of those both have, these do not reach it: {', '.join(unreached)}" if unreached else ""
        raise TransportError(
            f"no transport serves edge kind {kind!r} ({_LABELS[kind]}) from {_where(reader)} to"
            f" {_where(holder)}: the holder offers [{', '.join(have)}], this process has"
            f" [{', '.join(mine)}]{refused}"
        )
    return Choice(
        name=found,
        kind=kind,
        preferred=listed[0],
        fallback=found != listed[0],
        reader=reader,
        holder=holder,
        offered=have,
        local=mine,
        listed=in_list,
        unreached=tuple(unreached),
    )


def _names(names: Iterable[str], what: str) -> tuple[str, ...]:
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise InvalidArgument(f"{what} transports must be a collection of names, got {names!r}")
    names = tuple(names)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise InvalidArgument(f"{what} transports must be non-empty strings, got {bad[0]!r} in {names!r}")
    return tuple(dict.fromkeys(names))


def parse_preference(spec: str | Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """A full preference table from configuration; kinds not given keep the defaults.

    Args:
        spec: a mapping ``{"host": ["local", "tcp"], ...}``, or the same as an environment-style
            string ``"host=local,tcp;datacenter=nixl,tcp;remote=tcp"`` (spaces around items
            and empty ``;`` segments are ignored; ``""`` keeps every default).

    Returns:
        edge kind -> transport names, for every kind in :data:`EDGE_KINDS`.

    Raises:
        InvalidArgument: an unknown or repeated edge kind, a segment without ``=``, an empty
            list, a repeated name, or a name that is not an identifier; the message names the
            bad part.
    """
    items: list[tuple[str, Sequence[str]]]
    if isinstance(spec, str):
        items = []
        for segment in spec.split(";"):
            if not segment.strip():
                continue
            kind, eq, listed = segment.partition("=")
            if not eq:
                raise InvalidArgument(
                    f"transport preference segment {segment.strip()!r} is not 'kind=name,name'"
                )
            items.append((kind.strip(), [n.strip() for n in listed.split(",")] if listed.strip() else []))
    elif isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        raise InvalidArgument(
            f"a transport preference is a mapping or a 'kind=name,...;...' string, got {spec!r}"
        )
    table = {kind: list(names) for kind, names in DEFAULT_PREFERENCE.items()}
    seen = set()
    for kind, names in items:
        if kind not in EDGE_KINDS:
            raise InvalidArgument(
                f"unknown edge kind {kind!r} in transport preference (known: {', '.join(EDGE_KINDS)})"
            )
        if kind in seen:
            raise InvalidArgument(f"edge kind {kind!r} given twice in transport preference")
        seen.add(kind)
        if isinstance(names, (str, bytes)) or not isinstance(names, Sequence) or not names:
            raise InvalidArgument(
                f"transport preference for {kind!r} must be a non-empty list of names, got {names!r}"
            )
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise InvalidArgument(
                    f"transport preference for {kind!r} has {name!r}, which is not a transport name"
                )
        if len(set(names)) != len(names):
            raise InvalidArgument(
                f"transport preference for {kind!r} names a transport twice: {list(names)!r}"
            )
        table[kind] = list(names)
    return table
