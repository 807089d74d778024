/* test_sim.c — the failure simulation (core/sim/sim.c) against cases whose
 * answer is known in closed form, worked out by hand in each test's comment:
 *   - no failures: ETTR 1; with start-up and checkpoint stalls, exactly
 *     steps / (start-up + steps + stalls);
 *   - replace mode, a failure every T seconds with a stall d: the wall time
 *     and goodput of a periodic schedule, to the last second;
 *   - restart-all with failures at given steps: each goes back to the newest
 *     *committed* checkpoint (one still being written does not count);
 *   - restart-all under Poisson failures loses on average what is left of
 *     an exponential time modulo the checkpoint interval: half an interval
 *     when failures are rare against it;
 *   - a recovery that starts over when a failure lands in it: ETTR =
 *     exp(-lambda D), in both modes;
 *   - waiting for a spare host that is in repair; pausing below
 *     min_replicas; the restart policy's exponential backoff;
 *   - replace mode with one replica is restart-all, failure for failure;
 *   - the books balance: wall = useful + every lost cause, goodput <= ETTR;
 *   - a config out of range is refused.
 * Times are simulated: nothing here depends on the machine's speed.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "sim.h"
#include "util.h"

static int near(double a, double b) { return fabs(a - b) <= 1e-9 * fmax(1.0, fabs(b)); }
#define NEAR(a, b) near((a), (double)(b))

/* R replicas of one GPU (one host each), `steps` steps of 1 s, every cost 0,
 * software failures, no spares. */
static sim_config base(int64_t replicas, int64_t steps) {
  sim_config c;
  memset(&c, 0, sizeof c);
  c.replicas = replicas;
  c.gpus_per_replica = 1;
  c.gpus_per_host = 1;
  c.min_replicas = 1;
  c.steps = steps;
  c.step_s = c.degraded_step_s = 1.0;
  c.backoff = 1;
  return c;
}

static sim_result run(const sim_config *c, sim_mode m, uint64_t seed) {
  sim_result r;
  memset(&r, 0, sizeof r);
  int rc = sim_run(c, m, seed, &r);
  CHECK(rc == TR_OK, "sim_run: %s", tr_error());
  return r;
}

static double lost_sum(const sim_result *r) {
  double s = 0;
  for (int i = 0; i < SIM_NCAUSE; i++) s += r->lost_s[i];
  return s;
}

static void test_no_failures(void) {
  for (int m = 0; m < 2; m++) {
    sim_config c = base(4, 1000);
    sim_result r = run(&c, m, 1);
    CHECK(r.finished && r.ettr == 1.0 && r.goodput == 1.0 && r.wall_s == 1000, "mode %d: ettr %g wall %g", m, r.ettr,
          r.wall_s);
    /* start-up 10 s; a snapshot every 100 steps stalls 0.5 s: at 100..900,
     * none at the last step: wall = 10 + 1000 + 9 * 0.5 */
    c.startup_s = 10;
    c.ckpt_every_steps = 100;
    c.ckpt_stall_s = 0.5;
    c.ckpt_write_s = 3;
    r = run(&c, m, 1);
    CHECK(NEAR(r.wall_s, 1014.5) && NEAR(r.ettr, 1000 / 1014.5), "mode %d: wall %g", m, r.wall_s);
    CHECK(NEAR(r.lost_s[SIM_STARTUP], 10) && NEAR(r.lost_s[SIM_CKPT], 4.5), "startup %g ckpt %g",
          r.lost_s[SIM_STARTUP], r.lost_s[SIM_CKPT]);
  }
}

/* A failure every T = 100 s, replicas in turn; survivors stall d = 3 + 7 s;
 * the replacement is back 3 + 0 + 1 + 26 = 30 s after the failure. Steps
 * 0..100 s: 100; each later period trains T - d = 90. 865 steps = 100 +
 * 8 * 90 + 45: the 9th failure is at 900 s, its stall ends at 910, the last
 * 45 steps end at 955. Goodput: in each of the 9 periods, 20 steps (10..30
 * s after the failure) ran with 3 of 4 replicas: 865 - 9 * 20 / 4 = 820. */
