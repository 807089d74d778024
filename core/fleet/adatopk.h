/* adatopk.h — AdaTopK: top-k sparsification of what crosses a pipeline
 * link, with k adapted per link (private to core/fleet; used by
 * pipeline_stage.c).
 *
 * Encodings, by the bytes per entry the link can afford: 4 or more, the raw
 * float32 tensor (codec 0); 2 to 4, every entry as bf16 (ADATOPK_BF16: a
 * relative error of 2^-8, nothing dropped); below 2, the k entries of
 * largest magnitude as (uint32 index, bf16 value) pairs, 6 bytes each,
 * after a 16-byte header, the rest zero at the receiver (ADATOPK_CODEC).
 * With error feedback (gradients) whatever the receiver does not get (the
 * dropped entries, the bf16 rounding) is added to the next message.
 *
 * The controller (adatopk_density): a link carries, per micro-batch, the
 * activations forward and their gradients back; each direction gets half of
 * the compute time the sender spends per micro-batch (forward + backward),
 * the time a transfer can hide behind in 1F1B's steady state. The density
 * is the largest that fits that budget at the link's bandwidth (measured:
 * the probe at start, then an average of the sends themselves), never
 * below the direction's floor:
 *
 *   density = clamp((bandwidth * compute / 2) / (6 * n), floor, 1)
 *
 * Plain data and pure functions; any thread.
 */
#ifndef TRANSOM_ADATOPK_H
#define TRANSOM_ADATOPK_H

#include <stddef.h>
#include <stdint.h>

#define ADATOPK_CODEC 1 /* top-k: (uint32 index, bf16 value) pairs */
#define ADATOPK_BF16 2  /* every value, as bf16 */
#define ADATOPK_HEADER 16

/* Bytes an encoding of k of n entries takes. */
size_t adatopk_bytes(int64_t k);

/* Encodes the k largest |x[i]| of x[0..n) into out (adatopk_bytes(k)
 * bytes), chosen among the finite entries only: with fewer than k finite,
 * all of them, and the message says how many (none: a message of zeros).
 * residual (NULL: none): error feedback: x + residual is encoded and
 * residual becomes what the receiver will not see (x + residual -
 * decoded), except that it never keeps a NaN or Inf (that entry is
 * dropped: 0); x is left as it was. scratch: n floats. Returns the bytes
 * written (adatopk_bytes of the entries sent). */
size_t adatopk_encode(const float *x, float *residual, int64_t n, int64_t k, float *scratch, void *out);

/* Decodes bytes of in into x[0..n) (zeros elsewhere). 0, or a negative
 * error if the encoding is not one of n entries. */
int adatopk_decode(const void *in, size_t bytes, float *x, int64_t n);
/* The same for either codec (ADATOPK_CODEC, ADATOPK_BF16); any other
 * codec is an error (never decoded as something else). */
int adatopk_decode_any(int codec, const void *in, size_t bytes, float *x, int64_t n);

/* Dense bf16 (ADATOPK_BF16): 2 bytes an entry after the header (a finite
 * value stays finite: above bf16's range it is the largest bf16; NaN and
 * Inf go as they are); residual as for adatopk_encode, never non-finite.
 * Returns the bytes written. */
size_t adatopk_encode_bf16(const float *x, float *residual, int64_t n, void *out);

/* Which encoding for a density d (adatopk_density) and floor: *codec 0
 * (raw), ADATOPK_BF16 or ADATOPK_CODEC with *k entries. */
void adatopk_choose(double d, double floor, int64_t n, int *codec, int64_t *k);

/* The controller above: the fraction of n to keep. bandwidth in bytes/s
 * (<= 0: unknown, keep everything), compute_s the sender's compute per
 * micro-batch, floor the smallest density allowed. */
double adatopk_density(double bandwidth, double compute_s, int64_t n, double floor);

#endif
