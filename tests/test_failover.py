"""Server failover end to end (DESIGN §5.5): real ``tensorhub server`` processes with short
heartbeats, shard handles in real worker processes, real SIGKILLs of the primary.

- a trainer and two rollouts on ``server="primary,backup"``: the primary dies; rollouts keep
  their weights and ``update()`` says "nothing newer" instead of raising; every handle moves to
  the backup and re-announces what it holds; the trainer publishes v2 there and the rollouts
  update to it, byte for byte;
- no server at all for a while: ``update()`` is False, ``list()``/``replicate()``/``publish()``
  raise ``ServerUnavailable``, the weights stay; a backup that starts later is found;
- a handle given only dead servers fails with ``ServerUnavailable`` within its bound;
- malformed ``server=`` values (argument or ``$TENSORHUB_SERVER``) are typed errors naming the
  bad entry.
"""

from __future__ import annotations

import socket
import time

import pytest
import structlog

import tensorhub
from tensorhub.core import errors as e
from tensorhub.core import messages as m
from tensorhub.core.wire import encode
from tensorhub.runtime.client import _HOLD_MOVE_S, ClientActor, _Incoming, _MoveBack

from .procs import RemoteError, ServerProcess, wait_until

pytestmark = pytest.mark.integration

#: Short heartbeats: a lost server is noticed in about two seconds. (A one-second timeout made
#: clients fail over from a healthy primary, and servers remove live replicas, on a machine whose
#: cores were all busy: processes there stand still for longer than that.)
FAST = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "2.0")
SLOWER = ("--heartbeat-timeout", "4.0")  # after FAST: a 2 s lease, for tests that need no takeover


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def servers():
    made: list[ServerProcess] = []

    def make(*extra: str) -> ServerProcess:
        s = ServerProcess(*FAST, *extra)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def kill(server: ServerProcess) -> None:
    server.proc.kill()  # SIGKILL: no goodbye to anyone
    server.proc.wait(10)


