/* ckpt.c — the checkpoint engine (see ckpt.h for the design).
 *
 * Sections: keys, manifest encoding, the engine (snapshot and its busy
 * policy, copy thread, writer thread with retention and pacing), level 3
 * (the replicator thread; the remote store's files are ckpt_remote.c), the
 * reader (both levels; verify; load on two threads).
 *
 * LMDB layout, one environment per run (RUN/ckpt/):
 *   db "manifest": key = step (8 bytes big-endian, so keys sort by step)
 *                  value = manifest (see encode_manifest; decoded by
 *                  ckpt_manifest_decode, ckpt_internal.h)
 *   db "data":     key = step (8 BE) | tensor index (4 BE) | chunk (4 BE)
 *                  value = at most CHUNK bytes of the tensor
 */
#include "ckpt.h"
#include "ckpt_internal.h"

#include <errno.h>
#include <limits.h>
#include <lmdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <sys/time.h>
#include <time.h>

#include "backend.h"
#include "crc32c.h"
#include "util.h"

#define CHUNK ((uint64_t)16 << 20)
#define MANIFEST_MAGIC 0x4b435254u /* "TRCK" little-endian */
#define MANIFEST_VERSION 1u
#define MAX_EVENTS 64
#define CKPT_GONE 3 /* replicate: the step left the local store first (not an error) */

/* --- keys --- */

static void put_be64(uint8_t *p, uint64_t v) {
  for (int i = 7; i >= 0; i--, v >>= 8) p[i] = (uint8_t)v;
}
static void put_be32(uint8_t *p, uint32_t v) {
  for (int i = 3; i >= 0; i--, v >>= 8) p[i] = (uint8_t)v;
}
static uint64_t get_be64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v = v << 8 | p[i];
  return v;
}

/* --- manifest encoding (little-endian, bounds-checked on read) --- */

typedef struct {
  uint8_t *p;
  size_t n, cap;
  int oom;
} wbuf;

static void wb_put(wbuf *b, const void *src, size_t len) {
  if (b->oom) return;
  if (b->n + len > b->cap) {
    size_t ncap = (b->cap ? b->cap * 2 : 1024) + len;
    uint8_t *np = realloc(b->p, ncap);
    if (!np) {
      b->oom = 1;
      return;
    }
    b->p = np;
    b->cap = ncap;
  }
  memcpy(b->p + b->n, src, len);
  b->n += len;
}
#define WB(b, v)                     \
  do {                               \
    __typeof__(v) tmp_ = (v);        \
    wb_put((b), &tmp_, sizeof tmp_); \
  } while (0)

typedef struct {
  const uint8_t *p;
  size_t n, off;
  int bad;
} rbuf;

static void rb_get(rbuf *r, void *dst, size_t len) {
  if (r->bad || len > r->n - r->off) {
    r->bad = 1;
    memset(dst, 0, len);
    return;
  }
  memcpy(dst, r->p + r->off, len);
  r->off += len;
}

static int encode_manifest(wbuf *b, const ckpt_state *s, const ckpt_tensor_info *t, int nt) {
  WB(b, (uint32_t)MANIFEST_MAGIC);
  WB(b, (uint32_t)MANIFEST_VERSION);
  WB(b, s->step);
  WB(b, s->data_rng);
  WB(b, s->opt_steps);
  WB(b, s->config_hash);
  WB(b, s->wall_time);
  WB(b, (uint32_t)nt);
  WB(b, (uint64_t)CHUNK);
  for (int i = 0; i < nt; i++) {
    uint16_t len = (uint16_t)strlen(t[i].name);
    WB(b, len);
    wb_put(b, t[i].name, len);
    WB(b, (uint8_t)t[i].dtype);
    WB(b, (uint8_t)t[i].ndim);
    for (int d = 0; d < t[i].ndim; d++) WB(b, t[i].dim[d]);
    WB(b, t[i].bytes);
    WB(b, t[i].crc);
  }
  if (!b->oom) WB(b, tr_crc32c(0, b->p, b->n));
  return b->oom ? tr_fail(TR_ENOMEM, "out of memory encoding a manifest") : TR_OK;
}

/* Decodes into m (tensors malloc'd into *tensors); see ckpt_internal.h. */
int ckpt_manifest_decode(const void *data, size_t len, ckpt_manifest *m, ckpt_tensor_info **tensors,
                         uint64_t *chunk) {
  rbuf r = {data, len, 0, 0};
  uint32_t magic, version, nt, crc;
  if (len < 8 + 4) return tr_fail(TR_EFORMAT, "manifest too short (%zu bytes)", len);
  memcpy(&crc, (const uint8_t *)data + len - 4, 4);
  if (tr_crc32c(0, data, len - 4) != crc) return tr_fail(TR_EFORMAT, "manifest checksum mismatch");
  r.n = len - 4;
  rb_get(&r, &magic, 4);
  rb_get(&r, &version, 4);
  if (magic != MANIFEST_MAGIC) return tr_fail(TR_EFORMAT, "bad manifest magic 0x%08x", magic);
  if (version != MANIFEST_VERSION) return tr_fail(TR_EFORMAT, "manifest version %u (this build reads %u)", version,
                                                  MANIFEST_VERSION);
  memset(m, 0, sizeof *m);
  rb_get(&r, &m->state.step, 8);
  rb_get(&r, &m->state.data_rng, 8);
  rb_get(&r, &m->state.opt_steps, 8);
  rb_get(&r, &m->state.config_hash, 8);
  rb_get(&r, &m->state.wall_time, 8);
  rb_get(&r, &nt, 4);
  rb_get(&r, chunk, 8);
  /* a tensor entry takes at least 16 bytes (name length, dtype, ndim, bytes,
   * crc): a count the value cannot hold is refused before the table is
   * allocated, so a short value cannot make the reader allocate much */
  if (r.bad || nt > 1000000 || nt > (r.n - r.off) / 16 || *chunk == 0)
    return tr_fail(TR_EFORMAT, "malformed manifest header");
  ckpt_tensor_info *t = calloc(nt ? nt : 1, sizeof *t);
  if (!t) return tr_fail(TR_ENOMEM, "out of memory reading a manifest");
  for (uint32_t i = 0; i < nt && !r.bad; i++) {
    uint16_t nlen;
    uint8_t dt, nd;
    rb_get(&r, &nlen, 2);
    if (nlen >= CKPT_NAME_MAX) r.bad = 1;
    rb_get(&r, t[i].name, r.bad ? 0 : nlen);
    rb_get(&r, &dt, 1);
    rb_get(&r, &nd, 1);
    if (nd > CKPT_MAX_DIMS) r.bad = 1;
    t[i].dtype = dt;
    t[i].ndim = nd;
    for (int d = 0; d < nd && !r.bad; d++) rb_get(&r, &t[i].dim[d], 8);
    rb_get(&r, &t[i].bytes, 8);
    rb_get(&r, &t[i].crc, 4);
    if (m->bytes + t[i].bytes < m->bytes) r.bad = 1; /* sizes that wrap would pass a reader's total check */
    m->bytes += t[i].bytes;
  }
  if (r.bad || r.off != r.n) {
    free(t);
    return tr_fail(TR_EFORMAT, "malformed manifest tensor table");
  }
  m->ntensors = (int)nt;
  m->tensors = t;
  *tensors = t;
  return TR_OK;
}

/* --- LMDB helpers --- */

/* The LMDB code of this thread's last mdb_fail (commit tells a full map
 * from other failures by it). */
static _Thread_local int mdb_last;

static int mdb_fail(int rc, const char *what) {
  mdb_last = rc;
  if (rc == MDB_MAP_FULL)
    return tr_fail(TR_EIO, "%s: the checkpoint store is full (LMDB map size reached; raise checkpoint.map_mb)", what);
  return tr_fail(TR_EIO, "%s: %s", what, mdb_strerror(rc));
}

/* mdb_txn_begin, where another process may have grown the map: when the
 * leader's writer commits with a larger map than this environment's (a
 * replica opening the store while the first checkpoint commits, a reader
 * opened before it), LMDB says MDB_MAP_RESIZED; its remedy is to adopt the
 * new size and begin again. remap = 0 where this process may have other
 * transactions on env (a borrowed reader): the remap would pull the map from
 * under them. */
static int txn_begin_remap(MDB_env *env, unsigned flags, MDB_txn **txn, int remap, int *map_lost) {
  int rc = mdb_txn_begin(env, NULL, flags, txn);
  for (int i = 0; rc == MDB_MAP_RESIZED && remap && i < 8; i++) {
    rc = mdb_env_set_mapsize(env, 0);
    if (rc) {
      if (map_lost) *map_lost = 1; /* see map_lost below */
      return rc;
    }
    rc = mdb_txn_begin(env, NULL, flags, txn);
  }
  return rc;
}
static int txn_begin(MDB_env *env, unsigned flags, MDB_txn **txn, int remap) {
  return txn_begin_remap(env, flags, txn, remap, NULL);
}

/* Every key of the manifest database, read once: a damaged page of the
 * list of checkpoints shows here (opening the databases reads none of
 * it). 0, or LMDB's code. */
static int manifest_walk(MDB_txn *txn, MDB_dbi man) {
  MDB_cursor *c;
  int rc = mdb_cursor_open(txn, man, &c);
  if (rc) return rc;
  MDB_val k, v;
  for (rc = mdb_cursor_get(c, &k, &v, MDB_FIRST); rc == 0; rc = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
  }
  mdb_cursor_close(c);
  return rc == MDB_NOTFOUND ? 0 : rc;
}

/* Deletes every data chunk and the manifest of `step` inside txn. */
static int delete_step(MDB_txn *txn, MDB_dbi man, MDB_dbi data, int64_t step) {
  uint8_t k[16];
  put_be64(k, (uint64_t)step);
  memset(k + 8, 0, 8);
  MDB_cursor *c;
  int rc = mdb_cursor_open(txn, data, &c);
  if (rc) return mdb_fail(rc, "cursor");
  MDB_val key = {16, k}, val;
  rc = mdb_cursor_get(c, &key, &val, MDB_SET_RANGE);
  while (rc == 0 && key.mv_size == 16 && get_be64(key.mv_data) == (uint64_t)step) {
    if ((rc = mdb_cursor_del(c, 0))) break;
    rc = mdb_cursor_get(c, &key, &val, MDB_GET_CURRENT);
    if (rc == EINVAL) rc = mdb_cursor_get(c, &key, &val, MDB_NEXT); /* deleted the last item */
  }
  mdb_cursor_close(c);
  if (rc && rc != MDB_NOTFOUND) return mdb_fail(rc, "deleting checkpoint data");
  MDB_val mk = {8, k};
  rc = mdb_del(txn, man, &mk, NULL);
  if (rc && rc != MDB_NOTFOUND) return mdb_fail(rc, "deleting a manifest");
  return TR_OK;
}

