-- pipeline.lua — the default pipeline (FusionLLM): one stage, one
-- micro-batch, i.e. no pipeline. A job overrides any field with
-- `pipeline = { stages = 2, micro_batches = 4 }` or
-- `--set pipeline.stages=2`. See the README's "Pipeline stages" section.
return {
  stages = 1,        -- worker processes the model's op order is cut into
  micro_batches = 1, -- each step's batch_size sequences split into this many
                     -- micro-batches, run through the stages in 1F1B order
}
