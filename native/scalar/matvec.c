/* scalar/matvec.c — the reference semantics of every kernel, in plain C.
 *
 * Compiled like every other source with -ffp-contract=off -fno-tree-vectorize (see
 * build_kernels.py): what is written here is what runs — one multiply, one add, in this order,
 * never fused into an FMA nor reassociated into vector lanes.  The SIMD backends must decode to
 * the same bits and stay within 1e-5 (relative to sum |w*x|) of the float64 matvec.
 * Formats (MXFP4, bf16, FP8 E4M3 with 128x128 E8M0 tiles): see ds4f_kernels.h.
 */
#include <math.h>

#include "kernels_internal.h"

const float ds4f_e2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* b=0 is the subnormal 2^-127 (0x00400000), 1..254 is b<<23, 255 the quiet NaN 0x7fc00000. */
#define E8(b) ((b) == 0 ? 0x00400000u : (b) == 255 ? 0x7fc00000u : ((uint32_t)(b) << 23))
#define E8x4(b) E8(b), E8((b) + 1), E8((b) + 2), E8((b) + 3)
#define E8x16(b) E8x4(b), E8x4((b) + 4), E8x4((b) + 8), E8x4((b) + 12)
const ds4f_byte_table ds4f_e8m0 = {{E8x16(0), E8x16(16), E8x16(32), E8x16(48), E8x16(64),
                                    E8x16(80), E8x16(96), E8x16(112), E8x16(128), E8x16(144),
                                    E8x16(160), E8x16(176), E8x16(192), E8x16(208), E8x16(224),
                                    E8x16(240)}};

/* E4M3 code c (sign s, exponent e, mantissa m) -> fp32 bits.  e >= 1: 2^(e-7) * (1 + m/8), i.e.
 * fp32 exponent field e + 120 and the mantissa's 3 bits on top; e = 0: m/8 * 2^-6 = m * 2^-9,
 * normalised by hand (1 -> 2^-9, 2..3 -> 2^-8 * (1 + (m-2)/2), 4..7 -> 2^-7 * (1 + (m-4)/4));
 * 0x7F and 0xFF -> the quiet NaN 0x7fc00000, the same bits as the NaN scale. */
#define E4SUB(m) ((m) == 0 ? 0u : (m) == 1 ? 118u << 23 : (m) < 4 ? (119u << 23 | ((m) - 2u) << 22) \
                                                                 : (120u << 23 | ((m) - 4u) << 21))
#define E4MAG(u) ((u) >> 3 ? ((((u) >> 3) + 120u) << 23 | ((u) & 7u) << 20) : E4SUB((u) & 7u))
#define E4(c) (((c) & 0x7Fu) == 0x7Fu ? DS4F_QNAN_BITS : (((c) & 0x80u) << 24 | E4MAG((c) & 0x7Fu)))
#define E4x4(c) E4((c) + 0u), E4((c) + 1u), E4((c) + 2u), E4((c) + 3u)
#define E4x16(c) E4x4(c), E4x4((c) + 4u), E4x4((c) + 8u), E4x4((c) + 12u)
const ds4f_byte_table ds4f_e4m3 = {{E4x16(0u), E4x16(16u), E4x16(32u), E4x16(48u), E4x16(64u),
                                    E4x16(80u), E4x16(96u), E4x16(112u), E4x16(128u), E4x16(144u),
                                    E4x16(160u), E4x16(176u), E4x16(192u), E4x16(208u), E4x16(224u),
                                    E4x16(240u)}};

/* silu is O(inter) per expert, not hot: one scalar definition serves every backend, so the
 * backends differ only in matvec lane order. */
float ds4f_silu(float g) { return g / (1.0f + expf(-g)); }

/* value = e2m1(code) * 2^(b-127): one fp32 multiply, exact (or +-inf / NaN) — so any correct
 * decode is bit-identical to this one. */
static void decode_rows(const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1,
                        size_t k, float *out) {
    const size_t kb = k / 2, ks = k / 32;
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *c = codes + r * kb, *s = scales + r * ks;
        float *o = out + r * k;
        for (size_t b = 0; b < ks; b++) {
            const float sc = DS4F_SCALE(s[b]);
            for (size_t i = 0; i < 16; i++) {
                const uint8_t byte = c[16 * b + i];
                o[32 * b + 2 * i] = ds4f_e2m1[byte & 15] * sc;
                o[32 * b + 2 * i + 1] = ds4f_e2m1[byte >> 4] * sc;
            }
        }
    }
}

/* y[r] = sum_j w[r][j] * x[j], w decoded as above, one fp32 accumulator in element order. */
static void matvec_rows(const uint8_t *codes, const uint8_t *scales, size_t r0, size_t r1,
                        size_t k, const float *x, float *y) {
    const size_t kb = k / 2, ks = k / 32;
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *c = codes + r * kb, *s = scales + r * ks;
        float acc = 0.0f;
        for (size_t b = 0; b < ks; b++) {
            const float sc = DS4F_SCALE(s[b]);
            const float *xb = x + 32 * b;
            for (size_t i = 0; i < 16; i++) {
                const uint8_t byte = c[16 * b + i];
                acc += (ds4f_e2m1[byte & 15] * sc) * xb[2 * i];
                acc += (ds4f_e2m1[byte >> 4] * sc) * xb[2 * i + 1];
            }
        }
        y[r] = acc;
    }
}

static void bf16_rows(const uint16_t *w, size_t r0, size_t r1, size_t k, const float *x,
                      float *y) {
    for (size_t r = r0; r < r1; r++) {
        const uint16_t *wr = w + r * k;
        float acc = 0.0f;
        for (size_t j = 0; j < k; j++) acc += bf16_to_f32(wr[j]) * x[j];
        y[r] = acc;
    }
}

/* FP8: value = e4m3(w) * 2^(b-127), one fp32 multiply (exact, or +-inf / NaN): the same bits on
 * every backend.  Row r's tiles are row r/128 of the scale grid. */
static void fp8_decode_rows(const uint8_t *w, const uint8_t *scales, size_t r0, size_t r1,
                            size_t k, float *out) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE;
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * k, *sr = scales + r / DS4F_FP8_TILE * kt;
        float *o = out + r * k;
        for (size_t j = 0; j < k; j++) o[j] = ds4f_e4m3.f[wr[j]] * DS4F_SCALE(sr[j / DS4F_FP8_TILE]);
    }
}

/* y[r] = sum_j value(r, j) * x[j]: one fp32 accumulator in element order, the decoded value (the
 * same float as bf16_rows reads from the widened matrix) times x[j], then the add. */
static void fp8_matvec_rows(const uint8_t *w, const uint8_t *scales, size_t r0, size_t r1,
                            size_t k, const float *x, float *y) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE;
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * k, *sr = scales + r / DS4F_FP8_TILE * kt;
        float acc = 0.0f;
        for (size_t j = 0; j < k; j++)
            acc += (ds4f_e4m3.f[wr[j]] * DS4F_SCALE(sr[j / DS4F_FP8_TILE])) * x[j];
        y[r] = acc;
    }
}

const ds4f_ktable ds4f_kt_scalar = {"scalar", decode_rows, matvec_rows, bf16_rows, fp8_decode_rows,
                                    fp8_matvec_rows};
