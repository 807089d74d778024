/* util.c — error buffer, clocks, file helpers, running gnuplot. See util.h. */
#define _GNU_SOURCE /* fallocate */
#include "util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* --- errors --- */

static _Thread_local char err_buf[1024];

int tr_fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err_buf, sizeof err_buf, fmt, ap);
  va_end(ap);
  return code;
}

int tr_fail_prefix(int code, const char *fmt, ...) {
  char old[sizeof err_buf];
  memcpy(old, err_buf, sizeof old);
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(err_buf, sizeof err_buf, fmt, ap);
  va_end(ap);
  if (k >= 0 && (size_t)k < sizeof err_buf - 2) {
    err_buf[k] = ':';
    err_buf[k + 1] = ' ';
    size_t room = sizeof err_buf - (size_t)k - 2;
    size_t n = strnlen(old, room - 1);
    memcpy(err_buf + k + 2, old, n);
    err_buf[k + 2 + n] = 0;
  }
  return code;
}

const char *tr_error(void) { return err_buf; }

void tr_json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}

/* Room kept ahead of an event log on its file system (best effort, where
 * fallocate works): when checkpoints fill the disk, the events that say so
 * still land. Renewed once a quarter of it is left. */
#define TR_LOG_RESERVE (256 << 10)

void tr_log_reserve(FILE *f) {
  struct stat st;
  int fd = f ? fileno(f) : -1;
  if (fd < 0 || fstat(fd, &st) != 0) return;
  if ((off_t)st.st_blocks * 512 - st.st_size >= TR_LOG_RESERVE / 4) return;
  (void)fallocate(fd, FALLOC_FL_KEEP_SIZE, st.st_size, TR_LOG_RESERVE);
}

void tr_event_line(FILE *f, int64_t step, int worker, const char *kind, const char *detail) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  fprintf(f, "{\"time\":%.3f,\"step\":%lld,\"worker\":%d,\"kind\":", ts.tv_sec + ts.tv_nsec * 1e-9,
          (long long)step, worker);
  tr_json_str(f, kind);
  fprintf(f, ",\"detail\":");
  tr_json_str(f, detail);
  fprintf(f, "}\n");
  if (fflush(f) != 0 || ferror(f)) { /* not silently: the line goes to stderr instead */
    fprintf(stderr, "transom: an event could not be logged (%s): %s: %s\n", strerror(errno), kind, detail);
    clearerr(f);
  }
  tr_log_reserve(f);
}

/* --- clocks and memory --- */

int tr_parse_int(const char *s, long long lo, long long hi, long long *out) {
  if (!s || !(*s == '-' || (*s >= '0' && *s <= '9'))) return -1;
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (end == s || *end || errno || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

double tr_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static size_t status_kb(const char *field) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  size_t kb = 0, n = strlen(field);
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, field, n) == 0) {
      kb = (size_t)strtoull(line + n, NULL, 10);
      break;
    }
  }
  fclose(f);
  return kb * 1024;
}

size_t tr_peak_rss(void) { return status_kb("VmHWM:"); }
size_t tr_current_rss(void) { return status_kb("VmRSS:"); }

void *tr_alloc_aligned(size_t bytes) {
  void *p = NULL;
  if (bytes == 0) bytes = 64;
  bytes = (bytes + 63) & ~(size_t)63;
  if (posix_memalign(&p, 64, bytes) != 0) return NULL;
  memset(p, 0, bytes);
  return p;
}

void tr_free_aligned(void *p) { free(p); }

/* --- files --- */

char *tr_read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    tr_fail(TR_EIO, "cannot open '%s': %s", path, strerror(errno));
    return NULL;
  }
  char *buf = NULL;
  size_t cap = 0, n = 0;
  for (;;) {
    if (n + 65536 + 1 > cap) {
      size_t ncap = cap ? cap * 2 : 1 << 20;
      char *nb = realloc(buf, ncap);
      if (!nb) {
        free(buf);
        fclose(f);
        tr_fail(TR_ENOMEM, "out of memory reading '%s'", path);
        return NULL;
      }
      buf = nb;
      cap = ncap;
    }
    size_t got = fread(buf + n, 1, cap - n - 1, f);
    n += got;
    if (got == 0) break;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) {
    free(buf);
    tr_fail(TR_EIO, "error reading '%s'", path);
    return NULL;
  }
  buf[n] = 0;
  if (len) *len = n;
  return buf;
}

