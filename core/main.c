/* main.c — the `transom` command line: subcommands and their --help.
 *
 *   transom run JOB.lua [--set key=value]...   train (one replica)
 *   transom sample RUN [--prompt S] [--tokens N] [--temperature X] [--seed N]
 *   transom test [busted options] [spec dir]   Lua specs inside this binary
 *   transom lua SCRIPT [args]                  run a Lua script with `transom`
 *   transom version
 *
 * This is the only file that may end the process: library code returns
 * errors, main prints them and picks the exit status (0 ok, 1 runtime error,
 * 2 bad usage or bad job file).
 */
#include <lauxlib.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "job.h"
#include "kernels.h"
#include "lua_graph.h"
#include "lua_host.h"
#include "trainer.h"
#include "util.h"

static void die_usage(const char *msg) {
  fprintf(stderr, "transom: %s\n", msg);
  exit(2);
}

static int is_help(const char *a) { return strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0; }

/* --- transom run --- */

static volatile sig_atomic_t stop_requested;
static void on_stop(int sig) {
  (void)sig;
  stop_requested = 1;
}

static const char run_usage[] =
    "usage: transom run JOB.lua [--set key=value]...\n"
    "\n"
    "Trains the model the job file describes. The job file returns a table;\n"
    "every key is checked. --set overrides any key (repeatable). Output goes\n"
    "to the run directory: job.lua (resolved job), vocab.json, metrics.jsonl,\n"
    "model.safetensors. Ctrl-C stops early and still saves the weights.\n"
    "\n"
    "Job keys (name, type, default, meaning):\n";

static int default_run_dir(const job_config *cfg, char *out, size_t n) {
  if (cfg->run_dir[0]) {
    snprintf(out, n, "%s", cfg->run_dir);
    return 0;
  }
  char stamp[32];
  time_t now = time(NULL);
  struct tm tm;
  localtime_r(&now, &tm);
  strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &tm);
  snprintf(out, n, "runs/%s-%s", cfg->name, stamp);
  for (int i = 2; access(out, F_OK) == 0 && i < 1000; i++) snprintf(out, n, "runs/%s-%s-%d", cfg->name, stamp, i);
  return 0;
}

static int write_text(const char *dir, const char *file, const char *text) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/%s", dir, file);
  return tr_write_file_atomic(path, text, strlen(text));
}

