/* pipeline_main.c — `transom stage`: one pipeline stage process, started by
 * pipeline_run.c (see pipeline.h). It loads the run's job.lua, builds its
 * trainer for one micro-batch (the stage holds every parameter, computes
 * only its ops; the global norm clips, not the trainer), links to its
 * neighbours and runs the one training loop with the stage's hooks:
 * compute (pipeline_stage.c), exchange, evaluate, boundary
 * (pipeline_step.c), and a report that the first stage writes to
 * metrics.jsonl and prints. Checkpoints are off in a pipeline for now: each
 * stage holds a share of the state (the README says so).
 */
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "job.h"
#include "loop.h"
#include "lua_host.h"
#include "pipeline.h"
#include "pipeline_stage.h"
#include "step_record.h"
#include "util.h"

typedef struct {
  const char *run;
  int stage, listen_fd, next_port, threads;
  char next_host[256];
} stage_args;

static const char stage_usage[] =
    "usage: transom stage --run DIR --stage K [--listen-fd FD] [--next HOST:PORT] [--threads N]\n"
    "\n"
    "One pipeline stage of the run in DIR (its job.lua): started by `transom run` for a job with\n"
    "pipeline.stages > 1, one process per stage. Stage K > 0 accepts stage K-1 on the listening\n"
    "socket FD; stage K < S-1 connects to stage K+1 at HOST:PORT.\n";

/* 1: --help was asked (printed) */
static int parse(stage_args *a, int argc, char **argv) {
  for (int i = 0; i < argc; i++) {
    int more = i + 1 < argc;
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(stage_usage, stdout);
      return 1;
    } else if (strcmp(argv[i], "--run") == 0 && more) a->run = argv[++i];
    else if (strcmp(argv[i], "--stage") == 0 && more) a->stage = atoi(argv[++i]);
    else if (strcmp(argv[i], "--listen-fd") == 0 && more) a->listen_fd = atoi(argv[++i]);
    else if (strcmp(argv[i], "--threads") == 0 && more) a->threads = atoi(argv[++i]);
    else if (strcmp(argv[i], "--next") == 0 && more) {
      const char *hp = argv[++i], *colon = strrchr(hp, ':');
      if (!colon) return tr_fail(TR_EINVAL, "--next wants HOST:PORT, got '%s'", hp);
      snprintf(a->next_host, sizeof a->next_host, "%.*s", (int)(colon - hp), hp);
      a->next_port = atoi(colon + 1);
    } else return tr_fail(TR_EINVAL, "stage: unknown argument '%s'", argv[i]);
  }
  if (!a->run || a->stage < 0) return tr_fail(TR_EINVAL, "usage: transom stage --run DIR --stage K [--listen-fd FD] "
                                                          "[--next HOST:PORT] [--threads N]");
  return TR_OK;
}

/* --- the loop's report: the first stage writes the records --- */

static int stage_report(void *ud, const step_record *rec) {
  pipe_stage *s = ud;
  if (s->k != 0) return 0;
  step_record r = *rec;
  r.grad_norm = s->global_norm; /* the pipeline's, not this stage's share */
  const job_config *c = s->cfg;
  if (r.step % c->log_interval == 0 || r.step == c->max_steps)
    printf("step %*lld/%lld | loss %.4f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s\n", s->width, (long long)r.step,
           (long long)c->max_steps, r.loss, r.lr, r.grad_norm, r.step_s * 1e3, r.tokens_per_s);
  fflush(stdout);
  if (s->metrics && step_record_json(s->metrics, &r)) return tr_fail(TR_EIO, "writing metrics.jsonl");
  if (s->metrics) fflush(s->metrics);
  return 0;
}

static int stage_eval(void *ud, int64_t step, float val) {
  pipe_stage *s = ud;
  printf("step %*lld/%lld | val loss %.4f\n", s->width, (long long)step, (long long)s->cfg->max_steps, val);
  if (s->metrics) {
    fprintf(s->metrics, "{\"step\":%lld,\"val_loss\":%.9g}\n", (long long)step, val);
    fflush(s->metrics);
  }
  return 0;
}

/* --- setting up --- */

