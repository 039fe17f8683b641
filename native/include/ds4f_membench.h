/* ds4f_membench.h — the memory floor: how fast this machine streams a buffer from RAM with the
 * loads of one backend's width, split across the kernels' thread pool as the kernels split
 * their rows.  `ds4f bench-kernels` divides every kernel's GB/s by this figure (the same
 * backend and thread count) to say how close a kernel gets to what RAM can deliver.
 */
#ifndef DS4F_MEMBENCH_H
#define DS4F_MEMBENCH_H
#include <stddef.h>
#include <stdint.h>

/* Reads buf[0 .. nbytes) once, as 64-bit words (DS4F_SCALAR), 128-bit (DS4F_NEON), 256-bit
 * (DS4F_AVX2) or 512-bit (DS4F_AVX512) loads, on ds4f_get_threads() threads, and stores in
 * *sum the 64-bit wrap-around sum of the buffer's little-endian 64-bit words: the same value
 * for every backend and thread count, and one the compiler cannot skip a load of.
 * buf must be 8-byte aligned and nbytes a multiple of 8.
 * Returns 0, or -1 (nothing read) for an unsupported backend or bad arguments. */
int ds4f_mem_read(const void *buf, size_t nbytes, int backend, uint64_t *sum);

/* The FMA peak: 4 tasks per pool thread (1 task on 1 thread), each running `iters` iterations of
 * 12 independent multiply-add chains of the backend's width (a fused multiply-add on the SIMD
 * backends; a multiply and an add on scalar, which never fuses).  *lanes = the multiply-add lanes
 * computed, so lanes / seconds is the backend's peak; ds4f_fma_lanes = its lanes per instruction.
 * Returns a checksum of the chains' values (>= 0), or -1 for an unsupported backend or lanes NULL. */
long long ds4f_fma_peak(int backend, size_t iters, double *lanes);
int ds4f_fma_lanes(int backend);

#endif
