/* run.h — the `transom run` command (run.c). */
#ifndef TRANSOM_RUN_H
#define TRANSOM_RUN_H

#include <stdio.h>

/* argv excludes "transom run"; returns the process exit status. */
int run_main(int argc, char **argv);

/* Generates ntok tokens to out from the weights the run in dir saved
 * (dir/model.safetensors), with the model and vocabulary of dir/job.lua
 * and dir/vocab.json (token shards: dir/tokenizer.bpe, or token ids).
 * prompt NULL: the job's sample_prompt; seed < 0: the job's seed. 0 or a
 * negative error (tr_error() says why). `transom sample`, and the closing
 * sample of a run whose workers saved the weights (a pipelined run). */
int run_sample(const char *dir, const char *prompt, long long ntok, double temp, long long seed, FILE *out);

#endif
