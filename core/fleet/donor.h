/* donor.h — catch-up for a joining replica, served by a healthy one.
 *
 * Every worker runs a donor: a listener thread that a replacement connects
 * to. On "SNAP" the donor's training thread copies its state (parameters,
 * AdamW moments, step) into a side buffer at the next step boundary — one
 * memcpy, the only work the training thread does for the joiner — and from
 * then on records each step's all-reduced gradient in a bounded history. The
 * session thread streams the snapshot and then, on "GRADS from=S", the
 * recorded gradients from step S on. The joiner replays them (clip + AdamW
 * are deterministic), so it reaches the group's parameters bit for bit
 * without the others ever waiting for it. "BYE" (or a closed connection)
 * ends its session; the recording stops once no joiner is served or parked.
 *
 * A donor serves one joiner at a time, the others wait in its queue in the
 * order they proved the job secret; a joiner that has caught up is parked
 * as soon as another waits (or its session idles out): it keeps its
 * connection, and a late GRADS from it (its first collective found the
 * group a step ahead) is answered between the other sessions' requests.
 *
 * Wire format (after a text header line): raw little-endian float32 arrays.
 * Threads: donor_record/donor_boundary from the training thread only; the
 * rest runs on the donor's two threads (the listener, the session).
 */
#ifndef TRANSOM_DONOR_H
#define TRANSOM_DONOR_H

#include "auth.h"
#include <stdint.h>

#include "trainer.h"

typedef struct donor donor;

/* Starts listening on host (port 0 = any). history = most steps kept. */
donor *donor_start(const char *host, trainer *t, int history, int *port, const auth_secret *secret);
void donor_stop(donor *d);

/* Training thread: the all-reduced gradient of `step` (before clipping). */
void donor_record(donor *d, int64_t step, const float *grads);
/* Whether donor_record(d, step, ...) would keep the gradients (a joiner is
 * catching up): a device replica downloads them only then. */
int donor_wants(donor *d, int64_t step);
/* Training thread, after the optimizer: serve a pending snapshot request. */
void donor_boundary(donor *d);

/* --- the joiner's side --- */

/* Loads a snapshot from the donor at host:port into t. *fd < 0: connects
 * (and proves the secret); else asks again over that session (a newer
 * snapshot). Leaves the connection open in *fd for donor_catch_up; on an
 * error it is closed and *fd is -1. */
int donor_fetch_snapshot(const char *host, int port, trainer *t, int *fd, const auth_secret *secret);
/* Replays the donor's recorded gradients after t's step: with until > 0 up
 * to exactly step `until` (waiting for the donor to get there), else until
 * t is within one step of the donor. Returns the number of steps applied,
 * or a negative error (TR_ESTATE only if the donor's history no longer
 * reaches back to t's step: the connection is in step, fetch a newer
 * snapshot over it). */
int donor_catch_up(int fd, trainer *t, int64_t until);
void donor_close(int fd);

#endif
