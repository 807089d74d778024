/* plot.c — `transom plot RUN [-o run.png]`: a picture of a run with gnuplot.
 *
 * Reads RUN/metrics.jsonl (per-step lines {"step","worker","loss","step_s",...};
 * single-replica runs have no "worker"; evaluation lines {"step","val_loss"})
 * and RUN/events.jsonl ({"time","step","worker","kind",...}), writes the
 * series into a temporary folder and runs gnuplot (Debian: gnuplot-nox):
 *   top:    loss per worker and validation loss against the step;
 *   bottom: step time per worker (ms);
 *   both:   a vertical line at the step of every anomaly (red), action
 *           (blue) and replica failure (grey).
 * It draws only; it does not compute statistics. core/cli/main.c dispatches
 * `transom plot` here. Returns an exit status: 0 ok, 1 failure, 2 bad usage.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util.h"

#define PLOT_MAX_WORKERS 64
#define PLOT_MAX_MARKS 400
#define PLOT_LINE_MAX 65536

int plot_main(int argc, char **argv);

static const char plot_usage[] =
    "usage: transom plot RUN [-o FILE.png] [--size WIDTHxHEIGHT]\n"
    "\n"
    "Draws RUN/metrics.jsonl and RUN/events.jsonl with gnuplot (Debian package\n"
    "gnuplot-nox): loss and validation loss against the step, step time per\n"
    "worker, and the steps of anomalies (red), actions (blue) and replica\n"
    "failures (grey) as vertical lines. FILE defaults to RUN/run.png.\n";

/* --- reading JSON lines (flat objects, as transom writes them) --- */

/* The value of "key": in a one-line JSON object, as a number. Accepts the
 * nan / inf that printf writes for non-finite values. */
static int json_num(const char *line, const char *key, double *out) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *p = strstr(line, pat);
  if (!p) return 0;
  p += strlen(pat);
  while (*p == ' ') p++;
  if (*p == '"' || strncmp(p, "null", 4) == 0) return 0;
  char *end;
  double v = strtod(p, &end);
  if (end == p) return 0;
  *out = v;
  return 1;
}

static int json_str(const char *line, const char *key, char *out, size_t n) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\":\"", key);
  const char *p = strstr(line, pat);
  if (!p || n == 0) return 0;
  p += strlen(pat);
  size_t k = 0;
  for (; *p && *p != '"' && k + 1 < n; p++) {
    if (*p == '\\' && p[1]) p++;
    out[k++] = *p;
  }
  out[k] = 0;
  return 1;
}

/* gnuplot single-quoted strings: a quote is doubled. */
static void gp_quoted(FILE *f, const char *s) {
  fputc('\'', f);
  for (; *s; s++) {
    if (*s == '\'') fputc('\'', f);
    fputc(*s, f);
  }
  fputc('\'', f);
}

static void put_num(FILE *f, double v) {
  if (isfinite(v)) fprintf(f, " %.9g", v);
  else fputs(" ?", f);
}

/* --- the plot --- */

typedef struct {
  double step;
  int color; /* 0 anomaly, 1 action, 2 failure */
} mark;

typedef struct {
  char dir[PATH_MAX];
  FILE *w[PLOT_MAX_WORKERS];
  FILE *val;
  long nval, nsteps;
  int nworkers_dropped;
  mark marks[PLOT_MAX_MARKS];
  int nmarks, marks_dropped;
} plot_data;

static int read_metrics(plot_data *p, const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return tr_fail(TR_EIO, "cannot open %s: %s", path, strerror(errno));
  char *line = malloc(PLOT_LINE_MAX);
  if (!line) {
    fclose(f);
    return tr_fail(TR_ENOMEM, "out of memory");
  }
  int rc = TR_OK;
  while (fgets(line, PLOT_LINE_MAX, f)) {
    double step, v, worker = 0, ms = NAN, loss = NAN;
    if (!json_num(line, "step", &step)) continue;
    if (json_num(line, "val_loss", &v)) {
      char fn[PATH_MAX + 16];
      if (!p->val) {
        snprintf(fn, sizeof fn, "%s/val.dat", p->dir);
        if (!(p->val = fopen(fn, "w"))) {
          rc = tr_fail(TR_EIO, "cannot write %s: %s", fn, strerror(errno));
          break;
        }
      }
      fprintf(p->val, "%.0f", step);
      put_num(p->val, v);
      fputc('\n', p->val);
      p->nval++;
      continue;
    }
    json_num(line, "worker", &worker);
    json_num(line, "loss", &loss);
    if (json_num(line, "step_s", &ms)) ms *= 1e3;
    int w = (int)worker;
    if (w < 0 || w >= PLOT_MAX_WORKERS) {
      p->nworkers_dropped++;
      continue;
    }
    if (!p->w[w]) {
      char fn[PATH_MAX + 16];
      snprintf(fn, sizeof fn, "%s/w%d.dat", p->dir, w);
      if (!(p->w[w] = fopen(fn, "w"))) {
        rc = tr_fail(TR_EIO, "cannot write %s: %s", fn, strerror(errno));
        break;
      }
    }
    fprintf(p->w[w], "%.0f", step);
    put_num(p->w[w], loss);
    put_num(p->w[w], ms);
    fputc('\n', p->w[w]);
    p->nsteps++;
  }
  free(line);
  fclose(f);
  return rc;
}

