-- slurm_spec.lua — examples/slurm.sbatch under a real Slurm: Debian's
-- slurm-wlm and munge started by the test (spec/hosts/slurm_cluster.sh:
-- slurmctld on test host 1, one slurmd per test host 2..4). The job asks
-- for 3 nodes and 2 replicas (one spare node); agents come by srun. A
-- replica killed is replaced; `scancel --signal=TERM --batch` (what
-- --signal=B:TERM@120 does before the time limit) makes a checkpoint and a
-- clean exit (job COMPLETED, exit 0); `scontrol requeue` brings the job back
-- and it resumes from that checkpoint and finishes, replicas agreeing.
-- Skipped with a message where slurm-wlm/munge are not installed
-- (apt-get install slurm-wlm munge) or namespaces cannot be made.
-- Runs inside the transom binary (`transom test spec`); spawns $TRANSOM_BIN.

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local BIN, ROOT, CORPUS = S.BIN, S.ROOT, S.CORPUS
local sh, sleep, read = S.sh, S.sleep, S.read
local T, N = S.T, S.N

local SC = ROOT .. "/spec/hosts/slurm_cluster.sh"
local TH = ROOT .. "/spec/hosts/testhosts.sh"
local NAME = "ts" .. (tonumber(sh("echo $$"):match("%d+")) % 100000)
local probe, probe_rc = sh(SC .. " probe")

local tmp = os.tmpname()
os.remove(tmp)
assert(os.execute("mkdir -p " .. tmp))
local have_corpus = read(CORPUS) ~= nil
if have_corpus then S.write(tmp .. "/corpus.txt", read(CORPUS):sub(1, 300000)) end
local CL = tmp .. "/cluster"

-- a command on test host 1 (the controller's), with the cluster's SLURM_CONF
local function on1(cmd) return sh(TH .. " exec " .. NAME .. " 1 env SLURM_CONF=" .. CL .. "/slurm.conf " .. cmd) end
local function state(id) return (on1("scontrol show job " .. id)):match("JobState=(%u+)") end
local events = S.events

local wait_for = S.wait_for

describe("examples/slurm.sbatch under a real Slurm", function()
  after_each(function()
    S.cleanup()
    sh(SC .. " down " .. NAME .. " " .. CL)
  end)

  it("a replica killed is replaced; preempted: checkpoint, exit 0; requeued: resumes and finishes", function()
    if probe_rc ~= 0 then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    local out, rc = sh(SC .. " up " .. NAME .. " 4 " .. CL)
    assert(rc == 0, out)
    S.write(tmp .. "/job.lua", [[
return {
  data = "]] .. tmp .. [[/corpus.txt", max_steps = 600,
  n_layer = 2, n_head = 2, n_embd = 64, block_size = 32, batch_size = 8,
  eval_interval = 0, eval_steps = 5, sample_tokens = 0, log_interval = 100,
  checkpoint = { every_steps = 20 }, deadline = ]] .. T(2) .. [[, threads = 1,
}
]])
    local run = tmp .. "/run"
    out = on1("env REPLICAS=2 RUN=" .. run .. " TRANSOM=" .. BIN .. " TRANSOM_TEST_STEP_MS=40 sbatch --nodes=3 " ..
      "--cpus-per-task=1 -o " .. tmp .. "/slurm-%j.out " .. ROOT .. "/examples/slurm.sbatch " .. tmp .. "/job.lua")
    local id = assert(tonumber(out:match("Submitted batch job (%d+)")), out)
    local log = function() return read(tmp .. "/slurm-" .. id .. ".out") or "" end
    assert(wait_for(function() return select(2, events(run):gsub("replica_ready", "")) >= 2 end, T(60)), log())
    assert(wait_for(function() return events(run):match('"step":[5-9]%d,') end, T(60)), log())
    -- a replica killed: replaced (the spare node has room)
    sh(BIN .. " chaos " .. run .. " kill 1")
    assert(wait_for(function() return events(run):match("replica 1 ready[^\n]*join") end, T(30)), log())
    -- preemption: the batch shell gets TERM, the operator checkpoints and exits 0
    on1("scancel --signal=TERM --batch " .. id)
    assert(wait_for(function() return state(id) == "COMPLETED" end, T(60)), log() .. on1("scontrol show job " .. id))
    local stop = tonumber(events(run):match('SIGTERM: every replica finishes step (%d+)'))
    assert(stop, events(run))
    assert.matches('"step":' .. stop .. ',[^\n]*"kind":"checkpoint"', events(run))
    assert.matches("stopped at step " .. stop .. " %(checkpointed%)", log())
    -- requeued: back from the checkpoint (Slurm holds a requeued job for cred_expire, 5 s in the test
    -- cluster; releasing it sooner makes its start fail with "Job credential revoked")
    on1("scontrol requeue " .. id)
    assert(wait_for(function()
      local st = state(id)
      return st == "COMPLETED" and log():match("finished at step 600") or st == "FAILED"
    end, T(120)), log())
    assert.equal("COMPLETED", state(id))
    assert.matches("replica_ready: replica %d ready at step " .. stop .. " %(resume", log())
    assert.matches("replicas_agree", events(run), 1, true)
    assert.matches("finished at step 600 | 2 replicas finished", log(), 1, true)
  end)
end)
