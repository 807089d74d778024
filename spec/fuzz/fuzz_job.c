/* fuzz_job.c — fuzzes job files: job_load (core/train/job.c, which runs
 * lua/transom/job.lua's sandbox and checks) on arbitrary Lua source and
 * --set overrides. Does not build a model or train. Built by CMake with
 * -DTRANSOM_FUZZ=ON; run by run.sh.
 *
 * Input: the job file's text, optionally followed by a NUL byte and up to
 * four --set items, one a line. The text is written to a scratch file (the
 * loader takes a path) and loaded in a fresh VM (lua_host_new, as `transom
 * run` does).
 *
 * A job file may do anything its sandbox allows; job_load must return, with
 * a config or an error message, never crash. What bounds a runaway file:
 *   - instructions and time: job_load's own budget (job.c: 100 million
 *     instructions or 2 s of CPU) stops a loop that never ends, including
 *     one that pcalls the loop (regress-pcall-undefined-global: it ran
 *     30 s under the instruction budget alone);
 *   - memory: this harness caps the VM's allocations at 256 MiB (an
 *     allocator wrapper; Lua then raises "not enough memory", which job_load
 *     reports), so `("x"):rep(1e12)` is an error here, not libFuzzer's
 *     malloc limit. In `transom run` the operating system is the limit;
 *   - time inside one C function (a pathological string.find pattern) is
 *     bounded by neither: run.sh's -timeout would report it.
 *
 * Checked: every error has a message; a job that loads dumps (job_dump) to
 * a file that loads back to the same config, its path-valued keys made
 * absolute (job.h), and dumps again to the same text; a dump refused is
 * one whose paths outgrew their fields once absolute.
 *
 * Coverage: Lua is Debian's library, not instrumented, so libFuzzer would
 * see job.c alone. Each input is therefore first run through job.lua's
 * loader directly under a line hook that counts (previous line, line) pairs
 * of transom's own Lua files into libFuzzer's extra counters, with a budget
 * of its own; then through job_load, which is what is checked (job_load
 * sets its own hook, so the two cannot share one call).
 */
#include <fcntl.h>
#include <lauxlib.h>
#include <lua.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fuzz.h"
#include "job.h"
#include "lua_host.h"
#include "util.h"

#define LUA_CAP ((size_t)256 << 20)

/* --- a capped allocator around the VM's own --- */

typedef struct {
  lua_Alloc f;
  void *ud;
  size_t used;
} capped;

static void *capped_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  capped *c = ud;
  size_t old = ptr ? osize : 0; /* for a new block osize is the object's type */
  if (nsize > old && c->used - old + nsize > LUA_CAP) return NULL; /* only growth may fail */
  void *p = c->f(c->ud, ptr, osize, nsize);
  if (nsize == 0 || p) c->used = c->used - old + nsize;
  return p;
}

/* --- Lua line coverage, as libFuzzer features --- */

__attribute__((used, section("__libfuzzer_extra_counters"))) static uint8_t lua_cov[1 << 16];
static const char *cov_skip; /* the job file itself: its lines are the input, not coverage */
static int cov_prev;
static long cov_left;
static double cov_cpu_end;

static double cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void cov_hook(lua_State *L, lua_Debug *ar) {
  if (ar->event == LUA_HOOKCOUNT && ((cov_left -= 1000) <= 0 || cpu_s() > cov_cpu_end)) cov_left = 0;
  if (cov_left <= 0) luaL_error(L, "harness budget spent"); /* at every event from then on: past any pcall */
  if (ar->event == LUA_HOOKCOUNT) return;
  if (!lua_getinfo(L, "S", ar) || strcmp(ar->source + (ar->source[0] == '@'), cov_skip) == 0) return;
  uint32_t h = 2166136261u; /* FNV-1a of the source name, then the line pair */
  for (const char *c = ar->source; *c; c++) h = (h ^ (uint8_t)*c) * 16777619u;
  h = (h ^ (uint32_t)cov_prev * 2654435761u ^ (uint32_t)ar->currentline) * 16777619u;
  cov_prev = ar->currentline;
  uint8_t *k = &lua_cov[h % sizeof lua_cov];
  if (*k < 255) (*k)++;
}

