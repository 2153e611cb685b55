"""The tree shows the architecture, and these tests keep it that way.

Layers, bottom to top; a module may import its own layer and the layers below it, never above:

    core        tensorhub.core (and its public alias tensorhub.errors): sans-IO
    scheduling  tensorhub.scheduling (the repository's scheduling/): sans-IO policies
    transports  tensorhub.transports (transports/): the plugin base class, the shard buffers it
                reads and writes, the registry, and the built-in plugins
    runtime     tensorhub.runtime: the actors and everything else that does IO
    handles     tensorhub (the package), tensorhub.aio, tensorhub.handles
    tools       tensorhub.tools, tensorhub.testing, tensorhub.sim, tensorhub.__main__
    integrations tensorhub.integrations (Ray, vLLM), tensorhub.ray: frameworks a job runs in

Every import counts, also those inside functions and under ``TYPE_CHECKING``: a lazy import is
still an arrow. Plugins depend on the base class, never the other way: nothing outside a plugin
module imports it, except through the registry's ``"module:Class"`` names.

No module is longer than ``MAX_LINES`` lines unless its docstring says why, on a line that starts
with ``Size:`` (what keeps it whole, or where it would split).
"""

from __future__ import annotations

import ast
import functools
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: package name -> folder, as setup.cfg's package_dir maps them
FOLDERS = {
    "tensorhub": ROOT / "tensorhub",
    "tensorhub.transports": ROOT / "transports",
    "tensorhub.scheduling": ROOT / "scheduling",
    "tensorhub.sim": ROOT / "sim",
}
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("tensorhub.core", "tensorhub.errors")),
    ("scheduling", ("tensorhub.scheduling",)),
    ("transports", ("tensorhub.transports",)),
    ("runtime", ("tensorhub.runtime", "tensorhub.reshard")),
    ("handles", ("tensorhub.handles", "tensorhub.aio", "tensorhub")),
    ("tools", ("tensorhub.tools", "tensorhub.testing", "tensorhub.sim", "tensorhub.__main__")),
    ("integrations", ("tensorhub.integrations", "tensorhub.ray")),
]
#: the transport package's own framework: what plugins build on
PLUGIN_FRAMEWORK = {"base", "buffers", "registry", "sidechannel", "nic", "faults"}
#: what a sans-IO module must not import (top-level module names)
IO_MODULES = {
    "asyncio", "concurrent", "multiprocessing", "selectors", "select", "signal", "socket",
    "socketserver", "ssl", "subprocess", "threading", "uvloop", "zmq", "http", "urllib", "torch",
}  # fmt: skip
SANS_IO = ("tensorhub.core", "tensorhub.errors", "tensorhub.scheduling")
#: a module longer than this says why in its docstring, on a line starting with SIZE_MARK
MAX_LINES = 800
SIZE_MARK = "Size:"


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    found: dict[str, Path] = {}
    for pkg, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            # a folder mapped elsewhere is its own package, not part of this one
            name = ".".join([pkg, *parts])
            if any(name.startswith(other + ".") or name == other for other in FOLDERS if other != pkg and other.startswith(pkg + ".")):
                continue
            found[name] = path
    return found


MODULES = modules()


