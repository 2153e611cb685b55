"""Unit and property tests of names, shard indices, versions, version specs and retention
declarations (``tensorhub.core.naming``)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.core import naming
from tensorhub.core.errors import InvalidName, UsageError
from tensorhub.core.naming import (
    LATEST,
    MAX_NAME_LEN,
    MAX_RELATIVE,
    MAX_SHARDS,
    MAX_VERSION,
    VersionSpec,
    parse_retain,
    parse_version_spec,
    retain_to_str,
    validate_model,
    validate_replica,
    validate_shard,
    validate_version,
)

NAME_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:@+-"
FIRST_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def reference_name_ok(name: object) -> bool:
    """The naming rule, restated independently of the module's regex."""
    return (
        isinstance(name, str)
        and 1 <= len(name) <= MAX_NAME_LEN
        and name[0] in FIRST_CHARS
        and all(c in NAME_CHARS for c in name)
    )


# --- model and replica names ---------------------------------------------------------------------

VALID_NAMES = [
    "actor",
    "a",
    "0",
    "Actor-v2",
    "rollout-3",
    "trainer.0",
    "team:actor",
    "actor@dc1",
    "a+b",
    "a_b",
    "9lives",
    "a" * MAX_NAME_LEN,
    "a" + NAME_CHARS,
]

INVALID_NAMES = [
    "",
    "a" * (MAX_NAME_LEN + 1),
    "-actor",
    ".hidden",
    "_private",
    ":x",
    "@x",
    "+x",
    "bad name",
    "a/b",
    "a\\b",
    "actor\n",  # a trailing newline must not slip past the end anchor
    "\nactor",
    "act\x00or",
    "actor\t",
    "émile",
    "actör",
    "ａctor",  # fullwidth
    "a*",
    "a,b",
    "a#b",
    "a$",
    "a'b",
    'a"b',
    "a;b",
]

NON_STR = [None, 1, 1.5, b"actor", ["actor"], True, object()]


@pytest.mark.parametrize("name", VALID_NAMES)
@pytest.mark.parametrize("validate", [validate_model, validate_replica])
def test_valid_names(validate, name):
    assert validate(name) == name


@pytest.mark.parametrize("name", INVALID_NAMES, ids=repr)
@pytest.mark.parametrize("validate", [validate_model, validate_replica])
def test_invalid_names(validate, name):
    with pytest.raises(InvalidName) as info:
        validate(name)
    assert isinstance(info.value, UsageError) and isinstance(info.value, ValueError)


def _stable_id(value: object) -> str:
    """A test id that is the same in every process (pytest-xdist workers must agree)."""
    return "object()" if type(value) is object else repr(value)


@pytest.mark.parametrize("name", NON_STR, ids=_stable_id)
@pytest.mark.parametrize("validate", [validate_model, validate_replica])
def test_names_must_be_str(validate, name):
    with pytest.raises(InvalidName, match="str"):
        validate(name)


def test_invalid_name_messages_say_which_name():
    with pytest.raises(InvalidName, match="model"):
        validate_model("bad name")
    with pytest.raises(InvalidName, match="replica"):
        validate_replica("bad name")
    with pytest.raises(InvalidName, match="129"):
        validate_model("a" * 129)


def test_invalid_replica_names_the_model():
    with pytest.raises(InvalidName) as info:
        validate_replica("bad name", model="actor")
    assert info.value.model == "actor"
    assert "model='actor'" in str(info.value)


@pytest.mark.property
@settings(max_examples=200, deadline=None)
@given(st.text(max_size=MAX_NAME_LEN + 3) | st.text(alphabet=NAME_CHARS + " /é\n", max_size=MAX_NAME_LEN + 3))
def test_names_follow_the_rule(name):
    if reference_name_ok(name):
        assert validate_model(name) == name
        assert validate_replica(name) == name
    else:
        with pytest.raises(InvalidName):
            validate_model(name)
        with pytest.raises(InvalidName):
            validate_replica(name)


@pytest.mark.property
@settings(max_examples=100, deadline=None)
@given(st.from_regex(re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}", re.ASCII), fullmatch=True))
def test_every_name_of_the_alphabet_is_accepted(name):
    assert validate_model(name) == name


# --- shards --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_shards, shard_idx",
    [(1, 0), (2, 1), (8, 0), (8, 7), (MAX_SHARDS, 0), (MAX_SHARDS, MAX_SHARDS - 1)],
)
def test_valid_shards(num_shards, shard_idx):
    assert validate_shard(num_shards, shard_idx) == (num_shards, shard_idx)


