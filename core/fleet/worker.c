/* worker.c — `transom worker`: one data-parallel replica.
 *
 * Started by the operator (operator.c) or by an external launcher. It
 * connects to the operator, learns the run directory and the FTAR
 * coordinator, builds its trainer (its own data stream: slot), gets its
 * state (fresh, from the newest checkpoint, or from a donor peer while the
 * others keep training), and loops:
 *
 *   batch -> forward -> backward -> FTAR all-reduce (mean) -> clip + AdamW
 *   -> (leader: checkpoint snapshot) -> report the step to the operator
 *
 * The replica with the lowest slot among the contributors of a step is the
 * leader: the only one that writes checkpoints (all replicas hold the same
 * bits). Identity is the slot and the run, never the PID or rank order.
 *
 *   transom worker --operator HOST:PORT --slot K [--threads N]
 *   RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun) or SLURM_PROCID/
 *   SLURM_NTASKS (srun) stand in for --slot and --operator.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "ckpt.h"
#include "donor.h"
#include "ftar.h"
#include "job.h"
#include "lua_host.h"
#include "proto.h"
#include "trainer.h"
#include "util.h"

int worker_main(int argc, char **argv);

#define MAX_CHAOS 64

typedef struct {
  int64_t at;
  char fault[8];
  int64_t ms, steps;
} chaos;

typedef struct {
  int slot, threads;
  char op_host[256];
  int op_port;
  int opfd;
  proto_reader rd;
  chaos chaos[MAX_CHAOS];
  int nchaos;
  int64_t stop_at; /* finish this step, then stop (0 = no stop asked) */
  int ckpt_now;    /* the operator asked for a checkpoint */
  trainer *t;
  pthread_mutex_t send_mu; /* the training and heartbeat threads both write to opfd */
  pthread_t hb;
  volatile int hb_stop;
  volatile int in_allreduce;   /* the training thread's phase, for the heartbeat */
  volatile double phase_since; /* tr_now() when it entered that phase */
  int64_t slow_until, slow_ms, nan_until;
} worker;

static const char usage[] =
    "usage: transom worker --operator HOST:PORT --slot K [--threads N]\n"
    "\n"
    "One replica of a `transom run` job; the operator starts these itself.\n"
    "Under an external launcher, torchrun's RANK/MASTER_ADDR/MASTER_PORT or\n"
    "Slurm's SLURM_PROCID (with MASTER_ADDR/MASTER_PORT set to the operator)\n"
    "stand in for --slot and --operator.\n";

static const char *env_any(const char *a, const char *b) {
  const char *v = getenv(a);
  if (v && *v) return v;
  v = b ? getenv(b) : NULL;
  return v && *v ? v : NULL;
}

/* One line to the operator, from either thread. */
#define SEND(w, ...)                                 \
  ({                                                 \
    pthread_mutex_lock(&(w)->send_mu);               \
    int rc_ = proto_send((w)->opfd, __VA_ARGS__);    \
    pthread_mutex_unlock(&(w)->send_mu);             \
    rc_;                                             \
  })

/* Liveness, apart from progress: a hung training thread still heartbeats
 * (the detector's "hang"), a stopped or dead process does not ("dead"). */
static void *heartbeat_main(void *arg) {
  worker *w = arg;
  while (!w->hb_stop) {
    if (SEND(w, "HB slot=%d phase=%s for=%.3f", w->slot, w->in_allreduce ? "allreduce" : "compute",
             tr_now() - w->phase_since))
      break;
    for (int i = 0; i < 5 && !w->hb_stop; i++) usleep(100000);
  }
  return NULL;
}

