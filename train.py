"""
The GRPO training loop: rollout, reward, advantages, a few optimizer steps, repeat.

$ python train.py config/dr_grpo.py  # one process (CPU or one GPU)
$ torchrun --standalone --nproc_per_node=2 train.py config/dr_grpo.py  # DDP: gloo on CPU, nccl on GPUs (README: nodes)

Per iteration: prompts_per_step prompts (over the ranks) x num_generations completions = the rollout batch, cut into
steps_per_generation optimizer steps over micro-batches of micro_batch_size on each rank (gradient accumulation),
all num_iterations (mu) times. The loss's normalisers sum over ranks and micro-batches: 1 GPU with 8 accumulation
steps and 8 GPUs with 1 give the same parameters.
"""
import math
import os
import sys
import time
from types import SimpleNamespace

import torch

from configurator import check_config, check_device, configure, one_line_errors
from data import load_task
from evaluate import evaluate, report, with_accuracy
from loss import MAX_STATS, grpo_loss
from model import GPT, GPTConfig
from rollout import last_counted, micro_batches, prompt_seed, rollout, rollout_metrics, top_entropy_mask, truncation
import sft
from lib import chat, checkpoint, lora, multiturn, parallelism
from lib.errors import need_package
from lib.measure import fastest_dtype, iteration_line, iteration_metrics, log, matmul_peak, memory_mb, phase
from lib.parallelism import all_sum, full, gather, gathered
from lib.tokenizer import get_tokenizer

