-- transom.model — finds a model definition and builds its graph.
--
-- A model file (lua/models/*.lua) returns a function
--     build(g, cfg, tokens, targets) -> { loss = tensor, logits = tensor }
-- that adds its parameters and ops to the graph g. cfg is the checked job
-- table plus vocab_size; tokens and targets are int32 (B,T) inputs.
-- Called from C (core/train/trainer.c) once per graph; never per step.

local transom = require("transom")

local M = {}

-- Returns the build function for a model name ("gpt") or path ("x/y.lua").
function M.find(name)
  local build
  if name:find("/") or name:match("%.lua$") then
    local chunk, err = loadfile(name)
    if not chunk then error({ msg = "model: " .. err }, 0) end
    build = chunk()
  else
    if not name:match("^[%w_]+$") then error({ msg = "model: bad model name '" .. name .. "'" }, 0) end
    local ok, mod = pcall(require, "models." .. name)
    if not ok then
      if tostring(mod):find("module 'models%." .. name .. "' not found") then
        error({ msg = string.format("model '%s': no lua/models/%s.lua", name, name) }, 0)
      end
      error(mod, 0)
    end
    build = mod
  end
  if type(build) ~= "function" then
    error({ msg = string.format("model '%s' must return a build function, got %s", name, type(build)) }, 0)
  end
  return build
end

-- Builds the graph for cfg at batch size B. Returns the graph handle.
function M.build(cfg, B)
  local build = M.find(cfg.model)
  local g = transom.graph()
  local tokens = g:input("tokens", { B, cfg.block_size }, "int32")
  local targets = g:input("targets", { B, cfg.block_size }, "int32")
  local out = build(g, cfg, tokens, targets)
  if type(out) ~= "table" or not out.loss or not out.logits then
    error({ msg = string.format("model '%s': build must return {loss = ..., logits = ...}", cfg.model) }, 0)
  end
  g:output("logits", out.logits)
  g:output("loss", out.loss)
  return g
end

return M
