/* run.h — the `transom run` command (run.c). */
#ifndef TRANSOM_RUN_H
#define TRANSOM_RUN_H

/* argv excludes "transom run"; returns the process exit status. */
int run_main(int argc, char **argv);

#endif
