"""Test configuration: one seed for every randomized test, and the hypothesis profiles.

``TENSORHUB_SEED`` (default 20261121) seeds hypothesis and the ``seed`` fixture; it is printed
in the header and on every failure. ``TENSORHUB_HYPOTHESIS_PROFILE`` picks ``ci`` (default)
or ``long`` (the state machine runs at least 10,000 steps).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

SEED = int(os.environ.get("TENSORHUB_SEED", "20261121"))

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=True)
settings.register_profile("ci", max_examples=150, stateful_step_count=50, **_COMMON)
settings.register_profile("long", max_examples=250, stateful_step_count=60, **_COMMON)
settings.load_profile(os.environ.get("TENSORHUB_HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "hypothesis_seed", None) is None:
        config.option.hypothesis_seed = SEED


def pytest_report_header(config: pytest.Config) -> str:
    return f"tensorhub: TENSORHUB_SEED={SEED} hypothesis profile={os.environ.get('TENSORHUB_HYPOTHESIS_PROFILE', 'ci')}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("tensorhub seed", f"TENSORHUB_SEED={SEED} (rerun with this environment variable)"))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    import sys

    module = sys.modules.get("tests.test_table_state_machine")
    if module is not None and module.STEPS[0]:
        terminalreporter.write_line(f"tensorhub: reference-table state machine ran {module.STEPS[0]} steps")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """On pytest-xdist's controller, before its workers start: rewrite the test modules' asserts
    into pytest's bytecode cache in a thread, so that the workers, which all import the same
    modules at once, find them rewritten. Each worker rewrote each module itself: about 11 of the
    20 CPU seconds a worker spent collecting, times three (issue 33). Only an optimization: it
    uses pytest's internals, and any failure just leaves the work to the workers."""
    config = session.config
    if hasattr(config, "workerinput") or not config.pluginmanager.has_plugin("dsession"):
        return
    import sys
    import threading

    if sys.dont_write_bytecode:
        return
    threading.Thread(target=_warm_rewrites, args=(config,), daemon=True, name="warm-rewrites").start()


def _warm_rewrites(config: pytest.Config) -> None:
    from pathlib import Path

    try:
        from _pytest.assertion import rewrite

        state = config.stash[rewrite.assertstate_key]
        for fn in sorted(Path(__file__).parent.glob("test_*.py")):
            cache = rewrite.get_cache_dir(fn)
            pyc = cache / (fn.name[:-3] + rewrite.PYC_TAIL)
            if rewrite.try_makedirs(cache) and rewrite._read_pyc(fn, pyc) is None:
                source_hash, co = rewrite._rewrite_test(fn, config)
                rewrite._write_pyc(state, co, source_hash, pyc)
    except Exception:  # noqa: BLE001 - an optimization: the workers rewrite what is missing
        return


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest first: tests marked ``slow``, then the other ``integration`` tests, then the
    rest (each group in collection order). On several workers (pytest-xdist) the long ones start
    at once, spread over the workers, and the many short ones fill in around them, instead of
    a long test starting last and running alone."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("integration") else 2)


@pytest.fixture
def seed() -> int:
    """The run's seed: derive every random source of a test from it."""
    return SEED


@pytest.fixture
def handles():
    """``make(replica, **open_kw)``: a shard handle in a worker process, closed after the test."""
    from .procs import RemoteHandle

    made: list[RemoteHandle] = []

    def make(replica: str, **kw) -> RemoteHandle:
        h = RemoteHandle(model=kw.pop("model", "actor"), replica=replica, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.exit()


@pytest.fixture
def inproc_server():
    """A real server actor in this process, whose table the test can look into."""
    from .procs import InprocServer

    s = InprocServer()
    yield s
    s.close()
