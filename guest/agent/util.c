/* Small helpers: clocks, a fast PRNG, a pacer, a checksum. */
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

    nanosleep(&ts, NULL);
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

void pacer_spend(pacer_t *p, uint64_t units)
{
    uint64_t due, now;

    p->spent += units;
    if (!p->rate) {
        return;
    }
    /* the moment by which `spent` units are allowed */
    due = p->start_ns + (uint64_t)((double)p->spent * 1e9 / (double)p->rate);
    now = now_ns();
    if (due > now) {
        sleep_ns(due - now);
    } else if (now - due > 1000000000ull) {
        /* fell more than 1 s behind (e.g. VM paused): do not burst to catch up */
        p->start_ns = now;
        p->spent = 0;
    }
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
