/* pipeline_main.c — `transom stage`: one pipeline stage process, started by
 * pipeline_run.c (see pipeline.h). It loads the run's job.lua, builds its
 * trainer for one micro-batch (the stage holds every parameter, computes
 * only its ops; the global norm clips, not the trainer), links to its
 * neighbours and runs the one training loop with the stage's hooks:
 * compute (pipeline_stage.c), exchange, evaluate, boundary
 * (pipeline_step.c), and a report that the first stage writes to
 * metrics.jsonl and prints. Checkpoints: each stage its own store
 * (pipeline_ckpt.c), loaded when the plan says resume=STEP; each outcome
 * is a line on stdout and in RUN/events.jsonl. A STOP line
 * from the launcher (SIGINT/SIGTERM to `transom run`) is a vote in the
 * end-of-step exchange: every stage stops after the same step, snapshots
 * it, stage 0 saves the weights, and each tells the launcher "STOPPED
 * step=N" before it exits 0. The stage ignores SIGINT (a terminal's
 * Ctrl-C reaches the whole process group: the launcher stops the stages in
 * order); SIGTERM still ends it at once (the launcher's own stop of a
 * stage that outlived the run, or of the run when another failed). With replicas
 * each worker serves a donor, and a worker the launcher started to rebuild
 * a lost pipeline (--rejoin) catches up from one before it trains
 * (pipeline_rejoin.c).
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "backend.h"
#include "ftar.h"
#include "job.h"
#include "loop.h"
#include "lua_host.h"
#include "pipeline.h"
#include "pipeline_ckpt.h"
#include "pipeline_plan.h"
#include "pipeline_probe.h"
#include "pipeline_stage.h"
#include "step_record.h"
#include "util.h"

typedef struct {
  int coord, donor, attempt; /* from the PLAN line: see take_plan */
  int64_t resume;            /* the step to load from this stage's store (0: none) */
  double hide, bw_prev, bw_next; /* AdaTopK's start (pipe_plan_adatopk_seed; 0: learn it) */
} plan_extra;

typedef struct {
  const char *run;
  int worker, listen_fd, control_fd, threads, nports, rejoin;
  int ports[PIPE_MAX_STAGES];
} stage_args;

static const char stage_usage[] =
    "usage: transom stage --run DIR --worker W --listen-fd FD --control-fd FD --ports P0,P1,... [--threads N]\n"
    "                     [--rejoin]\n"
    "\n"
    "One pipeline worker of the run in DIR (its job.lua), started by `transom run` (or `transom plan`) for\n"
    "a job with pipeline.stages > 1, one process per stage. It probes its speed and its links to the other\n"
    "workers (listening on FD, the others on 127.0.0.1:P0,...), reports them on the control socket, takes\n"
    "its stage and cuts from the launcher's plan, links to its neighbours and trains. --rejoin: a worker of a\n"
    "pipeline the launcher rebuilt: no probes; it catches up from a live pipeline's worker of its stage (the\n"
    "plan names its donor) and enters its replicas' group at a step its pipeline agrees on.\n";

static int parse_ports(stage_args *a, const char *s) {
  for (a->nports = 0; *s && a->nports < PIPE_MAX_STAGES;) {
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || v < 0 || v > 65535 || (*end && *end != ','))
      return tr_fail(TR_EINVAL, "stage: bad --ports '%s'", s);
    a->ports[a->nports++] = (int)v;
    s = *end == ',' ? end + 1 : end;
  }
  return TR_OK;
}

/* An integer flag's value, whole and in lo..hi, else TR_EINVAL naming the flag. */
static int int_arg(const char *flag, const char *v, long long lo, long long hi, int *out) {
  long long x;
  if (tr_parse_int(v, lo, hi, &x))
    return tr_fail(TR_EINVAL, "stage: %s '%s' is not an integer in %lld..%lld", flag, v, lo, hi);
  *out = (int)x;
  return TR_OK;
}

