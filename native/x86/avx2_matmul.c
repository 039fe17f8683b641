/* x86/avx2_matmul.c — AVX2 multi-token kernels (contract: kernels_internal.h; structure: see
 * x86/avx512_matmul.c).
 *
 * k in chunks decoded once into an L1 tile with kernels_avx2.h's steps, then every token runs
 * over the tile.  MXFP4: per 32-block the block's E2M1 values (unscaled, mx_prep32's lanes) and
 * its scale factor; per (token, row) the matvec's steps: mx_partial's products in its order,
 * then the partial sum times the scale into the row's accumulator.  bf16: per 32-block [x_even,
 * x_odd] of elements 0..15, then of 16..31, into the row's two accumulators (alo gets the even
 * halves, ahi the odd ones, in that order).  FP8: fp8_x_perm's order per 32-chunk into the tile
 * partial, then fp8_tile_add, two tokens at a time (four rows give only 4 dependency chains, too
 * few to keep two FMA ports busy).
 *
 * MXFP4 / bf16 run 2 tokens x 3 rows = 12 chains (MXFP4: 6 block partials and 6 accumulators;
 * bf16: 12 accumulators): each weight vector is loaded once for both tokens, each x vector once
 * for the 3 rows (0.83 loads per FMA), 15 of AVX2's 16 registers.  GCC shuffles that many live
 * vectors between registers, so the block's steps are written out (mx_block_2x3, h_block_2x3)
 * with fixed registers; a tile holds two such row groups, so each x slice read from L2 serves 6
 * rows.  Every chain gets its operations in the single-vector kernel's order, which is what keeps
 * a token's result bit-identical whatever its neighbours.
 *
 * Measured on a Zen 3 VM (1 thread, 32 vectors; 2 FMAs per cycle, ~51 G lanes/s peak): the bare
 * 2 x 3 block of the bf16 form runs at ~95% of peak from L1, against ~77% for 1 token x 4 rows
 * (8 chains, 1.25 loads per FMA).  A tile is decoded once for up to H_TB = 64 tokens (48 tokens:
 * ~1.1x against two decodes, at 32 and 16).  MXFP4 spends 5 FMAs per block and (token, row), 4
 * products and the scale.
 *
 * FP8: 2 tokens x 4 rows = 8 chains, 0.75 loads per FMA, over one 128-element tile of 32 decoded
 * rows, so that each x slice read from L2 serves 32 rows: ~31 -> ~34 G at k = 4096 (~4% slower
 * at k = 1024, where 32 rows' accumulators crowd L1).  3 tokens x 4 rows in fixed registers measured no faster; without the decode FP8 reaches
 * ~37 G, without its tile scaling too ~39 G, with x in L1 ~47 G.
 */
#include "kernels_avx2.h"

#ifdef DS4F_X86

#define MM_R 4   /* FP8: rows in registers at a time */
#define H_T 2    /* MXFP4 / bf16: tokens in registers at a time */
#define H_R 3    /* MXFP4 / bf16: rows in registers at a time */
#define H_RB 6   /* MXFP4 / bf16: rows decoded together (two groups of H_R) */
#define MM_KC 16 /* MXFP4 / bf16: 32-element blocks per chunk (12 KiB tile for H_RB rows) */
#define H_TB 64  /* MXFP4 / bf16: tokens per decode of a tile (their accumulators: 24 KiB of stack) */
#define FP8_KT 1 /* FP8: 128-element tiles per chunk */
#define FP8_RB 32 /* FP8: rows decoded together (groups of MM_R), so an x slice read from L2 serves 32 rows */
#define FP8_NT 2 /* FP8: tokens in registers at a time (2 x 4 partials, 2 x vectors, 1 weight: 11 ymm) */

/* ---- MXFP4 and bf16 ----------------------------------------------------------------------- */