@pytest.mark.parametrize(
    "num_shards, shard_idx, what",
    [
        (0, 0, "num_shards"),
        (-1, 0, "num_shards"),
        (MAX_SHARDS + 1, 0, "num_shards"),
        (True, 0, "num_shards"),
        (2.0, 0, "num_shards"),
        ("2", 0, "num_shards"),
        (None, 0, "num_shards"),
        (2, 2, "shard_idx"),
        (2, 3, "shard_idx"),
        (2, -1, "shard_idx"),
        (1, 1, "shard_idx"),
        (2, True, "shard_idx"),
        (2, False, "shard_idx"),
        (2, 0.0, "shard_idx"),
        (2, "0", "shard_idx"),
        (2, None, "shard_idx"),
    ],
    ids=repr,
)
def test_invalid_shards(num_shards, shard_idx, what):
    with pytest.raises(InvalidName, match=what):
        validate_shard(num_shards, shard_idx)


def test_invalid_shard_carries_its_context():
    with pytest.raises(InvalidName) as info:
        validate_shard(4, 4, model="actor", replica="rollout-1")
    err = info.value
    assert (err.model, err.replica) == ("actor", "rollout-1")
    assert "model='actor'" in str(err) and "replica='rollout-1'" in str(err)


@pytest.mark.property
@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=-5, max_value=MAX_SHARDS + 5), st.integers(min_value=-5, max_value=MAX_SHARDS + 5))
def test_shard_rule(num_shards, shard_idx):
    if 1 <= num_shards <= MAX_SHARDS and 0 <= shard_idx < num_shards:
        assert validate_shard(num_shards, shard_idx) == (num_shards, shard_idx)
    else:
        with pytest.raises(InvalidName):
            validate_shard(num_shards, shard_idx)


# --- absolute versions ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 1, 12345, MAX_VERSION])
def test_valid_versions(version):
    assert validate_version(version) == version


@pytest.mark.parametrize("version", [-1, MAX_VERSION + 1, 2**64, True, False, 1.0, "1", None, [1]], ids=repr)
def test_invalid_versions(version):
    with pytest.raises(InvalidName, match="version"):
        validate_version(version)


def test_max_version_is_int63():
    assert MAX_VERSION == 2**63 - 1


def test_invalid_version_carries_its_context():
    with pytest.raises(InvalidName) as info:
        validate_version(-1, model="actor", replica="r", shard=2)
    assert info.value.context() == {"model": "actor", "version": None, "replica": "r", "shard": 2}


# --- version specs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, version, back",
    [
        (0, 0, None),
        (7, 7, None),
        (MAX_VERSION, MAX_VERSION, None),
        ("latest", None, 0),
        ("latest-0", None, 0),
        ("latest-1", None, 1),
        ("latest-12", None, 12),
        ("latest-01", None, 1),
        (f"latest-{MAX_RELATIVE}", None, MAX_RELATIVE),
    ],
)
def test_parse_version_spec(spec, version, back):
    parsed = parse_version_spec(spec)
    assert parsed == VersionSpec(version=version, back=back)
    assert parsed.relative is (back is not None)


@pytest.mark.parametrize(
    "spec",
    [
        -1,
        MAX_VERSION + 1,
        True,
        False,
        1.0,
        None,
        b"latest",
        ["latest"],
        "",
        "3",
        "-1",
        "Latest",
        "LATEST",
        "latest-",
        "latest-x",
        "latest-1x",
        "latest--1",
        "latest+1",
        "latest-1.5",
        "latest-1 ",
        " latest",
        "latest\n",
        "latest-1\n",
        "latest 1",
        "latest1",
        "newest",
        "latestlatest",
        f"latest-{MAX_RELATIVE + 1}",
        "latest-12345678",  # more digits than any accepted k
        "latest-" + "9" * 100,
    ],
    ids=repr,
)
def test_invalid_version_specs(spec):
    with pytest.raises(InvalidName) as info:
        parse_version_spec(spec)
    assert repr(spec)[:40] in str(info.value)  # names what was given


def test_version_spec_passes_through():
    spec = VersionSpec(back=3)
    assert parse_version_spec(spec) is spec


def test_absolute_of_a_relative_spec_is_refused():
    assert parse_version_spec(7).absolute == 7 and parse_version_spec(7).resolve(3) == 7
    for spec in (parse_version_spec("latest-1"), VersionSpec()):
        with pytest.raises(InvalidName, match="not an absolute version spec"):
            spec.absolute
    with pytest.raises(InvalidName):  # a spec that names nothing resolves to nothing (it was None)
        VersionSpec().resolve(3)


