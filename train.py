"""
The GRPO training loop: rollout, reward, advantages, a few optimizer steps, repeat.

$ python train.py config/dr_grpo.py  # one process (CPU or one GPU)
$ torchrun --standalone --nproc_per_node=2 train.py config/dr_grpo.py  # DDP

Per iteration: prompts_per_step prompts (over the ranks) x num_generations completions
= the rollout batch, cut into steps_per_generation optimizer steps over micro-batches of
micro_batch_size on each rank, all num_iterations (mu) times. The loss's normalisers and
the logged stats sum over ranks and micro-batches: 8 accumulation steps on 1 GPU and 8
GPUs log and learn the same.
"""
import functools
import math
import os
import sys
import time
from contextlib import nullcontext

import torch
from torch.nn.utils import clip_grad_norm_

from configurator import (check_config, check_device, check_fits, check_rewards,
                          check_teacher, check_tokenizer, configure, one_line_errors,
                          run_config)
from data import load_task
from evaluate import evaluate, report, with_accuracy
from loss import MAX_STATS, grpo_loss, stale_objective
from model import GPT, GPTConfig
from rollout import (epoch_order, last_counted, make_batch, micro_batches, prompt_seed,
                     rollout, rollout_metrics, top_entropy_mask)
import sft
from lib import chat, checkpoint, lora, parallelism, stream
from lib.curriculum import Pool
from lib.errors import need_package
from lib.measure import (fastest_dtype, iteration_line, log, matmul_peak, memory_mb,
                         row_flops, update_metrics)
from lib.parallelism import all_sum, gathered
from lib.tokenizer import get_tokenizer

