/* pipeline_ckpt.c — checkpoints of a pipelined run (see pipeline_ckpt.h).
 *
 * Each stage has its own store, RUN/ckpt-stage-K: the stage's whole trainer
 * state (its worker holds every parameter and moment; the ones of its own
 * ops are current). The lowest live pipeline's worker of stage K writes it
 * (the loop's `snapshots`), at the checkpoint steps the stages agree on in
 * the end-of-step exchange (pipeline_step.c), unpaced, so that every store
 * holds the same steps; the stores commit independently, so a
 * resume takes the newest step that every stage committed and that
 * verifies in every store (a corrupt copy in one store makes all of them
 * take an older step). The stages' ops must be the ones they were
 * checkpointed with: the launcher saves the plan (RUN/pipeline-plan) and a
 * resumed run uses it instead of planning again. Before a resume changes
 * anything the launcher checks the stores against the job
 * (pipe_ckpt_resume_check); the stores of a start abandoned are set aside,
 * never deleted.
 */
#include "pipeline_ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

#define MAX_STEPS 100000 /* committed checkpoints read per store */

static void store_path(char *out, size_t n, const char *run, int stage) {
  snprintf(out, n, "%s/ckpt-stage-%d", run, stage);
}

ckpt_engine *pipe_ckpt_open(const job_config *cfg, trainer *t, const char *run, int stage) {
  if (cfg->ckpt_every_steps == 0 && cfg->ckpt_every_seconds == 0) return NULL;
  char path[1200];
  store_path(path, sizeof path, run, stage);
  /* coalesce: a stage snapshots only when every stage's engine is free (the
   * end-of-step vote, pipeline_step.c), so one is never busy then (the job
   * refuses checkpoint.when_busy = "skip" for a pipeline) */
  ckpt_opts o = {path, (size_t)cfg->ckpt_map_mb << 20, (int)cfg->ckpt_keep_last, (int)cfg->ckpt_keep_every,
                 CKPT_COALESCE};
  ckpt_engine *ck = ckpt_open(&o);
  if (!ck) {
    tr_fail_prefix(TR_EIO, "stage %d's checkpoint store %s", stage, path);
    return NULL;
  }
  /* no pacing: every stage snapshots at the due steps themselves (pacing
   * would defer each store to steps of its own, and a resume needs a step
   * all of them hold) */
  if (ckpt_set_cpu_share(ck, 1.0) || trainer_ckpt_attach(t, ck)) {
    ckpt_close(ck);
    return NULL;
  }
  return ck;
}

int pipe_ckpt_load(ckpt_engine *ck, trainer *t, int stage, int64_t step) {
  char report[2048] = "";
  ckpt_reader *r = ckpt_engine_reader(ck);
  int rc = r ? trainer_ckpt_load(t, r, step, report, sizeof report) : TR_EIO;
  ckpt_reader_close(r);
  if (report[0]) fputs(report, stderr);
  if (rc) return tr_fail_prefix(rc, "stage %d: loading the checkpoint of step %lld", stage, (long long)step);
  /* the load takes the newest step at or before `step` that verifies: an
   * older one here would put this stage out of step with the others */
  trainer_state ts;
  trainer_get_state(t, &ts);
  if (ts.step != step)
    return tr_fail(TR_ESTATE, "stage %d: step %lld of its checkpoint store does not load (step %lld did instead): %s",
                   stage, (long long)step, (long long)ts.step, report[0] ? report : "no report");
  return TR_OK;
}

/* 1 when every stage's store holds step and it verifies there; 0 (saying
 * why on stderr) when one does not; an error when a store cannot be
 * opened at all (not a reason to go back a step). */
static int verifies_everywhere(const char *run, int S, int64_t step) {
  for (int k = 0; k < S; k++) {
    char path[1200];
    store_path(path, sizeof path, run, k);
    ckpt_reader *r = ckpt_reader_open(path);
    if (!r) return tr_fail_prefix(TR_EIO, "stage %d's checkpoint store %s", k, path);
    int ok = ckpt_reader_verify(r, step) == 0;
    if (!ok) fprintf(stderr, "resume: step %lld of stage %d does not verify (%s): trying an older one\n",
                     (long long)step, k, tr_error());
    ckpt_reader_close(r);
    if (!ok) return 0;
  }
  return 1;
}

