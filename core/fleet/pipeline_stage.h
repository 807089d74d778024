/* pipeline_stage.h — one pipeline stage's state and its schedule (private
 * to core/fleet): pipeline_stage.c runs the micro-batches (1F1B, remote
 * autodiff), pipeline_step.c the end of a step (tied gradients, the global
 * norm, the final gather of parameters) and evaluation, pipeline_main.c the
 * `transom stage` command that wires them into the one training loop.
 */
#ifndef TRANSOM_PIPELINE_STAGE_H
#define TRANSOM_PIPELINE_STAGE_H

#include <stdint.h>
#include <stdio.h>

#include "donor.h"
#include "ftar.h"
#include "graph.h"
#include "loop.h"
#include "pipeline_link.h"
#include "trainer.h"

#define PIPE_MAX_STAGES 64
#define PIPE_MAX_TIED 16
#define PIPE_MAX_USES 8
/* FTAR seqs of a stage's collectives: step x this, +0 its parameters, +1
 * (the first stage) the tied gradients */
#define PIPE_SEQ_PER_STEP (1 + PIPE_MAX_TIED * PIPE_MAX_USES)
/* A rebuilt worker's exit status when the live pipelines end before it
 * could enter: the launcher does not try again. */
#define PIPE_EXIT_LATE 3

/* A parameter read by more than one op (the token embedding and the tied
 * head): each use accumulates its own gradient over the micro-batches, and
 * the step's gradient is their sum in op order, on every stage alike. */
typedef struct {
  int p;                       /* the parameter's tensor id */
  int64_t size;                /* elements */
  int nuse;
  int pos[PIPE_MAX_USES];      /* order positions of its uses, ascending */
  float *acc[PIPE_MAX_USES];   /* the uses in this stage: their accumulators (else NULL) */
  int64_t vec_off[PIPE_MAX_USES]; /* where each use's accumulator sits in the exchange vector (floats) */
} pipe_tied;

/* One direction of this stage's traffic (activations to the next stage,
 * gradients to the previous), and AdaTopK's view of it. */
typedef struct {
  int on;            /* compression = "adatopk" */
  double floor;      /* the smallest density */
  float *residual;   /* gradients: error feedback (NULL: none, activations) */
  double bw;         /* bytes/s: the probe's, then measured by the sends */
  double density_sum; /* this step's: sum over messages, and their count */
  int nsent;
  uint64_t bytes;    /* this step's bytes sent */
} pipe_dir;

typedef struct {
  trainer *t;
  graph *g;
  const job_config *cfg; /* the stage trainer's: batch_size = one micro-batch, grad_clip = 0 */
  double clip;           /* the job's grad_clip, applied with the global norm */
  int S, k, M, b, T;     /* stages, this stage, micro-batches, micro-batch size, block */
  int cuts[PIPE_MAX_STAGES + 1], lo, hi;
  int *xin, nxin, *xout, nxout; /* crossing activations at lo (received) and hi (sent) */
  int64_t xin_n, xout_n;        /* their elements */
  int *keep, nkeep;             /* what a micro-batch in flight keeps */
  int64_t keep_n;
  int slots;
  float *stash;     /* slots x keep_n */
  float *buf;       /* a message's floats (the larger crossing) */
  int32_t *mb_tok, *mb_tgt; /* the step's micro-batches, M x (b*T) */
  float *mb_loss;   /* per micro-batch (the last stage's own; others from the gradients) */
  int tok, tgt, loss;
  int *owner;       /* per tensor id: the stage that owns a parameter (its lowest user) */
  pipe_tied tied[PIPE_MAX_TIED];
  int ntied;
  int64_t vec_doubles, vec_floats; /* the exchange vector: per-parameter sums of squares, then the tied uses */
  char *vec;
  float *tied_all;  /* every tied gradient combined, one after the other (tied_n floats) */
  int64_t tied_n;
  pl_link *prev, *next;
  int R, p;          /* pipelines (replicas of every stage), this one */
  ftar_member *fm;   /* R > 1: this stage's replicas average gradients through FTAR */
  pl_herald *herald; /* with fm: tells the links' peers we are alive while in its all-reduce */
  donor *dn;         /* R > 1: serves a rebuilt pipeline's worker of this stage (pipeline_rejoin.c) */
  int donor_fd;      /* a rebuilt worker: its donor, until its first step with the others (else -1) */
  int64_t join_step; /* a rebuilt worker: the step it enters its replicas' group at */
  int too_late;      /* a rebuilt worker: the live pipelines end before it could enter (exit PIPE_EXIT_LATE) */
  int ctl;           /* the control socket to the launcher */
  int lowest;        /* the lowest live pipeline (its stage 0 leads, its stages checkpoint): the
                        first stage's view, down the chain every step (pipeline_step.c) */
  int vote;          /* this step's vote: 1 wants a snapshot, 2 its engine is busy, 4 asked to stop */
  int stop_asked;    /* the launcher said STOP (it caught SIGINT/SIGTERM): voted until agreed */
  int stop_late;     /* TRANSOM_TEST_STOP_LATE: STOP read, voted from the next step on */
  int64_t stop_step; /* the step every stage agreed to stop after (0: none): its boundary gathers
                        the parameters into stage 0, as the last step's does */
  int lowest_seen;   /* the lowest slot among this stage's latest replicas' all-reduce's contributors */
  int64_t own_lo, own_hi; /* the span of the gradient slab this stage's parameters cover (what replicas average) */
  int64_t epoch, redos;
  pipe_dir fwd, bwd; /* to next, to prev */
  float *scratch;    /* AdaTopK's: the larger crossing's floats */
  void *enc;         /* an encoded message */
  double compute_s, compute_mb; /* this step's compute (no waiting); per micro-batch, averaged over steps */
  double hide_s;     /* the slowest stage's compute_mb (the exchange vector): what a transfer hides behind */
  double speed;      /* emulated: compute is stretched by 1/speed */
  double owed;       /* emulated compute time not yet slept */
  double timeout;
  int pad_ms;        /* TRANSOM_TEST_STEP_MS: every step sleeps this long first (tests) */
  float global_norm, step_loss;
  char dir[1024];
  FILE *metrics;
  FILE *events;      /* RUN/events.jsonl, appended by every stage and the launcher (whole lines) */
  int width;
} pipe_stage;

