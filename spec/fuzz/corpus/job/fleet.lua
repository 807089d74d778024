-- replicas, a checkpoint policy and chaos
local layers = 2
return {
  name = "fleet", data = "data/fortunes.txt", n_layer = layers * 2, n_head = 2, n_embd = 32,
  replicas = 3, min_replicas = 2, max_replicas = 4, on_failure = "restart_all", deadline = 1.5,
  checkpoint = { every_steps = 10, keep_last = 2, when_busy = "coalesce" },
  chaos = { { at_step = 5, replica = 1, fault = "kill" }, { at_step = 9, replica = 2, fault = "slow", ms = 50 } },
  sample_prompt = "\0a\r%q", precision = "bf16", device = "emu", lr = 3e-4, min_lr = 0,
}
