"""The lab's example domain: livemig's guest image booted directly by a libvirt
domain, on the testbed's guest network (the host's ``br0``), with one raw disk.

The guest agent's virtio-serial port is there (a socket libvirt names), so the agent
starts its workload at once instead of waiting 10 s for a port that never comes.
Used by the tests and as a template (``livemig testbed libvirt-uri`` + ``virsh
define``); a user's own domain needs none of it.
"""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import quoteattr

from livemig.lab.vm import AGENT_PORT_NAME
from livemig.paths import FIRMWARE_DIRS
from livemig.testbed import topology


def lab_domain_xml(name: str, emulator: Path, kernel: Path, initrd: Path, disk: str,
                   memory_mib: int = 256, workload: str = "idle") -> str:
    """``disk``: the image path as the daemons see it (a per-host path under
    /var/lib/libvirt/images for copied storage, a shared one otherwise)."""
    cmdline = (f"console=ttyS0 quiet livemig.workload={workload} "
               f"livemig.ip={topology.GUEST_IP}/{topology.GUEST_PREFIX}")
    firmware = "".join(f"<qemu:arg value='-L'/><qemu:arg value={quoteattr(str(d))}/>"
                       for d in FIRMWARE_DIRS)
    return f"""<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>{name}</name>
  <memory unit='MiB'>{memory_mib}</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{kernel}</kernel>
    <initrd>{initrd}</initrd>
    <cmdline>{cmdline}</cmdline>
  </os>
  <features><acpi/></features>
  <cpu mode='custom' match='exact'><model fallback='allow'>qemu64</model></cpu>
  <on_poweroff>destroy</on_poweroff>
  <devices>
    <emulator>{emulator}</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw' cache='none'/>
      <source file={quoteattr(disk)}/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <interface type='bridge'>
      <source bridge='br0'/>
      <mac address='{topology.GUEST_MAC}'/>
      <model type='virtio'/>
      <rom enabled='no'/>
    </interface>
    <channel type='unix'>
      <source mode='bind'/>
      <target type='virtio' name='{AGENT_PORT_NAME}'/>
    </channel>
    <serial type='file'>
      <source path='/var/log/libvirt/qemu/{name}.console'/>
      <target port='0'/>
    </serial>
    <memballoon model='none'/>
  </devices>
  <qemu:commandline>{firmware}</qemu:commandline>
</domain>
"""