# -----------------------------------------------------------------------------
# default config values: the default task, learnt by a tiny model on a laptop CPU
# I/O
out_dir = 'out'
eval_interval = 100  # iterations between held-out evals (and first, last); 0: none
eval_size = 500  # held-out prompts for greedy accuracy and pass@k
save_interval = 100  # iterations between checkpoints (and last, on a signal); 0: those
progress_interval = 10.0  # seconds between progress lines of a warm start or eval
init_from = 'scratch'  # 'resume' (out_dir's), a Hugging Face dir or a .gguf file
overwrite = False  # True: replace out_dir's run (else refused), keeping its warm start
wandb_log, wandb_project, wandb_run_name = False, 'nanogrpo', 'grpo'  # Weights & Biases
# data
task = 'addition'  # a built-in task (data.py) or a .jsonl of {"prompt", "answer"} rows
task_options = {}  # a built-in task's options (data.py); {} = its defaults (2 digits)
test_task = ''  # held-out data: '' = the task's own test split
# 'bytes', 'gpt2' (tiktoken's), a tokenizer.json (or its dir), a .gguf; '': init_from's
tokenizer = ''
# 'auto': init_from's; 'none' (raw prompts), a checkpoint, a .jinja file, Jinja text
chat_template = 'auto'
system_prompt, chat_template_kwargs = None, {}  # a default system message; keywords
chat_date = ''  # the day strftime_now writes (YYYY-MM-DD); '': the run's first day
stop_tokens = ()  # one-token strings that end a completion too: ('\n',) for a base model
reward_funcs, reward_weights = (), ()  # reward.py's functions, weights; (): the task's
accuracy_func = ''  # what acc and the evals count as right (score >= 1); '': a verifier
# rewards from models (reward_model.py): 'rm:DIR' (reward model), 'judge:PATH' (LLM judge)
reward_model_dtype = 'float32'  # their weights' dtype: 'float32', 'bfloat16' or 'float64'
judge_prompt = ''  # a judge's question with {prompt}, {completion} (reward_model.YES_NO)
judge_tokens = ('Yes', 'No')  # a judge's reward: P(first) / P(both); numbers: their mean
reward_clip = 0.0  # > 0: a reward model's scores clipped to [-reward_clip, reward_clip]
# on-policy distillation (docs/distillation.md): a frozen teacher scores every token
teacher = ''  # a Hugging Face dir or a .gguf of the student's tokenizer; '' = off
teacher_dtype = 'float32'  # its weights' dtype: 'float32', 'bfloat16' or 'float64'
teacher_weight = 1.0  # A_t = the reward's + this x (log pi_teacher - log pi)(y_t)
teacher_discount = 0.0  # 1: A_t sums the later tokens' too (the sequences' KL)
# model, when init_from='scratch'
n_layer, n_head, n_embd, block_size = 4, 4, 128, 64
vocab_size = 0  # 0 = the tokenizer's; more pads the output layer (nanoGPT's 50304)
dropout, bias = 0.0, True  # bias: in the Linears and LayerNorms, as GPT-2
# rollout
prompts_per_step, num_generations = 32, 8  # prompts an iteration (all ranks); G each
max_completion_length = 8
temperature = 1.0  # the sampler's, and the loss's log-probs': the ratio is of one policy
top_k, top_p = None, None  # sample among the top_k likeliest, the fewest holding top_p
max_rows = 0  # rows decoded at once at most, a group seated as one leaves; 0 = all
max_staleness = 0  # K > 0: train on groups sampled K versions ago (lib/stream.py)
sampler_ranks = 0  # N > 0 (torchrun, K > 0): the last N ranks only sample, the others train
stale_correction = 'decoupled'  # their objective: 'decoupled' (AReaL), 'tis', 'none'
truncate_logprobs = True  # top_k/top_p: train on q, what sampled; False: the full softmax
mask_truncated_completions = False  # DAPO: truncated completions do not count in the loss
dynamic_sampling, max_resample_rounds = False, 4  # DAPO: resample groups of one reward
# a curriculum (docs/curriculum.md): prompts leave the draw by their running pass rate
curriculum = ''  # 'pass_rate': those nearly always right or wrong retire; '' = off
curriculum_easy = 0.9  # a prompt's pass rate at or above this is too easy
curriculum_hard = 0.1  # at or below this, too hard
curriculum_patience = 2  # visits in a row too easy (too hard) before a prompt retires
curriculum_rest = 2  # the draw passes a retired prompt this often, then it visits once
env = ''  # multi-turn: lib/envs.py's name or 'module:attribute'; '' = one turn
max_turns, tool_workers = 4, 4  # with env: turns an episode at most; threads for env.step
sandbox = 'bwrap'  # the python tool's: 'bwrap' (refused where it cannot isolate), 'none'
# loss: grpo_loss's settings and defaults, TRL's names (test_config); loss.py's papers
loss_type = 'dr_grpo'  # sum / (sequences x max_completion_length); 'grpo', 'dapo'...
beta = 0.0  # the KL penalty's weight, to the frozen reference; 0 = no reference model
kl_estimator = 'k3'  # Schulman's KL estimator: 'k1', 'k2' or 'k3'
kl_in_reward = False  # PPO's place for the KL: the reward, not the loss (docs/kl.md)
use_bias_correction_kl = False  # DeepSeek-V3.2: the KL weighted by the ratio, unbiased
surrogate = 'clip'  # the policy term: 'clip' (PPO), 'cispo', 'sapo' (soft gate), 'vespo'
epsilon_low, epsilon_high = 0.2, 0.2  # the clip range [1 - low, 1 + high]; DAPO: 0.28
delta = None  # dual clip: with A < 0 the ratio is capped at delta (> 1 + epsilon_high)
importance_sampling_level = 'token'  # or 'sequence': GSPO's ratio of whole sequences
sapo_temperature_pos, sapo_temperature_neg = 1.0, 1.05  # SAPO's gates, A > 0 and < 0
# VESPO's shape
vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg = 2.0, 3.0, 3.0, 2.0
off_policy_mask_threshold = None  # DeepSeek-V3.2: drop a sequence, A < 0, this far off
sampler_correction = 'none'  # TIS/MIS: weigh by pi_old / pi_sampler: 'token_truncate'...
sampler_correction_clip_min, sampler_correction_clip_max = None, 3.0  # its bounds
entropy_coef = 0.0  # an entropy bonus (verl's entropy_coeff)
# advantages (loss.group_advantages)
scale_rewards = 'none'  # r - mean(group), no std: 'group' or 'batch' divides by one
advantage_estimator = 'grpo'  # the baseline: 'grpo' (group mean), 'rloo', 'reinforce_pp'
multi_objective_aggregation = 'sum_then_normalize'  # or 'normalize_then_sum' (GDPO)
top_entropy_quantile = 1.0  # 80/20: the policy term on this share of tokens, by entropy
# the warm start (sft.py): supervised steps on answers, so RL starts from some right ones
sft_iters = None  # None: up to 1000 from scratch, 0 from a pretrained checkpoint
sft_target_acc = 0.3  # > 0: stop at this greedy accuracy on 256 train prompts
sft_batch_size, sft_learning_rate, sft_check_interval = 64, 1e-3, 50  # a check every 50
# LoRA (lib/lora.py)
lora_rank, lora_alpha, lora_dropout = 0, 32.0, 0.0  # 0: full fine-tuning; alpha / rank
lora_targets = ()  # PEFT's target_modules, e.g. ('q_proj', 'v_proj'); () = 'all-linear'
lora_save_merged = False  # each checkpoint also holds merged/: the adapters merged in
# optimization
num_iterations, steps_per_generation = 1, 1  # mu: passes over a rollout; steps a pass
max_iters, micro_batch_size = 1200, 64  # rollouts; completions a forward/backward a rank
learning_rate = 1e-4  # RL wants small steps (docs/performance.md: larger learnt slower)
weight_decay, beta1, beta2, grad_clip = 0.0, 0.9, 0.99, 1.0  # AdamW's; grad clip, 0 = off
warmup_iters, lr_schedule, min_lr_ratio = 0, 'constant', 0.1  # or 'cosine' to the ratio
ref_sync_every, ref_model_mixup_alpha = 0, 1.0  # TR-DPO: sync every N iters (0: never)
max_bad_steps = 3  # stop after this many non-finite steps in a row
# system
parallel = 'ddp'  # torchrun: 'ddp' (replicas) or 'fsdp' (FSDP2: all state sharded)
device = 'auto'  # 'auto', 'cpu', 'cuda', 'cuda:1', 'mps'
dtype = 'float32'  # 'float64' (tests), 'bfloat16'/'float16' (autocast), 'auto'
compile, cuda_graphs = False, False  # torch.compile; generate's decode as CUDA graphs
plain = False  # each speed trick off for its plain reference: padding, log_softmax.gather
gradient_checkpointing = False  # recompute each block and the logits in backward
seed, peak_flops = 1337, 0.0  # peak_flops: the FLOP/s MFU is of; 0 = a matmul measured

