/* dispatch_matmul.c — the multi-token entry points: argument checks, x in the backend's lane
 * order (prep), and the work split.
 *
 * Rows are split among the pool's threads as for the single-vector kernels (tasks of a multiple
 * of 16 rows), and the tokens in blocks whose prepared x fits X_BLOCK_BYTES: a task is (row
 * chunk, token block), so the x a task walks its rows with stays in the core's L2 (all tokens at
 * once streamed x from L3 for every 4-row group: 512 tokens x 1024 took 1.2x the time of two
 * 256-token halves).  A (row, token) product is the same sequence whichever task computes it, so
 * a result never depends on the thread count or the blocks.  x is prepared once per call into the caller's scratch, by a pool job over the
 * tokens.  A batch of one token goes to the single-vector kernel itself: the same bits by
 * definition, and its decode in registers is faster than a tile for one vector.
 *
 * Routed experts (ds4f_experts_forward_tokens): phase 1 runs w1 and w3 of every expert on its
 * tokens, task = (expert, part of the inter rows, 32-aligned), and each task turns its slice of
 * gate/up into the activation (the expression of ds4f_experts_forward_each, element by element)
 * and prepares that slice for w2; phase 2 runs w2, task = (expert, part of the hidden rows).
 * An expert with one token goes through the single-vector kernels on natural x, as in decode.
 * A task takes an expert's tokens in blocks as matmul's tasks do (all 96 tokens an expert gets in
 * a 1024-token chunk at once streamed their 1.5 MiB of x from L3 for every 4-row group, and a
 * chunk of 1024 prefilled at 0.8x the tokens/s of chunks of 256).
 */
#include <string.h>

#include "kernels_internal.h"

#define ROW_ALIGN 16
#define MIN_TASK_WEIGHTS (1u << 16) /* below this, one thread does it all */
#define PREP_TOKENS 8               /* tokens per prep task */
#define X_BLOCK_BYTES (256u << 10)  /* a token block's prepared x, */
#define MIN_BLOCK_TOKENS 32         /* with at least these tokens: a block decodes its rows' weights again */

static size_t round_up(size_t a, size_t m) { return (a + m - 1) / m * m; }

static const ds4f_mtable *mtable(int backend) {
    switch (backend) {
#ifdef DS4F_X86
    case DS4F_AVX2: return &ds4f_mt_avx2;
    case DS4F_AVX512: return &ds4f_mt_avx512;
#endif
#ifdef DS4F_ARM64
    case DS4F_NEON: return &ds4f_mt_neon;
#endif
    default: return &ds4f_mt_scalar;
    }
}

const ds4f_mtable *ds4f_mtable_of(int backend) { return mtable(backend); }

/* one row of x in kind's prepared form, kpad floats (zero past k) */
static void prep_row(const ds4f_mtable *m, int kind, const float *x, size_t k, size_t kpad, float *xp) {
    if (m->prep[kind]) {
        m->prep[kind](x, k, xp);
    } else {
        memcpy(xp, x, k * sizeof(float));
        memset(xp + k, 0, (kpad - k) * sizeof(float));
    }
}

/* ---- matrix x several vectors ------------------------------------------------------------- */

/* Prepared rows are stored this far apart: padded to DS4F_MM_XPAD_MAX, plus one cache line so
 * that with k a multiple of 1024 the tokens' rows are not all 4 KiB apart (the same L1 sets for
 * every token's chunk; no measurable difference on the bench shapes, but never worse). */
static size_t xp_stride(size_t k) { return round_up(k, DS4F_MM_XPAD_MAX) + 16; }

size_t ds4f_matmul_scratch_floats(size_t n, size_t k) { return n * xp_stride(k); }

typedef struct {
    const ds4f_mtable *m;
    int kind;
    const void *w;
    const uint8_t *scales;
    size_t rows, k, n, chunk, kpad, ldx;
    size_t tblock, nchunks; /* tokens per block; row chunks per token block */
    const float *x;
    size_t ldxin, ldy;      /* x's rows ldxin floats apart, y's ldy */
    float *xp, *y;
} mm_job;

static void prep_task(void *ctx, size_t i) {
    const mm_job *j = ctx;
    const size_t t1 = (i + 1) * PREP_TOKENS < j->n ? (i + 1) * PREP_TOKENS : j->n;
    for (size_t t = i * PREP_TOKENS; t < t1; t++) prep_row(j->m, j->kind, j->x + t * j->ldxin, j->k, j->kpad, j->xp + t * j->ldx);
}

/* task i: token block i / nchunks (the threads share a block's x while they take its rows), row
 * chunk i % nchunks */
