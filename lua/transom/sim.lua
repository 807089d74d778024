-- transom.sim — the scenario file of `transom sim`: schema, loading,
-- checking, --set overrides, and resolving it at a GPU count.
--
-- A scenario is a Lua chunk that returns one declarative table (see
-- examples/sim/). It runs in the same sandbox as a job file. Every key is
-- checked against SCHEMA: an unknown key, a wrong type or an out-of-range
-- value is an error naming the file, the line and the key. A cost may be a
-- function of the job's size, c = { gpus, replicas, gpus_per_replica,
-- gpus_per_host, hosts }, called once per GPU count of a sweep and checked
-- like a number. Called from C (core/sim/sim_scenario.c) under the
-- declarative-file budget; the simulation itself is C (core/sim/sim.c).

local schema = require("transom.schema")
local fail, line_of, check_value, describe = schema.fail, schema.line_of, schema.check_value, schema.describe

local M = {}

-- { key, type, default, help, min/max/gt/lt/enum, optional = true,
--   size = true (part of the size context: a number, never a function) }.
-- default nil and not optional: required.
local GROUPS = {
  { "job", "the training job", {
    { "gpus_per_replica", "integer", nil, "GPUs in one data-parallel replica", min = 1, size = true },
    { "replicas", "integer", 1, "data-parallel replicas (a sweep sets it: gpus / gpus_per_replica)", min = 1,
      size = true },
    { "gpus_per_host", "integer", 8, "GPUs per host: a hardware failure takes one host down", min = 1, size = true },
    { "min_replicas", "integer", 1, "with fewer live replicas training pauses (replace mode)", min = 1 },
    { "steps", "integer", nil, "optimizer steps the job runs", min = 1 },
    { "step_s", "number", nil, "seconds a step takes with every replica live", gt = 0 },
    { "degraded_step_s", "number", nil, "seconds a step takes while a replica is missing (default step_s)", gt = 0,
      optional = true },
    { "startup_s", "number", 0, "seconds from submission to the first step", min = 0 },
  } },
  { "failures", "the failure process", {
    { "per_gpu_hour", "number", 0, "Poisson failures per allocated GPU per hour", min = 0 },
    { "hardware_fraction", "number", 1, "share of failures that take a host down (need a spare host)", min = 0,
      max = 1 },
    { "every_s", "number", 0, "also a failure every this many seconds of wall time (0 = none)", min = 0 },
    { "chaos", "list", nil, "failures at steps, as a job's chaos list: { {at_step = 50, replica = 1}, ... }",
      optional = true, fields = {
        { "at_step", "integer", nil, "the replica fails on reaching this step", min = 1 },
        { "replica", "integer", nil, "replica slot", min = 0 },
      } },
    { "detect_s", "number", nil, "seconds from a failure until it is known", min = 0 },
  } },
  { "checkpoint", "checkpoints", {
    { "every_steps", "integer", 0, "a snapshot every N steps (0 = none: a restart goes back to step 0)", min = 0 },
    { "stall_s", "number", 0, "seconds a snapshot holds training up", min = 0 },
    { "write_s", "number", 0, "seconds from a snapshot until it is committed", min = 0 },
    { "load_s", "number", 0, "seconds a restart takes to load it", min = 0 },
  } },
  { "replace", "transom's replace mode", {
    { "redo_s", "number", nil, "survivors' stall after detection: abort, new epoch, redo of the all-reduce", min = 0 },
    { "delay_s", "number", 0, "restart policy's delay before a replacement", min = 0 },
    { "backoff", "number", 1, "the delay is multiplied by this for each earlier replacement of the slot", min = 1 },
    { "delay_max_s", "number", 0, "the delay's cap (0 = none)", min = 0 },
    { "start_s", "number", nil, "seconds to start a replacement (scheduling, process, device, communicator)",
      min = 0 },
    { "catchup_s", "number", nil, "seconds the replacement catches up from a donor (others train on)", min = 0 },
    { "join_s", "number", 0, "survivors' stall when a replacement enters the ring", min = 0 },
  } },
  { "restart_all", "restart-all (torchrun's way)", {
    { "restart_s", "number", nil, "seconds to stop and restart every replica, before the checkpoint load", min = 0 },
  } },
  { "hosts", "spare hosts", {
    { "spare_fraction", "number", 0, "spare hosts as a share of the job's hosts", min = 0 },
    { "repair_s", "number", 0, "seconds until a failed host is a spare again (0 = at once)", min = 0 },
  } },
}

