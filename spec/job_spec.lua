-- job_spec.lua — the job-file checker (lua/transom/job.lua), through the CLI
-- (`transom run FILE`, as a subprocess) and in-process (transom.job.load).
--
-- Every error case points run_dir at a fresh path and asserts that the
-- directory was not created: a bad job must write nothing.

local job = require("transom.job")

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local BIN, q, exists, write = S.BIN, S.q, S.exists, S.write
local function read(path) return assert(S.read(path), "cannot read " .. path) end
local transom = S.transom

describe("job files", function()
  local dir, data, n = nil, nil, 0

  setup(function()
    dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir -p " .. q(dir)))
    data = dir .. "/data.txt"
    write(data, string.rep("To be, or not to be, that is the question.\n", 100))
  end)

  teardown(function()
    if dir then os.execute("rm -rf " .. q(dir)) end
  end)

  -- Writes a job file whose text is `body` with DATA and RUN_DIR replaced by
  -- quoted paths; returns the job path and the (fresh, absent) run dir.
  local function job_file(body, name)
    n = n + 1
    local path = string.format("%s/%s%d.lua", dir, name or "job", n)
    local run_dir = string.format("%s/run%d", dir, n)
    write(path, (body:gsub("DATA", string.format("%q", data)):gsub("RUN_DIR", string.format("%q", run_dir))))
    return path, run_dir
  end

  -- Runs a job expected to be rejected; checks status 2, no output, no run
  -- dir; returns stderr.
  local function rejected(path, run_dir, ...)
    local code, out, err = transom(dir, "run", path, ...)
    assert.are.equal(2, code, "exit status; stderr: " .. err)
    assert.are.equal("", out)
    assert.is_false(exists(run_dir), "a rejected job created its run dir " .. run_dir)
    return err
  end

  local function has(text, ...)
    for _, s in ipairs({ ... }) do
      assert.is_truthy(text:find(s, 1, true), string.format("expected %q in:\n%s", s, text))
    end
  end

  it("accepts a valid job (the baseline the error cases differ from)", function()
    -- a tiny model, one step: proves DATA/RUN_DIR substitution and the
    -- no-run-dir assertions below are meaningful
    local path, run_dir = job_file([[
return {
  data = DATA, run_dir = RUN_DIR,
  n_layer = 1, n_head = 1, n_embd = 8, block_size = 8, batch_size = 2,
  max_steps = 1, warmup_steps = 0, eval_interval = 0, eval_steps = 1,
  sample_tokens = 0, threads = 1,
}
]])
    local code, out, err = transom(dir, "run", path)
    assert.are.equal(0, code, err)
    assert.is_truthy(out:find("step 1/1", 1, true), out)
    assert.is_true(exists(run_dir .. "/job.lua"))
  end)

  it("rejects an unknown key with file:line:key and suggests 'lr'", function()
    local path, run_dir = job_file([[
-- lerning_rate = 1 in a comment does not count
local steps = 10
return {
  data = DATA,
  run_dir = RUN_DIR,
  max_steps = steps,

  lerning_rate = 1,
}
]])
    local err = rejected(path, run_dir)
    has(err, path .. ":8:", "'lerning_rate'", "did you mean 'lr'")
  end)

  it("suggests the closest field for a near miss, and nothing for a far one", function()
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  n_layers = 2,\n}\n")
    has(rejected(path, run_dir), path .. ":3:", "'n_layers'", "did you mean 'n_layer'")
    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  xyzzy_quux_plugh = 2,\n}\n")
    local err = rejected(path, run_dir)
    has(err, path .. ":3:", "'xyzzy_quux_plugh'")
    assert.is_falsy(err:find("did you mean", 1, true), err)
  end)

  it("rejects a wrong type with file:line:key", function()
    local path, run_dir = job_file([[
return {
  data = DATA,
  run_dir = RUN_DIR,
  n_layer = "four",
}
]])
    has(rejected(path, run_dir), path .. ":4:", "'n_layer'", "integer", '"four"')
  end)

  it("rejects a float where an integer is required", function()
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  batch_size = 2.5,\n}\n")
    has(rejected(path, run_dir), path .. ":3:", "'batch_size'", "integer")
  end)

  it("rejects out-of-range values with file:line:key", function()
    local path, run_dir = job_file([[
return {
  data = DATA, run_dir = RUN_DIR,
  sample_prompt = "n_layer = 4 would be fine",
  n_layer = 0,
}
]])
    has(rejected(path, run_dir), path .. ":4:", "'n_layer'", ">= 1", "got 0")

    path, run_dir = job_file([[
return {
  data = DATA, run_dir = RUN_DIR,
  beta1 = 0.9,
  beta2 = 1.5,
}
]])
    has(rejected(path, run_dir), path .. ":4:", "'beta2'", "< 1", "1.5")

    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  lr = 0,\n}\n")
    has(rejected(path, run_dir), path .. ":3:", "'lr'", "> 0")

    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  lr = math.huge,\n}\n")
    has(rejected(path, run_dir), path .. ":3:", "'lr'", "finite")
  end)

  -- Integers are int64 in Lua and often an int in C: without a bound a
  -- value past INT_MAX wrapped there (keep_last = 2^32 + 1 kept one
  -- checkpoint; sample_tokens = 2^62 overflowed the sampler's buffer size
  -- and wrote past it; map_mb = 2^44 shifted to 0, "automatic";
  -- temperature = 1e-50 became the float 0: a NaN sample).
  it("bounds integers to C's int unless a key says otherwise, and the sampler's and the store's sizes", function()
    for _, c in ipairs({
      { "eval_steps = 4294967297", "'eval_steps'", "<= 2147483647" },
      { "checkpoint = { keep_last = 4294967297 }", "'checkpoint.keep_last'", "<= 1000000" },
      { "checkpoint = { map_mb = 17592186044416 }", "'checkpoint.map_mb'", "<= 1073741824" },
      { "sample_tokens = 4611686018427387904", "'sample_tokens'", "<= 16777216" },
      { "temperature = 1e-50", "'temperature'", ">= 1e-06" },
    }) do
      local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  " .. c[1] .. ",\n}\n")
      has(rejected(path, run_dir), path .. ":3:", c[2], c[3])
    end
    -- a seed may use all 63 bits
    local t = job.load((job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  seed = math.maxinteger,\n}\n")), {})
    assert.equal(math.maxinteger, t.seed)
  end)

  it("rejects n_embd not divisible by n_head", function()
    local path, run_dir = job_file([[
return {
  data = DATA, run_dir = RUN_DIR,
  n_embd = 30,
  n_head = 4,
}
]])
    has(rejected(path, run_dir), path .. ":4:", "n_embd = 30", "n_head = 4")
  end)

  it("rejects fields that contradict each other", function()
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  lr = 1e-3,\n  min_lr = 1e-2,\n}\n")
    has(rejected(path, run_dir), path .. ":4:", "min_lr")
    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  max_steps = 10,\n  warmup_steps = 50,\n}\n")
    has(rejected(path, run_dir), path .. ":4:", "warmup_steps")
  end)

  it("bounds the replica counts: min_replicas <= replicas <= max_replicas (default: replicas), chaos slots below it", function()
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  replicas = 3,\n  max_replicas = 2,\n}\n")
    has(rejected(path, run_dir), path .. ":4:", "max_replicas = 2 is below replicas = 3")
    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  replicas = 2,\n  min_replicas = 3,\n}\n")
    has(rejected(path, run_dir), path .. ":4:", "min_replicas = 3 is above replicas = 2")
    -- the default max_replicas is replicas: slot 2 of 2 replicas does not exist
    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  replicas = 2,\n"
      .. "  chaos = { { at_step = 5, replica = 2, fault = \"kill\" } },\n}\n")
    has(rejected(path, run_dir), "chaos[1]: replica 2 does not exist (slots 0..1)")
    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n}\n")
    has(rejected(path, run_dir, "--set", "replicas=2", "--set", "max_replicas=1"),
      "max_replicas = 1 is below replicas = 2")
    -- one replica trains alone (no operator, no worker): its chaos list would never fire
    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n"
      .. "  chaos = { { at_step = 5, replica = 0, fault = \"fail\" } },\n}\n")
    has(rejected(path, run_dir), path .. ":3:", "a chaos list needs replicas >= 2")
    has(rejected(path, run_dir, "--set", "max_replicas=3"), "a chaos list needs replicas >= 2")
    local j = job.load(job_file("return { data = DATA, replicas = 3 }\n"))
    assert.are.equal(3, j.max_replicas)
    assert.are.equal(1, j.min_replicas)
    j = job.load(job_file("return { data = DATA, replicas = 3, min_replicas = 3, max_replicas = 5 }\n"))
    assert.are.same({ 3, 3, 5 }, { j.min_replicas, j.replicas, j.max_replicas })
  end)

  -- One replica trains alone in the transom process: nothing reads what
  -- only a fleet uses (before: deadline, hang_seconds, bucket_mb,
  -- operator_grace, on_failure, metrics_port, max_replicas and policies
  -- were accepted and never read). Their defaults, as a run's own job.lua
  -- writes them, load.
  it("refuses what only replicas read in a job of one replica, unless it is the default", function()
    for _, c in ipairs({
      { "deadline = 5", "deadline = 5" }, { "hang_seconds = 10", "hang_seconds = 10" },
      { "bucket_mb = 4", "bucket_mb = 4" }, { "operator_grace = 5", "operator_grace = 5" },
      { 'on_failure = "restart_all"', 'on_failure = "restart_all"' }, { "metrics_port = 9100", "metrics_port = 9100" },
      { "max_replicas = 3", "max_replicas = 3" }, { 'policies = "/tmp"', 'policies = "/tmp"' },
    }) do
      local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  " .. c[1] .. ",\n}\n")
      has(rejected(path, run_dir), path .. ":3:", c[2], "a job of one replica trains alone")
    end
    local t = job.load((job_file("return { data = DATA, deadline = 3.0, metrics_port = 0, detector = false }\n")), {})
    assert.equal(3.0, t.deadline)
    t = job.load((job_file("return { data = DATA, replicas = 2, deadline = 5, metrics_port = 9100 }\n")), {})
    assert.equal(9100, t.metrics_port)
    -- a fleet's own job.lua resumed as one replica: what it wrote is not
    -- refused (a --set on top is); one written before dump left out
    -- max_replicas at its default follows replicas too
    local again = dir .. "/fleet-run.lua"
    write(again, job.dump(job.load((job_file("return { data = DATA, replicas = 2, deadline = 2 }\n")), {})))
    t = job.load(again, { "replicas=1" })
    assert.same({ 1, 1, 2 }, { t.replicas, t.max_replicas, t.deadline })
    local ok, e = pcall(job.load, again, { "replicas=1", "deadline=5" })
    assert.is_false(ok)
    assert.matches("deadline = 5: a job of one replica trains alone", e.msg, 1, true)
    write(again, (job.dump(t):gsub("return {\n", "return {\n  max_replicas = 1,\n", 1)))
    t = job.load(again, { "replicas=3" })
    assert.same({ 3, 3 }, { t.replicas, t.max_replicas })
  end)

  it("refuses, naming the key, what a pipelined job does not support yet (nothing is silently ignored)", function()
    local base = "return {\n  data = DATA, run_dir = RUN_DIR, replicas = 2, pipeline = { stages = 2 },\n"
    for _, case in ipairs({
      { "  min_replicas = 2,\n", "min_replicas = 2: a pipelined job" },
      { "  on_failure = \"restart_all\",\n", "on_failure = \"restart_all\": a pipelined job" },
      { "  hosts = 2,\n", "hosts = 2 (stages on agents' hosts): a pipelined job" },
      { "  device = \"emu\",\n", "device = \"emu\": a pipelined job" },
      { "  precision = \"bf16\",\n", "precision = \"bf16\": a pipelined job" },
      { "  chaos = { { at_step = 5, replica = 1, fault = \"kill\" } },\n", "a chaos list: a pipelined job" },
      { "  checkpoint = { when_busy = \"skip\" },\n", "checkpoint.when_busy = \"skip\" (the stages snapshot together" },
    }) do
      local path, run_dir = job_file(base .. case[1] .. "}\n")
      has(rejected(path, run_dir), path .. ":3:", case[2], "does not support it yet")
    end
    -- the same keys at their defaults are fine
    local j = job.load(job_file(base .. "  min_replicas = 1, on_failure = \"replace\",\n"
      .. "  checkpoint = { when_busy = \"coalesce\" },\n}\n"))
    assert.are.equal(2, j.pipeline.stages)
  end)

  it("requires the data key", function()
    local path, run_dir = job_file("return {\n  run_dir = RUN_DIR,\n  n_layer = 2,\n}\n")
    local err = rejected(path, run_dir)
    has(err, path, "'data'", "missing")
    assert.is_falsy(err:find("job.lua", 1, true), "an internal error leaked: " .. err)
  end)

  it("rejects a non-string key", function()
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  'oops',\n}\n")
    has(rejected(path, run_dir), path, "keys must be names")
  end)

  it("reports a Lua syntax error with file:line", function()
    local path, run_dir = job_file([[
return {
  data = DATA, run_dir = RUN_DIR,
  n_layer = 2
  n_head = 2,
}
]])
    has(rejected(path, run_dir), path .. ":4:")
  end)

  it("rejects reading an undefined global, naming it and the line", function()
    local path, run_dir = job_file([[
local layers = 2
return {
  data = DATA, run_dir = RUN_DIR,
  n_layer = layers,
  n_head = heads,
}
]])
    local err = rejected(path, run_dir)
    has(err, path .. ":5:", "undefined global 'heads'")
  end)

  it("runs in a sandbox: no io, no os.execute, no require", function()
    local marker = dir .. "/sandbox-escaped"
    for _, code in ipairs({
      string.format("os.execute('touch %s')", marker),
      string.format("io.open(%q, 'w'):close()", marker),
      "require('os')",
    }) do
      local path, run_dir = job_file(code .. "\nreturn { data = DATA, run_dir = RUN_DIR }\n")
      has(rejected(path, run_dir), path .. ":1:")
      assert.is_false(exists(marker), code)
    end
  end)

  it("does not let a job file change the host's libraries", function()
    -- string.format is what the checker formats its messages with
    local path, run_dir = job_file("string.format = nil\nreturn {\n  data = DATA, run_dir = RUN_DIR,\n  n_layer = 0,\n}\n")
    has(rejected(path, run_dir), path .. ":4:", "'n_layer'")
  end)

  it("rejects a job file that does not return a table", function()
    local path, run_dir = job_file("return 42\n")
    has(rejected(path, run_dir), path, "must return a table")
  end)

  it("rejects a missing job file", function()
    local path = dir .. "/no-such-job.lua"
    local code, _, err = transom(dir, "run", path)
    assert.are.equal(2, code)
    has(err, path, "cannot open")
  end)

  it("names a job file that is a directory (run, run --resume, sample), not the checker's internals", function()
    local code, out, err = transom(dir, "run", dir)
    assert.are.equal(2, code, err)
    assert.are.equal("", out)
    has(err, dir .. ": cannot read the job file: Is a directory")
    assert.is_falsy(err:find("schema.lua", 1, true), err)
    local run = dir .. "/dirjob"
    assert(os.execute("mkdir -p " .. q(run .. "/job.lua")))
    code, _, err = transom(dir, "run", "--resume", run)
    assert.are.equal(2, code, err)
    has(err, run .. "/job.lua: cannot read the job file: Is a directory")
    code, _, err = transom(dir, "sample", run)
    assert.are.equal(1, code, err)
    has(err, run .. "/job.lua: cannot read the job file: Is a directory")
    assert.is_falsy(err:find("schema.lua", 1, true), err)
  end)

  it("names a policy file that is a directory", function()
    local lua = dir .. "/lua-copy"
    assert(os.execute("cp -r " .. q(S.ROOT .. "/lua") .. " " .. q(lua) .. " && rm " .. q(lua .. "/policies/checkpoint.lua")
      .. " && mkdir " .. q(lua .. "/policies/checkpoint.lua")))
    local path, run_dir = job_file("return { data = DATA, run_dir = RUN_DIR }\n")
    local out, rc = S.sh("TRANSOM_LUA_DIR=" .. q(lua) .. " " .. q(BIN) .. " run " .. q(path))
    assert.are.equal(2, rc, out)
    has(out, lua .. "/policies/checkpoint.lua: cannot read the policy file: Is a directory")
    assert.is_falsy(out:find("load", 1, true), out)
    assert.is_false(exists(run_dir))
  end)

  it("names the file, line and key for a table or list with keys it cannot have", function()
    -- checkpoint = { [1] = 5 }: a key that is not a name (was "schema.lua:24: attempt to index a number value")
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  checkpoint = { [1] = 5 },\n}\n")
    local err = rejected(path, run_dir)
    has(err, path .. ":3:", "'checkpoint.1' is not a checkpoint field")
    assert.is_falsy(err:find("schema.lua", 1, true), err)
    -- a hole in the list (was "job.lua:280: invalid value (nil) at index 2 in table for 'concat'")
    path, run_dir = job_file("return {\n  run_dir = RUN_DIR,\n  data = { DATA, nil, DATA },\n}\n")
    err = rejected(path, run_dir)
    has(err, path .. ":3:", "data[2] is nil: a list has no holes")
    assert.is_falsy(err:find("concat", 1, true), err)
    -- a named key beside the files (was silently dropped: the job trained on the list's files alone)
    path, run_dir = job_file("return {\n  run_dir = RUN_DIR,\n  data = { DATA, extra = DATA },\n}\n")
    has(rejected(path, run_dir), path .. ":3:", "key 'data' must be a list (1..n), found key \"extra\"")
    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  val_data = { DATA, [3] = DATA },\n}\n")
    has(rejected(path, run_dir), path .. ":3:", "val_data[2] is nil")
    -- the same for a list of tables (chaos): its third fault was never injected
    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR, replicas = 2,\n"
      .. "  chaos = { { at_step = 5, replica = 1, fault = 'kill' }, nil, { at_step = 9, replica = 1, fault = 'kill' } },\n}\n")
    has(rejected(path, run_dir), path .. ":3:", "chaos[2] is nil: a list has no holes")
  end)

  it("refuses a string with a NUL byte naming the key, and a name that leaves runs/ (no run_dir)", function()
    -- tiny jobs: without the checks they train (briefly) instead
    local tiny = "  n_layer = 1, n_head = 1, n_embd = 16, block_size = 16, batch_size = 2, max_steps = 1,\n"
      .. "  warmup_steps = 0, eval_interval = 0, eval_steps = 1, sample_tokens = 0, threads = 1,\n"
    -- C reads job strings up to their first NUL: "data.txt\0/etc/passwd" trained on data.txt without a word
    local path, run_dir = job_file('return {\n  run_dir = RUN_DIR,\n  data = DATA .. "\\0/etc/passwd",\n' .. tiny .. '}\n')
    has(rejected(path, run_dir), path .. ":3:", "key 'data' holds a NUL byte (byte " .. #data + 1 .. " of ")
    path, run_dir = job_file('return {\n  data = DATA, run_dir = RUN_DIR,\n  checkpoint = { remote = "a\\0b" },\n' .. tiny
      .. '}\n')
    has(rejected(path, run_dir), path .. ":3:", "key 'checkpoint.remote' holds a NUL byte")
    -- without run_dir the run directory is runs/<name>-<time>: "../../x" made it runs/../../x-<time>
    for _, name in ipairs({ "../../x", "a/b", "/abs" }) do
      path, run_dir = job_file('return {\n  data = DATA,\n  name = ' .. string.format("%q", name) .. ',\n' .. tiny
        .. '}\n')
      has(rejected(path, run_dir), path .. ":3:", string.format("name = %q: without run_dir a run's directory is "
        .. "runs/<name>-<time>", name), "no '/'", "set run_dir")
      assert.is_false(exists(dir .. "/runs"), "a refused name made runs/")
    end
    for _, name in ipairs({ "a..b", ".", ".." }) do -- runs/..-<time> is one directory in runs/
      assert.are.equal(name, job.load(job_file('return { data = DATA, name = ' .. string.format("%q", name) .. ' }\n')).name)
    end
    -- with run_dir the name is only a name: a run that an older build started with name = "proj/x" resumes
    path, run_dir = job_file('return {\n  data = DATA, run_dir = RUN_DIR,\n  name = "proj/x",\n' .. tiny
      .. '  checkpoint = { every_steps = 1 },\n}\n')
    local code, _, err = transom(dir, "run", path)
    assert.are.equal(0, code, err)
    has(read(run_dir .. "/job.lua"), 'name = "proj/x"')
    local out
    code, out, err = transom(dir, "run", "--resume", run_dir, "--set", "max_steps=2")
    assert.are.equal(0, code, err)
    has(out, "resumed from step 1")
    assert.is_false(exists(dir .. "/runs"))
  end)

  it("rejects a bad --set naming the item", function()
    local path, run_dir = job_file("return { data = DATA, run_dir = RUN_DIR }\n")
    has(rejected(path, run_dir, "--set", "lerning_rate=1"), "--set lerning_rate=1", "'lerning_rate'", "'lr'")
    has(rejected(path, run_dir, "--set", "n_layer=abc"), "--set n_layer=abc", "'n_layer'", "integer")
    has(rejected(path, run_dir, "--set=n_layer=0"), "--set n_layer=0", ">= 1")
    has(rejected(path, run_dir, "--set", "n_layer"), "--set n_layer", "key=value")
  end)

  -- Errors found after the check (the data cannot be opened) name where the
  -- key came from as the checker's do: they named the job file for a --set.
  it("names the --set item, or the file and line, for data that cannot be opened", function()
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  tokenizer = 'x.bpe',\n}\n")
    local nope = dir .. "/nope2.txt"
    local err = rejected(path, run_dir, "--set", "data=" .. nope)
    has(err, "transom: --set data=" .. nope .. ": key 'data': cannot open '" .. nope .. "'")
    assert.is_nil(err:find(path, 1, true), err)
    -- the tokenizer the file gave, refused for a text corpus: its line
    has(rejected(path, run_dir), path .. ":3: key 'tokenizer': 'x.bpe' is for token files")
    path, run_dir = job_file("return {\n  run_dir = RUN_DIR,\n  data = '" .. nope .. "',\n}\n")
    has(rejected(path, run_dir), "transom: " .. path .. ":3: key 'data': cannot open '" .. nope .. "'")
  end)

  it("lets --set override the file, checked by the same rules", function()
    -- the file's bad value is replaced; the override's own error names --set
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  n_layer = 0,\n}\n")
    local err = rejected(path, run_dir, "--set", "n_head=3")
    has(err, path .. ":3:", "'n_layer'")
    err = rejected(path, run_dir, "--set", "n_layer=2", "--set", "n_head=5")
    has(err, "--set n_head=5", "n_embd = 128")
  end)

  it("checks the checkpoint table's fields with file:line", function()
    local path, run_dir = job_file([[
return {
  data = DATA, run_dir = RUN_DIR,
  checkpoint = {
    keep_last = 2,
    every_stepz = 5,
  },
}
]])
    has(rejected(path, run_dir), path .. ":5:", "'checkpoint.every_stepz'", "every_steps")

    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  checkpoint = { when_busy = 'wait' },\n}\n")
    has(rejected(path, run_dir), path .. ":3:", "'checkpoint.when_busy'", "skip", "coalesce", '"wait"')

    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  checkpoint = { keep_last = 0 },\n}\n")
    has(rejected(path, run_dir), path .. ":3:", "'checkpoint.keep_last'", ">= 1")

    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  checkpoint = { remote = 5 },\n}\n")
    has(rejected(path, run_dir), path .. ":3:", "'checkpoint.remote'", "string")

    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  checkpoint = { remote_rate_mb = -1 },\n}\n")
    has(rejected(path, run_dir), path .. ":3:", "'checkpoint.remote_rate_mb'", ">= 0")

    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n  checkpoint = 100,\n}\n")
    has(rejected(path, run_dir), path .. ":3:", "'checkpoint'", "table")
  end)

  -- the smallest job that trains and checkpoints (the run_dir cases)
  local tiny = "  n_layer = 1, n_head = 1, n_embd = 16, block_size = 16, batch_size = 2, max_steps = 2,\n"
    .. "  warmup_steps = 0, eval_interval = 0, eval_steps = 1, sample_tokens = 0, threads = 1,\n"
    .. "  checkpoint = { every_steps = 1 },\n"

  it("refuses, without --resume, a run_dir that already holds a run (its job.lua or checkpoint store)", function()
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n" .. tiny .. "}\n")
    local code, _, err = transom(dir, "run", path)
    assert.are.equal(0, code, err)
    local job1, metrics1 = read(run_dir .. "/job.lua"), read(run_dir .. "/metrics.jsonl")
    -- a second job into the same directory would reuse the first one's checkpoints
    code, _, err = transom(dir, "run", path, "--set", "seed=7")
    assert.are.equal(2, code, err)
    has(err, "run directory " .. run_dir, run_dir .. "/job.lua", "transom run --resume " .. run_dir, "another run_dir")
    assert.are.equal(job1, read(run_dir .. "/job.lua"), "the refused run rewrote job.lua")
    assert.are.equal(metrics1, read(run_dir .. "/metrics.jsonl"), "the refused run rewrote metrics.jsonl")
    -- a store with committed checkpoints is enough, without job.lua: no --resume hint (it needs a job.lua)
    os.remove(run_dir .. "/job.lua")
    code, _, err = transom(dir, "run", path)
    assert.are.equal(2, code, err)
    has(err, run_dir .. "/ckpt", "checkpoints of an earlier run", "another run_dir")
    assert.is_falsy(err:find("--resume", 1, true), err)
    -- a job.lua that is not a run's resolved job (the user's own job file) is named as such, and kept
    write(run_dir .. "/job.lua", "return { data = 'x' }\n")
    code, _, err = transom(dir, "run", path)
    assert.are.equal(2, code, err)
    has(err, run_dir .. "/job.lua", "another job file")
    assert.is_falsy(err:find("--resume", 1, true), err)
    assert.are.equal("return { data = 'x' }\n", read(run_dir .. "/job.lua"))
    -- a directory that exists but holds no run is fine
    local other
    path, other = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n" .. tiny .. "}\n")
    assert(os.execute("mkdir -p " .. q(other) .. " && touch " .. q(other .. "/notes.txt")))
    code, _, err = transom(dir, "run", path)
    assert.are.equal(0, code, err)
    assert.is_true(exists(other .. "/notes.txt"))
  end)

  it("refuses --resume of a directory whose job.lua is the user's own job file, touching nothing", function()
    -- (before: it trained and replaced the file, comments and all, with a resolved dump)
    local own = dir .. "/own"
    assert(os.execute("mkdir -p " .. q(own)))
    local text = "-- my job, with my comments\nreturn {\n  data = " .. string.format("%q", data) .. ",\n" .. tiny .. "}\n"
    write(own .. "/job.lua", text)
    local code, out, err = transom(dir, "run", "--resume", own)
    assert.are.equal(2, code, err .. out)
    has(err, own .. "/job.lua is not a job written by transom", "-- resolved job, written by transom",
      "point --resume at a run directory")
    assert.are.equal(text, read(own .. "/job.lua"))
    local _, rc = S.sh("test \"$(ls -A " .. q(own) .. ")\" = job.lua")
    assert.are.equal(0, rc, "the refused resume wrote into " .. own)
  end)

  it("refuses a --set run_dir on --resume that names another directory (it was silently ignored)", function()
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n" .. tiny .. "}\n")
    local code, _, err = transom(dir, "run", path)
    assert.are.equal(0, code, err)
    local job1, other = read(run_dir .. "/job.lua"), run_dir .. "-elsewhere"
    code, _, err = transom(dir, "run", "--resume", run_dir, "--set", "run_dir=" .. other, "--set", "max_steps=3")
    assert.are.equal(2, code, err)
    has(err, "--set run_dir=" .. other, "stays in its run directory (" .. run_dir .. ")")
    assert.is_false(exists(other))
    assert.are.equal(job1, read(run_dir .. "/job.lua"))
    -- the same directory, spelled otherwise, is no change
    local out
    code, out, err = transom(dir, "run", "--resume", run_dir, "--set", "run_dir=" .. run_dir .. "/", "--set", "max_steps=3")
    assert.are.equal(0, code, err)
    has(out, "step 3/3")
  end)

  it("refuses another run in a directory a lone run is training in; the first finishes alone", function()
    -- (before: a --resume said "resumed from step N" and trained alongside the first, both checkpointing into
    -- RUN/ckpt and writing RUN/metrics.jsonl)
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n" .. tiny .. "}\n")
    local steps, log = 150, run_dir .. ".log"
    local pid, rc_of = S.spawn_rc("env TRANSOM_TEST_STEP_MS=20 " .. q(BIN) .. " run " .. q(path) .. " --set max_steps="
      .. steps .. " --set checkpoint.every_steps=10", log)
    local ok, err = pcall(function()
      assert.is_truthy(S.wait_for(function() return #S.losses(run_dir) >= 1 end, 60), S.read(log))
      os.execute("kill -STOP " .. pid) -- (so that it cannot finish meanwhile: the lock is held all the same)
      local job1 = read(run_dir .. "/job.lua")
      local code, out, e = transom(dir, "run", "--resume", run_dir)
      assert.are.equal(2, code, e .. out)
      has(e, run_dir .. " is in use by a running transom (pid " .. pid .. "): stop it first (kill -TERM " .. pid)
      assert.are.equal(job1, read(run_dir .. "/job.lua"))
      -- a new run into it: the directory holds a run, said first (before: "in use", and only that)
      code, out, e = transom(dir, "run", path)
      assert.are.equal(2, code, e .. out)
      has(e, "run directory " .. run_dir .. " already holds a run")
      assert.are.equal(job1, read(run_dir .. "/job.lua"))
      os.execute("kill -CONT " .. pid)
      assert.are.equal(0, S.wait_rc(rc_of, 120), S.read(log))
    end)
    os.execute("kill -CONT " .. pid .. " 2>/dev/null")
    S.cleanup()
    assert(ok, err)
    -- one timeline: every step once, in order, and no resume
    local losses = S.losses(run_dir)
    assert.are.equal(steps, #losses)
    for i, l in ipairs(losses) do assert.are.equal(tostring(i), l:match("^(%d+)="), "metrics line " .. i) end
    assert.is_falsy(read(run_dir .. "/events.jsonl"):find('"kind":"resume"', 1, true))
    -- the lock is the kernel's: gone with the process, so the run resumes now
    local code, out, e = transom(dir, "run", "--resume", run_dir, "--set", "max_steps=" .. steps + 1)
    assert.are.equal(0, code, e)
    has(out, "resumed from step " .. steps)
  end)

  it("refuses an operator started while a lone run starts in the same directory, after waiting for it", function()
    -- A start looks for a live job, then claims the directory (a lone run: RUN/run.lock). The lone run is held
    -- between the two (TRANSOM_TEST_START_PAUSE: until a file exists) while an operator starts, and let go once
    -- the operator says it waits at the start gate; the operator then finds the lone run. (Before: an operator
    -- takes no lock, found nothing, and trained beside it.)
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n" .. tiny .. "}\n")
    local log, log2, go = run_dir .. ".log", run_dir .. ".log2", run_dir .. ".go"
    local pid, rc_of = S.spawn_rc("env TRANSOM_TEST_START_PAUSE=" .. q(go) .. " " .. q(BIN) .. " run " .. q(path) ..
      " --set max_steps=20", log)
    local ok, err = pcall(function()
      assert.is_truthy(S.wait_for(function() return (S.read(log) or ""):find("start paused", 1, true) end, 60),
        S.read(log))
      local _, op_rc = S.spawn_rc(q(BIN) .. " run " .. q(path) .. " --replicas 2 --set max_steps=20", log2)
      local waited = S.wait_for(function() return (S.read(log2) or ""):find("waiting for it", 1, true) end, 60)
      write(go, "")
      local code, e = S.wait_rc(op_rc, 60), S.read(log2) or ""
      assert.is_truthy(waited, e)
      assert.are.equal(2, code, e)
      has(e, "another transom (pid " .. pid .. ") is starting in " .. run_dir .. ": waiting for it")
      -- refused as in use (the lone run holds RUN/run.lock now), or as a run's directory (its job.lua came too)
      assert.is_truthy(e:find(run_dir .. " is in use by a running transom (pid " .. pid, 1, true) or
        e:find("run directory " .. run_dir .. " already holds a run", 1, true), e)
      assert.are.equal(0, S.wait_rc(rc_of, 120), S.read(log))
    end)
    write(go, "")
    S.cleanup()
    assert(ok, err)
    has(read(log), "step 20/20")
    assert.is_false(exists(run_dir .. "/operator.addr"), "the operator started")
    assert.is_false(exists(run_dir .. "/secret"), "the operator started")
  end)

  it("a start killed (kill -9) while it holds the start gate holds nothing: the next start goes on at once", function()
    -- the gate is an flock, which the kernel lets go however its holder ends; the killed start had made RUN
    -- (and start.lock) but written nothing else, so the next new run into RUN is no second run there
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n" .. tiny .. "}\n")
    local log, go = run_dir .. ".log", run_dir .. ".go"
    local pid = S.spawn_rc("env TRANSOM_TEST_START_PAUSE=" .. q(go) .. " " .. q(BIN) .. " run " .. q(path), log)
    local ok, err = pcall(function()
      assert.is_truthy(S.wait_for(function() return (S.read(log) or ""):find("start paused", 1, true) end, 60),
        S.read(log))
      assert.is_true(exists(run_dir .. "/start.lock"))
      os.execute("kill -9 " .. pid)
      assert.is_truthy(S.wait_for(function() return not S.alive(pid) end, 60), "the start outlived kill -9")
      local code, out, e = transom(dir, "run", path, "--set", "max_steps=3")
      assert.are.equal(0, code, e .. out)
      has(out, "step 3/3")
      assert.is_nil(e:find("waiting for it", 1, true), e)
    end)
    write(go, "")
    S.cleanup()
    assert(ok, err)
  end)

  it("removes a new run directory, and the parents it made, when the start is refused after its checks begin", function()
    -- the start gate makes RUN for its lock file (RUN/start.lock); a start refused after that (here: hosts without
    -- MASTER_ADDR, checked before anything is written) leaves nothing behind: not RUN, not the parents it made, not
    -- a directory that was there before it (only its lock file goes)
    local function refused(run_dir)
      local path = job_file("return {\n  data = DATA, run_dir = " .. string.format("%q", run_dir) .. ",\n" .. tiny .. "}\n")
      local _, how, code = os.execute(string.format("env -u MASTER_ADDR -u MASTER_PORT %s run %s --replicas 2 --set hosts=2 "
        .. ">%s 2>%s", q(BIN), q(path), q(dir .. "/stdout"), q(dir .. "/stderr")))
      assert(how == "exit")
      local e = read(dir .. "/stderr")
      assert.are.equal(2, code, e)
      has(e, "MASTER_ADDR")
    end
    refused(dir .. "/made/a/b")
    assert.is_false(exists(dir .. "/made"), "a refused start left " .. dir .. "/made")
    refused(dir .. "/made2/a/b/") -- a trailing slash
    assert.is_false(exists(dir .. "/made2"), "a refused start left " .. dir .. "/made2")
    assert(os.execute("mkdir -p " .. q(dir .. "/mine")))
    refused(dir .. "/mine/run")
    assert.is_true(exists(dir .. "/mine"), "a refused start removed a directory it did not make")
    assert.is_false(exists(dir .. "/mine/run"), "a refused start left " .. dir .. "/mine/run")
    -- "..": its prefixes are not the directories made, so nothing goes (T/new/../mine would take mine)
    refused(dir .. "/new/../mine")
    assert.is_true(exists(dir .. "/mine"), "a refused start removed a directory it did not make")
  end)

  it("runs, with one warning, where the filesystem has no locks (flock: ENOSYS, ENOLCK, EOPNOTSUPP, EINVAL)", function()
    -- (before: "cannot lock RUN/run.lock: Function not implemented", and no lone run could start on Lustre
    -- without flock or NFSv3 without lockd)
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n" .. tiny .. "}\n")
    local function run(e, ...)
      local args = {}
      for i, a in ipairs({ ... }) do args[i] = q(a) end
      local _, how, code = os.execute(string.format("env TRANSOM_TEST_FLOCK_ERRNO=%s %s %s >%s 2>%s", e, q(BIN),
        table.concat(args, " "), q(dir .. "/stdout"), q(dir .. "/stderr")))
      assert(how == "exit")
      return code, read(dir .. "/stdout"), read(dir .. "/stderr")
    end
    local code, out, err = run("ENOSYS", "run", path, "--set", "max_steps=3")
    assert.are.equal(0, code, err)
    has(out, "step 3/3")
    has(err, run_dir .. "/run.lock: this filesystem has no locks (Function not implemented): two runs in " .. run_dir
      .. " are not prevented")
    for _, e in ipairs({ "ENOLCK", "EOPNOTSUPP", "EINVAL" }) do
      code, out, err = run(e, "run", "--resume", run_dir, "--set", "max_steps=4")
      assert.are.equal(0, code, err)
      has(err, "this filesystem has no locks")
      -- one warning, not one per try
      local _, n = err:gsub("has no locks", "")
      assert.are.equal(1, n, err)
    end
    -- another error is still an error
    code, _, err = run("EIO", "run", "--resume", run_dir, "--set", "max_steps=5")
    assert.are_not.equal(0, code, err)
    has(err, "cannot lock " .. run_dir .. "/run.lock")
  end)

  it("a first run that fails before training leaves a directory a rerun or --resume takes up", function()
    -- job.lua cannot be written (its .tmp is a directory): the store is not opened yet, so the fixed rerun goes
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n" .. tiny .. "}\n")
    assert(os.execute("mkdir -p " .. q(run_dir .. "/job.lua.tmp")))
    local code, _, err = transom(dir, "run", path)
    assert.are_not.equal(0, code, err)
    has(err, "job.lua.tmp")
    assert(os.execute("rmdir " .. q(run_dir .. "/job.lua.tmp")))
    code, _, err = transom(dir, "run", path)
    assert.are.equal(0, code, err)
    -- the initial weights cannot be written: job.lua and an opened store without a checkpoint stay behind
    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n" .. tiny .. "}\n")
    assert(os.execute("mkdir -p " .. q(run_dir .. "/model.safetensors.tmp")))
    code, _, err = transom(dir, "run", path)
    assert.are_not.equal(0, code, err)
    assert.is_true(exists(run_dir .. "/job.lua") and exists(run_dir .. "/ckpt"))
    assert(os.execute("rmdir " .. q(run_dir .. "/model.safetensors.tmp")))
    -- a rerun is pointed at --resume, which starts from step 0
    code, _, err = transom(dir, "run", path)
    assert.are.equal(2, code, err)
    has(err, "transom run --resume " .. run_dir)
    local out
    code, out, err = transom(dir, "run", "--resume", run_dir)
    assert.are.equal(0, code, err)
    has(out, "no committed checkpoint", "step 2/2")
    -- a store without a committed checkpoint and no job.lua (an older build opened the store first, then failed
    -- to write job.lua) is reused: a plain rerun trains
    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n" .. tiny .. "}\n")
    assert(os.execute("mkdir -p " .. q(run_dir .. "/model.safetensors.tmp")))
    code, _, err = transom(dir, "run", path)
    assert.are_not.equal(0, code, err)
    assert(os.execute("rmdir " .. q(run_dir .. "/model.safetensors.tmp")))
    os.remove(run_dir .. "/job.lua")
    code, out, err = transom(dir, "run", path)
    assert.are.equal(0, code, err)
    has(out, "step 2/2")
    -- and so is an empty ckpt/ (killed between its mkdir and the store's first file)
    path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n" .. tiny .. "}\n")
    assert(os.execute("mkdir -p " .. q(run_dir .. "/ckpt")))
    code, _, err = transom(dir, "run", path)
    assert.are.equal(0, code, err)
  end)

  -- README: relative paths are relative to the current directory. A run's
  -- job.lua writes them absolute, so --resume RUN and sample RUN mean the same
  -- files from anywhere (they said "key 'data': cannot open 'data.txt'").
  it("writes a run's paths absolute: --resume and sample from another directory", function()
    local w = dir .. "/cwd"
    assert(os.execute("mkdir -p " .. q(w)))
    write(w .. "/data.txt", read(data))
    write(w .. "/mymodel.lua", read(S.ROOT .. "/lua/models/gpt.lua"))
    write(w .. "/rel.lua", 'return {\n  data = "./data.txt", model = "mymodel.lua", run_dir = "r",\n' .. tiny .. "}\n")
    local out, rc = S.sh("cd " .. q(w) .. " && " .. q(BIN) .. " run rel.lua")
    assert.are.equal(0, rc, out)
    local j = job.load(w .. "/r/job.lua")
    for _, key in ipairs({ "data", "model", "run_dir" }) do
      assert.are.equal("/", j[key]:sub(1, 1), key .. " = " .. j[key])
      assert.is_nil(j[key]:find("/./", 1, true), key .. " = " .. j[key])
    end
    assert.are.equal(read(data), read(j.data))
    assert.are.equal(read(w .. "/mymodel.lua"), read(j.model))
    assert.is_true(exists(j.run_dir .. "/job.lua"))
    -- a model's name stays a name
    write(w .. "/named.lua", 'return {\n  data = "data.txt", model = "gpt", run_dir = "r2",\n' .. tiny .. "}\n")
    out, rc = S.sh("cd " .. q(w) .. " && " .. q(BIN) .. " run named.lua")
    assert.are.equal(0, rc, out)
    assert.are.equal("gpt", job.load(w .. "/r2/job.lua").model)
    out, rc = S.sh("cd / && " .. q(BIN) .. " run --resume " .. q(w .. "/r") .. " --set max_steps=3")
    assert.are.equal(0, rc, out)
    has(out, "resumed from step 2", "step 3/3")
    out, rc = S.sh("cd / && " .. q(BIN) .. " sample " .. q(w .. "/r") .. " --tokens 5")
    assert.are.equal(0, rc, out)
  end)

  -- getcwd() is the physical directory: a project reached through a
  -- symlink was written as its target. $PWD, when it names ".", is the
  -- directory as the user sees it; a stale $PWD is not used.
  it("writes the paths as seen from the starting directory ($PWD), through a symlink", function()
    local real, link = dir .. "/real", dir .. "/link"
    assert(os.execute("mkdir -p " .. q(real) .. " && ln -sfn " .. q(real) .. " " .. q(link)))
    write(real .. "/data.txt", read(data))
    write(real .. "/j.lua", 'return {\n  data = "data.txt", run_dir = "r",\n' .. tiny .. "}\n")
    local out, rc = S.sh("cd " .. q(link) .. " && " .. q(BIN) .. " run j.lua")
    assert.are.equal(0, rc, out)
    local j = job.load(real .. "/r/job.lua")
    assert.are.same({ link .. "/data.txt", link .. "/r" }, { j.data, j.run_dir })
    -- a $PWD that names another directory: getcwd's
    out, rc = S.sh("cd " .. q(link) .. " && PWD=/ " .. q(BIN) .. " run j.lua --set run_dir=r2")
    assert.are.equal(0, rc, out)
    j = job.load(real .. "/r2/job.lua")
    assert.is_nil(j.data:find(link, 1, true), j.data)
    assert.are.equal(read(data), read(j.data))
  end)

  -- model was a 256-byte field: once absolute, a model file in a directory
  -- deeper than ~240 bytes was refused; and the refusal of a path that no
  -- field holds suggested a glob, which only data and val_data take
  it("holds a model path from a deep directory; a too long one is refused without 'use a glob'", function()
    local seg = string.rep("d", 200)
    local deep = dir .. "/deep/" .. seg .. "/" .. seg
    assert(os.execute("mkdir -p " .. q(deep)))
    write(deep .. "/mymodel.lua", read(S.ROOT .. "/lua/models/gpt.lua"))
    write(deep .. "/j.lua", 'return {\n  data = ' .. string.format("%q", data) .. ', model = "mymodel.lua", '
      .. 'run_dir = ' .. string.format("%q", dir .. "/deep/r") .. ',\n' .. tiny .. "}\n")
    local out, rc = S.sh("cd " .. q(deep) .. " && " .. q(BIN) .. " run j.lua")
    assert.are.equal(0, rc, out)
    assert.are.equal(deep .. "/mymodel.lua", job.load(dir .. "/deep/r/job.lua").model)
    out, rc = S.sh("cd / && " .. q(BIN) .. " run --resume " .. q(dir .. "/deep/r") .. " --set max_steps=3")
    assert.are.equal(0, rc, out)
    has(out, "resumed from step 2")
    -- past model's 1023 bytes once absolute
    local deeper = deep .. "/" .. seg .. "/" .. seg .. "/" .. seg .. "/" .. seg
    assert(os.execute("mkdir -p " .. q(deeper)))
    write(deeper .. "/mymodel.lua", read(S.ROOT .. "/lua/models/gpt.lua"))
    write(deeper .. "/j.lua", 'return {\n  data = ' .. string.format("%q", data) .. ', model = "mymodel.lua", '
      .. 'run_dir = ' .. string.format("%q", dir .. "/deep/r2") .. ',\n' .. tiny .. "}\n")
    out, rc = S.sh("cd " .. q(deeper) .. " && " .. q(BIN) .. " run j.lua")
    assert.are_not.equal(0, rc, out)
    has(out, "key 'model' is ", "more than 1023: run from a directory with a shorter path")
    assert.is_nil(out:find("glob", 1, true), out)
    assert.is_false(exists(dir .. "/deep/r2"), "a refused job created its run dir")
    -- transom plan says the same (it said "plan: cannot prepare a scratch directory")
    out, rc = S.sh("cd " .. q(deeper) .. " && " .. q(BIN) .. " plan j.lua")
    assert.are.equal(2, rc, out)
    has(out, "key 'model' is ", "more than 1023")
    assert.is_nil(out:find("scratch", 1, true), out)
  end)

  -- a run whose job now names another model (here its width) has
  -- checkpoints, none damaged: the error says they are another model's
  -- (it said "no intact checkpoint", as if the store were broken)
  it("resuming another model's checkpoints says so", function()
    local w = dir .. "/other"
    assert(os.execute("mkdir -p " .. q(w)))
    write(w .. "/j.lua", 'return {\n  data = ' .. string.format("%q", data) .. ', run_dir = "r",\n' .. tiny .. "}\n")
    local out, rc = S.sh("cd " .. q(w) .. " && " .. q(BIN) .. " run j.lua")
    assert.are.equal(0, rc, out)
    out, rc = S.sh("cd " .. q(w) .. " && " .. q(BIN) .. " run --resume r --set n_embd=32 --set max_steps=3")
    assert.are_not.equal(0, rc, out)
    has(out, "skipped step 2: step 2 is of a different model", "every checkpoint in '", "is of a different model (config hash ")
    assert.is_nil(out:find("no intact checkpoint", 1, true), out)
  end)

  -- token data's lines are glob patterns (data.c): job.lua escapes the glob
  -- characters of the directory it prefixes, or a run begun in "exp[1]"
  -- resumed and replicated on "exp1"'s data (a sibling that "exp[1]"
  -- matches as a pattern). exp1's tokens are out of the vocabulary: using
  -- them is an error, not a silent different run.
  it("escapes the starting directory's glob characters in token data's paths", function()
    local w = dir .. "/glob"
    local a, b = w .. "/exp[1]", w .. "/exp1"
    assert(os.execute("mkdir -p " .. q(a) .. " " .. q(b)))
    local function tokens(path, count, tok)
      local t = {}
      for i = 1, count do t[i] = string.pack("<I2", tok or (i % 50)) end
      write(path, table.concat(t))
    end
    tokens(a .. "/d.bin", 400)
    tokens(b .. "/d.bin", 300, 1000)
    write(a .. "/j.lua", 'return {\n  data = "d.bin", data_format = "uint16", vocab_size = 64, run_dir = "r",\n'
      .. tiny .. "}\n")
    local out, rc = S.sh("cd " .. q(a) .. " && " .. q(BIN) .. " run j.lua")
    assert.are.equal(0, rc, out)
    has(out, "data d.bin: 400 tokens")
    local j = job.load(a .. "/r/job.lua")
    assert.are.equal(w .. "/exp\\[1\\]/d.bin", j.data)
    out, rc = S.sh("cd " .. q(a) .. " && " .. q(BIN) .. " run --resume r --set max_steps=3")
    assert.are.equal(0, rc, out)
    has(out, "resumed from step 2", ": 400 tokens (360 train, 40 val)", "step 3/3")
    -- replicated: the workers load r/job.lua
    out, rc = S.sh("cd " .. q(a) .. " && timeout 120 " .. q(BIN) .. " run j.lua --replicas 2 --set run_dir=r2")
    assert.are.equal(0, rc, out)
    has(out, "step 2/2", "2 replicas finished")
    -- a text corpus is opened by its name, not globbed: no escaping
    write(a .. "/t.txt", read(data))
    write(a .. "/t.lua", 'return {\n  data = "t.txt", run_dir = "r3",\n' .. tiny .. "}\n")
    out, rc = S.sh("cd " .. q(a) .. " && " .. q(BIN) .. " run t.lua && " .. q(BIN) .. " run --resume r3 --set max_steps=3")
    assert.are.equal(0, rc, out)
    assert.are.equal(a .. "/t.txt", job.load(a .. "/r3/job.lua").data)
  end)

  it("--resume --set max_steps=N: a default lr_decay_steps decays over the new steps, not at min_lr", function()
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR, min_lr = 1e-4,\n" .. tiny .. "}\n")
    local code, _, err = transom(dir, "run", path)
    assert.are.equal(0, code, err)
    code, _, err = transom(dir, "run", "--resume", run_dir, "--set", "max_steps=4")
    assert.are.equal(0, code, err)
    local lr = {}
    for line in read(run_dir .. "/metrics.jsonl"):gmatch("[^\n]+") do
      local step, v = line:match('^{"step":(%d+),.*"lr":([%d.eE+-]+)')
      if step then lr[tonumber(step)] = tonumber(v) end
    end
    -- cosine from 1e-3 over 4 steps: step 3 is still above min_lr (it was min_lr: decay ended at step 2)
    assert.is_true(lr[3] > 2e-4, "lr at step 3: " .. tostring(lr[3]))
    assert.is_nil(read(run_dir .. "/job.lua"):find("lr_decay_steps", 1, true))
  end)

  -- the closing sample (sample_tokens, temperature) was made by a lone run
  -- only: a replicated one skipped it without a word. It comes from the
  -- weights the leader saved, what `transom sample RUN` reads
  it("a replicated run ends with the closing sample, from the weights it saved", function()
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n" .. tiny .. "}\n")
    local code, out, err = transom(dir, "run", path, "--replicas", "2", "--set", "max_steps=3", "--set",
      "sample_tokens=20", "--set", "temperature=0.8")
    assert.are.equal(0, code, out .. err)
    local text = out:match("\n%-%-%- sample %(20 tokens, temperature 0%.80%) %-%-%-\n(.*)run directory: ")
    assert.truthy(text and #text > 0, out)
    local scode, same, serr = transom(dir, "sample", run_dir, "--tokens", "20", "--temperature", "0.8")
    assert.are.equal(0, scode, serr)
    assert.are.equal(same, text)
  end)

  it("finds a start's setup errors before it writes anything: no run directory, the corrected rerun goes", function()
    -- (before: each failed after job.lua, and for replicas the weights, secret and logs, were written, and the
    -- corrected rerun was refused as "already holds a run")
    local path, run_dir = job_file("return {\n  data = DATA, run_dir = RUN_DIR,\n" .. tiny .. "}\n")
    local function start(env, ...)
      local args = {}
      for i, a in ipairs({ ... }) do args[i] = q(a) end
      return S.sh("env -u MASTER_ADDR -u MASTER_PORT " .. env .. " " .. q(BIN) .. " run " .. q(path) .. " "
        .. table.concat(args, " "))
    end
    local out, rc = start("", "--replicas", "2", "--set", "hosts=2")
    assert.are.equal(2, rc, out)
    has(out, "--set hosts=2: key 'hosts'", "needs MASTER_ADDR")
    assert.is_false(exists(run_dir), out)
    out, rc = start("MASTER_PORT=99999", "--replicas", "2")
    assert.are.equal(2, rc, out)
    has(out, "MASTER_PORT '99999' is not a port number")
    assert.is_false(exists(run_dir), out)
    for _, replicas in ipairs({ "1", "2" }) do
      out, rc = start("", "--replicas", replicas, "--set", "checkpoint.remote=/proc/nope")
      assert.are.equal(2, rc, out)
      has(out, "--set checkpoint.remote=/proc/nope: key 'checkpoint.remote'", "'/proc/nope'")
      assert.is_false(exists(run_dir), out)
    end
    out, rc = start("", "--replicas", "2", "--set", "checkpoint.remote=" .. run_dir .. "-remote")
    assert.are.equal(0, rc, out)
    has(out, "finished at step 2")
  end)

  it("checks --set checkpoint.FIELD=VALUE", function()
    local path, run_dir = job_file("return { data = DATA, run_dir = RUN_DIR }\n")
    has(rejected(path, run_dir, "--set", "checkpoint.every_steps=abc"), "--set checkpoint.every_steps=abc",
      "'checkpoint.every_steps'", "integer")
    has(rejected(path, run_dir, "--set", "checkpoint.nope=1"), "--set checkpoint.nope=1", "'checkpoint.nope'")
    has(rejected(path, run_dir, "--set", "checkpoint=1"), "--set checkpoint=1", "checkpoint.FIELD=VALUE")
    has(rejected(path, run_dir, "--set", "checkpoint.keep_last=0"), "--set checkpoint.keep_last=0", ">= 1")
  end)

  describe("transom.job in-process", function()
    local function load_err(path, sets)
      local ok, e = pcall(job.load, path, sets)
      assert.is_false(ok, "expected an error")
      assert.are.equal("table", type(e), "error should be a table, got " .. tostring(e))
      assert.are.equal("string", type(e.msg))
      return e
    end

    it("raises {msg, source, line} for a bad key", function()
      local path = job_file("return {\n  data = DATA,\n\n  lerning_rate = 1,\n}\n")
      local e = load_err(path)
      assert.are.equal(path, e.source)
      assert.are.equal(4, e.line)
      assert.are.equal(path .. ":4: key 'lerning_rate' is not a job field (did you mean 'lr'?)", e.msg)
    end)

    it("raises {msg, source, line} for syntax and runtime errors", function()
      local e = load_err(job_file("return {\n  data = DATA,\n  n_layer = = 2,\n}\n"))
      assert.are.equal(3, e.line)
      e = load_err(job_file("local x = 1\nlocal y = undefined_thing\nreturn { data = DATA }\n"))
      assert.are.equal(2, e.line)
      assert.is_truthy(e.msg:find("undefined global 'undefined_thing'", 1, true), e.msg)
    end)

    it("keeps the full path and line for a long job path", function()
      local long = dir .. "/" .. string.rep("d", 80)
      assert(os.execute("mkdir -p " .. q(long)))
      local path = long .. "/job.lua"
      write(path, "return {\n  data = nope,\n}\n")
      local e = load_err(path)
      assert.are.equal(2, e.line)
      assert.are.equal(path .. ":2: undefined global 'nope'", e.msg)
    end)

    it("names the --set item as the source, with no line", function()
      local path = job_file("return { data = DATA }\n")
      local e = load_err(path, { "n_layer=abc" })
      assert.are.equal("--set n_layer=abc", e.source)
      assert.is_nil(e.line)
      assert.is_truthy(e.msg:find("'n_layer'", 1, true), e.msg)
    end)

    it("fills defaults and applies --set with the key's type", function()
      local path = job_file("return { data = DATA, n_layer = 3 }\n", "myjob")
      local j = job.load(path, { "lr=0.01", "n_head=8", "sample_prompt=x=y" })
      assert.are.equal(3, j.n_layer)
      assert.are.equal(0.01, j.lr)
      assert.are.equal(8, j.n_head)
      assert.are.equal("integer", math.type(j.n_head))
      assert.are.equal("x=y", j.sample_prompt)
      assert.are.equal(128, j.n_embd)         -- default
      assert.are.equal(j.max_steps, j.lr_decay_steps)
      assert.is_truthy(j.name:match("^myjob%d+$"), j.name)
    end)

    it("fills the checkpoint table from the policy file, under the job's overrides", function()
      local policy_path = assert(package.searchpath("policies.checkpoint", package.path))
      local policy = assert(loadfile(policy_path, "t", {}))()
      local j = job.load(job_file("return { data = DATA }\n"))
      assert.are.same(policy, j.checkpoint)

      j = job.load(job_file("return { data = DATA, checkpoint = { keep_last = 9 } }\n"), { "checkpoint.every_steps=7" })
      local want = {}
      for k, v in pairs(policy) do want[k] = v end
      want.keep_last, want.every_steps = 9, 7
      assert.are.same(want, j.checkpoint)
      assert.are.equal("integer", math.type(j.checkpoint.every_steps))
    end)

    it("dump() output loads back to an equal table", function()
      local path = job_file([[
return {
  data = DATA,
  name = "round trip",
  lr = 3e-4,
  min_lr = 0.1 + 0.2 - 0.3,
  temperature = 0.1 + 0.2,
  grad_clip = 1,
  eps = 1e-12,
  sample_prompt = "a\"b\\c\1d\r\n\t\255 ]] .. "]]" .. [[", -- \1: a control byte (a NUL is refused)
  lr_decay_steps = 777,
  checkpoint = { every_seconds = 0.1 + 0.2, when_busy = "skip", keep_every = 1000 },
}
]])
      local a = job.load(path)
      local text = job.dump(a)
      local again = dir .. "/dumped.lua"
      write(again, text)
      local b = job.load(again)
      assert.are.same(a, b)
      for k, v in pairs(a) do
        assert.are.equal(math.type(v), math.type(b[k]), "type of " .. k)
      end
      for k, v in pairs(a.checkpoint) do
        assert.are.equal(math.type(v), math.type(b.checkpoint[k]), "type of checkpoint." .. k)
      end
      assert.are.equal(0.1 + 0.2, b.checkpoint.every_seconds)
      -- and the dump is stable
      assert.are.equal(text, job.dump(b))
    end)

    it("dump(job, cwd) writes every path-valued key absolute against cwd, names and absolute paths as they are", function()
      local a = job.load((job_file([[
return {
  data = "a.bin\n/abs/b.bin\n./c_*.bin", val_data = "v.bin", vocab_size = 256, tokenizer = "t.bpe",
  init_from = "../hf", model = "m/x.lua", run_dir = ".", replicas = 2, policies = "pol",
  checkpoint = { remote = "remote" }, pipeline = { placement = "place.lua" },
}
]])), {})
      local text = job.dump(a, "/base")
      local again = dir .. "/absolute.lua"
      write(again, text)
      local b = job.load(again)
      assert.are.equal("/base/a.bin\n/abs/b.bin\n/base/c_*.bin", b.data)
      assert.are.same({ "/base/v.bin", "/base/t.bpe", "/base/../hf", "/base/m/x.lua", "/base", "/base/pol" },
        { b.val_data, b.tokenizer, b.init_from, b.model, b.run_dir, b.policies })
      assert.are.same({ "/base/remote", "/base/place.lua" }, { b.checkpoint.remote, b.pipeline.placement })
      -- names stay names, and "" stays "none"
      local c = job.load((job_file("return { data = '/d.txt', model = 'mlp', pipeline = { placement = 'even' } }\n")))
      write(again, job.dump(c, "/"))
      local d = job.load(again)
      assert.are.same({ "/d.txt", "mlp", "even", "" }, { d.data, d.model, d.pipeline.placement, d.checkpoint.remote })
      write(again, job.dump(job.load((job_file("return { data = 'd.txt' }\n"))), "/"))
      assert.are.equal("/d.txt", job.load(again).data)
    end)

    -- A run's job.lua is loaded again by --resume, with --set on top:
    -- max_replicas at its default (replicas) must follow a new replicas,
    -- not stay the old count as if the user had chosen it (a pipelined
    -- resume with fewer pipelines was refused for it, a resume with more
    -- replicas had it 'below replicas'). One it was given stays.
    -- The same for lr_decay_steps (default: max_steps): a resume with more
    -- steps ran them all at min_lr.
    it("dump() leaves max_replicas and lr_decay_steps to follow replicas and max_steps unless the job chose them", function()
      for _, c in ipairs({
        { "pipeline = { stages = 2 }, replicas = 2", "replicas=1", "max_replicas", 1 },
        { "replicas = 2", "replicas=3", "max_replicas", 3 },
        { "replicas = 2, max_replicas = 4", "replicas=3", "max_replicas", 4 },
        { "max_steps = 30", "max_steps=50", "lr_decay_steps", 50 },
        { "max_steps = 30, lr_decay_steps = 40", "max_steps=50", "lr_decay_steps", 40 },
      }) do
        local a = job.load((job_file("return { data = DATA, warmup_steps = 0, " .. c[1] .. " }\n")), {})
        local again = dir .. "/resumed.lua"
        write(again, job.dump(a))
        local ok, b = pcall(job.load, again, { c[2] })
        assert.is_true(ok, c[1] .. " then --set " .. c[2] .. ": " .. tostring(type(b) == "table" and b.msg or b))
        assert.are.equal(c[4], b[c[3]], c[1])
      end
      -- a run's job.lua of an older build, which wrote the default down, follows too
      write(dir .. "/older.lua", "-- resolved job, written by transom\nreturn { data = " .. string.format("%q", data)
        .. ", max_steps = 30, lr_decay_steps = 30, warmup_steps = 0 }\n")
      assert.are.equal(50, job.load(dir .. "/older.lua", { "max_steps=50" }).lr_decay_steps)
    end)
  end)
end)
