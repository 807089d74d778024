/* test_graph.c — the graph as a whole: a tiny GPT built by lua/models/gpt.lua
 * gradient-checked end to end, plus the planner, the optimizer, the LR
 * schedule, safetensors (its header's checks too) and the data pipeline.
 *
 * GPT check: loss L(params) on fixed tokens; for a seeded sample of
 * parameters across every tensor, (L(p+h) - L(p-h)) / 2h must match the
 * backward pass within 1e-4 + 2e-2 * |g| (h = 1e-2, float32 throughout).
 */
#include <lauxlib.h>
#include <signal.h>
#include <sys/wait.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "check.h"
#include "bpe.h"
#include "bpe_internal.h" /* bpe_new, bpe_add_token: a tokenizer by hand */
#include "crc32c.h"
#include "data.h"
#include "graph.h"
#include "kernels.h"
#include "lua_host.h"
#include "optim.h"
#include "rng.h"
#include "safetensors.h"
#include "trainer.h"
#include "util.h"

static int make_cfg(lua_State *L, const char *model, int layers, int heads, int embd, int block) {
  lua_createtable(L, 0, 8);
  lua_pushstring(L, model);
  lua_setfield(L, -2, "model");
  lua_pushinteger(L, layers);
  lua_setfield(L, -2, "n_layer");
  lua_pushinteger(L, heads);
  lua_setfield(L, -2, "n_head");
  lua_pushinteger(L, embd);
  lua_setfield(L, -2, "n_embd");
  lua_pushinteger(L, block);
  lua_setfield(L, -2, "block_size");
  return luaL_ref(L, LUA_REGISTRYINDEX);
}

/* graph_set_grad_hook: each report's suffix grads[from..) is checksummed
 * when reported; after backward it must hold the same bits (nothing wrote
 * it again), from must only decrease, and 0 must come last. */
typedef struct {
  graph *g;
  int calls, bad_order;
  int64_t last, from[256];
  uint32_t crc[256];
} hook_log;

static void on_grads(void *ud, int64_t from) {
  hook_log *h = ud;
  if (from >= h->last) h->bad_order++;
  h->last = from;
  if (h->calls < 256) {
    int64_t n = graph_nparams(h->g);
    h->from[h->calls] = from;
    h->crc[h->calls] = tr_crc32c(0, graph_grads(h->g) + from, sizeof(float) * (size_t)(n - from));
  }
  h->calls++;
}

static void check_grad_hook(graph *g, int loss, const char *model) {
  hook_log h = {.g = g, .last = graph_nparams(g) + 1};
  CHECK(graph_set_grad_hook(g, on_grads, &h) == 0, "grad hook: %s", tr_error());
  graph_zero_grad(g);
  CHECK(graph_forward(g) == 0 && graph_backward(g, loss) == 0, "forward/backward: %s", tr_error());
  graph_set_grad_hook(g, NULL, NULL);
  int64_t n = graph_nparams(g);
  int changed = 0;
  for (int i = 0; i < h.calls && i < 256; i++)
    changed += tr_crc32c(0, graph_grads(g) + h.from[i], sizeof(float) * (size_t)(n - h.from[i])) != h.crc[i];
  CHECK(h.calls >= 3 && h.bad_order == 0 && h.last == 0, "%s: grad hook called %d times, %d out of order, last %lld",
        model, h.calls, h.bad_order, (long long)h.last);
  CHECK(changed == 0, "%s: %d reported-final gradient ranges changed afterwards", model, changed);
}

static double loss_now(graph *g, int loss) {
  graph_forward(g);
  return *(float *)graph_data(g, loss);
}

static void gpt_gradcheck(lua_State *L, const char *model) {
  const int B = 2, T = 5, V = 7;
  graph *g = NULL;
  int ref = make_cfg(L, model, 2, 2, 8, T);
  int rc = model_build(L, ref, V, B, 1, &g);
  CHECK(rc == 0, "model_build(%s): %s", model, tr_error());
  if (rc) return;
  graph_init_params(g, 7);
  /* larger init than GPT-2's so every path carries signal */
  float *p = graph_params(g);
  rng_t r;
  rng_seed(&r, 99);
  for (int i = 0; i < graph_ntensors(g); i++) {
    tensor_desc d;
    graph_tensor(g, i, &d);
    if (d.kind == TK_PARAM)
      for (int64_t k = 0; k < d.size; k++) p[d.offset + k] += 0.3f * rng_normal(&r);
  }
  int32_t *tok = graph_data(g, graph_find(g, "tokens")), *tgt = graph_data(g, graph_find(g, "targets"));
  for (int i = 0; i < B * T; i++) {
    tok[i] = (int32_t)rng_below(&r, V);
    tgt[i] = (int32_t)rng_below(&r, V);
  }
  int loss = graph_find(g, "loss");
  check_grad_hook(g, loss, model);
  graph_zero_grad(g);
  CHECK(graph_forward(g) == 0 && graph_backward(g, loss) == 0, "forward/backward: %s", tr_error());
  const float *grad = graph_grads(g);
  /* sample up to 12 entries of every parameter tensor */
  int total = 0, bad = 0;
  for (int i = 0; i < graph_ntensors(g); i++) {
    tensor_desc d;
    graph_tensor(g, i, &d);
    if (d.kind != TK_PARAM) continue;
    for (int s = 0; s < 12 && s < d.size; s++) {
      int64_t k = d.offset + (int64_t)rng_below(&r, (uint64_t)d.size);
      float keep = p[k];
      p[k] = keep + 1e-2f;
      double lp = loss_now(g, loss);
      p[k] = keep - 1e-2f;
      double lm = loss_now(g, loss);
      p[k] = keep;
      double num = (lp - lm) / 2e-2, an = grad[k];
      total++;
      if (fabs(num - an) > 1e-4 + 2e-2 * fmax(fabs(num), fabs(an))) {
        if (bad++ < 5) fprintf(stderr, "  %s %s[%lld]: analytic %.6g numeric %.6g\n", model, d.name,
                               (long long)(k - d.offset), an, num);
      }
    }
  }
  CHECK(bad == 0, "%s: %d of %d sampled parameter gradients off", model, bad, total);
  CHECK(total > 100, "%s: only %d gradients sampled", model, total);
  /* weight tying: the token table's gradient has both the embedding and the
   * head contributions, so it is non-zero for tokens that never appear */
  graph_free(g);
  luaL_unref(L, LUA_REGISTRYINDEX, ref);
}

