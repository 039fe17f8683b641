/* ds4f_kernels.h — the one public header of the native kernels.
 *
 * MXFP4 matrices use the official DeepSeek-V4-Flash packing: a rows x k matrix is
 *   codes:  rows * k/2 bytes, element 2i in the low nibble of byte i, 2i+1 in the high nibble
 *   scales: rows * k/32 E8M0 bytes, one per 32 consecutive elements of a row
 * value = e2m1(code) * 2^(scale - 127); scale 255 is NaN.  k must be a multiple of 32.
 * bf16 matrices are rows x k uint16 (the upper half of an fp32); k a multiple of 32 as well.
 * FP8 matrices (the trunk's linears) use the official layout too, with any rows >= 0 and k >= 1
 * (neither needs to be a multiple of 128: ragged last tiles and a k tail are handled):
 *   w:      rows * k bytes of E4M3 (float8_e4m3fn: sign, 4 exponent bits biased by 7, 3 mantissa
 *           bits; exponent 0 is subnormal, m/8 * 2^-6; 0x7F and 0xFF are NaN; no infinities)
 *   scales: ceil(rows/128) x ceil(k/128) E8M0 bytes, row-major: tile (i/128, j/128) scales (i, j)
 * value = fp32(e4m3(w)) * 2^(b - 127) in one fp32 multiply, exact or +-inf/NaN, so every backend
 * decodes to the same bits; a NaN code or a 255 scale decodes to the quiet NaN 0x7fc00000.
 * FP8 matvec: the scalar backend is the reference, y[r] = sum over j in element order of
 * value(r, j) * x[j] in one fp32 accumulator, a multiply and an add per element (never fused), so
 * it equals the scalar bf16 matvec of the bf16-widened matrix bit for bit.  SIMD backends use a
 * fixed lane order of their own and may factor each tile's power-of-two scale out of its partial
 * sum (y = sum_t s_t * sum_{j in t} e4m3(w_j) * x_j); they stay within 1e-5 * sum_j
 * |value(r, j) * x[j]| of the exact result.  On every backend a NaN code or a 255 scale anywhere
 * in a row makes y[r] NaN (corrupt weights are caught downstream by a finite check).
 * Backends and threads are process-wide settings; a change applies from the next call on.
 * The kernels never touch MXCSR/FPCR (no flush-to-zero): subnormals in, subnormals out.
 * All matvecs accumulate in fp32; each output row is computed by one thread in a fixed
 * order, so a backend's results do not depend on the thread count.
 */
#ifndef DS4F_KERNELS_H
#define DS4F_KERNELS_H
#include <stddef.h>
#include <stdint.h>

/* The backends: these numbers are also the backend codes in state dumps (do not renumber). */
enum { DS4F_SCALAR = 0, DS4F_AVX2 = 1, DS4F_AVX512 = 2, DS4F_NEON = 3, DS4F_N_BACKENDS = 4 };
/* FP8 weights: one E8M0 scale per DS4F_FP8_TILE x DS4F_FP8_TILE tile. */
enum { DS4F_FP8_TILE = 128 };

const char *ds4f_backend_name(int backend); /* "scalar", "avx2", "avx512", "neon"; NULL if out of range */

int ds4f_backend_supported(int backend); /* compiled in and usable on this CPU and OS */
int ds4f_set_backend(int backend);       /* 0 on success, -1 if unsupported; next call honours it */
int ds4f_get_backend(void);
int ds4f_best_backend(void);
int ds4f_set_threads(int n);             /* persistent pool size incl. the caller; 0 ok, -1 bad */
int ds4f_get_threads(void);
void ds4f_set_alone(int on);             /* this thread's calls: all their work on this thread */
int ds4f_get_alone(void);                /* (for a helper thread beside another that computes) */
/* The pool's work since the process started: tasks run (by any thread, counted as each ends)
 * and, of those, tasks run by the pool's workers rather than the calling thread. */
unsigned long long ds4f_tasks_done(void);
unsigned long long ds4f_worker_tasks_done(void);

void ds4f_mxfp4_decode(const uint8_t *codes, const uint8_t *scales, size_t rows, size_t k, float *out);
void ds4f_mxfp4_matvec(const uint8_t *codes, const uint8_t *scales, size_t rows, size_t k,
                       const float *x, float *y);
