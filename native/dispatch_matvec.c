/* dispatch_matvec.c — backend detection and selection, and the public entry points.
 *
 * Backend: an atomic int read once at the start of every call (so a change from another thread
 * takes effect at the next call, never in the middle of one).  Initialised on first use from
 * DS4F_KERNELS=scalar|avx2|avx512|neon|auto (unknown or unsupported values mean auto).
 * x86 support = CPUID feature bits AND the OS saving the registers (OSXSAVE + XGETBV: XCR0 must
 * enable SSE|AVX state for AVX2, and also opmask|ZMM_Hi256|Hi16_ZMM for AVX-512).  AVX2 means
 * AVX2 + FMA + F16C (the FP8 kernels convert through fp16; every AVX2 CPU has F16C), AVX-512
 * means F/BW/VL/DQ on top of that.
 *
 * Work split: rows are cut into tasks of a multiple of 16 rows; every row is computed entirely
 * by one thread with the backend's fixed op sequence, so results do not depend on the thread
 * count.  experts_forward_each: per-expert outputs into the caller's rows; experts_forward: the
 * same into scratch, then summed in expert order 0..n-1.
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_internal.h"

#ifdef DS4F_X86
#include <cpuid.h>
#endif

/* ---- detection ---------------------------------------------------------------------------- */

static atomic_int supported_mask = -1; /* bit b set = backend b usable */

#ifdef DS4F_X86
static unsigned long long xgetbv0(void) {
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}
#endif

static int detect(void) {
    int mask = 1 << DS4F_SCALAR;
#ifdef DS4F_X86
    unsigned int a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
        if (osxsave && avx) {
            const unsigned long long xcr0 = xgetbv0();
            const int ymm_os = (xcr0 & 0x6) == 0x6;    /* SSE + AVX state */
            const int zmm_os = (xcr0 & 0xe6) == 0xe6;  /* + opmask, ZMM_Hi256, Hi16_ZMM */
            unsigned int a7, b7, c7, d7;
            if (__get_cpuid_count(7, 0, &a7, &b7, &c7, &d7)) {
                const int avx2 = (b7 >> 5) & 1;
                const int f = (b7 >> 16) & 1, dq = (b7 >> 17) & 1, bw = (b7 >> 30) & 1, vl = (b7 >> 31) & 1;
                if (ymm_os && avx2 && fma && f16c) mask |= 1 << DS4F_AVX2;
                if (ymm_os && zmm_os && avx2 && fma && f16c && f && dq && bw && vl) mask |= 1 << DS4F_AVX512;
            }
        }
    }
#endif
#ifdef DS4F_ARM64
    mask |= 1 << DS4F_NEON; /* Advanced SIMD is mandatory on AArch64 */
#endif
    return mask;
}

static int supported(void) {
    int m = atomic_load_explicit(&supported_mask, memory_order_relaxed);
    if (m < 0) {
        m = detect();
        atomic_store(&supported_mask, m);
    }
    return m;
}

int ds4f_backend_supported(int backend) {
    return backend >= 0 && backend < DS4F_N_BACKENDS && ((supported() >> backend) & 1);
}

int ds4f_best_backend(void) {
    static const int order[] = {DS4F_AVX512, DS4F_NEON, DS4F_AVX2};
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++)
        if (ds4f_backend_supported(order[i])) return order[i];
    return DS4F_SCALAR;
}

/* ---- selection ---------------------------------------------------------------------------- */

static atomic_int active = -1;

static const char *const names[DS4F_N_BACKENDS] = {"scalar", "avx2", "avx512", "neon"};

const char *ds4f_backend_name(int backend) {
    return backend >= 0 && backend < DS4F_N_BACKENDS ? names[backend] : NULL;
}

static int from_env(void) {
    const char *e = getenv("DS4F_KERNELS");
    if (e)
        for (int b = 0; b < DS4F_N_BACKENDS; b++)
            if (strcmp(e, names[b]) == 0 && ds4f_backend_supported(b)) return b;
    return ds4f_best_backend(); /* unset, "auto", unknown or unsupported */
}

int ds4f_get_backend(void) {
    int b = atomic_load(&active);
    if (b < 0) {
        int expected = -1;
        atomic_compare_exchange_strong(&active, &expected, from_env());
        b = atomic_load(&active);
    }
    return b;
}

int ds4f_set_backend(int backend) {
    if (!ds4f_backend_supported(backend)) return -1;
    atomic_store(&active, backend);
    return 0;
}

