/* ftar_member_internal.h — the FTAR member's state and the functions its
 * files lend each other: ftar_member.c (lifecycle), ftar_control.c (control
 * thread, coordinator link), ftar_shm.c (same-host rings), ftar_port.c (data
 * port, links), ftar_ring.c (the ring engine and flat plane), ftar_hier.c
 * (the hierarchical plane), ftar_collective.c (the control round). How the pieces fit: the comment at the top of ftar_ring.c
 * (data) and ftar_control.c (control).
 *
 * Not for ftar_dev.c or other modules: the device data plane sees the member
 * only through the hooks of ftar_internal.h, and this header is not
 * installed (core/ftar/, not core/ftar/include/).
 *
 * Threads: fields are grouped by owner. "control thread" fields are the
 * libevent thread's; "under mu" fields are shared and read or written only
 * with mu held (gen is the lock-free hint that something changed); "data
 * plane" fields belong to the thread inside ftar_allreduce.
 */
#ifndef TRANSOM_FTAR_MEMBER_INTERNAL_H
#define TRANSOM_FTAR_MEMBER_INTERNAL_H

#include "auth.h"
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "ftar.h"
#include "ftar_internal.h"
#include "ftar_wire.h"

struct event_base;
struct bufferevent;
struct event;

#define PENDING_MAX 16
#define RX_CAP (64 * 1024)

typedef struct {
  int slot;
  uint64_t uid;
  uint16_t port;
  char host[FTAR_HOST_MAX + 1];
} peer;

typedef struct ftar_async ftar_async; /* ftar_async.c's communication thread */

typedef struct { /* a connection on the data port that has not shown a valid CONNECT yet */
  int fd;
  size_t got;
  double t0;
  int complete; /* valid CONNECT read; parked until its epoch is ours */
  ftar_hdr h;
  uint64_t uid;
  uint32_t level; /* the ring level it links (FTAR_LEVEL_*) */
  uint8_t b[FTAR_HDR + FTAR_CONNECT_LEN];
  int authed;    /* answered our challenge with the job secret (or none was asked) */
  size_t mgot;   /* bytes of that answer so far */
  uint8_t ch[AUTH_CHALLENGE], mac[AUTH_MAC];
} pending;

/* DOWN_AUTH: with a job secret, the downstream's challenge is read and
 * answered before CONNECT is sent. */
enum { DOWN_NONE = 0, DOWN_CONNECTING, DOWN_AUTH, DOWN_HELLO, DOWN_ACK, DOWN_READY };

/* A same-host link's frames go through this ring: a memfd the sender
 * creates and the receiver maps through /proc/<pid>/fd/<n>. Single producer,
 * single consumer; head/tail count bytes; the *_waiting flags ask the other
 * side for a 1-byte doorbell on the TCP link before sleeping in poll(). */
#define SHM_RING_DEFAULT (1u << 20) /* ftar_member_opts.shm_ring_bytes's default and floor */
#define SHM_RING_MAX (64u << 20)
#define SHM_DATA 4096
#define SHM_TAGS 1024 /* blocks of max(16 KiB, ring / 1024) */
#define SHM_TIMED 4096 /* copies into the ring and reduces out of it are timed from this many bytes */
#define SHM_MAGIC 0x4d485346u /* "FSHM" */
typedef struct {
  uint32_t magic, size;
  uint64_t token;
  uint8_t pad0[48];
  _Atomic uint64_t head;
  uint8_t pad1[56];
  _Atomic uint64_t tail;
  uint8_t pad2[56];
  _Atomic uint32_t cons_waiting;
  uint8_t pad3[60];
  _Atomic uint32_t prod_waiting;
  uint8_t pad4[60];
  _Atomic uint64_t read_rate[2]; /* consumer: its reduce pass's rate over bytes stored cached [0] /
                                    non-temporally [1], bytes/s as a double's bits (0: none yet) */
  _Atomic uint64_t read_count[2]; /* consumer: reads that went into read_rate */
  uint8_t pad5[32];
  _Atomic uint8_t tag[SHM_TAGS]; /* producer: how each block of the ring was stored last (ftar_shm.c) */
} shm_hdr;
_Static_assert(sizeof(shm_hdr) <= SHM_DATA, "the ring's header fits its page");