void ds4f_bf16_matvec(const uint16_t *w, size_t rows, size_t k, const float *x, float *y);
void ds4f_fp8_decode(const uint8_t *w, const uint8_t *scales, size_t rows, size_t k, float *out);
void ds4f_fp8_matvec(const uint8_t *w, const uint8_t *scales, size_t rows, size_t k,
                     const float *x, float *y);

/* One routed expert as it sits in a cache slot: w1/w3 are inter x hidden, w2 is hidden x inter. */
typedef struct {
    const uint8_t *w1, *s1, *w3, *s3, *w2, *s2;
    float weight; /* routing weight (already renormalised and scaled) */
} ds4f_expert;

#define DS4F_MAX_EXPERTS 8
/* y[hidden] = sum over e (in order 0..n-1) of
 *   w2_e . ( silu(min(w1_e.x, limit)) * clamp(w3_e.x, -limit, limit) * weight_e )
 * scratch must hold ds4f_experts_scratch_floats(n, hidden, inter) floats.
 * Returns 0, or -1 for bad arguments (n outside 1..8, sizes not multiples of 32). */
size_t ds4f_experts_scratch_floats(int n, size_t hidden, size_t inter);
int ds4f_experts_forward(const ds4f_expert *ex, int n, const float *x, size_t hidden, size_t inter,
                         float limit, float *y, float *scratch);
/* The same per expert: expert e's weighted output w2_e . (...) goes to y_each + e*hidden
 * (y_each holds [n][hidden] floats, apart from scratch), nothing is summed; summing the rows in
 * order 0..n-1 in fp32 is exactly ds4f_experts_forward's y (which is this plus that sum).  So a
 * caller can keep experts computed at different times apart and sum them in an order of its own.
 * scratch as for ds4f_experts_forward.  Returns 0, or -1 for bad arguments. */
int ds4f_experts_forward_each(const ds4f_expert *ex, int n, const float *x, size_t hidden, size_t inter,
                              float limit, float *y_each, float *scratch);

/* ---- several input vectors at once -------------------------------------------------------------
 * x is [n][k] fp32 row-major (n input vectors), y is [n][rows] fp32 row-major: y[t] = W . x[t].
 * Every weight block is decoded once per call (once per 32 vectors) and applied to all
 * n vectors, and y[t] is bit-identical to the single-vector kernel on x[t] (ds4f_mxfp4_matvec,
 * ds4f_bf16_matvec, ds4f_fp8_matvec) on the same backend, at any n and thread count: batching
 * never changes a result.  Shapes as for the single-vector kernels.  scratch holds at least
 * ds4f_matmul_scratch_floats(n, k) floats (x in the backend's lane order; the size does not depend
 * on the backend) and must not overlap x or y.  Returns 0, or -1 for bad arguments. */
size_t ds4f_matmul_scratch_floats(size_t n, size_t k);
int ds4f_mxfp4_matmul(const uint8_t *codes, const uint8_t *scales, size_t rows, size_t k, size_t n,
                      const float *x, float *y, float *scratch);
int ds4f_bf16_matmul(const uint16_t *w, size_t rows, size_t k, size_t n, const float *x, float *y,
                     float *scratch);
int ds4f_fp8_matmul(const uint8_t *w, const uint8_t *scales, size_t rows, size_t k, size_t n,
                    const float *x, float *y, float *scratch);

/* A group of matrices applied to the same n vectors in one call (a sublayer's projections of one
 * input, or the groups of a grouped projection).  Matrix i is W_i [rows][k] of `kind` (w = MXFP4
 * codes with their scales, bf16 bits, or FP8 E4M3 with its 128x128 tiles' E8M0 scales); it reads
 * columns x_col .. x_col + k - 1 of each row of x [n][ldx] and writes its results to columns
 * y_col .. y_col + rows - 1 of each row of y [n][ldy]:  y[t][y_col + r] = (W_i . x[t][x_col ..])[r],
 * bit-identical to the matrix's own single-vector kernel on that slice of x[t], at every n and
 * thread count.  The matrices' outputs must not overlap each other or x.  At most DS4F_GROUP_MAX
 * matrices; scratch holds ds4f_matmul_scratch_floats(n, the largest k) floats.  Returns 0, or -1
 * for bad arguments (a kind, a slice beyond its row, a k that is not a multiple of 32 for MXFP4 and
 * bf16). */
