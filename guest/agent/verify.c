/*
 * Stamp-and-verify: every 4 KiB block of a memory region and of a disk region
 * carries a magic, its address (block index), a generation and an FNV-1a checksum
 * over the whole block (64-bit words). The checker keeps rewriting blocks with the next
 * generation (so they stay dirty during a migration) and keeps reading blocks back
 * against the generation it expects, kept in a separate table. Any difference is
 * reported at once. Nothing depends on wall-clock time, so a pause and resume on
 * another host cannot cause a false alarm: only lost, stale or misplaced data can.
 */
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "agent.h"

#define HDR sizeof(struct vblock_hdr)
#define CHECKS_PER_REWRITE 16
#define MAX_REPORTS 64
#define STAMP_CHUNK 64 /* blocks per write while stamping the disk region */
#define VERIFY_DISK_DEV "/dev/vda"
#define STRIDE 7919 /* rewrite order: a prime stride spreads the writes */

struct verify_job {
    struct verify_spec spec;
    uint8_t *mem;          /* memory region */
    uint64_t mem_n;        /* blocks */
    uint64_t *mem_gen;     /* expected generation per memory block */
    int disk_fd;
    uint64_t disk_n;
    uint64_t *disk_gen;    /* expected generation per disk block */
};

static atomic_int reports;

/*
 * FNV-1a over the block's 64-bit words (header without the checksum, then the
 * payload): each step is a bijection of the running hash, so any change confined
 * to one word always changes the result; word-wise it is 8x cheaper than
 * byte-wise, which matters under TCG.
 */
static uint64_t block_csum(const uint8_t *blk)
{
    uint64_t h = FNV_OFFSET;

    for (size_t off = 0; off < PAGE_SIZE_4K; off += 8) {
        uint64_t w;
        if (off == offsetof(struct vblock_hdr, csum)) {
            continue;
        }
        memcpy(&w, blk + off, 8);
        h = (h ^ w) * 0x100000001b3ull;
    }
    return h;
}

/* The payload is ordinary-looking memory, different for each generation. */
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
        bad |= VB_BAD_MAGIC;
    }
    if (h.addr != addr) {
        bad |= VB_BAD_ADDR;
    }
    if (h.gen != gen) {
        bad |= VB_BAD_GEN;
    }
    if (h.csum != block_csum(blk)) {
        bad |= VB_BAD_CSUM;
    }
    return bad;
}

