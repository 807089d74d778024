/* test_ckpt.c — the checkpoint engine under real faults.
 *
 * - laziness: the snapshot holds the values of snapshot time even though the
 *   "optimizer" overwrites the tensors right after ckpt_wait_copy;
 * - retention (keep_last, keep_every) and the busy policies;
 * - bytes flipped on disk inside the newest checkpoint's data (located
 *   through LMDB's memory map): verify names the tensor, load falls back;
 * - a flipped manifest byte;
 * - a full store (LMDB map size): the commit fails cleanly, older
 *   checkpoints stay loadable, the engine keeps working;
 * - a damaged page of the list of checkpoints: an error everywhere, never
 *   "no checkpoints";
 * - a reader killed inside its read transaction: its slot is cleared, the
 *   store neither fills up nor grows;
 * - kill -9 of a writing process at 20 random moments: the newest committed
 *   checkpoint always verifies and holds exactly its step's data;
 * - unwritable directories: a clear error, no crash;
 * - the map grown by another process's commit (MDB_MAP_RESIZED): a reader
 *   and an engine opened before it adopt the new size;
 * - device staging through a fake backend's hooks: a buffer that cannot be
 *   pinned is used unpinned, nothing left pinned, a backend without side-stream
 *   copies is read with download, a failed copy is an event, never a commit;
 * - the remote level: replication and retention there; resume with the
 *   local store deleted, with its copy corrupt, with both copies of the
 *   newest corrupt; kill -9 of a replicating process mid-copy leaves no half
 *   checkpoint published, and its temporary is cleaned up (also on a host
 *   whose name has dots, in a UTS namespace of its own);
 * - a store killed inside its first open (data.mdb without databases, or of
 *   0 bytes): no checkpoint, not an unreadable store;
 * - a rollback's drop of the checkpoints after its target, in both levels;
 *   a drop that fails names its level (a remote step that cannot be
 *   removed; a local store LMDB refuses);
 * - a remote whose writes block (a FIFO nobody reads, where the replicator
 *   writes its temporary): local commits go on meanwhile;
 * - retention with a newer step in the store: the step being committed
 *   is kept.
 */
#define _GNU_SOURCE /* unshare, CLONE_NEWUTS */
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <fcntl.h>
#include <lmdb.h>
#include <sched.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "check.h"
#include "ckpt.h"
#include "crc32c.h"
#include "util.h"

static char root[] = "/tmp/transom-ckpt-XXXXXX";