/* Reads the operator's commands that are waiting (never blocks). */
static int poll_commands(worker *w) {
  char line[PROTO_LINE_MAX];
  for (;;) {
    int rc = proto_read(&w->rd, line, sizeof line, 0);
    if (rc == 0) return tr_fail(TR_EIO, "the operator closed the connection");
    if (rc < 0) return w->rd.len < PROTO_LINE_MAX ? TR_OK : rc; /* nothing waiting */
    if (proto_is(line, "STOP")) {
      w->stop_at = proto_int(line, "at", 1);
    } else if (proto_is(line, "CKPT_NOW")) {
      w->ckpt_now = 1;
    } else if (proto_is(line, "SKIP") && w->t) {
      trainer_skip_update(w->t, proto_int(line, "at", -1));
    } else if (proto_is(line, "SET") && w->t) {
      /* applied from an agreed step on, by every replica alike */
      double lr = proto_num(line, "lr", 0);
      if (lr > 0) trainer_set_lr(w->t, proto_int(line, "at", 0), (float)lr);
    } else if (proto_is(line, "CHAOS") && w->nchaos < MAX_CHAOS) {
      chaos *c = &w->chaos[w->nchaos++];
      c->at = proto_int(line, "at", 0);
      proto_get(line, "fault", c->fault, sizeof c->fault);
      c->ms = proto_int(line, "ms", 200);
      c->steps = proto_int(line, "steps", 0);
    }
  }
}

/* Faults injected on purpose (the job's chaos list, `transom chaos`). */
static void apply_chaos(worker *w, int64_t step) {
  for (int i = 0; i < w->nchaos; i++) {
    chaos *c = &w->chaos[i];
    if (c->at != step) continue;
    fprintf(stderr, "worker %d: chaos: %s at step %lld\n", w->slot, c->fault, (long long)step);
    fflush(stderr);
    SEND(w, "FIRED slot=%d at=%lld fault=%s", w->slot, (long long)c->at, c->fault);
    if (strcmp(c->fault, "kill") == 0) raise(SIGKILL);
    if (strcmp(c->fault, "hang") == 0) /* the training thread stops; the heartbeat goes on */
      for (;;) sleep(1);
    if (strcmp(c->fault, "bitflip") == 0) { /* silent data corruption in this replica only */
      trainer_buffers b;
      if (trainer_buffers_get(w->t, &b) == 0) { /* never push a mirror that missed the device's state */
        uint32_t bits;
        memcpy(&bits, &b.params[b.n / 2], 4);
        bits ^= 1u << 20;
        memcpy(&b.params[b.n / 2], &bits, 4);
        trainer_buffers_put(w->t);
      }
    }
    if (strcmp(c->fault, "slow") == 0) {
      w->slow_ms = c->ms;
      w->slow_until = c->steps > 0 ? step + c->steps : INT64_MAX;
    }
    if (strcmp(c->fault, "nan") == 0) w->nan_until = step + (c->steps > 0 ? c->steps : 1);
  }
}

static int welcome(worker *w, char *line, size_t n) {
  char host[256];
  gethostname(host, sizeof host);
  int rc = proto_send(w->opfd, "HELLO slot=%d pid=%d host=%s", w->slot, (int)getpid(), host);
  if (rc) return rc;
  for (;;) {
    rc = proto_read(&w->rd, line, n, 120000);
    if (rc <= 0) return rc ? rc : tr_fail(TR_EIO, "the operator closed the connection");
    if (proto_is(line, "WELCOME")) return TR_OK;
    if (proto_is(line, "REFUSE")) {
      char why[256];
      proto_get(line, "why", why, sizeof why);
      return tr_fail(TR_ESTATE, "the operator refused slot %d: %s", w->slot, why);
    }
  }
}