static void test_planner(lua_State *L) {
  graph *g = NULL;
  int ref = make_cfg(L, "gpt", 1, 2, 8, 4);
  CHECK(model_build(L, ref, 5, 3, 1, &g) == 0, "build: %s", tr_error());
  if (!g) return;
  /* parameter count of GPT-2 for L=1, C=8, T=4, V=5 (biases, norms, tied head) */
  int64_t expect = 5 * 8 + 4 * 8 + (8 + 8) + (24 * 8 + 24) + (8 * 8 + 8) + (8 + 8) + (32 * 8 + 32) + (8 * 32 + 8) + 16;
  int64_t n = 0;
  for (int i = 0; i < graph_ntensors(g); i++) {
    tensor_desc d;
    graph_tensor(g, i, &d);
    if (d.kind == TK_PARAM) {
      n += d.size;
      CHECK(d.offset % 16 == 0, "parameter '%s' offset %lld is not 64-byte aligned", d.name, (long long)d.offset);
      CHECK(d.decay == (d.ndim >= 2), "'%s': decay %d for a %d-D parameter", d.name, d.decay, d.ndim);
    }
  }
  CHECK(n == expect, "GPT parameter count %lld, expected %lld", (long long)n, (long long)expect);
  /* same seed, same bits; other seed, other bits */
  graph_init_params(g, 5);
  float *a = malloc(sizeof(float) * (size_t)graph_nparams(g));
  memcpy(a, graph_params(g), sizeof(float) * (size_t)graph_nparams(g));
  graph_init_params(g, 5);
  CHECK(memcmp(a, graph_params(g), sizeof(float) * (size_t)graph_nparams(g)) == 0, "init is not deterministic");
  graph_init_params(g, 6);
  CHECK(memcmp(a, graph_params(g), sizeof(float) * (size_t)graph_nparams(g)) != 0, "seed has no effect");
  free(a);
  /* the residual projections use the smaller std */
  int cp = graph_find(g, "transformer.h.0.attn.c_proj.weight"), fc = graph_find(g, "transformer.h.0.mlp.c_fc.weight");
  CHECK(cp >= 0 && fc >= 0, "nanoGPT parameter names");
  /* a planned graph refuses changes; bad shapes are errors, not crashes */
  int64_t dim[2] = {2, 2};
  CHECK(graph_param(g, "late", 2, dim, INIT_ZEROS, 0, -1) < 0, "planned graph accepted a new parameter");
  CHECK(graph_backward(g, graph_find(g, "logits")) < 0, "backward from a non-scalar must fail");
  graph_free(g);
  /* inference graph: no gradient slabs, same parameter layout */
  graph *gi = NULL;
  CHECK(model_build(L, ref, 5, 1, 0, &gi) == 0, "build inference: %s", tr_error());
  if (gi) {
    CHECK(graph_grads(gi) == NULL, "inference graph has gradients");
    CHECK(graph_backward(gi, graph_find(gi, "loss")) < 0, "inference backward must fail");
    graph_free(gi);
  }
  luaL_unref(L, LUA_REGISTRYINDEX, ref);
}

/* A graph with a float input (a linear layer on it, then add(h, h) and a
 * loss) on emu gives the cpu's loss and gradients bit for bit: every input
 * reaches the kernels as device memory (its uploaded copy), not as the
 * host copy the caller fills, which a GPU (and emu) would refuse. */
static void test_float_input(void) {
  const tr_backend *bes[2] = {backend_cpu(), backend_get("emu", 1)};
  CHECK(bes[1] != NULL, "emu: %s", tr_error());
  if (!bes[1]) return;
  enum { N = 6, C = 5, OC = 7 };
  float loss[2] = {0, 0}, *grads[2] = {NULL, NULL};
  int64_t np = 0;
  for (int k = 0; k < 2; k++) {
    graph *g = graph_create();
    int64_t dx[2] = {N, C}, dw[2] = {OC, C}, db[1] = {OC}, dt[1] = {N};
    int x = graph_input(g, "x", 2, dx, DT_F32), tg = graph_input(g, "targets", 1, dt, DT_I32);
    int w = graph_param(g, "w", 2, dw, INIT_NORMAL, 0.5f, -1), b = graph_param(g, "b", 1, db, INIT_NORMAL, 0.1f, -1);
    int h = graph_linear(g, x, w, b);
    int l = graph_cross_entropy(g, graph_add(g, h, h), tg);
    CHECK(l >= 0 && graph_plan_on(g, 1, bes[k]) == 0, "%s: float-input graph: %s", bes[k]->name, tr_error());
    if (l < 0 || !graph_planned(g)) {
      graph_free(g);
      break;
    }
    CHECK(graph_init_params(g, 7) == 0, "init: %s", tr_error());
    float *hx = graph_data(g, x);
    int32_t *ht = graph_data(g, tg);
    for (int i = 0; i < N * C; i++) hx[i] = (float)((i * 37) % 11) / 5.0f - 1.0f;
    for (int i = 0; i < N; i++) ht[i] = (i * 3) % OC;
    graph_zero_grad(g);
    int rf = graph_forward(g), rb = rf ? rf : graph_backward(g, l);
    CHECK(rf == 0 && rb == 0, "%s: forward %d, backward %d: %s", bes[k]->name, rf, rb, tr_error());
    graph_read(g, l, &loss[k]);
    np = graph_nparams(g);
    grads[k] = malloc(sizeof(float) * (size_t)np);
    CHECK(bes[k]->download(grads[k], graph_grads(g), sizeof(float) * (size_t)np) == 0, "%s: gradients: %s",
          bes[k]->name, bes[k]->error());
    graph_free(g);
  }
  if (grads[0] && grads[1]) {
    CHECK(loss[0] == loss[1] && loss[0] > 0, "float input: loss cpu %.9g, emu %.9g", loss[0], loss[1]);
    CHECK(memcmp(grads[0], grads[1], sizeof(float) * (size_t)np) == 0, "float input: emu's gradients are cpu's");
  }
  CHECK(bes[1]->sync() == 0, "emu is healthy afterwards: %s", bes[1]->error());
  free(grads[0]);
  free(grads[1]);
}

/* TRANSOM_EMU_DEVICES=N: emu has N devices, one per replica, as cuda: an
 * ordinal past them is refused at init, naming the slot and the count. */
static void test_emu_devices(void) {
  const tr_backend *be = backend_emu();
  CHECK(be->devices && be->devices() == 0, "emu: no device limit by default");
  setenv("TRANSOM_EMU_DEVICES", "2", 1);
  CHECK(be->devices() == 2, "emu: TRANSOM_EMU_DEVICES=2 gives 2 devices (%d)", be->devices());
  int rc = be->init(2, 1);
  CHECK(rc == TR_EINVAL && strstr(be->error(), "replica slot 2 has no device of its own") &&
            strstr(be->error(), "2 emulated device(s)"),
        "emu: slot 2 of 2 devices is refused: %d %s", rc, be->error());
  CHECK(be->init(1, 1) == 0 && be->init(-1, 1) == 0, "emu: slots 1 and -1 of 2 devices are fine: %s", be->error());
  unsetenv("TRANSOM_EMU_DEVICES");
  CHECK(be->init(7, 1) == 0, "emu: no limit again: %s", be->error());
  CHECK(backend_cpu()->devices == NULL, "cpu: no device limit");
}