static void store_path(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", root, name); }

static void fill(float *p, int64_t n, int64_t step) {
  for (int64_t i = 0; i < n; i++) p[i] = (float)(step * 1000 + i % 1000);
}

static int holds_step(const float *p, int64_t n, int64_t step) {
  for (int64_t i = 0; i < n; i++)
    if (p[i] != (float)(step * 1000 + i % 1000)) return 0;
  return 1;
}

static ckpt_engine *open_engine(const char *dir, int keep_last, int keep_every, int busy, size_t map) {
  ckpt_opts o = {dir, map, keep_last, keep_every, busy};
  ckpt_engine *e = ckpt_open(&o);
  CHECK(e != NULL, "ckpt_open(%s): %s", dir, tr_error());
  return e;
}

static int64_t newest(const char *dir) {
  ckpt_reader *r = ckpt_reader_open(dir);
  if (!r) return -1;
  int64_t steps[256];
  int n = ckpt_reader_steps(r, steps, 256);
  ckpt_reader_close(r);
  return n > 0 ? steps[n - 1] : -1;
}

static void test_lazy_copy_and_retention(void) {
  char dir[256];
  store_path(dir, sizeof dir, "lazy");
  ckpt_engine *e = open_engine(dir, 2, 5, CKPT_COALESCE, 0);
  if (!e) return;
  enum { N = 300000 };
  float *a = malloc(sizeof(float) * N), *b = malloc(sizeof(float) * 7);
  int64_t da[2] = {1000, 300}, db[1] = {7};
  CHECK(ckpt_register(e, "param/a", CKPT_F32, 2, da, a) == 0, "register: %s", tr_error());
  CHECK(ckpt_register(e, "param/b", CKPT_F32, 1, db, b) == 0, "register: %s", tr_error());
  CHECK(ckpt_register(e, "param/b", CKPT_F32, 1, db, b) != 0, "a duplicate name must be refused");
  for (int64_t step = 1; step <= 12; step++) {
    fill(a, N, step);
    fill(b, 7, step);
    ckpt_state s = {.step = step, .data_rng = 0xabc0 + (uint64_t)step, .opt_steps = step, .config_hash = 42};
    int rc = ckpt_snapshot(e, &s);
    CHECK(rc >= 0, "snapshot %lld: %s", (long long)step, tr_error());
    ckpt_wait_copy(e);
    fill(a, N, -step); /* the optimizer changes the parameters right away */
    ckpt_flush(e);     /* one commit at a time: retention below is exact */
  }
  ckpt_event ev;
  int events = 0, failed = 0;
  while (ckpt_poll(e, &ev)) events++, failed += !ev.ok;
  CHECK(events == 12 && failed == 0, "12 commit events expected, got %d (%d failed)", events, failed);
  CHECK(ckpt_register(e, "late", CKPT_F32, 1, db, b) != 0, "register after the first snapshot must be refused");
  ckpt_close(e);

  ckpt_reader *r = ckpt_reader_open(dir);
  CHECK(r != NULL, "reader: %s", tr_error());
  if (!r) return;
  int64_t steps[32];
  int n = ckpt_reader_steps(r, steps, 32);
  CHECK(n == 4 && steps[0] == 5 && steps[1] == 10 && steps[2] == 11 && steps[3] == 12,
        "retention keep_last=2 keep_every=5 must leave 5 10 11 12; got %d steps", n);
  for (int i = 0; i < n; i++) {
    CHECK(ckpt_reader_verify(r, steps[i]) == 0, "verify %lld: %s", (long long)steps[i], tr_error());
    CHECK(ckpt_reader_read(r, steps[i], "param/a", a, sizeof(float) * N) == 0, "read: %s", tr_error());
    CHECK(holds_step(a, N, steps[i]), "step %lld holds the values of snapshot time", (long long)steps[i]);
  }
  ckpt_manifest m;
  CHECK(ckpt_reader_manifest(r, 11, &m) == 0 && m.state.data_rng == 0xabc0 + 11 && m.state.opt_steps == 11 &&
            m.state.config_hash == 42 && m.ntensors == 2 && m.tensors[0].dim[1] == 300,
        "manifest of step 11 carries the state and the tensor table");
  ckpt_reader_close(r);
  free(a);
  free(b);
}

/* The offset in data.mdb of the value of tensor `tensor` (or of the
 * manifest) of checkpoint `step`, in *off; 0 or -1. */
static int value_offset(const char *dir, int64_t step, uint32_t tensor, int manifest, off_t *off) {
  MDB_env *env;
  MDB_txn *txn;
  MDB_dbi dbi;
  mdb_env_create(&env);
  mdb_env_set_maxdbs(env, 4);
  int rc = mdb_env_open(env, dir, MDB_RDONLY, 0644);
  if (!rc) rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
  if (!rc) rc = mdb_dbi_open(txn, manifest ? "manifest" : "data", 0, &dbi);
  if (rc) {
    fprintf(stderr, "flip: %s: %s\n", dir, mdb_strerror(rc));
    return -1;
  }
  uint8_t kb[16] = {0};
  for (int i = 0; i < 8; i++) kb[7 - i] = (uint8_t)((uint64_t)step >> (8 * i));
  for (int i = 0; i < 4; i++) kb[11 - i] = (uint8_t)(tensor >> (8 * i));
  MDB_val k = {manifest ? 8 : 16, kb}, v;
  rc = mdb_get(txn, dbi, &k, &v);
  if (rc) fprintf(stderr, "flip: get: %s\n", mdb_strerror(rc));
  /* the file offset of the value: its address minus the map's base, which
   * /proc/self/maps shows beside the file's name */
  uintptr_t base = 0;
  char line[1024], want[300];
  snprintf(want, sizeof want, "%s/data.mdb", dir);
  FILE *maps = fopen("/proc/self/maps", "r");
  while (maps && fgets(line, sizeof line, maps)) {
    unsigned long lo, hi, foff;
    if (strstr(line, want) && sscanf(line, "%lx-%lx %*s %lx", &lo, &hi, &foff) == 3 && foff == 0 &&
        (uintptr_t)v.mv_data >= lo && (uintptr_t)v.mv_data < hi)
      base = lo;
  }
  if (maps) fclose(maps);
  *off = (off_t)((uintptr_t)v.mv_data - base);
  if (!base) rc = -1;
  mdb_txn_abort(txn);
  mdb_env_close(env);
  return rc ? -1 : 0;
}

/* Flips one byte of `name` in checkpoint `step` of the store, on disk. */
static int flip_tensor_byte(const char *dir, int64_t step, uint32_t tensor, size_t at, int manifest) {
  off_t off;
  if (value_offset(dir, step, tensor, manifest, &off)) return -1;
  off += (off_t)at;
  char path[300];
  snprintf(path, sizeof path, "%s/data.mdb", dir);
  int fd = open(path, O_RDWR);
  uint8_t c;
  if (fd < 0 || pread(fd, &c, 1, off) != 1) return -1;
  c ^= 0x5a;
  int ok = pwrite(fd, &c, 1, off) == 1;
  fsync(fd);
  close(fd);
  return ok ? 0 : -1;
}

/* Commits steps from..to (every `every`) of param/a (n floats at a, which
 * the engine has registered), each with its step's values, one at a time;
 * with a remote level, each one's remote copy too (the replicator skips a
 * step committed while it copies an older one: the remote would hold only
 * some of them). */
static void commit_steps(ckpt_engine *e, float *a, int64_t n, int64_t from, int64_t to, int64_t every) {
  for (int64_t step = from; step <= to; step += every) {
    fill(a, n, step);
    ckpt_state s = {.step = step};
    ckpt_snapshot(e, &s);
    ckpt_wait_copy(e);
    ckpt_flush(e);
    ckpt_wait_remote(e);
  }
}

/* A damaged page of the list of checkpoints (the manifest database's
 * leaf) is an error everywhere, never "no checkpoints": a resume that took
 * it for an empty store would start from step 0 and overwrite the run. */
static void test_damaged_list(void) {
  char dir[256];
  store_path(dir, sizeof dir, "damaged-list");
  ckpt_engine *e = open_engine(dir, 5, 0, CKPT_COALESCE, 0);
  if (!e) return;
  enum { N = 1000 };
  float *a = malloc(sizeof(float) * N);
  int64_t d[1] = {N};
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  commit_steps(e, a, N, 10, 30, 10);
  ckpt_close(e);
  free(a);
  CHECK(ckpt_store_damaged(dir) == 0, "an intact store is not damaged");
  /* the page holding step 30's manifest: its header's flags (bytes 10-11,
   * after the page number and a pad) zeroed, an invalid page type */
  off_t off;
  CHECK(value_offset(dir, 30, 0, 1, &off) == 0, "could not find step 30's manifest on disk");
  char path[300];
  snprintf(path, sizeof path, "%s/data.mdb", dir);
  int fd = open(path, O_RDWR);
  long page = sysconf(_SC_PAGESIZE);
  uint8_t zero[2] = {0, 0};
  CHECK(fd >= 0 && pwrite(fd, zero, 2, off / page * page + 10) == 2, "could not damage the page");
  if (fd >= 0) close(fd);
  ckpt_reader *r = ckpt_reader_open(dir);
  int64_t steps[8];
  int n = r ? ckpt_reader_steps(r, steps, 8) : -1;
  CHECK(n < 0 && strstr(tr_error(), "damaged") && strstr(tr_error(), dir),
        "listing a damaged list is an error naming the store, not %d checkpoint(s): %s", n, tr_error());
  ckpt_reader_close(r);
  CHECK(ckpt_store_damaged(dir) == 1, "ckpt_store_damaged sees the damaged list (so a remote level can take over)");
  ckpt_opts o = {dir, 0, 5, 0, CKPT_COALESCE};
  e = ckpt_open(&o);
  CHECK(e == NULL && strstr(tr_error(), "damaged") && strstr(tr_error(), dir),
        "opening the engine on it fails, naming the store and saying why: %s", tr_error());
  ckpt_close(e);
}

static void test_corruption(void) {
  char dir[256];
  store_path(dir, sizeof dir, "corrupt");
  ckpt_engine *e = open_engine(dir, 5, 0, CKPT_COALESCE, 0);
  if (!e) return;
  enum { N = 50000 };
  float *a = malloc(sizeof(float) * N), *b = malloc(sizeof(float) * N);
  int64_t d[1] = {N};
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  ckpt_register(e, "adam.m/a", CKPT_F32, 1, d, b);
  for (int64_t step = 10; step <= 30; step += 10) {
    fill(a, N, step);
    fill(b, N, step + 1);
    ckpt_state s = {.step = step, .config_hash = 7};
    ckpt_snapshot(e, &s);
    ckpt_wait_copy(e);
    ckpt_flush(e);
  }
  ckpt_close(e);
  /* data bytes of the newest checkpoint's second tensor */
  CHECK(flip_tensor_byte(dir, 30, 1, 12345, 0) == 0, "could not flip a byte on disk");
  ckpt_reader *r = ckpt_reader_open(dir);
  if (!r) return;
  CHECK(ckpt_reader_verify(r, 30) != 0 && strstr(tr_error(), "adam.m/a") && strstr(tr_error(), "checksum"),
        "verify must name the corrupted tensor: %s", tr_error());
  CHECK(ckpt_reader_verify(r, 20) == 0, "step 20 is intact: %s", tr_error());
  ckpt_target t[2] = {{"param/a", a, sizeof(float) * N}, {"adam.m/a", b, sizeof(float) * N}};
  ckpt_state st;
  char report[1024];
  memset(a, 0, sizeof(float) * N);
  int rc = ckpt_load(r, -1, t, 2, &st, report, sizeof report);
  CHECK(rc == 0 && st.step == 20, "load falls back to step 20 (rc %d, step %lld): %s", rc, (long long)st.step,
        tr_error());
  CHECK(strstr(report, "skipped step 30") && strstr(report, "adam.m/a"), "the report says why: %s", report);
  CHECK(holds_step(a, N, 20) && holds_step(b, N, 21), "the fallback's data is step 20's");
  ckpt_reader_close(r);
  /* a flipped manifest byte */
  CHECK(flip_tensor_byte(dir, 20, 0, 9, 1) == 0, "could not flip a manifest byte");
  r = ckpt_reader_open(dir);
  CHECK(ckpt_reader_verify(r, 20) != 0 && strstr(tr_error(), "manifest"), "manifest damage: %s", tr_error());
  rc = ckpt_load(r, -1, t, 2, &st, report, sizeof report);
  CHECK(rc == 0 && st.step == 10, "load falls back to step 10: %s", tr_error());
  ckpt_reader_close(r);
  free(a);
  free(b);
}

/* ckpt_reader_expect_model: a checkpoint of the legacy hash (a run of an
 * older build, which hashed "models/x.lua" as written) loads; when every
 * step is another model's, the error says so, not "no intact checkpoint". */
static void test_expect_model(void) {
  char dir[256];
  store_path(dir, sizeof dir, "model");
  ckpt_engine *e = open_engine(dir, 5, 0, CKPT_COALESCE, 0);
  if (!e) return;
  enum { N = 1000 };
  float *a = malloc(sizeof(float) * N);
  int64_t d[1] = {N};
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  for (int64_t step = 10; step <= 20; step += 10) {
    fill(a, N, step);
    ckpt_state s = {.step = step, .config_hash = 7};
    ckpt_snapshot(e, &s);
    ckpt_wait_copy(e);
    ckpt_flush(e);
  }
  ckpt_close(e);
  ckpt_target t[1] = {{"param/a", a, sizeof(float) * N}};
  ckpt_state st;
  char report[1024];
  ckpt_reader *r = ckpt_reader_open(dir);
  if (!r) return;
  memset(a, 0, sizeof(float) * N);
  ckpt_reader_expect_model(r, 9, 7);
  int rc = ckpt_load(r, -1, t, 1, &st, report, sizeof report);
  CHECK(rc == 0 && st.step == 20 && holds_step(a, N, 20), "the legacy hash is accepted (rc %d): %s", rc, tr_error());
  ckpt_reader_expect_model(r, 9, 9);
  rc = ckpt_load(r, -1, t, 1, &st, report, sizeof report);
  CHECK(rc != 0 && strstr(tr_error(), "every checkpoint in") && strstr(tr_error(), "is of a different model") &&
            strstr(tr_error(), "config hash 0000000000000007"),
        "every step another model's: %s", tr_error());
  CHECK(strstr(report, "skipped step 20") && strstr(report, "skipped step 10"), "the report lists both: %s", report);
  ckpt_reader_close(r);
  /* one step damaged (its manifest), the other another model's: no intact checkpoint */
  CHECK(flip_tensor_byte(dir, 20, 0, 9, 1) == 0, "could not flip a manifest byte");
  r = ckpt_reader_open(dir);
  if (!r) return;
  ckpt_reader_expect_model(r, 9, 9);
  rc = ckpt_load(r, -1, t, 1, &st, report, sizeof report);
  CHECK(rc != 0 && strstr(tr_error(), "no intact checkpoint"), "damage and another model: %s", tr_error());
  ckpt_reader_close(r);
  free(a);
}

static void test_full_store(void) {
  char dir[256];
  store_path(dir, sizeof dir, "full");
  enum { N = 1 << 20 }; /* 4 MiB a checkpoint */
  ckpt_engine *e = open_engine(dir, 10, 0, CKPT_COALESCE, 11u << 20); /* room for about two */
  if (!e) return;
  float *a = malloc(sizeof(float) * N);
  int64_t d[1] = {N};
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  int ok = 0, failed = 0;
  char why[256] = "";
  for (int64_t step = 1; step <= 5; step++) {
    fill(a, N, step);
    ckpt_state s = {.step = step};
    CHECK(ckpt_snapshot(e, &s) >= 0, "snapshot: %s", tr_error());
    ckpt_wait_copy(e);
    ckpt_flush(e);
    ckpt_event ev;
    while (ckpt_poll(e, &ev)) {
      if (ev.ok) ok++;
      else failed++, snprintf(why, sizeof why, "%s", ev.what);
    }
  }
  ckpt_close(e);
  CHECK(ok >= 1 && failed >= 1, "a small store must take some and refuse some (ok %d, failed %d)", ok, failed);
  CHECK(strstr(why, "full") != NULL, "the failure says the store is full: %s", why);
  int64_t last = newest(dir);
  CHECK(last == ok, "the newest committed checkpoint is step %d (found %lld)", ok, (long long)last);
  ckpt_reader *r = ckpt_reader_open(dir);
  for (int64_t s = 1; r && s <= ok; s++) {
    CHECK(ckpt_reader_verify(r, s) == 0, "step %lld stays intact after the failures: %s", (long long)s, tr_error());
    ckpt_reader_read(r, s, "param/a", a, sizeof(float) * N);
    CHECK(holds_step(a, N, s), "step %lld data", (long long)s);
  }
  ckpt_reader_close(r);
  free(a);
}

/* A map LMDB cannot map (checkpoint.map_mb past the address space, or a
 * process out of memory): the failed resize unmaps the old map and leaves
 * none, so every later use of the environment must be refused, not read
 * the unmapped pages (a segfault at the next snapshot, before). The store
 * on disk stays intact. */
static void test_map_lost(void) {
  char dir[256];
  store_path(dir, sizeof dir, "maplost");
  enum { N = 1000 };
  float a[N];
  int64_t d[1] = {N};
  ckpt_engine *e = open_engine(dir, 2, 0, CKPT_SKIP, 0);
  if (!e) return;
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  fill(a, N, 1);
  ckpt_state s = {.step = 1};
  CHECK(ckpt_snapshot(e, &s) >= 0 && ckpt_flush(e) == 0, "map lost: step 1: %s", tr_error());
  ckpt_close(e);
  e = open_engine(dir, 2, 0, CKPT_SKIP, (size_t)1 << 60); /* 1 EiB: no mmap takes it */
  if (!e) return;
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  for (int64_t step = 2; step <= 3; step++) {
    fill(a, N, step);
    s.step = step;
    int rc = ckpt_snapshot(e, &s);
    CHECK(rc < 0, "map lost: snapshot %lld must fail (rc %d)", (long long)step, rc);
    CHECK(step == 2 || strstr(tr_error(), "unusable"), "map lost: the second refusal says why: %s", tr_error());
  }
  ckpt_stats st;
  ckpt_get_stats(e, &st);
  CHECK(st.failed == 2 && st.committed == 0, "map lost: both count as failed (%llu failed, %llu committed)",
        (unsigned long long)st.failed, (unsigned long long)st.committed);
  ckpt_reader *r = ckpt_engine_reader(e);
  CHECK(r == NULL && strstr(tr_error(), "unusable"), "map lost: no reader on the lost map: %s", tr_error());
  ckpt_reader_close(r);
  ckpt_close(e);
  CHECK(newest(dir) == 1, "map lost: step 1 is still the newest checkpoint (%lld)", (long long)newest(dir));
  r = ckpt_reader_open(dir);
  CHECK(r && ckpt_reader_verify(r, 1) == 0, "map lost: step 1 verifies: %s", tr_error());
  ckpt_reader_close(r);
}

/* A process killed inside a read transaction (`transom ckpt verify`
 * interrupted, a replica killed while it loads) leaves its read slot
 * behind; the writer must clear it, or the snapshot the slot pins keeps
 * every page freed since from reuse: a fixed map fills up ("store full")
 * and an automatic one grows by a checkpoint per commit. */
static void test_stale_reader(void) {
  char dir[256];
  store_path(dir, sizeof dir, "stale-reader");
  enum { N = 1 << 18 }; /* 1 MiB a checkpoint */
  for (int fixed = 1; fixed >= 0; fixed--) {
    char d2[300];
    snprintf(d2, sizeof d2, "%s-%s", dir, fixed ? "fixed" : "auto");
    ckpt_engine *e = open_engine(d2, 1, 0, CKPT_COALESCE, fixed ? 6u << 20 : 0);
    if (!e) return;
    float *a = malloc(sizeof(float) * N);
    int64_t d[1] = {N};
    ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
    int ok = 0;
    char why[256] = "";
    for (int64_t step = 1; step <= 20; step++) {
      if (step == 2) { /* a reader of step 1 dies holding its read transaction */
        pid_t p = fork();
        if (p == 0) {
          MDB_env *env;
          MDB_txn *t;
          if (mdb_env_create(&env) || mdb_env_set_maxdbs(env, 4) || mdb_env_open(env, d2, MDB_RDONLY, 0644) ||
              mdb_txn_begin(env, NULL, MDB_RDONLY, &t))
            _exit(3);
          kill(getpid(), SIGKILL);
        }
        int status = 0;
        waitpid(p, &status, 0);
        CHECK(WIFSIGNALED(status), "the reader child died in its read transaction (status %d)", status);
      }
      fill(a, N, step);
      ckpt_state s = {.step = step};
      ckpt_snapshot(e, &s);
      ckpt_wait_copy(e);
      ckpt_flush(e);
      ckpt_event ev;
      while (ckpt_poll(e, &ev)) {
        if (ev.ok) ok++;
        else snprintf(why, sizeof why, "%s", ev.what);
      }
    }
    ckpt_close(e);
    char path[400];
    snprintf(path, sizeof path, "%s/data.mdb", d2);
    struct stat st;
    CHECK(stat(path, &st) == 0, "%s exists", path);
    CHECK(ok == 20, "%s map: all 20 commits past a dead reader (ok %d; last failure: %s)",
          fixed ? "a fixed" : "the automatic", ok, why);
    CHECK(st.st_size <= (off_t)(8u << 20), "%s map: the store stays near keep_last = 1 (data.mdb %lld bytes)",
          fixed ? "a fixed" : "the automatic", (long long)st.st_size);
    CHECK(newest(d2) == 20, "step 20 is the newest (%lld)", (long long)newest(d2));
    free(a);
  }
}

/* test_kill9's tensor: 12 MiB, so commits take a while; 1 MiB under
 * TRANSOM_TEST_SMALL (ThreadSanitizer: ten times slower, so its commits
 * take as long, and the writer, at nice 19, gets little of a loaded
 * machine's cores) */
static int64_t kill9_floats(void) { return test_small() ? 1 << 18 : 3 << 20; }

/* The child: snapshots forever, a new step every iteration. */
static void writer_child(const char *dir, int64_t first) {
  const int64_t N = kill9_floats();
  ckpt_opts o = {dir, 0, 3, 0, CKPT_COALESCE};
  ckpt_engine *e = ckpt_open(&o);
  if (!e) _exit(3);
  float *a = malloc(sizeof(float) * N);
  int64_t d[1] = {N};
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  for (int64_t step = first;; step++) {
    fill(a, N, step);
    ckpt_state s = {.step = step};
    ckpt_snapshot(e, &s);
    ckpt_wait_copy(e);
  }
}

static void test_kill9(void) {
  char dir[256];
  store_path(dir, sizeof dir, "kill");
  const int64_t N = kill9_floats();
  float *a = malloc(sizeof(float) * N);
  unsigned seed = (unsigned)time(NULL);
  srand(seed);
  int kills = 0, verified = 0, own = 0;
  int64_t first = 1;
  for (int round = 0; round < 20; round++) {
    pid_t pid = fork();
    if (pid == 0) writer_child(dir, first);
    /* once the child committed something of its own (bounded: 60 s; the
     * writer runs at nice 19, so under load that can take a while), kill it
     * 0..400 ms later: mid-copy or mid-commit most of the time */
    for (int i = 0; i < 6000 && newest(dir) < first; i++) usleep(10000);
    usleep((useconds_t)(rand() % 400000));
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    kills += WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    int64_t last = newest(dir);
    own += last >= first; /* else the wait above ran out: an earlier writer's step */
    if (last < 0) continue; /* killed before its first commit */
    ckpt_reader *r = ckpt_reader_open(dir);
    int rc = r ? ckpt_reader_verify(r, last) : -1;
    CHECK(rc == 0, "round %d (seed %u): newest step %lld must verify: %s", round, seed, (long long)last, tr_error());
    if (r && rc == 0 && ckpt_reader_read(r, last, "param/a", a, sizeof(float) * N) == 0) {
      CHECK(holds_step(a, N, last), "round %d: step %lld holds its own data", round, (long long)last);
      verified++;
    }
    ckpt_reader_close(r);
    first = last + 1000; /* the next writer's steps follow on */
  }
  CHECK(kills == 20, "20 kill -9 expected, %d", kills);
  CHECK(verified == 20, "every round has a committed checkpoint to check (%d of 20)", verified);
  CHECK(own == 20, "in every round the killed writer had committed a step of its own (%d of 20)", own);
  printf("kill -9: %d rounds, %d newest checkpoints verified (seed %u)\n", kills, verified, seed);
  free(a);
}

static void test_unwritable(void) {
  ckpt_opts o = {"/proc/transom-no-such/ckpt", 0, 3, 0, CKPT_COALESCE};
  ckpt_engine *e = ckpt_open(&o);
  CHECK(e == NULL && strlen(tr_error()) > 0, "an unwritable directory must fail clearly");
  char file[300];
  store_path(file, sizeof file, "plainfile");
  FILE *f = fopen(file, "w");
  fclose(f);
  char under[320];
  snprintf(under, sizeof under, "%s/ckpt", file);
  o.dir = under;
  e = ckpt_open(&o);
  CHECK(e == NULL && strstr(tr_error(), "plainfile"), "a path under a file must fail naming it: %s", tr_error());
  CHECK(ckpt_reader_open("/nonexistent-transom") == NULL, "reader of a missing store must fail");
}


/* --- a device backend as the engine sees it: host memory behind the
 * table's hooks, with faults on demand --- */

static struct {
  int pin_fail_at;      /* the ckpt_pin call (1, 2, ...) that fails; 0: none */
  int pin_calls;
  void *pinned[8];      /* currently pinned buffers */
  int npin, pins;       /* live pins, successful pin calls */
  int copies, downloads, copy_fail;
  int mark_fail;        /* ckpt_mark fails */
} fake;

static const char *fake_error(void) { return "fake device error"; }
static int fake_pin(void *host, size_t bytes) {
  (void)bytes;
  if (++fake.pin_calls == fake.pin_fail_at) return TR_EIO;
  fake.pinned[fake.npin++] = host;
  fake.pins++;
  return TR_OK;
}
static void fake_unpin(void *host) {
  for (int i = 0; i < fake.npin; i++)
    if (fake.pinned[i] == host) {
      fake.pinned[i] = fake.pinned[--fake.npin];
      return;
    }
}
static int fake_copy(void *dst, const void *src, size_t bytes) {
  fake.copies++;
  if (fake.copy_fail) return TR_EIO;
  memcpy(dst, src, bytes);
  return TR_OK;
}
static int fake_download(void *dst, const void *src, size_t bytes) {
  fake.downloads++;
  memcpy(dst, src, bytes);
  return TR_OK;
}
static int fake_nothing(void) { return TR_OK; }
static int fake_mark(void) { return fake.mark_fail ? TR_EIO : TR_OK; }

/* Device staging: a staging buffer that cannot be pinned is used unpinned
 * (the snapshot commits, stats say so, no second try; nothing stays pinned
 * after close); a backend without side-stream copies is read through its
 * download; a failed device copy is an event and commits nothing. */
static void test_device_staging(void) {
  char dir[256];
  enum { N = 1000 };
  float *a = malloc(sizeof(float) * N);
  int64_t da[1] = {N};
  tr_backend be = {.abi = TR_BACKEND_ABI, .name = "fake", .host_memory = 0, .error = fake_error,
                   .download = fake_download, .ckpt_pin = fake_pin, .ckpt_unpin = fake_unpin,
                   .ckpt_mark = fake_nothing, .ckpt_copy = fake_copy, .ckpt_wait = fake_nothing};

  store_path(dir, sizeof dir, "dev-pin");
  memset(&fake, 0, sizeof fake);
  fake.pin_fail_at = 2; /* the first buffer is pinned, the second fails */
  ckpt_engine *e = open_engine(dir, 3, 0, CKPT_SKIP, 0); /* skip: two staging buffers (coalesce stages one) */
  if (!e) goto out;
  CHECK(ckpt_set_device(e, &be) == 0, "set_device: %s", tr_error());
  CHECK(ckpt_register(e, "param/a", CKPT_F32, 1, da, a) == 0, "register: %s", tr_error());
  fill(a, N, 1);
  ckpt_state s = {.step = 1, .config_hash = 7};
  int rc = ckpt_snapshot(e, &s);
  CHECK(rc >= 0, "a staging buffer that cannot be pinned does not fail the snapshot: %d %s", rc, tr_error());
  ckpt_flush(e);
  ckpt_stats st;
  ckpt_get_stats(e, &st);
  CHECK(st.committed == 1 && st.unpinned == 1 && strstr(st.unpinned_why, "fake device error"),
        "it commits, unpinned, and the stats say why (committed %llu, unpinned %d: %s)",
        (unsigned long long)st.committed, st.unpinned, st.unpinned_why);
  s.step = 2;
  fill(a, N, 2);
  rc = ckpt_snapshot(e, &s);
  CHECK(rc >= 0, "the next snapshot: %s", tr_error());
  ckpt_flush(e);
  CHECK(fake.pin_calls == 2 && fake.pins == 1, "one buffer pinned, the other not tried again (%d calls, %d pinned)",
        fake.pin_calls, fake.pins);
  CHECK(fake.copies >= 1 && fake.downloads == 0, "copies through ckpt_copy (%d)", fake.copies);
  ckpt_close(e);
  CHECK(fake.npin == 0, "%d staging buffer(s) left pinned after close", fake.npin);
  CHECK(newest(dir) == 2, "step 2 committed (newest %lld)", (long long)newest(dir));
  {
    ckpt_reader *rd = ckpt_reader_open(dir);
    CHECK(rd && ckpt_reader_read(rd, 1, "param/a", a, sizeof(float) * N) == 0 && holds_step(a, N, 1),
          "step 1, copied into an unpinned buffer, holds its values: %s", tr_error());
    ckpt_reader_close(rd);
  }

  store_path(dir, sizeof dir, "dev-download");
  memset(&fake, 0, sizeof fake);
  be.ckpt_copy = NULL;
  be.ckpt_wait = NULL;
  e = open_engine(dir, 3, 0, CKPT_COALESCE, 0);
  if (!e) goto out;
  ckpt_set_device(e, &be);
  ckpt_register(e, "param/a", CKPT_F32, 1, da, a);
  fill(a, N, 3);
  s.step = 3;
  CHECK(ckpt_snapshot(e, &s) >= 0, "snapshot: %s", tr_error());
  ckpt_flush(e);
  CHECK(fake.downloads == 1, "no ckpt_copy: the device memory is read with download (%d calls)", fake.downloads);
  ckpt_close(e);
  ckpt_reader *r = ckpt_reader_open(dir);
  CHECK(r && ckpt_reader_read(r, 3, "param/a", a, sizeof(float) * N) == 0 && holds_step(a, N, 3),
        "step 3 holds its values: %s", tr_error());
  ckpt_reader_close(r);

  store_path(dir, sizeof dir, "dev-copyfail");
  memset(&fake, 0, sizeof fake);
  be.ckpt_copy = fake_copy;
  be.ckpt_wait = fake_nothing;
  fake.copy_fail = 1;
  e = open_engine(dir, 3, 0, CKPT_COALESCE, 0);
  if (!e) goto out;
  ckpt_set_device(e, &be);
  ckpt_register(e, "param/a", CKPT_F32, 1, da, a);
  s.step = 4;
  CHECK(ckpt_snapshot(e, &s) >= 0, "snapshot: %s", tr_error());
  ckpt_flush(e);
  ckpt_event ev;
  int got = ckpt_poll(e, &ev);
  CHECK(got && !ev.ok && ev.step == 4 && strstr(ev.what, "level-1 copy") && strstr(ev.what, "fake device error"),
        "a failed device copy is a failure event: %s", got ? ev.what : "(none)");
  ckpt_close(e);
  CHECK(newest(dir) == -1, "nothing half-copied is committed (newest %lld)", (long long)newest(dir));

  /* a device stream that cannot be marked: an error, counted in the totals */
  store_path(dir, sizeof dir, "dev-markfail");
  memset(&fake, 0, sizeof fake);
  be.ckpt_mark = fake_mark;
  fake.mark_fail = 1;
  e = open_engine(dir, 3, 0, CKPT_COALESCE, 0);
  if (!e) goto out;
  ckpt_set_device(e, &be);
  ckpt_register(e, "param/a", CKPT_F32, 1, da, a);
  s.step = 5;
  rc = ckpt_snapshot(e, &s);
  CHECK(rc < 0 && strstr(tr_error(), "marking the device stream"), "a failed mark fails the snapshot: %d %s", rc,
        tr_error());
  ckpt_get_stats(e, &st);
  CHECK(st.snapshots == 1 && st.failed == 1, "and the totals count it (snapshots %llu, failed %llu)",
        (unsigned long long)st.snapshots, (unsigned long long)st.failed);
  fake.mark_fail = 0;
  s.step = 6;
  CHECK(ckpt_snapshot(e, &s) >= 0, "the next snapshot, marked: %s", tr_error());
  ckpt_flush(e);
  ckpt_close(e);
  CHECK(newest(dir) == 6, "step 6 committed after the failed mark (newest %lld)", (long long)newest(dir));
out:
  free(a);
}

/* when_busy: a snapshot due while the previous one is still being copied
 * or written (or while pacing rests). "skip" drops the new one when both
 * staging buffers are taken; "coalesce" defers it: nothing is copied then,
 * ckpt_pending says when the engine can take one, and the state of that
 * moment is what gets written. Snapshots come back to back until the policy
 * is reached (the writer, with its fdatasync, is far slower than the copy);
 * then what is in the store says which ones were written. */
static int in_store(const char *dir, int64_t step) {
  ckpt_reader *r = ckpt_reader_open(dir);
  int64_t steps[512];
  int n = r ? ckpt_reader_steps(r, steps, 512) : 0, found = 0;
  for (int i = 0; i < n; i++) found |= steps[i] == step;
  ckpt_reader_close(r);
  return found;
}

/* coalesce, continued: the deferred snapshot is wanted until taken; once
 * the writer is free (and pacing over) ckpt_pending says 1 (within a bound:
 * the engine paces at most CKPT_CPU_SHARE of the machine, so a rest is at
 * most (copy + commit CPU) / share), and the snapshot then taken holds the
 * state of that moment. */
static void test_coalesce_pending(const char *dir, float *a, int64_t n) {
  ckpt_engine *e = open_engine(dir, 200, 0, CKPT_COALESCE, 0);
  if (!e) return;
  int64_t d[1] = {n};
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  fill(a, n, 900);
  ckpt_state st = {.step = 900};
  CHECK(ckpt_snapshot(e, &st) == 0, "the first snapshot of an engine is taken");
  CHECK(ckpt_pending(e) == 0, "nothing is pending after a snapshot that was taken");
  ckpt_wait_copy(e);
  fill(a, n, 901);
  st.step = 901;
  CHECK(ckpt_snapshot(e, &st) == CKPT_COALESCED, "a snapshot due while one commits is deferred");
  int due = 0;
  for (int i = 0; i < 60000 && !due; i++) { /* bounded: 60 s */
    due = ckpt_pending(e);
    if (!due) usleep(1000);
  }
  CHECK(due, "ckpt_pending says 1 once the writer is free");
  fill(a, n, 902);
  st.step = 902;
  CHECK(ckpt_snapshot(e, &st) == 0, "the pending snapshot is taken");
  CHECK(ckpt_pending(e) == 0, "and nothing is pending after it");
  ckpt_wait_copy(e);
  fill(a, n, 903); /* the "optimizer" moves on: the staged copy must not */
  ckpt_flush(e);
  ckpt_close(e);
  CHECK(in_store(dir, 900) && !in_store(dir, 901) && in_store(dir, 902), "900 and 902 written, 901 not");
  ckpt_reader *r = ckpt_reader_open(dir);
  float *back = malloc(sizeof(float) * (size_t)n);
  CHECK(r && back && ckpt_reader_read(r, 902, "param/a", back, sizeof(float) * (uint64_t)n) == 0 &&
            holds_step(back, n, 902),
        "step 902 holds the state at the moment it was taken");
  free(back);
  ckpt_reader_close(r);
}

static void test_when_busy(int busy) {
  char dir[256];
  store_path(dir, sizeof dir, busy == CKPT_SKIP ? "busy-skip" : "busy-coalesce");
  enum { N = 1 << 20, MAX = 200 };
  float *a = malloc(sizeof(float) * N);
  ckpt_engine *e = open_engine(dir, MAX, 0, busy, 0);
  if (!a || !e) return;
  int64_t d[1] = {N};
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  int result[MAX + 1] = {0}, reached = 0;
  int64_t last = 0;
  for (int64_t step = 1; step <= MAX && !reached; step++) {
    ckpt_wait_copy(e);
    fill(a, N, step);
    ckpt_state st = {.step = step};
    result[step] = ckpt_snapshot(e, &st);
    reached = result[step] == (busy == CKPT_SKIP ? CKPT_SKIPPED : CKPT_COALESCED);
    last = step;
  }
  ckpt_flush(e);
  ckpt_stats cs;
  ckpt_get_stats(e, &cs);
  ckpt_close(e);
  CHECK(reached, "when_busy = %s reached within %d back-to-back snapshots", busy == CKPT_SKIP ? "skip" : "coalesce", MAX);
  if (busy == CKPT_SKIP) {
    CHECK(!in_store(dir, last) && cs.skipped >= 1, "skip: the new snapshot (step %lld) is dropped", (long long)last);
    CHECK(in_store(dir, last - 1), "skip: the waiting one (step %lld) is written", (long long)last - 1);
  } else {
    CHECK(!in_store(dir, last) && cs.coalesced >= 1, "coalesce: the deferred snapshot (step %lld) is not copied",
          (long long)last);
  }
  int64_t ok = 0;
  for (int64_t step = 1; step < last; step++) ok += result[step] == 0 && in_store(dir, step);
  CHECK(ok == last - 1, "every snapshot before the busy one is written (%lld of %lld)", (long long)ok,
        (long long)last - 1);
  if (busy == CKPT_COALESCE) test_coalesce_pending(dir, a, N);
  free(a);
}

/* Pacing: after a commit the engine rests until that commit's CPU is the
 * share's worth of the machine since its snapshot; stats say how long is
 * left (bench/ckpt_bench.c ends its window there). A share of 1e-6 makes
 * the rest hours long, so it cannot be over by the time we look. */
static void test_pacing(void) {
  char dir[256];
  store_path(dir, sizeof dir, "pacing");
  enum { N = 1 << 20 };
  const double share = 1e-6; /* a rest of hours on any machine: ~3 ms of CPU / (1e-6 * cores) */
  float *a = malloc(sizeof(float) * N);
  ckpt_engine *e = open_engine(dir, 2, 0, CKPT_COALESCE, 0);
  if (!a || !e) {
    free(a);
    ckpt_close(e);
    return;
  }
  CHECK(ckpt_set_cpu_share(e, share) == 0, "ckpt_set_cpu_share: %s", tr_error());
  int64_t d[1] = {N};
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  fill(a, N, 1);
  ckpt_state st = {.step = 1};
  CHECK(ckpt_snapshot(e, &st) == 0, "the first snapshot is taken");
  ckpt_wait_copy(e);
  ckpt_stats cs;
  for (int i = 0; i < 60000; i++) { /* committed, without ckpt_flush (it ends the rest) */
    ckpt_get_stats(e, &cs);
    if (cs.committed + cs.failed >= 1) break;
    usleep(1000);
  }
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  double period = (cs.copy_cpu_s + cs.commit_cpu_s) / (share * (double)(ncpu > 0 ? ncpu : 1));
  if (period == 0) /* a thread CPU clock too coarse to see the commit: no rest to check */
    printf("  pacing: the commit's CPU read 0 s (coarse thread clock); rest not checked\n");
  CHECK(cs.committed == 1 && (period == 0 || cs.rest_left_s > 0) && cs.rest_left_s <= period + 1e-3,
        "after a commit: a rest left (%.3f s), at most its period (%.3f s for %.4f CPU-s)", cs.rest_left_s, period,
        cs.copy_cpu_s + cs.commit_cpu_s);
  if (period > 0) {
    st.step = 2;
    CHECK(ckpt_snapshot(e, &st) == CKPT_COALESCED && !ckpt_pending(e), "while resting: deferred, and not due");
  }
  ckpt_flush(e);
  ckpt_get_stats(e, &cs);
  CHECK(cs.rest_left_s == 0 && (period == 0 || ckpt_pending(e)),
        "ckpt_flush ends the rest: none left, the deferred one due");
  ckpt_close(e);
  free(a);
}

/* Another process's commit grows the store beyond the LMDB map this
 * process's environment was opened with (a replica that opened the store
 * while the leader's first checkpoint committed; the operator's reader):
 * LMDB's next transaction here says MDB_MAP_RESIZED, and the engine must
 * adopt the new size instead of failing (a joiner took that for a start-up
 * error and was never replaced). */
static void commit_in_child(const char *dir, int64_t step, int64_t n) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    ckpt_opts o = {dir, 0, 3, 0, CKPT_COALESCE};
    ckpt_engine *e = ckpt_open(&o);
    float *v = malloc(sizeof(float) * (size_t)(n ? n : 1));
    int ok = e && v;
    if (ok && n > 0) {
      fill(v, n, step);
      ckpt_state s = {.step = step};
      ok = ckpt_register(e, "w", CKPT_F32, 1, &n, v) == 0 && ckpt_snapshot(e, &s) >= 0 && ckpt_flush(e) == 0;
      ckpt_event ev;
      while (ok && ckpt_poll(e, &ev)) ok = ev.ok;
    }
    ckpt_close(e);
    free(v);
    _exit(ok ? 0 : 1); /* ok-exit: the child of a test */
  }
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child committed step %lld (%lld floats)", (long long)step,
        (long long)n);
}

