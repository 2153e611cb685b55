"""Cross-datacenter replication policy of the reference table (DESIGN §5.1, §5.6): the seeding
replica, smart skipping in ``update()``, offload seeding, bytes per link class, and the
invariants "at most one seeder and one offload seed per datacenter" under failures."""

from __future__ import annotations

import random

import pytest

from tensorhub.core import messages as m
from tensorhub.core.naming import seed_replica
from tensorhub.core.table import TableConfig
from tensorhub.scheduling.dag import summary

from .table_driver import Driver, complete_all
from .test_table import published


def _driver(**config) -> Driver:
    d = Driver(config=TableConfig(**config))
    d.advance(11)  # past the start-up grace period
    return d


def _answer(shard, req) -> m.Updated:
    r = shard.expect_ok(req)
    assert isinstance(r, m.Updated)
    return r


def test_same_datacenter_is_preferred_over_a_less_loaded_source():
    d = _driver(pipeline=False)  # complete holders only: near and the trainer
    published(d, dc="dc0")
    near = published(d, "near", dc="dc1")[0]
    busy = d.shard("busy", dc="dc1")
    busy.replicate(1)
    assert busy.grant().source.replica == "near"
    r = d.shard("r", dc="dc1")
    r.replicate(1)  # near serves one reader already, the trainer none: near still wins
    assert r.grant().source.replica == "near"
    assert near.session is not None


def test_fewest_grants_within_the_datacenter():
    d = _driver(pipeline=False)
    published(d, "a", dc="dc1")
    published(d, "b", dc="dc1")
    sources = []
    for k in range(4):
        r = d.shard(f"r{k}", dc="dc1")
        r.replicate(1)
        sources.append(r.grant().source.replica)
    assert sorted(sources) == ["a", "a", "b", "b"]  # each new reader goes to the less loaded one


def test_the_first_update_of_a_datacenter_seeds_and_the_others_skip_until_it_is_done():
    d = _driver()
    published(d, dc="dc0")
    r1, r2 = d.shard("r1", dc="dc1"), d.shard("r2", dc="dc1")
    req1 = r1.update()
    g1 = r1.grant()
    assert g1.source.replica == "trainer"  # across: r1 is dc1's seeder
    a = _answer(r2, r2.update())
    assert (a.moved, a.skipped, a.seed) == (False, 1, None)  # smart skipping: not behind the slow link
    status = d.table.seeding()
    assert [(s.version, s.datacenter, s.replicas) for s in status] == [(1, "dc1", ("r1",))]
    r1.progress(g1, 4096)
    assert _answer(r2, r2.update()).skipped == 1  # a partial copy in dc1 is still seeding
    r1.complete(g1)
    assert _answer(r1, req1).moved
    req2 = r2.update()
    g2 = r2.grant()
    assert g2.source.replica == "r1"  # now local
    r2.complete(g2)
    a = _answer(r2, req2)
    assert (a.moved, a.skipped, a.version) == (True, None, 1)
    assert d.table.stats["updates_skipped"] == 2
    assert list(d.table.seeding()) == []


def test_a_multi_shard_version_is_seeding_until_every_shard_is_whole_in_the_datacenter():
    d = _driver()
    published(d, num_shards=2, dc="dc0")
    s0, s1 = d.replica("r1", 2, dc="dc1")
    s0.update()
    s1.update()
    g0, g1 = s0.grant(), s1.grant()
    s0.complete(g0)  # shard 0 is whole in dc1, shard 1 is not
    o0, o1 = d.replica("r2", 2, dc="dc1")
    a0, a1 = _answer(o0, o0.update()), _answer(o1, o1.update())
    assert a0.skipped == a1.skipped == 1 and not a0.moved and not a1.moved  # one answer per replica
    s1.complete(g1)
    o0.update()
    o1.update()
    assert {g.source.replica for g in o0.grants() + o1.grants()} == {"r1"}


@pytest.mark.parametrize("config", [{"smart_skipping": False}, {"pipeline": False}])
def test_without_skipping_every_update_moves(config):
    d = _driver(**config)
    published(d, dc="dc0")
    r1, r2 = d.shard("r1", dc="dc1"), d.shard("r2", dc="dc1")
    r1.update()
    r2.update()
    g2 = r2.grant()
    assert g2.source.replica == ("r1" if config.get("pipeline", True) else "trainer")
    assert d.table.stats["updates_skipped"] == 0