static const ds4f_ktable *table(int backend) {
    switch (backend) {
#ifdef DS4F_X86
    case DS4F_AVX2: return &ds4f_kt_avx2;
    case DS4F_AVX512: return &ds4f_kt_avx512;
#endif
#ifdef DS4F_ARM64
    case DS4F_NEON: return &ds4f_kt_neon;
#endif
    default: return &ds4f_kt_scalar;
    }
}

const ds4f_ktable *ds4f_ktable_of(int backend) { return table(backend); }

int ds4f_set_threads(int n) { return ds4f_pool_set_threads(n); }
int ds4f_get_threads(void) { return ds4f_pool_get_threads(); }
void ds4f_set_alone(int on) { ds4f_pool_set_alone(on); }
int ds4f_get_alone(void) { return ds4f_pool_get_alone(); }
unsigned long long ds4f_tasks_done(void) { return ds4f_pool_tasks_done(); }
unsigned long long ds4f_worker_tasks_done(void) { return ds4f_pool_worker_tasks_done(); }

/* ---- row-parallel kernels ------------------------------------------------------------------ */

#define ROW_ALIGN 16
#define MIN_TASK_WEIGHTS (1u << 16) /* below this, one thread does it all */

enum { K_DECODE, K_MATVEC, K_BF16, K_FP8_DECODE, K_FP8_MATVEC };

typedef struct {
    const ds4f_ktable *t;
    int kind; /* K_* */
    const void *w;
    const uint8_t *scales;
    size_t rows, k, chunk;
    const float *x;
    float *y;
} rows_job;

static void rows_task(void *ctx, size_t i) {
    const rows_job *j = ctx;
    const size_t r0 = i * j->chunk, r1 = r0 + j->chunk < j->rows ? r0 + j->chunk : j->rows;
    switch (j->kind) {
    case K_DECODE: j->t->decode(j->w, j->scales, r0, r1, j->k, j->y); break;
    case K_MATVEC: j->t->matvec(j->w, j->scales, r0, r1, j->k, j->x, j->y); break;
    case K_BF16: j->t->bf16(j->w, r0, r1, j->k, j->x, j->y); break;
    case K_FP8_DECODE: j->t->fp8_decode(j->w, j->scales, r0, r1, j->k, j->y); break;
    default: j->t->fp8_matvec(j->w, j->scales, r0, r1, j->k, j->x, j->y); break;
    }
}

static size_t round_up(size_t a, size_t m) { return (a + m - 1) / m * m; }

static void run_rows(rows_job *j) {
    if (j->rows == 0 || j->k == 0) return;
    const size_t nt = (size_t)ds4f_pool_get_threads();
    size_t ntasks = 1;
    if (nt > 1 && j->rows * j->k >= MIN_TASK_WEIGHTS) ntasks = 4 * nt; /* some slack for balance */
    j->chunk = round_up((j->rows + ntasks - 1) / ntasks, ROW_ALIGN);
    ds4f_pool_run(rows_task, j, (j->rows + j->chunk - 1) / j->chunk);
}

void ds4f_mxfp4_decode(const uint8_t *codes, const uint8_t *scales, size_t rows, size_t k, float *out) {
    rows_job j = {table(ds4f_get_backend()), K_DECODE, codes, scales, rows, k, 0, NULL, out};
    run_rows(&j);
}

void ds4f_mxfp4_matvec(const uint8_t *codes, const uint8_t *scales, size_t rows, size_t k,
                       const float *x, float *y) {
    rows_job j = {table(ds4f_get_backend()), K_MATVEC, codes, scales, rows, k, 0, x, y};
    run_rows(&j);
}

void ds4f_bf16_matvec(const uint16_t *w, size_t rows, size_t k, const float *x, float *y) {
    rows_job j = {table(ds4f_get_backend()), K_BF16, w, NULL, rows, k, 0, x, y};
    run_rows(&j);
}

void ds4f_fp8_decode(const uint8_t *w, const uint8_t *scales, size_t rows, size_t k, float *out) {
    rows_job j = {table(ds4f_get_backend()), K_FP8_DECODE, w, scales, rows, k, 0, NULL, out};
    run_rows(&j);
}

void ds4f_fp8_matvec(const uint8_t *w, const uint8_t *scales, size_t rows, size_t k, const float *x,
                     float *y) {
    rows_job j = {table(ds4f_get_backend()), K_FP8_MATVEC, w, scales, rows, k, 0, x, y};
    run_rows(&j);
}

/* ---- routed experts ------------------------------------------------------------------------ */

/* scratch: act[n][inter] | up[n][inter] | ye[n][hidden] (ye: experts_forward's per-expert rows;
 * experts_forward_each writes those to the caller's y_each and leaves this part alone) */
