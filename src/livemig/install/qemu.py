"""Install, check and uninstall the project's QEMU under a prefix.

``PREFIX/bin/qemu-system-x86_64`` is a copy of the build (written beside and renamed
over, so a QEMU already running from the old file keeps its inode), and
``PREFIX/share/qemu`` holds the firmware links (:mod:`.firmware`). A manifest
(``PREFIX/share/livemig/install.json``) names everything livemig put there: a
second install changes only what differs, ``--uninstall`` removes exactly that, and
a file livemig did not put there (a distribution's QEMU in ``/usr/bin``, a real
firmware file) is never overwritten or removed.
"""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from livemig import paths
from livemig.errors import SetupError, UsageError
from livemig.install import apparmor, firmware

BINARY = "qemu-system-x86_64"
DEFAULT_PREFIX = Path("/opt/livemig/qemu")
UPSTREAM_PREFIX = Path("/opt/livemig/qemu-upstream")
MANIFEST = Path("share/livemig/install.json")
DATA = Path("share/qemu")
BIN_MODE = 0o755


@dataclass
class Result:
    binary: Path
    flavour: str
    copied: bool = False
    links: int = 0
    changed_links: int = 0
    kept: list[str] = field(default_factory=list)  # names in share/qemu that are not ours
    apparmor: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def source_binary(upstream: bool) -> Path:
    """The build to install; a one-line error when it is not built."""
    sub, target = ("qemu-upstream", "make qemu-upstream") if upstream else ("qemu", "make qemu")
    p = paths.build_dir() / sub / BINARY
    if not p.is_file():
        raise SetupError(f"{p} is not built: build it first ({target}), then install")
    return p


def check_prefix(prefix: Path) -> Path:
    text = str(prefix)
    if not prefix.is_absolute():
        raise UsageError(f"--prefix {text}: an absolute path, please")
    if any(c in text for c in '"\n\\'):
        raise UsageError(f"--prefix {text}: no quotes, backslashes or newlines "
                         "(the path goes into AppArmor rules)")
    prefix = Path(os.path.normpath(text))
    if prefix == Path("/"):
        raise UsageError("--prefix /: choose a directory of its own, e.g. "
                         f"{DEFAULT_PREFIX}")
    return prefix


def _writable(prefix: Path) -> None:
    """A one-line error when this user cannot create or change ``prefix``."""
    p = prefix
    while not p.exists():
        p = p.parent
    if not os.access(p, os.W_OK | os.X_OK):
        owner = "root" if p.stat().st_uid == 0 else f"uid {p.stat().st_uid}"
        raise SetupError(f"{prefix}: {p} is not writable by this user (owned by {owner}): "
                         "run as root, or choose a --prefix under a directory you own")


