/* hf.c — GPT-2 weights to and from Hugging Face's layout (see hf.h). Called
 * by `transom export --hf` (core/cli/export.c) and by trainer_create for the
 * job key init_from. */
#include "hf.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "json_top.h"
#include "safetensors.h"
#include "util.h"

static int ends_with(const char *s, const char *tail) {
  size_t a = strlen(s), b = strlen(tail);
  return a >= b && strcmp(s + a - b, tail) == 0;
}

/* Conv1D in Hugging Face: stored (in, out), transom (out, in). */
static int is_conv1d(const char *name) {
  return ends_with(name, "attn.c_attn.weight") || ends_with(name, "attn.c_proj.weight") ||
         ends_with(name, "mlp.c_fc.weight") || ends_with(name, "mlp.c_proj.weight");
}

static void transpose(float *out, const float *in, int64_t rows, int64_t cols) { /* in (rows,cols) -> (cols,rows) */
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) out[c * rows + r] = in[r * cols + c];
}

/* --- export --- */

static int write_config(const char *dir, const hf_shape *s, int64_t n_positions) {
  char path[PATH_MAX], buf[2048];
  int n = snprintf(buf, sizeof buf,
                   "{\n  \"architectures\": [\"GPT2LMHeadModel\"],\n  \"model_type\": \"gpt2\",\n"
                   "  \"vocab_size\": %lld,\n  \"n_positions\": %lld,\n  \"n_ctx\": %lld,\n  \"n_embd\": %lld,\n"
                   "  \"n_layer\": %lld,\n  \"n_head\": %lld,\n  \"n_inner\": null,\n"
                   "  \"activation_function\": \"gelu_new\",\n  \"layer_norm_epsilon\": 1e-05,\n"
                   "  \"resid_pdrop\": 0.0,\n  \"embd_pdrop\": 0.0,\n  \"attn_pdrop\": 0.0,\n"
                   "  \"initializer_range\": 0.02,\n  \"bos_token_id\": %lld,\n  \"eos_token_id\": %lld,\n"
                   "  \"tie_word_embeddings\": true,\n  \"torch_dtype\": \"float32\"\n}\n",
                   (long long)s->vocab_size, (long long)n_positions, (long long)n_positions, (long long)s->n_embd,
                   (long long)s->n_layer, (long long)s->n_head, (long long)s->vocab_size - 1,
                   (long long)s->vocab_size - 1);
  snprintf(path, sizeof path, "%s/config.json", dir);
  return tr_write_file_atomic(path, buf, (size_t)n);
}

/* "[58, 16]" */
static void shape_str(char *out, size_t n, int ndim, const int64_t *dim) {
  size_t k = (size_t)snprintf(out, n, "[");
  for (int i = 0; i < ndim && k < n; i++)
    k += (size_t)snprintf(out + k, n - k, "%s%lld", i ? ", " : "", (long long)dim[i]);
  if (k < n) snprintf(out + k, n - k, "]");
}

/* The weights against the model the run's job and vocabulary make (g): each
 * of g's parameters in the file, F32, of g's shape, and nothing else there.
 * The error names the file, the tensor and both shapes. */
static int check_weights(const st_file *f, const char *weights, const graph *g, const hf_shape *s) {
  char model[256], want[128], got[128];
  int wte = graph_find(g, "transformer.wte.weight");
  tensor_desc d = {0};
  if (wte >= 0) graph_tensor(g, wte, &d);
  int64_t rows = d.dim[0];
  if (rows < s->vocab_size) /* the model's wte is padded up from the vocabulary, never cut */
    return tr_fail(TR_EINVAL, "the model's wte has %lld rows, fewer than the vocabulary's %lld tokens",
                   (long long)rows, (long long)s->vocab_size);
  snprintf(model, sizeof model, "the run's job and vocabulary (n_layer = %lld, n_embd = %lld, %lld tokens: wte rows "
           "%lld)", (long long)s->n_layer, (long long)s->n_embd, (long long)s->vocab_size, (long long)rows);
  for (int i = 0; i < graph_ntensors(g); i++) {
    graph_tensor(g, i, &d);
    if (d.kind != TK_PARAM) continue;
    const st_entry *e = safetensors_find(f, d.name);
    if (!e) return tr_fail(TR_EFORMAT, "'%s' has no tensor '%s', which %s make", weights, d.name, model);
    if (strcmp(e->dtype, "F32") != 0)
      return tr_fail(TR_EFORMAT, "'%s': tensor '%s' is %s; only F32 exports", weights, e->name, e->dtype);
    shape_str(want, sizeof want, d.ndim, d.dim);
    shape_str(got, sizeof got, e->ndim, e->dim);
    if (strcmp(want, got) != 0)
      return tr_fail(TR_EFORMAT, "'%s': tensor '%s' is %s, but %s make it %s: the weights are not that model's",
                     weights, e->name, got, model, want);
  }
  for (int i = 0; i < f->n; i++) {
    int t = graph_find(g, f->entries[i].name);
    if (t >= 0) graph_tensor(g, t, &d);
    if (t < 0 || d.kind != TK_PARAM)
      return tr_fail(TR_EFORMAT, "'%s' holds tensor '%s', which %s do not make", weights, f->entries[i].name, model);
  }
  return TR_OK;
}

