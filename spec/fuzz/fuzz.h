/* fuzz.h — what the libFuzzer targets in spec/fuzz/ share: FUZZ_CHECK, an
 * assertion that reports and aborts (so that libFuzzer records the input as
 * a crash: a harness may abort, library code never does), and a scratch
 * file for readers that take a path (job files, safetensors).
 *
 * Not product code: only the fuzz_*.c targets include it.
 */
#ifndef TRANSOM_FUZZ_H
#define TRANSOM_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FUZZ_CHECK(cond, ...)                                              \
  do {                                                                     \
    if (!(cond)) {                                                         \
      fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                        \
      fputc('\n', stderr);                                                 \
      abort();                                                             \
    }                                                                      \
  } while (0)

/* A per-process scratch file (suffix: ".lua", ".safetensors", ...), created
 * on first use in $TMPDIR (run.sh points it at a folder of its own), else in
 * /dev/shm when it exists (no disk I/O per input), else in /tmp; removed at
 * a normal exit. Returns its path. */
static char fuzz_scratch_paths[4][256];
static int fuzz_scratch_n;

static void fuzz_scratch_cleanup(void) {
  for (int i = 0; i < fuzz_scratch_n; i++) unlink(fuzz_scratch_paths[i]);
}

static inline const char *fuzz_scratch(int which, const char *suffix) {
  if (which >= fuzz_scratch_n) {
    const char *dir = getenv("TMPDIR");
    if (!dir || !*dir) dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    FUZZ_CHECK(which < 4 && which == fuzz_scratch_n, "scratch files are numbered 0..3 in order");
    snprintf(fuzz_scratch_paths[which], sizeof fuzz_scratch_paths[which], "%s/transom-fuzz-%d-%d%s", dir,
             (int)getpid(), which, suffix);
    if (fuzz_scratch_n++ == 0) atexit(fuzz_scratch_cleanup);
  }
  return fuzz_scratch_paths[which];
}

/* Replaces the scratch file's contents with data. */
static inline const char *fuzz_write_scratch(int which, const char *suffix, const uint8_t *data, size_t size) {
  const char *path = fuzz_scratch(which, suffix);
  FILE *f = fopen(path, "wb");
  FUZZ_CHECK(f != NULL, "cannot create the scratch file %s", path);
  FUZZ_CHECK(size == 0 || fwrite(data, 1, size, f) == size, "cannot write the scratch file %s", path);
  FUZZ_CHECK(fclose(f) == 0, "cannot write the scratch file %s", path);
  return path;
}

#endif
