/* graph_stage.c — the workload estimator and the cut search over a planned
 * graph (see graph_stage.h). It reads the graph through graph.h's public
 * inspection calls only; it runs nothing and allocates only scratch.
 */
#include "graph_stage.h"

#include <stdlib.h>
#include <string.h>

#include "util.h"

/* --- costs --- */

static int64_t rows_of(const tensor_desc *d) {
  int64_t r = 1;
  for (int i = 0; i + 1 < d->ndim; i++) r *= d->dim[i];
  return r;
}

/* Forward FLOPs of one node: matmuls 2 per multiply-add, the rest a few per
 * element (the constants are rough: what matters is the ratio to the
 * matmuls, which dominate). */
static double forward_flops(const graph *g, const graph_node_desc *n) {
  tensor_desc a, o;
  graph_tensor(g, n->in[0] >= 0 ? n->in[0] : n->out, &a);
  graph_tensor(g, n->out, &o);
  const char *op = n->name;
  if (strcmp(op, "linear") == 0) {
    tensor_desc w;
    graph_tensor(g, n->in[1], &w);
    return 2.0 * (double)rows_of(&a) * (double)w.dim[0] * (double)w.dim[1];
  }
  if (strcmp(op, "attention") == 0) { /* QK^T and AV: 2 * 2 * B*T*T*C, softmax ~5 per score */
    double B = (double)a.dim[0], T = (double)a.dim[1], C = (double)a.dim[2] / 3.0, NH = n->attr;
    return 4.0 * B * T * T * C + 5.0 * B * NH * T * T;
  }
  if (strcmp(op, "layernorm") == 0) return 8.0 * (double)o.size;
  if (strcmp(op, "gelu") == 0) return 10.0 * (double)o.size;
  if (strcmp(op, "cross_entropy") == 0) return 5.0 * (double)a.size;
  return (double)o.size; /* embed, add */
}

int graph_stage_costs(const graph *g, graph_op_cost *out) {
  int n = graph_norder(g);
  if (n == 0) return tr_fail(TR_ESTATE, "graph_stage_costs: plan the graph first");
  for (int k = 0; k < n; k++) {
    graph_node_desc nd;
    int rc = graph_order_node(g, k, &nd);
    if (rc) return rc;
    tensor_desc d;
    graph_tensor(g, nd.out, &d);
    out[k].flops = 3.0 * forward_flops(g, &nd);
    out[k].out_bytes = 4.0 * (double)d.size;
    out[k].param_bytes = 0;
    for (int i = 0; i < 3; i++) {
      if (nd.in[i] < 0) continue;
      graph_tensor(g, nd.in[i], &d);
      if (d.kind == TK_PARAM) out[k].param_bytes += 4.0 * (double)d.size;
    }
  }
  return TR_OK;
}

/* --- crossings --- */

/* For every activation: the order position that makes it (-1: none) and
 * the last that reads it (-1: none). */
static int spans(const graph *g, int **made, int **last) {
  int nt = graph_ntensors(g), n = graph_norder(g);
  *made = malloc(sizeof(int) * (size_t)nt);
  *last = malloc(sizeof(int) * (size_t)nt);
  if (!*made || !*last) {
    free(*made);
    free(*last);
    return tr_fail(TR_ENOMEM, "out of memory cutting the graph");
  }
  for (int t = 0; t < nt; t++) (*made)[t] = (*last)[t] = -1;
  for (int k = 0; k < n; k++) {
    graph_node_desc nd;
    graph_order_node(g, k, &nd);
    (*made)[nd.out] = k;
    for (int i = 0; i < 3; i++)
      if (nd.in[i] >= 0) (*last)[nd.in[i]] = k;
  }
  return TR_OK;
}

static int64_t bytes_of(const graph *g, int t) {
  tensor_desc d;
  graph_tensor(g, t, &d);
  return 4 * d.size;
}

int graph_stage_crossing(const graph *g, int k, int *ids, int cap, int64_t *bytes) {
  if (k <= 0 || k >= graph_norder(g)) return tr_fail(TR_EINVAL, "graph_stage_crossing: no cut at %d", k);
  int *made, *last, rc = spans(g, &made, &last), cnt = 0;
  if (rc) return rc;
  int64_t b = 0;
  for (int t = 0; t < graph_ntensors(g); t++)
    if (made[t] >= 0 && made[t] < k && last[t] >= k) {
      if (cnt < cap) ids[cnt] = t;
      cnt++;
      b += bytes_of(g, t);
    }
  free(made);
  free(last);
  if (bytes) *bytes = b;
  return cnt;
}

int graph_stage_tensors(const graph *g, int lo, int hi, int *ids, int cap) {
  if (lo < 0 || hi > graph_norder(g) || lo >= hi) return tr_fail(TR_EINVAL, "graph_stage_tensors: bad range");
  int *made, *last, rc = spans(g, &made, &last), cnt = 0;
  if (rc) return rc;
  char *mine = calloc((size_t)graph_ntensors(g), 1);
  if (!mine) rc = tr_fail(TR_ENOMEM, "out of memory cutting the graph");
  for (int k = lo; k < hi && !rc; k++) {
    graph_node_desc nd;
    graph_order_node(g, k, &nd);
    mine[nd.out] = 1;
    for (int i = 0; i < 2; i++)
      if (nd.aux[i] >= 0) mine[nd.aux[i]] = 1;
  }
  for (int t = 0; t < graph_ntensors(g) && !rc; t++) {
    int from_before = made[t] >= 0 && made[t] < lo && last[t] >= lo; /* read here or relayed on */
    if (mine[t] || from_before) {
      if (cnt < cap) ids[cnt] = t;
      cnt++;
    }
  }
  free(mine);
  free(made);
  free(last);
  return rc ? rc : cnt;
}

