/* crc32c.h — CRC32C (Castagnoli), zlib-style running value: the CRC of a||b
 * is tr_crc32c(tr_crc32c(0, a), b). Folding by VPCLMULQDQ from 1 KiB (on
 * 512-bit vectors with AVX-512, else on 256-bit ones with AVX2: there the
 * plain CRC and the copy only below 512 KiB), else SSE4.2 (and AVX2 for the
 * fused passes) when the CPU has them, chosen at run time; identical
 * results either way.
 * Thread-safe; no allocation; cannot fail.
 */
#ifndef TRANSOM_CRC32C_H
#define TRANSOM_CRC32C_H

#include <stddef.h>
#include <stdint.h>

uint32_t tr_crc32c(uint32_t crc, const void *buf, size_t len);
/* The portable table version (for tests). */
uint32_t tr_crc32c_sw(uint32_t crc, const void *buf, size_t len);
/* One pass each: copy len bytes src -> dst and return the CRC of src; and
 * dst[k] += src[k], save[k] = old dst[k] for n floats, returning the CRC of
 * src's bytes. SSE4.2 + AVX2 when the CPU has them. */
uint32_t tr_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len);
uint32_t tr_crc32c_reduce(uint32_t crc, float *dst, float *save, const float *src, size_t n);
/* The same two with the copy's dst / the reduce's save written by
 * non-temporal stores where a folding path runs (plain stores on the
 * others): for bytes written now and read seldom, which then take no cache
 * from the data read next (FTAR's saved input, read only to undo an aborted
 * collective). Same results. */
uint32_t tr_crc32c_copy_nt(uint32_t crc, void *dst, const void *src, size_t len);
uint32_t tr_crc32c_reduce_nt(uint32_t crc, float *dst, float *save, const float *src, size_t n);
/* For tests and benches: use at most path `level` (3 AVX-512 + VPCLMULQDQ,
 * 2 AVX2 + VPCLMULQDQ, 1 SSE4.2 + AVX2, 0 the table); returns the path now
 * used (the CPU may lack the wider ones). Not thread-safe: call while no
 * CRC runs. The environment's TRANSOM_CRC32C_LEVEL=0..3 (any other value
 * is ignored) caps the path the same way for a whole program, read at the
 * first CRC; a later call here overrides it. */
int tr_crc32c_level(int level);

#endif
