/* stats.c — EWMA, order statistics and the bounded per-worker series store
 * (see stats.h). Called by detector.c on every observation and by the Lua
 * views when rules ask for a statistic. No allocation after a worker's first
 * sight; order statistics use quickselect (Wirth) in a scratch buffer.
 */
#include "stats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

#define CK_RING 16

/* --- plain statistics --- */

void ewma_init(ewma *e, double alpha) {
  e->alpha = alpha > 0 && alpha <= 1 ? alpha : 0.1;
  e->mean = 0;
  e->var = 0;
  e->n = 0;
}

void ewma_push(ewma *e, double x) {
  if (!isfinite(x)) return;
  if (e->n++ == 0) {
    e->mean = x;
    e->var = 0;
    return;
  }
  double d = x - e->mean;
  e->mean += e->alpha * d;
  e->var = (1 - e->alpha) * (e->var + e->alpha * d * d);
}

double ewma_std(const ewma *e) { return e->n > 0 ? sqrt(e->var) : NAN; }

double stats_z(double x, double center, double scale) {
  if (!isfinite(x) || !isfinite(center) || !(scale >= 0)) return NAN;
  if (x == center) return 0;
  if (scale == 0) return x > center ? HUGE_VAL : -HUGE_VAL;
  return (x - center) / scale;
}

double ewma_z(const ewma *e, double x) {
  if (e->n == 0) return NAN;
  return stats_z(x, e->mean, sqrt(e->var));
}

/* k-th smallest (0-based) of a[0..n-1]; reorders a. Wirth's selection:
 * Hoare partitioning, so runs of equal values cost O(n). */
static double kth(double *a, int n, int k) {
  int l = 0, m = n - 1;
  while (l < m) {
    double x = a[k];
    int i = l, j = m;
    do {
      while (a[i] < x) i++;
      while (x < a[j]) j--;
      if (i <= j) {
        double t = a[i];
        a[i] = a[j];
        a[j] = t;
        i++;
        j--;
      }
    } while (i <= j);
    if (j < k) l = i;
    if (k < i) m = j;
  }
  return a[k];
}

/* After kth(a, n, k): the smallest of a[k+1..n-1], the (k+1)-th. */
static double next_after(const double *a, int n, int k) {
  double v = a[k + 1];
  for (int i = k + 2; i < n; i++)
    if (a[i] < v) v = a[i];
  return v;
}

static int finite_copy(const double *x, int n, double *out) {
  int m = 0;
  for (int i = 0; i < n; i++)
    if (isfinite(x[i])) out[m++] = x[i];
  return m;
}

static double percentile_inplace(double *a, int m, double p) {
  if (m == 0) return NAN;
  if (p <= 0) p = 0;
  if (p >= 100) p = 100;
  double h = (m - 1) * p / 100.0;
  int lo = (int)floor(h);
  double lov = kth(a, m, lo);
  if (lo + 1 >= m || h == lo) return lov;
  double hiv = next_after(a, m, lo);
  return lov + (h - lo) * (hiv - lov);
}

double stats_percentile(const double *x, int n, double p, double *scratch) {
  return percentile_inplace(scratch, finite_copy(x, n, scratch), p);
}

double stats_median(const double *x, int n, double *scratch) { return stats_percentile(x, n, 50, scratch); }

double stats_mad(const double *x, int n, double *scratch) {
  int m = finite_copy(x, n, scratch);
  if (m == 0) return NAN;
  double med = percentile_inplace(scratch, m, 50);
  for (int i = 0; i < m; i++) scratch[i] = fabs(scratch[i] - med);
  return percentile_inplace(scratch, m, 50);
}

double stats_mean(const double *x, int n) {
  double s = 0;
  int m = 0;
  for (int i = 0; i < n; i++)
    if (isfinite(x[i])) s += x[i], m++;
  return m ? s / m : NAN;
}

/* --- the series store --- */

