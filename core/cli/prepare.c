/* prepare.c — `transom prepare`: text files -> llm.c token shards + the
 * tokenizer that made them.
 *
 * A byte-level BPE is trained on the text (bpe.h; offline, no downloads), or
 * an existing tokenizer.bpe is reused; each file is one document, starting
 * with <|endoftext|> as GPT-2's data does. The last --val fraction of the
 * tokens goes to val_*.bin, the rest to train_*.bin, at most --shard-tokens
 * per shard; DIR/tokenizer.bpe is where a job finds it (trainer.c). Called
 * from main.c only; it returns an exit status and never exits itself.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bpe.h"
#include "util.h"

static const char prepare_usage[] =
    "usage: transom prepare TEXT... -o DIR [--vocab N] [--tokenizer FILE] [--val F] [--shard-tokens N]\n"
    "\n"
    "Tokenizes text files into llm.c token shards: DIR/train_000000.bin ...,\n"
    "DIR/val_000000.bin, and DIR/tokenizer.bpe. The tokenizer is a byte-level\n"
    "BPE (GPT-2's scheme) trained on the text to --vocab tokens (default 4096,\n"
    "<|endoftext|> last), or the one in --tokenizer FILE. Each file is a\n"
    "document and starts with <|endoftext|>. --val: the fraction of the\n"
    "tokens that validate (default 0.1); --shard-tokens: tokens per shard\n"
    "(default 100000000). A job then names the shards:\n"
    "\n"
    "  data = \"DIR/train_*.bin\", val_data = \"DIR/val_*.bin\", vocab_size = N\n";

typedef struct {
  const char *dir;
  int64_t shard_tokens;
  int next[2]; /* shard numbers per split */
} shard_out;

/* Writes ids as llm.c shards of at most shard_tokens each. */
static int write_shards(shard_out *o, int split, const int32_t *ids, int64_t n) {
  static const char *const name[2] = {"train", "val"};
  for (int64_t at = 0; at < n; at += o->shard_tokens) {
    int64_t k = n - at < o->shard_tokens ? n - at : o->shard_tokens;
    size_t bytes = 1024 + 2 * (size_t)k;
    uint8_t *buf = calloc(1, bytes);
    if (!buf) return tr_fail(TR_ENOMEM, "out of memory");
    int32_t h[3] = {20240520, 1, (int32_t)k};
    memcpy(buf, h, sizeof h);
    uint16_t *t = (uint16_t *)(buf + 1024);
    for (int64_t i = 0; i < k; i++) t[i] = (uint16_t)ids[at + i];
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s_%06d.bin", o->dir, name[split], o->next[split]++);
    int rc = tr_write_file_atomic(path, buf, bytes);
    free(buf);
    if (rc) return rc;
  }
  return TR_OK;
}

/* Reads every file; *docs[i] is file i. */
static char *read_all(char **files, int n, size_t *len, size_t *ends) {
  size_t total = 0, cap = 0;
  char *all = NULL;
  for (int i = 0; i < n; i++) {
    size_t l;
    char *s = tr_read_file(files[i], &l);
    if (!s) {
      free(all);
      return NULL;
    }
    if (total + l + 1 > cap) {
      cap = (total + l + 1) * 2;
      char *q = realloc(all, cap);
      if (!q) {
        free(s);
        free(all);
        tr_fail(TR_ENOMEM, "out of memory");
        return NULL;
      }
      all = q;
    }
    memcpy(all + total, s, l);
    total += l;
    ends[i] = total;
    free(s);
  }
  *len = total;
  return all;
}

/* Encodes each document (<|endoftext|> first) into one id array. */
static int encode_docs(const bpe *b, const char *all, const size_t *ends, int n, int32_t **ids, int64_t *nids) {
  size_t len = n ? ends[n - 1] : 0;
  *ids = malloc(sizeof(int32_t) * (len + (size_t)n + 1));
  if (!*ids) return tr_fail(TR_ENOMEM, "out of memory");
  *nids = 0;
  for (int i = 0; i < n; i++) {
    size_t from = i ? ends[i - 1] : 0;
    int64_t k;
    int rc = bpe_encode(b, all + from, ends[i] - from, *ids + *nids, (int64_t)(ends[i] - from) + 1, &k, 1);
    if (rc) return rc;
    *nids += k;
  }
  return TR_OK;
}

