/*
 * Starting and stopping a workload: parse the spec, prepare every item (allocate
 * and fill memory, stamp the checker's blocks), start the threads, say "ready".
 * A bad spec leaves the running workload alone.
 */
#include <stdio.h>
#include <string.h>

#include "agent.h"

#define MAX_THREADS 128
#define DISK_WRITERS 4 /* writes in flight per disk item */

struct counters g_count;
atomic_int g_stop;

static pthread_t threads[MAX_THREADS];
static int n_threads;
static struct workload current;
static struct mem_job *mem_jobs[MAX_ITEMS];
static struct mem_thread mem_threads[MAX_THREADS];
static struct disk_job disk_jobs[MAX_ITEMS * DISK_WRITERS];
static struct verify_job *verify_job;
static char current_text[SPEC_MAX] = "idle";

static void send_error(const char *msg)
{
    char esc[600];

    json_escape(esc, sizeof(esc), msg);
    channel_send(CH_EVENT, "{\"ev\":\"error\",\"msg\":\"%s\"}\n", esc);
}

static void spawn(void *(*fn)(void *), void *arg)
{
    if (n_threads == MAX_THREADS || pthread_create(&threads[n_threads], NULL, fn, arg)) {
        send_error("cannot start a workload thread");
        return;
    }
    n_threads++;
}

void workload_stop(void)
{
    atomic_store(&g_stop, 1);
    for (int i = 0; i < n_threads; i++) {
        pthread_join(threads[i], NULL);
    }
    n_threads = 0;
    for (int i = 0; i < MAX_ITEMS; i++) {
        memload_free(mem_jobs[i]);
        mem_jobs[i] = NULL;
    }
    verify_free(verify_job);
    verify_job = NULL;
    memset(&current, 0, sizeof(current));
    atomic_store(&g_stop, 0);
    snprintf(current_text, sizeof(current_text), "idle");
}

const char *workload_current(void)
{
    return current_text;
}

int workload_start(const char *text)
{
    struct workload w;
    char err[256], esc[2 * SPEC_MAX];
    int t = 0;

    if (parse_workload(text, &w, err, sizeof(err))) {
        char msg[300 + 64];
        snprintf(msg, sizeof(msg), "bad workload: %s", err);
        send_error(msg);
        return -1;
    }
    workload_stop();
    current = w;
    for (int i = 0; i < current.n_mem; i++) {
        mem_jobs[i] = memload_prepare(&current.mem[i], err, sizeof(err));
        if (!mem_jobs[i]) {
            send_error(err);
            workload_stop();
            return -1;
        }
    }
    if (current.has_verify) {
        verify_job = verify_prepare(&current.verify, err, sizeof(err));
        if (!verify_job) {
            send_error(err);
            workload_stop();
            return -1;
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
        /*
         * DISK_WRITERS threads share the item's rate, so that several writes are in
         * flight (one synchronous O_DIRECT writer is latency-bound, far below the
         * device's rate, under TCG). The checker owns the start of /dev/vda.
         */
        for (int k = 0; k < DISK_WRITERS; k++) {
            struct disk_job *dj = &disk_jobs[i * DISK_WRITERS + k];
            dj->spec = current.disk[i];
            dj->spec.rate = current.disk[i].rate / DISK_WRITERS;
            if (current.disk[i].rate && !dj->spec.rate) {
                dj->spec.rate = 1;
            }
            dj->base = current.has_verify && !strcmp(current.disk[i].dev, "/dev/vda")
                     ? current.verify.disk : 0;
            spawn(diskload_thread, dj);
        }
    }
    if (verify_job && verify_has_mem(verify_job)) {
        spawn(verify_mem_thread, verify_job);
    }
    if (verify_job && verify_has_disk(verify_job)) {
        spawn(verify_disk_thread, verify_job);
    }
    snprintf(current_text, sizeof(current_text), "%s", text);
    json_escape(esc, sizeof(esc), current_text);
    channel_send(CH_EVENT, "{\"ev\":\"ready\",\"workload\":\"%s\"}\n", esc);
    return 0;
}