/* MXFP4: per 32-block mx_prep32 (the matvec's order) */
T256 static void prep_mx(const float *x, size_t k, float *xp) {
    for (size_t j = 0; j < k; j += 32) {
        __m256 v[4];
        mx_prep32(x + j, v);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(xp + j + 8 * i, v[i]);
    }
}

/* bf16: per 32-block deinterleave(x), deinterleave(x + 16) */
T256 static void prep_h(const float *x, size_t k, float *xp) {
    for (size_t j = 0; j < k; j += 32) {
        __m256 v[4];
        deinterleave(x + j, &v[0], &v[1]);
        deinterleave(x + j + 16, &v[2], &v[3]);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(xp + j + 8 * i, v[i]);
    }
}

/* blocks b0..b0+nb-1 of rows r..r+R-1 -> wb[b][i] = the 4 weight vectors in the prep's order
 * (MXFP4: the E2M1 values, and sc[b][i] the block's scale factor) */
INL void h_decode(int kind, const void *w, const uint8_t *scales, size_t r, int R, size_t k, size_t b0, size_t nb,
                  float *wb, float *sc) {
    const size_t kb = k / 2, ks = k / 32;
    const mxfp4_bs mb = mxfp4_bs_consts();
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
        for (size_t b = 0; b < nb; b++) {
            __m256 v[4];
            if (kind == DS4F_MM_MXFP4) { /* the matvec's weights and scale */
                mxfp4_block_e2m1(&mb, (const uint8_t *)w + (r + i) * kb + 16 * (b0 + b), v);
                sc[b * R + i] = DS4F_SCALE(scales[(r + i) * ks + b0 + b]);
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

/* One 32-block step of 2 tokens x 3 rows: a[n][i][0] += w[i][m] x[n][m] for m = 0, 2 and
 * a[n][i][1] for m = 1, 3, in that order.  w: the block's 3 rows in the tile (32 floats each),
 * x0, x1: the tokens' prepared 32 floats.  ymm13/14 hold x, ymm15 the weight vector. */
#define H_STEP(m, p)                                                                                     \
    "vmovups " #m "*32(%[x0]), %%ymm13\n\t"                                                            \
    "vmovups " #m "*32(%[x1]), %%ymm14\n\t"                                                            \
    "vmovaps " #m "*32(%[w]), %%ymm15\n\t"                                                             \
    "vfmadd231ps %%ymm15, %%ymm13, %[a00" #p "]\n\t"                                                   \
    "vfmadd231ps %%ymm15, %%ymm14, %[a10" #p "]\n\t"                                                   \
    "vmovaps 128+" #m "*32(%[w]), %%ymm15\n\t"                                                         \
    "vfmadd231ps %%ymm15, %%ymm13, %[a01" #p "]\n\t"                                                   \
    "vfmadd231ps %%ymm15, %%ymm14, %[a11" #p "]\n\t"                                                   \
    "vmovaps 256+" #m "*32(%[w]), %%ymm15\n\t"                                                         \
    "vfmadd231ps %%ymm15, %%ymm13, %[a02" #p "]\n\t"                                                   \
    "vfmadd231ps %%ymm15, %%ymm14, %[a12" #p "]\n\t"
INL void h_block_2x3(const float *w, const float *x0, const float *x1, __m256 a[H_T][H_R][2]) {
    __asm__(H_STEP(0, 0) H_STEP(1, 1) H_STEP(2, 0) H_STEP(3, 1)
            : [a000] "+x"(a[0][0][0]), [a001] "+x"(a[0][0][1]), [a010] "+x"(a[0][1][0]), [a011] "+x"(a[0][1][1]),
              [a020] "+x"(a[0][2][0]), [a021] "+x"(a[0][2][1]), [a100] "+x"(a[1][0][0]), [a101] "+x"(a[1][0][1]),
              [a110] "+x"(a[1][1][0]), [a111] "+x"(a[1][1][1]), [a120] "+x"(a[1][2][0]), [a121] "+x"(a[1][2][1])
            : [w] "r"(w), [x0] "r"(x0), [x1] "r"(x1)
            : "xmm13", "xmm14", "xmm15", "memory");
}
#undef H_STEP

/* NT tokens (1..H_T) from xr (row stride ldx) on R rows (1..H_R) over the chunk's nb blocks
 * (wb: block b's rows at wb + b * ws): their accumulators come from accm[n][i0 + i] (zero in the
 * first chunk) and go back there, or, after the last chunk, the finished results to y. */
INL void h_tokens(int NT, int R, const float *wb, size_t ws, size_t nb, int first, int last, const float *xr,
                  size_t ldx, __m256 (*accm)[H_RB][2], int i0, float *y, size_t ldy, size_t r) {
    __m256 a[H_T][H_R][2];
    _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++)
        _Pragma("GCC unroll 3") for (int i = 0; i < R; i++) {
            a[n][i][0] = first ? _mm256_setzero_ps() : accm[n][i0 + i][0];
            a[n][i][1] = first ? _mm256_setzero_ps() : accm[n][i0 + i][1];
        }
    if (NT == H_T && R == H_R) {
        for (size_t b = 0; b < nb; b++) h_block_2x3(wb + b * ws, xr + 32 * b, xr + ldx + 32 * b, a);
    } else { /* the tile's last rows or tokens: the same steps, as the compiler lays them out */
        for (size_t b = 0; b < nb; b++) {
            const float *wr = wb + b * ws;
            _Pragma("GCC unroll 4") for (int m = 0; m < 4; m++) {
                __m256 xv[H_T];
                _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++) xv[n] = _mm256_loadu_ps(xr + n * ldx + 32 * b + 8 * m);
                _Pragma("GCC unroll 3") for (int i = 0; i < R; i++) {
                    const __m256 wv = _mm256_load_ps(wr + 32 * i + 8 * m);
                    _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++) a[n][i][m & 1] = _mm256_fmadd_ps(wv, xv[n], a[n][i][m & 1]);
                }
            }
        }
    }
    _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++)
        _Pragma("GCC unroll 3") for (int i = 0; i < R; i++) {
            if (last) {
                y[n * ldy + r + i0 + i] = finish(a[n][i][0], a[n][i][1]);
            } else {
                accm[n][i0 + i][0] = a[n][i][0];
                accm[n][i0 + i][1] = a[n][i][1];
            }
        }
}

