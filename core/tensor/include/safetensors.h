/* safetensors.h — write and read the safetensors format (Hugging Face):
 * 8-byte little-endian header length N, N bytes of JSON header
 * {"__metadata__":{...}, "name":{"dtype":"F32","shape":[...],
 * "data_offsets":[begin,end]}, ...}, then the data. The header is padded with
 * spaces so the data starts 8-byte aligned. transom writes float32 only.
 *
 * The reader validates everything before trusting it: header length against
 * the file size, every offset against the data size, shape against byte
 * count, each tensor name once. Used by the trainer (final weights), `transom sample`, and the
 * checkpoint exporter.
 */
#ifndef TRANSOM_SAFETENSORS_H
#define TRANSOM_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define ST_MAX_DIMS 8

typedef struct {
  const char *name;
  const float *data;
  int ndim;
  const int64_t *dim;
} st_tensor;

/* Writes tensors to path atomically (path.tmp + fsync + rename). meta is a
 * NULL-terminated list of key, value string pairs added to __metadata__
 * beside "format":"pt" (may be NULL). */
int safetensors_write(const char *path, const st_tensor *t, int n, const char *const *meta);

typedef struct {
  char name[128];
  char dtype[8];
  int ndim;
  int64_t dim[ST_MAX_DIMS];
  uint64_t begin, end; /* byte offsets into data */
} st_entry;

typedef struct {
  char *buf; /* the whole file */
  size_t len;
  st_entry *entries;
  int n;
  const uint8_t *data;
  size_t data_len;
} st_file;

/* Reads and validates the file at path. TR_EIO when it cannot be read;
 * TR_EFORMAT "'PATH': not a valid float32 safetensors file: REASON", the
 * reason naming the tensor and what was wrong (its dtype, its offsets
 * against the data, its shape against its bytes, a name twice). On error f
 * is left empty (safetensors_close is not needed). */
int safetensors_open(st_file *f, const char *path);
void safetensors_close(st_file *f);
const st_entry *safetensors_find(const st_file *f, const char *name);

#endif
