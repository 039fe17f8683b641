/* kernels_internal.h — what the backends, the dispatcher and the thread pool share.
 * Not part of the public API (that is ds4f_kernels.h).
 *
 * Every backend implements the same five row-range kernels (MXFP4 decode and matvec, bf16
 * matvec, FP8 decode and matvec).  Rows r0..r1 of the matrix are processed; pointers are to the
 * whole matrix / vector, so out/y are indexed by absolute row (and an FP8 row finds its scale
 * tiles from its absolute index).  A row's arithmetic never depends on which other rows are
 * processed in the same call, so the dispatcher may split rows among threads however it likes
 * without changing a single bit.
 */
#ifndef DS4F_KERNELS_INTERNAL_H
#define DS4F_KERNELS_INTERNAL_H
#include "ds4f_kernels.h"

typedef void (*ds4f_decode_fn)(const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1,
                               size_t k, float *out);
typedef void (*ds4f_matvec_fn)(const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1,
                               size_t k, const float *x, float *y);
typedef void (*ds4f_bf16_fn)(const uint16_t *w, size_t r0, size_t r1, size_t k, const float *x,
                             float *y);

typedef struct {
    const char *name;
    ds4f_decode_fn decode;     /* MXFP4: codes, scales as in ds4f_kernels.h */
    ds4f_matvec_fn matvec;
    ds4f_bf16_fn bf16;
    ds4f_decode_fn fp8_decode; /* FP8: codes = the E4M3 bytes, scales = the 128x128 tiles */
    ds4f_matvec_fn fp8_matvec;
} ds4f_ktable;

/* MXFP4 matvec over 4-row groups: prefetch the next group while this one computes, its codes
 * (4 rows x k/2 bytes: one 64-byte line per 32-weight block b of the current group) and scales
 * (4 x k/32 bytes). The hardware prefetchers stop at page boundaries and do not run far enough
 * ahead on a matrix streamed from RAM: on cold experts (AVX-512, 1 thread, huge pages) this
 * took ~13 to ~22 G weights/s, with no loss on cached ones. A prefetch never faults and never
 * changes a result. */
#define MXFP4_PREFETCH(c0, s0, kb, ks, b)                                            \
    do {                                                                             \
        __builtin_prefetch((c0) + 4 * (kb) + 64 * (b), 0, 3);                        \
        if (64 * (b) < 4 * (ks)) __builtin_prefetch((s0) + 4 * (ks) + 64 * (b), 0, 3); \
    } while (0)

/* scalar/matvec.c: the reference semantics and the shared tables */
extern const float ds4f_e2m1[16];       /* E2M1 code -> value, code 8 is -0.0 */
/* A byte -> fp32 table as a union of bit patterns, so it is a compile-time constant whatever
 * the compiler's float parsing. */
typedef union {
    uint32_t u[256];
    float f[256];
} ds4f_byte_table;
typedef ds4f_byte_table ds4f_e8m0_table;
/* E8M0 byte -> 2^(b-127) as an exact fp32: 0 -> 2^-127 (subnormal), 255 -> NaN. */
extern const ds4f_byte_table ds4f_e8m0;
#define DS4F_SCALE(b) (ds4f_e8m0.f[(b)])
/* E4M3 byte -> its exact fp32 value; the NaN codes 0x7F and 0xFF -> the quiet NaN 0x7fc00000,
 * the same bits as DS4F_SCALE(255), so a decoded NaN is those bits whichever operand of the
 * multiply it came from. */
extern const ds4f_byte_table ds4f_e4m3;
#define DS4F_QNAN_BITS 0x7fc00000u
/* The SIMD FP8 kernels widen E4M3 through fp16, which leaves each value 2^8 too small, and scale
 * a tile's partial sum by 2^(b-119) = 2^(b-127) * 2^8 in one multiply: exact in fp32 while it
 * fits (b <= 246, and b = 255, the NaN); for b = 247..254 by 2^8 first, then by 2^(b-127). */
