/* attention_simd.h — attention.c's SIMD sums, included once per instruction set with its vector
 * macros (VL lanes of float64, HV head vectors a logits tile, DV head_dim vectors a weighted-sum
 * tile). Each lane runs the scalar reference's sequence of one sum. */

#define AINL static inline __attribute__((always_inline)) TGT

/* the logits of keys j0 .. j0 + KB - 1 (kb[i] widened, zeros past the last key) for nv head
 * vectors from head vector v0; the first nk_here keys are stored */
AINL void V(logits_tile)(const double *qt, size_t g, size_t hd, const double *kb, size_t v0, int nv, size_t nk_here,
                         double scale, double *lt) {
    VD acc[HV][KB];
    _Pragma("GCC unroll 16")
    for (int v = 0; v < HV; v++)
        _Pragma("GCC unroll 16")
        for (int i = 0; i < KB; i++) acc[v][i] = ZERO();
    for (size_t d = 0; d < hd; d++) {
        VD q[HV];
        _Pragma("GCC unroll 16")
        for (int v = 0; v < HV; v++)
            if (v < nv) q[v] = LOADU(qt + d * g + (v0 + v) * VL);
        _Pragma("GCC unroll 16")
        for (int i = 0; i < KB; i++) {
            const VD k = SET1(kb[i * hd + d]);
            _Pragma("GCC unroll 16")
            for (int v = 0; v < HV; v++)
                if (v < nv) acc[v][i] = FMADD(q[v], k, acc[v][i]);
        }
    }
    const VD sc = SET1(scale);
    for (size_t i = 0; i < nk_here; i++)
        for (int v = 0; v < nv; v++) STOREU(lt + i * g + (v0 + v) * VL, MUL(acc[v][i], sc));
}

TGT static void V(logits)(const double *qt, size_t g, size_t hd, const float *const *kp, size_t nk, double scale,
                          double *lt, double *kb) {
    const size_t nvec = g / VL;
    for (size_t j0 = 0; j0 < nk; j0 += KB) {
        const size_t here = nk - j0 < KB ? nk - j0 : KB;
        for (size_t i = 0; i < KB; i++)
            for (size_t d = 0; d < hd; d++) kb[i * hd + d] = i < here ? (double)kp[j0 + i][d] : 0.0;
        size_t v0 = 0;
        for (; v0 + HV <= nvec; v0 += HV) V(logits_tile)(qt, g, hd, kb, v0, HV, here, scale, lt + j0 * g);
        for (; v0 < nvec; v0++) V(logits_tile)(qt, g, hd, kb, v0, 1, here, scale, lt + j0 * g);
    }
}

AINL VD V(exp)(VD x) {
    x = LT_CLAMP(x, SET1(EXP_MIN));
    const VD sh = SET1(EXP_SHIFT);
    const VD k = SUB(ADD(MUL(x, SET1(EXP_LOG2E)), sh), sh);
    VD r = FMADD(NEG(k), SET1(EXP_LN2HI), x);
    r = FMADD(NEG(k), SET1(EXP_LN2LO), r);
    VD p = SET1(exp_c[13]);
    for (int i = 12; i >= 0; i--) p = FMADD(p, r, SET1(exp_c[i]));
    const VD k1 = FLOOR(MUL(k, SET1(0.5)));
    const VD bias = SET1(EXP_SHIFT + 1023.0);
    return MUL(MUL(p, SHL52(ADD(k1, bias))), SHL52(ADD(SUB(k, k1), bias)));
}

TGT static void V(softmax)(double *lt, size_t g, size_t nk, const float *sinks) {
    for (size_t v = 0; v < g / VL; v++) {
        double *l = lt + v * VL;
        const VD sink = CVTPS(sinks + v * VL);
        VD m = sink;
        for (size_t j = 0; j < nk; j++) m = GT_SELECT(LOADU(l + j * g), m);
        VD s = ZERO();
        for (size_t j = 0; j < nk; j++) {
            const VD e = V(exp)(SUB(LOADU(l + j * g), m));
            STOREU(l + j * g, e);
            s = ADD(s, e);
        }
        s = ADD(s, V(exp)(SUB(sink, m)));
        for (size_t j = 0; j < nk; j++) STOREU(l + j * g, DIV(LOADU(l + j * g), s));
    }
}

/* out[h][d0 ..] for heads h0 .. h0 + nh - 1 and nd head_dim vectors from d0 */
AINL void V(weighted_tile)(const double *pt, size_t g, size_t hd, const float *const *kp, size_t nk, size_t h0, int nh,
                           size_t d0, int nd, float *out) {
    VD acc[4][DV];
    _Pragma("GCC unroll 16")
    for (int i = 0; i < 4; i++)
        _Pragma("GCC unroll 16")
        for (int v = 0; v < DV; v++) acc[i][v] = ZERO();
    for (size_t j = 0; j < nk; j++) {
        VD k[DV];
        _Pragma("GCC unroll 16")
        for (int v = 0; v < DV; v++)
            if (v < nd) k[v] = CVTPS(kp[j] + d0 + v * VL);
        _Pragma("GCC unroll 16")
        for (int i = 0; i < 4; i++)
            if (i < nh) {
                const VD p = SET1(pt[j * g + h0 + i]);
                _Pragma("GCC unroll 16")
                for (int v = 0; v < DV; v++)
                    if (v < nd) acc[i][v] = FMADD(p, k[v], acc[i][v]);
            }
    }
    for (int i = 0; i < nh; i++)
        for (int v = 0; v < nd; v++) STORE_F32(out + (h0 + i) * hd + d0 + v * VL, acc[i][v]);
}

TGT static void V(weighted)(const double *pt, size_t g, size_t hd, const float *const *kp, size_t nk, float *out) {
    const size_t dvec = hd / VL;
    for (size_t dv = 0; dv < dvec;) {
        const int nd = dvec - dv >= DV ? DV : 1;
        size_t h0 = 0;
        if (nd == DV) {
            for (; h0 + 4 <= g; h0 += 4) V(weighted_tile)(pt, g, hd, kp, nk, h0, 4, dv * VL, DV, out);
            for (; h0 < g; h0++) V(weighted_tile)(pt, g, hd, kp, nk, h0, 1, dv * VL, DV, out);
        } else {
            for (; h0 + 4 <= g; h0 += 4) V(weighted_tile)(pt, g, hd, kp, nk, h0, 4, dv * VL, 1, out);
            for (; h0 < g; h0++) V(weighted_tile)(pt, g, hd, kp, nk, h0, 1, dv * VL, 1, out);
        }
        dv += nd;
    }
}

#undef AINL
