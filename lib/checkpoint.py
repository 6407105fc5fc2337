"""
Checkpoints that survive SIGKILL at any moment.

    out_dir/latest            one line: the name of the newest complete checkpoint directory
    out_dir/ckpt-000040/      model.safetensors + config.json (Hugging Face layout: load it with the usual tools)
                              optimizer.safetensors (AdamW moments; under FSDP one optimizer.rank{r}.safetensors
                              per rank, its shard), optimizer.json, trainer.json (iteration, step, config)
                              ref/ (the frozen reference model, only when beta > 0 without LoRA)
                              adapter/ (LoRA: PEFT's adapter_config.json + adapter_model.safetensors; the model
                              files beside it are then the frozen base, hard links to the run's previous checkpoint's),
                              merged/ (LoRA's merged model, if asked)
                              curriculum.safetensors (curriculum='pass_rate': the pool of prompts, lib/curriculum.py)
                              tokenizer.json, generation_config.json... (a checkpoint's tokenizer's, when used)

A checkpoint is written into a temporary directory, every file fsync'd, the directory renamed into place, and only
then `latest` is switched to it (write + fsync + rename, atomic on POSIX). A kill before the switch leaves the previous
checkpoint as `latest`; older checkpoints are removed only after the switch. Nothing is ever unpickled: tensors are
safetensors, the rest JSON.
"""
import json
import os
import shlex
import shutil
import signal
import sys

import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lib import gguf_file, lora, parallelism
from lib.errors import ConfigError


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path, obj):
    """Atomically write obj as JSON to path (temp file in the same directory, fsync, rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, 'w') as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_json(path):
    """The JSON object at path, or None if the file does not exist."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); delete it or restore it from a backup") from None


TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'generation_config.json',
                   'vocab.json', 'merges.txt')  # what transformers and vLLM read beside the weights


def _fsynced(file):
    with open(file, 'rb') as f:
        os.fsync(f.fileno())


def _link_base(src, dst):
    """Hard-link the model files of checkpoint src (config.json, the weights and their index) into dst: a LoRA run's
    base never changes, so each checkpoint shares the first one's files instead of writing them again (28 GB for a
    7B in float32). Copies them where the filesystem cannot link."""
    os.makedirs(dst, exist_ok=True)
    for file in os.listdir(src):
        if file == 'config.json' or file.startswith('model') and '.safetensors' in file:
            try:
                os.link(os.path.join(src, file), os.path.join(dst, file))
            except OSError:
                shutil.copyfile(os.path.join(src, file), os.path.join(dst, file))
                _fsynced(os.path.join(dst, file))
    fsync_dir(dst)


def ckpt_dir(out_dir, it):
    """The directory of checkpoint `it`."""
    return os.path.join(out_dir, f"ckpt-{it:06d}")