typedef struct {
  int known, len, head; /* head: the slot the next observation goes to */
  int64_t total;
  int64_t *steps;       /* (history) */
  double *times;        /* (history) */
  double *vals;         /* (n_metrics, history) */
  ewma *ew;             /* (n_metrics) */
  double *z;            /* (n_metrics): z of the latest value against the EWMA before it */
  int ck_len;
  int64_t ck_step[CK_RING]; /* oldest first */
  uint32_t ck_crc[CK_RING];
} wblock;

struct series_store {
  int max_workers, n_metrics, history;
  double alpha;
  wblock **w;      /* (max_workers), NULL until first sight */
  double *scratch; /* (max(history, max_workers)) */
};

series_store *series_create(int max_workers, int n_metrics, int history, double alpha) {
  if (max_workers < 1 || max_workers > 1 << 16 || n_metrics < 1 || n_metrics > 256 || history < 2 ||
      history > 1 << 16) {
    tr_fail(TR_EINVAL, "series store: bad size (workers %d, metrics %d, history %d)", max_workers, n_metrics, history);
    return NULL;
  }
  series_store *s = calloc(1, sizeof *s);
  if (!s) goto nomem;
  s->max_workers = max_workers;
  s->n_metrics = n_metrics;
  s->history = history;
  s->alpha = alpha;
  s->w = calloc((size_t)max_workers, sizeof *s->w);
  s->scratch = malloc(sizeof(double) * (size_t)(history > max_workers ? history : max_workers));
  if (!s->w || !s->scratch) goto nomem;
  return s;
nomem:
  series_free(s);
  tr_fail(TR_ENOMEM, "series store: out of memory");
  return NULL;
}

void series_free(series_store *s) {
  if (!s) return;
  if (s->w)
    for (int i = 0; i < s->max_workers; i++) free(s->w[i]);
  free(s->w);
  free(s->scratch);
  free(s);
}

static void block_clear(series_store *s, wblock *b) {
  b->known = 0;
  b->len = b->head = 0;
  b->total = 0;
  b->ck_len = 0;
  for (int m = 0; m < s->n_metrics; m++) {
    ewma_init(&b->ew[m], s->alpha);
    b->z[m] = NAN;
  }
}

/* The worker's block, allocated on first sight (one malloc for all its rings). */
static wblock *block_get(series_store *s, int worker) {
  if (worker < 0 || worker >= s->max_workers) return NULL;
  if (s->w[worker]) return s->w[worker];
  size_t H = (size_t)s->history, M = (size_t)s->n_metrics;
  size_t bytes = sizeof(wblock) + H * sizeof(int64_t) + H * sizeof(double) + M * H * sizeof(double) +
                 M * sizeof(double) + M * sizeof(ewma);
  char *p = malloc(bytes);
  if (!p) return NULL;
  wblock *b = (wblock *)p;
  p += sizeof(wblock);
  b->ew = (ewma *)p; /* ewma first: the strictest alignment */
  p += M * sizeof(ewma);
  b->steps = (int64_t *)p;
  p += H * sizeof(int64_t);
  b->times = (double *)p;
  p += H * sizeof(double);
  b->vals = (double *)p;
  p += M * H * sizeof(double);
  b->z = (double *)p;
  block_clear(s, b);
  s->w[worker] = b;
  return b;
}

static const wblock *block_of(const series_store *s, int worker) {
  if (worker < 0 || worker >= s->max_workers) return NULL;
  const wblock *b = s->w[worker];
  return b && b->known ? b : NULL;
}

/* Ring index of the observation `ago` back, -1 if none. */
static int ring_at(const series_store *s, const wblock *b, int ago) {
  if (!b || ago < 0 || ago >= b->len) return -1;
  int i = b->head - 1 - ago;
  return i < 0 ? i + s->history : i;
}

