-- agents_spec.lua — replicas across hosts: `transom agent` on test hosts
-- (network namespaces on a bridge, spec/hosts/testhosts.sh), the operator
-- on the first, and real network faults: a host's link cut in the middle
-- of an all-reduce (its worker stopped by the FTAR test hook at a data
-- frame while the link goes down) and restored (the cut-off replica is replaced on a spare host
-- and fenced: it never contributes again), whole hosts lost (agent and
-- workers killed at once: a replacement on the spare; with no spare the job
-- trains on with fewer replicas, down to min_replicas), SIGTERM to the
-- operator while a host is unreachable (a checkpoint and exit 0 in bounded
-- time), a deadline shorter than the agents' heartbeat interval (no host
-- lost for it), the operator stopped (SIGSTOP) with its socket buffers full:
-- the agents wait operator_grace for it (and give up after it), an agent
-- stopped (SIGTERM) meanwhile hands it its queued lines first (and one
-- whose registration the frozen operator never answered exits at once), and the
-- operator's host gone silent under external workers (their blocked sends
-- end after operator_grace, a restarted operator adopts them), the
-- operator frozen with its workers' sends stuck while a new one starts
-- (they follow RUN/operator.addr at once and are adopted), the operator
-- killed under agents (they keep their workers and register again with
-- the restarted one, which adopts them; with one worker killed too, the
-- lost replica joins from the adopted one), and the job-file errors of
-- `hosts`.
-- Each case injects the fault for real and asserts what survived. Skipped
-- with a message only where network namespaces cannot be made (not root).
-- Runs inside the transom binary (`transom test spec`); spawns $TRANSOM_BIN.
-- Its waits and the jobs' deadline stretch with TRANSOM_TIME_SCALE (support.lua).

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local BIN, ROOT, CORPUS = S.BIN, S.ROOT, S.CORPUS
local sh, sleep, read = S.sh, S.sleep, S.read
local T, N = S.T, S.N

local TH = ROOT .. "/spec/hosts/testhosts.sh"
local NAME = "ta" .. (tonumber(sh("echo $$"):match("%d+")) % 100000)
local probe, probe_rc = sh(TH .. " probe")
local have_ns = probe_rc == 0

local tmp = S.tmpdir()
local data = S.corpus_copy(tmp, 300000)
local have_corpus = data ~= nil

local STEPS = 400
local PORT = 29500
local function job(run, extra, envs)
  return table.concat({
    TH, "exec", NAME, "1", "env", "MASTER_ADDR=10.77.0.1", "MASTER_PORT=" .. PORT, "TRANSOM_TEST_STEP_MS=40", envs or "",
    BIN, "run", ROOT .. "/examples/shakespeare.lua", "--replicas 2 --set hosts=2", "--set data=" .. data,
    "--set run_dir=" .. run, "--set max_steps=" .. STEPS,
    "--set n_layer=2 --set n_head=2 --set n_embd=64 --set block_size=32 --set batch_size=8",
    "--set eval_interval=0 --set eval_steps=10 --set sample_tokens=0 --set log_interval=50",
    "--set checkpoint.every_steps=20 --set deadline=" .. T(2), extra or "" }, " ")
end

-- an agent on host k, given the job's secret (made by the operator at its
-- start): its pid, and a function that reads its exit status (nil while it runs)
local function agent(k, run, extra, envs, secret)
  for _ = 1, N(300) do
    if S.exists(run .. "/secret") then break end
    sleep(0.05)
  end
  return S.spawn_rc(TH .. " exec " .. NAME .. " " .. k .. " env TRANSOM_TEST_STEP_MS=40 " .. (envs or "") .. " " ..
    BIN .. " agent --operator 10.77.0.1:" .. PORT .. " --secret-file " .. (secret or run .. "/secret") .. " --name h" ..
    k .. " --cores 1 " .. (extra or ""), run .. "-agent" .. k .. ".log")
end

local events = S.events

-- waits (bounded) until pattern shows in the run's events
local function wait_event(run, pattern, seconds)
  return S.wait_for(function() return events(run):match(pattern) end, seconds or 30) ~= nil
end

-- the highest step any replica reported
local function best_step(run)
  local best = 0
  for step in (read(run .. "/metrics.jsonl") or ""):gmatch('{"step":(%d+),"worker"') do
    best = math.max(best, tonumber(step))
  end
  return best
end

local function wait_step(run, n)
  for _ = 1, N(600) do
    if best_step(run) >= n then return true end
    sleep(0.05)
  end
  return false
end