local TOP = {
  { "name", "string", nil, "scenario name (default: the file's name)", optional = true },
  { "seeds", "integer", 5, "runs per point, each with its own failures (their mean is reported)", min = 1,
    max = 1000 },
  { "sweep", "table", nil, "{ gpus = {1024, 2048, ...} }: a table and a plot against the GPU count",
    optional = true, fields = {
      { "gpus", "intlist", nil, "GPU counts (each a multiple of job.gpus_per_replica)" },
    } },
  { "sensitivity", "table", nil, "{ gpus = N, factor = 2 }: each cost times and divided by factor at N GPUs",
    optional = true, fields = {
      { "gpus", "integer", nil, "GPU count (a multiple of job.gpus_per_replica)", min = 1 },
      { "factor", "number", 2, "how far each cost moves", gt = 1 },
    } },
  { "reference", "list", nil, "published points drawn beside the simulation: { {gpus =, ettr =, mode =, label =} }",
    optional = true, fields = {
      { "gpus", "integer", nil, "GPU count", min = 1 },
      { "ettr", "number", nil, "effective training time ratio", min = 0, max = 1 },
      { "mode", "string", nil, "which curve it compares with", enum = { "replace", "restart_all" } },
      { "label", "string", nil, "where it comes from" },
    } },
}

