/*
 * Page contents that look like real guest memory.
 *
 * Real RAM is a mix: free/zeroed pages, text (logs, config, strings), structures
 * full of pointers and small integers, and high-entropy data (compressed or
 * encrypted buffers, hashes). fill=mixed draws each page's kind from that mix so
 * that the whole region compresses about like real guest RAM (measured ratios in
 * guest/README.md); a write replaces bytes with new bytes of the page's own kind.
 */
#include <pthread.h>
#include <string.h>

#include "agent.h"

#define OBJ 64 /* struct-like pages are arrays of 64-byte objects */

static const char *const words[] = {
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with",
    "be", "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which",
    "but", "have", "an", "had", "they", "you", "were", "their", "one", "all", "we",
    "can", "her", "has", "there", "been", "if", "more", "when", "will", "would",
    "who", "so", "no", "request", "server", "error", "user", "session", "timeout",
    "connection", "database", "query", "table", "index", "commit", "transaction",
    "buffer", "page", "memory", "thread", "process", "kernel", "network", "packet",
    "client", "response", "status", "value", "record", "update", "insert", "select",
    "where", "order", "account", "balance", "customer", "invoice", "payment", "item",
    "price", "quantity", "total", "date", "time", "name", "address", "city", "country",
    "INFO", "WARN", "DEBUG", "200", "404", "GET", "POST", "/api/v1/orders", "true",
    "false", "null", "id", "key", "cache", "hit", "miss", "latency", "ms", "bytes",
};
#define N_WORDS (sizeof(words) / sizeof(words[0]))

static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

enum page_kind page_kind_for(enum fill_kind fill, uint64_t page_index)
{
    unsigned pct;

    switch (fill) {
    case FILL_RANDOM: return PK_RANDOM;
    case FILL_TEXT: return PK_TEXT;
    case FILL_ZERO: return PK_ZERO;
    case FILL_MIXED: break;
    }
    pct = (unsigned)(mix64(page_index) % 100);
    if (pct < 20) {
        return PK_ZERO;
    }
    if (pct < 48) {
        return PK_TEXT;
    }
    if (pct < 80) {
        return PK_STRUCT;
    }
    return PK_RANDOM;
}

/* words padded to 16 bytes, so a word is copied with one fixed-size memcpy */
struct padded_word {
    char s[16];
    size_t len;
};
static struct padded_word word_tab[N_WORDS];
static pthread_once_t word_once = PTHREAD_ONCE_INIT;

static void word_tab_init(void)
{
    for (size_t k = 0; k < N_WORDS; k++) {
        word_tab[k].len = strlen(words[k]);
        memcpy(word_tab[k].s, words[k], word_tab[k].len); /* all shorter than 16 */
    }
}

static uint8_t separator(uint64_t x)
{
    return (x >> 32) % 13 == 0 ? '\n' : (x >> 40) % 11 == 0 ? ',' : ' ';
}

/*
 * Text has locality: a stretch of text (a page, a log line) draws on a few dozen
 * words of the vocabulary, not on all of it with equal odds.
 */
#define TOPIC_WORDS 20

static void gen_text(uint8_t *dst, size_t len, rng_t *r)
{
    size_t i = 0, topic = (size_t)(rng_next(r) % N_WORDS);
#define word_index(x) ((topic + (size_t)((x) % TOPIC_WORDS)) % N_WORDS)

    pthread_once(&word_once, word_tab_init);
    while (i + 17 <= len) { /* fast path: room for a whole padded word + separator */
        uint64_t x = rng_next(r);
        const struct padded_word *w = &word_tab[word_index(x)];
        memcpy(dst + i, w->s, 16);
        i += w->len;
        dst[i++] = separator(x);
    }
    while (i < len) {
        uint64_t x = rng_next(r);
        const struct padded_word *w = &word_tab[word_index(x)];
        for (size_t k = 0; k < w->len && i < len; k++) {
            dst[i++] = (uint8_t)w->s[k];
        }
        if (i < len) {
            dst[i++] = separator(x);
        }
    }
#undef word_index
}

/* one 64-byte object: two heap pointers, small ints, a length, a hash, padding */
static void gen_object(uint8_t obj[OBJ], rng_t *r)
{
    uint64_t v[8];
    uint64_t x = rng_next(r);

    v[0] = 0x00007f3a00000000ull | ((x & 0xfffff) << 4);
    v[1] = 0x00007f3a00000000ull | (((x >> 20) & 0xfffff) << 4);
    v[2] = (x >> 40) & 7;              /* refcount */
    v[3] = ((x >> 43) & 15) | 0x100;   /* type tag */
    v[4] = (x >> 47) & 0xfff;          /* length */
    v[5] = rng_next(r);                /* a hash: high entropy */
    v[6] = 0;
    v[7] = (x >> 60) ? 0 : 0xffffffffffffffffull;
    memcpy(obj, v, OBJ);
}

void fill_bytes(uint8_t *dst, size_t len, size_t page_offset, enum page_kind kind,
                rng_t *r)
{
    switch (kind) {
    case PK_ZERO:
        memset(dst, 0, len);
        return;
    case PK_TEXT:
        gen_text(dst, len, r);
        return;
    case PK_RANDOM:
        for (size_t i = 0; i < len; i += 8) {
            uint64_t x = rng_next(r);
            memcpy(dst + i, &x, len - i < 8 ? len - i : 8);
        }
        return;
    case PK_STRUCT: {
        /* regenerate the objects covering [page_offset, page_offset + len) */
        size_t first = page_offset / OBJ, last = (page_offset + len - 1) / OBJ;
        for (size_t o = first; o <= last; o++) {
            uint8_t obj[OBJ];
            size_t ostart = o * OBJ;
            size_t from = page_offset > ostart ? page_offset - ostart : 0;
            size_t to = page_offset + len < ostart + OBJ ? page_offset + len - ostart : OBJ;
            gen_object(obj, r);
            memcpy(dst + (ostart + from - page_offset), obj + from, to - from);
        }
        return;
    }
    }
}

void fill_page(uint8_t *page, enum page_kind kind, rng_t *r)
{
    fill_bytes(page, PAGE_SIZE_4K, 0, kind, r);
}

void touch_page(uint8_t *page, enum page_kind kind, unsigned touch, rng_t *r)
{
    size_t off = touch >= PAGE_SIZE_4K ? 0
               : (size_t)(rng_next(r) % (PAGE_SIZE_4K - touch + 1));

    if (kind == PK_ZERO) {
        /* a zeroed page being written: stays zero most of the time (memset-like) */
        memset(page + off, 0, touch);
        return;
    }
    fill_bytes(page + off, touch, off, kind, r);
}