static void test_builder_errors(void) {
  graph *g = graph_create();
  int64_t d23[2] = {2, 3}, d45[2] = {4, 5}, d4[1] = {4};
  int x = graph_input(g, "x", 2, d23, DT_F32);
  int w = graph_param(g, "w", 2, d45, INIT_NORMAL, 0.02f, -1);
  int b = graph_param(g, "b", 1, d4, INIT_ZEROS, 0, -1);
  CHECK(graph_linear(g, x, w, b) < 0 && strstr(tr_error(), "features"), "linear shape error: %s", tr_error());
  CHECK(graph_add(g, x, w) < 0 && strstr(tr_error(), "shapes differ"), "add shape error: %s", tr_error());
  CHECK(graph_attention(g, x, 2) < 0, "attention on a 2-D input must fail");
  CHECK(graph_param(g, "w", 1, d4, INIT_ZEROS, 0, -1) < 0, "duplicate name must fail");
  CHECK(graph_linear(g, 99, w, -1) < 0, "unknown tensor id must fail");
  CHECK(graph_plan(g, 1) < 0, "a graph without ops must not plan");
  graph_free(g);
}

static void test_optim(void) {
  /* one AdamW step by hand: m = (1-b1) g, v = (1-b2) g^2, bias-corrected
   * mhat = g, vhat = g^2, so p -= lr * (g/(|g|+eps) + wd p) */
  graph *g = graph_create();
  int64_t d[2] = {2, 2}, d1[1] = {2};
  graph_param(g, "w", 2, d, INIT_ONES, 0, -1);
  graph_param(g, "b", 1, d1, INIT_ONES, 0, -1);
  int64_t dt[2] = {1, 1};
  int tok = graph_input(g, "t", 2, dt, DT_I32);
  int e = graph_embed(g, tok, 0, -1);
  (void)e;
  CHECK(graph_plan(g, 1) == 0, "plan: %s", tr_error());
  graph_init_params(g, 1);
  adamw_config c = {0.9f, 0.95f, 1e-8f, 0.5f};
  adamw *o = adamw_create(g, &c, NULL);
  float *p = graph_params(g), *gr = graph_grads(g);
  tensor_desc dw, db;
  graph_tensor(g, 0, &dw);
  graph_tensor(g, 1, &db);
  gr[dw.offset] = 2.0f;
  gr[db.offset] = -3.0f;
  adamw_step(o, p, gr, 0.1f);
  CHECK(fabsf(p[dw.offset] - (1.0f - 0.1f * (1.0f + 0.5f))) < 1e-6f, "decayed weight: %g", p[dw.offset]);
  CHECK(fabsf(p[dw.offset + 1] - (1.0f - 0.1f * 0.5f)) < 1e-6f, "zero-grad weight only decays: %g", p[dw.offset + 1]);
  CHECK(fabsf(p[db.offset] - (1.0f + 0.1f)) < 1e-6f, "bias is not decayed: %g", p[db.offset]);
  CHECK(adamw_steps(o) == 1, "step counter");
  adamw_free(o);
  graph_free(g);
  /* clipping */
  float v[2] = {3, 4};
  float n = grad_clip(v, 2, 1.0f);
  CHECK(fabsf(n - 5) < 1e-6f && fabsf(v[0] - 0.6f) < 1e-5f && fabsf(v[1] - 0.8f) < 1e-5f, "clip: %g %g %g", n, v[0], v[1]);
  /* schedule: warm-up, cosine, floor */
  lr_schedule s = {1e-3f, 1e-4f, 10, 110};
  CHECK(fabsf(lr_at(&s, 0) - 1e-4f) < 1e-9f, "warm-up start %g", lr_at(&s, 0));
  CHECK(fabsf(lr_at(&s, 9) - 1e-3f) < 1e-9f, "warm-up end %g", lr_at(&s, 9));
  CHECK(fabsf(lr_at(&s, 60) - 5.5e-4f) < 1e-7f, "cosine midpoint %g", lr_at(&s, 60));
  CHECK(fabsf(lr_at(&s, 500) - 1e-4f) < 1e-9f, "floor %g", lr_at(&s, 500));
}

static void test_safetensors(void) {
  char dir[] = "/tmp/transom-st-XXXXXX", path[256];
  CHECK(mkdtemp(dir) != NULL, "mkdtemp");
  snprintf(path, sizeof path, "%s/m.safetensors", dir);
  float a[6] = {1, 2, 3, 4, 5, 6}, b[3] = {-1, 0.5f, 7};
  int64_t da[2] = {2, 3}, db[1] = {3};
  st_tensor ts[2] = {{"a.weight", a, 2, da}, {"b", b, 1, db}};
  const char *meta[] = {"k", "v\"q", NULL};
  CHECK(safetensors_write(path, ts, 2, meta) == 0, "write: %s", tr_error());
  st_file f;
  CHECK(safetensors_open(&f, path) == 0, "open: %s", tr_error());
  const st_entry *e = safetensors_find(&f, "a.weight");
  CHECK(e && e->ndim == 2 && e->dim[0] == 2 && e->dim[1] == 3, "a.weight entry");
  CHECK(e && memcmp(f.data + e->begin, a, sizeof a) == 0, "a.weight data");
  e = safetensors_find(&f, "b");
  CHECK(e && memcmp(f.data + e->begin, b, sizeof b) == 0, "b data");
  CHECK((8 + (f.data - (const uint8_t *)f.buf - 8)) % 8 == 0, "data is 8-byte aligned");
  safetensors_close(&f);
  /* truncated and corrupted headers are refused, not trusted */
  FILE *fp = fopen(path, "r+b");
  uint8_t huge[8] = {0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0};
  fwrite(huge, 1, 8, fp);
  fclose(fp);
  CHECK(safetensors_open(&f, path) != 0, "a header length past the end must be refused");
  /* shapes whose element count wraps uint64: [2^62, 4] floats is 2^66 bytes,
   * 0 modulo 2^64, so offsets [0, 0] looked consistent and hf_import then
   * read rows past the file; [2^63, 1]: a dimension over INT64_MAX */
  static const char *const wrap[] = {
      "{\"w\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,0]}}",
      "{\"w\":{\"dtype\":\"F32\",\"shape\":[9223372036854775808,2],\"data_offsets\":[0,0]}}",
  };
  for (int k = 0; k < 2; k++) {
    fp = fopen(path, "wb");
    uint64_t hl = strlen(wrap[k]);
    uint8_t l8[8];
    for (int i = 0; i < 8; i++) l8[i] = (uint8_t)(hl >> (8 * i));
    fwrite(l8, 1, 8, fp);
    fwrite(wrap[k], 1, hl, fp);
    fclose(fp);
    int orc = safetensors_open(&f, path);
    if (orc == 0) safetensors_close(&f);
    CHECK(orc != 0, "a shape whose element count overflows must be refused (%s)", wrap[k]);
  }
  unlink(path);
  rmdir(dir);
}

