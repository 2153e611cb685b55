"""``tensorhub doctor``: what this process would use, and why not the rest.

It answers the questions users of RDMA stacks ask first, without starting anything that lasts:

- **transports**: every built-in transport's probe (usable here? started by default? why not?
  what it checked: ptrace scope, NIXL import and version, RDMA devices, UCX settings), the
  plugins found in the ``tensorhub.transports`` entry-point group, and the set a handle opened
  with no ``transports=`` would start (``$TENSORHUB_TRANSPORTS`` overrides it);
- **edges**: the transport preference per edge kind (``$TENSORHUB_TRANSPORT_PREFERENCE``);
- **memory**: transparent and reserved huge pages (bulk copies and registrations are cheaper on
  them; the benchmark suite turns on torch's ``THP_MEM_ALLOC_ENABLE``);
- **server**: the address a handle would use (``--server``, ``$TENSORHUB_SERVER`` or the embedded
  default), whether a TensorHub server answers there now, and whether the embedded default is
  refused (a multi-node job);
- **CURVE**: whether client keys are configured and load, and whether the address would need
  them (a server refuses a non-loopback bind without keys unless ``--insecure``);
- **addresses**: where this process's transports would listen and what they would advertise to
  readers on other hosts, for that server (:func:`tensorhub.transports.nic.choose_address`:
  ``$TENSORHUB_ADVERTISE_HOST``, loopback for a server on loopback, else the interface that
  routes to the server), and which transports check grant tokens (the authenticated data plane).

:func:`diagnose` returns all of it as one JSON-able dict; :func:`render` prints it for people.
Nothing here raises for what it finds: a broken setting is reported as a finding.
"""

from __future__ import annotations

import asyncio
import os
import platform
import sys
from typing import Any

import tensorhub
from tensorhub.core.errors import InvalidArgument, TensorHubError

__all__ = ["diagnose", "render"]


def _transports() -> dict[str, Any]:
    from tensorhub.transports.registry import BUILTIN_ORDER, get_transport, probe_builtins, transport_names

    found: dict[str, Any] = {}
    for name, p in probe_builtins().items():
        found[name] = {"builtin": True, "usable": p.usable, "default": p.default, "reason": p.reason, "facts": dict(p.facts)}
    try:
        plugins = [n for n in transport_names() if n not in BUILTIN_ORDER]
    except InvalidArgument as err:  # a clash in the entry-point group
        plugins, found["(entry points)"] = [], {"builtin": False, "usable": False, "default": False, "reason": str(err), "facts": {}}
    for name in plugins:
        try:
            p = get_transport(name).probe()
            found[name] = {"builtin": False, "usable": p.usable, "default": False, "reason": p.reason, "facts": dict(p.facts)}
        except InvalidArgument as err:
            found[name] = {"builtin": False, "usable": False, "default": False, "reason": str(err), "facts": {}}
    env = os.environ.get("TENSORHUB_TRANSPORTS")
    if env is not None:
        named = [n.strip() for n in env.split(",") if n.strip()]
        started = [n for n in named if found.get(n, {}).get("usable")]
        why = f"$TENSORHUB_TRANSPORTS={env!r}" + (
            f" (not usable here, skipped: {', '.join(n for n in named if n not in started)})" if len(started) < len(named) else ""
        )
    else:
        started = [n for n, t in found.items() if t["default"]]
        why = "the built-ins whose probe says default (set $TENSORHUB_TRANSPORTS or transports= to choose)"
    return {"transports": found, "would_start": started, "would_start_why": why}


