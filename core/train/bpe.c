/* bpe.c — byte-level BPE: GPT-2's pre-tokenizer, rank-ordered merges,
 * training on a corpus, the tokenizer.bpe file (see bpe.h). Called by
 * `transom prepare` (core/cli/prepare.c) and by sampling (trainer.c). */
#include "bpe.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

struct bpe {
  int n;            /* tokens */
  uint8_t *pool;    /* every token's bytes, back to back */
  size_t pool_len, pool_cap;
  int64_t *off;     /* token i: pool[off[i] .. off[i] + len[i]) */
  int32_t *len;
  uint8_t *special; /* 1: never merged (<|endoftext|>) */
  int32_t *slot;    /* hash table of token bytes -> id (-1 empty) */
  uint32_t mask;
};

/* --- token table --- */

static uint64_t hash_bytes(const uint8_t *p, size_t n) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

/* The id of these bytes, or -1. */
static int lookup(const bpe *b, const uint8_t *p, size_t n) {
  for (uint32_t i = (uint32_t)hash_bytes(p, n) & b->mask;; i = (i + 1) & b->mask) {
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
    uint32_t i = (uint32_t)hash_bytes(b->pool + b->off[id], (size_t)b->len[id]) & b->mask;
    while (b->slot[i] >= 0) i = (i + 1) & b->mask;
    b->slot[i] = id;
  }
  return TR_OK;
}

/* Appends a token (tables sized for cap tokens by bpe_new). */
static int add_token(bpe *b, const uint8_t *p, size_t n, int special) {
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
  uint32_t i = (uint32_t)hash_bytes(p, n) & b->mask;
  while (b->slot[i] >= 0) i = (i + 1) & b->mask;
  b->slot[i] = id;
  return TR_OK;
}

