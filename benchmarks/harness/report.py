"""Where a benchmark's figures go: a JSON file of every figure (:func:`write_json`), the
matplotlib module for plots where it is installed (:func:`pyplot`), and the commit measured
(:func:`git_head`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["git_head", "pyplot", "write_json"]

ROOT = Path(__file__).resolve().parents[2]


def write_json(path: str | Path, data: Any, indent: int = 2, default: Any = None) -> Path:
    """``data`` as JSON in ``path`` (its folder made first); ``default`` as for ``json.dumps``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=default))
    return path


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files (the Agg backend). Raises ImportError where
    matplotlib is not installed (it comes with the ``bench`` extra): a report then says so and
    goes without plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def git_head() -> str | None:
    """The short commit of this checkout, or None outside git (bounded: 10 s)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, check=False)  # fmt: skip
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
