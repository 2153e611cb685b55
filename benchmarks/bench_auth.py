"""What authenticating the data plane costs the bulk path: ``tcp`` pulls with grant tokens
against the same pulls without, in one run; and, for comparison, what encrypting the stream
would cost.

Workload: one holder process serving a ``--size-mib`` shard of 16 MiB tensors over ``tcp``; this
process pulls it whole, ``--rounds`` pairs of pulls; one loopback stream of ``--tls-mib`` MiB.
Baseline: the same pulls with no token check (``open``), paired and alternating in the same run;
for encryption, the same stream in plain TCP.
Goal: open time / tokens time >= 0.97 (median over the pairs).

One holder process (``spawn``) serves one shard (``--size-mib``, default 512, of 16 MiB
tensors) from two ``TcpTransport`` listeners over the same buffers:

- ``tokens``: guarded by a real :class:`~tensorhub.runtime.engine.EngineActor`'s ``admit`` (the
  production check: find the region's slot, HMAC-SHA256 the token, check version and expiry,
  under the engine's lock); the reader shows a grant token sealed with that slot's key, as the
  server would have sealed it;
- ``open``: no check installed; the reader sends no token.

This process pulls the whole shard the way the engine does (reads of 8 MiB, ``reads_in_flight``
of them at once, each striped over the transport's streams) into its own buffers, alternating
``open`` and ``tokens`` pulls (``--rounds`` pairs, after one warm-up pull each), and prints the
median throughput of each, and the median over the pairs of (open time / tokens time): the
headline ratio, since a pair's two pulls run back to back and drift cancels (goal: >= 0.97).
The first pull with tokens is checked byte-exact against the holder's content (xxh3-128).

``encryption``: one TCP stream over loopback moving ``--tls-mib`` MiB, plain and under TLS 1.3
(Python's ``ssl``, AES-GCM, a throwaway self-signed certificate made with the ``openssl``
command), in the same run: what an encrypted bulk path would cost per stream (skipped, saying
why, without the ``openssl`` command).

Usage: ``python benchmarks/bench_auth.py [--size-mib 512] [--rounds 41] [--tls-mib 512] [--json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import median  # noqa: E402

REGION, VERSION = 1, 7
CHUNK = 8 << 20
TENSOR = 16 << 20


def _tensors(size: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    n = max(1, size // TENSOR)
    return {f"w{i}": torch.randint(0, 256, (TENSOR,), dtype=torch.uint8, generator=g) for i in range(n)}


def _holder(conn: Any, size: int) -> None:
    """The holder process: two listeners over one shard; answers the key and ports, then waits."""
    import xxhash

    from tensorhub.runtime.actor import new_event_loop
    from tensorhub.runtime.engine import EngineActor, _Slot
    from tensorhub.transports.buffers import ShardBuffers, layout_of
    from tensorhub.transports.tcp import TcpTransport

    tensors = _tensors(size, 1)
    buffers = ShardBuffers(tensors, layout_of(tensors))
    buffers.progress.reset(VERSION, buffers.total_bytes)
    digest = xxhash.xxh3_128()
    for v in buffers.views(0, buffers.total_bytes):
        digest.update(v)
    loop = new_event_loop()
    guarded, open_ = TcpTransport({"host": "127.0.0.1"}), TcpTransport({"host": "127.0.0.1"})
    loop.run_until_complete(guarded.start())
    loop.run_until_complete(open_.start())
    engine = EngineActor({"tcp": guarded})  # serves and guards it: the production check
    slot = _Slot(1, REGION, buffers, None, {"replica": "bench-holder", "shard": 0})  # type: ignore[arg-type]
    engine.regions[REGION] = slot
    open_.serve(lambda region, version: buffers if (region, version) == (REGION, VERSION) else None)
    conn.send({"key": slot.key, "guarded": guarded.port, "open": open_.port, "total": buffers.total_bytes,
               "hash": digest.hexdigest()})  # fmt: skip
    conn.recv()  # until told to stop
    conn.send({"refused": engine.refused_total})
    loop.run_until_complete(guarded.close())
    loop.run_until_complete(open_.close())


async def _pull(reader: Any, port: int, into: Any, token: bytes | None) -> float:
    """One pull of the whole shard as the engine issues it; seconds."""
    total = into.total_bytes
    gate = asyncio.Semaphore(reader.reads_in_flight)
    peer = {"host": "127.0.0.1", "port": port}
    kw = {"token": token} if token is not None else {}

    async def one(offset: int) -> None:
        async with gate:
            await reader.read(peer, REGION, VERSION, offset, min(CHUNK, total - offset), into, None, **kw)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(o) for o in range(0, total, CHUNK)))
    return time.perf_counter() - t0


def bulk(size: int, rounds: int) -> dict[str, Any]:
    import xxhash

    from tensorhub.core.tokens import GrantToken
    from tensorhub.runtime.actor import run
    from tensorhub.transports.buffers import ShardBuffers, layout_of
    from tensorhub.transports.tcp import TcpTransport

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(child, size), daemon=True)
    proc.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the holder process did not start")
        info = parent.recv()
        token = GrantToken(term=1, grant=1, reader=2, version=VERSION, issued=0.0, ttl=3600.0).seal(info["key"])
        zeros = {k: v.zero_() for k, v in _tensors(size, 2).items()}
        into = ShardBuffers(zeros, layout_of(zeros))
        total = info["total"]

        async def main() -> dict[str, list[float]]:
            reader = TcpTransport({"host": "127.0.0.1"})
            await reader.start()
            times: dict[str, list[float]] = {"open": [], "tokens": []}
            try:
                await _pull(reader, info["open"], into, None)  # warm-up: connections, page faults
                await _pull(reader, info["guarded"], into, token)
                digest = xxhash.xxh3_128()
                for v in into.views(0, total):
                    digest.update(v)
                if digest.hexdigest() != info["hash"]:
                    raise RuntimeError("the pull with tokens did not land the holder's bytes")
                for r in range(rounds):
                    order = ("open", "tokens") if r % 2 == 0 else ("tokens", "open")
                    for mode in order:
                        port, tok = (info["open"], None) if mode == "open" else (info["guarded"], token)
                        times[mode].append(await _pull(reader, port, into, tok))
            finally:
                await reader.close()
            return times

        times = run(main())
        parent.send("stop")
        refused = parent.recv()["refused"] if parent.poll(30) else None
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    rate = {mode: total / median(ts) / 1e9 for mode, ts in times.items()}
    pairs = [o / t for o, t in zip(times["open"], times["tokens"])]
    return {
        "bytes": total,
        "rounds": rounds,
        "open_gbps": rate["open"],
        "tokens_gbps": rate["tokens"],
        "ratio": median(pairs),  # paired rounds, alternating: drift cancels
        "ratio_of_medians": rate["tokens"] / rate["open"],
        "pair_ratios": pairs,
        "refused": refused,
        "requests_per_pull": -(-total // CHUNK) * 4,
        "times": times,
    }


def admit_cost(n: int = 20000) -> float:
    """Microseconds one ``EngineActor.admit`` of a valid token takes (the holder's per-request cost)."""
    from tensorhub.core.tokens import GrantToken
    from tensorhub.runtime.engine import EngineActor, _Slot

    engine = EngineActor({})
    slot = _Slot(1, REGION, None, None, {})  # type: ignore[arg-type]
    engine.regions[REGION] = slot
    token = GrantToken(1, 1, 2, VERSION, 0.0, 3600.0).seal(slot.key)
    t0 = time.perf_counter()
    for _ in range(n):
        engine.admit(REGION, VERSION, token, "bench")
    return (time.perf_counter() - t0) / n * 1e6


def _tls_sender(port: int, certdir: str, nbytes: int, tls: bool) -> None:
    payload = memoryview(bytearray(os.urandom(1 << 20)) * 4)
    sock = socket.create_connection(("127.0.0.1", port))
    if tls:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=os.path.join(certdir, "cert.pem"))
        ctx.check_hostname = False
        sock = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
    sent = 0
    while sent < nbytes:
        n = min(len(payload), nbytes - sent)
        sock.sendall(payload[:n])
        sent += n
    sock.close()