# -----------------------------------------------------------------------------
# default config values: the default task, learnt by a tiny model on a laptop CPU
# I/O
out_dir = 'out'
eval_interval = 100  # iterations between held-out evaluations (also at the start and the end); 0 = none
eval_size = 500  # held-out prompts for greedy accuracy and pass@k, sampled prompts_per_step at a time
save_interval = 100  # iterations between checkpoints (also at the end and when stopped by a signal); 0 = those only
progress_interval = 10.0  # seconds between progress lines of a long warm start or evaluation
init_from = 'scratch'  # 'scratch', 'resume' (out_dir's), a Hugging Face directory or a .gguf (Llama/Qwen2/Qwen3)
wandb_log, wandb_project, wandb_run_name = False, 'nanogrpo', 'grpo'  # logging to Weights & Biases too
# data
task = 'addition'  # a built-in task (data.py) or a .jsonl file of {"prompt", "answer"} rows
task_options = {}  # a built-in task's options (see data.py); {} = its defaults (addition: 2 digits)
test_task = ''  # held-out data: '' = the task's own test split
tokenizer = ''  # 'bytes', 'gpt2' (tiktoken's), a tokenizer.json or its directory, a .gguf; '' = init_from's or 'bytes'
chat_template = 'auto'  # init_from's; 'none' (raw prompts), a checkpoint, a .jinja file, Jinja text
system_prompt, chat_template_kwargs = None, {}  # a default system message; template keywords
chat_date = ''  # the day strftime_now writes (YYYY-MM-DD); '' = the run's first, kept on resume
stop_tokens = ()  # strings of one token that end a completion too, e.g. ('\n',) for a base model
reward_funcs, reward_weights = (), ()  # reward function names from reward.py and their weights; () = the task's, 1s
accuracy_func = ''  # what acc and the evals count as right (score >= 1); '' = a verifier (evaluate)
# rewards from models (reward_model.py), named 'rm:DIR' (a reward model) or 'judge:PATH' (an LLM judge) in reward_funcs
reward_model_dtype = 'float32'  # their weights' dtype: 'float32', 'bfloat16' or 'float64'
judge_prompt = ''  # a judge's question, holding {prompt} and {completion} (e.g. reward_model.YES_NO)
judge_tokens = ('Yes', 'No')  # a judge's reward: P(first) / P(both); for numbers ('1', ..., '10') their expected value
reward_clip = 0.0  # > 0: a reward model's scores clipped to [-reward_clip, reward_clip]
# model, when init_from='scratch'
n_layer, n_head, n_embd, block_size = 4, 4, 128, 64
vocab_size = 0  # 0 = the tokenizer's; more pads the output layer (nanoGPT's 50304), e.g. for benchmarks
dropout, bias = 0.0, True  # bias: in the Linears and LayerNorms, as GPT-2
# rollout
prompts_per_step, num_generations = 32, 8  # prompts per iteration over all ranks; G, samples each
max_completion_length = 8
temperature = 1.0  # sampling temperature; the loss's log-probs use it too, so the ratio is about the same policy
top_k, top_p = None, None  # sample from the top_k likeliest tokens only, then from the fewest holding top_p of them
truncate_logprobs = True  # top_k/top_p: train on q, what sampled; False: on the full softmax
mask_truncated_completions = False  # DAPO: truncated completions do not count in the loss
dynamic_sampling, max_resample_rounds = False, 4  # DAPO: resample prompts whose groups all got the same reward
env = ''  # multi-turn: an environment, lib/envs.py's name or 'module:attribute'; '' = one turn, no environment
max_turns = 4  # with env: the policy's turns per episode at most (max_completion_length bounds all the tokens)
tool_workers = 4  # with env: threads running the env.step calls of rows that end a turn at the same step
sandbox = 'bwrap'  # the python tool's: 'bwrap' (bubblewrap; refused at start where it cannot isolate) or 'none'
# loss: grpo_loss's settings, TRL's names and grpo_loss's defaults (test_config), loss.py's papers
loss_type = 'dr_grpo'  # token sum / (sequences x max_completion_length); or 'grpo' (grpo_loss's), 'bnpo', 'dapo'...
beta = 0.0  # the KL penalty's weight, against the frozen reference policy; 0 = no reference model at all
kl_estimator = 'k3'  # Schulman's KL estimator: 'k1', 'k2' or 'k3'
kl_in_reward = False  # PPO's placement of the KL (beta > 0): in the reward, not in the loss (docs/kl.md)
use_bias_correction_kl = False  # DeepSeek-V3.2: the KL weighted by the ratio, unbiased off-policy
surrogate = 'clip'  # the policy term: 'clip' (PPO), 'cispo' (a clipped weight), 'sapo' (a soft gate), 'vespo'
epsilon_low, epsilon_high = 0.2, 0.2  # the clip range [1 - low, 1 + high]; DAPO's clip-higher: 0.28; cispo: a cap
delta = None  # dual clip: with A < 0 the ratio is capped at delta (> 1 + epsilon_high)
importance_sampling_level = 'token'  # or 'sequence': GSPO's ratio of whole sequences
sapo_temperature_pos, sapo_temperature_neg = 1.0, 1.05  # SAPO's gate temperatures, for A > 0 and A < 0
vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg = 2.0, 3.0, 3.0, 2.0  # VESPO's weight's shape
off_policy_mask_threshold = None  # DeepSeek-V3.2: drop a sequence with A < 0 this far off the sampler's policy
sampler_correction = 'none'  # TIS/MIS: weigh tokens by pi_old / pi_sampler, e.g. 'token_truncate' (loss.py lists them)
sampler_correction_clip_min, sampler_correction_clip_max = None, 3.0  # that weight's bounds
entropy_coef = 0.0  # an entropy bonus (verl's entropy_coeff)
# advantages (loss.group_advantages)
scale_rewards = 'none'  # advantages r - mean(group), no std: 'group' or 'batch' divides by one
advantage_estimator = 'grpo'  # the baseline: 'grpo' (group mean), 'rloo' (leave-one-out), 'reinforce_pp'
multi_objective_aggregation = 'sum_then_normalize'  # or 'normalize_then_sum' (GDPO) for several reward functions
top_entropy_quantile = 1.0  # 80/20: the policy term on this share of the step's tokens, highest entropy first
# the warm start (sft.py): supervised steps on the task's answers, so that RL starts from some right ones
sft_iters = None  # None = up to 1000 from scratch, 0 from a pretrained checkpoint (which needs none)
sft_target_acc = 0.3  # > 0: stop once greedy accuracy on 256 train prompts reaches it (a fixed count is not robust)
sft_batch_size, sft_learning_rate, sft_check_interval = 64, 1e-3, 50  # a check every 50 steps
# LoRA (lib/lora.py)
lora_rank, lora_alpha, lora_dropout = 0, 32.0, 0.0  # 0 = full fine-tuning; scaled by alpha / rank
lora_targets = ()  # PEFT's target_modules in the family's names, e.g. ('q_proj', 'v_proj'); () = 'all-linear'
lora_save_merged = False  # each checkpoint also holds merged/: the base with the adapters merged in (for serving)
# optimization
num_iterations, steps_per_generation = 1, 1  # mu: passes over each rollout; optimizer steps a pass
max_iters, micro_batch_size = 1200, 64  # rollouts; completions per forward/backward on each rank
learning_rate = 1e-4  # RL wants small steps (docs/performance.md: larger ones learnt slower on the default task)
weight_decay, beta1, beta2, grad_clip = 0.0, 0.9, 0.99, 1.0  # AdamW's; grad norm clip, 0 = off
warmup_iters, lr_schedule, min_lr_ratio = 0, 'constant', 0.1  # linear warmup steps; 'cosine' down to the ratio
ref_sync_every = 0  # copy the policy into the reference model every N iterations; 0 = never
ref_model_mixup_alpha = 1.0  # at a sync, ref = alpha * policy + (1 - alpha) * ref (TR-DPO); 1 = a copy
max_bad_steps = 3  # stop after this many non-finite steps in a row
# system
parallel = 'ddp'  # under torchrun: 'ddp' (replicas) or 'fsdp' (FSDP2: weights, gradients, AdamW state in shards)
device = 'auto'  # 'auto', 'cpu', 'cuda', 'cuda:1', 'mps'
dtype = 'float32'  # 'float64' (tests), 'bfloat16'/'float16' (autocast), 'auto' (bf16 where 2x faster: lib/measure.py)
compile, cuda_graphs = False, False  # torch.compile; replay generate's decode steps as CUDA graphs
plain = False  # every speed trick off, its plain reference instead: padded micro-batches, log_softmax(logits).gather
gradient_checkpointing = False  # recompute each block and the output layer's logits in backward: less memory
seed, peak_flops = 1337, 0.0  # peak_flops: the peak FLOP/s for MFU; 0 = measure a matmul at start

