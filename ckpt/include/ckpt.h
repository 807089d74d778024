/* ckpt.h — TCE: the lazy, asynchronous, two-level checkpoint engine.
 *
 * Level 1 (memory): at a step boundary the training thread calls
 * ckpt_snapshot(), which returns at once; a copy thread copies every
 * registered tensor into a staging buffer while the next forward/backward
 * run (parameters and optimizer state do not change until the next optimizer
 * step). Before the optimizer touches them again the training thread calls
 * ckpt_wait_copy(), which blocks only if that copy is still running.
 *
 * Level 2 (LMDB): a writer thread commits each staged snapshot in ONE write
 * transaction: the tensors (in chunks of at most 16 MiB) and a manifest
 * (magic, version, step, tensor table with name/shape/dtype/bytes/CRC32C,
 * trainer state, config hash), and applies retention in the same
 * transaction. A checkpoint exists only once its transaction committed, so a
 * kill -9 at any moment leaves the previous ones intact.
 *
 * When a snapshot is due while the previous one is still being copied or
 * written, the busy policy says what happens. CKPT_COALESCE (one staging
 * buffer) defers it: the engine remembers that one is wanted and
 * ckpt_pending() says when to take it (the newest state, at the first step
 * boundary after the writer is free), so no copy is made only to be
 * replaced. CKPT_SKIP (two staging buffers: one commits while the next is
 * staged) drops a snapshot due with neither free. Training never waits on
 * the disk.
 *
 * Pacing: a checkpoint costs CPU (the level-1 copy, the CRC32C and copy into
 * LMDB, the kernel's writes). After each commit the engine rests until that
 * cost is at most cpu_share of the machine's CPU since the snapshot began;
 * a snapshot due while it rests is deferred (coalesce) or dropped (skip)
 * like one due while busy. On a machine whose cores all train, this is what
 * keeps the step time within a few percent with a checkpoint due every
 * step: checkpoints coalesce instead of taking CPU from the step.
 *
 * Threads: ckpt_register/snapshot/wait_copy/poll/flush/close from the one
 * training thread; the engine runs its own copy and writer threads. The
 * reading side (ckpt_reader_*) is independent and may run in another process
 * while a trainer writes.
 */
#ifndef TRANSOM_CKPT_H
#define TRANSOM_CKPT_H

#include <stddef.h>
#include <stdint.h>

#define CKPT_NAME_MAX 128
#define CKPT_MAX_DIMS 4

enum { CKPT_F32 = 0, CKPT_U8 = 1 };
enum { CKPT_SKIP = 0, CKPT_COALESCE = 1 };
enum { CKPT_SKIPPED = 1, CKPT_COALESCED = 2 }; /* ckpt_snapshot's positive results */

/* Where training is, beside the tensors. */
typedef struct {
  int64_t step;        /* steps completed */
  uint64_t data_rng;   /* data position: the batch generator's state */
  int64_t opt_steps;   /* optimizer updates so far */
  uint64_t config_hash;/* hash of the model-defining configuration */
  double wall_time;    /* seconds since the epoch when snapshotted */
} ckpt_state;

typedef struct {
  const char *dir;     /* LMDB environment directory (created) */
  size_t map_bytes;    /* LMDB map size; 0 = room for keep_last+2 snapshots, grown when full */
  int keep_last;       /* keep the newest K (>= 1) */
  int keep_every;      /* also keep steps divisible by M (0 = none) */
  int busy;            /* CKPT_SKIP or CKPT_COALESCE */
} ckpt_opts;


typedef struct ckpt_engine ckpt_engine;

/* Opens (creating) the LMDB environment at o->dir and starts the threads.
 * NULL with tr_error() set on failure (unwritable directory, bad options). */
ckpt_engine *ckpt_open(const ckpt_opts *o);
/* Registers a tensor before the first snapshot: the engine copies `bytes`
 * from ptr at every snapshot. The memory must stay valid until close. */
int ckpt_register(ckpt_engine *e, const char *name, int dtype, int ndim, const int64_t *dim, const void *ptr);
/* Every registered tensor (before or after this call) lives in be's
 * memory: level-1 copies go through be's ckpt_* functions (pinned staging
 * buffers, copies queued on a side stream after everything the training
 * thread queued before ckpt_snapshot), or be->download where the backend has
 * no ckpt_copy. Before the first snapshot; be may be a host backend (then
 * nothing changes). A staging buffer that cannot be pinned is used
 * unpinned (slower device copies that wait for the host; stats.unpinned
 * says so, with the backend's reason) and not pinned again. */
