/* main.c — the `transom` command line: subcommands and their --help.
 *
 *   transom run JOB.lua [--set key=value]...   train (one replica; run.c)
 *   transom run --resume RUN                   continue from the newest checkpoint
 *   transom sample RUN [--prompt S] [--tokens N] [--temperature X] [--seed N]
 *   transom prepare TEXT... -o DIR              text -> BPE token shards (prepare.c)
 *   transom export RUN --hf DIR                 weights as a Hugging Face GPT-2 (export.c)
 *   transom ckpt ls|verify|export RUN          checkpoints (ckpt/ckpt_cli.c)
 *   transom attach RUN [-e EXPR]               REPL in the live job (attach.c)
 *   transom test [busted options] [spec dir]   Lua specs inside this binary
 *   transom lua SCRIPT [args]                  run a Lua script with `transom`
 *   transom sim SCENARIO.lua                   failures at scale, simulated (core/sim)
 *   transom version
 *
 * This is the only file that may end the process: library code returns
 * errors, main prints them and picks the exit status (0 ok, 1 runtime error,
 * 2 bad usage or bad job file).
 */
#define _GNU_SOURCE /* memmem */
#include <lauxlib.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "version.h"
#include "backend.h"
#include "bpe.h"
#include "ftar_bench.h"
#include "job.h"
#include "kernels.h"
#include "lua_graph.h"
#include "lua_host.h"
#include "pipeline.h"
#include "run.h"

int ckpt_main(int argc, char **argv);   /* ckpt/ckpt_cli.c */
int worker_main(int argc, char **argv); /* core/fleet/worker.c */
int agent_main(int argc, char **argv);  /* core/fleet/agent.c */
int attach_main(int argc, char **argv); /* core/cli/attach.c */
int plot_main(int argc, char **argv);   /* detector/plot.c */
int sim_main(int argc, char **argv);    /* core/sim/sim_cli.c */
int prepare_main(int argc, char **argv); /* core/cli/prepare.c */
int export_main(int argc, char **argv);  /* core/cli/export.c */
int chaos_main(int argc, char **argv);  /* below */
#include "trainer.h"
#include "util.h"

static void die_usage(const char *msg) {
  fprintf(stderr, "transom: %s\n", msg);
  exit(2);
}

static int is_help(const char *a) { return strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0; }

/* --- transom sample --- */

static const char sample_usage[] =
    "usage: transom sample RUN [--prompt TEXT] [--tokens N] [--temperature X] [--seed N]\n"
    "\n"
    "Generates text from the weights a run saved (RUN/model.safetensors),\n"
    "with the model and vocabulary of RUN/job.lua and RUN/vocab.json (a run\n"
    "on token shards decodes with RUN/tokenizer.bpe, or prints token ids).\n"
    "Defaults: the job's sample_prompt, 200 tokens, temperature 1.0, the\n"
    "job's seed.\n";

static int cmd_sample(int argc, char **argv) {
  static const char *const value_flags[] = {"--prompt", "--tokens", "--seed", "--temperature", NULL};
  const char *run = NULL, *prompt = NULL;
  long long ntok = 200, seed = -1;
  double temp = 1.0;
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    if (is_help(a)) {
      fputs(sample_usage, stdout);
      return 0;
    }
    if (tr_flag_lacks_value(argc, argv, i, value_flags)) {
      fprintf(stderr, "transom sample: %s needs a value (see transom sample --help)\n", a);
      return 2;
    }
    if (strcmp(a, "--prompt") == 0) prompt = argv[++i];
    else if (strcmp(a, "--tokens") == 0) {
      if (tr_parse_int(argv[++i], 0, 1 << 24, &ntok)) die_usage("sample: --tokens must be an integer in 0..16777216");
    } else if (strcmp(a, "--seed") == 0) {
      if (tr_parse_int(argv[++i], 0, LLONG_MAX, &seed)) die_usage("sample: --seed must be a non-negative integer");
    } else if (strcmp(a, "--temperature") == 0) {
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
  int rc = run_sample(run, prompt, ntok, temp, seed, stdout);
  if (rc) fprintf(stderr, "transom sample: %s\n", tr_error());
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
  if (argv[0][0] == '-') { /* the script's own arguments come after it */
    fprintf(stderr, "transom lua: unknown option '%s' (see transom lua --help)\n", argv[0]);
    return 2;
  }
  set_self_env();
  return run_lua_main(argv[0], argc - 1, argv + 1, argv[0], 1);
}

/* --- transom chaos --- */

static const char chaos_usage[] =
    "usage: transom chaos RUN FAULT SLOT     (FAULT: kill, hang, slow, nan, fail)\n"
    "       transom chaos RUN status\n"
    "\n"
    "Injects a fault into replica SLOT of the live job in RUN, through the\n"
    "operator's control socket RUN/control.sock: kill (SIGKILL), hang\n"
    "(SIGSTOP), slow (200 ms more per step), nan (a NaN gradient once),\n"
    "fail (a step fails with an error once its all-reduce started; the\n"
    "worker reports it 200 ms later and exits).\n";

int chaos_main(int argc, char **argv) {
  for (int i = 0; i < argc; i++) {
    if (is_help(argv[i])) {
      fputs(chaos_usage, stdout);
      return 0;
    }
    if (argv[i][0] == '-') {
      fprintf(stderr, "transom chaos: unknown option '%s' (see transom chaos --help)\n", argv[i]);
      return 2;
    }
  }
  if (argc != 3 && !(argc == 2 && strcmp(argv[1], "status") == 0)) {
    fputs(chaos_usage, stderr);
    return 2;
  }
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s/control.sock", argv[0]);
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    fprintf(stderr, "transom chaos: cannot reach %s (is the job running?)\n", sa.sun_path);
    return 1;
  }
  char line[256];
  int n = argc == 3 ? snprintf(line, sizeof line, "chaos %s %s\n", argv[1], argv[2])
                    : snprintf(line, sizeof line, "status\n");
  if (write(fd, line, (size_t)n) != n) return 1;
  shutdown(fd, SHUT_WR);
  char buf[4096];
  ssize_t got;
  int err = 0;
  while ((got = read(fd, buf, sizeof buf)) > 0) {
    fwrite(buf, 1, (size_t)got, stdout);
    err |= memmem(buf, (size_t)got, "error", 5) != NULL;
  }
  close(fd);
  return err ? 1 : 0;
}