-- the job at run has logged step n (within 30 s, scaled); else an error
-- that shows the operator's output, its last events and the workers' logs
local function progress(run, n)
  if wait_step(run, n) then return end
  local function tail(f) return ((read(f) or ""):sub(-1500)) end
  local msg = { "no progress to step " .. n .. " (best " .. best_step(run) .. ")",
    "--- operator " .. run .. ".out:", tail(run .. ".out"), "--- events:", tail(run .. "/events.jsonl") }
  for f in sh("ls " .. run .. "-*.log " .. run .. "/worker-*.log 2>/dev/null"):gmatch("[^\n]+") do
    msg[#msg + 1] = "--- " .. f .. ":"
    msg[#msg + 1] = tail(f)
  end
  error(table.concat(msg, "\n"), 2)
end

-- per worker, its steps in order, and the replicas each step averaged
local function steps_by_worker(run)
  local by = {}
  for line in (read(run .. "/metrics.jsonl") or ""):gmatch("[^\n]+") do
    local step, w = line:match('^{"step":(%d+),"worker":(%d+),')
    local reps = line:match('"replicas":(%d+)')
    if step then
      w = tonumber(w)
      by[w] = by[w] or {}
      table.insert(by[w], { step = tonumber(step), replicas = tonumber(reps) })
    end
  end
  return by
end

-- Workers 0 and 1 each recorded every step once, in order, up to steps:
-- no rejoin, no redo from a checkpoint, nothing lost across an adoption.
local function every_step_once(run, steps)
  local by = steps_by_worker(run)
  for w = 0, 1 do
    for i = 2, #by[w] do assert.equal(by[w][i - 1].step + 1, by[w][i].step) end
    assert.equal(steps, by[w][#by[w]].step)
  end
end

local wait_exit = S.wait_rc

local function up(n)
  local out, rc = sh(TH .. " up " .. NAME .. " " .. n)
  assert(rc == 0, out)
end

describe("replicas across hosts (transom agent on test hosts)", function()
  after_each(function()
    S.cleanup()
    sh(TH .. " down " .. NAME)
  end)

  it("refuses hosts without MASTER_ADDR and hosts with one replica, naming the key", function()
    local out, rc = sh(BIN .. " run " .. ROOT .. "/examples/shakespeare.lua --set hosts=1 --set run_dir=" .. tmp ..
      "/bad1")
    assert.is_not.equal(0, rc)
    assert.matches("hosts = 1 needs replicas >= 2", out, 1, true)
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    out, rc = sh(BIN .. " run " .. ROOT .. "/examples/shakespeare.lua --replicas 2 --set hosts=2 --set data=" .. data ..
      " --set run_dir=" .. tmp .. "/bad2")
    assert.is_not.equal(0, rc)
    assert.matches("key 'hosts'", out, 1, true)
    assert.matches("MASTER_ADDR", out, 1, true)
  end)

  it("testhosts.sh with: a step of up that fails stops it (no command run on broken hosts, nothing left)", function()
    if not have_ns then pending(probe) return end
    -- a `timeout` that fails the bridge's creation, found before /usr/bin's
    assert(os.execute("mkdir -p " .. tmp .. "/fake"))
    S.write(tmp .. "/fake/timeout", '#!/bin/sh\ncase "$*" in *"type bridge"*) exit 2 ;; esac\nexec /usr/bin/timeout "$@"\n')
    sh("chmod +x " .. tmp .. "/fake/timeout")
    local name = "tw" .. NAME:sub(3)
    local out, rc = sh("PATH=" .. tmp .. "/fake:$PATH " .. TH .. " with " .. name .. " 2 echo RAN")
    assert.is_not.equal(0, rc, out)
    assert.is_nil(out:match("RAN"), out)
    assert.equal("", sh("ip netns list | grep '^" .. name .. "-' || true"))
  end)

  it("a deadline shorter than the agents' heartbeat interval does not lose a host between two beats", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(2)
    local run = tmp .. "/short"
    S.spawn_rc(job(run, "--set deadline=0.1"), run .. ".out") -- (the last --set wins)
    agent(2, run) -- one host of the two: the operator waits for the other, its agent heartbeating
    assert(wait_event(run, "host_joined[^\n]*host h2"), events(run))
    sleep(1.5)
    assert.is_nil(events(run):match("host_lost"), events(run))
  end)

  -- small socket buffers (per namespace): the hosts send from 4 KiB, the
  -- operator's host receives into at most rmem bytes (no growth; nil: as
  -- usual), so a stopped operator's buffers fill with a few link probes (64
  -- KiB each)
  local function small_buffers(hosts, rmem)
    if rmem then sh(TH .. " exec " .. NAME .. " 1 sysctl -qw net.ipv4.tcp_rmem='4096 " .. rmem .. " " .. rmem .. "'") end
    for _, k in ipairs(hosts) do sh(TH .. " exec " .. NAME .. " " .. k .. " sysctl -qw net.ipv4.tcp_wmem='4096 4096 4096'") end
  end

  -- whether pid is gone (or a zombie)
  local function ended(pid)
    local stat = read("/proc/" .. pid .. "/stat")
    return not stat or stat:match("^%d+ %b() Z") ~= nil
  end

  -- The operator stopped for good (SIGSTOP, never continued) with its
  -- buffers full: the agent gives up on it once it has taken none of the
  -- agent's bytes for operator_grace, on its own, and it never waits in
  -- send meanwhile (before: a probe blocked in send, SO_SNDTIMEO 10 s).
  -- It then tries another grace to register again (the stopped operator's
  -- port takes the connection but never answers) and exits.
  it("an agent whose operator stops reading gives up after operator_grace, never blocked in send", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(2)
    small_buffers({ 2 }, 4096) -- one probe fills them
    local run = tmp .. "/stalled"
    local grace = string.format("%d", math.ceil(T(3)))
    local opid = S.spawn_rc(job(run, "--set operator_grace=" .. grace), run .. ".out")
    local apid = agent(2, run) -- one host of the two: the operator waits for the other
    assert(wait_event(run, "host_joined[^\n]*host h2"), events(run))
    sh("kill -STOP " .. opid)
    local in_send, gone = nil, false
    for _ = 1, N(300) do -- its next probe (every 2 s) fills the buffers; grace s later it is gone
      if ended(apid) then gone = true break end
      local wchan = read("/proc/" .. apid .. "/wchan") or "" -- sk_stream_wait_memory sleeps in wait_woken
      if wchan:match("wait_memory") or wchan:match("wait_woken") then in_send = wchan end
      sleep(0.1)
    end
    sh("kill -CONT " .. opid)
    local log = read(run .. "-agent2.log") or ""
    assert(gone, "the agent did not give up on the stopped operator: " .. log)
    assert.is_nil(in_send, "the agent waited in send (" .. tostring(in_send) .. ")")
    assert.matches("lost the operator: it took none of our bytes for " .. grace .. " s (operator_grace", log, 1, true)
  end)

  -- host k's process pid, its connection to the operator: the bytes queued
  -- and not yet taken (Send-Q) and the bytes the operator's host has taken
  -- so far (bytes_acked); nil when it has none
  local function link_bytes(k, pid)
    local out = sh(TH .. " exec " .. NAME .. " " .. k .. " ss -tnpiH state established dport = :" .. PORT)
    local q
    for line in out:gmatch("[^\n]+") do
      if q then return q, tonumber(line:match("bytes_acked:(%d+)") or 0) end
      q = tonumber(line:match("^%s*%d+%s+(%d+)%s.*pid=" .. pid .. ","))
    end
  end

  -- An agent stopped (SIGTERM: its node drained) while its operator is
  -- stalled (SIGSTOP) with the socket buffers full: the agent kills its
  -- worker, whose EXITED line queues behind a link probe the operator has
  -- not taken. Before, the agent exited at once and dropped what its socket
  -- had not taken: the operator, going on, saw only the connection close
  -- and counted the replica lost with its host (host_lost). Now it waits
  -- (a few seconds at most) for the operator to take its lines, then exits
  -- 0 as before: the operator hears the worker's real exit.
  it("an agent stopped while its operator stalls hands over its queued lines before it exits", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(3)
    small_buffers({ 2, 3 }, 4096)
    local run = tmp .. "/agentterm"
    local opid = S.spawn_rc(job(run), run .. ".out")
    local apid, arc = agent(2, run)
    agent(3, run)
    progress(run, 20)
    local v = events(run):match("replica (%d) placed on host h2")
    assert(v, events(run))
    sh("kill -STOP " .. opid)
    -- a link probe stuck behind the stopped operator: more of the agent's
    -- bytes unsent than its heartbeats ever make
    assert(S.wait_for(function()
      local q = link_bytes(2, apid)
      return q and q >= 1024
    end, 15), "the agent's bytes did not pile up behind the stopped operator")
    sh("kill -TERM " .. apid)
    local function alog() return read(run .. "-agent2.log") or "" end
    -- its worker stopped, it waits for the operator (before: it was gone)
    S.wait_for(function() return ended(apid) or alog():find("has not taken", 1, true) end, 10)
    sh("kill -CONT " .. opid)
    assert(S.wait_for(arc, 15), "the agent did not exit: " .. alog())
    assert.equal(0, arc(), alog())
    assert(wait_event(run, "host_lost[^\n]*host h2", 15), events(run))
    local ev = events(run)
    assert.matches('"kind":"replica_failed","detail":"replica ' .. v .. ' killed (signal 9)', ev, 1, true)
    assert.matches("host h2 (10.77.0.2) lost: its agent's connection closed; 0 replica(s) on it", ev, 1, true)
    assert.matches("the operator took them", alog(), 1, true)
  end)

  -- An agent started while its operator is frozen (SIGSTOP): the
  -- operator's port takes the connection (the kernel's backlog) and nothing
  -- answers the registration. Stopped meanwhile (SIGTERM: its node
  -- drained), the agent exits 0 at once. Before, it sat out its wait for
  -- the operator's answer (30 s at the start; 3 s a try when it registers
  -- again after losing the operator, the same code) and then exited 1,
  -- "did not answer".
  it("an agent stopped while a frozen operator has not answered its registration exits 0 at once", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(2)
    local run = tmp .. "/frozenhello"
    local opid = S.spawn_rc(job(run), run .. ".out")
    assert(S.wait_for(function() return S.exists(run .. "/operator.addr") end, 30), "the operator did not start")
    sh("kill -STOP " .. opid)
    local apid, arc = agent(2, run)
    assert(S.wait_for(function() return link_bytes(2, apid) end, 15), "the agent did not connect")
    sh("kill -TERM " .. apid)
    local rc -- waited for unscaled: the fixed 30 s answer wait is what this tells apart
    for _ = 1, 200 do
      rc = arc()
      if rc then break end
      sleep(0.05)
    end
    sh("kill -CONT " .. opid)
    local log = read(run .. "-agent2.log") or ""
    assert(rc, "the agent did not exit within 10 s of SIGTERM: " .. log)
    assert.equal(0, rc, log)
    assert.matches("agent h2: stopped (SIGTERM) before registering", log, 1, true)
  end)

  -- The operator stopped (SIGSTOP: its loop stalled, its host alive) with
  -- its buffers full, then continued. Before, an agent whose send moved
  -- nothing for SEND_TIMEOUT_S (10 s) took the operator for lost: it killed
  -- its worker and exited, and the job lost its hosts. (A send blocked on a
  -- closed window is woken now and then by a few bytes' room, and each wait
  -- starts again: here the old agent gave up after about 30 s with none of
  -- its bytes taken, never before 20.) The stop here lasts until the
  -- operator's host has taken none of each agent's bytes for 35 s (read
  -- from the agent's socket), well inside operator_grace (60 s by default).
  -- Now an agent stops adding bytes behind those not taken and waits
  -- operator_grace, the workers' sends wait the same, and the operator does
  -- not count its own stall as the agents' or the workers' silence: the job
  -- goes on with the same workers and finishes. The default suite stops it
  -- until 12 s with none taken (past SEND_TIMEOUT_S) in a 400-step job;
  -- ./test.sh --long (TRANSOM_LONG=1) until 35 s in a 500-step one, past
  -- the 20 to 30 s after which the old agent gave up.
  it("the operator stopped past an agent's old send timeout: agents and workers wait, the job finishes", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(3)
    -- the operator's host receives into 128 KiB, its usual start (into 4
    -- KiB, after a stop this long the FTAR heartbeats' connections stayed
    -- silent past the deadline: their window probes had backed off)
    small_buffers({ 2, 3 }, 131072)
    -- steps of 100 ms: the replicas cannot finish while it is stopped
    local long = os.getenv("TRANSOM_LONG") == "1"
    local run, steps, pad = tmp .. "/paused", long and 500 or 400, "TRANSOM_TEST_STEP_MS=100"
    local opid, rc_of = S.spawn_rc(job(run, "--set max_steps=" .. steps), run .. ".out")
    local agents = { { k = 2, pid = agent(2, run, nil, pad) }, { k = 3, pid = agent(3, run, nil, pad) } }
    progress(run, 40)
    local workers = {}
    for k = 2, 3 do workers[k] = tonumber((read(run .. "-agent" .. k .. ".log") or ""):match("started %(pid (%d+)%)")) end
    local STUCK_S = long and 35 or 12 -- none of an agent's bytes taken this long (os.time: whole seconds)
    sh("kill -STOP " .. opid)
    local stuck, gave_up = false, nil
    for _ = 1, N(500) do -- 50 s of 0.1 s rounds, more with ss's time: bounded
      stuck = true
      for _, a in ipairs(agents) do
        if ended(a.pid) then gave_up = a.k end
        local q, acked = link_bytes(a.k, a.pid)
        if not q or q == 0 or acked ~= a.acked then a.acked, a.since = acked, os.time() end
        stuck = stuck and q and q > 0 and os.time() - a.since > STUCK_S
      end
      if stuck or gave_up then break end
      sleep(0.1)
    end
    local training = workers[2] and workers[3] and not ended(workers[2]) and not ended(workers[3])
    sh("kill -CONT " .. opid)
    assert.is_nil(gave_up, "the agent on h" .. tostring(gave_up) .. " gave up on the stopped operator: " ..
      (read(run .. "-agent" .. tostring(gave_up) .. ".log") or ""))
    assert(stuck, "the agents' bytes kept being taken: the stop did not outlast the old send timeout")
    assert(training, "the workers did not outlast the stop")
    local rc = wait_exit(rc_of, T(120))
    local out, ev = read(run .. ".out") or "", events(run)
    assert.equal(0, rc, out)
    assert.matches("finished at step " .. steps, out, 1, true)
    assert.is_nil(ev:match("host_lost"), ev)
    assert.is_nil(ev:match('"kind":"replica_failed"'), ev)
    assert.equal(2, select(2, ev:gsub('"kind":"spawn"', "")), ev) -- none replaced
    assert.matches("replicas_agree", ev, 1, true)
    for k = 2, 3 do -- each agent started one worker and kept it
      local log = read(run .. "-agent" .. k .. ".log") or ""
      assert.equal(1, select(2, log:gsub("replica %d started", "")), log)
    end
    every_step_once(run, steps) -- every step once, in order: no rejoin, no redo from a checkpoint
  end)

  -- The operator's host gone silent under external workers (torchrun's
  -- way: RANK and MASTER_ADDR, no agent) on two other hosts: its link cut,
  -- then the operator killed, so no FIN or RST ever reaches them. Their
  -- lines to it go unacknowledged and fill their 4 KiB send buffers, and a
  -- send blocks holding send_mu (the heartbeat thread, which looks for a
  -- new operator, waits behind it). Before, it stayed blocked for the
  -- kernel's retransmissions (about 15 minutes). Now a send the operator
  -- takes nothing of for operator_grace fails and is the link lost: each
  -- worker pauses at its step boundary, an operator restarted on the
  -- restored host (--resume) adopts both, and the job finishes with every
  -- step once.
  it("the operator's host gone silent: external workers' blocked sends end after operator_grace, a new operator adopts them", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(3)
    small_buffers({ 2, 3 })
    local run, steps, grace = tmp .. "/silent", 200, math.ceil(T(8))
    local ext = "TRANSOM_EXTERNAL_WORKERS=1"
    local opid = S.spawn_rc(job(run, "--set hosts=0 --set max_steps=" .. steps .. " --set operator_grace=" .. grace, ext),
      run .. ".out")
    assert(S.wait_for(function() return S.exists(run .. "/secret") end, 15), "no secret")
    local wpid = {}
    for r = 0, 1 do -- what torchrun would start on hosts 2 and 3
      wpid[r] = S.spawn(TH .. " exec " .. NAME .. " " .. (r + 2) .. " env RANK=" .. r .. " MASTER_ADDR=10.77.0.1 MASTER_PORT=" ..
        PORT .. " TRANSOM_SECRET_FILE=" .. run .. "/secret TRANSOM_TEST_STEP_MS=40 " .. BIN .. " worker",
        run .. "-w" .. r .. ".log")
    end
    progress(run, 40)
    sh(TH .. " cut " .. NAME .. " 1")
    sh("kill -KILL " .. opid)
    local function wlog(r) return read(run .. "-w" .. r .. ".log") or "" end
    -- while the host is still cut off, each worker finds its operator lost
    local lost = S.wait_for(function()
      return wlog(0):find("lost the operator", 1, true) and wlog(1):find("lost the operator", 1, true)
    end, T(3 * grace))
    -- where each worker's threads wait (a send: sk_stream_wait_memory, in wait_woken)
    local function wchans(r)
      return (sh("for f in /proc/" .. wpid[r] .. "/task/*/wchan; do cat $f; echo -n ' '; done 2>/dev/null"))
    end
    assert(lost, "a worker never noticed its operator's host gone (its threads wait in: " .. wchans(0) .. "/ " ..
      wchans(1) .. ")\n" .. wlog(0) .. wlog(1))
    local before = #events(run)
    sh(TH .. " restore " .. NAME .. " 1")
    local _, rc_of = S.spawn_rc(TH .. " exec " .. NAME .. " 1 env " .. ext .. " MASTER_ADDR=10.77.0.1 MASTER_PORT=" .. PORT ..
      " " .. BIN .. " run --resume " .. run, run .. ".out2")
    local rc = wait_exit(rc_of, T(120))
    assert.equal(0, rc, (read(run .. ".out2") or "") .. wlog(0) .. wlog(1))
    local ev = events(run):sub(before + 1)
    assert.matches("replica 0 adopted", ev, 1, true)
    assert.matches("replica 1 adopted", ev, 1, true)
    assert.matches("replicas_agree", ev, 1, true)
    for r = 0, 1 do assert.matches("adopted by the operator at 10.77.0.1:" .. PORT, wlog(r), 1, true) end
    every_step_once(run, steps) -- the replayed STEP lines fill what the old operator never got
  end)

  -- The operator frozen (SIGSTOP, never continued: a hung process, or its
  -- host stalled) with 4 KiB socket buffers, its replicas on its own host
  -- (the first test host), their lines to it piling up unsent; an operator
  -- started with --resume meanwhile. Before, a worker blocked in its send
  -- to the frozen one noticed nothing until that send timed out
  -- (operator_grace): the new operator's adoption window (2 s) had long
  -- closed and it had started replacements, so the workers were refused
  -- ("slot in use") and exited 4 after another grace. Now a worker follows
  -- RUN/operator.addr written anew at once, whatever its old link looks
  -- like, and the new operator adopts both: no replacement, every step once.
  it("the operator frozen with the workers' sends stuck, a new one started: it adopts them, no replacement", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(1)
    small_buffers({ 1 }, 4096)
    local run, steps = tmp .. "/frozen", 150
    local opid = S.spawn_rc(job(run, "--set hosts=0 --set max_steps=" .. steps), run .. ".out")
    progress(run, 40)
    local wpid = {}
    local status = sh(BIN .. " chaos " .. run .. " status")
    for r = 0, 1 do wpid[r] = tonumber(status:match("replica " .. r .. ": running pid (%d+)")) end
    assert(wpid[0] and wpid[1], status)
    sh("kill -STOP " .. opid)
    -- the frozen operator takes none of their lines: they wait in the workers' send queues
    assert(S.wait_for(function()
      for r = 0, 1 do
        local q = link_bytes(1, wpid[r])
        if not q or q == 0 then return false end
      end
      return true
    end, 15), "the workers' lines did not pile up behind the frozen operator")
    local before = #events(run)
    local _, rc_of = S.spawn_rc(TH .. " exec " .. NAME .. " 1 " .. BIN .. " run --resume " .. run, run .. ".out2")
    local rc = wait_exit(rc_of, T(60))
    sh("kill -KILL " .. opid)
    local function wlog(r) return read(run .. "/worker-" .. r .. ".log") or "" end
    assert.equal(0, rc, (read(run .. ".out2") or "") .. wlog(0) .. wlog(1))
    local ev = events(run):sub(before + 1)
    assert.matches("2 of 2 replicas adopted live", ev .. (read(run .. ".out2") or ""), 1, true)
    assert.is_nil(ev:find('"kind":"spawn"', 1, true), ev)
    assert.is_nil(ev:find('"kind":"replica_failed"', 1, true), ev)
    for r = 0, 1 do
      assert.matches("(RUN/operator.addr names a restarted operator)", wlog(r), 1, true)
      assert.matches("adopted by the operator", wlog(r), 1, true)
    end
    every_step_once(run, steps) -- the replayed STEP lines fill what the frozen operator never took
  end)

  -- A 200-step job with one replica on each of hosts 2 and 3 (agents),
  -- trained to step 40: its run directory, the operator's pid, each
  -- agent's exit status reader, and a reader of agent k's log. Agent
  -- stale_k (if given) reads the secret from a copy beside a stale
  -- operator.addr (another operator's nonce, the address the agents know).
  local function agents_job(name, stale_k)
    up(3)
    local run = tmp .. "/" .. name
    local opid = S.spawn_rc(job(run, "--set max_steps=200 --set operator_grace=" .. math.ceil(T(10))), run .. ".out")
    local agents, copy = {}, tmp .. "/" .. name .. "-copy"
    if stale_k then
      assert(S.wait_for(function() return S.exists(run .. "/secret") end, 15), "no secret")
      sh("mkdir -p " .. copy .. " && cp -p " .. run .. "/secret " .. copy .. "/secret")
      S.write(copy .. "/operator.addr", "10.77.0.1:" .. PORT .. "\n0123456789abcdef01234567\n")
    end
    for k = 2, 3 do agents[k] = select(2, agent(k, run, nil, nil, k == stale_k and copy .. "/secret" or nil)) end
    progress(run, 40)
    return run, opid, agents, function(k) return read(run .. "-agent" .. k .. ".log") or "" end
  end

  -- A restarted operator's events ev: both replicas adopted live, nothing
  -- started, failed or killed.
  local function adopted_both(ev)
    assert.matches("2 of 2 replicas adopted live", ev, 1, true)
    assert.is_nil(ev:find('"kind":"spawn"', 1, true), ev)
    assert.is_nil(ev:find('"kind":"replica_failed"', 1, true), ev)
    assert.is_nil(ev:find("stale_worker", 1, true), ev)
  end

  -- `transom run --resume RUN` on host 1 with MASTER_PORT port: its exit status reader.
  local function resume_on_h1(run, port, envs)
    return select(2, S.spawn_rc(TH .. " exec " .. NAME .. " 1 env MASTER_ADDR=10.77.0.1 MASTER_PORT=" .. port ..
      " TRANSOM_TEST_STEP_MS=40 " .. (envs or "") .. " " .. BIN .. " run --resume " .. run, run .. ".out2"))
  end

  -- The operator killed (kill -9) while its replicas run on two agents'
  -- hosts. Before, each agent stopped its workers and exited 1 when its
  -- operator's connection closed: a restart had to start agents again and
  -- resume from the newest checkpoint, the steps since lost. Now the agents
  -- keep their workers and register again with the operator restarted on
  -- another port (`transom run --resume`; they find it through
  -- RUN/operator.addr), naming them (AGENT live=);
  -- the workers say HELLO live=1 naming their agent: both adopted, no
  -- replacement, every step once; at the end the operator tells the
  -- agents (END) and they exit 0 at once, not after operator_grace.
  it("the operator killed: the agents keep their workers and register again, the restarted operator adopts them", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    local run, opid, agents, alog = agents_job("rejoin")
    local wpid = {}
    for k = 2, 3 do wpid[k] = alog(k):match("started %(pid (%d+)%)") end
    assert(wpid[2] and wpid[3], alog(2) .. alog(3))
    sh("kill -KILL " .. opid)
    assert(S.wait_for(function()
      return alog(2):find("keeping our 1 worker", 1, true) and alog(3):find("keeping our 1 worker", 1, true)
    end, T(20)), "an agent did not keep its worker:\n" .. alog(2) .. alog(3))
    local before = #events(run)
    -- on another port: agents and workers find it through RUN/operator.addr
    -- (the next case restarts it at the agents' --operator address)
    local rc = wait_exit(resume_on_h1(run, PORT + 1), T(120))
    assert.equal(0, rc, (read(run .. ".out2") or "") .. alog(2) .. alog(3))
    local ev = events(run):sub(before + 1)
    adopted_both(ev)
    assert.equal(2, select(2, ev:gsub("1 worker%(s%) it kept are ours", "")), ev)
    for k = 2, 3 do
      -- the very process its agent started before the kill, adopted as that agent's
      assert.matches("adopted at step %d+ %(pid " .. wpid[k] .. " on host h" .. k .. "%)", ev)
      assert.matches("registered with the operator at 10.77.0.1:" .. (PORT + 1), alog(k), 1, true)
      assert.matches("registered again", alog(k), 1, true)
      assert.equal(1, select(2, alog(k):gsub("replica %d started", "")), alog(k))
      -- END: it exits 0 as the job ends, well before its grace would run out
      assert.equal(0, wait_exit(agents[k], T(8)), alog(k))
      assert.matches("the operator ended the job", alog(k), 1, true)
    end
    every_step_once(run, 200) -- the replayed STEP lines fill what the killed operator never logged
  end)

  -- The operator frozen (SIGSTOP, never continued: hung) under agents, and
  -- a new one started on another port with --resume. The agents watch
  -- RUN/operator.addr as their workers do: both leave the frozen operator
  -- at once (not after operator_grace), register with the new one and are
  -- adopted with their workers: no spawn, every step once, END at the end.
  it("the operator frozen under agents, a new one started: agents and workers leave it at once and are adopted", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    local run, opid, agents, alog = agents_job("rejoinf")
    sh("kill -STOP " .. opid)
    local before = #events(run)
    local rc = wait_exit(resume_on_h1(run, PORT + 1), T(120))
    sh("kill -KILL " .. opid)
    assert.equal(0, rc, (read(run .. ".out2") or "") .. alog(2) .. alog(3))
    local ev = events(run):sub(before + 1)
    adopted_both(ev)
    for k = 2, 3 do
      assert.matches("lost the operator: RUN/operator.addr names a restarted operator", alog(k), 1, true)
      assert.matches("registered with the operator at 10.77.0.1:" .. (PORT + 1), alog(k), 1, true)
      assert.equal(1, select(2, alog(k):gsub("replica %d started", "")), alog(k))
      assert.equal(0, wait_exit(agents[k], T(8)), alog(k))
    end
    every_step_once(run, 200)
  end)

  -- The operator and one worker killed together: its agent registers again
  -- with no worker to name; the restarted operator adopts the other
  -- replica and starts the lost one on that host, joining from the adopted
  -- one (no checkpoint reload): the survivor records every step once.
  it("the operator and a worker killed together: the survivor is adopted, the lost replica joins from it", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    -- host 2's agent reads its secret beside a stale copy of operator.addr:
    -- not news of a restarted operator, before the kill or after it
    local run, opid, _, alog = agents_job("rejoin1", 2)
    local victim = alog(3):match("replica (%d) started %(pid (%d+)%)")
    local vpid = select(2, alog(3):match("replica (%d) started %(pid (%d+)%)"))
    assert(vpid, alog(3))
    sh("kill -KILL " .. opid .. " " .. vpid)
    assert(S.wait_for(function() return alog(3):find("exited, status 0x9", 1, true) end, T(20)), alog(3))
    local before = #events(run)
    -- at the same address, and slow to write RUN/operator.addr (a test
    -- hook, 1 s): the survivor reaches it while the file still names the
    -- dead operator, and must not take the file's rewrite a moment later
    -- for yet another operator (before: it left, was refused, restarted)
    local rc = wait_exit(resume_on_h1(run, PORT, "TRANSOM_TEST_ADDR_DELAY_MS=1000"), T(120))
    assert.equal(0, rc, (read(run .. ".out2") or "") .. alog(2) .. alog(3))
    local ev = events(run):sub(before + 1)
    local survivor = 1 - tonumber(victim)
    assert.matches("1 of 2 replicas adopted live at step %d+; 1 to start", ev)
    assert.matches("replica " .. survivor .. " adopted", ev, 1, true)
    assert.matches("replica " .. victim .. " placed on host h3 %([^)]*join", ev)
    assert.matches("replica_ready[^\n]*replica " .. victim .. " ready[^\n]*join", ev)
    assert.is_nil(ev:find("stale_worker", 1, true), ev)
    assert.is_nil(ev:find('"kind":"replica_failed"', 1, true), ev)
    assert.matches("replicas_agree", ev, 1, true)
    assert.is_nil(events(run):find("host_lost", 1, true), events(run))
    assert.is_nil(alog(2):find("names a restarted operator", 1, true), alog(2))
    assert.matches("registered again", alog(3), 1, true)
    assert.equal(2, select(2, alog(3):gsub("replica %d started", "")), alog(3)) -- the first, and the one that joined
    local by = steps_by_worker(run) -- the survivor: every step once, in order
    for i = 2, #by[survivor] do assert.equal(by[survivor][i - 1].step + 1, by[survivor][i].step) end
    assert.equal(200, by[survivor][#by[survivor]].step)
  end)

  it("a host's link cut in the middle of an all-reduce: replaced on the spare, fenced when restored", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(4)
    local run = tmp .. "/cut"
    local pid, rc_of = S.spawn_rc(job(run), run .. ".out")
    -- the worker on h2 stops itself (SIGSTOP) at the first data frame of the
    -- all-reduce of step 100 (the test hook of ftar_ring.c): the link is cut
    -- while it is in the middle of that collective, then it runs on, cut off
    local CUT_SEQ = 100
    agent(2, run, nil, "TRANSOM_TEST_FTAR_FAULT=stop:" .. CUT_SEQ .. ":1")
    agent(3, run)
    assert(wait_event(run, '"kind":"start"'), events(run))
    agent(4, run) -- the spare, once both replicas are placed
    assert(wait_event(run, "host_joined[^\n]*host h4"), events(run))
    local v = tonumber(events(run):match('replica (%d) placed on host h2'))
    assert(v, events(run))
    local other = 1 - v
    local wpid
    progress(run, 50)
    wpid = tonumber(sh(BIN .. " chaos " .. run .. " status"):match("replica " .. v .. ": running pid (%d+)"))
    assert(wpid, "no pid for replica " .. v)
    local stopped = false
    for _ = 1, N(600) do
      local stat = read("/proc/" .. wpid .. "/stat") or ""
      if stat:match("^%d+ %b() T") then stopped = true break end
      sleep(0.05)
    end
    assert(stopped, "replica " .. v .. " never reached the all-reduce of step " .. CUT_SEQ)
    sh(TH .. " cut " .. NAME .. " 2")
    sh("kill -CONT " .. wpid)
    assert(wait_event(run, "host_lost[^\n]*host h2 [^\n]*no word from its agent", T(30)), events(run))
    assert(wait_event(run, "replica_ready[^\n]*replica " .. v .. " ready[^\n]*join", T(30)), events(run))
    sh(TH .. " restore " .. NAME .. " 2")
    local rc = wait_exit(rc_of, T(120))
    local out = read(run .. ".out")
    assert.equal(0, rc, out)
    local ev = events(run)
    assert.matches("finished at step " .. STEPS, out, 1, true)
    -- replaced on the spare, not back on the cut host
    assert.matches("replica " .. v .. " placed on host h4", ev, 1, true)
    assert.is_nil(ev:match("replica " .. v .. " placed on host h2[^\n]*join"))
    -- its agent, back in touch, registered again naming the cut-off worker:
    -- not this operator's any more (replaced), so it was told to kill it
    assert.matches("stale_worker[^\n]*host h2 kept a worker for replica " .. v, ev)
    -- the survivor finished the step among itself and never stopped: every step once, in order
    local by = steps_by_worker(run)
    for i = 2, #by[other] do assert.equal(by[other][i - 1].step + 1, by[other][i].step) end
    assert.equal(STEPS, by[other][#by[other]].step)
    for _, r in ipairs(by[other]) do
      if r.step == CUT_SEQ + 1 then assert.equal(1, r.replicas) end -- the step cut mid-reduce: its own gradient
    end
    -- fenced: its own agent killed the cut-off worker once the link came
    -- back (it lost the operator), and every replica agrees at the end (a
    -- stale gradient would have split them)
    assert.matches("replica " .. v .. " %(pid " .. wpid .. "%) exited, status 0x9", read(run .. "-agent2.log"))
    assert.matches("replicas_agree", ev, 1, true)
    print(string.format("\n  link cut in all-reduce %d; replacement ready: %s", CUT_SEQ,
      ev:match('replica ' .. v .. ' ready at step %d+ %(join[^)]*%)') or "?"))
  end)

  it("4 replicas on 2 hosts (2 slots each): FTAR reduces hierarchically, a replica killed mid-reduce is redone", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(3)
    local run = tmp .. "/hier"
    local FAULT_SEQ = 60
    local pid, rc_of = S.spawn_rc(job(run, "--replicas 4"), run .. ".out") -- (the last --replicas wins)
    -- the replica of slot 3 (not a leader: slots 0 and 1 lead, wherever
    -- placement puts them) kills itself at its 2nd data frame of the
    -- all-reduce of step 60, in the local reduce (frames counted over the
    -- hierarchy's phases); both agents carry the hook, the slot picks it
    local fault = "TRANSOM_TEST_FTAR_FAULT=kill:" .. FAULT_SEQ .. ":2:3"
    agent(2, run, "--slots 2", fault)
    agent(3, run, "--slots 2", fault)
    local rc = wait_exit(rc_of, T(180))
    local out = read(run .. ".out") or ""
    assert.equal(0, rc, out)
    assert.matches("finished at step " .. STEPS, out, 1, true)
    local ev = events(run)
    assert.matches("replicas_agree", ev, 1, true)
    -- two replicas per host, and every worker's FTAR ran the hierarchy
    local hosts = {}
    for h in ev:gmatch("replica %d placed on host (h%d) %([%d.]+, start%)") do hosts[h] = (hosts[h] or 0) + 1 end
    assert.equal(2, hosts.h2, ev)
    assert.equal(2, hosts.h3, ev)
    local logs = ""
    for w = 0, 3 do logs = logs .. (read(run .. "/worker-" .. w .. ".log") or "") end
    assert.matches("hierarchical over 2 hosts, leader of 2", logs, 1, true)
    assert.matches("hierarchical over 2 hosts, member of 2", logs, 1, true)
    -- the killed replica's step was redone by the survivors over 3 replicas
    local by = steps_by_worker(run)
    local redone = false
    for w = 0, 2 do
      for _, r in ipairs(by[w] or {}) do
        if r.step == FAULT_SEQ + 1 and r.replicas == 3 then redone = true end
      end
    end
    assert(redone, "no survivor averaged step " .. (FAULT_SEQ + 1) .. " over 3 replicas")
    assert.matches("seq " .. FAULT_SEQ .. " aborted", logs, 1, true)
    print(string.format("\n  hierarchical: 4 replicas on 2 hosts, step %d redone over 3", FAULT_SEQ + 1))
  end)

  it("attach: hosts() lists them; a cordoned spare gets no replacement until uncordoned", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(4)
    local run = tmp .. "/cordon"
    local pid, rc_of = S.spawn_rc(job(run), run .. ".out")
    agent(2, run)
    agent(3, run)
    assert(wait_event(run, '"kind":"start"'), events(run))
    agent(4, run)
    assert(wait_event(run, "host_joined[^\n]*host h4"), events(run))
    local hosts = sh(BIN .. " attach " .. run .. " -e 'hosts()'")
    -- a table: a header, then one row per host, every value under its name
    assert.matches("^name%s+addr%s+alive%s+cordoned%s+slots%s+used", hosts)
    for k = 2, 4 do assert.matches("\nh" .. k .. "%s+10%.77%.0%." .. k .. "%s+true%s+false%s", hosts) end
    local out = sh(BIN .. " attach " .. run .. " -e 'cordon(\"h4\")'")
    assert.matches("true", out, 1, true)
    assert(wait_event(run, "cordon[^\n]*host h4 %(10.77.0.4%) cordoned[^\n]*from attach"), events(run))
    out = sh(BIN .. " attach " .. run .. " -e 'cordon(\"h9\")'")
    assert.matches("no such host", out, 1, true)
    progress(run, 60)
    local first = events(run):match('replica 1 placed on host h(%d)')
    sh(TH .. " kill " .. NAME .. " " .. first)
    -- the only free host is cordoned: the replacement waits
    assert(wait_event(run, "unplaced[^\n]*replica 1 waits", T(30)), events(run))
    assert.is_nil(events(run):match("replica 1 placed on host h4"))
    sh(BIN .. " attach " .. run .. " -e 'uncordon(\"10.77.0.4\")'")
    assert(wait_event(run, "replica_ready[^\n]*replica 1 ready[^\n]*join", T(30)), events(run))
    assert.matches("replica 1 placed on host h4", events(run), 1, true)
    assert.equal(0, wait_exit(rc_of, T(120)), read(run .. ".out"))
    assert.matches("replicas_agree", events(run), 1, true)
  end)

  it("whole hosts lost: a replacement on the spare, then with no spare fewer replicas", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(4)
    local run = tmp .. "/lost"
    local pid, rc_of = S.spawn_rc(job(run), run .. ".out")
    agent(2, run)
    agent(3, run)
    assert(wait_event(run, '"kind":"start"'), events(run))
    agent(4, run)
    assert(wait_event(run, "host_joined[^\n]*host h4"), events(run))
    progress(run, 60)
    local first = events(run):match('replica 1 placed on host h(%d)')
    sh(TH .. " kill " .. NAME .. " " .. first) -- agent and workers at once
    assert(wait_event(run, "host_lost[^\n]*host h" .. first, T(30)), events(run))
    assert(wait_event(run, "replica_ready[^\n]*replica 1 ready[^\n]*join", T(30)), events(run))
    assert.matches("replica 1 placed on host h4", events(run), 1, true)
    local at = best_step(run)
    assert(wait_step(run, at + 40), "no progress after the replacement")
    sh(TH .. " kill " .. NAME .. " 4") -- no spare left
    assert(wait_event(run, "unplaced[^\n]*replica 1 waits", T(30)), events(run))
    local rc = wait_exit(rc_of, T(120))
    local out = read(run .. ".out")
    assert.equal(0, rc, out)
    assert.matches("finished at step " .. STEPS, out, 1, true)
    -- the survivor trained every step, the last ones alone (min_replicas 1)
    local by = steps_by_worker(run)
    local last = by[0][#by[0]]
    assert.equal(STEPS, last.step)
    assert.equal(1, last.replicas)
    for i = 2, #by[0] do assert.equal(by[0][i - 1].step + 1, by[0][i].step) end
  end)

  it("no livelock: a replacement its peer cannot reach is evicted as unreachable, its host cordoned", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(4)
    local run = tmp .. "/unreach"
    local pid, rc_of = S.spawn_rc(job(run), run .. ".out")
    agent(2, run)
    agent(3, run)
    assert(wait_event(run, '"kind":"start"'), events(run))
    -- the spare advertises loopback: its workers' ports are unreachable from h2 and h3
    agent(4, run, "--addr 127.0.0.1")
    assert(wait_event(run, "host_joined[^\n]*host h4"), events(run))
    progress(run, 60)
    local first = events(run):match('replica 1 placed on host h(%d)')
    sh(TH .. " kill " .. NAME .. " " .. first)
    assert(wait_event(run, "replica 1 placed on host h4", T(30)), events(run))
    -- every collective aborts now; within a few deadlines the member is named and evicted
    assert(wait_event(run, '"kind":"anomaly","detail":"unreachable: replica 1 %(h4%)', T(60)), events(run))
    assert(wait_event(run, "replica 1 evicted: unreachable", T(10)), events(run))
    local rc = wait_exit(rc_of, T(120))
    local out = read(run .. ".out")
    assert.equal(0, rc, out)
    assert.matches("finished at step " .. STEPS, out, 1, true)
    -- h4 failed twice (its first replacement too, or the eviction and a retry): cordoned, or the job
    -- trained on without it; either way the survivor did every step once
    local by = steps_by_worker(run)
    for i = 2, #by[0] do assert.equal(by[0][i - 1].step + 1, by[0][i].step) end
    assert.equal(STEPS, by[0][#by[0]].step)
    print("\n  " .. (events(run):match("unreachable: replica 1 [^\"]*") or ""))
  end)

  it("a slow link (tbf 10 mbit on one host) is named by the slow_link rule", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(3)
    local run = tmp .. "/slow"
    local pid, rc_of = S.spawn_rc(job(run), run .. ".out")
    agent(2, run)
    agent(3, run)
    progress(run, 30)
    local slowed = events(run):match('replica 1 placed on host h(%d)')
    local out, rc = sh(TH .. " slow " .. NAME .. " " .. slowed .. " 10mbit")
    assert(rc == 0, out)
    assert(wait_event(run, '"kind":"anomaly","detail":"slow_link: host h' .. slowed .. ' ', T(40)), events(run))
    local other = slowed == "2" and "3" or "2"
    assert.is_nil(events(run):match("slow_link: host h" .. other))
    print("\n  " .. (events(run):match("slow_link: host [^\"]*") or ""))
    sh("kill -TERM " .. pid)
    assert.equal(0, wait_exit(rc_of, T(60)), read(run .. ".out"))
  end)

  -- ./test.sh --long: the operator killed 4 times in a 600-step job on two
  -- agents' hosts, each time restarted with --resume (at the agents'
  -- address, or at another port found through RUN/operator.addr), and a
  -- worker killed between restarts. The job finishes, the replicas agree,
  -- every restart adopted live workers, and metrics.jsonl holds every step.
  it("soak: the operator killed 4 times under agents, workers killed between (TRANSOM_LONG=1)", function()
    if os.getenv("TRANSOM_LONG") ~= "1" then return pending("the soak runs with ./test.sh --long (TRANSOM_LONG=1)") end
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(3)
    local run, STEPS = tmp .. "/asoak", 600
    local opid = S.spawn_rc(job(run, "--set max_steps=" .. STEPS .. " --set operator_grace=" .. math.ceil(T(20))),
      run .. ".out")
    for k = 2, 3 do agent(k, run) end
    math.randomseed(os.time())
    local rc_of, kills = nil, 0
    local function count(pattern) return select(2, events(run):gsub(pattern, "")) end
    for round = 1, 4 do
      assert(wait_step(run, round * 110 + math.random(0, 30)), "no progress in round " .. round)
      if round > 1 then -- a worker killed first, while this operator lives: replaced, joins
        local joins = count("replica_ready[^\n]*join")
        local pid = sh(BIN .. " chaos " .. run .. " status"):match("running pid (%d+)")
        if pid then sh("kill -9 " .. pid) kills = kills + 1 end
        assert(S.wait_for(function() return count("replica_ready[^\n]*join") > joins end, T(30)), events(run))
        assert(wait_step(run, best_step(run) + 10), "no progress after the worker kill in round " .. round)
      end
      sh("kill -9 " .. opid)
      sleep(0.2 + math.random() * 1.5)
      local adoptions = count('"kind":"adoption"')
      -- at the agents' --operator address, or at another port (RUN/operator.addr)
      opid, rc_of = S.spawn_rc(TH .. " exec " .. NAME .. " 1 env MASTER_ADDR=10.77.0.1 MASTER_PORT=" ..
        (round % 2 == 0 and PORT or PORT + 1) .. " TRANSOM_TEST_STEP_MS=40 " .. BIN .. " run --resume " .. run,
        run .. ".out" .. round)
      assert(S.wait_for(function() return count('"kind":"adoption"') > adoptions end, T(30)), events(run))
    end
    assert.equal(0, wait_exit(rc_of, T(300)), read(run .. ".out4"))
    local ev = events(run)
    assert.matches("replicas_agree", ev, 1, true)
    assert.equal(4, count('"kind":"adoption"'), ev) -- each restart adopted live workers (none: no adoption event)
    local seen = {}
    for step in (read(run .. "/metrics.jsonl") or ""):gmatch('{"step":(%d+),"worker"') do seen[tonumber(step)] = true end
    for step = 1, STEPS do assert(seen[step], "step " .. step .. " is missing from metrics.jsonl") end
    print(string.format("\n  agents soak: 4 operator kills, %d worker kills, %d adoptions", kills,
      select(2, ev:gsub('"kind":"adopted"', ""))))
  end)

  it("SIGTERM to the operator while a host is cut off: a checkpoint and exit 0, bounded", function()
    if not have_ns then pending(probe) return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    up(3)
    local run = tmp .. "/term"
    local pid, rc_of = S.spawn_rc(job(run, "--set checkpoint.every_steps=1000"), run .. ".out")
    agent(2, run)
    agent(3, run)
    progress(run, 60)
    sh(TH .. " cut " .. NAME .. " 3")
    sh("kill -TERM " .. pid)
    local rc = wait_exit(rc_of, T(60))
    local out = read(run .. ".out")
    assert.equal(0, rc, out)
    assert.matches("stopped at step %d+ %(checkpointed%)", out)
    local stop = tonumber(events(run):match('"kind":"stopping","detail":"SIGTERM: every replica finishes step (%d+)'))
    assert(stop, events(run))
    assert.matches('"step":' .. stop .. ',[^\n]*"kind":"checkpoint"', events(run))
  end)
end)