/* One MXFP4 32-block step of 2 tokens x 3 rows, the matvec's operations per (token, row): the
 * partial p[n][i] = w[i][0] x[n][0], + w[i][1] x[n][1], + w[i][2] x[n][2], + w[i][3] x[n][3],
 * then a[n][i] += p[n][i] * sc[i].  w: the block's 3 rows in the tile (32 floats each), sc their
 * scale factors, x0, x1: the tokens' prepared 32 floats.  ymm7..12 hold the partials, ymm13/14
 * x, ymm15 the weight vector, then the scale. */
#define MX_STEP(m, op)                                                                                   \
    "vmovups " #m "*32(%[x0]), %%ymm13\n\t"                                                            \
    "vmovups " #m "*32(%[x1]), %%ymm14\n\t"                                                            \
    "vmovaps " #m "*32(%[w]), %%ymm15\n\t"                                                             \
    op " %%ymm15, %%ymm13, %%ymm7\n\t"                                                                 \
    op " %%ymm15, %%ymm14, %%ymm10\n\t"                                                                \
    "vmovaps 128+" #m "*32(%[w]), %%ymm15\n\t"                                                         \
    op " %%ymm15, %%ymm13, %%ymm8\n\t"                                                                 \
    op " %%ymm15, %%ymm14, %%ymm11\n\t"                                                                \
    "vmovaps 256+" #m "*32(%[w]), %%ymm15\n\t"                                                         \
    op " %%ymm15, %%ymm13, %%ymm9\n\t"                                                                 \
    op " %%ymm15, %%ymm14, %%ymm12\n\t"
