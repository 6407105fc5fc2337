"""
nanoGPT-style configuration, with the errors a long run deserves.

The defaults are train.py's commented module globals. The command line adds, in
order, an optional config file (plain Python, exec'd) and `--key=value` overrides
(read by ast.literal_eval):

    python train.py config/dr_grpo.py --beta=0.04 --out_dir='out-kl'

Every mistake is caught before any work, in one line that says what is wrong and
how to fix it: an unknown key (with the closest known ones), a value of the wrong
type, combinations that cannot work (check_config). They raise ConfigError, which
train.py prints as `error: ...`, no traceback.
"""
import ast
import difflib
import functools
import inspect
import math
import os
import sys
from types import SimpleNamespace

import torch

import loss
from rollout import score
from sampling import check_sampling
from lib import chat, checkpoint, multiturn, parallelism
from lib.errors import ConfigError, unknown
from lib.tokenizer import eos_ids, get_tokenizer


def one_line_errors(kind, value, tb, out_dir=None):
    """train.py's sys.excepthook: bad input (a ConfigError) prints one line, a rank
    that lost another (once out_dir is known) one line naming the last checkpoint, a
    bug its traceback."""
    if issubclass(kind, ConfigError):
        print(f"error: {value}", file=sys.stderr)
    elif out_dir and parallelism.peer_gone(value):
        print(lost_rank(value, out_dir), file=sys.stderr)
    else:
        sys.__excepthook__(kind, value, tb)


def lost_rank(error, out_dir):
    """What a rank says when another is gone: gloo's reason without its source
    line, and the checkpoint to resume from (the writes are atomic: it is whole)."""
    rank = os.environ.get('RANK', '0')
    # '[.../gloo/transport/tcp/pair.cc:537] Read error [...]: Connection reset by
    # peer. This is typically caused by ...'
    reason = str(error).splitlines()[0].split('] ', 1)[-1].split('. ')[0]
    latest = checkpoint.read_json(os.path.join(out_dir, 'latest'))
    saved = (f"the last checkpoint, {os.path.join(out_dir, latest)}, is whole: "
             f"resume with init_from='resume'" if latest else
             "no checkpoint was saved yet: start the run again")
    return (f"error: rank {rank} stopped: another rank is gone ({reason}); {saved} "
            f"once every rank can run (that rank's own output says why it stopped)")


# the values a config may hold; the rest of train.py's globals (modules,
# functions) is not config
CONFIG_TYPES = (bool, int, float, str, tuple, dict, type(None))


def _unknown(key, known):
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
    hint = (f" Did you mean {' or '.join(close)}?" if close
            else " See the globals at the top of train.py.")
    return ConfigError(f"unknown config key '{key}'.{hint}")


