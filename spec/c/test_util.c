/* test_util.c — the lock and process helpers of core/base/util.c that the
 * start gate (`transom run`) and `transom prepare` name and time their
 * waits by: tr_flock_holder finds the pid that holds an flock on a file
 * (this process, also while a child waits for it; then the child, once it
 * has it), 0 for a file nobody locks and 0 once the holder is gone;
 * tr_proc_state / tr_pid_running follow the child through running,
 * stopped (SIGSTOP), running again and gone, and say 0 for no pid. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "util.h"

static unsigned long long lock_ino;

/* Whether /proc/locks shows a waiter ("N: -> FLOCK ...") on lock_ino. */
static int waiter_seen(int unused) {
  (void)unused;
  FILE *f = fopen("/proc/locks", "r");
  if (!f) return 0;
  char line[256];
  int seen = 0;
  while (!seen && fgets(line, sizeof line, f)) {
    const char *p = strstr(line, "-> FLOCK");
    unsigned maj, min;
    unsigned long long ino;
    seen = p && sscanf(p, "-> FLOCK %*s %*s %*d %x:%x:%llu", &maj, &min, &ino) == 3 && ino == lock_ino;
  }
  fclose(f);
  return seen;
}

/* Polls (bounded) until cond(pid) holds. */
static int wait_until(int (*cond)(int), int pid) {
  for (int i = 0; i < (int)(500 * test_time_scale()); i++) {
    if (cond(pid)) return 1;
    usleep(10000);
  }
  return 0;
}

static int is_stopped(int pid) { return tr_proc_state(pid) == 'T' || tr_proc_state(pid) == 't'; }
static int is_running(int pid) { return tr_pid_running(pid); }

static void holder(const char *path, const char *other) {
  int fd1 = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600), fd2 = open(path, O_RDONLY | O_CLOEXEC);
  int free_fd = open(other, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  CHECK(fd1 >= 0 && fd2 >= 0 && free_fd >= 0, "open %s: %s", path, strerror(errno));
  CHECK(tr_flock_holder(fd2) == 0, "no holder before the lock: %d", tr_flock_holder(fd2));
  CHECK(flock(fd1, LOCK_EX | LOCK_NB) == 0, "flock: %s", strerror(errno));
  struct stat st;
  lock_ino = fstat(fd1, &st) == 0 ? (unsigned long long)st.st_ino : 0;
  CHECK(tr_flock_holder(fd2) == (int)getpid(), "holder %d, this process is %d", tr_flock_holder(fd2), (int)getpid());
  CHECK(tr_flock_holder(free_fd) == 0, "a file nobody locks has holder %d", tr_flock_holder(free_fd));
  fflush(NULL);
  pid_t child = fork();
  if (child == 0) { /* waits for the lock, then holds it until killed */
    close(fd1);     /* (a forked copy of the holder's fd would keep the parent's lock alive) */
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0 || flock(fd, LOCK_EX) != 0) _exit(1);
    for (;;) pause();
  }
  CHECK(child > 0, "fork: %s", strerror(errno));
  if (child <= 0) return;
  CHECK(wait_until(waiter_seen, 0), "the child never waited on the lock (no -> FLOCK line)");
  CHECK(tr_flock_holder(fd2) == (int)getpid(), "with a waiter: holder %d, this process is %d", tr_flock_holder(fd2),
        (int)getpid());
  close(fd1); /* the child takes it */
  int got = 0;
  for (int i = 0; i < (int)(500 * test_time_scale()) && !got; i++) {
    got = tr_flock_holder(fd2) == (int)child;
    if (!got) usleep(10000);
  }
  CHECK(got, "after the handover: holder %d, the child is %d", tr_flock_holder(fd2), (int)child);

  /* the child's state: running (sleeping in pause), stopped, running, gone */
  CHECK(tr_pid_running(child), "a sleeping child counts as running (state %c)", tr_proc_state(child));
  kill(child, SIGSTOP);
  CHECK(wait_until(is_stopped, child), "never seen stopped (state %c)", tr_proc_state(child));
  CHECK(!tr_pid_running(child), "a stopped child counts as running");
  kill(child, SIGCONT);
  CHECK(wait_until(is_running, child), "never seen running again (state %c)", tr_proc_state(child));
  kill(child, SIGKILL);
  waitpid(child, NULL, 0);
  CHECK(tr_proc_state(child) == 0 && !tr_pid_running(child), "a reaped child: state %c", tr_proc_state(child));
  CHECK(tr_flock_holder(fd2) == 0, "the lock outlived its holder: %d", tr_flock_holder(fd2));
  CHECK(tr_proc_state(0) == 0 && !tr_pid_running(0) && !tr_pid_running(-1), "no pid");
  CHECK(tr_proc_state((int)getpid()) == 'R', "this process: state %c", tr_proc_state((int)getpid()));
  close(fd2);
  close(free_fd);
}

int main(void) {
  char dir[] = "/tmp/test_util.XXXXXX", path[64], other[64];
  CHECK(mkdtemp(dir) != NULL, "mkdtemp: %s", strerror(errno));
  snprintf(path, sizeof path, "%s/lock", dir);
  snprintf(other, sizeof other, "%s/other", dir);
  holder(path, other);
  unlink(path);
  unlink(other);
  rmdir(dir);
  return check_report("test_util");
}
