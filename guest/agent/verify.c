/*
 * Stamp-and-verify: every 4 KiB block of a memory region and of a disk region
 * carries its address, a generation and a checksum over the whole block. The
 * checker keeps rewriting blocks with the next generation (so they stay dirty
 * during a migration) and keeps reading blocks back against the generation it
 * expects (kept in a separate table). Any difference is reported at once.
 * Nothing depends on wall-clock time, so a pause and resume on another host
 * cannot cause a false alarm.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "agent.h"

#define HDR sizeof(struct vblock_hdr)
#define CHECKS_PER_REWRITE 16
#define MAX_REPORTS 64

static uint64_t block_csum(const uint8_t *blk)
{
    const struct vblock_hdr *h = (const void *)blk;
    uint64_t c = fnv1a64(&h->magic, 3 * sizeof(uint64_t), FNV_OFFSET);

    return fnv1a64(blk + HDR, PAGE_SIZE_4K - HDR, c);
}

uint64_t vblock_expected_csum(const uint8_t *blk)
{
    return block_csum(blk);
}

void vblock_stamp(uint8_t *blk, uint64_t addr, uint64_t gen)
{
    struct vblock_hdr h = { .magic = VBLOCK_MAGIC, .addr = addr, .gen = gen };
    rng_t r;

    rng_seed(&r, addr * 0x9e3779b97f4a7c15ull ^ gen);
    fill_bytes(blk + HDR, PAGE_SIZE_4K - HDR, HDR, (gen & 1) ? PK_STRUCT : PK_TEXT, &r);
    memcpy(blk, &h, HDR);
    h.csum = block_csum(blk);
    memcpy(blk, &h, HDR);
}

int vblock_check(const uint8_t *blk, uint64_t addr, uint64_t gen)
{
    struct vblock_hdr h;
    int bad = 0;

    memcpy(&h, blk, HDR);
    if (h.magic != VBLOCK_MAGIC) {
        bad |= 1;
    }
    if (h.addr != addr) {
        bad |= 2;
    }
    if (h.gen != gen) {
        bad |= 4;
    }
    if (h.csum != block_csum(blk)) {
        bad |= 8;
    }
    return bad;
}

/* guest-physical address of a virtual address (root can read the PFN) */
static uint64_t virt_to_phys(const void *p)
{
    uint64_t entry = 0, va = (uint64_t)(uintptr_t)p;
    int fd = open("/proc/self/pagemap", O_RDONLY);

    if (fd < 0) {
        return 0;
    }
    if (pread(fd, &entry, 8, (off_t)(va / PAGE_SIZE_4K * 8)) != 8 || !(entry >> 63)) {
        entry = 0;
    }
    close(fd);
    return entry ? (entry & ((1ull << 55) - 1)) * PAGE_SIZE_4K + va % PAGE_SIZE_4K : 0;
}

static int reports;

static void report(const char *kind, uint64_t index, uint64_t gpa, const uint8_t *blk,
                   uint64_t exp_addr, uint64_t exp_gen, int bad)
{
    struct vblock_hdr h;

    if (reports++ >= MAX_REPORTS) {
        return;
    }
    memcpy(&h, blk, HDR);
    channel_send("{\"ev\":\"verify_error\",\"kind\":\"%s\",\"addr\":%llu,\"offset\":%llu,"
                 "\"block\":%llu,\"problems\":%d,"
                 "\"expected\":\"addr=%llu gen=%llu\","
                 "\"found\":\"magic=%llx addr=%llu gen=%llu csum=%s\"}\n",
                 kind, (unsigned long long)gpa,
                 (unsigned long long)(index * PAGE_SIZE_4K), (unsigned long long)index,
                 bad, (unsigned long long)exp_addr, (unsigned long long)exp_gen,
                 (unsigned long long)h.magic, (unsigned long long)h.addr,
                 (unsigned long long)h.gen, (bad & 8) ? "bad" : "ok");
}

