/* graph.h — the operator DAG (the model) and its executor.
 *
 * A graph is built once (usually from Lua, see lua_graph.c), then planned:
 * planning fixes a topological order and allocates one slab per tensor family
 * (parameters, parameter gradients, activations, activation gradients, int
 * inputs), with named views into them. After that, forward/backward run C
 * kernels in that order; nothing is allocated per step.
 *
 * Tensors are named by small integer ids returned by the builder calls.
 * Builder calls check shapes and return a negative TR_E* code with tr_error()
 * set on misuse; the graph is left unchanged. A graph is used by one thread
 * at a time.
 */
#ifndef TRANSOM_GRAPH_H
#define TRANSOM_GRAPH_H

#include <stddef.h>
#include <stdint.h>

#define GRAPH_MAX_DIMS 4
#define GRAPH_NAME_MAX 64

typedef struct graph graph;

typedef enum { TK_INPUT, TK_PARAM, TK_ACT } tensor_kind;
typedef enum { DT_F32, DT_I32, DT_BF16 } tensor_dtype; /* DT_BF16: only activations, see graph_set_bf16 */
typedef enum { INIT_ZEROS, INIT_ONES, INIT_NORMAL } param_init;

/* A read-only description of a tensor (graph_tensor). */
typedef struct {
  const char *name;
  tensor_kind kind;
  tensor_dtype dtype;
  int ndim;
  int64_t dim[GRAPH_MAX_DIMS];
  int64_t size;   /* elements */
  int64_t offset; /* elements into its slab (params: the parameter slab) */
  int decay;      /* params: weight decay applies */
} tensor_desc;

graph *graph_create(void);
void graph_free(graph *g);

/* --- building (returns a tensor id >= 0, or a negative error) --- */
int graph_input(graph *g, const char *name, int ndim, const int64_t *dim, tensor_dtype dt);
/* std is used by INIT_NORMAL. decay < 0 means "default": decay iff ndim >= 2. */
int graph_param(graph *g, const char *name, int ndim, const int64_t *dim, param_init init, float std, int decay);
int graph_embed(graph *g, int tokens, int wte, int wpe /* or -1 */);
int graph_linear(graph *g, int x, int w, int bias /* or -1 */);
int graph_layernorm(graph *g, int x, int w, int b);
int graph_gelu(graph *g, int x);
int graph_add(graph *g, int a, int b);
int graph_attention(graph *g, int qkv, int n_head);
int graph_cross_entropy(graph *g, int logits, int targets); /* a scalar: mean loss */
/* Names a tensor as an output (e.g. "loss", "logits"); outputs are what the
 * planner keeps alive. */
int graph_output(graph *g, const char *name, int t);

/* --- inspection --- */
int graph_ntensors(const graph *g);
int graph_nnodes(const graph *g);
int graph_tensor(const graph *g, int t, tensor_desc *out);
int graph_find(const graph *g, const char *name); /* tensors and outputs; -1 if absent */
const char *graph_op_name(const graph *g, int node);

/* --- planning and memory --- */
/* with_grad = 0 plans an inference-only graph (no gradient slabs). */
int graph_plan(graph *g, int with_grad); /* on the host CPU backend */
/* Plans with every slab in be's memory, run by be's kernels (backend.h).
 * Inputs stay in host memory (graph_data gives the host copy; forward
 * uploads them); parameters, gradients and activations are device memory:
 * graph_params/graph_grads/graph_data/graph_grad return device pointers
 * (host pointers on a host backend). */
struct tr_backend;
int graph_plan_on(graph *g, int with_grad, const struct tr_backend *be);
const struct tr_backend *graph_backend(const graph *g);
/* Before planning: store activations and their gradients as bf16 (the
 * backend's tr_bf16_ops run the graph), except layernorm's saved mean/rstd
 * and the loss; parameters and their gradients stay fp32 (master weights)
 * and forward gives the matmuls a bf16 copy of them. Every op must take
 * bf16 activations where activations flow (so a cross_entropy loss, fp32,
 * feeds no other op) and parameters as weights (checked at planning).
 * graph_read widens a bf16 tensor to fp32. */
int graph_set_bf16(graph *g, int on);
/* Copies tensor t (all of it, 4 bytes an element) to host memory dst. */
int graph_read(graph *g, int t, void *dst);
int graph_planned(const graph *g);
typedef struct {
  int64_t params, grads, acts, act_grads, inputs; /* elements per family */
} graph_sizes;
void graph_sizes_get(const graph *g, graph_sizes *out);

int64_t graph_nparams(const graph *g);
float *graph_params(graph *g);
float *graph_grads(graph *g); /* NULL for an inference graph */
/* Pointer to a tensor's storage after planning (f32 or i32 by dtype). */
void *graph_data(graph *g, int t);
/* Gradient of an activation or parameter, NULL if none. */
float *graph_grad(graph *g, int t);

/* Fills parameters from their init specs with a seeded generator; parameters
 * are visited in creation order, so the same graph and seed give the same
 * bits. */
int graph_init_params(graph *g, uint64_t seed);

/* --- execution --- */
int graph_forward(graph *g);
/* Backward from the scalar tensor `loss`: d(loss)=1. Parameter gradients are
 * accumulated (+=); call graph_zero_grad between steps. */
int graph_backward(graph *g, int loss);
void graph_zero_grad(graph *g);

/* --- stages: a contiguous range of the planned order (a pipeline stage,
 * core/fleet/pipeline*.c; graph_stage.h cuts the order) --- */
/* The planned order's length (0 before planning). */
int graph_norder(const graph *g);
/* What the k-th node of the planned order reads and writes. */
typedef struct {
  int node;        /* node id */
  int op;          /* ops.def's index */
  const char *name; /* the op's name ("linear") */
  int in[3], out, aux[2]; /* tensor ids, -1 when unused */
  int attr;
} graph_node_desc;
int graph_order_node(const graph *g, int k, graph_node_desc *out);
/* Forward over order positions [lo,hi) (inputs uploaded, bf16 shadow made,
 * as graph_forward). The activations a range reads from before lo must be in
 * place (graph_data). */
int graph_forward_range(graph *g, int lo, int hi);
/* Backward over [lo,hi), last node first, accumulating (+=) into whatever
 * the activation gradients hold: no zeroing, no seeding of a loss (the
 * caller zeroes with graph_zero_act_grads and writes the gradients that come
 * from after hi). graph_backward = zero + seed d(loss) = 1 + the whole range. */
int graph_backward_range(graph *g, int lo, int hi);
void graph_zero_act_grads(graph *g);

/* Called by graph_backward, on its thread, each time more of the gradient
 * slab is final: grads[from..nparams) will not be written again in this
 * backward (a parameter's gradient is final once every op that reads it
 * ran its backward; parameters are laid out in declaration order, so a
 * model declared input to output finishes from the end). from only
 * decreases within one backward; it reaches 0 only after the last op.
 * On a device backend kernels are asynchronous: "final" means every
 * kernel that writes them has been queued on the compute stream (a
 * consumer on another stream orders itself after a mark of it:
 * backend.h's comm_mark). fn NULL removes it. 0, or TR_ESTATE (not
 * planned for training), TR_ENOMEM. */
typedef void (*graph_grad_hook)(void *ud, int64_t from);
int graph_set_grad_hook(graph *g, graph_grad_hook fn, void *ud);

#endif
