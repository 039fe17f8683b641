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
 * One piece of C for every backend.  Rows are spread over the kernels' threads when there are
 * enough of them; a row is computed by one thread, so the bits do not depend on the thread count.
 */
#include <math.h>

#include "kernels_internal.h"

#define PW_BLOCKSIZE 128
#define POOL_ELEMS 32768 /* values from which the rows go to the pool (some 50 us on one thread) */
#define TASK_ELEMS 4096  /* values per task at least: small tasks, so a thread that starts late takes few */

static double square(const float *x, size_t i) {
    const double v = (double)x[i];
    return v * v;
}

/* numpy's pairwise_sum of the squares of x[0 .. n-1] */
static double pairwise_squares(const float *x, size_t n) {
    if (n < 8) {
        double res = 0.0;
        for (size_t i = 0; i < n; i++) res += square(x, i);
        return res;
    }
    if (n <= PW_BLOCKSIZE) {
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
    size_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_squares(x, n2) + pairwise_squares(x + n2, n - n2);
}

static void rms_row(const float *x, size_t d, double eps, const float *weight, float *out) {
    double ms = pairwise_squares(x, d);
    ms /= (double)d;
    ms += eps;
    ms = sqrt(ms);
    if (weight) {
        for (size_t j = 0; j < d; j++) {
            const float y = (float)((double)x[j] / ms);
            out[j] = y * weight[j];
        }
    } else {
        for (size_t j = 0; j < d; j++) out[j] = (float)((double)x[j] / ms);
    }
}

typedef struct {
    const float *x;
    size_t n, d, rows; /* rows per task */
    double eps;
    const float *weight;
    float *out;
} rms_job;

static void rms_task(void *ctx, size_t i) {
    const rms_job *j = ctx;
    const size_t r1 = (i + 1) * j->rows < j->n ? (i + 1) * j->rows : j->n;
    for (size_t r = i * j->rows; r < r1; r++) rms_row(j->x + r * j->d, j->d, j->eps, j->weight, j->out + r * j->d);
}

int ds4f_rms_rows(const float *x, size_t n, size_t d, double eps, const float *weight, float *out) {
    if (n == 0) return 0;
    if (!x || !out || d == 0) return -1;
    size_t tasks = n * d < POOL_ELEMS ? 1 : n * d / TASK_ELEMS;
    if (tasks > n) tasks = n;
    rms_job j = {x, n, d, (n + tasks - 1) / tasks, eps, weight, out};
    if (tasks == 1) {
        rms_task(&j, 0);
        return 0;
    }
    ds4f_pool_run(rms_task, &j, (n + j.rows - 1) / j.rows);
    return 0;
}
