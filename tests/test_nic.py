"""NIC affinity (``tensorhub.transports.nic``) on a fake sysfs tree built from real directories and symlinks.

The tree (relative symlinks, as the kernel makes them)::

    pci0000:00 (NUMA 0)
      00:01.0 - 01:00.0 (PCIe switch) - 02:00.0 - 03:00.0  GPU0
                                      - 02:04.0 - 04:00.0  mlx5_0 (+ ib0), 04:00.1 mlx5_3
      00:02.0 - 05:00.0  mlx5_1          (same root complex as GPU0, another port)
      00:03.0 - 06:00.0  GPU1            (no NIC under its port)
      00:05.0 - virtio0  ens3            (a virtio interface below its PCI function)
    pci0000:80 (NUMA 1)
      80:01.0 - 81:00.0  mlx5_2, 81:00.1 eth0
      80:02.0 - 82:00.0  GPU2
    pci0000:c0 (NUMA 1)
      c0:01.0 - c1:00.0  GPU3            (its socket's NIC is on another root complex)

plus ``mlx5_broken`` (a dangling ``device`` link), ``mlx5_gone`` (a dangling class link), ``rxe0``
and ``lo`` (no ``device`` link).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tensorhub.core.errors import InvalidArgument
from tensorhub.transports import nic
from tensorhub.transports.nic import (
    CROSS_ROOT_DISTANCE,
    NicChoice,
    choose_nic,
    gpu_bdf,
    nearest_nic,
    normalize_bdf,
    pci_distance,
    pci_path,
    rdma_nics,
    ucx_device_name,
)

GPU0, GPU1, GPU2, GPU3 = "0000:03:00.0", "0000:06:00.0", "0000:82:00.0", "0000:c1:00.0"


class FakeSysfs:
    """Writes devices, class entries and their symlinks under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "bus" / "pci" / "devices").mkdir(parents=True)

    def device(self, *chain: str, numa: int | None = None) -> Path:
        """Create the PCI device at the end of ``chain`` (root complex first) and its bus link."""
        path = self.root.joinpath("devices", *chain)
        path.mkdir(parents=True, exist_ok=True)
        if numa is not None:
            (path / "numa_node").write_text(f"{numa}\n")
        self._link(self.root / "bus" / "pci" / "devices" / chain[-1], path)
        return path

    def class_entry(self, cls: str, name: str, parent: Path | None, device: Path | None) -> None:
        """``class/<cls>/<name>`` -> ``<parent>/<cls>/<name>``, whose ``device`` -> ``device``."""
        entry = (parent if parent is not None else self.root / "devices" / "virtual") / cls / name
        entry.mkdir(parents=True)
        if device is not None:
            self._link(entry / "device", device)
        (self.root / "class" / cls).mkdir(parents=True, exist_ok=True)
        self._link(self.root / "class" / cls / name, entry)

    @staticmethod
    def _link(link: Path, target: Path) -> None:
        os.symlink(os.path.relpath(target, link.parent), link)


@pytest.fixture
def sysfs(tmp_path: Path) -> str:
    fs = FakeSysfs(tmp_path / "sys")
    switch = ("pci0000:00", "0000:00:01.0", "0000:01:00.0")
    fs.device(*switch, "0000:02:00.0", GPU0, numa=0)
    nic0 = fs.device(*switch, "0000:02:04.0", "0000:04:00.0", numa=0)
    nic3 = fs.device(*switch, "0000:02:04.0", "0000:04:00.1", numa=0)
    nic1 = fs.device("pci0000:00", "0000:00:02.0", "0000:05:00.0", numa=0)
    fs.device("pci0000:00", "0000:00:03.0", GPU1, numa=0)
    virtio = fs.device("pci0000:00", "0000:00:05.0", numa=0) / "virtio0"
    virtio.mkdir()
    nic2 = fs.device("pci0000:80", "0000:80:01.0", "0000:81:00.0", numa=1)
    eth0 = fs.device("pci0000:80", "0000:80:01.0", "0000:81:00.1", numa=1)
    fs.device("pci0000:80", "0000:80:02.0", GPU2, numa=1)
    fs.device("pci0000:c0", "0000:c0:01.0", GPU3, numa=1)
    for name, dev in (("mlx5_0", nic0), ("mlx5_1", nic1), ("mlx5_2", nic2), ("mlx5_3", nic3)):
        fs.class_entry("infiniband", name, dev, dev)
    fs.class_entry("infiniband", "mlx5_broken", nic0, nic0.parent / "0000:04:00.7")  # dangling
    fs.class_entry("infiniband", "rxe0", None, None)
    os.symlink(
        "../../devices/pci0000:00/0000:00:09.0/infiniband/mlx5_gone", fs.root / "class/infiniband/mlx5_gone"
    )
    fs.class_entry("net", "ib0", nic0, nic0)
    fs.class_entry("net", "eth0", eth0, eth0)
    fs.class_entry("net", "ens3", virtio, virtio)
    fs.class_entry("net", "mlx5_1", eth0, eth0)  # same name as an RDMA device: the RDMA one stays
    fs.class_entry("net", "lo", None, None)
    return str(fs.root)


