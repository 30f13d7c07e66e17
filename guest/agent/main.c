/*
 * livemig-agent: runs the workload from the kernel command line or the host,
 * reports heartbeats and counters, answers commands. See docs/agent-protocol.md.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include "agent.h"

#define PORT_NAME "org.livemig.agent0"
#define MAX_THREADS 128

struct counters g_count;
atomic_int g_stop;

static unsigned hb_ms = 10, report_ms = 100;
static pthread_t threads[MAX_THREADS];
static int n_threads;
static struct workload current;
static struct mem_job *mem_jobs[MAX_ITEMS];
static struct mem_thread mem_threads[MAX_THREADS];
static struct disk_job disk_jobs[MAX_ITEMS];
static char current_text[1024] = "idle";

static int spawn(void *(*fn)(void *), void *arg)
{
    if (n_threads == MAX_THREADS || pthread_create(&threads[n_threads], NULL, fn, arg)) {
        channel_send("{\"ev\":\"error\",\"msg\":\"cannot start a workload thread\"}\n");
        return -1;
    }
    n_threads++;
    return 0;
}

static void stop_workload(void)
{
    atomic_store(&g_stop, 1);
    for (int i = 0; i < n_threads; i++) {
        pthread_join(threads[i], NULL);
    }
    n_threads = 0;
    for (int i = 0; i < current.n_mem; i++) {
        memload_free(mem_jobs[i]);
        mem_jobs[i] = NULL;
    }
    memset(&current, 0, sizeof(current));
    atomic_store(&g_stop, 0);
    snprintf(current_text, sizeof(current_text), "idle");
}

static void start_workload(const char *text)
{
    char err[256];
    int t = 0;

    stop_workload();
    if (parse_workload(text, &current, err, sizeof(err))) {
        channel_send("{\"ev\":\"error\",\"msg\":\"bad workload: %s\"}\n", err);
        memset(&current, 0, sizeof(current));
        return;
    }
    snprintf(current_text, sizeof(current_text), "%s", text);
    for (int i = 0; i < current.n_mem; i++) {
        mem_jobs[i] = memload_prepare(&current.mem[i], err, sizeof(err));
        if (!mem_jobs[i]) {
            channel_send("{\"ev\":\"error\",\"msg\":\"%s\"}\n", err);
            current.n_mem = i;
            return;
        }
    }
    for (int i = 0; i < current.n_mem; i++) {
        for (unsigned k = 0; k < current.mem[i].threads && t < MAX_THREADS; k++, t++) {
            mem_threads[t].job = mem_jobs[i];
            mem_threads[t].index = (unsigned)t;
            spawn(memload_thread, &mem_threads[t]);
        }
    }
    for (int i = 0; i < current.n_disk; i++) {
        disk_jobs[i].spec = current.disk[i];
        disk_jobs[i].base = current.has_verify && !strcmp(current.disk[i].dev, "/dev/vda")
                          ? current.verify.disk : 0;
        spawn(diskload_thread, &disk_jobs[i]);
    }
    if (current.has_verify && current.verify.mem) {
        spawn(verify_mem_thread, &current.verify);
    }
    if (current.has_verify && current.verify.disk) {
        spawn(verify_disk_thread, &current.verify);
    }
    channel_send("{\"ev\":\"ready\",\"workload\":\"%s\"}\n", current_text);
}

static void *reporter(void *arg)
{
    uint64_t seq = 0, hb_seq = 0, next_report = now_ns();

    (void)arg;
    for (;;) {
        uint64_t t = now_ns();
        channel_send("{\"ev\":\"hb\",\"seq\":%llu,\"t\":%llu}\n",
                     (unsigned long long)hb_seq++, (unsigned long long)t);
        if (t >= next_report) {
            channel_send("{\"ev\":\"rate\",\"seq\":%llu,\"t\":%llu,\"mem_bytes\":%llu,"
                         "\"mem_ops\":%llu,\"disk_bytes\":%llu,\"disk_ops\":%llu,"
                         "\"verify_blocks\":%llu}\n",
                         (unsigned long long)seq++, (unsigned long long)t,
                         (unsigned long long)atomic_load(&g_count.mem_bytes),
                         (unsigned long long)atomic_load(&g_count.mem_ops),
                         (unsigned long long)atomic_load(&g_count.disk_bytes),
                         (unsigned long long)atomic_load(&g_count.disk_ops),
                         (unsigned long long)atomic_load(&g_count.verify_blocks));
            next_report = t + (uint64_t)report_ms * 1000000ull;
        }
        sleep_ns((uint64_t)hb_ms * 1000000ull);
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

int main(void)
{
    char cmdline[4096] = "", spec[1024] = "idle", val[32], line[1100];
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
    if (cmdline_arg(cmdline, "livemig.hb_ms", val, sizeof(val))) {
        hb_ms = (unsigned)atoi(val) ?: 10;
    }
    if (cmdline_arg(cmdline, "livemig.report_ms", val, sizeof(val))) {
        report_ms = (unsigned)atoi(val) ?: 100;
    }
    for (int i = 0; i < 100 && channel_open(PORT_NAME); i++) {
        sleep_ns(100000000ull);
    }
    sysinfo(&si);
    channel_send("{\"ev\":\"hello\",\"ver\":1,\"mem_kb\":%llu,\"cpus\":%ld,"
                 "\"workload\":\"%s\"}\n",
                 (unsigned long long)si.totalram * si.mem_unit / 1024,
                 sysconf(_SC_NPROCESSORS_ONLN), spec);
    pthread_create(&t, NULL, reporter, NULL);
    pthread_create(&t, NULL, echo_thread, NULL);
    start_workload(spec);
    for (;;) {
        int rc = channel_readline(line, sizeof(line), 200);
        if (rc <= 0) {
            continue;
        }
        if (!strncmp(line, "workload ", 9)) {
            start_workload(line + 9);
        } else if (!strcmp(line, "stop")) {
            stop_workload();
            channel_send("{\"ev\":\"ready\",\"workload\":\"idle\"}\n");
        } else if (!strncmp(line, "ping ", 5)) {
            channel_send("{\"ev\":\"pong\",\"token\":\"%.64s\"}\n", line + 5);
        } else {
            channel_send("{\"ev\":\"error\",\"msg\":\"unknown command\"}\n");
        }
    }
}