/* The committed steps of stage K's store (ascending): how many, 0 with
 * no store (or its directory without data.mdb, or a data.mdb whose
 * databases were never created: a worker killed inside ckpt_open), or an
 * error (a store whose list cannot be read is not an empty one: resuming
 * from step 0 would throw its checkpoints away). */
static int store_steps(const char *run, int stage, int64_t *steps, int cap) {
  char path[1200], mdb[1300];
  store_path(path, sizeof path, run, stage);
  snprintf(mdb, sizeof mdb, "%s/data.mdb", path);
  if (access(mdb, F_OK) != 0) return 0; /* no store: nothing committed */
  ckpt_reader *r = ckpt_reader_open(path);
  if (!r) return tr_fail_prefix(TR_EIO, "%s", path);
  int n = ckpt_reader_steps(r, steps, cap);
  ckpt_reader_close(r);
  return n < 0 ? tr_fail_prefix(n, "%s", path) : n;
}

int pipe_ckpt_common_step(const char *run, int S, int64_t *step) {
  int64_t *mine = malloc(sizeof(int64_t) * MAX_STEPS), *other = malloc(sizeof(int64_t) * MAX_STEPS);
  *step = 0;
  if (!mine || !other) {
    free(mine);
    free(other);
    return tr_fail(TR_ENOMEM, "out of memory");
  }
  int n = store_steps(run, 0, mine, MAX_STEPS), rc = n < 0 ? n : TR_OK;
  for (int k = 1; k < S && n > 0; k++) { /* keep the steps every store has */
    int m = store_steps(run, k, other, MAX_STEPS), kept = 0;
    if (m < 0) {
      rc = m;
      n = 0;
      break;
    }
    for (int i = 0, j = 0; i < n && j < m;) {
      if (mine[i] == other[j]) mine[kept++] = mine[i], i++, j++;
      else if (mine[i] < other[j]) i++;
      else j++;
    }
    n = kept;
  }
  int common = n, v = 0; /* the newest step every store can load */
  while (!rc && n > 0 && (v = verifies_everywhere(run, S, mine[n - 1])) == 0) n--;
  if (!rc && v < 0) rc = v;
  if (!rc && common > 0 && n == 0) /* committed, but none loads: not a run to start over */
    rc = tr_fail(TR_EIO, "none of the %d step(s) every stage committed verifies in every store (see above)", common);
  if (!rc && n > 0) *step = mine[n - 1];
  free(mine);
  free(other);
  return rc;
}

/* --- a resume from step 0 --- */

/* The stages RUN/pipeline-plan lists (its lines): -1 without one. */
static int plan_stages(const char *run) {
  char path[1200];
  snprintf(path, sizeof path, "%s/pipeline-plan", run);
  size_t len;
  char *text = tr_read_file(path, &len);
  if (!text) return -1;
  int n = 0;
  for (const char *l = text; l && *l; l = strchr(l, '\n'), l = l ? l + 1 : NULL) n += strncmp(l, "PLAN ", 5) == 0;
  free(text);
  return n;
}

/* The stage K of a store's directory name ckpt-stage-K (as store_path
 * writes it); -1 for any other. */
static int store_stage(const char *name) {
  long long k;
  char canon[64];
  if (strncmp(name, "ckpt-stage-", 11) != 0 || tr_parse_int(name + 11, 0, INT_MAX, &k)) return -1;
  snprintf(canon, sizeof canon, "ckpt-stage-%lld", k);
  return strcmp(canon, name) == 0 ? (int)k : -1;
}

/* "3, 6, 9" (the newest 8 of n, "..." before them), into out. */
static void list_steps(char *out, size_t cap, const int64_t *steps, int n) {
  size_t k = 0;
  out[0] = 0;
  if (n > 8) k += (size_t)snprintf(out, cap, "..., ");
  for (int i = n > 8 ? n - 8 : 0; i < n && k < cap; i++)
    k += (size_t)snprintf(out + k, cap - k, "%s%lld", k && out[k - 1] != ' ' ? ", " : "", (long long)steps[i]);
}

