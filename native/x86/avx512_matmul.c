/* x86/avx512_matmul.c — AVX-512 multi-token kernels (contract: kernels_internal.h).
 *
 * 4 rows at a time, k in chunks: the chunk's weights of the 4 rows are decoded once into an L1
 * tile with the single-vector kernel's own steps (kernels_avx512.h), in its lane order; then the
 * tokens run over the tile two at a time, their accumulators in registers within a chunk and in
 * a stack tile between chunks (DS4F_MM_TB tokens per tile).  Per token and row that is the
 * single-vector kernel's sequence: the same FMAs into the same two accumulators (MXFP4, bf16:
 * even and odd elements of each 32-block) or the same tile partials and tile scaling (FP8), the
 * same final reduction.  x is prepared once per call (prep_*): the xe | xo of every 32-block, or
 * FP8's permuted 64-chunks zero-padded to a multiple of 64, as the single-vector kernels permute
 * it themselves.
 *
 * Measured on the Sapphire Rapids VM (thread CPU time, 1 thread; perf has no counters here):
 * the core does 2 zmm FMAs per cycle at ~3.5 GHz (~110 G lanes/s) but only ~1.25 zmm loads per
 * cycle from L1.  Bit identity fixes the lanes: each (row, token) owns two 16-lane accumulators
 * along k, so every FMA needs a weight vector and an x vector, and with R rows x NT tokens in
 * registers a block costs 2R + 2NT loads for 2*R*NT FMAs.  The single-vector kernel (R = 4,
 * NT = 1, decode in registers) does ~22-24 G weights/s.  Here R = 4, NT = 2: ~50 G weights x
 * tokens/s at 32 tokens on the 2048x4096 MXFP4 shape, ~2.1x the single-vector calls; the same
 * loop alone on L1-resident data tops out near 77 G (R = 4, NT = 3: 86 G, with spills in the
 * full kernel), so 4x (~95 G) is beyond this core for these exact FMAs.  GCC folds the weight
 * loads into the FMAs' memory operands (a load per FMA, undoing NT = 2): an empty asm keeps each
 * weight vector in a register for both tokens.  A 256-bit version (FMAs split by lane halves, the
 * same bits) reached only ~23 G.
 *
 * Up to 8 tokens (several sequences' decode rows, the tokens of one routed expert) the tile does
 * not pay: those calls decode in registers instead, as the single-vector kernels do, and apply each
 * decoded vector to a group of tokens (eo_few, fp8_few below), with the same per-(row, token)
 * sequence.
 */
#include "kernels_avx512.h"

#ifdef DS4F_X86

#define MM_R 4   /* rows decoded together */
#define MM_KC 8  /* MXFP4 / bf16: 32-element blocks per chunk (4 KiB tile for 4 rows) */
#define MM_NT 2  /* tokens in registers at a time (their accumulators; each weight load serves all) */
#define FP8_KT 2  /* FP8: 128-element tiles per chunk */
#define FP8_R 8   /* FP8: rows decoded together: a row's partial takes 4 chained FMAs per 64-chunk, and 8
                   * rows x 2 tokens keep 16 chains in flight (4 rows: 8, one per FMA latency slot, and
                   * the loop ran at ~41 G weights x tokens/s; 8 rows: ~44 G on 4096x4096 at 32-64
                   * tokens, 1 thread); 16 accumulators + 8 x + 4 weight vectors fit the 32 registers */

/* ---- MXFP4 and bf16: the even/odd lane order ---------------------------------------------- */

T512 static void prep_eo(const float *x, size_t k, float *xp) {
    for (size_t j = 0; j < k; j += 32) {
        __m512 xe, xo;
        x_eo(x + j, &xe, &xo);
        _mm512_storeu_ps(xp + j, xe);
        _mm512_storeu_ps(xp + j + 16, xo);
    }
}

/* blocks b0..b0+nb-1 of rows r..r+R-1 -> wb[b][i] = w_lo (16) | w_hi (16), and a prefetch of
 * the row's next chunk */
