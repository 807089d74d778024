/* bpe.c — byte-level BPE: the token table, GPT-2's pre-tokenizer,
 * rank-ordered merges, the tokenizer.bpe and tiktoken files (see bpe.h;
 * training is bpe_train.c). Called by `transom prepare`
 * (core/cli/prepare.c) and by sampling (trainer.c). */
#include "bpe.h"
#include "bpe_internal.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"


/* --- token table --- */

uint64_t bpe_hash_bytes(const uint8_t *p, size_t n) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

/* The id of these bytes, or -1. */
int bpe_lookup(const bpe *b, const uint8_t *p, size_t n) {
  for (uint32_t i = (uint32_t)bpe_hash_bytes(p, n) & b->mask;; i = (i + 1) & b->mask) {
    int id = b->slot[i];
    if (id < 0) return -1;
    if ((size_t)b->len[id] == n && memcmp(b->pool + b->off[id], p, n) == 0) return id;
  }
}

static int rehash(bpe *b, int cap) {
  uint32_t size = 1024;
  while (size < (uint32_t)cap * 2) size *= 2;
  free(b->slot);
  if (!(b->slot = malloc(sizeof(int32_t) * size))) return tr_fail(TR_ENOMEM, "out of memory");
  memset(b->slot, 0xff, sizeof(int32_t) * size);
  b->mask = size - 1;
  for (int id = 0; id < b->n; id++) {
    uint32_t i = (uint32_t)bpe_hash_bytes(b->pool + b->off[id], (size_t)b->len[id]) & b->mask;
    while (b->slot[i] >= 0) i = (i + 1) & b->mask;
    b->slot[i] = id;
  }
  return TR_OK;
}

/* Appends a token (tables sized for cap tokens by bpe_new). */
int bpe_add_token(bpe *b, const uint8_t *p, size_t n, int special) {
  if (b->pool_len + n > b->pool_cap) {
    size_t cap = (b->pool_cap + n) * 2;
    uint8_t *q = realloc(b->pool, cap);
    if (!q) return tr_fail(TR_ENOMEM, "out of memory");
    b->pool = q;
    b->pool_cap = cap;
  }
  memcpy(b->pool + b->pool_len, p, n);
  int id = b->n++;
  b->off[id] = (int64_t)b->pool_len;
  b->len[id] = (int32_t)n;
  b->special[id] = (uint8_t)special;
  b->pool_len += n;
  uint32_t i = (uint32_t)bpe_hash_bytes(p, n) & b->mask;
  while (b->slot[i] >= 0) i = (i + 1) & b->mask;
  b->slot[i] = id;
  return TR_OK;
}

bpe *bpe_new(int cap) {
  bpe *b = calloc(1, sizeof *b);
  if (!b) return NULL;
  b->off = malloc(sizeof(int64_t) * (size_t)cap);
  b->len = malloc(sizeof(int32_t) * (size_t)cap);
  b->special = malloc((size_t)cap);
  if (!b->off || !b->len || !b->special || rehash(b, cap)) {
    bpe_free(b);
    return NULL;
  }
  return b;
}

void bpe_free(bpe *b) {
  if (!b) return;
  free(b->pool);
  free(b->off);
  free(b->len);
  free(b->special);
  free(b->slot);
  free(b);
}

int64_t bpe_vocab_size(const bpe *b) { return b->n; }

int bpe_eot(const bpe *b) { return bpe_lookup(b, (const uint8_t *)"<|endoftext|>", 13); }

void bpe_decode(const bpe *b, int id, FILE *out) {
  if (id >= 0 && id < b->n) fwrite(b->pool + b->off[id], 1, (size_t)b->len[id], out);
}

/* --- GPT-2's pre-tokenizer ---
 * 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * with bytes >= 0x80 as letters (UTF-8 letters stay whole). */

