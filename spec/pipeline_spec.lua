-- pipeline_spec.lua — pipeline stages (FusionLLM, issue 14) through the CLI:
-- a job cut into 2 and 3 stage processes (1F1B, activations forward and
-- gradients back over loopback) ends with the same parameters, bit for bit,
-- as one process accumulating the same micro-batches (pipeline.stages = 1),
-- with the tied embedding/head, gradient clipping and evaluation on; bad
-- pipeline keys name the file, line and key; a stage killed with -9 ends
-- the run with an error naming it, and no stage outlives it; `transom
-- plan` clusters workers by bandwidth and keeps each cluster contiguous
-- (OP-Fence), and a Lua policy overrides it; AdaTopK sends fewer bytes and
-- still learns; 2 pipelines x 2 stages (stage replicas averaging through
-- FTAR) give the same parameters as 2 x 1; when a worker of one pipeline
-- is killed (-9) the launcher starts that pipeline again, its new workers
-- catch up from the live one and rejoin with the same parameters, bit for
-- bit, from the step they entered at (with pipeline.rebuilds = 0 the other
-- trains on alone; pipeline 33 of 34 is rebuilt like any other); a worker
-- killed before it got the plan ends the run naming it (not the launcher
-- by SIGPIPE). About 30 s on 2 cores.

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local q, write = S.q, S.write

local SLICE = 200 * 1024

local function job_text(data, extra)
  return string.format([[
return {
  model = "gpt", data = %q,
  n_layer = 2, n_head = 2, n_embd = 32, block_size = 32, batch_size = 8,
  max_steps = 8, warmup_steps = 2, eval_interval = 4, eval_steps = 2, sample_tokens = 0,
  threads = 1, grad_clip = 0.5, checkpoint = { every_steps = 0 },
  %s
}
]], data, extra or "")
end

