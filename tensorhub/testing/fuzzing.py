"""Hostile input against a real server: random and mutated frames while honest clients work.

Theory of operation
-------------------
:class:`FrameFuzzer` makes frames from one seeded ``random.Random``: valid requests of every
kind (with the fuzzer's own sessions, other sessions, and reply kinds sent as requests), and
mutations of them (bit flips, truncation, splices, a field given another type, fields missing
or added, other wire versions, unknown kinds, deep nesting, collections and strings over their
limits, multi-part messages, raw bytes), and rarely a frame over the socket's size limit.

:func:`run_fuzz` starts a real server process (``python -m tensorhub server``; CURVE keys by
default, so that the fuzzer is an *authenticated* hostile client, and one more socket without
keys knocks too), runs honest clients in another process (a trainer publishing versions and a
rollout replicating them, checking every byte), and sends frames from several DEALER sockets in
windows, draining replies between windows. It reads the server's Prometheus metrics before and
after, and reports:

- frames sent, by mutation; replies received, by kind and error code; frames without a reply;
- the server's count of frames by outcome (``ok`` or the error code it answered), connection
  events (frames over the size limit are dropped with their connection; frames from the
  unauthenticated socket never pass the handshake), replies it dropped;
- ``internal``: frames that raised something unexpected in the server (must be 0);
- the honest clients' rounds and errors (errors must be 0), and whether the server is alive.

Every loop is bounded in count and time. Only 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from tensorhub.core import messages as m
from tensorhub.core.layout import Layout, TensorSpec
from tensorhub.core.wire import MAX_COLLECTION, MAX_FRAME_BYTES, MAX_STR, WIRE_VERSION, decode, encode

__all__ = ["FrameFuzzer", "FuzzReport", "run_fuzz"]

_LAYOUT = Layout((TensorSpec("w", "float32", (4,), 16),), "xxh3-64", 1 << 20, 2 << 20)
_MUTATIONS = (
    "valid", "bitflip", "truncate", "splice", "field_type", "missing_field", "extra_field", "wire_version",
    "unknown_kind", "not_an_array", "deep_nesting", "big_collection", "long_string", "multipart", "random_bytes",
    "empty", "reply_kind", "ext_type", "bad_utf8",
)  # fmt: skip
# Heavy frames (megabytes to build and to decode) are sent less often, and built once each.
_WEIGHTS = tuple({"big_collection": 0.1, "long_string": 0.3, "valid": 2.0, "field_type": 2.0, "bitflip": 2.0}.get(k, 1.0)
                 for k in _MUTATIONS)  # fmt: skip


def _weird(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack value of any type (bounded size and depth)."""
    pick = rng.randrange(12 if depth < 3 else 9)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, -1, 1, 2**31, -(2**63), 2**64 - 1, 2**63, rng.randrange(-1000, 1000)])
    if pick == 3:
        return rng.choice([0.0, -0.0, 1.5, float("nan"), float("inf"), -float("inf"), 1e308, rng.random()])
    if pick == 4:
        return "".join(rng.choice("ab\x00é\u2603:/-_ ") for _ in range(rng.randrange(0, 40)))
    if pick == 5:
        return rng.randbytes(rng.randrange(0, 40))
    if pick == 6:
        return rng.choice(["latest", "latest-1", "latest--1", "newest", "", "actor", "x" * 200])
    if pick in (7, 8):
        return rng.randrange(0, 50)  # small ints: plausible session, grant and call ids
    if pick == 9:
        return [_weird(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if pick == 10:
        return {str(_weird(rng, depth + 1))[:20]: _weird(rng, depth + 1) for _ in range(rng.randrange(0, 5))}
    return {rng.randrange(10): 1}  # a non-string key


class FrameFuzzer:
    """Frames to throw at a server. ``sessions``: session ids to put in valid requests (the
    fuzzer's own, once it has opened some); ``models``: model names it uses."""

    def __init__(self, rng: random.Random, models: tuple[str, ...] = ("fuzz-a", "fuzz-b")) -> None:
        self.rng = rng
        self.models = models
        self.sessions: list[int] = []
        self.huge_every = 0  # one frame over the size limit every this many frames (0: never)
        self.count = 0
        self._heavy: dict[tuple, bytes] = {}

    # ---- valid requests -------------------------------------------------------------------------

    def _session(self) -> int:
        rng = self.rng
        if self.sessions and rng.random() < 0.7:
            return rng.choice(self.sessions)
        return rng.choice([0, 1, 2, 3, rng.randrange(1, 100), rng.randrange(1 << 40)])

    def valid(self) -> Any:
        """A valid request of a random kind (valid on the wire; the table may still refuse it)."""
        rng = self.rng
        sid = self._session()
        req = rng.randrange(1, 1 << 31)
        version = rng.choice([0, 1, 2, 3, rng.randrange(1 << 40)])
        grant = rng.randrange(0, 200)
        kind = rng.randrange(22)
        from tensorhub.core.topology import Location

        if kind == 0:
            model = rng.choice(self.models)
            n = rng.choice([1, 1, 2])
            return m.OpenShard(req, model, f"r{rng.randrange(6)}", n, rng.randrange(n), f"inc{rng.randrange(4)}",
                               Location(rng.choice(["dc-a", "dc-b"]), f"h{rng.randrange(3)}", ""),
                               rng.random() < 0.2, rng.choice([None, 0, 1]))  # fmt: skip
        if kind == 1:
            return m.Register(req, sid, _LAYOUT, rng.choice([{"region": 1}, {"region": 1, "tcp": {"host": "127.0.0.1", "port": 9}}, {}]))
        if kind == 2:
            return m.Unregister(req, sid)
        if kind == 3:
            return m.Publish(req, sid, rng.randrange(1, 5), version, rng.choice([None, (1,), (1, 2)]))
        if kind == 4:
            return m.DeclareChecksums(req, sid, version, tuple(rng.randrange(1 << 64) for _ in range(rng.randrange(3))))
        if kind == 5:
            return m.Unpublish(req, sid, rng.randrange(1, 5))
        if kind == 6:
            return m.PublishOffload(req, sid, version, rng.random() < 0.5)
        if kind == 7:
            specs: list[int | str] = ["latest", "latest-1", version]
            return m.Replicate(req, sid, rng.randrange(1, 5), rng.choice(specs), rng.choice([0.0, 0.05, None]))
        if kind == 8:
            specs = ["latest", version]
            return m.Update(req, sid, rng.randrange(1, 5), rng.choice(specs), rng.choice([0.0, 0.05]), rng.random() < 0.3)
        if kind == 9:
            return m.ListVersions(req, sid, rng.choice([None, 1, 2]))
        if kind == 10:
            return m.Wait(req, sid, rng.randrange(1, 5), rng.randrange(5), rng.choice([None, 0, 1]), rng.choice([0.0, 0.05]))
        if kind == 11:
            return m.Progress(rng.choice([0, req]), sid, grant, rng.randrange(3), rng.randrange(64))
        if kind == 12:
            return m.Complete(req, sid, grant, rng.randrange(3))
        if kind == 13:
            return m.SourceFailed(req, sid, grant, rng.randrange(3), rng.randrange(64), "fuzz")
        if kind == 14:
            return m.ChecksumFailed(req, sid, grant, rng.randrange(3), rng.randrange(64), rng.randrange(4))
        if kind == 15:
            return m.VerifyResult(req, sid, version, rng.random() < 0.5)
        if kind == 16:
            return m.Heartbeat(req, tuple(self._session() for _ in range(rng.randrange(4))))
        if kind == 17:
            held = tuple(m.Held(rng.randrange(4), rng.choice([m.KIND_NORMAL, m.KIND_OFFLOAD]), rng.choice([None, (7,)]))
                         for _ in range(rng.randrange(3)))  # fmt: skip
            return m.Announce(req, sid, held, rng.choice([None, m.PartialHeld(1, 4)]), 0, ())
        if kind == 18:
            return m.CloseShard(req, sid)
        if kind == 19:
            return rng.choice([m.GetStatus(req), m.GetCluster(req), m.GetDag(req, rng.choice(self.models), version),
                               m.GetTrace(req, rng.choice(self.models), version)])  # fmt: skip
        if kind == 20:
            start = 1.7e9 + rng.random() * 1e8
            return m.TransferSpan(rng.choice([0, req]), sid, grant, version, "r1", 0, "tcp", rng.randrange(1 << 20),
                                  rng.randrange(10), start, start + rng.random(), rng.choice(m.SPAN_OUTCOMES))  # fmt: skip
        return m.Listing(req, 1, True, ())  # a reply kind sent as a request

    # ---- mutations ------------------------------------------------------------------------------

    def frame(self) -> tuple[str, list[bytes]]:
        """(mutation, frames of one message)."""
        rng = self.rng
        self.count += 1
        if self.huge_every and self.count % self.huge_every == 0:
            return "over_size_limit", [b"\x00" * (MAX_FRAME_BYTES + 4096)]
        how = rng.choices(_MUTATIONS, _WEIGHTS)[0]
        base = encode(self.valid())
        if how == "valid":
            return how, [base]
        if how == "bitflip":
            b = bytearray(base)
            for _ in range(rng.randrange(1, 9)):
                i = rng.randrange(len(b))
                b[i] ^= 1 << rng.randrange(8)
            return how, [bytes(b)]
        if how == "truncate":
            return how, [base[: rng.randrange(len(base))]]
        if how == "splice":
            other = encode(self.valid())
            return how, [base[: rng.randrange(len(base) + 1)] + other[rng.randrange(len(other)) :]]
        if how == "random_bytes":
            return how, [rng.randbytes(rng.randrange(1, 300))]
        if how == "empty":
            return how, [b""]
        if how == "multipart":
            return how, [base] + [rng.randbytes(rng.randrange(0, 20)) for _ in range(rng.randrange(1, 3))]
        version, kind, body = msgpack.unpackb(base, raw=False)
        if how == "field_type" and body:
            key = rng.choice(sorted(body))
            body[key] = _weird(rng)
            return how, [msgpack.packb([version, kind, body], use_bin_type=True)]
        if how == "missing_field" and body:
            del body[rng.choice(sorted(body))]
            return how, [msgpack.packb([version, kind, body], use_bin_type=True)]
        if how == "extra_field":
            body[rng.choice(["x", "extra", "req2", "__class__", ""])] = _weird(rng)
            return how, [msgpack.packb([version, kind, body], use_bin_type=True)]
        if how == "wire_version":
            return how, [msgpack.packb([rng.choice([0, 2, -1, 1.0, "1", None, True, 2**64 - 1]), kind, body], use_bin_type=True)]
        if how == "unknown_kind":
            return how, [msgpack.packb([WIRE_VERSION, rng.choice(["", "OPEN", "open ", "x" * 100, 7, None]), body], use_bin_type=True)]
        if how == "not_an_array":
            return how, [msgpack.packb(rng.choice([body, kind, [WIRE_VERSION, kind], [WIRE_VERSION, kind, body, 1], 5]), use_bin_type=True)]
        if how == "deep_nesting":
            depth = rng.choice([50, 500, 5000])
            return how, [msgpack.packb([WIRE_VERSION, kind, {**body, rng.choice(sorted(body) or ["x"]): None}], use_bin_type=True)[:-1]
                         + b"\x91" * depth + b"\x90"]  # fmt: skip
        if how in ("big_collection", "long_string"):
            key = rng.choice(sorted(body) or ["x"])
            size = rng.choice([MAX_COLLECTION + 1, 70_000, 5_000] if how == "big_collection" else [MAX_STR + 1, 1 << 20])
            shape = rng.choice(["list", "map"]) if how == "big_collection" else "str"
            cached = self._heavy.get((kind, key, size, shape))
            if cached is None:
                if shape == "list":
                    body[key] = list(range(size))
                elif shape == "map":
                    body[key] = {str(i): i for i in range(min(size, 100_000))}
                else:
                    body[key] = "s" * size
                cached = self._heavy[(kind, key, size, shape)] = msgpack.packb([version, kind, body], use_bin_type=True)
                if len(self._heavy) > 64:
                    self._heavy.pop(next(iter(self._heavy)))
            return how, [cached]
        if how == "reply_kind":
            reply = rng.choice([m.Ack(1), m.Failed(1, "malformed", "x"), m.HeartbeatAck(1, ()), m.Replicated(1, 1)])
            return how, [encode(reply)]
        if how == "ext_type":
            return how, [msgpack.packb([WIRE_VERSION, kind, {**body, "req": msgpack.ExtType(1, b"xx")}], use_bin_type=True)]
        if how == "bad_utf8":
            raw = msgpack.packb([WIRE_VERSION, kind, body], use_bin_type=True)
            return how, [raw.replace(kind.encode(), b"\xff" * len(kind), 1)]
        return "valid", [base]


@dataclass
class FuzzReport:
    """What one run did and saw (see the module docstring)."""

    seed: int
    frames_sent: int = 0
    sent_by_mutation: dict[str, int] = field(default_factory=dict)
    unauthenticated_sent: int = 0
    replies: dict[str, int] = field(default_factory=dict)  # reply kind, or "failed:<code>"
    server_frames: dict[str, int] = field(default_factory=dict)  # the server's frames by outcome (delta)
    server_connections: dict[str, int] = field(default_factory=dict)
    server_replies_dropped: int = 0
    server_auth: dict[str, int] = field(default_factory=dict)
    honest_rounds: int = 0
    honest_errors: list[str] = field(default_factory=list)
    server_alive: bool = False
    server_answers: bool = False
    seconds: float = 0.0

    @property
    def server_received(self) -> int:
        return sum(self.server_frames.values())

    @property
    def internal(self) -> int:
        return self.server_frames.get("internal", 0)

    @property
    def dropped(self) -> int:
        """Frames the server never handled: over the size limit (dropped with the connection by
        ZeroMQ) or from the unauthenticated socket (never past the handshake)."""
        return self.frames_sent + self.unauthenticated_sent - self.server_received

    honest_expected: bool = True

    def ok(self) -> bool:
        return (self.server_alive and self.server_answers and not self.honest_errors and self.internal == 0
                and (self.honest_rounds > 0 or not self.honest_expected) and self.dropped >= 0)  # fmt: skip

    def lines(self) -> list[str]:
        refused = {k: v for k, v in sorted(self.server_frames.items()) if k != "ok"}
        return [
            f"seed {self.seed}: {self.frames_sent} frames sent in {self.seconds:.1f} s "
            f"({self.frames_sent / max(self.seconds, 1e-9):,.0f}/s) + {self.unauthenticated_sent} from a socket without keys",
            "  by mutation: " + ", ".join(f"{k} {v}" for k, v in sorted(self.sent_by_mutation.items())),
            f"  server handled {self.server_received}: ok {self.server_frames.get('ok', 0)}, refused with a typed error "
            f"{sum(refused.values())}: " + ", ".join(f"{k} {v}" for k, v in refused.items()),
            f"  dropped, not handled: {self.dropped} (connection events: "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.server_connections.items())) + ")",
            f"  internal errors in the server: {self.internal}; replies the server dropped: {self.server_replies_dropped}; "
            f"auth: " + ", ".join(f"{k} {v}" for k, v in sorted(self.server_auth.items())),
            "  replies received by the fuzzer: " + ", ".join(f"{k} {v}" for k, v in sorted(self.replies.items())),
            f"  honest clients: {self.honest_rounds} versions published and replicated, verified; errors: "
            f"{len(self.honest_errors)}" + (f" (first: {self.honest_errors[0]})" if self.honest_errors else ""),
            f"  server alive: {self.server_alive}, answering: {self.server_answers}; verdict: {'PASS' if self.ok() else 'FAIL'}",
        ]

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.update(dropped=self.dropped, internal=self.internal, server_received=self.server_received, ok=self.ok())
        return d