/* A safetensors file at path: the 8-byte length hlen (as given), then the
 * header's bytes, then ndata zero bytes. */
static void write_st(const char *path, uint64_t hlen, const char *header, size_t nheader, size_t ndata) {
  FILE *fp = fopen(path, "wb");
  uint8_t l8[8];
  for (int i = 0; i < 8; i++) l8[i] = (uint8_t)(hlen >> (8 * i));
  fwrite(l8, 1, 8, fp);
  fwrite(header, 1, nheader, fp);
  for (size_t i = 0; i < ndata; i++) fputc(0, fp);
  fclose(fp);
}

/* rc of safetensors_open on path; the file's entry count in *n. */
static int st_open_n(const char *path, int *n) {
  st_file f;
  int rc = safetensors_open(&f, path);
  *n = rc ? -1 : f.n;
  if (!rc) safetensors_close(&f);
  return rc;
}

/* The reader's reasons and its check of names: 50k entries (the pairwise
 * check took seconds; sorted, no time limit is asserted here), one name
 * twice at the end refused, all distinct accepted; a header length under 2
 * and a long __metadata__ string. */
static void test_safetensors_header(void) {
  char dir[] = "/tmp/transom-st-XXXXXX", path[256];
  CHECK(mkdtemp(dir) != NULL, "mkdtemp");
  snprintf(path, sizeof path, "%s/h.safetensors", dir);
  enum { N = 50000 };
  size_t cap = (size_t)N * 80 + 256, k = 0;
  char *h = malloc(cap);
  k += (size_t)snprintf(h + k, cap - k, "{");
  for (int i = 0; i < N; i++)
    k += (size_t)snprintf(h + k, cap - k, "%s\"t%d\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[%d,%d]}",
                          i ? "," : "", i, 4 * (i % 8), 4 * (i % 8) + 4);
  size_t body = k;
  k += (size_t)snprintf(h + k, cap - k, "}");
  int n = 0;
  write_st(path, k, h, k, 32);
  CHECK(st_open_n(path, &n) == TR_OK && n == N, "%d distinct names: n %d, %s", N, n, tr_error());
  /* the same and one more entry, named as entry 17: refused, naming it */
  k = body + (size_t)snprintf(h + body, cap - body, ",\"t17\":{\"dtype\":\"F32\",\"shape\":[1],"
                                                    "\"data_offsets\":[0,4]}}");
  write_st(path, k, h, k, 32);
  CHECK(st_open_n(path, &n) == TR_EFORMAT && strstr(tr_error(), "tensor 't17' appears twice in the header"),
        "one name twice among %d: %s", N + 1, tr_error());
  /* two names twice: the one whose second entry comes first is named */
  const char *two = "{\"b\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},"
                    "\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},"
                    "\"b\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},"
                    "\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}";
  write_st(path, strlen(two), two, strlen(two), 0);
  CHECK(st_open_n(path, &n) == TR_EFORMAT && strstr(tr_error(), "tensor 'b' appears twice"), "%s", tr_error());
  /* a header length of 0 or 1: too short to be {}, not "does not fit" */
  for (uint64_t hl = 0; hl < 2; hl++) {
    write_st(path, hl, "{}", 2, 0);
    CHECK(st_open_n(path, &n) == TR_EFORMAT && strstr(tr_error(), "less than the 2 bytes of the smallest header"),
          "header length %llu: %s", (unsigned long long)hl, tr_error());
  }
  /* a __metadata__ string of 5000 bytes: metadata has no length limit, and
   * is skipped (it was refused as "not an object of strings"); a value that
   * is not a string is still refused so */
  k = (size_t)snprintf(h, cap, "{\"__metadata__\":{\"note\":\"");
  memset(h + k, 'x', 5000);
  k += 5000;
  k += (size_t)snprintf(h + k, cap - k, "\"},\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}");
  write_st(path, k, h, k, 4);
  CHECK(st_open_n(path, &n) == TR_OK && n == 1, "a 5000-byte metadata string: %s", tr_error());
  const char *num = "{\"__metadata__\":{\"step\":100}}";
  write_st(path, strlen(num), num, strlen(num), 0);
  CHECK(st_open_n(path, &n) == TR_EFORMAT && strstr(tr_error(), "__metadata__ is not an object of strings"), "%s",
        tr_error());
  free(h);
  unlink(path);
  rmdir(dir);
}

/* The batch keys after rollbacks: the step-th key that is not skipped, so
 * the steps before a skipped key keep theirs and no skipped key is drawn. */
static void test_batch_keys(void) {
  CHECK(batch_key(0, NULL, 0) == 0 && batch_key(41, NULL, 0) == 41, "no skips: a step's key is the step");
  const int64_t one[] = {5};
  CHECK(batch_key(4, one, 1) == 4 && batch_key(5, one, 1) == 6 && batch_key(9, one, 1) == 10, "skip 5: 4, 6, 10");
  /* nested rollbacks: 7 was skipped first, then (under that) step 2's key, 2 */
  const int64_t two[] = {2, 7}, want[] = {0, 1, 3, 4, 5, 6, 8, 9, 10, 11};
  int ok = 1;
  for (int s = 0; s < 10; s++) ok &= batch_key(s, two, 2) == want[s];
  CHECK(ok, "skips {2, 7}: steps 0..9 draw keys 0 1 3 4 5 6 8 9 10 11");
  const int64_t run[] = {3, 4, 5};
  CHECK(batch_key(2, run, 3) == 2 && batch_key(3, run, 3) == 6, "adjacent skips {3, 4, 5}: step 3 draws key 6");
}

/* A graph of 300 chained adds: each node's shape is read from its input
 * while the tensor table grows past 64, 128 and 256 entries (under ASan, the
 * use-after-free GPT-2's 12 layers once hit; here: the shapes stay right). */
