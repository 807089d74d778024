/* pipeline_plan.c — OP-Fence: where a pipeline's stages go (see
 * pipeline_plan.h and the README's "Pipeline stages").
 *
 * Objective: the time of a 1F1B step, which in steady state is set by the
 * slowest stage or link per micro-batch (the bottleneck):
 *
 *   step ~ sum_k stage_k + sum_k link_k + (M - 1) * max(max_k stage_k, max_k link_k)
 *   stage_k = FLOPs(ops of stage k) / FLOP/s(worker of stage k)
 *   link_k  = compress * 2 * bytes crossing cut k / bandwidth(worker k, worker k+1) + 2 * latency
 *
 * Algorithm: (1) cluster the workers by bandwidth: sort the pairwise
 * bandwidths, split at the largest gap (a factor of 4 at least; else one
 * cluster) and join the pairs above it (single linkage); (2) order the
 * workers so that each cluster is contiguous in the chain (only C - 1 links
 * of the chain cross a slow gap, the heavy traffic stays inside clusters),
 * fastest workers first inside a cluster, trying every order of the
 * clusters (at most 5! orders); (3) for each order, cut the op order by
 * graph_stage_cut's exact DP for that order's speeds and links; keep the
 * order whose bottleneck is least. "even" is the baseline: workers in
 * job order, cuts for equal FLOPs, links ignored. A Lua policy file gets
 * the measurements and OP-Fence's proposal and returns its own plan.
 */
#include "pipeline_plan.h"

#include <errno.h>
#include <lauxlib.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "graph_stage.h"
#include "lua_host.h"
#include "util.h"

/* --- the workers --- */

void pipe_link_emulation(const job_config *cfg, const char *za, const char *zb, double *rate, double *delay) {
  int same = strcmp(za, zb) == 0;
  double mbit = same ? cfg->pipe_lan_mbit : cfg->pipe_wan_mbit;
  *rate = mbit > 0 ? mbit * 1e6 / 8.0 : 0;
  *delay = same ? 0 : cfg->pipe_wan_ms / 1e3;
}

static void read_worker(lua_State *L, int i, pipe_plan *p) { /* [workers] */
  lua_rawgeti(L, -1, i + 1);                                   /* [workers, w] */
  if (lua_istable(L, -1)) {
    lua_getfield(L, -1, "speed");
    if (lua_isnumber(L, -1)) p->speed[i] = lua_tonumber(L, -1);
    lua_getfield(L, -2, "zone");
    if (lua_isstring(L, -1)) snprintf(p->zone[i], PIPE_ZONE_MAX, "%s", lua_tostring(L, -1));
    lua_getfield(L, -3, "netns");
    if (lua_isstring(L, -1)) snprintf(p->netns[i], PIPE_ZONE_MAX, "%s", lua_tostring(L, -1));
    lua_getfield(L, -4, "address");
    if (lua_isstring(L, -1) && lua_tostring(L, -1)[0]) snprintf(p->addr[i], PIPE_ADDR_MAX, "%s", lua_tostring(L, -1));
    lua_pop(L, 4);
  }
  lua_pop(L, 1);
}

int pipe_plan_from_job(lua_State *L, const job_config *cfg, pipe_plan *p) {
  memset(p, 0, sizeof *p);
  p->S = (int)cfg->pipe_stages;
  p->M = (int)cfg->pipe_micro_batches;
  if (p->S < 1 || p->S > PIPE_MAX_STAGES) return tr_fail(TR_EINVAL, "pipeline.stages = %d (1..%d)", p->S, PIPE_MAX_STAGES);
  for (int i = 0; i < p->S; i++) {
    p->speed[i] = 1.0;
    snprintf(p->zone[i], PIPE_ZONE_MAX, "local");
    snprintf(p->addr[i], PIPE_ADDR_MAX, "127.0.0.1");
  }
  int top = lua_gettop(L);
  lua_rawgeti(L, LUA_REGISTRYINDEX, cfg->lua_ref); /* [cfg] */
  lua_getfield(L, -1, "pipeline");                 /* [cfg, pipeline] */
  if (lua_istable(L, -1)) {
    lua_getfield(L, -1, "workers"); /* [cfg, pipeline, workers] */
    if (lua_istable(L, -1))
      for (int i = 0; i < p->S && i < (int)luaL_len(L, -1); i++) read_worker(L, i, p);
  }
  lua_settop(L, top);
  for (int i = 0; i < p->S; i++) {
    p->flops_s[i] = 1e9 * p->speed[i]; /* a guess until a probe measures it */
    for (int j = 0; j < p->S; j++) pipe_link_emulation(cfg, p->zone[i], p->zone[j], &p->bw[i][j], &p->lat[i][j]);
  }
  return TR_OK;
}

