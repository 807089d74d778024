/* pipeline_plan.h — where a pipeline's stages go (private to core/fleet):
 * the workers as the job describes them and as the probes measured them,
 * and the plan: which worker runs which stage, where the op order is cut,
 * and what that should cost. pipeline_plan.c computes it (OP-Fence, the
 * even split, or a Lua policy's override); pipeline_run.c and `transom
 * plan` use it.
 */
#ifndef TRANSOM_PIPELINE_PLAN_H
#define TRANSOM_PIPELINE_PLAN_H

#include <lua.h>
#include <stdio.h>

#include "graph.h"
#include "job.h"
#include "pipeline_stage.h"

#define PIPE_ZONE_MAX 32
#define PIPE_ADDR_MAX 64

typedef struct {
  int S, M;
  /* the workers (one per stage), from the job */
  double speed[PIPE_MAX_STAGES];              /* emulated fraction of this host */
  char zone[PIPE_MAX_STAGES][PIPE_ZONE_MAX];
  char netns[PIPE_MAX_STAGES][PIPE_ZONE_MAX];  /* a test host's network namespace ("": this host's) */
  char addr[PIPE_MAX_STAGES][PIPE_ADDR_MAX];   /* where the others reach the worker */
  /* measured by the probes (or, without them, the job's numbers) */
  int measured;
  double flops_s[PIPE_MAX_STAGES];             /* FLOP/s */
  double bw[PIPE_MAX_STAGES][PIPE_MAX_STAGES];  /* bytes/s between workers (0: unlimited) */
  double lat[PIPE_MAX_STAGES][PIPE_MAX_STAGES]; /* one way, seconds */
  /* the plan */
  char how[64];                 /* "opfence", "even", the policy file */
  int ncluster, cluster[PIPE_MAX_STAGES]; /* OP-Fence's bandwidth clusters */
  int order[PIPE_MAX_STAGES];   /* stage -> worker */
  int cuts[PIPE_MAX_STAGES + 1];
  double compress;              /* planned fraction of link bytes (1: none) */
  /* predictions, per micro-batch unless said */
  double stage_s[PIPE_MAX_STAGES], link_bytes[PIPE_MAX_STAGES], link_s[PIPE_MAX_STAGES];
  double bottleneck_s, step_s; /* step_s: a whole step of M micro-batches, 1F1B */
} pipe_plan;

/* The workers of cfg (pipeline.workers from the checked Lua table at
 * cfg->lua_ref; none listed: S alike in one zone) and the job's links as
 * the first guess of the measurements. */
int pipe_plan_from_job(lua_State *L, const job_config *cfg, pipe_plan *p);

/* The emulated link between two zones: bytes/s (0: unlimited), one-way
 * delay in seconds. */
void pipe_link_emulation(const job_config *cfg, const char *zone_a, const char *zone_b, double *rate, double *delay);

/* Makes the plan for graph g (one micro-batch): cfg->pipe_placement's
 * method; a Lua policy file runs in L. 0 or an error (a policy's bad
 * answer names the file). */
int pipe_plan_make(lua_State *L, const graph *g, const job_config *cfg, pipe_plan *p);

/* A Lua placement policy's plan (pipeline_policy.c): runs the file at path
 * sandboxed in L, passes it the measurements and p's proposal, and takes
 * its cuts and order into p. 0, or an error naming the file (a bad answer,
 * a policy error, one past its budget); L's stack as it was. */
int pipe_policy_plan(lua_State *L, const graph *g, const char *path, pipe_plan *p);

/* Fills p's predictions (stage_s, link_bytes, link_s, bottleneck_s,
 * step_s) for its order and cuts from its measurements: pipe_plan_make
 * does; a plan whose cuts and order were restored needs it again. */
int pipe_plan_predict(const graph *g, pipe_plan *p);

/* AdaTopK's starting point for stage k of plan p (what a worker would
 * otherwise learn during its first step): the slowest stage's predicted
 * compute per micro-batch (what a transfer hides behind) and the measured
 * bandwidth of its links to stages k-1 and k+1, bytes/s (0: unknown, or
 * too fast to tell). All 0 unless the probes measured p. */
void pipe_plan_adatopk_seed(const pipe_plan *p, int k, double *hide_s, double *bw_prev, double *bw_next);

/* The plan as a table: stages, ops, workers, predicted time per stage,
 * bytes per link per step. */
void pipe_plan_print(FILE *f, const graph *g, const pipe_plan *p);

/* The PLAN line the launcher sends stage k's worker (and RUN/pipeline-plan
 * holds), and its parser: "PLAN stage=K cuts=C0,..,CS order=W0,..,WS-1",
 * exactly S+1 cuts and S workers, each in 0..INT_MAX (anything after the
 * order, past a space, is the caller's). TR_EFORMAT on anything else; the
 * values are not checked against each other (pipe_plan_check). */
int pipe_plan_line(char *out, size_t n, const pipe_plan *p, int stage);
int pipe_plan_parse(const char *line, int S, int *stage, int *cuts, int *order);

/* A plan fits S stages and a graph of n ops: cuts start at 0, strictly
 * increase, end at n; order names each worker 0..S-1 once. 0, or
 * TR_EINVAL with a message that starts with `what` (the file, the
 * policy, the launcher's line). */
int pipe_plan_check(const char *what, const int *cuts, const int *order, int S, int n);

#endif
