"""
The one place nanoGRPO's speed numbers come from. Each section is a function that fills its part of one results
dict; main() prints the dict as a table and writes it as JSON. Random weights: speed does not depend on them.

$ python bench.py                                  # GRPO-shaped: 8 prompts x G=8, prompt 64, completion 128
$ python bench.py --prompts 4 --G 16 --prompt_len 32 --new_tokens 64   # the smaller shape of the first benchmark
$ python bench.py --preset gpt2 --device cuda --compile --json bench.json

Sections: the machine's matmul peak (every MFU is against it), sampling (KV cache vs naive full recompute, and a
batch where half the rows end early), and the log-prob pass (chunked vs a plain full log-softmax).
"""

import argparse
import json
import multiprocessing
import os
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext

import torch

from model import GPT, GPTConfig, sample

PRESETS = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768)}  # 124M

def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="model shape; overrides --n_layer/--n_head/--n_embd")
    p.add_argument("--n_layer", type=int, default=6)
    p.add_argument("--n_head", type=int, default=6)
    p.add_argument("--n_embd", type=int, default=384)
    p.add_argument("--vocab_size", type=int, default=50304)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--G", type=int, default=8, help="completions per prompt")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=128, help="completion length")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="autocast dtype; default bfloat16 on CUDA")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (best is kept)")
    p.add_argument("--naive_points", type=int, default=4,
                   help="sequence lengths the naive sampler is timed at (0: run it for every token)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.preset:
        vars(args).update(PRESETS[args.preset])
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args

# -----------------------------------------------------------------------------
# shared helpers

def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()

def timed(fn, device, repeat, warmup=1):
    """Best wall-clock seconds of fn() over `repeat` runs, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best

def autocast(args):
    return nullcontext() if args.dtype == "float32" else torch.autocast(args.device.split(":")[0], torch.bfloat16)

def build_model(args):
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=args.block_size, vocab_size=args.vocab_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(cfg).to(args.device).eval()
    if args.compile:
        for block in model.transformer.h:
            block.compile(dynamic=True)  # the cache grows and the batch shrinks: shapes change every step
    return model

def make_prompts(args, lengths=None):
    g = torch.Generator().manual_seed(1)
    lengths = lengths or [args.prompt_len] * args.prompts
    return [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in lengths]

def generate(model, args, prompts, max_new_tokens, eos_id=None):
    g = torch.Generator(args.device).manual_seed(2)
    with autocast(args):
        return model.generate(prompts, max_new_tokens, num_samples=args.G, eos_id=eos_id, generator=g)

def decode_flops(model, args, prompt_len, steps):
    """Forward FLOPs of `steps` decode steps over all rows; step t attends to prompt_len + t positions."""
    rows = args.prompts * args.G
    return sum(rows * model.flops_per_token(prompt_len + t, backward=False) for t in range(1, steps))

# -----------------------------------------------------------------------------
# sections

def bench_matmul_peak(args, model, results):
    """The machine's own matmul throughput: a big square matmul, float32 on CPU, bf16 on CUDA."""
    cuda = args.device.startswith("cuda")
    n, dtype = (8192, torch.bfloat16) if cuda else (2048, torch.float32)
    a, b = (torch.randn(n, n, device=args.device, dtype=dtype) for _ in range(2))
    seconds = timed(lambda: a @ b, args.device, repeat=max(args.repeat, 5))
    results["peak"] = dict(matmul=f"{n}x{n} {dtype}".replace("torch.", ""), tflops=2 * n**3 / seconds / 1e12)

def naive_generate(model, args, prompts, steps):
    """The baseline: no cache, every step recomputes the whole sequence (only the last position goes through the
    output layer, as nanoGPT's generate does). Needs equal prompt lengths, which the benchmark uses."""
    idx = torch.tensor(prompts, device=args.device).repeat_interleave(args.G, 0)  # (N, P)
    g = torch.Generator(args.device).manual_seed(2)
    with torch.inference_mode(), autocast(args):
        for _ in range(steps):
            logits = model.lm_head(model._hidden(idx)[:, -1])  # (N, V)
            u = torch.rand(idx.size(0), 2, device=args.device, generator=g)
            idx = torch.cat([idx, sample(logits, u=u)[0][:, None]], 1)

def naive_seconds(model, args, prompts):
    """Time of the naive sampler for args.new_tokens tokens. Its step time grows linearly with the sequence, so
    unless --naive_points 0 it is timed at a few evenly spaced lengths and the mean step scaled up."""
    if args.naive_points == 0:
        return timed(lambda: naive_generate(model, args, prompts, args.new_tokens), args.device, 1, warmup=0)
    lengths = torch.linspace(0, args.new_tokens - 1, args.naive_points).round().int().tolist()
    g = torch.Generator().manual_seed(3)
    step = []
    for t in lengths:  # the prompts followed by t random "generated" tokens
        longer = [p + torch.randint(0, args.vocab_size, (t,), generator=g).tolist() for p in prompts]
        step.append(timed(lambda: naive_generate(model, args, longer, 1), args.device, 1))
    return sum(step) / len(step) * args.new_tokens

def matmul_share(model, args, prompts):
    """Share of a whole generate call's wall time spent inside matmul kernels, from the profiler."""
    activity = torch.profiler.ProfilerActivity
    cuda = args.device.startswith("cuda")
    # on CUDA an aten op's device time is that of the kernels it launched
    with torch.profiler.profile(activities=[activity.CPU] + [activity.CUDA] * cuda) as prof:
        seconds = timed(lambda: generate(model, args, prompts, args.new_tokens), args.device, 1, warmup=0)
    matmul_us = sum(e.self_device_time_total if cuda else e.self_cpu_time_total for e in prof.key_averages()
                    if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    return matmul_us / 1e6 / seconds

def bench_sampling(args, model, results):
    """Prefill and decode of model.generate, its MFU (needs the peak section first) and matmul share, the naive
    sampler, and a batch where half the rows end early."""
    prompts, rows, T = make_prompts(args), args.prompts * args.G, args.new_tokens
    prefill = timed(lambda: generate(model, args, prompts, 1), args.device, args.repeat)
    total = timed(lambda: generate(model, args, prompts, T), args.device, args.repeat)
    decode = total - prefill
    naive = naive_seconds(model, args, prompts)
    r = results["sampling"] = dict(rows=rows, prefill_ms=prefill * 1e3, decode_ms=decode * 1e3,
                                   generated_tokens_per_s=rows * T / total, decode_tokens_per_s=rows * (T - 1) / decode)
    r["decode_mfu"] = decode_flops(model, args, args.prompt_len, T) / decode / (results["peak"]["tflops"] * 1e12)
    r["decode_matmul_share"] = matmul_share(model, args, prompts)
    r["naive_ms"] = naive * 1e3
    r["speedup_vs_naive"] = naive / total

    # early EOS: half the prompts are half as long, and the model is edited so that EOS is near certain at a few
    # positions only those rows reach while decoding; the other half decode all T tokens
    short, eos, hit = args.prompt_len // 2, args.vocab_size - 1, args.prompt_len // 2 + T // 8
    if hit + 4 > args.prompt_len:  # the long rows would reach those positions too
        r["early_eos"] = "skipped: needs new_tokens <= 4 * prompt_len - 32"
        return
    mixed = make_prompts(args, [short, args.prompt_len] * (args.prompts // 2) + [args.prompt_len] * (args.prompts % 2))
    edited = build_model(args)
    with torch.no_grad():
        # the residual stream keeps the position embedding's direction 0; ln_f turns it into a huge EOS logit there
        edited.transformer.wpe.weight[hit:hit + 4, 0] = 100.0
        edited.transformer.wte.weight[eos, 0] = 2.0
    early = timed(lambda: generate(edited, args, mixed, T, eos_id=eos), args.device, args.repeat)
    full = timed(lambda: generate(edited, args, mixed, T), args.device, args.repeat)
    _, mask, _ = generate(edited, args, mixed, T, eos_id=eos)
    r["early_eos_rows_done_early"] = float((mask.sum(1) < T).float().mean())
    r["early_eos_time_vs_full"] = early / full
    r["early_eos_ideal_ratio"] = float(mask.sum()) / mask.numel()  # if a finished row cost nothing at all

def logprob_pass(args, naive):
    """Run in a fresh process: (seconds, peak resident memory above the inputs' in bytes) of one log-prob pass over
    a GRPO batch, chunked or naive. ru_maxrss is a per-process high-water mark, hence the fresh process."""
    model = build_model(args)
    rows, P, T = args.prompts * args.G, args.prompt_len, args.new_tokens
    idx = torch.randint(0, args.vocab_size, (rows, P + T), device=args.device)
    start = torch.full((rows,), P, device=args.device)

    def run():
        with torch.inference_mode(), autocast(args):
            if naive:  # the plain way: (B, T, V) float32 log-softmax of every position
                logp = model(idx).float().log_softmax(-1)
                return logp[:, P - 1:-1].gather(2, idx[:, P:, None])
            return model.logprobs(idx, start, T)

    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        seconds = timed(run, args.device, args.repeat)
        return seconds, torch.cuda.max_memory_allocated() - base
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # resident now
    seconds = timed(run, args.device, args.repeat)
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base

def bench_logprobs(args, model, results):
    """The old/ref log-prob pass over a whole GRPO batch: model.logprobs against a plain full log-softmax."""
    r = results["logprobs"] = {}
    tokens = args.prompts * args.G * args.new_tokens
    for name in ("chunked", "naive"):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            seconds, peak = pool.submit(logprob_pass, args, name == "naive").result()
        r[f"{name}_tokens_per_s"] = tokens / seconds
        r[f"{name}_peak_mb"] = peak / 2**20
    r["peak_memory_ratio"] = r["chunked_peak_mb"] / r["naive_peak_mb"]

SECTIONS = [bench_matmul_peak, bench_sampling, bench_logprobs]

# -----------------------------------------------------------------------------

def main():
    args = get_args()
    model = build_model(args)
    results = {"machine": dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                               threads=torch.get_num_threads(), torch=torch.__version__, dtype=args.dtype),
               "config": {k: v for k, v in vars(args).items() if k != "json"}}
    results["config"]["params_m"] = model.get_num_params() / 1e6
    for section in SECTIONS:
        section(args, model, results)
    print(f"{'section':<10} {'metric':<28} value")
    for section, metrics in results.items():
        for k, v in metrics.items():
            print(f"{section:<10} {k:<28} {v:.4g}" if isinstance(v, float) else f"{section:<10} {k:<28} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)

if __name__ == "__main__":
    main()