static int parse_args(int argc, char **argv, char **files, int *nfiles, shard_out *o, long *vocab,
                      const char **tok, double *val) {
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    int has = i + 1 < argc;
    char *end = NULL;
    if (strcmp(a, "-o") == 0 && has) o->dir = argv[++i];
    else if (strcmp(a, "--tokenizer") == 0 && has) *tok = argv[++i];
    else if (strcmp(a, "--vocab") == 0 && has) {
      *vocab = strtol(argv[++i], &end, 10);
      if (*end || *vocab < 257 || *vocab > 65536) return tr_fail(TR_EINVAL, "--vocab must be 257..65536 (uint16 shards)");
    } else if (strcmp(a, "--val") == 0 && has) {
      *val = strtod(argv[++i], &end);
      if (*end || !(*val > 0 && *val < 1)) return tr_fail(TR_EINVAL, "--val must be a fraction in (0, 1)");
    } else if (strcmp(a, "--shard-tokens") == 0 && has) {
      o->shard_tokens = strtoll(argv[++i], &end, 10);
      if (*end || o->shard_tokens < 1 || o->shard_tokens > INT32_MAX) /* the header's count is an int32 */
        return tr_fail(TR_EINVAL, "--shard-tokens must be 1..%d (an llm.c header counts tokens in an int32)", INT32_MAX);
    } else if (a[0] == '-') {
      return tr_fail(TR_EINVAL, "unknown option '%s' (see transom prepare --help)", a);
    } else {
      files[(*nfiles)++] = argv[i];
    }
  }
  if (!*nfiles || !o->dir) return tr_fail(TR_EINVAL, "text files and -o DIR are required (see transom prepare --help)");
  return TR_OK;
}

int prepare_main(int argc, char **argv) {
  for (int i = 0; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(prepare_usage, stdout);
      return 0;
    }
  char **files = calloc((size_t)argc + 1, sizeof *files);
  size_t *ends = calloc((size_t)argc + 1, sizeof *ends);
  shard_out o = {NULL, 100000000, {0, 0}};
  long vocab = 4096;
  const char *tokfile = NULL;
  double val = 0.1;
  int nfiles = 0;
  if (!files || !ends || parse_args(argc, argv, files, &nfiles, &o, &vocab, &tokfile, &val)) {
    fprintf(stderr, "transom prepare: %s\n", tr_error());
    free(files);
    free(ends);
    return 2;
  }
  size_t len = 0;
  char *all = read_all(files, nfiles, &len, ends), path[PATH_MAX];
  bpe *b = NULL;
  int32_t *ids = NULL;
  int64_t n = 0;
  int rc = all ? tr_mkdirs(o.dir) : TR_EIO;
  if (!rc) b = tokfile ? bpe_load(tokfile) : bpe_train(all, len, (int)vocab);
  if (!rc && !b) rc = TR_EINVAL;
  if (!rc && bpe_vocab_size(b) > 65536) rc = tr_fail(TR_EINVAL, "'%s': more than 65536 tokens (uint16 shards)", tokfile);
  if (!rc) rc = encode_docs(b, all, ends, nfiles, &ids, &n);
  int64_t nval = (int64_t)((double)n * val);
  if (!rc) rc = write_shards(&o, 0, ids, n - nval);
  if (!rc) rc = write_shards(&o, 1, ids + n - nval, nval);
  snprintf(path, sizeof path, "%s/tokenizer.bpe", o.dir);
  if (!rc) rc = bpe_save(b, path);
  if (!rc)
    printf("%zu bytes -> %lld tokens (%.2f bytes/token): %d train and %d val shards, tokenizer of %lld tokens in %s\n"
           "a job reads them with:\n  data = \"%s/train_*.bin\", val_data = \"%s/val_*.bin\", vocab_size = %lld,\n",
           len, (long long)n, n ? (double)len / (double)n : 0.0, o.next[0], o.next[1], (long long)bpe_vocab_size(b),
           path, o.dir, o.dir, (long long)bpe_vocab_size(b));
  else fprintf(stderr, "transom prepare: %s\n", tr_error());
  bpe_free(b);
  free(ids);
  free(all);
  free(files);
  free(ends);
  return rc ? 1 : 0;
}
