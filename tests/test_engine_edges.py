"""The engine's choice of a transport per (reader, holder) edge, and the log line of a
fallback (the policy itself is tested in test_edges.py)."""

from __future__ import annotations

import pytest
import structlog

from tensorhub.core import messages as m
from tensorhub.core.errors import TransportError
from tensorhub.core.topology import Location
from tensorhub.runtime.engine import EngineActor, _Slot
from tensorhub.transports.base import Transport

HERE = Location("dc1", "h1", "")


class Stub(Transport):
    """A started-looking transport that only answers ``reaches``."""

    def __init__(self, name: str, reaches: bool = True) -> None:
        super().__init__({})
        self.name = name  # type: ignore[misc]
        self._reaches = reaches

    def reaches(self, peer: dict) -> bool:
        return self._reaches


def _source(where: Location, offers: list[str]) -> m.SourceInfo:
    endpoint = {"region": 3, **{n: {"at": n} for n in offers}}
    return m.SourceInfo(session=1, replica="trainer", shard_idx=0, kind="live", complete=True, location=where, endpoint=endpoint)


def _engine(*transports: Stub) -> tuple[EngineActor, _Slot]:
    engine = EngineActor({t.name: t for t in transports})
    slot = _Slot(1, 1, None, None, {"replica": "rollout"})  # type: ignore[arg-type]
    slot.location = HERE
    return engine, slot


@pytest.mark.parametrize(
    ("holder", "offers", "mine", "want"),
    [
        (HERE, ["tcp", "local", "nixl"], ["tcp", "nixl", "local"], "local"),
        (Location("dc1", "h2", ""), ["tcp", "local", "nixl"], ["tcp", "nixl", "local"], "nixl"),
        (Location("dc2", "h1", ""), ["tcp", "local", "nixl"], ["tcp", "nixl", "local"], "tcp"),
        (HERE, ["tcp", "nixl"], ["local", "tcp"], "tcp"),
    ],
)
def test_the_edge_picks_the_transport(holder, offers, mine, want):
    engine, slot = _engine(*(Stub(n) for n in mine))
    transport, peer, region = engine._pick(slot, _source(holder, offers))
    assert (transport.name, peer, region) == (want, {"at": want}, 3)


def test_a_transport_that_does_not_reach_is_passed_over():
    engine, slot = _engine(Stub("local", reaches=False), Stub("tcp"))
    assert engine._pick(slot, _source(HERE, ["local", "tcp"]))[0].name == "tcp"


def test_a_fallback_from_a_transport_one_side_has_is_a_warning_once():
    engine, slot = _engine(Stub("tcp"), Stub("nixl"))
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert engine._pick(slot, _source(Location("dc1", "h2", ""), ["tcp"]))[0].name == "tcp"
    assert len(logs) == 1 and logs[0]["log_level"] == "warning"
    assert "preferred transport 'nixl'" in logs[0]["event"] and "using 'tcp'" in logs[0]["event"]


def test_a_fallback_from_a_transport_nobody_started_is_only_info():
    engine, slot = _engine(Stub("tcp"))
    with structlog.testing.capture_logs() as logs:
        engine._pick(slot, _source(HERE, ["tcp"]))
    assert [e["log_level"] for e in logs] in ([], ["info"])  # info: shown only at that log level


def test_nothing_in_common_is_a_transport_error():
    engine, slot = _engine(Stub("tcp"))
    with pytest.raises(TransportError, match="nixl"):
        engine._pick(slot, _source(HERE, ["nixl"]))
    with pytest.raises(TransportError, match="names no region"):
        engine._pick(slot, m.SourceInfo(1, "t", 0, "live", True, HERE, {"tcp": {}}))
