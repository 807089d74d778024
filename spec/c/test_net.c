/* test_net.c — the fleet's TCP connect (core/fleet/proto.c net_connect),
 * over loopback only: a listener answers; a closed port is refused after the
 * retries; a listener whose accept queue is full drops the SYNs, as a cut
 * link does, and the connect fails at its own timeout, saying so, instead of
 * waiting out the kernel's two minutes of SYN retries. And proto_read's
 * timeout bounds the whole wait for a line: neither signals arriving
 * meanwhile nor a peer trickling bytes without a newline start it again;
 * nor do signals a pipeline stage's accept (pl_accept). */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "check.h"
#include "pipeline_link.h"
#include "proto.h"
#include "util.h"

/* A loopback listener with the given backlog that never accepts. */
static int listener(int backlog, int *port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  socklen_t len = sizeof sa;
  if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) || listen(fd, backlog) ||
      getsockname(fd, (struct sockaddr *)&sa, &len))
    return -1;
  *port = ntohs(sa.sin_port);
  return fd;
}

static void test_answered(void) {
  int port = 0, lfd = listener(8, &port);
  CHECK(lfd >= 0, "listener");
  int fd = net_connect("127.0.0.1", port, 5.0);
  CHECK(fd >= 0, "connect to a listener: %s", tr_error());
  if (fd >= 0) {
    CHECK(!(fcntl(fd, F_GETFL) & O_NONBLOCK), "the connected socket is blocking, as callers expect");
    close(fd);
  }
  close(lfd);
}

static void test_refused(void) {
  int port = 0, lfd = listener(1, &port);
  close(lfd); /* nothing listens on port now */
  int rc = net_connect("127.0.0.1", port, 0.3);
  CHECK(rc < 0, "connect to a closed port fails");
  CHECK(strstr(tr_error(), "refused") != NULL, "says refused: %s", tr_error());
  CHECK(net_connect("127.0.0.1", port, 0) == TR_EINVAL, "timeout 0 is refused: %s", tr_error());
}

/* Backlog 0: after one queued connection Linux drops further SYNs. Fill
 * the queue until a connect fails; that failure must be the timeout. */
static void test_syn_dropped(void) {
  int port = 0, lfd = listener(0, &port), held[16], n = 0, rc = 0;
  CHECK(lfd >= 0, "listener");
  while (n < 16 && (rc = net_connect("127.0.0.1", port, 0.5)) >= 0) held[n++] = rc;
  CHECK(rc < 0, "a listener that never accepts fills up (%d connections queued)", n);
  CHECK(strstr(tr_error(), "no answer in 0.5 s") != NULL, "fails at its own timeout: %s", tr_error());
  for (int i = 0; i < n; i++) close(held[i]);
  close(lfd);
}

/* --- proto_read's deadline ---
 * A helper thread disturbs a proto_read(400 ms) on the main thread BURST
 * times, every 20 ms (2 s in all): signals (poll's EINTR) or single bytes
 * without a newline. Each used to start the 400 ms wait again, so the read
 * returned only after the burst. Now it times out with the burst still
 * going: fewer than BURST disturbances were made by then (about 20; the
 * margin is the rest of the 2 s, not a timing threshold). */
#define BURST 100

typedef struct {
  pthread_t target; /* signals: the reading thread */
  int fd;           /* bytes: our end of the pair (-1: signals) */
  atomic_int made;
  atomic_int stop; /* the disturbed call returned: no more needed */
  pthread_t th;
  int started;
  struct sigaction old; /* SIGUSR1's, restored at the end */
} disturber;

static void on_usr1(int sig) { (void)sig; }

static void *disturb(void *arg) {
  disturber *d = arg;
  for (int i = 0; i < BURST && !atomic_load(&d->stop); i++) {
    usleep(20 * 1000);
    if (d->fd >= 0) {
      if (write(d->fd, "x", 1) != 1) break;
    } else {
      pthread_kill(d->target, SIGUSR1);
    }
    atomic_fetch_add(&d->made, 1);
  }
  return NULL;
}

/* Starts disturbing this thread: signals (fd -1; no SA_RESTART, so poll
 * returns EINTR) or bytes written to fd. */
static void disturb_start(disturber *d, int fd) {
  struct sigaction sa = {.sa_handler = on_usr1};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGUSR1, &sa, &d->old);
  d->target = pthread_self();
  d->fd = fd;
  d->started = pthread_create(&d->th, NULL, disturb, d) == 0;
  CHECK(d->started, "the disturbing thread starts");
}

/* The disturbed call returned: how many disturbances came before it. */
static int disturb_end(disturber *d) {
  int made = atomic_load(&d->made);
  atomic_store(&d->stop, 1);
  if (d->started) pthread_join(d->th, NULL);
  sigaction(SIGUSR1, &d->old, NULL);
  return made;
}

/* The same for a pipeline stage's accept (pl_accept, 400 ms), disturbed
 * by signals while nobody connects. */
static void accept_while_disturbed(void) {
  int port = 0, lfd = listener(4, &port);
  CHECK(lfd >= 0, "listener");
  disturber d = {0};
  disturb_start(&d, -1);
  int rc = pl_accept(lfd, 0.4);
  int made = disturb_end(&d);
  CHECK(rc < 0 && strstr(tr_error(), "no stage connected") != NULL, "the accept times out (rc %d: %s)", rc,
        tr_error());
  CHECK(made < BURST, "signals: the 400 ms accept ended while they still came (%d of %d made)", made, BURST);
  close(lfd);
}

static void read_while_disturbed(int by_bytes) {
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
  disturber d = {0};
  disturb_start(&d, by_bytes ? sv[1] : -1);
  proto_reader r = {.fd = sv[0]};
  char line[PROTO_LINE_MAX];
  int rc = proto_read(&r, line, sizeof line, 400);
  int made = disturb_end(&d);
  const char *what = by_bytes ? "bytes without a newline" : "signals";
  CHECK(rc < 0 && strstr(tr_error(), "timed out") != NULL, "%s: the read times out (rc %d: %s)", what, rc,
        tr_error());
  CHECK(made < BURST, "%s: the 400 ms read ended while they still came (%d of %d made)", what, made, BURST);
  close(sv[0]);
  close(sv[1]);
}

int main(void) {
  test_answered();
  test_refused();
  test_syn_dropped();
  read_while_disturbed(0);
  read_while_disturbed(1);
  accept_while_disturbed();
  return check_report("test_net");
}
