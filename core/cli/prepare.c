/* prepare.c — `transom prepare`: text files -> llm.c token shards + the
 * tokenizer that made them.
 *
 * A byte-level BPE is trained on the text (bpe.h; offline, no downloads), or
 * an existing tokenizer.bpe is reused; each file is one document, starting
 * with <|endoftext|> as GPT-2's data does. The last --val fraction of the
 * tokens goes to val_*.bin, the rest to train_*.bin, at most --shard-tokens
 * per shard; DIR/tokenizer.bpe is where a job finds it (trainer.c). The
 * shards and the tokenizer are written inside DIR, into a fresh
 * DIR/.prepare-XXXXXX (made before the tokenizing, so an unwritable DIR
 * fails at once), and moved into DIR when all are written: the earlier
 * prepare output there (tokenizer.bpe, train_/val_NNNNNN.bin; no other
 * file) goes first, tokenizer.bpe last in both directions. DIR itself is
 * never replaced: its mode, group, ACLs and other files stay, and it may be
 * ".", a symbolic link or a mount point. Two prepares into one DIR at
 * once do not mix: each holds an flock on its own DIR/.prepare-XXXXXX/.lock
 * for its life (a leftover is only one nobody holds: a killed prepare's),
 * and one on DIR/.prepare.lock (removed again) while it swaps its output
 * in; the later swap replaces the earlier whole.
 * Called from main.c only; it returns an exit status and never exits
 * itself.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bpe.h"
#include "util.h"

static const char prepare_usage[] =
    "usage: transom prepare TEXT... -o DIR [--vocab N] [--tokenizer FILE] [--val F] [--shard-tokens N]\n"
    "\n"
    "Tokenizes text files into llm.c token shards: DIR/train_000000.bin ...,\n"
    "DIR/val_000000.bin, and DIR/tokenizer.bpe. The tokenizer is a byte-level\n"
    "BPE (GPT-2's scheme) trained on the text to --vocab tokens (default 4096,\n"
    "<|endoftext|> last), or the one in --tokenizer FILE. Each file is a\n"
    "document and starts with <|endoftext|>. --val: the fraction of the\n"
    "tokens that validate (default 0.1); --shard-tokens: tokens per shard\n"
    "(default 100000000). --vocab and --tokenizer exclude each other. DIR is\n"
    "created if absent; the new files are written first into DIR/.prepare-*\n"
    "and then replace an earlier prepare's tokenizer.bpe, train_*.bin and\n"
    "val_*.bin there (other files stay; a failure leaves DIR as it was). Both\n"
    "splits must get tokens. A job then names the shards:\n"
    "\n"
    "  data = \"DIR/train_*.bin\", val_data = \"DIR/val_*.bin\", vocab_size = N\n";

typedef struct {
  const char *dir;
  int64_t shard_tokens;
  int next[2]; /* shard numbers per split */
} shard_out;

/* Writes ids as llm.c shards of at most shard_tokens each. */
static int write_shards(shard_out *o, int split, const int32_t *ids, int64_t n) {
  static const char *const name[2] = {"train", "val"};
  for (int64_t at = 0; at < n; at += o->shard_tokens) {
    int64_t k = n - at < o->shard_tokens ? n - at : o->shard_tokens;
    size_t bytes = 1024 + 2 * (size_t)k;
    uint8_t *buf = calloc(1, bytes);
    if (!buf) return tr_fail(TR_ENOMEM, "out of memory");
    int32_t h[3] = {20240520, 1, (int32_t)k};
    memcpy(buf, h, sizeof h);
    uint16_t *t = (uint16_t *)(buf + 1024);
    for (int64_t i = 0; i < k; i++) t[i] = (uint16_t)ids[at + i];
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s_%06d.bin", o->dir, name[split], o->next[split]++);
    int rc = tr_write_file_atomic(path, buf, bytes);
    free(buf);
    if (rc) return rc;
  }
  return TR_OK;
}

/* Reads every file; *docs[i] is file i. */
static char *read_all(char **files, int n, size_t *len, size_t *ends) {
  size_t total = 0, cap = 0;
  char *all = NULL;
  for (int i = 0; i < n; i++) {
    size_t l;
    char *s = tr_read_file(files[i], &l);
    if (!s) {
      free(all);
      return NULL;
    }
    if (total + l + 1 > cap) {
      cap = (total + l + 1) * 2;
      char *q = realloc(all, cap);
      if (!q) {
        free(s);
        free(all);
        tr_fail(TR_ENOMEM, "out of memory");
        return NULL;
      }
      all = q;
    }
    memcpy(all + total, s, l);
    total += l;
    ends[i] = total;
    free(s);
  }
  *len = total;
  return all;
}

