/* trainer.c — the replica's step loop pieces (see trainer.h).
 *
 * One step: draw a batch (data RNG) -> graph_forward -> graph_backward ->
 * clip the global gradient norm -> AdamW with the scheduled LR -> zero grads.
 * The model graph comes from Lua (lua/transom/model.lua) exactly once.
 */
#include "trainer.h"

#include <lauxlib.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "bpe.h"
#include "crc32c.h"
#include "hf.h"
#include "kernels.h"
#include "lua_graph.h"
#include "lua_host.h"
#include "optim.h"
#include "rng.h"
#include "safetensors.h"
#include "util.h"

struct trainer {
  lua_State *L;
  job_config cfg;
  int poison_next; /* chaos: the next step's loss and gradients are NaN */
  dataset data;
  bpe *tok_bpe; /* token data: the tokenizer that decodes samples, or NULL */
  graph *g;
  graph *infer; /* B=1 graph for sampling, built on first use */
  adamw *opt;
  lr_schedule sched;
  int tok, tgt, loss; /* tensor ids */
  int slot; /* replica slot: selects the data stream */
  int64_t batch_skips[64]; /* batch keys never drawn (rollbacks past a bad batch), ascending */
  int nbatch_skips;
  int64_t skip_steps[64]; /* updates to drop (the operator's skip_update), by step */
  int nskip;
  int64_t skipped;
  int64_t lr_from[16]; /* live learning-rate changes: from step lr_from[i] on, peak lr_to[i] */
  float lr_to[16];
  int nlr;
  int64_t step;
  /* on a device backend (be->host_memory == 0) the training state lives in
   * device memory; the host keeps mirrors that trainer_pull/push sync */
  const tr_backend *be;
  int dev;
  float *hparams; /* host mirror of the parameters */
  float *hgrads;  /* host copy of the gradients (collectives over the host, donors) */
  void (*ready_fn)(void *ud, int64_t from); /* trainer_set_grads_ready */
  void *ready_ud;
};

/* The parameters in host memory: the slab itself on a host backend, else
 * the mirror (current after trainer_pull). */
static float *host_params(const trainer *t) { return t->dev ? t->hparams : graph_params(t->g); }

/* --- model building (shared with `transom sample`) --- */

int model_build(lua_State *L, int cfg_ref, int64_t V, int B, int with_grad, graph **out) {
  return model_build_on(L, cfg_ref, V, B, with_grad, backend_cpu(), 0, out);
}

int model_build_on(lua_State *L, int cfg_ref, int64_t V, int B, int with_grad, const tr_backend *be, int bf16,
                   graph **out) {
  int top = lua_gettop(L);
  *out = NULL;
  lua_rawgeti(L, LUA_REGISTRYINDEX, cfg_ref); /* [job] */
  lua_newtable(L);                            /* [job, cfg]: a copy, so the job keeps its own vocab_size */
  lua_pushnil(L);
  while (lua_next(L, -3)) {                   /* [job, cfg, k, v] */
    lua_pushvalue(L, -2);
    lua_insert(L, -2);                        /* [job, cfg, k, k, v] */
    lua_rawset(L, -4);                        /* [job, cfg, k] */
  }
  lua_remove(L, -2);                          /* [cfg] */
  lua_pushinteger(L, V);                      /* the model's V (padded for token data) */
  lua_setfield(L, -2, "vocab_size");
  lua_getglobal(L, "require");
  lua_pushliteral(L, "transom.model");
  int rc = lua_host_pcall(L, 1, 1);          /* [cfg, model] */
  if (rc) goto done;
  lua_getfield(L, -1, "build");              /* [cfg, model, build] */
  lua_pushvalue(L, -3);
  lua_pushinteger(L, B);
  rc = lua_host_pcall(L, 2, 1);              /* [cfg, model, g] */
  if (rc) goto done;
  graph *g = lua_graph_take(L, -1);
  if (!g) {
    rc = tr_fail(TR_ELUA, "model build did not return a graph");
    goto done;
  }
  rc = graph_set_bf16(g, bf16);
  if (!rc) rc = graph_plan_on(g, with_grad, be);
  if (rc) {
    graph_free(g);
    goto done;
  }
  *out = g;
done:
  lua_settop(L, top);
  return rc;
}

