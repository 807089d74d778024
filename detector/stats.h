/* stats.h — the detector's statistics: EWMA with variance, median, MAD,
 * percentiles and z-scores over bounded series, and the bounded series store
 * (one ring buffer of the last `history` values per metric per worker) with
 * fleet aggregates across workers.
 *
 * What it does not do: decide anything (the Lua rules do, detector.c), know
 * metric names (the store is indexed by metric number; detector.h names
 * them), or take a clock.
 *
 * Allocation: only series_create (one block for the index) and the first
 * sight of a worker (one block for that worker's rings). series_push and
 * every query run in preallocated memory; the order statistics work in the
 * store's scratch buffer.
 *
 * Non-finite values (NaN, +-Inf) are stored as they are (a NaN loss is what a
 * rule looks for) but every statistic skips them and the EWMA never takes
 * them in.
 *
 * Thread-safety: none. A store belongs to one thread (the operator's event
 * loop); the query functions that use the scratch buffer are not reentrant.
 */
#ifndef TRANSOM_STATS_H
#define TRANSOM_STATS_H

#include <stdint.h>

/* --- plain statistics on arrays --- */

/* Exponentially weighted mean and variance (West's incremental form):
 *   d = x - mean; mean += alpha d; var = (1 - alpha) (var + alpha d^2).
 * n counts the values taken in. */
typedef struct {
  double alpha, mean, var;
  int64_t n;
} ewma;

void ewma_init(ewma *e, double alpha);
/* Takes x in; non-finite x is ignored. */
void ewma_push(ewma *e, double x);
double ewma_std(const ewma *e);
/* (x - mean) / std against the current state: 0 when x equals the mean,
 * +-HUGE_VAL when std is 0 and x differs, NaN when n == 0 or x is not finite. */
double ewma_z(const ewma *e, double x);

/* The statistics below skip non-finite entries of x, copy the rest into
 * scratch (room for n doubles; it is reordered) and return NaN when nothing
 * finite is left. */
double stats_median(const double *x, int n, double *scratch);
/* Median absolute deviation, unscaled (multiply by 1.4826 for a normal sigma). */
double stats_mad(const double *x, int n, double *scratch);
/* p in [0, 100]; linear interpolation between order statistics (Hyndman-Fan
 * type 7, numpy's default). */
double stats_percentile(const double *x, int n, double p, double *scratch);
double stats_mean(const double *x, int n);
/* (x - center) / scale; 0 when x == center, +-HUGE_VAL when scale is 0. */
double stats_z(double x, double center, double scale);

/* --- the bounded series store --- */

typedef struct series_store series_store;

/* A store for worker ids 0..max_workers-1, n_metrics metrics each, keeping
 * the last `history` observations (2..65536), EWMAs with smoothing alpha.
 * NULL with tr_error() set on bad arguments or no memory. The caller owns it
 * and frees it with series_free. */
series_store *series_create(int max_workers, int n_metrics, int history, double alpha);
void series_free(series_store *s);

/* Appends one observation (n_metrics values) for worker at step, seen at
 * time t. For each metric the z-score of the new value against the EWMA
 * *before* it is kept (series_z), then the value goes into the EWMA.
 * TR_EINVAL for a worker id out of range; TR_ENOMEM the first time a worker
 * is seen and its block cannot be allocated. */
int series_push(series_store *s, int worker, int64_t step, double t, const double *vals);
/* Records a parameter checksum of worker at step (the last 16 are kept). */
int series_push_checksum(series_store *s, int worker, int64_t step, uint32_t crc);
/* Marks worker known without an observation (a heartbeat); allocates its
 * block on first sight. */
int series_touch(series_store *s, int worker);
/* Forgets everything about worker (its block is kept for reuse). */
void series_reset(series_store *s, int worker);
/* Drops every observation and checksum with step > step (a rollback). */
void series_rewind(series_store *s, int worker, int64_t step);

int series_max_workers(const series_store *s);
int series_history(const series_store *s);
int series_n_metrics(const series_store *s);
/* 1 when worker has been seen (push, checksum or touch) since its last reset. */
int series_known(const series_store *s, int worker);
/* Observations held for worker (<= history). */
int series_len(const series_store *s, int worker);
/* Observations ever pushed for worker since its last reset. */
int64_t series_total(const series_store *s, int worker);
/* The step and time of the observation `ago` back (0 = latest); -1 / NaN
 * when there is none. */
int64_t series_step(const series_store *s, int worker, int ago);
double series_time(const series_store *s, int worker, int ago);
/* Value of metric `ago` observations back; NaN when there is none. */
double series_value(const series_store *s, int worker, int metric, int ago);
/* Copies the last n values of metric (oldest first) into out; returns how
 * many were copied (<= n). */
int series_copy(const series_store *s, int worker, int metric, int n, double *out);
const ewma *series_ewma(const series_store *s, int worker, int metric);
/* z-score of the latest value against the EWMA before it (NaN if none). */
double series_z(const series_store *s, int worker, int metric);
/* Over the last n observations (n <= 0: all held). NaN when none. */
double series_median(series_store *s, int worker, int metric, int n);
double series_mad(series_store *s, int worker, int metric, int n);
double series_percentile(series_store *s, int worker, int metric, double p, int n);
double series_mean(series_store *s, int worker, int metric, int n);
/* How many of the most recent observations in a row have metric > threshold. */
int series_run_above(const series_store *s, int worker, int metric, double threshold);
/* Latest checksum: 1 and *step, *crc set when worker has one, else 0. */
int series_checksum(const series_store *s, int worker, int64_t *step, uint32_t *crc);
/* Checksum of worker at exactly step: 1 and *crc set, else 0. */
int series_checksum_at(const series_store *s, int worker, int64_t step, uint32_t *crc);

/* Fleet aggregates over the latest value of metric of every known worker
 * with at least one observation, leaving out worker `exclude` (-1: none).
 * NaN when no worker has a finite value. */
double series_fleet_median(series_store *s, int metric, int exclude);
double series_fleet_mad(series_store *s, int metric, int exclude);
double series_fleet_percentile(series_store *s, int metric, double p, int exclude);
double series_fleet_mean(series_store *s, int metric, int exclude);

#endif
