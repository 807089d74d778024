/* export.c — `transom export RUN --hf DIR`: a run's final weights as a
 * Hugging Face GPT-2 directory (config.json + model.safetensors) that
 * transformers.GPT2LMHeadModel.from_pretrained(DIR) loads. The layout work is
 * hf.c's; this file reads the run (job.lua, vocab.json, model.safetensors)
 * and builds the model they describe, which hf_export checks every tensor
 * against (an edited job.lua or vocab.json is refused, not exported as a
 * config.json that lies about the tensors). Called from main.c only;
 * returns an exit status, never exits.
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "data.h"
#include "graph.h"
#include "hf.h"
#include "job.h"
#include "lua_host.h"
#include "trainer.h"
#include "util.h"

static const char export_usage[] =
    "usage: transom export RUN --hf DIR\n"
    "\n"
    "Writes RUN's weights (RUN/model.safetensors: the end of training, or what\n"
    "`transom ckpt export RUN --step N -o RUN/model.safetensors` put there) as\n"
    "a Hugging Face GPT-2: DIR/config.json and DIR/model.safetensors, loaded by\n"
    "transformers.GPT2LMHeadModel.from_pretrained(DIR). The model must be\n"
    "transom's gpt; the token table keeps the real vocabulary (not the padding).\n"
    "Every tensor must match the model RUN/job.lua and RUN/vocab.json make.\n"
    "DIR must not be RUN; it is created if absent, and other files in it stay\n"
    "(tokenizer.json, README.md, .git of a model repository). The two files are\n"
    "each replaced atomically, the weights first; two exports into one DIR take\n"
    "turns. A job starts from such a directory with init_from = DIR.\n";

int export_main(int argc, char **argv) {
  static const char *const value_flags[] = {"--hf", NULL};
  const char *run = NULL, *hf = NULL;
  for (int i = 0; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(export_usage, stdout);
      return 0;
    }
    if (tr_flag_lacks_value(argc, argv, i, value_flags)) {
      fprintf(stderr, "transom export: %s needs a value (see transom export --help)\n", argv[i]);
      return 2;
    }
    if (strcmp(argv[i], "--hf") == 0) hf = argv[++i];
    else if (argv[i][0] == '-') {
      fprintf(stderr, "transom export: unknown option '%s' (see transom export --help)\n", argv[i]);
      return 2;
    } else if (!run) run = argv[i];
    else {
      fprintf(stderr, "transom export: one run directory only\n");
      return 2;
    }
  }
  if (!run || !hf) {
    fputs(export_usage, stderr);
    return 2;
  }
  char path[PATH_MAX];
  lua_State *L = lua_host_new();
  if (!L) {
    fprintf(stderr, "transom export: %s\n", tr_error());
    return 1;
  }
  job_config cfg;
  vocab v;
  int64_t nvocab = 0;
  graph *g = NULL;
  snprintf(path, sizeof path, "%s/job.lua", run);
  int rc = job_load(L, path, NULL, 0, &cfg);
  snprintf(path, sizeof path, "%s/vocab.json", run);
  if (!rc) rc = vocab_load_any(&v, &nvocab, path);
  if (!rc && v.size == 0 && cfg.vocab_size > 0 && cfg.vocab_size != nvocab)
    rc = tr_fail(TR_EINVAL, "'%s' has vocab_size %lld, but '%s/job.lua' says vocab_size = %lld", path,
                 (long long)nvocab, run, (long long)cfg.vocab_size);
  if (!rc && strcmp(cfg.model, "gpt") != 0)
    rc = tr_fail(TR_EINVAL, "%s: model '%s': only transom's gpt exports as GPT-2", run, cfg.model);
  /* the model job.lua and vocab.json make: what every tensor is checked against */
  if (!rc) rc = model_build(L, cfg.lua_ref, v.size ? v.size : data_padded_vocab(nvocab), 1, 0, &g);
  hf_shape s = {nvocab, cfg.n_layer, cfg.n_head, cfg.n_embd};
  snprintf(path, sizeof path, "%s/model.safetensors", run);
  if (!rc) rc = hf_export(path, g, &s, hf);
  graph_free(g);
  if (rc) fprintf(stderr, "transom export: %s\n", tr_error());
  else printf("wrote %s/config.json and %s/model.safetensors (GPT-2: %lld layers, %lld heads, %lld wide, vocab %lld)\n",
              hf, hf, (long long)cfg.n_layer, (long long)cfg.n_head, (long long)cfg.n_embd, (long long)nvocab);
  lua_host_close(L);
  return rc ? 1 : 0;
}
