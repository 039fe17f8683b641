/* scalar/matmul.c — the multi-token kernels in plain C: the reference semantics of the batched
 * matrix products, and the scalar backend's (see kernels_internal.h for the contract).
 *
 * Per row and block of weights: decode the block once into a small buffer, then for each token
 * continue its accumulator over the block in element order, a multiply then an add per element
 * (no FMA: -ffp-contract=off), exactly as scalar/matvec.c does for one vector.  x is read in
 * natural order (no prep).  The same decoded float times the same x element, added in the same
 * order: the single-vector result bit for bit.
 */
#include "kernels_internal.h"

/* acc[t] += w[i] * x_t[i] for i in 0..n-1, in order, for each of nt tokens */
static void apply(const float *w, size_t n, size_t nt, const float *xp, size_t ldx, float *acc) {
    for (size_t t = 0; t < nt; t++) {
        const float *xt = xp + t * ldx;
        float a = acc[t];
        for (size_t i = 0; i < n; i++) a += w[i] * xt[i];
        acc[t] = a;
    }
}

static void mxfp4_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                     const float *xp, size_t ldx, float *y, size_t ldy) {
    const uint8_t *codes = w;
    const size_t kb = k / 2, ks = k / 32;
    float wb[32], acc[DS4F_MM_TB];
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *c = codes + r * kb, *s = scales + r * ks;
        for (size_t t0 = 0; t0 < nt; t0 += DS4F_MM_TB) {
            const size_t tn = nt - t0 < DS4F_MM_TB ? nt - t0 : DS4F_MM_TB;
            for (size_t t = 0; t < tn; t++) acc[t] = 0.0f;
            for (size_t b = 0; b < ks; b++) {
                const float sc = DS4F_SCALE(s[b]);
                for (size_t i = 0; i < 16; i++) {
                    const uint8_t byte = c[16 * b + i];
                    wb[2 * i] = ds4f_e2m1[byte & 15] * sc;
                    wb[2 * i + 1] = ds4f_e2m1[byte >> 4] * sc;
                }
                apply(wb, 32, tn, xp + t0 * ldx + 32 * b, ldx, acc);
            }
            for (size_t t = 0; t < tn; t++) y[(t0 + t) * ldy + r] = acc[t];
        }
    }
}

static void bf16_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                    const float *xp, size_t ldx, float *y, size_t ldy) {
    (void)scales;
    float wb[32], acc[DS4F_MM_TB];
    for (size_t r = r0; r < r1; r++) {
        const uint16_t *wr = (const uint16_t *)w + r * k;
        for (size_t t0 = 0; t0 < nt; t0 += DS4F_MM_TB) {
            const size_t tn = nt - t0 < DS4F_MM_TB ? nt - t0 : DS4F_MM_TB;
            for (size_t t = 0; t < tn; t++) acc[t] = 0.0f;
            for (size_t j = 0; j < k; j += 32) {
                for (size_t i = 0; i < 32; i++) wb[i] = bf16_to_f32(wr[j + i]);
                apply(wb, 32, tn, xp + t0 * ldx + j, ldx, acc);
            }
            for (size_t t = 0; t < tn; t++) y[(t0 + t) * ldy + r] = acc[t];
        }
    }
}

/* FP8: the decoded value e4m3(w) * 2^(b-127) (one multiply, as fp8_matvec_rows), tile by tile */
static void fp8_mm(const void *w, const uint8_t *scales, size_t r0, size_t r1, size_t k, size_t nt,
                   const float *xp, size_t ldx, float *y, size_t ldy) {
    const size_t kt = (k + DS4F_FP8_TILE - 1) / DS4F_FP8_TILE;
    float wb[DS4F_FP8_TILE], acc[DS4F_MM_TB];
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *wr = (const uint8_t *)w + r * k, *sr = scales + r / DS4F_FP8_TILE * kt;
        for (size_t t0 = 0; t0 < nt; t0 += DS4F_MM_TB) {
            const size_t tn = nt - t0 < DS4F_MM_TB ? nt - t0 : DS4F_MM_TB;
            for (size_t t = 0; t < tn; t++) acc[t] = 0.0f;
            for (size_t j0 = 0; j0 < k; j0 += DS4F_FP8_TILE) {
                const size_t n = k - j0 < DS4F_FP8_TILE ? k - j0 : DS4F_FP8_TILE;
                const float sc = DS4F_SCALE(sr[j0 / DS4F_FP8_TILE]);
                for (size_t i = 0; i < n; i++) wb[i] = ds4f_e4m3.f[wr[j0 + i]] * sc;
                apply(wb, n, tn, xp + t0 * ldx + j0, ldx, acc);
            }
            for (size_t t = 0; t < tn; t++) y[(t0 + t) * ldy + r] = acc[t];
        }
    }
}

const ds4f_mtable ds4f_mt_scalar = {{mxfp4_mm, bf16_mm, fp8_mm}, {NULL, NULL, NULL}, {1, 1, 1}};
