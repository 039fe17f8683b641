/* bench/ggml_mxfp4.c — ggml's MXFP4 matvec kernels on a ds4f matrix, for bench/ggml.py (compiled
 * there against a ggml build; ds4f itself never links ggml).
 *
 * gb_setup converts ds4f's codes and scales (element 2i in byte i's low nibble, 2i + 1 in its high
 * one; one E8M0 byte per 32) into ggml's block_mxfp4 (element j in qs[j]'s low nibble, j + 16 in its
 * high one), keeps one plain copy and sets one into ggml's CPU_REPACK buffer, which repacks it.
 * Each call then does what ggml's mul_mat does for one column: x to q8_0 (the vec_dot type of
 * MXFP4), then ggml_vec_dot_mxfp4_q8_0 row by row (gb_standard) or ggml_gemv_mxfp4_8x8_q8_0 over
 * the repacked rows (gb_repacked). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

typedef struct {
    uint8_t e;
    uint8_t qs[16];
} gb_block; /* ggml's block_mxfp4 */

void ggml_gemv_mxfp4_8x8_q8_0(int n, float *s, size_t bs, const void *vx, const void *vy, int nr, int nc);

static size_t g_rows, g_k;
static gb_block *g_plain;
static void *g_q8;
static struct ggml_context *g_ctx;
static struct ggml_tensor *g_rep;
static ggml_backend_buffer_t g_buf;
static const struct ggml_type_traits_cpu *g_tq, *g_tw;

static void gb_quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)level, (void)text, (void)user; /* ggml's notes (which tensors it repacks) stay off the bench's output */
}

/* 0; -1: no CPU_REPACK buffer type in this ggml; -2: it did not repack MXFP4 (rows % 8, no AVX2);
 * -3: out of memory.  Once per process. */
int gb_setup(const uint8_t *codes, const uint8_t *scales, size_t rows, size_t k) {
    ggml_log_set(gb_quiet, NULL);
    ggml_cpu_init();
    g_rows = rows, g_k = k;
    const size_t nb = k / 32;
    g_plain = malloc(rows * nb * sizeof(gb_block));
    g_q8 = malloc(nb * 34); /* block_q8_0: an fp16 scale and 32 int8 */
    if (!g_plain || !g_q8) return -3;
    for (size_t r = 0; r < rows; r++)
        for (size_t b = 0; b < nb; b++) {
            gb_block *o = &g_plain[r * nb + b];
            const uint8_t *c = codes + r * (k / 2) + 16 * b;
            o->e = scales[r * nb + b];
            for (int j = 0; j < 16; j++) {
                const int lo = (c[j / 2] >> (4 * (j & 1))) & 15, hi = (c[(j + 16) / 2] >> (4 * (j & 1))) & 15;
                o->qs[j] = (uint8_t)(lo | hi << 4);
            }
        }
    g_tw = ggml_get_type_traits_cpu(GGML_TYPE_MXFP4);
    g_tq = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0);
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
    ggml_backend_dev_get_extra_bufts_t get = ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    ggml_backend_buffer_type_t rep = NULL;
    for (ggml_backend_buffer_type_t *p = get ? get(dev) : NULL; p && *p; p++)
        if (strcmp(ggml_backend_buft_name(*p), "CPU_REPACK") == 0) rep = *p;
    if (!rep) return -1;
    struct ggml_init_params ip = {ggml_tensor_overhead() * 4, NULL, true};
    g_ctx = ggml_init(ip);
    g_rep = ggml_new_tensor_2d(g_ctx, GGML_TYPE_MXFP4, (int64_t)k, (int64_t)rows);
    g_buf = ggml_backend_buft_alloc_buffer(rep, ggml_backend_buft_get_alloc_size(rep, g_rep));
    if (!g_buf) return -3;
    ggml_backend_tensor_alloc(g_buf, g_rep, ggml_backend_buffer_get_base(g_buf));
    ggml_backend_tensor_set(g_rep, g_plain, 0, rows * nb * sizeof(gb_block));
    return g_rep->extra ? 0 : -2;
}

void gb_standard(const float *x, float *y) {
    g_tq->from_float(x, g_q8, (int64_t)g_k);
    const size_t rb = g_k / 32 * sizeof(gb_block);
    for (size_t r = 0; r < g_rows; r++) g_tw->vec_dot((int)g_k, y + r, 0, (const char *)g_plain + r * rb, 0, g_q8, 0, 1);
}

void gb_repacked(const float *x, float *y) {
    g_tq->from_float(x, g_q8, (int64_t)g_k);
    ggml_gemv_mxfp4_8x8_q8_0((int)g_k, y, g_rows, g_rep->data, g_q8, 1, (int)g_rows);
}
