/* membench.c — the limits a kernel can stand at (ds4f_membench.h): the memory floor, one
 * streaming read of a buffer per call with the load width of a backend, and the FMA peak, both
 * split across the kernels' pool.
 *
 * Each width has its own loop, selected per function with target attributes like the kernels
 * (no global -m flags): 64-bit scalar loads, 128-bit NEON, 256-bit AVX2, 512-bit AVX-512, four
 * independent accumulators so the adds never limit the loads.  Nothing but plain loads and
 * the hardware prefetchers: no software prefetch and no non-temporal hints, since the kernels
 * use none either, so the floor is what the kernels' own access pattern can get from RAM.
 * The buffer is cut into page-aligned chunks claimed by the pool's threads (ds4f_pool_run);
 * each chunk's word sum is added to one atomic total, and addition modulo 2^64 does not care
 * in which order, so every backend and thread count gives the same sum.
 */
#include <stdatomic.h>
#include <stdint.h>

#include "ds4f_membench.h"
#include "kernels_internal.h"

#ifdef DS4F_X86
#include <immintrin.h>
#endif
#ifdef DS4F_ARM64
#include <arm_neon.h>
#endif

typedef uint64_t (*sum_fn)(const uint64_t *p, size_t n); /* n words */

static uint64_t sum_scalar(const uint64_t *p, size_t n) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) { /* one 64-byte line per iteration */
        a0 += p[i] + p[i + 4];
        a1 += p[i + 1] + p[i + 5];
        a2 += p[i + 2] + p[i + 6];
        a3 += p[i + 3] + p[i + 7];
    }
    for (; i < n; i++) a0 += p[i];
    return a0 + a1 + a2 + a3;
}

#ifdef DS4F_X86
__attribute__((target("avx2"))) static uint64_t sum_avx2(const uint64_t *p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) { /* 128 bytes per iteration */
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + i + 4)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(p + i + 8)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(p + i + 12)));
    }
    const __m256i a = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    uint64_t s = (uint64_t)_mm_cvtsi128_si64(h) + (uint64_t)_mm_extract_epi64(h, 1);
    for (; i < n; i++) s += p[i];
    return s;
}

__attribute__((target("avx512f"))) static uint64_t sum_avx512(const uint64_t *p, size_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) { /* 256 bytes per iteration */
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512((const void *)(p + i)));
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512((const void *)(p + i + 8)));
        a2 = _mm512_add_epi64(a2, _mm512_loadu_si512((const void *)(p + i + 16)));
        a3 = _mm512_add_epi64(a3, _mm512_loadu_si512((const void *)(p + i + 24)));
    }
    uint64_t s = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1),
                                                                    _mm512_add_epi64(a2, a3)));
    for (; i < n; i++) s += p[i];
    return s;
}
#endif

#ifdef DS4F_ARM64
static uint64_t sum_neon(const uint64_t *p, size_t n) {
    uint64x2_t a0 = vdupq_n_u64(0), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) { /* 64 bytes per iteration */
        a0 = vaddq_u64(a0, vld1q_u64(p + i));
        a1 = vaddq_u64(a1, vld1q_u64(p + i + 2));
        a2 = vaddq_u64(a2, vld1q_u64(p + i + 4));
        a3 = vaddq_u64(a3, vld1q_u64(p + i + 6));
    }
    uint64_t s = vaddvq_u64(vaddq_u64(vaddq_u64(a0, a1), vaddq_u64(a2, a3)));
    for (; i < n; i++) s += p[i];
    return s;
}
#endif

#define CHUNK_ALIGN_WORDS (4096 / 8) /* chunks start on page boundaries of an aligned buffer */

typedef struct {
    sum_fn fn;
    const uint64_t *p;
    size_t words, chunk; /* in 64-bit words */
    _Atomic uint64_t total;
} read_job;

static void read_task(void *ctx, size_t i) {
    read_job *j = ctx;
    const size_t w0 = i * j->chunk, w1 = w0 + j->chunk < j->words ? w0 + j->chunk : j->words;
    atomic_fetch_add_explicit(&j->total, j->fn(j->p + w0, w1 - w0), memory_order_relaxed);
}

int ds4f_mem_read(const void *buf, size_t nbytes, int backend, uint64_t *sum) {
    if (!buf || !sum || ((uintptr_t)buf & 7) || (nbytes & 7) || !ds4f_backend_supported(backend)) return -1;
    sum_fn fn = sum_scalar;
    switch (backend) {
#ifdef DS4F_X86
    case DS4F_AVX2: fn = sum_avx2; break;
    case DS4F_AVX512: fn = sum_avx512; break;
#endif
#ifdef DS4F_ARM64
    case DS4F_NEON: fn = sum_neon; break;
#endif
    default: break;
    }
    read_job j = {fn, buf, nbytes / 8, 0, 0};
    if (j.words == 0) {
        *sum = 0;
        return 0;
    }
    /* as the kernels do: 4 tasks per thread, claimed dynamically, one task on one thread */
    const size_t nt = (size_t)ds4f_pool_get_threads(), ntasks = nt > 1 ? 4 * nt : 1;
    j.chunk = (j.words + ntasks - 1) / ntasks;
    j.chunk = (j.chunk + CHUNK_ALIGN_WORDS - 1) / CHUNK_ALIGN_WORDS * CHUNK_ALIGN_WORDS;
    ds4f_pool_run(read_task, &j, (j.words + j.chunk - 1) / j.chunk);
    *sum = atomic_load(&j.total);
    return 0;
}

