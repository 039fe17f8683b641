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
 * FP8 (if DIR/fp8.txt exists; one line per case: "rows k"):
 *   DIR/f<i>.w  rows*k E4M3 bytes   DIR/f<i>.ds / f<i>.ms  ceil(rows/128)*ceil(k/128) scale bytes
 *   (decode / matvec)   DIR/f<i>.x  k float32
 *   -> DIR/f<i>.B.decode (rows*k float32), DIR/f<i>.B.tT.matvec (rows float32)
 * Routed experts (if DIR/experts.txt exists: "n hidden inter limit"):
 *   DIR/e<e>.w1 .s1 .w3 .s3 .w2 .s2 (MXFP4, as ds4f_expert), DIR/e.weights n float32, DIR/e.x
 *   hidden float32 -> DIR/e.B.tT.each (n*hidden float32, experts_forward_each) and DIR/e.B.tT.sum
 *   (hidden float32, experts_forward)
 * Several vectors at once (if DIR/multi.txt exists: "tmax t1 t2 ..."):
 *   DIR/<i>.xs, DIR/f<i>.xs   tmax*k float32 (tmax input vectors per case)
 *   -> DIR/<i>.B.rows, .bfrows, DIR/f<i>.B.rows: the single-vector matvec of each of the tmax rows
 *      (tmax*rows float32), and for every t in the list and thread count T:
 *      DIR/<i>.B.tT.mm<t>, .bfmm<t> (MXFP4, bf16 matmul of the first t rows), DIR/f<i>.B.tT.mm<t>
 *   Routed experts on tokens (with experts.txt; DIR/e.tok.txt: "ntok" then one line per expert
 *   "n tok..."), DIR/e.xs ntok*hidden float32, DIR/e.tw one float32 weight per pair
 *   -> DIR/e.B.tT.tokens (pairs*hidden float32, experts_forward_tokens) and DIR/e.B.pairs (the
 *      same pairs through experts_forward_each, one call per pair)
 * The comparisons (bit identity, tolerance against float64) are made in Python.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4f_kernels.h"

static const int backends[2] = {DS4F_SCALAR, DS4F_NEON};
static const char *backend_name(int b) { return ds4f_backend_name(backends[b]); }

static void *slurp_path(const char *path, size_t n) {
    FILE *f = fopen(path, "rb");
    void *p = malloc(n ? n : 1);
    if (!f || !p || fread(p, 1, n, f) != n) {
        fprintf(stderr, "neon_driver: cannot read %zu bytes from %s\n", n, path);
        exit(1);
    }
    fclose(f);
    return p;
}

static void spit_path(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n) {
        fprintf(stderr, "neon_driver: cannot write %s\n", path);
        exit(1);
    }
    fclose(f);
}

/* DIR/<prefix><i>.<ext> */
static void *slurp_f(const char *dir, const char *prefix, int i, const char *ext, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s%d.%s", dir, prefix, i, ext);
    return slurp_path(path, n);
}

static void spit_f(const char *dir, const char *prefix, int i, const char *ext, const void *p, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s%d.%s", dir, prefix, i, ext);
    spit_path(path, p, n);
}

static void use_backend(int b) {
    if (ds4f_set_backend(backends[b]) != 0 || ds4f_get_backend() != backends[b]) exit(4);
}

static void run_multi(const char *dir, const char *prefix, int i, int kind, const void *w, const uint8_t *sc,
                      size_t rows, size_t k);
static void run_expert_tokens(const char *dir, const ds4f_expert *ex, int n, size_t hidden, size_t inter,
                              float limit);

