/* ftar.h — FTAR: fault-tolerant ring all-reduce of float32 buffers over TCP,
 * with dynamic membership kept by a coordinator.
 *
 * Two roles:
 *   - the coordinator (ftar_coord) owns (epoch, ordered member list). Members
 *     register with a stable identity (a replica slot number), heartbeat on
 *     their control connection and learn every new epoch. It publishes
 *     epoch+1 when a member joins, when a member's control connection closes,
 *     when its heartbeats lapse past the deadline, when the host evicts it,
 *     and when a member reports an aborted collective. It runs on a libevent
 *     loop: the host's (ftar_coord_create) or its own thread (ftar_coord_start).
 *   - a member (ftar_member) is one replica. ftar_allreduce reduces a buffer
 *     in place with the other members over direct TCP links (ring
 *     reduce-scatter then all-gather, chunked and pipelined; same-host
 *     neighbours move frames through a shared-memory ring, the TCP link
 *     still carrying the handshake and detecting death; across hosts,
 *     opts.hier, the members of each host reduce among themselves first and
 *     one ring runs between the hosts' leaders). It keeps the
 *     caller's input: when a peer dies or stalls past the deadline, the
 *     collective is aborted on every survivor, buf is restored, and the same
 *     collective is redone in the next epoch, automatically. Survivors agree
 *     on the outcome through the coordinator, so a collective is either
 *     returned by all of them with the same contributors or redone by all.
 *
 * A collective is tagged (epoch, seq): seq is the caller's step number and
 * must increase from call to call on a member; every member passes the same
 * seq. A joiner enters at the next collective boundary: the members finish
 * the collective in flight, and the joiner's first collective is their next
 * one, whose seq it adopts (res->seq). Data frames of a stale epoch are
 * refused. Every frame carries a CRC32C; a malformed frame closes its link
 * with a logged reason and the collective is redone.
 *
 * Device buffers (ftar_allreduce_dev, core/ftar/ftar_dev.c): the same collective
 * and the same agreement, but the bytes move through the backend's
 * communicator of the epoch (NCCL for "cuda", shared memory for "emu"),
 * created when the epoch's first collective runs: the epoch's rank 0 makes
 * the id and the coordinator hands it to every member (COMMID frames).
 *
 * While they are being written (ftar_allreduce_dev_start): the same in
 * buckets on the member's communication thread, each bucket's all-reduce
 * queued on the backend's communication stream after a mark of its compute
 * stream.
 *
 * Not here: the NCCL calls themselves (ext/cuda/comm.cu), state catch-up of
 * a joiner (the operator streams it a snapshot), Lua bindings.
 *
 * Errors: functions return 0 / FTAR_RESHAPED or a negative code (TR_* of
 * util.h or FTAR_E* below) with the message in tr_error() of the calling
 * thread; constructors return NULL the same way. Nothing here ends the
 * process. Members and a started coordinator never raise SIGPIPE (data sends
 * use MSG_NOSIGNAL; their private threads block SIGPIPE); a host that embeds
 * the coordinator in its own loop should ignore SIGPIPE, as any libevent
 * server must.
 */
#ifndef TRANSOM_FTAR_H
#define TRANSOM_FTAR_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

struct event_base;

#define FTAR_MAX_MEMBERS 256
#define FTAR_HOST_MAX 47 /* longest host string (numeric address or name) */

/* Return codes beyond util.h's TR_E*. */
enum {
  FTAR_OK = 0,        /* completed in the same epoch as this member's previous collective */
  FTAR_RESHAPED = 1,  /* completed, but the membership changed (new epoch, or a redo) */
  FTAR_ETIMEOUT = -20, /* no quorum, no decision or no peer within opts.timeout */
  FTAR_ECOORD = -21,   /* the coordinator refused us or its connection was lost */
  FTAR_EEVICTED = -22, /* the coordinator removed this member (lapse, evict) */
  FTAR_ESEQ = -23,     /* seq out of step with the group (res->seq = the group's) */
  FTAR_ECANCELED = -24, /* the group wound down (ftar_member_wind_down): the collective was not run */
};

typedef enum { FTAR_SUM = 0, FTAR_MEAN = 1 } ftar_op;