INL void eo_decode(int kind, const void *w, const uint8_t *scales, size_t r, int R, size_t k, size_t b0,
                   size_t nb, float *wb) {
    const size_t kb = k / 2, ks = k / 32;
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
        for (size_t b = 0; b < nb; b++) {
            __m512 lo, hi;
            if (kind == DS4F_MM_MXFP4)
                mxfp4_eo((const uint8_t *)w + (r + i) * kb + 16 * (b0 + b), scales[(r + i) * ks + b0 + b], &lo, &hi);
            else
                bf16_eo((const uint16_t *)w + (r + i) * k + 32 * (b0 + b), &lo, &hi);
            _mm512_store_ps(wb + (b * R + i) * 32, lo);
            _mm512_store_ps(wb + (b * R + i) * 32 + 16, hi);
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

/* NT tokens (1 or 2) from token t over the chunk's nb blocks, their accumulators in
 * registers; each row's two weight vectors are loaded once per block for all NT tokens */
INL void eo_tokens(int NT, int R, const float *wb, size_t nb, const float *xp, size_t ldx, int first, int last,
                   __m512 (*accm)[MM_R][2], float *y, size_t ldy) {
    __m512 a[MM_NT][MM_R][2];
    _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++)
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
            a[n][i][0] = first ? _mm512_setzero_ps() : accm[n][i][0];
            a[n][i][1] = first ? _mm512_setzero_ps() : accm[n][i][1];
        }
    for (size_t b = 0; b < nb; b++) {
        __m512 xe[MM_NT], xo[MM_NT];
        _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) {
            xe[n] = _mm512_loadu_ps(xp + n * ldx + 32 * b);
            xo[n] = _mm512_loadu_ps(xp + n * ldx + 32 * b + 16);
        }
        const float *wr = wb + b * R * 32;
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
            __m512 wlo = _mm512_load_ps(wr + 32 * i), whi = _mm512_load_ps(wr + 32 * i + 16);
            __asm__("" : "+v"(wlo), "+v"(whi)); /* one load per vector for all NT tokens, not one per FMA */
            _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) {
                a[n][i][0] = _mm512_fmadd_ps(wlo, xe[n], a[n][i][0]);
                a[n][i][1] = _mm512_fmadd_ps(whi, xo[n], a[n][i][1]);
            }
        }
    }
    _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++)
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
            if (last) {
                y[n * ldy + i] = finish(a[n][i][0], a[n][i][1]);
            } else {
                accm[n][i][0] = a[n][i][0];
                accm[n][i][1] = a[n][i][1];
            }
        }
}

INL void eo_rows(int kind, const void *w, const uint8_t *scales, size_t r, int R, size_t k, size_t nt,
                 const float *xp, size_t ldx, float *y, size_t ldy) {
    const size_t ks = k / 32;
    float wb[MM_R * MM_KC * 32] __attribute__((aligned(64)));
    __m512 accm[DS4F_MM_TB][MM_R][2];
    for (size_t t0 = 0; t0 < nt; t0 += DS4F_MM_TB) {
        const size_t tn = nt - t0 < DS4F_MM_TB ? nt - t0 : DS4F_MM_TB;
        for (size_t c = 0; c < ks; c += MM_KC) {
            const size_t nb = ks - c < MM_KC ? ks - c : MM_KC;
            const int first = c == 0, last = c + nb == ks;
            eo_decode(kind, w, scales, r, R, k, c, nb, wb);
            for (size_t t = 0; t < tn; t += MM_NT) {
                const float *x = xp + (t0 + t) * ldx + 32 * c;
                float *yt = y + (t0 + t) * ldy + r;
                if (tn - t >= 2)
                    eo_tokens(2, R, wb, nb, x, ldx, first, last, accm + t, yt, ldy);
                else
                    eo_tokens(1, R, wb, nb, x, ldx, first, last, accm + t, yt, ldy);
            }
        }
    }
}

/* A few tokens (an expert two or three rows chose, several sequences' decode rows): 4 rows at a
 * time, each block decoded in registers as the single-vector kernel does, and applied to NT <= 3
 * tokens whose x vectors are loaded once per block for the 4 rows; per (row, token) the
 * single-vector kernel's FMAs into its two accumulators and its reduction.  The tile path above
 * stores and reloads every decoded vector and passes over the tile per token pair: 2 tokens took
 * 1.76x one token's time, 4 tokens 2.6x; here 1.15x and 2.2x (2048x4096 and 4096x2048, 1 thread).
 * From 8 tokens on the tile path is as fast.  bf16 (2048x4096): 2 tokens 1.18x against 1.28x,
 * 3 tokens 1.44x against 1.57x, 4 tokens 2.3x against the tile's 1.74x. */