static int is_ws(uint8_t c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
static int char_class(uint8_t c) { /* 0 white, 1 letter, 2 digit, 3 other */
  if (is_ws(c)) return 0;
  if ((c | 32) >= 'a' && (c | 32) <= 'z') return 1;
  if (c >= 0x80) return 1;
  if (c >= '0' && c <= '9') return 2;
  return 3;
}

/* The end of the piece that starts at i. */
size_t bpe_next_piece(const uint8_t *s, size_t len, size_t i) {
  if (s[i] == '\'' && i + 1 < len) {
    static const char *const cont[] = {"re", "ve", "ll", "s", "t", "m", "d"};
    for (int k = 0; k < 7; k++) {
      size_t m = strlen(cont[k]);
      if (i + 1 + m <= len && memcmp(s + i + 1, cont[k], m) == 0) return i + 1 + m;
    }
  }
  size_t j = i;
  if (s[i] == ' ' && i + 1 < len && !is_ws(s[i + 1])) j = i + 1; /* the optional space */
  int cls = char_class(s[j]);
  if (cls) {
    size_t k = j + 1;
    while (k < len && char_class(s[k]) == cls) k++;
    return k;
  }
  size_t k = i; /* white space: leave its last char to the word after it */
  while (k < len && is_ws(s[k])) k++;
  if (k == len) return k;
  return k - i > 1 ? k - 1 : i + 1;
}

/* --- encoding --- */

/* Merges one piece's bytes; writes ids to out, returns how many, or a
 * negative error for a byte with no token. */
static int64_t encode_piece(const bpe *b, const uint8_t *p, size_t n, int32_t *start, int32_t *out) {
  int m = (int)n; /* parts: p[start[k] .. start[k+1]) */
  for (int k = 0; k <= m; k++) start[k] = k;
  for (;;) {
    int best = INT_MAX, at = -1;
    for (int k = 0; k + 1 < m; k++) {
      int id = bpe_lookup(b, p + start[k], (size_t)(start[k + 2] - start[k]));
      if (id >= 0 && !b->special[id] && id < best) best = id, at = k;
    }
    if (at < 0) break;
    memmove(start + at + 1, start + at + 2, sizeof(int32_t) * (size_t)(m - at - 1));
    m--;
  }
  for (int k = 0; k < m; k++) {
    int id = bpe_lookup(b, p + start[k], (size_t)(start[k + 1] - start[k]));
    if (id < 0) /* only a single byte can lack a token: bpe_load refuses such a tokenizer */
      return tr_fail(TR_EINVAL, "bpe_encode: the byte 0x%02x has no token (a byte-level tokenizer needs all 256)",
                     p[start[k]]);
    out[k] = id;
  }
  return m;
}

int bpe_encode(const bpe *b, const char *text, size_t len, int32_t *out, int64_t cap, int64_t *n, int eot_first) {
  const uint8_t *s = (const uint8_t *)text;
  *n = 0;
  if (cap < (int64_t)len + (eot_first ? 1 : 0)) return tr_fail(TR_EINVAL, "bpe_encode: out holds too few ids");
  if (eot_first) {
    int eot = bpe_eot(b);
    if (eot < 0) return tr_fail(TR_EINVAL, "the tokenizer has no <|endoftext|>");
    out[(*n)++] = eot;
  }
  int32_t *start = NULL;
  size_t scap = 0;
  for (size_t i = 0; i < len;) {
    size_t e = bpe_next_piece(s, len, i);
    if (e - i + 1 > scap) {
      scap = (e - i + 1) * 2;
      int32_t *q = realloc(start, sizeof(int32_t) * scap);
      if (!q) {
        free(start);
        return tr_fail(TR_ENOMEM, "out of memory");
      }
      start = q;
    }
    int64_t k = encode_piece(b, s + i, e - i, start, out + *n);
    if (k < 0) {
      free(start);
      return (int)k;
    }
    *n += k;
    i = e;
  }
  free(start);
  return TR_OK;
}

/* --- the tokenizer.bpe file --- */

int bpe_save(const bpe *b, const char *path) {
  size_t cap = 64 + (size_t)b->n * 2 + b->pool_len * 2, k = 0;
  char *buf = malloc(cap);
  if (!buf) return tr_fail(TR_ENOMEM, "out of memory");
  k += (size_t)snprintf(buf, cap, "transom-bpe 1 %d\n", b->n);
  static const char hex[] = "0123456789abcdef";
  for (int id = 0; id < b->n; id++) {
    if (b->special[id]) buf[k++] = '!';
    for (int j = 0; j < b->len[id]; j++) {
      uint8_t c = b->pool[b->off[id] + j];
      buf[k++] = hex[c >> 4];
      buf[k++] = hex[c & 15];
    }
    buf[k++] = '\n';
  }
  int rc = tr_write_file_atomic(path, buf, k);
  free(buf);
  return rc;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

/* --- tiktoken's files (GPT-2's gpt2.tiktoken: "base64 rank" a line) --- */

static int b64val(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  return c == '+' ? 62 : c == '/' ? 63 : -1;
}

/* Decodes base64 at p (up to a space) into out; returns the byte count, -1 if malformed. */
static int b64_decode(const char *p, uint8_t *out, const char **end) {
  int n = 0, bits = 0;
  unsigned acc = 0;
  for (; *p && *p != ' ' && *p != '='; p++) {
    int v = b64val(*p);
    if (v < 0) return -1;
    acc = (acc << 6 | (unsigned)v) & 0x3fffu; /* at most 13 pending bits */
    if ((bits += 6) >= 8) out[n++] = (uint8_t)(acc >> (bits -= 8));
  }
  while (*p == '=') p++;
  *end = p;
  return n;
}

/* Byte-level BPE encodes any text only if each of the 256 bytes is a
 * token of its own (not a special one): a file lacking one is refused
 * here, naming the byte, rather than failing on the first text holding it. */
static int check_bytes(const bpe *b, const char *path) {
  for (int v = 0; v < 256; v++) {
    uint8_t c = (uint8_t)v;
    int id = bpe_lookup(b, &c, 1);
    if (id < 0 || b->special[id])
      return tr_fail(TR_EFORMAT, "%s: no token for the byte 0x%02x (a byte-level tokenizer needs one for each of the "
                     "256 bytes)", path, v);
  }
  return TR_OK;
}

/* Ranks must be 0, 1, 2, ... in order; <|endoftext|> is added last, as
 * GPT-2 numbers it (50256). */
static bpe *load_tiktoken(const char *path, const char *s, size_t len) {
  int n = 0;
  for (size_t i = 0; i < len; i++) n += s[i] == '\n';
  bpe *b = bpe_new(n + 2);
  uint8_t *tmp = malloc(len + 1);
  int line = 1;
  if (!b || !tmp) goto fail;
  for (const char *p = s; *p; line++) {
    const char *e = p;
    int m = b64_decode(p, tmp, &e);
    char *after = (char *)e;
    long rank = *e == ' ' ? strtol(e + 1, &after, 10) : -1;
    if (m <= 0 || rank != b->n || (*after != '\n' && *after) || bpe_lookup(b, tmp, (size_t)m) >= 0) {
      tr_fail(TR_EFORMAT, "%s:%d: expected 'BASE64 %d' (a tiktoken file, ranks in order)", path, line, b->n);
      goto fail;
    }
    if (bpe_add_token(b, tmp, (size_t)m, 0)) goto fail;
    p = *after ? after + 1 : after;
  }
  if (bpe_lookup(b, (const uint8_t *)"<|endoftext|>", 13) < 0 && bpe_add_token(b, (const uint8_t *)"<|endoftext|>", 13, 1))
    goto fail;
  if (check_bytes(b, path)) goto fail;
  free(tmp);
  return b;
fail:
  free(tmp);
  bpe_free(b);
  return NULL;
}

bpe *bpe_load(const char *path) {
  size_t len;
  char *s = tr_read_file(path, &len);
  if (!s) return NULL;
  if (strncmp(s, "transom-bpe ", 12) != 0 && len > 0 && b64val(s[0]) >= 0) {
    bpe *t = load_tiktoken(path, s, len);
    free(s);
    return t;
  }
  int n = 0;
  bpe *b = NULL;
  uint8_t *tmp = NULL;
  if (sscanf(s, "transom-bpe 1 %d", &n) != 1 || n < 1 || n > (1 << 24)) {
    tr_fail(TR_EFORMAT, "%s:1: not a transom tokenizer (expected 'transom-bpe 1 N')", path);
    goto fail;
  }
  int lines = 0; /* a token is a line: a header claiming more is refused before its tables are allocated */
  for (size_t i = 0; i < len; i++) lines += s[i] == '\n';
  if (n > lines) { /* lines: the header's and the tokens' newlines (a damaged one is reported at its line) */
    tr_fail(TR_EFORMAT, "%s:1: the header says %d tokens, the file has %d lines", path, n, lines);
    goto fail;
  }
  b = bpe_new(n);
  tmp = malloc(len);
  if (!b || !tmp) {
    tr_fail(TR_ENOMEM, "out of memory");
    goto fail;
  }
  char *p = strchr(s, '\n');
  for (int id = 0; id < n; id++) {
    if (!p) {
      tr_fail(TR_EFORMAT, "%s: %d tokens, the header says %d", path, id, n);
      goto fail;
    }
    p++;
    int special = *p == '!';
    p += special;
    size_t m = 0;
    for (; hexval(p[0]) >= 0 && hexval(p[1]) >= 0; p += 2) tmp[m++] = (uint8_t)(hexval(p[0]) * 16 + hexval(p[1]));
    if (*p != '\n' || m == 0 || bpe_lookup(b, tmp, m) >= 0) {
      tr_fail(TR_EFORMAT, "%s:%d: a token is lowercase hex bytes, each token once", path, id + 2);
      goto fail;
    }
    if (bpe_add_token(b, tmp, m, special)) goto fail;
  }
  if (check_bytes(b, path)) goto fail;
  free(tmp);
  free(s);
  return b;
fail:
  free(tmp);
  free(s);
  bpe_free(b);
  return NULL;
}
