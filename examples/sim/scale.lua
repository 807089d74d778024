-- scale.lua — what transom's replace mode buys against restart-all from 1K
-- to 128K GPUs: a 30-day pre-training run of a 405B-parameter model with
-- Llama 3's failure rate, transom's measured costs where a bench measures
-- them, and the rest marked assumed.
--
--   build/transom sim examples/sim/scale.lua -o sim-scale.png
--   bench/sim_scale.sh          (this, the plot, and the FT-HSDP check)
--
-- Where each number comes from:
--   [Llama 3]   "The Llama 3 Herd of Models" (Meta, 2024): 419 unexpected
--               interruptions in a 54-day snapshot of pre-training on 16,384
--               H100 GPUs, about 78% of them confirmed or suspected hardware;
--               400 TFLOPs per GPU (38% BF16 MFU) at 16K GPUs; 16M-token
--               batches; storage (Tectonic) 2 TB/s sustained, 7 TB/s peak;
--               400 Gbps RoCE per GPU.
--   [FT-HSDP]   "Training LLMs with Fault Tolerant HSDP on 100,000 GPUs"
--               (Meta, arXiv 2602.00277): at O(100K) GPUs the stall per
--               failure falls from 10 min (synchronous) to 3 min (FT-HSDP),
--               effective training time from 44% to 80%.
--   [measured]  a transom bench on the project's 2-core CPU machine (README,
--               Performance): bench/eagle_bench.sh, bench/ftar_vs_mpi.sh,
--               bench/ckpt_bench.sh, bench/operator_bench.sh.
--   [policy]    transom's shipped lua/policies/*.lua.
--   [assumed]   no source: a guess, and `sensitivity` below shows how much
--               it matters.

local PARAMS = 405e9        -- [Llama 3] the flagship model
local BYTES_PER_PARAM = 16  -- [assumed] bf16 weights + fp32 master + AdamW m, v (2 + 4 + 4 + 4, rounded up)
local REPLICA_GPUS = 512    -- [assumed] one HSDP replica: TP 8 x PP 16 x FSDP 4 (Llama 3 used TP 8, PP 16)
local STATE_PER_GPU = PARAMS * BYTES_PER_PARAM / REPLICA_GPUS -- 12.7 GB: what one GPU holds and a joiner needs
local NIC_BYTES_S = 400e9 / 8 * 0.5   -- [Llama 3] 400 Gbps per GPU; [assumed] half of it for the donor stream
local STORAGE_BYTES_S = 7e12          -- [Llama 3] peak storage read for the whole cluster
local STORAGE_WRITE_S = 2e12          -- [Llama 3] sustained storage write
local STEP_S = 6.0 -- [Llama 3] 6 * 405e9 * 16M tokens / (16,384 GPUs * 400 TFLOP/s) = 5.9 s; [assumed] the same
                   -- at every size (each replica keeps its batch: weak scaling)

-- restart-all's stop + reschedule + start + communicator set-up: [FT-HSDP]
-- 10 min of stall per failure at ~100K GPUs (less the detection and the
-- checkpoint load modelled separately); [assumed] 2 min at 1K GPUs, linear
-- in log2(GPUs) between the two.
local function restart_s(c)
  local at_100k = 600 - 3.4 - 98304 * STATE_PER_GPU / STORAGE_BYTES_S
  local per_doubling = (at_100k - 120) / math.log(98304 / 1024, 2)
  return 120 + per_doubling * math.log(c.gpus / 1024, 2)
end

return {
  seeds = 10,
  job = {
    gpus_per_replica = REPLICA_GPUS,
    replicas = 32,                    -- 16,384 GPUs, Llama 3's size, for the single-point report
    gpus_per_host = 8,                -- [Llama 3] 8 H100 per host
    steps = 30 * 86400 // 6,          -- 30 days of fault-free training
    step_s = STEP_S,
    degraded_step_s = STEP_S,         -- [assumed] a missing replica does not slow the others
    startup_s = restart_s,            -- [assumed] the first start costs what a restart does
  },
  failures = {
    per_gpu_hour = 419 / (54 * 24 * 16384), -- [Llama 3] 1.97e-5: one every 3.1 h at 16K GPUs
    hardware_fraction = 0.78,               -- [Llama 3] the failed host is replaced by a spare
    detect_s = 3.4,  -- [measured] eagle_bench.sh: a dead replica evicted 3.4 s after its last heartbeat
                     -- (deadline 3 s). A process that dies is seen sooner (its socket's EOF: the
                     -- survivors redo 28.5 ms after a kill -9, ftar_vs_mpi.sh); a hung GPU later
                     -- (hang_seconds, 60 s).
  },
  checkpoint = {
    every_steps = 100,  -- [policy] lua/policies/checkpoint.lua's default (10 min here)
    -- [measured] ckpt_bench.sh: the training thread stalls 0.051 of a synchronous save (85M
    -- params); a synchronous save of one replica's state at [Llama 3]'s sustained write rate
    -- takes 512 * 12.7 GB / 2 TB/s = 3.2 s.
    stall_s = 0.051 * REPLICA_GPUS * STATE_PER_GPU / STORAGE_WRITE_S,
    write_s = REPLICA_GPUS * STATE_PER_GPU / STORAGE_WRITE_S, -- one replica writes (the others hold copies)
    -- every GPU of every replica reads its shard back at [Llama 3]'s peak read rate
    load_s = function(c) return c.gpus * STATE_PER_GPU / STORAGE_BYTES_S end,
  },
  replace = {
    -- [assumed] abort + a new epoch's communicators among the survivors + the step's all-reduce
    -- again. Measured on CPU only: 28.5 ms (ftar_vs_mpi.sh, 3 ranks); the GPU plane (an NCCL
    -- communicator per epoch) has not run on a GPU yet, and NCCL's set-up at scale takes seconds
    -- to tens of seconds.
    redo_s = 30,
    delay_s = 0.2, backoff = 2, delay_max_s = 10, -- [policy] lua/policies/restart.lua (its limits of 5
                                                   -- replacements a slot and 20 a job are not modelled)
    start_s = 120, -- [assumed] a spare host's processes, CUDA, the replica's own communicators, the model.
                   -- Measured on CPU: 0.23-0.40 s from spawn to ready (operator_bench.sh).
    catchup_s = STATE_PER_GPU / NIC_BYTES_S, -- 0.5 s: the donor streams each shard GPU to GPU, in parallel
    join_s = 30,   -- [assumed] survivors build the next epoch's communicators, as in redo_s
  },
  restart_all = {
    restart_s = restart_s,
  },
  hosts = {
    -- [assumed] 1% spare hosts, at least 16 (a cluster's pool that a small job draws on)
    spare_fraction = function(c) return math.max(0.01, 16 / c.hosts) end,
    repair_s = 48 * 3600,  -- [assumed] two days until a failed host is back in the pool
  },
  sweep = { gpus = { 1024, 2048, 4096, 8192, 16384, 32768, 65536, 98304, 131072 } },
  sensitivity = { gpus = 98304, factor = 2 },
  reference = {
    { gpus = 100000, ettr = 0.44, mode = "restart_all",
      label = "FT-HSDP paper: synchronous training at O(100K) GPUs, 10 min stall per failure" },
    { gpus = 100000, ettr = 0.80, mode = "replace",
      label = "FT-HSDP paper: FT-HSDP at O(100K) GPUs, 3 min stall per failure" },
  },
}
