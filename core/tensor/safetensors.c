/* safetensors.c — safetensors writer and validating reader (see the header). */
#include "safetensors.h"

#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "util.h"

/* --- writer --- */

typedef struct {
  char *p;
  size_t n, cap;
  int oom;
} sbuf;

static void sb_add(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_add(sbuf *b, const char *fmt, ...) {
  if (b->oom) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(b->cap ? b->p + b->n : NULL, b->cap - b->n, fmt, ap); /* no NULL + 0 before the first realloc */
    va_end(ap);
    if (k >= 0 && b->n + (size_t)k < b->cap) {
      b->n += (size_t)k;
      return;
    }
    size_t ncap = (b->cap ? b->cap * 2 : 4096) + (size_t)(k > 0 ? k : 0);
    char *np = realloc(b->p, ncap);
    if (!np) {
      b->oom = 1;
      return;
    }
    b->p = np;
    b->cap = ncap;
  }
}

static void sb_str(sbuf *b, const char *s) { /* JSON string with escapes */
  sb_add(b, "\"");
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') sb_add(b, "\\%c", c);
    else if (c < 0x20) sb_add(b, "\\u%04x", c);
    else sb_add(b, "%c", c);
  }
  sb_add(b, "\"");
}

static int write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t w = write(fd, p, len);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    p += w;
    len -= (size_t)w;
  }
  return 0;
}

int safetensors_write(const char *path, const st_tensor *t, int n, const char *const *meta) {
  sbuf h = {0};
  sb_add(&h, "{\"__metadata__\":{\"format\":\"pt\"");
  for (int i = 0; meta && meta[i] && meta[i + 1]; i += 2) {
    sb_add(&h, ",");
    sb_str(&h, meta[i]);
    sb_add(&h, ":");
    sb_str(&h, meta[i + 1]);
  }
  sb_add(&h, "}");
  uint64_t off = 0;
  for (int i = 0; i < n; i++) {
    int64_t size = 1;
    sb_add(&h, ",");
    sb_str(&h, t[i].name);
    sb_add(&h, ":{\"dtype\":\"F32\",\"shape\":[");
    for (int d = 0; d < t[i].ndim; d++) {
      sb_add(&h, d ? ",%lld" : "%lld", (long long)t[i].dim[d]);
      size *= t[i].dim[d];
    }
    sb_add(&h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
           (unsigned long long)(off + 4 * (uint64_t)size));
    off += 4 * (uint64_t)size;
  }
  sb_add(&h, "}");
  while (!h.oom && h.n % 8 != 0) sb_add(&h, " ");
  if (h.oom) {
    free(h.p);
    return tr_fail(TR_ENOMEM, "out of memory writing '%s'", path);
  }
  char tmp[4096];
  int fd = tr_tmp_open(path, tmp, sizeof tmp);
  if (fd < 0) {
    free(h.p);
    return fd;
  }
  uint8_t len8[8];
  for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)h.n >> (8 * i)); /* little-endian */
  int bad = write_all(fd, len8, 8) || write_all(fd, h.p, h.n);
  for (int i = 0; i < n && !bad; i++) {
    int64_t size = 1;
    for (int d = 0; d < t[i].ndim; d++) size *= t[i].dim[d];
    bad = write_all(fd, t[i].data, 4 * (size_t)size);
  }
  int e = errno;
  free(h.p);
  if (bad) {
    int rc = tr_fail(TR_EIO, "cannot write '%s': %s", tmp, strerror(e));
    tr_tmp_abandon(fd, tmp);
    return rc;
  }
  return tr_tmp_commit(fd, tmp, path);
}

/* --- reader: a small JSON scanner for the header's fixed structure --- */

typedef struct {
  const char *p, *end;
} scan;

static void skip_ws(scan *s) {
  while (s->p < s->end && (*s->p == ' ' || *s->p == '\n' || *s->p == '\t' || *s->p == '\r')) s->p++;
}

static int expect(scan *s, char c) {
  skip_ws(s);
  if (s->p >= s->end || *s->p != c) return -1;
  s->p++;
  return 0;
}

/* Reads a JSON string into out (truncating escapes to their char); one of
 * cap bytes or more (with its NUL) fails. out == NULL skips the string,
 * whatever its length. */
static int read_str(scan *s, char *out, size_t cap) {
  if (expect(s, '"')) return -1;
  size_t k = 0;
  while (s->p < s->end && *s->p != '"') {
    char c = *s->p++;
    if (c == '\\') {
      if (s->p >= s->end) return -1;
      c = *s->p++;
      if (c == 'u') { /* keep it simple: \uXXXX -> '?' */
        if (s->end - s->p < 4) return -1;
        s->p += 4;
        c = '?';
      }
    }
    if (!out) continue;
    if (k + 1 >= cap) return -1;
    out[k++] = c;
  }
  if (s->p >= s->end) return -1;
  s->p++;
  if (out) out[k] = 0;
  return 0;
}

