-- detector_spec.lua — the shipped policy files (lua/policies/rules.lua,
-- lua/policies/actions.lua) as plain Lua in the VM users get, and `transom
-- plot` through the CLI.
--
-- The engine itself (C views, sandbox, instruction hook, hot reload, inotify,
-- Prometheus) is tested by spec/c/test_detector.c, which embeds the detector.
-- Here the rules run on small mock views written in Lua, so a rule's logic
-- can be read next to the case that drives it; the files load in a sandbox
-- like the detector's (no io, os but time/clock, no require/load; undefined
-- globals raise).
-- Runs inside the transom binary (`transom test spec`).

local BIN = assert(os.getenv("TRANSOM_BIN"), "run through `transom test`")
local ROOT = (debug.getinfo(1, "S").source:match("^@(.*)/spec/[^/]*$")) or "."
local POLICIES = ROOT .. "/lua/policies/"

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function sh(cmd)
  local p = io.popen("(" .. cmd .. ") 2>&1; echo \"__rc=$?\"")
  local out = p:read("a")
  p:close()
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  return (out:gsub("__rc=%d+%s*$", "")), rc
end

-- The detector's sandbox, rebuilt in Lua for the spec.
local function sandbox()
  local env = {
    assert = assert, error = error, ipairs = ipairs, next = next, pairs = pairs, select = select,
    tonumber = tonumber, tostring = tostring, type = type, rawequal = rawequal, rawlen = rawlen,
    rawget = rawget, pcall = pcall, print = function() end, _VERSION = _VERSION,
    math = math, string = string, table = table, utf8 = utf8,
    os = { time = os.time, clock = os.clock }, state = {},
  }
  env._G = env
  return setmetatable(env, { __index = function(_, k) error("undefined global '" .. tostring(k) .. "'", 2) end })
end

local function load_policy(name)
  local chunk = assert(loadfile(POLICIES .. name, "t", sandbox()))
  return chunk()
end

