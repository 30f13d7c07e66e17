"""One libvirt daemon per testbed host (``livemig testbed up --libvirt``).

Each of lm-src and lm-dst gets a privileged ``libvirtd`` of its own, so that a domain
really moves from one daemon to another the way it does between two machines:

- its own network namespace (the host's), listening on the host's migration
  address with TLS, so ``qemu+tls://10.77.0.1/system?pkipath=...`` and
  ``qemu+tls://10.77.0.2/system?pkipath=...`` reach one each (:func:`uri`): the
  daemon's certificate is the host's from the testbed's PKI
  (:mod:`livemig.tls.testbed`), and it accepts clients with a certificate of either
  testbed host only (``tls_allowed_dn_list``). Its QEMUs migrate over TLS with the
  same certificates (``migrate_tls_x509_cert_dir``, peers verified) when asked
  (``VIR_MIGRATE_TLS``: ``livemig migrate --domain`` between the two hosts). Plain
  TCP without authentication (``auth_tcp = "none"``, :func:`tcp_uri`) stays open
  for users who ask for it: this is a test lab on one machine, never a deployment;
- its own mount and UTS namespaces: ``/etc/libvirt``, ``/run/libvirt``,
  ``/var/lib/libvirt``, ``/var/cache/libvirt`` and ``/var/log/libvirt`` are bind
  mounts of ``/run/livemig/libvirt/<host>/{etc,run,lib,cache,log}``, so configuration,
  sockets, domain definitions, images (``/var/lib/libvirt/images``), capability cache
  and logs are per host, and the host name is the host's (``lm-src``, ``lm-dst``);
- its own host UUID (``host_uuid``: libvirt refuses to migrate between two daemons
  with the same one).

A system-wide libvirt is neither needed nor touched: only ``libvirt-daemon`` and its
QEMU driver are installed (``.ci/deps.sh``), and the ``libvirt-qemu`` user that
libvirt 9.0 resolves at start-up (even when QEMU runs as root, as here) exists only
in the daemon's mount namespace (a private copy of ``/etc/passwd`` and
``/etc/group``). The only things created outside ``/run/livemig`` are the empty
mount points ``/run/libvirt``, ``/var/lib/libvirt``, ``/var/cache/libvirt`` and
``/var/log/libvirt`` that the Debian packages' own daemon would use.

QEMU runs as root without a security driver, cgroups or per-domain mount namespaces
(none of which the lab needs); its stdio goes to a file instead of ``virtlogd``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from livemig import paths
from livemig.errors import SetupError
from livemig.testbed import netns, topology
from livemig.tls import creds, pki
from livemig.tls import testbed as tls_testbed

SIDES = ("src", "dst")
ALL_SIDES = ("src", "dst", "dst2")  # dst2: the second destination (testbed up --hosts 2)
TCP_PORT = 16509
TLS_PORT = 16514  # libvirt's default for qemu+tls
START_TIMEOUT = 30.0
# inside the daemon's mount namespace: where each per-host directory is mounted
_MOUNTS = {"etc": "/etc/libvirt", "run": "/run/libvirt", "lib": "/var/lib/libvirt",
           "cache": "/var/cache/libvirt", "log": "/var/log/libvirt"}
_QEMU_USER = "libvirt-qemu"
_QEMU_UID = 64055
POOL_NAME = "default"
IMAGES_DIR = "/var/lib/libvirt/images"  # per host (inside the host's mount namespace)


def root() -> Path:
    return paths.run_root() / "libvirt"


def host_dir(side: str) -> Path:
    return root() / side


def caps_store() -> Path:
    """QEMU capabilities the daemons probed, kept across their restarts (outside
    :func:`root`, which ``down`` removes)."""
    return paths.run_root() / "libvirt-qemu-caps"


_CAPS_SUBDIR = Path("cache") / "qemu" / "capabilities"


def uri(side: str) -> str:
    """The URI a client (or the other daemon) uses to reach ``side``'s daemon: TLS,
    with the testbed PKI's source-host client certificate (the daemons accept either
    host's, so the same URI works from the other daemon, peer to peer)."""
    return (f"qemu+tls://{topology.MIG_ADDR[side]}/system"
            f"?pkipath={tls_testbed.host_dir('src')}")


