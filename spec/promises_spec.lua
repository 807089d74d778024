-- promises_spec.lua — what the README promises of a live multi-replica job
-- that no other spec checks: the actions `skip_update` and `checkpoint_now`
-- decided by a rule on a live job and what they visibly do, the batch that
-- a rollback skips and the checkpoints it drops, `min_replicas`, the restart policy's limits and backoff
-- driven by `transom chaos RUN kill 1`, and the default job
-- (examples/fortunes.lua, what the README's first command runs).
-- Runs inside the transom binary (`transom test spec`); spawns $TRANSOM_BIN.
-- Each case is a small 2-replica job (a few seconds); the restart-limit case
-- waits out the shipped backoff (0.2 + 0.4 + 0.8 + 1.6 + 3.2 s).

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local BIN, ROOT, CORPUS = S.BIN, S.ROOT, S.CORPUS
local sh, sleep, read, write = S.sh, S.sleep, S.read, S.write

local tmp = S.tmpdir()
local data = S.corpus_copy(tmp, 300000)
local have_corpus = data ~= nil

local function skip() return pending("no ../shared/data/tinyshakespeare.txt: promises spec skipped") end

-- A 2-replica job of the small model; extra: more --set items.
local function job(run, extra)
  return table.concat({
    BIN, "run", ROOT .. "/examples/shakespeare.lua", "--replicas 2", "--set data=" .. data,
    "--set run_dir=" .. run, "--set n_layer=2 --set n_head=2 --set n_embd=64 --set block_size=32 --set batch_size=8",
    "--set eval_interval=0 --set eval_steps=5 --set sample_tokens=0 --set log_interval=100 --set deadline=2",
    extra or "" }, " ")
end

-- A copy of lua/policies in tmp/name, with Lua added to rules.lua and
-- actions.lua (before their `return`) and restart.lua edited by a function.
local function policies(name, rules, actions, restart)
  local dir = tmp .. "/" .. name
  assert(os.execute("mkdir -p " .. dir .. " && cp " .. ROOT .. "/lua/policies/*.lua " .. dir))
  local function add(file, text)
    if not text then return end
    local src = read(dir .. "/" .. file)
    local n
    src, n = src:gsub("\nreturn ([AR])%s*$", "\n" .. text .. "\nreturn %1\n")
    assert(n == 1, "no final return in " .. file)
    write(dir .. "/" .. file, src)
  end
  add("rules.lua", rules)
  add("actions.lua", actions)
  if restart then write(dir .. "/restart.lua", restart(read(dir .. "/restart.lua"))) end
  return dir
end

local events = S.events

-- metrics.jsonl's step records in file order: {step, worker, replicas,
-- skipped, loss (the string: runs compare bit for bit), checksum}
local function records(run)
  local t = {}
  for line in (read(run .. "/metrics.jsonl") or ""):gmatch("[^\n]+") do
    local step, w = line:match('^{"step":(%d+),"worker":(%d+),')
    if step then
      t[#t + 1] = { step = tonumber(step), worker = tonumber(w), replicas = tonumber(line:match('"replicas":(%d+)')),
        skipped = tonumber(line:match('"skipped":(%d+)')), loss = line:match('"loss":([^,}]+)'),
        checksum = line:match('"checksum":"(%x+)"') }
    end
  end
  return t
end

-- events of a kind, in order: {step, worker, time, detail, line}
local function events_of(run, kind)
  local t = {}
  for line in events(run):gmatch("[^\n]+") do
    if line:find('"kind":"' .. kind .. '"', 1, true) then
      t[#t + 1] = { step = tonumber(line:match('"step":(%-?%d+)')), worker = tonumber(line:match('"worker":(%-?%d+)')),
        time = tonumber(line:match('"time":([%d%.]+)')), detail = line:match('"detail":"(.-)"[,}]') or "", line = line }
    end
  end
  return t
end

local alive, wait_exit = S.alive, S.wait_gone

-- (slot state, pid, step) from the operator itself (`transom chaos RUN status`)
local function status(run, slot)
  local out = sh(BIN .. " chaos " .. run .. " status")
  local st, pid, step = out:match("replica " .. slot .. ": (%a+) pid (%d+) step (%d+)")
  return st, tonumber(pid), tonumber(step)
