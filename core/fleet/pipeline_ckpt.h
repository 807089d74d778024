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

/* A resume that found no step every stage committed (pipe_ckpt_common_step
 * gave 0) starts from step 0, with a new plan: the checkpoints some stores
 * did commit belong to the timeline it abandons (a start killed between
 * two stages' first commits), and kept they would be loaded later beside
 * the new run's, or outlive its newer ones by retention. They are dropped
 * from every RUN/ckpt-stage-K (a line each says what went); *dropped: the
 * checkpoints. Refused, nothing dropped, when they are of another layout
 * than the job's S stages (a store of stage S or above holds one, or
 * RUN/pipeline-plan has another number of stages: pipeline.stages
 * changed), or a store cannot be read: an error saying so. For stores no
 * process has open (the launcher, before its workers start). */
int pipe_ckpt_start_over(const char *run, int S, int *dropped);

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