/* --- the engine --- */

typedef struct {
  ckpt_tensor_info info;
  const void *ptr;
  uint64_t off; /* in a staging buffer */
} reg_tensor;

enum { BUF_FREE, BUF_COPYING, BUF_STAGED, BUF_WRITING };

typedef struct {
  int state;
  ckpt_state st;
  uint8_t *data;
  double copy_s, copy_cpu_s;
  double started; /* tr_now() at ckpt_snapshot */
  uint64_t seq; /* order of snapshots */
} stage_buf;

struct ckpt_engine {
  ckpt_opts o;
  char dir[1024];
  MDB_env *env;
  MDB_dbi man, data;
  reg_tensor *t;
  int nt, capt;
  uint64_t total;
  stage_buf buf[2];
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pthread_t copier, writer;
  int threads_started, stop;
  int copy_req; /* buffer index to copy, -1 = none */
  ckpt_event events[MAX_EVENTS];
  int ev_head, ev_count;
  ckpt_stats stats;
  uint64_t seq;
  const tr_backend *dev; /* NULL: registered tensors are host memory */
  int pinned[2]; /* 1 page-locked, -1 could not be (used unpinned), 0 not tried yet */
  /* pacing: a checkpoint's CPU (copy + commit threads) spread so that the
   * engine uses at most cpu_share of the machine; no snapshot is taken
   * before rest_until (ckpt_flush ends the rest) */
  double cpu_share, rest_until;
  int pending; /* a snapshot was deferred (coalesce): ckpt_pending */
  /* level 3: the replicator thread copies the newest committed checkpoint
   * (repl_want) to the remote store; repl_done is the last one it tried */
  char remote[1024]; /* "" = no remote level */
  double remote_rate; /* bytes/s, 0 = no limit */
  pthread_t replicator;
  int repl_started;
  int64_t repl_want, repl_done;
  /* held around every transaction of the replicator and around the
   * writer's map changes: LMDB resizes a map only while this process has
   * no transaction open on it */
  pthread_mutex_t map_mu;
  /* A map change failed (mmap: out of memory or address space): LMDB has
   * unmapped the old map and keeps no usable one (its next transaction
   * would read the unmapped meta pages). From then on every use of env is
   * refused with map_why; the store's file is intact. Under map_mu. */
  atomic_int map_lost; /* read without the lock by borrowed readers */
  char map_why[160];
};

/* Records a failed map change (map_mu held) and returns its error. */
static int map_lost_fail(ckpt_engine *e, int rc, const char *what) {
  snprintf(e->map_why, sizeof e->map_why, "%s: %s", what, mdb_strerror(rc));
  atomic_store(&e->map_lost, 1);
  mdb_last = rc;
  return tr_fail(TR_EIO, "%s: %s (the store is intact; no more checkpoints in this process)", what,
                 mdb_strerror(rc));
}

/* The error for any use of env after a failed map change (map_mu held). */
static int map_lost_refuse(const ckpt_engine *e) {
  return tr_fail(TR_EIO, "the checkpoint store is unusable in this process since %s (it is intact on disk)",
                 e->map_why);
}

/* mdb_env_set_mapsize for the engine (map_mu held): a failure loses the map. */
static int engine_set_map(ckpt_engine *e, size_t size, const char *what) {
  if (e->map_lost) return map_lost_refuse(e);
  int rc = mdb_env_set_mapsize(e->env, size);
  return rc ? map_lost_fail(e, rc, what) : TR_OK;
}

/* txn_begin for the engine (map_mu held): refused once the map was lost,
 * and loses it if adopting a map grown elsewhere fails. 0 or an error
 * already reported (tr_error; mdb_last set). */
static int engine_txn_begin(ckpt_engine *e, unsigned flags, MDB_txn **txn, int remap, const char *what) {
  if (e->map_lost) return map_lost_refuse(e);
  int lost = 0, rc = txn_begin_remap(e->env, flags, txn, remap, &lost);
  if (lost) return map_lost_fail(e, rc, "adopting the checkpoint store's grown map");
  return rc ? mdb_fail(rc, what) : TR_OK;
}

/* The CPU seconds the calling thread has used. */
static double thread_cpu(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void push_event(ckpt_engine *e, const ckpt_event *ev) { /* with e->mu held */
  if (e->ev_count == MAX_EVENTS) {
    e->ev_head = (e->ev_head + 1) % MAX_EVENTS;
    e->ev_count--;
  }
  e->events[(e->ev_head + e->ev_count) % MAX_EVENTS] = *ev;
  e->ev_count++;
}

/* Level 1: registered tensors -> staging buffer b (the copy thread). */
static int copy_tensors(ckpt_engine *e, stage_buf *b) {
  if (!e->dev || e->dev->host_memory) {
    for (int i = 0; i < e->nt; i++) memcpy(b->data + e->t[i].off, e->t[i].ptr, e->t[i].info.bytes);
    return TR_OK;
  }
  int rc = TR_OK;
  if (!e->dev->ckpt_copy) { /* device memory, but no side-stream copies: the backend's own (waiting) download */
    for (int i = 0; i < e->nt && !rc; i++) rc = e->dev->download(b->data + e->t[i].off, e->t[i].ptr, e->t[i].info.bytes);
    return rc;
  }
  for (int i = 0; i < e->nt && !rc; i++) rc = e->dev->ckpt_copy(b->data + e->t[i].off, e->t[i].ptr, e->t[i].info.bytes);
  int rc2 = e->dev->ckpt_wait ? e->dev->ckpt_wait() : TR_OK; /* even after a failure: nothing may still write into b */
  return rc ? rc : rc2;
}

static void *copy_main(void *arg) {
  ckpt_engine *e = arg;
  pthread_mutex_lock(&e->mu);
  for (;;) {
    while (e->copy_req < 0 && !e->stop) pthread_cond_wait(&e->cv, &e->mu);
    if (e->copy_req < 0) break;
    stage_buf *b = &e->buf[e->copy_req];
    pthread_mutex_unlock(&e->mu);
    double t0 = tr_now(), c0 = thread_cpu();
    int rc = copy_tensors(e, b);
    double dt = tr_now() - t0;
    pthread_mutex_lock(&e->mu);
    b->copy_s = dt;
    b->copy_cpu_s = thread_cpu() - c0;
    b->state = rc ? BUF_FREE : BUF_STAGED;
    if (rc) { /* nothing half-copied is ever committed */
      ckpt_event ev = {.step = b->st.step, .ok = 0, .copy_s = dt};
      snprintf(ev.what, sizeof ev.what, "level-1 copy from the device failed: %s", e->dev->error());
      push_event(e, &ev);
      e->stats.failed++;
    }
    e->copy_req = -1;
    e->stats.copy_s += dt;
    pthread_cond_broadcast(&e->cv);
  }
  pthread_mutex_unlock(&e->mu);
  return NULL;
}

/* Level 2, phase 1: every tensor's chunks into txn. MDB_RESERVE hands back
 * the value's pages and one pass (tr_crc32c_copy) checksums the staged bytes
 * and copies them there: the bytes are read once, written once. The CRCs go
 * into info for the manifest. */
static int put_tensors(ckpt_engine *e, MDB_txn *txn, const stage_buf *b, ckpt_tensor_info *info) {
  int64_t step = b->st.step;
  for (int i = 0; i < e->nt; i++) {
    uint64_t bytes = e->t[i].info.bytes;
    const uint8_t *src = b->data + e->t[i].off;
    uint32_t crc = 0;
    for (uint64_t c = 0, off = 0; off < bytes || (bytes == 0 && c == 0); c++, off += CHUNK) {
      uint8_t k[16];
      put_be64(k, (uint64_t)step);
      put_be32(k + 8, (uint32_t)i);
      put_be32(k + 12, (uint32_t)c);
      MDB_val key = {16, k}, val = {bytes - off < CHUNK ? bytes - off : CHUNK, NULL};
      int mrc = mdb_put(txn, e->data, &key, &val, MDB_RESERVE);
      if (mrc) return mdb_fail(mrc, "writing checkpoint data");
      crc = tr_crc32c_copy(crc, val.mv_data, src + off, val.mv_size);
      if (bytes == 0) break;
    }
    info[i] = e->t[i].info;
    info[i].crc = crc;
  }
  return TR_OK;
}

/* Level 2, phase 2: the manifest (after the data: it holds their CRCs). */
static int put_manifest(ckpt_engine *e, MDB_txn *txn, const ckpt_state *s, const ckpt_tensor_info *info) {
  wbuf mb = {0};
  int rc = encode_manifest(&mb, s, info, e->nt);
  if (!rc) {
    uint8_t mk[8];
    put_be64(mk, (uint64_t)s->step);
    MDB_val key = {8, mk}, val = {mb.n, mb.p};
    int mrc = mdb_put(txn, e->man, &key, &val, 0);
    if (mrc) rc = mdb_fail(mrc, "writing the manifest");
  }
  free(mb.p);
  return rc;
}

/* Level 2, phase 3: retention inside the same txn: keep the newest
 * keep_last, every keep_every-th step, and `just` (the step committed). */
static int apply_retention(ckpt_engine *e, MDB_txn *txn, int64_t just) {
  MDB_cursor *c;
  int mrc = mdb_cursor_open(txn, e->man, &c), rc = TR_OK;
  if (mrc) return mdb_fail(mrc, "cursor");
  int64_t *steps = NULL;
  int n = 0, cap = 0;
  MDB_val k2, v2;
  for (mrc = mdb_cursor_get(c, &k2, &v2, MDB_FIRST); mrc == 0; mrc = mdb_cursor_get(c, &k2, &v2, MDB_NEXT)) {
    if (k2.mv_size != 8) continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 64;
      int64_t *ns = realloc(steps, sizeof *ns * (size_t)cap);
      if (!ns) {
        rc = tr_fail(TR_ENOMEM, "out of memory applying retention");
        break;
      }
      steps = ns;
    }
    steps[n++] = (int64_t)get_be64(k2.mv_data);
  }
  mdb_cursor_close(c);
  if (!rc && mrc != MDB_NOTFOUND) rc = mdb_fail(mrc, "listing checkpoints for retention"); /* a damaged page */
  for (int i = 0; i < n - e->o.keep_last && !rc; i++) {
    if (e->o.keep_every > 0 && steps[i] % e->o.keep_every == 0) continue;
    if (steps[i] == just) continue; /* newer steps stay from before a resume (a damaged one skipped): the
                                     * checkpoint being committed is never its own retention's victim */
    rc = delete_step(txn, e->man, e->data, steps[i]);
  }
  free(steps);
  return rc;
}