/* Encodes each document (<|endoftext|> first) into one id array. */
static int encode_docs(const bpe *b, const char *all, const size_t *ends, int n, int32_t **ids, int64_t *nids) {
  size_t len = n ? ends[n - 1] : 0;
  *ids = malloc(sizeof(int32_t) * (len + (size_t)n + 1));
  if (!*ids) return tr_fail(TR_ENOMEM, "out of memory");
  *nids = 0;
  for (int i = 0; i < n; i++) {
    size_t from = i ? ends[i - 1] : 0;
    int64_t k;
    int rc = bpe_encode(b, all + from, ends[i] - from, *ids + *nids, (int64_t)(ends[i] - from) + 1, &k, 1);
    if (rc) return rc;
    *nids += k;
  }
  return TR_OK;
}

static int parse_args(int argc, char **argv, char **files, int *nfiles, shard_out *o, long *vocab,
                      const char **tok, double *val) {
  static const char *const value_flags[] = {"-o", "--tokenizer", "--vocab", "--val", "--shard-tokens", NULL};
  int vocab_given = 0;
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    char *end = NULL;
    if (tr_flag_lacks_value(argc, argv, i, value_flags))
      return tr_fail(TR_EINVAL, "%s needs a value (see transom prepare --help)", a);
    if (strcmp(a, "-o") == 0) o->dir = argv[++i];
    else if (strcmp(a, "--tokenizer") == 0) *tok = argv[++i];
    else if (strcmp(a, "--vocab") == 0) {
      vocab_given = 1;
      *vocab = strtol(argv[++i], &end, 10);
      if (*end || *vocab < 257 || *vocab > 65536) return tr_fail(TR_EINVAL, "--vocab must be 257..65536 (uint16 shards)");
    } else if (strcmp(a, "--val") == 0) {
      *val = strtod(argv[++i], &end);
      if (*end || !(*val > 0 && *val < 1)) return tr_fail(TR_EINVAL, "--val must be a fraction in (0, 1)");
    } else if (strcmp(a, "--shard-tokens") == 0) {
      o->shard_tokens = strtoll(argv[++i], &end, 10);
      if (*end || o->shard_tokens < 1 || o->shard_tokens > INT32_MAX) /* the header's count is an int32 */
        return tr_fail(TR_EINVAL, "--shard-tokens must be 1..%d (an llm.c header counts tokens in an int32)", INT32_MAX);
    } else if (a[0] == '-') {
      return tr_fail(TR_EINVAL, "unknown option '%s' (see transom prepare --help)", a);
    } else {
      files[(*nfiles)++] = argv[i];
    }
  }
  if (!*nfiles || !o->dir) return tr_fail(TR_EINVAL, "text files and -o DIR are required (see transom prepare --help)");
  if (vocab_given && *tok)
    return tr_fail(TR_EINVAL, "--vocab %ld with --tokenizer %s: the tokenizer brings its own vocabulary (--vocab "
                   "sizes a new one); give one of them", *vocab, *tok);
  return TR_OK;
}

/* --- the output directory: written inside it --- */

/* A file prepare writes (tokenizer.bpe, train_NNNNNN.bin, val_NNNNNN.bin),
 * or the .tmp of one that a killed prepare left. */
static int is_prepare_file(const char *name) {
  size_t n = strlen(name);
  if (n > 4 && strcmp(name + n - 4, ".tmp") == 0) n -= 4;
  if (n == 13 && strncmp(name, "tokenizer.bpe", 13) == 0) return 1;
  const char *digits = strncmp(name, "train_", 6) == 0 ? name + 6 : strncmp(name, "val_", 4) == 0 ? name + 4 : NULL;
  if (!digits || name + n - digits != 10 || strncmp(digits + 6, ".bin", 4) != 0) return 0;
  for (int i = 0; i < 6; i++)
    if (digits[i] < '0' || digits[i] > '9') return 0;
  return 1;
}

#define TMP_PREFIX ".prepare-"

/* --- locks: two prepares into one DIR ---
 * Lock files, not the directories: an flock on a directory fails over NFS
 * (it is taken through a read-only fd), and a user's own `flock DIR ...`
 * around prepare would deadlock with one on DIR. */
