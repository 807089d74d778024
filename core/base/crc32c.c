/* crc32c.c — CRC32C (Castagnoli): plain, and fused with a copy or a float
 * reduction so a buffer is read once. See crc32c.h.
 *
 * The hardware path runs three independent crc32q streams over adjacent
 * blocks and merges them with precomputed "append N zero bytes" operators
 * (Mark Adler's crc32c.c method), about 3x the single-stream speed; the
 * portable path is slicing-by-8. Both give identical results
 * (spec/c/test_ftar.c compares them). Tables are built once, thread-safely.
 * Used by FTAR's frames and the checkpoint engine's manifests and data.
 */
#include "crc32c.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CRC_HAVE_X86 1
#endif

#define POLY 0x82f63b78u /* CRC-32C, reflected */
#define CRC_LONG 8192
#define CRC_SHORT 256

static uint32_t crc_table[8][256];
static uint32_t crc_long[4][256], crc_short[4][256];
static int crc_hw;
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

/* --- zero-append operators (GF(2) 32x32 matrices) --- */

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
  uint32_t sum = 0;
  while (vec) {
    if (vec & 1) sum ^= *mat;
    vec >>= 1;
    mat++;
  }
  return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
  for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* Operator that appends len (a power of two) zero bytes to a crc. */
static void zeros_op(uint32_t *even, size_t len) {
  uint32_t odd[32];
  odd[0] = POLY; /* one zero bit */
  uint32_t row = 1;
  for (int n = 1; n < 32; n++) {
    odd[n] = row;
    row <<= 1;
  }
  gf2_square(even, odd); /* two zero bits */
  gf2_square(odd, even); /* four */
  /* the next square gives one zero byte in even, then two in odd, ... */
  do {
    gf2_square(even, odd);
    len >>= 1;
    if (len == 0) return;
    gf2_square(odd, even);
    len >>= 1;
  } while (len);
  for (int n = 0; n < 32; n++) even[n] = odd[n];
}

static void zeros_table(uint32_t zeros[4][256], size_t len) {
  uint32_t op[32];
  zeros_op(op, len);
  for (uint32_t n = 0; n < 256; n++) {
    zeros[0][n] = gf2_times(op, n);
    zeros[1][n] = gf2_times(op, n << 8);
    zeros[2][n] = gf2_times(op, n << 16);
    zeros[3][n] = gf2_times(op, n << 24);
  }
}