static void test_map_grown_elsewhere(void) {
  char dir[256];
  store_path(dir, sizeof dir, "grown");
  commit_in_child(dir, 0, 0); /* an empty store: LMDB's default 1 MiB map */
  enum { SMALL = 1 << 20, BIG = 16 << 20 }; /* 4 MiB, then 64 MiB of data */
  float *v = malloc(sizeof(float) * BIG);
  if (!v) return;
  ckpt_reader *r = ckpt_reader_open(dir);
  CHECK(r != NULL, "reader: %s", tr_error());
  if (!r) return;
  commit_in_child(dir, 1, SMALL);
  int64_t steps[8];
  int n = ckpt_reader_steps(r, steps, 8);
  CHECK(n == 1 && steps[0] == 1, "a reader opened before sees the commit that grew the map (%d: %s)", n,
        n < 0 ? tr_error() : "");
  CHECK(ckpt_reader_read(r, 1, "w", v, sizeof(float) * SMALL) == 0 && holds_step(v, SMALL, 1), "and reads it: %s",
        tr_error());
  ckpt_reader_close(r);
  /* an engine (a replica) opened, then the store grows past its map: its
   * reader (the resume) and its own first commit */
  ckpt_engine *e = open_engine(dir, 3, 0, CKPT_COALESCE, 0);
  if (!e) return;
  commit_in_child(dir, 2, BIG);
  r = ckpt_engine_reader(e);
  n = r ? ckpt_reader_steps(r, steps, 8) : -1;
  CHECK(n == 2 && steps[1] == 2, "the engine's reader sees it (%d: %s)", n, n < 0 ? tr_error() : "");
  CHECK(r && ckpt_reader_read(r, 2, "w", v, sizeof(float) * BIG) == 0 && holds_step(v, BIG, 2), "and reads it: %s",
        tr_error());
  ckpt_reader_close(r);
  int64_t d[1] = {64};
  fill(v, 64, 3);
  CHECK(ckpt_register(e, "w", CKPT_F32, 1, d, v) == 0, "register: %s", tr_error());
  ckpt_state s = {.step = 3};
  CHECK(ckpt_snapshot(e, &s) >= 0 && ckpt_flush(e) == 0, "snapshot: %s", tr_error());
  ckpt_event ev = {0};
  int ok = 0, events = 0;
  while (ckpt_poll(e, &ev)) events++, ok += ev.ok;
  CHECK(events == 1 && ok == 1, "its own commit: %d of %d ok (%s)", ok, events, events && !ok ? ev.what : "");
  ckpt_close(e);
  CHECK(newest(dir) == 3, "step 3 committed (newest %lld)", (long long)newest(dir));
  free(v);
}

