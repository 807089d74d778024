-- e2e_spec.lua — end to end through the CLI: `transom run` trains a tiny GPT
-- on 200 KB of Tiny Shakespeare (also at threads=2), `transom sample`
-- generates from the saved run; every command's --help and unknown options.
-- About 8 seconds on 2 cores (four 200-step runs at ~1 s each, two 80-step
-- runs on 2 threads).
--
-- The corpus is ../shared/data/tinyshakespeare.txt relative to the repository
-- root; without it every test here is pending, not failed.

local job = require("transom.job")

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local BIN, q, exists, write = S.BIN, S.q, S.exists, S.write
local function read(path) return assert(S.read(path), "cannot read " .. path) end

local CORPUS = S.CORPUS
local SLICE = 200 * 1024

-- The tiny GPT every run here uses (plus data and run_dir).
local BASE = {
  model = "gpt", n_layer = 2, n_head = 2, n_embd = 64, block_size = 32, batch_size = 8,
  threads = 1, max_steps = 200, eval_interval = 100, sample_tokens = 50, log_interval = 50,
}

describe("end to end", function()
  local dir, data, corpus_text
  local runs = {} -- name -> {code, out, err, dir}

  setup(function()
    local f = io.open(CORPUS, "rb")
    if f then
      corpus_text = f:read(SLICE)
      f:close()
    end
    dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir -p " .. q(dir)))
    if corpus_text then
      data = dir .. "/shakespeare-200k.txt"
      write(data, corpus_text)
    end
  end)

  teardown(function()
    if dir then os.execute("rm -rf " .. q(dir)) end
  end)

  local function need_corpus()
    if not corpus_text then pending("no corpus at " .. CORPUS .. ": end-to-end tests skipped") end
    assert.are.equal(SLICE, #corpus_text)
  end

  -- Runs the binary; returns exit status, stdout, stderr.
  local function transom(...) return S.transom(dir, ...) end

  -- Writes a job file of BASE + over and runs it once per name (memoized).
  local function run(name, over)
    if runs[name] then return runs[name] end
    local cfg = { data = data, run_dir = dir .. "/" .. name }
    for k, v in pairs(BASE) do cfg[k] = v end
    for k, v in pairs(over or {}) do cfg[k] = v end
    local lines = { "return {" }
    for k, v in pairs(cfg) do lines[#lines + 1] = string.format("  %s = %q,", k, v) end
    lines[#lines + 1] = "}"
    local path = dir .. "/" .. name .. ".lua"
    write(path, table.concat(lines, "\n") .. "\n")
    local code, out, err = transom("run", path)
    runs[name] = { code = code, out = out, err = err, dir = cfg.run_dir, job = path }
    return runs[name]
  end

  -- metrics.jsonl: step lines {step, loss (string)} and val lines {step, val}
  local function metrics(r)
    local steps, vals = {}, {}
    for line in io.lines(r.dir .. "/metrics.jsonl") do
      local step = tonumber(line:match('^{"step":(%d+),'))
      local loss = line:match('"loss":([^,}]+)')
      local val = line:match('"val_loss":([^,}]+)')
      assert(step and (loss or val), "bad metrics line: " .. line)
      if loss then steps[#steps + 1] = { step = step, loss = loss } end
      if val then vals[#vals + 1] = { step = step, val = tonumber(val) } end
    end
    return steps, vals
  end

  local function mean_loss(steps, from, to)
    local s = 0
    for i = from, to do s = s + tonumber(steps[i].loss) end
    return s / (to - from + 1)
  end

  local function loss_strings(steps)
    local t = {}
    for i, s in ipairs(steps) do t[i] = s.loss end
    return t
  end

  -- The entropy of the corpus slice's byte frequencies: the loss of the best
  -- model that ignores context. A model that learned anything beats it.
  local function unigram_entropy()
    local count = {}
    for i = 1, #corpus_text do
      local b = corpus_text:byte(i)
      count[b] = (count[b] or 0) + 1
    end
    local h = 0
    for _, c in pairs(count) do
      local p = c / #corpus_text
      h = h - p * math.log(p)
    end
    return h
  end

  it("trains: exits 0, logs 200 steps, and the loss falls", function()
    need_corpus()
    local r = run("a")
    assert.are.equal(0, r.code, r.err .. r.out)
    assert.is_truthy(r.out:find("step 200/200", 1, true), r.out)
    local steps, vals = metrics(r)
    assert.are.equal(200, #steps)
    for i, s in ipairs(steps) do assert.are.equal(i, s.step) end
    -- validation after steps 100 and 200 (eval_interval = 100)
    assert.are.equal(2, #vals)
    assert.are.same({ 100, 200 }, { vals[1].step, vals[2].step })

    local first, last = mean_loss(steps, 1, 10), mean_loss(steps, 181, 200)
    -- at init the model is near uniform over the vocabulary
    local V = tonumber(r.out:match("vocab (%d+)"))
    assert.is_true(math.abs(first - math.log(V)) < 0.2, string.format("first 10 steps: %.3f, log V = %.3f", first,
      math.log(V)))
    -- A real run drops ~1.5 nats (4.1 -> 2.6). Learning only the byte
    -- frequencies would drop ~0.8 and end at the unigram entropy (~3.3).
    local H = unigram_entropy()
    assert.is_true(first - last >= 1.1, string.format("loss fell only %.3f (%.3f -> %.3f)", first - last, first, last))
    assert.is_true(last < H - 0.3, string.format("last 20 steps %.3f, unigram entropy %.3f", last, H))
    assert.is_true(vals[2].val < H - 0.3, string.format("val loss %.3f, unigram entropy %.3f", vals[2].val, H))
    assert.is_true(vals[2].val < vals[1].val, "val loss did not fall from step 100 to 200")
  end)

  it("writes job.lua, vocab.json and model.safetensors", function()
    need_corpus()
    local r = run("a")
    assert.are.equal(0, r.code, r.err)
    for _, f in ipairs({ "job.lua", "vocab.json", "model.safetensors", "metrics.jsonl" }) do
      assert.is_true(exists(r.dir .. "/" .. f), "missing " .. f)
    end

    -- job.lua: the resolved job, loadable, equal to the job file's
    assert.are.same(job.load(r.job), job.load(r.dir .. "/job.lua"))

    -- vocab.json: the slice's distinct bytes, in order
    local seen, want = {}, {}
    for i = 1, #corpus_text do seen[corpus_text:byte(i)] = true end
    for b = 0, 255 do if seen[b] then want[#want + 1] = b end end
    local got = {}
    for b in read(r.dir .. "/vocab.json"):match('"tokens":%[([%d,]*)%]'):gmatch("%d+") do got[#got + 1] = tonumber(b) end
    assert.are.same(want, got)
    local V, C, T, L = #want, BASE.n_embd, BASE.block_size, BASE.n_layer

    -- model.safetensors: a header naming every GPT parameter, then the data
    local st = read(r.dir .. "/model.safetensors")
    local hlen = string.unpack("<I8", st)
    local header = st:sub(9, 8 + hlen)
    assert.is_truthy(header:find('"transom.step":"200"', 1, true), header:sub(1, 200))
    local n, elems, ends = 0, 0, {}
    for name, shape, b, e in header:gmatch('"([^"]+)":{"dtype":"F32","shape":%[([%d,]+)%],"data_offsets":%[(%d+),(%d+)%]}') do
      local size = 1
      for d in shape:gmatch("%d+") do size = size * tonumber(d) end
      assert.are.equal(4 * size, tonumber(e) - tonumber(b), name)
      n, elems = n + 1, elems + size
      ends[#ends + 1] = tonumber(e)
    end
    assert.are.equal(2 + 12 * L + 2, n)
    assert.is_truthy(header:find('"transformer.wte.weight":{"dtype":"F32","shape":[' .. V .. ',' .. C .. ']', 1, true))
    local nparams = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    assert.are.equal(nparams, elems)
    assert.is_truthy(r.out:find(nparams .. " parameters", 1, true), r.out)
    assert.are.equal(8 + hlen + 4 * nparams, #st)
    assert.are.equal(4 * nparams, math.max(table.unpack(ends)))
  end)

  it("is bit-reproducible for a seed (threads=1), and a new seed changes it", function()
    need_corpus()
    local a, b, c = run("a"), run("b"), run("c", { seed = 7 })
    assert.are.equal(0, a.code, a.err)
    assert.are.equal(0, b.code, b.err)
    assert.are.equal(0, c.code, c.err)
    local la, lb, lc = loss_strings((metrics(a))), loss_strings((metrics(b))), loss_strings((metrics(c)))
    assert.are.equal(200, #lb)
    assert.are.same(la, lb)
    assert.are.equal(read(a.dir .. "/model.safetensors"), read(b.dir .. "/model.safetensors"))
    assert.are.equal(200, #lc)
    assert.are_not.same(la, lc)
    assert.are_not.equal(la[1], lc[1]) -- a new seed: new init and batches from step 1
  end)

  it("samples from a saved run", function()
    need_corpus()
    local r = run("a")
    assert.are.equal(0, r.code, r.err)
    local code, out, err = transom("sample", r.dir, "--prompt", "ROMEO:", "--tokens", "40")
    assert.are.equal(0, code, err)
    assert.are.equal("ROMEO:", out:sub(1, 6))
    assert.are.equal(6 + 40 + 1, #out) -- byte tokens, then a newline
    local vocab = {}
    for i = 1, #corpus_text do vocab[corpus_text:sub(i, i)] = true end
    for i = 7, 46 do assert.is_true(vocab[out:sub(i, i)], "sampled a byte outside the vocabulary") end

    -- the same seed gives the same text; another seed another text
    local _, again = transom("sample", r.dir, "--prompt", "ROMEO:", "--tokens", "40")
    assert.are.equal(out, again)
    local _, other = transom("sample", r.dir, "--prompt", "ROMEO:", "--tokens", "40", "--seed", "99")
    assert.are_not.equal(out, other)
  end)

  it("saves the final weights: `transom sample` repeats the run's own sample", function()
    need_corpus()
    local r = run("a")
    assert.are.equal(0, r.code, r.err)
    -- the run ends with its job's sample (prompt "\n", 50 tokens, seed, T=1)
    local in_run = r.out:match("%-%-%- sample %(50 tokens, temperature 1%.00%) %-%-%-\n(.-)run directory:")
    assert.is_truthy(in_run, r.out)
    local code, out, err = transom("sample", r.dir, "--tokens", "50")
    assert.are.equal(0, code, err)
    assert.are.equal(1 + 50 + 1, #out)
    assert.are.equal(in_run, out)
  end)

  it("refuses a prompt character outside the vocabulary, naming it", function()
    need_corpus()
    local r = run("a")
    assert.are.equal(0, r.code, r.err)
    local missing
    for c in ("~#@%^{}<>|"):gmatch(".") do
      if not corpus_text:find(c, 1, true) then missing = c break end
    end
    assert(missing, "every candidate character is in the corpus slice")
    local code, out, err = transom("sample", r.dir, "--prompt", "ROMEO" .. missing, "--tokens", "10")
    assert.are_not.equal(0, code)
    assert.are.equal("", out)
    assert.is_truthy(err:find("'" .. missing .. "'", 1, true), err)
    assert.is_truthy(err:find("vocabulary", 1, true), err)
  end)

  it("threads=2 trains, bit-reproducibly at that thread count", function()
    need_corpus()
    -- README: "Results are bit-identical for a fixed thread count"
    local over = { threads = 2, max_steps = 80, warmup_steps = 20, eval_interval = 0, sample_tokens = 0 }
    local a, b = run("t2a", over), run("t2b", over)
    assert.are.equal(0, a.code, a.err)
    assert.are.equal(0, b.code, b.err)
    assert.is_truthy(a.out:find(" 2 threads", 1, true), a.out)
    local la, lb = loss_strings((metrics(a))), loss_strings((metrics(b)))
    assert.are.equal(80, #la)
    assert.are.same(la, lb)
    assert.are.equal(read(a.dir .. "/model.safetensors"), read(b.dir .. "/model.safetensors"))
    local steps = metrics(a)
    assert.is_true(mean_loss(steps, 1, 10) - mean_loss(steps, 71, 80) >= 0.5, "the loss did not fall")
    -- threads = 0: all cores
    local nproc = tonumber((S.sh("nproc")))
    local code, out, err = transom("run", a.job, "--set", "threads=0", "--set", "max_steps=1", "--set", "warmup_steps=0",
      "--set", "run_dir=" .. dir .. "/t0")
    assert.are.equal(0, code, err)
    assert.is_truthy(out:find(" " .. nproc .. " thread", 1, true), out)
  end)

  it("rejects a data file smaller than the block size, writing nothing", function()
    -- needs no corpus
    local tiny = dir .. "/tiny.txt"
    write(tiny, "First Citizen:\nBefore we\n") -- 25 bytes < block_size 32
    local run_dir = dir .. "/tiny-run"
    local path = dir .. "/tiny.lua"
    write(path, string.format("return { data = %q, run_dir = %q, block_size = 32, n_layer = 1, n_head = 1, n_embd = 8 }\n",
      tiny, run_dir))
    local code, out, err = transom("run", path)
    assert.are.equal(2, code, err)
    assert.are.equal("", out)
    assert.is_truthy(err:find("'data'", 1, true), err)
    assert.is_truthy(err:find(tiny, 1, true), err)
    assert.is_truthy(err:find("too small", 1, true), err)
    assert.is_false(exists(run_dir), "a rejected job created " .. run_dir)

    -- and a missing one
    write(path, string.format("return { data = %q, run_dir = %q }\n", dir .. "/absent.txt", run_dir))
    code, out, err = transom("run", path)
    assert.are.equal(2, code, err)
    assert.is_truthy(err:find("'data'", 1, true), err)
    assert.is_false(exists(run_dir))
  end)
end)

describe("the command line", function()
  local dir
  setup(function()
    dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir -p " .. q(dir)))
  end)
  teardown(function()
    if dir then os.execute("rm -rf " .. q(dir)) end
  end)

  -- the commands `transom --help` lists (its lines "  NAME ...")
  local function commands()
    local code, out, err = S.transom(dir, "--help")
    assert.are.equal(0, code, err)
    assert.is_truthy(out:find("usage: transom COMMAND", 1, true), out)
    local cmds = {}
    for name in out:gmatch("\n  ([%w][%w%-]*)") do cmds[#cmds + 1] = name end
    return cmds
  end

  it("transom --help lists every command; each one's --help prints its usage and exits 0", function()
    local cmds = commands()
    assert.are.same({ "run", "sample", "prepare", "export", "ckpt", "attach", "plot", "chaos", "sim", "worker", "agent",
      "plan", "stage", "test", "lua", "ftar-bench", "version" }, cmds)
    for _, cmd in ipairs(cmds) do
      for _, flag in ipairs({ "--help", "-h" }) do
        local code, out, err = S.transom(dir, cmd, flag)
        assert.are.equal(0, code, cmd .. " " .. flag .. ": " .. err)
        assert.is_truthy(out:find("^usage: transom " .. cmd:gsub("%-", "%%-")), cmd .. " " .. flag .. ": " .. out)
        assert.are.equal("", err, cmd .. " " .. flag)
      end
    end
  end)

  it("an unknown option exits non-zero with a message naming it, for every command", function()
    for _, cmd in ipairs(commands()) do
      local code, out, err = S.transom(dir, cmd, "--no-such-option")
      assert.are_not.equal(0, code, cmd .. ": " .. out .. err)
      assert.is_truthy(err:find("--no-such-option", 1, true), cmd .. ": " .. err)
    end
    local code, _, err = S.transom(dir, "--no-such-option")
    assert.are.equal(2, code)
    assert.is_truthy(err:find("'--no-such-option'", 1, true), err)
  end)

  it("a flag given without its value says so, naming the flag (not 'unknown option')", function()
    for _, c in ipairs({
      { "run", "base.lua", "--set" }, { "run", "base.lua", "--replicas" }, { "run", "--resume" },
      { "sample", "RUN", "--tokens" }, { "sample", "RUN", "--prompt" }, { "sample", "RUN", "--seed" },
      { "sample", "RUN", "--temperature" }, { "export", "RUN", "--hf" }, { "prepare", "a.txt", "-o" },
      { "prepare", "a.txt", "-o", "out", "--vocab" }, { "prepare", "a.txt", "--tokenizer" },
      { "prepare", "a.txt", "--val" }, { "prepare", "a.txt", "--shard-tokens" }, { "attach", "RUN", "-e" },
      { "plot", "RUN", "--size" }, { "plot", "RUN", "-o" }, { "sim", "s.lua", "--seeds" }, { "sim", "s.lua", "--set" },
      { "plan", "job.lua", "--set" },
    }) do
      local code, out, err = S.transom(dir, table.unpack(c))
      local what = table.concat(c, " ") .. ": " .. out .. err
      assert.are.equal(2, code, what)
      assert.is_truthy(err:find("transom " .. c[1] .. ": " .. c[#c] .. " needs a value", 1, true), what)
      assert.is_falsy(err:find("unknown", 1, true), what)
    end
    -- a value that looks like a flag is still the value
    local code, _, err = S.transom(dir, "sample", dir .. "/none", "--prompt", "--tokens")
    assert.are.equal(1, code, err)
    assert.is_truthy(err:find("none/job.lua", 1, true), err)
  end)

  it("transom agent refuses a number flag that is not a whole integer in range, naming the flag", function()
    -- no operator is contacted: each case is a usage error (exit 2) before any connect
    local op = { "--operator", "127.0.0.1:1" }
    for _, c in ipairs({
      { "--slots", "abc", "1..64" }, { "--slots", "2x", "1..64" }, { "--slots", "0", "1..64" },
      { "--slots", "65", "1..64" }, { "--cores", "-1", "1..1048576" }, { "--cores", "", "1..1048576" },
      { "--gpus", "two", "0..1048576" }, { "--gpus", "99999999999", "0..1048576" },
    }) do
      local code, out, err = S.transom(dir, "agent", op[1], op[2], c[1], c[2])
      assert.are.equal(2, code, table.concat(c, " ") .. ": " .. out .. err)
      local want = "transom agent: " .. c[1] .. " '" .. c[2] .. "' is not an integer in " .. c[3]
      assert.is_truthy(err:find(want, 1, true), want .. " in: " .. err)
    end
    local code, _, err = S.transom(dir, "agent", op[1], op[2], "--slots")
    assert.are.equal(2, code, err)
    assert.is_truthy(err:find("transom agent: --slots needs a value", 1, true), err)
    -- a name travels in control lines, whose values end at a space: a host name's characters only, and one
    -- that fits (before: "a b" registered as "a", a 70-character name was cut at 63 without a word)
    for _, name in ipairs({ "a b", "x=y", "", string.rep("x", 64) }) do
      code, _, err = S.transom(dir, "agent", op[1], op[2], "--name", name)
      assert.are.equal(2, code, name .. ": " .. err)
      assert.is_truthy(err:find("transom agent: --name '" .. name .. "': a host name is 1 to 63", 1, true), err)
    end
  end)

  it("transom worker and the operator refuse a slot, thread count, RANK or MASTER_PORT that is not an integer", function()
    -- usage errors before any connect (atoi once took "1x" for slot 1 and "abc" for port 0, any port)
    for _, c in ipairs({ { "--slot", "1x", "0..4096" }, { "--slot", "", "0..4096" }, { "--threads", "0", "1..4096" },
      { "--threads", "two", "1..4096" } }) do
      local code, out, err = S.transom(dir, "worker", "--operator", "127.0.0.1:1", c[1], c[2])
      assert.are.equal(2, code, table.concat(c, " ") .. ": " .. out .. err)
      local want = "transom worker: " .. c[1] .. " '" .. c[2] .. "' is not an integer in " .. c[3]
      assert.is_truthy(err:find(want, 1, true), want .. " in: " .. err)
    end
    local out, rc = S.sh("RANK=abc MASTER_ADDR=127.0.0.1 MASTER_PORT=1 " .. S.q(BIN) .. " worker 2>&1")
    assert.are.equal(2, rc, out)
    assert.is_truthy(out:find("RANK / SLURM_PROCID 'abc' is not an integer", 1, true), out)
    out, rc = S.sh("MASTER_PORT=29x " .. S.q(BIN) .. " run " .. S.ROOT .. "/examples/shakespeare.lua --replicas 2 " ..
      "--set max_steps=1 --set data=" .. S.q(CORPUS) .. " --set run_dir=" .. dir .. "/mp 2>&1")
    assert.are_not.equal(0, rc, out)
    assert.is_truthy(out:find("MASTER_PORT '29x' is not a port number", 1, true), out)
  end)

  it("transom run --help lists every job key with its type, default and meaning", function()
    local code, out, err = S.transom(dir, "run", "--help")
    assert.are.equal(0, code, err)
    local function row(prefix, name)
      return out:match("\n" .. prefix .. name:gsub("%p", "%%%0") .. " +([^\n]*)")
    end
    local policies = {}
    for _, f in ipairs(job.SCHEMA) do
      local line = row("  ", f[1])
      assert.is_truthy(line, "no row for '" .. f[1] .. "'")
      local typ, default, meaning = line:match("^(%S+) +(%S+) +(.*)$")
      assert.are.equal(f[2], typ, f[1])
      assert.are.equal(f[4], meaning, f[1])
      if type(f[3]) == "number" or type(f[3]) == "boolean" then assert.are.equal(tostring(f[3]), default, f[1]) end
      if f[3] == nil and f[2] ~= "table" then assert.are.equal(f.optional and "-" or "required", default, f[1]) end
      if f.policy then
        local path = assert(package.searchpath("policies." .. f.policy, package.path))
        policies[f[1]] = assert(loadfile(path, "t", {}))()
      end
      for _, sf in ipairs(f.fields or {}) do
        local sline = row("    %.", sf[1])
        assert.is_truthy(sline, "no row for '" .. f[1] .. "." .. sf[1] .. "'")
        local styp, sdefault, smeaning = sline:match("^(%S+) +(%S+) +(.*)$")
        assert.are.equal(sf[2], styp, sf[1])
        assert.are.equal(sf[4], smeaning, sf[1])
        local want = f.policy and policies[f[1]][sf[1]] or sf[3]
        if want == nil then want = "required" elseif type(want) == "string" then want = string.format("%q", want) end
        if type(want) == "table" then want = next(want) == nil and "{}" or "{...}" end
        assert.are.equal(tostring(want), sdefault, f[1] .. "." .. sf[1])
      end
    end
  end)
end)
