/* sim_cli.c — `transom sim SCENARIO.lua`: runs the simulation (sim.c) of a
 * scenario (sim_scenario.c) in both modes and reports
 *   - at the file's own size: ETTR, goodput and where the lost time went;
 *   - with `sweep`: ETTR and goodput against the GPU count, beside the
 *     file's published reference points, and a PNG plot (-o, gnuplot);
 *   - with `sensitivity`: each cost divided and multiplied by a factor at
 *     one size, ranked by how far it moves ETTR.
 * Each point is the mean over `seeds` runs with different failures; both
 * modes and every variant of a cost see the same failures (seeds 1..N).
 * core/cli/main.c dispatches `transom sim` here. Returns an exit status:
 * 0 ok, 1 runtime error, 2 bad usage or bad scenario file.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lua_host.h"
#include "sim.h"
#include "sim_scenario.h"
#include "util.h"

int sim_main(int argc, char **argv);

static const char sim_usage[] =
    "usage: transom sim SCENARIO.lua [--set key=value]... [--seeds N] [-o PLOT.png]\n"
    "       transom sim --help        (this, and every scenario key)\n"
    "\n"
    "Simulates a long training job under failures, in transom's replace mode\n"
    "(only the failed replica restarts; the others train on) and in\n"
    "restart-all (every replica goes back to the last checkpoint), and prints\n"
    "the effective training time ratio (ETTR: training time / wall time) and\n"
    "goodput (the same, each step weighted by the share of replicas in it)\n"
    "with where the rest of the time went. A scenario with `sweep` also gets\n"
    "a table against the GPU count (and a plot with -o); with `sensitivity`,\n"
    "which cost moves ETTR most. Scenarios: examples/sim/.\n"
    "\n"
    "Scenario keys (a cost may also be a function of c = {gpus, replicas,\n"
    "gpus_per_replica, gpus_per_host, hosts}):\n";

/* --- running a point --- */

typedef struct { /* the mean of `seeds` runs */
  int n, unfinished;
  double ettr, ettr_sq, goodput, wall_s, failures, replacements, restarts, rework_steps;
  double lost_s[SIM_NCAUSE];
  int64_t spares;
} agg;

static int run_point(const sim_config *c, sim_mode mode, int64_t seeds, agg *a) {
  memset(a, 0, sizeof *a);
  for (int64_t k = 1; k <= seeds; k++) {
    sim_result r;
    int rc = sim_run(c, mode, (uint64_t)k, &r);
    if (rc) return rc;
    a->n++;
    a->unfinished += !r.finished;
    a->ettr += r.ettr;
    a->ettr_sq += r.ettr * r.ettr;
    a->goodput += r.goodput;
    a->wall_s += r.wall_s;
    a->failures += (double)r.failures;
    a->replacements += (double)r.replacements;
    a->restarts += (double)r.restarts;
    a->rework_steps += (double)r.rework_steps;
    for (int i = 0; i < SIM_NCAUSE; i++) a->lost_s[i] += r.lost_s[i];
    a->spares = r.spares;
  }
  double n = a->n;
  a->ettr /= n, a->ettr_sq /= n, a->goodput /= n, a->wall_s /= n, a->failures /= n;
  a->replacements /= n, a->restarts /= n, a->rework_steps /= n;
  for (int i = 0; i < SIM_NCAUSE; i++) a->lost_s[i] /= n;
  return TR_OK;
}

/* Standard error of the mean ETTR. */
static double ettr_se(const agg *a) {
  if (a->n < 2) return 0;
  double var = (a->ettr_sq - a->ettr * a->ettr) * a->n / (a->n - 1);
  return var > 0 ? sqrt(var / a->n) : 0;
}

static int run_both(const sim_config *c, int64_t seeds, agg a[2]) {
  int rc = run_point(c, SIM_REPLACE, seeds, &a[0]);
  return rc ? rc : run_point(c, SIM_RESTART_ALL, seeds, &a[1]);
}

/* --- printing --- */