static inline int ds4f_fp8_factor_fits(uint8_t b) { return b < 247 || b == 255; }
static inline float ds4f_fp8_factor(uint8_t b) { return DS4F_SCALE(b == 255 ? 255 : b + 8); }
float ds4f_silu(float g);               /* g / (1 + expf(-g)); the same code for every backend */
extern const ds4f_ktable ds4f_kt_scalar;

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define DS4F_X86 1
extern const ds4f_ktable ds4f_kt_avx2;   /* x86/avx2_matvec.c */
extern const ds4f_ktable ds4f_kt_avx512; /* x86/avx512_matvec.c */
#endif
#if defined(__aarch64__) || defined(_M_ARM64)
#define DS4F_ARM64 1
extern const ds4f_ktable ds4f_kt_neon;   /* arm/neon_matvec.c */
#endif

/* ---- multi-token kernels (*_matmul.c, dispatched by dispatch_matmul.c) ---------------------------
 *
 * A multi-token kernel applies rows r0..r1 of one matrix to nt input vectors at once: vector t is
 * the prepared row xp + t*ldx, and row r's result for it goes to y[t*ldy + r].  Each block of
 * weights is decoded once (into a small L1 tile) and then applied to every vector, yet for every
 * (t, r) the arithmetic is exactly that of the same backend's single-vector kernel on vector t:
 * the same decoded weights times the same x elements, accumulated by the same instruction into
 * the same lanes in the same order, and reduced by the same code.  So y[t*ldy + r] equals the
 * single-vector y[r] for x = vector t bit for bit, whatever nt, the row split or the thread count.
 *
 * "Prepared" = x in the lane order the backend's kernel reads (prep), zero-padded to a multiple
 * of xpad floats; prep NULL means natural order.  A prep works block by block (32 floats for
 * MXFP4 and bf16), so a slice of a row that starts at a multiple of 32 can be prepared alone. */
/* the kinds: DS4F_MM_MXFP4, DS4F_MM_BF16, DS4F_MM_FP8 (ds4f_kernels.h) */
#define DS4F_MM_XPAD_MAX 64 /* the largest xpad of any backend: scratch is sized with it */

typedef void (*ds4f_mm_fn)(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k,
                           size_t nt, const float *xp, size_t ldx, float *y, size_t ldy);
typedef void (*ds4f_prep_fn)(const float *x, size_t k, float *xp); /* one row (or block-aligned slice) */

typedef struct {
    ds4f_mm_fn mm[DS4F_MM_KINDS];     /* MXFP4 (w = codes), bf16 (w = uint16, scales unused), FP8 */
    ds4f_prep_fn prep[DS4F_MM_KINDS]; /* NULL: natural order */
    size_t xpad[DS4F_MM_KINDS];       /* 1, or the multiple a prepared row is zero-padded to */
} ds4f_mtable;

extern const ds4f_mtable ds4f_mt_scalar; /* scalar/matmul.c */
#ifdef DS4F_X86
extern const ds4f_mtable ds4f_mt_avx2;   /* x86/avx2_matmul.c */
extern const ds4f_mtable ds4f_mt_avx512; /* x86/avx512_matmul.c */
#endif
#ifdef DS4F_ARM64
extern const ds4f_mtable ds4f_mt_neon;   /* arm/neon_matmul.c */
#endif
const ds4f_ktable *ds4f_ktable_of(int backend);  /* dispatch_matvec.c */
const ds4f_mtable *ds4f_mtable_of(int backend);  /* dispatch_matmul.c */

/* A bf16 value (its 16 bits) widened to fp32: exact, the high half of the float's bits. */
static inline float bf16_to_f32(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } v = {(uint32_t)h << 16};
    return v.f;
}

/* The tokens a multi-token kernel keeps accumulators for at a time (its stack tile); more tokens
 * are taken in blocks of this many, each block decoding the weights again (from L1/L2). */
#define DS4F_MM_TB 32

/* threadpool.c: a persistent pool; the caller takes part.  Jobs are serialised (one at a time,
 * whatever the number of calling threads); tasks are claimed dynamically, so a task must give
 * the same result whichever thread runs it. */
typedef void (*ds4f_task_fn)(void *ctx, size_t task);
void ds4f_pool_run(ds4f_task_fn fn, void *ctx, size_t ntasks);
int ds4f_pool_get_threads(void);
int ds4f_pool_set_threads(int n);
void ds4f_pool_set_alone(int on); /* per calling thread: its jobs run all their tasks on it, pool untouched */
int ds4f_pool_get_alone(void);
unsigned long long ds4f_pool_tasks_done(void);
unsigned long long ds4f_pool_worker_tasks_done(void);

#endif
