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

#include "job.h"

/* Runs cfg's pipeline: starts cfg->pipe_stages `transom stage` processes on
 * this host (linked over loopback), waits for them, and stops the others
 * when one fails. dir exists and holds job.lua and the vocabulary; resume:
 * every stage loads the newest step all stages checkpointed (and the run's
 * saved plan). 0 when every stage finished, else a negative error
 * (tr_error() says which stage and how). Main thread only. */
int pipeline_run(lua_State *L, const job_config *cfg, const char *dir, int resume);

/* `transom plan JOB.lua [--set k=v]...`: prints the plan (probing the
 * workers as a run would) and starts nothing else. The exit status. */
int pipeline_plan_main(int argc, char **argv);

/* `transom stage --run DIR --worker W ...`: one stage worker (started by
 * the launcher; its usage says more). The exit status. */
int pipeline_stage_main(int argc, char **argv);

#endif
