/* hyper.c — the hyper-connections' mix of several tokens, in float64 with one fixed order.
 *
 * For token t with streams x[t] (k = N * hidden fp32 values) and the fp32 weights fn, both widened
 * to float64 exactly where they are used (fn stays fp32 in memory, transposed: fn_t[i][r] is the
 * weight of element i in row r, so one element's weights for every row are together):
 *   ss     = sum over i in order of x_i * x_i          (one fused multiply-add per element)
 *   d      = sqrt(ss / k + eps)
 *   mix[r] = sum over i in order of fn_t[i][r] * (x_i / d)   (one fused multiply-add per element)
 * Every step is correctly rounded (fma, division, square root), so the scalar reference below and
 * the AVX2 versions, whose vector lanes each run the scalar sequence of one sum, give the same
 * bits; so does any batch size: a token's mix never depends on the others.
 * A BLAS product would sum in its build's and CPU's order; this order is the project's own.
 *
 * AVX2, many tokens (HC_T or more): the lanes are tokens. The streams of 8 tokens (two vectors of 4
 * lanes) are transposed into scratch while their squares are summed; then, HC_IB elements at a
 * time, the block is divided by d and every row runs over it, 6 rows at a time (12 accumulator
 * chains), while the block is in L1. fn (1.5 MiB at the real width) is read once per 8 tokens.
 * A group of 4 tokens or fewer (several sequences' decode rows) fills only the first vector of
 * lanes: the second is not computed (4 tokens: 0.20 ms against 0.29 at the real width, 1 thread).
 * AVX2, a few tokens (a decode step): the lanes are rows, 4 to a vector: for each element i, its
 * x_i / d broadcast and fn_t[i]'s row weights (contiguous) in as many chains as rows / 4, fn read
 * once per token.
 */
#include <math.h>

#include "kernels_internal.h"

#ifdef DS4F_X86
#include "kernels_avx2.h"
#endif

size_t ds4f_hc_mix_scratch_doubles(size_t k, size_t rows) { return 8 * k + 8 * rows; }

static void hc_mix_scalar(const float *x, size_t n, size_t k, const float *fn_t, size_t rows, double eps,
                          double *out, double *acc) {
    for (size_t t = 0; t < n; t++) {
        const float *xt = x + t * k;
        double ss = 0.0;
        for (size_t i = 0; i < k; i++) ss = fma((double)xt[i], (double)xt[i], ss);
        const double d = sqrt(ss / (double)k + eps);
        for (size_t r = 0; r < rows; r++) acc[r] = 0.0;
        for (size_t i = 0; i < k; i++) {
            const double xn = (double)xt[i] / d;
            const float *f = fn_t + i * rows;
            for (size_t r = 0; r < rows; r++) acc[r] = fma((double)f[r], xn, acc[r]);
        }
        for (size_t r = 0; r < rows; r++) out[t * rows + r] = acc[r];
    }
}

#ifdef DS4F_X86
#define HC_T 8    /* tokens at a time: two vectors of 4 lanes */
#define HC_R 6    /* rows at a time: 12 accumulator chains */
#define HC_IB 256 /* elements per block: the block's 8 tokens' streams are 16 KiB */

/* xt[i][l] = token l's x_i for the group's nl tokens (lanes past nl repeat the last token; their
 * results are dropped), not yet divided, and each lane's d; only the first nh vectors of lanes
 * (nh = 1: 4 tokens or fewer) */