/* --- OP-Fence --- */

static double bw_or_inf(double b) { return b > 0 ? b : 1e15; }

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static int find(int *up, int i) { return up[i] == i ? i : (up[i] = find(up, up[i])); }

/* Clusters: split the sorted bandwidths at their largest gap (ratio >= 4). */
static void cluster(pipe_plan *p) {
  int S = p->S, n = 0, up[PIPE_MAX_STAGES];
  double v[PIPE_MAX_STAGES * PIPE_MAX_STAGES], tau = 0, gap = 4.0;
  for (int i = 0; i < S; i++)
    for (int j = i + 1; j < S; j++) v[n++] = bw_or_inf(p->bw[i][j]);
  qsort(v, (size_t)n, sizeof v[0], cmp_double);
  for (int i = 0; i + 1 < n; i++)
    if (v[i + 1] / v[i] >= gap) {
      gap = v[i + 1] / v[i];
      tau = sqrt(v[i] * v[i + 1]);
    }
  for (int i = 0; i < S; i++) up[i] = i;
  for (int i = 0; i < S; i++)
    for (int j = i + 1; j < S; j++)
      if (bw_or_inf(p->bw[i][j]) >= tau) up[find(up, i)] = find(up, j);
  p->ncluster = 0;
  int id[PIPE_MAX_STAGES];
  for (int i = 0; i < S; i++) id[i] = -1;
  for (int i = 0; i < S; i++) {
    int r = find(up, i);
    if (id[r] < 0) id[r] = p->ncluster++;
    p->cluster[i] = id[r];
  }
}

int pipe_plan_predict(const graph *g, pipe_plan *p) {
  int n = graph_norder(g);
  graph_op_cost *c = malloc(sizeof *c * (size_t)n);
  if (!c) return tr_fail(TR_ENOMEM, "out of memory planning");
  int rc = graph_stage_costs(g, c);
  p->bottleneck_s = p->step_s = 0;
  for (int k = 0; k < p->S && !rc; k++) {
    double f = 0;
    for (int i = p->cuts[k]; i < p->cuts[k + 1]; i++) f += c[i].flops;
    p->stage_s[k] = f / p->flops_s[p->order[k]];
    p->step_s += p->stage_s[k];
    if (p->stage_s[k] > p->bottleneck_s) p->bottleneck_s = p->stage_s[k];
    if (k + 1 == p->S) break;
    int64_t x = 0;
    rc = graph_stage_crossing(g, p->cuts[k + 1], NULL, 0, &x) < 0;
    int a = p->order[k], b = p->order[k + 1];
    p->link_bytes[k] = 2.0 * (double)x;
    p->link_s[k] = (p->bw[a][b] > 0 ? p->compress * p->link_bytes[k] / p->bw[a][b] : 0) + 2 * p->lat[a][b];
    p->step_s += p->link_s[k];
    if (p->link_s[k] > p->bottleneck_s) p->bottleneck_s = p->link_s[k];
  }
  p->step_s += (p->M - 1) * p->bottleneck_s;
  free(c);
  return rc ? tr_fail_prefix(TR_EINVAL, "planning") : TR_OK;
}

void pipe_plan_adatopk_seed(const pipe_plan *p, int k, double *hide_s, double *bw_prev, double *bw_next) {
  *hide_s = *bw_prev = *bw_next = 0;
  if (!p->measured) return;
  for (int j = 0; j < p->S; j++)
    if (p->stage_s[j] > *hide_s && isfinite(p->stage_s[j])) *hide_s = p->stage_s[j];
  if (k > 0) *bw_prev = p->bw[p->order[k - 1]][p->order[k]];
  if (k + 1 < p->S) *bw_next = p->bw[p->order[k]][p->order[k + 1]];
}

/* Cuts for p->order by the DP, with the order's speeds and links. */
static int cut_for_order(const graph *g, pipe_plan *p, double *cost) {
  double speed[PIPE_MAX_STAGES], bw[PIPE_MAX_STAGES];
  for (int k = 0; k < p->S; k++) {
    speed[k] = p->flops_s[p->order[k]];
    if (k + 1 < p->S) {
      double b = p->bw[p->order[k]][p->order[k + 1]];
      bw[k] = b > 0 ? b / p->compress : 0;
    }
  }
  return graph_stage_cut(g, p->S, speed, bw, p->cuts, cost);
}