static void run_fp8(const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/fp8.txt", dir);
    FILE *cases = fopen(path, "r");
    if (!cases) return;
    size_t rows, k;
    for (int i = 0; fscanf(cases, "%zu %zu", &rows, &k) == 2; i++) {
        const size_t nt = ((rows + 127) / 128) * ((k + 127) / 128);
        uint8_t *w = slurp_f(dir, "f", i, "w", rows * k);
        uint8_t *ds = slurp_f(dir, "f", i, "ds", nt), *ms = slurp_f(dir, "f", i, "ms", nt);
        float *x = slurp_f(dir, "f", i, "x", k * sizeof(float));
        float *out = malloc(rows * k * sizeof(float) + 1), *y = malloc(rows * sizeof(float) + 1);
        for (int b = 0; b < 2; b++) {
            use_backend(b);
            char ext[64];
            ds4f_set_threads(1);
            memset(out, 0xff, rows * k * sizeof(float));
            ds4f_fp8_decode(w, ds, rows, k, out);
            snprintf(ext, sizeof ext, "%s.decode", backend_name(b));
            spit_f(dir, "f", i, ext, out, rows * k * sizeof(float));
            for (int t = 1; t <= 3; t++) {
                ds4f_set_threads(t);
                ds4f_fp8_matvec(w, ms, rows, k, x, y);
                snprintf(ext, sizeof ext, "%s.t%d.matvec", backend_name(b), t);
                spit_f(dir, "f", i, ext, y, rows * sizeof(float));
            }
        }
        run_multi(dir, "f", i, 2, w, ms, rows, k);
        printf("fp8 case %d: %zu x %zu done\n", i, rows, k);
        free(w), free(ds), free(ms), free(x), free(out), free(y);
    }
    fclose(cases);
}

static void run_experts(const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/experts.txt", dir);
    FILE *f = fopen(path, "r");
    if (!f) return;
    int n;
    size_t hidden, inter;
    float limit;
    if (fscanf(f, "%d %zu %zu %f", &n, &hidden, &inter, &limit) != 4 || n < 1 || n > DS4F_MAX_EXPERTS) exit(5);
    fclose(f);
    ds4f_expert ex[DS4F_MAX_EXPERTS];
    snprintf(path, sizeof path, "%s/e.weights", dir);
    float *wts = slurp_path(path, (size_t)n * sizeof(float));
    for (int e = 0; e < n; e++) {
        ex[e].w1 = slurp_f(dir, "e", e, "w1", inter * hidden / 2);
        ex[e].s1 = slurp_f(dir, "e", e, "s1", inter * hidden / 32);
        ex[e].w3 = slurp_f(dir, "e", e, "w3", inter * hidden / 2);
        ex[e].s3 = slurp_f(dir, "e", e, "s3", inter * hidden / 32);
        ex[e].w2 = slurp_f(dir, "e", e, "w2", hidden * inter / 2);
        ex[e].s2 = slurp_f(dir, "e", e, "s2", hidden * inter / 32);
        ex[e].weight = wts[e];
    }
    snprintf(path, sizeof path, "%s/e.x", dir);
    float *x = slurp_path(path, hidden * sizeof(float));
    float *scratch = malloc(ds4f_experts_scratch_floats(n, hidden, inter) * sizeof(float));
    float *each = malloc((size_t)n * hidden * sizeof(float)), *sum = malloc(hidden * sizeof(float));
    for (int b = 0; b < 2; b++) {
        use_backend(b);
        for (int t = 1; t <= 3; t++) {
            ds4f_set_threads(t);
            if (ds4f_experts_forward_each(ex, n, x, hidden, inter, limit, each, scratch) != 0 ||
                ds4f_experts_forward(ex, n, x, hidden, inter, limit, sum, scratch) != 0)
                exit(6);
            snprintf(path, sizeof path, "%s/e.%s.t%d.each", dir, backend_name(b), t);
            spit_path(path, each, (size_t)n * hidden * sizeof(float));
            snprintf(path, sizeof path, "%s/e.%s.t%d.sum", dir, backend_name(b), t);
            spit_path(path, sum, hidden * sizeof(float));
        }
    }
    printf("experts: %d x %zu x %zu done\n", n, hidden, inter);
    run_expert_tokens(dir, ex, n, hidden, inter, limit);
}

/* DIR/multi.txt: tmax, then the token counts to run; returns how many (0: no file) */
static int multi_counts(const char *dir, size_t *tmax, size_t *ts, int cap) {
    char path[4096];
    snprintf(path, sizeof path, "%s/multi.txt", dir);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int n = 0;
    if (fscanf(f, "%zu", tmax) != 1) exit(7);
    while (n < cap && fscanf(f, "%zu", &ts[n]) == 1) n++;
    fclose(f);
    return n;
}

/* kind 0 MXFP4, 1 bf16, 2 FP8: the single-vector kernel on each of tmax rows, then the matmul of
 * the first t rows for each t, at 1..3 threads */
