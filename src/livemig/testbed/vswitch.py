"""A vhost-user switch on one testbed host: Open vSwitch with DPDK (Debian's
``openvswitch-switch-dpdk``), private to the host and to the run.

::

    lm-src (or lm-dst)
      QEMU ──vhost-user socket── ovs-vswitchd-dpdk: vbr0 (netdev datapath)
      (server=on)                  ├─ vhu0  dpdkvhostuserclient (the guest's NIC)
                                   └─ vh0   system port ── veth ── vh0br ─ br0 ─ up0 ─▶ client

Each host gets its own ``ovsdb-server`` and ``ovs-vswitchd`` with their database,
sockets, logs and DPDK runtime files in the run's directory (nothing of the machine's
own Open vSwitch is used or touched), both started inside the host's namespace, so
they are also killed by ``livemig testbed down``.

Choices, and why:

- DPDK without hugepages (``--no-huge -m 256 --legacy-mem``): vhost-user maps the
  guest's RAM from the fd QEMU passes (the guest RAM is a shared file in /dev/shm),
  so the switch's own packet buffers are all it allocates; --no-huge keeps the
  host's hugepage pool untouched. OVS adds ``--in-memory`` unless told otherwise and
  that conflicts with --no-huge; an explicit ``--legacy-mem`` stops it, and a
  ``--file-prefix`` per host keeps the two instances' runtime files apart.
- ``per-port-memory``: a pool sized for the port (tens of MB) instead of OVS's
  shared 256K-mbuf pool.
- The poll-mode thread sleeps when idle (``pmd-maxsleep`` 1 ms: ~1.5 % of a core
  for an idle port instead of 100 %), and is one thread on one CPU
  (``pmd-cpu-mask``).
- The uplink is a veth whose bridge end has TX checksum offload off: a datagram
  from the client crosses veths with its checksum still to be done (CHECKSUM_PARTIAL)
  and OVS's packet-socket port would hand it to the guest like that; with offload
  off on the way in, the kernel completes it first.
- Dirty logging: DPDK's vhost library offers ``VHOST_USER_PROTOCOL_F_LOG_SHMFD`` and
  ``VHOST_F_LOG_ALL``; QEMU enables the log when a migration starts, and the switch
  then marks every guest page it writes (received packets, used rings).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from livemig.errors import SetupError
from livemig.testbed import netns

log = logging.getLogger(__name__)

PACKAGE = "openvswitch-switch-dpdk"
VSWITCHD = Path("/usr/lib/openvswitch-switch-dpdk/ovs-vswitchd-dpdk")
SCHEMA = Path("/usr/share/openvswitch/vswitch.ovsschema")
MEMPOOL_DRIVER = Path("/usr/lib/x86_64-linux-gnu/dpdk/pmds-23.0/librte_mempool_ring.so.23")
BRIDGE = "vbr0"
PORT = "vhu0"  # the guest's vhost-user port
UPLINK = "vh0"  # OVS side of the veth into the host's br0
UPLINK_PEER = "vh0br"
HOST_BRIDGE = "br0"
NETDEV_TAP = "ovs-netdev"  # the netdev datapath's own internal port
DPDK_MEM_MB = 256
PMD_MAXSLEEP_US = 1000
START_TIMEOUT_S = 30.0
DPDK_RUNTIME = Path("/var/run/dpdk")


def missing() -> str | None:
    """Why the switch cannot run here (None: it can)."""
    for f, what in ((VSWITCHD, PACKAGE), (SCHEMA, "openvswitch-common"),
                    (MEMPOOL_DRIVER, "librte-mempool-ring23")):
        if not f.exists():
            return f"{f} not found: install {what} (make setup)"
    for tool in ("ovsdb-tool", "ovsdb-server", "ovs-vsctl", "ovs-appctl", "ethtool"):
        if shutil.which(tool) is None:
            return f"{tool} not found: install {PACKAGE} and ethtool (make setup)"
    return None


@dataclass
class Switch:
    """One host's switch; :meth:`start` then :meth:`stop` (also after a failure)."""

    host: str  # testbed host name: src | dst
    ns: str  # its namespace
    run_dir: Path
    tag: str  # unique per run and host (DPDK file prefix)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def dir(self) -> Path:
        return self.run_dir / f"ovs-{self.host}"

    @property
    def socket(self) -> Path:
        """The guest NIC's vhost-user socket (QEMU listens, the switch connects)."""
        return self.dir / f"{PORT}.sock"

    @property
    def db(self) -> str:
        return f"unix:{self.dir / 'db.sock'}"

    def _env(self) -> dict[str, str]:
        d = str(self.dir)
        return {**os.environ, "OVS_RUNDIR": d, "OVS_LOGDIR": d, "OVS_DBDIR": d}

    def vsctl(self, *args: str, wait: bool = True) -> str:
        argv = ["ovs-vsctl", f"--db={self.db}", "--timeout=20"]
        if not wait:
            argv.append("--no-wait")
        p = subprocess.run(argv + list(args), capture_output=True, text=True, timeout=30,
                           env=self._env())
        if p.returncode != 0:
            raise SetupError(f"{self.host} switch: ovs-vsctl {' '.join(args)}: "
                             f"{(p.stderr or p.stdout).strip()}")
        return p.stdout.strip()

    def _spawn(self, name: str, argv: list[str]) -> None:
        logf = open(self.dir / f"{name}.out", "wb")  # noqa: SIM115 - handed to the child
        try:
            self.procs.append(subprocess.Popen(
                netns.exec_prefix(self.ns) + argv, stdin=subprocess.DEVNULL, stdout=logf,
                stderr=subprocess.STDOUT, env=self._env(), start_new_session=True))
        except OSError as e:
            raise SetupError(f"{self.host} switch: cannot run {argv[0]}: {e}") from e
        finally:
            logf.close()

    def _wait_for(self, path: Path, what: str) -> None:
        end = time.monotonic() + START_TIMEOUT_S
        while not path.exists():
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > end:
                raise SetupError(f"{self.host} switch: {what} did not start: "
                                 f"{self._log_tail(what)}")
            time.sleep(0.05)

    def _log_tail(self, name: str) -> str:
        for f in (self.dir / f"{name}.log", self.dir / f"{name}.out"):
            with contextlib.suppress(OSError):
                lines = [ln for ln in f.read_text(errors="replace").splitlines()
                         if "|ERR|" in ln or "|EMER|" in ln or "rror" in ln]
                if lines:
                    return lines[-1]
        return "no log"

    def start(self, cpu: int) -> None:
        """Database, switch daemon, bridge, the guest's port and the uplink."""
        why = missing()
        if why:
            raise SetupError(why)
        self.dir.mkdir(parents=True, exist_ok=True)
        d = self.dir
        self._remove_links()  # what a run that was killed left
        made = subprocess.run(["ovsdb-tool", "create", str(d / "conf.db"), str(SCHEMA)],
                              capture_output=True, text=True, timeout=30)
        if made.returncode != 0:
            raise SetupError(f"{self.host} switch: ovsdb-tool create: {made.stderr.strip()}")
        self._spawn("ovsdb-server", [
            "ovsdb-server", str(d / "conf.db"), f"--remote=punix:{d / 'db.sock'}",
            f"--unixctl={d / 'ovsdb-server.ctl'}", f"--pidfile={d / 'ovsdb-server.pid'}",
            f"--log-file={d / 'ovsdb-server.log'}"])
        self._wait_for(d / "db.sock", "ovsdb-server")
        self.vsctl("init", wait=False)
        extra = (f"--no-huge -m {DPDK_MEM_MB} --legacy-mem --no-pci "
                 f"--file-prefix={self.tag}")
        self.vsctl("set", "Open_vSwitch", ".", "other_config:dpdk-init=true",
                   f"other_config:dpdk-extra={extra}",
                   f"other_config:pmd-cpu-mask={1 << cpu:#x}",
                   f"other_config:pmd-maxsleep={PMD_MAXSLEEP_US}",
                   "other_config:per-port-memory=true", wait=False)
        self._spawn("ovs-vswitchd", [
            str(VSWITCHD), self.db, f"--unixctl={d / 'ovs-vswitchd.ctl'}",
            f"--pidfile={d / 'ovs-vswitchd.pid'}", f"--log-file={d / 'ovs-vswitchd.log'}"])
        self._wait_for(d / "ovs-vswitchd.ctl", "ovs-vswitchd")
        self.vsctl("add-br", BRIDGE, "--", "set", "bridge", BRIDGE, "datapath_type=netdev")
        self.vsctl("add-port", BRIDGE, PORT, "--", "set", "Interface", PORT,
                   "type=dpdkvhostuserclient", f"options:vhost-server-path={self.socket}")
        run = netns.run
        run("ip", "link", "add", UPLINK, "type", "veth", "peer", "name", UPLINK_PEER,
            ns=self.ns)
        for dev in (UPLINK, UPLINK_PEER):
            run("ethtool", "-K", dev, "tx", "off", ns=self.ns)
        run("ip", "link", "set", UPLINK, "up", ns=self.ns)
        run("ip", "link", "set", UPLINK_PEER, "master", HOST_BRIDGE, "up", ns=self.ns)
        self.vsctl("add-port", BRIDGE, UPLINK)
        log.info("%s switch up in %s (socket %s)", self.host, self.ns, self.socket)

    def stop(self) -> None:
        """Stop both daemons (politely, then SIGKILL) and remove the uplink."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
        self.procs.clear()
        self._remove_links()
        shutil.rmtree(DPDK_RUNTIME / self.tag, ignore_errors=True)

    def _remove_links(self) -> None:
        """The uplink veth, and the tap devices the netdev datapath made for its
        internal ports (they outlive ovs-vswitchd)."""
        if netns.exists(self.ns):
            for dev in (UPLINK, BRIDGE, NETDEV_TAP):
                netns.run("ip", "link", "del", dev, ns=self.ns, check=False)

    def running(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def appctl(self, *args: str) -> str:
        p = subprocess.run(["ovs-appctl", "-t", str(self.dir / "ovs-vswitchd.ctl"),
                            *args], capture_output=True, text=True, timeout=15)
        if p.returncode != 0:
            raise SetupError(f"{self.host} switch: ovs-appctl {' '.join(args)}: "
                             f"{(p.stderr or p.stdout).strip()}")
        return p.stdout

    def counters(self) -> dict[str, int]:
        """Packets through the guest's port: rx = sent by the guest, tx = sent to it
        (the same meaning as a tap's counters seen from the host). Read live from the
        datapath: the database's Interface statistics lag by up to 5 s."""
        try:
            text = self.appctl("dpctl/show", "-s") if self.running() else ""
        except (SetupError, OSError, subprocess.SubprocessError):
            text = ""
        return parse_port_counters(text, PORT)

    def queue_counters(self) -> dict[str, int]:
        """Good packets per virtqueue of the guest's port (rx_qN: sent by the guest on
        its queue pair N, tx_qN: written by the switch into the guest's queue N), from
        the database (refreshed by the switch every 5 s)."""
        return {k.removesuffix("_good_packets"): v for k, v in self._statistics().items()
                if k.endswith("_good_packets") and k.startswith(("rx_q", "tx_q"))}

    def drop_counters(self) -> dict[str, int]:
        """The guest's port's drop counters (e.g. ``ovs_tx_failure_drops``: packets
        the switch could not write because the guest's receive ring was full), from
        the database (refreshed every 5 s)."""
        return {k: v for k, v in self._statistics().items() if "drop" in k}

    def _statistics(self) -> dict[str, int]:
        try:
            text = self.vsctl("--format=json", "--columns=statistics", "list",
                              "Interface", PORT, wait=False) if self.running() else ""
            data = json.loads(text)["data"][0][0][1]  # ["map", [[key, value], ...]]
            return {str(k): int(v) for k, v in sorted(data)}
        except (SetupError, ValueError, LookupError, TypeError, OSError,
                subprocess.SubprocessError):
            return {}

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def pmd_cpu() -> int:
    """The CPU for the poll-mode thread: the last one this process may use."""
    return max(os.sched_getaffinity(0))


def parse_port_counters(text: str, port: str) -> dict[str, int]:
    """RX/TX packets of ``port`` in ``ovs-appctl dpctl/show -s`` output (-1: absent)."""
    m = re.search(rf"port \d+: {re.escape(port)}\b.*?\n\s+RX packets:(\d+).*?\n"
                  r"\s+TX packets:(\d+)", text)
    if m is None:
        return {"rx_packets": -1, "tx_packets": -1}
    return {"rx_packets": int(m.group(1)), "tx_packets": int(m.group(2))}
