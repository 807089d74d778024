/* bpe_internal.h — what bpe.c shares with bpe_train.c: the tokenizer's
 * layout and its table helpers. Nothing outside core/train/bpe*.c includes
 * it. */
#ifndef TRANSOM_BPE_INTERNAL_H
#define TRANSOM_BPE_INTERNAL_H

#include "bpe.h"

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

uint64_t bpe_hash_bytes(const uint8_t *p, size_t n);
/* The id of these bytes, or -1. */
int bpe_lookup(const bpe *b, const uint8_t *p, size_t n);
/* Appends a token (the tables are sized for bpe_new's cap). */
int bpe_add_token(bpe *b, const uint8_t *p, size_t n, int special);
/* An empty tokenizer with room for cap tokens (NULL: out of memory). */
bpe *bpe_new(int cap);
/* Encodes one piece of n bytes both ways (the short pieces' rescan and the
 * long pieces' heap: bpe.c), into out_short and out_long (n ids each at
 * most); tests check that they agree. 0, or an error. */
int bpe_encode_piece_paths(const bpe *b, const uint8_t *p, size_t n, int32_t *out_short, int32_t *out_long,
                           int64_t *n_short, int64_t *n_long);
/* The end of GPT-2's pre-tokenizer piece that starts at i. */
size_t bpe_next_piece(const uint8_t *s, size_t len, size_t i);

#endif
