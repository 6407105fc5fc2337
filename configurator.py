"""
nanoGPT-style configuration, with the errors a long run deserves.

The defaults are train.py's commented module globals. The command line adds, in order, an optional
config file (plain Python, exec'd) and `--key=value` overrides (read by ast.literal_eval):

    python train.py config/dr_grpo.py --beta=0.04 --out_dir='out-kl'

Every mistake is caught before any work, in one line that says what is wrong and how to fix it: an
unknown key (with the closest known ones), a value of the wrong type, combinations that cannot work
(check_config). They raise ConfigError, which train.py prints as `error: ...`, no traceback.
"""
import ast
import difflib
import math
import os
import sys

import torch

from loss import check_settings
from sampling import check_sampling
from lib.errors import ConfigError


def one_line_errors(kind, value, tb):
    """train.py's sys.excepthook: bad input (a ConfigError) prints one line, a bug its traceback."""
    if issubclass(kind, ConfigError):
        print(f"error: {value}", file=sys.stderr)
    else:
        sys.__excepthook__(kind, value, tb)


# the values a config may hold; the rest of train.py's globals (modules, functions) is not config
CONFIG_TYPES = (bool, int, float, str, tuple, dict, type(None))


def _unknown(key, known):
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
    hint = (f" Did you mean {' or '.join(close)}?" if close
            else " See the globals at the top of train.py.")
    return ConfigError(f"unknown config key '{key}'.{hint}")


