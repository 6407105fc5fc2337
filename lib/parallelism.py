"""
Data parallelism on PyTorch's own engine: DDP (every rank holds the whole model and optimizer) or FSDP2
(`fully_shard`: every rank holds 1/world_size of each parameter, gradient and AdamW moment, and gathers a block's
weights just before it runs). The loop is the same for both; this file holds the process group (joined and left)
and the few places where they differ: wrapping, switching the gradient sync off between micro-batches, gathering the
weights for a rollout, and reading the sharded weights and optimizer state out for a checkpoint (and back in on
resume).
"""
import os
import signal
import sys
import time
import warnings
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


# FSDP and DTensor take 0.8 s to import, a third of train.py's start-up: only shard() and load_whole() import them.
# Until then no module can be an FSDPModule and no tensor a DTensor, so the checks look in the loaded modules only.
def _instance(x, module, name):
    return module in sys.modules and isinstance(x, getattr(sys.modules[module], name))


def sharded(model):
    return _instance(model, 'torch.distributed.fsdp', 'FSDPModule')


def is_dtensor(t):
    return _instance(t, 'torch.distributed.tensor', 'DTensor')


def shard(model, bf16=False):
    """Shard model in place with fully_shard: each block, then the root, which keeps the embeddings, the final norm
    and the output layer. With bf16 (on a GPU), FSDP gathers bf16 copies for compute and reduces gradients in float32
    into the float32 master shards. (DDP needs no such step: train.py wraps the model in DistributedDataParallel.)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    for method in ('generate', 'logprobs'):  # entry points besides forward: they gather the root's weights too
        register_fsdp_forward_method(model, method)
    # FSDP warns that an in-place op on a returned view would skip its backward hook; nothing here writes into the
    # log-probs model.forward returns (a view of the output layer's flat result)
    warnings.filterwarnings('ignore', message='FSDP2-wrapped module .* returned a view tensor')
    return model


def load_whole(model, read):
    """Copy whole tensors, read() -> a state dict (a Hugging Face checkpoint's), into model. Under FSDP only rank 0
    calls read(), and sends each tensor to the others, each rank keeping its shard: one copy in host memory, not one
    per rank."""
    if not sharded(model):
        model.load_state_dict(read())
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    set_model_state_dict(model, read() if dist.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _shard_from_rank0(model, device, bf16):
    """Shard model in place, each rank's shards sent by rank 0 (the others built it on the meta device)."""
    whole = model.state_dict() if dist.get_rank() == 0 else {}
    shard(model, bf16)
    load_whole(model.to_empty(device=device), lambda: whole)


def wrap(model, *, device, fsdp, bf16, compile, cuda_graphs=False):
    """The policy ready to train: under FSDP sharded in place, each rank's shards sent by rank 0 (the others built
    it on the meta device); compiled if asked; under torchrun with DDP, wrapped in DistributedDataParallel; on CUDA
    with cuda_graphs, generate's decode steps replayed as CUDA graphs (lib/cuda_graphs.py). Returns (the module the
    training forward calls, the model itself: what the sampler, the optimizer and checkpoints use)."""
    if fsdp:
        _shard_from_rank0(model, device, bf16)
    raw, on_cuda = model, 'cuda' in str(device)
    raw.decode_graphs = cuda_graphs and on_cuda
    if compile:
        model = torch.compile(model)  # the training forward, i.e. the log-prob path
        # generate's step, sampling included: one graph, except under FSDP, whose hooks around each block break it
        raw.decode = torch.compile(raw.decode, fullgraph=not fsdp)
    # not on a sampler rank (split), which is in no group of trainers
    if dist.is_initialized() and not fsdp and dist.get_rank(group) >= 0:
        model = DDP(model, device_ids=[torch.device(device).index] if on_cuda else None,
                    process_group=group)
    return model, raw


def frozen_copy(model, *, device, dtype, bf16, saved=None):
    """A frozen copy of model (the KL's reference policy), sharded like it under FSDP so that their state dicts match
    shard for shard; its weights from the checkpoint directory `saved` (read by rank 0 alone) or, without it, model's.
    A new module, not a deepcopy, which would share model's compiled decode step."""
    with torch.device('meta' if sharded(model) else device):  # FSDP: sharded before it takes any memory
        ref = type(model)(model.config).to(dtype=dtype).eval().requires_grad_(False)
    if sharded(model):
        shard(ref, bf16).to_empty(device=device)
    if saved:
        load_whole(ref, lambda: type(ref).from_pretrained(saved, dtype=dtype).state_dict())
    else:
        ref.load_state_dict(model.state_dict())
    return ref


def frozen(model, *, device, fsdp):
    """A model that is run but never trained (on-policy distillation's teacher), frozen, in its own dtype. Under FSDP
    sharded as wrap shards the policy (rank 0 read it), without mixed precision: each forward gathers one block at a
    time and frees it after, so no rank holds the whole model. Else whole on device."""
    model.eval().requires_grad_(False)
    if fsdp:
        _shard_from_rank0(model, device, bf16=False)
        # FSDP keeps the root's weights (the embeddings, the output layer) gathered after a forward, for the backward
        # that would follow; a frozen model runs none, so they would stay whole on every rank
        model.set_reshard_after_forward(True)
    else:
        model.to(device)
    return model


@torch.no_grad()
def blend(ref, model, alpha):
    """ref = alpha * model + (1 - alpha) * ref, parameter by parameter (alpha 1 copies); under FSDP shard by shard,
    as frozen_copy shards ref like model."""
    for r, p in zip(ref.parameters(), model.parameters()):
        r.lerp_(p, alpha)


def set_grad_sync(model, on):
    """Reduce gradients across ranks (DDP's all-reduce, FSDP's reduce-scatter) only on the last micro-batch of a step:
    the earlier ones accumulate locally."""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = on
    elif sharded(model):
        model.set_requires_gradient_sync(on)


@contextmanager
def gathered(*models):
    """Under FSDP, each model's full weights for the duration: gathered once (not once per decode step, which is what
    FSDP's per-block hooks would do in generate's loop), and sharded again after. A no-op for unsharded models."""
    models = [m for m in {id(m): m for m in models if m is not None and sharded(m)}.values()]  # LoRA: ref is model
    fsdp = [m for model in models for m in model.modules() if sharded(m)]
    for m in fsdp:
        m.unshard()
    blocks = [m for model in models for m in model.transformer.h]
    for b in blocks:  # a block's post-forward hook would free its gathered weights
        b.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for b in blocks:
            b.set_reshard_after_forward(True, recurse=False)
        for m in fsdp:
            m.reshard()


def full(t):
    """The whole tensor of a possibly sharded one (a collective under FSDP: every rank must call it)."""
    return t.full_tensor() if is_dtensor(t) else t


def _local(t):
    """This rank's part of a possibly sharded tensor."""
    return t.to_local() if is_dtensor(t) else t


def full_state_dict(model, keep):
    """model's state dict as whole CPU tensors where keep (rank 0), {} elsewhere; gathered one tensor at a time, so a
    rank never holds more than one gathered tensor beyond the CPU copy it keeps. A tensor under two names (tied
    embeddings) is gathered once."""
    out, seen = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            whole = full(t.detach())  # every rank takes part in the gather
            seen[id(t)] = whole.cpu() if keep else None
        if keep:
            out[name] = seen[id(t)]
    return out


def local_state(optimizer):
    """This rank's part of the optimizer state: {'index.key': tensor}, the local shard of sharded moments."""
    return {f"{i}.{k}": _local(v).contiguous()
            for i, s in optimizer.state_dict()['state'].items() for k, v in s.items()}


def to_params(state, optimizer):
    """Inverse of local_state for load_state_dict: each moment of a sharded parameter becomes a DTensor shard like
    that parameter's."""
    params = [p for g in optimizer.param_groups for p in g['params']]
    for i, s in state.items():
        p = params[i]
        for k, v in s.items():
            if is_dtensor(p) and v.dim() > 0:
                s[k] = type(p).from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False,
                                          shape=p.shape, stride=p.stride())
    return state


