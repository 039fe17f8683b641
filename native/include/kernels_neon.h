/* kernels_neon.h — the NEON steps that the single-vector kernels (arm/neon_matvec.c) and the
 * multi-token ones (arm/neon_matmul.c) share, so that both compute every result with the same
 * decode, lane order, per-tile scaling and final reduction.
 */
#ifndef DS4F_KERNELS_NEON_H
#define DS4F_KERNELS_NEON_H
#include "kernels_internal.h"

#ifdef DS4F_ARM64
#include <arm_neon.h>

#define INL static inline __attribute__((always_inline))

static const uint8_t BF16_HI[16] = {0x00, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40,
                                    0x80, 0xbf, 0xbf, 0xbf, 0xc0, 0xc0, 0xc0, 0xc0};
static const uint8_t BF16_LO[16] = {0x00, 0x00, 0x80, 0xc0, 0x00, 0x40, 0x80, 0xc0,
                                    0x00, 0x00, 0x80, 0xc0, 0x00, 0x40, 0x80, 0xc0};

/* 16 codes (one per byte, natural order) -> 16 unscaled fp32 in w[0..3] */
INL void e2m1x16(uint8x16_t n, uint8x16_t thi, uint8x16_t tlo, float32x4_t w[4]) {
    const uint8x16_t h = vqtbl1q_u8(thi, n), l = vqtbl1q_u8(tlo, n);
    const uint16x8_t a = vreinterpretq_u16_u8(vzip1q_u8(l, h)), b = vreinterpretq_u16_u8(vzip2q_u8(l, h));
    w[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(a), 16));
    w[1] = vreinterpretq_f32_u32(vshll_high_n_u16(a, 16));
    w[2] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16));
    w[3] = vreinterpretq_f32_u32(vshll_high_n_u16(b, 16));
}

/* one 32-element block of codes -> 32 scaled fp32 in natural order */
INL void decode_block(const uint8_t *c, uint8_t s, uint8x16_t thi, uint8x16_t tlo, float32x4_t w[8]) {
    const uint8x16_t cb = vld1q_u8(c);
    const uint8x16_t lo = vandq_u8(cb, vdupq_n_u8(15)), hi = vshrq_n_u8(cb, 4);
    e2m1x16(vzip1q_u8(lo, hi), thi, tlo, w);
    e2m1x16(vzip2q_u8(lo, hi), thi, tlo, w + 4);
    const float32x4_t sc = vdupq_n_f32(DS4F_SCALE(s));
    for (int i = 0; i < 8; i++) w[i] = vmulq_f32(w[i], sc);
}

/* 32 bf16 weights -> 32 fp32 in natural order (a 16-bit left shift each) */
INL void bf16_widen32(const uint16_t *w, float32x4_t f[8]) {
    for (int i = 0; i < 4; i++) {
        const uint16x8_t v = vld1q_u16(w + 8 * i);
        f[2 * i] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16));
        f[2 * i + 1] = vreinterpretq_f32_u32(vshll_high_n_u16(v, 16));
    }
}

/* an MXFP4 / bf16 row's result from its two accumulators */
INL float finish(float32x4_t a, float32x4_t b) { return vaddvq_f32(vaddq_f32(a, b)); }

/* ---- FP8 (see arm/neon_matvec.c) ---- */

/* n < 16 trailing bytes of a row, zero-filled (code 0 = +0, against x = 0) */
INL uint8x16_t fp8_load_tail(const uint8_t *w, size_t n) {
    uint8_t b[16] = {0};
    for (size_t i = 0; i < n; i++) b[i] = w[i];
    return vld1q_u8(b);
}

/* 8 E4M3 bytes -> the fp16 words e4m3/2^8 */
INL float16x8_t fp8_half8(int8x8_t b) {
    return vreinterpretq_f16_u16(vandq_u16(vreinterpretq_u16_s16(vshll_n_s8(b, 7)), vdupq_n_u16(0xBFFF)));
}

/* 16 E4M3 bytes -> e4m3(b) / 2^8 as fp32, exact, natural order (the NaN codes come out finite) */
INL void fp8_widen16(uint8x16_t v, float32x4_t f[4]) {
    const float16x8_t h0 = fp8_half8(vreinterpret_s8_u8(vget_low_u8(v)));
    const float16x8_t h1 = fp8_half8(vreinterpret_s8_u8(vget_high_u8(v)));
    f[0] = vcvt_f32_f16(vget_low_f16(h0));
    f[1] = vcvt_high_f32_f16(h0);
    f[2] = vcvt_f32_f16(vget_low_f16(h1));
    f[3] = vcvt_high_f32_f16(h1);
}

/* bytewise max of (b & 0x7F): 0x7F somewhere = a NaN code */
INL uint8x16_t fp8_nan_max(uint8x16_t nan, uint8x16_t v) { return vmaxq_u8(nan, vandq_u8(v, vdupq_n_u8(0x7F))); }

/* acc + a tile's partial sum p times its scale (and the 2^8 of the fp16 trick) */
INL float32x4_t fp8_tile_add(float32x4_t p, uint8_t b, float32x4_t acc) {
    if (ds4f_fp8_factor_fits(b)) return vfmaq_f32(acc, p, vdupq_n_f32(ds4f_fp8_factor(b)));
    /* 2^(b-119) overflows: scale p by 2^8 first (exact), then by 2^(b-127) */
    return vfmaq_f32(acc, vmulq_f32(p, vdupq_n_f32(256.0f)), vdupq_n_f32(DS4F_SCALE(b)));
}

/* a row's result: the sum of its lanes, or the quiet NaN if it holds a NaN code */
INL float fp8_result(float32x4_t acc, uint8x16_t nan) {
    if (vmaxvq_u8(nan) == 0x7F) {
        const union {
            uint32_t u;
            float f;
        } q = {DS4F_QNAN_BITS};
        return q.f;
    }
    return vaddvq_f32(acc);
}

#endif
#endif
