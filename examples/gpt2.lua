-- gpt2.lua — GPT-2 small (124M) at its real shapes: GPT-2's vocabulary of
-- 50257 BPE tokens (padded to 50304 for the kernels, as llm.c does), context
-- 1024, 12 layers, 12 heads, 768 wide; nanoGPT's/llm.c's GPT-2 hyper-
-- parameters (lr 6e-4 with warm-up, AdamW betas 0.9/0.95, weight decay 0.1).
-- It reads GPT-2-tokenized shards: llm.c's (python dev/data/fineweb.py or
-- tinyshakespeare.py in llm.c writes them) or nanoGPT's train.bin/val.bin:
--
--   transom run examples/gpt2.lua --set 'data=fineweb10B/fineweb_train_*.bin' \
--                                 --set 'val_data=fineweb10B/fineweb_val_*.bin'
--
-- (add --set tokenizer=PATH/gpt2.tiktoken, a copy of GPT-2's encoding, and
-- the closing sample decodes to text; without it, it prints token ids)
--
-- Without GPT-2 shards at hand, shards of our own tokenizer fit the same
-- shapes (its ids are below 50257):
--
--   transom prepare data/fortunes.txt -o data/fortunes-bpe --vocab 4096
--   transom run examples/gpt2.lua
--
-- On the CPU it is slow (the README's "Your own data" has the seconds and
-- memory per step); on a GPU add --set device=cuda --set precision=bf16 and
-- a larger batch_size. Fine-tuning Hugging Face's GPT-2: `init_from = DIR`
-- (a directory with its config.json and model.safetensors).
return {
  model = "gpt",
  data = "data/fortunes-bpe/train_*.bin",
  val_data = "data/fortunes-bpe/val_*.bin",
  vocab_size = 50257,
  n_layer = 12,
  n_head = 12,
  n_embd = 768,
  block_size = 1024,
  batch_size = 4,
  max_steps = 5000,
  lr = 6e-4,
  min_lr = 6e-5,
  warmup_steps = 200,
  weight_decay = 0.1,
  beta1 = 0.9,
  beta2 = 0.95,
  grad_clip = 1.0,
  eval_interval = 250,
  eval_steps = 10,
  log_interval = 1,
  checkpoint = { every_steps = 250 },
  sample_prompt = "",
  sample_tokens = 100,
  temperature = 0.8,
}