/* An automatic map (map_bytes 0) that filled up: keep_every keeps steps
 * beyond the keep_last + 2 it was sized for. Doubles it (at least two
 * snapshots more); 0, or an error. */
static int grow_map(ckpt_engine *e) {
  MDB_envinfo info;
  pthread_mutex_lock(&e->map_mu);
  int rc = e->map_lost ? map_lost_refuse(e) : TR_OK;
  int mrc = rc ? 0 : mdb_env_info(e->env, &info);
  if (mrc) rc = mdb_fail(mrc, "growing the checkpoint store's map");
  if (!rc) {
    size_t more = (size_t)(e->total + (e->total >> 3) + (1 << 20)) * 2;
    rc = engine_set_map(e, info.me_mapsize + (info.me_mapsize > more ? info.me_mapsize : more),
                        "growing the checkpoint store's map");
  }
  pthread_mutex_unlock(&e->map_mu);
  return rc;
}

/* Level 2: one write transaction for the whole checkpoint plus retention;
 * the checkpoint exists once mdb_txn_commit returned. A full automatic map
 * grows and the checkpoint is written again (a few times at most). */
static int commit_once(ckpt_engine *e, stage_buf *b);
static int commit(ckpt_engine *e, stage_buf *b) {
  int rc = commit_once(e, b);
  for (int i = 0; rc && mdb_last == MDB_MAP_FULL && e->o.map_bytes == 0 && i < 4; i++) {
    mdb_last = 0;
    if ((rc = grow_map(e))) break;
    rc = commit_once(e, b);
  }
  return rc;
}

/* Read slots of processes that died in a read transaction (`transom ckpt
 * verify` interrupted, a replica killed while it loaded) pin the snapshot
 * they read: LMDB reuses no page freed after it, so a fixed map fills up
 * ("store full") and an automatic one grows by a checkpoint a commit. LMDB
 * clears them only when a process opens the store first, or when the one
 * that dies held the write lock; a scan of the reader table does it. */
static void clear_stale_readers(MDB_env *env) {
  int dead = 0;
  if (mdb_reader_check(env, &dead) == 0 && dead > 0)
    fprintf(stderr, "checkpoint: cleared %d read slot(s) of processes that died reading the store\n", dead);
}

static int commit_once(ckpt_engine *e, stage_buf *b) {
  ckpt_tensor_info *info = malloc(sizeof *info * (size_t)(e->nt ? e->nt : 1));
  if (!info) return tr_fail(TR_ENOMEM, "out of memory committing a checkpoint");
  MDB_txn *txn = NULL;
  mdb_last = 0;
  pthread_mutex_lock(&e->map_mu); /* txn_begin may adopt a map grown elsewhere */
  if (!e->map_lost) clear_stale_readers(e->env);
  int rc = engine_txn_begin(e, 0, &txn, 1, "beginning a checkpoint transaction");
  pthread_mutex_unlock(&e->map_mu);
  if (rc) {
    free(info);
    return rc;
  }
  rc = delete_step(txn, e->man, e->data, b->st.step); /* a re-taken step replaces the old one */
  if (!rc) rc = put_tensors(e, txn, b, info);
  if (!rc) rc = put_manifest(e, txn, &b->st, info);
  if (!rc) rc = apply_retention(e, txn, b->st.step);
  free(info);
  if (rc) {
    mdb_txn_abort(txn);
    return rc;
  }
  int mrc = mdb_txn_commit(txn);
  if (mrc) {
    mdb_last = mrc;
    struct statvfs vfs;
    if (statvfs(e->dir, &vfs) == 0)
      return tr_fail(TR_EIO, "committing the checkpoint: %s (%.1f MiB free on the device, %.1f MiB needed)",
                     mdb_strerror(mrc), (double)vfs.f_bavail * vfs.f_frsize / 1048576.0, e->total / 1048576.0);
    return mdb_fail(mrc, "committing the checkpoint");
  }
  return TR_OK;
}

/* Pacing, after a commit (with e->mu held): the checkpoint cost
 * copy_cpu + commit_cpu seconds of CPU; the next snapshot waits until that
 * is at most cpu_share of the machine's CPU since this one started. */
static void rest(ckpt_engine *e, const stage_buf *b, double commit_cpu) {
  double cost = b->copy_cpu_s + commit_cpu, now = tr_now();
  e->stats.copy_cpu_s += b->copy_cpu_s;
  e->stats.commit_cpu_s += commit_cpu;
  if (e->cpu_share <= 0) return;
  double until = b->started + cost / e->cpu_share;
  if (until > now) e->stats.rest_s += until - now;
  e->rest_until = until;
}

static void *writer_main(void *arg) {
  ckpt_engine *e = arg;
  /* Level 2 yields the CPU to training: the step never waits on it, and a
   * commit that takes longer only coalesces more snapshots. */
  setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19);
  pthread_mutex_lock(&e->mu);
  for (;;) {
    int pick = -1;
    for (;;) {
      for (int i = 0; i < 2; i++)
        if (e->buf[i].state == BUF_STAGED && (pick < 0 || e->buf[i].seq < e->buf[pick].seq)) pick = i;
      if (pick >= 0 || e->stop) break;
      pthread_cond_wait(&e->cv, &e->mu);
    }
    if (pick < 0) break; /* stopping and nothing staged */
    stage_buf *b = &e->buf[pick];
    b->state = BUF_WRITING;
    pthread_mutex_unlock(&e->mu);
    double t0 = tr_now(), c0 = thread_cpu();
    int rc = commit(e, b);
    double dt = tr_now() - t0, cpu = thread_cpu() - c0;
    ckpt_event ev = {.step = b->st.step, .ok = rc == 0, .copy_s = b->copy_s, .commit_s = dt, .bytes = e->total};
    if (rc) snprintf(ev.what, sizeof ev.what, "%s", tr_error());
    pthread_mutex_lock(&e->mu);
    rest(e, b, cpu);
    b->state = BUF_FREE;
    if (rc) e->stats.failed++;
    else e->stats.committed++;
    if (!rc && e->remote[0] && b->st.step > e->repl_want) e->repl_want = b->st.step;
    e->stats.commit_s += dt;
    push_event(e, &ev);
    pthread_cond_broadcast(&e->cv);
  }
  pthread_mutex_unlock(&e->mu);
  return NULL;
}

/* --- level 3: replication to the remote store --- */

/* The raw manifest of step (malloc'd copy in *raw) and its decoded table. */
static int local_manifest(ckpt_engine *e, int64_t step, uint8_t **raw, size_t *len, ckpt_manifest *m,
                          ckpt_tensor_info **tensors) {
  MDB_txn *txn;
  pthread_mutex_lock(&e->map_mu);
  int rc = engine_txn_begin(e, MDB_RDONLY, &txn, 0, "replicating: reading the store"), mrc;
  if (rc) {
    pthread_mutex_unlock(&e->map_mu);
    return rc;
  }
  uint8_t kb[8];
  put_be64(kb, (uint64_t)step);
  MDB_val k = {8, kb}, v;
  mrc = mdb_get(txn, e->man, &k, &v);
  if (mrc == MDB_NOTFOUND) rc = CKPT_GONE;
  else if (mrc) rc = mdb_fail(mrc, "replicating: reading a manifest");
  uint64_t chunk;
  if (!rc) rc = ckpt_manifest_decode(v.mv_data, v.mv_size, m, tensors, &chunk);
  if (!rc && !(*raw = malloc(v.mv_size))) {
    free(*tensors);
    rc = tr_fail(TR_ENOMEM, "out of memory replicating");
  }
  if (!rc) {
    memcpy(*raw, v.mv_data, v.mv_size);
    *len = v.mv_size;
  }
  mdb_txn_abort(txn);
  pthread_mutex_unlock(&e->map_mu);
  return rc;
}

/* Streams tensor i of step from the local store into f, one chunk per
 * short read transaction (a long one would pin LMDB's pages and grow the
 * store while the rate limit stretches the copy), pacing between chunks
 * and checking the bytes against the manifest's CRC: a step removed or
 * re-taken meanwhile is CKPT_GONE or a mismatch, never a wrong copy. Each
 * chunk is copied out of the map under map_mu and written to the remote
 * after it is released: a slow or stuck remote (a hung network mount)
 * never holds up the writer's local commits, which need map_mu too. *buf
 * (capacity *cap) is the caller's, grown as needed. */
static int replicate_tensor(ckpt_engine *e, remote_file *f, int64_t step, int i, const ckpt_tensor_info *t,
                            uint8_t **buf, size_t *cap) {
  uint32_t crc = 0;
  uint64_t got = 0;
  for (uint32_t c = 0; got < t->bytes; c++) {
    uint8_t kb[16];
    put_be64(kb, (uint64_t)step);
    put_be32(kb + 8, (uint32_t)i);
    put_be32(kb + 12, c);
    MDB_val k = {16, kb}, v;
    MDB_txn *txn;
    pthread_mutex_lock(&e->map_mu);
    int rc = engine_txn_begin(e, MDB_RDONLY, &txn, 0, "replicating: reading the store");
    if (rc) {
      pthread_mutex_unlock(&e->map_mu);
      return rc;
    }
    int mrc = mdb_get(txn, e->data, &k, &v);
    if (mrc == MDB_NOTFOUND) rc = CKPT_GONE;
    else if (mrc) rc = mdb_fail(mrc, "replicating: reading checkpoint data");
    else if (v.mv_size == 0 || got + v.mv_size > t->bytes)
      rc = tr_fail(TR_EFORMAT, "replicating step %lld: tensor '%s' has more data than its manifest says",
                   (long long)step, t->name);
    size_t n = rc ? 0 : v.mv_size;
    if (n > *cap) {
      uint8_t *b = realloc(*buf, n);
      if (b) *buf = b, *cap = n;
      else rc = tr_fail(TR_ENOMEM, "out of memory replicating step %lld", (long long)step);
    }
    if (!rc) memcpy(*buf, v.mv_data, n);
    mdb_txn_abort(txn);
    pthread_mutex_unlock(&e->map_mu);
    if (rc) return rc;
    crc = tr_crc32c(crc, *buf, n);
    rc = remote_write(f, *buf, n);
    if (rc) return rc;
    got += n;
    remote_pace(f);
  }
  if (crc != t->crc)
    return tr_fail(TR_EFORMAT, "replicating step %lld: tensor '%s' fails its checksum in the local store",
                   (long long)step, t->name);
  return TR_OK;
}