void *verify_mem_thread(void *arg)
{
    const struct verify_spec *s = arg;
    uint64_t n = s->mem / PAGE_SIZE_4K, next_check = 0, next_write = 0;
    uint8_t *region;
    uint64_t *gen;
    pacer_t pacer;

    region = mmap(NULL, n * PAGE_SIZE_4K, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    gen = calloc(n, sizeof(*gen));
    if (region == MAP_FAILED || !gen) {
        channel_send("{\"ev\":\"error\",\"msg\":\"verify: cannot allocate memory\"}\n");
        return NULL;
    }
    mlock(region, n * PAGE_SIZE_4K);
    for (uint64_t i = 0; i < n; i++) {
        gen[i] = 1;
        vblock_stamp(region + i * PAGE_SIZE_4K, i, 1);
    }
    pacer_init(&pacer, s->rate);
    while (!atomic_load(&g_stop)) {
        for (int k = 0; k < CHECKS_PER_REWRITE; k++) {
            uint8_t *b = region + next_check * PAGE_SIZE_4K;
            int bad = vblock_check(b, next_check, gen[next_check]);
            if (bad) {
                report("mem", next_check, virt_to_phys(b), b, next_check, gen[next_check],
                       bad);
                vblock_stamp(b, next_check, gen[next_check]); /* report once */
            }
            atomic_fetch_add_explicit(&g_count.verify_blocks, 1, memory_order_relaxed);
            next_check = (next_check + 1) % n;
        }
        gen[next_write]++;
        vblock_stamp(region + next_write * PAGE_SIZE_4K, next_write, gen[next_write]);
        next_write = (next_write + 7919) % n; /* stride: spread the writes */
        pacer_spend(&pacer, PAGE_SIZE_4K);
    }
    munmap(region, n * PAGE_SIZE_4K);
    free(gen);
    return NULL;
}

void *verify_disk_thread(void *arg)
{
    const struct verify_spec *s = arg;
    uint64_t n = s->disk / PAGE_SIZE_4K, next_check = 0, next_write = 0;
    uint64_t *gen = calloc(n, sizeof(*gen));
    uint8_t *b;
    pacer_t pacer;
    int fd = open("/dev/vda", O_RDWR | O_DIRECT);

    if (fd < 0 || !gen || posix_memalign((void **)&b, PAGE_SIZE_4K, PAGE_SIZE_4K)) {
        channel_send("{\"ev\":\"error\",\"msg\":\"verify: cannot open /dev/vda\"}\n");
        free(gen);
        if (fd >= 0) {
            close(fd);
        }
        return NULL;
    }
    for (uint64_t i = 0; i < n && !atomic_load(&g_stop); i++) {
        gen[i] = 1;
        vblock_stamp(b, i, 1);
        if (pwrite(fd, b, PAGE_SIZE_4K, (off_t)(i * PAGE_SIZE_4K)) != PAGE_SIZE_4K) {
            channel_send("{\"ev\":\"error\",\"msg\":\"verify: disk write failed\"}\n");
            goto out;
        }
    }
    pacer_init(&pacer, s->rate);
    while (!atomic_load(&g_stop)) {
        for (int k = 0; k < CHECKS_PER_REWRITE; k++) {
            int bad;
            if (pread(fd, b, PAGE_SIZE_4K, (off_t)(next_check * PAGE_SIZE_4K)) !=
                PAGE_SIZE_4K) {
                break;
            }
            bad = vblock_check(b, next_check, gen[next_check]);
            if (bad) {
                report("disk", next_check, next_check * PAGE_SIZE_4K, b, next_check,
                       gen[next_check], bad);
                gen[next_check]++;
                vblock_stamp(b, next_check, gen[next_check]);
                pwrite(fd, b, PAGE_SIZE_4K, (off_t)(next_check * PAGE_SIZE_4K));
            }
            atomic_fetch_add_explicit(&g_count.verify_blocks, 1, memory_order_relaxed);
            next_check = (next_check + 1) % n;
        }
        gen[next_write]++;
        vblock_stamp(b, next_write, gen[next_write]);
        if (pwrite(fd, b, PAGE_SIZE_4K, (off_t)(next_write * PAGE_SIZE_4K)) != PAGE_SIZE_4K) {
            gen[next_write]--; /* not written: keep expecting the old one */
        }
        next_write = (next_write + 7919) % n;
        pacer_spend(&pacer, PAGE_SIZE_4K);
    }
out:
    free(b);
    free(gen);
    close(fd);
    return NULL;
}
