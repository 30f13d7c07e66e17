/* The virtio-serial channel to the host: JSON lines out, command lines in. */
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

static int chan_fd = -1;
static pthread_mutex_t chan_lock = PTHREAD_MUTEX_INITIALIZER;
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

void channel_send(const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    if (n <= 0) {
        return;
    }
    if ((size_t)n >= sizeof(buf)) {
        n = sizeof(buf) - 1;
        buf[n - 1] = '\n';
    }
    pthread_mutex_lock(&chan_lock);
    if (chan_fd >= 0) {
        /* never block: a line the host cannot take now is dropped */
        if (write(chan_fd, buf, (size_t)n) < 0 && errno != EAGAIN) {
            /* host not connected: drop */
        }
    } else {
        fputs(buf, stderr);
    }
    pthread_mutex_unlock(&chan_lock);
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
    snprintf(out, len, "%s", inbuf);
    inlen -= (size_t)(nl + 1 - inbuf);
    memmove(inbuf, nl + 1, inlen);
    return 1;
}