static bpe *bpe_new(int cap) {
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

int bpe_eot(const bpe *b) { return lookup(b, (const uint8_t *)"<|endoftext|>", 13); }

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
static size_t next_piece(const uint8_t *s, size_t len, size_t i) {
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

/* Merges one piece's bytes; writes ids to out, returns how many. */
static int64_t encode_piece(const bpe *b, const uint8_t *p, size_t n, int32_t *start, int32_t *out) {
  int m = (int)n; /* parts: p[start[k] .. start[k+1]) */
  for (int k = 0; k <= m; k++) start[k] = k;
  for (;;) {
    int best = INT_MAX, at = -1;
    for (int k = 0; k + 1 < m; k++) {
      int id = lookup(b, p + start[k], (size_t)(start[k + 2] - start[k]));
      if (id >= 0 && !b->special[id] && id < best) best = id, at = k;
    }
    if (at < 0) break;
    memmove(start + at + 1, start + at + 2, sizeof(int32_t) * (size_t)(m - at - 1));
    m--;
  }
  for (int k = 0; k < m; k++) {
    int id = lookup(b, p + start[k], (size_t)(start[k + 1] - start[k]));
    out[k] = id >= 0 ? id : 0; /* a byte-level vocabulary holds every byte */
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
    size_t e = next_piece(s, len, i);
    if (e - i + 1 > scap) {
      scap = (e - i + 1) * 2;
      int32_t *q = realloc(start, sizeof(int32_t) * scap);
      if (!q) {
        free(start);
        return tr_fail(TR_ENOMEM, "out of memory");
      }
      start = q;
    }
    *n += encode_piece(b, s + i, e - i, start, out + *n);
    i = e;
  }
  free(start);
  return TR_OK;
}

/* --- training --- */

typedef struct {
  int32_t *sym;
  int n;
  int64_t count;
} word;

typedef struct {
  word *w;
  int n, cap;
  int32_t *slot; /* distinct pieces: hash -> index into w (-1 empty) */
  const uint8_t **key;
  size_t *klen;
  uint32_t mask;
} word_set;

static int word_set_grow(word_set *ws) {
  int cap = ws->cap ? ws->cap * 2 : 4096;
  word *w = realloc(ws->w, sizeof(word) * (size_t)cap);
  const uint8_t **key = realloc(ws->key, sizeof(*key) * (size_t)cap);
  size_t *klen = realloc(ws->klen, sizeof(size_t) * (size_t)cap);
  if (w) ws->w = w;
  if (key) ws->key = key;
  if (klen) ws->klen = klen;
  int32_t *slot = malloc(sizeof(int32_t) * (size_t)cap * 2);
  if (!w || !key || !klen || !slot) {
    free(slot);
    return tr_fail(TR_ENOMEM, "out of memory training the tokenizer");
  }
  memset(slot, 0xff, sizeof(int32_t) * (size_t)cap * 2);
  free(ws->slot);
  ws->slot = slot;
  ws->cap = cap;
  ws->mask = (uint32_t)cap * 2 - 1;
  for (int k = 0; k < ws->n; k++) {
    uint32_t i = (uint32_t)hash_bytes(ws->key[k], ws->klen[k]) & ws->mask;
    while (ws->slot[i] >= 0) i = (i + 1) & ws->mask;
    ws->slot[i] = k;
  }
  return TR_OK;
}

/* Counts one piece: a new distinct piece starts as its bytes. */
static int word_set_add(word_set *ws, const uint8_t *p, size_t n) {
  if (ws->n * 2 >= ws->cap && word_set_grow(ws)) return TR_ENOMEM;
  uint32_t i = (uint32_t)hash_bytes(p, n) & ws->mask;
  for (; ws->slot[i] >= 0; i = (i + 1) & ws->mask) {
    int k = ws->slot[i];
    if (ws->klen[k] == n && memcmp(ws->key[k], p, n) == 0) {
      ws->w[k].count++;
      return TR_OK;
    }
  }
  int32_t *sym = malloc(sizeof(int32_t) * n);
  if (!sym) return tr_fail(TR_ENOMEM, "out of memory training the tokenizer");
  for (size_t j = 0; j < n; j++) sym[j] = p[j];
  int k = ws->n++;
  ws->w[k] = (word){sym, (int)n, 1};
  ws->key[k] = p;
  ws->klen[k] = n;
  ws->slot[i] = k;
  return TR_OK;
}

static void word_set_free(word_set *ws) {
  for (int k = 0; k < ws->n; k++) free(ws->w[k].sym);
  free(ws->w);
  free(ws->key);
  free(ws->klen);
  free(ws->slot);
}

/* --- pair statistics ---
 * Every adjacent pair's count over all words, kept up to date as merges
 * rewrite the words: a merge touches only the words that hold its pair
 * (each pair lists them), and a max-heap with lazy deletion finds the next
 * pair. Ties go to the smallest (a, b). */

typedef struct {
  uint64_t key; /* a << 32 | b; UINT64_MAX: empty */
  int64_t count;
  int32_t *words; /* words that held the pair when it was counted (may repeat or be stale) */
  int nwords, capw;
} pair_ent;

typedef struct {
  int64_t count;
  uint64_t key;
} heap_ent;

typedef struct {
  pair_ent *e;
  uint64_t mask, used;
  heap_ent *h;
  size_t nh, caph;
  int *stamp; /* per word: the last merge that rewrote it */
} pair_stats;

static int pair_table_init(pair_ent **e, uint64_t size) {
  *e = malloc(sizeof(pair_ent) * size);
  if (!*e) return tr_fail(TR_ENOMEM, "out of memory training the tokenizer");
  for (uint64_t i = 0; i < size; i++) (*e)[i] = (pair_ent){UINT64_MAX, 0, NULL, 0, 0};
  return TR_OK;
}

static uint64_t pair_slot(const pair_ent *e, uint64_t mask, uint64_t key) {
  uint64_t i = hash_bytes((const uint8_t *)&key, sizeof key) & mask;
  while (e[i].key != key && e[i].key != UINT64_MAX) i = (i + 1) & mask;
  return i;
}

/* The entry of key, created if absent (NULL: out of memory). */
static pair_ent *pair_get(pair_stats *ps, uint64_t key) {
  if ((ps->used + 1) * 2 > ps->mask + 1) { /* grow: entries move, so callers never keep a pointer */
    uint64_t size = (ps->mask + 1) * 2;
    pair_ent *ne;
    if (pair_table_init(&ne, size)) return NULL;
    for (uint64_t i = 0; i <= ps->mask; i++)
      if (ps->e[i].key != UINT64_MAX) ne[pair_slot(ne, size - 1, ps->e[i].key)] = ps->e[i];
    free(ps->e);
    ps->e = ne;
    ps->mask = size - 1;
  }
  uint64_t i = pair_slot(ps->e, ps->mask, key);
  if (ps->e[i].key == UINT64_MAX) ps->e[i].key = key, ps->used++;
  return &ps->e[i];
}

static int heap_before(const heap_ent *x, const heap_ent *y) {
  return x->count > y->count || (x->count == y->count && x->key < y->key);
}

static int heap_push(pair_stats *ps, int64_t count, uint64_t key) {
  if (ps->nh == ps->caph) {
    size_t cap = ps->caph ? ps->caph * 2 : 4096;
    heap_ent *h = realloc(ps->h, sizeof *h * cap);
    if (!h) return tr_fail(TR_ENOMEM, "out of memory training the tokenizer");
    ps->h = h;
    ps->caph = cap;
  }
  size_t i = ps->nh++;
  ps->h[i] = (heap_ent){count, key};
  while (i && heap_before(&ps->h[i], &ps->h[(i - 1) / 2])) {
    heap_ent t = ps->h[i];
    ps->h[i] = ps->h[(i - 1) / 2];
    ps->h[(i - 1) / 2] = t;
    i = (i - 1) / 2;
  }
  return TR_OK;
}

static heap_ent heap_pop(pair_stats *ps) {
  heap_ent top = ps->h[0];
  ps->h[0] = ps->h[--ps->nh];
  for (size_t i = 0;;) {
    size_t l = 2 * i + 1, r = l + 1, m = i;
    if (l < ps->nh && heap_before(&ps->h[l], &ps->h[m])) m = l;
    if (r < ps->nh && heap_before(&ps->h[r], &ps->h[m])) m = r;
    if (m == i) break;
    heap_ent t = ps->h[i];
    ps->h[i] = ps->h[m];
    ps->h[m] = t;
    i = m;
  }
  return top;
}

/* count += delta for pair key; a gain lists word k under the pair and
 * offers the new count to the heap. */
static int pair_add(pair_stats *ps, uint64_t key, int64_t delta, int k) {
  pair_ent *e = pair_get(ps, key);
  if (!e) return TR_ENOMEM;
  e->count += delta;
  if (delta <= 0) return TR_OK;
  if (e->nwords == e->capw) {
    int cap = e->capw ? e->capw * 2 : 4;
    int32_t *w = realloc(e->words, sizeof(int32_t) * (size_t)cap);
    if (!w) return tr_fail(TR_ENOMEM, "out of memory training the tokenizer");
    e->words = w;
    e->capw = cap;
  }
  e->words[e->nwords++] = k;
  return heap_push(ps, e->count, key);
}

static uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t)a << 32 | (uint32_t)b; }