/* The fastest worker of cluster c not among order[0..m); -1: none. */
static int fastest_unused(const pipe_plan *p, int m, int c) {
  int w = -1;
  for (int j = 0; j < p->S; j++) {
    int used = 0;
    for (int u = 0; u < m; u++) used |= p->order[u] == j;
    if (!used && p->cluster[j] == c && (w < 0 || p->flops_s[j] > p->flops_s[w])) w = j;
  }
  return w;
}

/* Tries every order of the clusters (each contiguous, fastest first
 * inside); keeps the best. */
static int opfence(const graph *g, pipe_plan *p) {
  cluster(p);
  int C = p->ncluster, perm[PIPE_MAX_STAGES], best_order[PIPE_MAX_STAGES], best_cuts[PIPE_MAX_STAGES + 1];
  double best = -1;
  for (int i = 0; i < C; i++) perm[i] = i;
  long tries = 1;
  for (int i = 2; i <= C && C <= 5; i++) tries *= i;
  for (long t = 0; t < tries; t++) {
    int m = 0, rc, w;
    for (int ci = 0; ci < C; ci++) /* cluster perm[ci]'s workers, fastest first */
      while ((w = fastest_unused(p, m, perm[ci])) >= 0) p->order[m++] = w;
    double cost;
    if ((rc = cut_for_order(g, p, &cost))) return rc;
    if (best < 0 || cost < best * (1 - 1e-9)) {
      best = cost;
      memcpy(best_order, p->order, sizeof best_order);
      memcpy(best_cuts, p->cuts, sizeof best_cuts);
    }
    /* next permutation of perm[0..C) */
    int i = C - 2;
    while (i >= 0 && perm[i] > perm[i + 1]) i--;
    if (i < 0) break;
    int j = C - 1;
    while (perm[j] < perm[i]) j--;
    int tmp = perm[i];
    perm[i] = perm[j];
    perm[j] = tmp;
    for (int a = i + 1, b = C - 1; a < b; a++, b--) tmp = perm[a], perm[a] = perm[b], perm[b] = tmp;
  }
  memcpy(p->order, best_order, sizeof best_order);
  memcpy(p->cuts, best_cuts, sizeof best_cuts);
  return TR_OK;
}

static int even(const graph *g, pipe_plan *p) {
  for (int k = 0; k < p->S; k++) p->order[k] = k;
  p->ncluster = 1;
  return graph_stage_cut(g, p->S, NULL, NULL, p->cuts, NULL);
}

int pipe_plan_make(lua_State *L, const graph *g, const job_config *cfg, pipe_plan *p) {
  /* the fewest bytes AdaTopK may send, against float32: top-k at the floor
   * (6 bytes an entry) or dense bf16 (2), whichever it would choose */
  double a = 1.5 * cfg->pipe_act_min_density, d = 1.5 * cfg->pipe_min_density;
  a = a >= 0.5 ? 0.5 : a;
  d = d >= 0.5 ? 0.5 : d;
  p->compress = strcmp(cfg->pipe_compression, "adatopk") == 0 ? (a + d) / 2 : 1.0;
  snprintf(p->how, sizeof p->how, "%s", cfg->pipe_placement);
  int rc = strcmp(cfg->pipe_placement, "even") == 0 ? even(g, p) : opfence(g, p);
  if (!rc && strcmp(cfg->pipe_placement, "even") != 0 && strcmp(cfg->pipe_placement, "opfence") != 0)
    rc = pipe_policy_plan(L, g, cfg->pipe_placement, p);
  return rc ? rc : pipe_plan_predict(g, p);
}

/* --- printing and the PLAN line --- */

