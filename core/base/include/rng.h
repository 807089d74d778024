/* rng.h — the seeded random number generator used everywhere in transom.
 *
 * The whole state is one uint64_t (splitmix64), so it is trivially saved in a
 * checkpoint and restored: determinism and resume depend on it. Not for
 * cryptography.
 */
#ifndef TRANSOM_RNG_H
#define TRANSOM_RNG_H

#include <stdint.h>

typedef struct { uint64_t state; } rng_t;

static inline void rng_seed(rng_t *r, uint64_t seed) { r->state = seed; }

static inline uint64_t rng_u64(rng_t *r) {
  uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* uniform in [0, 1) with 24 random bits */
static inline float rng_uniform(rng_t *r) { return (float)(rng_u64(r) >> 40) / 16777216.0f; }

/* uniform integer in [0, n), n > 0 */
static inline uint64_t rng_below(rng_t *r, uint64_t n) { return rng_u64(r) % n; }

/* standard normal (Box-Muller, one value per call) */
float rng_normal(rng_t *r);

#endif
