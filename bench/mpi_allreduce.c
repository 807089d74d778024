/* mpi_allreduce.c — the baseline for bench/ftar_vs_mpi.sh: MPI_Allreduce
 * (float32, sum, in place) over the same sizes and iteration counts as
 * `transom ftar-bench`, timed the same way (warm-up, then the slowest rank's
 * time for the measured iterations).
 *
 *   mpirun -np N ./mpi_allreduce [--iters N|auto] [--warmup N] SIZE...
 *
 * SIZE in bytes, K/M/G suffixes. Prints, on rank 0, one line per size:
 *   mpi-bw ranks=N bytes=B iters=K us=T algbw=X busbw=Y
 * with busbw = algbw * 2(n-1)/n (nccl-tests' convention). Not part of the
 * transom build: the bench script compiles it with mpicc.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t parse_size(const char *s) {
  char *end;
  uint64_t v = strtoull(s, &end, 10);
  if (*end == 'K' || *end == 'k') v <<= 10;
  else if (*end == 'M' || *end == 'm') v <<= 20;
  else if (*end == 'G' || *end == 'g') v <<= 30;
  return v;
}

/* Same rule as ftar_bench.c: about 512 MiB of payload, 5..1000 iterations. */
static int auto_iters(uint64_t bytes) {
  uint64_t k = ((uint64_t)512 << 20) / (bytes ? bytes : 1);
  return k < 5 ? 5 : k > 1000 ? 1000 : (int)k;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  int iters = 0, warmup = 2;
  uint64_t sizes[64];
  int nsizes = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      i++;
      iters = strcmp(argv[i], "auto") == 0 ? 0 : atoi(argv[i]);
    } else if (strcmp(argv[i], "--warmup") == 0 && i + 1 < argc) {
      warmup = atoi(argv[++i]);
    } else if (nsizes < 64) {
      sizes[nsizes++] = parse_size(argv[i]);
    }
  }
  uint64_t maxb = 4;
  for (int i = 0; i < nsizes; i++)
    if (sizes[i] > maxb) maxb = sizes[i];
  float *buf = malloc(maxb);
  if (!buf) {
    fprintf(stderr, "mpi_allreduce: out of memory\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  for (uint64_t i = 0; i < maxb / 4; i++) buf[i] = (float)(rank + 1);
  for (int s = 0; s < nsizes; s++) {
    int count = (int)(sizes[s] / 4);
    int it = iters > 0 ? iters : auto_iters(sizes[s]);
    for (int w = 0; w < warmup; w++) MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int k = 0; k < it; k++) MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double t = MPI_Wtime() - t0, worst;
    MPI_Reduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      double per = worst / it, alg = (double)sizes[s] / per / 1e9;
      printf("mpi-bw ranks=%d bytes=%llu iters=%d us=%.3f algbw=%.4f busbw=%.4f\n", n, (unsigned long long)sizes[s], it,
             per * 1e6, alg, alg * 2.0 * (n - 1) / n);
      fflush(stdout);
    }
  }
  free(buf);
  MPI_Finalize();
  return 0;
}
