-- gpt2-cuda.lua — GPT-2 small's shapes (12 layers, 12 heads, 768 wide,
-- context 1024) on one GPU, bf16 activations with fp32 master weights,
-- byte-level tokens (so about 86M parameters: the vocabulary is the corpus's
-- distinct bytes, not GPT-2's 50257). Needs the CUDA plugin
-- (build/libtransom_cuda.so, built when CMake finds nvcc) and a GPU:
--
--   transom run examples/gpt2-cuda.lua --set data=PATH/corpus.txt
--   transom run examples/gpt2-cuda.lua --set data=... --set replicas=4   -- 4 GPUs, NCCL between them
--
-- Not yet run on a GPU (see the README's Devices section).
return {
  model = "gpt",
  data = "data/fortunes.txt",
  device = "cuda",
  precision = "bf16",
  n_layer = 12,
  n_head = 12,
  n_embd = 768,
  block_size = 1024,
  batch_size = 8,
  max_steps = 5000,
  lr = 6e-4,
  min_lr = 6e-5,
  warmup_steps = 200,
  weight_decay = 0.1,
  beta1 = 0.9,
  beta2 = 0.95,
  grad_clip = 1.0,
  eval_interval = 500,
  eval_steps = 20,
  log_interval = 10,
  checkpoint = { every_steps = 250 },
  sample_prompt = "\n",
  sample_tokens = 300,
  temperature = 0.8,
}
