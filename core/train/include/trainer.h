/* trainer.h — one data-parallel replica's training state and step.
 *
 * A trainer owns the corpus, the model graph (built by the Lua model file
 * once, then executed by C), the optimizer and the explicit training state
 * (step counter, data RNG) that a checkpoint must capture. trainer_step runs
 * batch -> forward -> backward -> clip -> AdamW. The CLI's `run` drives it;
 * the operator and the checkpoint engine plug in around trainer_step.
 * One thread at a time.
 */
#ifndef TRANSOM_TRAINER_H
#define TRANSOM_TRAINER_H

#include <lua.h>
#include <stdint.h>
#include <stdio.h>

#include "ckpt.h"
#include "data.h"
#include "graph.h"
#include "job.h"

typedef struct {
  int64_t step;  /* steps completed after this one */
  float loss, lr, grad_norm;
  int64_t tokens;
  double t_data, t_fwd, t_bwd, t_opt, t_total; /* seconds */
  double t_ckpt_wait; /* waiting for a level-1 checkpoint copy (the loop's, before t_opt) */
  int skipped;        /* the update was not applied (non-finite gradient, or asked) */
} step_stats;

/* The state beside parameters and optimizer moments that defines where
 * training is: what a checkpoint saves. */
typedef struct {
  int64_t step;
  uint64_t data_rng; /* the batch generator's state for this step (derived from seed, slot, step) */
} trainer_state;

typedef struct trainer trainer;

/* Loads cfg->data, builds and plans the model, initialises parameters from
 * cfg->seed. NULL with tr_error() set on failure. L must outlive the trainer. */
trainer *trainer_create(lua_State *L, const job_config *cfg);
void trainer_free(trainer *t);

/* One step = trainer_compute_grads (batch, forward, backward) then
 * trainer_apply_grads (clip, AdamW, step+1). The training loop (loop.h)
 * exchanges trainer_grads() with peers between the two. */
int trainer_step(trainer *t, step_stats *st);
int trainer_compute_grads(trainer *t, step_stats *st);
int trainer_apply_grads(trainer *t, step_stats *st);
/* fn(ud, from) from inside trainer_compute_grads, on its thread, as the
 * backward finishes gradients: trainer_grads()[from..trainer_grads_size())
 * is final for this step (from decreases; 0 comes last, after everything
 * the step does to the gradients). On a device backend: every kernel that
 * writes them was queued on the compute stream (graph_set_grad_hook).
 * fn NULL removes it. 0 or a negative code. */
int trainer_set_grads_ready(trainer *t, void (*fn)(void *ud, int64_t from), void *ud);
float *trainer_grads(trainer *t); /* the backend's memory (device pointer on a device) */
int64_t trainer_grads_size(const trainer *t);
/* Direct access to the training state (catch-up of a joining replica). */
typedef struct {
  float *params, *m, *v; /* n floats each */
  int64_t n, step, opt_steps;
} trainer_buffers;
/* Host copies of the state: on a device backend this downloads them first
 * (a non-zero return means the copy failed); write through them and call
 * trainer_buffers_put to send changes back. */
int trainer_buffers_get(trainer *t, trainer_buffers *b);
#define trainer_buffers_put trainer_push

/* --- device backends (job field `device`; see backend.h) ---
 * On a device the parameters, gradients and Adam moments live in device
 * memory and the host keeps mirrors. trainer_pull copies parameters (and
 * with_moments the moments) to the mirrors, trainer_push the mirrors back.
 * On the cpu backend both are no-ops. */
int trainer_pull(trainer *t, int with_moments);
int trainer_push(trainer *t);
/* The backend the trainer runs on. */
const struct tr_backend *trainer_backend(const trainer *t);
/* The gradients in host memory (downloaded on a device; NULL on failure),
 * and back (uploaded on a device). */
float *trainer_grads_host(trainer *t);
int trainer_grads_put(trainer *t, const float *host);
void trainer_set_progress(trainer *t, int64_t step, int64_t opt_steps);
/* CRC32C of the parameters (replicas must agree bit for bit). */
uint32_t trainer_param_crc(trainer *t);
/* Replica slot (default 0): each slot draws its own batches. */
void trainer_set_slot(trainer *t, int slot);
/* Drops the optimizer update of `step` (counted as a step all the same).
 * Non-finite gradients are always dropped. At most 64 per run. */
int trainer_skip_update(trainer *t, int64_t step);
/* Chaos: the next trainer_compute_grads reports a NaN loss and leaves a NaN
 * in the gradients, as a numerical fault would. */