/* dir must not be the weights' own directory (realpath: any spelling, a
 * link): the export would overwrite them with the Hugging Face layout. */
static int check_out_dir(const char *weights, const char *dir) {
  char a[PATH_MAX], b[PATH_MAX], parent[PATH_MAX];
  snprintf(parent, sizeof parent, "%s", weights);
  char *slash = strrchr(parent, '/');
  if (slash) slash[slash == parent] = 0;
  else snprintf(parent, sizeof parent, ".");
  if (realpath(dir, a) && realpath(parent, b) && strcmp(a, b) == 0)
    return tr_fail(TR_EINVAL, "'%s' is the directory of the weights '%s': the export would overwrite them with the "
                   "Hugging Face layout; give another directory", dir, weights);
  return TR_OK;
}

/* The Hugging Face tensors of the file f into ts: Conv1D weights transposed
 * into bufs, wte cut to the vocabulary; *nt of them. f is transom's own
 * weights, already held by check_weights to the model's shapes: a Conv1D
 * weight here is always (out, in), so it is always transposed. */
static int hf_tensors(const st_file *f, const hf_shape *s, st_tensor *ts, int64_t (*dims)[ST_MAX_DIMS], float **bufs,
                      int *nt, int64_t *n_positions) {
  for (int i = 0; i < f->n; i++) {
    const st_entry *e = &f->entries[i];
    const float *src = (const float *)(f->data + e->begin);
    memcpy(dims[i], e->dim, sizeof e->dim);
    ts[i] = (st_tensor){e->name, src, e->ndim, dims[i]};
    if (strcmp(e->name, "transformer.wte.weight") == 0) {
      dims[i][0] = s->vocab_size; /* the padding rows stay behind */
    } else if (strcmp(e->name, "transformer.wpe.weight") == 0) {
      *n_positions = e->dim[0];
    } else if (is_conv1d(e->name) && e->ndim == 2) {
      if (!(bufs[i] = malloc(e->end - e->begin))) return tr_fail(TR_ENOMEM, "out of memory");
      transpose(bufs[i], src, e->dim[0], e->dim[1]);
      dims[i][0] = e->dim[1];
      dims[i][1] = e->dim[0];
      ts[i].data = bufs[i];
    }
    *nt = i + 1;
  }
  return TR_OK;
}

/* The lock two exports into one directory take turns on (tr_lock_file):
 * removed when the export ends. */
#define EXPORT_LOCK ".transom-export.lock"

/* dir made if absent (*created: by this call), then its export lock taken
 * (*fd, see tr_lock_file); made and taken again if dir went meanwhile (an
 * export that made it failed and removed it while this one waited). */
static int take_dir(const char *dir, const char *lock_path, int *created, int *fd) {
  for (int i = 0;; i++) {
    *created = access(dir, F_OK) != 0;
    int rc = tr_mkdirs(dir);
    if (!rc) rc = tr_lock_file(lock_path, fd);
    if (!rc || i == 2 || access(dir, F_OK) == 0) return rc;
  }
}

