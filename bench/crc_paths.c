/* crc_paths.c — CRC32C's paths against each other on this CPU: the plain
 * checksum and the fused copy and reduce (what FTAR runs on every frame),
 * GB/s per path and size, and each folding path's ratio to the three
 * crc32q streams (path 1) measured in the same run. Paths and sizes are
 * interleaved round by round, in turn forwards and backwards, and the best
 * round kept (a shared machine's load moves every number; on this
 * project's VMs whichever path ran first in a round ran faster). Where a
 * path runs the crc32q code itself (path 2's plain CRC from 512 KiB) its
 * ratio is the noise floor.
 *
 *   cmake --build build --target crc_paths && build/crc_paths [ROUNDS]
 *
 * Paths (tr_crc32c_level): 3 AVX-512 + VPCLMULQDQ, 2 AVX2 + VPCLMULQDQ,
 * 1 SSE4.2 (three crc32q streams; AVX2 for the fused moves), 0 the table.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"
#include "util.h"

enum { OP_CRC, OP_COPY, OP_REDUCE, NOPS };
static const char *op_name[NOPS] = {"crc", "copy+crc", "reduce+crc"};
static const size_t sizes[] = {64 << 10, 1 << 20, 16 << 20};
#define NSIZES (sizeof sizes / sizeof sizes[0])

static volatile uint32_t sink;

/* GB/s of one op at one size on the current path: repeats until ~20 ms. */
static double run(int op, size_t bytes, uint8_t *src, uint8_t *dst, float *save) {
  size_t reps = ((size_t)64 << 20) / bytes;
  if (reps < 4) reps = 4;
  double t0 = tr_now();
  uint32_t c = 0;
  for (size_t r = 0; r < reps; r++) {
    if (op == OP_CRC) c ^= tr_crc32c(c, src, bytes);
    else if (op == OP_COPY) c ^= tr_crc32c_copy(c, dst, src, bytes);
    else c ^= tr_crc32c_reduce(c, (float *)(void *)dst, save, (const float *)(const void *)src, bytes / 4);
  }
  double t = tr_now() - t0;
  sink = c;
  return (double)bytes * (double)reps / t / 1e9;
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 5;
  if (rounds < 1) rounds = 1;
  size_t big = sizes[NSIZES - 1];
  uint8_t *src = aligned_alloc(64, big), *dst = aligned_alloc(64, big);
  float *save = aligned_alloc(64, big);
  if (!src || !dst || !save) {
    fprintf(stderr, "crc_paths: out of memory\n");
    return 1;
  }
  /* finite, normal floats (the reduce adds them: no NaN or denormal
   * slow path), bytes that vary (the CRC reads them) */
  float *fs = (float *)(void *)src;
  for (size_t i = 0; i < big / 4; i++) fs[i] = 1.0f + (float)((uint32_t)(i * 2654435761u) >> 13) * 0x1p-20f;
  memset(dst, 0, big); /* adds of about 1 each over ~100 rounds stay finite */
  memset(save, 0, big);
  int top = tr_crc32c_level(3);
  double best[4][NOPS][NSIZES] = {{{0}}};
  for (int r = 0; r < rounds; r++)
    for (int k = 0; k < top; k++) { /* paths top..1, then 1..top: neither always runs first */
      int lv = r % 2 ? 1 + k : top - k;
      tr_crc32c_level(lv);
      for (int op = 0; op < NOPS; op++)
        for (size_t s = 0; s < NSIZES; s++) {
          double g = run(op, sizes[s], src, dst, save);
          if (g > best[lv][op][s]) best[lv][op][s] = g;
        }
    }
  tr_crc32c_level(3);
  printf("crc32c paths on this CPU (best of %d rounds, GB/s; ratio to path 1, the three crc32q streams)\n", rounds);
  printf("top path: %d (3 AVX-512 + VPCLMULQDQ, 2 AVX2 + VPCLMULQDQ, 1 SSE4.2)\n", top);
  for (int op = 0; op < NOPS; op++)
    for (size_t s = 0; s < NSIZES; s++) {
      printf("%-11s %6zu KiB", op_name[op], sizes[s] >> 10);
      for (int lv = top; lv >= 1; lv--) {
        printf("  path %d %6.1f", lv, best[lv][op][s]);
        if (lv > 1) printf(" (%.2fx)", best[lv][op][s] / best[1][op][s]);
      }
      printf("\n");
    }
  free(src);
  free(dst);
  free(save);
  return 0;
}
