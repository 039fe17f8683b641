/* x86/avx2_matvec.c — AVX2 + FMA + F16C backend (target attributes only; see x86/avx512_matvec.c).
 *
 * decode (ds4f_mxfp4_decode): vpermps on ymm has an 8-entry table, so the 16-entry E2M1 LUT is
 * two scaled 8-entry tables (positive and negative magnitudes) and the code's sign bit selects
 * between them with vblendvps (which reads only bit 31: the sign bit shifted there).  Selecting
 * the product keeps decode bit-identical to scalar, NaN blocks included.
 *
 * matvec: per row and 32-element block, kernels_avx2.h's block step: the block's E2M1 values
 * (mxfp4_block_e2m1, unscaled) times x in their lanes (x reordered once per call, shared by 4
 * rows), summed, then the partial sum times the block's scale into the row's accumulator.
 * The step count and the figures against ggml's kernels: kernels_avx2.h and docs/kernels.md.
 */
#include <stdint.h>

#include "kernels_avx2.h"

#ifdef DS4F_X86

/* decode: duplicate each code byte (c0 c0 c1 c1 ...), widen to dwords, shift odd lanes by 4:
 * lane j then holds code j in bits 3:0.  Large 64-byte-aligned outputs use non-temporal
 * stores (same bits, no cache thrash), as in x86/avx512_matvec.c. */
INL void store8(float *o, __m256 w, int stream) {
    if (stream)
        _mm256_stream_ps(o, w);
    else
        _mm256_storeu_ps(o, w);
}

INL void decode_row(const uint8_t *c, const uint8_t *s, size_t ks, float *o, int stream) {
    const __m256i shift = _mm256_set_epi32(4, 0, 4, 0, 4, 0, 4, 0);
    for (size_t b = 0; b < ks; b++) {
        const lut8 l = scaled_lut(s[b]);
        const __m128i cb = _mm_loadu_si128((const __m128i *)(c + 16 * b));
        const __m128i d0 = _mm_unpacklo_epi8(cb, cb), d1 = _mm_unpackhi_epi8(cb, cb);
        const __m256i v0 = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(d0), shift);
        const __m256i v1 = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(d0, 8)), shift);
        const __m256i v2 = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(d1), shift);
        const __m256i v3 = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(d1, 8)), shift);
        store8(o + 32 * b, lookup(l, v0, _mm256_slli_epi32(v0, 28)), stream);
        store8(o + 32 * b + 8, lookup(l, v1, _mm256_slli_epi32(v1, 28)), stream);
        store8(o + 32 * b + 16, lookup(l, v2, _mm256_slli_epi32(v2, 28)), stream);
        store8(o + 32 * b + 24, lookup(l, v3, _mm256_slli_epi32(v3, 28)), stream);
    }
}

T256 static void decode_rows(const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1,
                             size_t k, float *out) {
    const size_t kb = k / 2, ks = k / 32;
    const int stream = ((uintptr_t)out & 63) == 0 && (r1 - r0) * k * sizeof(float) >= (1u << 20);
    for (size_t r = r0; r < r1; r++) {
        if (stream)
            decode_row(codes + r * kb, scales + r * ks, ks, out + r * k, 1);
        else
            decode_row(codes + r * kb, scales + r * ks, ks, out + r * k, 0);
    }
    if (stream) _mm_sfence();
}

/* Rows r..r+R-1 (R = 1 or 4, the same op sequence per row either way); loops over them
 * unrolled, so that a row's state stays in registers. */
#define FOR_ROWS(R, stmt)                                                                          \
    do {                                                                                           \
        _Pragma("GCC unroll 4") for (int i_ = 0; i_ < (R); i_++) { stmt; }                         \
    } while (0)

/* MXFP4 matvec: x reordered once per call into xp (mx_prep32's order per 32-block); rows 4 at a
 * time share each x vector; per row and block mx_partial of the block's E2M1 values, then
 * mx_scale_add into the row's accumulator; the result hsum8 of it. */
#define MX_XMAX 8192 /* k up to this: x prepared on the stack (32 KiB); beyond, block by block */

INL void mx_x_block(const float *x, const float *xp, size_t b, __m256 xv[4]) {
    if (xp) {
        xv[0] = _mm256_load_ps(xp + 32 * b), xv[1] = _mm256_load_ps(xp + 32 * b + 8);
        xv[2] = _mm256_load_ps(xp + 32 * b + 16), xv[3] = _mm256_load_ps(xp + 32 * b + 24);
    } else {
        mx_prep32(x + 32 * b, xv);
    }
}

