"""bench.py's truncation section (issue 47): what training on log q, top-k/top-p's truncated
distribution, costs against the full softmax's log-probs, and how often the trainer's kept set,
found from its own logits, differs from the one the sampler drew from."""
import argparse
import math
import tempfile

import torch

from lib.measure import timed_rounds
from lib.truncation import candidates, truncate_
from scripts.benchmarks.common import autocast, grpo_batch, make_prompts, run_train
from scripts.benchmarks.runs import PHASES, task_file


def kept(z, top_k, top_p):
    """(n, V) bool: the tokens top_k/top_p keep of each row of logits z, as the sampler does"""
    w, idx = candidates(torch.softmax(z.float(), -1), top_k, top_p)
    return torch.zeros(z.shape, dtype=torch.bool, device=z.device).scatter_(1, idx, w > 0)


def fingerprint(z, top_k, top_p):
    """Each row's kept set as (size, sum of ids, sum of squared ids) (n, 3): equal sets, equal
    prints; one token in or out changes them."""
    ids = torch.arange(z.shape[-1], device=z.device, dtype=torch.float64)
    return kept(z, top_k, top_p).double() @ torch.stack([torch.ones_like(ids), ids, ids ** 2], 1)


def edge(model, args, top_k, top_p):
    """Sample --prompts x --G rows of --new_tokens with top_k/top_p (no eos: every row decodes to
    the end, in order), print the kept set of every logits row the sampler drew from (a hook on the
    output layer), then the trainer's from its own forward of the whole sequences, in the same
    dtype. Returns the share of sampled tokens whose two sets differ, the share outside the
    trainer's set, and the mean |log q (sampler) - log q (trainer)|."""
    prints = []
    hook = model.lm_head.register_forward_hook(
        lambda m, i, out: prints.append(fingerprint(out, top_k, top_p)))
    prompts, G = make_prompts(args), args.G
    with autocast(args):
        tokens, _, logps = model.generate(prompts, args.new_tokens, num_samples=G, top_k=top_k,
                                          top_p=top_p,
                                          generator=torch.Generator(args.device).manual_seed(5))
    hook.remove()
    # the prefill's row a prompt (its G rows draw their first token from it), then a row each
    # decode step
    sampler = torch.stack([prints[0].repeat_interleave(G, 0)] + prints[1:])  # (new_tokens, rows, 3)
    differ = outside = gap = 0
    for r, row in enumerate(tokens):
        idx = torch.tensor(prompts[r // G] + row.tolist(), device=row.device)[None]
        with torch.no_grad(), autocast(args):
            z = model.logits(idx)[0, args.prompt_len - 1:-1].float()  # (new_tokens, V) each token's logits
        differ += (fingerprint(z, top_k, top_p) != sampler[:, r]).any(-1).sum().item()
        outside += (~kept(z, top_k, top_p).gather(1, row[:, None])).sum().item()
        logq = torch.log_softmax(truncate_(z, top_k, top_p, row), -1).gather(1, row[:, None])[:, 0]
        gap += (logq - logps[r]).abs().sum().item()
    return differ / tokens.numel(), outside / tokens.numel(), gap / tokens.numel()


def bench_truncation(args, model, results):
    """Top-k/top-p (--top_k, --top_p) with the trainer on log q (truncate_logprobs=True, the
    default) against the full softmax (False): a micro-batch's log-prob pass with gradient (timed
    in interleaved rounds), whole iterations of train.py (3 a run, the first warm-up; two runs of
    each, in turn), and the kept sets' disagreements in float32 and bfloat16."""
    idx, start, mask = grpo_batch(args)
    rows = slice(0, args.micro_batch_size)
    cut = dict(top_k=args.top_k, top_p=args.top_p)

    def step(**kw):
        with autocast(args):
            model.logprobs(idx[rows], start[rows], mask.shape[1], **kw).sum().backward()
    full_s, truncated_s = timed_rounds([step, lambda: step(**cut)], args.device, args.repeat)
    model.zero_grad(set_to_none=True)
    r = results["truncation"] = dict(top_k=str(args.top_k), top_p=args.top_p,
                                     logprob_step_full_s=full_s,
                                     logprob_step_truncated_s=truncated_s,
                                     logprob_step_ratio=truncated_s / full_s)
    # in turn, twice (once with --repeat 1), the least of each kept: a shared machine has slow
    # spells
    for truncate in (False, True) * min(args.repeat, 2):
        with tempfile.TemporaryDirectory() as out_dir:
            its = run_train(args, out_dir, n_layer=args.n_layer, n_head=args.n_head,
                            n_embd=args.n_embd, vocab_size=args.vocab_size,
                            block_size=args.block_size, prompts_per_step=args.prompts,
                            num_generations=args.G, max_completion_length=args.new_tokens,
                            micro_batch_size=math.gcd(args.micro_batch_size, len(idx)),
                            eval_interval=0, save_interval=5, max_iters=3,
                            peak_flops=results["peak"]["tflops"] * 1e12,
                            task=task_file(args, out_dir), truncate_logprobs=truncate, **cut)
        mean = lambda key: sum(m[key] for m in its[1:]) / len(its[1:])  # the first: warm-up
        name = "truncated" if truncate else "full"
        got = {f"iter_{name}_s": mean("dt"), f"iter_{name}_gap": mean("sampler/logp_diff"),
               **{f"iter_{name}_{p}_s": mean(f"time/{p}") for p in PHASES[:4]}}
        r.update({k: min(v, r.get(k, math.inf)) for k, v in got.items()})
    r["iter_ratio"] = r["iter_truncated_s"] / r["iter_full_s"]
    for dtype in ("float32", "bfloat16"):
        differ, outside, gap = edge(model, argparse.Namespace(**dict(vars(args), dtype=dtype)),
                                    args.top_k, args.top_p)
        r.update({f"{dtype}_sets_differ": differ, f"{dtype}_token_outside": outside,
                  f"{dtype}_logq_gap": gap})
