"""Where an installed QEMU finds its firmware, and the check that it does.

QEMU looks for firmware relative to its own binary: ``qemu_add_default_firmwarepath``
(system/datadir.c) adds the configured firmware path and ``CONFIG_QEMU_DATADIR``,
each through ``get_relocated_path`` (util/cutils.c), which rewrites a path under the
configured prefix (``/usr/local``: qemu/build.sh keeps QEMU's default) relative to
the directory of ``/proc/self/exe`` when QEMU is built relocatable (the default). So
``PREFIX/bin/qemu-system-x86_64`` searches ``PREFIX/share/qemu-firmware`` and
``PREFIX/share/qemu`` (``qemu-system-x86_64 -L help`` prints them). A symbolic link
to the binary would not do: ``/proc/self/exe`` is the resolved path.

The build is from the ``+ds`` tarball, without firmware blobs; Debian's QEMU finds
Debian's firmware through its configured path (``--firmwarepath=/usr/share/qemu:
/usr/share/seabios`` in debian/rules of 10.2.2), and until 10.2.1 also
``/usr/lib/ipxe/qemu``, dropped because trixie's ipxe-qemu links its ROMs into
/usr/share/qemu; bookworm's ipxe-qemu does not, so its NIC ROMs are found only there.
The installed ``PREFIX/share/qemu`` therefore holds one symbolic link per file or
directory of :data:`SOURCES`, the first directory to have a name winning, exactly
the search order Debian's QEMU uses. Links, not copies: a security update of seabios
or ipxe reaches the installed QEMU, and a confined QEMU reads the links' targets,
which the distribution's libvirt profile already allows.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable
from pathlib import Path

# Debian's QEMU firmware path, in its order (see above), plus bookworm's ipxe ROMs
SOURCES = (Path("/usr/share/qemu"), Path("/usr/share/seabios"), Path("/usr/lib/ipxe/qemu"))
# what a q35 guest cannot start without (bios-256k.bin: SeaBIOS, from `seabios`)
REQUIRED = ("bios-256k.bin",)
# a q35 machine with no disk and no -L, stopped before its first instruction (-S):
# the firmware is loaded while the machine is built, so a missing BIOS fails here
BOOT_ARGS = ("-machine", "q35", "-accel", "tcg", "-m", "64M", "-nodefaults",
             "-no-user-config", "-display", "none", "-S", "-qmp", "stdio")
BOOT_TIMEOUT_S = 30.0  # a stopped q35 with 64 MiB answers QMP in well under a second


def links(sources: Iterable[Path] = SOURCES) -> dict[str, Path]:
    """Name in ``PREFIX/share/qemu`` -> the file or directory it links to; the first
    source directory that has a name wins (Debian's search order)."""
    out: dict[str, Path] = {}
    for d in sources:
        try:
            entries = sorted(d.iterdir())
        except OSError:
            continue
        for e in entries:
            out.setdefault(e.name, e)
    return out


def missing_required(plan: dict[str, Path]) -> list[str]:
    return [n for n in REQUIRED if n not in plan]


def boot_check(binary: Path) -> str | None:
    """Start ``binary`` as a stopped q35 machine with no ``-L`` and quit it: None when
    it finds its firmware, else QEMU's own complaint (one line)."""
    script = "".join(json.dumps({"execute": c}) + "\n" for c in ("qmp_capabilities", "quit"))
    try:
        out = subprocess.run([str(binary), *BOOT_ARGS], input=script, capture_output=True,
                             text=True, timeout=BOOT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"a stopped q35 machine did not quit within {BOOT_TIMEOUT_S:.0f}s"
    except OSError as e:
        return f"cannot run it: {e.strerror}"
    if out.returncode == 0 and '"return"' in out.stdout:
        return None
    lines = [ln for ln in out.stderr.strip().splitlines() if "rom:" not in ln]
    return (lines or [f"exit status {out.returncode}, no QMP answer"])[-1].strip()


def data_dirs(binary: Path) -> list[str]:
    """The directories ``binary`` searches (``-L help``), for messages and the doctor."""
    try:
        out = subprocess.run([str(binary), "-L", "help"], capture_output=True, text=True,
                             timeout=BOOT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in out.stdout.splitlines() if ln.startswith("/")]