#define MX_SCALE(i, p0, p1)                                                                              \
    "vbroadcastss " #i "*4(%[sc]), %%ymm15\n\t"                                                        \
    "vfmadd231ps %%ymm15, %%ymm" #p0 ", %[a0" #i "]\n\t"                                               \
    "vfmadd231ps %%ymm15, %%ymm" #p1 ", %[a1" #i "]\n\t"
INL void mx_block_2x3(const float *w, const float *sc, const float *x0, const float *x1, __m256 a[H_T][H_R]) {
    __asm__(MX_STEP(0, "vmulps") MX_STEP(1, "vfmadd231ps") MX_STEP(2, "vfmadd231ps") MX_STEP(3, "vfmadd231ps")
                MX_SCALE(0, 7, 10) MX_SCALE(1, 8, 11) MX_SCALE(2, 9, 12)
            : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a02] "+x"(a[0][2]), [a10] "+x"(a[1][0]),
              [a11] "+x"(a[1][1]), [a12] "+x"(a[1][2])
            : [w] "r"(w), [sc] "r"(sc), [x0] "r"(x0), [x1] "r"(x1)
            : "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory");
}
#undef MX_SCALE
#undef MX_STEP

/* MXFP4, as h_tokens: NT tokens on R rows over the chunk's nb blocks (wb: block b's rows at
 * wb + b * ws, their scale factors at sc + b * ss); accumulators in accm[n][i0 + i][0] */
INL void mx_tokens(int NT, int R, const float *wb, size_t ws, const float *sc, size_t ss, size_t nb, int first,
                   int last, const float *xr, size_t ldx, __m256 (*accm)[H_RB][2], int i0, float *y, size_t ldy,
                   size_t r) {
    __m256 a[H_T][H_R];
    _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++)
        _Pragma("GCC unroll 3") for (int i = 0; i < R; i++) a[n][i] = first ? _mm256_setzero_ps() : accm[n][i0 + i][0];
    if (NT == H_T && R == H_R) {
        for (size_t b = 0; b < nb; b++) mx_block_2x3(wb + b * ws, sc + b * ss, xr + 32 * b, xr + ldx + 32 * b, a);
    } else { /* the tile's last rows or tokens: the same steps, as the compiler lays them out */
        for (size_t b = 0; b < nb; b++) {
            _Pragma("GCC unroll 3") for (int i = 0; i < R; i++) {
                const float *wr = wb + b * ws + 32 * i;
                const __m256 w[4] = {_mm256_load_ps(wr), _mm256_load_ps(wr + 8), _mm256_load_ps(wr + 16),
                                     _mm256_load_ps(wr + 24)};
                _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++) {
                    const float *xq = xr + n * ldx + 32 * b;
                    const __m256 p = mx_partial(w, _mm256_loadu_ps(xq), _mm256_loadu_ps(xq + 8), _mm256_loadu_ps(xq + 16),
                                                _mm256_loadu_ps(xq + 24));
                    a[n][i] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(sc + b * ss + i), a[n][i]);
                }
            }
        }
    }
    _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++)
        _Pragma("GCC unroll 3") for (int i = 0; i < R; i++) {
            if (last)
                y[n * ldy + r + i0 + i] = hsum8(a[n][i]);
            else
                accm[n][i0 + i][0] = a[n][i];
        }
}

