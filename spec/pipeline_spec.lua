-- pipeline_spec.lua — pipeline stages (FusionLLM, issue 14) through the CLI:
-- a job cut into 2 and 3 stage processes (1F1B, activations forward and
-- gradients back over loopback) ends with the same parameters, bit for bit,
-- as one process accumulating the same micro-batches (pipeline.stages = 1),
-- with the tied embedding/head, gradient clipping and evaluation on; bad
-- pipeline keys name the file, line and key; a stage killed with -9 ends
-- the run with an error naming it, and no stage outlives it. About 5 s on
-- 2 cores.

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
    write(job, job_text(data, "pipeline = { stages = 2 }, replicas = 2,"))
    code, _, err = S.transom(dir, "run", job)
    assert.are.equal(2, code)
    assert.truthy(err:find("bad%.lua:%d+:.*pipelines x replicas"), err)
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
    local stage1 = S.sh("pgrep -f -- " .. q("[s]tage --run " .. rd .. " --stage 1 "))
    local spid = assert(tonumber(stage1:match("(%d+)")), stage1)
    os.execute("kill -9 " .. spid)
    for _ = 1, S.N(600) do
      if rc() then break end
      S.sleep(0.05)
    end
    assert.are.equal(1, rc(), S.read(dir .. "/kill.log"))
    local log = S.read(dir .. "/kill.log")
    assert.truthy(log:find("pipeline stage 1 was killed by signal 9"), log)
    local left = S.sh("pgrep -f -- " .. q("[s]tage --run " .. rd .. " ") .. " || true")
    assert.are.equal("", (left:gsub("%s", "")))
  end)
end)