T256 static void hc_gather(const float *x, size_t nl, int nh, size_t k, double eps, double *xt, __m256d d[2]) {
    const float *row[HC_T];
    for (size_t l = 0; l < HC_T; l++) row[l] = x + (l < nl ? l : nl - 1) * k;
    __m256d ss[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
    size_t i = 0;
    for (; i + 4 <= k; i += 4) /* 4 elements of 4 tokens: a 4 x 4 transpose per lane vector */
        for (int h = 0; h < nh; h++) {
            const __m256d r0 = _mm256_cvtps_pd(_mm_loadu_ps(row[4 * h] + i)), r1 = _mm256_cvtps_pd(_mm_loadu_ps(row[4 * h + 1] + i));
            const __m256d r2 = _mm256_cvtps_pd(_mm_loadu_ps(row[4 * h + 2] + i)), r3 = _mm256_cvtps_pd(_mm_loadu_ps(row[4 * h + 3] + i));
            const __m256d a0 = _mm256_unpacklo_pd(r0, r1), a1 = _mm256_unpackhi_pd(r0, r1);
            const __m256d a2 = _mm256_unpacklo_pd(r2, r3), a3 = _mm256_unpackhi_pd(r2, r3);
            const __m256d c[4] = {_mm256_permute2f128_pd(a0, a2, 0x20), _mm256_permute2f128_pd(a1, a3, 0x20),
                                  _mm256_permute2f128_pd(a0, a2, 0x31), _mm256_permute2f128_pd(a1, a3, 0x31)};
            for (int m = 0; m < 4; m++) { /* element i + m, in order */
                _mm256_storeu_pd(xt + (i + m) * HC_T + 4 * h, c[m]);
                ss[h] = _mm256_fmadd_pd(c[m], c[m], ss[h]);
            }
        }
    for (; i < k; i++)
        for (int h = 0; h < nh; h++) {
            const __m256d xv = _mm256_set_pd(row[4 * h + 3][i], row[4 * h + 2][i], row[4 * h + 1][i], row[4 * h][i]);
            _mm256_storeu_pd(xt + i * HC_T + 4 * h, xv);
            ss[h] = _mm256_fmadd_pd(xv, xv, ss[h]);
        }
    const __m256d kk = _mm256_set1_pd((double)k), ee = _mm256_set1_pd(eps);
    for (int h = 0; h < nh; h++) d[h] = _mm256_sqrt_pd(_mm256_add_pd(_mm256_div_pd(ss[h], kk), ee));
}

/* rows r..r+R-1 over elements i0..i1-1: their running sums (acc + 8 j: row r + j's 8 lanes), for
 * NH vectors of lanes (a constant in each call, so the loops unroll) */
INL void hc_rows_nh(int NH, const float *fn_t, size_t rows, size_t r, int R, const double *xt, size_t i0,
                       size_t i1, double *acc) {
    const float *f0 = fn_t + r;
    if (R == HC_R) {
        __m256d a[HC_R][2];
        _Pragma("GCC unroll 6") for (int j = 0; j < HC_R; j++)
            _Pragma("GCC unroll 2") for (int h = 0; h < NH; h++) a[j][h] = _mm256_loadu_pd(acc + 8 * j + 4 * h);
        for (size_t i = i0; i < i1; i++) {
            __m256d xv[2];
            _Pragma("GCC unroll 2") for (int h = 0; h < NH; h++) xv[h] = _mm256_loadu_pd(xt + i * HC_T + 4 * h);
            _Pragma("GCC unroll 6") for (int j = 0; j < HC_R; j++) {
                const __m256d f = _mm256_set1_pd((double)f0[i * rows + j]);
                _Pragma("GCC unroll 2") for (int h = 0; h < NH; h++) a[j][h] = _mm256_fmadd_pd(f, xv[h], a[j][h]);
            }
        }
        _Pragma("GCC unroll 6") for (int j = 0; j < HC_R; j++)
            _Pragma("GCC unroll 2") for (int h = 0; h < NH; h++) _mm256_storeu_pd(acc + 8 * j + 4 * h, a[j][h]);
        return;
    }
    for (int j = 0; j < R; j++) /* the last rows, one at a time */
        for (int h = 0; h < NH; h++) {
            __m256d a0 = _mm256_loadu_pd(acc + 8 * j + 4 * h);
            for (size_t i = i0; i < i1; i++)
                a0 = _mm256_fmadd_pd(_mm256_set1_pd((double)f0[i * rows + j]), _mm256_loadu_pd(xt + i * HC_T + 4 * h), a0);
            _mm256_storeu_pd(acc + 8 * j + 4 * h, a0);
        }
}

T256 static void hc_rows(int nh, const float *fn_t, size_t rows, size_t r, int R, const double *xt, size_t i0,
                         size_t i1, double *acc) {
    if (nh == 2)
        hc_rows_nh(2, fn_t, rows, r, R, xt, i0, i1, acc);
    else
        hc_rows_nh(1, fn_t, rows, r, R, xt, i0, i1, acc);
}

T256 static void hc_mix_tokens(const float *x, size_t n, size_t k, const float *fn_t, size_t rows, double eps,
                             double *out, double *scratch) {
    double *xt = scratch, *acc = scratch + HC_T * k; /* xt [k][HC_T]; acc [rows][HC_T], the rows' running sums */
    for (size_t t0 = 0; t0 < n; t0 += HC_T) {
        const size_t nl = n - t0 < HC_T ? n - t0 : HC_T;
        const int nh = nl > HC_T / 2 ? 2 : 1; /* 4 tokens or fewer: one vector of lanes */
        __m256d d[2];
        hc_gather(x + t0 * k, nl, nh, k, eps, xt, d);
        for (size_t j = 0; j < HC_T * rows; j++) acc[j] = 0.0;
        for (size_t i0 = 0; i0 < k; i0 += HC_IB) {
            const size_t i1 = i0 + HC_IB < k ? i0 + HC_IB : k;
            for (size_t i = i0; i < i1; i++)
                for (int h = 0; h < nh; h++)
                    _mm256_storeu_pd(xt + i * HC_T + 4 * h, _mm256_div_pd(_mm256_loadu_pd(xt + i * HC_T + 4 * h), d[h]));
            for (size_t r = 0; r < rows; r += HC_R)
                hc_rows(nh, fn_t, rows, r, rows - r < HC_R ? (int)(rows - r) : HC_R, xt, i0, i1, acc + HC_T * r);
        }
        for (size_t r = 0; r < rows; r++)
            for (size_t l = 0; l < nl; l++) out[(t0 + l) * rows + r] = acc[HC_T * r + l];
    }
}

#define HC_RV 6   /* row vectors at a time (24 rows, the real model's (2 + N) N: 6 accumulator chains) */

/* a few tokens: the lanes are rows (see the top); xn holds the token's x_i / d */
T256 static void hc_mix_rows(const float *x, size_t n, size_t k, const float *fn_t, size_t rows, double eps,
                             double *out, double *xn) {
    const size_t vr = rows / 4 * 4;
    for (size_t t = 0; t < n; t++) {
        const float *xt = x + t * k;
        double ss = 0.0;
        for (size_t i = 0; i < k; i++) ss = fma((double)xt[i], (double)xt[i], ss);
        const double d = sqrt(ss / (double)k + eps);
        const __m256d dv = _mm256_set1_pd(d);
        size_t i = 0;
        for (; i + 4 <= k; i += 4) _mm256_storeu_pd(xn + i, _mm256_div_pd(_mm256_cvtps_pd(_mm_loadu_ps(xt + i)), dv));
        for (; i < k; i++) xn[i] = (double)xt[i] / d;
        double *o = out + t * rows;
        for (size_t r0 = 0; r0 < vr; r0 += 4 * HC_RV) {
            const int nv = (int)((vr - r0) / 4 < HC_RV ? (vr - r0) / 4 : HC_RV);
            __m256d a[HC_RV];
            for (int v = 0; v < HC_RV; v++) a[v] = _mm256_setzero_pd();
            const float *f = fn_t + r0;
            if (nv == HC_RV) {
                for (size_t i = 0; i < k; i++, f += rows) {
                    const __m256d xv = _mm256_set1_pd(xn[i]);
                    _Pragma("GCC unroll 6") for (int v = 0; v < HC_RV; v++)
                        a[v] = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(f + 4 * v)), xv, a[v]);
                }
            } else {
                for (size_t i = 0; i < k; i++, f += rows) {
                    const __m256d xv = _mm256_set1_pd(xn[i]);
                    for (int v = 0; v < nv; v++)
                        a[v] = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(f + 4 * v)), xv, a[v]);
                }
            }
            for (int v = 0; v < nv; v++) _mm256_storeu_pd(o + r0 + 4 * v, a[v]);
        }
        for (size_t r = vr; r < rows; r++) { /* the last rows (rows not a multiple of 4), one at a time */
            double acc = 0.0;
            for (size_t i = 0; i < k; i++) acc = fma((double)fn_t[i * rows + r], xn[i], acc);
            o[r] = acc;
        }
    }
}
#endif

