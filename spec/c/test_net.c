/* test_net.c — the fleet's TCP connect (core/fleet/proto.c net_connect),
 * over loopback only: a listener answers; a closed port is refused after the
 * retries; a listener whose accept queue is full drops the SYNs, as a cut
 * link does, and the connect fails at its own timeout, saying so, instead of
 * waiting out the kernel's two minutes of SYN retries. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "check.h"
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

int main(void) {
  test_answered();
  test_refused();
  test_syn_dropped();
  return check_report("test_net");
}
