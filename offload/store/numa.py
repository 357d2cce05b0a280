"""NUMA placement of the pinned arena: its pages on the socket the GPU hangs off.

    online_nodes()                  the machine's NUMA nodes ([0] where it has one, or no NUMA support)
    pci_numa_node(bus_id)           the node a PCI device (a GPU) is attached to, None where unknown
    gpu_node(device)                the same for a CUDA device
    arena_node(device)              where the cpu tier's arena goes: OFFLOAD_NUMA_NODE, else "auto"
    prefer(ptr, nbytes, node)       mbind MPOL_PREFERRED on an untouched range; None, or why it could not
    nodes_of(ptr, nbytes, samples)  {node: pages} of a sample of the range's pages (move_pages, query only)

Why: on a two-socket node a host->GPU copy from memory on the other socket crosses the inter-socket link, which
runs at a fraction of PCIe's rate and is shared by every GPU on the far side. Pinning faults every page in from the
thread that pins (or from the pre-fault threads), so without a policy the whole arena lands wherever those threads
happen to run. A preferred node (not a hard bind) keeps a full node from failing the run: the kernel then takes
pages from another node, and nodes_of() shows it.

OFFLOAD_NUMA_NODE: "auto" (default: the GPU's node, on a machine with several nodes and a GPU whose node the
kernel knows; otherwise none), "off", or a node number.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

import torch

from .. import env

__all__ = ["online_nodes", "pci_numa_node", "gpu_node", "arena_node", "prefer", "nodes_of"]

_SYSFS = "/sys"
_MPOL_PREFERRED = 1
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# syscall numbers (glibc wraps neither; libnuma would, but is not a dependency)
_SYSCALLS = {"x86_64": {"mbind": 237, "move_pages": 279}, "aarch64": {"mbind": 235, "move_pages": 239}}
_libc = None


def _syscall(name: str):
    global _libc
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return lambda *args: _libc.syscall(ctypes.c_long(numbers[name]), *args)


def _parse_list(text: str) -> list[int]:
    """A sysfs node list ("0-1,4") as numbers."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def online_nodes() -> list[int]:
    try:
        with open(f"{_SYSFS}/devices/system/node/online") as f:
            return _parse_list(f.read()) or [0]
    except (OSError, ValueError):
        return [0]


def pci_numa_node(bus_id: str) -> int | None:
    """The NUMA node of PCI device `bus_id` ("0000:17:00.0"), None where the kernel does not know (-1: one node,
    or firmware that does not say)."""
    try:
        with open(f"{_SYSFS}/bus/pci/devices/{bus_id.lower()}/numa_node") as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def gpu_node(device: torch.device) -> int | None:
    """The NUMA node of a CUDA device (from its PCI address), None where unknown."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None  # a torch too old to say where the GPU is
    bus_id = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
    return pci_numa_node(bus_id)


def arena_node(device: torch.device) -> int | None:
    """The node the cpu tier's arena prefers: OFFLOAD_NUMA_NODE if a number; none if "off"; "auto": the GPU's
    node where the machine has several (with one node there is nothing to choose)."""
    value = env.NUMA_NODE.get().lower()
    if value == "off":
        return None
    if value != "auto":
        nodes = online_nodes()
        if not value.isdigit() or int(value) not in nodes:
            raise ValueError(f"OFFLOAD_NUMA_NODE={value!r}: expected 'auto', 'off' or one of this machine's NUMA "
                             f"nodes {nodes}")
        return int(value)
    if len(online_nodes()) < 2:
        return None
    return gpu_node(device)


def prefer(ptr: int, nbytes: int, node: int) -> str | None:
    """Set MPOL_PREFERRED(node) on [ptr, ptr + nbytes) (page-aligned, its pages not yet touched: the policy
    applies to pages faulted in after it). None when set, else the reason it was not."""
    mbind = _syscall("mbind")
    if mbind is None:
        return f"no mbind syscall number for {platform.machine()}"
    mask = (ctypes.c_ulong * (node // 64 + 1))()
    mask[node // 64] = 1 << (node % 64)
    rc = mbind(ctypes.c_void_p(ptr), ctypes.c_ulong(nbytes), ctypes.c_int(_MPOL_PREFERRED), mask,
               ctypes.c_ulong(len(mask) * 64 + 1), ctypes.c_uint(0))
    if rc != 0:
        err = ctypes.get_errno()
        return f"mbind(MPOL_PREFERRED, node {node}) failed: {os.strerror(err)} (errno {err})"
    return None


def nodes_of(ptr: int, nbytes: int, samples: int = 64) -> dict[int, int]:
    """{node: pages} over `samples` pages spread evenly over the range (pages not faulted in yet are left out);
    {} where the kernel cannot say."""
    move_pages = _syscall("move_pages")
    pages = max(1, nbytes // _PAGE)
    count = min(samples, pages)
    if move_pages is None or nbytes <= 0:
        return {}
    addrs = (ctypes.c_void_p * count)(*[ptr + (i * pages // count) * _PAGE for i in range(count)])
    status = (ctypes.c_int * count)()
    # pid 0 (this process), nodes NULL: only report where each page is
    if move_pages(ctypes.c_int(0), ctypes.c_ulong(count), addrs, None, status, ctypes.c_int(0)) != 0:
        return {}
    out: dict[int, int] = {}
    for s in status:
        if s >= 0:  # negative: -ENOENT (not faulted in) and the like
            out[s] = out.get(s, 0) + 1
    return out
