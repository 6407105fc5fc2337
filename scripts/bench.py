"""
The one place nanoGRPO's speed numbers come from. Each section is a function that fills its part of one results
dict; main() prints the dict as a table and writes it as JSON. Random weights: speed does not depend on them.
Without --preset the model is a 6-layer, 384-wide GPT-2; a preset is a real model's shape, and an explicit
--n_layer/--n_head/--n_embd/--vocab_size overrides it (fewer layers: a CPU run in minutes).

$ python -m scripts.bench                                  # GRPO-shaped: 8 prompts x G=8, prompt 64, completion 128
$ python -m scripts.bench --prompts 4 --G 16 --prompt_len 32 --new_tokens 64   # the first benchmark's shape
$ python -m scripts.bench --preset gpt2 --device cuda --compile --cuda_graphs --json bench.json  # all of it
$ OMP_NUM_THREADS=2 python -m scripts.bench --preset qwen2.5-0.5b --n_layer 4 --json bench_qwen25.json
$ python -m scripts.bench --preset qwen3-0.6b --n_layer 4       # or --preset llama-3.2-1b
$ python -m scripts.bench --soak                           # 200 iterations of train.py: does its memory stay flat?
$ python -m scripts.bench --only truncation --top_p 0.95   # or --top_k 50 --top_p 0.95
$ OMP_NUM_THREADS=1 python -m scripts.bench --only refill --prompts 16 --G 4 --new_tokens 256 --dtype bfloat16

Sections: the machine's matmul peak (every MFU is against it), sampling (KV cache vs naive full recompute, and a
batch where half the rows end early), the log-prob pass (chunked, also with each token's entropy, vs a plain full
log-softmax), one training step (forward, GRPO loss, backward, clip, AdamW), a reward model's scoring pass (packed
and plain), whole GRPO iterations of train.py itself, phase by phase, building a Hugging Face
tokenizer and encoding prompts (also rendered by a chat template), what each rank holds under DDP,
FSDP and LoRA (scale), each rank's memory while train.py starts from a checkpoint (start), and
top-k/top-p's cost when the trainer takes log q, with how often its kept set differs from the
sampler's (truncation), and the sampler refilling at most --max_rows rows against all at once, on
SmolLM2-135M's long-tailed completions (refill).
"""
import json
import sys

import torch

from scripts.benchmarks.common import SECTIONS as NAMES, build_model, get_args
from scripts.benchmarks.kernels import (bench_logprobs, bench_matmul_peak, bench_reward_model, bench_sampling,
                                       bench_train_step)
from scripts.benchmarks.runs import bench_iteration, bench_multiturn, bench_scale, bench_start, bench_tokenizer, soak
from scripts.benchmarks.refill import bench_refill
from scripts.benchmarks.truncation import bench_truncation

SECTIONS = [bench_matmul_peak, bench_sampling, bench_logprobs, bench_train_step, bench_reward_model, bench_iteration,
            bench_multiturn, bench_tokenizer, bench_scale, bench_start, bench_truncation, bench_refill]
assert [s.__name__[6:] for s in SECTIONS[1:]] == list(NAMES)  # the names --only takes


def main():
    args = get_args(description=__doc__)
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
