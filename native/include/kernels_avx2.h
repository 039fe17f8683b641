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

/* 8 code bytes (16 elements): wlo = elements 0, 2, .., 14, whi = 1, 3, .., 15 */
INL void mxfp4_half8(const uint8_t *c, lut8 l, __m256 *wlo, __m256 *whi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    *wlo = lookup(l, v, _mm256_slli_epi32(v, 28));
    *whi = lookup(l, _mm256_srli_epi32(v, 4), _mm256_slli_epi32(v, 24));
}

/* ---- MXFP4 through integers: the matvec's and the multi-token tile's decode ----------------------
 *
 * The LUT above costs four lane-crossing vpermps (two uops each on Zen 3) and two blends per 16
 * weights, which bound the old matvec on the shuffle pipes.  Here every shuffle stays in its
 * 128-bit lane and no multiply is spent on the decode (removing the multiply from an earlier form
 * of this decode, which converted and then scaled, was worth ~7% on Zen 3):
 *   - the 16 code bytes of a block are broadcast to both lanes, and vpshufb looks up
 *     u = 2 * e2m1 + 12 (0..24) for the low nibbles and for the high ones;
 *   - the exponent bytes of M = 2^(s-105) (s the block's scale) are blended into the lookup results'
 *     spare dwords (each lane spreads only 8 of its 16 bytes);
 *   - a second vpshufb spreads u to the low byte of each dword lane and M's bytes above it: the
 *     float M + u * 2^(s-128), exact;
 *   - one subtraction of C = M + 12 * 2^(s-128) leaves (u - 12) * 2^(s-128) = e2m1(c) * 2^(s-127),
 *     exactly (Sterbenz: two floats within a factor 2 of each other).
 * These are the decode's weights, in mxfp4_half8's lanes.  Code 8 (-0) becomes +0: no sum can tell,
 * as the accumulators start at +0 and a sum that rounds to zero is +0, so an accumulator is never -0
 * (and 0 * inf or NaN is the same NaN).  M is a normal float for s <= 232: rows with a larger scale
 * (weights beyond 2^105, and the NaN scale) take the LUT steps, which give the same weights, so
 * which path a row takes never shows in its result. */

/* s -> the bits of M = 2^(s-105) and of C = M + 12 * 2^(s-128), for s <= MXFP4_INT_MAX_SCALE
 * (0 above: unused); each read with a broadcast load, which costs no shuffle */
#define MXM(b) ((b) > 232 ? 0u : (uint32_t)((b) + 22) << 23)
#define MXC(b) ((b) > 232 ? 0u : MXM(b) + 12u)
#define MX4(F, b) F(b), F((b) + 1), F((b) + 2), F((b) + 3)
#define MX16(F, b) MX4(F, b), MX4(F, (b) + 4), MX4(F, (b) + 8), MX4(F, (b) + 12)
#define MX256(F) {{MX16(F, 0), MX16(F, 16), MX16(F, 32), MX16(F, 48), MX16(F, 64), MX16(F, 80), MX16(F, 96),          \
                   MX16(F, 112), MX16(F, 128), MX16(F, 144), MX16(F, 160), MX16(F, 176), MX16(F, 192), MX16(F, 208), \
                   MX16(F, 224), MX16(F, 240)}}
static const ds4f_byte_table mxfp4_magic = MX256(MXM), mxfp4_offset = MX256(MXC);
#undef MX256
#undef MX16
#undef MX4
#undef MXC
#undef MXM
#define MXFP4_INT_MAX_SCALE 232

/* the constants of the integer decode, loaded once per call */
typedef struct {
    __m256i table, nib, spread_lo, spread_hi; /* u (both lanes), 0x0F, the spreads: see mxfp4_block_int */
} mxfp4_int;