static void test_graph_growth(void) {
  graph *g = graph_create();
  const int64_t dim[3] = {2, 3, 5};
  int x = graph_input(g, "x", 3, dim, DT_F32);
  for (int i = 0; i < 300 && x >= 0; i++) x = graph_add(g, x, x);
  CHECK(x >= 0, "300 adds: %s", tr_error());
  tensor_desc d;
  if (x >= 0) graph_tensor(g, x, &d);
  CHECK(x >= 0 && d.ndim == 3 && d.dim[0] == 2 && d.dim[1] == 3 && d.dim[2] == 5, "the last add keeps (2,3,5)");
  graph_free(g);
}

static void test_data(void) {
  char dir[] = "/tmp/transom-data-XXXXXX", path[256];
  CHECK(mkdtemp(dir) != NULL, "mkdtemp");
  snprintf(path, sizeof path, "%s/c.txt", dir);
  FILE *f = fopen(path, "w");
  for (int i = 0; i < 400; i++) fputs("abcab\n", f);
  fclose(f);
  dataset d;
  CHECK(dataset_load(&d, path, 8) == 0, "load: %s", tr_error());
  CHECK(d.voc.size == 4, "vocab size %d (expected a b c \\n)", d.voc.size);
  CHECK(d.n_train == d.n * 9 / 10, "90/10 split");
  int32_t x[16], y[16], x2[16], y2[16];
  rng_t r1, r2;
  rng_seed(&r1, 3);
  rng_seed(&r2, 3);
  dataset_batch(&d, SPLIT_TRAIN, &r1, 2, 8, x, y);
  dataset_batch(&d, SPLIT_TRAIN, &r2, 2, 8, x2, y2);
  CHECK(memcmp(x, x2, sizeof x) == 0 && memcmp(y, y2, sizeof y) == 0, "same seed, same batch");
  int shifted = 1;
  for (int b = 0; b < 2; b++)
    for (int t = 0; t + 1 < 8; t++) shifted &= y[b * 8 + t] == x[b * 8 + t + 1];
  CHECK(shifted, "targets are the inputs shifted by one");
  int32_t ids[3];
  CHECK(vocab_encode(&d.voc, "abz", 3, ids) != 0 && strstr(tr_error(), "'z'"), "unknown char: %s", tr_error());
  snprintf(path, sizeof path, "%s/v.json", dir);
  CHECK(vocab_save(&d.voc, path) == 0, "vocab save");
  vocab v;
  CHECK(vocab_load(&v, path) == 0 && v.size == 4 && memcmp(v.byte_of, d.voc.byte_of, 4) == 0, "vocab round trip");
  unlink(path);
  dataset_free(&d);
  snprintf(path, sizeof path, "%s/c.txt", dir);
  CHECK(dataset_load(&d, path, 4000) != 0 && strstr(tr_error(), "too small"), "small corpus: %s", tr_error());
  unlink(path);
  rmdir(dir);
}

/* Writes an llm.c shard of n tokens t(i) (magic/version/count overridable). */
static void write_llmc(const char *path, int magic, int version, int count, int n, int first) {
  int32_t h[256] = {magic, version, count};
  FILE *f = fopen(path, "wb");
  fwrite(h, sizeof h, 1, f);
  for (int i = 0; i < n; i++) {
    uint16_t t = (uint16_t)(first + i % 50);
    fwrite(&t, 2, 1, f);
  }
  fclose(f);
}

/* Token shards: a glob of two llm.c shards (tokens 0..49 and 100..149) and a
 * nanoGPT pair; every batch row lies inside one shard and is a run of the
 * file; both shards are drawn; bad shards fail naming the file. */
static void test_shards(void) {
  char dir[] = "/tmp/transom-shards-XXXXXX", a[256], b[256], pat[256], val[256];
  CHECK(mkdtemp(dir) != NULL, "mkdtemp");
  snprintf(a, sizeof a, "%s/s_000.bin", dir);
  snprintf(b, sizeof b, "%s/s_001.bin", dir);
  snprintf(pat, sizeof pat, "%s/s_*.bin", dir);
  write_llmc(a, 20240520, 1, 3000, 3000, 0);
  write_llmc(b, 20240520, 1, 1000, 1000, 100);
  dataset d;
  data_spec sp = {pat, NULL, "auto", 200, 16};
  CHECK(dataset_open(&d, &sp) == 0, "open a glob of shards: %s", tr_error());
  CHECK(d.kind == DATA_TOKENS && d.n == 4000 && d.n_train == 3600, "4000 tokens, 3600 train (got %lld, %lld)",
        (long long)d.n, (long long)d.n_train);
  CHECK(d.model_vocab == 256, "vocab 200 padded to 256 (got %lld)", (long long)d.model_vocab);
  int32_t x[64 * 16], y[64 * 16];
  rng_t r;
  rng_seed(&r, 7);
  int ok = 1, saw[2] = {0, 0};
  for (int rep = 0; rep < 4; rep++) {
    dataset_batch(&d, SPLIT_TRAIN, &r, 64, 16, x, y);
    for (int i = 0; i < 64; i++) {
      int32_t *row = x + i * 16, hi = row[0] >= 100;
      saw[hi] = 1;
      for (int t = 0; t < 16; t++) {
        ok &= (row[t] >= 100) == hi && y[i * 16 + t] == (row[t] % 50 == 49 ? row[t] - 49 : row[t] + 1);
      }
    }
  }
  CHECK(ok, "every row is a run of one shard, targets shifted by one");
  CHECK(saw[0] && saw[1], "rows come from both shards");
  dataset_free(&d);

  snprintf(val, sizeof val, "%s/val.bin", dir); /* nanoGPT: headerless uint16 */
  FILE *f = fopen(val, "wb");
  for (uint16_t t = 0; t < 500; t++) fwrite(&t, 2, 1, f);
  fclose(f);
  sp = (data_spec){a, val, "auto", 500, 16};
  CHECK(dataset_open(&d, &sp) == 0 && d.n_train == 3000 && d.n == 3500, "llm.c train + nanoGPT val: %s",
        tr_error());
  dataset_batch(&d, SPLIT_VAL, &r, 4, 16, x, y);
  CHECK(y[0] == x[0] + 1 && x[15] == x[0] + 15, "val rows are runs of val.bin");
  dataset_free(&d);

  sp = (data_spec){val, NULL, "auto", 100, 16};
  CHECK(dataset_open(&d, &sp) != 0 && strstr(tr_error(), "val.bin") && strstr(tr_error(), "is 100"),
        "a token >= vocab_size names the file and the token: %s", tr_error());
  dataset_free(&d);
  write_llmc(b, 20240519, 1, 1000, 1000, 0);
  sp = (data_spec){pat, NULL, "auto", 200, 16};
  CHECK(dataset_open(&d, &sp) != 0 && strstr(tr_error(), "s_001.bin") && strstr(tr_error(), "magic"),
        "wrong magic: %s", tr_error());
  dataset_free(&d);
  write_llmc(b, 20240520, 1, 1000, 999, 0);
  CHECK(dataset_open(&d, &sp) != 0 && strstr(tr_error(), "s_001.bin") && strstr(tr_error(), "truncated"),
        "truncated: %s", tr_error());
  dataset_free(&d);
  sp = (data_spec){pat, NULL, "auto", 0, 16};
  CHECK(dataset_open(&d, &sp) != 0 && strstr(tr_error(), "vocab_size"), "no vocab_size: %s", tr_error());
  dataset_free(&d);
  snprintf(pat, sizeof pat, "%s/nothing_*.bin", dir);
  sp = (data_spec){pat, NULL, "auto", 200, 16};
  CHECK(dataset_open(&d, &sp) != 0 && strstr(tr_error(), "matches no file"), "empty glob: %s", tr_error());
  dataset_free(&d);
  unlink(a);
  unlink(b);
  unlink(val);
  rmdir(dir);
}

