"""torchrun defaults: ``num_shards``/``shard_idx`` omitted come from the job.

- an initialized ``torch.distributed`` process group gives its world size and rank; else
  torchrun's ``$WORLD_SIZE``/``$RANK``; else 1 and 0; explicit values are kept;
- inconsistent sources are refused with ``InvalidArgument`` naming them: one of the two
  variables alone, a non-integer, a rank outside the world, a process group that disagrees with
  the variables, an explicit ``num_shards`` other than the world size with ``shard_idx`` omitted;
- two processes started as torchrun starts them (``WORLD_SIZE=2``, ``RANK=r``) open a replica of
  two shards with no sharding arguments, and a reader replicates what they publish.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tensorhub.core.errors import InvalidArgument, InvalidName
from tensorhub.handles.api import AsyncShardHandle, default_sharding

from .procs import ServerProcess


@pytest.fixture
def no_job(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    return monkeypatch


def test_without_a_job_the_defaults_are_one_shard(no_job):
    assert default_sharding(None, None) == (1, 0)
    assert default_sharding(4, 3) == (4, 3)
    assert default_sharding(None, 0) == (1, 0)
    h = AsyncShardHandle("m", "r")
    assert (h.num_shards, h.shard_idx) == (1, 0)
    assert default_sharding(1, None) == (1, 0)


def test_several_shards_with_no_index_and_no_job_are_refused(no_job):
    """Issue 36 (5): num_shards=4 with shard_idx omitted and nothing to take a rank from made
    every process shard 0, silently."""
    with pytest.raises(InvalidArgument, match="pass shard_idx="):
        default_sharding(4, None)
    with pytest.raises(InvalidArgument, match="shard_idx omitted with num_shards=4"):
        AsyncShardHandle("m", "r", num_shards=4)


def test_torchrun_variables_fill_what_is_omitted(no_job):
    no_job.setenv("WORLD_SIZE", "4")
    no_job.setenv("RANK", "2")
    assert default_sharding(None, None) == (4, 2)
    assert default_sharding(4, None) == (4, 2)
    assert default_sharding(None, 1) == (4, 1)
    assert default_sharding(8, 5) == (8, 5)  # explicit values win, whatever the job says
    h = AsyncShardHandle("m", "r")
    assert (h.num_shards, h.shard_idx) == (4, 2)
    assert h.ctx["shard"] == 2


@pytest.mark.parametrize(
    ("env", "args", "match"),
    [
        ({"WORLD_SIZE": "4"}, (None, None), r"\$WORLD_SIZE is set but \$RANK is not"),
        ({"RANK": "1"}, (None, None), r"\$RANK is set but \$WORLD_SIZE is not"),
        ({"WORLD_SIZE": "four", "RANK": "1"}, (None, None), r"\$WORLD_SIZE must be an integer"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, (None, None), "not a rank of that world"),
        ({"WORLD_SIZE": "4", "RANK": "3"}, (2, None), "num_shards=2 is not the world size 4"),
    ],
)
def test_inconsistent_values_are_refused(no_job, env, args, match):
    for k, v in env.items():
        no_job.setenv(k, v)
    with pytest.raises(InvalidArgument, match=match):
        default_sharding(*args)
    with pytest.raises(InvalidArgument, match=match) as info:
        AsyncShardHandle("m", "r", num_shards=args[0], shard_idx=args[1])
    assert "model 'm'" in str(info.value) or "'m'" in str(info.value)


def test_an_explicit_shard_outside_the_job_world_is_refused(no_job):
    no_job.setenv("WORLD_SIZE", "2")
    no_job.setenv("RANK", "0")
    with pytest.raises(InvalidName, match=r"shard_idx must be an int in \[0, 2\)"):
        AsyncShardHandle("m", "r", shard_idx=3)


def test_an_initialized_process_group_gives_world_and_rank(no_job, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", world_size=1, rank=0)
    try:
        assert default_sharding(None, None) == (1, 0)
        no_job.setenv("WORLD_SIZE", "1")
        no_job.setenv("RANK", "0")
        assert default_sharding(None, None) == (1, 0)  # agreeing sources
        no_job.setenv("WORLD_SIZE", "2")
        with pytest.raises(InvalidArgument, match="process group .* disagrees with"):
            default_sharding(None, None)
        assert default_sharding(2, 1) == (2, 1)  # explicit values are not checked against the job
    finally:
        dist.destroy_process_group()


def test_two_torchrun_ranks_make_one_replica(handles):
    server = ServerProcess()
    try:
        # no num_shards / shard_idx: each worker takes them from torchrun's variables
        ranks = [handles("trainer", model="tr", server=server.address, env={"WORLD_SIZE": "2", "RANK": str(r)})
                 for r in range(2)]  # fmt: skip
        for h in ranks:
            h.call("register")
            h.call("fill", 7)
        for h in ranks:  # publish is a model-parallel call: both shards of one replica of two
            h.send("publish", 7)
        for h in ranks:
            assert h.result() is None
        assert ranks[0].call("list", True) == {7: ["trainer"]}  # listed once both shards hold it
        readers = [handles("reader", model="tr", server=server.address, env={"WORLD_SIZE": "2", "RANK": str(r)})
                   for r in range(2)]  # fmt: skip
        for h in readers:
            h.call("register")
        for h in readers:
            h.send("replicate", "latest", 30.0)
        assert [h.result() for h in readers] == [7, 7]
        for r in range(2):  # each reader rank holds what the trainer rank of the same shard published
            assert readers[r].call("digests") == ranks[r].call("digests")
        assert readers[0].call("holds", 7)
    finally:
        server.stop()
