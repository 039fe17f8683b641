/* multi_avx2.c — AVX2 multi-token kernels (contract: kernels_internal.h; structure: see
 * multi_avx512.c).
 *
 * 4 rows at a time, k in chunks decoded once into an L1 tile with kernels_avx2.h's steps, then
 * every token runs over the tile.  MXFP4 / bf16: per 32-block the lane order of matvec_rows, i.e.
 * [x_even, x_odd] of elements 0..15, then of 16..31, into the row's two accumulators (alo gets
 * the even halves, ahi the odd ones, in that order).  FP8: fp8_x_perm's order per 32-chunk into
 * the tile partial, then fp8_tile_add, two tokens at a time (four rows give only 4 dependency
 * chains, too few to keep two FMA ports busy).
 *
 * Measured on a Zen 3 VM (1 thread, 32 vectors; 2 FMAs per cycle, ~51 G lanes/s peak): MXFP4
 * ~28 G weights x tokens/s (the bare FMA loop with its 1.25 loads per FMA tops out near 39 G,
 * the decode costs ~10%), FP8 ~29 G (2 tokens x 4 rows = 8 chains, 0.75 loads per FMA; what
 * is left goes to the per-tile scaling every 16 FMAs of a chain and the decode).  Three tokens
 * at a time (12 chains) spill with AVX2's 16 registers and are no faster; two tokens on two rows
 * for MXFP4 (each weight loaded once for both) were slower (21 G).
 */
#include "kernels_avx2.h"

#ifdef DS4F_X86

#define MM_R 4   /* rows decoded together */
#define MM_KC 16 /* MXFP4 / bf16: 32-element blocks per chunk (8 KiB tile for 4 rows) */
#define FP8_KT 4 /* FP8: 128-element tiles per chunk */
#define FP8_NT 2 /* FP8: tokens in registers at a time (2 x 4 partials, 2 x vectors, 1 weight: 11 ymm) */

/* ---- MXFP4 and bf16 ----------------------------------------------------------------------- */

/* per 32-block: deinterleave(x), deinterleave(x + 16) */
T256 static void prep_h(const float *x, size_t k, float *xp) {
    for (size_t j = 0; j < k; j += 32) {
        __m256 v[4];
        deinterleave(x + j, &v[0], &v[1]);
        deinterleave(x + j + 16, &v[2], &v[3]);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(xp + j + 8 * i, v[i]);
    }
}

/* blocks b0..b0+nb-1 of rows r..r+R-1 -> wb[b][i] = the 4 weight vectors in prep_h's order */
INL void h_decode(int kind, const void *w, const uint8_t *scales, size_t r, int R, size_t k, size_t b0, size_t nb,
                  float *wb) {
    const size_t kb = k / 2, ks = k / 32;
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
        for (size_t b = 0; b < nb; b++) {
            __m256 v[4];
            if (kind == DS4F_MM_MXFP4) {
                const uint8_t *c = (const uint8_t *)w + (r + i) * kb + 16 * (b0 + b);
                const lut8 l = scaled_lut(scales[(r + i) * ks + b0 + b]);
                mxfp4_half8(c, l, &v[0], &v[1]);
                mxfp4_half8(c + 8, l, &v[2], &v[3]);
            } else {
                const uint16_t *wr = (const uint16_t *)w + (r + i) * k + 32 * (b0 + b);
                bf16_half8(wr, &v[0], &v[1]);
                bf16_half8(wr + 16, &v[2], &v[3]);
            }
            for (int m = 0; m < 4; m++) _mm256_store_ps(wb + (b * R + i) * 32 + 8 * m, v[m]);
        }
        const size_t nx = (r + i) * ks + b0 + nb; /* the row's next block */
        if (b0 + nb < ks && kind == DS4F_MM_MXFP4) {
            const uint8_t *c = (const uint8_t *)w + nx * 16;
            _mm_prefetch((const char *)c, _MM_HINT_T0);
            _mm_prefetch((const char *)c + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)(scales + nx), _MM_HINT_T0);
        } else if (b0 + nb < ks) {
            const char *c = (const char *)((const uint16_t *)w + nx * 32);
            for (int l = 0; l < MM_KC; l++) _mm_prefetch(c + 64 * l, _MM_HINT_T0);
        }
    }
}