/* Byte-level BPE: trained on a text, encoding then decoding gives the text
 * back, merges shorten it, a saved tokenizer encodes the same, GPT-2's
 * pre-tokenizer keeps " world" and "'s" as pieces, a damaged file names its
 * line. */
/* Byte-level BPE needs a token for each of the 256 bytes: a tokenizer
 * file lacking one (or holding it only as a special token) is refused at
 * load naming the byte; a tokenizer built by hand without one makes
 * bpe_encode fail naming the byte, never map it to id 0. */
static void test_bpe_bytes(const char *path) {
  static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  FILE *f = fopen(path, "w"); /* tiktoken: bytes 0x00..0x40 only */
  for (int i = 0; i <= 0x40; i++) fprintf(f, "%c%c== %d\n", b64[i >> 2], b64[(i & 3) << 4], i);
  fclose(f);
  bpe *c = bpe_load(path);
  CHECK(c == NULL && strstr(tr_error(), "tokenizer.bpe: no token for the byte 0x41"),
        "a tiktoken file without byte 'A' is refused naming it: %s", tr_error());
  bpe_free(c);
  f = fopen(path, "w"); /* transom-bpe: all 256, but 0x0a is special */
  fprintf(f, "transom-bpe 1 256\n");
  for (int i = 0; i < 256; i++) fprintf(f, "%s%02x\n", i == 0x0a ? "!" : "", i);
  fclose(f);
  c = bpe_load(path);
  CHECK(c == NULL && strstr(tr_error(), "tokenizer.bpe: no token for the byte 0x0a"),
        "a byte held only as a special token is refused naming it: %s", tr_error());
  bpe_free(c);
  bpe *h = bpe_new(4); /* by hand: 'a' and 'b' only */
  CHECK(h && bpe_add_token(h, (const uint8_t *)"a", 1, 0) == 0 && bpe_add_token(h, (const uint8_t *)"b", 1, 0) == 0,
        "a hand-built tokenizer: %s", tr_error());
  int32_t ids[8];
  int64_t n = -1;
  CHECK(bpe_encode(h, "abc", 3, ids, 8, &n, 0) == TR_EINVAL && strstr(tr_error(), "the byte 0x63 has no token"),
        "encoding a byte with no token fails naming it: %s", tr_error());
  CHECK(bpe_encode(h, "ab", 2, ids, 8, &n, 0) == 0 && n == 2 && ids[0] == 0 && ids[1] == 1, "'ab' -> 0 1 (%lld)",
        (long long)n);
  bpe_free(h);
}