/* 1: --help was asked (printed) */
static int parse(stage_args *a, int argc, char **argv) {
  for (int i = 0; i < argc; i++) {
    int more = i + 1 < argc, rc = TR_OK;
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(stage_usage, stdout);
      return 1;
    } else if (strcmp(argv[i], "--run") == 0 && more) a->run = argv[++i];
    else if (strcmp(argv[i], "--worker") == 0 && more)
      rc = int_arg(argv[i], argv[i + 1], 0, PIPE_MAX_STAGES - 1, &a->worker), i++;
    else if (strcmp(argv[i], "--listen-fd") == 0 && more)
      rc = int_arg(argv[i], argv[i + 1], -1, INT_MAX, &a->listen_fd), i++;
    else if (strcmp(argv[i], "--control-fd") == 0 && more)
      rc = int_arg(argv[i], argv[i + 1], 0, INT_MAX, &a->control_fd), i++;
    else if (strcmp(argv[i], "--threads") == 0 && more)
      rc = int_arg(argv[i], argv[i + 1], 1, 4096, &a->threads), i++;
    else if (strcmp(argv[i], "--rejoin") == 0) a->rejoin = 1;
    else if (strcmp(argv[i], "--ports") == 0 && more) {
      if ((rc = parse_ports(a, argv[++i]))) return rc;
    } else return tr_fail(TR_EINVAL, "stage: unknown argument '%s'", argv[i]);
    if (rc) return rc;
  }
  if (!a->run || a->worker < 0 || a->control_fd < 0 || a->worker >= a->nports)
    return tr_fail(TR_EINVAL, "usage: transom stage --run DIR --worker W --listen-fd FD --control-fd FD --ports ...");
  return TR_OK;
}

/* --- the loop's report: the first stage writes the records --- */

/* Every stage writes its records (the links it sends on): the first to
 * metrics.jsonl, which it also prints, stage k to stage-k.jsonl. */
static int stage_report(void *ud, const step_record *rec) {
  pipe_stage *s = ud;
  step_record r = *rec;
  r.grad_norm = s->global_norm; /* the pipeline's, not this stage's share */
  r.density_fwd = s->fwd.nsent ? s->fwd.density_sum / s->fwd.nsent : 1.0;
  r.density_bwd = s->bwd.nsent ? s->bwd.density_sum / s->bwd.nsent : 1.0;
  r.bytes_fwd = (double)s->fwd.bytes;
  r.bytes_bwd = (double)s->bwd.bytes;
  if (s->k != 0 || s->p != 0) {
    if (s->metrics && step_record_json(s->metrics, &r)) return tr_fail(TR_EIO, "writing a stage's records");
    if (s->metrics) fflush(s->metrics);
    return 0;
  }
  const job_config *c = s->cfg;
  if (r.step % c->log_interval == 0 || r.step == c->max_steps)
    printf("step %*lld/%lld | loss %.4f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s\n", s->width, (long long)r.step,
           (long long)c->max_steps, r.loss, r.lr, r.grad_norm, r.step_s * 1e3, r.tokens_per_s);
  fflush(stdout);
  if (s->metrics && step_record_json(s->metrics, &r)) return tr_fail(TR_EIO, "writing metrics.jsonl");
  if (s->metrics) fflush(s->metrics);
  return 0;
}

/* The loop's poll: a STOP line from the launcher (it caught SIGINT or
 * SIGTERM) makes this stage vote to stop. It never stops here alone: the
 * stages agree on the step in the end-of-step exchange (pipe_exchange),
 * and every one stops after it. A control socket the launcher closed
 * counts as STOP (the launcher is gone: the run cannot go on). */