static int cmd_run(int argc, char **argv) {
  const char *job_path = NULL;
  const char **sets = calloc((size_t)argc + 1, sizeof(char *));
  int nsets = 0;
  lua_State *L = lua_host_new();
  if (!sets || !L) die_usage(tr_error());
  for (int i = 0; i < argc; i++) {
    if (is_help(argv[i])) {
      fputs(run_usage, stdout);
      job_help(L);
      return 0;
    } else if (strcmp(argv[i], "--set") == 0 && i + 1 < argc) {
      sets[nsets++] = argv[++i];
    } else if (strncmp(argv[i], "--set=", 6) == 0) {
      sets[nsets++] = argv[i] + 6;
    } else if (argv[i][0] == '-') {
      fprintf(stderr, "transom run: unknown option '%s' (see transom run --help)\n", argv[i]);
      return 2;
    } else if (!job_path) {
      job_path = argv[i];
    } else {
      fprintf(stderr, "transom run: one job file only ('%s' and '%s')\n", job_path, argv[i]);
      return 2;
    }
  }
  if (!job_path) {
    fputs(run_usage, stderr);
    return 2;
  }
  job_config cfg;
  if (job_load(L, job_path, sets, nsets, &cfg)) {
    fprintf(stderr, "transom: %s\n", tr_error());
    return 2;
  }
  free(sets);
  trainer *t = trainer_create(L, &cfg);
  if (!t) {
    fprintf(stderr, "transom: %s\n", tr_error());
    return 2;
  }
  char dir[PATH_MAX - 64];
  default_run_dir(&cfg, dir, sizeof dir);
  char *dump = job_dump(L, &cfg);
  if (tr_mkdirs(dir) || !dump || write_text(dir, "job.lua", dump) || trainer_save(t, dir)) {
    fprintf(stderr, "transom: run directory: %s\n", tr_error());
    free(dump);
    trainer_free(t);
    return 1;
  }
  free(dump);
  char mpath[PATH_MAX];
  snprintf(mpath, sizeof mpath, "%s/metrics.jsonl", dir);
  FILE *metrics = fopen(mpath, "w");
  if (!metrics) {
    fprintf(stderr, "transom: cannot create %s\n", mpath);
    trainer_free(t);
    return 1;
  }
  graph_sizes sz;
  graph_sizes_get(trainer_graph(t), &sz);
  printf("transom %s | job %s | run %s\n", TRANSOM_VERSION, cfg.path, dir);
  printf("model %s: %lld parameters, vocab %d, %lld threads | data %s: %lld tokens (%lld train, %lld val)\n", cfg.model,
         (long long)sz.params, trainer_data(t)->voc.size, (long long)kernels_threads(), cfg.data,
         (long long)trainer_data(t)->n, (long long)trainer_data(t)->n_train,
         (long long)(trainer_data(t)->n - trainer_data(t)->n_train));
  signal(SIGINT, on_stop);
  signal(SIGTERM, on_stop);

  int rc = 0;
  double sum_time = 0, sum_tokens = 0;
  int64_t timed = 0;
  float val = NAN;
  int width = snprintf(NULL, 0, "%lld", (long long)cfg.max_steps);
  step_stats st = {0};
  while (st.step < cfg.max_steps && !stop_requested) {
    if ((rc = trainer_step(t, &st))) break;
    if (st.step > 1) { /* the first step warms caches and thread pools */
      sum_time += st.t_total;
      sum_tokens += (double)st.tokens;
      timed++;
    }
    if (st.step % cfg.log_interval == 0 || st.step == cfg.max_steps)
      printf("step %*lld/%lld | loss %.4f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s\n", width, (long long)st.step,
             (long long)cfg.max_steps, st.loss, st.lr, st.grad_norm, st.t_total * 1e3, st.tokens / st.t_total);
    fprintf(metrics,
            "{\"step\":%lld,\"loss\":%.9g,\"lr\":%.9g,\"grad_norm\":%.9g,\"ms\":%.3f,\"tok_s\":%.1f,"
            "\"data_ms\":%.3f,\"fwd_ms\":%.3f,\"bwd_ms\":%.3f,\"opt_ms\":%.3f}\n",
            (long long)st.step, st.loss, st.lr, st.grad_norm, st.t_total * 1e3, st.tokens / st.t_total,
            st.t_data * 1e3, st.t_fwd * 1e3, st.t_bwd * 1e3, st.t_opt * 1e3);
    fflush(metrics);
    int last = st.step == cfg.max_steps;
    if ((cfg.eval_interval > 0 && st.step % cfg.eval_interval == 0) || last) {
      if ((rc = trainer_eval(t, &val))) break;
      printf("step %*lld/%lld | val loss %.4f\n", width, (long long)st.step, (long long)cfg.max_steps, val);
      fprintf(metrics, "{\"step\":%lld,\"val_loss\":%.9g}\n", (long long)st.step, val);
      fflush(metrics);
    }
    fflush(stdout);
  }
  fclose(metrics);
  if (rc) {
    fprintf(stderr, "transom: step %lld: %s\n", (long long)st.step + 1, tr_error());
  } else if (trainer_save(t, dir)) {
    fprintf(stderr, "transom: saving weights: %s\n", tr_error());
    rc = 1;
  }
  if (stop_requested) printf("stopped at step %lld; weights saved in %s\n", (long long)st.step, dir);
  if (timed > 0) {
    double ms = sum_time / (double)timed * 1e3;
    printf("done: %lld steps | %.1f ms/step | %.0f tok/s | %.2f GFLOP/s (steps 2..%lld)\n", (long long)st.step, ms,
           sum_tokens / sum_time, trainer_flops_per_step(t) / (ms * 1e-3) * 1e-9, (long long)st.step);
  }
  double rss = (double)tr_peak_rss(), plan = (double)trainer_planned_bytes(t);
  printf("memory: peak RSS %.1f MiB | planned %.1f MiB (params, grads, AdamW, activations) | ratio %.2f\n",
         rss / 1048576.0, plan / 1048576.0, rss / plan);
  if (!rc && cfg.sample_tokens > 0 && !stop_requested) {
    printf("--- sample (%lld tokens, temperature %.2f) ---\n", (long long)cfg.sample_tokens, cfg.temperature);
    if (trainer_sample(t, cfg.sample_prompt, cfg.sample_tokens, (float)cfg.temperature, (uint64_t)cfg.seed, stdout)) {
      fprintf(stderr, "transom: sample: %s\n", tr_error());
      rc = 1;
    }
  }
  printf("run directory: %s\n", dir);
  trainer_free(t);
  lua_host_close(L);
  return rc ? 1 : 0;
}