def save(out_dir, it, model, optimizer, ref_model, trainer_state, tokenizer_dir=None, save_merged=False, last=None,
         stream=None, curriculum=None):
    """Write checkpoint ckpt-{it} atomically and make it the latest; keep the previous one until then. With
    tokenizer_dir, its tokenizer files are copied in too, so the checkpoint is a whole Hugging Face model directory.
    Every rank calls it: under FSDP the weights are gathered to rank 0 a tensor at a time and each rank writes its own
    shard of the optimizer state (optimizer.rank{r}.safetensors; a shared filesystem across nodes); under DDP the
    ranks hold the same state and rank 0 writes it all (optimizer.safetensors). With LoRA and save_merged, merged/
    holds the base with the adapters merged in, a whole Hugging Face model. last: the iteration of the run's last
    checkpoint (saved or resumed from), if any: with LoRA its frozen base is this one's, so its model files are
    linked, not gathered and written again. stream: this rank's rollouts in flight (lib/stream.py), tensors each rank
    writes to stream.rank{r}.safetensors. curriculum: the pool of prompts (lib/curriculum.py), the same on every rank:
    rank 0 writes curriculum.safetensors."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    shards = parallelism.sharded(model)
    ref_model = None if ref_model is model else ref_model  # LoRA's reference is the base model: nothing to save
    base_from = ckpt_dir(out_dir, last) if last is not None and lora.has_adapters(model) else None
    # without LoRA's adapters: the base (every rank takes part under FSDP, so the choice is the same on all)
    weights = parallelism.full_state_dict(model, keep=rank == 0) if save_merged or not base_from else None
    ref_weights = parallelism.full_state_dict(ref_model, keep=rank == 0) if ref_model is not None else None
    merged = lora.merged_state_dict(model, weights) if save_merged and lora.has_adapters(model) else None
    final = ckpt_dir(out_dir, it)
    name = os.path.basename(final)
    tmp = os.path.join(out_dir, f".{name}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a run killed mid-write
        if base_from:
            _link_base(base_from, tmp)
        else:
            model.save_pretrained(tmp, state_dict=weights)
        for file in TOKENIZER_FILES if tokenizer_dir else ():
            if os.path.isfile(os.path.join(tokenizer_dir, file)):
                shutil.copyfile(os.path.join(tokenizer_dir, file), os.path.join(tmp, file))
                _fsynced(os.path.join(tmp, file))
        if ref_model is not None:
            ref_model.save_pretrained(os.path.join(tmp, 'ref'), state_dict=ref_weights)
        if merged is not None:
            model.save_pretrained(os.path.join(tmp, 'merged'), state_dict=merged)
        write_json(os.path.join(tmp, 'optimizer.json'), optimizer.state_dict()['param_groups'])
    if lora.has_adapters(model):  # PEFT's layout, in a folder of its own (a model folder with adapter_config.json
        # is an adapter to transformers); its base is this checkpoint's model.safetensors
        lora.save_adapter(model, os.path.join(tmp, 'adapter'), os.path.abspath(final), write=rank == 0)
    parallelism.barrier()  # the directory exists before the other ranks write into it
    if shards or rank == 0:
        file = os.path.join(tmp, f'optimizer.rank{rank}.safetensors' if shards else 'optimizer.safetensors')
        save_file(parallelism.local_state(optimizer), file)
        _fsynced(file)
    if stream is not None:
        file = os.path.join(tmp, f'stream.rank{rank}.safetensors')
        save_file(stream, file)
        _fsynced(file)
    if curriculum is not None and rank == 0:
        save_file(curriculum, os.path.join(tmp, 'curriculum.safetensors'))
        _fsynced(os.path.join(tmp, 'curriculum.safetensors'))
    parallelism.barrier()  # every shard is on disk before the checkpoint becomes the latest
    if rank == 0:
        write_json(os.path.join(tmp, 'trainer.json'), dict(trainer_state, iter=it))
        shutil.rmtree(final, ignore_errors=True)  # a same-named leftover that `latest` does not point to
        os.rename(tmp, final)
        fsync_dir(out_dir)
        write_json(os.path.join(out_dir, 'latest'), name)
        if 'config' in trainer_state:  # the run that wrote the latest checkpoint, every value
            write_json(os.path.join(out_dir, 'config.json'), trainer_state['config'])
        for old in os.listdir(out_dir):  # only now is it safe to drop the older checkpoints
            if old.startswith('ckpt-') and old != name or old.startswith('.ckpt-'):
                shutil.rmtree(os.path.join(out_dir, old), ignore_errors=True)
    parallelism.barrier()


RUN_FILES = ('latest', 'metrics.jsonl', 'config.json')  # beside the checkpoints


def run_files(out_dir):
    """What in out_dir belongs to a run, `latest` first: its checkpoints (one cut off mid-write
    too), RUN_FILES. Not the warm start's cache, which any run with the same settings reuses."""
    mine = lambda f: f.startswith(('ckpt-', '.ckpt-')) or f in RUN_FILES
    files = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted(filter(mine, files), key=lambda f: (f != 'latest', f))


def remove_run(out_dir):
    """Delete the run out_dir holds (run_files), `latest` first: what is left of it is never taken
    for a checkpoint."""
    for f in run_files(out_dir):
        path = os.path.join(out_dir, f)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def default_tokenizer(init_from, state):
    """The tokenizer of a run that names none: a resumed run's own, a checkpoint's (a .gguf's, or tokenizer.json or
    vocab.json beside the weights), else 'bytes'."""
    if state:
        return state['config']['tokenizer']
    own = init_from.endswith('.gguf') or any(os.path.exists(os.path.join(init_from, f))
                                             for f in ('tokenizer.json', 'vocab.json'))
    return init_from if own else 'bytes'


def tokenizer_files(tokenizer, out_dir, write):
    """The directory whose tokenizer files go into every checkpoint, so that each is a whole Hugging Face model:
    the tokenizer's own (a tokenizer.json's directory), a GGUF's tokenizer written out as Hugging Face files to
    out_dir/tokenizer (where write: by one rank), or None for a built-in tokenizer ('bytes', 'gpt2')."""
    if tokenizer.endswith('.gguf'):
        if write:
            gguf_file.write_hf_tokenizer(tokenizer, os.path.join(out_dir, 'tokenizer'))
        return os.path.join(out_dir, 'tokenizer')
    if not os.path.exists(tokenizer):
        return None
    return tokenizer if os.path.isdir(tokenizer) else os.path.dirname(tokenizer)


