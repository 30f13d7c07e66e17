/* dumpfill FILL MIB: write MIB MiB of pages filled like the mem workload does, then
 * the same region after a round of `touch` writes, to stdout (for ratio checks). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent.h"


int main(int argc, char **argv)
{
    struct mem_spec s = { .touch = 64, .threads = 1 };
    char err[128];
    struct mem_job *j;
    rng_t r;

    if (argc != 3) {
        fprintf(stderr, "usage: dumpfill mixed|random|text|zero MIB\n");
        return 2;
    }
    s.fill = !strcmp(argv[1], "random") ? FILL_RANDOM : !strcmp(argv[1], "text") ? FILL_TEXT
           : !strcmp(argv[1], "zero") ? FILL_ZERO : FILL_MIXED;
    s.size = strtoull(argv[2], NULL, 10) << 20;
    j = memload_prepare(&s, err, sizeof(err));
    if (!j) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    rng_seed(&r, 9);
    for (uint64_t i = 0; i < j->npages * 4; i++) {
        uint64_t p = memload_pick(j, &r);
        touch_page(j->region + p * PAGE_SIZE_4K, (enum page_kind)j->kinds[p], 64, &r);
    }
    fwrite(j->region, PAGE_SIZE_4K, j->npages, stdout);
    return 0;
}