/* rows r..r+R-1 (R <= H_RB) for all nt tokens */
INL void h_rows(int kind, const void *w, const uint8_t *scales, size_t r, int R, size_t k, size_t nt,
                const float *xp, size_t ldx, float *y, size_t ldy) {
    const size_t ks = k / 32;
    float wb[H_RB * MM_KC * 32] __attribute__((aligned(32))), sc[H_RB * MM_KC];
    __m256 accm[H_TB][H_RB][2];
    for (size_t t0 = 0; t0 < nt; t0 += H_TB) {
        const size_t tn = nt - t0 < H_TB ? nt - t0 : H_TB;
        for (size_t c = 0; c < ks; c += MM_KC) {
            const size_t nb = ks - c < MM_KC ? ks - c : MM_KC;
            const int first = c == 0, last = c + nb == ks;
            h_decode(kind, w, scales, r, R, k, c, nb, wb, sc);
            for (size_t t = 0; t < tn; t += H_T) {
                const float *xr = xp + (t0 + t) * ldx + 32 * c;
                float *yt = y + (t0 + t) * ldy;
                const int nn = t + H_T <= tn ? H_T : (int)(tn - t);
                for (int i0 = 0; i0 < R; i0 += H_R) {
                    const int rr = R - i0 < H_R ? R - i0 : H_R;
                    const float *wg = wb + 32 * i0;
                    const size_t ws = 32 * (size_t)R;
                    if (kind == DS4F_MM_MXFP4 && nn == H_T && rr == H_R) /* the usual cases, spelled out for the compiler */
                        mx_tokens(H_T, H_R, wg, ws, sc + i0, R, nb, first, last, xr, ldx, accm + t, i0, yt, ldy, r);
                    else if (kind == DS4F_MM_MXFP4)
                        mx_tokens(nn, rr, wg, ws, sc + i0, R, nb, first, last, xr, ldx, accm + t, i0, yt, ldy, r);
                    else if (nn == H_T && rr == H_R)
                        h_tokens(H_T, H_R, wg, ws, nb, first, last, xr, ldx, accm + t, i0, yt, ldy, r);
                    else
                        h_tokens(nn, rr, wg, ws, nb, first, last, xr, ldx, accm + t, i0, yt, ldy, r);
                }
            }
        }
    }
}

/* A few tokens (2..MX_FEW: an expert two or three of a verify pass's rows chose, a small batch's):
 * as for FP8 below, the decoded tile only pays from ~4 tokens.  Each row goes as in the matvec
 * (avx2_matvec.c's mx_rows, R = 1): a block's E2M1 values made once in registers, then per token
 * mx_partial and the scale into its accumulator: each token's result is mxfp4_matvec's, bit for
 * bit.  x comes prepared by prep_mx (the matvec's own order).  Rows go FEW_RB at a time, each over
 * a slice of FEW_KC elements of k before the next row takes it: the tokens' slices of x (4 x 4
 * KiB) stay in L1 for the FEW_RB rows, where whole rows of 4 tokens' x (64 KiB at k = 4096) came
 * from L2 for every row.  A (row, token)'s steps keep their order: only rows interleave. */
#define MX_FEW 4
#define FEW_RB 8     /* MXFP4 / FP8 few tokens: rows that take a slice of k in turn */
#define FEW_KC 1024  /* ... and the slice's elements (a multiple of 32 and of the FP8 tile) */

INL void mx_few_rows(const int NT, const mxfp4_bs *mb, const uint8_t *codes, const uint8_t *scales, size_t r, int R,
                     size_t k, const float *xp, size_t ldx, float *y, size_t ldy) {
    const size_t kb = k / 2, ks = k / 32;
    __m256 accm[FEW_RB][MX_FEW]; /* each (row, token)'s accumulator between k slices */
    for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) accm[i][n] = _mm256_setzero_ps();
    for (size_t b0 = 0; b0 < ks; b0 += FEW_KC / 32) {
        const size_t b1 = b0 + FEW_KC / 32 < ks ? b0 + FEW_KC / 32 : ks;
        for (int i = 0; i < R; i++) {
            const uint8_t *c0 = codes + (r + i) * kb, *s0 = scales + (r + i) * ks;
            /* what comes next: the next row's slice, after the last row the first row's next slice */
            const uint8_t *pf = i + 1 < R ? c0 + kb : codes + r * kb + 16 * (FEW_KC / 32);
            __m256 acc[MX_FEW];
            _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) acc[n] = accm[i][n];
            for (size_t b = b0; b < b1; b++) {
                if ((b & 3) == 0) _mm_prefetch((const char *)(pf + 16 * b), _MM_HINT_T0);
                __m256 w[4];
                mxfp4_block_e2m1(mb, c0 + 16 * b, w);
                _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) {
                    const float *xq = xp + n * ldx + 32 * b;
                    acc[n] = mx_scale_add(mx_partial(w, _mm256_loadu_ps(xq), _mm256_loadu_ps(xq + 8),
                                                     _mm256_loadu_ps(xq + 16), _mm256_loadu_ps(xq + 24)),
                                          s0[b], acc[n]);
                }
            }
            _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) accm[i][n] = acc[n];
        }
    }
    for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) y[n * ldy + r + i] = hsum8(accm[i][n]);
}