typedef struct {
  uint64_t epoch;      /* epoch the result was computed in */
  uint64_t seq;        /* the collective's seq (a fresh joiner's is the group's) */
  int contributors;    /* members whose input is in the result; MEAN divided by it */
  int redos;           /* times this collective was aborted and started again */
  int slots[FTAR_MAX_MEMBERS]; /* the contributors' slots, ascending */
} ftar_result;

typedef struct {
  uint64_t collectives, redos, epochs; /* completed calls, restarts, epochs seen */
  uint64_t bytes_sent, bytes_recv;     /* data plane payload + headers */
  uint64_t conns_rejected;             /* data connections closed as malformed/stale */
  uint64_t links_shm, links_tcp;       /* data links this member opened or accepted, by transport */
  uint64_t bytes_cross;                /* of bytes_sent, those sent to a member of another host */
  uint64_t bytes_streamed;             /* of bytes_sent, those stored into a shared-memory ring with
                                          non-temporal stores (opts.shm_stream) */
  uint64_t hier_collectives;           /* attempts that completed through the hierarchical plane */
  uint64_t grid_collectives;           /* ... through the grid (one host, an even count >= 4) */
  uint64_t waves;                      /* their waves: one a call, or with buckets one per run of
                                          whole buckets of >= 1 MiB (ftar_hier.c's "waves": the
                                          cross-host part overlaps the producer) */
} ftar_stats;

typedef void (*ftar_log_fn)(void *ud, const char *msg);

/* --- coordinator --- */

typedef enum {
  FTAR_CHANGE_JOIN,    /* slot registered */
  FTAR_CHANGE_CLOSED,  /* slot's control connection closed */
  FTAR_CHANGE_LAPSED,  /* slot's heartbeats lapsed past the deadline */
  FTAR_CHANGE_EVICTED, /* the host evicted slot (ftar_coord_evict) */
  FTAR_CHANGE_ABORTED, /* slot reported an aborted collective: same members, new epoch */
  FTAR_CHANGE_WOUND_DOWN, /* slot wound the group down (ftar_member_wind_down) while the
                             group's collectives could run: same members, new epoch at the
                             next collective boundary (one owed while the coordinator is held
                             comes at the release, reported as a join) */
} ftar_change_kind;

typedef struct {
  ftar_change_kind kind;
  int slot;            /* the member the change is about */
  uint64_t epoch;      /* the epoch just published */
  int n_members;
  const int *slots;    /* the new ordered member list (valid during the callback) */
  int clean;           /* CLOSED: the member left cleanly (ftar_member_free) after completing
                          its part, so the epoch did not abort the collective in flight */
} ftar_change;

typedef struct ftar_coord ftar_coord;

typedef struct {
  double deadline;  /* seconds without a heartbeat before a member is dropped (default 3) */
  double heartbeat; /* seconds between member heartbeats (default deadline / 6) */
  /* Called on the loop thread after every published epoch. */
  void (*on_change)(void *ud, const ftar_change *c);
  void *ud;
  ftar_log_fn log;  /* default: stderr, "ftar-coord: ..." */
  void *log_ud;
  /* The job's secret (auth.h; copied): every connection gets a challenge
   * first and is closed, with a log line saying so, unless it answers with
   * this secret. NULL/0: no challenge; more than AUTH_KEY_MAX bytes, or a
   * length without bytes: ftar_coord_create fails (TR_EINVAL). */
  const uint8_t *secret;
  size_t secret_len;
} ftar_coord_opts;

void ftar_coord_opts_default(ftar_coord_opts *o);

/* Listens on host:port (port 0 = any; see ftar_coord_port) inside the
 * caller's event loop. o may be NULL (defaults). Returns NULL on error. The
 * coordinator lives until ftar_coord_free; base must outlive it. Call from
 * the thread that runs base (or before it runs). */
ftar_coord *ftar_coord_create(struct event_base *base, const char *host, int port, const ftar_coord_opts *o);
/* The same on a private event_base run by a private thread (the standalone
 * driver, tests). */
ftar_coord *ftar_coord_start(const char *host, int port, const ftar_coord_opts *o);
/* Closes every member connection and the listener. For an embedded
 * coordinator: call on the loop thread (or with the loop stopped). For a
 * started one: any thread; it stops and joins the private thread. NULL ok. */
void ftar_coord_free(ftar_coord *c);

/* The port actually bound. Any thread. */
int ftar_coord_port(const ftar_coord *c);
/* Current epoch and member slots (ascending; at most max written). Returns
 * the number of members. Any thread (a consistent snapshot). */
