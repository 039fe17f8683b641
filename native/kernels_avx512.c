/* kernels_avx512.c — AVX-512 (F/BW/VL) backend.
 *
 * Only these functions get AVX-512 code, through target attributes: no global -mavx512 flags,
 * so the scalar reference and the dispatcher stay baseline x86-64.  The dispatcher calls in
 * here only after CPUID + XGETBV say the CPU and the OS support ZMM state.
 *
 * MXFP4 matvec, per row and 32-element block (16 code bytes, one scale):
 *   lut_s = E2M1 table (16 fp32) * scale          exact products: a per-block scaled LUT
 *   v     = zero-extend 16 code bytes to 16 dwords (vpmovzxbd)
 *   w_lo  = vpermps(v, lut_s)       vpermps reads index bits 3:0 = low nibble = elements 2i
 *   w_hi  = vpermps(v >> 4, lut_s)  high nibble = elements 2i+1
 *   acc_lo += w_lo * x_even;  acc_hi += w_hi * x_odd      (FMA)
 * Weights are decoded in registers, never through a scratch buffer (a round trip through memory
 * costs more than the decode).
 * x_even/x_odd are de-interleaved once per block and shared by 4 rows.  Each row has its
 * own two accumulators and the same op sequence whether it is processed in a group of 4 or
 * alone, so its bits never depend on the row split (thread count).
 *
 * Profile notes (Zen 4 VM, 2 cores; perf has no hardware counters here and valgrind cannot
 * decode AVX-512, so: a C micro-benchmark with L1-resident data vs the bench's real shapes,
 * plus the disassembly).  matvec's inner loop is ~32 vector uops per 4 rows x 32 weights, of
 * which 14 are shuffles; it runs at ~23 G weights/s from L1 and 19-23 from L3/DRAM on the
 * real shapes, i.e. compute-bound near the shuffle-port limit.  decode runs at ~19 G elem/s
 * from L1 (store-bound: 4 B written per element) but ~6-9 on the bench shape, whose 32 MB
 * fp32 output does not fit any cache: it is write-bandwidth bound, which non-temporal stores
 * only soften.  The scalar decode already does ~1 element/cycle, so 15x scalar would need
 * ~190 GB/s of stores.
 */
#include <stdint.h>

#include "kernels_internal.h"

#ifdef DS4F_X86
#include <immintrin.h>

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define INL static inline __attribute__((always_inline)) T512

INL __m512 scaled_lut(uint8_t s) {
    return _mm512_mul_ps(_mm512_loadu_ps(ds4f_e2m1), _mm512_set1_ps(DS4F_SCALE(s)));
}

/* decode: elements in natural order.  The 16 code bytes are broadcast to all four 128-bit
 * lanes (a load, no shuffle uop); vpshufb puts byte j/2 in dword lane j, and a variable shift
 * by 0/4 leaves code j in bits 3:0 (higher bits are ignored by vpermps).  4 shuffles per 32
 * elements.  Large outputs (a chunk of >= 1 MiB, 64-byte aligned) use non-temporal stores:
 * the result is the same, the write bypasses the cache it would only thrash. */
INL void decode_block(const uint8_t *c, uint8_t s, __m512i sh0, __m512i sh1, __m512i shift, __m512 *w0,
                      __m512 *w1) {
    const __m512 lut = scaled_lut(s);
    const __m512i cb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)c));
    *w0 = _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_shuffle_epi8(cb, sh0), shift), lut);
    *w1 = _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_shuffle_epi8(cb, sh1), shift), lut);
}

T512 static void decode_rows(const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1,
                             size_t k, float *out) {
    const size_t kb = k / 2, ks = k / 32;
    const __m512i shift = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    /* pshufb control: dword lane j takes byte j/2 (cb is broadcast, so every 128-bit lane
     * holds all 16 bytes) into its low byte and zeroes the rest; s1 does elements 16..31 */
    const __m512i s0 = _mm512_set_epi32(0x80808007, 0x80808007, 0x80808006, 0x80808006, 0x80808005, 0x80808005,
                                        0x80808004, 0x80808004, 0x80808003, 0x80808003, 0x80808002, 0x80808002,
                                        0x80808001, 0x80808001, 0x80808000, 0x80808000);
    const __m512i s1 = _mm512_add_epi32(s0, _mm512_set1_epi32(8));
    const int stream = ((uintptr_t)out & 63) == 0 && (r1 - r0) * k * sizeof(float) >= (1u << 20);
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *c = codes + r * kb, *s = scales + r * ks;
        float *o = out + r * k;
        if (stream) {
            for (size_t b = 0; b < ks; b++) {
                __m512 w0, w1;
                decode_block(c + 16 * b, s[b], s0, s1, shift, &w0, &w1);
                _mm512_stream_ps(o + 32 * b, w0);
                _mm512_stream_ps(o + 32 * b + 16, w1);
            }
        } else {
            for (size_t b = 0; b < ks; b++) {
                __m512 w0, w1;
                decode_block(c + 16 * b, s[b], s0, s1, shift, &w0, &w1);
                _mm512_storeu_ps(o + 32 * b, w0);
                _mm512_storeu_ps(o + 32 * b + 16, w1);
            }
        }
    }
    if (stream) _mm_sfence();
}

