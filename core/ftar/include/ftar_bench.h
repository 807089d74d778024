/* ftar_bench.h — `transom ftar-bench`: the standalone FTAR driver (a
 * coordinator plus N rank processes on 127.0.0.1) used by the benchmark and
 * the fault-injection tests. See ftar_bench.c for the modes. */
#ifndef TRANSOM_FTAR_BENCH_H
#define TRANSOM_FTAR_BENCH_H

/* argv[0] is the first argument after "ftar-bench". Returns the process exit
 * status (0 ok, 1 failure, 2 bad usage). Main thread only. */
int ftar_bench_main(int argc, char **argv);

#endif