int model_load_params(graph *g, const char *path) {
  st_file f;
  int rc = safetensors_open(&f, path);
  if (rc) return rc;
  for (int i = 0; i < graph_ntensors(g) && !rc; i++) {
    tensor_desc d;
    graph_tensor(g, i, &d);
    if (d.kind != TK_PARAM) continue;
    const st_entry *e = safetensors_find(&f, d.name);
    if (!e) {
      rc = tr_fail(TR_EFORMAT, "'%s' has no tensor '%s'", path, d.name);
      break;
    }
    int same = e->ndim == d.ndim;
    for (int k = 0; same && k < d.ndim; k++) same = e->dim[k] == d.dim[k];
    if (!same) {
      rc = tr_fail(TR_EFORMAT, "'%s': tensor '%s' has a different shape than the model's", path, d.name);
      break;
    }
    memcpy(graph_data(g, i), f.data + e->begin, e->end - e->begin);
  }
  safetensors_close(&f);
  return rc;
}

/* The prompt as ids (NULL codec->bytes and tok: token runs take no prompt). */
static int encode_prompt(const text_codec *c, const char *prompt, size_t plen, int32_t *ids, int64_t *n) {
  *n = 0;
  if (c->bytes) {
    int rc = vocab_encode(c->bytes, prompt, plen, ids);
    if (rc) return rc;
    *n = (int64_t)plen;
    if (*n == 0) ids[(*n)++] = c->bytes->id_of['\n'] >= 0 ? c->bytes->id_of['\n'] : 0;
    return TR_OK;
  }
  if (c->tok) return bpe_encode(c->tok, prompt, plen, ids, (int64_t)plen + 1, n, 1);
  if (plen) return tr_fail(TR_EINVAL, "this run has no tokenizer to encode a prompt (job key 'tokenizer')");
  ids[(*n)++] = (int32_t)(c->vocab_size - 1); /* GPT-2's <|endoftext|> is its last id */
  return TR_OK;
}

static void emit(const text_codec *c, int id, FILE *out) {
  if (c->bytes) fputc(c->bytes->byte_of[id], out);
  else if (c->tok) bpe_decode(c->tok, id, out);
  else fprintf(out, "%d ", id);
}

int model_generate(graph *g, const text_codec *c, const char *prompt, int64_t ntokens, float temperature,
                   uint64_t seed, FILE *out) {
  int tok = graph_find(g, "tokens"), logits = graph_find(g, "logits");
  if (tok < 0 || logits < 0) return tr_fail(TR_EINVAL, "the model has no tokens input or logits output");
  tensor_desc dt, dl;
  graph_tensor(g, tok, &dt);
  graph_tensor(g, logits, &dl);
  const int T = (int)dt.dim[1], Vp = (int)dl.dim[dl.ndim - 1];
  const int V = c->vocab_size > 0 && c->vocab_size < Vp ? (int)c->vocab_size : Vp; /* never a padding id */
  size_t plen = strlen(prompt);
  if (ntokens < 0 || ntokens > MODEL_GENERATE_MAX || plen > (size_t)MODEL_GENERATE_MAX)
    return tr_fail(TR_EINVAL, "sampling: %lld tokens after a prompt of %zu bytes is more than %d", (long long)ntokens,
                   plen, MODEL_GENERATE_MAX);
  if (!(temperature > 0.0f) || isinf(temperature))
    return tr_fail(TR_EINVAL, "sampling: temperature %g is not a positive float", (double)temperature);
  int64_t cap = (int64_t)plen + ntokens + 2;
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)cap);
  double *p = malloc(sizeof(double) * (size_t)V);
  if (!ids || !p) {
    free(ids);
    free(p);
    return tr_fail(TR_ENOMEM, "out of memory sampling");
  }
  int64_t n;
  int rc = encode_prompt(c, prompt, plen, ids, &n);
  if (rc) goto done;
  fwrite(prompt, 1, plen, out);
  rng_t r;
  rng_seed(&r, seed);
  int32_t *in = graph_data(g, tok);
  for (int64_t i = 0; i < ntokens; i++) {
    int k = n < T ? (int)n : T; /* context: the last k ids */
    memset(in, 0, sizeof(int32_t) * (size_t)dt.size);
    memcpy(in, ids + n - k, sizeof(int32_t) * (size_t)k);
    if ((rc = graph_forward(g))) goto done;
    const float *row = (const float *)graph_data(g, logits) + (int64_t)(k - 1) * Vp;
    double mx = -INFINITY, sum = 0.0;
    for (int j = 0; j < V; j++)
      if (row[j] > mx) mx = row[j];
    for (int j = 0; j < V; j++) sum += (p[j] = exp((row[j] - mx) / temperature));
    double u = rng_uniform(&r) * sum, cum = 0.0;
    int pick = V - 1;
    for (int j = 0; j < V; j++) {
      cum += p[j];
      if (u < cum) {
        pick = j;
        break;
      }
    }
    ids[n++] = pick;
    emit(c, pick, out);
  }
  fputc('\n', out);
  fflush(out);
