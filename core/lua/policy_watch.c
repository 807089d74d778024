/* policy_watch.c — hot reload for every policy file: inotify on the folders
 * of an engine's policies, driven by the caller's libevent loop, debounced.
 *
 * Editors save in different ways: in place (IN_CLOSE_WRITE), by writing a
 * temporary file and renaming it over the old one (IN_MOVED_TO), or by
 * moving the old one away and creating a new one (IN_CREATE, then
 * IN_CLOSE_WRITE). Any event in a watched folder (or a queue overflow)
 * (re)arms a timer, whatever the name: a policy file may be a symlink
 * whose target changes in another folder (watched too: the folder the file
 * resolves to, looked up again at every reload), or a Kubernetes ConfigMap
 * mount, where an update renames only `..data`; a reload skips files whose
 * bytes did not change, so other files' events cost a read and a hash.
 * When the timer fires, on_change runs (or policy_engine_reload without
 * force, which loads whichever file's bytes changed). It does not load
 * anything itself (policy.c does). Called by the detector and the operator
 * through policy_watch; everything runs on their event loop.
 */
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <event2/event.h>
#include <string.h>
#include <sys/inotify.h>
#include <unistd.h>

#include "policy_internal.h"
#include "util.h"

#define WATCH_MASK (IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE)

/* Watches the folder p's file resolves to when it is a symlink into
 * another folder (the same wd again if already watched). */
static void watch_target(policy_engine *e, policy *p) {
  char path[PATH_MAX + 64], real[PATH_MAX], rdir[PATH_MAX];
  snprintf(path, sizeof path, "%s/%s", p->dir, p->name);
  if (!realpath(path, real) || !realpath(p->dir, rdir)) return; /* not there (yet): the folder's events say when */
  char *tdir = dirname(real);
  if (strcmp(tdir, rdir) == 0) return;
  int wd = inotify_add_watch(e->ino_fd, tdir, IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE);
  if (wd >= 0) p->twd = wd;
}

static void debounce_cb(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  policy_engine *e = arg;
  if (e->loading) return;
  if (e->o.on_change) e->o.on_change(e->o.ud);
  else policy_engine_reload(e, 0); /* failures are on_reload calls; the versions in force stay */
  for (policy *p = e->policies; p; p = p->next) watch_target(e, p); /* a link may point elsewhere now */
}

/* The folder of watch wd went away: say so once per folder. */
static void folder_lost(policy_engine *e, int wd) {
  const char *dir = NULL;
  for (policy *p = e->policies; p; p = p->next) {
    if (p->twd == wd) p->twd = -1; /* a symlink's target folder: the link's own folder still says when it moves */
    if (p->wd == wd) {
      if (!dir) dir = p->dir;
      p->wd = -1;
    }
  }
  if (!dir || !e->o.on_reload) return;
  policy_err err;
  memset(&err, 0, sizeof err);
  snprintf(err.msg, sizeof err.msg, "the policy directory went away: no more hot reloads; the policies in force stay");
  policy_reload_info r = {.path = dir, .err = &err, .detail = err.msg};
  e->o.on_reload(e->o.ud, &r);
}

static void inotify_cb(evutil_socket_t fd, short what, void *arg) {
  (void)what;
  policy_engine *e = arg;
  char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
  int relevant = 0;
  for (;;) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) break; /* EAGAIN: drained */
    for (char *c = buf; c < buf + n;) {
      const struct inotify_event *ev = (const struct inotify_event *)c;
      if (ev->mask & (IN_Q_OVERFLOW | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE)) relevant = 1;
      if (ev->mask & IN_IGNORED) folder_lost(e, ev->wd);
      c += sizeof(struct inotify_event) + ev->len;
    }
  }
  if (relevant) {
    struct timeval tv = {e->o.debounce_ms / 1000, (e->o.debounce_ms % 1000) * 1000};
    evtimer_add(e->debounce_ev, &tv); /* re-adding a pending timer moves it: the debounce */
  }
}

int policy_watch_add(policy_engine *e, policy *p) {
  int wd = inotify_add_watch(e->ino_fd, p->dir, WATCH_MASK); /* the same folder twice: the same wd */
  if (wd < 0) return tr_fail(TR_EIO, "cannot watch %s: %s", p->dir, strerror(errno));
  p->wd = wd;
  watch_target(e, p);
  return TR_OK;
}

int policy_watch(policy_engine *e, struct event_base *base) {
  if (e->ino_fd >= 0) return tr_fail(TR_ESTATE, "policy_watch: already watching");
  int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  if (fd < 0) return tr_fail(TR_EIO, "inotify_init1: %s", strerror(errno));
  e->ino_fd = fd;
  for (policy *p = e->policies; p; p = p->next) {
    int rc = policy_watch_add(e, p);
    if (rc) {
      for (policy *q = e->policies; q; q = q->next) q->wd = q->twd = -1;
      close(fd);
      e->ino_fd = -1;
      return rc;
    }
  }
  e->ino_ev = event_new(base, fd, EV_READ | EV_PERSIST, inotify_cb, e);
  e->debounce_ev = evtimer_new(base, debounce_cb, e);
  if (!e->ino_ev || !e->debounce_ev || event_add(e->ino_ev, NULL) != 0) {
    if (e->ino_ev) event_free(e->ino_ev);
    if (e->debounce_ev) event_free(e->debounce_ev);
    e->ino_ev = e->debounce_ev = NULL;
    for (policy *q = e->policies; q; q = q->next) q->wd = q->twd = -1;
    close(fd);
    e->ino_fd = -1;
    return tr_fail(TR_ENOMEM, "policy_watch: cannot register with the event loop");
  }
  e->base = base;
  return TR_OK;
}

void policy_unwatch(policy_engine *e) {
  if (e->ino_fd < 0) return;
  event_free(e->ino_ev);
  event_free(e->debounce_ev);
  close(e->ino_fd);
  e->ino_ev = e->debounce_ev = NULL;
  e->ino_fd = -1;
  e->base = NULL;
  for (policy *p = e->policies; p; p = p->next) p->wd = p->twd = -1;
}
