/* pipeline_ckpt.h — checkpoints of a pipelined run (private to core/fleet):
 * one store per stage written by the lowest live pipeline's worker of that
 * stage, the newest step every stage committed (what a resume loads), the
 * plan the checkpoints were taken with, and the records after a resumed
 * step. The stage workers (pipeline_main.c) and the launcher
 * (pipeline_run.c) call it.
 */
#ifndef TRANSOM_PIPELINE_CKPT_H
#define TRANSOM_PIPELINE_CKPT_H

#include <stdint.h>

#include "ckpt.h"
#include "job.h"
#include "pipeline_plan.h"
#include "trainer.h"

/* Stage `stage`'s store RUN/ckpt-stage-K, attached to t; NULL when the job
 * takes no checkpoints or on an error (tr_error() says; check the job). */
ckpt_engine *pipe_ckpt_open(const job_config *cfg, trainer *t, const char *run, int stage);
/* Loads step (> 0) from the store into t, all or nothing; that step or
 * an error (never an older one: the stages would be out of step). */
int pipe_ckpt_load(ckpt_engine *ck, trainer *t, int stage, int64_t step);
/* The newest step committed in all S stage stores of run that verifies in
 * every one of them (0: none); an error when a store cannot be listed. */
int pipe_ckpt_common_step(const char *run, int S, int64_t *step);

/* What a --resume of run with the job's S stages does, decided before
 * anything is written (read only: the launcher calls it before job.lua,
 * the records or the stores change). *step: the newest step every store
 * committed and verifies (pipe_ckpt_common_step), 0 for none. With
 * *step = 0 and *start_over = 1 some stores hold checkpoints and another
 * holds none (a start killed between two stages' first commits, or inside
 * a store's first ckpt_open, before its databases existed): those
 * belong to the run abandoned, to be set aside (pipe_ckpt_set_aside)
 * before it starts over. Refused (an error saying why, naming the way
 * out) when the stores hold checkpoints and: RUN/pipeline-plan is missing
 * or lists no stage, or lists another number of stages (pipeline.stages
 * changed); a store of stage S or above holds one; a store of a stage
 * below S is missing; every store holds some but no step is in all of
 * them (out of step: the error lists each store's); or a store cannot be
 * read, or none of the common steps verifies. */
int pipe_ckpt_resume_check(const char *run, int S, int64_t *step, int *start_over);

/* Moves each RUN/ckpt-stage-K (K < S) that holds checkpoints aside, whole
 * and atomically (rename to ckpt-stage-K.abandoned-<time>-<pid>-<n>, a
 * name no other set-aside took: nothing is deleted), saying so on stdout
 * and in RUN/events.jsonl ("checkpoints_set_aside"); *moved: the
 * checkpoints. When a rename fails, the stores renamed before it are moved
 * back (the run as it was) and the error says which failed. Only after
 * pipe_ckpt_resume_check said start_over, for stores no process has open
 * (the launcher, before its workers start). */
int pipe_ckpt_set_aside(const char *run, int S, int *moved);

/* RUN/pipeline-plan: the stages' cuts and order, saved by the first run
 * and restored (into p's cuts and order; *found = 0 when there is none) by
 * a resumed one, which must have as many stages. The file is checked as a
 * policy's answer is (pipe_plan_check against nops, the graph's op
 * count), one line per stage 0..S-1, all alike: anything else is an
 * error naming the file, and p is left as it was. */
int pipe_plan_save(const char *run, const pipe_plan *p);
int pipe_plan_restore(const char *run, pipe_plan *p, int nops, int *found);

/* Drops the records of steps after `step` from the run's metrics.jsonl,
 * stage-K.jsonl and pipeline-P-stage-K.jsonl (the resumed run does them
 * again); *dropped = lines removed. */
int pipe_ckpt_truncate_records(const char *run, int64_t step, int *dropped);

#endif