/* Copies committed checkpoint `step` to the remote store (commit, then
 * publish by rename) and applies retention there. CKPT_GONE: the step left
 * the local store first (retention after newer commits): a newer one is
 * replicated instead. */
static int replicate(ckpt_engine *e, int64_t step) {
  uint8_t *raw = NULL;
  size_t rlen = 0;
  ckpt_manifest m;
  ckpt_tensor_info *tensors = NULL;
  int rc = local_manifest(e, step, &raw, &rlen, &m, &tensors);
  if (rc) return rc;
  remote_file f;
  rc = remote_begin(&f, e->remote, step, raw, rlen, e->remote_rate);
  uint8_t *buf = NULL;
  size_t cap = 0;
  for (int i = 0; !rc && i < m.ntensors; i++) rc = replicate_tensor(e, &f, step, i, &tensors[i], &buf, &cap);
  free(buf);
  if (!rc) rc = remote_publish(&f);
  else if (f.fd >= 0) remote_abandon(&f);
  if (!rc) rc = remote_retain(e->remote, e->o.keep_last, e->o.keep_every, step);
  free(raw);
  free(tensors);
  return rc;
}

/* The replicator thread (nice 19, like the writer): always the newest
 * committed checkpoint; one committed while a copy runs waits for it (the
 * ones in between are never copied). At close it finishes the newest. */
static void *replicator_main(void *arg) {
  ckpt_engine *e = arg;
  setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19);
  pthread_mutex_lock(&e->mu);
  for (;;) {
    while (e->repl_want <= e->repl_done && !e->stop) pthread_cond_wait(&e->cv, &e->mu);
    if (e->repl_want <= e->repl_done) break;
    int64_t step = e->repl_want;
    pthread_mutex_unlock(&e->mu);
    double t0 = tr_now();
    int rc = replicate(e, step);
    ckpt_event ev = {.step = step, .ok = rc == 0, .commit_s = tr_now() - t0, .bytes = e->total, .remote = 1};
    if (rc) snprintf(ev.what, sizeof ev.what, "replicating to the remote store '%s': %s", e->remote, tr_error());
    pthread_mutex_lock(&e->mu);
    e->repl_done = step;
    if (rc == CKPT_GONE) e->stats.repl_superseded++;
    else if (rc) e->stats.repl_failed++;
    else e->stats.replicated++;
    if (rc != CKPT_GONE) push_event(e, &ev);
    pthread_cond_broadcast(&e->cv);
  }
  pthread_mutex_unlock(&e->mu);
  return NULL;
}

int ckpt_wait_remote(ckpt_engine *e) {
  if (!e || !e->repl_started) return TR_OK;
  pthread_mutex_lock(&e->mu);
  while (e->repl_want > e->repl_done) pthread_cond_wait(&e->cv, &e->mu);
  pthread_mutex_unlock(&e->mu);
  return TR_OK;
}

int ckpt_remote_prepare(const char *dir) {
  if (strlen(dir) >= sizeof ((ckpt_engine *)0)->remote)
    return tr_fail(TR_EINVAL, "remote checkpoint path too long: '%s'", dir);
  return remote_prepare(dir);
}

int ckpt_set_remote(ckpt_engine *e, const char *dir, double rate_mb_s) {
  if (e->buf[0].data) return tr_fail(TR_ESTATE, "ckpt_set_remote after the first snapshot");
  if (!dir || !dir[0]) {
    e->remote[0] = 0;
    return TR_OK;
  }
  if (rate_mb_s < 0) return tr_fail(TR_EINVAL, "remote checkpoint rate %g MiB/s is negative", rate_mb_s);
  int rc = ckpt_remote_prepare(dir);
  if (rc) return rc;
  snprintf(e->remote, sizeof e->remote, "%s", dir);
  e->remote_rate = rate_mb_s * 1048576.0;
  return TR_OK;
}

ckpt_engine *ckpt_open(const ckpt_opts *o) {
  if (o->keep_last < 1) {
    tr_fail(TR_EINVAL, "checkpoint keep_last must be >= 1");
    return NULL;
  }
  ckpt_engine *e = calloc(1, sizeof *e);
  if (!e) {
    tr_fail(TR_ENOMEM, "out of memory");
    return NULL;
  }
  e->o = *o;
  e->copy_req = -1;
  ckpt_set_cpu_share(e, CKPT_CPU_SHARE);
  snprintf(e->dir, sizeof e->dir, "%s", o->dir);
  e->o.dir = e->dir;
  pthread_mutex_init(&e->mu, NULL);
  pthread_mutex_init(&e->map_mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  if (tr_mkdirs(e->dir)) goto fail;
  int rc = mdb_env_create(&e->env);
  if (rc) {
    mdb_fail(rc, "creating the LMDB environment");
    goto fail;
  }
  mdb_env_set_maxdbs(e->env, 4);
  /* Not MDB_WRITEMAP: measured with 10 commits of a 975 MiB state, its
   * steady-state commits cost the same CPU as these (0.15-0.2 CPU-s each:
   * MDB_RESERVE already makes the bytes cross once into LMDB's pages), and
   * its first ones, filling the file's holes through page faults, twice as
   * much. */
  if ((rc = mdb_env_open(e->env, e->dir, 0, 0644))) {
    mdb_fail(rc, e->dir);
    mdb_env_close(e->env);
    e->env = NULL;
    goto fail;
  }
  clear_stale_readers(e->env);
  MDB_txn *txn = NULL;
  if (!(rc = txn_begin(e->env, 0, &txn, 1)) && !(rc = mdb_dbi_open(txn, "manifest", MDB_CREATE, &e->man)) &&
      !(rc = manifest_walk(txn, e->man)) && !(rc = mdb_dbi_open(txn, "data", MDB_CREATE, &e->data))) {
    rc = mdb_txn_commit(txn); /* frees txn, committed or not */
    txn = NULL;
  }
  if (txn) mdb_txn_abort(txn); /* not left holding the write lock */
  if (rc) {
    char what[1200];
    snprintf(what, sizeof what, "opening the checkpoint databases of '%s'%s", o->dir,
             rc == MDB_CORRUPTED || rc == MDB_PAGE_NOTFOUND ? " (the list of checkpoints is damaged)" : "");
    mdb_fail(rc, what);
    goto fail;
  }
  return e;
fail:
  ckpt_close(e);
  return NULL;
}

int ckpt_set_cpu_share(ckpt_engine *e, double share) {
  if (e->buf[0].data) return tr_fail(TR_ESTATE, "ckpt_set_cpu_share after the first snapshot");
  if (!(share > 0 && share <= 1)) return tr_fail(TR_EINVAL, "checkpoint CPU share %g is not in (0, 1]", share);
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  e->cpu_share = share >= 1 ? 0 : share * (double)(ncpu > 0 ? ncpu : 1); /* of one core; 0 = no pacing */
  return TR_OK;
}

int ckpt_set_device(ckpt_engine *e, const tr_backend *be) {
  if (e->buf[0].data) return tr_fail(TR_ESTATE, "ckpt_set_device after the first snapshot");
  e->dev = be;
  return TR_OK;
}

int ckpt_register(ckpt_engine *e, const char *name, int dtype, int ndim, const int64_t *dim, const void *ptr) {
  if (e->buf[0].data) return tr_fail(TR_ESTATE, "ckpt_register after the first snapshot");
  if (strlen(name) >= CKPT_NAME_MAX) return tr_fail(TR_EINVAL, "checkpoint tensor name too long: '%s'", name);
  if (ndim < 0 || ndim > CKPT_MAX_DIMS) return tr_fail(TR_EINVAL, "'%s': %d dimensions", name, ndim);
  for (int i = 0; i < e->nt; i++)
    if (strcmp(e->t[i].info.name, name) == 0) return tr_fail(TR_EINVAL, "'%s' is registered twice", name);
  if (e->nt == e->capt) {
    int ncap = e->capt ? e->capt * 2 : 64;
    reg_tensor *nt = realloc(e->t, sizeof *nt * (size_t)ncap);
    if (!nt) return tr_fail(TR_ENOMEM, "out of memory");
    e->t = nt;
    e->capt = ncap;
  }
  reg_tensor *r = &e->t[e->nt];
  memset(r, 0, sizeof *r);
  snprintf(r->info.name, sizeof r->info.name, "%s", name);
  r->info.dtype = dtype;
  r->info.ndim = ndim;
  uint64_t n = 1;
  for (int i = 0; i < ndim; i++) {
    r->info.dim[i] = dim[i];
    n *= (uint64_t)dim[i];
  }
  r->info.bytes = n * (dtype == CKPT_F32 ? 4 : 1);
  r->ptr = ptr;
  r->off = e->total;
  e->total += (r->info.bytes + 63) & ~(uint64_t)63;
  e->nt++;
  return TR_OK;
}

/* Staging buffers, map size, threads. A failure leaves what was done in
 * place (freed by ckpt_close) and the next snapshot picks up from there:
 * nothing is allocated or pinned twice. A buffer that cannot be pinned
 * (page-locked memory is limited: ulimit -l, a container's cap) is used
 * unpinned: device copies into it are slower and wait for the host, but
 * they work; stats.unpinned counts such buffers, and it is not tried again. */
/* The automatic map: keep_last + 2 snapshots of total bytes with 1/8 and
 * 1 MiB of slack each, and 16 MiB. 0, or -1 if it does not fit a size_t. */
static int auto_map_size(uint64_t total, int keep_last, size_t *map) {
  uint64_t per = total + (total >> 3) + (1u << 20), all;
  if (per < total || keep_last < 0 || __builtin_mul_overflow(per, (uint64_t)keep_last + 2, &all) ||
      all > SIZE_MAX - (16u << 20))
    return -1;
  *map = (size_t)all + (16u << 20);
  return 0;
}

static int start(ckpt_engine *e) {
  int nbuf = e->o.busy == CKPT_COALESCE ? 1 : 2;
  for (int i = 0; i < nbuf; i++) {
    if (!e->buf[i].data) e->buf[i].data = tr_alloc_aligned(e->total ? e->total : 64);
    if (!e->buf[i].data) return tr_fail(TR_ENOMEM, "out of memory for checkpoint staging (%llu bytes)",
                                        (unsigned long long)e->total);
  }
  if (e->dev && !e->dev->host_memory && e->dev->ckpt_pin)
    for (int i = 0; i < nbuf; i++) {
      if (e->pinned[i]) continue;
      int ok = e->dev->ckpt_pin(e->buf[i].data, e->total ? e->total : 64) == 0;
      e->pinned[i] = ok ? 1 : -1;
      if (!ok) {
        pthread_mutex_lock(&e->mu);
        e->stats.unpinned++;
        snprintf(e->stats.unpinned_why, sizeof e->stats.unpinned_why, "%s", e->dev->error());
        pthread_mutex_unlock(&e->mu);
      }
    }
  size_t map = e->o.map_bytes;
  if (map == 0 && auto_map_size(e->total, e->o.keep_last, &map))
    return tr_fail(TR_EINVAL, "the checkpoint store's map for keep_last = %d snapshots of %llu bytes is more than "
                   "this machine can address: lower checkpoint.keep_last or set checkpoint.map_mb",
                   e->o.keep_last, (unsigned long long)e->total);
  /* never below the map another process already grew the store to (no
   * transaction of ours is active yet: adopting it is safe here) */
  MDB_envinfo info;
  pthread_mutex_lock(&e->map_mu);
  int rc = engine_set_map(e, 0, "adopting the checkpoint store's map");
  if (!rc && mdb_env_info(e->env, &info) == 0 && info.me_mapsize > map) map = info.me_mapsize;
  if (!rc) rc = engine_set_map(e, map, "setting the LMDB map size");
  pthread_mutex_unlock(&e->map_mu);
  if (rc) return rc;
  e->stats.bytes_per_snapshot = e->total;
  if (e->remote[0] && !e->repl_started) {
    e->repl_want = e->repl_done = INT64_MIN;
    if (pthread_create(&e->replicator, NULL, replicator_main, e) != 0)
      return tr_fail(TR_ENOMEM, "cannot start the replicator thread");
    e->repl_started = 1;
  }
  if (pthread_create(&e->copier, NULL, copy_main, e) != 0) return tr_fail(TR_ENOMEM, "cannot start the copy thread");
  if (pthread_create(&e->writer, NULL, writer_main, e) != 0) {
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->copier, NULL);
    if (e->repl_started) pthread_join(e->replicator, NULL);
    e->repl_started = 0;
    e->stop = 0; /* a later start must not find its threads told to stop */
    return tr_fail(TR_ENOMEM, "cannot start the writer thread");
  }
  e->threads_started = 1;
  return TR_OK;
}