static int stage_poll(void *ud, loop_control *ctl) {
  pipe_stage *s = ud;
  char line[64];
  (void)ctl;
  if (s->stop_late) { /* the test hook below: a step later than read */
    s->stop_asked = 1;
    return 0;
  }
  for (struct pollfd p = {.fd = s->ctl, .events = POLLIN}; !s->stop_asked && !s->stop_late && poll(&p, 1, 0) > 0;)
    if (pipe_read_line(s->ctl, line, sizeof line, 1.0) || strcmp(line, "STOP") == 0) {
      /* TRANSOM_TEST_STOP_LATE=P: the stages of pipeline P vote a step
       * after they read STOP, so the pipelines are asked at different
       * steps (their agreement is what a test checks) */
      const char *late = getenv("TRANSOM_TEST_STOP_LATE");
      if (late && atoi(late) == s->p) s->stop_late = 1;
      else s->stop_asked = 1;
    }
  return 0;
}

/* The writer's checkpoint outcomes, one line each on stdout and in
 * RUN/events.jsonl (the operator's kinds, "worker": the stage). */
static void stage_ckpt_event(void *ud, const ckpt_event *ev) {
  pipe_stage *s = ud;
  char detail[1200];
  if (ev->ok) {
    printf("checkpoint: stage %d, step %lld committed in %.1f ms\n", s->k, (long long)ev->step, ev->commit_s * 1e3);
    snprintf(detail, sizeof detail, "stage %d (pipeline %d) committed %.1f MiB: copy %.1f ms, commit %.1f ms", s->k,
             s->p, ev->bytes / 1048576.0, ev->copy_s * 1e3, ev->commit_s * 1e3);
  } else {
    printf("checkpoint: stage %d, step %lld failed: %s\n", s->k, (long long)ev->step, ev->what);
    snprintf(detail, sizeof detail, "stage %d (pipeline %d): %s", s->k, s->p, ev->what);
  }
  fflush(stdout);
  if (s->events) tr_event_line(s->events, ev->step, s->k, ev->ok ? "checkpoint" : "checkpoint_failed", detail);
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
  s->R = cfg->replicas > 1 ? (int)cfg->replicas : 1;
  s->p = a->worker / s->S;
  s->clip = cfg->grad_clip;
  job_config tc = *cfg;
  tc.batch_size /= s->M;
  tc.grad_clip = 0;
  if (!(s->t = trainer_create(L, &tc))) return TR_EINVAL;
  trainer_set_slot(s->t, s->p); /* each pipeline its own batches */
  s->g = trainer_graph(s->t);
  s->cfg = trainer_config(s->t);
  s->b = (int)s->cfg->batch_size;
  s->T = (int)s->cfg->block_size;
  s->tok = graph_find(s->g, "tokens");
  s->tgt = graph_find(s->g, "targets");
  s->loss = graph_find(s->g, "loss");
  s->timeout = cfg->hang_seconds;
  const char *pad = getenv("TRANSOM_TEST_STEP_MS");
  s->pad_ms = pad ? atoi(pad) : 0;
  s->width = snprintf(NULL, 0, "%lld", (long long)cfg->max_steps);
  snprintf(s->dir, sizeof s->dir, "%s", a->run);
  int on = strcmp(cfg->pipe_compression, "adatopk") == 0;
  s->fwd = (pipe_dir){.on = on, .floor = cfg->pipe_act_min_density};
  s->bwd = (pipe_dir){.on = on, .floor = cfg->pipe_min_density};
  return TR_OK;
}

/* --- the control socket: lines to and from the launcher --- */

int pipe_write_line(int fd, const char *line) {
  size_t n = strlen(line);
  for (size_t off = 0; off < n;) {
    /* a peer gone is EPIPE here, not SIGPIPE: the launcher does not ignore
     * it, and dying of it would orphan the workers it supervises */
    ssize_t w = send(fd, line + off, n - off, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return tr_fail(TR_EIO, "writing a control line: %s", strerror(errno));
    off += (size_t)w;
  }
  return TR_OK;
}

int pipe_read_line(int fd, char *out, size_t n, double timeout) {
  size_t k = 0;
  double end = tr_now() + timeout;
  while (k + 1 < n) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int left = (int)((end - tr_now()) * 1000), n = left < 0 ? 0 : poll(&p, 1, left);
    if (n < 0 && errno == EINTR) continue; /* the launcher's stop signal: the wait goes on */
    if (n == 0) return tr_fail(TR_EIO, "no line in %.0f s", timeout);
    char c;
    ssize_t r = read(fd, &c, 1);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return tr_fail(TR_EIO, "the peer closed the control socket");
    if (c == '\n') break;
    out[k++] = c;
  }
  out[k] = 0;
  return TR_OK;
}

