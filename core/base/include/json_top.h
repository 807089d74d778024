/* json_top.h — the top-level keys of a small JSON object text (a
 * config.json, a vocab.json), read strictly. The whole text must be one JSON
 * object: strings with their escapes, numbers, true/false/null, nested
 * objects and arrays, nothing but white space after the closing brace. A key
 * is looked up among that object's own keys only, never inside a nested
 * object, an array or a string value; a key that appears twice at the top
 * level is an error (not first- or last-wins). No tree is built: every call
 * scans the text again, which suits files of a few kilobytes. Does not write
 * JSON (util.h's tr_json_str does). Used by hf.c (a Hugging Face
 * config.json) and data.c (a run's vocab.json).
 *
 * What it accepts, against RFC 8259's grammar:
 *   - a UTF-8 byte order mark before the object is skipped (8.1 lets a
 *     reader ignore it);
 *   - bytes 0x80..0xFF inside a string are taken as they are, not checked
 *     to be UTF-8 (a key or a value may hold bytes that are not);
 *   - a \u escape of a lone surrogate (one not in a high-low pair) reads as
 *     U+FFFD (EF BF BD), as the grammar allows it but it names no character;
 *   - a number too small for a double reads as 0 (or a subnormal) in
 *     json_top_num; one too large is an error;
 *   - more than 64 objects and arrays nested inside one value is an error
 *     (the RFC sets no limit), and so is a top-level key twice (its SHOULD);
 *     keys repeated inside a nested object are not checked.
 *
 * Errors: TR_EFORMAT, with the message (tr_error) naming the file and the
 * key: "'DIR/config.json': n_layer is not an integer (it is "12")",
 * "'DIR/config.json' is not a JSON object (byte 40: expected ',' or '}')",
 * "'DIR/config.json': key n_embd appears twice" (a key is checked for
 * duplicates when it is read). TR_EINVAL when the key asked for is 256 bytes
 * or longer (a caller's mistake; a key that long in the text is read past,
 * never equal to one asked for). Out-parameters, *found included, are set on
 * success only (json_top_str's buffer excepted: after an error it may hold
 * anything); the byte offset in an error counts a byte order mark.
 *
 * No allocation, no global state: any thread may call, on any document.
 */
#ifndef TRANSOM_JSON_TOP_H
#define TRANSOM_JSON_TOP_H

#include <stddef.h>
#include <stdint.h>

/* A JSON text and the file it came from. text need not be NUL-terminated
 * (len bytes are read); both are borrowed for the call only. */
typedef struct {
  const char *file; /* named in every error */
  const char *text;
  size_t len;
} json_doc;

/* Each reads the value of the top-level key `key` (a C string of at most
 * 255 bytes). found == NULL makes the key required (absent: TR_EFORMAT
 * "'FILE' has no key KEY"); otherwise an absent key gives TR_OK with
 * *found = 0 (*out untouched), a value read TR_OK with *found = 1. A value
 * of another type is TR_EFORMAT naming the key and the value, *found and
 * *out untouched. */

/* An integer written without fraction or exponent ("12", not "12.0"), in
 * int64_t's range. */
int json_top_int(const json_doc *d, const char *key, int64_t *out, int *found);
/* Any JSON number. */
int json_top_num(const json_doc *d, const char *key, double *out, int *found);
/* true or false: *out = 1 or 0. */
int json_top_bool(const json_doc *d, const char *key, int *out, int *found);
/* A string, unescaped (\uXXXX as UTF-8) into out (cap bytes with the NUL);
 * one longer than cap - 1 bytes, or holding \u0000, is an error. */
int json_top_str(const json_doc *d, const char *key, char *out, size_t cap, int *found);
/* The value's text as written (*val into d->text, *vlen bytes), any type:
 * for a caller that reads an array itself, or quotes the value in an error. */
int json_top_raw(const json_doc *d, const char *key, const char **val, size_t *vlen, int *found);

#endif
