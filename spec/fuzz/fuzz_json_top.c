/* fuzz_json_top.c — fuzzes the strict top-level JSON reader (json_top_*,
 * core/base/json_top.c) on arbitrary texts and keys. Does not read files:
 * the readers take the text as bytes. Built by CMake with -DTRANSOM_FUZZ=ON;
 * run by run.sh.
 *
 * Input: byte 0 is the length k of the key asked for (cut at its first NUL
 * byte), bytes 1..k the key, the rest the text, copied into a buffer of
 * exactly its length (AddressSanitizer sees a read past it: the text need
 * not be NUL-terminated).
 *
 * Checked, for that key, "n", "" and a 300-byte key (what json_top.h
 * promises and hf.c and data.c rely on):
 *   - every reader returns TR_OK, TR_EFORMAT, or TR_EINVAL exactly when the
 *     key is 256 bytes or more; an error has a message and leaves *found
 *     and the output as they were; TR_OK sets *found to 0 or 1;
 *   - a text that is not one object, or has the key twice, is the same
 *     error, word for word, from every reader;
 *   - json_top_raw's value lies inside the text, and decides the others:
 *     a string reads with json_top_str (NUL-terminated, no longer than the
 *     value as written) unless it holds \u0000, true/false read with
 *     json_top_bool, a number reads with json_top_num unless out of a
 *     double's range, and json_top_int reads exactly the numbers written
 *     as digits in int64_t's range; each other pairing is TR_EFORMAT;
 *   - a key absent with found != NULL is "has no key" with found == NULL.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "json_top.h"
#include "util.h"

/* An error's message, kept to compare with the next reader's. */
static char first_err[512];

static void check_rc(int rc, const char *key, const char *what) {
  int long_key = strlen(key) >= 256;
  FUZZ_CHECK(rc == TR_OK || rc == TR_EFORMAT || rc == TR_EINVAL, "%s: rc %d", what, rc);
  FUZZ_CHECK((rc == TR_EINVAL) == long_key, "%s: rc %d for a key of %zu bytes", what, rc, strlen(key));
  if (rc) FUZZ_CHECK(tr_error()[0] != 0, "%s: refused without a message", what);
}

/* Digits, with a leading '-', in int64_t's range: what json_top_int reads. */
static int is_int64(const char *v, size_t n) {
  size_t k = n && v[0] == '-';
  if (k == n || n - k > 19) return 0;
  for (size_t i = k; i < n; i++)
    if (v[i] < '0' || v[i] > '9') return 0;
  char buf[32];
  memcpy(buf, v, n);
  buf[n] = 0;
  errno = 0;
  strtoll(buf, NULL, 10);
  return errno != ERANGE;
}

