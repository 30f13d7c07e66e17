/*
 * The virtio-serial channel to the host: JSON lines out, command lines in.
 *
 * Any thread may call channel_send(): it formats the line into a slot of a small
 * queue and returns; one writer thread takes lines off the queue and writes them
 * to the port without blocking (O_NONBLOCK). A line is dropped when the queue is
 * full or the port cannot take it (host not connected, host not reading): the
 * host measures the gaps, a workload must never wait for it. Lines the host
 * waits for (CH_KEEP) are retried by the writer for a while instead.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "agent.h"

#define SLOTS 256
#define LINE_MAX_LEN 1024
#define KEEP_NS 10000000000ull /* retry a CH_KEEP line for 10 s */
#define STALE_NS 100000000ull   /* an hb/rate line older than this is not sent */

struct slot {
    uint64_t queued_ns;
    int flags;
    int len;
    char text[LINE_MAX_LEN];
};

static int chan_fd = -1;
static struct slot queue[SLOTS];
static unsigned q_head, q_tail; /* head: next to write; tail: next free */
static int writer_running;
static pthread_mutex_t q_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t q_cond = PTHREAD_COND_INITIALIZER;
static _Atomic uint64_t dropped;
static char inbuf[4096];
static size_t inlen;

int channel_open(const char *port_name)
{
    DIR *d = opendir("/sys/class/virtio-ports");
    struct dirent *e;

    if (!d) {
        return -1;
    }
    while ((e = readdir(d))) {
        char path[300], name[128] = "";
        FILE *f;
        if (e->d_name[0] == '.') {
            continue;
        }
        snprintf(path, sizeof(path), "/sys/class/virtio-ports/%s/name", e->d_name);
        f = fopen(path, "r");
        if (!f) {
            continue;
        }
        if (fgets(name, sizeof(name), f)) {
            name[strcspn(name, "\n")] = 0;
        }
        fclose(f);
        if (!strcmp(name, port_name)) {
            snprintf(path, sizeof(path), "/dev/%s", e->d_name);
            chan_fd = open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC);
            break;
        }
    }
    closedir(d);
    return chan_fd < 0 ? -1 : 0;
}

static void write_line(const struct slot *s)
{
    if (chan_fd >= 0 && !(s->flags & CH_KEEP) && now_ns() - s->queued_ns > STALE_NS) {
        /* queued behind a retried line: its arrival time would lie to the host */
        atomic_fetch_add(&dropped, 1);
        return;
    }
    if (chan_fd >= 0) {
        /*
         * One write per line, never blocking. EAGAIN (host not connected or not
         * reading) drops the line, except a CH_KEEP line (hello, ready, pong,
         * errors), which is retried for a while: the host waits for those.
         */
        uint64_t give_up = (s->flags & CH_KEEP) ? now_ns() + KEEP_NS : 0;
        while (write(chan_fd, s->text, (size_t)s->len) != s->len) {
            if (now_ns() >= give_up) {
                atomic_fetch_add(&dropped, 1);
                break;
            }
            sleep_ns(10000000ull);
        }
    }
    if (chan_fd < 0 || (s->flags & CH_CONSOLE)) {
        fprintf(stderr, "livemig-agent: %.*s", s->len, s->text);
    }
}

static void *writer(void *arg)
{
    struct slot s;

    (void)arg;
    pthread_mutex_lock(&q_lock);
    for (;;) {
        while (q_head == q_tail) {
            pthread_cond_wait(&q_cond, &q_lock);
        }
        s = queue[q_head % SLOTS];
        q_head++;
        pthread_mutex_unlock(&q_lock);
        write_line(&s);
        pthread_mutex_lock(&q_lock);
    }
    return NULL;
}

void channel_start_writer(void)
{
    pthread_t t;

    if (start_thread(&t, writer, NULL, 1) == 0) {
        writer_running = 1;
    }
}

void channel_send(int flags, const char *fmt, ...)
{
    struct slot s;
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(s.text, sizeof(s.text), fmt, ap);
    va_end(ap);
    if (n <= 0) {
        return;
    }
    if ((size_t)n >= sizeof(s.text)) {
        n = sizeof(s.text) - 1;
        s.text[n - 1] = '\n';
    }
    s.len = n;
    s.flags = flags;
    s.queued_ns = now_ns();
    if (!writer_running) {
        write_line(&s);
        return;
    }
    pthread_mutex_lock(&q_lock);
    if (q_tail - q_head < SLOTS) {
        queue[q_tail % SLOTS] = s;
        q_tail++;
        pthread_cond_signal(&q_cond);
    } else {
        atomic_fetch_add(&dropped, 1);
    }
    pthread_mutex_unlock(&q_lock);
}

uint64_t channel_dropped(void)
{
    return atomic_load(&dropped);
}

int channel_readline(char *out, size_t len, int timeout_ms)
{
    struct pollfd p = { .fd = chan_fd, .events = POLLIN };
    char *nl;
    ssize_t n;

    if (chan_fd < 0) {
        sleep_ns((uint64_t)timeout_ms * 1000000ull);
        return 0;
    }
    nl = memchr(inbuf, '\n', inlen);
    if (!nl) {
        if (poll(&p, 1, timeout_ms) <= 0) {
            return 0;
        }
        if (!(p.revents & POLLIN)) {
            sleep_ns((uint64_t)timeout_ms * 1000000ull); /* host gone: POLLHUP */
            return 0;
        }
        n = read(chan_fd, inbuf + inlen, sizeof(inbuf) - 1 - inlen);
        if (n <= 0) {
            return n < 0 && errno != EAGAIN ? -1 : 0;
        }
        inlen += (size_t)n;
        nl = memchr(inbuf, '\n', inlen);
        if (!nl) {
            if (inlen == sizeof(inbuf) - 1) {
                inlen = 0; /* overlong line: drop it */
            }
            return 0;
        }
    }
    *nl = 0;
    if (nl > inbuf && nl[-1] == '\r') {
        nl[-1] = 0;
    }
    snprintf(out, len, "%s", inbuf);
    inlen -= (size_t)(nl + 1 - inbuf);
    memmove(inbuf, nl + 1, inlen);
    return 1;
}
