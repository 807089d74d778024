-- data_spec.lua — token shards through the CLI: a job trains from a glob of
-- llm.c shards and from a list of nanoGPT files, resumes bit for bit across
-- shards, and refuses a damaged shard naming it. The shards hold the bytes of
-- the first 120 KB of data/fortunes.txt (setup.sh writes it) as uint16 token
-- ids (vocab_size 256), so no tokenizer is needed here (prepare_spec has one).
-- About 5 seconds on 2 cores.

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local BIN, ROOT, q, read, write = S.BIN, S.ROOT, S.q, S.read, S.write

local tmp = os.tmpname()
os.remove(tmp)
assert(os.execute("mkdir -p " .. q(tmp)))
local text = assert(read(ROOT .. "/data/fortunes.txt"), "run ./setup.sh: no data/fortunes.txt"):sub(1, 120000)

local function u16(s) -- the bytes of s as little-endian uint16 tokens
  local out = {}
  for i = 1, #s, 4096 do
    out[#out + 1] = string.pack("<" .. string.rep("I2", #s:sub(i, i + 4095)), s:byte(i, i + 4095))
  end
  return table.concat(out)
end

local function llmc(path, s, magic)
  write(path, string.pack("<i4i4i4", magic or 20240520, 1, #s) .. string.rep("\0", 1024 - 12) .. u16(s))
end

-- three shards of 40 KB each, in order
for i = 0, 2 do llmc(string.format("%s/fort_train_%06d.bin", tmp, i), text:sub(i * 40000 + 1, (i + 1) * 40000)) end
write(tmp .. "/train.bin", u16(text:sub(1, 100000)))
write(tmp .. "/val.bin", u16(text:sub(100001)))

local BASE = {
  "--set n_layer=1", "--set n_head=2", "--set n_embd=32", "--set block_size=32", "--set batch_size=4",
  "--set threads=1", "--set eval_interval=0", "--set eval_steps=2", "--set sample_tokens=0",
  "--set log_interval=10", "--set warmup_steps=5", "--set lr_decay_steps=40", "--set vocab_size=256",
}

local function run(dir, extra)
  return S.sh(table.concat({ BIN, "run", ROOT .. "/examples/fortunes.lua", "--set run_dir=" .. dir,
    table.concat(BASE, " "), extra }, " ") .. " 2>&1")
end

describe("token shards", function()
  teardown(function() os.execute("rm -rf " .. q(tmp)) end)

  it("a glob of llm.c shards trains, and a resume is bit-identical", function()
    local glob = tmp .. "/fort_train_*.bin"
    local out, rc = run(tmp .. "/a", "--set 'data=" .. glob .. "' --set max_steps=40 --set checkpoint.every_steps=10")
    assert.equal(0, rc, out)
    assert.matches("vocab 256", out)
    assert.matches("120000 tokens %(108000 train, 12000 val%)", out)
    assert.matches('"type":"tokens","vocab_size":256', read(tmp .. "/a/vocab.json"))
    local l = S.losses(tmp .. "/a")
    assert.equal(40, #l)
    local first, last = tonumber(l[1]:match("=(.*)")), tonumber(l[40]:match("=(.*)"))
    assert.is_true(first > 5.0 and last < first - 1.0, "loss " .. first .. " -> " .. last)
    out, rc = run(tmp .. "/b", "--set 'data=" .. glob .. "' --set max_steps=20 --set checkpoint.every_steps=10")
    assert.equal(0, rc, out)
    out, rc = S.sh(BIN .. " run --resume " .. tmp .. "/b --set max_steps=40 2>&1")
    assert.equal(0, rc, out)
    assert.matches("resumed from step 20", out)
    assert.same(l, S.losses(tmp .. "/b"))
  end)

  it("a job's list of nanoGPT files and val_data; sample prints ids without a tokenizer", function()
    local job = tmp .. "/list.lua"
    write(job, string.format([[return { data = { %q }, val_data = %q, vocab_size = 256, max_steps = 10,
      n_layer = 1, n_head = 2, n_embd = 32, block_size = 32, batch_size = 4, threads = 1, eval_interval = 0,
      eval_steps = 2, sample_tokens = 5, sample_prompt = "", warmup_steps = 2, run_dir = %q }]],
      tmp .. "/train.bin", tmp .. "/val.bin", tmp .. "/c"))
    local out, rc = S.sh(BIN .. " run " .. job .. " 2>&1")
    assert.equal(0, rc, out)
    assert.matches("120000 tokens %(100000 train, 20000 val%)", out)
    out, rc = S.sh(BIN .. " sample " .. tmp .. "/c --tokens 5 2>&1")
    assert.equal(0, rc, out)
    assert.matches("^%d+ %d+ %d+ %d+ %d+ \n$", out)
  end)

  it("transom prepare: text -> BPE shards + tokenizer; a job trains on them and sample decodes text", function()
    write(tmp .. "/a.txt", text:sub(1, 60000))
    write(tmp .. "/b.txt", text:sub(60001))
    local out, rc = S.sh(BIN .. " prepare " .. tmp .. "/a.txt " .. tmp .. "/b.txt -o " .. tmp .. "/bpe --vocab 600 "
      .. "--shard-tokens 20000 2>&1")
    assert.equal(0, rc, out)
    local ntok = tonumber(out:match("120000 bytes %-> (%d+) tokens"))
    assert.is_truthy(ntok, out)
    assert.is_true(ntok < 80000, "BPE shortens the text: " .. ntok .. " tokens")
    assert.matches('vocab_size = 600', out)
    -- shards hold every token once: the headers' counts add up
    local sum, shards = 0, 0
    for _, split in ipairs({ "train", "val" }) do
      for i = 0, 9 do
        local blob = read(string.format("%s/bpe/%s_%06d.bin", tmp, split, i))
        if blob then
          local magic, version, n = string.unpack("<i4i4i4", blob)
          assert.same({ 20240520, 1, 1024 + 2 * n }, { magic, version, #blob })
          sum, shards = sum + n, shards + 1
        end
      end
    end
    assert.equal(ntok, sum)
    local nval = math.floor(ntok * 0.1)
    assert.equal(-((nval - ntok) // 20000) + -(-nval // 20000), shards) -- at most 20000 tokens a shard
    out, rc = run(tmp .. "/p", "--set 'data=" .. tmp .. "/bpe/train_*.bin' --set 'val_data=" .. tmp
      .. "/bpe/val_*.bin' --set vocab_size=600 --set max_steps=60 --set sample_tokens=0")
    assert.equal(0, rc, out)
    assert.is_truthy(read(tmp .. "/p/tokenizer.bpe"), "the tokenizer is copied into the run")
    out, rc = S.sh(BIN .. " sample " .. tmp .. "/p --prompt 'The ' --tokens 40 --seed 3 2>&1")
    assert.equal(0, rc, out)
    -- decoded text: the prompt, then more than 40 bytes (tokens are several bytes), mostly letters
    assert.equal("The ", out:sub(1, 4))
    assert.is_true(#out > 60, out)
    local _, letters = out:gsub("[%a%s]", "")
    assert.is_true(letters > #out / 2, out)
  end)

  it("transom prepare refuses --shard-tokens past an int32 (the shard header's count)", function()
    write(tmp .. "/s.txt", text:sub(1, 2000))
    local out, rc = S.sh(BIN .. " prepare " .. tmp .. "/s.txt -o " .. tmp .. "/big --vocab 300 "
      .. "--shard-tokens 4294967296 2>&1")
    assert.equal(2, rc, out)
    assert.matches("%-%-shard%-tokens must be 1%.%.2147483647", out)
  end)

  -- the files of a directory, name -> contents
  local function files_of(d)
    local t = {}
    for name in S.sh("ls -A " .. q(d) .. " 2>/dev/null"):gmatch("[^\n]+") do t[name] = read(d .. "/" .. name) end
    return t
  end

  it("transom prepare replaces an earlier output in DIR, leaves it after a failure part-way, keeps other files", function()
    write(tmp .. "/w.txt", text:sub(1, 20000))
    local out, rc = S.sh(BIN .. " prepare " .. tmp .. "/w.txt -o " .. tmp .. "/whole --vocab 300 --shard-tokens 2000 2>&1")
    assert.equal(0, rc, out)
    local first = files_of(tmp .. "/whole")
    assert.truthy(first["train_000006.bin"], out)
    -- again with larger shards: the earlier output's train_000003..6.bin do not stay for a glob to take in
    out, rc = S.sh(BIN .. " prepare " .. tmp .. "/w.txt -o " .. tmp .. "/whole/ --vocab 300 --shard-tokens 5000 2>&1")
    assert.equal(0, rc, out)
    local second = files_of(tmp .. "/whole")
    assert.same({ "tokenizer.bpe", "train_000000.bin", "train_000001.bin", "train_000002.bin", "val_000000.bin" },
      (function() local n = {} for k in pairs(second) do n[#n + 1] = k end table.sort(n) return n end)())
    -- a failure part-way (a file size limit: the 3 KB shards fit, the 11 KB tokenizer does not) leaves the
    -- directory as it was, not new shards beside the old tokenizer, and no temporary directory in it or beside it
    out, rc = S.sh("trap '' XFSZ; ulimit -f 8; " .. BIN .. " prepare " .. tmp .. "/w.txt -o " .. tmp
      .. "/whole --vocab 1500 --shard-tokens 1000 2>&1")
    assert.equal(1, rc, out)
    assert.matches("tokenizer%.bpe.*File too large", out)
    assert.same(second, files_of(tmp .. "/whole"))
    assert.equal("whole\n", S.sh("cd " .. q(tmp) .. " && ls -d whole*"))
    -- a directory of other files takes the output beside them; they stay, and so do they on the next prepare
    assert(os.execute("mkdir -p " .. q(tmp .. "/mine") .. " && echo keep > " .. q(tmp .. "/mine/notes.txt")))
    for _ = 1, 2 do
      out, rc = S.sh(BIN .. " prepare " .. tmp .. "/w.txt -o " .. tmp .. "/mine --vocab 300 2>&1")
      assert.equal(0, rc, out)
      local mine = files_of(tmp .. "/mine")
      assert.equal("keep\n", mine["notes.txt"])
      assert.same(second["tokenizer.bpe"], mine["tokenizer.bpe"])
      assert.truthy(mine["train_000000.bin"] and mine["val_000000.bin"], out)
    end
  end)

  it("transom prepare writes into DIR as it is: '.', a symbolic link, a 2770 directory; a killed one's temp goes", function()
    write(tmp .. "/k.txt", text:sub(1, 6000))
    local function prepare(o, cd)
      return S.sh((cd and "cd " .. q(cd) .. " && " or "") .. BIN .. " prepare " .. tmp .. "/k.txt -o " .. o
        .. " --vocab 280 2>&1")
    end
    local function names(d)
      local n = {}
      for k in pairs(files_of(d)) do n[#n + 1] = k end
      table.sort(n)
      return table.concat(n, " ")
    end
    local shards = "tokenizer.bpe train_000000.bin val_000000.bin"
    -- the working directory (-o .): the output lands beside the files already there
    assert(os.execute("mkdir -p " .. q(tmp .. "/cwd") .. " && echo x > " .. q(tmp .. "/cwd/notes.txt")))
    local out, rc = prepare(".", tmp .. "/cwd")
    assert.equal(0, rc, out)
    assert.equal("notes.txt " .. shards, names(tmp .. "/cwd"))
    assert.matches('data = "%./train_%*%.bin"', out)
    -- a symbolic link to a directory stays a link; the files land in its target
    assert(os.execute("mkdir -p " .. q(tmp .. "/target") .. " && ln -sfn target " .. q(tmp .. "/link")))
    out, rc = prepare(tmp .. "/link")
    assert.equal(0, rc, out)
    assert.equal("target\n", S.sh("readlink " .. q(tmp .. "/link")))
    assert.equal(shards, names(tmp .. "/target"))
    -- a shared directory keeps its mode (setgid, group-writable) and its group
    assert(os.execute("mkdir -p " .. q(tmp .. "/shared") .. " && chmod 2770 " .. q(tmp .. "/shared")))
    local mode = S.sh("stat -c '%a %g' " .. q(tmp .. "/shared"))
    out, rc = prepare(tmp .. "/shared")
    assert.equal(0, rc, out)
    assert.equal(mode, S.sh("stat -c '%a %g' " .. q(tmp .. "/shared")))
    assert.equal("2770", mode:match("^%d+"))
    -- a temporary directory a killed prepare left is removed, never merged into the output
    assert(os.execute("mkdir -p " .. q(tmp .. "/shared/.prepare-1") .. " && echo old > "
      .. q(tmp .. "/shared/.prepare-1/train_000007.bin")))
    out, rc = prepare(tmp .. "/shared")
    assert.equal(0, rc, out)
    assert.equal(shards, names(tmp .. "/shared"))
  end)

  it("two transom prepares into one DIR at once: both finish, DIR holds the later one's output whole", function()
    -- The first is held inside its swap (TRANSOM_TEST_PREPARE_PAUSE: its old output gone, its new not yet in;
    -- until a file exists) while the second starts, tokenizes and comes to its swap, and let go once the second
    -- says it waits. (Before: the second took the first's live .prepare-* for a
    -- killed prepare's and removed it, so the first failed; and two swaps could interleave, leaving one's
    -- tokenizer beside the other's shards.) The second waits for the first's swap, then replaces it whole.
    write(tmp .. "/c1.txt", text:sub(1, 8000))
    write(tmp .. "/c2.txt", text:sub(8001, 20000))
    local function prepare(o, src, vocab, shard, env, log)
      local cmd = (env or "") .. BIN .. " prepare " .. tmp .. "/" .. src .. " -o " .. o .. " --vocab " .. vocab ..
        " --shard-tokens " .. shard
      if log then return S.spawn_rc(cmd, log) end
      return S.sh(cmd .. " 2>&1")
    end
    -- what each makes alone
    local out, rc = prepare(tmp .. "/alone1", "c1.txt", 300, 1000)
    assert.equal(0, rc, out)
    out, rc = prepare(tmp .. "/alone2", "c2.txt", 400, 3000)
    assert.equal(0, rc, out)
    local want = files_of(tmp .. "/alone2")
    assert.is_truthy(want["tokenizer.bpe"] and want["train_000000.bin"], out)
    local d, log1, log2, go = tmp .. "/both", tmp .. "/both1.log", tmp .. "/both2.log", tmp .. "/both.go"
    local ok, err = pcall(function()
      local _, rc1 = prepare(d, "c1.txt", 300, 1000, "env TRANSOM_TEST_PREPARE_PAUSE=" .. q(go) .. " ", log1)
      assert.is_truthy(S.wait_for(function() return (read(log1) or ""):find("swap paused", 1, true) end, S.T(60)),
        read(log1))
      local _, rc2 = prepare(d, "c2.txt", 400, 3000, nil, log2)
      local waited = S.wait_for(function() return (read(log2) or ""):find("waiting for it", 1, true) end, S.T(60))
      write(go, "")
      assert.is_truthy(waited, read(log2))
      assert.equal(0, S.wait_rc(rc1, S.T(60)), read(log1))
      assert.equal(0, S.wait_rc(rc2, S.T(60)), read(log2))
      assert.matches("'" .. (d .. "/.prepare.lock"):gsub("%p", "%%%0") .. "' is held by another process %(pid %d+%): "
        .. "waiting for it", read(log2))
    end)
    write(go, "")
    S.cleanup() -- a failed case leaves no prepare behind
    assert(ok, err)
    -- the second's output, whole: no shard of the first beside it, no temporary directory left
    assert.same(want, files_of(d))
  end)

  it("transom prepare refuses an empty text, a --val that leaves no val token, and --vocab with --tokenizer", function()
    write(tmp .. "/empty.txt", "")
    local out, rc = S.sh(BIN .. " prepare " .. tmp .. "/empty.txt -o " .. tmp .. "/none 2>&1")
    assert.equal(1, rc, out)
    assert.matches("no text to tokenize: .*empty%.txt is empty", out)
    assert.is_false(S.exists(tmp .. "/none"))
    write(tmp .. "/t.txt", text:sub(1, 3000))
    out, rc = S.sh(BIN .. " prepare " .. tmp .. "/t.txt -o " .. tmp .. "/none --vocab 300 --val 0.0001 2>&1")
    assert.equal(1, rc, out)
    assert.matches("3000 bytes of text are %d+ tokens, and %-%-val 0%.0001 of them leaves no val tokens", out)
    assert.not_matches("val_%*%.bin\"", out) -- no hint naming shards that were not written
    assert.is_false(S.exists(tmp .. "/none"))
    out, rc = S.sh(BIN .. " prepare " .. tmp .. "/t.txt -o " .. tmp .. "/tok --vocab 300 2>&1")
    assert.equal(0, rc, out)
    out, rc = S.sh(BIN .. " prepare " .. tmp .. "/t.txt -o " .. tmp .. "/none --tokenizer " .. tmp
      .. "/tok/tokenizer.bpe --vocab 999 2>&1")
    assert.equal(2, rc, out)
    assert.matches("%-%-vocab 999 with %-%-tokenizer .*tok/tokenizer%.bpe", out)
    assert.is_false(S.exists(tmp .. "/none"))
  end)

  it("a list of data files is checked like any key: file, line, item", function()
    local job = require("transom.job")
    local path = tmp .. "/badlist.lua"
    write(path, "return {\n  model = 'gpt',\n  data = { 'a.bin', 3 },\n  vocab_size = 256,\n}\n")
    local ok, e = pcall(job.load, path)
    assert.is_false(ok)
    assert.equal(path .. ":3: data[2] must be a string (a file or a glob), got number 3", e.msg)
    write(path, "return { data = {}, vocab_size = 256 }\n")
    ok, e = pcall(job.load, path)
    assert.is_false(ok)
    assert.matches("key 'data' is an empty list", e.msg)
  end)

  it("a damaged shard is an error naming it", function()
    llmc(tmp .. "/bad_000.bin", text:sub(1, 40000), 20240521)
    local out, rc = run(tmp .. "/d", "--set data=" .. tmp .. "/bad_000.bin --set max_steps=2")
    assert.equal(2, rc, out)
    assert.matches("key 'data'.*bad_000%.bin.*magic is 20240521", out)
    write(tmp .. "/bad_001.bin", read(tmp .. "/fort_train_000000.bin"):sub(1, 5000))
    out = run(tmp .. "/e", "--set data=" .. tmp .. "/bad_001.bin --set max_steps=2")
    assert.matches("bad_001%.bin' is truncated", out)
    -- the right magic, but a header cut short, or fewer tokens than it says
    write(tmp .. "/bad_002.bin", read(tmp .. "/fort_train_000000.bin"):sub(1, 600))
    out, rc = run(tmp .. "/g", "--set data=" .. tmp .. "/bad_002.bin --set max_steps=2")
    assert.equal(2, rc, out)
    assert.matches("bad_002%.bin' is truncated: 600 bytes, shorter than the 1024%-byte llm%.c shard header", out)
    assert.not_matches("magic", out)
    write(tmp .. "/bad_003.bin", read(tmp .. "/fort_train_000000.bin"):sub(1, 1024 + 2 * 100))
    out, rc = run(tmp .. "/h", "--set data=" .. tmp .. "/bad_003.bin --set max_steps=2")
    assert.equal(2, rc, out)
    assert.matches("bad_003%.bin' is truncated or damaged: its header says 40000 tokens %(81024 bytes%), the file has "
      .. "1224 bytes", out)
    out = run(tmp .. "/f", "--set data=" .. tmp .. "/fort_train_000000.bin --set vocab_size=100 --set max_steps=2")
    assert.matches("fort_train_000000%.bin': token %d+ .* is 1%d%d, not below vocab_size = 100", out)
  end)

  -- A text corpus's vocabulary is its bytes: vocab_size and tokenizer are
  -- token files' keys, refused rather than ignored (a run with vocab_size =
  -- 50257 on text trained a byte model and wrote 50257 into its job.lua).
  it("a text corpus refuses the token files' keys vocab_size and tokenizer", function()
    local corpus = tmp .. "/plain.txt"
    write(corpus, text:sub(1, 20000))
    local out, rc = run(tmp .. "/t1", "--set data=" .. corpus .. " --set max_steps=2") -- BASE sets vocab_size=256
    assert.equal(2, rc, out)
    assert.matches("vocab_size = 256 is for token files; '.-plain%.txt' is a text corpus", out)
    assert.is_false(S.exists(tmp .. "/t1"))
    out, rc = S.sh(table.concat({ BIN, "run", ROOT .. "/examples/fortunes.lua", "--set run_dir=" .. tmp .. "/t2",
      "--set data=" .. corpus, "--set tokenizer=" .. tmp .. "/none.bpe", "--set max_steps=2", "--set warmup_steps=0",
      "--set eval_steps=1", "--set sample_tokens=0" }, " ") .. " 2>&1")
    assert.equal(2, rc, out)
    assert.matches("key 'tokenizer': '.-none%.bpe' is for token files; data is a text corpus", out)
  end)
end)
