/* arm/neon_matvec.c — AArch64 Advanced SIMD backend (compiled only on aarch64, where NEON is
 * baseline: no flags needed).  Structurally the same as the x86 backends: decode nibbles in
 * registers, multiply by the block scale (exact), FMA with x, 4 rows share each x load, one
 * fixed reduction per row (so a row's bits never depend on the row split).
 *
 * In-register decode: every E2M1 value is exact in bf16, so two 16-entry byte tables (tbl)
 * give the bf16 high and low bytes of each code; zip them into bf16 words and widen with a
 * 16-bit left shift to fp32 (sign kept, so code 8 is -0.0), then multiply by the scale.
 */
#include "kernels_neon.h"

#ifdef DS4F_ARM64

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
    float32x4_t f[8];
    bf16_widen32(w, f);
    for (int i = 0; i < 4; i++) {
        *a = vfmaq_f32(*a, f[2 * i], xv[2 * i]);
        *bb = vfmaq_f32(*bb, f[2 * i + 1], xv[2 * i + 1]);
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

/* ---- FP8 E4M3 with 128x128 E8M0 tiles ---------------------------------------------------------
 *
 * The x86 backends' method (see x86/avx512_matvec.c), in natural element order: vshll_n_s8(b, 7)
 * widens 8 bytes to words sext(b) << 7, AND 0xBFFF makes the fp16 e4m3(b) / 2^8 (exact,
 * subnormals included), vcvt_f32_f16 widens 4 at a time, FMA with x; a tile's partial sum is
 * multiplied by 2^(b-119) (or 2^8, then 2^(b-127), for b >= 247, where that would overflow).
 * NaN codes: vmaxvq(max(b & 0x7F)) == 0x7F over the row.  4 rows share each x load; the k tail
 * goes through zero-filled 16-byte copies.  (No software prefetch: not measured on hardware.)
 */

typedef struct {
    float32x4_t p, acc; /* tile partial (e4m3/2^8 * x), row total */
    uint8x16_t nan;     /* bytewise max of (b & 0x7F) */
} fp8_row;

INL void fp8_row_init(fp8_row *s) {
    s->p = s->acc = vdupq_n_f32(0.0f);
    s->nan = vdupq_n_u8(0);
}

INL void load_x16(const float *x, float32x4_t xv[4]) {
    for (int i = 0; i < 4; i++) xv[i] = vld1q_f32(x + 4 * i);
}

INL void fp8_chunk(uint8x16_t v, const float32x4_t xv[4], fp8_row *s) {
    float32x4_t f[4];
    fp8_widen16(v, f);
    s->nan = fp8_nan_max(s->nan, v);
    float32x4_t p = s->p;
    p = vfmaq_f32(p, f[0], xv[0]);
    p = vfmaq_f32(p, f[1], xv[1]);
    p = vfmaq_f32(p, f[2], xv[2]);
    p = vfmaq_f32(p, f[3], xv[3]);
    s->p = p;
}

INL void fp8_tile_end(fp8_row *s, uint8_t b) {
    s->acc = fp8_tile_add(s->p, b, s->acc);
    s->p = vdupq_n_f32(0.0f);
}

INL float fp8_row_end(const fp8_row *s) { return fp8_result(s->acc, s->nan); }

#define FP8_FOR_ROWS(R, stmt)                                                                      \
    do {                                                                                           \
        _Pragma("GCC unroll 4") for (int i_ = 0; i_ < (R); i_++) { stmt; }                         \
    } while (0)

/* rows r..r+R-1 (R = 1 or 4: the same op sequence per row either way) */
INL void fp8_rows(const uint8_t *w, const uint8_t *scales, size_t r, int R, size_t k, const float *x,
                  float *y) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE;
    const uint8_t *wr[4], *sr[4];
    fp8_row st[4];
    FP8_FOR_ROWS(R, (wr[i_] = w + (r + i_) * k, sr[i_] = scales + (r + i_) / DS4F_FP8_TILE * kt,
                     fp8_row_init(&st[i_])));
    for (size_t t = 0; t < kt; t++) {
        const size_t j0 = t * DS4F_FP8_TILE, j1 = j0 + DS4F_FP8_TILE < k ? j0 + DS4F_FP8_TILE : k;
        size_t j = j0;
        for (; j + 16 <= j1; j += 16) {
            float32x4_t xv[4];
            load_x16(x + j, xv);
            FP8_FOR_ROWS(R, fp8_chunk(vld1q_u8(wr[i_] + j), xv, &st[i_]));
        }
        if (j < j1) { /* the k tail (only the last tile can be ragged) */
            float xt[16] = {0};
            for (size_t i = 0; i < j1 - j; i++) xt[i] = x[j + i];
            float32x4_t xv[4];
            load_x16(xt, xv);
            FP8_FOR_ROWS(R, (fp8_chunk(fp8_load_tail(wr[i_] + j, j1 - j), xv, &st[i_])));
        }
        FP8_FOR_ROWS(R, fp8_tile_end(&st[i_], sr[i_][t]));
    }
    FP8_FOR_ROWS(R, y[r + i_] = fp8_row_end(&st[i_]));
}

