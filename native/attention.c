/* attention.c — the attention core of a step's rows: logits over each row's keys, the softmax with
 * the head's sink, the weighted sum of the keys, with the queries' RoPE and the outputs' inverse RoPE
 * (engine/model/attention.py's docstring says what attention computes; ds4f_kernels.h's
 * ds4f_attention_rows what this file is given).
 *
 * Row t, head h, the row's keys K_0 .. K_{n-1} (fp32 rows of head_dim):
 *   q      = RoPE(q_t[h]) in fp32 (cos, sin given per row), widened to float64 exactly
 *   l_j    = (sum over d in order of q_d K_j[d]) * scale     each term exact (a product of two fp32
 *            values fits a float64), so the sum is the same bits as one fma per term from 0
 *   m      = the largest of sink_h and the l_j;  e_j = exp(l_j - m)   (ds4f_exp below)
 *   s      = (sum over j in order of e_j) + exp(sink_h - m);  p_j = e_j / s
 *   o[d]   = sum over j in order of p_j K_j[d], one fma per term from 0, rounded to fp32 once
 *   out    = the inverse RoPE of o in fp32
 * Every step is correctly rounded (exact products, fma, division) or, for exp, a fixed sequence of
 * them, so the scalar reference and the SIMD versions (each vector lane runs the scalar sequence of
 * one sum: heads in the lanes for the logits and the softmax, head_dim for the weighted sum) give the
 * same bits on every backend, and a row's bits are its own: whatever the other rows of the call, the
 * thread count, or how a prompt is cut into chunks.
 *
 * A task is one row and one group of up to GROUP heads, run by one thread; its float64 scratch
 * (the group's queries transposed, [head_dim][group], and the logits [keys][group]) is the thread's
 * own, kept between calls and grown when a call needs more.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_internal.h"

#ifdef DS4F_X86
#include <immintrin.h>
#define T256A __attribute__((target("avx2,fma")))
#define T512A __attribute__((target("avx512f,avx512dq,avx2,fma")))
#endif

#define GROUP 32 /* heads per task */
#define KB 4     /* keys per logits tile */

/* exp(x) for x <= 0 (and NaN): x = k ln2 + r, |r| <= ln2 / 2; exp(r) by its Taylor series to r^13
 * (Horner, one fma a step: the truncation is below 2^-57 relative); 2^k applied in two exact halves
 * so a subnormal result is rounded once. Below -746 the result is 0. A fixed sequence of correctly
 * rounded steps: the SIMD versions run it lane by lane. */
#define EXP_SHIFT 0x1.8p52
#define EXP_LOG2E 0x1.71547652b82fep0
#define EXP_LN2HI 0x1.62e42fefa39efp-1
#define EXP_LN2LO 0x1.abc9e3b39803fp-56
#define EXP_MIN (-746.0)
static const double exp_c[14] = {
    1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040, 1.0 / 40320, 1.0 / 362880,
    1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800.0};

static inline double pow2_of(double k) { /* 2^k for an integer k in -1022..1023, exactly */
    double t = k + (EXP_SHIFT + 1023.0);
    uint64_t b;
    memcpy(&b, &t, 8);
    b <<= 52;
    memcpy(&t, &b, 8);
    return t;
}

static double ds4f_exp(double x) {
    if (x < EXP_MIN) x = EXP_MIN;
    const double k = (x * EXP_LOG2E + EXP_SHIFT) - EXP_SHIFT;
    double r = fma(-k, EXP_LN2HI, x);
    r = fma(-k, EXP_LN2LO, r);
    double p = exp_c[13];
    for (int i = 12; i >= 0; i--) p = fma(p, r, exp_c[i]);
    const double k1 = floor(k * 0.5);
    return (p * pow2_of(k1)) * pow2_of(k - k1);
}

/* ---- one task's view of its row ------------------------------------------------------------------ */

typedef struct {
    const ds4f_attention_rows_args *a;
    size_t groups; /* head groups a row */
} job;

