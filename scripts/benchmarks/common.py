"""The benchmark's shape (presets, command line) and the helpers its sections share: the model, prompts, a GRPO
batch, timing with peak memory, and train.py run as a subprocess."""
import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext

import torch

from lib.measure import flops_per_token, memory_mb, timed
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: train.py
# after the peak, which always runs
SECTIONS = ("sampling", "logprobs", "train_step", "reward_model", "iteration", "multiturn", "tokenizer", "scale",
            "start", "truncation", "refill")

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
    "gemma-3-270m": dict(model_type="gemma3_text", n_layer=18, n_head=4, n_kv_head=1, n_embd=640, head_dim=256,
                         n_inner=2048, vocab_size=262144, bias=False, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
                         sliding_window=512, rope_local_theta=1e4, query_pre_attn_scalar=256,
                         layer_types=tuple("full_attention" if i % 6 == 5 else "sliding_attention"
                                           for i in range(18))),  # config/gemma3.py's model
    "llama-3.2-1b": dict(model_type="llama", n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, n_inner=8192,
                         vocab_size=128256, bias=False, rope_theta=500000.0, rope_scaling=dict(
                             factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)),
}

def get_args(argv=None, description=None):
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--top_k", type=int, help="the truncation section's top_k (default: none)")
    p.add_argument("--top_p", type=float, default=0.95, help="the truncation section's top_p")
    p.add_argument("--max_rows", help="the refill section's max_rows, comma-separated (default: a "
                                      "quarter and a half of --prompts x --G)")
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
                   ", ".join(SECTIONS))
    args = p.parse_args(argv)
    unknown = set((args.only or "").split(",")) - set(SECTIONS) - {""}
    if unknown:
        p.error(f"--only {','.join(sorted(unknown))}: no such section; the sections are {', '.join(SECTIONS)}")
    given = {k: v for k, v in vars(args).items() if k in DEFAULT and v is not None}
    vars(args).update({**DEFAULT, **PRESETS.get(args.preset, {}), **given})
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


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
    return sum(rows * flops_per_token(model, prompt_len + t, backward=False) for t in range(1, steps))

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
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
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