/* Refused: the stores hold commits, none in all of them, and every store
 * holds some (a store killed before its first commit would hold none):
 * they are out of step, not a start to redo; the error lists them. */
static int out_of_step(const char *run, int S) {
  int64_t *steps = malloc(sizeof(int64_t) * MAX_STEPS);
  size_t cap = 512 * (size_t)S + 256, k = 0;
  char *msg = malloc(cap);
  if (!steps || !msg) {
    free(steps);
    free(msg);
    return tr_fail(TR_ENOMEM, "out of memory");
  }
  for (int st = 0; st < S; st++) {
    char list[512];
    int n = store_steps(run, st, steps, MAX_STEPS);
    list_steps(list, sizeof list, steps, n > 0 ? n : 0);
    k += (size_t)snprintf(msg + k, cap - k, "%sstage %d holds %s", st ? ", " : "", st, list);
  }
  int rc = tr_fail(TR_ESTATE, "resume: stage stores out of step in %s: %s (no step is in every store); nothing was "
                   "changed: resume from one store's steps is impossible, remove the ckpt-stage-* to start over",
                   run, msg);
  free(steps);
  free(msg);
  return rc;
}

int pipe_ckpt_resume_check(const char *run, int S, int64_t *step, int *start_over) {
  *step = 0;
  *start_over = 0;
  if (S > PIPE_MAX_STAGES) return tr_fail(TR_EINVAL, "resume: %d stages (at most %d)", S, PIPE_MAX_STAGES);
  int held[PIPE_MAX_STAGES], missing[PIPE_MAX_STAGES] = {0}, beyond = -1, rc = TR_OK, any = 0, empty = 0;
  int64_t one[1];
  DIR *d = opendir(run);
  if (!d) return tr_fail(TR_EIO, "cannot list %s", run);
  for (struct dirent *e; !rc && (e = readdir(d));) { /* stores past the job's last stage */
    int k = store_stage(e->d_name), m = k < S ? 0 : store_steps(run, k, one, 1);
    if (m < 0) rc = m;
    else if (m > 0) beyond = k;
  }
  closedir(d);
  for (int k = 0; k < S && !rc; k++) { /* held[k]: its checkpoints (0 or 1), or an error */
    char path[1200];
    store_path(path, sizeof path, run, k);
    missing[k] = access(path, F_OK) != 0;
    held[k] = missing[k] ? 0 : store_steps(run, k, one, 1);
    if (held[k] < 0) rc = tr_fail_prefix(held[k], "resume: stage %d's checkpoint store", k);
    any |= held[k] > 0;
    empty |= !missing[k] && held[k] == 0;
  }
  if (rc || (!any && beyond < 0)) return rc; /* nothing committed: a start from step 0, nothing to set aside */
  int planned = plan_stages(run);
  if (planned <= 0)
    return tr_fail(TR_ESTATE, "resume: %s/pipeline-plan is missing or holds no stage, but the stores hold "
                   "checkpoints: they load only with the cuts they were taken with; nothing was changed (restore "
                   "the file, or remove the ckpt-stage-* to start over)", run);
  if (planned != S)
    return tr_fail(TR_ESTATE, "resume: the run's checkpoints are of %d stages (%s/pipeline-plan), the job has %d: "
                   "resume with --set pipeline.stages=%d, or remove its ckpt-stage-* to start over; nothing was "
                   "changed", planned, run, S, planned);
  if (beyond >= 0)
    return tr_fail(TR_ESTATE, "resume: %s/ckpt-stage-%d holds checkpoints of a stage the job does not have (%d "
                   "stages): resume with the run's own pipeline.stages, or remove its ckpt-stage-* to start over; "
                   "nothing was changed", run, beyond, S);
  for (int k = 0; k < S; k++)
    if (missing[k])
      return tr_fail(TR_ESTATE, "resume: %s/ckpt-stage-%d is missing while other stages' stores hold checkpoints "
                     "(a stage's store is created when its worker starts): nothing was changed; restore it, or "
                     "remove the ckpt-stage-* to start over", run, k);
  if ((rc = pipe_ckpt_common_step(run, S, step)) || *step > 0) return rc;
  if (!empty) return out_of_step(run, S);
  *start_over = 1; /* a store holds none: killed before that stage's first commit */
  return TR_OK;
}

