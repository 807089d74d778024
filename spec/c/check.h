/* check.h — the tiny assertion layer of the C tests: CHECK counts failures
 * and prints file:line; main returns check_report(). grad_compare prints the
 * first mismatches between analytic and numeric gradients (llm.c style). */
#ifndef TRANSOM_CHECK_H
#define TRANSOM_CHECK_H

#include <math.h>
#include <stdio.h>

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
