/* json_top.c — a strict scanner for the top-level keys of a JSON object (see
 * json_top.h). It checks the grammar of everything it skips (so a key inside
 * a nested object or a string is never mistaken for a top-level one) and
 * builds nothing: each lookup is one pass over the text, no allocation.
 * Called by hf.c (config.json) and data.c (vocab.json).
 */
#include "json_top.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

#define JSON_MAX_DEPTH 64 /* objects and arrays nested inside one value */
/* A key a caller asks for is shorter than this (longer: TR_EINVAL). A key in
 * the text may be any length: only its first JSON_KEY_MAX bytes are kept, and
 * one that long or longer is never compared (it cannot equal a caller's). */
#define JSON_KEY_MAX 256

/* --- scanner --- */

typedef struct {
  const char *p, *start, *end;
  const char *why; /* the first syntax error, or NULL */
  size_t at;       /* its byte offset */
} jscan;

static int bad(jscan *s, const char *why) {
  if (!s->why) {
    s->why = why;
    s->at = (size_t)(s->p - s->start);
  }
  return -1;
}

static void skip_ws(jscan *s) {
  while (s->p < s->end && (*s->p == ' ' || *s->p == '\n' || *s->p == '\t' || *s->p == '\r')) s->p++;
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* Four hex digits at p (at least 4 bytes there): their value, or -1. */
static long hex4(const char *p) {
  long v = 0;
  for (int i = 0; i < 4; i++) {
    char c = p[i];
    int h = is_digit(c) ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (h < 0) return -1;
    v = v * 16 + h;
  }
  return v;
}

/* Appends byte c to out at *n while there is room (out may be NULL: count only). */
static void put(char *out, size_t cap, size_t *n, unsigned char c) {
  if (out && *n < cap) out[*n] = (char)c;
  (*n)++;
}

static void put_utf8(char *out, size_t cap, size_t *n, unsigned long cp) {
  if (cp < 0x80) {
    put(out, cap, n, (unsigned char)cp);
  } else if (cp < 0x800) {
    put(out, cap, n, (unsigned char)(0xC0 | cp >> 6));
    put(out, cap, n, (unsigned char)(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    put(out, cap, n, (unsigned char)(0xE0 | cp >> 12));
    put(out, cap, n, (unsigned char)(0x80 | (cp >> 6 & 0x3F)));
    put(out, cap, n, (unsigned char)(0x80 | (cp & 0x3F)));
  } else {
    put(out, cap, n, (unsigned char)(0xF0 | cp >> 18));
    put(out, cap, n, (unsigned char)(0x80 | (cp >> 12 & 0x3F)));
    put(out, cap, n, (unsigned char)(0x80 | (cp >> 6 & 0x3F)));
    put(out, cap, n, (unsigned char)(0x80 | (cp & 0x3F)));
  }
}

/* The string at s->p (its opening quote), unescaped into out (cap bytes, no
 * NUL added; out may be NULL): *n is its full decoded length, which may be
 * more than cap (then out holds the first cap bytes). */
static int scan_string(jscan *s, char *out, size_t cap, size_t *n) {
  *n = 0;
  if (s->p >= s->end || *s->p != '"') return bad(s, "expected a string");
  s->p++;
  while (s->p < s->end) {
    unsigned char c = (unsigned char)*s->p;
    if (c == '"') {
      s->p++;
      return 0;
    }
    if (c < 0x20) return bad(s, "a control character inside a string");
    s->p++;
    if (c != '\\') {
      put(out, cap, n, c);
      continue;
    }
    if (s->p >= s->end) break;
    c = (unsigned char)*s->p++;
    switch (c) {
    case '"': case '\\': case '/': put(out, cap, n, c); break;
    case 'b': put(out, cap, n, '\b'); break;
    case 'f': put(out, cap, n, '\f'); break;
    case 'n': put(out, cap, n, '\n'); break;
    case 'r': put(out, cap, n, '\r'); break;
    case 't': put(out, cap, n, '\t'); break;
    case 'u': {
      long cp = s->end - s->p >= 4 ? hex4(s->p) : -1;
      if (cp < 0) return bad(s, "a \\u escape without four hex digits");
      s->p += 4;
      if (cp >= 0xD800 && cp <= 0xDBFF && s->end - s->p >= 6 && s->p[0] == '\\' && s->p[1] == 'u') {
        long lo = hex4(s->p + 2); /* a surrogate pair: one code point */
        if (lo >= 0xDC00 && lo <= 0xDFFF) {
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          s->p += 6;
        }
      }
      if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xFFFD; /* a lone surrogate: valid JSON, no character */
      put_utf8(out, cap, n, (unsigned long)cp);
      break;
    }
    default: s->p--; return bad(s, "an unknown escape inside a string");
    }
  }
  return bad(s, "a string without its closing quote");
}

/* -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
static int scan_number(jscan *s) {
  const char *p = s->p, *e = s->end;
  if (p < e && *p == '-') p++;
  if (p >= e || !is_digit(*p)) return bad(s, "expected a value");
  if (*p == '0') p++;
  else while (p < e && is_digit(*p)) p++;
  if (p < e && *p == '.') {
    if (++p >= e || !is_digit(*p)) return s->p = p, bad(s, "a number without digits after its '.'");
    while (p < e && is_digit(*p)) p++;
  }
  if (p < e && (*p == 'e' || *p == 'E')) {
    if (++p < e && (*p == '+' || *p == '-')) p++;
    if (p >= e || !is_digit(*p)) return s->p = p, bad(s, "a number without digits in its exponent");
    while (p < e && is_digit(*p)) p++;
  }
  s->p = p;
  return 0;
}

static int scan_literal(jscan *s, const char *word) {
  size_t n = strlen(word);
  if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n) != 0) return bad(s, "expected a value");
  s->p += n;
  return 0;
}

static int scan_value(jscan *s, int depth);

/* An object or an array at s->p, depth levels down. */
static int scan_container(jscan *s, int depth) {
  if (depth > JSON_MAX_DEPTH) return bad(s, "objects and arrays nested more than 64 deep");
  char close = *s->p == '{' ? '}' : ']';
  s->p++;
  skip_ws(s);
  if (s->p < s->end && *s->p == close) {
    s->p++;
    return 0;
  }
  for (;;) {
    if (close == '}') {
      size_t n;
      skip_ws(s);
      if (scan_string(s, NULL, 0, &n)) return -1;
      skip_ws(s);
      if (s->p >= s->end || *s->p != ':') return bad(s, "expected ':' after a key");
      s->p++;
    }
    if (scan_value(s, depth)) return -1;
    skip_ws(s);
    if (s->p < s->end && *s->p == ',') {
      s->p++;
      continue;
    }
    if (s->p < s->end && *s->p == close) {
      s->p++;
      return 0;
    }
    return bad(s, close == '}' ? "expected ',' or '}'" : "expected ',' or ']'");
  }
}

static int scan_value(jscan *s, int depth) {
  skip_ws(s);
  if (s->p >= s->end) return bad(s, "expected a value");
  size_t n;
  switch (*s->p) {
  case '"': return scan_string(s, NULL, 0, &n);
  case '{': case '[': return scan_container(s, depth + 1);
  case 't': return scan_literal(s, "true");
  case 'f': return scan_literal(s, "false");
  case 'n': return scan_literal(s, "null");
  default: return scan_number(s);
  }
}

/* --- the top-level object --- */

/* Scans the whole of d: 1 with key's value in *val, *vlen; 0 when key is
 * absent; TR_EFORMAT on a syntax error or key twice; TR_EINVAL when key is
 * JSON_KEY_MAX bytes or longer. */
static int find(const json_doc *d, const char *key, const char **val, size_t *vlen) {
  jscan s = {d->text, d->text, d->text + d->len, NULL, 0};
  size_t klen = strlen(key);
  int seen = 0;
  if (klen >= JSON_KEY_MAX)
    return tr_fail(TR_EINVAL, "'%s': the key asked for is %zu bytes, more than the %d a key is read to", d->file, klen,
                   JSON_KEY_MAX - 1);
  if (d->len >= 3 && memcmp(d->text, "\xEF\xBB\xBF", 3) == 0) s.p += 3; /* a UTF-8 byte order mark (RFC 8259 8.1) */
  skip_ws(&s);
  if (s.p >= s.end || *s.p != '{') {
    bad(&s, "expected '{'");
    goto syntax;
  }
  s.p++;
  skip_ws(&s);
  if (s.p < s.end && *s.p == '}') s.p++;
  else for (;;) {
    char name[JSON_KEY_MAX];
    size_t n;
    skip_ws(&s);
    if (scan_string(&s, name, sizeof name, &n)) goto syntax;
    skip_ws(&s);
    if (s.p >= s.end || *s.p != ':') {
      bad(&s, "expected ':' after a key");
      goto syntax;
    }
    s.p++;
    skip_ws(&s);
    const char *v = s.p;
    if (scan_value(&s, 0)) goto syntax;
    if (n == klen && n < sizeof name && memcmp(name, key, n) == 0) { /* n < sizeof name: name holds all n bytes */
      if (seen++) return tr_fail(TR_EFORMAT, "'%s': key %s appears twice", d->file, key);
      *val = v;
      *vlen = (size_t)(s.p - v);
    }
    skip_ws(&s);
    if (s.p < s.end && *s.p == ',') {
      s.p++;
      continue;
    }
    if (s.p < s.end && *s.p == '}') {
      s.p++;
      break;
    }
    bad(&s, "expected ',' or '}'");
    goto syntax;
  }
  skip_ws(&s);
  if (s.p != s.end) {
    bad(&s, "more after the object's closing '}'");
    goto syntax;
  }
  return seen;
syntax:
  return tr_fail(TR_EFORMAT, "'%s' is not a JSON object (byte %zu: %s)", d->file, s.at, s.why);
}

/* find, then absent handled as json_top.h says: 1 when the value is there,
 * 0 when it is absent and may be (found != NULL; *found is not set here: the
 * reader sets it once its value is read, so that an error leaves it). */
static int lookup(const json_doc *d, const char *key, const char **v, size_t *n, int *found) {
  int rc = find(d, key, v, n);
  if (rc == 0 && !found) return tr_fail(TR_EFORMAT, "'%s' has no key %s", d->file, key);
  return rc;
}

/* A reader's return when lookup gave rc <= 0: an error, or the key absent. */
static int not_read(int rc, int *found) {
  if (rc == 0) *found = 0;
  return rc;
}

/* A reader's return once its value is read. */
static int read_ok(int *found) {
  if (found) *found = 1;
  return TR_OK;
}

/* "'FILE': KEY is not WHAT (it is VALUE)", the value cut at 40 bytes. */
static int not_a(const json_doc *d, const char *key, const char *what, const char *v, size_t n) {
  return tr_fail(TR_EFORMAT, "'%s': %s is not %s (it is %.*s%s)", d->file, key, what, (int)(n > 40 ? 40 : n), v,
                 n > 40 ? "..." : "");
}

/* --- typed readers --- */

int json_top_int(const json_doc *d, const char *key, int64_t *out, int *found) {
  const char *v = NULL;
  size_t n = 0;
  int rc = lookup(d, key, &v, &n, found);
  if (rc <= 0) return not_read(rc, found);
  size_t k = n && v[0] == '-';
  if (k == n) return not_a(d, key, "an integer", v, n);
  for (; k < n; k++)
    if (!is_digit(v[k])) return not_a(d, key, "an integer", v, n);
  char buf[32];
  long long x = 0;
  errno = 0;
  if (n < sizeof buf) {
    memcpy(buf, v, n);
    buf[n] = 0;
    x = strtoll(buf, NULL, 10);
  }
  if (n >= sizeof buf || errno == ERANGE)
    return tr_fail(TR_EFORMAT, "'%s': %s is %.*s%s, out of a 64-bit integer's range", d->file, key,
                   (int)(n > 40 ? 40 : n), v, n > 40 ? "..." : "");
  *out = (int64_t)x;
  return read_ok(found);
}

int json_top_num(const json_doc *d, const char *key, double *out, int *found) {
  const char *v = NULL;
  size_t n = 0;
  int rc = lookup(d, key, &v, &n, found);
  if (rc <= 0) return not_read(rc, found);
  if (v[0] != '-' && !is_digit(v[0])) return not_a(d, key, "a number", v, n);
  /* a scanned number is followed by white space, ',' or '}' in the text:
   * strtod stops exactly at its end */
  char *end;
  double x = strtod(v, &end);
  if (end != v + n) return not_a(d, key, "a number", v, n);
  if (isinf(x))
    return tr_fail(TR_EFORMAT, "'%s': %s is %.*s%s, out of a double's range", d->file, key, (int)(n > 40 ? 40 : n), v,
                   n > 40 ? "..." : "");
  *out = x;
  return read_ok(found);
}

int json_top_bool(const json_doc *d, const char *key, int *out, int *found) {
  const char *v = NULL;
  size_t n = 0;
  int rc = lookup(d, key, &v, &n, found);
  if (rc <= 0) return not_read(rc, found);
  if (n == 4 && memcmp(v, "true", 4) == 0) *out = 1;
  else if (n == 5 && memcmp(v, "false", 5) == 0) *out = 0;
  else return not_a(d, key, "true or false", v, n);
  return read_ok(found);
}

int json_top_str(const json_doc *d, const char *key, char *out, size_t cap, int *found) {
  const char *v = NULL;
  size_t n = 0, len = 0;
  int rc = lookup(d, key, &v, &n, found);
  if (rc <= 0) return not_read(rc, found);
  if (v[0] != '"') return not_a(d, key, "a string", v, n);
  jscan s = {v, v, v + n, NULL, 0};
  scan_string(&s, NULL, 0, &len); /* already scanned: cannot fail */
  if (len >= cap)
    return tr_fail(TR_EFORMAT, "'%s': %s is a string of %zu bytes, longer than the %zu read", d->file, key, len,
                   cap ? cap - 1 : 0);
  s.p = v;
  scan_string(&s, out, cap, &len);
  if (memchr(out, 0, len)) return tr_fail(TR_EFORMAT, "'%s': %s holds a \\u0000 character", d->file, key);
  out[len] = 0;
  return read_ok(found);
}

int json_top_raw(const json_doc *d, const char *key, const char **val, size_t *vlen, int *found) {
  const char *v = NULL;
  size_t n = 0;
  int rc = lookup(d, key, &v, &n, found);
  if (rc <= 0) return not_read(rc, found);
  *val = v;
  *vlen = n;
  return read_ok(found);
}
