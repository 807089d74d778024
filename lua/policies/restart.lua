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
--        restarts_slot = 0, restarts_total = 0,  -- since the operator started
--        time = 812.5,                           -- seconds since the operator started
--        slot_restart_times = { 20.1, 700.4 },   -- this slot's last 32 restarts (same clock)
--        restart_times = { ... } }               -- the job's last 128 (every slot, full restarts)
-- "startup_error": the worker could not start for a reason that repeats on
-- every try (the job file, its data, its checkpoint; its exit status 2).

local M = {}

-- The limits count restarts within a sliding window, not since the start: a
-- job of weeks on a flaky cluster sees dozens of unrelated failures; only a
-- slot (or a job) failing again and again in a short time is broken.
M.window_seconds = 3600       -- the window the limits count in
M.max_restarts_per_slot = 5   -- a slot restarted this often within the window is given up
M.max_restarts_total = 20     -- job-wide, within the window
M.backoff_first = 0.2         -- seconds before the first replacement of a slot
M.backoff_max = 10            -- exponential backoff cap

-- How many of times lie within the window before now.
local function recent(times, now)
  local n = 0
  for _, t in ipairs(times) do
    if now - t < M.window_seconds then n = n + 1 end
  end
  return n
end

-- A replica failed while others survive: replace it (the replacement
-- catches up from a healthy peer) after an exponential backoff.
function M.on_failure(ev, state)
  if ev.reason == "startup_error" then -- the job, its data, its checkpoint: the same on every try
    return { action = "none", detail = "a start-up error is not retried" }
  end
  local slot, all = recent(ev.slot_restart_times, ev.time), recent(ev.restart_times, ev.time)
  if all >= M.max_restarts_total then
    return { action = "none", detail = "job-wide restart budget spent (" .. all .. " in " .. M.window_seconds .. " s)" }
  end
  if slot >= M.max_restarts_per_slot then
    return { action = "none", detail = "slot " .. ev.slot .. " failed too often (" .. slot .. " in " .. M.window_seconds .. " s)" }
  end
  local delay = math.min(M.backoff_max, M.backoff_first * 2 ^ slot)
  return { action = "replace", delay = delay }
end

-- Every replica is gone: start them all again from the newest checkpoint.
function M.on_all_dead(ev, state)
  if ev.reason == "startup_error" then
    return { action = "stop", detail = "a start-up error is not retried" }
  end
  local all = recent(ev.restart_times, ev.time)
  if all >= M.max_restarts_total then
    return { action = "stop", detail = "job-wide restart budget spent (" .. all .. " in " .. M.window_seconds .. " s)" }
  end
  return { action = "restart", delay = M.backoff_first }
end

return M
