"""The replication DAG: the table's record of who served whom, and what tensorhub.scheduling.dag makes of
it (summary, link classes, JSON, dot)."""

from __future__ import annotations

import json

import pytest

from tensorhub.core.errors import InvalidArgument
from tensorhub.scheduling.dag import link_class, summary, to_dot, to_json
from tensorhub.tools.graphviz import render

from .table_driver import Driver
from .test_table import published


def _edge(reader, source, nbytes, outcome="completed", rdc="dc1", sdc="dc1", rhost="h1", shost="h2"):
    return {"reader": reader, "source": source, "reader_dc": rdc, "source_dc": sdc, "reader_host": rhost,
            "source_host": shost, "bytes": nbytes, "outcome": outcome}  # fmt: skip


def test_the_table_records_each_grant_with_its_bytes_and_outcome():
    d = Driver()
    d.advance(11)
    (t,) = published(d)
    a, b = d.shard("a"), d.shard("b")
    a.replicate(1)
    ga = a.grant()
    b.replicate(1)
    gb = b.grant()  # the partial holder a is the least loaded source: b pipelines from it
    assert gb.source.replica == "a"
    a.progress(ga, 1000)
    b.source_failed(gb, 400)  # a "dies" for b at 400 bytes; b is granted the trainer
    b.complete(b.grant())
    a.complete(ga)
    total = d.table.sessions[a.session].layout.total_bytes
    dag = d.table.replication_dag("actor", 1)
    got = [(e["reader"], e["source"], e["bytes"], e["outcome"], e["source_complete"]) for e in dag["edges"]]
    assert got == [("b", "a", 400, "failed", False), ("b", "trainer", total - 400, "completed", True), ("a", "trainer", total, "completed", True)]
    s = summary(dag)
    assert s["readers"]["b"] == {"sources": ["a", "trainer"], "bytes": total}
    assert s["grants"] == {"failed": 1, "completed": 2}
    assert d.table.replication_dag("actor", 2) == {"model": "actor", "version": 2, "edges": []}


def test_summary_counts_bytes_per_link_class_and_the_pipeline_depth():
    dag = {"edges": [
        _edge("a", "trainer", 100, sdc="dc0"),            # across datacenters: the seeder
        _edge("b", "a", 100, rhost="h3", shost="h3"),     # same host
        _edge("c", "b", 100),                             # same datacenter
        _edge("d", "b", 40, outcome="revoked"),
    ]}  # fmt: skip
    s = summary(dag)
    assert s["bytes_by_link"] == {"host": 100, "datacenter": 140, "remote": 100}
    assert s["pipeline_depth"] == 3  # trainer -> a -> b -> c
    assert [link_class(e) for e in dag["edges"]] == ["remote", "host", "datacenter", "datacenter"]
    parsed = json.loads(to_json(dag))
    assert parsed["summary"]["pipeline_depth"] == 3


def test_dot_clusters_datacenters_and_labels_bytes():
    dag = {"model": "actor", "version": 3, "edges": [_edge("a", "trainer", 2_500_000, sdc="dc0"), _edge("b", "a", 10, "failed")]}
    dot = to_dot(dag)
    assert dot.startswith('digraph "actor version 3" {')
    assert 'label="dc0"' in dot and 'label="dc1"' in dot
    assert '"trainer" -> "a" [label="2.5 MB"];' in dot
    assert '"a" -> "b" [label="0.0 MB", style=dashed];' in dot


@pytest.mark.parametrize("bad", [None, {}, {"edges": 3}, {"edges": [{"reader": "a"}]}])
def test_not_a_dag_is_invalid(bad):
    with pytest.raises(InvalidArgument):
        summary(bad)
    with pytest.raises(InvalidArgument):
        to_dot(bad)


def test_render_says_when_graphviz_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(InvalidArgument, match="'dot' program is not installed"):
        render({"edges": []}, str(tmp_path / "x.png"))


@pytest.mark.parametrize("readers", [2, 5])
def test_a_burst_of_readers_in_another_datacenter_crosses_the_slow_link_once(readers):
    """Readers in dc1 replicating at once: the first is granted the trainer in dc0 (the seeder);
    every other is granted a holder in dc1 (same datacenter first), so one copy crosses."""
    d = Driver()
    d.advance(11)
    published(d, dc="dc0")
    rs = [d.shard(f"r{k}", dc="dc1") for k in range(readers)]
    for r in rs:
        r.replicate(1)
    for _ in range(100):
        pending = [(r, g) for r in rs for g in r.grants()]
        if not pending:
            break
        for r, g in pending:
            r.complete(g)
    dag = d.table.replication_dag("actor", 1)
    remote = [e for e in dag["edges"] if link_class(e) == "remote"]
    assert len(remote) == 1 and remote[0]["source"] == "trainer"
    total = d.table.sessions[rs[0].session].layout.total_bytes
    assert summary(dag)["bytes_by_link"]["remote"] == total  # one copy of the shard, not one per reader


@pytest.mark.parametrize("pipeline", [True, False])
def test_without_pipelining_every_reader_is_served_by_a_complete_holder(pipeline):
    """Pipeline replication off (``TableConfig(pipeline=False)``, ``tensorhub server
    --no-pipeline``): partial holders serve nobody, so a burst fans out from the trainer."""
    from tensorhub.core.table import TableConfig

    d = Driver(config=TableConfig(pipeline=pipeline))
    d.advance(11)
    published(d)
    rs = [d.shard(f"r{k}") for k in range(4)]
    for r in rs:
        r.replicate(1)
    sources = {r.replica: g.source.replica for r in rs for g in r.grants()}
    if pipeline:
        assert sorted(sources.values()).count("trainer") < len(rs)
    else:
        assert set(sources.values()) == {"trainer"}


@pytest.mark.skipif(__import__("shutil").which("dot") is None, reason="graphviz's dot program is not installed")
def test_render_draws_a_png(tmp_path):
    dag = {"model": "actor", "version": 3, "edges": [_edge("a", "trainer", 2_500_000, sdc="dc0"), _edge("b", "a", 10)]}
    out = tmp_path / "dag.png"
    render(dag, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