# --- PCI addresses and paths ------------------------------------------------------------------


@pytest.mark.parametrize(
    "given_bdf, want",
    [
        ("0000:3b:00.0", "0000:3b:00.0"),
        ("3B:00.0", "0000:3b:00.0"),
        ("00000000:3B:00.0", "0000:3b:00.0"),  # torch's pci_bus_id string
        (" 0000:3b:1f.7\n", "0000:3b:1f.7"),
        ("0001:3b:00.1", "0001:3b:00.1"),
        ("00010000:3b:00.0", "10000:3b:00.0"),  # a VMD domain, as the kernel spells it
    ],
)
def test_normalize_bdf(given_bdf, want):
    assert normalize_bdf(given_bdf) == want


@pytest.mark.parametrize(
    "bad", ["", "3b:00", "zz:00.0", "0000:3b:20.0", "0000:3b:00.8", "000:3b:00.0", "0000:3b:00.0.0", 42, None]
)
def test_normalize_bdf_refuses_what_is_not_a_pci_address(bad):
    with pytest.raises(InvalidArgument, match="not a PCI address"):
        normalize_bdf(bad)


def test_pci_path_is_the_chain_from_the_root_complex(sysfs):
    want = ["pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0", GPU0]
    assert pci_path(GPU0, sysfs) == want
    assert pci_path("00000000:03:00.0", sysfs) == want
    assert pci_path("03:00.0", sysfs) == want


def test_pci_path_errors_name_the_device(sysfs, tmp_path):
    with pytest.raises(InvalidArgument, match="no PCI device .*0000:99:00.0"):
        pci_path("99:00.0", sysfs)
    os.symlink("../../../devices/pci0000:00/0000:9a:00.0", Path(sysfs, "bus/pci/devices/0000:9a:00.0"))
    with pytest.raises(InvalidArgument, match="no PCI device .*0000:9a:00.0"):  # a broken link
        pci_path("9a:00.0", sysfs)
    Path(tmp_path, "elsewhere", "0000:9b:00.0").mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere" / "0000:9b:00.0", Path(sysfs, "bus/pci/devices/0000:9b:00.0"))
    with pytest.raises(InvalidArgument, match="under no PCI root complex"):
        pci_path("9b:00.0", sysfs)
    with pytest.raises(InvalidArgument, match="not a PCI address"):
        pci_path("gpu0", sysfs)


@pytest.mark.parametrize(
    "a, b, want",
    [
        (["pci0000:00", "00:01.0", "03:00.0"], ["pci0000:00", "00:01.0", "03:00.0"], 0),
        (["pci0000:00", "00:01.0", "03:00.0"], ["pci0000:00", "00:01.0", "04:00.0"], 2),
        (["pci0000:00", "00:01.0", "03:00.0"], ["pci0000:00", "00:01.0"], 1),
        (["pci0000:00", "00:01.0", "03:00.0"], ["pci0000:00", "00:02.0", "05:00.0"], 4),
        (["pci0000:00", "00:01.0"], ["pci0000:80", "80:01.0"], CROSS_ROOT_DISTANCE),
    ],
)
def test_pci_distance(a, b, want):
    assert pci_distance(a, b) == want == pci_distance(b, a)


def test_pci_distance_refuses_empty_paths():
    with pytest.raises(InvalidArgument, match="non-empty"):
        pci_distance([], ["pci0000:00"])


paths = st.lists(st.sampled_from(["a", "b"]), max_size=5).map(lambda p: ["pci0000:00", *p])


@given(a=paths, b=paths, c=paths)
def test_pci_distance_is_a_metric_within_one_root_complex(a, b, c):
    assert pci_distance(a, b) == pci_distance(b, a)
    assert (pci_distance(a, b) == 0) == (a == b)
    assert pci_distance(a, c) <= pci_distance(a, b) + pci_distance(b, c)
    assert pci_distance(a, b) < CROSS_ROOT_DISTANCE


