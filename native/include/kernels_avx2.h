/* kernels_avx2.h — the AVX2 steps that the single-vector kernels (x86/avx2_matvec.c) and the
 * multi-token ones (x86/avx2_matmul.c) share, so that both compute every result with the same
 * decode, lane order, per-tile scaling and final reduction.
 */
#ifndef DS4F_KERNELS_AVX2_H
#define DS4F_KERNELS_AVX2_H
#include "kernels_internal.h"

#ifdef DS4F_X86
#include <immintrin.h>

#define T256 __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) T256

/* MXFP4 decode (x86/avx2_matvec.c): the 16 E2M1 values times the block's scale, as two 8-entry tables */
typedef struct {
    __m256 pos, neg;
} lut8;

INL lut8 scaled_lut(uint8_t s) {
    const __m256 sc = _mm256_set1_ps(DS4F_SCALE(s));
    lut8 l = {_mm256_mul_ps(_mm256_loadu_ps(ds4f_e2m1), sc), _mm256_mul_ps(_mm256_loadu_ps(ds4f_e2m1 + 8), sc)};
    return l;
}

/* lane value: bits 2:0 magnitude index, bit `signbit` the sign (moved to bit 31 for blendv) */
INL __m256 lookup(lut8 l, __m256i idx, __m256i sign31) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(l.pos, idx), _mm256_permutevar8x32_ps(l.neg, idx),
                            _mm256_castsi256_ps(sign31));
}

/* ---- MXFP4: the matvec's and the multi-token kernels' block step ---------------------------------
 *
 * A block's 32 products are summed unscaled, then the block's partial sum is multiplied by its
 * scale 2^(s-127) once, into the row's accumulator (one FMA per block and row).  The weights are
 * then the E2M1 values themselves, whatever the block: exact small floats whose bits are a bf16
 * (two bytes: sign and exponent high bits, exponent low bit and mantissa), which in-lane steps
 * build from the codes with no per-block constant:
 *   - the block's 16 code bytes are broadcast to both lanes, shifted right by 0 (low lane) or 4
 *     (high lane) and masked: the low lane holds the 16 even elements' codes, the high lane the 16
 *     odd ones';
 *   - two vpshufb look up the bf16's high and low byte of each code;
 *   - vpunpck{l,h}bw interleave them into bf16 words (16 per register);
 *   - a word moves into its float's high half by a shift (even words) or a mask (odd words).
 * Per 32 weights that is 10 steps and 5 FMAs (4 products, 1 scale), against 15 steps and 4 FMAs
 * when every weight carries its scale.  x comes in the lane order these steps leave (mx_prep32).
 * Code 8 (-0) is -0.0: the partial sum of a block of zeros may be -0, and the scale FMA adds it to
 * an accumulator that starts at +0, which stays +0.  A 255 scale is the NaN and makes the row
 * NaN.  The only difference from decode-then-multiply, besides rounding, is for scale bytes 253
 * and 254, where a decoded weight of 4 or 6 (253), 2 and up (254) overflows fp32: here the block's
 * sum is scaled instead, finite where it fits (as in float64). */
typedef struct {
    __m256i hi, lo, shift, nib, himask; /* the byte tables, the lanes' shifts, 0x0F, 0xFFFF0000 */
} mxfp4_bs;

INL mxfp4_bs mxfp4_bs_consts(void) {
    mxfp4_bs m;
#define P(a, b, c, d, e, f, g, h) a, b, c, d, e, f, g, h
#define N (char)0x80, (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0
    /* code c -> the high byte of bf16(e2m1(c)): 0, 0.5, 1, 1.5 (0x3F..), 2, 3, 4, 6 (0x40..), then negated */
    m.hi = _mm256_setr_epi8(P(0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40), N, P(0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40), N);
#undef N
#define L P(0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0)
    m.lo = _mm256_setr_epi8(L, L, L, L); /* its low byte, the same for c and c ^ 8 */
#undef L
#undef P
    m.shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    m.nib = _mm256_set1_epi8(0x0F);
    m.himask = _mm256_set1_epi32((int)0xFFFF0000u);
    return m;
}

/* the 32 E2M1 values of one block (16 code bytes c), unscaled, in mx_prep32's lanes */
INL void mxfp4_block_e2m1(const mxfp4_bs *m, const uint8_t *c, __m256 w[4]) {
    const __m256i cb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)c));
    const __m256i n = _mm256_and_si256(_mm256_srlv_epi32(cb, m->shift), m->nib);
    const __m256i h = _mm256_shuffle_epi8(m->hi, n), l = _mm256_shuffle_epi8(m->lo, n);
    const __m256i w0 = _mm256_unpacklo_epi8(l, h), w1 = _mm256_unpackhi_epi8(l, h);
    w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
    w[1] = _mm256_castsi256_ps(_mm256_and_si256(w0, m->himask));
    w[2] = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    w[3] = _mm256_castsi256_ps(_mm256_and_si256(w1, m->himask));
}

/* x[0..31] in mxfp4_block_e2m1's lanes: elements 0, 4, 8, 12, 1, 5, 9, 13 | 2, 6, 10, 14, 3, 7, 11, 15 |
 * the same + 16 | + 16 */