def read_manifest(prefix: Path) -> dict[str, object] | None:
    try:
        d = json.loads((prefix / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise SetupError(f"{prefix / MANIFEST}: unreadable ({e}); remove it by hand") \
            from None
    return d if isinstance(d, dict) else None


def _names(manifest: dict[str, object] | None, key: str) -> list[str]:
    v = (manifest or {}).get(key)
    return [str(x) for x in v] if isinstance(v, list) else []


def _copy_binary(src: Path, dst: Path) -> bool:
    if dst.is_file() and filecmp.cmp(src, dst, shallow=False):
        return False
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.livemig-tmp")
    shutil.copyfile(src, tmp)
    os.chmod(tmp, BIN_MODE)
    os.replace(tmp, dst)
    return True


def _link(data: Path, name: str, target: Path, ours: set[str], res: Result) -> None:
    p = data / name
    if p.is_symlink():
        if Path(os.readlink(p)) == target:
            return
        if name not in ours:
            res.kept.append(name)
            return
        p.unlink()
    elif p.exists():
        res.kept.append(name)  # a real file or directory: not ours, left alone
        return
    p.symlink_to(target)
    res.changed_links += 1


def install(prefix: Path, upstream: bool = False, with_apparmor: bool = True,
            root: Path = Path("/")) -> Result:
    """Install (or bring up to date) the QEMU build under ``prefix``; ``root`` is
    where /etc lives (tests)."""
    prefix = check_prefix(prefix)
    src = source_binary(upstream)
    plan = firmware.links(firmware.SOURCES)
    lacking = firmware.missing_required(plan)
    if lacking:
        raise SetupError(f"no {', '.join(lacking)} in "
                         f"{', '.join(map(str, firmware.SOURCES))}: install Debian's "
                         "seabios, ipxe-qemu and qemu-system-data packages first")
    _writable(prefix)
    manifest = read_manifest(prefix)
    dst = prefix / "bin" / BINARY
    if dst.exists() and manifest is None:
        raise SetupError(f"{dst} exists and was not installed by livemig (no "
                         f"{prefix / MANIFEST}): refusing to overwrite it")
    res = Result(binary=dst, flavour="unpatched" if upstream else "patched")
    res.copied = _copy_binary(src, dst)
    data = prefix / DATA
    data.mkdir(parents=True, exist_ok=True)
    ours = set(_names(manifest, "links"))
    for name, target in plan.items():
        _link(data, name, target, ours, res)
    for stale in ours - set(plan):
        p = data / stale
        if p.is_symlink():
            p.unlink()
            res.changed_links += 1
    res.links = len(plan) - len(res.kept)
    if with_apparmor and apparmor.applies(root):
        if os.geteuid() != 0 and root == Path("/"):
            res.notes.append("AppArmor rules not written (needs root): see docs/install.md")
        else:
            res.apparmor = apparmor.write(apparmor.Rules(prefix, dst), root)
            if root == Path("/"):
                why = apparmor.reload_daemon_profile()
                if why:
                    res.notes.append(f"libvirtd's AppArmor profile not reloaded: {why}")
    stamp = src.parent / "stamp"
    record = {"binary": f"bin/{BINARY}", "flavour": res.flavour, "source": str(src),
              "stamp": stamp.read_text() if stamp.is_file() else "",
              "links": sorted(n for n in plan if n not in res.kept),
              "apparmor": bool(res.apparmor)}
    (prefix / MANIFEST).parent.mkdir(parents=True, exist_ok=True)
    (prefix / MANIFEST).write_text(json.dumps(record, indent=1) + "\n")
    return res


def running_from(binary: Path, proc: Path = Path("/proc")) -> list[int]:
    """The processes whose executable is ``binary`` (QEMUs of running domains)."""
    want = str(binary)
    out = []
    for p in proc.iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(p / "exe") == want:
                    out.append(int(p.name))
    return sorted(out)


def uninstall(prefix: Path, root: Path = Path("/")) -> list[Path]:
    """Remove what :func:`install` put under ``prefix`` (and its AppArmor rules);
    returns what was removed. Directories go only when empty. Refused while a QEMU
    runs from the installed binary: its domain could not be migrated or restarted."""
    prefix = check_prefix(prefix)
    manifest = read_manifest(prefix)
    if manifest is None:
        raise UsageError(f"nothing of livemig's at {prefix} (no {prefix / MANIFEST})")
    _writable(prefix)
    removed: list[Path] = []
    dst = prefix / "bin" / BINARY
    pids = running_from(dst)
    if pids:
        raise UsageError(f"{dst} runs as {len(pids)} process(es) (pid "
                         f"{', '.join(map(str, pids))}): migrate or stop those domains "
                         "first")
    if dst.is_file():
        dst.unlink()
        removed.append(dst)
    for name in _names(manifest, "links"):
        p = prefix / DATA / name
        if p.is_symlink():
            p.unlink()
            removed.append(p)
    removed += apparmor.remove(apparmor.Rules(prefix, dst), root)
    (prefix / MANIFEST).unlink()
    removed.append(prefix / MANIFEST)
    for d in (prefix / "share/livemig", prefix / DATA, prefix / "share", prefix / "bin",
              prefix):
        with contextlib.suppress(OSError):  # not empty (someone else's files) or gone
            d.rmdir()
    return removed