INL void mx_few(const int NT, const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1, size_t k,
                const float *xp, size_t ldx, float *y, size_t ldy) {
    const mxfp4_bs mb = mxfp4_bs_consts();
    for (size_t r = r0; r < r1; r += FEW_RB)
        mx_few_rows(NT, &mb, codes, scales, r, r1 - r < FEW_RB ? (int)(r1 - r) : FEW_RB, k, xp, ldx, y, ldy);
}

T256 static void mxfp4_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                          const float *xp, size_t ldx, float *y, size_t ldy) {
    switch (nt) { /* constant token counts, so the compiler keeps the accumulators in registers */
    case 2: mx_few(2, w, scales, r0, r1, k, xp, ldx, y, ldy); return;
    case 3: mx_few(3, w, scales, r0, r1, k, xp, ldx, y, ldy); return;
    case 4: mx_few(4, w, scales, r0, r1, k, xp, ldx, y, ldy); return;
    default: break;
    }
    size_t r = r0;
    for (; r + H_RB <= r1; r += H_RB) h_rows(DS4F_MM_MXFP4, w, scales, r, H_RB, k, nt, xp, ldx, y, ldy);
    if (r < r1) h_rows(DS4F_MM_MXFP4, w, scales, r, (int)(r1 - r), k, nt, xp, ldx, y, ldy);
}

