-- operator_spec.lua — `transom run` with 3 replicas under real faults: kill -9
-- from outside (one, two at once, the donor during a catch-up, all of them),
-- SIGTERM to the operator and --resume, the job's chaos list, restart_all,
-- kill -9 of the operator itself (a restarted one adopts the live workers;
-- none restarted: they exit after operator_grace), a rollback whose drop of
-- the abandoned checkpoints fails in the remote level (chattr +i).
-- Each case asserts what survived: every step done, no survivor's step going
-- back, the replacement joined, every replica's parameters equal at the end,
-- the final validation loss within 2% of a fault-free run.
-- Runs inside the transom binary (`transom test spec`); spawns $TRANSOM_BIN.
-- Its waits and the jobs' deadline stretch with TRANSOM_TIME_SCALE (support.lua).

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local BIN, ROOT, CORPUS = S.BIN, S.ROOT, S.CORPUS
local sh, sleep, read, write = S.sh, S.sleep, S.read, S.write
local T, N = S.T, S.N

local tmp = S.tmpdir()
local data = S.corpus_copy(tmp, 300000)
local have_corpus = data ~= nil

local STEPS = 300
local function job(run, extra)
  return table.concat({
    BIN, "run", ROOT .. "/examples/shakespeare.lua", "--replicas 3", "--set data=" .. data,
    "--set run_dir=" .. run, "--set max_steps=" .. STEPS,
    "--set n_layer=2 --set n_head=2 --set n_embd=64 --set block_size=32 --set batch_size=8",
    "--set eval_interval=0 --set eval_steps=10 --set sample_tokens=0 --set log_interval=50",
    "--set checkpoint.every_steps=20 --set deadline=" .. T(2), extra or "" }, " ")
end

local spawn, spawn_rc = S.spawn, S.spawn_rc

-- job() with a chaos list (the Lua text of its entries) in a job file of its own
local function chaos_job(run, entries, extra)
  local jobfile = run .. "-job.lua"
  write(jobfile, 'return { data = "' .. data .. '", chaos = { ' .. entries .. ' } }\n')
  -- a plain replacement: ROOT may hold pattern characters (a worktree named wt-rev12)
  local pat = (ROOT .. "/examples/shakespeare.lua"):gsub("%p", "%%%0")
  return (job(run, extra):gsub(pat, (jobfile:gsub("%%", "%%%%")), 1))
end

local alive, wait_exit = S.alive, S.wait_gone

-- the metrics lines of a multi-replica run: per worker, its steps in order
local function steps_by_worker(run)
  local by = {}
  for line in (read(run .. "/metrics.jsonl") or ""):gmatch("[^\n]+") do
    local step, w = line:match('^{"step":(%d+),"worker":(%d+),')
    if step then
      w = tonumber(w)
      by[w] = by[w] or {}
      table.insert(by[w], tonumber(step))
    end
  end
  return by
end

local function final_val(run)
  local v
  for line in (read(run .. "/metrics.jsonl") or ""):gmatch("[^\n]+") do
    local x = line:match('"val_loss":([%d%.eE%-]+)')
    if x then v = tonumber(x) end
  end
  return v
end

local events = S.events