struct tr_backend;
int ckpt_set_device(ckpt_engine *e, const struct tr_backend *be);
/* Level 3, the remote store: a directory on another disk (a shared file
 * system's mount, another host's disk), one file per checkpoint, published
 * by rename after fsync so it never holds half of one. A replicator thread
 * (nice 19) copies the newest committed checkpoint there in the background
 * at no more than rate_mb_s MiB/s on average (0 = no limit), one short LMDB
 * read transaction per 16 MiB chunk, checking every tensor's CRC32C on the
 * way; checkpoints committed meanwhile are skipped for the newest; the
 * remote keeps keep_last (and keep_every) like the local store. Outcomes
 * come through ckpt_poll with ev.remote = 1 (failures too: training goes
 * on). ckpt_close finishes the copy of the newest committed checkpoint.
 * dir is created; an unwritable one is an error naming it. NULL or "" =
 * none. Before the first snapshot. Readers of the engine
 * (ckpt_engine_reader) see both levels. */
int ckpt_set_remote(ckpt_engine *e, const char *dir, double rate_mb_s);
/* What ckpt_set_remote checks first, without an engine: dir is created
 * and a file can be written in it. For a caller that must know before it
 * writes anything else (transom run, before the run directory). 0, or a
 * negative error naming dir. Any thread. */
int ckpt_remote_prepare(const char *dir);
/* Waits until the newest committed checkpoint's remote copy is done (or
 * failed): its event is then in ckpt_poll. No remote level, or NULL: 0 at
 * once. The training loop's end calls it after ckpt_flush. */
int ckpt_wait_remote(ckpt_engine *e);
/* Pacing (see above): at most `share` of the machine's CPU, 0 < share <= 1
 * (1 = no pacing); the default is CKPT_CPU_SHARE. Before the first
 * snapshot. */
#define CKPT_CPU_SHARE 0.02
int ckpt_set_cpu_share(ckpt_engine *e, double share);
/* Starts a snapshot; returns 0, CKPT_SKIPPED (busy policy skip),
 * CKPT_COALESCED (deferred: see ckpt_pending), or a negative error. */
int ckpt_snapshot(ckpt_engine *e, const ckpt_state *s);
/* 1 when a deferred (coalesced) snapshot is wanted and the engine can take
 * it now: the training loop asks at every step boundary and calls
 * ckpt_snapshot with the state of that boundary. NULL or not started: 0. */
int ckpt_pending(ckpt_engine *e);
/* 1 when a ckpt_snapshot now would be taken, under either busy policy:
 * nothing staged, copied or written, and no pacing rest. It stays 1 until
 * the training thread's next ckpt_snapshot (the threads only free the
 * engine), so processes that agree on a step by it (pipeline stages: one
 * store each) all take that step. NULL or not started: 1. */
int ckpt_ready(ckpt_engine *e);
/* Blocks until no level-1 copy is running; returns the seconds waited. */
double ckpt_wait_copy(ckpt_engine *e);
/* Waits until every staged snapshot is committed (or failed), and ends a
 * pacing rest: the next ckpt_snapshot is taken (the end of training, a
 * stop, a test). */
int ckpt_flush(ckpt_engine *e);
/* Flushes, stops the threads, closes LMDB. NULL is a no-op. */
void ckpt_close(ckpt_engine *e);

/* Outcome of a level-2 commit, for the run's event log. */
typedef struct {
  int64_t step;
  int ok;              /* 1 committed, 0 failed */
  char what[256];      /* failure reason, or "" */
  double copy_s, commit_s; /* remote: commit_s is the whole copy's time */
  uint64_t bytes;
  int remote;          /* 1: the outcome of a replication to the remote store */
} ckpt_event;
/* Pops the oldest unread commit outcome; returns 1 if one was written. */
int ckpt_poll(ckpt_engine *e, ckpt_event *ev);

typedef struct {
  uint64_t snapshots, skipped, coalesced, committed, failed;
  double stall_s;      /* total time the training thread waited in wait_copy */
  double copy_s, commit_s;
  double copy_cpu_s, commit_cpu_s; /* CPU the copy and writer threads used */
  double rest_s;       /* pacing rests (see cpu_share) */
  double rest_left_s;  /* of the current rest: seconds until the pacing lets the next snapshot in (0: none) */
  uint64_t replicated, repl_failed, repl_superseded; /* level 3 (superseded: left
                        * the local store before its turn; a newer one was copied) */
  uint64_t bytes_per_snapshot;
  int unpinned;           /* staging buffers that could not be page-locked (used unpinned) */
  char unpinned_why[160]; /* the backend's reason for the first */
} ckpt_stats;
void ckpt_get_stats(ckpt_engine *e, ckpt_stats *st);

/* --- reading (verify, load, list, export) --- */

typedef struct {
  char name[CKPT_NAME_MAX];
  int dtype, ndim;
  int64_t dim[CKPT_MAX_DIMS];
  uint64_t bytes;
  uint32_t crc;
} ckpt_tensor_info;