enum { DS4F_MM_MXFP4 = 0, DS4F_MM_BF16 = 1, DS4F_MM_FP8 = 2, DS4F_MM_KINDS = 3 };
enum { DS4F_GROUP_MAX = 16 };
typedef struct {
    int kind;               /* DS4F_MM_MXFP4, DS4F_MM_BF16 or DS4F_MM_FP8 */
    const void *w;          /* codes, bf16 bits or E4M3 bytes: [rows][k] (MXFP4: [rows][k / 2]) */
    const uint8_t *scales;  /* MXFP4 [rows][k / 32], FP8 [ceil(rows/128)][ceil(k/128)]; bf16: NULL */
    size_t rows, k, x_col, y_col;
} ds4f_matrix;
int ds4f_matmul_group(const ds4f_matrix *m, size_t count, size_t n, const float *x, size_t ldx, float *y,
                      size_t ldy, float *scratch);

/* A routed expert applied to a set of tokens (the pairs routed to it in a batch of tokens):
 * tokens[i] is a row of the caller's x [ntok][hidden], weights[i] that pair's routing weight. */
typedef struct {
    const uint8_t *w1, *s1, *w3, *s3, *w2, *s2; /* as in ds4f_expert */
    const int32_t *tokens;                      /* n row indices into x, each < ntok */
    const float *weights;                       /* n routing weights */
    size_t n;                                   /* 0 is allowed (the expert is skipped) */
} ds4f_expert_tokens;

/* For every expert e (in order) and every pair i of it (in order), one row of y [pairs][hidden]:
 *   w2_e . ( silu(min(w1_e.x[tokens[i]], limit)) * clamp(w3_e.x[tokens[i]], -limit, limit) * weights[i] )
 * where pairs = the sum of the n's: bit-identical to ds4f_experts_forward_each's row for that
 * expert, token row and weight.  n_experts >= 1 (no upper bound).  scratch holds
 * ds4f_experts_tokens_scratch_floats(pairs, hidden, inter) floats, apart from x and y.
 * Returns 0, or -1 for bad arguments (a token index >= ntok, sizes not multiples of 32, ...). */
size_t ds4f_experts_tokens_scratch_floats(size_t pairs, size_t hidden, size_t inter);
int ds4f_experts_forward_tokens(const ds4f_expert_tokens *ex, int n_experts, const float *x, size_t ntok,
                                size_t hidden, size_t inter, float limit, float *y, float *scratch);

/* ---- the hyper-connections' mix ---------------------------------------------------------------
 * For each of n tokens, x[t] its k fp32 values (the N streams, flattened), and the weights fn_t
 * [k][rows] fp32 (the mix matrix transposed: fn_t[i][r] weighs element i in row r):
 *   d = sqrt((sum over i of x_i^2) / k + eps),  out[t][r] = sum over i of fn_t[i][r] * (x_i / d)
 * in float64 (the fp32 values widened exactly), each sum one fused multiply-add per element in
 * element order: correctly rounded steps, so the result has the same bits on every backend and at
 * every n.  scratch holds ds4f_hc_mix_scratch_doubles(k, rows) doubles.  Single-threaded.
 * Returns 0, or -1 for bad arguments. */
size_t ds4f_hc_mix_scratch_doubles(size_t k, size_t rows);
int ds4f_hc_mix(const float *x, size_t n, size_t k, const float *fn_t, size_t rows, double eps, double *out,
                double *scratch);

/* hc_pre of n tokens (engine/model/hyper.py's docstring): x [n][N][hidden] their streams, fn_t the
 * mix's weights as for ds4f_hc_mix (k = N hidden), base [rows] and scale [3] fp32.  rows = (2 + N) N:
 * pre [n][N], post [n][N] and comb [n][N][N] (Sinkhorn, iters rounds) in float64, h [n][hidden] =
 * sum over streams in order of pre[k] x[k] (float64, rounded to fp32); rows = N (the head): pre and
 * h only (post, comb may be NULL).  Every sum in index order, products and sums rounded apart (no
 * contraction) except the mix's: one piece of C for every backend.  scratch holds
 * ds4f_hc_pre_scratch_doubles(n, N hidden, rows) doubles.  Returns 0, or -1 for bad arguments. */
