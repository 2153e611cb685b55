"""Type-check the installed package ``tensorhub``, and the examples that use it, with mypy
(``bash scripts/dev typecheck``).

setup.cfg's ``package_dir`` installs the top-level folders transports/, scheduling/ and sim/ as
tensorhub.transports, tensorhub.scheduling and tensorhub.sim, which mypy cannot see through the
editable install's import hook. So this script lays out the package as it is installed, as a
tree of symbolic links in .mypy_cache/tree (rebuilt on every run, so that new modules are
seen), runs mypy there on that package and on examples/ with the configuration of
pyproject.toml, and prints mypy's report with the repository's own paths. Extra arguments go to
mypy; the exit status is mypy's.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "tensorhub"


def mapped_folders() -> dict[str, str]:
    """Subpackage path inside the package -> repository folder, from setup.cfg's package_dir."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    found: dict[str, str] = {}
    for line in cfg.get("options", "package_dir", fallback="").splitlines():
        name, eq, folder = line.partition("=")
        name, folder = name.strip(), folder.strip()
        if eq and name.startswith(PACKAGE + "."):
            found[name[len(PACKAGE) + 1 :].replace(".", "/")] = folder
    return found


def link_tree(tree: Path, mapped: dict[str, str]) -> None:
    """``tree/tensorhub``: links to every entry of tensorhub/ and to each mapped folder."""
    if tree.exists():
        shutil.rmtree(tree)
    pkg = tree / PACKAGE
    pkg.mkdir(parents=True)
    for entry in (ROOT / PACKAGE).iterdir():
        if entry.name != "__pycache__" and entry.name not in mapped:
            (pkg / entry.name).symlink_to(entry)
    for sub, folder in mapped.items():
        (pkg / sub).symlink_to(ROOT / folder, target_is_directory=True)


def main(argv: list[str]) -> int:
    mapped = mapped_folders()
    cache = ROOT / ".mypy_cache"
    tree = cache / "tree"
    link_tree(tree, mapped)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "--cache-dir", str(cache), PACKAGE, str(ROOT / "examples"), *argv]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=False)
    # tensorhub/transports/tcp.py -> transports/tcp.py, /.../examples/x.py -> examples/x.py
    back = [(re.compile(rf"^{PACKAGE}/{re.escape(sub)}/", re.MULTILINE), folder.rstrip("/") + "/")
            for sub, folder in mapped.items()]  # fmt: skip
    back.append((re.compile(rf"^{re.escape(str(ROOT))}/", re.MULTILINE), ""))
    for stream, text in ((sys.stdout, proc.stdout), (sys.stderr, proc.stderr)):
        for pattern, folder in back:
            text = pattern.sub(folder, text)
        stream.write(text)
    return proc.returncode


if __name__ == "__main__":
    os.environ.setdefault("MYPY_FORCE_COLOR", "0")
    sys.exit(main(sys.argv[1:]))