# bad input is one line, a bug keeps its traceback
sys.excepthook = one_line_errors
# the defaults above, then a config file's and the flags' (known keys, their types)
config = configure(globals(), sys.argv[1:])
# printed at the start
changed = {k: v for k, v in config.items() if v != globals()[k]}
globals().update(config)
check_device(device)
# -----------------------------------------------------------------------------

# under torchrun: DDP or FSDP
distributed, rank, world_size, device = parallelism.init(device)
# SIGTERM or Ctrl-C: within seconds, a checkpoint of the state before the iteration
parallelism.catch_stop_signals()
# a rank whose peer is gone stops with one line naming the last checkpoint
sys.excepthook = functools.partial(one_line_errors, out_dir=out_dir)
device_type, master = 'cuda' if 'cuda' in device else 'cpu', rank == 0

# What a setting leaves open is settled here, once, in the globals (config.json keeps it)
sft_iters = sft.default_iters(init_from) if sft_iters is None else sft_iters
# and the loss's settings, and the sampler's
check_config({k: globals()[k] for k in config}, world_size, distributed)
# sampler_ranks: the last ranks only sample; world_size counts the others (lib/stream.py)
to_samplers = None
if sampler_ranks:
    world_size, to_samplers = parallelism.split(sampler_ranks)
state = None
if init_from == 'resume':
    state = checkpoint.load_state(out_dir, parallel, world_size)
tokenizer = tokenizer or checkpoint.default_tokenizer(init_from, state)
template, chat_template, chat_date = chat.run_template(
    chat_template, chat_date, init_from=init_from, tokenizer=tokenizer,
    saved=state and state['config'])
