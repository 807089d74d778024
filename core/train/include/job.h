/* job.h — the checked job configuration, as C reads it.
 *
 * The schema, defaults and checks live in lua/transom/job.lua; job_load runs
 * them and copies the fields C needs into a job_config. The checked Lua table
 * stays in the registry (cfg->lua_ref) for the model builder. Nothing is
 * written to disk here.
 */
#ifndef TRANSOM_JOB_H
#define TRANSOM_JOB_H

#include <lua.h>
#include <stddef.h>
#include <stdint.h>

#define JOB_MAX_CHAOS 64

typedef struct { /* one entry of the job's chaos list */
  int64_t at_step, replica, ms, steps;
  char fault[8];
} job_chaos;

typedef struct {
  char path[1024];   /* the job file */
  char name[128];
  char model[1024];  /* a name (lua/models/) or a .lua file: RUN/job.lua writes it absolute */
  char data[4096];     /* a file or glob, or several separated by '\n' */
  char val_data[4096]; /* "" = the last 10% of data */
  char data_format[8]; /* "auto", "text", "llmc", "uint16" */
  char tokenizer[1024];
  char init_from[1024]; /* a Hugging Face GPT-2 directory, "" = none */
  int64_t vocab_size;   /* token data: 0 = not given */
  char run_dir[1024]; /* "" = default */
  char sample_prompt[256];
  char device[16];   /* "cpu", "cuda", "emu" (backend.h) */
  char precision[8]; /* "fp32", "bf16" (graph_set_bf16) */
  int64_t n_layer, n_head, n_embd, block_size, batch_size;
  int64_t max_steps, warmup_steps, lr_decay_steps, eval_interval, eval_steps, log_interval, sample_tokens;
  int64_t seed, threads;
  double lr, min_lr, weight_decay, beta1, beta2, eps, grad_clip, temperature;
  /* checkpoint policy (lua/policies/checkpoint.lua + the job's overrides) */
  int64_t ckpt_every_steps, ckpt_keep_last, ckpt_keep_every, ckpt_map_mb;
  double ckpt_every_seconds;
  char ckpt_when_busy[16];
  /* pipeline stages (core/fleet/pipeline*.c; lua/policies/pipeline.lua) */
  int64_t pipe_stages, pipe_micro_batches;
  char pipe_placement[1024], pipe_compression[16];
  double pipe_min_density, pipe_act_min_density, pipe_lan_mbit, pipe_wan_mbit, pipe_wan_ms;
  int64_t pipe_rebuilds;
  int pipe_probe; /* pipeline.workers (speed, zone) stay in the Lua table: pipeline_plan.c reads them */
  char ckpt_remote[1024];    /* level 3's directory, "" = none */
  double ckpt_remote_rate_mb; /* MiB/s, 0 = no limit */
  /* replicas and failures (the operator) */
  int64_t replicas, min_replicas, max_replicas, checksum_interval, metrics_port;
  int64_t hosts; /* agents to wait for (0: the operator forks its workers) */
  char on_failure[16];
  char policies[1024];
  double deadline, bucket_mb, hang_seconds, operator_grace;
  int detector; /* Eagle Eye on */
  job_chaos chaos[JOB_MAX_CHAOS];
  int nchaos;
  int lua_ref; /* registry ref of the checked table */
} job_config;

/* Loads and checks path with --set overrides (sets[0..nsets)). On error
 * returns a negative code with tr_error() = "file:line: message"; a file
 * that runs past 100 million VM instructions or 2 s of CPU time is such an
 * error. L's hook,
 * if any, is suspended during the call and restored after it. */
int job_load(lua_State *L, const char *path, const char *const *sets, int nsets, job_config *cfg);

/* Lua text of the resolved job (for RUN/job.lua); caller frees. Paths
 * (data, val_data, model and pipeline.placement when they are files,
 * tokenizer, init_from, run_dir, policies, checkpoint.remote) are written
 * absolute against the working directory ($PWD when it names it: a
 * symlinked directory as the user sees it), so the run means the same files
 * from anywhere (--resume, transom sample, a worker an agent starts). NULL on
 * error (tr_error()). */
char *job_dump(lua_State *L, const job_config *cfg);
/* The directory job_dump writes paths against, as the user sees it: $PWD
 * when it is an absolute path without "." or ".." components that names
 * the same directory as "." (st_dev, st_ino), else getcwd's. buf (n bytes)
 * or NULL when neither is known. */
const char *job_working_dir(char *buf, size_t n);
/* Where key came from, for an error found after job_load (a data file that
 * cannot be opened), as the checker's own errors say it: "--set data=x:
 * key 'data'" for a --set item, else "FILE:LINE: key 'data'" (or "FILE: key
 * 'data'"). Writes at most n bytes into buf and returns it; leaves tr_error()
 * and L's stack as they were. cfg: one job_load filled, on this L. */
const char *job_where(lua_State *L, const job_config *cfg, const char *key, char *buf, size_t n);
/* Prints the schema (for --help). */
int job_help(lua_State *L);

#endif
