"""The ``tensorhub`` command line: ``server`` and ``demo`` (``python -m tensorhub`` too)."""

from __future__ import annotations

import argparse
import sys

from .errors import TensorHubError

__all__ = ["main"]


def _server(args: argparse.Namespace) -> int:
    from .actor import run
    from .log import configure
    from .server import ServerConfig, serve
    from .table import TableConfig

    configure(args.log_format, args.log_level)
    config = ServerConfig(
        bind=args.bind,
        table=TableConfig(
            heartbeat_interval=args.heartbeat_interval,
            heartbeat_timeout=args.heartbeat_timeout,
            drain_timeout=args.drain_timeout,
            pipeline=not args.no_pipeline,
            smart_skipping=not args.no_smart_skipping,
        ),
        seed=args.seed,
        idle_exit=args.idle_exit,
    )
    run(serve(config, ready=lambda address: print(f"tensorhub server listening on {address}", flush=True)))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _status(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from .admin import server_status

    status = server_status(args.server, args.timeout)
    print(json.dumps({k: v for k, v in dataclasses.asdict(status).items() if k != "req"}, indent=2))
    return 0


def _dag(args: argparse.Namespace) -> int:
    from scheduling.dag import render, summary, to_dot, to_json

    from .admin import replication_dag

    dag = replication_dag(args.server, args.model, args.version, args.timeout)
    if args.dot:
        with open(args.dot, "w") as f:
            f.write(to_dot(dag))
    if args.png:
        render(dag, args.png)
    if args.json or not (args.dot or args.png):
        text = to_json(dag)
        if args.json and args.json != "-":
            with open(args.json, "w") as f:
                f.write(text)
        else:
            print(text)
    else:
        print(summary(dag))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensorhub", description="Reference-oriented weight transfer for RL jobs.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("server", help="run a reference server")
    s.add_argument("--bind", default="tcp://127.0.0.1:5557", help="ZeroMQ address to bind (default: loopback)")
    s.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between client heartbeats")
    s.add_argument("--heartbeat-timeout", type=float, default=10.0, help="seconds of silence before a client is dead")
    s.add_argument("--drain-timeout", type=float, default=30.0, help="seconds an unpublish waits for readers")
    s.add_argument("--no-pipeline", action="store_true", help="only complete holders serve (no pipeline replication)")
    s.add_argument("--no-smart-skipping", action="store_true",
                   help="update() moves even while its datacenter is seeding the version across datacenters")
    s.add_argument("--idle-exit", type=float, default=None, help="exit after this many seconds with no session")
    s.add_argument("--seed", type=int, default=None, help="seed of the scheduling random source")
    s.add_argument("--log-format", choices=("console", "json"), default=None)
    s.add_argument("--log-level", default=None)
    s.set_defaults(func=_server)

    st = sub.add_parser("status", help="a running server's status (counts, bytes per link class, seeding)")
    st.add_argument("--server", required=True, help="the server's address, e.g. tcp://127.0.0.1:5557")
    st.add_argument("--timeout", type=float, default=5.0)
    st.set_defaults(func=_status)

    g = sub.add_parser("dag", help="the replication DAG of a version: who served whom (JSON, dot, PNG)")
    g.add_argument("--server", required=True, help="the server's address")
    g.add_argument("--model", required=True)
    g.add_argument("--version", type=int, required=True)
    g.add_argument("--json", default=None, help="write JSON here ('-': stdout; the default without --dot/--png)")
    g.add_argument("--dot", default=None, help="write graphviz dot here")
    g.add_argument("--png", default=None, help="draw a PNG here (needs graphviz's dot program)")
    g.add_argument("--timeout", type=float, default=5.0)
    g.set_defaults(func=_dag)

    d = sub.add_parser("demo", help="train a small model and replicate it to rollouts, on this machine")
    d.add_argument("--steps", type=int, default=8, help="training steps (versions published)")
    d.add_argument("--rollouts", type=int, default=3, help="rollout replicas")
    d.add_argument("--shards", type=int, default=2, help="shards per replica (processes)")
    d.add_argument("--width", type=int, default=512, help="model width (size of the weights)")
    d.add_argument("--layers", type=int, default=4, help="transformer layers")
    d.add_argument("--server", default=None, help="server address (default: the embedded server)")
    d.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    d.add_argument("--quiet", action="store_true", help="no live progress line")
    d.add_argument("--chaos", action="store_true", help="SIGKILL rollout replicas while it runs, and restart them")
    d.add_argument("--seed", type=int, default=None, help="the chaos schedule's seed (default 0)")
    d.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TensorHubError as err:
        print(f"tensorhub {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