#define TMP_LOCK ".lock"            /* in DIR/.prepare-XXXXXX: held by its prepare for its life */
#define SWAP_LOCK ".prepare.lock"   /* in DIR: held while a prepare swaps its output in */

/* Test hook TRANSOM_TEST_PREPARE_PAUSE=FILE: the swap says "swap paused"
 * once the old output is gone, before the new comes in, and waits (up to
 * 120 s) until FILE exists, so a test can run a second prepare into that
 * window. */
static void test_pause(void) {
  const char *v = getenv("TRANSOM_TEST_PREPARE_PAUSE");
  if (!v || !*v) return;
  fprintf(stderr, "transom prepare: test: swap paused until %s exists\n", v);
  for (int i = 0; i < 12000 && access(v, F_OK) != 0; i++) usleep(10000);
}

/* The .prepare-* directory at path, a killed prepare's (nobody holds its
 * lock file, or it has none: killed before it made one), locked (*fd, -1:
 * no lock file) so that nobody takes it while it is removed: 1; 0 when a
 * live prepare holds it. */
static int take_leftover(const char *path, int *fd) {
  char lock[PATH_MAX];
  *fd = -1;
  if (snprintf(lock, sizeof lock, "%s/" TMP_LOCK, path) >= (int)sizeof lock) return 0;
  *fd = open(lock, O_RDWR | O_CLOEXEC);
  if (*fd < 0) return 1;
  if (flock(*fd, LOCK_EX | LOCK_NB) == 0 || errno != EWOULDBLOCK) return 1; /* (a filesystem without locks: as before) */
  close(*fd);
  *fd = -1;
  return 0;
}

/* Removes the DIR/.prepare-* directories a killed prepare left (flat: the
 * files in them, then them), holding each one's lock meanwhile; a live
 * prepare's stays. Best effort. */
static void remove_leftovers(const char *dir) {
  DIR *d = opendir(dir);
  char path[PATH_MAX];
  for (struct dirent *e; d && (e = readdir(d));) {
    int fd;
    if (strncmp(e->d_name, TMP_PREFIX, strlen(TMP_PREFIX)) != 0 ||
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name) >= (int)sizeof path || !take_leftover(path, &fd))
      continue;
    tr_remove_flat(path);
    if (fd >= 0) close(fd);
  }
  if (d) closedir(d);
}

/* A fresh DIR/.prepare-XXXXXX in tmp, its lock file made and held (*fd;
 * -1 without locks). One that another prepare's remove_leftovers took
 * before the lock was held is gone by then: another is made. */
static int make_tmp(const char *dir, char *tmp, size_t ntmp, int *fd) {
  char lock[PATH_MAX];
  *fd = -1;
  for (int tries = 0; tries < 16; tries++) {
    if (snprintf(tmp, ntmp, "%s/" TMP_PREFIX "XXXXXX", dir) >= (int)ntmp ||
        snprintf(lock, sizeof lock, "%s/" TMP_PREFIX "XXXXXX/" TMP_LOCK, dir) >= (int)sizeof lock)
      return tr_fail(TR_EINVAL, "'%s': path too long", dir);
    if (!mkdtemp(tmp)) return tr_fail(TR_EIO, "cannot create a directory in '%s': %s", dir, strerror(errno));
    snprintf(lock, sizeof lock, "%s/" TMP_LOCK, tmp);
    int f = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (f < 0) {
      if (errno == ENOENT) continue; /* taken for a leftover already */
      int e = errno;
      rmdir(tmp);
      return tr_fail(TR_EIO, "cannot create '%s': %s", lock, strerror(e));
    }
    if (flock(f, LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK) { /* a filesystem without locks */
        close(f);
        return TR_OK;
      }
      close(f); /* taken for a leftover meanwhile: gone next */
      continue;
    }
    if (tr_fd_at_path(f, lock)) {
      *fd = f;
      return TR_OK;
    }
    close(f);
  }
  return tr_fail(TR_EIO, "cannot keep a directory in '%s': another prepare removes each one made", dir);
}

/* DIR made if absent (*created then set: a failure removes it again), the
 * leftovers of a killed prepare removed, and a fresh DIR/.prepare-XXXXXX
 * made in tmp and locked (*tmp_fd) for as long as this prepare runs: DIR
 * is known to be writable before hours of tokenizing. */