/* 1 while a staging buffer is copying, staged or being written (e->mu held). */
static int engine_busy(const ckpt_engine *e) {
  for (int i = 0; i < 2; i++)
    if (e->buf[i].state != BUF_FREE) return 1;
  return 0;
}

/* The staging buffer a snapshot due now goes to, or -1 with *result the
 * busy policy's answer (e->mu held). coalesce: one snapshot in flight at a
 * time; one due while it is (or while pacing rests) is deferred, and the
 * newest state is taken at the next step boundary where ckpt_pending says
 * so: nothing is copied only to be replaced. skip: two buffers, and a
 * snapshot due with neither free (or while resting) is dropped. */
static int pick_buffer(ckpt_engine *e, int *result) {
  int resting = tr_now() < e->rest_until;
  if (e->o.busy == CKPT_COALESCE) {
    if (!engine_busy(e) && !resting) return 0;
    e->pending = 1;
    e->stats.coalesced++;
    *result = CKPT_COALESCED;
    return -1;
  }
  for (int i = 0; i < 2 && !resting; i++)
    if (e->buf[i].state == BUF_FREE) return i;
  e->stats.skipped++;
  *result = CKPT_SKIPPED;
  return -1;
}

int ckpt_snapshot(ckpt_engine *e, const ckpt_state *s) {
  if (!e->threads_started) {
    int rc = start(e);
    if (rc) { /* the caller reports tr_error(); the totals count it */
      pthread_mutex_lock(&e->mu);
      e->stats.snapshots++;
      e->stats.failed++;
      pthread_mutex_unlock(&e->mu);
      return rc;
    }
  }
  pthread_mutex_lock(&e->mu);
  while (e->copy_req >= 0) pthread_cond_wait(&e->cv, &e->mu); /* only if the caller skipped wait_copy */
  int result = 0, pick = pick_buffer(e, &result);
  if (pick < 0) {
    pthread_mutex_unlock(&e->mu);
    return result;
  }
  if (e->dev && !e->dev->host_memory && e->dev->ckpt_mark && e->dev->ckpt_mark()) {
    e->stats.snapshots++; /* the totals count it, as a failed start */
    e->stats.failed++;
    pthread_mutex_unlock(&e->mu);
    return tr_fail(TR_EIO, "checkpoint snapshot: marking the device stream: %s", e->dev->error());
  }
  stage_buf *b = &e->buf[pick];
  b->state = BUF_COPYING;
  b->st = *s;
  b->seq = ++e->seq;
  b->started = tr_now();
  e->pending = 0;
  e->copy_req = pick;
  e->stats.snapshots++;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
  return result;
}

int ckpt_pending(ckpt_engine *e) {
  if (!e || !e->threads_started) return 0;
  pthread_mutex_lock(&e->mu);
  int due = e->pending && !engine_busy(e) && tr_now() >= e->rest_until;
  pthread_mutex_unlock(&e->mu);
  return due;
}

int ckpt_ready(ckpt_engine *e) {
  if (!e || !e->threads_started) return 1;
  pthread_mutex_lock(&e->mu);
  int ready = !engine_busy(e) && tr_now() >= e->rest_until; /* only ckpt_snapshot makes it busy again */
  pthread_mutex_unlock(&e->mu);
  return ready;
}

double ckpt_wait_copy(ckpt_engine *e) {
  if (!e || !e->threads_started) return 0.0;
  pthread_mutex_lock(&e->mu);
  double waited = 0.0;
  if (e->copy_req >= 0) {
    double t0 = tr_now();
    while (e->copy_req >= 0) pthread_cond_wait(&e->cv, &e->mu);
    waited = tr_now() - t0;
    e->stats.stall_s += waited;
  }
  pthread_mutex_unlock(&e->mu);
  return waited;
}

int ckpt_flush(ckpt_engine *e) {
  if (!e || !e->threads_started) return TR_OK;
  pthread_mutex_lock(&e->mu);
  for (;;) {
    int busy = e->copy_req >= 0;
    for (int i = 0; i < 2; i++) busy |= e->buf[i].state != BUF_FREE;
    if (!busy) break;
    pthread_cond_wait(&e->cv, &e->mu);
  }
  e->rest_until = 0; /* the caller wants the next snapshot taken */
  pthread_mutex_unlock(&e->mu);
  return TR_OK;
}

int ckpt_poll(ckpt_engine *e, ckpt_event *ev) {
  if (!e) return 0;
  pthread_mutex_lock(&e->mu);
  int got = e->ev_count > 0;
  if (got) {
    *ev = e->events[e->ev_head];
    e->ev_head = (e->ev_head + 1) % MAX_EVENTS;
    e->ev_count--;
  }
  pthread_mutex_unlock(&e->mu);
  return got;
}

void ckpt_get_stats(ckpt_engine *e, ckpt_stats *st) {
  pthread_mutex_lock(&e->mu);
  *st = e->stats;
  double left = e->rest_until - tr_now();
  st->rest_left_s = left > 0 ? left : 0;
  pthread_mutex_unlock(&e->mu);
}

void ckpt_close(ckpt_engine *e) {
  if (!e) return;
  if (e->threads_started) {
    ckpt_flush(e);
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->copier, NULL);
    pthread_join(e->writer, NULL);
  }
  if (e->repl_started) { /* it finishes the newest committed checkpoint first */
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->replicator, NULL);
  }
  if (e->env) mdb_env_close(e->env);
  for (int i = 0; i < 2; i++) {
    if (e->pinned[i] == 1 && e->dev->ckpt_unpin) e->dev->ckpt_unpin(e->buf[i].data);
    tr_free_aligned(e->buf[i].data);
  }
  free(e->t);
  pthread_mutex_destroy(&e->mu);
  pthread_mutex_destroy(&e->map_mu);
  pthread_cond_destroy(&e->cv);
  free(e);
}

/* --- reading --- */

struct ckpt_reader {
  MDB_env *env;
  int empty;    /* env NULL: a local store whose databases were never created (a process killed in its
                 * ckpt_open, before that commit): it holds no checkpoint */
  int borrowed; /* env belongs to an engine (LMDB allows one env per file per process) */
  int map_lost; /* its own env's remap failed: LMDB keeps no map (see the engine's map_lost) */
  ckpt_engine *engine; /* that engine (borrowed) */
  MDB_dbi man, data;
  ckpt_tensor_info *tensors; /* last decoded manifest's table */
  char dir[1024];
  int expect_hash;      /* ckpt_reader_expect_model was called */
  uint64_t config_hash; /* ... with this */
  uint64_t legacy_hash; /* ... and this, also accepted */
  uint64_t other_hash;  /* load_step: the step failed as of a different model, with this hash */
  int other_model;      /* ... (set by check_targets) */
  char remote[1024];    /* level 3's directory, "" = none; env NULL: remote only */
};

/* A reader's environment may adopt a map grown by another process unless it
 * is an engine's whose writer thread runs (it may be inside a transaction). */
static int may_remap(const ckpt_reader *r) { return !r->borrowed || !r->engine->threads_started; }

/* A read transaction on the reader's env. A borrowed env whose engine lost
 * its map is refused (MDB_PANIC: "environment had fatal error"), and a
 * failed remap of a borrowed env loses the engine's map as its own would. */
static int reader_txn_begin(ckpt_reader *r, MDB_txn **txn) {
  if (r->map_lost || (r->borrowed && atomic_load(&r->engine->map_lost))) return MDB_PANIC;
  int lost = 0, rc = txn_begin_remap(r->env, MDB_RDONLY, txn, may_remap(r), &lost);
  if (lost && r->borrowed) map_lost_fail(r->engine, rc, "a reader adopting the checkpoint store's grown map");
  else if (lost) r->map_lost = 1;
  return rc;
}

