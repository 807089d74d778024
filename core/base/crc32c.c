/* crc32c.c — CRC32C (Castagnoli): plain, and fused with a copy or a float
 * reduction so a buffer is read once. See crc32c.h.
 *
 * The hardware path runs three independent crc32q streams over adjacent
 * blocks and merges them with precomputed "append N zero bytes" operators
 * (Mark Adler's crc32c.c method), about 3x the single-stream speed; from
 * 1 KiB on CPUs with VPCLMULQDQ, folding by carry-less multiplication runs
 * ahead of it: on 512-bit vectors with AVX-512 (about 3x again, see
 * "AVX-512" below), else on 256-bit ones with AVX2 (the fused reduce 1.6x,
 * the plain CRC about even, see "AVX2" below); the portable path is
 * slicing-by-8. All give identical results
 * (spec/c/test_ftar.c compares them, tr_crc32c_level picks the path). Tables are built once, thread-safely.
 * Used by FTAR's frames and the checkpoint engine's manifests and data.
 */
#include "crc32c.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
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
static int crc_max = 3; /* tr_crc32c_level */
#ifdef CRC_HAVE_X86
static void wide_init(void);
#endif
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
  wide_init();
#endif
  /* TRANSOM_CRC32C_LEVEL=N: at most path N (tr_crc32c_level), for A/B
   * benches of whole programs (bench/ftar_frames.sh KNOB=crc-path) */
  const char *v = getenv("TRANSOM_CRC32C_LEVEL");
  if (v && *v >= '0' && *v <= '3' && v[1] == 0) crc_max = *v - '0';
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

#ifdef CRC_HAVE_X86
/* --- AVX-512 + VPCLMULQDQ: folding by carry-less multiplication ---
 * The data is one polynomial over GF(2); each of four 64-byte accumulators
 * (four 128-bit lanes each) holds a stretch of it, and moving 256 bytes on
 * multiplies a lane by x^2048 mod P, which two carry-less multiplies by
 * constants give (a lane is H*x^64 + L: H*x^(64+D) + L*x^D, each half times
 * x^k mod P, a 32-bit constant). At the end the lanes are folded into one
 * 128-bit value congruent to the data (mod P), whose CRC (initial value 0)
 * is the running value; the tail goes through crc32q. In the reflected bit
 * order of CRC32C, a 64-bit qword's bit i is the coefficient of x^(63-i),
 * and a carry-less product carries one extra factor x, which the constants
 * absorb (x^(D+63) and x^(D-1) instead of x^(D+64) and x^D). The running
 * value enters by XOR into the first four bytes. Constants are computed at
 * init (crc_init), not tabulated; tests compare every path with the table
 * version. 64 bytes per two multiplies: several times crc32q's 8 bytes a
 * cycle, so the fused copy and add run at memory speed. */

#define WIDE_MIN 1024 /* below this the crc32q path is as fast */

typedef struct {
  uint64_t k[2];
} fold_k;
static fold_k k2048, k1536, k1024, k512, k384, k256, k128;
static int wide_hw, ymm_hw; /* AVX-512, AVX2 (with VPCLMULQDQ) */

/* x^n mod P as 32 coefficients, reflected into the top half of a qword */
static uint64_t xpow_reflected(unsigned n) {
  uint64_t v = 1; /* x^0, normal order, degree < 32 */
  for (unsigned i = 0; i < n; i++) {
    v <<= 1;
    if (v >> 32) v ^= 0x11EDC6F41ull;
  }
  uint64_t r = 0;
  for (int d = 0; d < 32; d++)
    if (v >> d & 1) r |= 1ull << (63 - d);
  return r;
}

static fold_k fold_by(unsigned bits) { return (fold_k){{xpow_reflected(bits + 63), xpow_reflected(bits - 1)}}; }

static void wide_init(void) {
  k2048 = fold_by(2048);
  k1536 = fold_by(1536);
  k1024 = fold_by(1024);
  k512 = fold_by(512);
  k384 = fold_by(384);
  k256 = fold_by(256);
  k128 = fold_by(128);
  wide_hw = crc_hw && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
            __builtin_cpu_supports("pclmul");
  ymm_hw = crc_hw && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq") &&
           __builtin_cpu_supports("pclmul");
}

#define WIDE_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))

WIDE_TARGET static inline __m512i wide_k(const fold_k *k) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)k->k)); }