int hf_export(const char *weights, const graph *g, const hf_shape *s, const char *dir) {
  char path[PATH_MAX];
  int rc = check_out_dir(weights, dir);
  if (rc) return rc;
  st_file f;
  if ((rc = safetensors_open(&f, weights))) return rc;
  st_tensor *ts = calloc((size_t)f.n + 1, sizeof *ts);
  int64_t(*dims)[ST_MAX_DIMS] = calloc((size_t)f.n + 1, sizeof *dims);
  float **bufs = calloc((size_t)f.n + 1, sizeof *bufs);
  int64_t n_positions = 0;
  int nt = 0;
  rc = ts && dims && bufs ? check_weights(&f, weights, g, s) : tr_fail(TR_ENOMEM, "out of memory");
  if (!rc) rc = hf_tensors(&f, s, ts, dims, bufs, &nt, &n_positions);
  if (!rc && !n_positions) rc = tr_fail(TR_EFORMAT, "'%s' is not a transom GPT (no transformer.wpe.weight)", weights);
  /* inside dir, each file replaced atomically (its .tmp, fsync, rename) and the other files left alone;
   * the weights first: the large write, the one a full disk or a size limit stops, fails before
   * config.json changes, so that failure leaves the earlier pair. Only one between the two renames
   * leaves the new weights beside the earlier config.json. Two exports into one dir take turns (the
   * lock file, held from before the weights to after config.json): one's weights never sit beside the
   * other's config.json. */
  char lock_path[PATH_MAX];
  int created = 0, lock = -1, locked = 0;
  if (!rc && snprintf(lock_path, sizeof lock_path, "%s/" EXPORT_LOCK, dir) >= (int)sizeof lock_path)
    rc = tr_fail(TR_EINVAL, "'%s': path too long", dir);
  if (!rc) rc = take_dir(dir, lock_path, &created, &lock);
  locked = !rc;
  if (!rc) snprintf(path, sizeof path, "%s/model.safetensors", dir); /* shorter than lock_path */
  const char *meta[] = {"transom.export", "hf-gpt2", NULL};
  if (!rc) rc = safetensors_write(path, ts, nt, meta);
  if (!rc) rc = tr_sync_dir(dir);
  if (!rc) rc = write_config(dir, s, n_positions);
  if (locked) tr_unlock_file(lock, lock_path);
  if (rc && locked && created) rmdir(dir); /* only while empty: a failed first export leaves no directory */
  for (int i = 0; i < nt; i++) free(bufs[i]);
  free(bufs);
  free(dims);
  free(ts);
  safetensors_close(&f);
  return rc;
}

/* --- import --- */

/* A JSON value as written, cut at 40 bytes: "%.*s%s" with these. */
#define CUT40(n) (int)((n) > 40 ? 40 : (n))
#define MORE40(n) ((n) > 40 ? "..." : "")

/* What transom's gpt cannot honour: another activation than GPT-2's tanh
 * GELU, an untied output head (its own lm_head.weight, which import_one
 * would never read), another layer norm epsilon (the kernels' is 1e-5),
 * attention scores scaled otherwise than by 1/sqrt(head_dim) alone
 * (scale_attn_weights false: not scaled; scale_attn_by_inverse_layer_idx
 * true: also by 1/(layer + 1)), or an MLP other than 4 * n_embd wide
 * (n_inner; lua/models/gpt.lua's c_fc). Absent keys, and n_inner null, are
 * GPT-2's defaults. Each error names the file and the key. */