INL void mx_prep32(const float *x, __m256 xv[4]) {
    const __m256i p = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int h = 0; h < 2; h++) {
        const __m256 a = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + 16 * h), p);     /* 0 4 1 5 | 2 6 3 7 */
        const __m256 b = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + 16 * h + 8), p); /* 8 12 9 13 | ... */
        const __m256 lo = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
        const __m256 hi = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
        xv[2 * h] = _mm256_permute2f128_ps(lo, hi, 0x20);     /* 0 4 8 12 | 1 5 9 13 */
        xv[2 * h + 1] = _mm256_permute2f128_ps(lo, hi, 0x31); /* 2 6 10 14 | 3 7 11 15 */
    }
}

/* a block's partial sum: w[0] x[0], then + w[1] x[1], + w[2] x[2], + w[3] x[3] (one rounding each) */
INL __m256 mx_partial(const __m256 w[4], __m256 x0, __m256 x1, __m256 x2, __m256 x3) {
    __m256 p = _mm256_mul_ps(w[0], x0);
    p = _mm256_fmadd_ps(w[1], x1, p);
    p = _mm256_fmadd_ps(w[2], x2, p);
    return _mm256_fmadd_ps(w[3], x3, p);
}

/* acc + a block's partial sum times its scale 2^(s-127) (NaN for 255) */
INL __m256 mx_scale_add(__m256 p, uint8_t s, __m256 acc) {
    return _mm256_fmadd_ps(p, _mm256_broadcast_ss(&DS4F_SCALE(s)), acc);
}

/* 16 bf16 weights: the even elements are the low halves (<< 16), the odd ones the high halves */
INL void bf16_half8(const uint16_t *w, __m256 *we, __m256 *wo) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)w);
    *we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *wo = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/* x[0..15] -> even elements and odd elements, each in order */
INL void deinterleave(const float *x, __m256 *xe, __m256 *xo) {
    const __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8);
    const __m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    const __m256 o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    *xe = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
    *xo = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
}

/* the sum of a vector's lanes: an MXFP4 row's result from its accumulator */
INL float hsum8(__m256 s) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

/* a bf16 row's result from its two accumulators */
INL float finish(__m256 alo, __m256 ahi) { return hsum8(_mm256_add_ps(alo, ahi)); }

/* ---- FP8 (see x86/avx2_matvec.c and x86/avx512_matvec.c for the method) ---- */

/* x[j..j+31] (zero past k) in the lane order of fp8_widen32 */
INL void fp8_x_perm(const float *x, size_t j, size_t k, __m256 xv[4]) {
    float tail[32];
    const float *src = x + j;
    if (j + 32 > k) {
        for (size_t i = 0; i < 32; i++) tail[i] = j + i < k ? x[j + i] : 0.0f;
        src = tail;
    }
    deinterleave(src, &xv[0], &xv[2]);
    deinterleave(src + 16, &xv[1], &xv[3]);
}

/* 32 E4M3 bytes -> e4m3(b) / 2^8 as fp32, exact, in the lane order of fp8_x_perm */
INL void fp8_widen32(__m256i v, __m256 f[4]) {
    const __m256i m = _mm256_set1_epi16((short)0xBFFF);
    const __m256i he = _mm256_and_si256(_mm256_maddubs_epi16(_mm256_set1_epi16(0x0080), v), m);
    const __m256i ho = _mm256_and_si256(_mm256_maddubs_epi16(_mm256_set1_epi16((short)0x8000), v), m);
    f[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(he));
    f[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(he, 1));
    f[2] = _mm256_cvtph_ps(_mm256_castsi256_si128(ho));
    f[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(ho, 1));
}

/* bytewise max of (b & 0x7F): 0x7F somewhere = a NaN code */
INL __m256i fp8_nan_max(__m256i nan, __m256i v) {
    return _mm256_max_epu8(nan, _mm256_and_si256(v, _mm256_set1_epi8(0x7F)));
}

/* n < 32 trailing bytes of a row, zero-filled (code 0 = +0, against x = 0) */
INL __m256i fp8_load_tail(const uint8_t *w, size_t n) {
    uint8_t b[32] = {0};
    for (size_t i = 0; i < n; i++) b[i] = w[i];
    return _mm256_loadu_si256((const __m256i *)b);
}

/* acc + a tile's partial sum p times its scale (and the 2^8 of the fp16 trick) */
INL __m256 fp8_tile_add(__m256 p, uint8_t b, __m256 acc) {
    if (ds4f_fp8_factor_fits(b)) return _mm256_fmadd_ps(p, _mm256_set1_ps(ds4f_fp8_factor(b)), acc);
    /* 2^(b-119) overflows: scale p by 2^8 first (exact), then by 2^(b-127) */
    return _mm256_fmadd_ps(_mm256_mul_ps(p, _mm256_set1_ps(256.0f)), _mm256_set1_ps(DS4F_SCALE(b)), acc);
}

/* a row's result: the sum of its lanes, or the quiet NaN if it holds a NaN code */
INL float fp8_result(__m256 acc, __m256i nan) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(nan, _mm256_set1_epi8(0x7F)))) {
        const union {
            uint32_t u;
            float f;
        } q = {DS4F_QNAN_BITS};
        return q.f;
    }
    return _mm_cvtss_f32(v);
}

#endif
#endif
