-- restart.lua — what the operator does when a replica fails. Plain Lua
-- functions that get an event table and return an action table; the
-- operator calls them (sandboxed) on every failure. `state` is a table the
-- operator keeps for the policy across calls.
--
-- ev = { slot = 1, reason = "killed" | "exited" | "evicted", signal = 9,
--        code = 0, step = 120, live = 2, replicas = 3,
--        restarts_slot = 0, restarts_total = 0 }

local M = {}

M.max_restarts_per_slot = 5   -- a slot that keeps failing is given up
M.max_restarts_total = 20     -- job-wide budget
M.backoff_first = 0.2         -- seconds before the first replacement of a slot
M.backoff_max = 10            -- exponential backoff cap

-- A replica failed while others survive: replace it (the replacement
-- catches up from a healthy peer) after an exponential backoff.
function M.on_failure(ev, state)
  if ev.restarts_total >= M.max_restarts_total then
    return { action = "none", detail = "job-wide restart budget spent" }
  end
  if ev.restarts_slot >= M.max_restarts_per_slot then
    return { action = "none", detail = "slot " .. ev.slot .. " failed too often" }
  end
  local delay = math.min(M.backoff_max, M.backoff_first * 2 ^ ev.restarts_slot)
  return { action = "replace", delay = delay }
end

-- Every replica is gone: start them all again from the newest checkpoint.
function M.on_all_dead(ev, state)
  if ev.restarts_total >= M.max_restarts_total then
    return { action = "stop", detail = "job-wide restart budget spent" }
  end
  return { action = "restart", delay = M.backoff_first }
end

return M