def _resolve(module: str, is_pkg: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def imports_of(name: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in ``name``'s source, relative ones resolved."""
    path = MODULES[name]
    tree = _parsed(path)
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(name, is_pkg, node.level, node.module) if node.level else node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                out.append((sub if sub in MODULES else mod, node.lineno))
    return out


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for all the checks of this file."""
    return ast.parse(path.read_text(), str(path))


def where(name: str, line: int) -> str:
    path = MODULES[name]
    return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"


def layer_of(module: str) -> int | None:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def internal_edges() -> dict[str, dict[str, int]]:
    edges: dict[str, dict[str, int]] = {}
    for name in MODULES:
        for target, line in imports_of(name):
            if target in MODULES and target != name:
                edges.setdefault(name, {}).setdefault(target, line)
    return edges


def test_every_module_has_a_layer():
    assert [name for name in MODULES if layer_of(name) is None] == []
    assert "tensorhub.core.table" in MODULES and "tensorhub.transports.base" in MODULES


def test_arrows_point_down_the_layers():
    wrong = []
    for src, targets in internal_edges().items():
        for dst, line in targets.items():
            if layer_of(dst) > layer_of(src):
                wrong.append(
                    f"{where(src, line)}: {src} ({LAYERS[layer_of(src)][0]}) imports "
                    f"{dst} ({LAYERS[layer_of(dst)][0]})"
                )
    assert wrong == [], "imports that point up the layers:\n" + "\n".join(wrong)


def test_plugins_depend_on_the_framework_never_the_other_way():
    wrong = []
    for src, targets in internal_edges().items():
        for dst, line in targets.items():
            leaf = dst.rpartition(".")[2]
            if not dst.startswith("tensorhub.transports.") or leaf in PLUGIN_FRAMEWORK:
                continue
            # dst is a plugin: only another plugin may build on it (rdma_copy uses nixl's agent)
            src_leaf = src.rpartition(".")[2]
            if not src.startswith("tensorhub.transports.") or src_leaf in PLUGIN_FRAMEWORK:
                wrong.append(f"{where(src, line)}: {src} imports the plugin {dst}")
    assert wrong == [], "\n".join(wrong)


def test_no_import_cycles():
    edges = internal_edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components (recursion depth: the module count)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    shown = [
        " <-> ".join(c) + "\n    " + "\n    ".join(f"{a} -> {b} (line {edges[a][b]})" for a in c for b in edges.get(a, {}) if b in c)
        for c in cycles
    ]
    assert cycles == [], "import cycles:\n" + "\n".join(shown)


def test_the_sans_io_layers_import_no_io():
    wrong = []
    for name in MODULES:
        if not name.startswith(SANS_IO):
            continue
        for target, line in imports_of(name):
            if target.split(".")[0] in IO_MODULES:
                wrong.append(f"{where(name, line)}: {name} imports {target}")
    assert wrong == [], "IO in the sans-IO core:\n" + "\n".join(wrong)


BARE_IMPORT_LINE = re.compile(r"^[ \t]*(?:from[ \t]+|import[ \t]+(?:[\w.]+[ \t]*,[ \t]*)*)(?:transports|scheduling|sim)\b", re.M)


def test_nothing_imports_the_bare_folder_names():
    """``transports``, ``scheduling`` and ``sim`` are folders of the repository, not installed names."""
    wrong = []
    # top-level folders first: globbing "*/**/*.py" from the root walked .venv's 30,000 files too
    folders = [d for d in sorted(ROOT.iterdir()) if d.is_dir() and not d.name.startswith(".") and d.name not in ("build", "dist")]
    for path in (p for d in folders for p in sorted(d.rglob("*.py"))):
        # an import names its module on the line of its keyword: a file with no such line is not parsed
        if not BARE_IMPORT_LINE.search(path.read_text()):
            continue
        for node in ast.walk(_parsed(path)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in ("transports", "scheduling", "sim")]
    assert wrong == [], "\n".join(wrong)


def test_the_bare_name_filter_keeps_every_form_of_such_an_import():
    """The text filter in front of the parse lets through every way to import a bare folder name."""
    for line in ("import sim", "  from transports.tcp import TcpTransport", "import os, scheduling.dag", "\tfrom sim import x"):
        assert BARE_IMPORT_LINE.search(f"x = 1\n{line}\n"), line
    for line in ("from tensorhub.sim import x", "import simulator", "from . import sim", "sim = 1"):
        assert not BARE_IMPORT_LINE.search(line), line


def test_the_checker_sees_a_planted_violation(tmp_path):
    """The checks above can fail: an upward import and a cycle planted in parsed source are found."""
    MODULES["tensorhub.core._planted"] = tmp_path / "planted.py"
    MODULES["tensorhub.core._planted2"] = tmp_path / "planted2.py"
    (tmp_path / "planted.py").write_text("from tensorhub.runtime import server\nfrom . import _planted2\n")
    (tmp_path / "planted2.py").write_text("def f():\n    from tensorhub.core import _planted\n    import threading\n")
    try:
        with pytest.raises(AssertionError, match="imports tensorhub.runtime.server"):
            test_arrows_point_down_the_layers()
        with pytest.raises(AssertionError, match="_planted <-> tensorhub.core._planted2"):
            test_no_import_cycles()
        with pytest.raises(AssertionError, match="_planted2 imports threading"):
            test_the_sans_io_layers_import_no_io()
    finally:
        del MODULES["tensorhub.core._planted"], MODULES["tensorhub.core._planted2"]


def size_reason(path: Path) -> str:
    """What the line of ``path``'s module docstring that starts with ``Size:`` says ("": none)."""
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""  # not cached: a test rewrites its file
    return next((ln.strip()[len(SIZE_MARK) :].strip() for ln in doc.splitlines() if ln.strip().startswith(SIZE_MARK)), "")


def oversized(names: list[str]) -> list[str]:
    """Each of the modules ``names`` that is over ``MAX_LINES`` lines with no reason given."""
    wrong = []
    for name in names:
        path = MODULES[name]
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and len(size_reason(path)) < 20:  # a reason is a sentence, not a word
            wrong.append(f"{where(name, 1)}: {name} has {lines} lines (over {MAX_LINES}) and no '{SIZE_MARK}' line in its docstring saying why")
    return wrong


def test_no_module_is_over_the_size_limit_without_a_reason():
    wrong = oversized(sorted(MODULES))
    assert wrong == [], "modules over the size limit:\n" + "\n".join(wrong)


def test_the_size_check_sees_a_long_module_without_a_reason(tmp_path):
    planted = tmp_path / "planted.py"
    MODULES["tensorhub.core._planted"] = planted
    body = "x = 1\n" * MAX_LINES
    try:
        planted.write_text('"""A planted module."""\n' + body)
        with pytest.raises(AssertionError, match=r"tensorhub.core._planted has 801 lines"):
            test_no_module_is_over_the_size_limit_without_a_reason()
        planted.write_text('"""A planted module.\n\nSize: ok.\n"""\n' + body)  # too short to be a reason
        assert [w.split(": ", 1)[1] for w in oversized(["tensorhub.core._planted"])] == [
            f"tensorhub.core._planted has 804 lines (over {MAX_LINES}) and no 'Size:' line in its docstring saying why"
        ]
        planted.write_text('"""A planted module.\n\nSize: one table of constants, read top to bottom.\n"""\n' + body)
        assert oversized(["tensorhub.core._planted"]) == []
        planted.write_text('"""A planted module."""\n' + "x = 1\n" * (MAX_LINES - 1))  # at the limit: no reason needed
        assert oversized(["tensorhub.core._planted"]) == []
    finally:
        del MODULES["tensorhub.core._planted"]


@pytest.mark.slow
def test_the_wheel_installs_only_tensorhub(tmp_path):
    """A wheel built from the tree holds one top-level name, every source module, the ``py.typed``
    marker (PEP 561) and the LICENSE (in its .dist-info)."""
    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ and *.egg-info behind
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for folder in FOLDERS.values():
        shutil.copytree(folder, src / folder.name, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(src)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("tensorhub-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = sorted({n.split("/")[0] for n in names})
    assert [t for t in top if not t.endswith(".dist-info")] == ["tensorhub"], top
    expected = {name.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py") for name, path in MODULES.items()}
    assert sorted(expected - set(names)) == []
    assert "tensorhub/py.typed" in names
    # .dist-info/LICENSE, or .dist-info/licenses/LICENSE (setuptools >= 77, PEP 639)
    licenses = [n for n in names if n.split("/")[0].endswith(".dist-info") and n.rsplit("/", 1)[-1] == "LICENSE"]
    assert licenses, sorted(n for n in names if ".dist-info/" in n)
    assert "Apache License" in zipfile.ZipFile(wheel).read(licenses[0]).decode()