int64_t vregion_find_bad(const uint8_t *region, const uint64_t *gen, uint64_t n,
                         uint64_t start, uint64_t count, int *bad)
{
    for (uint64_t k = 0; k < count && k < n; k++) {
        uint64_t i = (start + k) % n;
        int b = vblock_check(region + i * PAGE_SIZE_4K, i, gen[i]);
        if (b) {
            *bad = b;
            return (int64_t)i;
        }
    }
    *bad = 0;
    return -1;
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

static void report(const char *kind, uint64_t index, uint64_t addr, const uint8_t *blk,
                   uint64_t exp_gen, int bad)
{
    struct vblock_hdr h;

    atomic_fetch_add(&g_count.verify_errors, 1);
    if (atomic_fetch_add(&reports, 1) >= MAX_REPORTS) {
        return;
    }
    memcpy(&h, blk, HDR);
    channel_send(CH_EVENT,
                 "{\"ev\":\"verify_error\",\"kind\":\"%s\",\"addr\":%llu,\"offset\":%llu,"
                 "\"block\":%llu,\"problems\":\"%s%s%s%s\","
                 "\"expected\":\"addr=%llu gen=%llu\","
                 "\"found\":\"magic=%016llx addr=%llu gen=%llu csum=%s\"}\n",
                 kind, (unsigned long long)addr,
                 (unsigned long long)(index * PAGE_SIZE_4K), (unsigned long long)index,
                 (bad & VB_BAD_MAGIC) ? "magic " : "", (bad & VB_BAD_ADDR) ? "addr " : "",
                 (bad & VB_BAD_GEN) ? "gen " : "", (bad & VB_BAD_CSUM) ? "csum" : "",
                 (unsigned long long)index, (unsigned long long)exp_gen,
                 (unsigned long long)h.magic, (unsigned long long)h.addr,
                 (unsigned long long)h.gen, (bad & VB_BAD_CSUM) ? "bad" : "ok");
}

/*
 * The host finds the checker's blocks by their magic when it injects a fault
 * (livemig/lab/faults.py). Stamps left behind in freed memory (a previous load's
 * region, a disk block's copy in a buffer) look the same, and a fault placed in one
 * is named by the host but never by this checker, which no longer owns it: so every
 * stamp this checker leaves outside its region is wiped before the memory goes.
 */
static void unstamp(void *p, size_t len)
{
    explicit_bzero(p, len);
}

static int stamp_disk(struct verify_job *j, char *err, size_t errlen)
{
    uint8_t *buf;

    if (posix_memalign((void **)&buf, PAGE_SIZE_4K, STAMP_CHUNK * PAGE_SIZE_4K)) {
        snprintf(err, errlen, "verify: out of memory");
        return -1;
    }
    for (uint64_t i = 0; i < j->disk_n; i += STAMP_CHUNK) {
        uint64_t k = j->disk_n - i < STAMP_CHUNK ? j->disk_n - i : STAMP_CHUNK;
        for (uint64_t b = 0; b < k; b++) {
            j->disk_gen[i + b] = 1;
            vblock_stamp(buf + b * PAGE_SIZE_4K, i + b, 1);
        }
        if (pwrite(j->disk_fd, buf, k * PAGE_SIZE_4K, (off_t)(i * PAGE_SIZE_4K)) !=
            (ssize_t)(k * PAGE_SIZE_4K)) {
            snprintf(err, errlen, "verify: cannot stamp %s at block %llu", VERIFY_DISK_DEV,
                     (unsigned long long)i);
            unstamp(buf, STAMP_CHUNK * PAGE_SIZE_4K);
            free(buf);
            return -1;
        }
    }
    unstamp(buf, STAMP_CHUNK * PAGE_SIZE_4K);
    free(buf);
    return 0;
}

struct verify_job *verify_prepare(const struct verify_spec *spec, char *err, size_t errlen)
{
    struct verify_job *j = calloc(1, sizeof(*j));

    if (!j) {
        snprintf(err, errlen, "verify: out of memory");
        return NULL;
    }
    j->spec = *spec;
    j->disk_fd = -1;
    j->mem_n = spec->mem / PAGE_SIZE_4K;
    j->disk_n = spec->disk / PAGE_SIZE_4K;
    if (j->mem_n) {
        j->mem = mmap(NULL, j->mem_n * PAGE_SIZE_4K, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        j->mem_gen = calloc(j->mem_n, sizeof(uint64_t));
        if (j->mem == MAP_FAILED || !j->mem_gen) {
            if (j->mem == MAP_FAILED) {
                j->mem = NULL;
            }
            snprintf(err, errlen, "verify: cannot allocate %llu MiB",
                     (unsigned long long)(spec->mem >> 20));
            verify_free(j);
            return NULL;
        }
        mlock(j->mem, j->mem_n * PAGE_SIZE_4K); /* keep the GPAs stable for reports */
        for (uint64_t i = 0; i < j->mem_n; i++) {
            j->mem_gen[i] = 1;
            vblock_stamp(j->mem + i * PAGE_SIZE_4K, i, 1);
        }
    }
    if (j->disk_n) {
        j->disk_fd = open(VERIFY_DISK_DEV, O_RDWR | O_DIRECT | O_CLOEXEC);
        j->disk_gen = calloc(j->disk_n, sizeof(uint64_t));
        if (j->disk_fd < 0 || !j->disk_gen) {
            snprintf(err, errlen, "verify: cannot open %s", VERIFY_DISK_DEV);
            verify_free(j);
            return NULL;
        }
        if (stamp_disk(j, err, errlen)) {
            verify_free(j);
            return NULL;
        }
    }
    return j;
}

int verify_has_mem(const struct verify_job *j)
{
    return j->mem_n > 0;
}

int verify_has_disk(const struct verify_job *j)
{
    return j->disk_n > 0;
}

void verify_free(struct verify_job *j)
{
    if (!j) {
        return;
    }
    if (j->mem) {
        unstamp(j->mem, j->mem_n * PAGE_SIZE_4K);
        munmap(j->mem, j->mem_n * PAGE_SIZE_4K);
    }
    if (j->disk_fd >= 0) {
        close(j->disk_fd);
    }
    free(j->mem_gen);
    free(j->disk_gen);
    free(j);
}

void *verify_mem_thread(void *arg)
{
    struct verify_job *j = arg;
    uint64_t n = j->mem_n, next_check = 0, next_write = 0;
    pacer_t pacer;

    pacer_init(&pacer, j->spec.rate);
    while (!atomic_load(&g_stop)) {
        int bad;
        int64_t i = vregion_find_bad(j->mem, j->mem_gen, n, next_check, CHECKS_PER_REWRITE,
                                     &bad);
        uint64_t done = CHECKS_PER_REWRITE < n ? CHECKS_PER_REWRITE : n;
        if (i >= 0) {
            uint8_t *b = j->mem + (uint64_t)i * PAGE_SIZE_4K;
            report("mem", (uint64_t)i, virt_to_phys(b), b, j->mem_gen[i], bad);
            vblock_stamp(b, (uint64_t)i, j->mem_gen[i]); /* repair: report once */
            done = ((uint64_t)i + n - next_check) % n + 1;
        }
        atomic_fetch_add_explicit(&g_count.verify_blocks, done, memory_order_relaxed);
        next_check = (next_check + done) % n;
        /* never overwrite a block unread: a corruption the read sweep has not reached
         * yet would vanish under the new generation (~1 fault in 32 went unseen) */
        uint8_t *w = j->mem + next_write * PAGE_SIZE_4K;
        int wbad = vblock_check(w, next_write, j->mem_gen[next_write]);
        if (wbad) {
            report("mem", next_write, virt_to_phys(w), w, j->mem_gen[next_write], wbad);
        }
        j->mem_gen[next_write]++;
        vblock_stamp(w, next_write, j->mem_gen[next_write]);
        next_write = (next_write + STRIDE) % n;
        pacer_spend(&pacer, PAGE_SIZE_4K);
    }
    return NULL;
}

void *verify_disk_thread(void *arg)
{
    struct verify_job *j = arg;
    uint64_t n = j->disk_n, next_check = 0, next_write = 0;
    uint8_t *b;
    pacer_t pacer;

    if (posix_memalign((void **)&b, PAGE_SIZE_4K, PAGE_SIZE_4K)) {
        return NULL;
    }
    pacer_init(&pacer, j->spec.rate);
    while (!atomic_load(&g_stop)) {
        for (int k = 0; k < CHECKS_PER_REWRITE; k++) {
            int bad;
            if (pread(j->disk_fd, b, PAGE_SIZE_4K, (off_t)(next_check * PAGE_SIZE_4K)) !=
                PAGE_SIZE_4K) {
                channel_send(CH_EVENT, "{\"ev\":\"error\",\"msg\":\"verify: read of "
                             "block %llu failed\"}\n", (unsigned long long)next_check);
                sleep_ns(100000000ull);
                break;
            }
            bad = vblock_check(b, next_check, j->disk_gen[next_check]);
            if (bad) {
                report("disk", next_check, next_check * PAGE_SIZE_4K, b,
                       j->disk_gen[next_check], bad);
                /* repair with the next generation so the error is reported once */
                j->disk_gen[next_check]++;
                vblock_stamp(b, next_check, j->disk_gen[next_check]);
                if (pwrite(j->disk_fd, b, PAGE_SIZE_4K,
                           (off_t)(next_check * PAGE_SIZE_4K)) != PAGE_SIZE_4K) {
                    j->disk_gen[next_check]--;
                }
            }
            atomic_fetch_add_explicit(&g_count.verify_blocks, 1, memory_order_relaxed);
            next_check = (next_check + 1) % n;
        }
        /* read before overwriting, as for memory: no block is rewritten unverified */
        if (pread(j->disk_fd, b, PAGE_SIZE_4K, (off_t)(next_write * PAGE_SIZE_4K)) ==
            PAGE_SIZE_4K) {
            int wbad = vblock_check(b, next_write, j->disk_gen[next_write]);
            if (wbad) {
                report("disk", next_write, next_write * PAGE_SIZE_4K, b,
                       j->disk_gen[next_write], wbad);
            }
        }
        j->disk_gen[next_write]++;
        vblock_stamp(b, next_write, j->disk_gen[next_write]);
        if (pwrite(j->disk_fd, b, PAGE_SIZE_4K, (off_t)(next_write * PAGE_SIZE_4K)) !=
            PAGE_SIZE_4K) {
            j->disk_gen[next_write]--; /* not written: keep expecting the old one */
        }
        unstamp(b, PAGE_SIZE_4K); /* no copy of a disk block lingers in RAM */
        next_write = (next_write + STRIDE) % n;
        pacer_spend(&pacer, PAGE_SIZE_4K);
    }
    free(b);
    return NULL;
}