# rank 0 measures, so that every rank computes in the same dtype
if dtype == 'auto':
    dtype = parallelism.from_rank0(fastest_dtype(device) if master else None)
param_dtype = torch.float64 if dtype == 'float64' else torch.float32
enc = get_tokenizer(tokenizer)
# a pretrained model's own tokenizer, whatever the chat template: the ids it learnt
check_tokenizer(enc, tokenizer, init_from, state)
# the settings, settled (config.json), and one namespace of them and what they derive
config = {k: globals()[k] for k in config}
cfg = run_config(config, enc=enc, template=template, world_size=world_size)
tokenizer_dir = checkpoint.tokenizer_files(tokenizer, out_dir, write=master)
wandb = need_package('wandb', 'wandb_log=True') if wandb_log else None

# Data and rewards: everything that can be wrong with them fails here, before any work:
# the rows, then the reward functions and their weights, each called on stand-ins
train_rows, test_rows, *rewards = load_task(cfg, enc)
reward_fns, reward_weights, accuracy, accuracy_note = with_accuracy(cfg, train_rows,
                                                                    *rewards)
check_rewards(train_rows, cfg, enc, reward_fns, reward_weights)

# model: from scratch the same weights on every rank and in every run
torch.manual_seed(seed)
fsdp = distributed and parallel == 'fsdp'
if init_from == 'scratch':
    model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                          block_size=block_size, vocab_size=max(vocab_size, enc.n_vocab),
                          dropout=dropout, bias=bias))
else:
    # under FSDP only rank 0 reads the weights; the others get their shards from it
    model = GPT.from_pretrained(state['dir'] if init_from == 'resume' else init_from,
                                dtype=param_dtype,
                                device='meta' if fsdp and not master else None)
check_fits(model.config, enc, tokenizer, block_size)
model.to(device=None if fsdp else device, dtype=param_dtype)
model.gradient_checkpointing = gradient_checkpointing
# the adapters' random A is drawn from the seeded generator: the same on every rank
if lora_rank:
    lora.add_lora(model, lora_rank, lora_alpha, lora_dropout,
                  lora_targets or 'all-linear')
    if init_from == 'resume' and (master or not fsdp):
        lora.load_adapter(model, os.path.join(state['dir'], 'adapter'))
# FSDP's mixed precision: bf16 compute copies
bf16 = device_type == 'cuda' and dtype == 'bfloat16'
model, raw_model = parallelism.wrap(model, device=device, fsdp=fsdp, bf16=bf16,
                                    compile=compile, cuda_graphs=cuda_graphs)
# K > 0: sampling runs K iterations ahead of training, rollouts in flight (lib/stream.py);
# a sampler rank samples for the trainers until they stop it, then exits
ahead = stream.start(
    functools.partial(rollout, raw_model, train_rows=train_rows, cfg=cfg, enc=enc,
                      reward_fns=reward_fns, reward_weights=reward_weights),
    model=raw_model, rank=rank, cfg=cfg, seed_of=functools.partial(prompt_seed, seed),
    saved=lambda r: state and checkpoint.load_stream(state['dir'], r, world_size),
    group=to_samplers) if max_staleness else None
# on-policy distillation's teacher: frozen, in its own dtype; under FSDP sharded
# as the policy is (rank 0 reads it), else a whole copy on each rank
teacher_model = None
if teacher:
    teacher_model = GPT.from_pretrained(teacher, dtype=getattr(torch, teacher_dtype),
                                        device='meta' if fsdp and not master else None)
    check_teacher(teacher_model.config, enc, cfg)
    teacher_model = parallelism.frozen(teacher_model, device=device, fsdp=fsdp)


def make_optimizer(lr):
    return raw_model.configure_optimizer(lr=lr, weight_decay=weight_decay,
                                         betas=(beta1, beta2),
                                         fused=device_type == 'cuda')