/* --- level 3: the remote store --- */

static ckpt_engine *open_remote_engine(const char *dir, const char *remote, double rate_mb, int keep_last) {
  ckpt_engine *e = open_engine(dir, keep_last, 0, CKPT_COALESCE, 0);
  if (e && ckpt_set_remote(e, remote, rate_mb) != 0) {
    CHECK(0, "ckpt_set_remote(%s): %s", remote, tr_error());
    ckpt_close(e);
    return NULL;
  }
  return e;
}

/* Loads param/a (n floats) through an engine's reader into out; returns the
 * step loaded or -1, the report in rep. */
static int64_t load_through(ckpt_engine *e, float *out, int64_t n, char *rep, size_t rep_len) {
  ckpt_reader *r = ckpt_engine_reader(e);
  ckpt_target t = {"param/a", out, sizeof(float) * (uint64_t)n};
  ckpt_state st;
  int rc = r ? ckpt_load(r, -1, &t, 1, &st, rep, rep_len) : -1;
  ckpt_reader_close(r);
  return rc ? -1 : st.step;
}

/* Committed checkpoints reach the remote store (retention there too);
 * resume picks the newest intact one across levels: with the local store
 * deleted, with the local copy's bytes flipped, with the remote copy's
 * bytes flipped as well (then the older step). An unwritable remote is a
 * clear error naming it. */