/* Renames path to a free name, path.abandoned-<time>-<pid>-<call> (the
 * set-aside's stores share it), or with .<n> after it when that is taken
 * (a rename never replaces a name: not an empty directory either). 0 (the
 * name in aside), or errno. */
static int rename_aside(const char *path, const char *suffix, char *aside, size_t cap) {
  for (int n = 0; n < 1000; n++) {
    if (n) snprintf(aside, cap, "%s.abandoned-%s.%d", path, suffix, n);
    else snprintf(aside, cap, "%s.abandoned-%s", path, suffix);
    if (access(aside, F_OK) == 0) continue;
    if (rename(path, aside) == 0) return 0;
    if (errno != EEXIST && errno != ENOTEMPTY) return errno;
  }
  return EEXIST;
}

int pipe_ckpt_set_aside(const char *run, int S, int *moved) {
  *moved = 0;
  if (S > PIPE_MAX_STAGES) return tr_fail(TR_EINVAL, "resume: %d stages (at most %d)", S, PIPE_MAX_STAGES);
  int64_t *steps = malloc(sizeof(int64_t) * MAX_STEPS);
  char(*aside)[1300] = calloc((size_t)S, sizeof *aside), (*list)[512] = calloc((size_t)S, sizeof *list);
  int held[PIPE_MAX_STAGES] = {0}, rc = TR_OK, k;
  if (!steps || !aside || !list) rc = tr_fail(TR_ENOMEM, "out of memory");
  /* every store's steps first, then every rename: a failure moves back the
   * ones renamed, leaving the run as it was */
  for (k = 0; k < S && !rc; k++) {
    int n = store_steps(run, k, steps, MAX_STEPS);
    if (n < 0) rc = n;
    else if ((held[k] = n) > 0) list_steps(list[k], sizeof list[k], steps, n);
  }
  static int calls; /* a second set-aside in the same second is named apart */
  char suffix[64];
  snprintf(suffix, sizeof suffix, "%lld-%ld-%d", (long long)time(NULL), (long)getpid(), calls++);
  for (k = 0; k < S && !rc; k++) {
    char path[1200];
    store_path(path, sizeof path, run, k);
    int err = held[k] > 0 ? rename_aside(path, suffix, aside[k], sizeof aside[k]) : 0;
    if (err) rc = tr_fail(TR_EIO, "resume: setting aside %s as %s: %s", path, aside[k], strerror(err));
  }
  if (rc) { /* back, the ones moved (k - 1: the one that failed) */
    for (int j = k - 2; j >= 0 && aside; j--) {
      char path[1200];
      store_path(path, sizeof path, run, j);
      if (held[j] > 0 && rename(aside[j], path) != 0)
        fprintf(stderr, "resume: moving %s back to %s: %s (move it back by hand)\n", aside[j], path, strerror(errno));
    }
  } else {
    char events[1200];
    snprintf(events, sizeof events, "%s/events.jsonl", run);
    FILE *ev = NULL;
    for (k = 0; k < S; k++) {
      if (held[k] <= 0) continue;
      char path[1200], line[2600];
      store_path(path, sizeof path, run, k);
      snprintf(line, sizeof line, "set aside %d checkpoint(s) of stage %d (steps %s): %s moved to %s; not every "
               "stage committed one, so the run starts over from step 0", held[k], k, list[k], path, aside[k]);
      printf("resume: %s\n", line);
      if (!ev) ev = fopen(events, "a");
      if (ev) tr_event_line(ev, 0, -1, "checkpoints_set_aside", line);
      *moved += held[k];
    }
    if (ev) fclose(ev);
  }
  free(steps);
  free(aside);
  free(list);
  return rc;
}

/* --- the plan the checkpoints were taken with --- */

/* A line's room: PLAN stage=S cuts= (S + 1 numbers) order= (S numbers),
 * as the launcher's and the workers' 4 KiB line buffers take it. */