int ftar_coord_members(ftar_coord *c, uint64_t *epoch, int *slots, int max);
/* Hold (1) or release (0) the publication of epochs: while held, members
 * register and heartbeat but no epoch goes out; the release publishes one
 * epoch with every member registered meanwhile. A new coordinator holds
 * while the members of a lost one re-register, so they never run a
 * collective in a partial group. Loop thread. */
void ftar_coord_hold(ftar_coord *c, int hold);
/* Members registered now (published or held). Loop thread. */
int ftar_coord_registered(ftar_coord *c);
/* Closes slot's connection (it gets FTAR_EEVICTED) and publishes epoch+1.
 * Asynchronous: done on the loop thread shortly after. Any thread. Returns
 * TR_EIO if the request could not be queued. */
int ftar_coord_evict(ftar_coord *c, int slot);

/* --- member --- */

typedef struct ftar_member ftar_member;

typedef struct {
  const char *data_host; /* address to listen on and advertise (default "127.0.0.1") */
  int data_port;         /* 0 = any */
  double timeout;        /* longest wait inside one call for quorum/peers/decision (default 60 s) */
  double deadline;       /* data-plane stall limit; 0 = the coordinator's deadline */
  int min_members;       /* quorum: wait (up to timeout) for at least this many (default 1) */
  size_t chunk_bytes;    /* largest frame payload (default 128 KiB, whole frames of 2 x 65408 B;
                            bench/ftar_frames.sh measures it against 256 KiB). A ring segment of
                            up to 4 x 65408 B is cut evenly in frames of at most 65408 B (header +
                            payload fill one 64 KiB loopback segment); bigger ones in about 4
                            frames of whole multiples of it, at most chunk_bytes. Every member
                            must use the same value. */
  int sockbuf;           /* SO_SNDBUF/SO_RCVBUF bytes (default 4 MiB; 0 = kernel autotuning) */
  int spin_us;           /* after the last progress, poll this long (yielding the core between
                            rounds) before sleeping: -1 default (500 us), 0 never */
  int shm;               /* same-host peers exchange frames through a shared-memory ring
                            (TCP stays for the handshake, doorbells and EOF): 1 (default) / 0;
                            decided link by link (members may differ) */
  size_t shm_ring_bytes; /* each shared-memory ring's size: 0 = the default, 1 MiB; rounded up
                            to a power of two in [1 MiB, 64 MiB]. A ring that stays in cache
                            beat a 4 MiB one (bench/ftar_frames.sh KNOB=shm-ring). The sender
                            sizes its ring, link by link (members may differ) */
  int shm_stream;        /* how the sender stores frames into its shared-memory ring: -1
                            (default) times its copies both ways and keeps the faster, trying
                            the other every 0.2 s (non-temporal stores win where the two cores
                            share no cache, plain ones where they do); 1 non-temporal (x86-64);
                            0 plain. Sender's choice, link by link */
  int hier;              /* hierarchical reduction (core/ftar/ftar_hier.c): members that
                            advertise the same data_host reduce through a local ring first,
                            their host's leader (lowest slot) runs one ring across hosts, the
                            result goes back within the host. -1 (default, auto): when the
                            epoch spans >= 2 hosts with >= 2 members on some host, else the
                            grid (pairs, then columns; ftar_hier.c) for an even number >= 4 of
                            members, each on a host of its own; 1: whenever
                            some host has >= 2 members; 0: never (the flat ring). Decided per
                            attempt from the epoch's members; every member must use the same
                            value. Host buffers only (not ftar_allreduce_dev) */
  int strict_seq;        /* 0 (default): a member that never completed a collective adopts the
                            group's seq. 1: it gets FTAR_ESEQ with res->seq = the group's seq
                            instead; it stays a member and the group waits for it: call
                            again with exactly that seq (after catching up to it) */
  uint64_t join_seq;      /* 0 (default): a new member enters the group at its members' next
                            collective. J > 0: at seq J exactly: the members run their
                            collectives before J without it (the epoch that adds it takes
                            effect at J), so a joiner that catches up to J - 1 from a peer
                            enters where it planned, whatever the group's speed (a pipeline
                            rebuilt stage by stage enters every stage's group at the same
                            step). A group already past J answers its collective with
                            FTAR_ESEQ (pick a later J). Until the group reaches J, any other
                            change to it (a member lost or aborting, a clean leave) removes the
                            joiner unless that leaves it alone (its calls fail with
                            FTAR_EEVICTED: create it again with a later J), and the coordinator
                            refuses other registrations. */
  int survive_coord_loss; /* 0 (default): losing the coordinator fails the member (FTAR_ECOORD).
                            1: it aborts the collective in flight (kept for a redo, as after a
                            membership change) and the member waits, up to timeout, for
                            ftar_member_reconnect to a new coordinator */
  ftar_log_fn log;       /* default: stderr, "ftar[slot N]: ..." */
  void *log_ud;
  void (*quorum_wait)(void *ud); /* NULL, or called on the calling thread about every 0.2 s while
                            a collective waits for quorum (the member's lock not held): work
                            only that thread may do and that restoring the quorum needs,
                            e.g. copying its state for a replacement that is joining */
  void *quorum_ud;
  /* The job's secret (auth.h; copied): the member answers the coordinator's
   * and its peers' challenges with it, and challenges every connection to
   * its data port. NULL/0: none (the other side must have none either);
   * more than AUTH_KEY_MAX bytes, or a length without bytes:
   * ftar_member_create fails (TR_EINVAL). */
  const uint8_t *secret;
  size_t secret_len;
} ftar_member_opts;

