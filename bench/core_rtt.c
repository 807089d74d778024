/* core_rtt.c — the round trip of one cache line between two CPUs, for the
 * FTAR bench scripts: shared-memory figures depend on whether the two cores
 * share a cache. On the 2-vCPU VMs here the hypervisor moves the vCPUs, and
 * the round trip flips between about 55 ns (a shared L3) and about 320 ns
 * (none) from minute to minute; ring copies through shared memory moved 3-4x
 * apart between the two. The scripts print it beside each run.
 *
 *   core_rtt [CPU_A CPU_B]      (default 0 1)
 *
 * Prints "core-rtt cpus=A,B ns=N" (median of 7 rounds of 20000 trips).
 * Not part of the transom build: the bench scripts compile it with cc.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { TRIPS = 20000, ROUNDS = 7 };

static _Atomic long ball __attribute__((aligned(64)));

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Returns every odd value as the next even one (pinned at its creation). */
static void *echo(void *arg) {
  (void)arg;
  for (long i = 0; i < (long)TRIPS * ROUNDS; i++) {
    while (atomic_load_explicit(&ball, memory_order_acquire) != 2 * i + 1) {
    }
    atomic_store_explicit(&ball, 2 * i + 2, memory_order_release);
  }
  return NULL;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  int cpu[2] = {argc > 2 ? atoi(argv[1]) : 0, argc > 2 ? atoi(argv[2]) : 1};
  cpu_set_t s[2];
  for (int k = 0; k < 2; k++) {
    CPU_ZERO(&s[k]);
    CPU_SET(cpu[k], &s[k]);
  }
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_t t;
  if (pthread_setaffinity_np(pthread_self(), sizeof s[0], &s[0]) != 0 ||
      pthread_attr_setaffinity_np(&at, sizeof s[1], &s[1]) != 0 || pthread_create(&t, &at, echo, NULL) != 0) {
    fprintf(stderr, "core_rtt: cannot run on CPUs %d and %d\n", cpu[0], cpu[1]);
    return 1;
  }
  double ns[ROUNDS];
  long i = 0;
  for (int r = 0; r < ROUNDS; r++) {
    double t0 = now();
    for (long k = 0; k < TRIPS; k++, i++) {
      atomic_store_explicit(&ball, 2 * i + 1, memory_order_release);
      while (atomic_load_explicit(&ball, memory_order_acquire) != 2 * i + 2) {
      }
    }
    ns[r] = (now() - t0) / TRIPS * 1e9;
  }
  pthread_join(t, NULL);
  qsort(ns, ROUNDS, sizeof ns[0], cmp);
  printf("core-rtt cpus=%d,%d ns=%.0f\n", cpu[0], cpu[1], ns[ROUNDS / 2]);
  return 0;
}