done:
  free(ids);
  free(p);
  return rc;
}

/* --- trainer --- */

/* Token data: the job's tokenizer, or tokenizer.bpe beside the first shard
 * when there is one (transom prepare writes it there); none is no error. */
static int trainer_open_tokenizer(trainer *t) {
  char path[4200];
  const char *want = t->cfg.tokenizer;
  if (!want[0]) {
    /* the first line is a glob pattern (data.c): its directory as glob(3)
     * reads it, a backslash quoting the next character (RUN/job.lua escapes
     * the glob characters of the directory it was started in) */
    const char *nl = strchr(t->cfg.data, '\n'), *slash = NULL;
    for (const char *q = t->cfg.data; *q && (!nl || q < nl); q++)
      if (*q == '/') slash = q;
    size_t n = 0;
    if (!slash) path[n++] = '.';
    for (const char *q = t->cfg.data; slash && q < slash && n < sizeof path - 32; q++) {
      if (*q == '\\' && q + 1 < slash) q++;
      path[n++] = *q;
    }
    snprintf(path + n, sizeof path - n, "/tokenizer.bpe");
    if (access(path, R_OK) != 0) return TR_OK;
    want = path;
  }
  char where[1200];
  if (!(t->tok_bpe = bpe_load(want)))
    return tr_fail_prefix(TR_EINVAL, "%s", job_where(t->L, &t->cfg, "tokenizer", where, sizeof where));
  if (bpe_vocab_size(t->tok_bpe) > t->data.vocab_size)
    return tr_fail(TR_EINVAL, "%s: the tokenizer '%s' has %lld tokens, more than vocab_size = %lld",
                   job_where(t->L, &t->cfg, "tokenizer", where, sizeof where), want,
                   (long long)bpe_vocab_size(t->tok_bpe), (long long)t->data.vocab_size);
  return TR_OK;
}

/* init_from: the parameters of a Hugging Face GPT-2 directory (hf.h). */
static int trainer_init_from(trainer *t) {
  hf_shape hs = {t->data.vocab_size, t->cfg.n_layer, t->cfg.n_head, t->cfg.n_embd};
  int rc = hf_import(t->g, host_params(t), t->cfg.init_from, &hs);
  if (!rc) rc = trainer_push(t);
  char where[1200];
  return rc ? tr_fail_prefix(rc, "%s", job_where(t->L, &t->cfg, "init_from", where, sizeof where)) : TR_OK;
}