sys.excepthook = one_line_errors  # bad input is one line, a bug keeps its traceback
config = configure(globals(), sys.argv[1:])
changed = {k: v for k, v in config.items() if v != globals()[k]}  # printed at the start; all in out_dir/config.json
globals().update(config)
check_device(device)
# -----------------------------------------------------------------------------

distributed, rank, world_size, device = parallelism.init(device)  # under torchrun: DDP or FSDP
checkpoint.catch_stop_signals()  # SIGTERM or Ctrl-C: a checkpoint at the next iteration boundary
device_type, master = 'cuda' if 'cuda' in device else 'cpu', rank == 0
sft_iters = config['sft_iters'] = sft.default_iters(init_from) if sft_iters is None else sft_iters
check_config(config, world_size, distributed)  # and the loss's settings, and the sampler's
state = checkpoint.load_state(out_dir, parallel, world_size) if init_from == 'resume' else None
tokenizer = config['tokenizer'] = tokenizer or checkpoint.default_tokenizer(init_from, state)
template = chat.run_template(config, state)  # 'auto' resolved, the date fixed: saved in config.json
if dtype == 'auto':  # rank 0 measures, so that every rank computes in the same dtype
    dtype = config['dtype'] = parallelism.from_rank0(fastest_dtype(device) if master else None)
autocast = dtype in ('bfloat16', 'float16')
cfg = SimpleNamespace(**dict(config, device=device, template=template), world_size=world_size, autocast=autocast,
                      ptdtype=getattr(torch, dtype), on_policy=num_iterations == 1 and steps_per_generation == 1)
param_dtype = torch.float64 if dtype == 'float64' else torch.float32

# data and rewards: everything that can be wrong with them fails here, before any work
enc = get_tokenizer(tokenizer)
cfg.eos_ids = chat.stop_ids(enc, cfg.template, tokenizer, stop_tokens)  # the turn's end first; tokens checked
tokenizer_dir = checkpoint.tokenizer_files(tokenizer, out_dir, write=master)
cfg.environment = multiturn.environment(env, sandbox, cfg) if env else None
wandb = need_package('wandb', 'wandb_log=True') if wandb_log else None  # optional: only when asked for
train_rows, test_rows, *rewards = load_task(cfg, enc)  # then the reward functions and their weights
reward_fns, reward_weights, accuracy, accuracy_note = with_accuracy(cfg, train_rows, *rewards)

# model
torch.manual_seed(seed)  # the scratch init: the same weights on every rank and in every run
fsdp = distributed and parallel == 'fsdp'
if init_from == 'scratch':
    model = GPT(GPTConfig(block_size=block_size, vocab_size=max(vocab_size, enc.n_vocab), n_layer=n_layer,
                          n_head=n_head, n_embd=n_embd, dropout=dropout, bias=bias))
