-- fortunes.lua — the default job: a small GPT on Debian's fortune cookie
-- database. ./setup.sh concatenates /usr/share/games/fortunes into
-- data/fortunes.txt (about 2.5 MB). About 80 seconds on 2 cores; the
-- validation loss falls from ~4.6 to ~2.0 and the closing sample reads like a
-- fortune, "%" separators and "-- Attribution" lines included.
return {
  model = "gpt",
  data = "data/fortunes.txt",
  n_layer = 4,
  n_head = 4,
  n_embd = 128,
  block_size = 64,
  batch_size = 16,
  max_steps = 1500,
  lr = 1e-3,
  min_lr = 1e-4,
  warmup_steps = 100,
  eval_interval = 250,
  log_interval = 25,
  sample_prompt = "\n",
  sample_tokens = 400,
  temperature = 0.8,
}