typedef struct { /* ftar_shm.c: timed pieces gathered into samples, and which samples count */
  size_t bytes[2];  /* per kind of stores: of the sample being gathered */
  double sec[2];
  int warm, kind, run; /* samples so far (up to STORE_WARM); the last one's kind, samples since it changed */
} store_clock;

typedef struct {
  shm_hdr *h; /* NULL: not mapped */
  uint8_t *data;
  size_t size;
  uint64_t pos;   /* our side's counter: head for the producer, tail for the consumer */
  int memfd;      /* producer, until the receiver answered */
  int active;     /* frames flow through the ring */
  int armed;      /* we set our *_waiting flag */
  /* how frames are stored into the ring (ftar_shm.c) */
  int stores;        /* producer: ftar_member_opts.shm_stream: -1 learn, 0 cached, 1 non-temporal */
  int stream;        /* producer: the kind kept (1 non-temporal) */
  int trial;         /* producer: samples of the other kind still to try */
  int judging;       /* producer: a trial's copies are done; its verdict waits for the consumer's reads */
  uint64_t judge_at; /* producer: ... until read_count[the trial's kind] reaches this */
  int patience;      /* producer: ... or for this many more samples */
  int blind;         /* producer: copies the first trial waited for the consumer's first rate */
  double next_trial; /* producer: tr_now() of the next trial */
  double rate[2];    /* producer: copy rate, bytes/s, with cached [0] / non-temporal [1] stores */
  double rread[2];   /* consumer: its reduce pass's rates, published in h->read_rate */
  uint64_t nread[2]; /* consumer: ... and how many reads went into them (h->read_count) */
  store_clock clock; /* either: which timings count */
} shm_link;

/* The links of one ring in run_ep: the view (its members in ring order,
 * our place) and the two neighbours' links. Level 0 is the flat ring of
 * every member; the hierarchical plane (ftar_hier.c) adds this host's
 * local ring (1) and the ring of the hosts' leaders (2). A CONNECT names
 * its level, so an accepted link is matched to (upstream uid, level).
 * rx keeps what TCP delivered past the last frame: it belongs to the next
 * frame on the same link, whatever collective or phase that is. */
enum { FTAR_LEVEL_FLAT = 0, FTAR_LEVEL_LOCAL = 1, FTAR_LEVEL_LEADERS = 2, FTAR_LEVELS = 3 };

typedef struct {
  int level;
  uint64_t ep; /* the epoch of the view (0: none yet): CONNECTs of run_ep wait for it */
  int n, r;    /* members of this ring, our place in it */
  peer mem[FTAR_MAX_MEMBERS];
  int up_fd, down_fd, down_state;
  uint8_t down_ch[AUTH_CHALLENGE]; /* the downstream's challenge (DOWN_AUTH) */
  size_t down_chgot;
  int up_eof, down_eof; /* the peer closed; fatal only while that link still has work */
  shm_link up_shm, down_shm;
  uint8_t *rx;
  size_t rx_head, rx_tail;
} ftar_links;

struct ftar_member {
  ftar_member_opts o;
  auth_secret secret; /* the job's (opts.secret, copied); len 0: none */
  char data_host[FTAR_HOST_MAX + 1];
  int slot;
  uint64_t uid;
  double deadline, coord_deadline, hb_interval;
  size_t chunk; /* floats per frame */
  uint32_t shm_ring; /* bytes of each shared-memory ring we create (a power of two) */

  /* control thread */
  pthread_t th;
  int th_started;
  struct event_base *base;
  struct bufferevent *bev;
  struct event *hb_ev, *cmd_ev;
  int cmd[2];  /* data thread -> control thread */
  int wake[2]; /* control thread -> data thread */
  uint8_t ctl_buf[4 + FTAR_ENTRY_LEN * FTAR_MAX_MEMBERS];

