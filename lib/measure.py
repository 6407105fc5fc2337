"""
Measuring the machine: wall time per phase, memory, the matmul peak that MFU is a fraction of, and the progress
lines of long phases.

train.py logs with these and scripts/bench.py builds its numbers on them; the model and the loss never need them.
"""
import functools
import json
import os
import resource
import time
from datetime import timedelta

import torch

from lib.parallelism import all_sum, gather


def sync(device):
    """Wait for the device's queued work (CUDA is asynchronous), so a clock read after it means something."""
    if torch.device(device).type == 'cuda':
        torch.cuda.synchronize(device)


def timed_rounds(fns, device, repeat, warmup=1):
    """Best seconds of each of fns, timed in turn, `repeat` rounds: numbers meant to be compared, e.g. as a ratio,
    then see the same slow spells of a shared machine."""
    for fn in fns * warmup:
        fn()
    best = [float('inf')] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def timed(fn, device, repeat, warmup=1):
    """Best wall-clock seconds of fn() over `repeat` runs, after `warmup` untimed ones."""
    return timed_rounds([fn], device, repeat, warmup)[0]


@functools.lru_cache(maxsize=4)  # once per process and dtype: tests run train.py many times in one process
def matmul_peak(device, dtype=torch.float32, repeat=5):
    """The machine's own matmul throughput in FLOP/s in `dtype` (a big square matmul), and what was measured. MFU
    is against this, not a datasheet: CPUs differ 2x in float32 and some have bf16 matrix units. On a CPU the size
    doubles from 256 up to 2048 while one product takes under 50 ms: bf16 without matrix units runs ~100x slower
    than float32 there, and a 2048 one would take minutes."""
    cuda = torch.device(device).type == 'cuda'
    n = 8192 if cuda else 256
    while True:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        if cuda or n >= 2048 or timed(lambda: a @ b, device, repeat=1) > 0.05:
            break
        n *= 2
    seconds = timed(lambda: a @ b, device, repeat=repeat)
    return 2 * n**3 / seconds, f"{n}x{n} {dtype}".replace('torch.', '')


def flops_per_token(model, T, backward=True):
    """A GPT's model FLOPs for one token at context length T (PaLM appendix B, as nanoGPT's
    estimate_mfu): 2 per weight of a matmul (an untied input embedding is a lookup, not a matmul;
    grouped-query attention's smaller k and v and SwiGLU's third matrix are in the weights) plus 2*T
    per query-head channel per layer for the attention scores and as much for the mixing (a sliding
    layer's T at most its window); x3 with the backward pass."""
    cfg = model.config
    # the matmuls' weights: not the position table, nor an untied input embedding (a lookup)
    weights = sum(p.numel() for n, p in model.named_parameters() if n != "transformer.wpe.weight"
                  and (cfg.tie_word_embeddings or n != "transformer.wte.weight"))
    spans = [min(T, cfg.sliding_window) if t == "sliding_attention" else T  # the keys a query sees
             for t in cfg.layer_types or [None] * cfg.n_layer]
    forward = 2 * weights + 4 * cfg.n_head * cfg.head_dim * sum(spans)
    return 3 * forward if backward else forward


def update_flops(model, rows, T, C):
    """Model FLOPs of a training step over `rows` sequences of T tokens with C completion positions
    each (on average: logprobs' lengths): the body runs over all T positions, the output layer only
    over the completion positions. A frozen weight (LoRA's base) gets no gradient of its own: 4
    FLOPs per token in the step, not 6."""
    head = 6 * model.config.vocab_size * model.config.n_embd  # the output layer's flops_per_token
    frozen_head = 0 if model.lm_head.weight.requires_grad else head // 3
    frozen_body = sum(p.numel() for p in model.transformer.h.parameters() if not p.requires_grad)
    body = T * (flops_per_token(model, T) - head - 2 * frozen_body)
    return rows * (body + C * (head - frozen_head))


def row_flops(model, longest):
    """The model FLOPs of a training row, once at the start for update_metrics: (body, head), a row of T tokens
    with C completion positions costing body[T] + C * head (update_flops, which is linear in C), T up to
    `longest`."""
    return [update_flops(model, 1, T, 0) for T in range(longest + 1)], update_flops(model, 1, 0, 1)


