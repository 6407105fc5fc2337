"""bench.py's sections on the parts: the matmul peak, sampling, the log-prob pass, one training step."""
import argparse

import torch

from loss import grpo_loss
from lib.measure import flops_per_token, matmul_peak, timed, timed_rounds, update_flops
from rollout import micro_batches
from scripts.benchmarks.common import (autocast, build_model, decode_flops, generate, grpo_batch, in_fresh_process,
                               make_prompts, timed_peak)


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
    """The baseline: GPT.generate(plain=True), the plain sampler, which has no cache and recomputes every row's whole
    sequence at each step (only the newest position goes through the output layer, as nanoGPT's generate does)."""
    with torch.inference_mode(), autocast(args):
        model.generate(prompts, steps, num_samples=args.G, plain=True,
                       generator=torch.Generator(args.device).manual_seed(2))

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
                logp = model.logits(idx).float().log_softmax(-1)
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
    flops = sum(update_flops(model, *mb['idx'].shape, mb['mask'].sum().item() / len(mb['idx'])) for mb in parts)
    results["train_step"] = dict(
        rows=len(idx), micro_batch_size=min(args.micro_batch_size, len(idx)), lengths=args.lengths,
        completion_len=mask.sum(1).double().mean().item(), step_ms=seconds * 1e3,
        tokens_per_s=own / seconds, pad_share=1 - placed / computed, saved_share=1 - placed / own,
        mfu=flops / seconds / (results["peak"]["tflops"] * 1e12), peak_mb=peak / 2**20)
    if vs_full is not None:
        results["train_step"]["time_vs_full_length"] = vs_full


def bench_reward_model(args, model, results):
    """A reward model's pass over a GRPO batch (reward_model.py): this shape as the classifier's decoder, each row's
    final hidden state at its last token (a score layer's matmul on top is nothing), packed as the trainer scores
    (a group's shared prompt once) and plain (each row its own padded sequence), in micro-batches of
    --micro_batch_size; MFU of the forward against the peak."""
    from reward_model import last_hidden
    idx, start, mask = grpo_batch(args)  # with --lengths geometric, rows of geometric completion lengths
    rows = [ids[:s + n] for ids, s, n in zip(idx.tolist(), start.tolist(), mask.sum(1).tolist())]
    groups = [b // args.G for b in range(len(idx))]
    r = results["reward_model"] = {}
    tokens = sum(map(len, rows))
    head = 2 * args.vocab_size * args.n_embd  # the output layer's share of a token's FLOPs: a reward model skips it
    flops = sum(len(ids) * (flops_per_token(model, len(ids), backward=False) - head) for ids in rows)
    for plain in (False, True):
        cfg = argparse.Namespace(micro_batch_size=args.micro_batch_size, plain=plain)
        with autocast(args):
            seconds = timed(lambda: last_hidden(model, rows, groups, cfg), args.device, args.repeat)
        name = "plain" if plain else "packed"
        r[f"{name}_s"], r[f"{name}_tokens_per_s"] = seconds, tokens / seconds
        r[f"{name}_mfu"] = flops / seconds / (results["peak"]["tflops"] * 1e12)
    r["packed_speedup"] = r["plain_s"] / r["packed_s"]
