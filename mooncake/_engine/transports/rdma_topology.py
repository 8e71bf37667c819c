"""NIC topology from sysfs: which RDMA devices are close to which memory.

For every NUMA node ``N`` the matrix entry ``"cpu:N"`` prefers the devices whose
``/sys/class/infiniband/<dev>/device/numa_node`` is ``N`` (a device with unknown NUMA node, -1,
is preferred everywhere); for every NVIDIA GPU ``i`` (PCI vendor 0x10de, display class) the entry
``"cuda:i"`` prefers the devices at the smallest PCIe distance (hops between the two devices'
paths under ``/sys/devices``). Everything not preferred is "available". ``"*"`` prefers all.
``MC_CUSTOM_TOPO_JSON`` (a file holding Mooncake's matrix JSON) replaces discovery.

The sysfs root is a parameter so tests can build a fake tree.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

from mooncake._core.rdma import PriorityMatrix
from mooncake.errors import InvalidArgumentError, ProtocolError


@dataclass(frozen=True)
class NicInfo:
    name: str
    numa_node: int
    pci_path: str


def _read_int(path: str, default: int) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or str(default), 0)
    except (OSError, ValueError):
        return default


def _read_str(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def pci_distance(a: str, b: str) -> int:
    """Hops between two sysfs device paths (through their deepest common bridge)."""
    pa = [p for p in a.split("/") if p]
    pb = [p for p in b.split("/") if p]
    common = 0
    for x, y in zip(pa, pb, strict=False):
        if x != y:
            break
        common += 1
    return len(pa) + len(pb) - 2 * common


def nic_info(name: str, sysfs: str = "/sys") -> NicInfo:
    dev = os.path.join(sysfs, "class", "infiniband", name, "device")
    return NicInfo(
        name,
        _read_int(os.path.join(dev, "numa_node"), -1),
        os.path.realpath(dev) if os.path.exists(dev) else "",
    )


def numa_nodes(sysfs: str = "/sys") -> list[int]:
    base = os.path.join(sysfs, "devices", "system", "node")
    try:
        nodes = sorted(
            int(n[4:]) for n in os.listdir(base) if n.startswith("node") and n[4:].isdigit()
        )
    except OSError:
        nodes = []
    return nodes or [0]


def gpus(sysfs: str = "/sys") -> list[str]:
    """sysfs paths of NVIDIA GPUs, in PCI bus order (CUDA's default enumeration)."""
    base = os.path.join(sysfs, "bus", "pci", "devices")
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for e in entries:
        p = os.path.join(base, e)
        if _read_str(os.path.join(p, "vendor")) == "0x10de" and _read_str(
            os.path.join(p, "class")
        ).startswith("0x03"):
            out.append(os.path.realpath(p))
    return out


def discover(names: Sequence[str], sysfs: str = "/sys") -> PriorityMatrix:
    """The priority matrix for ``names`` (index order kept)."""
    custom = os.environ.get("MC_CUSTOM_TOPO_JSON")
    if custom:
        try:
            with open(custom) as f:
                obj = json.load(f)
        except (OSError, ValueError) as e:
            raise InvalidArgumentError(f"MC_CUSTOM_TOPO_JSON={custom!r}: {e}") from None
        try:
            return PriorityMatrix.from_json(obj, names, f"MC_CUSTOM_TOPO_JSON={custom!r}")
        except ProtocolError as e:
            raise InvalidArgumentError(str(e)) from None
    infos = [nic_info(n, sysfs) for n in names]
    n = len(infos)
    entries: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for node in numa_nodes(sysfs):
        pref = tuple(i for i, x in enumerate(infos) if x.numa_node in (node, -1))
        entries[f"cpu:{node}"] = (pref, tuple(i for i in range(n) if i not in pref))
    for g, gpath in enumerate(gpus(sysfs)):
        dists = [pci_distance(gpath, x.pci_path) if x.pci_path else 1 << 16 for x in infos]
        best = min(dists) if dists else 0
        pref = tuple(i for i in range(n) if dists[i] == best)
        entries[f"cuda:{g}"] = (pref, tuple(i for i in range(n) if i not in pref))
    entries["*"] = (tuple(range(n)), ())
    return PriorityMatrix(entries, n)


def rdma_devices(sysfs: str = "/sys") -> list[str]:
    """The RDMA device names under ``<sysfs>/class/infiniband`` (sorted; none: empty)."""
    try:
        return sorted(os.listdir(os.path.join(sysfs, "class", "infiniband")))
    except OSError:
        return []


def local_topology_json(device_filter: str | None = None, sysfs: str = "/sys") -> str:
    """Mooncake's topology JSON (``{"cpu:0": [[preferred], [available]], ...}``) of this host's
    RDMA devices, optionally only those named in ``device_filter`` (comma-separated); ``{}``
    when there are none. ``MC_CUSTOM_TOPO_JSON`` replaces discovery as in :func:`discover`."""
    names = rdma_devices(sysfs)
    custom = os.environ.get("MC_CUSTOM_TOPO_JSON")
    if custom and not names:  # a matrix given for devices this host does not show
        try:
            with open(custom) as f:
                obj = json.load(f)
        except (OSError, ValueError) as e:
            raise InvalidArgumentError(f"MC_CUSTOM_TOPO_JSON={custom!r}: {e}") from None
        if not isinstance(obj, dict):
            raise InvalidArgumentError(f"MC_CUSTOM_TOPO_JSON={custom!r}: not a JSON object")
        names = sorted({n for v in obj.values() if isinstance(v, list) for grp in v for n in grp})
    if device_filter:
        wanted = {n.strip() for n in device_filter.split(",") if n.strip()}
        names = [n for n in names if n in wanted]
    if not names:
        return "{}"
    return json.dumps(discover(names, sysfs).to_json(names))
