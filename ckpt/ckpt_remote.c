/* ckpt_remote.c — level 3 of the checkpoint engine: the remote store, a
 * directory on another disk (a shared file system's mount, another host's
 * disk mounted here). One file per checkpoint:
 *
 *   DIR/step-00000000000000001234.ckpt
 *     "TRCKREM1" | manifest length (u64 LE) | manifest (the LMDB manifest
 *     value, byte for byte: it carries its own CRC32C and every tensor's) |
 *     every tensor's bytes, in manifest order, back to back
 *
 * A file is written as DIR/.tmp-step-N.HOST.PID, fsync'd, renamed to its
 * name and the directory fsync'd: a reader sees a whole checkpoint or none
 * (commit-then-publish), whenever the writer dies. Readers ignore every
 * other name; stale temporaries of this host's dead processes are removed
 * when a store is prepared. LMDB is not used here on purpose: its lock file
 * and memory map are not safe on network file systems.
 *
 * What this file does not do: decide what to replicate or when (the
 * engine's replicator thread in ckpt.c), decode manifests (ckpt.c). Called
 * from ckpt.c only; declared in ckpt_internal.h.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt_internal.h"
#include "util.h"

#define REMOTE_MAGIC "TRCKREM1"
#define HEADER_BYTES 16

/* --- names --- */

static void step_path(char *out, size_t n, const char *dir, int64_t step) {
  snprintf(out, n, "%s/step-%020lld.ckpt", dir, (long long)step);
}

/* The step of a published checkpoint's file name, or -1. */
static int64_t step_of(const char *name) {
  if (strncmp(name, "step-", 5) != 0 || strlen(name) != 5 + 20 + 5 || strcmp(name + 25, ".ckpt") != 0) return -1;
  int64_t v = 0;
  for (int i = 5; i < 25; i++) {
    if (name[i] < '0' || name[i] > '9') return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

static int fsync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY);
  if (fd < 0) return tr_fail(TR_EIO, "remote checkpoint store '%s': %s", dir, strerror(errno));
  int rc = fsync(fd) == 0 || errno == EINVAL ? TR_OK : tr_fail(TR_EIO, "fsync '%s': %s", dir, strerror(errno));
  close(fd);
  return rc;
}

/* --- preparing a store --- */

/* This host's name as temporaries carry it: '.' and '/' as '_', so that
 * the name's dots cannot be taken for the separators around it. */
static void temp_host(char *host, size_t n) {
  host[0] = 0;
  gethostname(host, n - 1);
  host[n - 1] = 0;
  for (char *p = host; *p; p++)
    if (*p == '.' || *p == '/') *p = '_';
}

/* Removes .tmp-step-N.HOST.PID files of this host whose process is gone
 * (a replicator killed mid-copy). Others' are left to them. */
static void remove_stale(const char *dir) {
  char host[256];
  temp_host(host, sizeof host);
  DIR *d = opendir(dir);
  struct dirent *de;
  while (d && (de = readdir(d))) {
    if (strncmp(de->d_name, ".tmp-step-", 10) != 0) continue;
    const char *pid_s = strrchr(de->d_name, '.'), *host_s = strchr(de->d_name + 10, '.');
    if (!pid_s || !host_s || host_s == pid_s) continue;
    size_t hl = (size_t)(pid_s - host_s - 1);
    if (hl != strlen(host) || strncmp(host_s + 1, host, hl) != 0) continue;
    long pid = strtol(pid_s + 1, NULL, 10);
    if (pid <= 0 || (kill((pid_t)pid, 0) != 0 && errno == ESRCH)) {
      char path[2048];
      snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
      unlink(path);
    }
  }
  if (d) closedir(d);
}

