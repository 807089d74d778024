-- support.lua — what the process-level specs share: the binary under test,
-- the repository root, the corpus, running shell commands, reading and
-- writing files. Loaded with dofile by ckpt_spec, operator_spec,
-- attach_spec and eagle_spec (busted does not run it: no _spec suffix).

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

return S
