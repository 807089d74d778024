/* hf.h — GPT-2 weights in Hugging Face's layout: `transom export --hf` and
 * the job key init_from.
 *
 * transom's GPT (lua/models/gpt.lua) already uses nanoGPT's names, which are
 * GPT2LMHeadModel's: transformer.wte.weight, transformer.h.N.attn.c_attn.weight
 * and so on. What differs: Hugging Face stores the four projection matrices
 * (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) as Conv1D weights, (in,
 * out) where transom has (out, in); its token table has vocab_size rows where
 * transom's is padded to a multiple of 128; its position table has
 * n_positions rows, which may be more than the job's block_size (the first
 * block_size are used, as nanoGPT crops). The head is tied to wte (no
 * lm_head.weight is written; one read is ignored). Float32 only.
 */
#ifndef TRANSOM_HF_H
#define TRANSOM_HF_H

#include <stdint.h>

#include "graph.h"

typedef struct {
  int64_t vocab_size; /* real tokens (not padded) */
  int64_t n_layer, n_head, n_embd;
} hf_shape;

/* Writes dir/config.json and dir/model.safetensors from transom's weights
 * file `weights` (RUN/model.safetensors), so that
 * GPT2LMHeadModel.from_pretrained(dir) loads it. g is the model the run's
 * job and vocabulary make (its parameters' names and shapes), s their sizes:
 * every tensor in `weights` must be one of g's parameters, F32, of its shape,
 * and every parameter must be there (an error names the file, the tensor and
 * both shapes), so config.json never describes another model than the
 * tensors. dir must not be the weights' own directory (compared by
 * realpath); it is created if absent, and other files in it stay (a model
 * repository's tokenizer.json, README.md, .git). model.safetensors, then
 * config.json, are each replaced atomically (a .tmp beside it, fsync,
 * rename, the directory synced): an error before the first rename leaves
 * dir as it was; one between the two leaves the new weights beside the
 * earlier config.json. */
int hf_export(const char *weights, const graph *g, const hf_shape *s, const char *dir);

/* Fills the parameters of a planned GPT graph from dir/config.json and
 * dir/model.safetensors (names with or without the "transformer." prefix);
 * params is the host array the tensors' offsets index (graph_params on the
 * CPU). config.json is read by its top-level keys (json_top.h: one nested
 * or inside a string is not the key; a key twice, a value of another type,
 * a text that is not one JSON object are TR_EFORMAT naming the file and
 * the key) and must agree with s (the job): TR_EINVAL names the field, both
 * values and the file. So must the keys that change the maths (TR_EINVAL
 * naming the file and the key): activation_function GPT-2's tanh GELU,
 * tie_word_embeddings true, layer_norm_epsilon 1e-5, scale_attn_weights
 * true, scale_attn_by_inverse_layer_idx false, n_inner null or 4 * n_embd
 * (each absent: GPT-2's default, accepted). Every Conv1D weight must be (in, out); any other
 * shape, as every other tensor of another shape than the model's, is
 * TR_EFORMAT naming model.safetensors, the tensor, its shape and the one
 * expected. wte must have a row for each of the s->vocab_size tokens (an
 * error names model.safetensors and both sizes); only the model's padding
 * rows past them are zeroed. On an error params may be partly written. */
int hf_import(graph *g, float *params, const char *dir, const hf_shape *s);

#endif