# The ranks that train, which the collectives below run over: all of them (None), or
# with sampler ranks the group of the others (split), of which a sampler rank is no member.
group = None


def init(device):
    """Under torchrun (RANK set), join the process group, gloo on the CPU, nccl for CUDA tensors (with gloo for the
    small CPU ones), and take this rank's GPU. Returns (distributed, rank, world_size, device), device 'auto' made
    'cuda' or 'cpu'."""
    global group
    torch.backends.cuda.matmul.allow_tf32 = True  # CUDA float32 matmuls in TF32
    torch.backends.cudnn.allow_tf32 = True
    # every rank trains until split() says otherwise (a test runs train.py many times in
    # one process)
    group = None
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if int(os.environ.get('RANK', -1)) == -1:
        return False, 0, 1, device
    use_cuda = torch.cuda.is_available() and device != 'cpu'
    dist.init_process_group(backend='cpu:gloo,cuda:nccl' if use_cuda else 'gloo')
    if use_cuda:
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    return True, dist.get_rank(), dist.get_world_size(), device


def split(sampler_ranks):
    """The last sampler_ranks ranks only sample (lib/stream.py), the first ones train:
    their collectives (gradients, sums, votes, barriers) go over a group of their own
    from now on. Every rank calls it. Returns (the trainers' number, the group over
    which trainer 0 sends the samplers the weights)."""
    global group
    world = dist.get_world_size()
    trainers = world - sampler_ranks
    # new_group is a collective: every rank makes both, in the same order
    train = dist.new_group(list(range(trainers)))
    # the samplers wait in it through the trainers' warm start and evaluations, which
    # can take longer than gloo's 30 minutes
    weights = dist.new_group([0, *range(trainers, world)], timeout=timedelta(days=1))
    if dist.get_rank() >= trainers:
        # a stop is the trainers' to decide: they save, then tell the samplers (a
        # rollout a signal cut short could be one they must save)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    group = train
    return trainers, weights


