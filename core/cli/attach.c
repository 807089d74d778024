/* attach.c — `transom attach RUN [-e EXPR]`: a Lua REPL inside the live
 * operator, over RUN/control.sock (see operator_repl.c for the protocol).
 * Line editing from libedit: TAB completes the controls' names, and the
 * history is kept in RUN/attach_history from one attach to the next.
 * Detaching (^D), an error, or this process dying never affects the job.
 */
#include <editline/readline.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "util.h"

int attach_main(int argc, char **argv);

static const char usage[] =
    "usage: transom attach RUN [-e EXPR]\n"
    "\n"
    "Opens a Lua REPL inside the live job in RUN (its operator's VM). help()\n"
    "lists the controls: workers(), metrics(w), events(n), evict(w),\n"
    "checkpoint(), rollback(step), set('lr', x), reload(). -e runs one\n"
    "expression and exits (status 1 if it raised). TAB completes the\n"
    "controls' names; the history lives in RUN/attach_history. ^D detaches.\n";

/* --- completion: the operator's controls (operator_repl.c) --- */

static const char *const controls[] = {"workers(", "metrics(", "series(", "anomalies(", "events(", "evict(",
                                       "checkpoint()", "rollback(", "set('lr', ", "reload()", "help()", "hosts(",
                                       NULL};

static char *control_match(const char *text, int state) {
  static int i;
  if (!state) i = 0;
  for (size_t n = strlen(text); controls[i];)
    if (strncmp(controls[i++], text, n) == 0) return strdup(controls[i - 1]);
  return NULL;
}

static char **complete(const char *text, int start, int end) {
  (void)start;
  (void)end;
  rl_attempted_completion_over = 1; /* no file names */
  return rl_completion_matches(text, control_match);
}

/* Sends one line; prints the reply until its terminator, flushed. Returns 0 done,
 * 1 error, 2 needs more input, -1 connection lost. */
static int exchange(int fd, FILE *in, const char *code) {
  dprintf(fd, "lua %s\n", code);
  char line[65536];
  int rc = -1;
  while (fgets(line, sizeof line, in)) {
    if (line[0] == '\001' || line[0] == '\002') {
      rc = line[0] == '\002' ? 2 : strncmp(line + 1, "ERR", 3) == 0 ? 1 : 0;
      break;
    }
    fputs(line, stdout);
  }
  fflush(stdout); /* each reply as it comes, into a pipe or a file too */
  return rc;
}

int attach_main(int argc, char **argv) {
  static const char *const value_flags[] = {"-e", NULL};
  const char *run = NULL, *expr = NULL;
  for (int i = 0; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(usage, stdout);
      return 0;
    } else if (tr_flag_lacks_value(argc, argv, i, value_flags)) {
      fprintf(stderr, "transom attach: %s needs a value\n%s", argv[i], usage);
      return 2;
    } else if (strcmp(argv[i], "-e") == 0) {
      expr = argv[++i];
    } else if (!run && argv[i][0] != '-') {
      run = argv[i];
    } else {
      fprintf(stderr, "transom attach: unexpected argument '%s'\n%s", argv[i], usage);
      return 2;
    }
  }
  if (!run) {
    fputs(usage, stderr);
    return 2;
  }
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (snprintf(sa.sun_path, sizeof sa.sun_path, "%s/control.sock", run) >= (int)sizeof sa.sun_path) {
    fprintf(stderr, "transom attach: path too long\n");
    return 2;
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    fprintf(stderr, "transom attach: cannot reach %s (is the job running, and is it yours?)\n", sa.sun_path);
    return 1;
  }
  /* a job that refuses us closes at once: our first write must fail with
   * EPIPE and say so below, not kill us silently with SIGPIPE */
  signal(SIGPIPE, SIG_IGN);
  FILE *in = fdopen(dup(fd), "r");
  if (!in) return 1;
  int rc = 0;
  if (expr) { /* line by line, as typed at the prompt: the protocol's lines end at a newline */
    char *all = strdup(expr);
    if (!all) return 1;
    for (char *l = all, *nl; l; l = nl) {
      if ((nl = strchr(l, '\n'))) *nl++ = 0;
      if ((rc = exchange(fd, in, l)) != 0 && rc != 2) break;
    }
    free(all);
    if (rc == 2) fprintf(stderr, "transom attach: incomplete expression\n");
    if (rc < 0) fprintf(stderr, "transom attach: the job closed the connection (was this client refused?)\n");
  } else {
    printf("transom attach: %s (help lists the controls, TAB completes, ^D detaches)\n", run);
    char prompt[32] = "transom> ", hist[PATH_MAX];
    snprintf(hist, sizeof hist, "%s/attach_history", run);
    rl_attempted_completion_function = complete;
    rl_completion_append_character = '\0';
    stifle_history(1000);
    read_history(hist);
    char *line;
    while ((line = readline(prompt))) {
      if (*line) {
        add_history(line);
        write_history(hist); /* at once: a killed client keeps its lines too */
      }
      int r = exchange(fd, in, line);
      free(line);
      if (r < 0) {
        fprintf(stderr, "transom attach: the job closed the connection\n");
        rc = 1;
        break;
      }
      snprintf(prompt, sizeof prompt, "%s", r == 2 ? "     ... " : "transom> ");
    }
    if (!line) putchar('\n');
  }
  fclose(in);
  close(fd);
  return rc < 0 ? 1 : rc == 2 ? 1 : rc;
}