/* acc * x^D mod P (a congruent value) XOR data, per 128-bit lane */
WIDE_TARGET static inline __m512i wide_fold(__m512i acc, __m512i k, __m512i data) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k, 0x00), _mm512_clmulepi64_epi128(acc, k, 0x11), data,
                                   0x96);
}
/* one 128-bit lane: both folding paths call it, so it takes only what both
 * have (compiled for AVX-512 it could hold EVEX code the AVX2 path's CPUs
 * lack) */
__attribute__((target("pclmul,sse4.2"))) static inline __m128i lane_fold(__m128i acc, const fold_k *k, __m128i data) {
  __m128i kk = _mm_loadu_si128((const __m128i *)k->k);
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(acc, kk, 0x00), _mm_clmulepi64_si128(acc, kk, 0x11)), data);
}

/* The four accumulators (a stretch of 256 bytes) into the CRC register. */
WIDE_TARGET static uint32_t wide_finish(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  __m512i z = _mm512_setzero_si512();
  __m512i a = wide_fold(a0, wide_k(&k1536), z);
  a = _mm512_xor_si512(a, wide_fold(a1, wide_k(&k1024), z));
  a = _mm512_xor_si512(a, wide_fold(a2, wide_k(&k512), a3));
  __m128i r = lane_fold(_mm512_extracti32x4_epi32(a, 0), &k384, _mm_setzero_si128());
  r = _mm_xor_si128(r, lane_fold(_mm512_extracti32x4_epi32(a, 1), &k256, _mm_setzero_si128()));
  r = lane_fold(_mm512_extracti32x4_epi32(a, 2), &k128, _mm_xor_si128(r, _mm512_extracti32x4_epi32(a, 3)));
  uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(r));
  return (uint32_t)_mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(r, 1));
}

/* Folds len - len % 256 bytes of s (len >= 256) from CRC register c,
 * STEP(o, v0, v1, v2, v3) seeing each 256-byte block's four vectors at
 * offset o; the caller goes on from *done with crc32q. */
#define WIDE_BODY(STEP)                                                                  \
  __m512i v0 = _mm512_loadu_si512(s), v1 = _mm512_loadu_si512(s + 64);                   \
  __m512i v2 = _mm512_loadu_si512(s + 128), v3 = _mm512_loadu_si512(s + 192);            \
  STEP(0, v0, v1, v2, v3);                                                               \
  __m512i a0 = _mm512_xor_si512(v0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));  \
  __m512i a1 = v1, a2 = v2, a3 = v3, kb = wide_k(&k2048);                                \
  size_t i = 256;                                                                        \
  for (; len - i >= 256; i += 256) {                                                     \
    v0 = _mm512_loadu_si512(s + i);                                                      \
    v1 = _mm512_loadu_si512(s + i + 64);                                                 \
    v2 = _mm512_loadu_si512(s + i + 128);                                                \
    v3 = _mm512_loadu_si512(s + i + 192);                                                \
    STEP(i, v0, v1, v2, v3);                                                             \
    a0 = wide_fold(a0, kb, v0);                                                          \
    a1 = wide_fold(a1, kb, v1);                                                          \
    a2 = wide_fold(a2, kb, v2);                                                          \
    a3 = wide_fold(a3, kb, v3);                                                          \
  }                                                                                      \
  *done = i;                                                                             \
  return wide_finish(a0, a1, a2, a3)

#define NO_STEP(o, v0, v1, v2, v3) (void)0
WIDE_TARGET static uint32_t wide_crc(uint32_t c, const uint8_t *s, size_t len, size_t *done) { WIDE_BODY(NO_STEP); }

#define COPY_STEP(o, v0, v1, v2, v3)          \
  do {                                       \
    _mm512_storeu_si512(d + (o), v0);        \
    _mm512_storeu_si512(d + (o) + 64, v1);   \
    _mm512_storeu_si512(d + (o) + 128, v2);  \
    _mm512_storeu_si512(d + (o) + 192, v3);  \
  } while (0)
WIDE_TARGET static uint32_t wide_copy(uint32_t c, uint8_t *d, const uint8_t *s, size_t len, size_t *done) {
  WIDE_BODY(COPY_STEP);
}
#undef COPY_STEP
/* d 64-byte aligned: the copy by non-temporal stores (the caller fences) */
#define COPY_STEP(o, v0, v1, v2, v3)                 \
  do {                                              \
    _mm512_stream_si512((void *)(d + (o)), v0);       \
    _mm512_stream_si512((void *)(d + (o) + 64), v1);  \
    _mm512_stream_si512((void *)(d + (o) + 128), v2); \
    _mm512_stream_si512((void *)(d + (o) + 192), v3); \
  } while (0)
