/*
 * compbench: single-core compression and decompression speed and ratio of
 * zlib (level 1), zstd (level 1) and lz4 (several accelerations) on a corpus
 * of guest memory, in units of 4 KiB pages and of 512 KiB multifd packets.
 *
 * usage: compbench FILE [LABEL]
 */
#include <lz4.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zlib.h>
#include <zstd.h>

#define PAGE 4096
#define PACKET (512 * 1024)

static double now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

typedef size_t (*comp_fn)(const uint8_t *in, size_t n, uint8_t *out, size_t cap, int arg);
typedef size_t (*dec_fn)(const uint8_t *in, size_t n, uint8_t *out, size_t cap);

static size_t c_zlib(const uint8_t *in, size_t n, uint8_t *out, size_t cap, int lvl)
{
    uLongf len = cap;

    return compress2(out, &len, in, n, lvl) == Z_OK ? len : 0;
}

static size_t d_zlib(const uint8_t *in, size_t n, uint8_t *out, size_t cap)
{
    uLongf len = cap;

    return uncompress(out, &len, in, n) == Z_OK ? len : 0;
}

static size_t c_zstd(const uint8_t *in, size_t n, uint8_t *out, size_t cap, int lvl)
{
    static ZSTD_CCtx *cx;
    size_t r;

    if (!cx) {
        cx = ZSTD_createCCtx();
    }
    r = ZSTD_compressCCtx(cx, out, cap, in, n, lvl);
    return ZSTD_isError(r) ? 0 : r;
}

static size_t d_zstd(const uint8_t *in, size_t n, uint8_t *out, size_t cap)
{
    static ZSTD_DCtx *dx;
    size_t r;

    if (!dx) {
        dx = ZSTD_createDCtx();
    }
    r = ZSTD_decompressDCtx(dx, out, cap, in, n);
    return ZSTD_isError(r) ? 0 : r;
}

static size_t c_lz4(const uint8_t *in, size_t n, uint8_t *out, size_t cap, int accel)
{
    int r = LZ4_compress_fast((const char *)in, (char *)out, (int)n, (int)cap, accel);

    return r > 0 ? (size_t)r : 0;
}

static size_t d_lz4(const uint8_t *in, size_t n, uint8_t *out, size_t cap)
{
    int r = LZ4_decompress_safe((const char *)in, (char *)out, (int)n, (int)cap);

    return r > 0 ? (size_t)r : 0;
}

static void run(const char *label, const char *name, comp_fn c, dec_fn d, int arg,
                const uint8_t *data, size_t size, size_t unit)
{
    size_t units = size / unit, cap = unit * 2 + 1024, total_out = 0;
    uint8_t *out = malloc(units * cap), *back = malloc(unit);
    size_t *lens = calloc(units, sizeof(size_t));
    double t0, tc, td;

    t0 = now();
    for (size_t i = 0; i < units; i++) {
        lens[i] = c(data + i * unit, unit, out + i * cap, cap, arg);
        total_out += lens[i] ? lens[i] : unit;
    }
    tc = now() - t0;
    t0 = now();
    for (size_t i = 0; i < units; i++) {
        if (lens[i] && (d(out + i * cap, lens[i], back, unit) != unit ||
                        memcmp(back, data + i * unit, unit))) {
            fprintf(stderr, "%s: round trip failed at unit %zu\n", name, i);
            exit(1);
        }
    }
    td = now() - t0;
    printf("| %s | %s | %s | %.0f | %.0f | %.2f |\n", label, name,
           unit == PAGE ? "4 KiB" : "512 KiB", units * unit / tc / 1e6,
           units * unit / td / 1e6, (double)units * unit / total_out);
    free(out);
    free(back);
    free(lens);
}

int main(int argc, char **argv)
{
    FILE *f;
    uint8_t *data;
    size_t size;
    const char *label;
    static const int accels[] = { 1, 2, 4, 8, 16 };

    if (argc < 2) {
        fprintf(stderr, "usage: compbench FILE [LABEL]\n");
        return 2;
    }
    label = argc > 2 ? argv[2] : argv[1];
    f = fopen(argv[1], "rb");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    size = (size_t)ftell(f) / PACKET * PACKET;
    rewind(f);
    data = malloc(size);
    if (fread(data, 1, size, f) != size) {
        perror("read");
        return 1;
    }
    fclose(f);
    for (size_t unit = PAGE; unit <= PACKET; unit *= PACKET / PAGE) {
        char name[32];
        run(label, "zlib-1", c_zlib, d_zlib, 1, data, size, unit);
        run(label, "zstd-1", c_zstd, d_zstd, 1, data, size, unit);
        for (size_t i = 0; i < sizeof(accels) / sizeof(accels[0]); i++) {
            snprintf(name, sizeof(name), "lz4-a%d", accels[i]);
            run(label, name, c_lz4, d_lz4, accels[i], data, size, unit);
        }
    }
    return 0;
}
