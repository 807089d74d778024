-- mlp.lua — a small per-position MLP language model: token + position
-- embedding, n_layer residual MLP blocks (layernorm -> 4x GELU MLP), a final
-- layernorm and a tied head. It sees only the current token and its position
-- (a learned bigram model with depth), which makes it a quick baseline and a
-- second, attention-free model for the graph API.

return function(g, cfg, tokens, targets)
  local V, C, T = cfg.vocab_size, cfg.n_embd, cfg.block_size
  local wte = g:param("wte", { V, C })
  local x = g:embed(tokens, wte, g:param("wpe", { T, C }))
  for l = 0, cfg.n_layer - 1 do
    local p = "block" .. l .. "."
    local h = g:layernorm(x, g:param(p .. "ln.weight", { C }, { init = "ones" }),
      g:param(p .. "ln.bias", { C }, { init = "zeros" }))
    h = g:gelu(g:linear(h, g:param(p .. "fc.weight", { 4 * C, C }), g:param(p .. "fc.bias", { 4 * C }, { init = "zeros" })))
    h = g:linear(h, g:param(p .. "proj.weight", { C, 4 * C }, { std = 0.02 / math.sqrt(2 * cfg.n_layer) }),
      g:param(p .. "proj.bias", { C }, { init = "zeros" }))
    x = g:add(x, h)
  end
  x = g:layernorm(x, g:param("ln_f.weight", { C }, { init = "ones" }), g:param("ln_f.bias", { C }, { init = "zeros" }))
  local logits = g:linear(x, wte)
  return { loss = g:cross_entropy(logits, targets), logits = logits }
end
