/* fuzz_safetensors.c — fuzzes the safetensors reader (safetensors_open,
 * core/tensor/safetensors.c) on arbitrary file bytes. Does not load a
 * model. Built by CMake with -DTRANSOM_FUZZ=ON; run by run.sh.
 *
 * Input: the whole file, written to a scratch file (the reader takes a path).
 *
 * Checked, when the reader accepts the file (what safetensors.h promises
 * and model_load_params relies on):
 *   - every entry is F32, has at most ST_MAX_DIMS dimensions, none negative,
 *     a NUL-terminated name, and begin <= end <= data_len;
 *   - the product of its dimensions, times 4, is end - begin, computed
 *     without overflow (a product that wraps around is not a shape);
 *   - every tensor's bytes are read (AddressSanitizer sees any byte outside
 *     the file buffer), and safetensors_find finds each name;
 *   - writing the entries back (safetensors_write) and reading that file
 *     gives the same names, shapes and bytes, when the names survive the
 *     writer's JSON escapes (no control characters, which it writes as
 *     \\u00XX and the reader reads back as '?').
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "safetensors.h"
#include "util.h"

static int name_round_trips(const char *name) {
  for (const unsigned char *c = (const unsigned char *)name; *c; c++)
    if (*c < 0x20) return 0;
  return 1;
}

static void check_entries(const st_file *f) {
  for (int i = 0; i < f->n; i++) {
    const st_entry *e = &f->entries[i];
    FUZZ_CHECK(memchr(e->name, 0, sizeof e->name) != NULL, "entry %d: name not NUL-terminated", i);
    FUZZ_CHECK(strcmp(e->dtype, "F32") == 0, "entry %d: dtype '%s'", i, e->dtype);
    FUZZ_CHECK(e->ndim >= 0 && e->ndim <= ST_MAX_DIMS, "entry %d: %d dimensions", i, e->ndim);
    FUZZ_CHECK(e->begin <= e->end && e->end <= f->data_len, "entry %d: bytes %llu..%llu of %zu", i,
               (unsigned long long)e->begin, (unsigned long long)e->end, f->data_len);
    uint64_t elems = 1;
    for (int d = 0; d < e->ndim; d++) {
      FUZZ_CHECK(e->dim[d] >= 0, "entry %d '%s': dimension %d is %lld", i, e->name, d, (long long)e->dim[d]);
      FUZZ_CHECK(!__builtin_mul_overflow(elems, (uint64_t)e->dim[d], &elems),
                 "entry %d '%s': the shape's element count overflows 64 bits (accepted for %llu bytes)", i, e->name,
                 (unsigned long long)(e->end - e->begin));
    }
    uint64_t bytes;
    FUZZ_CHECK(!__builtin_mul_overflow(elems, (uint64_t)4, &bytes) && bytes == e->end - e->begin,
               "entry %d '%s': %llu elements in %llu bytes", i, e->name, (unsigned long long)elems,
               (unsigned long long)(e->end - e->begin));
    volatile uint8_t sum = 0;
    for (uint64_t k = e->begin; k < e->end; k++) sum += f->data[k];
    (void)sum;
    const st_entry *found = safetensors_find(f, e->name);
    FUZZ_CHECK(found != NULL && strcmp(found->name, e->name) == 0, "entry %d '%s' not found by name", i, e->name);
  }
}

/* Writes f's entries to a second file and reads them back. */
static void check_round_trip(const st_file *f) {
  for (int i = 0; i < f->n; i++)
    if (!name_round_trips(f->entries[i].name)) return;
  st_tensor *t = calloc((size_t)f->n + 1, sizeof *t);
  float **copies = calloc((size_t)f->n + 1, sizeof *copies);
  FUZZ_CHECK(t && copies, "out of memory");
  for (int i = 0; i < f->n; i++) { /* aligned copies of the (possibly unaligned) data */
    const st_entry *e = &f->entries[i];
    copies[i] = malloc(e->end - e->begin + 4);
    FUZZ_CHECK(copies[i] != NULL, "out of memory");
    memcpy(copies[i], f->data + e->begin, e->end - e->begin);
    t[i] = (st_tensor){e->name, copies[i], e->ndim, e->dim};
  }
  const char *path = fuzz_scratch(1, ".safetensors");
  FUZZ_CHECK(safetensors_write(path, t, f->n, NULL) == 0, "safetensors_write: %s", tr_error());
  st_file g;
  FUZZ_CHECK(safetensors_open(&g, path) == 0, "the reader refuses what the writer wrote: %s", tr_error());
  FUZZ_CHECK(g.n == f->n, "%d entries written, %d read", f->n, g.n);
  for (int i = 0; i < f->n; i++) {
    const st_entry *a = &f->entries[i], *b = &g.entries[i];
    FUZZ_CHECK(strcmp(a->name, b->name) == 0 && a->ndim == b->ndim &&
                   memcmp(a->dim, b->dim, sizeof a->dim[0] * (size_t)a->ndim) == 0 &&
                   b->end - b->begin == a->end - a->begin &&
                   memcmp(g.data + b->begin, f->data + a->begin, a->end - a->begin) == 0,
               "entry %d '%s' does not round-trip", i, a->name);
  }
  safetensors_close(&g);
  for (int i = 0; i < f->n; i++) free(copies[i]);
  free(copies);
  free(t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const char *path = fuzz_write_scratch(0, ".safetensors", data, size);
  st_file f;
  if (safetensors_open(&f, path) != 0) {
    FUZZ_CHECK(tr_error()[0] != 0, "refused without a message");
    FUZZ_CHECK(f.buf == NULL && f.entries == NULL && f.n == 0, "a refused file left state behind");
    return 0;
  }
  FUZZ_CHECK(f.len == size && memcmp(f.buf, data, size) == 0, "the reader's buffer is not the file");
  FUZZ_CHECK(f.data >= (const uint8_t *)f.buf + 8 && f.data + f.data_len == (const uint8_t *)f.buf + f.len,
             "the data section is not the file's tail");
  check_entries(&f);
  check_round_trip(&f);
  safetensors_close(&f);
  return 0;
}