INL void h_rows(int kind, const void *w, const uint8_t *scales, size_t r, int R, size_t k, size_t nt,
                const float *xp, size_t ldx, float *y, size_t ldy) {
    const size_t ks = k / 32;
    float wb[MM_R * MM_KC * 32] __attribute__((aligned(32)));
    __m256 accm[DS4F_MM_TB][MM_R][2];
    for (size_t t0 = 0; t0 < nt; t0 += DS4F_MM_TB) {
        const size_t tn = nt - t0 < DS4F_MM_TB ? nt - t0 : DS4F_MM_TB;
        for (size_t c = 0; c < ks; c += MM_KC) {
            const size_t nb = ks - c < MM_KC ? ks - c : MM_KC;
            const int first = c == 0, last = c + nb == ks;
            h_decode(kind, w, scales, r, R, k, c, nb, wb);
            for (size_t t = 0; t < tn; t++) {
                __m256 a[MM_R][2];
                _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                    a[i][0] = first ? _mm256_setzero_ps() : accm[t][i][0];
                    a[i][1] = first ? _mm256_setzero_ps() : accm[t][i][1];
                }
                const float *xr = xp + (t0 + t) * ldx + 32 * c;
                for (size_t b = 0; b < nb; b++) {
                    const __m256 x0 = _mm256_loadu_ps(xr + 32 * b), x1 = _mm256_loadu_ps(xr + 32 * b + 8);
                    const __m256 x2 = _mm256_loadu_ps(xr + 32 * b + 16), x3 = _mm256_loadu_ps(xr + 32 * b + 24);
                    const float *wr = wb + b * R * 32;
                    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                        a[i][0] = _mm256_fmadd_ps(_mm256_load_ps(wr + 32 * i), x0, a[i][0]);
                        a[i][1] = _mm256_fmadd_ps(_mm256_load_ps(wr + 32 * i + 8), x1, a[i][1]);
                        a[i][0] = _mm256_fmadd_ps(_mm256_load_ps(wr + 32 * i + 16), x2, a[i][0]);
                        a[i][1] = _mm256_fmadd_ps(_mm256_load_ps(wr + 32 * i + 24), x3, a[i][1]);
                    }
                }
                _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                    if (last) {
                        y[(t0 + t) * ldy + r + i] = finish(a[i][0], a[i][1]);
                    } else {
                        accm[t][i][0] = a[i][0];
                        accm[t][i][1] = a[i][1];
                    }
                }
            }
        }
    }
}

T256 static void mxfp4_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                          const float *xp, size_t ldx, float *y, size_t ldy) {
    size_t r = r0;
    for (; r + MM_R <= r1; r += MM_R) h_rows(DS4F_MM_MXFP4, w, scales, r, MM_R, k, nt, xp, ldx, y, ldy);
    for (; r < r1; r++) h_rows(DS4F_MM_MXFP4, w, scales, r, 1, k, nt, xp, ldx, y, ldy);
}

T256 static void bf16_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                         const float *xp, size_t ldx, float *y, size_t ldy) {
    size_t r = r0;
    for (; r + MM_R <= r1; r += MM_R) h_rows(DS4F_MM_BF16, w, scales, r, MM_R, k, nt, xp, ldx, y, ldy);
    for (; r < r1; r++) h_rows(DS4F_MM_BF16, w, scales, r, 1, k, nt, xp, ldx, y, ldy);
}

/* ---- FP8 ---------------------------------------------------------------------------------- */

/* x as fp8_matvec_rows permutes it: per 32-chunk fp8_x_perm's 4 vectors, zero past k */
T256 static void prep_fp8(const float *x, size_t k, float *xp) {
    for (size_t j = 0; j < k; j += 32) {
        __m256 xv[4];
        fp8_x_perm(x, j, k, xv);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(xp + j + 8 * i, xv[i]);
    }
}

/* 32-chunks in the tile starting at element j0: 4, or fewer for a ragged last tile */
static inline size_t fp8_chunks(size_t j0, size_t k) {
    const size_t n = k - j0 < DS4F_FP8_TILE ? k - j0 : DS4F_FP8_TILE;
    return (n + 31) / 32;
}

/* tiles t0..t0+ntl-1 of rows r..r+R-1 -> wb[tile][chunk][i] = fp8_widen32's 4 vectors */
INL void fp8_decode(const uint8_t *w, size_t r, int R, size_t k, size_t t0, size_t ntl, float *wb, __m256i *nan) {
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
        const uint8_t *wr = w + (r + i) * k;
        for (size_t tt = 0; tt < ntl; tt++) {
            const size_t j0 = (t0 + tt) * DS4F_FP8_TILE, nq = fp8_chunks(j0, k);
            for (size_t q = 0; q < nq; q++) {
                const size_t j = j0 + 32 * q;
                const __m256i v = j + 32 <= k ? _mm256_loadu_si256((const __m256i *)(wr + j)) : fp8_load_tail(wr + j, k - j);
                nan[i] = fp8_nan_max(nan[i], v);
                __m256 f[4];
                fp8_widen32(v, f);
                float *o = wb + ((tt * 4 + q) * R + i) * 32;
                for (int m = 0; m < 4; m++) _mm256_store_ps(o + 8 * m, f[m]);
            }
        }
        const size_t nx = (t0 + ntl) * DS4F_FP8_TILE; /* the row's next chunk */
        if (nx < k) {
            _mm_prefetch((const char *)wr + nx, _MM_HINT_T0);
            _mm_prefetch((const char *)wr + nx + 64, _MM_HINT_T0);
        }
    }
}

