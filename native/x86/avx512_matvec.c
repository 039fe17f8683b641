/* x86/avx512_matvec.c — AVX-512 (F/BW/VL) backend.
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

#include "kernels_avx512.h"

#ifdef DS4F_X86

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
    __m512 wlo, whi;
    mxfp4_eo(c, s, &wlo, &whi);
    *alo = _mm512_fmadd_ps(wlo, xe, *alo);
    *ahi = _mm512_fmadd_ps(whi, xo, *ahi);
}

T512 static void matvec_rows(const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1,
                             size_t k, const float *x, float *y) {
    const size_t kb = k / 2, ks = k / 32;
    size_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const uint8_t *c0 = codes + r * kb, *c1 = c0 + kb, *c2 = c1 + kb, *c3 = c2 + kb;
        const uint8_t *s0 = scales + r * ks, *s1 = s0 + ks, *s2 = s1 + ks, *s3 = s2 + ks;
        __m512 a0 = _mm512_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
        const int ahead = r + 4 < r1; /* the next group's bytes follow this one's (see MXFP4_PREFETCH) */
        for (size_t b = 0; b < ks; b++) {
            if (ahead) MXFP4_PREFETCH(c0, s0, kb, ks, b);
            __m512 xe, xo;
            x_eo(x + 32 * b, &xe, &xo);
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
            __m512 xe, xo;
            x_eo(x + 32 * b, &xe, &xo);
            mxfp4_block(c0 + 16 * b, s0[b], xe, xo, &a0, &b0);
        }
        y[r] = finish(a0, b0);
    }
}

/* bf16: 32 weights per 64-byte load; the even elements are the low halves (<< 16), the odd
 * ones the high halves (mask); x de-interleaved the same way as above. */
INL void bf16_block(const uint16_t *w, __m512 xe, __m512 xo, __m512 *alo, __m512 *ahi) {
    __m512 we, wo;
    bf16_eo(w, &we, &wo);
    *alo = _mm512_fmadd_ps(we, xe, *alo);
    *ahi = _mm512_fmadd_ps(wo, xo, *ahi);
}

T512 static void bf16_rows(const uint16_t *w, size_t r0, size_t r1, size_t k, const float *x,
                           float *y) {
    const size_t nb = k / 32;
    size_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const uint16_t *w0 = w + r * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        __m512 a0 = _mm512_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
        for (size_t b = 0; b < nb; b++) {
            __m512 xe, xo;
            x_eo(x + 32 * b, &xe, &xo);
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
            __m512 xe, xo;
            x_eo(x + 32 * b, &xe, &xo);
            bf16_block(w0 + 32 * b, xe, xo, &a0, &b0);
        }
        y[r] = finish(a0, b0);
    }
}

/* ---- FP8 E4M3 with 128x128 E8M0 tiles ---------------------------------------------------------
 *
 * E4M3 -> fp16 in two integer ops: vpmaddubsw(0x80 | 0x00 per byte pair, w) widens the even (or,
 * with 0x00 | 0x80, the odd) bytes of 64 to words sext(b) << 7, i.e. sign copies in bits 15 and
 * 14 and b's 7 other bits in 13..7; AND 0xBFFF clears bit 14.  That is the fp16 whose value is
 * e4m3(b) / 2^8 exactly, subnormals included (E4M3's exponent field lands in fp16's low 4
 * exponent bits), and vcvtph2ps widens it to fp32 exactly.  The NaN codes (0x7F, 0xFF) come out
 * as the finite +-1.875 and are caught by a byte check instead: max(b & 0x7F) over a row is 0x7F.
 * The 2^8 is folded into the tile factor: a tile's partial sum p is multiplied by
 * 2^(b-127) * 2^8 = 2^(b-119), exact for b <= 246; for b = 247..254 that factor would overflow,
 * so p is first scaled by 2^8 (exact) — the same real product either way.  b = 255 (NaN) gives
 * NaN through the multiply.  Each row: p accumulates a tile with FMAs in a fixed lane order, then
 * acc = fma(p, factor, acc); the row's bits never depend on how rows are grouped or split.
 *
 * matvec per row and 64 bytes: 2 vpmaddubsw, 2 AND, 2 extracts, 4 vcvtph2ps (2 uops each), 4 FMA
 * and 2 for the NaN check: ~20 uops on the two 512-bit ports, so one core tops out near 20 G
 * weights/s (Sapphire Rapids VM, matrix in L2 or L3); the two uops of each conversion are the
 * bulk, and no cheaper exact decode of the subnormal codes was found (fp32 bit tricks make fp32
 * subnormals, which take microcode assists: 30x slower).  4 rows share each x load.  The even/odd
 * split puts the weights in lanes (0, 2, .., 30 | 32, .., 62 | 1, .., 31 | 33, .., 63): x is
 * permuted to match once per call into a stack buffer (or per chunk when k is beyond it).  Each
 * row is prefetched 512 bytes ahead, which lifts a matrix streamed from RAM from ~11.5 to ~13
 * G weights/s (the VM's single-core RAM read is ~16 GB/s).  The k tail: masked byte and x loads
 * (masked-off bytes read as code 0 = +0, against x = 0).
 */

