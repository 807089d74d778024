/* step_record.h — what one replica reports about one training step: one
 * table, and everything that names a step's fields comes from it.
 *
 * From STEP_FIELDS below come: the step_record struct, the worker's STEP
 * line to the operator (step_record_line), the operator's parser of it
 * (step_record_parse), the keys of metrics.jsonl (step_record_json, the
 * same for one replica and for many), the detector's metric names (its
 * DETECTOR_METRICS extends STEP_METRICS) and Prometheus's gauge names. One
 * spelling per field, times in seconds. The training loop (core/train/
 * loop.c) fills a record; core/cli/run.c writes it, core/fleet sends and
 * parses it. Plain data: no allocation, any thread.
 */
#ifndef TRANSOM_STEP_RECORD_H
#define TRANSOM_STEP_RECORD_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* The measured values, all doubles:
 * X(ID, name, help, Prometheus gauge ("" = none), Prometheus phase ("" = none)) */
#define STEP_METRICS(X)                                                                                       \
  X(LOSS, loss, "training loss of the latest step", "transom_loss", "")                                       \
  X(GRAD_NORM, grad_norm, "global gradient norm of the latest step", "transom_grad_norm", "")                 \
  X(LR, lr, "learning rate of the latest step", "transom_learning_rate", "")                                  \
  X(STEP_S, step_s, "wall time of the latest step", "transom_step_seconds", "")                               \
  X(DATA_S, data_s, "time loading the batch", "", "data")                                                     \
  X(FORWARD_S, forward_s, "time in the forward pass", "", "forward")                                          \
  X(BACKWARD_S, backward_s, "time in the backward pass", "", "backward")                                      \
  X(ALLREDUCE_S, allreduce_s, "time the step waited for the gradient all-reduce (exposed: not hidden behind "  \
    "backward)", "", "allreduce")                                                                             \
  X(COMM_S, comm_s, "time the gradient all-reduce ran, overlapped with backward or not", "", "")              \
  X(OPTIMIZER_S, optimizer_s, "time in the optimizer update", "", "optimizer")                                \
  X(CKPT_WAIT_S, ckpt_wait_s, "time waiting for the checkpoint copy", "", "checkpoint_wait")                  \
  X(TOKENS_PER_S, tokens_per_s, "training tokens per second", "transom_tokens_per_second", "")                \
  X(RSS_BYTES, rss_bytes, "resident set size", "transom_rss_bytes", "")                                     \
  X(DENSITY_FWD, density_fwd, "pipeline stage: fraction of the activations sent to the next stage (AdaTopK; "  \
    "1 = all)", "", "")                                                                                       \
  X(DENSITY_BWD, density_bwd, "pipeline stage: fraction of the gradients sent to the previous stage", "", "")   \
  X(BYTES_FWD, bytes_fwd, "pipeline stage: bytes sent to the next stage in the step", "", "")                 \
  X(BYTES_BWD, bytes_bwd, "pipeline stage: bytes sent to the previous stage in the step", "", "")

/* Who and where, all integers: X(name, help) */
#define STEP_COUNTERS(X)                                                         \
  X(step, "steps completed, this one included")                                  \
  X(worker, "the replica slot (0 for a single-process run)")                     \
  X(replicas, "replicas whose gradients the step averaged")                      \
  X(epoch, "FTAR membership epoch the step was reduced in (0: alone)")           \
  X(redos, "times the all-reduce was redone after a member failed")              \
  X(leader, "1 if this replica led the step (checkpoints, evaluation)")          \
  X(skipped, "1 if the optimizer update was not applied")

typedef struct {
#define STEP_RECORD_INT(name, help) int64_t name;
  STEP_COUNTERS(STEP_RECORD_INT)
#undef STEP_RECORD_INT
#define STEP_RECORD_NUM(ID, name, help, prom, phase) double name;
  STEP_METRICS(STEP_RECORD_NUM)
#undef STEP_RECORD_NUM
  uint32_t checksum; /* parameter CRC32C after the step, when has_checksum */
  int has_checksum;
} step_record;

/* One metrics.jsonl line: {"step":..,"worker":..,...,"checksum":"89abcdef"?}
 * and a newline. Returns 0, or -1 if the write failed. */
int step_record_json(FILE *f, const step_record *r);
/* The record as "key=value" pairs separated by spaces (the STEP line's
 * body), NUL-terminated in out. Returns the length, or -1 if n is too
 * small. */
int step_record_line(char *out, size_t n, const step_record *r);
/* Reads the pairs of a STEP line (other keys and the verb are ignored) into
 * r, which it zeroes first. Returns the number of record fields found. */
int step_record_parse(const char *line, step_record *r);

#endif
