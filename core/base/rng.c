/* rng.c — the normal sampler for rng.h. */
#include "rng.h"

#include <math.h>

float rng_normal(rng_t *r) {
  double u1 = ((double)(rng_u64(r) >> 11) + 1.0) / 9007199254740993.0; /* (0,1] */
  double u2 = (double)(rng_u64(r) >> 11) / 9007199254740992.0;
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}
