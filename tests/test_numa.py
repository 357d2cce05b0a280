"""NUMA placement of the pinned arena (offload/store/numa.py): an arena that prefers a node gets its pages there
(the kernel's own numa_maps and move_pages say so, not our bookkeeping), OFFLOAD_NUMA_NODE is checked and named
when wrong, a node the kernel refuses is reported rather than fatal, a PCI device's node is read as sysfs has it,
and a runtime reports how much it pinned and where."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import offload
from offload.store import PinnedArena, numa

MiB = 1 << 20
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="NUMA policy is Linux's mbind")


def numa_maps_policy(ptr: int) -> str | None:
    """The policy /proc/self/numa_maps shows for the mapping starting at ptr ("prefer:0", "default", ...)."""
    with open("/proc/self/numa_maps") as f:
        for line in f:
            start, policy, *_ = line.split()
            if int(start, 16) == ptr:
                return policy
    return None


def test_an_arena_that_prefers_a_node_gets_its_pages_there():
    node = numa.online_nodes()[-1]
    with PinnedArena(64 * MiB, lock=False, numa_node=node) as arena:
        assert arena.numa_node == node and arena.numa_error is None
        assert numa_maps_policy(arena.base_ptr) == f"prefer:{node}"
        assert numa.nodes_of(arena.base_ptr, arena.capacity) == {}  # nothing faulted in yet
        arena.buffer.fill_(1)
        assert numa.nodes_of(arena.base_ptr, arena.capacity) == {node: 64}
    with PinnedArena(4 * MiB, lock=False) as plain:  # no node asked for: the kernel's default policy
        assert plain.numa_node is None and numa_maps_policy(plain.base_ptr) == "default"


def test_a_node_the_kernel_refuses_is_reported_not_fatal():
    """A node the machine lacks (mbind: EINVAL): the arena works, unplaced, and says why."""
    missing = max(numa.online_nodes()) + 1
    with PinnedArena(4 * MiB, lock=False, numa_node=missing) as arena:
        assert arena.numa_node is None and "mbind" in arena.numa_error and "Invalid argument" in arena.numa_error
        arena.alloc(MiB).free()


def test_offload_numa_node_is_checked_and_named(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("OFFLOAD_NUMA_NODE", "off")
    assert numa.arena_node(cpu) is None
    monkeypatch.setenv("OFFLOAD_NUMA_NODE", str(numa.online_nodes()[0]))
    assert numa.arena_node(cpu) == numa.online_nodes()[0]
    for bad in (str(max(numa.online_nodes()) + 1), "socket0"):
        monkeypatch.setenv("OFFLOAD_NUMA_NODE", bad)
        with pytest.raises(ValueError, match="OFFLOAD_NUMA_NODE.*'auto', 'off'"):
            numa.arena_node(cpu)
    monkeypatch.setenv("OFFLOAD_NUMA_NODE", "auto")
    assert numa.arena_node(cpu) is None  # no GPU: nothing to be near


def test_a_pci_devices_node_is_read_as_sysfs_has_it():
    root = "/sys/bus/pci/devices"
    devices = sorted(os.listdir(root)) if os.path.isdir(root) else []
    if not devices:
        pytest.skip("no PCI devices in sysfs here")
    for bus_id in devices:
        with open(f"{root}/{bus_id}/numa_node") as f:
            raw = int(f.read())
        assert numa.pci_numa_node(bus_id) == (raw if raw >= 0 else None)
        assert numa.pci_numa_node(bus_id.upper()) == numa.pci_numa_node(bus_id)
    assert numa.pci_numa_node("ffff:ff:1f.7") is None


def test_a_runtime_reports_how_much_it_pinned_and_where(tmp_path, monkeypatch):
    node = numa.online_nodes()[0]
    monkeypatch.setenv("OFFLOAD_NUMA_NODE", str(node))
    cfg = offload.Config(params="cpu", optimizer="cpu", cpu_budget="32MiB", device_budget="16MiB")
    with offload.init(cfg) as rt:
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        model(torch.randn(4, 256)).sum().backward()
        pinned = rt.stats()["memory"]["pinned"]
    assert pinned["numa_node"] == node and pinned["numa_error"] is None
    assert pinned["arena_bytes"] == 32 * MiB
    # what the params' home blocks touched is on the node
    assert pinned["pages_by_node"] and set(pinned["pages_by_node"]) == {node}
    assert pinned["locked_bytes"] == (pinned["arena_bytes"] if pinned["lock_kind"] != "none" else 0)


@pytest.mark.cuda
def test_the_gpus_node_comes_from_its_pci_address():
    """torch must tell the GPU's PCI address, else gpu_node() is always None and "auto" silently places nothing."""
    props = torch.cuda.get_device_properties(0)
    assert hasattr(props, "pci_bus_id") and hasattr(props, "pci_device_id"), props
    node = numa.gpu_node(torch.device("cuda", 0))
    assert node is None or node in numa.online_nodes()
