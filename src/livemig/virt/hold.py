"""The guard of a libvirt run: a libvirt domain held paused for the copied-disk
comparison is never left paused for good, and what livemig set on the domain's QEMUs
is put back if livemig dies.

With ``--storage copy`` livemig migrates with ``VIR_MIGRATE_PAUSED`` and compares
the copied disks before it resumes the destination. Under libvirt the source is
gone by then: the paused destination is the only copy of the guest. If livemig dies
during the comparison (kill -9, SIGTERM, Ctrl-C, a crash), nothing would resume it.

Before the migration starts livemig starts this guard (a migration with
``VIR_MIGRATE_PAUSED`` ends with the destination paused even if livemig died
during it: libvirt's source daemon drives a peer-to-peer migration to its end): a
detached process (its own session: no signal to livemig's process group reaches it)
that blocks reading a pipe only livemig writes to. livemig writes ``done`` once it
has decided (resumed the destination, kept it paused because the disks differ:
``mismatch``, then ``done``, or the migration did not complete and the source runs
on). EOF without ``done`` means livemig died: unless livemig had said ``mismatch``
(a destination proven corrupt stays paused; the report and the error say how to run
it anyway), the guard waits until no migration job holds the domain, then resumes
it on the destination if it is paused there, or leaves it where it runs (a migration
that failed: libvirt keeps the source).
Before it resumes, the guard removes the NBD exports and server the comparison
had opened on the destination's QEMU.

Every libvirt run starts the guard before it changes anything on the domain (its
settings, passthrough parameters: the journal, ``virt/journal.py``, says what and
their values before). When livemig dies, the guard then also waits until no job holds
the domain and puts the journal's settings back on the end where it runs
(``virt/repair.py``), so a killed run leaves no reconfigured VM behind, without
waiting for a next livemig run. livemig says ``decided`` once it resumed (or kept
paused) the destination itself; the settings are the guard's until ``done``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from livemig import paths, private
from livemig.engine.guardian import read_words

log = logging.getLogger("livemig.virt.hold")

MISMATCH = "mismatch"
DECIDED = "decided"  # livemig resumed the held destination itself (settings still guarded)
DONE = "done"
# how long the guard waits for a migration job to end after livemig died: livemig's
# default --max-time (engine/plan.py) plus the switchover and libvirt's confirm
WAIT_S = 960.0
RETRY_S = 1.0


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


def start(domain: str, dst_uri: str, src_uri: str | None = None,
          paused: bool = True) -> Guard:
    """Start the guard for ``domain`` migrated from ``src_uri`` to ``dst_uri``;
    ``paused``: with ``VIR_MIGRATE_PAUSED`` (the destination is to be resumed)."""
    d = guard_dir(domain)
    private.make_dir(d)
    spec = d / "hold.json"
    private.write_text(spec, json.dumps({"domain": domain, "dst_uri": dst_uri,
                                         "src_uri": src_uri, "paused": paused,
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


def resume_if_paused(domain: str, dst_uri: str, src_uri: str | None = None) -> str | None:
    """Resume ``domain`` on ``dst_uri`` once no migration job holds it and it is
    paused there; what was done, one line, or None while it must wait (a job runs, or
    the domain is on neither host yet)."""
    from livemig.virt.conn import find, libvirt_module, open_uri

    libvirt = libvirt_module()
    conn = open_uri(dst_uri, "destination")
    try:
        dom = find(conn, domain)
        if dom is not None and not _in_job(dom, libvirt):
            state, reason = dom.state()
            if state != libvirt.VIR_DOMAIN_PAUSED:
                return f"{domain}: state {state} on {dst_uri}, not paused: left as it is"
            dom.resume()
            return f"{domain}: resumed on {dst_uri} (was paused, reason {reason})"
    finally:
        with contextlib.suppress(Exception):
            conn.close()
    if dom is None and src_uri is not None:  # not (yet) on dst: where does it run?
        sconn = open_uri(src_uri, "source")
        try:
            sdom = find(sconn, domain)
            if sdom is not None and not _in_job(sdom, libvirt):
                return f"{domain}: on {src_uri} (the migration did not complete): left there"
        finally:
            with contextlib.suppress(Exception):
                sconn.close()
    return None


def _in_job(dom: Any, libvirt: Any) -> bool:
    """A job (the migration) holds the domain: it may not be resumed yet."""
    try:
        return bool(dom.jobInfo()[0] != libvirt.VIR_DOMAIN_JOB_NONE)
    except libvirt.libvirtError:
        return True  # cannot tell: ask again


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


def put_back_settings(domain: str, record: dict[str, Any]) -> list[str] | None:
    """The journal's settings put back where the domain runs; what was done, or None
    while a migration job still holds it on an end."""
    from livemig.virt.conn import find, libvirt_module, open_uri
    from livemig.virt.repair import put_back

    libvirt = libvirt_module()
    conns: dict[str, Any] = {}

    def dom_at(uri: str) -> Any:
        if uri not in conns:
            conns[uri] = open_uri(uri, "guard")
        return find(conns[uri], domain)
    try:
        repaired, waiting = put_back(record, dom_at, libvirt.VIR_DOMAIN_JOB_NONE)
    finally:
        for c in conns.values():
            with contextlib.suppress(Exception):
                c.close()
    if waiting:
        return None
    return [str(r) for r in repaired] or ["nothing set on an end where it runs"]


def _until(deadline: float, waiting: str, attempt: Callable[[], str | None]) -> str | None:
    """``attempt()`` every RETRY_S until it says what it did or ``deadline`` passes
    (None); why it has not yet (``waiting``, or its error) is logged when it changes."""
    last = ""
    while True:
        try:
            done, why = attempt(), waiting
        except Exception as e:  # a daemon away, a QMP error: log it, never a traceback
            done, why = None, f"{e!r}"
        if done is not None:
            return done
        if why != last:
            log.info("not yet: %s", why)
            last = why
        if time.monotonic() >= deadline:
            return None
        time.sleep(RETRY_S)


def _settings(spec: dict[str, Any], deadline: float) -> int:
    """Put back what the dead run's journal says it set, once no job holds the domain."""
    from livemig.virt import journal

    domain, pid = str(spec["domain"]), spec.get("watch_pid")

    def attempt() -> str | None:
        record = journal.read(domain)
        if record is None or record.get("owner_pid") != pid:
            return "no settings of this run left to put back"
        done = put_back_settings(domain, record)
        if done is None:
            return None
        journal.remove(domain, owner_pid=pid if isinstance(pid, int) else None)
        return "settings put back: " + "; ".join(done)
    said = _until(deadline, "a migration job still holds the domain", attempt)
    if said is None:
        log.info("gave up putting the settings back: the next livemig run for %s "
                 "does it (journal %s)", domain, journal.path(domain))
        return 1
    log.info("%s", said)
    return 0


