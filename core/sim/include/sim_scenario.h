/* sim_scenario.h — a scenario file of `transom sim` as C reads it.
 *
 * The schema, defaults and checks live in lua/transom/sim.lua; this runs
 * them (under the declarative-file budget, lua_host_pcall_file) and copies
 * the result into C. Costs in the file may be functions of the job's size:
 * sim_scenario_resolve calls them for one GPU count and fills a
 * sim_config. Errors name the file, the line and the key (tr_error()).
 * One thread per lua_State; nothing is written anywhere.
 */
#ifndef TRANSOM_SIM_SCENARIO_H
#define TRANSOM_SIM_SCENARIO_H

#include <lua.h>
#include <stdint.h>

#include "sim.h"

#define SIM_MAX_SWEEP 64
#define SIM_MAX_REFS 16

typedef struct { /* a published point drawn beside the simulation */
  int64_t gpus;
  double ettr;
  sim_mode mode;
  char label[200];
} sim_reference;

typedef struct {
  char path[1024];
  char name[128];
  int64_t seeds;
  int nsweep;
  int64_t sweep[SIM_MAX_SWEEP]; /* GPU counts; none: just the file's size */
  int64_t sens_gpus;            /* 0: no sensitivity analysis */
  double sens_factor;
  int nrefs;
  sim_reference refs[SIM_MAX_REFS];
  int lua_ref; /* the checked table in L's registry (sim_scenario_free) */
} sim_scenario;

/* Loads and checks path with `--set key=value` items. TR_OK, or TR_ELUA /
 * TR_EINVAL with "file:line: key '...' ..." in tr_error(). */
int sim_scenario_load(lua_State *L, const char *path, const char *const *sets, int nsets, sim_scenario *s);

/* The configuration at `gpus` GPUs (0: the file's own job.replicas). TR_OK,
 * or an error naming the file, the key and the GPU count (a cost function
 * that raised, returned a bad value or ran past the budget). */
int sim_scenario_resolve(lua_State *L, const sim_scenario *s, int64_t gpus, sim_config *c);

void sim_scenario_free(lua_State *L, sim_scenario *s);

/* Prints the schema (transom sim --help). */
int sim_scenario_help(lua_State *L);

#endif
