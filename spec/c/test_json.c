/* test_json.c — the strict top-level JSON reader (core/base/json_top.c):
 * a key is found at the top level only (not in a nested object, an array
 * or a string, escapes included), a key twice is refused, each typed reader
 * refuses another type naming the file, the key and the value, integers out
 * of int64_t's range and numbers out of a double's are refused, \u escapes
 * (a surrogate pair too) decode to UTF-8, and texts that are not one JSON
 * object are refused with the byte and the reason, deep nesting included.
 * Also: a key asked for of 256 bytes or more is refused (TR_EINVAL) and one
 * that long in the text is read past safely; *found and *out are untouched
 * by an error; a UTF-8 byte order mark is skipped; texts cut at every point
 * of a string, an escape or a number (explicit lengths, no NUL after them)
 * and NUL bytes inside; what json_top.h says it accepts beyond RFC 8259.
 * The end-to-end cases (config.json, vocab.json) are in spec/hf_spec.lua. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "json_top.h"
#include "util.h"

static json_doc doc(const char *text) { return (json_doc){"c.json", text, strlen(text)}; }

/* rc of reading key as an integer; *v and *found as read. */
static int int_of(const char *text, const char *key, int64_t *v, int *found) {
  json_doc d = doc(text);
  return json_top_int(&d, key, v, found);
}

static void top_level_only(void) {
  int64_t v = -1;
  int found = -1;
  const char *t = "{\"a\": {\"n\": 7, \"m\": [\"n\", {\"n\": 8}]}, \"s\": \"\\\"n\\\": 9 \\\\\", \"n\": 3}";
  CHECK(int_of(t, "n", &v, &found) == TR_OK && found == 1 && v == 3, "v %lld found %d: %s", (long long)v, found,
        tr_error());
  CHECK(int_of("{\"a\": {\"n\": 7}}", "n", &v, &found) == TR_OK && found == 0, "found %d", found);
  CHECK(int_of("{\"a\": {\"n\": 7}}", "n", &v, NULL) == TR_EFORMAT && strcmp(tr_error(), "'c.json' has no key n") == 0,
        "%s", tr_error());
  CHECK(int_of("{\"n\": 1, \"x\": 2, \"n\": 1}", "n", &v, &found) == TR_EFORMAT &&
            strcmp(tr_error(), "'c.json': key n appears twice") == 0, "%s", tr_error());
  CHECK(int_of("{\"\\u006e\": 5}", "n", &v, NULL) == TR_OK && v == 5, "an escaped key is the same key: %s", tr_error());
  CHECK(int_of("{\"n\\u0000\": 5}", "n", &v, &found) == TR_OK && found == 0, "a key with a NUL is another key");
  CHECK(int_of("{}", "n", &v, &found) == TR_OK && found == 0, "empty object");
}