int remote_prepare(const char *dir) {
  if (!dir[0]) return tr_fail(TR_EINVAL, "the remote checkpoint store's path is empty");
  if (tr_mkdirs(dir)) return tr_fail_prefix(TR_EIO, "remote checkpoint store '%s'", dir);
  char probe[2048];
  snprintf(probe, sizeof probe, "%s/.tmp-probe.%ld", dir, (long)getpid());
  int fd = open(probe, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return tr_fail(TR_EIO, "remote checkpoint store '%s' is not writable: %s", dir, strerror(errno));
  close(fd);
  unlink(probe);
  remove_stale(dir);
  return TR_OK;
}

/* --- writing one checkpoint --- */

int remote_begin(remote_file *f, const char *dir, int64_t step, const void *manifest, size_t mlen, double rate) {
  memset(f, 0, sizeof *f);
  char host[256];
  temp_host(host, sizeof host);
  snprintf(f->dir, sizeof f->dir, "%s", dir);
  snprintf(f->tmp, sizeof f->tmp, "%s/.tmp-step-%lld.%s.%ld", dir, (long long)step, host, (long)getpid());
  step_path(f->final, sizeof f->final, dir, step);
  f->rate = rate;
  f->t0 = tr_now();
  f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (f->fd < 0) return tr_fail(TR_EIO, "remote checkpoint '%s': %s", f->tmp, strerror(errno));
  uint8_t hdr[HEADER_BYTES];
  memcpy(hdr, REMOTE_MAGIC, 8);
  uint64_t n = mlen;
  memcpy(hdr + 8, &n, 8);
  int rc = remote_write(f, hdr, sizeof hdr);
  if (!rc) rc = remote_write(f, manifest, mlen);
  if (rc) remote_abandon(f);
  return rc;
}

/* Writes all of p (remote_pace sleeps for the rate). */
int remote_write(remote_file *f, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n > 0) {
    ssize_t w = write(f->fd, b, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return tr_fail(TR_EIO, "writing remote checkpoint '%s': %s", f->tmp, w < 0 ? strerror(errno) : "no progress");
    b += w;
    n -= (size_t)w;
    f->sent += (uint64_t)w;
  }
  return TR_OK;
}

/* Sleeps as long as the rate (bytes/s; 0 = none) says: the average since
 * remote_begin stays at or below it. */
void remote_pace(remote_file *f) {
  if (f->rate > 0) {
    double ahead = (double)f->sent / f->rate - (tr_now() - f->t0);
    if (ahead > 0) {
      struct timespec ts = {(time_t)ahead, (long)((ahead - (double)(time_t)ahead) * 1e9)};
      while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
      }
    }
  }
}

int remote_publish(remote_file *f) {
  int rc = fsync(f->fd) == 0 ? TR_OK : tr_fail(TR_EIO, "fsync '%s': %s", f->tmp, strerror(errno));
  if (close(f->fd) != 0 && !rc) rc = tr_fail(TR_EIO, "closing '%s': %s", f->tmp, strerror(errno));
  f->fd = -1;
  if (!rc && rename(f->tmp, f->final) != 0)
    rc = tr_fail(TR_EIO, "publishing remote checkpoint '%s': %s", f->final, strerror(errno));
  if (!rc) rc = fsync_dir(f->dir);
  if (rc) unlink(f->tmp);
  return rc;
}

void remote_abandon(remote_file *f) {
  if (f->fd >= 0) close(f->fd);
  f->fd = -1;
  unlink(f->tmp);
}

/* --- listing and retention --- */

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return x < y ? -1 : x > y;
}

/* Every published step, ascending, malloc'd into *out (NULL when none);
 * the count, or an error. */
static int remote_list(const char *dir, int64_t **out) {
  *out = NULL;
  DIR *d = opendir(dir);
  if (!d) return errno == ENOENT ? 0 : tr_fail(TR_EIO, "remote checkpoint store '%s': %s", dir, strerror(errno));
  int n = 0, cap = 0;
  int64_t *v = NULL;
  struct dirent *de;
  while ((de = readdir(d))) {
    int64_t s = step_of(de->d_name);
    if (s < 0) continue;
    if (n == cap) {
      int64_t *nv = cap < (1 << 28) ? realloc(v, sizeof *v * (size_t)(cap = cap ? cap * 2 : 256)) : NULL;
      if (!nv) {
        free(v);
        closedir(d);
        return tr_fail(TR_ENOMEM, "out of memory listing '%s'", dir);
      }
      v = nv;
    }
    v[n++] = s;
  }
  closedir(d);
  if (n > 1) qsort(v, (size_t)n, sizeof *v, cmp_i64); /* (v is NULL when nothing matched) */
  *out = v;
  return n;
}