static const char *mode_name(sim_mode m) { return m == SIM_REPLACE ? "replace" : "restart_all"; }

/* A duration in the unit that suits it. */
static const char *dur(double s, char *buf, size_t n) {
  if (fabs(s) < 120) snprintf(buf, n, "%.3g s", s);
  else if (fabs(s) < 7200) snprintf(buf, n, "%.1f min", s / 60);
  else if (fabs(s) < 172800) snprintf(buf, n, "%.1f h", s / 3600);
  else snprintf(buf, n, "%.1f d", s / 86400);
  return buf;
}

static double job_failures_per_s(const sim_config *c) {
  return c->per_gpu_hour * (double)(c->replicas * c->gpus_per_replica) / 3600.0 + (c->every_s > 0 ? 1 / c->every_s : 0);
}

static void print_header(const sim_scenario *s, const sim_config *c, const agg *a) {
  char b1[32], b2[32];
  int64_t hosts = c->replicas * ((c->gpus_per_replica + c->gpus_per_host - 1) / c->gpus_per_host);
  printf("scenario %s (%s): %lld GPUs = %lld replicas x %lld GPUs, %lld hosts + %lld spare; %lld steps x %g s = %s "
         "fault-free; mean of %lld runs\n",
         s->name, s->path, (long long)(c->replicas * c->gpus_per_replica), (long long)c->replicas,
         (long long)c->gpus_per_replica, (long long)hosts, (long long)a->spares, (long long)c->steps, c->step_s,
         dur((double)c->steps * c->step_s + c->startup_s, b1, sizeof b1), (long long)s->seeds);
  double rate = job_failures_per_s(c);
  if (rate > 0)
    printf("failures: one every %s for the job (%.3g per GPU-hour), %.0f%% hardware; detection %s\n",
           dur(1 / rate, b1, sizeof b1), c->per_gpu_hour, 100 * c->hardware_fraction, dur(c->detect_s, b2, sizeof b2));
  if (c->nchaos) printf("failures: %d at given steps (failures.chaos)\n", c->nchaos);
}

/* ETTR, goodput, counts and the lost time by cause, both modes. */
static void print_table(const agg a[2]) {
  char b[2][32];
  printf("\n%-26s %-18s %-18s\n", "", "replace", "restart_all");
  printf("%-26s %.4f ±%.4f     %.4f ±%.4f\n", "ETTR", a[0].ettr, ettr_se(&a[0]), a[1].ettr, ettr_se(&a[1]));
  printf("%-26s %-18.4f %-18.4f\n", "goodput", a[0].goodput, a[1].goodput);
  printf("%-26s %-18s %-18s\n", "wall", dur(a[0].wall_s, b[0], 32), dur(a[1].wall_s, b[1], 32));
  printf("%-26s %-18.1f %-18.1f\n", "failures", a[0].failures, a[1].failures);
  printf("%-26s %-18.1f %-18.1f\n", "replicas replaced", a[0].replacements, a[1].replacements);
  printf("%-26s %-18.1f %-18.1f\n", "whole-job restarts", a[0].restarts, a[1].restarts);
  printf("%-26s %-18.0f %-18.0f\n", "steps done again", a[0].rework_steps, a[1].rework_steps);
  printf("lost time, %% of wall:\n");
  for (int i = 0; i < SIM_NCAUSE; i++) {
    if (a[0].lost_s[i] == 0 && a[1].lost_s[i] == 0) continue;
    printf("  %-24s %-18.3f %-18.3f\n", sim_cause_name((sim_cause)i), 100 * a[0].lost_s[i] / a[0].wall_s,
           100 * a[1].lost_s[i] / a[1].wall_s);
  }
  printf("  %-24s %-18.3f %-18.3f\n", "(replicas missing)", 100 * (a[0].ettr - a[0].goodput),
         100 * (a[1].ettr - a[1].goodput));
  for (int m = 0; m < 2; m++)
    if (a[m].unfinished)
      printf("note: %s: %d of %d runs stopped at 100x the fault-free time\n", mode_name(m), a[m].unfinished, a[m].n);
}

