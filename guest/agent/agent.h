/*
 * livemig guest agent: shared declarations.
 *
 * The agent runs workloads that dirty memory and disk like real services, reports
 * heartbeats and cumulative counters to the host over a virtio-serial port, and
 * stamps-and-verifies memory and disk blocks. Protocol: docs/agent-protocol.md.
 *
 * One file per concept: util.c (clock, PRNG, pacer, checksum), spec.c (workload
 * grammar), fill.c (page contents), memload.c (memory dirtier), diskload.c (disk
 * writer), verify.c (stamp-and-verify), echo.c (UDP echo), sink.c (TCP sink), channel.c (host channel
 * and its writer thread), workload.c (start/stop of a workload), main.c.
 */
#ifndef LIVEMIG_AGENT_H
#define LIVEMIG_AGENT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define PAGE_SIZE_4K 4096u
#define MAX_ITEMS 8
#define SPEC_MAX 1024

/* ---- util.c ---------------------------------------------------------------- */
uint64_t now_ns(void);
void sleep_ns(uint64_t ns);
void sleep_until_ns(uint64_t deadline); /* CLOCK_MONOTONIC, absolute */
/*
 * pthread_create; realtime = SCHED_FIFO (the heartbeat and the channel writer keep
 * their period under a flat-out workload on one vCPU), falling back to normal.
 */
int start_thread(pthread_t *t, void *(*fn)(void *), void *arg, int realtime);

typedef struct {
    uint64_t s;
} rng_t;
void rng_seed(rng_t *r, uint64_t seed);
uint64_t rng_next(rng_t *r);
double rng_unit(rng_t *r); /* [0, 1) */

/*
 * Token bucket: at most `rate` units per second (0 = unlimited), refilled
 * continuously; the bucket holds at most PACER_BURST_NS worth of tokens, so after a
 * stall (VM paused, vCPU throttled) the workload does not burst for long to catch up.
 */
#define PACER_BURST_NS 50000000ull /* 50 ms */
typedef struct {
    uint64_t rate;
    uint64_t start_ns;
    uint64_t spent;
} pacer_t;
void pacer_init(pacer_t *p, uint64_t rate);
void pacer_spend(pacer_t *p, uint64_t units); /* sleeps when ahead of the rate */
/* units to spend per pacer call so that one call is about 1 ms of work */
uint64_t pacer_quantum(uint64_t rate, uint64_t unit, uint64_t max_units);

uint64_t fnv1a64(const void *buf, size_t len, uint64_t h);
#define FNV_OFFSET 0xcbf29ce484222325ull

/* Copy src into dst as the inside of a JSON string (escapes " \ and controls). */
void json_escape(char *dst, size_t len, const char *src);

/* ---- spec.c ---------------------------------------------------------------- */
enum fill_kind { FILL_MIXED, FILL_RANDOM, FILL_TEXT, FILL_ZERO };
enum page_kind { PK_ZERO, PK_TEXT, PK_STRUCT, PK_RANDOM };

struct mem_spec {
    uint64_t size, rate;
    int hot_p, hot_f; /* 0 = off */
    double zipf;      /* 0 = off */
    enum fill_kind fill;
    unsigned touch, threads;
    unsigned after; /* seconds idle before the first write (a guest that turns busy) */
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

/* ---- counters (workload.c) ------------------------------------------------- */
struct counters {
    _Atomic uint64_t mem_bytes, mem_ops, disk_bytes, disk_ops, verify_blocks, verify_errors;
    _Atomic uint64_t net_bytes, net_conns; /* the TCP sink (sink.c) */
};
extern struct counters g_count;
extern atomic_int g_stop; /* ask workload threads to stop */

/* ---- channel.c ------------------------------------------------------------- */
/* Find the virtio-serial port named port_name and open it; 0 or -1. */
int channel_open(const char *port_name);
/* Start the writer thread; until then (and without a port) lines go to stderr. */
void channel_start_writer(void);
/*
 * Queue one line for the host. Never blocks on the channel: the writer thread
 * writes it; if the queue is full or the host is not connected it is dropped.
 * CH_KEEP: the host waits for this line (hello, ready, pong, errors): the writer
 * retries it for up to 10 s instead of dropping it. CH_CONSOLE also copies it to
 * stderr (the serial console), for rare events.
 */
#define CH_CONSOLE 1
#define CH_KEEP 2
#define CH_EVENT (CH_CONSOLE | CH_KEEP)
void channel_send(int flags, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int channel_readline(char *buf, size_t len, int timeout_ms); /* 1 line, 0 none, -1 err */
uint64_t channel_dropped(void);

/* ---- memload.c ------------------------------------------------------------- */
struct mem_job {
    struct mem_spec spec;
    uint8_t *region;
    uint8_t *kinds;      /* enum page_kind per page */
    uint64_t npages;
    double *zipf_cdf;    /* zipf only: cumulative probability by rank */
    uint32_t *zipf_page; /* zipf only: rank -> page (scattered) */
};
struct mem_thread {
    struct mem_job *job;
    unsigned index; /* for seeding */
};
struct mem_job *memload_prepare(const struct mem_spec *spec, char *err, size_t errlen);
void memload_free(struct mem_job *job);
uint64_t memload_pick(const struct mem_job *job, rng_t *r);
void *memload_thread(void *arg); /* struct mem_thread * */

/* ---- diskload.c ------------------------------------------------------------ */
struct disk_job {
    struct disk_spec spec;
    uint64_t base; /* first byte the writer may touch */
};
void *diskload_thread(void *arg); /* struct disk_job * */

/* ---- verify.c -------------------------------------------------------------- */
struct vblock_hdr {
    uint64_t magic, addr, gen, csum;
};
#define VBLOCK_MAGIC 0x6c6d76626c6b3031ull /* "lmvblk01" */
#define VB_BAD_MAGIC 1
#define VB_BAD_ADDR 2
#define VB_BAD_GEN 4
#define VB_BAD_CSUM 8
void vblock_stamp(uint8_t *blk, uint64_t addr, uint64_t gen);
/* 0 = good; else VB_BAD_* bits */
int vblock_check(const uint8_t *blk, uint64_t addr, uint64_t gen);
/*
 * Check blocks start .. start+count-1 (wrapping at n) of a region whose block i
 * must carry address i and generation gen[i]. Returns the index of the first bad
 * block and its VB_BAD_* bits in *bad, or -1 if all are good.
 */
int64_t vregion_find_bad(const uint8_t *region, const uint64_t *gen, uint64_t n,
                         uint64_t start, uint64_t count, int *bad);

struct verify_job; /* opaque */
/* Allocate and stamp the regions (memory and/or disk); NULL with err on failure. */
struct verify_job *verify_prepare(const struct verify_spec *spec, char *err, size_t errlen);
void *verify_mem_thread(void *arg);  /* struct verify_job * */
void *verify_disk_thread(void *arg); /* struct verify_job * */
int verify_has_mem(const struct verify_job *j);
int verify_has_disk(const struct verify_job *j);
void verify_free(struct verify_job *j);

/* ---- echo.c ---------------------------------------------------------------- */
#define ECHO_PORT 7777
void *echo_thread(void *arg);

/* ---- sink.c ---------------------------------------------------------------- */
#define SINK_PORT 7778
void *sink_thread(void *arg);

/* ---- workload.c ------------------------------------------------------------ */
/* Replace the running workload; answers "ready" or "error". 0 = started. */
int workload_start(const char *text);
void workload_stop(void);
const char *workload_current(void);

#endif