/* tokens per block of a k-wide x: X_BLOCK_BYTES of it, at least MIN_BLOCK_TOKENS, at most n */
static size_t block_tokens(size_t ldx, size_t n) {
    size_t tb = X_BLOCK_BYTES / (ldx * sizeof(float));
    if (tb < MIN_BLOCK_TOKENS) tb = MIN_BLOCK_TOKENS;
    return tb < n ? tb : n;
}

static void mm_task(void *ctx, size_t i) {
    const mm_job *j = ctx;
    const size_t c = i % j->nchunks, t0 = (i / j->nchunks) * j->tblock;
    const size_t r0 = c * j->chunk, r1 = r0 + j->chunk < j->rows ? r0 + j->chunk : j->rows;
    const size_t nt = t0 + j->tblock < j->n ? j->tblock : j->n - t0;
    j->m->mm[j->kind](j->w, j->scales, r0, r1, j->k, nt, j->xp + t0 * j->ldx, j->ldx, j->y + t0 * j->ldy, j->ldy);
}

/* one matrix on n vectors: x row t at x + t ldxin, its results at y + t ldy (both at least the
 * matrix's k and rows); arguments checked by the caller */
static void matmul_strided(int kind, const void *w, const uint8_t *scales, size_t rows, size_t k, size_t n,
                           const float *x, size_t ldxin, float *y, size_t ldy, float *scratch) {
    if (rows == 0 || n == 0) return;
    if (n == 1) { /* the single-vector kernel: the same bits, and faster for one vector */
        switch (kind) {
        case DS4F_MM_MXFP4: ds4f_mxfp4_matvec(w, scales, rows, k, x, y); break;
        case DS4F_MM_BF16: ds4f_bf16_matvec(w, rows, k, x, y); break;
        default: ds4f_fp8_matvec(w, scales, rows, k, x, y); break;
        }
        return;
    }
    mm_job j = {mtable(ds4f_get_backend()), kind, w, scales, rows, k, n, 0, 0, xp_stride(k), 0, 0, x, ldxin, ldy,
                scratch, y};
    j.kpad = round_up(k, j.m->xpad[kind]);
    if (!j.m->prep[kind] && j.kpad == k) {
        j.xp = (float *)x; /* natural order, no padding: x as it is */
        j.ldx = ldxin;
    } else {
        ds4f_pool_run(prep_task, &j, (n + PREP_TOKENS - 1) / PREP_TOKENS);
    }
    const size_t nt = (size_t)ds4f_pool_get_threads();
    size_t ntasks = 1;
    if (nt > 1 && rows * k * n >= MIN_TASK_WEIGHTS) ntasks = 4 * nt;
    j.chunk = round_up((rows + ntasks - 1) / ntasks, ROW_ALIGN);
    j.nchunks = (rows + j.chunk - 1) / j.chunk;
    j.tblock = block_tokens(j.ldx, n);
    ds4f_pool_run(mm_task, &j, j.nchunks * ((n + j.tblock - 1) / j.tblock));
}

static int kind_ok(int kind, const void *w, const uint8_t *scales, size_t k) {
    return w && kind >= 0 && kind < DS4F_MM_KINDS && (kind == DS4F_MM_BF16 || scales) && k > 0 &&
           (kind == DS4F_MM_FP8 || k % 32 == 0);
}

static int matmul(int kind, const void *w, const uint8_t *scales, size_t rows, size_t k, size_t n, const float *x,
                  float *y, float *scratch) {
    if (!kind_ok(kind, w, scales, k) || !x || !y || !scratch) return -1;
    matmul_strided(kind, w, scales, rows, k, n, x, k, y, rows, scratch);
    return 0;
}

/* ---- a group of matrices in one call ------------------------------------------------------ */

/* One vector (decode): every matrix's row chunks are tasks of one pool job, so the threads meet
 * once for the group instead of once per matrix; each chunk runs the single-vector kernel's row
 * function, as ds4f_*_matvec's tasks do. */
typedef struct {
    const ds4f_ktable *t;
    const ds4f_matrix *m;
    size_t count, chunk[DS4F_GROUP_MAX], first[DS4F_GROUP_MAX + 1]; /* first[i]: matrix i's first task */
    const float *x;
    float *y;
} group_job;

static void group_task(void *ctx, size_t i) {
    const group_job *j = ctx;
    size_t g = 0;
    while (i >= j->first[g + 1]) g++;
    const ds4f_matrix *m = &j->m[g];
    const size_t r0 = (i - j->first[g]) * j->chunk[g], r1 = r0 + j->chunk[g] < m->rows ? r0 + j->chunk[g] : m->rows;
    const float *x = j->x + m->x_col;
    float *y = j->y + m->y_col;
    switch (m->kind) {
    case DS4F_MM_MXFP4: j->t->matvec(m->w, m->scales, r0, r1, m->k, x, y); break;
    case DS4F_MM_BF16: j->t->bf16(m->w, r0, r1, m->k, x, y); break;
    default: j->t->fp8_matvec(m->w, m->scales, r0, r1, m->k, x, y); break;
    }
}