#define EO_FEW_R 4
#define EO_FEW_NT 3      /* 4 rows x 3 tokens x 2 accumulators, 3 x 2 x vectors: 30 of the 32 registers */
#define EO_FEW_TOKENS 8  /* up to this many tokens an MXFP4 call goes this way, in FEW_GROUPS */
#define BF16_FEW_TOKENS 3 /* bf16's decode is 2 steps per 32 weights: its tile pays from 4 tokens */

INL void eo_few_rows(int kind, int NT, int R, const void *w, const uint8_t *scales, size_t r, size_t k,
                     const float *xp, size_t ldx, int ahead, float *y, size_t ldy) {
    const size_t kb = k / 2, ks = k / 32;
    __m512 a[EO_FEW_R][EO_FEW_NT][2];
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) a[i][n][0] = a[i][n][1] = _mm512_setzero_ps();
    const uint8_t *c0 = (const uint8_t *)w + r * kb, *s0 = scales + r * ks;
    for (size_t b = 0; b < ks; b++) {
        if (ahead && kind == DS4F_MM_MXFP4) { /* the next row group's bytes, 16 R per block */
            _mm_prefetch((const char *)c0 + R * kb + 16 * R * b, _MM_HINT_T0);
            if (16 * R * b < R * ks) _mm_prefetch((const char *)s0 + R * ks + 16 * R * b, _MM_HINT_T0);
        }
        __m512 xe[EO_FEW_NT], xo[EO_FEW_NT]; /* loaded once for all the rows */
        _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) {
            xe[n] = _mm512_loadu_ps(xp + n * ldx + 32 * b);
            xo[n] = _mm512_loadu_ps(xp + n * ldx + 32 * b + 16);
        }
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
            __m512 lo, hi;
            if (kind == DS4F_MM_MXFP4)
                mxfp4_eo(c0 + i * kb + 16 * b, s0[i * ks + b], &lo, &hi);
            else
                bf16_eo((const uint16_t *)w + (r + i) * k + 32 * b, &lo, &hi);
            _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) {
                a[i][n][0] = _mm512_fmadd_ps(lo, xe[n], a[i][n][0]);
                a[i][n][1] = _mm512_fmadd_ps(hi, xo[n], a[i][n][1]);
            }
        }
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) y[n * ldy + r + i] = finish(a[i][n][0], a[i][n][1]);
}

/* rows r0..r1 for NT tokens (a constant in each call below, so the loops unroll) */
INL void eo_few(int kind, int NT, const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k,
                const float *xp, size_t ldx, float *y, size_t ldy) {
    const int R = EO_FEW_R;
    size_t r = r0;
    for (; r + R <= r1; r += R) eo_few_rows(kind, NT, R, w, scales, r, k, xp, ldx, r + 2 * R <= r1, y, ldy);
    for (; r < r1; r++) eo_few_rows(kind, NT, 1, w, scales, r, k, xp, ldx, 0, y, ldy);
}

/* the tokens in groups of 2, the first of 3 when their count is odd (one token: alone) */
#define FEW_GROUPS(nt, call)                                                                       \
    for (size_t t_ = 0; t_ < (nt);) {                                                              \
        const size_t g_ = (nt) == 1 ? 1 : t_ == 0 && (nt) % 2 ? 3 : 2;                             \
        if (g_ == 3)                                                                               \
            call(3, t_);                                                                           \
        else if (g_ == 2)                                                                          \
            call(2, t_);                                                                           \
        else                                                                                       \
            call(1, t_);                                                                           \
        t_ += g_;                                                                                  \
    }

T512 static void mxfp4_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                          const float *xp, size_t ldx, float *y, size_t ldy) {
    if (nt <= EO_FEW_TOKENS) {
#define MXFP4_FEW(NT, t) eo_few(DS4F_MM_MXFP4, NT, w, scales, r0, r1, k, xp + (t) * ldx, ldx, y + (t) * ldy, ldy)
        FEW_GROUPS(nt, MXFP4_FEW)
#undef MXFP4_FEW
        return;
    }
    size_t r = r0;
    for (; r + MM_R <= r1; r += MM_R) eo_rows(DS4F_MM_MXFP4, w, scales, r, MM_R, k, nt, xp, ldx, y, ldy);
    for (; r < r1; r++) eo_rows(DS4F_MM_MXFP4, w, scales, r, 1, k, nt, xp, ldx, y, ldy);
}

