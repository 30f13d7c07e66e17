"""``livemig install-qemu [--prefix DIR] [--upstream] [--uninstall]``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from livemig.errors import SetupError
from livemig.install import apparmor, firmware, qemu

_DOC = f"""Install this checkout's QEMU build so that a libvirt domain can name it as
its <emulator> with no extra arguments: PREFIX/bin/{qemu.BINARY} (a copy) and
PREFIX/share/qemu (links to Debian's firmware: {', '.join(map(str, firmware.SOURCES))},
searched in Debian's order; QEMU looks there relative to its own binary). Where
libvirt's AppArmor profiles are installed, the rules for the new path are added too.
Then a q35 machine is started with no -L to prove the firmware is found. Run it
again after a rebuild: only what changed is rewritten. docs/install.md."""


def register(sub: Any) -> None:
    p = sub.add_parser("install-qemu", help="install the patched QEMU for libvirt domains "
                       "(no -L needed)", description=_DOC)
    p.add_argument("--prefix", type=Path, help=f"where (default {qemu.DEFAULT_PREFIX}; "
                   f"with --upstream {qemu.UPSTREAM_PREFIX})")
    p.add_argument("--upstream", action="store_true", help="the unpatched build of the "
                   "same release (build/qemu-upstream) instead of the patched one")
    p.add_argument("--uninstall", action="store_true", help="remove what install-qemu put "
                   "under PREFIX (and its AppArmor rules)")
    p.add_argument("--no-apparmor", action="store_true", help="do not add AppArmor rules "
                   "even where libvirt's profiles are installed")
    p.set_defaults(func=cmd_install_qemu)


def cmd_install_qemu(a: argparse.Namespace) -> int:
    prefix = a.prefix or (qemu.UPSTREAM_PREFIX if a.upstream else qemu.DEFAULT_PREFIX)
    if a.uninstall:
        removed = qemu.uninstall(prefix)
        print(f"removed    {len(removed)} files and links livemig had put in {prefix}")
        return 0
    res = qemu.install(prefix, upstream=a.upstream, with_apparmor=not a.no_apparmor)
    state = "copied" if res.copied else "unchanged"
    print(f"installed  {res.binary} ({res.flavour}; {state})")
    changed = f", {res.changed_links} changed" if res.changed_links else ""
    print(f"firmware   {prefix / qemu.DATA}: {res.links} links{changed}")
    for name in res.kept:
        print(f"           kept {name}: not a link livemig made")
    if res.apparmor:
        print(f"apparmor   rules in {', '.join(map(str, res.apparmor))}")
    elif a.no_apparmor:
        print("apparmor   skipped (--no-apparmor)")
    elif not apparmor.applies():
        print("apparmor   libvirt's AppArmor profiles are not installed here: nothing to add")
    for note in res.notes:
        print(f"note       {note}")
    problem = firmware.boot_check(res.binary)
    if problem:
        raise SetupError(f"{res.binary} does not start a q35 machine without -L: {problem}")
    dirs = ", ".join(firmware.data_dirs(res.binary))
    print(f"check      a q35 machine starts with no -L (firmware searched in {dirs})")
    print(f"use        <emulator>{res.binary}</emulator>")
    return 0
