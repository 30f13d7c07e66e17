"""Which per-page addition holds the whole-page writer's stream on the busy fleet:
migrate fleet-1 between src and dst with variants, the other 4 guests running."""
import asyncio, json, subprocess, sys, time
from pathlib import Path
from livemig import paths
from livemig.evacuate import testfleet
from livemig.evacuate.harm import FleetWatch
from livemig.testbed import libvirtd, topology
from livemig.units import parse_link_rate

OUT = Path(sys.argv[1]); OUT.mkdir(exist_ok=True, parents=True)
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 1
VARIANTS = [("livemig", []), ("upstream", ["--profile", "upstream"]),
            ("zstd", ["--set", "encoding=zstd"]),
            ("zstd3", ["--set", "encoding=zstd", "--set", "multifd-zstd-level=3"]),
            ("no-verify", ["--no-verify"]), ("encoding-off", ["--set", "encoding=off"])]
if len(sys.argv) > 3:
    VARIANTS = [v for v in VARIANTS if v[0] in sys.argv[3].split(",")]
with topology.locked(wait=600):
    created = not topology.is_up()
    link = parse_link_rate("100mbit")
    if created:
        topology.up(link, owner="diag")
    else:
        topology.set_link(link)
    libvirtd.up()
    prefix = f"diag{int(time.time()) % 100000}"
    names = list(testfleet.define(5, 192, prefix, paths.default_qemu(), "busy"))
    try:
        async def ready():
            w = FleetWatch(names); await w.start(); await w.wait_ready(180); await w.close()
        asyncio.run(ready()); time.sleep(5)
        sides = ["src", "dst"]
        k = 0
        for rep in range(REPS):
            for name, extra in VARIANTS:
                a, b = sides[k % 2], sides[(k + 1) % 2]; k += 1
                out = OUT / f"{name}-{rep}.json"
                cmd = [sys.executable, "-m", "livemig.cli", "migrate", "--domain", f"{prefix}-1",
                       "--connect", libvirtd.uri(a), "--to", libvirtd.uri(b), "--profile", "livemig",
                       "--storage", "shared", "--unsafe", "-q",
                       "--set", "link-rate=100mbit", "--report", str(out), *extra]
                t0 = time.time()
                p = subprocess.run(cmd, capture_output=True, text=True)
                r = json.loads(out.read_text()) if out.exists() else {}
                ph = (r.get("libvirt") or {}).get("phases") or {}
                mb = (r.get('ram_transferred_bytes') or 0) / 1e6
                q = ph.get('migration_s') or 0
                print(name, rep, a, '->', b, 'rc', p.returncode, 'wall', round(time.time() - t0, 1),
                      'call', r.get('total_time_s'), 'qemu', q, 'MB', round(mb, 1),
                      'MB/s', round(mb / q, 2) if q else None,
                      'enc', (r.get('encoding') or {}).get('encoding'),
                      'cpu', r.get('cpu_seconds'), flush=True)
                if p.returncode:
                    print(p.stderr[-2000:], flush=True)
    finally:
        testfleet.remove(names)
        libvirtd.down()
        if created:
            topology.down(quiet=True)