static void test_periodic_replace(void) {
  sim_config c = base(4, 865);
  c.every_s = 100;
  c.detect_s = 3;
  c.redo_s = 7;
  c.start_s = 1;
  c.catchup_s = 26;
  sim_result r = run(&c, SIM_REPLACE, 1);
  CHECK(r.finished && NEAR(r.wall_s, 955), "wall %g (want 955)", r.wall_s);
  CHECK(NEAR(r.ettr, 865.0 / 955) && NEAR(r.goodput, 820.0 / 955), "ettr %g goodput %g", r.ettr, r.goodput);
  CHECK(r.failures == 9 && r.replacements == 9 && r.restarts == 0, "failures %lld replacements %lld",
        (long long)r.failures, (long long)r.replacements);
  CHECK(NEAR(r.lost_s[SIM_DETECT], 27) && NEAR(r.lost_s[SIM_REDO], 63), "detect %g redo %g", r.lost_s[SIM_DETECT],
        r.lost_s[SIM_REDO]);
}

/* Restart-all, a failure on reaching steps 50, 100, ..., 450 (after 49, 99,
 * ... steps, as operator_bench.sh's chaos list), snapshots every 25 steps,
 * committed 10 s after: each failure goes back 24 steps and costs detect 2
 * + restart 30 + load 5: wall = 500 + 9 * (24 + 37). */
static void test_restart_all_at_steps(void) {
  sim_config c = base(2, 500);
  c.ckpt_every_steps = 25;
  c.ckpt_write_s = 10;
  c.detect_s = 2;
  c.restart_s = 30;
  c.load_s = 5;
  c.nchaos = 9;
  for (int i = 0; i < 9; i++) c.chaos[i] = (sim_chaos){50 * (i + 1), (i + 1) % 2};
  sim_result r = run(&c, SIM_RESTART_ALL, 1);
  CHECK(NEAR(r.wall_s, 500 + 9 * 61.0) && r.rework_steps == 9 * 24 && r.restarts == 9, "wall %g rework %lld",
        r.wall_s, (long long)r.rework_steps);
  /* the same failures in replace mode: survivors stall detect + redo only */
  c.redo_s = 1;
  r = run(&c, SIM_REPLACE, 1);
  CHECK(NEAR(r.wall_s, 500 + 9 * 3.0) && r.rework_steps == 0 && r.restarts == 0, "replace: wall %g", r.wall_s);
}

/* One failure on reaching step 40, a snapshot at step 25 (t = 25 s). Its
 * write takes 10 s: committed at 35, the failure at 39 goes back to 25
 * (rework 14). A 20 s write is still running at 39: back to step 0 (39). */
static void test_uncommitted_checkpoint(void) {
  sim_config c = base(1, 100);
  c.ckpt_every_steps = 25;
  c.nchaos = 1;
  c.chaos[0] = (sim_chaos){40, 0};
  c.ckpt_write_s = 10;
  sim_result r = run(&c, SIM_RESTART_ALL, 1);
  CHECK(r.rework_steps == 14 && NEAR(r.wall_s, 114), "rework %lld wall %g", (long long)r.rework_steps, r.wall_s);
  c.ckpt_write_s = 20;
  r = run(&c, SIM_RESTART_ALL, 1);
  CHECK(r.rework_steps == 39 && NEAR(r.wall_s, 139), "rework %lld wall %g", (long long)r.rework_steps, r.wall_s);
}

/* Poisson failures (one per theta = 1000 s for the job), snapshots every
 * C = 100 steps of 1 s committed at once, restarts free: after a restart
 * the job trains from a checkpoint until the next failure, X ~ Exp(theta)
 * later, and loses X mod C. Its mean, theta - C q / (1 - q) with q =
 * exp(-C / theta), is 49.17 steps here and tends to C/2 as theta / C grows:
 * restart-all loses half a checkpoint interval per failure. The loss has sd
 * under C / sqrt(12) = 28.9; over ~5000 failures the mean is within 4
 * standard errors. */
static void test_poisson_half_interval(void) {
  sim_config c = base(8, 1000000);
  const double theta = 1000, C = 100, q = exp(-C / theta), want = theta - C * q / (1 - q);
  c.per_gpu_hour = 3600.0 / theta / 8;
  c.ckpt_every_steps = (int64_t)C;
  double lost = 0, failures = 0;
  for (uint64_t seed = 1; seed <= 5; seed++) {
    sim_result r = run(&c, SIM_RESTART_ALL, seed);
    lost += r.lost_s[SIM_REWORK] / c.step_s;
    failures += (double)r.failures;
  }
  double mean = lost / failures;
  CHECK(failures > 4000 && fabs(mean - want) < 4 * 28.9 / sqrt(failures), "mean loss %.2f steps (want %.2f) over %.0f "
        "failures", mean, want, failures);
  printf("restart-all under Poisson failures: %.2f steps lost per failure (closed form %.2f; C/2 = %.0f) over %.0f "
         "failures\n", mean, want, C / 2, failures);
}