else:  # under FSDP only rank 0 reads the weights; the others build the shape alone, then get their shards from it
    model = GPT.from_pretrained(state['dir'] if init_from == 'resume' else init_from, dtype=param_dtype,
                                device='meta' if fsdp and not master else None)
model.check_fits(enc, tokenizer, block_size)
model.to(device=None if fsdp else device, dtype=param_dtype)
model.gradient_checkpointing = gradient_checkpointing
if lora_rank:  # the adapters' random A is drawn from the seeded generator: the same on every rank
    lora.add_lora(model, lora_rank, lora_alpha, lora_dropout, lora_targets or 'all-linear')
    if init_from == 'resume' and (master or not fsdp):
        lora.load_adapter(model, os.path.join(state['dir'], 'adapter'))
bf16 = device_type == 'cuda' and dtype == 'bfloat16'  # FSDP's mixed precision: bf16 compute copies
model, raw_model = parallelism.wrap(model, device=device, fsdp=fsdp, bf16=bf16, compile=compile,
                                    cuda_graphs=cuda_graphs)


def make_optimizer(lr):
    return raw_model.configure_optimizer(lr=lr, weight_decay=weight_decay, betas=(beta1, beta2),
                                         fused=device_type == 'cuda')


def get_lr(step):
    if step < warmup_iters:
        return learning_rate * (step + 1) / (warmup_iters + 1)
    if lr_schedule == 'constant':
        return learning_rate
    total = max_iters * num_iterations * steps_per_generation  # optimizer steps in the run
    ratio = min(1.0, (step - warmup_iters) / max(1, total - warmup_iters))
    return learning_rate * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * ratio)))


def forward_backward(mb, num_sequences, num_tokens):
    """One micro-batch (rollout.micro_batches): its log-probs and entropies, grpo_loss, backward.
    Returns the loss's stats and what it ran: tokens in its sequences, those not padding, model FLOPs."""
    with torch.autocast(device_type, dtype=cfg.ptdtype, enabled=autocast):
        need = last_counted(mb['mask'])  # (b,) the output layer runs up to the last token the loss counts only
        logps, entropy = model(mb['idx'], start=mb['start'], length=mb['mask'].shape[1], temperature=temperature,
                               entropy=True, lengths=need, pos=mb['pos'], plain=plain, **truncation(cfg))
    old, advantages, sampler = (mb[k].to(logps.dtype) for k in ('old_logps', 'advantages', 'sampler_logps'))
    loss, stats = grpo_loss(logps, None if cfg.on_policy else old, mb.get('ref_logps'), advantages,
        mb['mask'], num_sequences=num_sequences, num_tokens=num_tokens, sampler_logps=sampler,
        entropy=entropy, entropy_mask=mb.get('entropy_mask'), surrogate=surrogate, delta=delta,
        importance_sampling_level=importance_sampling_level, epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos, vespo_k_neg=vespo_k_neg,
        vespo_lambda_pos=vespo_lambda_pos, vespo_lambda_neg=vespo_lambda_neg,
        off_policy_mask_threshold=off_policy_mask_threshold, sampler_correction=sampler_correction,
        sampler_correction_clip_min=sampler_correction_clip_min, entropy_coef=entropy_coef,
        sampler_correction_clip_max=sampler_correction_clip_max, kl_estimator=kl_estimator,
        beta=0.0 if kl_in_reward else beta, use_bias_correction_kl=use_bias_correction_kl,
        loss_type=loss_type, max_completion_length=max_completion_length)
    (loss * world_size).backward()  # DDP and FSDP average over ranks; the loss contract wants the sum
    (b, T), n = mb['idx'].shape, int(need.sum())
    return stats, dict(tokens=b * T, placed=mb['tokens'], flops=raw_model.update_flops(b, T, n / b))