def _preference() -> dict[str, Any]:
    from tensorhub.scheduling.edges import parse_preference

    raw = os.environ.get("TENSORHUB_TRANSPORT_PREFERENCE", "")
    try:
        return {"preference": parse_preference(raw), "preference_source": "$TENSORHUB_TRANSPORT_PREFERENCE" if raw else "default"}
    except InvalidArgument as err:
        return {"preference": None, "preference_source": f"$TENSORHUB_TRANSPORT_PREFERENCE is invalid: {err}"}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _huge_pages() -> dict[str, Any]:
    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    selected = thp.split("[", 1)[1].split("]", 1)[0] if thp and "[" in thp else thp
    reserved = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key in ("HugePages_Total", "HugePages_Free", "Hugepagesize"):
            reserved[key] = value.strip()
    return {
        "transparent": selected or "unknown",
        "torch_thp_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", "unset"),
        **reserved,
        "note": (
            "torch allocations can use transparent huge pages (THP_MEM_ALLOC_ENABLE=1)"
            if selected in ("always", "madvise") else "transparent huge pages are off: bulk copies touch 4 KiB pages"
        ),
    }  # fmt: skip


async def _server_reachable(address: str, keys: Any, timeout: float) -> bool:
    import zmq.asyncio

    from tensorhub.runtime.embedded import probe

    ctx = zmq.asyncio.Context()
    try:
        for one in address.split(","):
            if await probe(ctx, one, timeout, keys):
                return True
        return False
    finally:
        ctx.term()


def _server(server: str | None, timeout: float) -> dict[str, Any]:
    from tensorhub.runtime.embedded import embedded_address, parse_servers
    from tensorhub.runtime.security import ENV_SECRET, ENV_SERVER_KEY, client_keys, is_loopback

    out: dict[str, Any] = {}
    env = os.environ.get("TENSORHUB_SERVER") or None
    try:
        if server is not None:
            addresses, source = parse_servers(server, "--server"), "--server"
        elif env is not None:
            addresses, source = parse_servers(env, "$TENSORHUB_SERVER"), "$TENSORHUB_SERVER"
        else:
            addresses, source = (embedded_address(),), "embedded default (started on first use if nobody answers)"
    except InvalidArgument as err:
        return {"address": None, "source": str(err), "reachable": False, "curve": {"configured": False}}
    out["address"], out["source"] = ",".join(addresses), source
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if source.startswith("embedded") and world and local and world.isdigit() and local.isdigit() and int(world) > int(local):
        out["source"] = f"refused: a multi-node job (WORLD_SIZE={world} > LOCAL_WORLD_SIZE={local}) needs $TENSORHUB_SERVER"
    curve: dict[str, Any] = {
        "server_key": os.environ.get(ENV_SERVER_KEY, "unset"),
        "client_secret": os.environ.get(ENV_SECRET, "unset"),
        "needed": not all(is_loopback(a) for a in addresses),
    }
    keys = None
    try:
        keys = client_keys()
        curve["configured"] = keys is not None
        curve["status"] = "keys load" if keys is not None else "no keys: plain connections"
    except TensorHubError as err:
        curve["configured"], curve["status"] = False, f"broken: {err}"
    if curve["needed"] and not curve["configured"]:
        curve["status"] += " (a non-loopback server refuses to bind without keys unless started with --insecure)"
    out["curve"] = curve
    try:
        out["reachable"] = asyncio.run(_server_reachable(out["address"], keys, timeout))
    except Exception as err:  # noqa: BLE001 - a finding, not a crash
        out["reachable"], out["error"] = False, f"{type(err).__name__}: {err}"
    return out


def _addresses(server: str | None) -> dict[str, Any]:
    from tensorhub.transports.nic import ADVERTISE_ENV, choose_address
    from tensorhub.transports.registry import BUILTIN_ORDER, get_transport

    servers = tuple(a for a in (server or "").split(",") if a)
    try:
        where = choose_address(servers=servers)
        cross: dict[str, str | None] = {"bind": where.bind, "advertise": where.advertise, "rule": where.rule}
    except TensorHubError as err:
        cross = {"bind": None, "advertise": None, "rule": f"broken: {err}"}
    checks = {}
    for name in BUILTIN_ORDER:
        try:
            checks[name] = bool(getattr(get_transport(name), "checks_grants", False))
        except InvalidArgument:
            continue
    return {
        "env": os.environ.get(ADVERTISE_ENV, "unset"),
        "cross_host": cross,  # tcp's listener, nixl's and rdma_copy's side channels (with no host/advertise option)
        "local": {"bind": "127.0.0.1", "advertise": "127.0.0.1", "rule": "same-host readers only (its side channel)"},
        "grant_tokens": checks,
    }