def update_metrics(stats, shapes, *, maxima, steps, seconds, flops, peak, world_size, distributed,
                   held):
    """The update's numbers for the log, computed once after it, over every rank (each must call
    it). stats: grpo_loss's of every micro-batch, each its share of its step's token mean, summed
    in float64 and averaged over the `steps` optimizer steps, those named in maxima the largest.
    shapes: each micro-batch's (rows, T, completion tokens the output layer ran on, tokens not
    padding, the rows' own tokens), for the model FLOPs (row_flops' table), tokens/s, MFU, the
    padding's share and the share of the rows' tokens that sharing a prompt saved. The same
    whatever the layout. MFU: all ranks' FLOPs over what world_size devices of `peak` FLOP/s each
    could do in those seconds, so that it reads the same at every world size. held: (model,
    optimizer, reference model or None, teacher or None), whose tensors this rank holds for
    training (under FSDP its shards): their MB, the teacher's only with one. Returns (the speed:
    tokens/s and MFU, the stats, shares and memory)."""
    total = {}
    for micro_batch in stats:
        for k, v in micro_batch.items():
            v = v.detach().double()
            total[k] = v if k not in total else total[k].maximum(v) if k in maxima else total[k] + v
    body, head = flops
    done = torch.tensor([sum(b * body[T] + n * head for b, T, n, _, _ in shapes),
                         sum(b * T for b, T, *_ in shapes), sum(shape[3] for shape in shapes),
                         sum(shape[4] for shape in shapes)], dtype=torch.float64)
    values = largest = torch.stack(list(total.values()))
    if distributed:
        values, largest, done = all_sum(values), gather(values[None]).amax(0), all_sum(done)
    flops, tokens, not_padding, row_tokens = done.tolist()
    means = {k: (largest[i] if k in maxima else values[i] / steps).item()
             for i, k in enumerate(total)}
    speed = dict(train_tok_s=tokens / seconds, mfu=flops / seconds / (peak * world_size))
    shares = dict(pad_share=1 - not_padding / tokens, saved_share=1 - not_padding / row_tokens)
    model, optimizer, ref_model, teacher = held
    local = lambda t: t.to_local() if hasattr(t, 'to_local') else t  # an FSDP shard's own part
    size = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts) / 2**20
    params = list(model.parameters())  # a tied weight once
    # LoRA's base has no gradient, and a LoRA run's reference is the policy itself
    memory = {'mem/params_mb': size(params),
              'mem/grads_mb': size(p for p in params if p.requires_grad),
              'mem/optimizer_mb': size(v for state in optimizer.state.values()
                                       for v in state.values() if torch.is_tensor(v)),
              'mem/ref_mb': size(ref_model.parameters()) if ref_model not in (None, model) else 0.0}
    if teacher is not None:
        memory['mem/teacher_mb'] = size(teacher.parameters())
    return speed, dict(means, **shares, **memory)


def fastest_dtype(device):
    """What train.py's dtype='auto' computes in: 'bfloat16' (autocast) on a GPU that has it, and on a CPU whose
    bf16 matmuls run at least twice as fast as its float32 ones (bf16 matrix units, e.g. Intel's AMX), else
    'float32' (without such units a CPU runs bf16 matmuls many times slower)."""
    if torch.device(device).type == 'cuda':
        return 'bfloat16' if torch.cuda.is_bf16_supported() else 'float32'
    bf16, fp32 = (matmul_peak(device, dtype)[0] for dtype in (torch.bfloat16, torch.float32))
    return 'bfloat16' if bf16 >= 2 * fp32 else 'float32'


def memory_mb(device):
    """CUDA: the peak allocated since the last call. CPU: the resident memory now (peak where /proc is missing)."""
    if torch.device(device).type == 'cuda':
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**20
    try:
        with open('/proc/self/statm') as f:
            return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def ticker(what, total, unit, interval):
    """A progress line for a long phase (warm start, evaluation): tick(done) prints `what: done/total unit (elapsed,
    eta)` at most every interval seconds (math.inf: never, as on all ranks but the first), so short phases stay
    quiet."""
    t0 = last = time.time()

    def tick(done, extra=''):
        nonlocal last
        now = time.time()
        if now - last >= interval and done < total:
            eta = (now - t0) / done * (total - done)
            elapsed, eta = timedelta(seconds=round(now - t0)), timedelta(seconds=round(eta))
            print(f"{what}: {done}/{total} {unit}{extra} ({elapsed}, eta {eta})", flush=True)
            last = now
    return tick


def log(metrics, line, *, out_dir, wandb=None):
    """Rank 0's record of an iteration or an evaluation: its line printed, its metrics a line of out_dir/metrics.jsonl
    and, with wandb, logged there at the iteration (the x-axis of eval and train alike)."""
    print(line, flush=True)
    with open(os.path.join(out_dir, 'metrics.jsonl'), 'a') as f:
        f.write(json.dumps(metrics) + '\n')
    if wandb:
        wandb.log(metrics, step=metrics["iter"])


def iteration_line(m, *, max_iters, eta, reward_fns):
    """An iteration's line in the log, from its metrics m (iteration_metrics'); with several
    reward functions each adds its mean reward (the total is their weighted sum), a reward
    model or judge the seconds of scoring, and a curriculum its pool's sizes (in the draw,
    too easy, too hard)."""
    each = reward_fns if len(reward_fns) > 1 else ()
    others = ''.join(f" | {f.__name__} {m['reward/' + f.__name__]:.2f}" for f in each)
    models = any(f.__name__.startswith(('rm:', 'judge:')) for f in reward_fns)  # their forwards: a phase worth a look
    return (f"iter {m['iter']}/{max_iters}: reward {m['reward']:.3f}±{m['reward_std']:.3f} | acc {m['acc']:.3f}"
            f"{others} | flat {m['flat_groups']:.2f} | len {m['len_mean']:.1f}/{m['len_max']:.0f} trunc "
            f"{m['truncated']:.2f} | kl {m['kl']:.4f} | entropy {m['entropy']:.2f} | clip {m['clip_ratio/region']:.3f}"
            + (f" | teacher kl {m['teacher/kl']:.3f}" if 'teacher/kl' in m else "")
            + (f" | pool {m['pool/active']}/{m['pool/easy']}/{m['pool/hard']}" if 'pool/easy' in m else "") +
            f" | sampler gap {m['sampler/logp_diff']:.1e} kl {m['sampler/kl']:.1e}"
            f" | gnorm {m['grad_norm']:.2f} | lr {m['lr']:.1e} | rollout {m['rollout_tok_s']:.0f} tok/s | train "
            f"{m['train_tok_s']:.0f} tok/s | mfu {100 * m['mfu']:.1f}% | {m['dt']:.2f}s | eta "
            f"{timedelta(seconds=round(eta))}" +
            (f" | scoring {m['time/reward']:.2f}s" if models else "") +
            (f" | {m['bad_steps']} non-finite step(s) skipped" if m['bad_steps'] else ""))