static int read_uint(scan *s, uint64_t *v) {
  skip_ws(s);
  if (s->p >= s->end || *s->p < '0' || *s->p > '9') return -1;
  uint64_t x = 0;
  while (s->p < s->end && *s->p >= '0' && *s->p <= '9') {
    if (x > (UINT64_MAX - 9) / 10) return -1;
    x = x * 10 + (uint64_t)(*s->p++ - '0');
  }
  *v = x;
  return 0;
}

static int read_uint_array(scan *s, uint64_t *v, int cap, int *n) {
  if (expect(s, '[')) return -1;
  *n = 0;
  skip_ws(s);
  if (s->p < s->end && *s->p == ']') {
    s->p++;
    return 0;
  }
  for (;;) {
    if (*n >= cap || read_uint(s, &v[*n])) return -1;
    (*n)++;
    skip_ws(s);
    if (s->p < s->end && *s->p == ',') {
      s->p++;
      continue;
    }
    return expect(s, ']');
  }
}

/* Skips an object of string values (__metadata__), its keys and values of
 * any length (safetensors sets no limit, and nothing here keeps them). */
static int skip_str_object(scan *s) {
  if (expect(s, '{')) return -1;
  skip_ws(s);
  if (s->p < s->end && *s->p == '}') {
    s->p++;
    return 0;
  }
  for (;;) {
    if (read_str(s, NULL, 0) || expect(s, ':') || read_str(s, NULL, 0)) return -1;
    skip_ws(s);
    if (s->p < s->end && *s->p == ',') {
      s->p++;
      continue;
    }
    return expect(s, '}');
  }
}

static int read_entry(scan *s, st_entry *e) {
  char key[32];
  int have = 0;
  if (expect(s, '{')) return -1;
  for (;;) {
    if (read_str(s, key, sizeof key) || expect(s, ':')) return -1;
    if (strcmp(key, "dtype") == 0) {
      if (read_str(s, e->dtype, sizeof e->dtype)) return -1;
      have |= 1;
    } else if (strcmp(key, "shape") == 0) {
      uint64_t d[ST_MAX_DIMS];
      if (read_uint_array(s, d, ST_MAX_DIMS, &e->ndim)) return -1;
      for (int i = 0; i < e->ndim; i++) e->dim[i] = (int64_t)d[i];
      have |= 2;
    } else if (strcmp(key, "data_offsets") == 0) {
      uint64_t d[2];
      int n;
      if (read_uint_array(s, d, 2, &n) || n != 2) return -1;
      e->begin = d[0];
      e->end = d[1];
      have |= 4;
    } else {
      return -1;
    }
    skip_ws(s);
    if (s->p < s->end && *s->p == ',') {
      s->p++;
      continue;
    }
    if (expect(s, '}')) return -1;
    return have == 7 ? 0 : -1;
  }
}

/* One tensor's entry against the data: F32, a shape whose byte count does
 * not wrap (readers trust dim[] once the offsets agree: [2^62, 4] floats is
 * 0 bytes modulo 2^64), offsets inside the data holding exactly that many
 * bytes. why gets the reason. (Names read twice: check_unique, once all are
 * read.) */
static int check_entry(const st_file *f, const st_entry *e, char *why, size_t n) {
  if (strcmp(e->dtype, "F32") != 0) {
    snprintf(why, n, "tensor '%s' is %s; only F32 is read", e->name, e->dtype);
    return -1;
  }
  uint64_t elems = 1;
  for (int i = 0; i < e->ndim; i++) {
    uint64_t d = (uint64_t)e->dim[i];
    if (e->dim[i] < 0 || (d && elems > UINT64_MAX / 4 / d)) {
      snprintf(why, n, "tensor '%s': its shape is too large to be stored", e->name);
      return -1;
    }
    elems *= d;
  }
  if (e->begin > e->end || e->end > f->data_len) {
    snprintf(why, n, "tensor '%s': data_offsets [%llu, %llu] are not within the %zu data bytes", e->name,
             (unsigned long long)e->begin, (unsigned long long)e->end, f->data_len);
    return -1;
  }
  if (e->end - e->begin != elems * 4) {
    snprintf(why, n, "tensor '%s': its shape makes %llu bytes of F32, its data_offsets [%llu, %llu] hold %llu", e->name,
             (unsigned long long)(elems * 4), (unsigned long long)e->begin, (unsigned long long)e->end,
             (unsigned long long)(e->end - e->begin));
    return -1;
  }
  return 0;
}

/* By name, then by place in the header (a name's entries in file order). */
static int by_name(const void *a, const void *b) {
  const st_entry *x = *(const st_entry *const *)a, *y = *(const st_entry *const *)b;
  int c = strcmp(x->name, y->name);
  return c ? c : (x > y) - (x < y);
}

