/* neon_driver.c — runs the kernels on fixture files so tests/test_neon.py can check the NEON
 * backend on an x86 machine (cross-compiled for aarch64, run under qemu-aarch64).
 *
 * usage: neon_driver DIR
 *   DIR/cases.txt        one line per case: "rows k"
 *   DIR/<i>.codes        rows*k/2 bytes           DIR/<i>.dscales  rows*k/32 bytes (decode)
 *   DIR/<i>.mscales      rows*k/32 bytes (matvec)  DIR/<i>.x        k float32
 *   DIR/<i>.bf16         rows*k uint16
 * writes, for each backend B in {scalar, neon} and thread count T in {1, 2, 3}:
 *   DIR/<i>.B.decode (rows*k float32), DIR/<i>.B.tT.matvec, DIR/<i>.B.tT.bf16 (rows float32)
 * The comparisons (bit identity, tolerance against float64) are made in Python.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4f_kernels.h"

static void *slurp(const char *dir, int i, const char *ext, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%d.%s", dir, i, ext);
    FILE *f = fopen(path, "rb");
    void *p = malloc(n ? n : 1);
    if (!f || !p || fread(p, 1, n, f) != n) {
        fprintf(stderr, "neon_driver: cannot read %zu bytes from %s\n", n, path);
        exit(1);
    }
    fclose(f);
    return p;
}

static void spit(const char *dir, int i, const char *ext, const void *p, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%d.%s", dir, i, ext);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n) {
        fprintf(stderr, "neon_driver: cannot write %s\n", path);
        exit(1);
    }
    fclose(f);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: neon_driver DIR\n");
        return 2;
    }
    const char *dir = argv[1];
    printf("best=%d neon_supported=%d\n", ds4f_best_backend(), ds4f_backend_supported(DS4F_NEON));
    if (!ds4f_backend_supported(DS4F_NEON)) return 3;
    char path[4096];
    snprintf(path, sizeof path, "%s/cases.txt", dir);
    FILE *cases = fopen(path, "r");
    if (!cases) {
        fprintf(stderr, "neon_driver: cannot open %s\n", path);
        return 1;
    }
    size_t rows, k;
    for (int i = 0; fscanf(cases, "%zu %zu", &rows, &k) == 2; i++) {
        uint8_t *codes = slurp(dir, i, "codes", rows * k / 2);
        uint8_t *dsc = slurp(dir, i, "dscales", rows * k / 32);
        uint8_t *msc = slurp(dir, i, "mscales", rows * k / 32);
        float *x = slurp(dir, i, "x", k * sizeof(float));
        uint16_t *w16 = slurp(dir, i, "bf16", rows * k * sizeof(uint16_t));
        float *out = malloc(rows * k * sizeof(float) + 1), *y = malloc(rows * sizeof(float) + 1);
        static const int backends[2] = {DS4F_SCALAR, DS4F_NEON};
        static const char *names[2] = {"scalar", "neon"};
        for (int b = 0; b < 2; b++) {
            if (ds4f_set_backend(backends[b]) != 0 || ds4f_get_backend() != backends[b]) return 4;
            char ext[64];
            ds4f_set_threads(1);
            memset(out, 0xff, rows * k * sizeof(float));
            ds4f_mxfp4_decode(codes, dsc, rows, k, out);
            snprintf(ext, sizeof ext, "%s.decode", names[b]);
            spit(dir, i, ext, out, rows * k * sizeof(float));
            for (int t = 1; t <= 3; t++) {
                ds4f_set_threads(t);
                ds4f_mxfp4_matvec(codes, msc, rows, k, x, y);
                snprintf(ext, sizeof ext, "%s.t%d.matvec", names[b], t);
                spit(dir, i, ext, y, rows * sizeof(float));
                ds4f_bf16_matvec(w16, rows, k, x, y);
                snprintf(ext, sizeof ext, "%s.t%d.bf16", names[b], t);
                spit(dir, i, ext, y, rows * sizeof(float));
            }
        }
        printf("case %d: %zu x %zu done\n", i, rows, k);
        free(codes), free(dsc), free(msc), free(x), free(w16), free(out), free(y);
    }
    fclose(cases);
    return 0;
}
