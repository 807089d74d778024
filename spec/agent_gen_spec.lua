-- agent_gen_spec.lua — the operator and an agent agree on which worker of a
-- slot a line is about: SPAWN carries a generation, the agent's STARTED /
-- EXITED echo it and KILL names it (core/fleet/operator_hosts.c, agent.c).
-- Races a real agent hits only sometimes are played here on purpose by a
-- scripted agent (spec/hosts/fake_agent.py) on loopback: an older worker's
-- EXITED and STARTED arriving after the slot was placed again on the same
-- host must not fail or adopt the new placement, and a kill asked for
-- before the agent's STARTED arrived (no pid known yet) must still reach
-- the worker. Runs inside the transom binary (`transom test spec`).

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local BIN, ROOT, CORPUS = S.BIN, S.ROOT, S.CORPUS
local sh, sleep, read, write = S.sh, S.sleep, S.read, S.write
local T, N = S.T, S.N

local tmp = S.tmpdir()
local have_python = select(2, sh("python3 -c 'import hmac, hashlib'")) == 0
local data = S.corpus_copy(tmp, 100000)
local have_corpus = data ~= nil

-- waits (bounded) until pattern shows in the file at path; returns its text
local function wait_for(path, pattern, seconds)
  return S.wait_for(function()
    local text = read(path) or ""
    return text:find(pattern) and text
  end, seconds)
end

local function count(text, pattern)
  local n = 0
  for _ in text:gmatch(pattern) do n = n + 1 end
  return n
end

describe("agent protocol: SPAWN generations", function()
  after_each(function() S.cleanup() end)

  it("a late EXITED / STARTED of an older worker is ignored; a kill before STARTED reaches the worker", function()
    if not have_python then pending("python3 not found") return end
    if not have_corpus then pending("no corpus at " .. CORPUS) return end
    local run, port = tmp .. "/run", 29000 + (tonumber(sh("echo $$"):match("%d+")) % 500)
    -- a host that fails is cordoned after 2 failures by default: this test fails it 3 times on purpose
    local pol = tmp .. "/policies"
    sh("mkdir -p " .. pol .. " && cp " .. ROOT .. "/lua/policies/*.lua " .. pol)
    write(pol .. "/hosts.lua", (read(pol .. "/hosts.lua"):gsub("M%.failures = 2 ", "M.failures = 100 ")))
    S.spawn("env MASTER_ADDR=127.0.0.1 MASTER_PORT=" .. port .. " " .. BIN .. " run " .. ROOT ..
      "/examples/shakespeare.lua --replicas 2 --set hosts=1 --set data=" .. data .. " --set run_dir=" .. run ..
      " --set policies=" .. pol .. " --set max_steps=50 --set deadline=" .. T(2), tmp .. "/op.log")
    for _ = 1, N(300) do
      if S.exists(run .. "/secret") then break end
      sleep(0.05)
    end
    local log, cmd = tmp .. "/agent.log", tmp .. "/agent.cmd"
    write(cmd, "")
    S.spawn("python3 " .. ROOT .. "/spec/hosts/fake_agent.py " .. port .. " " .. run .. "/secret " .. log .. " " .. cmd,
      tmp .. "/agent.out")
    local function say(line) write(cmd, (read(cmd) or "") .. line .. "\n") end

    assert(wait_for(log, "SPAWN slot=0 gen=1 ", T(20)), read(tmp .. "/op.log"))
    assert(wait_for(log, "SPAWN slot=1 gen=1 ", T(5)), read(log))
    say("STARTED slot=0 gen=1 pid=4000001")
    say("STARTED slot=1 gen=1 pid=4000002")
    say("EXITED slot=0 gen=1 pid=4000001 status=9") -- worker 0 killed: replaced on the same (only) host
    assert(wait_for(log, "SPAWN slot=0 gen=2 ", T(20)), read(log))
    -- the old worker's words arrive late, before the new one's STARTED
    say("EXITED slot=0 gen=1 pid=4000001 status=9")
    say("STARTED slot=0 gen=1 pid=4000001")
    sleep(T(1.5)) -- a failure taken from these lines would be replaced after 0.4 s (the policy's backoff)
    local ev = read(run .. "/events.jsonl") or ""
    assert.equal(1, count(ev, '"kind":"replica_failed"'), ev)
    assert.is_nil((read(log) or ""):find("SPAWN slot=0 gen=3 "), read(log))

    -- a kill asked for before STARTED gen=2 arrived: by generation, not by a pid nobody knows yet
    local out, rc = sh(BIN .. " chaos " .. run .. " kill 0")
    assert.equal(0, rc, out)
    assert(wait_for(log, "KILL slot=0 gen=2 sig=9", T(10)), read(log))
    assert.is_nil((read(log) or ""):find("KILL slot=0 gen=1"), read(log))
    say("STARTED slot=0 gen=2 pid=4000003")
    say("EXITED slot=0 gen=2 pid=4000003 status=9")
    assert(wait_for(log, "SPAWN slot=0 gen=3 ", T(20)), read(log))
    ev = read(run .. "/events.jsonl") or ""
    assert.equal(2, count(ev, '"kind":"replica_failed"'), ev)
  end)
end)