def load_state(out_dir, parallel=None, world_size=None):
    """The latest checkpoint's trainer state, with 'dir' set to its directory. Given the resuming run's parallel and
    world_size, checks it can resume there: on any number of ranks, except that FSDP's optimizer state is in shards,
    so a run with FSDP on either side resumes only as it was written."""
    name = read_json(os.path.join(out_dir, 'latest'))
    if name is None:
        raise ConfigError(f"no checkpoint in {out_dir} (no 'latest' file); start with init_from='scratch'")
    path = os.path.join(out_dir, str(name))
    state = read_json(os.path.join(path, 'trainer.json'))
    if state is None:
        raise ConfigError(f"{path}/trainer.json is missing: the checkpoint is incomplete; "
                          f"restore it or start with init_from='scratch'")
    was = state['config'].get('parallel', 'ddp'), state.get('world_size', world_size)
    if parallel and 'fsdp' in (parallel, was[0]) and was != (parallel, world_size):
        raise ConfigError(f"{path} was written with parallel='{was[0]}' on {was[1]} rank(s); resume it with "
                          f"--parallel={was[0]} and torchrun --nproc_per_node={was[1]} (this run: '{parallel}', "
                          f"{world_size} rank(s))")
    return dict(state, dir=path)


def load_optimizer(path, optimizer, rank=None):
    """Load the AdamW state saved by save() into optimizer (which must have the same parameter groups): the whole of it,
    or with rank (FSDP) that rank's shard, into moments sharded like their parameters."""
    file = os.path.join(path, 'optimizer.safetensors' if rank is None else f'optimizer.rank{rank}.safetensors')
    tensors = _tensors(file)
    state = {}
    for key, value in tensors.items():
        i, k = key.split('.', 1)
        state.setdefault(int(i), {})[k] = value
    optimizer.load_state_dict(dict(state=parallelism.to_params(state, optimizer),
                                   param_groups=read_json(os.path.join(path, 'optimizer.json'))))


def load_stream(path, rank, world_size):
    """This rank's rollouts in flight in checkpoint path (lib/stream.py's tensors), {} if it has none (a run with
    max_staleness=0). Each rank holds its own prompts' groups: the run resumes on as many ranks."""
    files = [f for f in os.listdir(path) if f.startswith('stream.rank')]
    if not files:
        return {}
    if len(files) != world_size:
        raise ConfigError(f"{path} holds the rollouts in flight of {len(files)} rank(s); resume it on as many "
                          f"(torchrun --nproc_per_node={len(files)}), this run has {world_size}")
    return _tensors(os.path.join(path, f'stream.rank{rank}.safetensors'))


def load_curriculum(path):
    """The pool of prompts in checkpoint path (lib/curriculum.py's tensors), None if it has none (a run without a
    curriculum, or before it had one)."""
    file = os.path.join(path, 'curriculum.safetensors')
    return _tensors(file) if os.path.exists(file) else None


def _tensors(file):
    """A checkpoint's safetensors file, or one line saying it is damaged."""
    try:
        return load_file(file)
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{file} cannot be read ({e}); the checkpoint is damaged, restore it or start "
                          f"with init_from='scratch'") from None


# -----------------------------------------------------------------------------
def stopped_message(sig, it, out_dir, world_size):
    """What a run stopped by signal sig before iteration it (None: in the warm start, which saves
    nothing until it ends) prints: where it is saved, the command that resumes it."""
    name = signal.Signals(sig).name
    if it is None:
        return f"stopped by {name} in the warm start: nothing saved; the same command starts again"
    stopped = f"stopped by {name} before iteration {it}: "
    where = read_json(os.path.join(out_dir, 'latest'))
    if not where:
        return stopped + "no checkpoint to resume from (the first steps were non-finite)"
    args = [a for a in sys.argv[1:] if not a.startswith('--init_from=')] + ['--init_from=resume']
    launcher = ['python']
    if dist.is_initialized():  # a run on one machine gets its command; one on several, the torchrun it needs
        local = int(os.environ.get('LOCAL_WORLD_SIZE', world_size))
        launcher = ['torchrun', '--standalone', f'--nproc_per_node={world_size}'] if local == world_size else \
            ['torchrun', "<this run's torchrun options>"]
    return stopped + f"{out_dir}/{where} holds the run; resume with:\n{shlex.join(launcher + [sys.argv[0]] + args)}"
