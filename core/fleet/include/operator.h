/* operator.h — the multi-replica `transom run` (operator.c). */
#ifndef TRANSOM_OPERATOR_H
#define TRANSOM_OPERATOR_H

#include <lua.h>

#include "job.h"

/* Runs the job with cfg->replicas worker processes until it finishes or is
 * stopped; dir exists and holds job.lua (transom run writes it once
 * operator_check_env passed). resume: workers start from the
 * newest checkpoint. start_gate: an fd (-1: none) closed once
 * dir/control.sock listens, or the start failed: transom run's start gate
 * (run.c), which other starts wait on until a probe can find us. Returns 0 when the job finished or was stopped cleanly
 * (a checkpoint can resume it; *stopped set to 1 then), else a negative
 * error. Main thread only. */
int operator_run(lua_State *L, job_config *cfg, const char *dir, int resume, int start_gate, int *stopped);

/* What operator_run needs of its environment, for a check before anything
 * is written: hosts > 0 needs MASTER_ADDR (where the agents reach the
 * operator); MASTER_PORT, when set, must be a port number. hosts_from names
 * where cfg->hosts came from (the job file, or the --set item) in the
 * message. 0, or TR_EINVAL with tr_error() set. Any thread. */
int operator_check_env(const job_config *cfg, const char *hosts_from);

/* Who holds RUN/control.sock, asked before a run starts in dir. */
typedef enum {
  OPERATOR_NONE,    /* no socket, or nobody listens on it (its operator died) */
  OPERATOR_SILENT,  /* it took the connection but sent no answer in time: stopped or hung */
  OPERATOR_ANSWERS, /* a live operator answered its "status" */
  OPERATOR_REFUSED, /* it refused us (another user's: connect not permitted, or closed unanswered): in use */
} operator_presence;

/* Connects to dir/control.sock and asks for its "status", waiting up to
 * timeout_s for the first byte of the answer. *pid, *uid: the process
 * that listens there and its user (SO_PEERCRED; 0 and -1 when unknown).
 * No answer in time from a process that is not stopped (/proc/PID/stat:
 * running, only slow) is waited for up to PROBE_MORE_S longer; a stopped
 * (T, t) or gone one is silent at once. Never changes the
 * job. Any thread; blocks up to timeout_s. */
operator_presence operator_probe(const char *dir, double timeout_s, int *pid, int *uid);

#endif