def until_moved(h, timeout: float = 15.0) -> dict:
    """Poll ``list()`` until the handle works again (it raises ServerUnavailable meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return h.call("list", timeout=timeout)
        except RemoteError as err:
            assert err.kind == "ServerUnavailable", err
            if time.monotonic() > deadline:
                raise AssertionError(f"the handle did not move to another server in {timeout} s") from err
            time.sleep(0.1)


def test_rollouts_survive_the_primary_and_move_to_the_backup(servers, handles):
    primary, backup = servers(), servers()
    addresses = f"{primary.address},{backup.address}"
    trainer = handles("trainer", server=addresses)
    rollouts = [handles(f"rollout-{i}", server=addresses) for i in range(2)]
    for h in (trainer, *rollouts):
        h.call("register")
        assert h.call("server_address") == primary.address
    trainer.call("fill", 1)
    trainer.call("publish", 1)
    for r in rollouts:
        assert r.call("replicate", "latest", 30.0) == 1
        assert r.call("holds", 1)

    t0 = time.monotonic()
    kill(primary)
    # Rollouts keep serving inference: update() is "nothing newer", never an error, and the
    # weights are the ones they had (whether the loss is noticed yet or not).
    for _ in range(3):
        for r in rollouts:
            assert r.call("update", "latest", timeout=10.0) is False
            assert r.call("holds", 1)
        time.sleep(0.2)

    # Every handle moves to the backup and re-announces what it holds: version 1 is available
    # there with all three holders, though the backup never saw it published.
    listing = {}
    for h in (trainer, *rollouts):
        listing = until_moved(h)
        assert h.call("server_address") == backup.address
    moved_in = time.monotonic() - t0
    assert moved_in < 20, f"moving took {moved_in:.1f} s"  # about 3 s idle; a bound only a hang exceeds
    assert listing == {1: ["rollout-0", "rollout-1", "trainer"]}

    # A new step on the backup: the rollouts get it byte for byte.
    trainer.call("unpublish")
    trainer.call("fill", 2)
    trainer.call("publish", 2)
    for r in rollouts:
        r.send("update", "latest", 30.0)
    assert [r.result() for r in rollouts] == [True, True]
    for r in rollouts:
        assert r.call("holds", 2)
        assert r.call("update", "latest") is False
    assert trainer.call("list") == {2: ["rollout-0", "rollout-1", "trainer"]}
    assert backup.alive()


def test_no_server_at_all_then_a_backup_comes_up(servers, handles):
    primary = servers()
    port = _free_port()  # the backup's address, with nobody there yet
    addresses = f"{primary.address},tcp://127.0.0.1:{port}"
    trainer = handles("trainer", server=addresses)
    rollout = handles("rollout", server=addresses)
    for h in (trainer, rollout):
        h.call("register")
    trainer.call("fill", 1)
    trainer.call("publish", 1)
    assert rollout.call("replicate", 1, 30.0) == 1

    kill(primary)
    # past the heartbeat timeout the loss is noticed, and no server answers
    wait_until(lambda: rollout.call("server_address") is None, 30, "the rollout noticing its server is gone")
    for _ in range(5):
        assert rollout.call("update", "latest", timeout=5.0) is False
        assert rollout.call("holds", 1)
    for cmd, args in (("list", ()), ("replicate", ("latest", 1.0)), ("publish", (1,))):
        h = trainer if cmd == "publish" else rollout
        with pytest.raises(RemoteError) as err:
            h.call(cmd, *args, timeout=5.0)
        assert err.value.kind == "ServerUnavailable", (cmd, err.value)
    trainer.call("fill", 2)  # the trainer trains on (its publish of v1 is still what it holds)
    assert rollout.call("holds", 1)

    backup = servers("--bind", f"tcp://127.0.0.1:{port}")
    for h in (trainer, rollout):
        until_moved(h)
        assert h.call("server_address") == backup.address
    assert rollout.call("list") == {1: ["rollout", "trainer"]}
    assert rollout.call("update", "latest") is False  # the backup knows nothing newer yet
    trainer.call("unpublish")
    trainer.call("publish", 2)
    assert rollout.call("update", "latest", 30.0) is True
    assert rollout.call("holds", 2)


def test_only_dead_servers_is_server_unavailable_within_the_bound():
    dead = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(2)]
    t0 = time.monotonic()
    with pytest.raises(e.ServerUnavailable) as err:
        tensorhub.open("actor", "rollout", server=dead, connect_timeout=1.0)
    assert time.monotonic() - t0 < 8  # about 2 s; the default connect_timeout (10 s) alone exceeds it
    assert "actor" in str(err.value) and "rollout" in str(err.value)


@pytest.mark.parametrize(
    "server, named",
    [
        ("", "no address"),
        ([], "no address"),
        ("tcp://127.0.0.1:5557,,tcp://127.0.0.1:5558", "entry 1 ('')"),
        ("tcp://127.0.0.1:5557,http://example.com", "entry 1 ('http://example.com')"),
        (["tcp://127.0.0.1:5557", 5558], "entry 1 (5558)"),
        (("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557"), "repeats"),
        (5557, "got int"),
        ({"tcp://127.0.0.1:5557": 1}, "got dict"),
    ],
)
def test_bad_server_values_are_invalid_arguments_naming_the_entry(server, named):
    with pytest.raises(e.InvalidArgument) as err:
        tensorhub.open("actor", "rollout", server=server)
    assert named in str(err.value)


def test_bad_server_list_in_the_environment_is_named(monkeypatch):
    monkeypatch.setenv("TENSORHUB_SERVER", "tcp://127.0.0.1:5557, nonsense")
    with pytest.raises(e.InvalidArgument) as err:
        tensorhub.open("actor", "rollout", connect_timeout=1.0)
    assert "$TENSORHUB_SERVER entry 1 ('nonsense')" in str(err.value)


def test_a_client_that_gives_up_says_so_and_keeps_the_weights(servers, handles):
    only = servers()
    trainer = handles("trainer", server=only.address)
    rollout = handles("rollout", server=only.address, env={"TENSORHUB_FAILOVER_TIMEOUT": "0.5"})
    for h in (trainer, rollout):
        h.call("register")
    trainer.call("fill", 1)
    trainer.call("publish", 1)
    assert rollout.call("replicate", 1, 30.0) == 1
    kill(only)
    deadline = time.monotonic() + 10
    while True:  # False while it looks for a server; then it gives up and says so
        try:
            assert rollout.call("update", "latest", timeout=5.0) is False
        except RemoteError as err:
            assert err.kind == "ServerUnavailable", err
            break
        assert time.monotonic() < deadline, "the client never gave up"
        time.sleep(0.1)
    assert rollout.call("holds", 1)
    with pytest.raises(RemoteError) as err:
        rollout.call("list")
    assert err.value.kind == "ServerUnavailable"


def test_model_parallel_replicas_move_together(servers, handles):
    primary, backup = servers(), servers()
    addresses = [primary.address, backup.address]  # the list form of server=
    trainer = [handles("trainer", server=addresses, num_shards=2, shard_idx=i) for i in range(2)]
    rollout = [handles("rollout", server=addresses, num_shards=2, shard_idx=i) for i in range(2)]
    for h in (*trainer, *rollout):
        h.call("register")
        h.call("fill", 1) if h in trainer else None
    for step, group in ((("publish", 1), trainer), (("replicate", "latest", 30.0), rollout)):
        for h in group:
            h.send(*step)
        [h.result() for h in group]
    kill(primary)
    for h in (*trainer, *rollout):
        until_moved(h)
    assert rollout[0].call("list", True) == {1: ["rollout", "trainer"]}  # a consistent list: a model-parallel call
    assert rollout[1].call("list", True) == {1: ["rollout", "trainer"]}
    for h in trainer:
        h.send("unpublish")
    [h.result() for h in trainer]
    for h in trainer:
        h.call("fill", 2)
        h.send("publish", 2)
    [h.result() for h in trainer]
    for h in rollout:
        h.send("update", "latest", 30.0)
    assert [h.result() for h in rollout] == [True, True]
    assert all(h.call("holds", 2) for h in rollout)


def test_a_pull_under_way_resumes_on_the_backup_from_what_it_verified(servers, handles):
    """The primary is SIGKILLed while a reader is a few reads into a slowed pull: the replicate
    call waits for the move, the reader re-announces its partial pull, and the backup grants it
    a source for the same version: it resumes from its verified ranges (far less than a second
    whole shard is pulled) and ends byte-exact."""
    from .test_integrity import MANY, SCALE, shard_bytes

    primary, backup = servers(), servers()
    addresses = f"{primary.address},{backup.address}"
    trainer = handles("trainer", server=addresses, scale=2 * SCALE, env=MANY)
    slow = [{"op": "delay", "seconds": 3.0, "after": 1, "times": 0}]  # every read but the first
    reader = handles("rollout", server=addresses, scale=2 * SCALE, env=MANY, transports={"tcp": {"faults": slow}})
    for h in (trainer, reader):
        h.call("register")
    trainer.call("fill", 1)
    trainer.call("publish", 1)
    reader.send("replicate", 1, 60.0)
    time.sleep(1.0)  # the first read (one of three checksum units) landed; the others are slowed
    kill(primary)
    assert reader.result(60.0) == 1
    assert reader.call("holds", 1)
    assert reader.call("server_address") == backup.address
    # Bytes landed under the pull's current grants (reads of the lost server's grant that were in
    # flight at the loss, verified against the checksums like any other, are not counted).
    pulled, total = reader.call("pulled"), shard_bytes(2 * SCALE)
    assert 0 < pulled < 1.2 * total, f"pulled {pulled} bytes for a {total}-byte shard"
    assert reader.call("last_sources") == ["trainer/0", "trainer/0"]  # one grant from each server, one pull


# ---- a primary and a backup that never decide together (issue 23) ---------------------------


def until_reigning(address: str, timeout: float = 15.0) -> None:
    """Wait until the server at ``address`` reigns: a primary does from its first lease reply
    (its first lease request goes out a fifth of a lease after it starts), and refuses calls
    before (a publish made at once was refused so in a clean-clone CI run)."""
    from tensorhub.tools.admin import cluster_state

    deadline = time.monotonic() + timeout
    while not any(r.end is None for r in cluster_state(address, timeout=5.0, keys=None).reigns):
        assert time.monotonic() < deadline, f"{address} did not begin to reign in {timeout} s"
        time.sleep(0.05)


def reigns_overlap(*addresses: str) -> list[str]:
    """Pairs of reigns of different servers that overlap in time (one monotonic clock: one
    machine), from each server's cluster state."""
    from tensorhub.tools.admin import cluster_state

    spans = [(a, r) for a in addresses for r in cluster_state(a, timeout=5.0, keys=None).reigns]
    now = time.monotonic()
    bad = []
    for i, (a, x) in enumerate(spans):
        for b, y in spans[i + 1:]:
            if a != b and x.start < (y.end if y.end is not None else now) and y.start < (x.end if x.end is not None else now):
                bad.append(f"{a} term {x.term} [{x.start:.2f}, {x.end}] and {b} term {y.term} [{y.start:.2f}, {y.end}]")
    return bad


