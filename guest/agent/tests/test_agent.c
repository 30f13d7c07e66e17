/* Unit tests of the agent's pure parts: spec parsing, page contents, the checker. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent.h"



static int passed, failed;

#define CHECK(cond) do { \
    if (cond) { passed++; } \
    else { failed++; fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); } \
} while (0)

static void test_spec_good(void)
{
    struct workload w;
    char err[256];

    CHECK(parse_workload("mem:size=512M,rate=200M,hot=80/10,fill=text,touch=128,threads=2"
                         "+disk:bs=8K,rate=2M+verify:mem=64M,disk=32M", &w, err,
                         sizeof(err)) == 0);
    CHECK(w.n_mem == 1 && w.mem[0].size == 512ull << 20 && w.mem[0].rate == 200ull << 20);
    CHECK(w.mem[0].hot_p == 80 && w.mem[0].hot_f == 10 && w.mem[0].fill == FILL_TEXT);
    CHECK(w.mem[0].touch == 128 && w.mem[0].threads == 2);
    CHECK(w.n_disk == 1 && w.disk[0].bs == 8192 && !strcmp(w.disk[0].dev, "/dev/vda"));
    CHECK(w.has_verify && w.verify.mem == 64ull << 20 && w.verify.disk == 32ull << 20);
    CHECK(parse_workload("idle", &w, err, sizeof(err)) == 0 && !w.n_mem && !w.n_disk);
    CHECK(parse_workload("mem:zipf=1.1", &w, err, sizeof(err)) == 0 && w.mem[0].zipf == 1.1);
    CHECK(w.mem[0].size == 256ull << 20 && w.mem[0].touch == 64 && w.mem[0].fill == FILL_MIXED);
    CHECK(w.mem[0].after == 0);
    CHECK(parse_workload("mem:touch=128,after=12", &w, err, sizeof(err)) == 0 &&
          w.mem[0].after == 12);
}

static void test_spec_bad(void)
{
    static const char *const bad[] = {
        "", "mem:size", "mem:size=12Q", "mem:hot=80", "mem:hot=0/10",
        "mem:hot=80/10,zipf=1", "mem:fill=sparse", "mem:colour=red", "disk:bs=1000",
        "disk:dev=vda", "cpu:x=1", "idle:x=1", "verify:", "mem:touch=5000",
        "mem:size=1M,size=2M", "mem:size=1M++idle", "mem:size=1M,", "mem:size=1M,,rate=1M",
        "mem: size=1M", "+mem:size=1M", "mem:threads=0", "mem:zipf=0", "mem:after=-1", "mem:after=3601", "verify:mem=1M+verify:disk=1M",
    };
    struct workload w;
    char err[256];

    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        err[0] = 0;
        int rc = parse_workload(bad[i], &w, err, sizeof(err));
        CHECK(rc == -1 && err[0] && !strchr(err, '\n'));
        if (rc == 0) {
            fprintf(stderr, "  accepted bad spec '%s'\n", bad[i]);
        }
    }
}

static int distinct_bytes(const uint8_t *p, size_t n)
{
    int seen[256] = { 0 }, d = 0;

    for (size_t i = 0; i < n; i++) {
        d += !seen[p[i]]++;
    }
    return d;
}

static void test_fill_kinds(void)
{
    uint8_t page[PAGE_SIZE_4K];
    rng_t r;
    int kinds[4] = { 0 };
    int printable = 1;

    rng_seed(&r, 1);
    fill_page(page, PK_ZERO, &r);
    CHECK(distinct_bytes(page, sizeof(page)) == 1 && page[0] == 0);
    fill_page(page, PK_RANDOM, &r);
    CHECK(distinct_bytes(page, sizeof(page)) > 240);
    fill_page(page, PK_TEXT, &r);
    for (size_t i = 0; i < sizeof(page); i++) {
        printable &= isprint(page[i]) || page[i] == '\n';
    }
    CHECK(printable);
    /* a touch on a text page writes text, only inside a `touch`-sized window */
    {
        uint8_t before[PAGE_SIZE_4K];
        size_t changed_lo = PAGE_SIZE_4K, changed_hi = 0;
        memcpy(before, page, sizeof(page));
        touch_page(page, PK_TEXT, 64, &r);
        for (size_t i = 0; i < sizeof(page); i++) {
            if (page[i] != before[i]) {
                changed_lo = i < changed_lo ? i : changed_lo;
                changed_hi = i;
            }
            printable &= isprint(page[i]) || page[i] == '\n';
        }
        CHECK(printable && changed_hi >= changed_lo && changed_hi - changed_lo < 64);
    }
    fill_page(page, PK_STRUCT, &r);
    CHECK(distinct_bytes(page, sizeof(page)) > 64);
    /* mixed: every kind appears, in roughly the intended shares */
    for (uint64_t p = 0; p < 10000; p++) {
        kinds[page_kind_for(FILL_MIXED, p)]++;
    }
    CHECK(kinds[PK_ZERO] > 1500 && kinds[PK_ZERO] < 2500);
    CHECK(kinds[PK_RANDOM] > 1500 && kinds[PK_RANDOM] < 2500);
    CHECK(page_kind_for(FILL_RANDOM, 7) == PK_RANDOM && page_kind_for(FILL_ZERO, 7) == PK_ZERO);
}