def test_replicate_never_skips_it_pipelines_behind_the_seeder():
    d = _driver()
    published(d, dc="dc0")
    r1, r2 = d.shard("r1", dc="dc1"), d.shard("r2", dc="dc1")
    r1.update()
    r2.replicate(1)
    assert r2.grant().source.replica == "r1"


def test_a_datacenter_that_holds_the_version_does_not_skip():
    d = _driver()
    published(d, dc="dc0")
    r = d.shard("r", dc="dc0")
    req = r.update()
    r.complete(r.grant())
    assert _answer(r, req).moved


def _seed(d: Driver, owner: str, dc: str, version: int):
    """What the client does when told to seed: a spot replica of CPU copies replicates it."""
    s = d.shard(seed_replica(owner), dc=dc, host=f"{owner}-host", spot=True)
    req = s.replicate(version)
    return s, req


def test_offload_seeding_returns_at_once_and_a_later_update_takes_the_local_copy():
    d = _driver()
    published(d, dc="dc0")
    r1, r2 = d.shard("r1", dc="dc1"), d.shard("r2", dc="dc1")
    a = _answer(r1, r1.update(offload_seed=True))
    assert (a.moved, a.seed, a.skipped) == (False, 1, None)
    assert r1.grants() == []  # r1's own tensors are not touched
    a2 = _answer(r2, r2.update(offload_seed=True))
    assert (a2.seed, a2.skipped) == (None, 1)  # at most one offload seed per datacenter
    seed, sreq = _seed(d, "r1", "dc1", 1)
    gs = seed.grant()
    assert gs.source.replica == "trainer"
    assert [s.replicas for s in d.table.seeding()] == [("r1@seed",)]
    assert _answer(r1, r1.update(offload_seed=True)).skipped == 1  # its own seed is not done yet
    seed.complete(gs)
    seed.expect_ok(sreq)
    req1 = r1.update(offload_seed=True)
    g1 = r1.grant()
    assert g1.source.replica == "r1@seed"  # consumes its CPU copy (same host)
    r1.complete(g1)
    assert _answer(r1, req1).moved
    req2 = r2.update(offload_seed=True)
    g2 = r2.grant()
    assert g2.source.location.datacenter == "dc1"
    r2.complete(g2)
    assert _answer(r2, req2).moved
    assert d.table.stats["offload_seeds"] == 1
    # The seed retires gracefully: unpublished (spot: no offload first), then closed.
    seed.expect_ok(seed.unpublish())
    seed.expect_ok(seed.close())
    dag = d.table.replication_dag("actor", 1)
    total = d.table.sessions[r1.session].layout.total_bytes
    assert summary(dag)["bytes_by_link"] == {"host": total, "datacenter": total, "remote": total}
    assert d.table.bytes_by_link == summary(dag)["bytes_by_link"]


def test_an_offload_seed_that_never_shows_up_expires_and_the_datacenter_seeds_again():
    d = _driver()
    published(d, dc="dc0")
    r1, r2 = d.shard("r1", dc="dc1"), d.shard("r2", dc="dc1")
    assert _answer(r1, r1.update(offload_seed=True)).seed == 1
    assert _answer(r2, r2.update(offload_seed=True)).skipped == 1
    d.run_for(d.table.config.heartbeat_timeout + 1)  # r1 never opened its seed
    assert _answer(r2, r2.update(offload_seed=True)).seed == 1


def test_an_offload_seed_owner_that_dies_frees_the_datacenter_at_once():
    d = _driver()
    published(d, dc="dc0")
    r1, r2 = d.shard("r1", dc="dc1"), d.shard("r2", dc="dc1")
    assert _answer(r1, r1.update(offload_seed=True)).seed == 1
    r1.expect_ok(r1.close())
    assert _answer(r2, r2.update(offload_seed=True)).seed == 1


def test_a_seed_replica_never_offload_seeds_itself():
    d = _driver()
    published(d, dc="dc0")
    s = d.shard(seed_replica("r1"), dc="dc1", spot=True)
    req = s.update(offload_seed=True)
    assert s.grant().source.replica == "trainer"
    assert s.reply(req) is None


