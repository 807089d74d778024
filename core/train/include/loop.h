/* loop.h — the one training loop, for a single-process run and for every
 * worker of a multi-replica job alike.
 *
 * A step is: commands -> before_step -> compute (batch, forward, backward)
 * -> exchange (gradients with peers) -> checkpoint wait -> apply (clip,
 * AdamW) -> boundary -> checkpoint snapshot -> evaluation -> report. The
 * loop alone decides when to snapshot (every_steps, every_seconds, asked
 * for, at a stop, at the end), waits for a running copy before the
 * parameters change, evaluates, and saves the final weights. What differs
 * between a lone process and a replica is in the hooks: how gradients are
 * exchanged (FTAR, later a pipeline stage's tensors), where commands come
 * from, where records go, the donor's step boundary, chaos.
 *
 * "Compute the step" (trainer) and "exchange tensors with peers" (the
 * exchange hook) stay separate: a pipeline stage plugs in as another
 * exchange. One thread: the loop runs on the caller's.
 */
#ifndef TRANSOM_LOOP_H
#define TRANSOM_LOOP_H

#include <stdint.h>

#include "ckpt.h"
#include "step_record.h"
#include "trainer.h"

/* What a poll of the commands can ask for (the hook sets fields; the loop
 * clears ckpt_now once it acted on it). */
typedef struct {
  int stop;        /* stop after the current step (a signal, say) */
  int64_t stop_at; /* finish this step, then stop (0: not asked) */
  int ckpt_now;    /* snapshot at the next step boundary */
} loop_control;

/* The outcome of one exchange. */
typedef struct {
  int replicas;       /* whose gradients the result averages */
  int leader;         /* 1: this process leads the step (snapshots, evaluation, final save) */
  int snapshots;      /* 1: this process snapshots (default: the leader; a pipeline stage's
                         lowest live replica snapshots into its stage's own store) */
  int ckpt_want;      /* in: 1 when this process wants a snapshot at this step (every_steps,
                         every_seconds on its own clock, asked for, the end, a deferred one) */
  int ckpt_ready;     /* in: 1 when its engine would take one now (ckpt_ready) */
  int ckpt_agreed;    /* out: -1 (the default): each process decides at its boundary; 0 or 1:
                         whether every process snapshots this step (a pipeline's stages: one
                         store each, all of the same steps: some stage wants one, every
                         stage's engine is ready) */
  int stop;           /* out: 1: every process stops after this step, agreed in the exchange (a
                         pipeline's stages: one of them was asked to); it ends the run as
                         max_steps does: the step snapshotted, the leader saves the weights */
  int64_t epoch;      /* membership epoch (0: alone) */
  int redos;          /* collectives redone after a member failed */
  double allreduce_s; /* the loop's: time the step waited in exchange (exposed) */
  double comm_s;      /* time the exchange ran, overlapped with backward or not (0: the hook
                         did not say; then allreduce_s) */
} loop_exchange;

/* An exchange that returns LOOP_RECOMPUTE changed the trainer's state (a
 * joiner replayed steps it missed): the loop recomputes from there. */
#define LOOP_RECOMPUTE 1
/* An exchange that returns LOOP_STOPPED called its step off: a stop was
 * asked while the step could not finish (the group waits below
 * min_replicas for replacements). Nothing was applied: the loop stops at
 * the last boundary as after a finished step, and the exchange's leader
 * and snapshots fields say who writes that state. */
#define LOOP_STOPPED 2

/* Hooks; any may be NULL. Each returns 0, or a negative error that ends the
 * loop (tr_error() says why). ud is the hooks' own state. */
typedef struct {
  void *ud;
  /* Between steps, before anything else: commands from outside. */
  int (*poll)(void *ud, loop_control *ctl);
  /* Before step `next` is computed (chaos: a fault, a delay). */
  int (*before_step)(void *ud, int64_t next);
  /* Before step `next` is computed: the exchange may start now and reduce
   * gradients while the backward produces them (grads_ready says how far
   * it got: trainer_set_grads_ready). exchange then finishes it. */
  int (*exchange_start)(void *ud, int64_t next);
  void (*grads_ready)(void *ud, int64_t from);
  /* After the gradients of step `next` exist: reduce them with peers and say
   * how. Without it the process is alone and leads. May return
   * LOOP_RECOMPUTE or LOOP_STOPPED. */
  int (*exchange)(void *ud, int64_t next, loop_exchange *x);
  /* After the update of `step`, before anything else sees it (the donor's
   * consistent point). */
  int (*boundary)(void *ud, int64_t step);
  /* The step's record (every step, leader or not). */
  int (*report)(void *ud, const step_record *r);
  /* A validation loss (the leader's, every eval_interval steps and at the end). */
  int (*eval)(void *ud, int64_t step, float val_loss);
  /* A checkpoint the engine committed or failed. */
  void (*ckpt_event)(void *ud, const ckpt_event *ev);
  /* The final weights were written to the run directory at `step`. */
  void (*saved)(void *ud, int64_t step);
  /* A pipeline stage (core/fleet/pipeline_stage.c): computes the gradients
   * of step `next` in place of trainer_compute_grads (its share of the
   * micro-batches' forward and backward, with its neighbours), filling st. */
  int (*compute)(void *ud, int64_t next, step_stats *st);
  /* In place of trainer_eval, and then on every process, leader or not (a
   * pipeline's stages all take part); only the leader's value is reported. */
  int (*evaluate)(void *ud, int64_t step, float *val_loss);
  /* The loop ends with error rc (a step failed, after exchange_start
   * perhaps), before the final checkpoint is flushed: peers should stop
   * waiting for this process now, not when it exits. */
  void (*failed)(void *ud, int rc);
} loop_hooks;

typedef struct {
  trainer *t;
  ckpt_engine *ck;     /* NULL: checkpoints are off */
  const char *run_dir; /* where the final weights go */
  int worker;          /* the replica slot, for the records */
  int save_on_stop;    /* 1: the leader saves the weights also when stopped early
                          (README's "Ctrl-C still saves the weights"), and after an
                          error the writer snapshots the last state (a lone run);
                          0: the weights only at max_steps or at a stop the exchange
                          agreed on (loop_exchange.stop: a pipeline's stages), no
                          snapshot after an error */
  int replica;         /* 1: one replica of several (worker.c): save_on_stop saves the
                          weights at a stop, but no snapshot follows an error (the
                          operator decides what survives it: a replacement, a rollback) */
} loop_opts;

typedef struct {
  int64_t step;    /* where training is */
  int stopped;     /* 1: stopped by a command before max_steps */
  int leader;      /* whether this process led the last step */
  int64_t last_snapshot; /* the newest step snapshotted (-1: none) */
} loop_result;

/* Runs from the trainer's current step to cfg->max_steps or a stop. On an
 * error the snapshots taken are flushed (and the last state snapshotted
 * too where save_on_stop is set and replica is not); returns the error,
 * with res filled as far as it got. */
int loop_run(const loop_opts *o, const loop_hooks *h, loop_result *res);

#endif