/* Adds (sign 1) or removes (-1) the pairs of word k. */
static int count_word(pair_stats *ps, const word *w, int k, int sign) {
  int rc = TR_OK;
  for (int j = 0; j + 1 < w->n && !rc; j++) rc = pair_add(ps, pair_key(w->sym[j], w->sym[j + 1]), sign * w->count, k);
  return rc;
}

static int pair_stats_init(pair_stats *ps, const word_set *ws) {
  memset(ps, 0, sizeof *ps);
  ps->mask = 4095;
  ps->stamp = calloc((size_t)ws->n + 1, sizeof(int));
  int rc = ps->stamp ? pair_table_init(&ps->e, ps->mask + 1) : tr_fail(TR_ENOMEM, "out of memory");
  for (int k = 0; k < ws->n && !rc; k++) rc = count_word(ps, &ws->w[k], k, 1);
  return rc;
}

static void pair_stats_free(pair_stats *ps) {
  for (uint64_t i = 0; ps->e && i <= ps->mask; i++) free(ps->e[i].words);
  free(ps->e);
  free(ps->h);
  free(ps->stamp);
}

/* The most frequent pair (0 if none occurs twice). */
static uint64_t best_pair(pair_stats *ps) {
  while (ps->nh) {
    heap_ent top = heap_pop(ps);
    int64_t now = pair_get(ps, top.key)->count; /* the entry exists: it was pushed */
    if (now == top.count) return now > 1 ? top.key : 0;
    if (now > 1 && heap_push(ps, now, top.key)) return 0; /* stale: offer the current count */
  }
  return 0;
}