T512 static void bf16_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                         const float *xp, size_t ldx, float *y, size_t ldy) {
    if (nt <= BF16_FEW_TOKENS) {
#define BF16_FEW(NT, t) eo_few(DS4F_MM_BF16, NT, w, scales, r0, r1, k, xp + (t) * ldx, ldx, y + (t) * ldy, ldy)
        FEW_GROUPS(nt, BF16_FEW)
#undef BF16_FEW
        return;
    }
    size_t r = r0;
    for (; r + MM_R <= r1; r += MM_R) eo_rows(DS4F_MM_BF16, w, scales, r, MM_R, k, nt, xp, ldx, y, ldy);
    for (; r < r1; r++) eo_rows(DS4F_MM_BF16, w, scales, r, 1, k, nt, xp, ldx, y, ldy);
}

/* ---- FP8 ---------------------------------------------------------------------------------- */

/* x as fp8_matvec_rows permutes it: per 64-chunk fp8_x_perm's 4 vectors, zero past k */
T512 static void prep_fp8(const float *x, size_t k, float *xp) {
    for (size_t j = 0; j < k; j += 64) {
        __m512 xv[4];
        fp8_x_perm(x, j, k, xv);
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(xp + j + 16 * i, xv[i]);
    }
}

/* 64-chunks in the tile starting at element j0: 2, or fewer for a ragged last tile */
static inline size_t fp8_chunks(size_t j0, size_t k) {
    const size_t n = k - j0 < DS4F_FP8_TILE ? k - j0 : DS4F_FP8_TILE;
    return (n + 63) / 64;
}

/* tiles t0..t0+nt-1 of rows r..r+R-1 -> wb[tile][chunk][i] = fp8_widen64's 4 vectors; NaN codes
 * into nan[i] */
INL void fp8_decode(const uint8_t *w, size_t r, int R, size_t k, size_t t0, size_t ntl, float *wb, __m512i *nan) {
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
        const uint8_t *wr = w + (r + i) * k;
        for (size_t tt = 0; tt < ntl; tt++) {
            const size_t j0 = (t0 + tt) * DS4F_FP8_TILE, nq = fp8_chunks(j0, k);
            for (size_t q = 0; q < nq; q++) {
                const size_t j = j0 + 64 * q;
                const __m512i v = j + 64 <= k ? _mm512_loadu_si512(wr + j) : fp8_load_tail(wr + j, k - j);
                nan[i] = fp8_nan_max(nan[i], v);
                __m512 f[4];
                fp8_widen64(v, f);
                float *o = wb + ((tt * 2 + q) * R + i) * 64;
                for (int m = 0; m < 4; m++) _mm512_store_ps(o + 16 * m, f[m]);
            }
        }
        /* the next chunk of this row (the hardware prefetcher follows within it) */
        const size_t nx = (t0 + ntl) * DS4F_FP8_TILE;
        if (nx < k) {
            _mm_prefetch((const char *)wr + nx, _MM_HINT_T0);
            _mm_prefetch((const char *)wr + nx + 64, _MM_HINT_T0);
        }
    }
}

/* NT tokens (1 or 2) from token t over the chunk's tiles: per tile a partial p per row and
 * token from zero, then acc = fp8_tile_add(p, scale, acc).  A row's 4 weight vectors of a
 * 64-chunk are loaded once for all NT tokens (whose partials are independent chains). */
