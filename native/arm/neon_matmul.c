/* arm/neon_matmul.c — NEON multi-token kernels (contract: kernels_internal.h; structure: see
 * x86/avx512_matmul.c).
 *
 * x in natural order (NEON's single-vector kernels read it so); FP8 rows are zero-padded to a
 * multiple of 16 (done by the dispatcher).  4 rows at a time, k in chunks decoded once into an
 * L1 tile with kernels_neon.h's steps, then every token runs over the tile: MXFP4 / bf16 per
 * 32-block 8 vectors of 4, the even ones into the row's accumulator a and the odd ones into b
 * (matvec_rows' order); FP8 per 16-chunk 4 vectors into the tile partial, then fp8_tile_add, two
 * tokens at a time.
 */
#include "kernels_neon.h"

#ifdef DS4F_ARM64

#define MM_R 4   /* rows decoded together */
#define MM_KC 8  /* MXFP4 / bf16: 32-element blocks per chunk */
#define FP8_KT 2 /* FP8: 128-element tiles per chunk */

/* ---- MXFP4 and bf16 ----------------------------------------------------------------------- */

INL void n_decode(int kind, const void *w, const uint8_t *scales, size_t r, int R, size_t k, size_t b0, size_t nb,
                  float *wb) {
    const size_t kb = k / 2, ks = k / 32;
    const uint8x16_t thi = vld1q_u8(BF16_HI), tlo = vld1q_u8(BF16_LO);
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
        for (size_t b = 0; b < nb; b++) {
            float32x4_t v[8];
            if (kind == DS4F_MM_MXFP4)
                decode_block((const uint8_t *)w + (r + i) * kb + 16 * (b0 + b), scales[(r + i) * ks + b0 + b], thi, tlo, v);
            else
                bf16_widen32((const uint16_t *)w + (r + i) * k + 32 * (b0 + b), v);
            for (int m = 0; m < 8; m++) vst1q_f32(wb + (b * R + i) * 32 + 4 * m, v[m]);
        }
    }
}

INL void n_rows(int kind, const void *w, const uint8_t *scales, size_t r, int R, size_t k, size_t nt,
                const float *xp, size_t ldx, float *y, size_t ldy) {
    const size_t ks = k / 32;
    float wb[MM_R * MM_KC * 32] __attribute__((aligned(16)));
    float32x4_t accm[DS4F_MM_TB][MM_R][2];
    for (size_t t0 = 0; t0 < nt; t0 += DS4F_MM_TB) {
        const size_t tn = nt - t0 < DS4F_MM_TB ? nt - t0 : DS4F_MM_TB;
        for (size_t c = 0; c < ks; c += MM_KC) {
            const size_t nb = ks - c < MM_KC ? ks - c : MM_KC;
            const int first = c == 0, last = c + nb == ks;
            n_decode(kind, w, scales, r, R, k, c, nb, wb);
            for (size_t t = 0; t < tn; t++) {
                float32x4_t a[MM_R], bb[MM_R];
                _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                    a[i] = first ? vdupq_n_f32(0.0f) : accm[t][i][0];
                    bb[i] = first ? vdupq_n_f32(0.0f) : accm[t][i][1];
                }
                const float *xr = xp + (t0 + t) * ldx + 32 * c;
                for (size_t b = 0; b < nb; b++) {
                    float32x4_t xv[8];
                    for (int m = 0; m < 8; m++) xv[m] = vld1q_f32(xr + 32 * b + 4 * m);
                    const float *wr = wb + b * R * 32;
                    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                        for (int m = 0; m < 8; m += 2) {
                            a[i] = vfmaq_f32(a[i], vld1q_f32(wr + 32 * i + 4 * m), xv[m]);
                            bb[i] = vfmaq_f32(bb[i], vld1q_f32(wr + 32 * i + 4 * m + 4), xv[m + 1]);
                        }
                    }
                }
                _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                    if (last) {
                        y[(t0 + t) * ldy + r + i] = finish(a[i], bb[i]);
                    } else {
                        accm[t][i][0] = a[i];
                        accm[t][i][1] = bb[i];
                    }
                }
            }
        }
    }
}

static void mxfp4_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                     const float *xp, size_t ldx, float *y, size_t ldy) {
    size_t r = r0;
    for (; r + MM_R <= r1; r += MM_R) n_rows(DS4F_MM_MXFP4, w, scales, r, MM_R, k, nt, xp, ldx, y, ldy);
    for (; r < r1; r++) n_rows(DS4F_MM_MXFP4, w, scales, r, 1, k, nt, xp, ldx, y, ldy);
}

static void bf16_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                    const float *xp, size_t ldx, float *y, size_t ldy) {
    size_t r = r0;
    for (; r + MM_R <= r1; r += MM_R) n_rows(DS4F_MM_BF16, w, scales, r, MM_R, k, nt, xp, ldx, y, ldy);
    for (; r < r1; r++) n_rows(DS4F_MM_BF16, w, scales, r, 1, k, nt, xp, ldx, y, ldy);
}

/* ---- FP8 ---------------------------------------------------------------------------------- */

/* 16-chunks in the tile starting at element j0: 8, or fewer for a ragged last tile */
static inline size_t fp8_chunks(size_t j0, size_t k) {
    const size_t n = k - j0 < DS4F_FP8_TILE ? k - j0 : DS4F_FP8_TILE;
    return (n + 15) / 16;
}

