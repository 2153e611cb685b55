"""The typed entry points: ``tensorhub.open`` and ``tensorhub.aio.open`` take exactly the
handle's arguments, with its defaults, and ``import tensorhub`` stays light."""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Any

import tensorhub
import tensorhub.aio
from tensorhub.handles.api import AsyncShardHandle


def _arguments(fn: Any) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def test_open_takes_the_handles_arguments_with_its_defaults() -> None:
    handle = _arguments(AsyncShardHandle.__init__)
    assert _arguments(tensorhub.open) == handle
    assert _arguments(tensorhub.aio.open) == handle
    for fn in (tensorhub.open, tensorhub.aio.open):
        kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
        assert kinds[2:] == [inspect.Parameter.KEYWORD_ONLY] * (len(kinds) - 2), fn


def test_the_return_types_name_the_handles() -> None:
    assert inspect.signature(tensorhub.open).return_annotation == "ShardHandle"
    assert inspect.signature(tensorhub.aio.open).return_annotation == "AsyncOpen"


def test_import_tensorhub_imports_neither_torch_nor_the_handles() -> None:
    code = "import sys, tensorhub; print(sorted(m for m in ('torch', 'tensorhub.handles.api') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