static void print_point(const sim_scenario *s, const sim_config *c, const agg a[2]) {
  print_header(s, c, &a[0]);
  print_table(a);
  for (int m = 0; m < 2; m++)
    printf("result mode=%s gpus=%lld ettr=%.5f goodput=%.5f wall_s=%.3f useful_s=%.3f failures=%.1f\n",
           mode_name(m), (long long)(c->replicas * c->gpus_per_replica), a[m].ettr, a[m].goodput, a[m].wall_s,
           (double)c->steps * c->step_s, a[m].failures);
}

/* --- the sweep --- */

typedef struct {
  int64_t gpus, replicas;
  double mtbf_s;
  agg a[2];
} sweep_row;

static int run_sweep(lua_State *L, const sim_scenario *s, sweep_row *rows) {
  for (int i = 0; i < s->nsweep; i++) {
    sim_config c;
    int rc = sim_scenario_resolve(L, s, s->sweep[i], &c);
    if (!rc) rc = run_both(&c, s->seeds, rows[i].a);
    if (rc) return rc;
    rows[i].gpus = s->sweep[i];
    rows[i].replicas = c.replicas;
    double rate = job_failures_per_s(&c);
    rows[i].mtbf_s = rate > 0 ? 1 / rate : INFINITY;
  }
  return TR_OK;
}

static void print_sweep(const sim_scenario *s, const sweep_row *rows) {
  char b[32];
  printf("\nETTR (goodput) against the job's size, mean of %lld runs each:\n", (long long)s->seeds);
  printf("%8s %9s %11s   %-17s %-17s %s\n", "GPUs", "replicas", "MTBF", "replace", "restart_all", "replace/restart_all");
  for (int i = 0; i < s->nsweep; i++) {
    const sweep_row *r = &rows[i];
    printf("%8lld %9lld %11s   %.3f (%.3f)     %.3f (%.3f)     %.2fx\n", (long long)r->gpus,
           (long long)r->replicas, dur(r->mtbf_s, b, sizeof b),
           r->a[0].ettr, r->a[0].goodput, r->a[1].ettr, r->a[1].goodput, r->a[0].ettr / r->a[1].ettr);
  }
}

static void print_refs(const sim_scenario *s) {
  if (s->nrefs) printf("published points (not simulated):\n");
  for (int i = 0; i < s->nrefs; i++)
    printf("%8lld GPUs  %-11s ETTR %.2f  %s\n", (long long)s->refs[i].gpus, mode_name(s->refs[i].mode),
           s->refs[i].ettr, s->refs[i].label);
}

/* --- the plot --- */

static int write_plot_data(const char *dir, const sim_scenario *s, const sweep_row *rows) {
  char fn[PATH_MAX];
  snprintf(fn, sizeof fn, "%s/sweep.dat", dir);
  FILE *f = fopen(fn, "w");
  if (!f) return tr_fail(TR_EIO, "cannot write %s: %s", fn, strerror(errno));
  for (int i = 0; i < s->nsweep; i++)
    fprintf(f, "%lld %.6f %.6f %.6f %.6f\n", (long long)rows[i].gpus, rows[i].a[0].ettr, rows[i].a[0].goodput,
            rows[i].a[1].ettr, rows[i].a[1].goodput);
  if (fclose(f)) return tr_fail(TR_EIO, "cannot write %s", fn);
  for (int m = 0; m < 2; m++) {
    snprintf(fn, sizeof fn, "%s/ref%d.dat", dir, m);
    if (!(f = fopen(fn, "w"))) return tr_fail(TR_EIO, "cannot write %s: %s", fn, strerror(errno));
    int any = 0;
    for (int i = 0; i < s->nrefs; i++)
      if ((int)s->refs[i].mode == m) fprintf(f, "%lld %.4f\n", (long long)s->refs[i].gpus, s->refs[i].ettr), any = 1;
    if (!any) fprintf(f, "NaN NaN\n");
    if (fclose(f)) return tr_fail(TR_EIO, "cannot write %s", fn);
  }
  return TR_OK;
}