/* ---- the FMA peak --------------------------------------------------------------------------
 *
 * How many multiply-add lanes per second a backend's vector unit retires: FMA_CHAINS independent
 * chains a = a * m + c of the backend's width (FMA latency 4-5 cycles x 2 FMA pipes needs at least
 * 10 chains in flight), nothing else in the loop.  The scalar backend, which never fuses, runs a
 * multiply and an add per lane, as its kernels do.  m = 1 - 2^-10 and c = 2^-10 keep every value
 * in [0.5, 1]: no overflow, no subnormals.  Split across the pool like the kernels. */
#define FMA_CHAINS 12

typedef double (*fma_fn)(size_t iters);

#define FMA_BODY(T, SET1, FMA, FIRST)                                                                  \
    const T m = SET1(1.0f - 0x1p-10f), c = SET1(0x1p-10f);                                           \
    T a0 = SET1(0.5f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0, \
      a10 = a0, a11 = a0;                                                                              \
    for (size_t i = 0; i < iters; i++) {                                                               \
        a0 = FMA(a0, m, c), a1 = FMA(a1, m, c), a2 = FMA(a2, m, c), a3 = FMA(a3, m, c);                \
        a4 = FMA(a4, m, c), a5 = FMA(a5, m, c), a6 = FMA(a6, m, c), a7 = FMA(a7, m, c);                \
        a8 = FMA(a8, m, c), a9 = FMA(a9, m, c), a10 = FMA(a10, m, c), a11 = FMA(a11, m, c);            \
    }                                                                                                  \
    return (double)FIRST(a0) + FIRST(a1) + FIRST(a2) + FIRST(a3) + FIRST(a4) + FIRST(a5) + FIRST(a6) +  \
           FIRST(a7) + FIRST(a8) + FIRST(a9) + FIRST(a10) + FIRST(a11);

static inline float scalar_set1(float v) { return v; }
static inline float scalar_madd(float a, float m, float c) { return a * m + c; } /* -ffp-contract=off: two ops */
static inline float scalar_first(float a) { return a; }
static double fma_scalar(size_t iters) { FMA_BODY(float, scalar_set1, scalar_madd, scalar_first) }

#ifdef DS4F_X86
#define F256 __attribute__((target("avx2,fma")))
static inline F256 __m256 avx2_set1(float v) { return _mm256_set1_ps(v); }
static inline F256 __m256 avx2_fma(__m256 a, __m256 m, __m256 c) { return _mm256_fmadd_ps(a, m, c); }
static inline F256 float avx2_first(__m256 a) { return _mm256_cvtss_f32(a); }
F256 static double fma_avx2(size_t iters) { FMA_BODY(__m256, avx2_set1, avx2_fma, avx2_first) }

#define F512 __attribute__((target("avx512f")))
static inline F512 __m512 avx512_set1(float v) { return _mm512_set1_ps(v); }
static inline F512 __m512 avx512_fma(__m512 a, __m512 m, __m512 c) { return _mm512_fmadd_ps(a, m, c); }
static inline F512 float avx512_first(__m512 a) { return _mm512_cvtss_f32(a); }
F512 static double fma_avx512(size_t iters) { FMA_BODY(__m512, avx512_set1, avx512_fma, avx512_first) }
#endif

#ifdef DS4F_ARM64
static inline float32x4_t neon_fma(float32x4_t a, float32x4_t m, float32x4_t c) { return vfmaq_f32(c, a, m); }
static inline float neon_first(float32x4_t a) { return vgetq_lane_f32(a, 0); }
static double fma_neon(size_t iters) { FMA_BODY(float32x4_t, vdupq_n_f32, neon_fma, neon_first) }
#endif

typedef struct {
    fma_fn fn;
    size_t iters;
    _Atomic long long sum; /* the chains' values x 2^20, so that the compiler keeps every FMA */
} fma_job;

static void fma_task(void *ctx, size_t i) {
    (void)i;
    fma_job *j = ctx;
    atomic_fetch_add_explicit(&j->sum, (long long)(j->fn(j->iters) * 1048576.0), memory_order_relaxed);
}

int ds4f_fma_lanes(int backend) {
    switch (backend) {
    case DS4F_SCALAR: return 1;
    case DS4F_AVX2: return 8;
    case DS4F_AVX512: return 16;
    case DS4F_NEON: return 4;
    default: return 0;
    }
}

long long ds4f_fma_peak(int backend, size_t iters, double *lanes) {
    if (!lanes || !ds4f_backend_supported(backend)) return -1;
    fma_fn fn = fma_scalar;
    switch (backend) {
#ifdef DS4F_X86
    case DS4F_AVX2: fn = fma_avx2; break;
    case DS4F_AVX512: fn = fma_avx512; break;
#endif
#ifdef DS4F_ARM64
    case DS4F_NEON: fn = fma_neon; break;
#endif
    default: break;
    }
    const size_t nt = (size_t)ds4f_pool_get_threads(), ntasks = nt > 1 ? 4 * nt : 1;
    fma_job j = {fn, iters, 0};
    ds4f_pool_run(fma_task, &j, ntasks);
    *lanes = (double)ntasks * (double)iters * FMA_CHAINS * ds4f_fma_lanes(backend);
    return atomic_load(&j.sum);
}
