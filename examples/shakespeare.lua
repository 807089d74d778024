-- shakespeare.lua — nanoGPT's CPU configuration for character-level
-- Shakespeare (config/train_shakespeare_char.py with the CPU overrides:
-- 4 layers, 4 heads, 128 wide, context 64, batch 12, 2000 steps, lr decay
-- to 2000, dropout 0). The corpus path is given on the command line:
--
--   transom run examples/shakespeare.lua --set data=PATH/tinyshakespeare.txt
--
-- nanoGPT reports a validation loss of about 1.88 at the end.
return {
  model = "gpt",
  data = "tinyshakespeare.txt",
  n_layer = 4,
  n_head = 4,
  n_embd = 128,
  block_size = 64,
  batch_size = 12,
  max_steps = 2000,
  lr = 1e-3,
  min_lr = 1e-4,
  warmup_steps = 100,
  lr_decay_steps = 2000,
  weight_decay = 0.1,
  beta1 = 0.9,
  beta2 = 0.99,
  grad_clip = 1.0,
  eval_interval = 250,
  eval_steps = 20,
  log_interval = 10,
  sample_prompt = "ROMEO:",
  sample_tokens = 300,
  temperature = 0.8,
}
