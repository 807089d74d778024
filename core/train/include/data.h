/* data.h — the training corpus: byte-level text or token shards, the
 * train/val split, batches.
 *
 * Text (any file): tokens are bytes; the vocabulary is the sorted set of byte
 * values that occur in the corpus, so any file works (ASCII text gives the
 * familiar 65-symbol Shakespeare vocabulary; UTF-8 is modelled byte by byte).
 * The first 90% of the tokens train, the last 10% validate.
 *
 * Token shards (already tokenized, e.g. GPT-2 BPE): llm.c's `.bin` shards (a
 * 256 x int32 header: magic 20240520, version 1 = uint16 tokens or 2 = uint32,
 * token count; then the tokens) and nanoGPT's headerless uint16 files
 * (train.bin, val.bin). `data` names one file, a glob, or several of either
 * separated by newlines (the job's list form); the files are memory-mapped,
 * not copied. The vocabulary size comes from the job; the model sees it
 * padded to a multiple of 128, as llm.c pads GPT-2's 50257 to 50304. Without
 * `val_data` the last 10% of the tokens (over all shards, in order) validate.
 *
 * Batches are drawn at random offsets from a caller-owned rng_t: the data
 * position is that generator's state, explicit so a checkpoint can save it.
 * A sequence never crosses a shard boundary: a batch row picks a start
 * uniformly among all valid starts of all shards of the split, so the stream
 * is a pure function of the generator over any number of shards.
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

/* A run of tokens inside one file: base[0..n), elements of `width` bytes. */
typedef struct {
  const void *base;
  int width; /* 2 (uint16), 4 (int32/uint32) */
  int64_t n;
} data_seg;

typedef struct {
  void *p;
  size_t len;
} data_map;

enum { DATA_BYTES = 0, DATA_TOKENS = 1 };

typedef struct {
  int kind;           /* DATA_BYTES or DATA_TOKENS */
  vocab voc;          /* bytes: the corpus's vocabulary */
  int64_t vocab_size; /* tokens: ids are < vocab_size (bytes: voc.size) */
  int64_t model_vocab; /* the model's V: voc.size, or vocab_size padded to 128 */
  int32_t *ids;       /* bytes: the whole corpus as token ids */
  data_map *maps;     /* tokens: the mapped files */
  int nmaps;
  data_seg *seg[2];   /* per split: its runs of tokens */
  int nseg[2];
  int64_t starts[2];  /* per split: valid batch-row starts over all its runs */
  int64_t n;
  int64_t n_train;    /* tokens: train, n - n_train: validate */
  int block;
} dataset;

enum { SPLIT_TRAIN = 0, SPLIT_VAL = 1 };

/* What the job says about its data. */
typedef struct {
  const char *data;      /* a file, a glob, or several separated by '\n' */
  const char *val_data;  /* the same for validation, or NULL/"" */
  const char *format;    /* "auto" (token files by name: *.bin), "text", "llmc", "uint16" */
  int64_t vocab_size;    /* token files: the vocabulary (0 = not given) */
  int block;             /* context length: every split needs a run longer than block+1 */
} data_spec;

/* Loads what spec names. Errors (negative, tr_error() set) name the file:
 * no match for a glob, wrong magic or version, a truncated shard, a token
 * >= vocab_size (with its index), a corpus too small for the block. */
int dataset_open(dataset *d, const data_spec *spec);
/* The byte-level corpus of one text file (dataset_open with format "text"). */
int dataset_load(dataset *d, const char *path, int block);
void dataset_free(dataset *d);
/* Pads a vocabulary for the kernels: up to a multiple of 128. */
int64_t data_padded_vocab(int64_t v);

/* x, y are (B,T); y is x shifted by one. */
void dataset_batch(const dataset *d, int split, rng_t *r, int B, int T, int32_t *x, int32_t *y);

/* Vocabulary as JSON: {"type":"bytes","tokens":[10,32,...]}, or for token
 * data {"type":"tokens","vocab_size":50257} (vocab_load_any then gives
 * size 0 and *vocab_size; bytes give *vocab_size = size; vocab_load reads
 * bytes only). Read by their top-level keys (json_top.h): TR_EFORMAT names
 * the file and the key (a key twice, a type other than those two, a token
 * that is not a byte 0..255, vocab_size not a positive integer). */
int vocab_save(const vocab *v, const char *path);
int vocab_save_tokens(int64_t vocab_size, const char *path);
int vocab_load(vocab *v, const char *path);
int vocab_load_any(vocab *v, int64_t *vocab_size, const char *path);
/* Encodes text into ids; fails naming the first byte not in the vocabulary. */
int vocab_encode(const vocab *v, const char *text, size_t len, int32_t *out);

#endif