def test_invalid_spec_carries_its_context():
    with pytest.raises(InvalidName) as info:
        parse_version_spec("nope", model="actor", replica="r", shard=0)
    assert (info.value.model, info.value.replica, info.value.shard) == ("actor", "r", 0)


def test_latest_constant():
    assert LATEST == parse_version_spec("latest")
    assert LATEST.relative and LATEST.back == 0
    assert LATEST.wire() == "latest" and str(LATEST) == "latest"


@pytest.mark.parametrize(
    "spec, wire",
    [(0, 0), (5, 5), ("latest", "latest"), ("latest-0", "latest"), ("latest-2", "latest-2"), ("latest-007", "latest-7")],
)
def test_wire_form_is_canonical(spec, wire):
    parsed = parse_version_spec(spec)
    assert parsed.wire() == wire
    assert type(parsed.wire()) is type(wire)
    assert str(parsed) == str(wire)


@pytest.mark.parametrize(
    "spec, latest, expect",
    [(5, 100, 5), ("latest", 9, 9), ("latest-3", 9, 6), ("latest-9", 9, 0), ("latest-10", 9, -1), (0, 0, 0)],
)
def test_resolve(spec, latest, expect):
    # An absolute spec ignores ``latest``; a relative one may go negative (the caller reports it).
    assert parse_version_spec(spec).resolve(latest) == expect


def test_version_spec_is_frozen_and_hashable():
    spec = parse_version_spec("latest-2")
    with pytest.raises(AttributeError):
        spec.back = 3  # type: ignore[misc]
    assert {spec, parse_version_spec("latest-2"), parse_version_spec(2)} == {spec, VersionSpec(version=2)}


SPECS = st.one_of(
    st.integers(min_value=0, max_value=MAX_VERSION).map(lambda v: VersionSpec(version=v)),
    st.integers(min_value=0, max_value=MAX_RELATIVE).map(lambda k: VersionSpec(back=k)),
)


@pytest.mark.property
@settings(max_examples=200, deadline=None)
@given(SPECS)
def test_wire_form_round_trips(spec):
    assert parse_version_spec(spec.wire()) == spec
    assert parse_version_spec(spec.wire()).wire() == spec.wire()


@pytest.mark.property
@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=MAX_RELATIVE), st.integers(min_value=0, max_value=MAX_VERSION))
def test_latest_k_resolves_to_latest_minus_k(k, latest):
    assert parse_version_spec(f"latest-{k}").resolve(latest) == latest - k


@pytest.mark.property
@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=20), st.text(alphabet="latest-0123456789 x", max_size=16)))
def test_any_string_parses_or_raises_invalid_name(spec):
    try:
        parsed = parse_version_spec(spec)
    except InvalidName:
        return
    assert parsed.relative
    assert 0 <= parsed.back <= MAX_RELATIVE
    assert spec.startswith("latest")


# --- retention declarations ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "retain, back",
    [(None, None), ("latest", 0), ("latest-0", 0), ("latest-1", 1), ("latest-5", 5), (f"latest-{MAX_RELATIVE}", MAX_RELATIVE)],
)
def test_parse_retain(retain, back):
    assert parse_retain(retain) == back


@pytest.mark.parametrize(
    "retain",
    [0, 3, True, False, 1.5, "", "3", "all", "none", "latest-x", "latest-", "latest--1", "Latest", f"latest-{MAX_RELATIVE + 1}",
     VersionSpec(back=1), b"latest"],
    ids=repr,
)
def test_invalid_retain(retain):
    with pytest.raises(InvalidName):
        parse_retain(retain)


def test_invalid_retain_names_the_value_and_context():
    with pytest.raises(InvalidName, match="retain") as info:
        parse_retain(3, model="actor", replica="r")
    assert "3" in str(info.value)
    assert (info.value.model, info.value.replica) == ("actor", "r")


@pytest.mark.parametrize("back, text", [(None, None), (0, "latest"), (1, "latest-1"), (42, "latest-42")])
def test_retain_to_str(back, text):
    assert retain_to_str(back) == text


@pytest.mark.property
@settings(max_examples=100, deadline=None)
@given(st.none() | st.integers(min_value=0, max_value=MAX_RELATIVE))
def test_retain_round_trips(back):
    assert parse_retain(retain_to_str(back)) == back


def test_exports():
    for name in naming.__all__:
        assert hasattr(naming, name), name
