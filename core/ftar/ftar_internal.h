/* ftar_internal.h — what the FTAR member lends its device data plane
 * (ftar_dev.c). Internal: not for other modules (tests use the
 * communicator-id hooks). The member's own state and the functions its
 * files share are in ftar_member_internal.h, which ftar_dev.c does not see.
 *
 * ftar_collective.c owns the collective's control round: SYNC, the
 * coordinator's GO (RUN / COMMIT / ESEQ), redo after an abort, the result.
 * The bytes move through a data plane: ftar_ring.c's TCP / shared-memory
 * ring or ftar_hier.c's hierarchy of rings (host memory), or ftar_dev.c's
 * per-epoch communicator. A plane only runs one attempt in the member's run
 * epoch and puts the caller's input back when told; the decision of what
 * survivors return stays in one place (ftar_collective).
 */
#ifndef TRANSOM_FTAR_INTERNAL_H
#define TRANSOM_FTAR_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "ftar.h"
#include "ftar_wire.h"

/* What one attempt of a plane ended with. */
enum {
  FTAR_PLANE_DONE = 0,  /* every member holds the full result (as after the ring's last commit token) */
  FTAR_PLANE_ABORT = 1, /* the attempt failed in this epoch: *full says whether buf holds the full result */
  FTAR_PLANE_FATAL = 2, /* give up the call: *fatal_rc (default FTAR_ETIMEOUT) with why */
};

typedef struct ftar_plane ftar_plane;
struct ftar_plane {
  /* One attempt of collective `seq` in the member's run epoch (see
   * ftar_member_run_info), bounded by t_end (tr_now() clock). Called only
   * with two or more members. Returns FTAR_PLANE_* (why: a one-line reason
   * for ABORT/FATAL), or a negative code with tr_error() set, which fails
   * the call as is (no log line). */
  int (*run)(ftar_plane *pl, ftar_member *m, uint64_t seq, double t_end, int *full, int *fatal_rc, char *why,
             size_t why_len);
  /* Puts the caller's input back into buf: before a redo and on a failed
   * return. Harmless when nothing was changed. 0, or a negative code with
   * tr_error() set when buf could not be restored (a device copy failed):
   * then buf may hold a partly reduced sum, and ftar_collective fails the
   * member for good rather than redo from it. */
  int (*restore)(ftar_plane *pl, ftar_member *m);
  /* The member leaves its run epoch at a collective boundary (it is about to
   * sync a newer one): drop what belongs to the old epoch. */
  void (*leave_epoch)(ftar_plane *pl, ftar_member *m);
};

/* How far its producer got with a buffer being all-reduced while it is
 * still written (ftar_allreduce_start): buf[from..n) is final. The
 * producer stores with release, the planes load with acquire. A device
 * call's producer also leaves, before `from` covers bucket b, in marks[b]
 * the backend's mark (comm_mark) after which bucket b is final on the
 * device (NULL: the compute stream was synchronised instead). */
typedef struct {
  _Atomic size_t from;
  tr_mark **marks; /* device calls: one per bucket; NULL for host memory */
} ftar_ready;

/* The device plane in bucket mode, for ftar_allreduce_dev_start: buf[0..n)
 * of be (which has the overlapped collectives of backend.h) in buckets of
 * `bucket` floats from the end (ftar_ring.c's geometry), each all-reduced
 * on the epoch's communicator once rd says it is final. NULL with
 * tr_error() set when out of memory. Freed with ftar_dev_plane_free (NULL
 * ok). Communication thread. */
ftar_plane *ftar_dev_plane_new(ftar_member *m, const tr_backend *be, float *buf, size_t n, ftar_op op, size_t bucket,
                               const ftar_ready *rd);
void ftar_dev_plane_free(ftar_plane *pl);
/* be has the overlapped collectives (all five hooks). */
int ftar_dev_has_overlap(const tr_backend *be);
/* A collective started with ftar_allreduce_start / _dev_start was not
 * waited for yet (its communication thread may be inside ftar_collective). */
int ftar_async_busy(ftar_member *m);
/* Waits until rd says buf[off..) is final: 0; 1 with *abort_ep set when
 * a newer epoch aborts the collectives of the member's run epoch first
 * (the attempt is over: the producer may take its time); or a negative
 * code with tr_error() set when the member failed or t_end (tr_now()
 * clock) passed. The communication thread of ftar_allreduce_start. */
int ftar_member_ready_wait(ftar_member *m, const ftar_ready *rd, size_t off, double t_end, uint64_t *abort_ep);

/* The collective of ftar_allreduce (same arguments checks, return values,
 * agreement and redo rules) with its data moved by pl. n is only checked
 * here; pl knows the buffer. */
int ftar_collective(ftar_member *m, ftar_plane *pl, size_t n, ftar_op op, uint64_t seq, ftar_result *res);

/* The epoch the member runs collectives in (after GO) and its place there. */
typedef struct {
  uint64_t epoch;
  int n;           /* members of the epoch */
  int rank;        /* this member's position in the epoch's ordered list */
  int slot;        /* this member's slot */
  double deadline; /* data-plane stall limit, seconds */
  double timeout;  /* opts.timeout */
} ftar_run_info;

void ftar_member_run_info(ftar_member *m, ftar_run_info *ri);

/* --- communicator ids through the coordinator (COMMID frames) --- */

/* Rank 0 of `epoch` hands its communicator id to the coordinator, which
 * sends it to every member of the epoch. Asynchronous (the control thread
 * sends it). Data thread. */
void ftar_member_comm_id_offer(ftar_member *m, uint64_t epoch, const uint8_t id[FTAR_COMMID_LEN]);
/* Waits until the id of `epoch` arrived (0, copied into id), a newer epoch
 * aborts that one (1), or t_end passes / the control link is gone (negative
 * code, tr_error() set). Any thread. */
int ftar_member_comm_id_wait(ftar_member *m, uint64_t epoch, uint8_t id[FTAR_COMMID_LEN], double t_end);

/* --- state the device plane keeps in the member --- */

/* The device plane's state (NULL until set). Data thread. */
void *ftar_member_dev_state(ftar_member *m);
/* Sets it; ftar_member_free calls free_fn(st) first thing. */
void ftar_member_set_dev_state(ftar_member *m, void *st, void (*free_fn)(void *st));

/* Fails m for good with code and why: every call fails with it from now
 * on (a call waiting inside ftar_allreduce returns). Any thread. */
void ftar_member_fail(ftar_member *m, int code, const char *why);

/* A line in the member's log ("ftar[slot N]: ..." by default). */
void ftar_member_log(ftar_member *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