typedef struct {
  ckpt_state state;
  int ntensors;
  ckpt_tensor_info *tensors; /* owned by the reader; valid until the next call */
  uint64_t bytes;
} ckpt_manifest;

typedef struct ckpt_reader ckpt_reader;

/* 1 when dir holds a store LMDB refuses as damaged (not an LMDB file,
 * corrupted pages, another format version): ckpt_open fails on it, and a
 * job with a remote level may move it aside and resume from the remote.
 * 0 otherwise (no store, a sound one, or another kind of error). Not for a
 * store this process has open. */
int ckpt_store_damaged(const char *dir);
/* The levels of a store, as ckpt_store_drop_after names a failed one:
 * level 2 the local store (LMDB), level 3 the remote copies. */
typedef enum { CKPT_LEVEL_NONE = 0, CKPT_LEVEL_LOCAL = 2, CKPT_LEVEL_REMOTE = 3 } ckpt_level;
/* Deletes the checkpoints after step from the local store dir (one
 * transaction), then from the remote level (NULL or "": none): a rollback
 * abandons them, and a later resume must not load the timeline it threw
 * away. Returns how many steps went (a step in both levels counts once)
 * or an error; *first gets the oldest of them. On an error, *failed (NULL:
 * not wanted) names the level that failed: CKPT_LEVEL_LOCAL, and nothing
 * was dropped from either level; CKPT_LEVEL_REMOTE, and the local store's
 * steps after step are gone while the remote level's stay (all, or those
 * it could not remove). CKPT_LEVEL_NONE on success. For a store no process
 * writes now (the operator, its replicas all stopped), and not one this
 * process has open. */
int ckpt_store_drop_after(const char *dir, const char *remote, int64_t step, int64_t *first, ckpt_level *failed);
/* Opens an existing checkpoint directory read-only (another process may be
 * writing it). Not for a directory this process has open as an engine: use
 * ckpt_engine_reader then (LMDB allows one environment per file per
 * process). A store whose databases were never created (its data.mdb of 0
 * bytes, or without them: a process killed inside its first ckpt_open)
 * opens as one that holds no checkpoint, not as an unreadable one. */
ckpt_reader *ckpt_reader_open(const char *dir);
/* A reader over an open engine's store; close it before the engine. Use it
 * before the engine's first snapshot (a resume, as run.c and worker.c do):
 * once the writer runs it may grow the map, which LMDB allows only with no
 * transaction of this process open, and this reader's are not excluded. */
ckpt_reader *ckpt_engine_reader(ckpt_engine *e);
/* Adds level 3 to a reader of the local store: steps, manifests and loads
 * then see both levels, as an engine's reader does (a process with no
 * engine: the operator choosing a rollback target). dir "" or NULL: none.
 * 0, or TR_EINVAL (path too long). */
int ckpt_reader_set_remote(ckpt_reader *r, const char *dir);
void ckpt_reader_close(ckpt_reader *r);
/* Steps of the committed checkpoints, ascending; returns the count (<= cap),
 * or a negative error. */
int ckpt_reader_steps(ckpt_reader *r, int64_t *steps, int cap);
int ckpt_reader_manifest(ckpt_reader *r, int64_t step, ckpt_manifest *m);
/* Verifies every tensor's checksum; on failure tr_error() names the tensor. */
int ckpt_reader_verify(ckpt_reader *r, int64_t step);
/* Copies a verified tensor into out (bytes must match). */
int ckpt_reader_read(ckpt_reader *r, int64_t step, const char *name, void *out, uint64_t bytes);

/* From now on ckpt_load skips checkpoints whose manifest's config_hash is
 * neither config_hash nor legacy_hash (the same hash as an older build
 * computed it; pass config_hash again for none): "of a different model".
 * When every step it tried was skipped so, its error says "every checkpoint
 * in DIR is of a different model (config hash ...)". */
void ckpt_reader_expect_model(ckpt_reader *r, uint64_t config_hash, uint64_t legacy_hash);
/* Loads the newest checkpoint (at or before `step` if >= 0) that verifies into the
 * tensors registered under the same names (ckpt_target list). Skipped
 * (corrupt, unreadable, another model's) checkpoints are described in report
 * (one line each, "skipped step N: reason"). Returns 0 and fills *state, or a
 * negative error when no checkpoint loads. A target is written only once
 * its checkpoint has verified whole (every tensor's CRC32C, every target
 * present with its size, the model): after a failure the targets hold what
 * they held, so callers need no scratch copy. */
typedef struct {
  const char *name;
  void *ptr;
  uint64_t bytes;
} ckpt_target;
int ckpt_load(ckpt_reader *r, int64_t step, const ckpt_target *t, int n, ckpt_state *state, char *report,
              size_t report_len);

#endif
