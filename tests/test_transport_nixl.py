"""The ``nixl``, ``rdma_copy`` and ``local`` transports against the conformance suite, across
processes (the holder in a child process, :func:`check_transport` with ``holder_process``),
with real NIXL agents on CPU memory: UCX's default transports (shared memory / cma here) and
``UCX_TLS=tcp`` (in a child interpreter, so that UCX reads it before any agent exists; the
holder process inherits it).

Across processes every check applies: ``seqlock_during`` churns the holding in the holder's
process while reads run, and ``peer_death`` SIGKILLs the holder mid-read. In one process the
suite's two checks that act from inside a transport's copy of the holder's memory cannot fire
for a one-sided transport (``nixl``, ``local``); ``rdma_copy`` copies through
:meth:`ShardBuffers.copy_out` on the holder and takes them there too.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tensorhub.testing import check_transport
from tensorhub.transports.nixl import load_nixl

from .procs import mp

needs_nixl = pytest.mark.skipif(load_nixl() is None, reason="NIXL is not installed")


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("nixl", marks=needs_nixl), pytest.param("rdma_copy", marks=needs_nixl), "local"])
def test_conformance_across_processes(name, seed):
    check_transport(name, {}, seed=seed, holder_process=True, mp_context=mp())


_OVER_THE_WIRE = ["odd_ranges", "large_range", "concurrent_readers", "partial_holder", "seqlock_during", "peer_death",
                  "close_reader", "close_holder"]  # fmt: skip


@needs_nixl
@pytest.mark.slow
@pytest.mark.parametrize("name", ["nixl", "rdma_copy"])
def test_conformance_across_processes_over_ucx_tcp(name, seed):
    """The checks whose bytes cross the wire, with UCX held to TCP on loopback (the rest of the
    suite, which exercises no UCX transport choice, runs over shared memory above)."""
    code = (
        "from tensorhub.testing import check_transport\n"
        "if __name__ == '__main__':\n"
        f"    check_transport({name!r}, {{}}, seed={seed}, holder_process=True, mp_context='forkserver',\n"
        f"                    only={_OVER_THE_WIRE!r})\n"
    )
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]


@needs_nixl
def test_rdma_copy_in_one_process_takes_every_check(seed):
    check_transport("rdma_copy", {}, seed=seed, only=["seqlock_during", "peer_death", "close_holder"])
