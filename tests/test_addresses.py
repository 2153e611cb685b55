"""The address rule (``tensorhub.transports.nic.choose_address``): which address a transport
binds and advertises, in order: its options, ``$TENSORHUB_ADVERTISE_HOST``, loopback for a
server on loopback, the interface that routes to the server, the default route's or the only
interface, loopback. No packet is sent by any of it (a route lookup is a UDP ``connect``)."""

from __future__ import annotations

import pytest

from tensorhub.runtime.actor import run
from tensorhub.tools.doctor import _addresses
from tensorhub.transports import nic
from tensorhub.transports.nic import ADVERTISE_ENV, choose_address
from tensorhub.transports.tcp import TcpTransport


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(ADVERTISE_ENV, raising=False)


def _pair(choice: nic.AddressChoice) -> tuple[str, str]:
    return choice.bind, choice.advertise


def test_options_win_then_the_environment(monkeypatch):
    assert _pair(choose_address("10.9.8.7", None, ["tcp://127.0.0.1:5557"])) == ("10.9.8.7", "10.9.8.7")
    assert _pair(choose_address("0.0.0.0", "10.1.1.1")) == ("0.0.0.0", "10.1.1.1")
    assert _pair(choose_address(None, "10.1.1.1")) == ("0.0.0.0", "10.1.1.1")  # may be behind NAT: bind all
    assert _pair(choose_address(None, "127.0.0.1")) == ("127.0.0.1", "127.0.0.1")
    monkeypatch.setenv(ADVERTISE_ENV, "10.2.2.2")
    got = choose_address(servers=["tcp://127.0.0.1:5557"])
    assert (got.bind, got.advertise) == ("0.0.0.0", "10.2.2.2") and ADVERTISE_ENV in got.rule
    assert choose_address("127.0.0.1", None).advertise == "127.0.0.1"  # options before the environment


@pytest.mark.parametrize("servers", [["tcp://127.0.0.1:5557"], ["tcp://localhost:1", "ipc:///tmp/x"], ["tcp://[::1]:7"]])
def test_a_server_on_loopback_keeps_the_job_on_loopback(servers):
    got = choose_address(servers=servers)
    assert (got.bind, got.advertise) == ("127.0.0.1", "127.0.0.1") and "on loopback" in got.rule


def test_otherwise_the_interface_that_routes_to_the_server(monkeypatch):
    asked = []
    monkeypatch.setattr(nic, "route_source", lambda host: asked.append(host) or "10.50.0.3")
    got = choose_address(servers=["tcp://127.0.0.1:1", "tcp://trainer-0:5557"])
    assert (got.bind, got.advertise) == ("10.50.0.3", "10.50.0.3") and asked == ["trainer-0"]
    assert "routes to the server trainer-0" in got.rule
    monkeypatch.setattr(nic, "route_source", lambda host: None)  # no route found (an IPv6 or unresolvable server)
    monkeypatch.setattr(nic, "default_route_interface", lambda: "eth7")
    monkeypatch.setattr(nic, "interface_address", lambda name: "10.60.0.1" if name == "eth7" else None)
    got = choose_address(servers=["tcp://[2001:db8::1]:5557"])
    assert got.advertise == "10.60.0.1" and "default route's interface eth7" in got.rule
    monkeypatch.setattr(nic, "default_route_interface", lambda: None)
    monkeypatch.setattr(nic, "host_interfaces", lambda: {"veth0": "10.70.0.2"})
    assert choose_address(servers=["tcp://[2001:db8::1]:5557"]).advertise == "10.70.0.2"
    monkeypatch.setattr(nic, "host_interfaces", lambda: {})
    got = choose_address(servers=["tcp://[2001:db8::1]:5557"])
    assert got.advertise == "127.0.0.1" and "unreachable from other hosts" in got.rule


def test_no_server_known_is_loopback_and_a_transport_uses_the_servers_it_is_given(monkeypatch):
    assert choose_address().advertise == "127.0.0.1" and "no server known" in choose_address().rule
    asked = []
    monkeypatch.setattr(nic, "route_source", lambda host: asked.append(host) or "127.0.0.1")

    async def main(servers: list[str] | None) -> str:
        t = TcpTransport({})
        if servers is not None:
            t.set_servers(servers)
        await t.start()
        try:
            return t.address_rule
        finally:
            await t.close()

    assert "no server known" in run(main(None))  # nothing process-wide: a transport not told knows none
    assert "routes to the server trainer-0" in run(main(["tcp://trainer-0:5557"])) and asked == ["trainer-0"]
    assert "no server known" in run(main(None))  # what another transport was given does not leak
    from tensorhub.transports.faults import wrap

    inner = TcpTransport({})
    wrapped = wrap(inner, [])
    wrapped.set_servers(("tcp://trainer-0:5557",))
    assert inner.servers == wrapped.servers == ("tcp://trainer-0:5557",)  # the inner one starts and advertises


@pytest.mark.integration  # a server process (about 2 s to start)
def test_the_runtime_gives_its_transports_the_handles_server_list():
    from tensorhub.handles.api import open_async

    from .procs import ServerProcess

    srv = ServerProcess()
    try:
        other = "tcp://127.0.0.1:9"  # a backup that does not answer: the client stays on the primary

        async def main() -> tuple[tuple[str, ...], str]:
            h = await open_async("m", "r", server=[srv.address, other], transports={"tcp": {}}, connect_timeout=30)
            try:
                assert h._engine is not None
                t = h._engine.transports["tcp"]
                return t.servers, t.address_rule
            finally:
                await h.close()

        servers, rule = run(main())
        assert servers == (srv.address, other) and "on loopback" in rule
    finally:
        assert srv.stop() == 0


def test_a_route_lookup_finds_this_hosts_loopback_source():
    assert nic.route_source("127.0.0.1") == "127.0.0.1"  # (the test asks no name of a resolver: no DNS traffic)


def test_tcp_binds_and_advertises_what_the_rule_says(monkeypatch):
    monkeypatch.setenv(ADVERTISE_ENV, "10.3.3.3")

    async def main() -> tuple:
        t = TcpTransport({})
        await t.start()
        try:
            return t.host, t.endpoint(), t.address_rule
        finally:
            await t.close()

    host, ep, rule = run(main())
    assert host == "0.0.0.0" and ep["host"] == "10.3.3.3" and ADVERTISE_ENV in rule


def test_doctor_shows_the_chosen_addresses(monkeypatch):
    ad = _addresses("tcp://127.0.0.1:5557")
    assert ad["cross_host"]["advertise"] == "127.0.0.1" and "on loopback" in ad["cross_host"]["rule"]
    assert ad["grant_tokens"]["tcp"] is True and ad["grant_tokens"]["memory"] is False
    monkeypatch.setenv(ADVERTISE_ENV, "10.4.4.4")
    assert _addresses("tcp://127.0.0.1:5557")["cross_host"]["advertise"] == "10.4.4.4"