static void fp8_matvec_rows(const uint8_t *w, const uint8_t *scales, size_t r0, size_t r1, size_t k,
                            const float *x, float *y) {
    size_t r = r0;
    for (; r + 4 <= r1; r += 4) fp8_rows(w, scales, r, 4, k, x, y);
    for (; r < r1; r++) fp8_rows(w, scales, r, 1, k, x, y);
}

/* decode, 16 elements at a time: the same fp16 path, one multiply by the factor, NaN codes
 * replaced by the quiet NaN: the scalar decode's bits */
INL void fp8_decode16(uint8x16_t v, uint8_t b, float *o) {
    const float16x8_t h[2] = {fp8_half8(vreinterpret_s8_u8(vget_low_u8(v))),
                              fp8_half8(vreinterpret_s8_u8(vget_high_u8(v)))};
    const int8x16_t nan = vreinterpretq_s8_u8(vceqq_u8(vorrq_u8(v, vdupq_n_u8(0x80)), vdupq_n_u8(0xFF)));
    const int16x8_t n16[2] = {vmovl_s8(vget_low_s8(nan)), vmovl_s8(vget_high_s8(nan))};
    const float32x4_t qnan = vreinterpretq_f32_u32(vdupq_n_u32(DS4F_QNAN_BITS));
    for (int i = 0; i < 4; i++) {
        const float16x8_t hh = h[i / 2];
        const float32x4_t f = i % 2 ? vcvt_high_f32_f16(hh) : vcvt_f32_f16(vget_low_f16(hh));
        const float32x4_t val = ds4f_fp8_factor_fits(b)
                                    ? vmulq_f32(f, vdupq_n_f32(ds4f_fp8_factor(b)))
                                    : vmulq_f32(vmulq_f32(f, vdupq_n_f32(256.0f)), vdupq_n_f32(DS4F_SCALE(b)));
        const int16x8_t nn = n16[i / 2];
        const uint32x4_t m = vreinterpretq_u32_s32(i % 2 ? vmovl_high_s16(nn) : vmovl_s16(vget_low_s16(nn)));
        vst1q_f32(o + 4 * i, vbslq_f32(m, qnan, val));
    }
}

static void fp8_decode_rows(const uint8_t *w, const uint8_t *scales, size_t r0, size_t r1, size_t k,
                            float *out) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE;
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * k, *sr = scales + r / DS4F_FP8_TILE * kt;
        float *o = out + r * k;
        size_t j = 0;
        for (; j + 16 <= k; j += 16) fp8_decode16(vld1q_u8(wr + j), sr[j / DS4F_FP8_TILE], o + j);
        if (j < k) {
            float t[16];
            fp8_decode16(fp8_load_tail(wr + j, k - j), sr[j / DS4F_FP8_TILE], t);
            for (size_t i = 0; i < k - j; i++) o[j + i] = t[i];
        }
    }
}

const ds4f_ktable ds4f_kt_neon = {"neon", decode_rows, matvec_rows, bf16_rows, fp8_decode_rows,
                                  fp8_matvec_rows};
#endif
