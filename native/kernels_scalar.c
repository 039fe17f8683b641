/* placeholder: replaced by the kernel work of issue 2 */
#include "ds4f_kernels.h"
#include <math.h>
static const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                               -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
void ds4f_mxfp4_decode(const uint8_t *codes, const uint8_t *scales, size_t rows, size_t k, float *out) {
    for (size_t i = 0; i < rows * k; i++) {
        uint8_t b = codes[i / 2], c = (i & 1) ? (b >> 4) : (b & 15);
        out[i] = E2M1[c] * ldexpf(1.f, (int)scales[i / 32] - 127);
    }
}
int ds4f_backend_supported(int b) { return b == 0; }
int ds4f_set_backend(int b) { return b == 0 ? 0 : -1; }
int ds4f_get_backend(void) { return 0; }
int ds4f_best_backend(void) { return 0; }
int ds4f_set_threads(int n) { return n >= 1 ? 0 : -1; }
int ds4f_get_threads(void) { return 1; }
void ds4f_mxfp4_matvec(const uint8_t *c, const uint8_t *s, size_t r, size_t k, const float *x, float *y) {}
void ds4f_bf16_matvec(const uint16_t *w, size_t r, size_t k, const float *x, float *y) {}
size_t ds4f_experts_scratch_floats(int n, size_t h, size_t i) { return 0; }
int ds4f_experts_forward(const ds4f_expert *ex, int n, const float *x, size_t h, size_t i, float l, float *y, float *s) { return -1; }