/* --- transom sample --- */

static const char sample_usage[] =
    "usage: transom sample RUN [--prompt TEXT] [--tokens N] [--temperature X] [--seed N]\n"
    "\n"
    "Generates text from the weights a run saved (RUN/model.safetensors),\n"
    "with the model and vocabulary of RUN/job.lua and RUN/vocab.json.\n"
    "Defaults: the job's sample_prompt, 200 tokens, temperature 1.0, the\n"
    "job's seed.\n";

static int parse_int(const char *s, long long lo, long long hi, long long *out) {
  char *end;
  long long v = strtoll(s, &end, 10);
  if (end == s || *end || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

static int cmd_sample(int argc, char **argv) {
  const char *run = NULL, *prompt = NULL;
  long long ntok = 200, seed = -1;
  double temp = 1.0;
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    if (is_help(a)) {
      fputs(sample_usage, stdout);
      return 0;
    }
    int has = i + 1 < argc;
    if (strcmp(a, "--prompt") == 0 && has) prompt = argv[++i];
    else if (strcmp(a, "--tokens") == 0 && has) {
      if (parse_int(argv[++i], 0, 1 << 24, &ntok)) die_usage("sample: --tokens must be an integer in 0..16777216");
    } else if (strcmp(a, "--seed") == 0 && has) {
      if (parse_int(argv[++i], 0, LLONG_MAX, &seed)) die_usage("sample: --seed must be a non-negative integer");
    } else if (strcmp(a, "--temperature") == 0 && has) {
      char *end;
      temp = strtod(argv[++i], &end);
      if (*end || !(temp > 0)) die_usage("sample: --temperature must be a positive number");
    } else if (a[0] == '-') {
      fprintf(stderr, "transom sample: unknown option '%s' (see transom sample --help)\n", a);
      return 2;
    } else if (!run) run = a;
    else die_usage("sample: one run directory only");
  }
  if (!run) {
    fputs(sample_usage, stderr);
    return 2;
  }
  char path[PATH_MAX];
  lua_State *L = lua_host_new();
  if (!L) die_usage(tr_error());
  job_config cfg;
  vocab v;
  graph *g = NULL;
  int rc;
  snprintf(path, sizeof path, "%s/job.lua", run);
  if ((rc = job_load(L, path, NULL, 0, &cfg))) goto done;
  snprintf(path, sizeof path, "%s/vocab.json", run);
  if ((rc = vocab_load(&v, path))) goto done;
  kernels_set_threads(cfg.threads > 0 ? (int)cfg.threads : 1);
  if ((rc = model_build(L, cfg.lua_ref, v.size, 1, 0, &g))) goto done;
  snprintf(path, sizeof path, "%s/model.safetensors", run);
  if ((rc = model_load_params(g, path))) goto done;
  rc = model_generate(g, &v, prompt ? prompt : cfg.sample_prompt, ntok, (float)temp,
                      seed >= 0 ? (uint64_t)seed : (uint64_t)cfg.seed, stdout);
done:
  if (rc) fprintf(stderr, "transom sample: %s\n", tr_error());
  graph_free(g);
  lua_host_close(L);
  return rc ? 1 : 0;
}

/* --- transom test / transom lua --- */

static const char test_usage[] =
    "usage: transom test [busted options] [SPEC_DIR]\n"
    "\n"
    "Runs the busted specs (spec/*_spec.lua by default) inside this binary,\n"
    "so they test the same Lua VM and `transom` module users get.\n"
    "TRANSOM_BIN is set to this executable for specs that spawn it.\n";

static void set_self_env(void) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0 && !getenv("TRANSOM_BIN")) {
    self[n] = 0;
    setenv("TRANSOM_BIN", self, 1);
  }
}

