"""Try `livemig migrate --src-qmp --dst-qmp` on hand-started VMs in configurations the
tests never used (README.md beside this file has what it found).

    flock /tmp/livemig-vm.lock .venv/bin/python docs/results/configs-2026-11-27/sweep.py [CASE...]

Each case: two plain QEMU command lines (this repository's guest kernel and initramfs,
the workload on the kernel command line), the destination with -incoming defer -S
unless the case says otherwise, 12 s of workload, then livemig; one JSON object per
case on stdout. QEMU_PATCHED overrides the patched binary (to compare two builds).
Scratch files under /tmp/me/sweep (a raw disk image /tmp/me/shared.raw for raw-disk:
create it with `truncate -s 1G`)."""
import json, os, signal, subprocess, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
PATCHED = Path(os.environ.get("QEMU_PATCHED", ROOT / "build/qemu/qemu-system-x86_64"))
STOCK = ROOT / "build/qemu-upstream/qemu-system-x86_64"
K, I = ROOT / "build/guest/vmlinuz", ROOT / "build/guest/initrd.img"

def start(d, name, qemu, machine, mem, smp, workload, extra, incoming=None, paused=False, agent=True):
    argv = [str(qemu), "-L", "/usr/share/seabios", "-L", "/usr/share/qemu", "-nodefaults",
            "-no-user-config", "-display", "none", "-accel", "tcg", "-machine", machine,
            "-m", mem, "-smp", str(smp), "-kernel", str(K), "-initrd", str(I),
            "-append", f"console=ttyS0 quiet livemig.workload={workload}",
            "-serial", f"file:{d}/{name}.console", "-qmp", f"unix:{d}/{name}.qmp,server=on,wait=off"]
    if agent:
        argv += ["-device", "virtio-serial-pci,id=vser0", "-chardev",
                 f"socket,id=agentch,path={d}/{name}.agent,server=on,wait=off",
                 "-device", "virtserialport,bus=vser0.0,chardev=agentch,name=org.livemig.agent0"]
    argv += extra
    if incoming:
        argv += ["-incoming", incoming]
    if paused:
        argv += ["-S"]
    p = subprocess.Popen(argv, stdout=open(f"{d}/{name}.log", "wb"), stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    for _ in range(200):
        if os.path.exists(f"{d}/{name}.qmp"): break
        if p.poll() is not None: raise SystemExit(open(f"{d}/{name}.log").read())
        time.sleep(0.05)
    return p

def case(name, *, src_qemu=PATCHED, dst_qemu=PATCHED, machine="q35", mem="1G", smp=1,
         workload="mem:size=256M,rate=0,hot=80/10,touch=128", extra=(), dst_extra=None,
         dst_incoming="defer", dst_paused=True, agent=True, args=(), boot=12):
    d = Path(f"/tmp/me/sweep/{name}"); subprocess.run(["rm", "-rf", str(d)]); d.mkdir(parents=True)
    port = 47000 + (abs(hash(name)) % 1000)
    inc = dst_incoming if dst_incoming == "defer" else dst_incoming.format(port=port)
    s = start(d, "src", src_qemu, machine, mem, smp, workload, list(extra), agent=agent)
    t = start(d, "dst", dst_qemu, machine, mem, smp, workload,
              list(dst_extra if dst_extra is not None else extra), incoming=inc, paused=dst_paused, agent=agent)
    time.sleep(boot)
    cmd = [str(ROOT / ".venv/bin/livemig"), "migrate", "--src-qmp", f"{d}/src.qmp", "--dst-qmp",
           f"{d}/dst.qmp", "--uri", f"tcp:127.0.0.1:{port}", "--report", f"{d}/report.json", *args]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall = time.time() - t0
    out = {"case": name, "rc": r.returncode, "wall": round(wall, 2),
           "stderr_tail": r.stderr.strip().splitlines()[-6:], "stdout_tail": r.stdout.strip().splitlines()[-3:]}
    try:
        rep = json.load(open(f"{d}/report.json"))
        out.update({k: rep.get(k) for k in ("outcome", "reason", "total_time_s", "downtime_ms", "guest_pause_ms", "verify_hold_ms", "ram_transferred_bytes")})
        out["ram"] = (rep.get("consistency") or {}).get("ram")
        enc = rep.get("encoding") or {}
        out["encoding"] = {k: enc.get(k) for k in ("chosen", "sampler", "why", "reason") if k in enc}
        out["not_applied"] = [e for e in rep.get("events", []) if "not" in json.dumps(e)[:200] and e.get("event") not in ("round",)][:6]
    except Exception as e:
        out["report_error"] = repr(e)
    out["src_alive"] = s.poll() is None; out["dst_alive"] = t.poll() is None
    for p in (s, t):
        if p.poll() is None: os.kill(p.pid, signal.SIGKILL); p.wait()
    print(json.dumps(out, indent=1)[:3000], flush=True)

CASES = {
 "pc-2cpu-5G": dict(machine="pc", mem="5G", smp=2, args=["--profile", "livemig"]),
 "numa-2blocks": dict(extra=["-object", "memory-backend-ram,id=m0,size=512M", "-object", "memory-backend-ram,id=m1,size=512M",
                             "-numa", "node,memdev=m0", "-numa", "node,memdev=m1"], args=["--profile", "livemig"]),
 "dst-incoming-tcp-running": dict(dst_incoming="tcp:127.0.0.1:{port}", dst_paused=False, args=["--profile", "livemig"]),
 "dst-incoming-tcp-paused": dict(dst_incoming="tcp:127.0.0.1:{port}", args=["--profile", "livemig"]),
 "stock-src-patched-dst": dict(src_qemu=STOCK, args=["--profile", "livemig"]),
 "no-agent-unlimited": dict(agent=False, workload="mem:size=256M,rate=80M,hot=70/20,touch=4096,fill=mixed", args=["--profile", "livemig"]),
 "stock-both-10M": dict(src_qemu=STOCK, dst_qemu=STOCK, args=["--profile", "livemig", "--bandwidth", "10M"], workload="mem:size=128M,rate=4M,hot=80/10,touch=128"),
}

NUMA = ["-object", "memory-backend-ram,id=m0,size=512M", "-object", "memory-backend-ram,id=m1,size=512M", "-numa", "node,memdev=m0", "-numa", "node,memdev=m1"]
for enc in ("lz4-delta", "lz4", "zstd", "plain", "xbzrle"):
    CASES["numa-" + enc] = dict(extra=NUMA, args=["--profile", "livemig", "--set", "encoding=" + enc])
CASES["numa-upstream"] = dict(extra=NUMA, args=["--profile", "upstream"])
CASES["q35-lz4-delta"] = dict(args=["--profile", "livemig", "--set", "encoding=lz4-delta"])

CASES["memfd-upstream"] = dict(extra=["-object", "memory-backend-memfd,id=mem,size=1G,share=on", "-machine", "q35,memory-backend=mem"], args=["--profile", "upstream"])
CASES["memfd"] = dict(extra=["-object", "memory-backend-memfd,id=mem,size=1G,share=on", "-machine", "q35,memory-backend=mem"], args=["--profile", "livemig"])
CASES["smp2-bw50"] = dict(smp=2, args=["--profile", "livemig", "--bandwidth", "50M"], workload="mem:size=256M,rate=80M,hot=70/20,touch=4096,fill=mixed")
CASES["raw-disk"] = dict(extra=["-drive", "if=none,id=d0,file=/tmp/me/shared.raw,format=raw,cache=none", "-device", "virtio-blk-pci,drive=d0"], args=["--profile", "livemig"])
CASES["dimm"] = dict(mem="512M,slots=2,maxmem=2G", extra=["-object", "memory-backend-ram,id=dm,size=512M", "-device", "pc-dimm,memdev=dm,id=dimm0"], args=["--profile", "livemig"])
CASES["stock-both-livemig-dimm"] = dict(src_qemu=STOCK, dst_qemu=STOCK, mem="512M,slots=2,maxmem=2G", extra=["-object", "memory-backend-ram,id=dm,size=512M", "-device", "pc-dimm,memdev=dm,id=dimm0"], args=["--profile", "livemig"])
for n in (sys.argv[1:] or CASES):
    try:
        case(n, **CASES[n])
    except Exception as e:
        print(n, "CRASH", repr(e), flush=True)