trainer *trainer_create(lua_State *L, const job_config *cfg) {
  trainer *t = calloc(1, sizeof *t);
  if (!t) {
    tr_fail(TR_ENOMEM, "out of memory");
    return NULL;
  }
  char where[1200]; /* an error's prefix: where the key it names came from (job_where) */
  t->L = L;
  t->cfg = *cfg;
  int threads = cfg->threads > 0 ? (int)cfg->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
  kernels_set_threads(threads > 0 ? threads : 1);
  if (!(t->be = backend_get(cfg->device, threads))) {
    tr_fail_prefix(TR_EINVAL, "%s", job_where(L, cfg, "device", where, sizeof where));
    goto fail;
  }
  t->dev = !t->be->host_memory;
  data_spec ds = {cfg->data, cfg->val_data, cfg->data_format[0] ? cfg->data_format : "auto", cfg->vocab_size,
                   (int)cfg->block_size};
  if (dataset_open(&t->data, &ds)) {
    tr_fail_prefix(TR_EINVAL, "%s", job_where(L, cfg, "data", where, sizeof where));
    goto fail;
  }
  if (t->data.kind != DATA_TOKENS && cfg->tokenizer[0]) { /* not ignored: bytes need no tokenizer */
    tr_fail(TR_EINVAL, "%s: '%s' is for token files; data is a text corpus (its bytes are its "
            "tokens): drop tokenizer, or give .bin shards", job_where(L, cfg, "tokenizer", where, sizeof where),
            cfg->tokenizer);
    goto fail;
  }
  if (t->data.kind == DATA_TOKENS && trainer_open_tokenizer(t)) goto fail;
  if (model_build_on(L, cfg->lua_ref, t->data.model_vocab, (int)cfg->batch_size, 1, t->be,
                     strcmp(cfg->precision, "bf16") == 0, &t->g)) {
    if (strncmp(tr_error(), "precision", 9) == 0)
      tr_fail_prefix(TR_EINVAL, "%s", job_where(L, cfg, "precision", where, sizeof where));
    goto fail;
  }
  t->tok = graph_find(t->g, "tokens");
  t->tgt = graph_find(t->g, "targets");
  t->loss = graph_find(t->g, "loss");
  if (graph_init_params(t->g, (uint64_t)cfg->seed)) goto fail;
  adamw_config oc = {(float)cfg->beta1, (float)cfg->beta2, (float)cfg->eps, (float)cfg->weight_decay};
  t->opt = adamw_create(t->g, &oc, t->be); /* it owns the moments, on the device too */
  if (!t->opt) goto fail;
  if (t->dev) {
    size_t n = (size_t)graph_nparams(t->g);
    t->hparams = tr_alloc_aligned(sizeof(float) * n);
    t->hgrads = tr_alloc_aligned(sizeof(float) * n);
    if (!t->hparams || !t->hgrads) {
      tr_fail(TR_ENOMEM, "out of %s memory for the optimizer state", t->be->name);
      goto fail;
    }
  }
  if (cfg->init_from[0] && trainer_init_from(t)) goto fail;
  t->sched = (lr_schedule){(float)cfg->lr, (float)cfg->min_lr, cfg->warmup_steps, cfg->lr_decay_steps};
  return t;
fail:
  trainer_free(t);
  return NULL;
}

void trainer_free(trainer *t) {
  if (!t) return;
  dataset_free(&t->data);
  bpe_free(t->tok_bpe);
  graph_free(t->g);
  graph_free(t->infer);
  adamw_free(t->opt);
  tr_free_aligned(t->hparams);
  tr_free_aligned(t->hgrads);
  free(t);
}

/* The batch generator of (seed, slot, step): the data position is a pure
 * function of where training is, so any replica's stream can be recomputed
 * after a failure, a resume or a replacement without extra state. */
static void batch_rng(const trainer *t, int64_t step, rng_t *r) {
  step = batch_key(step, t->batch_skips, t->nbatch_skips);
  rng_seed(r, (uint64_t)t->cfg.seed * 0x9E3779B97F4A7C15ull ^ (uint64_t)(t->slot + 1) * 0xD1B54A32D192ED03ull ^
                  (uint64_t)step * 0x94D049BB133111EBull);
  rng_u64(r);
}

/* The graph's backward hook: everything but the slab's start is passed on
 * at once; 0 only after the step's last write (chaos poisons grads[0]). */
static void grads_progress(void *ud, int64_t from) {
  trainer *t = ud;
  if (from > 0) t->ready_fn(t->ready_ud, from);
}

int trainer_set_grads_ready(trainer *t, void (*fn)(void *ud, int64_t from), void *ud) {
  t->ready_fn = fn;
  t->ready_ud = ud;
  return graph_set_grad_hook(t->g, fn ? grads_progress : NULL, t);
}