def diagnose(server: str | None = None, timeout: float = 0.5) -> dict[str, Any]:
    """Everything :mod:`tensorhub.tools.doctor` checks, as one JSON-able dict.

    Args:
        server: the address(es) to check instead of ``$TENSORHUB_SERVER`` / the embedded default.
        timeout: seconds to wait for the server to answer.
    """
    try:
        import torch

        torch_version: str = torch.__version__
        cuda = torch.cuda.is_available()
    except Exception as err:  # noqa: BLE001 - reported, not raised
        torch_version, cuda = f"not importable: {err}", False
    found = _server(server, timeout)
    return {
        "tensorhub": tensorhub.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch_version,
        "cuda": cuda,
        **_transports(),
        **_preference(),
        "huge_pages": _huge_pages(),
        "server": found,
        "addresses": _addresses(found.get("address")),
    }


def render(doc: dict[str, Any]) -> str:
    """The report for people: one block per area, a line per finding."""
    lines = [f"tensorhub {doc['tensorhub']}  python {doc['python']}  torch {doc['torch']}  cuda {'yes' if doc['cuda'] else 'no'}",
             f"  {doc['platform']}", "", "transports"]  # fmt: skip
    for name, t in doc["transports"].items():
        mark = "default" if t["default"] else ("usable" if t["usable"] else "unusable")
        kind = "" if t["builtin"] else " (plugin)"
        lines.append(f"  {name:<10} {mark:<9} {t['reason']}{kind}")
        lines += [f"  {'':<10} {'':<9} - {k}: {v}" for k, v in t["facts"].items()]
    lines.append(f"  a handle with no transports= starts: {', '.join(doc['would_start']) or 'nothing'}")
    lines.append(f"    ({doc['would_start_why']})")
    lines += ["", f"edge preference ({doc['preference_source']})"]
    for kind, names in (doc["preference"] or {}).items():
        lines.append(f"  {kind:<10} {', '.join(names)}")
    hp = doc["huge_pages"]
    lines += ["", "huge pages", f"  transparent: {hp['transparent']}  THP_MEM_ALLOC_ENABLE: {hp['torch_thp_alloc']}  "
              f"reserved: {hp.get('HugePages_Total', '?')} of {hp.get('Hugepagesize', '?')}", f"  {hp['note']}"]  # fmt: skip
    sv = doc["server"]
    lines += ["", "server", f"  address: {sv['address']}", f"  from: {sv['source']}",
              f"  answering now: {'yes' if sv['reachable'] else 'no'}" + (f" ({sv['error']})" if sv.get("error") else "")]  # fmt: skip
    cv = sv["curve"]
    if "status" in cv:
        lines += [f"  CURVE: {cv['status']}", f"    server key: {cv['server_key']}  client secret: {cv['client_secret']}",
                  f"    keys needed for this address: {'yes' if cv['needed'] else 'no (loopback)'}"]  # fmt: skip
    ad = doc.get("addresses")
    if ad:
        cross, local = ad["cross_host"], ad["local"]
        tokens = ", ".join(n for n, on in ad["grant_tokens"].items() if on) or "none"
        lines += ["", "data-plane addresses (transports with no host/advertise option)",
                  f"  tcp, nixl, rdma_copy: bind {cross['bind']}, advertise {cross['advertise']}",
                  f"    ({cross['rule']}; $TENSORHUB_ADVERTISE_HOST: {ad['env']})",
                  f"  local: bind {local['bind']}: {local['rule']}",
                  f"  grant tokens checked by: {tokens} (readers without a grant are refused)"]  # fmt: skip
    return "\n".join(lines)
