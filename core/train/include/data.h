/* data.h — the character-level corpus: tokenizer, train/val split, batches.
 *
 * Tokens are bytes: the vocabulary is the sorted set of byte values that occur
 * in the corpus, so any file works (ASCII text gives the familiar 65-symbol
 * Shakespeare vocabulary; UTF-8 text is modelled byte by byte). The first 90%
 * of the tokens train, the last 10% validate.
 *
 * Batches are drawn at random offsets from a caller-owned rng_t: the data
 * position is that generator's state, explicit so a checkpoint can save it.
 */
#ifndef TRANSOM_DATA_H
#define TRANSOM_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "rng.h"

typedef struct {
  int size;              /* V */
  uint8_t byte_of[256];  /* token id -> byte */
  int16_t id_of[256];    /* byte -> token id, -1 if absent */
} vocab;

typedef struct {
  vocab voc;
  int32_t *ids; /* the whole corpus as token ids */
  int64_t n;
  int64_t n_train; /* ids[0..n_train) train, ids[n_train..n) validate */
} dataset;

enum { SPLIT_TRAIN = 0, SPLIT_VAL = 1 };

/* Loads and tokenizes a file; each split must hold more than block+1 tokens.
 * Returns 0 or a negative code with tr_error() set (naming the file). */
int dataset_load(dataset *d, const char *path, int block);
void dataset_free(dataset *d);

/* x, y are (B,T); y is x shifted by one. */
void dataset_batch(const dataset *d, int split, rng_t *r, int B, int T, int32_t *x, int32_t *y);

/* Vocabulary as JSON: {"type":"bytes","tokens":[10,32,...]} */
int vocab_save(const vocab *v, const char *path);
int vocab_load(vocab *v, const char *path);
/* Encodes text into ids; fails naming the first byte not in the vocabulary. */
int vocab_encode(const vocab *v, const char *text, size_t len, int32_t *out);

#endif
