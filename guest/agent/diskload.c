/* The disk writer: random block-aligned O_DIRECT writes of `bs` at `rate` bytes/s. */
#include <fcntl.h>
#include <linux/fs.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "agent.h"

void *diskload_thread(void *arg)
{
    struct disk_job *job = arg;
    struct disk_spec *d = &job->spec;
    uint64_t devsize = 0, end, blocks;
    uint8_t *buf;
    pacer_t pacer;
    rng_t r;
    int fd = open(d->dev, O_RDWR | O_DIRECT);

    if (fd < 0) {
        channel_send("{\"ev\":\"error\",\"msg\":\"disk: cannot open %s\"}\n", d->dev);
        return NULL;
    }
    if (ioctl(fd, BLKGETSIZE64, &devsize) || devsize == 0) {
        devsize = (uint64_t)lseek(fd, 0, SEEK_END);
    }
    end = d->size ? job->base + d->size : devsize;
    if (end > devsize) {
        end = devsize;
    }
    if (end <= job->base + d->bs) {
        channel_send("{\"ev\":\"error\",\"msg\":\"disk: %s too small\"}\n", d->dev);
        close(fd);
        return NULL;
    }
    blocks = (end - job->base) / d->bs;
    if (posix_memalign((void **)&buf, PAGE_SIZE_4K, d->bs)) {
        close(fd);
        return NULL;
    }
    rng_seed(&r, now_ns());
    pacer_init(&pacer, d->rate);
    while (!atomic_load(&g_stop)) {
        uint64_t off = job->base + (rng_next(&r) % blocks) * d->bs;
        for (uint64_t p = 0; p < d->bs; p += PAGE_SIZE_4K) {
            uint64_t n = d->bs - p < PAGE_SIZE_4K ? d->bs - p : PAGE_SIZE_4K;
            fill_bytes(buf + p, n, 0, page_kind_for(FILL_MIXED, off / PAGE_SIZE_4K + p), &r);
        }
        if (pwrite(fd, buf, d->bs, (off_t)off) != (ssize_t)d->bs) {
            channel_send("{\"ev\":\"error\",\"msg\":\"disk: write failed at %llu\"}\n",
                         (unsigned long long)off);
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
