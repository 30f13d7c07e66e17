"""Warm children for the evacuation: ``livemig migrate --domain`` processes that have
already imported what they need (:mod:`.worker`) and wait for their argv.

A migration's child used to start cold when the scheduler started its VM: 5 s of
Python start-up per VM on the busy fleet (five TCG guests on two cores), before its
first byte. The pool keeps ``size`` children warming while the others migrate, so a
start is a line written to a process that is ready. A management layer (Nova's
compute service, KubeVirt's handler) is a long-running process and pays no start
per migration either; every configuration of ``livemig evacuate`` (the fixed
baselines too) goes through the pool.

A child taken from the pool is the same ``livemig migrate --domain`` as a cold one:
its own process, session, guard and report; a cold one is started when no warm one
is ready (or it died). Children not needed are ended by closing their input; should
the evacuation die, they read end of input and exit without touching anything.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

WORKER = [sys.executable, "-m", "livemig.evacuate.worker"]


def _interruptible() -> None:
    """In the child, before it runs: SIGINT as a program gets it by default. An
    evacuation started in the background (nohup, a script's ``&``) has SIGINT
    ignored, its children would inherit that, and the cancel (SIGINT to each child)
    would not reach a child that had not yet installed its own handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Pool:
    def __init__(self, size: int, env: dict[str, str]) -> None:
        self.size = size
        self.env = env  # the children's environment (without a VM's own variables)
        self.ready: list[subprocess.Popen[bytes]] = []
        self.cold = 0  # children started cold (none warm and alive)

    def fill(self, wanted: int) -> None:
        """Warm up to ``min(size, wanted)`` children (``wanted``: VMs still to start)."""
        self.ready = [p for p in self.ready if p.poll() is None]
        while len(self.ready) < min(self.size, wanted):
            self.ready.append(subprocess.Popen(
                WORKER, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, env=self.env,
                preexec_fn=_interruptible))

    def run(self, argv: list[str], log: Path, env: dict[str, str],
            unset: list[str]) -> subprocess.Popen[bytes]:
        """``livemig argv`` in a warm child (a cold one if none is ready), its output
        appended to ``log``, ``env`` set and ``unset`` removed in its environment."""
        while self.ready:
            p = self.ready.pop(0)
            if p.poll() is not None or p.stdin is None:
                continue
            try:
                p.stdin.write((json.dumps({"argv": argv, "log": str(log), "env": env,
                                           "unset": unset}) + "\n").encode())
                p.stdin.close()
            except OSError:  # it died in between: the next one
                continue
            return p
        self.cold += 1
        child_env = {**{k: v for k, v in self.env.items() if k not in unset}, **env}
        with open(log, "ab") as f:
            return subprocess.Popen([sys.executable, "-m", "livemig.cli", *argv],
                                    stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env=child_env, preexec_fn=_interruptible)

    def close(self) -> None:
        """End the children no VM needed: end of input, then wait for them."""
        for p in self.ready:
            with contextlib.suppress(OSError):
                if p.stdin is not None:
                    p.stdin.close()
        for p in self.ready:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.ready = []
