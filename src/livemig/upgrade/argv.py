"""The new QEMU's command line: the running one's, with the incoming side added.

Pure functions on argument lists (unit-tested without QEMU). The new process must
create the same machine, so everything is kept except what belongs to one process
only or cannot be opened twice:

- ``-incoming`` (old ones dropped, the upgrade's added), ``-S`` (the guest was
  running; the new QEMU resumes it by itself), ``-daemonize`` (livemig starts the
  new process in its own session), ``-pidfile`` (locked by the old process);
- a tap ``-netdev`` opened by name: a tap without multi-queue can be attached to one
  file description only, and the old QEMU still holds it while the new one starts
  (cpr-transfer) or leaks it into the exec'd image (QEMU 10.2.2 opens /dev/net/tun
  without O_CLOEXEC, and cpr does not preserve tap fds). So the new QEMU gets the
  very same open tap as ``fd=N``: same device, same bridge port, no re-open.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from livemig.errors import UsageError

DROP_WITH_VALUE = frozenset({"-incoming", "-pidfile"})
DROP_FLAGS = frozenset({"-S", "-daemonize"})
# tap options that make no sense with fd= (QEMU refuses them together)
_TAP_OPEN_KEYS = frozenset({"ifname", "script", "downscript", "br", "helper", "fds",
                            "vhostfds", "queues", "fd"})


@dataclass(frozen=True)
class TapNetdev:
    """A ``-netdev tap,...`` option found in the old command line."""

    index: int  # position of its value in argv
    id: str
    ifname: str | None
    fd: int | None  # given as fd=N


def split_opts(text: str) -> list[tuple[str, str | None]]:
    """QEMU's ``key=value,key=value`` (``,,`` is a literal comma; a bare word is a
    key without value, e.g. the driver name in front)."""
    parts: list[str] = []
    cur = ""
    i = 0
    while i < len(text):
        c = text[i]
        if c == "," and text[i + 1:i + 2] == ",":
            cur += ","
            i += 2
            continue
        if c == ",":
            parts.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    parts.append(cur)
    out: list[tuple[str, str | None]] = []
    for p in parts:
        if "=" in p:
            k, v = p.split("=", 1)
            out.append((k, v))
        else:
            out.append((p, None))
    return out


def join_opts(opts: Sequence[tuple[str, str | None]]) -> str:
    return ",".join(k if v is None else f"{k}={v.replace(',', ',,')}" for k, v in opts)


def _opt(argv: Sequence[str], i: int) -> str:
    """Option ``argv[i]`` with ``--x`` spelled ``-x``."""
    a = argv[i]
    return a[1:] if a.startswith("--") else a


def tap_netdevs(argv: Sequence[str]) -> list[TapNetdev]:
    """The tap netdevs of a command line; one-line refusal for spellings livemig
    cannot rewrite (JSON -netdev, -nic tap, multi-queue taps)."""
    found: list[TapNetdev] = []
    for i in range(len(argv) - 1):
        o = _opt(argv, i)
        val = argv[i + 1]
        if o == "-nic" and (val == "tap" or val.startswith("tap,")):
            raise UsageError("the VM uses -nic tap: livemig can hand over only "
                             "-netdev tap,id=... taps")
        if o != "-netdev":
            continue
        if val.lstrip().startswith("{"):
            try:
                d = json.loads(val)
            except json.JSONDecodeError:
                d = {}
            if d.get("type") == "tap":
                raise UsageError("the VM's tap netdev is given as JSON: livemig can hand "
                                 "over only -netdev tap,id=...")
            continue
        opts = split_opts(val)
        if not opts or opts[0][0] != "tap":
            continue
        kv = {k: v for k, v in opts[1:]}
        if kv.get("queues") not in (None, "1") or "fds" in kv:
            raise UsageError("the VM has a multi-queue tap: livemig hands over "
                             "single-queue taps only")
        fd = kv.get("fd")
        found.append(TapNetdev(i + 1, kv.get("id") or "", kv.get("ifname"),
                               int(fd) if fd is not None and fd.isdigit() else None))
    return found


def new_argv(old: Sequence[str], qemu: str, incoming: Sequence[str],
             tap_fds: Mapping[str, int], extra: Sequence[str] = ()) -> list[str]:
    """The new QEMU's argv: ``qemu`` instead of the old binary, the one-process
    options dropped, tap netdevs (by id) given ``tap_fds[id]``, ``incoming`` and
    ``extra`` appended."""
    taps = {t.index: t for t in tap_netdevs(old)}
    missing = [t.id for t in taps.values() if t.id not in tap_fds]
    if missing:
        raise UsageError(f"no open tap found for netdev {', '.join(missing)}")
    out = [qemu]
    i = 1
    while i < len(old):
        o = _opt(old, i)
        if o in DROP_FLAGS:
            i += 1
            continue
        if o in DROP_WITH_VALUE:
            i += 2
            continue
        if i + 1 in taps:
            t = taps[i + 1]
            kept = [(k, v) for k, v in split_opts(old[i + 1])
                    if k not in _TAP_OPEN_KEYS]
            out += [old[i], join_opts([*kept, ("fd", str(tap_fds[t.id]))])]
            i += 2
            continue
        out.append(old[i])
        i += 1
    return out + list(incoming) + list(extra)


def ram_backends(argv: Sequence[str]) -> list[dict[str, str | None]]:
    """The memory backends of a command line (for the refusal message)."""
    out = []
    for i in range(len(argv) - 1):
        if _opt(argv, i) == "-object" and argv[i + 1].startswith("memory-backend"):
            opts = split_opts(argv[i + 1])
            out.append({"type": opts[0][0], **{k: v for k, v in opts[1:]}})
    return out
