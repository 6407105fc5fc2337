"""
The one place nanoGRPO's speed numbers come from. Each section is a function that fills its part of one results
dict; main() prints the dict as a table and writes it as JSON. Random weights: speed does not depend on them.
Without --preset the model is a 6-layer, 384-wide GPT-2; a preset is a real model's shape, and an explicit
--n_layer/--n_head/--n_embd/--vocab_size overrides it (fewer layers: a CPU run in minutes).

$ python bench.py                                  # GRPO-shaped: 8 prompts x G=8, prompt 64, completion 128
$ python bench.py --prompts 4 --G 16 --prompt_len 32 --new_tokens 64   # the smaller shape of the first benchmark
$ python bench.py --preset gpt2 --device cuda --compile --cuda_graphs --json bench.json   # bench_gpu.sh: all of it
$ OMP_NUM_THREADS=2 python bench.py --preset qwen2.5-0.5b --n_layer 4 --json bench_qwen25.json
$ python bench.py --preset qwen3-0.6b --n_layer 4       # or --preset llama-3.2-1b
$ python bench.py --soak                           # 200 iterations of train.py: does its memory stay flat?

Sections: the machine's matmul peak (every MFU is against it), sampling (KV cache vs naive full recompute, and a
batch where half the rows end early), the log-prob pass (chunked, also with each token's entropy, vs a plain full
log-softmax), one training step (forward, GRPO loss, backward, clip, AdamW), whole GRPO iterations of train.py
itself, phase by phase, building a Hugging Face tokenizer, what each rank holds under DDP, FSDP and LoRA (scale),
and each rank's memory while train.py starts from a checkpoint (start).
"""

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext

import torch

import lora
from loss import grpo_loss
from measure import matmul_peak, memory_mb, timed, timed_rounds
from model import GPT, GPTConfig
from rollout import micro_batches
from sampling import sample
from tokenizer import _hf_bpe, bytes_to_unicode, get_tokenizer, load_hf_tokenizer

DEFAULT = dict(n_layer=6, n_head=6, n_embd=384, vocab_size=50304)  # a 30M GPT-2: the shape without --preset
# the GPTConfig fields of real models (their config.json); the Llama family has no biases but Qwen2's q/k/v ones
QWEN = dict(vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, bias=False)
PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "qwen2.5-0.5b": dict(QWEN, model_type="qwen2", n_layer=24, n_head=14, n_kv_head=2, n_embd=896, n_inner=4864,
                         qkv_bias=True),
    "qwen2.5-3b": dict(QWEN, model_type="qwen2", n_layer=36, n_head=16, n_kv_head=2, n_embd=2048, n_inner=11008,
                       qkv_bias=True),
    "qwen3-0.6b": dict(QWEN, model_type="qwen3", n_layer=28, n_head=16, n_kv_head=8, n_embd=1024, head_dim=128,
                       n_inner=3072, qk_norm=True),
    "smollm2-135m": dict(model_type="llama", n_layer=30, n_head=9, n_kv_head=3, n_embd=576, n_inner=1536,
                         vocab_size=49152, bias=False, rope_theta=100000.0),  # config/smollm2.py's model
    "llama-3.2-1b": dict(model_type="llama", n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, n_inner=8192,
                         vocab_size=128256, bias=False, rope_theta=500000.0, rope_scaling=dict(
                             factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)),
}

