/* ckpt_internal.h — ckpt's private seams, for ckpt.c and white-box tests
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

#endif