/* The local part of ckpt_store_drop_after: the steps after step, deleted
 * in one write transaction; how many (ascending in *out, malloc'd), or an
 * error. */
static int local_drop_after(const char *dir, int64_t step, int64_t **out) {
  *out = NULL;
  char path[1100];
  snprintf(path, sizeof path, "%s/data.mdb", dir);
  if (access(path, F_OK) != 0) return 0;
  MDB_env *env;
  MDB_txn *txn = NULL;
  MDB_dbi man, data;
  int rc = mdb_env_create(&env), n = 0, none = 0;
  if (rc) return mdb_fail(rc, dir);
  mdb_env_set_maxdbs(env, 4);
  if (!(rc = mdb_env_open(env, dir, 0, 0644))) {
    clear_stale_readers(env);
    rc = txn_begin(env, 0, &txn, 1);
  }
  if (!rc) rc = mdb_dbi_open(txn, "manifest", 0, &man);
  if (!rc) rc = mdb_dbi_open(txn, "data", 0, &data);
  if (rc == MDB_NOTFOUND) rc = 0, none = 1; /* no databases yet: nothing committed */
  int64_t *steps = NULL;
  int cap = 0;
  if (!rc && !none) {
    MDB_cursor *c;
    uint8_t kb[8];
    put_be64(kb, (uint64_t)step + 1);
    MDB_val k = {8, kb}, v;
    if (!(rc = mdb_cursor_open(txn, man, &c))) {
      for (rc = mdb_cursor_get(c, &k, &v, MDB_SET_RANGE); rc == 0; rc = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        if (k.mv_size != 8) continue;
        if (n == cap) {
          int64_t *ns = realloc(steps, sizeof *ns * (size_t)(cap = cap ? cap * 2 : 64));
          if (!ns) break;
          steps = ns;
        }
        steps[n++] = (int64_t)get_be64(k.mv_data);
      }
      mdb_cursor_close(c);
    }
  }
  int trc = rc == 0 || rc == MDB_NOTFOUND ? TR_OK : mdb_fail(rc, "listing the checkpoints to drop");
  if (!trc && rc == 0 && !none) trc = tr_fail(TR_ENOMEM, "out of memory listing the checkpoints to drop");
  for (int i = 0; i < n && !trc; i++) trc = delete_step(txn, man, data, steps[i]);
  if (txn && !trc) {
    if ((rc = mdb_txn_commit(txn))) trc = mdb_fail(rc, "dropping checkpoints");
    txn = NULL;
  }
  if (txn) mdb_txn_abort(txn);
  mdb_env_close(env);
  if (trc) {
    free(steps);
    return tr_fail_prefix(trc, "checkpoint store '%s'", dir);
  }
  *out = steps;
  return n;
}

int ckpt_store_drop_after(const char *dir, const char *remote, int64_t step, int64_t *first, ckpt_level *failed) {
  ckpt_level level = CKPT_LEVEL_LOCAL; /* the level a failure is in */
  int64_t *l = NULL, *r = malloc(sizeof *r * 4096);
  int nr = 0, rc = r ? TR_OK : tr_fail(TR_ENOMEM, "out of memory");
  int nl = rc ? 0 : local_drop_after(dir, step, &l);
  if (nl < 0) rc = nl;
  if (!rc && remote && remote[0]) { /* the remote's steps are listed for the count, then dropped */
    level = CKPT_LEVEL_REMOTE;
    int all = remote_steps(remote, r, 4096);
    if (all < 0) rc = all;
    for (int i = 0; i < all; i++)
      if (r[i] > step) r[nr++] = r[i];
    int k = rc ? 0 : remote_drop_after(remote, step);
    if (k < 0) rc = k;
  }
  if (failed) *failed = rc ? level : CKPT_LEVEL_NONE;
  /* the union of the two ascending lists: a step both levels held counts once */
  int n = 0;
  *first = -1;
  for (int i = 0, j = 0; !rc && (i < nl || j < nr); n++) {
    int64_t v = j >= nr || (i < nl && l[i] <= r[j]) ? l[i] : r[j];
    if (*first < 0) *first = v;
    if (i < nl && l[i] == v) i++;
    if (j < nr && r[j] == v) j++;
  }
  free(l);
  free(r);
  return rc ? rc : n;
}

int ckpt_store_damaged(const char *dir) {
  char path[1100];
  snprintf(path, sizeof path, "%s/data.mdb", dir);
  if (access(path, F_OK) != 0) return 0;
  MDB_env *env;
  MDB_txn *txn = NULL;
  MDB_dbi dbi;
  if (mdb_env_create(&env)) return 0;
  mdb_env_set_maxdbs(env, 4);
  int rc = mdb_env_open(env, dir, MDB_RDONLY, 0644);
  if (!rc) rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
  if (!rc) rc = mdb_dbi_open(txn, "manifest", 0, &dbi);
  if (!rc) rc = manifest_walk(txn, dbi);
  if (!rc) rc = mdb_dbi_open(txn, "data", 0, &dbi);
  if (txn) mdb_txn_abort(txn);
  mdb_env_close(env);
  return rc == MDB_INVALID || rc == MDB_CORRUPTED || rc == MDB_VERSION_MISMATCH || rc == MDB_INCOMPATIBLE ||
         rc == MDB_PAGE_NOTFOUND;
}

ckpt_reader *ckpt_reader_open(const char *dir) {
  ckpt_reader *r = calloc(1, sizeof *r);
  if (!r) {
    tr_fail(TR_ENOMEM, "out of memory");
    return NULL;
  }
  snprintf(r->dir, sizeof r->dir, "%s", dir);
  char path[1100];
  snprintf(path, sizeof path, "%s/data.mdb", dir);
  FILE *f = fopen(path, "rb");
  if (!f) {
    int64_t one;
    if (remote_steps(dir, &one, 1) > 0) { /* a remote store (level 3) */
      snprintf(r->remote, sizeof r->remote, "%s", dir);
      return r;
    }
    tr_fail(TR_EIO, "no checkpoint store at '%s' (%s)", dir, strerror(errno));
    free(r);
    return NULL;
  }
  struct stat st;
  int size0 = fstat(fileno(f), &st) == 0 && st.st_size == 0;
  fclose(f);
  if (size0) { /* killed before LMDB wrote its first page: nothing committed */
    r->empty = 1;
    return r;
  }
  MDB_txn *txn = NULL;
  int rc = mdb_env_create(&r->env);
  if (!rc) mdb_env_set_maxdbs(r->env, 4);
  if (!rc) rc = mdb_env_open(r->env, dir, MDB_RDONLY, 0644);
  if (!rc) clear_stale_readers(r->env);
  if (!rc) rc = txn_begin(r->env, MDB_RDONLY, &txn, 1);
  if (!rc) rc = mdb_dbi_open(txn, "manifest", 0, &r->man);
  if (rc == MDB_NOTFOUND) { /* killed in ckpt_open before the databases' commit: nothing committed */
    mdb_txn_abort(txn);
    mdb_env_close(r->env);
    r->env = NULL;
    r->empty = 1;
    return r;
  }
  if (!rc) rc = mdb_dbi_open(txn, "data", 0, &r->data);
  if (txn) { /* commit, not abort: handles opened in an aborted txn are discarded */
    int crc = rc ? (mdb_txn_abort(txn), 0) : mdb_txn_commit(txn);
    if (!rc) rc = crc;
  }
  if (rc) {
    mdb_fail(rc, dir);
    ckpt_reader_close(r);
    return NULL;
  }
  return r;
}

int ckpt_reader_set_remote(ckpt_reader *r, const char *dir) {
  if (!dir) dir = "";
  if (strlen(dir) >= sizeof r->remote) return tr_fail(TR_EINVAL, "remote checkpoint path too long: '%s'", dir);
  snprintf(r->remote, sizeof r->remote, "%s", dir);
  return TR_OK;
}

ckpt_reader *ckpt_engine_reader(ckpt_engine *e) {
  if (atomic_load(&e->map_lost)) {
    map_lost_refuse(e);
    return NULL;
  }
  ckpt_reader *r = calloc(1, sizeof *r);
  if (!r) {
    tr_fail(TR_ENOMEM, "out of memory");
    return NULL;
  }
  r->env = e->env;
  r->borrowed = 1;
  snprintf(r->remote, sizeof r->remote, "%s", e->remote);
  r->engine = e;
  r->man = e->man;
  r->data = e->data;
  snprintf(r->dir, sizeof r->dir, "%s", e->dir);
  return r;
}

void ckpt_reader_close(ckpt_reader *r) {
  if (!r) return;
  if (r->env && !r->borrowed) mdb_env_close(r->env);
  free(r->tensors);
  free(r);
}

static int local_steps(ckpt_reader *r, int64_t *steps, int cap) {
  if (!r->env) return 0;
  MDB_txn *txn;
  MDB_cursor *c;
  int rc = reader_txn_begin(r, &txn);
  if (rc) return mdb_fail(rc, "reading checkpoints");
  if ((rc = mdb_cursor_open(txn, r->man, &c))) {
    mdb_txn_abort(txn);
    return mdb_fail(rc, "reading checkpoints");
  }
  /* the newest cap: from the last key down (big-endian keys sort as the
   * steps do), then put back in ascending order */
  int n = 0;
  MDB_val k, v;
  for (rc = mdb_cursor_get(c, &k, &v, MDB_LAST); rc == 0 && n < cap; rc = mdb_cursor_get(c, &k, &v, MDB_PREV))
    if (k.mv_size == 8) steps[n++] = (int64_t)get_be64(k.mv_data);
  mdb_cursor_close(c);
  mdb_txn_abort(txn);
  if (rc != 0 && rc != MDB_NOTFOUND) { /* a damaged page: not "fewer checkpoints" */
    char what[1200];
    snprintf(what, sizeof what, "reading the checkpoints of '%s' (the store's list of checkpoints is damaged)", r->dir);
    return mdb_fail(rc, what);
  }
  for (int i = 0; i < n / 2; i++) {
    int64_t x = steps[i];
    steps[i] = steps[n - 1 - i];
    steps[n - 1 - i] = x;
  }
  return n;
}

/* Both levels' steps, merged ascending without duplicates (the newest cap
 * when there are more). A remote store that cannot be listed counts as
 * empty only if the local one answers: one readable level is enough (an
 * empty local store, never committed to, does not answer for it). */
