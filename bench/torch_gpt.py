#!/usr/bin/env python3
"""torch_gpt.py — the transom GPT training step in PyTorch (eager or
torch.compile; CPU or CUDA).

The reference side of bench/cpu_vs_torch.sh. It builds the same model as
lua/models/gpt.lua (nanoGPT: token + position embeddings, n_layer pre-norm
blocks, LayerNorm eps 1e-5 with bias, Linear layers with bias, causal
self-attention, GELU tanh approximation, final LayerNorm, head tied to the
token embedding without bias, mean cross-entropy) and trains it the way
transom does: random batches of byte tokens from the first 90% of the file,
AdamW (betas 0.9/0.99, eps 1e-8, weight decay 0.1 on 2-D tensors only,
fused=False, foreach left at its default), clip_grad_norm_ to 1.0, linear
warm-up then cosine decay of the learning rate, no dropout.

Timing matches transom's "done:" line: each step is timed from batch
sampling to the end of the optimizer step, step 1 is warm-up, and tokens/s
is (tokens of steps 2..N) / (time of steps 2..N).

Machine-readable lines (one per line, key=value):
  torch_params=<int>       sum of the parameter tensor sizes (tied head counted once)
  torch_tok_s=<float>      tokens/s over steps 2..N
  torch_ms_step=<float>    mean ms per step over steps 2..N
  torch_gflop_s=<float>    with transom's FLOP count (6*N*tokens + attention)
  torch_median_ms=<float>  median step time over steps 2..N (robust to a busy machine)
  torch_median_tok_s=<float>
  torch_val_loss=<float>   only with --eval: mean loss of 20 val batches
  torch_version=<str>

Parameter count: transom's "model gpt: N parameters" line counts its
parameter slab, which pads every tensor to 64 bytes (16 floats), so it is a
little larger than the sum of tensor sizes. --check-safetensors RUN/model.
safetensors compares names, shapes and the unpadded total with a transom
run's saved weights instead, and exits 3 on any difference.
"""
import argparse
import json
import math
import os
import struct
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                                                   "tinyshakespeare.txt"))
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval", action="store_true", help="at the end, mean loss of --eval-steps val batches")
    p.add_argument("--eval-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--lr-decay-steps", type=int, default=2000,
                   help="step where the cosine reaches min_lr (examples/shakespeare.lua: 2000)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cpu", help="cpu or cuda (bench/gpu_vs_torch.sh)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (the first steps compile)")
    p.add_argument("--bf16", action="store_true", help="autocast the forward to bfloat16 (fp32 master weights)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (compilation, caches)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over the timed steps: the top 25 kernels by GPU self time")
    p.add_argument("--log-interval", type=int, default=0, help="print a step line every this many steps (0 = none)")
    p.add_argument("--attn", choices=["sdpa", "manual"], default="sdpa",
                   help="sdpa: F.scaled_dot_product_attention(is_causal=True), as nanoGPT; manual: masked softmax")
    p.add_argument("--check-safetensors", metavar="PATH",
                   help="compare parameter names/shapes/count with a transom model.safetensors")
    return p.parse_args()


args = parse_args()

import torch  # noqa: E402  (after argparse so --help works without torch)
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(args.threads)


