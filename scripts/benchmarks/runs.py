"""bench.py's sections on train.py itself: whole iterations, the tokenizer, what each rank holds (scale),
memory at start-up, and the memory soak."""
import functools
import json
import math
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from lib import lora
from lib import sandbox
from lib import tools
from lib.chat import encode_prompt, load_template
from lib.measure import timed
from lib.tokenizer import _hf_bpe, bytes_to_unicode, get_tokenizer, load_hf_tokenizer
from scripts.benchmarks.common import ROOT, autocast, build_model, grpo_batch, make_prompts, run_train


PHASES = ("generate", "reward", "logprobs", "update")  # train.py's time/ metrics

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

def bench_multiturn(args, model, results):
    """Multi-turn sampling against single-turn: --prompts x --G rows of this GPT-2 shape edited to end a turn every
    --new_tokens/4 steps or so (end_geometrically); the first 3 ends of a row get an observation of 8 tokens (a
    calculator's answer), then of 24 (a tool turn in a chat template), each read into the row's cache in one forward
    (engine.py); the 4th ends the row. Against generate with no turns and as many policy tokens a row (the
    multi-turn rows' mean), and with 8-token observations and 1 ms of tool latency a call (a sleep) on top."""
    if model.config.model_type != "gpt2" or not model.config.bias:
        return  # end_geometrically needs the final norm's bias
    model, eos = build_model(args), 1  # a copy: the other sections keep theirs
    end_geometrically(model, eos, args.new_tokens / 4)
    prompts, calls = make_prompts(args), {}

    def turns(row, ids, length, latency=0.0):
        calls[row] = calls.get(row, 0) + 1
        time.sleep(latency)
        return [7] * length if calls[row] <= 3 else None

    def run(max_new_tokens, **kw):
        calls.clear()
        g = [torch.Generator(args.device).manual_seed(i) for i in range(len(prompts))]
        with autocast(args):
            return model.generate(prompts, max_new_tokens, num_samples=args.G, generator=g, **kw)
    r = results["multiturn"] = {}
    for length in (8, 24):
        _, mask, _ = run(args.new_tokens, eos_id=eos, turns=functools.partial(turns, length=length))
        policy, read = int(mask.sum()) // mask.shape[0], length * sum(min(c, 3) for c in calls.values()) / len(mask)
        multi = timed(lambda: run(args.new_tokens, eos_id=eos, turns=functools.partial(turns, length=length)),
                      args.device, args.repeat)
        single = timed(lambda: run(policy), args.device, args.repeat)
        # overhead: against as many policy tokens; per token: against as many tokens sampled or read in
        r.update({f"obs{length}_policy_tokens_per_row": policy, f"obs{length}_observation_tokens_per_row": read,
                  f"obs{length}_multi_turn_s": multi, f"obs{length}_single_turn_s": single,
                  f"obs{length}_overhead": multi / single - 1,
                  f"obs{length}_overhead_per_token": multi / (policy + read) / (single / policy) - 1})
        if length == 8:
            slow = functools.partial(turns, length=8, latency=1e-3)
            waiting = timed(lambda: run(args.new_tokens, eos_id=eos, turns=slow), args.device, args.repeat)
            r.update(obs8_with_1ms_tool_s=waiting, obs8_overhead_with_tool=waiting / single - 1)
    bench_python_tool(args, r)


def bench_python_tool(args, r):
    """The python tool's cost a call, in bubblewrap and unisolated, for a trivial program and a 100 ms one; then 16
    calls of the 100 ms one as a step's rows would make them (multiturn.observer), one after another and from 4
    threads."""
    sandboxes = ("bwrap", "none") if sandbox.sandbox_problem() is None else ("none",)
    for kind in sandboxes:
        for name, code in (("trivial", "pass"), ("100ms", "import time; time.sleep(0.1)")):
            r[f"python_{name}_{kind}_s"] = timed(lambda: sandbox.python(code, sandbox=kind), "cpu", args.repeat)
    call = functools.partial(sandbox.python, "import time; time.sleep(0.1)", sandbox=sandboxes[0])
    for workers in (1, 4):
        with ThreadPoolExecutor(workers) as pool:
            r[f"python_16_calls_{workers}_workers_s"] = timed(lambda: list(pool.map(lambda _: call(), range(16))),
                                                             "cpu", args.repeat)

def synthetic_tokenizer(path, n_vocab, seed=0):
    """Write a byte-level BPE tokenizer.json in the Qwen2.5 layout (its pre-tokenizer, NFC, ignore_merges false,
    special tokens after the vocabulary) with n_vocab tokens, grown the way training grows one: each merge joins
    two existing tokens, kept only if HF's BPE of the result is exactly that pair, so every token is reachable by its
    merges (what load_hf_tokenizer checks). Returns the mean token length in characters."""
    fixture = json.load(open(os.path.join(ROOT, "tests", "fixtures",
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
    downloaded), its checks included, and encoding a GSM8K-sized batch of prompts with it: as they
    are, and rendered by Qwen2.5-Instruct's chat template with tools first (chat.encode_prompt)."""
    with tempfile.TemporaryDirectory() as folder:
        mean_len = synthetic_tokenizer(os.path.join(folder, "tokenizer.json"), args.tokenizer_vocab)
        enc = load_hf_tokenizer(folder)  # also the warm-up of the timed build
        build = timed(lambda: load_hf_tokenizer(folder), "cpu", 1, warmup=0)
    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(500)]
    prompts = [" ".join(rng.choice(words) for _ in range(80)) + f" {rng.randint(0, 10**6)}." for _ in range(64)]
    encode = timed(lambda: [enc.encode(p) for p in prompts], "cpu", args.repeat)
    # the batch as chat prompts: Qwen2.5-Instruct's own template with the tools in its system
    # message, compiled once (chat.compile_template's cache) as in a run, then encoded
    qwen = os.path.join(ROOT, "tests", "fixtures", "chat_templates", "qwen2_5.jinja")
    cfg = SimpleNamespace(template=load_template(qwen), system_prompt=None, chat_template_kwargs={},
                          environment=SimpleNamespace(tools=tools.TOOLS))
    chat = timed(lambda: [encode_prompt(p, cfg, enc) for p in prompts], "cpu", args.repeat)
    results["tokenizer"] = dict(vocab=enc.n_vocab, mean_token_chars=mean_len, build_s=build, batch_prompts=64,
                                batch_chars=sum(map(len, prompts)), encode_batch_ms=encode * 1e3,
                                chat_tools_batch_ms=chat * 1e3)

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