def gather(t):
    """Concatenate a tensor across the training ranks along dim 0 (identity on one
    process). Every rank holds equal rows."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def all_sum(t):
    """Sum a tensor over the training ranks, in a copy (identity on one process)."""
    t = t.clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def all_finite(norm):
    """(norm, finite): the whole gradient norm (FSDP's is a DTensor) and whether it is finite on every rank, so
    that a NaN on one rank skips the step on all of them."""
    norm = full(norm)
    return norm, all_sum(torch.tensor(float(not torch.isfinite(norm)))).item() == 0


def check_replicas(model, it):
    """DDP's ranks must hold the same weights: a cheap checksum of each parameter, compared over ranks, catches a
    silent divergence before it is saved (FSDP's ranks hold different shards: nothing to compare)."""
    if sharded(model):
        return
    sums = gather(torch.stack([p.double().sum() + (p.double() ** 2).sum() for p in model.parameters()])[None])
    if not torch.equal(sums.min(0).values, sums.max(0).values):
        raise RuntimeError(f"iteration {it}: the ranks' parameters differ (checksums {sums.sum(1).tolist()}); not "
                           f"saving. This is a bug or a hardware fault; resume from the last checkpoint")


def peer_gone(error):
    """Whether error is a collective failing because another rank is gone (its process died or
    its connection broke): gloo's transport errors, torch's network ones. Not this rank's bug."""
    return isinstance(error, dist.DistNetworkError) or (
        isinstance(error, RuntimeError) and '/gloo/transport/' in str(error))


def from_rank0(obj):
    """Rank 0's obj on every rank, samplers included (a small picklable value; the ranks'
    own one when not distributed)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier():
    """Wait for every training rank."""
    if dist.is_initialized():
        dist.barrier(group=group)


def end(code=0):
    """Leave the process group and exit with code, skipping the interpreter's shutdown: after the last collective a
    gloo worker thread frees that work only once it has woken the main thread, and the free takes the GIL, so if the
    interpreter is shutting down by then the thread dies inside the destructor and the rank aborts ("terminate called
    without an active exception", SIGABRT; torch 2.13, pytorch/pytorch#190489; about 1 launch in 300 under the tests'
    load, 1 in 20 for a bare DDP script). Everything is written and closed by the time the loop calls this. On one
    process: SystemExit(code) where code is not 0."""
    if not dist.is_initialized():
        if code:
            raise SystemExit(code)
        return
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -----------------------------------------------------------------------------
# stopping: SIGTERM (what SLURM and Kubernetes send before a kill) or Ctrl-C asks the run to stop.
# The long phases look at the flag (the warm start's steps, an evaluation's chunks, generate's
# decode steps, the update until its first optimizer step), so train.py saves the state before the
# iteration and exits within seconds. A second signal exits at once, or, while a checkpoint is being
# written (writing()), once its files are complete: the writes are atomic, so the last checkpoint
# is whole either way. A repeat within a second is the same request delivered twice: the terminal
# sends Ctrl-C to every process and torchrun forwards what it gets to its workers.
asked = dict(signal=0, time=0.0, writing=False, exit=0)


def _say(text):
    """Rank 0's line on stderr from a signal handler: os.write, since a print there could re-enter
    one in progress."""
    if os.environ.get('RANK', '0') == '0':
        os.write(2, f"{text}\n".encode())


def _on_signal(signum, frame):
    name = signal.Signals(signum).name
    if asked['signal'] and time.time() - asked['time'] > 1.0:
        if not asked['writing']:
            os._exit(128 + signum)
        asked['exit'] = signum
        _say(f"{name} again: exiting once the checkpoint being written is complete")
    if not asked['signal']:
        asked.update(signal=signum, time=time.time())
        _say(f"{name}: stopping, after a checkpoint where there is one to save (a second {name} "
             f"exits at once, the last checkpoint whole)")


def catch_stop_signals():
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)


def stopping():
    """Whether this process got a stop signal: a phase whose result the stop drops may end early
    on it (each rank on its own, so only between its collectives)."""
    return asked['signal'] != 0


def stop_requested():
    """The signal any training rank got since catch_stop_signals (0: none), the same on every
    one: every one must call it at the same point."""
    sig = torch.tensor(asked['signal'])
    if dist.is_initialized():
        dist.all_reduce(sig, op=dist.ReduceOp.MAX, group=group)
    return sig.item()


@contextmanager
def writing():
    """Files written inside are finished before a second stop signal exits: then at its end."""
    asked['writing'] = True
    try:
        yield
    finally:
        asked['writing'] = False
    if asked['exit']:
        sys.stdout.flush()
        os._exit(128 + asked['exit'])
