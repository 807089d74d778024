/* pipeline_rejoin.c — a lost pipeline rebuilt while the others train on
 * (pipelines x replicas; see pipeline_stage.h).
 *
 * Every stage worker of a job with replicas runs a donor (donor.h) and
 * tells the launcher its port. When a pipeline loses a worker, the
 * launcher (pipeline_run.c) starts all of that pipeline's stages again;
 * each new worker
 *   1. loads the state of the same stage of a live pipeline from that
 *      worker's donor and replays the updates the donor records (a step's
 *      final gradients: averaged over the pipelines, tied uses combined,
 *      clipped by the global norm, so AdamW alone reproduces the update,
 *      bit for bit);
 *   2. follows the donor for a moment to measure the live pipelines' steps
 *      per second, and agrees with the rest of its pipeline, up and down
 *      the chain, on a step J that far ahead of the slowest estimate: half
 *      a second of steps, times the attempt, plus two;
 *   3. registers in its stage's FTAR group to enter at exactly J's seq
 *      (ftar opts.join_seq): the live pipelines run every step before J
 *      without waiting for it;
 *   4. replays the donor's updates up to J - 1 and trains on: J is the
 *      first step the rebuilt pipeline computes, and all its stages enter
 *      their groups there, together.
 * A group already past J when the worker registered answers its first
 * collective with FTAR_ESEQ, and a group that changed before J (a member
 * lost) has removed the worker (FTAR_EEVICTED): the worker exits saying
 * so and the launcher tries again with a larger margin (pipeline.rebuilds
 * bounds the tries).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pipeline_probe.h"
#include "pipeline_stage.h"
#include "util.h"

#define DONOR_HISTORY 256 /* steps a donor keeps for a worker catching up */
#define MARGIN_S 0.5      /* how far ahead a rebuilt pipeline enters, in seconds of the live ones' steps */

int pipe_donor_start(pipe_stage *s) {
  int port = 0;
  if (!(s->dn = donor_start("127.0.0.1", s->t, DONOR_HISTORY, &port, NULL)))
    return tr_fail_prefix(TR_EIO, "stage %d: cannot start its donor", s->k);
  char line[64];
  snprintf(line, sizeof line, "DONOR port=%d\n", port);
  return pipe_write_line(s->ctl, line);
}

void pipe_donor_record(pipe_stage *s, int64_t step, const float *grads) {
  if (s->dn && donor_wants(s->dn, step)) donor_record(s->dn, step, grads);
}

int pipe_donor_boundary(pipe_stage *s, int64_t step) {
  donor_boundary(s->dn);
  if (s->donor_fd < 0) return TR_OK;
  donor_close(s->donor_fd); /* in the group now: serve as a donor in turn */
  s->donor_fd = -1;
  char line[64];
  snprintf(line, sizeof line, "JOINED step=%lld\n", (long long)step);
  int rc = pipe_donor_start(s);
  return rc ? rc : pipe_write_line(s->ctl, line);
}

/* Replays the donor's updates until within a step of it; its step. */
static int follow(pipe_stage *s, int64_t *step) {
  int rc = donor_catch_up(s->donor_fd, s->t, 0);
  if (rc < 0) return tr_fail_prefix(rc, "stage %d: following its donor", s->k);
  trainer_state ts;
  trainer_get_state(s->t, &ts);
  *step = ts.step;
  return TR_OK;
}

/* Follows the donor for a quarter of a second: where the live pipelines
 * are and how many steps a second they make. */
static int measure(pipe_stage *s, int64_t *now, double *rate) {
  int64_t a = 0;
  int rc = follow(s, &a);
  double t0 = tr_now();
  *now = a;
  while (!rc && tr_now() - t0 < 0.25) {
    struct timespec ts = {0, 5 * 1000 * 1000};
    nanosleep(&ts, NULL);
    rc = follow(s, now);
  }
  *rate = (double)(*now - a) / (tr_now() - t0);
  return rc;
}

/* The largest of the stages' proposals, up the chain to the first stage
 * and back down: every stage of the pipeline gets the same step. */
static int agree(pipe_stage *s, int64_t mine, int64_t *step) {
  pl_header h;
  void *p = NULL;
  double v = (double)mine;
  int rc;
  if (s->next) {
    if ((rc = pl_recv(s->next, PL_JOIN, 0, -1, s->timeout, &h, &p))) return rc;
    free(p);
    if (h.value > v) v = h.value;
  }
  if (s->prev) {
    pl_header up = {.kind = PL_JOIN, .value = v};
    if ((rc = pl_send(s->prev, &up, NULL)) || (rc = pl_recv(s->prev, PL_JOIN, 0, -1, s->timeout, &h, &p))) return rc;
    free(p);
    v = h.value;
  }
  if (s->next) {
    pl_header down = {.kind = PL_JOIN, .value = v};
    if ((rc = pl_send(s->next, &down, NULL))) return rc;
  }
  *step = (int64_t)v;
  return TR_OK;
}

static int enter_group(pipe_stage *s, const job_config *cfg, int coord, int64_t step) {
  ftar_member_opts fo;
  ftar_member_opts_default(&fo);
  fo.deadline = cfg->deadline;
  fo.timeout = cfg->hang_seconds;
  fo.strict_seq = 1; /* a group past our step must say so, not take us in at its own */
  fo.join_seq = (uint64_t)step * PIPE_SEQ_PER_STEP;
  if (!(s->fm = ftar_member_create("127.0.0.1", coord, s->p, &fo)))
    return tr_fail_prefix(TR_EIO, "stage %d: cannot register with its replicas", s->k);
  return TR_OK;
}

int pipe_rejoin(pipe_stage *s, const job_config *cfg, int coord, int donor_port, int attempt) {
  if (coord <= 0 || donor_port <= 0)
    return tr_fail(TR_EINVAL, "stage %d: a rebuilt worker needs its replicas' coordinator and a donor", s->k);
  int rc = donor_fetch_snapshot("127.0.0.1", donor_port, s->t, &s->donor_fd, NULL);
  if (rc) return tr_fail_prefix(rc, "stage %d: loading the state of a live pipeline's stage", s->k);
  int64_t now = 0, step = 0;
  double rate = 0;
  if ((rc = measure(s, &now, &rate))) return rc;
  int64_t margin = (int64_t)ceil(rate * MARGIN_S * (attempt > 0 ? attempt : 1)) + 2;
  if ((rc = agree(s, now + margin, &step))) return tr_fail_prefix(rc, "stage %d: agreeing on a step to enter at", s->k);
  if (step > s->cfg->max_steps && (s->too_late = 1))
    return tr_fail(TR_ESTATE, "the live pipelines end (step %lld) before a rebuilt one could enter (step %lld)",
                   (long long)s->cfg->max_steps, (long long)step);
  if ((rc = enter_group(s, cfg, coord, step))) return rc;
  rc = donor_catch_up(s->donor_fd, s->t, step - 1);
  if (rc < 0) return tr_fail_prefix(rc, "stage %d: replaying up to step %lld", s->k, (long long)(step - 1));
  s->join_step = step;
  fprintf(stderr, "pipeline %d stage %d: caught up from a live pipeline (%.0f steps/s there); enters at step %lld\n",
          s->p, s->k, rate, (long long)step);
  return TR_OK;
}