/* job.lua's load(path, sets) under cov_hook; errors are expected and ignored. */
static void run_covered(lua_State *L, const char *path, const char *const *sets, int nsets) {
  lua_getglobal(L, "require");
  lua_pushliteral(L, "transom.job");
  if (lua_pcall(L, 1, 1, 0) != LUA_OK) {
    lua_settop(L, 0);
    return;
  }
  lua_getfield(L, -1, "load"); /* [job, load] */
  lua_pushstring(L, path);
  lua_createtable(L, nsets, 0);
  for (int i = 0; i < nsets; i++) {
    lua_pushstring(L, sets[i]);
    lua_rawseti(L, -2, i + 1);
  }
  cov_skip = path;
  cov_prev = 0;
  cov_left = 2000000; /* a job that loads takes ~30k instructions, a misspelled key ~150k */
  cov_cpu_end = cpu_s() + 0.5;
  lua_sethook(L, cov_hook, LUA_MASKLINE | LUA_MASKCOUNT, 1000);
  (void)lua_pcall(L, 2, 0, 0);
  lua_sethook(L, NULL, 0, 0);
  lua_settop(L, 0);
}

/* What job_dump must write for one path-valued value v (job.lua's
 * absolute()): each line made absolute against base (cwd, its glob
 * characters backslash-escaped when the line is a glob pattern), a
 * leading "./" dropped, an absolute line as it is; a "lua" key's value
 * that is a name (no '/', not ending in .lua) as it is. */
static void expected_path(char *out, size_t n, const char *v, const char *cwd, int globbed, int lua) {
  size_t len = strlen(v), o = 0;
  if (!*v || (lua && !strchr(v, '/') && !(len >= 4 && strcmp(v + len - 4, ".lua") == 0))) {
    snprintf(out, n, "%s", v);
    return;
  }
  char base[8192];
  size_t b = 0;
  for (const char *c = cwd; *c && b + 2 < sizeof base; c++) {
    if (globbed && strchr("[]*?\\", *c)) base[b++] = '\\';
    base[b++] = *c;
  }
  base[b] = 0;
  out[0] = 0;
  for (const char *line = v; *line;) {
    const char *nl = strchr(line, '\n');
    size_t ll = nl ? (size_t)(nl - line) : strlen(line);
    if (ll == 0) { /* an empty line stays (gsub matches [^\n]+) */
    } else if (line[0] == '/') {
      o += (size_t)snprintf(out + o, o < n ? n - o : 0, "%.*s", (int)ll, line);
    } else {
      const char *p = line;
      while (ll >= 2 && p[0] == '.' && p[1] == '/') p += 2, ll -= 2;
      if (ll == 0 || (ll == 1 && p[0] == '.'))
        o += (size_t)snprintf(out + o, o < n ? n - o : 0, "%s", base);
      else
        o += (size_t)snprintf(out + o, o < n ? n - o : 0, "%s%s%.*s", base, b && base[b - 1] == '/' ? "" : "/",
                              (int)ll, p);
    }
    if (!nl) break;
    if (o + 1 < n) out[o++] = '\n', out[o] = 0;
    line = nl + 1;
  }
}

/* job_dump writes the path-valued keys absolute against the working
 * directory (job.h): each must be exactly expected_path() of want's value;
 * it is then taken over into want, so that the rest compares bit for bit. */
static void take_paths(job_config *want, const job_config *got) {
#define P(k, lua) {offsetof(job_config, k), sizeof(((job_config *)0)->k), #k, lua}
  static const struct {
    size_t off, size;
    const char *key;
    int lua;
  } paths[] = {P(model, 1),     P(data, 0),     P(val_data, 0),    P(tokenizer, 0),     P(init_from, 0),
               P(run_dir, 0),   P(policies, 0), P(ckpt_remote, 0), P(pipe_placement, 1)};
#undef P
  char cwd[4096];
  FUZZ_CHECK(job_working_dir(cwd, sizeof cwd) != NULL, "no working directory");
  /* data.c globs val_data, and data when it is token data (is_token_data) */
  size_t dl = strlen(want->data);
  int token = strcmp(want->data_format, "auto") != 0 ? strcmp(want->data_format, "text") != 0
                                                      : dl >= 4 && strcmp(want->data + dl - 4, ".bin") == 0;
  static char exp[16384];
  for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
    char *w = (char *)want + paths[i].off;
    const char *g = (const char *)got + paths[i].off;
    int globbed = paths[i].off == offsetof(job_config, val_data) || (paths[i].off == offsetof(job_config, data) && token);
    expected_path(exp, sizeof exp, w, cwd, globbed, paths[i].lua);
    FUZZ_CHECK(strcmp(exp, g) == 0, "the dump's %s is '%s', not '%s' (was '%s', cwd '%s')", paths[i].key, g, exp, w,
               cwd);
    memcpy(w, g, paths[i].size); /* the bytes past the string too (zeros in both) */
  }
}

