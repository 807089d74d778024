/* ckpt_bench.c — what a checkpoint costs training, measured against
 * baselines in the same process (ratios, never lone absolute times):
 *
 *   1. step time with a checkpoint every step / without (blocks of steps,
 *      interleaved A B A B so drift hits both alike), and how many of the
 *      snapshots were committed (the rest coalesced or skipped);
 *   2. training-thread stall per checkpoint (snapshot call + wait before the
 *      optimizer) / a synchronous save of the same bytes (write + fsync; on a
 *      device backend, --set device=cuda, plus the download of the state);
 *   3. LMDB commit throughput (CRC32C + one write transaction + sync, the
 *      engine's own commit with training paused) / raw sequential write +
 *      fdatasync of the same bytes, interleaved A B A B;
 *   4. load (verify every CRC + copy into the model) with the store in the
 *      page cache / memcpy of the same bytes; and with the page cache
 *      dropped (root only: /proc/sys/vm/drop_caches) / a raw read() of a
 *      file of the same size, also cold;
 *   5. with --remote, the background replication: how long the newest
 *      checkpoint took to reach the remote store at the configured rate.
 *
 * usage: ckpt_bench JOB.lua DATA DIR [--set key=value]...   (DIR: scratch)
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "ckpt.h"
#include "job.h"
#include "lua_host.h"
#include "trainer.h"
#include "util.h"

#define BLOCK 8   /* steps per block */
#define ROUNDS 3  /* A B pairs */

static double write_file(const char *path, const void *buf, size_t n, int data_only, int keep) {
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
  if (!keep) unlink(path);
  return dt;
}

static double read_file(const char *path, void *buf, size_t n) {
  double t0 = tr_now();
  int fd = open(path, O_RDONLY);
  if (fd < 0) return -1;
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, (char *)buf + got, n - got > (1u << 24) ? (1u << 24) : n - got);
    if (r <= 0) break;
    got += (size_t)r;
  }
  close(fd);
  return got == n ? tr_now() - t0 : -1;
}

/* CPU seconds this process used so far (every thread, user + system). */
static double process_cpu(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
         ru.ru_stime.tv_usec * 1e-6;
}

/* 1 when the page cache could be dropped (root). */
static int drop_caches(void) {
  sync();
  FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
  if (!f) return 0;
  int ok = fputs("3\n", f) >= 0;
  return fclose(f) == 0 && ok;
}

typedef struct {
  double off_s, on_s, stall_s;
  double cpu_on; /* process CPU in the blocks with checkpoints (and their drain) */
  double wall;   /* the whole phase, both modes, and the last commit's pacing rest after it */
  double rest_left; /* that rest, included in wall */
  int snaps;
} step_figures;

/* Waits (bounded: 10 min) until every snapshot taken is committed or
 * failed, without ending a pacing rest as ckpt_flush would: the blocks with
 * checkpoints see the engine's steady pace, not a fresh start each. */
static void drain(ckpt_engine *e) {
  for (int i = 0; i < 600000; i++) {
    ckpt_stats s;
    ckpt_get_stats(e, &s);
    if (s.snapshots == s.committed + s.failed) return;
    usleep(1000);
  }
}

/* Phase 1 and 2: blocks of steps with and without a snapshot every step. */
static void steps_phase(trainer *t, ckpt_engine *e, step_figures *f) {
  step_stats st;
  memset(f, 0, sizeof *f);
  double w0 = tr_now();
  for (int round = 0; round < ROUNDS; round++) {
    for (int mode = 0; mode < 2; mode++) {
      double c0 = process_cpu();
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
          f->snaps++;
        }
        double snap = tr_now() - t0;
        if (mode == 1) {
          f->on_s += st.t_total + snap;
          f->stall_s += snap + st.t_ckpt_wait;
        } else {
          f->off_s += st.t_total;
        }
      }
      if (mode == 1) drain(e); /* let the writer finish outside the timed blocks */
      if (mode == 1) f->cpu_on += process_cpu() - c0;
    }
  }
  /* The pacing spreads each commit's CPU over a period from its snapshot
   * on; the window ends where the last commit's period does (the next
   * snapshot could not start sooner), not mid-period, which would count
   * the whole of its CPU against part of its time (a window of a few
   * commits, as on a fast GPU, read 0.026 for a 0.02 pace). */
  ckpt_stats cs;
  ckpt_get_stats(e, &cs);
  f->wall = tr_now() - w0 + cs.rest_left_s;
  f->rest_left = cs.rest_left_s;
  ckpt_flush(e);
}

/* Phase 3: the engine's commit alone against raw write+fdatasync, A B A B.
 * Returns the summed seconds of each side. */
