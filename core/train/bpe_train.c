/* bpe_train.c — training a byte-level BPE on a corpus (bpe_train, see
 * bpe.h): the corpus's distinct pieces with their counts, then merges of the
 * most frequent adjacent pair, with the pair counts kept up to date. Called
 * by `transom prepare` (core/cli/prepare.c). */
#include <stdlib.h>
#include <string.h>

#include "bpe.h"
#include "bpe_internal.h"
#include "util.h"

/* --- the corpus's pieces --- */

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
    uint32_t i = (uint32_t)bpe_hash_bytes(ws->key[k], ws->klen[k]) & ws->mask;
    while (ws->slot[i] >= 0) i = (i + 1) & ws->mask;
    ws->slot[i] = k;
  }
  return TR_OK;
}

/* Counts one piece: a new distinct piece starts as its bytes. */
static int word_set_add(word_set *ws, const uint8_t *p, size_t n) {
  if (ws->n * 2 >= ws->cap && word_set_grow(ws)) return TR_ENOMEM;
  uint32_t i = (uint32_t)bpe_hash_bytes(p, n) & ws->mask;
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
  uint64_t i = bpe_hash_bytes((const uint8_t *)&key, sizeof key) & mask;
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
    int id = bpe_lookup(b, tmp, lx + ly);
    if (id < 0) {
      id = b->n;
      rc = bpe_add_token(b, tmp, lx + ly, 0);
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
    rc = bpe_add_token(b, &c, 1, 0);
  }
  const uint8_t *s = (const uint8_t *)text;
  for (size_t i = 0; i < len && !rc;) {
    size_t e = bpe_next_piece(s, len, i);
    rc = word_set_add(&ws, s + i, e - i);
    i = e;
  }
  if (!rc) rc = train_merges(b, &ws, vocab_size - 1);
  if (!rc) rc = bpe_add_token(b, (const uint8_t *)"<|endoftext|>", 13, 1);
  word_set_free(&ws);
  if (rc) {
    bpe_free(b);
    return NULL;
  }
  return b;
}

