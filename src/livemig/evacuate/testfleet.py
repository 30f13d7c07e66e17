"""A fleet of small domains on the testbed's source daemon (``livemig testbed fleet``).

Two kinds, their workloads cycled over the domains:

- ``mixed`` (the default): idle, a small-write busy guest (128 B rewrites in a hot
  set: what lz4 deltas are for), a whole-page writer, then idle again, writers at a
  few MiB/s: a fleet that converges with any profile.
- ``busy``: databases and caches, the guests an evacuation hangs on. Small-write
  writers at 24 and 12 MiB/s (128 B records, 85 % of writes in 8 % of the set: the
  issue's "busy database"), a whole-page writer of mixed data at 16 MiB/s, one idle
  guest. Each dirties faster than its share of a 100 Mbit/s link carries plain
  pages, so none converges without a delta encoding or a throttle.

Sized for this 2-core TCG machine: each guest's vCPU is a host thread, and writers
at a rate (not flat out) leave the cores to the migrations. Each
domain has its own MAC and guest address (10.78.0.20 + i) and a small raw disk on the
lab's shared storage, so ``livemig evacuate`` needs no disk copy.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from livemig import paths
from livemig.errors import SetupError
from livemig.testbed import libvirtd, topology

FLEETS: dict[str, tuple[str, ...]] = {
    "mixed": (
        "idle",
        "mem:size=64M,rate=6M,hot=80/10,touch=128",
        "mem:size=64M,rate=12M",
    ),
    "busy": (
        "mem:size=96M,rate=24M,hot=85/8,touch=128",
        "mem:size=96M,rate=16M,hot=70/20,touch=4096,fill=mixed",
        "mem:size=96M,rate=12M,hot=85/8,touch=128",
        "idle",
    ),
}
DISK_BYTES = 16 << 20
FIRST_HOST_OCTET = 20


def workload(i: int, kind: str = "mixed") -> str:
    loads = FLEETS[kind]
    return loads[i % len(loads)]


def domain_xml(name: str, i: int, memory_mib: int, emulator: Path, disk: Path,
               kind: str = "mixed") -> str:
    from livemig.virt.domain import lab_domain_xml

    xml = lab_domain_xml(name, emulator, paths.guest_kernel(), paths.guest_initrd(),
                         str(disk), memory_mib=memory_mib, workload=workload(i, kind))
    ip = f"10.78.0.{FIRST_HOST_OCTET + i}"
    mac = f"52:54:00:4c:4e:{FIRST_HOST_OCTET + i:02x}"
    return xml.replace(f"livemig.ip={topology.GUEST_IP}/", f"livemig.ip={ip}/").replace(
        topology.GUEST_MAC, mac)


def define(count: int, memory_mib: int, prefix: str = "fleet",
           emulator: Path | None = None, kind: str = "mixed") -> dict[str, str]:
    """Define and start ``count`` domains of the ``kind`` fleet on src; their names
    and workloads."""
    from livemig.virt.conn import libvirt_module, message

    if kind not in FLEETS:
        raise SetupError(f"no fleet kind {kind!r} (kinds: {', '.join(FLEETS)})")
    if not libvirtd.is_running("src"):
        raise SetupError("no libvirt daemon on src (livemig testbed up --libvirt)")
    emulator = emulator or paths.default_qemu()
    if not emulator.exists():
        raise SetupError(f"no QEMU at {emulator}")
    libvirt = libvirt_module()
    conn = libvirt.open(libvirtd.local_uri("src"))
    out: dict[str, str] = {}
    try:
        for i in range(count):
            name = f"{prefix}-{i}"
            disk = libvirtd.shared_dir() / f"{name}.img"
            with open(disk, "wb") as f:
                f.truncate(DISK_BYTES)
            try:
                conn.defineXML(domain_xml(name, i, memory_mib, emulator, disk,
                                          kind)).create()
            except libvirt.libvirtError as e:
                raise SetupError(f"domain {name}: {message(e)}") from None
            out[name] = workload(i, kind)
    finally:
        conn.close()
    return out


def remove(names: list[str], within_s: float = 60.0) -> None:
    """Destroy and undefine these domains wherever they are (tests' cleanup). A
    migration still under way (livemig was killed, libvirt carries on) moves a domain
    from one host to the other while the hosts are looked at one by one: look again
    until none is left anywhere, or ``within_s`` passed."""
    from livemig.virt.conn import libvirt_module

    libvirt = libvirt_module()
    deadline = time.monotonic() + within_s
    while _remove_once(libvirt, set(names)) and time.monotonic() < deadline:
        time.sleep(1.0)
    for n in names:
        (libvirtd.shared_dir() / f"{n}.img").unlink(missing_ok=True)


def _remove_once(libvirt: Any, names: set[str]) -> int:
    """One pass over the hosts; how many of ``names`` it found."""
    found = 0
    for side in libvirtd.ALL_SIDES:
        if not libvirtd.is_running(side):
            continue
        conn = libvirt.open(libvirtd.local_uri(side))
        try:
            for d in conn.listAllDomains():
                if d.name() not in names:
                    continue
                found += 1
                try:  # a domain that migrates away meanwhile: found again next pass
                    if d.isActive():
                        d.destroy()
                    if d.isPersistent():
                        d.undefine()
                except libvirt.libvirtError:
                    continue
        finally:
            conn.close()
    return found