static void types(void) {
  int64_t v = 0;
  CHECK(int_of("{\"n\": -12}", "n", &v, NULL) == TR_OK && v == -12, "%lld", (long long)v);
  CHECK(int_of("{\"n\": 9223372036854775807}", "n", &v, NULL) == TR_OK && v == INT64_MAX, "%s", tr_error());
  CHECK(int_of("{\"n\": 9223372036854775808}", "n", &v, NULL) == TR_EFORMAT && strstr(tr_error(), "range"), "%s",
        tr_error());
  CHECK(int_of("{\"n\": 12.0}", "n", &v, NULL) == TR_EFORMAT &&
            strcmp(tr_error(), "'c.json': n is not an integer (it is 12.0)") == 0, "%s", tr_error());
  CHECK(int_of("{\"n\": 1e3}", "n", &v, NULL) == TR_EFORMAT, "an exponent is not an integer");
  CHECK(int_of("{\"n\": \"12\"}", "n", &v, NULL) == TR_EFORMAT &&
            strcmp(tr_error(), "'c.json': n is not an integer (it is \"12\")") == 0, "%s", tr_error());
  CHECK(int_of("{\"n\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}", "n", &v, NULL) == TR_EFORMAT &&
            strstr(tr_error(), "(it is [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, ...)"), "a long value cut: %s",
        tr_error());

  json_doc d = doc("{\"e\": 1e-05, \"big\": 1e999, \"t\": true, \"f\": false, \"z\": null, "
                   "\"s\": \"x\\u00e9\\ud83d\\ude00\\n\"}");
  double x = 0;
  int b = -1;
  char s[16];
  CHECK(json_top_num(&d, "e", &x, NULL) == TR_OK && x == 1e-5, "%g", x);
  CHECK(json_top_num(&d, "big", &x, NULL) == TR_EFORMAT && strstr(tr_error(), "out of a double's range"), "%s",
        tr_error());
  CHECK(json_top_num(&d, "t", &x, NULL) == TR_EFORMAT &&
            strcmp(tr_error(), "'c.json': t is not a number (it is true)") == 0, "%s", tr_error());
  CHECK(json_top_bool(&d, "t", &b, NULL) == TR_OK && b == 1, "true");
  CHECK(json_top_bool(&d, "f", &b, NULL) == TR_OK && b == 0, "false");
  CHECK(json_top_bool(&d, "z", &b, NULL) == TR_EFORMAT &&
            strcmp(tr_error(), "'c.json': z is not true or false (it is null)") == 0, "%s", tr_error());
  CHECK(json_top_str(&d, "s", s, sizeof s, NULL) == TR_OK && strcmp(s, "x\xc3\xa9\xf0\x9f\x98\x80\n") == 0,
        "\\u escapes as UTF-8: %s", tr_error());
  CHECK(json_top_str(&d, "s", s, 4, NULL) == TR_EFORMAT && strstr(tr_error(), "a string of 8 bytes, longer than the 3"),
        "%s", tr_error());
  CHECK(json_top_str(&d, "e", s, sizeof s, NULL) == TR_EFORMAT &&
            strcmp(tr_error(), "'c.json': e is not a string (it is 1e-05)") == 0, "%s", tr_error());
  json_doc nul = doc("{\"s\": \"a\\u0000b\"}");
  CHECK(json_top_str(&nul, "s", s, sizeof s, NULL) == TR_EFORMAT && strstr(tr_error(), "\\u0000"), "%s", tr_error());
  const char *raw = NULL;
  size_t n = 0;
  json_doc arr = doc("{\"a\" : [1, {\"b\": 2}] , \"c\": 0}");
  CHECK(json_top_raw(&arr, "a", &raw, &n, NULL) == TR_OK && n == 13 && memcmp(raw, "[1, {\"b\": 2}]", 13) == 0,
        "%.*s", (int)n, raw);
}

/* text is refused as "not a JSON object" with this reason. */
static void not_object(const char *text, const char *why) {
  int64_t v;
  int found;
  char want[160];
  snprintf(want, sizeof want, ": %s)", why);
  int rc = int_of(text, "n", &v, &found);
  CHECK(rc == TR_EFORMAT && strstr(tr_error(), "'c.json' is not a JSON object (byte ") && strstr(tr_error(), want),
        "'%s': %s", text, tr_error());
}