int ds4f_hc_mix(const float *x, size_t n, size_t k, const float *fn_t, size_t rows, double eps, double *out,
                double *scratch) {
    if (!x || !fn_t || !out || !scratch || k == 0 || rows == 0) return -1;
#ifdef DS4F_X86
    const int b = ds4f_get_backend();
    if (b == DS4F_AVX2 || b == DS4F_AVX512) {
        if (n < HC_T / 2)
            hc_mix_rows(x, n, k, fn_t, rows, eps, out, scratch);
        else
            hc_mix_tokens(x, n, k, fn_t, rows, eps, out, scratch);
        return 0;
    }
#endif
    hc_mix_scalar(x, n, k, fn_t, rows, eps, out, scratch);
    return 0;
}

/* ---- around the sublayer: hc_pre and hc_post, the small math in float64 -------------------- */

size_t ds4f_hc_pre_scratch_doubles(size_t n, size_t k, size_t rows) {
    return ds4f_hc_mix_scratch_doubles(k, rows) + n * rows;
}

static double sigmoid(double v) { return 1.0 / (1.0 + exp(-v)); }

/* One token's pre, post and Sinkhorn-normalised combination from its mix (m [rows]), as the
 * module docstring of engine/model/hyper.py writes them; every sum over N terms in index order. */
