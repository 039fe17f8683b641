/* norms.c — per-row RMS norms with numpy's bits (engine/model/attention.py's rms_rows).
 *
 * Row r of x [n][d] (fp32), widened to float64 exactly:
 *   ss  = the sum of the squares x_j * x_j in numpy's pairwise order (below)
 *   ms  = sqrt(ss / d + eps)
 *   out = (float)(x_j / ms)                   rounded to fp32 once
 *   with a weight: out = (float)(x_j / ms) * weight_j in fp32
 * numpy's np.add.reduce(np.square(x64), axis=-1) sums a contiguous row with pairwise_sum
 * (numpy/_core/src/umath/loops_utils.h.src): fewer than 8 terms one after another from 0; up to
 * PW_BLOCKSIZE terms in eight running sums r[0..7] over i += 8, joined as ((r0 + r1) + (r2 + r3)) +
 * ((r4 + r5) + (r6 + r7)), then the terms past the last multiple of 8 one after another; more terms:
 * the two halves at n2 = n / 2 rounded down to a multiple of 8, each summed the same way, added.
 * Every step here is that step, correctly rounded (a square of a widened fp32 value is exact, so it
 * cannot be fused into a sum either way; the build has no FP contraction and no reassociation), so
 * the result is numpy's bits; tests/native/test_rms_rows.py holds it to the installed numpy's
 * expression, with inputs that make the sum's last bits show in the fp32 result (they seldom do: a
 * last-place change in the sum flips a float's rounding for about one value in 2^29).
 * The scalar code below is the reference.  The AVX2 and AVX-512 versions do the same steps with
 * the same operands: a block's eight running sums r[0..7] are one __m512d (two __m256d), each step
 * r = r + v * v a multiply then an add (not fused: the targets below leave out FMA where they can,
 * and the build does not contract), the fp32 -> float64 widening exact, the eight joined in the
 * same order, the terms past the last multiple of 8 added one after another as in the scalar code;
 * then x / ms a float64 division and a rounding to fp32 per lane (both correctly rounded, to
 * nearest even, as the scalar (float)(x / ms)), and the weight an fp32 multiply.  NEON runs the
 * scalar code.  Rows are spread over the kernels' threads when there are enough of them; a row is
 * computed by one thread, so the bits depend on neither the thread count nor the backend.
 */
#include <math.h>

#include "kernels_internal.h"

#ifdef DS4F_X86
#include <immintrin.h>
#define T256 __attribute__((target("avx2")))                /* no "fma": nothing to fuse into */
#define T512 __attribute__((target("avx512f,avx512vl,avx2")))
#endif

#define PW_BLOCKSIZE 128
#define POOL_ELEMS 32768 /* values from which the rows go to the pool (some 50 us on one thread) */
#define TASK_ELEMS 4096  /* values per task at least: small tasks, so a thread that starts late takes few */

static double square(const float *x, size_t i) {
    const double v = (double)x[i];
    return v * v;
}

/* numpy's pairwise_sum of the squares of x[0 .. n-1], a block of 8 <= n <= PW_BLOCKSIZE values
 * summed by `block` (eight running sums, joined as below; the backends' do the same in vectors) */
typedef double (*block_fn)(const float *x, size_t n);

static double pairwise_squares(block_fn block, const float *x, size_t n) {
    if (n < 8) {
        double res = 0.0;
        for (size_t i = 0; i < n; i++) res += square(x, i);
        return res;
    }
    if (n <= PW_BLOCKSIZE) return block(x, n);
    size_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_squares(block, x, n2) + pairwise_squares(block, x + n2, n - n2);
}

static double block_scalar(const float *x, size_t n) {
    double r0 = square(x, 0), r1 = square(x, 1), r2 = square(x, 2), r3 = square(x, 3);
    double r4 = square(x, 4), r5 = square(x, 5), r6 = square(x, 6), r7 = square(x, 7);
    size_t i;
    for (i = 8; i < n - n % 8; i += 8) {
        r0 += square(x, i);
        r1 += square(x, i + 1);
        r2 += square(x, i + 2);
        r3 += square(x, i + 3);
        r4 += square(x, i + 4);
        r5 += square(x, i + 5);
        r6 += square(x, i + 6);
        r7 += square(x, i + 7);
    }
    double res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7));
    for (; i < n; i++) res += square(x, i);
    return res;
}

/* the row's root mean square, + eps, as numpy computes it from the pairwise sum */
static double row_rms(block_fn block, const float *x, size_t d, double eps) {
    double ms = pairwise_squares(block, x, d);
    ms /= (double)d;
    ms += eps;
    return sqrt(ms);
}

/* out[j0 .. d-1]: x / rms rounded to fp32, times the weight in fp32 */
static void scale_scalar(const float *x, size_t j0, size_t d, double rms, const float *weight, float *out) {
    for (size_t j = j0; j < d; j++) {
        const float y = (float)((double)x[j] / rms);
        out[j] = weight ? y * weight[j] : y;
    }
}

