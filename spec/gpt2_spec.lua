-- gpt2_spec.lua — examples/gpt2.lua, GPT-2 small's job, from BPE shards.
-- Always: GPT-2's vocabulary (50257, padded to 50304) and 12 heads, at
-- width 192, 2 layers and context 64, train 5 steps on the CPU (the
-- parameter count is the formula's, the first loss is ln(50304) at init, it
-- falls) and export as a Hugging Face GPT-2 of vocab 50257. With TRANSOM_LONG=1
-- (./test.sh --long): the real shapes, 12 layers and context 1024, one step
-- (124,475,904 parameters; 90 to 150 s and about 10 GB of memory on 2 cores), its
-- export loaded by transformers when a Python with it is at hand (124,439,808
-- parameters: GPT-2's own count). The default case takes about 3 seconds.

local S = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec") .. "/support.lua")
local BIN, ROOT, q, read, write = S.BIN, S.ROOT, S.q, S.read, S.write

local tmp = os.tmpname()
os.remove(tmp)
assert(os.execute("mkdir -p " .. q(tmp)))

-- V*C + T*C + L*(12C^2 + 13C) + 2C: embeddings, blocks, final norm (the head is tied)
local function gpt_params(V, T, L, C) return V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C end

local function prepare()
  if S.exists(tmp .. "/bpe/tokenizer.bpe") then return end
  write(tmp .. "/corpus.txt", assert(read(ROOT .. "/data/fortunes.txt")):sub(1, 300000))
  local out, rc = S.sh(BIN .. " prepare " .. tmp .. "/corpus.txt -o " .. tmp .. "/bpe --vocab 1024 2>&1")
  assert.equal(0, rc, out)
end

local function run(dir, extra)
  return S.sh(table.concat({ BIN, "run", ROOT .. "/examples/gpt2.lua", "--set 'data=" .. tmp .. "/bpe/train_*.bin'",
    "--set 'val_data=" .. tmp .. "/bpe/val_*.bin'", "--set batch_size=1 --set warmup_steps=1 --set eval_interval=0",
    "--set eval_steps=1 --set sample_tokens=0 --set threads=2 --set log_interval=1",
    "--set run_dir=" .. dir, extra }, " ") .. " 2>&1")
end

describe("GPT-2 small (examples/gpt2.lua)", function()
  teardown(function() os.execute("rm -rf " .. q(tmp)) end)

  it("GPT-2's vocabulary and heads, 2 layers, width 192, context 64: trains and exports", function()
    prepare()
    local out, rc = run(tmp .. "/small", "--set n_layer=2 --set n_embd=192 --set block_size=64 --set max_steps=5 "
      .. "--set lr=3e-3 --set min_lr=3e-3")
    assert.equal(0, rc, out)
    local n = tonumber(out:match("model gpt: (%d+) parameters, vocab 50257"))
    assert.equal(gpt_params(50304, 64, 2, 192), n, out)
    local losses = {}
    for l in out:gmatch("step %d+/5 | loss ([%d.]+)") do losses[#losses + 1] = tonumber(l) end
    assert.equal(5, #losses, out)
    assert.is_true(math.abs(losses[1] - math.log(50304)) < 0.5, "first loss " .. losses[1])
    assert.is_true(losses[5] < losses[1] - 0.3, "loss " .. losses[1] .. " -> " .. losses[5])
    out, rc = S.sh(BIN .. " export " .. tmp .. "/small --hf " .. tmp .. "/small-hf 2>&1")
    assert.equal(0, rc, out)
    local cfg = read(tmp .. "/small-hf/config.json")
    assert.matches('"vocab_size": 50257', cfg)
    assert.matches('"n_embd": 192', cfg)
    -- the token table is written without its 47 padding rows
    local st = read(tmp .. "/small-hf/model.safetensors")
    local hlen = string.unpack("<I8", st)
    assert.matches('"transformer%.wte%.weight":{"dtype":"F32","shape":%[50257,192%]', st:sub(9, 8 + hlen))
  end)

  it("the real shapes: 12 layers, context 1024, one step (TRANSOM_LONG=1)", function()
    if not os.getenv("TRANSOM_LONG") then
      return pending("GPT-2 124M at context 1024: ~90 s and ~10 GB; ./test.sh --long runs it")
    end
    prepare()
    local out, rc = run(tmp .. "/full", "--set max_steps=1")
    assert.equal(0, rc, out)
    assert.equal(124475904, tonumber(out:match("model gpt: (%d+) parameters")), out)
    assert.equal(gpt_params(50304, 1024, 12, 768), 124475904)
    out, rc = S.sh(BIN .. " export " .. tmp .. "/full --hf " .. tmp .. "/full-hf 2>&1")
    assert.equal(0, rc, out)
    assert.matches('"n_positions": 1024', read(tmp .. "/full-hf/config.json"))
    local py = os.getenv("TRANSOM_HF_PYTHON")
      or ((os.getenv("XDG_CACHE_HOME") or ((os.getenv("HOME") or "") .. "/.cache")) .. "/transom/hfvenv/bin/python")
    if select(2, S.sh(q(py) .. " -c 'import transformers' 2>/dev/null")) == 0 then
      out = S.sh(q(py) .. " -c " .. q("import transformers; m = transformers.GPT2LMHeadModel.from_pretrained('"
        .. tmp .. "/full-hf'); print('params', sum(p.numel() for p in m.parameters()))") .. " 2>&1")
      assert.matches("params 124439808", out)
    end
  end)
end)
