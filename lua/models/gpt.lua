-- gpt.lua — GPT-2 / nanoGPT: token + position embeddings, n_layer
-- pre-norm blocks (layernorm -> causal self-attention -> residual,
-- layernorm -> MLP with GELU -> residual), a final layernorm, and an output
-- head tied to the token embedding. GPT-2 init: N(0, 0.02), residual
-- projections N(0, 0.02/sqrt(2*n_layer)), biases 0, norm gains 1.
-- Parameter names follow nanoGPT's state_dict.

return function(g, cfg, tokens, targets)
  local V, C, T, L, NH = cfg.vocab_size, cfg.n_embd, cfg.block_size, cfg.n_layer, cfg.n_head
  local proj_std = 0.02 / math.sqrt(2 * L)

  local function norm(name)
    return g:param(name .. ".weight", { C }, { init = "ones" }), g:param(name .. ".bias", { C }, { init = "zeros" })
  end
  local function linear(x, name, out, inp, std)
    local w = g:param(name .. ".weight", { out, inp }, { std = std or 0.02 })
    local b = g:param(name .. ".bias", { out }, { init = "zeros" })
    return g:linear(x, w, b)
  end

  local wte = g:param("transformer.wte.weight", { V, C })
  local wpe = g:param("transformer.wpe.weight", { T, C })
  local x = g:embed(tokens, wte, wpe)
  for l = 0, L - 1 do
    local p = "transformer.h." .. l .. "."
    local h = g:layernorm(x, norm(p .. "ln_1"))
    local qkv = linear(h, p .. "attn.c_attn", 3 * C, C)
    local a = g:attention(qkv, NH)
    x = g:add(x, linear(a, p .. "attn.c_proj", C, C, proj_std))
    h = g:layernorm(x, norm(p .. "ln_2"))
    h = g:gelu(linear(h, p .. "mlp.c_fc", 4 * C, C))
    x = g:add(x, linear(h, p .. "mlp.c_proj", C, 4 * C, proj_std))
  end
  x = g:layernorm(x, norm("transformer.ln_f"))
  local logits = g:linear(x, wte) -- weight tying: the head is the token table
  return { loss = g:cross_entropy(logits, targets), logits = logits }
end