def _coerce(key, value, default):
    """Return value converted to the type of default, or raise naming the key and
    both types."""
    # optional knobs (top_k, delta, ...): None or a value
    if default is None or value is None:
        ok = value is None or isinstance(value, (int, float, str, bool))
    elif isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    # an int where a float is expected is fine: --beta=0
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, tuple):
        ok = isinstance(value, (tuple, list))
        value = tuple(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(
            f"config key '{key}' expects {type(default).__name__}, "
            f"got {type(value).__name__} {value!r}; e.g. --{key}={default!r}")
    return value


def configure(defaults, argv):
    """The final config {key: value}: defaults (train.py's globals()), then argv
    (sys.argv[1:])."""
    config = {k: v for k, v in defaults.items()
              if not k.startswith('_') and isinstance(v, CONFIG_TYPES)}
    for arg in argv:
        # a config file: exec it on top of the defaults
        if not arg.startswith('--'):
            if not os.path.isfile(arg):
                raise ConfigError(f"config file '{arg}' not found; "
                                  "pass a path like config/dr_grpo.py")
            # __file__, so that a config can find the files beside it
            scope = dict(config, __file__=os.path.abspath(arg))
            try:
                exec(compile(open(arg).read(), arg, 'exec'), scope)
            except SyntaxError as e:
                raise ConfigError(
                    f"config file '{arg}' line {e.lineno}: {e.msg}") from None
            for key, value in scope.items():
                # imports, helpers and _private names may live in a config file
                if key.startswith('_') or not isinstance(value, CONFIG_TYPES):
                    continue
                if key not in config:
                    raise ConfigError(f"{arg}: {_unknown(key, config)}")
                config[key] = _coerce(key, value, defaults[key])
            continue
        key, eq, text = arg[2:].partition('=')
        if not eq:
            raise ConfigError(
                f"override '{arg}' has no value; write --{key}=VALUE")
        if key not in config:
            raise _unknown(key, config)
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            # a bare word is a string: --init_from=resume
            value = text
        config[key] = _coerce(key, value, defaults[key])
    return config


def _need(ok, message):
    if not ok:
        raise ConfigError(message)


def check_config(c, world_size, distributed=False):
    """Reject combinations that cannot work, before any work starts. c: the config
    dict; distributed: under torchrun. Then the loss's settings (check_loss), the
    sampler's (sampling.check_sampling), and that out_dir holds no other run."""
    choices = dict(
        lr_schedule=('constant', 'cosine'),
        dtype=('auto', 'float32', 'float64', 'bfloat16', 'float16'),
        parallel=('ddp', 'fsdp'), sandbox=('bwrap', 'none'),
        reward_model_dtype=('float32', 'bfloat16', 'float64'),
        stale_correction=('decoupled', 'tis', 'none'),
        teacher_dtype=('float32', 'bfloat16', 'float64'),
        curriculum=('', 'pass_rate'))
    for key, valid in choices.items():
        if c[key] not in valid:
            raise unknown(key, c[key], valid)
    # counts and rates that have a range; each message names its key and value
    at_least = dict(
        num_generations=2, prompts_per_step=1, steps_per_generation=1,
        micro_batch_size=1, num_iterations=1, max_completion_length=1,
        max_iters=0, eval_interval=0, eval_size=1, save_interval=0,
        sft_batch_size=1, max_resample_rounds=0, warmup_iters=0,
        ref_sync_every=0, max_bad_steps=1, n_layer=1, n_head=1, n_embd=1,
        block_size=2, vocab_size=0, grad_clip=0, weight_decay=0,
        peak_flops=0, lora_rank=0, tool_workers=1, max_staleness=0, sampler_ranks=0,
        curriculum_patience=1, curriculum_rest=1)
    why = dict(
        num_generations="; GRPO learns from differences between the completions "
                        "of one prompt",
        eval_size="; eval_interval=0 turns evaluation off")
    for key, low in at_least.items():
        _need(c[key] >= low,
              f"{key}={c[key]} must be >= {low}{why.get(key, '')}")
    _need(c['sft_iters'] is None or c['sft_iters'] >= 0,
          f"sft_iters={c['sft_iters']} must be None or >= 0")
    _need(0 <= c['sft_target_acc'] <= 1,
          f"sft_target_acc={c['sft_target_acc']} must be in [0, 1] (0: off)")
    _need(c['sft_check_interval'] >= 1,
          f"sft_check_interval={c['sft_check_interval']} must be >= 1")
    for key in ('beta1', 'beta2', 'dropout', 'lora_dropout'):
        _need(0 <= c[key] < 1, f"{key}={c[key]} must be in [0, 1)")
    _need(0 <= c['min_lr_ratio'] <= 1,
          f"min_lr_ratio={c['min_lr_ratio']} must be in [0, 1]")
    _need(c['lora_alpha'] > 0, f"lora_alpha={c['lora_alpha']} must be > 0")
    _need(0 < c['ref_model_mixup_alpha'] <= 1,
          f"ref_model_mixup_alpha={c['ref_model_mixup_alpha']} must be in "
          f"(0, 1]; 1 = off (the reference becomes a copy)")
    _need(c['parallel'] != 'fsdp' or distributed,
          "parallel='fsdp' shards over torchrun's processes: launch with "
          "torchrun (--nproc_per_node=1 for one GPU), or use parallel='ddp'")
    check_split(c, world_size, distributed)
    # the ranks that train: with sampler ranks, the others
    world_size -= c['sampler_ranks']
    G, P = c['num_generations'], c['prompts_per_step']
    _need(c['max_rows'] == 0 or c['max_rows'] >= G,
          f"max_rows={c['max_rows']} must be 0 (all rows at once) or "
          f">= num_generations={G}: a prompt's {G} rows are seated together")
    _need(P % world_size == 0,
          f"prompts_per_step={P} is not divisible by the {world_size} ranks "
          f"that train; make it a multiple of {world_size}")
    # completions each rank holds per rollout
    rows = P // world_size * G
    spg, mbs = c['steps_per_generation'], c['micro_batch_size']
    _need(rows % (spg * mbs) == 0,
          f"each rank holds prompts_per_step/ranks*num_generations = {rows} "
          f"completions per rollout, which must split into "
          f"steps_per_generation={spg} optimizer steps of "
          f"micro_batch_size={mbs}; pick micro_batch_size dividing "
          f"{rows // spg if rows % spg == 0 else rows}")
    _need(c['ref_model_mixup_alpha'] == 1
          or c['beta'] > 0 and c['ref_sync_every'] > 0,
          f"ref_model_mixup_alpha={c['ref_model_mixup_alpha']} blends the "
          f"policy into the reference every ref_sync_every iterations: "
          f"it needs beta > 0 and ref_sync_every > 0")
    if c['lora_rank']:
        _need(not c['sft_iters'] or c['init_from'] == 'resume',
              f"LoRA adapts a pretrained model, but sft_iters={c['sft_iters']} "
              f"asks for a full warm start first; run that without LoRA and "
              f"set init_from to its out_dir/warmstart (or a Hugging Face "
              f"model); sft_iters=0")
        _need(not c['ref_sync_every'],
              "with LoRA the reference is the base model (adapters off), "
              "which never changes: set ref_sync_every=0")
    _need(not (c['plain'] and c['cuda_graphs']),
          "plain=True turns the speed tricks off, cuda_graphs=True turns "
          "one on: drop one of them")
    _need(c['reward_clip'] >= 0,
          f"reward_clip={c['reward_clip']} must be >= 0 (0: off)")
    _need(c['temperature'] > 0,
          f"temperature={c['temperature']} must be > 0 for RL sampling "
          f"(log-probs divide by it)")
    _need(c['learning_rate'] > 0 and math.isfinite(c['learning_rate']),
          f"learning_rate={c['learning_rate']} must be a positive number")
    gguf = c['init_from'].endswith('.gguf')
    _need(c['init_from'] in ('scratch', 'resume')
          or os.path.isdir(c['init_from']) or gguf,
          f"init_from='{c['init_from']}' is neither 'scratch', 'resume', "
          f"a Hugging Face checkpoint directory nor a .gguf file")
    _need(not gguf or os.path.isfile(c['init_from']),
          f"init_from='{c['init_from']}': no such .gguf file")
    _need(c['init_from'] != 'resume'
          or os.path.exists(os.path.join(c['out_dir'], 'latest')),
          f"init_from='resume' but {c['out_dir']} holds no checkpoint; "
          f"start with init_from='scratch'")
    # sft_iters=None warm-starts a model from scratch (sft.default_iters): only 0
    # leaves it random
    _need(c['beta'] == 0 or c['init_from'] != 'scratch'
          or c['sft_iters'] != 0,
          "beta > 0 needs a reference policy worth staying close to, but "
          "init_from='scratch' with sft_iters=0 starts from random weights; "
          "set sft_iters > 0, init_from a checkpoint directory, or beta=0")
    _need(c['truncate_logprobs'] or (c['top_k'], c['top_p']) != (None, None),
          "truncate_logprobs=False asks for the full softmax's log-probs "
          "rather than those of top_k/top_p's truncated distribution, but "
          "neither is set, so every log-prob is the full softmax's already: "
          "drop it")
    check_distillation(c)
    check_curriculum(c)
    check_loss(c)
    check_sampling(c['top_k'], c['top_p'])
    # a new run never deletes or appends to another's checkpoints and metrics
    held = checkpoint.run_files(c['out_dir'])
    resume = "resume it with init_from='resume', " if 'latest' in held else ""
    _need(not held or c['init_from'] == 'resume' or c['overwrite'],
          f"out_dir='{c['out_dir']}' holds another run ({', '.join(held)}); "
          f"{resume}name another out_dir, or say overwrite=True to replace it")

def check_split(c, world_size, distributed):
    """sampler_ranks = N (lib/stream.py): the last N of torchrun's ranks only sample, K
    versions ahead of the others, which train."""
    N = c['sampler_ranks']
    if not N:
        return
    _need(c['max_staleness'] >= 1,
          f"sampler_ranks={N} samples while the trainers update, which needs groups "
          f"sampled versions ahead: set max_staleness >= 1")
    _need(distributed and world_size > N,
          f"sampler_ranks={N}: the last {N} of torchrun's ranks sample, the others "
          f"train; launch with torchrun --nproc_per_node > {N} (this run has "
          f"{world_size} rank(s))")
    _need(N <= world_size - N,
          f"sampler_ranks={N} is more than the {world_size - N} ranks that train, and "
          f"a sampler rank serves whole trainer ranks: the others would idle; use at "
          f"most {world_size - N}")
    _need(c['parallel'] == 'ddp',
          f"sampler_ranks={N} sends the whole weights to the samplers, which "
          f"parallel='fsdp' never holds on one rank: use parallel='ddp'")


def check_distillation(c):
    """On-policy distillation's settings (docs/distillation.md): a teacher that
    exists, a weight and a discount that do something."""
    teacher = c['teacher']
    if not teacher:
        return
    _need(os.path.isdir(teacher)
          or teacher.endswith('.gguf') and os.path.isfile(teacher),
          f"teacher='{teacher}' is neither a Hugging Face checkpoint directory "
          f"nor a .gguf file; give the teacher model's path, or '' for none")
    _need(c['teacher_weight'] > 0 and math.isfinite(c['teacher_weight']),
          f"teacher_weight={c['teacher_weight']} must be a positive number; "
          f"teacher='' turns distillation off")
    _need(0 <= c['teacher_discount'] <= 1,
          f"teacher_discount={c['teacher_discount']} must be in [0, 1]")


def check_curriculum(c):
    """The curriculum's thresholds (docs/curriculum.md), and what it cannot go with:
    another way to choose the prompts, or a draw made before the pool is known."""
    easy, hard = c['curriculum_easy'], c['curriculum_hard']
    _need(0 <= hard < easy <= 1,
          f"curriculum_hard={hard} and curriculum_easy={easy} are pass rates: "
          f"0 <= curriculum_hard < curriculum_easy <= 1")
    if not c['curriculum']:
        return
    _need(not c['dynamic_sampling'],
          "curriculum='pass_rate' and dynamic_sampling=True both choose the "
          "prompts (by their history; by resampling): use one")
    _need(not c['max_staleness'],
          f"curriculum='pass_rate' draws each iteration's prompts from the pool "
          f"as the iteration before left it, max_staleness={c['max_staleness']} "
          f"samples iterations ahead of it: use one")


def check_loss(s):
    """Refuse loss settings that cannot work, one line naming the setting: s holds
    some of them (train.py's whole config). Besides grpo_loss's (loss_settings())
    it knows the advantages' and the trainer's that the loss depends on:
    scale_rewards, advantage_estimator, multi_objective_aggregation, kl_in_reward,
    top_entropy_quantile. Their values and the pairs that would leave one of them
    ignored: loss.py's functions, called directly, only refuse a name they do not
    know."""
    choices = dict(
        loss_type=loss.LOSS_TYPES, scale_rewards=loss.SCALES,
        advantage_estimator=loss.ADVANTAGE_ESTIMATORS,
        surrogate=loss.SURROGATES,
        importance_sampling_level=loss.SAMPLING_LEVELS,
        kl_estimator=loss.KL_ESTIMATORS,
        sampler_correction=loss.SAMPLER_CORRECTIONS,
        multi_objective_aggregation=("sum_then_normalize",
                                     "normalize_then_sum"))
    for key, valid in choices.items():
        if key in s and s[key] not in valid:
            raise unknown(key, s[key], valid)
    # a setting not given: its default
    get = lambda key: s.get(key, loss_settings().get(key))
    for key in ("beta", "epsilon_low", "epsilon_high", "vespo_k_pos",
                "vespo_k_neg"):
        _need(get(key) >= 0, f"{key}={get(key)} must be >= 0")
    for key in ("sapo_temperature_pos", "sapo_temperature_neg",
                "vespo_lambda_pos", "vespo_lambda_neg",
                "sampler_correction_clip_max"):
        _need(get(key) > 0, f"{key}={get(key)} must be > 0")
    quantile = s.get("top_entropy_quantile", 1)
    _need(0 < quantile <= 1,
          f"top_entropy_quantile={s.get('top_entropy_quantile')} must be in "
          f"(0, 1]; 1 = off (every token)")
    _need(math.isfinite(get("entropy_coef")),
          f"entropy_coef={get('entropy_coef')} must be a finite number")
    low, high = (get("sampler_correction_clip_min"),
                 get("sampler_correction_clip_max"))
    _need(low is None or 0 <= low < high,
          f"sampler_correction_clip_min={low} must be None or in "
          f"[0, sampler_correction_clip_max={high})")
    mask = get("off_policy_mask_threshold")
    _need(mask is None or mask >= 0,
          f"off_policy_mask_threshold={mask} must be None or >= 0 "
          f"(a mean log-ratio)")
    beta, kl_in_reward, delta = (get("beta"), s.get("kl_in_reward", False),
                                 get("delta"))
    _need(not (kl_in_reward and beta == 0),
          "kl_in_reward=True needs beta > 0 (the KL coefficient)")
    _need(delta is None or delta > 1 + get("epsilon_high"),
          f"delta={delta} must be None or > 1 + epsilon_high (it caps the "
          f"ratio above the clip range)")
    # settings that would be silently ignored, or that contradict another
    _need(delta is None or get("surrogate") == "clip",
          f"delta caps PPO's clipped ratio; surrogate='{get('surrogate')}' "
          f"has none: set delta=None")
    _need(not (get("surrogate") == "vespo"
               and get("importance_sampling_level") == "sequence"),
          "surrogate='vespo' weighs each sequence by its whole ratio "
          "already; set importance_sampling_level='token'")
    _need(not get("use_bias_correction_kl") or beta > 0 and not kl_in_reward,
          "use_bias_correction_kl=True weighs the KL term of the loss: it "
          "needs beta > 0 and kl_in_reward=False")
    scale, estimator = (s.get("scale_rewards", "none"),
                        s.get("advantage_estimator", "grpo"))
    gdpo = s.get("multi_objective_aggregation") == "normalize_then_sum"
    for name, on in (("reinforce_pp", estimator == "reinforce_pp"),
                     ("normalize_then_sum", gdpo)):
        _need(not on or scale == "none",
              f"{name} normalises the advantages over the batch itself; "
              f"scale_rewards='{scale}' would scale twice: "
              f"set scale_rewards='none'")
    _need(not gdpo or estimator == "grpo" and not kl_in_reward,
          "multi_objective_aggregation='normalize_then_sum' (GDPO) "
          "normalises each reward function in its group: it takes "
          "advantage_estimator='grpo' and kl_in_reward=False")


@functools.lru_cache(maxsize=1)
def loss_settings():
    """grpo_loss's settings by name, with their defaults, written once, in its
    signature: check_loss fills in a setting not given from here, and
    tests/test_config.py checks that train.py declares each with this default.
    The tensors and the step's counts are arguments, not settings."""
    per_step = ("max_completion_length", "num_sequences", "num_tokens",
                "sampler_logps", "entropy", "entropy_mask")
    return {name: p.default for name, p
            in inspect.signature(loss.grpo_loss).parameters.items()
            if p.kind is p.KEYWORD_ONLY and name not in per_step}


# a text whose ids differ between any two tokenizers that are not the same one
PROBE = "What is 7 times 8? The answer: 56.\n\tHello, world!"


def _ids_differ(a, b):
    """What makes tokenizers a and b give other ids, in a few words, '' where
    nothing does: the vocabulary's size, the special tokens, PROBE's ids."""
    specials, theirs = (sorted(enc.special_tokens_set) for enc in (a, b))
    text = PROBE + "".join(specials)
    ids = lambda enc: enc.encode(text, allowed_special="all")
    if a.n_vocab != b.n_vocab:
        return f"{a.n_vocab} ids against {b.n_vocab}"
    if specials != theirs:
        only = sorted(set(specials) ^ set(theirs))
        return f"special tokens only one has: {', '.join(only[:3])}"
    if ids(a) != ids(b):
        return f"{PROBE!r} encodes to other ids"
    return ""


def check_tokenizer(enc, tokenizer, init_from, state):
    """A pretrained model is fed the ids it learnt, whatever the chat template.
    Where init_from has a tokenizer of its own (a .gguf's, a tokenizer.json or
    vocab.json beside the weights; a resumed run: the run's), tokenizer (enc) must
    give its ids; a model that came without one must end text with an id the
    tokenizer has."""
    own = None
    if state:
        own, whose = (state['config']['tokenizer'],
                      "the run in out_dir was trained with")
    elif init_from != 'scratch':
        if checkpoint.default_tokenizer(init_from, None) != 'bytes':
            own, whose = init_from, f"init_from='{init_from}' comes with"
    if own and os.path.realpath(own) != os.path.realpath(tokenizer):
        theirs = get_tokenizer(own)
        _need(not _ids_differ(enc, theirs),
              f"{whose} its own tokenizer ({theirs.n_vocab} ids), but "
              f"tokenizer='{tokenizer}' is another ({enc.n_vocab} ids): "
              f"the model would read ids it never learnt; drop tokenizer= "
              f"to use its own")
    eos = eos_ids(init_from) if os.path.isdir(init_from) else None
    _need(not eos or max(eos) < enc.n_vocab,
          f"init_from='{init_from}' ends text with token id "
          f"{max(eos or [0])}, which tokenizer '{tokenizer}' "
          f"({enc.n_vocab} ids) lacks; pick the tokenizer the model was "
          f"trained with")


def check_teacher(config, enc, cfg):
    """On-policy distillation's teacher (its GPTConfig) scores the student's
    token ids: its own tokenizer (checkpoint.default_tokenizer's: a .gguf's, the
    files beside its weights, the one its run of this project was trained with,
    else the byte tokenizer's) must give the run's ids (enc), and the run must fit
    in it."""
    run = (checkpoint.read_json(os.path.join(cfg.teacher, 'trainer.json'))
           if os.path.isdir(cfg.teacher) else None)
    own = checkpoint.default_tokenizer(cfg.teacher, run)
    if os.path.realpath(own) != os.path.realpath(cfg.tokenizer):
        differs = _ids_differ(enc, get_tokenizer(own))
        _need(not differs,
              f"teacher='{cfg.teacher}' reads its own tokenizer ({own}), not "
              f"the student's (tokenizer='{cfg.tokenizer}'); the student's "
              f"against the teacher's: {differs}; "
              f"distil from a teacher that shares the student's tokenizer")
    try:
        check_fits(config, enc, cfg.tokenizer, cfg.block_size)
    except ConfigError as e:
        raise ConfigError(f"teacher='{cfg.teacher}': {e}") from None


def check_rewards(rows, cfg, enc, reward_fns, reward_weights):
    """Every reward function called on the first train rows, each row's answer and
    an empty completion standing in for the policy's, before any work: one that
    raises, or returns other than a number (or None) per completion, fails here in
    one line, not after the warm start. No random number is drawn and nothing of
    the run changes."""
    rows, eos = rows[:2], cfg.eos_ids[0]
    ids = [c for r in rows
           for c in ([*enc.encode_ordinary(r['answer']), eos], [eos])]
    width = max(map(len, ids))
    tokens = torch.tensor([c + [eos] * (width - len(c)) for c in ids])
    mask = (torch.arange(width)
            < torch.tensor([len(c) for c in ids])[:, None])
    # a multi-turn run's episodes: finished, nothing observed
    finished = [dict(finished=True, observations=[]) for _ in ids]
    record = finished if cfg.environment else None
    try:
        score(rows, tokens, mask, cfg, enc, reward_fns, reward_weights,
              num_samples=2, record=record)
    except ConfigError as e:
        raise ConfigError(f"{e} (a check before any work, on train rows with "
                          f"stand-in completions)") from e


def check_fits(config, enc, tokenizer, block_size):
    """A pretrained model (its GPTConfig) fits the run: the tokenizer's ids in its
    vocabulary, block_size in its own."""
    vocab, own = config.vocab_size, config.block_size
    if vocab < enc.n_vocab:
        raise ConfigError(
            f"the model's vocab_size {vocab} < tokenizer '{tokenizer}' "
            f"n_vocab {enc.n_vocab}; pick the tokenizer the model was "
            f"trained with")
    if own < block_size:
        raise ConfigError(f"block_size={block_size} exceeds the model's "
                          f"{own}; lower block_size")


def check_device(device):
    """One line naming the devices this machine has, rather than torch's traceback
    at the first tensor moved."""
    here = (['cpu']
            + [f'cuda:{i}' for i in range(torch.cuda.device_count())]
            + (['mps'] if torch.backends.mps.is_available() else []))
    if (device not in ('auto', *here)
            and not (device == 'cuda' and torch.cuda.is_available())):
        no_cuda = device.startswith('cuda') and torch.version.cuda is None
        why = ' (this torch is built without CUDA)' if no_cuda else ''
        raise ConfigError(
            f"device='{device}' is not on this machine{why}; it has "
            f"{', '.join(here)}: use one of those or device='auto'")


def run_config(config, *, enc, template, world_size):
    """The run's one namespace, built once at the start and never changed after: its settings
    (config: train.py's globals, each settled, device the one it runs on: what config.json holds)
    and what they derive, each named here. rollout.py, sft.py and evaluate.py read it as cfg."""
    c = SimpleNamespace(**config)
    autocast = c.dtype in ('bfloat16', 'float16')
    on_policy = c.num_iterations == 1 and c.steps_per_generation == 1
    full_softmax = (c.top_k, c.top_p) != (None, None) and not c.truncate_logprobs
    environment = (multiturn.environment(c.env, c.sandbox, template, c.chat_template_kwargs)
                   if c.env else None)
    return SimpleNamespace(
        **config, world_size=world_size, template=template,
        environment=environment, autocast=autocast, ptdtype=getattr(torch, c.dtype),
        on_policy=on_policy,
        # the ids that end a completion, the turn's end first
        eos_ids=chat.stop_ids(enc, template, c.tokenizer, c.stop_tokens),
        # model.logprobs' truncation: the sampler's (log q, of the distribution that sampled)
        # unless truncate_logprobs=False asks for the full softmax's
        logp_top_k=c.top_k if c.truncate_logprobs else None,
        logp_top_p=c.top_p if c.truncate_logprobs else None,
        # The sampler's log-probs serve as the old ones but where they are not the trainer's:
        # low-precision sampling differs enough from the training forward to redo them, as a
        # trainer on the full softmax does, whose KL in the reward needs its own too. On-policy
        # the loss takes the training forward's own (logp.detach()) and needs no pass.
        redo_old_logps=(autocast or full_softmax) and not on_policy
        or full_softmax and c.kl_in_reward
        # the decoupled objective's proximal policy: the one before the update (lib/stream.py)
        or c.max_staleness > 0 and c.stale_correction == 'decoupled' and not on_policy)