void ftar_member_opts_default(ftar_member_opts *o);

/* Opens the data listener, connects to the coordinator at coord_host:
 * coord_port, registers as slot (>= 0) and starts a background thread for
 * control traffic and heartbeats. Blocks until the coordinator accepted (up
 * to o->timeout). NULL on error (FTAR-coded message in tr_error(): refused,
 * slot in use, unreachable). o may be NULL. */
ftar_member *ftar_member_create(const char *coord_host, int coord_port, int slot, const ftar_member_opts *o);
/* Leaves the group cleanly (tells the coordinator, which publishes epoch+1
 * without aborting the others' collective in flight: this member completed
 * its part) and frees everything. Not while another thread is inside
 * ftar_allreduce on m. NULL ok. */
void ftar_member_free(ftar_member *m);

/* All-reduces buf[0..n) in place across the current members. op: FTAR_SUM or
 * FTAR_MEAN (sum / contributors). seq: this collective's step number,
 * greater than the previous call's. res (may be NULL) gets epoch, seq,
 * contributors, redos and slots.
 * Returns FTAR_OK, FTAR_RESHAPED (done, but the epoch differs from the
 * previous collective's or it had to be redone), or negative: FTAR_ETIMEOUT,
 * FTAR_ECOORD, FTAR_EEVICTED, FTAR_ESEQ, FTAR_ECANCELED, TR_EINVAL, TR_ENOMEM. On a negative
 * return buf holds the caller's input again.
 * With one member no data moves: contributors = 1, buf untouched.
 * One thread at a time per member; buf must not be touched meanwhile. */
int ftar_allreduce(ftar_member *m, float *buf, size_t n, ftar_op op, uint64_t seq, ftar_result *res);

/* The same collective while buf is still being written (gradients during
 * backward), reduced in buckets on a communication thread the member
 * keeps (PyTorch DDP's overlap). buf[0..n) is cut into buckets of `bucket`
 * floats from its end (bucket 0 = the last `bucket` floats; 0 or >= n:
 * one bucket); the producer says how far it got with
 * ftar_allreduce_ready, and each bucket is reduced as soon as it is final.
 * Every member must pass the same n, op, seq and bucket.
 *   start: queues collective `seq`; the thread SYNCs once bucket 0 is
 *     final. TR_EINVAL, TR_ENOMEM, TR_ESTATE (one was not waited for).
 *   ready: buf[from..n) will not be written again (from only decreases;
 *     a larger value is ignored). The producer's thread; cheap (an atomic
 *     store, a wake-up when a bucket becomes final).
 *   wait: declares all of buf final (ready(0)), waits for the result and
 *     returns what ftar_allreduce would (res, codes, input restored on a
 *     negative return); *comm_s (may be NULL) = seconds the collective ran
 *     on the communication thread, from bucket 0 final to the result.
 *     opts.quorum_wait runs here, on the caller's thread.
 * Faults as ftar_allreduce, for the whole buffer: an attempt that aborts
 * puts back every bucket it touched (only those: the producer may still be
 * writing the others) and the survivors redo all buckets in the next
 * epoch, so every member returns the same complete result. Results: each
 * bucket is a ring all-reduce of its own, so an element's sum is added in
 * another order than in one ftar_allreduce of buf: the same bits at 2
 * members (a + b == b + a) and whenever bucket >= n; at 3 or more, the
 * same bits on every member and from run to run for a fixed membership and
 * bucket, possibly not those of ftar_allreduce. Between start and wait the
 * caller calls nothing else on m but ready (ftar_member_free fails the
 * collective in flight). Host memory (a device buffer:
 * ftar_allreduce_dev_start). */