T256 static void bf16_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                         const float *xp, size_t ldx, float *y, size_t ldy) {
    size_t r = r0;
    for (; r + H_RB <= r1; r += H_RB) h_rows(DS4F_MM_BF16, w, scales, r, H_RB, k, nt, xp, ldx, y, ldy);
    if (r < r1) h_rows(DS4F_MM_BF16, w, scales, r, (int)(r1 - r), k, nt, xp, ldx, y, ldy);
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

/* NT tokens (1..FP8_NT) from xt (row stride ldx) on R rows (1..MM_R) over the chunk's ntl tiles
 * (wb: tile tt's 32-chunk q of these rows at wb + (tt * 4 + q) * ws): per tile a partial p per
 * (token, row) from zero in registers (each weight vector loaded once for all NT tokens, each x
 * vector once for all R rows), then fp8_tile_add into the token's accumulators in accm */
INL void fp8_tokens(int NT, int R, const float *wb, size_t ws, const uint8_t *const *sr, const float (*fac)[FP8_RB],
                    int big, size_t c, size_t ntl, size_t k, const float *xt, size_t ldx, __m256 (*accm)[FP8_RB]) {
    for (size_t tt = 0; tt < ntl; tt++) {
        const size_t j0 = (c + tt) * DS4F_FP8_TILE, nq = fp8_chunks(j0, k);
        __m256 p[FP8_NT][MM_R];
        _Pragma("GCC unroll 2") for (int n = 0; n < NT; n++)
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) p[n][i] = _mm256_setzero_ps();
        for (size_t q = 0; q < nq; q++) {
            const float *wq = wb + (tt * 4 + q) * ws;
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

/* rows r..r+R-1 (R <= FP8_RB) for all nt tokens, MM_R rows at a time over each decoded chunk */
INL void fp8_rows(const uint8_t *w, const uint8_t *scales, size_t r, int R, size_t k, size_t nt, const float *xp,
                  size_t ldx, float *y, size_t ldy) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE;
    float wb[FP8_KT * 4 * FP8_RB * 32] __attribute__((aligned(32)));
    __m256 accm[DS4F_MM_TB][FP8_RB];
    const uint8_t *sr[FP8_RB];
    for (int i = 0; i < R; i++) sr[i] = scales + (r + i) / DS4F_FP8_TILE * kt;
    for (size_t t0 = 0; t0 < nt; t0 += DS4F_MM_TB) {
        const size_t tn = nt - t0 < DS4F_MM_TB ? nt - t0 : DS4F_MM_TB;
        __m256i nan[FP8_RB];
        for (int i = 0; i < R; i++) nan[i] = _mm256_setzero_si256();
        for (size_t t = 0; t < tn; t++)
            for (int i = 0; i < R; i++) accm[t][i] = _mm256_setzero_ps();
        for (size_t c = 0; c < kt; c += FP8_KT) {
            const size_t ntl = kt - c < FP8_KT ? kt - c : FP8_KT;
            fp8_decode(w, r, R, k, c, ntl, wb, nan);
            float fac[FP8_KT][FP8_RB]; /* each tile's factor, hoisted out of the token loop */
            int big = 0;               /* a scale whose factor overflows: fp8_tile_add's slow case */
            for (size_t tt = 0; tt < ntl; tt++)
                for (int i = 0; i < R; i++) {
                    const uint8_t b = sr[i][c + tt];
                    big |= !ds4f_fp8_factor_fits(b);
                    fac[tt][i] = ds4f_fp8_factor(b);
                }
            for (size_t t = 0; t < tn; t += FP8_NT) {
                const float *xt = xp + (t0 + t) * ldx;
                const int nn = t + FP8_NT <= tn ? FP8_NT : (int)(tn - t);
                for (int i0 = 0; i0 < R; i0 += MM_R) {
                    const int rr = R - i0 < MM_R ? R - i0 : MM_R;
                    const float *wg = wb + 32 * i0;
                    const float (*fg)[FP8_RB] = (const float (*)[FP8_RB])&fac[0][i0];
                    __m256 (*ag)[FP8_RB] = (__m256 (*)[FP8_RB])&accm[t][i0];
                    if (nn == FP8_NT && rr == MM_R) /* the usual case, spelled out for the compiler */
                        fp8_tokens(FP8_NT, MM_R, wg, 32 * (size_t)R, sr + i0, fg, big, c, ntl, k, xt, ldx, ag);
                    else
                        fp8_tokens(nn, rr, wg, 32 * (size_t)R, sr + i0, fg, big, c, ntl, k, xt, ldx, ag);
                }
            }
        }
        for (size_t t = 0; t < tn; t++)
            for (int i = 0; i < R; i++) y[(t0 + t) * ldy + r + i] = fp8_result(accm[t][i], nan[i]);
    }
}

/* A few tokens (2..FP8_FEW: a verify pass's rows, a small batch's): the decoded tile above costs
 * about what a matvec does, so below ~4 tokens it loses to one matvec per token.  Instead each
 * row goes as in fp8_matvec (avx2_matvec.c's fp8_rows, R = 1): every 32-byte chunk widened once
 * in registers, then per token its 4 FMAs into that token's tile partial, in the matvec's order,
 * and the tile's fp8_tile_add: each token's result is fp8_matvec's, bit for bit.  x comes
 * prepared (prep_fp8 is the matvec's own permutation).  Rows go FEW_RB at a time over slices of
 * k, as for MXFP4 above; the next row's bytes are prefetched a tile ahead. */
#define FP8_FEW 4

INL void fp8_few_rows(const int NT, const uint8_t *w, const uint8_t *scales, size_t r, int R, size_t k,
                      const float *xp, size_t ldx, float *y, size_t ldy) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE, st = FEW_KC / DS4F_FP8_TILE;
    __m256 accm[FEW_RB][FP8_FEW]; /* each (row, token)'s accumulator between k slices */
    __m256i nanm[FEW_RB];
    for (int i = 0; i < R; i++) {
        nanm[i] = _mm256_setzero_si256();
        _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) accm[i][n] = _mm256_setzero_ps();
    }
    for (size_t t0 = 0; t0 < kt; t0 += st) {
        const size_t t1 = t0 + st < kt ? t0 + st : kt;
        for (int i = 0; i < R; i++) {
            const uint8_t *wr = w + (r + i) * k, *sr = scales + (r + i) / DS4F_FP8_TILE * kt;
            /* what comes next: the next row's slice, after the last row the first row's next slice */
            const uint8_t *pf = i + 1 < R ? wr + k : w + r * k + FEW_KC;
            __m256 p[FP8_FEW], acc[FP8_FEW];
            __m256i nan = nanm[i];
            _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) p[n] = _mm256_setzero_ps(), acc[n] = accm[i][n];
            for (size_t t = t0; t < t1; t++) {
                const size_t j0 = t * DS4F_FP8_TILE, j1 = j0 + DS4F_FP8_TILE < k ? j0 + DS4F_FP8_TILE : k;
                _mm_prefetch((const char *)pf + j0, _MM_HINT_T0);
                _mm_prefetch((const char *)pf + j0 + 64, _MM_HINT_T0);
                for (size_t j = j0; j < j1; j += 32) {
                    const __m256i v =
                        j + 32 <= k ? _mm256_loadu_si256((const __m256i *)(wr + j)) : fp8_load_tail(wr + j, k - j);
                    nan = fp8_nan_max(nan, v);
                    __m256 f[4];
                    fp8_widen32(v, f);
                    _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) {
                        const float *xq = xp + n * ldx + j;
                        __m256 q = p[n];
                        q = _mm256_fmadd_ps(f[0], _mm256_loadu_ps(xq), q);
                        q = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xq + 8), q);
                        q = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xq + 16), q);
                        q = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xq + 24), q);
                        p[n] = q;
                    }
                }
                _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) {
                    acc[n] = fp8_tile_add(p[n], sr[t], acc[n]);
                    p[n] = _mm256_setzero_ps();
                }
            }
            nanm[i] = nan;
            _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) accm[i][n] = acc[n];
        }
    }
    for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int n = 0; n < NT; n++) y[n * ldy + r + i] = fp8_result(accm[i][n], nanm[i]);
}

