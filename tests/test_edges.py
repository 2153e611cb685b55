"""Which transport serves an edge (``tensorhub.scheduling.edges``): tables of cases, properties, errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorhub.core.errors import InvalidArgument, TransportError
from tensorhub.core.topology import Location
from tensorhub.scheduling.edges import (
    DEFAULT_PREFERENCE,
    EDGE_KINDS,
    Choice,
    choose_transport,
    edge_kind,
    parse_preference,
)

A = Location("east", "a", "")
A_NIC = Location("east", "a", "mlx5_0")
B = Location("east", "b", "")
WEST_A = Location("west", "a", "")  # same host name, another datacenter
ALL = ["local", "nixl", "rdma_copy", "tcp", "memory"]


@pytest.mark.parametrize(
    "reader, holder, kind",
    [(A, A, "host"), (A, A_NIC, "host"), (A, B, "datacenter"), (B, A, "datacenter"), (A, WEST_A, "remote")],
)
def test_edge_kind(reader, holder, kind):
    assert edge_kind(reader, holder) == kind


@pytest.mark.parametrize(
    "holder, offered, local, name, fallback, listed",
    [
        (A, ALL, ALL, "local", False, True),
        (A, ["tcp", "nixl"], ALL, "nixl", True, True),  # the holder has no local
        (A, ALL, ["tcp", "nixl"], "nixl", True, True),  # this process has no local
        (A, ["memory"], ["memory"], "memory", True, True),
        (B, ALL, ALL, "nixl", False, True),
        (B, ["rdma_copy", "tcp"], ALL, "rdma_copy", True, True),
        (B, ALL, ["tcp", "local"], "tcp", True, True),
        (B, ["local", "memory"], ["memory", "local"], "memory", True, False),  # off the list: local's order
        (WEST_A, ALL, ALL, "tcp", False, True),
        (WEST_A, ["nixl", "tcp"], ["nixl", "tcp"], "tcp", False, True),
        (WEST_A, ["nixl", "zmq"], ["zmq", "nixl"], "zmq", True, False),
    ],
)
def test_choose_transport(holder, offered, local, name, fallback, listed):
    got = choose_transport(A, holder, offered, local)
    assert (got.name, got.fallback, got.listed) == (name, fallback, listed)
    assert got.kind == edge_kind(A, holder)
    assert got.preferred == DEFAULT_PREFERENCE[got.kind][0]


def test_reaches_rules_out_a_transport_and_is_asked_once_per_shared_name():
    asked = []

    def reaches(name):
        asked.append(name)
        return name != "local"

    got = choose_transport(A, A, ["local", "tcp", "memory"], ["memory", "tcp", "local"], reaches=reaches)
    assert got.name == "tcp" and got.unreached == ("local",)
    assert asked == ["local", "tcp"]  # list order; nixl and rdma_copy are not shared: never asked


def test_a_custom_preference_list():
    pref = {"host": ["tcp", "local"]}
    assert choose_transport(A, A, ALL, ALL, preference=pref).name == "tcp"
    assert choose_transport(A, B, ALL, ALL, preference=pref).name == "nixl"  # datacenter: default
    assert choose_transport(A, A, ALL, ALL, preference="host=memory").name == "memory"


@pytest.mark.parametrize(
    "holder, offered, local, reaches, line",
    [
        (A, ALL, ALL, None, "edge east/a->east/a (same host): using preferred transport 'local'"),
        (
            A,
            ALL,
            ["tcp", "nixl"],
            None,
            (
                "edge east/a->east/a (same host): preferred transport 'local' is unavailable here"
                " (this process has: tcp, nixl); using 'nixl'"
            ),
        ),
        (
            B,
            ["tcp", "local"],
            ALL,
            None,
            (
                "edge east/a->east/b (same datacenter): preferred transport 'nixl' is not offered by the"
                " holder (it offers: tcp, local); using 'tcp'"
            ),
        ),
        (
            A,
            ALL,
            ALL,
            lambda n: n != "local",
            (
                "edge east/a->east/a (same host): preferred transport 'local' does not reach the holder;"
                " using 'nixl'"
            ),
        ),
        (
            WEST_A,
            ["memory"],
            ["memory"],
            None,
            (
                "edge east/a->west/a (across datacenters): preferred transport 'tcp' is unavailable here"
                " (this process has: memory); none of its list fits; falling back to 'memory'"
            ),
        ),
    ],
)
def test_describe(holder, offered, local, reaches, line):
    assert choose_transport(A, holder, offered, local, reaches=reaches).describe() == line


def test_nothing_shared_is_a_transport_error_naming_both_sides():
    with pytest.raises(TransportError) as e:
        choose_transport(A, B, ["nixl", "rdma_copy"], ["tcp", "memory"])
    msg = str(e.value)
    assert "edge kind 'datacenter'" in msg
    assert "the holder offers [nixl, rdma_copy]" in msg and "this process has [tcp, memory]" in msg


def test_nothing_that_reaches_is_a_transport_error_naming_the_refused():
    with pytest.raises(TransportError, match="edge kind 'host'.*these do not reach it: local, tcp"):
        choose_transport(A, A, ["local", "tcp"], ["tcp", "local"], reaches=lambda n: False)


@pytest.mark.parametrize(
    "offered, local, match",
    [
        ("tcp", ["tcp"], "offered transports must be a collection"),
        (["tcp"], "tcp", "local transports must be a collection"),
        (None, ["tcp"], "offered transports must be a collection"),
        (["tcp", ""], ["tcp"], "offered transports must be non-empty strings, got ''"),
        (["tcp"], ["tcp", 3], "local transports must be non-empty strings, got 3"),
    ],
)
def test_choose_transport_refuses_bad_names(offered, local, match):
    with pytest.raises(InvalidArgument, match=match):
        choose_transport(A, A, offered, local)


def test_choose_transport_refuses_a_bad_preference():
    with pytest.raises(InvalidArgument, match="unknown edge kind 'rack'"):
        choose_transport(A, A, ALL, ALL, preference={"rack": ["tcp"]})


# --- properties ---------------------------------------------------------------------------------

NAMES = ["local", "nixl", "rdma_copy", "tcp", "memory", "zmq"]
LOCS = [A, A_NIC, B, WEST_A, Location("west", "c", "")]
name_lists = st.lists(st.sampled_from(NAMES), max_size=8)
preferences = st.none() | st.dictionaries(
    st.sampled_from(EDGE_KINDS), st.lists(st.sampled_from(NAMES), min_size=1, max_size=6, unique=True)
)


@given(
    reader=st.sampled_from(LOCS),
    holder=st.sampled_from(LOCS),
    offered=name_lists,
    local=name_lists,
    preference=preferences,
    unreachable=st.sets(st.sampled_from(NAMES)),
    data=st.data(),
)
def test_choice_properties(reader, holder, offered, local, preference, unreachable, data):
    def reaches(name):
        return name not in unreachable

    def choose(offered_order):
        return choose_transport(reader, holder, offered_order, local, preference, reaches)

    usable = [n for n in local if n in offered and reaches(n)]
    if not usable:
        with pytest.raises(TransportError):
            choose(offered)
        return
    got = choose(offered)
    ranked = parse_preference(preference or {})[got.kind]
    assert got.name in offered and got.name in local and reaches(got.name)
    assert got.preferred == ranked[0]
    assert got.fallback == (got.name != ranked[0])
    listed = [n for n in ranked if n in usable]
    if listed:  # the first listed name both sides have and that reaches
        assert got.listed and got.name == listed[0]
    else:  # else this process's first usable name
        assert not got.listed and got.name == usable[0]
    if ranked[0] in usable:
        assert got.name == ranked[0] and not got.fallback
    # deterministic; the holder's order changes only the record of what it offers
    assert choose(offered) == got
    again = choose(data.draw(st.permutations(offered)))
    assert (again.name, again.fallback, again.listed, again.unreached) == (
        got.name,
        got.fallback,
        got.listed,
        got.unreached,
    )
    assert isinstance(got.describe(), str)


@given(
    spec=st.dictionaries(
        st.sampled_from(EDGE_KINDS), st.lists(st.sampled_from(NAMES), min_size=1, max_size=6, unique=True)
    )
)
def test_parse_preference_string_and_mapping_agree(spec):
    text = ";".join(f"{kind}={','.join(names)}" for kind, names in spec.items())
    want = {kind: list(spec.get(kind, DEFAULT_PREFERENCE[kind])) for kind in EDGE_KINDS}
    assert parse_preference(spec) == parse_preference(text) == want


# --- parse_preference ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, want",
    [
        ("", {}),
        (
            "host=local,tcp;datacenter=nixl,tcp;remote=tcp",
            {"host": ["local", "tcp"], "datacenter": ["nixl", "tcp"]},
        ),
        (" remote = tcp , nixl ; ", {"remote": ["tcp", "nixl"]}),
        ({"datacenter": ("rdma_copy",)}, {"datacenter": ["rdma_copy"]}),
        ({}, {}),
    ],
)
def test_parse_preference(spec, want):
    defaults = {kind: list(names) for kind, names in DEFAULT_PREFERENCE.items()}
    assert parse_preference(spec) == {**defaults, **want}


def test_parse_preference_returns_a_copy():
    table = parse_preference("")
    table["host"].append("zmq")
    assert "zmq" not in DEFAULT_PREFERENCE["host"] and "zmq" not in parse_preference("")["host"]


@pytest.mark.parametrize(
    "spec, match",
    [
        ("rack=tcp", "unknown edge kind 'rack'"),
        ("host", "segment 'host' is not 'kind=name,name'"),
        ("host=local;host=tcp", "edge kind 'host' given twice"),
        ("host=", "for 'host' must be a non-empty list"),
        ("host=local,,tcp", "for 'host' has '', which is not a transport name"),
        ("host=lo cal", "for 'host' has 'lo cal'"),
        ("datacenter=nixl,nixl", "for 'datacenter' names a transport twice"),
        ({"remote": "tcp"}, "for 'remote' must be a non-empty list of names, got 'tcp'"),
        ({"remote": [1]}, "for 'remote' has 1"),
        ({"remote": []}, "for 'remote' must be a non-empty list"),
        ({3: ["tcp"]}, "unknown edge kind 3"),
        (["host=tcp"], "a transport preference is a mapping or a"),
        (None, "a transport preference is a mapping or a"),
    ],
)
def test_parse_preference_refuses_malformed_input(spec, match):
    with pytest.raises(InvalidArgument, match=match):
        parse_preference(spec)


def test_choice_is_a_frozen_value():
    got = choose_transport(A, B, ALL, ALL)
    assert isinstance(got, Choice) and got == choose_transport(A, B, ALL, ALL)
    with pytest.raises(AttributeError):
        got.name = "tcp"  # type: ignore[misc]