int ftar_allreduce_start(ftar_member *m, float *buf, size_t n, ftar_op op, uint64_t seq, size_t bucket);
void ftar_allreduce_ready(ftar_member *m, size_t from);
int ftar_allreduce_wait(ftar_member *m, ftar_result *res, double *comm_s);

/* ftar_allreduce_start on a backend's buffer (ftar_allreduce_dev's data
 * plane, in buckets), finished by the same ftar_allreduce_ready and
 * ftar_allreduce_wait. be->host_memory: exactly ftar_allreduce_start.
 * Otherwise be must have the overlapped collectives of backend.h
 * (ftar_dev_overlaps; else TR_EINVAL: call ftar_allreduce_dev after the
 * producer instead). "Final" is then about the compute stream: ready and
 * wait must be called by the thread that drives be's compute stream, after
 * it queued the last kernel that writes buf[from..n); ready records a mark
 * there (be->comm_mark) when a bucket becomes final, and the
 * communication thread queues that bucket's all-reduce on the backend's
 * communication stream after the mark, so it runs on the device while the
 * compute stream goes on with backward. Per attempt, in the epoch's
 * communicator (created as ftar_allreduce_dev says, on the communication
 * thread): each bucket, from the end of buf, as soon as it is final: its
 * input is copied into the member's device copy (first attempt only),
 * then it is all-reduced (scale 1/contributors for FTAR_MEAN); once all
 * are done (be->comm_wait, the watchdog of comm_allreduce), the commit
 * round. Faults as ftar_allreduce_dev, for the whole buffer: a member lost
 * mid-call aborts the communicator, the buckets that were queued are
 * copied back from the device copy (only those: the producer may still be
 * writing the others) and the survivors redo every bucket in the next
 * epoch (an epoch that aborts while the communication thread waits for
 * the producer ends the attempt there, as on the ring); TR_EDEVICE is not
 * retried. Results: each bucket's sum is the
 * communicator's sum of that bucket; on emu (sums in rank order) the bits
 * of ftar_allreduce_dev. wait's *comm_s: as for host memory (the time the
 * communication thread spent on the collective, from bucket 0 final). On
 * return from wait the result is in buf for the compute stream's next
 * kernels. The member's device copies are freed by ftar_member_free. */
int ftar_allreduce_dev_start(ftar_member *m, const tr_backend *be, float *buf, size_t n, ftar_op op, uint64_t seq,
                             size_t bucket);
/* 1 when ftar_allreduce_dev_start can overlap on be: host memory, or the
 * backend has the overlapped collectives (emu; cuda built with NCCL). */
int ftar_dev_overlaps(const tr_backend *be);

/* ftar_allreduce on a backend's ("device") buffer: buf[0..n) is a pointer
 * of be (backend.h); same seq, op, res, return values and agreement as
 * ftar_allreduce. How the data moves:
 *   - be->host_memory (cpu): exactly ftar_allreduce.
 *   - be has no collectives: buf is downloaded into a host buffer the
 *     member keeps, ftar_allreduce'd, and uploaded.
 *   - otherwise the backend's communicator of the epoch. The member keeps
 *     one (rank = its position in the epoch's ordered member list); it is
 *     created by the first collective of an epoch (the epoch's rank 0 calls
 *     be->comm_id and hands the id to the coordinator, which sends it to
 *     every member; creation waits at most min(time left, max(10 s, 4 x
 *     deadline))) and destroyed when the member moves to another epoch:
 *     aborted (comm_destroy's finalize = 0), since finalizing waits for
 *     every rank, a failed one included. ftar_member_free finalizes it
 *     when its last collective completed (a clean shutdown), else aborts.
 *     The input is saved (be->copy into a buffer the member keeps) before
 *     the first attempt. An attempt is the all-reduce (scale 1/contributors
 *     for FTAR_MEAN, a multiplication: bits may differ from the ring's
 *     division) and then a one-float all-reduce, the commit round: once it
 *     completes, every member holds the full result, which is what lets the
 *     coordinator's decision stay that of the ring. A communicator that
 *     fails (a peer died or stalled past the deadline: the backend's
 *     watchdog aborts it) is destroyed, the abort reported, buf restored
 *     from the copy and the collective redone in the next epoch. A device
 *     that is unusable (the backend says TR_EDEVICE: a corrupted CUDA
 *     context, an abort that hung) is not retried: the call fails with
 *     TR_EDEVICE, and the process must be replaced.
 *   One member: no communicator, buf untouched.
 * Device memory the member keeps (the input copy, one float) is freed by
 * ftar_member_free, which must run while be is still usable. The calling
 * thread must be the one that drives be's compute stream. TR_ESTATE while
 * a collective started with ftar_allreduce_start / _dev_start was not
 * waited for (as ftar_allreduce). On a negative
 * return buf holds the caller's input again (a backend without
 * collectives: buf is untouched, unless uploading the result failed:
 * TR_EIO, buf undefined). */