static void read_events(plot_data *p, const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return; /* a run without events draws without marks */
  char line[8192], kind[64];
  while (fgets(line, sizeof line, f)) {
    double step;
    if (!json_num(line, "step", &step) || step < 0 || !json_str(line, "kind", kind, sizeof kind)) continue;
    int color = strcmp(kind, "anomaly") == 0 ? 0 : strcmp(kind, "action") == 0 ? 1 : -1;
    if (color == 1) { /* "ignore" decisions are not drawn */
      char action[32];
      if (json_str(line, "action", action, sizeof action) && strcmp(action, "ignore") == 0) continue;
    }
    if (strcmp(kind, "replica_failed") == 0 || strcmp(kind, "restart_all") == 0 ||
        strcmp(kind, "all_replicas_dead") == 0)
      color = 2;
    if (color < 0) continue;
    int dup = 0;
    for (int i = 0; i < p->nmarks && !dup; i++) dup = p->marks[i].step == step && p->marks[i].color == color;
    if (dup) continue;
    if (p->nmarks == PLOT_MAX_MARKS) {
      p->marks_dropped++;
      continue;
    }
    p->marks[p->nmarks++] = (mark){step, color};
  }
  fclose(f);
}

static int write_script(plot_data *p, const char *script, const char *out, const char *title, int width, int height,
                        const char *terminal) {
  FILE *f = fopen(script, "w");
  if (!f) return tr_fail(TR_EIO, "cannot write %s: %s", script, strerror(errno));
  static const char *const colors[] = {"#d62728", "#1f77b4", "#7f7f7f"};
  static const char *const names[] = {"anomaly", "action", "replica failure"};
  fprintf(f, "set terminal %s size %d,%d noenhanced\nset output ", terminal, width, height);
  gp_quoted(f, out);
  fprintf(f, "\nset datafile missing '?'\nset grid\nset key outside right top\nset xlabel 'step'\n"
             "set lmargin at screen 0.08\nset rmargin at screen 0.80\n"); /* both panels share the step axis */
  int used[3] = {0, 0, 0};
  for (int i = 0; i < p->nmarks; i++) {
    fprintf(f, "set arrow from %.0f, graph 0 to %.0f, graph 1 nohead lc rgb '%s' dt 2 lw 1\n", p->marks[i].step,
            p->marks[i].step, colors[p->marks[i].color]);
    used[p->marks[i].color] = 1;
  }
  fprintf(f, "set multiplot layout %d,1 title ", p->nsteps ? 2 : 1);
  gp_quoted(f, title);
  fprintf(f, "\nset ylabel 'loss'\nplot ");
  int first = 1;
  for (int w = 0; w < PLOT_MAX_WORKERS; w++)
    if (p->w[w]) {
      fprintf(f, "%s'%s/w%d.dat' using 1:2 with lines lw 1 title 'loss, worker %d'", first ? "" : ", ", p->dir, w, w);
      first = 0;
    }
  if (p->val) {
    fprintf(f, "%s'%s/val.dat' using 1:2 with linespoints lw 2 pt 7 ps 0.6 title 'val loss'", first ? "" : ", ", p->dir);
    first = 0;
  }
  for (int c = 0; c < 3; c++) /* legend entries for the vertical lines */
    if (used[c]) fprintf(f, ", NaN with lines lc rgb '%s' dt 2 title '%s'", colors[c], names[c]);
  if (p->nsteps == 0) goto end; /* evaluations only: no step-time panel */
  fprintf(f, "\nset ylabel 'step time (ms)'\nset yrange [0:*]\nplot ");
  first = 1;
  for (int w = 0; w < PLOT_MAX_WORKERS; w++)
    if (p->w[w]) {
      fprintf(f, "%s'%s/w%d.dat' using 1:3 with lines lw 1 title 'worker %d'", first ? "" : ", ", p->dir, w, w);
      first = 0;
    }
end:
  fprintf(f, "\nunset multiplot\nset output\n");
  if (fclose(f) != 0) return tr_fail(TR_EIO, "cannot write %s", script);
  return TR_OK;
}