int worker_main(int argc, char **argv) {
  worker w = {.slot = -1, .opfd = -1, .send_mu = PTHREAD_MUTEX_INITIALIZER};
  const char *opaddr = NULL;
  for (int i = 0; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(usage, stdout);
      return 0;
    } else if (strcmp(argv[i], "--operator") == 0 && i + 1 < argc) {
      opaddr = argv[++i];
    } else if (strcmp(argv[i], "--slot") == 0 && i + 1 < argc) {
      w.slot = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      w.threads = atoi(argv[++i]);
    } else {
      fprintf(stderr, "transom worker: unexpected argument '%s'\n%s", argv[i], usage);
      return 2;
    }
  }
  /* external launchers */
  const char *rank = env_any("RANK", "SLURM_PROCID");
  if (w.slot < 0 && rank) w.slot = atoi(rank);
  char envaddr[300];
  if (!opaddr && env_any("MASTER_ADDR", NULL) && env_any("MASTER_PORT", NULL)) {
    snprintf(envaddr, sizeof envaddr, "%s:%s", getenv("MASTER_ADDR"), getenv("MASTER_PORT"));
    opaddr = envaddr;
  }
  if (w.slot < 0 || !opaddr) {
    fputs(usage, stderr);
    return 2;
  }
  if (net_split(opaddr, w.op_host, sizeof w.op_host, &w.op_port)) {
    fprintf(stderr, "transom worker: %s\n", tr_error());
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);

  char line[PROTO_LINE_MAX], run[1024], coord[300], donor_addr[300], mode[16];
  lua_State *L = NULL;
  trainer *t = NULL;
  ckpt_engine *ck = NULL;
  donor *dn = NULL;
  ftar_member *fm = NULL;
  int donor_fd = -1, rc = 0, exit_code = 1;
  w.opfd = net_connect(w.op_host, w.op_port, 60.0);
  w.rd.fd = w.opfd;
  if (w.opfd < 0 || (rc = welcome(&w, line, sizeof line))) goto fail;
  proto_get(line, "run", run, sizeof run);
  proto_get(line, "coord", coord, sizeof coord);
  proto_get(line, "mode", mode, sizeof mode);
  proto_get(line, "donor", donor_addr, sizeof donor_addr);
  if (!w.threads) w.threads = (int)proto_int(line, "threads", 1);

  /* the job, as the operator resolved it */
  char path[1200], setthreads[32];
  snprintf(path, sizeof path, "%s/job.lua", run);
  snprintf(setthreads, sizeof setthreads, "threads=%d", w.threads);
  const char *sets[] = {setthreads};
  job_config cfg;
  L = lua_host_new();
  if (!L || (rc = job_load(L, path, sets, 1, &cfg))) goto fail;
  t = trainer_create(L, &cfg);
  if (!t) goto fail;
  w.t = t;
  trainer_set_slot(t, w.slot);
  trainer_set_data_skip(t, proto_int(line, "data_skip", 0));
  { /* updates the operator said to drop: skips=STEP,STEP */
    char sk[1024];
    proto_get(line, "skips", sk, sizeof sk);
    for (char *p = sk; *p;) {
      char *end;
      long long at = strtoll(p, &end, 10);
      if (end == p) break;
      trainer_skip_update(t, at);
      p = *end == ',' ? end + 1 : end;
    }
  }
  { /* live learning-rate changes so far: lr=STEP:VALUE,STEP:VALUE */
    char lrs[1024];
    proto_get(line, "lr", lrs, sizeof lrs);
    for (char *p = lrs; *p;) {
      char *end;
      long long at = strtoll(p, &end, 10);
      if (*end != ':') break;
      double v = strtod(end + 1, &p);
      trainer_set_lr(t, at, (float)v);
      if (*p == ',') p++;
    }
  }
  int64_t resume_step = proto_int(line, "resume_step", -1);

  /* checkpoints: every replica can lead, so every replica has the engine */
  if (cfg.ckpt_every_steps > 0 || cfg.ckpt_every_seconds > 0) {
    snprintf(path, sizeof path, "%s/ckpt", run);
    ckpt_opts o = {path, (size_t)cfg.ckpt_map_mb << 20, (int)cfg.ckpt_keep_last, (int)cfg.ckpt_keep_every,
                   strcmp(cfg.ckpt_when_busy, "skip") == 0 ? CKPT_SKIP : CKPT_COALESCE};
    ck = ckpt_open(&o);
    if (!ck || (rc = trainer_ckpt_attach(t, ck))) goto fail;
  }
  /* state */
  double t_state = tr_now();
  if (strcmp(mode, "resume") == 0 && ck) {
    char report[2048] = "";
    ckpt_reader *r = ckpt_engine_reader(ck);
    rc = r ? trainer_ckpt_load(t, r, resume_step, report, sizeof report) : TR_ENOMEM;
    ckpt_reader_close(r);
    if (report[0]) fputs(report, stderr);
    if (rc) goto fail;
  } else if (strcmp(mode, "join") == 0) {
    char dh[256];
    int dp;
    if ((rc = net_split(donor_addr, dh, sizeof dh, &dp)) || (rc = donor_fetch_snapshot(dh, dp, t, &donor_fd))) goto fail;
    const char *delay = getenv("TRANSOM_TEST_CATCHUP_DELAY_MS"); /* widens the window for fault tests */
    if (delay) usleep((useconds_t)atoi(delay) * 1000);
    int applied = donor_catch_up(donor_fd, t, 0);
    if (applied < 0) {
      rc = applied;
      goto fail;
    }
    trainer_state ts;
    trainer_get_state(t, &ts);
    fprintf(stderr, "worker %d: caught up from %s: at step %lld after replaying %d steps\n", w.slot, donor_addr,
            (long long)ts.step, applied);
  }
  double state_s = tr_now() - t_state;

  /* the address peers reach us at: TRANSOM_HOST on multi-node launches */
  const char *me = env_any("TRANSOM_HOST", NULL);
  if (!me) me = "127.0.0.1";
  int dport = 0;
  dn = donor_start(me, t, 64, &dport);
  if (!dn) goto fail;
  char ch[256];
  int cp;
  if ((rc = net_split(coord, ch, sizeof ch, &cp))) goto fail;
  ftar_member_opts fo;
  ftar_member_opts_default(&fo);
  fo.timeout = 3600; /* below min_replicas training pauses until replacements come */
  fo.deadline = cfg.deadline;
  fo.min_members = (int)cfg.min_replicas;
  fo.data_host = me;
  fo.strict_seq = 1; /* a joiner must enter at exactly its own step */
  fm = ftar_member_create(ch, cp, w.slot, &fo);
  if (!fm) goto fail;
  trainer_state ts0; /* where training is: no state leaves the device for this */
  trainer_get_state(t, &ts0);
  rc = SEND(&w, "READY slot=%d step=%lld donor=%s:%d state_s=%.3f", w.slot, (long long)ts0.step, me, dport, state_s);
  if (rc) goto fail;
  w.phase_since = tr_now();
  if (pthread_create(&w.hb, NULL, heartbeat_main, &w) != 0) {
    rc = tr_fail(TR_ENOMEM, "cannot start the heartbeat thread");
    goto fail;
  }
  if (strcmp(mode, "join") != 0) ftar_member_wait(fm, (int)cfg.replicas, 30.0); /* start together if we can */

  int64_t step = ts0.step, last_snap = ts0.step;
  int leader = 0;
  while (step < cfg.max_steps) {
    if ((rc = poll_commands(&w))) goto fail;
    if (w.stop_at > 0 && step >= w.stop_at) break;
    double t_step = tr_now(); /* the step's wall time: a slow replica's delay is its own compute time */
    apply_chaos(&w, step + 1);
    if (step + 1 <= w.slow_until && w.slow_ms > 0) usleep((useconds_t)w.slow_ms * 1000);
    step_stats st;
    if ((rc = trainer_compute_grads(t, &st))) goto fail;
    const tr_backend *be = trainer_backend(t);
    float *g = trainer_grads(t); /* the backend's memory: FTAR moves it with the device's communicator */
    if (step + 1 <= w.nan_until) {
      const float nan = st.loss = __builtin_nanf("");
      if ((rc = be->upload(g, &nan, sizeof nan))) goto fail;
    }
    double t_ar = tr_now();
    w.phase_since = t_ar;
    w.in_allreduce = 1;
    ftar_result res;
    rc = ftar_allreduce_dev(fm, be, g, (size_t)trainer_grads_size(t), FTAR_MEAN, (uint64_t)step + 1, &res);
    w.phase_since = tr_now();
    w.in_allreduce = 0;
    if (rc == FTAR_ESEQ && donor_fd >= 0 && res.seq > (uint64_t)step + 1) {
      /* the group moved on while we caught up: replay the rest, recompute */
      int applied = donor_catch_up(donor_fd, t, (int64_t)res.seq - 1);
      if (applied < 0) {
        rc = applied;
        goto fail;
      }
      trainer_get_state(t, &ts0);
      step = ts0.step;
      continue;
    }
    if (rc < 0) goto fail;
    double ar_s = tr_now() - t_ar;
    if (donor_wants(dn, step + 1)) { /* a joiner is catching up: keep the reduced gradients for it */
      const float *hg = trainer_grads_host(t);
      if (!hg) {
        rc = TR_EIO;
        goto fail;
      }
      donor_record(dn, step + 1, hg);
    }
    if ((rc = trainer_apply_grads(t, &st))) goto fail;
    donor_boundary(dn);
    step = st.step;
    if (donor_fd >= 0) { /* in the ring: the donor can stop recording for us */
      donor_close(donor_fd);
      donor_fd = -1;
    }
    leader = res.contributors <= 1 || res.slots[0] == w.slot;
    if (ck && leader) {
      int due = (cfg.ckpt_every_steps > 0 && step % cfg.ckpt_every_steps == 0) || w.ckpt_now ||
                step == cfg.max_steps || (w.stop_at > 0 && step >= w.stop_at);
      w.ckpt_now = 0;
      if (due) {
        ckpt_state cs;
        trainer_ckpt_state(t, &cs);
        ckpt_snapshot(ck, &cs);
        last_snap = step;
      }
    }
    ckpt_event ev;
    while (ckpt_poll(ck, &ev)) {
      char what[600];
      proto_escape(ev.what, what, sizeof what);
      SEND(&w, "CKPT slot=%d step=%lld ok=%d commit_ms=%.1f what=%s", w.slot, (long long)ev.step, ev.ok,
           ev.commit_s * 1e3, what);
    }
    if (leader && ((cfg.eval_interval > 0 && step % cfg.eval_interval == 0) || step == cfg.max_steps)) {
      float val;
      if ((rc = trainer_eval(t, &val))) goto fail;
      SEND(&w, "EVAL slot=%d step=%lld val=%.9g", w.slot, (long long)step, val);
    }
    double wall_s = tr_now() - t_step;
    char crc[32] = "";
    if (cfg.checksum_interval > 0 && step % cfg.checksum_interval == 0)
      snprintf(crc, sizeof crc, " crc=%08x", trainer_param_crc(t));
    rc = SEND(&w,
              "STEP slot=%d step=%lld loss=%.9g norm=%.9g lr=%.9g ms=%.3f tok_s=%.1f ar_ms=%.3f ckpt_ms=%.3f "
              "data_ms=%.3f fwd_ms=%.3f bwd_ms=%.3f opt_ms=%.3f rss=%zu epoch=%llu n=%d redos=%d leader=%d "
              "skipped=%d%s",
              w.slot, (long long)step, st.loss, st.grad_norm, st.lr, wall_s * 1e3, st.tokens / wall_s, ar_s * 1e3, st.t_ckpt_wait * 1e3, st.t_data * 1e3, st.t_fwd * 1e3,
              st.t_bwd * 1e3, st.t_opt * 1e3, tr_current_rss(), (unsigned long long)res.epoch, res.contributors,
              res.redos, leader, st.skipped, crc);
    if (rc) goto fail;
  }
  if (ck && leader && last_snap != step) { /* stopped: the state to resume from */
    ckpt_state cs;
    trainer_ckpt_state(t, &cs);
    ckpt_wait_copy(ck);
    ckpt_snapshot(ck, &cs);
  }
  ckpt_flush(ck);
  ckpt_event ev;
  while (ckpt_poll(ck, &ev))
    SEND(&w, "CKPT slot=%d step=%lld ok=%d commit_ms=%.1f what=-", w.slot, (long long)ev.step, ev.ok,
         ev.commit_s * 1e3);
  if (leader && step == cfg.max_steps && trainer_save(t, run) == 0) /* all hold the same bits: one writes */
    SEND(&w, "SAVED slot=%d step=%lld", w.slot, (long long)step);
  SEND(&w, "DONE slot=%d step=%lld crc=%08x", w.slot, (long long)step, trainer_param_crc(t));
  exit_code = 0;
  goto done;
fail:
  fprintf(stderr, "transom worker %d: %s\n", w.slot, tr_error());
  if (w.opfd >= 0) {
    char why[600];
    proto_escape(tr_error(), why, sizeof why);
    SEND(&w, "FAIL slot=%d why=%s", w.slot, why);
  }
  exit_code = rc == FTAR_EEVICTED ? 3 : 1;
done:
  if (w.hb) {
    w.hb_stop = 1;
    pthread_join(w.hb, NULL);
  }
  donor_close(donor_fd);
  ftar_member_free(fm);
  donor_stop(dn);
  ckpt_close(ck);
  trainer_free(t);
  lua_host_close(L);
  if (w.opfd >= 0) close(w.opfd);
  return exit_code;
}