/* Every name once: the entries sorted by name (O(n log n): a header of 50k
 * tensors compared pairwise took seconds), neighbours compared. The name
 * reported is the one whose second entry comes first in the header, as a
 * reader going in order would find it. 0; 1, the reason in why; or TR_ENOMEM. */
static int check_unique(const st_file *f, char *why, size_t n) {
  if (f->n < 2) return 0;
  const st_entry **idx = malloc(sizeof *idx * (size_t)f->n);
  if (!idx) return TR_ENOMEM;
  for (int i = 0; i < f->n; i++) idx[i] = &f->entries[i];
  qsort(idx, (size_t)f->n, sizeof *idx, by_name);
  const st_entry *dup = NULL; /* the earliest second entry of a name */
  for (int i = 1; i < f->n; i++)
    if (strcmp(idx[i - 1]->name, idx[i]->name) == 0 && (!dup || idx[i] < dup) &&
        (i < 2 || strcmp(idx[i - 2]->name, idx[i]->name) != 0))
      dup = idx[i];
  free(idx);
  if (!dup) return 0;
  snprintf(why, n, "tensor '%s' appears twice in the header", dup->name);
  return 1;
}

int safetensors_open(st_file *f, const char *path) {
  char why[384];
  memset(f, 0, sizeof *f);
  f->buf = tr_read_file(path, &f->len);
  if (!f->buf) return TR_EIO;
  int cap = 0, rc;
  snprintf(why, sizeof why, "the file is %zu bytes, less than the 8 of its header length", f->len);
  if (f->len < 8) goto bad;
  uint64_t hlen = 0;
  for (int i = 0; i < 8; i++) hlen |= (uint64_t)(uint8_t)f->buf[i] << (8 * i);
  snprintf(why, sizeof why, "its header length %llu does not fit in the %zu bytes after it",
           (unsigned long long)hlen, f->len - 8);
  if (hlen > f->len - 8) goto bad;
  snprintf(why, sizeof why, "its header length is %llu, less than the 2 bytes of the smallest header, {}",
           (unsigned long long)hlen);
  if (hlen < 2) goto bad;
  f->data = (const uint8_t *)f->buf + 8 + hlen;
  f->data_len = f->len - 8 - hlen;
  scan s = {f->buf + 8, f->buf + 8 + hlen};
  snprintf(why, sizeof why, "its header is not a JSON object");
  if (expect(&s, '{')) goto bad;
  skip_ws(&s);
  if (s.p < s.end && *s.p == '}') goto done;
  for (;;) {
    char name[128];
    snprintf(why, sizeof why, "header byte %zu: expected a tensor name in quotes (at most 127 bytes), then ':'",
             (size_t)(s.p - (f->buf + 8)));
    if (read_str(&s, name, sizeof name) || expect(&s, ':')) goto bad;
    if (strcmp(name, "__metadata__") == 0) {
      snprintf(why, sizeof why, "__metadata__ is not an object of strings");
      if (skip_str_object(&s)) goto bad;
    } else {
      if (f->n == cap) {
        cap = cap ? cap * 2 : 64;
        st_entry *ne = realloc(f->entries, sizeof(st_entry) * (size_t)cap);
        if (!ne) {
          safetensors_close(f);
          return tr_fail(TR_ENOMEM, "out of memory reading '%s'", path);
        }
        f->entries = ne;
      }
      st_entry *e = &f->entries[f->n];
      memset(e, 0, sizeof *e);
      memcpy(e->name, name, sizeof e->name);
      snprintf(why, sizeof why, "tensor '%s': its entry is not {\"dtype\", \"shape\" (at most %d dimensions), "
               "\"data_offsets\"}", name, ST_MAX_DIMS);
      if (read_entry(&s, e) || check_entry(f, e, why, sizeof why)) goto bad;
      f->n++;
    }
    skip_ws(&s);
    if (s.p < s.end && *s.p == ',') {
      s.p++;
      continue;
    }
    snprintf(why, sizeof why, "header byte %zu: expected ',' or '}'", (size_t)(s.p - (f->buf + 8)));
    if (expect(&s, '}')) goto bad;
    break;
  }
done:
  rc = check_unique(f, why, sizeof why);
  if (rc == TR_ENOMEM) {
    safetensors_close(f);
    return tr_fail(TR_ENOMEM, "out of memory reading '%s'", path);
  }
  if (rc) goto bad;
  return TR_OK;
bad:
  safetensors_close(f);
  return tr_fail(TR_EFORMAT, "'%s': not a valid float32 safetensors file: %s", path, why);
}

void safetensors_close(st_file *f) {
  free(f->buf);
  free(f->entries);
  memset(f, 0, sizeof *f);
}

const st_entry *safetensors_find(const st_file *f, const char *name) {
  for (int i = 0; i < f->n; i++)
    if (strcmp(f->entries[i].name, name) == 0) return &f->entries[i];
  return NULL;
}
