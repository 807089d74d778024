-- transom.job — the job file: schema, loading, checking, --set overrides.
--
-- A job file is a Lua chunk that returns one declarative table:
--
--     return { model = "gpt", data = "data/fortunes.txt", n_layer = 4 }
--
-- It runs in a sandbox (no io, no os.execute, no require; reading an
-- undefined global is an error). Every key is checked against SCHEMA: an
-- unknown key, a wrong type or an out-of-range value is an error naming the
-- file, the line and the key. Called from C (core/train/job.c) before anything is
-- written; `transom run --help` prints the schema.

local M = {}

-- The first line of a run's own job.lua (M.dump).
local RESOLVED = "-- resolved job, written by transom\n"

-- type: "string" | "integer" | "number" | "boolean" | "table"; min/max
-- inclusive; gt/lt strict; enum: allowed strings; default nil means
-- "required" unless optional. A "table" field has its own `fields` schema and
-- takes its defaults from the policy file lua/policies/<policy>.lua.
-- path = true: the value names files, relative to the working directory
-- (data and val_data: one a line); path = "lua": only when it looks like a
-- path (has a '/' or ends in .lua; else a name: "gpt", "opfence"). M.dump
-- writes them absolute.
local CHECKPOINT = {
  { "every_steps", "integer", nil, "snapshot every N steps (0 = not by count)", min = 0 },
  { "every_seconds", "number", nil, "snapshot every T seconds (0 = not by time)", min = 0 },
  { "keep_last", "integer", nil, "keep the newest K checkpoints", min = 1, max = 1000000 },
  { "keep_every", "integer", nil, "also keep steps divisible by M (0 = none)", min = 0 },
  { "when_busy", "string", nil, "when the disk is still writing: skip or coalesce", enum = { "skip", "coalesce" } },
  { "map_mb", "integer", nil, "LMDB map size in MiB (0 = automatic)", min = 0, max = 1 << 30 },
  { "remote", "string", nil, "remote level: a directory on another disk or a shared file system (\"\" = none)",
    path = true },
  { "remote_rate_mb", "number", nil, "remote copies' average rate in MiB/s (0 = no limit)", min = 0 },
}

local PIPELINE = {
  { "stages", "integer", nil, "pipeline stages: worker processes the op order is cut into (1 = none)", min = 1,
    max = 64 },
  { "micro_batches", "integer", nil, "micro-batches per step (must divide batch_size), 1F1B across the stages",
    min = 1, max = 4096 },
  { "placement", "string", nil, "opfence (clusters by bandwidth, cuts and places for the bottleneck), even (equal "
    .. "FLOPs, workers in order), or a Lua policy file returning function(plan) -> {cuts =, order =}", path = "lua" },
  { "compression", "string", nil, "what crosses a link: none, or adatopk (top-k per link, k from its bandwidth)",
    enum = { "none", "adatopk" } },
  { "min_density", "number", nil, "adatopk: the smallest fraction of a gradient kept", gt = 0, max = 1 },
  { "act_min_density", "number", nil, "adatopk: the smallest fraction of an activation kept", gt = 0, max = 1 },
  { "workers", "list", nil, "one per stage: { {speed = 0.5, zone = \"b\"}, ... } (empty: all alike, one zone)",
    fields = {
      { "speed", "number", 1.0, "emulated speed, a fraction of this host's (compute is stretched by 1/speed)",
        gt = 0, max = 1 },
      { "zone", "string", "local", "workers in one zone share its LAN; between zones the WAN" },
      { "netns", "string", "", "run this worker in that network namespace (a test host; needs root): "
        .. "\"\" = this host's" },
      { "address", "string", "", "where the other workers reach this one (with netns: its address there; "
        .. "\"\" = 127.0.0.1)" },
    } },
  { "lan_mbit", "number", nil, "emulated bandwidth inside a zone, Mbit/s (0 = unlimited)", min = 0 },
  { "wan_mbit", "number", nil, "emulated bandwidth between zones, Mbit/s (0 = unlimited)", min = 0 },
  { "wan_ms", "number", nil, "emulated one-way delay between zones, ms (the transport adds it)", min = 0 },
  { "probe", "boolean", nil, "measure each worker's speed and every link at start (false: use the job's numbers)" },
  { "rebuilds", "integer", nil, "replicas > 1: times a lost pipeline is started again (its workers catch up from "
    .. "a live pipeline's and rejoin) before the others go on without it", min = 0, max = 1000 },
}