  /* shared with the control thread, under mu */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t ep; /* latest epoch published */
  uint64_t ep_from; /* its first seq (a join at a chosen seq): older collectives stay in run_ep */
  int ep_n;
  peer ep_mem[FTAR_MAX_MEMBERS];
  uint64_t abort_ep; /* latest epoch that aborts the collectives of older ones */
  uint64_t go_ep, go_seq;
  int go_dec, go_wind; /* go_wind: FTF_WIND, decided while the group winds down */
  int sync_n; /* the member list of the epoch we last sent SYNC for */
  peer sync_mem[FTAR_MAX_MEMBERS];
  int failed; /* FTAR_ECOORD / FTAR_EEVICTED once the control link is gone */
  int winding; /* wound down (ftar_member_wind_down, or the coordinator's WIND): no quorum
                * wait (under mu) */
  int wound;   /* took a decision of a winding group: every later call is called off
                * (the thread running ftar_collective: the caller's, or the
                * communication thread's on the async path) */
  int coord_lost; /* survive_coord_loss: the link is gone, waiting for ftar_member_reconnect */
  int q_fd;       /* a new coordinator connection for the control thread (-1: none) */
  int leave_abort; /* ftar_member_leave with a collective in flight: its LEAVE calls that collective off */
  char fail_msg[256];
  int q_sync, q_abort, q_quit, q_commid, q_wind;
  ftar_hdr sync_h, abort_h, commid_h;
  uint8_t commid_pay[FTAR_COMMID_LEN];
  uint64_t cid_ep; /* latest epoch whose communicator id arrived (COMMID) */
  uint8_t cid[FTAR_COMMID_LEN];
  uint64_t epochs_seen;
  atomic_uint gen; /* bumped on every change above; the data thread polls it */

  /* data plane: the calling thread only */
  int lfd, lport;
  pending pend[PENDING_MAX];
  int npend;
  uint64_t run_ep; /* epoch we were told to run in (GO) */
  int run_aborted; /* a collective failed in run_ep: do not run there again */
  int run_n, run_r; /* the epoch's members (ordered by slot) and our place */
  peer run_mem[FTAR_MAX_MEMBERS];
  ftar_links lk[FTAR_LEVELS]; /* each ring level's view and links */
  uint64_t shape_ep;          /* ftar_hier.c: the run epoch whose hosts were counted (0: none) */
  int shape_hosts, shape_most; /* its hosts, members on the most populated one */
  uint64_t shape_logged;      /* the last epoch whose hierarchy was logged */
  float *in_copy, *stage;
  size_t in_cap;
  uint64_t last_seq, last_ep;
  int completed_any;
  ftar_stats st;
  ftar_async *async; /* ftar_async.c's communication thread (NULL until the first ftar_allreduce_start) */
  void *dev_state; /* ftar_dev.c's, freed by dev_free */
  void (*dev_free)(void *);
};

/* --- ftar_member.c: descriptors, sockets, waiting --- */

void ftar_set_nonblock(int fd);
void ftar_tune_socket(int fd, int sockbuf);
void ftar_close_fd(int *fd); /* closes *fd if open; *fd = -1 */
void ftar_wake_fd(int fd);   /* one byte into a wake-up pipe */
void ftar_drain_fd(int fd);  /* empties a wake-up pipe */
/* Waits until fd is ready for ev (POLLIN / POLLOUT): 0, or -1 when t_end
 * (tr_now() clock) passed or poll failed. */
int ftar_io_wait(int fd, short ev, double t_end);
/* Waits on m->cv (mu held) until t_end or a short slice, whichever is first. */
void ftar_cv_wait(ftar_member *m, double t_end);
/* A non-blocking TCP connection to host:port (IPv4). t_end <= 0: returns
 * with the connect in progress (the caller completes it); else waits for it
 * until t_end. 0 with *out set, or a negative code with tr_error() set. */
