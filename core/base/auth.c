/* auth.c — the job secret, SHA-256, HMAC-SHA256 and the challenge/answer
 * exchange of every transom port (see auth.h). SHA-256 after FIPS 180-4,
 * checked against its and RFC 4231's vectors in spec/c/test_auth.c.
 * Called by the operator (its workers' port), the FTAR coordinator and data
 * ports, the donor, and their clients (worker, agent, member).
 */
#define _GNU_SOURCE /* getrandom */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "auth.h"
#include "util.h"

/* --- SHA-256 --- */

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

typedef struct {
  uint32_t h[8];
  uint8_t buf[64];
  size_t fill;
  uint64_t bytes;
} sha256_ctx;

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(sha256_ctx *c, const uint8_t *p) {
  uint32_t w[64], s[8];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  memcpy(s, c->h, sizeof s);
  for (int i = 0; i < 64; i++) {
    uint32_t S1 = ROR(s[4], 6) ^ ROR(s[4], 11) ^ ROR(s[4], 25), ch = (s[4] & s[5]) ^ (~s[4] & s[6]);
    uint32_t t1 = s[7] + S1 + ch + K[i] + w[i];
    uint32_t S0 = ROR(s[0], 2) ^ ROR(s[0], 13) ^ ROR(s[0], 22), maj = (s[0] & s[1]) ^ (s[0] & s[2]) ^ (s[1] & s[2]);
    memmove(s + 1, s, 7 * sizeof s[0]);
    s[4] += t1;
    s[0] = t1 + S0 + maj;
  }
  for (int i = 0; i < 8; i++) c->h[i] += s[i];
}

static void sha256_init(sha256_ctx *c) {
  static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(c->h, h0, sizeof h0);
  c->fill = 0;
  c->bytes = 0;
}

static void sha256_update(sha256_ctx *c, const void *data, size_t n) {
  const uint8_t *p = data;
  c->bytes += n;
  while (n > 0) {
    size_t take = 64 - c->fill < n ? 64 - c->fill : n;
    memcpy(c->buf + c->fill, p, take);
    c->fill += take, p += take, n -= take;
    if (c->fill == 64) sha256_block(c, c->buf), c->fill = 0;
  }
}

static void sha256_final(sha256_ctx *c, uint8_t out[32]) {
  uint64_t bits = c->bytes * 8;
  uint8_t pad = 0x80, zero = 0, len[8];
  sha256_update(c, &pad, 1);
  while (c->fill != 56) sha256_update(c, &zero, 1);
  for (int i = 0; i < 8; i++) len[i] = (uint8_t)(bits >> (56 - 8 * i));
  sha256_update(c, len, 8);
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 4; j++) out[4 * i + j] = (uint8_t)(c->h[i] >> (24 - 8 * j));
}

void auth_sha256(const void *data, size_t n, uint8_t out[32]) {
  sha256_ctx c;
  sha256_init(&c);
  sha256_update(&c, data, n);
  sha256_final(&c, out);
}

void auth_hmac_sha256(const uint8_t *key, size_t klen, const void *msg, size_t n, uint8_t out[32]) {
  uint8_t k[64] = {0}, pad[64], inner[32];
  if (klen > 64) auth_sha256(key, klen, k);
  else memcpy(k, key, klen);
  sha256_ctx c;
  for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x36;
  sha256_init(&c);
  sha256_update(&c, pad, 64);
  sha256_update(&c, msg, n);
  sha256_final(&c, inner);
  for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x5c;
  sha256_init(&c);
  sha256_update(&c, pad, 64);
  sha256_update(&c, inner, 32);
  sha256_final(&c, out);
}

/* --- randomness --- */

/* n random bytes: getrandom (retried when interrupted), else /dev/urandom.
 * 0, or -1 when neither gives them. */
static int random_bytes(uint8_t *p, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t k = getrandom(p + got, n - got, 0);
    if (k > 0) got += (size_t)k;
    else if (!(k < 0 && errno == EINTR)) break;
  }
  if (got == n) return 0;
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  for (got = 0; got < n;) {
    ssize_t k = read(fd, p + got, n - got);
    if (k > 0) got += (size_t)k;
    else if (!(k < 0 && errno == EINTR)) break;
  }
  close(fd);
  return got == n ? 0 : -1;
}

/* --- the secret --- */

static int from_hex(const char *hex, size_t len, auth_secret *s) {
  if (len < 2 || len > 2 * AUTH_KEY_MAX || len % 2) return -1;
  for (size_t i = 0; i < len / 2; i++) {
    unsigned v;
    if (sscanf(hex + 2 * i, "%2x", &v) != 1 || !strchr("0123456789abcdefABCDEF", hex[2 * i]) ||
        !strchr("0123456789abcdefABCDEF", hex[2 * i + 1]))
      return -1;
    s->key[i] = (uint8_t)v;
  }
  s->len = len / 2;
  return 0;
}

void auth_secret_hex(const auth_secret *s, char *out, size_t n) {
  size_t k = 0;
  out[0] = 0;
  for (size_t i = 0; i < s->len && k + 3 <= n; i++) k += (size_t)snprintf(out + k, n - k, "%02x", s->key[i]);
}

int auth_secret_load(const char *path, auth_secret *s) {
  size_t len;
  char *text = tr_read_file(path, &len);
  if (!text) return tr_fail(TR_EIO, "cannot read the job secret %s", path);
  len = strcspn(text, "\r\n");
  int bad = from_hex(text, len, s);
  free(text);
  return bad ? tr_fail(TR_EFORMAT, "%s: the job secret must be 2..128 hex digits", path) : 0;
}

