"""The guardian: a detached process that repairs a migration if livemig dies.

Started (in its own session, so no signal to livemig's process group reaches it)
before ``migrate-incoming``; it blocks reading a pipe whose write end only livemig
holds. livemig writes ``done`` when it has finished normally; EOF without it means
livemig died. Then the guardian connects to both QMP sockets (QEMU's monitor takes
the next client once livemig's connection is gone) and makes it right:

- migration not completed: ``migrate_cancel``, and the source runs (``cont`` if it
  was left paused);
- completed: the destination runs (``cont``: it was started with ``-S`` and the
  source is stopped, so otherwise no guest would run anywhere); if the destination
  did not load, or livemig had told the guardian it was proven corrupt
  (:data:`REFUSE_DESTINATION`), or the run verifies and livemig died before it told
  :data:`VERIFIED` (killed while comparing), the source, intact in ``postmigrate``,
  runs instead and the destination stays paused;
- no management throttle stays on (``cancel-cpu-throttle`` when QEMU has it), and
  every capability/parameter livemig changed is set back on both ends;
- a destination that never held the guest and still listens is quit
  (:mod:`livemig.engine.listener`: QEMU cannot close its incoming port otherwise).

It never kills a QEMU that holds a guest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from livemig import private
from livemig.engine.listener import quit_unused_destination
from livemig.errors import LivemigError

log = logging.getLogger("livemig.guardian")

CONNECT_TIMEOUT_S = 20.0
RUNNABLE_PAUSED = ("paused", "postmigrate", "finish-migrate", "prelaunch")
REFUSE_DESTINATION = "refuse-destination"  # the RAM/disk comparison failed: never cont dst
QUIT_UNUSED_DESTINATION = "quit_unused_destination"  # spec key; default True
VERIFIED = "verified"  # the comparison passed (or was waived): the destination may run


class Handle:
    """livemig's side: dismiss the guardian when the run ends normally."""

    def __init__(self, proc: subprocess.Popen[bytes], wfd: int) -> None:
        self.proc = proc
        self.wfd = wfd

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tell(self, word: str) -> None:
        """A fact the repair must know should livemig die from now on."""
        with contextlib.suppress(OSError):
            os.write(self.wfd, word.encode() + b"\n")

    def dismiss(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.wfd, b"done\n")
        with contextlib.suppress(OSError):
            os.close(self.wfd)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def start(spec: dict[str, Any], directory: Path) -> Handle:
    """Start the guardian for ``spec`` (sockets, original settings)."""
    private.make_dir(directory)
    spec = {**spec, "watch_pid": os.getpid()}
    spec_path = directory / "guardian.json"
    private.write_text(spec_path, json.dumps(spec))
    rfd, wfd = os.pipe()  # both non-inheritable; rfd becomes the child's stdin only
    logf = os.fdopen(private.open_file(directory / "guardian.log", append=True), "ab")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "livemig.engine.guardian", str(spec_path)],
            stdin=rfd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
            close_fds=True)
    finally:
        os.close(rfd)
        logf.close()
    return Handle(proc, wfd)


def read_words() -> set[str]:
    """Block on the pipe from livemig (standard input) until its write end closes;
    the words livemig told on the way. Also the libvirt hold guard's (``virt/hold``)."""
    data = b""
    while True:
        try:
            chunk = os.read(0, 64)
        except InterruptedError:
            continue
        if not chunk:
            return set(data.decode(errors="replace").split())
        data += chunk


def _wait_for_parent() -> tuple[bool, set[str]]:
    """(True when livemig said ``done``, False when it died (EOF without it); the
    words it told on the way)."""
    words = read_words()
    return "done" in words, words


async def repair(spec: dict[str, Any]) -> dict[str, Any]:
    """Make the migration safe after livemig died; return what was done."""
    from livemig.engine.endpoint import Endpoint

    src = Endpoint("src", Path(spec["src"]))
    dst = Endpoint("dst", Path(spec["dst"]))
    reachable = []
    notes = []
    for end in (src, dst):
        try:
            await end.connect(CONNECT_TIMEOUT_S)
            reachable.append(end)
        except LivemigError as e:
            notes.append(f"{end.name}: not reachable: {e}")
    try:
        done = await repair_ends(src if src in reachable else None,
                                 dst if dst in reachable else None, spec)
    finally:
        for end in (src, dst):
            await end.close()
    done["actions"][:0] = notes
    return done