/* gnuplot single-quoted strings: a quote is doubled. */
static void gp_quoted(FILE *f, const char *str) {
  fputc('\'', f);
  for (; *str; str++) {
    if (*str == '\'') fputc('\'', f);
    fputc(*str, f);
  }
  fputc('\'', f);
}

static int write_plot_script(const char *script, const char *dir, const sim_scenario *s, const char *out,
                             const char *terminal) {
  FILE *f = fopen(script, "w");
  if (!f) return tr_fail(TR_EIO, "cannot write %s: %s", script, strerror(errno));
  fprintf(f, "set terminal %s size 1000,650\nset output ", terminal);
  gp_quoted(f, out);
  fprintf(f, "\nset title ");
  char title[300];
  snprintf(title, sizeof title, "%s: ETTR against GPUs (simulated, mean of %lld runs)", s->name, (long long)s->seeds);
  gp_quoted(f, title);
  fprintf(f, " noenhanced\nset logscale x 2\nset xlabel 'GPUs'\nset ylabel 'ETTR / goodput'\nset yrange [0:1.02]\n"
             "set grid\nset key bottom left\nset xtics (");
  for (int i = 0; i < s->nsweep; i++) {
    int64_t g = s->sweep[i];
    if (g % 1024 == 0) fprintf(f, "%s'%lldK' %lld", i ? ", " : "", (long long)(g / 1024), (long long)g);
    else fprintf(f, "%s'%lld' %lld", i ? ", " : "", (long long)g, (long long)g);
  }
  fprintf(f, ")\n");
  if (s->nsweep) fprintf(f, "set xrange [%g:%g]\n", (double)s->sweep[0] / 1.25, (double)s->sweep[s->nsweep - 1] * 1.25);
  const char *d = dir;
  fprintf(f, "plot '%s/sweep.dat' u 1:2 w lp lw 2 pt 7 lc rgb '#1f77b4' t 'transom replace: ETTR', \\\n", d);
  fprintf(f, "  '' u 1:3 w lp lw 1 dt 2 pt 6 lc rgb '#1f77b4' t 'transom replace: goodput', \\\n");
  fprintf(f, "  '' u 1:4 w lp lw 2 pt 5 lc rgb '#d62728' t 'restart-all: ETTR', \\\n");
  fprintf(f, "  '%s/ref0.dat' u 1:2 w p ps 2.5 pt 9 lc rgb '#2ca02c' t 'FT-HSDP paper (replica recovery)', \\\n", d);
  fprintf(f, "  '%s/ref1.dat' u 1:2 w p ps 2.5 pt 11 lc rgb '#ff7f0e' t 'FT-HSDP paper (synchronous)'\n", d);
  fprintf(f, "set output\n");
  if (fclose(f)) return tr_fail(TR_EIO, "cannot write %s", script);
  return TR_OK;
}

static int plot_sweep(const sim_scenario *s, const sweep_row *rows, const char *out) {
  char dir[PATH_MAX], script[PATH_MAX + 16];
  const char *tmp = getenv("TMPDIR");
  snprintf(dir, sizeof dir, "%s/transom-sim-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(dir)) return tr_fail(TR_EIO, "cannot make a temporary folder: %s", strerror(errno));
  snprintf(script, sizeof script, "%s/plot.gp", dir);
  int rc = write_plot_data(dir, s, rows);
  if (!rc) rc = write_plot_script(script, dir, s, out, "pngcairo");
  if (!rc && (rc = tr_run_gnuplot(script)) && !strstr(tr_error(), "not found")) {
    rc = write_plot_script(script, dir, s, out, "png"); /* a gnuplot without cairo */
    if (!rc) rc = tr_run_gnuplot(script);
  }
  const char *names[] = {"sweep.dat", "ref0.dat", "ref1.dat", "plot.gp"};
  char fn[PATH_MAX + 16];
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    snprintf(fn, sizeof fn, "%s/%s", dir, names[i]);
    unlink(fn);
  }
  rmdir(dir);
  if (!rc) printf("plot: wrote %s\n", out);
  return rc;
}

