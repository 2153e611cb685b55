"""The authenticated data plane: grant tokens (``tensorhub.core.tokens``), the table that seals
them, the engine that checks them, and the transports that carry them.

- sans-IO: a token opens only under the key it was sealed with, binds what the grant says,
  expires by the server's clock as the holder learns it from the tokens; the table seals each
  grant from a holder that registered a key (the same seed gives the same tokens), and the key
  never reaches a reader; the engine admits, refuses, counts and logs;
- end to end: a process that was never granted anything connects to a holder's ``tcp`` port
  and to its side channels (``local``, ``nixl``, ``rdma_copy``) with no token, a forged one and
  one sealed under another key: it gets no byte of the shard and no memory description, and the
  holder counts every refusal; readers the server granted pull byte-exact beside it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import pytest
import structlog
import torch

from tensorhub.core import messages as m
from tensorhub.core import wire
from tensorhub.core.errors import MalformedMessage
from tensorhub.core.table import TableConfig
from tensorhub.core.tokens import TOKEN_BYTES, GrantToken, InvalidToken, TokenChecker
from tensorhub.core.topology import Location
from tensorhub.runtime.engine import EngineActor, _Slot
from tensorhub.transports.base import Transport

from .procs import holds, wait_until, weights, zeros_like_weights
from .table_driver import LAYOUT, Driver

ROOT = Path(__file__).resolve().parent.parent
KEY, OTHER = bytes(range(32)), bytes(range(1, 33))


# --- tokens --------------------------------------------------------------------------------------


def test_a_token_opens_under_its_key_and_binds_the_grant():
    t = GrantToken(term=7, grant=42, reader=9, version=3, issued=1234.5, ttl=60.0)
    blob = t.seal(KEY)
    assert len(blob) == TOKEN_BYTES == 61
    assert GrantToken.open(KEY, blob) == t
    with pytest.raises(InvalidToken) as err:
        GrantToken.open(OTHER, blob)  # another holder's key
    assert err.value.reason == "forged"
    for i in (0, 10, 30, TOKEN_BYTES - 1):  # any altered byte: a field or the MAC
        bad = bytearray(blob)
        bad[i] ^= 1
        with pytest.raises(InvalidToken, match="MAC does not verify"):
            GrantToken.open(KEY, bytes(bad))
    for junk, reason in ((None, "no_token"), (b"", "malformed"), (blob[:-1], "malformed"), ("x" * 61, "malformed")):
        with pytest.raises(InvalidToken) as err:
            GrantToken.open(KEY, junk)
        assert err.value.reason == reason
    with pytest.raises(ValueError, match="16 to 64 bytes"):
        t.seal(b"short")


def test_the_checker_refuses_another_version_and_expired_tokens_by_the_servers_clock():
    now = [100.0]  # the holder's clock: unrelated to the server's
    checker = TokenChecker(lambda: now[0])

    def token(version: int = 3, issued: float = 5000.0, ttl: float = 60.0, term: int = 1) -> bytes:
        return GrantToken(term, 1, 2, version, issued, ttl).seal(KEY)

    with pytest.raises(InvalidToken) as err:
        checker.check(KEY, token(version=4), 3)
    assert err.value.reason == "wrong_version"
    assert checker.check(KEY, token(), 3).issued == 5000.0  # the first of a term: judged by MAC and version
    assert checker.server_now(1) == 5000.0
    now[0] += 30.0  # 30 s later here: the server is at least at 5030
    assert checker.server_now(1) == 5030.0
    checker.check(KEY, token(issued=5000.0, ttl=60.0), 3)  # still good
    now[0] += 31.0
    with pytest.raises(InvalidToken) as err:
        checker.check(KEY, token(issued=5000.0, ttl=60.0), 3)
    assert err.value.reason == "expired"
    checker.check(KEY, token(issued=5060.0, ttl=60.0), 3)  # a fresh grant's token
    assert checker.check(KEY, token(issued=1.0, ttl=60.0, term=2), 3)  # another server: its own clock


# --- the table seals them ------------------------------------------------------------------------


def _granted(seed: int, key: bytes | None) -> tuple[Driver, m.Grant, int]:
    d = Driver(seed, TableConfig(grant_ttl=120.0))
    trainer = d.shard("trainer", layout=None)
    endpoint = {"region": 5, "tcp": {"host": "127.0.0.1", "port": 9}}
    trainer.expect_ok(trainer.register(LAYOUT, {**endpoint, m.GRANT_KEY: key} if key is not None else endpoint))
    trainer.expect_ok(trainer.publish(1))
    reader = d.shard("rollout")
    reader.replicate(1)
    (g,) = reader.grants()
    return d, g, reader.session


def test_a_grant_carries_a_token_sealed_with_the_sources_key_and_never_the_key():
    d, g, reader = _granted(0, KEY)
    t = GrantToken.open(KEY, g.token)
    assert (t.term, t.grant, t.reader, t.version, t.ttl) == (d.table.term, g.grant, reader, 1, 120.0)
    assert t.issued == pytest.approx(d.clock.t)
    assert m.GRANT_KEY not in g.source.endpoint and g.source.endpoint == {"region": 5, "tcp": {"host": "127.0.0.1", "port": 9}}
    assert KEY not in wire.encode(g)  # nothing a reader is sent holds the key
    assert all(KEY not in wire.encode(msg) for _, msg in d.log)
    _, plain, _ = _granted(0, None)
    assert plain.token is None  # a holder that registered no key: grants carry none


def test_same_seed_same_tokens():
    assert _granted(3, KEY)[1].token == _granted(3, KEY)[1].token


def test_register_takes_the_key_out_of_the_endpoint_and_validates_it():
    r = m.Register(1, 2, LAYOUT, {"region": 1, m.GRANT_KEY: KEY})
    assert r.endpoint == {"region": 1} and r.grant_key == KEY
    back = wire.decode(wire.encode(r))
    assert back == r and back.endpoint == {"region": 1}
    with pytest.raises(ValueError, match="given twice"):
        m.Register(1, 2, LAYOUT, {"region": 1, m.GRANT_KEY: KEY}, KEY)
    for bad in (b"x" * 8, "k" * 32, 5):
        with pytest.raises(ValueError, match="16 to 64 bytes"):
            m.Register(1, 2, LAYOUT, {"region": 1, m.GRANT_KEY: bad})
    frame = msgpack.unpackb(wire.encode(r))
    frame[2]["grant_key"] = b"x" * 8
    with pytest.raises(MalformedMessage, match="16 to 64 bytes"):
        wire.decode(msgpack.packb(frame, use_bin_type=True))
    g = m.Grant(1, 2, 3, 4, 5, 0, m.SourceInfo(1, "t", 0, "normal", True, Location("dc", "h", ""), {}), None, b"t" * 61)
    assert wire.decode(wire.encode(g)).token == b"t" * 61


# --- the engine checks them ----------------------------------------------------------------------


class _Quiet(Transport):
    name = "tcp"
    checks_grants = True


def test_the_engine_admits_the_granted_and_counts_and_logs_every_refusal():
    engine = EngineActor({"tcp": _Quiet()})
    slot = _Slot(1, 4, None, None, {"replica": "trainer", "shard": 0})  # type: ignore[arg-type]
    engine.regions[4] = slot
    good = GrantToken(1, 1, 2, 3, 10.0, 60.0).seal(slot.key)
    assert engine.transports["tcp"].admit(4, 3, good, "from 127.0.0.1:5") is None
    with structlog.testing.capture_logs() as logs:
        refused = [
            engine.admit(4, 3, None, "tcp from a"),
            engine.admit(4, 3, good[:-1] + bytes([good[-1] ^ 1]), "tcp from a"),
            engine.admit(4, 3, GrantToken(1, 1, 2, 3, 10.0, 60.0).seal(KEY), "tcp from a"),  # another holder's
            engine.admit(4, 4, good, "tcp from a"),
            engine.admit(99, 3, good, "tcp from a"),
            engine.admit(4, 3, None, "tcp from b"),
        ]
    assert all(r is not None and r.startswith("refused") for r in refused)
    assert dict(engine.refusals) == {"no_token": 2, "forged": 2, "wrong_version": 1, "unknown_region": 1}
    assert engine.refused_total == 6
    # One line per reason (the second "no_token" within 10 s is counted, not logged again).
    assert [e["log_level"] for e in logs] == ["warning"] * 4
    assert all(e["event"].startswith("data-plane request without a valid grant token refused") for e in logs)
    assert logs[0]["who"] == "tcp from a" and logs[0]["replica"] == "trainer"


# --- end to end: an ungranted process gets nothing ------------------------------------------------

ATTACKER = textwrap.dedent(
    """
    import json, secrets, socket, sys
    import msgpack, torch, zmq
    from tensorhub.core.tokens import GrantToken
    from tensorhub.runtime.actor import run
    from tensorhub.transports import tcp
    from tensorhub.transports.base import Unauthorized
    from tensorhub.transports.buffers import ShardBuffers, layout_of

    ep, version, total = json.loads(sys.argv[1])
    region = ep["region"]
    forged = GrantToken(1, 1, 1, version, 0.0, 3600.0).seal(secrets.token_bytes(32))  # a key of its own
    junk = secrets.token_bytes(61)
    out = {}

    def raw_tcp(token):
        host, port = ep["tcp"]["host"], ep["tcp"]["port"]
        req = tcp._REQ.pack(tcp._MAGIC, region, version, 0, total, 0, 1000, len(token)) + token
        got = b""
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(req)
            while True:
                k = s.recv(1 << 20)
                if not k:
                    break
                got += k
        return got.hex()

    out["tcp_raw"] = [raw_tcp(t) for t in (b"", junk, forged)]

    async def via_transport():
        t = tcp.TcpTransport({})
        await t.start()
        into = ShardBuffers({"x": torch.zeros(total, dtype=torch.uint8)}, layout_of({"x": torch.zeros(total, dtype=torch.uint8)}))
        try:
            await t.read(ep["tcp"], region, version, 0, total, into, None, token=forged)
            return "served"
        except Unauthorized as err:
            return ["Unauthorized", str(err), bytes(into.views(0, total)[0]).count(0) == total]
        finally:
            await t.close()

    out["tcp_transport"] = run(via_transport())

    def side(address, op, fields):
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        s.send(msgpack.packb({**fields, "op": op, "id": 1}, use_bin_type=True))
        if not s.poll(10000):
            reply = None
        else:
            reply = msgpack.unpackb(s.recv(), raw=False)
        s.close(0)
        ctx.term()
        return reply

    for name, op, extra in (("local", "describe", {"ipc": False}), ("nixl", "describe", {}),
                            ("rdma_copy", "stage", {"offset": 0, "length": 4096, "generation": None, "metadata": True})):
        if name in ep:
            out[name] = [side(ep[name]["side"], op, {"region": region, "version": version, **extra, **tok})
                         for tok in ({}, {"token": junk}, {"token": forged})]
    print(json.dumps(out))
    """
)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_an_ungranted_process_gets_no_bytes_and_no_description_and_is_counted(inproc_server, handles):
    import tensorhub
    from tensorhub.transports.registry import get_transport

    srv = inproc_server
    names = ["tcp", "local"] + [n for n in ("nixl", "rdma_copy") if get_transport(n).probe().usable]
    h = tensorhub.open(model="actor", replica="trainer", server=srv.address, transports={n: {} for n in names})
    try:
        tensors = zeros_like_weights(0, 100)
        h.register(tensors)
        for k, v in weights(1, 0, 100).items():
            tensors[k].copy_(v)
        h.publish(1)
        wait_until(lambda: srv.checksums("actor", 1) is not None, 30, "the publisher's checksums")
        engine = h._engine
        # What readers are handed is what an attacker on the network could learn: no key in it.
        ep = srv._look(lambda t: next(s.endpoint for s in t.sessions.values() if s.replica.name == "trainer"))
        key = srv._look(lambda t: next(s.grant_key for s in t.sessions.values() if s.replica.name == "trainer"))
        assert m.GRANT_KEY not in ep and key is not None and len(key) == 32
        assert key not in json.dumps(ep).encode() and set(names) <= set(ep)
        total = h.buffers.total_bytes

        with structlog.testing.capture_logs() as logs:
            proc = subprocess.run([sys.executable, "-c", ATTACKER, json.dumps([ep, 1, total])], cwd=ROOT,
                                  capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])

        from tensorhub.transports import tcp

        refusal = tcp._RESP.pack(tcp.UNAUTHORIZED, 0, 0).hex()
        assert out["tcp_raw"] == [refusal] * 3  # 17 bytes of refusal, then the connection closed: no byte of the shard
        kind, message, untouched = out["tcp_transport"]
        assert kind == "Unauthorized" and "no valid grant token" in message and untouched
        sides = names[1:]  # each asked 3 times: no token, junk, a token sealed under another key
        for name in sides:
            assert len(out[name]) == 3
            for reply in out[name]:
                assert reply is not None and reply["ok"] is False and reply["code"] == "unauthorized", (name, reply)
                assert set(reply) == {"id", "ok", "code", "error"}, (name, reply)  # no regions, no md, no slot
        # Counted, every one: tcp raw 1 + 2, the transport's read one per stripe, the side channels 1 + 2 each.
        stripes = engine.refusals["forged"] - 2 - 2 * len(sides)
        assert stripes >= 1 and engine.refusals["no_token"] == 1 + len(sides)
        assert engine.refused_total == 3 + stripes + 3 * len(sides)
        lines = [e for e in logs if e["event"].startswith("data-plane request without a valid grant token refused")]
        assert [e["log_level"] for e in lines] == ["warning", "warning"]  # one per reason (no_token, forged)
        assert lines[0]["who"].startswith("tcp from 127.0.0.1:") and lines[0]["replica"] == "trainer"

        # Beside it, readers the server granted pull byte-exact, each over one transport.
        before = engine.refused_total
        for name in ("tcp", "local"):
            reader = handles(f"rollout-{name}", server=srv.address, scale=100, transports={name: {}})
            reader.call("register")
            assert reader.call("replicate", 1, 60.0) == 1
            assert reader.call("holds", 1) and reader.call("last_transports") == [name]
            reader.exit()
        assert engine.refused_total == before
        assert holds(tensors, 1, 0, 100)
    finally:
        h.close()


def test_grant_keys_are_fresh_per_slot():
    a, b = _Slot(1, 1, None, None, {}), _Slot(2, 2, None, None, {})  # type: ignore[arg-type]
    assert a.key != b.key and len(a.key) == 32
    assert torch.tensor(list(a.key)).unique().numel() > 8  # not a constant
