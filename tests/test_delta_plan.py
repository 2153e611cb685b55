"""Properties of the delta pull planner (``tensorhub.core.deltas.plan_pull``) and the per-tensor
encoding rule, over random holdings, wanted versions, held deltas (spanning one or several
versions, duplicated with different sizes), shard sizes and limits:

- nothing to pull exactly when the reader holds the wanted version;
- a reader holding nothing, a newer version, or more than ``max_behind`` behind pulls full;
- otherwise the plan is a delta chain exactly when some chain of held deltas of at most
  ``max_steps`` steps goes from the held version to the wanted one in strictly fewer bytes than
  the shard, and then it is a cheapest one (checked against every chain, enumerated);
- a chain links held -> wanted through held deltas at their smallest size, its bytes add up;
- the plan does not depend on the order of the deltas; holding one more delta never makes a
  plan pull more bytes; a larger shard never turns a chain into a full pull.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorhub.core import deltas as d
from tensorhub.core.deltas import DeltaStep, encoding_for, entry_bytes, plan_pull
from tensorhub.core.errors import InvalidArgument

pytestmark = pytest.mark.property

V = 10  # versions 0..V


@st.composite
def cases(draw):
    held = None if draw(st.integers(0, 9)) == 0 else draw(st.integers(0, V))
    wanted = max(
        0, min(V, (held or 0) + draw(st.integers(-2, 6) | st.integers(1, 6)))
    )  # mostly ahead of the held version
    steps = []
    for _ in range(draw(st.integers(0, 20))):
        base = draw(st.integers(0, V - 1))
        version = draw(st.integers(base + 1, min(V, base + 4)))
        steps.append(DeltaStep(base, version, draw(st.integers(0, 60))))
    if held is not None and draw(st.booleans()):  # a backbone of one-version deltas, so that chains exist
        steps += [DeltaStep(v, v + 1, draw(st.integers(0, 60))) for v in range(held, wanted)]
    full = draw(st.integers(0, 300))
    max_behind = draw(st.just(V) | st.integers(0, V))
    return held, wanted, steps, full, max_behind, draw(st.integers(0, 5))


def chains(held: int, wanted: int, steps: list[DeltaStep], max_steps: int) -> list[tuple[int, tuple[DeltaStep, ...]]]:
    """Every chain held -> wanted of at most max_steps steps, with its bytes (by enumeration)."""
    size: dict[tuple[int, int], int] = {}
    for s in steps:
        size[(s.base, s.version)] = min(s.nbytes, size.get((s.base, s.version), s.nbytes))
    out = []

    def walk(at: int, path: tuple[DeltaStep, ...]) -> None:
        if at == wanted and path:
            out.append((sum(s.nbytes for s in path), path))
            return
        if len(path) == max_steps:
            return
        for (b, v), n in size.items():
            if b == at and v <= wanted:
                walk(v, path + (DeltaStep(b, v, n),))

    if held < wanted:
        walk(held, ())
    return out


@given(cases())
def test_the_plan_follows_the_rule(case):
    held, wanted, steps, full, max_behind, max_steps = case
    plan = plan_pull(held, wanted, steps, full, max_behind=max_behind, max_steps=max_steps)
    assert plan.version == wanted
    if held == wanted:
        assert (plan.kind, plan.nbytes, plan.steps, plan.reason) == (d.NONE, 0, (), d.HOLDS_IT)
        return
    assert plan.kind in (d.FULL, d.DELTAS)
    if held is None or held > wanted or wanted - held > max_behind:
        assert plan.kind == d.FULL and plan.nbytes == full and plan.steps == ()
        want = d.HOLDS_NOTHING if held is None else d.AHEAD if held > wanted else d.TOO_FAR_BEHIND
        assert plan.reason == want
        return
    found = chains(held, wanted, steps, max_steps)
    best = min((n for n, _ in found), default=None)
    if best is None:
        assert (plan.kind, plan.reason, plan.nbytes) == (d.FULL, d.NO_CHAIN, full)
    elif best >= full:
        assert (plan.kind, plan.reason, plan.nbytes) == (d.FULL, d.CHAIN_NOT_SMALLER, full)
    else:
        assert (plan.kind, plan.reason) == (d.DELTAS, d.CHAIN)
        assert plan.nbytes == best == sum(s.nbytes for s in plan.steps) < full
        assert plan.steps in [p for _, p in found]  # links held -> wanted through held deltas, smallest sizes
        assert 1 <= len(plan.steps) <= max_steps
        assert plan.steps[0].base == held and plan.steps[-1].version == wanted
        assert all(a.version == b.base for a, b in zip(plan.steps, plan.steps[1:]))


@given(cases(), st.randoms(use_true_random=False))
def test_the_plan_does_not_depend_on_the_order_of_the_deltas(case, rnd):
    held, wanted, steps, full, max_behind, max_steps = case
    shuffled = list(steps)
    rnd.shuffle(shuffled)
    kw = {"max_behind": max_behind, "max_steps": max_steps}
    assert plan_pull(held, wanted, steps, full, **kw) == plan_pull(held, wanted, shuffled, full, **kw)


@given(cases(), st.integers(0, V - 1), st.integers(1, 4), st.integers(0, 60), st.integers(0, 100))
def test_more_deltas_never_cost_more_and_a_larger_shard_keeps_a_chain(case, base, span, nbytes, more):
    held, wanted, steps, full, max_behind, max_steps = case
    kw = {"max_behind": max_behind, "max_steps": max_steps}
    plan = plan_pull(held, wanted, steps, full, **kw)
    extra = DeltaStep(base, min(V, base + span), nbytes)
    assert plan_pull(held, wanted, [*steps, extra], full, **kw).nbytes <= plan.nbytes
    if plan.kind == d.DELTAS:
        assert plan_pull(held, wanted, steps, full + more, **kw) == plan


def test_a_chain_is_taken_over_one_bigger_delta_and_ties_go_to_fewer_steps():
    steps = [DeltaStep(1, 2, 10), DeltaStep(2, 4, 10), DeltaStep(1, 4, 25), DeltaStep(2, 3, 5), DeltaStep(3, 4, 5)]
    plan = plan_pull(1, 4, steps, 100)
    assert plan.kind == d.DELTAS and plan.nbytes == 20
    assert [(s.base, s.version) for s in plan.steps] == [(1, 2), (2, 4)]  # 20 in 2 steps beats 20 in 3
    assert plan_pull(1, 4, steps, 100, max_steps=1).steps == (DeltaStep(1, 4, 25),)
    assert plan_pull(1, 4, steps, 20).kind == d.FULL  # not strictly fewer bytes
    assert plan_pull(1, 4, steps, 100, max_behind=2).reason == d.TOO_FAR_BEHIND
    assert plan_pull(1, 4, steps, 100, max_steps=0).reason == d.NO_CHAIN


def test_bad_input_is_refused():
    with pytest.raises(InvalidArgument):
        DeltaStep(3, 3, 1)
    with pytest.raises(InvalidArgument):
        DeltaStep(-1, 3, 1)
    with pytest.raises(InvalidArgument):
        DeltaStep(1, 3, -5)
    with pytest.raises(InvalidArgument):
        plan_pull(-1, 3, [], 10)
    with pytest.raises(InvalidArgument):
        plan_pull(1, 3, [], -10)
    with pytest.raises(InvalidArgument):
        encoding_for(5, 4, 2)


@given(st.integers(0, 10_000), st.integers(0, 10_000), st.sampled_from([1, 2, 4, 8, 16]))
def test_the_encoding_is_the_one_of_fewer_bytes(a, b, itemsize):
    changed, numel = min(a, b), max(a, b)
    enc = encoding_for(changed, numel, itemsize)
    sparse, dense = entry_bytes(d.SPARSE, changed, numel, itemsize), entry_bytes(d.DENSE, changed, numel, itemsize)
    assert enc == (d.SPARSE if sparse < dense else d.DENSE)


def test_the_threshold_is_a_third_for_bf16_and_huge_tensors_are_dense():
    assert encoding_for(333, 1000, 2) == d.SPARSE and encoding_for(334, 1000, 2) == d.DENSE
    assert encoding_for(499, 1000, 4) == d.SPARSE and encoding_for(500, 1000, 4) == d.DENSE
    assert encoding_for(1, d.MAX_SPARSE_NUMEL + 1, 2) == d.DENSE


def test_a_random_walk_of_versions_keeps_plans_consistent(seed):
    """A reader that follows plans version after version always lands on the version it wanted."""
    rnd = random.Random(seed)
    steps = [DeltaStep(v, v + 1, rnd.randrange(1, 20)) for v in range(30)]
    held: int | None = None
    for _ in range(50):
        wanted = rnd.randrange(0, 31)
        plan = plan_pull(held, wanted, steps, 100, max_behind=8, max_steps=8)
        at = held
        for s in plan.steps:
            assert s.base == at
            at = s.version
        held = wanted if plan.kind != d.DELTAS else at
        assert held == wanted
