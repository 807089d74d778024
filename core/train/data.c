/* data.c — the corpus: byte-level text and token shards, the train/val
 * split, batches (see data.h). Called by the trainer (trainer.c). */
#define _GNU_SOURCE
#include "data.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json_top.h"
#include "util.h"

#define LLMC_MAGIC 20240520
#define LLMC_HEADER 256 /* int32s */

static void vocab_index(vocab *v) {
  for (int b = 0; b < 256; b++) v->id_of[b] = -1;
  for (int i = 0; i < v->size; i++) v->id_of[v->byte_of[i]] = (int16_t)i;
}

/* --- splits --- */

static int add_seg(dataset *d, int split, const void *base, int width, int64_t n) {
  data_seg *s = realloc(d->seg[split], sizeof *s * (size_t)(d->nseg[split] + 1));
  if (!s) return tr_fail(TR_ENOMEM, "out of memory");
  d->seg[split] = s;
  s[d->nseg[split]++] = (data_seg){base, width, n};
  int64_t rows = n - d->block - 1; /* starts whose x and y fit: off + T + 1 <= n */
  if (rows > 0) d->starts[split] += rows;
  return TR_OK;
}

/* Splits runs [0..count) (already in split 0) at 90% of their tokens: the
 * tail validates. */
static int split_tail(dataset *d) {
  int64_t total = 0;
  for (int i = 0; i < d->nseg[0]; i++) total += d->seg[0][i].n;
  int64_t cut = total * 9 / 10, at = 0;
  data_seg *all = d->seg[0];
  int n = d->nseg[0];
  d->seg[0] = NULL;
  d->nseg[0] = 0;
  d->starts[0] = 0;
  int rc = TR_OK;
  for (int i = 0; i < n && !rc; i++) {
    data_seg s = all[i];
    int64_t tr = cut - at < 0 ? 0 : (cut - at > s.n ? s.n : cut - at);
    if (tr > 0) rc = add_seg(d, SPLIT_TRAIN, s.base, s.width, tr);
    if (!rc && s.n - tr > 0)
      rc = add_seg(d, SPLIT_VAL, (const char *)s.base + (size_t)tr * (size_t)s.width, s.width, s.n - tr);
    at += s.n;
  }
  free(all);
  d->n = total;
  d->n_train = cut;
  return rc;
}

int dataset_load(dataset *d, const char *path, int block) {
  memset(d, 0, sizeof *d);
  d->block = block;
  size_t len;
  char *text = tr_read_file(path, &len);
  if (!text) return TR_EIO;
  int seen[256] = {0};
  for (size_t i = 0; i < len; i++) seen[(uint8_t)text[i]] = 1;
  for (int b = 0; b < 256; b++)
    if (seen[b]) d->voc.byte_of[d->voc.size++] = (uint8_t)b;
  vocab_index(&d->voc);
  d->vocab_size = d->model_vocab = d->voc.size;
  int64_t n = (int64_t)len, need = (int64_t)block + 2;
  if (n * 9 / 10 < need || n - n * 9 / 10 < need) {
    free(text);
    return tr_fail(TR_EINVAL, "data '%s': %lld bytes is too small: each of the 90/10 train/val splits needs more than "
                   "block_size+1 = %d tokens (at least %lld bytes in all)", path, (long long)len, block + 1,
                   (long long)(need * 10 + 10));
  }
  d->ids = malloc(sizeof(int32_t) * (size_t)n);
  if (!d->ids) {
    free(text);
    return tr_fail(TR_ENOMEM, "out of memory tokenizing '%s'", path);
  }
  for (int64_t i = 0; i < n; i++) d->ids[i] = d->voc.id_of[(uint8_t)text[i]];
  free(text);
  int rc = add_seg(d, SPLIT_TRAIN, d->ids, 4, n);
  return rc ? rc : split_tail(d);
}

/* --- token shards --- */

int64_t data_padded_vocab(int64_t v) { return (v + 127) / 128 * 128; }

static int ends_with(const char *s, const char *tail) {
  size_t a = strlen(s), b = strlen(tail);
  return a >= b && strcmp(s + a - b, tail) == 0;
}

