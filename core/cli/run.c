/* run.c — `transom run`: the command. It parses the arguments, loads and
 * checks the job, prepares the run directory (job.lua, vocabulary, logs,
 * checkpoints, resume) and then either hands the job to the operator
 * (replicas > 1, core/fleet) or the pipeline launcher (pipeline_run.c;
 * then it makes the closing sample from the weights stage 0 saved:
 * run_sample, which `transom sample` uses too) or trains alone through the
 * one training loop (core/train/loop.c) with hooks that print, write
 * metrics.jsonl and events.jsonl, and stop on a signal.
 *
 *   transom run JOB.lua [--set key=value]...
 *   transom run --resume RUN [--set key=value]...
 *
 * Errors in the job (bad job, bad data, a run directory that holds an
 * earlier run without --resume, or that a live job trains in (a lone
 * run's RUN/run.lock, an operator that answers on RUN/control.sock), a
 * checkpoint.remote that cannot be written, hosts without MASTER_ADDR)
 * exit 2 with nothing written; a new run
 * writes RUN/job.lua first, so a start that fails or is killed after that
 * (the checkpoint store cannot open, a disk full, a SIGTERM before the
 * handler) leaves a directory `--resume` continues. SIGINT/SIGTERM during
 * training checkpoint now and exit 0, so `--resume` carries on exactly
 * where the run stopped.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "version.h"
#include "backend.h"
#include "bpe.h"
#include "ckpt.h"
#include "job.h"
#include "kernels.h"
#include "loop.h"
#include "lua_graph.h"
#include "lua_host.h"
#include "operator.h"
#include "pipeline.h"
#include "run.h"
#include "step_record.h"
#include "trainer.h"
#include "util.h"

static volatile sig_atomic_t stop_requested;
static void on_stop(int sig) {
  (void)sig;
  stop_requested = 1;
}

static const char run_usage[] =
    "usage: transom run JOB.lua [--set key=value]...\n"
    "       transom run --resume RUN [--set key=value]...\n"
    "       transom run JOB.lua --replicas N   (same as --set replicas=N)\n"
    "\n"
    "Trains the model the job file describes. The job file returns a table;\n"
    "every key is checked. --set overrides any key (repeatable; nested keys\n"
    "as checkpoint.every_steps=1). Output goes to the run directory: job.lua\n"
    "(resolved job), vocab.json, metrics.jsonl, events.jsonl, ckpt/ (LMDB\n"
    "checkpoints), model.safetensors. SIGINT/SIGTERM checkpoint and stop;\n"
    "--resume RUN continues from the newest intact checkpoint. Without\n"
    "--resume, a run directory that holds a run (its job.lua, or checkpoints\n"
    "without one) or another job.lua is refused. A new run writes job.lua\n"
    "first: a start that failed is continued with --resume. A directory a\n"
    "live run trains in is refused, --resume too (a hung operator is taken\n"
    "over).\n"
    "\n"
    "Job keys (name, type, default, meaning):\n";

typedef struct {
  job_config cfg;
  trainer *t;
  ckpt_engine *ck;
  char dir[PATH_MAX - 64];
  FILE *metrics, *events;
  int lock_fd; /* RUN/run.lock (take_lock), never closed: held until the process ends */
  int gate_fd; /* RUN/start.lock, flock'd while this start checks and claims RUN (gate_take); -1: not held */
  char made[PATH_MAX - 64]; /* the topmost directory of RUN's path that gate_take made ("": none) */
  int pad_ms;  /* TRANSOM_TEST_STEP_MS (tests): every step sleeps this long first, as a worker's do */
  /* the hooks' figures */
  double sum_time, sum_tokens;
  int64_t timed, first;
  int width;
} run_ctx;

static int take_lock(run_ctx *r); /* RUN/run.lock: "another job in the run directory" below */
static void gate_release(run_ctx *r);

/* --- the run directory's logs --- */


