/* kernels_avx512.h — the AVX-512 steps that the single-vector kernels (x86/avx512_matvec.c) and the
 * multi-token ones (x86/avx512_matmul.c) share.  A multi-token result equals the single-vector one
 * bit for bit because both go through these very functions: the same decode, the same lane
 * order, the same per-tile scaling and the same final reduction.
 */
#ifndef DS4F_KERNELS_AVX512_H
#define DS4F_KERNELS_AVX512_H
#include "kernels_internal.h"

#ifdef DS4F_X86
#include <immintrin.h>

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) T512

/* the E2M1 table times a block's scale: exact products */
INL __m512 scaled_lut(uint8_t s) {
    return _mm512_mul_ps(_mm512_loadu_ps(ds4f_e2m1), _mm512_set1_ps(DS4F_SCALE(s)));
}

/* one MXFP4 block (16 code bytes): w_lo = elements 0, 2, .., 30 and w_hi = 1, 3, .., 31 */
INL void mxfp4_eo(const uint8_t *c, uint8_t s, __m512 *wlo, __m512 *whi) {
    const __m512 lut = scaled_lut(s);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    *wlo = _mm512_permutexvar_ps(v, lut);
    *whi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
}

/* 32 bf16 weights: the even elements are the low halves (<< 16), the odd ones the high halves */
INL void bf16_eo(const uint16_t *w, __m512 *we, __m512 *wo) {
    const __m512i v = _mm512_loadu_si512((const void *)w);
    *we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *wo = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

/* x[0..31] -> its even elements (xe) and its odd ones (xo), each in order */
INL void x_eo(const float *x, __m512 *xe, __m512 *xo) {
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    *xe = _mm512_permutex2var_ps(x0, ie, x1);
    *xo = _mm512_permutex2var_ps(x0, io, x1);
}

/* an MXFP4 / bf16 row's result from its two accumulators */
INL float finish(__m512 alo, __m512 ahi) { return _mm512_reduce_add_ps(_mm512_add_ps(alo, ahi)); }

/* ---- FP8 (see x86/avx512_matvec.c for the method) ---- */

/* x[j..j+63] (zero past k) in the lane order of fp8_widen64 */
INL void fp8_x_perm(const float *x, size_t j, size_t k, __m512 xv[4]) {
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512 a[4];
    if (j + 64 <= k) {
        a[0] = _mm512_loadu_ps(x + j), a[1] = _mm512_loadu_ps(x + j + 16);
        a[2] = _mm512_loadu_ps(x + j + 32), a[3] = _mm512_loadu_ps(x + j + 48);
    } else {
        for (int i = 0; i < 4; i++) {
            const size_t lo = j + 16 * (size_t)i;
            const size_t n = lo >= k ? 0 : k - lo >= 16 ? 16 : k - lo;
            a[i] = _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), x + lo);
        }
    }
    xv[0] = _mm512_permutex2var_ps(a[0], ie, a[1]);
    xv[1] = _mm512_permutex2var_ps(a[2], ie, a[3]);
    xv[2] = _mm512_permutex2var_ps(a[0], io, a[1]);
    xv[3] = _mm512_permutex2var_ps(a[2], io, a[3]);
}

/* 64 E4M3 bytes -> e4m3(b) / 2^8 as fp32, exact: f[0] = even bytes 0..30, f[1] = even bytes
 * 32..62, f[2] = odd bytes 1..31, f[3] = odd bytes 33..63 (the NaN codes come out finite) */
INL void fp8_widen64(__m512i v, __m512 f[4]) {
    const __m512i m = _mm512_set1_epi16((short)0xBFFF);
    const __m512i he = _mm512_and_si512(_mm512_maddubs_epi16(_mm512_set1_epi16(0x0080), v), m);
    const __m512i ho = _mm512_and_si512(_mm512_maddubs_epi16(_mm512_set1_epi16((short)0x8000), v), m);
    f[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(he));
    f[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(he, 1));
    f[2] = _mm512_cvtph_ps(_mm512_castsi512_si256(ho));
    f[3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(ho, 1));
}

/* bytewise max of (b & 0x7F): 0x7F somewhere = a NaN code */
INL __m512i fp8_nan_max(__m512i nan, __m512i v) {
    return _mm512_max_epu8(nan, _mm512_and_si512(v, _mm512_set1_epi8(0x7F)));
}

/* n < 64 trailing bytes of a row (masked off = code 0 = +0, against x = 0) */
INL __m512i fp8_load_tail(const uint8_t *w, size_t n) {
    return _mm512_maskz_loadu_epi8(((__mmask64)1 << n) - 1, w);
}

/* acc + a tile's partial sum p times its scale (and the 2^8 of the fp16 trick) */
INL __m512 fp8_tile_add(__m512 p, uint8_t b, __m512 acc) {
    if (ds4f_fp8_factor_fits(b)) return _mm512_fmadd_ps(p, _mm512_set1_ps(ds4f_fp8_factor(b)), acc);
    /* 2^(b-119) overflows: scale p by 2^8 first (exact), then by 2^(b-127) */
    return _mm512_fmadd_ps(_mm512_mul_ps(p, _mm512_set1_ps(256.0f)), _mm512_set1_ps(DS4F_SCALE(b)), acc);
}

/* a row's result: the sum of its lanes, or the quiet NaN if it holds a NaN code */
INL float fp8_result(__m512 acc, __m512i nan) {
    const float y = _mm512_reduce_add_ps(acc);
    if (_mm512_cmpeq_epi8_mask(nan, _mm512_set1_epi8(0x7F))) {
        const union {
            uint32_t u;
            float f;
        } q = {DS4F_QNAN_BITS};
        return q.f;
    }
    return y;
}

#endif
#endif