/* A seed of AdaTopK's on the PLAN line: a finite number >= 0, else 0 (learn it). */
static double seed_value(const char *line, const char *key) {
  const char *v = strstr(line, key);
  double x = v ? strtod(v + strlen(key), NULL) : 0;
  return isfinite(x) && x > 0 ? x : 0;
}

/* The launcher's PLAN line: stage, cuts, order, and the replicas'
 * coordinator (coord=), a rebuilt worker's donor and attempt, AdaTopK's
 * start (hide=, bw_prev=, bw_next=). */
static int take_plan(const char *line, pipe_stage *s, pipe_plan *p, plan_extra *x) {
  int rc = pipe_plan_parse(line, s->S, &s->k, s->cuts, p->order);
  if (!rc) rc = pipe_plan_check("the launcher's plan", s->cuts, p->order, s->S, graph_norder(s->g));
  if (!rc && s->k >= s->S) rc = tr_fail(TR_EINVAL, "the launcher's plan: stage %d of %d", s->k, s->S);
  if (rc) return rc;
  const char *co = strstr(line, "coord="), *dn = strstr(line, "donor="), *at = strstr(line, "attempt="),
             *re = strstr(line, "resume=");
  x->resume = re ? atoll(re + 7) : 0;
  x->coord = co ? atoi(co + 6) : 0;
  x->donor = dn ? atoi(dn + 6) : 0;
  x->attempt = at ? atoi(at + 8) : 1;
  x->hide = seed_value(line, "hide=");
  x->bw_prev = seed_value(line, "bw_prev=");
  x->bw_next = seed_value(line, "bw_next=");
  return TR_OK;
}

/* Probes (if the job asks), reports, takes the plan: stage, cuts, order.
 * A rebuilt worker (--rejoin) only takes the plan. 1: the plan says stop
 * (`transom plan`). */
static int probe_and_plan(lua_State *L, const stage_args *a, const job_config *cfg, pipe_stage *s, pipe_plan *p,
                          plan_extra *x) {
  double flops = 0, bw[PIPE_MAX_STAGES] = {0}, lat[PIPE_MAX_STAGES] = {0};
  int rc = pipe_plan_from_job(L, cfg, p);
  if (rc) return rc;
  if (a->nports != s->S * s->R) return tr_fail(TR_EINVAL, "stage: %d ports for %d workers", a->nports, s->S * s->R);
  char line[4096];
  if (a->rejoin) {
    s->speed = p->speed[a->worker % s->S];
    if ((rc = pipe_read_line(a->control_fd, line, sizeof line, 600))) return rc;
    return take_plan(line, s, p, x);
  }
  int j = a->worker % s->S, probe = cfg->pipe_probe && s->p == 0; /* pipeline 0 probes for all */
  s->speed = p->speed[j];
  pipe_probe_ctx c = {.cfg = cfg, .plan = p, .w = j, .lfd = a->listen_fd, .ports = a->ports,
                      .timeout = s->timeout}; /* the HELLO wait: PIPE_PROBE_HELLO_S */
  pipe_probe_server *sv = probe ? pipe_probe_serve(&c) : NULL;
  if (probe && !sv) return TR_EIO;
  rc = pipe_read_line(a->control_fd, line, sizeof line, 600); /* GO: our turn to probe */
  if (!rc && probe && !(rc = pipe_probe_speed(s, &flops))) rc = pipe_probe_links(&c, bw, lat);
  int rj = pipe_probe_serve_join(sv); /* the lower workers probed before our turn */
  if (rc || (rc = rj)) return rc;
  if ((rc = pipe_probe_line(line, sizeof line, j, s->S, flops, bw, lat)) < 0) return rc;
  if ((rc = pipe_write_line(a->control_fd, line)) || (rc = pipe_read_line(a->control_fd, line, sizeof line, 600))) return rc;
  if (strncmp(line, "PLAN stop", 9) == 0) return 1;
  return take_plan(line, s, p, x);
}

