/*
 * livemig-agent: runs the workload from the kernel command line or the host,
 * reports heartbeats and counters, answers commands. See docs/agent-protocol.md.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include "agent.h"

#define PORT_NAME "org.livemig.agent0"

static uint64_t hb_ms = 10, report_ms = 100;

/**
 * reporter: the heartbeat (every hb_ms) and the counters (every report_ms).
 *
 * Ticks are absolute deadlines on CLOCK_MONOTONIC, so the period does not drift
 * with the time spent formatting; ticks missed while the VM was paused are
 * skipped, not replayed (the host measures that gap).
 */
static void *reporter(void *arg)
{
    uint64_t seq = 0, hb_seq = 0, hb_ns = hb_ms * 1000000ull;
    uint64_t report_ns = report_ms * 1000000ull, next = now_ns(), next_report = next;

    (void)arg;
    for (;;) {
        uint64_t t = now_ns();
        channel_send(0, "{\"ev\":\"hb\",\"seq\":%llu,\"t\":%llu}\n",
                     (unsigned long long)hb_seq++, (unsigned long long)t);
        if (t >= next_report) {
            channel_send(0, "{\"ev\":\"rate\",\"seq\":%llu,\"t\":%llu,\"mem_bytes\":%llu,"
                         "\"mem_ops\":%llu,\"disk_bytes\":%llu,\"disk_ops\":%llu,"
                         "\"verify_blocks\":%llu,\"verify_errors\":%llu,\"dropped\":%llu,"
                         "\"net_bytes\":%llu,\"net_conns\":%llu}\n",
                         (unsigned long long)seq++, (unsigned long long)t,
                         (unsigned long long)atomic_load(&g_count.mem_bytes),
                         (unsigned long long)atomic_load(&g_count.mem_ops),
                         (unsigned long long)atomic_load(&g_count.disk_bytes),
                         (unsigned long long)atomic_load(&g_count.disk_ops),
                         (unsigned long long)atomic_load(&g_count.verify_blocks),
                         (unsigned long long)atomic_load(&g_count.verify_errors),
                         (unsigned long long)channel_dropped(),
                         (unsigned long long)atomic_load(&g_count.net_bytes),
                         (unsigned long long)atomic_load(&g_count.net_conns));
            next_report += report_ns;
            if (next_report <= t) {
                next_report = t + report_ns;
            }
        }
        next += hb_ns;
        t = now_ns();
        if (next <= t) {
            next = t + hb_ns; /* fell behind (paused): skip the missed ticks */
        }
        sleep_until_ns(next);
    }
    return NULL;
}

/* value of `key=` on the kernel command line, or NULL */
static char *cmdline_arg(const char *cmdline, const char *key, char *out, size_t len)
{
    size_t kl = strlen(key);
    const char *p = cmdline;

    while ((p = strstr(p, key))) {
        if ((p == cmdline || p[-1] == ' ') && p[kl] == '=') {
            size_t n = strcspn(p + kl + 1, " \n");
            if (n >= len) {
                n = len - 1;
            }
            memcpy(out, p + kl + 1, n);
            out[n] = 0;
            return out;
        }
        p += kl;
    }
    return NULL;
}

static uint64_t ms_arg(const char *cmdline, const char *key, uint64_t dflt)
{
    char val[32];
    long v;

    if (!cmdline_arg(cmdline, key, val, sizeof(val))) {
        return dflt;
    }
    v = atol(val);
    return v > 0 && v <= 60000 ? (uint64_t)v : dflt;
}

/* usage: livemig-agent [SPEC]  (SPEC overrides livemig.workload, for tests on a host) */
int main(int argc, char **argv)
{
    char cmdline[4096] = "", spec[SPEC_MAX] = "idle", line[SPEC_MAX + 64], esc[2 * SPEC_MAX];
    char ip[64];
    FILE *f = fopen("/proc/cmdline", "r");
    struct sysinfo si;
    pthread_t t;

    if (f) {
        if (!fgets(cmdline, sizeof(cmdline), f)) {
            cmdline[0] = 0;
        }
        fclose(f);
    }
    cmdline_arg(cmdline, "livemig.workload", spec, sizeof(spec));
    if (argc > 1) {
        snprintf(spec, sizeof(spec), "%s", argv[1]);
    }
    hb_ms = ms_arg(cmdline, "livemig.hb_ms", 10);
    report_ms = ms_arg(cmdline, "livemig.report_ms", 100);
    /* the port appears once virtio_console has probed; on a host (argv) do not wait */
    for (int i = 0; i < (argc > 1 ? 1 : 100) && channel_open(PORT_NAME); i++) {
        sleep_ns(100000000ull);
    }
    sysinfo(&si);
    json_escape(esc, sizeof(esc), spec);
    channel_start_writer();
    /* queued before the reporter exists, so it comes first */
    channel_send(CH_EVENT, "{\"ev\":\"hello\",\"ver\":1,\"mem_kb\":%llu,\"cpus\":%ld,"
                 "\"workload\":\"%s\"}\n",
                 (unsigned long long)si.totalram * si.mem_unit / 1024,
                 sysconf(_SC_NPROCESSORS_ONLN), esc);
    start_thread(&t, reporter, NULL, 1);
    /* the UDP echo answers probes on the guest network, when there is one; the TCP
     * sink takes a client's stream there (normal priority: it may run flat out) */
    if (cmdline_arg(cmdline, "livemig.ip", ip, sizeof(ip))) {
        start_thread(&t, echo_thread, NULL, 1);
        start_thread(&t, sink_thread, NULL, 0);
    }
    workload_start(spec);
    for (;;) {
        int rc = channel_readline(line, sizeof(line), 200);
        if (rc <= 0) {
            continue;
        }
        if (!strncmp(line, "workload ", 9)) {
            workload_start(line + 9);
        } else if (!strcmp(line, "stop")) {
            workload_stop();
            channel_send(CH_EVENT, "{\"ev\":\"ready\",\"workload\":\"idle\"}\n");
        } else if (!strncmp(line, "ping ", 5)) {
            json_escape(esc, 256, line + 5);
            channel_send(CH_KEEP, "{\"ev\":\"pong\",\"token\":\"%s\"}\n", esc);
        } else if (line[0]) {
            json_escape(esc, 128, line);
            channel_send(CH_EVENT, "{\"ev\":\"error\",\"msg\":\"unknown command: %s\"}\n",
                         esc);
        }
    }
}