/* --- dispatch --- */

static const char main_usage[] =
    "transom — fault-tolerant training runtime for language models\n"
    "\n"
    "usage: transom COMMAND [options]   (transom COMMAND --help for details)\n"
    "\n"
    "  run JOB.lua      train the model a job file describes\n"
    "  sample RUN       generate text from a finished run's weights\n"
    "  prepare TEXT... -o DIR   tokenize text into token shards (byte-level BPE)\n"
    "  export RUN --hf DIR      a run's weights as a Hugging Face GPT-2 directory\n"
    "  ckpt ls|verify|export RUN   inspect, check and export checkpoints\n"
    "  attach RUN [-e EXPR]   a Lua REPL inside the live job\n"
    "  plot RUN -o run.png    loss, step times and anomalies over steps (gnuplot)\n"
    "  chaos RUN FAULT SLOT   inject a fault into a live job (kill, hang, slow, nan, fail)\n"
    "  sim SCENARIO.lua       ETTR under failures at 1K..128K GPUs, simulated\n"
    "  worker           one replica (started by `run`, or by srun/torchrun)\n"
    "  agent --operator HOST:PORT   one per host: starts the replicas placed there\n"
    "  plan JOB.lua     the pipeline plan: stages, ops, workers, predicted times, bytes per link\n"
    "  stage            one pipeline stage worker (started by `run` with pipeline.stages > 1)\n"
    "  test [DIR]       run the Lua specs inside this binary\n"
    "  lua SCRIPT       run a Lua script with the transom module\n"
    "  ftar-bench       fault-tolerant all-reduce: benchmark and test driver\n"
    "  version          print the version\n";

int main(int argc, char **argv) {
  if (argc < 2 || is_help(argv[1]) || strcmp(argv[1], "help") == 0) {
    fputs(main_usage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "run") == 0) return run_main(argc - 2, argv + 2);
  if (strcmp(cmd, "sample") == 0) return cmd_sample(argc - 2, argv + 2);
  if (strcmp(cmd, "prepare") == 0) return prepare_main(argc - 2, argv + 2);
  if (strcmp(cmd, "export") == 0) return export_main(argc - 2, argv + 2);
  if (strcmp(cmd, "ckpt") == 0) return ckpt_main(argc - 2, argv + 2);
  if (strcmp(cmd, "worker") == 0) {
    int rc = worker_main(argc - 2, argv + 2);
    if (rc == 5) { /* its device is unusable (TR_EDEVICE): a thread may be stuck in the driver (an NCCL abort
                    * past its bound), and the CUDA runtime's exit handlers could wait on it for ever; the
                    * worker has said why and freed what it could: leave now, so it can be replaced */
      fflush(NULL);
      _exit(rc);
    }
    return rc;
  }
  if (strcmp(cmd, "agent") == 0) return agent_main(argc - 2, argv + 2);
  if (strcmp(cmd, "stage") == 0) return pipeline_stage_main(argc - 2, argv + 2);
  if (strcmp(cmd, "plan") == 0) return pipeline_plan_main(argc - 2, argv + 2);
  if (strcmp(cmd, "attach") == 0) return attach_main(argc - 2, argv + 2);
  if (strcmp(cmd, "plot") == 0) return plot_main(argc - 2, argv + 2);
  if (strcmp(cmd, "chaos") == 0) return chaos_main(argc - 2, argv + 2);
  if (strcmp(cmd, "sim") == 0) return sim_main(argc - 2, argv + 2);
  if (strcmp(cmd, "test") == 0) return cmd_test(argc - 2, argv + 2);
  if (strcmp(cmd, "lua") == 0) return cmd_lua(argc - 2, argv + 2);
  if (strcmp(cmd, "ftar-bench") == 0) return ftar_bench_main(argc - 2, argv + 2);
  if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
    if (argc > 2 && is_help(argv[2])) {
      fputs("usage: transom version\n\nPrints the version and the devices a job can name in this build.\n", stdout);
      return 0;
    }
    if (argc > 2) {
      fprintf(stderr, "transom version: unexpected argument '%s' (see transom version --help)\n", argv[2]);
      return 2;
    }
    printf("transom %s\n", TRANSOM_VERSION);
    /* which devices a job can name here, and why not (the plugin is only loaded) */
    char path[4200] = "";
    backend_cuda_path(path, sizeof path);
    printf("devices: cpu, emu, ");
    if (backend_load("cuda")) printf("cuda (plugin %s; a GPU is looked for when a job uses it)\n", path);
    else printf("not cuda: %s\n", tr_error());
    return 0;
  }
  fprintf(stderr, "transom: unknown command '%s'\n\n%s", cmd, main_usage);
  return 2;
}
