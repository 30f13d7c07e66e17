/*
 * TCP sink on port 7778: accepts connections from the guest network, reads and
 * discards everything, counts the bytes (g_count.net_bytes, in every `rate` line),
 * so a client can measure TCP throughput into the guest and how the connection
 * rides through a live migration (the guest's TCP stack moves with it). Started
 * with the UDP echo, only when livemig.ip configured eth0.
 *
 * One thread per connection at normal priority (a flat-out stream must not starve
 * the realtime heartbeat or the workload); `tcp_open` and `tcp_close` events (with
 * the connection's bytes and how it ended: eof, or the errno of a reset) tell the
 * host whether a connection survived.
 */
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "agent.h"

#define SINK_BUF (256u << 10)
#define SINK_MAX_CONNS 16

static atomic_int live_conns;

struct sink_conn {
    int fd;
    uint64_t id;
};

static void *sink_conn_thread(void *arg)
{
    struct sink_conn c = *(struct sink_conn *)arg;
    uint64_t bytes = 0;
    char *buf = malloc(SINK_BUF);
    const char *how = "eof";
    int err = 0;

    free(arg);
    if (!buf) {
        how = "nomem";
    }
    while (buf) {
        ssize_t n = read(c.fd, buf, SINK_BUF);
        if (n > 0) {
            bytes += (uint64_t)n;
            atomic_fetch_add_explicit(&g_count.net_bytes, (uint64_t)n, memory_order_relaxed);
            continue;
        }
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            err = errno;
            how = err == ECONNRESET ? "reset" : "error";
        }
        break;
    }
    channel_send(CH_EVENT, "{\"ev\":\"tcp_close\",\"conn\":%llu,\"bytes\":%llu,"
                 "\"how\":\"%s\",\"errno\":%d}\n",
                 (unsigned long long)c.id, (unsigned long long)bytes, how, err);
    free(buf);
    close(c.fd);
    atomic_fetch_sub(&live_conns, 1);
    return NULL;
}

void *sink_thread(void *arg)
{
    struct sockaddr_in addr = { .sin_family = AF_INET, .sin_port = htons(SINK_PORT),
                                .sin_addr.s_addr = htonl(INADDR_ANY) };
    int one = 1, fd = socket(AF_INET, SOCK_STREAM, 0);
    uint64_t next_id = 0;

    (void)arg;
    if (fd >= 0) {
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    }
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof(addr)) || listen(fd, 8)) {
        channel_send(CH_EVENT, "{\"ev\":\"error\",\"msg\":\"sink: cannot listen on tcp/%d\"}\n",
                     SINK_PORT);
        return NULL;
    }
    for (;;) {
        struct sink_conn *c;
        pthread_t t;
        int cfd = accept(fd, NULL, NULL);

        if (cfd < 0) {
            if (errno != EINTR && errno != ECONNABORTED) {
                sleep_ns(10000000ull); /* e.g. EMFILE: do not spin */
            }
            continue;
        }
        if (atomic_load(&live_conns) >= SINK_MAX_CONNS || !(c = malloc(sizeof(*c)))) {
            close(cfd);
            continue;
        }
        c->fd = cfd;
        c->id = next_id++;
        atomic_fetch_add(&live_conns, 1);
        atomic_fetch_add(&g_count.net_conns, 1);
        channel_send(CH_EVENT, "{\"ev\":\"tcp_open\",\"conn\":%llu}\n",
                     (unsigned long long)c->id);
        if (start_thread(&t, sink_conn_thread, c, 0)) {
            close(cfd);
            free(c);
            atomic_fetch_sub(&live_conns, 1);
            continue;
        }
        pthread_detach(t);
    }
    return NULL;
}