def tcp_uri(side: str) -> str:
    """Plain TCP without authentication (still open, for users who ask for it)."""
    return f"qemu+tcp://{topology.MIG_ADDR[side]}/system"


def local_uri(side: str) -> str:
    """The daemon's UNIX socket, reachable from the root namespace too."""
    return f"qemu+unix:///system?socket={host_dir(side) / 'run' / 'libvirt-sock'}"


def side_of_address(host: str) -> str | None:
    """The testbed host whose migration address is ``host`` (None: not one of ours)."""
    for side, addr in topology.MIG_ADDR.items():
        if addr == host:
            return side
    return None


def state_file() -> Path:
    return root() / "daemons.json"  # not state.json: run dirs use that name


def read_state() -> dict[str, Any]:
    try:
        return dict(json.loads(state_file().read_text()))
    except (OSError, ValueError):
        return {}


def daemon_pid(side: str) -> int | None:
    try:
        pid = int((host_dir(side) / "run" / "libvirtd.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    return pid if comm == "libvirtd" else None


def is_running(side: str) -> bool:
    return daemon_pid(side) is not None


def _libvirtd_conf(side: str, host_uuid: str) -> str:
    host_pki = tls_testbed.host_dir(side)
    peers = ", ".join(f'"{creds.dn_string(pki.subject(topology.HOSTS[s]))}"'
                      for s in ALL_SIDES)
    return "\n".join([
        "# livemig testbed: TLS with the testbed's PKI; TEST LAB ONLY - plain TCP "
        "without authentication too",
        "listen_tls = 1",
        "listen_tcp = 1",
        f'listen_addr = "{topology.MIG_ADDR[side]}"',
        f'tls_port = "{TLS_PORT}"',
        f'ca_file = "{host_pki / "ca-cert.pem"}"',
        f'cert_file = "{host_pki / "server-cert.pem"}"',
        f'key_file = "{host_pki / "server-key.pem"}"',
        f"tls_allowed_dn_list = [{peers}]",
        f'tcp_port = "{TCP_PORT}"',
        'auth_tcp = "none"',
        'auth_unix_rw = "none"',
        f'host_uuid = "{host_uuid}"',
        "log_level = 3",
        'log_outputs = "3:file:/var/log/libvirt/libvirtd.log"',
        "keepalive_interval = 5",
        "",
    ])


def _qemu_conf(side: str) -> str:
    addr = topology.MIG_ADDR[side]
    return "\n".join([
        "# livemig testbed: QEMU as root, no confinement (a lab on one machine)",
        'user = "root"',
        'group = "root"',
        "dynamic_ownership = 0",
        "remember_owner = 0",
        'security_driver = "none"',
        "cgroup_controllers = [ ]",
        "namespaces = [ ]",
        'stdio_handler = "file"',
        # incoming migrations and NBD disk copies listen on the migration link, and the
        # source is told this address (the host name would not resolve)
        f'migration_address = "{addr}"',
        f'migration_host = "{addr}"',
        # VIR_MIGRATE_TLS: the host's certificates from the testbed's PKI, and the
        # peer's checked against the CA (the stream and the NBD disk copy)
        f'migrate_tls_x509_cert_dir = "{tls_testbed.host_dir(side)}"',
        "migrate_tls_x509_verify = 1",
        "",
    ])


def _passwd_copy(d: Path) -> None:
    """/etc/passwd and /etc/group plus libvirt's QEMU user, for the daemon's eyes only."""
    passwd = Path("/etc/passwd").read_text()
    group = Path("/etc/group").read_text()
    if not any(ln.startswith(f"{_QEMU_USER}:") for ln in passwd.splitlines()):
        passwd += (f"{_QEMU_USER}:x:{_QEMU_UID}:{_QEMU_UID}:livemig testbed:"
                   "/var/lib/libvirt:/usr/sbin/nologin\n")
    if not any(ln.startswith(f"{_QEMU_USER}:") for ln in group.splitlines()):
        group += f"{_QEMU_USER}:x:{_QEMU_UID}:\n"
    (d / "passwd").write_text(passwd)
    (d / "group").write_text(group)


def _start_script(side: str, d: Path) -> str:
    lines = ["set -e", "mount --make-rprivate /",
             f"mount --bind {d / 'passwd'} /etc/passwd",
             f"mount --bind {d / 'group'} /etc/group",
             f"hostname {topology.HOSTS[side]}"]
    for sub, target in _MOUNTS.items():
        lines.append(f"mount --bind {d / sub} {target}")
    lines.append("exec libvirtd --listen --pid-file /run/libvirt/libvirtd.pid")
    return "\n".join(lines) + "\n"


def _prepare(side: str, host_uuid: str) -> Path:
    d = host_dir(side)
    if d.exists():
        shutil.rmtree(d)
    for sub in _MOUNTS:
        (d / sub).mkdir(parents=True)
    (d / "lib" / "images").mkdir()
    (d / "log" / "qemu").mkdir()
    _restore_caps(d)
    for target in _MOUNTS.values():
        Path(target).mkdir(parents=True, exist_ok=True)  # mount points only
    (d / "etc" / "libvirtd.conf").write_text(_libvirtd_conf(side, host_uuid))
    (d / "etc" / "qemu.conf").write_text(_qemu_conf(side))
    _passwd_copy(d)
    (d / "start.sh").write_text(_start_script(side, d))
    return d


def _restore_caps(d: Path) -> None:
    """A host's libvirt keeps the QEMU capabilities it probed in ``/var/cache/libvirt``
    across restarts; the testbed's per-host cache is made afresh with the daemon, so it
    is filled from what the daemons probed before. Without it every first migration
    of an emulator into a fresh daemon paid libvirt's probe of that emulator (a ``-S``
    QEMU queried over QMP: ~4.5 s under TCG) inside the migration call, and benchmarks
    charged it to whichever profile ran first. libvirt revalidates every file (the
    binary's ctime, libvirt's own version, the kernel) and probes again when stale."""
    store = caps_store()
    if not store.is_dir():
        return
    dest = d / _CAPS_SUBDIR
    dest.mkdir(parents=True, exist_ok=True)
    for f in store.glob("*.xml"):
        with contextlib.suppress(OSError):
            shutil.copy2(f, dest / f.name)


def save_caps(*dirs: Path) -> None:
    """Keep what the daemons of host dirs ``dirs`` probed (see :func:`_restore_caps`);
    the kept files of emulators that are gone (a test's temporary install) are
    dropped."""
    store = caps_store()
    with contextlib.suppress(OSError):
        for d in dirs:
            src = d / _CAPS_SUBDIR
            if src.is_dir():
                store.mkdir(parents=True, exist_ok=True)
                for f in src.glob("*.xml"):
                    shutil.copy2(f, store / f.name)
        for f in store.glob("*.xml"):
            emulator = _caps_emulator(f)
            if emulator is None or not emulator.exists():
                f.unlink()


def _caps_emulator(f: Path) -> Path | None:
    """The emulator a libvirt capabilities cache file describes (its first element)."""
    with contextlib.suppress(OSError), f.open(errors="replace") as fh:
        m = re.search(r"<emulator>([^<]+)</emulator>", fh.read(1024))
        return Path(m.group(1)) if m else None
    return None


def _wait_ready(side: str, proc: subprocess.Popen[bytes], deadline: float) -> None:
    sock = host_dir(side) / "run" / "libvirt-sock"
    addr = (topology.MIG_ADDR[side], TCP_PORT)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = (host_dir(side) / "daemon.out").read_text(errors="replace").strip()
            raise SetupError(f"libvirtd on {side} exited with status {proc.returncode}: "
                             f"{out.splitlines()[-1] if out else 'see its log'}")
        if sock.exists() and daemon_pid(side) and _tcp_open(side, addr) \
                and _tcp_open(side, (addr[0], TLS_PORT)):
            return
        time.sleep(0.1)
    raise SetupError(f"libvirtd on {side} did not come up within {START_TIMEOUT:.0f} s "
                     f"(log {host_dir(side) / 'log' / 'libvirtd.log'})")


def _tcp_open(side: str, addr: tuple[str, int]) -> bool:
    def probe() -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(addr) == 0
    return netns.call_in(topology.HOSTS[side], probe)


def up() -> dict[str, str]:
    """Start the daemons on a running testbed (no-op for one already running)."""
    if shutil.which("libvirtd") is None:
        raise SetupError("libvirtd not found: install the Debian packages (make deps)")
    if not topology.is_up():
        raise SetupError("the testbed is down (livemig testbed up --libvirt)")
    state = read_state()
    deadline = time.monotonic() + START_TIMEOUT
    sides = [*SIDES, *([topology.EXTRA_DST] if topology.has_dst2() else [])]
    for side in sides:
        if is_running(side):
            continue
        host_uuid = str(uuid.uuid4())
        tls_testbed.ensure()
        d = _prepare(side, host_uuid)
        log = (d / "daemon.out").open("wb")
        proc = subprocess.Popen(
            [*netns.exec_prefix(topology.HOSTS[side]), "unshare", "--mount", "--uts",
             "--propagation", "private", "sh", str(d / "start.sh")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        _wait_ready(side, proc, deadline)
        state[side] = {"uri": uri(side), "host_uuid": host_uuid, "pid": daemon_pid(side),
                       "dir": str(d)}
    shared_dir().mkdir(parents=True, exist_ok=True)
    state_file().write_text(json.dumps(state, indent=2))
    for side in sides:
        _ensure_pool(side)
    return {side: uri(side) for side in sides}


def _ensure_pool(side: str) -> None:
    """A directory pool on the host's own images directory, so that libvirt can
    pre-create the destination's image of a copied (``--storage copy``) disk."""
    from livemig.virt.conn import libvirt_module  # the binding: only with --libvirt

    libvirt = libvirt_module()
    conn = libvirt.open(local_uri(side))
    try:
        try:
            pool = conn.storagePoolLookupByName(POOL_NAME)
        except libvirt.libvirtError:
            pool = conn.storagePoolDefineXML(
                f"<pool type='dir'><name>{POOL_NAME}</name><target><path>{IMAGES_DIR}"
                "</path></target></pool>")
        if not pool.isActive():
            pool.create()
        pool.setAutostart(True)
    except libvirt.libvirtError as e:
        raise SetupError(f"libvirt on {side}: storage pool {POOL_NAME}: "
                         f"{e.get_error_message()}") from None
    finally:
        conn.close()


def shared_dir() -> Path:
    """A directory both hosts see at the same path: the lab's shared storage."""
    return root() / "shared"


def image_path(side: str, name: str) -> Path:
    """Where ``IMAGES_DIR/name`` of ``side`` lives as seen from the root namespace."""
    return host_dir(side) / "lib" / "images" / name


def host_view(side: str, path: str) -> Path:
    """Where a path seen by ``side``'s daemon (and its QEMUs) is in the root
    namespace: its per-host directories are bind mounts, everything else is shared."""
    p = Path(path)
    for sub, target in _MOUNTS.items():
        if p == Path(target) or Path(target) in p.parents:
            return host_dir(side) / sub / p.relative_to(target)
    return p


def _same_mount_ns(pid: int) -> list[int]:
    """Other processes in ``pid``'s mount namespace: the QEMUs its daemon started."""
    try:
        ns = os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return []
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != pid:
            with contextlib.suppress(OSError):
                if os.readlink(proc / "ns" / "mnt") == ns:
                    out.append(int(proc.name))
    return out


def down() -> list[str]:
    """Stop the daemons and the QEMUs they started, and remove their files. Only
    the testbed's own daemons and domains: nothing else runs in these namespaces."""
    removed = []
    waiting: list[int] = []
    for side in ALL_SIDES:
        pid = daemon_pid(side)
        if pid is None:
            continue
        guests = _same_mount_ns(pid)
        for p in guests:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        waiting += [pid, *guests]
        removed.append(f"libvirtd on {side}"
                       + (f" ({len(guests)} of its QEMUs killed)" if guests else ""))
    end = time.monotonic() + 5
    while time.monotonic() < end and any(Path(f"/proc/{p}").exists() for p in waiting):
        time.sleep(0.05)
    for p in waiting:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    save_caps(*(host_dir(side) for side in ALL_SIDES))
    if root().exists():
        shutil.rmtree(root(), ignore_errors=True)
    return removed