/* One line of events.jsonl: {"time", "step", "kind", "detail"} */
static void event(run_ctx *r, int64_t step, const char *kind, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void event(run_ctx *r, int64_t step, const char *kind, const char *fmt, ...) {
  if (!r->events) return;
  char detail[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  tr_event_line(r->events, step, 0, kind, detail);
}

static int path_in(const run_ctx *r, const char *file, char *out, size_t n) {
  return snprintf(out, n, "%s/%s", r->dir, file) < (int)n ? 0 : tr_fail(TR_EINVAL, "path too long");
}

/* Keeps the metrics of steps <= step (a resumed run re-does the rest). */
static int truncate_metrics(run_ctx *r, int64_t step) {
  char path[PATH_MAX];
  path_in(r, "metrics.jsonl", path, sizeof path);
  int dropped = 0, rc = tr_jsonl_keep_until(path, step, &dropped);
  if (!rc && dropped) event(r, step, "resume_truncated_metrics", "dropped %d metric lines after step %lld", dropped,
                            (long long)step);
  return rc;
}

/* --- the loop's hooks for a lone process --- */

static int lone_poll(void *ud, loop_control *c) {
  const run_ctx *r = ud;
  if (r->pad_ms > 0) usleep((useconds_t)r->pad_ms * 1000);
  c->stop = stop_requested;
  return 0;
}

static int lone_report(void *ud, const step_record *rec) {
  run_ctx *r = ud;
  const job_config *cfg = &r->cfg;
  if (rec->step > r->first + 1) { /* the first step warms caches and thread pools */
    r->sum_time += rec->step_s;
    r->sum_tokens += rec->tokens_per_s * rec->step_s;
    r->timed++;
  }
  if (rec->step % cfg->log_interval == 0 || rec->step == cfg->max_steps)
    printf("step %*lld/%lld | loss %.4f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s\n", r->width, (long long)rec->step,
           (long long)cfg->max_steps, rec->loss, rec->lr, rec->grad_norm, rec->step_s * 1e3, rec->tokens_per_s);
  step_record_json(r->metrics, rec);
  fflush(r->metrics);
  fflush(stdout);
  return 0;
}

static int lone_eval(void *ud, int64_t step, float val) {
  run_ctx *r = ud;
  printf("step %*lld/%lld | val loss %.4f\n", r->width, (long long)step, (long long)r->cfg.max_steps, val);
  fprintf(r->metrics, "{\"step\":%lld,\"val_loss\":%.9g}\n", (long long)step, val);
  fflush(r->metrics);
  return 0;
}

static void lone_ckpt_event(void *ud, const ckpt_event *ev) {
  run_ctx *r = ud;
  if (ev->ok && ev->remote) {
    event(r, ev->step, "checkpoint_remote", "replicated %.1f MiB to %s in %.1f s", ev->bytes / 1048576.0,
          r->cfg.ckpt_remote, ev->commit_s);
  } else if (ev->ok) {
    event(r, ev->step, "checkpoint", "committed %.1f MiB: copy %.1f ms, commit %.1f ms", ev->bytes / 1048576.0,
          ev->copy_s * 1e3, ev->commit_s * 1e3);
  } else if (ev->remote) {
    event(r, ev->step, "checkpoint_remote_failed", "%s", ev->what);
    fprintf(stderr, "transom: remote copy of checkpoint %lld failed: %s (training continues)\n", (long long)ev->step,
            ev->what);
  } else {
    event(r, ev->step, "checkpoint_failed", "%s", ev->what);
    fprintf(stderr, "transom: checkpoint of step %lld failed: %s (training continues; older checkpoints stay)\n",
            (long long)ev->step, ev->what);
  }
}

static int open_ckpt(run_ctx *r) {
  const job_config *c = &r->cfg;
  if (c->ckpt_every_steps == 0 && c->ckpt_every_seconds == 0) return TR_OK;
  char path[PATH_MAX];
  path_in(r, "ckpt", path, sizeof path);
  ckpt_opts o = {path, (size_t)c->ckpt_map_mb << 20, (int)c->ckpt_keep_last, (int)c->ckpt_keep_every,
                 strcmp(c->ckpt_when_busy, "skip") == 0 ? CKPT_SKIP : CKPT_COALESCE};
  r->ck = ckpt_open(&o);
  if (!r->ck && c->ckpt_remote[0] && ckpt_store_damaged(path)) { /* the remote level still has them */
    char aside[PATH_MAX + 32];
    snprintf(aside, sizeof aside, "%s.damaged-%lld", path, (long long)time(NULL));
    if (rename(path, aside) == 0) {
      fprintf(stderr, "transom: the checkpoint store %s is damaged (%s); moved to %s: the remote level %s still "
              "holds the checkpoints\n", path, tr_error(), aside, c->ckpt_remote);
      r->ck = ckpt_open(&o);
    }
  }
  if (!r->ck) return tr_fail_prefix(TR_EIO, "checkpoints");
  return trainer_ckpt_attach(r->t, r->ck);
}

/* --- a sample from the saved weights --- */

int run_sample(const char *dir, const char *prompt, long long ntok, double temp, long long seed, FILE *out) {
  char path[PATH_MAX];
  lua_State *L = lua_host_new();
  if (!L) return TR_ENOMEM;
  job_config cfg;
  vocab v;
  int64_t nvocab = 0;
  bpe *tok = NULL;
  graph *g = NULL;
  int rc;
  snprintf(path, sizeof path, "%s/job.lua", dir);
  if ((rc = job_load(L, path, NULL, 0, &cfg))) goto done;
  snprintf(path, sizeof path, "%s/vocab.json", dir);
  if ((rc = vocab_load_any(&v, &nvocab, path))) goto done;
  snprintf(path, sizeof path, "%s/tokenizer.bpe", dir);
  if (v.size == 0 && access(path, R_OK) == 0 && !(tok = bpe_load(path))) {
    rc = TR_EFORMAT;
    goto done;
  }
  kernels_set_threads(cfg.threads > 0 ? (int)cfg.threads : 1);
  if ((rc = model_build(L, cfg.lua_ref, v.size ? v.size : data_padded_vocab(nvocab), 1, 0, &g))) goto done;
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  if ((rc = model_load_params(g, path))) goto done;
  text_codec codec = {v.size ? &v : NULL, tok, nvocab};
  rc = model_generate(g, &codec, prompt ? prompt : cfg.sample_prompt, ntok, (float)temp,
                      seed >= 0 ? (uint64_t)seed : (uint64_t)cfg.seed, out);
done:
  graph_free(g);
  bpe_free(tok);
  lua_host_close(L);
  return rc;
}

/* --- several replicas (the operator) or pipeline stages (core/fleet/pipeline_run.c) --- */

/* A pipelined --resume is checked (the stores against the job's stages,
 * the saved plan) before job.lua takes the --set values: a refused one
 * leaves the run as it was. */
static int run_replicas(lua_State *L, run_ctx *r, const char *dump, int resume, int pipeline) {
  char path[PATH_MAX];
  pipeline_resume pr;
  if (pipeline && resume && pipeline_resume_check(&r->cfg, r->dir, &pr)) {
    fprintf(stderr, "transom: %s\n", tr_error());
    trainer_free(r->t);
    r->t = NULL;
    return 1;
  }
  int rc = tr_mkdirs(r->dir); /* without a checkpoint the operator starts from step 0 */
  if (!rc && pipeline) rc = take_lock(r); /* one launcher: no takeover (an operator is probed: check_in_use) */
  if (pipeline) gate_release(r); /* later starts see the lock */
  if (!rc) {
    path_in(r, "job.lua", path, sizeof path);
    rc = tr_write_file_atomic(path, dump, strlen(dump));
  }
  if (!rc && !resume) rc = trainer_save(r->t, r->dir); /* vocabulary, initial weights */
  trainer_free(r->t); /* the operator does not train: the workers do */
  r->t = NULL;
  if (rc) {
    fprintf(stderr, "transom: run directory: %s\n", tr_error());
    return 2;
  }
  printf("transom %s | job %s | run %s\n", TRANSOM_VERSION, r->cfg.path, r->dir);
  int stopped = 0;
  int gate = r->gate_fd;
  r->gate_fd = -1; /* the operator lets it go once RUN/control.sock listens */
  rc = pipeline ? pipeline_run(L, &r->cfg, r->dir, resume ? &pr : NULL, &stopped)
                : operator_run(L, &r->cfg, r->dir, resume, gate, &stopped);
  if (rc) fprintf(stderr, "transom: %s\n", tr_error());
  const job_config *c = &r->cfg;
  if (!rc && !stopped && c->sample_tokens > 0) { /* as a lone run's, from the weights the leader (stage 0) saved */
    printf("--- sample (%lld tokens, temperature %.2f) ---\n", (long long)c->sample_tokens, c->temperature);
    fflush(stdout);
    if ((rc = run_sample(r->dir, c->sample_prompt, c->sample_tokens, c->temperature, c->seed, stdout)))
      fprintf(stderr, "transom: sample: %s\n", tr_error());
  }
  printf("run directory: %s\n", r->dir);
  return rc ? 1 : 0;
}

/* --- the command --- */

static void close_run(run_ctx *r) {
  gate_release(r);
  ckpt_close(r->ck);
  if (r->metrics) fclose(r->metrics);
  if (r->events) fclose(r->events);
  trainer_free(r->t);
}

typedef struct {
  const char *job_path, *resume;
  const char **sets;
  int nsets;
  char resume_job[PATH_MAX], resume_dir[PATH_MAX + 16];
} run_args;

/* The first line job_dump writes: a job.lua without it is not a run's. */
static const char resolved_mark[] = "-- resolved job, written by transom";

/* Whether the job file at path is one transom wrote for a run (its first
 * line resolved_mark): 1, 0 (another file: the user's own job), or -1
 * when it cannot be read (a directory too: job_load names it). */
static int job_is_resolved(const char *path) {
  char line[64] = "";
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  int ours = fgets(line, sizeof line, f) ? strncmp(line, resolved_mark, strlen(resolved_mark)) == 0
                                         : (ferror(f) ? -1 : 0);
  fclose(f);
  return ours;
}

/* Whether paths a and b name one directory (the same text, or the same
 * real path). */
static int same_dir(const char *a, const char *b) {
  char ra[PATH_MAX], rb[PATH_MAX];
  return strcmp(a, b) == 0 || (realpath(a, ra) && realpath(b, rb) && strcmp(ra, rb) == 0);
}

/* The command line into a; 0 to go on, or the exit status (help: 0 with
 * *done set). */
static int parse_args(lua_State *L, run_args *a, int argc, char **argv, int *done) {
  static const char *const value_flags[] = {"--set", "--replicas", "--resume", NULL};
  *done = 0;
  for (int i = 0; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(run_usage, stdout);
      job_help(L);
      *done = 1;
      return 0;
    } else if (tr_flag_lacks_value(argc, argv, i, value_flags)) {
      fprintf(stderr, "transom run: %s needs a value (see transom run --help)\n", argv[i]);
      return 2;
    } else if (strcmp(argv[i], "--set") == 0) {
      a->sets[a->nsets++] = argv[++i];
    } else if (strncmp(argv[i], "--set=", 6) == 0) {
      a->sets[a->nsets++] = argv[i] + 6;
    } else if (strcmp(argv[i], "--replicas") == 0) {
      static char rep[64];
      snprintf(rep, sizeof rep, "replicas=%s", argv[++i]);
      a->sets[a->nsets++] = rep;
    } else if (strcmp(argv[i], "--resume") == 0) {
      a->resume = argv[++i];
    } else if (argv[i][0] == '-') {
      fprintf(stderr, "transom run: unknown option '%s' (see transom run --help)\n", argv[i]);
      return 2;
    } else if (!a->job_path) {
      a->job_path = argv[i];
    } else {
      fprintf(stderr, "transom run: one job file only ('%s' and '%s')\n", a->job_path, argv[i]);
      return 2;
    }
  }
  if (a->resume) { /* the job is the run's own */
    if (a->job_path) {
      fprintf(stderr, "transom run: --resume takes the job from %s/job.lua; give no job file\n", a->resume);
      return 2;
    }
    snprintf(a->resume_job, sizeof a->resume_job, "%s/job.lua", a->resume);
    snprintf(a->resume_dir, sizeof a->resume_dir, "run_dir=%s", a->resume);
    if (access(a->resume_job, R_OK) != 0) {
      fprintf(stderr, "transom run: --resume %s: no %s (not a run directory?)\n", a->resume, a->resume_job);
      return 2;
    }
    if (job_is_resolved(a->resume_job) == 0) { /* the user's own job file: a resume would overwrite it */
      fprintf(stderr, "transom run: --resume %s: %s is not a job written by transom (its first line is not \"%s\"): "
              "point --resume at a run directory\n", a->resume, a->resume_job, resolved_mark);
      return 2;
    }
    for (int i = 0; i < a->nsets; i++) /* the run stays where it is: --set run_dir would be overridden unseen */
      if (strncmp(a->sets[i], "run_dir=", 8) == 0 && !same_dir(a->sets[i] + 8, a->resume)) {
        fprintf(stderr, "transom run: --set %s: a resumed run stays in its run directory (%s): drop the --set, or "
                "resume the run in %s\n", a->sets[i], a->resume, a->sets[i] + 8);
        return 2;
      }
    a->job_path = a->resume_job;
    a->sets[a->nsets++] = a->resume_dir;
  }
  if (!a->job_path) {
    fputs(run_usage, stderr);
    return 2;
  }
  return 0;
}

/* Replicas on this host get a device each (slot k takes device k: two on
 * one GPU cannot share an NCCL communicator): a job with more replicas than
 * devices is refused here, before any replica starts. */
static int check_devices(const run_ctx *r, const tr_backend *be) {
  if (!be->devices) return 0;
  int n = be->devices();
  if (n < 0) {
    char why[512];
    snprintf(why, sizeof why, "%s", be->error());
    return tr_fail(TR_EINVAL, "%s: key 'device': device = \"%s\": %s", r->cfg.path, r->cfg.device, why);
  }
  if (n > 0 && r->cfg.replicas > n) {
    const char *vis = strcmp(be->name, "cuda") == 0 ? getenv("CUDA_VISIBLE_DEVICES") : NULL;
    return tr_fail(TR_EINVAL,
                   "%s: key 'replicas': %lld replicas need a device each, but %d %s device(s) are visible on this "
                   "host%s%s%s: set replicas to %d or less",
                   r->cfg.path, (long long)r->cfg.replicas, n, be->name, vis ? " (CUDA_VISIBLE_DEVICES=" : "",
                   vis ? vis : "", vis ? ")" : "", n);
  }
  return 0;
}

/* The job's trainer: the operator computes nothing, so its trainer (the
 * initial weights) stays on the host; its device must still load, with a
 * device for every replica. */
static int make_trainer(lua_State *L, run_ctx *r) {
  if (r->cfg.replicas <= 1) return (r->t = trainer_create(L, &r->cfg)) ? 0 : TR_EINVAL;
  const tr_backend *be = backend_load(r->cfg.device);
  if (!be) return tr_fail_prefix(TR_EINVAL, "%s: key 'device'", r->cfg.path);
  int rc = check_devices(r, be);
  if (rc) return rc;
  job_config host = r->cfg;
  snprintf(host.device, sizeof host.device, "cpu");
  return (r->t = trainer_create(L, &host)) ? 0 : TR_EINVAL;
}

/* run_dir, or runs/<name>-<time>[-N]. */
static void choose_dir(run_ctx *r) {
  if (r->cfg.run_dir[0]) {
    snprintf(r->dir, sizeof r->dir, "%s", r->cfg.run_dir);
    return;
  }
  char stamp[32];
  time_t now = time(NULL);
  struct tm tm;
  localtime_r(&now, &tm);
  strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &tm);
  snprintf(r->dir, sizeof r->dir, "runs/%s-%s", r->cfg.name, stamp);
  for (int i = 2; access(r->dir, F_OK) == 0 && i < 1000; i++)
    snprintf(r->dir, sizeof r->dir, "runs/%s-%s-%d", r->cfg.name, stamp, i);
}

