/* graph.c — the OP-DAG: builder, planner, executor (see graph.h).
 *
 * Nodes are appended in creation order; since every input must exist before
 * it is used, creation order is already a topological order. The planner keeps
 * the nodes the outputs depend on, in that order, and lays every tensor out in
 * its family's slab. Forward walks the order; backward walks it in reverse.
 * Kernels live behind the backend table (backend.h); this file only
 * dispatches. The ops, their inputs' roles and the arguments each kernel
 * gets from a node come from ops.def: the enum, the op table and the four
 * dispatch switches (fp32/bf16, forward/backward) below are generated from
 * it. The builders (graph_embed, ...) hold each op's shape rule.
 */
#include "graph.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "kernels.h"
#include "rng.h"
#include "util.h"

/* --- the ops (ops.def) --- */

typedef enum {
#define TR_OP(ID, ...) OP_##ID,
#include "ops.def"
} op_kind;

/* What the planner and executor know of an op besides its kernels. */
typedef struct {
  const char *name;
  char ins[4]; /* roles of inputs 0..2: 'a' activation, 'p' parameter, 't' tokens, '-' none */
  char out;    /* 'a', or 'f': stays fp32 under bf16 (the loss) */
  char aux[3]; /* roles of the op-private tensors 0..1: 'a', 'f', '-' */
} op_info;

static const op_info ops[TR_OP_COUNT] = {
#define TR_OP(ID, NAME, K, HOST, INS, OUT, AUX, ...) [OP_##ID] = {#NAME, INS, OUT, AUX},
#include "ops.def"
};

