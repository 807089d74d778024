-- auth_spec.lua — only the job's own processes get in: a live 2-replica job
-- (the operator makes RUN/secret, mode 0600) is knocked on at every port
-- it opens: `transom agent` with no secret and with a wrong one (refused,
-- exit 1, an auth_refused event), one with the right secret (registered),
-- a connection that never answers the challenge (closed, an auth_refused event),
-- a flood of wrong answers (each refused; at most 5 events per 10 s, the rest
-- counted in one event),
-- junk to the FTAR coordinator (refused, an auth_refused event) and to a
-- worker's data and donor ports (refused, the worker's log says why); the
-- job goes on untouched (no failure, every step, replicas agree).
-- Runs inside the transom binary (`transom test spec`); spawns $TRANSOM_BIN.

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local BIN, ROOT, CORPUS = S.BIN, S.ROOT, S.CORPUS
local sh, sleep, read = S.sh, S.sleep, S.read
local T, N = S.T, S.N

local tmp = S.tmpdir()
local data = S.corpus_copy(tmp, 300000)
local have_corpus = data ~= nil

local STEPS = 300

local events, wait_for = S.events, S.wait_for

-- the TCP ports pid listens on
local function ports_of(pid)
  local ports = {}
  for port in sh("ss -ltnpH"):gmatch(":(%d+)%s+%S+%s+users:%(%(\"[^\"]*\",pid=" .. pid .. ",") do
    ports[#ports + 1] = tonumber(port)
  end
  return ports
end

-- 64 bytes of junk to 127.0.0.1:port, held open a moment
local function knock(port)
  sh("bash -c 'exec 3<>/dev/tcp/127.0.0.1/" .. port .. " && head -c 64 /dev/zero | tr \"\\0\" x >&3; sleep 0.3' 2>&1")
end

describe("the job secret", function()
  after_each(function() S.cleanup() end)

  it("every port refuses who does not prove it; the job goes on", function()
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    if sh("command -v ss >/dev/null && echo y"):match("y") == nil then pending("no ss (iproute2)") return end
    local run = tmp .. "/run"
    local pid, rc_of = S.spawn_rc(table.concat({ "env TRANSOM_TEST_STEP_MS=40", BIN, "run",
      ROOT .. "/examples/shakespeare.lua", "--replicas 2 --set data=" .. data, "--set run_dir=" .. run,
      "--set max_steps=" .. STEPS, "--set n_layer=2 --set n_head=2 --set n_embd=64 --set block_size=32",
      "--set batch_size=8 --set eval_interval=0 --set sample_tokens=0 --set log_interval=50",
      "--set checkpoint.every_steps=50 --set deadline=" .. T(2) }, " "), run .. ".out")
    assert(wait_for(function() return select(2, events(run):gsub("replica_ready", "")) >= 2 end, T(60)), events(run))
    local mode = sh("stat -c %a " .. run .. "/secret"):match("%d+")
    assert.equal("600", mode)
    local op_port = tonumber((read(run .. "/operator.addr") or ""):match(":(%d+)"))
    assert(op_port, "no operator.addr")
    local agent = BIN .. " agent --operator 127.0.0.1:" .. op_port .. " --name knock"
    -- no secret, a wrong one: refused
    local out, rc = sh("env -u TRANSOM_SECRET -u TRANSOM_SECRET_FILE " .. agent)
    assert.equal(1, rc, out)
    out, rc = sh("TRANSOM_SECRET=" .. string.rep("ab", 32) .. " " .. agent)
    assert.equal(1, rc, out)
    assert(wait_for(function() return select(2, events(run):gsub("auth_refused[^\n]*workers' port", "")) >= 2 end, T(10)),
      events(run))
    -- the right one gets in (and hears that this job has no hosts = N)
    out, rc = sh(agent .. " --secret-file " .. run .. "/secret")
    assert.equal(1, rc, out)
    assert.matches("refused us: this job runs on one host", out, 1, true)
    assert.equal(2, select(2, events(run):gsub("auth_refused", "")))
    -- a connection that never answers the challenge is closed (not held open for ever)
    local silent = tmp .. "/silent.out"
    S.spawn("bash -c 'exec 3<>/dev/tcp/127.0.0.1/" .. op_port .. " && timeout 100 cat <&3 >/dev/null; echo rc=$?'",
      silent)
    -- the coordinator: the operator's port that is not the workers'
    local coord
    for _, p in ipairs(ports_of(pid)) do if p ~= op_port then coord = p end end
    assert(coord, "no coordinator port among " .. table.concat(ports_of(pid), ","))
    knock(coord)
    assert(wait_for(function() return events(run):match("auth_refused[^\n]*coordinator") end, T(10)), events(run))
    -- a worker's data and donor ports
    local wpid = tonumber(sh(BIN .. " chaos " .. run .. " status"):match("replica 0: running pid (%d+)"))
    assert(wpid, "no worker 0")
    local wports = ports_of(wpid)
    assert(#wports >= 2, "worker 0 listens on " .. table.concat(wports, ","))
    for _, p in ipairs(wports) do knock(p) end
    assert(wait_for(function()
      local log = read(run .. "/worker-0.log") or ""
      return log:match("did not prove the job secret") and log:match("donor: refused a connection")
    end, T(10)), read(run .. "/worker-0.log"))
    assert(wait_for(function() return events(run):match("auth_refused[^\n]*sent no answer") end, T(30)), events(run))
    assert(wait_for(function() return (read(silent) or ""):match("rc=0") end, T(10)), read(silent))
    -- a flood of wrong answers: every one refused, but at most 5 events per 10 s; the rest counted in one line
    local FLOOD = 30
    local before = select(2, events(run):gsub("did not prove the job secret; closed", ""))
    sh("bash -c 'for i in $(seq " .. FLOOD .. "); do exec 3<>/dev/tcp/127.0.0.1/" .. op_port ..
      " && head -c 64 /dev/zero | tr \"\\0\" x >&3; exec 3>&-; done' 2>&1")
    -- and the job never noticed
    assert(wait_for(function() return rc_of() ~= nil end, T(120)), "the job did not finish")
    assert.equal(0, rc_of(), read(run .. ".out"))
    local ev = events(run)
    assert.matches("replicas_agree", ev, 1, true)
    assert.is_nil(ev:match("replica_failed"))
    assert.matches("finished at step " .. STEPS .. " | 2 replicas finished | 0 restarts", read(run .. ".out"), 1, true)
    local logged = select(2, ev:gsub("did not prove the job secret; closed", "")) - before
    local counted = 0
    for k in ev:gmatch("(%d+) more connection%(s%) refused") do counted = counted + tonumber(k) end
    assert.is_true(counted > 0, ev)
    assert.equal(FLOOD, logged + counted, ev)
  end)

  it("silent connections to a donor's port do not keep a joiner waiting: it joins on its first try", function()
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    if sh("command -v ss >/dev/null && echo y"):match("y") == nil then pending("no ss (iproute2)") return end
    local run = tmp .. "/run2"
    local _, rc_of = S.spawn_rc(table.concat({ "env TRANSOM_TEST_STEP_MS=40", BIN, "run",
      ROOT .. "/examples/shakespeare.lua", "--replicas 2 --set data=" .. data, "--set run_dir=" .. run,
      "--set max_steps=" .. STEPS, "--set n_layer=2 --set n_head=2 --set n_embd=64 --set block_size=32",
      "--set batch_size=8 --set eval_interval=0 --set sample_tokens=0 --set log_interval=50",
      "--set checkpoint.every_steps=50 --set deadline=" .. T(2) }, " "), run .. ".out")
    assert(wait_for(function() return select(2, events(run):gsub("replica_ready", "")) >= 2 end, T(60)), events(run))
    local wpid = tonumber(sh(BIN .. " chaos " .. run .. " status"):match("replica 0: running pid (%d+)"))
    assert(wpid, "no worker 0")
    -- three silent connections to each port of replica 0 (its donor port among them), held open
    for _, p in ipairs(ports_of(wpid)) do
      for _ = 1, 3 do
        S.spawn("bash -c 'exec 3<>/dev/tcp/127.0.0.1/" .. p .. " && sleep 60'", tmp .. "/silent2.out")
      end
    end
    sleep(0.5)
    local out, rc = sh(BIN .. " chaos " .. run .. " kill 1")
    assert.equal(0, rc, out)
    -- the replacement catches up from replica 0 on its first try (a joiner's challenge waits at most 10 s: one
    -- silent connection served first would have failed it)
    assert(wait_for(function() return events(run):match('"worker":1,"kind":"replica_ready"[^\n]*join') end, T(60)),
      events(run))
    assert(wait_for(function() return rc_of() ~= nil end, T(120)), "the job did not finish")
    assert.equal(0, rc_of(), read(run .. ".out"))
    assert.equal(1, select(2, events(run):gsub('"kind":"replica_failed"', "")), events(run))
  end)
end)
