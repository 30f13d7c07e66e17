/*
 * The memory dirtier: writes `touch` bytes into a page chosen uniformly, from a hot
 * set (hot=P/F) or zipf-distributed, at `rate` bytes of pages per second.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "agent.h"

static int zipf_init(struct mem_job *j)
{
    double sum = 0;
    rng_t r;

    j->zipf_cdf = malloc(j->npages * sizeof(double));
    j->zipf_page = malloc(j->npages * sizeof(uint32_t));
    if (!j->zipf_cdf || !j->zipf_page) {
        return -1;
    }
    for (uint64_t k = 0; k < j->npages; k++) {
        sum += 1.0 / pow((double)(k + 1), j->spec.zipf);
        j->zipf_cdf[k] = sum;
        j->zipf_page[k] = (uint32_t)k;
    }
    for (uint64_t k = 0; k < j->npages; k++) {
        j->zipf_cdf[k] /= sum;
    }
    /* scatter ranks over the region, as hot objects are in real heaps */
    rng_seed(&r, 42);
    for (uint64_t k = j->npages - 1; k > 0; k--) {
        uint64_t o = rng_next(&r) % (k + 1);
        uint32_t t = j->zipf_page[k];
        j->zipf_page[k] = j->zipf_page[o];
        j->zipf_page[o] = t;
    }
    return 0;
}

struct mem_job *memload_prepare(const struct mem_spec *spec, char *err, size_t errlen)
{
    struct mem_job *j = calloc(1, sizeof(*j));
    rng_t r;

    if (!j) {
        snprintf(err, errlen, "mem: out of memory");
        return NULL;
    }
    j->spec = *spec;
    j->npages = spec->size / PAGE_SIZE_4K;
    j->region = mmap(NULL, j->npages * PAGE_SIZE_4K, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    j->kinds = malloc(j->npages);
    if (j->region == MAP_FAILED || !j->kinds) {
        snprintf(err, errlen, "mem: cannot allocate %llu MiB",
                 (unsigned long long)(spec->size >> 20));
        j->region = NULL;
        memload_free(j);
        return NULL;
    }
    if (spec->zipf && zipf_init(j)) {
        snprintf(err, errlen, "mem: cannot allocate the zipf table");
        memload_free(j);
        return NULL;
    }
    rng_seed(&r, now_ns());
    for (uint64_t p = 0; p < j->npages; p++) {
        j->kinds[p] = (uint8_t)page_kind_for(spec->fill, p);
        fill_page(j->region + p * PAGE_SIZE_4K, (enum page_kind)j->kinds[p], &r);
    }
    return j;
}

void memload_free(struct mem_job *j)
{
    if (!j) {
        return;
    }
    if (j->region) {
        munmap(j->region, j->npages * PAGE_SIZE_4K);
    }
    free(j->kinds);
    free(j->zipf_cdf);
    free(j->zipf_page);
    free(j);
}

uint64_t memload_pick(const struct mem_job *j, rng_t *r)
{
    if (j->spec.hot_p) {
        uint64_t hot = j->npages * (uint64_t)j->spec.hot_f / 100;
        if (hot < 1) {
            hot = 1;
        }
        if (hot >= j->npages || rng_next(r) % 100 < (uint64_t)j->spec.hot_p) {
            return rng_next(r) % hot;
        }
        return hot + rng_next(r) % (j->npages - hot);
    }
    if (j->zipf_cdf) {
        double u = rng_unit(r);
        uint64_t lo = 0, hi = j->npages - 1;
        while (lo < hi) {
            uint64_t mid = (lo + hi) / 2;
            if (j->zipf_cdf[mid] < u) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        return j->zipf_page[lo];
    }
    return rng_next(r) % j->npages;
}

/**
 * memload_thread: dirty pages of the job's region until told to stop.
 *
 * Counters and the pacer are updated once per quantum of about 1 ms of work at
 * the requested rate (1..64 pages), so a rate limit is smooth at millisecond
 * scale and the flat-out case is not slowed down by the accounting.
 */
void *memload_thread(void *arg)
{
    struct mem_thread *t = arg;
    struct mem_job *j = t->job;
    unsigned threads = j->spec.threads ? j->spec.threads : 1;
    uint64_t rate = j->spec.rate / threads, quantum;
    pacer_t pacer;
    rng_t r;

    if (j->spec.rate && !rate) {
        rate = 1;
    }
    quantum = pacer_quantum(rate, PAGE_SIZE_4K, 64);
    rng_seed(&r, now_ns() ^ ((uint64_t)t->index << 32) ^ (uint64_t)(uintptr_t)t);
    for (uint64_t idle = 0; idle < j->spec.after * 10ull &&
         !atomic_load_explicit(&g_stop, memory_order_relaxed); idle++) {
        sleep_ns(100000000ull);
    }
    pacer_init(&pacer, rate);
    while (!atomic_load_explicit(&g_stop, memory_order_relaxed)) {
        for (uint64_t k = 0; k < quantum; k++) {
            uint64_t p = memload_pick(j, &r);
            touch_page(j->region + p * PAGE_SIZE_4K, (enum page_kind)j->kinds[p],
                       j->spec.touch, &r);
        }
        atomic_fetch_add_explicit(&g_count.mem_bytes, quantum * PAGE_SIZE_4K,
                                  memory_order_relaxed);
        atomic_fetch_add_explicit(&g_count.mem_ops, quantum, memory_order_relaxed);
        pacer_spend(&pacer, quantum * PAGE_SIZE_4K);
    }
    return NULL;
}