/* Runs `chunk` with global arg = {[0]=name, argv...}. */
static int run_lua_main(const char *name, int argc, char **argv, const char *chunk_or_file, int is_file) {
  lua_State *L = lua_host_new();
  if (!L) die_usage(tr_error());
  lua_createtable(L, argc, 1);
  lua_pushstring(L, name);
  lua_rawseti(L, -2, 0);
  for (int i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i + 1);
  }
  lua_setglobal(L, "arg");
  int rc = is_file ? luaL_loadfile(L, chunk_or_file) : luaL_loadstring(L, chunk_or_file);
  if (rc != LUA_OK) {
    fprintf(stderr, "transom: %s\n", lua_tostring(L, -1));
    lua_close(L);
    return 2;
  }
  for (int i = 0; i < argc; i++) lua_pushstring(L, argv[i]);
  rc = lua_host_pcall(L, argc, 0);
  if (rc) fprintf(stderr, "transom: %s\n", getenv("TRANSOM_TRACE") ? lua_host_traceback() : tr_error());
  lua_close(L);
  return rc ? 1 : 0;
}

static int cmd_test(int argc, char **argv) {
  for (int i = 0; i < argc; i++)
    if (is_help(argv[i])) {
      fputs(test_usage, stdout);
      return 0;
    }
  set_self_env();
  return run_lua_main("busted", argc, argv, "require('busted.runner')({ standalone = false })", 0);
}

static int cmd_lua(int argc, char **argv) {
  if (argc < 1 || is_help(argv[0])) {
    fputs("usage: transom lua SCRIPT [args]\n\nRuns a Lua script in transom's VM (require 'transom' works).\n",
          argc < 1 ? stderr : stdout);
    return argc < 1 ? 2 : 0;
  }
  set_self_env();
  return run_lua_main(argv[0], argc - 1, argv + 1, argv[0], 1);
}

/* --- dispatch --- */

static const char main_usage[] =
    "transom — fault-tolerant training runtime for language models\n"
    "\n"
    "usage: transom COMMAND [options]   (transom COMMAND --help for details)\n"
    "\n"
    "  run JOB.lua      train the model a job file describes\n"
    "  sample RUN       generate text from a finished run's weights\n"
    "  test [DIR]       run the Lua specs inside this binary\n"
    "  lua SCRIPT       run a Lua script with the transom module\n"
    "  version          print the version\n";

int main(int argc, char **argv) {
  if (argc < 2 || is_help(argv[1]) || strcmp(argv[1], "help") == 0) {
    fputs(main_usage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "run") == 0) return cmd_run(argc - 2, argv + 2);
  if (strcmp(cmd, "sample") == 0) return cmd_sample(argc - 2, argv + 2);
  if (strcmp(cmd, "test") == 0) return cmd_test(argc - 2, argv + 2);
  if (strcmp(cmd, "lua") == 0) return cmd_lua(argc - 2, argv + 2);
  if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
    printf("transom %s\n", TRANSOM_VERSION);
    return 0;
  }
  fprintf(stderr, "transom: unknown command '%s'\n\n%s", cmd, main_usage);
  return 2;
}