async def repair_ends(src: Any, dst: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The repair itself, on connected ends (None: unreachable)."""
    from livemig.engine.negotiate import EndSettings, restore

    done: dict[str, Any] = {"actions": []}
    act = done["actions"].append
    if src is not None:
        info = await src.cmd("query-migrate")
        status = info.get("status", "none")
        if status not in ("completed", "failed", "cancelled", "none") and \
                not str(status).startswith("postcopy"):
            await src.cmd("migrate_cancel")
            act(f"migrate_cancel (was {status})")
            for _ in range(600):
                status = (await src.cmd("query-migrate")).get("status")
                if status in ("completed", "failed", "cancelled"):
                    break
                await asyncio.sleep(0.05)
        unproven = bool(spec.get("verify")) and not spec.get(VERIFIED)
        refused = status == "completed" and (bool(spec.get(REFUSE_DESTINATION)) or unproven)
        if refused:
            act("destination proven corrupt: left paused" if spec.get(REFUSE_DESTINATION)
                else "destination not verified yet (livemig died before the comparison "
                "passed): left paused; the intact source runs")
            await _deactivate(dst)
        if str(status).startswith("postcopy"):
            # the destination runs the guest and pulls its pages from the source:
            # resuming the source would run it twice; cancelling would lose it
            act(f"post-copy ({status}): the destination runs the guest; source left "
                "as it is")
        elif refused or not (status == "completed"
                             and await _resume_destination(dst, act)):
            st = (await src.cmd("query-status")).get("status")
            if st in RUNNABLE_PAUSED and await _destination_stopped(dst, act):
                try:
                    await src.cmd("cont")
                    act(f"source cont (was {st})")
                except LivemigError as e:  # log it; the restores below still run
                    act(f"source cont failed: {e}")
        if spec.get("block_job"):  # the lab's disk mirror
            with contextlib.suppress(LivemigError):
                await src.cmd("block-job-cancel", device=spec["block_job"], force=True)
                act(f"block-job-cancel {spec['block_job']}")
        if spec.get("io_throttle_device"):  # the lab's IO QoS cap on the guest's disk
            with contextlib.suppress(LivemigError):
                await src.cmd("block_set_io_throttle", id=spec["io_throttle_device"], bps=0,
                              bps_rd=0, bps_wr=0, iops=0, iops_rd=0, iops_wr=0)
                act("io throttle removed")
        with contextlib.suppress(LivemigError):
            if await src.has_command("cancel-cpu-throttle"):
                await src.cmd("cancel-cpu-throttle")
                act("cancel-cpu-throttle")
    if spec.get("affinity"):  # the source's vCPU threads livemig pinned
        from livemig.engine.pinning import restore_affinities
        for line in restore_affinities({int(t): c for t, c in spec["affinity"].items()}):
            act(line)
    for end, key in ((src, "original_src"), (dst, "original_dst")):
        if end is not None and key in spec:
            with contextlib.suppress(LivemigError, OSError):
                r = await restore(end, EndSettings.from_dict(spec[key]))
                act(f"{end.name}: restored {r}")
    if dst is not None and spec.get(QUIT_UNUSED_DESTINATION, True):
        await quit_unused_destination(dst, act)
    return done


async def _deactivate(dst: Any) -> None:
    """A destination that must not run gives its disks back (as the engine does)."""
    if dst is None:
        return
    with contextlib.suppress(LivemigError, OSError):
        if await dst.has_command("blockdev-set-active"):
            await dst.cmd("blockdev-set-active", active=False)


async def _destination_stopped(dst: Any, act: Any) -> bool:
    """The split-brain guard: the source resumes only if the destination does not
    run the guest (``stop`` clears autostart on one still loading). An unreachable
    destination counts as stopped: the guardian cannot see it, and a source left
    paused would leave no guest running anywhere in the far likelier case that the
    destination never loaded."""
    if dst is None:
        return True
    try:
        st = (await dst.cmd("query-status")).get("status")
        if st != "running":  # never stop a guest that runs: it is the VM now
            with contextlib.suppress(LivemigError):
                await dst.cmd("stop")
            st = (await dst.cmd("query-status")).get("status")
    except LivemigError:
        return True
    if st == "running":
        act("destination runs the guest: source left paused (split-brain guard)")
        return False
    return True


async def _resume_destination(dst: Any, act: Any) -> bool:
    """The migration completed: run the guest on the destination if it loaded."""
    if dst is None:
        return False
    try:
        incoming = (await dst.cmd("query-migrate")).get("status")
        st = (await dst.cmd("query-status")).get("status")
    except LivemigError:
        return False
    if st == "running":
        act("destination already running")
        return True
    if incoming == "completed" and st in RUNNABLE_PAUSED:
        await dst.cmd("cont")
        act(f"destination cont (was {st})")
        return True
    return False


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s guardian %(message)s")
    spec = json.loads(Path(argv[0]).read_text())
    log.info("watching livemig pid %s", spec.get("watch_pid"))
    finished, words = _wait_for_parent()
    if finished:
        log.info("livemig finished normally")
        return 0
    spec[REFUSE_DESTINATION] = REFUSE_DESTINATION in words
    spec[VERIFIED] = VERIFIED in words
    log.info("livemig died: repairing")
    t0 = time.monotonic()
    try:
        done = asyncio.run(repair(spec))
    except Exception as e:  # log, never a traceback in someone's terminal
        log.info("repair failed: %r", e)
        return 1
    log.info("repair done in %.1fs: %s", time.monotonic() - t0, done)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