static lua_State *new_vm(capped *c) {
  lua_State *L = lua_host_new();
  FUZZ_CHECK(L != NULL, "lua_host_new: %s", tr_error());
  c->f = lua_getallocf(L, &c->ud);
  c->used = (size_t)lua_gc(L, LUA_GCCOUNT) * 1024 + (size_t)lua_gc(L, LUA_GCCOUNTB);
  lua_setallocf(L, capped_alloc, c);
  return L;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  int fd = open("/dev/null", O_WRONLY); /* a job file may print() */
  if (fd >= 0) {
    dup2(fd, 1);
    close(fd);
  }
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const uint8_t *nul = memchr(data, 0, size);
  size_t src_len = nul ? (size_t)(nul - data) : size;
  const char *path = fuzz_write_scratch(0, ".lua", data, src_len);

  /* --set items: the lines after the NUL */
  char setbuf[1024];
  const char *sets[4];
  int nsets = 0;
  if (nul) {
    size_t rest = size - src_len - 1;
    if (rest > sizeof setbuf - 1) rest = sizeof setbuf - 1;
    memcpy(setbuf, nul + 1, rest);
    setbuf[rest] = 0;
    for (char *p = setbuf, *line; nsets < 4 && (line = strsep(&p, "\n")) != NULL;) sets[nsets++] = line;
  }

  capped c;
  lua_State *L = new_vm(&c);
  run_covered(L, path, sets, nsets);
  lua_close(L);
  L = new_vm(&c);
  job_config *cfg = calloc(2, sizeof *cfg); /* heap: field copies are bounds-checked */
  FUZZ_CHECK(cfg != NULL, "out of memory");
  int rc = job_load(L, path, sets, nsets, &cfg[0]);
  if (rc) {
    FUZZ_CHECK(rc < 0 && tr_error()[0] != 0, "job_load failed (%d) without a message", rc);
    FUZZ_CHECK(lua_gettop(L) == 0, "job_load left %d values on the stack", lua_gettop(L));
  } else {
    /* a checked job dumps to a file that loads back to the same config */
    char *dump = job_dump(L, &cfg[0]);
    FUZZ_CHECK(dump != NULL || strstr(tr_error(), "once its paths are made absolute"), "job_dump: %s", tr_error());
    if (dump) {
      const char *again = fuzz_write_scratch(1, ".lua", (const uint8_t *)dump, strlen(dump));
      capped c2;
      lua_State *L2 = new_vm(&c2);
      rc = job_load(L2, again, NULL, 0, &cfg[1]);
      FUZZ_CHECK(rc == 0, "the dump of a checked job does not load: %s\n%s", tr_error(), dump);
      char *dump2 = job_dump(L2, &cfg[1]);
      FUZZ_CHECK(dump2 && strcmp(dump, dump2) == 0, "the dump's dump differs:\n%s\n%s", dump, dump2 ? dump2 : tr_error());
      take_paths(&cfg[0], &cfg[1]);
      memcpy(cfg[1].path, cfg[0].path, sizeof cfg[1].path);
      cfg[1].lua_ref = cfg[0].lua_ref;
      FUZZ_CHECK(memcmp(&cfg[0], &cfg[1], sizeof cfg[0]) == 0, "the dump loads to a different config:\n%s", dump);
      lua_host_close(L2);
      free(dump2);
      free(dump);
    }
  }
  free(cfg);
  lua_host_close(L);
  return 0;
}
