"""The transport conformance suite with the holder in another process
(``check_transport(..., holder_process=True)``): ``tcp`` passes it, broken transports named by
path fail it (holder-side breaks included, which only the child runs), and no holder process
outlives a call, whether it passed or failed.

The full ``tcp`` run starts its holder processes with ``spawn`` (the default); the others use
the test suite's forkserver (``tests.procs.mp()``, torch preloaded) so that each costs a fork.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import re
from collections.abc import Iterator

import pytest
import torch

from tensorhub import testing
from tensorhub.core.errors import InvalidArgument
from tensorhub.testing import CHECKS, check_transport
from tensorhub.transports.tcp import TcpTransport

from .procs import mp, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

BROKEN = "tests._broken_transport"


@pytest.fixture
def holder_processes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[testing._HolderProcess]]:
    """The holder processes the suite starts during the test; after it, none may be left."""
    started: list[testing._HolderProcess] = []

    class Recorded(testing._HolderProcess):
        def __init__(self, context: object) -> None:
            super().__init__(context)
            started.append(self)

    monkeypatch.setattr(testing.holder_process, "_HolderProcess", Recorded)
    yield started
    for proc in started:
        assert not proc.process.is_alive(), f"holder process {proc.pid} outlived the suite"
        wait_until(lambda pid=proc.pid: _gone(pid), 5.0, f"holder process {proc.pid} to be reaped")
    assert not [p for p in multiprocessing.active_children() if p.name == testing._HolderProcess.NAME]


def _gone(pid: int) -> bool:
    """No such process any more (not even a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("X",)
    except FileNotFoundError:
        return True


def test_tcp_conforms_across_processes(seed: int, holder_processes: list) -> None:
    outcome = check_transport("tcp", {}, seed=seed, holder_process=True)
    assert list(outcome) == list(CHECKS)
    assert {k for k, v in outcome.items() if v != "passed"} <= {"cuda_buffers"}
    if not torch.cuda.is_available():
        assert outcome["cuda_buffers"] == "skipped: no CUDA device"
    # One for the suite, and one more after peer_death killed it.
    assert len(holder_processes) == 2
    assert holder_processes[0].process.exitcode == -9  # SIGKILL
    assert holder_processes[1].process.exitcode == 0  # told to exit, and did
    assert all(p.pid != os.getpid() for p in holder_processes)


def test_the_holder_really_runs_in_another_process(seed: int, holder_processes: list) -> None:
    # OnlyAcrossProcesses refuses to read from a peer in its own process.
    path = f"{BROKEN}:OnlyAcrossProcesses"
    with pytest.raises(AssertionError, match="the peer is in this process"):
        check_transport(path, seed=seed, only=["odd_ranges"])
    assert not holder_processes
    outcome = check_transport(path, seed=seed, only=["odd_ranges", "close_holder"], holder_process=True, mp_context=mp())
    assert outcome == {"odd_ranges": "passed", "close_holder": "passed"}
    assert len(holder_processes) == 1


@pytest.mark.parametrize(
    ("broken", "check", "match"),
    [
        # holder side: only the holder process runs the broken code
        ("ServesOneByteEarly", "odd_ranges", "the bytes differ"),
        # deterministic: the holder process's own copy moves the generation (a hook), no race
        ("NoSeqlock", "seqlock_during", r"a read of bytes \[0, 4096\) across which the holder's generation moved: returned normally"),
        ("DiesWhenServing", "start_endpoint", r"the holder process is gone \(exit code 3\) before it answered 'start'"),
        # reader side, against a sound holder in the other process
        ("IgnoresGeneration", "seqlock_between", "returned normally"),
    ],
)
def test_the_suite_fails_a_broken_transport_across_processes(
    broken: str, check: str, match: str, seed: int, holder_processes: list
) -> None:
    path = f"{BROKEN}:{broken}"
    with pytest.raises(AssertionError) as info:
        check_transport(path, seed=seed, only=[check], holder_process=True, mp_context=mp())
    text = str(info.value)
    assert text.startswith(f"check_transport({path}): check {check!r} failed (seed={seed})"), text
    assert re.search(match, text), text
    assert len(holder_processes) == 1


def test_a_holder_process_that_does_not_answer_is_killed(seed: int, holder_processes: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testing.limits, "_COMMAND_TIMEOUT", 1.0)
    path = f"{BROKEN}:HangsWhenHolding"
    with pytest.raises(AssertionError, match=r"check 'odd_ranges' failed .*the holder process did not answer 'hold' within 1 s"):
        check_transport(path, seed=seed, only=["odd_ranges"], holder_process=True, mp_context=mp())
    assert len(holder_processes) == 1 and holder_processes[0].process.exitcode == -9


def test_a_transport_class_importable_at_module_level_will_do(seed: int, holder_processes: list) -> None:
    outcome = check_transport(TcpTransport, seed=seed, only=["tiny_ranges"], holder_process=True, mp_context=mp())
    assert outcome == {"tiny_ranges": "passed"}


def _local_class() -> type:
    class Local(TcpTransport):
        pass

    return Local


@pytest.mark.parametrize(
    ("transport", "options", "kw", "match"),
    [
        (lambda options: TcpTransport(options), {}, {}, "name it by its registered name or a 'module:Class' path"),
        (_local_class(), {}, {}, "name it by its registered name"),  # the child cannot import it
        ("tests._broken_transport:Nope", {}, {}, "does not load: AttributeError"),
        ("tests._broken_transport:os", {}, {}, "not a subclass of tensorhub.Transport"),
        ("nope", {}, {}, "no transport named 'nope'"),
        ("tcp", {"host": ("127.0.0.1",)}, {}, "options go to the holder process as msgpack"),
        ("tcp", {}, {"mp_context": "fork"}, "'spawn' or 'forkserver'"),
        ("tcp", {}, {"mp_context": "nope"}, "no start method 'nope'"),
        ("tcp", {}, {"only": ["nope"]}, r"unknown conformance checks \['nope'\]"),
    ],
)
def test_process_mode_refuses_what_the_child_cannot_make(
    transport: object, options: dict, kw: dict, match: str, holder_processes: list
) -> None:
    with pytest.raises(InvalidArgument, match=match):
        check_transport(transport, options, holder_process=True, **kw)  # type: ignore[arg-type]
    assert not holder_processes


def test_pair_commands_answer_alike_in_both_places(seed: int, holder_processes: list) -> None:
    """The commands a check gives a holder do the same here and in the holder process (the
    suite's machinery, driven directly)."""
    from tensorhub.runtime.actor import run
    from tensorhub.transports.registry import get_transport

    async def _failure(aw: object) -> BaseException:
        try:
            await aw  # type: ignore[misc]
        except Exception as err:  # noqa: BLE001 - the error is the answer
            return err
        raise AssertionError("no error")

    async def script(hosting: object) -> list:
        ctx = testing._Ctx("script", random.Random(seed), get_transport("tcp"), {}, 1 << 20, asyncio.get_running_loop(), hosting)
        shard = ctx.shard(filled=False)
        log: list = []
        try:
            async with ctx.pair() as p:
                log.append(await p.hold(shard, verified=0))
                into = p.into(shard)
                await p.write(shard, 0, shard.data[:5000])
                await p.write(shard, 5000, b"\x01" * (testing._WRITE_CHUNK + 3))  # two commands
                await p.advance(shard, 5000 + testing._WRITE_CHUNK + 3)
                log.append(await p.generation(shard))
                log.append(await p.read(into, 0, 6000))
                log.append(testing._bytes(into)[:6000])
                log.append(await p.reset(shard, testing.VERSION, shard.total))
                await p.withdraw(shard)
                await p.expose(shard)
                log.append(await p.read(into, 10, 20, log[-1]))
                with pytest.raises((InvalidArgument, AssertionError), match="hold it first"):  # AssertionError from there
                    await p.advance(shard.sibling(99), 1)
                await p.close_holder()
                log.append(type(await _failure(p.read(into, 0, 10))).__name__)
        finally:
            await hosting.close()
        return log

    here = run(script(testing._InProcess()))
    there = run(script(testing._InChild(mp(), "tcp")))
    assert here == there
    # A closed holder's port refuses the connection: PeerUnreachable, a TransportError.
    assert here[-1] == "PeerUnreachable" and here[3][5000:6000] == b"\x01" * 1000
    assert len(holder_processes) == 1
