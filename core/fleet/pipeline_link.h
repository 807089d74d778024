/* pipeline_link.h — one TCP link between neighbouring pipeline stages
 * (private to core/fleet).
 *
 * Messages are framed (a header, then `bytes` of payload) and arrive in the
 * order they were sent. A reader thread per link drains the socket into a
 * queue as messages come, so two stages that send to each other at once
 * (activations forward, gradients back in 1F1B) never block each other on
 * full socket buffers. The stage's thread sends (blocking) and takes the
 * next message with a bounded wait; it says which kind, step and
 * micro-batch it expects, and anything else is a protocol error: both ends
 * follow the same deterministic schedule. A closed or broken peer ends
 * every wait with an error at once. Sends and receives come from one
 * thread (the stage's); the reader is the link's own.
 */
#ifndef TRANSOM_PIPELINE_LINK_H
#define TRANSOM_PIPELINE_LINK_H

#include <stddef.h>
#include <stdint.h>

enum {
  PL_ACT = 1,    /* forward: crossing activations of (step, mb) */
  PL_GRAD,       /* backward: their gradients, and the micro-batch's loss in `value` */
  PL_GATHER_UP,  /* end of step, last stage -> first: the exchange vector */
  PL_GATHER_DOWN, /* first -> last: the full vector */
  PL_EVAL_ACT,   /* evaluation forward */
  PL_EVAL_LOSS,  /* the mean validation loss, back to the first stage */
  PL_PARAMS,     /* the end: parameters toward the first stage */
  PL_HELLO,      /* at connect: the worker's index in `value` */
  PL_PING,       /* probes (pipeline_probe.c): latency ... */
  PL_PONG,
  PL_BULK,       /* ... and bandwidth */
  PL_ACK,
  PL_DONE,
  PL_TIED,       /* replicas: the tied gradients the first stage averaged, down the chain */
  PL_JOIN,       /* a rebuilt pipeline: the step its stages enter at (`value`), up then down the chain */
  PL_WAIT,       /* the sender enters a collective with its replicas: a wait on this link may last `value` s
                  * longer (taken by the reader, never queued: pl_link_grace) */
};

typedef struct {
  uint32_t magic, kind;
  int64_t step;
  int32_t mb, codec; /* codec: 0 raw float32 (AdaTopK's encodings are others) */
  double value;      /* a scalar riding along (a loss) */
  double sent_at;    /* tr_now() when the last byte left (emulated links: when it would have) */
  uint64_t bytes;    /* payload */
} pl_header;

typedef struct pl_link pl_link;

/* Messages a link holds unread before its reader stops taking more from
 * the socket (the peer's sends then block: back-pressure, nothing lost).
 * 1F1B leaves at most one message per micro-batch in flight on a link
 * (at most PIPE_MAX_STAGES = 64) plus the step's few exchange messages;
 * an evaluation sends eval_steps x micro_batches activations without a
 * reply and may meet the bound: its sender then waits for the next stage's
 * forward passes (one-way traffic, no cycle), as a flooding peer does. */
#define PL_QUEUE_DEPTH 256
/* And bytes: past its first message the queue holds at most
 * max(PL_QUEUE_BYTES_MIN, PL_QUEUE_MESSAGES x the link's largest stream
 * message: an activation or gradient, not the parameter slab or the
 * exchange vector, which come one at a time and are always taken into an
 * empty queue) of payload (256 large activations were gigabytes; 4 slabs
 * were 4 x the model). A stage ahead of a
 * slower next one may meet it in 1F1B's warm-up (its sends then wait, as
 * it would for the gradients anyway); while a stage sends activations at
 * most two gradients wait unread on its side of the link, well inside the
 * bound, so two stages never block on each other's sends. */
#define PL_QUEUE_BYTES_MIN ((uint64_t)64 << 20)
#define PL_QUEUE_MESSAGES 4

/* Takes a connected socket (closed by pl_link_free). max_bytes: the
 * largest payload a message on it may carry (its largest legitimate
 * one): a header asking for more, or with no finite sent_at, closes the
 * link (every wait on it then ends with the error). stream_bytes: the
 * largest of the messages that may queue up several at a time (a
 * stage's activations and gradients; max_bytes where every message may).
 * The reader holds at most PL_QUEUE_DEPTH unread messages and, past the
 * first, the bytes PL_QUEUE_BYTES_MIN says (from stream_bytes), then
 * stops reading the socket until the stage takes one (the peer's sends
 * block). NULL on failure. */