-- A mock worker view: fields from `o`, statistics over o.series (oldest first).
local function worker(o)
  local w = {}
  for k, v in pairs(o) do w[k] = v end
  local series = o.series or {}
  w.series = nil
  function w:value(m, ago) local s = series[m] or {}; return s[#s - (ago or 0)] end
  function w:z(m) return o.z and o.z[m] or 0 end
  function w:ewma(m) return o.ewma and o.ewma[m] or 0, 0 end
  function w:median(m)
    local s = {}
    for i, v in ipairs(series[m] or {}) do s[i] = v end
    table.sort(s)
    if #s == 0 then return 0 / 0 end
    return #s % 2 == 1 and s[(#s + 1) // 2] or (s[#s // 2] + s[#s // 2 + 1]) / 2
  end
  function w:run_above(m, x)
    local s, n = series[m] or {}, 0
    for i = #s, 1, -1 do
      if s[i] > x then n = n + 1 else break end
    end
    return n
  end
  return setmetatable(w, { __newindex = function() error("read-only") end })
end

local function fleet(o)
  local f = { size = o.size or 1, step = o.step, progress_age = o.progress_age }
  function f:median(m, except) return o.median and o.median(m, except) or 0 / 0 end
  function f:checksums(step)
    local t, n = {}, 0
    for id, c in pairs(o.checksums and o.checksums[step] or {}) do t[id] = c; n = n + 1 end
    return t, n, o.complete ~= false
  end
  return f
end

local function as_list(r)
  if r == nil then return {} end
  if r.kind then return { r } end
  return r
end

describe("lua/policies/rules.lua", function()
  local R = load_policy("rules.lua")

  it("loads in the sandbox and returns only functions", function()
    local names = {}
    for name, fn in pairs(R) do
      assert.is_function(fn, name)
      names[#names + 1] = name
    end
    table.sort(names)
    assert.same({ "dead", "divergence", "grad_explosion", "hang", "loss_spike", "nan_or_inf_loss", "straggler" }, names)
  end)

  it("keeps its thresholds as plain values at the top", function()
    local f = assert(io.open(POLICIES .. "rules.lua"))
    local text = f:read("a")
    f:close()
    for _, k in ipairs({ "SPIKE_Z", "STRAGGLER_K", "STRAGGLER_MIN_S", "STRAGGLER_M", "HANG_T", "DEAD_T" }) do
      assert.truthy(text:match("\nlocal " .. k .. " = [%d%.e]+"), k)
    end
  end)

  it("every rule is quiet on an empty worker and on a healthy one", function()
    local empty = worker({ id = 1, n = 0, total = 0, progress_age = 1 })
    local healthy = worker({
      id = 0, step = 30, n = 30, total = 30, loss = 2.0, grad_norm = 1.0, compute_s = 0.1,
      heartbeat_age = 0.5, progress_age = 0.2, live_stall = 0, checksum = 7, checksum_step = 30,
      series = { grad_norm = { 1, 1.1, 0.9 }, compute_s = { 0.1, 0.1, 0.1 } },
    })
    local fl = fleet({ size = 2, step = 30, progress_age = 0.2, median = function() return 0.1 end,
                       checksums = { [30] = { [0] = 7, [1] = 7 } } })
    for name, rule in pairs(R) do
      assert.same({}, as_list(rule(empty, fl, {})), name .. " on an empty worker")
      assert.same({}, as_list(rule(healthy, fl, {})), name .. " on a healthy worker")
    end
  end)

  it("nan_or_inf_loss fires on NaN and Inf", function()
    for _, bad in ipairs({ 0 / 0, math.huge, -math.huge }) do
      local a = R.nan_or_inf_loss(worker({ id = 0, step = 9, loss = bad }))
      assert.equal("nan_or_inf_loss", a.kind)
    end
  end)

  it("straggler needs m slow steps in a row against the others' median", function()
    local fl = fleet({ size = 4, median = function(m, except) return 0.1 end })
    local slow = { 0.1, 0.5, 0.5, 0.5, 0.5, 0.5 }
    local w = worker({ id = 1, step = 6, compute_s = 0.5, series = { compute_s = slow } })
    assert.equal("straggler", R.straggler(w, fl).kind)
    local blip = worker({ id = 1, step = 6, compute_s = 0.5, series = { compute_s = { 0.5, 0.5, 0.1, 0.5, 0.5, 0.5 } } })
    assert.is_nil(R.straggler(blip, fl))
  end)

  -- Steps of a few ms on a busy host: the scheduler holds one replica back
  -- by tens of ms now and then, which is k x its steps but no straggler
  -- (CI's operator specs saw a healthy replica evicted so: 0.044, 0.025,
  -- 0.037, 0.136, 0.056 s against a median of 0.007). Slower by more than
  -- STRAGGLER_MIN_S it is one.
  it("straggler on fast steps needs to be slower by STRAGGLER_MIN_S, not only k x", function()
    local fl = fleet({ size = 3, median = function(m, except) return 0.007 end })
    local noisy = { 0.007, 0.044, 0.025, 0.037, 0.136, 0.056 }
    assert.is_nil(R.straggler(worker({ id = 1, step = 6, compute_s = 0.056, series = { compute_s = noisy } }), fl))
    local slowed = { 0.007, 0.09, 0.088, 0.095, 0.091, 0.09 } -- 80 ms added a step (eagle_spec's slow fault)
    local a = R.straggler(worker({ id = 1, step = 6, compute_s = 0.09, series = { compute_s = slowed } }), fl)
    assert.equal("straggler", a and a.kind)
  end)

  it("hang needs a live heartbeat; dead a lost one", function()
    local fl = fleet({ size = 3, progress_age = 0.1 })
    local hung = worker({ id = 2, step = 10, heartbeat_age = 1, progress_age = 100, live_stall = 99 })
    assert.equal("hang", R.hang(hung, fl).kind)
    assert.is_nil(R.dead(hung))
    local gone = worker({ id = 2, step = 10, heartbeat_age = 100, progress_age = 100, live_stall = 0 })
    assert.is_nil(R.hang(gone, fl))
    assert.equal("dead", R.dead(gone).kind)
    -- stopped just after a step: no step for long, heartbeat not yet lapsed,
    -- but it was never seen alive past its last step (the SIGSTOP race)
    local frozen = worker({ id = 2, step = 10, heartbeat_age = 14, progress_age = 100, live_stall = 0.4 })
    assert.is_nil(R.hang(frozen, fl))
    local stalled = R.hang(hung, fleet({ size = 3, progress_age = 100, step = 10 }))
    assert.equal(-1, stalled.worker)
  end)

  it("divergence names the minority, or the fleet when there is no majority", function()
    local fl = fleet({ size = 3, checksums = { [40] = { [0] = 5, [1] = 5, [2] = 6 } } })
    local a = R.divergence(worker({ id = 2, checksum = 6, checksum_step = 40 }), fl)
    assert.equal("divergence", a.kind)
    assert.equal(40, a.step)
    assert.is_nil(R.divergence(worker({ id = 0, checksum = 5, checksum_step = 40 }), fl))
    local split = fleet({ size = 2, checksums = { [40] = { [0] = 5, [1] = 6 } } })
    assert.equal(-1, R.divergence(worker({ id = 0, checksum = 5, checksum_step = 40 }), split).worker)
    local partial = fleet({ size = 3, complete = false, checksums = { [40] = { [0] = 5, [2] = 6 } } })
    assert.is_nil(R.divergence(worker({ id = 2, checksum = 6, checksum_step = 40 }), partial))
  end)
end)

describe("lua/policies/actions.lua", function()
  local A = load_policy("actions.lua")
  local valid = { ignore = true, alert = true, evict = true, rollback = true, skip_update = true, checkpoint_now = true }

  local function decide(kind, a, state)
    local p = A[kind] or A.default
    if type(p) == "function" then p = p(a, state or {}, fleet({})) end
    return type(p) == "table" and p.action or p, p
  end

  it("maps to known actions only", function()
    for kind, p in pairs(A) do
      if type(p) == "string" then assert.truthy(valid[p], kind .. " -> " .. p) else assert.is_function(p, kind) end
    end
  end)

  it("has the documented defaults", function()
    local a = { worker = 1, step = 50 }
    local act, full = decide("nan_or_inf_loss", a)
    assert.equal("rollback", act)
    assert.equal(49, full.step)
    assert.equal("skip_update", decide("grad_explosion", a))
    assert.equal("alert", decide("loss_spike", a))
    assert.equal("evict", decide("hang", a))
    assert.equal("alert", decide("hang", { worker = -1, step = 50 }))
    assert.equal("evict", decide("dead", a)) -- a stopped process never exits by itself
    assert.equal("evict", decide("divergence", a))
    assert.equal("rollback", decide("divergence", { worker = -1, step = 50 }))
    assert.equal("alert", decide("something_new", a))
  end)

  it("evicts a straggler only after consecutive reports", function()
    local state = {}
    assert.equal("alert", decide("straggler", { worker = 2, step = 10 }, state))
    assert.equal("alert", decide("straggler", { worker = 2, step = 11 }, state))
    assert.equal("evict", decide("straggler", { worker = 2, step = 12 }, state))
    assert.equal("alert", decide("straggler", { worker = 2, step = 20 }, state))
    assert.equal("alert", decide("straggler", { worker = 2, step = 30 }, state), "a gap starts the count again")
  end)
end)

describe("transom plot", function()
  local has_plot = (sh(q(BIN) .. " plot --help")):match("usage: transom plot") ~= nil
  local has_gnuplot = select(2, sh("command -v gnuplot")) == 0

  it("draws a run's metrics and events into a PNG", function()
    if not has_plot then return pending("this transom has no `plot` command yet (core/cli/main.c dispatch)") end
    if not has_gnuplot then return pending("gnuplot is not installed (detector/test_deps.sh installs gnuplot-nox)") end
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir -p " .. q(dir)))
    local m = assert(io.open(dir .. "/metrics.jsonl", "w"))
    for s = 1, 100 do
      for w = 0, 2 do
        m:write(string.format('{"step":%d,"worker":%d,"loss":%.4f,"step_s":%.4f}\n', s, w, 4 * math.exp(-s / 30), (40 + w) / 1e3))
      end
      if s % 25 == 0 then m:write(string.format('{"step":%d,"val_loss":%.4f}\n', s, 4 * math.exp(-s / 30) + 0.1)) end
    end
    m:close()
    local e = assert(io.open(dir .. "/events.jsonl", "w"))
    e:write('{"time":1,"step":60,"worker":1,"kind":"anomaly","rule":"straggler","detail":"slow"}\n')
    e:write('{"time":1,"step":62,"worker":1,"kind":"action","action":"evict","detail":""}\n')
    e:close()
    local out, rc = sh(q(BIN) .. " plot " .. q(dir) .. " -o " .. q(dir .. "/p.png"))
    assert.equal(0, rc, out)
    local f = assert(io.open(dir .. "/p.png", "rb"))
    assert.equal("\137PNG", f:read(4))
    f:close()
    local _, bad = sh(q(BIN) .. " plot " .. q(dir .. "/missing"))
    assert.equal(1, bad)
    os.execute("rm -rf " .. q(dir))
  end)
end)
