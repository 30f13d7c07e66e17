/*
 * livemig guest agent: shared declarations.
 *
 * The agent runs workloads that dirty memory and disk like real services, reports
 * heartbeats and cumulative counters to the host over a virtio-serial port, and
 * stamps-and-verifies memory and disk blocks. Protocol: docs/agent-protocol.md.
 */
#ifndef LIVEMIG_AGENT_H
#define LIVEMIG_AGENT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define PAGE_SIZE_4K 4096u
#define MAX_ITEMS 8

/* ---- util.c ---------------------------------------------------------------- */
uint64_t now_ns(void);
void sleep_ns(uint64_t ns);

typedef struct {
    uint64_t s;
} rng_t;
void rng_seed(rng_t *r, uint64_t seed);
uint64_t rng_next(rng_t *r);
double rng_unit(rng_t *r); /* [0, 1) */

/* Token bucket: at most `rate` units per second (0 = unlimited). */
typedef struct {
    uint64_t rate;
    uint64_t start_ns;
    uint64_t spent;
} pacer_t;
void pacer_init(pacer_t *p, uint64_t rate);
void pacer_spend(pacer_t *p, uint64_t units); /* sleeps when ahead of the rate */

uint64_t fnv1a64(const void *buf, size_t len, uint64_t h);
#define FNV_OFFSET 0xcbf29ce484222325ull

/* ---- spec.c ---------------------------------------------------------------- */
enum fill_kind { FILL_MIXED, FILL_RANDOM, FILL_TEXT, FILL_ZERO };
enum page_kind { PK_ZERO, PK_TEXT, PK_STRUCT, PK_RANDOM };

struct mem_spec {
    uint64_t size, rate;
    int hot_p, hot_f; /* 0 = off */
    double zipf;      /* 0 = off */
    enum fill_kind fill;
    unsigned touch, threads;
};

struct disk_spec {
    uint64_t bs, rate, size; /* size 0 = whole device */
    char dev[64];
};

struct verify_spec {
    uint64_t mem, disk, rate;
};

struct workload {
    int n_mem, n_disk, has_verify;
    struct mem_spec mem[MAX_ITEMS];
    struct disk_spec disk[MAX_ITEMS];
    struct verify_spec verify;
};

/* Returns 0, or -1 with a one-line message in err. */
int parse_workload(const char *text, struct workload *w, char *err, size_t errlen);
int parse_size(const char *s, uint64_t *out);

/* ---- fill.c ---------------------------------------------------------------- */
enum page_kind page_kind_for(enum fill_kind fill, uint64_t page_index);
void fill_page(uint8_t *page, enum page_kind kind, rng_t *r);
void fill_bytes(uint8_t *dst, size_t len, size_t page_offset, enum page_kind kind,
                rng_t *r);
void touch_page(uint8_t *page, enum page_kind kind, unsigned touch, rng_t *r);

/* ---- counters (main.c) ----------------------------------------------------- */
struct counters {
    _Atomic uint64_t mem_bytes, mem_ops, disk_bytes, disk_ops, verify_blocks;
};
extern struct counters g_count;
extern atomic_int g_stop; /* ask workload threads to stop */

/* ---- channel.c ------------------------------------------------------------- */
int channel_open(const char *port_name);
void channel_send(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int channel_readline(char *buf, size_t len, int timeout_ms); /* 1 line, 0 none, -1 err */

/* ---- workloads ------------------------------------------------------------- */
struct mem_job {
    struct mem_spec spec;
    uint8_t *region;
    uint8_t *kinds;    /* enum page_kind per page */
    uint64_t npages;
    double *zipf_cdf;  /* zipf only: cumulative probability by rank */
    uint32_t *zipf_page; /* zipf only: rank -> page (scattered) */
};
struct mem_thread {
    struct mem_job *job;
    unsigned index; /* for seeding */
};
struct mem_job *memload_prepare(const struct mem_spec *spec, char *err, size_t errlen);
void memload_free(struct mem_job *job);
uint64_t memload_pick(const struct mem_job *job, rng_t *r);
void *memload_thread(void *arg);  /* struct mem_thread * */
void *diskload_thread(void *arg); /* struct disk_job * */
struct disk_job {
    struct disk_spec spec;
    uint64_t base; /* first byte the writer may touch */
};

/* ---- verify.c -------------------------------------------------------------- */
struct vblock_hdr {
    uint64_t magic, addr, gen, csum;
};
#define VBLOCK_MAGIC 0x6c6d76626c6b3031ull /* "lmvblk01" */
void vblock_stamp(uint8_t *blk, uint64_t addr, uint64_t gen);
/* 0 = good; else a bit set per problem (1 magic, 2 addr, 4 gen, 8 checksum) */
int vblock_check(const uint8_t *blk, uint64_t addr, uint64_t gen);
uint64_t vblock_expected_csum(const uint8_t *blk);
void *verify_mem_thread(void *arg);  /* struct verify_spec * */
void *verify_disk_thread(void *arg); /* struct verify_spec * */

/* ---- echo.c ---------------------------------------------------------------- */
void *echo_thread(void *arg);

#endif