int trainer_compute_grads(trainer *t, step_stats *st) {
  const int B = (int)t->cfg.batch_size, T = (int)t->cfg.block_size;
  double t0 = tr_now();
  rng_t r;
  batch_rng(t, t->step, &r);
  dataset_batch(&t->data, SPLIT_TRAIN, &r, B, T, graph_data(t->g, t->tok), graph_data(t->g, t->tgt));
  double t1 = tr_now();
  int rc = graph_forward(t->g);
  if (rc) return rc;
  double t2 = tr_now();
  rc = graph_backward(t->g, t->loss);
  if (rc) return rc;
  double t3 = tr_now();
  memset(st, 0, sizeof *st);
  if ((rc = graph_read(t->g, t->loss, &st->loss))) return rc;
  st->tokens = (int64_t)B * T;
  if (t->poison_next) { /* chaos: a numerical fault in this step */
    const float nan = st->loss = __builtin_nanf("");
    t->poison_next = 0;
    if ((rc = t->be->upload(graph_grads(t->g), &nan, sizeof nan))) return rc;
  }
  if (t->ready_fn) t->ready_fn(t->ready_ud, 0);
  st->t_data = t1 - t0;
  st->t_fwd = t2 - t1;
  st->t_bwd = t3 - t2;
  st->t_total = t3 - t0;
  return TR_OK;
}

int trainer_apply_grads(trainer *t, step_stats *st) {
  double t0 = tr_now();
  float *grads = graph_grads(t->g);
  int64_t n = graph_nparams(t->g);
  float norm = grad_clip_on(t->be, grads, n, (float)t->cfg.grad_clip);
  int skip = !isfinite(norm); /* a non-finite gradient is never applied */
  for (int i = 0; i < t->nskip && !skip; i++) skip = t->skip_steps[i] == t->step;
  lr_schedule sched = t->sched; /* with the live changes in force at this step */
  for (int i = 0; i < t->nlr; i++)
    if (t->step >= t->lr_from[i]) {
      sched.min_lr = t->sched.min_lr * t->lr_to[i] / t->sched.lr;
      sched.lr = t->lr_to[i];
    }
  float lr = lr_at(&sched, t->step);
  if (!skip) adamw_step(t->opt, graph_params(t->g), grads, lr);
  else t->skipped++;
  st->skipped = skip;
  graph_zero_grad(t->g);
  if (t->dev && t->be->sync()) return tr_fail(TR_EIO, "optimizer step on the %s device: %s", t->be->name, t->be->error());
  t->step++;
  double dt = tr_now() - t0;
  st->step = t->step;
  st->lr = lr;
  st->grad_norm = norm;
  st->t_opt = dt;
  st->t_total += dt;
  return TR_OK;
}

int trainer_step(trainer *t, step_stats *st) {
  int rc = trainer_compute_grads(t, st);
  return rc ? rc : trainer_apply_grads(t, st);
}

int trainer_eval(trainer *t, float *val_loss) {
  const int B = (int)t->cfg.batch_size, T = (int)t->cfg.block_size;
  rng_t r; /* same batches every evaluation: comparable numbers */
  rng_seed(&r, (uint64_t)t->cfg.seed * 2654435761u + 2);
  double sum = 0.0;
  for (int64_t i = 0; i < t->cfg.eval_steps; i++) {
    dataset_batch(&t->data, SPLIT_VAL, &r, B, T, graph_data(t->g, t->tok), graph_data(t->g, t->tgt));
    int rc = graph_forward(t->g);
    float loss = 0;
    if (!rc) rc = graph_read(t->g, t->loss, &loss);
    if (rc) return rc;
    sum += loss;
  }
  *val_loss = (float)(sum / (double)t->cfg.eval_steps);
  return TR_OK;
}

int trainer_sample(trainer *t, const char *prompt, int64_t ntokens, float temperature, uint64_t seed, FILE *out) {
  if (!t->infer) {
    int rc = model_build(t->L, t->cfg.lua_ref, t->data.model_vocab, 1, 0, &t->infer);
    if (rc) return rc;
    if (graph_nparams(t->infer) != graph_nparams(t->g))
      return tr_fail(TR_ESTATE, "the inference graph's parameters differ from the training graph's");
  }
  int rc = trainer_pull(t, 0);
  if (rc) return rc;
  memcpy(graph_params(t->infer), host_params(t), sizeof(float) * (size_t)graph_nparams(t->g));
  text_codec c = {t->data.kind == DATA_BYTES ? &t->data.voc : NULL, t->tok_bpe, t->data.vocab_size};
  return model_generate(t->infer, &c, prompt, ntokens, temperature, seed, out);
}