static void test_bpe(void) {
  static const char text[] = "the cat's hat is on the mat; the cat sat.\n\n  The hat, the cat and 42 mats!\n";
  char big[sizeof text * 40];
  size_t len = 0;
  for (int i = 0; i < 40; i++) memcpy(big + len, text, sizeof text - 1), len += sizeof text - 1;
  bpe *b = bpe_train(big, len, 1000); /* stops early: when no pair repeats */
  CHECK(b != NULL, "train: %s", tr_error());
  if (!b) return;
  int V = (int)bpe_vocab_size(b);
  CHECK(V > 270 && V < 1000 && bpe_eot(b) == V - 1, "merges until none repeats, <|endoftext|> last (%lld, %d)",
        (long long)bpe_vocab_size(b), bpe_eot(b));
  int32_t *ids = malloc(sizeof(int32_t) * (len + 1));
  int64_t n = 0;
  CHECK(bpe_encode(b, big, len, ids, (int64_t)len + 1, &n, 1) == 0 && ids[0] == V - 1, "encode, eot first");
  CHECK(n < (int64_t)len / 3, "merges shorten the text: %lld ids for %zu bytes", (long long)n, len);
  char *back = NULL;
  size_t blen = 0;
  FILE *m = open_memstream(&back, &blen);
  for (int64_t i = 1; i < n; i++) bpe_decode(b, ids[i], m);
  fclose(m);
  CHECK(blen == len && memcmp(back, big, len) == 0, "decode(encode(text)) == text");
  free(back);
  /* a long piece (no space: CJK text, base64) merges through a heap of
   * candidate pairs, a short one by rescanning its parts: the same ids on
   * runs of the corpus's letters, spaces and newlines (many merges; "   "
   * and "\n\n\n" where the leftmost of equal pairs must win) and random bytes */
  {
    uint64_t x = 0x9E3779B97F4A7C15ull;
    int agree = 1, merged = 0;
    uint8_t piece[600];
    int32_t *o1 = malloc(sizeof(int32_t) * sizeof piece), *o2 = malloc(sizeof(int32_t) * sizeof piece);
    for (int t = 0; t < 300 && agree; t++) {
      size_t pn = 1 + (size_t)(t * 2) % sizeof piece;
      for (size_t i = 0; i < pn; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        piece[i] = t % 3 ? (uint8_t)"thecatsm \n  \n"[x % 12] : (uint8_t)x;
      }
      int64_t a = -1, c2 = -1;
      agree = bpe_encode_piece_paths(b, piece, pn, o1, o2, &a, &c2) == 0 && a == c2 &&
              memcmp(o1, o2, sizeof(int32_t) * (size_t)a) == 0;
      merged += a < (int64_t)pn;
    }
    CHECK(agree && merged > 100, "the heap and the rescan merge alike (%d pieces merged)", merged);
    free(o1);
    free(o2);
    /* and a 4 MiB piece, which the rescan alone took hours for */
    size_t bn = (size_t)4 << 20;
    char *one_piece = malloc(bn);
    int32_t *bids = malloc(sizeof(int32_t) * bn);
    for (size_t i = 0; i < bn; i++) one_piece[i] = "thecat"[i % 6];
    int64_t bk = 0;
    CHECK(bpe_encode(b, one_piece, bn, bids, (int64_t)bn, &bk, 0) == 0 && bk > 0 && bk < (int64_t)bn,
          "a 4 MiB piece encodes (%lld ids): %s", (long long)bk, tr_error());
    free(one_piece);
    free(bids);
  }
  /* pieces never merge across GPT-2's split points: " cat" and "'s" are tokens, "t'" is not */
  int32_t one[16];
  int64_t k;
  bpe_encode(b, " cat's", 6, one, 16, &k, 0);
  CHECK(k == 2, "\" cat's\" is two tokens (\" cat\", \"'s\"), got %lld", (long long)k);
  char dir[] = "/tmp/transom-bpe-XXXXXX", path[256];
  CHECK(mkdtemp(dir) != NULL, "mkdtemp");
  snprintf(path, sizeof path, "%s/tokenizer.bpe", dir);
  CHECK(bpe_save(b, path) == 0, "save: %s", tr_error());
  bpe *c = bpe_load(path);
  CHECK(c != NULL, "load: %s", tr_error());
  int32_t *ids2 = malloc(sizeof(int32_t) * (len + 1));
  int64_t n2 = 0;
  if (c) bpe_encode(c, big, len, ids2, (int64_t)len + 1, &n2, 1);
  CHECK(n2 == n && memcmp(ids, ids2, sizeof(int32_t) * (size_t)n) == 0, "the loaded tokenizer encodes the same");
  bpe_free(c);
  FILE *f = fopen(path, "r+");
  fseek(f, 20, SEEK_SET); /* inside line 2 */
  fputs("zz", f);
  fclose(f);
  c = bpe_load(path);
  CHECK(c == NULL && strstr(tr_error(), "tokenizer.bpe:2:"), "a damaged token names its line: %s", tr_error());
  bpe_free(c);
  /* a header claiming far more tokens than the file holds is refused before
   * 2^24 tokens' tables are allocated (a shard directory's tokenizer.bpe is
   * input like any other) */
  f = fopen(path, "w");
  fputs("transom-bpe 1 16777216\n61\n", f);
  fclose(f);
  c = bpe_load(path);
  CHECK(c == NULL && strstr(tr_error(), "tokenizer.bpe:1: the header says 16777216 tokens, the file has 2 lines"),
        "a token count past the file's lines is refused at the header: %s", tr_error());
  bpe_free(c);
  /* a tiktoken file (GPT-2's format): the 256 bytes, then "th", "the", " the" */
  f = fopen(path, "w");
  static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  for (int i = 0; i < 256; i++) fprintf(f, "%c%c== %d\n", b64[i >> 2], b64[(i & 3) << 4], i);
  fprintf(f, "dGg= 256\ndGhl 257\nIHRoZQ== 258\n");
  fclose(f);
  c = bpe_load(path);
  CHECK(c != NULL, "tiktoken load: %s", tr_error());
  if (c) {
    CHECK(bpe_vocab_size(c) == 260 && bpe_eot(c) == 259, "259 ranks + <|endoftext|> = 260 tokens");
    CHECK(bpe_encode(c, "the the", 7, one, 16, &k, 0) == 0 && k == 2 && one[0] == 257 && one[1] == 258,
          "'the the' -> 257 258 (merges by rank)");
    bpe_free(c);
  }
  f = fopen(path, "w");
  fprintf(f, "AA== 0\nAQ== 2\n");
  fclose(f);
  c = bpe_load(path);
  CHECK(c == NULL && strstr(tr_error(), "tokenizer.bpe:2:"), "a tiktoken rank out of order names its line: %s",
        tr_error());
  test_bpe_bytes(path);
  unlink(path);
  rmdir(dir);
  free(ids);
  free(ids2);
  bpe_free(b);
}

/* bf16 activations: the same GPT and parameters with activations stored as
 * bf16 (graph_set_bf16, the host tr_bf16_ops) give the fp32 loss and
 * parameter gradients within bf16's precision (8 significant bits), and the
 * activation slabs take about half the memory. */