static void test_page_choice(void)
{
    struct mem_spec s = { .size = 4096ull * 1000, .hot_p = 80, .hot_f = 10, .touch = 64,
                          .threads = 1, .fill = FILL_ZERO };
    char err[128];
    struct mem_job *j = memload_prepare(&s, err, sizeof(err));
    rng_t r;
    int in_hot = 0, top = 0;

    CHECK(j != NULL);
    if (!j) {
        return;
    }
    rng_seed(&r, 3);
    for (int i = 0; i < 100000; i++) {
        in_hot += memload_pick(j, &r) < 100;
    }
    CHECK(in_hot > 79000 && in_hot < 81500); /* 80% + the hot share of the other 20% */
    memload_free(j);

    s.hot_p = s.hot_f = 0;
    s.zipf = 1.2;
    j = memload_prepare(&s, err, sizeof(err));
    CHECK(j != NULL);
    if (!j) {
        return;
    }
    for (int i = 0; i < 100000; i++) {
        top += memload_pick(j, &r) == j->zipf_page[0];
    }
    CHECK(top > 15000); /* rank 1 of zipf(1.2) over 1000 pages: ~21% */
    memload_free(j);
}

static void test_checker(void)
{
    uint8_t *blocks = aligned_alloc(PAGE_SIZE_4K, 4 * PAGE_SIZE_4K);
    uint8_t tmp[PAGE_SIZE_4K];

    for (uint64_t i = 0; i < 4; i++) {
        vblock_stamp(blocks + i * PAGE_SIZE_4K, i, 5);
    }
    for (uint64_t i = 0; i < 4; i++) {
        CHECK(vblock_check(blocks + i * PAGE_SIZE_4K, i, 5) == 0);
    }
    /* one flipped payload byte: checksum */
    blocks[2 * PAGE_SIZE_4K + 1000] ^= 0x40;
    CHECK(vblock_check(blocks + 2 * PAGE_SIZE_4K, 2, 5) == 8);
    blocks[2 * PAGE_SIZE_4K + 1000] ^= 0x40;
    CHECK(vblock_check(blocks + 2 * PAGE_SIZE_4K, 2, 5) == 0);
    /* two blocks swapped (a page landed at the wrong address): address */
    memcpy(tmp, blocks, PAGE_SIZE_4K);
    memcpy(blocks, blocks + PAGE_SIZE_4K, PAGE_SIZE_4K);
    memcpy(blocks + PAGE_SIZE_4K, tmp, PAGE_SIZE_4K);
    CHECK(vblock_check(blocks, 0, 5) == 2);
    CHECK(vblock_check(blocks + PAGE_SIZE_4K, 1, 5) == 2);
    /* a stale block (the old generation arrived): generation */
    vblock_stamp(blocks + 3 * PAGE_SIZE_4K, 3, 4);
    CHECK(vblock_check(blocks + 3 * PAGE_SIZE_4K, 3, 5) == 4);
    /* a single flipped bit anywhere in a block is caught */
    {
        int all = 1;
        vblock_stamp(blocks, 0, 5);
        CHECK(vblock_check(blocks, 0, 5) == 0);
        for (size_t off = 0; off < PAGE_SIZE_4K; off += 7) {
            blocks[off] ^= 0x10;
            all &= vblock_check(blocks, 0, 5) != 0;
            blocks[off] ^= 0x10;
        }
        CHECK(all);
    }
    /* a zeroed block: magic, address, generation and checksum all wrong */
    memset(blocks + PAGE_SIZE_4K, 0, PAGE_SIZE_4K);
    CHECK(vblock_check(blocks + PAGE_SIZE_4K, 1, 5) == 15);
    free(blocks);
}