INL void fp8_decode(const uint8_t *w, size_t r, int R, size_t k, size_t t0, size_t ntl, float *wb, uint8x16_t *nan) {
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
        const uint8_t *wr = w + (r + i) * k;
        for (size_t tt = 0; tt < ntl; tt++) {
            const size_t j0 = (t0 + tt) * DS4F_FP8_TILE, nq = fp8_chunks(j0, k);
            for (size_t q = 0; q < nq; q++) {
                const size_t j = j0 + 16 * q;
                const uint8x16_t v = j + 16 <= k ? vld1q_u8(wr + j) : fp8_load_tail(wr + j, k - j);
                nan[i] = fp8_nan_max(nan[i], v);
                float32x4_t f[4];
                fp8_widen16(v, f);
                float *o = wb + ((tt * 8 + q) * R + i) * 16;
                for (int m = 0; m < 4; m++) vst1q_f32(o + 4 * m, f[m]);
            }
        }
    }
}

INL void fp8_tokens(int NT, int R, const float *wb, const uint8_t *const *sr, size_t t0, size_t ntl, size_t k,
                    const float *const *xr, float32x4_t acc[2][MM_R]) {
    for (size_t tt = 0; tt < ntl; tt++) {
        const size_t j0 = (t0 + tt) * DS4F_FP8_TILE, nq = fp8_chunks(j0, k);
        float32x4_t p[2][MM_R];
        _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++)
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) p[n][i] = vdupq_n_f32(0.0f);
        for (size_t q = 0; q < nq; q++) {
            const float *wq = wb + (tt * 8 + q) * R * 16;
            _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++) {
                const float *x = xr[n] + j0 + 16 * q;
                const float32x4_t x0 = vld1q_f32(x), x1 = vld1q_f32(x + 4), x2 = vld1q_f32(x + 8), x3 = vld1q_f32(x + 12);
                _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                    const float *wi = wq + 16 * i;
                    p[n][i] = vfmaq_f32(p[n][i], vld1q_f32(wi), x0);
                    p[n][i] = vfmaq_f32(p[n][i], vld1q_f32(wi + 4), x1);
                    p[n][i] = vfmaq_f32(p[n][i], vld1q_f32(wi + 8), x2);
                    p[n][i] = vfmaq_f32(p[n][i], vld1q_f32(wi + 12), x3);
                }
            }
        }
        _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++)
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) acc[n][i] = fp8_tile_add(p[n][i], sr[i][t0 + tt], acc[n][i]);
    }
}

INL void fp8_rows(const uint8_t *w, const uint8_t *scales, size_t r, int R, size_t k, size_t nt, const float *xp,
                  size_t ldx, float *y, size_t ldy) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE;
    float wb[FP8_KT * 8 * MM_R * 16] __attribute__((aligned(16)));
    float32x4_t accm[DS4F_MM_TB][MM_R];
    const uint8_t *sr[MM_R];
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) sr[i] = scales + (r + i) / DS4F_FP8_TILE * kt;
    for (size_t t0 = 0; t0 < nt; t0 += DS4F_MM_TB) {
        const size_t tn = nt - t0 < DS4F_MM_TB ? nt - t0 : DS4F_MM_TB;
        uint8x16_t nan[MM_R];
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) nan[i] = vdupq_n_u8(0);
        for (size_t c = 0; c < kt; c += FP8_KT) {
            const size_t ntl = kt - c < FP8_KT ? kt - c : FP8_KT;
            const int first = c == 0, last = c + ntl == kt;
            fp8_decode(w, r, R, k, c, ntl, wb, nan);
            for (size_t t = 0; t < tn; t += 2) {
                const int NT = t + 1 < tn ? 2 : 1;
                const float *xr[2] = {xp + (t0 + t) * ldx, xp + (t0 + t + NT - 1) * ldx};
                float32x4_t acc[2][MM_R];
                _Pragma("GCC unroll 2") for (int n = 0; n < 2; n++)
                    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
                        acc[n][i] = first || n >= NT ? vdupq_n_f32(0.0f) : accm[t + n][i];
                if (NT == 2)
                    fp8_tokens(2, R, wb, sr, c, ntl, k, xr, acc);
                else
                    fp8_tokens(1, R, wb, sr, c, ntl, k, xr, acc);
                for (int n = 0; n < NT; n++)
                    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                        if (last)
                            y[(t0 + t + n) * ldy + r + i] = fp8_result(acc[n][i], nan[i]);
                        else
                            accm[t + n][i] = acc[n][i];
                    }
            }
        }
    }
}

static void fp8_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                   const float *xp, size_t ldx, float *y, size_t ldy) {
    size_t r = r0;
    for (; r + MM_R <= r1; r += MM_R) fp8_rows(w, scales, r, MM_R, k, nt, xp, ldx, y, ldy);
    for (; r < r1; r++) fp8_rows(w, scales, r, 1, k, nt, xp, ldx, y, ldy);
}

const ds4f_mtable ds4f_mt_neon = {{mxfp4_mm, bf16_mm, fp8_mm}, {NULL, NULL, NULL}, {1, 1, 16}};
#endif