/* A restart of D seconds that starts over whenever a failure lands in it
 * (Poisson, rate lambda): it takes (exp(lambda D) - 1) / lambda on average,
 * one per lambda of training time, so ETTR = exp(-lambda D). Here D = 300 s
 * (detect 10 + restart 250 + load 40), lambda = 1/1000 s: 0.7408. A
 * checkpoint every step (committed at once) leaves half a step of rework a
 * failure: ETTR = 1 / (exp(lambda D) + lambda / 2) = 0.7405. Replace mode
 * with a 300 s survivors' stall that a failure inside it extends to 300 s
 * from then, and replacements back at once: the same. Five runs of ~1300
 * failures each: within 0.01. */
static void test_poisson_exp(void) {
  const double lambda = 1e-3, D = 300, want = 1 / (exp(lambda * D) + lambda / 2);
  sim_config c = base(4, 1000000);
  c.per_gpu_hour = lambda * 3600 / 4;
  c.ckpt_every_steps = 1;
  c.detect_s = 10;
  c.restart_s = 250;
  c.load_s = 40;
  c.redo_s = D - c.detect_s;
  double ettr[2] = {0, 0};
  for (uint64_t seed = 1; seed <= 5; seed++)
    for (int m = 0; m < 2; m++) ettr[m] += run(&c, m, seed).ettr / 5;
  CHECK(fabs(ettr[SIM_RESTART_ALL] - want) < 0.01, "restart-all ETTR %.4f, closed form %.4f", ettr[1], want);
  CHECK(fabs(ettr[SIM_REPLACE] - exp(-lambda * D)) < 0.01, "replace ETTR %.4f, closed form %.4f", ettr[0],
        exp(-lambda * D));
  printf("ETTR under Poisson failures, 300 s lost per failure restarted by the next: restart-all %.4f (closed form "
         "%.4f), replace %.4f (%.4f)\n", ettr[1], want, ettr[0], exp(-lambda * D));
}

/* A hardware failure with no spare: the job waits for its host to come
 * back from repair. Fails on reaching step 101 (t = 100), detect 5, host
 * back at 600, restart 20, load 7, no checkpoint: all 1000 steps again from
 * 627: wall 1627. With one spare: 100 + 32 + 1000 = 1132. */
static void test_spare_wait(void) {
  sim_config c = base(1, 1000);
  c.hardware_fraction = 1;
  c.repair_s = 500;
  c.detect_s = 5;
  c.restart_s = 20;
  c.load_s = 7;
  c.nchaos = 1;
  c.chaos[0] = (sim_chaos){101, 0};
  sim_result r = run(&c, SIM_RESTART_ALL, 1);
  CHECK(NEAR(r.wall_s, 1627) && NEAR(r.lost_s[SIM_SPARE], 495) && r.spares == 0, "wall %g spare wait %g", r.wall_s,
        r.lost_s[SIM_SPARE]);
  c.spare_fraction = 1;
  r = run(&c, SIM_RESTART_ALL, 1);
  CHECK(NEAR(r.wall_s, 1132) && r.lost_s[SIM_SPARE] == 0 && r.spares == 1, "wall %g", r.wall_s);
}

/* Replace mode with min_replicas = replicas = 2: training pauses from the
 * failure (t = 100) until the replacement is in, 2 + 0.5 + 3 + 4 = 9.5 s
 * later, then the join stalls 1 s: wall = 1000 + 10.5. */
static void test_min_replicas_pause(void) {
  sim_config c = base(2, 1000);
  c.min_replicas = 2;
  c.detect_s = 2;
  c.redo_s = 1;
  c.delay_s = 0.5;
  c.start_s = 3;
  c.catchup_s = 4;
  c.join_s = 1;
  c.nchaos = 1;
  c.chaos[0] = (sim_chaos){101, 0};
  sim_result r = run(&c, SIM_REPLACE, 1);
  CHECK(NEAR(r.wall_s, 1010.5) && NEAR(r.lost_s[SIM_PAUSED], 9.5) && NEAR(r.lost_s[SIM_JOIN], 1), "wall %g paused %g",
        r.wall_s, r.lost_s[SIM_PAUSED]);
}