int trainer_save(trainer *t, const char *dir) {
  char path[4096];
  int np = 0, nt = graph_ntensors(t->g);
  int rc = trainer_pull(t, 0);
  if (rc) return rc;
  st_tensor *ts = malloc(sizeof(st_tensor) * (size_t)nt);
  tensor_desc *ds = malloc(sizeof(tensor_desc) * (size_t)nt);
  if (!ts || !ds) {
    free(ts);
    free(ds);
    return tr_fail(TR_ENOMEM, "out of memory saving");
  }
  for (int i = 0; i < nt; i++) {
    graph_tensor(t->g, i, &ds[np]);
    if (ds[np].kind != TK_PARAM) continue;
    ts[np] = (st_tensor){ds[np].name, host_params(t) + ds[np].offset, ds[np].ndim, ds[np].dim};
    np++;
  }
  char step[32];
  snprintf(step, sizeof step, "%lld", (long long)t->step);
  const char *meta[] = {"transom.step", step, "transom.model", t->cfg.model, NULL};
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  rc = safetensors_write(path, ts, np, meta);
  free(ts);
  free(ds);
  if (rc) return rc;
  snprintf(path, sizeof path, "%s/vocab.json", dir);
  if (t->data.kind == DATA_BYTES) return vocab_save(&t->data.voc, path);
  if ((rc = vocab_save_tokens(t->data.vocab_size, path))) return rc;
  snprintf(path, sizeof path, "%s/tokenizer.bpe", dir);
  return t->tok_bpe ? bpe_save(t->tok_bpe, path) : TR_OK;
}

/* --- checkpoints --- */

/* Calls fn for every saved tensor: name, pointer, shape. */
typedef int (*state_fn)(void *ctx, const char *name, float *p, int ndim, const int64_t *dim);

/* device = 1: where the state lives (what the checkpoint engine copies);
 * 0: its host copy (what a load fills before trainer_push). */
static int for_each_state(trainer *t, int device, state_fn fn, void *ctx) {
  float *params = device ? graph_params(t->g) : host_params(t);
  float *m = device ? adamw_moments(t->opt) : adamw_state(t->opt), *v = m + graph_nparams(t->g);
  for (int i = 0; i < graph_ntensors(t->g); i++) {
    tensor_desc d;
    graph_tensor(t->g, i, &d);
    if (d.kind != TK_PARAM) continue;
    char name[256];
    int rc;
    snprintf(name, sizeof name, "param/%s", d.name);
    if ((rc = fn(ctx, name, params + d.offset, d.ndim, d.dim))) return rc;
    snprintf(name, sizeof name, "adam.m/%s", d.name);
    if ((rc = fn(ctx, name, m + d.offset, d.ndim, d.dim))) return rc;
    snprintf(name, sizeof name, "adam.v/%s", d.name);
    if ((rc = fn(ctx, name, v + d.offset, d.ndim, d.dim))) return rc;
  }
  return TR_OK;
}

static int reg_one(void *ctx, const char *name, float *p, int ndim, const int64_t *dim) {
  return ckpt_register(ctx, name, CKPT_F32, ndim, dim, p);
}

int trainer_ckpt_attach(trainer *t, ckpt_engine *e) {
  int rc = t->dev ? ckpt_set_device(e, t->be) : TR_OK;
  if (!rc && t->cfg.ckpt_remote[0] && (rc = ckpt_set_remote(e, t->cfg.ckpt_remote, t->cfg.ckpt_remote_rate_mb)))
    rc = tr_fail_prefix(rc, "checkpoint.remote");
  if (!rc) rc = for_each_state(t, 1, reg_one, e);
  return rc;
}

const job_config *trainer_config(const trainer *t) { return &t->cfg; }

void trainer_poison_next(trainer *t) { t->poison_next = 1; }

/* The config hash with the model named by `model`. */
static uint64_t config_hash_of(const trainer *t, const char *model) {
  char buf[1200];
  int n = snprintf(buf, sizeof buf, "%s|%lld|%lld|%lld|%lld|", model, (long long)t->cfg.n_layer,
                   (long long)t->cfg.n_head, (long long)t->cfg.n_embd, (long long)t->cfg.block_size);
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (int i = 0; i < n; i++) h = (h ^ (uint8_t)buf[i]) * 1099511628211ull;
  for (int i = 0; i < t->data.voc.size; i++) h = (h ^ t->data.voc.byte_of[i]) * 1099511628211ull;
  if (t->data.kind == DATA_TOKENS) h = (h ^ (uint64_t)t->data.vocab_size) * 1099511628211ull;
  return h;
}

