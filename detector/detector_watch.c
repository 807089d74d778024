/* detector_watch.c — hot reload: inotify on the policy directory, driven by
 * the operator's libevent loop, debounced.
 *
 * Editors save in different ways: in place (IN_CLOSE_WRITE), by writing a
 * temporary file and renaming it over the old one (IN_MOVED_TO), or by
 * moving the old one away and creating a new one (IN_CREATE, then
 * IN_CLOSE_WRITE). Any of these on rules.lua or actions.lua (or a queue
 * overflow) (re)arms a timer; when it fires, det_reload loads whichever file's
 * bytes changed. It does not load anything itself (detector_lua.c does).
 */
#include <errno.h>
#include <event2/event.h>
#include <string.h>
#include <sys/inotify.h>
#include <unistd.h>

#include "detector_internal.h"
#include "util.h"

static int is_policy_file(const detector *d, const char *name) {
  for (int i = 0; i < DET_NFILES; i++)
    if (strcmp(name, d->files[i].name) == 0) return 1;
  return 0;
}

static void debounce_cb(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  detector *d = arg;
  if (d->busy) return;
  d->busy = 1;
  det_reload(d, 0, 0); /* failures are events; the version in force stays */
  d->busy = 0;
}

static void inotify_cb(evutil_socket_t fd, short what, void *arg) {
  (void)what;
  detector *d = arg;
  char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
  int relevant = 0;
  for (;;) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) break; /* EAGAIN: drained */
    for (char *p = buf; p < buf + n;) {
      const struct inotify_event *ev = (const struct inotify_event *)p;
      if (ev->mask & IN_Q_OVERFLOW) relevant = 1;
      if (ev->len > 0 && is_policy_file(d, ev->name)) relevant = 1;
      if (ev->mask & IN_IGNORED) {
        detector_event e = {.type = DET_EV_RELOAD_FAILED, .kind = "policy_reload_failed", .step = -1, .worker = -1,
                            .file = d->policy_dir,
                            .detail = "the policy directory went away: no more hot reloads; the policies in force stay"};
        det_emit(d, &e);
      }
      p += sizeof(struct inotify_event) + ev->len;
    }
  }
  if (relevant) {
    struct timeval tv = {d->o.debounce_ms / 1000, (d->o.debounce_ms % 1000) * 1000};
    evtimer_add(d->debounce_ev, &tv); /* re-adding a pending timer moves it: the debounce */
  }
}

int detector_watch(detector *d, struct event_base *base) {
  if (d->ino_fd >= 0) return tr_fail(TR_ESTATE, "detector_watch: already watching");
  int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  if (fd < 0) return tr_fail(TR_EIO, "inotify_init1: %s", strerror(errno));
  if (inotify_add_watch(fd, d->policy_dir, IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE) < 0) {
    int rc = tr_fail(TR_EIO, "cannot watch %s: %s", d->policy_dir, strerror(errno));
    close(fd);
    return rc;
  }
  d->ino_ev = event_new(base, fd, EV_READ | EV_PERSIST, inotify_cb, d);
  d->debounce_ev = evtimer_new(base, debounce_cb, d);
  if (!d->ino_ev || !d->debounce_ev || event_add(d->ino_ev, NULL) != 0) {
    if (d->ino_ev) event_free(d->ino_ev);
    if (d->debounce_ev) event_free(d->debounce_ev);
    d->ino_ev = d->debounce_ev = NULL;
    close(fd);
    return tr_fail(TR_ENOMEM, "detector_watch: cannot register with the event loop");
  }
  d->ino_fd = fd;
  d->base = base;
  return TR_OK;
}

void detector_unwatch(detector *d) {
  if (d->ino_fd < 0) return;
  event_free(d->ino_ev);
  event_free(d->debounce_ev);
  close(d->ino_fd);
  d->ino_ev = d->debounce_ev = NULL;
  d->ino_fd = -1;
  d->base = NULL;
}