static void test_remote_levels(void) {
  char dir[256], remote[256], cmd[600];
  store_path(dir, sizeof dir, "lvl-local");
  store_path(remote, sizeof remote, "lvl-remote");
  enum { N = 200000 };
  float *a = malloc(sizeof(float) * N), *back = malloc(sizeof(float) * N);
  char rep[2048];
  int64_t d[1] = {N};
  ckpt_engine *e = open_remote_engine(dir, remote, 0, 2);
  if (!e || !a || !back) return;
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  for (int64_t step = 1; step <= 3; step++) {
    fill(a, N, step);
    ckpt_state st = {.step = step};
    CHECK(ckpt_snapshot(e, &st) == 0, "snapshot %lld: %s", (long long)step, tr_error());
    ckpt_wait_copy(e);
    ckpt_flush(e);
    ckpt_wait_remote(e); /* else a copy still running skips the next step (only the newest waits) */
  }
  ckpt_close(e); /* finishes the newest's copy */
  ckpt_reader *r = ckpt_reader_open(remote);
  int64_t steps[8];
  int n = r ? ckpt_reader_steps(r, steps, 8) : -1;
  CHECK(n == 2 && steps[0] == 2 && steps[1] == 3, "the remote keeps the newest 2 (keep_last): %d steps", n);
  CHECK(r && ckpt_reader_verify(r, 3) == 0 && ckpt_reader_read(r, 3, "param/a", back, sizeof back[0] * N) == 0 &&
            holds_step(back, N, 3),
        "the remote's step 3 verifies and holds step 3: %s", tr_error());
  ckpt_reader_close(r);

  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir); /* the local disk is lost */
  CHECK(system(cmd) == 0, "rm");
  e = open_remote_engine(dir, remote, 0, 2);
  if (e) ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  int64_t got = e ? load_through(e, back, N, rep, sizeof rep) : -1;
  CHECK(got == 3 && holds_step(back, N, 3), "local store deleted: resume from the remote's step 3 (got %lld: %s)",
        (long long)got, got < 0 ? tr_error() : "");
  if (e) commit_steps(e, a, N, 4, 5, 1); /* training goes on: 4 and 5 in both stores */
  ckpt_close(e);

  CHECK(flip_tensor_byte(dir, 5, 0, 4000, 0) == 0, "flip a byte of the local step 5");
  e = open_remote_engine(dir, remote, 0, 2);
  got = e ? load_through(e, back, N, rep, sizeof rep) : -1;
  CHECK(got == 5 && holds_step(back, N, 5) && strstr(rep, "step 5 (local store)"),
        "local copy corrupt: the remote's step 5 loads (got %lld; report: %s)", (long long)got, rep);
  ckpt_close(e);

  char path[400];
  snprintf(path, sizeof path, "%s/step-%020d.ckpt", remote, 5);
  int fd = open(path, O_RDWR);
  uint8_t c = 0;
  off_t at = lseek(fd, -1000, SEEK_END);
  CHECK(fd >= 0 && at > 0 && pread(fd, &c, 1, at) == 1, "read the remote step 5");
  c ^= 0x5a;
  CHECK(pwrite(fd, &c, 1, at) == 1, "flip a byte of the remote step 5");
  if (fd >= 0) close(fd);
  e = open_remote_engine(dir, remote, 0, 2);
  got = e ? load_through(e, back, N, rep, sizeof rep) : -1;
  CHECK(got == 4 && holds_step(back, N, 4) && strstr(rep, "step 5 (remote store)"),
        "both copies of 5 corrupt: step 4 loads (got %lld; report: %s)", (long long)got, rep);
  ckpt_close(e);

  e = open_engine(dir, 2, 0, CKPT_COALESCE, 0);
  CHECK(e && ckpt_set_remote(e, "/proc/transom-no-such/remote", 0) != 0 && strstr(tr_error(), "/proc/transom-no-such"),
        "an unwritable remote is an error naming it: %s", tr_error());
  ckpt_close(e);
  free(a);
  free(back);
}