def policy_update(batch, times, step):
    """num_iterations passes of steps_per_generation optimizer steps over this rank's rollout batch, each over
    micro-batches (gradient accumulation), the first the run's step `step`. Returns the stats to log, over every rank,
    and the run's optimizer steps so far; adds each phase's seconds to times ('comm' has parts in the rollout too)."""
    rows = len(batch['idx']) // steps_per_generation  # this rank's completions per optimizer step
    # what ran: tokens in the sequences, those not padding, the rows' own (a prompt shared by rows counts for each)
    sums, bad, ran = {}, 0, dict(tokens=0.0, placed=0.0, own=0.0, flops=0.0)
    for _ in range(num_iterations):
        for s in range(steps_per_generation):
            part = {k: v[s * rows:(s + 1) * rows] for k, v in batch.items()}
            with phase(times, 'comm', device):
                num_tokens = all_sum(part['mask'].sum().float())  # the step's normaliser, the same on every rank
                if top_entropy_quantile < 1:
                    part['entropy_mask'] = top_entropy_mask(raw_model, part, cfg)
            ran['own'] += (part['start'] + last_counted(part['mask'])).sum().item()  # each row's prompt, completion
            with phase(times, 'backward', device):  # forward + backward; DDP's all-reduce overlaps the last one
                for m, (_, mb) in enumerate(micro_batches(part, micro_batch_size, plain)):
                    parallelism.set_grad_sync(model, m == rows // micro_batch_size - 1)  # reduce on the last only
                    stats, counts = forward_backward(mb, rows * world_size, num_tokens)
                    ran.update({k: ran[k] + v for k, v in counts.items()})
                    for k, v in stats.items():  # shares of the step's means add up; maxima do not
                        v = v.detach().double()
                        sums[k] = v if k not in sums else sums[k].maximum(v) if k in MAX_STATS else sums[k] + v
            with phase(times, 'optimizer', device):
                norm = full(torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip or math.inf))  # DTensor
                # under FSDP; the ranks share one gradient, but a NaN on one must stop them all
                finite = all_sum(torch.tensor(float(not torch.isfinite(norm)))).item() == 0
                if finite:
                    for group in optimizer.param_groups:
                        group['lr'] = get_lr(step)
                    optimizer.step()
                    step += 1
                bad += not finite
                optimizer.zero_grad(set_to_none=True)
    # each optimizer step's token means (their shares summed over micro-batches and ranks), averaged over the
    # steps, and the maxima over every step and rank: numbers of the steps, the same whatever their layout
    values = torch.stack(list(sums.values()))
    means, maxima = all_sum(values) / (num_iterations * steps_per_generation), gather(values[None]).amax(0)
    stats = {k: (maxima if k in MAX_STATS else means)[i].item() for i, k in enumerate(sums)}
    ran = dict(zip(ran, all_sum(torch.tensor(list(ran.values()), dtype=torch.float64)).tolist()))  # over ranks
    # the padding's share of what ran, and the share of the rows' tokens a shared prompt saved
    return dict(stats, grad_norm=norm.item(), lr=get_lr(max(step - 1, 0)), flops=ran['flops'],
                train_tokens=ran['tokens'], pad_share=1 - ran['placed'] / ran['tokens'],
                saved_share=1 - ran['placed'] / ran['own'], bad_steps=bad), step


def save(it):
    """Checkpoint the state before iteration it, never right after a skipped step; returns it."""
    parallelism.check_replicas(raw_model, it)
    checkpoint.save(out_dir, it, model=raw_model, optimizer=optimizer, ref_model=ref_model,
                    trainer_state=dict(step=step, bad_in_row=bad_in_row, config=config, world_size=world_size),
                    tokenizer_dir=tokenizer_dir, save_merged=lora_save_merged, last=saved_it)
    return it


def stop_if_signalled(it):
    """At an iteration boundary (the state before iteration `it`): if any rank got a signal, all save that state,
    print how to resume and exit with 128 + its number. A rollout in progress is dropped (resume samples it again,
    identically); an update in progress is finished first."""
    sig = checkpoint.stop_requested()
    if sig:
        if bad_in_row == 0 and it != saved_it:
            save(it)
        if master:
            print(checkpoint.stopped_message(sig, it, out_dir, world_size), flush=True)
        if master and wandb:
            wandb.finish()
        parallelism.end(128 + sig)


# -----------------------------------------------------------------------------
os.makedirs(out_dir, exist_ok=True)
if wandb and master:  # its files go with the run's: out_dir/wandb (WANDB_MODE=offline keeps them local)
    wandb.init(project=wandb_project, name=wandb_run_name, config=config, dir=out_dir)
optimizer = make_optimizer(learning_rate)
iter_start, step, bad_in_row, saved_it = 0, 0, 0, None
if init_from == 'resume':
    iter_start = saved_it = state['iter']
    step, bad_in_row = state['step'], state['bad_in_row']
    checkpoint.load_optimizer(state['dir'], optimizer, rank if fsdp else None)