def test_bytes_are_accounted_per_link_class_and_reported_in_the_status():
    d = _driver()
    published(d, dc="dc0")
    rs = [d.shard(f"r{k}", dc="dc1") for k in range(3)]
    for r in rs:
        r.replicate(1)
    complete_all(rs)
    total = d.table.sessions[rs[0].session].layout.total_bytes
    status = d.send("admin", m.GetStatus(5))[-1][1]
    assert isinstance(status, m.ServerStatus)
    assert status.bytes_by_link == {"host": 0, "datacenter": 2 * total, "remote": total}
    dag = d.send("admin", m.GetDag(6, "actor", 1))[-1][1]
    assert isinstance(dag, m.Dag) and len(dag.edges) == 3
    assert summary(dag.as_dict())["bytes_by_link"] == status.bytes_by_link


# ---- invariants under random schedules ---------------------------------------------------------


def _seeders(d: Driver) -> dict[tuple[int, int, str], set[str]]:
    """(version, shard, datacenter) -> reader replicas pulling it across datacenters now, not
    counting readers that excluded a source (a source that failed them: crossing again is how
    they get around it)."""
    out: dict[tuple[int, int, str], set[str]] = {}
    for g in d.table.grants.values():
        r = g.reader
        dc = r.session.location.datacenter
        if dc != g.source.session.location.datacenter and not r.excluded:
            out.setdefault((r.version, r.shard_idx, dc), set()).add(r.replica.name)
    return out


def _offload_seeds(d: Driver) -> dict[tuple[int, str], set[str]]:
    out: dict[tuple[int, str], set[str]] = {}
    for h in d.table.holders():
        if h.replica.name.endswith("@seed"):
            out.setdefault((h.version, h.session.location.datacenter), set()).add(h.replica.name)
    return out


@pytest.mark.property
@pytest.mark.parametrize("run", range(12))
def test_at_most_one_seeder_and_one_offload_seed_per_datacenter_under_failures(seed, run):
    """Random schedules of updates (half with offload seeding), replicates, progress, completions,
    crashes and restarts of rollouts in two datacenters, and new versions from dc0; after every
    step at most one replica per (version, shard, datacenter) pulls across, and at most one
    offload seed per (version, datacenter) exists."""
    rng = random.Random(seed * 1000 + run)
    d = _driver()
    published(d, dc="dc0")
    version = 1
    names = [f"r{k}" for k in range(6)]
    live: dict[str, object] = {}
    incarnation = {n: 0 for n in names}
    pending: dict[str, int] = {}  # replica -> its update/replicate req
    seeds: dict[str, tuple[object, int]] = {}
    told: dict[str, int] = {}  # replica -> the version the server told it to offload-seed
    offload = {n: rng.random() < 0.5 for n in names}
    steps = []
    try:
        for step in range(300):
            op = rng.choice(["open", "update", "update", "update", "replicate", "grant", "grant", "grant", "crash",
                             "publish", "time", "seed"])  # fmt: skip
            n = rng.choice(sorted(told) if op == "seed" and told else names)
            steps.append((op, n))
            if op == "open" and n not in live:
                incarnation[n] += 1
                live[n] = d.shard(n, dc=rng.choice(["dc1", "dc2"]), incarnation=f"i{incarnation[n]}")
            elif op in ("update", "replicate") and n in live and n not in pending:
                s = live[n]
                pending[n] = s.update(offload_seed=offload[n]) if op == "update" else s.replicate("latest")
            elif op == "grant":
                shards = list(live.values()) + [s for s, _ in seeds.values()]
                rng.shuffle(shards)
                for s in shards:
                    gs = s.grants()
                    if gs:
                        g = gs[-1]
                        if rng.random() < 0.7:
                            s.complete(g)
                        else:
                            s.progress(g, 4096)
                        break
            elif op == "seed" and n in told and n in live:  # the client gets round to its seed
                old = seeds.pop(n, None)
                if old is not None and old[0].session in d.table.sessions:
                    old[0].expect_ok(old[0].close())
                seeds[n] = _seed(d, n, live[n].location.datacenter, told.pop(n))
            elif op == "crash" and n in live:
                told.pop(n, None)
                for s in (live.pop(n), seeds.pop(n, (None,))[0]):
                    if s is not None and s.session in d.table.sessions:
                        s.expect_ok(s.close())
                pending.pop(n, None)
            elif op == "publish":
                version += 1  # a new trainer replica each time: no drain to wait for
                published(d, f"trainer{version}", version, dc="dc0")
            elif op == "time":
                d.run_for(2.0)
            for name, req in list(pending.items()):  # answered calls; seeds the server asked for
                s = live[name]
                r = s.reply(req)
                if r is None:
                    continue
                del pending[name]
                if isinstance(r, m.Updated) and r.seed is not None:
                    told[name] = r.seed  # opened by a later "seed" step
            for key, replicas in _seeders(d).items():
                assert len(replicas) <= 1, f"two seeders of {key}: {replicas}"
            for key, replicas in _offload_seeds(d).items():
                assert len(replicas) <= 1, f"two offload seeds of {key}: {replicas}"
    except AssertionError:
        print(f"seed={seed} run={run} steps={steps}")
        raise