/* How long tr_write_file_atomic waits for another writer of the same path:
 * while it runs (a big file on a slow disk), and once it is stopped or
 * cannot be seen (as the start gate and prepare's swap wait). */
#define WRITE_MAX_S 600.0
#define WRITE_WAIT_S 30.0

/* An exclusive flock on the file at path, opened with oflags (O_CREAT
 * among them), taken on the file still at that name: the holder before us
 * may have renamed it (a .tmp committed) or removed it (a lock file let
 * go) meanwhile, and a lock on that file is no lock on the name; then the
 * name is opened anew (a file made with mode, before the umask). A busy
 * lock is retried on the same file until its holder lets go, or the file
 * leaves the name (tr_lock_wait_step bounds the wait and names the holder;
 * what_now / what_since word the message and the error: "is being
 * written" / "has been written"). *fd: the locked file, or -1 where the
 * filesystem has no locks (the caller goes on unlocked, as before). A lock
 * file another user made and this one may not write is locked read-only
 * (enough for flock on a local filesystem). */
static int lock_at_name(const char *path, int oflags, mode_t mode, const char *what_now, const char *what_since,
                        int *fd_out) {
  tr_lock_wait w;
  tr_lock_wait_init(&w);
  *fd_out = -1;
  for (int fd = -1;;) {
    if (fd < 0) fd = open(path, oflags | O_CLOEXEC, mode);
    if (fd < 0 && errno == EACCES && (oflags & O_ACCMODE) == O_RDWR)
      fd = open(path, O_RDONLY | O_CLOEXEC); /* another user's lock file: flock needs no write access (NFS does) */
    if (fd < 0) return tr_fail(TR_EIO, "cannot open '%s': %s", path, strerror(errno));
    int rc = flock(fd, LOCK_EX | LOCK_NB), busy = rc != 0 && (errno == EWOULDBLOCK || errno == EINTR);
    if (!busy && rc != 0) { /* a filesystem without locks */
      close(fd);
      return TR_OK;
    }
    if (!busy && tr_fd_at_path(fd, path)) {
      *fd_out = fd;
      return TR_OK;
    }
    if (!busy) { /* ours, but the name went to another file meanwhile: the name anew */
      close(fd);
      fd = -1;
      continue;
    }
    int step = tr_lock_wait_step(&w, fd, WRITE_WAIT_S, WRITE_MAX_S);
    if (step == TR_WAIT_SAY)
      fprintf(stderr, "transom: '%s' %s by another process%s: waiting for it\n", path, what_now, w.who);
    if (step == TR_WAIT_GIVE_UP) {
      close(fd);
      return tr_fail(TR_EIO, "'%s' %s by another process%s for %.0f s%s: stop it, then try again", path, what_since,
                     w.who, w.waited, w.stopped ? " (it is stopped)" : "");
    }
    if (!tr_fd_at_path(fd, path)) { /* the holder renamed or removed it, and holds it still (stopped?): the name */
      close(fd);
      fd = -1;
    }
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

/* Opens path.tmp, emptied, for a writer that holds it alone (see
 * tr_tmp_open). Two writers of one path (two exports into one directory)
 * would otherwise truncate and fill the same file, and one could rename a
 * mix of both. fd, or a negative code. */
static int open_tmp_locked(const char *tmp) {
  int fd, rc = lock_at_name(tmp, O_WRONLY | O_CREAT, 0644, "is being written", "has been written", &fd);
  if (rc) return rc;
  if (fd < 0 && (fd = open(tmp, O_WRONLY | O_CREAT | O_CLOEXEC, 0644)) < 0) /* no locks here: unlocked */
    return tr_fail(TR_EIO, "cannot create '%s': %s", tmp, strerror(errno));
  if (ftruncate(fd, 0) == 0) return fd;
  int e = errno;
  close(fd);
  return tr_fail(TR_EIO, "cannot truncate '%s': %s", tmp, strerror(e));
}

int tr_lock_file(const char *path, int *fd) {
  return lock_at_name(path, O_RDWR | O_CREAT, 0666, "is held", "has been held", fd); /* others may share it */
}

void tr_unlock_file(int fd, const char *path) {
  /* ours only: a file someone put at the name meanwhile may be another's lock. Removed before the
   * close: a waiter that then locks the removed file opens the name anew. */
  if (fd < 0 || tr_fd_at_path(fd, path)) unlink(path);
  if (fd >= 0) close(fd);
}

int tr_tmp_open(const char *path, char *tmp, size_t n) {
  if (snprintf(tmp, n, "%s.tmp", path) >= (int)n) return tr_fail(TR_EINVAL, "path too long: %s", path);
  return open_tmp_locked(tmp);
}

void tr_tmp_abandon(int fd, const char *tmp) {
  unlink(tmp); /* before the close: the lock is ours until then */
  close(fd);
}

int tr_tmp_commit(int fd, const char *tmp, const char *path) {
  /* the lock is held (fd open) until after the rename: a writer that
   * locked the file before it is renamed would truncate what we rename */
  int rc = TR_OK;
  if (fsync(fd) != 0) rc = tr_fail(TR_EIO, "cannot sync '%s': %s", tmp, strerror(errno));
  if (!rc && rename(tmp, path) != 0) rc = tr_fail(TR_EIO, "cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
  if (rc) {
    tr_tmp_abandon(fd, tmp);
    return rc;
  }
  close(fd); /* after fsync, a close error loses nothing */
  /* the rename itself is durable only once the directory is synced */
  char dir[4096];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash == dir) dir[1] = 0;
  else if (slash) *slash = 0;
  else snprintf(dir, sizeof dir, ".");
  return tr_sync_dir(dir);
}

int tr_write_file_atomic(const char *path, const void *buf, size_t len) {
  char tmp[4096];
  int fd = tr_tmp_open(path, tmp, sizeof tmp);
  if (fd < 0) return fd;
  const char *p = buf;
  size_t left = len;
  while (left > 0) {
    ssize_t w = write(fd, p, left);
    if (w < 0 && errno != EINTR) {
      int rc = tr_fail(TR_EIO, "cannot write '%s': %s", tmp, strerror(errno));
      tr_tmp_abandon(fd, tmp);
      return rc;
    }
    if (w > 0) p += w, left -= (size_t)w;
  }
  return tr_tmp_commit(fd, tmp, path);
}

int tr_sync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return tr_fail(TR_EIO, "cannot open directory '%s': %s", dir, strerror(errno));
  int bad = fsync(fd) != 0 && errno != EINVAL, e = errno; /* EINVAL: a file system that cannot sync a directory */
  close(fd);
  return bad ? tr_fail(TR_EIO, "cannot sync directory '%s': %s", dir, strerror(e)) : TR_OK;
}

int tr_mkdirs(const char *path) {
  char buf[4096];
  size_t n = strlen(path);
  if (n == 0 || n >= sizeof buf) return tr_fail(TR_EINVAL, "bad directory path '%s'", path);
  memcpy(buf, path, n + 1);
  for (size_t i = 1; i <= n; i++) {
    if (buf[i] == '/' || buf[i] == 0) {
      char c = buf[i];
      buf[i] = 0;
      if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return tr_fail(TR_EIO, "cannot create directory '%s': %s", buf, strerror(errno));
      buf[i] = c;
    }
  }
  struct stat st;
  if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
    return tr_fail(TR_EIO, "'%s' is not a directory", path);
  if (access(path, W_OK) != 0)
    return tr_fail(TR_EIO, "directory '%s' is not writable: %s", path, strerror(errno));
  return TR_OK;
}

void tr_remove_flat(const char *dir) {
  DIR *d = opendir(dir);
  char path[4096];
  for (struct dirent *e; d && (e = readdir(d));) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) < (int)sizeof path) unlink(path);
  }
  if (d) closedir(d);
  rmdir(dir);
}

