-- repl_spec.lua — `transom attach` as a person uses it, through a real
-- terminal: tmux runs the REPL against a live 2-replica job, the keys are
-- typed, the screen is read back. `help` works without parentheses,
-- workers()/metrics()/anomalies() print aligned tables (every value under
-- its header), set() says what it did, TAB completes a control's name, and
-- the history comes back in the next attach (RUN/attach_history).
-- tmux runs on a socket of its own. Waits are bounded and stretch with
-- TRANSOM_TIME_SCALE. Pending without tmux (setup.sh installs it).

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local BIN, ROOT, q, sh, sleep = S.BIN, S.ROOT, S.q, S.sh, S.sleep

local tmp = os.tmpname()
os.remove(tmp)
assert(os.execute("mkdir -p " .. q(tmp)))
local TMUX = "tmux -L " .. q("transom-spec-" .. tmp:match("[^/]+$"))
local have_tmux = select(2, sh("command -v tmux >/dev/null 2>&1")) == 0

-- The screen and its scrollback, without the blank lines below the cursor
-- (so a prompt waiting for input ends the text: "transom>").
local function screen()
  return (sh(TMUX .. " capture-pane -p -J -t repl -S -300 2>/dev/null"):gsub("[\n ]+$", ""))
end

-- Waits (bounded) until the screen matches pattern; returns the screen.
local function wait_screen(pattern, what)
  local s
  for _ = 1, S.N(150) do
    s = screen()
    if s:find(pattern) then return s end
    sleep(0.1)
  end
  error("the screen never showed " .. (what or pattern) .. ":\n" .. tostring(s))
end

local function keys(...)
  local args = {}
  for i, k in ipairs({ ... }) do args[i] = q(k) end
  assert(os.execute(TMUX .. " send-keys -t repl " .. table.concat(args, " ")))
end

-- The lines of the last answer to `cmd` (between its prompt and the next).
local function answer(s, cmd)
  local from, pat = nil, "transom> " .. cmd:gsub("%p", "%%%0") .. "\n"
  for _, e in s:gmatch("()" .. pat .. "()") do from = e - 1 end -- the last time it was typed
  assert(from, "no prompt with " .. cmd)
  local lines = {}
  for line in s:sub(from + 1):gmatch("([^\n]*)\n") do
    if line:find("^transom>") then break end
    lines[#lines + 1] = line
  end
  return lines
end

-- Every row's value starts where its header's name starts.
local function assert_aligned(lines, first_col)
  local header = lines[1]
  assert.matches("^" .. first_col .. " ", header)
  local starts = {}
  for at in header:gmatch("()%S+") do starts[#starts + 1] = at end
  assert.is_true(#lines >= 2, "no rows under " .. header)
  for i = 2, #lines do
    for c = 2, #starts - 1 do -- the last column (free text) may hold spaces
      local at = starts[c]
      assert.is_true(lines[i]:sub(at - 2, at - 1) == "  " and lines[i]:sub(at, at):find("%S") ~= nil,
        string.format("row %d, column %d is not under its header:\n%s\n%s", i - 1, c, header, lines[i]))
    end
  end
end

-- The REPL in a new tmux session. Its stderr and exit status go to
-- tmp/attach.err: an attach that ends at once takes the session and the
-- tmux server with it ("server exited unexpectedly"), and says why there.
local function attach(run)
  local err = tmp .. "/attach.err"
  local cmd = BIN .. " attach " .. q(run) .. " 2>>" .. q(err) .. "; echo \"attach exited: $?\" >>" .. q(err)
  local ok = os.execute(TMUX .. " new-session -d -s repl -x 200 -y 60 " .. q(cmd))
  if not ok then
    local alive = select(2, sh("test -S " .. q(run .. "/control.sock"))) == 0
    error(string.format("tmux could not start the REPL session; %s:\n%s\ncontrol.sock %s; the job's log ends:\n%s",
      err, S.read(err) or "(nothing)", alive and "exists" or "is gone",
      (S.read(tmp .. "/op.log") or ""):sub(-3000)))
  end
  wait_screen("transom>$", "the prompt")
end

describe("the REPL in a terminal", function()
  after_each(function()
    os.execute(TMUX .. " kill-server 2>/dev/null")
    S.cleanup()
  end)
  teardown(function() os.execute("rm -rf " .. q(tmp)) end)

  it("help, aligned tables, set's answer, TAB completion, history across attaches", function()
    if not have_tmux then return pending("no tmux: the terminal REPL spec is skipped (setup.sh installs it)") end
    local run = tmp .. "/run"
    S.spawn(table.concat({ BIN, "run", ROOT .. "/examples/fortunes.lua", "--replicas 2", "--set run_dir=" .. run,
      "--set max_steps=1000000 --set n_layer=1 --set n_head=2 --set n_embd=32 --set block_size=32",
      "--set batch_size=4 --set threads=1 --set eval_interval=0 --set sample_tokens=0 --set log_interval=100000" },
      " "), tmp .. "/op.log")
    local out, rc
    for _ = 1, S.N(150) do -- the control socket and two replicas past their first step
      out, rc = sh(BIN .. " attach " .. run .. " -e 'metrics(0).step > 0 and metrics(1).step > 0' 2>&1")
      if rc == 0 and out:match("^true") then break end
      sleep(0.1)
    end
    assert.matches("^true", out)

    attach(run)
    keys("help", "Enter")
    wait_screen("every replica's latest step", "help's text")
    keys("workers", "Enter")
    local lines = answer(wait_screen("transom> workers\n.-transom>$"), "workers")
    assert.equal(3, #lines, table.concat(lines, "\n"))
    assert.matches("^slot%s+state%s+pid%s+step%s+restarts%s+mode%s+host$", lines[1])
    assert.matches("%slocal$", lines[2]) -- one host: no agents
    assert.matches("^0%s+running%s+%d+", lines[2])
    assert_aligned(lines, "slot")
    keys("metrics()", "Enter")
    lines = answer(wait_screen("transom> metrics%(%)\n.-transom>$"), "metrics()")
    assert.equal(3, #lines, table.concat(lines, "\n"))
    assert.matches("^worker%s+step%s+loss%s+grad_norm%s+lr", lines[1])
    assert_aligned(lines, "worker")
    -- TAB: "anom" becomes "anomalies("
    keys("anom", "Tab")
    wait_screen("transom> anomalies%($", "the completed name")
    keys(")", "Enter")
    lines = answer(wait_screen("transom> anomalies%(%)\n.-transom>$"), "anomalies()")
    assert.is_true(lines[1] == "(none)" or lines[1]:find("^step%s+worker%s+rule") ~= nil, lines[1])
    keys("set('lr', 5e-4)", "Enter")
    lines = answer(wait_screen("transom> set%('lr', 5e%-4%)\n.-transom>$"), "set('lr', 5e-4)")
    assert.matches("^lr 5e%-4 from step %d+", lines[1])
    keys("C-d")
    for _ = 1, S.N(50) do -- the session ends with the REPL
      if select(2, sh(TMUX .. " has-session -t repl 2>/dev/null")) ~= 0 then break end
      sleep(0.1)
    end
    assert.is_truthy(S.read(run .. "/attach_history"), "no RUN/attach_history")

    -- the next attach has the history: Up brings back the last line
    attach(run)
    keys("Up")
    wait_screen("transom> set%('lr', 5e%-4%)$", "the last line from the history")
    keys("Enter")
    lines = answer(wait_screen("transom> set%('lr', 5e%-4%)\n.-transom>$"), "set('lr', 5e-4)")
    assert.matches("^lr 5e%-4 from step %d+", lines[1])
  end)
end)