def encryption(nbytes: int) -> dict[str, Any]:
    if shutil.which("openssl") is None:
        return {"skipped": "no openssl command to make a throwaway certificate"}
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-keyout", os.path.join(d, "key.pem"), "-out", os.path.join(d, "cert.pem")],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        out: dict[str, Any] = {"bytes": nbytes}
        ctx = multiprocessing.get_context("spawn")
        for tls in (False, True, False, True):
            lst = socket.socket()
            lst.bind(("127.0.0.1", 0))
            lst.listen(1)
            sender = ctx.Process(target=_tls_sender, args=(lst.getsockname()[1], d, nbytes, tls), daemon=True)
            sender.start()
            conn, _ = lst.accept()
            if tls:
                sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                sctx.load_cert_chain(os.path.join(d, "cert.pem"), os.path.join(d, "key.pem"))
                conn = sctx.wrap_socket(conn, server_side=True)
            buf = memoryview(bytearray(4 << 20))
            got, t0 = 0, time.perf_counter()
            while got < nbytes:
                k = conn.recv_into(buf)
                if not k:
                    break
                got += k
            dt = time.perf_counter() - t0
            conn.close()
            lst.close()
            sender.join(30)
            key = "tls_gbps" if tls else "plain_gbps"
            out[key] = max(out.get(key, 0.0), got / dt / 1e9)  # the better of two, each
            if tls:
                out["cipher"] = "TLS 1.3 " + (ssl.OPENSSL_VERSION.split()[1] if ssl.OPENSSL_VERSION else "")
        out["ratio"] = out["tls_gbps"] / out["plain_gbps"]
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--tls-mib", type=int, default=512)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    res = {"bulk": bulk(a.size_mib << 20, a.rounds), "admit_us": admit_cost(), "encryption": encryption(a.tls_mib << 20)}
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    b, e = res["bulk"], res["encryption"]
    print(f"tcp pull of {b['bytes'] / 2**20:.0f} MiB, holder and reader in two processes, {b['rounds']} rounds each, alternating")
    print(f"  open (no tokens)      {b['open_gbps']:6.2f} GB/s")
    print(f"  with grant tokens     {b['tokens_gbps']:6.2f} GB/s   (ratio of the medians {b['ratio_of_medians']:.3f})")
    print(f"  tokens / open, median of the paired rounds: {b['ratio']:.3f}  (goal >= 0.97)  "
          f"{'MET' if b['ratio'] >= 0.97 else 'MISSED'}")  # fmt: skip
    print(f"  each pair (open time / tokens time): {', '.join(f'{r:.3f}' for r in b['pair_ratios'])}")
    print(f"  one admit (HMAC check) on the holder: {res['admit_us']:.1f} us; about {b['requests_per_pull']} requests per pull")
    print(f"  refusals counted by the holder: {b['refused']}")
    if "skipped" in e:
        print(f"encryption: skipped ({e['skipped']})")
    else:
        print(f"one TCP stream of {e['bytes'] / 2**20:.0f} MiB over loopback: plain {e['plain_gbps']:.2f} GB/s, "
              f"{e['cipher']} {e['tls_gbps']:.2f} GB/s: encryption keeps {e['ratio']:.2f} of the stream's rate")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