/* Rewrites every word that holds (a, b) with id in its place. */
static int merge_pair(pair_stats *ps, word_set *ws, uint64_t key, int32_t id, int stamp) {
  pair_ent *e = pair_get(ps, key);
  int32_t *list = e->words; /* taken: pair_add may move the table */
  int n = e->nwords, rc = TR_OK;
  e->words = NULL;
  e->nwords = e->capw = 0;
  int32_t a = (int32_t)(key >> 32), b2 = (int32_t)(key & 0xffffffffu);
  for (int i = 0; i < n && !rc; i++) {
    int k = list[i];
    word *w = &ws->w[k];
    if (ps->stamp[k] == stamp) continue;
    int has = 0;
    for (int j = 0; j + 1 < w->n && !has; j++) has = w->sym[j] == a && w->sym[j + 1] == b2;
    if (!has) continue;
    ps->stamp[k] = stamp;
    rc = count_word(ps, w, k, -1);
    int o = 0;
    for (int j = 0; j < w->n; j++) {
      if (j + 1 < w->n && w->sym[j] == a && w->sym[j + 1] == b2) w->sym[o++] = id, j++;
      else w->sym[o++] = w->sym[j];
    }
    w->n = o;
    if (!rc) rc = count_word(ps, w, k, 1);
  }
  free(list);
  return rc;
}

/* Merges pairs until the table holds `want` tokens or no pair repeats. */
static int train_merges(bpe *b, word_set *ws, int want) {
  pair_stats ps;
  uint8_t *tmp = NULL;
  int rc = pair_stats_init(&ps, ws);
  for (int stamp = 1; !rc && b->n < want; stamp++) {
    uint64_t pair = best_pair(&ps);
    if (!pair) break;
    int32_t x = (int32_t)(pair >> 32), y = (int32_t)(pair & 0xffffffffu);
    size_t lx = (size_t)b->len[x], ly = (size_t)b->len[y];
    uint8_t *t = realloc(tmp, lx + ly);
    if (!t) {
      rc = tr_fail(TR_ENOMEM, "out of memory training the tokenizer");
      break;
    }
    tmp = t;
    memcpy(tmp, b->pool + b->off[x], lx);
    memcpy(tmp + lx, b->pool + b->off[y], ly);
    int id = lookup(b, tmp, lx + ly);
    if (id < 0) {
      id = b->n;
      rc = add_token(b, tmp, lx + ly, 0);
    }
    if (!rc) rc = merge_pair(&ps, ws, pair, id, stamp);
  }
  free(tmp);
  pair_stats_free(&ps);
  return rc;
}

bpe *bpe_train(const char *text, size_t len, int vocab_size) {
  if (vocab_size < 257 || vocab_size > (1 << 20)) {
    tr_fail(TR_EINVAL, "a tokenizer's vocabulary must be 257..1048576 tokens, not %d", vocab_size);
    return NULL;
  }
  bpe *b = bpe_new(vocab_size);
  word_set ws = {0};
  int rc = b ? TR_OK : tr_fail(TR_ENOMEM, "out of memory");
  for (int i = 0; i < 256 && !rc; i++) {
    uint8_t c = (uint8_t)i;
    rc = add_token(b, &c, 1, 0);
  }
  const uint8_t *s = (const uint8_t *)text;
  for (size_t i = 0; i < len && !rc;) {
    size_t e = next_piece(s, len, i);
    rc = word_set_add(&ws, s + i, e - i);
    i = e;
  }
  if (!rc) rc = train_merges(b, &ws, vocab_size - 1);
  if (!rc) rc = add_token(b, (const uint8_t *)"<|endoftext|>", 13, 1);
  word_set_free(&ws);
  if (rc) {
    bpe_free(b);
    return NULL;
  }
  return b;
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
    if (m <= 0 || rank != b->n || (*after != '\n' && *after) || lookup(b, tmp, (size_t)m) >= 0) {
      tr_fail(TR_EFORMAT, "%s:%d: expected 'BASE64 %d' (a tiktoken file, ranks in order)", path, line, b->n);
      goto fail;
    }
    if (add_token(b, tmp, (size_t)m, 0)) goto fail;
    p = *after ? after + 1 : after;
  }
  if (lookup(b, (const uint8_t *)"<|endoftext|>", 13) < 0 && add_token(b, (const uint8_t *)"<|endoftext|>", 13, 1))
    goto fail;
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
    if (*p != '\n' || m == 0 || lookup(b, tmp, m) >= 0) {
      tr_fail(TR_EFORMAT, "%s:%d: a token is lowercase hex bytes, each token once", path, id + 2);
      goto fail;
    }
    if (add_token(b, tmp, m, special)) goto fail;
  }
  free(tmp);
  free(s);
  return b;
fail:
  free(tmp);
  free(s);
  bpe_free(b);
  return NULL;
}