#define FP8_XMAX 8192     /* x floats permuted into the stack buffer (32 KiB); larger k: per chunk */
#define FP8_PREFETCH 512  /* bytes ahead in each row: 4 tiles */

typedef struct {
    __m512 p, acc; /* tile partial (unscaled, e4m3/2^8 * x), row total */
    __m512i nan;   /* bytewise max of (b & 0x7F): 0x7F somewhere = a NaN code */
} fp8_row;

INL void fp8_row_init(fp8_row *s) {
    s->p = s->acc = _mm512_setzero_ps();
    s->nan = _mm512_setzero_si512();
}

/* the 4 x vectors of chunk j: from the permuted buffer, or permuted now */
INL void fp8_x_chunk(const float *x, const float *xb, size_t j, size_t k, __m512 xv[4]) {
    if (xb) {
        xv[0] = _mm512_load_ps(xb + j), xv[1] = _mm512_load_ps(xb + j + 16);
        xv[2] = _mm512_load_ps(xb + j + 32), xv[3] = _mm512_load_ps(xb + j + 48);
    } else {
        fp8_x_perm(x, j, k, xv);
    }
}

INL void fp8_chunk(__m512i v, const __m512 xv[4], fp8_row *s) {
    __m512 f[4];
    fp8_widen64(v, f);
    s->nan = fp8_nan_max(s->nan, v);
    __m512 p = s->p;
    p = _mm512_fmadd_ps(f[0], xv[0], p);
    p = _mm512_fmadd_ps(f[1], xv[1], p);
    p = _mm512_fmadd_ps(f[2], xv[2], p);
    p = _mm512_fmadd_ps(f[3], xv[3], p);
    s->p = p;
}

INL void fp8_tile_end(fp8_row *s, uint8_t b) {
    s->acc = fp8_tile_add(s->p, b, s->acc);
    s->p = _mm512_setzero_ps();
}

INL float fp8_row_end(const fp8_row *s) { return fp8_result(s->acc, s->nan); }

/* Rows r..r+R-1 (R = 1 or 4: the same op sequence per row either way).  Full tiles are two
 * 64-byte chunks; the last tile may be ragged (a full chunk and/or a masked one).  The row loops
 * are unrolled so that each row's state stays in registers. */
#define FP8_FOR_ROWS(R, stmt)                                                                      \
    do {                                                                                           \
        _Pragma("GCC unroll 4") for (int i_ = 0; i_ < (R); i_++) { stmt; }                         \
    } while (0)

