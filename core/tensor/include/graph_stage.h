/* graph_stage.h — a planned graph seen as a chain of pipeline stages: what
 * each op costs, which tensors cross a cut, and where to cut.
 *
 * A stage is a contiguous range [lo,hi) of the planned order (graph.h's
 * graph_norder): since the order is topological, every tensor a stage reads
 * comes from itself, from a parameter or input (every stage holds those), or
 * from an earlier stage through the cuts in between. A cut at position k
 * (between order positions k-1 and k) is crossed by every activation made
 * before k and read at or after k; those are what a pipeline sends forward,
 * and their gradients what comes back. A tensor made in stage 0 and read in
 * stage 2 crosses both cuts: stage 1 relays it.
 *
 * The workload estimator (costs) and the cut search (graph_stage_cut) are
 * pure functions of the graph and the numbers given; the planner
 * (core/fleet/pipeline_plan.c) adds the measured speeds and links. Called
 * after graph_plan; any thread that owns the graph.
 */
#ifndef TRANSOM_GRAPH_STAGE_H
#define TRANSOM_GRAPH_STAGE_H

#include <stdint.h>

#include "graph.h"

/* What an op costs: FLOPs of its forward and backward (backward counted as
 * 2x forward: the two matmuls of a linear's backward; elementwise ops alike,
 * a slight overcount), the bytes of parameters it reads, and the bytes of
 * its output. */
typedef struct {
  double flops;       /* forward + backward */
  double param_bytes; /* parameters it reads (a tied one in each reader) */
  double out_bytes;   /* its output activation */
} graph_op_cost;

/* Costs of the planned order's nodes, into out[0..graph_norder). */
int graph_stage_costs(const graph *g, graph_op_cost *out);

/* The activations crossing the cut at position k (0 < k < norder), in
 * tensor-id order, into ids[0..cap); returns their number (more than cap:
 * only cap written), or a negative error. *bytes (may be NULL): their size
 * in bytes (4 an element). */
int graph_stage_crossing(const graph *g, int k, int *ids, int cap, int64_t *bytes);

/* The activations stage [lo,hi) writes (outputs, op-private ones) or reads
 * from before lo: what it must keep per micro-batch in flight between its
 * forward and backward. Same return convention. */
int graph_stage_tensors(const graph *g, int lo, int hi, int *ids, int cap);

/* Cuts the order into S stages: cuts[0] = 0 < cuts[1] < ... < cuts[S] =
 * norder; stage s is [cuts[s], cuts[s+1]). The objective is the pipeline's
 * bottleneck per micro-batch, what sets a 1F1B step in steady state:
 *
 *   max( max_s flops(stage s) / speed[s],  max_k 2 * crossing_bytes(cut k) / bw[k] )
 *
 * (activations forward and gradients back over link k, between stages k and
 * k+1), minimised exactly by dynamic programming over (stage, cut) in
 * O(S * norder^2); ties (a slow link sets the bottleneck whatever the
 * compute) go to the least compute on the slowest stage, then to the fewest
 * bytes crossing in all. speed: FLOP/s
 * per stage (NULL: all 1); bw: bytes/s per link (NULL or 0: free). *cost
 * (may be NULL): the bottleneck in seconds. Errors: S < 1 or S > norder. */
int graph_stage_cut(const graph *g, int S, const double *speed, const double *bw, int *cuts, double *cost);

#endif