int tr_flag_lacks_value(int argc, char *const *argv, int i, const char *const *flags) {
  if (i + 1 < argc) return 0;
  for (; *flags; flags++)
    if (strcmp(argv[i], *flags) == 0) return 1;
  return 0;
}

/* --- gnuplot --- */

int tr_run_gnuplot(const char *script) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) return tr_fail(TR_EIO, "fork: %s", strerror(errno));
  if (pid == 0) {
    execlp("gnuplot", "gnuplot", script, (char *)NULL);
    _exit(127); /* ok-exit: exec failed in the child */
  }
  int status;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return tr_fail(TR_EIO, "waitpid: %s", strerror(errno));
  if (WIFEXITED(status) && WEXITSTATUS(status) == 127)
    return tr_fail(TR_EIO, "gnuplot not found (Debian: apt-get install gnuplot-nox)");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return tr_fail(TR_EIO, "gnuplot failed");
  return TR_OK;
}

int tr_jsonl_keep_until(const char *path, int64_t step, int *dropped) {
  size_t len;
  char *text = tr_read_file(path, &len);
  if (dropped) *dropped = 0;
  if (!text) return TR_OK; /* none yet */
  char *out = malloc(len + 1);
  size_t k = 0;
  int gone = 0;
  for (char *line = text; out && *line;) {
    char *nl = strchr(line, '\n');
    size_t n = nl ? (size_t)(nl - line + 1) : strlen(line);
    long long s = -1;
    sscanf(line, "{\"step\":%lld", &s);
    if (s >= 0 && s <= step && nl) {
      memcpy(out + k, line, n);
      k += n;
    } else {
      gone++;
    }
    line += n;
  }
  int rc = out ? tr_write_file_atomic(path, out, k) : tr_fail(TR_ENOMEM, "out of memory");
  free(out);
  free(text);
  if (dropped) *dropped = gone;
  return rc;
}