# --- NICs --------------------------------------------------------------------------------------


def test_rdma_nics_lists_rdma_devices_with_their_pci_address(sysfs):
    got = rdma_nics(sysfs)
    assert got == {
        "mlx5_0": "0000:04:00.0",
        "mlx5_1": "0000:05:00.0",
        "mlx5_2": "0000:81:00.0",
        "mlx5_3": "0000:04:00.1",
    }  # not the dangling mlx5_broken and mlx5_gone, not the virtual rxe0
    assert list(got) == sorted(got)


def test_rdma_nics_adds_network_interfaces_when_asked(sysfs):
    got = rdma_nics(sysfs, kind="net")
    assert got == {
        **rdma_nics(sysfs),
        "ib0": "0000:04:00.0",
        "eth0": "0000:81:00.1",
        "ens3": "0000:00:05.0",  # the PCI function above the virtio device
    }  # mlx5_1 is still the RDMA device; lo has no device
    assert list(got) == sorted(got)


def test_rdma_nics_without_class_directories_is_empty(tmp_path):
    assert rdma_nics(str(tmp_path)) == {}
    assert rdma_nics(str(tmp_path), kind="net") == {}
    assert rdma_nics(str(tmp_path / "missing")) == {}


def test_rdma_nics_refuses_an_unknown_kind(sysfs):
    with pytest.raises(InvalidArgument, match="kind must be one of infiniband, net, got 'ib'"):
        rdma_nics(sysfs, kind="ib")


@pytest.mark.parametrize(
    "gpu, want",
    [
        (GPU0, "mlx5_0"),  # same PCIe switch; mlx5_3 is as near, and mlx5_0 sorts first
        ("00000000:03:00.0", "mlx5_0"),
        (GPU1, "mlx5_1"),  # same root complex, nearer port than the switch
        (GPU2, "mlx5_2"),  # the NIC on its own socket
        (GPU3, "mlx5_2"),  # no NIC on its root complex: the one on its NUMA node
    ],
)
def test_nearest_nic(sysfs, gpu, want):
    nics = rdma_nics(sysfs)
    assert nearest_nic(gpu, nics, sysfs) == want
    assert nearest_nic(gpu, dict(reversed(nics.items())), sysfs) == want  # order does not matter


def test_nearest_nic_ranks_switch_then_root_complex_then_the_rest(sysfs):
    assert nearest_nic(GPU0, {"b": "0000:81:00.0", "c": "0000:05:00.0"}, sysfs) == "c"
    assert nearest_nic(GPU0, {"b": "0000:81:00.0", "c": "0000:05:00.0", "d": "04:00.1"}, sysfs) == "d"
    assert nearest_nic(GPU0, {"z": "0000:81:00.0"}, sysfs) == "z"


def test_nearest_nic_without_numa_information_breaks_ties_by_name(sysfs):
    for numa in Path(sysfs, "devices").rglob("numa_node"):
        numa.write_text("-1\n")
    assert nearest_nic(GPU3, rdma_nics(sysfs), sysfs) == "mlx5_0"


def test_nearest_nic_with_no_nics_is_none(sysfs):
    assert nearest_nic(GPU0, {}, sysfs) is None


def test_nearest_nic_errors_name_the_missing_device(sysfs):
    with pytest.raises(InvalidArgument, match="0000:99:00.0"):
        nearest_nic(GPU0, {"mlx5_9": "99:00.0"}, sysfs)
    with pytest.raises(InvalidArgument, match="0000:99:00.0"):
        nearest_nic("99:00.0", rdma_nics(sysfs), sysfs)


def test_ucx_device_name():
    assert ucx_device_name("mlx5_0") == "mlx5_0:1"
    assert ucx_device_name("mlx5_0", port=2) == "mlx5_0:2"


@pytest.mark.parametrize(
    "name, port", [("mlx5_0:1", 1), ("", 1), ("mlx 5", 1), (None, 1), ("mlx5_0", 0), ("mlx5_0", True)]
)
def test_ucx_device_name_refuses_bad_input(name, port):
    with pytest.raises(InvalidArgument):
        ucx_device_name(name, port)


# --- the GPU's address (torch faked: no GPU here) ---------------------------------------------


def fake_cuda(monkeypatch, *props: object) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])