def get_lr(step):
    if step < warmup_iters:
        return learning_rate * (step + 1) / (warmup_iters + 1)
    if lr_schedule == 'constant':
        return learning_rate
    # cosine, over the optimizer steps of the whole run
    total = max_iters * num_iterations * steps_per_generation
    ratio = min(1.0, (step - warmup_iters) / max(1, total - warmup_iters))
    cosine = (1 + math.cos(math.pi * ratio)) / 2
    return learning_rate * (min_lr_ratio + (1 - min_lr_ratio) * cosine)


# grpo_loss with this run's settings by name (loss.py: what each does, whose paper)
loss_fn = functools.partial(
    grpo_loss, loss_type=loss_type, max_completion_length=max_completion_length,
    beta=0.0 if kl_in_reward else beta, kl_estimator=kl_estimator,
    use_bias_correction_kl=use_bias_correction_kl, surrogate=surrogate,
    epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
    importance_sampling_level=importance_sampling_level,
    sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
    vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
    vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg,
    off_policy_mask_threshold=off_policy_mask_threshold,
    sampler_correction=sampler_correction,
    sampler_correction_clip_min=sampler_correction_clip_min,
    sampler_correction_clip_max=sampler_correction_clip_max, entropy_coef=entropy_coef)
# K > 0: the stale groups' objective (loss.py's decoupled_loss or truncated_is_loss)
if max_staleness:
    loss_fn = stale_objective(loss_fn, stale_correction)


def save(it):
    """Checkpoint the state before iteration it, never right after a skipped step; returns
    it."""
    parallelism.check_replicas(raw_model, it)
    trainer_state = dict(step=step, bad_in_row=bad_in_row, config=config,
                         world_size=world_size)
    # a second stop signal waits for the checkpoint to be whole
    with parallelism.writing():
        checkpoint.save(out_dir, it, model=raw_model, optimizer=optimizer,
                        ref_model=ref_model, trainer_state=trainer_state,
                        tokenizer_dir=tokenizer_dir, save_merged=lora_save_merged,
                        last=saved_it, stream=ahead and ahead.tensors(it),
                        curriculum=pool and pool.tensors())
    return it


def stop_if_signalled(it):
    """If any rank got a stop signal (a vote: every rank calls this at the same
    point), all save the state before iteration `it` (None: in the warm start, nothing
    to save), print how to resume and exit with 128 + its number (resume redoes a
    dropped rollout or evaluation exactly)."""
    # the signal: a vote over the ranks, or the one this process got
    sig = parallelism.stop_requested() if distributed else parallelism.asked['signal']
    if sig:
        if it is not None and bad_in_row == 0 and it != saved_it:
            save(it)
        if master:
            print(checkpoint.stopped_message(sig, it, out_dir, world_size + sampler_ranks),
                  flush=True)
        if master and wandb:
            wandb.finish()
        if ahead:
            ahead.close(128 + sig)
        parallelism.end(128 + sig)


# -----------------------------------------------------------------------------
# every check has passed: only now does overwrite=True delete the run out_dir held
if overwrite and init_from != 'resume' and master:
    checkpoint.remove_run(out_dir)
os.makedirs(out_dir, exist_ok=True)
# its files go in out_dir/wandb (WANDB_MODE=offline keeps them local)
if wandb and master:
    wandb.init(project=wandb_project, name=wandb_run_name, config=config, dir=out_dir)
optimizer = make_optimizer(learning_rate)
iter_start, step, bad_in_row, saved_it = 0, 0, 0, None
if init_from == 'resume':
    iter_start = saved_it = state['iter']
    step, bad_in_row = state['step'], state['bad_in_row']
    checkpoint.load_optimizer(state['dir'], optimizer, rank if fsdp else None)
elif sft_iters > 0:
    sft.warm_start(model, raw_model, optimizer=make_optimizer(sft_learning_rate),
                   rows=train_rows, cfg=cfg, enc=enc, accuracy=accuracy, rank=rank,
                   stop=lambda: stop_if_signalled(None))
# The reference: the policy RL starts from, frozen (refreshed every ref_sync_every
# iterations); none without a KL term. With LoRA it is the policy itself, its log-probs
# taken without the adapters; a resumed run's is the one it saved (TR-DPO's moves).
if beta == 0:
    ref_model = None
elif lora_rank:
    ref_model = raw_model
