"""Deltas between versions, as the core decides about them: per-tensor encoding and pull plans.

Theory of operation
-------------------
Between two consecutive RL steps almost every bf16 weight is bit-identical (an Adam step at RL
learning rates is below bf16's spacing), so a reader that holds version ``b`` can reach ``v`` by
applying a **delta** ``b -> v`` instead of pulling the whole shard. A delta carries, per tensor
that changed, either

- ``sparse``: the flat element indices that changed (int32, ascending) and their new values, or
- ``dense``: the tensor's new values whole,

whichever is fewer bytes (:func:`encoding_for`): sparse costs ``4 + itemsize`` bytes per changed
element, dense ``itemsize`` per element, so a tensor is sparse while fewer than
``itemsize / (4 + itemsize)`` of its elements changed: a third for bf16, half for float32, a fifth
for FP8. A tensor of more than 2**31 - 1 elements cannot be indexed by int32 and is always dense.
Values are the new values, never differences, so applying is a copy and the result is
bit-exact (no floating-point arithmetic anywhere).

:func:`plan_pull` decides, for one shard of a reader, between a **delta chain** and a **full
pull**. It is pure: the reader's held version, the version wanted, the deltas that live holders
hold (:class:`DeltaStep`: base, version, bytes) and the shard's full size go in; a
:class:`PullPlan` comes out. The rule, in order:

1. holding the wanted version: nothing to pull;
2. holding nothing, or a version newer than the one wanted (deltas only go forward): full;
3. more than ``max_behind`` versions behind: full (deltas that old are not kept, and replaying
   many costs more than it saves);
4. otherwise the cheapest chain ``held -> ... -> wanted`` of at most ``max_steps`` held deltas
   (a delta may span several versions), if it is strictly fewer bytes than the full shard;
   else full.

Ties between chains go to fewer steps, then to the chain whose versions sort first, so the same
inputs give the same plan in any order. Where the deltas live, how they are granted and
pipelined, and applying them are not decided here (the table and the engine do that); nothing
here imports torch (:mod:`tensorhub.runtime.deltas` computes and applies deltas on tensors).
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import InvalidArgument
from .wire import struct

__all__ = [
    "AHEAD",
    "CHAIN",
    "CHAIN_NOT_SMALLER",
    "DEFAULT_MAX_BEHIND",
    "DEFAULT_MAX_STEPS",
    "DELTAS",
    "DENSE",
    "FULL",
    "HOLDS_IT",
    "HOLDS_NOTHING",
    "INDEX_BYTES",
    "MAX_SPARSE_NUMEL",
    "NONE",
    "NO_CHAIN",
    "SPARSE",
    "TOO_FAR_BEHIND",
    "DeltaStep",
    "PullPlan",
    "encoding_for",
    "entry_bytes",
    "plan_pull",
]

#: Per-tensor encodings of a delta.
SPARSE = "sparse"
DENSE = "dense"
#: Bytes of one sparse index (int32, as in TRL's delta files).
INDEX_BYTES = 4
#: The most elements a tensor may have and still be sparse (int32 indices).
MAX_SPARSE_NUMEL = (1 << 31) - 1

#: Plan kinds.
NONE = "none"
FULL = "full"
DELTAS = "deltas"
#: Plan reasons (``PullPlan.reason``).
HOLDS_IT = "holds the wanted version"
HOLDS_NOTHING = "holds no version"
AHEAD = "holds a newer version (deltas only go forward)"
TOO_FAR_BEHIND = "too far behind"
NO_CHAIN = "no chain of held deltas"
CHAIN_NOT_SMALLER = "the delta chain is not smaller than the shard"
CHAIN = "the delta chain is smaller than the shard"

#: A reader more versions behind than this pulls full.
DEFAULT_MAX_BEHIND = 32
#: The most deltas one plan applies.
DEFAULT_MAX_STEPS = 16


def entry_bytes(encoding: str, changed: int, numel: int, itemsize: int) -> int:
    """Bytes of one tensor's delta entry: ``changed`` indices and values (sparse), or the
    tensor's ``numel`` values (dense)."""
    if encoding == SPARSE:
        return changed * (INDEX_BYTES + itemsize)
    if encoding == DENSE:
        return numel * itemsize
    raise InvalidArgument(f"unknown delta encoding {encoding!r} (known: {SPARSE}, {DENSE})")


def encoding_for(changed: int, numel: int, itemsize: int) -> str:
    """The encoding of a tensor of ``numel`` elements of ``itemsize`` bytes of which ``changed``
    changed: :data:`SPARSE` while that is strictly fewer bytes than :data:`DENSE` (and int32 can
    index the tensor), else :data:`DENSE`.

    Raises:
        InvalidArgument: counts out of range.
    """
    if not 0 <= changed <= numel or itemsize <= 0:
        raise InvalidArgument(f"bad delta counts: {changed} changed of {numel} elements of {itemsize} bytes")
    if numel > MAX_SPARSE_NUMEL:
        return DENSE
    return (
        SPARSE
        if entry_bytes(SPARSE, changed, numel, itemsize) < entry_bytes(DENSE, changed, numel, itemsize)
        else DENSE
    )


