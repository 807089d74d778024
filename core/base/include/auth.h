/* auth.h — the job secret and the challenge every transom port asks for.
 *
 * A job has a secret (AUTH_KEY random bytes, kept hex-encoded in RUN/secret,
 * mode 0600; handed to agents and workers as TRANSOM_SECRET or the file
 * named by TRANSOM_SECRET_FILE). A server that holds a secret sends a
 * challenge first thing on every connection it accepts ("TRAU" + 16 random
 * bytes, AUTH_CHALLENGE bytes); the client answers HMAC-SHA256(secret,
 * "transom-auth-v1" || nonce), AUTH_MAC bytes; the server reads nothing else
 * before that answer checked (constant-time). A secret of length 0 turns
 * the exchange off on both sides (the FTAR driver, the unit tests).
 *
 * What it does not do: encrypt, or authenticate the server to the client
 * (a client only proves it belongs to the job). Pure functions plus small
 * blocking helpers; any thread.
 */
#ifndef TRANSOM_AUTH_H
#define TRANSOM_AUTH_H

#include <stddef.h>
#include <stdint.h>

#define AUTH_KEY 32        /* bytes of a secret this module makes */
#define AUTH_KEY_MAX 64    /* bytes of a secret it accepts */
#define AUTH_NONCE 16
#define AUTH_CHALLENGE 20  /* "TRAU" + nonce */
#define AUTH_MAC 32

typedef struct {
  uint8_t key[AUTH_KEY_MAX];
  size_t len; /* 0: no secret, no exchange */
} auth_secret;

/* SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104). */
void auth_sha256(const void *data, size_t n, uint8_t out[32]);
void auth_hmac_sha256(const uint8_t *key, size_t klen, const void *msg, size_t n, uint8_t out[32]);

/* A fresh random secret written to path (hex, mode 0600, atomically); an
 * existing one is loaded instead (a resumed job keeps its secret), unless
 * its mode lets group or others in: TR_EINVAL (it may have leaked; nothing
 * is changed). TR_EIO, TR_EFORMAT otherwise, tr_error() naming the path. */
int auth_secret_make(const char *path, auth_secret *s);
/* Reads a hex secret file. TR_EIO (unreadable), TR_EFORMAT (not 2..128
 * hex digits) naming the path. */
int auth_secret_load(const char *path, auth_secret *s);
/* TRANSOM_SECRET (hex) or TRANSOM_SECRET_FILE; neither: s->len = 0 and 0.
 * A malformed value: TR_EFORMAT naming the variable. */
int auth_secret_from_env(auth_secret *s);
/* The secret as hex (for TRANSOM_SECRET); out holds 2 * AUTH_KEY_MAX + 1. */
void auth_secret_hex(const auth_secret *s, char *out, size_t n);

/* Fills a challenge ("TRAU" + random nonce). With no random bytes to be
 * had (getrandom and /dev/urandom both failing) it is "TRNO" + zeros, which
 * no client answers and auth_verify never accepts: the connection fails
 * rather than be challenged with a guessable nonce. */
void auth_challenge(uint8_t ch[AUTH_CHALLENGE]);
/* The answer to a challenge. */
void auth_answer(const auth_secret *s, const uint8_t ch[AUTH_CHALLENGE], uint8_t mac[AUTH_MAC]);
/* 1 when mac answers ch under s (constant time), else 0 (always for a
 * challenge that is not "TRAU" + nonce). */
int auth_verify(const auth_secret *s, const uint8_t ch[AUTH_CHALLENGE], const uint8_t mac[AUTH_MAC]);

/* Blocking, on a connected socket, within timeout_s; nothing when s->len
 * is 0. Client: reads the challenge, sends the answer. Server: sends a
 * challenge, reads and checks the answer. 0, or TR_EIO (I/O, timeout) /
 * TR_EINVAL (a wrong or missing answer) with tr_error() saying which. */
int auth_client(int fd, const auth_secret *s, double timeout_s);
int auth_server(int fd, const auth_secret *s, double timeout_s);

#endif