int series_push(series_store *s, int worker, int64_t step, double t, const double *vals) {
  if (worker < 0 || worker >= s->max_workers)
    return tr_fail(TR_EINVAL, "worker %d out of range 0..%d", worker, s->max_workers - 1);
  wblock *b = block_get(s, worker);
  if (!b) return tr_fail(TR_ENOMEM, "series store: out of memory for worker %d", worker);
  b->known = 1;
  int H = s->history, i = b->head;
  b->steps[i] = step;
  b->times[i] = t;
  for (int m = 0; m < s->n_metrics; m++) {
    b->vals[(size_t)m * H + i] = vals[m];
    b->z[m] = ewma_z(&b->ew[m], vals[m]);
    ewma_push(&b->ew[m], vals[m]);
  }
  b->head = (i + 1) % H;
  if (b->len < H) b->len++;
  b->total++;
  return TR_OK;
}

int series_push_checksum(series_store *s, int worker, int64_t step, uint32_t crc) {
  if (worker < 0 || worker >= s->max_workers)
    return tr_fail(TR_EINVAL, "worker %d out of range 0..%d", worker, s->max_workers - 1);
  wblock *b = block_get(s, worker);
  if (!b) return tr_fail(TR_ENOMEM, "series store: out of memory for worker %d", worker);
  b->known = 1;
  for (int k = 0; k < b->ck_len; k++) /* a repeat for the same step replaces */
    if (b->ck_step[k] == step) {
      b->ck_crc[k] = crc;
      return TR_OK;
    }
  if (b->ck_len == CK_RING) {
    memmove(b->ck_step, b->ck_step + 1, (CK_RING - 1) * sizeof b->ck_step[0]);
    memmove(b->ck_crc, b->ck_crc + 1, (CK_RING - 1) * sizeof b->ck_crc[0]);
    b->ck_len--;
  }
  b->ck_step[b->ck_len] = step;
  b->ck_crc[b->ck_len] = crc;
  b->ck_len++;
  return TR_OK;
}

int series_touch(series_store *s, int worker) {
  if (worker < 0 || worker >= s->max_workers)
    return tr_fail(TR_EINVAL, "worker %d out of range 0..%d", worker, s->max_workers - 1);
  wblock *b = block_get(s, worker);
  if (!b) return tr_fail(TR_ENOMEM, "series store: out of memory for worker %d", worker);
  b->known = 1;
  return TR_OK;
}

void series_reset(series_store *s, int worker) {
  if (worker >= 0 && worker < s->max_workers && s->w[worker]) block_clear(s, s->w[worker]);
}

void series_rewind(series_store *s, int worker, int64_t step) {
  if (worker < 0 || worker >= s->max_workers || !s->w[worker]) return;
  wblock *b = s->w[worker];
  while (b->len > 0) {
    int i = ring_at(s, b, 0);
    if (b->steps[i] <= step) break;
    b->head = i;
    b->len--;
  }
  int k = 0;
  for (int j = 0; j < b->ck_len; j++)
    if (b->ck_step[j] <= step) {
      b->ck_step[k] = b->ck_step[j];
      b->ck_crc[k] = b->ck_crc[j];
      k++;
    }
  b->ck_len = k;
  for (int m = 0; m < s->n_metrics; m++) b->z[m] = NAN;
}

int series_max_workers(const series_store *s) { return s->max_workers; }
int series_history(const series_store *s) { return s->history; }
int series_n_metrics(const series_store *s) { return s->n_metrics; }
int series_known(const series_store *s, int worker) { return block_of(s, worker) != NULL; }

int series_len(const series_store *s, int worker) {
  const wblock *b = block_of(s, worker);
  return b ? b->len : 0;
}

int64_t series_total(const series_store *s, int worker) {
  const wblock *b = block_of(s, worker);
  return b ? b->total : 0;
}

int64_t series_step(const series_store *s, int worker, int ago) {
  const wblock *b = block_of(s, worker);
  int i = ring_at(s, b, ago);
  return i < 0 ? -1 : b->steps[i];
}

double series_time(const series_store *s, int worker, int ago) {
  const wblock *b = block_of(s, worker);
  int i = ring_at(s, b, ago);
  return i < 0 ? NAN : b->times[i];
}

double series_value(const series_store *s, int worker, int metric, int ago) {
  const wblock *b = block_of(s, worker);
  int i = ring_at(s, b, ago);
  if (i < 0 || metric < 0 || metric >= s->n_metrics) return NAN;
  return b->vals[(size_t)metric * s->history + i];
}