-- A run that a refused --resume left alone: no event past the first
-- `before` bytes of events.jsonl says anything was adopted, spawned,
-- failed, superseded or resumed, and every worker logged steps 1..steps
-- once, in order.
local function went_on_alone(run, before, steps)
  local after = events(run):sub(before + 1)
  for _, kind in ipairs({ "adopted", "spawn", "replica_failed", "superseded", "resume" }) do
    assert.is_nil(after:find('"kind":"' .. kind .. '"', 1, true), after)
  end
  for w, ws in pairs(steps_by_worker(run)) do
    assert.equal(steps, #ws, "worker " .. w)
    for i = 1, #ws do assert.equal(i, ws[i], "worker " .. w .. " line " .. i) end
  end
end

-- pid of a slot, from the operator itself (`transom chaos RUN status`)
local function pid_of(run, slot)
  for _ = 1, N(100) do
    local out = sh(BIN .. " chaos " .. run .. " status")
    local pid = tonumber(out:match("replica " .. slot .. ": running pid (%d+)"))
    if pid and pid > 0 then return pid end
    sleep(0.05)
  end
  error("no running replica " .. slot)
end

-- waits (bounded) until the run's leader reported step >= n
local function wait_step(run, n)
  for _ = 1, N(400) do
    local by = steps_by_worker(run)
    for _, steps in pairs(by) do
      if steps[#steps] and steps[#steps] >= n then return true end
    end
    sleep(0.05)
  end
  return false
end

-- A 2-replica job in tmp/NAME, `steps` long at `step_ms` a step, its
-- operator stopped (SIGSTOP) once a worker is at step 20. Returns the
-- run directory, the operator's pid and exit-status function, and the size
-- of events.jsonl at the stop; its output goes to tmp/NAME.log.
local function stopped_operator(name, steps, step_ms)
  local run, log = tmp .. "/" .. name, tmp .. "/" .. name .. ".log"
  local op, op_rc = spawn_rc("env TRANSOM_TEST_STEP_MS=" .. step_ms .. " " .. job(run, "--replicas 2 --set max_steps=" ..
    steps .. " --set log_interval=600"), log)
  assert.is_true(wait_step(run, 20), read(log))
  os.execute("kill -STOP " .. op)
  return run, op, op_rc, #events(run)
end

local function survivors_never_go_back(run, killed)
  for w, steps in pairs(steps_by_worker(run)) do
    if not killed[w] then
      for i = 2, #steps do
        assert(steps[i] > steps[i - 1], string.format("worker %d went from step %d back to %d", w, steps[i - 1], steps[i]))
      end
    end
  end
end

-- waits (bounded: 30 s, scaled) until the run's events hold `text`
local function wait_event(run, text)
  for _ = 1, N(600) do
    if events(run):find(text, 1, true) then return true end
    sleep(0.05)
  end
  return false
end

-- waits (bounded: 30 s, scaled) until the file at path matches the Lua pattern
local function wait_log(path, pattern)
  for _ = 1, N(600) do
    if (read(path) or ""):find(pattern) then return true end
    sleep(0.05)
  end
  return false
end

-- the slots in the ring as of the last membership event: "[0,1,2]"
local function members_now(run)
  local members
  for m in events(run):gmatch("members (%[[%d,]*%])") do members = m end
  return members
end

-- SIGTERM to an operator whose slots are all in: it stops them and exits 0
local function stop_all_in(op, exit_status)
  os.execute("kill -TERM " .. op)
  assert.is_true(wait_exit(op, 180))
  for _ = 1, N(200) do
    if exit_status() ~= nil then break end
    sleep(0.05)
  end
  assert.equal(0, exit_status())
end

local function assert_agree(run, out, steps)
  assert.matches("replicas_agree", events(run), 1, true)
  assert.matches('3 replicas finished with parameter crc32c', events(run), 1, true)
  assert.matches("finished at step " .. (steps or STEPS), out, 1, true)
end

local baseline_val
local function baseline()
  if baseline_val then return baseline_val end
  local run = tmp .. "/clean"
  local out, rc = sh(job(run))
  assert.equal(0, rc, out)
  assert_agree(run, out)
  -- a clean run raises no failure
  assert.not_matches("replica_failed", events(run))
  baseline_val = assert(final_val(run), "no val loss in the clean run")
  return baseline_val
end

describe("operator (3 replicas)", function()
  after_each(function() S.cleanup() end) -- a failed test leaves no process behind
  it("kill -9 of one worker from outside: every step done, replacement joins, replicas agree", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local clean = baseline()
    local run = tmp .. "/kill1"
    local op = spawn(job(run), tmp .. "/kill1.log")
    math.randomseed(os.time())
    local at = math.random(40, 200)
    assert.is_true(wait_step(run, at))
    local pid = pid_of(run, 1)
    assert.is_true(os.execute("kill -9 " .. pid))
    assert.is_true(wait_exit(op, 120), "the operator did not finish")
    local out = read(tmp .. "/kill1.log")
    assert_agree(run, out)
    local ev = events(run)
    assert.matches('"worker":1,"kind":"replica_failed","detail":"replica 1 killed (signal 9)', ev, 1, true)
    assert.matches('replica 1 ready at step %d+ %(join', ev)
    survivors_never_go_back(run, { [1] = true })
    local val = assert(final_val(run))
    assert.is_true(math.abs(val - clean) / clean < 0.02,
      string.format("val loss %.4f vs fault-free %.4f (killed near step %d)", val, clean, at))
  end)

  -- Both replacements catch up from the survivor, which serves one joiner
  -- at a time: each joiner pauses 11 s after its snapshot, longer than a
  -- joiner waits for the donor's challenge (10 s), so the second one gets
  -- in on its first try only if the donor challenges it while the first
  -- one's session runs and keeps it queued (not if it sits unanswered).
  -- min_replicas = 3: the survivor waits for both, so the first joiner,
  -- caught up and in the ring, waits for the second; its session must make
  -- way for the queued one at once (not hold the donor for its 120 s idle
  -- limit): it is parked.
  it("two workers killed at once with min_replicas = 3: the survivor waits, both are replaced, each on its first try", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/kill2"
    local op, exit_status = spawn_rc("env TRANSOM_TEST_CATCHUP_DELAY_MS=11000 " ..
      job(run, "--set max_steps=1000000 --set min_replicas=3"), tmp .. "/kill2.log")
    assert.is_true(wait_step(run, 80))
    local p1, p2 = pid_of(run, 1), pid_of(run, 2)
    os.execute("kill -9 " .. p1 .. " " .. p2)
    local function all_in()
      local ev = events(run)
      return members_now(run) == "[0,1,2]" and ev:find("replica 1 ready at step %d+ %(join") and
        ev:find("replica 2 ready at step %d+ %(join")
    end
    local ok = false
    for _ = 1, N(1800) do
      ok = all_in()
      if ok then break end
      sleep(0.05)
    end
    assert.is_truthy(ok, "the two replacements never both got in: " .. events(run))
    stop_all_in(op, exit_status)
    local ev = events(run)
    assert.matches("3 replicas finished with parameter crc32c", ev, 1, true)
    assert.matches("replica 1 killed", ev, 1, true)
    assert.matches("replica 2 killed", ev, 1, true)
    for slot = 1, 2 do
      local joins = select(2, ev:gsub("replica " .. slot .. " started %(pid %d+, join%)", ""))
      assert.equal(1, joins, "slot " .. slot .. " was started " .. joins .. " times to join: " .. ev)
    end
    assert.not_matches("replica_error", ev, 1, true)
    -- the first joiner's session made way for the second
    assert.matches("another waits: it is parked", read(run .. "/worker-0.log") or "", 1, true)
    survivors_never_go_back(run, { [1] = true, [2] = true })
  end)

  -- Slots 1 and 2 lost in collective 60 with slot 0 holding its full
  -- result: the FTAR hook stops slot 1 (SIGSTOP) once it has sent and
  -- received all its data, before its commit tokens, so the others get all
  -- theirs and wait for tokens that never come, until the stall deadline
  -- (or slot 1's eviction) aborts them holding the full result, which
  -- slot 0's log says; then slots 1 and 2 are killed (kill -9). (Killed at
  -- the hook instead, slot 1 let slot 0 see the abort before its last frame
  -- came, now and then.) A replacement, which inherits the hook, is spared
  -- (_ONCE). env: more of the operator's environment. The operator's pid
  -- and its exit-status reader.
  local function lose_two_holding(run, env, extra, log)
    local once = run .. "-once"
    assert(os.execute("mkdir -p " .. once))
    local op, exit_status = spawn_rc("env TRANSOM_TEST_FTAR_FAULT=stop:60:0:1 TRANSOM_TEST_FTAR_FAULT_ONCE=" .. once .. " " ..
      env .. " " .. job(run, extra .. " --set min_replicas=3"), log)
    local p1, p2 = pid_of(run, 1), pid_of(run, 2)
    assert(wait_log(run .. "/worker-0.log", "seq 60 aborted [^\n]*; holding the full result"),
      "slot 0 never held collective 60's full result: " .. (read(run .. "/worker-0.log") or ""))
    os.execute("kill -9 " .. p1 .. " " .. p2)
    return op, exit_status
  end

  -- The same two losses where the survivor holds the full result of the
  -- collective they died in (lose_two_holding). Both replacements catch up from
  -- slot 0 to step 59; when the group is whole again, slot 0 commits step
  -- 60 from the result it held, so each joiner's first collective finds
  -- the group a step ahead (FTAR_ESEQ) and replays step 60 from the donor:
  -- the first over the connection it was parked with. Before, the first
  -- joiner's session had ended (it made way for the second), its replay
  -- failed with "donor: no reply" and the job stalled (seen in CI).
  it("two workers lost with min_replicas = 3, the survivor holding their last step's result: both joiners replay it from the donor", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local steps = 100
    local clean_out, clean_rc = sh(job(tmp .. "/kill2full-clean", "--set max_steps=" .. steps .. " --set min_replicas=3"))
    assert.equal(0, clean_rc, clean_out)
    local clean_crc = events(tmp .. "/kill2full-clean"):match("parameter crc32c (%x+)")
    local run = tmp .. "/kill2full"
    local op, exit_status = lose_two_holding(run, "", "--set max_steps=" .. steps, tmp .. "/kill2full.log")
    assert.is_true(wait_exit(op, 180))
    assert.equal(0, exit_status(), read(tmp .. "/kill2full.log"))
    local ev, w0 = events(run), read(run .. "/worker-0.log") or ""
    assert.matches("holding the full result", w0, 1, true) -- the case itself: else the hook's frame missed
    assert.matches("another waits: it is parked", w0, 1, true)
    for slot = 1, 2 do
      assert.matches("replica " .. slot .. " killed", ev, 1, true)
      local joins = select(2, ev:gsub("replica " .. slot .. " started %(pid %d+, join%)", ""))
      assert.equal(1, joins, "slot " .. slot .. " was started " .. joins .. " times to join: " .. ev)
      assert.matches("the group was at step 61: replayed 1 step(s) from the donor", read(run .. "/worker-" .. slot .. ".log")
        or "", 1, true)
    end
    assert.not_matches("replica_error", ev, 1, true)
    -- nothing lost: the parameters a fault-free run ends with
    assert.equal(clean_crc, ev:match("3 replicas finished with parameter crc32c (%x+)"), ev)
  end)

  -- SIGTERM to the job's operator (its output in run.log): it exits 0 and
  -- gave up on no replica (stop_timeout). Its output and events.
  local function sigterm_clean(op, exit_status, run)
    os.execute("kill -TERM " .. op)
    assert.is_true(wait_exit(op, 180))
    local out = read(run .. ".log") or ""
    assert.equal(0, exit_status(), out)
    local ev = events(run)
    assert.not_matches("stop_timeout", ev, 1, true)
    return out, ev
  end

  -- SIGTERM while the survivors wait below min_replicas (a policy that
  -- does not replace: the pause lasts): their pending step can never
  -- finish. Each winds its FTAR member down: the coordinator decides on
  -- the collective without quorum, nothing more runs, the loop stops at
  -- the last boundary, the lowest live slot checkpoints it and saves the
  -- weights, and the operator exits 0 at once. Before, the stop waited for
  -- that step until the operator killed the replicas 60 s later, with no
  -- final checkpoint. Returns the step the survivors stopped at and the
  -- two survivors' logs. fault: where slot 2 goes, through the FTAR test
  -- hook; "stop:..." stops it before its commit tokens (the others hold
  -- the full result) and it is killed then; CALL_OFF kills it at its first
  -- data frame of step 40's all-reduce, so no survivor can hold the full
  -- result and the step is called off. (A kill -9 from outside at a
  -- random moment, as before, now and then landed between the ring's data
  -- and its commit tokens: the step was committed instead, and the
  -- call-off the cases look for never came; CI saw it once.)
  local CALL_OFF = "TRANSOM_TEST_FTAR_FAULT=kill:40:1:2"
  local function stop_while_paused(name, fault, env)
    local pol, run = tmp .. "/" .. name .. "-policies", tmp .. "/" .. name
    assert(os.execute("mkdir -p " .. pol .. " && cp " .. ROOT .. "/lua/policies/*.lua " .. pol))
    write(pol .. "/restart.lua", "local M = {}\n" ..
      "function M.on_failure(ev) return 'none' end\n" ..
      "function M.on_all_dead(ev) return 'stop' end\n" ..
      "return M\n")
    local op, exit_status = spawn_rc("env " .. (fault or "") .. " " .. (env or "") .. " " ..
      job(run, "--set max_steps=1000000 --set min_replicas=3 --set policies=" .. pol), run .. ".log")
    local p2 = pid_of(run, 2)
    if fault ~= CALL_OFF then -- it stops slot 2 before its commit tokens: the others abort holding the full result
      for w = 0, 1 do
        assert(wait_log(run .. "/worker-" .. w .. ".log", "aborted [^\n]*; holding the full result"),
          "slot " .. w .. " never held the full result: " .. (read(run .. "/worker-" .. w .. ".log") or ""))
      end
      os.execute("kill -9 " .. p2)
    end
    assert(wait_event(run, '"kind":"paused"'), "no pause below min_replicas: " .. events(run))
    sleep(0.5) -- the survivors wait in their pending step's all-reduce
    local out, ev = sigterm_clean(op, exit_status, run)
    assert.matches("the replicas wait below min_replicas: they call their pending step off", ev, 1, true)
    -- the step they stopped at, checkpointed by slot 0 as the job stopped
    local at = tonumber(out:match("stopped at step (%d+) %(checkpointed%)"))
    assert(at, out)
    assert.matches('"step":' .. at .. ',"worker":0,"kind":"checkpoint","detail":"committed', ev, 1, true)
    -- both survivors stopped on the same parameters
    assert.matches("2 replicas finished with parameter crc32c", ev, 1, true)
    return at, read(run .. "/worker-0.log") or "", read(run .. "/worker-1.log") or ""
  end

  it("SIGTERM while paused below min_replicas: the step in flight is called off, the last one checkpointed, exit 0", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local at, w0, w1 = stop_while_paused("pausestop", CALL_OFF)
    assert.equal(39, at)
    assert.matches("stopped at step " .. at .. ": step " .. (at + 1) ..
      " could not finish below min_replicas; this replica checkpoints it", w0, 1, true)
    assert.matches("stopped at step " .. at .. ": step " .. (at + 1) .. " could not finish below min_replicas\n", w1, 1, true)
  end)

  -- The same where the operator's STOP never reaches slot 1 (a test hook
  -- drops it): slot 0's wind-down goes through the FTAR coordinator to
  -- slot 1, which stops on the same step at once, without checkpointing.
  -- Before, slot 0 waited for slot 1 in the coordinator's decision, and the
  -- operator killed both after 60 s (stop_timeout).
  it("SIGTERM while paused, one survivor's STOP lost: the group's wind-down stops it on the same step", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local at, w0, w1 = stop_while_paused("pauselost", CALL_OFF, "TRANSOM_TEST_LOSE_STOP=1")
    assert.equal(39, at)
    assert.matches("the operator's STOP dropped (test hook)", w1, 1, true)
    assert.matches("stopped at step " .. at .. ": step " .. (at + 1) ..
      " could not finish below min_replicas; this replica checkpoints it", w0, 1, true)
    assert.matches("stopped at step " .. at .. ": step " .. (at + 1) ..
      " could not finish below min_replicas (the group wound down: the job stops)\n", w1, 1, true)
  end)

  -- The same where the lead's STOP comes after the wind-down: slot 0 (the
  -- lowest live slot, which checkpoints) takes its STOP only once slot 1's
  -- wind-down has called its step off (a test hook holds it until then).
  -- It waits a moment for its STOP before it stops, learns from it that it
  -- is the lead and checkpoints the step; stopping at once, it would not
  -- know, and nobody would checkpoint the job's last step.
  it("SIGTERM while paused, the lead's STOP after the wind-down: it still checkpoints the step", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local at, w0 = stop_while_paused("pauselate", CALL_OFF, "TRANSOM_TEST_LATE_STOP=0")
    assert.equal(39, at)
    assert.matches("the operator's STOP held until the group winds down (test hook)", w0, 1, true)
    assert.matches("stopped at step " .. at .. ": step " .. (at + 1) ..
      " could not finish below min_replicas; this replica checkpoints it", w0, 1, true)
  end)

  -- The same with the survivors holding the full result of the step their
  -- peer died in (slot 2 stopped by the FTAR hook before its commit tokens,
  -- the others aborted holding the full result, then slot 2 killed):
  -- winding down, they take the coordinator's COMMIT of it, and both stop
  -- on that step (one that returned it and one that did not would
  -- otherwise stop a step apart).
  it("SIGTERM while paused, the survivors holding their step's full result: it is committed, both stop on it", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local at, w0, w1 = stop_while_paused("pausefull", "TRANSOM_TEST_FTAR_FAULT=stop:40:0:2")
    for _, log in ipairs({ w0, w1 }) do assert.matches("seq 40 aborted in epoch %d+ %b(); holding the full result", log) end
    assert.equal(40, at)
  end)

  -- SIGTERM after two losses, the survivor holding the full result of the
  -- step its peers died in, one replacement in the ring (fresh: a step
  -- behind the survivor's commit) and the other still catching up. Winding
  -- down, the survivor commits the step; the joiner in the ring finds the
  -- group a step ahead, replays it from its donor and stops on it too; the
  -- one catching up is stopped with the job. The survivor checkpoints
  -- (the joiner has trained no step yet), the two agree, exit 0.
  it("SIGTERM below min_replicas with a joiner in the ring and the survivor holding the step: both stop on it", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/pausejoin"
    local op, exit_status = lose_two_holding(run, "TRANSOM_TEST_CATCHUP_DELAY_MS=" .. math.floor(T(4000)),
      "--set max_steps=1000000", run .. ".log")
    local first
    for _ = 1, N(600) do
      first = tonumber(events(run):match("replica (%d) ready at step %d+ %(join"))
      if first then break end
      sleep(0.05)
    end
    assert(first, "no replacement got in: " .. events(run))
    local out, ev = sigterm_clean(op, exit_status, run)
    assert.matches("replica " .. (3 - first) .. " was catching up: stopped with the job", ev, 1, true)
    local wj = read(run .. "/worker-" .. first .. ".log") or ""
    assert.matches("the group was at step 61: replayed 1 step(s) from the donor", wj, 1, true)
    assert.matches('"step":60,"worker":0,"kind":"checkpoint","detail":"committed', ev, 1, true)
    assert.matches("stopped at step 60 (checkpointed)", out, 1, true)
    assert.matches("2 replicas finished with parameter crc32c", ev, 1, true)
  end)

  -- Workers started by an external launcher (TRANSOM_EXTERNAL_WORKERS,
  -- torchrun's RANK / MASTER_ADDR / MASTER_PORT) a moment apart: the first
  -- is ready and waits (up to 30 s) for the others to start together; the
  -- second, which said HELLO after that, is told to join from the first.
  -- Its snapshot is served while the first waits, so it joins at step 0
  -- and both start together. Before, the first served snapshots only from
  -- its training loop: the second waited for one until the first gave up
  -- 30 s later and trained alone (agents_spec's "no progress" in CI: its
  -- launcher's second worker came late on a loaded machine).
  it("external workers a moment apart: the later one joins at step 0 while the first waits for it", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/extlate"
    local op, exit_status = spawn_rc("env TRANSOM_EXTERNAL_WORKERS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=0 " ..
      job(run, "--set max_steps=60"):gsub("%-%-replicas 3", "--replicas 2"), run .. ".log")
    local port
    for _ = 1, N(300) do
      port = (read(run .. "/operator.addr") or ""):match("^127%.0%.0%.1:(%d+)")
      if port then break end
      sleep(0.05)
    end
    assert(port, "no RUN/operator.addr: " .. (read(run .. ".log") or ""))
    local function worker(r)
      S.spawn("env RANK=" .. r .. " MASTER_ADDR=127.0.0.1 MASTER_PORT=" .. port .. " TRANSOM_SECRET_FILE=" .. run ..
        "/secret " .. BIN .. " worker", run .. "-w" .. r .. ".log")
    end
    worker(0)
    assert(wait_event(run, "replica 0 ready at step 0"), "replica 0 never ready: " .. events(run))
    worker(1)
    assert.is_true(wait_exit(op, 120))
    assert.equal(0, exit_status(), read(run .. ".log"))
    local ev = events(run)
    assert.matches("replica 1 ready at step 0 (join", ev, 1, true)
    assert.matches("2 replicas finished with parameter crc32c", ev, 1, true)
  end)

  it("the donor killed during a catch-up: the joiner gets another donor", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/donor"
    -- the joiner pauses 1.5 s between its first snapshot and the replay: the
    -- window to kill its donor. The group outruns the donor's 64-step history
    -- in that pause, so every joiner here also takes the path that fetches a
    -- newer snapshot. The job runs until slot 1 is back (then SIGTERM): how
    -- fast the steps go does not decide whether the switch is seen
    local cmd = job(run, "--set max_steps=1000000")
    local op, exit_status = spawn_rc("env TRANSOM_TEST_CATCHUP_DELAY_MS=" .. math.floor(T(1500)) .. " " .. cmd,
      tmp .. "/donor.log")
    assert.is_true(wait_step(run, 60))
    os.execute("kill -9 " .. pid_of(run, 1))
    local donor
    for _ = 1, N(200) do
      donor = events(run):match("replica 1 catches up from replica (%d+)")
      if donor then break end
      sleep(0.05)
    end
    assert.is_truthy(donor, "no catch-up started")
    os.execute("kill -9 " .. pid_of(run, tonumber(donor)))
    -- slot 1 goes on to catch up from a donor alive after the kill (another
    -- replica, or the killed slot's replacement) and gets in
    local function switched()
      local ev = events(run)
      local killed_at = ev:find("replica " .. donor .. " killed", 1, true)
      if not killed_at then return false end
      local caught, ready
      for pos in ev:gmatch("()replica 1 catches up from replica %d+") do caught = pos end
      for pos in ev:gmatch("()replica 1 ready at step %d+ %(join") do ready = pos end
      return caught and caught > killed_at and ready and ready > caught
    end
    -- and the killed donor's replacement gets in too (it may catch up from
    -- the same donor, before or after slot 1): the job ends with all three
    local function all_in() return members_now(run) == "[0,1,2]" end
    local ok, full = false, false
    for _ = 1, N(1200) do
      ok = ok or switched()
      full = ok and all_in()
      if full then break end
      sleep(0.05)
    end
    assert.is_true(ok, "slot 1 never switched donors: " .. events(run))
    assert.is_true(full, "the three slots were never all in after the switch: " .. events(run))
    stop_all_in(op, exit_status)
    local ev = events(run)
    assert.matches("replicas_agree", ev, 1, true)
    assert.matches("3 replicas finished with parameter crc32c", ev, 1, true)
    assert.matches("replica " .. donor .. " killed", ev, 1, true)
    -- and no joiner gave up because the group outran the donor's history
    assert.not_matches("history starts at step", ev, 1, true)
    local logs = read(run .. "/worker-0.log") .. read(run .. "/worker-1.log") .. read(run .. "/worker-2.log")
    assert.matches("fetching a newer snapshot", logs, 1, true)
  end)

  -- The group outruns a catch-up reply while the donor sends it: its ring
  -- slots must not be overwritten under the send (the joiner would replay
  -- another step's gradient and finish with other parameters). The test
  -- hook holds the donor's first reply after the snapshot until the group
  -- reaches the step that would overwrite its first slot; the donor stops
  -- its history instead and sends the slots intact. The joiner's next
  -- request is answered GONE: it takes a newer snapshot or, had it entered
  -- the ring already, exits (its LEAVE calls off the collective the group
  -- ran for it) and is replaced; slot 1 gets in. (Before: the slot was
  -- overwritten and sent, and the replicas finished with different
  -- parameters.)
  it("the group outruns a catch-up reply in flight: the donor's slots stay intact, the replicas agree", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/outrun"
    -- it runs until slot 1 is in for good (then SIGTERM): how fast the steps go decides nothing
    local op, exit_status = spawn_rc("env TRANSOM_TEST_DONOR_OUTRUN=1 " .. job(run, "--set max_steps=1000000"),
      tmp .. "/outrun.log")
    assert.is_true(wait_step(run, 40))
    os.execute("kill -9 " .. pid_of(run, 1))
    -- slot 1 in: a join, no failure or new start of slot 1 since, and 20 steps trained
    local function in_for_good()
      local ev = events(run)
      local pos, at
      for p, step in ev:gmatch('()"worker":1,"kind":"replica_ready","detail":"replica 1 ready at step (%d+) %(join') do
        pos, at = p, tonumber(step)
      end
      if not at then return false end
      local since = ev:sub(pos)
      if since:find('"worker":1,"kind":"replica_failed"', 1, true) or since:find('"worker":1,"kind":"spawn"', 1, true) then
        return false
      end
      local mine = steps_by_worker(run)[1] or {}
      return (mine[#mine] or 0) >= at + 20
    end
    assert.is_truthy(S.wait_for(in_for_good, T(120)), "slot 1 never got in: " .. events(run))
    os.execute("kill -TERM " .. op)
    assert.is_true(wait_exit(op, 180), "the operator did not finish")
    local rc = S.wait_rc(exit_status, T(30))
    assert.equal(0, rc, read(tmp .. "/outrun.log"))
    local ev = events(run)
    assert.matches("replicas_agree", ev, 1, true)
    assert.matches("3 replicas finished with parameter crc32c", ev, 1, true)
    local logs = (read(run .. "/worker-0.log") or "") .. (read(run .. "/worker-2.log") or "")
    assert.matches("while a catch-up reply sends it: history stopped", logs, 1, true)
  end)

  it("all workers killed: the job restarts from the newest checkpoint and finishes", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/killall"
    local op = spawn(job(run), tmp .. "/killall.log")
    assert.is_true(wait_step(run, 90))
    os.execute("kill -9 " .. pid_of(run, 0) .. " " .. pid_of(run, 1) .. " " .. pid_of(run, 2))
    assert.is_true(wait_exit(op, 180))
    local out = read(tmp .. "/killall.log")
    assert_agree(run, out)
    local ev = events(run)
    assert.matches("all_replicas_dead", ev, 1, true)
    assert.matches("%(resume, state in", ev)
  end)

  it("--resume over a checkpoint store it cannot read stops, naming it, and keeps metrics.jsonl", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/unreadable"
    local out, rc = sh(job(run, "--set max_steps=40"))
    assert.equal(0, rc, out)
    local metrics = read(run .. "/metrics.jsonl")
    assert.is_truthy(metrics and #metrics > 0)
    -- LMDB's meta pages overwritten: the store is there, and refused
    local f = assert(io.open(run .. "/ckpt/data.mdb", "r+b"))
    f:write(string.rep("\0", 8192))
    f:close()
    out, rc = sh(BIN .. " run --resume " .. run)
    assert.are_not.equal(0, rc, out)
    assert.matches("the checkpoint store " .. run .. "/ckpt", out, 1, true)
    -- not taken for a run killed before its first checkpoint: nothing started over, nothing truncated
    assert.is_nil(out:find("starting from step 0", 1, true), out)
    assert.equal(metrics, read(run .. "/metrics.jsonl"))
  end)

  it("SIGTERM to the operator checkpoints and exits 0; --resume finishes the job", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/term"
    local op, status = spawn_rc(job(run), tmp .. "/term.log")
    assert.is_true(wait_step(run, 100))
    os.execute("kill -TERM " .. op)
    assert.is_true(wait_exit(op, 60))
    for _ = 1, N(100) do
      if status() then break end
      sleep(0.05)
    end
    assert.equal(0, status())
    local out = read(tmp .. "/term.log")
    local stopped = tonumber(out:match("stopped at step (%d+)"))
    assert.is_truthy(stopped, out)
    assert.is_true(stopped < STEPS)
    local ls = sh(BIN .. " ckpt ls " .. run)
    assert.matches("\n%s*" .. stopped .. "%s", ls)
    -- the leader saved the weights of the step it stopped at, as a lone run
    -- does (they were the step-0 ones run.c writes at the start)
    assert.equal(stopped, S.weights_step(run .. "/model.safetensors"))
    local sout, src = sh(BIN .. " sample " .. run .. " --tokens 20")
    assert.equal(0, src, sout)
    local rout, rc = sh(BIN .. " run --resume " .. run)
    assert.equal(0, rc, rout)
    assert_agree(run, rout)
    assert.equal(STEPS, S.weights_step(run .. "/model.safetensors")) -- the end saves too
  end)

  -- step records of worker w: step -> {replicas, redos, checksum}
  local function records(run, w)
    local by = {}
    for line in (read(run .. "/metrics.jsonl") or ""):gmatch("[^\n]+") do
      local step, wk, reps, redos = line:match('^{"step":(%d+),"worker":(%d+),"replicas":(%d+),"epoch":%d+,"redos":(%d+)')
      if step and tonumber(wk) == w then
        by[tonumber(step)] = { replicas = tonumber(reps), redos = tonumber(redos),
                               checksum = line:match('"checksum":"(%x+)"'), comm = tonumber(line:match('"comm_s":([%d%.eE%-]+)')),
                               exposed = tonumber(line:match('"allreduce_s":([%d%.eE%-]+)')) }
      end
    end
    return by
  end

  it("gradients reduced in buckets while backward runs: the bits of one all-reduce after backward (2 replicas)", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local sums = {}
    for _, b in ipairs({ "0", "0.02" }) do
      local run = tmp .. "/bucket" .. b
      local cmd = job(run, "--set bucket_mb=" .. b .. " --set max_steps=60 --set checksum_interval=20")
      local out, rc = sh((cmd:gsub("%-%-replicas 3", "--replicas 2")))
      assert.equal(0, rc, out)
      local r = records(run, 0)
      sums[b] = { r[20].checksum, r[40].checksum, r[60].checksum }
      for s = 2, 60 do -- what the step waited for is part of what the collective took
        assert.is_true(r[s].exposed <= r[s].comm + 1e-6, string.format("step %d: exposed %g > comm %g", s, r[s].exposed, r[s].comm))
      end
    end
    assert.is_truthy(sums["0"][3])
    assert.same(sums["0"], sums["0.02"])
  end)

  it("a replica killed mid-step with gradient buckets in flight: the survivors redo the step's buckets", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/bucketkill"
    -- replica 1 kills itself once it received 2 data frames of step 30's
    -- all-reduce: the first buckets are on the wire while backward still
    -- writes the others
    local out, rc = sh("TRANSOM_TEST_FTAR_FAULT=kill:30:2:1 " .. job(run, "--set bucket_mb=0.02"))
    assert.equal(0, rc, out)
    assert_agree(run, out)
    assert.matches('"worker":1,"kind":"replica_failed","detail":"replica 1 killed (signal 9)', events(run), 1, true)
    local redone = 0
    for _, w in ipairs({ 0, 2 }) do
      local s30 = records(run, w)[30]
      assert.is_truthy(s30, "survivor " .. w .. " has no record of step 30")
      assert.equal(2, s30.replicas)
      redone = redone + (s30.redos >= 1 and 1 or 0)
    end
    assert.is_true(redone >= 1, "no survivor redid step 30")
    survivors_never_go_back(run, { [1] = true })
  end)

  it("a replica whose step fails with buckets in flight leaves FTAR at once: the survivors go on during its error path", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/failleave"
    -- replica 2's step 40 fails once its all-reduce started (chaos fail);
    -- then it spends 8 s in its error path before it reports FAIL and exits.
    -- deadline 30 s: a survivor waiting for it would not give up on its own
    -- before that, so only the loop's failed hook (ftar_member_leave) lets
    -- the survivors redo step 40 while the failed worker is still there
    local out, rc = sh(chaos_job(run, '{ at_step = 40, replica = 2, fault = "fail", ms = 8000 }',
      "--set bucket_mb=0.02 --set deadline=30"))
    assert.equal(0, rc, out)
    local ev = events(run)
    -- the survivors may well finish every step during those 8 s: then the
    -- failed replica is not replaced and 2 replicas agree at the end
    assert.matches("finished at step " .. STEPS, out, 1, true)
    assert.matches('"replicas_agree","detail":"[23] replicas finished with parameter crc32c', ev)
    local failed_at = ev:find('"worker":2,"kind":"replica_error"', 1, true) -- its FAIL, after the error path
    assert.is_truthy(failed_at, ev)
    assert.matches("chaos: step 40 failed after its all-reduce started", ev:sub(failed_at, failed_at + 300), 1, true)
    assert.matches('"worker":2,"kind":"replica_failed"', ev, failed_at, true)
    -- slot 2 left the FTAR membership before the operator heard of its failure
    local left_at
    for pos, kind in ev:gmatch('()"kind":"membership","detail":"epoch %d+: (%a+) slot 2;') do
      if kind ~= "join" then left_at = pos break end
    end
    assert.is_truthy(left_at, "slot 2 never left the membership: " .. ev)
    assert.is_true(left_at < failed_at, "slot 2 left the membership only after its failure was reported: " .. ev)
    -- and the survivors redid step 40 over 2 replicas meanwhile
    for _, w in ipairs({ 0, 1 }) do
      local s40 = records(run, w)[40]
      assert.is_truthy(s40, "survivor " .. w .. " has no record of step 40")
      assert.equal(2, s40.replicas)
    end
    survivors_never_go_back(run, { [2] = true })
  end)

  it("a failed replica's error path does not pass for a wait in the all-reduce: no healthy replica is evicted as hung", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/failphase"
    -- replica 2's step 10 fails; it spends 5 s in its error path. Every step
    -- computes 400 ms (TRANSOM_TEST_STEP_MS), longer than hang_seconds: a
    -- replica heartbeating "allreduce" past the deadline meanwhile would make
    -- the operator evict the healthy ones as hung (find_hung). The failed
    -- one waits for nobody: its heartbeats must say so.
    -- (all three stretched alike by TRANSOM_TIME_SCALE: the survivors' skew
    -- on a slow build must stay below hang_seconds)
    local cmd = chaos_job(run, '{ at_step = 10, replica = 2, fault = "fail", ms = ' .. math.floor(T(5000)) .. ' }',
      "--set bucket_mb=0.02 --set max_steps=30 --set warmup_steps=3 --set hang_seconds=" .. T(0.3) ..
      " --set deadline=" .. T(1))
    local out, rc = sh("env TRANSOM_TEST_STEP_MS=" .. math.floor(T(400)) .. " " .. cmd)
    assert.equal(0, rc, out)
    local ev = events(run)
    assert.matches('"worker":2,"kind":"replica_error","detail":"chaos: step 10 failed', ev, 1, true)
    assert.is_nil(ev:find('"kind":"evict"', 1, true), "a replica was evicted: " .. ev)
    assert.matches("finished at step 30", out, 1, true)
  end)

  it("`transom chaos RUN fail 1` against a live job: the step fails, the worker reports it and exits, a replacement joins", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/chaosfail"
    local op = spawn(job(run, "--set bucket_mb=0.02"), tmp .. "/chaosfail.log", "TRANSOM_TEST_STEP_MS=" .. math.floor(T(20)))
    assert.is_true(wait_step(run, 40), "no step 40")
    local out, rc = sh(BIN .. " chaos " .. run .. " fail 1")
    assert.equal(0, rc, out)
    assert.equal("ok\n", out)
    assert.is_true(wait_exit(op, 180), "the operator did not finish")
    assert_agree(run, read(tmp .. "/chaosfail.log"))
    local ev = events(run)
    assert.matches('"worker":1,"kind":"chaos","detail":"fail replica 1 (from transom chaos)"', ev, 1, true)
    local step = tonumber(ev:match('"worker":1,"kind":"replica_error","detail":"chaos: step (%d+) failed after its all%-reduce started"'))
    assert.is_truthy(step, ev)
    assert.matches('"worker":1,"kind":"replica_failed","detail":"replica 1 exited %(exit code 1%)', ev)
    assert.matches("replica 1 ready at step %d+ %(join", ev)
    -- the survivors averaged the failed step over 2 replicas
    for _, w in ipairs({ 0, 2 }) do
      local r = records(run, w)[step]
      assert.is_truthy(r, "survivor " .. w .. " has no record of step " .. step)
      assert.equal(2, r.replicas)
    end
    survivors_never_go_back(run, { [1] = true })
  end)

  it("the job's chaos list kills a replica at its step; the job finishes", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/chaos"
    local out, rc = sh(chaos_job(run, '{ at_step = 50, replica = 2, fault = "kill" }'))
    assert.equal(0, rc, out)
    assert_agree(run, out)
    local step = tonumber(events(run):match('"step":(%d+),"worker":2,"kind":"replica_failed"'))
    assert.is_truthy(step)
    assert.is_true(step >= 48 and step <= 52, "killed at step " .. tostring(step))
  end)

  it("restart_all (the torchrun baseline) also finishes after a kill", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/rall"
    local op = spawn(job(run, "--set on_failure=restart_all"), tmp .. "/rall.log")
    assert.is_true(wait_step(run, 70))
    os.execute("kill -9 " .. pid_of(run, 1))
    assert.is_true(wait_exit(op, 180))
    local out = read(tmp .. "/rall.log")
    assert_agree(run, out)
    assert.matches("restart_all", events(run), 1, true)
  end)
  it("checkpoint.every_seconds also times the replicas' checkpoints (one loop for 1 and N)", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/secs"
    -- by time only, every replica slowed alike (one alone is a straggler the
    -- detector evicts) to about 50 ms a step from step 5 (the chaos list
    -- reaches a worker after it started), so the run lasts seconds
    local jobfile = tmp .. "/secs-job.lua"
    write(jobfile, 'return { data = "' .. data .. '", chaos = { { at_step = 5, replica = 0, fault = "slow", ms = 50 }, '
      .. '{ at_step = 5, replica = 1, fault = "slow", ms = 50 }, { at_step = 5, replica = 2, fault = "slow", ms = 50 } } }\n')
    local cmd = job(run, "--set checkpoint.every_steps=0 --set checkpoint.every_seconds=0.5 --set max_steps=120")
    local out, rc = sh((cmd:gsub(ROOT .. "/examples/shakespeare.lua", jobfile, 1)))
    assert.equal(0, rc, out)
    local ev = events(run)
    local first_t = tonumber(ev:match('"time":([%d%.]+)'))
    local steps, last_t = {}, nil
    for line in ev:gmatch("[^\n]+") do
      if line:find('"kind":"checkpoint"', 1, true) then
        table.insert(steps, tonumber(line:match('"step":(%d+)')))
        last_t = tonumber(line:match('"time":([%d%.]+)'))
      end
    end
    assert.is_true(last_t - first_t >= 3, "the run lasted " .. (last_t - first_t) .. " s: too short to test")
    assert.is_nil(ev:find('"kind":"replica_failed"', 1, true), ev)
    -- by time: several before the end (not multiples of any step count), and the last state
    assert.is_true(#steps >= 3, "checkpoints at steps " .. table.concat(steps, ","))
    assert.equal(120, steps[#steps])
    assert.is_true(steps[1] < 120)
  end)
  it("the operator killed before its first checkpoint: --resume starts from step 0, once", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/early"
    local op = spawn(job(run, "--set checkpoint.every_steps=1000 --set operator_grace=1"), tmp .. "/early.log")
    assert.is_true(wait_step(run, 30))
    os.execute("kill -9 " .. op)
    assert.is_true(wait_exit(op, 10))
    -- its workers see the connection drop and exit after operator_grace (a bounded wait)
    for _ = 1, N(200) do
      if not sh("pgrep -f 'transom worker' | head -1"):match("%d") then break end
      sleep(0.05)
    end
    local out, rc = sh(BIN .. " run --resume " .. run)
    assert.equal(0, rc, out)
    assert.matches("no committed checkpoint in " .. run .. "/ckpt: starting from step 0", out, 1, true)
    assert_agree(run, out)
    local ev = events(run)
    assert.is_nil(ev:find('"kind":"replica_failed"', 1, true), ev)
    -- metrics start over: one step 1 per replica
    local ones = select(2, (read(run .. "/metrics.jsonl") or ""):gsub('{"step":1,', ""))
    assert.equal(3, ones)
  end)

  -- a process that is gone (a zombie whose parent died counts as gone)
  local function gone(pid)
    return not (sh("ps -o stat= -p " .. pid .. " 2>/dev/null || true")):match("^%s*[^Z%s]")
  end

  it("kill -9 of the operator at a random step: --resume adopts the live workers, no step lost", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    for round = 1, 2 do
      local run = tmp .. "/opkill" .. round
      local op = spawn(job(run, "--set operator_grace=30"), tmp .. "/opkill" .. round .. ".log")
      local at = math.random(30, 220)
      assert.is_true(wait_step(run, at))
      local pids = { pid_of(run, 0), pid_of(run, 1), pid_of(run, 2) }
      os.execute("kill -9 " .. op)
      assert.is_true(wait_exit(op, 10))
      sleep(0.2 + math.random() * 1.5)
      local out, rc = sh(BIN .. " run --resume " .. run)
      assert.equal(0, rc, out)
      assert_agree(run, out)
      local ev = events(run)
      local first = assert(ev:find('"kind":"adopted"', 1, true), ev)
      local after = ev:sub(first)
      assert.matches("3 of 3 replicas adopted live", after, 1, true)
      -- no reload, no restart: the same three processes finished the job
      assert.is_nil(after:find('"kind":"resume"', 1, true), after)
      assert.is_nil(after:find('"kind":"replica_failed"', 1, true), after)
      assert.is_nil(after:find('"kind":"spawn"', 1, true), after)
      for _, pid in ipairs(pids) do
        assert.matches("adopted by the operator", read(run .. "/worker-" .. _ - 1 .. ".log") or "", 1, true)
        assert.is_true(gone(pid) or wait_exit(pid, 10))
      end
      -- every step once per worker, in order: no gap, nothing went back
      for w, steps in pairs(steps_by_worker(run)) do
        assert.equal(STEPS, #steps, "worker " .. w)
        for i = 1, #steps do assert.equal(i, steps[i], "worker " .. w .. " line " .. i) end
      end
      S.cleanup()
    end
  end)

  it("kill -9 of the operator between the replicas' last step and their DONE: --resume adopts them and hears it",
    function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/opkill-done"
    local gate = tmp .. "/opkill-done.gate"
    os.remove(gate)
    local op = spawn("env TRANSOM_TEST_DONE_GATE=" .. gate .. " " .. job(run, "--set operator_grace=30"),
      tmp .. "/opkill-done.log")
    local function logs_say(text)
      for w = 0, 2 do
        if not (read(run .. "/worker-" .. w .. ".log") or ""):find(text, 1, true) then return false end
      end
      return true
    end
    -- every replica finished its last step and holds its DONE
    assert.is_true(S.wait_for(function() return logs_say("holding DONE until") end, 120), "no replica finished")
    local pids = { pid_of(run, 0), pid_of(run, 1), pid_of(run, 2) }
    os.execute("kill -9 " .. op)
    assert.is_true(wait_exit(op, 10))
    assert.is_true(S.wait_for(function() return logs_say("lost the operator") end, 30), "no replica saw it go")
    write(gate, "go\n")
    -- each sends its DONE now, with no operator: it must wait for one (before: it exited unheard)
    assert.is_true(S.wait_for(function()
      for w = 0, 2 do
        local said = (read(run .. "/worker-" .. w .. ".log") or ""):find("the last line waits for a restarted one", 1,
          true)
        if not said and alive(pids[w + 1]) then return false end
      end
      return true
    end, 30), "the replicas neither waited nor exited")
    local out, rc = sh(BIN .. " run --resume " .. run)
    assert.equal(0, rc, out)
    assert_agree(run, out)
    local ev = events(run)
    local first = assert(ev:find('"kind":"adopted"', 1, true), ev)
    local after = ev:sub(first)
    assert.matches("3 of 3 replicas adopted live", after, 1, true)
    assert.is_nil(after:find('"kind":"spawn"', 1, true), after) -- the same three processes finished
    assert.is_nil(after:find('"kind":"replica_failed"', 1, true), after)
    for _, pid in ipairs(pids) do assert.is_true(wait_exit(pid, 10)) end
  end)

  it("kill -9 of the operator, never restarted: the workers exit after operator_grace", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/orphans"
    local op = spawn(job(run, "--set operator_grace=2"), tmp .. "/orphans.log")
    assert.is_true(wait_step(run, math.random(20, 120)))
    local pids = { pid_of(run, 0), pid_of(run, 1), pid_of(run, 2) }
    os.execute("kill -9 " .. op)
    local t0 = os.time()
    for _, pid in ipairs(pids) do
      local ok = false
      for _ = 1, N(300) do -- 15 s: the grace, and the next heartbeat round
        if gone(pid) then
          ok = true
          break
        end
        sleep(0.05)
      end
      assert.is_true(ok, "worker " .. pid .. " still runs " .. (os.time() - t0) .. " s after the operator died")
    end
    for k = 0, 2 do
      assert.matches("no operator came back within 2 s", read(run .. "/worker-" .. k .. ".log") or "", 1, true)
    end
  end)

  -- The operator stopped (SIGSTOP: a loop stalled, as by a long REPL
  -- expression) while 2 replicas train to their end and exit (all-reduces
  -- need the coordinator only when the group changes): when it goes on,
  -- each replica's lines (a STEP per step, then DONE: more than libevent
  -- reads in one callback) and its exit are ready at once. The lines are
  -- read and handled before the exit, so the replicas count as finished,
  -- not failed and replaced. (Before: a connection was freed unread when
  -- the exit came first: replica_failed ... exit code 0, and a replacement.)
  it("the operator stalled while the replicas finish: their last lines count before their exits", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/stalled_end"
    local pid, rc_of = spawn_rc(job(run, "--replicas 2 --set max_steps=400 --set log_interval=400"),
      tmp .. "/stalled_end.log")
    -- both replicas train: their first steps reached the operator
    assert.is_truthy(S.wait_for(function()
      local by = steps_by_worker(run)
      return by[0] and by[1] and #by[0] >= 2 and #by[1] >= 2
    end, T(60)), read(tmp .. "/stalled_end.log"))
    os.execute("kill -STOP " .. pid)
    local workers = {}
    for w in sh("pgrep -P " .. pid):gmatch("%d+") do workers[#workers + 1] = w end
    -- they end while the operator cannot reap them: zombies
    local ended = #workers == 2 and S.wait_for(function()
      for _, w in ipairs(workers) do
        if (read("/proc/" .. w .. "/stat") or "1 (x) Z"):match("^%d+ %b() (%a)") ~= "Z" then return false end
      end
      return true
    end, T(120))
    os.execute("kill -CONT " .. pid)
    assert.equal(2, #workers, "worker processes under the operator")
    assert.is_truthy(ended, "the replicas did not end while the operator was stopped")
    local rc = S.wait_rc(rc_of, T(60))
    local ev = events(run)
    assert.equal(0, rc, read(tmp .. "/stalled_end.log"))
    assert.is_nil(ev:find('"kind":"replica_failed"', 1, true), ev)
    assert.equal(2, select(2, ev:gsub('"kind":"spawn"', "")), ev) -- none replaced
    local by = steps_by_worker(run)
    for w = 0, 1 do assert.equal(400, by[w][#by[w]], "replica " .. w .. "'s last step recorded") end
  end)

  -- `transom run --resume RUN` while RUN's operator is alive and answers on
  -- RUN/control.sock: refused, exit 2, naming its pid; the live job goes on
  -- as if nothing happened. (Before: the new operator adopted both live
  -- workers while the old one went on: two operators in one run directory.)
  it("--resume of a run whose operator is alive is refused; the live job goes on unaffected", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run, steps = tmp .. "/inuse", 400
    local op, op_rc = spawn_rc("env TRANSOM_TEST_STEP_MS=10 " .. job(run, "--replicas 2 --set max_steps=" .. steps ..
      " --set log_interval=400"), tmp .. "/inuse.log")
    assert.is_true(wait_step(run, 20), read(tmp .. "/inuse.log"))
    local before, job1 = #events(run), read(run .. "/job.lua")
    local _, rc_of = spawn_rc(BIN .. " run --resume " .. run, tmp .. "/inuse2.log")
    local rc = S.wait_rc(rc_of, T(60))
    local said = read(tmp .. "/inuse2.log") or ""
    assert.equal(2, rc, said)
    assert.matches(run .. " is in use by a live operator (pid " .. op .. "): stop it first (kill -TERM " .. op,
      said, 1, true)
    assert.equal(job1, read(run .. "/job.lua"))
    assert.equal(0, S.wait_rc(op_rc, T(120)), read(tmp .. "/inuse.log"))
    went_on_alone(run, before, steps)
  end)

  -- Two starts into one new run directory at once: an operator (it takes
  -- no lock: a hung one must stay possible to take over) and a lone run.
  -- A start looks for a live job, then claims the directory; the operator
  -- is held between the two (TRANSOM_TEST_START_PAUSE: until a file
  -- exists) while the lone run starts, and let go once the lone start says
  -- it waits at the start gate, naming the operator. The lone start then
  -- finds the operator's run: exit 2, and the operator's job trains alone.
  -- (Before: both found nothing, and both trained in the directory.)
  it("a lone run started while an operator starts in the same directory waits for it and is refused", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run, steps, go = tmp .. "/startrace", 60, tmp .. "/startrace.go"
    local log1, log2 = tmp .. "/startrace.log", tmp .. "/startrace2.log"
    local op, op_rc = spawn_rc("env TRANSOM_TEST_START_PAUSE=" .. go .. " " .. job(run, "--replicas 2 --set max_steps="
      .. steps), log1)
    assert.is_truthy(S.wait_for(function() return (read(log1) or ""):find("start paused", 1, true) end, T(60)),
      read(log1))
    local lone = job(run, "--replicas 1 --set max_steps=" .. steps):gsub("%-%-set deadline=%S+", "")
    local _, rc_of = spawn_rc(lone, log2)
    local waited = S.wait_for(function() return (read(log2) or ""):find("waiting for it", 1, true) end, T(60))
    write(go, "")
    local rc = S.wait_rc(rc_of, T(60))
    local said = read(log2) or ""
    assert.is_truthy(waited, said)
    assert.equal(2, rc, said)
    assert.matches("another transom (pid " .. op .. ") is starting in " .. run .. ": waiting for it", said, 1, true)
    assert.matches("run directory " .. run .. " already holds a run", said, 1, true)
    assert.equal(0, S.wait_rc(op_rc, T(120)), read(log1))
    assert.is_nil(read(run .. "/run.lock"), "a lone run took the directory's lock")
    local by = steps_by_worker(run)
    for w = 0, 1 do
      assert.equal(steps, #by[w], "worker " .. w)
      for i = 1, steps do assert.equal(i, by[w][i], "worker " .. w .. " line " .. i) end
    end
    assert.is_nil(by[2], "a third writer in metrics.jsonl")
  end)

  -- The operator stopped (SIGSTOP: hung, as far as anyone can tell), a
  -- --resume started meanwhile: it adopts the workers. Then the old one runs
  -- again. It finds RUN/operator.addr written by the new one and stands down:
  -- a "superseded" event, exit, nothing spawned, no stop or checkpoint, no
  -- metrics line (the STEP lines its socket still holds are not written: the
  -- workers' steps go on increasing), RUN/control.sock left to the new one.
  -- (Before: it took its workers' hang-ups for failures and started
  -- replacements: two operators, two timelines in one run directory.)
  it("an operator stopped while a --resume took over stands down when it runs again", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local steps = 600
    local run, old, old_rc, before = stopped_operator("superseded", steps, 20)
    local _, new_rc = spawn_rc(BIN .. " run --resume " .. run, tmp .. "/superseded2.log")
    assert.is_truthy(S.wait_for(function() return events(run):find("2 of 2 replicas adopted live", before + 1, true) end,
      T(60)), (read(tmp .. "/superseded2.log") or "") .. events(run):sub(before + 1))
    os.execute("kill -CONT " .. old)
    local rc = S.wait_rc(old_rc, T(60))
    local said = read(tmp .. "/superseded.log") or ""
    assert.equal(1, rc, said)
    assert.matches("superseded by an operator started later", said, 1, true)
    local after = events(run):sub(before + 1)
    assert.matches('"kind":"superseded","detail":"superseded by the operator at 127.0.0.1:', after, 1, true)
    if not new_rc() then -- (the new one still runs, as it should: its control socket is still there)
      assert.matches("replica 0: running", sh(BIN .. " chaos " .. run .. " status"), 1, true)
    end
    assert.equal(0, S.wait_rc(new_rc, T(120)), read(tmp .. "/superseded2.log"))
    after = events(run):sub(before + 1)
    assert.is_nil(after:find('"kind":"spawn"', 1, true), after) -- neither operator started a replica
    assert.is_nil(after:find('"kind":"replica_failed"', 1, true), after)
    assert.matches("2 replicas finished with parameter crc32c", after, 1, true)
    for w, ws in pairs(steps_by_worker(run)) do
      for i = 2, #ws do assert.is_true(ws[i] > ws[i - 1], "worker " .. w .. ": step " .. ws[i - 1] .. " then " .. ws[i]) end
      assert.equal(steps, ws[#ws], "worker " .. w)
    end
  end)

  -- RUN/operator.addr removed under a healthy sole operator (a tmp
  -- cleaner, a scratch purge, a user): it says nothing, and the job trains
  -- on to its end: no "superseded", nothing restarted. (Before: the missing
  -- file counted as a takeover: the operator stood down, exit 1.)
  it("RUN/operator.addr removed under a running operator: it trains on and finishes", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run, steps = tmp .. "/addr_gone", 300
    local op, op_rc = spawn_rc("env TRANSOM_TEST_STEP_MS=10 " .. job(run, "--replicas 2 --set max_steps=" .. steps ..
      " --set log_interval=600"), tmp .. "/addr_gone.log")
    assert.is_true(wait_step(run, 20), read(tmp .. "/addr_gone.log"))
    local addr = read(run .. "/operator.addr") or ""
    assert.matches("^[^\n]+:%d+\n%x+\n$", addr) -- host:port, then the operator's nonce
    os.remove(run .. "/operator.addr")
    assert.equal(0, S.wait_rc(op_rc, T(120)), read(tmp .. "/addr_gone.log"))
    local ev = events(run)
    for _, kind in ipairs({ "superseded", "replica_failed" }) do
      assert.is_nil(ev:find('"kind":"' .. kind .. '"', 1, true), ev)
    end
    assert.equal(2, select(2, ev:gsub('"kind":"spawn"', "")), ev)
    for w, ws in pairs(steps_by_worker(run)) do assert.equal(steps, ws[#ws], "worker " .. w) end
    assert.is_falsy(alive(op))
  end)

  -- A --resume by another user (root here: setpriv to nobody) while the
  -- operator trains: its control socket refuses that user, and the run
  -- directory is in use all the same: exit 2, naming the operator's uid.
  -- (Before: a refused connect counted as no operator, and a refused
  -- connection as a silent one: taken over after 2.5 s.)
  it("a --resume by another user while the operator trains is refused, naming its uid", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    if sh("id -u"):match("%d+") ~= "0" or not sh("command -v setpriv"):match("setpriv") then
      return pending("needs root and setpriv")
    end
    local run = tmp .. "/other_uid"
    local _, op_rc = spawn_rc("env TRANSOM_TEST_STEP_MS=10 " .. job(run, "--replicas 2 --set max_steps=300" ..
      " --set log_interval=600"), tmp .. "/other_uid.log")
    assert.is_true(wait_step(run, 20), read(tmp .. "/other_uid.log"))
    os.execute("chmod a+rx " .. tmp)
    local out, rc = sh("setpriv --reuid=65534 --regid=65534 --clear-groups " .. BIN .. " run --resume " .. run .. " 2>&1")
    assert.equal(2, rc, out)
    assert.matches(run .. " is in use by an operator of another user (uid 0", out, 1, true)
    assert.equal(0, S.wait_rc(op_rc, T(120)), read(tmp .. "/other_uid.log"))
  end)

  -- The other way round: the operator is another user's (nobody) and root,
  -- whose connect the socket's mode does not stop, resumes: the operator's
  -- ctl_accept closes the connection before the request is read (the probe
  -- gets EPIPE or ECONNRESET, not an answer). In use all the same: exit 2,
  -- naming the uid. (Before: read as a silent operator, taken over.)
  it("a --resume by root of another user's running operator is refused, naming its uid", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    if sh("id -u"):match("%d+") ~= "0" or not sh("command -v setpriv"):match("setpriv") then
      return pending("needs root and setpriv")
    end
    local d = tmp .. "/nobody_op"
    assert(os.execute("mkdir -p " .. d .. " && chmod 777 " .. d .. " && chmod a+rx " .. tmp))
    write(d .. "/c.txt", read(data):sub(1, 200000))
    assert(os.execute("chmod 644 " .. d .. "/c.txt"))
    local run = d .. "/run"
    local cmd = job(run, "--replicas 2 --set max_steps=300 --set log_interval=600"):gsub("--set data=%S+",
      "--set data=" .. d .. "/c.txt")
    local _, op_rc = spawn_rc("setpriv --reuid=65534 --regid=65534 --clear-groups env TRANSOM_TEST_STEP_MS=10 " .. cmd,
      d .. "/op.log")
    assert.is_true(wait_step(run, 20), read(d .. "/op.log"))
    local out, rc = sh(BIN .. " run --resume " .. run .. " 2>&1")
    assert.equal(2, rc, out)
    assert.matches(run .. " is in use by an operator of another user (uid 65534", out, 1, true)
    assert.equal(0, S.wait_rc(op_rc, T(120)), read(d .. "/op.log"))
  end)

  -- The operator stopped (SIGSTOP), and a lone --resume (--replicas 1)
  -- started meanwhile: refused, exit 2, naming the stopped operator's pid:
  -- only an operator rewrites RUN/operator.addr, so nothing would make the
  -- old one stand down when continued. It goes on and finishes alone.
  -- (Before: the lone run said "taking the run over" and trained alongside
  -- it once it was continued: two timelines in one run directory.)
  it("a lone --resume while the operator is stopped is refused: nothing would make it stand down", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local steps = 300
    local run, old, old_rc, before = stopped_operator("stopped_lone", steps, 10)
    local job1 = read(run .. "/job.lua")
    local _, rc_of = spawn_rc(BIN .. " run --resume " .. run .. " --replicas 1", tmp .. "/stopped_lone2.log")
    local rc = S.wait_rc(rc_of, T(60))
    os.execute("kill -CONT " .. old)
    local said = read(tmp .. "/stopped_lone2.log") or ""
    assert.equal(2, rc, said)
    assert.matches("a stopped or hung operator (pid " .. old .. ") holds " .. run .. ": kill it (kill -9 " .. old ..
      ") first, or resume with --replicas > 1 to take it over", said, 1, true)
    assert.equal(job1, read(run .. "/job.lua"))
    assert.equal(0, S.wait_rc(old_rc, T(120)), read(tmp .. "/stopped_lone.log"))
    went_on_alone(run, before, steps)
  end)

  -- A rollback whose drop of the checkpoints it abandons fails in the
  -- remote level only (the remote directory made immutable, chattr +i: as a
  -- read-only or failing mount would): the local store's go, the remote's
  -- stay. The rollback_drop_failed event must say which (before: "the
  -- checkpoints after step N stay", as if neither level had dropped any).
  it("a rollback whose drop fails in the remote level only: rollback_drop_failed names that level", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run, remote = tmp .. "/dropfail", tmp .. "/dropfail-remote"
    spawn(job(run, "--replicas 2 --set max_steps=3000 --set checkpoint.every_steps=10 " ..
      "--set checkpoint.keep_last=100 --set checkpoint.remote=" .. remote), tmp .. "/dropfail.log",
      "TRANSOM_TEST_STEP_MS=20")
    -- the remote level holds a checkpoint after step 10, the rollback's target
    assert.is_truthy(S.wait_for(function()
      local newest = 0
      for st in sh(BIN .. " ckpt ls " .. remote .. " 2>/dev/null"):gmatch("\n%s*(%d+)%s") do
        newest = math.max(newest, tonumber(st))
      end
      return newest > 10
    end, 60), "no remote checkpoint after step 10: " .. (read(tmp .. "/dropfail.log") or ""))
    local _, crc = sh("chattr +i " .. remote)
    if crc ~= 0 then return pending("chattr +i does not work on " .. remote) end
    local ok, err = pcall(function()
      local out, rc = sh(BIN .. " attach " .. run .. " -e 'rollback(10)' 2>&1")
      assert.equal(0, rc, out)
      assert.is_truthy(S.wait_for(function() return events(run):find('"kind":"rollback_drop_failed"', 1, true) end, 30),
        events(run))
    end)
    sh("chattr -i " .. remote)
    if not ok then error(err, 0) end
    local detail = events(run):match('"kind":"rollback_drop_failed","detail":"([^"]*)"')
    assert.matches("after step 10 failed in the remote level", detail, 1, true)
    assert.matches("the local store's were dropped", detail, 1, true)
    -- and so it was: the remote level still holds a step after 10
    assert.matches("\n%s*[2-9]%d%s", sh(BIN .. " ckpt ls " .. remote))
  end)

  -- The run directory travels to each worker in its WELCOME line, whose
  -- values end at a space: it goes escaped. (Before: "/tmp/x y/run" reached
  -- the workers as "/tmp/x", every one failed to start and the job stopped.)
  it("a run directory with a space in it: the replicas find it", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/with space/run"
    assert(os.execute("mkdir -p " .. S.q(tmp .. "/with space")))
    local cmd = job("RUN_DIR_HERE", "--replicas 2 --set max_steps=20")
    local at = assert(cmd:find("run_dir=RUN_DIR_HERE", 1, true))
    cmd = cmd:sub(1, at - 1) .. S.q("run_dir=" .. run) .. cmd:sub(at + #"run_dir=RUN_DIR_HERE")
    local out, rc = sh(cmd)
    assert.equal(0, rc, out)
    assert.matches('"kind":"replicas_agree"', events(run), 1, true)
    assert.is_nil(events(run):find('"kind":"replica_failed"', 1, true), events(run))
  end)

  it("a start-up error that repeats on every try is not retried", function()
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local run = tmp .. "/badresume"
    local out, rc = sh(job(run, "--set max_steps=40"))
    assert.equal(0, rc, out)
    -- the run's job now describes another model: its checkpoints do not fit
    local jobf = run .. "/job.lua"
    local text = read(jobf)
    local edited = text:gsub("n_embd = 64", "n_embd = 32")
    assert.are_not.equal(text, edited)
    write(jobf, edited)
    out, rc = sh(BIN .. " run --resume " .. run .. " --set max_steps=80")
    assert.are_not.equal(0, rc)
    local ev = events(run):match('"kind":"resume".*$') -- this attempt's events
    local failed = select(2, ev:gsub('"kind":"replica_failed"', ""))
    local spawns = select(2, ev:gsub('"kind":"spawn"', ""))
    assert.equal(3, failed, ev)
    assert.matches("startup_error", ev, 1, true)
    assert.matches("is of a different model", ev, 1, true) -- the reason, from the worker
    assert.is_true(spawns <= 3, "replaced after a start-up error: " .. ev)
  end)

  -- The soak (./test.sh --long): 3 replicas, 2000 steps, 50 random kill -9
  -- or SIGSTOP of workers and 3 kill -9 of the operator (each followed by
  -- `transom run --resume`, which adopts the live workers). Each fault lands
  -- a random 5 to 40 steps after the previous one healed (a step reduced by
  -- all 3 replicas again), so the job runs degraded only while it recovers,
  -- as on a cluster where failures are hours apart. The restart budget is raised in
  -- a copy of the shipped policies: this tests recovery, not the limits.
  it("soak: 50 random kill -9 / SIGSTOP of workers and 3 of the operator lose no committed step", function()
    if os.getenv("TRANSOM_LONG") ~= "1" then return pending("the soak runs with ./test.sh --long (TRANSOM_LONG=1)") end
    if not have_corpus then return pending("no ../shared/data/tinyshakespeare.txt: operator spec skipped") end
    local SOAK, LAST = 2000, 1700
    local pol = tmp .. "/soak-policies"
    assert(os.execute("mkdir -p " .. pol .. " && cp " .. ROOT .. "/lua/policies/*.lua " .. pol))
    local restart = read(pol .. "/restart.lua")
    local raised = restart:gsub("max_restarts_per_slot = %d+", "max_restarts_per_slot = 1000")
      :gsub("max_restarts_total = %d+", "max_restarts_total = 1000"):gsub("backoff_max = %d+", "backoff_max = 1")
    assert.are_not.equal(restart, raised)
    write(pol .. "/restart.lua", raised)
    -- DEAD_T = 2 s: a SIGSTOP heals in seconds, as the eagle spec's copy does
    local rules = read(pol .. "/rules.lua")
    write(pol .. "/rules.lua", (rules:gsub("local DEAD_T = %d+", "local DEAD_T = " .. T(2))))
    local extra = "--set max_steps=" .. SOAK .. " --set operator_grace=" .. T(60) .. " --set policies=" .. pol
    -- every step sleeps 250 ms first (TRANSOM_TEST_STEP_MS): a GPU's step time,
    -- long against a recovery, without burning the machine's cores; the clean
    -- run goes alongside the soak
    local pad = "TRANSOM_TEST_STEP_MS=250"
    local clean_run = tmp .. "/soak-clean"
    local clean_op = spawn(job(clean_run, extra), tmp .. "/soak-clean.log", pad)
    local run = tmp .. "/soak"
    local op = spawn(job(run, extra), tmp .. "/soak-0.log", pad)
    math.randomseed(os.time())
    local worker_faults, op_kills, stops = 0, 0, 0
    local function leader_step()
      local top = 0
      for _, steps in pairs(steps_by_worker(run)) do top = math.max(top, steps[#steps] or 0) end
      return top
    end
    -- a step after `after` all 3 replicas reduced: the last fault is healed
    local function healed(after)
      for line in (read(run .. "/metrics.jsonl") or ""):gmatch("[^\n]+") do
        local step, reps = line:match('^{"step":(%d+),"worker":%d+,"replicas":(%d+)')
        if step and tonumber(step) > after and reps == "3" then return true end
      end
    end
    local function wait_for(what, ok)
      for _ = 1, N(1800) do -- 90 s: a SIGSTOP heals after the dead rule's deadline and a catch-up
        if ok() then return end
        sleep(0.05)
      end
      error("soak: " .. what .. " after " .. worker_faults .. " worker faults and " .. op_kills .. " operator kills")
    end
    while worker_faults < 50 do
      -- the next fault lands a random 5 to 40 steps after the last one healed,
      -- and never after step LAST
      local at = leader_step()
      wait_for("no recovery to 3 replicas after step " .. at + 1, function() return healed(at + 1) end)
      local target = math.min(LAST, leader_step() + math.random(5, 40))
      wait_for("no progress to step " .. target, function() return leader_step() >= target end)
      if op_kills < 3 and (worker_faults + 1) % 13 == 0 then
        os.execute("kill -9 " .. op)
        assert.is_true(wait_exit(op, 10))
        op_kills = op_kills + 1
        sleep(0.2 + math.random() * 1.5)
        op = spawn(BIN .. " run --resume " .. run, tmp .. "/soak-" .. op_kills .. ".log", pad)
      else
        local status, running = sh(BIN .. " chaos " .. run .. " status"), {}
        for pid in status:gmatch("replica %d+: running pid (%d+)") do running[#running + 1] = pid end
        if #running > 0 then
          local pid = running[math.random(#running)]
          if math.random() < 0.3 then
            os.execute("kill -STOP " .. pid)
            stops = stops + 1
          else
            os.execute("kill -9 " .. pid)
          end
          worker_faults = worker_faults + 1
        end
      end
    end
    assert.is_true(wait_exit(op, 900), "the soak did not finish")
    assert.is_true(wait_exit(clean_op, 900), "the clean run did not finish")
    assert_agree(clean_run, read(tmp .. "/soak-clean.log"), SOAK)
    local clean = assert(final_val(clean_run), "no val loss in the clean run")
    local out = read(tmp .. "/soak-" .. op_kills .. ".log")
    assert_agree(run, out, SOAK)
    -- no committed step lost: whatever restarted from a checkpoint restarted
    -- from the newest one committed by then
    local committed = 0
    for line in events(run):gmatch("[^\n]+") do
      local kind = line:match('"kind":"([%w_]+)"')
      local step = tonumber(line:match('"step":(%-?%d+)'))
      if kind == "checkpoint" then committed = math.max(committed, step) end
      local from = tonumber(line:match("ready at step (%d+) %(resume"))
      if from then assert.is_true(from >= committed, "a resume from step " .. from .. " after step " .. committed .. " was committed") end
    end
    assert.equal(3, op_kills)
    local adoptions = select(2, events(run):gsub('"kind":"adopted"', ""))
    assert.is_true(adoptions > 0, "no worker was adopted by a restarted operator")
    local val = assert(final_val(run))
    assert.is_true(math.abs(val - clean) / clean < 0.02,
      string.format("val loss %.4f vs fault-free %.4f after %d worker faults (%d SIGSTOP) and %d operator kills",
        val, clean, worker_faults, stops, op_kills))
    local full, seen = 0, {}
    for line in (read(run .. "/metrics.jsonl") or ""):gmatch("[^\n]+") do
      local step, reps = line:match('^{"step":(%d+),"worker":%d+,"replicas":(%d+)')
      if step and not seen[step] then
        seen[step] = true
        if reps == "3" then full = full + 1 end
      end
    end
    print(string.format("  soak: %d worker faults (%d SIGSTOP), %d operator kills, %d adoptions, %d of %d steps "
      .. "with 3 replicas, val %.4f vs %.4f clean", worker_faults, stops, op_kills, adoptions, full, SOAK, val, clean))
  end)
end)
