"""The ``tensorhub`` command line: ``server``, ``status``, ``dag``, ``trace``, ``keygen``, ``sim``, ``demo``,
``doctor``, and ``export`` / ``import`` of anchor and delta files (``python -m tensorhub`` too)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from tensorhub.core.errors import InvalidArgument, TensorHubError

__all__ = ["main"]


def _server(args: argparse.Namespace) -> int:
    from tensorhub.core.log import configure
    from tensorhub.core.table import TableConfig
    from tensorhub.runtime.actor import run
    from tensorhub.runtime.security import ModelPolicy, ServerKeys
    from tensorhub.runtime.server import ServerConfig, serve

    configure(args.log_format, args.log_level)
    if (args.curve_secret is None) != (args.curve_clients is None):
        raise InvalidArgument("CURVE needs both --curve-secret (the server's .key_secret) and --curve-clients (allowed keys)")
    keys = ServerKeys.load(args.curve_secret, args.curve_clients) if args.curve_secret else None
    if args.model_policy is not None and keys is None:
        raise InvalidArgument("--model-policy needs CURVE (--curve-secret and --curve-clients): it names client keys")
    policy = ModelPolicy.load(args.model_policy, args.curve_clients) if args.model_policy is not None else None
    config = ServerConfig(
        bind=args.bind,
        table=TableConfig(
            heartbeat_interval=args.heartbeat_interval,
            heartbeat_timeout=args.heartbeat_timeout,
            drain_timeout=args.drain_timeout,
            pin_timeout=args.pin_timeout,
            grant_ttl=args.grant_ttl,
            straggler_window=args.straggler_window,
            straggler_ratio=args.straggler_ratio,
            pipeline=not args.no_pipeline,
            smart_skipping=not args.no_smart_skipping,
        ),
        seed=args.seed,
        idle_exit=args.idle_exit,
        keys=keys,
        insecure=args.insecure or os.environ.get("TENSORHUB_INSECURE", "") == "1",
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        role=args.role,
        peer=args.peer,
        lease=args.lease,
        policy=policy,
    )
    run(serve(
        config,
        ready=lambda address: print(f"tensorhub server listening on {address}", flush=True),
        metrics_ready=lambda port: print(f"tensorhub metrics on http://{args.metrics_host}:{port}/metrics", flush=True),
        gc_mode=args.gc,
    ))  # fmt: skip
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _client_keys(args: argparse.Namespace) -> Any:
    from tensorhub.runtime.security import client_keys

    return client_keys(getattr(args, "server_key", None), getattr(args, "client_key", None))


def _address(args: argparse.Namespace) -> str:
    """The server an operations command talks to: ``--server``, else ``$TENSORHUB_SERVER`` (its
    first address), else the embedded default's address: where a handle would find it (nothing
    is started)."""
    from tensorhub.runtime.embedded import embedded_address, parse_servers

    if args.server:
        return str(parse_servers(args.server, "--server")[0])
    env = os.environ.get("TENSORHUB_SERVER")
    if env:
        return str(parse_servers(env, "$TENSORHUB_SERVER")[0])
    return str(embedded_address())


def _status(args: argparse.Namespace) -> int:
    import json
    import time

    from .admin import cluster_status
    from .status import render

    args.server = _address(args)
    keys = _client_keys(args)
    as_json = args.json or (not args.watch and not sys.stdout.isatty())
    rounds = args.count if args.count is not None else (None if args.watch else 1)
    n = 0
    while rounds is None or n < rounds:
        doc = cluster_status(args.server, args.timeout, keys)
        if as_json:
            print(json.dumps(doc, indent=None if args.watch else 2), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")
            print(render(doc, args.server), flush=True)
        n += 1
        if rounds is not None and n >= rounds:
            break
        time.sleep(args.interval)
    return 0


def _trace(args: argparse.Namespace) -> int:
    from .admin import transfer_trace
    from .trace import write_chrome_trace

    args.server = _address(args)
    trace = transfer_trace(args.server, args.model, args.version, args.timeout, _client_keys(args))
    doc = write_chrome_trace(trace, args.out)
    print(f"{args.out}: {len(trace.spans)} transfer spans, {len(trace.edges)} grants of {args.model} v{args.version} "
          f"({len(doc['traceEvents'])} events; open in ui.perfetto.dev or chrome://tracing)")  # fmt: skip
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from tensorhub.runtime.security import keygen

    public, secret = keygen(args.dir, args.name)
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def _dag(args: argparse.Namespace) -> int:
    from tensorhub.scheduling.dag import summary, to_dot, to_json
    from tensorhub.tools.graphviz import render

    from .admin import replication_dag

    args.server = _address(args)
    dag = replication_dag(args.server, args.model, args.version, args.timeout, _client_keys(args))
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


def _doctor(args: argparse.Namespace) -> int:
    import json

    from .doctor import diagnose, render

    doc = diagnose(args.server, args.timeout)
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0


def _sim(args: argparse.Namespace) -> int:
    from tensorhub.sim.cli import main as sim_main

    return sim_main(args.sim_args)


def _key_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server-key", default=None, metavar="FILE|KEY",
                   help="the server's CURVE public key (.key file or Z85); also $TENSORHUB_CURVE_SERVER_KEY")
    p.add_argument("--client-key", default=None, metavar="FILE",
                   help="this client's CURVE secret key (.key_secret file); also $TENSORHUB_CURVE_SECRET")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensorhub", description="Reference-oriented weight transfer for RL jobs.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("server", help="run a reference server")
    s.add_argument("--bind", default="tcp://127.0.0.1:5557", help="ZeroMQ address to bind (default: loopback)")
    s.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between client heartbeats")
    s.add_argument("--heartbeat-timeout", type=float, default=10.0, help="seconds of silence before a client is dead")
    s.add_argument("--straggler-window", type=float, default=5.0,
                   help="seconds of progress a grant is judged on (stragglers: a slow source's readers move)")
    s.add_argument("--straggler-ratio", type=float, default=0.25,
                   help="a source below this fraction of the reference rate is slow (0: never move readers)")
    s.add_argument("--role", choices=("solo", "primary", "backup"), default="solo",
                   help="with a backup server: primary (needs --peer) or backup; solo: a server alone")
    s.add_argument("--peer", default=None, help="the primary's backup server address (it asks it for the lease)")
    s.add_argument("--gc", choices=("paced", "watched"), default="paced",
                   help="paced (default): freeze the server's long-lived objects out of the garbage collector's passes; "
                        "watched: CPython's collector as it is (both report their passes in the metrics)")
    s.add_argument("--lease", type=float, default=None, help="lease and vote lifetime in seconds (default: heartbeat timeout / 2)")
    s.add_argument("--drain-timeout", type=float, default=30.0, help="seconds an unpublish waits for readers")
    s.add_argument("--pin-timeout", type=float, default=300.0,
                   help="seconds a replicate/update in flight keeps the version it decided (its pin)")
    s.add_argument("--grant-ttl", type=float, default=3600.0,
                   help="seconds a grant's data-plane token stays valid at the holder")
    s.add_argument("--no-pipeline", action="store_true", help="only complete holders serve (no pipeline replication)")
    s.add_argument("--no-smart-skipping", action="store_true",
                   help="update() moves even while its datacenter is seeding the version across datacenters")
    s.add_argument("--idle-exit", type=float, default=None, help="exit after this many seconds with no session")
    s.add_argument("--seed", type=int, default=None, help="seed of the scheduling random source")
    s.add_argument("--log-format", choices=("console", "json"), default=None,
                   help="console lines (default) or JSON lines; also $TENSORHUB_LOG_FORMAT")
    s.add_argument("--log-level", default=None, help="debug, info (default), warning...; also $TENSORHUB_LOG_LEVEL")
    s.add_argument("--curve-secret", default=None, metavar="FILE",
                   help="the server's CURVE secret key (a .key_secret file from tensorhub keygen): require authentication")
    s.add_argument("--curve-clients", default=None, metavar="DIR|FILE",
                   help="the client public keys let in: a directory of .key files, or one file")
    s.add_argument("--model-policy", default=None, metavar="FILE",
                   help="a TOML file of rules: model name patterns -> the client keys that may publish / read them (CURVE only)")
    s.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --bind without CURVE keys (anyone who reaches the port is trusted)")
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (0: any free port)")
    s.add_argument("--metrics-host", default="127.0.0.1", help="the address the metrics endpoint binds (default loopback)")
    s.set_defaults(func=_server)

    st = sub.add_parser("status", help="a running server's state: models, versions, replicas, grants, rates")
    st.add_argument("--server", default=None,
                    help="the server's address, e.g. tcp://127.0.0.1:5557 (default: $TENSORHUB_SERVER, else the embedded default's)")
    st.add_argument("--json", action="store_true", help="JSON for scripts (also the default when stdout is not a terminal)")
    st.add_argument("--watch", action="store_true", help="refresh every --interval seconds (JSON: one document a line)")
    st.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    st.add_argument("--count", type=int, default=None, help="stop after this many refreshes")
    st.add_argument("--timeout", type=float, default=5.0)
    _key_args(st)
    st.set_defaults(func=_status)

    tr = sub.add_parser("trace", help="a version's replication as a Chrome trace / Perfetto JSON file")
    tr.add_argument("--server", default=None, help="the server's address (default: $TENSORHUB_SERVER, else the embedded default's)")
    tr.add_argument("--model", required=True)
    tr.add_argument("--version", type=int, required=True)
    tr.add_argument("--out", required=True, help="the JSON file to write")
    tr.add_argument("--timeout", type=float, default=5.0)
    _key_args(tr)
    tr.set_defaults(func=_trace)

    kg = sub.add_parser("keygen", help="make a CURVE key pair: DIR/NAME.key (public) and DIR/NAME.key_secret")
    kg.add_argument("--dir", default=".", help="where to write the key files")
    kg.add_argument("--name", required=True, help="the key's name (e.g. server, trainer)")
    kg.set_defaults(func=_keygen)

    g = sub.add_parser("dag", help="the replication DAG of a version: who served whom (JSON, dot, PNG)")
    g.add_argument("--server", default=None, help="the server's address (default: $TENSORHUB_SERVER, else the embedded default's)")
    g.add_argument("--model", required=True)
    g.add_argument("--version", type=int, required=True)
    g.add_argument("--json", default=None, help="write JSON here ('-': stdout; the default without --dot/--png)")
    g.add_argument("--dot", default=None, help="write graphviz dot here")
    g.add_argument("--png", default=None, help="draw a PNG here (needs graphviz's dot program)")
    g.add_argument("--timeout", type=float, default=5.0)
    _key_args(g)
    g.set_defaults(func=_dag)

    sm = sub.add_parser("sim", help="the simulator: the paper's experiments at scale (tensorhub sim --help)", add_help=False)
    sm.add_argument("sim_args", nargs=argparse.REMAINDER)
    sm.set_defaults(func=_sim)

    dr = sub.add_parser("doctor", help="which transports this process can use and why not, the server, CURVE, huge pages")
    dr.add_argument("--server", default=None, help="check this address instead of $TENSORHUB_SERVER / the embedded default")
    dr.add_argument("--json", action="store_true", help="the findings as JSON")
    dr.add_argument("--timeout", type=float, default=0.5, help="seconds to wait for the server to answer")
    dr.set_defaults(func=_doctor)

    d = sub.add_parser("demo", help="train a small model and replicate it to rollouts, on this machine")
    d.add_argument("--steps", type=int, default=8, help="training steps (versions published)")
    d.add_argument("--rollouts", type=int, default=3, help="rollout replicas")
    d.add_argument("--shards", type=int, default=2, help="shards per replica (processes)")
    d.add_argument("--width", type=int, default=512, help="model width (size of the weights)")
    d.add_argument("--layers", type=int, default=4, help="transformer layers")
    d.add_argument("--server", default=None, help="server address (default: the embedded server)")
    d.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    d.add_argument("--quiet", action="store_true", help="no live view: the per-step lines come at the end")
    d.add_argument("--chaos", action="store_true", help="SIGKILL rollout replicas while it runs, and restart them")
    d.add_argument("--seed", type=int, default=None, help="the chaos schedule's seed (default 0)")
    d.set_defaults(func=_demo)

    from .checkpoints import add_parsers as add_file_parsers

    add_file_parsers(sub)  # export, import
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sim"]:  # its own parser (argparse would take `sim --help` as the top level's)
        from tensorhub.sim.cli import main as sim_main

        return sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TensorHubError as err:
        print(f"tensorhub {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
