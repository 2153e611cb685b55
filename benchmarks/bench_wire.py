"""CPU time per message of the control plane's wire format: decode, encode, and building a message.

Workload: the messages of the server's hot path (a burst: heartbeat, replicate, progress,
complete in; heartbeat ack, grant, ack, replicated out), ``--count`` of each per round,
``--rounds`` rounds, one core, CPU time of the process (not wall time: the machine may be shared).
Baseline: msgpack alone on the same frames (the floor under any validation), in the same run;
with ``--against DIR`` also the same measurement on another checkout (e.g. the previous commit's
``git worktree``), its rounds alternating with this tree's, each in a fresh process.
Goal: decode at least 2x cheaper than before the generated decoders (``--against`` a checkout of
main before issue 34b); none against the msgpack floor (validation costs something by design).

Each figure is nanoseconds of CPU per message, the best round and the median. What is timed:

- decode: ``wire.decode(frame)``, the frame's msgpack, its schema's checks and the message built;
- encode: ``wire.encode(msg)``;
- build: the message's constructor with its own checks (``__post_init__``), as the table and
  the clients make them;
- msgpack floor: ``msgpack.unpackb`` of the same frames and one reused ``msgpack.Packer`` packing
  their plain data, nothing checked or converted.

A figure that no other load on the machine moves: ``--instructions OP`` (decode, encode or
build) runs OP ``--count`` times over the mix inside ``itertools.starmap``, so that valgrind
counts those instructions alone; divide by the messages it prints::

    valgrind --tool=callgrind --toggle-collect=starmap_next --callgrind-out-file=/dev/null \\
        python benchmarks/bench_wire.py --instructions decode --count 1600 [--tree DIR]

Usage: python benchmarks/bench_wire.py [--count N] [--rounds R] [--against DIR | --tree DIR]
[--instructions OP] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_TREE = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv[:-1] else None
if _TREE is not None:  # measure that checkout's tensorhub (first on the path), with this workload
    sys.path.insert(0, _TREE)
sys.path.insert(1 if _TREE is not None else 0, str(ROOT))

from benchmarks.harness import median, meets, ratio, write_json  # noqa: E402

GOAL = 2.0  # decode at least this many times cheaper than the old path (when measured)
OPS = ("decode", "encode", "build", "msgpack unpackb", "msgpack pack")


def _messages() -> dict[str, tuple[type, tuple[object, ...]]]:
    """The hot path's messages: kind -> (class, constructor args). Imported here, inside the
    process that measures, so that ``--child ROOT`` measures ROOT's tensorhub."""
    from tensorhub.core import messages as m
    from tensorhub.core.topology import Location

    loc = Location("dc0", "host-17", "mlx5_0")
    src = m.SourceInfo(4242, "trainer", 1, "normal", True, loc, {"tcp": {"host": "10.0.0.17", "port": 31337}})
    return {
        "heartbeat": (m.Heartbeat, (1001, (4242,), 1234.5, 3)),
        "replicate": (m.Replicate, (1002, 4242, 7, "latest", None)),
        "progress": (m.Progress, (1003, 4242, 99, 3, 1 << 30)),
        "complete": (m.Complete, (1004, 4242, 99, 3)),
        "heartbeat_ack": (m.HeartbeatAck, (1001, (), 3, 1234.5, 5.0, True)),
        "grant": (m.Grant, (1002, 4242, 99, 3, 12, 1, src, tuple(range(16)), b"\x01" * 48)),
        "ack": (m.Ack, (1004,)),
        "replicated": (m.Replicated, (1002, 12)),
    }


def _cpu_ns(fn, items: list, repeat: int) -> float:  # type: ignore[no-untyped-def]
    """CPU nanoseconds per item of ``fn(item)`` over ``items``, ``repeat`` times over."""
    t0 = time.process_time_ns()
    for _ in range(repeat):
        for x in items:
            fn(x)
    return (time.process_time_ns() - t0) / (repeat * len(items))


