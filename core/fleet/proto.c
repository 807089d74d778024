/* proto.c — control lines and blocking TCP helpers (see proto.h). */
#include "proto.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util.h"

/* --- lines --- */

int proto_send(int fd, const char *fmt, ...) {
  char line[PROTO_LINE_MAX];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line - 1, fmt, ap);
  va_end(ap);
  if (n < 0 || n >= (int)sizeof line - 1) return tr_fail(TR_EINVAL, "control line too long");
  line[n++] = '\n';
  return net_send_all(fd, line, (size_t)n);
}

void proto_escape(const char *s, char *out, size_t n) {
  if (n == 0) return; /* no room even for the terminator */
  size_t k = 0;
  for (; *s && k + 4 < n; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == ' ' || c == '%' || c == '\n' || c == '\r' || c == '=' || c == '\t') k += (size_t)snprintf(out + k, n - k, "%%%02X", c);
    else out[k++] = (char)c;
  }
  out[k] = 0;
}

int proto_is(const char *line, const char *verb) {
  size_t n = strlen(verb);
  return strncmp(line, verb, n) == 0 && (line[n] == ' ' || line[n] == 0);
}

int proto_get(const char *line, const char *key, char *out, size_t n) {
  if (n == 0) return 0; /* no room even for the terminator */
  size_t kl = strlen(key);
  for (const char *p = strchr(line, ' '); p; p = strchr(p + 1, ' ')) {
    if (strncmp(p + 1, key, kl) == 0 && p[1 + kl] == '=') {
      const char *v = p + 2 + kl;
      size_t k = 0;
      while (*v && *v != ' ' && k + 1 < n) {
        if (*v == '%' && v[1] && v[2]) {
          char hex[3] = {v[1], v[2], 0};
          out[k++] = (char)strtol(hex, NULL, 16);
          v += 3;
        } else {
          out[k++] = *v++;
        }
      }
      out[k] = 0;
      return 1;
    }
  }
  if (n) out[0] = 0;
  return 0;
}

int64_t proto_int(const char *line, const char *key, int64_t dflt) {
  char v[64];
  if (!proto_get(line, key, v, sizeof v)) return dflt;
  char *end;
  long long x = strtoll(v, &end, 10);
  return end == v ? dflt : (int64_t)x;
}

double proto_num(const char *line, const char *key, double dflt) {
  char v[64];
  if (!proto_get(line, key, v, sizeof v)) return dflt;
  char *end;
  double x = strtod(v, &end);
  return end == v ? dflt : x;
}

int proto_read(proto_reader *r, char *out, size_t n, int timeout_ms) {
  /* one deadline for the whole line: a signal (poll's EINTR) or a peer
   * that trickles bytes without a newline does not start the wait again */
  double t_end = timeout_ms > 0 ? tr_now() + timeout_ms / 1000.0 : 0;
  for (;;) {
    char *nl = memchr(r->buf, '\n', r->len);
    if (nl) {
      size_t len = (size_t)(nl - r->buf);
      if (len + 1 > n) return tr_fail(TR_EFORMAT, "control line too long");
      memcpy(out, r->buf, len);
      out[len] = 0;
      memmove(r->buf, nl + 1, r->len - len - 1);
      r->len -= len + 1;
      return 1;
    }
    if (r->len >= PROTO_LINE_MAX) return tr_fail(TR_EFORMAT, "control line longer than %d bytes", PROTO_LINE_MAX);
    if (timeout_ms >= 0) {
      struct pollfd p = {r->fd, POLLIN, 0};
      double left = timeout_ms > 0 ? t_end - tr_now() : 0;
      int pr = poll(&p, 1, left > 0 ? (int)(left * 1000) + 1 : 0);
      if (pr == 0) return tr_fail(TR_EIO, "timed out waiting for a control line");
      if (pr < 0 && errno != EINTR) return tr_fail(TR_EIO, "poll: %s", strerror(errno));
      if (pr < 0) continue;
    }
    ssize_t got = recv(r->fd, r->buf + r->len, sizeof r->buf - r->len, 0);
    if (got == 0) return 0;
    if (got < 0) {
      if (errno == EINTR) continue;
      return tr_fail(TR_EIO, "recv: %s", strerror(errno));
    }
    r->len += (size_t)got;
  }
}

/* --- sockets --- */

int net_split(const char *hostport, char *host, size_t n, int *port) {
  const char *colon = strrchr(hostport, ':');
  if (!colon || colon == hostport || (size_t)(colon - hostport) >= n)
    return tr_fail(TR_EINVAL, "'%s' is not HOST:PORT", hostport);
  memcpy(host, hostport, (size_t)(colon - hostport));
  host[colon - hostport] = 0;
  char *end;
  long p = strtol(colon + 1, &end, 10);
  if (*end || p < 1 || p > 65535) return tr_fail(TR_EINVAL, "'%s': bad port", hostport);
  *port = (int)p;
  return TR_OK;
}