def test_backup_takes_over_then_hands_back_to_the_returning_primary(servers, handles):
    """The backup decides only once the primary's lease ran out and a majority of the shards
    reached it; a primary started again at its address asks for the lease, the backup steps
    down and tells its clients, and they move back, with their data; the two never reign at
    the same time."""
    port = _free_port()
    # A lease of 2 s (SLOWER), not FAST's 1 s: at load 14-20 the primary stood still past 1 s and
    # stepped down at the first register ("0 of 2 voters"), which failed the call as the contract says.
    backup = servers("--role", "backup", *SLOWER)
    primary = servers("--role", "primary", "--peer", backup.address, "--bind", f"tcp://127.0.0.1:{port}", *SLOWER)
    addresses = f"{primary.address},{backup.address}"
    trainer = handles("trainer", server=addresses)
    rollouts = [handles(f"rollout-{i}", server=addresses) for i in range(2)]
    until_reigning(primary.address)
    for h in (trainer, *rollouts):
        h.call("register")
    trainer.call("fill", 1)
    trainer.call("publish", 1)
    for r in rollouts:
        assert r.call("replicate", "latest", 30.0) == 1
    # The backup learns who votes (the membership) from the primary's lease requests: now one as
    # soon as the slots change (before, the next of those a fifth of a lease apart: killed before
    # it, the primary left a backup that could never decide, in 2 clean-clone CI runs in a row).
    # Its cluster state says what it holds.
    from tensorhub.tools.admin import cluster_state

    wait_until(lambda: cluster_state(backup.address, timeout=5.0, keys=None).voters == 3, 10.0,
               "the backup to learn the three slots")  # fmt: skip

    kill(primary)
    for h in (trainer, *rollouts):
        until_moved(h)
        assert h.call("server_address") == backup.address
    trainer.call("unpublish")
    trainer.call("fill", 2)
    trainer.call("publish", 2)
    for r in rollouts:
        assert r.call("update", "latest", 30.0) is True
        assert r.call("holds", 2)

    again = servers("--role", "primary", "--peer", backup.address, "--bind", f"tcp://127.0.0.1:{port}", *SLOWER)
    deadline = time.monotonic() + 20
    while any(h.call("server_address") != again.address for h in (trainer, *rollouts)):
        assert time.monotonic() < deadline, "the clients did not move back to the primary"
        time.sleep(0.1)
    listing: dict = {}
    for h in (trainer, *rollouts):
        listing = until_moved(h)
    assert listing == {2: ["rollout-0", "rollout-1", "trainer"]}
    trainer.call("unpublish")
    trainer.call("fill", 3)
    trainer.call("publish", 3)
    for r in rollouts:
        assert r.call("update", "latest", 30.0) is True
        assert r.call("holds", 3)
    assert reigns_overlap(again.address, backup.address) == []


