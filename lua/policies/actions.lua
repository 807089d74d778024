-- actions.lua — what the operator does about each anomaly the rules raise.
-- Edit it while a job runs: the operator reloads it when it changes (a
-- version that fails to load or to run on a dry run is refused; the one in
-- force stays, and events.jsonl says why).
--
-- Each entry maps an anomaly kind to an action name, or to a
-- function(anomaly, state, fleet) returning an action name, a table
-- { action = "rollback", step = 120, worker = 2, detail = "..." } or nil
-- (= "ignore"). `default` covers kinds without an entry.
--
-- anomaly = { kind, worker (-1: the whole fleet), step, severity, detail, rule, time }
-- Actions:
--   evict           kill the replica; the restart policy replaces it
--   rollback        every replica reloads the newest checkpoint at or before
--                   `step` (default: the anomaly's step - 1) and never draws
--                   the anomaly's batch again (the steps before it keep theirs)
--   skip_update     drop the optimizer update of `step` if it is still ahead
--                   (3 steps or more), else of the next step every replica
--                   can agree on (the default: the anomaly's own update was
--                   already applied when its step was reported)
--   alert           an event, nothing else
--   checkpoint_now  snapshot as soon as possible
--   ignore          nothing (still an event)

-- thresholds --------------------------------------------------------------
local STRAGGLER_EVICT_AFTER = 3   -- straggler anomalies on consecutive steps before evicting
                                  -- (each already means STRAGGLER_M slow steps in a row)

local A = {}

-- A NaN/Inf loss poisons the parameters from this step on: go back to before it.
function A.nan_or_inf_loss(a)
  return { action = "rollback", step = a.step - 1, detail = "loss not finite at step " .. a.step }
end

A.grad_explosion = "skip_update"
A.loss_spike = "alert"

-- A straggler slows every replica down (they wait for it in the all-reduce);
-- evict it once it has been slow for a while, so the restart policy gives
-- the slot a fresh process.
function A.straggler(a, state)
  state.straggler = state.straggler or {}
  local s = state.straggler[a.worker]
  if s == nil or a.step ~= s.last + 1 then s = { n = 0 } end
  s.n, s.last = s.n + 1, a.step
  state.straggler[a.worker] = s
  if s.n >= STRAGGLER_EVICT_AFTER then
    state.straggler[a.worker] = nil
    return { action = "evict", detail = "slow for " .. s.n .. " straggler reports in a row" }
  end
  return "alert"
end

-- One replica hung: evict it (the others go on without it). The whole fleet
-- stalled: say so; the all-reduce deadline drops the replica that hangs.
function A.hang(a)
  if a.worker < 0 then return "alert" end
  return "evict"
end

-- No heartbeat: the process died, or was stopped (SIGSTOP) and never exits
-- on its own. Evict: the operator kills it (a no-op for a process already
-- gone) and the restart policy replaces it.
A.dead = "evict"

-- Silent data corruption: evict the replica that differs from the majority
-- (its replacement catches up from a healthy one); with no majority, nobody
-- can be trusted: roll everyone back to before the checksum step.
function A.divergence(a)
  if a.worker < 0 then
    return { action = "rollback", step = a.step - 1, detail = "no majority among the parameter checksums" }
  end
  return "evict"
end

A.default = "alert"

return A