static inline uint32_t crc_shift(uint32_t zeros[4][256], uint32_t crc) {
  return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

static void crc_init(void) {
  for (uint32_t n = 0; n < 256; n++) {
    uint32_t c = n;
    for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
    crc_table[0][n] = c;
  }
  for (uint32_t n = 0; n < 256; n++) {
    uint32_t c = crc_table[0][n];
    for (int k = 1; k < 8; k++) {
      c = crc_table[0][c & 0xff] ^ (c >> 8);
      crc_table[k][n] = c;
    }
  }
  zeros_table(crc_long, CRC_LONG);
  zeros_table(crc_short, CRC_SHORT);
#ifdef CRC_HAVE_X86
  __builtin_cpu_init();
  crc_hw = __builtin_cpu_supports("sse4.2");
#endif
}

/* --- software --- */

uint32_t tr_crc32c_sw(uint32_t crc, const void *buf, size_t len) {
  pthread_once(&crc_once, crc_init);
  const uint8_t *p = buf;
  uint64_t c = (uint32_t)~crc;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  while (len && ((uintptr_t)p & 7)) {
    c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    len--;
  }
  while (len >= 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    c ^= w;
    c = crc_table[7][c & 0xff] ^ crc_table[6][(c >> 8) & 0xff] ^ crc_table[5][(c >> 16) & 0xff] ^
        crc_table[4][(c >> 24) & 0xff] ^ crc_table[3][(c >> 32) & 0xff] ^ crc_table[2][(c >> 40) & 0xff] ^
        crc_table[1][(c >> 48) & 0xff] ^ crc_table[0][c >> 56];
    p += 8;
    len -= 8;
  }
#endif
  while (len--) c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return ~(uint32_t)c;
}

/* --- SSE4.2 --- */

#ifdef CRC_HAVE_X86
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const void *buf, size_t len) {
  const uint8_t *next = buf;
  uint64_t crc0 = (uint32_t)~crc, crc1, crc2, w0, w1, w2;
  while (len && ((uintptr_t)next & 7)) {
    crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
    len--;
  }
  while (len >= CRC_LONG * 3) {
    crc1 = crc2 = 0;
    const uint8_t *end = next + CRC_LONG;
    do {
      memcpy(&w0, next, 8);
      memcpy(&w1, next + CRC_LONG, 8);
      memcpy(&w2, next + 2 * CRC_LONG, 8);
      crc0 = _mm_crc32_u64(crc0, w0);
      crc1 = _mm_crc32_u64(crc1, w1);
      crc2 = _mm_crc32_u64(crc2, w2);
      next += 8;
    } while (next < end);
    crc0 = crc_shift(crc_long, (uint32_t)crc0) ^ crc1;
    crc0 = crc_shift(crc_long, (uint32_t)crc0) ^ crc2;
    next += 2 * CRC_LONG;
    len -= 3 * CRC_LONG;
  }
  while (len >= CRC_SHORT * 3) {
    crc1 = crc2 = 0;
    const uint8_t *end = next + CRC_SHORT;
    do {
      memcpy(&w0, next, 8);
      memcpy(&w1, next + CRC_SHORT, 8);
      memcpy(&w2, next + 2 * CRC_SHORT, 8);
      crc0 = _mm_crc32_u64(crc0, w0);
      crc1 = _mm_crc32_u64(crc1, w1);
      crc2 = _mm_crc32_u64(crc2, w2);
      next += 8;
    } while (next < end);
    crc0 = crc_shift(crc_short, (uint32_t)crc0) ^ crc1;
    crc0 = crc_shift(crc_short, (uint32_t)crc0) ^ crc2;
    next += 2 * CRC_SHORT;
    len -= 3 * CRC_SHORT;
  }
  while (len >= 8) {
    memcpy(&w0, next, 8);
    crc0 = _mm_crc32_u64(crc0, w0);
    next += 8;
    len -= 8;
  }
  while (len--) crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
  return ~(uint32_t)crc0;
}
#endif

uint32_t tr_crc32c(uint32_t crc, const void *buf, size_t len) {
  pthread_once(&crc_once, crc_init);
#ifdef CRC_HAVE_X86
  if (crc_hw) return crc32c_hw(crc, buf, len);
#endif
  return tr_crc32c_sw(crc, buf, len);
}

/* --- fused passes: checksum while copying / reducing ---
 * The same three-stream block structure as crc32c_hw; each 32-byte step of
 * each stream also moves (copy) or adds (reduce) those bytes with AVX2, so
 * the data is read once. Byte order of the CRC is memory order, as above. */

#ifdef CRC_HAVE_X86
static int fused_hw;

#define FUSED_BLOCKS(BLK, TABLE, STEP)                                   \
  while (len - i >= 3 * (size_t)(BLK)) {                                 \
    uint64_t c1 = 0, c2 = 0, w;                                          \
    for (size_t k = 0; k < (size_t)(BLK); k += 32) {                     \
      const uint8_t *a0 = s + i + k, *a1 = a0 + (BLK), *a2 = a1 + (BLK); \
      for (int q = 0; q < 32; q += 8) {                                  \
        memcpy(&w, a0 + q, 8);                                           \
        c0 = _mm_crc32_u64(c0, w);                                       \
        memcpy(&w, a1 + q, 8);                                           \
        c1 = _mm_crc32_u64(c1, w);                                       \
        memcpy(&w, a2 + q, 8);                                           \
        c2 = _mm_crc32_u64(c2, w);                                       \
      }                                                                  \
      STEP(i + k);                                                       \
      STEP(i + k + (BLK));                                               \
      STEP(i + k + 2 * (BLK));                                           \
    }                                                                    \
    c0 = crc_shift(TABLE, (uint32_t)c0) ^ c1;                            \
    c0 = crc_shift(TABLE, (uint32_t)c0) ^ c2;                            \
    i += 3 * (size_t)(BLK);                                              \
  }

