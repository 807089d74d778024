-- pipeline.lua — the default pipeline (FusionLLM): one stage, one
-- micro-batch, i.e. no pipeline. A job overrides any field with
-- `pipeline = { stages = 2, micro_batches = 4 }` or
-- `--set pipeline.stages=2`. See the README's "Pipeline stages" section.
return {
  stages = 1,            -- worker processes the model's op order is cut into
  micro_batches = 1,     -- each step's batch_size sequences split into this many
                         -- micro-batches, run through the stages in 1F1B order
  placement = "opfence", -- or "even", or a Lua policy file
  compression = "none",  -- or "adatopk"
  min_density = 0.34,    -- adatopk: gradients keep at least this fraction
  act_min_density = 0.34, -- adatopk: activations keep at least this fraction
                         -- (at 1/3 and above nothing is dropped: dense bf16
                         -- is smaller than top-k there; lower floors allow
                         -- top-k, which cost validation loss in the bench:
                         -- see the README)
  workers = {},          -- { {speed = 1.0, zone = "a"}, ... }: one per stage
  lan_mbit = 0,          -- emulated links (0 = as fast as the host allows)
  wan_mbit = 0,
  wan_ms = 0,
  probe = true,          -- measure workers and links at start
  rebuilds = 3,          -- replicas > 1: a lost pipeline is started again this
                         -- many times (new workers catch up from a live
                         -- pipeline's stages and rejoin at a step they agree)
}
