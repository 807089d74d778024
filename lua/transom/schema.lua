-- transom.schema — what every declarative file transom reads has in common:
-- the sandbox it runs in, structured errors that name the file, the line and
-- the key, typed and ranged values, and "did you mean" for a misspelled key.
--
-- Used by transom.job (job files) and transom.sim (simulation scenarios);
-- each keeps its own schema and cross-field checks. Policy files (rules,
-- actions, restart) are not declarative: they go through the policy engine
-- (core/lua/policy.c) instead.

local M = {}

-- --- errors ---------------------------------------------------------------

-- Raises a structured error: {msg = "file:line: text", source = file, line = n}
function M.fail(source, line, fmt, ...)
  local where = source
  if line then where = source .. ":" .. line end
  error({ msg = where .. ": " .. string.format(fmt, ...), source = source, line = line }, 0)
end

-- Line of `key =` in the source text (first occurrence), or nil.
function M.line_of(src, key)
  if not src or type(key) ~= "string" then return nil end
  local k = key:gsub("%p", "%%%0") -- a literal in patterns
  local n = 0
  for line in (src .. "\n"):gmatch("([^\n]*)\n") do
    n = n + 1
    -- blank out short strings, then drop the comment: a key named inside a
    -- string value or a comment is not the key
    local code = line:gsub('"[^"]*"', '""'):gsub("'[^']*'", "''"):gsub("%-%-.*$", "")
    if code:find("%f[%w_]" .. k .. "%s*=[^=]") or code:find("%f[%w_]" .. k .. "%s*=$")
      or line:gsub("%-%-[^\"']*$", ""):find("%[%s*[\"']" .. k .. "[\"']%s*%]%s*=") then
      return n
    end
  end
  return nil
end

local function distance(a, b) -- Levenshtein, for "did you mean"
  local prev = {}
  for j = 0, #b do prev[j] = j end
  for i = 1, #a do
    local cur = { [0] = i }
    for j = 1, #b do
      local cost = a:sub(i, i) == b:sub(j, j) and 0 or 1
      cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
    end
    prev = cur
  end
  return prev[#b]
end

-- " (did you mean 'x'?)" for the nearest of `names` (a list), or of the
-- fields `aliases` (alias -> field) stands for; "" when nothing is near.
function M.suggest(key, names, aliases)
  local best, bd = nil, 4
  for _, name in ipairs(names) do
    local d = distance(key, name)
    if d < bd then best, bd = name, d end
  end
  for alias, field in pairs(aliases or {}) do
    local d = distance(key, alias)
    if d < bd or (d == bd and best and field < best) then best, bd = field, d end
  end
  return best and string.format(" (did you mean '%s'?)", best) or ""
end

-- --- values ---------------------------------------------------------------

local function type_ok(ty, v)
  if ty == "integer" then return math.type(v) == "integer" end
  if ty == "number" then return type(v) == "number" and v == v and v ~= math.huge and v ~= -math.huge end
  return type(v) == ty
end

function M.describe(v)
  if type(v) == "string" then return string.format("the string %q", v) end
  if math.type(v) == "float" then return "the number " .. tostring(v) end
  return type(v) .. " " .. tostring(v)
end

-- Integers without a max of their own stop at C's INT_MAX: the C side
-- keeps many of them in an int (a larger value would wrap there).
M.INT_MAX = 2147483647

-- Checks v against field f = { key, type, default, help, min=, max=, gt=,
-- lt=, enum= }; where(fmt, ...) raises the error at the right place.
function M.check_value(f, v, where)
  local key, ty = f[1], f[2]
  if ty == "number" and type(v) == "number" and (v == math.huge or v == -math.huge) then
    where("key '%s' must be a finite number, got %s", key, tostring(v))
  end
  if not type_ok(ty, v) then
    where("key '%s' must be %s %s, got %s", key, ty == "integer" and "an" or "a", ty, M.describe(v))
  end
  local nul = ty == "string" and v:find("\0", 1, true)
  if nul then -- C reads strings up to their first NUL: the rest would be dropped without a word
    where("key '%s' holds a NUL byte (byte %d of %d): a string here cannot", key, nul, #v)
  end
  if f.min and v < f.min then where("key '%s' must be >= %s, got %s", key, tostring(f.min), tostring(v)) end
  local max = f.max or (ty == "integer" and M.INT_MAX or nil)
  if max and v > max then where("key '%s' must be <= %s, got %s", key, tostring(max), tostring(v)) end
  if f.gt and not (v > f.gt) then where("key '%s' must be > %s, got %s", key, tostring(f.gt), tostring(v)) end
  if f.lt and not (v < f.lt) then where("key '%s' must be < %s, got %s", key, tostring(f.lt), tostring(v)) end
  if f.enum then
    local ok = false
    for _, e in ipairs(f.enum) do ok = ok or v == e end
    if not ok then where("key '%s' must be one of %s, got %q", key, table.concat(f.enum, ", "), v) end
  end
end

-- --- loading --------------------------------------------------------------

local function copy(t)
  local c = {}
  for k, v in pairs(t) do c[k] = v end
  return c
end

-- A declarative file's sandbox: pure functions only; undefined globals raise.
function M.sandbox()
  local env = { -- copies: a file must not change the host's libraries
    math = copy(math), string = copy(string), table = copy(table), utf8 = copy(utf8),
    ipairs = ipairs, pairs = pairs, next = next, select = select, type = type,
    tostring = tostring, tonumber = tonumber, error = error, assert = assert,
    pcall = pcall, print = print,
    os = { getenv = os.getenv, time = os.time, date = os.date },
  }
  return setmetatable(env, {
    __index = function(_, k) error(string.format("undefined global '%s'", tostring(k)), 2) end,
  })
end

-- The text of the file path; raises a structured error naming it when it
-- cannot be opened or read (a directory opens, then reads as nil). `what`
-- names the file in messages ("job file").
function M.read_source(path, what)
  local f, err = io.open(path, "rb")
  if not f then M.fail(path, nil, "cannot open the %s: %s", what, err) end
  local src, rerr = f:read("a")
  f:close()
  if not src then M.fail(path, nil, "cannot read the %s: %s", what, tostring(rerr or "read failed")) end
  return src
end

-- Reads path and runs it in a fresh sandbox. Returns what the chunk returned
-- and the source text; raises a structured error naming the file (and the
-- line, when Lua gave one). `what` names the file in messages ("job file").
function M.run_file(path, what)
  local src = M.read_source(path, what)
  -- Lua's messages start "path:line:" (a long path shortened to "...tail");
  -- restore the full path and keep the line as a field too.
  local function lua_error(msg)
    local where, line, rest = msg:match("^(.-):(%d+):(.*)$")
    if where and (where == path or (where:sub(1, 3) == "..." and path:sub(-(#where - 3)) == where:sub(4))) then
      error({ msg = path .. ":" .. line .. ":" .. rest, source = path, line = tonumber(line) }, 0)
    end
    error({ msg = path .. ": " .. msg, source = path }, 0)
  end
  local chunk, cerr = load(src, "@" .. path, "t", M.sandbox())
  if not chunk then lua_error(cerr) end
  local ok, value = pcall(chunk)
  if not ok then
    lua_error(type(value) == "table" and tostring(value.msg) or tostring(value))
  end
  return value, src
end

return M
