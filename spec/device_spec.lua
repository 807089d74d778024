-- device_spec.lua — the job's `device` field end to end: the emu backend
-- (core's kernels behind the device boundary: device slabs, host mirrors,
-- uploads, the optimizer and clipping through the backend table, level-1
-- checkpoint copies through the backend) trains bit for bit like cpu; a
-- checkpoint taken on one device resumes on the other; device = "cuda"
-- trains where a GPU is visible and is a clear error where none is.
-- Runs inside the transom binary (`transom test spec`); spawns $TRANSOM_BIN.

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local BIN, ROOT, CORPUS = S.BIN, S.ROOT, S.CORPUS
local sh, read = S.sh, S.read

local tmp = S.tmpdir()
local data = S.corpus_copy(tmp, 200000)
local have_corpus = data ~= nil

-- a GPU is visible to this process: the cuda cases train instead of failing
local gpu = select(2, sh("nvidia-smi -L >/dev/null 2>&1")) == 0
local ngpus = gpu and tonumber((sh("nvidia-smi -L | grep -c '^GPU'")):match("%d+")) or 0

local function args(run, device, extra)
  return table.concat({
    BIN, "run", ROOT .. "/examples/shakespeare.lua", "--set data=" .. data, "--set run_dir=" .. run,
    "--set device=" .. device,
    "--set n_layer=2 --set n_head=2 --set n_embd=64 --set block_size=32 --set batch_size=8",
    "--set threads=1 --set eval_interval=0 --set eval_steps=2 --set sample_tokens=0 --set log_interval=50",
    extra or "" }, " ")
end

local losses = S.losses

