/* check.h — the tiny assertion layer of the C tests: CHECK counts failures
 * and prints file:line; main returns check_report(). grad_compare prints the
 * first mismatches between analytic and numeric gradients (llm.c style).
 * test_time_scale and test_small are the two knobs of the sanitizer passes
 * (test.sh). */
#ifndef TRANSOM_CHECK_H
#define TRANSOM_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int check_failures, check_total;

#define CHECK(cond, ...)                                          \
  do {                                                            \
    check_total++;                                                \
    if (!(cond)) {                                                \
      check_failures++;                                           \
      fprintf(stderr, "%s:%d: FAILED: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                               \
      fputc('\n', stderr);                                        \
    }                                                             \
  } while (0)

static inline int check_report(const char *name) {
  printf("%s: %d checks, %d failed\n", name, check_total, check_failures);
  return check_failures ? 1 : 0;
}

/* TRANSOM_TIME_SCALE (default 1, never below): a slower build (the
 * sanitizers) multiplies a test's own waits and the slack of its latency
 * bounds by it. The deadlines a test gives the product stay as they are:
 * what is measured is still the product's reaction to them. */
static inline double test_time_scale(void) {
  const char *s = getenv("TRANSOM_TIME_SCALE");
  double x = s && *s ? atof(s) : 1.0;
  return x > 1.0 ? x : 1.0;
}

/* TRANSOM_TEST_SMALL=1: the data-heavy tests (test_ftar, test_ftar_dev,
 * test_ckpt) move smaller buffers. Under ThreadSanitizer, what they check
 * is how threads meet, which a 64 MiB all-reduce shows no better than a
 * 256 KiB one; each test says what it shrinks. */
static inline int test_small(void) {
  const char *s = getenv("TRANSOM_TEST_SMALL");
  return s && *s && strcmp(s, "0") != 0;
}

/* |a - n| <= atol + rtol * max(|a|, |n|) elementwise; prints up to 5
 * mismatches. Returns the number of mismatches. */
static inline int grad_compare(const char *what, const float *analytic, const double *numeric, int n, double atol,
                        double rtol) {
  int bad = 0;
  double worst = 0;
  for (int i = 0; i < n; i++) {
    double a = analytic[i], m = numeric[i];
    double err = fabs(a - m), lim = atol + rtol * fmax(fabs(a), fabs(m));
    if (err / lim > worst) worst = err / lim;
    if (err > lim) {
      if (bad < 5) fprintf(stderr, "  %s[%d]: analytic %.6g numeric %.6g\n", what, i, a, m);
      bad++;
    }
  }
  check_total++;
  if (bad) {
    check_failures++;
    fprintf(stderr, "%s: %d of %d gradients off (worst err/limit %.2f)\n", what, bad, n, worst);
  }
  return bad;
}

#endif