int ckpt_reader_steps(ckpt_reader *r, int64_t *steps, int cap) {
  int64_t *a = malloc(sizeof *a * 4096 * 2);
  if (!a) return tr_fail(TR_ENOMEM, "out of memory");
  int na = local_steps(r, a, 4096);
  int nb = r->remote[0] ? remote_steps(r->remote, a + 4096, 4096) : 0;
  if (na < 0 || (nb < 0 && !r->env)) {
    free(a);
    return na < 0 ? na : nb;
  }
  if (nb < 0) nb = 0;
  int64_t *b = a + 4096;
  int i = 0, j = 0, n = 0;
  int64_t *m = malloc(sizeof *m * (size_t)(na + nb + 1));
  while (m && (i < na || j < nb)) {
    int64_t v = j >= nb || (i < na && a[i] <= b[j]) ? a[i] : b[j];
    if (i < na && a[i] == v) i++;
    if (j < nb && b[j] == v) j++;
    m[n++] = v;
  }
  int from = n > cap ? n - cap : 0;
  for (int k = from; m && k < n; k++) steps[k - from] = m[k];
  free(a);
  free(m);
  return m ? n - from : tr_fail(TR_ENOMEM, "out of memory");
}

/* 1 when the local store holds a manifest for step. */
static int local_has(ckpt_reader *r, int64_t step) {
  if (!r->env) return 0;
  MDB_txn *txn;
  if (reader_txn_begin(r, &txn)) return 0;
  uint8_t kb[8];
  put_be64(kb, (uint64_t)step);
  MDB_val k = {8, kb}, v;
  int has = mdb_get(txn, r->man, &k, &v) == 0;
  mdb_txn_abort(txn);
  return has;
}

/* Reads the manifest of step inside txn. */
static int read_manifest(ckpt_reader *r, MDB_txn *txn, int64_t step, ckpt_manifest *m, uint64_t *chunk) {
  uint8_t kb[8];
  put_be64(kb, (uint64_t)step);
  MDB_val k = {8, kb}, v;
  int rc = mdb_get(txn, r->man, &k, &v);
  if (rc == MDB_NOTFOUND) return tr_fail(TR_EINVAL, "no checkpoint at step %lld", (long long)step);
  if (rc) return mdb_fail(rc, "reading a manifest");
  free(r->tensors);
  r->tensors = NULL;
  rc = ckpt_manifest_decode(v.mv_data, v.mv_size, m, &r->tensors, chunk);
  if (rc) return tr_fail_prefix(rc, "step %lld", (long long)step);
  if (m->state.step != step) return tr_fail(TR_EFORMAT, "step %lld: manifest says step %lld", (long long)step,
                                            (long long)m->state.step);
  return TR_OK;
}

/* Maps the pages of [p, p+n) of LMDB's map in one call instead of a page
 * fault per few pages (the first read of a store in a process: a resume).
 * Only a hint: where the kernel lacks MADV_POPULATE_READ (5.14) the reads
 * fault the pages in as before. */
static void populate(const void *p, size_t n) {
#ifdef MADV_POPULATE_READ
  if (n < (1u << 20)) return;
  uintptr_t a = (uintptr_t)p & ~(uintptr_t)4095, b = (uintptr_t)p + n;
  (void)madvise((void *)a, b - a, MADV_POPULATE_READ);
#else
  (void)p;
  (void)n;
#endif
}

/* Streams tensor i of step through its chunks: checks sizes and (check)
 * the CRC; if out is given, copies the bytes there (fused with the CRC).
 * check = 0 only inside a txn in which the tensor already verified: the
 * bytes are the same ones. */
static int read_tensor(ckpt_reader *r, MDB_txn *txn, int64_t step, int i, const ckpt_tensor_info *t, uint64_t chunk,
                       void *out, int check) {
  uint32_t crc = 0;
  uint64_t got = 0;
  for (uint32_t c = 0;; c++) {
    uint8_t kb[16];
    put_be64(kb, (uint64_t)step);
    put_be32(kb + 8, (uint32_t)i);
    put_be32(kb + 12, c);
    MDB_val k = {16, kb}, v;
    int rc = mdb_get(txn, r->data, &k, &v);
    if (rc == MDB_NOTFOUND) break;
    if (rc) return mdb_fail(rc, "reading checkpoint data");
    if (v.mv_size > chunk || got + v.mv_size > t->bytes)
      return tr_fail(TR_EFORMAT, "step %lld: tensor '%s' has more data than its manifest says", (long long)step,
                     t->name);
    if (check) populate(v.mv_data, v.mv_size);
    if (out && check) crc = tr_crc32c_copy(crc, (uint8_t *)out + got, v.mv_data, v.mv_size);
    else if (out) memcpy((uint8_t *)out + got, v.mv_data, v.mv_size);
    else crc = tr_crc32c(crc, v.mv_data, v.mv_size);
    got += v.mv_size;
    if (got == t->bytes) break;
  }
  if (got != t->bytes)
    return tr_fail(TR_EFORMAT, "step %lld: tensor '%s' is truncated (%llu of %llu bytes)", (long long)step, t->name,
                   (unsigned long long)got, (unsigned long long)t->bytes);
  if (check && crc != t->crc)
    return tr_fail(TR_EFORMAT, "step %lld: tensor '%s' fails its checksum (crc32c %08x, manifest %08x)",
                   (long long)step, t->name, crc, t->crc);
  return TR_OK;
}

/* --- one step from either level --- */

/* A checkpoint opened for reading: a read txn on the local store, or a
 * remote file mapped; its manifest decoded (tensors in r->tensors). */
typedef struct {
  int remote;
  MDB_txn *txn;
  uint64_t chunk;
  remote_view v;
  uint64_t *off; /* remote: each tensor's offset in v.data */
  ckpt_manifest m;
} step_src;

static void src_close(step_src *s) {
  if (s->txn) mdb_txn_abort(s->txn);
  s->txn = NULL;
  remote_unmap(&s->v);
  free(s->off);
  s->off = NULL;
}

static int src_open_remote(ckpt_reader *r, int64_t step, step_src *s) {
  int rc = remote_map(r->remote, step, &s->v);
  if (rc) return rc;
  free(r->tensors);
  r->tensors = NULL;
  rc = ckpt_manifest_decode(s->v.manifest, s->v.manifest_len, &s->m, &r->tensors, &s->chunk);
  if (!rc && s->m.state.step != step)
    rc = tr_fail(TR_EFORMAT, "manifest says step %lld", (long long)s->m.state.step);
  if (!rc && s->m.bytes != s->v.data_len)
    rc = tr_fail(TR_EFORMAT, "'%s' holds %zu bytes of tensors, its manifest %llu (truncated or grown)", s->v.path,
                 s->v.data_len, (unsigned long long)s->m.bytes);
  if (!rc && !(s->off = malloc(sizeof *s->off * (size_t)(s->m.ntensors + 1))))
    rc = tr_fail(TR_ENOMEM, "out of memory");
  for (int i = 0; !rc && i < s->m.ntensors; i++)
    s->off[i] = i ? s->off[i - 1] + s->m.tensors[i - 1].bytes : 0;
  return rc ? tr_fail_prefix(rc, "remote step %lld", (long long)step) : TR_OK;
}

/* Opens step at one level (remote = 1: level 3). */
static int src_open(ckpt_reader *r, int64_t step, int remote, step_src *s) {
  memset(s, 0, sizeof *s);
  s->remote = remote;
  int rc;
  if (remote) rc = src_open_remote(r, step, s);
  else if (!r->env) rc = tr_fail(TR_EINVAL, "no checkpoint at step %lld", (long long)step); /* an empty store */
  else if ((rc = reader_txn_begin(r, &s->txn))) {
    s->txn = NULL;
    rc = mdb_fail(rc, "reading checkpoints");
  } else {
    rc = read_manifest(r, s->txn, step, &s->m, &s->chunk);
  }
  if (rc) src_close(s);
  return rc;
}

/* Tensor i of an open step: checks (check) and/or copies to out, as
 * read_tensor. */
static int src_tensor(ckpt_reader *r, step_src *s, int64_t step, int i, void *out, int check) {
  const ckpt_tensor_info *t = &s->m.tensors[i];
  if (!s->remote) return read_tensor(r, s->txn, step, i, t, s->chunk, out, check);
  const uint8_t *p = s->v.data + s->off[i];
  if (check) populate(p, t->bytes);
  uint32_t crc = 0;
  if (out && check) crc = tr_crc32c_copy(0, out, p, t->bytes);
  else if (out) memcpy(out, p, t->bytes);
  else crc = tr_crc32c(0, p, t->bytes);
  if (check && crc != t->crc)
    return tr_fail(TR_EFORMAT, "remote step %lld: tensor '%s' fails its checksum (crc32c %08x, manifest %08x)",
                   (long long)step, t->name, crc, t->crc);
  return TR_OK;
}

/* The level a single-step call reads: the local store's copy if it has
 * one, else the remote's. */
static int level_of(ckpt_reader *r, int64_t step) { return local_has(r, step) || !r->remote[0] ? 0 : 1; }

int ckpt_reader_manifest(ckpt_reader *r, int64_t step, ckpt_manifest *m) {
  step_src s;
  int rc = src_open(r, step, level_of(r, step), &s);
  if (rc) return rc;
  *m = s.m;
  src_close(&s);
  return TR_OK;
}

int ckpt_reader_verify(ckpt_reader *r, int64_t step) {
  step_src s;
  int rc = src_open(r, step, level_of(r, step), &s);
  for (int i = 0; !rc && i < s.m.ntensors; i++) rc = src_tensor(r, &s, step, i, NULL, 1);
  src_close(&s);
  return rc;
}

int ckpt_reader_read(ckpt_reader *r, int64_t step, const char *name, void *out, uint64_t bytes) {
  step_src s;
  int rc = src_open(r, step, level_of(r, step), &s), found = -1;
  for (int i = 0; !rc && i < s.m.ntensors && found < 0; i++)
    if (strcmp(s.m.tensors[i].name, name) == 0) found = i;
  if (!rc && found < 0) rc = tr_fail(TR_EINVAL, "step %lld has no tensor '%s'", (long long)step, name);
  if (!rc && s.m.tensors[found].bytes != bytes)
    rc = tr_fail(TR_EINVAL, "step %lld: tensor '%s' is %llu bytes, expected %llu", (long long)step, name,
                 (unsigned long long)s.m.tensors[found].bytes, (unsigned long long)bytes);
  if (!rc) rc = src_tensor(r, &s, step, found, out, 1);
  src_close(&s);
  return rc;
}

