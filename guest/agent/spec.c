/* Workload spec parser: the same grammar as src/livemig/spec.py. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent.h"

int parse_size(const char *s, uint64_t *out)
{
    char *end;
    double v;
    uint64_t mult = 1;

    errno = 0;
    v = strtod(s, &end);
    if (end == s || errno || v < 0) {
        return -1;
    }
    switch (*end) {
    case 'k': case 'K': mult = 1ull << 10; end++; break;
    case 'm': case 'M': mult = 1ull << 20; end++; break;
    case 'g': case 'G': mult = 1ull << 30; end++; break;
    case 't': case 'T': mult = 1ull << 40; end++; break;
    default: break;
    }
    if (*end == 'i') {
        end++;
    }
    if (*end == 'B' || *end == 'b') {
        end++;
    }
    if (*end) {
        return -1;
    }
    *out = (uint64_t)(v * (double)mult);
    return 0;
}

#define FAIL(...) do { snprintf(err, errlen, __VA_ARGS__); return -1; } while (0)

static int parse_int(const char *v, int lo, int hi, int *out)
{
    char *end;
    long n = strtol(v, &end, 10);

    if (end == v || *end || n < lo || n > hi) {
        return -1;
    }
    *out = (int)n;
    return 0;
}

static int mem_kv(struct mem_spec *m, const char *k, const char *v, char *err, size_t errlen)
{
    int n;

    if (!strcmp(k, "size")) {
        if (parse_size(v, &m->size) || m->size < PAGE_SIZE_4K) {
            FAIL("mem: bad size '%s'", v);
        }
    } else if (!strcmp(k, "rate")) {
        if (parse_size(v, &m->rate)) {
            FAIL("mem: bad rate '%s'", v);
        }
    } else if (!strcmp(k, "hot")) {
        char p[16], *slash;
        snprintf(p, sizeof(p), "%s", v);
        slash = strchr(p, '/');
        if (!slash) {
            FAIL("mem: hot must be P/F, got '%s'", v);
        }
        *slash = 0;
        if (parse_int(p, 1, 100, &m->hot_p) || parse_int(slash + 1, 1, 100, &m->hot_f)) {
            FAIL("mem: bad hot '%s'", v);
        }
    } else if (!strcmp(k, "zipf")) {
        char *end;
        m->zipf = strtod(v, &end);
        if (end == v || *end || m->zipf <= 0 || m->zipf > 10) {
            FAIL("mem: bad zipf '%s'", v);
        }
    } else if (!strcmp(k, "fill")) {
        if (!strcmp(v, "mixed")) {
            m->fill = FILL_MIXED;
        } else if (!strcmp(v, "random")) {
            m->fill = FILL_RANDOM;
        } else if (!strcmp(v, "text")) {
            m->fill = FILL_TEXT;
        } else if (!strcmp(v, "zero")) {
            m->fill = FILL_ZERO;
        } else {
            FAIL("mem: bad fill '%s'", v);
        }
    } else if (!strcmp(k, "touch")) {
        uint64_t t;
        if (parse_size(v, &t) || t < 1 || t > PAGE_SIZE_4K) {
            FAIL("mem: bad touch '%s'", v);
        }
        m->touch = (unsigned)t;
    } else if (!strcmp(k, "threads")) {
        if (parse_int(v, 1, 64, &n)) {
            FAIL("mem: bad threads '%s'", v);
        }
        m->threads = (unsigned)n;
    } else if (!strcmp(k, "after")) {
        if (parse_int(v, 0, 3600, &n)) {
            FAIL("mem: bad after '%s'", v);
        }
        m->after = (unsigned)n;
    } else {
        FAIL("mem: unknown key '%s'", k);
    }
    return 0;
}

static int disk_kv(struct disk_spec *d, const char *k, const char *v, char *err,
                   size_t errlen)
{
    if (!strcmp(k, "bs")) {
        if (parse_size(v, &d->bs) || d->bs < 512 || d->bs % 512) {
            FAIL("disk: bad bs '%s'", v);
        }
    } else if (!strcmp(k, "rate")) {
        if (parse_size(v, &d->rate)) {
            FAIL("disk: bad rate '%s'", v);
        }
    } else if (!strcmp(k, "size")) {
        if (parse_size(v, &d->size)) {
            FAIL("disk: bad size '%s'", v);
        }
    } else if (!strcmp(k, "dev")) {
        if (strncmp(v, "/dev/", 5) || strlen(v) >= sizeof(d->dev)) {
            FAIL("disk: bad dev '%s'", v);
        }
        snprintf(d->dev, sizeof(d->dev), "%s", v);
    } else {
        FAIL("disk: unknown key '%s'", k);
    }
    return 0;
}

static int verify_kv(struct verify_spec *s, const char *k, const char *v, char *err,
                     size_t errlen)
{
    uint64_t *dst = !strcmp(k, "mem") ? &s->mem : !strcmp(k, "disk") ? &s->disk
                  : !strcmp(k, "rate") ? &s->rate : NULL;

    if (!dst) {
        FAIL("verify: unknown key '%s'", k);
    }
    if (parse_size(v, dst)) {
        FAIL("verify: bad %s '%s'", k, v);
    }
    return 0;
}

int parse_workload(const char *text, struct workload *w, char *err, size_t errlen)
{
    char buf[1024], *save_item = NULL, *item;

    memset(w, 0, sizeof(*w));
    if (strlen(text) >= sizeof(buf)) {
        FAIL("workload spec too long");
    }
    if (!*text) {
        FAIL("empty workload spec");
    }
    if (strpbrk(text, " \t\r\n")) {
        FAIL("no spaces allowed in a workload spec");
    }
    if (strstr(text, "++") || strstr(text, ",,") || strstr(text, ":,") ||
        text[0] == '+' || strchr("+,", text[strlen(text) - 1]) || strstr(text, ",+")) {
        FAIL("empty item or key=value in '%.200s'", text);
    }
    snprintf(buf, sizeof(buf), "%s", text);
    for (item = strtok_r(buf, "+", &save_item); item;
         item = strtok_r(NULL, "+", &save_item)) {
        char *colon = strchr(item, ':'), *body = colon ? colon + 1 : NULL;
        char *save_kv = NULL, *kv;
        const char *seen[16];
        int n_seen = 0;
        enum { K_MEM, K_DISK, K_VERIFY } kind;

        if (colon) {
            *colon = 0;
        }
        if (!strcmp(item, "idle")) {
            if (body && *body) {
                FAIL("idle takes no options");
            }
            continue;
        } else if (!strcmp(item, "mem")) {
            struct mem_spec *m;
            if (w->n_mem == MAX_ITEMS) {
                FAIL("too many mem items");
            }
            m = &w->mem[w->n_mem++];
            m->size = 256ull << 20;
            m->touch = 64;
            m->threads = 1;
            kind = K_MEM;
        } else if (!strcmp(item, "disk")) {
            struct disk_spec *d;
            if (w->n_disk == MAX_ITEMS) {
                FAIL("too many disk items");
            }
            d = &w->disk[w->n_disk++];
            d->bs = 4096;
            d->rate = 1ull << 20;
            snprintf(d->dev, sizeof(d->dev), "/dev/vda");
            kind = K_DISK;
        } else if (!strcmp(item, "verify")) {
            if (w->has_verify) {
                FAIL("verify given twice");
            }
            w->has_verify = 1;
            w->verify.rate = 8ull << 20;
            kind = K_VERIFY;
        } else {
            FAIL("unknown workload item '%s'", item);
        }
        for (kv = body ? strtok_r(body, ",", &save_kv) : NULL; kv;
             kv = strtok_r(NULL, ",", &save_kv)) {
            char *eq = strchr(kv, '=');
            int rc;
            if (!eq || eq == kv || !eq[1]) {
                FAIL("expected key=value, got '%s'", kv);
            }
            *eq = 0;
            for (int i = 0; i < n_seen; i++) {
                if (!strcmp(seen[i], kv)) {
                    FAIL("%s given twice", kv);
                }
            }
            if (n_seen == 16) {
                FAIL("too many keys");
            }
            seen[n_seen++] = kv;
            rc = kind == K_MEM ? mem_kv(&w->mem[w->n_mem - 1], kv, eq + 1, err, errlen)
               : kind == K_DISK ? disk_kv(&w->disk[w->n_disk - 1], kv, eq + 1, err, errlen)
               : verify_kv(&w->verify, kv, eq + 1, err, errlen);
            if (rc) {
                return rc;
            }
        }
        if (kind == K_MEM && w->mem[w->n_mem - 1].hot_p && w->mem[w->n_mem - 1].zipf) {
            FAIL("mem: hot and zipf exclude each other");
        }
        if (kind == K_VERIFY && !w->verify.mem && !w->verify.disk) {
            FAIL("verify: give mem=SIZE and/or disk=SIZE");
        }
    }
    return 0;
}
