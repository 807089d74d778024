/* fuzz_proto.c — fuzzes the operator <-> worker control-line protocol
 * (core/fleet/proto.c) and the STEP line's parser (step_record_parse,
 * core/base/step_record.c) on arbitrary bytes. Does not run an operator or
 * a worker. Built by CMake with -DTRANSOM_FUZZ=ON; run by run.sh.
 *
 * Input: byte 0 picks the line buffer size handed to proto_read, byte 1
 * seeds how the rest is cut into writes, and the rest is the byte stream a
 * peer sends. The stream goes through a socketpair in those pieces, read by
 * proto_read (timeout 0 while more is to come: the "timed out" return is
 * where the next piece is written; blocking once the writer shut down).
 *
 * Checked:
 *   - proto_read returns exactly the stream's lines, in order, each within
 *     the caller's buffer; it refuses only a line that does not fit that
 *     buffer or PROTO_LINE_MAX; at EOF no complete line is left unread;
 *   - on every line: proto_is for each verb, proto_get / proto_int /
 *     proto_num for every key the workers and the operator read and for the
 *     keys found in the line, into buffers of exactly the size given (heap,
 *     so AddressSanitizer sees an overrun), always NUL-terminated;
 *   - proto_escape, then proto_get of the escaped value, gives the value
 *     back;
 *   - step_record_parse, step_record_line, step_record_parse again: the
 *     second line equals the first (one spelling), and the line writer
 *     stays inside a too-small buffer.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fuzz.h"
#include "proto.h"
#include "step_record.h"
#include "util.h"

static const char *const verbs[] = {"HELLO", "READY", "STEP", "FIRED", "HB",    "EVAL", "CKPT",     "GRADS", "STOP",
                                    "SKIP",  "SET",   "CHAOS", "BYE",  "WELCOME", "REFUSE", "SNAP", "GONE", "CKPT_NOW"};
static const char *const keys[] = {"slot", "pid",   "step",  "donor", "state_s",   "at",    "phase",       "for",
                                   "val",  "what",  "from",  "lr",    "fault",     "ms",    "steps",       "why",
                                   "n",    "first", "count", "run",   "coord",     "mode",  "threads",     "resume_step",
                                   "skips", "batch_skips", "opt_steps", "loss", "checksum"};

/* A heap buffer of exactly n bytes, filled with a marker. */
static char *exact(size_t n) {
  char *b = malloc(n);
  FUZZ_CHECK(b != NULL, "out of memory");
  memset(b, 0x5a, n);
  return b;
}

static void check_get(const char *line, const char *key, size_t n) {
  char *out = exact(n);
  int found = proto_get(line, key, out, n);
  FUZZ_CHECK(memchr(out, 0, n) != NULL, "proto_get(%s) left no NUL within %zu bytes", key, n);
  if (!found) FUZZ_CHECK(out[0] == 0, "proto_get(%s) not found but wrote a value", key);
  free(out);
  (void)proto_int(line, key, -7);
  (void)proto_num(line, key, -7.5);
}

/* proto_escape then proto_get gives the value back. */
static void check_escape(const char *key, const char *value) {
  size_t vl = strlen(value), kl = strlen(key);
  size_t en = 3 * vl + 5; /* every byte escaped, and the loop's 4 bytes of slack */
  char *esc = exact(en);
  proto_escape(value, esc, en);
  FUZZ_CHECK(memchr(esc, 0, en) != NULL, "proto_escape left no NUL");
  FUZZ_CHECK(strpbrk(esc, " \n\r\t=") == NULL, "proto_escape left a separator in '%s'", esc);
  size_t ln = 2 + kl + 1 + strlen(esc) + 1;
  char *line = exact(ln);
  snprintf(line, ln, "X %s=%s", key, esc);
  char *back = exact(vl + 1);
  FUZZ_CHECK(proto_get(line, key, back, vl + 1) == 1, "escaped key '%s' not found again", key);
  FUZZ_CHECK(strcmp(back, value) == 0, "escape round trip: '%s' came back as '%s'", value, back);
  free(back);
  free(line);
  /* a short buffer truncates, NUL-terminated */
  size_t small = 1 + vl % 7;
  char *s = exact(small);
  proto_escape(value, s, small);
  FUZZ_CHECK(memchr(s, 0, small) != NULL, "proto_escape into %zu bytes left no NUL", small);
  free(s);
  free(esc);
}