end

-- waits (bounded) until fn() is true; returns whether it came
local function wait_for(fn, seconds) return S.wait_for(fn, seconds or 30) ~= nil end

local function assert_agree(run, out, n)
  assert.matches('"kind":"replicas_agree","detail":"' .. (n or 2) .. ' replicas finished with parameter crc32c',
    events(run), 1, true)
  assert.is_truthy(out:match("finished at step %d+"), out)
end

describe("promises (2 replicas)", function()
  after_each(function() S.cleanup() end) -- a failed test leaves no process behind

  -- one run serves the two actions: a rule that reports made-up anomalies at
  -- steps 30, 50 and 70 of replica 0, and actions.lua mapping them
  local actions_run
  local function run_actions()
    if actions_run then return actions_run end
    local pol = policies("pol-actions", [==[
function R.test_marks(w, fleet, state)
  if w.id ~= 0 or w.step == nil then return nil end
  state.marks = state.marks or {}
  for _, m in ipairs({ { 30, "mark_skip" }, { 50, "mark_skip_at" }, { 70, "mark_ckpt" } }) do
    if w.step >= m[1] and not state.marks[m[2]] then
      state.marks[m[2]] = true
      return { kind = m[2], severity = "warning", detail = "made up at step " .. w.step }
    end
  end
end]==], [[
A.mark_skip = "skip_update"
function A.mark_skip_at(a) return { action = "skip_update", step = a.step + 10 } end
A.mark_ckpt = "checkpoint_now"]])
    local run = tmp .. "/actions"
    -- checkpoints by step count only past the end, a checksum every step
    local out, rc = sh(job(run, "--set max_steps=120 --set checkpoint.every_steps=1000 --set checksum_interval=1 "
      .. "--set policies=" .. pol))
    actions_run = { run = run, out = out, rc = rc }
    return actions_run
  end

  -- the step of the first anomaly of a kind
  local function anomaly_step(run, kind)
    for _, e in ipairs(events_of(run, "anomaly")) do
      if e.line:find('"anomaly":"' .. kind .. '"', 1, true) then return e.step end
    end
  end

  it("skip_update: every replica drops the update of the step it names, and nothing else", function()
    if not have_corpus then return skip() end
    local r = run_actions()
    assert.equal(0, r.rc, r.out)
    assert_agree(r.run, r.out)
    local skips = events_of(r.run, "skip_update")
    assert.equal(2, #skips, events(r.run))
    -- the default: the next step every replica can still agree on (the
    -- anomalous update is already applied when its step is reported)
    local a1 = assert(anomaly_step(r.run, "mark_skip"), events(r.run))
    local s1 = tonumber(skips[1].detail:match("drops the update of step (%d+)"))
    assert.is_truthy(s1, skips[1].line)
    assert.is_true(s1 > a1, skips[1].line)
    -- a decision naming a step still ahead: exactly that one
    local a2 = assert(anomaly_step(r.run, "mark_skip_at"), events(r.run))
    local s2 = tonumber(skips[2].detail:match("drops the update of step (%d+)"))
    assert.equal(a2 + 10, s2, skips[2].line)
    -- the step records say so, on both replicas, for those steps only; the
    -- parameters (their checksum, every step) do not change in those steps
    -- and change in every other one
    local crc = { [0] = {}, [1] = {} }
    local n = 0
    for _, x in ipairs(records(r.run)) do
      local want = (x.step == s1 or x.step == s2) and 1 or 0
      assert.equal(want, x.skipped, string.format("worker %d step %d skipped=%d", x.worker, x.step, x.skipped))
      crc[x.worker][x.step] = assert(x.checksum, "no checksum at step " .. x.step)
      n = n + 1
    end
    assert.equal(2 * 120, n)
    for w = 0, 1 do
      for step = 2, 120 do
        if step == s1 or step == s2 then
          assert.equal(crc[w][step - 1], crc[w][step], "worker " .. w .. ": parameters changed in skipped step " .. step)
        else
          assert.are_not.equal(crc[w][step - 1], crc[w][step], "worker " .. w .. ": no update in step " .. step)
        end
      end
    end
  end)

  it("checkpoint_now: the leader commits a checkpoint at the next step, off the every_steps schedule", function()
    if not have_corpus then return skip() end
    local r = run_actions()
    assert.equal(0, r.rc, r.out)
    local a = assert(anomaly_step(r.run, "mark_ckpt"), events(r.run))
    local steps = {}
    for _, e in ipairs(events_of(r.run, "checkpoint")) do steps[#steps + 1] = e.step end
    -- every_steps = 1000: without the action only the end (120) is checkpointed
    assert.equal(2, #steps, events(r.run))
    assert.is_true(steps[1] >= a and steps[1] < 120, "checkpoint at " .. steps[1] .. ", anomaly at " .. a)
    assert.equal(120, steps[2])
    local ls = sh(BIN .. " ckpt ls " .. r.run)
    assert.matches("\n%s*" .. steps[1] .. "%s", ls)
  end)

  it("a rollback skips the anomaly's batch: the steps before it repeat bit for bit, its step draws another", function()
    if not have_corpus then return skip() end
    local pol = policies("pol-rollback", [[
function R.test_mark(w, fleet, state)
  if w.id ~= 0 or w.step == nil or w.step < 45 or state.mark then return nil end
  state.mark = true
  return { kind = "mark_rollback", severity = "warning", detail = "made up at step " .. w.step }
end]], [[
function A.mark_rollback(a) return { action = "rollback", step = a.step - 1 } end]])
    local run = tmp .. "/rollback"
    -- steps padded to 20 ms: unpadded, 45 steps ran in 0.11 s on a loaded machine while the first
    -- checkpoint (step 10) took 83 ms to commit, so the rollback was refused (no checkpoint yet)
    local out, rc = sh("env TRANSOM_TEST_STEP_MS=" .. math.floor(S.T(20)) .. " " ..
      job(run, "--set max_steps=100 --set checkpoint.every_steps=10 --set policies=" .. pol))
    assert.equal(0, rc, out)
    assert_agree(run, out)
    local a = assert(anomaly_step(run, "mark_rollback"), events(run))
    local rb = events_of(run, "rollback")
    assert.equal(1, #rb, events(run))
    local target = tonumber(rb[1].detail:match("at or before step (%d+)"))
    assert.is_truthy(target, rb[1].line)
    assert.is_true(target < a)
    assert.matches("skips the batch of step " .. a, rb[1].detail, 1, true)
    -- per worker, the losses before the rollback (until its steps go back) and after
    local before, after, prev = { [0] = {}, [1] = {} }, { [0] = {}, [1] = {} }, {}
    for _, x in ipairs(records(run)) do
      local w = x.worker
      if after[w].rolled or (prev[w] and x.step <= prev[w]) then after[w].rolled = true end
      if after[w].rolled then after[w][x.step] = x.loss else before[w][x.step] = x.loss end
      prev[w] = x.step
    end
    -- replica 0 reported step a before the rule fired; replica 1 may have
    -- been killed before its line of a step reached the operator
    for step = target + 1, a do assert.is_truthy(before[0][step], "replica 0 did not report step " .. step) end
    for w = 0, 1 do
      assert.is_true(after[w].rolled, "replica " .. w .. " did not go back")
      -- from the checkpoint on, the same parameters meet the same batches ...
      for step = target + 1, a - 1 do
        if before[w][step] then
          assert.equal(before[w][step], after[w][step], "worker " .. w .. " step " .. step .. " (rolled back to "
            .. target .. ", anomaly at " .. a .. ")")
        end
      end
      -- ... until the anomaly's step, which draws the next batch instead
      if before[w][a] then
        assert.are_not.equal(before[w][a], after[w][a], "worker " .. w .. " trained on step " .. a .. "'s batch again")
      end
    end
  end)
  it("a rollback drops the checkpoints it abandons: a restart after it resumes the new timeline, not the old", function()
    if not have_corpus then return skip() end
    -- at step 75 a made-up anomaly rolls back to step 20; the store then
    -- held 20..70 (every 10, keep_last 10): 30..70 belong to the timeline
    -- the rollback abandons. A replica killed a few steps into the new one
    -- (on_failure = restart_all: every replica reloads the newest) must
    -- resume at most where the new timeline got, not at the old step 70.
    local pol = policies("pol-rollback-drop", [[
function R.test_mark(w, fleet, state)
  if w.id ~= 0 or w.step == nil or w.step < 75 or state.mark then return nil end
  state.mark = true
  return { kind = "mark_far_rollback", severity = "warning", detail = "made up at step " .. w.step }
end]], [[
function A.mark_far_rollback(a) return { action = "rollback", step = 20 } end]])
    local run = tmp .. "/rollback-drop"
    local op = S.spawn("env TRANSOM_TEST_STEP_MS=" .. math.floor(S.T(60)) .. " " ..
      job(run, "--set max_steps=100 --set checkpoint.every_steps=10 --set checkpoint.keep_last=10 " ..
        "--set on_failure=restart_all --set policies=" .. pol), tmp .. "/rollback-drop.log")
    -- the new timeline running: the rollback's replicas past step 22, before the old 60
    assert.is_true(wait_for(function()
      if #events_of(run, "rollback") == 0 then return false end
      local st, _, step = status(run, 0)
      return st == "running" and step >= 22 and step < 45
    end, 60), "no new timeline after the rollback: " .. events(run))
    local killed_at = select(3, status(run, 0))
    sh(BIN .. " chaos " .. run .. " kill 1")
    assert.is_true(wait_exit(op, 120), "the operator did not finish")
    local out = read(tmp .. "/rollback-drop.log") or ""
    assert.matches("finished at step 100", out, 1, true)
    -- the step replica 0 was ready at after the restart: the checkpoint it loaded
    local ra = events_of(run, "restart_all")
    assert.equal(1, #ra, events(run))
    local resumed
    for _, e in ipairs(events_of(run, "replica_ready")) do
      if not resumed and e.worker == 0 and e.time >= ra[1].time then
        resumed = tonumber(e.detail:match("ready at step (%d+)"))
      end
    end
    assert.is_truthy(resumed, "replica 0 was never ready after the restart: " .. events(run))
    assert.is_true(resumed <= killed_at + 10 and resumed < 60,
      "the restart resumed at step " .. resumed .. " (killed at about " .. killed_at ..
      "): a checkpoint of the abandoned timeline")
    local dropped = events_of(run, "checkpoints_dropped")
    assert.equal(1, #dropped, events(run))
    assert.matches("after step 20 dropped (from step 30)", dropped[1].detail, 1, true)
  end)

  it("min_replicas: below it training pauses until the replacement is back, and never trains with fewer", function()
    if not have_corpus then return skip() end
    -- the replacement comes 2 s after the kill (the restart policy's first
    -- backoff, raised from 0.2 s): long enough for dozens of steps if the
    -- survivor went on alone
    local pol = policies("pol-min", nil, nil, function(src)
      local out, n = src:gsub("M.backoff_first = [%d%.]+", "M.backoff_first = 2")
      assert(n == 1)
      return out
    end)
    local run = tmp .. "/min"
    local op = S.spawn(job(run, "--set max_steps=300 --set checkpoint.every_steps=50 --set min_replicas=2 --set policies="
      .. pol), tmp .. "/min.log")
    assert.is_true(wait_for(function()
      local st, _, step = status(run, 1)
      return st == "running" and step >= 40
    end), "replica 1 never reached step 40")
    local _, pid = status(run, 1)
    os.execute("kill -9 " .. pid)
    assert.is_true(wait_exit(op, 120), "the operator did not finish")
    local out = read(tmp .. "/min.log")
    -- every step record of both replicas: 2 replicas averaged, and none missing
    local by = { [0] = {}, [1] = {} }
    for _, x in ipairs(records(run)) do
      assert.equal(2, x.replicas, string.format("worker %d trained step %d with %d replica(s)", x.worker, x.step,
        x.replicas))
      by[x.worker][x.step] = true
    end
    for step = 1, 300 do assert.is_true(by[0][step], "worker 0 has no step " .. step) end
    local ev = events(run)
    assert.matches("replica 1 killed (signal 9)", ev, 1, true)
    assert.matches("on_failure -> replace (delay 2.00 s)", ev, 1, true)
    assert.matches('"kind":"paused","detail":"1 live replicas < min_replicas 2: waiting for replacements"', ev, 1, true)
    -- the replacement got its state from the paused survivor
    assert.matches("replica 1 ready at step %d+ %(join", ev)
    assert_agree(run, out)
  end)
  it("`transom chaos RUN kill 1`: the operator kills replica 1, a replacement joins, every step done", function()
    if not have_corpus then return skip() end
    local run = tmp .. "/chaoskill"
    -- steps padded to 20 ms: unpadded, a loaded machine let the survivor run its last 250 steps before the
    -- replacement joined (cancelled: one replica finished, and the test failed on what it does not check)
    local op = S.spawn(job(run, "--set max_steps=300 --set checkpoint.every_steps=50"), tmp .. "/chaoskill.log",
      "TRANSOM_TEST_STEP_MS=" .. math.floor(S.T(20)))
    local pid, at
    assert.is_true(wait_for(function()
      local st, p, step = status(run, 1)
      pid, at = p, step
      return st == "running" and step >= 50
    end), "replica 1 never reached step 50")
    local out, rc = sh(BIN .. " chaos " .. run .. " kill 1")
    assert.equal(0, rc, out)
    assert.equal("ok\n", out)
    assert.is_true(wait_exit(op, 120), "the operator did not finish")
    local log = read(tmp .. "/chaoskill.log")
    assert_agree(run, log)
    local ev = events(run)
    -- the kill went through the control socket, to the pid the operator knew
    local chaos = events_of(run, "chaos")
    assert.equal(1, #chaos, ev)
    assert.equal("kill replica 1 (from transom chaos)", chaos[1].detail)
    local failed = events_of(run, "replica_failed")
    assert.equal(1, #failed, ev)
    assert.matches("^replica 1 killed %(signal 9%)", failed[1].detail)
    assert.is_true(failed[1].step >= at)
    local spawns = events_of(run, "spawn")
    assert.equal(3, #spawns, ev) -- 2 at the start, the replacement
    assert.matches("^replica 1 started %(pid %d+, join%)", spawns[3].detail)
    assert.are_not.equal(tostring(pid), spawns[3].detail:match("pid (%d+)"))
    assert.matches("replica 1 ready at step %d+ %(join", ev)
    -- every step of the survivor; the replacement from where it joined to the end
    local by = { [0] = {}, [1] = {} }
    for _, x in ipairs(records(run)) do
      by[x.worker][#by[x.worker] + 1] = x.step
      -- max_replicas (default: replicas): never more at once, a replacement included
      assert.is_true(x.replicas <= 2, string.format("step %d averaged %d replicas", x.step, x.replicas))
    end
    for i = 1, 300 do assert.equal(i, by[0][i], "worker 0, line " .. i) end
    assert.equal(300, by[1][#by[1]])
  end)
  it("a replica lost near the end is not replaced once the survivor finished every step", function()
    if not have_corpus then return skip() end
    -- the replacement is due 30 s after the kill; the survivor has 5 steps left
    local pol = policies("pol-late", nil, nil, function(src)
      local s, n = src:gsub("M%.backoff_first = 0%.2", "M.backoff_first = 30")
      local s2, n2 = s:gsub("M%.backoff_max = 10", "M.backoff_max = 30")
      assert(n == 1 and n2 == 1, "no backoff_first or backoff_max in restart.lua")
      return s2
    end)
    local run, file = tmp .. "/late", tmp .. "/late.lua"
    write(file, string.format([[
return { data = %q, replicas = 2, max_steps = 60, warmup_steps = 10, n_layer = 2, n_head = 2, n_embd = 64, block_size = 32,
  batch_size = 8, eval_interval = 0, eval_steps = 5, sample_tokens = 0, log_interval = 100, deadline = 2,
  policies = %q, checkpoint = { every_steps = 20 }, chaos = { { at_step = 55, replica = 1, fault = "kill" } } }
]], data, pol))
    local op, exit_status = S.spawn_rc(BIN .. " run " .. file .. " --set run_dir=" .. run, tmp .. "/late.log")
    assert.is_true(wait_exit(op, 120), "the operator did not finish")
    assert.is_true(wait_for(function() return exit_status() ~= nil end, 10))
    local log, ev = read(tmp .. "/late.log"), events(run)
    assert.equal(0, exit_status(), log)
    assert.matches("finished at step 60 | 1 replicas finished", log, 1, true)
    assert.equal(1, #events_of(run, "replica_failed"), ev)
    assert.equal("on_failure -> replace (delay 30.00 s)", events_of(run, "policy")[1].detail)
    -- no replacement started after the kill: it would resume at step 60 alone
    assert.equal(2, #events_of(run, "spawn"), ev)
    local cancelled = events_of(run, "replacement_cancelled")
    assert.equal(1, #cancelled, ev)
    assert.equal(1, cancelled[1].worker)
    assert.equal("replica 1 not replaced: the others finished step 60", cancelled[1].detail)
  end)

  it("a joiner that fails after the survivor finished every step is not restarted, nor is anything else", function()
    if not have_corpus then return skip() end
    -- the replacement pauses 8 s in its catch-up (a test hook) after its
    -- snapshot: the survivor finishes its 40 remaining steps (20 ms each at
    -- least: TRANSOM_TEST_STEP_MS, so the replacement starts before the end)
    -- and exits meanwhile, so the joiner's replay fails with no replica live
    local run, file = tmp .. "/latejoin", tmp .. "/latejoin.lua"
    write(file, string.format([[
return { data = %q, replicas = 2, max_steps = 100, warmup_steps = 10, n_layer = 2, n_head = 2, n_embd = 64,
  block_size = 32, batch_size = 8, eval_interval = 0, eval_steps = 5, sample_tokens = 0, log_interval = 100,
  deadline = 2, checkpoint = { every_steps = 20 }, chaos = { { at_step = 60, replica = 1, fault = "kill" } } }
]], data))
    local op, exit_status = S.spawn_rc("env TRANSOM_TEST_CATCHUP_DELAY_MS=8000 TRANSOM_TEST_STEP_MS=20 " .. BIN .. " run " .. file
      .. " --set run_dir=" .. run, tmp .. "/latejoin.log")
    assert.is_true(wait_exit(op, 120), "the operator did not finish")
    assert.is_true(wait_for(function() return exit_status() ~= nil end, 10))
    local log, ev = read(tmp .. "/latejoin.log"), events(run)
    assert.equal(0, exit_status(), log)
    assert.matches("finished at step 100 | 1 replicas finished", log, 1, true)
    local failed = events_of(run, "replica_failed")
    assert.equal(2, #failed, ev) -- the kill, then the joiner
    assert.matches("; 0 live$", failed[2].detail)
    assert.equal(0, #events_of(run, "all_replicas_dead"), ev)
    assert.equal(3, #events_of(run, "spawn"), ev) -- 2 at the start, the joiner; no restart of everything
    local cancelled = events_of(run, "replacement_cancelled")
    assert.equal(1, #cancelled, ev)
    assert.equal("replica 1 not replaced: the others finished step 100", cancelled[1].detail)
  end)
  it("restart policy: replaced after 0.2, 0.4, 0.8, 1.6, 3.2 s, then the slot is given up (5 per slot within the hour)", function()
    if not have_corpus then return skip() end
    local run = tmp .. "/limits"
    local op, exit_status = S.spawn_rc(job(run, "--set max_steps=100000 --set checkpoint.every_steps=500"),
      tmp .. "/limits.log")
    local pid
    for kill = 1, 6 do
      local st, p
      assert.is_true(wait_for(function()
        st, p = status(run, 1)
        return st == "running" and p ~= pid
      end, 60), "replica 1 not running again before kill " .. kill .. " (" .. tostring(st) .. ")")
      pid = p
      local out, rc = sh(BIN .. " chaos " .. run .. " kill 1")
      assert.equal(0, rc, out)
      assert.is_true(wait_for(function() return #events_of(run, "policy") >= kill end),
        "no decision after kill " .. kill)
    end
    -- given up: nothing is started for slot 1 any more; slot 0 trains on
    local _, _, step0 = status(run, 0)
    assert.is_true(wait_for(function() return select(3, status(run, 0)) >= step0 + 20 end), "slot 0 stopped training")
    assert.equal("dead", (status(run, 1)))
    os.execute("kill -TERM " .. op)
    assert.is_true(wait_exit(op, 60))
    assert.is_true(wait_for(function() return exit_status() ~= nil end, 10))
    assert.equal(0, exit_status())
    assert.matches("| 5 restarts |", read(tmp .. "/limits.log"), 1, true)
    local ev = events(run)
    local policy, failed, spawns = events_of(run, "policy"), events_of(run, "replica_failed"), {}
    for _, e in ipairs(events_of(run, "spawn")) do
      if e.worker == 1 then spawns[#spawns + 1] = e end
    end
    assert.equal(6, #policy, ev)
    assert.equal(6, #failed, ev)
    assert.equal(6, #spawns, ev) -- the first start and 5 replacements
    for i, delay in ipairs({ 0.2, 0.4, 0.8, 1.6, 3.2 }) do
      assert.equal(string.format("on_failure -> replace (delay %.2f s)", delay), policy[i].detail)
      -- the replacement waited out its backoff (events carry milliseconds)
      local waited = spawns[i + 1].time - failed[i].time
      assert.is_true(waited >= delay - 0.01, string.format("replacement %d came %.3f s after the failure, backoff %.1f s",
        i, waited, delay))
      assert.matches("^replica 1 started %(pid %d+, join%)", spawns[i + 1].detail)
    end
    assert.equal("on_failure -> none: slot 1 failed too often (5 in 3600 s) (delay 0.00 s)", policy[6].detail)
  end)
end)

describe("the default job", function()
  it("examples/fortunes.lua from the repository root, shortened: trains on data/fortunes.txt", function()
    local fortunes = ROOT .. "/data/fortunes.txt"
    local text = read(fortunes)
    if not text then return pending("no data/fortunes.txt: run ./setup.sh --no-build") end
    local run_dir = tmp .. "/fortunes"
    local cmd = "cd " .. S.q(ROOT) .. " && " .. S.q(BIN) .. " run examples/fortunes.lua --set run_dir=" .. S.q(run_dir)
    -- max_steps alone below its warmup_steps (100) is refused, saying what to set
    local out, code = sh(cmd .. " --set max_steps=10")
    assert.are.equal(2, code, out)
    assert.is_truthy(out:find("examples/fortunes.lua:%d+: warmup_steps = 100 is past lr_decay_steps = 10"), out)
    assert.is_truthy(out:find("defaults to max_steps", 1, true), out)
    assert.is_false(S.exists(run_dir))
    out, code = sh(cmd .. " --set max_steps=10 --set warmup_steps=5")
    assert.are.equal(0, code, out)
    assert.is_truthy(out:find("data data/fortunes.txt: " .. #text .. " tokens", 1, true), out)
    assert.is_truthy(out:find("step 10/10 | val loss", 1, true), out)
    -- the job's own closing sample: 400 tokens at temperature 0.8
    assert.is_truthy(out:find("--- sample (400 tokens, temperature 0.80) ---", 1, true), out)
    for _, f in ipairs({ "job.lua", "vocab.json", "metrics.jsonl", "events.jsonl", "model.safetensors" }) do
      assert.is_true(S.exists(run_dir .. "/" .. f), "missing " .. f)
    end
    -- the example's model, and a loss that starts near log(vocab) and falls
    local j = require("transom.job").load(run_dir .. "/job.lua")
    assert.are.same({ 4, 4, 128, 64, 16, 0.8 }, { j.n_layer, j.n_head, j.n_embd, j.block_size, j.batch_size, j.temperature })
    local V = tonumber(out:match("vocab (%d+)"))
    local losses = {}
    for line in read(run_dir .. "/metrics.jsonl"):gmatch("[^\n]+") do
      losses[#losses + 1] = tonumber(line:match('"loss":([^,}]+)'))
    end
    assert.are.equal(10, #losses)
    assert.is_true(math.abs(losses[1] - math.log(V)) < 0.3, losses[1] .. " vs log V " .. math.log(V))
    assert.is_true(losses[10] < losses[1], "the loss did not fall")
  end)
end)