/* Whether the checkpoint store at path holds a committed checkpoint: 1, 0
 * (none: an empty directory, a store whose first checkpoint never
 * committed), or TR_EIO when it cannot be read (a damaged store: its
 * checkpoints may be an earlier run's). */
static int store_has_checkpoint(const char *path) {
  ckpt_reader *rd = ckpt_reader_open(path);
  if (!rd) return ckpt_store_damaged(path) ? TR_EIO : 0; /* no data.mdb, or no checkpoint ever made one */
  int64_t step;
  int n = ckpt_reader_steps(rd, &step, 1);
  ckpt_reader_close(rd);
  return n < 0 ? TR_EIO : n > 0;
}

/* Without --resume the run directory must hold no earlier run, or a later
 * --resume would load the old run's checkpoints under this job. A run is
 * its job.lua (written first, before the store opens): one of transom's
 * (its first line resolved_mark) is refused with the --resume hint,
 * another job file is refused as such (the run would overwrite it). With
 * no job.lua, a checkpoint store (ckpt/, a pipeline's ckpt-stage-N/) is
 * refused only when it holds a committed checkpoint or cannot be read;
 * else it is what a start that failed before job.lua left (older builds
 * opened the store first), and the run reuses it. Any other file is left
 * alone. Returns 0 or TR_EINVAL (message set). */