/* --- sensitivity --- */

/* What the analysis moves, as offsets into sim_config (doubles, but the
 * checkpoint interval, an integer). The failure rate and the spare hosts are
 * not costs of a failure: they are reported apart, never named the dominant
 * cost. */
enum { KNOB_COST, KNOB_RATE, KNOB_CAPACITY };
static const struct {
  const char *key;
  size_t off;
  int integer, kind;
} knobs[] = {
    {"failures.per_gpu_hour", offsetof(sim_config, per_gpu_hour), 0, KNOB_RATE},
    {"failures.detect_s", offsetof(sim_config, detect_s), 0, KNOB_COST},
    {"replace.redo_s", offsetof(sim_config, redo_s), 0, KNOB_COST},
    {"replace.delay_s", offsetof(sim_config, delay_s), 0, KNOB_COST},
    {"replace.start_s", offsetof(sim_config, start_s), 0, KNOB_COST},
    {"replace.catchup_s", offsetof(sim_config, catchup_s), 0, KNOB_COST},
    {"replace.join_s", offsetof(sim_config, join_s), 0, KNOB_COST},
    {"restart_all.restart_s", offsetof(sim_config, restart_s), 0, KNOB_COST},
    {"checkpoint.every_steps", offsetof(sim_config, ckpt_every_steps), 1, KNOB_COST},
    {"checkpoint.stall_s", offsetof(sim_config, ckpt_stall_s), 0, KNOB_COST},
    {"checkpoint.write_s", offsetof(sim_config, ckpt_write_s), 0, KNOB_COST},
    {"checkpoint.load_s", offsetof(sim_config, load_s), 0, KNOB_COST},
    {"hosts.spare_fraction", offsetof(sim_config, spare_fraction), 0, KNOB_CAPACITY},
    {"hosts.repair_s", offsetof(sim_config, repair_s), 0, KNOB_CAPACITY},
    {"job.startup_s", offsetof(sim_config, startup_s), 0, KNOB_COST},
};
#define NKNOBS (sizeof knobs / sizeof knobs[0])

/* c with knob k scaled by f; 0 when the knob is 0 (scaling changes nothing). */
static int knob_scaled(const sim_config *base, size_t k, double f, sim_config *c) {
  *c = *base;
  char *p = (char *)c + knobs[k].off;
  if (knobs[k].integer) {
    int64_t v = *(int64_t *)p;
    if (v == 0) return 0;
    int64_t nv = llround((double)v * f);
    *(int64_t *)p = nv < 1 ? 1 : nv;
  } else {
    if (*(double *)p == 0) return 0;
    *(double *)p *= f;
  }
  return 1;
}

enum { COL_REPLACE, COL_REPLACE_GOODPUT, COL_RESTART_ALL, NCOL };
static const char *col_name[NCOL] = {"replace ETTR", "replace goodput", "restart_all ETTR"};

typedef struct {
  size_t k;
  double v[NCOL][2]; /* [column][divided, multiplied] */
  double spread[NCOL];
} knob_row;

static int cmp_spread(const void *x, const void *y) {
  const knob_row *a = x, *b = y;
  double sa = fmax(a->spread[COL_REPLACE_GOODPUT], a->spread[COL_RESTART_ALL]);
  double sb = fmax(b->spread[COL_REPLACE_GOODPUT], b->spread[COL_RESTART_ALL]);
  return (sa < sb) - (sa > sb);
}

/* The knob of `kind` that moves column `col` most, with any within 0.001
 * of it ("a and b"), and its spread. */
static double dominant(const knob_row *rows, size_t n, int col, int kind, char *name, size_t cap) {
  double best = -1;
  for (size_t i = 0; i < n; i++)
    if (knobs[rows[i].k].kind == kind && rows[i].spread[col] > best) best = rows[i].spread[col];
  name[0] = 0;
  for (size_t i = 0; i < n && best >= 0; i++)
    if (knobs[rows[i].k].kind == kind && rows[i].spread[col] >= best - 1e-3) {
      size_t len = strlen(name);
      snprintf(name + len, cap - len, "%s%s", len ? " and " : "", knobs[rows[i].k].key);
    }
  if (!name[0]) snprintf(name, cap, "-");
  return best;
}

