-- rules.lua — the detector's anomaly rules. Edit it while a job runs: the
-- operator reloads it when it changes (a version that fails to load or to run
-- on a dry run is refused; the one in force stays, and events.jsonl says why).
--
-- A rule is a function(w, fleet, state) called for every known worker at
-- every detector tick (after each fleet step, and every second). It returns
-- nil, one anomaly, or a list of them:
--   { kind = "straggler", severity = "warning", detail = "...",
--     worker = w.id (default), step = w.step (default) }
-- An anomaly is reported once per (rule, kind, worker, step); actions.lua
-- decides what happens.
--
-- w (read-only): w.id, w.step, w.n (steps kept), w.total, w.time, w.now,
--   w.progress_age (s since its last step), w.heartbeat_age (s since its last
--   heartbeat; nil if it never sent one), w.live_stall (s from its last step
--   to its latest heartbeat: how long it is known to have been alive without
--   progressing; it stops growing when the process stops), w.checksum, w.checksum_step, and the
--   latest value of every metric: loss, grad_norm, lr, step_s, data_s,
--   forward_s, backward_s, allreduce_s (what the step waited for),
--   comm_s (how long the all-reduce ran, overlapped with backward or not),
--   optimizer_s, ckpt_wait_s, tokens_per_s, rss_bytes,
--   compute_s (= step_s - allreduce_s).
--   Statistics in C: w:z(m) (latest against the EWMA before it), w:ewma(m)
--   -> mean, std, w:median(m, n), w:mad(m, n), w:mean(m, n),
--   w:percentile(m, p, n), w:run_above(m, x) (latest steps in a row > x),
--   w:value(m, ago), w:step_at(ago), w:series(m, n), w:checksum_at(step).
-- fleet (read-only): fleet.now, fleet.step, fleet.min_step, fleet.size,
--   fleet.progress_age, fleet:median(m, except_worker), fleet:mad, fleet:mean,
--   fleet:percentile(m, p, except), fleet:ids(), fleet:worker(id),
--   fleet:checksums(step) -> {[worker] = crc}, count, complete.
-- state: a table kept across calls and reloads (use state.<rule name>);
-- at this file's top level `state` is a scratch table (set things up in
-- the rules themselves).
--
-- Sandbox: math, string, table, utf8, os.time, os.clock, pairs, ipairs, ...;
-- no io, os.execute, require, load. Reading an undefined global is an
-- error. Each call has an instruction budget.

-- thresholds --------------------------------------------------------------
local SPIKE_Z = 6             -- loss_spike: z-score of the loss against its EWMA
local SPIKE_MIN_RISE = 0.25   --   and at least 25 % above the EWMA mean
local SPIKE_WARMUP = 20       --   steps seen before it may fire
local GRAD_MAX = 1e4          -- grad_explosion: gradient norm above this,
local GRAD_RATIO = 10         --   or this many times its median over
local GRAD_WINDOW = 50        --   the last 50 steps
local GRAD_WARMUP = 20        --   (after 20 steps)
local STRAGGLER_K = 3.0       -- straggler: compute time above k x the others' median
local STRAGGLER_MIN_S = 0.05  --   and at least this many seconds above it (a busy host's
                              --   scheduler delays a process by tens of ms: with steps
                              --   of a few ms that alone is k x, and no reason to evict)
local STRAGGLER_M = 5         --   for m steps in a row
local HANG_T = 60             -- hang: seconds without a step while the heartbeat lives
local STARTUP_T = 600         --   (before its first step: loading, catching up)
local DEAD_T = 15             -- dead: seconds without a heartbeat
local DIVERGENCE_MIN = 2      -- divergence: replicas that must report a checksum at the step
local DIVERGENCE_WAIT = 20    --   steps to wait for a replica that has not reported it yet

-- helpers -----------------------------------------------------------------
local function finite(x) return x ~= nil and x == x and x ~= math.huge and x ~= -math.huge end
local function fmt(...) return string.format(...) end

local R = {}

-- NaN or Inf in the loss: the step's update is poison.
function R.nan_or_inf_loss(w)
  if w.step == nil or finite(w.loss) then return nil end
  return { kind = "nan_or_inf_loss", severity = "critical",
           detail = fmt("loss is %s at step %d", tostring(w.loss), w.step) }
end

