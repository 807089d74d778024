/* sim.h — a discrete-event simulation of one long training job under
 * failures: how much of the wall time trains (ETTR) and how much of the
 * fleet's work counts (goodput), in transom's replace mode or with
 * restart-all, from per-failure costs.
 *
 * The job: `replicas` data-parallel replicas of `gpus_per_replica` GPUs on
 * hosts of `gpus_per_host`, `steps` optimizer steps of `step_s` each.
 * Failures arrive as a Poisson process over every allocated GPU
 * (`per_gpu_hour`), and/or every `every_s` seconds, and/or at given steps
 * (`chaos`, as a job file's chaos list: the replica fails on reaching
 * at_step). Each hits one replica; with probability `hardware_fraction` it
 * takes its host down, which then needs a spare host (back from repair
 * after `repair_s`), else the replica restarts in place.
 *
 * What a failure costs:
 *   replace      survivors stall detect_s + redo_s (abort, new epoch, redo
 *                of the step's all-reduce), then train on with one replica
 *                fewer (degraded_step_s a step; below min_replicas they
 *                pause). The failed replica: detect_s, the restart policy's
 *                delay (delay_s * backoff^k for its k-th replacement, at
 *                most delay_max_s if > 0), a spare host if the failure was
 *                hardware, start_s, catchup_s from a donor while the others
 *                train; then the survivors stall join_s as it enters.
 *                Every replica down at once: as restart-all.
 *   restart_all  everything stops: detect_s, a spare host if needed,
 *                restart_s, load_s; training resumes from the newest
 *                committed checkpoint, so the steps since are done again.
 * Checkpoints: a snapshot every ckpt_every_steps stalls training
 * ckpt_stall_s and commits ckpt_write_s later (one write at a time; a newer
 * snapshot replaces one still waiting, as the engine's "coalesce").
 *
 * No threads, no I/O, no allocation outside sim_run; any thread may call
 * it. Used by `transom sim` (sim_cli.c) and spec/c/test_sim.c.
 */
#ifndef TRANSOM_SIM_H
#define TRANSOM_SIM_H

#include <stdint.h>

#define SIM_MAX_CHAOS 256

typedef enum { SIM_REPLACE = 0, SIM_RESTART_ALL = 1 } sim_mode;

typedef struct {
  int64_t at_step; /* fails on reaching this step (after at_step - 1 are done) */
  int64_t replica;
} sim_chaos;

typedef struct {
  /* the job */
  int64_t replicas, gpus_per_replica, gpus_per_host, min_replicas, steps;
  double step_s;          /* a step with every replica live */
  double degraded_step_s; /* a step while some replica is missing */
  double startup_s;       /* from submission to the first step */
  /* failures */
  double per_gpu_hour;      /* Poisson rate per allocated GPU (0 = none) */
  double hardware_fraction; /* share that takes a host down (needs a spare) */
  double every_s;           /* also one every every_s seconds of wall time (0 = none) */
  int nchaos;
  sim_chaos chaos[SIM_MAX_CHAOS];
  double detect_s; /* failure -> the operator (or the survivors) know */
  /* replace mode */
  double redo_s, delay_s, backoff, delay_max_s, start_s, catchup_s, join_s;
  /* restart-all (and replace mode with every replica down) */
  double restart_s, load_s;
  /* checkpoints (0 = none: a restart goes back to step 0) */
  int64_t ckpt_every_steps;
  double ckpt_stall_s, ckpt_write_s;
  /* hosts */
  double spare_fraction; /* spare hosts, as a share of the job's hosts (rounded) */
  double repair_s;       /* a host that failed returns to the spares after this */
} sim_config;

/* Where wall time went that did not train (sim_result.lost_s). */
typedef enum {
  SIM_STARTUP,  /* start-up before the first step */
  SIM_DETECT,   /* survivors (or the stopped job) waiting to detect a failure */
  SIM_REDO,     /* survivors' abort + new epoch + redo of the all-reduce */
  SIM_JOIN,     /* survivors' stall while a replacement enters */
  SIM_CKPT,     /* checkpoint snapshot stalls */
  SIM_RESTART,  /* restart-all: rescheduling, start, communicator set-up */
  SIM_LOAD,     /* restart-all: checkpoint load */
  SIM_SPARE,    /* waiting for a host to come back from repair */
  SIM_PAUSED,   /* fewer live replicas than min_replicas */
  SIM_REWORK,   /* steps done again after going back to a checkpoint */
  SIM_DEGRADED, /* degraded steps' extra time (negative when they are faster) */
  SIM_NCAUSE
} sim_cause;

const char *sim_cause_name(sim_cause c);

typedef struct {
  int finished;        /* 0: stopped at 100 x the fault-free time */
  double wall_s;       /* submission to the last step */
  double useful_s;     /* steps done x step_s */
  double ettr;         /* useful_s / wall_s */
  double goodput;      /* like ettr, each step weighted by live replicas / replicas */
  double lost_s[SIM_NCAUSE]; /* wall_s = useful_s + the sum of these */
  int64_t failures, hw_failures;
  int64_t replacements; /* replicas that rejoined (replace mode) */
  int64_t restarts;     /* whole-job restarts */
  int64_t rework_steps; /* steps done again */
  int64_t spares;       /* spare hosts at the start */
} sim_result;

/* Simulates the job once in `mode` with failures drawn from `seed` (the
 * failure times depend only on the seed, so both modes see the same ones).
 * TR_OK, or TR_EINVAL for a config out of range (message in tr_error()),
 * TR_ENOMEM. *r is filled on TR_OK only. */
int sim_run(const sim_config *c, sim_mode mode, uint64_t seed, sim_result *r);

#endif