static void run_multi(const char *dir, const char *prefix, int i, int kind, const void *w, const uint8_t *sc,
                      size_t rows, size_t k) {
    size_t tmax, ts[16];
    const int nts = multi_counts(dir, &tmax, ts, 16);
    if (!nts) return;
    static const char *tag[3] = {"", "bf", ""};
    float *xs = slurp_f(dir, prefix, i, "xs", tmax * k * sizeof(float));
    float *y = malloc(tmax * rows * sizeof(float) + 1);
    float *scratch = malloc(ds4f_matmul_scratch_floats(tmax, k) * sizeof(float) + 4);
    char ext[64];
    for (int b = 0; b < 2; b++) {
        use_backend(b);
        ds4f_set_threads(1);
        for (size_t t = 0; t < tmax; t++) {
            if (kind == 0) ds4f_mxfp4_matvec(w, sc, rows, k, xs + t * k, y + t * rows);
            else if (kind == 1) ds4f_bf16_matvec(w, rows, k, xs + t * k, y + t * rows);
            else ds4f_fp8_matvec(w, sc, rows, k, xs + t * k, y + t * rows);
        }
        snprintf(ext, sizeof ext, "%s.%srows", backend_name(b), tag[kind]);
        spit_f(dir, prefix, i, ext, y, tmax * rows * sizeof(float));
        for (int th = 1; th <= 3; th++) {
            ds4f_set_threads(th);
            for (int j = 0; j < nts; j++) {
                const size_t t = ts[j];
                memset(y, 0xff, t * rows * sizeof(float));
                int rc;
                if (kind == 0) rc = ds4f_mxfp4_matmul(w, sc, rows, k, t, xs, y, scratch);
                else if (kind == 1) rc = ds4f_bf16_matmul(w, rows, k, t, xs, y, scratch);
                else rc = ds4f_fp8_matmul(w, sc, rows, k, t, xs, y, scratch);
                if (rc != 0) exit(8);
                snprintf(ext, sizeof ext, "%s.t%d.%smm%zu", backend_name(b), th, tag[kind], t);
                spit_f(dir, prefix, i, ext, y, t * rows * sizeof(float));
            }
        }
    }
    free(xs), free(y), free(scratch);
}

/* routed experts on tokens: experts_forward_tokens against experts_forward_each pair by pair */
static void run_expert_tokens(const char *dir, const ds4f_expert *ex, int n, size_t hidden, size_t inter,
                              float limit) {
    char path[4096];
    snprintf(path, sizeof path, "%s/e.tok.txt", dir);
    FILE *f = fopen(path, "r");
    if (!f) return;
    size_t ntok, pairs = 0;
    if (fscanf(f, "%zu", &ntok) != 1) exit(9);
    ds4f_expert_tokens et[DS4F_MAX_EXPERTS];
    int32_t *tok = malloc(64 * DS4F_MAX_EXPERTS * sizeof(int32_t));
    for (int e = 0; e < n; e++) {
        size_t m;
        if (fscanf(f, "%zu", &m) != 1 || m > 64) exit(9);
        et[e] = (ds4f_expert_tokens){ex[e].w1, ex[e].s1, ex[e].w3, ex[e].s3, ex[e].w2, ex[e].s2, tok + pairs, NULL, m};
        for (size_t i = 0; i < m; i++)
            if (fscanf(f, "%d", &tok[pairs + i]) != 1) exit(9);
        pairs += m;
    }
    fclose(f);
    snprintf(path, sizeof path, "%s/e.tw", dir);
    float *tw = slurp_path(path, pairs * sizeof(float));
    for (int e = 0, o = 0; e < n; o += (int)et[e].n, e++) et[e].weights = tw + o;
    snprintf(path, sizeof path, "%s/e.xs", dir);
    float *xs = slurp_path(path, ntok * hidden * sizeof(float));
    float *y = malloc(pairs * hidden * sizeof(float));
    float *scratch = malloc(ds4f_experts_tokens_scratch_floats(pairs, hidden, inter) * sizeof(float));
    float *one = malloc(ds4f_experts_scratch_floats(1, hidden, inter) * sizeof(float));
    for (int b = 0; b < 2; b++) {
        use_backend(b);
        ds4f_set_threads(1);
        for (int e = 0, p = 0; e < n; e++)
            for (size_t i = 0; i < et[e].n; i++, p++) {
                ds4f_expert x1 = ex[e];
                x1.weight = et[e].weights[i];
                if (ds4f_experts_forward_each(&x1, 1, xs + (size_t)et[e].tokens[i] * hidden, hidden, inter, limit,
                                              y + (size_t)p * hidden, one) != 0)
                    exit(10);
            }
        snprintf(path, sizeof path, "%s/e.%s.pairs", dir, backend_name(b));
        spit_path(path, y, pairs * hidden * sizeof(float));
        for (int t = 1; t <= 3; t++) {
            ds4f_set_threads(t);
            memset(y, 0xff, pairs * hidden * sizeof(float));
            if (ds4f_experts_forward_tokens(et, n, xs, ntok, hidden, inter, limit, y, scratch) != 0) exit(11);
            snprintf(path, sizeof path, "%s/e.%s.t%d.tokens", dir, backend_name(b), t);
            spit_path(path, y, pairs * hidden * sizeof(float));
        }
    }
    printf("expert tokens: %zu pairs done\n", pairs);
    free(tok), free(tw), free(xs), free(y), free(scratch), free(one);
}

