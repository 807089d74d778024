/* ckpt_internal.h — ckpt's private seams: between ckpt.c and
 * ckpt_remote.c (the remote store), and for white-box tests
 * (the manifest fuzz target, spec/fuzz/fuzz_ckpt_manifest.c, which adds
 * ckpt/ to its include path). Not on any other module's include path: the
 * build keeps it out of the public API (ckpt/include/ckpt.h).
 */
#ifndef TRANSOM_CKPT_INTERNAL_H
#define TRANSOM_CKPT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "ckpt.h"

/* Decodes a manifest value (the LMDB "manifest" db's layout, written by the
 * engine's encoder in ckpt.c) from len bytes at data, which may be anything:
 * every length and count is checked against len before it is used, the
 * trailing CRC32C first.
 *
 * On success returns 0 and fills *m (m->tensors = *tensors, a malloc'd table
 * of m->ntensors entries, each name NUL-terminated; the caller frees it) and
 * *chunk (the chunk size the tensors were stored in, > 0). On failure returns
 * TR_EFORMAT (or TR_ENOMEM) with tr_error() set; *tensors is untouched and
 * nothing is allocated; *m and *chunk may have been partly written. Any
 * thread; no global state. */
int ckpt_manifest_decode(const void *data, size_t len, ckpt_manifest *m, ckpt_tensor_info **tensors,
                         uint64_t *chunk);

/* --- level 3: the remote store (ckpt_remote.c; file format there) --- */

/* Creates dir if needed, checks it is writable, removes stale temporaries
 * of this host's dead processes. 0 or an error naming dir. */
int remote_prepare(const char *dir);

/* One checkpoint being written: remote_begin (header + manifest), then
 * remote_write the tensors' bytes in manifest order, then remote_publish
 * (fsync, rename, fsync dir) or remote_abandon (the temporary removed).
 * rate: bytes per second on average since remote_begin (0 = no limit):
 * remote_pace sleeps to keep it (called between writes, outside any LMDB
 * transaction). A failed begin leaves nothing behind. */
typedef struct {
  int fd;
  char dir[1024], tmp[1400], final[1200];
  double rate, t0;
  uint64_t sent;
} remote_file;
int remote_begin(remote_file *f, const char *dir, int64_t step, const void *manifest, size_t mlen, double rate);
int remote_write(remote_file *f, const void *p, size_t n);
void remote_pace(remote_file *f);
int remote_publish(remote_file *f);
void remote_abandon(remote_file *f);

/* Published steps, ascending: the newest cap when there are more (count
 * <= cap; 0 for a missing dir), or an error. */
int remote_steps(const char *dir, int64_t *steps, int cap);
/* Removes all but the newest keep_last (and multiples of keep_every, and
 * just: the step just published). */
int remote_retain(const char *dir, int keep_last, int keep_every, int64_t just);
/* Removes the published steps after step; how many, or an error. */
int remote_drop_after(const char *dir, int64_t step);

/* A published checkpoint mapped read-only: the manifest's raw bytes (for
 * ckpt_manifest_decode) and the tensors' bytes after them. Nothing is
 * verified here but the header. remote_unmap releases it. */
typedef struct {
  char path[1200];
  const uint8_t *map, *manifest, *data;
  size_t len, manifest_len, data_len;
} remote_view;
int remote_map(const char *dir, int64_t step, remote_view *v);
int remote_has(const char *dir, int64_t step); /* 1 when step is published */
void remote_unmap(remote_view *v);

#endif