def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="a real model's shape (random weights)")
    for name, value in DEFAULT.items():  # None: not given, so the preset's (or the default shape's)
        p.add_argument(f"--{name}", type=int, help=f"overrides the preset's; default without one: {value}")
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--G", type=int, default=8, help="completions per prompt")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=128, help="completion length (the longest, with --lengths)")
    p.add_argument("--lengths", choices=["fixed", "geometric"], default="fixed",
                   help="completion lengths of the training step and the iteration: all --new_tokens, or geometric "
                        "with mean 3/8 of it, capped at it (as real answers vary)")
    p.add_argument("--micro_batch_size", type=int, default=16, help="rows per forward/backward of a training step")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="autocast dtype; default bfloat16 on CUDA")
    p.add_argument("--compile", action="store_true", help="torch.compile the forward and the decode step")
    p.add_argument("--cuda_graphs", action="store_true", help="replay decode steps as CUDA graphs (engine.py)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (best is kept)")
    p.add_argument("--naive_points", type=int, default=4,
                   help="sequence lengths the naive sampler is timed at (0: run it for every token)")
    p.add_argument("--tokenizer_vocab", type=int, default=151_643,
                   help="tokens in the tokenizer section's synthetic tokenizer.json (default: Qwen2.5's)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--soak", action="store_true", help="only the memory soak: 200 iterations of a tiny train.py run")
    p.add_argument("--only", help="comma-separated sections to run (the peak always runs): " +
                   ", ".join(s.__name__[6:] for s in SECTIONS[1:]))
    args = p.parse_args(argv)
    names = [s.__name__[6:] for s in SECTIONS[1:]]
    unknown = set((args.only or "").split(",")) - set(names) - {""}
    if unknown:
        p.error(f"--only {','.join(sorted(unknown))}: no such section; the sections are {', '.join(names)}")
    given = {k: v for k, v in vars(args).items() if k in DEFAULT and v is not None}
    vars(args).update({**DEFAULT, **PRESETS.get(args.preset, {}), **given})
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args

# -----------------------------------------------------------------------------
# shared helpers

def autocast(args):
    return nullcontext() if args.dtype == "float32" else torch.autocast(args.device.split(":")[0], torch.bfloat16)

def build_model(args):
    torch.manual_seed(0)
    cfg = GPTConfig(**{f.name: vars(args)[f.name] for f in dataclasses.fields(GPTConfig) if f.name in vars(args)})
    model = GPT(cfg).to(args.device).eval()
    if args.compile:  # as train.py's compile: the forward (training's log-prob path) and generate's decode step
        model.compile()
        model.decode = torch.compile(model.decode, fullgraph=True)
    model.decode_graphs = args.cuda_graphs
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

def grpo_batch(args):
    """A GRPO-shaped batch of random tokens, seeded: idx (rows, prompt_len + new_tokens), G rows to a prompt, each
    row's prompt length and the completion mask (rows, new_tokens), all True, or a prefix of a geometric length
    with --lengths geometric."""
    rows, P, C = args.prompts * args.G, args.prompt_len, args.new_tokens
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, args.vocab_size, (rows, P + C), generator=g)
    idx[:, :P] = idx[::args.G, :P].repeat_interleave(args.G, 0)  # a group's rows share its prompt
    lengths = torch.full((rows,), C)
    if args.lengths == "geometric":  # P(L = k) = p (1 - p)^(k - 1) with mean 1/p = 3C/8, cut at C
        p = 8 / (3 * C)
        lengths = (torch.log(torch.rand(rows, generator=g)) / math.log(1 - p)).ceil().clamp(1, C).long()
    mask = torch.arange(C) < lengths[:, None]  # (rows, C)
    return idx.to(args.device), torch.full((rows,), P, device=args.device), mask.to(args.device)

def in_fresh_process(fn, *fn_args):
    """fn(*fn_args) in a new process: the CPU memory high-water mark (ru_maxrss) is per process and never goes down."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *fn_args).result()

def timed_peak(fn, args):
    """(best seconds of fn(), its peak memory in bytes above what is held before the first call): allocated bytes on
    CUDA; on CPU the resident set, whose high-water mark only means this when called in_fresh_process."""
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        seconds = timed(fn, args.device, args.repeat)
        return seconds, torch.cuda.max_memory_allocated() - base
    base = memory_mb("cpu") * 2**20  # resident now
    seconds = timed(fn, args.device, args.repeat)
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base

def run_train(args, out_dir, env=None, ranks=1, peaks=None, **overrides):
    """Run train.py with no warm start on args' device, dtype, compile and CUDA graphs, with --key=value overrides
    and the environment env (default: this one), on `ranks` processes (torchrun); return its training iterations'
    metrics from out_dir/metrics.jsonl. peaks: a dict to fill with each rank's peak resident memory in MB."""
    config = dict(device=args.device, dtype=args.dtype, compile=args.compile, cuda_graphs=args.cuda_graphs,
                  sft_iters=0, out_dir=out_dir, **overrides)
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                                   if ranks > 1 else [])
    cmd = launcher + ["train.py"] + [f"--{k}={v!r}" for k, v in config.items()]
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.abspath(__file__)), stdout=subprocess.DEVNULL,
                             stderr=err, text=True, env=env)
        while peaks is not None and p.poll() is None:
            for rank, mb in peak_rss_mb(f"--out_dir={out_dir!r}").items():
                peaks[rank] = max(peaks.get(rank, 0.0), mb)
            time.sleep(0.05)
        if p.wait() != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed: {(err.read().strip().splitlines() or ['no stderr'])[-1]}")
    if not os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
        return []  # max_iters=0 without an evaluation
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "dt" in m]  # the eval lines have no dt