WIDE_TARGET static uint32_t wide_copy_nt(uint32_t c, uint8_t *d, const uint8_t *s, size_t len, size_t *done) {
  WIDE_BODY(COPY_STEP);
}
#undef COPY_STEP

#define RED_ONE(f, v)                                                                \
  do {                                                                              \
    __m512 t_ = _mm512_loadu_ps(dst + (f));                                         \
    _mm512_storeu_ps(save + (f), t_);                                               \
    _mm512_storeu_ps(dst + (f), _mm512_add_ps(t_, _mm512_castsi512_ps(v)));         \
  } while (0)
#define RED_STEP(o, v0, v1, v2, v3) \
  do {                              \
    size_t f_ = (o) / 4;            \
    RED_ONE(f_, v0);                \
    RED_ONE(f_ + 16, v1);           \
    RED_ONE(f_ + 32, v2);           \
    RED_ONE(f_ + 48, v3);           \
  } while (0)
WIDE_TARGET static uint32_t wide_reduce(uint32_t c, float *dst, float *save, const uint8_t *s, size_t len,
                                        size_t *done) {
  WIDE_BODY(RED_STEP);
}
#undef RED_ONE
/* save 64-byte aligned: saved by non-temporal stores (the caller fences) */
#define RED_ONE(f, v)                                                                \
  do {                                                                              \
    __m512 t_ = _mm512_loadu_ps(dst + (f));                                         \
    _mm512_stream_ps(save + (f), t_);                                               \
    _mm512_storeu_ps(dst + (f), _mm512_add_ps(t_, _mm512_castsi512_ps(v)));         \
  } while (0)
WIDE_TARGET static uint32_t wide_reduce_nt(uint32_t c, float *dst, float *save, const uint8_t *s, size_t len,
                                           size_t *done) {
  WIDE_BODY(RED_STEP);
}
#undef RED_STEP
#undef RED_ONE

/* --- AVX2 + VPCLMULQDQ: the same folding, 256-bit ---
 * For CPUs with VPCLMULQDQ but not AVX-512 (AMD Zen 3, say): eight 32-byte
 * accumulators (two 128-bit lanes each) cover the same 256-byte stretch as
 * the AVX-512 path's four, so the loop folds by the same x^2048; at the end
 * they fold in a tree (x^1024, x^512, x^256, then lane into lane by x^128)
 * and the 128-bit value goes through crc32q as above. On a Zen 3 EPYC
 * (bench/crc_paths.c, 64 KiB-1 MiB in cache) against the three crc32q
 * streams: the plain CRC 1.0x-1.2x (VPCLMULQDQ on 256 bits is hardly
 * faster there than crc32q), copy + CRC 1.1x-1.4x, reduce + CRC 1.6x-2.2x
 * (the crc32q version interleaves its scalar streams with the vector adds
 * badly); out of cache see YMM_MAX. */

#define YMM_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))

/* The plain CRC and the copy + CRC of a buffer this long or longer (out
 * of cache, as a checkpoint's tensors are when they are staged or a load
 * verifies them) run the crc32q streams instead: their three streams read
 * memory faster there (Zen 3, 16 MiB, folding against them: plain
 * 0.91x-0.94x, copy 0.90x-0.94x; 64 KiB: 1.1x, 1.2x). The reduce folds at
 * every length (16 MiB: 1.06x-1.18x). */
#define YMM_MAX ((size_t)512 * 1024)

YMM_TARGET static inline __m256i ymm_k(const fold_k *k) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)k->k));
}

/* acc * x^D mod P (a congruent value) XOR data, per 128-bit lane */
YMM_TARGET static inline __m256i ymm_fold(__m256i acc, __m256i k, __m256i data) {
  return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(acc, k, 0x00), _mm256_clmulepi64_epi128(acc, k, 0x11)),
                          data);
}

/* The eight accumulators (a stretch of 256 bytes) into the CRC register. */
YMM_TARGET static uint32_t ymm_finish(const __m256i a[8]) {
  __m256i k = ymm_k(&k1024), b[4], c[2];
  for (int j = 0; j < 4; j++) b[j] = ymm_fold(a[j], k, a[j + 4]);
  k = ymm_k(&k512);
  for (int j = 0; j < 2; j++) c[j] = ymm_fold(b[j], k, b[j + 2]);
  __m256i d = ymm_fold(c[0], ymm_k(&k256), c[1]);
  __m128i r = lane_fold(_mm256_castsi256_si128(d), &k128, _mm256_extracti128_si256(d, 1));
  uint64_t crc = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(r));
  return (uint32_t)_mm_crc32_u64(crc, (uint64_t)_mm_extract_epi64(r, 1));
}