describe("pipeline stages", function()
  local dir, data

  setup(function()
    local f = io.open(S.CORPUS, "rb")
    if not f then return end
    local text = f:read(SLICE)
    f:close()
    dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir -p " .. q(dir)))
    data = dir .. "/corpus.txt"
    write(data, text)
  end)
  teardown(function()
    if dir then os.execute("rm -rf " .. q(dir)) end
  end)
  after_each(function() S.cleanup() end) -- a failed test leaves no process behind

  local function run(name, stages, extra)
    local job = dir .. "/" .. name .. ".lua"
    write(job, job_text(data, extra or ""))
    local rd = dir .. "/" .. name
    local code, out, err = S.transom(dir, "run", job, "--set", "run_dir=" .. rd, "--set",
      "pipeline.stages=" .. stages, "--set", "pipeline.micro_batches=4")
    return code, out, err, rd
  end

  -- the steps a store committed (`transom ckpt ls`), as a set
  local function steps_of(store)
    local t = {}
    for st in S.sh(q(S.BIN) .. " ckpt ls " .. q(store)):gmatch("\n%s*(%d+)%s") do t[tonumber(st)] = true end
    return t
  end
  local function list(set, sep)
    local l = {}
    for st in pairs(set) do l[#l + 1] = st end
    table.sort(l)
    return table.concat(l, sep or ",")
  end

  it("gives the same parameters on 1, 2 and 3 stages, bit for bit", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local weights, losses = {}, {}
    for _, stages in ipairs({ 1, 2, 3 }) do
      local code, out, err, rd = run("s" .. stages, stages)
      assert.are.equal(0, code, out .. err)
      assert.truthy(out:find(stages .. " stage%(s%), 4 micro%-batch%(es%) of 2 sequences"), out)
      assert.truthy(out:find("val loss"), out)
      weights[stages] = assert(S.read(rd .. "/model.safetensors"))
      losses[stages] = S.losses(rd)
      assert.are.equal(8, #losses[stages])
    end
    assert.are.equal(weights[1], weights[2])
    assert.are.equal(weights[1], weights[3])
    assert.are.same(losses[1], losses[2])
    assert.are.same(losses[1], losses[3])
  end)

  it("names the file, line and key of a bad pipeline setting", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local job = dir .. "/bad.lua"
    write(job, job_text(data, "pipeline = { stages = 2, micro_batches = 3 },"))
    local code, _, err = S.transom(dir, "run", job)
    assert.are.equal(2, code)
    assert.truthy(err:find("bad%.lua:%d+:.*micro_batches = 3 does not divide batch_size = 8"), err)
    write(job, job_text(data, "pipeline = { stages = 2, micro_batch = 4 },"))
    code, _, err = S.transom(dir, "run", job)
    assert.are.equal(2, code)
    assert.truthy(err:find("bad%.lua:%d+:.*pipeline%.micro_batch"), err)
    write(job, job_text(data, "pipeline = { stages = 33 }, replicas = 2,"))
    code, _, err = S.transom(dir, "run", job)
    assert.are.equal(2, code)
    assert.truthy(err:find("bad%.lua:%d+:.*at most 64 stage workers"), err)
    write(job, job_text(data, "pipeline = { stages = 2, workers = { { sped = 0.5 }, {} } },"))
    code, _, err = S.transom(dir, "run", job)
    assert.are.equal(2, code)
    assert.truthy(err:find("bad%.lua:%d+:.*'sped' is not a pipeline%.workers field"), err)
    write(job, job_text(data, "pipeline = { stages = 2, workers = { { speed = 0 }, {} } },"))
    code, _, err = S.transom(dir, "run", job)
    assert.are.equal(2, code)
    assert.truthy(err:find("bad%.lua:%d+:.*speed.* must be > 0"), err)
    write(job, job_text(data, "pipeline = { stages = 3, workers = { {}, {} } },"))
    code, _, err = S.transom(dir, "run", job)
    assert.are.equal(2, code)
    assert.truthy(err:find("bad%.lua:%d+:.*lists 2 workers for 3 stages"), err)
    write(job, job_text(data, "pipeline = { stages = 2 },"))
    code, _, err = S.transom(dir, "run", job, "--set", "checkpoint.remote=" .. dir .. "/remote")
    assert.are.equal(2, code)
    assert.truthy(err:find("checkpoint%.remote.*a pipelined job"), err)
    -- keys the pipeline launcher never reads: refused, not ignored
    for _, set in ipairs({ "metrics_port=19123", "max_replicas=4", "policies=" .. dir }) do
      code, _, err = S.transom(dir, "run", job, "--set", set)
      assert.are.equal(2, code, err)
      local key = set:match("^[%w_]+")
      assert.truthy(err:find("%-%-set " .. key .. "=.*" .. key .. " = .*a pipelined job"), err)
    end
    write(job, job_text(data, 'pipeline = { stages = 2, compression = "topk" },'))
    code, _, err = S.transom(dir, "plan", job)
    assert.are.equal(2, code)
    assert.truthy(err:find("bad%.lua:%d+:.*compression.*none, adatopk"), err)
  end)

  it("ends the run when a stage is killed, naming it, with no stage left behind", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local job = dir .. "/kill.lua"
    write(job, job_text(data, "pipeline = { stages = 3, micro_batches = 4 }, max_steps = 100000, eval_interval = 0,"))
    local rd = dir .. "/kill"
    local _, rc = S.spawn_rc(q(S.BIN) .. " run " .. q(job) .. " --set run_dir=" .. q(rd), dir .. "/kill.log")
    local function lines() return #((S.read(rd .. "/metrics.jsonl") or ""):gsub("[^\n]", "")) end
    for _ = 1, S.N(600) do
      if lines() >= 3 or rc() then break end
      S.sleep(0.05)
    end
    assert.truthy(lines() >= 3, S.read(dir .. "/kill.log"))
    local stage1 = S.sh("pgrep -f -- " .. q("[s]tage --run " .. rd .. " --worker 1 "))
    local spid = assert(tonumber(stage1:match("(%d+)")), stage1)
    os.execute("kill -9 " .. spid)
    for _ = 1, S.N(600) do
      if rc() then break end
      S.sleep(0.05)
    end
    assert.are.equal(1, rc(), S.read(dir .. "/kill.log"))
    local log = S.read(dir .. "/kill.log")
    assert.truthy(log:find("pipeline stage %d %(worker 1%) was killed by signal 9"), log)
    local left = S.sh("pgrep -f -- " .. q("[s]tage --run " .. rd .. " ") .. " || true")
    assert.are.equal("", (left:gsub("%s", "")))
  end)

  -- three workers: two in zone a (LAN 1 Gbit), one in zone b behind a
  -- 10 Mbit WAN; worker 1 at half speed. The job's numbers, no probes, so
  -- the plan is deterministic.
  local HET = [[pipeline = { stages = 3, micro_batches = 4, probe = false, lan_mbit = 1000, wan_mbit = 10,
    workers = { { zone = "a" }, { zone = "b" }, { zone = "a", speed = 0.5 } } %s },]]

  local function plan(extra)
    local job = dir .. "/plan.lua"
    write(job, job_text(data, string.format(HET, extra or "")))
    return S.transom(dir, "plan", job)
  end

  local function stages(out)
    local order = {}
    for w, zone in out:gmatch("\n +%d+ +(%d+) +(%a+) +%d+") do order[#order + 1] = zone .. w end
    return table.concat(order, " ")
  end

  it("plans with OP-Fence: clusters by bandwidth, each cluster contiguous, the fast worker first", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local code, out, err = plan()
    assert.are.equal(0, code, out .. err)
    assert.truthy(out:find("plan: opfence | 3 stages x 4 micro%-batches | 2 bandwidth cluster%(s%)"), out)
    local order = stages(out)
    assert.truthy(order == "a0 a2 b1" or order == "b1 a0 a2", order) -- the WAN crossed once
    assert.truthy(out:find("MB/step raw"), out)
    assert.truthy(out:find("\n *%d%->%d +10%.0 "), out) -- the one WAN link in the chain
    code, out = plan(', placement = "even"')
    assert.are.equal(0, code, out)
    assert.are.equal("a0 b1 a2", stages(out))
    assert.are.equal(2, select(2, out:gsub("\n *%d%->%d +10%.0 ", ""))) -- the WAN crossed twice
  end)

  it("lets a Lua placement policy override the plan, and names the policy file when its answer is bad", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    write(dir .. "/rev.lua", [[
return function(plan)
  local order = {}
  for i = #plan.proposal.order, 1, -1 do order[#order + 1] = plan.proposal.order[i] end
  return { cuts = plan.proposal.cuts, order = order }
end]])
    local code, out, err = plan(', placement = ' .. string.format("%q", dir .. "/rev.lua"))
    assert.are.equal(0, code, out .. err)
    local order = stages(out)
    assert.truthy(order == "b1 a2 a0" or order == "a2 a0 b1", order)
    write(dir .. "/bad.lua", "return function(plan) return { cuts = { 0, 1 }, order = { 0, 1, 2 } } end")
    code, out, err = plan(', placement = ' .. string.format("%q", dir .. "/bad.lua"))
    assert.are.equal(2, code, out)
    assert.truthy(err:find("bad%.lua: the policy's answer needs 'cuts', a list of 4 integers"), err)
    write(dir .. "/loop.lua", "return function(plan) while true do end end")
    code, out, err = plan(', placement = ' .. string.format("%q", dir .. "/loop.lua"))
    assert.are.equal(2, code, out)
    assert.truthy(err:find("loop%.lua:1:.*budget"), err)
  end)

  -- the records of a run: metrics.jsonl (stage 0) or stage-K.jsonl
  local function records(path)
    local t = {}
    for line in (S.read(path) or ""):gmatch("[^\n]+") do
      if line:find('"density_fwd"') then t[#t + 1] = line end
    end
    return t
  end
  local function field(line, key) return tonumber(line:match('"' .. key .. '":([^,}]+)')) end

  it("AdaTopK sends fewer bytes over a slow link, reports the density per link, and still trains", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local slow = [[pipeline = { stages = 2, micro_batches = 4, wan_mbit = 20, compression = "%s", min_density = 0.05,
      workers = { { zone = "a" }, { zone = "b" } } }, max_steps = 10, eval_interval = 0,]]
    local bytes = {}
    for _, how in ipairs({ "none", "adatopk" }) do
      local job = dir .. "/" .. how .. ".lua"
      write(job, job_text(data, string.format(slow, how)))
      local code, out, err = S.transom(dir, "run", job, "--set", "run_dir=" .. dir .. "/" .. how)
      assert.are.equal(0, code, out .. err)
      local r0, r1 = records(dir .. "/" .. how .. "/metrics.jsonl"), records(dir .. "/" .. how .. "/stage-1.jsonl")
      assert.are.equal(10, #r0)
      assert.are.equal(10, #r1)
      bytes[how] = 0
      for i = 1, 10 do bytes[how] = bytes[how] + field(r0[i], "bytes_fwd") + field(r1[i], "bytes_bwd") end
      assert.are.equal(0, field(r0[10], "bytes_bwd")) -- stage 0 sends nothing back
      assert.are.equal(0, field(r1[10], "bytes_fwd")) -- the last stage nothing forward
      local last0, last1 = r0[10], r1[10]
      if how == "none" then
        assert.are.equal(1, field(last0, "density_fwd"))
        assert.are.equal(1, field(last1, "density_bwd"))
      else -- from the first step on: it starts from the probe's bandwidth and the plan's compute (it used to
        -- send step 1 raw, learning both), then follows the sends
        assert.truthy(field(r0[1], "density_fwd") < 1, r0[1])
        assert.truthy(field(r1[1], "density_bwd") < 1, r1[1])
        assert.truthy(field(last0, "density_fwd") < 1, last0)
        assert.truthy(field(last1, "density_bwd") < 1, last1)
        assert.truthy(field(last0, "loss") < field(r0[1], "loss"), "it still learns")
      end
    end
    assert.truthy(bytes.adatopk < bytes.none / 2, bytes.adatopk .. " vs " .. bytes.none)
  end)

  it("runs pipelines x replicas: 2 pipelines of 2 stages give the same parameters as 2 of 1", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local weights = {}
    for _, stages in ipairs({ 1, 2 }) do
      local job = dir .. "/rep" .. stages .. ".lua"
      write(job, job_text(data, "replicas = 2,"))
      local rd = dir .. "/rep" .. stages
      local code, out, err = S.transom(dir, "run", job, "--set", "run_dir=" .. rd, "--set",
        "pipeline.stages=" .. stages, "--set", "pipeline.micro_batches=2")
      assert.are.equal(0, code, out .. err)
      weights[stages] = assert(S.read(rd .. "/model.safetensors"))
      local last = S.read(rd .. "/metrics.jsonl"):match('[^\n]*"step":8,[^\n]*"replicas":2[^\n]*')
      assert.truthy(last, "step 8 averaged 2 pipelines")
    end
    assert.are.equal(weights[1], weights[2])
  end)

  -- A placement policy (its path) that cuts 3 stages, the middle one the
  -- first gelu alone: a stage that holds no parameter.
  local function gelu_alone()
    local policy = dir .. "/gelu_alone.lua"
    write(policy, [[
return function(plan)
  local g
  for i, op in ipairs(plan.ops) do if op.name == "gelu" then g = g or i - 1 end end
  return { cuts = { 0, g, g + 1, #plan.ops }, order = { 0, 1, 2 } }
end]])
    return policy
  end

  -- 2 pipelines of `stages` stages (default 2) train 2000 steps, padded
  -- (TRANSOM_TEST_STEP_MS) so the run outlasts a rebuild on a loaded
  -- machine; after 20 steps worker `worker` (default 3: pipeline 1's last
  -- stage of 2) gets signal sig (default KILL). extra: more pipeline keys;
  -- top: more job keys. Returns the log, the exit status and the run
  -- directory.
  local function kill_one(name, extra, sig, top, stages, worker)
    local job = dir .. "/" .. name .. ".lua"
    write(job, job_text(data, "replicas = 2, pipeline = { stages = " .. (stages or 2) .. ", micro_batches = 2"
      .. (extra or "") .. " }, "
      .. "max_steps = 2000, eval_interval = 0, checksum_interval = 1," .. (top or "")))
    local rd = dir .. "/" .. name
    local log = dir .. "/" .. name .. ".log"
    local _, rc = S.spawn_rc("env TRANSOM_TEST_STEP_MS=" .. math.floor(S.T(2)) .. " " .. q(S.BIN) .. " run " .. q(job)
      .. " --set run_dir=" .. q(rd), log)
    local function lines() return #((S.read(rd .. "/metrics.jsonl") or ""):gsub("[^\n]", "")) end
    for _ = 1, S.N(600) do
      if lines() >= 20 or rc() then break end
      S.sleep(0.05)
    end
    assert.truthy(lines() >= 20 and not rc(), S.read(log))
    local w = S.sh("pgrep -f -- " .. q("[s]tage --run " .. rd .. " --worker " .. (worker or 3) .. " "))
    os.execute("kill -" .. (sig or "KILL") .. " " .. assert(tonumber(w:match("(%d+)")), w))
    for _ = 1, S.N(1800) do
      if rc() then break end
      S.sleep(0.05)
    end
    local left = S.sh("pgrep -f -- " .. q("[s]tage --run " .. rd .. " ") .. " || true")
    assert.are.equal("", (left:gsub("%s", "")), "no stage outlives the run")
    return S.read(log), rc(), rd
  end

  -- step -> checksum of a stage's records
  local function checksums(path)
    local t = {}
    for line in (S.read(path) or ""):gmatch("[^\n]+") do
      local step, sum = line:match('"step":(%d+),.*"checksum":"(%x+)"')
      if step then t[tonumber(step)] = sum end
    end
    return t
  end

  it("rebuilds a pipeline that lost a worker: its new workers catch up from the live one and rejoin, bit for bit",
    function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local log, rc, rd = kill_one("rebuild")
    assert.are.equal(0, rc, log)
    assert.truthy(log:find("pipeline 1 lost: pipeline stage %d %(worker 3%) was killed by signal 9"), log)
    assert.truthy(log:find("pipeline 1: started again %(1 of 3%); its workers catch up from pipeline 0"), log)
    local at = tonumber(log:match("pipeline 1 rejoined at step (%d+): 2 pipelines train"))
    assert.truthy(at and at < 2000, log)
    -- and RUN/events.jsonl says so, in order, as the operator's do for a replica
    local ev = S.read(rd .. "/events.jsonl") or ""
    local lost = ev:find('"worker":%-1,"kind":"pipeline_lost","detail":"pipeline 1 lost: pipeline stage %d %(worker 3%)')
    local again = ev:find('"kind":"pipeline_rebuilt","detail":"pipeline 1: started again %(1 of 3%)')
    local back = ev:find('"step":' .. at .. ',"worker":%-1,"kind":"pipeline_rejoined","detail":"pipeline 1 rejoined at step '
      .. at)
    assert.truthy(lost and again and back and lost < again and again < back, ev)
    assert.truthy(S.read(rd .. "/metrics.jsonl"):find('"step":2000,[^\n]*"replicas":2'), "the last step averaged both")
    -- from the step it entered at, each stage of the rebuilt pipeline holds
    -- exactly the parameters of the same stage of the live one
    for _, f in ipairs({ { "metrics.jsonl", "pipeline-1-stage-0.jsonl" }, { "stage-1.jsonl", "pipeline-1-stage-1.jsonl" } }) do
      local live, rebuilt = checksums(rd .. "/" .. f[1]), checksums(rd .. "/" .. f[2])
      local n = 0
      for step = at, 2000 do
        assert.are.equal(live[step], rebuilt[step], f[2] .. " at step " .. step)
        n = n + 1
      end
      assert.are.equal(2001 - at, n)
      assert.truthy(live[2000])
    end
    assert.truthy(S.exists(rd .. "/model.safetensors"))
  end)

  it("with pipeline.rebuilds = 0 the other pipelines train on to the end without the lost one", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local log, rc, rd = kill_one("norebuild", ", rebuilds = 0")
    assert.are.equal(0, rc, log)
    assert.truthy(log:find("pipeline 1 lost: pipeline stage %d %(worker 3%) was killed by signal 9"), log)
    assert.truthy(log:find("pipeline 1: not started again (pipeline.rebuilds = 0)", 1, true), log)
    local ev = S.read(rd .. "/events.jsonl") or ""
    assert.truthy(ev:find('"kind":"pipeline_lost","detail":"pipeline 1 lost:', 1, true), ev)
    assert.truthy(ev:find('"kind":"pipeline_not_rebuilt","detail":"pipeline 1: not started again (pipeline.rebuilds = 0)"',
      1, true), ev)
    assert.falsy(ev:find('"pipeline_rebuilt"', 1, true), ev)
    assert.truthy(S.read(rd .. "/metrics.jsonl"):find('"step":2000,[^\n]*"replicas":1'), "one pipeline left")
    assert.truthy(S.exists(rd .. "/model.safetensors"))
  end)

  -- 34 pipelines of 1 stage (stages = 1 with micro-batches is a pipeline job;
  -- job.lua allows replicas x stages <= 64): the launcher's per-pipeline
  -- tables held 33, so losing pipeline 33 wrote past them (its first rebuild
  -- said "2 of 3", or none was left)
  it("rebuilds pipeline 33 of 34: the launcher keeps a record for every pipeline", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local job = dir .. "/many.lua"
    write(job, string.format([[
return {
  model = "gpt", data = %q, n_layer = 1, n_head = 2, n_embd = 16, block_size = 8, batch_size = 2,
  max_steps = 100000, warmup_steps = 1, eval_interval = 0, log_interval = 1000, sample_tokens = 0, threads = 1,
  checkpoint = { every_steps = 0 }, replicas = 34,
  pipeline = { stages = 1, micro_batches = 2, probe = false, rebuilds = 1 },
}
]], data))
    local rd, log = dir .. "/many", dir .. "/many.log"
    local pid, rc = S.spawn_rc(q(S.BIN) .. " run " .. q(job) .. " --set run_dir=" .. q(rd), log)
    local function lines() return #((S.read(rd .. "/metrics.jsonl") or ""):gsub("[^\n]", "")) end
    for _ = 1, S.N(1200) do
      if lines() >= 3 or rc() then break end
      S.sleep(0.05)
    end
    assert.truthy(lines() >= 3 and not rc(), S.read(log))
    local w33 = S.sh("pgrep -f -- " .. q("[s]tage --run " .. rd .. " --worker 33 "))
    os.execute("kill -KILL " .. assert(tonumber(w33:match("(%d+)")), w33))
    local said
    for _ = 1, S.N(600) do
      said = (S.read(log) or ""):match("pipeline 33: [^\n]*started again[^\n]*")
      if said or rc() then break end
      S.sleep(0.05)
    end
    os.execute("kill -KILL " .. pid) -- the launcher: its workers go with it
    for _ = 1, S.N(200) do
      if rc() then break end
      S.sleep(0.05)
    end
    assert.are.equal("pipeline 33: started again (1 of 1); its workers catch up from pipeline 0", said, S.read(log))
  end)

  it("a stage worker stopped (SIGSTOP): its pipeline is lost and the worker killed, the other pipeline trains on", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    -- its mate gives up waiting on the link after hang_seconds; the replicas' groups wait twice that, so the
    -- live pipeline's members are not timed out along with it (they were: one hung worker ended the run)
    local log, rc, rd = kill_one("stopped", ", rebuilds = 0", "STOP",
      " hang_seconds = " .. S.T(3) .. ", deadline = " .. S.T(1) .. ",")
    assert.are.equal(0, rc, log)
    assert.truthy(log:find("pipeline 1 lost: pipeline stage %d %(worker 3%) was killed by signal 9"), log)
    assert.falsy(log:find("pipeline 0 lost", 1, true), log)
    assert.truthy(S.read(rd .. "/metrics.jsonl"):find('"step":2000,[^\n]*"replicas":1'), "one pipeline left")
  end)

  -- 3 stages, the middle one a lone gelu (no parameter: it joins no
  -- all-reduce); the stopped worker is pipeline 1's last stage: its group
  -- of last stages times it out after `deadline`, pipeline 1's other
  -- stages wait on their links for hang_seconds, pipeline 0's first stage
  -- in the all-reduce with pipeline 1's as long, and pipeline 0's middle
  -- and last stages on their links meanwhile. Pipeline 0 must not be lost
  -- with it. Here pipeline 1's stages nearest the stopped one give up
  -- first, so the herald's grace is not what this run turns on (its grace
  -- and its relay along a chain are checked in test_pipeline): it covers
  -- 3 stages end to end.
  it("a last stage stopped (SIGSTOP) with 3 stages: its pipeline is lost, the other pipeline's 3 train on", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local policy = gelu_alone()
    local log, rc, rd = kill_one("stopped3", string.format(", rebuilds = 0, probe = false, placement = %q", policy),
      "STOP", " hang_seconds = " .. S.T(3) .. ", deadline = " .. S.T(1) .. ",", 3, 5)
    assert.are.equal(0, rc, log)
    assert.truthy(log:find("\n%s+1%s+1%s+%S+%s+%d+%s+[%d.]+%s+%d+%.%.%d+ %(gelu%.%.gelu%)"), log)
    assert.truthy(log:find("pipeline 1 lost: pipeline stage 2 %(worker 5%) was killed by signal 9"), log)
    assert.falsy(log:find("pipeline 0 lost", 1, true), log)
    assert.truthy(S.read(rd .. "/metrics.jsonl"):find('"step":2000,[^\n]*"replicas":1'), "one pipeline left")
  end)

  -- 3 stages x 2 pipelines, the middle stage a lone gelu (it averages no
  -- parameter with its replicas): when pipeline 0 is lost, pipeline 1's
  -- workers write every store from then on, that stage's too (it kept
  -- waiting for pipeline 0, and a resume found no step every store held)
  it("a stage that reads no parameter still checkpoints once pipeline 0 is lost", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local policy = gelu_alone()
    local job = dir .. "/paramless.lua"
    write(job, job_text(data, string.format("replicas = 2, pipeline = { stages = 3, micro_batches = 2, probe = false, "
      .. "rebuilds = 0, placement = %q }, max_steps = 120, eval_interval = 0,", policy)))
    local rd, log = dir .. "/paramless", dir .. "/paramless.log"
    local _, rc = S.spawn_rc("env TRANSOM_TEST_STEP_MS=" .. math.floor(S.T(10)) .. " " .. q(S.BIN) .. " run " .. q(job)
      .. " --set run_dir=" .. q(rd) .. " --set checkpoint.every_steps=10", log)
    local function lines() return #((S.read(rd .. "/metrics.jsonl") or ""):gsub("[^\n]", "")) end
    for _ = 1, S.N(600) do
      if lines() >= 15 or rc() then break end
      S.sleep(0.05)
    end
    assert.truthy(lines() >= 15 and not rc(), S.read(log))
    assert.truthy(S.read(log):find("\n%s+1%s+1%s+%S+%s+%d+%s+[%d.]+%s+%d+%.%.%d+ %(gelu%.%.gelu%)"), S.read(log))
    local w1 = S.sh("pgrep -f -- " .. q("[s]tage --run " .. rd .. " --worker 1 ")) -- pipeline 0's stage 1
    os.execute("kill -KILL " .. assert(tonumber(w1:match("(%d+)")), w1))
    for _ = 1, S.N(1200) do
      if rc() then break end
      S.sleep(0.05)
    end
    local out = S.read(log)
    assert.are.equal(0, rc(), out)
    assert.truthy(out:find("pipeline 0 lost", 1, true), out)
    for k = 0, 2 do -- every store holds the last step
      local ls = S.sh(q(S.BIN) .. " ckpt ls " .. q(rd .. "/ckpt-stage-" .. k))
      local newest = 0
      for st in ls:gmatch("\n%s*(%d+)%s") do newest = math.max(newest, tonumber(st)) end
      assert.are.equal(120, newest, "stage " .. k .. "'s store: " .. ls)
    end
  end)

  it("checkpoints each stage, and a launcher killed with -9 resumes to the weights of an uninterrupted run, " ..
    "past a corrupt copy in one stage's store", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local job = dir .. "/ck.lua"
    write(job, job_text(data, "pipeline = { stages = 2, micro_batches = 2 }, max_steps = 300, eval_interval = 100,"))
    local ck = { "--set", "checkpoint.every_steps=20" }
    local code, out, err = S.transom(dir, "run", job, "--set", "run_dir=" .. dir .. "/ckA", ck[1], ck[2])
    assert.are.equal(0, code, out .. err)
    assert.truthy(out:find("checkpoint: stage 1, step 20 committed"), out)
    local rd, log = dir .. "/ckB", dir .. "/ckB.log"
    local pid, rc = S.spawn_rc("env TRANSOM_TEST_STEP_MS=" .. math.floor(S.T(5)) .. " " .. q(S.BIN) .. " run " .. q(job)
      .. " --set run_dir=" .. q(rd) .. " --set checkpoint.every_steps=20", log)
    -- both stages hold a step from 40 on (not step 40 itself: on a loaded
    -- machine the nice-19 writer may still be committing step 20 when 40
    -- is due, and a snapshot due then is coalesced into a later one)
    local function committed()
      local l, held = S.read(log) or "", {}
      for k, st in l:gmatch("checkpoint: stage (%d), step (%d+) committed") do
        st = tonumber(st)
        if st >= 40 then
          held[st] = held[st] or {}
          held[st][k] = true
          if held[st]["0"] and held[st]["1"] then return true end
        end
      end
      return false
    end
    for _ = 1, S.N(600) do
      if committed() or rc() then break end
      S.sleep(0.05)
    end
    assert.truthy(committed() and not rc(), S.read(log))
    os.execute("kill -9 " .. pid) -- the launcher: its workers go with it
    for _ = 1, S.N(200) do
      if rc() and S.sh("pgrep -f -- " .. q("[s]tage --run " .. rd .. " ") .. " || true"):match("^%s*$") then break end
      S.sleep(0.05)
    end
    assert.are.equal("", (S.sh("pgrep -f -- " .. q("[s]tage --run " .. rd .. " ") .. " || true"):gsub("%s", "")))
    -- a corrupt copy in one store: a byte of stage 1's newest step that both
    -- stores hold is flipped, so every stage must resume from an older one
    local s0, s1, newest = steps_of(rd .. "/ckpt-stage-0"), steps_of(rd .. "/ckpt-stage-1"), 0
    for st in pairs(s1) do if s0[st] and st > newest then newest = st end end
    assert.truthy(newest >= 40, "no common step: " .. S.sh(q(S.BIN) .. " ckpt ls " .. q(rd .. "/ckpt-stage-1")))
    local why = S.flip_tensor_byte(rd .. "/ckpt-stage-1", rd .. "/ckpt-stage-1/data.mdb", newest,
      '[^"]*mlp%.c_fc%.weight', dir .. "/stage1.safetensors")
    assert.is_nil(why, why)
    code, out, err = S.transom(dir, "run", "--resume", rd)
    assert.are.equal(0, code, out .. err)
    assert.truthy(err:find("step " .. newest .. " of stage 1 does not verify", 1, true), err)
    local from = tonumber(out:match("resumed from step (%d+)"))
    assert.truthy(from and from >= 20 and from < newest, out)
    assert.truthy(out:find("plan: the run's own", 1, true), out)
    assert.are.equal(S.read(dir .. "/ckA/model.safetensors"), S.read(rd .. "/model.safetensors"))
    local seen, n = {}, 0 -- one record per step: the ones after the checkpoint were dropped and done again
    for step in S.read(rd .. "/metrics.jsonl"):gmatch('{"step":(%d+),"worker"') do
      assert.is_nil(seen[step], "step " .. step .. " twice")
      seen[step] = true
      n = n + 1
    end
    assert.are.equal(300, n)
  end)

  -- checkpoint.every_seconds on each stage's own clock made the stages
  -- commit different steps (stage 0 {117,123,129}, stage 1 {118,124,130}),
  -- and with keep_last the stores could share none: a resume then started
  -- over. The stages agree on the step in the end-of-step exchange.
  it("every stage's store holds the same steps with checkpoint.every_seconds", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local job, rd = dir .. "/secs.lua", dir .. "/secs"
    write(job, job_text(data, "pipeline = { stages = 2, micro_batches = 2 }, max_steps = 150, eval_interval = 0,"))
    local cmd = string.format("env TRANSOM_TEST_STEP_MS=%d %s run %s --set run_dir=%s --set checkpoint.every_steps=0 "
      .. "--set checkpoint.every_seconds=0.13 --set checkpoint.keep_last=1000 > %s 2>&1", math.floor(S.T(20)), q(S.BIN), q(job), q(rd),
      q(dir .. "/secs.log"))
    assert.truthy(os.execute(cmd), S.read(dir .. "/secs.log"))
    local s0, s1 = list(steps_of(rd .. "/ckpt-stage-0")), list(steps_of(rd .. "/ckpt-stage-1"))
    -- by seconds: how many depends on the machine's pace; a few are
    -- enough to show the stores agree
    assert.truthy(select(2, s0:gsub(",", "")) + 1 >= 3, "too few checkpoints: " .. s0)
    assert.are.equal(s0, s1)
  end)

  -- SIGTERM or SIGINT to the launcher of a pipelined run killed it at once
  -- (no handler: exit 143, the work since the last checkpoint lost), or,
  -- started in the background as S.spawn_rc starts it, SIGINT was ignored
  -- and the run went on. Now every stage stops after the same step and
  -- checkpoints it (every_steps is past the end: the stop's is the only
  -- one), stage 0 saves the weights of that step, exit 0, and --resume
  -- continues from it.
  for _, sig in ipairs({ "TERM", "INT" }) do
    it("SIG" .. sig .. " stops a pipelined run: every stage checkpoints the same step, exit 0, --resume goes on",
      function()
      if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
      local name = "sig" .. sig:lower()
      local job, rd, log = dir .. "/" .. name .. ".lua", dir .. "/" .. name, dir .. "/" .. name .. ".log"
      write(job, job_text(data, "pipeline = { stages = 2, micro_batches = 2 }, max_steps = 100000, eval_interval = 0,"))
      local pid, rc = S.spawn_rc("env TRANSOM_TEST_STEP_MS=" .. math.floor(S.T(5)) .. " " .. q(S.BIN) .. " run "
        .. q(job) .. " --set run_dir=" .. q(rd) .. " --set checkpoint.every_steps=100000 --set sample_tokens=5", log)
      local function lines() return #((S.read(rd .. "/metrics.jsonl") or ""):gsub("[^\n]", "")) end
      assert.truthy(S.wait_for(function() return lines() >= 10 or rc() end, 30) and not rc(), S.read(log))
      os.execute("kill -" .. sig .. " " .. pid)
      S.wait_rc(rc, 30)
      local out = S.read(log)
      assert.are.equal(0, rc(), out)
      local at = tonumber(out:match("\nstopped at step (%d+) %(checkpointed%); resume with: transom run %-%-resume "))
      assert.truthy(at and at >= 10, out)
      assert.falsy(out:find("--- sample", 1, true), out) -- a stopped run does not sample, as a lone one
      assert.are.equal(tostring(at), list(steps_of(rd .. "/ckpt-stage-0")), out)
      assert.are.equal(tostring(at), list(steps_of(rd .. "/ckpt-stage-1")), out)
      assert.truthy(S.read(rd .. "/model.safetensors"):find('"transom.step":"' .. at .. '"', 1, true),
        "the weights of the stop step")
      assert.are.equal("", (S.sh("pgrep -f -- " .. q("[s]tage --run " .. rd .. " ") .. " || true"):gsub("%s", "")))
      local code, o, e = S.transom(dir, "run", "--resume", rd, "--set", "max_steps=" .. (at + 3))
      assert.are.equal(0, code, o .. e)
      assert.truthy(o:find("resumed from step " .. at .. " (", 1, true), o)
      assert.truthy(S.read(rd .. "/metrics.jsonl"):find('{"step":' .. (at + 3) .. ',"worker"', 1, true))
      local ev = S.events(rd) -- the stop and the resume are events too
      for _, kind in ipairs({ "stopped", "resume" }) do
        assert.truthy(ev:find('"step":' .. at .. ',"worker":%-1,"kind":"' .. kind .. '"'), ev)
      end
      assert.truthy(ev:find('"step":' .. at .. ',"worker":1,"kind":"checkpoint"'), ev)
    end)
  end

  -- Two pipelines: the launcher's STOP reaches them one after the other,
  -- so one may read it a step later than the other (the test hook makes
  -- pipeline 1 vote a step after it read it, every time). Their stages
  -- still stop after one step: the stop vote rides on the first stage's
  -- collective over the pipelines. Until this round each pipeline agreed
  -- within itself: pipeline 0 stopped a step early, pipeline 1 ran the
  -- last step alone (its record says 1 replica) and metrics.jsonl ended a
  -- step before the checkpoint.
  it("SIGTERM to 2 pipelines asked at different steps: both stop after the same step, which every store holds", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local job, rd, log = dir .. "/stop2.lua", dir .. "/stop2", dir .. "/stop2.log"
    write(job, job_text(data, "replicas = 2, pipeline = { stages = 2, micro_batches = 2 }, max_steps = 100000, "
      .. "eval_interval = 0,"))
    local pid, rc = S.spawn_rc("env TRANSOM_TEST_STOP_LATE=1 TRANSOM_TEST_STEP_MS=" .. math.floor(S.T(5)) .. " "
      .. q(S.BIN) .. " run " .. q(job) .. " --set run_dir=" .. q(rd) .. " --set checkpoint.every_steps=100000 "
      .. "--set sample_tokens=0", log)
    local function lines() return #((S.read(rd .. "/metrics.jsonl") or ""):gsub("[^\n]", "")) end
    assert.truthy(S.wait_for(function() return lines() >= 10 or rc() end, 60) and not rc(), S.read(log))
    os.execute("kill -TERM " .. pid)
    S.wait_rc(rc, 60)
    local out = S.read(log)
    assert.are.equal(0, rc(), out)
    local at = tonumber(out:match("\nstopped at step (%d+) %(checkpointed%)"))
    assert.truthy(at and at >= 10, out)
    assert.are.equal(tostring(at), list(steps_of(rd .. "/ckpt-stage-0")), out)
    assert.are.equal(tostring(at), list(steps_of(rd .. "/ckpt-stage-1")), out)
    -- each pipeline's last step is the stop step, averaged over both
    for _, f in ipairs({ "metrics.jsonl", "pipeline-1-stage-0.jsonl" }) do
      local last
      for line in (S.read(rd .. "/" .. f) or ""):gmatch("[^\n]+") do
        if line:find('^{"step":') then last = line end
      end
      assert.truthy(last and last:find('^{"step":' .. at .. ','), f .. " ends at: " .. tostring(last))
      assert.truthy(last:find('"replicas":2', 1, true), f .. "'s last step: " .. last)
    end
  end)

  -- every file of a run directory but LMDB's lock files (readers write
  -- those), with its checksum: a refused resume must leave it all as it was
  local function files_of(rd)
    return S.sh("cd " .. q(rd) .. " && find . -type f ! -name lock.mdb | sort | xargs md5sum")
  end
  local function ckpt_run(name, extra, ...)
    local job, rd = dir .. "/" .. name .. ".lua", dir .. "/" .. name
    write(job, job_text(data, extra .. " eval_interval = 0,"))
    local code, out, err = S.transom(dir, "run", job, "--set", "run_dir=" .. rd, ...)
    assert.are.equal(0, code, out .. err)
    return rd, job
  end

  -- a pipelined run wrote no RUN/events.jsonl (checkpoint lines went to
  -- stdout only), though the run directory's table lists it: now the
  -- launcher writes the start and the end, each stage its checkpoints, in
  -- the operator's format (time, step, worker, kind, detail)
  it("writes RUN/events.jsonl: the start, each stage's checkpoints, the end", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local rd = ckpt_run("events", "pipeline = { stages = 2, micro_batches = 2 }, max_steps = 6,", "--set",
      "checkpoint.every_steps=3")
    local ev = S.events(rd)
    local function has(step, worker, kind)
      return ev:find('{"time":[%d.]+,"step":' .. step .. ',"worker":' .. (tostring(worker):gsub("%-", "%%-")) .. ',"kind":"' .. kind
        .. '","detail":"[^"\n]*"}\n')
    end
    assert.truthy(has(0, -1, "start"), ev)
    for _, step in ipairs({ 3, 6 }) do
      for k = 0, 1 do assert.truthy(has(step, k, "checkpoint"), "stage " .. k .. ", step " .. step .. ": " .. ev) end
    end
    assert.truthy(has(6, -1, "finished"), ev)
  end)

  -- the closing sample (sample_tokens, sample_prompt, temperature) was
  -- skipped without a word for a pipelined run: now it is made, as a lone
  -- run's, from the final weights stage 0 saved (what `transom sample` reads)
  it("ends with the closing sample, from the weights it saved", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local rd = dir .. "/sample"
    local job = dir .. "/sample.lua"
    write(job, job_text(data, "pipeline = { stages = 2, micro_batches = 2 }, max_steps = 4, eval_interval = 0,"))
    local code, out, err = S.transom(dir, "run", job, "--set", "run_dir=" .. rd, "--set", "sample_tokens=30", "--set",
      "temperature=0.8")
    assert.are.equal(0, code, out .. err)
    local text = out:match("\n%-%-%- sample %(30 tokens, temperature 0%.80%) %-%-%-\n(.*)run directory: ")
    assert.truthy(text and #text > 0, out)
    local scode, same, serr = S.transom(dir, "sample", rd, "--tokens", "30", "--temperature", "0.8")
    assert.are.equal(0, scode, serr)
    assert.are.equal(same, text)
  end)

  -- a resume that finds no step every stage committed because a stage's
  -- store holds none (the start was killed between the stages' first
  -- commits) starts over from step 0: what the other stores committed is
  -- of the run it abandons (kept in place it would be loaded later beside
  -- the new run's, or outlive its newer ones by retention) and is set
  -- aside whole, renamed, never deleted
  it("a resume where a stage's store holds no checkpoint sets the others aside and starts over", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local shape = "pipeline = { stages = 2, micro_batches = 4 }, max_steps = 6,"
    local rd, job = ckpt_run("zero", shape, "--set", "checkpoint.every_steps=3")
    assert.truthy(steps_of(rd .. "/ckpt-stage-0")[3] and steps_of(rd .. "/ckpt-stage-1")[3])
    -- an empty store, as a start killed before its first commit leaves it
    local ek, log = dir .. "/killed", dir .. "/killed.log"
    local pid, rc = S.spawn_rc("env TRANSOM_TEST_STEP_MS=" .. math.floor(S.T(3000)) .. " " .. q(S.BIN) .. " run " ..
      q(job) .. " --set run_dir=" .. q(ek) .. " --set checkpoint.every_steps=3", log)
    -- stage 1's store opened: `transom ckpt ls` reads it and lists nothing
    -- (a kill inside ckpt_open, after data.mdb and before the databases'
    -- commit, left a store the resume refused as unreadable; it holds no
    -- checkpoint now: test_ckpt and test_pipeline make that state by hand)
    local function opened()
      local code, out = S.transom(dir, "ckpt", "ls", ek .. "/ckpt-stage-1")
      return code == 0 and out:find("^%s*step") ~= nil and out:find("\n%s*%d") == nil
    end
    for _ = 1, S.N(400) do
      if opened() or rc() then break end
      S.sleep(0.05)
    end
    assert.truthy(opened() and not rc(), S.read(log))
    os.execute("kill -9 " .. pid) -- the launcher: its workers go with it
    local function workers() return (S.sh("pgrep -f -- " .. q("[s]tage --run " .. ek .. " ") .. " || true"):gsub("%s", "")) end
    for _ = 1, S.N(200) do
      if rc() and workers() == "" then break end
      S.sleep(0.05)
    end
    assert.are.equal("", workers())
    assert.is_nil(next(steps_of(ek .. "/ckpt-stage-1")), "the killed start committed")
    os.execute("rm -rf " .. q(rd .. "/ckpt-stage-1") .. " && cp -r " .. q(ek .. "/ckpt-stage-1") .. " " ..
      q(rd .. "/ckpt-stage-1"))
    local code, out, err = S.transom(dir, "run", "--resume", rd, "--set", "checkpoint.every_steps=4")
    assert.are.equal(0, code, out .. err)
    assert.truthy(out:find("starting from step 0", 1, true), out)
    local aside = out:match("set aside 2 checkpoint%(s%) of stage 0 %(steps 3, 6%): %S+ moved to (%S+);")
    assert.truthy(aside, out)
    local kept = steps_of(aside) -- nothing deleted: the abandoned run's steps are all there
    assert.truthy(kept[3] and kept[6], aside)
    assert.truthy(S.events(rd):find('"kind":"checkpoints_set_aside"', 1, true), S.events(rd))
    local s0, s1 = steps_of(rd .. "/ckpt-stage-0"), steps_of(rd .. "/ckpt-stage-1")
    assert.is_nil(s0[3], "step 3 of the abandoned run is still in stage 0's store")
    assert.truthy(s0[4] and s1[4] and s0[6] and s1[6], out)
  end)

  -- a resume that does not fit the run's stores is refused before anything
  -- of the run changes (job.lua with the --set values, the records, the
  -- stores): another number of stages (either way), stores out of step
  -- (each holds checkpoints, none a step of all), a stage's store missing,
  -- RUN/pipeline-plan missing
  it("refuses a resume whose stores do not fit, and changes nothing of the run", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local function refused(rd, want, ...)
      local before = files_of(rd)
      local code, out, err = S.transom(dir, "run", "--resume", rd, ...)
      assert.are.equal(1, code, out .. err)
      assert.truthy(err:find(want, 1, true), err)
      assert.is_nil(out:find("resumed from step", 1, true), out)
      assert.are.equal(before, files_of(rd))
    end
    local two = ckpt_run("fit2", "pipeline = { stages = 2, micro_batches = 4 }, max_steps = 6,", "--set",
      "checkpoint.every_steps=3")
    refused(two, "--set pipeline.stages=2", "--set", "pipeline.stages=3")
    -- 3 stages resumed as 2: stores 0 and 1 share step 6, but the plan and store 2 say 3 stages
    local three = ckpt_run("fit3", "pipeline = { stages = 3, micro_batches = 4 }, max_steps = 6,", "--set",
      "checkpoint.every_steps=3")
    refused(three, "checkpoints are of 3 stages", "--set", "pipeline.stages=2")
    -- out of step: stage 1's store from a run that committed 2, 4 (unless an engine was still busy) and 5
    local other = ckpt_run("fit2b", "pipeline = { stages = 2, micro_batches = 4 }, max_steps = 5,", "--set",
      "checkpoint.every_steps=2")
    os.execute("rm -rf " .. q(two .. "/ckpt-stage-1") .. " && cp -r " .. q(other .. "/ckpt-stage-1") .. " " ..
      q(two .. "/ckpt-stage-1"))
    refused(two, "stage stores out of step in " .. two .. ": stage 0 holds " .. list(steps_of(two .. "/ckpt-stage-0"),
      ", ") .. ", stage 1 holds " .. list(steps_of(two .. "/ckpt-stage-1"), ", ") .. " (no step")
    -- a stage's store missing, the plan missing
    os.execute("mv " .. q(two .. "/ckpt-stage-1") .. " " .. q(dir .. "/fit2-stage-1"))
    refused(two, two .. "/ckpt-stage-1 is missing")
    os.execute("mv " .. q(other .. "/pipeline-plan") .. " " .. q(dir .. "/fit2b-plan"))
    refused(other, other .. "/pipeline-plan is missing")
  end)

  it("runs its workers on test hosts (network namespaces), and the probes measure a tc-limited link", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local TH = S.ROOT .. "/spec/hosts/testhosts.sh"
    local probe, prc = S.sh(TH .. " probe")
    if prc ~= 0 then return pending("no network namespaces here: " .. probe) end
    local name = "tp" .. (tonumber(S.sh("echo $$"):match("%d+")) % 100000)
    local out, rc = S.sh(TH .. " up " .. name .. " 2 10.79.0")
    assert.are.equal(0, rc, out)
    local ok, err = pcall(function()
      S.sh(TH .. " slow " .. name .. " 2 10mbit")
      local job = dir .. "/ns.lua"
      write(job, job_text(data, string.format("pipeline = { stages = 2, micro_batches = 2, workers = { "
        .. "{ netns = %q, address = '10.79.0.1' }, { netns = %q, address = '10.79.0.2' } } }, max_steps = 6,",
        name .. "-h1", name .. "-h2")))
      local code, o, e = S.transom(dir, "run", job, "--set", "run_dir=" .. dir .. "/ns")
      assert.are.equal(0, code, o .. e)
      local mbit = tonumber(o:match("0%->1%s+([%d%.]+)"))
      assert.truthy(mbit and mbit > 5 and mbit < 15, "the probe measures the 10 Mbit link: " .. o)
      assert.truthy(S.read(dir .. "/ns/metrics.jsonl"):find('"step":6,'), "it trained")
      -- a worker in a namespace that does not exist: a clear error
      write(job, job_text(data, "pipeline = { stages = 2, workers = { { netns = 'nope0', address = '10.79.0.1' }, {} } },"))
      code, o, e = S.transom(dir, "run", job, "--set", "run_dir=" .. dir .. "/ns2")
      assert.are_not.equal(0, code)
      assert.truthy((o .. e):find("network namespace 'nope0'", 1, true), o .. e)
      write(job, job_text(data, "pipeline = { stages = 2, workers = { { netns = 'h1' }, {} } },"))
      code, _, e = S.transom(dir, "run", job)
      assert.are.equal(2, code)
      assert.truthy(e:find('ns%.lua.*pipeline%.workers%[1%] runs in netns "h1": give its address there'), e)
    end)
    S.sh(TH .. " down " .. name)
    assert(ok, err)
  end)

  -- The launcher writes GO and the plan to each worker's control socket: a
  -- worker gone before that was a SIGPIPE that killed the launcher (status
  -- 141, no message; mid-run, the live workers left without a launcher).
  it("a worker killed before the plan ends the run naming it, the launcher not killed by SIGPIPE", function()
    if not data then return pending("no ../shared/data/tinyshakespeare.txt") end
    local job = dir .. "/earlykill.lua"
    write(job, job_text(data, "replicas = 2, pipeline = { stages = 2, micro_batches = 2 },"))
    local rd, log = dir .. "/earlykill", dir .. "/earlykill.log"
    local _, rc = S.spawn_rc(q(S.BIN) .. " run " .. q(job) .. " --set run_dir=" .. q(rd), log)
    local w3 = ""
    for _ = 1, S.N(600) do -- the last worker, killed as soon as it is there (it probes last)
      w3 = S.sh("pgrep -f -- " .. q("[s]tage --run " .. rd .. " --worker 3 ") .. " || true")
      if w3:match("%d") or rc() then break end
      S.sleep(0.01)
    end
    os.execute("kill -" .. (sig or "KILL") .. " " .. assert(tonumber(w3:match("(%d+)")), w3))
    for _ = 1, S.N(1200) do
      if rc() then break end
      S.sleep(0.05)
    end
    local out = S.read(log)
    assert.are_not.equal(141, rc(), out)
    -- before the plan: an error naming the worker; after it (a slow kill): the pipeline was lost
    assert.truthy(rc() == 1 and out:find("worker 3") or out:find("pipeline 1 lost", 1, true), out)
    local left = S.sh("pgrep -f -- " .. q("[s]tage --run " .. rd .. " ") .. " || true")
    assert.are.equal("", (left:gsub("%s", "")), "no stage outlives the run")
  end)
end)