uint64_t trainer_config_hash(const trainer *t) {
  /* a model file by its name, not by where it lies: RUN/job.lua writes the
   * path absolute (job_dump), the first run may have spelled it relative */
  const char *model = strrchr(t->cfg.model, '/') ? strrchr(t->cfg.model, '/') + 1 : t->cfg.model;
  return config_hash_of(t, model);
}

uint64_t trainer_legacy_config_hash(const trainer *t) { return config_hash_of(t, t->cfg.model); }

void trainer_ckpt_state(const trainer *t, ckpt_state *s) {
  rng_t r;
  batch_rng(t, t->step, &r);
  s->step = t->step;
  s->data_rng = r.state;
  s->opt_steps = adamw_steps(t->opt);
  s->config_hash = trainer_config_hash(t);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  s->wall_time = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
  ckpt_target *t;
  int n;
} targets;

static int add_target(void *ctx, const char *name, float *p, int ndim, const int64_t *dim) {
  targets *ts = ctx;
  uint64_t bytes = 4;
  for (int i = 0; i < ndim; i++) bytes *= (uint64_t)dim[i];
  char *copy = strdup(name);
  if (!copy) return tr_fail(TR_ENOMEM, "out of memory");
  ts->t[ts->n++] = (ckpt_target){copy, p, bytes};
  return TR_OK;
}

int trainer_ckpt_load(trainer *t, ckpt_reader *r, int64_t step, char *report, size_t report_len) {
  targets ts = {calloc(3 * (size_t)graph_ntensors(t->g) + 1, sizeof(ckpt_target)), 0};
  if (!ts.t) return tr_fail(TR_ENOMEM, "out of memory");
  /* straight into the host state: ckpt_load writes the targets only once the
   * whole checkpoint verified (and is of this model), so a failed load
   * leaves the trainer as it was */
  int rc = for_each_state(t, 0, add_target, &ts);
  ckpt_state st;
  /* a run of a build before job.lua's paths were absolute hashed the model
   * by its string, as its job.lua still spells it ("models/x.lua") */
  ckpt_reader_expect_model(r, trainer_config_hash(t), trainer_legacy_config_hash(t));
  if (!rc) rc = ckpt_load(r, step, ts.t, ts.n, &st, report, report_len);
  if (!rc) rc = trainer_push(t);
  if (!rc) {
    t->step = st.step;
    adamw_set_steps(t->opt, st.opt_steps);
  }
  for (int i = 0; i < ts.n; i++) free((char *)ts.t[i].name);
  free(ts.t);
  return rc;
}

graph *trainer_graph(trainer *t) { return t->g; }
const dataset *trainer_data(trainer *t) { return &t->data; }

void trainer_get_state(const trainer *t, trainer_state *s) {
  rng_t r;
  batch_rng(t, t->step, &r);
  s->step = t->step;
  s->data_rng = r.state;
}

void trainer_set_slot(trainer *t, int slot) { t->slot = slot; }
int64_t batch_key(int64_t step, const int64_t *skips, int n) {
  for (int i = 0; i < n; i++) /* ascending: each skipped key at or below moves it one further */
    if (skips[i] <= step) step++;
  return step;
}

int trainer_set_batch_skips(trainer *t, const int64_t *keys, int n) {
  if (n < 0 || n > 64) return tr_fail(TR_EINVAL, "%d skipped batches (at most 64)", n);
  for (int i = 1; i < n; i++)
    if (keys[i] <= keys[i - 1]) return tr_fail(TR_EINVAL, "skipped batches must be ascending");
  memcpy(t->batch_skips, keys, sizeof(int64_t) * (size_t)n);
  t->nbatch_skips = n;
  return TR_OK;
}

int trainer_skip_update(trainer *t, int64_t step) {
  if (t->nskip == 64) return tr_fail(TR_EINVAL, "too many skipped updates");
  t->skip_steps[t->nskip++] = step;
  return TR_OK;
}