/* rows r..r+R-1 (R = 1 or 4) */
INL void mx_rows(int R, const mxfp4_bs *m, const uint8_t *codes, const uint8_t *scales, size_t r, size_t r1, size_t k,
                 const float *x, const float *xp, float *y) {
    const size_t kb = k / 2, ks = k / 32;
    const uint8_t *c0 = codes + r * kb, *s0 = scales + r * ks;
    const int ahead = R == 4 && r + 4 < r1; /* the next group's bytes follow this one's */
    __m256 acc[4];
    FOR_ROWS(R, acc[i_] = _mm256_setzero_ps());
    for (size_t b = 0; b < ks; b++) {
        if (ahead) MXFP4_PREFETCH(c0, s0, kb, ks, b);
        __m256 xv[4];
        mx_x_block(x, xp, b, xv);
        FOR_ROWS(R, {
            __m256 w[4];
            mxfp4_block_e2m1(m, c0 + i_ * kb + 16 * b, w);
            acc[i_] = mx_scale_add(mx_partial(w, xv[0], xv[1], xv[2], xv[3]), s0[i_ * ks + b], acc[i_]);
        });
    }
    FOR_ROWS(R, y[r + i_] = hsum8(acc[i_]));
}

INL void mx_matvec(const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1, size_t k, const float *x,
                   const float *xp, float *y) {
    const mxfp4_bs m = mxfp4_bs_consts();
    size_t r = r0;
    for (; r + 4 <= r1; r += 4) mx_rows(4, &m, codes, scales, r, r1, k, x, xp, y);
    for (; r < r1; r++) mx_rows(1, &m, codes, scales, r, r1, k, x, xp, y);
}

T256 static void matvec_rows(const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1, size_t k,
                             const float *x, float *y) {
    if (k <= MX_XMAX) {
        float xp[MX_XMAX] __attribute__((aligned(32)));
        for (size_t b = 0; b < k / 32; b++) {
            __m256 xv[4];
            mx_prep32(x + 32 * b, xv);
            for (int i = 0; i < 4; i++) _mm256_store_ps(xp + 32 * b + 8 * i, xv[i]);
        }
        mx_matvec(codes, scales, r0, r1, k, x, xp, y);
    } else {
        mx_matvec(codes, scales, r0, r1, k, x, NULL, y);
    }
}

INL void bf16_half(const uint16_t *w, __m256 xe, __m256 xo, __m256 *alo, __m256 *ahi) {
    __m256 we, wo;
    bf16_half8(w, &we, &wo);
    *alo = _mm256_fmadd_ps(we, xe, *alo);
    *ahi = _mm256_fmadd_ps(wo, xo, *ahi);
}

#define BF16_BLOCK(wr, a, bb)                                 \
    do {                                                       \
        bf16_half((wr) + 32 * b, xe0, xo0, &(a), &(bb));       \
        bf16_half((wr) + 32 * b + 16, xe1, xo1, &(a), &(bb));  \
    } while (0)

T256 static void bf16_rows(const uint16_t *w, size_t r0, size_t r1, size_t k, const float *x,
                           float *y) {
    const size_t nb = k / 32;
    size_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const uint16_t *w0 = w + r * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
        for (size_t b = 0; b < nb; b++) {
            __m256 xe0, xo0, xe1, xo1;
            deinterleave(x + 32 * b, &xe0, &xo0);
            deinterleave(x + 32 * b + 16, &xe1, &xo1);
            BF16_BLOCK(w0, a0, b0);
            BF16_BLOCK(w1, a1, b1);
            BF16_BLOCK(w2, a2, b2);
            BF16_BLOCK(w3, a3, b3);
        }
        y[r] = finish(a0, b0);
        y[r + 1] = finish(a1, b1);
        y[r + 2] = finish(a2, b2);
        y[r + 3] = finish(a3, b3);
    }
    for (; r < r1; r++) {
        const uint16_t *w0 = w + r * k;
        __m256 a0 = _mm256_setzero_ps(), b0 = a0;
        for (size_t b = 0; b < nb; b++) {
            __m256 xe0, xo0, xe1, xo1;
            deinterleave(x + 32 * b, &xe0, &xo0);
            deinterleave(x + 32 * b + 16, &xe1, &xo1);
            BF16_BLOCK(w0, a0, b0);
        }
        y[r] = finish(a0, b0);
    }
}