def test_gpu_bdf_from_device_properties(monkeypatch):
    fake_cuda(
        monkeypatch,
        SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0),
        SimpleNamespace(pci_domain_id=1, pci_bus_id=0xC1, pci_device_id=0x1F),
        SimpleNamespace(name="an old torch: no PCI fields"),
    )
    assert gpu_bdf(0) == "0000:3b:00.0"
    assert gpu_bdf(1) == "0001:c1:1f.0"
    assert gpu_bdf(2) is None
    with pytest.raises(InvalidArgument, match="no CUDA device 3 \\(3 visible\\)"):
        gpu_bdf(3)


@pytest.mark.parametrize("bad", [-1, True, "0", None])
def test_gpu_bdf_refuses_a_bad_index(bad):
    with pytest.raises(InvalidArgument, match="CUDA device index"):
        gpu_bdf(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")
def test_gpu_bdf_without_cuda_is_none():
    assert gpu_bdf(0) is None


# --- the policy ---------------------------------------------------------------------------------


def at(bdf: str | None):
    return lambda index: bdf


@pytest.mark.parametrize(
    "explicit, gpu, want",
    [
        ("mlx5_1:1", GPU0, NicChoice("mlx5_1:1", "explicit")),
        ("mlx5_0:1,mlx5_1:1", None, NicChoice("mlx5_0:1,mlx5_1:1", "explicit")),
        ("eth0", GPU0, NicChoice("eth0", "explicit")),
        (None, GPU0, NicChoice("mlx5_0", "nearest to GPU 0000:03:00.0 (distance 4)")),
        (None, "00000000:06:00.0", NicChoice("mlx5_1", "nearest to GPU 0000:06:00.0 (distance 4)")),
        (None, GPU3, NicChoice("mlx5_2", f"nearest to GPU {GPU3} (distance {CROSS_ROOT_DISTANCE})")),
        (None, None, NicChoice(None, "no GPU")),
        (None, "0000:99:00.0", NicChoice(None, "GPU 0000:99:00.0 not found in sysfs")),
    ],
)
def test_choose_nic(sysfs, explicit, gpu, want):
    assert choose_nic(explicit, 0, sysfs, locate_gpu=at(gpu)) == want


def test_choose_nic_for_a_cpu_tensor_or_a_host_without_nics(sysfs, tmp_path):
    def never(index):
        raise AssertionError("a CPU tensor has no GPU to look up")

    assert choose_nic(None, None, sysfs, locate_gpu=never) == NicChoice(None, "no GPU")
    assert choose_nic("mlx5_0:1", None, sysfs, locate_gpu=never) == NicChoice("mlx5_0:1", "explicit")
    assert choose_nic(None, 0, str(tmp_path), locate_gpu=at(GPU0)) == NicChoice(None, "no RDMA NIC found")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")
def test_choose_nic_asks_torch_by_default(sysfs):
    assert choose_nic(None, 0, sysfs) == NicChoice(None, "no GPU")


def test_choose_nic_through_torch(monkeypatch, sysfs):
    fake_cuda(monkeypatch, SimpleNamespace(pci_domain_id=0, pci_bus_id=0x82, pci_device_id=0))
    assert choose_nic(None, 0, sysfs) == NicChoice("mlx5_2", "nearest to GPU 0000:82:00.0 (distance 4)")
    assert nic.gpu_bdf(0) == GPU2


@pytest.mark.parametrize(
    "bad", ["", " mlx5_0:1", "mlx5_0:1, mlx5_1:1", "mlx5_0:1,", ",mlx5_0", "mlx5_0:x", "a;b", 7]
)
def test_choose_nic_refuses_a_malformed_explicit_nic(sysfs, bad):
    with pytest.raises(InvalidArgument, match="explicit NIC must be a comma-separated list"):
        choose_nic(bad, 0, sysfs, locate_gpu=at(GPU0))


def test_nic_choice_gives_the_ucx_net_devices_value():
    assert NicChoice("mlx5_0", "nearest to GPU 0000:03:00.0 (distance 4)").ucx_net_devices() == "mlx5_0:1"
    assert NicChoice("mlx5_0", "nearest to GPU 0000:03:00.0 (distance 4)").ucx_net_devices(2) == "mlx5_0:2"
    assert NicChoice("mlx5_0:1,mlx5_1:1", "explicit").ucx_net_devices() == "mlx5_0:1,mlx5_1:1"
    assert NicChoice(None, "no GPU").ucx_net_devices() is None
