"""Unit tests of the transport registry (``tensorhub.transports.registry``).

The registry is module-global state: every test runs on a private copy of it (the
``registry`` fixture), with the entry-point group replaced by a scriptable list, so that
nothing a test registers leaks into another test.
"""

from __future__ import annotations

import sys
import textwrap
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import pytest

from tensorhub.core.errors import InvalidArgument
from tensorhub.transports import registry as reg
from tensorhub.transports.base import Transport
from tensorhub.transports.tcp import TcpTransport


class FakeTransport(Transport):
    name = "fake"

    async def start(self) -> None:  # pragma: no cover - never started here
        pass


class Nameless(Transport):
    """A plugin that leaves ``name`` empty: registrable under any name."""


class Misnamed(Transport):
    name = "something_else"


class NotATransport:
    name = "nope"


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> list[EntryPoint]:
    """A private registry; returns the (initially empty) entry-point list it discovers."""
    eps: list[EntryPoint] = []

    def fake_entry_points(*, group: str) -> list[EntryPoint]:
        assert group == reg.ENTRY_POINT_GROUP
        return [ep for ep in eps if ep.group == group]

    monkeypatch.setattr(reg, "_registered", dict(reg._BUILTIN))
    monkeypatch.setattr(reg, "_entry_points_loaded", False)
    monkeypatch.setattr(reg, "entry_points", fake_entry_points)
    return eps


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on sys.path for throwaway plugin modules (removed from sys.modules after)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("thplugin_"):
            del sys.modules[name]


def write_module(where: Path, name: str, body: str) -> None:
    (where / f"{name}.py").write_text(textwrap.dedent(body))


# --- built-ins -------------------------------------------------------------------------------------


def test_tcp_is_built_in_and_loads_lazily(registry: list) -> None:
    assert reg.transport_names() == ["local", "memory", "nixl", "rdma_copy", "tcp"]
    assert reg._registered["tcp"] == "tensorhub.transports.tcp:TcpTransport"  # not imported yet
    assert reg.get_transport("tcp") is TcpTransport
    assert reg._registered["tcp"] is TcpTransport  # cached once loaded
    assert reg.get_transport("tcp") is TcpTransport


# --- register_transport ------------------------------------------------------------------------------


def test_register_a_class_and_get_it_back(registry: list) -> None:
    reg.register_transport("fake", FakeTransport)
    assert reg.get_transport("fake") is FakeTransport
    assert reg.transport_names() == ["fake", "local", "memory", "nixl", "rdma_copy", "tcp"]


def test_register_a_nameless_class_under_any_name(registry: list) -> None:
    reg.register_transport("mine", Nameless)
    assert reg.get_transport("mine") is Nameless


def test_duplicate_is_refused_naming_it(registry: list) -> None:
    reg.register_transport("fake", FakeTransport)
    with pytest.raises(InvalidArgument, match=r"'fake' is already registered \(tests\.test_transport_registry:FakeTransport\)"):
        reg.register_transport("fake", FakeTransport)
    assert reg.get_transport("fake") is FakeTransport  # the first registration stands


def test_duplicate_of_a_built_in_is_refused_naming_it(registry: list) -> None:
    with pytest.raises(InvalidArgument, match=r"'tcp' is already registered \(tensorhub\.transports\.tcp:TcpTransport\)"):
        reg.register_transport("tcp", Nameless)
    with pytest.raises(InvalidArgument, match="'tcp' is already registered"):
        reg.register_transport("tcp", "somewhere:Else")
    assert reg.get_transport("tcp") is TcpTransport


@pytest.mark.parametrize("cls", [NotATransport, NotATransport(), 42, None, Transport.__init__])
def test_non_transport_is_refused(registry: list, cls: Any) -> None:
    with pytest.raises(InvalidArgument, match=r"transport plugin 'bad' is .*not a subclass of tensorhub\.Transport"):
        reg.register_transport("bad", cls)
    assert "bad" not in reg.transport_names()


def test_class_whose_name_differs_is_refused(registry: list) -> None:
    with pytest.raises(InvalidArgument, match="'other' is class Misnamed whose name is 'something_else'"):
        reg.register_transport("other", Misnamed)
    assert "other" not in reg.transport_names()


@pytest.mark.parametrize("name", ["", "has space", "a-b", "1st", None, 3])
def test_names_must_be_identifiers(registry: list, name: Any) -> None:
    with pytest.raises(InvalidArgument, match="transport names are identifiers"):
        reg.register_transport(name, Nameless)


# --- get_transport ---------------------------------------------------------------------------------


def test_unknown_name_lists_the_known_ones(registry: list) -> None:
    reg.register_transport("fake", FakeTransport)
    with pytest.raises(InvalidArgument, match=r"no transport named 'rdma'; known: fake, local, memory, nixl, rdma_copy, tcp$"):
        reg.get_transport("rdma")


def test_lazy_path_is_imported_on_first_use(registry: list, plugin_dir: Path) -> None:
    write_module(
        plugin_dir,
        "thplugin_ok",
        """
        from tensorhub.transports.base import Transport
        class Good(Transport):
            name = "good"
        """,
    )
    reg.register_transport("good", "thplugin_ok:Good")
    assert "thplugin_ok" not in sys.modules  # registering imports nothing
    cls = reg.get_transport("good")
    assert cls.__name__ == "Good" and issubclass(cls, Transport)
    assert reg.get_transport("good") is cls


