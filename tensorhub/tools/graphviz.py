"""Drawing a replication DAG with graphviz's ``dot`` program (``tensorhub dag --png``)."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from tensorhub.core.errors import InvalidArgument
from tensorhub.scheduling.dag import to_dot

__all__ = ["render"]


def render(dag: dict[str, Any], path: str, timeout: float = 30.0) -> None:
    """Draw the DAG as a PNG at ``path`` with graphviz's ``dot`` program.

    Raises:
        InvalidArgument: ``dot`` is not installed (write :func:`~tensorhub.scheduling.dag.to_dot`
            to a file instead).
    """
    exe = shutil.which("dot")
    if exe is None:
        raise InvalidArgument("graphviz's 'dot' program is not installed; write to_dot(dag) to a .dot file instead")
    subprocess.run([exe, "-Tpng", "-o", path], input=to_dot(dag), text=True, check=True, timeout=timeout)