# ---- the honest side (a separate process) --------------------------------------------------------


def honest_main(address: str, seconds: float, out_path: str) -> None:
    """A trainer publishes versions 1, 2, ... and a rollout replicates each, checking the bytes,
    for ``seconds`` or until a file ``out_path + ".stop"`` exists; writes
    ``{"rounds": n, "errors": [...]}`` to ``out_path``."""
    import torch

    import tensorhub

    rounds, errors = 0, []
    deadline = time.monotonic() + seconds
    try:
        with tensorhub.open("honest", "trainer", server=address, connect_timeout=30) as t, \
                tensorhub.open("honest", "rollout", server=address, connect_timeout=30) as r:  # fmt: skip
            src = {"w": torch.zeros(1 << 16), "b": torch.zeros(16)}
            dst = {"w": torch.zeros(1 << 16), "b": torch.zeros(16)}
            t.register(src)
            r.register(dst)
            v = 0
            while time.monotonic() < deadline and v < 100_000 and not os.path.exists(out_path + ".stop"):
                v += 1
                try:
                    if v > 1:
                        t.unpublish()
                    src["w"].fill_(float(v))
                    src["b"].fill_(-float(v))
                    t.publish(v)
                    got = r.replicate(v, timeout=30)
                    if got != v or not torch.equal(dst["w"], src["w"]) or not torch.equal(dst["b"], src["b"]):
                        errors.append(f"round {v}: replicated {got} with wrong bytes")
                    rounds += 1
                    if rounds == 1:
                        open(out_path + ".ready", "w").close()
                except Exception as err:  # noqa: BLE001 - every failure is a finding
                    errors.append(f"round {v}: {type(err).__name__}: {err}")
                    if len(errors) > 20:
                        break
                time.sleep(0.02)
    except Exception as err:  # noqa: BLE001
        errors.append(f"setup: {type(err).__name__}: {err}")
    with open(out_path, "w") as f:
        json.dump({"rounds": rounds, "errors": errors}, f)