static int knob_row_run(const sim_config *base, const sim_scenario *s, size_t k, knob_row *r) {
  sim_config c;
  agg v[2];
  *r = (knob_row){.k = k};
  for (int d = 0; d < 2; d++) {
    if (!knob_scaled(base, k, d ? s->sens_factor : 1 / s->sens_factor, &c)) return 0;
    int rc = run_both(&c, s->seeds, v);
    if (rc) return rc;
    r->v[COL_REPLACE][d] = v[0].ettr;
    r->v[COL_REPLACE_GOODPUT][d] = v[0].goodput;
    r->v[COL_RESTART_ALL][d] = v[1].ettr;
  }
  for (int col = 0; col < NCOL; col++) r->spread[col] = fabs(r->v[col][1] - r->v[col][0]);
  return 1;
}

static void print_sensitivity(const sim_scenario *s, const knob_row *rows, size_t n) {
  printf("\nsensitivity at %lld GPUs: each cost divided (/) and multiplied (x) by %g, the rest as above;\n"
         "rows by the largest spread of replace goodput or restart_all ETTR\n", (long long)s->sens_gpus, s->sens_factor);
  printf("%-24s", "cost");
  for (int col = 0; col < NCOL; col++) printf("   %-24s", col_name[col]);
  printf("\n%-24s", "");
  for (int col = 0; col < NCOL; col++) printf("   %-24s", "   /     x     (spread)");
  printf("\n");
  for (size_t i = 0; i < n; i++) {
    printf("%-24s", knobs[rows[i].k].key);
    for (int col = 0; col < NCOL; col++)
      printf("   %.3f %.3f (%.3f)     ", rows[i].v[col][0], rows[i].v[col][1], rows[i].spread[col]);
    printf("\n");
  }
  char name[160];
  printf("dominant cost at %lld GPUs (spread of ETTR or goodput, x%g against /%g):\n", (long long)s->sens_gpus,
         s->sens_factor, s->sens_factor);
  for (int col = 0; col < NCOL; col++) {
    double d = dominant(rows, n, col, KNOB_COST, name, sizeof name);
    printf("  %-17s %s (%.3f)", col_name[col], name, d);
    d = dominant(rows, n, col, KNOB_RATE, name, sizeof name);
    if (d >= 0) printf("; not a cost: the failure rate %.3f", d);
    d = dominant(rows, n, col, KNOB_CAPACITY, name, sizeof name);
    if (d >= 0) printf(", spare capacity (%s) %.3f", name, d);
    printf("\n");
  }
}

static int run_sensitivity(lua_State *L, const sim_scenario *s) {
  sim_config base;
  agg a[2];
  int rc = sim_scenario_resolve(L, s, s->sens_gpus, &base);
  if (!rc) rc = run_both(&base, s->seeds, a);
  if (rc) return rc;
  printf("\nat %lld GPUs (%lld replicas):", (long long)s->sens_gpus, (long long)base.replicas);
  print_table(a);
  knob_row rows[NKNOBS];
  size_t n = 0;
  for (size_t k = 0; k < NKNOBS; k++) {
    int got = knob_row_run(&base, s, k, &rows[n]);
    if (got < 0) return got;
    n += (size_t)got;
  }
  qsort(rows, n, sizeof rows[0], cmp_spread);
  print_sensitivity(s, rows, n);
  return TR_OK;
}

/* --- the command --- */

typedef struct {
  const char *path, *plot;
  const char **sets;
  int nsets;
  long long seeds; /* 0: the scenario's */
} sim_args;

