-- support.lua — what the process-level specs share: the binary under test,
-- the repository root, the corpus, running shell commands, reading and
-- writing files, quoting, running the binary, the time scale of a slow
-- (sanitizer) build, bounded waits (for a condition, a process's end, an
-- exit status), a run's events. Loaded with dofile by every
-- spec that spawns transom (busted does not run it: no _spec suffix).

local S = {}

S.BIN = assert(os.getenv("TRANSOM_BIN"), "run through `transom test`")
S.ROOT = (debug.getinfo(1, "S").source:match("^@(.*)/spec/[^/]*$")) or "."
S.CORPUS = S.ROOT .. "/../shared/data/tinyshakespeare.txt"

-- Runs cmd through the shell; returns its output (stdout and stderr) and
-- its exit status.
function S.sh(cmd)
  local p = io.popen("(" .. cmd .. ") 2>&1; echo \"__rc=$?\"")
  local out = p:read("a")
  p:close()
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  return out:gsub("__rc=%d+%s*$", ""), rc
end

function S.sleep(s) os.execute("sleep " .. s) end

-- Waits for pid to exit while the file `progress` keeps growing: it fails
-- (returns false) only after `stall` seconds without a new byte there, so a
-- slow machine or a sanitizer build waits longer, and a stuck job fails as
-- soon. Every wait stays bounded: a job cannot grow its log forever.
function S.wait_exit_progress(pid, progress, stall)
  local size, quiet = -1, 0
  while quiet < stall do
    if not (S.sh("kill -0 " .. pid .. " 2>/dev/null && echo yes")):match("yes") then return true end
    local now = #(S.read(progress) or "")
    if now ~= size then size, quiet = now, 0 else quiet = quiet + 0.1 end
    S.sleep(0.1)
  end
  return false
end