int auth_secret_make(const char *path, auth_secret *s) {
  struct stat st;
  if (stat(path, &st) == 0) { /* a resumed job keeps its secret, if nobody else could read it */
    if (st.st_mode & 077)
      return tr_fail(TR_EINVAL, "the job secret %s is open to others (mode %03o): chmod 600 it, or remove it for a new one",
                     path, (unsigned)(st.st_mode & 0777));
    return auth_secret_load(path, s);
  }
  if (errno != ENOENT) return tr_fail(TR_EIO, "job secret %s: %s", path, strerror(errno));
  if (random_bytes(s->key, AUTH_KEY)) return tr_fail(TR_EIO, "job secret %s: no random bytes: %s", path, strerror(errno));
  s->len = AUTH_KEY;
  char hex[2 * AUTH_KEY_MAX + 2];
  auth_secret_hex(s, hex, sizeof hex);
  strcat(hex, "\n");
  mode_t old = umask(077); /* the file is born 0600 */
  int rc = tr_write_file_atomic(path, hex, strlen(hex));
  umask(old);
  if (!rc) chmod(path, 0600);
  return rc ? tr_fail_prefix(rc, "job secret %s", path) : 0;
}

int auth_secret_from_env(auth_secret *s) {
  const char *hex = getenv("TRANSOM_SECRET"), *file = getenv("TRANSOM_SECRET_FILE");
  s->len = 0;
  if (hex && *hex) {
    if (from_hex(hex, strlen(hex), s)) return tr_fail(TR_EFORMAT, "TRANSOM_SECRET must be 2..128 hex digits");
    return 0;
  }
  if (file && *file) return auth_secret_load(file, s);
  return 0;
}

/* --- challenge and answer --- */

void auth_challenge(uint8_t ch[AUTH_CHALLENGE]) {
  if (random_bytes(ch + 4, AUTH_NONCE) == 0) {
    memcpy(ch, "TRAU", 4);
    return;
  }
  /* No randomness: a guessable nonce would let a recorded answer be
   * replayed, so this challenge is one nobody can answer (fail closed). */
  memcpy(ch, "TRNO", 4);
  memset(ch + 4, 0, AUTH_NONCE);
}

void auth_answer(const auth_secret *s, const uint8_t ch[AUTH_CHALLENGE], uint8_t mac[AUTH_MAC]) {
  uint8_t msg[15 + AUTH_NONCE];
  memcpy(msg, "transom-auth-v1", 15);
  memcpy(msg + 15, ch + 4, AUTH_NONCE);
  auth_hmac_sha256(s->key, s->len, msg, sizeof msg, mac);
}

int auth_verify(const auth_secret *s, const uint8_t ch[AUTH_CHALLENGE], const uint8_t mac[AUTH_MAC]) {
  uint8_t want[AUTH_MAC], diff = 0;
  if (memcmp(ch, "TRAU", 4) != 0) return 0; /* a challenge made without randomness */
  auth_answer(s, ch, want);
  for (int i = 0; i < AUTH_MAC; i++) diff |= (uint8_t)(want[i] ^ mac[i]);
  return diff == 0;
}

/* --- blocking helpers --- */

static int io_all(int fd, void *buf, size_t n, int reading, double t_end) {
  uint8_t *p = buf;
  size_t done = 0;
  while (done < n) {
    double left = t_end - tr_now();
    struct pollfd pf = {fd, reading ? POLLIN : POLLOUT, 0};
    if (left <= 0) return tr_fail(TR_EIO, "job secret exchange: timed out");
    int r = poll(&pf, 1, (int)(left * 1000) + 1);
    if (r < 0 && errno != EINTR) return tr_fail(TR_EIO, "job secret exchange: poll: %s", strerror(errno));
    if (r <= 0) continue;
    ssize_t k = reading ? recv(fd, p + done, n - done, MSG_DONTWAIT) : send(fd, p + done, n - done, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (k == 0) return tr_fail(TR_EIO, "job secret exchange: the peer closed the connection");
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return tr_fail(TR_EIO, "job secret exchange: %s", strerror(errno));
    if (k > 0) done += (size_t)k;
  }
  return 0;
}

int auth_client(int fd, const auth_secret *s, double timeout_s) {
  if (!s || s->len == 0) return 0;
  double t_end = tr_now() + timeout_s;
  uint8_t ch[AUTH_CHALLENGE], mac[AUTH_MAC];
  int rc = io_all(fd, ch, sizeof ch, 1, t_end);
  if (rc) return rc;
  if (memcmp(ch, "TRAU", 4) != 0) return tr_fail(TR_EIO, "job secret exchange: the server sent no challenge");
  auth_answer(s, ch, mac);
  return io_all(fd, mac, sizeof mac, 0, t_end);
}

int auth_server(int fd, const auth_secret *s, double timeout_s) {
  if (!s || s->len == 0) return 0;
  double t_end = tr_now() + timeout_s;
  uint8_t ch[AUTH_CHALLENGE], mac[AUTH_MAC];
  auth_challenge(ch);
  int rc = io_all(fd, ch, sizeof ch, 0, t_end);
  if (!rc) rc = io_all(fd, mac, sizeof mac, 1, t_end);
  if (rc) return rc;
  return auth_verify(s, ch, mac) ? 0 : tr_fail(TR_EINVAL, "a wrong job secret");
}