/* nanoGPT's names for its headerless files. */
static int is_nanogpt_name(const char *path) {
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  return strcmp(base, "train.bin") == 0 || strcmp(base, "val.bin") == 0;
}

/* Checks every token of a run against the vocabulary. */
static int check_tokens(const char *path, const void *base, int width, int64_t n, int64_t vocab_size) {
  for (int64_t i = 0; i < n; i++) {
    int64_t t = width == 2 ? ((const uint16_t *)base)[i] : ((const uint32_t *)base)[i];
    if (t >= vocab_size)
      return tr_fail(TR_EFORMAT, "'%s': token %lld (the %lld-th) is %lld, not below vocab_size = %lld", path,
                     (long long)i, (long long)i + 1, (long long)t, (long long)vocab_size);
  }
  return TR_OK;
}

/* Maps one token file and appends its tokens to `split`. */
static int open_shard(dataset *d, int split, const char *path, const char *format) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return tr_fail(TR_EIO, "cannot open '%s': %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size == 0) {
    close(fd);
    return tr_fail(TR_EFORMAT, "'%s' is empty", path);
  }
  size_t len = (size_t)st.st_size;
  void *p = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return tr_fail(TR_EIO, "cannot map '%s': %s", path, strerror(errno));
  data_map *m = realloc(d->maps, sizeof *m * (size_t)(d->nmaps + 1));
  if (!m) {
    munmap(p, len);
    return tr_fail(TR_ENOMEM, "out of memory");
  }
  d->maps = m;
  m[d->nmaps++] = (data_map){p, len};
  int llmc = strcmp(format, "llmc") == 0 || (strcmp(format, "auto") == 0 && !is_nanogpt_name(path));
  const void *base = p;
  int width = 2;
  int64_t n;
  if (llmc) {
    const int32_t *h = p;
    if (len >= 4 && h[0] != LLMC_MAGIC)
      return tr_fail(TR_EFORMAT, "'%s' is not an llm.c token shard: its magic is %d, not %d (a headerless "
                     "uint16 file wants data_format = \"uint16\")", path, h[0], LLMC_MAGIC);
    if (len < LLMC_HEADER * 4)
      return tr_fail(TR_EFORMAT, "'%s' is truncated: %zu bytes, shorter than the %d-byte llm.c shard header",
                     path, len, LLMC_HEADER * 4);
    if (h[1] != 1 && h[1] != 2)
      return tr_fail(TR_EFORMAT, "'%s': llm.c shard version %d (known: 1 = uint16 tokens, 2 = uint32)", path, h[1]);
    width = h[1] == 1 ? 2 : 4;
    n = h[2];
    if (n < 0 || (uint64_t)len != LLMC_HEADER * 4 + (uint64_t)n * (uint64_t)width)
      return tr_fail(TR_EFORMAT, "'%s' is truncated or damaged: its header says %lld tokens (%lld bytes), the file "
                     "has %zu bytes", path, (long long)n, (long long)(LLMC_HEADER * 4 + n * width), len);
    base = h + LLMC_HEADER;
  } else {
    if (len % 2)
      return tr_fail(TR_EFORMAT, "'%s' is truncated: %zu bytes is not a whole number of uint16 tokens", path, len);
    n = (int64_t)(len / 2);
  }
  int rc = check_tokens(path, base, width, n, d->vocab_size);
  return rc ? rc : add_seg(d, split, base, width, n);
}

/* Expands a list of files/globs (separated by '\n') and opens each file. */
static int open_list(dataset *d, int split, const char *list, const char *format) {
  char *copy = strdup(list);
  if (!copy) return tr_fail(TR_ENOMEM, "out of memory");
  int rc = TR_OK;
  char *save = NULL;
  for (char *pat = strtok_r(copy, "\n", &save); pat && !rc; pat = strtok_r(NULL, "\n", &save)) {
    glob_t g;
    int gr = glob(pat, GLOB_ERR, NULL, &g);
    if (gr == GLOB_NOMATCH) rc = tr_fail(TR_EIO, "'%s' matches no file", pat);
    else if (gr != 0) rc = tr_fail(TR_EIO, "cannot expand '%s'", pat);
    for (size_t i = 0; !gr && i < g.gl_pathc && !rc; i++) rc = open_shard(d, split, g.gl_pathv[i], format);
    if (!gr) globfree(&g);
  }
  free(copy);
  return rc;
}