/* R > 1: this stage's member of its replicas' FTAR group (slot: the
 * pipeline), once all R are in. */
static int join_replicas(const job_config *cfg, pipe_stage *s, int coord) {
  if (s->R < 2) return TR_OK;
  if (coord <= 0) return tr_fail(TR_EIO, "stage: the plan names no coordinator for the replicas");
  ftar_member_opts fo;
  ftar_member_opts_default(&fo);
  fo.deadline = cfg->deadline;
  /* Longer than a link's wait (hang_seconds): a member that waits on a hung
   * pipeline mate gives up on its link first and leaves the group, and the
   * other pipelines' members carry on without it; with equal bounds they
   * timed out too, and one hung worker ended every pipeline. */
  fo.timeout = 2 * cfg->hang_seconds;
  if (!(s->fm = ftar_member_create("127.0.0.1", coord, s->p, &fo))) return TR_EIO;
  int rc = ftar_member_wait(s->fm, s->R, cfg->hang_seconds);
  return rc ? tr_fail(rc, "stage %d: its %d replicas did not all join", s->k, s->R) : TR_OK;
}

/* Connect to the next stage's worker, then take the previous one's; both
 * links emulated as the job's zones say. */
static int link_up(const stage_args *a, const job_config *cfg, const pipe_plan *p, pipe_stage *s) {
  char name[64];
  double rate, delay;
  int w = a->worker % s->S;
  if (s->k < s->S - 1) {
    int nw = p->order[s->k + 1], fd = pl_connect(p->addr[nw], a->ports[s->p * s->S + nw], s->timeout);
    snprintf(name, sizeof name, "stage %d", s->k + 1);
    if (fd < 0 || !(s->next = pl_link_create(fd, name, pipe_stage_max_message(s), pipe_stage_max_stream(s))))
      return tr_fail_prefix(TR_EIO, "linking to stage %d", s->k + 1);
    pipe_link_emulation(cfg, p->zone[w], p->zone[nw], &rate, &delay);
    pl_link_shape(s->next, rate, delay);
    pl_link_send_timeout(s->next, s->timeout);
  }
  if (s->k > 0) {
    int fd = pl_accept(a->listen_fd, s->timeout);
    snprintf(name, sizeof name, "stage %d", s->k - 1);
    if (fd < 0 || !(s->prev = pl_link_create(fd, name, pipe_stage_max_message(s), pipe_stage_max_stream(s))))
      return tr_fail_prefix(TR_EIO, "linking to stage %d", s->k - 1);
    pipe_link_emulation(cfg, p->zone[w], p->zone[p->order[s->k - 1]], &rate, &delay);
    pl_link_shape(s->prev, rate, delay);
    pl_link_send_timeout(s->prev, s->timeout);
  }
  return TR_OK;
}

/* The stage's records (metrics.jsonl, stage-K.jsonl, pipeline-P-stage-K.jsonl) and
 * RUN/events.jsonl, both appended. */
static int open_logs(pipe_stage *s) {
  char path[1200];
  if (s->k == 0 && s->p == 0) snprintf(path, sizeof path, "%s/metrics.jsonl", s->dir);
  else if (s->p == 0) snprintf(path, sizeof path, "%s/stage-%d.jsonl", s->dir, s->k);
  else snprintf(path, sizeof path, "%s/pipeline-%d-stage-%d.jsonl", s->dir, s->p, s->k);
  if (!(s->metrics = fopen(path, "a"))) return tr_fail(TR_EIO, "cannot open %s", path);
  snprintf(path, sizeof path, "%s/events.jsonl", s->dir);
  if (!(s->events = fopen(path, "a"))) return tr_fail(TR_EIO, "cannot open %s", path);
  tr_log_reserve(s->events);
  return TR_OK;
}