static int check_fixed(const json_doc *d, int64_t n_embd) {
  char act[64];
  const char *raw;
  size_t n;
  int found, b, tied = 1;
  double eps = 1e-5;
  int rc = json_top_raw(d, "activation_function", &raw, &n, &found);
  if (!rc && found && raw[0] != '"') /* not a string: json_top_str says so */
    return json_top_str(d, "activation_function", act, sizeof act, NULL);
  /* a string too long for act (or holding \u0000) is neither name either */
  if (!rc && found && (json_top_str(d, "activation_function", act, sizeof act, NULL) != TR_OK ||
                       (strcmp(act, "gelu_new") != 0 && strcmp(act, "gelu_pytorch_tanh") != 0)))
    return tr_fail(TR_EINVAL, "'%s': activation_function is %.*s%s; transom's gpt computes GPT-2's tanh GELU "
                   "(\"gelu_new\" or \"gelu_pytorch_tanh\")", d->file, CUT40(n), raw, MORE40(n));
  if (!rc) rc = json_top_bool(d, "tie_word_embeddings", &tied, &found);
  if (!rc && !tied)
    return tr_fail(TR_EINVAL, "'%s': tie_word_embeddings is false; transom's gpt ties the output head to wte "
                   "(lm_head.weight would be ignored)", d->file);
  /* the value as written first: the refusal quotes it and needs nothing more */
  if (!rc) rc = json_top_raw(d, "layer_norm_epsilon", &raw, &n, &found);
  if (!rc && found) rc = json_top_num(d, "layer_norm_epsilon", &eps, NULL);
  if (!rc && fabs(eps - 1e-5) > 1e-12)
    return tr_fail(TR_EINVAL, "'%s': layer_norm_epsilon is %.*s%s, transom's gpt uses 1e-05", d->file, CUT40(n), raw,
                   MORE40(n));
  if (!rc) rc = json_top_bool(d, "scale_attn_weights", &b, &found);
  if (!rc && found && !b)
    return tr_fail(TR_EINVAL, "'%s': scale_attn_weights is false; transom's gpt scales attention scores by "
                   "1/sqrt(head_dim)", d->file);
  if (!rc) rc = json_top_bool(d, "scale_attn_by_inverse_layer_idx", &b, &found);
  if (!rc && found && b)
    return tr_fail(TR_EINVAL, "'%s': scale_attn_by_inverse_layer_idx is true; transom's gpt scales attention scores "
                   "by 1/sqrt(head_dim) alone, not also by 1/(layer index + 1)", d->file);
  if (!rc) rc = json_top_raw(d, "n_inner", &raw, &n, &found);
  if (!rc && found && !(n == 4 && memcmp(raw, "null", 4) == 0)) {
    int64_t inner = 0;
    rc = json_top_int(d, "n_inner", &inner, NULL);
    if (!rc && inner != 4 * n_embd)
      return tr_fail(TR_EINVAL, "'%s': n_inner is %lld; transom's gpt's MLP is 4 * n_embd = %lld wide (n_inner null "
                     "or %lld)", d->file, (long long)inner, (long long)(4 * n_embd), (long long)(4 * n_embd));
  }
  return rc;
}

/* config.json against the job (s, its block_size): every key read as a
 * top-level key of one JSON object (json_top.h), the four sizes and
 * n_positions required. */
static int check_config(const char *dir, const hf_shape *s, int64_t block) {
  char path[PATH_MAX];
  if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path)
    return tr_fail(TR_EINVAL, "'%s': path too long", dir);
  size_t len;
  char *js = tr_read_file(path, &len);
  if (!js) return TR_EIO;
  json_doc d = {path, js, len};
  struct { const char *key; int64_t want; } f[] = {
      {"n_layer", s->n_layer}, {"n_head", s->n_head}, {"n_embd", s->n_embd}, {"vocab_size", s->vocab_size}};
  int rc = TR_OK;
  for (int i = 0; i < 4 && !rc; i++) {
    int64_t got = 0;
    rc = json_top_int(&d, f[i].key, &got, NULL);
    if (!rc && got != f[i].want)
      rc = tr_fail(TR_EINVAL, "'%s': %s is %lld, the job has %s = %lld", path, f[i].key, (long long)got, f[i].key,
                   (long long)f[i].want);
  }
  int64_t npos = 0;
  if (!rc) rc = json_top_int(&d, "n_positions", &npos, NULL);
  if (!rc && npos < block)
    rc = tr_fail(TR_EINVAL, "'%s': n_positions = %lld is less than the job's block_size = %lld", path,
                 (long long)npos, (long long)block);
  if (!rc) rc = check_fixed(&d, s->n_embd);
  free(js);
  return rc;
}

/* Copies one Hugging Face tensor into transom's tensor d, whose name and
 * shape are the model's. A Conv1D weight must be Hugging Face's (in, out),
 * always: it is transposed, and any other shape is refused. A square one
 * cannot show its layout, but c_attn (3C, C) and c_fc (4C, C) never are
 * square, so a file in Linear's (out, in) layout is refused by them rather
 * than loaded with its square matrices transposed and the rest not. wte
 * must hold a row for each of the vocab real tokens: only the model's
 * padding rows past them (the vocabulary rounded up) are zeroed, never a
 * real token's; wpe's first rows, as many as the job's block_size, are
 * read. Each error names the file, the tensor, the shape found and the
 * shape expected. */