INL void mxfp4_block(const uint8_t *c, uint8_t s, __m512 xe, __m512 xo, __m512 *alo,
                     __m512 *ahi) {
    const __m512 lut = scaled_lut(s);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    *alo = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, lut), xe, *alo);
    *ahi = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut), xo, *ahi);
}

INL float finish(__m512 alo, __m512 ahi) { return _mm512_reduce_add_ps(_mm512_add_ps(alo, ahi)); }

T512 static void matvec_rows(const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1,
                             size_t k, const float *x, float *y) {
    const size_t kb = k / 2, ks = k / 32;
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    size_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const uint8_t *c0 = codes + r * kb, *c1 = c0 + kb, *c2 = c1 + kb, *c3 = c2 + kb;
        const uint8_t *s0 = scales + r * ks, *s1 = s0 + ks, *s2 = s1 + ks, *s3 = s2 + ks;
        __m512 a0 = _mm512_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
        for (size_t b = 0; b < ks; b++) {
            const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
            const __m512 xe = _mm512_permutex2var_ps(x0, ie, x1), xo = _mm512_permutex2var_ps(x0, io, x1);
            mxfp4_block(c0 + 16 * b, s0[b], xe, xo, &a0, &b0);
            mxfp4_block(c1 + 16 * b, s1[b], xe, xo, &a1, &b1);
            mxfp4_block(c2 + 16 * b, s2[b], xe, xo, &a2, &b2);
            mxfp4_block(c3 + 16 * b, s3[b], xe, xo, &a3, &b3);
        }
        y[r] = finish(a0, b0);
        y[r + 1] = finish(a1, b1);
        y[r + 2] = finish(a2, b2);
        y[r + 3] = finish(a3, b3);
    }
    for (; r < r1; r++) {
        const uint8_t *c0 = codes + r * kb, *s0 = scales + r * ks;
        __m512 a0 = _mm512_setzero_ps(), b0 = a0;
        for (size_t b = 0; b < ks; b++) {
            const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
            const __m512 xe = _mm512_permutex2var_ps(x0, ie, x1), xo = _mm512_permutex2var_ps(x0, io, x1);
            mxfp4_block(c0 + 16 * b, s0[b], xe, xo, &a0, &b0);
        }
        y[r] = finish(a0, b0);
    }
}

/* bf16: 32 weights per 64-byte load; the even elements are the low halves (<< 16), the odd
 * ones the high halves (mask); x de-interleaved the same way as above. */
INL void bf16_block(const uint16_t *w, __m512 xe, __m512 xo, __m512 *alo, __m512 *ahi) {
    const __m512i v = _mm512_loadu_si512((const void *)w);
    const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
    *alo = _mm512_fmadd_ps(we, xe, *alo);
    *ahi = _mm512_fmadd_ps(wo, xo, *ahi);
}

T512 static void bf16_rows(const uint16_t *w, size_t r0, size_t r1, size_t k, const float *x,
                           float *y) {
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const size_t nb = k / 32;
    size_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const uint16_t *w0 = w + r * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        __m512 a0 = _mm512_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
        for (size_t b = 0; b < nb; b++) {
            const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
            const __m512 xe = _mm512_permutex2var_ps(x0, ie, x1), xo = _mm512_permutex2var_ps(x0, io, x1);
            bf16_block(w0 + 32 * b, xe, xo, &a0, &b0);
            bf16_block(w1 + 32 * b, xe, xo, &a1, &b1);
            bf16_block(w2 + 32 * b, xe, xo, &a2, &b2);
            bf16_block(w3 + 32 * b, xe, xo, &a3, &b3);
        }
        y[r] = finish(a0, b0);
        y[r + 1] = finish(a1, b1);
        y[r + 2] = finish(a2, b2);
        y[r + 3] = finish(a3, b3);
    }
    for (; r < r1; r++) {
        const uint16_t *w0 = w + r * k;
        __m512 a0 = _mm512_setzero_ps(), b0 = a0;
        for (size_t b = 0; b < nb; b++) {
            const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
            const __m512 xe = _mm512_permutex2var_ps(x0, ie, x1), xo = _mm512_permutex2var_ps(x0, io, x1);
            bf16_block(w0 + 32 * b, xe, xo, &a0, &b0);
        }
        y[r] = finish(a0, b0);
    }
}

const ds4f_ktable ds4f_kt_avx512 = {"avx512", decode_rows, matvec_rows, bf16_rows};
#endif