/* A process replicating (rate-limited, so a copy takes about half a second)
 * is killed -9 while a temporary file shows a copy under way: every
 * published remote checkpoint verifies and holds its own step's data, and
 * the dead process's temporary is removed when a store is prepared again. */
static void replicating_child(const char *dir, const char *remote, int64_t first) {
  enum { N = 2 << 20 }; /* 8 MiB at 16 MiB/s */
  ckpt_opts o = {dir, 0, 2, 0, CKPT_COALESCE};
  ckpt_engine *e = ckpt_open(&o);
  if (!e || ckpt_set_remote(e, remote, 16)) _exit(3);
  float *a = malloc(sizeof(float) * N);
  int64_t d[1] = {N};
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  for (int64_t step = first;; step++) {
    fill(a, N, step);
    ckpt_state s = {.step = step};
    ckpt_snapshot(e, &s);
    ckpt_wait_copy(e);
    usleep(20000);
  }
}

static int temp_in(const char *remote) {
  char cmd[400];
  snprintf(cmd, sizeof cmd, "ls -a '%s' 2>/dev/null | grep -q '^.tmp-step-'", remote);
  return system(cmd) == 0;
}

static void test_remote_kill9(void) {
  char dir[256], remote[256];
  store_path(dir, sizeof dir, "repl-local");
  store_path(remote, sizeof remote, "repl-remote");
  enum { N = 2 << 20, ROUNDS = 4 };
  float *a = malloc(sizeof(float) * N);
  int midcopy = 0, checked = 0;
  for (int round = 0; round < ROUNDS; round++) {
    pid_t pid = fork();
    if (pid == 0) replicating_child(dir, remote, 1 + 1000 * round);
    int seen = 0;
    for (int i = 0; i < 30000 && !seen; i++) { /* bounded: 30 s */
      seen = temp_in(remote);
      if (!seen) usleep(1000);
    }
    usleep((useconds_t)(round * 300000)); /* 0 to 900 ms: into the first copy, or a later one */
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    midcopy += seen && temp_in(remote);
    ckpt_reader *r = ckpt_reader_open(remote);
    int64_t steps[16];
    int n = r ? ckpt_reader_steps(r, steps, 16) : 0;
    for (int i = 0; i < n; i++) {
      int ok = ckpt_reader_verify(r, steps[i]) == 0 &&
               ckpt_reader_read(r, steps[i], "param/a", a, sizeof(float) * N) == 0 && holds_step(a, N, steps[i]);
      CHECK(ok, "round %d: published remote step %lld verifies and holds its data: %s", round, (long long)steps[i],
            tr_error());
      checked += ok;
    }
    ckpt_reader_close(r);
  }
  CHECK(midcopy >= 1, "at least one kill landed mid-copy (%d of %d)", midcopy, ROUNDS);
  ckpt_engine *e = open_remote_engine(dir, remote, 0, 2); /* prepares the store: the dead one's temporary goes */
  CHECK(!temp_in(remote), "a dead replicator's temporary is removed when the store is prepared");
  ckpt_close(e);
  printf("remote kill -9: %d rounds, %d mid-copy, %d published checkpoints verified\n", ROUNDS, midcopy, checked);
  free(a);
}

/* The same on a host whose name has dots (node1.example.com): the
 * temporary's name carries it as node1_example_com, and preparing the
 * store must still recognise it as this host's. Run in a UTS namespace of
 * its own (root only: skipped, saying so, elsewhere). */
static void test_remote_stale_dotted_host(void) {
  char dir[256], remote[256];
  store_path(dir, sizeof dir, "dotted-local");
  store_path(remote, sizeof remote, "dotted-remote");
  pid_t child = fork();
  if (child == 0) {
    const char *name = "node1.example.com";
    if (unshare(CLONE_NEWUTS) != 0 || sethostname(name, strlen(name)) != 0) _exit(77);
    pid_t w = fork();
    if (w == 0) replicating_child(dir, remote, 1);
    int seen = 0;
    for (int i = 0; i < 30000 && !seen; i++) { /* bounded: 30 s */
      seen = temp_in(remote);
      if (!seen) usleep(1000);
    }
    kill(w, SIGKILL);
    waitpid(w, NULL, 0);
    if (!seen || !temp_in(remote)) _exit(78); /* the kill missed the copy: nothing to clean */
    ckpt_engine *e = open_remote_engine(dir, remote, 0, 2);
    int left = temp_in(remote);
    ckpt_close(e);
    _exit(left ? 1 : 0);
  }
  int status = 0;
  waitpid(child, &status, 0);
  int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (code == 77) {
    printf("remote temporaries on a dotted host name: skipped (no UTS namespace: not root)\n");
    return;
  }
  CHECK(code != 78, "the replicator was killed mid-copy on the dotted host");
  CHECK(code == 0, "a dead replicator's temporary on host node1.example.com is removed when the store is prepared "
                   "(child exit %d)", code);
}

/* ckpt_store_drop_after (a rollback's abandoned checkpoints): the steps
 * after the target go from both levels, a step in both counts once, the
 * rest stay loadable, and the engine commits on top of what is left. */
static void test_drop_after(void) {
  char dir[256], remote[256];
  store_path(dir, sizeof dir, "drop-local");
  store_path(remote, sizeof remote, "drop-remote");
  enum { N = 1000 };
  float *a = malloc(sizeof(float) * N);
  int64_t d[1] = {N};
  ckpt_engine *e = open_remote_engine(dir, remote, 0, 10);
  if (!e) return;
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  commit_steps(e, a, N, 10, 50, 10);
  ckpt_close(e);
  int64_t first = 0;
  int n = ckpt_store_drop_after(dir, remote, 20, &first, NULL);
  CHECK(n == 3 && first == 30, "3 steps dropped from 30 (both levels, counted once): %d from %lld: %s", n,
        (long long)first, tr_error());
  int64_t steps[16];
  ckpt_reader *r = ckpt_reader_open(dir);
  int nl = r ? ckpt_reader_steps(r, steps, 16) : -1;
  CHECK(nl == 2 && steps[0] == 10 && steps[1] == 20, "the local store keeps 10 and 20 (%d steps)", nl);
  CHECK(r && ckpt_reader_read(r, 20, "param/a", a, sizeof(float) * N) == 0 && holds_step(a, N, 20),
        "step 20 still loads: %s", tr_error());
  ckpt_reader_close(r);
  r = ckpt_reader_open(remote);
  int nr = r ? ckpt_reader_steps(r, steps, 16) : -1;
  CHECK(nr == 2 && steps[1] == 20, "the remote keeps 10 and 20 (%d steps, newest %lld)", nr,
        nr > 0 ? (long long)steps[nr - 1] : -1LL);
  ckpt_reader_close(r);
  CHECK(ckpt_store_drop_after(dir, remote, 20, &first, NULL) == 0, "nothing more to drop: %s", tr_error());
  e = open_remote_engine(dir, remote, 0, 10);
  if (!e) return;
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  commit_steps(e, a, N, 24, 24, 1);
  ckpt_close(e);
  CHECK(newest(dir) == 24, "the new timeline's step 24 is the newest (%lld)", (long long)newest(dir));
  store_path(dir, sizeof dir, "drop-none");
  CHECK(ckpt_store_drop_after(dir, NULL, 0, &first, NULL) == 0, "no store: nothing dropped, no error: %s", tr_error());
  free(a);
}

/* A store whose process was killed inside ckpt_open, after LMDB created
 * data.mdb and before the commit that creates the "manifest" and "data"
 * databases (or before LMDB wrote its first page: a data.mdb of 0 bytes),
 * holds no checkpoint: the reader opens it and lists none, a load says
 * there is none (not that the store is unreadable), it is not "damaged",
 * a remote level beside it is read, and an engine opened on it commits.
 * A resume took it for an unreadable store and refused to go on. */
