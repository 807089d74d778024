-- restart.lua — what the operator does when a replica fails. Plain Lua
-- functions that get an event table and return a decision; the operator
-- calls them on every failure. `state` is a table the operator keeps for the
-- policy across calls and reloads.
--
-- Loaded by the policy engine (core/lua/policy.c) like rules.lua and
-- actions.lua: sandboxed, strict globals (a misspelled name is an error at
-- load, naming the line: keep helpers in locals), an instruction budget per
-- call, and hot reload: save it while the job runs and, once it loads and
-- both handlers pass a dry run, it is in force; otherwise the previous
-- version stays and events.jsonl says why. When a handler raises, runs past
-- its budget or returns no valid decision, the operator decides by the
-- built-in rule (what this file does by default) and logs a policy_error.
--
-- Decisions: on_failure -> "replace" | "none"; on_all_dead -> "restart" |
-- "stop"; as a string or { action = ..., delay = seconds, detail = "..." }.
--
-- ev = { slot = 1, reason = "killed" | "exited" | "evicted" | "startup_error",
--        signal = 9, code = 0, step = 120, live = 2, replicas = 3,
--        restarts_slot = 0, restarts_total = 0 }
-- "startup_error": the worker could not start for a reason that repeats on
-- every try (the job file, its data, its checkpoint; its exit status 2).

local M = {}

M.max_restarts_per_slot = 5   -- a slot that keeps failing is given up
M.max_restarts_total = 20     -- job-wide budget
M.backoff_first = 0.2         -- seconds before the first replacement of a slot
M.backoff_max = 10            -- exponential backoff cap

-- A replica failed while others survive: replace it (the replacement
-- catches up from a healthy peer) after an exponential backoff.
function M.on_failure(ev, state)
  if ev.reason == "startup_error" then -- the job, its data, its checkpoint: the same on every try
    return { action = "none", detail = "a start-up error is not retried" }
  end
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
  if ev.reason == "startup_error" then
    return { action = "stop", detail = "a start-up error is not retried" }
  end
  if ev.restarts_total >= M.max_restarts_total then
    return { action = "stop", detail = "job-wide restart budget spent" }
  end
  return { action = "restart", delay = M.backoff_first }
end

return M