static int is_token_data(const data_spec *s) {
  if (strcmp(s->format, "auto") != 0) return strcmp(s->format, "text") != 0;
  return ends_with(s->data, ".bin");
}

static int too_small(const dataset *d, const char *what) {
  return tr_fail(TR_EINVAL, "%s: no run of tokens is longer than block_size+1 = %d (the shards are too small for "
                 "the context)", what, d->block + 1);
}

int dataset_open(dataset *d, const data_spec *s) {
  if (!is_token_data(s)) {
    if (s->val_data && s->val_data[0]) return tr_fail(TR_EINVAL, "val_data needs token files (text splits 90/10)");
    if (s->vocab_size > 0) /* not ignored: the model's vocabulary is the text's bytes */
      return tr_fail(TR_EINVAL, "vocab_size = %lld is for token files; '%s' is a text corpus (its vocabulary is its "
                     "bytes): drop vocab_size, or give .bin shards (transom prepare)", (long long)s->vocab_size, s->data);
    if (strchr(s->data, '\n')) return tr_fail(TR_EINVAL, "a list of files needs token files (data_format)");
    return dataset_load(d, s->data, s->block);
  }
  memset(d, 0, sizeof *d);
  d->kind = DATA_TOKENS;
  d->block = s->block;
  if (s->vocab_size <= 0)
    return tr_fail(TR_EINVAL, "token files need the vocabulary size: set vocab_size (GPT-2: 50257)");
  d->vocab_size = s->vocab_size;
  d->model_vocab = data_padded_vocab(s->vocab_size);
  const char *fmt = s->format;
  int rc = open_list(d, SPLIT_TRAIN, s->data, fmt);
  if (rc) return rc;
  if (s->val_data && s->val_data[0]) {
    if ((rc = open_list(d, SPLIT_VAL, s->val_data, fmt))) return rc;
    for (int i = 0; i < d->nseg[0]; i++) d->n_train += d->seg[0][i].n;
    d->n = d->n_train;
    for (int i = 0; i < d->nseg[1]; i++) d->n += d->seg[1][i].n;
  } else if ((rc = split_tail(d))) {
    return rc;
  }
  if (d->starts[SPLIT_TRAIN] <= 0) return too_small(d, "data");
  if (d->starts[SPLIT_VAL] <= 0)
    return too_small(d, s->val_data && s->val_data[0] ? "val_data" : "data (its last 10%, validation)");
  return TR_OK;
}

void dataset_free(dataset *d) {
  free(d->ids);
  d->ids = NULL;
  for (int i = 0; i < d->nmaps; i++) munmap(d->maps[i].p, d->maps[i].len);
  free(d->maps);
  d->maps = NULL;
  d->nmaps = 0;
  for (int s = 0; s < 2; s++) {
    free(d->seg[s]);
    d->seg[s] = NULL;
    d->nseg[s] = 0;
  }
}

/* --- batches --- */

static void copy_ids(int32_t *out, const data_seg *s, int64_t off, int T) {
  if (s->width == 4) {
    memcpy(out, (const int32_t *)s->base + off, sizeof(int32_t) * (size_t)T);
    return;
  }
  const uint16_t *p = (const uint16_t *)s->base + off;
  for (int t = 0; t < T; t++) out[t] = p[t];
}

void dataset_batch(const dataset *d, int split, rng_t *r, int B, int T, int32_t *x, int32_t *y) {
  for (int b = 0; b < B; b++) {
    /* a start among all the split's valid starts (T+1 tokens from it in one run) */
    int64_t u = (int64_t)rng_below(r, (uint64_t)d->starts[split]);
    const data_seg *s = d->seg[split];
    for (int i = 0; i < d->nseg[split]; i++, s++) {
      int64_t rows = s->n - d->block - 1;
      if (rows <= 0) continue;
      if (u < rows) break;
      u -= rows;
    }
    copy_ids(x + (int64_t)b * T, s, u, T);
    copy_ids(y + (int64_t)b * T, s, u + 1, T);
  }
}