void pipe_plan_print(FILE *f, const graph *g, const pipe_plan *p) {
  fprintf(f, "plan: %s | %d stages x %d micro-batches | %d bandwidth cluster(s) | %s | predicted step %.1f ms "
             "(bottleneck %.2f ms per micro-batch)\n",
          p->how, p->S, p->M, p->ncluster, p->measured ? "measured by probes" : "the job's numbers", p->step_s * 1e3,
          p->bottleneck_s * 1e3);
  fprintf(f, "%5s %6s %-8s %7s %10s  %-36s %10s %12s\n", "stage", "worker", "zone", "cluster", "GFLOP/s", "ops",
          "ms/mb", "ms/step");
  for (int k = 0; k < p->S; k++) {
    int w = p->order[k];
    graph_node_desc a, b;
    graph_order_node(g, p->cuts[k], &a);
    graph_order_node(g, p->cuts[k + 1] - 1, &b);
    char ops[64];
    snprintf(ops, sizeof ops, "%d..%d (%s..%s)", p->cuts[k], p->cuts[k + 1] - 1, a.name, b.name);
    fprintf(f, "%5d %6d %-8s %7d %10.2f  %-36s %10.2f %12.2f\n", k, w, p->zone[w], p->cluster[w], p->flops_s[w] / 1e9,
            ops, p->stage_s[k] * 1e3, p->stage_s[k] * p->M * 1e3);
  }
  fprintf(f, "%5s %12s %10s %14s %16s %12s\n", "link", "Mbit/s", "ms", "MB/step raw", "MB/step planned", "ms/step");
  for (int k = 0; k + 1 < p->S; k++) {
    int a = p->order[k], b = p->order[k + 1];
    char bw[32];
    if (p->bw[a][b] > 0) snprintf(bw, sizeof bw, "%.1f", p->bw[a][b] * 8 / 1e6);
    else snprintf(bw, sizeof bw, "unlimited");
    fprintf(f, "%2d->%-2d %12s %10.2f %14.3f %16.3f %12.2f\n", k, k + 1, bw, p->lat[a][b] * 1e3,
            p->link_bytes[k] * p->M / 1e6, p->link_bytes[k] * p->M * p->compress / 1e6, p->link_s[k] * p->M * 1e3);
  }
}

int pipe_plan_line(char *out, size_t n, const pipe_plan *p, int stage) {
  size_t k = (size_t)snprintf(out, n, "PLAN stage=%d cuts=", stage);
  for (int i = 0; i <= p->S && k < n; i++) k += (size_t)snprintf(out + k, n - k, i ? ",%d" : "%d", p->cuts[i]);
  if (k < n) k += (size_t)snprintf(out + k, n - k, " order=");
  for (int i = 0; i < p->S && k < n; i++) k += (size_t)snprintf(out + k, n - k, i ? ",%d" : "%d", p->order[i]);
  if (k < n) k += (size_t)snprintf(out + k, n - k, "\n");
  return k < n ? (int)k : tr_fail(TR_EINVAL, "plan line too long");
}

/* n comma-separated integers in 0..INT_MAX, exactly: the last one ends
 * the string or is followed by a space. 0 or -1. */
static int parse_ints(const char *s, int *out, int n) {
  for (int i = 0; i < n; i++) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || errno || v < 0 || v > INT_MAX) return -1;
    if (i + 1 < n ? *end != ',' : *end && *end != ' ' && *end != '\n') return -1;
    out[i] = (int)v;
    s = end + 1;
  }
  return 0;
}

int pipe_plan_parse(const char *line, int S, int *stage, int *cuts, int *order) {
  const char *st = strstr(line, "stage="), *c = strstr(line, "cuts="), *o = strstr(line, "order=");
  if (strncmp(line, "PLAN ", 5) != 0 || !st || !c || !o || parse_ints(st + 6, stage, 1) ||
      parse_ints(c + 5, cuts, S + 1) || parse_ints(o + 6, order, S))
    return tr_fail(TR_EFORMAT, "a bad plan line: %.80s", line);
  return TR_OK;
}

int pipe_plan_check(const char *what, const int *cuts, const int *order, int S, int n) {
  int seen[PIPE_MAX_STAGES] = {0};
  if (S < 1 || S > PIPE_MAX_STAGES) return tr_fail(TR_EINVAL, "%s: %d stages (1..%d)", what, S, PIPE_MAX_STAGES);
  if (cuts[0] != 0 || cuts[S] != n)
    return tr_fail(TR_EINVAL, "%s: cuts must start at 0 and end at %d (the number of ops)", what, n);
  for (int k = 0; k < S; k++) {
    if (cuts[k + 1] <= cuts[k]) return tr_fail(TR_EINVAL, "%s: cuts must increase (stage %d is empty)", what, k);
    if (order[k] < 0 || order[k] >= S || seen[order[k]]++)
      return tr_fail(TR_EINVAL, "%s: order must name each worker 0..%d once", what, S - 1);
  }
  return TR_OK;
}