static void hc_small(const double *m, size_t N, size_t rows, const float *base, const float *scale, double hc_eps,
                     int iters, double *pre, double *post, double *comb) {
    const double s0 = scale[0];
    for (size_t j = 0; j < N; j++) pre[j] = sigmoid(m[j] * s0 + (double)base[j]) + hc_eps;
    if (rows == N) return; /* the head: pre alone */
    const double s1 = scale[1], s2 = scale[2];
    for (size_t j = 0; j < N; j++) post[j] = 2.0 * sigmoid(m[N + j] * s1 + (double)base[N + j]);
    for (size_t i = 0; i < N; i++) { /* a softmax along each row i */
        double *c = comb + i * N;
        for (size_t j = 0; j < N; j++) c[j] = m[2 * N + i * N + j] * s2 + (double)base[2 * N + i * N + j];
        double mx = c[0];
        for (size_t j = 1; j < N; j++) mx = c[j] > mx ? c[j] : mx;
        for (size_t j = 0; j < N; j++) c[j] = exp(c[j] - mx);
        double s = c[0];
        for (size_t j = 1; j < N; j++) s = s + c[j];
        for (size_t j = 0; j < N; j++) c[j] = c[j] / s + hc_eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0) /* rows (the first round: columns only) */
            for (size_t i = 0; i < N; i++) {
                double *c = comb + i * N, s = c[0];
                for (size_t j = 1; j < N; j++) s = s + c[j];
                s = s + hc_eps;
                for (size_t j = 0; j < N; j++) c[j] = c[j] / s;
            }
        for (size_t j = 0; j < N; j++) { /* columns */
            double s = comb[j];
            for (size_t i = 1; i < N; i++) s = s + comb[i * N + j];
            s = s + hc_eps;
            for (size_t i = 0; i < N; i++) comb[i * N + j] = comb[i * N + j] / s;
        }
    }
}

/* The per-element sums around the sublayer, elements c from c0 on (the vector versions below do
 * the ones before, 4 lanes of elements at a time, each lane these very steps). */
static void streams_sum_from(const float *x, size_t N, size_t hidden, const double *p, float *h, size_t c0) {
    for (size_t c = c0; c < hidden; c++) { /* sum_k pre[k] X[k], k in order */
        double s = p[0] * (double)x[c];
        for (size_t j = 1; j < N; j++) s = s + p[j] * (double)x[j * hidden + c];
        h[c] = (float)s;
    }
}

static void streams_mix_from(float *x, size_t N, size_t hidden, const float *y, const double *post,
                             const double *comb, size_t c0) {
    double mixed[64];
    for (size_t c = c0; c < hidden; c++) {
        /* X'[k] = sum_j C[j, k] X[j] (fused, j in order, from 0) + post[k] y */
        for (size_t kk = 0; kk < N; kk++) {
            double s = 0.0;
            for (size_t j = 0; j < N; j++) s = fma(comb[j * N + kk], (double)x[j * hidden + c], s);
            mixed[kk] = s + post[kk] * (double)y[c];
        }
        for (size_t kk = 0; kk < N; kk++) x[kk * hidden + c] = (float)mixed[kk];
    }
}

