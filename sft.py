"""
The supervised warm start, a cold start as in DeepSeek-R1: next-token training on the
task's answers before RL. GRPO learns only from groups whose rewards differ, so a policy
that never earns a reward learns nothing; a model trained from scratch starts here, a
pretrained one skips it (train.py's sft_iters). The weights it ends with are cached in
out_dir/warmstart and reused by later runs while the settings that made them match.
"""
import json
import math
import os
import shutil
import time

import torch

from evaluate import greedy_hits
from model import GPT
from rollout import pack, prompt_seed
from lib import checkpoint, multiturn, parallelism
from lib.chat import encode_prompt
from lib.measure import ticker
from lib.parallelism import all_sum, full_state_dict, gathered

# the settings the cached weights depend on
KEYS = ('init_from', 'task', 'task_options', 'tokenizer',
        'chat_template', 'system_prompt', 'chat_template_kwargs', 'chat_date',
        'vocab_size', 'n_layer', 'n_head', 'n_embd', 'block_size', 'bias',
        'sft_iters', 'sft_batch_size', 'sft_learning_rate', 'sft_target_acc',
        'sft_check_interval', 'seed', 'env')


def target(row, cfg, enc):
    """A row's tokens to learn, and which are the policy's (1) rather than an
    observation's (0): its answer and the end of text; with an environment and a row
    that has a demonstration, the demonstration's turns instead, with the environment's
    own observations between them, as a multi-turn rollout would have them."""
    turns = row.get('demonstration') if cfg.environment is not None else None
    ids, own, text, episode = [], [], '', {}
    for k, turn in enumerate(turns or [row['answer']]):
        # what the environment answers to the turns so far
        if k:
            observation = cfg.environment.step(row, text)
            seen = multiturn.encode_observation(observation, cfg, enc, episode=episode,
                                                ids=ids, row=row)
            shown = observation if isinstance(observation, str) else enc.decode(seen)
            ids, own, text = ids + seen, own + [0] * len(seen), text + shown
        mine = enc.encode_ordinary(turn)
        ids, own, text = ids + mine, own + [1] * len(mine), text + turn
    return ids + [cfg.eos_ids[0]], own + [1]


def default_iters(init_from):
    """sft_iters=None: up to 1000 steps from scratch, none from a pretrained
    checkpoint."""
    return 0 if os.path.isdir(init_from) or init_from.endswith('.gguf') else 1000


def warm_start(model, raw_model, optimizer, rows, cfg, enc, accuracy, rank, stop):
    """Train `model` (DDP's or FSDP's wrapper of raw_model) on the answers of the train
    rows with `optimizer`, or load the cached result. Every rank takes
    sft_batch_size / ranks rows a step, the same draws whatever the ranks. With
    sft_target_acc it ends once greedy accuracy (`accuracy` scores >= 1) on the first
    256 train prompts reaches it (checked every sft_check_interval steps). stop() is
    called before each step, on every rank: it exits if a stop signal came. Rank 0
    prints what it did."""
    began = time.time()
    # the settings as the JSON file reads them back: lists, not tuples
    spec = json.loads(json.dumps({k: getattr(cfg, k) for k in KEYS}))
    path = os.path.join(cfg.out_dir, 'warmstart')
    p = next(raw_model.parameters())
    dtype, device = p.dtype, p.device
    if checkpoint.read_json(os.path.join(path, 'warmstart.json')) == spec:
        # whole tensors, sharded if need be
        parallelism.load_whole(
            raw_model, lambda: GPT.from_pretrained(path, dtype=dtype).state_dict())
        _said('loaded', began, rank)
        return
    ranks, eos = cfg.world_size, cfg.eos_ids[0]
    # only rank 0 reports progress
    every = cfg.progress_interval if rank == 0 else math.inf
    tick = ticker('warm start', cfg.sft_iters, 'steps', every)
    # the same prompts at every check
    probe = rows[rank:256:ranks]
    probe_seeds = [prompt_seed(cfg.seed, -3, j)
                   for j in range(rank, len(probe) * ranks, ranks)]
    steps = cfg.sft_iters
    for i in range(cfg.sft_iters):
        checking = cfg.sft_target_acc and i and i % cfg.sft_check_interval == 0
        if checking:
            # FSDP: the whole weights for the sampler
            with gathered(raw_model):
                hits = greedy_hits(raw_model, probe, probe_seeds, cfg, enc, accuracy)[0]
            counts = torch.tensor([hits, len(probe)], dtype=torch.float64)
            # over all ranks
            hits, n = all_sum(counts).tolist()
        # after the check, which a signal cuts short: its count is then never used
        stop()
        if checking and hits / n >= cfg.sft_target_acc:
            steps = i
            break
        g = torch.Generator().manual_seed(prompt_seed(cfg.seed, -2, i))
        picks = torch.randint(len(rows), (cfg.sft_batch_size,),
                              generator=g).tolist()[rank::ranks]
        prompts = [encode_prompt(rows[j]['prompt'], cfg, enc) for j in picks]
        answers, own = zip(*[target(rows[j], cfg, enc) for j in picks])
        idx, start = pack(prompts, answers, eos)
        L = max(map(len, answers))
        # (B, L): 1 on the policy's tokens
        mask = torch.tensor([o + [0] * (L - len(o)) for o in own], dtype=torch.float)
        with torch.autocast(device.type, dtype=cfg.ptdtype, enabled=cfg.autocast):
            # (B, L) through DDP's forward
            logps = model(idx.to(device), start.to(device), L)
        mask = mask.to(device, logps.dtype)
        # token mean over all ranks
        loss = -(logps * mask).sum() / all_sum(mask.sum()) * ranks
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tick(i + 1, f", loss {loss.item():.3f}")
    # every rank takes part under FSDP
    weights = full_state_dict(raw_model, keep=rank == 0)
    if rank == 0:
        # a second stop signal waits for the files to be whole; the settings go last, so
        # weights cut off mid-write are never taken for a match
        with parallelism.writing():
            shutil.rmtree(path, ignore_errors=True)
            raw_model.save_pretrained(path, state_dict=weights)
            checkpoint.write_json(os.path.join(path, 'warmstart.json'), spec)
    _said(f'trained {steps} iters', began, rank)


def _said(how, began, rank):
    if rank == 0:
        print(f"warm start: {how} ({time.time() - began:.1f}s)", flush=True)