def peak_rss_mb(arg):
    """{rank: peak resident memory in MB so far (VmHWM)} of the running train.py processes with arg (their out_dir)
    on their command line: torchrun's workers by their LOCAL_RANK, a process alone as rank 0 (Linux's /proc)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue  # gone, or not ours
        if arg.encode() not in argv or b"torch.distributed.run" in argv or "VmHWM:" not in status:
            continue  # not one of its ranks, or one that has just exited
        rank = next((int(v[len(b"LOCAL_RANK="):]) for v in environ if v.startswith(b"LOCAL_RANK=")), 0)
        out[rank] = int(status.split("VmHWM:")[1].split()[0]) / 1024
    return out

# -----------------------------------------------------------------------------
# sections

def bench_matmul_peak(args, model, results):
    """The big square matmul's rate in the dtype the matmuls run in (every MFU is against it), and the output
    layer's at 64 rows, (64, n_embd) @ (n_embd, vocab): the practical ceiling of a decode step, whose matmuls are
    that thin."""
    dtype = getattr(torch, args.dtype)
    flops, what = matmul_peak(args.device, dtype, max(args.repeat, 5))
    h, w = (torch.randn(n, args.n_embd, device=args.device, dtype=dtype) for n in (64, args.vocab_size))
    head = timed(lambda: h @ w.t(), args.device, max(args.repeat, 5))
    results["peak"] = dict(matmul=what, tflops=flops / 1e12, head64_tflops=2 * 64 * args.n_embd * args.vocab_size /
                           head / 1e12)

def naive_generate(model, args, prompts, steps):
    """The baseline: no cache, every step recomputes the whole sequence (only the last position goes through the
    output layer, as nanoGPT's generate does). Needs equal prompt lengths, which the benchmark uses."""
    idx = torch.tensor(prompts, device=args.device).repeat_interleave(args.G, 0)  # (N, P)
    g = torch.Generator(args.device).manual_seed(2)
    with torch.inference_mode(), autocast(args):
        for _ in range(steps):
            logits = model.lm_head(model.hidden(idx)[:, -1])  # (N, V)
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

def matmul_share(args):
    """Run in a fresh process (a profiler run leaves state that inflates later processes' memory peaks): shares of a
    whole generate call's wall time spent inside matmul kernels and inside attention over the cache (SDPA: two
    matmuls a head, whose FLOPs decode MFU counts, but bound by reading the cache), from the profiler."""
    model, prompts = build_model(args), make_prompts(args)
    generate(model, args, prompts, args.new_tokens)  # warm-up
    activity = torch.profiler.ProfilerActivity
    cuda = args.device.startswith("cuda")
    # on CUDA an aten op's device time is that of the kernels it launched
    with torch.profiler.profile(activities=[activity.CPU] + [activity.CUDA] * cuda) as prof:
        seconds = timed(lambda: generate(model, args, prompts, args.new_tokens), args.device, 1, warmup=0)
    us = lambda keep: sum(e.self_device_time_total if cuda else e.self_cpu_time_total for e in prof.key_averages()
                          if keep(e.key))
    return (us(lambda k: k in ("aten::mm", "aten::addmm", "aten::bmm")) / 1e6 / seconds,
            us(lambda k: k.startswith("aten::_scaled_dot_product")) / 1e6 / seconds)

def decode_overhead(args, T):
    """Seconds of host overhead (Python, dispatch, kernel launches) per decode step: the step time of a model with
    the same layers, rows and lengths but tiny widths, whose arithmetic is next to nothing."""
    tiny = argparse.Namespace(**{**vars(args), "n_embd": 4 * args.n_head, "head_dim": 4, "n_inner": 16 * args.n_head,
                                 "vocab_size": 64})  # the same family, heads and kv heads; 4 wide each
    model, prompts = build_model(tiny), make_prompts(tiny)
    steps = timed(lambda: generate(model, tiny, prompts, T), args.device, args.repeat)
    return (steps - timed(lambda: generate(model, tiny, prompts, 1), args.device, args.repeat)) / (T - 1)

def sampling_peak(args):
    """Run in a fresh process: peak memory in bytes of one generate call above the weights (cache, logits, draws)."""
    model, prompts, once = build_model(args), make_prompts(args), argparse.Namespace(**{**vars(args), "repeat": 1})
    return timed_peak(lambda: generate(model, args, prompts, args.new_tokens), once)[1]

def bench_sampling(args, model, results):
    """Prefill and decode of model.generate, its MFU (needs the peak section first), matmul share, host overhead
    and peak memory, the naive sampler, and a batch where half the rows end early."""
    prompts, rows, T = make_prompts(args), args.prompts * args.G, args.new_tokens
    prefill = timed(lambda: generate(model, args, prompts, 1), args.device, args.repeat)
    total = timed(lambda: generate(model, args, prompts, T), args.device, args.repeat)
    decode = total - prefill
    naive = naive_seconds(model, args, prompts)
    r = results["sampling"] = dict(rows=rows, prefill_ms=prefill * 1e3, decode_ms=decode * 1e3,
                                   generated_tokens_per_s=rows * T / total, decode_tokens_per_s=rows * (T - 1) / decode)
    r["decode_mfu"] = decode_flops(model, args, args.prompt_len, T) / decode / (results["peak"]["tflops"] * 1e12)
    r["decode_vs_head64"] = r["decode_mfu"] * results["peak"]["tflops"] / results["peak"]["head64_tflops"]
    r["decode_matmul_share"], r["decode_attention_share"] = in_fresh_process(matmul_share, args)
    r["naive_ms"] = naive * 1e3
    r["decode_overhead_share"] = decode_overhead(args, T) / (decode / (T - 1))
    r["peak_mb"] = in_fresh_process(sampling_peak, args) / 2**20
    r["speedup_vs_naive"] = naive / total

    # early EOS: half the prompts are half as long, and the model is edited so that EOS is near certain at a few
    # positions only those rows reach while decoding; the other half decode all T tokens. The edit is to the final
    # hidden states, not to a position embedding: rotary families have none
    short, eos, hit = args.prompt_len // 2, args.vocab_size - 1, args.prompt_len // 2 + T // 8
    if hit + 4 > args.prompt_len:  # the long rows would reach those positions too
        r["early_eos"] = "skipped: needs new_tokens <= 4 * prompt_len - 32"
        return
    mixed = make_prompts(args, [short, args.prompt_len] * (args.prompts // 2) + [args.prompt_len] * (args.prompts % 2))
    edited = build_model(args)
    hidden = edited.hidden

    def edited_hidden(idx, pos=None, **cache):  # direction 0 of the final hidden state: 100 there, a huge EOS logit
        h = hidden(idx, pos, **cache)
        pos = torch.arange(idx.size(1), device=idx.device) if pos is None else pos  # as hidden's default
        h[..., 0] += 100.0 * ((pos >= hit) & (pos < hit + 4))
        return h

    edited.hidden = edited_hidden
    with torch.no_grad():
        edited.lm_head.weight[eos, 0] = 2.0
    _, mask, _ = generate(edited, args, mixed, T, eos_id=eos)
    ended = mask.sum(1) < T
    r["early_eos_rows_done_early"] = float(ended.float().mean())
    r["early_eos_ideal_ratio"] = float(mask.sum()) / mask.numel()  # if time were proportional to live tokens
    # if a finished row cost nothing on this machine: all rows until the last early one ends, then the others alone
    # (a step over half the rows costs more than half a step: the weights are read all the same)
    k, rest = int(mask[ended].sum(1).max()), [p for i, p in enumerate(mixed) if not ended[i * args.G]]
    run = lambda prompts, steps, eos_id=None: lambda: generate(edited, args, prompts, steps, eos_id)
    early, full, *bound = timed_rounds([run(mixed, T, eos), run(mixed, T), run(mixed, k), run(rest, T), run(rest, k)],
                                       args.device, args.repeat)
    r["early_eos_time_vs_full"] = early / full
    r["early_eos_bound_vs_full"] = (bound[0] + bound[1] - bound[2]) / full

def logprob_pass(args, naive, entropy=False):
    """Run in a fresh process: (seconds, peak memory above the weights and inputs in bytes) of one log-prob pass over
    a GRPO batch, chunked (with each token's entropy too if entropy) or naive."""
    model = build_model(args)
    idx, start, _ = grpo_batch(args)
    P, T = args.prompt_len, args.new_tokens

    def run():
        with torch.inference_mode(), autocast(args):
            if naive:  # the plain way: (B, T, V) float32 log-softmax of every position
                logp = model(idx).float().log_softmax(-1)
                return logp[:, P - 1:-1].gather(2, idx[:, P:, None])
            return model.logprobs(idx, start, T, entropy=entropy)

    return timed_peak(run, args)

def bench_logprobs(args, model, results):
    """The old/ref log-prob pass over a whole GRPO batch: model.logprobs against a plain full log-softmax, and
    model.logprobs with entropy=True (the entropy from the same chunks) against it without."""
    r = results["logprobs"] = {}
    tokens = args.prompts * args.G * args.new_tokens
    for name in ("chunked", "entropy", "naive"):
        seconds, peak = in_fresh_process(logprob_pass, args, name == "naive", name == "entropy")
        r[f"{name}_tokens_per_s"] = tokens / seconds
        r[f"{name}_peak_mb"] = peak / 2**20
    r["peak_memory_ratio"] = r["chunked_peak_mb"] / r["naive_peak_mb"]
    r["entropy_time_ratio"] = r["chunked_tokens_per_s"] / r["entropy_tokens_per_s"]  # seconds with / without
    r["entropy_peak_ratio"] = r["entropy_peak_mb"] / r["chunked_peak_mb"]

def train_step(args):
    """Run in a fresh process: (seconds, peak memory above the weights and batch in bytes, time against the same
    rows at full length or None) of one optimizer step as the trainer takes it: micro-batches of forward (the
    log-prob path), on-policy Dr. GRPO loss and backward accumulate the gradient of the whole batch (in train.py's
    micro-batches: sorted by length, each cut to its longest row), then clip, AdamW and zero_grad. With --lengths
    geometric, the step is also timed in turn with the same rows at full length, which is what every row cost when
    micro-batches were padded to the rollout's longest completion."""
    model = build_model(args).train()
    idx, start, mask = grpo_batch(args)
    rows = idx.size(0)
    batch = dict(idx=idx, start=start, mask=mask, advantages=torch.randn(rows, device=args.device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device.startswith("cuda"))

    def step(batch=batch):
        for _, mb in micro_batches(batch, args.micro_batch_size):
            with autocast(args):  # with each token's entropy, which train.py always logs
                logps, entropy = model(mb['idx'], mb['start'], mb['mask'].shape[1], entropy=True,
                                       lengths=mb['mask'].sum(1), pos=mb['pos'])  # (b, L)
            # num_sequences counts the whole step: the micro-batches' gradients add up to the step's
            loss, _ = grpo_loss(logps, None, None, mb['advantages'], mb['mask'], loss_type="dr_grpo",
                                max_completion_length=args.new_tokens, num_sequences=rows, entropy=entropy)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds, peak = timed_peak(step, args)
    if args.lengths == "fixed":
        return seconds, peak, None
    full = dict(batch, mask=torch.ones_like(mask))
    short, long = timed_rounds([step, lambda: step(full)], args.device, args.repeat)
    return seconds, peak, short / long

def bench_train_step(args, model, results):
    """One training step over the whole GRPO batch: tokens/s (prompt and completion tokens, as train.py's
    train_tok_s), MFU (needs the peak section first) and peak memory above the weights and batch (gradients, AdamW
    state, activations)."""
    seconds, peak, vs_full = in_fresh_process(train_step, args)
    idx, start, mask = grpo_batch(args)
    parts = [mb for _, mb in micro_batches(dict(idx=idx, start=start, mask=mask), args.micro_batch_size)]
    computed = sum(mb['idx'].numel() for mb in parts)  # tokens through the model, padding included
    placed = sum(mb['tokens'] for mb in parts)  # those of them that are not padding
    own = (start + mask.sum(1)).sum().item()  # the rows' prompt and completion tokens, each row alone
    flops = sum(model.update_flops(*mb['idx'].shape, mb['mask'].sum().item() / len(mb['idx'])) for mb in parts)
    results["train_step"] = dict(
        rows=len(idx), micro_batch_size=min(args.micro_batch_size, len(idx)), lengths=args.lengths,
        completion_len=mask.sum(1).double().mean().item(), step_ms=seconds * 1e3,
        tokens_per_s=own / seconds, pad_share=1 - placed / computed, saved_share=1 - placed / own,
        mfu=flops / seconds / (results["peak"]["tflops"] * 1e12), peak_mb=peak / 2**20)
    if vs_full is not None:
        results["train_step"]["time_vs_full_length"] = vs_full

PHASES = ("generate", "reward", "logprobs", "backward", "optimizer", "comm")  # train.py's time/ metrics

def end_geometrically(model, eos, mean):
    """Edit a random GPT-2 so that every position gives eos about the same logit, log(V / (mean - 1)): each decode
    step then ends a row with probability ~1/mean, and completion lengths are about geometric. The final norm's
    bias gets a large component on channel 0, which only eos's row of the (tied) output layer reads."""
    if model.config.model_type != "gpt2" or not model.config.bias:
        raise ValueError("--lengths geometric for the iteration needs a GPT-2 shape with biases (the final norm's)")
    with torch.no_grad():
        model.transformer.ln_f.bias.zero_()[0] = 100.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eos, 0] = math.log(model.config.vocab_size / (mean - 1)) / 100.0

def task_file(args, out_dir):
    """A task of random-letter prompts of --prompt_len (one token each with the byte tokenizer) whose answers no
    one will match, in out_dir: its train.py task= path."""
    g = torch.Generator().manual_seed(4)
    for split in ("train", "test"):
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as f:
            for _ in range(max(64, args.prompts)):
                letters = torch.randint(97, 123, (args.prompt_len,), generator=g).tolist()
                f.write(json.dumps(dict(prompt="".join(map(chr, letters)), answer="0")) + "\n")
    return os.path.join(out_dir, "{split}.jsonl")

def bench_iteration(args, model, results):
    """Whole GRPO iterations of train.py itself at this model shape, from its own metrics: each phase's seconds and
    share of the iteration, rollout and training tokens/s, MFU (against the peak section's) and memory (train.py's
    mem_mb: peak allocated on CUDA, resident on CPU). The prompts are --prompt_len random letters (one token each
    with the byte tokenizer train.py then uses); a random model rarely samples the eos, so completions run to
    --new_tokens, or about geometrically with --lengths geometric (end_geometrically). Of 4 iterations the first is
    warm-up and the other 3 are averaged."""
    with tempfile.TemporaryDirectory() as out_dir:
        task = task_file(args, out_dir)
        if model.config.model_type == "gpt2" and args.lengths == "fixed":
            shape = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, vocab_size=args.vocab_size)
        else:  # train.py builds only GPT-2 from scratch; it starts any other family from this model's checkpoint
            shape = dict(init_from=os.path.join(out_dir, "random_init"))
            if args.lengths == "geometric":
                model = build_model(args)  # a copy: the other sections keep theirs
                end_geometrically(model, get_tokenizer("bytes").eot_token, 3 * args.new_tokens / 8)
            model.save_pretrained(shape["init_from"])
        its = run_train(args, out_dir, **shape, block_size=args.block_size, prompts_per_step=args.prompts,
                        num_generations=args.G, max_completion_length=args.new_tokens,
                        micro_batch_size=math.gcd(args.micro_batch_size, args.prompts * args.G),
                        eval_interval=0, save_interval=5, max_iters=4, peak_flops=results["peak"]["tflops"] * 1e12,
                        task=task)
    mean = lambda key: sum(m[key] for m in its[1:]) / len(its[1:])
    r = results["iteration"] = dict(prompt_len=args.prompt_len, completion_len=mean("len_mean"), dt_s=mean("dt"))
    for phase in PHASES:
        r[f"{phase}_s"] = mean(f"time/{phase}")
        r[f"{phase}_share"] = r[f"{phase}_s"] / r["dt_s"]
    r.update({k: mean(k) for k in ("rollout_tok_s", "train_tok_s", "pad_share", "saved_share", "mfu", "mem_mb")})

def synthetic_tokenizer(path, n_vocab, seed=0):
    """Write a byte-level BPE tokenizer.json in the Qwen2.5 layout (its pre-tokenizer, NFC, ignore_merges false,
    special tokens after the vocabulary) with n_vocab tokens, grown the way training grows one: each merge joins
    two existing tokens, kept only if HF's BPE of the result is exactly that pair, so every token is reachable by its
    merges (what load_hf_tokenizer checks). Returns the mean token length in characters."""
    fixture = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "fixtures",
                                          "tiny-bpe-a", "tokenizer.json"), encoding="utf-8"))
    tokens = list(bytes_to_unicode().values())  # the 256 single bytes
    vocab, merges, rank, rng = {t: i for i, t in enumerate(tokens)}, [], {}, random.Random(seed)
    while len(tokens) < n_vocab:
        # short tokens are the likelier parts, as in a trained vocabulary (mean length ~8 characters at 150k)
        a, b = tokens[int(len(tokens) * rng.random() ** 6)], tokens[rng.randrange(min(len(tokens), 2000))]
        if a + b not in vocab and _hf_bpe(a + b, rank) == [a, b]:
            rank[(a, b)] = len(merges)
            merges.append(f"{a} {b}")
            vocab[a + b] = len(tokens)
            tokens.append(a + b)
    specials = [dict(t, id=n_vocab + i) for i, t in enumerate(fixture["added_tokens"])]
    tok = dict(fixture, added_tokens=specials, model=dict(fixture["model"], vocab=vocab, merges=merges))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tok, f)
    return sum(map(len, tokens)) / len(tokens)