static void syntax(void) {
  not_object("", "expected '{'");
  not_object("[1]", "expected '{'");
  not_object("{\"n\": 1", "expected ',' or '}'");
  not_object("{\"n\": 1,}", "expected a string");
  not_object("{\"n\" 1}", "expected ':' after a key");
  not_object("{\"n\": 1} x", "more after the object's closing '}'");
  not_object("{\"n\": 01}", "expected ',' or '}'");
  not_object("{\"n\": 1.}", "a number without digits after its '.'");
  not_object("{\"n\": 1e}", "a number without digits in its exponent");
  not_object("{\"n\": tru}", "expected a value");
  not_object("{\"n\": +1}", "expected a value");
  not_object("{\"n\": \"a\\q\"}", "an unknown escape inside a string");
  not_object("{\"n\": \"a\\u12\"}", "a \\u escape without four hex digits");
  not_object("{\"n\": \"a\tb\"}", "a control character inside a string");
  not_object("{\"n\": \"ab}", "a string without its closing quote");
  not_object("{\"n\": [1, 2}", "expected ',' or ']'");
  not_object("{\"n\": [1,]}", "expected a value");
  not_object("{\"x\": 1, \"n\": 2} {\"n\": 3}", "more after the object's closing '}'");
  /* a byte offset: where the fault is */
  int64_t v;
  CHECK(int_of("{\"n\": 1,}", "n", &v, NULL) == TR_EFORMAT && strstr(tr_error(), "(byte 8:"), "%s", tr_error());
  /* nesting: 64 levels inside a value are read, 65 refused (no unbounded recursion) */
  char deep[300];
  for (int levels = 64; levels <= 65; levels++) {
    size_t k = (size_t)snprintf(deep, sizeof deep, "{\"a\": ");
    for (int i = 0; i < levels; i++) deep[k++] = '[';
    for (int i = 0; i < levels; i++) deep[k++] = ']';
    snprintf(deep + k, sizeof deep - k, ", \"n\": 4}");
    int rc = int_of(deep, "n", &v, NULL);
    CHECK(levels == 64 ? rc == TR_OK && v == 4 : rc == TR_EFORMAT && strstr(tr_error(), "nested more than 64 deep"),
          "%d levels: %s", levels, tr_error());
  }
  /* the text's length is what is read: bytes past len are not the object's */
  json_doc cut = {"c.json", "{\"n\": 5}garbage", 8};
  CHECK(json_top_int(&cut, "n", &v, NULL) == TR_OK && v == 5, "%s", tr_error());
}

/* The text's first len bytes, copied into a buffer of exactly len bytes (so
 * that AddressSanitizer sees a read past the end), refused as "not a JSON
 * object" with this reason. */
static void not_object_n(const char *text, size_t len, const char *why) {
  char *copy = malloc(len ? len : 1);
  memcpy(copy, text, len);
  json_doc d = {"c.json", copy, len};
  int64_t v = 0;
  int found = -1;
  char want[160];
  snprintf(want, sizeof want, ": %s)", why);
  int rc = json_top_int(&d, "n", &v, &found);
  CHECK(rc == TR_EFORMAT && strstr(tr_error(), "'c.json' is not a JSON object (byte ") && strstr(tr_error(), want) &&
            found == -1, "%zu bytes of '%s': rc %d found %d: %s", len, text, rc, found, tr_error());
  free(copy);
}

/* A key of 256 bytes or more: asked for, refused (TR_EINVAL, before the
 * fix a read past the 256-byte copy of the text's key on the stack); in the
 * text, read past. */
static void long_keys(void) {
  char key[600], text[700];
  memset(key, 'k', 599);
  key[599] = 0;
  snprintf(text, sizeof text, "{\"%s\": 1, \"n\": 2}", key);
  int64_t v = -1;
  int found = -1;
  CHECK(int_of(text, key, &v, &found) == TR_EINVAL && found == -1 && v == -1 &&
            strstr(tr_error(), "the key asked for is 599 bytes, more than the 255"), "599-byte key: found %d: %s",
        found, tr_error());
  CHECK(int_of(text, key, &v, NULL) == TR_EINVAL, "599-byte key, required: %s", tr_error());
  CHECK(int_of(text, "n", &v, NULL) == TR_OK && v == 2, "a 599-byte key in the text is read past: %s", tr_error());
  /* 255 bytes: the longest asked for, found; a 256-byte key in the text
   * that starts with it is another key */
  key[255] = 0;
  snprintf(text, sizeof text, "{\"%s\": 3}", key);
  CHECK(int_of(text, key, &v, NULL) == TR_OK && v == 3, "255-byte key: %s", tr_error());
  snprintf(text, sizeof text, "{\"%sk\": 4}", key);
  CHECK(int_of(text, key, &v, &found) == TR_OK && found == 0, "a 256-byte key is not its 255-byte prefix");
  key[255] = 'k', key[256] = 0;
  CHECK(int_of(text, key, &v, &found) == TR_EINVAL, "256 bytes asked for: %s", tr_error());
}

