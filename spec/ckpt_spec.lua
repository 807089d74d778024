-- ckpt_spec.lua — checkpoints through the CLI, with real faults: kill -9 and
-- resume (bit-identical losses), SIGTERM and resume, bytes flipped inside a
-- stored checkpoint, a full store (LMDB map limit and a real 3 MB tmpfs), an
-- unwritable run directory, the remote level (local store deleted, then
-- damaged: resume from the remote; an unwritable remote), and the
-- safetensors export read back by Python.
-- Runs inside the transom binary (`transom test spec`); spawns $TRANSOM_BIN.

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local BIN, ROOT, CORPUS = S.BIN, S.ROOT, S.CORPUS
local sh, sleep, read, write = S.sh, S.sleep, S.read, S.write

local losses = S.losses

local function count_lines(path)
  local n = 0
  for _ in (read(path) or ""):gmatch("[^\n]+") do n = n + 1 end
  return n
end

local tmp = S.tmpdir()
local data = S.corpus_copy(tmp, 200000)
local have_corpus = data ~= nil

-- a small GPT: 1.2 MiB of state per checkpoint, a few ms per step
local function args(run, extra)
  return table.concat({
    BIN, "run", ROOT .. "/examples/shakespeare.lua", "--set data=" .. data, "--set run_dir=" .. run,
    "--set n_layer=2 --set n_head=2 --set n_embd=64 --set block_size=32 --set batch_size=8",
    "--set threads=1 --set eval_interval=0 --set eval_steps=2 --set sample_tokens=0 --set log_interval=50",
    extra or "" }, " ")
end

-- starts a run in the background; returns its pid
local function spawn(cmd, log) return S.spawn(cmd, log) end

-- waits (bounded) until the run's metrics have at least n lines
local function wait_metrics(run, n)
  for _ = 1, 300 do
    if count_lines(run .. "/metrics.jsonl") >= n then return true end
    sleep(0.05)
  end
  return false
end