describe("device", function()
  it("emu trains bit for bit like cpu: losses, weights and checkpoints", function()
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    local a, b = tmp .. "/cpu", tmp .. "/emu"
    local out, rc = sh(args(a, "cpu", "--set max_steps=40 --set checkpoint.every_steps=20"))
    assert.equals(0, rc, out)
    out, rc = sh(args(b, "emu", "--set max_steps=40 --set checkpoint.every_steps=20"))
    assert.equals(0, rc, out)
    assert.matches("device emu:", out)
    local la, lb = losses(a), losses(b)
    assert.equals(40, #la)
    assert.same(la, lb)
    assert.equals(read(a .. "/model.safetensors"), read(b .. "/model.safetensors"))
    -- the checkpoint copied through the backend holds the same bytes
    local ea = sh(BIN .. " ckpt export " .. a .. " --step 40 -o " .. tmp .. "/ea.safetensors")
    local eb = sh(BIN .. " ckpt export " .. b .. " --step 40 -o " .. tmp .. "/eb.safetensors")
    assert.is_truthy(read(tmp .. "/ea.safetensors"), ea)
    assert.equals(read(tmp .. "/ea.safetensors"), read(tmp .. "/eb.safetensors"), eb)
  end)

  it("a checkpoint taken on one device resumes on the other, bit for bit", function()
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    local ref = tmp .. "/ref"
    local out, rc = sh(args(ref, "cpu", "--set max_steps=60 --set checkpoint.every_steps=30"))
    assert.equals(0, rc, out)
    for _, pair in ipairs({ { "emu", "cpu" }, { "cpu", "emu" } }) do
      local run = tmp .. "/" .. pair[1] .. "_to_" .. pair[2]
      -- train to step 30 on one device (its last state is always checkpointed),
      -- then resume the same run on the other device to step 60. (kill -9
      -- then --resume is ckpt_spec's; killing here raced the nice-19 writer.)
      out, rc = sh(args(run, pair[1], "--set max_steps=30 --set checkpoint.every_steps=30 --set checkpoint.keep_last=1"))
      assert.equals(0, rc, out)
      out, rc = sh(BIN .. " run --resume " .. run .. " --set device=" .. pair[2] .. " --set max_steps=60")
      assert.equals(0, rc, out)
      assert.matches("resumed from step 30", out)
      if pair[2] == "emu" then assert.matches("device emu:", out, 1, true)
      else assert.not_matches("device emu:", out, 1, true) end
      assert.equals(read(ref .. "/model.safetensors"), read(run .. "/model.safetensors"),
        pair[1] .. " -> " .. pair[2] .. ": the resumed run's weights differ from the uninterrupted run's")
    end
  end)

  it("device = cuda: trains on a GPU, or says why not and writes nothing", function()
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    local run = tmp .. "/cuda"
    local out, rc = sh(args(run, "cuda", "--set max_steps=10"))
    if gpu then
      assert.equals(0, rc, out)
      assert.matches("device cuda:", out)
      assert.equals(10, #losses(run))
      -- 50 steps follow the CPU's loss curve (fp32 both; sums in other orders)
      local c, g = tmp .. "/curve_cpu", tmp .. "/curve_cuda"
      assert.equals(0, select(2, sh(args(c, "cpu", "--set max_steps=50"))))
      assert.equals(0, select(2, sh(args(g, "cuda", "--set max_steps=50"))))
      local lc, lg = losses(c), losses(g)
      assert.equals(50, #lg)
      for i = 1, 50 do
        local a, b = tonumber(lc[i]:match("=(.*)")), tonumber(lg[i]:match("=(.*)"))
        assert.is_true(math.abs(a - b) <= 2e-3 + 2e-3 * math.abs(a), "step " .. i .. ": cpu " .. a .. " cuda " .. b)
      end
      -- a GPU checkpoint resumes on the CPU, and a CPU checkpoint on the GPU
      for _, pair in ipairs({ { "cuda", "cpu" }, { "cpu", "cuda" } }) do
        local r = tmp .. "/x_" .. pair[1] .. "_" .. pair[2]
        assert.equals(0, select(2, sh(args(r, pair[1], "--set max_steps=20 --set checkpoint.every_steps=20"))))
        local o, rc2 = sh(BIN .. " run --resume " .. r .. " --set device=" .. pair[2] .. " --set max_steps=40")
        assert.equals(0, rc2, o)
        assert.matches("resumed from step 20", o)
        local l = losses(r)
        assert.equals(40, #l)
        local ref = tonumber(lc[40]:match("=(.*)"))
        local got = tonumber(l[40]:match("=(.*)"))
        assert.is_true(math.abs(ref - got) <= 5e-3 + 5e-3 * ref, pair[1] .. " -> " .. pair[2] .. ": " .. got .. " vs " .. ref)
      end
      return
    end
    assert.equals(2, rc, out)
    assert.matches("--set device=cuda: key 'device': device = \"cuda\": ", out, 1, true) -- where the key came from
    assert.is_truthy(out:find("built without the CUDA backend", 1, true) or out:find("no CUDA device", 1, true)
      or out:find("CUDA driver", 1, true), out)
    assert.is_false(S.exists(run), "a run directory was written for a job that cannot start")
    -- the operator checks it too, before starting any replica
    out, rc = sh(args(run, "cuda", "--set max_steps=10 --set replicas=2"))
    assert.equals(2, rc, out)
    assert.matches("key 'device'", out, 1, true)
    assert.is_false(S.exists(run))
  end)

  it("cuda with a GPU: bf16 follows the CPU's bf16, and 2 replicas reduce through NCCL", function()
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    if not gpu then pending("no GPU visible: runs where one is") return end
    local c, g = tmp .. "/b16_cpu", tmp .. "/b16_cuda"
    assert.equals(0, select(2, sh(args(c, "cpu", "--set max_steps=30 --set precision=bf16"))))
    local out, rc = sh(args(g, "cuda", "--set max_steps=30 --set precision=bf16"))
    assert.equals(0, rc, out)
    local lc, lg = losses(c), losses(g)
    assert.equals(30, #lg)
    for i = 1, 30 do
      local a, b = tonumber(lc[i]:match("=(.*)")), tonumber(lg[i]:match("=(.*)"))
      -- bf16 on both; the GPU's tensor-core matmuls round once more (test_cuda's B16_GPUROUND)
      assert.is_true(math.abs(a - b) <= 3e-2 + 1e-2 * math.abs(a), "step " .. i .. ": cpu " .. a .. " cuda " .. b)
    end
    if ngpus < 2 then pending("one GPU: 2 replicas need 2 (one each)") return end
    local r = tmp .. "/cuda2"
    out, rc = sh("timeout 300 " .. args(r, "cuda", "--set max_steps=20 --set replicas=2"))
    assert.equals(0, rc, out)
    assert.matches("2 replicas finished with parameter crc32c %x+", out)
    assert.matches('"replicas":2,', read(r .. "/metrics.jsonl") or "", 1, true)
  end)

  it("one device per replica: more replicas than devices, or a slot past them, is refused at start", function()
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    -- emu with TRANSOM_EMU_DEVICES=N has N devices, as a host has N GPUs
    local run = tmp .. "/toomany"
    local out, rc = sh("TRANSOM_EMU_DEVICES=1 " .. args(run, "emu", "--set max_steps=5 --set replicas=2"))
    assert.equals(2, rc, out)
    assert.matches("key 'replicas': 2 replicas need a device each, but 1 emu device(s) are visible on this host",
      out, 1, true)
    assert.is_false(S.exists(run), "a run directory was written for a job that cannot start")
    -- a process on a slot past the devices (an outside launcher's LOCAL_RANK) is refused before it computes
    out, rc = sh("TRANSOM_EMU_DEVICES=1 TRANSOM_LOCAL_RANK=1 " .. args(run, "emu", "--set max_steps=5"))
    assert.equals(2, rc, out)
    assert.matches("replica slot 1 has no device of its own: 1 emulated device(s) are visible", out, 1, true)
    assert.is_false(S.exists(run))
    -- as many replicas as devices train
    out, rc = sh("timeout 120 env TRANSOM_EMU_DEVICES=2 " .. args(run, "emu", "--set max_steps=10 --set replicas=2"))
    assert.equals(0, rc, out)
    assert.matches("2 replicas finished with parameter crc32c %x+", out)
  end)

  it("precision = bf16 follows the fp32 loss curve with half the activation memory; emu = cpu bit for bit", function()
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    local runs, outs = {}, {}
    for _, v in ipairs({ { "cpu", "fp32" }, { "cpu", "bf16" }, { "emu", "bf16" } }) do
      local run = tmp .. "/p_" .. v[1] .. "_" .. v[2]
      local out, rc = sh(args(run, v[1], "--set max_steps=60 --set eval_interval=60 --set precision=" .. v[2]))
      assert.equals(0, rc, out)
      runs[#runs + 1], outs[#outs + 1] = losses(run), out
    end
    local f32, b16, e16 = runs[1], runs[2], runs[3]
    assert.equals(60, #b16)
    assert.same(b16, e16) -- the device path changes nothing but where the bytes live
    local worst = 0
    for i = 1, 60 do
      local a, b = tonumber(f32[i]:match("=(.*)")), tonumber(b16[i]:match("=(.*)"))
      worst = math.max(worst, math.abs(a - b))
    end
    -- bf16 keeps 8 significant bits: a loss near 3 moves by ~1e-2 at most
    assert.is_true(worst < 2e-2, "bf16 strays from fp32 by " .. worst)
    assert.is_true(worst > 0, "bf16 gave fp32's exact losses: the bf16 kernels did not run")
    local p32 = tonumber(outs[1]:match("planned ([%d.]+) MiB"))
    local p16 = tonumber(outs[2]:match("planned ([%d.]+) MiB"))
    assert.is_true(p16 < p32, outs[2])
  end)

  it("an unknown device names the key and the choices", function()
    local out, rc = sh(args(tmp .. "/bad", "gpu"))
    assert.equals(2, rc, out)
    assert.matches("key 'device' must be one of cpu, cuda, emu", out, 1, true)
  end)

  it("on emu a replica killed by chaos is replaced: survivors go on through the device communicator", function()
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    local run, jobfile = tmp .. "/emu_kill", tmp .. "/emu_kill.lua"
    S.write(jobfile, 'return { data = "' .. data .. '", chaos = { { at_step = 40, replica = 1, fault = "kill" } } }\n')
    local cmd = args(run, "emu", "--set max_steps=120 --set replicas=3 --set deadline=2 --set log_interval=20"
      .. " --set checkpoint.every_steps=20"):gsub(ROOT .. "/examples/shakespeare.lua", jobfile, 1)
    local out, rc = sh("timeout 300 " .. cmd)
    assert.equals(0, rc, out)
    assert.matches("replica_failed: replica 1 killed %(signal 9%)", out)
    assert.matches("replica 1 catches up from replica", out)
    assert.matches("3 replicas finished with parameter crc32c %x+ %(step 120%)", out)
    -- every step was trained once by the group: the survivors never stopped
    local steps = {}
    for line in (read(run .. "/metrics.jsonl") or ""):gmatch("[^\n]+") do
      local st, w = line:match('^{"step":(%d+),"worker":(%d+),')
      if st and w == "0" then steps[#steps + 1] = tonumber(st) end
    end
    assert.equals(120, #steps)
    for i, st in ipairs(steps) do assert.equals(i, st) end
  end)

  -- step records of worker w: {loss, comm_s, allreduce_s} per step
  local function comm_records(run, w)
    local by = {}
    for line in (read(run .. "/metrics.jsonl") or ""):gmatch("[^\n]+") do
      local st, wk = line:match('^{"step":(%d+),"worker":(%d+),')
      if st and tonumber(wk) == w then
        by[#by + 1] = { step = tonumber(st), loss = line:match('"loss":([^,}]+)'),
                        comm = tonumber(line:match('"comm_s":([%d%.eE%-]+)')),
                        exposed = tonumber(line:match('"allreduce_s":([%d%.eE%-]+)')) }
      end
    end
    return by
  end

  it("on emu, gradient buckets are reduced through the device communicator while backward runs: the bits of one all-reduce after backward", function()
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    local recs, crcs = {}, {}
    for _, b in ipairs({ "0", "0.02" }) do
      local run = tmp .. "/emu_bucket" .. b
      local out, rc = sh("timeout 180 " .. args(run, "emu", "--set max_steps=30 --set replicas=2 --set bucket_mb=" .. b))
      assert.equals(0, rc, out)
      crcs[b] = out:match("2 replicas finished with parameter crc32c (%x+)")
      assert.is_truthy(crcs[b], out)
      recs[b] = comm_records(run, 0)
      assert.equals(30, #recs[b])
    end
    assert.equals(crcs["0"], crcs["0.02"])
    local overlapped = 0
    for i = 1, 30 do
      local a, b = recs["0"][i], recs["0.02"][i]
      assert.equals(a.loss, b.loss, "step " .. i)
      -- after backward: the collective ran exactly while the step waited
      assert.equals(a.comm, a.exposed, "step " .. i)
      -- overlapped: it ran at least while the step waited, and started
      -- during backward (comm_s is the communication thread's time)
      assert.is_true(b.exposed <= b.comm + 1e-6, string.format("step %d: exposed %g > comm %g", i, b.exposed, b.comm))
      if b.comm > b.exposed + 1e-6 then overlapped = overlapped + 1 end
    end
    assert.is_true(overlapped >= 10, "only " .. overlapped .. " of 30 steps had communication before the wait")
  end)

  it("replicas on emu agree bit for bit", function()
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    local run = tmp .. "/emu2"
    local out, rc = sh("timeout 120 " .. args(run, "emu", "--set max_steps=20 --set replicas=2"))
    assert.equals(0, rc, out)
    assert.matches("2 replicas finished with parameter crc32c %x+", out)
  end)
end)