@struct
class DeltaStep:
    """One delta of a shard that some live holder holds: ``base -> version``, ``nbytes`` to pull.

    A delta may span several versions (``version - base > 1``: a squashed chain)."""

    base: int
    version: int
    nbytes: int

    def __post_init__(self) -> None:
        if type(self.base) is not int or type(self.version) is not int or type(self.nbytes) is not int:
            raise InvalidArgument(f"a delta step has integer fields, got {self!r}")
        if self.base < 0 or self.version <= self.base or self.nbytes < 0:
            raise InvalidArgument(f"a delta goes from a version >= 0 to a later one, in bytes >= 0; got {self!r}")


@struct
class PullPlan:
    """How one shard of a reader gets the version it wants.

    Attributes:
        kind: :data:`NONE` (it holds it), :data:`FULL` (pull the shard) or :data:`DELTAS`
            (pull and apply ``steps`` in order).
        version: the version wanted.
        steps: the delta chain (``DELTAS`` only): each step's base is the previous one's version,
            the first's is the held version and the last's version is ``version``.
        nbytes: the bytes the plan pulls.
        reason: why (one of this module's reason constants).
    """

    kind: str
    version: int
    steps: tuple[DeltaStep, ...]
    nbytes: int
    reason: str


def _cheapest_chain(
    held: int, wanted: int, deltas: Iterable[DeltaStep], max_steps: int
) -> tuple[DeltaStep, ...] | None:
    # Cheapest path in a DAG (every edge goes to a later version), kept per step count so a
    # cheaper path with more steps never hides one that fits max_steps. Keys order the ties.
    edges: dict[tuple[int, int], int] = {}
    for d in deltas:
        if held <= d.base and d.version <= wanted:
            key = (d.base, d.version)
            edges[key] = min(d.nbytes, edges.get(key, d.nbytes))
    out: dict[int, list[tuple[int, int]]] = {}
    for (base, version), nbytes in sorted(edges.items()):
        out.setdefault(base, []).append((version, nbytes))
    # best[v][k] = (bytes, versions) of the best path held -> v of k steps
    best: dict[int, dict[int, tuple[int, tuple[int, ...]]]] = {held: {0: (0, ())}}
    for node in sorted({held, *(v for v, _ in edges)}):
        paths = best.get(node)
        if not paths:
            continue
        for version, nbytes in out.get(node, ()):
            into = best.setdefault(version, {})
            for k, (total, path) in paths.items():
                if k >= max_steps:
                    continue
                cand = (total + nbytes, path + (version,))
                cur = into.get(k + 1)
                if cur is None or cand < cur:
                    into[k + 1] = cand
    reached = best.get(wanted, {})
    if wanted == held or not reached:
        return None
    _, k, path = min((total, k, path) for k, (total, path) in reached.items())
    steps = []
    prev = held
    for version in path:
        steps.append(DeltaStep(prev, version, edges[(prev, version)]))
        prev = version
    assert len(steps) == k
    return tuple(steps)


def plan_pull(
    held: int | None,
    wanted: int,
    deltas: Iterable[DeltaStep],
    full_bytes: int,
    *,
    max_behind: int = DEFAULT_MAX_BEHIND,
    max_steps: int = DEFAULT_MAX_STEPS,
) -> PullPlan:
    """Decide how one shard of a reader that holds ``held`` gets ``wanted``: a chain of held
    deltas or a full pull (see the module docstring for the rule).

    Args:
        held: the version the reader's shard holds completely, or None.
        wanted: the version it wants.
        deltas: the deltas of this shard that live holders hold (duplicates allowed: the
            smallest size of a (base, version) pair counts).
        full_bytes: the shard's size (a full pull).
        max_behind: a reader more versions behind than this pulls full.
        max_steps: the most deltas a chain may have (0: never deltas).

    Returns:
        The plan; the same inputs give the same plan.

    Raises:
        InvalidArgument: a negative version, size or limit.
    """
    if type(wanted) is not int or wanted < 0 or (held is not None and (type(held) is not int or held < 0)):
        raise InvalidArgument(f"versions are integers >= 0, got held={held!r} wanted={wanted!r}")
    if full_bytes < 0 or max_behind < 0 or max_steps < 0:
        raise InvalidArgument(
            f"sizes and limits are >= 0, got full_bytes={full_bytes} max_behind={max_behind} max_steps={max_steps}"
        )
    if held == wanted:
        return PullPlan(NONE, wanted, (), 0, HOLDS_IT)
    if held is None:
        return PullPlan(FULL, wanted, (), full_bytes, HOLDS_NOTHING)
    if held > wanted:
        return PullPlan(FULL, wanted, (), full_bytes, AHEAD)
    if wanted - held > max_behind:
        return PullPlan(FULL, wanted, (), full_bytes, TOO_FAR_BEHIND)
    chain = _cheapest_chain(held, wanted, deltas, max_steps)
    if chain is None:
        return PullPlan(FULL, wanted, (), full_bytes, NO_CHAIN)
    nbytes = sum(s.nbytes for s in chain)
    if nbytes >= full_bytes:
        return PullPlan(FULL, wanted, (), full_bytes, CHAIN_NOT_SMALLER)
    return PullPlan(DELTAS, wanted, chain, nbytes, CHAIN)
