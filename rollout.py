"""
Rollout: a step's prompts in, the batch the loss needs out.

For each prompt the policy samples G = num_generations completions (model.generate
prefills the prompt once and decodes all G*prompts rows together), reward functions
score them, and loss.group_advantages turns each group's rewards into advantages.
What comes back holds, per completion row:

    idx        (B, T)  prompt + completion, right-padded: what model.logprobs reads
    start      (B,)    prompt length = index of the first completion token in idx
    mask       (B, C)  1 on completion tokens that count in the loss
                       (C = max_completion_length)
    old_logps  (B, C)  log-probs of the sampled tokens under the sampling policy
                       (the ratio's denominator)
    sampler_logps (B, C)  the log-probs generate reported: old_logps itself, unless
                          old_logps were redone (see rollout: autocast, or the full
                          softmax with top-k/top-p)
    ref_logps  (B, C)  log-probs under the frozen reference model, only when beta > 0
    advantages (B,), or (B, C) with a teacher: on-policy distillation's, one a token

Randomness is per prompt, not per rank: prompt j of iteration `it` is sampled from
its own generator seeded by (seed, it, j). So a prompt gets the same completions
whichever rank, batch or resume it lands in, and a run on 1 GPU and on 8 sees the
same rollouts (up to float rounding of the logits).
"""
import time
from contextlib import nullcontext

import torch

from loss import (decoupled_advantages, entropy_threshold, group_advantages,
                  kl_divergence, reverse_kl_advantages)
from reward import compute_rewards
from lib import multiturn, packing
from lib.chat import encode_prompt, text_of
from lib.lora import adapters_off, merged
from lib.parallelism import all_sum, gather, gathered


def prompt_seed(*key):
    """A 63-bit seed from a tuple of ints, e.g. (seed, iteration, prompt id):
    python's hash of ints and tuples of ints is the same in every process and run
    (only str hashes are randomised)."""
    return hash(key) & 0x7FFF_FFFF_FFFF_FFFF


