/* operator.h — the multi-replica `transom run` (operator.c). */
#ifndef TRANSOM_OPERATOR_H
#define TRANSOM_OPERATOR_H

#include <lua.h>

#include "job.h"

/* Runs the job with cfg->replicas worker processes until it finishes or is
 * stopped; dir exists and holds job.lua (transom run writes it once
 * operator_check_env passed). resume: workers start from the
 * newest checkpoint. Returns 0 when the job finished or was stopped cleanly
 * (a checkpoint can resume it), else a negative error. Main thread only. */
int operator_run(lua_State *L, job_config *cfg, const char *dir, int resume);

/* What operator_run needs of its environment, for a check before anything
 * is written: hosts > 0 needs MASTER_ADDR (where the agents reach the
 * operator); MASTER_PORT, when set, must be a port number. hosts_from names
 * where cfg->hosts came from (the job file, or the --set item) in the
 * message. 0, or TR_EINVAL with tr_error() set. Any thread. */
int operator_check_env(const job_config *cfg, const char *hosts_from);

#endif