else:
    ref_model = parallelism.frozen_copy(
        raw_model, device=device, dtype=param_dtype, bf16=bf16,
        saved=os.path.join(state['dir'], 'ref') if state else None)
# the curriculum's pool of prompts: the checkpoint's, or a fresh one
pool = None
if curriculum:
    pool = Pool(len(train_rows), cfg, start=iter_start, order=epoch_order,
                saved=state and checkpoint.load_curriculum(state['dir']))
# MFU's peak, in the dtype the update computes in, and the FLOPs of a row by its length
peak = peak_flops or matmul_peak(device, cfg.ptdtype)[0]
flops = row_flops(raw_model, block_size)
# what changed, and what dtype='auto' chose; what acc and the evaluations count as right
if master:
    said = [f"{k}={v!r}" + (f" ({dtype})" if k == 'dtype' and v == 'auto' else '')
            for k, v in changed.items()]
    print(f"{raw_model.get_num_params() / 1e6:.2f}M parameters, {world_size} rank(s) on "
          f"{device}, {prompts_per_step}x{num_generations} completions per iteration; "
          f"config: {' '.join(said) or 'the defaults'}", flush=True)
    print(f"accuracy: {accuracy_note}", flush=True)

t_loop = time.time()
for it in range(iter_start, max_iters + 1):
    if it < max_iters:
        stop_if_signalled(it)
    # held-out greedy accuracy and pass@k
    if eval_interval and (it % eval_interval == 0 or it == max_iters):
        metrics, samples = evaluate(raw_model, test_rows, it=it, rank=rank, cfg=cfg,
                                    enc=enc, accuracy=accuracy,
                                    every=progress_interval if master else math.inf)
        # a signal cuts an evaluation short: it is not logged, and resume does it again
        stop_if_signalled(it)
        if master:
            log(dict(metrics, iter=it), report(metrics, samples, it), out_dir=out_dir,
                wandb=wandb)
    saving = save_interval and it % save_interval == 0 or it == max_iters
    if it > iter_start and saving and bad_in_row == 0:
        saved_it = save(it)
    if it == max_iters:
        break
    # TR-DPO: the reference moves to the policy
    if ref_model is not None and ref_sync_every and it > 0 and it % ref_sync_every == 0:
        parallelism.blend(ref_model, raw_model, ref_model_mixup_alpha)
    # dropout follows the iteration: resume is exact
    torch.manual_seed(prompt_seed(seed, it, rank))
    t0 = time.perf_counter()
    # FSDP: the weights, gathered for the rollout
    with gathered(raw_model, ref_model) if fsdp else nullcontext():
        # G completions of each prompt, sampled and scored; then the batch and advantages
        if not max_staleness:
            groups, info = rollout(raw_model, train_rows=train_rows, it=it, rank=rank,
                                   cfg=cfg, enc=enc, reward_fns=reward_fns,
                                   reward_weights=reward_weights, pool=pool)
        else:
            # those sampled K versions ago, after this version's are sampled ahead
            groups, info = ahead.take(it)
        batch = make_batch(raw_model, ref_model, groups=groups, info=info, rank=rank,
                           cfg=cfg, reward_weights=reward_weights, teacher=teacher_model)
    t1 = time.perf_counter()
    # the rollout is the long part; resume redoes it exactly
    stop_if_signalled(it)

    # The update: num_iterations (mu) passes over the batch, each of steps_per_generation
    # optimizer steps. What the log needs of each micro-batch is kept, and made into the
    # log's numbers after the update.
    stats, shapes, bad = [], [], 0
    # this rank's completions per optimizer step
    per_step = len(batch['idx']) // steps_per_generation
    for n in range(num_iterations):
        for s in range(steps_per_generation):
            step_batch = {k: v[s * per_step:(s + 1) * per_step] for k, v in batch.items()}
            # the normaliser: the step's tokens, on every rank
            num_tokens = step_batch['mask'].sum().float()
            if distributed:
                num_tokens = all_sum(num_tokens)
            if top_entropy_quantile < 1:
                step_batch['entropy_mask'] = top_entropy_mask(raw_model, step_batch, cfg)
            micro = micro_batches(step_batch, micro_batch_size, plain)
            for i, (_, mb) in enumerate(micro):
                # until the first optimizer step the state is the one before the iteration
                if n == s == 0:
                    stop_if_signalled(it)
                # gradients are reduced over ranks on the last micro-batch only
                if distributed:
                    last = i == per_step // micro_batch_size - 1
                    parallelism.set_grad_sync(model, last)
                # (b,) the output layer stops at each row's last token that counts
                lengths = last_counted(mb['mask'])
                with torch.autocast(device_type, dtype=cfg.ptdtype, enabled=cfg.autocast):
                    logps, entropy = model(mb['idx'], start=mb['start'],
                        length=mb['mask'].shape[1], temperature=temperature, entropy=True,
                        lengths=lengths, pos=mb['pos'], plain=plain, top_k=cfg.logp_top_k,
                        top_p=cfg.logp_top_p)
                keys = ('old_logps', 'advantages', 'sampler_logps')
                old, advantages, sampler = (mb[k].to(logps.dtype) for k in keys)
                loss, mb_stats = loss_fn(logps, None if cfg.on_policy else old,
                    mb.get('ref_logps'), advantages, mb['mask'],
                    num_sequences=per_step * world_size, num_tokens=num_tokens,
                    sampler_logps=sampler, entropy=entropy,
                    entropy_mask=mb.get('entropy_mask'))
                # DDP and FSDP average over ranks: the loss is a sum
                (loss * world_size).backward()
                stats.append(mb_stats)
                shapes.append((*mb['idx'].shape, int(lengths.sum()), mb['tokens'],
                               mb['row_tokens']))
            norm = clip_grad_norm_(raw_model.parameters(), grad_clip or math.inf)
            # the ranks share one gradient, but a NaN on one must stop them all
            if distributed:
                norm, finite = parallelism.all_finite(norm)
            else:
                finite = torch.isfinite(norm).item()
            if finite:
                for group in optimizer.param_groups:
                    group['lr'] = get_lr(step)
                optimizer.step()
                step += 1
            bad += not finite
            optimizer.zero_grad(set_to_none=True)
    bad_in_row = bad_in_row + bad if bad else 0
    if bad_in_row >= max_bad_steps:
        raise SystemExit(
            f"error: {bad_in_row} optimizer steps in a row had a non-finite loss or "
            f"gradient (iteration {it}); the last good checkpoint in {out_dir} is "
            f"intact. Lower learning_rate or check the rewards, then resume with "
            f"init_from='resume'")

    # every rank's groups move their prompts' pass rates (right: the accuracy's score >= 1)
    if pool:
        right = info['scores'][:, reward_fns.index(accuracy)].nan_to_num() >= 1
        pool.update(right)
    # the log's numbers, once: the update's (norm.item() waits for the device), the rest
    grad_norm, t2 = norm.item(), time.perf_counter()
    speed, update = update_metrics(
        stats, shapes, maxima=MAX_STATS, steps=num_iterations * steps_per_generation,
        seconds=t2 - t1, flops=flops, peak=peak, world_size=world_size,
        distributed=distributed,
        held=(raw_model, optimizer, ref_model, teacher_model))
    times = dict(info['time'], update=t2 - t1)
    metrics = dict(iter=it, **rollout_metrics(info, cfg, reward_fns, accuracy), **speed,
                   dt=t2 - t0, mem_mb=memory_mb(device), **update, grad_norm=grad_norm,
                   lr=get_lr(max(step - 1, 0)), bad_steps=bad,
                   **{f'time/{k}': v for k, v in times.items()},
                   **info.get('stale', {}), **(pool.metrics() if pool else {}))
    # evaluations included
    eta = (time.time() - t_loop) / (it + 1 - iter_start) * (max_iters - it - 1)
    if master:
        line = iteration_line(metrics, max_iters=max_iters, eta=eta,
                              reward_fns=reward_fns)
        if max_staleness:
            line += stream.line(metrics)
        log(metrics, line, out_dir=out_dir, wandb=wandb)

if master and wandb:
    wandb.finish()
if ahead:
    ahead.close(0)
parallelism.end()
