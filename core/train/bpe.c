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

/* --- encoding ---
 * A piece's bytes are merged pair by pair, always the adjacent pair whose
 * token has the lowest id (the earliest merge), the leftmost of equals,
 * until no adjacent pair is a token. Short pieces (words) rescan their few
 * parts for each merge; long ones (a run of letters with no space: CJK
 * text, base64, minified JSON) keep the candidate pairs in a heap, so a
 * piece of n bytes costs O(n log n), not O(n^2) (a 16 KiB piece took 3.4 s
 * and 64 KiB 18 s before). Both give the same merges, the same ids. */

/* Parts [left, right) and [right, rend) would merge into token id. */
typedef struct {
  int32_t id, left, right, rend;
} merge_cand;

/* Scratch for one piece: per byte offset, where the part starting there
 * ends (-1: no part starts there) and where the part before it starts;
 * the heap of candidates (n - 1 at first, and each merge pops one and
 * pushes at most two: at most 2n - 2 at once). */
typedef struct {
  int32_t *end, *prv;
  merge_cand *heap;
  size_t cap; /* bytes of piece the arrays hold */
} bpe_work;

#define SHORT_PIECE 64

static int work_reserve(bpe_work *w, size_t n) {
  if (n <= w->cap) return TR_OK;
  size_t cap = n > w->cap * 2 ? n : w->cap * 2;
  int32_t *end = realloc(w->end, sizeof(int32_t) * (cap + 1));
  if (end) w->end = end;
  int32_t *prv = realloc(w->prv, sizeof(int32_t) * (cap + 1));
  if (prv) w->prv = prv;
  merge_cand *heap = realloc(w->heap, sizeof(merge_cand) * 2 * (cap + 1));
  if (heap) w->heap = heap;
  if (!end || !prv || !heap) return tr_fail(TR_ENOMEM, "out of memory encoding a piece of %zu bytes", n);
  w->cap = cap;
  return TR_OK;
}

static void work_free(bpe_work *w) {
  free(w->end);
  free(w->prv);
  free(w->heap);
}

static int cand_before(const merge_cand *a, const merge_cand *b) {
  return a->id < b->id || (a->id == b->id && a->left < b->left);
}

static void heap_push(merge_cand *h, size_t *n, merge_cand c) {
  size_t k = (*n)++;
  while (k > 0 && cand_before(&c, &h[(k - 1) / 2])) {
    h[k] = h[(k - 1) / 2];
    k = (k - 1) / 2;
  }
  h[k] = c;
}

static merge_cand heap_pop(merge_cand *h, size_t *n) {
  merge_cand top = h[0], last = h[--(*n)];
  size_t k = 0;
  for (;;) {
    size_t c = 2 * k + 1;
    if (c >= *n) break;
    if (c + 1 < *n && cand_before(&h[c + 1], &h[c])) c++;
    if (!cand_before(&h[c], &last)) break;
    h[k] = h[c];
    k = c;
  }
  h[k] = last;
  return top;
}

/* Pushes the pair [left, right) + [right, rend) if it is a (non-special) token. */
static void push_pair(const bpe *b, const uint8_t *p, merge_cand *h, size_t *hn, int left, int right, int rend) {
  int id = bpe_lookup(b, p + left, (size_t)(rend - left));
  if (id >= 0 && !b->special[id]) heap_push(h, hn, (merge_cand){id, left, right, rend});
}

/* Writes the id of each part of p (parts p[k] .. p[end[k]) from k = 0),
 * or fails for a byte with no token. Returns how many. */
static int64_t emit_parts(const bpe *b, const uint8_t *p, int n, const int32_t *end, int32_t *out) {
  int64_t m = 0;
  for (int k = 0; k < n; k = end[k]) {
    int id = bpe_lookup(b, p + k, (size_t)(end[k] - k));
    if (id < 0) /* only a single byte can lack a token: bpe_load refuses such a tokenizer */
      return tr_fail(TR_EINVAL, "bpe_encode: the byte 0x%02x has no token (a byte-level tokenizer needs all 256)",
                     p[k]);
    out[m++] = id;
  }
  return m;
}

/* A short piece: rescans its parts for each merge. */
static int64_t encode_short(const bpe *b, const uint8_t *p, int n, bpe_work *w, int32_t *out) {
  int32_t *start = w->prv, *end = w->end; /* start: parts p[start[k] .. start[k+1]) */
  int m = n;
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
  for (int k = 0; k < m; k++) end[start[k]] = start[k + 1];
  return emit_parts(b, p, n, end, out);
}

/* A long piece: candidates in a heap; one that a merge made stale (either
 * of its parts is no longer what it was) is dropped when it comes up. */
static int64_t encode_long(const bpe *b, const uint8_t *p, int n, bpe_work *w, int32_t *out) {
  int32_t *end = w->end, *prv = w->prv;
  size_t hn = 0;
  for (int k = 0; k < n; k++) {
    end[k] = k + 1;
    prv[k] = k - 1;
  }
  for (int k = 0; k + 1 < n; k++) push_pair(b, p, w->heap, &hn, k, k + 1, k + 2);
  while (hn > 0) {
    merge_cand c = heap_pop(w->heap, &hn);
    if (end[c.left] != c.right || end[c.right] != c.rend) continue;
    end[c.left] = c.rend;
    end[c.right] = -1;
    if (c.rend < n) prv[c.rend] = c.left;
    if (prv[c.left] >= 0) push_pair(b, p, w->heap, &hn, prv[c.left], c.left, c.rend);
    if (c.rend < n) push_pair(b, p, w->heap, &hn, c.left, c.rend, end[c.rend]);
  }
  return emit_parts(b, p, n, end, out);
}

/* Merges one piece's bytes; writes ids to out, returns how many, or a
 * negative error. */
static int64_t encode_piece(const bpe *b, const uint8_t *p, size_t n, bpe_work *w, int32_t *out) {
  if (n > INT32_MAX / 2) return tr_fail(TR_EINVAL, "bpe_encode: a piece of %zu bytes is too long", n);
  int rc = work_reserve(w, n);
  if (rc) return rc;
  return n <= SHORT_PIECE ? encode_short(b, p, (int)n, w, out) : encode_long(b, p, (int)n, w, out);
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
  bpe_work w = {0};
  for (size_t i = 0; i < len;) {
    size_t e = bpe_next_piece(s, len, i);
    int64_t k = encode_piece(b, s + i, e - i, &w, out + *n);
    if (k < 0) {
      work_free(&w);
      return (int)k;
    }
    *n += k;
    i = e;
  }
  work_free(&w);
  return TR_OK;
}

/* The short and the long path on one piece (tests: they must agree). */
int bpe_encode_piece_paths(const bpe *b, const uint8_t *p, size_t n, int32_t *out_short, int32_t *out_long,
                           int64_t *n_short, int64_t *n_long) {
  bpe_work w = {0};
  int rc = n > INT32_MAX / 2 ? TR_EINVAL : work_reserve(&w, n);
  if (!rc) *n_short = encode_short(b, p, (int)n, &w, out_short);
  if (!rc) *n_long = encode_long(b, p, (int)n, &w, out_long);
  work_free(&w);
  return rc ? rc : *n_short < 0 ? (int)*n_short : *n_long < 0 ? (int)*n_long : TR_OK;
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
