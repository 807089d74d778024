/* test_util.c — the lock and process helpers of core/base/util.c that the
 * start gate (`transom run`) and `transom prepare` name and time their
 * waits by: tr_flock_holder finds the pid that holds an flock on a file
 * (this process, also while a child waits for it; then the child, once it
 * has it), 0 for a file nobody locks and 0 once the holder is gone;
 * tr_proc_state / tr_pid_running follow the child through running,
 * stopped (SIGSTOP), running again and gone, and say 0 for no pid.
 * tr_lock_wait_step, the wait all three share, says whom it waits for once
 * and gives up past max_s, or past wait_s only once the holder is stopped.
 * tr_write_file_atomic: a second writer of one path waits for the first
 * (which holds path.tmp locked from its open to its rename) instead of
 * writing into the same file, and a killed writer's leftover path.tmp is
 * written over. tr_lock_file: a second taker waits for the first, and locks
 * the file then at that name (the first removes its own as it lets go). */
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
  /* a wait for it (each look forced now, not a second on): said once, with
   * its pid; given up past max_s; not past wait_s while it runs */
  char who[32];
  snprintf(who, sizeof who, " (pid %d)", (int)child);
  tr_lock_wait w;
  tr_lock_wait_init(&w);
  w.t_look = w.t0;
  CHECK(tr_lock_wait_step(&w, fd2, 0, 100) == TR_WAIT_SAY && strcmp(w.who, who) == 0 && !w.stopped,
        "a running holder past wait_s: not said, or who '%s'", w.who);
  CHECK(tr_lock_wait_step(&w, fd2, 0, 100) == TR_WAIT_ON, "looked again within the second");
  w.t_look = w.t0;
  CHECK(tr_lock_wait_step(&w, fd2, 0, 100) == TR_WAIT_ON, "said twice");
  tr_lock_wait_init(&w);
  w.t_look = w.t0;
  usleep(1000);
  CHECK(tr_lock_wait_step(&w, fd2, 100, 0) == TR_WAIT_GIVE_UP && !w.stopped && w.waited > 0,
        "a running holder past max_s: not given up");
  kill(child, SIGSTOP);
  CHECK(wait_until(is_stopped, child), "never seen stopped (state %c)", tr_proc_state(child));
  CHECK(!tr_pid_running(child), "a stopped child counts as running");
  tr_lock_wait_init(&w);
  w.t_look = w.t0;
  usleep(1000);
  CHECK(tr_lock_wait_step(&w, fd2, 100, 1000) == TR_WAIT_SAY && w.stopped, "a stopped holder within wait_s");
  w.t_look = w.t0;
  CHECK(tr_lock_wait_step(&w, fd2, 0, 1000) == TR_WAIT_GIVE_UP && w.stopped && strcmp(w.who, who) == 0,
        "a stopped holder past wait_s: not given up");
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

#define MIB (1 << 20)

/* Whether the file at fd holds n bytes, all c. */
static int all_of(int fd, size_t n, char c) {
  static char buf[MIB];
  struct stat st;
  if (fstat(fd, &st) != 0 || (size_t)st.st_size != n || n > sizeof buf) return 0;
  if (pread(fd, buf, n, 0) != (ssize_t)n) return 0;
  for (size_t i = 0; i < n; i++)
    if (buf[i] != c) return 0;
  return 1;
}