static void test_never_committed(void) {
  enum { N = 1000 };
  float *a = malloc(sizeof(float) * N);
  int64_t d[1] = {N}, steps[8];
  char dir[256], path[300], remote[256], other[256];
  for (int zero = 0; zero < 2; zero++) {
    store_path(dir, sizeof dir, zero ? "never-committed-0" : "never-committed");
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    CHECK(tr_mkdirs(dir) == 0, "mkdir %s", dir);
    if (zero) { /* killed between LMDB's open(O_CREAT) and its first page */
      int fd = open(path, O_CREAT | O_WRONLY, 0644);
      CHECK(fd >= 0, "creating %s", path);
      if (fd >= 0) close(fd);
    } else { /* the environment, no databases */
      MDB_env *env;
      int rc = mdb_env_create(&env);
      if (!rc) mdb_env_set_maxdbs(env, 4);
      if (!rc) rc = mdb_env_open(env, dir, 0, 0644);
      mdb_env_close(env);
      struct stat st;
      CHECK(rc == 0 && stat(path, &st) == 0, "an LMDB environment without databases in %s: %s", dir,
            mdb_strerror(rc));
    }
    const char *what = zero ? "a data.mdb of 0 bytes" : "a store without databases";
    ckpt_reader *r = ckpt_reader_open(dir);
    CHECK(r != NULL, "%s opens: %s", what, tr_error());
    int n = r ? ckpt_reader_steps(r, steps, 8) : -1;
    CHECK(n == 0, "%s holds no checkpoint (%d: %s)", what, n, tr_error());
    CHECK(!r || ckpt_reader_verify(r, 10) != 0, "%s has no step 10 to verify", what);
    ckpt_target t = {"param/a", a, sizeof(float) * N};
    ckpt_state st;
    CHECK(!r || (ckpt_load(r, -1, &t, 1, &st, NULL, 0) != 0 && strstr(tr_error(), "no committed checkpoint")),
          "a load from %s says there is none: %s", what, tr_error());
    ckpt_reader_close(r);
    CHECK(ckpt_store_damaged(dir) == 0, "%s is not damaged", what);
    if (!zero) { /* its remote level is read beside it (an operator's --resume) */
      store_path(other, sizeof other, "never-committed-other");
      store_path(remote, sizeof remote, "never-committed-remote");
      ckpt_engine *e = open_remote_engine(other, remote, 0, 10);
      if (e) {
        ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
        commit_steps(e, a, N, 10, 20, 10);
        ckpt_close(e);
      }
      r = ckpt_reader_open(dir);
      n = r && ckpt_reader_set_remote(r, remote) == 0 ? ckpt_reader_steps(r, steps, 8) : -1;
      CHECK(n == 2 && steps[1] == 20, "the remote level's steps 10 and 20 beside it (%d: %s)", n, tr_error());
      memset(a, 0, sizeof(float) * N);
      CHECK(r && ckpt_load(r, -1, &t, 1, &st, NULL, 0) == 0 && st.step == 20 && holds_step(a, N, 20),
            "step 20 loads from the remote level: %s", tr_error());
      ckpt_reader_close(r);
    }
    ckpt_engine *e = open_engine(dir, 5, 0, CKPT_COALESCE, 0);
    if (!e) continue;
    ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
    commit_steps(e, a, N, 10, 10, 10);
    ckpt_close(e);
    CHECK(newest(dir) == 10, "an engine opened on %s commits step 10 (%lld)", what, (long long)newest(dir));
  }
  free(a);
}

/* A drop that fails says in which level: a remote step that cannot be
 * removed (a directory in its file's place: unlink fails, root or not)
 * after the local store's steps went; a local store LMDB refuses, and then
 * the remote level was not touched. */
static void test_drop_failed_level(void) {
  char dir[256], remote[256], stuck[600], aside[620];
  store_path(dir, sizeof dir, "dropfail-local");
  store_path(remote, sizeof remote, "dropfail-remote");
  enum { N = 1000 };
  float *a = malloc(sizeof(float) * N);
  int64_t d[1] = {N}, first = 0, steps[16];
  ckpt_engine *e = open_remote_engine(dir, remote, 0, 10);
  if (!e) return;
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  commit_steps(e, a, N, 10, 50, 10);
  ckpt_close(e);
  snprintf(stuck, sizeof stuck, "%s/step-%020lld.ckpt", remote, 40LL);
  snprintf(aside, sizeof aside, "%s.aside", stuck);
  CHECK(rename(stuck, aside) == 0 && mkdir(stuck, 0755) == 0, "a directory in step 40's place: %s", strerror(errno));
  ckpt_level failed = CKPT_LEVEL_NONE;
  int n = ckpt_store_drop_after(dir, remote, 20, &first, &failed);
  CHECK(n < 0 && failed == CKPT_LEVEL_REMOTE, "the remote drop failed, and says so: %d, level %d: %s", n, (int)failed,
        tr_error());
  CHECK(newest(dir) == 20, "the local store's steps after 20 went first (newest %lld)", (long long)newest(dir));
  CHECK(access(stuck, F_OK) == 0, "step 40 stays in the remote level");
  rmdir(stuck);
  CHECK(rename(aside, stuck) == 0, "step 40 back: %s", strerror(errno));
  /* the local store refused (garbage where data.mdb was): nothing dropped anywhere */
  char mdb[300], junk[4096];
  snprintf(mdb, sizeof mdb, "%s/data.mdb", dir);
  memset(junk, 0xff, sizeof junk);
  FILE *f = fopen(mdb, "wb");
  CHECK(f && fwrite(junk, 1, sizeof junk, f) == sizeof junk, "garbage over %s", mdb);
  if (f) fclose(f);
  failed = CKPT_LEVEL_NONE;
  n = ckpt_store_drop_after(dir, remote, 20, &first, &failed);
  CHECK(n < 0 && failed == CKPT_LEVEL_LOCAL, "the local drop failed, and says so: %d, level %d: %s", n, (int)failed,
        tr_error());
  ckpt_reader *r = ckpt_reader_open(remote);
  int nr = r ? ckpt_reader_steps(r, steps, 16) : -1;
  CHECK(nr >= 1 && steps[nr - 1] == 40,
        "the remote level was not touched: it still holds step 40 (%d steps, newest %lld)", nr,
        nr > 0 ? (long long)steps[nr - 1] : -1LL);
  ckpt_reader_close(r);
  free(a);
}

/* keep_every keeps steps beyond the keep_last + 2 an automatic map
 * (map_bytes 0) is sized for: the map grows when it fills, every commit
 * succeeds and every kept step reads back. */
static void test_map_grows(void) {
  char dir[256];
  store_path(dir, sizeof dir, "grows");
  enum { N = 1 << 20, STEPS = 12 }; /* 4 MiB a snapshot; the first map holds about 7 */
  ckpt_engine *e = open_engine(dir, 1, 1, CKPT_COALESCE, 0);
  float *a = malloc(sizeof(float) * N);
  if (!e || !a) return;
  int64_t d[1] = {N};
  CHECK(ckpt_register(e, "param/a", CKPT_F32, 1, d, a) == 0, "register: %s", tr_error());
  int ok = 0, events = 0;
  char what[256] = "";
  for (int64_t step = 1; step <= STEPS; step++) {
    fill(a, N, step);
    ckpt_state st = {.step = step};
    ckpt_snapshot(e, &st);
    ckpt_wait_copy(e);
    ckpt_flush(e);
    ckpt_event ev;
    while (ckpt_poll(e, &ev)) {
      events++, ok += ev.ok;
      if (!ev.ok && !what[0]) snprintf(what, sizeof what, "%s", ev.what);
    }
  }
  ckpt_close(e);
  CHECK(events == STEPS && ok == STEPS, "keep_every = 1 past the automatic map: %d of %d commits ok (%s)", ok, events,
        what);
  ckpt_reader *r = ckpt_reader_open(dir);
  int64_t steps[32];
  int n = r ? ckpt_reader_steps(r, steps, 32) : -1;
  int good = 0;
  for (int i = 0; i < n; i++)
    good += ckpt_reader_read(r, steps[i], "param/a", a, sizeof(float) * N) == 0 && holds_step(a, N, steps[i]);
  CHECK(n == STEPS && good == STEPS, "all %d kept steps read back (%d listed, %d good)", STEPS, n, good);
  ckpt_reader_close(r);
  free(a);
}

/* More checkpoints than a listing holds (keep_every keeps one per N steps
 * for a whole run): ckpt_reader_steps returns the newest cap, so a resume
 * (ckpt_load lists 4096) starts from the newest, at both levels. The local
 * store's manifests are written straight through LMDB (keys only matter
 * here); the remote store's are empty files (names only matter). */
static void test_many_steps(void) {
  enum { MANY = 5000, CAP = 4096 };
  char dir[256], remote[256], path[512];
  store_path(dir, sizeof dir, "many-local");
  store_path(remote, sizeof remote, "many-remote");
  CHECK(tr_mkdirs(dir) == 0 && tr_mkdirs(remote) == 0, "mkdirs: %s", tr_error());
  MDB_env *env = NULL;
  MDB_txn *txn = NULL;
  MDB_dbi man, data;
  int rc = mdb_env_create(&env);
  if (!rc) mdb_env_set_maxdbs(env, 4);
  if (!rc) rc = mdb_env_open(env, dir, MDB_NOSYNC, 0644);
  if (!rc) rc = mdb_txn_begin(env, NULL, 0, &txn);
  if (!rc) rc = mdb_dbi_open(txn, "manifest", MDB_CREATE, &man);
  if (!rc) rc = mdb_dbi_open(txn, "data", MDB_CREATE, &data);
  for (int64_t s = 1; !rc && s <= MANY; s++) {
    uint8_t kb[8];
    for (int i = 0; i < 8; i++) kb[i] = (uint8_t)((uint64_t)s >> (56 - 8 * i)); /* big-endian, as the engine's */
    MDB_val k = {8, kb}, v = {1, "m"};
    rc = mdb_put(txn, man, &k, &v, 0);
  }
  if (!rc) rc = mdb_txn_commit(txn);
  else if (txn) mdb_txn_abort(txn);
  if (env) mdb_env_close(env);
  CHECK(rc == 0, "writing %d manifests: %s", MANY, mdb_strerror(rc));
  for (int64_t s = 1; s <= MANY; s++) {
    snprintf(path, sizeof path, "%s/step-%020lld.ckpt", remote, (long long)(s * 7));
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) close(fd);
  }
  int64_t *steps = malloc(sizeof *steps * CAP);
  if (!steps) return;
  const char *what[2] = {"local", "remote"};
  const int64_t top[2] = {MANY, (int64_t)MANY * 7};
  for (int level = 0; level < 2; level++) {
    ckpt_reader *r = ckpt_reader_open(level ? remote : dir);
    CHECK(r != NULL, "reader: %s", tr_error());
    int n = r ? ckpt_reader_steps(r, steps, CAP) : -1;
    int asc = 1;
    for (int i = 1; i < n; i++) asc &= steps[i - 1] < steps[i];
    CHECK(n == CAP && asc && steps[n - 1] == top[level] && steps[0] == top[level] - (int64_t)(CAP - 1) * (level ? 7 : 1),
          "%s, %d steps: the newest %d, ascending (got %d, %lld .. %lld)", what[level], MANY, CAP, n,
          n > 0 ? (long long)steps[0] : -1LL, n > 0 ? (long long)steps[n - 1] : -1LL);
    ckpt_reader_close(r);
  }
  free(steps);
}

