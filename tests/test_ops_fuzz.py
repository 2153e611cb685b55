"""Hostile input against a real server process: a bounded fuzz run (mutated and random frames
from an authenticated client, a socket without keys, frames over the size limit) while honest
clients publish and replicate; and hypothesis-made frames, each answered with the same typed
error the local decoder raises. The long run is ``benchmarks/fuzz_server.py``."""

from __future__ import annotations

import random

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.core import messages as m
from tensorhub.core.errors import ProtocolError
from tensorhub.core.wire import WIRE_VERSION, decode, encode, message_kinds
from tensorhub.testing.fuzzing import FrameFuzzer, run_fuzz

from .procs import ServerProcess

pytestmark = pytest.mark.integration


def test_fuzz_run_keeps_the_server_and_honest_clients_whole(seed):
    report = run_fuzz(3000, seed, window=64, sockets=3, huge_every=1400, max_seconds=90, log=lambda line: None)
    text = "\n".join(report.lines())
    print(text)
    assert report.frames_sent == 3000, text
    assert report.server_alive and report.server_answers, text
    assert report.internal == 0, text
    assert report.honest_rounds > 0 and report.honest_errors == [], text
    # Every frame is accounted for: handled (ok, or refused with a typed error that came back)
    # or dropped by the transport (over the size limit, or no keys) and counted there.
    refused = sum(v for k, v in report.server_frames.items() if k != "ok")
    failed_replies = sum(v for k, v in report.replies.items() if k.startswith("failed:"))
    assert failed_replies + report.server_replies_dropped >= refused > 0.8 * report.frames_sent, text
    assert report.sent_by_mutation.get("over_size_limit") == 2, text
    assert report.dropped == 2 + report.unauthenticated_sent, text  # nothing else went missing
    assert report.server_connections.get("disconnected", 0) >= 2, text
    assert report.ok(), text


def test_fuzzer_is_deterministic(seed):
    a, b = FrameFuzzer(random.Random(seed)), FrameFuzzer(random.Random(seed))
    assert [a.frame() for _ in range(300)] == [b.frame() for _ in range(300)]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    assert s.alive(), f"the server died: {s.stderr()}"
    assert s.stop() == 0


@pytest.fixture(scope="module")
def sock(server):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(server.address)
    yield s
    s.close(0)
    ctx.term()


_SCALARS = st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats() \
    | st.text(max_size=20) | st.binary(max_size=20)  # fmt: skip
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                       max_leaves=12)  # fmt: skip
_KINDS = st.sampled_from(sorted(message_kinds())) | st.text(max_size=12)
_FRAMES = (
    st.binary(max_size=200)
    | st.builds(lambda v: msgpack.packb(v, use_bin_type=True), _VALUES)
    | st.builds(lambda ver, k, body: msgpack.packb([ver, k, body], use_bin_type=True),
                st.just(WIRE_VERSION) | _SCALARS, _KINDS, st.dictionaries(st.text(max_size=12), _VALUES, max_size=6))  # fmt: skip
)


def _reply(sock: zmq.Socket):
    assert sock.poll(5000), "the server did not answer a bad frame"
    return decode(sock.recv())


@settings(max_examples=300)
@given(frame=_FRAMES)
def test_hypothesis_frames_get_the_decoders_typed_error(server, sock, frame):
    while sock.poll(0):  # replies to earlier valid frames (long polls ending, grants...)
        sock.recv()
    try:
        decode(frame)
    except ProtocolError as err:
        expected = err.code
    else:
        return  # a valid message: the table's business (tests/test_bad_input.py, the fuzz run)
    sock.send(frame)
    for _ in range(50):
        reply = _reply(sock)
        if isinstance(reply, m.Failed) and reply.code == expected:
            break
    else:
        raise AssertionError(f"no {expected} reply for {frame!r}")
    assert server.alive()


def test_server_still_serves_after_the_hypothesis_frames(server, sock):
    sock.send(encode(m.GetStatus(424242)))
    for _ in range(50):
        reply = _reply(sock)
        if isinstance(reply, m.ServerStatus) and reply.req == 424242:
            return
    raise AssertionError("no status answer")