typedef void (*rms_row_fn)(const float *x, size_t d, double eps, const float *weight, float *out);

static void rms_row(const float *x, size_t d, double eps, const float *weight, float *out) {
    scale_scalar(x, 0, d, row_rms(block_scalar, x, d, eps), weight, out);
}

#ifdef DS4F_X86
/* ---- AVX2: r[0..3] and r[4..7] in two vectors ---- */

/* ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)): hadd gives (r0+r1, r4+r5, r2+r3, r6+r7) */
T256 static double join8_avx2(__m256d lo, __m256d hi) {
    const __m256d p = _mm256_hadd_pd(lo, hi);
    const __m128d q = _mm_add_pd(_mm256_castpd256_pd128(p), _mm256_extractf128_pd(p, 1));
    return _mm_cvtsd_f64(_mm_add_sd(q, _mm_unpackhi_pd(q, q)));
}

T256 static double block_avx2(const float *x, size_t n) {
    __m256d v0 = _mm256_cvtps_pd(_mm_loadu_ps(x)), v1 = _mm256_cvtps_pd(_mm_loadu_ps(x + 4));
    __m256d r0 = _mm256_mul_pd(v0, v0), r1 = _mm256_mul_pd(v1, v1);
    size_t i;
    for (i = 8; i < n - n % 8; i += 8) {
        v0 = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
        v1 = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
        r0 = _mm256_add_pd(r0, _mm256_mul_pd(v0, v0));
        r1 = _mm256_add_pd(r1, _mm256_mul_pd(v1, v1));
    }
    double res = join8_avx2(r0, r1);
    for (; i < n; i++) res += square(x, i);
    return res;
}

T256 static void rms_row_avx2(const float *x, size_t d, double eps, const float *weight, float *out) {
    const double rms = row_rms(block_avx2, x, d, eps);
    const __m256d m = _mm256_set1_pd(rms);
    size_t j = 0;
    for (; j + 4 <= d; j += 4) {
        __m128 y = _mm256_cvtpd_ps(_mm256_div_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + j)), m));
        if (weight) y = _mm_mul_ps(y, _mm_loadu_ps(weight + j));
        _mm_storeu_ps(out + j, y);
    }
    scale_scalar(x, j, d, rms, weight, out);
}

/* ---- AVX-512: r[0..7] in one vector ---- */

T512 static double block_avx512(const float *x, size_t n) {
    __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x));
    __m512d r = _mm512_mul_pd(v, v);
    size_t i;
    for (i = 8; i < n - n % 8; i += 8) {
        v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
        r = _mm512_add_pd(r, _mm512_mul_pd(v, v));
    }
    double res = join8_avx2(_mm512_castpd512_pd256(r), _mm512_extractf64x4_pd(r, 1));
    for (; i < n; i++) res += square(x, i);
    return res;
}

T512 static void rms_row_avx512(const float *x, size_t d, double eps, const float *weight, float *out) {
    const double rms = row_rms(block_avx512, x, d, eps);
    const __m512d m = _mm512_set1_pd(rms);
    size_t j = 0;
    for (; j + 8 <= d; j += 8) {
        __m256 y = _mm512_cvtpd_ps(_mm512_div_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + j)), m));
        if (weight) y = _mm256_mul_ps(y, _mm256_loadu_ps(weight + j));
        _mm256_storeu_ps(out + j, y);
    }
    scale_scalar(x, j, d, rms, weight, out);
}
#endif

typedef struct {
    rms_row_fn row; /* the backend's */
    const float *x;
    size_t n, d, rows; /* rows per task */
    double eps;
    const float *weight;
    float *out;
} rms_job;

static void rms_task(void *ctx, size_t i) {
    const rms_job *j = ctx;
    const size_t r1 = (i + 1) * j->rows < j->n ? (i + 1) * j->rows : j->n;
    for (size_t r = i * j->rows; r < r1; r++) j->row(j->x + r * j->d, j->d, j->eps, j->weight, j->out + r * j->d);
}

int ds4f_rms_rows(const float *x, size_t n, size_t d, double eps, const float *weight, float *out) {
    if (n == 0) return 0;
    if (!x || !out || d == 0) return -1;
    size_t tasks = n * d < POOL_ELEMS ? 1 : n * d / TASK_ELEMS;
    if (tasks > n) tasks = n;
    rms_row_fn row = rms_row;
#ifdef DS4F_X86
    const int b = ds4f_get_backend();
    if (b == DS4F_AVX512) row = rms_row_avx512;
    else if (b == DS4F_AVX2) row = rms_row_avx2;
#endif
    rms_job j = {row, x, n, d, (n + tasks - 1) / tasks, eps, weight, out};
    if (tasks == 1) {
        rms_task(&j, 0);
        return 0;
    }
    ds4f_pool_run(rms_task, &j, (n + j.rows - 1) / j.rows);
    return 0;
}