/* The restart policy's backoff: slot 1 fails three times, delays 1, 2, then
 * 4 capped at 3. Detection 1 s (the survivor's only stall); a step takes 2 s
 * while the slot is missing, so half of each delay is lost: wall = 1000 +
 * 3 * 1 + (1 + 2 + 3) / 2. */
static void test_backoff(void) {
  sim_config c = base(2, 1000);
  c.degraded_step_s = 2;
  c.detect_s = 1;
  c.delay_s = 1;
  c.backoff = 2;
  c.delay_max_s = 3;
  c.nchaos = 3;
  for (int i = 0; i < 3; i++) c.chaos[i] = (sim_chaos){100 * (i + 1) + 1, 1};
  sim_result r = run(&c, SIM_REPLACE, 1);
  CHECK(NEAR(r.wall_s, 1006) && NEAR(r.lost_s[SIM_DEGRADED], 3), "wall %g degraded %g", r.wall_s,
        r.lost_s[SIM_DEGRADED]);
}

/* A realistic mix: Poisson failures, 78% hardware, spares that run out,
 * checkpoints with writes. Replace with one replica is restart-all,
 * failure for failure; in both modes the books balance. */
static void test_identities(void) {
  sim_config c = base(1, 20000);
  c.gpus_per_replica = 64;
  c.gpus_per_host = 8;
  c.step_s = c.degraded_step_s = 5;
  c.per_gpu_hour = 1e-2;
  c.hardware_fraction = 0.78;
  c.detect_s = 3;
  c.redo_s = 10;
  c.delay_s = 1;
  c.start_s = 60;
  c.catchup_s = 30;
  c.join_s = 5;
  c.restart_s = 300;
  c.load_s = 40;
  c.ckpt_every_steps = 50;
  c.ckpt_stall_s = 0.5;
  c.ckpt_write_s = 60;
  c.spare_fraction = 0.125;
  c.repair_s = 4 * 3600;
  for (uint64_t seed = 1; seed <= 3; seed++) {
    sim_result a = run(&c, SIM_REPLACE, seed), b = run(&c, SIM_RESTART_ALL, seed);
    CHECK(a.failures > 10 && a.wall_s == b.wall_s && a.failures == b.failures && a.rework_steps == b.rework_steps,
          "seed %llu: replace(1 replica) wall %g vs restart-all %g", (unsigned long long)seed, a.wall_s, b.wall_s);
  }
  c.replicas = 16;
  c.per_gpu_hour = 1e-3;
  c.degraded_step_s = 5.5;
  for (int m = 0; m < 2; m++) {
    sim_result r = run(&c, m, 7);
    CHECK(r.finished && fabs(r.wall_s - r.useful_s - lost_sum(&r)) < 1e-6 * r.wall_s,
          "mode %d: wall %g != useful %g + lost %g", m, r.wall_s, r.useful_s, lost_sum(&r));
    CHECK(r.goodput <= r.ettr + 1e-12 && r.ettr < 1, "mode %d: goodput %g ettr %g", m, r.goodput, r.ettr);
  }
}

static void test_bad_config(void) {
  sim_config c = base(2, 100);
  sim_result r;
  c.min_replicas = 3;
  CHECK(sim_run(&c, SIM_REPLACE, 1, &r) == TR_EINVAL && strstr(tr_error(), "min_replicas"), "%s", tr_error());
  c = base(2, 100);
  c.nchaos = 1;
  c.chaos[0] = (sim_chaos){10, 2};
  CHECK(sim_run(&c, SIM_REPLACE, 1, &r) == TR_EINVAL && strstr(tr_error(), "replica"), "%s", tr_error());
  c = base(2, 100);
  c.detect_s = -1;
  CHECK(sim_run(&c, SIM_REPLACE, 1, &r) == TR_EINVAL, "negative detect_s accepted");
}

int main(void) {
  test_no_failures();
  test_periodic_replace();
  test_restart_all_at_steps();
  test_uncommitted_checkpoint();
  test_poisson_half_interval();
  test_poisson_exp();
  test_spare_wait();
  test_min_replicas_pause();
  test_backoff();
  test_identities();
  test_bad_config();
  return check_report("test_sim");
}
