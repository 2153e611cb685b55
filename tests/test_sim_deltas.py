"""The simulator's cross-datacenter scenario with deltas (issue 21): the bytes that cross are
the encoding rule's, a reader holding the previous version is never slower with deltas, a reader
holding nothing pulls in full, and a seed gives one trace. Run on the paper's 9B row (the 1T
row is the command line's default and takes ~30 s)."""

from __future__ import annotations

import pytest

from tensorhub.core.deltas import DELTAS, FULL, MAX_SPARSE_NUMEL, encoding_for, entry_bytes
from tensorhub.core.errors import InvalidArgument
from tensorhub.sim import scenarios
from tensorhub.sim.cli import main as sim_main
from tensorhub.sim.cluster import GB
from tensorhub.sim.deltas import MEASURED_UNCHANGED, DeltaInputs, apply_seconds, crossdc_deltas, shard_delta
from tensorhub.sim.scenarios import MODELS

NINE_B = DeltaInputs(model="9B", versions=3, join_at=2)


@pytest.fixture(scope="module")
def run9b() -> scenarios.Result:
    return crossdc_deltas(0, inputs=NINE_B)


def _by_version(r: scenarios.Result, mode: str) -> dict[int, dict]:
    return {x["version"]: x for x in r.data["versions"][mode]}