static int resolve(const char *host, int port, struct sockaddr_in *sa) {
  memset(sa, 0, sizeof *sa);
  sa->sin_family = AF_INET;
  sa->sin_port = htons((uint16_t)port);
  if (inet_pton(AF_INET, host, &sa->sin_addr) == 1) return TR_OK;
  struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res = NULL;
  int rc = getaddrinfo(host, NULL, &hints, &res);
  if (rc || !res) return tr_fail(TR_EIO, "cannot resolve '%s': %s", host, gai_strerror(rc));
  sa->sin_addr = ((struct sockaddr_in *)res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return TR_OK;
}

/* One connect attempt, bounded by t_end: a non-blocking connect and a poll,
 * so a peer whose SYNs vanish (a cut link, a full backlog) costs at most the
 * caller's bound, never the kernel's two minutes of SYN retries. Returns the
 * connected (blocking) fd, or -1 with *err = errno, ETIMEDOUT past t_end. */
static int connect_once(const struct sockaddr_in *sa, double t_end, int *err) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  int e = 0;
  if (connect(fd, (const struct sockaddr *)sa, sizeof *sa) != 0) e = errno;
  while (e == EINPROGRESS || e == EINTR) {
    double left = t_end - tr_now();
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    int r = left > 0 ? poll(&p, 1, (int)(left * 1000) + 1) : 0;
    if (r == 0 && tr_now() >= t_end) e = ETIMEDOUT;
    else if (r < 0 && errno != EINTR) e = errno;
    else if (r > 0) {
      socklen_t el = sizeof e;
      if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) != 0) e = errno;
    }
  }
  if (e == 0 && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) e = errno;
  if (e) {
    close(fd);
    *err = e;
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

int net_connect(const char *host, int port, double timeout_s) {
  if (!(timeout_s > 0)) return tr_fail(TR_EINVAL, "connect to %s:%d: timeout %g s is not positive", host, port, timeout_s);
  struct sockaddr_in sa;
  int rc = resolve(host, port, &sa);
  if (rc) return rc;
  double t_end = tr_now() + timeout_s;
  int refused = 0; /* an earlier try was refused: a later one's timeout is still that refusal */
  for (;;) { /* retry a refusal while the peer is still starting */
    int e = 0, fd = connect_once(&sa, t_end, &e);
    if (fd >= 0) return fd;
    if (e == ETIMEDOUT && refused) e = refused;
    if (e == ETIMEDOUT)
      return tr_fail(TR_EIO, "cannot connect to %s:%d: no answer in %.1f s", host, port, timeout_s);
    if (e != ECONNREFUSED && e != EAGAIN)
      return tr_fail(TR_EIO, "cannot connect to %s:%d: %s", host, port, strerror(e));
    refused = e;
    usleep(50000);
    if (tr_now() >= t_end) /* no time for one more try (a loaded machine may oversleep) */
      return tr_fail(TR_EIO, "cannot connect to %s:%d: %s", host, port, strerror(e));
  }
}

int net_listen(const char *host, int port, int *bound_port) {
  struct sockaddr_in sa;
  int rc = resolve(host, port, &sa);
  if (rc) return rc;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return tr_fail(TR_EIO, "socket: %s", strerror(errno));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, 64) != 0) {
    int e = errno;
    close(fd);
    return tr_fail(TR_EIO, "cannot listen on %s:%d: %s", host, port, strerror(e));
  }
  socklen_t len = sizeof sa;
  getsockname(fd, (struct sockaddr *)&sa, &len);
  if (bound_port) *bound_port = ntohs(sa.sin_port);
  return fd;
}

int net_send_all(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return tr_fail(TR_EIO, "send: %s", strerror(errno));
    }
    p += w;
    n -= (size_t)w;
  }
  return TR_OK;
}

int net_recv_all(int fd, void *buf, size_t n) {
  char *p = buf;
  while (n > 0) {
    ssize_t r = recv(fd, p, n, 0);
    if (r == 0) return tr_fail(TR_EIO, "connection closed");
    if (r < 0) {
      if (errno == EINTR) continue;
      return tr_fail(TR_EIO, "recv: %s", strerror(errno));
    }
    p += r;
    n -= (size_t)r;
  }
  return TR_OK;
}

/* --- RUN/operator.addr --- */

int opaddr_read_nonce(const char *run, char *addr, size_t an, char *nonce, size_t nn) {
  char path[1100], text[512];
  snprintf(path, sizeof path, "%s/operator.addr", run);
  if (an) addr[0] = 0;
  if (nn) nonce[0] = 0;
  int fd = run[0] ? open(path, O_RDONLY | O_CLOEXEC) : -1;
  if (fd < 0) return run[0] && errno == ENOENT ? 1 : -1;
  ssize_t got;
  while ((got = read(fd, text, sizeof text - 1)) < 0 && errno == EINTR) {
  }
  close(fd);
  if (got <= 0) return -1;
  text[got] = 0;
  size_t k = strcspn(text, "\r\n");
  if (an) snprintf(addr, an, "%.*s", (int)k, text);
  char *second = text + k;
  second += strspn(second, "\r\n");
  if (nn) snprintf(nonce, nn, "%.*s", (int)strcspn(second, "\r\n"), second);
  return 0;
}