int ftar_connect_to(const char *host, int port, int sockbuf, double t_end, int *out);

/* --- ftar_control.c: the control thread and the coordinator link --- */

/* Connects to the coordinator and registers (HELLO / WELCOME): sets uid,
 * coord_deadline, hb_interval. 0 with *cfd the connection, or a negative
 * code with tr_error() set ("ftar: ..."). Constructor. */
int ftar_ctl_register(ftar_member *m, const char *coord_host, int coord_port, double t_end, int *cfd);
/* Starts the control thread on cfd; *cfd = -1 once the thread's bufferevent
 * owns it. 0, or a negative code with tr_error() set. Constructor. */
int ftar_ctl_start(ftar_member *m, int *cfd);
/* Stops the control thread, says LEAVE to the coordinator and frees the
 * libevent state. Harmless on a partly started member. ftar_member_free. */
void ftar_ctl_stop(ftar_member *m);
/* Queues a control frame for the control thread: ABORT (abort_frame) or
 * SYNC. Data thread. */
void ftar_ctl_queue(ftar_member *m, int abort_frame, const ftar_hdr *h);

/* --- ftar_shm.c: same-host shared-memory rings --- */

int ftar_shm_create(ftar_links *L, uint32_t size, int stores); /* producer: maps down_shm; 0 or -1 */
int ftar_shm_attach(ftar_links *L, const uint8_t *pay); /* consumer: maps up_shm from CONNECT; 0 or -1 */
void ftar_shm_unmap(shm_link *S);
ssize_t ftar_shm_write(ftar_links *L, const struct iovec *iov, int niov, uint64_t *streamed);
ssize_t ftar_shm_read(ftar_links *L, void *dst, size_t cap);
const uint8_t *ftar_shm_peek(ftar_links *L, size_t *n, int *bad);
void ftar_shm_consume(ftar_links *L, size_t n);
void ftar_shm_read_took(ftar_links *L, size_t n, double sec); /* consumer: a reduce of the next n bytes took sec */

/* --- ftar_port.c: the data port and the ring's links --- */

void ftar_port_accept(ftar_member *m); /* accepts strangers on the data port */
void ftar_port_read(ftar_member *m);   /* reads and checks their CONNECT frames */
void ftar_port_match(ftar_member *m);  /* adopts each ring level's upstream CONNECT for run_ep */
void ftar_port_close(ftar_member *m);  /* closes every stranger */
void ftar_links_close(ftar_member *m); /* closes the ring links of every level */
void ftar_links_close_one(ftar_links *L); /* closes one level's two links */
/* Sets level L's view for epoch ep: n members in ring order, ours at r. */
void ftar_links_view(ftar_links *L, uint64_t ep, const peer *mem, int n, int r);

/* --- ftar_async.c: the communication thread of ftar_allreduce_start --- */

/* opts.quorum_wait, on the caller's thread: called on the communication
 * thread, it asks ftar_allreduce_wait to run it instead. Mutex not held. */
void ftar_quorum_wait(ftar_member *m);
int ftar_async_busy(ftar_member *m); /* a started collective was not waited for yet */
void ftar_async_free(ftar_member *m); /* fails a collective in flight, joins the thread */
int ftar_async_inflight(ftar_member *m); /* a started collective is queued or running (not done) */

/* --- ftar_ring.c: the ring engine, and the flat ring as a data plane --- */

/* What one pass of the ring engine does over one level's links. */
enum {
  FTAR_PASS_RING = 0,    /* reduce-scatter, all-gather, p-1 commit tokens: the flat ring's collective */
  FTAR_PASS_REDUCE = 1,  /* reduce-scatter and all-gather, no tokens: done once we hold the ring's sum */
  FTAR_PASS_BCAST = 2,   /* rank 0's buf along the chain 0 -> 1 -> .. -> p-1, no tokens */
  FTAR_PASS_TOKENS = 3,  /* p-1 tokens around the ring (n = 0): then every member of it got here */
  FTAR_PASS_RELEASE = 4, /* one token along the chain 0 -> .. -> p-1 (n = 0) */
  FTAR_PASS_RS = 5,      /* the reduce-scatter alone: rank r then holds the sum of segment r+1 mod p */
  FTAR_PASS_AG = 6,      /* the all-gather alone, from what FTAR_PASS_RS left */
};