local CHAOS = {
  { "at_step", "integer", nil, "inject when the replica reaches this step", min = 1 },
  { "replica", "integer", nil, "replica slot", min = 0 },
  { "fault", "string", nil, "kill | hang | slow | nan | bitflip | fail (the step fails with an error at its "
    .. "all-reduce, with bucket_mb > 0 once its buckets are in flight; the worker then takes ms in its error path "
    .. "before it reports and exits)",
    enum = { "kill", "hang", "slow", "nan", "bitflip", "fail" } },
  { "ms", "integer", 200, "slow: extra milliseconds per step; fail: milliseconds in the error path", min = 0,
    max = 3600000 },
  { "steps", "integer", 0, "slow, nan: for how many steps (0 = slow: until the end, nan: once)", min = 0 },
}

local check_list

local SCHEMA = {
  { "name", "string", nil, "job name (default: the job file's name)", optional = true },
  { "model", "string", "gpt", "model: a file in lua/models/ (gpt, mlp) or a path to a .lua file", path = "lua" },
  { "data", "string", nil, "the training data: a text file (byte-level tokens), or token shards (llm.c .bin, "
    .. "nanoGPT train.bin): a file, a glob, or a list of them", path = true },
  { "val_data", "string", nil, "token shards that validate (default: the last 10% of data's tokens)",
    optional = true, path = true },
  { "data_format", "string", "auto", "auto (token shards when data ends in .bin: llm.c's headered shards, or "
    .. "nanoGPT's headerless train.bin/val.bin), text, llmc, uint16", enum = { "auto", "text", "llmc", "uint16" } },
  { "vocab_size", "integer", nil, "token shards: the vocabulary (GPT-2: 50257; the model pads it to a multiple "
    .. "of 128)", min = 1, max = 16777216, optional = true },
  { "tokenizer", "string", nil, "token shards: the tokenizer that decodes samples (default: tokenizer.bpe beside "
    .. "the first shard, if there is one; `transom prepare` writes it)", optional = true, path = true },
  { "init_from", "string", nil, "start from these weights: a Hugging Face GPT-2 directory (config.json + "
    .. "model.safetensors), e.g. one `transom export --hf` wrote", optional = true, path = true },
  { "n_layer", "integer", 4, "transformer blocks", min = 1, max = 256 },
  { "n_head", "integer", 4, "attention heads (must divide n_embd)", min = 1, max = 1024 },
  { "n_embd", "integer", 128, "embedding width", min = 1, max = 65536 },
  { "block_size", "integer", 64, "context length in tokens", min = 1, max = 65536 },
  { "batch_size", "integer", 12, "sequences per step", min = 1, max = 65536 },
  { "max_steps", "integer", 1000, "optimizer steps", min = 1 },
  { "lr", "number", 1e-3, "peak learning rate", gt = 0 },
  { "min_lr", "number", 1e-4, "learning rate at the end of the cosine decay", min = 0 },
  { "warmup_steps", "integer", 100, "linear warm-up steps", min = 0 },
  { "lr_decay_steps", "integer", nil, "step where the cosine decay reaches min_lr (default: max_steps)", min = 1,
    optional = true },
  { "weight_decay", "number", 0.1, "AdamW decoupled weight decay (matrices only)", min = 0 },
  { "beta1", "number", 0.9, "AdamW beta1", min = 0, lt = 1 },
  { "beta2", "number", 0.99, "AdamW beta2", min = 0, lt = 1 },
  { "eps", "number", 1e-8, "AdamW epsilon", gt = 0 },
  { "grad_clip", "number", 1.0, "clip the global gradient norm to this (0 = off)", min = 0 },
  { "eval_interval", "integer", 250, "steps between validation runs (0 = only at the end)", min = 0 },
  { "eval_steps", "integer", 20, "batches per validation run", min = 1 },
  { "seed", "integer", 1337, "seed for init, batches and sampling", min = 0, max = math.maxinteger },
  { "threads", "integer", 0, "compute threads (0 = all cores)", min = 0, max = 1024 },
  { "device", "string", "cpu", "where the model runs: cpu, cuda (the ext/cuda backend: CUDA kernels, cuBLAS, "
    .. "NCCL), or emu (the CPU kernels behind the device interface, for testing device code paths)",
    enum = { "cpu", "cuda", "emu" } },
  { "precision", "string", "fp32", "activations: fp32, or bf16 (activations and their gradients stored as bf16, "
    .. "parameters, gradients and optimizer fp32)", enum = { "fp32", "bf16" } },
  { "run_dir", "string", nil, "run directory (default runs/<name>-<time>)", optional = true, path = true },
  { "log_interval", "integer", 1, "print a line every this many steps", min = 1 },
  { "sample_tokens", "integer", 200, "tokens generated at the end (0 = none)", min = 0, max = 1 << 24 },
  { "sample_prompt", "string", "\n", "prompt for the final sample" },
  { "temperature", "number", 1.0, "sampling temperature", min = 1e-6, max = 1e6 },
  { "checkpoint", "table", nil, "checkpoint policy overrides (defaults: lua/policies/checkpoint.lua)",
    fields = CHECKPOINT, policy = "checkpoint" },
  { "pipeline", "table", nil, "pipeline stages over worker processes (defaults: lua/policies/pipeline.lua)",
    fields = PIPELINE, policy = "pipeline" },
  { "replicas", "integer", 1, "data-parallel replicas (worker processes) on this host", min = 1, max = 256 },
  { "min_replicas", "integer", 1, "below this many live replicas training pauses for replacements", min = 1,
    max = 256 },
  { "max_replicas", "integer", nil, "most replicas at once (default: replicas)", min = 1, max = 256, optional = true },
  { "on_failure", "string", "replace", "replace (only the failed replica) or restart_all (stop everything, reload "
    .. "the last checkpoint: what torchrun does)", enum = { "replace", "restart_all" } },
  { "deadline", "number", 3.0, "seconds a silent or stalled replica is tolerated before it is dropped", gt = 0 },
  { "bucket_mb", "number", 1.0, "replicas reduce gradients in buckets of this many MiB while backward still "
    .. "runs (0 = one all-reduce after backward)", min = 0, max = 4096 },
  { "hang_seconds", "number", 60, "a replica computing one step this long while the others wait for it is hung "
    .. "(evicted)", gt = 0 },
  { "operator_grace", "number", 60, "seconds a replica waits for a restarted operator (`transom run --resume RUN`) "
    .. "after losing it, holding its state; then it exits without a checkpoint. Also how long replicas and agents "
    .. "wait on an operator that takes none of their bytes (stalled, its host gone silent) before it is lost",
    gt = 0 },
  { "hosts", "integer", 0, "transom agents to wait for before placing replicas on them (0 = this host only: the "
    .. "operator starts the workers itself); needs MASTER_ADDR, the address agents reach the operator at",
    min = 0, max = 256 },
  { "policies", "string", nil, "directory of policy files (default: transom's lua/policies)", optional = true,
    path = true },
  { "checksum_interval", "integer", 50, "replicas report a parameter checksum every N steps (0 = never)", min = 0 },
  { "detector", "boolean", true, "Eagle Eye: rules and policies over the replicas' metrics (false = off)" },
  { "metrics_port", "integer", 0, "Prometheus /metrics on 127.0.0.1:PORT (0 = off)", min = 0, max = 65535 },
  { "chaos", "list", nil, "faults to inject: { {at_step = 50, replica = 1, fault = \"kill\"}, ... }",
    optional = true, fields = CHAOS },
}