def _rule_bytes(full_bytes: int, unchanged: float, itemsize: int, numel: int) -> int:
    """The encoding rule, tensor by tensor, written out here independently of the simulator."""
    total = full_bytes // itemsize
    sizes = [numel] * (total // numel) + ([total % numel] if total % numel else [])
    out = 0
    for n in sizes:
        changed = round(n * (1 - unchanged))
        out += entry_bytes(encoding_for(changed, n, itemsize), changed, n, itemsize)
    return out


def test_bytes_across_with_deltas_are_the_encoding_rules(run9b: scenarios.Result) -> None:
    spec = MODELS["9B"]
    full_bytes = int(spec.shard_gb * GB)
    per_shard = _rule_bytes(full_bytes, MEASURED_UNCHANGED, 2, NINE_B.tensor_numel)
    # 98.35 % unchanged bf16: every tensor sparse, 6 bytes per changed element
    assert per_shard == pytest.approx(full_bytes * (1 - MEASURED_UNCHANGED) * 3, rel=1e-6)
    assert shard_delta(full_bytes, NINE_B).nbytes == per_shard
    full, deltas = _by_version(run9b, "full"), _by_version(run9b, "deltas")
    for v in (2, 3):
        assert deltas[v]["remote_bytes"] == spec.shards * per_shard  # one copy of each shard's delta
        assert deltas[v]["wire_bytes"] == pytest.approx(spec.shards * per_shard)  # what the VPC NICs carried
        assert full[v]["remote_bytes"] == spec.shards * full_bytes
    assert full[1]["remote_bytes"] == deltas[1]["remote_bytes"] == spec.shards * full_bytes  # nothing held yet
    assert run9b.data["after_first"]["bytes_ratio"] == pytest.approx(1 / (3 * (1 - MEASURED_UNCHANGED)), rel=1e-6)
    assert run9b.violations == []


def test_a_reader_holding_the_previous_version_is_never_slower_with_deltas(seed: int) -> None:
    for unchanged in (MEASURED_UNCHANGED, 0.9):
        r = crossdc_deltas(seed, inputs=DeltaInputs(model="9B", versions=3, unchanged=unchanged))
        full, deltas = _by_version(r, "full"), _by_version(r, "deltas")
        compared = 0
        for v in (2, 3):
            for name, kind in deltas[v]["plan"].items():
                if kind == DELTAS:
                    assert deltas[v]["stall"][name] <= full[v]["stall"][name], (seed, unchanged, v, name)
                    compared += 1
            assert deltas[v]["seeder_s"] < full[v]["seeder_s"]  # the seeder moves a delta across
        assert compared >= 6
        assert r.violations == []


def test_a_reader_holding_nothing_pulls_in_full_inside_its_datacenter(run9b: scenarios.Result) -> None:
    deltas = _by_version(run9b, "deltas")
    late = deltas[2]["joiner"]
    assert late is not None and deltas[2]["plan"][late] == FULL
    assert sorted(k for n, k in deltas[2]["plan"].items() if n != late) == [DELTAS] * 3
    # it did not cross: only the deltas did
    assert deltas[2]["remote_bytes"] == MODELS["9B"].shards * run9b.data["delta_bytes"]
    assert deltas[2]["seeder"] != late
    # a full in-datacenter pull (10 GB at ~22 GB/s), not a seed across the slow link (~2.8 s)
    assert 0.4 < deltas[2]["stall"][late] < 1.0
    assert deltas[3]["plan"][late] == DELTAS  # holding v2, it takes the next delta


def test_no_deltas_when_they_are_not_smaller() -> None:
    full_bytes = int(MODELS["9B"].shard_gb * GB)
    # half the bf16 elements changed: dense per tensor, as large as the shard
    assert shard_delta(full_bytes, DeltaInputs(unchanged=0.5)).nbytes == full_bytes
    # a tensor int32 cannot index is dense however little changed
    numel = MAX_SPARSE_NUMEL + 1
    big = shard_delta(2 * numel * 2, DeltaInputs(tensor_numel=numel))
    assert (big.tensors, big.sparse_tensors, big.nbytes) == (2, 0, 2 * numel * 2)
    r = crossdc_deltas(1, inputs=DeltaInputs(model="9B", versions=2, ratio=1.0, join_at=None))
    deltas, full = _by_version(r, "deltas"), _by_version(r, "full")
    assert set(deltas[2]["plan"].values()) == {FULL}
    assert deltas[2]["remote_bytes"] == full[2]["remote_bytes"]


def test_delta_size_and_apply_cost_follow_the_stated_inputs() -> None:
    full_bytes = 66 * 10**9
    ratio = shard_delta(full_bytes, DeltaInputs(ratio=0.05))
    assert ratio.nbytes == round(full_bytes * 0.05) and ratio.changed == ratio.nbytes // 6
    fp8 = shard_delta(full_bytes, DeltaInputs(dtype="float8_e4m3fn"))
    assert fp8.nbytes == _rule_bytes(full_bytes, MEASURED_UNCHANGED, 1, DeltaInputs().tensor_numel)
    size = shard_delta(full_bytes, DeltaInputs())
    inputs = DeltaInputs(apply_gbps=1000.0)
    expected = (size.nbytes + size.changed * 2 * inputs.sector_bytes) / (1000.0 * GB)
    assert apply_seconds(size, inputs) == pytest.approx(expected)
    with pytest.raises(InvalidArgument, match="dtype"):
        DeltaInputs(dtype="bf16")
    with pytest.raises(InvalidArgument, match="unchanged"):
        DeltaInputs(unchanged=1.5)


def test_same_seed_same_trace() -> None:
    a = crossdc_deltas(3, inputs=DeltaInputs(model="9B", versions=2))
    b = crossdc_deltas(3, inputs=DeltaInputs(model="9B", versions=2))
    assert a.digest == b.digest and a.rows == b.rows and a.data == b.data
    c = crossdc_deltas(4, inputs=DeltaInputs(model="9B", versions=2))
    assert c.digest != a.digest


def test_cli_prints_both_and_leaves_crossdc_as_it_was(capsys) -> None:
    assert sim_main(["crossdc", "--seed", "2"]) == 0
    plain = capsys.readouterr().out
    assert sim_main(["crossdc", "--seed", "2", "--deltas", "--model", "9B", "--versions", "2"]) == 0
    both = capsys.readouterr().out
    first = both.split("== crossdc-deltas")[0]

    def strip(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if "s wall" not in ln]

    assert strip(first) == strip(plain)  # the Fig. 12 table, its headlines and its trace hash unchanged
    assert f"trace {scenarios.crossdc(2).digest[:16]}" in plain
    assert "GB across deltas" in both and "20.2x smaller" in both
    with pytest.raises(SystemExit) as exc:
        sim_main(["bursts", "--deltas"])
    assert exc.value.code == 2
    assert "--deltas goes with the crossdc scenario" in capsys.readouterr().err
    assert sim_main(["crossdc", "--deltas", "--dtype", "bf16"]) == 2
