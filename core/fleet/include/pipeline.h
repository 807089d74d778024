/* pipeline.h — pipeline stages (FusionLLM, issue 14): the launcher of a
 * pipelined `transom run` and the `transom stage` command each stage runs.
 *
 * A job with pipeline.stages = S > 1 (or micro_batches > 1) is cut into S
 * contiguous ranges of the model's op order (graph_stage.h); stage k runs
 * in its own process, receives the crossing activations from stage k-1 and
 * sends its own to k+1 over TCP, and the gradients come back the same way
 * (remote autodiff), micro-batches in 1F1B order, all through the one
 * training loop (loop.h's compute/exchange/evaluate hooks). Stage 0 leads:
 * it writes metrics.jsonl and, after the last step, the whole model.
 */
#ifndef TRANSOM_PIPELINE_H
#define TRANSOM_PIPELINE_H

#include <lua.h>
#include <stdint.h>

#include "job.h"

/* What a --resume of a pipelined run will do. */
typedef struct {
  int64_t step;   /* the newest step every stage's store committed (0: none) */
  int start_over; /* step 0, and some stores hold checkpoints of the run abandoned: set aside */
} pipeline_resume;

/* The checks of a --resume of the run in dir with cfg's stages, before
 * anything of the run is written (job.lua, the records, the stores): r
 * says what pipeline_run will do. An error (nothing changed; tr_error()
 * says why and the way out) when the stores do not fit the job (another
 * number of stages than RUN/pipeline-plan, a store past the last stage),
 * hold checkpoints without RUN/pipeline-plan, miss a stage's store, are
 * out of step (each holds some, none all), or cannot be read. */
int pipeline_resume_check(const job_config *cfg, const char *dir, pipeline_resume *r);

/* Runs cfg's pipeline: starts cfg->pipe_stages `transom stage` processes on
 * this host (linked over loopback), waits for them, and stops the others
 * when one fails. dir exists and holds job.lua and the vocabulary; resume
 * (NULL: a new run; else from pipeline_resume_check): every stage loads
 * its step (and the run's saved plan), the records after it dropped; or,
 * starting over, the abandoned stores set aside first. SIGINT/SIGTERM
 * stop it at a step every stage checkpoints (*stopped = 1; else 0: it
 * reached max_steps, and dir/model.safetensors holds the final weights).
 * 0 when every stage finished or stopped, else a negative error
 * (tr_error() says which stage and how). Main thread only. */
int pipeline_run(lua_State *L, const job_config *cfg, const char *dir, const pipeline_resume *resume,
                 int *stopped);

/* `transom plan JOB.lua [--set k=v]...`: prints the plan (probing the
 * workers as a run would) and starts nothing else. The exit status. */
int pipeline_plan_main(int argc, char **argv);

/* `transom stage --run DIR --worker W ...`: one stage worker (started by
 * the launcher; its usage says more). The exit status. */
int pipeline_stage_main(int argc, char **argv);

#endif
