/* Small helpers: clocks, a fast PRNG, a token-bucket pacer, a checksum, JSON. */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <time.h>

#include "agent.h"

uint64_t now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void sleep_ns(uint64_t ns)
{
    struct timespec ts = { .tv_sec = (time_t)(ns / 1000000000ull),
                           .tv_nsec = (long)(ns % 1000000000ull) };

    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

void sleep_until_ns(uint64_t deadline)
{
    struct timespec ts = { .tv_sec = (time_t)(deadline / 1000000000ull),
                           .tv_nsec = (long)(deadline % 1000000000ull) };

    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

void rng_seed(rng_t *r, uint64_t seed)
{
    r->s = seed ? seed : 0x9e3779b97f4a7c15ull;
}

/* xorshift64* */
uint64_t rng_next(rng_t *r)
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545f4914f6cdd1dull;
}

double rng_unit(rng_t *r)
{
    return (double)(rng_next(r) >> 11) / (double)(1ull << 53);
}

void pacer_init(pacer_t *p, uint64_t rate)
{
    p->rate = rate;
    p->start_ns = now_ns();
    p->spent = 0;
}

/**
 * pacer_spend: account for @units of work and sleep until the rate allows them.
 *
 * The pacer keeps the moment by which everything spent so far is allowed
 * ("due"); sleeping until then gives the exact long-run rate whatever the sleep
 * granularity. When the caller has fallen behind by more than PACER_BURST_NS (a
 * pause, a throttled vCPU), the missed allowance beyond that is forgotten.
 */
void pacer_spend(pacer_t *p, uint64_t units)
{
    uint64_t due, now;

    p->spent += units;
    if (!p->rate) {
        return;
    }
    due = p->start_ns + (uint64_t)((double)p->spent * 1e9 / (double)p->rate);
    now = now_ns();
    if (due > now) {
        sleep_until_ns(due);
    } else if (now - due > PACER_BURST_NS) {
        p->start_ns += now - due - PACER_BURST_NS;
    }
}

uint64_t pacer_quantum(uint64_t rate, uint64_t unit, uint64_t max_units)
{
    uint64_t per_ms = rate / 1000 / unit;

    if (!rate || per_ms > max_units) {
        return max_units;
    }
    return per_ms ? per_ms : 1;
}

uint64_t fnv1a64(const void *buf, size_t len, uint64_t h)
{
    const uint8_t *b = buf;

    for (size_t i = 0; i < len; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

void json_escape(char *dst, size_t len, const char *src)
{
    size_t o = 0;

    if (!len) {
        return;
    }
    for (; *src && o + 7 < len; src++) {
        unsigned char c = (unsigned char)*src;
        if (c == '"' || c == '\\') {
            dst[o++] = '\\';
            dst[o++] = (char)c;
        } else if (c < 0x20 || c == 0x7f) {
            o += (size_t)snprintf(dst + o, len - o, "\\u%04x", c);
        } else {
            dst[o++] = (char)c;
        }
    }
    dst[o] = 0;
}

int start_thread(pthread_t *t, void *(*fn)(void *), void *arg, int realtime)
{
    pthread_attr_t a;
    struct sched_param sp = { .sched_priority = 10 };
    int rc = -1;

    if (realtime) {
        pthread_attr_init(&a);
        pthread_attr_setinheritsched(&a, PTHREAD_EXPLICIT_SCHED);
        pthread_attr_setschedpolicy(&a, SCHED_FIFO);
        pthread_attr_setschedparam(&a, &sp);
        rc = pthread_create(t, &a, fn, arg);
        pthread_attr_destroy(&a);
    }
    if (rc) {
        rc = pthread_create(t, NULL, fn, arg); /* not allowed: ordinary priority */
    }
    return rc;
}
