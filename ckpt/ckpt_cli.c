/* ckpt_cli.c — `transom ckpt ls|verify|export`: inspect a run's checkpoint
 * store from outside (read-only; safe while the run is writing).
 *
 *   transom ckpt ls RUN
 *   transom ckpt verify RUN [--step N]
 *   transom ckpt export RUN [--step N] -o model.safetensors
 *
 * RUN is a run directory (its ckpt/ store is used) or a store itself.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "ckpt.h"
#include "safetensors.h"
#include "util.h"

int ckpt_main(int argc, char **argv);

static const char usage[] =
    "usage: transom ckpt ls RUN\n"
    "       transom ckpt verify RUN [--step N]\n"
    "       transom ckpt export RUN [--step N] -o model.safetensors\n"
    "\n"
    "ls lists the committed checkpoints; verify checks every tensor's CRC32C\n"
    "(of --step N only, if given) and names the ones that fail (exit 1 if any\n"
    "does, or if there is no checkpoint at N); export writes the\n"
    "parameters of the newest intact checkpoint (or --step N) as safetensors\n"
    "(float32, nanoGPT names) for PyTorch / Hugging Face. A flag a verb does\n"
    "not take (ls --step, ls -o, verify -o) is an error (exit 2).\n";

static ckpt_reader *open_store(const char *run) {
  char path[PATH_MAX];
  struct stat st;
  snprintf(path, sizeof path, "%s/ckpt/data.mdb", run);
  if (stat(path, &st) == 0) {
    snprintf(path, sizeof path, "%s/ckpt", run);
    return ckpt_reader_open(path);
  }
  return ckpt_reader_open(run);
}

static int cmd_ls(ckpt_reader *r) {
  int64_t steps[4096];
  int n = ckpt_reader_steps(r, steps, 4096);
  if (n < 0) {
    fprintf(stderr, "transom ckpt: %s\n", tr_error());
    return 1;
  }
  printf("%8s  %-19s  %7s  %10s\n", "step", "time", "tensors", "size");
  for (int i = 0; i < n; i++) {
    ckpt_manifest m;
    if (ckpt_reader_manifest(r, steps[i], &m)) {
      printf("%8lld  unreadable manifest: %s\n", (long long)steps[i], tr_error());
      continue;
    }
    char when[32];
    time_t t = (time_t)m.state.wall_time;
    struct tm tm;
    localtime_r(&t, &tm);
    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
    printf("%8lld  %-19s  %7d  %7.1f MiB\n", (long long)steps[i], when, m.ntensors, m.bytes / 1048576.0);
  }
  if (n == 0) printf("(no committed checkpoints)\n");
  return 0;
}

static int cmd_verify(ckpt_reader *r, long long only) {
  int64_t steps[4096];
  int n = ckpt_reader_steps(r, steps, 4096), bad = 0, checked = 0;
  if (n < 0) {
    fprintf(stderr, "transom ckpt: %s\n", tr_error());
    return 1;
  }
  for (int i = 0; i < n; i++) {
    if (only >= 0 && steps[i] != only) continue;
    checked++;
    if (ckpt_reader_verify(r, steps[i]) == 0) {
      printf("step %lld: ok\n", (long long)steps[i]);
    } else {
      printf("step %lld: CORRUPT: %s\n", (long long)steps[i], tr_error());
      bad++;
    }
  }
  if (checked == 0) {
    fprintf(stderr, "transom ckpt verify: no checkpoint%s\n", only >= 0 ? " at that step" : "");
    return 1;
  }
  return bad ? 1 : 0;
}

static int cmd_export(ckpt_reader *r, long long step, const char *out) {
  int64_t steps[4096];
  int n = ckpt_reader_steps(r, steps, 4096);
  if (n < 0) {
    fprintf(stderr, "transom ckpt: %s\n", tr_error());
    return 1;
  }
  long long pick = -1;
  for (int i = n - 1; i >= 0 && pick < 0; i--) {
    if (step >= 0 && steps[i] != step) continue;
    if (ckpt_reader_verify(r, steps[i]) == 0) pick = steps[i];
    else fprintf(stderr, "transom ckpt export: skipping step %lld: %s\n", (long long)steps[i], tr_error());
  }
  if (pick < 0) {
    fprintf(stderr, "transom ckpt export: no intact checkpoint%s\n", step >= 0 ? " at that step" : "");
    return 1;
  }
  ckpt_manifest m;
  if (ckpt_reader_manifest(r, pick, &m)) {
    fprintf(stderr, "transom ckpt export: %s\n", tr_error());
    return 1;
  }
  int np = 0;
  st_tensor *ts = calloc((size_t)m.ntensors + 1, sizeof *ts);
  ckpt_tensor_info *info = malloc(sizeof *info * ((size_t)m.ntensors + 1));
  float **bufs = calloc((size_t)m.ntensors + 1, sizeof *bufs);
  int rc = ts && info && bufs ? 0 : tr_fail(TR_ENOMEM, "out of memory");
  if (!rc) memcpy(info, m.tensors, sizeof *info * (size_t)m.ntensors); /* the reader reuses m.tensors */
  for (int i = 0; i < m.ntensors && !rc; i++) {
    if (strncmp(info[i].name, "param/", 6) != 0 || info[i].dtype != CKPT_F32) continue;
    bufs[np] = malloc(info[i].bytes ? info[i].bytes : 4);
    if (!bufs[np]) {
      rc = tr_fail(TR_ENOMEM, "out of memory");
      break;
    }
    rc = ckpt_reader_read(r, pick, info[i].name, bufs[np], info[i].bytes);
    ts[np] = (st_tensor){info[i].name + 6, bufs[np], info[i].ndim, info[i].dim};
    np++;
  }
  char stepstr[32];
  snprintf(stepstr, sizeof stepstr, "%lld", pick);
  const char *meta[] = {"transom.step", stepstr, NULL};
  if (!rc) rc = safetensors_write(out, ts, np, meta);
  if (!rc) printf("exported step %lld: %d tensors to %s\n", pick, np, out);
  else fprintf(stderr, "transom ckpt export: %s\n", tr_error());
  for (int i = 0; i < np; i++) free(bufs[i]);
  free(bufs);
  free(ts);
  free(info);
  return rc ? 1 : 0;
}