INL mxfp4_int mxfp4_int_consts(void) {
    mxfp4_int m;
    m.table = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, 18, 20, 24,
                               12, 11, 10, 9, 8, 6, 4, 0);
    m.nib = _mm256_set1_epi8(0x0F);
    /* dword j of the low lane: u of byte j (spread_lo) or 8 + j (spread_hi), then M's bytes from
     * bytes 6, 7 (that lane's spare dword 1); of the high lane: byte 4 + j or 12 + j, then bytes 2, 3
     * (its spare dword 0) */
#define Z (char)0x80
    m.spread_lo = _mm256_setr_epi8(0, Z, 6, 7, 1, Z, 6, 7, 2, Z, 6, 7, 3, Z, 6, 7, 4, Z, 2, 3, 5, Z, 2, 3, 6, Z, 2, 3, 7,
                                   Z, 2, 3);
    m.spread_hi = _mm256_setr_epi8(8, Z, 6, 7, 9, Z, 6, 7, 10, Z, 6, 7, 11, Z, 6, 7, 12, Z, 2, 3, 13, Z, 2, 3, 14, Z, 2, 3,
                                   15, Z, 2, 3);
#undef Z
    return m;
}

/* the 32 weights of one block (16 code bytes c, scale s <= MXFP4_INT_MAX_SCALE) in mxfp4_half8's
 * lanes: w[0], w[1] = elements 0, 2, .., 14 and 1, 3, .., 15; w[2], w[3] the same for 16..31 */
INL void mxfp4_block_int(const mxfp4_int *m, const uint8_t *c, uint8_t s, __m256 w[4]) {
    const __m256i cb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)c));
    const __m256i mg = _mm256_castps_si256(_mm256_broadcast_ss(&mxfp4_magic.f[s]));
    /* 0x12: dword 1 of the low lane and dword 0 of the high lane, which their spreads leave unread */
    const __m256i lo = _mm256_blend_epi32(_mm256_shuffle_epi8(m->table, _mm256_and_si256(cb, m->nib)), mg, 0x12);
    const __m256i hi =
        _mm256_blend_epi32(_mm256_shuffle_epi8(m->table, _mm256_and_si256(_mm256_srli_epi16(cb, 4), m->nib)), mg, 0x12);
    const __m256 off = _mm256_broadcast_ss(&mxfp4_offset.f[s]);
    w[0] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_shuffle_epi8(lo, m->spread_lo)), off);
    w[1] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_shuffle_epi8(hi, m->spread_lo)), off);
    w[2] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_shuffle_epi8(lo, m->spread_hi)), off);
    w[3] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_shuffle_epi8(hi, m->spread_hi)), off);
}

/* a block's weights by the integer steps (use_int: its scale is <= MXFP4_INT_MAX_SCALE) or the LUT */
INL void mxfp4_block_w(int use_int, const mxfp4_int *m, const uint8_t *c, uint8_t s, __m256 w[4]) {
    if (use_int) {
        mxfp4_block_int(m, c, s, w);
    } else {
        const lut8 l = scaled_lut(s);
        mxfp4_half8(c, l, &w[0], &w[1]);
        mxfp4_half8(c + 8, l, &w[2], &w[3]);
    }
}

/* every one of n scale bytes <= MXFP4_INT_MAX_SCALE */
INL int mxfp4_scales_int(const uint8_t *s, size_t n) {
    __m256i hi = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 32 <= n; i += 32) hi = _mm256_max_epu8(hi, _mm256_loadu_si256((const __m256i *)(s + i)));
    const __m256i bad = _mm256_cmpeq_epi8(_mm256_min_epu8(hi, _mm256_set1_epi8((char)(MXFP4_INT_MAX_SCALE + 1))),
                                          _mm256_set1_epi8((char)(MXFP4_INT_MAX_SCALE + 1)));
    if (_mm256_movemask_epi8(bad)) return 0;
    for (; i < n; i++)
        if (s[i] > MXFP4_INT_MAX_SCALE) return 0;
    return 1;
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

/* an MXFP4 / bf16 row's result from its two accumulators */
INL float finish(__m256 alo, __m256 ahi) {
    const __m256 s = _mm256_add_ps(alo, ahi);
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

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
