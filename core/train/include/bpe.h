/* bpe.h — a byte-level BPE tokenizer (GPT-2's scheme): train, encode, decode.
 *
 * Text is first split into pieces as GPT-2 splits it (contractions, an
 * optional space + a run of letters, of digits, of other symbols, runs of
 * white space; bytes >= 0x80 count as letters), then each piece's bytes are
 * merged pairwise, always the pair whose joined bytes are the token of the
 * lowest id, as tiktoken does: the ids are the merge ranks. Ids 0..255 need
 * not be the single bytes in order (GPT-2's are permuted); a special token
 * (<|endoftext|>) is never produced by merging.
 *
 * File format (tokenizer.bpe, text): a first line "transom-bpe 1 N", then N
 * lines, line i is token i: its bytes in hex, or "!" and hex for a special
 * token. `transom prepare` trains one on a corpus and writes it beside the
 * shards; `transom sample` decodes with the copy in the run.
 *
 * Objects are immutable after creation: any thread may encode and decode.
 */
#ifndef TRANSOM_BPE_H
#define TRANSOM_BPE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct bpe bpe;

/* Trains on text: the 256 bytes, then merges of the most frequent adjacent
 * pair (ties: the smaller ids) until vocab_size - 1 tokens, then
 * <|endoftext|> as the last id. vocab_size must be in 257..1048576. NULL
 * with tr_error() set on failure. */
bpe *bpe_train(const char *text, size_t len, int vocab_size);
/* Reads a tokenizer.bpe file, or a tiktoken file ("BASE64 RANK" a line,
 * ranks 0.. in order, as GPT-2's gpt2.tiktoken: then <|endoftext|> is added
 * as the next id, 50256 for GPT-2). Errors name the file and line; a file
 * without a (non-special) token for each of the 256 bytes is refused,
 * naming the first byte missing. */
bpe *bpe_load(const char *path);
int bpe_save(const bpe *b, const char *path);
void bpe_free(bpe *b);

int64_t bpe_vocab_size(const bpe *b);
/* The id of <|endoftext|>, or -1. */
int bpe_eot(const bpe *b);
/* Encodes text into out[0..cap) (at most len + eot_first ids are produced),
 * *n = how many; eot_first puts <|endoftext|> first (as GPT-2 starts a
 * document). TR_EINVAL if cap is too small, or if the text holds a byte
 * with no token (only a tokenizer built by hand can lack one: bpe_load and
 * bpe_train never return such a tokenizer). */
int bpe_encode(const bpe *b, const char *text, size_t len, int32_t *out, int64_t cap, int64_t *n, int eot_first);
/* Writes token id's bytes to out (nothing for an id out of range). */
void bpe_decode(const bpe *b, int id, FILE *out);

#endif