INL void fp8_tokens(int NT, int R, const float *wb, const uint8_t *const *sr, size_t c, size_t ntl, size_t k,
                    const float *xp, size_t ldx, int first, int last, const __m512i *nan, __m512 (*accm)[FP8_R],
                    float *y, size_t ldy) {
    __m512 acc[MM_NT][FP8_R];
    _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++)
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) acc[n][i] = first ? _mm512_setzero_ps() : accm[n][i];
    for (size_t tt = 0; tt < ntl; tt++) {
        const size_t j0 = (c + tt) * DS4F_FP8_TILE, nq = fp8_chunks(j0, k);
        __m512 p[MM_NT][FP8_R];
        _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++)
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) p[n][i] = _mm512_setzero_ps();
        for (size_t q = 0; q < nq; q++) {
            const float *wq = wb + (tt * 2 + q) * R * 64, *x = xp + j0 + 64 * q;
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
                __m512 f0 = _mm512_load_ps(wq + 64 * i), f1 = _mm512_load_ps(wq + 64 * i + 16);
                __m512 f2 = _mm512_load_ps(wq + 64 * i + 32), f3 = _mm512_load_ps(wq + 64 * i + 48);
                __asm__("" : "+v"(f0), "+v"(f1), "+v"(f2), "+v"(f3)); /* loaded once for all NT tokens */
                _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) {
                    p[n][i] = _mm512_fmadd_ps(f0, _mm512_loadu_ps(x + n * ldx), p[n][i]);
                    p[n][i] = _mm512_fmadd_ps(f1, _mm512_loadu_ps(x + n * ldx + 16), p[n][i]);
                    p[n][i] = _mm512_fmadd_ps(f2, _mm512_loadu_ps(x + n * ldx + 32), p[n][i]);
                    p[n][i] = _mm512_fmadd_ps(f3, _mm512_loadu_ps(x + n * ldx + 48), p[n][i]);
                }
            }
        }
        _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++)
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) acc[n][i] = fp8_tile_add(p[n][i], sr[i][c + tt], acc[n][i]);
    }
    _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++)
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
            if (last)
                y[n * ldy + i] = fp8_result(acc[n][i], nan[i]);
            else
                accm[n][i] = acc[n][i];
        }
}

INL void fp8_rows(const uint8_t *w, const uint8_t *scales, size_t r, int R, size_t k, size_t nt, const float *xp,
                  size_t ldx, float *y, size_t ldy) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE;
    float wb[FP8_KT * 2 * FP8_R * 64] __attribute__((aligned(64)));
    __m512 accm[DS4F_MM_TB][FP8_R];
    const uint8_t *sr[FP8_R];
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) sr[i] = scales + (r + i) / DS4F_FP8_TILE * kt;
    for (size_t t0 = 0; t0 < nt; t0 += DS4F_MM_TB) {
        const size_t tn = nt - t0 < DS4F_MM_TB ? nt - t0 : DS4F_MM_TB;
        __m512i nan[FP8_R];
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) nan[i] = _mm512_setzero_si512();
        for (size_t c = 0; c < kt; c += FP8_KT) {
            const size_t ntl = kt - c < FP8_KT ? kt - c : FP8_KT;
            const int first = c == 0, last = c + ntl == kt;
            fp8_decode(w, r, R, k, c, ntl, wb, nan);
            for (size_t t = 0; t < tn; t += MM_NT) {
                const float *x = xp + (t0 + t) * ldx;
                float *yt = y + (t0 + t) * ldy + r;
                if (tn - t >= 2)
                    fp8_tokens(2, R, wb, sr, c, ntl, k, x, ldx, first, last, nan, accm + t, yt, ldy);
                else
                    fp8_tokens(1, R, wb, sr, c, ntl, k, x, ldx, first, last, nan, accm + t, yt, ldy);
            }
        }
    }
}

/* A few tokens (several sequences' decode rows, a shared expert's): each 64-chunk of 4 rows decoded
 * in registers as the single-vector kernel does, and applied to NT <= 4 tokens whose x vectors are
 * loaded once per chunk for those rows (with 4 tokens the compiler keeps some of them in memory:
 * 4 x 4 partials are 16 independent chains, where 2 rows' 8 were latency-bound); per (row, token) the
 * single-vector kernel's sequence (4 FMAs per chunk into the tile partial, the tile added with its
 * scale, the same result).  The tile path above stores and reloads every decoded vector and passes
 * over the tile per token pair: 2 tokens took 2x one token's time, 4 tokens 2.85x; here 1.35x and
 * 1.9-2.3x (the trunk's shapes, 1 thread).  Decode is most of a token's work (14 steps per 64
 * weights against 4 FMAs), so a group of 4 tokens beats two of 2. */
#define FP8_FEW_R 4
#define FP8_FEW_NT 4
#define FP8_FEW_TOKENS 8 /* up to this many tokens a call goes this way, in groups of 4 */
#define FP8_FEW_PREFETCH 512

