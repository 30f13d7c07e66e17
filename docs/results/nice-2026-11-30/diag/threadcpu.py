"""Every 100 ms: CPU ticks of every thread of every qemu-system process; prints per
100 ms the CPU (in cores) used by each thread class after a run ends."""
import os, sys, time, json
out = open(sys.argv[1], 'w')
hz = os.sysconf('SC_CLK_TCK')
end = time.time() + float(sys.argv[2])
while time.time() < end:
    t = time.time()
    rec = {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit():
            continue
        try:
            comm = open(f'/proc/{pid}/comm').read().strip()
            if not comm.startswith('qemu-system'):
                continue
            cmd = open(f'/proc/{pid}/cmdline').read()
            role = 'dst' if 'incoming' in cmd else 'src'
            for tid in os.listdir(f'/proc/{pid}/task'):
                st = open(f'/proc/{pid}/task/{tid}/stat').read().rsplit(')', 1)[1].split()
                rec[f'{role}:{pid}:{tid}'] = int(st[11]) + int(st[12])
        except OSError:
            continue
    out.write(json.dumps([t, rec]) + '\n')
    out.flush()
    time.sleep(0.1)
