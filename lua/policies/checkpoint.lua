-- checkpoint.lua — the default checkpoint policy. A job overrides any field
-- with `checkpoint = { every_steps = 1 }` or `--set checkpoint.every_steps=1`.
--
-- Snapshots cost the training thread almost nothing (a background copy while
-- forward/backward run; LMDB commits on a writer thread, paced to 2% of the
-- machine's CPU), so frequent ones are cheap; the limit is the disk's write
-- bandwidth, which `when_busy` handles. By default a checkpoint is due every
-- 100 steps or every 5 minutes, whichever comes first: a crash costs at most
-- that much training (plus the last commit's few seconds), whether a step
-- takes 10 ms or 10 minutes.
return {
  every_steps = 100,      -- snapshot every N steps (0 = not by step count)
  every_seconds = 300,    -- and every T seconds of training (0 = not by time)
  keep_last = 3,          -- keep the newest K committed checkpoints
  keep_every = 0,         -- also keep every step divisible by M forever (0 = none)
  when_busy = "coalesce", -- a snapshot is due while the disk is still writing:
                          -- "coalesce" replaces the one waiting to be written,
                          -- "skip" drops the new one. Training never waits.
  map_mb = 0,             -- LMDB map size in MiB (0 = room for keep_last + 2, grown when full)
  remote = "",            -- level 3: a directory on another disk (a shared file
                          -- system, another host's disk); committed checkpoints
                          -- are copied there in the background ("" = none)
  remote_rate_mb = 100,   -- at most this many MiB/s on average (0 = no limit)
}
