/* adatopk.c — top-k encode/decode with error feedback, and the per-link
 * density controller (see adatopk.h). The selection is a quickselect on
 * the magnitudes: O(n) on average, no sort.
 */
#include "adatopk.h"

#include <math.h>
#include <string.h>

#include "util.h"

size_t adatopk_bytes(int64_t k) { return ADATOPK_HEADER + 6 * (size_t)k; }

static uint16_t to_bf16(float f) { /* round to nearest even; a finite value stays finite */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
  if ((u & 0x7fffffffu) == 0x7f800000u) return (uint16_t)(u >> 16);         /* and Inf Inf */
  u += 0x7fffu + ((u >> 16) & 1u);
  if ((u & 0x7f800000u) == 0x7f800000u) return (uint16_t)(((u >> 16) & 0x8000u) | 0x7f7fu); /* the largest bf16 */
  return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* The k-th largest of a[0..n) (k >= 1), reordering a. */
static float kth_largest(float *a, int64_t n, int64_t k) {
  int64_t lo = 0, hi = n - 1, want = k - 1;
  while (lo < hi) {
    float pivot = a[lo + (hi - lo) / 2];
    int64_t i = lo, j = hi;
    while (i <= j) {
      while (a[i] > pivot) i++;
      while (a[j] < pivot) j--;
      if (i <= j) {
        float t = a[i];
        a[i++] = a[j];
        a[j--] = t;
      }
    }
    if (want <= j) hi = j;
    else if (want >= i) lo = i;
    else return a[want];
  }
  return a[want];
}

/* What error feedback keeps for the next message: never a non-finite
 * value (a NaN or Inf held back would poison every later message). */
static float keep(float r) { return isfinite(r) ? r : 0.0f; }

size_t adatopk_encode(const float *x, float *residual, int64_t n, int64_t k, float *scratch, void *out) {
  int64_t nf = 0; /* the finite entries' magnitudes: the only candidates */
  for (int64_t i = 0; i < n; i++) {
    float v = x[i] + (residual ? residual[i] : 0.0f);
    if (isfinite(v)) scratch[nf++] = fabsf(v);
  }
  if (k > nf) k = nf;
  if (k < 1 && nf > 0) k = 1;
  float thr = k > 0 ? kth_largest(scratch, nf, k) : 0.0f;
  unsigned char *o = out;
  uint32_t *idx = (uint32_t *)(o + ADATOPK_HEADER);
  unsigned char *val = o + ADATOPK_HEADER + 4 * (size_t)k;
  int64_t m = 0;
  for (int pass = 0; pass < 2 && m < k; pass++) /* above the threshold, then ties at it */
    for (int64_t i = 0; i < n && m < k; i++) {
      float v = x[i] + (residual ? residual[i] : 0.0f), a = fabsf(v);
      if (!isfinite(v) || (pass == 0 ? !(a > thr) : !(a == thr))) continue;
      uint16_t h = to_bf16(v);
      idx[m] = (uint32_t)i;
      memcpy(val + 2 * m, &h, 2);
      m++;
    }
  if (m < k) { /* never with finite candidates; if it were, exactly the m written go out */
    memmove(o + ADATOPK_HEADER + 4 * (size_t)m, val, 2 * (size_t)m);
    val = o + ADATOPK_HEADER + 4 * (size_t)m;
  }
  uint32_t hdr[4] = {(uint32_t)n, (uint32_t)((uint64_t)n >> 32), (uint32_t)m, 0};
  memcpy(o, hdr, sizeof hdr);
  if (residual) { /* what the receiver will not see */
    for (int64_t i = 0; i < n; i++) residual[i] += x[i];
    for (int64_t j = 0; j < m; j++) {
      uint16_t h;
      memcpy(&h, val + 2 * j, 2);
      residual[idx[j]] -= from_bf16(h);
    }
    for (int64_t i = 0; i < n; i++) residual[i] = keep(residual[i]);
  }
  return adatopk_bytes(m);
}

size_t adatopk_encode_bf16(const float *x, float *residual, int64_t n, void *out) {
  uint32_t hdr[4] = {(uint32_t)n, (uint32_t)((uint64_t)n >> 32), 0, 0};
  unsigned char *o = out;
  memcpy(o, hdr, sizeof hdr);
  uint16_t *h = (uint16_t *)(o + ADATOPK_HEADER);
  for (int64_t i = 0; i < n; i++) {
    float v = x[i] + (residual ? residual[i] : 0.0f);
    h[i] = to_bf16(v);
    if (residual) residual[i] = keep(v - from_bf16(h[i]));
  }
  return ADATOPK_HEADER + 2 * (size_t)n;
}

void adatopk_choose(double d, double floor, int64_t n, int *codec, int64_t *k) {
  double per = 6.0 * (d > floor ? d : floor); /* bytes an entry, as top-k */
  *k = n;
  if (per >= 4.0) *codec = 0;
  else if (per >= 2.0) *codec = ADATOPK_BF16;
  else {
    *codec = ADATOPK_CODEC;
    *k = (int64_t)ceil((d > floor ? d : floor) * (double)n);
    if (*k < 1) *k = 1;
  }
}

static int decode_bf16(const unsigned char *p, size_t bytes, float *x, int64_t n) {
  if (bytes != ADATOPK_HEADER + 2 * (size_t)n) return tr_fail(TR_EIO, "adatopk: a bf16 message of %zu bytes", bytes);
  const uint16_t *h = (const uint16_t *)(p + ADATOPK_HEADER);
  for (int64_t i = 0; i < n; i++) x[i] = from_bf16(h[i]);
  return TR_OK;
}

int adatopk_decode_any(int codec, const void *in, size_t bytes, float *x, int64_t n) {
  if (codec == ADATOPK_BF16) return decode_bf16(in, bytes, x, n);
  if (codec == ADATOPK_CODEC) return adatopk_decode(in, bytes, x, n);
  return tr_fail(TR_EIO, "adatopk: a message in codec %d (this build knows %d and %d)", codec, ADATOPK_CODEC,
                 ADATOPK_BF16);
}

int adatopk_decode(const void *in, size_t bytes, float *x, int64_t n) {
  if (bytes < ADATOPK_HEADER) return tr_fail(TR_EIO, "adatopk: a message of %zu bytes", bytes);
  uint32_t hdr[4];
  memcpy(hdr, in, sizeof hdr);
  int64_t nn = (int64_t)hdr[0] | (int64_t)hdr[1] << 32, k = hdr[2];
  if (nn != n || k > n || bytes != adatopk_bytes(k))
    return tr_fail(TR_EIO, "adatopk: an encoding of %lld of %lld entries in %zu bytes, expected %lld entries",
                   (long long)k, (long long)nn, bytes, (long long)n);
  const unsigned char *p = in;
  const uint32_t *idx = (const uint32_t *)(p + ADATOPK_HEADER);
  const unsigned char *val = p + ADATOPK_HEADER + 4 * (size_t)k;
  memset(x, 0, sizeof(float) * (size_t)n);
  for (int64_t j = 0; j < k; j++) {
    if (idx[j] >= (uint64_t)n) return tr_fail(TR_EIO, "adatopk: index %u out of %lld", idx[j], (long long)n);
    uint16_t h;
    memcpy(&h, val + 2 * j, 2);
    x[idx[j]] = from_bf16(h);
  }
  return TR_OK;
}

double adatopk_density(double bandwidth, double compute_s, int64_t n, double floor) {
  if (!(bandwidth > 0) || !(compute_s > 0) || n <= 0) return 1.0;
  double d = (bandwidth * compute_s / 2.0 - ADATOPK_HEADER) / (6.0 * (double)n);
  if (d < floor) d = floor;
  return d > 1.0 ? 1.0 : d;
}