elif sft_iters > 0:
    sft.warm_start(model, raw_model, optimizer=make_optimizer(sft_learning_rate), rows=train_rows,
                   cfg=cfg, enc=enc, accuracy=accuracy, rank=rank)
# the reference: the policy RL starts from, frozen (refreshed every ref_sync_every iterations)
if beta == 0:
    ref_model = None  # no KL term: no reference
elif lora_rank:
    ref_model = raw_model  # the policy itself, whose log-probs rollout.py computes with the adapters off
else:  # a resumed run's reference is the one it saved (TR-DPO's moves)
    ref_model = parallelism.frozen_copy(raw_model, device=device, dtype=param_dtype, bf16=bf16,
                                        saved=os.path.join(state['dir'], 'ref') if state else None)
peak = peak_flops or matmul_peak(device, cfg.ptdtype)[0]  # in the dtype the update computes in
if master:
    print(f"{raw_model.get_num_params() / 1e6:.2f}M parameters, {world_size} rank(s) on {device}, "
          f"{prompts_per_step}x{num_generations} completions per iteration; config: "
          f"{' '.join(f'{k}={v!r}' for k, v in changed.items()) or 'the defaults'}", flush=True)
    print(f"accuracy: {accuracy_note}", flush=True)  # what acc and the evaluations count as right

t_loop = time.time()
for it in range(iter_start, max_iters + 1):
    if it < max_iters:
        stop_if_signalled(it)
    evaluating = eval_interval and (it % eval_interval == 0 or it == max_iters)
    if evaluating:  # held-out greedy accuracy and pass@k
        metrics, samples = evaluate(raw_model, test_rows, it=it, rank=rank, cfg=cfg, enc=enc,
            accuracy=accuracy, every=progress_interval if master else math.inf)
        if master:
            log(dict(metrics, iter=it), report(metrics, samples, it), out_dir=out_dir, wandb=wandb)
    if it > iter_start and (save_interval and it % save_interval == 0 or it == max_iters) and bad_in_row == 0:
        saved_it = save(it)
    if it == max_iters:
        break
    if evaluating:
        stop_if_signalled(it)  # an evaluation can take a while
    if ref_model is not None and ref_sync_every and it > 0 and it % ref_sync_every == 0:  # TR-DPO
        parallelism.blend(ref_model, raw_model, ref_model_mixup_alpha)  # the reference moves towards the policy
    torch.manual_seed(prompt_seed(seed, it, rank))  # dropout's randomness follows the iteration: resume is exact
    t0 = time.perf_counter()
    with gathered(raw_model, ref_model):  # FSDP: gathered once for all of generate's steps and the log-prob passes
        # sample G completions per prompt, score them, and their group advantages
        batch, info = rollout(raw_model, ref_model, train_rows=train_rows, it=it, rank=rank, cfg=cfg, enc=enc,
                              reward_fns=reward_fns, reward_weights=reward_weights)
    mem_rollout, t1 = memory_mb(device), time.perf_counter()
    stop_if_signalled(it)  # the rollout is the long part; resume redoes it exactly
    stats, step = policy_update(batch, times=info['time'], step=step)  # their seconds added to the rollout's
    bad_in_row = bad_in_row + stats['bad_steps'] if stats['bad_steps'] else 0
    if bad_in_row >= max_bad_steps:
        raise SystemExit(f"error: {bad_in_row} optimizer steps in a row had a non-finite loss or gradient "
                         f"(iteration {it}); the last good checkpoint in {out_dir} is intact. Lower learning_rate "
                         f"or check the rewards, then resume with init_from='resume'")
    m = iteration_metrics(it, rollout_metrics(info, num_generations, reward_fns, accuracy, device),
                          stats, times=info['time'], clock=(t0, t1, time.perf_counter()), peak=peak,
                          world_size=world_size, mem_mb=max(mem_rollout, memory_mb(device)),
                          **parallelism.resident_mb(raw_model, optimizer, ref_model))
    eta = (time.time() - t_loop) / (it + 1 - iter_start) * (max_iters - it - 1)  # evaluations and saves included
    if master:
        log(m, iteration_line(m, max_iters=max_iters, eta=eta, reward_fns=reward_fns), out_dir=out_dir, wandb=wandb)

if master and wandb:
    wandb.finish()
parallelism.end()