class Block(nn.Module):
    def __init__(self, C, n_head, n_layer, attn):
        super().__init__()
        self.n_head, self.attn_kind = n_head, attn
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(C, 3 * C, bias=True)
        self.attn.c_proj = nn.Linear(C, C, bias=True)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(C, 4 * C, bias=True)
        self.mlp.c_proj = nn.Linear(4 * C, C, bias=True)
        self.gelu = nn.GELU(approximate="tanh")

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = self.attn.c_attn(x).split(C, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        if self.attn_kind == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn.c_proj(y)

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        x = x + self.mlp.c_proj(self.gelu(self.mlp.c_fc(self.ln_2(x))))
        return x


class GPT(nn.Module):
    def __init__(self, V, T, L, NH, C, attn):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(V, C)
        self.transformer.wpe = nn.Embedding(T, C)
        self.transformer.h = nn.ModuleList([Block(C, NH, L, attn) for _ in range(L)])
        self.transformer.ln_f = nn.LayerNorm(C, eps=1e-5)
        # GPT-2 init, as lua/models/gpt.lua: N(0, 0.02), residual projections
        # N(0, 0.02/sqrt(2L)), biases 0, norm gains 1.
        for name, prm in self.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "transformer.ln_f.weight":
                nn.init.ones_(prm)
            elif name.endswith(".bias"):
                nn.init.zeros_(prm)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(prm, 0.0, 0.02 / math.sqrt(2 * L))
            else:
                nn.init.normal_(prm, 0.0, 0.02)

    def forward(self, idx, targets):
        B, T = idx.shape
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for blk in self.transformer.h:
            x = blk(x)
        x = self.transformer.ln_f(x)
        logits = F.linear(x, self.transformer.wte.weight)  # tied head, no bias
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def lr_at(step):  # transom's core/tensor/optim.c lr_at, step counted from 0
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if step >= args.lr_decay_steps:
        return args.min_lr
    span = args.lr_decay_steps - args.warmup_steps
    frac = (step - args.warmup_steps) / span if span > 0 else 1.0
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (args.lr - args.min_lr)


def read_safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    return {k: tuple(v["shape"]) for k, v in hdr.items()}


def main():
    torch.manual_seed(args.seed)
    with open(args.data, "rb") as f:
        raw = f.read()
    vocab = sorted(set(raw))  # byte-level tokens: the distinct bytes, in byte order (as transom)
    lut = torch.full((256,), -1, dtype=torch.long)
    lut[torch.tensor(vocab, dtype=torch.long)] = torch.arange(len(vocab))
    ids = lut[torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()]
    n_train = len(ids) * 9 // 10
    train, val = ids[:n_train], ids[n_train:]
    B, T = args.batch_size, args.block_size

    dev = torch.device(args.device)

    def batch(split, gen=None):
        off = torch.randint(0, len(split) - T - 1, (B,), generator=gen)
        x = torch.stack([split[o:o + T] for o in off.tolist()])
        y = torch.stack([split[o + 1:o + 1 + T] for o in off.tolist()])
        return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

    model = GPT(len(vocab), T, args.n_layer, args.n_head, args.n_embd, args.attn).to(dev)
    run = torch.compile(model) if args.compile else model
    params = dict(model.named_parameters())
    n_params = sum(p.numel() for p in params.values())
    print(f"torch {torch.__version__} | {torch.get_num_threads()} threads | model gpt: {n_params} parameters "
          f"(sum of tensor sizes), vocab {len(vocab)} | data {args.data}: {len(ids)} tokens "
          f"({len(train)} train, {len(val)} val) | attention {args.attn}", flush=True)
    print(f"torch_version={torch.__version__}")
    print(f"torch_params={n_params}")
    if args.check_safetensors:
        theirs = read_safetensors_header(args.check_safetensors)
        ours = {k: tuple(v.shape) for k, v in params.items()}
        n_theirs = sum(math.prod(s) for s in theirs.values())
        bad = [k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
        for k in bad:
            print(f"  param mismatch: {k}: transom {theirs.get(k)} torch {ours.get(k)}")
        print(f"transom_params_unpadded={n_theirs}")
        print(f"params_match={'yes' if not bad and n_theirs == n_params else 'no'}", flush=True)
        if bad or n_theirs != n_params:
            sys.exit(3)

    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.99), eps=1e-8, fused=False)

    flops = 6.0 * sum(p.numel() for n, p in params.items() if p.dim() == 2 and "wpe" not in n) * B * T \
        + 6.0 * args.n_layer * B * T * T * args.n_embd  # transom's trainer_flops_per_step
    timed, tokens, times, wall0 = 0.0, 0, [], time.perf_counter()
    prof = None
    for step in range(args.steps):
        if args.profile and step == args.warmup:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        t0 = time.perf_counter()
        x, y = batch(train)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = run(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip) if args.grad_clip > 0 else 0.0
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()  # a step ends when the GPU is done with it
        dt = time.perf_counter() - t0
        if step >= args.warmup:  # the first steps warm caches and thread pools (and compile)
            timed += dt
            tokens += B * T
            times.append(dt)
        if args.log_interval and ((step + 1) % args.log_interval == 0 or step + 1 == args.steps):
            print(f"step {step + 1}/{args.steps} | loss {loss.item():.4f} | lr {lr:.2e} | norm {float(norm):.4f} | "
                  f"{dt * 1e3:.1f} ms | {B * T / dt:.0f} tok/s", flush=True)
    wall = time.perf_counter() - wall0
    if prof is not None:
        prof.__exit__(None, None, None)
        def dev_us(e):
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        evs = sorted(prof.key_averages(), key=dev_us, reverse=True)
        total = sum(dev_us(e) for e in evs) or 1
        print(f"torch profile: {total / 1e3 / (args.steps - args.warmup):.1f} ms of GPU self time per step")
        for e in evs[:25]:
            print(f"  {dev_us(e) / 1e3 / (args.steps - args.warmup):8.2f} ms/step {100 * dev_us(e) / total:5.1f}% "
                  f"{e.count:6d}x  {e.key[:90]}")
        sys.stdout.flush()
    print(f"torch_final_train_loss={loss.item():.4f}")
    if timed > 0:
        ms = timed / (args.steps - args.warmup) * 1e3
        print(f"done: {args.steps} steps | {ms:.1f} ms/step | {tokens / timed:.0f} tok/s | "
              f"{flops / (ms * 1e-3) * 1e-9:.2f} GFLOP/s (steps {args.warmup + 1}..{args.steps}) | "
              f"training wall {wall:.1f} s")
        print(f"torch_ms_step={ms:.3f}")
        print(f"torch_tok_s={tokens / timed:.1f}")
        print(f"torch_gflop_s={flops / (ms * 1e-3) * 1e-9:.3f}")
        med = sorted(times)[len(times) // 2]
        print(f"torch_median_ms={med * 1e3:.3f}")
        print(f"torch_median_tok_s={B * T / med:.1f}")
    if args.eval:
        gen = torch.Generator().manual_seed(args.seed + 1)
        model.eval()
        with torch.no_grad():
            losses = [run(*batch(val, gen)).item() for _ in range(args.eval_steps)]
        print(f"torch_val_loss={sum(losses) / len(losses):.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