def test_a_server_restarted_at_once_at_its_address_is_moved_to_not_taken_as_removal(handles):
    """The server comes back on the same address faster than the silence that would say it was
    lost (a supervisor's restart; Ray restarting its actor): the first heartbeat answer comes from
    a new term that knows none of the sessions. The handles move to it and re-announce, rather
    than taking "unknown session" as their removal."""
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    slow = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "10")  # silence would take 10 s to notice
    first = ServerProcess(*slow, "--bind", address)
    second = None
    try:
        trainer = handles("trainer", server=address)
        rollout = handles("rollout", server=address)
        for h in (trainer, rollout):
            h.call("register")
        trainer.call("fill", 1)
        trainer.call("publish", 1)
        assert rollout.call("replicate", 1, 30.0) == 1
        kill(first)
        second = ServerProcess(*slow, "--bind", address)
        for h in (trainer, rollout):
            until_moved(h, timeout=8.0)  # well inside the 10 s silence
        # both re-announce version 1 (each once it moved: the second may still be on its way)
        wait_until(lambda: rollout.call("list") == {1: ["rollout", "trainer"]}, 10, "both to re-announce version 1")
        trainer.call("fill", 2)
        trainer.call("unpublish")
        trainer.call("publish", 2)
        assert rollout.call("update", "latest", 30.0) is True
        assert rollout.call("holds", 2)
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_a_primary_and_its_backup_stop_at_once_on_sigterm():
    """A primary holds a socket to its backup for the lease: stopping closes it too, so the
    process exits on SIGTERM at once (it used to wait forever in the ZeroMQ context's term)."""
    import signal

    backup = ServerProcess(*FAST, "--role", "backup")
    primary = ServerProcess(*FAST, "--role", "primary", "--peer", backup.address, "--bind", f"tcp://127.0.0.1:{_free_port()}")
    try:
        time.sleep(0.5)  # a few lease requests on the way
        for s in (primary, backup):
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.wait(5) == 0
    finally:
        for s in (primary, backup):
            if s.proc.poll() is None:
                s.proc.kill()
            s.stop()