int ftar_allreduce_dev(ftar_member *m, const tr_backend *be, float *buf, size_t n, ftar_op op, uint64_t seq,
                       ftar_result *res);

/* Waits until the latest epoch has at least n members including this one
 * (startup). 0, FTAR_ETIMEOUT, FTAR_ECOORD or FTAR_EEVICTED. Any thread. */
int ftar_member_wait(ftar_member *m, int n, double timeout);
/* Registers m with a new coordinator at host:port after the old one was
 * lost (opts.survive_coord_loss): a fresh connection, HELLO carrying the
 * member's epoch (the new coordinator numbers its epochs above it), a new
 * uid, and the control thread takes the connection over. The collective in
 * flight, already aborted, is redone in the first epoch the new coordinator
 * publishes. Blocks up to timeout seconds. 0, or FTAR_ECOORD / FTAR_ETIMEOUT
 * (the member stays as it was: call again). Any thread but the control
 * thread; may run while another thread is inside ftar_allreduce. */
int ftar_member_reconnect(ftar_member *m, const char *host, int port, double timeout);
/* Fails m for good with FTAR_ECOORD and why: a call waiting inside
 * ftar_allreduce returns (input restored). For a host that gives up on
 * every coordinator. Any thread. */
void ftar_member_abandon(ftar_member *m, const char *why);
/* The group runs no more collectives (the job stops while the group waits
 * below min_members for members that will not come in time). The
 * coordinator is told and tells every member (and any that registers
 * later), so the others wind down too without a call of their own: a call
 * waiting for quorum stops waiting and takes the coordinator's decision on
 * its collective: a result the members held is committed and returned as
 * usual, so every member ends on the same step; where the collective would
 * have to run (again) it is called off for every member (FTAR_ECANCELED,
 * input restored), and any later call returns FTAR_ECANCELED at once. A
 * collective running, or decided to run before the coordinator knew,
 * completes; every member's next one is called off. A member that adopts a
 * new coordinator (ftar_member_reconnect) while wound down winds that
 * coordinator's group down too. Any thread. */
void ftar_member_wind_down(ftar_member *m);
/* Leaves the group now, for a caller that cannot go on (its compute
 * failed): a collective in flight (ftar_allreduce_start) fails with its
 * input restored, LEAVE goes to the coordinator (flagged, with a
 * collective in flight: the epoch it publishes aborts the others' attempt
 * as a lost member's would) and the links and the data listener close, so
 * the others redo without this member at once instead of waiting for it
 * until their deadline, and again in every epoch until the process exits.
 * m stays valid for ftar_member_stats and ftar_member_free; every call
 * fails with why from now on. Not while another thread of the caller is
 * inside ftar_allreduce or _wait; not from the control thread. Leaves
 * the caller's tr_error() as it was. */
void ftar_member_leave(ftar_member *m, const char *why);
/* Latest epoch known and its member count. Any thread. */
uint64_t ftar_member_epoch(ftar_member *m, int *n_members);
/* Port of the data listener. Any thread. */
int ftar_member_data_port(const ftar_member *m);
/* Counters. Call from the thread that calls ftar_allreduce. */
void ftar_member_stats(ftar_member *m, ftar_stats *s);

#endif