def _resume(spec: dict[str, Any], deadline: float) -> int:
    try:  # first what the comparison had opened on it (never in the way of the resume)
        log.info("%s", drop_exports(str(spec["domain"]), str(spec["dst_uri"])))
    except Exception as e:
        log.info("removing the comparison's NBD exports failed: %r", e)
    log.info("livemig died: resuming the destination once the migration is over")
    src = spec.get("src_uri")
    said = _until(deadline, "a migration job still holds the domain",
                  lambda: resume_if_paused(str(spec["domain"]), str(spec["dst_uri"]),
                                           str(src) if src else None))
    if said is None:
        log.info("gave up after %.0f s: the domain may still be paused on %s",
                 float(spec.get("wait_s", WAIT_S)), spec["dst_uri"])
        return 1
    log.info("%s", said)
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s hold-guard %(message)s")
    spec: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    log.info("guarding %s for livemig pid %s", spec["domain"], spec.get("watch_pid"))
    words = read_words()
    if DONE in words:
        log.info("livemig decided%s", " (mismatch: the domain stays paused)"
                 if MISMATCH in words else "")
        return 0
    deadline = time.monotonic() + float(spec.get("wait_s", WAIT_S))
    rc = 0
    if MISMATCH in words:
        log.info("livemig died after a mismatch: the domain stays paused")
    elif DECIDED in words:
        log.info("livemig died after it had resumed the destination")
    elif spec.get("paused", True):
        rc = _resume(spec, deadline)
    return max(rc, _settings(spec, deadline))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