# ---- the run ------------------------------------------------------------------------------------


def _metrics(port: int) -> dict[str, dict[tuple, float]]:
    from tensorhub.runtime.metrics import parse_text, scrape

    return parse_text(scrape("127.0.0.1", port, timeout=30.0))


def _by(sample: dict[tuple, float], label: str) -> dict[str, int]:
    return {dict(k).get(label, ""): int(v) for k, v in sample.items()}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def run_fuzz(
    frames: int,
    seed: int,
    curve: bool = True,
    window: int = 64,
    sockets: int = 4,
    huge_every: int = 25_000,
    max_seconds: float = 600.0,
    log: Any = print,
    honest_clients: bool = True,
) -> FuzzReport:
    """Throw ``frames`` frames at a fresh server process while honest clients work (see the
    module docstring); bounded by ``max_seconds``."""
    from tensorhub.runtime.security import ClientKeys, keygen, load_public, load_secret
    from tensorhub.runtime.server import client_label

    rng = random.Random(seed)
    report = FuzzReport(seed)
    report.honest_expected = honest_clients
    tmp = tempfile.TemporaryDirectory(prefix="tensorhub-fuzz-")
    env = dict(os.environ)
    server_args = ["--bind", "tcp://127.0.0.1:*", "--metrics-port", "0", "--log-level", "error", "--seed", str(seed)]
    fuzz_keys = None
    if curve:
        keygen(tmp.name, "server")
        keygen(os.path.join(tmp.name, "clients"), "honest")
        keygen(os.path.join(tmp.name, "clients"), "fuzzer")
        server_args += ["--curve-secret", os.path.join(tmp.name, "server.key_secret"),
                        "--curve-clients", os.path.join(tmp.name, "clients")]  # fmt: skip
        env["TENSORHUB_CURVE_SERVER_KEY"] = os.path.join(tmp.name, "server.key")
        env["TENSORHUB_CURVE_SECRET"] = os.path.join(tmp.name, "clients", "honest.key_secret")
        pub, sec = load_secret(os.path.join(tmp.name, "clients", "fuzzer.key_secret"))
        fuzz_keys = ClientKeys(pub, sec, load_public(os.path.join(tmp.name, "server.key")))
    elif honest_clients:
        raise ValueError("honest clients need curve=True: without keys any client may use any session id")
    fuzz_client = client_label(fuzz_keys.public.decode() if fuzz_keys is not None else None)
    server = subprocess.Popen([sys.executable, "-m", "tensorhub", "server", *server_args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    honest: subprocess.Popen | None = None
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    try:
        assert server.stdout is not None
        first, second = server.stdout.readline(), server.stdout.readline()
        found = re.search(r"listening on (tcp://\S+)", first)
        port_match = re.search(r":(\d+)/metrics", second)
        if not found or not port_match:
            raise RuntimeError(f"the server did not start: {first!r} {second!r}")
        address, port = found.group(1), int(port_match.group(1))
        before = _metrics(port)

        def dealer(keys: ClientKeys | None) -> zmq.Socket:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 10_000)
            if keys is not None:
                keys.apply(s)
            s.connect(address)
            socks.append(s)
            return s

        pool = [dealer(fuzz_keys) for _ in range(sockets)]
        # Frames over the size limit go on a socket of their own: ZeroMQ drops the connection
        # they come on, and replies still queued on it would be lost with it.
        big = dealer(fuzz_keys)
        stranger = dealer(None) if curve else None  # speaks no CURVE: never gets past the handshake
        fuzzer = FrameFuzzer(rng)
        fuzzer.huge_every = huge_every

        def note(reply: bytes) -> None:
            try:
                msg = decode(reply)
            except Exception:  # noqa: BLE001 - the server sent something undecodable: a finding
                report.replies["undecodable"] = report.replies.get("undecodable", 0) + 1
                return
            key = f"failed:{msg.code}" if isinstance(msg, m.Failed) else msg.KIND
            report.replies[key] = report.replies.get(key, 0) + 1
            if isinstance(msg, m.Opened) and msg.session not in fuzzer.sessions:
                fuzzer.sessions.append(msg.session)
                del fuzzer.sessions[:-32]

        def drain(quiet_ms: int, limit_s: float) -> None:
            end = time.monotonic() + limit_s
            poller = zmq.Poller()
            for s in pool:
                poller.register(s, zmq.POLLIN)
            while time.monotonic() < end:
                ready = dict(poller.poll(quiet_ms))
                if not ready:
                    return
                for s in ready:
                    for _ in range(10_000):
                        try:
                            note(s.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break

        out_path = os.path.join(tmp.name, "honest.json")
        honest_seconds = max_seconds + 60  # told to stop (a file) once the frames are sent
        honest = None if not honest_clients else subprocess.Popen([sys.executable, "-c", "import sys; from tensorhub.testing.fuzzing import honest_main; "
                                   "honest_main(sys.argv[1], float(sys.argv[2]), sys.argv[3])",
                                   address, str(honest_seconds), out_path], env=env)  # fmt: skip
        ready_by = time.monotonic() + 60.0  # the honest clients are up (a first round done) before the flood
        while honest is not None and not os.path.exists(out_path + ".ready") and time.monotonic() < ready_by:
            if honest.poll() is not None:
                break
            time.sleep(0.05)
        t0 = time.monotonic()
        deadline = t0 + max_seconds
        last_log = t0
        while report.frames_sent < frames and time.monotonic() < deadline:
            sock = pool[(report.frames_sent // window) % len(pool)]
            for _ in range(min(window, frames - report.frames_sent)):
                how, parts = fuzzer.frame()
                try:
                    (big if how == "over_size_limit" else sock).send_multipart(parts, flags=zmq.NOBLOCK)
                except zmq.Again:
                    report.replies["send_queue_full"] = report.replies.get("send_queue_full", 0) + 1
                    continue
                report.frames_sent += 1
                report.sent_by_mutation[how] = report.sent_by_mutation.get(how, 0) + 1
            if stranger is not None and rng.random() < 0.05:
                try:
                    stranger.send(encode(m.GetStatus(1)), flags=zmq.NOBLOCK)
                    report.unauthenticated_sent += 1
                except zmq.Again:
                    pass
            drain(5, 2.0)
            if time.monotonic() - last_log > 10:
                last_log = time.monotonic()
                log(f"  ... {report.frames_sent} frames sent ({report.frames_sent / (last_log - t0):,.0f}/s)")
        # The last replies: until the server has been quiet for 2 s (300 ms missed replies to
        # hundreds of frames when a loaded machine paused the server longer than that).
        drain(2000, 30.0)
        report.seconds = time.monotonic() - t0
        # Let the honest clients go on a little after the flood, then stop them.
        time.sleep(1.0)
        open(out_path + ".stop", "w").close()
        if honest is not None:
            try:
                honest.wait(60)
            except subprocess.TimeoutExpired:
                honest.kill()
                honest.wait(10)
            try:
                with open(out_path) as f:
                    h = json.load(f)
                report.honest_rounds, report.honest_errors = h["rounds"], h["errors"]
            except (OSError, ValueError) as err:
                report.honest_errors = [f"the honest process left no report (exit {honest.returncode}): {err}"]
        # The server's view.
        report.server_alive = server.poll() is None
        if report.server_alive:
            after = _metrics(port)
            report.server_frames = _delta(_by(after.get("tensorhub_frames_total", {}), "outcome"),
                                          _by(before.get("tensorhub_frames_total", {}), "outcome"))  # fmt: skip
            report.server_connections = _delta(_by(after.get("tensorhub_connections_total", {}), "event"),
                                               _by(before.get("tensorhub_connections_total", {}), "event"))  # fmt: skip
            report.server_auth = _by(after.get("tensorhub_auth_total", {}), "result")
            report.server_replies_dropped = int(sum(after.get("tensorhub_replies_dropped_total", {}).values()))
            # The honest clients' frames are in the server's counts too (all "ok": any refusal of
            # theirs is an error they see). The server counts frames per client key: the
            # fuzzer's own count tells how many of the "ok" were its.
            by_client = _delta(_by(after.get("tensorhub_client_frames_total", {}), "client"),
                               _by(before.get("tensorhub_client_frames_total", {}), "client"))  # fmt: skip
            fuzz_received = by_client.get(fuzz_client, 0)
            refused = sum(v for k, v in report.server_frames.items() if k != "ok")
            report.server_frames["ok"] = fuzz_received - refused
            from tensorhub.tools.admin import server_status

            try:
                server_status(address, 10.0, fuzz_keys)
                report.server_answers = True
            except Exception:  # noqa: BLE001
                report.server_answers = False
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        if honest is not None and honest.poll() is None:
            honest.kill()
            honest.wait(10)
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(5)
        err_text = server.stderr.read() if server.stderr else ""
        if err_text.strip():
            log("server stderr (last lines):\n" + "\n".join(err_text.strip().splitlines()[-15:]))
        for pipe in (server.stdout, server.stderr):
            if pipe is not None:
                pipe.close()
        tmp.cleanup()
    return report
