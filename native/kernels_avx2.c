/* kernels_avx2.c — AVX2 + FMA backend (target attributes only; see kernels_avx512.c).
 *
 * Same structure as the AVX-512 backend, with one difference forced by the ISA: vpermps on
 * ymm has an 8-entry table, so the 16-entry E2M1 LUT is two scaled 8-entry tables (positive
 * and negative magnitudes) and the code's sign bit selects between them with vblendvps (which
 * reads only bit 31: the sign bit shifted there).  Selecting the product keeps decode
 * bit-identical to scalar, NaN blocks included.
 *
 * matvec per row and 16 elements (8 code bytes): widen to 8 dwords, look up low and high
 * nibbles, FMA with x_even / x_odd (de-interleaved once, shared by 4 rows).
 */
#include <stdint.h>

#include "kernels_internal.h"

#ifdef DS4F_X86
#include <immintrin.h>

#define T256 __attribute__((target("avx2,fma")))
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

/* decode: duplicate each code byte (c0 c0 c1 c1 ...), widen to dwords, shift odd lanes by 4:
 * lane j then holds code j in bits 3:0.  Large 64-byte-aligned outputs use non-temporal
 * stores (same bits, no cache thrash), as in kernels_avx512.c. */
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

/* x[0..15] -> even elements and odd elements, each in order */
INL void deinterleave(const float *x, __m256 *xe, __m256 *xo) {
    const __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8);
    const __m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    const __m256 o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    *xe = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
    *xo = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
}

INL void mxfp4_half(const uint8_t *c, lut8 l, __m256 xe, __m256 xo, __m256 *alo, __m256 *ahi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    const __m256 wlo = lookup(l, v, _mm256_slli_epi32(v, 28));
    const __m256 whi = lookup(l, _mm256_srli_epi32(v, 4), _mm256_slli_epi32(v, 24));
    *alo = _mm256_fmadd_ps(wlo, xe, *alo);
    *ahi = _mm256_fmadd_ps(whi, xo, *ahi);
}

INL float finish(__m256 alo, __m256 ahi) {
    const __m256 s = _mm256_add_ps(alo, ahi);
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

/* one row, one 32-element block: two halves of 16 */
#define ROW_BLOCK(cr, sr, a, bb)                                      \
    do {                                                               \
        const lut8 l_ = scaled_lut((sr)[b]);                           \
        mxfp4_half((cr) + 16 * b, l_, xe0, xo0, &(a), &(bb));          \
        mxfp4_half((cr) + 16 * b + 8, l_, xe1, xo1, &(a), &(bb));      \
    } while (0)

T256 static void matvec_rows(const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1,
                             size_t k, const float *x, float *y) {
    const size_t kb = k / 2, ks = k / 32;
    size_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const uint8_t *c0 = codes + r * kb, *c1 = c0 + kb, *c2 = c1 + kb, *c3 = c2 + kb;
        const uint8_t *s0 = scales + r * ks, *s1 = s0 + ks, *s2 = s1 + ks, *s3 = s2 + ks;
        __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
        for (size_t b = 0; b < ks; b++) {
            __m256 xe0, xo0, xe1, xo1;
            deinterleave(x + 32 * b, &xe0, &xo0);
            deinterleave(x + 32 * b + 16, &xe1, &xo1);
            ROW_BLOCK(c0, s0, a0, b0);
            ROW_BLOCK(c1, s1, a1, b1);
            ROW_BLOCK(c2, s2, a2, b2);
            ROW_BLOCK(c3, s3, a3, b3);
        }
        y[r] = finish(a0, b0);
        y[r + 1] = finish(a1, b1);
        y[r + 2] = finish(a2, b2);
        y[r + 3] = finish(a3, b3);
    }
    for (; r < r1; r++) {
        const uint8_t *c0 = codes + r * kb, *s0 = scales + r * ks;
        __m256 a0 = _mm256_setzero_ps(), b0 = a0;
        for (size_t b = 0; b < ks; b++) {
            __m256 xe0, xo0, xe1, xo1;
            deinterleave(x + 32 * b, &xe0, &xo0);
            deinterleave(x + 32 * b + 16, &xe1, &xo1);
            ROW_BLOCK(c0, s0, a0, b0);
        }
        y[r] = finish(a0, b0);
    }
}

INL void bf16_half(const uint16_t *w, __m256 xe, __m256 xo, __m256 *alo, __m256 *ahi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)w);
    *alo = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), xe, *alo);
    *ahi = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))), xo, *ahi);
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

const ds4f_ktable ds4f_kt_avx2 = {"avx2", decode_rows, matvec_rows, bf16_rows};
#endif