/* NT tokens (1..FP8_NT) from xt (row stride ldx) over the chunk's ntl tiles: per tile a partial
 * p per (token, row) from zero in registers (each weight vector loaded once for all NT tokens,
 * each x vector once for all R rows), then fp8_tile_add into the token's accumulators in accm */
INL void fp8_tokens(int NT, int R, const float *wb, const uint8_t *const *sr, const float (*fac)[MM_R], int big,
                    size_t c, size_t ntl, size_t k, const float *xt, size_t ldx, __m256 (*accm)[MM_R]) {
    for (size_t tt = 0; tt < ntl; tt++) {
        const size_t j0 = (c + tt) * DS4F_FP8_TILE, nq = fp8_chunks(j0, k);
        __m256 p[FP8_NT][MM_R];
        _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++)
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) p[n][i] = _mm256_setzero_ps();
        for (size_t q = 0; q < nq; q++) {
            const float *wq = wb + (tt * 4 + q) * R * 32;
            _Pragma("GCC unroll 4") for (int m = 0; m < 4; m++) {
                __m256 xv[FP8_NT];
                _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++) xv[n] = _mm256_loadu_ps(xt + n * ldx + j0 + 32 * q + 8 * m);
                _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                    __m256 wv = _mm256_load_ps(wq + 32 * i + 8 * m);
                    __asm__("" : "+x"(wv)); /* one load for all NT tokens, not one folded into each FMA */
                    _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++) p[n][i] = _mm256_fmadd_ps(wv, xv[n], p[n][i]);
                }
            }
        }
        _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++)
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) accm[n][i] =
                big ? fp8_tile_add(p[n][i], sr[i][c + tt], accm[n][i])
                    : _mm256_fmadd_ps(p[n][i], _mm256_set1_ps(fac[tt][i]), accm[n][i]); /* fp8_tile_add's usual case */
    }
}

INL void fp8_rows(const uint8_t *w, const uint8_t *scales, size_t r, int R, size_t k, size_t nt, const float *xp,
                  size_t ldx, float *y, size_t ldy) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE;
    float wb[FP8_KT * 4 * MM_R * 32] __attribute__((aligned(32)));
    __m256 accm[DS4F_MM_TB][MM_R];
    const uint8_t *sr[MM_R];
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) sr[i] = scales + (r + i) / DS4F_FP8_TILE * kt;
    for (size_t t0 = 0; t0 < nt; t0 += DS4F_MM_TB) {
        const size_t tn = nt - t0 < DS4F_MM_TB ? nt - t0 : DS4F_MM_TB;
        __m256i nan[MM_R];
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) nan[i] = _mm256_setzero_si256();
        for (size_t t = 0; t < tn; t++)
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) accm[t][i] = _mm256_setzero_ps();
        for (size_t c = 0; c < kt; c += FP8_KT) {
            const size_t ntl = kt - c < FP8_KT ? kt - c : FP8_KT;
            fp8_decode(w, r, R, k, c, ntl, wb, nan);
            float fac[FP8_KT][MM_R]; /* each tile's factor, hoisted out of the token loop */
            int big = 0;             /* a scale whose factor overflows: fp8_tile_add's slow case */
            for (size_t tt = 0; tt < ntl; tt++)
                _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                    const uint8_t b = sr[i][c + tt];
                    big |= !ds4f_fp8_factor_fits(b);
                    fac[tt][i] = ds4f_fp8_factor(b);
                }
            for (size_t t = 0; t < tn; t += FP8_NT) {
                const float *xt = xp + (t0 + t) * ldx;
                if (t + FP8_NT <= tn)
                    fp8_tokens(FP8_NT, R, wb, sr, fac, big, c, ntl, k, xt, ldx, accm + t);
                else /* the block's last tokens, fewer than FP8_NT */
                    fp8_tokens((int)(tn - t), R, wb, sr, fac, big, c, ntl, k, xt, ldx, accm + t);
            }
        }
        for (size_t t = 0; t < tn; t++)
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) y[(t0 + t) * ldy + r + i] = fp8_result(accm[t][i], nan[i]);
    }
}

T256 static void fp8_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                        const float *xp, size_t ldx, float *y, size_t ldy) {
    size_t r = r0;
    for (; r + MM_R <= r1; r += MM_R) fp8_rows(w, scales, r, MM_R, k, nt, xp, ldx, y, ldy);
    for (; r < r1; r++) fp8_rows(w, scales, r, 1, k, nt, xp, ldx, y, ldy);
}

const ds4f_mtable ds4f_mt_avx2 = {{mxfp4_mm, bf16_mm, fp8_mm}, {prep_h, prep_h, prep_fp8}, {32, 32, 32}};
#endif