def test_update_on_a_server_that_does_not_reign_moves_to_the_one_that_does(servers, handles):
    """A rollout whose list names the backup first opens there, where nothing is decided while
    the primary holds the lease: its update() finds the reigning server and moves (issue 34: it
    raised ServerUnavailable)."""
    # A 2 s lease, as in the hands-back test: at load 19 the primary stepped down at the first
    # register ("0 of 1 voters") with FAST's 1 s.
    backup = servers("--role", "backup", *SLOWER)
    primary = servers("--role", "primary", "--peer", backup.address, *SLOWER)
    until_reigning(primary.address)
    trainer = handles("trainer", server=primary.address)
    rollout = handles("rollout-0", server=f"{backup.address},{primary.address}")
    for h in (trainer, rollout):
        h.call("register")
    trainer.call("fill", 1)
    trainer.call("publish", 1)
    assert rollout.call("update", "latest", 30.0) is True
    assert rollout.call("holds", 1)
    assert rollout.call("server_address") == primary.address


def _parked_client(calls: set[int]):
    """A client actor parked on a backup that does not decide (index 1), with ``calls`` in flight:
    only the fields the move-back path reads."""
    client = ClientActor.__new__(ClientActor)
    client.lost, client.reigning, client.stopped = None, False, False
    client.addresses, client.index = ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), 1
    client.address, client.sock = client.addresses[1], object()
    client.last_heard, client.sessions, client._remote, client._dead = time.monotonic(), {}, {}, {}
    client.pending = {req: (_Future(), None, None) for req in calls}
    client._calls, client._held_move = set(calls), None
    client.log = structlog.get_logger()
    moves: list[int | None] = []
    client._lose = lambda err, start=None: moves.append(start)  # type: ignore[method-assign]
    told: list = []
    client.tell = told.append  # type: ignore[method-assign]
    return client, moves, told


class _Future:
    def __init__(self):
        self.result = None

    def done(self):
        return self.result is not None

    def set_result(self, value):
        self.result = value

    def set_exception(self, err):
        self.result = err


def test_a_move_back_waits_for_the_calls_in_flight_to_be_answered():
    """Parked on a backup, a client that finds the primary moves back, which fails the calls in
    flight with ServerUnavailable: a `register` sent just before the move failed so at load 17.
    The move now waits for their answers (10 s at most)."""
    client, moves, told = _parked_client({7})
    client.on__MoveBack(_MoveBack(0))
    assert moves == [] and client._held_move is not None and client._held_move[0] == 0
    client.on__Incoming(_Incoming(client.sock, [encode(m.Ack(7))]))  # the register's answer
    assert client.pending == {} and told == [_MoveBack(0)]
    client.on__MoveBack(told.pop())
    assert moves == [0]

    # a call that is never answered holds the move no longer than _HOLD_MOVE_S
    client, moves, _ = _parked_client({9})
    client._held_move = (0, time.monotonic() - _HOLD_MOVE_S - 0.1)
    client.on__MoveBack(_MoveBack(0))
    assert moves == [0]

    # nothing in flight (heartbeats and reports are not calls): the move is at once
    client, moves, _ = _parked_client(set())
    client.pending[3] = (_Future(), None, None)
    client.on__MoveBack(_MoveBack(0))
    assert moves == [0]


# ---- the backup learns who votes as soon as the membership changes (issue 34) ---------------