/* ---- FP8 E4M3 with 128x128 E8M0 tiles ---------------------------------------------------------
 *
 * The AVX-512 backend's method at 256 bits (see x86/avx512_matvec.c for the why): per 32 bytes,
 * vpmaddubsw widens the even / odd bytes to words sext(b) << 7, AND 0xBFFF makes them the fp16
 * e4m3(b) / 2^8, vcvtph2ps (F16C) widens 8 at a time, FMA with x permuted to the same lanes
 * (0, 2, .., 14 | 16, .., 30 | 1, .., 15 | 17, .., 31), and a tile's partial sum is multiplied
 * by 2^(b-119) (or 2^8, then 2^(b-127), for b >= 247).  NaN codes: max(b & 0x7F) == 0x7F.  4
 * rows share each x load (their state partly spills with 16 ymm registers; 2 rows at a time is
 * no faster), the next group is prefetched (fp8_prefetch_next).  k tails go through zero-filled
 * 32-byte copies.  ~15-16 G weights/s on one core of a Sapphire Rapids VM (AVX-512 ~20), ~10-11 on
 * a Zen 3 one, where llvm-mca (znver3) finds all four FP pipes busy: ~24 cycles for 4 rows x 32
 * weights, the 2-uop conversions (4 per 32 weights) the largest share.  An integer decode (spread
 * each byte to a dword's top byte, an arithmetic shift and a mask: e4m3 * 2^-120, one multiply by
 * 2^120) gives the same bits but needs more uops, and measured ~40% slower there.
 */

#define FP8_XMAX 8192    /* x floats permuted into the stack buffer (32 KiB); larger k: per chunk */
/* The next 4-row group's bytes follow this group's (4k of them): while a group computes tile t,
 * the next group's bytes 512t..512t+511 are prefetched, so that the whole next group is on its
 * way by the time it starts.  Prefetching ahead within each row instead (as the hardware does)
 * leaves every group's start to wait on RAM, which on short rows (k = 1024: 4 KiB per group) kept
 * a matrix streamed from RAM at ~0.3 of the memory floor on one core (~0.7 with it, Zen 3). */
INL void fp8_prefetch_next(const uint8_t *next, size_t from, size_t to) {
    for (size_t o = from; o < to; o += 64) _mm_prefetch((const char *)next + o, _MM_HINT_T0);
}

typedef struct {
    __m256 p, acc; /* tile partial (e4m3/2^8 * x), row total */
    __m256i nan;   /* bytewise max of (b & 0x7F) */
} fp8_row;

INL void fp8_row_init(fp8_row *s) {
    s->p = s->acc = _mm256_setzero_ps();
    s->nan = _mm256_setzero_si256();
}

INL void fp8_x_chunk(const float *x, const float *xb, size_t j, size_t k, __m256 xv[4]) {
    if (xb) {
        xv[0] = _mm256_load_ps(xb + j), xv[1] = _mm256_load_ps(xb + j + 8);
        xv[2] = _mm256_load_ps(xb + j + 16), xv[3] = _mm256_load_ps(xb + j + 24);
    } else {
        fp8_x_perm(x, j, k, xv);
    }
}

INL void fp8_chunk(__m256i v, const __m256 xv[4], fp8_row *s) {
    __m256 f[4];
    fp8_widen32(v, f);
    s->nan = fp8_nan_max(s->nan, v);
    __m256 p = s->p;
    p = _mm256_fmadd_ps(f[0], xv[0], p);
    p = _mm256_fmadd_ps(f[1], xv[1], p);
    p = _mm256_fmadd_ps(f[2], xv[2], p);
    p = _mm256_fmadd_ps(f[3], xv[3], p);
    s->p = p;
}

INL void fp8_tile_end(fp8_row *s, uint8_t b) {
    s->acc = fp8_tile_add(s->p, b, s->acc);
    s->p = _mm256_setzero_ps();
}

INL float fp8_row_end(const fp8_row *s) { return fp8_result(s->acc, s->nan); }

INL void fp8_rows(const uint8_t *w, const uint8_t *scales, size_t r, int R, int ahead, size_t k, const float *x,
                  const float *xb, float *y) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE, full = k / DS4F_FP8_TILE;
    const uint8_t *wr[4], *sr[4];
    fp8_row st[4];
    FOR_ROWS(R, (wr[i_] = w + (r + i_) * k, sr[i_] = scales + (r + i_) / DS4F_FP8_TILE * kt,
                     fp8_row_init(&st[i_])));
    __m256 xv[4];
    const uint8_t *next = ahead ? w + (r + 4) * k : NULL;
    for (size_t t = 0; t < full; t++) {
        const size_t j0 = t * DS4F_FP8_TILE;
        if (next) fp8_prefetch_next(next, 4 * j0, 4 * j0 + 4 * DS4F_FP8_TILE);
        for (size_t j = j0; j < j0 + DS4F_FP8_TILE; j += 32) {
            fp8_x_chunk(x, xb, j, k, xv);
            FOR_ROWS(R, fp8_chunk(_mm256_loadu_si256((const __m256i *)(wr[i_] + j)), xv, &st[i_]));
        }
        FOR_ROWS(R, fp8_tile_end(&st[i_], sr[i_][t]));
    }
    if (k > full * DS4F_FP8_TILE) {
        size_t j = full * DS4F_FP8_TILE;
        if (next) fp8_prefetch_next(next, 4 * j, 4 * k);
        for (; j + 32 <= k; j += 32) {
            fp8_x_chunk(x, xb, j, k, xv);
            FOR_ROWS(R, fp8_chunk(_mm256_loadu_si256((const __m256i *)(wr[i_] + j)), xv, &st[i_]));
        }
        if (j < k) {
            fp8_x_chunk(x, xb, j, k, xv);
            FOR_ROWS(R, fp8_chunk(fp8_load_tail(wr[i_] + j, k - j), xv, &st[i_]));
        }
        FOR_ROWS(R, fp8_tile_end(&st[i_], sr[i_][full]));
    }
    FOR_ROWS(R, y[r + i_] = fp8_row_end(&st[i_]));
}