/* 0 ok, 1 printed help, 2 bad usage. */
static int parse_args(int argc, char **argv, sim_args *a) {
  static const char *const value_flags[] = {"--set", "-o", "--seeds", NULL};
  for (int i = 0; i < argc; i++) {
    const char *x = argv[i];
    if (strcmp(x, "--help") == 0 || strcmp(x, "-h") == 0) return 1;
    if (tr_flag_lacks_value(argc, argv, i, value_flags)) {
      fprintf(stderr, "transom sim: %s needs a value (see transom sim --help)\n", x);
      return 2;
    }
    if (strcmp(x, "--set") == 0) a->sets[a->nsets++] = argv[++i];
    else if (strcmp(x, "-o") == 0) a->plot = argv[++i];
    else if (strcmp(x, "--seeds") == 0) {
      char *end;
      a->seeds = strtoll(argv[++i], &end, 10);
      if (*end || a->seeds < 1 || a->seeds > 1000) {
        fprintf(stderr, "transom sim: --seeds must be an integer in 1..1000\n");
        return 2;
      }
    } else if (x[0] == '-' || a->path) {
      fprintf(stderr, "transom sim: unexpected argument '%s' (see transom sim --help)\n", x);
      return 2;
    } else a->path = x;
  }
  if (!a->path) {
    fputs(sim_usage, stderr);
    return 2;
  }
  return 0;
}

/* Resolves every size the scenario names before anything runs, so that a
 * cost function that fails at one of them refuses the file up front. */
static int check_sizes(lua_State *L, const sim_scenario *s) {
  sim_config c;
  int rc = sim_scenario_resolve(L, s, s->sens_gpus, &c);
  for (int i = 0; i < s->nsweep && !rc; i++) rc = sim_scenario_resolve(L, s, s->sweep[i], &c);
  return rc;
}

/* The point, the sweep and the published points, the sensitivity, then the
 * plot: a plot that fails (no gnuplot) comes after every table. */
static int run_all(lua_State *L, sim_scenario *s, const sim_args *a) {
  sim_config c;
  agg pt[2];
  sweep_row *rows = NULL;
  if (a->plot && !s->nsweep) return tr_fail(TR_EINVAL, "%s has no sweep to plot", s->path);
  int rc = check_sizes(L, s);
  if (!rc) rc = sim_scenario_resolve(L, s, 0, &c);
  if (!rc) rc = run_both(&c, s->seeds, pt);
  if (rc) return rc;
  print_point(s, &c, pt);
  if (s->nsweep) {
    if (!(rows = calloc((size_t)s->nsweep, sizeof *rows))) return tr_fail(TR_ENOMEM, "out of memory");
    rc = run_sweep(L, s, rows);
    if (!rc) print_sweep(s, rows);
  }
  if (!rc) print_refs(s);
  if (!rc && s->sens_gpus) rc = run_sensitivity(L, s);
  if (!rc && a->plot && (rc = plot_sweep(s, rows, a->plot)))
    tr_fail_prefix(rc, "every table is above; the plot %s", a->plot);
  free(rows);
  return rc;
}

int sim_main(int argc, char **argv) {
  const char *sets[argc > 0 ? argc : 1];
  sim_args a = {.sets = sets};
  int prc = parse_args(argc, argv, &a);
  lua_State *L = prc == 2 ? NULL : lua_host_new();
  if (prc == 2) return 2;
  if (!L) {
    fprintf(stderr, "transom sim: %s\n", tr_error());
    return 1;
  }
  if (prc == 1) {
    fputs(sim_usage, stdout);
    int rc = sim_scenario_help(L);
    lua_host_close(L);
    return rc ? 1 : 0;
  }
  sim_scenario s;
  int rc = sim_scenario_load(L, a.path, a.sets, a.nsets, &s);
  if (!rc) {
    if (a.seeds) s.seeds = a.seeds;
    rc = run_all(L, &s, &a);
  }
  if (rc) fprintf(stderr, "transom sim: %s\n", tr_error());
  sim_scenario_free(L, &s);
  lua_host_close(L);
  /* the scenario's fault (a key, a cost function, a value out of range): 2 */
  return rc == TR_ELUA || rc == TR_EINVAL ? 2 : rc ? 1 : 0;
}