/* Folds len - len % 256 bytes of s (len >= 256) from CRC register c,
 * STEP(o, v) seeing each 32-byte vector v at offset o; the caller goes on
 * from *done with crc32q. */
#define YMM_BODY(STEP)                                                               \
  __m256i a[8], kb = ymm_k(&k2048);                                                  \
  for (int j = 0; j < 8; j++) {                                                      \
    a[j] = _mm256_loadu_si256((const __m256i *)(s + 32 * j));                         \
    STEP(32 * (size_t)j, a[j]);                                                      \
  }                                                                                  \
  a[0] = _mm256_xor_si256(a[0], _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)c)));  \
  size_t i = 256;                                                                    \
  for (; len - i >= 256; i += 256) {                                                 \
    for (int j = 0; j < 8; j++) {                                                    \
      __m256i v = _mm256_loadu_si256((const __m256i *)(s + i + 32 * j));              \
      STEP(i + 32 * (size_t)j, v);                                                   \
      a[j] = ymm_fold(a[j], kb, v);                                                  \
    }                                                                                \
  }                                                                                  \
  *done = i;                                                                         \
  return ymm_finish(a)

#define NO_STEP1(o, v) (void)0
YMM_TARGET static uint32_t ymm_crc(uint32_t c, const uint8_t *s, size_t len, size_t *done) { YMM_BODY(NO_STEP1); }

/* the copy's and the reduce's steps, their stores to d / save by STORE:
 * plain, or non-temporal where d / save is 32-byte aligned (the caller
 * fences) */
#define COPY_WITH(STORE, o, v) STORE((__m256i *)(void *)(d + (o)), v)
#define RED_WITH(STORE, o, v)                                                   \
  do {                                                                          \
    __m256 t_ = _mm256_loadu_ps(dst + (o) / 4);                                 \
    STORE(save + (o) / 4, t_);                                                  \
    _mm256_storeu_ps(dst + (o) / 4, _mm256_add_ps(t_, _mm256_castsi256_ps(v))); \
  } while (0)
#define COPY_STEP1(o, v) COPY_WITH(_mm256_storeu_si256, o, v)
#define COPY_NT_STEP1(o, v) COPY_WITH(_mm256_stream_si256, o, v)
#define RED_STEP1(o, v) RED_WITH(_mm256_storeu_ps, o, v)
#define RED_NT_STEP1(o, v) RED_WITH(_mm256_stream_ps, o, v)
YMM_TARGET static uint32_t ymm_copy(uint32_t c, uint8_t *d, const uint8_t *s, size_t len, size_t *done) {
  YMM_BODY(COPY_STEP1);
}
YMM_TARGET static uint32_t ymm_copy_nt(uint32_t c, uint8_t *d, const uint8_t *s, size_t len, size_t *done) {
  YMM_BODY(COPY_NT_STEP1);
}
YMM_TARGET static uint32_t ymm_reduce(uint32_t c, float *dst, float *save, const uint8_t *s, size_t len, size_t *done) {
  YMM_BODY(RED_STEP1);
}
YMM_TARGET static uint32_t ymm_reduce_nt(uint32_t c, float *dst, float *save, const uint8_t *s, size_t len,
                                         size_t *done) {
  YMM_BODY(RED_NT_STEP1);
}
#undef COPY_WITH
#undef RED_WITH
#undef COPY_STEP1
#undef COPY_NT_STEP1
#undef RED_STEP1
#undef RED_NT_STEP1
#undef NO_STEP1
#endif

/* the widest path allowed and available: 3 AVX-512, 2 AVX2 + VPCLMULQDQ, 1 SSE4.2 (+AVX2), 0 table */
static int crc_path(void);