-- Background processes: S.spawn starts cmd in a process group of its own
-- (setsid: the operator's workers, forked by it, join the group), output to
-- log, env an optional "VAR=value ..." prefix; returns its pid. S.cleanup()
-- kills every group spawned so far, stopped processes too (SIGKILL reaches
-- them; SIGCONT first for good measure): every spec that spawns calls it
-- after each test, so a failing test leaves nothing behind.
S.spawned = {}

function S.spawn(cmd, log, env)
  local out = S.sh((env or "") .. " setsid " .. cmd .. " > " .. log .. " 2>&1 & echo $!")
  local pid = assert(tonumber(out:match("(%d+)%s*$")), out)
  S.spawned[#S.spawned + 1] = pid
  return pid
end

-- The same, and the exit status lands in a file: returns the pid and a
-- function that reads the status (nil while it runs).
function S.spawn_rc(cmd, log)
  local pidf, rcf = log .. ".pid", log .. ".rc"
  os.remove(pidf)
  os.remove(rcf)
  os.execute("(setsid " .. cmd .. " > " .. log .. " 2>&1 & echo $! > " .. pidf .. "; wait $!; echo $? > " .. rcf .. ") &")
  for _ = 1, 200 do
    local pid = tonumber(S.read(pidf) or "")
    if pid then
      S.spawned[#S.spawned + 1] = pid
      return pid, function() return tonumber(S.read(rcf) or "") end
    end
    S.sleep(0.05)
  end
  error("no pid for " .. cmd)
end

function S.cleanup()
  for _, pid in ipairs(S.spawned) do
    -- "-PID" right after the signal: dash's kill (Debian's /bin/sh) takes
    -- no "--" ("Illegal number"), and the group was never killed
    os.execute("kill -CONT -" .. pid .. " 2>/dev/null; kill -KILL -" .. pid .. " 2>/dev/null")
  end
  S.spawned = {}
end
-- TRANSOM_TIME_SCALE (default 1, never below): the sanitizer pass of
-- test.sh runs the specs against a binary several times slower. S.T
-- stretches a spec's own waits, the thresholds it sets in its jobs and
-- policy copies (deadline, hang_seconds, HANG_T/DEAD_T, a slow fault's
-- delay) and the latencies it asserts; S.N stretches a count of polling
-- rounds alike. The product's defaults are never scaled.
S.SCALE = math.max(1, tonumber(os.getenv("TRANSOM_TIME_SCALE") or "") or 1)
function S.T(seconds) return seconds * S.SCALE end
function S.N(rounds) return math.ceil(rounds * S.SCALE) end

function S.read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

function S.write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

-- Shell-quotes s.
function S.q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- Flips one byte in the middle of a tensor of checkpoint `step`, on disk:
-- `store` is what `transom ckpt export` takes (a run, or a store folder),
-- `mdb` that store's data.mdb, `name` a Lua pattern for the tensor's name
-- in the export's header. The tensor's bytes are found in the LMDB file
-- through the export (64 bytes of them). Returns nil, or why it could not.
function S.flip_tensor_byte(store, mdb, step, name, scratch)
  local _, rc = S.sh(S.BIN .. " ckpt export " .. S.q(store) .. " --step " .. step .. " -o " .. S.q(scratch))
  if rc ~= 0 then return "export of step " .. step .. " failed" end
  local blob = S.read(scratch)
  local hlen = string.unpack("<I8", blob)
  local b0, b1 = blob:sub(9, 8 + hlen):match('"' .. name .. '":{[^}]*"data_offsets":%[(%d+),(%d+)%]')
  if not b0 then return "no tensor matching " .. name .. " in the export" end
  local mid = 8 + hlen + math.tointeger(tonumber(b0) + (tonumber(b1) - tonumber(b0)) // 2)
  local at = (S.read(mdb) or ""):find(blob:sub(mid + 1, mid + 64), 1, true)
  if not at then return "the tensor's bytes are not in " .. mdb end
  local f = assert(io.open(mdb, "r+b"))
  f:seek("set", at + 10)
  local c = f:read(1)
  f:seek("set", at + 10)
  f:write(string.char(c:byte() ~ 0xff))
  f:close()
  return nil
end

function S.exists(path)
  local ok, _, code = os.rename(path, path)
  return ok or code == 13 -- EACCES still means it exists
end

-- Runs the binary with shell-quoted args, stdout and stderr to files in dir;
-- returns the exit status, stdout, stderr.
function S.transom(dir, ...)
  local args = {}
  for i, a in ipairs({ ... }) do args[i] = S.q(a) end
  local out, err = dir .. "/stdout", dir .. "/stderr"
  local _, how, code = os.execute(string.format("%s %s >%s 2>%s", S.q(S.BIN), table.concat(args, " "), S.q(out),
    S.q(err)))
  assert(how == "exit", "transom was killed by signal " .. tostring(code))
  return code, assert(S.read(out)), assert(S.read(err))
end

-- A fresh directory for a spec's files.
function S.tmpdir()
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir -p " .. S.q(dir)))
  return dir
end

-- The corpus's first `bytes` in dir/corpus.txt: its path, or nil where this
-- machine has no corpus (the spec then marks its cases pending).
function S.corpus_copy(dir, bytes)
  local text = S.read(S.CORPUS)
  if not text then return nil end
  S.write(dir .. "/corpus.txt", text:sub(1, bytes))
  return dir .. "/corpus.txt"
end

-- A run's events.jsonl ("" before the run wrote one).
function S.events(run) return S.read(run .. "/events.jsonl") or "" end

-- Polls fn every 0.05 s until it returns a true value, which is returned;
-- nil once `seconds` (stretched by the time scale) passed. Every wait of a
-- spec is bounded this way.
function S.wait_for(fn, seconds)
  for _ = 1, S.N(seconds * 20) do
    local v = fn()
    if v then return v end
    S.sleep(0.05)
  end
  return nil
end

-- Whether process pid exists (a zombie counts).
function S.alive(pid) return (S.sh("kill -0 " .. pid .. " 2>/dev/null && echo yes || echo no")):match("yes") ~= nil end

-- Waits (bounded, scaled) until pid is gone; whether it went.
function S.wait_gone(pid, seconds) return S.wait_for(function() return not S.alive(pid) end, seconds) == true end

-- Waits (bounded, scaled) for rc_of() (S.spawn_rc's) to give the exit status; it, or nil.
function S.wait_rc(rc_of, seconds) return S.wait_for(rc_of, seconds) end

-- The "step=loss" strings of a single-replica run's metrics.jsonl, in order
-- (strings: two runs compare bit for bit).
function S.losses(run)
  local t = {}
  for line in (S.read(run .. "/metrics.jsonl") or ""):gmatch("[^\n]+") do
    local step, loss = line:match('^{"step":(%d+),'), line:match('"loss":([^,}]+)')
    if step and loss then t[#t + 1] = step .. "=" .. loss end
  end
  return t
end


-- The step a weights file (RUN/model.safetensors) says it holds: its
-- metadata's "transom.step", as a number (nil: no file, or no such key).
function S.weights_step(path)
  local st = S.read(path)
  if not st or #st < 8 then return nil end
  local header = st:sub(9, 8 + string.unpack("<I8", st))
  return tonumber(header:match('"transom%.step":"(%d+)"'))
end

return S
