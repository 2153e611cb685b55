"""The NIXL and same-host transports end to end: a real server actor, shard handles in worker
processes, real NIXL agents (UCX on CPU memory) and real process_vm_readv, real checksums.

- a version replicated over each transport lands byte-exact (from a holder with copied packs,
  into readers with copied or in-place ones, and the other way round);
- the engine picks each edge's transport by topology (same host, same datacenter, across
  datacenters), and falls back when the preferred one is not there;
- a holder SIGKILLed mid-pull: the reader reports it, is re-granted another holder and resumes
  from what it verified (no byte landed twice beyond the failed reads).
"""

from __future__ import annotations

import time

import pytest

from tensorhub.core.topology import Location

from .procs import wait_until
from .test_integrity import BIG, MANY, SCALE, publish_and_wait_checksums, shard_bytes

pytestmark = pytest.mark.integration

TRANSPORTS = ["nixl", "rdma_copy", "local"]


def test_each_transport_replicates_byte_exact(inproc_server, handles):
    srv = inproc_server
    trainer = handles("trainer", server=srv.address, scale=SCALE, transports={n: {} for n in TRANSPORTS})
    trainer.call("register")
    assert trainer.call("packs") == "copied"  # it runs nixl, which registers its packs
    publish_and_wait_checksums(srv, trainer, 1)
    for name in TRANSPORTS:
        reader = handles(f"rollout-{name}", server=srv.address, scale=SCALE, transports={name: {}})
        reader.call("register")
        # A reader whose one transport gathers lands the tiny tensors in place, from copied packs.
        assert reader.call("packs") == ("copied" if name == "nixl" else "in place"), name
        assert reader.call("replicate", 1, 60.0) == 1
        assert reader.call("holds", 1), name
        assert reader.call("last_transports") == [name]
        reader.exit()


def test_a_holder_with_packs_in_place_serves_a_reader_with_copied_ones(inproc_server, handles):
    srv = inproc_server
    trainer = handles("trainer", server=srv.address, scale=SCALE, transports={"local": {}})
    trainer.call("register")
    assert trainer.call("packs") == "in place"  # its one transport gathers: no pack buffers
    publish_and_wait_checksums(srv, trainer, 1)
    reader = handles("rollout-0", server=srv.address, scale=SCALE, transports={"local": {}, "nixl": {}})
    reader.call("register")
    assert reader.call("packs") == "copied"
    assert reader.call("replicate", 1, 60.0) == 1
    assert reader.call("last_transports") == ["local"]
    assert reader.call("holds", 1)


@pytest.mark.parametrize(
    ("reader_at", "want"),
    [
        (Location("dc1", "h1", ""), "local"),
        (Location("dc1", "h2", ""), "nixl"),
        (Location("dc2", "h1", ""), "tcp"),
    ],
    ids=["same-host", "same-datacenter", "remote"],
)
def test_the_edge_decides_the_transport(inproc_server, handles, reader_at, want):
    srv = inproc_server
    every = {"tcp": {}, "nixl": {}, "local": {}}
    trainer = handles("trainer", server=srv.address, scale=SCALE, transports=every, location=Location("dc1", "h1", ""))
    reader = handles("rollout", server=srv.address, scale=SCALE, transports=every, location=reader_at)
    for h in (trainer, reader):
        h.call("register")
    publish_and_wait_checksums(srv, trainer, 1)
    assert reader.call("replicate", 1, 60.0) == 1
    assert reader.call("holds", 1)
    assert reader.call("last_transports") == [want]


def test_a_missing_preferred_transport_falls_back(inproc_server, handles):
    srv = inproc_server
    trainer = handles("trainer", server=srv.address, scale=SCALE, transports={"tcp": {}, "nixl": {}})
    reader = handles("rollout", server=srv.address, scale=SCALE, transports={"tcp": {}, "rdma_copy": {}})
    for h in (trainer, reader):
        h.call("register")
    publish_and_wait_checksums(srv, trainer, 1)
    assert reader.call("replicate", 1, 60.0) == 1
    assert reader.call("last_transports") == ["tcp"]  # same host: local, nixl, rdma_copy are not shared


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_holder_killed_mid_pull_is_replaced_and_the_pull_resumes(inproc_server, handles, name):
    srv = inproc_server  # twice the usual scale: about 8 MB, three reads of at most 4 MiB
    victim = handles("trainer", server=srv.address, scale=2 * SCALE, env=BIG, transports={name: {}})
    backup = handles("trainer-b", server=srv.address, scale=2 * SCALE, env=BIG, transports={name: {}})
    # One read at a time; the first lands at once, every later one waits 4 s first: the kill
    # lands after some bytes were verified and before the rest were read.
    slow = {name: {"streams": 1, "faults": [{"op": "delay", "seconds": 4.0, "after": 1}]}}
    reader = handles("rollout", server=srv.address, scale=2 * SCALE, env=MANY, transports=slow)
    for h in (victim, backup, reader):
        h.call("register")
    publish_and_wait_checksums(srv, victim, 1)
    reader.send("replicate", 1, 90.0)
    wait_until(lambda: srv.counts()["grants"] == 1, 30, "the reader's grant")
    publish_and_wait_checksums(srv, backup, 1)
    time.sleep(0.3)  # into the pull (the reader's handle is busy: it cannot be asked)
    victim.kill()
    assert reader.result(90.0) == 1
    assert reader.call("holds", 1)
    sources = reader.call("last_sources")
    assert sources[0] == "trainer/0" and sources[-1] == "trainer-b/0", sources
    # Resumed, not restarted: what was verified before the kill was not pulled again.
    assert reader.call("pulled") < 2 * shard_bytes(2 * SCALE)