static int check_new_dir(const run_ctx *r) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/job.lua", r->dir);
  int ours = job_is_resolved(path);
  if (ours >= 0 || access(path, F_OK) == 0) {
    if (ours > 0)
      return tr_fail(TR_EINVAL, "run directory %s already holds a run (%s): continue it with `transom run --resume "
                     "%s`, or give another run_dir (or remove this one)", r->dir, path, r->dir);
    return tr_fail(TR_EINVAL, "run directory %s holds another job file (%s, not a job.lua that transom wrote for a "
                   "run): the run would overwrite it with its resolved job; give another run_dir", r->dir, path);
  }
  DIR *d = opendir(r->dir);
  int rc = 0;
  for (struct dirent *e; d && !rc && (e = readdir(d));) {
    if (strcmp(e->d_name, "ckpt") != 0 && strncmp(e->d_name, "ckpt-stage-", 11) != 0) continue;
    snprintf(path, sizeof path, "%s/%s", r->dir, e->d_name);
    int held = store_has_checkpoint(path);
    if (held > 0)
      rc = tr_fail(TR_EINVAL, "run directory %s holds the checkpoints of an earlier run (%s) but no job.lua to "
                   "resume it with: give another run_dir (or remove this one)", r->dir, path);
    else if (held < 0)
      rc = tr_fail(TR_EINVAL, "run directory %s holds a checkpoint store that cannot be read (%s) and no job.lua: "
                   "give another run_dir (or remove this one)", r->dir, path);
  }
  if (d) closedir(d);
  return rc;
}

/* --- another job in the run directory --- */

/* How long a live operator has to answer on RUN/control.sock: not scaled
 * by anything (an operator's loop that stalls this long counts as hung). */
#define PROBE_S 2.5

/* A lone run, or a pipeline's launcher, holds an advisory lock (flock) on
 * RUN/run.lock for its whole life, its pid written in the file: another
 * run in the directory is refused while it is held, and the kernel
 * releases it however the process ends (a kill -9 too). O_CLOEXEC: no
 * worker it starts keeps it. An operator takes none: a stopped or hung
 * one must stay possible to take over (check_in_use). */
#define RUN_LOCK "run.lock"

/* The pid written in a lock file (0: none yet, or unreadable). */
static int lock_pid(int fd) {
  char text[32] = "";
  ssize_t n = pread(fd, text, sizeof text - 1, 0);
  return n > 0 ? atoi(text) : 0;
}

static int in_use_by(const char *dir, int pid) {
  if (pid > 0)
    return tr_fail(TR_EINVAL, "%s is in use by a running transom (pid %d): stop it first (kill -TERM %d: it "
                   "checkpoints and exits)", dir, pid, pid);
  return tr_fail(TR_EINVAL, "%s is in use by a running transom (it holds %s/" RUN_LOCK "): stop it first", dir, dir);
}

/* Whether a live process holds dir's lock: its pid into *pid. A shared
 * lock tried and let go at once: it conflicts only with a holder. */
static int lock_held(const char *dir, int *pid) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/" RUN_LOCK, dir);
  int fd = open(path, O_RDONLY | O_CLOEXEC), held = 0;
  if (fd < 0) return 0; /* none: no lone run was ever here */
  if (flock(fd, LOCK_SH | LOCK_NB) == 0) flock(fd, LOCK_UN);
  else if ((held = errno == EWOULDBLOCK)) *pid = lock_pid(fd);
  close(fd);
  return held;
}

/* Test hook TRANSOM_TEST_FLOCK_ERRNO=NAME (ENOSYS, ENOLCK, EOPNOTSUPP,
 * EINVAL, EIO) or a number: take_lock's flock fails with it, as on a
 * filesystem without locks (Lustre mounted without flock: ENOSYS; NFSv3
 * without lockd: ENOLCK). */