static int open_out(const char *dir, char *tmp, size_t ntmp, int *created, int *tmp_fd) {
  struct stat st;
  *tmp_fd = -1;
  *created = stat(dir, &st) != 0 && errno == ENOENT;
  int rc = tr_mkdirs(dir);
  if (rc) return rc;
  remove_leftovers(dir);
  return make_tmp(dir, tmp, ntmp, tmp_fd);
}

/* Unlinks dir's files of an earlier prepare: tokenizer first (or only it). */
static int remove_old(const char *dir, int tokenizer_only) {
  DIR *d = opendir(dir);
  if (!d) return tr_fail(TR_EIO, "cannot read '%s': %s", dir, strerror(errno));
  char path[PATH_MAX];
  int rc = TR_OK;
  for (struct dirent *e; !rc && (e = readdir(d));) {
    if (!is_prepare_file(e->d_name) || (tokenizer_only && strncmp(e->d_name, "tokenizer.bpe", 13) != 0)) continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (unlink(path) != 0 && errno != ENOENT) rc = tr_fail(TR_EIO, "cannot remove '%s': %s", path, strerror(errno));
  }
  closedir(d);
  return rc;
}

/* Renames tmp's files into dir: the shards, or tokenizer.bpe alone. */
static int move_in(const char *tmp, const char *dir, int tokenizer) {
  DIR *d = opendir(tmp);
  if (!d) return tr_fail(TR_EIO, "cannot read '%s': %s", tmp, strerror(errno));
  char from[PATH_MAX], to[PATH_MAX];
  int rc = TR_OK;
  for (struct dirent *e; !rc && (e = readdir(d));) {
    if (e->d_name[0] == '.' || (strcmp(e->d_name, "tokenizer.bpe") == 0) != tokenizer) continue;
    snprintf(from, sizeof from, "%s/%s", tmp, e->d_name);
    snprintf(to, sizeof to, "%s/%s", dir, e->d_name);
    if (rename(from, to) != 0) rc = tr_fail(TR_EIO, "cannot rename '%s' to '%s': %s", from, to, strerror(errno));
  }
  closedir(d);
  return rc;
}

/* The finished output in tmp takes the place of dir's earlier one: the old
 * tokenizer.bpe goes, then the old shards; the new shards come in, then the
 * new tokenizer.bpe; dir is synced between, so after a crash dir never
 * holds a tokenizer beside shards it did not make. A failure here leaves
 * no tokenizer.bpe in dir and says to run prepare again. */
static int swap_locked(const char *tmp, const char *dir) {
  int rc = remove_old(dir, 1);
  if (rc) return rc; /* dir is as it was (but for a tokenizer.bpe.tmp left by an older build) */
  rc = tr_sync_dir(dir);
  if (!rc) rc = remove_old(dir, 0);
  if (!rc) test_pause();
  if (!rc) rc = move_in(tmp, dir, 0);
  if (!rc) rc = tr_sync_dir(dir);
  if (!rc) rc = move_in(tmp, dir, 1);
  if (!rc) rc = tr_sync_dir(dir);
  if (rc) {
    char why[512];
    snprintf(why, sizeof why, "%s", tr_error());
    return tr_fail(rc, "%s (%s now holds no tokenizer.bpe, and part of the shards: run transom prepare again)", why,
                   dir);
  }
  char lock[PATH_MAX];
  if (snprintf(lock, sizeof lock, "%s/" TMP_LOCK, tmp) < (int)sizeof lock) unlink(lock);
  rmdir(tmp);
  return TR_OK;
}

/* swap_locked under DIR/.prepare.lock (tr_lock_file: another prepare's
 * swap ends first; removed again as it is let go). */
static int swap_in(const char *tmp, const char *dir) {
  char path[PATH_MAX];
  if (snprintf(path, sizeof path, "%s/" SWAP_LOCK, dir) >= (int)sizeof path)
    return tr_fail(TR_EINVAL, "'%s': path too long", dir);
  int fd, rc = tr_lock_file(path, &fd);
  if (rc) return rc;
  rc = swap_locked(tmp, dir);
  tr_unlock_file(fd, path);
  return rc;
}

/* --- the command --- */

/* The text read and encoded: *b the tokenizer (trained, or --tokenizer's),
 * *ids the tokens of every document. */