def bench_tokenizer(args, model, results):
    """Building a tiktoken Encoding from a --tokenizer_vocab-token tokenizer.json (synthetic, since nothing is
    downloaded), its checks included, and encoding a GSM8K-sized batch of prompts with it."""
    with tempfile.TemporaryDirectory() as folder:
        mean_len = synthetic_tokenizer(os.path.join(folder, "tokenizer.json"), args.tokenizer_vocab)
        enc = load_hf_tokenizer(folder)  # also the warm-up of the timed build
        build = timed(lambda: load_hf_tokenizer(folder), "cpu", 1, warmup=0)
    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(500)]
    prompts = [" ".join(rng.choice(words) for _ in range(80)) + f" {rng.randint(0, 10**6)}." for _ in range(64)]
    encode = timed(lambda: [enc.encode(p) for p in prompts], "cpu", args.repeat)
    results["tokenizer"] = dict(vocab=enc.n_vocab, mean_token_chars=mean_len, build_s=build, batch_prompts=64,
                                batch_chars=sum(map(len, prompts)), encode_batch_ms=encode * 1e3)

def activation_mb(model, args):
    """MB of the tensors one micro-batch's training forward saves for backward (counted once per storage by
    saved-tensor hooks): the activation memory of a step, the same under DDP and FSDP."""
    idx, start, _ = grpo_batch(args)
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(args):
        model.train()(idx[:args.micro_batch_size], start[:args.micro_batch_size], args.new_tokens)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}  # weights are held anyway
    return sum(n for ptr, n in seen.items() if ptr not in params) / 2**20