def test_lazy_path_to_a_missing_module_names_the_plugin(registry: list) -> None:
    reg.register_transport("ghost", "thplugin_no_such_module:Ghost")
    with pytest.raises(InvalidArgument, match=r"transport 'ghost' \(thplugin_no_such_module:Ghost\) does not load") as info:
        reg.get_transport("ghost")
    assert isinstance(info.value.__cause__, ImportError)
    # Still registered as a path: a later call tries again (and fails the same way).
    with pytest.raises(InvalidArgument, match="'ghost'"):
        reg.get_transport("ghost")


def test_lazy_path_to_a_missing_class_names_the_plugin(registry: list, plugin_dir: Path) -> None:
    write_module(plugin_dir, "thplugin_empty", "X = 1\n")
    reg.register_transport("empty", "thplugin_empty:Missing")
    with pytest.raises(InvalidArgument, match=r"transport 'empty' \(thplugin_empty:Missing\) does not load") as info:
        reg.get_transport("empty")
    assert isinstance(info.value.__cause__, AttributeError)


def test_lazy_path_without_a_class_part_is_refused_at_registration(registry: list) -> None:
    with pytest.raises(InvalidArgument, match="transport 'noclass'"):
        reg.register_transport("noclass", "tensorhub.transports.tcp")
    with pytest.raises(InvalidArgument, match="no transport named 'noclass'"):
        reg.get_transport("noclass")


def test_lazy_path_to_a_non_transport_is_refused_naming_the_plugin(registry: list, plugin_dir: Path) -> None:
    write_module(plugin_dir, "thplugin_wrong", "class Thing:\n    pass\n")
    reg.register_transport("wrong", "thplugin_wrong:Thing")
    with pytest.raises(InvalidArgument, match="transport plugin 'wrong' is .*Thing.*not a subclass"):
        reg.get_transport("wrong")
    assert reg._registered["wrong"] == "thplugin_wrong:Thing"  # not replaced by the bad class


def test_lazy_path_whose_module_fails_at_import_names_the_plugin(registry: list, plugin_dir: Path) -> None:
    write_module(plugin_dir, "thplugin_broken", "raise RuntimeError('CUDA driver too old')\n")
    reg.register_transport("broken", "thplugin_broken:Broken")
    with pytest.raises(InvalidArgument, match="transport 'broken'.*CUDA driver too old"):
        reg.get_transport("broken")


def test_lazy_path_with_an_empty_module_is_refused_at_registration(registry: list) -> None:
    with pytest.raises(InvalidArgument, match="transport 'blank'"):
        reg.register_transport("blank", ":Blank")


# --- entry points ----------------------------------------------------------------------------------


def test_entry_points_are_discovered_lazily(registry: list, plugin_dir: Path) -> None:
    write_module(plugin_dir, "thplugin_ep", "from tensorhub.transports.base import Transport\nclass Ep(Transport):\n    name = 'ep'\n")
    registry.append(EntryPoint("ep", "thplugin_ep:Ep", reg.ENTRY_POINT_GROUP))
    registry.append(EntryPoint("elsewhere", "thplugin_ep:Ep", "some.other.group"))
    assert reg.transport_names() == ["ep", "local", "memory", "nixl", "rdma_copy", "tcp"]
    assert "thplugin_ep" not in sys.modules
    assert reg.get_transport("ep").__name__ == "Ep"


def test_register_refuses_a_name_an_entry_point_took(registry: list) -> None:
    registry.append(EntryPoint("fake", "thplugin_x:Fake", reg.ENTRY_POINT_GROUP))
    with pytest.raises(InvalidArgument, match=r"'fake' is already registered \(thplugin_x:Fake\)"):
        reg.register_transport("fake", FakeTransport)


def test_entry_point_clashing_with_a_built_in_is_refused_naming_both(registry: list) -> None:
    registry.append(EntryPoint("tcp", "evil_pkg.mod:Tcp", reg.ENTRY_POINT_GROUP))
    with pytest.raises(InvalidArgument, match=r"entry point 'tcp' = 'evil_pkg\.mod:Tcp' of group tensorhub\.transports clashes with transport tensorhub\.transports\.tcp:TcpTransport"):
        reg.transport_names()


def test_entry_point_clash_is_not_forgotten(registry: list) -> None:
    registry.append(EntryPoint("tcp", "evil_pkg.mod:Tcp", reg.ENTRY_POINT_GROUP))
    registry.append(EntryPoint("later", "good_pkg.mod:Later", reg.ENTRY_POINT_GROUP))
    with pytest.raises(InvalidArgument, match="clashes"):
        reg.transport_names()
    # Either the clash is raised again, or every other entry point is still discovered.
    try:
        names = reg.transport_names()
    except InvalidArgument:
        return
    assert "later" in names


def test_entry_points_are_loaded_once(registry: list, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    inner = reg.entry_points

    def counting(*, group: str) -> list:
        calls.append(group)
        return inner(group=group)

    monkeypatch.setattr(reg, "entry_points", counting)
    reg.transport_names()
    reg.transport_names()
    reg.register_transport("fake", FakeTransport)
    reg.get_transport("fake")
    assert calls == [reg.ENTRY_POINT_GROUP]


def test_the_fixture_restores_the_global_registry() -> None:
    """Runs without the fixture: nothing registered by the tests above is left over."""
    real = {ep.name for ep in entry_points(group=reg.ENTRY_POINT_GROUP)}
    assert set(reg._registered) <= set(reg._BUILTIN) | real
    assert reg.entry_points is entry_points