/* An error leaves *found and *out as they were (json_top.h). */
static void untouched_on_error(void) {
  json_doc d = doc("{\"s\": \"x\", \"n\": 1}");
  int64_t v = -7;
  double x = -7;
  int b = -7, found = -7;
  CHECK(json_top_int(&d, "s", &v, &found) == TR_EFORMAT && found == -7 && v == -7, "int: found %d", found);
  CHECK(json_top_num(&d, "s", &x, &found) == TR_EFORMAT && found == -7 && x == -7, "num: found %d", found);
  CHECK(json_top_bool(&d, "s", &b, &found) == TR_EFORMAT && found == -7 && b == -7, "bool: found %d", found);
  char s[4] = "abc";
  CHECK(json_top_str(&d, "n", s, sizeof s, &found) == TR_EFORMAT && found == -7, "str: found %d", found);
  json_doc twice = doc("{\"n\": 1, \"n\": 2}");
  CHECK(json_top_int(&twice, "n", &v, &found) == TR_EFORMAT && found == -7 && v == -7, "twice: found %d", found);
  CHECK(json_top_int(&d, "n", &v, &found) == TR_OK && found == 1 && v == 1, "read: found %d", found);
  CHECK(json_top_int(&d, "z", &v, &found) == TR_OK && found == 0 && v == 1, "absent: found %d", found);
}

/* A UTF-8 byte order mark before the object is skipped; anywhere else it
 * is not white space. */
static void byte_order_mark(void) {
  int64_t v = 0;
  CHECK(int_of("\xEF\xBB\xBF{\"n\": 1}", "n", &v, NULL) == TR_OK && v == 1, "BOM: %s", tr_error());
  CHECK(int_of("\xEF\xBB\xBF \n{\"n\": 2}", "n", &v, NULL) == TR_OK && v == 2, "BOM, white space: %s", tr_error());
  not_object("\xEF\xBB\xBF\xEF\xBB\xBF{\"n\": 1}", "expected '{'");
  not_object(" \xEF\xBB\xBF{\"n\": 1}", "expected '{'");
  not_object("\xEF\xBB\xBF", "expected '{'");
  not_object("{\"n\": 1}\xEF\xBB\xBF", "more after the object's closing '}'");
  not_object_n("\xEF\xBB", 2, "expected '{'");
}

/* Texts of explicit length, cut inside a string, an escape or a number;
 * NUL bytes; numbers at the edges of int64_t and double. */