static int test_flock_errno(void) {
  const char *v = getenv("TRANSOM_TEST_FLOCK_ERRNO");
  if (!v || !*v) return 0;
  static const struct { const char *name; int e; } names[] = {
    {"ENOSYS", ENOSYS}, {"ENOLCK", ENOLCK}, {"EOPNOTSUPP", EOPNOTSUPP}, {"EINVAL", EINVAL}, {"EIO", EIO}};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (strcmp(v, names[i].name) == 0) return names[i].e;
  return atoi(v);
}

/* flock, or the test hook's failure. */
static int lock_ex(int fd) {
  int e = test_flock_errno();
  if (e) {
    errno = e;
    return -1;
  }
  return flock(fd, LOCK_EX | LOCK_NB);
}

/* Errors of a filesystem that has no locks at all (not of a lock held). */
static int no_locks(int e) { return e == ENOSYS || e == ENOLCK || e == EOPNOTSUPP || e == EINVAL; }

/* Takes r->dir's lock (the directory exists), before the run writes
 * anything else there; refused (TR_EINVAL, message set) while another
 * holds it. A few tries: a lock_held of another start holds it shared
 * for an instant. On a filesystem without locks the run goes on,
 * unprotected, after one warning. */
static int take_lock(run_ctx *r) {
  char path[PATH_MAX];
  path_in(r, RUN_LOCK, path, sizeof path);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return tr_fail(TR_EIO, "cannot open %s: %s", path, strerror(errno));
  for (int i = 0; lock_ex(fd) != 0; i++) {
    if (no_locks(errno)) {
      fprintf(stderr, "transom: warning: %s: this filesystem has no locks (%s): two runs in %s are not prevented\n",
              path, strerror(errno), r->dir);
      break; /* the fd is kept all the same: the pid is for messages */
    }
    if (errno != EWOULDBLOCK || i == 20) {
      int rc = errno == EWOULDBLOCK ? in_use_by(r->dir, lock_pid(fd))
                                    : tr_fail(TR_EIO, "cannot lock %s: %s", path, strerror(errno));
      close(fd);
      return rc;
    }
    usleep(25000);
  }
  char pid[32];
  int n = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)n, 0) != n) { /* the pid is for messages: the lock holds */
  }
  r->lock_fd = fd;
  return 0;
}

/* --- the start gate ---
 * check_in_use looks for a live job in RUN; only afterwards does a start
 * take what later starts look for (RUN/run.lock; an operator's
 * RUN/control.sock). Another start that looked in between saw nothing
 * either, and went on too: two jobs in one run directory (an operator
 * takes no lock, so an operator beside a lone run, or two operators). So
 * each start holds an exclusive flock on RUN/start.lock from before
 * check_new_dir until that claim is visible: a lone run or a pipeline's
 * launcher lets it go once it holds RUN/run.lock, an operator once
 * RUN/control.sock listens (operator_run); the kernel lets it go however
 * the process ends. A start that finds it held waits while the holder runs
 * (it may be probing a hung operator, or saving a big model's first
 * weights), at most GATE_MAX_S; GATE_WAIT_S for a holder that is stopped
 * or cannot be told. A new RUN is made for the lock file, and removed
 * again (with the parents the start made) when the start is refused; the
 * lock file is never removed otherwise (a start waiting on a removed one
 * sees it is gone and opens the new one), nor where the path holds "."
 * or "..". A filesystem without locks has no gate: take_lock warns there,
 * and gate_take for an operator's start (which takes no run.lock). */
#define START_LOCK "start.lock"
#define GATE_WAIT_S 30.0
#define GATE_MAX_S 600.0

/* Test hook TRANSOM_TEST_START_PAUSE=FILE: a start says "start paused"
 * after its checks, before it claims RUN, and waits (up to 120 s) until
 * FILE exists, so a test can run a second start into that window. */
static void test_start_pause(void) {
  const char *v = getenv("TRANSOM_TEST_START_PAUSE");
  if (!v || !*v) return;
  fprintf(stderr, "transom: test: start paused until %s exists\n", v);
  for (int i = 0; i < 12000 && access(v, F_OK) != 0; i++) usleep(10000);
}

/* Makes r->dir one directory at a time; the first time, r->made takes the
 * topmost one this call created (mkdir succeeded: not one another start
 * made meanwhile). */
static int make_dir(run_ctx *r) {
  char path[sizeof r->dir];
  snprintf(path, sizeof path, "%s", r->dir);
  int first = !r->made[0];
  for (char *p = path + 1;; p++) {
    if (*p != '/' && *p != 0) continue;
    char c = *p;
    *p = 0;
    if (mkdir(path, 0755) == 0) {
      if (first && !r->made[0]) snprintf(r->made, sizeof r->made, "%s", path);
    } else if (errno != EEXIST) {
      return tr_fail(TR_EIO, "run directory: cannot create directory '%s': %s", path, strerror(errno));
    }
    *p = c;
    if (!c) break;
  }
  int rc = tr_mkdirs(r->dir); /* is a writable directory */
  return rc ? tr_fail_prefix(rc, "run directory") : 0;
}

/* Takes RUN/start.lock (RUN made first unless resume), waiting while
 * another start holds it; 0 (r->gate_fd -1 where the filesystem cannot
 * lock: a warning then if warn, the starts that take no run.lock), or
 * TR_EINVAL / TR_EIO (message set). */
