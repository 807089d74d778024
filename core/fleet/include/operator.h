/* operator.h — the multi-replica `transom run` (operator.c). */
#ifndef TRANSOM_OPERATOR_H
#define TRANSOM_OPERATOR_H

#include <lua.h>

#include "job.h"

/* Runs the job with cfg->replicas worker processes until it finishes or is
 * stopped; dir exists and holds job.lua. resume: workers start from the
 * newest checkpoint. Returns 0 when the job finished or was stopped cleanly
 * (a checkpoint can resume it), else a negative error. Main thread only. */
int operator_run(lua_State *L, job_config *cfg, const char *dir, int resume);

#endif