int tr_flock_holder(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return 0;
  FILE *f = fopen("/proc/locks", "r");
  if (!f) return 0;
  char line[256];
  int pid = 0;
  while (!pid && fgets(line, sizeof line, f)) {
    /* "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; a waiter's is "1: -> FLOCK ..." */
    const char *p = line + strspn(line, "0123456789: ");
    int who;
    unsigned maj, min;
    unsigned long long ino;
    if (strncmp(p, "FLOCK", 5) == 0 && sscanf(p, "FLOCK %*s %*s %d %x:%x:%llu", &who, &maj, &min, &ino) == 4 &&
        ino == (unsigned long long)st.st_ino && makedev(maj, min) == st.st_dev)
      pid = who;
  }
  fclose(f);
  return pid;
}

int tr_fd_at_path(int fd, const char *path) {
  struct stat a, b;
  return fstat(fd, &a) == 0 && stat(path, &b) == 0 && a.st_ino == b.st_ino && a.st_dev == b.st_dev;
}

char tr_proc_state(int pid) {
  if (pid <= 0) return 0;
  char path[64], text[512];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = 0;
  const char *rp = strrchr(text, ')'); /* the name may hold spaces and parentheses */
  return rp && rp[1] == ' ' ? rp[2] : 0;
}

int tr_pid_running(int pid) {
  char st = tr_proc_state(pid);
  return st && st != 'T' && st != 't' && st != 'Z' && st != 'X';
}

void tr_lock_wait_init(tr_lock_wait *w) {
  memset(w, 0, sizeof *w);
  w->t0 = tr_now();
  w->t_look = w->t0 + 1.0;
}

int tr_lock_wait_step(tr_lock_wait *w, int fd, double wait_s, double max_s) {
  double now = tr_now();
  if (now < w->t_look) return TR_WAIT_ON;
  w->t_look = now + 1.0;
  w->waited = now - w->t0;
  int pid = tr_flock_holder(fd), running = tr_pid_running(pid);
  w->stopped = pid > 0 && !running;
  w->who[0] = 0;
  if (pid > 0) snprintf(w->who, sizeof w->who, " (pid %d)", pid);
  if (w->waited > max_s || (w->waited > wait_s && !running)) return TR_WAIT_GIVE_UP;
  if (w->said) return TR_WAIT_ON;
  w->said = 1;
  return TR_WAIT_SAY;
}