def test_a_primary_ships_a_new_slot_to_its_backup_at_once_and_spaces_a_storm_of_them():
    """Real server actors (one loop thread), a 20 s lease: periodic lease requests 4 s apart.
    The primary asks its backup at once (not a fifth of a lease after it started) and ships a
    new session's slot a round trip after the open; a storm of opens is shipped in a few
    requests, each at least 0.1 s after the one before. The backup's cluster state says which
    membership it holds. (Before: the first request and the slot each waited for the 4 s tick.)"""
    import zmq

    from tensorhub.core.table import TableConfig
    from tensorhub.core.topology import Location
    from tensorhub.runtime.actor import LoopThread
    from tensorhub.runtime.server import ServerActor, ServerConfig
    from tensorhub.tools.admin import cluster_state, cluster_status
    from tensorhub.tools.status import render

    slow = TableConfig(heartbeat_interval=1.0, heartbeat_timeout=60.0)
    loop = LoopThread("test-lease")
    backup = ServerActor(ServerConfig(bind="tcp://127.0.0.1:*", role="backup", lease=20.0, table=slow))
    loop.run(backup.start())
    primary = ServerActor(ServerConfig(bind="tcp://127.0.0.1:*", role="primary", peer=backup.address, lease=20.0, table=slow))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        t0 = time.monotonic()
        loop.run(primary.start())
        wait_until(lambda: primary.reign.reigning, 2.0, "the primary to reign (its first lease request goes out at once)")
        state = cluster_state(backup.address, timeout=5.0, keys=None)
        assert (state.membership, state.voters) == (0, 0)  # synced with nothing to ship yet
        assert cluster_state(primary.address, timeout=5.0, keys=None).voters == 0
        sock.connect(primary.address)

        def open_slot(n: int) -> None:
            sock.send(encode(m.OpenShard(n, "actor", f"rollout-{n}", 1, 0, "i1", Location.default(), False, None)))

        open_slot(1)
        wait_until(lambda: cluster_state(backup.address, timeout=5.0, keys=None).voters == 1, 1.0,
                   "the backup to learn the new slot")  # fmt: skip
        assert time.monotonic() - t0 < 4.0  # well before the first periodic request
        assert cluster_state(backup.address, timeout=5.0, keys=None).membership == 1
        # ``tensorhub status --json`` says it too: the backup holds epoch 1's one voter and does
        # not reign (its primary holds the lease); the primary reigns, its backup's epoch acknowledged.
        doc = cluster_status(backup.address, timeout=5.0, keys=None)
        assert doc["membership"] == {"epoch": 1, "voters": 1} and doc["reigning"] is False and doc["reigns"] == []
        doc = cluster_status(primary.address, timeout=5.0, keys=None)
        assert doc["reigning"] is True and doc["membership"]["voters"] == 1
        assert [r["end"] for r in doc["reigns"]] == [None] and doc["reigns"][0]["term"] == primary.table.term
        assert "not reigning (0 reigns, 0 grants in them); membership epoch 1, 1 voters" in render(cluster_status(backup.address, timeout=5.0, keys=None))
        sent, start = primary._lease_req, time.monotonic()
        for n in range(2, 42):  # 40 opens over about 0.4 s
            open_slot(n)
            time.sleep(0.01)
        wait_until(lambda: backup.reign.voters and len(backup.reign.voters) == 41, 2.0, "the backup to learn all 41 slots")
        took = time.monotonic() - start
        requests = primary._lease_req - sent
        assert 1 <= requests <= took / 0.1 + 2, f"{requests} lease requests in {took:.2f} s"
        assert primary.reign.epoch == backup.reign.epoch or primary.reign.pending is not None
    finally:
        sock.close(0)
        ctx.term()
        loop.run(primary.stop())
        loop.run(backup.stop())
        loop.close()


