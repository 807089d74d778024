-- operator_support.lua — what operator_spec.lua and operator_stop_spec.lua
-- share: the 3-replica job they run (a small model on a corpus copy, a
-- checkpoint every 20 steps), reading its metrics and events, a slot's pid,
-- bounded waits on its steps, events and logs, the checks the cases end
-- with (the replicas agree, no survivor's step goes back) and the
-- fault-free run they compare with. Loaded with dofile and called with the
-- spec's support table (spec/support.lua), so what it spawns is that
-- spec's to clean up, and with busted's assert (a dofile'd chunk sees the
-- plain one); busted does not run it (no _spec suffix).

return function(S, assert)

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

  -- a process that is gone (a zombie whose parent died counts as gone)
  local function gone(pid)
    return not (sh("ps -o stat= -p " .. pid .. " 2>/dev/null || true")):match("^%s*[^Z%s]")
  end

  return {
    tmp = tmp, data = data, have_corpus = have_corpus, STEPS = STEPS, job = job, spawn = spawn,
    spawn_rc = spawn_rc, chaos_job = chaos_job, alive = alive, wait_exit = wait_exit,
    steps_by_worker = steps_by_worker, final_val = final_val, events = events, went_on_alone = went_on_alone,
    pid_of = pid_of, wait_step = wait_step, stopped_operator = stopped_operator,
    survivors_never_go_back = survivors_never_go_back, wait_event = wait_event, wait_log = wait_log,
    members_now = members_now, stop_all_in = stop_all_in, assert_agree = assert_agree, baseline = baseline,
    lose_two_holding = lose_two_holding, gone = gone,
  }
end