int trainer_set_lr(trainer *t, int64_t from_step, float lr) {
  if (!(lr > 0) || t->nlr == 16) return tr_fail(TR_EINVAL, "learning-rate change refused (lr %g, %d changes)", lr, t->nlr);
  t->lr_from[t->nlr] = from_step;
  t->lr_to[t->nlr++] = lr;
  return TR_OK;
}

int trainer_pull(trainer *t, int with_moments) {
  if (!t->dev) return TR_OK;
  size_t n = (size_t)graph_nparams(t->g);
  if (t->be->download(t->hparams, graph_params(t->g), sizeof(float) * n))
    return tr_fail(TR_EIO, "copying the training state from the %s device: %s", t->be->name, t->be->error());
  return with_moments ? adamw_pull(t->opt) : TR_OK;
}

int trainer_push(trainer *t) {
  if (!t->dev) return TR_OK;
  size_t n = (size_t)graph_nparams(t->g);
  if (t->be->upload(graph_params(t->g), t->hparams, sizeof(float) * n))
    return tr_fail(TR_EIO, "copying the training state to the %s device: %s", t->be->name, t->be->error());
  return adamw_push(t->opt);
}

float *trainer_grads_host(trainer *t) {
  if (!t->dev) return graph_grads(t->g);
  if (t->be->download(t->hgrads, graph_grads(t->g), sizeof(float) * (size_t)graph_nparams(t->g))) {
    tr_fail(TR_EIO, "copying the gradients from the %s device: %s", t->be->name, t->be->error());
    return NULL;
  }
  return t->hgrads;
}

int trainer_grads_put(trainer *t, const float *host) {
  if (!t->dev) {
    if (host != graph_grads(t->g)) memcpy(graph_grads(t->g), host, sizeof(float) * (size_t)graph_nparams(t->g));
    return TR_OK;
  }
  if (t->be->upload(graph_grads(t->g), host, sizeof(float) * (size_t)graph_nparams(t->g)))
    return tr_fail(TR_EIO, "copying the gradients to the %s device: %s", t->be->name, t->be->error());
  return TR_OK;
}

const tr_backend *trainer_backend(const trainer *t) { return t->be; }

int trainer_buffers_get(trainer *t, trainer_buffers *b) {
  int rc = trainer_pull(t, 1);
  b->n = graph_nparams(t->g);
  b->params = host_params(t);
  b->m = adamw_state(t->opt);
  b->v = b->m + b->n;
  b->step = t->step;
  b->opt_steps = adamw_steps(t->opt);
  return rc;
}

void trainer_set_progress(trainer *t, int64_t step, int64_t opt_steps) {
  t->step = step;
  adamw_set_steps(t->opt, opt_steps);
}

uint32_t trainer_param_crc(trainer *t) {
  if (trainer_pull(t, 0)) return 0; /* an unreadable device disagrees with everyone */
  return tr_crc32c(0, host_params(t), sizeof(float) * (size_t)graph_nparams(t->g));
}
float *trainer_grads(trainer *t) { return graph_grads(t->g); }
int64_t trainer_grads_size(const trainer *t) { return graph_nparams(t->g); }

size_t trainer_planned_bytes(const trainer *t) {
  graph_sizes sz;
  graph_sizes_get(t->g, &sz);
  int64_t elems = sz.params + sz.grads + adamw_state_size(t->opt) + sz.acts + sz.act_grads + sz.inputs;
  if (t->dev) elems += 2 * sz.params + adamw_state_size(t->opt); /* device memory beside the host mirrors */
  return 4 * (size_t)elems;
}

double trainer_flops_per_step(const trainer *t) {
  /* 6 * N * tokens for the matmuls (forward 2, backward 4) plus attention:
   * per layer 2 * B * T * T * C forward (QK^T and AV), x3 with backward. */
  const job_config *c = &t->cfg;
  double N = 0;
  for (int i = 0; i < graph_ntensors(t->g); i++) {
    tensor_desc d;
    graph_tensor(t->g, i, &d);
    if (d.kind == TK_PARAM && d.ndim == 2 && strstr(d.name, "wpe") == NULL) N += (double)d.size;
  }
  double tokens = (double)c->batch_size * (double)c->block_size;
  return 6.0 * N * tokens + 6.0 * (double)c->n_layer * tokens * (double)c->block_size * (double)c->n_embd;
}