-- Keys whose default is another key's value (M.check): a run's job.lua
-- leaves them out at that value, so that on --resume they follow a new one
-- (a value chosen equal to it is taken for the default).
local DERIVED = { max_replicas = "replicas", lr_decay_steps = "max_steps" }

M.SCHEMA = SCHEMA
local BY_KEY = {}
for _, f in ipairs(SCHEMA) do BY_KEY[f[1]] = f end

local schema = require("transom.schema")
local fail, line_of, describe, check_value = schema.fail, schema.line_of, schema.describe, schema.check_value

-- nanoGPT's names for job fields, so that "learning_rate" (or a misspelling
-- of it) suggests the field it means.
local ALIASES = {
  learning_rate = "lr", max_iters = "max_steps", warmup_iters = "warmup_steps",
  lr_decay_iters = "lr_decay_steps", eval_iters = "eval_steps", out_dir = "run_dir",
  dataset = "data", batch = "batch_size", context_length = "block_size", n_embed = "n_embd",
}

local NAMES = {}
for _, f in ipairs(SCHEMA) do NAMES[#NAMES + 1] = f[1] end

local function suggest(key) return schema.suggest(key, NAMES, ALIASES) end

-- --- checking -------------------------------------------------------------

local function by_key(fields)
  local t = {}
  for _, f in ipairs(fields) do t[f[1]] = f end
  return t
end

-- A policy file: a sandboxed chunk returning a table of defaults.
local function load_policy(name)
  -- TRANSOM_LUA_DIR as in lua_host.c (empty = unset), else search
  -- package.path: its first entry is not always transom's (busted prepends)
  local dir = os.getenv("TRANSOM_LUA_DIR")
  local path = dir and dir ~= "" and dir .. "/policies/" .. name .. ".lua"
    or package.searchpath("policies." .. name, package.path)
  if not path then fail("policies/" .. name .. ".lua", nil, "cannot find the policy file on package.path") end
  local src = schema.read_source(path, "policy file")
  local chunk, cerr = load(src, "@" .. path, "t", {})
  if not chunk then error({ msg = cerr, source = path }, 0) end
  local ok, t = pcall(chunk)
  if not ok then error({ msg = type(t) == "table" and t.msg or tostring(t), source = path }, 0) end
  if type(t) ~= "table" then fail(path, nil, "a policy file must return a table") end
  return t, path, src
end

-- Checks a list of tables (chaos): every item against the field's schema.
check_list = function(f, v, at)
  local key = f[1]
  if type(v) ~= "table" then at(key)("key '%s' must be a list of tables, got %s", key, describe(v)) end
  local fields = by_key(f.fields)
  local out, n = {}, 0
  for k in pairs(v) do
    if math.type(k) ~= "integer" or k < 1 then at(key)("key '%s' must be a list (1..n), found key %s", key,
        type(k) == "string" and string.format("%q", k) or tostring(k)) end
    n = n + 1
  end
  for i = 1, n do
    if v[i] == nil then at(key)("%s[%d] is nil: a list has no holes (keys 1..n)", key, i) end
  end
  for i, item in ipairs(v) do
    if type(item) ~= "table" then at(key)("%s[%d] must be a table, got %s", key, i, describe(item)) end
    local o = {}
    for k, x in pairs(item) do
      if type(k) ~= "string" or not fields[k] then
        at(type(k) == "string" and k or key)("%s[%d]: '%s' is not a %s field", key, i, tostring(k), key)
      end
      o[k] = x
    end
    for _, sf in ipairs(f.fields) do
      if o[sf[1]] == nil then
        if sf[3] == nil then at(key)("%s[%d]: '%s' is missing (%s)", key, i, sf[1], sf[4]) end
        o[sf[1]] = sf[3]
      end
      check_value(setmetatable({ key .. "[" .. i .. "]." .. sf[1] }, { __index = sf }), o[sf[1]], at(sf[1]))
    end
    out[i] = o
  end
  return out
end

-- Checks a table-valued field: policy defaults, then the job's overrides.
local function check_table(f, v, at)
  local key = f[1]
  local fields = by_key(f.fields)
  if v ~= nil and type(v) ~= "table" then at(key)("key '%s' must be a table, got %s", key, describe(v)) end
  local defaults, ppath, psrc = load_policy(f.policy)
  for k in pairs(defaults) do
    if not fields[k] then fail(ppath, line_of(psrc, k), "key '%s' is not a %s field", tostring(k), key) end
  end
  local out = {}
  for k, dv in pairs(defaults) do out[k] = dv end
  for k, ov in pairs(v or {}) do
    if type(k) ~= "string" or not fields[k] then
      at(type(k) == "string" and k or key)("key '%s.%s' is not a %s field (known: %s)", key, tostring(k), key,
        table.concat((function() local n = {} for _, x in ipairs(f.fields) do n[#n + 1] = x[1] end return n end)(), ", "))
    end
    out[k] = ov
  end
  for _, sf in ipairs(f.fields) do
    local sk = sf[1]
    if out[sk] == nil then fail(ppath, nil, "policy key '%s' is missing", sk) end
    local origin = (v and v[sk] ~= nil) and at(sk) or function(fmt, ...) fail(ppath, line_of(psrc, sk), fmt, ...) end
    if sf[2] == "list" then -- a list of tables inside the table (pipeline.workers)
      out[sk] = check_list(setmetatable({ key .. "." .. sk }, { __index = sf }), out[sk],
        (v and v[sk] ~= nil) and at or function() return origin end)
    else
      check_value(setmetatable({ key .. "." .. sk }, { __index = sf }), out[sk], origin)
    end
  end
  return out
end

-- Checks a raw job table in place: fills defaults, validates every key.
-- origin(key) returns (source, line) for error messages.
-- M.check(job, origin, written): written(key) true for a key that a run's
-- own job.lua gave (not --set): a lone replica does not refuse it
function M.check(job, origin, written)
  local function at(key)
    local source, line = origin(key)
    return function(fmt, ...) fail(source, line, fmt, ...) end
  end
  for k in pairs(job) do
    if type(k) ~= "string" then
      local source = origin(nil)
      fail(source, nil, "job keys must be names, found %s key %s", type(k), tostring(k))
    end
    if not BY_KEY[k] then at(k)("key '%s' is not a job field%s", k, suggest(k)) end
  end
  for _, key in ipairs({ "data", "val_data" }) do -- a list of files: one string, a file or glob a line
    local v = job[key]
    if type(v) == "table" then -- every key 1..n, no hole, nothing else: no file is silently dropped
      local n = 0
      for k in pairs(v) do
        if math.type(k) ~= "integer" or k < 1 then
          at(key)("key '%s' must be a list (1..n), found key %s", key, type(k) == "string" and string.format("%q", k)
            or tostring(k))
        end
        n = n + 1
      end
      for i = 1, n do
        local x = v[i]
        if x == nil then at(key)("%s[%d] is nil: a list has no holes (keys 1..n)", key, i) end
        if type(x) ~= "string" then at(key)("%s[%d] must be a string (a file or a glob), got %s", key, i, describe(x)) end
      end
      if n == 0 then at(key)("key '%s' is an empty list", key) end
      job[key] = table.concat(v, "\n", 1, n)
    end
  end
  for _, f in ipairs(SCHEMA) do
    local key = f[1]
    if job[key] == nil then
      if f[3] ~= nil then
        job[key] = f[3]
      elseif not f.optional and f[2] ~= "table" then -- a table field defaults to its policy file
        local source = origin(nil)
        fail(source, nil, "required key '%s' is missing (%s)", key, f[4])
      end
    end
    if f[2] == "table" then
      job[key] = check_table(f, job[key], at)
    elseif f[2] == "list" and job[key] ~= nil then
      job[key] = check_list(f, job[key], at)
    elseif job[key] ~= nil then
      check_value(f, job[key], at(key))
    end
  end
  -- fields that constrain each other
  -- without run_dir the name becomes a path, runs/<name>-<time>: one '/' would leave runs/ ("../../x")
  -- or need directories that do not exist; with run_dir it is only a name (a run of an older build
  -- that allowed "proj/x" beside its own run_dir still resumes)
  if job.name and (job.run_dir or "") == "" and job.name:find("/", 1, true) then
    at("name")("name = %q: without run_dir a run's directory is runs/<name>-<time>, so the name must be one "
      .. "directory name (no '/'); set run_dir to put the run anywhere", job.name)
  end
  job.max_replicas = job.max_replicas or job.replicas
  if job.replicas > job.max_replicas then
    at("max_replicas")("max_replicas = %d is below replicas = %d", job.max_replicas, job.replicas)
  end
  if job.min_replicas > job.replicas then
    at("min_replicas")("min_replicas = %d is above replicas = %d", job.min_replicas, job.replicas)
  end
  if job.hosts > 0 and job.replicas < 2 then
    at("hosts")("hosts = %d needs replicas >= 2 (one replica runs alone, on this host)", job.hosts)
  end
  if #(job.chaos or {}) > 0 and job.replicas < 2 and job.pipeline.stages <= 1 and job.pipeline.micro_batches <= 1 then
    at("chaos")("a chaos list needs replicas >= 2: one replica trains alone, without the operator and workers "
      .. "that inject the faults (nothing is silently ignored)")
  end
  for i, c in ipairs(job.chaos or {}) do
    if c.replica >= job.max_replicas then
      at("replica")("chaos[%d]: replica %d does not exist (slots 0..%d)", i, c.replica, job.max_replicas - 1)
    end
  end
  local pipe = job.pipeline
  if job.batch_size % pipe.micro_batches ~= 0 then
    at("micro_batches")("pipeline.micro_batches = %d does not divide batch_size = %d", pipe.micro_batches,
      job.batch_size)
  end
  if #pipe.workers > 0 and #pipe.workers ~= pipe.stages then
    at("workers")("pipeline.workers lists %d workers for %d stages (one each, or none)", #pipe.workers, pipe.stages)
  end
  for i, w in ipairs(pipe.workers) do
    if w.netns ~= "" and not w.netns:match("^[%w_.-]+$") then
      at("netns")("pipeline.workers[%d].netns = %q: not a namespace name", i, w.netns)
    end
    if w.netns ~= "" and w.address == "" then
      at("address")("pipeline.workers[%d] runs in netns %q: give its address there", i, w.netns)
    end
    if w.netns ~= "" and job.replicas > 1 then
      at("netns")("pipeline.workers[%d].netns with replicas = %d: the replicas' coordinators live on this "
        .. "host's loopback (one pipeline only, for now)", i, job.replicas)
    end
  end
  if pipe.placement ~= "opfence" and pipe.placement ~= "even" and not pipe.placement:match("%.lua$") then
    at("placement")("pipeline.placement = %q: opfence, even, or a .lua policy file", pipe.placement)
  end
  if (pipe.stages > 1 or pipe.micro_batches > 1) and job.replicas * pipe.stages > 64 then
    at("stages")("pipeline.stages = %d x replicas = %d: at most 64 stage workers", pipe.stages, job.replicas)
  end
  if pipe.stages > 1 or pipe.micro_batches > 1 then -- what a pipeline does not honour yet is refused, not ignored
    local function refuse(key, what) at(key)("%s: a pipelined job (key 'pipeline') does not support it yet", what) end
    if job.min_replicas > 1 then refuse("min_replicas", "min_replicas = " .. job.min_replicas) end
    if job.on_failure ~= "replace" then refuse("on_failure", "on_failure = " .. string.format("%q", job.on_failure)) end
    if job.hosts > 0 then refuse("hosts", "hosts = " .. job.hosts .. " (stages on agents' hosts)") end
    if job.device ~= "cpu" then refuse("device", "device = " .. string.format("%q", job.device)) end
    if job.precision ~= "fp32" then refuse("precision", "precision = " .. string.format("%q", job.precision)) end
    if #(job.chaos or {}) > 0 then refuse("chaos", "a chaos list") end
    if (job.checkpoint.remote or "") ~= "" then refuse("checkpoint", "checkpoint.remote (each stage keeps a local store)") end
    if (job.checkpoint.when_busy or "coalesce") ~= "coalesce" then
      refuse("checkpoint", "checkpoint.when_busy = " .. string.format("%q", job.checkpoint.when_busy)
        .. " (the stages snapshot together, when every stage's store is free: one is never busy)")
    end
    if job.metrics_port > 0 then refuse("metrics_port", "metrics_port = " .. job.metrics_port .. " (Prometheus /metrics)") end
    if job.max_replicas ~= job.replicas then
      refuse("max_replicas", "max_replicas = " .. job.max_replicas .. " (replicas = " .. job.replicas .. ")")
    end
    if (job.policies or "") ~= "" then refuse("policies", "policies = " .. string.format("%q", job.policies)) end
  end
  if job.replicas == 1 and pipe.stages == 1 and pipe.micro_batches == 1 then
    -- one replica trains alone in this process: no operator, FTAR or
    -- detector reads what only a fleet uses, so a value other than the
    -- default is refused, not ignored (detector = false says what is so)
    local function refuse(key, what)
      at(key)("%s: a job of one replica trains alone, with no operator to use it: set replicas >= 2, or leave it out",
        what)
    end
    local function given(key) return not (written and written(key)) end
    for _, key in ipairs({ "deadline", "hang_seconds", "bucket_mb", "operator_grace", "on_failure", "metrics_port" }) do
      local v = job[key]
      if v ~= BY_KEY[key][3] and given(key) then
        refuse(key, key .. " = " .. (type(v) == "string" and string.format("%q", v) or tostring(v)))
      end
    end
    if job.max_replicas > 1 and given("max_replicas") then refuse("max_replicas", "max_replicas = " .. job.max_replicas) end
    if (job.policies or "") ~= "" and given("policies") then
      refuse("policies", "policies = " .. string.format("%q", job.policies))
    end
  end
  if job.n_embd % job.n_head ~= 0 then
    at("n_head")("n_embd = %d does not split into n_head = %d heads", job.n_embd, job.n_head)
  end
  if job.min_lr > job.lr then at("min_lr")("min_lr = %g is above lr = %g", job.min_lr, job.lr) end
  local decay_default = job.lr_decay_steps == nil
  job.lr_decay_steps = job.lr_decay_steps or job.max_steps
  if job.warmup_steps > job.lr_decay_steps then
    at("warmup_steps")("warmup_steps = %d is past lr_decay_steps = %d%s", job.warmup_steps, job.lr_decay_steps,
      decay_default and " (lr_decay_steps defaults to max_steps: for a run this short, set warmup_steps too, "
        .. "e.g. --set warmup_steps=" .. job.max_steps // 10 .. ")" or "")
  end
  return job
end

-- Converts a --set value by the key's type.
local function parse_set(item)
  local key, text = item:match("^([%w_%.]+)=(.*)$")
  if not key then fail("--set " .. item, nil, "expected key=value") end
  local top, sub = key:match("^([%w_]+)%.([%w_]+)$")
  local f = BY_KEY[top or key]
  if not f then fail("--set " .. item, nil, "key '%s' is not a job field%s", top or key, suggest(top or key)) end
  if sub then
    f = f.fields and by_key(f.fields)[sub]
    if not f then fail("--set " .. item, nil, "key '%s' is not a job field", key) end
  elseif f[2] == "table" then
    fail("--set " .. item, nil, "key '%s' is a table: set its fields as %s.FIELD=VALUE", key, key)
  end
  local v
  if f[2] == "integer" then
    v = math.tointeger(tonumber(text))
  elseif f[2] == "number" then
    v = tonumber(text)
  elseif f[2] == "boolean" then
    if text == "true" then v = true elseif text == "false" then v = false end
  else
    v = text
  end
  if v == nil then fail("--set " .. item, nil, "key '%s' must be %s %s", key, f[2] == "integer" and "an" or "a", f[2]) end
  return top or key, v, sub
end

-- Each loaded job's origin(key) -> source, line (M.where); weak: a job
-- C lets go of is collected with its entry.
local ORIGINS = setmetatable({}, { __mode = "k" })

-- Loads, overrides and checks a job file. Returns the checked table, or
-- raises a structured error {msg, source, line}.
function M.load(path, sets)
  local job, src = schema.run_file(path, "job file")
  if type(job) ~= "table" then fail(path, nil, "a job file must return a table, got %s", type(job)) end
  -- a run's own job.lua (--resume): its max_replicas and lr_decay_steps at
  -- their defaults (= replicas, = max_steps; files before dump left them
  -- out) follow a new replicas or max_steps, and the fleet keys it wrote do
  -- not make a lone replica refuse it
  local resolved = src and src:sub(1, #RESOLVED) == RESOLVED
  if resolved then
    for key, of in pairs(DERIVED) do
      if math.type(job[key]) == "integer" and job[key] == job[of] then job[key] = nil end
    end
  end
  local overridden = {}
  for _, item in ipairs(sets or {}) do
    local k, v, sub = parse_set(item)
    if sub then
      if job[k] ~= nil and type(job[k]) ~= "table" then fail(path, line_of(src, k), "key '%s' must be a table", k) end
      job[k] = job[k] or {}
      job[k][sub] = v
      overridden[sub] = item
    else
      job[k] = v
      overridden[k] = item
    end
  end
  if job.name == nil then job.name = path:match("([^/]+)%.lua$") or path:match("([^/]+)$") end
  local function origin(key)
    if key and overridden[key] then return "--set " .. overridden[key], nil end
    return path, line_of(src, key)
  end
  M.check(job, origin, resolved and function(key) return overridden[key] == nil end)
  ORIGINS[job] = origin
  return job
end

-- Where a key of a job M.load returned came from, as the prefix of an error
-- found after the check (a data file that cannot be opened), in the form
-- the checker's own errors take: "--set data=x.txt: key 'data'" for a --set
-- item, else "FILE:LINE: key 'data'" (FILE: when the file does not set it).
-- nil for a table M.load did not return. job_where (C) calls it.
function M.where(job, key)
  local origin = ORIGINS[job]
  if not origin then return nil end
  local source, line = origin(key)
  return string.format("%s%s: key '%s'", source, line and ":" .. line or "", key)
end

-- A path-valued field's value (f.path) made absolute against cwd; any
-- other value as it is. data and val_data hold one file or glob a line.
-- globbed: the value's lines are glob patterns (core/train/data.c expands
-- them with glob(3)), so cwd's glob characters ([ ] * ? \) are escaped in
-- the prefix: a directory named "exp[1]" must not match "exp1".
local function absolute(f, v, cwd, globbed)
  if not cwd or not f.path or type(v) ~= "string" or v == "" then return v end
  if f.path == "lua" and not (v:find("/", 1, true) or v:match("%.lua$")) then return v end -- a name
  local base = globbed and cwd:gsub("[%[%]%*%?\\]", "\\%0") or cwd
  local dir = base:sub(-1) == "/" and base or base .. "/"
  return (v:gsub("[^\n]+", function(p)
    if p:sub(1, 1) == "/" then return p end
    while p:sub(1, 2) == "./" do p = p:sub(3) end
    return (p == "" or p == ".") and base or dir .. p
  end))
end

-- Whether core/train/data.c globs key's lines: val_data always (token
-- files only); data when it is token data, by data.c's is_token_data rule
-- (data_format, or for "auto" data ending in ".bin"); a text corpus is
-- opened by its name as written.
local function globbed(job, key)
  if key == "val_data" then return true end
  if key ~= "data" or type(job.data) ~= "string" then return false end
  local format = job.data_format or "auto"
  if format ~= "auto" then return format ~= "text" end
  return job.data:sub(-4) == ".bin"
end

-- Serializes a checked job as a Lua chunk (written to RUN/job.lua). cwd
-- (optional; job_dump passes the working directory): path-valued fields
-- are written absolute against it, so that the run's job.lua names the same
-- files from any directory (`--resume RUN`, `transom sample RUN`, a worker
-- started by an agent). caps (optional, job_dump's): key -> the most bytes C
-- holds of it; a path that outgrows it once absolute is an error now, not
-- when the run's job.lua is loaded again.
function M.dump(job, cwd, caps)
  local function path(f, v, key)
    local a = absolute(f, v, cwd, globbed(job, key))
    if caps and caps[key] and a ~= v and #a > caps[key] then
      -- (the advice before the directory: a long one may be cut off the message)
      error({ msg = string.format("key '%s' is %d bytes once its paths are made absolute (as the run's job.lua "
        .. "writes them), more than %d: %srun from a directory with a shorter path than %s", key, #a, caps[key],
        (key == "data" or key == "val_data") and "use a glob, or " or "", cwd) }, 0)
    end
    return a
  end
  local out = { RESOLVED .. "return {\n" }
  for _, f in ipairs(SCHEMA) do
    local v = path(f, job[f[1]], f[1])
    local function lit(x)
      if type(x) == "string" then return (string.format("%q", x):gsub("\\\n", "\\n")) end
      if math.type(x) == "float" then
        local s = string.format("%.17g", x)
        if not s:find("[%.eEn]") then s = s .. ".0" end
        return s
      end
      return tostring(x)
    end
    local function list(lf, lv)
      local items = {}
      for _, item in ipairs(lv) do
        local parts = {}
        for _, sf in ipairs(lf.fields) do parts[#parts + 1] = string.format("%s = %s", sf[1], lit(item[sf[1]])) end
        items[#items + 1] = "{ " .. table.concat(parts, ", ") .. " }"
      end
      return "{ " .. table.concat(items, ", ") .. " }"
    end
    if type(v) == "table" and f[2] == "list" then
      out[#out + 1] = string.format("  %s = %s,\n", f[1], list(f, v))
    elseif type(v) == "table" then
      local parts = {}
      for _, sf in ipairs(f.fields) do
        local sv = path(sf, v[sf[1]], f[1] .. "." .. sf[1])
        if sv ~= nil then parts[#parts + 1] = string.format("%s = %s", sf[1], sf[2] == "list" and list(sf, sv) or lit(sv)) end
      end
      out[#out + 1] = string.format("  %s = { %s },\n", f[1], table.concat(parts, ", "))
    elseif v ~= nil and not (DERIVED[f[1]] and v == job[DERIVED[f[1]]]) then
      -- (a key at its derived default follows the key it comes from: a
      -- resume that changes replicas must not find the old count written
      -- down as if chosen, refused as below replicas or by a pipelined job;
      -- one that adds steps must not run them all at min_lr)
      out[#out + 1] = string.format("  %s = %s,\n", f[1], lit(v))
    end
  end
  out[#out + 1] = "}\n"
  return table.concat(out)
end

-- A default as `transom run --help` shows it.
local function show_default(v, optional)
  if v == nil then return optional and "-" or "required" end
  if type(v) == "string" then return (string.format("%q", v):gsub("\\\n", "\\n")) end
  if type(v) == "table" then return next(v) == nil and "{}" or "{...}" end -- a list (pipeline.workers)
  return tostring(v)
end

-- Text for `transom run --help`: every key with its type, default and
-- meaning; a table's fields with the defaults of its policy file, a list's
-- entry fields with theirs.
function M.help()
  local lines = {}
  for _, f in ipairs(SCHEMA) do
    local d = f[2] == "table" and "policy" or show_default(f[3], f.optional)
    lines[#lines + 1] = string.format("  %-15s %-8s %-10s %s", f[1], f[2], d, f[4])
    local defaults = {}
    if f.policy then
      local ok, t = pcall(load_policy, f.policy)
      if ok then defaults = t end
    end
    for _, sf in ipairs(f.fields or {}) do
      local sd = f.policy and show_default(defaults[sf[1]], true) or show_default(sf[3], false)
      lines[#lines + 1] = string.format("    .%-13s %-8s %-10s %s", sf[1], sf[2], sd, sf[4])
    end
  end
  return table.concat(lines, "\n")
end

return M