int series_copy(const series_store *s, int worker, int metric, int n, double *out) {
  const wblock *b = block_of(s, worker);
  if (!b || metric < 0 || metric >= s->n_metrics || n <= 0) return 0;
  if (n > b->len) n = b->len;
  for (int k = 0; k < n; k++) out[k] = b->vals[(size_t)metric * s->history + ring_at(s, b, n - 1 - k)];
  return n;
}

const ewma *series_ewma(const series_store *s, int worker, int metric) {
  const wblock *b = block_of(s, worker);
  return b && metric >= 0 && metric < s->n_metrics ? &b->ew[metric] : NULL;
}

double series_z(const series_store *s, int worker, int metric) {
  const wblock *b = block_of(s, worker);
  return b && b->len > 0 && metric >= 0 && metric < s->n_metrics ? b->z[metric] : NAN;
}

/* The last n values (all if n <= 0) into the scratch buffer; returns the count. */
static int window(series_store *s, int worker, int metric, int n) {
  int len = series_len(s, worker);
  return series_copy(s, worker, metric, n <= 0 || n > len ? len : n, s->scratch);
}

double series_median(series_store *s, int worker, int metric, int n) {
  int m = window(s, worker, metric, n);
  return percentile_inplace(s->scratch, finite_copy(s->scratch, m, s->scratch), 50);
}

double series_mad(series_store *s, int worker, int metric, int n) {
  int m = window(s, worker, metric, n);
  return stats_mad(s->scratch, m, s->scratch); /* finite_copy in place is safe: out <= in */
}

double series_percentile(series_store *s, int worker, int metric, double p, int n) {
  int m = window(s, worker, metric, n);
  return percentile_inplace(s->scratch, finite_copy(s->scratch, m, s->scratch), p);
}

double series_mean(series_store *s, int worker, int metric, int n) {
  int m = window(s, worker, metric, n);
  return stats_mean(s->scratch, m);
}

int series_run_above(const series_store *s, int worker, int metric, double threshold) {
  const wblock *b = block_of(s, worker);
  if (!b || metric < 0 || metric >= s->n_metrics) return 0;
  int k = 0;
  while (k < b->len && b->vals[(size_t)metric * s->history + ring_at(s, b, k)] > threshold) k++;
  return k;
}

int series_checksum(const series_store *s, int worker, int64_t *step, uint32_t *crc) {
  const wblock *b = block_of(s, worker);
  if (!b || b->ck_len == 0) return 0;
  *step = b->ck_step[b->ck_len - 1];
  *crc = b->ck_crc[b->ck_len - 1];
  return 1;
}

int series_checksum_at(const series_store *s, int worker, int64_t step, uint32_t *crc) {
  const wblock *b = block_of(s, worker);
  if (!b) return 0;
  for (int k = b->ck_len - 1; k >= 0; k--)
    if (b->ck_step[k] == step) {
      *crc = b->ck_crc[k];
      return 1;
    }
  return 0;
}

/* Latest finite values of metric across workers into scratch; returns the count. */
static int fleet_latest(series_store *s, int metric, int exclude) {
  int m = 0;
  for (int w = 0; w < s->max_workers; w++) {
    if (w == exclude) continue;
    double v = series_value(s, w, metric, 0);
    if (isfinite(v)) s->scratch[m++] = v;
  }
  return m;
}

double series_fleet_median(series_store *s, int metric, int exclude) {
  return percentile_inplace(s->scratch, fleet_latest(s, metric, exclude), 50);
}

double series_fleet_percentile(series_store *s, int metric, double p, int exclude) {
  return percentile_inplace(s->scratch, fleet_latest(s, metric, exclude), p);
}

double series_fleet_mad(series_store *s, int metric, int exclude) {
  int m = fleet_latest(s, metric, exclude);
  return stats_mad(s->scratch, m, s->scratch);
}

double series_fleet_mean(series_store *s, int metric, int exclude) {
  return stats_mean(s->scratch, fleet_latest(s, metric, exclude));
}
