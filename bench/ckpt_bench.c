/* ckpt_bench.c — what a checkpoint costs training, measured against
 * baselines in the same process (ratios, never lone absolute times):
 *
 *   1. step time with a checkpoint every step / without (blocks of steps,
 *      interleaved A B A B so drift hits both alike);
 *   2. training-thread stall per checkpoint (snapshot call + wait before the
 *      optimizer) / a synchronous save of the same bytes (write + fsync; on a
 *      device backend, --set device=cuda, plus the download of the state);
 *   3. LMDB commit throughput (CRC32C + one write transaction + sync) / raw
 *      sequential write + fdatasync of the same bytes;
 *   4. load throughput (verify every CRC + copy) / memcpy of the same bytes.
 *
 * usage: ckpt_bench JOB.lua DATA DIR [--set key=value]...   (DIR: scratch)
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt.h"
#include "job.h"
#include "lua_host.h"
#include "trainer.h"
#include "util.h"

#define BLOCK 8   /* steps per block */
#define ROUNDS 3  /* A B pairs */

static double write_file(const char *path, const void *buf, size_t n, int data_only) {
  double t0 = tr_now();
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return -1;
  const char *p = buf;
  size_t left = n;
  while (left > 0) {
    ssize_t w = write(fd, p, left > (1u << 24) ? (1u << 24) : left);
    if (w <= 0) return -1;
    p += w;
    left -= (size_t)w;
  }
  if ((data_only ? fdatasync(fd) : fsync(fd)) != 0) return -1;
  close(fd);
  double dt = tr_now() - t0;
  unlink(path);
  return dt;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: ckpt_bench JOB.lua DATA DIR [--set key=value]...\n");
    return 2;
  }
  const char *sets[64];
  int nsets = 0;
  char data[1200], rundir[1200];
  snprintf(data, sizeof data, "data=%s", argv[2]);
  sets[nsets++] = data;
  sets[nsets++] = "eval_interval=0";
  for (int i = 4; i + 1 < argc && nsets < 60; i += 2)
    if (strcmp(argv[i], "--set") == 0) sets[nsets++] = argv[i + 1];
  lua_State *L = lua_host_new();
  job_config cfg;
  if (!L || job_load(L, argv[1], sets, nsets, &cfg)) {
    fprintf(stderr, "ckpt_bench: %s\n", tr_error());
    return 1;
  }
  trainer *t = trainer_create(L, &cfg);
  if (!t) {
    fprintf(stderr, "ckpt_bench: %s\n", tr_error());
    return 1;
  }
  snprintf(rundir, sizeof rundir, "%s/ckpt", argv[3]);
  if (system("true") != 0) return 1;
  char rm[1300];
  snprintf(rm, sizeof rm, "rm -rf '%s'", rundir);
  if (system(rm) != 0) return 1;
  ckpt_opts o = {rundir, 0, 2, 0, CKPT_COALESCE};
  ckpt_engine *e = ckpt_open(&o);
  if (!e || trainer_ckpt_attach(t, e)) {
    fprintf(stderr, "ckpt_bench: %s\n", tr_error());
    return 1;
  }
  step_stats st;
  trainer_step(t, &st); /* warm-up: caches, thread pools, first-touch */
  double off_s = 0, on_s = 0, stall_s = 0;
  int snaps = 0;
  for (int round = 0; round < ROUNDS; round++) {
    for (int mode = 0; mode < 2; mode++) {
      for (int i = 0; i < BLOCK; i++) {
        double w0 = tr_now(); /* as the training loop does: wait for a running copy before the update */
        trainer_compute_grads(t, &st);
        st.t_ckpt_wait = ckpt_wait_copy(e);
        trainer_apply_grads(t, &st);
        st.t_total = tr_now() - w0;
        double t0 = tr_now();
        if (mode == 1) {
          ckpt_state s;
          trainer_ckpt_state(t, &s);
          ckpt_snapshot(e, &s);
          snaps++;
        }
        double snap = tr_now() - t0;
        if (mode == 1) {
          on_s += st.t_total + snap;
          stall_s += snap + st.t_ckpt_wait;
        } else {
          off_s += st.t_total;
        }
      }
      if (mode == 1) { /* let the writer finish outside the timed blocks */
        ckpt_flush(e);
      }
    }
  }
  ckpt_flush(e);
  ckpt_stats cs;
  ckpt_get_stats(e, &cs);
  uint64_t bytes = cs.bytes_per_snapshot;
  double commit_bps = cs.committed ? (double)bytes * cs.committed / cs.commit_s : 0;
  printf("model: %lld parameters | state per checkpoint %.1f MiB | %d snapshots: %llu committed, %llu coalesced, "
         "%llu skipped\n",
         (long long)graph_nparams(trainer_graph(t)), bytes / 1048576.0, snaps, (unsigned long long)cs.committed,
         (unsigned long long)cs.coalesced, (unsigned long long)cs.skipped);

  /* baselines on the same bytes */
  void *buf = tr_alloc_aligned(bytes), *buf2 = tr_alloc_aligned(bytes);
  memset(buf, 7, bytes);
  char path[1300];
  snprintf(path, sizeof path, "%s/sync-save.bin", argv[3]);
  double pull_s = 0;
  if (strcmp(cfg.device, "cpu") != 0) { /* a synchronous save from a device downloads the state first */
    double p0 = tr_now();
    if (trainer_pull(t, 1)) fprintf(stderr, "ckpt_bench: %s\n", tr_error());
    pull_s = tr_now() - p0;
  }
  double sync_s = write_file(path, buf, bytes, 0) + pull_s;
  double raw_s = write_file(path, buf, bytes, 1);
  double mc = tr_now();
  memcpy(buf2, buf, bytes);
  double memcpy_s = tr_now() - mc;

  /* load: verify + copy the newest checkpoint into the trainer */
  ckpt_reader *r = ckpt_engine_reader(e);
  char report[1024];
  double l0 = tr_now();
  int lrc = trainer_ckpt_load(t, r, -1, report, sizeof report);
  double load_s = tr_now() - l0;
  ckpt_reader_close(r);
  if (lrc) fprintf(stderr, "ckpt_bench: load: %s\n", tr_error());

  double step_off = off_s / (ROUNDS * BLOCK), step_on = on_s / (ROUNDS * BLOCK);
  printf("step time:   %.1f ms with a checkpoint every step, %.1f ms without\n", step_on * 1e3, step_off * 1e3);
  printf("stall:       %.3f ms per checkpoint; synchronous save (%swrite+fsync) %.1f ms\n", stall_s / snaps * 1e3,
         pull_s > 0 ? "download+" : "", sync_s * 1e3);
  printf("commit:      %.0f MiB/s (CRC32C + LMDB txn + sync); raw write+fdatasync %.0f MiB/s\n",
         commit_bps / 1048576.0, bytes / raw_s / 1048576.0);
  printf("load:        %.0f MiB/s (verify + copy); memcpy %.0f MiB/s\n", bytes / load_s / 1048576.0,
         bytes / memcpy_s / 1048576.0);
  printf("RATIO step_with_ckpt/step_without = %.3f (target <= 1.03)\n", step_on / step_off);
  printf("RATIO stall/sync_save = %.4f (target <= 0.05)\n", stall_s / snaps / sync_s);
  printf("RATIO lmdb_commit/raw_write = %.2f (target >= 0.5)\n", commit_bps / (bytes / raw_s));
  printf("RATIO load/memcpy = %.3f\n", (bytes / load_s) / (bytes / memcpy_s));
  tr_free_aligned(buf);
  tr_free_aligned(buf2);
  ckpt_close(e);
  trainer_free(t);
  lua_host_close(L);
  return 0;
}