static void explicit_lengths(void) {
#define CUT(lit, why) not_object_n(lit, sizeof lit - 1, why)
  CUT("{\"n\": \"ab\\", "a string without its closing quote");
  CUT("{\"n\": \"\\u00", "a \\u escape without four hex digits");
  CUT("{\"n\": \"\\ud800", "a string without its closing quote");
  CUT("{\"n\": \"\\ud800\\u", "a \\u escape without four hex digits");
  CUT("{\"n\": \"\\ud800\\udc0", "a \\u escape without four hex digits");
  CUT("{\"n\": \"", "a string without its closing quote");
  CUT("{\"n", "a string without its closing quote");
  CUT("{\"n\": -", "expected a value");
  CUT("{\"n\": 1.", "a number without digits after its '.'");
  CUT("{\"n\": 1e+", "a number without digits in its exponent");
  CUT("{\"n\": 12", "expected ',' or '}'");
  CUT("{\"n\": tr", "expected a value");
  CUT("{\"n\": [", "expected a value");
  CUT("{", "expected a string");
  CUT("{\"n\": \"a\0b\"}", "a control character inside a string");
  CUT("{\"n\": 1}\0", "more after the object's closing '}'");
  CUT("{\"n\": 1\0}", "expected ',' or '}'");
  CUT("{\"\0\": 1}", "a control character inside a string");
#undef CUT
  int64_t v = 1;
  CHECK(int_of("{\"n\": -}", "n", &v, NULL) == TR_EFORMAT && strstr(tr_error(), "expected a value"), "-: %s",
        tr_error());
  CHECK(int_of("{\"n\": -0}", "n", &v, NULL) == TR_OK && v == 0, "-0: %lld %s", (long long)v, tr_error());
  CHECK(int_of("{\"n\": -9223372036854775808}", "n", &v, NULL) == TR_OK && v == INT64_MIN, "INT64_MIN: %s",
        tr_error());
  CHECK(int_of("{\"n\": -9223372036854775809}", "n", &v, NULL) == TR_EFORMAT && strstr(tr_error(), "range"),
        "below INT64_MIN: %s", tr_error());
  CHECK(int_of("{\"n\": 1e400}", "n", &v, NULL) == TR_EFORMAT &&
            strcmp(tr_error(), "'c.json': n is not an integer (it is 1e400)") == 0, "1e400 as an integer: %s",
        tr_error());
  CHECK(int_of("{\"n\": 123456789012345678901234567890123456789012345}", "n", &v, NULL) == TR_EFORMAT &&
            strstr(tr_error(), "n is 1234567890123456789012345678901234567890..., out of a 64-bit integer's range"),
        "45 digits: %s", tr_error());
  json_doc d = doc("{\"big\": 1e400, \"tiny\": 1e-400, \"neg0\": -0}");
  double x = 1;
  CHECK(json_top_num(&d, "big", &x, NULL) == TR_EFORMAT && strstr(tr_error(), "out of a double's range"), "%s",
        tr_error());
  CHECK(json_top_num(&d, "tiny", &x, NULL) == TR_OK && x == 0, "underflow reads as 0 (json_top.h): %g", x);
  CHECK(json_top_num(&d, "neg0", &x, NULL) == TR_OK && x == 0, "-0: %g", x);
  /* a number at the very end of the text (no '}' after it: not an object,
   * and no read past len) */
  CHECK(json_top_num(&(json_doc){"c.json", "{\"n\": 1", 7}, "n", &x, NULL) == TR_EFORMAT, "cut number");
}

/* What json_top.h says it accepts beyond RFC 8259's letter: bytes that are
 * not UTF-8 inside a string, as they are; a lone surrogate as U+FFFD. */
static void accepted(void) {
  char s[16];
  json_doc d = doc("{\"raw\": \"a\xff\xc3(\", \"lone\": \"\\ud800x\", \"low\": \"\\udc00\", "
                   "\"hi_hi\": \"\\ud800\\ud800\", \"\xff\": 5}");
  CHECK(json_top_str(&d, "raw", s, sizeof s, NULL) == TR_OK && strcmp(s, "a\xff\xc3(") == 0, "raw bytes: %s",
        tr_error());
  CHECK(json_top_str(&d, "lone", s, sizeof s, NULL) == TR_OK && strcmp(s, "\xef\xbf\xbdx") == 0, "lone high: %s",
        tr_error());
  CHECK(json_top_str(&d, "low", s, sizeof s, NULL) == TR_OK && strcmp(s, "\xef\xbf\xbd") == 0, "lone low: %s",
        tr_error());
  CHECK(json_top_str(&d, "hi_hi", s, sizeof s, NULL) == TR_OK && strcmp(s, "\xef\xbf\xbd\xef\xbf\xbd") == 0,
        "two highs: %s", tr_error());
  int64_t v = 0;
  CHECK(json_top_int(&d, "\xff", &v, NULL) == TR_OK && v == 5, "a key that is not UTF-8: %s", tr_error());
}

int main(void) {
  top_level_only();
  types();
  syntax();
  long_keys();
  untouched_on_error();
  byte_order_mark();
  explicit_lengths();
  accepted();
  return check_report("test_json");
}
