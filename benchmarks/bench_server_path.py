"""CPU time per heartbeat through the server actor's message path, without the socket.

Workload: ``--sessions`` sessions (one shard each, each on its own connection) open in a
``ServerActor``; each round hands it one heartbeat frame per session, as its socket reader does
(answered as they are read, ``_answer_beats``; a checkout without it: one batch to the
mailbox), and times them: decode, metrics, the table, encoding and sending the ack (to a
socket that takes the bytes and does nothing). ``--rounds`` rounds, one core, CPU time.
Baseline: with ``--against DIR``, the same workload on another checkout (e.g. the previous
commit's ``git worktree``), its rounds alternating with this tree's, each in a fresh process;
without it, decoding the same frames alone in the same run.
Goal: none fixed: issue 34's budget is the server's whole message mix in one core at 4,096
sessions, which ``benchmarks/server_load.py`` measures; this isolates the heartbeat's share.

``--backup`` makes the server a primary with a backup (holding its lease): each heartbeat is a
vote, echoing the stamp of the server's last answer, as a client's is.

A figure that no other load on the machine moves: ``--instructions`` hands one round of
heartbeats (after a first one) inside ``itertools.starmap``, so that valgrind counts that round
alone; divide by the heartbeats it prints::

    valgrind --tool=callgrind --toggle-collect=starmap_next --callgrind-out-file=/dev/null \\
        python benchmarks/bench_server_path.py --instructions [--backup] [--tree DIR]

Usage: python benchmarks/bench_server_path.py [--sessions N] [--rounds R] [--backup] [--against DIR | --tree DIR] [--instructions]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
_TREE = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv[:-1] else None
if _TREE is not None:  # measure that checkout's tensorhub (first on the path), with this workload
    sys.path.insert(0, _TREE)
sys.path.insert(1 if _TREE is not None else 0, str(ROOT))

from benchmarks.harness import median, ratio  # noqa: E402


class _Socket:
    """Takes what the server sends and drops it (the socket is not what is measured)."""

    def send(self, data: object, flags: int = 0) -> None:
        pass

    def getsockopt(self, option: int) -> int:
        return 0  # nothing waiting to be read

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[bytes]:
        import zmq

        raise zmq.Again()  # nothing waiting (the server looks for heartbeats between a batch's frames)


def _server(sessions: int, backup: bool) -> tuple[Any, Callable[[list[Any]], None], list[Any], list[bytes]]:
    """A server actor with ``sessions`` open sessions on a socket stand-in, the path a heartbeat
    read from the socket takes, one heartbeat frame per session (echoing the server's stamp
    with ``backup``), and those frames alone."""
    from tensorhub.core import messages as m
    from tensorhub.core import wire
    from tensorhub.core.topology import Location
    from tensorhub.runtime.server import ServerActor, ServerConfig, _Batch, _Frames

    if backup:  # a primary holding its backup's lease (no socket to it: the lease is set here)
        server = ServerActor(ServerConfig(bind="tcp://127.0.0.1:0", role="primary", peer="tcp://127.0.0.1:9"))
        server.table.reign.lease_until = float("inf")
        server.table.tick()  # begins its reign
        if not server.table.reign.reigning:
            raise SystemExit("the primary does not reign with its lease held")
    else:
        server = ServerActor(ServerConfig(bind="tcp://127.0.0.1:0"))
    server._raw = _Socket()  # type: ignore[assignment]  # a stand-in that only takes bytes
    server.loop = asyncio.new_event_loop()
    peers = [b"peer-%d" % i for i in range(sessions)]
    sids = []
    for i, peer in enumerate(peers):
        opened = m.OpenShard(1, "actor", f"rollout-{i}", 1, 0, "n1", Location("dc0", f"host-{i // 8}", ""), False, None)
        out = server.table.handle(peer, opened)
        sids.append(out[0][1].session)
    frames = [wire.encode(m.Heartbeat(7, (sid,), 0.0, 0)) for sid in sids]
    batch = [_Frames(peer, [f], None, 0.0) for peer, f in zip(peers, frames)]
    # the path a heartbeat read from the socket takes: answered as it is read where the server
    # does that (``_answer_beats``), else handed to the mailbox as a batch (older checkouts)
    answer = getattr(server, "_answer_beats", None)
    path = answer if answer is not None else (lambda frames: server.on__Batch(_Batch(frames)))
    path(batch)  # warm: every schema compiled, every session seen (with a backup: their arrivals)
    if backup:  # from now on each heartbeat echoes a stamp of this server's: a vote that refreshes
        stamp, term = time.monotonic(), server.table.term
        frames = [wire.encode(m.Heartbeat(7, (sid,), stamp, term)) for sid in sids]
        batch = [_Frames(peer, [f], None, 0.0) for peer, f in zip(peers, frames)]
        path(batch)
    return server, path, batch, frames


#: the burst's message kinds (``--path``), in the order a burst sends them
BURST_PATHS = ("update", "progress", "complete")


def _burst(sessions: int, backup: bool) -> tuple[Any, dict[str, list[Any]]]:
    """A server actor on a socket stand-in holding a version's burst, as ``server_load.py`` sends
    it: ``sessions`` shards (replicas of 8, the trainer's first) opened and registered with a
    1 GiB layout, the trainer's version 1 published with its checksums. Returns the server and
    a function per kind that builds its frames from the table's state: ``update`` (every rollout
    shard's ``update("latest")``: each gets its grant), ``progress`` (one report per active
    grant) and ``complete`` (each active grant's completion)."""
    from benchmarks.server_load import SHARDS, layout
    from tensorhub.core import messages as m
    from tensorhub.core import wire
    from tensorhub.core.topology import Location
    from tensorhub.runtime.server import _Frames

    server, _, _, _ = _server(0, backup)
    table = server.table
    lay = layout()
    checksums = tuple(range(1, lay.checksum_count() + 1))
    shards = []  # (peer, session id, replica)
    for i in range(max(2, sessions // SHARDS)):
        replica = "trainer" if i == 0 else f"rollout-{i}"
        for k in range(SHARDS):
            peer = b"peer-%d-%d" % (i, k)
            loc = Location("dc0", f"host-{i}", "")
            (_, opened), *_ = table.handle(peer, m.OpenShard(1, "actor", replica, SHARDS, k, "n1", loc, False, 1 if i == 0 else None))
            table.handle(peer, m.Register(2, opened.session, lay, {"tcp": {"host": "127.0.0.1", "port": 1}}, bytes(32)))
            shards.append((peer, opened.session, replica))
    for peer, sid, replica in shards:
        if replica == "trainer":
            table.handle(peer, m.Publish(3, sid, 1, 1, None))
    for peer, sid, replica in shards:
        if replica == "trainer":
            table.handle(peer, m.DeclareChecksums(4, sid, 1, checksums))
    peer_of = {sid: peer for peer, sid, _ in shards}

    def frames(kind: str, step: int = 1) -> list[Any]:
        if kind == "update":
            msgs = [(peer, m.Update(5, sid, 1, "latest", 60.0)) for peer, sid, r in shards if r != "trainer"]
        else:
            grants = [table.grants[g] for g in sorted(table.grants)]
            if kind == "progress":  # an eighth of the shard verified per report
                msgs = [(peer_of[g.reader.session.id], m.Progress(6 + step, g.reader.session.id, g.id, table.term,
                                                                  min(lay.total_bytes, (lay.total_bytes >> 3) * step)))
                        for g in grants]  # fmt: skip
            else:
                msgs = [(peer_of[g.reader.session.id], m.Complete(20, g.reader.session.id, g.id, table.term)) for g in grants]
        return [_Frames(peer, [wire.encode(msg)], None, 0.0) for peer, msg in msgs]

    return server, {"frames": [frames]}


def burst_round(server: Any, frames: list[Any]) -> None:
    """Hand ``frames`` to the server actor as its socket reader does: batches of ``_BATCH``."""
    from tensorhub.runtime.server import _BATCH, _Batch

    for i in range(0, len(frames), _BATCH):
        part = frames[i:i + _BATCH]
        server._queued += len(part)
        server.on__Batch(_Batch(part))


def burst_instructions(sessions: int, backup: bool, path: str) -> int:
    """The burst up to ``path``'s messages outside, those inside ``itertools.starmap`` (what
    callgrind counts); returns how many."""
    server, made = _burst(sessions, backup)
    build = made["frames"][0]
    counted = 0
    for kind in BURST_PATHS:
        frames = build(kind)
        if kind == path:
            import gc

            gc.collect()  # the setup's garbage is not counted, and the collector's phase is the same
            gc.freeze()  # for both trees: only this round's own objects are looked at by its passes
            list(itertools.starmap(burst_round, [(server, frames)]))
            counted = len(frames)
            break
        burst_round(server, frames)
    _check_burst(server, path)
    server.loop.close()
    return counted


def _check_burst(server: Any, upto: str) -> None:
    table = server.table
    rollouts = sum(1 for s in table.sessions.values() if s.replica.name != "trainer")
    if table.stats["expired"] or table.stats["revoked"]:
        raise SystemExit("sessions expired or grants were revoked while measuring")
    if upto in ("update", "progress") and len(table.grants) != rollouts:
        raise SystemExit(f"{len(table.grants)} active grants for {rollouts} rollout shards")
    if upto == "complete" and table.grants:
        raise SystemExit(f"{len(table.grants)} grants still active after every completion")


def measure_burst(sessions: int, rounds: int, backup: bool = False) -> dict[str, list[float]]:
    """``rounds`` bursts in this process, each on a fresh server: CPU microseconds per message
    of each kind (an update with the grant it gets; a progress report; a completion)."""
    out: dict[str, list[float]] = {k: [] for k in BURST_PATHS}
    for _ in range(rounds):
        server, made = _burst(sessions, backup)
        build = made["frames"][0]
        for kind in BURST_PATHS:
            frames = build(kind)
            c0 = time.process_time()
            burst_round(server, frames)
            out[kind].append((time.process_time() - c0) / len(frames) * 1e6)
            _check_burst(server, kind)
        server.loop.close()
    return out


def measure(sessions: int, rounds: int, backup: bool = False) -> dict[str, list[float]]:
    """``rounds`` batches in this process: CPU microseconds per heartbeat, and per decode alone."""
    from tensorhub.core import wire

    server, path, batch, frames = _server(sessions, backup)
    out: dict[str, list[float]] = {"heartbeat": [], "decode alone": []}
    for _ in range(rounds):
        c0 = time.process_time()
        path(batch)
        out["heartbeat"].append((time.process_time() - c0) / sessions * 1e6)
        c0 = time.process_time()
        for f in frames:
            wire.decode(f)
        out["decode alone"].append((time.process_time() - c0) / sessions * 1e6)
    _check(server, sessions, backup)
    server.loop.close()
    return out


def _check(server: Any, sessions: int, backup: bool) -> None:
    if server.table.stats["expired"] or len(server.table.sessions) != sessions:
        raise SystemExit("sessions were lost while measuring")
    if backup and len(server.table.reign.votes) != sessions:
        raise SystemExit(f"{len(server.table.reign.votes)} votes recorded for {sessions} sessions")


def instructions(sessions: int, backup: bool) -> int:
    """One round of heartbeats inside ``itertools.starmap`` (what callgrind counts); returns
    how many."""
    server, path, batch, _ = _server(sessions, backup)
    list(itertools.starmap(path, [(batch,)]))
    _check(server, sessions, backup)
    server.loop.close()
    return len(batch)


def _child(root: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    from benchmarks.harness.processes import in_checkout  # here: the child imports the other tree's harness

    figures: dict[str, list[float]] = in_checkout(Path(__file__).resolve(), root, [
        "--sessions", str(args.sessions), "--rounds", "3" if args.path == "heartbeat" else "1", "--path", args.path,
        *(["--backup"] if args.backup else [])], timeout=600)  # fmt: skip
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--against", type=Path, help="another checkout to measure, alternating with this one")
    ap.add_argument("--tree", type=Path, help="measure this checkout's tensorhub instead of this tree's")
    ap.add_argument("--backup", action="store_true", help="a primary with its backup: heartbeats are votes")
    ap.add_argument("--instructions", action="store_true", help="one round in itertools.starmap, for valgrind")
    ap.add_argument("--path", choices=("heartbeat", "burst", *BURST_PATHS), default="heartbeat",
                    help="heartbeats (the default), or a version's burst: every kind (burst) or one")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.sessions < 1 or args.rounds < 1:
        ap.error("--sessions and --rounds must be >= 1")
    if args.instructions and args.path != "heartbeat":
        if args.path == "burst":
            ap.error("--instructions counts one kind: --path update, progress or complete")
        n = burst_instructions(args.sessions, args.backup, args.path)
        where = Path(sys.modules["tensorhub"].__file__ or "?").parents[1]
        print(f"one burst's {n} {args.path} messages through {where}'s server actor"
              f"{' (a primary with a backup)' if args.backup else ''} (divide callgrind's Collected by it)")  # fmt: skip
        return 0
    if args.instructions:
        n = instructions(args.sessions, args.backup)
        where = Path(sys.modules["tensorhub"].__file__ or "?").parents[1]
        print(f"one round of {n} heartbeats through {where}'s server actor"
              f"{' (a primary with a backup)' if args.backup else ''} (divide callgrind's Collected by it)")  # fmt: skip
        return 0
    burst = args.path != "heartbeat"
    run = measure_burst if burst else measure
    if args.child:
        print(json.dumps(run(args.sessions, args.rounds, args.backup)))
        return 0
    if args.against is not None and not (args.against / "tensorhub" / "runtime" / "server.py").is_file():
        ap.error(f"--against {args.against}: not a checkout of this project (no tensorhub/runtime/server.py)")
    if args.against is None:
        trees = {"this tree": run(args.sessions, args.rounds, args.backup)}
    else:
        trees = {"this tree": {}, "against": {}}
        for _ in range(args.rounds):  # alternating, so that a busy spell hits both alike
            for tree, root in (("this tree", ROOT), ("against", args.against.resolve())):
                for label, xs in _child(root, args).items():
                    trees[tree].setdefault(label, []).extend(xs)
    what = "a version's burst (every rollout shard's update, a progress report per grant, each completion)" if burst \
        else "one heartbeat frame each per batch"
    print(f"server actor{' (a primary with a backup)' if args.backup else ''}, {args.sessions} sessions, "
          f"{what}, CPU us per message (load average {os.getloadavg()[0]:.1f})")  # fmt: skip
    for tree, figures in trees.items():
        for label, xs in figures.items():
            print(f"{tree:<10} {label:<14} best {min(xs):6.1f}  median {median(xs):6.1f}")
    new = trees["this tree"]
    if burst:
        if "against" in trees:
            old = trees["against"]
            for kind in BURST_PATHS:
                print(f"this tree against {args.against} (best rounds): {kind} {ratio(min(old[kind]), min(new[kind])):.2f}x cheaper")
        return 0
    print(f"a heartbeat costs {ratio(min(new['heartbeat']), min(new['decode alone'])):.1f}x decoding its frame alone")
    if "against" in trees:
        old = trees["against"]
        print(f"this tree against {args.against} (best rounds): a heartbeat {ratio(min(old['heartbeat']), min(new['heartbeat'])):.2f}x cheaper")
    return 0


if __name__ == "__main__":
    sys.exit(main())
