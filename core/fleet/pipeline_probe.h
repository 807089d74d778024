/* pipeline_probe.h — the probes a stage worker runs at start (private to
 * core/fleet; pipeline_probe.c): its speed, its links to every other
 * worker, and the PROBE line that reports them to the launcher.
 */
#ifndef TRANSOM_PIPELINE_PROBE_H
#define TRANSOM_PIPELINE_PROBE_H

#include <stddef.h>

#include "job.h"
#include "pipeline_plan.h"
#include "pipeline_stage.h"

typedef struct {
  const job_config *cfg;
  const pipe_plan *plan; /* the job's workers (zones: the emulated links) */
  int w;                 /* this worker */
  int lfd;               /* its listening socket */
  const int *ports;      /* every worker's port (at plan->addr) */
  double timeout;        /* a probe's wait for its peer (hang_seconds) */
  double hello_timeout;  /* the server's wait for a connection's HELLO (0: PIPE_PROBE_HELLO_S, at most timeout) */
} pipe_probe_ctx;

/* How long the probe server waits for a new connection's HELLO before it
 * closes it and takes the next: a prober sends HELLO as soon as it is
 * connected, so a connection that says nothing this long is none of the
 * workers (and must not hold the lower workers' probes for hang_seconds). */
#define PIPE_PROBE_HELLO_S 5.0

/* FLOP/s of the whole micro-batch graph on this worker (emulation on). */
int pipe_probe_speed(pipe_stage *s, double *flops_s);
/* The thread that answers the probes of workers 0..w-1: started first
 * thing, joined (its error returned) before this worker reports. Any local
 * process can connect: a connection whose HELLO names no lower worker not
 * served yet, or that sends no HELLO within the HELLO wait (hello_timeout),
 * is closed (a line on stderr says why) and not counted; the server then
 * takes the next connection. */
typedef struct pipe_probe_server pipe_probe_server;
pipe_probe_server *pipe_probe_serve(const pipe_probe_ctx *c);
int pipe_probe_serve_join(pipe_probe_server *sv);
/* Bandwidth (bytes/s; 0: too fast to tell) and one-way latency to workers
 * w+1..S-1 into bw[j], lat[j]. */
int pipe_probe_links(const pipe_probe_ctx *c, double *bw, double *lat);

int pipe_probe_line(char *out, size_t n, int w, int S, double flops_s, const double *bw, const double *lat);
/* Fills p's measurements from one worker's line. */
int pipe_probe_parse(const char *line, pipe_plan *p);

/* A line (without its newline) from fd within timeout seconds
 * (pipeline_main.c): the control socket between launcher and worker. */
int pipe_read_line(int fd, char *out, size_t n, double timeout);
/* Writes line (with its newline) whole to a control socket (EPIPE, never
 * SIGPIPE, when the peer is gone). 0 or TR_EIO. */
int pipe_write_line(int fd, const char *line);

#endif