#define TR_OP(ID, NAME, K, HOST, INS, OUT, AUX, ...) \
  _Static_assert(sizeof INS == 4 && sizeof AUX == 3, #NAME ": ops.def names 3 input roles and 2 aux roles");
#include "ops.def"

typedef struct {
  char name[GRAPH_NAME_MAX];
  tensor_kind kind;
  tensor_dtype dtype;
  int ndim;
  int64_t dim[GRAPH_MAX_DIMS];
  int64_t size;
  int64_t off;  /* into the family slab, in 4-byte slots */
  int64_t goff; /* into the gradient slab of its family; -1: no gradient */
  int aux;      /* op-private activation (saved stats): never has a gradient */
  int eb;       /* bytes per element as stored: 4, or 2 for a bf16 activation */
  param_init init;
  float std;
  int decay;
} tensor;

typedef struct {
  op_kind op;
  int in[3]; /* tensor ids, -1 when unused */
  int out;
  int aux[2]; /* op-private activations, -1 when unused */
  int iattr;  /* attention: heads */
} node;

typedef struct {
  char name[GRAPH_NAME_MAX];
  int t;
} output;

struct graph {
  tensor *tensors;
  int nt, capt;
  node *nodes;
  int nn, capn;
  output *outputs;
  int no, capo;
  /* plan */
  int planned, with_grad;
  int *order; /* node ids, topological */
  int norder;
  graph_sizes sz;
  const tr_backend *be;                  /* where the slabs live and which kernels run */
  int bf16;                              /* activations stored as bf16 (graph_set_bf16) */
  tr_bf16 *w16;                          /* bf16: the parameters' bf16 shadow, refreshed every forward */
  float *params, *grads, *acts, *act_grads; /* backend memory */
  uint32_t *inputs;  /* host: int32 or float32 inputs, 4 bytes each (the caller fills them) */
  uint32_t *dinputs; /* their device copy (== inputs on a host backend) */
  /* graph_set_grad_hook: after backward ran order position k (and all
   * later ones), grads[grad_ready[k]..) are final; grad_ready[norder]:
   * before any op */
  int64_t *grad_ready;
  graph_grad_hook grad_hook;
  void *grad_ud;
};

#define ALIGN_ELEMS 16 /* 64 bytes */

static int64_t align_up(int64_t n) { return (n + ALIGN_ELEMS - 1) / ALIGN_ELEMS * ALIGN_ELEMS; }
/* 4-byte slots a tensor takes in its slab */
static int64_t slots_of(const tensor *t) { return t->eb == 2 ? (t->size + 1) / 2 : t->size; }

graph *graph_create(void) {
  graph *g = calloc(1, sizeof *g);
  if (!g) tr_fail(TR_ENOMEM, "out of memory creating a graph");
  return g;
}

void graph_free(graph *g) {
  if (!g) return;
  free(g->tensors);
  free(g->nodes);
  free(g->outputs);
  free(g->order);
  free(g->grad_ready);
  if (g->be) {
    g->be->free(g->params);
    g->be->free(g->grads);
    g->be->free(g->acts);
    g->be->free(g->act_grads);
    if (g->dinputs != g->inputs) g->be->free(g->dinputs);
    g->be->free(g->w16);
  }
  tr_free_aligned(g->inputs);
  free(g);
}

/* --- builder helpers --- */

static int grow(void **p, int *cap, int n, size_t elem) {
  if (n < *cap) return TR_OK;
  int ncap = *cap ? *cap * 2 : 64;
  void *np = realloc(*p, (size_t)ncap * elem);
  if (!np) return tr_fail(TR_ENOMEM, "out of memory growing the graph");
  *p = np;
  *cap = ncap;
  return TR_OK;
}

static int check_building(graph *g) {
  if (g->planned) return tr_fail(TR_ESTATE, "the graph is already planned; it cannot change");
  return TR_OK;
}

static int check_tensor(const graph *g, int t, const char *what) {
  if (t < 0 || t >= g->nt) return tr_fail(TR_EINVAL, "%s: no such tensor (id %d)", what, t);
  return TR_OK;
}

static void shape_str(const tensor *t, char *buf, size_t n) {
  size_t k = (size_t)snprintf(buf, n, "(");
  for (int i = 0; i < t->ndim && k < n; i++)
    k += (size_t)snprintf(buf + k, n - k, i ? ",%lld" : "%lld", (long long)t->dim[i]);
  if (k < n) snprintf(buf + k, n - k, ")");
}

/* "'name' (2,3)" for error messages; rotates among 4 buffers */
static const char *describe(const graph *g, int t) {
  static _Thread_local char bufs[4][160];
  static _Thread_local int i;
  char *b = bufs[i++ & 3];
  char s[96];
  shape_str(&g->tensors[t], s, sizeof s);
  snprintf(b, 160, "'%s' %s", g->tensors[t].name, s);
  return b;
}

static int add_tensor(graph *g, const char *name, tensor_kind kind, tensor_dtype dt, int ndim, const int64_t *dim_in) {
  if (ndim < 0 || ndim > GRAPH_MAX_DIMS) return tr_fail(TR_EINVAL, "'%s': %d dimensions (at most %d)", name, ndim, GRAPH_MAX_DIMS);
  /* callers pass another tensor's shape (g->tensors[a].dim): copy it before
   * grow() may move the tensor table (a use-after-free once a graph passed
   * 64, 128, ... tensors, as GPT-2's 12 layers do) */
  int64_t dim[GRAPH_MAX_DIMS];
  for (int i = 0; i < ndim; i++) dim[i] = dim_in[i];
  int rc = grow((void **)&g->tensors, &g->capt, g->nt, sizeof(tensor));
  if (rc) return rc;
  if (strlen(name) >= GRAPH_NAME_MAX) return tr_fail(TR_EINVAL, "tensor name too long: '%s'", name);
  tensor *t = &g->tensors[g->nt];
  memset(t, 0, sizeof *t);
  snprintf(t->name, sizeof t->name, "%s", name);
  t->kind = kind;
  t->dtype = dt;
  t->ndim = ndim;
  t->size = 1;
  for (int i = 0; i < ndim; i++) {
    if (dim[i] < 1 || dim[i] > ((int64_t)1 << 31))
      return tr_fail(TR_EINVAL, "'%s': dimension %d is %lld (must be 1..2^31)", name, i + 1, (long long)dim[i]);
    t->dim[i] = dim[i];
    t->size *= dim[i];
  }
  if (t->size > ((int64_t)1 << 34)) return tr_fail(TR_EINVAL, "'%s': %lld elements is too large", name, (long long)t->size);
  t->goff = -1;
  t->eb = 4;
  return g->nt++;
}

static int name_taken(const graph *g, const char *name) {
  for (int i = 0; i < g->nt; i++)
    if (strcmp(g->tensors[i].name, name) == 0) return 1;
  return 0;
}

/* Adds a node with output shape (ndim, dim); returns the output tensor id. */
static int add_node(graph *g, op_kind op, int a, int b, int c, int ndim, const int64_t *dim) {
  int rc = grow((void **)&g->nodes, &g->capn, g->nn, sizeof(node));
  if (rc) return rc;
  char name[GRAPH_NAME_MAX];
  snprintf(name, sizeof name, "%s_%d", ops[op].name, g->nn);
  int out = add_tensor(g, name, TK_ACT, DT_F32, ndim, dim);
  if (out < 0) return out;
  node *n = &g->nodes[g->nn++];
  n->op = op;
  n->in[0] = a;
  n->in[1] = b;
  n->in[2] = c;
  n->out = out;
  n->aux[0] = n->aux[1] = -1;
  n->iattr = 0;
  return out;
}

/* Undoes a half-built node (its output and aux tensors) after a failure. */
static int rollback(graph *g, int nt0, int nn0, int rc) {
  g->nt = nt0;
  g->nn = nn0;
  return rc;
}

/* Adds an op-private activation to the last node. */
static int add_aux(graph *g, int slot, const char *suffix, int ndim, const int64_t *dim) {
  node *n = &g->nodes[g->nn - 1];
  char name[GRAPH_NAME_MAX];
  snprintf(name, sizeof name, "%s_%d.%s", ops[n->op].name, g->nn - 1, suffix);
  int t = add_tensor(g, name, TK_ACT, DT_F32, ndim, dim);
  if (t < 0) return t;
  g->tensors[t].aux = 1;
  g->nodes[g->nn - 1].aux[slot] = t;
  return t;
}

static int64_t rows_of(const tensor *t) { /* product of all but the last dim */
  int64_t r = 1;
  for (int i = 0; i + 1 < t->ndim; i++) r *= t->dim[i];
  return r;
}

static int need_f32(const graph *g, int t, const char *what) {
  if (g->tensors[t].dtype != DT_F32) return tr_fail(TR_EINVAL, "%s: %s must be float32", what, describe(g, t));
  return TR_OK;
}

/* --- builder API --- */

int graph_input(graph *g, const char *name, int ndim, const int64_t *dim, tensor_dtype dt) {
  int rc = check_building(g);
  if (rc) return rc;
  if (name_taken(g, name)) return tr_fail(TR_EINVAL, "input: a tensor named '%s' already exists", name);
  return add_tensor(g, name, TK_INPUT, dt, ndim, dim);
}

int graph_param(graph *g, const char *name, int ndim, const int64_t *dim, param_init init, float std, int decay) {
  int rc = check_building(g);
  if (rc) return rc;
  if (name_taken(g, name)) return tr_fail(TR_EINVAL, "param: a tensor named '%s' already exists", name);
  if (ndim < 1) return tr_fail(TR_EINVAL, "param '%s': needs at least one dimension", name);
  if (init == INIT_NORMAL && !(std > 0.0f && isfinite(std)))
    return tr_fail(TR_EINVAL, "param '%s': std must be a positive number", name);
  int t = add_tensor(g, name, TK_PARAM, DT_F32, ndim, dim);
  if (t < 0) return t;
  g->tensors[t].init = init;
  g->tensors[t].std = std;
  g->tensors[t].decay = decay < 0 ? ndim >= 2 : decay != 0;
  return t;
}

int graph_embed(graph *g, int tokens, int wte, int wpe) {
  int rc;
  if ((rc = check_building(g)) || (rc = check_tensor(g, tokens, "embed")) || (rc = check_tensor(g, wte, "embed")))
    return rc;
  if (wpe >= 0 && (rc = check_tensor(g, wpe, "embed"))) return rc;
  const tensor *tk = &g->tensors[tokens], *te = &g->tensors[wte];
  if (tk->dtype != DT_I32 || tk->ndim != 2)
    return tr_fail(TR_EINVAL, "embed: tokens %s must be int32 of shape (B,T)", describe(g, tokens));
  if (te->ndim != 2 || te->kind != TK_PARAM)
    return tr_fail(TR_EINVAL, "embed: token table %s must be a (V,C) parameter", describe(g, wte));
  if (wpe >= 0) {
    const tensor *tp = &g->tensors[wpe];
    if (tp->ndim != 2 || tp->kind != TK_PARAM || tp->dim[1] != te->dim[1])
      return tr_fail(TR_EINVAL, "embed: position table %s must be a (T,%lld) parameter", describe(g, wpe),
                     (long long)te->dim[1]);
    if (tp->dim[0] < tk->dim[1])
      return tr_fail(TR_EINVAL, "embed: position table %s has fewer rows than the sequence length %lld",
                     describe(g, wpe), (long long)tk->dim[1]);
  }
  int64_t dim[3] = {tk->dim[0], tk->dim[1], te->dim[1]};
  return add_node(g, OP_EMBED, tokens, wte, wpe, 3, dim);
}

int graph_linear(graph *g, int x, int w, int bias) {
  int rc;
  if ((rc = check_building(g)) || (rc = check_tensor(g, x, "linear")) || (rc = check_tensor(g, w, "linear"))) return rc;
  if (bias >= 0 && (rc = check_tensor(g, bias, "linear"))) return rc;
  if ((rc = need_f32(g, x, "linear")) || (rc = need_f32(g, w, "linear"))) return rc;
  const tensor *tx = &g->tensors[x], *tw = &g->tensors[w];
  if (tw->ndim != 2) return tr_fail(TR_EINVAL, "linear: weight %s must be 2-D (out,in)", describe(g, w));
  if (tx->ndim < 1 || tx->dim[tx->ndim - 1] != tw->dim[1])
    return tr_fail(TR_EINVAL, "linear: input %s has %lld features but weight %s expects %lld", describe(g, x),
                   (long long)(tx->ndim ? tx->dim[tx->ndim - 1] : 0), describe(g, w), (long long)tw->dim[1]);
  if (bias >= 0) {
    const tensor *tb = &g->tensors[bias];
    if (tb->ndim != 1 || tb->dim[0] != tw->dim[0])
      return tr_fail(TR_EINVAL, "linear: bias %s must be (%lld)", describe(g, bias), (long long)tw->dim[0]);
  }
  int64_t dim[GRAPH_MAX_DIMS];
  memcpy(dim, tx->dim, sizeof dim);
  dim[tx->ndim - 1] = tw->dim[0];
  return add_node(g, OP_LINEAR, x, w, bias, tx->ndim, dim);
}

int graph_layernorm(graph *g, int x, int w, int b) {
  int rc;
  if ((rc = check_building(g)) || (rc = check_tensor(g, x, "layernorm")) || (rc = check_tensor(g, w, "layernorm")) ||
      (rc = check_tensor(g, b, "layernorm")) || (rc = need_f32(g, x, "layernorm")))
    return rc;
  const tensor *tx = &g->tensors[x];
  if (tx->ndim < 1) return tr_fail(TR_EINVAL, "layernorm: input %s has no dimensions", describe(g, x));
  int64_t C = tx->dim[tx->ndim - 1];
  for (int p = 1; p <= 2; p++) {
    int id = p == 1 ? w : b;
    const tensor *tp = &g->tensors[id];
    if (tp->ndim != 1 || tp->dim[0] != C || tp->kind != TK_PARAM)
      return tr_fail(TR_EINVAL, "layernorm: %s %s must be a (%lld) parameter", p == 1 ? "weight" : "bias",
                     describe(g, id), (long long)C);
  }
  int nt0 = g->nt, nn0 = g->nn;
  int out = add_node(g, OP_LAYERNORM, x, w, b, tx->ndim, tx->dim);
  if (out < 0) return rollback(g, nt0, nn0, out);
  int64_t n = rows_of(&g->tensors[x]);
  if ((rc = add_aux(g, 0, "mean", 1, &n)) < 0 || (rc = add_aux(g, 1, "rstd", 1, &n)) < 0)
    return rollback(g, nt0, nn0, rc);
  return out;
}

int graph_gelu(graph *g, int x) {
  int rc;
  if ((rc = check_building(g)) || (rc = check_tensor(g, x, "gelu")) || (rc = need_f32(g, x, "gelu"))) return rc;
  return add_node(g, OP_GELU, x, -1, -1, g->tensors[x].ndim, g->tensors[x].dim);
}

int graph_add(graph *g, int a, int b) {
  int rc;
  if ((rc = check_building(g)) || (rc = check_tensor(g, a, "add")) || (rc = check_tensor(g, b, "add")) ||
      (rc = need_f32(g, a, "add")) || (rc = need_f32(g, b, "add")))
    return rc;
  const tensor *ta = &g->tensors[a], *tb = &g->tensors[b];
  int same = ta->ndim == tb->ndim;
  for (int i = 0; same && i < ta->ndim; i++) same = ta->dim[i] == tb->dim[i];
  if (!same) return tr_fail(TR_EINVAL, "add: shapes differ: %s and %s", describe(g, a), describe(g, b));
  return add_node(g, OP_ADD, a, b, -1, ta->ndim, ta->dim);
}

int graph_attention(graph *g, int qkv, int n_head) {
  int rc;
  if ((rc = check_building(g)) || (rc = check_tensor(g, qkv, "attention")) || (rc = need_f32(g, qkv, "attention")))
    return rc;
  const tensor *t = &g->tensors[qkv];
  if (t->ndim != 3 || t->dim[2] % 3 != 0)
    return tr_fail(TR_EINVAL, "attention: qkv %s must be (B,T,3C)", describe(g, qkv));
  int64_t B = t->dim[0], T = t->dim[1], C = t->dim[2] / 3;
  if (n_head < 1 || C % n_head != 0)
    return tr_fail(TR_EINVAL, "attention: %lld channels do not split into %d heads", (long long)C, n_head);
  int64_t dim[3] = {B, T, C};
  int nt0 = g->nt, nn0 = g->nn;
  int out = add_node(g, OP_ATTENTION, qkv, -1, -1, 3, dim);
  if (out < 0) return rollback(g, nt0, nn0, out);
  g->nodes[g->nn - 1].iattr = n_head;
  int64_t adim[4] = {B, n_head, T, T};
  if ((rc = add_aux(g, 0, "att", 4, adim)) < 0 || (rc = add_aux(g, 1, "scratch", 4, adim)) < 0)
    return rollback(g, nt0, nn0, rc);
  return out;
}

int graph_cross_entropy(graph *g, int logits, int targets) {
  int rc;
  if ((rc = check_building(g)) || (rc = check_tensor(g, logits, "cross_entropy")) ||
      (rc = check_tensor(g, targets, "cross_entropy")) || (rc = need_f32(g, logits, "cross_entropy")))
    return rc;
  const tensor *tl = &g->tensors[logits], *tt = &g->tensors[targets];
  int ok = tt->dtype == DT_I32 && tt->ndim == tl->ndim - 1;
  for (int i = 0; ok && i < tt->ndim; i++) ok = tt->dim[i] == tl->dim[i];
  if (!ok)
    return tr_fail(TR_EINVAL, "cross_entropy: targets %s must be int32 with the leading dimensions of logits %s",
                   describe(g, targets), describe(g, logits));
  int nt0 = g->nt, nn0 = g->nn;
  int out = add_node(g, OP_XENT, logits, targets, -1, 0, NULL);
  if (out < 0) return rollback(g, nt0, nn0, out);
  if ((rc = add_aux(g, 0, "probs", tl->ndim, tl->dim)) < 0) return rollback(g, nt0, nn0, rc);
  return out;
}

int graph_output(graph *g, const char *name, int t) {
  int rc;
  if ((rc = check_building(g)) || (rc = check_tensor(g, t, "output"))) return rc;
  if (strlen(name) >= GRAPH_NAME_MAX) return tr_fail(TR_EINVAL, "output name too long: '%s'", name);
  for (int i = 0; i < g->no; i++)
    if (strcmp(g->outputs[i].name, name) == 0) return tr_fail(TR_EINVAL, "output '%s' is already set", name);
  if ((rc = grow((void **)&g->outputs, &g->capo, g->no, sizeof(output)))) return rc;
  snprintf(g->outputs[g->no].name, GRAPH_NAME_MAX, "%s", name);
  g->outputs[g->no++].t = t;
  return t;
}

/* --- inspection --- */

int graph_ntensors(const graph *g) { return g->nt; }
int graph_nnodes(const graph *g) { return g->nn; }
const char *graph_op_name(const graph *g, int n) { return n >= 0 && n < g->nn ? ops[g->nodes[n].op].name : "?"; }

int graph_tensor(const graph *g, int t, tensor_desc *out) {
  int rc = check_tensor(g, t, "graph_tensor");
  if (rc) return rc;
  const tensor *x = &g->tensors[t];
  out->name = x->name;
  out->kind = x->kind;
  out->dtype = x->eb == 2 ? DT_BF16 : x->dtype;
  out->ndim = x->ndim;
  memcpy(out->dim, x->dim, sizeof out->dim);
  out->size = x->size;
  out->offset = x->off;
  out->decay = x->decay;
  return TR_OK;
}

int graph_find(const graph *g, const char *name) {
  for (int i = 0; i < g->no; i++)
    if (strcmp(g->outputs[i].name, name) == 0) return g->outputs[i].t;
  for (int i = 0; i < g->nt; i++)
    if (strcmp(g->tensors[i].name, name) == 0) return i;
  return -1;
}

/* --- planning --- */

int graph_set_bf16(graph *g, int on) {
  if (g->planned) return tr_fail(TR_ESTATE, "graph_set_bf16: the graph is already planned");
  g->bf16 = on != 0;
  return TR_OK;
}

int graph_plan(graph *g, int with_grad) { return graph_plan_on(g, with_grad, backend_cpu()); }

/* Keeps the nodes that the outputs depend on (all nodes if none is named),
 * in creation order, in g->order; marks in need_t the tensors they read and
 * the outputs. Reverse creation order visits consumers before producers. */
static int select_nodes(graph *g, char *need_t) {
  char *keep = calloc((size_t)g->nn, 1);
  free(g->order);
  g->order = malloc(sizeof(int) * (size_t)g->nn);
  if (!keep || !g->order) {
    free(keep);
    return tr_fail(TR_ENOMEM, "out of memory planning the graph");
  }
  if (g->no == 0)
    for (int n = 0; n < g->nn; n++) need_t[g->nodes[n].out] = 1;
  for (int i = 0; i < g->no; i++) need_t[g->outputs[i].t] = 1;
  for (int n = g->nn - 1; n >= 0; n--) {
    if (!need_t[g->nodes[n].out]) continue;
    keep[n] = 1;
    for (int k = 0; k < 3; k++)
      if (g->nodes[n].in[k] >= 0) need_t[g->nodes[n].in[k]] = 1;
  }
  g->norder = 0;
  for (int n = 0; n < g->nn; n++)
    if (keep[n]) g->order[g->norder++] = n;
  free(keep);
  return TR_OK;
}

/* bf16 kernels take bf16 activations where ops.def's roles say 'a' and fp32
 * parameters where they say 'p' (token ids are int32 either way). */
static int check_bf16_inputs(const graph *g) {
  for (int n = 0; n < g->nn; n++) {
    const node *nd = &g->nodes[n];
    for (int k = 0; k < 3; k++) {
      int t = nd->in[k];
      char r = ops[nd->op].ins[k];
      if (t < 0 || r == 't' || r == '-') continue;
      const tensor *in = &g->tensors[t];
      const char *want = NULL;
      if (in->kind != (r == 'a' ? TK_ACT : TK_PARAM)) want = r == 'a' ? "an activation" : "a parameter";
      else if (r == 'a' && in->eb != 2) /* a loss: its bits are fp32, the op would read them as bf16 */
        want = "a bf16 activation, not an fp32 one (a cross_entropy loss stays fp32 under bf16)";
      if (want)
        return tr_fail(TR_EINVAL, "precision = \"bf16\": %s (node %d) takes %s as input %d, which must be %s",
                       ops[nd->op].name, n, describe(g, t), k + 1, want);
    }
  }
  return TR_OK;
}

/* Under bf16, activations are stored as bf16 but for those ops.def marks
 * 'f' (layernorm's saved statistics, the loss). On failure every tensor is
 * fp32 again, as before planning. */
static int plan_bf16(graph *g, const tr_backend *be) {
  if (!g->bf16) return TR_OK;
  if (!be->bf16) return tr_fail(TR_EINVAL, "precision = \"bf16\": the %s backend has no bf16 kernels", be->name);
  for (int i = 0; i < g->nt; i++)
    if (g->tensors[i].kind == TK_ACT) g->tensors[i].eb = 2;
  for (int n = 0; n < g->nn; n++) {
    const node *nd = &g->nodes[n];
    if (ops[nd->op].out == 'f') g->tensors[nd->out].eb = 4;
    for (int k = 0; k < 2; k++)
      if (ops[nd->op].aux[k] == 'f' && nd->aux[k] >= 0) g->tensors[nd->aux[k]].eb = 4;
  }
  int rc = check_bf16_inputs(g);
  if (rc)
    for (int i = 0; i < g->nt; i++) g->tensors[i].eb = 4;
  return rc;
}

/* Lays out every family. Parameters are laid out even when unused, so the
 * slab layout depends only on the parameter declarations; an activation no
 * kept node reads and no output names gets no storage. */
static void lay_out(graph *g, const char *need_t, int with_grad) {
  memset(&g->sz, 0, sizeof g->sz);
  for (int i = 0; i < g->nt; i++) {
    tensor *t = &g->tensors[i];
    switch (t->kind) {
      case TK_PARAM:
        t->off = g->sz.params;
        t->goff = with_grad ? t->off : -1;
        g->sz.params += align_up(t->size);
        break;
      case TK_INPUT:
        t->off = g->sz.inputs;
        g->sz.inputs += align_up(t->size);
        break;
      case TK_ACT:
        if (!need_t[i] && !t->aux) { /* dead activation: no storage */
          t->off = -1;
          break;
        }
        t->off = g->sz.acts;
        g->sz.acts += align_up(slots_of(t));
        if (with_grad && !t->aux) {
          t->goff = g->sz.act_grads;
          g->sz.act_grads += align_up(slots_of(t));
        }
        break;
    }
  }
  g->sz.grads = with_grad ? g->sz.params : 0;
}

/* One allocation per family in be's memory (inputs: host, and a device copy
 * where be's memory is not the host's). */
static int alloc_slabs(graph *g, int with_grad, const tr_backend *be) {
  g->be = be;
  g->params = be->alloc(sizeof(float) * (size_t)g->sz.params);
  g->acts = be->alloc(sizeof(float) * (size_t)g->sz.acts);
  g->inputs = tr_alloc_aligned(4 * (size_t)g->sz.inputs);
  g->dinputs = be->host_memory ? g->inputs : be->alloc(4 * (size_t)g->sz.inputs);
  if (with_grad) {
    g->grads = be->alloc(sizeof(float) * (size_t)g->sz.grads);
    g->act_grads = be->alloc(sizeof(float) * (size_t)g->sz.act_grads);
  }
  if (g->bf16) g->w16 = be->alloc(sizeof(tr_bf16) * (size_t)g->sz.params);
  if (!g->params || !g->acts || !g->inputs || !g->dinputs || (with_grad && (!g->grads || !g->act_grads)) ||
      (g->bf16 && !g->w16))
    return tr_fail(TR_ENOMEM, "out of %s memory allocating the graph's slabs (%lld parameters, %lld activations)",
                   be->name, (long long)g->sz.params, (long long)g->sz.acts);
  g->planned = 1;
  g->with_grad = with_grad;
  return TR_OK;
}

int graph_plan_on(graph *g, int with_grad, const tr_backend *be) {
  if (g->planned) return tr_fail(TR_ESTATE, "the graph is already planned");
  if (g->nn == 0) return tr_fail(TR_EINVAL, "the graph has no operations");
  char *need_t = calloc((size_t)g->nt, 1);
  int rc = need_t ? select_nodes(g, need_t) : tr_fail(TR_ENOMEM, "out of memory planning the graph");
  if (!rc) rc = plan_bf16(g, be);
  if (!rc) lay_out(g, need_t, with_grad);
  free(need_t);
  return rc ? rc : alloc_slabs(g, with_grad, be);
}

int graph_planned(const graph *g) { return g->planned; }
void graph_sizes_get(const graph *g, graph_sizes *out) { *out = g->sz; }
int64_t graph_nparams(const graph *g) { return g->sz.params; }
float *graph_params(graph *g) { return g->params; }
float *graph_grads(graph *g) { return g->grads; }
const tr_backend *graph_backend(const graph *g) { return g->be ? g->be : backend_cpu(); }

int graph_read(graph *g, int t, void *dst) {
  void *src = graph_data(g, t);
  if (!src) return tr_fail(TR_EINVAL, "graph_read: tensor %d has no storage", t);
  if (g->tensors[t].eb == 2) { /* bf16: fetch the halves, widen */
    int64_t n = g->tensors[t].size;
    tr_bf16 *h = malloc(sizeof(tr_bf16) * (size_t)n);
    if (!h) return tr_fail(TR_ENOMEM, "out of memory reading '%s'", g->tensors[t].name);
    int rc = g->be->download(h, src, sizeof(tr_bf16) * (size_t)n);
    if (!rc) tr_bf16_widen(dst, h, n);
    free(h);
    return rc ? tr_fail(rc, "reading '%s' from the %s device: %s", g->tensors[t].name, g->be->name, g->be->error())
              : TR_OK;
  }
  size_t bytes = 4 * (size_t)g->tensors[t].size;
  if (g->tensors[t].kind == TK_INPUT || g->be->host_memory) {
    memcpy(dst, src, bytes);
    return TR_OK;
  }
  int rc = g->be->download(dst, src, bytes);
  return rc ? tr_fail(rc, "reading '%s' from the %s device: %s", g->tensors[t].name, g->be->name, g->be->error()) : TR_OK;
}

void *graph_data(graph *g, int t) {
  if (!g->planned || t < 0 || t >= g->nt) return NULL;
  tensor *x = &g->tensors[t];
  switch (x->kind) {
    case TK_PARAM: return g->params + x->off;
    case TK_INPUT: return g->inputs + x->off;
    case TK_ACT: return x->off < 0 ? NULL : g->acts + x->off;
  }
  return NULL;
}

float *graph_grad(graph *g, int t) {
  if (!g->planned || !g->with_grad || t < 0 || t >= g->nt) return NULL;
  tensor *x = &g->tensors[t];
  if (x->goff < 0) return NULL;
  return x->kind == TK_PARAM ? g->grads + x->goff : g->act_grads + x->goff;
}

int graph_init_params(graph *g, uint64_t seed) {
  if (!g->planned) return tr_fail(TR_ESTATE, "graph_init_params: plan the graph first");
  float *host = g->params;
  if (!g->be->host_memory && !(host = tr_alloc_aligned(sizeof(float) * (size_t)g->sz.params)))
    return tr_fail(TR_ENOMEM, "out of memory initialising parameters");
  rng_t r;
  rng_seed(&r, seed);
  for (int i = 0; i < g->nt; i++) {
    tensor *t = &g->tensors[i];
    if (t->kind != TK_PARAM) continue;
    float *p = host + t->off;
    for (int64_t k = 0; k < t->size; k++)
      p[k] = t->init == INIT_ZEROS ? 0.0f : t->init == INIT_ONES ? 1.0f : t->std * rng_normal(&r);
  }
  int rc = TR_OK;
  if (host != g->params) {
    if (g->be->upload(g->params, host, sizeof(float) * (size_t)g->sz.params))
      rc = tr_fail(TR_EIO, "uploading parameters to the %s device: %s", g->be->name, g->be->error());
    tr_free_aligned(host);
  }
  return rc;
}

void graph_zero_grad(graph *g) {
  if (g->grads) g->be->zero(g->grads, g->sz.grads);
}

/* --- execution --- */

/* What the kernels are given is device memory: an input's device copy
 * (graph_data is its host copy, which the caller fills and forward
 * uploads), every other tensor where it was planned. */
#define F(t) ((float *)kernel_data(g, (t)))
#define I(t) ((int32_t *)kernel_data(g, (t))) /* token ids */
#define G(t) ((t) >= 0 ? graph_grad(g, (t)) : NULL)
#define H(t) ((tr_bf16 *)kernel_data(g, (t)))                    /* a bf16 activation */
#define GH(t) ((t) >= 0 ? (tr_bf16 *)graph_grad(g, (t)) : NULL) /* its bf16 gradient */
#define W16(t) (g->w16 + g->tensors[t].off)                      /* a parameter's bf16 shadow */

/* ops.def's call vocabulary: what does not depend on the precision ... */
#define PAR(t) F(t)
#define OPTPAR(t) ((t) >= 0 ? F(t) : NULL)
#define DPAR(t) G(t)
#define F32(t) F(t)
#define DF32(t) G(t)
#define TOK(t) I(t)
#define DIM(t, i) ((int)g->tensors[t].dim[i])
#define LAST(t) ((int)g->tensors[t].dim[g->tensors[t].ndim - 1])
#define ROWS(t) ((int)rows_of(&g->tensors[t]))
#define SIZE(t) (g->tensors[t].size)
/* ... and a node's operands, as locals */
#define OPERANDS(n)                                                                                 \
  int a = (n)->in[0], b = (n)->in[1], c = (n)->in[2], o = (n)->out, s0 = (n)->aux[0], s1 = (n)->aux[1], \
      attr = (n)->iattr;                                                                            \
  (void)a, (void)b, (void)c, (void)o, (void)s0, (void)s1, (void)attr

static void *kernel_data(graph *g, int t) {
  return g->tensors[t].kind == TK_INPUT ? (void *)(g->dinputs + g->tensors[t].off) : graph_data(g, t);
}

/* Token ids are checked on the host, before they reach any kernel. */
static int check_tokens(graph *g, int tok, int64_t V, const char *what) {
  const int32_t *p = graph_data(g, tok);
  int64_t n = g->tensors[tok].size;
  for (int64_t i = 0; i < n; i++)
    if (p[i] < 0 || p[i] >= V)
      return tr_fail(TR_EINVAL, "%s: '%s'[%lld] = %d is outside the vocabulary [0,%lld)", what, g->tensors[tok].name,
                     (long long)i, p[i], (long long)V);
  return TR_OK;
}

/* The vocabulary a node's token input indexes (ops.def's VOCAB). */
static int64_t vocab_of(graph *g, const node *n) {
  OPERANDS(n);
  switch (n->op) {
#define TR_OP(ID, NAME, K, HOST, INS, OUT, AUX, VOCAB, ...) \
  case OP_##ID: return VOCAB;
#include "ops.def"
  }
  return 0;
}

/* Every token input of the kept nodes, in order, before any kernel runs. */
static int check_all_tokens(graph *g) {
  for (int k = 0; k < g->norder; k++) {
    const node *n = &g->nodes[g->order[k]];
    for (int i = 0; i < 3; i++)
      if (ops[n->op].ins[i] == 't' && n->in[i] >= 0) {
        int rc = check_tokens(g, n->in[i], vocab_of(g, n), ops[n->op].name);
        if (rc) return rc;
      }
  }
  return TR_OK;
}

/* --- per-op timing (TRANSOM_PROFILE=1): totals printed at exit --- */

static double prof_s[2][TR_OP_COUNT];
static long prof_n[2][TR_OP_COUNT];
static int prof_on = -1;

static void prof_report(void) {
  double total = 0;
  for (int d = 0; d < 2; d++)
    for (int i = 0; i < TR_OP_COUNT; i++) total += prof_s[d][i];
  fprintf(stderr, "op profile (TRANSOM_PROFILE): %.1f s in ops\n", total);
  for (int d = 0; d < 2; d++)
    for (int i = 0; i < TR_OP_COUNT; i++)
      if (prof_n[d][i])
        fprintf(stderr, "  %-14s %-8s %8.3f s %5.1f%%  %8.1f us/call\n", ops[i].name, d ? "backward" : "forward",
                prof_s[d][i], 100 * prof_s[d][i] / total, 1e6 * prof_s[d][i] / prof_n[d][i]);
}

static int profiling(void) {
  if (prof_on < 0) {
    const char *e = getenv("TRANSOM_PROFILE");
    prof_on = e && *e && strcmp(e, "0") != 0;
    if (prof_on) atexit(prof_report);
  }
  return prof_on;
}

static void prof_add(const graph *g, int dir, op_kind op, double t0) {
  g->be->sync(); /* kernels are queued: time them to completion */
  prof_s[dir][op] += tr_now() - t0;
  prof_n[dir][op]++;
}

static int check_device(graph *g, const char *what) {
  int rc = g->be->sync();
  return rc ? tr_fail(rc, "%s on the %s device: %s", what, g->be->name, g->be->error()) : TR_OK;
}

/* --- dispatch: one case per op of ops.def, fp32 and bf16 --- */

/* fp32: activations are float */
#define ACT(t) F(t)
#define DACT(t) G(t)
#define MAT(t) F(t)

static void forward_f32(graph *g, const node *n) {
  const tr_backend *be = g->be;
  OPERANDS(n);
  switch (n->op) {
#define TR_OP(ID, NAME, K, HOST, INS, OUT, AUX, VOCAB, FP, FA, FC, BP, BA, BC) \
  case OP_##ID: be->K##_forward FC; break;
#include "ops.def"
  }
}

static void backward_f32(graph *g, const node *n) {
  const tr_backend *be = g->be;
  OPERANDS(n);
  switch (n->op) {
#define TR_OP(ID, NAME, K, HOST, INS, OUT, AUX, VOCAB, FP, FA, FC, BP, BA, BC) \
  case OP_##ID: be->K##_backward BC; break;
#include "ops.def"
  }
}

#undef ACT
#undef DACT
#undef MAT

/* bf16 (backend.h, tr_bf16_ops): activations are bf16, matmuls read the
 * parameters' bf16 shadow */
#define ACT(t) H(t)
#define DACT(t) GH(t)
#define MAT(t) W16(t)

static void forward_bf16(graph *g, const node *n) {
  const tr_bf16_ops *bf = g->be->bf16;
  OPERANDS(n);
  switch (n->op) {
#define TR_OP(ID, NAME, K, HOST, INS, OUT, AUX, VOCAB, FP, FA, FC, BP, BA, BC) \
  case OP_##ID: bf->K##_forward FC; break;
#include "ops.def"
  }
}

static void backward_bf16(graph *g, const node *n) {
  const tr_bf16_ops *bf = g->be->bf16;
  OPERANDS(n);
  switch (n->op) {
#define TR_OP(ID, NAME, K, HOST, INS, OUT, AUX, VOCAB, FP, FA, FC, BP, BA, BC) \
  case OP_##ID: bf->K##_backward BC; break;
#include "ops.def"
  }
}

#undef ACT
#undef DACT
#undef MAT

/* --- gradients final during backward --- */

/* grad_ready from the plan: a parameter is final after the backward of the
 * first op (in order) that reads it; a suffix of the slab is final when
 * every parameter in it is. */
static int plan_grad_ready(graph *g) {
  int N = g->norder;
  int *first = malloc(sizeof(int) * (size_t)(g->nt ? g->nt : 1));
  free(g->grad_ready);
  g->grad_ready = malloc(sizeof(int64_t) * (size_t)(N + 1));
  if (!first || !g->grad_ready) {
    free(first);
    return tr_fail(TR_ENOMEM, "out of memory planning gradient readiness");
  }
  for (int t = 0; t < g->nt; t++) first[t] = N; /* unused: final from the start */
  for (int k = N - 1; k >= 0; k--)
    for (int i = 0; i < 3; i++) {
      int t = g->nodes[g->order[k]].in[i];
      if (t >= 0) first[t] = k;
    }
  for (int k = 0; k <= N; k++) g->grad_ready[k] = g->sz.grads;
  int lo = N; /* the earliest position after which every parameter from here to the end is final */
  for (int t = g->nt - 1; t >= 0; t--) { /* descending offsets */
    if (g->tensors[t].kind != TK_PARAM) continue;
    if (first[t] < lo) lo = first[t];
    for (int k = 0; k <= lo; k++)
      if (g->tensors[t].goff < g->grad_ready[k]) g->grad_ready[k] = g->tensors[t].goff;
  }
  free(first);
  return TR_OK;
}

int graph_set_grad_hook(graph *g, graph_grad_hook fn, void *ud) {
  if (fn && (!g->planned || !g->with_grad)) return tr_fail(TR_ESTATE, "graph_set_grad_hook: not planned for training");
  if (fn && !g->grad_ready) {
    int rc = plan_grad_ready(g);
    if (rc) return rc;
  }
  g->grad_hook = fn;
  g->grad_ud = ud;
  return TR_OK;
}

/* After backward ran position k: tell the hook if more became final. */
static void grad_progress(graph *g, int k, int64_t *told) {
  if (!g->grad_hook || g->grad_ready[k] >= *told) return;
  *told = g->grad_ready[k];
  g->grad_hook(g->grad_ud, *told);
}

/* --- forward, backward --- */

int graph_forward(graph *g) {
  if (!g->planned) return tr_fail(TR_ESTATE, "graph_forward: plan the graph first");
  return graph_forward_range(g, 0, g->norder);
}

int graph_forward_range(graph *g, int lo, int hi) {
  if (!g->planned) return tr_fail(TR_ESTATE, "graph_forward: plan the graph first");
  if (lo < 0 || hi > g->norder || lo > hi)
    return tr_fail(TR_EINVAL, "graph_forward_range: [%d,%d) is outside [0,%d)", lo, hi, g->norder);
  const tr_backend *be = g->be;
  int rc = check_all_tokens(g);
  if (rc) return rc;
  if (!be->host_memory && g->sz.inputs && be->upload(g->dinputs, g->inputs, 4 * (size_t)g->sz.inputs))
    return tr_fail(TR_EIO, "uploading the inputs to the %s device: %s", be->name, be->error());
  if (g->bf16) be->bf16->to_bf16(g->w16, g->params, g->sz.params); /* the matmuls' view of the master weights */
  int prof = profiling();
  for (int k = lo; k < hi; k++) {
    double t0 = prof ? tr_now() : 0;
    const node *n = &g->nodes[g->order[k]];
    if (g->bf16) forward_bf16(g, n);
    else forward_f32(g, n);
    if (prof) prof_add(g, 0, n->op, t0);
  }
  return be->host_memory ? TR_OK : check_device(g, "forward");
}

int graph_backward(graph *g, int loss) {
  if (!g->planned || !g->with_grad) return tr_fail(TR_ESTATE, "graph_backward: graph not planned for training");
  if (loss < 0 || loss >= g->nt || g->tensors[loss].size != 1 || g->tensors[loss].goff < 0)
    return tr_fail(TR_EINVAL, "graph_backward: loss must be a scalar activation");
  const tr_backend *be = g->be;
  be->zero(g->act_grads, g->sz.act_grads);
  const float one = 1.0f;
  const tr_bf16 one16 = 0x3f80; /* a loss stored as bf16 (an op other than cross_entropy made it) */
  int rc = g->tensors[loss].eb == 2 ? be->upload(G(loss), &one16, sizeof one16) : be->upload(G(loss), &one, sizeof one);
  if (rc) return tr_fail(TR_EIO, "backward on the %s device: %s", be->name, be->error());
  return graph_backward_range(g, 0, g->norder);
}

int graph_backward_range(graph *g, int lo, int hi) {
  if (!g->planned || !g->with_grad) return tr_fail(TR_ESTATE, "graph_backward: graph not planned for training");
  if (lo < 0 || hi > g->norder || lo > hi)
    return tr_fail(TR_EINVAL, "graph_backward_range: [%d,%d) is outside [0,%d)", lo, hi, g->norder);
  int prof = profiling();
  /* the gradient hook reports progress of a whole backward only (a range is
   * a pipeline stage's share, which sets no hook) */
  int64_t told = g->sz.grads;
  int full = lo == 0 && hi == g->norder;
  if (full) grad_progress(g, g->norder, &told);
  for (int k = hi - 1; k >= lo; k--) {
    double t0 = prof ? tr_now() : 0;
    const node *n = &g->nodes[g->order[k]];
    if (g->bf16) backward_bf16(g, n);
    else backward_f32(g, n);
    if (prof) prof_add(g, 1, n->op, t0);
    if (full) grad_progress(g, k, &told);
  }
  return g->be->host_memory ? TR_OK : check_device(g, "backward");
}

void graph_zero_act_grads(graph *g) {
  if (g->act_grads) g->be->zero(g->act_grads, g->sz.act_grads);
}

int graph_norder(const graph *g) { return g->planned ? g->norder : 0; }

int graph_order_node(const graph *g, int k, graph_node_desc *out) {
  if (!g->planned || k < 0 || k >= g->norder) return tr_fail(TR_EINVAL, "graph_order_node: no node at %d", k);
  const node *n = &g->nodes[g->order[k]];
  out->node = g->order[k];
  out->op = (int)n->op;
  out->name = ops[n->op].name;
  for (int i = 0; i < 3; i++) out->in[i] = n->in[i];
  out->out = n->out;
  out->aux[0] = n->aux[0];
  out->aux[1] = n->aux[1];
  out->attr = n->iattr;
  return TR_OK;
}