static void check_step_record(const char *line, size_t small) {
  step_record r1, r2;
  step_record_parse(line, &r1);
  char l1[4096], l2[4096];
  int k1 = step_record_line(l1, sizeof l1, &r1);
  FUZZ_CHECK(k1 > 0 && (size_t)k1 == strlen(l1), "step_record_line: %d", k1);
  int found = step_record_parse(l1, &r2);
  int fields = 0;
#define COUNT(...) fields++;
  STEP_COUNTERS(COUNT)
  STEP_METRICS(COUNT)
#undef COUNT
  FUZZ_CHECK(found == fields + r1.has_checksum, "a written STEP line parses to %d fields, not %d", found,
             fields + r1.has_checksum);
  int k2 = step_record_line(l2, sizeof l2, &r2);
  FUZZ_CHECK(k2 == k1 && strcmp(l1, l2) == 0, "STEP line not stable:\n  %s\n  %s", l1, l2);
  char *s = exact(small);
  int ks = step_record_line(s, small, &r1);
  FUZZ_CHECK(ks == -1 || (ks == k1 && (size_t)ks < small), "step_record_line into %zu bytes: %d", small, ks);
  free(s);
}

static void check_line(const char *line, size_t small) {
  for (size_t i = 0; i < sizeof verbs / sizeof verbs[0]; i++) (void)proto_is(line, verbs[i]);
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
    check_get(line, keys[i], PROTO_LINE_MAX);
    check_get(line, keys[i], small);
  }
  /* the keys the line itself names: " key=" */
  int n = 0;
  for (const char *p = strchr(line, ' '); p && n < 8; p = strchr(p + 1, ' ')) {
    const char *eq = strchr(p + 1, '=');
    const char *sp = strchr(p + 1, ' ');
    if (!eq || (sp && sp < eq)) continue;
    char key[64];
    size_t kl = (size_t)(eq - p - 1);
    if (kl >= sizeof key) continue;
    memcpy(key, p + 1, kl);
    key[kl] = 0;
    check_get(line, key, small);
    char value[PROTO_LINE_MAX];
    FUZZ_CHECK(proto_get(line, key, value, sizeof value) == 1, "key '%s' of the line not found", key);
    check_escape(key, value);
    n++;
  }
  check_step_record(line, small);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const size_t sizes[] = {1, 2, 16, 100, PROTO_LINE_MAX, 2 * PROTO_LINE_MAX + 1};
  if (size < 2) return 0;
  size_t n = sizes[data[0] % (sizeof sizes / sizeof sizes[0])];
  size_t small = 1 + data[0] % 13;
  uint32_t rng = 0x9e3779b9u * (1u + data[1]);
  const uint8_t *s = data + 2;
  size_t len = size - 2;

  int sv[2];
  FUZZ_CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair: %s", strerror(errno));
  proto_reader *r = calloc(1, sizeof *r); /* heap: an overrun of r->buf is seen */
  FUZZ_CHECK(r != NULL, "out of memory");
  r->fd = sv[0];
  char *line = exact(n);
  size_t sent = 0, off = 0; /* bytes written; bytes of the stream returned as lines */
  if (len == 0) shutdown(sv[1], SHUT_WR);
  for (int done = 0; !done;) {
    if (sent < len) { /* the next piece: 1..512 bytes */
      rng = rng * 1664525u + 1013904223u;
      size_t piece = 1 + (rng >> 16) % 512;
      if (piece > len - sent) piece = len - sent;
      FUZZ_CHECK(write(sv[1], s + sent, piece) == (ssize_t)piece, "write: %s", strerror(errno));
      sent += piece;
      if (sent == len) shutdown(sv[1], SHUT_WR);
    }
    for (;;) {
      int rc = proto_read(r, line, n, sent < len ? 0 : -1);
      const uint8_t *nl = memchr(s + off, '\n', len - off);
      size_t L = nl ? (size_t)(nl - (s + off)) : len - off; /* the next line's length */
      if (rc == 1) {
        FUZZ_CHECK(nl != NULL && nl < s + sent, "a line returned before its newline was sent");
        FUZZ_CHECK(L + 1 <= n, "a %zu-byte line returned into %zu bytes", L, n);
        FUZZ_CHECK(memcmp(line, s + off, L) == 0 && line[L] == 0, "the line returned is not the stream's");
        off += L + 1;
        check_line(line, small);
        continue;
      }
      if (rc == 0) { /* EOF: what is left is an unterminated tail */
        FUZZ_CHECK(sent == len && nl == NULL, "EOF with a complete line unread");
        done = 1;
        break;
      }
      if (rc == TR_EIO && sent < len) break; /* timed out: write the next piece */
      FUZZ_CHECK(rc == TR_EFORMAT, "proto_read: %d (%s)", rc, tr_error());
      FUZZ_CHECK(L + 1 > n || L >= PROTO_LINE_MAX, "a %zu-byte line refused with a %zu-byte buffer: %s", L, n,
                 tr_error());
      done = 1; /* the connection is closed */
      break;
    }
  }
  free(line);
  free(r);
  close(sv[0]);
  close(sv[1]);
  return 0;
}