int ckpt_main(int argc, char **argv) {
  if (argc < 1 || strcmp(argv[0], "--help") == 0 || strcmp(argv[0], "-h") == 0) {
    fputs(usage, argc < 1 ? stderr : stdout);
    return argc < 1 ? 2 : 0;
  }
  const char *verb = argv[0], *run = NULL, *out = NULL;
  long long step = -1;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(usage, stdout);
      return 0;
    } else if (strcmp(argv[i], "--step") == 0 && i + 1 < argc) {
      char *end;
      step = strtoll(argv[++i], &end, 10);
      if (*end || step < 0) {
        fprintf(stderr, "transom ckpt: --step must be a non-negative integer\n");
        return 2;
      }
    } else if (strcmp(argv[i], "-o") == 0 && i + 1 < argc) {
      out = argv[++i];
    } else if ((strcmp(argv[i], "--step") == 0 || strcmp(argv[i], "-o") == 0) && i + 1 == argc) {
      fprintf(stderr, "transom ckpt: %s needs a value\n%s", argv[i], usage);
      return 2;
    } else if (argv[i][0] == '-' || run) {
      fprintf(stderr, "transom ckpt: unexpected argument '%s'\n%s", argv[i], usage);
      return 2;
    } else {
      run = argv[i];
    }
  }
  int is_ls = strcmp(verb, "ls") == 0, is_verify = strcmp(verb, "verify") == 0, is_export = strcmp(verb, "export") == 0;
  if (!is_ls && !is_verify && !is_export) {
    fprintf(stderr, "transom ckpt: unknown verb '%s'\n%s", verb, usage);
    return 2;
  }
  if (!run || (is_export && !out)) {
    fputs(usage, stderr);
    return 2;
  }
  if (out && !is_export) { /* a flag that would be ignored is refused: the user meant something by it */
    fprintf(stderr, "transom ckpt %s: -o is for export only (%s writes no file)\n%s", verb, verb, usage);
    return 2;
  }
  if (step >= 0 && is_ls) {
    fprintf(stderr, "transom ckpt ls: --step is for verify and export (ls lists every step)\n%s", usage);
    return 2;
  }
  ckpt_reader *r = open_store(run);
  if (!r) {
    fprintf(stderr, "transom ckpt: %s\n", tr_error());
    return 1;
  }
  int rc = is_ls ? cmd_ls(r) : is_verify ? cmd_verify(r, step) : cmd_export(r, step, out);
  ckpt_reader_close(r);
  return rc;
}