INL void fp8_matvec_impl(const uint8_t *w, const uint8_t *scales, size_t r0, size_t r1, size_t k,
                         const float *x, const float *xb, float *y) {
    size_t r = r0;
    for (; r + 4 <= r1; r += 4) fp8_rows(w, scales, r, 4, r + 8 <= r1, k, x, xb, y);
    for (; r < r1; r++) fp8_rows(w, scales, r, 1, 0, k, x, xb, y);
}

T256 static void fp8_matvec_rows(const uint8_t *w, const uint8_t *scales, size_t r0, size_t r1,
                                 size_t k, const float *x, float *y) {
    if (k <= FP8_XMAX) {
        float xb[FP8_XMAX + 32] __attribute__((aligned(32)));
        for (size_t j = 0; j < k; j += 32) {
            __m256 xv[4];
            fp8_x_perm(x, j, k, xv);
            for (int i = 0; i < 4; i++) _mm256_store_ps(xb + j + 8 * i, xv[i]);
        }
        fp8_matvec_impl(w, scales, r0, r1, k, x, xb, y);
    } else {
        fp8_matvec_impl(w, scales, r0, r1, k, x, NULL, y);
    }
}

/* decode in natural order, 16 elements at a time (same fp16 trick, one multiply by the factor,
 * NaN codes replaced by the quiet NaN): the scalar decode's bits. */
INL void fp8_decode16(const uint8_t *c, uint8_t b, float *o) {
    const __m128i v = _mm_loadu_si128((const __m128i *)c);
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(v), 7),
                                       _mm256_set1_epi16((short)0xBFFF));
    const __m128i nan = _mm_cmpeq_epi8(_mm_or_si128(v, _mm_set1_epi8((char)0x80)), _mm_set1_epi8((char)0xFF));
    const __m256 qnan = _mm256_castsi256_ps(_mm256_set1_epi32((int)DS4F_QNAN_BITS));
    __m256 f[2] = {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
    const __m256i nm[2] = {_mm256_cvtepi8_epi32(nan), _mm256_cvtepi8_epi32(_mm_srli_si128(nan, 8))};
    for (int i = 0; i < 2; i++) {
        __m256 val = ds4f_fp8_factor_fits(b)
                         ? _mm256_mul_ps(f[i], _mm256_set1_ps(ds4f_fp8_factor(b)))
                         : _mm256_mul_ps(_mm256_mul_ps(f[i], _mm256_set1_ps(256.0f)), _mm256_set1_ps(DS4F_SCALE(b)));
        _mm256_storeu_ps(o + 8 * i, _mm256_blendv_ps(val, qnan, _mm256_castsi256_ps(nm[i])));
    }
}

T256 static void fp8_decode_rows(const uint8_t *w, const uint8_t *scales, size_t r0, size_t r1,
                                 size_t k, float *out) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE;
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * k, *sr = scales + r / DS4F_FP8_TILE * kt;
        float *o = out + r * k;
        size_t j = 0;
        for (; j + 16 <= k; j += 16) fp8_decode16(wr + j, sr[j / DS4F_FP8_TILE], o + j);
        if (j < k) {
            uint8_t c[16] = {0};
            float t[16];
            for (size_t i = 0; i < k - j; i++) c[i] = wr[j + i];
            fp8_decode16(c, sr[j / DS4F_FP8_TILE], t);
            for (size_t i = 0; i < k - j; i++) o[j + i] = t[i];
        }
    }
}

const ds4f_ktable ds4f_kt_avx2 = {"avx2", decode_rows, matvec_rows, bf16_rows, fp8_decode_rows,
                                  fp8_matvec_rows};
#endif