def bench_scale(args, model, results):
    """What each rank holds for training under DDP, FSDP and LoRA (rank 16, all linears): 2 ranks of train.py
    itself under torchrun, with beta > 0 so the reference model counts. Parameters, gradients, AdamW state and the
    reference model come from train.py's mem/ metrics (each rank's own tensors: its shards under FSDP),
    activations from one micro-batch's forward here (activation_mb), and the iteration time from the metrics. Also
    LoRA against full fine-tuning on one process (each over 2 iterations after a warm-up one)."""
    r = results["scale"] = dict(activations_mb=activation_mb(build_model(args), args))
    lora_model = build_model(args)
    lora.add_lora(lora_model, 16, 32.0)
    r["lora_activations_mb"] = activation_mb(lora_model, args)
    runs = dict(ddp=dict(parallel="ddp"), fsdp=dict(parallel="fsdp"), lora=dict(lora_rank=16))
    for ranks in (2, 1):
        for name, knobs in runs.items() if ranks == 2 else [("full", {}), ("lora_1rank", dict(lora_rank=16))]:
            with tempfile.TemporaryDirectory() as out_dir:
                model.save_pretrained(os.path.join(out_dir, "init"))
                its = run_train(args, out_dir, ranks=ranks, init_from=os.path.join(out_dir, "init"),
                                block_size=args.block_size, prompts_per_step=args.prompts, num_generations=args.G,
                                max_completion_length=args.new_tokens, beta=0.04, eval_interval=0, save_interval=0,
                                micro_batch_size=math.gcd(args.micro_batch_size, args.prompts * args.G // ranks),
                                max_iters=3, task=task_file(args, out_dir),
                                peak_flops=results["peak"]["tflops"] * 1e12, **knobs)
            for key in ("params", "grads", "optimizer", "ref"):
                r[f"{name}_{key}_mb"] = its[-1][f"mem/{key}_mb"]
            r[f"{name}_iteration_s"] = sum(m["dt"] for m in its[1:]) / len(its[1:])
    resident = lambda name: r[f"{name}_params_mb"] + r[f"{name}_optimizer_mb"]
    r["fsdp_vs_ddp_params_optimizer"] = resident("fsdp") / resident("ddp")
    r["lora_vs_full_optimizer"] = r["lora_1rank_optimizer_mb"] / r["full_optimizer_mb"]
    r["lora_vs_full_iteration"] = r["lora_1rank_iteration_s"] / r["full_iteration_s"]

def bench_start(args, model, results):
    """Each of 2 ranks' peak resident memory (CPU) while train.py starts from this model's checkpoint and stops
    (max_iters=0, no evaluation): under DDP every rank reads the checkpoint whole, under FSDP rank 0 alone reads it
    and the others build the model on the meta device and receive their shards."""
    r = results["start"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(os.path.join(tmp, "init"))
        task = task_file(args, tmp)
        for name in ("ddp", "fsdp"):
            peaks = {}
            run_train(args, os.path.join(tmp, name), ranks=2, peaks=peaks, parallel=name,
                      init_from=os.path.join(tmp, "init"), block_size=args.block_size, max_iters=0, eval_interval=0,
                      task=task, prompts_per_step=args.prompts, num_generations=args.G,
                      max_completion_length=args.new_tokens,
                      micro_batch_size=math.gcd(args.micro_batch_size, args.prompts * args.G // 2), peak_flops=1e12)
            for rank in range(2):
                r[f"{name}_rank{rank}_peak_mb"] = peaks.get(rank, math.nan)
    r["weights_mb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20

SECTIONS = [bench_matmul_peak, bench_sampling, bench_logprobs, bench_train_step, bench_iteration, bench_tokenizer,
            bench_scale, bench_start]

def soak(args, iters=200, every=20, warmup=40, limit=0.02):
    """Memory soak: `iters` iterations of a tiny model through train.py, evals and checkpoints included. A leak (a
    tensor kept per iteration, a cache that grows) shows as mem_mb creeping up, so after `warmup` iterations its
    spread (max - min) / min must stay within `limit`. glibc's malloc gets a fixed mmap threshold, so that it maps
    big blocks on their own and unmaps them when freed: otherwise the resident set moves up and down by tens of MB
    with what it happens to keep. Prints mem_mb every `every` iterations; returns the verdict."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    with tempfile.TemporaryDirectory() as out_dir:
        mem = [m["mem_mb"] for m in run_train(args, out_dir, env, n_layer=2, n_head=2, n_embd=64, prompts_per_step=4,
                                              num_generations=4, micro_batch_size=16, eval_interval=50,
                                              save_interval=50, max_iters=iters)]
    for i in sorted({*range(0, iters, every), iters - 1}):
        print(f"iter {i:4d}  mem_mb {mem[i]:.1f}")
    low, high = min(mem[warmup:]), max(mem[warmup:])
    ok = (high - low) / low <= limit
    print(f"soak {'PASS' if ok else 'FAIL'}: mem_mb over iterations {warmup}..{iters - 1} in [{low:.1f}, {high:.1f}], "
          f"growth {(high - low) / low:.1%} (limit {limit:.0%})")
    return ok

# -----------------------------------------------------------------------------

def main():
    args = get_args()
    if args.soak:
        sys.exit(0 if soak(args) else 1)
    model = build_model(args)
    results = {"machine": dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                               threads=torch.get_num_threads(), torch=torch.__version__, dtype=args.dtype),
               "config": {k: v for k, v in vars(args).items() if k != "json"}}
    results["config"].update(model_type=model.config.model_type, params_m=model.get_num_params() / 1e6)
    only = args.only.split(",") if args.only else [s.__name__[6:] for s in SECTIONS]
    for section in SECTIONS:
        if section is bench_matmul_peak or section.__name__[6:] in only:
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