size_t ds4f_hc_pre_scratch_doubles(size_t n, size_t k, size_t rows);
int ds4f_hc_pre(const float *x, size_t n, size_t N, size_t hidden, const float *fn_t, size_t rows,
                const float *base, const float *scale, double eps, double hc_eps, int iters, float *h, double *pre,
                double *post, double *comb, double *scratch);

/* hc_post of n tokens, in place: x [n][N][hidden] becomes, for each stream k,
 *   sum over j in order of comb[j][k] x[j] (one fused multiply-add per term, from 0) + post[k] y
 * in float64, rounded to fp32; y [n][hidden] the sublayer's outputs, post [n][N], comb [n][N][N].
 * Returns 0, or -1 for bad arguments. */
int ds4f_hc_post(float *x, size_t n, size_t N, size_t hidden, const float *y, const double *post, const double *comb);

/* ---- the attention core of a step's rows (attention.c; engine/model/attention.py) ----------------
 * Row t (of n), head h: q[t][h] (head_dim fp32, after the per-head norm) rotated in fp32 by row t's
 * cos, sin ([n][rope_half]: the last 2 rope_half dims, pairs (2i, 2i+1)), attends over its keys:
 * its n_win[t] window rows keys[win_first[t] ..] (oldest first), then n_comp[t] compressed rows of
 * comp[part[t]]: rows 0 .. n_comp[t] - 1, or where sel_first is given and sel_first[t] >= 0 the rows
 * sel[sel_first[t] ..] (n_comp[t] of them, in that order). logits = q . K * scale in float64, a
 * softmax whose denominator also holds exp(sinks[h] - max), the probabilities' sum of the keys,
 * rounded to fp32, rotated back: out[t][h] (head_dim fp32). Every float64 sum in key (or dim) order
 * from 0, exp a fixed sequence of correctly rounded steps (attention.c): the same bits on every
 * backend, at every thread count, and a row's bits whatever the other rows of the call. Rows and
 * groups of 32 heads are spread over the kernels' threads, one thread each.
 * The index arrays are checked against the sizes given (n_keys, comp_rows of n_parts parts, n_sel)
 * before anything is read. Returns 0, or for bad arguments: -1 a missing array or shape, -2 a row
 * with no keys, -3 a window outside keys, -4 a part that is not there, -5 a selection outside sel,
 * -6 a selected row its part does not hold, -7 more compressed rows than the part holds. */
typedef struct {
    size_t n, heads, head_dim, rope_half;
    const float *q;
    const float *cos, *sin;
    const float *keys;
    size_t n_keys, n_parts, n_sel;
    const int64_t *comp_rows;  /* each part's compressed rows (n_parts) */
    const int64_t *win_first;
    const int32_t *n_win;
    const float **comp;
    const int32_t *part;
    const int32_t *n_comp;
    const int64_t *sel_first;
    const int32_t *sel;
    const float *sinks;
    double scale;
    float *out;
} ds4f_attention_rows_args;
int ds4f_attention_rows(const ds4f_attention_rows_args *a);

/* ---- per-row RMS norms (norms.c; engine/model/attention.py's rms_rows) ---------------------------
 * Row r of x [n][d] fp32: ms = sqrt(ss / d + eps) with ss the sum of the row's squares, all in
 * float64 (the values widened exactly), the sum in numpy's pairwise order (np.add.reduce over a
 * contiguous row: norms.c says which); out[r][j] = (float)(x[r][j] / ms), and with a weight [d]
 * (NULL: none) that fp32 value times weight[j] in fp32.  The same bits as numpy's
 *   y = (x64 / np.sqrt(np.add.reduce(np.square(x64), axis=-1, keepdims=True) / d + eps)).astype(float32)
 *   y * weight
 * on every backend, at every thread count (rows are spread over the kernels' threads, one thread
 * a row).  out may be x itself, not a part of it.  Returns 0, or -1 for bad arguments (d = 0 or a
 * missing array, with n > 0). */
int ds4f_rms_rows(const float *x, size_t n, size_t d, double eps, const float *weight, float *out);

#endif