int ds4f_matmul_group(const ds4f_matrix *m, size_t count, size_t n, const float *x, size_t ldx, float *y, size_t ldy,
                      float *scratch) {
    if (!m || count > DS4F_GROUP_MAX || !x || !y || !scratch) return -1;
    for (size_t i = 0; i < count; i++)
        if (!kind_ok(m[i].kind, m[i].w, m[i].scales, m[i].k) || m[i].x_col + m[i].k > ldx ||
            m[i].y_col + m[i].rows > ldy)
            return -1;
    if (n == 0 || count == 0) return 0;
    if (n > 1) {
        for (size_t i = 0; i < count; i++)
            matmul_strided(m[i].kind, m[i].w, m[i].scales, m[i].rows, m[i].k, n, x + m[i].x_col, ldx,
                           y + m[i].y_col, ldy, scratch);
        return 0;
    }
    group_job j = {ds4f_ktable_of(ds4f_get_backend()), m, count, {0}, {0}, x, y};
    const size_t nt = (size_t)ds4f_pool_get_threads();
    for (size_t i = 0; i < count; i++) { /* each matrix cut as ds4f_*_matvec cuts it alone */
        const size_t ntasks = nt > 1 && m[i].rows * m[i].k >= MIN_TASK_WEIGHTS ? 4 * nt : 1;
        j.chunk[i] = round_up((m[i].rows + ntasks - 1) / ntasks, ROW_ALIGN);
        if (j.chunk[i] == 0) j.chunk[i] = ROW_ALIGN;
        j.first[i + 1] = j.first[i] + (m[i].rows + j.chunk[i] - 1) / j.chunk[i];
    }
    ds4f_pool_run(group_task, &j, j.first[count]);
    return 0;
}

int ds4f_mxfp4_matmul(const uint8_t *codes, const uint8_t *scales, size_t rows, size_t k, size_t n,
                      const float *x, float *y, float *scratch) {
    return matmul(DS4F_MM_MXFP4, codes, scales, rows, k, n, x, y, scratch);
}

int ds4f_bf16_matmul(const uint16_t *w, size_t rows, size_t k, size_t n, const float *x, float *y,
                     float *scratch) {
    return matmul(DS4F_MM_BF16, w, NULL, rows, k, n, x, y, scratch);
}

int ds4f_fp8_matmul(const uint8_t *w, const uint8_t *scales, size_t rows, size_t k, size_t n,
                    const float *x, float *y, float *scratch) {
    return matmul(DS4F_MM_FP8, w, scales, rows, k, n, x, y, scratch);
}

/* ---- routed experts on their tokens ------------------------------------------------------- */

/* scratch: xp[pairs][hidden] (x rows gathered, prepared) | gate[pairs][inter] (then the
 * activation) | up[pairs][inter] | ap[pairs][inter] (the activation prepared for w2) */
size_t ds4f_experts_tokens_scratch_floats(size_t pairs, size_t hidden, size_t inter) {
    return pairs * (hidden + 3 * inter);
}

typedef struct {
    const ds4f_ktable *t;
    const ds4f_mtable *m;
    const ds4f_expert_tokens *ex;
    size_t n, hidden, inter, rows1, rows2;
    const float *x;
    float limit;
    float *xp, *gate, *up, *ap, *y;
} tok_job;

/* expert e's first row in y (and in the per-pair scratch): a sum over the experts before it,
 * O(n) per task and tiny next to a task's matrix work */
static size_t first_pair(const tok_job *j, size_t e) {
    size_t o = 0;
    for (size_t a = 0; a < e; a++) o += j->ex[a].n;
    return o;
}

/* task = expert e: its token rows of x, gathered and prepared (one token: x is read in place) */
static void gather_task(void *ctx, size_t e) {
    const tok_job *j = ctx;
    const ds4f_expert_tokens *x = &j->ex[e];
    if (x->n < 2) return;
    const size_t o = first_pair(j, e);
    for (size_t i = 0; i < x->n; i++)
        prep_row(j->m, DS4F_MM_MXFP4, j->x + (size_t)x->tokens[i] * j->hidden, j->hidden, j->hidden,
                 j->xp + (o + i) * j->hidden);
}