uint32_t tr_crc32c(uint32_t crc, const void *buf, size_t len) {
  pthread_once(&crc_once, crc_init);
#ifdef CRC_HAVE_X86
  int path = crc_path();
  if (len >= WIDE_MIN && (path == 3 || (path == 2 && len < YMM_MAX))) {
    size_t done;
    uint32_t c = path == 3 ? wide_crc(~crc, buf, len, &done) : ymm_crc(~crc, buf, len, &done);
    return crc32c_hw(~c, (const uint8_t *)buf + done, len - done);
  }
  if (path >= 1) return crc32c_hw(crc, buf, len);
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

/* Bytes up to the next 64-byte boundary of p (at most len). */
static size_t to_line(const void *p, size_t len) {
  size_t k = (64 - ((uintptr_t)p & 63)) & 63;
  return k < len ? k : len;
}

/* nt: dst by non-temporal stores on the folding paths, from its first
 * 64-byte boundary (the bytes before it through crc32q). */
static uint32_t crc_copy(uint32_t crc, void *dst, const void *src, size_t len, int nt) {
  pthread_once(&crc_once, crc_init);
  pthread_once(&fused_once, fused_init);
#ifdef CRC_HAVE_X86
  int path = crc_path();
  if (len >= WIDE_MIN && (path == 3 || (path == 2 && len < YMM_MAX))) {
    uint8_t *d = dst;
    const uint8_t *s = src;
    size_t head = nt ? to_line(d, len) : 0, done;
    if (head) crc = crc_copy_hw(crc, d, s, head);
    uint32_t c;
    if (path == 3)
      c = nt ? wide_copy_nt(~crc, d + head, s + head, len - head, &done)
             : wide_copy(~crc, d + head, s + head, len - head, &done);
    else
      c = nt ? ymm_copy_nt(~crc, d + head, s + head, len - head, &done)
             : ymm_copy(~crc, d + head, s + head, len - head, &done);
    if (nt) _mm_sfence();
    done += head;
    return crc_copy_hw(~c, d + done, s + done, len - done);
  }
  if (path >= 1 && fused_hw) return crc_copy_hw(crc, dst, src, len);
#endif
  (void)nt;
  memcpy(dst, src, len);
  return tr_crc32c(crc, src, len);
}

static uint32_t crc_reduce(uint32_t crc, float *dst, float *save, const float *src, size_t n, int nt) {
  pthread_once(&crc_once, crc_init);
  pthread_once(&fused_once, fused_init);
#ifdef CRC_HAVE_X86
  int path = crc_path();
  if (path >= 2 && n * sizeof(float) >= WIDE_MIN) {
    size_t head = nt ? to_line(save, n * sizeof(float)) / sizeof(float) : 0, done;
    if (head) crc = crc_reduce_hw(crc, dst, save, src, head);
    const uint8_t *s = (const uint8_t *)(src + head);
    size_t len = (n - head) * sizeof(float);
    uint32_t c;
    if (path == 3)
      c = nt ? wide_reduce_nt(~crc, dst + head, save + head, s, len, &done)
             : wide_reduce(~crc, dst + head, save + head, s, len, &done);
    else
      c = nt ? ymm_reduce_nt(~crc, dst + head, save + head, s, len, &done)
             : ymm_reduce(~crc, dst + head, save + head, s, len, &done);
    if (nt) _mm_sfence();
    size_t f = head + done / sizeof(float);
    return crc_reduce_hw(~c, dst + f, save + f, src + f, n - f);
  }
  if (path >= 1 && fused_hw) return crc_reduce_hw(crc, dst, save, src, n);
#endif
  (void)nt;
  crc = tr_crc32c(crc, src, n * sizeof(float));
  for (size_t k = 0; k < n; k++) {
    float t = dst[k];
    save[k] = t;
    dst[k] = t + src[k];
  }
  return crc;
}

uint32_t tr_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len) { return crc_copy(crc, dst, src, len, 0); }
uint32_t tr_crc32c_copy_nt(uint32_t crc, void *dst, const void *src, size_t len) {
  return crc_copy(crc, dst, src, len, 1);
}
uint32_t tr_crc32c_reduce(uint32_t crc, float *dst, float *save, const float *src, size_t n) {
  return crc_reduce(crc, dst, save, src, n, 0);
}
uint32_t tr_crc32c_reduce_nt(uint32_t crc, float *dst, float *save, const float *src, size_t n) {
  return crc_reduce(crc, dst, save, src, n, 1);
}

static int crc_path(void) {
#ifdef CRC_HAVE_X86
  if (wide_hw && crc_max >= 3) return 3;
  if (ymm_hw && crc_max >= 2) return 2;
  if (crc_hw && crc_max >= 1) return 1;
#endif
  return 0;
}

int tr_crc32c_level(int level) {
  pthread_once(&crc_once, crc_init);
  pthread_once(&fused_once, fused_init);
  crc_max = level;
  return crc_path();
}