INL void fp8_rows(const uint8_t *w, const uint8_t *scales, size_t r, int R, size_t k, const float *x,
                  const float *xb, float *y) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE, full = k / DS4F_FP8_TILE;
    const size_t rem = k - full * DS4F_FP8_TILE;
    const uint8_t *wr[4], *sr[4];
    fp8_row st[4];
    FP8_FOR_ROWS(R, (wr[i_] = w + (r + i_) * k, sr[i_] = scales + (r + i_) / DS4F_FP8_TILE * kt,
                     fp8_row_init(&st[i_])));
    __m512 xv[4];
    for (size_t t = 0; t < full; t++) {
        const size_t j = t * DS4F_FP8_TILE;
        fp8_x_chunk(x, xb, j, k, xv);
        FP8_FOR_ROWS(R, (_mm_prefetch((const char *)wr[i_] + j + FP8_PREFETCH, _MM_HINT_T0),
                         _mm_prefetch((const char *)wr[i_] + j + FP8_PREFETCH + 64, _MM_HINT_T0)));
        FP8_FOR_ROWS(R, fp8_chunk(_mm512_loadu_si512(wr[i_] + j), xv, &st[i_]));
        fp8_x_chunk(x, xb, j + 64, k, xv);
        FP8_FOR_ROWS(R, fp8_chunk(_mm512_loadu_si512(wr[i_] + j + 64), xv, &st[i_]));
        FP8_FOR_ROWS(R, fp8_tile_end(&st[i_], sr[i_][t]));
    }
    if (rem) {
        size_t j = full * DS4F_FP8_TILE;
        if (rem >= 64) {
            fp8_x_chunk(x, xb, j, k, xv);
            FP8_FOR_ROWS(R, fp8_chunk(_mm512_loadu_si512(wr[i_] + j), xv, &st[i_]));
            j += 64;
        }
        if (k > j) {
            fp8_x_chunk(x, xb, j, k, xv);
            FP8_FOR_ROWS(R, fp8_chunk(fp8_load_tail(wr[i_] + j, k - j), xv, &st[i_]));
        }
        FP8_FOR_ROWS(R, fp8_tile_end(&st[i_], sr[i_][full]));
    }
    FP8_FOR_ROWS(R, y[r + i_] = fp8_row_end(&st[i_]));
}

INL void fp8_matvec_impl(const uint8_t *w, const uint8_t *scales, size_t r0, size_t r1, size_t k,
                         const float *x, const float *xb, float *y) {
    size_t r = r0;
    for (; r + 4 <= r1; r += 4) fp8_rows(w, scales, r, 4, k, x, xb, y);
    for (; r < r1; r++) fp8_rows(w, scales, r, 1, k, x, xb, y);
}

T512 static void fp8_matvec_rows(const uint8_t *w, const uint8_t *scales, size_t r0, size_t r1,
                                 size_t k, const float *x, float *y) {
    if (k <= FP8_XMAX) {
        float xb[FP8_XMAX + 64] __attribute__((aligned(64)));
        for (size_t j = 0; j < k; j += 64) {
            __m512 xv[4];
            fp8_x_perm(x, j, k, xv);
            for (int i = 0; i < 4; i++) _mm512_store_ps(xb + j + 16 * i, xv[i]);
        }
        fp8_matvec_impl(w, scales, r0, r1, k, x, xb, y);
    } else {
        fp8_matvec_impl(w, scales, r0, r1, k, x, NULL, y);
    }
}

/* decode in natural order, 16 elements at a time: sign-extend bytes to words, << 7, AND 0xBFFF
 * (the same fp16 as above), widen, one multiply by 2^(b-119) (or 2^8 then 2^(b-127)), NaN codes
 * replaced by the quiet NaN.  Same bits as the scalar decode. */
INL __m512 fp8_decode16(__m128i v, uint8_t b) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(v), 7),
                                       _mm256_set1_epi16((short)0xBFFF));
    const __m512 f = _mm512_cvtph_ps(h);
    const __m512 val = ds4f_fp8_factor_fits(b)
                           ? _mm512_mul_ps(f, _mm512_set1_ps(ds4f_fp8_factor(b)))
                           : _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(256.0f)), _mm512_set1_ps(DS4F_SCALE(b)));
    const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_or_si128(v, _mm_set1_epi8((char)0x80)), _mm_set1_epi8((char)0xFF));
    return _mm512_mask_mov_ps(val, nan, _mm512_castsi512_ps(_mm512_set1_epi32((int)DS4F_QNAN_BITS)));
}

T512 static void fp8_decode_rows(const uint8_t *w, const uint8_t *scales, size_t r0, size_t r1,
                                 size_t k, float *out) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE;
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * k, *sr = scales + r / DS4F_FP8_TILE * kt;
        float *o = out + r * k;
        size_t j = 0;
        for (; j + 16 <= k; j += 16)
            _mm512_storeu_ps(o + j, fp8_decode16(_mm_loadu_si128((const __m128i *)(wr + j)), sr[j / DS4F_FP8_TILE]));
        if (j < k) {
            const __mmask16 m = (__mmask16)((1u << (k - j)) - 1);
            _mm512_mask_storeu_ps(o + j, m, fp8_decode16(_mm_maskz_loadu_epi8(m, wr + j), sr[j / DS4F_FP8_TILE]));
        }
    }
}

const ds4f_ktable ds4f_kt_avx512 = {"avx512", decode_rows, matvec_rows, bf16_rows, fp8_decode_rows,
                                    fp8_matvec_rows};
#endif
