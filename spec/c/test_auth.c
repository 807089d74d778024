/* test_auth.c — the job secret's primitives (core/base/auth.c): SHA-256
 * against FIPS 180-4's vectors, HMAC-SHA256 against RFC 4231's (cases 1, 2
 * and 6: a key longer than a block), the challenge/answer (a right secret
 * passes, a wrong one, a flipped bit and a replayed answer to another
 * challenge fail), a challenge made with getrandom failing (from
 * /dev/urandom; with that failing too, one nobody can answer: seccomp in
 * a child), the exchange over a socketpair with a right, a wrong and no
 * secret, a secret too long for the FTAR ports refused by them (not
 * dropped), and the secret file (made 0600, loaded back, kept when it
 * exists but refused when open to others, malformed contents refused
 * naming the file). */
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <event2/event.h>

#include "auth.h"
#include "check.h"
#include "ftar.h"
#include "util.h"

static void hex(const uint8_t *b, size_t n, char *out) {
  for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", b[i]);
}

static void vectors(void) {
  uint8_t d[32];
  char h[65];
  auth_sha256("abc", 3, d);
  hex(d, 32, h);
  CHECK(strcmp(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad") == 0, "sha256(abc) = %s", h);
  const char *two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  auth_sha256(two, strlen(two), d);
  hex(d, 32, h);
  CHECK(strcmp(h, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1") == 0, "sha256(two blocks) = %s", h);
  static char million[1000000];
  memset(million, 'a', sizeof million);
  auth_sha256(million, sizeof million, d);
  hex(d, 32, h);
  CHECK(strcmp(h, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0") == 0, "sha256(a x 1e6) = %s", h);
  uint8_t k1[20], k6[131];
  memset(k1, 0x0b, sizeof k1);
  memset(k6, 0xaa, sizeof k6);
  auth_hmac_sha256(k1, sizeof k1, "Hi There", 8, d);
  hex(d, 32, h);
  CHECK(strcmp(h, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7") == 0, "RFC 4231 case 1: %s", h);
  const char *m2 = "what do ya want for nothing?";
  auth_hmac_sha256((const uint8_t *)"Jefe", 4, m2, strlen(m2), d);
  hex(d, 32, h);
  CHECK(strcmp(h, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843") == 0, "RFC 4231 case 2: %s", h);
  const char *m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
  auth_hmac_sha256(k6, sizeof k6, m6, strlen(m6), d);
  hex(d, 32, h);
  CHECK(strcmp(h, "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54") == 0, "RFC 4231 case 6: %s", h);
}

static void answers(void) {
  auth_secret a = {.len = AUTH_KEY}, b = {.len = AUTH_KEY};
  memset(a.key, 1, AUTH_KEY);
  memset(b.key, 1, AUTH_KEY);
  b.key[31] = 2;
  uint8_t ch[AUTH_CHALLENGE], ch2[AUTH_CHALLENGE], mac[AUTH_MAC];
  auth_challenge(ch);
  auth_challenge(ch2);
  CHECK(memcmp(ch, "TRAU", 4) == 0 && memcmp(ch + 4, ch2 + 4, AUTH_NONCE) != 0, "two challenges differ");
  auth_answer(&a, ch, mac);
  CHECK(auth_verify(&a, ch, mac), "the right secret passes");
  CHECK(!auth_verify(&b, ch, mac), "another secret fails");
  CHECK(!auth_verify(&a, ch2, mac), "an answer replayed to another challenge fails");
  mac[7] ^= 1;
  CHECK(!auth_verify(&a, ch, mac), "a flipped bit fails");
}

/* A child where getrandom fails (ENOSYS), and with no_urandom opening
 * files fails too (seccomp): 1 if its challenge can be answered, 0 if not,
 * -1 if seccomp is not to be had here. */
static int challenge_without_random(int no_urandom) {
  pid_t pid = fork();
  if (pid == 0) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_getrandom, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_openat, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, no_urandom ? SECCOMP_RET_ERRNO | EACCES : SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {sizeof f / sizeof f[0], f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) _exit(3);
    auth_secret a = {.len = AUTH_KEY};
    memset(a.key, 5, AUTH_KEY);
    uint8_t ch[AUTH_CHALLENGE], mac[AUTH_MAC];
    auth_challenge(ch);
    auth_answer(&a, ch, mac);
    _exit(auth_verify(&a, ch, mac) ? 1 : 0);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) && WEXITSTATUS(st) <= 1 ? WEXITSTATUS(st) : -1;
}

static void no_randomness(void) {
  int r = challenge_without_random(0);
  if (r < 0) {
    printf("test_auth: no seccomp here, the challenge without getrandom is not checked\n");
    return;
  }
  CHECK(r == 1, "without getrandom, /dev/urandom makes the challenge");
  CHECK(challenge_without_random(1) == 0, "without any randomness the challenge is one nobody can answer");
}

/* server and client over a socketpair, the client in a child */
static int exchange(const auth_secret *srv, const auth_secret *cli) {
  int sv[2];
  socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    auth_client(sv[1], cli, 5.0);
    _exit(0);
  }
  close(sv[1]);
  int rc = auth_server(sv[0], srv, 5.0);
  close(sv[0]);
  waitpid(pid, NULL, 0);
  return rc;
}

static void sockets(void) {
  auth_secret a = {.len = AUTH_KEY}, b = {.len = AUTH_KEY}, none = {.len = 0};
  memset(a.key, 3, AUTH_KEY);
  memset(b.key, 4, AUTH_KEY);
  CHECK(exchange(&a, &a) == 0, "right secret: %s", tr_error());
  CHECK(exchange(&a, &b) == TR_EINVAL, "wrong secret refused");
  CHECK(exchange(&a, &none) != 0, "no secret refused (the client sends nothing: timeout or EOF)");
  CHECK(exchange(&none, &none) == 0, "no secret on either side: no exchange");
}

/* The FTAR ports take the secret as bytes + length: one too long for a
 * challenge is refused, never quietly dropped (no challenge at all). */
static void ftar_secret(void) {
  uint8_t key[AUTH_KEY_MAX + 1];
  memset(key, 7, sizeof key);
  struct event_base *base = event_base_new();
  ftar_coord_opts co;
  ftar_coord_opts_default(&co);
  co.secret = key;
  co.secret_len = sizeof key;
  ftar_coord *c = ftar_coord_create(base, "127.0.0.1", 0, &co);
  CHECK(!c && strstr(tr_error(), "secret"), "coordinator: a %zu-byte secret refused: %s", sizeof key,
        c ? "it listens unchallenged" : tr_error());
  if (c) ftar_coord_free(c);
  event_base_free(base);
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.secret = key;
  mo.secret_len = sizeof key;
  mo.timeout = 0.5; /* nothing listens on port 1 */
  ftar_member *m = ftar_member_create("127.0.0.1", 1, 0, &mo);
  CHECK(!m && strstr(tr_error(), "secret"), "member: a %zu-byte secret refused: %s", sizeof key, tr_error());
  if (m) ftar_member_free(m);
}

static void files(void) {
  char dir[] = "/tmp/test_auth_XXXXXX", path[128];
  CHECK(mkdtemp(dir) != NULL, "mkdtemp");
  snprintf(path, sizeof path, "%s/secret", dir);
  auth_secret s, t;
  CHECK(auth_secret_make(path, &s) == 0 && s.len == AUTH_KEY, "made: %s", tr_error());
  struct stat st;
  CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600, "mode %o", st.st_mode & 0777);
  CHECK(auth_secret_load(path, &t) == 0 && t.len == s.len && memcmp(t.key, s.key, s.len) == 0, "loaded back");
  CHECK(auth_secret_make(path, &t) == 0 && memcmp(t.key, s.key, s.len) == 0, "an existing secret is kept");
  chmod(path, 0644);
  CHECK(auth_secret_make(path, &t) == TR_EINVAL && strstr(tr_error(), path) && strstr(tr_error(), "644"),
        "an existing secret open to others is refused: %s", tr_error());
  chmod(path, 0600);
  FILE *f = fopen(path, "w");
  fputs("not hex\n", f);
  fclose(f);
  CHECK(auth_secret_load(path, &t) == TR_EFORMAT && strstr(tr_error(), path), "malformed: %s", tr_error());
  unlink(path);
  rmdir(dir);
}

int main(void) {
  vectors();
  answers();
  sockets();
  no_randomness();
  ftar_secret();
  files();
  return check_report("test_auth");
}