-- The loss jumps far above its recent level.
function R.loss_spike(w)
  if w.step == nil or w.total < SPIKE_WARMUP or not finite(w.loss) then return nil end
  local z = w:z("loss")
  local mean = w:ewma("loss")
  if z > SPIKE_Z and w.loss > mean * (1 + SPIKE_MIN_RISE) then
    return { kind = "loss_spike", severity = "warning",
             detail = fmt("loss %.4g is %.1f sigma above its average %.4g", w.loss, z, mean) }
  end
end

-- The gradient norm is not finite, absurdly large, or far above its median.
function R.grad_explosion(w)
  if w.step == nil then return nil end
  local g = w.grad_norm
  -- a non-finite norm: the replicas never apply that update (a built-in
  -- guard), and nan_or_inf_loss reports the step
  if not finite(g) then return nil end
  if g > GRAD_MAX then
    return { kind = "grad_explosion", severity = "critical",
             detail = fmt("gradient norm %.4g above the ceiling %.4g", g, GRAD_MAX) }
  end
  if w.total >= GRAD_WARMUP then
    local med = w:median("grad_norm", GRAD_WINDOW)
    if med > 0 and g > GRAD_RATIO * med then
      return { kind = "grad_explosion", severity = "warning",
               detail = fmt("gradient norm %.4g is %.1fx its median %.4g", g, g / med, med) }
    end
  end
end

-- One replica's own work (step time less the all-reduce wait) is k times the
-- others' for m steps in a row. The others wait for it in the all-reduce, so
-- their step_s rises too; compute_s does not.
function R.straggler(w, fleet)
  if w.step == nil or fleet.size < 2 then return nil end
  local med = fleet:median("compute_s", w.id)
  if not finite(med) or med <= 0 then return nil end
  local run = w:run_above("compute_s", math.max(STRAGGLER_K * med, med + STRAGGLER_MIN_S))
  if run >= STRAGGLER_M then
    return { kind = "straggler", severity = "warning",
             detail = fmt("compute %.3f s is %.1fx the others' median %.3f s, %d steps in a row",
                          w.compute_s, w.compute_s / med, med, run) }
  end
end

-- Alive (heartbeats keep coming) but not progressing. The evidence is
-- live_stall, the time from its last step to its latest heartbeat: a stopped
-- or dead process sends none, so however HANG_T and DEAD_T are set it can
-- never look hung (that is "dead"). When no replica progresses, the fleet is
-- stalled (worker -1): the culprit is not known from here.
function R.hang(w, fleet)
  local hb = w.heartbeat_age
  if hb == nil or hb > DEAD_T or w.live_stall == nil then return nil end
  local limit = w.step and HANG_T or STARTUP_T
  if w.live_stall <= limit then return nil end
  if fleet.size > 1 and fleet.progress_age and fleet.progress_age > limit then
    return { kind = "hang", worker = -1, step = fleet.step or -1, severity = "critical",
             detail = fmt("no replica made progress for %.0f s", fleet.progress_age) }
  end
  return { kind = "hang", severity = "critical",
           detail = fmt("no step for %.0f s while its heartbeat lives (%.1f s ago)", w.live_stall, hb) }
end

-- The heartbeat stopped: the process is dead or stopped (SIGSTOP).
function R.dead(w)
  local hb = w.heartbeat_age
  if hb == nil or hb <= DEAD_T then return nil end
  return { kind = "dead", severity = "critical", detail = fmt("no heartbeat for %.0f s", hb) }
end

-- Replicas hold the same parameters bit for bit; a checksum that differs
-- from the majority's at the same step is silent data corruption.
function R.divergence(w, fleet)
  local s = w.checksum_step
  if s == nil then return nil end
  local sums, n, complete = fleet:checksums(s)
  if n < DIVERGENCE_MIN then return nil end
  if not complete and (fleet.step or s) < s + DIVERGENCE_WAIT then return nil end -- a slow or stopped replica
  local votes, best, best_n = {}, nil, 0
  for _, crc in pairs(sums) do votes[crc] = (votes[crc] or 0) + 1 end
  for crc, k in pairs(votes) do
    if k > best_n or (k == best_n and crc < best) then best, best_n = crc, k end
  end
  local mine = sums[w.id]
  if best_n * 2 > n then
    if mine ~= best then
      return { kind = "divergence", step = s, severity = "critical",
               detail = fmt("parameter checksum %08x at step %d differs from %d of %d replicas (%08x)",
                            mine, s, best_n, n, best) }
    end
  else
    return { kind = "divergence", worker = -1, step = s, severity = "critical",
             detail = fmt("replicas disagree at step %d with no majority (%d checksums)", s, n) }
  end
end

return R