/* --- the cut search --- */

/* Bytes crossing every cut 1..n-1 at once: x[k] (x[0] = x[n] = 0). */
static int cut_bytes(const graph *g, double *x) {
  int n = graph_norder(g), *made, *last, rc = spans(g, &made, &last);
  if (rc) return rc;
  double *d = calloc((size_t)n + 2, sizeof(double));
  if (!d) rc = tr_fail(TR_ENOMEM, "out of memory cutting the graph");
  for (int t = 0; t < graph_ntensors(g) && !rc; t++)
    if (made[t] >= 0 && last[t] > made[t]) { /* crosses cuts made+1 .. last */
      d[made[t] + 1] += (double)bytes_of(g, t);
      d[last[t] + 1] -= (double)bytes_of(g, t);
    }
  double run = 0;
  for (int k = 0; k <= n && !rc; k++) x[k] = (run += d[k]);
  if (!rc) x[0] = x[n] = 0;
  free(d);
  free(made);
  free(last);
  return rc;
}

typedef struct {
  int n, S;
  const double *F, *X, *speed, *bw; /* prefix FLOPs, cut bytes */
  double *best, *comp, *tot;        /* (S+1) x (n+1): bottleneck, slowest stage's compute, bytes crossing */
  int *from;
} cut_dp;

#define AT(D, s, k) ((s) * ((D)->n + 1) + (k))

/* Fills row s (stages 0..s-1 covering [0,k), stage s-1 ending at k). */
static void dp_row(cut_dp *D, int s) {
  double sp = D->speed ? D->speed[s - 1] : 1.0;
  for (int k = s; k <= D->n; k++) {
    double bestv = -1, bestc = 0, bestt = 0;
    int bj = -1;
    for (int j = s - 1; j < k; j++) {
      if (D->best[AT(D, s - 1, j)] < 0) continue;
      double v = D->best[AT(D, s - 1, j)], c = (D->F[k] - D->F[j]) / sp, t = D->tot[AT(D, s - 1, j)];
      double cm = D->comp[AT(D, s - 1, j)] > c ? D->comp[AT(D, s - 1, j)] : c;
      if (c > v) v = c;
      if (s > 1) {
        double bw = D->bw ? D->bw[s - 2] : 0, l = bw > 0 ? 2.0 * D->X[j] / bw : 0;
        if (l > v) v = l;
        t += D->X[j];
      }
      int same_v = v <= bestv * (1 + 1e-9), same_c = cm <= bestc * (1 + 1e-9) && cm >= bestc * (1 - 1e-9);
      if (bj < 0 || v < bestv * (1 - 1e-9) || (same_v && cm < bestc * (1 - 1e-9)) || (same_v && same_c && t < bestt)) {
        bestv = v;
        bestc = cm;
        bestt = t;
        bj = j;
      }
    }
    D->best[AT(D, s, k)] = bj < 0 ? -1 : bestv;
    D->comp[AT(D, s, k)] = bestc;
    D->tot[AT(D, s, k)] = bestt;
    D->from[AT(D, s, k)] = bj;
  }
}

int graph_stage_cut(const graph *g, int S, const double *speed, const double *bw, int *cuts, double *cost) {
  int n = graph_norder(g), rc = TR_OK;
  if (S < 1 || S > n) return tr_fail(TR_EINVAL, "%d stages for a graph of %d ops (1..%d)", S, n, n);
  size_t cells = (size_t)(S + 1) * (size_t)(n + 1);
  graph_op_cost *c = malloc(sizeof *c * (size_t)n);
  double *F = malloc(sizeof(double) * (size_t)(n + 1)), *X = malloc(sizeof(double) * (size_t)(n + 1));
  cut_dp D = {n, S, F, X, speed, bw, malloc(sizeof(double) * cells), malloc(sizeof(double) * cells),
              malloc(sizeof(double) * cells), malloc(sizeof(int) * cells)};
  if (!c || !F || !X || !D.best || !D.comp || !D.tot || !D.from)
    rc = tr_fail(TR_ENOMEM, "out of memory cutting the graph");
  if (!rc) rc = graph_stage_costs(g, c);
  if (!rc) rc = cut_bytes(g, X);
  if (!rc) {
    F[0] = 0;
    for (int k = 0; k < n; k++) F[k + 1] = F[k] + c[k].flops;
    for (size_t i = 0; i < cells; i++) D.best[i] = -1;
    D.best[AT(&D, 0, 0)] = 0;
    D.comp[AT(&D, 0, 0)] = 0;
    D.tot[AT(&D, 0, 0)] = 0;
    for (int s = 1; s <= S; s++) dp_row(&D, s);
    cuts[S] = n;
    for (int s = S; s > 0; s--) cuts[s - 1] = D.from[AT(&D, s, cuts[s])];
    if (cost) *cost = D.best[AT(&D, S, n)];
  }
  free(c);
  free(F);
  free(X);
  free(D.best);
  free(D.comp);
  free(D.tot);
  free(D.from);
  return rc;
}
