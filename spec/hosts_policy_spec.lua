-- hosts_policy_spec.lua — the shipped lua/policies/hosts.lua as plain Lua
-- (the operator runs it on the policy engine, operator_hosts.c): when a
-- host is cordoned and when it is trusted again (never, when cordoned by
-- hand). operator_hosts.c's side (cordon by address, a hand cordon the
-- policy cannot lift) is in spec/c/test_policy.c. Runs inside the transom
-- binary (`transom test spec`).

local ROOT = (debug.getinfo(1, "S").source:match("^@(.*)/spec/[^/]*$")) or "."
local M = dofile(ROOT .. "/lua/policies/hosts.lua")

local function ev(t)
  local e = { host = "h2", addr = "10.77.0.2", reason = "killed", cordoned = false, alive = true, time = 1000,
    cordoned_at = 0, failure_times = {} }
  for k, v in pairs(t) do e[k] = v end
  return e
end

local function action(d) return type(d) == "table" and d.action or d end

describe("hosts.lua", function()
  it("one failure keeps the host; a second within the window cordons it", function()
    assert.equal("none", action(M.on_host(ev({ failure_times = { 990 } }), {})))
    local d = M.on_host(ev({ failure_times = { 700, 990 } }), {})
    assert.equal("cordon", action(d))
    assert.matches("2 failures within 600 s", d.detail, 1, true)
  end)

  it("failures further apart than the window do not add up", function()
    assert.equal("none", action(M.on_host(ev({ failure_times = { 100, 990 } }), {})))
  end)

  it("a lost host counts like any failure; a cordoned host is not cordoned again", function()
    assert.equal("cordon", action(M.on_host(ev({ reason = "host_lost", failure_times = { 980, 990 } }), {})))
    assert.equal("none", action(M.on_host(ev({ cordoned = true, failure_times = { 980, 990 } }), {})))
  end)

  it("a cordoned host is trusted again after trust_after seconds, not before", function()
    local e = ev({ reason = "tick", cordoned = true, cordoned_at = 1000 })
    e.time = 1000 + M.trust_after - 1
    assert.equal("none", action(M.on_host(e, {})))
    e.time = 1000 + M.trust_after
    assert.equal("uncordon", action(M.on_host(e, {})))
    assert.equal("none", action(M.on_host(ev({ reason = "tick" }), {}))) -- not cordoned: nothing to do
  end)

  it("a host cordoned by hand is never trusted again by the policy, however long it waits", function()
    local e = ev({ reason = "tick", cordoned = true, cordoned_by_hand = true, cordoned_at = 1000 })
    for _, dt in ipairs({ M.trust_after, M.trust_after * 10 }) do
      e.time = 1000 + dt
      assert.equal("none", action(M.on_host(e, {})))
    end
    e.reason = "killed" -- a failure on it neither lifts nor renews the cordon
    e.failure_times = { e.time - 1, e.time }
    assert.equal("none", action(M.on_host(e, {})))
  end)
end)
