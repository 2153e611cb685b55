"""Deltas through the async API in one process (a real server actor, real sockets): what an
update does when applying the chain is cancelled or fails after writing, and bad arguments.

- cancelled mid-apply: the cancellation waits for the writes to stop, and the handle is empty
  (as after an aborted update); the next update pulls the version in full;
- the apply fails after writing (the result does not verify): the shard pulls the version in
  full in the same update, never presenting the written bytes as the version;
- ``deltas=`` and ``bucket=`` misuse are typed errors naming the argument.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tensorhub import aio
from tensorhub.core.errors import ChecksumMismatch, InvalidArgument
from tensorhub.handles import deltas as hd

from .procs import InprocServer


@pytest.fixture
def server():
    srv = InprocServer(heartbeat_interval=0.5, heartbeat_timeout=5.0)
    yield srv
    srv.close()


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 256, generator=g).to(torch.bfloat16), "b": torch.randn(1024, generator=g)}


async def step(trainer, w: dict[str, torch.Tensor], version: int, g: torch.Generator) -> None:
    await trainer.unpublish()
    idx = torch.randperm(w["w"].numel(), generator=g)[:200]
    w["w"].view(-1)[idx] += 1
    await trainer.publish(version)
    await trainer._delta_pub.settle()


async def setup(address: str, seed: int):
    w = weights(seed)
    trainer = await aio.open("m", "trainer", server=address, deltas=True)
    reader = await aio.open("m", "rollout", server=address, deltas=True)
    r = {k: torch.zeros_like(v) for k, v in w.items()}
    await trainer.register(w)
    await reader.register(r)
    await trainer.publish(1)
    await trainer._delta_pub.settle()
    assert await reader.update() and reader.version == 1
    return trainer, reader, w, r


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_an_update_cancelled_mid_apply_waits_for_the_writes_and_leaves_the_handle_empty(server, seed, monkeypatch):
    real = hd.apply_chain
    entered, release, done = threading.Event(), threading.Event(), threading.Event()

    def slow_apply(*args, **kw):
        entered.set()
        release.wait(10)
        try:
            return real(*args, **kw)
        finally:
            done.set()

    async def run() -> None:
        trainer, reader, w, r = await setup(server.address, seed)
        try:
            g = torch.Generator().manual_seed(seed)
            await step(trainer, w, 2, g)
            monkeypatch.setattr(hd, "apply_chain", slow_apply)
            task = asyncio.ensure_future(reader.update())
            await asyncio.to_thread(entered.wait, 10)
            task.cancel()
            await asyncio.sleep(0.05)
            assert not task.done()  # the cancellation waits for the thread writing into the tensors
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert done.is_set() and reader.empty and reader.version is None
            monkeypatch.setattr(hd, "apply_chain", real)
            assert await reader.update() and reader.version == 2
            assert reader.last_delta is None or reader.last_delta.target != 2 or not reader.last_delta.landed
            assert same(r, w)
        finally:
            await reader.close()
            await trainer.close()

    asyncio.run(run())


def test_an_apply_that_fails_after_writing_pulls_the_version_in_full(server, seed, monkeypatch):
    def broken_apply(tensors, deltas, **kw):
        for t in tensors.values():  # half-written, then the verification fails
            t.view(-1)[:7] = 0
        raise ChecksumMismatch("the result does not verify (injected)")

    async def run() -> None:
        trainer, reader, w, r = await setup(server.address, seed)
        try:
            g = torch.Generator().manual_seed(seed)
            await step(trainer, w, 2, g)
            monkeypatch.setattr(hd, "apply_chain", broken_apply)
            assert await reader.update() and reader.version == 2
            d = reader.last_delta
            assert d is not None and not d.landed and "ChecksumMismatch" in d.error
            assert same(r, w)  # pulled in full: the written bytes were never presented as version 2
            monkeypatch.undo()
            await step(trainer, w, 3, g)
            assert await reader.update() and reader.last_delta.landed and reader.last_delta.versions == [3]
            assert same(r, w)
            assert server.stats()["deltas_landed"] == 1
        finally:
            await reader.close()
            await trainer.close()

    asyncio.run(run())


def test_bad_delta_and_bucket_arguments_are_typed_errors():
    for bad in (-1, 65, "yes", 1.5):
        with pytest.raises(InvalidArgument, match="deltas"):
            aio.AsyncShardHandle("m", "r", deltas=bad)
    for bad in ("", 3):
        with pytest.raises(InvalidArgument, match="bucket"):
            aio.AsyncShardHandle("m", "r", bucket=bad)
    with pytest.raises(InvalidArgument, match="convert_from"):
        aio.AsyncShardHandle("m", "r", deltas=True, convert_from="src")


def test_the_standby_set_of_replicate_then_flip_lands_through_deltas_too(server, seed):
    async def run() -> None:
        trainer, reader, w, r = await setup(server.address, seed)
        try:
            g = torch.Generator().manual_seed(seed)
            await reader.register_shadow()
            await step(trainer, w, 2, g)
            assert await reader.prefetch("latest") == 2  # the standby holds nothing: in full
            assert await reader.flip() is True and same(reader.tensors, w)
            for v in (3, 4):
                await step(trainer, w, v, g)
            assert await reader.prefetch("latest") == 4  # the standby holds 1: the chain 2, 3, 4
            for _ in range(1000):
                if reader.prefetched == 4:
                    break
                await asyncio.sleep(0.02)
            standby = reader._banks.shadow
            assert standby.last_delta.versions == [2, 3, 4] and standby.last_delta.landed
            assert await reader.flip() is True and reader.version == 4 and same(reader.tensors, w)
            await step(trainer, w, 5, g)
            assert await reader.update() and reader.last_delta.versions == [5] and reader.last_delta.landed
            assert same(reader.tensors, w)
        finally:
            await reader.close()
            await trainer.close()

    asyncio.run(run())


# ---- issue 36 (4): the bucket tier's errors -------------------------------------------------------


def test_a_bucket_that_cannot_work_is_refused_at_open(tmp_path):
    """An unknown protocol, a path under a regular file, a path in /proc: BucketUnavailable (a
    TransportError) from open(), naming the URL and the cause, not untyped at every publish()."""
    import tensorhub
    from tensorhub.core.errors import BucketUnavailable, TransportError

    regular = tmp_path / "a-file"
    regular.write_text("not a directory")
    for url, cause in ((str(regular / "bucket"), "NotADirectoryError"), ("/proc/self/no-such/bucket", "Error"),
                       ("nosuchproto://weights", "ValueError")):  # fmt: skip
        with pytest.raises(BucketUnavailable) as info:
            tensorhub.open("m", "trainer", bucket=url, server="tcp://127.0.0.1:1", connect_timeout=0.2)
        err = info.value
        assert isinstance(err, TransportError) and url in str(err) and cause in str(err), err
        assert (err.model, err.replica) == ("m", "trainer")


def _bucket_copies(server, model):
    return server._look(lambda t: dict(t.models[model].buckets) if model in t.models else {})


def _until(cond, what: str, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_failed_bucket_write_is_raised_by_the_next_publish_and_never_declared(server, tmp_path):
    import shutil

    import tensorhub
    from tensorhub.core.errors import BucketError

    bucket = tmp_path / "bucket"
    with tensorhub.open("bw", "trainer", bucket=str(bucket), server=server.address) as h:
        w = {"x": torch.arange(256, dtype=torch.float32)}
        h.register(w)
        shutil.rmtree(bucket)
        bucket.write_text("the bucket's directory is gone")  # every write fails from now on
        h.publish(1)  # live for peers; the bucket write fails in the background
        _until(lambda: h._delta_pub is not None and h._delta_pub.write_error is not None, "the failed write")
        h.unpublish()
        with pytest.raises(BucketError) as info:
            h.publish(2)  # not silent: raised before version 2 goes live
        assert "bucket" in str(info.value) and h.version is None
        assert _bucket_copies(server, "bw") == {}  # version 1 was never declared as stored
        bucket.unlink()
        bucket.mkdir()
        h.publish(2)  # the bucket works again: version 2 is stored (an anchor) and declared
        _until(lambda: (2, 0) in _bucket_copies(server, "bw"), "the bucket copy of version 2")
        h.unpublish()


def test_the_bucket_serves_after_the_last_holder_left_and_a_failed_restore_says_why(server, tmp_path):
    import tensorhub
    from tensorhub.core.errors import VersionUnavailable

    bucket = tmp_path / "bucket"
    w = {"x": torch.arange(4096, dtype=torch.float32)}
    t = tensorhub.open("lr", "trainer", bucket=str(bucket), server=server.address)
    a = tensorhub.open("lr", "a", server=server.address)
    try:
        t.register(w)
        t.publish(1)
        _until(lambda: (1, 0) in _bucket_copies(server, "lr"), "the bucket copy of version 1")
        t.close()  # the only peer holder is gone
        got = {"x": torch.zeros(4096)}
        a.register(got)
        assert a.replicate(1) == 1  # no timeout: the server names the bucket at once, the handle restores
        assert torch.equal(got["x"], w["x"]) and a.last_bucket is not None
        a.close()  # gone again; now the bucket's chunks rot
        for f in (bucket / "chunks").rglob("*"):
            if f.is_file():
                f.write_bytes(b"\0" * f.stat().st_size)
        b = tensorhub.open("lr", "b", server=server.address)
        b.register({"x": torch.zeros(4096)})
        with pytest.raises(VersionUnavailable) as info:
            b.replicate(1)
        assert "ChecksumMismatch" in str(info.value) and "corrupt" in str(info.value), info.value
        assert isinstance(info.value.__cause__, ChecksumMismatch)
        b.close()
    finally:
        t.close()
        a.close()
