"""The guest's NIC on the testbed: ``--net tap`` (default) or ``--net vhost-user[,queues=N]``.

``tap``: virtio-net on QEMU's in-process tap backend, the host's ``tap0`` bridged to
the guest network. ``vhost-user``: virtio-net whose data path runs in a vhost-user
switch on each host (:mod:`livemig.testbed.vswitch`, Open vSwitch with DPDK); QEMU
serves the socket, the switch connects to it. With N queue pairs the device gets
``mq=on`` and ``vectors=2N+2`` (one per queue, config and control); a Linux guest
uses min(N, vCPUs) of them by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from livemig.errors import UsageError

KINDS = ("tap", "vhost-user")
MAX_QUEUES = 8


@dataclass(frozen=True)
class NetSpec:
    kind: str = "tap"
    queues: int = 1

    @property
    def vhost_user(self) -> bool:
        return self.kind == "vhost-user"

    @property
    def text(self) -> str:
        return self.kind + (f",queues={self.queues}" if self.vhost_user else "")

    def qemu_args(self, mac: str, tap: str, socket: Path | None) -> list[str]:
        """The -netdev/-device pair for one end (``socket``: the vhost-user socket)."""
        nic = f"virtio-net-pci,netdev=net0,mac={mac},romfile="
        if not self.vhost_user:
            return ["-netdev", f"tap,id=net0,ifname={tap},script=no,downscript=no",
                    "-device", nic]
        assert socket is not None
        return ["-chardev", f"socket,id=vhu0,path={socket},server=on",
                "-netdev", f"vhost-user,id=net0,chardev=vhu0,queues={self.queues}",
                "-device", f"{nic},mq=on,vectors={2 * self.queues + 2}"]


def parse_net(text: str) -> NetSpec:
    """``tap`` | ``vhost-user`` | ``vhost-user,queues=N``; one-line errors."""
    kind, _, rest = text.strip().partition(",")
    if kind not in KINDS:
        raise UsageError(f"bad --net {text!r}: expected tap or vhost-user[,queues=N]")
    queues = 1
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if kind != "vhost-user" or key != "queues" or not sep:
            raise UsageError(f"bad --net {text!r}: unknown option {item!r} "
                             "(only vhost-user takes queues=N)")
        try:
            queues = int(value)
        except ValueError:
            raise UsageError(f"bad --net {text!r}: queues must be a number") from None
        if not 1 <= queues <= MAX_QUEUES:
            raise UsageError(f"bad --net {text!r}: queues must be in 1..{MAX_QUEUES}")
    return NetSpec(kind, queues)