def epoch_order(n, epoch, seed):
    """(n,) the train rows in the order epoch `epoch` draws them: a seeded reshuffle."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def step_rows(train_rows, it, rank, cfg, pool=None):
    """This rank's prompts of iteration it: a seeded reshuffle of the train set each
    epoch, cut across ranks. The position in the data is a function of the
    iteration, so a resume needs nothing else. With a curriculum the pool walks the
    same positions, skipping retired prompts (lib/curriculum.py), and every rank
    takes its share of the iteration's walk."""
    n, per_rank = len(train_rows), cfg.prompts_per_step // cfg.world_size
    if pool is not None:
        drawn = pool.draw(it)[rank * per_rank:(rank + 1) * per_rank]
        return [dict(train_rows[i], _id=pos) for i, pos in drawn]
    first = it * cfg.prompts_per_step + rank * per_rank
    positions = range(first, first + per_rank)
    # the one or two epochs the rows fall in
    order = {epoch: epoch_order(n, epoch, cfg.seed)
             for epoch in {pos // n for pos in positions}}
    return [dict(train_rows[order[pos // n][pos % n]], _id=pos)
            for pos in positions]


def extra_rows(train_rows, n, it, rank, round_, cfg):
    """Dynamic sampling's n extra prompts in a resampling round: random train rows,
    seeded by (it, rank, round)."""
    generator = torch.Generator().manual_seed(
        prompt_seed(cfg.seed, it, rank, round_))
    picks = torch.randint(len(train_rows), (n,), generator=generator).tolist()
    return [dict(train_rows[i], _id=(rank, round_, k))
            for k, i in enumerate(picks)]


def pack(prompts, completions, pad):
    """Token lists into what model.logprobs reads: idx (B, T) rows of prompt +
    completion, right-padded (causal attention never looks at the padding on the
    right), and start (B,) where each completion begins."""
    width = max(map(len, prompts)) + max(map(len, completions))
    idx = torch.full((len(prompts), width), pad, dtype=torch.long)
    for b, (prompt, completion) in enumerate(zip(prompts, completions)):
        idx[b, :len(prompt) + len(completion)] = torch.tensor(prompt + completion)
    return idx, torch.tensor([len(prompt) for prompt in prompts])


def last_counted(mask):
    """(B, C) -> (B,) each row's completion up to its last token that counts: what
    the log-prob passes read. The mask is a prefix but for a multi-turn row's
    observations, which are context between the policy's turns."""
    return (mask * torch.arange(1, mask.size(1) + 1, device=mask.device)).amax(1)


def last_turn_start(mask):
    """(B, C) -> (B,) where each row's last turn starts: after the last
    observation's token before its last counted one (a multi-turn row's), 0 for a
    single turn."""
    at = torch.arange(1, mask.size(1) + 1, device=mask.device)
    observed = ~mask & (at <= last_counted(mask)[:, None])
    return (observed * at).amax(1)


def sample(model, rows, seeds, cfg, enc, temperature=None, num_samples=None):
    """Sample completions for rows (dicts with 'prompt'); returns prompt ids, (N, C)
    tokens, mask, logps and, with an environment (cfg.environment), each row's
    episode (else None)."""
    G = num_samples or cfg.num_generations
    C = cfg.max_completion_length
    device = next(model.parameters()).device
    prompts = [encode_prompt(row['prompt'], cfg, enc) for row in rows]
    generators = [torch.Generator(device).manual_seed(seed) for seed in seeds]
    temperature = cfg.temperature if temperature is None else temperature
    # LoRA samples from the weights with the adapters merged in: no adapter matmuls
    # per decode step. Not under autocast: the merged weight, rounded to bf16, would
    # lose most of a small update.
    merging = (merged(model) if cfg.lora_rank and not cfg.autocast
               else nullcontext())
    # a single turn unless an environment plays
    turns, record, ends = None, None, cfg.eos_ids
    if cfg.environment:
        turns, record, ends = multiturn.episodes(cfg.environment, rows, G, cfg, enc)
    with merging, torch.autocast(device.type, dtype=cfg.ptdtype,
                                 enabled=cfg.autocast):
        tokens, mask, logps = model.generate(
            prompts, C, num_samples=G, temperature=temperature,
            top_k=cfg.top_k, top_p=cfg.top_p,
            eos_id=ends, generator=generators,
            turns=turns, turn_workers=cfg.tool_workers,
            plain=cfg.plain, max_rows=cfg.max_rows)
    # generate stops early when every row is done; the loss wants width C
    pad = C - tokens.shape[1]
    tokens = torch.nn.functional.pad(tokens, (0, pad), value=cfg.eos_ids[0])
    mask = torch.nn.functional.pad(mask, (0, pad), value=False)
    logps = torch.nn.functional.pad(logps.float(), (0, pad))
    return prompts, tokens, mask, logps, record


def score(rows, tokens, mask, cfg, enc, reward_fns, reward_weights,
          num_samples=None, record=None):
    """Decode and score completions (with an environment, whole trajectories, record
    their episodes). Returns rewards (N,) with NaN = not applicable, truncated (N,),
    texts, per-fn."""
    G = num_samples or cfg.num_generations
    token_rows = tokens.tolist()
    ids = [row[:n] for row, n in zip(token_rows, last_counted(mask).tolist())]
    completions = [text_of(c, cfg, enc) for c in ids]
    truncated = ([not episode['finished'] for episode in record] if record else
                 [len(c) == cfg.max_completion_length and c[-1] not in cfg.eos_ids
                  for c in ids])
    columns = {k: [row[k] for row in rows for _ in range(G)]
               for k in rows[0] if k != 'prompt'}
    # DAPO's overlong punishment counts the policy's own tokens, so completion_ids
    # leave out a multi-turn row's observations.
    own_ids = [[t for t, counted in zip(row, row_mask) if counted]
               for row, row_mask in zip(token_rows, mask.tolist())]
    columns.update(completion_ids=own_ids, truncated=truncated,
                   last_turn=completions,
                   max_completion_length=cfg.max_completion_length)
    # what the environment said after each of the policy's turns
    if record:
        # the policy's last turn from the tokens, not the text: a chat template's
        # markup around a tool's result is the observation's, whatever the result says
        starts = last_turn_start(mask).tolist()
        last_turn = [text_of(c[start:], cfg, enc) for c, start in zip(ids, starts)]
        observations = [episode['observations'] for episode in record]
        columns.update(observations=observations, last_turn=last_turn)
    prompts = [row['prompt'] for row in rows for _ in range(G)]
    total, per_fn = compute_rewards(reward_fns, reward_weights, prompts,
                                    completions, columns)
    rewards = torch.tensor([float('nan') if r is None else r for r in total],
                           dtype=torch.float64)
    return rewards, torch.tensor(truncated), completions, per_fn


def is_flat(rewards, G):
    """(N,) rewards -> (N / G,) bool: the groups whose rewards are all equal (NaN,
    not applicable, as 0). Their advantages are zero, so they teach nothing; a group
    of one is always flat."""
    grouped = rewards.nan_to_num(0.0).view(-1, G)  # (groups, G)
    return grouped.amax(1) == grouped.amin(1)


def rollout(model, train_rows, it, rank, cfg, enc, reward_fns, reward_weights,
            pool=None):
    """
    Sample and score this rank's groups of iteration `it` (step_rows; dynamic
    sampling adds extra_rows until enough of them teach something). A group is one
    prompt and its G completions: a dict of the prompt's ids and its rows' tokens,
    mask, the sampler's log-probs, rewards, truncated flags and each reward
    function's scores ('scores' (G, functions), NaN where one does not apply).
    Returns (groups, info): info holds the dropped groups and each phase's seconds.
    """
    G = cfg.num_generations
    rows = step_rows(train_rows, it, rank, cfg, pool)
    kept, dropped, rounds = [], 0, 0
    # each phase's seconds, as nanoGPT takes dt: the clock read after it
    times, since = dict(generate=0.0, reward=0.0), time.perf_counter()
    # once, or with dynamic sampling until the batch holds enough informative groups
    while True:
        seeds = [prompt_seed(cfg.seed, it, r['_id']) for r in rows]
        prompts, tokens, mask, logps, record = sample(model, rows, seeds, cfg, enc)
        times['generate'] += time.perf_counter() - since
        since = time.perf_counter()
        rewards, truncated, _, per_fn = score(rows, tokens, mask, cfg, enc,
                                              reward_fns, reward_weights,
                                              record=record)
        times['reward'] += time.perf_counter() - since
        since = time.perf_counter()
        scores = torch.tensor([[float('nan') if v is None else v
                                for v in per_fn[f.__name__]]
                               for f in reward_fns], dtype=torch.float64).T
        per_row = dict(tokens=tokens, mask=mask, logps=logps, rewards=rewards,
                       truncated=truncated, scores=scores,
                       **(multiturn.counts(record) if record else {}))
        groups = [dict(prompt=prompts[g],
                       **{k: v[g * G:(g + 1) * G] for k, v in per_row.items()})
                  for g in range(len(rows))]
        if not cfg.dynamic_sampling:
            return groups, dict(time=times, dropped_groups=0)
        # DAPO dynamic sampling: a group of equal rewards has zero advantage: it
        # teaches nothing
        flat = is_flat(rewards, G).tolist()
        dropped += sum(flat)
        kept += [group for group, group_flat in zip(groups, flat) if not group_flat]
        want = cfg.prompts_per_step // cfg.world_size
        if len(kept) >= want or rounds == cfg.max_resample_rounds:
            # Out of rounds, flat groups (advantage 0) fill up, so every rank keeps
            # as many rows.
            kept += [group for group, group_flat in zip(groups, flat) if group_flat]
            return kept[:want], dict(time=times, dropped_groups=dropped)
        rounds += 1
        rows = extra_rows(train_rows, want - len(kept), it, rank, rounds, cfg)


def make_batch(model, ref_model, groups, info, rank, cfg, reward_weights, teacher=None):
    """
    The batch the loss needs (the module docstring) from rollout's groups, on the
    model's device: packed, the old log-probs redone where the sampler's are not the
    trainer's (cfg.redo_old_logps), the reference's, and advantages over every
    rank's groups. Adds to info, for the log, every rank's rewards, scores,
    completion lengths and truncated flags (and a multi-turn run's tool calls and
    errors), and the seconds of this phase. With a teacher (on-policy distillation,
    docs/distillation.md) its log-probs are taken as the reference's, each token's
    advantage gains teacher_weight x loss.reverse_kl_advantages, and info each row's
    reverse KL, summed.
    """
    G, device, since = (cfg.num_generations, next(model.parameters()).device,
                        time.perf_counter())
    cat = lambda key: torch.cat([group[key] for group in groups])
    mask, rewards, truncated = cat('mask'), cat('rewards'), cat('truncated')
    row_prompts = [group['prompt'] for group in groups for _ in range(G)]
    idx, start = pack(row_prompts, cat('tokens').tolist(), cfg.eos_ids[0])
    batch = dict(idx=idx.to(device), start=start.to(device), mask=mask.to(device),
                 sampler_logps=cat('logps').to(device))
    # Generate's log-probs are of the distribution it drew from (log q with
    # top-k/top-p), the trainer's own but where cfg.redo_old_logps says
    # (configurator.run_config: why). The sampler's stay in the batch for the
    # off-policy mask and sampler_correction, and the loss logs the gap.
    batch['old_logps'] = batch['sampler_logps']
    if cfg.redo_old_logps:
        batch['old_logps'] = logprobs(model, batch, cfg)
    # with LoRA the reference is the policy, its adapters switched off
    if ref_model is not None:
        with adapters_off(model) if ref_model is model else nullcontext():
            batch['ref_logps'] = logprobs(ref_model, batch, cfg)
    # on-policy distillation: the teacher's log-probs of the sampled tokens, timed apart
    if teacher is not None:
        at = time.perf_counter()
        teacher_logps = logprobs(teacher, batch, cfg)
        info['time']['teacher'] = time.perf_counter() - at
        gap = batch['old_logps'] - teacher_logps
        teacher_kl = torch.where(batch['mask'], gap, 0.0).sum(1)
    if cfg.mask_truncated_completions:
        # DAPO overlong filtering: a cut-off answer is neither right nor wrong.
        batch['mask'] = batch['mask'] & ~truncated.to(device)[:, None]
    shaped = rewards.clone()
    # PPO-style: the KL penalty is part of the reward, before the comparison
    if cfg.kl_in_reward:
        kl = kl_divergence(batch['old_logps'], batch['ref_logps'],
                           cfg.kl_estimator)  # (B, C)
        shaped -= cfg.beta * (kl * batch['mask']).sum(1).double().cpu()
    # Every rank's rows, this one's among them in rank order, in one gather: the
    # advantages compare groups across ranks (so 'batch' std scaling is the same on
    # any layout), and the log counts every row.
    teacher_kls = {'teacher_kl': teacher_kl.cpu()} if teacher is not None else {}
    columns = dict(shaped=shaped, rewards=rewards, lengths=mask.sum(1),
                   truncated=truncated,
                   **{k: cat(k) for k in ('calls', 'errors') if k in groups[0]},
                   **teacher_kls)
    mine = torch.cat([torch.stack([v.double() for v in columns.values()], 1),
                      cat('scores')], 1)
    everyone = (gather(mine.to(cfg.device)).cpu() if cfg.world_size > 1
                else mine)
    info.update(zip(columns, everyone.T.contiguous()),
                scores=everyone[:, len(columns):].contiguous())
    # dynamic sampling: each rank resampled its own flat groups; the log counts all
    if cfg.world_size > 1 and cfg.dynamic_sampling:
        dropped = torch.tensor(float(info['dropped_groups']), device=cfg.device)
        info['dropped_groups'] = round(all_sum(dropped).item())
    # GDPO: each function on its own
    if cfg.multi_objective_aggregation == 'normalize_then_sum':
        advantages = decoupled_advantages(info['scores'], reward_weights, G)
    else:
        advantages = group_advantages(info['shaped'], G, cfg.scale_rewards,
                                      cfg.advantage_estimator)
    B = len(shaped)
    batch['advantages'] = advantages[rank * B:(rank + 1) * B].float().to(device)
    # on-policy distillation: each token's own advantage, the reward's plus the teacher's
    if teacher is not None:
        distilled = reverse_kl_advantages(batch['old_logps'], teacher_logps,
                                          batch['mask'], cfg.teacher_discount)
        batch['advantages'] = (batch['advantages'][:, None]
                               + cfg.teacher_weight * distilled.float())
    info['time']['logprobs'] = time.perf_counter() - since
    return batch


def rollout_metrics(info, cfg, reward_fns, accuracy):
    """
    What the log says of a rollout, over all ranks (make_batch's info): the rewards
    (mean, std, each function's mean and spread within a group), the accuracy (the
    share that `accuracy`, one of reward_fns, scores >= 1), the share of flat
    groups, completion lengths (also of right and of wrong answers, and their
    correlation with the reward: a length bias), the truncated share and the
    sampler's tokens/s.
    """
    G = cfg.num_generations
    rewards, scores, lengths = info['rewards'], info['scores'], info['lengths']
    correct = scores[:, reward_fns.index(accuracy)].nan_to_num() >= 1
    metrics = dict(reward=rewards.nanmean().item(),
                   reward_std=rewards.std().item(),
                   acc=correct.double().mean().item(),
                   flat_groups=is_flat(rewards, G).double().mean().item(),
                   len_mean=lengths.mean().item(),
                   len_max=lengths.max().item(),
                   truncated=info['truncated'].mean().item(),
                   dropped_groups=info['dropped_groups'],
                   rollout_tok_s=lengths.sum().item() / info['time']['generate'])
    metrics.update({f'reward/{f.__name__}': scores[:, j].nanmean().item()
                    for j, f in enumerate(reward_fns)})
    # What a reward is prone to: its spread within a group (GRPO's signal) and a
    # length bias.
    # (functions,) where it applies
    spread = scores.view(-1, G, scores.shape[1]).std(1).nanmean(0)
    # s == s leaves out NaN
    metrics.update({f'reward_spread/{f.__name__}': s
                    for f, s in zip(reward_fns, spread.tolist()) if s == s})
    finite = rewards.isfinite()
    corr = (torch.corrcoef(torch.stack((lengths[finite], rewards[finite])))[0, 1].item()
            if finite.sum() > 1 else float('nan'))
    # absent where either does not vary
    if corr == corr:
        metrics['len_reward_corr'] = corr
    # absent when none
    for key, which in (('len_correct', correct), ('len_wrong', ~correct)):
        if which.any():
            metrics[key] = lengths[which].mean().item()
    # the reverse KL to a teacher per token, the policy's tokens of every rank
    if 'teacher_kl' in info:
        kl = info['teacher_kl'].sum() / info['lengths'].sum()
        metrics['teacher/kl'] = kl.item()
    # a multi-turn run's episodes
    if 'calls' in info:
        metrics.update(multiturn.metrics(info))
    return metrics


def micro_batches(batch, size, plain=False):
    """Yield (index, micro-batch): the step's rows in ceil(B / size) micro-batches,
    each row in exactly one, with the batch's tensors for those rows (index: their
    rows in batch), the (B, C) ones cut to their longest completion that counts. The
    plain way is below: `size` consecutive rows, each its own sequence, idx (b, T)
    right-padded to the longest, start (b,) each prompt's length. Unless plain,
    lib/packing.py lays the rows into fewer, fuller sequences instead (pos then
    gives each token's position in its row): the same log-probs, less work."""
    # (B,) completion tokens up to the last that counts
    need = last_counted(batch['mask'])
    if not plain:
        yield from packing.micro_batches(batch, size, need)
        return
    for index in torch.arange(len(need), device=need.device).split(size):
        L = max(int(need[index].max()), 1)
        mb = {k: v[index, :L] if v.dim() == 2 else v[index]
              for k, v in batch.items() if k != 'idx'}
        # the longest prompt + completion of the micro-batch
        T = int(mb['start'].max()) + L
        # each row's own, as it has its own sequence
        tokens = int((mb['start'] + need[index]).sum())
        yield index, dict(mb, idx=batch['idx'][index, :T], pos=None,
                          tokens=tokens, row_tokens=tokens)


@torch.inference_mode()
def logprobs(model, batch, cfg, entropy=False):
    """Log-probs (B, C) of the batch's completion tokens under model (no grad), at
    the sampling temperature, a micro-batch at a time; with entropy=True also each
    position's entropy (B, C). Only the positions the mask counts mean anything."""
    dtype = torch.float64 if cfg.dtype == 'float64' else torch.float32
    # (1 or 2, B, C)
    out = torch.zeros((1 + entropy, *batch['mask'].shape),
                      device=batch['mask'].device, dtype=dtype)
    for index, mb in micro_batches(batch, cfg.micro_batch_size, cfg.plain):
        with torch.autocast(batch['idx'].device.type, dtype=cfg.ptdtype,
                            enabled=cfg.autocast):
            # (b, L), 0 past the last that counts
            got = model.logprobs(mb['idx'], mb['start'], mb['mask'].shape[1],
                                 temperature=cfg.temperature, entropy=entropy,
                                 lengths=last_counted(mb['mask']),
                                 pos=mb['pos'], plain=cfg.plain,
                                 top_k=cfg.logp_top_k, top_p=cfg.logp_top_p)
        for o, x in zip(out, got if entropy else (got,)):
            o[index, :x.shape[1]] = x.to(o.dtype)
    return tuple(out) if entropy else out[0]


def top_entropy_mask(model, batch, cfg):
    """80/20 (Wang et al. 2025): the tokens whose entropy under the policy as it is
    now is in the top top_entropy_quantile of the whole step (all ranks, all
    micro-batches), so the choice does not depend on the split."""
    with gathered(model):
        entropy = logprobs(model, batch, cfg, entropy=True)[1]  # (rows, C)
    threshold = entropy_threshold(gather(entropy), gather(batch['mask']),
                                  cfg.top_entropy_quantile)
    return entropy >= threshold