pl_link *pl_link_create(int fd, const char *peer_name, uint64_t max_bytes, uint64_t stream_bytes);
void pl_link_free(pl_link *l);

/* Sends one message. 0 or a negative error. */
int pl_send(pl_link *l, const pl_header *h, const void *payload);
/* The next message: it must be of kind/step/mb (kind 0: any message, then
 * step and mb are not checked; mb < 0: any) and raw (codec 0): anything
 * else is an error naming the link (and the message is dropped). The
 * payload (malloc'd, the caller frees) and the header come back. Waits at
 * most timeout_s (on the monotonic clock), or until the grace the peer
 * last announced ends (pl_link_grace) if that is later, plus an emulated delay
 * (pl_link_shape) counted from the header's sent_at, which is believed
 * only up to now plus the message's own time on the wire. */
int pl_recv(pl_link *l, uint32_t kind, int64_t step, int mb, double timeout_s, pl_header *h, void **payload);
/* The same for a message that may come in any codec (AdaTopK's
 * activations and gradients): the caller checks h->codec. */
int pl_recv_encoded(pl_link *l, uint32_t kind, int64_t step, int mb, double timeout_s, pl_header *h,
                    void **payload);
/* Tells the peer that this side is alive and held (in a collective with
 * its replicas): the peer's waits on this link (pl_recv) last until
 * `seconds` from now at least. */
int pl_link_grace(pl_link *l, double seconds);
/* The herald of a stage: a thread that, every 0.25 s, renews a 2 s grace
 * (above) on each of the stage's links while the stage is held, between
 * pl_herald_on and pl_herald_off (at most cap_s of each stretch), or while
 * the peer of its other link holds one (the stage beyond is held: the
 * notice is passed on down the chain, never back). The first notice goes
 * out in pl_herald_on itself. A stage in its replicas' all-reduce may wait
 * for a replica whose own pipeline mate hangs; its pipeline mates, and
 * theirs, must not give up on it before that replica gives up on the hung
 * one (with equal timeouts they raced: one stopped worker could end the
 * healthy pipeline too). A stopped stage renews nothing, so waits on it end
 * 2 s after its last notice or at their own timeout. Links may be NULL;
 * pl_herald_start NULL: no herald (the calls below take NULL).
 * pl_herald_stop before the links are freed. */
typedef struct pl_herald pl_herald;
pl_herald *pl_herald_start(pl_link *a, pl_link *b, double cap_s);
void pl_herald_on(pl_herald *h);
void pl_herald_off(pl_herald *h);
void pl_herald_stop(pl_herald *h);
/* The peer's name (pl_link_create's), for errors. */
const char *pl_link_peer(const pl_link *l);

/* Emulates a slow link in this end's transport (the kernel here has no
 * netem): a send takes bytes / bytes_per_s (0: unlimited) of the sender's
 * time, as a blocking send on a full socket would, and a message is handed
 * over delay_s after it left. Both ends set the same numbers. */
void pl_link_shape(pl_link *l, double bytes_per_s, double delay_s);
/* A send that has the kernel take no byte for timeout_s seconds fails (the
 * peer stopped reading: SIGSTOP, a hung host), instead of blocking the
 * stage for ever. <= 0: no limit (the default). */
void pl_link_send_timeout(pl_link *l, double timeout_s);

/* Seconds spent in pl_send so far (what a slow link costs the sender). */
double pl_link_send_seconds(const pl_link *l);

/* Bytes sent and received so far (payload and headers). */
void pl_link_bytes(const pl_link *l, uint64_t *sent, uint64_t *received);

/* Connects to host:port, retrying for up to timeout_s (the peer may still
 * be starting). The socket, or a negative error. */
int pl_connect(const char *host, int port, double timeout_s);
/* Accepts one connection on a listening socket within timeout_s. */
int pl_accept(int lfd, double timeout_s);

#endif