INL void fp8_few(const int NT, const uint8_t *w, const uint8_t *scales, size_t r0, size_t r1, size_t k,
                 const float *xp, size_t ldx, float *y, size_t ldy) {
    for (size_t r = r0; r < r1; r += FEW_RB)
        fp8_few_rows(NT, w, scales, r, r1 - r < FEW_RB ? (int)(r1 - r) : FEW_RB, k, xp, ldx, y, ldy);
}

T256 static void fp8_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                        const float *xp, size_t ldx, float *y, size_t ldy) {
    switch (nt) { /* constant token counts, so the compiler keeps the partials in registers */
    case 2: fp8_few(2, w, scales, r0, r1, k, xp, ldx, y, ldy); return;
    case 3: fp8_few(3, w, scales, r0, r1, k, xp, ldx, y, ldy); return;
    case 4: fp8_few(4, w, scales, r0, r1, k, xp, ldx, y, ldy); return;
    default: break;
    }
    size_t r = r0;
    for (; r + FP8_RB <= r1; r += FP8_RB) fp8_rows(w, scales, r, FP8_RB, k, nt, xp, ldx, y, ldy);
    if (r < r1) fp8_rows(w, scales, r, (int)(r1 - r), k, nt, xp, ldx, y, ldy);
}

const ds4f_mtable ds4f_mt_avx2 = {{mxfp4_mm, bf16_mm, fp8_mm}, {prep_mx, prep_h, prep_fp8}, {32, 32, 32}};
#endif
