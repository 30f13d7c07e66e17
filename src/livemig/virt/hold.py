"""The hold guard: a libvirt domain held paused for the copied-disk comparison is
never left paused for good.

With ``--storage copy`` livemig migrates with ``VIR_MIGRATE_PAUSED`` and compares
the copied disks before it resumes the destination. Under libvirt the source is
gone by then: the paused destination is the only copy of the guest. If livemig dies
during the comparison (kill -9, SIGTERM, Ctrl-C, a crash), nothing would resume it.

Before the comparison livemig starts this guard: a detached process (its own
session: no signal to livemig's process group reaches it) that blocks reading a
pipe only livemig writes to. livemig writes ``done`` once it has decided (resumed
the destination, or kept it paused because the disks differ: ``mismatch``, then
``done``). EOF without ``done`` means livemig died: the guard connects to the
destination's libvirt and resumes the domain if it is still paused — unless livemig
had said ``mismatch`` (a destination proven corrupt stays paused; the report and
the error say how to run it anyway). Before it resumes, the guard removes the NBD
exports and server the comparison had opened on the destination's QEMU.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from livemig import paths, private
from livemig.engine.guardian import read_words

log = logging.getLogger("livemig.virt.hold")

MISMATCH = "mismatch"
DONE = "done"


class Guard:
    """livemig's side of the guard."""

    def __init__(self, proc: subprocess.Popen[bytes] | None, wfd: int | None) -> None:
        self.proc, self.wfd = proc, wfd

    def tell(self, word: str) -> None:
        if self.wfd is not None:
            with contextlib.suppress(OSError):
                os.write(self.wfd, word.encode() + b"\n")

    def dismiss(self) -> None:
        """livemig decided: the guard exits without touching the domain."""
        self.tell(DONE)
        if self.wfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.wfd)
            self.wfd = None
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)


def guard_dir(domain: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in domain)[:64]
    return paths.run_root() / "libvirt-hold" / safe


def start(domain: str, dst_uri: str) -> Guard:
    """Start the guard for ``domain`` held paused on ``dst_uri``."""
    d = guard_dir(domain)
    private.make_dir(d)
    spec = d / "hold.json"
    private.write_text(spec, json.dumps({"domain": domain, "dst_uri": dst_uri,
                                         "watch_pid": os.getpid()}))
    rfd, wfd = os.pipe()
    logf = os.fdopen(private.open_file(d / "hold.log", append=True), "ab")
    try:
        proc = subprocess.Popen([sys.executable, "-m", "livemig.virt.hold", str(spec)],
                                stdin=rfd, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    finally:
        os.close(rfd)
        logf.close()
    return Guard(proc, wfd)


def resume_if_paused(domain: str, dst_uri: str) -> str:
    """Resume ``domain`` on ``dst_uri`` if it is paused; what was done, one line."""
    from livemig.virt.conn import find, libvirt_module, open_uri

    libvirt = libvirt_module()
    conn = open_uri(dst_uri, "destination")
    try:
        dom = find(conn, domain)
        if dom is None:
            return f"{domain}: not on {dst_uri}"
        state, reason = dom.state()
        if state != libvirt.VIR_DOMAIN_PAUSED:
            return f"{domain}: state {state}, not paused: left as it is"
        dom.resume()
        return f"{domain}: resumed on {dst_uri} (was paused, reason {reason})"
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def drop_exports(domain: str, dst_uri: str) -> str:
    """The comparison's NBD exports, NBD server and TLS object removed from the held
    domain's QEMU (a livemig that died inside the comparison leaves them: a read-only
    export of the guest's disk on the migration network, and an NBD server that
    would make the next disk-copying migration of the domain fail); one line.

    Only when an export of the comparison is there: then the NBD server on the held
    destination is the comparison's (libvirt stops its own, the disk copy's, before
    the migration call returns); otherwise nothing is touched."""
    from livemig.errors import LivemigError
    from livemig.virt import qmp
    from livemig.virt.conn import find, open_uri
    from livemig.virt.diskcheck import EXPORT_PREFIX, TLS_ID

    conn = open_uri(dst_uri, "destination")
    try:
        dom = find(conn, domain)
        if dom is None or not dom.isActive():
            return f"{domain}: not running on {dst_uri}: no export to remove"
        exports = qmp.command(dom, "query-block-exports") or []
        ours = [str(e["id"]) for e in exports if str(e.get("id", "")).startswith(
            EXPORT_PREFIX)]
        if not ours:  # the server, if any, is not the comparison's (libvirt's copy)
            return f"{domain}: no export of the comparison on {dst_uri}"
        for name in ours:
            with contextlib.suppress(LivemigError):
                qmp.command(dom, "block-export-del", id=name, mode="hard")
        with contextlib.suppress(LivemigError):
            qmp.command(dom, "nbd-server-stop")
        with contextlib.suppress(LivemigError):
            qmp.command(dom, "object-del", id=TLS_ID)
        return f"{domain}: removed the comparison's exports {ours} and its NBD server"
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s hold-guard %(message)s")
    spec: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    log.info("holding %s for livemig pid %s", spec["domain"], spec.get("watch_pid"))
    words = read_words()
    if DONE in words:
        log.info("livemig decided%s", " (mismatch: the domain stays paused)"
                 if MISMATCH in words else "")
        return 0
    if MISMATCH in words:
        log.info("livemig died after a mismatch: the domain stays paused")
        return 0
    log.info("livemig died during the comparison: resuming the destination")
    try:  # first what the comparison had opened on it (never in the way of the resume)
        log.info("%s", drop_exports(str(spec["domain"]), str(spec["dst_uri"])))
    except Exception as e:
        log.info("removing the comparison's NBD exports failed: %r", e)
    try:
        log.info("%s", resume_if_paused(str(spec["domain"]), str(spec["dst_uri"])))
    except Exception as e:  # log, never a traceback in someone's terminal
        log.info("resume failed: %r", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
