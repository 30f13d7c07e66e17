"""A warm ``livemig migrate --domain`` child for the evacuation (:mod:`.pool`).

It imports what a libvirt migration needs and builds livemig's ``migrate`` parser
(a child's start: 3.5-5.2 s cold on the busy fleet, five TCG guests on two cores,
0.1-0.2 s warm; docs/results/evacuate-2026-11-27.md), then waits for one line on
stdin: a JSON object with the child's ``argv``, its ``log`` file (stdout and stderr
go there from then on) and its ``env``. It then runs ``livemig`` with that argv and exits with its
status, exactly as a child started cold would. End of input (the evacuation needed
no more children, or it died) ends it without touching anything.
"""

from __future__ import annotations

import json
import logging
import os
import sys


def main() -> int:
    import livemig.cli as cli
    import livemig.engine.adapt
    import livemig.virt.cli
    import livemig.virt.sampling  # noqa: F401 (imported for their start-up cost)
    from livemig.virt.conn import libvirt_module

    libvirt_module()
    cli._build_parser("migrate")
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    job = json.loads(line)
    fd = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # as a cold child's: nothing to read
    os.close(devnull)
    for k in job.get("unset", []):
        os.environ.pop(k, None)
    os.environ.update(job.get("env") or {})
    rc = cli.main(list(job["argv"]))
    # the run is over, its report written and its connections closed: exit without
    # the interpreter's teardown of everything imported (0.15-0.25 s on the loaded
    # testbed), which the evacuation would wait for before it sees the VM done
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # cancelled while it waited: nothing was started
        sys.exit(130)