static void cleanup(plot_data *p) {
  char fn[PATH_MAX + 32];
  for (int w = 0; w < PLOT_MAX_WORKERS; w++)
    if (p->w[w]) {
      fclose(p->w[w]);
      p->w[w] = NULL;
      snprintf(fn, sizeof fn, "%s/w%d.dat", p->dir, w);
      unlink(fn);
    }
  if (p->val) {
    fclose(p->val);
    p->val = NULL;
  }
  snprintf(fn, sizeof fn, "%s/val.dat", p->dir);
  unlink(fn);
  snprintf(fn, sizeof fn, "%s/plot.gp", p->dir);
  unlink(fn);
  rmdir(p->dir);
}

int plot_main(int argc, char **argv) {
  static const char *const value_flags[] = {"-o", "--output", "--size", NULL};
  const char *run = NULL, *out = NULL;
  int width = 1200, height = 900;
  for (int i = 0; i < argc; i++) {
    if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
      fputs(plot_usage, stdout);
      return 0;
    } else if (tr_flag_lacks_value(argc, argv, i, value_flags)) {
      fprintf(stderr, "transom plot: %s needs a value\n\n%s", argv[i], plot_usage);
      return 2;
    } else if (strcmp(argv[i], "-o") == 0 || strcmp(argv[i], "--output") == 0) {
      out = argv[++i];
    } else if (strcmp(argv[i], "--size") == 0) {
      if (sscanf(argv[++i], "%dx%d", &width, &height) != 2 || width < 100 || height < 100 || width > 10000 ||
          height > 10000) {
        fprintf(stderr, "transom plot: --size must be WIDTHxHEIGHT (100..10000)\n");
        return 2;
      }
    } else if (argv[i][0] == '-' || run) {
      fprintf(stderr, "transom plot: unexpected argument '%s'\n\n%s", argv[i], plot_usage);
      return 2;
    } else {
      run = argv[i];
    }
  }
  if (!run) {
    fputs(plot_usage, stderr);
    return 2;
  }
  char metrics[PATH_MAX], events[PATH_MAX], outbuf[PATH_MAX], script[PATH_MAX + 16];
  snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", run);
  snprintf(events, sizeof events, "%s/events.jsonl", run);
  if (!out) {
    snprintf(outbuf, sizeof outbuf, "%s/run.png", run);
    out = outbuf;
  }
  plot_data *p = calloc(1, sizeof *p);
  if (!p) {
    fprintf(stderr, "transom plot: out of memory\n");
    return 1;
  }
  const char *tmp = getenv("TMPDIR");
  snprintf(p->dir, sizeof p->dir, "%s/transom-plot-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  int rc;
  if (!mkdtemp(p->dir)) {
    fprintf(stderr, "transom plot: cannot make a temporary folder: %s\n", strerror(errno));
    free(p);
    return 1;
  }
  if ((rc = read_metrics(p, metrics))) goto done;
  if (p->nsteps == 0 && p->nval == 0) {
    rc = tr_fail(TR_EFORMAT, "%s has no steps to plot", metrics);
    goto done;
  }
  read_events(p, events);
  for (int w = 0; w < PLOT_MAX_WORKERS; w++)
    if (p->w[w]) fflush(p->w[w]);
  if (p->val) fflush(p->val);
  snprintf(script, sizeof script, "%s/plot.gp", p->dir);
  if ((rc = write_script(p, script, out, run, width, height, "pngcairo"))) goto done;
  if ((rc = tr_run_gnuplot(script))) { /* a gnuplot without cairo: the libgd terminal */
    if (strstr(tr_error(), "not found")) goto done;
    if ((rc = write_script(p, script, out, run, width, height, "png"))) goto done;
    rc = tr_run_gnuplot(script);
  }
done:
  if (rc) fprintf(stderr, "transom plot: %s\n", tr_error());
  else
    printf("transom plot: wrote %s (%ld steps, %ld evaluations, %d marks%s)\n", out, p->nsteps, p->nval, p->nmarks,
           p->marks_dropped ? ", some marks left out" : "");
  cleanup(p);
  free(p);
  return rc ? 1 : 0;
}