def test_a_primary_killed_right_after_its_clients_opened_leaves_a_backup_that_takes_over(servers, handles):
    """The gap behind the hands-back test's flake (2 clean-clone CI runs): the backup learns
    the membership from the primary's lease requests; killed before it did, the primary left a
    backup that refused every call for ever ("no membership known yet"). Now the primary ships
    a new slot at once: the trainer opens, the primary is SIGKILLed as soon as the backup knows
    the trainer's slot (well before the next periodic lease request, 0.4 s apart), and the backup
    takes over: the trainer registers and publishes there, and a rollout replicates from it.
    (Killed within the shipping's own delay, a few ms to 0.1 s after the open returned, the
    primary still leaves a backup that knows no membership: an open is not held until the backup
    has acknowledged it. That window made this test fail about 1 run in 12 when it killed at once.)"""
    from tensorhub.tools.admin import cluster_state

    backup = servers("--role", "backup", *SLOWER)
    primary = servers("--role", "primary", "--peer", backup.address, *SLOWER)
    until_reigning(primary.address)
    rollout = handles("rollout-0", server=backup.address)  # opened first, on the backup
    trainer = handles("trainer", server=f"{primary.address},{backup.address}")
    opened = time.monotonic()
    deadline = opened + 10.0
    while (cluster_state(backup.address, timeout=5.0, keys=None).membership or 0) < 1:
        assert time.monotonic() < deadline, "the backup did not learn the trainer's slot in 10 s"
        time.sleep(0.005)
    learned = time.monotonic() - opened
    kill(primary)
    print(f"the backup knew the slot {learned:.3f} s after the open returned; killed {time.monotonic() - opened:.3f} s after it")
    until_moved(trainer)
    assert trainer.call("server_address") == backup.address
    trainer.call("register")
    trainer.call("fill", 1)
    trainer.call("publish", 1)
    rollout.call("register")
    assert rollout.call("replicate", "latest", 30.0) == 1
    assert rollout.call("holds", 1)
    state = cluster_state(backup.address, timeout=5.0, keys=None)
    assert state.membership is not None and state.membership >= 1 and state.voters == 1


# ---- a report refused while the server does not decide is sent again (issue 34) -------------


def test_a_report_refused_while_the_server_holds_is_sent_again_boundedly():
    """A holding primary refuses a reader's ``Complete`` (``ServerUnavailable``: it decides
    nothing until its backup answers). Lost, the grant would hang until revoked and the update
    could abort (server_load: 2,544 completions refused, 192 updates aborted); a version's
    ``DeclareChecksums`` refused so would never be declared. The client sends the report again
    every 0.25 s while it stays on that server, at most ``_REPORT_RETRIES`` times; not after
    another error, not once the server is lost or left."""
    import asyncio
    import itertools

    from tensorhub.core.errors import ServerUnavailable, UnknownGrant
    from tensorhub.runtime.client import _REPORT_RETRIES, _REPORT_RETRY_S, Send

    def stub():
        client = ClientActor.__new__(ClientActor)
        client.lost, client.stopped, client.address = None, False, "tcp://127.0.0.1:1"
        client.pending, client._req, client.log = {}, itertools.count(1), structlog.get_logger()
        sent: list = []
        later: list = []
        client._send = sent.append  # type: ignore[method-assign]
        client._outgoing = lambda msg: msg  # type: ignore[method-assign]
        client.after = lambda delay, msg: later.append((delay, msg))  # type: ignore[method-assign]
        return client, sent, later

    async def refuse(client, req: int, err: Exception) -> None:
        fut, _, _ = client.pending.pop(req)
        fut.set_exception(err)
        await asyncio.sleep(0)  # its done callbacks run

    holding = ServerUnavailable("this server does not decide now: it holds its sessions")

    async def main() -> None:
        client, sent, later = stub()
        client.on_Send(Send(lambda req: m.Complete(req, 5, 9, 1)))
        await refuse(client, 1, holding)
        ((delay, again),) = later
        assert delay == _REPORT_RETRY_S and again.refused == 1
        client.on_Send(again)
        assert [(type(x), x.req, x.grant) for x in sent] == [(m.Complete, 1, 9), (m.Complete, 2, 9)]
        client.pending.pop(2)[0].set_result(m.Ack(2))  # answered: nothing more
        await asyncio.sleep(0)
        assert len(later) == 1

        for change in ("lost", "moved", "other error", "bound"):
            client, sent, later = stub()
            send = Send(lambda req: m.DeclareChecksums(req, 5, 1, (1, 2)), refused=_REPORT_RETRIES if change == "bound" else 0)
            client.on_Send(send)
            if change == "lost":
                client.lost = ServerUnavailable("no word from the server")
            elif change == "moved":
                client.address = "tcp://127.0.0.1:2"
            await refuse(client, 1, UnknownGrant("no such grant") if change == "other error" else holding)
            assert later == [], change

    asyncio.run(main())