/* The index of tensor `name` in m, or -1. */
static int find_tensor(const ckpt_manifest *m, const char *name) {
  for (int i = 0; i < m->ntensors; i++)
    if (strcmp(m->tensors[i].name, name) == 0) return i;
  return -1;
}

/* --- a load's verify and copy, on two threads (a load is all the process
 * does then: a resume, a rollback) --- */

typedef struct {
  const uint8_t *p;
  size_t n;
} seg;

/* Tensor i's bytes are segs[first[i] .. first[i+1]): pointers into LMDB's
 * map (valid while the txn lives) or into a remote file's mapping. The
 * helper thread only reads memory: no LMDB call leaves the txn's thread. */
typedef struct {
  const seg *segs;
  const int *first;
  const ckpt_tensor_info *info;
  uint8_t **out; /* copy: per tensor, its target or NULL */
  int copy;      /* 0: check the CRCs, 1: copy to out */
  int from, to;  /* tensors [from, to) */
  int bad;       /* check: the first tensor failing, or -1 */
  uint32_t bad_crc;
} seg_job;

static void *seg_run(void *arg) {
  seg_job *j = arg;
  j->bad = -1;
  for (int i = j->from; i < j->to && j->bad < 0; i++) {
    if (j->copy && !j->out[i]) continue;
    uint32_t crc = 0;
    uint64_t off = 0;
    for (int k = j->first[i]; k < j->first[i + 1]; k++) {
      if (j->copy) {
        memcpy(j->out[i] + off, j->segs[k].p, j->segs[k].n);
      } else {
        populate(j->segs[k].p, j->segs[k].n);
        crc = tr_crc32c(crc, j->segs[k].p, j->segs[k].n);
      }
      off += j->segs[k].n;
    }
    if (!j->copy && crc != j->info[i].crc) {
      j->bad = i;
      j->bad_crc = crc;
    }
  }
  return NULL;
}

/* Runs j over tensors [0, nt): two threads, halves by bytes, when there are
 * two cores and more than 64 MiB; else (or if the thread cannot start)
 * this one. */
static void seg_parallel(seg_job *j, int nt, uint64_t total) {
  seg_job a = *j, b = *j;
  int split = nt;
  uint64_t acc = 0;
  if (total >= ((uint64_t)64 << 20) && sysconf(_SC_NPROCESSORS_ONLN) > 1)
    for (split = 0; split < nt && acc < total / 2; split++) acc += j->info[split].bytes;
  a.from = 0;
  a.to = split;
  b.from = split;
  b.to = nt;
  pthread_t th;
  int threaded = split < nt && pthread_create(&th, NULL, seg_run, &b) == 0;
  if (!threaded) a.to = nt;
  seg_run(&a);
  if (threaded) pthread_join(th, NULL);
  j->bad = a.bad >= 0 ? a.bad : threaded ? b.bad : -1;
  j->bad_crc = a.bad >= 0 ? a.bad_crc : b.bad_crc;
}

/* Every tensor's segments of an open step, sizes checked as read_tensor
 * does. *segs and *first are malloc'd (the caller frees both). */
static int gather(ckpt_reader *r, step_src *s, int64_t step, seg **segs, int **first) {
  const ckpt_manifest *m = &s->m;
  size_t cap = 1;
  for (int i = 0; i < m->ntensors; i++) cap += (size_t)(m->tensors[i].bytes / s->chunk) + 2;
  *segs = malloc(sizeof **segs * cap);
  *first = malloc(sizeof **first * (size_t)(m->ntensors + 1));
  if (!*segs || !*first) return tr_fail(TR_ENOMEM, "out of memory loading a checkpoint");
  int n = 0;
  for (int i = 0; i < m->ntensors; i++) {
    const ckpt_tensor_info *t = &m->tensors[i];
    (*first)[i] = n;
    if (s->remote) {
      (*segs)[n++] = (seg){s->v.data + s->off[i], t->bytes};
      continue;
    }
    uint64_t got = 0;
    for (uint32_t c = 0; (size_t)n < cap; c++) {
      uint8_t kb[16];
      put_be64(kb, (uint64_t)step);
      put_be32(kb + 8, (uint32_t)i);
      put_be32(kb + 12, c);
      MDB_val k = {16, kb}, v;
      int rc = mdb_get(s->txn, r->data, &k, &v);
      if (rc == MDB_NOTFOUND) break;
      if (rc) return mdb_fail(rc, "reading checkpoint data");
      if (v.mv_size > s->chunk || got + v.mv_size > t->bytes)
        return tr_fail(TR_EFORMAT, "step %lld: tensor '%s' has more data than its manifest says", (long long)step,
                       t->name);
      (*segs)[n++] = (seg){v.mv_data, v.mv_size};
      got += v.mv_size;
      if (got == t->bytes) break;
    }
    if (got != t->bytes)
      return tr_fail(TR_EFORMAT, "step %lld: tensor '%s' is truncated (%llu of %llu bytes)", (long long)step, t->name,
                     (unsigned long long)got, (unsigned long long)t->bytes);
  }
  (*first)[m->ntensors] = n;
  return TR_OK;
}

/* The model (config hash, when the reader expects one) and every target
 * present with its size. */
static int check_targets(ckpt_reader *r, const ckpt_manifest *m, int64_t step, const ckpt_target *t, int n) {
  if (r->expect_hash && m->state.config_hash != r->config_hash && m->state.config_hash != r->legacy_hash) {
    r->other_model = 1;
    r->other_hash = m->state.config_hash;
    return tr_fail(TR_EINVAL, "step %lld is of a different model (model, sizes or vocabulary changed)",
                   (long long)step);
  }
  for (int j = 0; j < n; j++) {
    int i = find_tensor(m, t[j].name);
    if (i < 0) return tr_fail(TR_EINVAL, "step %lld has no tensor '%s'", (long long)step, t[j].name);
    if (m->tensors[i].bytes != t[j].bytes)
      return tr_fail(TR_EINVAL, "step %lld: tensor '%s' is %llu bytes, the model's is %llu", (long long)step,
                     t[j].name, (unsigned long long)m->tensors[i].bytes, (unsigned long long)t[j].bytes);
  }
  return TR_OK;
}

/* Loads step from one level into the targets: the manifest, the model,
 * every target present with its size, every tensor's CRC; only then are
 * the targets written (a plain copy of the bytes just verified, in the same
 * txn or mapping), so a failure leaves them untouched. */
static int load_step(ckpt_reader *r, int64_t step, int remote, const ckpt_target *t, int n, ckpt_state *state) {
  step_src s;
  int rc = src_open(r, step, remote, &s);
  if (rc) return rc;
  const ckpt_manifest *m = &s.m;
  seg *segs = NULL;
  int *first = NULL;
  uint8_t **out = NULL;
  rc = check_targets(r, m, step, t, n);
  if (!rc) rc = gather(r, &s, step, &segs, &first);
  if (!rc && !(out = calloc((size_t)m->ntensors + 1, sizeof *out))) rc = tr_fail(TR_ENOMEM, "out of memory");
  seg_job j = {segs, first, m->tensors, out, 0, 0, 0, -1, 0};
  if (!rc) seg_parallel(&j, m->ntensors, m->bytes);
  if (!rc && j.bad >= 0)
    rc = tr_fail(TR_EFORMAT, "%sstep %lld: tensor '%s' fails its checksum (crc32c %08x, manifest %08x)",
                 remote ? "remote " : "", (long long)step, m->tensors[j.bad].name, j.bad_crc, m->tensors[j.bad].crc);
  if (!rc) {
    for (int k = 0; k < n; k++) out[find_tensor(m, t[k].name)] = t[k].ptr;
    j.copy = 1;
    seg_parallel(&j, m->ntensors, m->bytes);
    *state = m->state;
  }
  free(segs);
  free(first);
  free(out);
  src_close(&s);
  return rc;
}

void ckpt_reader_expect_model(ckpt_reader *r, uint64_t config_hash, uint64_t legacy_hash) {
  r->expect_hash = 1;
  r->config_hash = config_hash;
  r->legacy_hash = legacy_hash;
}

/* Newest first; per step the local copy, then (if it is missing or fails)
 * the remote one. */
int ckpt_load(ckpt_reader *r, int64_t want, const ckpt_target *t, int n, ckpt_state *state, char *report,
              size_t report_len) {
  size_t rl = 0;
  const char *dir = r->env || r->empty ? r->dir : r->remote;
  if (report && report_len) report[0] = 0;
  int64_t steps[4096];
  int ns = ckpt_reader_steps(r, steps, 4096);
  int rc = ns < 0 ? ns
                  : want >= 0 ? tr_fail(TR_EINVAL, "no committed checkpoint at or before step %lld in '%s'",
                                        (long long)want, dir)
                              : tr_fail(TR_EINVAL, "no committed checkpoint in '%s'", dir);
  int tried = 0, other = 0; /* steps tried at either level; of them, another model's */
  uint64_t other_hash = 0;
  for (int k = ns - 1; k >= 0; k--) {
    if (want >= 0 && steps[k] > want) continue;
    int local = local_has(r, steps[k]);
    for (int level = local ? 0 : 1; level < (r->remote[0] ? 2 : 1); level++) {
      if (level == 1 && !remote_has(r->remote, steps[k])) break;
      r->other_model = 0;
      if (!(rc = load_step(r, steps[k], level, t, n, state))) return TR_OK;
      tried++;
      if (r->other_model) {
        if (!other++) other_hash = r->other_hash;
      }
      if (report && rl + 2 < report_len)
        rl += (size_t)snprintf(report + rl, report_len - rl, "skipped step %lld%s: %s\n", (long long)steps[k],
                               !r->remote[0] ? "" : level ? " (remote store)" : " (local store)", tr_error());
    }
    if (tried && other == tried) /* not damage: the job names another model than the run's checkpoints */
      rc = tr_fail(TR_EINVAL, "every checkpoint in '%s'%s%s is of a different model (config hash %016llx, this "
                   "job's %016llx): the job's model, sizes or vocabulary differ from the run's", dir,
                   (r->env || r->empty) && r->remote[0] ? " or its remote store" : "",
                   want >= 0 ? " at or before that step" : "", (unsigned long long)other_hash,
                   (unsigned long long)r->config_hash);
    else
      rc = tr_fail(TR_EFORMAT, "no intact checkpoint in '%s'%s%s", dir, (r->env || r->empty) && r->remote[0] ? " or its remote store" : "",
                   want >= 0 ? " at or before that step" : "");
  }
  return rc;
}
