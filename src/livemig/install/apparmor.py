"""What the distribution's libvirt confinement needs for a QEMU outside ``/usr/bin``.

On Debian and Ubuntu libvirt confines with AppArmor (``security_driver`` defaults to
it when the kernel has AppArmor on). Two profiles touch the emulator:

- libvirtd's own (``/etc/apparmor.d/usr.sbin.libvirtd``) runs the emulator to probe
  its capabilities; it may execute ``/usr/bin/*`` and a few helpers, nothing under
  ``/opt`` or ``/usr/local``. Its ``include if exists <local/usr.sbin.libvirtd>`` is
  the place for one more ``PUx`` rule;
- each domain's profile (``libvirt-UUID``, written by virt-aa-helper at every start
  from ``TEMPLATE.qemu``) includes ``abstractions/libvirt-qemu``, which lists the
  emulators a domain may execute (``/usr/bin/qemu-system-x86_64 rmix`` and the other
  ``/usr/bin`` names) and the firmware directories it may read
  (``/usr/share/qemu/**``, ``/usr/share/seabios/**``); virt-aa-helper adds the
  domain's disks, kernel and sockets, never its emulator. Its
  ``include if exists <abstractions/libvirt-qemu.d>`` is the place for the rest.

No prefix avoids this short of replacing Debian's own ``/usr/bin/qemu-system-x86_64``,
which livemig never does. The rules name the installed binary and its data
directory; the firmware links resolve into the Debian packages' directories, which
the abstraction allows already (bookworm's ipxe ROMs in ``/usr/lib/ipxe/qemu`` are
added, since the abstraction does not list them).
"""

from __future__ import annotations

import contextlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

BEGIN = "# BEGIN livemig install-qemu {prefix}"
END = "# END livemig install-qemu {prefix}"
ABSTRACTION = Path("etc/apparmor.d/abstractions/libvirt-qemu")
DOMAIN_DROPIN_DIR = Path("etc/apparmor.d/abstractions/libvirt-qemu.d")
DAEMON_LOCAL = Path("etc/apparmor.d/local/usr.sbin.libvirtd")
DAEMON_PROFILE = Path("/etc/apparmor.d/usr.sbin.libvirtd")
ENABLED = Path("/sys/module/apparmor/parameters/enabled")


@dataclass(frozen=True)
class Rules:
    """The drop-ins for one installed prefix."""

    prefix: Path
    binary: Path

    @property
    def name(self) -> str:
        """The domain drop-in's file name: one per prefix."""
        return "livemig-qemu" + str(self.prefix).replace("/", "-")

    def domain(self) -> str:
        return "\n".join([
            f"# livemig install-qemu: the QEMU in {self.prefix} (livemig install-qemu "
            "--uninstall removes this file)",
            f'"{self.binary}" rmix,',
            f'"{self.prefix}/share/qemu/" r,',
            f'"{self.prefix}/share/qemu/**" r,',
            '"/usr/lib/ipxe/qemu/**" r,',
            ""])

    def daemon_block(self) -> str:
        return "\n".join([BEGIN.format(prefix=self.prefix),
                          f'"{self.binary}" PUx,',
                          END.format(prefix=self.prefix), ""])


def applies(root: Path = Path("/")) -> bool:
    """Whether libvirt's AppArmor abstraction is installed on this host."""
    return (root / ABSTRACTION).is_file()


def kernel_enabled() -> bool:
    try:
        return ENABLED.read_text().strip().upper().startswith("Y")
    except OSError:
        return False


def without_block(text: str, prefix: Path) -> str:
    """``text`` with this prefix's block removed (other prefixes' blocks stay)."""
    begin, end = BEGIN.format(prefix=prefix), END.format(prefix=prefix)
    out: list[str] = []
    skipping = False
    for line in text.splitlines(keepends=True):
        if line.rstrip("\n") == begin:
            skipping = True
        elif skipping and line.rstrip("\n") == end:
            skipping = False
        elif not skipping:
            out.append(line)
    return "".join(out)


def write(rules: Rules, root: Path = Path("/")) -> list[Path]:
    """Write (or rewrite) both drop-ins; returns the files touched."""
    dropin = root / DOMAIN_DROPIN_DIR / rules.name
    dropin.parent.mkdir(parents=True, exist_ok=True)
    dropin.write_text(rules.domain())
    local = root / DAEMON_LOCAL
    local.parent.mkdir(parents=True, exist_ok=True)
    old = local.read_text() if local.exists() else ""
    local.write_text(without_block(old, rules.prefix) + rules.daemon_block())
    return [dropin, local]


def remove(rules: Rules, root: Path = Path("/")) -> list[Path]:
    """Remove what :func:`write` added; returns the files touched."""
    touched = []
    dropin = root / DOMAIN_DROPIN_DIR / rules.name
    if dropin.exists():
        dropin.unlink()
        touched.append(dropin)
    local = root / DAEMON_LOCAL
    if local.exists():
        old = local.read_text()
        new = without_block(old, rules.prefix)
        if new != old:
            local.write_text(new)
            touched.append(local)
    return touched


def reload_daemon_profile() -> str | None:
    """Reload libvirtd's profile so its new local rule counts (domain profiles are
    rebuilt at each start). None when done or not needed, else why it failed."""
    if not kernel_enabled() or not DAEMON_PROFILE.exists():
        return None
    with contextlib.suppress(FileNotFoundError):
        out = subprocess.run(["apparmor_parser", "-r", str(DAEMON_PROFILE)],
                             capture_output=True, text=True, check=False)
        if out.returncode == 0:
            return None
        return (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
    return "apparmor_parser is not installed"