#ifdef DS4F_X86
T256 static size_t streams_sum_avx2(const float *x, size_t N, size_t hidden, const double *p, float *h) {
    size_t c = 0;
    for (; c + 4 <= hidden; c += 4) {
        __m256d s = _mm256_mul_pd(_mm256_set1_pd(p[0]), _mm256_cvtps_pd(_mm_loadu_ps(x + c)));
        for (size_t j = 1; j < N; j++)
            s = _mm256_add_pd(s, _mm256_mul_pd(_mm256_set1_pd(p[j]), _mm256_cvtps_pd(_mm_loadu_ps(x + j * hidden + c))));
        _mm_storeu_ps(h + c, _mm256_cvtpd_ps(s));
    }
    return c;
}

T256 static size_t streams_mix_avx2(float *x, size_t N, size_t hidden, const float *y, const double *post,
                                    const double *comb) {
    if (N > 16) return 0;
    size_t c = 0;
    for (; c + 4 <= hidden; c += 4) {
        __m256d xs[16], mixed[16];
        for (size_t j = 0; j < N; j++) xs[j] = _mm256_cvtps_pd(_mm_loadu_ps(x + j * hidden + c));
        const __m256d yv = _mm256_cvtps_pd(_mm_loadu_ps(y + c));
        for (size_t kk = 0; kk < N; kk++) {
            __m256d s = _mm256_setzero_pd();
            for (size_t j = 0; j < N; j++) s = _mm256_fmadd_pd(_mm256_set1_pd(comb[j * N + kk]), xs[j], s);
            mixed[kk] = _mm256_add_pd(s, _mm256_mul_pd(_mm256_set1_pd(post[kk]), yv));
        }
        for (size_t kk = 0; kk < N; kk++) _mm_storeu_ps(x + kk * hidden + c, _mm256_cvtpd_ps(mixed[kk]));
    }
    return c;
}
#endif

static void streams_sum(const float *x, size_t N, size_t hidden, const double *p, float *h) {
    size_t c0 = 0;
#ifdef DS4F_X86
    const int b = ds4f_get_backend();
    if (b == DS4F_AVX2 || b == DS4F_AVX512) c0 = streams_sum_avx2(x, N, hidden, p, h);
#endif
    streams_sum_from(x, N, hidden, p, h, c0);
}

static void streams_mix(float *x, size_t N, size_t hidden, const float *y, const double *post, const double *comb) {
    size_t c0 = 0;
#ifdef DS4F_X86
    const int b = ds4f_get_backend();
    if (b == DS4F_AVX2 || b == DS4F_AVX512) c0 = streams_mix_avx2(x, N, hidden, y, post, comb);
#endif
    streams_mix_from(x, N, hidden, y, post, comb, c0);
}

int ds4f_hc_pre(const float *x, size_t n, size_t N, size_t hidden, const float *fn_t, size_t rows,
                const float *base, const float *scale, double eps, double hc_eps, int iters, float *h, double *pre,
                double *post, double *comb, double *scratch) {
    if (!x || !fn_t || !base || !scale || !h || !pre || !scratch || N == 0 || N > 64 || hidden == 0 || iters < 1 ||
        (rows != N && (rows != (2 + N) * N || !post || !comb)))
        return -1;
    const size_t k = N * hidden;
    double *mix = scratch + ds4f_hc_mix_scratch_doubles(k, rows);
    if (ds4f_hc_mix(x, n, k, fn_t, rows, eps, mix, scratch) != 0) return -1;
    for (size_t t = 0; t < n; t++) {
        double *p = pre + t * N;
        hc_small(mix + t * rows, N, rows, base, scale, hc_eps, iters, p,
                 rows == N ? NULL : post + t * N, rows == N ? NULL : comb + t * N * N);
        streams_sum(x + t * k, N, hidden, p, h + t * hidden);
    }
    return 0;
}

int ds4f_hc_post(float *x, size_t n, size_t N, size_t hidden, const float *y, const double *post, const double *comb) {
    if (!x || !y || !post || !comb || N == 0 || N > 64 || hidden == 0) return -1;
    for (size_t t = 0; t < n; t++) streams_mix(x + t * N * hidden, N, hidden, y + t * hidden, post + t * N, comb + t * N * N);
    return 0;
}