size_t ds4f_experts_scratch_floats(int n, size_t hidden, size_t inter) {
    if (n < 1 || n > DS4F_MAX_EXPERTS) return 0;
    return (size_t)n * (2 * inter + hidden);
}

typedef struct {
    const ds4f_ktable *t;
    const ds4f_expert *ex;
    size_t n, hidden, inter, rows1, rows2; /* rows per part in phase 1 (inter) and 2 (hidden) */
    const float *x;
    float limit;
    float *act, *up, *ye;
} experts_job;

/* Task i = expert i % n, part i / n: consecutive tasks go to different experts, so with as
 * many experts as threads the work is expert-parallel; parts split rows when threads > n. */
static void experts_phase1(void *ctx, size_t i) {
    const experts_job *j = ctx;
    const size_t e = i % j->n, r0 = (i / j->n) * j->rows1;
    const size_t r1 = r0 + j->rows1 < j->inter ? r0 + j->rows1 : j->inter;
    if (r0 >= r1) return;
    const ds4f_expert *x = &j->ex[e];
    float *g = j->act + e * j->inter, *u = j->up + e * j->inter;
    j->t->matvec(x->w1, x->s1, r0, r1, j->hidden, j->x, g);
    j->t->matvec(x->w3, x->s3, r0, r1, j->hidden, j->x, u);
    const float lim = j->limit, wt = x->weight;
    for (size_t r = r0; r < r1; r++) {
        float gate = g[r], up = u[r];
        if (gate > lim) gate = lim;
        if (up > lim) up = lim;
        if (up < -lim) up = -lim;
        g[r] = ds4f_silu(gate) * up * wt;
    }
}

static void experts_phase2(void *ctx, size_t i) {
    const experts_job *j = ctx;
    const size_t e = i % j->n, r0 = (i / j->n) * j->rows2;
    const size_t r1 = r0 + j->rows2 < j->hidden ? r0 + j->rows2 : j->hidden;
    if (r0 >= r1) return;
    const ds4f_expert *x = &j->ex[e];
    j->t->matvec(x->w2, x->s2, r0, r1, j->inter, j->act + e * j->inter, j->ye + e * j->hidden);
}

static int experts_args_ok(const ds4f_expert *ex, int n, const float *x, size_t hidden, size_t inter,
                           const float *y, const float *scratch) {
    if (!ex || !x || !y || !scratch || n < 1 || n > DS4F_MAX_EXPERTS || hidden == 0 || inter == 0 ||
        hidden % 32 || inter % 32)
        return 0;
    for (int e = 0; e < n; e++)
        if (!ex[e].w1 || !ex[e].s1 || !ex[e].w3 || !ex[e].s3 || !ex[e].w2 || !ex[e].s2) return 0;
    return 1;
}

int ds4f_experts_forward_each(const ds4f_expert *ex, int n, const float *x, size_t hidden, size_t inter,
                              float limit, float *y_each, float *scratch) {
    if (!experts_args_ok(ex, n, x, hidden, inter, y_each, scratch)) return -1;
    const size_t nt = (size_t)ds4f_pool_get_threads(), ne = (size_t)n;
    const size_t parts = nt <= 1 ? 1 : (2 * nt + ne - 1) / ne; /* >= 2 tasks per thread */
    experts_job j = {table(ds4f_get_backend()), ex, ne, hidden, inter,
                     round_up((inter + parts - 1) / parts, ROW_ALIGN),
                     round_up((hidden + parts - 1) / parts, ROW_ALIGN), x, limit,
                     scratch, scratch + ne * inter, y_each};
    const size_t p1 = (inter + j.rows1 - 1) / j.rows1, p2 = (hidden + j.rows2 - 1) / j.rows2;
    ds4f_pool_run(experts_phase1, &j, ne * p1);
    ds4f_pool_run(experts_phase2, &j, ne * p2);
    return 0;
}

/* the per-expert outputs in scratch's ye part, summed in expert order 0..n-1: deterministic */
int ds4f_experts_forward(const ds4f_expert *ex, int n, const float *x, size_t hidden, size_t inter,
                         float limit, float *y, float *scratch) {
    if (!experts_args_ok(ex, n, x, hidden, inter, y, scratch)) return -1;
    const size_t ne = (size_t)n;
    float *ye = scratch + 2 * ne * inter;
    if (ds4f_experts_forward_each(ex, n, x, hidden, inter, limit, ye, scratch) != 0) return -1;
    for (size_t h = 0; h < hidden; h++) {
        float s = ye[h];
        for (size_t e = 1; e < ne; e++) s += ye[e * hidden + h];
        y[h] = s;
    }
    return 0;
}