/* Finds the crossings, owners and tied parameters of the stage's cuts
 * (s->cuts from the plan; all zero: an even cut is made), and allocates the
 * stash. 0 or an error. */
int pipe_stage_setup(pipe_stage *s);
void pipe_stage_free(pipe_stage *s);
/* The largest payload a message between stages may carry (set up): a
 * crossing's floats raw or encoded, the exchange vector, the tied
 * gradients, the whole parameter slab. Each link's bound (pl_link_create). */
uint64_t pipe_stage_max_message(const pipe_stage *s);
/* The largest of the messages that queue up on a link several at a time:
 * a micro-batch's activations or gradients, raw or encoded (each link's
 * queue bound, pl_link_create's stream_bytes). */
uint64_t pipe_stage_max_stream(const pipe_stage *s);

/* The loop's compute hook: step `next`'s micro-batches, 1F1B. */
int pipe_compute(void *ud, int64_t next, step_stats *st);
/* The forward of one micro-batch already loaded (graph inputs); eval: an
 * evaluation batch (nothing kept). The last stage's loss in *loss. */
int pipe_forward(pipe_stage *s, int64_t step, int mb, int eval, float *loss);
/* One forward and backward of the whole graph on a training batch (the
 * speed probe; counts s->compute_s; leaves gradients to zero). */
int pipe_run_whole(pipe_stage *s);

/* pipeline_rejoin.c: a pipeline rebuilt after a loss. */
/* R > 1: starts this stage's donor and tells the launcher its port
 * ("DONOR port=N" on s->ctl). */
int pipe_donor_start(pipe_stage *s);
/* A rebuilt pipeline's worker (its trainer, links and plan set up): takes
 * the state of the same stage of a live pipeline from its donor at
 * 127.0.0.1:donor_port, agrees with the rest of its pipeline on a step J a
 * little ahead of the live ones (further ahead on each later attempt),
 * registers in its replicas' FTAR group (coordinator port coord) to enter
 * at J exactly and replays the donor's updates up to J - 1. */
int pipe_rejoin(pipe_stage *s, const job_config *cfg, int coord, int donor_port, int attempt);
/* The exchange and boundary hooks' part: keep a step's final gradients for
 * a catching-up worker; after a rebuilt worker's first step with the
 * others, drop its donor and serve as one. */
void pipe_donor_record(pipe_stage *s, int64_t step, const float *grads);
int pipe_donor_boundary(pipe_stage *s, int64_t step);

/* pipeline_step.c: the loop's exchange, evaluate and boundary hooks. The
 * exchange agrees on checkpoints and on a stop (loop_exchange.ckpt_agreed,
 * .stop) from every stage's vote. */
int pipe_exchange(void *ud, int64_t next, loop_exchange *x);
int pipe_evaluate(void *ud, int64_t step, float *val_loss);
int pipe_boundary(void *ud, int64_t step);
/* The loop failed: the stage's FTAR group (pipelines x replicas) goes on
 * without it now. */
void pipe_failed(void *ud, int rc);

#endif