static void writers(const char *dir) {
  char path[128], tmp[140];
  snprintf(path, sizeof path, "%s/out", dir);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  static char mine[MIB], theirs[MIB];
  memset(mine, 'p', sizeof mine);
  memset(theirs, 'c', sizeof theirs);

  /* a killed writer's leftover (nobody holds it) */
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  CHECK(fd >= 0 && write(fd, mine, 200) == 200, "a leftover: %s", strerror(errno)); /* longer than what follows */
  close(fd);
  CHECK(tr_write_file_atomic(path, theirs, 100) == 0, "over a leftover .tmp: %s", tr_error());
  fd = open(path, O_RDONLY);
  CHECK(fd >= 0 && all_of(fd, 100, 'c'), "over a leftover .tmp: not the 100 bytes written");
  close(fd);
  CHECK(access(tmp, F_OK) != 0, "the .tmp left behind");

  /* this process is a writer in the middle of its write, as
   * tr_write_file_atomic holds it; a child writes the same path */
  fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  CHECK(fd >= 0 && flock(fd, LOCK_EX) == 0, "the first writer's lock: %s", strerror(errno));
  CHECK(write(fd, mine, sizeof mine) == (ssize_t)sizeof mine, "the first writer's bytes: %s", strerror(errno));
  int go[2];
  CHECK(pipe(go) == 0, "pipe: %s", strerror(errno));
  fflush(NULL);
  pid_t child = fork();
  if (child == 0) {
    close(fd);
    close(go[0]);
    if (write(go[1], "w", 1) != 1) _exit(2);
    _exit(tr_write_file_atomic(path, theirs, sizeof theirs) == 0 ? 0 : 1);
  }
  CHECK(child > 0, "fork: %s", strerror(errno));
  if (child <= 0) return;
  close(go[1]);
  char c;
  CHECK(read(go[0], &c, 1) == 1, "the child never started its write");
  close(go[0]);
  usleep((useconds_t)(300000 * test_time_scale())); /* its write would land in this window */
  CHECK(all_of(fd, sizeof mine, 'p'), "the second writer wrote into the first one's file before its rename");
  int status = -1;
  CHECK(waitpid(child, &status, WNOHANG) == 0, "the second writer finished while the first held the file");
  CHECK(fsync(fd) == 0 && rename(tmp, path) == 0, "the first writer's rename: %s", strerror(errno));
  close(fd); /* its lock goes: the child opens the name anew */
  CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0,
        "the second writer failed (status %d)", status);
  fd = open(path, O_RDONLY);
  CHECK(fd >= 0 && all_of(fd, sizeof theirs, 'c'), "the path does not hold the second writer's bytes alone");
  close(fd);
  CHECK(access(tmp, F_OK) != 0, "the .tmp left behind after two writers");
  unlink(path);
}

/* tr_lock_file: a second taker waits for the first (one export's weights
 * never beside another's config.json); the first removes the file as it
 * lets go, so the second, which waited on that file, must open the name
 * anew and lock the file now there; a clean end leaves no file. */
static void lock_files(const char *dir) {
  char path[128];
  snprintf(path, sizeof path, "%s/export.lock", dir);
  int lock = -1;
  CHECK(tr_lock_file(path, &lock) == 0 && lock >= 0, "the first lock: %s", tr_error());
  int res[2];
  CHECK(pipe(res) == 0, "pipe: %s", strerror(errno));
  fflush(NULL);
  pid_t child = fork();
  if (child == 0) { /* takes it, says whether it holds the file at that name, lets go */
    close(lock);
    close(res[0]);
    int fd = -1;
    if (write(res[1], "s", 1) != 1) _exit(2);
    char ok = tr_lock_file(path, &fd) == 0 && fd >= 0 && tr_fd_at_path(fd, path) ? 'y' : 'n';
    tr_unlock_file(fd, path);
    _exit(write(res[1], &ok, 1) == 1 ? 0 : 2);
  }
  CHECK(child > 0, "fork: %s", strerror(errno));
  if (child <= 0) return;
  close(res[1]);
  char ok = 0;
  CHECK(read(res[0], &ok, 1) == 1 && ok == 's', "the second taker never started");
  usleep((useconds_t)(300000 * test_time_scale())); /* its lock would land in this window */
  int status = -1;
  CHECK(waitpid(child, &status, WNOHANG) == 0, "the second taker went on while the first held the lock");
  tr_unlock_file(lock, path);
  ok = 0;
  CHECK(read(res[0], &ok, 1) == 1 && ok == 'y', "the second taker holds a removed file, not the one at '%s' (%c)", path,
        ok);
  close(res[0]);
  CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0, "status %d", status);
  CHECK(access(path, F_OK) != 0, "the lock file left behind");
}

int main(void) {
  char dir[] = "/tmp/test_util.XXXXXX", path[64], other[64];
  CHECK(mkdtemp(dir) != NULL, "mkdtemp: %s", strerror(errno));
  snprintf(path, sizeof path, "%s/lock", dir);
  snprintf(other, sizeof other, "%s/other", dir);
  holder(path, other);
  writers(dir);
  lock_files(dir);
  unlink(path);
  unlink(other);
  rmdir(dir);
  return check_report("test_util");
}