/* The stage's trainer: one micro-batch, no clipping of its own. */
static int make_trainer(lua_State *L, const stage_args *a, job_config *cfg, pipe_stage *s) {
  char path[1200], th[32];
  snprintf(path, sizeof path, "%s/job.lua", a->run);
  snprintf(th, sizeof th, "threads=%d", a->threads);
  const char *sets[] = {th};
  int rc = job_load(L, path, sets, a->threads > 0 ? 1 : 0, cfg);
  if (rc) return rc;
  if (strcmp(cfg->device, "cpu") != 0 || strcmp(cfg->precision, "fp32") != 0)
    return tr_fail(TR_EINVAL, "%s: pipeline stages run on device = \"cpu\", precision = \"fp32\" for now", path);
  s->S = (int)cfg->pipe_stages;
  s->M = (int)cfg->pipe_micro_batches;
  s->k = a->stage;
  if (s->k >= s->S) return tr_fail(TR_EINVAL, "stage %d of %d", s->k, s->S);
  s->clip = cfg->grad_clip;
  cfg->batch_size /= s->M;
  cfg->grad_clip = 0;
  if (!(s->t = trainer_create(L, cfg))) return TR_EINVAL;
  s->g = trainer_graph(s->t);
  s->cfg = trainer_config(s->t);
  s->b = (int)s->cfg->batch_size;
  s->T = (int)s->cfg->block_size;
  s->timeout = cfg->hang_seconds;
  s->width = snprintf(NULL, 0, "%lld", (long long)cfg->max_steps);
  snprintf(s->dir, sizeof s->dir, "%s", a->run);
  return pipe_stage_setup(s);
}

/* Connect to the next stage (already listening), then take the previous. */
static int link_up(const stage_args *a, pipe_stage *s) {
  char name[64];
  if (s->k < s->S - 1) {
    int fd = pl_connect(a->next_host[0] ? a->next_host : "127.0.0.1", a->next_port, s->timeout);
    snprintf(name, sizeof name, "stage %d", s->k + 1);
    if (fd < 0 || !(s->next = pl_link_create(fd, name))) return tr_fail_prefix(TR_EIO, "linking to stage %d", s->k + 1);
  }
  if (s->k > 0) {
    int fd = pl_accept(a->listen_fd, s->timeout);
    snprintf(name, sizeof name, "stage %d", s->k - 1);
    if (fd < 0 || !(s->prev = pl_link_create(fd, name))) return tr_fail_prefix(TR_EIO, "linking to stage %d", s->k - 1);
  }
  return TR_OK;
}

static int open_metrics(pipe_stage *s) {
  if (s->k != 0) return TR_OK;
  char path[1200];
  snprintf(path, sizeof path, "%s/metrics.jsonl", s->dir);
  if (!(s->metrics = fopen(path, "a"))) return tr_fail(TR_EIO, "cannot open %s", path);
  return TR_OK;
}

int pipeline_stage_main(int argc, char **argv) {
  stage_args a = {.stage = -1, .listen_fd = -1};
  pipe_stage s = {0};
  job_config cfg;
  signal(SIGPIPE, SIG_IGN);
  lua_State *L = NULL;
  int rc = parse(&a, argc, argv);
  if (rc == 1) return 0;
  if (!rc) rc = (L = lua_host_new()) ? TR_OK : tr_fail(TR_ENOMEM, "cannot start Lua");
  if (!rc) rc = make_trainer(L, &a, &cfg, &s);
  if (!rc) rc = link_up(&a, &s);
  if (!rc) rc = open_metrics(&s);
  if (!rc) {
    loop_opts lo = {.t = s.t, .ck = NULL, .run_dir = a.run, .worker = s.k, .save_on_stop = 0};
    loop_hooks h = {.ud = &s, .compute = pipe_compute, .exchange = pipe_exchange, .evaluate = pipe_evaluate,
                    .boundary = pipe_boundary, .report = stage_report, .eval = stage_eval};
    loop_result res;
    rc = loop_run(&lo, &h, &res);
  }
  if (rc && s.t) fprintf(stderr, "transom stage %d: %s\n", a.stage, tr_error());
  else if (rc) fprintf(stderr, "transom: %s\n", tr_error());
  if (s.metrics) fclose(s.metrics);
  pipe_stage_free(&s);
  trainer_free(s.t);
  lua_host_close(L);
  return rc ? 1 : 0;
}
