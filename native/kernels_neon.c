/* kernels_neon.c — AArch64 Advanced SIMD backend (compiled only on aarch64, where NEON is
 * baseline: no flags needed).  Structurally the same as the x86 backends: decode nibbles in
 * registers, multiply by the block scale (exact), FMA with x, 4 rows share each x load, one
 * fixed reduction per row (so a row's bits never depend on the row split).
 *
 * In-register decode: every E2M1 value is exact in bf16, so two 16-entry byte tables (tbl)
 * give the bf16 high and low bytes of each code; zip them into bf16 words and widen with a
 * 16-bit left shift to fp32 (sign kept, so code 8 is -0.0), then multiply by the scale.
 */
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

static void decode_rows(const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1,
                        size_t k, float *out) {
    const size_t kb = k / 2, ks = k / 32;
    const uint8x16_t thi = vld1q_u8(BF16_HI), tlo = vld1q_u8(BF16_LO);
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *c = codes + r * kb, *s = scales + r * ks;
        float *o = out + r * k;
        for (size_t b = 0; b < ks; b++) {
            float32x4_t w[8];
            decode_block(c + 16 * b, s[b], thi, tlo, w);
            for (int i = 0; i < 8; i++) vst1q_f32(o + 32 * b + 4 * i, w[i]);
        }
    }
}

INL void mxfp4_block(const uint8_t *c, uint8_t s, uint8x16_t thi, uint8x16_t tlo,
                     const float32x4_t xv[8], float32x4_t *a, float32x4_t *bb) {
    float32x4_t w[8];
    decode_block(c, s, thi, tlo, w);
    for (int i = 0; i < 8; i += 2) {
        *a = vfmaq_f32(*a, w[i], xv[i]);
        *bb = vfmaq_f32(*bb, w[i + 1], xv[i + 1]);
    }
}

INL float finish(float32x4_t a, float32x4_t b) { return vaddvq_f32(vaddq_f32(a, b)); }

INL void load_x(const float *x, float32x4_t xv[8]) {
    for (int i = 0; i < 8; i++) xv[i] = vld1q_f32(x + 4 * i);
}

static void matvec_rows(const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1,
                        size_t k, const float *x, float *y) {
    const size_t kb = k / 2, ks = k / 32;
    const uint8x16_t thi = vld1q_u8(BF16_HI), tlo = vld1q_u8(BF16_LO);
    size_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const uint8_t *c0 = codes + r * kb, *c1 = c0 + kb, *c2 = c1 + kb, *c3 = c2 + kb;
        const uint8_t *s0 = scales + r * ks, *s1 = s0 + ks, *s2 = s1 + ks, *s3 = s2 + ks;
        float32x4_t a0 = vdupq_n_f32(0.0f), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
        for (size_t b = 0; b < ks; b++) {
            float32x4_t xv[8];
            load_x(x + 32 * b, xv);
            mxfp4_block(c0 + 16 * b, s0[b], thi, tlo, xv, &a0, &b0);
            mxfp4_block(c1 + 16 * b, s1[b], thi, tlo, xv, &a1, &b1);
            mxfp4_block(c2 + 16 * b, s2[b], thi, tlo, xv, &a2, &b2);
            mxfp4_block(c3 + 16 * b, s3[b], thi, tlo, xv, &a3, &b3);
        }
        y[r] = finish(a0, b0);
        y[r + 1] = finish(a1, b1);
        y[r + 2] = finish(a2, b2);
        y[r + 3] = finish(a3, b3);
    }
    for (; r < r1; r++) {
        const uint8_t *c0 = codes + r * kb, *s0 = scales + r * ks;
        float32x4_t a0 = vdupq_n_f32(0.0f), b0 = a0;
        for (size_t b = 0; b < ks; b++) {
            float32x4_t xv[8];
            load_x(x + 32 * b, xv);
            mxfp4_block(c0 + 16 * b, s0[b], thi, tlo, xv, &a0, &b0);
        }
        y[r] = finish(a0, b0);
    }
}

/* bf16: widen with a 16-bit left shift, FMA; 32 elements per block like the rest */
INL void bf16_block(const uint16_t *w, const float32x4_t xv[8], float32x4_t *a, float32x4_t *bb) {
    for (int i = 0; i < 4; i++) {
        const uint16x8_t v = vld1q_u16(w + 8 * i);
        *a = vfmaq_f32(*a, vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16)), xv[2 * i]);
        *bb = vfmaq_f32(*bb, vreinterpretq_f32_u32(vshll_high_n_u16(v, 16)), xv[2 * i + 1]);
    }
}

static void bf16_rows(const uint16_t *w, size_t r0, size_t r1, size_t k, const float *x, float *y) {
    const size_t nb = k / 32;
    size_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const uint16_t *w0 = w + r * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        float32x4_t a0 = vdupq_n_f32(0.0f), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
        for (size_t b = 0; b < nb; b++) {
            float32x4_t xv[8];
            load_x(x + 32 * b, xv);
            bf16_block(w0 + 32 * b, xv, &a0, &b0);
            bf16_block(w1 + 32 * b, xv, &a1, &b1);
            bf16_block(w2 + 32 * b, xv, &a2, &b2);
            bf16_block(w3 + 32 * b, xv, &a3, &b3);
        }
        y[r] = finish(a0, b0);
        y[r + 1] = finish(a1, b1);
        y[r + 2] = finish(a2, b2);
        y[r + 3] = finish(a3, b3);
    }
    for (; r < r1; r++) {
        const uint16_t *w0 = w + r * k;
        float32x4_t a0 = vdupq_n_f32(0.0f), b0 = a0;
        for (size_t b = 0; b < nb; b++) {
            float32x4_t xv[8];
            load_x(x + 32 * b, xv);
            bf16_block(w0 + 32 * b, xv, &a0, &b0);
        }
        y[r] = finish(a0, b0);
    }
}

const ds4f_ktable ds4f_kt_neon = {"neon", decode_rows, matvec_rows, bf16_rows};
#endif