typedef struct {
  float *buf;
  size_t n;
  ftar_op op;           /* FTAR_MEAN divides in the pass (FTAR_PASS_RING only) */
  size_t bucket;        /* floats per bucket (0: one), reduced once rd says they are final */
  const ftar_ready *rd; /* NULL: all are */
  size_t rd_off;        /* buf's offset in the buffer rd describes (a wave of the hierarchy's
                           bucketed call passes one bucket of it) */
  int level;            /* FTAR_LEVEL_*: whose view and links (the view set) */
  int kind;             /* FTAR_PASS_* */
  int phase;            /* 0..255, in every frame's flags (bits 8..15): passes on one link never mix */
  float *save;          /* where the pass saves the input it overwrites, at buf's offsets (n floats;
                           restored by ftar_ring_undo); NULL: saved nowhere */
  uint32_t frames_before; /* data frames received earlier in this attempt (the fault hook counts on) */
  int no_stall;           /* the pass waits on other hosts' local work: no "peer stalled" limit (a lost
                             peer ends it through EOF, the coordinator's abort or t_end) */
  int outer_p, outer_c;   /* > 1: the pass moves only segment outer_c of outer_p of every bucket (the
                             part an earlier FTAR_PASS_RS over outer_p members left this member) */
  float div;              /* FTAR_PASS_REDUCE: each member divides the segment it completes by div before
                             the all-gather sends it (0: no division) */
} ftar_pass;

typedef struct ftar_ring_run ftar_ring_run; /* a pass's state and undo log, reused across passes */
ftar_ring_run *ftar_ring_run_new(void);     /* NULL when out of memory */
void ftar_ring_run_free(ftar_ring_run *rr); /* NULL ok */
/* One pass in run_ep, bounded by t_end: FTAR_PLANE_DONE, FTAR_PLANE_ABORT
 * (every level's links closed; *full: buf holds the pass's result) or
 * FTAR_PLANE_FATAL (timeout, control link down). why: the reason. *frames:
 * data frames this pass received. */
int ftar_ring_pass(ftar_member *m, ftar_ring_run *rr, const ftar_pass *a, uint64_t seq, double t_end, int *full,
                   char *why, size_t why_len, uint32_t *frames);
/* Puts back into buf what rr's last pass overwrote (from a->save), once:
 * every element a reduce pass completed was saved before it changed. */
void ftar_ring_undo(ftar_ring_run *rr, float *buf);
/* Grows m->in_copy to n floats: 0, or a negative code with tr_error() set. */
int ftar_in_copy_reserve(ftar_member *m, size_t n);

/* The ring plane over buf[0..n) for ftar_allreduce: in buckets of `bucket`
 * floats from the end of buf (0 or >= n: one), each reduced once rd says
 * it is final (rd NULL: all are). NULL when out of memory (no message).
 * Freed with ftar_ring_plane_free (NULL ok). */
ftar_plane *ftar_ring_plane_new(float *buf, size_t n, ftar_op op, size_t bucket, const ftar_ready *rd);
void ftar_ring_plane_free(ftar_plane *pl);

/* --- ftar_hier.c: the hierarchical plane --- */

/* The plane of ftar_allreduce and ftar_allreduce_start: per attempt, the
 * hierarchical reduction when the run epoch's hosts call for it (opts.hier),
 * else the flat ring plane (same arguments as ftar_ring_plane_new). NULL
 * when out of memory. Freed with ftar_host_plane_free (NULL ok). */
ftar_plane *ftar_host_plane_new(float *buf, size_t n, ftar_op op, size_t bucket, const ftar_ready *rd);
void ftar_host_plane_free(ftar_plane *pl);

#endif