static void check_key(const json_doc *d, const char *key) {
  const char *val = NULL;
  size_t vlen = 0;
  int found = -1;
  int rc = json_top_raw(d, key, &val, &vlen, &found);
  check_rc(rc, key, "raw");
  if (rc) {
    FUZZ_CHECK(found == -1 && val == NULL, "raw: an error set the out-parameters");
    snprintf(first_err, sizeof first_err, "%s", tr_error());
    /* every reader scans the same way: the same error */
    int64_t i = 7;
    double x = 7;
    int b = 7, f2 = -1;
    char s[8] = "s";
    FUZZ_CHECK(json_top_int(d, key, &i, &f2) == rc && i == 7 && f2 == -1, "int: not raw's error");
    FUZZ_CHECK(strcmp(tr_error(), first_err) == 0, "int: '%s', raw: '%s'", tr_error(), first_err);
    FUZZ_CHECK(json_top_num(d, key, &x, &f2) == rc && x == 7 && f2 == -1, "num: not raw's error");
    FUZZ_CHECK(json_top_bool(d, key, &b, &f2) == rc && b == 7 && f2 == -1, "bool: not raw's error");
    FUZZ_CHECK(json_top_str(d, key, s, sizeof s, &f2) == rc && f2 == -1, "str: not raw's error");
    FUZZ_CHECK(strcmp(tr_error(), first_err) == 0, "str: '%s', raw: '%s'", tr_error(), first_err);
    return;
  }
  FUZZ_CHECK(found == 0 || found == 1, "raw: found %d", found);
  if (!found) {
    FUZZ_CHECK(val == NULL, "raw: an absent key set the value");
    FUZZ_CHECK(json_top_raw(d, key, &val, &vlen, NULL) == TR_EFORMAT && strstr(tr_error(), "has no key"),
               "an absent key, required: %s", tr_error());
    return;
  }
  FUZZ_CHECK(val >= d->text && vlen > 0 && vlen <= d->len && val + vlen <= d->text + d->len,
             "raw: the value is not inside the text");

  /* the typed readers, each against what the value as written is */
  int f2 = -1;
  int64_t i = 7;
  rc = json_top_int(d, key, &i, &f2);
  check_rc(rc, key, "int");
  FUZZ_CHECK(rc == (is_int64(val, vlen) ? TR_OK : TR_EFORMAT), "int: rc %d for %.*s", rc, (int)vlen, val);
  FUZZ_CHECK(rc ? f2 == -1 && i == 7 : f2 == 1, "int: found %d after rc %d", f2, rc);

  f2 = -1;
  double x = 7;
  rc = json_top_num(d, key, &x, &f2);
  check_rc(rc, key, "num");
  int number = val[0] == '-' || (val[0] >= '0' && val[0] <= '9');
  FUZZ_CHECK(number || rc == TR_EFORMAT, "num: a %c value read as a number", val[0]);
  if (number && rc) FUZZ_CHECK(strstr(tr_error(), "out of a double's range"), "num: %s", tr_error());
  FUZZ_CHECK(rc ? f2 == -1 && x == 7 : f2 == 1, "num: found %d after rc %d", f2, rc);

  f2 = -1;
  int b = 7;
  rc = json_top_bool(d, key, &b, &f2);
  check_rc(rc, key, "bool");
  int is_true = vlen == 4 && memcmp(val, "true", 4) == 0, is_false = vlen == 5 && memcmp(val, "false", 5) == 0;
  FUZZ_CHECK(rc == (is_true || is_false ? TR_OK : TR_EFORMAT), "bool: rc %d for %.*s", rc, (int)vlen, val);
  FUZZ_CHECK(rc ? b == 7 && f2 == -1 : b == is_true && f2 == 1, "bool: %d, found %d", b, f2);

  /* a string decodes to no more bytes than it is written in */
  size_t cap = vlen + 1;
  char *s = malloc(cap);
  FUZZ_CHECK(s != NULL, "out of memory");
  f2 = -1;
  rc = json_top_str(d, key, s, cap, &f2);
  check_rc(rc, key, "str");
  if (val[0] != '"') {
    FUZZ_CHECK(rc == TR_EFORMAT && f2 == -1, "str: a %c value read as a string", val[0]);
  } else if (rc) {
    FUZZ_CHECK(strstr(tr_error(), "\\u0000") && f2 == -1, "str: a string of %zu bytes refused: %s", vlen,
               tr_error());
  } else {
    FUZZ_CHECK(memchr(s, 0, cap) != NULL && strlen(s) + 2 <= vlen && f2 == 1, "str: %zu bytes from %zu",
               strlen(s), vlen);
    /* one byte too small a buffer is refused, never overrun */
    size_t len = strlen(s);
    char *tight = malloc(len + 1);
    FUZZ_CHECK(tight != NULL, "out of memory");
    FUZZ_CHECK(json_top_str(d, key, tight, len + 1, NULL) == TR_OK && strcmp(tight, s) == 0, "str: exact fit");
    if (len > 0) FUZZ_CHECK(json_top_str(d, key, tight, len, NULL) == TR_EFORMAT, "str: one byte short read");
    free(tight);
  }
  free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  size_t k = data[0];
  if (k > size - 1) k = size - 1;
  char key[256];
  memcpy(key, data + 1, k);
  key[k] = 0; /* a NUL inside cuts it */
  size_t len = size - 1 - k;
  char *text = malloc(len ? len : 1);
  FUZZ_CHECK(text != NULL, "out of memory");
  memcpy(text, data + 1 + k, len);
  json_doc d = {"f.json", text, len};
  check_key(&d, key);
  check_key(&d, "n");
  check_key(&d, "");
  char long_key[301];
  memset(long_key, 'n', 300);
  long_key[300] = 0;
  if (k) memcpy(long_key, key, strlen(key)); /* the input's key, made too long to ask for */
  check_key(&d, long_key);
  free(text);
  return 0;
}