void trainer_poison_next(trainer *t);
/* The batch stream without the batches of keys (ascending, at most 64):
 * a rollback past a bad batch never draws it again. A step's batch is
 * drawn from its key, batch_key(step, keys, n): the step-th key (from 0)
 * that is not skipped, so the steps before a skipped key keep theirs. */
int trainer_set_batch_skips(trainer *t, const int64_t *keys, int n);
int64_t batch_key(int64_t step, const int64_t *skips, int n);
/* From step from_step on, the schedule's peak learning rate is lr (min_lr
 * scaled alike). Every replica must apply the same changes at the same steps
 * (the operator sends them with the step). At most 16 per run. */
int trainer_set_lr(trainer *t, int64_t from_step, float lr);
/* Mean loss over cfg->eval_steps validation batches (the same batches every
 * call). */
int trainer_eval(trainer *t, float *val_loss);
/* Writes a sample of ntokens after prompt to out. */
int trainer_sample(trainer *t, const char *prompt, int64_t ntokens, float temperature, uint64_t seed, FILE *out);
/* Writes dir/model.safetensors (parameters) and dir/vocab.json (and for
 * token data with a tokenizer, dir/tokenizer.bpe). */
int trainer_save(trainer *t, const char *dir);

graph *trainer_graph(trainer *t);
/* The checked job the trainer was made from (valid for its lifetime). */
const job_config *trainer_config(const trainer *t);
const dataset *trainer_data(trainer *t);
void trainer_get_state(const trainer *t, trainer_state *s);
/* Bytes the planner predicts: parameters, gradients, Adam moments,
 * activations and their gradients, inputs. */
size_t trainer_planned_bytes(const trainer *t);
/* Model FLOPs per step (forward+backward), for GFLOP/s figures. */
double trainer_flops_per_step(const trainer *t);

/* --- checkpoints --- */

/* Registers the training state with a checkpoint engine: every parameter as
 * "param/<name>", the AdamW moments as "adam.m/<name>" and "adam.v/<name>".
 * The caller (the training loop, loop.c) waits for a running level-1 copy
 * (ckpt_wait_copy) before trainer_apply_grads changes the parameters. */
int trainer_ckpt_attach(trainer *t, ckpt_engine *e);
/* The state to save with a snapshot (step, data RNG, optimizer steps, config
 * hash, wall time). */
void trainer_ckpt_state(const trainer *t, ckpt_state *s);
/* Loads the newest intact checkpoint (or `step` >= 0) from r into the
 * trainer, all or nothing; fails if its config hash is not this model's.
 * Skipped checkpoints are described in report. */
int trainer_ckpt_load(trainer *t, ckpt_reader *r, int64_t step, char *report, size_t report_len);
/* Hash of what defines the model's tensors: model (a model file by its
 * name, wherever it lies), sizes, vocabulary. */
uint64_t trainer_config_hash(const trainer *t);
/* The same hash as builds before RUN/job.lua's paths were absolute computed
 * it: the model by its string as the job spells it. trainer_ckpt_load
 * accepts checkpoints of either. */
uint64_t trainer_legacy_config_hash(const trainer *t);

/* --- shared with `transom sample` --- */

/* Builds the model of the checked job at lua ref cfg_ref for batch size B and
 * vocabulary size V, planned (with_grad) and ready. */
int model_build(lua_State *L, int cfg_ref, int64_t V, int B, int with_grad, graph **out);
/* The same, planned on backend be. */
int model_build_on(lua_State *L, int cfg_ref, int64_t V, int B, int with_grad, const struct tr_backend *be,
                   int bf16, graph **out);
/* Copies parameters by name from a safetensors file into a planned graph. */
int model_load_params(graph *g, const char *path);
/* How sampling turns text into ids and back: a byte-level run's vocabulary,
 * or a token run's tokenizer (NULL: the prompt must be empty, ids print as
 * numbers); sampled ids stay below vocab_size (never a padding id). */
typedef struct {
  const vocab *bytes;
  const struct bpe *tok;
  int64_t vocab_size;
} text_codec;
/* Autoregressive sampling with an inference graph (B=1): ntokens in
 * 0..MODEL_GENERATE_MAX after a prompt of at most as many bytes, a
 * temperature that is a positive, finite float; TR_EINVAL otherwise. */
#define MODEL_GENERATE_MAX (1 << 24)
int model_generate(graph *g, const text_codec *c, const char *prompt, int64_t ntokens, float temperature,
                   uint64_t seed, FILE *out);

#endif
