/* pipeline_run.c — the launcher of a pipelined `transom run` (see
 * pipeline.h): one `transom stage` process per stage on this host, linked
 * in a chain over loopback. The launcher opens every listening socket
 * itself before any stage starts (stage k inherits its own), so stage k-1
 * can connect at once and no port is ever guessed. It waits for all of
 * them; when one fails, the others are stopped (SIGTERM, then SIGKILL after
 * a bounded wait) and reaped: no stage outlives the run.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pipeline.h"
#include "pipeline_stage.h"
#include "util.h"

static int listen_local(int *port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 4) ||
      getsockname(fd, (struct sockaddr *)&a, &len)) {
    if (fd >= 0) close(fd);
    return tr_fail(TR_EIO, "pipeline: cannot listen on loopback: %s", strerror(errno));
  }
  *port = ntohs(a.sin_port);
  return fd;
}

static pid_t spawn_stage(const char *self, const char *dir, int k, int lfd, int next_port, int threads) {
  pid_t pid = fork();
  if (pid != 0) return pid;
  char ks[16], fds[16], nx[64], th[16];
  snprintf(ks, sizeof ks, "%d", k);
  snprintf(fds, sizeof fds, "%d", lfd);
  snprintf(nx, sizeof nx, "127.0.0.1:%d", next_port);
  snprintf(th, sizeof th, "%d", threads);
  if (lfd >= 0) fcntl(lfd, F_SETFD, 0); /* this one stays open across exec */
  execl(self, "transom", "stage", "--run", dir, "--stage", ks, "--listen-fd", fds, "--next", nx, "--threads", th,
        (char *)NULL);
  _exit(127); /* ok-exit: exec failed in the child */
}

/* Stops the live stages: SIGTERM, a bounded wait, then SIGKILL; reaps all,
 * keeping each one's status. A short grace first: when one stage dies its
 * neighbours fail on their own a moment later, and their statuses say
 * more than a SIGTERM would. */
static void stop_all(pid_t *pids, int *status, int S) {
  for (int round = 0; round < 2; round++) {
    if (round == 1)
      for (int k = 0; k < S; k++)
        if (pids[k] > 0) kill(pids[k], SIGTERM);
    double end = tr_now() + (round ? 5.0 : 1.0);
    for (;;) {
      int live = 0;
      for (int k = 0; k < S; k++)
        if (pids[k] > 0) {
          if (waitpid(pids[k], &status[k], WNOHANG) == pids[k]) pids[k] = 0;
          else live++;
        }
      if (!live) return;
      if (tr_now() > end) break;
      struct timespec ts = {0, 20 * 1000 * 1000};
      nanosleep(&ts, NULL);
    }
  }
  for (int k = 0; k < S; k++)
    if (pids[k] > 0) {
      kill(pids[k], SIGKILL);
      waitpid(pids[k], &status[k], 0);
      pids[k] = 0;
    }
}

/* Why the pipeline failed: a stage killed by a signal (the cause; its
 * neighbours only lost their link), else the first that exited non-zero. */
static int failure(const int *status, int S) {
  for (int k = 0; k < S; k++)
    if (WIFSIGNALED(status[k]) && WTERMSIG(status[k]) != SIGTERM)
      return tr_fail(TR_EIO, "pipeline stage %d was killed by signal %d", k, WTERMSIG(status[k]));
  for (int k = 0; k < S; k++)
    if (!WIFEXITED(status[k]) || WEXITSTATUS(status[k]) != 0)
      return tr_fail(TR_EIO, "pipeline stage %d exited with status %d", k,
                     WIFEXITED(status[k]) ? WEXITSTATUS(status[k]) : 128 + WTERMSIG(status[k]));
  return TR_OK;
}

static int threads_per_stage(const job_config *cfg, int S) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int total = cfg->threads > 0 ? (int)cfg->threads : (int)(cores > 0 ? cores : 1);
  int t = total / S;
  return t > 0 ? t : 1;
}

int pipeline_run(lua_State *L, const job_config *cfg, const char *dir) {
  (void)L;
  int S = (int)cfg->pipe_stages, lfd[PIPE_MAX_STAGES] = {0}, port[PIPE_MAX_STAGES] = {0}, rc = TR_OK;
  pid_t pids[PIPE_MAX_STAGES] = {0};
  char self[PATH_MAX];
  ssize_t sn = readlink("/proc/self/exe", self, sizeof self - 1);
  if (sn <= 0) return tr_fail(TR_EIO, "cannot find the transom executable");
  self[sn] = 0;
  for (int k = 0; k < S; k++) lfd[k] = -1;
  for (int k = 1; k < S && !rc; k++)
    if ((lfd[k] = listen_local(&port[k])) < 0) rc = lfd[k];
  printf("pipeline: %d stage(s), %lld micro-batch(es) of %lld sequences, 1F1B over loopback\n", S,
         (long long)cfg->pipe_micro_batches, (long long)(cfg->batch_size / cfg->pipe_micro_batches));
  fflush(stdout);
  int threads = threads_per_stage(cfg, S);
  for (int k = 0; k < S && !rc; k++)
    if ((pids[k] = spawn_stage(self, dir, k, lfd[k], k + 1 < S ? port[k + 1] : 0, threads)) < 0) {
      pids[k] = 0;
      rc = tr_fail(TR_EIO, "pipeline: fork: %s", strerror(errno));
    }
  for (int k = 0; k < S; k++)
    if (lfd[k] >= 0) close(lfd[k]);
  int status[PIPE_MAX_STAGES] = {0}, failed = 0;
  for (int live = rc ? 0 : S; live > 0 && !failed;) {
    int st;
    pid_t p = waitpid(-1, &st, 0);
    if (p < 0 && errno == EINTR) continue;
    if (p < 0) break;
    for (int k = 0; k < S; k++)
      if (pids[k] == p) {
        pids[k] = 0;
        status[k] = st;
        live--;
        failed = !WIFEXITED(st) || WEXITSTATUS(st) != 0;
      }
  }
  stop_all(pids, status, S);
  if (!rc) rc = failure(status, S);
  return rc;
}
