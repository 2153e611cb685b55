"""The benchmarks' shape and their shared harness (``benchmarks/harness``): no benchmark module
imports another in a cycle, none imports a sibling by bare name, every script uses the harness
and states its workload, baseline and goal at the top of its docstring; and the harness's
figures (medians, ratios, verdicts, timings, workloads) on small inputs, with its refusals."""

from __future__ import annotations

import ast
import functools
import json
import math
import re
from pathlib import Path

import pytest

from benchmarks.harness import BenchmarkError, median, meets, ratio, timings, verdict, write_json

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

# Modules with a ``__main__`` block that are not benchmarks, and why.
NOT_BENCHMARKS = {
    "cluster_jobs": "its __main__ is the worker the cluster benchmarks start in each namespace",
}
STATED = ("Workload:", "Baseline:", "Goal:")
TOP_LINES = 12  # "near its top": the three lines start within the docstring's first lines


@functools.cache
def _modules() -> dict[str, Path]:
    """``benchmarks.X`` (and ``benchmarks.harness.Y``) -> file, ``__main__`` aside."""
    out = {}
    for path in sorted(BENCH.rglob("*.py")):
        parts = path.relative_to(BENCH.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _in_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _imports(path: Path, known: set[str]) -> tuple[set[str], list[str]]:
    """The benchmark modules ``path`` imports at run time (module level or inside functions),
    and the bare-name imports of a sibling (``import server_process``) it makes."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    siblings = {name.rsplit(".", 1)[-1] for name in known}
    found: set[str] = set()
    bare: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or _in_type_checking(node, parents):
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level or node.module is None:
                continue
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            names = [a.name for a in node.names]
        for name in names:
            if name in known:
                found.add(name)
            elif "." not in name and name in siblings and name != "benchmarks":
                bare.append(name)
    return found, bare


@functools.cache
def _scan() -> dict[str, tuple[set[str], list[str]]]:
    """Each benchmark module's imports of benchmark modules, and its bare-name imports (read once)."""
    mods = _modules()
    return {name: _imports(path, set(mods)) for name, path in mods.items()}


def _graph() -> dict[str, set[str]]:
    return {name: found - {name} for name, (found, _) in _scan().items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def _scripts() -> dict[str, Path]:
    """Every benchmark script: a module of ``benchmarks/`` run as a program (``__main__`` block),
    and the suite (run as ``python -m benchmarks``)."""
    out = {}
    for path in sorted(BENCH.glob("*.py")):
        text = path.read_text()
        if path.stem in NOT_BENCHMARKS or path.stem.startswith("__"):
            continue
        if 'if __name__ == "__main__":' in text or path.stem == "suite":
            out[path.stem] = path
    return out


# ---- the shape of benchmarks/ ------------------------------------------------------------------


def test_the_graph_is_read_and_a_cycle_is_found() -> None:
    graph = _graph()
    assert "benchmarks.harness.processes" in graph["benchmarks.harness.measure"]
    assert "benchmarks.suite_report" in graph["benchmarks.suite"]  # imported where it is needed too
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_benchmark_module_imports_another_in_a_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "benchmark modules import each other in a cycle: " + " -> ".join(cycle or [])


def test_no_benchmark_module_imports_a_sibling_by_bare_name() -> None:
    bare = {name: found for name, (_, found) in _scan().items() if found}
    assert not bare, f"import these as benchmarks.NAME (a bare name loads a second copy of the module): {bare}"


def test_the_harness_imports_no_benchmark_script() -> None:
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("benchmarks.harness"):
            assert all(d.startswith("benchmarks.harness") for d in deps), (name, deps)


def test_every_script_uses_the_harness() -> None:
    graph = _graph()
    scripts = _scripts()
    assert {"suite", "bench_table", "bench_local_path", "bench_transfer"} <= set(scripts)
    without = [s for s in scripts if not any(d.startswith("benchmarks.harness") for d in graph[f"benchmarks.{s}"])]
    assert not without, f"scripts that do not import benchmarks.harness: {without}"


def test_every_script_states_its_workload_baseline_and_goal() -> None:
    missing = {}
    for name, path in _scripts().items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        top = doc.splitlines()[:TOP_LINES]
        lacks = [k for k in STATED if not any(line.startswith(k) and len(line) > len(k) + 3 for line in top)]
        if lacks:
            missing[name] = lacks
    assert not missing, f"scripts whose docstring does not open with {' / '.join(STATED)}: {missing}"


# ---- the harness -------------------------------------------------------------------------------


def test_median_drops_missing_figures_and_averages_an_even_count() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median([None, 5.0, None]) == 5.0
    assert math.isnan(median([])) and math.isnan(median([None]))


def test_ratio_and_verdict_never_pass_a_figure_that_was_not_measured() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(None, 1.0)) and math.isnan(ratio(1.0, None))
    assert meets(0.8, 0.7) and not meets(0.6, 0.7)
    assert meets(0.4, 0.5, higher_is_better=False) and not meets(0.6, 0.5, higher_is_better=False)
    assert not meets(math.nan, 0.7) and not meets(math.nan, 0.5, higher_is_better=False)
    assert verdict(True) == "PASS" and verdict(False) == "MISS"


def test_timings_counts_calls_and_refuses_bad_counts() -> None:
    calls: list[str] = []
    out = timings(lambda: calls.append("call"), repeats=3, warmup=2, sync=lambda: calls.append("sync"))
    assert len(out) == 3 and all(t >= 0 for t in out)
    assert calls.count("call") == 5 and calls.count("sync") == 10
    with pytest.raises(BenchmarkError, match="repeats"):
        timings(lambda: None, repeats=0)
    with pytest.raises(BenchmarkError, match="warmup"):
        timings(lambda: None, repeats=1, warmup=-1)


def test_workload_specs_and_their_refusal() -> None:
    from benchmarks.harness.shards import WORKLOADS, spec_bytes, workload_spec

    total = 4 << 20
    uniform = workload_spec("64x16MiB", total, seed=0)
    assert len(uniform) == 64 and spec_bytes(uniform) == total
    model = workload_spec("model-500", total, seed=3)
    assert len(model) == 500 and model == workload_spec("model-500", total, seed=3)
    assert set(WORKLOADS) == {"64x16MiB", "model-500"}
    with pytest.raises(BenchmarkError, match="unknown workload 'nope'"):
        workload_spec("nope", total, seed=0)


def test_write_json_makes_its_folder(tmp_path: Path) -> None:
    path = write_json(tmp_path / "a" / "b.json", {"x": [1, 2]})
    assert json.loads(path.read_text()) == {"x": [1, 2]}
    assert re.search(r"\n  ", path.read_text())  # indented: a person reads these files


def test_the_suites_local_shm_row_is_local_with_its_tensors_in_shared_memory() -> None:
    from benchmarks.suite_systems import _tensorhub_transports, systems

    assert _tensorhub_transports("local-shm") == {"local": {"host": "127.0.0.1"}}
    assert _tensorhub_transports("local") == {"local": {"host": "127.0.0.1"}}
    row = next(s for s in systems(["local-shm", "local"]) if s.name == "tensorhub[local-shm]")
    assert row.extra["transport"] == "local-shm" and "shared memory" in row.describe