static int tokenize(char **files, int nfiles, size_t *ends, long vocab, const char *tokfile, char **all,
                    size_t *len, bpe **b, int32_t **ids, int64_t *n) {
  if (!(*all = read_all(files, nfiles, len, ends))) return TR_EIO;
  if (*len == 0)
    return tr_fail(TR_EINVAL, "no text to tokenize: %s%s empty", nfiles == 1 ? files[0] : "the files",
                   nfiles == 1 ? " is" : " are all");
  *b = tokfile ? bpe_load(tokfile) : bpe_train(*all, *len, (int)vocab);
  if (!*b) return TR_EINVAL;
  if (bpe_vocab_size(*b) > 65536)
    return tr_fail(TR_EINVAL, "'%s': more than 65536 tokens (uint16 shards)", tokfile);
  return encode_docs(*b, *all, ends, nfiles, ids, n);
}

/* The shards and the tokenizer into o->dir (the temporary directory). */
static int write_out(shard_out *o, const bpe *b, const int32_t *ids, int64_t n, int64_t nval) {
  char path[PATH_MAX];
  int rc = write_shards(o, 0, ids, n - nval);
  if (!rc) rc = write_shards(o, 1, ids + n - nval, nval);
  snprintf(path, sizeof path, "%s/tokenizer.bpe", o->dir);
  if (!rc) rc = bpe_save(b, path);
  return rc;
}

int prepare_main(int argc, char **argv) {
  for (int i = 0; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(prepare_usage, stdout);
      return 0;
    }
  char **files = calloc((size_t)argc + 1, sizeof *files), dir[PATH_MAX - 32], tmp[PATH_MAX];
  size_t *ends = calloc((size_t)argc + 1, sizeof *ends);
  shard_out o = {NULL, 100000000, {0, 0}};
  long vocab = 4096;
  const char *tokfile = NULL;
  double val = 0.1;
  int nfiles = 0, created = 0, tmp_fd = -1;
  int rc = files && ends ? parse_args(argc, argv, files, &nfiles, &o, &vocab, &tokfile, &val)
                         : tr_fail(TR_ENOMEM, "out of memory");
  if (!rc) { /* DIR as given, less its trailing slashes (for the hint printed at the end) */
    size_t k = strlen(o.dir);
    while (k > 1 && o.dir[k - 1] == '/') k--;
    if (k >= sizeof dir) rc = tr_fail(TR_EINVAL, "-o %s: path too long", o.dir);
    else snprintf(dir, sizeof dir, "%.*s", (int)k, o.dir);
  }
  if (!rc && (rc = open_out(dir, tmp, sizeof tmp, &created, &tmp_fd))) tr_fail_prefix(rc, "-o %s", dir);
  if (rc) {
    fprintf(stderr, "transom prepare: %s\n", tr_error());
    if (tmp_fd >= 0) close(tmp_fd);
    free(files);
    free(ends);
    return 2;
  }
  size_t len = 0;
  char *all = NULL;
  bpe *b = NULL;
  int32_t *ids = NULL;
  int64_t n = 0;
  rc = tokenize(files, nfiles, ends, vocab, tokfile, &all, &len, &b, &ids, &n);
  int64_t nval = (int64_t)((double)n * val); /* a job's val_data glob must match a shard, and data too */
  if (!rc && (nval == 0 || nval == n))
    rc = tr_fail(TR_EINVAL, "%zu bytes of text are %lld tokens, and --val %g of them leaves %s: give more text or "
                 "a %s --val", len, (long long)n, val, nval ? "no train tokens" : "no val tokens (no val_*.bin)",
                 nval ? "smaller" : "larger");
  o.dir = tmp;
  if (!rc) rc = write_out(&o, b, ids, n, nval);
  if (!rc) rc = swap_in(tmp, dir);
  if (rc) {
    tr_remove_flat(tmp); /* before swap_in's renames, dir is as it was */
    if (created) rmdir(dir);
  }
  if (!rc)
    printf("%zu bytes -> %lld tokens (%.2f bytes/token): %d train and %d val shards, tokenizer of %lld tokens in "
           "%s/tokenizer.bpe\na job reads them with:\n  data = \"%s/train_*.bin\", val_data = \"%s/val_*.bin\", "
           "vocab_size = %lld,\n",
           len, (long long)n, (double)len / (double)n, o.next[0], o.next[1], (long long)bpe_vocab_size(b), dir, dir,
           dir, (long long)bpe_vocab_size(b));
  else fprintf(stderr, "transom prepare: %s\n", tr_error());
  if (tmp_fd >= 0) close(tmp_fd);
  bpe_free(b);
  free(ids);
  free(all);
  free(files);
  free(ends);
  return rc ? 1 : 0;
}