static int import_one(const st_file *f, const char *path, const tensor_desc *d, int64_t vocab, float *dst) {
  char want[128], got[128];
  int prefixed = strncmp(d->name, "transformer.", 12) == 0;
  const st_entry *e = safetensors_find(f, d->name);
  if (!e && prefixed) e = safetensors_find(f, d->name + 12);
  if (!e)
    return tr_fail(TR_EFORMAT, "'%s' has no tensor '%s'%s%s%s, which the job's model needs", path, d->name,
                   prefixed ? " (nor '" : "", prefixed ? d->name + 12 : "", prefixed ? "')" : "");
  if (strcmp(e->dtype, "F32") != 0)
    return tr_fail(TR_EFORMAT, "'%s': tensor '%s' is %s; only F32 is read", path, e->name, e->dtype);
  const float *src = (const float *)(f->data + e->begin);
  shape_str(got, sizeof got, e->ndim, e->dim);
  int wte = ends_with(d->name, "wte.weight"), wpe = ends_with(d->name, "wpe.weight");
  if (d->ndim == 2 && is_conv1d(d->name)) {
    int64_t in_out[2] = {d->dim[1], d->dim[0]};
    shape_str(want, sizeof want, 2, in_out);
    if (e->ndim != 2 || e->dim[0] != in_out[0] || e->dim[1] != in_out[1])
      return tr_fail(TR_EFORMAT, "'%s': Conv1D weight '%s' is %s, expected %s: Hugging Face GPT-2 stores it "
                     "(in, out)%s", path, e->name, got, want,
                     e->ndim == 2 && e->dim[0] == d->dim[0] && e->dim[1] == d->dim[1]
                         ? "; this is Linear's (out, in) layout, which is not read" : "");
    transpose(dst, src, e->dim[0], e->dim[1]);
  } else if (d->ndim == 2 && (wte || wpe)) {
    if (e->ndim != 2 || e->dim[1] != d->dim[1])
      return tr_fail(TR_EFORMAT, "'%s': tensor '%s' is %s, expected [%s%lld, %lld] (%s rows of n_embd = %lld)", path,
                     e->name, got, wte ? "" : "at least ", (long long)(wte ? vocab : d->dim[0]), (long long)d->dim[1],
                     wte ? "vocab_size" : "block_size", (long long)d->dim[1]);
    if (wte && e->dim[0] < vocab)
      return tr_fail(TR_EFORMAT, "'%s': '%s' has %lld rows, fewer than vocab_size = %lld: tokens %lld..%lld would "
                     "have no embedding", path, e->name, (long long)e->dim[0], (long long)vocab, (long long)e->dim[0],
                     (long long)vocab - 1);
    if (wte && e->dim[0] > d->dim[0])
      return tr_fail(TR_EFORMAT, "'%s': '%s' has %lld rows, more than the model's %lld (vocab_size = %lld padded to "
                     "a multiple of 128)", path, e->name, (long long)e->dim[0], (long long)d->dim[0], (long long)vocab);
    if (wpe && e->dim[0] < d->dim[0])
      return tr_fail(TR_EFORMAT, "'%s': '%s' has %lld rows, fewer than the job's block_size = %lld", path, e->name,
                     (long long)e->dim[0], (long long)d->dim[0]);
    int64_t rows = wte ? e->dim[0] : d->dim[0];
    memcpy(dst, src, sizeof(float) * (size_t)(rows * d->dim[1]));
    memset(dst + rows * d->dim[1], 0, sizeof(float) * (size_t)((d->dim[0] - rows) * d->dim[1]));
  } else {
    shape_str(want, sizeof want, d->ndim, d->dim);
    if (strcmp(want, got) != 0)
      return tr_fail(TR_EFORMAT, "'%s': tensor '%s' is %s, expected %s (the job's model)", path, e->name, got, want);
    memcpy(dst, src, e->end - e->begin);
  }
  return TR_OK;
}

int hf_import(graph *g, float *params, const char *dir, const hf_shape *s) {
  int64_t block = 0;
  for (int i = 0; i < graph_ntensors(g); i++) {
    tensor_desc d;
    graph_tensor(g, i, &d);
    if (d.kind == TK_PARAM && ends_with(d.name, "wpe.weight")) block = d.dim[0];
  }
  int rc = check_config(dir, s, block);
  if (rc) return rc;
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  st_file f;
  if ((rc = safetensors_open(&f, path))) return rc;
  for (int i = 0; i < graph_ntensors(g) && !rc; i++) {
    tensor_desc d;
    graph_tensor(g, i, &d);
    if (d.kind == TK_PARAM) rc = import_one(&f, path, &d, s->vocab_size, params + d.offset);
  }
  safetensors_close(&f);
  return rc;
}