int vocab_save(const vocab *v, const char *path) {
  char buf[4096];
  size_t k = (size_t)snprintf(buf, sizeof buf, "{\"type\":\"bytes\",\"tokens\":[");
  for (int i = 0; i < v->size; i++) k += (size_t)snprintf(buf + k, sizeof buf - k, i ? ",%d" : "%d", v->byte_of[i]);
  k += (size_t)snprintf(buf + k, sizeof buf - k, "]}\n");
  return tr_write_file_atomic(path, buf, k);
}

int vocab_save_tokens(int64_t vocab_size, const char *path) {
  char buf[128];
  int k = snprintf(buf, sizeof buf, "{\"type\":\"tokens\",\"vocab_size\":%lld}\n", (long long)vocab_size);
  return tr_write_file_atomic(path, buf, (size_t)k);
}

/* The bytes of a {"type":"bytes","tokens":[...]} vocabulary: 1 to 256 of
 * them, each 0..255. */
static int vocab_bytes(vocab *v, const json_doc *d) {
  const char *p;
  size_t n;
  int rc = json_top_raw(d, "tokens", &p, &n, NULL);
  if (rc) return rc;
  if (*p != '[')
    return tr_fail(TR_EFORMAT, "'%s': tokens is not a list of bytes (it is %.*s%s)", d->file, (int)(n > 40 ? 40 : n), p,
                   n > 40 ? "..." : "");
  const char *end = p + n - 1; /* its ']': json_top checked the list */
  for (p++; p < end; p++) {
    if (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r' || *p == ',') continue;
    char *e;
    long b = strtol(p, &e, 10);
    size_t k = strcspn(p, ", \n\t\r]");
    if (e != p + k || b < 0 || b > 255)
      return tr_fail(TR_EFORMAT, "'%s': tokens holds %.*s, not a byte 0..255", d->file, (int)(k > 40 ? 40 : k), p);
    if (v->size >= 256) return tr_fail(TR_EFORMAT, "'%s': tokens holds more than 256 bytes", d->file);
    v->byte_of[v->size++] = (uint8_t)b;
    p = e - 1;
  }
  if (v->size == 0) return tr_fail(TR_EFORMAT, "'%s': tokens is empty", d->file);
  vocab_index(v);
  return TR_OK;
}

/* vocab.json by its top-level keys (json_top.h): "type" says which of the
 * two forms; tokens_ok = 0 refuses the token form. */
static int vocab_read(vocab *v, int64_t *vocab_size, const char *path, int tokens_ok) {
  size_t len;
  char *s = tr_read_file(path, &len);
  if (!s) return TR_EIO;
  memset(v, 0, sizeof *v);
  json_doc d = {path, s, len};
  char type[16] = "";
  const char *raw = NULL;
  size_t rn = 0;
  int64_t n = 0;
  int rc = json_top_raw(&d, "type", &raw, &rn, NULL);
  if (!rc && raw[0] != '"') /* not a string: json_top_str says so */
    rc = json_top_str(&d, "type", type, sizeof type, NULL);
  else if (!rc && json_top_str(&d, "type", type, sizeof type, NULL) != TR_OK)
    type[0] = 0; /* a string too long for type (or holding \u0000): neither form, refused below as written */
  if (!rc && strcmp(type, "bytes") == 0) {
    rc = vocab_bytes(v, &d);
    n = v->size;
  } else if (!rc && strcmp(type, "tokens") == 0 && tokens_ok) {
    rc = json_top_int(&d, "vocab_size", &n, NULL);
    if (!rc && n <= 0) rc = tr_fail(TR_EFORMAT, "'%s': vocab_size is %lld, not a positive count", path, (long long)n);
  } else if (!rc) {
    rc = tr_fail(TR_EFORMAT, "'%s': type is %.*s%s, expected %s", path, (int)(rn > 40 ? 40 : rn), raw,
                 rn > 40 ? "..." : "", tokens_ok ? "\"bytes\" or \"tokens\"" : "\"bytes\" (a byte-level vocabulary)");
  }
  free(s);
  if (!rc && vocab_size) *vocab_size = n;
  return rc;
}

int vocab_load_any(vocab *v, int64_t *vocab_size, const char *path) { return vocab_read(v, vocab_size, path, 1); }

int vocab_load(vocab *v, const char *path) { return vocab_read(v, NULL, path, 0); }

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