#define PLAN_LINE_MAX 4096

int pipe_plan_save(const char *run, const pipe_plan *p) {
  char path[1200];
  size_t cap = (size_t)(p->S > 0 ? p->S : 1) * PLAN_LINE_MAX, k = 0;
  char *text = malloc(cap);
  if (!text) return tr_fail(TR_ENOMEM, "out of memory saving the pipeline plan");
  int rc = TR_OK;
  for (int s = 0; s < p->S && !rc; s++) {
    int n = pipe_plan_line(text + k, cap - k, p, s);
    if (n < 0) rc = n;
    else k += (size_t)n;
  }
  snprintf(path, sizeof path, "%s/pipeline-plan", run);
  if (!rc) rc = tr_write_file_atomic(path, text, k);
  free(text);
  return rc;
}

int pipe_plan_restore(const char *run, pipe_plan *p, int nops, int *found) {
  char path[1200];
  snprintf(path, sizeof path, "%s/pipeline-plan", run);
  size_t len;
  char *text = tr_read_file(path, &len);
  *found = text != NULL;
  if (!text) return TR_OK;
  int rc = TR_OK, seen = 0, has[PIPE_MAX_STAGES] = {0}, cuts0[PIPE_MAX_STAGES + 1], order0[PIPE_MAX_STAGES];
  for (char *line = text; *line && !rc;) {
    char *nl = strchr(line, '\n');
    if (nl) *nl = 0;
    int stage = -1, cuts[PIPE_MAX_STAGES + 1], order[PIPE_MAX_STAGES];
    rc = pipe_plan_parse(line, p->S, &stage, cuts, order);
    if (rc) rc = tr_fail_prefix(rc, "%s, line %d", path, seen + 1);
    else if (stage >= p->S || has[stage]++)
      rc = tr_fail(TR_EFORMAT, "%s: stage %d %s", path, stage, stage >= p->S ? "of a larger pipeline" : "twice");
    else if (seen == 0 && !(rc = pipe_plan_check(path, cuts, order, p->S, nops))) {
      memcpy(cuts0, cuts, sizeof(int) * (size_t)(p->S + 1));
      memcpy(order0, order, sizeof(int) * (size_t)p->S);
    } else if (!rc && (memcmp(cuts0, cuts, sizeof(int) * (size_t)(p->S + 1)) ||
                       memcmp(order0, order, sizeof(int) * (size_t)p->S)))
      rc = tr_fail(TR_EFORMAT, "%s: stage %d's line has other cuts or order than the first", path, stage);
    seen += !rc;
    line = nl ? nl + 1 : line + strlen(line);
  }
  free(text);
  if (!rc && seen != p->S)
    rc = tr_fail(TR_EFORMAT, "%s has %d stage(s), the job %d (pipeline.stages changed: the checkpoints do not fit)",
                 path, seen, p->S);
  if (!rc) {
    memcpy(p->cuts, cuts0, sizeof(int) * (size_t)(p->S + 1));
    memcpy(p->order, order0, sizeof(int) * (size_t)p->S);
  }
  return rc ? tr_fail_prefix(rc, "the run's pipeline plan") : TR_OK;
}

/* --- the records after the resumed step --- */

static int is_record_file(const char *name) {
  size_t n = strlen(name);
  return n > 6 && strcmp(name + n - 6, ".jsonl") == 0 &&
         (strcmp(name, "metrics.jsonl") == 0 || strncmp(name, "stage-", 6) == 0 || strncmp(name, "pipeline-", 9) == 0);
}

int pipe_ckpt_truncate_records(const char *run, int64_t step, int *dropped) {
  DIR *d = opendir(run);
  *dropped = 0;
  if (!d) return tr_fail(TR_EIO, "cannot list %s", run);
  int rc = TR_OK;
  struct dirent *e;
  while (!rc && (e = readdir(d))) {
    if (!is_record_file(e->d_name)) continue;
    char path[1200];
    int n = 0;
    snprintf(path, sizeof path, "%s/%s", run, e->d_name);
    rc = tr_jsonl_keep_until(path, step, &n);
    *dropped += n;
  }
  closedir(d);
  return rc;
}