/* the hyper-connections' mix: DIR/hc.txt "n k rows eps", hc.x, hc.fn -> hc.<backend>.all (all n
 * tokens in one call) and hc.<backend>.one (each token alone) */
static void run_hc(const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/hc.txt", dir);
    FILE *f = fopen(path, "r");
    size_t n, k, rows;
    double eps;
    if (!f || fscanf(f, "%zu %zu %zu %lf", &n, &k, &rows, &eps) != 4) exit(12);
    fclose(f);
    snprintf(path, sizeof path, "%s/hc.x", dir);
    float *x = slurp_path(path, n * k * sizeof(float));
    snprintf(path, sizeof path, "%s/hc.fn", dir);
    float *fn = slurp_path(path, rows * k * sizeof(float));
    double *out = malloc(n * rows * sizeof(double)), *scratch = malloc(ds4f_hc_mix_scratch_doubles(k, rows) * sizeof(double));
    for (int b = 0; b < 2; b++) {
        use_backend(b);
        if (ds4f_hc_mix(x, n, k, fn, rows, eps, out, scratch) != 0) exit(13);
        snprintf(path, sizeof path, "%s/hc.%s.all", dir, backend_name(b));
        spit_path(path, out, n * rows * sizeof(double));
        for (size_t t = 0; t < n; t++)
            if (ds4f_hc_mix(x + t * k, 1, k, fn, rows, eps, out + t * rows, scratch) != 0) exit(13);
        snprintf(path, sizeof path, "%s/hc.%s.one", dir, backend_name(b));
        spit_path(path, out, n * rows * sizeof(double));
    }
    printf("hc mix: %zu tokens done\n", n);
    free(x), free(fn), free(out), free(scratch);
}

/* the MXFP4 / bf16 cases: DIR/<i>.<ext> */
static void *slurp(const char *dir, int i, const char *ext, size_t n) { return slurp_f(dir, "", i, ext, n); }

static void spit(const char *dir, int i, const char *ext, const void *p, size_t n) {
    spit_f(dir, "", i, ext, p, n);
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
        for (int b = 0; b < 2; b++) {
            use_backend(b);
            char ext[64];
            ds4f_set_threads(1);
            memset(out, 0xff, rows * k * sizeof(float));
            ds4f_mxfp4_decode(codes, dsc, rows, k, out);
            snprintf(ext, sizeof ext, "%s.decode", backend_name(b));
            spit(dir, i, ext, out, rows * k * sizeof(float));
            for (int t = 1; t <= 3; t++) {
                ds4f_set_threads(t);
                ds4f_mxfp4_matvec(codes, msc, rows, k, x, y);
                snprintf(ext, sizeof ext, "%s.t%d.matvec", backend_name(b), t);
                spit(dir, i, ext, y, rows * sizeof(float));
                ds4f_bf16_matvec(w16, rows, k, x, y);
                snprintf(ext, sizeof ext, "%s.t%d.bf16", backend_name(b), t);
                spit(dir, i, ext, y, rows * sizeof(float));
            }
        }
        run_multi(dir, "", i, 0, codes, msc, rows, k);
        run_multi(dir, "", i, 1, w16, NULL, rows, k);
        printf("case %d: %zu x %zu done\n", i, rows, k);
        free(codes), free(dsc), free(msc), free(x), free(w16), free(out), free(y);
    }
    fclose(cases);
    run_fp8(dir);
    run_experts(dir);
    run_hc(dir);
    return 0;
}