def _coerce(key, value, default):
    """Return value converted to the type of default, or raise naming the key and both types."""
    if default is None or value is None:  # optional knobs (top_k, delta, ...): None or a value
        ok = value is None or isinstance(value, (int, float, str, bool))
    elif isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):  # an int where a float is expected is fine: --beta=0
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, tuple):
        ok = isinstance(value, (tuple, list))
        value = tuple(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(f"config key '{key}' expects {type(default).__name__}, "
                          f"got {type(value).__name__} {value!r}; e.g. --{key}={default!r}")
    return value


def configure(defaults, argv):
    """The final config {key: value}: defaults (train.py's globals()), then argv (sys.argv[1:])."""
    config = {k: v for k, v in defaults.items()
              if not k.startswith('_') and isinstance(v, CONFIG_TYPES)}
    for arg in argv:
        if not arg.startswith('--'):  # a config file: exec it on top of the defaults
            if not os.path.isfile(arg):
                raise ConfigError(f"config file '{arg}' not found; "
                                  "pass a path like config/dr_grpo.py")
            # __file__, so that a config can find the files beside it
            scope = dict(config, __file__=os.path.abspath(arg))
            try:
                exec(compile(open(arg).read(), arg, 'exec'), scope)
            except SyntaxError as e:
                raise ConfigError(f"config file '{arg}' line {e.lineno}: {e.msg}") from None
            for key, value in scope.items():
                if key.startswith('_') or not isinstance(value, CONFIG_TYPES):
                    continue  # imports, helpers and _private names may live in a config file
                if key not in config:
                    raise ConfigError(f"{arg}: {_unknown(key, config)}")
                config[key] = _coerce(key, value, defaults[key])
            continue
        key, eq, text = arg[2:].partition('=')
        if not eq:
            raise ConfigError(f"override '{arg}' has no value; write --{key}=VALUE")
        if key not in config:
            raise _unknown(key, config)
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare word is a string: --init_from=resume
        config[key] = _coerce(key, value, defaults[key])
    return config


def check_config(c, world_size, distributed=False):
    """Reject combinations that cannot work, before any work starts. c: the config dict;
    distributed: under torchrun. Then the loss's settings (loss.check_settings) and the sampler's
    (sampling.check_sampling), each checked there."""
    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)
    choices = dict(lr_schedule=('constant', 'cosine'),
                   dtype=('auto', 'float32', 'float64', 'bfloat16', 'float16'),
                   parallel=('ddp', 'fsdp'), sandbox=('bwrap', 'none'),
                   reward_model_dtype=('float32', 'bfloat16', 'float64'))
    for key, valid in choices.items():
        need(c[key] in valid, f"unknown {key} '{c[key]}'; choose one of {', '.join(valid)}")
    # counts and rates that have a range; each message names its key and value
    at_least = dict(num_generations=2, prompts_per_step=1, steps_per_generation=1,
                    micro_batch_size=1, num_iterations=1, max_completion_length=1, max_iters=0,
                    eval_interval=0, eval_size=1, save_interval=0, sft_batch_size=1,
                    max_resample_rounds=0, warmup_iters=0, ref_sync_every=0, max_bad_steps=1,
                    n_layer=1, n_head=1, n_embd=1, block_size=2, vocab_size=0, grad_clip=0,
                    weight_decay=0, peak_flops=0, lora_rank=0, tool_workers=1)
    why = dict(num_generations="; GRPO learns from differences between the completions "
                               "of one prompt",
               eval_size="; eval_interval=0 turns evaluation off")
    for key, low in at_least.items():
        need(c[key] >= low, f"{key}={c[key]} must be >= {low}{why.get(key, '')}")
    need(c['sft_iters'] is None or c['sft_iters'] >= 0,
         f"sft_iters={c['sft_iters']} must be None or >= 0")
    need(0 <= c['sft_target_acc'] <= 1,
         f"sft_target_acc={c['sft_target_acc']} must be in [0, 1] (0: off)")
    need(c['sft_check_interval'] >= 1,
         f"sft_check_interval={c['sft_check_interval']} must be >= 1")
    for key in ('beta1', 'beta2', 'dropout', 'lora_dropout'):
        need(0 <= c[key] < 1, f"{key}={c[key]} must be in [0, 1)")
    need(0 <= c['min_lr_ratio'] <= 1, f"min_lr_ratio={c['min_lr_ratio']} must be in [0, 1]")
    need(c['lora_alpha'] > 0, f"lora_alpha={c['lora_alpha']} must be > 0")
    need(0 < c['ref_model_mixup_alpha'] <= 1,
         f"ref_model_mixup_alpha={c['ref_model_mixup_alpha']} must be in (0, 1]; "
         f"1 = off (the reference becomes a copy)")
    need(c['parallel'] != 'fsdp' or distributed,
         "parallel='fsdp' shards over torchrun's processes: launch with "
         "torchrun (--nproc_per_node=1 for one GPU), or use parallel='ddp'")
    G, P = c['num_generations'], c['prompts_per_step']
    need(P % world_size == 0, f"prompts_per_step={P} is not divisible by the {world_size} ranks; "
                              f"make it a multiple of {world_size}")
    rows = P // world_size * G  # completions each rank holds per rollout
    spg, mbs = c['steps_per_generation'], c['micro_batch_size']
    need(rows % (spg * mbs) == 0,
         f"each rank holds prompts_per_step/ranks*num_generations = {rows} completions per "
         f"rollout, which must split into steps_per_generation={spg} optimizer steps of "
         f"micro_batch_size={mbs}; pick micro_batch_size dividing "
         f"{rows // spg if rows % spg == 0 else rows}")
    need(c['ref_model_mixup_alpha'] == 1 or c['beta'] > 0 and c['ref_sync_every'] > 0,
         f"ref_model_mixup_alpha={c['ref_model_mixup_alpha']} blends the policy into the "
         f"reference every ref_sync_every iterations: it needs beta > 0 and ref_sync_every > 0")
    if c['lora_rank']:
        need(not c['sft_iters'] or c['init_from'] == 'resume',
             f"LoRA adapts a pretrained model, but sft_iters={c['sft_iters']} asks for a full warm "
             f"start first; run that without LoRA and set init_from to its out_dir/warmstart "
             f"(or a Hugging Face model); sft_iters=0")
        need(not c['ref_sync_every'], "with LoRA the reference is the base model (adapters off), "
                                      "which never changes: set ref_sync_every=0")
    need(not (c['plain'] and c['cuda_graphs']),
         "plain=True turns the speed tricks off, cuda_graphs=True turns one on: drop one of them")
    need(c['reward_clip'] >= 0, f"reward_clip={c['reward_clip']} must be >= 0 (0: off)")
    need(c['temperature'] > 0, f"temperature={c['temperature']} must be > 0 for RL sampling "
                               f"(log-probs divide by it)")
    need(c['learning_rate'] > 0 and math.isfinite(c['learning_rate']),
         f"learning_rate={c['learning_rate']} must be a positive number")
    gguf = c['init_from'].endswith('.gguf')
    need(c['init_from'] in ('scratch', 'resume') or os.path.isdir(c['init_from']) or gguf,
         f"init_from='{c['init_from']}' is neither 'scratch', 'resume', a Hugging Face checkpoint "
         f"directory nor a .gguf file")
    need(not gguf or os.path.isfile(c['init_from']),
         f"init_from='{c['init_from']}': no such .gguf file")
    need(c['init_from'] != 'resume' or os.path.exists(os.path.join(c['out_dir'], 'latest')),
         f"init_from='resume' but {c['out_dir']} holds no checkpoint; "
         f"start with init_from='scratch'")
    # sft_iters=None warm-starts a model from scratch (sft.default_iters): only 0 leaves it random
    need(c['beta'] == 0 or c['init_from'] != 'scratch' or c['sft_iters'] != 0,
         "beta > 0 needs a reference policy worth staying close to, but init_from='scratch' with "
         "sft_iters=0 starts from random weights; set sft_iters > 0, init_from a checkpoint "
         "directory, or beta=0")
    need(c['truncate_logprobs'] or (c['top_k'], c['top_p']) != (None, None),
         "truncate_logprobs=False asks for the full softmax's log-probs rather than those of "
         "top_k/top_p's truncated distribution, but neither is set, so every log-prob is the full "
         "softmax's already: drop it")
    check_settings(c)
    check_sampling(c['top_k'], c['top_p'])


def check_fits(config, enc, tokenizer, block_size):
    """A pretrained model (its GPTConfig) fits the run: the tokenizer's ids in its vocabulary,
    block_size in its own."""
    vocab, own = config.vocab_size, config.block_size
    if vocab < enc.n_vocab:
        raise ConfigError(f"the model's vocab_size {vocab} < tokenizer '{tokenizer}' n_vocab "
                          f"{enc.n_vocab}; pick the tokenizer the model was trained with")
    if own < block_size:
        raise ConfigError(f"block_size={block_size} exceeds the model's {own}; lower block_size")


def check_device(device):
    """One line naming the devices this machine has, rather than torch's traceback at the first
    tensor moved."""
    here = ['cpu'] + [f'cuda:{i}' for i in range(torch.cuda.device_count())] + \
        (['mps'] if torch.backends.mps.is_available() else [])
    if device not in ('auto', *here) and not (device == 'cuda' and torch.cuda.is_available()):
        no_cuda = device.startswith('cuda') and torch.version.cuda is None
        why = ' (this torch is built without CUDA)' if no_cuda else ''
        raise ConfigError(f"device='{device}' is not on this machine{why}; it has "
                          f"{', '.join(here)}: use one of those or device='auto'")
