-- pipeline.lua — the default model as a 4-stage pipeline (FusionLLM) over
-- heterogeneous, slow-linked workers, emulated on this host: two zones 1
-- Gbit inside, 100 Mbit and 5 ms between; worker 1 at half speed. OP-Fence
-- places the stages (`transom plan examples/pipeline.lua` prints the plan),
-- AdaTopK sizes what crosses each link. See the README's "Pipeline stages".
return {
  model = "gpt",
  data = "data/fortunes.txt",
  n_layer = 4,
  n_head = 4,
  n_embd = 128,
  block_size = 64,
  batch_size = 16,
  max_steps = 300,
  warmup_steps = 30,
  eval_interval = 100,
  log_interval = 25,
  sample_tokens = 0,
  -- each stage snapshots its own state (RUN/ckpt-stage-K): Ctrl-C, then
  -- `transom run --resume RUN`, carries on (a few MiB a stage: cheap)
  checkpoint = { every_steps = 100 },
  pipeline = {
    stages = 4,
    micro_batches = 4,
    compression = "adatopk",
    lan_mbit = 1000,
    wan_mbit = 100,
    wan_ms = 5,
    workers = { { zone = "a" }, { zone = "b", speed = 0.5 }, { zone = "a" }, { zone = "b" } },
  },
}
