/* proto.h — the operator <-> worker control protocol: newline-terminated
 * text lines "VERB key=value key=value ...", values without spaces (%XX
 * escapes for space, %, newline). Small, greppable, and nothing in it is
 * sized by an unchecked length: a line longer than PROTO_LINE_MAX closes the
 * connection.
 *
 * Used by the operator (operator.c, on libevent bufferevents) and by workers
 * (worker.c, blocking sockets). Binary payloads (state snapshots, gradients)
 * travel on the donor connection (donor.c), not here.
 */
#ifndef TRANSOM_PROTO_H
#define TRANSOM_PROTO_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#define PROTO_LINE_MAX 4096

/* Seconds between an agent's heartbeats (agent.c sends them, the operator's
 * hosts bookkeeping, operator_hosts.c, times their lapse against them). */
#define AGENT_HB_INTERVAL 0.5

/* Formats and sends one line on a blocking socket (adds '\n'). */
int proto_send(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Value of key in a line ("STEP slot=1 step=5"), unescaped into out.
 * Returns 1 if found. */
int proto_get(const char *line, const char *key, char *out, size_t n);
int64_t proto_int(const char *line, const char *key, int64_t dflt);
double proto_num(const char *line, const char *key, double dflt);
/* 1 if the line's verb is verb. */
int proto_is(const char *line, const char *verb);
/* Escapes s for a value (spaces, %, newlines). */
void proto_escape(const char *s, char *out, size_t n);

/* Blocking line reader over a socket. */
typedef struct {
  int fd;
  char buf[PROTO_LINE_MAX * 2];
  size_t len;
} proto_reader;
/* Reads the next line (without '\n') into out. Returns 1 for a line, 0 at
 * EOF, negative on error or an over-long line. timeout_ms bounds the whole
 * wait for the line (signals and partial lines meanwhile do not extend
 * it); 0 takes only what is there; < 0 waits forever. */
int proto_read(proto_reader *r, char *out, size_t n, int timeout_ms);

/* TCP helpers. net_connect connects to host:port within timeout_s (> 0)
 * in all: a refusal is retried (the peer may still be starting), and a peer
 * that never answers (SYNs dropped: a cut link, a full backlog) fails at
 * timeout_s with "no answer in N s", not after the kernel's SYN retries.
 * Returns a blocking socket with TCP_NODELAY, or a negative error.
 * net_listen listens on host:port (0 = any) and reports the port. */
int net_connect(const char *host, int port, double timeout_s);
int net_listen(const char *host, int port, int *bound_port);
/* Sends or receives exactly n bytes (blocking). */
int net_send_all(int fd, const void *buf, size_t n);
int net_recv_all(int fd, void *buf, size_t n);
/* Splits "host:port". */
int net_split(const char *hostport, char *host, size_t n, int *port);

/* RUN/operator.addr, where the run's operator listens ("host:port\n",
 * then the operator's nonce on a second line; "ended" for an address once
 * it has ended). Every operator writes it anew when it starts (its own
 * random nonce, which its WELCOME also carries) and rewrites it as "ended"
 * when it ends, so a nonce that is not ours names an operator started
 * since (a worker follows it, worker.c; the operator it replaced stands
 * down, operator.c).
 * Its first line into addr, its second (the nonce; "" when it has none)
 * into nonce. 0; 1 when the file does not exist; -1 when it cannot be
 * read. Any thread. */
int opaddr_read_nonce(const char *run, char *addr, size_t an, char *nonce, size_t nn);

#endif