describe("checkpoints", function()
  after_each(function() S.cleanup() end) -- a failed test leaves no process behind
  it("resume after kill -9 gives the same loss sequence as an uninterrupted run", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: checkpoint spec skipped") end
    local a, b = tmp .. "/plain", tmp .. "/killed"
    local opts = "--set max_steps=300 --set checkpoint.every_steps=10"
    local _, rc = sh(args(a, opts))
    assert.equal(0, rc)
    local pid = spawn(args(b, opts), tmp .. "/killed.log")
    assert.is_true(wait_metrics(b, 120), "the run never got to step 120")
    sh("kill -9 " .. pid)
    sleep(0.2)
    local killed_at = #losses(b)
    assert.is_true(killed_at < 300, "killed too late to test anything")
    local out, rc2 = sh(BIN .. " run --resume " .. b)
    assert.equal(0, rc2, out)
    local resumed = tonumber(out:match("resumed from step (%d+)"))
    assert.is_truthy(resumed, out)
    -- a multiple of 10, or a later step if that snapshot was deferred (the
    -- writer busy or pacing: ckpt.h) and taken at the next free boundary
    assert.is_true(resumed >= 10 and resumed <= killed_at)
    assert.same(losses(a), losses(b))
    assert.equal(300, #losses(b))
    assert.matches('"kind":"resume"', read(b .. "/events.jsonl"))
  end)

  it("SIGTERM checkpoints and exits 0; --resume finishes at the same step", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: checkpoint spec skipped") end
    local a, b = tmp .. "/plain2", tmp .. "/termed"
    local opts = "--set max_steps=250 --set checkpoint.every_steps=100"
    sh(args(a, opts))
    local pid = spawn(args(b, opts), tmp .. "/termed.log")
    assert.is_true(wait_metrics(b, 60))
    sh("kill -TERM " .. pid)
    local status
    for _ = 1, 100 do
      local out = sh("kill -0 " .. pid .. " 2>/dev/null && echo alive || echo gone")
      if out:match("gone") then status = "gone" break end
      sleep(0.05)
    end
    assert.equal("gone", status)
    local log = read(tmp .. "/termed.log")
    local stopped = tonumber(log:match("stopped at step (%d+)"))
    assert.is_truthy(stopped, log)
    assert.is_true(stopped < 250)
    -- the stop was checkpointed even though it is not a multiple of every_steps
    local ls = sh(BIN .. " ckpt ls " .. b)
    assert.matches("\n%s*" .. stopped .. "%s", ls)
    local out, rc = sh(BIN .. " run --resume " .. b)
    assert.equal(0, rc, out)
    assert.matches("resumed from step " .. stopped, out)
    assert.same(losses(a), losses(b))
  end)

  it("verify names a tensor whose stored bytes were flipped; resume falls back", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: checkpoint spec skipped") end
    local run = tmp .. "/flipped"
    -- steps 20 and 30 are each a run's last state, so both are committed
    -- whatever the load (a mid-run snapshot may coalesce with the next one)
    local _, rc = sh(args(run, "--set max_steps=20 --set checkpoint.every_steps=10"))
    assert.equal(0, rc)
    _, rc = sh(BIN .. " run --resume " .. run .. " --set max_steps=30")
    assert.equal(0, rc)
    local out, vrc = sh(BIN .. " ckpt verify " .. run)
    assert.equal(0, vrc, out)
    assert.matches("step 30: ok", out)
    -- find a parameter's bytes of step 30 inside the LMDB file and flip one
    local why = S.flip_tensor_byte(run, run .. "/ckpt/data.mdb", 30, "transformer%.h%.1%.mlp%.c_fc%.weight",
      tmp .. "/step30.safetensors")
    assert.is_nil(why, why)
    out, vrc = sh(BIN .. " ckpt verify " .. run)
    assert.equal(1, vrc, out)
    assert.matches("step 30: CORRUPT: step 30: tensor 'param/transformer.h.1.mlp.c_fc.weight' fails its checksum", out,
      1, true)
    assert.matches("step 20: ok", out)
    out, rc = sh(BIN .. " run --resume " .. run .. " --set max_steps=40")
    assert.equal(0, rc, out)
    assert.matches("skipped step 30", out)
    assert.matches("resumed from step 20", out)
  end)

  it("ckpt verify --step checks that step only; a flag a verb does not take is refused, naming it", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: checkpoint spec skipped") end
    local run = tmp .. "/flags"
    local out, rc = sh(args(run, "--set max_steps=20 --set checkpoint.every_steps=10"))
    assert.equal(0, rc, out)
    out, rc = sh(BIN .. " ckpt verify " .. run .. " --step 20")
    assert.equal(0, rc, out)
    assert.matches("step 20: ok", out)
    assert.not_matches("step 10", out)
    out, rc = sh(BIN .. " ckpt verify " .. run .. " --step 15 2>&1")
    assert.equal(1, rc, out)
    assert.matches("no checkpoint at that step", out)
    out, rc = sh(BIN .. " ckpt ls " .. run .. " -o " .. tmp .. "/flags.out 2>&1")
    assert.equal(2, rc, out)
    assert.matches("transom ckpt ls: -o is for export only", out, 1, true)
    out, rc = sh(BIN .. " ckpt verify " .. run .. " -o " .. tmp .. "/flags.out 2>&1")
    assert.equal(2, rc, out)
    assert.matches("transom ckpt verify: -o is for export only", out, 1, true)
    assert.is_nil(read(tmp .. "/flags.out"))
    out, rc = sh(BIN .. " ckpt ls " .. run .. " --step 20 2>&1")
    assert.equal(2, rc, out)
    assert.matches("transom ckpt ls: --step is for verify and export", out, 1, true)
    out, rc = sh(BIN .. " ckpt verify " .. run .. " --step 2>&1")
    assert.equal(2, rc, out)
    assert.matches("--step needs a value", out, 1, true)
    out, rc = sh(BIN .. " ckpt ls " .. run)
    assert.equal(0, rc, out)
    assert.matches("\n%s*20%s", out)
  end)

  it("a full store (LMDB map size) fails commits cleanly while training goes on", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: checkpoint spec skipped") end
    local run = tmp .. "/mapfull"
    -- 2 MiB hold one 1.2 MiB checkpoint, not two: the first snapshot and the
    -- last are always taken (others may be deferred: the writer's pace), so
    -- the store fills however fast the disk is
    local out, rc = sh(args(run, "--set max_steps=60 --set checkpoint.every_steps=10 --set checkpoint.keep_last=10"
      .. " --set checkpoint.map_mb=2"))
    assert.equal(0, rc, out)
    assert.matches("step 60/60", out)
    local ev = read(run .. "/events.jsonl")
    assert.matches('"kind":"checkpoint_failed"', ev)
    assert.matches("full", ev)
    assert.matches('"kind":"checkpoint"', ev) -- some fitted
    local v, vrc = sh(BIN .. " ckpt verify " .. run)
    assert.equal(0, vrc, v)
    assert.matches("step 10: ok", v)
  end)

  it("a full disk (3 MB tmpfs) fails commits cleanly while training goes on", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: checkpoint spec skipped") end
    local mnt = tmp .. "/small"
    os.execute("mkdir -p " .. mnt)
    -- 3 MB: the run's files and one 1.2 MiB checkpoint, not two (the first
    -- and the last snapshot are always taken; see the map-size case)
    local _, mrc = sh("mount -t tmpfs -o size=3m tmpfs " .. mnt)
    if mrc ~= 0 then
      pending("cannot mount a tmpfs here (needs root): the LMDB map-size case above covers a full store")
      return
    end
    finally(function() sh("umount " .. mnt) end)
    local run = mnt .. "/run"
    local out, rc = sh(args(run, "--set max_steps=60 --set checkpoint.every_steps=10 --set checkpoint.keep_last=10"))
    assert.matches("step 60/60 | val loss", out, 1, true) -- trained to the end
    assert.matches("free on the device", out)           -- the failure says why
    -- the final weights may not fit either: then the exit status says so
    if rc ~= 0 then assert.matches("saving weights", out) end
    local ev = read(run .. "/events.jsonl")
    assert.matches('"kind":"checkpoint_failed"', ev)
    assert.matches('"kind":"checkpoint"', ev)
    local v = sh(BIN .. " ckpt verify " .. run)
    assert.matches("step 10: ok", v)
    assert.not_matches("CORRUPT", v)
  end)

  it("the remote level: with the local store deleted, --resume continues from the remote copy", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: checkpoint spec skipped") end
    local a, b, remote = tmp .. "/remote-plain", tmp .. "/remote-run", tmp .. "/remote-store"
    local opts = "--set checkpoint.every_steps=10 --set checkpoint.remote=" .. remote
    local out, rc = sh(args(a, "--set max_steps=60 --set checkpoint.every_steps=10"))
    assert.equal(0, rc, out)
    out, rc = sh(args(b, "--set max_steps=40 " .. opts))
    assert.equal(0, rc, out)
    assert.matches('"kind":"checkpoint_remote"', read(b .. "/events.jsonl"))
    local ls = sh(BIN .. " ckpt ls " .. remote) -- the remote store reads on its own
    assert.matches("\n%s*40%s", ls)
    assert.equal(0, select(2, sh("rm -rf " .. b .. "/ckpt"))) -- the local disk is lost
    out, rc = sh(BIN .. " run --resume " .. b .. " --set max_steps=60")
    assert.equal(0, rc, out)
    assert.matches("resumed from step 40", out)
    assert.same(losses(a), losses(b)) -- as if nothing had happened

    -- the local store damaged (its first pages overwritten: LMDB refuses it)
    local f = io.open(b .. "/ckpt/data.mdb", "r+b")
    f:write(string.rep("\xff", 16384))
    f:close()
    out, rc = sh(BIN .. " run --resume " .. b .. " --set max_steps=60")
    assert.equal(0, rc, out)
    assert.matches("is damaged", out, 1, true)
    assert.matches("resumed from step 60", out, 1, true)
    assert.matches("damaged%-%d+", sh("ls " .. b)) -- moved aside, not deleted

    -- an unwritable remote stops the run before training, naming the key
    out, rc = sh(args(tmp .. "/remote-bad", "--set max_steps=5 --set checkpoint.remote=/proc/transom-no-such/x"))
    assert.is_not.equal(0, rc)
    assert.matches("checkpoint.remote", out, 1, true)
    assert.matches("/proc/transom-no-such/x", out, 1, true)
    assert.not_matches("step%s+1/", out)
  end)

  it("the remote level: a rollback asked of the operator finds its target there when the local store is gone", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: checkpoint spec skipped") end
    local run, remote = tmp .. "/remote-rollback", tmp .. "/remote-rollback-store"
    local _, rc_of = S.spawn_rc("env TRANSOM_TEST_STEP_MS=40 " .. args(run, "--replicas 2 --set max_steps=400 " ..
      "--set checkpoint.every_steps=10 --set checkpoint.remote=" .. remote .. " --set deadline=" .. S.T(2)),
      run .. ".out")
    local listed
    for _ = 1, S.N(600) do -- the remote level holds a checkpoint
      listed = sh(BIN .. " ckpt ls " .. remote .. " 2>/dev/null"):match("\n%s*(%d+)%s")
      if listed then break end
      sleep(0.05)
    end
    assert(listed, "no remote checkpoint: " .. (read(run .. ".out") or ""))
    -- the local disk is lost while the job runs (the workers keep the store they opened)
    assert.equal(0, select(2, sh("mv " .. run .. "/ckpt " .. run .. "/ckpt.lost")))
    local out, rc = sh(BIN .. " attach " .. run .. " -e 'rollback()' 2>&1")
    assert.equal(0, rc, out)
    local target = tonumber(out:match("(%d+)"))
    assert(target and target >= tonumber(listed), out)
    for _ = 1, S.N(1200) do
      if rc_of() then break end
      sleep(0.1)
    end
    assert.equal(0, rc_of(), read(run .. ".out"))
    local ev = read(run .. "/events.jsonl")
    assert.matches('"kind":"rollback"[^\n]*at or before step ' .. target, ev)
  end)

  it("an unwritable run directory is a clear error before training", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: checkpoint spec skipped") end
    local file = tmp .. "/plain-file"
    io.open(file, "w"):close()
    local out, rc = sh(args(file .. "/run", "--set max_steps=5"))
    assert.equal(2, rc, out)
    assert.matches("plain%-file", out)
    assert.not_matches("step%s+1/", out)
  end)

  it("exports safetensors that Python's safetensors package reads back equal", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: checkpoint spec skipped") end
    local py = os.getenv("TRANSOM_PYTHON") or (ROOT .. "/build/pyvenv/bin/python")
    local _, prc = sh(py .. " -c 'import safetensors, numpy'")
    if prc ~= 0 then
      if os.getenv("TRANSOM_REQUIRE_PYTHON") then error("no Python with safetensors at " .. py) end
      pending("no Python with safetensors+numpy (./test.sh makes build/pyvenv)")
      return
    end
    local run = tmp .. "/export"
    local _, rc = sh(args(run, "--set max_steps=20 --set checkpoint.every_steps=10"))
    assert.equal(0, rc)
    local st = tmp .. "/exported.safetensors"
    local out, erc = sh(BIN .. " ckpt export " .. run .. " -o " .. st)
    assert.equal(0, erc, out)
    assert.matches("exported step 20: 28 tensors", out)
    -- the final weights (model.safetensors, written by the trainer at step 20)
    -- and the checkpoint export must hold the same tensors, bit for bit
    local script = [[
import sys
import numpy as np
from safetensors.numpy import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
assert sorted(a) == sorted(b), (sorted(a), sorted(b))
for k in a:
    assert a[k].dtype == np.float32 and a[k].shape == b[k].shape, k
    assert np.array_equal(a[k], b[k]), k
assert a["transformer.wte.weight"].shape == (int(sys.argv[3]), 64)
print("compared", len(a), "tensors")
]]
    local f = io.open(tmp .. "/cmp.py", "w")
    f:write(script)
    f:close()
    local vocab = 0
    for _ in read(run .. "/vocab.json"):match("%[(.*)%]"):gmatch("%d+") do vocab = vocab + 1 end
    local pout, pyrc = sh(py .. " " .. tmp .. "/cmp.py " .. st .. " " .. run .. "/model.safetensors " .. vocab)
    assert.equal(0, pyrc, pout)
    assert.matches("compared 28 tensors", pout)
  end)
end)