static void test_bf16(lua_State *L) {
  const int B = 2, T = 16, V = 11;
  int ref = make_cfg(L, "gpt", 2, 2, 16, T);
  graph *g[2] = {NULL, NULL};
  for (int k = 0; k < 2; k++) {
    int rc = model_build_on(L, ref, V, B, 1, backend_cpu(), k, &g[k]);
    CHECK(rc == 0, "model_build_on(bf16=%d): %s", k, tr_error());
    if (rc) goto out;
    graph_init_params(g[k], 3);
    int32_t *tok = graph_data(g[k], graph_find(g[k], "tokens")), *tgt = graph_data(g[k], graph_find(g[k], "targets"));
    for (int i = 0; i < B * T; i++) tok[i] = (i * 7 + 3) % V, tgt[i] = (i * 5 + 1) % V;
    CHECK(graph_forward(g[k]) == 0, "forward: %s", tr_error());
    CHECK(graph_backward(g[k], graph_find(g[k], "loss")) == 0, "backward: %s", tr_error());
  }
  graph_sizes s32, s16;
  graph_sizes_get(g[0], &s32);
  graph_sizes_get(g[1], &s16);
  CHECK(s16.params == s32.params, "parameters stay fp32");
  CHECK(s16.acts < 0.6 * s32.acts && s16.act_grads < 0.6 * s32.act_grads, "bf16 activation slabs: %lld, %lld of %lld, %lld",
        (long long)s16.acts, (long long)s16.act_grads, (long long)s32.acts, (long long)s32.act_grads);
  float l32, l16;
  graph_read(g[0], graph_find(g[0], "loss"), &l32);
  graph_read(g[1], graph_find(g[1], "loss"), &l16);
  CHECK(fabsf(l32 - l16) < 1e-2f * fabsf(l32) && l32 != l16, "loss fp32 %.6f bf16 %.6f", l32, l16);
  tensor_desc d;
  graph_tensor(g[1], graph_find(g[1], "logits"), &d);
  CHECK(d.dtype == DT_BF16, "logits are bf16");
  /* parameter gradients: relative to the largest of each tensor */
  int bad = 0;
  for (int i = 0; i < graph_ntensors(g[0]); i++) {
    graph_tensor(g[0], i, &d);
    if (d.kind != TK_PARAM) continue;
    const float *a = graph_grad(g[0], i), *b = graph_grad(g[1], i);
    float mx = 0;
    for (int64_t j = 0; j < d.size; j++) mx = fmaxf(mx, fabsf(a[j]));
    for (int64_t j = 0; j < d.size; j++)
      if (fabsf(a[j] - b[j]) > 5e-2f * mx + 1e-6f) {
        if (bad++ < 5) fprintf(stderr, "  %s[%lld]: fp32 %g bf16 %g (max %g)\n", d.name, (long long)j, a[j], b[j], mx);
      }
  }
  CHECK(bad == 0, "%d bf16 parameter gradients off by more than 5%% of their tensor's largest", bad);
  /* the bf16 kernels take activations where activations flow: a parameter
   * fed straight into gelu is refused at planning, naming the op */
  graph *h = graph_create();
  int64_t xd[2] = {4, 3};
  graph_gelu(h, graph_param(h, "x", 2, xd, INIT_NORMAL, 1, -1));
  graph_set_bf16(h, 1);
  CHECK(graph_plan(h, 1) == TR_EINVAL && strstr(tr_error(), "gelu (node 0) takes 'x' (4,3)") &&
            strstr(tr_error(), "must be an activation"),
        "plan: %s", tr_error());
  graph_free(h);
  /* a cross_entropy loss stays fp32 under bf16: fed to a bf16 op (two losses
   * summed), the op would read its bits as bf16; refused at planning */
  h = graph_create();
  int64_t td[2] = {1, 4}, wd[2] = {5, 3}, ld[2] = {5, 3};
  int tok = graph_input(h, "tok", 2, td, DT_I32), tgt = graph_input(h, "tgt", 2, td, DT_I32);
  int x = graph_embed(h, tok, graph_param(h, "wte", 2, wd, INIT_NORMAL, 1, -1), -1);
  int logits = graph_linear(h, x, graph_param(h, "w", 2, ld, INIT_NORMAL, 1, -1), -1);
  graph_output(h, "loss", graph_add(h, graph_cross_entropy(h, logits, tgt), graph_cross_entropy(h, logits, tgt)));
  graph_set_bf16(h, 1);
  CHECK(graph_plan(h, 1) == TR_EINVAL && strstr(tr_error(), "add (node") && strstr(tr_error(), "fp32"),
        "plan: an fp32 loss into a bf16 add must be refused: %s", tr_error());
  graph_free(h);
  /* a scalar loss that is a bf16 activation: backward seeds its gradient
   * with bf16 1.0 (one token, one channel: the embedding's output is it) */
  h = graph_create();
  int64_t one[2] = {1, 1}, ed[2] = {3, 1};
  tok = graph_input(h, "tok", 2, one, DT_I32);
  int wte = graph_param(h, "wte", 2, ed, INIT_NORMAL, 1, -1);
  int e = graph_embed(h, tok, wte, -1);
  graph_set_bf16(h, 1);
  CHECK(graph_plan(h, 1) == 0, "plan: %s", tr_error());
  graph_init_params(h, 1);
  *(int32_t *)graph_data(h, tok) = 2;
  CHECK(graph_forward(h) == 0 && graph_backward(h, e) == 0, "forward/backward: %s", tr_error());
  const float *dwte = graph_grad(h, wte);
  CHECK(dwte[0] == 0 && dwte[1] == 0 && dwte[2] == 1.0f, "d loss / d wte[2] = 1, got %g %g %g", dwte[0], dwte[1],
        dwte[2]);
  graph_free(h);
out:
  graph_free(g[0]);
  graph_free(g[1]);
  luaL_unref(L, LUA_REGISTRYINDEX, ref);
}

/* emu's device memory is closed to the host outside the backend's calls: a
 * direct read faults (as it would on a GPU) while upload/download work. */
static void test_emu_guard(void) {
  const tr_backend *be = backend_get("emu", 1);
  CHECK(be != NULL, "emu: %s", tr_error());
  if (!be) return;
  float in[4] = {1, 2, 3, 4}, out[4] = {0};
  float *d = be->alloc(sizeof in);
  CHECK(d && be->upload(d, in, sizeof in) == 0 && be->download(out, d, sizeof out) == 0 && out[3] == 4,
        "emu round trip");
  be->scale(d, 4, 2.0f);
  be->download(out, d, sizeof out);
  CHECK(out[0] == 2 && out[3] == 8, "emu kernel on device memory: %g %g", out[0], out[3]);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    if (!freopen("/dev/null", "w", stderr)) { /* a sanitizer build reports the fault instead of dying of it */
      /* then the report lands in the test's output; the outcome is the same */
    }
    volatile float x = d[0]; /* host code touching device memory */
    (void)x;
    _exit(0);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  CHECK((WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV) || (WIFEXITED(st) && WEXITSTATUS(st) != 0),
        "a host read of emu device memory must fault (status %d)", st);
  /* the other way round: a host pointer given to a kernel is an illegal
   * address; the kernel does not run and the device is lost for good (in a
   * child: it cannot be undone) */
  fflush(NULL);
  pid = fork();
  if (pid == 0) {
    float host[4] = {1, 2, 3, 4};
    int bad = 0;
    be->scale(host, 4, 2.0f);
    bad |= (host[0] != 1) << 0; /* did not run */
    int rc = be->sync();
    bad |= (rc != TR_EDEVICE || !strstr(be->error(), "illegal address") || !strstr(be->error(), "scale")) << 1;
    bad |= (be->upload(d, in, sizeof in) != TR_EDEVICE) << 2; /* sticky */
    bad |= (be->alloc(16) != NULL) << 3;
    bad |= (be->sync() != TR_EDEVICE || !strstr(be->error(), "scale")) << 4; /* still the first error */
    if (bad) fprintf(stderr, "emu illegal address: bad = %#x (%s)\n", bad, be->error());
    _exit(bad);
  }
  waitpid(pid, &st, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0,
        "emu: a host pointer at a kernel does not run it, and sync, upload and alloc fail for good with TR_EDEVICE "
        "(child status %#x)",
        st);
  CHECK(be->sync() == 0, "this process's emu is unaffected: %s", be->error());
  be->free(d);
}

int main(void) {
  lua_State *L = lua_host_new();
  if (!L) return 1;
  kernels_set_threads(1);
  gpt_gradcheck(L, "gpt");
  gpt_gradcheck(L, "mlp");
  kernels_set_threads(2);
  gpt_gradcheck(L, "gpt");
  test_planner(L);
  test_bf16(L);
  test_emu_guard();
  test_float_input();
  test_emu_devices();
  test_builder_errors();
  test_optim();
  test_safetensors();
  test_safetensors_header();
  test_data();
  test_shards();
  test_bpe();
  test_batch_keys();
  test_graph_growth();
  lua_host_close(L);
  return check_report("test_graph");
}