int pipeline_stage_main(int argc, char **argv) {
  stage_args a = {.worker = -1, .listen_fd = -1, .control_fd = -1};
  pipe_stage s = {.donor_fd = -1};
  pipe_plan plan;
  job_config cfg;
  signal(SIGPIPE, SIG_IGN);
  lua_State *L = NULL;
  int rc = parse(&a, argc, argv);
  if (rc == 1) return 0;
  if (!rc) rc = (L = lua_host_new()) ? TR_OK : tr_fail(TR_ENOMEM, "cannot start Lua");
  if (!rc) rc = make_trainer(L, &a, &cfg, &s);
  plan_extra px = {0};
  s.ctl = a.control_fd;
  if (!rc) rc = probe_and_plan(L, &a, &cfg, &s, &plan, &px);
  int stop = rc == 1;
  if (stop) rc = TR_OK;
  /* AdaTopK starts from the probes' links and the plan's slowest stage,
   * then follows its sends and the stages' measured compute */
  s.fwd.bw = px.bw_next;
  s.bwd.bw = px.bw_prev;
  s.hide_s = px.hide;
  if (!rc && !stop) rc = pipe_stage_setup(&s);
  ckpt_engine *ck = NULL;
  if (!rc && !stop && !(ck = pipe_ckpt_open(&cfg, s.t, a.run, s.k)) && (cfg.ckpt_every_steps || cfg.ckpt_every_seconds))
    rc = TR_EIO;
  if (!rc && !stop && px.resume > 0 && !a.rejoin) rc = pipe_ckpt_load(ck, s.t, s.k, px.resume);
  if (!rc && !stop) rc = link_up(&a, &cfg, &plan, &s);
  if (!rc && !stop && a.rejoin) rc = pipe_rejoin(&s, &cfg, px.coord, px.donor, px.attempt);
  else if (!rc && !stop) rc = join_replicas(&cfg, &s, px.coord);
  if (!rc && !stop && s.R > 1 && !a.rejoin) rc = pipe_donor_start(&s); /* a rebuilt one: once it is in */
  if (!rc && !stop) rc = open_logs(&s);
  if (!rc && !stop) {
    loop_opts lo = {.t = s.t, .ck = ck, .run_dir = a.run, .worker = s.k, .save_on_stop = 0};
    loop_hooks h = {.ud = &s, .poll = stage_poll, .compute = pipe_compute, .exchange = pipe_exchange,
                    .evaluate = pipe_evaluate, .boundary = pipe_boundary, .report = stage_report,
                    .eval = stage_eval, .ckpt_event = stage_ckpt_event, .failed = pipe_failed};
    loop_result res;
    rc = loop_run(&lo, &h, &res);
    char line[64]; /* the launcher says where the run stopped */
    snprintf(line, sizeof line, "STOPPED step=%lld\n", (long long)res.step);
    if (!rc && res.stopped) pipe_write_line(s.ctl, line);
  }
  if (rc && s.t) fprintf(stderr, "transom stage worker %d: %s\n", a.worker, tr_error());
  else if (rc) fprintf(stderr, "transom: %s\n", tr_error());
  if (s.metrics) fclose(s.metrics);
  if (s.events) fclose(s.events);
  donor_close(s.donor_fd);
  donor_stop(s.dn);
  ckpt_close(ck);
  ftar_member_free(s.fm);
  pipe_stage_free(&s);
  trainer_free(s.t);
  lua_host_close(L);
  return rc ? (s.too_late ? PIPE_EXIT_LATE : 1) : 0;
}