int remote_steps(const char *dir, int64_t *steps, int cap) {
  int64_t *all;
  int n = remote_list(dir, &all);
  if (n < 0) return n;
  int from = n > cap ? n - cap : 0; /* readdir's order is no order: the newest cap of all of them */
  if (n - from > 0) memcpy(steps, all + from, sizeof *steps * (size_t)(n - from));
  free(all);
  return n - from;
}

int remote_retain(const char *dir, int keep_last, int keep_every, int64_t just) {
  int64_t *steps;
  int n = remote_list(dir, &steps), rc = n < 0 ? n : TR_OK;
  int removed = 0;
  for (int i = 0; i < n - keep_last; i++) {
    if (keep_every > 0 && steps[i] % keep_every == 0) continue;
    if (steps[i] == just) continue; /* just published, below a newer one left from before a resume */
    char path[2048];
    step_path(path, sizeof path, dir, steps[i]);
    if (unlink(path) != 0 && errno != ENOENT) rc = tr_fail(TR_EIO, "removing '%s': %s", path, strerror(errno));
    removed++;
  }
  free(steps);
  if (removed && !rc) rc = fsync_dir(dir);
  return rc;
}

int remote_drop_after(const char *dir, int64_t step) {
  int64_t *steps;
  int n = remote_list(dir, &steps), rc = n < 0 ? n : TR_OK, removed = 0;
  for (int i = 0; i < n; i++) {
    if (steps[i] <= step) continue;
    char path[2048];
    step_path(path, sizeof path, dir, steps[i]);
    if (unlink(path) == 0) removed++;
    else if (errno != ENOENT) rc = tr_fail(TR_EIO, "removing '%s': %s", path, strerror(errno));
  }
  free(steps);
  if (removed && !rc) rc = fsync_dir(dir);
  return rc ? rc : removed;
}

/* --- reading one checkpoint --- */

int remote_has(const char *dir, int64_t step) {
  char path[1200];
  step_path(path, sizeof path, dir, step);
  return access(path, R_OK) == 0;
}

int remote_map(const char *dir, int64_t step, remote_view *v) {
  memset(v, 0, sizeof *v);
  step_path(v->path, sizeof v->path, dir, step);
  int fd = open(v->path, O_RDONLY);
  if (fd < 0) return tr_fail(TR_EIO, "remote checkpoint '%s': %s", v->path, strerror(errno));
  struct stat st;
  int rc = fstat(fd, &st) == 0 ? TR_OK : tr_fail(TR_EIO, "'%s': %s", v->path, strerror(errno));
  if (!rc && st.st_size < HEADER_BYTES) rc = tr_fail(TR_EFORMAT, "'%s' is truncated (%lld bytes)", v->path, (long long)st.st_size);
  if (!rc) {
    v->map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (v->map == MAP_FAILED) {
      v->map = NULL;
      rc = tr_fail(TR_EIO, "mapping '%s': %s", v->path, strerror(errno));
    }
  }
  close(fd);
  if (rc) return rc;
  v->len = (size_t)st.st_size;
  uint64_t mlen;
  memcpy(&mlen, v->map + 8, 8);
  if (memcmp(v->map, REMOTE_MAGIC, 8) != 0 || mlen > v->len - HEADER_BYTES) {
    remote_unmap(v);
    return tr_fail(TR_EFORMAT, "'%s' is not a transom remote checkpoint (bad header)", v->path);
  }
  v->manifest = v->map + HEADER_BYTES;
  v->manifest_len = (size_t)mlen;
  v->data = v->manifest + mlen;
  v->data_len = v->len - HEADER_BYTES - (size_t)mlen;
  return TR_OK;
}

void remote_unmap(remote_view *v) {
  if (v->map) munmap((void *)v->map, v->len);
  v->map = NULL;
}