typedef struct {
    double *buf;
    size_t cap;
} scratch_t;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static void scratch_free(void *p) {
    scratch_t *s = p;
    free(s->buf);
    free(s);
}
static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }

/* this thread's scratch of at least n doubles, 64-byte aligned; NULL if out of memory */
static double *thread_scratch(size_t n) {
    pthread_once(&scratch_once, scratch_init);
    scratch_t *s = pthread_getspecific(scratch_key);
    if (!s) {
        s = calloc(1, sizeof *s);
        if (!s || pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (s->cap < n) {
        free(s->buf);
        s->cap = 0;
        s->buf = aligned_alloc(64, ((n * sizeof(double) + 63) / 64) * 64);
        if (!s->buf) return NULL;
        s->cap = n;
    }
    return s->buf;
}

/* fp32 RoPE of x's last 2 half dims (pairs 2i, 2i+1 of that slice), sign = -1: the inverse */
static void rope_f32(const float *x, float *y, size_t dim, size_t half, const float *cos, const float *sin, int inverse) {
    const size_t base = dim - 2 * half;
    if (y != x) memcpy(y, x, base * sizeof(float));
    for (size_t i = 0; i < half; i++) {
        const float c = cos[i], s = inverse ? -sin[i] : sin[i];
        const float e = x[base + 2 * i], o = x[base + 2 * i + 1];
        y[base + 2 * i] = e * c - o * s;
        y[base + 2 * i + 1] = o * c + e * s;
    }
}

static const float *key_row(const ds4f_attention_rows_args *a, size_t t, size_t j) {
    const size_t nw = (size_t)a->n_win[t], hd = a->head_dim;
    if (j < nw) return a->keys + ((size_t)a->win_first[t] + j) * hd;
    j -= nw;
    const float *rows = a->comp[a->part[t]];
    return rows + (a->sel_first && a->sel_first[t] >= 0 ? (size_t)a->sel[(size_t)a->sel_first[t] + j] : j) * hd;
}

/* ---- the scalar reference --------------------------------------------------------------------------
 * qt [hd][g] the group's roped queries, widened; lt [nk][g]; kp the key rows. */
static void logits_scalar(const double *qt, size_t g, size_t hd, const float *const *kp, size_t nk, double scale,
                          double *lt) {
    for (size_t j = 0; j < nk; j++)
        for (size_t h = 0; h < g; h++) {
            double acc = 0.0;
            for (size_t d = 0; d < hd; d++) acc += qt[d * g + h] * (double)kp[j][d]; /* exact products */
            lt[j * g + h] = acc * scale;
        }
}

static void softmax_scalar(double *lt, size_t g, size_t nk, const float *sinks) {
    for (size_t h = 0; h < g; h++) {
        double m = sinks[h];
        for (size_t j = 0; j < nk; j++)
            if (lt[j * g + h] > m) m = lt[j * g + h];
        double s = 0.0;
        for (size_t j = 0; j < nk; j++) {
            lt[j * g + h] = ds4f_exp(lt[j * g + h] - m);
            s += lt[j * g + h];
        }
        s += ds4f_exp((double)sinks[h] - m);
        for (size_t j = 0; j < nk; j++) lt[j * g + h] /= s;
    }
}

static void weighted_scalar(const double *pt, size_t g, size_t hd, const float *const *kp, size_t nk, float *out) {
    for (size_t h = 0; h < g; h++)
        for (size_t d = 0; d < hd; d++) {
            double acc = 0.0;
            for (size_t j = 0; j < nk; j++) acc = fma(pt[j * g + h], (double)kp[j][d], acc);
            out[h * hd + d] = (float)acc;
        }
}

/* ---- SIMD: the same sums, lanes = heads (logits, softmax) or head_dim (weighted sum) ------------------ */
#ifdef DS4F_X86
#define VL 8
#define VD __m512d
#define TGT T512A
#define V(name) name##_avx512
#define LOAD _mm512_load_pd
#define LOADU _mm512_loadu_pd
#define STORE _mm512_store_pd
#define STOREU _mm512_storeu_pd
#define SET1 _mm512_set1_pd
#define FMADD _mm512_fmadd_pd
#define ADD _mm512_add_pd
#define SUB _mm512_sub_pd
#define MUL _mm512_mul_pd
#define DIV _mm512_div_pd
#define ZERO _mm512_setzero_pd
#define CVTPS(p) _mm512_cvtps_pd(_mm256_loadu_ps(p))
#define CVT1(f) _mm512_set1_pd((double)(f))
#define FLOOR(x) _mm512_roundscale_pd(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define SHL52(x) _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_castpd_si512(x), 52))
#define NEG(x) _mm512_xor_pd(x, _mm512_set1_pd(-0.0))
#define STORE_F32(p, v) _mm256_storeu_ps(p, _mm512_cvtpd_ps(v))
#define GT_SELECT(a, b) _mm512_mask_blend_pd(_mm512_cmp_pd_mask(a, b, _CMP_GT_OQ), b, a) /* a > b ? a : b */
#define LT_CLAMP(x, c) _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x, c, _CMP_LT_OQ), x, c) /* x < c ? c : x */
#define HV 4 /* head vectors a logits tile */
#define DV 4 /* head_dim vectors a weighted-sum tile */
#include "attention_simd.h"
#undef VL
#undef VD
#undef TGT
#undef V
#undef LOAD
#undef LOADU
#undef STORE
#undef STOREU
#undef SET1
#undef FMADD
#undef ADD
#undef SUB
#undef MUL
#undef DIV
#undef ZERO
#undef CVTPS
#undef CVT1
#undef FLOOR
#undef SHL52
#undef NEG
#undef STORE_F32
#undef GT_SELECT
#undef LT_CLAMP
#undef HV
#undef DV

#define VL 4
#define VD __m256d
#define TGT T256A
#define V(name) name##_avx2
#define LOAD _mm256_load_pd
#define LOADU _mm256_loadu_pd
#define STORE _mm256_store_pd
#define STOREU _mm256_storeu_pd
#define SET1 _mm256_set1_pd
#define FMADD _mm256_fmadd_pd
#define ADD _mm256_add_pd
#define SUB _mm256_sub_pd
#define MUL _mm256_mul_pd
#define DIV _mm256_div_pd
#define ZERO _mm256_setzero_pd
#define CVTPS(p) _mm256_cvtps_pd(_mm_loadu_ps(p))
#define CVT1(f) _mm256_set1_pd((double)(f))
#define FLOOR(x) _mm256_round_pd(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define SHL52(x) _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(x), 52))
#define NEG(x) _mm256_xor_pd(x, _mm256_set1_pd(-0.0))
#define STORE_F32(p, v) _mm_storeu_ps(p, _mm256_cvtpd_ps(v))
#define GT_SELECT(a, b) _mm256_blendv_pd(b, a, _mm256_cmp_pd(a, b, _CMP_GT_OQ))
#define LT_CLAMP(x, c) _mm256_blendv_pd(x, c, _mm256_cmp_pd(x, c, _CMP_LT_OQ))
#define HV 2
#define DV 2
#include "attention_simd.h"
#endif

/* ---- a task ------------------------------------------------------------------------------------- */

static void task(void *ctx, size_t i) {
    const job *jb = ctx;
    const ds4f_attention_rows_args *a = jb->a;
    const size_t t = i / jb->groups, h0 = (i % jb->groups) * GROUP;
    const size_t H = a->heads, hd = a->head_dim, g = H - h0 < GROUP ? H - h0 : GROUP;
    const size_t nk = (size_t)a->n_win[t] + (size_t)a->n_comp[t];
    const size_t need = hd * GROUP + (nk + 1) * GROUP + nk + KB * hd + hd;
    double *sc = thread_scratch(need);
    float *out = a->out + (t * H + h0) * hd;
    if (!sc) { /* out of memory: NaN rows, which the forward pass's finite check reports */
        for (size_t x = 0; x < g * hd; x++) out[x] = NAN;
        return;
    }
    double *qt = sc, *lt = qt + hd * GROUP, *kbuf = lt + (nk + 1) * GROUP;
    const float **kp = (const float **)(kbuf + KB * hd);
    float *qr = (float *)(kp + nk + 1); /* hd floats: one head's roped query */
    const float *cos = a->cos + t * a->rope_half, *sin = a->sin + t * a->rope_half;
    for (size_t h = 0; h < g; h++) {
        rope_f32(a->q + (t * H + h0 + h) * hd, qr, hd, a->rope_half, cos, sin, 0);
        for (size_t d = 0; d < hd; d++) qt[d * g + h] = (double)qr[d];
    }
    for (size_t j = 0; j < nk; j++) kp[j] = key_row(a, t, j);
    const float *sinks = a->sinks + h0;
    const int b = ds4f_get_backend();
#ifdef DS4F_X86
    if (b == DS4F_AVX512 && g % 8 == 0) {
        logits_avx512(qt, g, hd, kp, nk, a->scale, lt, kbuf);
        softmax_avx512(lt, g, nk, sinks);
    } else if ((b == DS4F_AVX2 || b == DS4F_AVX512) && g % 4 == 0) {
        logits_avx2(qt, g, hd, kp, nk, a->scale, lt, kbuf);
        softmax_avx2(lt, g, nk, sinks);
    } else
#endif
    {
        logits_scalar(qt, g, hd, kp, nk, a->scale, lt);
        softmax_scalar(lt, g, nk, sinks);
    }
#ifdef DS4F_X86
    if (b == DS4F_AVX512 && hd % 8 == 0)
        weighted_avx512(lt, g, hd, kp, nk, out);
    else if ((b == DS4F_AVX2 || b == DS4F_AVX512) && hd % 4 == 0)
        weighted_avx2(lt, g, hd, kp, nk, out);
    else
#endif
        weighted_scalar(lt, g, hd, kp, nk, out);
    for (size_t h = 0; h < g; h++) rope_f32(out + h * hd, out + h * hd, hd, a->rope_half, cos, sin, 1);
}

int ds4f_attention_rows(const ds4f_attention_rows_args *a) {
    if (!a || !a->q || !a->cos || !a->sin || !a->sinks || !a->out || !a->n_win || !a->win_first || !a->n_comp)
        return -1;
    if (a->heads == 0 || a->head_dim == 0 || 2 * a->rope_half > a->head_dim) return -1;
    for (size_t t = 0; t < a->n; t++) {
        const int64_t nw = a->n_win[t], nc = a->n_comp[t];
        if (nw < 0 || nc < 0 || nw + nc == 0) return -2;
        if (nw > 0 && (!a->keys || a->win_first[t] < 0 || a->win_first[t] + nw > (int64_t)a->n_keys)) return -3;
        if (nc == 0) continue;
        if (!a->comp || !a->part || !a->comp_rows || a->part[t] < 0 || (size_t)a->part[t] >= a->n_parts ||
            !a->comp[a->part[t]])
            return -4;
        const int64_t held = a->comp_rows[a->part[t]];
        if (a->sel_first && a->sel_first[t] >= 0) {
            const int64_t f = a->sel_first[t];
            if (!a->sel || f + nc > (int64_t)a->n_sel) return -5;
            for (int64_t i = f; i < f + nc; i++)
                if (a->sel[i] < 0 || a->sel[i] >= held) return -6;
        } else if (nc > held) {
            return -7;
        }
    }
    job jb = {a, (a->heads + GROUP - 1) / GROUP};
    ds4f_pool_run(task, &jb, a->n * jb.groups);
    return 0;
}