__attribute__((target("sse4.2,avx2"))) static uint32_t crc_copy_hw(uint32_t crc, uint8_t *d, const uint8_t *s,
                                                                    size_t len) {
  uint64_t c0 = (uint32_t)~crc;
  size_t i = 0;
  while (i < len && ((uintptr_t)(s + i) & 7)) {
    d[i] = s[i];
    c0 = _mm_crc32_u8((uint32_t)c0, s[i]);
    i++;
  }
#define COPY_STEP(o) _mm256_storeu_si256((__m256i *)(d + (o)), _mm256_loadu_si256((const __m256i *)(s + (o))))
  FUSED_BLOCKS(CRC_LONG, crc_long, COPY_STEP)
  FUSED_BLOCKS(CRC_SHORT, crc_short, COPY_STEP)
#undef COPY_STEP
  for (; len - i >= 8; i += 8) {
    uint64_t w;
    memcpy(&w, s + i, 8);
    memcpy(d + i, &w, 8);
    c0 = _mm_crc32_u64(c0, w);
  }
  for (; i < len; i++) {
    d[i] = s[i];
    c0 = _mm_crc32_u8((uint32_t)c0, s[i]);
  }
  return ~(uint32_t)c0;
}

/* dst[k] += src[k] for n floats, save[k] = the old dst[k]; CRC over src. */
__attribute__((target("sse4.2,avx2"))) static uint32_t crc_reduce_hw(uint32_t crc, float *dst, float *save,
                                                                      const float *src, size_t n) {
  uint64_t c0 = (uint32_t)~crc;
  const uint8_t *s = (const uint8_t *)src;
  size_t len = n * sizeof(float), i = 0;
  if (n && ((uintptr_t)s & 7)) { /* floats are 4-aligned: at most one to reach 8 */
    uint32_t w;
    memcpy(&w, s, 4);
    c0 = _mm_crc32_u32((uint32_t)c0, w);
    float t = dst[0];
    save[0] = t;
    dst[0] = t + src[0];
    i = 4;
  }
#define RED_STEP(o)                                                                      \
  do {                                                                                   \
    size_t f_ = (o) / 4;                                                                 \
    __m256 t_ = _mm256_loadu_ps(dst + f_);                                               \
    _mm256_storeu_ps(save + f_, t_);                                                     \
    _mm256_storeu_ps(dst + f_, _mm256_add_ps(t_, _mm256_loadu_ps(src + f_)));            \
  } while (0)
  FUSED_BLOCKS(CRC_LONG, crc_long, RED_STEP)
  FUSED_BLOCKS(CRC_SHORT, crc_short, RED_STEP)
#undef RED_STEP
  for (; len - i >= 8; i += 8) {
    uint64_t w;
    memcpy(&w, s + i, 8);
    c0 = _mm_crc32_u64(c0, w);
    for (size_t f = i / 4; f < i / 4 + 2; f++) {
      float t = dst[f];
      save[f] = t;
      dst[f] = t + src[f];
    }
  }
  if (i < len) {
    uint32_t w;
    memcpy(&w, s + i, 4);
    c0 = _mm_crc32_u32((uint32_t)c0, w);
    size_t f = i / 4;
    float t = dst[f];
    save[f] = t;
    dst[f] = t + src[f];
  }
  return ~(uint32_t)c0;
}
#endif

static void fused_init(void) {
#ifdef CRC_HAVE_X86
  fused_hw = crc_hw && __builtin_cpu_supports("avx2");
#endif
}
static pthread_once_t fused_once = PTHREAD_ONCE_INIT;

uint32_t tr_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len) {
  pthread_once(&crc_once, crc_init);
  pthread_once(&fused_once, fused_init);
#ifdef CRC_HAVE_X86
  if (fused_hw) return crc_copy_hw(crc, dst, src, len);
#endif
  memcpy(dst, src, len);
  return tr_crc32c(crc, src, len);
}

uint32_t tr_crc32c_reduce(uint32_t crc, float *dst, float *save, const float *src, size_t n) {
  pthread_once(&crc_once, crc_init);
  pthread_once(&fused_once, fused_init);
#ifdef CRC_HAVE_X86
  if (fused_hw) return crc_reduce_hw(crc, dst, save, src, n);
#endif
  crc = tr_crc32c(crc, src, n * sizeof(float));
  for (size_t k = 0; k < n; k++) {
    float t = dst[k];
    save[k] = t;
    dst[k] = t + src[k];
  }
  return crc;
}
