/* data.c — corpus loading, byte tokenizer, batches (see data.h). */
#include "data.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

static void vocab_index(vocab *v) {
  for (int b = 0; b < 256; b++) v->id_of[b] = -1;
  for (int i = 0; i < v->size; i++) v->id_of[v->byte_of[i]] = (int16_t)i;
}

int dataset_load(dataset *d, const char *path, int block) {
  memset(d, 0, sizeof *d);
  size_t len;
  char *text = tr_read_file(path, &len);
  if (!text) return TR_EIO;
  int seen[256] = {0};
  for (size_t i = 0; i < len; i++) seen[(uint8_t)text[i]] = 1;
  for (int b = 0; b < 256; b++)
    if (seen[b]) d->voc.byte_of[d->voc.size++] = (uint8_t)b;
  vocab_index(&d->voc);
  d->n = (int64_t)len;
  d->n_train = d->n * 9 / 10;
  int64_t need = (int64_t)block + 2;
  if (d->n_train < need || d->n - d->n_train < need) {
    free(text);
    return tr_fail(TR_EINVAL, "data '%s': %lld bytes is too small: each of the 90/10 train/val splits needs more than "
                   "block_size+1 = %d tokens (at least %lld bytes in all)", path, (long long)len, block + 1,
                   (long long)(need * 10 + 10));
  }
  d->ids = malloc(sizeof(int32_t) * (size_t)d->n);
  if (!d->ids) {
    free(text);
    return tr_fail(TR_ENOMEM, "out of memory tokenizing '%s'", path);
  }
  for (int64_t i = 0; i < d->n; i++) d->ids[i] = d->voc.id_of[(uint8_t)text[i]];
  free(text);
  return TR_OK;
}

void dataset_free(dataset *d) {
  free(d->ids);
  d->ids = NULL;
}

void dataset_batch(const dataset *d, int split, rng_t *r, int B, int T, int32_t *x, int32_t *y) {
  int64_t lo = split == SPLIT_TRAIN ? 0 : d->n_train;
  int64_t n = split == SPLIT_TRAIN ? d->n_train : d->n - d->n_train;
  for (int b = 0; b < B; b++) {
    int64_t off = lo + (int64_t)rng_below(r, (uint64_t)(n - T - 1));
    memcpy(x + (int64_t)b * T, d->ids + off, sizeof(int32_t) * (size_t)T);
    memcpy(y + (int64_t)b * T, d->ids + off + 1, sizeof(int32_t) * (size_t)T);
  }
}

int vocab_save(const vocab *v, const char *path) {
  char buf[4096];
  size_t k = (size_t)snprintf(buf, sizeof buf, "{\"type\":\"bytes\",\"tokens\":[");
  for (int i = 0; i < v->size; i++) k += (size_t)snprintf(buf + k, sizeof buf - k, i ? ",%d" : "%d", v->byte_of[i]);
  k += (size_t)snprintf(buf + k, sizeof buf - k, "]}\n");
  return tr_write_file_atomic(path, buf, k);
}

int vocab_load(vocab *v, const char *path) {
  size_t len;
  char *s = tr_read_file(path, &len);
  if (!s) return TR_EIO;
  memset(v, 0, sizeof *v);
  char *p = strstr(s, "\"tokens\"");
  p = p ? strchr(p, '[') : NULL;
  if (!p) goto bad;
  p++;
  while (*p && *p != ']') {
    char *end;
    long b = strtol(p, &end, 10);
    if (end == p || b < 0 || b > 255 || v->size >= 256) goto bad;
    v->byte_of[v->size++] = (uint8_t)b;
    p = end;
    while (*p == ',' || *p == ' ' || *p == '\n') p++;
  }
  if (*p != ']' || v->size == 0) goto bad;
  free(s);
  vocab_index(v);
  return TR_OK;
bad:
  free(s);
  return tr_fail(TR_EFORMAT, "'%s': not a transom vocabulary file", path);
}

int vocab_encode(const vocab *v, const char *text, size_t len, int32_t *out) {
  for (size_t i = 0; i < len; i++) {
    int id = v->id_of[(uint8_t)text[i]];
    if (id < 0) {
      uint8_t c = (uint8_t)text[i];
      if (c >= 32 && c < 127)
        return tr_fail(TR_EINVAL, "character '%c' (byte %zu of the prompt) is not in the model's vocabulary", c, i + 1);
      return tr_fail(TR_EINVAL, "byte 0x%02x (byte %zu of the prompt) is not in the model's vocabulary", c, i + 1);
    }
    out[i] = id;
  }
  return TR_OK;
}