static int gate_take(run_ctx *r, int resume, int warn) {
  r->gate_fd = -1;
  r->made[0] = 0;
  char path[PATH_MAX];
  path_in(r, START_LOCK, path, sizeof path);
  tr_lock_wait w;
  tr_lock_wait_init(&w);
  for (;; usleep(20000)) {
    if (tr_now() - w.t0 > GATE_MAX_S) break;
    if (!resume && access(r->dir, F_OK) != 0) {
      int rc = make_dir(r);
      if (rc) return rc;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 && (errno == EACCES || errno == EPERM || errno == EROFS))
      fd = open(path, O_RDONLY | O_CLOEXEC); /* another user's RUN: flock needs no write access */
    if (fd < 0) {
      if (errno == ENOENT && !resume && access(r->dir, F_OK) != 0) continue; /* RUN removed meanwhile: again */
      if (errno == ENOENT || errno == EACCES || errno == EPERM || errno == EROFS)
        return 0; /* no gate to take here: the checks that follow say what is wrong with RUN */
      return tr_fail(TR_EIO, "run directory: cannot open %s: %s", path, strerror(errno));
    }
    if (lock_ex(fd) == 0) {
      if (tr_fd_at_path(fd, path)) { /* not one a refused start removed */
        r->gate_fd = fd;
        return 0;
      }
      close(fd);
      continue;
    }
    int e = errno;
    if (e != EWOULDBLOCK && e != EINTR) { /* no locks here (NFS without lockd, ...): no gate */
      close(fd);
      if (warn)
        fprintf(stderr, "transom: warning: %s: this filesystem has no locks (%s): two starts at once in %s are not "
                "prevented\n", path, strerror(e), r->dir);
      return 0;
    }
    /* a running holder: the loop's own GATE_MAX_S check ends the wait */
    int step = tr_lock_wait_step(&w, fd, GATE_WAIT_S, 1e30);
    if (step == TR_WAIT_SAY) fprintf(stderr, "transom: another transom%s is starting in %s: waiting for it\n", w.who, r->dir);
    close(fd);
    if (step == TR_WAIT_GIVE_UP) {
      r->made[0] = 0; /* never held: nothing here is ours to remove */
      return tr_fail(TR_EINVAL, "%s: another transom%s has been starting in it for %.0f s and %s: try again once "
                     "it has started (or ended)", r->dir, w.who, w.waited,
                     w.who[0] ? "is stopped (kill -CONT it, or kill it)" : "cannot be seen from here");
    }
  }
  r->made[0] = 0;
  return tr_fail(TR_EINVAL, "%s: another transom has been starting in it for %.0f s: try again once it has started "
                 "(or ended)", r->dir, GATE_MAX_S);
}

static void gate_release(run_ctx *r) {
  if (r->gate_fd < 0) return;
  close(r->gate_fd);
  r->gate_fd = -1;
}

/* Whether a component of path is "." or "..": then its parents are not
 * what its prefixes name. */
static int has_dots(const char *path) {
  for (const char *c = path; *c;) {
    size_t n = strcspn(c, "/");
    if ((n == 1 && c[0] == '.') || (n == 2 && c[0] == '.' && c[1] == '.')) return 1;
    c += n;
    c += strspn(c, "/");
  }
  return 0;
}

/* A refused start: what gate_take made of RUN's path removed again (the
 * lock file, then the directories, leaf first, while empty: rmdir
 * refuses otherwise), then the gate let go. Not where the path holds "."
 * or "..": its prefixes are not the directories made. */
static void gate_refused(run_ctx *r) {
  char path[sizeof r->dir + 16];
  snprintf(path, sizeof r->dir, "%s", r->dir);
  if (r->made[0] && !has_dots(path)) {
    size_t top = strlen(r->made), k = strlen(path);
    while (k > 1 && path[k - 1] == '/') path[--k] = 0;
    char lock[sizeof path + 16];
    snprintf(lock, sizeof lock, "%s/" START_LOCK, path);
    unlink(lock); /* a start waiting on it sees it gone once we let go */
    while (rmdir(path) == 0) {
      char *slash = strrchr(path, '/');
      if (!slash || slash == path) break;
      while (slash > path && slash[-1] == '/') slash--;
      *slash = 0;
      if (strlen(path) < top || strncmp(path, r->made, top) != 0) break;
    }
  }
  r->made[0] = 0;
  gate_release(r);
}

/* Is a live job writing into r->dir? A lone run holds RUN/run.lock, and
 * this run is refused. An operator (a replicated run) is asked on
 * RUN/control.sock: one that answers is live, and this run is refused;
 * one that takes the connection but does not answer within PROBE_S
 * (stopped, hung: the takeover the product supports) is taken over by a
 * replicated run only: a --resume adopts its workers, and it stands down
 * should it run again (operator.c, superseded); a lone run or a pipeline
 * is refused (nothing would make the old one stand down); a dead one (no socket, nobody listening) is
 * no one. Returns 0 to go on, or TR_EINVAL (message set). */
static int check_in_use(const run_ctx *r) {
  int pid = 0;
  if (lock_held(r->dir, &pid)) return in_use_by(r->dir, pid); /* a lone run, a pipeline's launcher */
  int uid;
  operator_presence p = operator_probe(r->dir, PROBE_S, &pid, &uid);
  if (p == OPERATOR_REFUSED && uid >= 0 && uid != (int)getuid())
    return tr_fail(TR_EINVAL, "%s is in use by an operator of another user (uid %d%s%.0d): it refused this one on "
                   "%s/control.sock", r->dir, uid, pid > 0 ? ", pid " : "", pid, r->dir);
  /* the pid is 0 when the socket could not say (another pid namespace, a
   * full backlog): no "kill 0" hint then, which would hit our own group */
  char who[32] = "", stop[48] = "", kill9[32] = "";
  if (pid > 0) {
    snprintf(who, sizeof who, " (pid %d)", pid);
    snprintf(stop, sizeof stop, " (kill -TERM %d: it checkpoints and exits)", pid);
    snprintf(kill9, sizeof kill9, " (kill -9 %d)", pid);
  }
  if (p == OPERATOR_REFUSED)
    return tr_fail(TR_EINVAL, "%s is in use by an operator%s that closed %s/control.sock without an answer "
                   "(it may be ending): stop it first, or try again", r->dir, who, r->dir);
  if (p == OPERATOR_ANSWERS)
    return tr_fail(TR_EINVAL, "%s is in use by a live operator%s: stop it first%s; a hung one that does not answer "
                   "is taken over", r->dir, who, stop);
  int pipeline = r->cfg.pipe_stages > 1 || r->cfg.pipe_micro_batches > 1;
  if (p == OPERATOR_SILENT && (r->cfg.replicas <= 1 || pipeline))
    /* Only an operator rewrites RUN/operator.addr (what makes the old one
     * stand down): a lone run or a pipeline taking over would leave it to
     * train on when continued, two timelines in one directory. */
    return tr_fail(TR_EINVAL, "a stopped or hung operator%s holds %s: kill it%s first, or resume with --replicas > 1 "
                   "to take it over", who, r->dir, kill9);
  if (p == OPERATOR_SILENT)
    fprintf(stderr, "transom: the operator in %s%s did not answer on %s/control.sock in %.1f s: taking the run over "
            "(it stands down should it run again)\n", r->dir, who, r->dir, PROBE_S);
  return 0;
}

/* Where key's value came from, for a message: "--set ITEM" (the last
 * --set of it wins), else the job file. */