/* Task i = expert i % n, part i / n (consecutive tasks go to different experts). */
static void tokens_phase1(void *ctx, size_t task) {
    const tok_job *j = ctx;
    const size_t e = task % j->n, r0 = (task / j->n) * j->rows1;
    const size_t r1 = r0 + j->rows1 < j->inter ? r0 + j->rows1 : j->inter;
    const ds4f_expert_tokens *x = &j->ex[e];
    if (r0 >= r1 || x->n == 0) return;
    const size_t o = first_pair(j, e), hid = j->hidden, in = j->inter;
    float *g = j->gate + o * in, *u = j->up + o * in;
    if (x->n == 1) {
        const float *xr = j->x + (size_t)x->tokens[0] * hid;
        j->t->matvec(x->w1, x->s1, r0, r1, hid, xr, g);
        j->t->matvec(x->w3, x->s3, r0, r1, hid, xr, u);
    } else { /* in token blocks, as matmul's tasks: a block's x stays in L2 while the rows pass */
        const size_t tb = block_tokens(hid, x->n);
        for (size_t t0 = 0; t0 < x->n; t0 += tb) {
            const size_t tn = x->n - t0 < tb ? x->n - t0 : tb;
            const float *xb = j->xp + (o + t0) * hid;
            j->m->mm[DS4F_MM_MXFP4](x->w1, x->s1, r0, r1, hid, tn, xb, hid, g + t0 * in, in);
            j->m->mm[DS4F_MM_MXFP4](x->w3, x->s3, r0, r1, hid, tn, xb, hid, u + t0 * in, in);
        }
    }
    const float lim = j->limit;
    for (size_t i = 0; i < x->n; i++) {
        float *gi = g + i * in;
        const float *ui = u + i * in, wt = x->weights[i];
        for (size_t r = r0; r < r1; r++) { /* ds4f_experts_forward_each's expression, as written there */
            float gv = gi[r], uv = ui[r];
            if (gv > lim) gv = lim;
            if (uv > lim) uv = lim;
            if (uv < -lim) uv = -lim;
            gi[r] = ds4f_silu(gv) * uv * wt;
        }
        if (x->n > 1 && j->m->prep[DS4F_MM_MXFP4])
            j->m->prep[DS4F_MM_MXFP4](gi + r0, r1 - r0, j->ap + (o + i) * in + r0);
    }
}

static void tokens_phase2(void *ctx, size_t task) {
    const tok_job *j = ctx;
    const size_t e = task % j->n, r0 = (task / j->n) * j->rows2;
    const size_t r1 = r0 + j->rows2 < j->hidden ? r0 + j->rows2 : j->hidden;
    const ds4f_expert_tokens *x = &j->ex[e];
    if (r0 >= r1 || x->n == 0) return;
    const size_t o = first_pair(j, e), in = j->inter;
    float *y = j->y + o * j->hidden;
    if (x->n == 1) {
        j->t->matvec(x->w2, x->s2, r0, r1, in, j->gate + o * in, y);
    } else {
        const float *a = j->m->prep[DS4F_MM_MXFP4] ? j->ap : j->gate;
        const size_t tb = block_tokens(in, x->n);
        for (size_t t0 = 0; t0 < x->n; t0 += tb)
            j->m->mm[DS4F_MM_MXFP4](x->w2, x->s2, r0, r1, in, x->n - t0 < tb ? x->n - t0 : tb, a + (o + t0) * in, in,
                                    y + t0 * j->hidden, j->hidden);
    }
}

int ds4f_experts_forward_tokens(const ds4f_expert_tokens *ex, int n_experts, const float *x, size_t ntok,
                                size_t hidden, size_t inter, float limit, float *y, float *scratch) {
    if (!ex || !x || !y || !scratch || n_experts < 1 || hidden == 0 || inter == 0 || hidden % 32 || inter % 32)
        return -1;
    const size_t ne = (size_t)n_experts;
    size_t pairs = 0;
    for (size_t e = 0; e < ne; e++) {
        const ds4f_expert_tokens *a = &ex[e];
        if (a->n && (!a->w1 || !a->s1 || !a->w3 || !a->s3 || !a->w2 || !a->s2 || !a->tokens || !a->weights))
            return -1;
        for (size_t i = 0; i < a->n; i++)
            if (a->tokens[i] < 0 || (size_t)a->tokens[i] >= ntok) return -1;
        pairs += a->n;
    }
    if (pairs == 0) return 0;
    const int backend = ds4f_get_backend();
    const size_t nt = (size_t)ds4f_pool_get_threads();
    const size_t parts = nt <= 1 ? 1 : (2 * nt + ne - 1) / ne; /* >= 2 tasks per thread */
    tok_job j = {ds4f_ktable_of(backend), mtable(backend), ex, ne, hidden, inter,
                 round_up((inter + parts - 1) / parts, 32), round_up((hidden + parts - 1) / parts, ROW_ALIGN), x, limit,
                 scratch, scratch + pairs * hidden, scratch + pairs * (hidden + inter),
                 scratch + pairs * (hidden + 2 * inter), y};
    ds4f_pool_run(gather_task, &j, ne);
    ds4f_pool_run(tokens_phase1, &j, ne * ((inter + j.rows1 - 1) / j.rows1));
    ds4f_pool_run(tokens_phase2, &j, ne * ((hidden + j.rows2 - 1) / j.rows2));
    return 0;
}