local GROUP, FIELD, NAMES = {}, {}, {}
for _, g in ipairs(GROUPS) do
  GROUP[g[1]] = g
  NAMES[#NAMES + 1] = g[1]
  for _, f in ipairs(g[3]) do
    FIELD[g[1] .. "." .. f[1]] = f
    NAMES[#NAMES + 1] = g[1] .. "." .. f[1]
  end
end
local TOPF = {}
for _, f in ipairs(TOP) do
  TOPF[f[1]] = f
  NAMES[#NAMES + 1] = f[1]
end

local function suggest(key) return schema.suggest(key, NAMES) end

-- --- checking -------------------------------------------------------------

-- A list of integers (sweep.gpus).
local function check_intlist(key, v, where)
  if type(v) ~= "table" or #v == 0 then where("key '%s' must be a non-empty list of integers", key) end
  for k, x in pairs(v) do
    if math.type(k) ~= "integer" or k < 1 or k > #v then where("key '%s' must be a list (1..n)", key) end
    if math.type(x) ~= "integer" or x < 1 then where("key '%s' must hold positive integers, got %s", key, describe(x)) end
  end
end

-- A list of tables, each checked against `fields` (chaos, reference).
local function check_list(key, fields, v, at)
  local lk = key:match("([%w_]+)$") -- the name a line is looked up by
  if type(v) ~= "table" then at(lk)("key '%s' must be a list of tables, got %s", key, describe(v)) end
  local by = {}
  for _, sf in ipairs(fields) do by[sf[1]] = sf end
  for k in pairs(v) do
    if math.type(k) ~= "integer" or k < 1 or k > #v then at(lk)("key '%s' must be a list (1..n)", key) end
  end
  for i, item in ipairs(v) do
    if type(item) ~= "table" then at(lk)("%s[%d] must be a table, got %s", key, i, describe(item)) end
    for k in pairs(item) do
      if type(k) ~= "string" or not by[k] then
        at(type(k) == "string" and k or lk)("%s[%d]: '%s' is not a %s field", key, i, tostring(k), key)
      end
    end
    for _, sf in ipairs(fields) do
      if item[sf[1]] == nil then
        if sf[3] == nil then at(lk)("%s[%d]: '%s' is missing (%s)", key, i, sf[1], sf[4]) end
        item[sf[1]] = sf[3]
      end
      check_value(setmetatable({ key .. "[" .. i .. "]." .. sf[1] }, { __index = sf }), item[sf[1]], at(sf[1]))
    end
  end
end

-- One field of a table: fills its default; checks its value (a function is
-- checked when resolved).
local function check_field(tbl, f, qual, at)
  local v = tbl[f[1]]
  if v == nil then
    if f[3] == nil and not f.optional then
      at(nil)("required key '%s' is missing (%s)", qual, f[4])
    end
    tbl[f[1]] = f[3]
    return
  end
  local named = setmetatable({ qual }, { __index = f })
  if f[2] == "list" then check_list(qual, f.fields, v, at)
  elseif f[2] == "intlist" then check_intlist(qual, v, at(f[1]))
  elseif type(v) == "function" and not f.size and (f[2] == "number" or f[2] == "integer") then return
  else check_value(named, v, at(f[1])) end
end

-- A table-valued key: no unknown keys, then each field.
local function check_table(scn, key, fields, at)
  local t = scn[key]
  if t == nil then t = {} scn[key] = t end
  if type(t) ~= "table" then at(key)("key '%s' must be a table, got %s", key, describe(t)) end
  local by = {}
  for _, f in ipairs(fields) do by[f[1]] = f end
  for k in pairs(t) do
    if type(k) ~= "string" or not by[k] then
      local q = key .. "." .. tostring(k)
      at(type(k) == "string" and k or key)("key '%s' is not a scenario field%s", q, suggest(q))
    end
  end
  for _, f in ipairs(fields) do check_field(t, f, key .. "." .. f[1], at) end
end

-- Checks a raw scenario in place. origin(key) returns (source, line).
function M.check(scn, origin)
  local function at(key)
    local source, line = origin(key)
    return function(fmt, ...) fail(source, line, fmt, ...) end
  end
  for k in pairs(scn) do
    if type(k) ~= "string" then fail(origin(nil), nil, "scenario keys must be names, found %s", describe(k)) end
    if not GROUP[k] and not TOPF[k] then at(k)("key '%s' is not a scenario field%s", k, suggest(k)) end
  end
  for _, g in ipairs(GROUPS) do check_table(scn, g[1], g[3], at) end
  for _, f in ipairs(TOP) do
    if f[2] == "table" then
      if scn[f[1]] ~= nil then check_table(scn, f[1], f.fields, at) end
    else
      check_field(scn, f, f[1], at)
    end
  end
  local job = scn.job
  if job.min_replicas > job.replicas then
    at("min_replicas")("job.min_replicas = %d is above job.replicas = %d", job.min_replicas, job.replicas)
  end
  for i, c in ipairs(scn.failures.chaos or {}) do
    if i > 1 and c.at_step < scn.failures.chaos[i - 1].at_step then
      at("chaos")("failures.chaos[%d]: entries must be in step order", i)
    end
  end
  local function multiple(key, n)
    if n % job.gpus_per_replica ~= 0 then
      at("gpus")("%s: %d GPUs is not a multiple of job.gpus_per_replica = %d", key, n, job.gpus_per_replica)
    end
  end
  for _, n in ipairs(scn.sweep and scn.sweep.gpus or {}) do multiple("sweep.gpus", n) end
  if scn.sensitivity then multiple("sensitivity.gpus", scn.sensitivity.gpus) end
  return scn
end

-- --- --set ----------------------------------------------------------------

local function parse_set(item)
  local key, text = item:match("^([%w_%.]+)=(.*)$")
  if not key then fail("--set " .. item, nil, "expected key=value") end
  local f = FIELD[key] or TOPF[key]
  if not f or f[2] == "table" or f[2] == "list" or f[2] == "intlist" then
    fail("--set " .. item, nil, "key '%s' is not a scenario field that --set can change%s", key, suggest(key))
  end
  local v
  if f[2] == "integer" then v = math.tointeger(tonumber(text))
  elseif f[2] == "number" then v = tonumber(text)
  else v = text end
  if v == nil then fail("--set " .. item, nil, "key '%s' must be %s %s", key, f[2] == "integer" and "an" or "a", f[2]) end
  return key, v
end

-- --- loading --------------------------------------------------------------

-- Loads, overrides and checks a scenario file. Returns the checked table
-- (functions kept), or raises {msg, source, line}.
function M.load(path, sets)
  local scn, src = schema.run_file(path, "scenario")
  if type(scn) ~= "table" then fail(path, nil, "a scenario must return a table, got %s", type(scn)) end
  local overridden = {}
  for _, item in ipairs(sets or {}) do
    local key, v = parse_set(item)
    local group, sub = key:match("^([%w_]+)%.([%w_]+)$")
    if group then
      if scn[group] ~= nil and type(scn[group]) ~= "table" then
        fail(path, line_of(src, group), "key '%s' must be a table", group)
      end
      scn[group] = scn[group] or {}
      scn[group][sub] = v
      overridden[sub] = item
    else
      scn[key] = v
      overridden[key] = item
    end
  end
  if scn.name == nil then scn.name = path:match("([^/]+)%.lua$") or path:match("([^/]+)$") end
  M.check(scn, function(key)
    if key and overridden[key] then return "--set " .. overridden[key], nil end
    return path, line_of(src, key)
  end)
  scn._path, scn._src = path, src
  return scn
end

-- --- resolving at a size --------------------------------------------------

-- The flat configuration at `gpus` GPUs (nil: as written): { ["job.steps"] =
-- n, ... } with every function called and its result checked.
function M.resolve(scn, gpus)
  local job = scn.job
  local replicas = job.replicas
  if gpus then replicas = gpus // job.gpus_per_replica end
  local c = {
    gpus = replicas * job.gpus_per_replica, replicas = replicas, gpus_per_replica = job.gpus_per_replica,
    gpus_per_host = job.gpus_per_host,
    hosts = replicas * ((job.gpus_per_replica + job.gpus_per_host - 1) // job.gpus_per_host),
  }
  local out = {}
  for _, g in ipairs(GROUPS) do
    for _, f in ipairs(g[3]) do
      local qual, v = g[1] .. "." .. f[1], scn[g[1]][f[1]]
      if type(v) == "function" then
        v = v(c)
        local where = function(fmt, ...)
          fail(scn._path, line_of(scn._src, f[1]), "%s (at %d GPUs)", string.format(fmt, ...), c.gpus)
        end
        if f[2] == "integer" and math.type(v) == "float" and v == math.floor(v) then v = math.tointeger(v) end
        check_value(setmetatable({ qual }, { __index = f }), v, where)
      end
      if f[2] ~= "list" then out[qual] = v end
    end
  end
  out["job.replicas"] = replicas
  if out["job.degraded_step_s"] == nil then out["job.degraded_step_s"] = out["job.step_s"] end
  if out["job.min_replicas"] > replicas then
    fail(scn._path, line_of(scn._src, "min_replicas"), "job.min_replicas = %d is above %d replicas (at %d GPUs)",
      out["job.min_replicas"], replicas, c.gpus)
  end
  out.chaos = scn.failures.chaos or {}
  return out
end

-- Text for `transom sim --help`.
function M.help()
  local lines = {}
  for _, g in ipairs(GROUPS) do
    lines[#lines + 1] = string.format("  %s = { ... }   %s", g[1], g[2])
    for _, f in ipairs(g[3]) do
      local d = f[3] ~= nil and tostring(f[3]) or (f.optional and "-" or "required")
      lines[#lines + 1] = string.format("    %-18s %-8s %-9s %s", f[1], f[2], d, f[4])
    end
  end
  for _, f in ipairs(TOP) do
    local d = f[3] ~= nil and tostring(f[3]) or "-"
    lines[#lines + 1] = string.format("  %-20s %-8s %-9s %s", f[1], f[2], d, f[4])
  end
  return table.concat(lines, "\n")
end

return M