static const char *key_source(const run_args *a, const run_ctx *r, const char *key, char *buf, size_t n) {
  size_t k = strlen(key);
  const char *item = NULL;
  for (int i = 0; i < a->nsets; i++)
    if (strncmp(a->sets[i], key, k) == 0 && a->sets[i][k] == '=') item = a->sets[i];
  if (!item) return r->cfg.path;
  snprintf(buf, n, "--set %s", item);
  return buf;
}

/* What would fail only once the run has started, checked before anything
 * is written (a start that failed after job.lua left a directory that
 * refuses the corrected rerun as "already holds a run"): the remote
 * checkpoint level can be created and written; an operator's environment
 * (MASTER_ADDR for hosts, MASTER_PORT). Returns 0 or TR_EINVAL (message
 * set, naming the --set item when one gave the value). */
static int check_start(const run_ctx *r, const run_args *a, int operator) {
  const job_config *c = &r->cfg;
  char from[PATH_MAX + 16];
  if (c->ckpt_remote[0] && (c->ckpt_every_steps > 0 || c->ckpt_every_seconds > 0) && ckpt_remote_prepare(c->ckpt_remote))
    return tr_fail_prefix(TR_EINVAL, "%s: key 'checkpoint.remote'", key_source(a, r, "checkpoint.remote", from, sizeof from));
  if (operator && operator_check_env(c, key_source(a, r, "hosts", from, sizeof from))) return TR_EINVAL;
  return 0;
}

static int write_job(const run_ctx *r, const char *dump) {
  char path[PATH_MAX];
  path_in(r, "job.lua", path, sizeof path);
  return tr_write_file_atomic(path, dump, strlen(dump));
}

/* Everything that can fail before training: the directory, the checkpoint
 * store, the resumed state. A new run writes job.lua before it opens the
 * store (as run_replicas does), so a directory whose start failed here
 * holds a job.lua that --resume takes (from step 0: no checkpoint), never
 * a store without one; a resume keeps its job.lua until the checkpoint has
 * loaded (write_run). Returns 0 or the exit status (with the error
 * printed). */
static int open_run(run_ctx *r, const char *dump, int *resume) {
  int rc = tr_mkdirs(r->dir), asked = *resume;
  if (!rc && take_lock(r)) { /* another start got here first */
    fprintf(stderr, "transom: %s\n", tr_error());
    return 2;
  }
  gate_release(r); /* later starts see the lock */
  if (!rc && !asked) rc = write_job(r, dump);
  if (!rc) rc = open_ckpt(r);
  if (!rc && *resume && !r->ck) rc = tr_fail(TR_EINVAL, "checkpoints are off in this job: nothing to resume from");
  if (!rc && *resume) {
    char report[4096] = "";
    int64_t newest;
    ckpt_reader *rd = ckpt_engine_reader(r->ck);
    int n = rd ? ckpt_reader_steps(rd, &newest, 1) : TR_EIO;
    if (n < 0) rc = n; /* a store that cannot be listed is not an empty one: never a silent step 0 */
    else if (n == 0) *resume = 0; /* killed before its first checkpoint */
    else rc = trainer_ckpt_load(r->t, rd, -1, report, sizeof report);
    ckpt_reader_close(rd);
    if (report[0]) fputs(report, stderr);
  }
  if (!rc) return 0;
  fprintf(stderr, "transom: %s: %s\n", asked ? "resume" : "run directory", tr_error());
  return asked ? 1 : 2;
}

/* A resumed run's job.lua (its --set applied; a new run's is written),
 * the initial weights and vocabulary, the logs (a resumed run's metrics
 * after its checkpoint are dropped: it does them again). asked: --resume;
 * resume: a checkpoint loaded; scratch: --resume found no committed
 * checkpoint and starts from step 0. */
static int write_run(run_ctx *r, const char *dump, int asked, int resume, int scratch, int64_t step) {
  char path[PATH_MAX];
  int rc = asked ? write_job(r, dump) : TR_OK;
  if (!rc && !resume) rc = trainer_save(r->t, r->dir);
  if (rc) return rc;
  path_in(r, "events.jsonl", path, sizeof path);
  r->events = fopen(path, "a");
  tr_log_reserve(r->events);
  if (scratch) event(r, 0, "resume", "no committed checkpoint in %s/ckpt: starting from step 0", r->dir);
  if (resume) {
    event(r, step, "resume", "resumed from the checkpoint of step %lld", (long long)step);
    rc = truncate_metrics(r, step);
  }
  path_in(r, "metrics.jsonl", path, sizeof path);
  r->metrics = fopen(path, resume ? "a" : "w");
  if (!r->metrics || !r->events) rc = tr_fail(TR_EIO, "cannot open the logs in %s", r->dir);
  return rc;
}

static void print_banner(const run_ctx *r, int resume, int64_t step) {
  const job_config *cfg = &r->cfg;
  graph_sizes sz;
  graph_sizes_get(trainer_graph(r->t), &sz);
  const dataset *d = trainer_data(r->t);
  printf("transom %s | job %s | run %s\n", TRANSOM_VERSION, cfg->path, r->dir);
  printf("model %s: %lld parameters, vocab %d, %d threads | data %s: %lld tokens (%lld train, %lld val)\n", cfg->model,
         (long long)sz.params, (int)d->vocab_size, kernels_threads(), cfg->data, (long long)d->n, (long long)d->n_train,
         (long long)(d->n - d->n_train));
  if (strcmp(cfg->device, "cpu") != 0) printf("device %s: %s\n", cfg->device, trainer_backend(r->t)->describe());
  if (r->ck)
    printf("checkpoints: every %lld steps%s, keep %lld, in %s/ckpt\n", (long long)cfg->ckpt_every_steps,
           cfg->ckpt_every_seconds > 0 ? " or by time" : "", (long long)cfg->ckpt_keep_last, r->dir);
  if (resume) printf("resumed from step %lld\n", (long long)step);
}