def measure(count: int) -> dict[str, float]:
    """One round in this process: ns of CPU per message for each of :data:`OPS`, over the mix."""
    import msgpack

    from tensorhub.core import wire

    mix = _messages()
    msgs = [cls(*args) for cls, args in mix.values()]
    frames = [wire.encode(x) for x in msgs]
    for f, x in zip(frames, msgs):  # the round trip is exact (else nothing here is worth timing)
        if wire.decode(f) != x:
            raise SystemExit(f"round trip changed {x!r}")
    plain = [msgpack.unpackb(f, raw=False) for f in frames]
    builds = list(mix.values())
    repeat = max(1, count // len(msgs))
    return {
        "decode": _cpu_ns(wire.decode, frames, repeat),
        "encode": _cpu_ns(wire.encode, msgs, repeat),
        "build": _cpu_ns(lambda ca: ca[0](*ca[1]), builds, repeat),
        "msgpack unpackb": _cpu_ns(msgpack.unpackb, frames, repeat),
        "msgpack pack": _cpu_ns(msgpack.Packer(use_bin_type=True).pack, plain, repeat),
    }


def instructions(op: str, count: int) -> int:
    """Run ``op`` over the mix about ``count`` times, inside ``itertools.starmap`` (what
    callgrind's ``--toggle-collect=starmap_next`` counts); return the messages handled."""
    from tensorhub.core import wire

    mix = list(_messages().values())
    msgs = [cls(*args) for cls, args in mix]
    frames = [wire.encode(x) for x in msgs]
    for f in frames:
        wire.decode(f)  # every schema compiled before the count starts
    repeat = max(1, count // len(msgs))
    fn, items = {"decode": (wire.decode, frames), "encode": (wire.encode, msgs), "build": (lambda ca: ca[0](*ca[1]), mix)}[op]

    def burst() -> int:
        for _ in range(repeat):
            for x in items:
                fn(x)
        return repeat * len(items)

    (n,) = itertools.starmap(burst, [()])
    return n


def _child(root: Path, count: int) -> dict[str, float]:
    """One round in a fresh process, importing tensorhub from ``root``."""
    from benchmarks.harness.processes import in_checkout  # here: the child imports the other tree's harness

    figures: dict[str, float] = in_checkout(Path(__file__).resolve(), root, ["--count", str(count)], timeout=300)
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=40_000, help="messages timed per operation per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--against", type=Path, help="another checkout to measure, alternating with this one")
    ap.add_argument("--tree", type=Path, help="measure this checkout's tensorhub instead of this tree's")
    ap.add_argument("--instructions", choices=("decode", "encode", "build"), help="OP in itertools.starmap, for valgrind")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.count < 8 or args.rounds < 1:
        ap.error("--count must be >= 8 and --rounds >= 1")
    if args.instructions:
        n = instructions(args.instructions, args.count)
        import tensorhub

        print(f"{args.instructions} with {Path(tensorhub.__file__).parents[1]}'s tensorhub: {n} messages (divide callgrind's Collected by it)")
        return 0
    if args.child:
        print(json.dumps(measure(args.count)))
        return 0
    if args.against is not None and not (args.against / "tensorhub" / "core" / "wire.py").is_file():
        ap.error(f"--against {args.against}: not a checkout of this project (no tensorhub/core/wire.py)")

    trees = {"this tree": ROOT} | ({"against": args.against.resolve()} if args.against is not None else {})
    results: dict[str, dict[str, list[float]]] = {t: {op: [] for op in OPS} for t in trees}
    for _ in range(args.rounds):
        for tree, root in trees.items():  # alternating, so that a busy spell hits both alike
            for op, ns in _child(root, args.count).items():
                results[tree][op].append(ns)

    load = os.getloadavg()[0]
    print(f"wire format, CPU ns per message over the hot path's 8 kinds, {args.rounds} rounds of {args.count:,} each, "
          f"load average {load:.1f}")  # fmt: skip
    print(f"{'operation':<18} " + " ".join(f"{t + ' best':>16} {t + ' median':>18}" for t in trees))
    for op in OPS:
        cells = " ".join(f"{min(results[t][op]):>16,.0f} {median(results[t][op]):>18,.0f}" for t in trees)
        print(f"{op:<18} {cells}")
    new = results["this tree"]
    print(f"this tree against the msgpack floor (best rounds): decode {ratio(min(new['decode']), min(new['msgpack unpackb'])):.2f}x,"
          f" encode {ratio(min(new['encode']), min(new['msgpack pack'])):.2f}x the floor's cost")  # fmt: skip
    if "against" in results:
        old = results["against"]
        speed = {op: ratio(min(old[op]), min(new[op])) for op in ("decode", "encode", "build")}
        print("this tree against " + str(args.against) + " (best rounds, old/new): "
              + ", ".join(f"{op} {x:.2f}x cheaper" for op, x in speed.items()))  # fmt: skip
        print(f"goal: decode >= {GOAL:.0f}x cheaper -> {'met' if meets(speed['decode'], GOAL) else 'NOT met'}")
    else:
        print("goal: needs --against a checkout from before the change (not measured)")
    if args.json:
        write_json(args.json, {"rounds": results, "load": load})
    return 0


if __name__ == "__main__":
    sys.exit(main())
