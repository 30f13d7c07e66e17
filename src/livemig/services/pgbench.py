"""pgbench (Debian's, from postgresql) on the client host against the guest's
PostgreSQL: TPC-B-like transactions, a progress line every second."""

from __future__ import annotations

import glob
import os
import re
import shutil
from pathlib import Path

from livemig.errors import SetupError
from livemig.services.client import ClientSeries, LoadProcess, Tick

PROGRESS = re.compile(
    r"^progress: (?P<at>[\d.]+) s, (?P<tps>[\d.]+) tps, lat (?P<lat>[\d.]+|NaN) ms"
    r"(?: stddev [\d.]+|NaN)?(?:, (?P<failed>\d+) failed)?")
ABORTED = re.compile(r"client \d+ aborted|connection to server .* failed|"
                     r"server closed the connection|could not connect")


def find_pgbench() -> Path:
    """Debian installs pgbench outside PATH, per PostgreSQL version; without the
    server package, scripts/client-tools.sh puts it in livemig's cache."""
    found = shutil.which("pgbench")
    if found:
        return Path(found)
    cache = Path(os.environ.get("LIVEMIG_CACHE", Path.home() / ".cache" / "livemig"))
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench")) + sorted(
        glob.glob(str(cache / "client-tools" / "usr/lib/postgresql/*/bin/pgbench")))
    if not versions:
        raise SetupError("pgbench not found: run 'make setup' (scripts/client-tools.sh "
                         "takes it out of Debian's postgresql package)")
    return Path(versions[-1])


def parse_line(line: str, now: float, series: ClientSeries) -> None:
    """One line of pgbench's output (progress lines on stderr, errors too)."""
    m = PROGRESS.match(line)
    if m:
        lat = m.group("lat")
        failed = int(m.group("failed") or 0)
        series.ticks.append(Tick(now, float(m.group("tps")),
                                 None if lat == "NaN" else float(lat), failed))
        series.errors += failed
        return
    if ABORTED.search(line):
        series.disconnects += 1
        series.note(line)
    elif line.startswith(("pgbench: error", "ERROR", "FATAL")):
        series.errors += 1
        series.note(line)


def command(host: str, clients: int, seconds: int, db: str = "bench",
            user: str = "postgres") -> list[str]:
    """Runs ``seconds`` at most; livemig stops it earlier when the run is over."""
    return [str(find_pgbench()), "-h", host, "-U", user, "-c", str(clients), "-j", "1",
            "-T", str(seconds), "-P", "1", "-n", db]


def start(prefix: list[str], host: str, clients: int, seconds: int = 3600) -> LoadProcess:
    """``prefix``: e.g. ``ip netns exec lm-client`` to run on the client host."""
    lp = LoadProcess("pgbench", prefix + command(host, clients, seconds), parse_line)
    lp.start()
    return lp