/* Throughput, checkpoint and memory figures after the loop. */
static void print_summary(const run_ctx *r, const loop_result *res) {
  if (r->timed > 0) {
    double ms = r->sum_time / (double)r->timed * 1e3;
    printf("done: %lld steps | %.1f ms/step | %.0f tok/s | %.2f GFLOP/s (steps %lld..%lld)\n", (long long)res->step, ms,
           r->sum_tokens / r->sum_time, trainer_flops_per_step(r->t) / (ms * 1e-3) * 1e-9, (long long)r->first + 2,
           (long long)res->step);
  }
  if (r->ck) {
    ckpt_stats cs;
    ckpt_get_stats(r->ck, &cs);
    printf("checkpoints: %llu committed, %llu failed, %llu skipped, %llu coalesced | %.1f MiB each | training waited "
           "%.2f ms in all\n",
           (unsigned long long)cs.committed, (unsigned long long)cs.failed, (unsigned long long)cs.skipped,
           (unsigned long long)cs.coalesced, cs.bytes_per_snapshot / 1048576.0, cs.stall_s * 1e3);
    if (cs.unpinned)
      printf("checkpoints: %d staging buffer(s) could not be page-locked (%s): their device copies ran unpinned "
             "(slower, and they wait for the host)\n",
             cs.unpinned, cs.unpinned_why);
  }
  double rss = (double)tr_peak_rss(), plan = (double)trainer_planned_bytes(r->t);
  printf("memory: peak RSS %.1f MiB | planned %.1f MiB (params, grads, AdamW, activations) | ratio %.2f\n",
         rss / 1048576.0, plan / 1048576.0, rss / plan);
}

/* A single-process run through the one training loop; the exit status. */
static int train_alone(run_ctx *r, int64_t step) {
  const job_config *cfg = &r->cfg;
  signal(SIGINT, on_stop);
  signal(SIGTERM, on_stop);
  r->first = step;
  r->width = snprintf(NULL, 0, "%lld", (long long)cfg->max_steps);
  const char *pad = getenv("TRANSOM_TEST_STEP_MS");
  r->pad_ms = pad ? atoi(pad) : 0;
  loop_opts lo = {.t = r->t, .ck = r->ck, .run_dir = r->dir, .worker = 0, .save_on_stop = 1};
  loop_hooks hooks = {.ud = r, .poll = lone_poll, .report = lone_report, .eval = lone_eval,
                      .ckpt_event = lone_ckpt_event};
  loop_result res;
  int rc = loop_run(&lo, &hooks, &res);
  if (rc) fprintf(stderr, "transom: step %lld: %s\n", (long long)res.step + 1, tr_error());
  if (res.stopped) {
    event(r, res.step, "stopped", "stopped by a signal");
    printf("stopped at step %lld%s; resume with: transom run --resume %s\n", (long long)res.step,
           r->ck ? " (checkpointed)" : "", r->dir);
  }
  print_summary(r, &res);
  if (!rc && cfg->sample_tokens > 0 && !res.stopped) {
    printf("--- sample (%lld tokens, temperature %.2f) ---\n", (long long)cfg->sample_tokens, cfg->temperature);
    if (trainer_sample(r->t, cfg->sample_prompt, cfg->sample_tokens, (float)cfg->temperature, (uint64_t)cfg->seed,
                       stdout)) {
      fprintf(stderr, "transom: sample: %s\n", tr_error());
      rc = 1;
    }
  }
  printf("run directory: %s\n", r->dir);
  return rc ? 1 : 0;
}

/* The command, with the VM and the --set list owned by run_main. Returns the
 * exit status. */
static int run_job(lua_State *L, const char **sets, int argc, char **argv) {
  run_args a = {.sets = sets};
  int done, rc = parse_args(L, &a, argc, argv, &done);
  if (rc || done) return rc;
  run_ctx r = {.gate_fd = -1};
  if (job_load(L, a.job_path, a.sets, a.nsets, &r.cfg) || make_trainer(L, &r)) {
    fprintf(stderr, "transom: %s\n", tr_error());
    return 2;
  }
  choose_dir(&r);
  int resume = a.resume != NULL;
  char *dump = job_dump(L, &r.cfg); /* what RUN/job.lua will hold: a job that cannot be written so makes no RUN */
  if (!dump) {
    fprintf(stderr, "transom: %s: %s\n", resume ? "resume" : "run directory", tr_error());
    close_run(&r);
    return resume ? 1 : 2;
  }
  int pipeline = r.cfg.pipe_stages > 1 || r.cfg.pipe_micro_batches > 1;
  if (gate_take(&r, resume, r.cfg.replicas > 1 && !pipeline) || (!resume && check_new_dir(&r)) ||
      check_in_use(&r)) { /* a new run into a run's directory: refused at once */
    fprintf(stderr, "transom: %s\n", tr_error());
    gate_refused(&r);
    free(dump);
    close_run(&r);
    return 2;
  }
  if (resume && r.cfg.ckpt_every_steps == 0 && r.cfg.ckpt_every_seconds == 0) {
    fprintf(stderr, "transom: resume: checkpoints are off in this job (%s): nothing to resume from\n", r.cfg.path);
    gate_refused(&r);
    free(dump);
    close_run(&r);
    return 2;
  }
  if (check_start(&r, &a, r.cfg.replicas > 1 && !pipeline)) {
    fprintf(stderr, "transom: %s\n", tr_error());
    gate_refused(&r);
    free(dump);
    close_run(&r);
    return 2;
  }
  test_start_pause();
  if (r.cfg.replicas > 1 || pipeline) {
    rc = run_replicas(L, &r, dump, resume, pipeline);
    free(dump);
    return rc;
  }
  if ((rc = open_run(&r, dump, &resume))) {
    free(dump);
    close_run(&r);
    return rc;
  }
  if (a.resume && !resume) printf("resume: no committed checkpoint in %s/ckpt: starting from step 0\n", r.dir);
  trainer_state ts;
  trainer_get_state(r.t, &ts);
  rc = write_run(&r, dump, a.resume != NULL, resume, a.resume && !resume, ts.step);
  free(dump);
  if (rc) {
    fprintf(stderr, "transom: run directory: %s\n", tr_error());
    close_run(&r);
    return 1;
  }
  print_banner(&r, resume, ts.step);
  rc = train_alone(&r, ts.step);
  close_run(&r);
  return rc;
}

int run_main(int argc, char **argv) {
  lua_State *L = lua_host_new();
  const char **sets = calloc((size_t)argc + 2, sizeof(char *));
  int rc = 1;
  if (L && sets) rc = run_job(L, sets, argc, argv);
  else fprintf(stderr, "transom: %s\n", L ? "out of memory" : tr_error());
  free(sets);
  lua_host_close(L);
  return rc;
}
