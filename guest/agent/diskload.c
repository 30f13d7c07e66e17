/*
 * The disk writer: random block-aligned O_DIRECT writes of `bs` bytes at `rate`
 * bytes/s over [base, base + size) of `dev`, with content of kind `mixed` (each
 * 4 KiB of a block gets the kind its disk offset maps to, as memory pages do).
 */
#include <fcntl.h>
#include <linux/fs.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "agent.h"

static void disk_error(const char *what, const char *dev, uint64_t off)
{
    char esc[160];

    json_escape(esc, sizeof(esc), dev);
    channel_send(CH_EVENT, "{\"ev\":\"error\",\"msg\":\"disk: %s %s at %llu\"}\n", what, esc,
                 (unsigned long long)off);
}

void *diskload_thread(void *arg)
{
    struct disk_job *job = arg;
    struct disk_spec *d = &job->spec;
    uint64_t devsize = 0, end, blocks;
    uint8_t *buf;
    pacer_t pacer;
    rng_t r;
    int fd = open(d->dev, O_RDWR | O_DIRECT | O_CLOEXEC);

    if (fd < 0) {
        disk_error("cannot open", d->dev, 0);
        return NULL;
    }
    if (ioctl(fd, BLKGETSIZE64, &devsize) || devsize == 0) {
        devsize = (uint64_t)lseek(fd, 0, SEEK_END);
    }
    end = d->size ? job->base + d->size : devsize;
    if (end > devsize) {
        end = devsize;
    }
    if (end < job->base + d->bs) {
        disk_error("too small:", d->dev, devsize);
        close(fd);
        return NULL;
    }
    blocks = (end - job->base) / d->bs;
    if (posix_memalign((void **)&buf, PAGE_SIZE_4K, d->bs)) {
        close(fd);
        return NULL;
    }
    rng_seed(&r, now_ns() ^ (uint64_t)(uintptr_t)job);
    pacer_init(&pacer, d->rate);
    while (!atomic_load(&g_stop)) {
        uint64_t off = job->base + (rng_next(&r) % blocks) * d->bs;
        for (uint64_t p = 0; p < d->bs; p += PAGE_SIZE_4K) {
            uint64_t n = d->bs - p < PAGE_SIZE_4K ? d->bs - p : PAGE_SIZE_4K;
            fill_bytes(buf + p, n, 0, page_kind_for(FILL_MIXED, (off + p) / PAGE_SIZE_4K),
                       &r);
        }
        if (pwrite(fd, buf, d->bs, (off_t)off) != (ssize_t)d->bs) {
            disk_error("write failed on", d->dev, off);
            sleep_ns(100000000ull);
            continue;
        }
        atomic_fetch_add_explicit(&g_count.disk_bytes, d->bs, memory_order_relaxed);
        atomic_fetch_add_explicit(&g_count.disk_ops, 1, memory_order_relaxed);
        pacer_spend(&pacer, d->bs);
    }
    free(buf);
    close(fd);
    return NULL;
}