INL void fp8_few_rows(int NT, int R, const uint8_t *w, const uint8_t *scales, size_t r, size_t k, const float *xp,
                      size_t ldx, float *y, size_t ldy) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE;
    const uint8_t *wr[FP8_FEW_R], *sr[FP8_FEW_R];
    __m512 p[FP8_FEW_R][FP8_FEW_NT];
    float acc[FP8_FEW_R][FP8_FEW_NT][16] __attribute__((aligned(64))); /* touched once a tile: kept out of registers */
    __m512i nan[FP8_FEW_R];
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
        wr[i] = w + (r + i) * k;
        sr[i] = scales + (r + i) / DS4F_FP8_TILE * kt;
        nan[i] = _mm512_setzero_si512();
        _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) _mm512_store_ps(acc[i][n], _mm512_setzero_ps());
    }
    for (size_t t = 0; t < kt; t++) {
        const size_t j0 = t * DS4F_FP8_TILE, nq = fp8_chunks(j0, k);
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
            _mm_prefetch((const char *)wr[i] + j0 + FP8_FEW_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)wr[i] + j0 + FP8_FEW_PREFETCH + 64, _MM_HINT_T0);
            _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) p[i][n] = _mm512_setzero_ps();
        }
        for (size_t q = 0; q < nq; q++) {
            const size_t j = j0 + 64 * q;
            __m512 xv[FP8_FEW_NT][4]; /* loaded once for all the rows */
            _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++)
                _Pragma("GCC unroll 4") for (int m = 0; m < 4; m++) xv[n][m] = _mm512_loadu_ps(xp + n * ldx + j + 16 * m);
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                const __m512i v = j + 64 <= k ? _mm512_loadu_si512(wr[i] + j) : fp8_load_tail(wr[i] + j, k - j);
                nan[i] = fp8_nan_max(nan[i], v);
                __m512 f[4];
                fp8_widen64(v, f);
                _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) {
                    __m512 a = p[i][n];
                    a = _mm512_fmadd_ps(f[0], xv[n][0], a);
                    a = _mm512_fmadd_ps(f[1], xv[n][1], a);
                    a = _mm512_fmadd_ps(f[2], xv[n][2], a);
                    a = _mm512_fmadd_ps(f[3], xv[n][3], a);
                    p[i][n] = a;
                }
            }
        }
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
            _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) {
                __m512 a = _mm512_load_ps(acc[i][n]);
                __asm__("" : "+v"(a));
                _mm512_store_ps(acc[i][n], fp8_tile_add(p[i][n], sr[i][t], a));
            }
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++)
            y[n * ldy + r + i] = fp8_result(_mm512_load_ps(acc[i][n]), nan[i]);
}

/* rows r0..r1 for NT tokens (a constant in each call below, so the loops unroll) */
INL void fp8_few(int NT, const uint8_t *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, const float *xp,
                 size_t ldx, float *y, size_t ldy) {
    const int R = FP8_FEW_R;
    size_t r = r0;
    for (; r + R <= r1; r += R) fp8_few_rows(NT, R, w, scales, r, k, xp, ldx, y, ldy);
    for (; r < r1; r++) fp8_few_rows(NT, 1, w, scales, r, k, xp, ldx, y, ldy);
}

T512 static void fp8_mm_few(const uint8_t *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                            const float *xp, size_t ldx, float *y, size_t ldy) {
#define FP8_FEW(NT, t) fp8_few(NT, w, scales, r0, r1, k, xp + (t) * ldx, ldx, y + (t) * ldy, ldy)
    for (size_t t = 0; t + 4 <= nt; t += 4) FP8_FEW(4, t);
    const size_t t4 = nt / 4 * 4;
    switch (nt - t4) {
    case 3: FP8_FEW(3, t4); break;
    case 2: FP8_FEW(2, t4); break;
    case 1: FP8_FEW(1, t4); break;
    }
#undef FP8_FEW
}

T512 static void fp8_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                        const float *xp, size_t ldx, float *y, size_t ldy) {
    if (nt <= FP8_FEW_TOKENS) {
        fp8_mm_few(w, scales, r0, r1, k, nt, xp, ldx, y, ldy);
        return;
    }
    size_t r = r0;
    for (; r + FP8_R <= r1; r += FP8_R) fp8_rows(w, scales, r, FP8_R, k, nt, xp, ldx, y, ldy);
    for (; r < r1; r++) fp8_rows(w, scales, r, 1, k, nt, xp, ldx, y, ldy);
}

const ds4f_mtable ds4f_mt_avx512 = {{mxfp4_mm, bf16_mm, fp8_mm}, {prep_eo, prep_eo, prep_fp8}, {32, 32, 64}};
#endif