static void commit_phase(trainer *t, ckpt_engine *e, const char *path, const void *buf, uint64_t bytes,
                         double *raw_s, double *commit_s) {
  *raw_s = *commit_s = 0;
  ckpt_event ev;
  while (ckpt_poll(e, &ev)) {
  }
  for (int round = 0; round < ROUNDS; round++) {
    *raw_s += write_file(path, buf, bytes, 1, 0);
    ckpt_state s;
    trainer_ckpt_state(t, &s);
    s.step += 1000000 + round; /* a step of its own: nothing to replace */
    ckpt_snapshot(e, &s);
    ckpt_wait_copy(e);
    ckpt_flush(e);
    while (ckpt_poll(e, &ev))
      if (ev.ok) *commit_s += ev.commit_s;
  }
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
  trainer_step(t, &st); /* warm-up: caches, thread pools, first-touch, the engine's start (buffers, threads) */
  for (int k = 0; k < o.keep_last + 3; k++) { /* and the store grown to its steady size: a young store's commits */
    ckpt_state s;                            /* write fresh file pages (10x the CPU on this VM), a run's later ones reuse them */
    trainer_ckpt_state(t, &s); /* the same step each time: each commit replaces the one before */
    ckpt_snapshot(e, &s);
    ckpt_wait_copy(e);
    ckpt_flush(e);
  }
  ckpt_stats c0, cs;
  ckpt_get_stats(e, &c0);
  step_figures f;
  steps_phase(t, e, &f);
  ckpt_get_stats(e, &cs);
  double cpu_ckpt = (cs.copy_cpu_s + cs.commit_cpu_s) - (c0.copy_cpu_s + c0.commit_cpu_s);
  uint64_t bytes = cs.bytes_per_snapshot, committed = cs.committed - c0.committed;
  cs.coalesced -= c0.coalesced;
  cs.skipped -= c0.skipped;
  printf("model: %lld parameters | state per checkpoint %.1f MiB | %d snapshots: %llu committed, %llu coalesced, "
         "%llu skipped\n",
         (long long)graph_nparams(trainer_graph(t)), bytes / 1048576.0, f.snaps, (unsigned long long)committed,
         (unsigned long long)cs.coalesced, (unsigned long long)cs.skipped);
  double train_commit_s = cs.commit_s - c0.commit_s;

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
  double sync_s = write_file(path, buf, bytes, 0, 0) + pull_s;
  double raw_s, commit_s;
  commit_phase(t, e, path, buf, bytes, &raw_s, &commit_s);
  double mc = tr_now();
  memcpy(buf2, buf, bytes);
  double memcpy_s = tr_now() - mc;

  /* load: verify + copy the newest checkpoint into the trainer as a resume
   * does (a fresh reader: the store's first read in a process), with the
   * store in the page cache, then with the page cache dropped (the engine
   * closed first: pages a process maps are not dropped) */
  ckpt_get_stats(e, &cs);
  ckpt_close(e);
  char report[1024];
  double load_s = 0, cold_s = -1, rawread_s = -1;
  for (int pass = 0; pass < 2; pass++) {
    if (pass == 1 && !drop_caches()) break;
    ckpt_reader *r = ckpt_reader_open(rundir);
    double l0 = tr_now();
    int lrc = r ? trainer_ckpt_load(t, r, -1, report, sizeof report) : TR_EIO;
    *(pass ? &cold_s : &load_s) = tr_now() - l0;
    ckpt_reader_close(r);
    if (lrc) fprintf(stderr, "ckpt_bench: load: %s\n", tr_error());
  }
  if (cold_s > 0 && write_file(path, buf, bytes, 1, 1) > 0 && drop_caches()) rawread_s = read_file(path, buf2, bytes);
  unlink(path);

  double step_off = f.off_s / (ROUNDS * BLOCK), step_on = f.on_s / (ROUNDS * BLOCK);
  double mib = bytes / 1048576.0;
  printf("step time:   %.1f ms with a checkpoint every step (%llu of %d committed), %.1f ms without\n", step_on * 1e3,
         (unsigned long long)committed, f.snaps, step_off * 1e3);
  printf("stall:       %.3f ms per checkpoint; synchronous save (%swrite+fsync) %.1f ms\n", f.stall_s / f.snaps * 1e3,
         pull_s > 0 ? "download+" : "", sync_s * 1e3);
  printf("commit:      %.0f MiB/s (CRC32C + LMDB txn + sync, training paused); raw write+fdatasync %.0f MiB/s; "
         "during training (writer at nice 19) %.0f MiB/s\n",
         mib * ROUNDS / commit_s, mib * ROUNDS / raw_s, committed ? mib * committed / train_commit_s : 0.0);
  printf("load warm:   %.0f MiB/s (verify + copy into the model); memcpy %.0f MiB/s\n", mib / load_s, mib / memcpy_s);
  if (cold_s > 0)
    printf("load cold:   %.0f MiB/s (%.2f s: the resume's load of this model); raw read() cold %.0f MiB/s\n",
           mib / cold_s, cold_s, rawread_s > 0 ? mib / rawread_s : 0.0);
  else
    printf("load cold:   not measured (dropping the page cache needs root)\n");
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  printf("cpu:         the checkpoint threads used %.2f CPU-s in %.1f s of steps and the last commit's pacing rest "
         "(%.1f s) on %ld cores (training %.1f CPU-s in the blocks with checkpoints)\n",
         cpu_ckpt, f.wall, f.rest_left, ncpu, f.cpu_on - cpu_ckpt);
  printf("RATIO step_with_ckpt/step_without = %.3f (target <= 1.05)\n", step_on / step_off);
  printf("RATIO ckpt_cpu/machine_cpu = %.4f (pacing: <= %.2f; the other jobs' load does not move it)\n",
         cpu_ckpt / (f.wall * (double)ncpu), CKPT_CPU_SHARE);
  printf("RATIO stall/sync_save = %.4f (target <= 0.02)\n", f.stall_s / f.snaps / sync_s);
  printf("RATIO lmdb_commit/raw_write = %.2f (target >= 0.6)\n", raw_s / commit_s);
  printf("RATIO load/memcpy = %.3f (target >= 0.3)\n", memcpy_s / load_s);
  if (cold_s > 0 && rawread_s > 0) printf("RATIO load_cold/raw_read_cold = %.3f\n", rawread_s / cold_s);
  tr_free_aligned(buf);
  tr_free_aligned(buf2);
  trainer_free(t);
  lua_host_close(L);
  return 0;
}
