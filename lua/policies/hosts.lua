-- hosts.lua — when the operator stops placing replicas on a host (cordon)
-- and when it trusts it again (uncordon). Loaded like restart.lua (the job's
-- policies folder, else lua/policies; sandboxed, strict globals, an
-- instruction budget, hot-reloaded; a handler that raises or returns
-- something else leaves the host as it is, with a policy_error event).
--
-- on_host(ev, state) is called when a worker on a host fails or the host is
-- lost (ev.reason: "killed", "exited", "evicted", "host_lost", ...), and
-- about once a second for every cordoned host (ev.reason = "tick").
--
-- ev = { host = "h2", addr = "10.77.0.2", reason = "host_lost",
--        cordoned = false, alive = true,
--        time = 812.5,                 -- seconds since the operator started
--        cordoned_at = 0,              -- when it was cordoned (same clock)
--        cordoned_by_hand = false,     -- cordon(h) from attach: stays until uncordon(h)
--        failure_times = { 20.1, 700.4 } } -- its last 16 failures
-- Decisions: "cordon" | "uncordon" | "none" (or { action = ..., detail = "..." }).
-- A lost host is gone until its agent registers again; cordoning it too
-- keeps it out once it is back, until uncordoned. A host an operator
-- cordoned by hand is theirs: trust_after does not lift it, and the
-- operator ignores an "uncordon" from here for it (only uncordon(h) does).

local M = {}

M.failures = 2          -- this many failures ...
M.window_seconds = 600  -- ... within this many seconds cordon the host
M.trust_after = 1800    -- a host this policy cordoned is trusted again after this many seconds (0 = never)

local function recent(times, now)
  local n = 0
  for _, t in ipairs(times) do
    if now - t <= M.window_seconds then n = n + 1 end
  end
  return n
end

function M.on_host(ev, state)
  if ev.reason == "tick" then
    if ev.cordoned and not ev.cordoned_by_hand and M.trust_after > 0 and ev.time - ev.cordoned_at >= M.trust_after then
      return { action = "uncordon", detail = "trusted again after " .. M.trust_after .. " s" }
    end
    return "none"
  end
  local n = recent(ev.failure_times, ev.time)
  if not ev.cordoned and n >= M.failures then
    return { action = "cordon", detail = n .. " failures within " .. M.window_seconds .. " s" }
  end
  return "none"
end

return M