# ---- end to end: real server process, real handles, real TCP ------------------------------------


@pytest.mark.integration
def test_offload_seeding_end_to_end_with_a_real_server():
    """A trainer in dc0 and two rollouts in dc1, with offload seeding: the first update() of r1
    returns at once and seeds a CPU copy in the background; r2's update skips meanwhile; later
    updates take the local copy; one copy crosses datacenters; the seed is freed afterwards."""
    import asyncio
    import time

    import torch

    from tensorhub.core.topology import Location
    from tensorhub.handles.api import open_async
    from tensorhub.tools.admin import replication_dag, server_status

    from .procs import ServerProcess

    server = ServerProcess()
    addr = server.address

    async def until(fn, what: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = await fn()
            if got:
                return got
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    async def main() -> None:
        weights = {"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.arange(7, dtype=torch.int64)}
        t = await open_async("m", "trainer", server=addr, location=Location("dc0", "a1", ""))
        await t.register(weights)
        await t.publish(1)
        rs, held = [], []
        for name, host in (("r1", "b1"), ("r2", "b2")):
            h = await open_async("m", name, server=addr, location=Location("dc1", host, ""), offload_seeding=True)
            held.append({k: torch.zeros_like(v) for k, v in weights.items()})
            await h.register(held[-1])
            rs.append(h)
        r1, r2 = rs
        assert await r1.update() is False and r1.seeding == 1  # returns at once; seeds in the background
        assert await r2.update() is False and r2.skipped == 1 and r2.seeding is None
        await until(r1.update, "r1 to take its seed")
        assert r1.version == 1 and r1.last_pull.sources == ["r1@seed/0"]
        await until(r2.update, "r2 to move")
        for tensors in held:
            assert all(torch.equal(tensors[k], weights[k]) for k in weights)
        assert r2.last_pull.sources[0] in ("r1/0", "r1@seed/0")

        async def seed_freed() -> bool:
            return "r1@seed" not in (await t.list()).get(1, {})

        await until(seed_freed, "the consumed seed to be freed")
        status = server_status(addr)
        total = t.buffers.total_bytes
        assert status.bytes_by_link["remote"] == total  # one copy across, not one per rollout
        assert status.stats["offload_seeds"] == 1 and status.stats["updates_skipped"] >= 1
        dag = replication_dag(addr, "m", 1)
        assert {(e["reader"], e["source"]) for e in dag["edges"]} >= {("r1@seed", "trainer"), ("r1", "r1@seed")}
        for h in (*rs, t):
            await h.close()

    try:
        asyncio.run(main())
    finally:
        assert server.stop() == 0


def test_a_seed_and_its_owner_share_one_link_for_load():
    """The seed replica and its owner sit on one host: a reader of the seed loads the owner too,
    so the next reader goes to a holder on another host."""
    d = _driver(pipeline=False)
    published(d, dc="dc0")
    seed, sreq = _seed(d, "r1", "dc1", 1)
    seed.complete(seed.grant())
    seed.expect_ok(sreq)
    owner = d.shard("r1", dc="dc1", host="r1-host")
    owner.replicate(1)
    owner.complete(owner.grant())
    published(d, "x", dc="dc1")  # another host of dc1 holding v1
    for seed_of_rng in range(8):  # whichever of the three a takes, b goes to the other host
        picks = []
        for k in ("a", "b"):
            r = d.shard(f"{k}{seed_of_rng}", dc="dc1")
            r.replicate(1)
            picks.append(r.grant().source.replica)
        on_r1 = [p for p in picks if p in ("r1", "r1@seed")]
        assert len(on_r1) == 1 and "x" in picks, picks
        for k in ("a", "b"):
            s = d.shards[f"actor/{k}{seed_of_rng}/0/i1"]
            s.expect_ok(s.close())
