/* util.h — error codes, the per-thread error message, clocks, small file helpers, gnuplot.
 *
 * Every library function in transom returns an int: 0 on success, a negative
 * TR_E* code on failure, with a human-readable message left in a thread-local
 * buffer (tr_error()). Constructors return NULL and leave the message the same
 * way. Nothing here ever ends the process.
 */
#ifndef TRANSOM_UTIL_H
#define TRANSOM_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum {
  TR_OK = 0,
  TR_ENOMEM = -1,   /* allocation failed */
  TR_EINVAL = -2,   /* bad argument or bad input (shape, config, data) */
  TR_EIO = -3,      /* file or socket error */
  TR_ELUA = -4,     /* a Lua script raised an error */
  TR_EFORMAT = -5,  /* malformed file contents */
  TR_ESTATE = -6,   /* call not allowed in the object's current state */
  TR_EDEVICE = -7,  /* the device is unusable in this process (a corrupted CUDA context, a hung
                       communicator): nothing on it can be retried; the process must be replaced */
};

/* Sets the calling thread's error message (printf-style) and returns code,
 * so that `return tr_fail(TR_EINVAL, "...")` reads naturally. */
int tr_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The calling thread's last error message ("" if none). Valid until the next
 * tr_fail on the same thread. */
const char *tr_error(void);
/* Prefixes the current message with "prefix: ". Returns code. */
int tr_fail_prefix(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Writes s to f as a JSON string (quotes, escapes). */
void tr_json_str(FILE *f, const char *s);
/* Appends one events.jsonl line, {"time","step","worker","kind","detail"}
 * (wall-clock time), and flushes. */
void tr_event_line(FILE *f, int64_t step, int worker, const char *kind, const char *detail);
/* Keeps room reserved on disk ahead of an append-only log (call after
 * opening it; tr_event_line renews it), so that a full disk does not
 * swallow the events that report it. */
void tr_log_reserve(FILE *f);

/* A whole decimal integer in lo..hi (no sign games: "2x", "", " 3" and
 * out-of-range values are refused, where atoi would take 2, 0, 3 or wrap):
 * 0 with *out set, or -1 (*out untouched). For flags and environment
 * variables; the caller names what was wrong. */
int tr_parse_int(const char *s, long long lo, long long hi, long long *out);

/* Whether argv[i] is one of flags (a NULL-terminated list of the options
 * that take a value) and the last argument, so without its value: the
 * command then says "FLAG needs a value" instead of calling it unknown. */
int tr_flag_lacks_value(int argc, char *const *argv, int i, const char *const *flags);

/* Monotonic time in seconds. */
double tr_now(void);
/* Peak resident set size of this process in bytes (VmHWM), 0 if unknown. */
size_t tr_peak_rss(void);
/* Current resident set size in bytes (VmRSS), 0 if unknown. */
size_t tr_current_rss(void);

/* Reads a whole file into a malloc'd buffer (NUL-terminated; *len excludes the
 * NUL). Caller frees. Returns NULL with tr_error() set on failure. */
char *tr_read_file(const char *path, size_t *len);
/* Writes buf to path atomically and durably: path.tmp, fsync, rename, fsync
 * of the directory (tr_tmp_open, then tr_tmp_commit). */
int tr_write_file_atomic(const char *path, const void *buf, size_t len);
/* A file written in place of path, for writers that stream it: opens
 * path.tmp (its name into tmp, n bytes), emptied and flocked until the
 * commit or abandon, so writers of one path take turns and never mix
 * their bytes; each waits for the one before it while that one runs (up
 * to 10 min; 30 s once it is stopped or unseen), saying so on stderr after
 * 1 s. A filesystem without locks goes unlocked. fd, or a negative code.
 * tr_tmp_commit: fsync, rename over path, fsync of the directory; fd is
 * closed and, on failure, tmp removed. tr_tmp_abandon: tmp removed, fd
 * closed. */
int tr_tmp_open(const char *path, char *tmp, size_t n);
int tr_tmp_commit(int fd, const char *tmp, const char *path);
void tr_tmp_abandon(int fd, const char *tmp);
/* A lock file, for writers of several files that belong together (an
 * export's weights and config.json): an exclusive flock on path (created,
 * opened for writing, as NFS's emulation of flock needs), taken on the
 * file still at that name, waited for as tr_tmp_open waits (said on
 * stderr after 1 s; 10 min while the holder runs, 30 s once it is stopped
 * or unseen). *fd: the lock, or -1 on a filesystem without locks
 * (unlocked, as tr_tmp_open goes). TR_OK, or TR_EIO naming path.
 * tr_unlock_file removes path, then lets go (a waiter that then takes the
 * removed file opens the name anew), so a clean run leaves no lock file. */
int tr_lock_file(const char *path, int *fd);
void tr_unlock_file(int fd, const char *path);
/* fsync of the directory dir: the renames, creations and removals in it
 * made so far are durable once it returns TR_OK (a file system that cannot
 * sync a directory counts as done). TR_EIO naming dir otherwise. */
int tr_sync_dir(const char *dir);
/* A JSON-lines log (each line starting {"step":N): keeps the lines of steps
 * <= step, atomically; *dropped (may be NULL) = lines removed. A missing
 * file is fine (nothing to keep). */
int tr_jsonl_keep_until(const char *path, int64_t step, int *dropped);
/* mkdir -p. */
int tr_mkdirs(const char *path);
/* Removes the files in dir, then dir: for a flat temporary directory (the
 * DIR/.prepare-* prepare writes into; a subdirectory stays, and so does
 * dir). Best effort. */
void tr_remove_flat(const char *dir);

/* Advisory locks and processes, for messages and deadlines: the pid that
 * holds an flock on fd's file (a holder line of /proc/locks for the same
 * device and inode; 0 when none is seen, or another pid namespace or
 * filesystem hides it); process pid's state letter (/proc/PID/stat: 'R',
 * 'S', 'T', ...; 0 when it is gone or cannot be seen); and whether it is
 * alive and not stopped. */
int tr_flock_holder(int fd);
/* Waiting for another process's flock, said and bounded alike everywhere
 * (the start gate, prepare's swap, an atomic write's .tmp): after each
 * busy try on fd, tr_lock_wait_step looks up the holder once a second
 * (the first time 1 s after init) and returns TR_WAIT_SAY that first time
 * (the caller says whom it waits for: who is " (pid N)" or ""),
 * TR_WAIT_GIVE_UP past max_s, or past wait_s while the holder is stopped
 * (then stopped is 1) or cannot be seen, else TR_WAIT_ON. waited: seconds
 * since init, as of the last look. */
typedef struct {
  double t0, t_look, waited;
  int said, stopped;
  char who[32];
} tr_lock_wait;
enum { TR_WAIT_ON, TR_WAIT_SAY, TR_WAIT_GIVE_UP };
void tr_lock_wait_init(tr_lock_wait *w);
int tr_lock_wait_step(tr_lock_wait *w, int fd, double wait_s, double max_s);
/* Whether fd's file is still the one at path (not removed or replaced
 * since fd was opened): a lock taken on a file another process then
 * removed is no lock on what the path names now. */
int tr_fd_at_path(int fd, const char *path);
char tr_proc_state(int pid);
int tr_pid_running(int pid);

/* Runs `gnuplot SCRIPT` and waits for it (transom plot, transom sim). TR_OK
 * when it exits 0; TR_EIO with "gnuplot not found ..." when it is not
 * installed, or "gnuplot failed". Flushes stdout and stderr first. */
int tr_run_gnuplot(const char *script);

/* 64-byte aligned, zeroed allocation; free with tr_free_aligned. */
void *tr_alloc_aligned(size_t bytes);
void tr_free_aligned(void *p);

#endif