/* A remote file whose manifest (CRC intact: written on purpose, or by a
 * bug) gives tensor sizes that sum past 2^64 to the bytes the file holds:
 * refused when opened, never read past the mapping. */
static void put(uint8_t *m, size_t *n, const void *v, size_t len) {
  memcpy(m + *n, v, len);
  *n += len;
}
static void test_remote_size_wrap(void) {
  char remote[256], path[512];
  store_path(remote, sizeof remote, "wrap-remote");
  CHECK(tr_mkdirs(remote) == 0, "mkdirs: %s", tr_error());
  uint8_t m[256];
  size_t n = 0;
  uint32_t magic = 0x4b435254u, version = 1, nt = 2, crc = 0;
  int64_t step = 9, zero = 0;
  uint64_t chunk = (uint64_t)16 << 20, sizes[2] = {UINT64_MAX - 7, 16}; /* sum mod 2^64: 8 */
  put(m, &n, &magic, 4);
  put(m, &n, &version, 4);
  put(m, &n, &step, 8);
  for (int i = 0; i < 4; i++) put(m, &n, &zero, 8); /* data_rng, opt_steps, config_hash, wall_time */
  put(m, &n, &nt, 4);
  put(m, &n, &chunk, 8);
  for (int i = 0; i < 2; i++) {
    uint16_t len = 1;
    uint8_t dt = CKPT_U8, nd = 1;
    int64_t dim = (int64_t)(sizes[i] & INT64_MAX);
    put(m, &n, &len, 2);
    put(m, &n, i ? "b" : "a", 1);
    put(m, &n, &dt, 1);
    put(m, &n, &nd, 1);
    put(m, &n, &dim, 8);
    put(m, &n, &sizes[i], 8);
    put(m, &n, &crc, 4);
  }
  crc = tr_crc32c(0, m, n);
  put(m, &n, &crc, 4);
  snprintf(path, sizeof path, "%s/step-%020lld.ckpt", remote, (long long)step);
  FILE *f = fopen(path, "wb");
  uint64_t mlen = n;
  fwrite("TRCKREM1", 1, 8, f);
  fwrite(&mlen, 8, 1, f);
  fwrite(m, 1, n, f);
  fwrite("01234567", 1, 8, f); /* the 8 bytes the wrapped sum claims */
  fclose(f);
  ckpt_reader *r = ckpt_reader_open(remote);
  CHECK(r != NULL, "reader: %s", tr_error());
  CHECK(r && ckpt_reader_verify(r, step) != 0, "tensor sizes summing past 2^64 are refused");
  ckpt_reader_close(r);
}

/* A store holding a step newer than the one being committed (resumed
 * from an older step because the newest was damaged, or a rollback whose
 * drop failed): retention keeps the newest keep_last by step, but never
 * deletes the checkpoint it is committing, which would be reported
 * committed and not be there. */
static void test_retention_keeps_new(void) {
  char dir[256], remote[256];
  store_path(dir, sizeof dir, "keep-new");
  store_path(remote, sizeof remote, "keep-new-remote");
  enum { N = 1000 };
  float *a = malloc(sizeof(float) * N), *back = malloc(sizeof(float) * N);
  int64_t d[1] = {N};
  ckpt_engine *e = open_remote_engine(dir, remote, 0, 1);
  if (!e || !a || !back) return;
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  commit_steps(e, a, N, 20, 20, 1);
  ckpt_close(e);
  e = open_remote_engine(dir, remote, 0, 1); /* the run goes on from step 10 */
  if (!e) return;
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  commit_steps(e, a, N, 11, 12, 1);
  ckpt_close(e);
  for (int level = 0; level < 2; level++) {
    const char *where = level ? "remote" : "local";
    ckpt_reader *r = ckpt_reader_open(level ? remote : dir);
    int64_t steps[8];
    int n = r ? ckpt_reader_steps(r, steps, 8) : -1;
    CHECK(n == 2 && steps[0] == 12 && steps[1] == 20, "%s: step 12 (just committed) kept beside 20: %d steps%s", where,
          n, n > 0 && steps[0] != 12 ? " (12 deleted by its own retention)" : "");
    CHECK(r && ckpt_reader_verify(r, 12) == 0 && ckpt_reader_read(r, 12, "param/a", back, sizeof back[0] * N) == 0 &&
              holds_step(back, N, 12),
          "%s: step 12 verifies and holds its data: %s", where, tr_error());
    ckpt_reader_close(r);
  }
  free(a);
  free(back);
}

typedef struct {
  ckpt_engine *e;
  atomic_int done;
} flush_arg;

static void *flush_thread(void *p) {
  flush_arg *f = p;
  ckpt_flush(f->e);
  atomic_store(&f->done, 1);
  return NULL;
}

/* A remote that stops taking bytes (a hung network mount): the
 * replicator's temporary for step 1 is a FIFO this test opened and never
 * reads, so its writes block once the pipe is full. Step 2 still commits
 * to the local store meanwhile (ckpt_flush returns, the step is there);
 * then the pipe is closed and the engine closes cleanly. */
static void test_remote_stuck(void) {
  char dir[256], remote[256], fifo[700], host[256];
  store_path(dir, sizeof dir, "stuck-local");
  store_path(remote, sizeof remote, "stuck-remote");
  enum { N = 1 << 20 }; /* 4 MiB: more than a pipe holds */
  float *a = malloc(sizeof(float) * N);
  int64_t d[1] = {N};
  ckpt_engine *e = open_remote_engine(dir, remote, 0, 3);
  if (!e || !a) return;
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  host[0] = 0;
  gethostname(host, sizeof host - 1);
  host[sizeof host - 1] = 0;
  for (char *c = host; *c; c++)
    if (*c == '.' || *c == '/') *c = '_'; /* ckpt_remote.c's temporary names */
  snprintf(fifo, sizeof fifo, "%s/.tmp-step-1.%s.%ld", remote, host, (long)getpid());
  CHECK(mkfifo(fifo, 0600) == 0, "mkfifo %s: %s", fifo, strerror(errno));
  int rd = open(fifo, O_RDONLY | O_NONBLOCK);
  CHECK(rd >= 0, "open %s: %s", fifo, strerror(errno));
  fill(a, N, 1);
  ckpt_state st = {.step = 1};
  CHECK(ckpt_snapshot(e, &st) == 0, "snapshot 1: %s", tr_error());
  ckpt_wait_copy(e);
  ckpt_flush(e);
  int queued = 0; /* the replicator has filled the pipe: its write blocks */
  for (double end = tr_now() + 60; rd >= 0 && tr_now() < end; usleep(10000)) {
    int q = 0;
    if (ioctl(rd, FIONREAD, &q) == 0) queued = q;
    if (queued > 4096) break; /* the tensor's bytes (header and manifest take less): they cannot all fit */
  }
  CHECK(queued > 4096, "the replicator writes the tensor into the FIFO (%d bytes queued)", queued);
  fill(a, N, 2);
  st.step = 2;
  CHECK(ckpt_snapshot(e, &st) == 0, "snapshot 2: %s", tr_error());
  ckpt_wait_copy(e);
  flush_arg f = {.e = e};
  pthread_t th;
  pthread_create(&th, NULL, flush_thread, &f);
  for (double end = tr_now() + 60; !atomic_load(&f.done) && tr_now() < end;) usleep(10000);
  CHECK(atomic_load(&f.done), "step 2 commits locally while the remote is stuck (ckpt_flush returned)");
  ckpt_reader *r = ckpt_engine_reader(e); /* (LMDB: one environment per store and process) */
  int64_t steps[4];
  int n = r ? ckpt_reader_steps(r, steps, 4) : -1;
  CHECK(n == 2 && steps[1] == 2, "the local store holds steps 1 and 2 (%d steps)", n);
  ckpt_reader_close(r);
  if (rd >= 0) close(rd); /* the replicator's write fails (EPIPE); it goes on to step 2 */
  pthread_join(th, NULL);
  ckpt_close(e);
  r = ckpt_reader_open(remote);
  n = r ? ckpt_reader_steps(r, steps, 4) : -1;
  CHECK(n >= 1 && steps[n - 1] == 2, "the remote gets step 2 once the FIFO is gone (%d steps): %s", n,
        n < 0 ? tr_error() : "");
  ckpt_reader_close(r);
  unlink(fifo);
  free(a);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN); /* test_remote_stuck closes the FIFO under a write */
  if (!mkdtemp(root)) return 1;
  test_map_grown_elsewhere();
  test_lazy_copy_and_retention();
  test_corruption();
  test_expect_model();
  test_full_store();
  test_map_lost();
  test_damaged_list();
  test_stale_reader();
  test_kill9();
  test_unwritable();
  test_device_staging();
  test_when_busy(CKPT_SKIP);
  test_when_busy(CKPT_COALESCE);
  test_pacing();
  test_remote_levels();
  test_remote_kill9();
  test_remote_stale_dotted_host();
  test_drop_after();
  test_never_committed();
  test_drop_failed_level();
  test_many_steps();
  test_map_grows();
  test_remote_size_wrap();
  test_remote_stuck();
  test_retention_keeps_new();
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf %s", root);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", root);
  return check_report("test_ckpt");
}