/* The checker finds the block that went wrong, and says what is wrong with it. */
static void test_region_scan(void)
{
    enum { N = 64 };
    uint8_t *r = aligned_alloc(PAGE_SIZE_4K, N * PAGE_SIZE_4K);
    uint8_t tmp[PAGE_SIZE_4K];
    uint64_t gen[N];
    int bad = -1;

    for (uint64_t i = 0; i < N; i++) {
        gen[i] = 1 + i % 3;
        vblock_stamp(r + i * PAGE_SIZE_4K, i, gen[i]);
    }
    CHECK(vregion_find_bad(r, gen, N, 0, N, &bad) == -1 && bad == 0);
    CHECK(vregion_find_bad(r, gen, N, 50, N, &bad) == -1); /* wraps around */

    /* one corrupted byte in block 17 */
    r[17 * PAGE_SIZE_4K + 2000] ^= 1;
    CHECK(vregion_find_bad(r, gen, N, 0, N, &bad) == 17 && bad == VB_BAD_CSUM);
    CHECK(vregion_find_bad(r, gen, N, 40, N, &bad) == 17); /* found after wrapping */
    CHECK(vregion_find_bad(r, gen, N, 18, 20, &bad) == -1); /* outside the window */
    vblock_stamp(r + 17 * PAGE_SIZE_4K, 17, gen[17]);

    /* blocks 5 and 9 swapped: both are found, by their address */
    memcpy(tmp, r + 5 * PAGE_SIZE_4K, PAGE_SIZE_4K);
    memcpy(r + 5 * PAGE_SIZE_4K, r + 9 * PAGE_SIZE_4K, PAGE_SIZE_4K);
    memcpy(r + 9 * PAGE_SIZE_4K, tmp, PAGE_SIZE_4K);
    CHECK(vregion_find_bad(r, gen, N, 0, N, &bad) == 5 && (bad & VB_BAD_ADDR) &&
          !(bad & VB_BAD_CSUM));
    CHECK(vregion_find_bad(r, gen, N, 6, N, &bad) == 9 && (bad & VB_BAD_ADDR));
    vblock_stamp(r + 5 * PAGE_SIZE_4K, 5, gen[5]);
    vblock_stamp(r + 9 * PAGE_SIZE_4K, 9, gen[9]);

    /* block 30 rewritten with a new generation, but the old content came back */
    memcpy(tmp, r + 30 * PAGE_SIZE_4K, PAGE_SIZE_4K);
    gen[30]++;
    vblock_stamp(r + 30 * PAGE_SIZE_4K, 30, gen[30]);
    CHECK(vregion_find_bad(r, gen, N, 0, N, &bad) == -1);
    memcpy(r + 30 * PAGE_SIZE_4K, tmp, PAGE_SIZE_4K);
    CHECK(vregion_find_bad(r, gen, N, 0, N, &bad) == 30 && bad == VB_BAD_GEN);
    vblock_stamp(r + 30 * PAGE_SIZE_4K, 30, gen[30]);

    /* a page of zeros (a lost page) at block 63 */
    memset(r + 63 * PAGE_SIZE_4K, 0, PAGE_SIZE_4K);
    CHECK(vregion_find_bad(r, gen, N, 0, N, &bad) == 63 &&
          bad == (VB_BAD_MAGIC | VB_BAD_ADDR | VB_BAD_GEN | VB_BAD_CSUM));
    free(r);
}

static void test_json_escape(void)
{
    char out[64];

    json_escape(out, sizeof(out), "a\"b\\c\nd");
    CHECK(!strcmp(out, "a\\\"b\\\\c\\u000ad"));
    json_escape(out, 8, "0123456789");
    CHECK(strlen(out) < 8);
}

static void test_pacer(void)
{
    pacer_t p;
    uint64_t t0;

    CHECK(pacer_quantum(0, 4096, 64) == 64);
    CHECK(pacer_quantum(64ull << 20, 4096, 64) == 16);     /* 64 MiB/s: 16 pages/ms */
    CHECK(pacer_quantum(1ull << 20, 4096, 64) == 1);       /* slower than a page/ms */
    CHECK(pacer_quantum(10ull << 30, 4096, 64) == 64);
    /* 20 MiB at 200 MiB/s takes at least 100 ms */
    t0 = now_ns();
    pacer_init(&p, 200ull << 20);
    for (int i = 0; i < 20; i++) {
        pacer_spend(&p, 1ull << 20);
    }
    CHECK(now_ns() - t0 >= 99000000ull);
    /* after a 1 s stall, the catch-up burst is capped at PACER_BURST_NS */
    pacer_init(&p, 100ull << 20);
    p.start_ns -= 1000000000ull;
    pacer_spend(&p, 1);
    t0 = now_ns();
    for (int i = 0; i < 20; i++) {
        pacer_spend(&p, 1ull << 20); /* 200 ms of allowance */
    }
    CHECK(now_ns() - t0 >= 140000000ull);
}

static void test_sizes(void)
{
    uint64_t v;

    CHECK(parse_size("4K", &v) == 0 && v == 4096);
    CHECK(parse_size("1.5G", &v) == 0 && v == 3ull << 29);
    CHECK(parse_size("2MiB", &v) == 0 && v == 2ull << 20);
    CHECK(parse_size("x", &v) == -1 && parse_size("1Q", &v) == -1);
}

int main(void)
{
    test_spec_good();
    test_spec_bad();
    test_fill_kinds();
    test_page_choice();
    test_checker();
    test_region_scan();
    test_json_escape();
    test_pacer();
    test_sizes();
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
