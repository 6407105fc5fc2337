"""
Training up to K policy versions behind, on one process (max_staleness = K > 0; issue 57).

Sampling runs K iterations ahead of training. Iteration `it` trains on the groups that the
policy sampled as it was before iteration it - K (their version), and first samples the
groups of iteration it + K with the weights it holds now: K rollouts are in flight between
the two. Each group carries its version; a rollout is sampled no further ahead than K
(admission), so none is trained on more than K versions after the one that sampled it, and
none is dropped. The first K iterations train on rollouts of version 0 (the warm-up); from
iteration K on every one is exactly K versions old.

One thread, in a fixed order (sample ahead, then train): on a CPU the sampler and the trainer
share the same cores, so threads would overlap nothing, and the run would depend on the
order the OS ran them in (docs/async.md). Each rollout is the one rollout.py draws for its
iteration (its seeds are the iteration's and the prompt's), drawn by older weights. With
K = 0 train.py does not use the stream at all: its loop is the synchronous one.

A checkpoint before iteration it holds the rollouts in flight that an older version sampled,
as tensors (checkpoint.save's stream.rank{r}.safetensors: each rank has its own queue);
those the saved weights sampled are drawn again on resume, from their seeds: the same groups.

With sampler_ranks = N under torchrun the same schedule runs on two kinds of rank: the last N
only sample (serve), the others only train (Stream with a Link). When trainer rank r takes
iteration it, trainer 0 sends version it's weights to the samplers (a broadcast); the sampler
rank serving r draws iteration it + K for it with them, as the one process would, and sends
the groups back as tensors, while r trains on iteration it. The same versions sample the same
iterations, from the same seeds: the run is the one-process stream's, bit for bit.
"""
import functools
import json
import math
import time

import torch
import torch.distributed as dist

from lib import parallelism
from lib.errors import ConfigError


class Stream:

    def __init__(self, sample, *, max_staleness, seed_of, saved=None, link=None):
        """sample(it=j) -> (groups, info): rollout.rollout's of iteration j, with the weights
        as they are at the call. seed_of(j): iteration j's seed of the global generator
        (train.py's: rollout.prompt_seed of the run's seed, j and the rank). saved: a
        checkpoint's tensors (checkpoint.load_stream). link: with sampler ranks, this
        trainer's Link: a sampler rank draws the rollouts instead."""
        self.sample, self.K, self.seed_of = sample, max_staleness, seed_of
        self.rollouts = in_flight(saved, max_staleness)
        # the iterations the sampler rank was asked for and has not sent yet, in order
        self.link, self.coming = link, []

    def take(self, it):
        """The groups and info iteration it trains on, with their staleness in info['stale'],
        after sampling ahead, with the weights as they are now (version it), the iterations
        up to it + K not in flight yet (K + 1 of them at the start, then one)."""
        self.rollouts = {j: r for j, r in self.rollouts.items() if j >= it}
        if self.link:
            self.link.send_weights(version=it)
        since = time.perf_counter()
        for j in range(it, it + self.K + 1):
            if j in self.rollouts or j in self.coming:
                continue
            if self.link:
                # the sampler rank draws it with the weights just sent
                self.coming.append(j)
                continue
            # an iteration's randomness is its own, however far ahead it is drawn
            torch.manual_seed(self.seed_of(j))
            groups, info = self.sample(it=j)
            self.rollouts[j] = [dict(g, version=it) for g in groups], info
        self.fetch(it)
        torch.manual_seed(self.seed_of(it))
        groups, info = self.rollouts[it]
        stale = [it - group['version'] for group in groups]
        # admission makes this impossible: a bug if not
        assert max(stale) <= self.K, (it, stale)
        stale = {'stale/mean': sum(stale) / len(stale), 'stale/max': max(stale)}
        if self.link:
            # a copy: make_batch adds its phases to the time it is given
            waited = time.perf_counter() - since
            info = dict(info, time=dict(info['time'], wait_groups=waited))
        return groups, dict(info, stale=stale)

    def fetch(self, upto):
        """Receive from the sampler rank, in the order it sends them, the rollouts asked for up
        to iteration upto (all of them: math.inf)."""
        while self.coming and self.coming[0] <= upto:
            j = self.coming.pop(0)
            got = self.link.receive()
            # one sampler rank sends one trainer's rollouts in the order asked: a bug if not
            assert list(got) == [j], (j, list(got))
            self.rollouts.update(got)

    def close(self, code):
        """With sampler ranks, at the end: receive what they were asked for (so their sends
        end), then trainer 0 tells them to exit with code."""
        if self.link:
            self.fetch(math.inf)
            self.link.close(code)

    def tensors(self, it):
        """What a checkpoint before iteration it keeps: the rollouts in flight for iterations
        it on that an older version sampled, as tensors (flat's); the others are drawn again on
        resume. With sampler ranks, all it asked them for first: those older versions sampled
        are among them."""
        if self.link:
            self.fetch(math.inf)
        out = {}
        for j, (groups, info) in self.rollouts.items():
            if j >= it and groups[0]['version'] < it:
                out.update(flat(j, groups, info))
        return out


def in_flight(saved, max_staleness):
    """A checkpoint's rollouts in flight (Stream.tensors'), refused if a run with this K would
    train on one of them more than K versions after it was sampled."""
    rollouts = rollouts_of(saved or {})
    for j, (groups, _) in rollouts.items():
        version = groups[0]['version']
        if j - version > max_staleness:
            raise ConfigError(
                f"the checkpoint holds iteration {j}'s groups, sampled by version "
                f"{version}: resume with max_staleness >= {j - version}")
    return rollouts


def flat(j, groups, info):
    """Iteration j's rollout as tensors: 'j.g.key' (group g's), 'j.time.phase' (the sampler's
    seconds), 'j.info.dropped_groups'."""
    out = {f'{j}.info.dropped_groups': torch.tensor(info['dropped_groups'])}
    # the sampler's phases (make_batch adds its own to the info it is given)
    for phase in ('generate', 'reward', 'wait_weights'):
        if phase in info['time']:
            out[f'{j}.time.{phase}'] = torch.tensor(info['time'][phase], dtype=torch.float64)
    for g, group in enumerate(groups):
        for key, value in group.items():
            # a tensor of its own: safetensors refuses views of one storage
            value = torch.as_tensor(value).cpu()
            out[f'{j}.{g}.{key}'] = value.clone(memory_format=torch.contiguous_format)
    return out


def rollouts_of(tensors):
    """Stream.tensors' tensors back into {iteration: (groups, info)}."""
    entries = {}
    for key, value in tensors.items():
        j, part, name = key.split('.')
        entries.setdefault(int(j), {}).setdefault(part, {})[name] = value
    rollouts = {}
    for j, parts in entries.items():
        times = {phase: t.item() for phase, t in parts.pop('time').items()}
        info = dict(time=times, dropped_groups=int(parts.pop('info')['dropped_groups']))
        groups = [parts[g] for g in sorted(parts, key=int)]
        for group in groups:
            group.update(prompt=group['prompt'].tolist(), version=int(group['version']))
        rollouts[j] = groups, info
    return rollouts


# -----------------------------------------------------------------------------
# sampler_ranks = N: the last N ranks sample, the others train. Each sampler rank serves
# whole trainer ranks (trainer r: sampler trainers + r % N). What goes over the wire: the
# weights, from trainer 0 to every sampler rank (a broadcast on their group, after a header
# [version, exit code]: version -1 = stop); each rollout, from its sampler to its trainer
# (flat's tensors, sent as bytes after a JSON header of their names, dtypes and shapes).

def sampler_of(r, sampler_ranks):
    """The sampler rank that serves trainer rank r."""
    return dist.get_world_size() - sampler_ranks + r % sampler_ranks


def trainable(model):
    """The weights that change, those the samplers need: all of them, or LoRA's adapters."""
    return [p for p in model.parameters() if p.requires_grad]


class Link:
    """A trainer rank's side: trainer 0 sends each version's weights to the sampler ranks,
    every trainer receives its rollouts from the sampler rank that serves it."""

    def __init__(self, model, *, group, sampler_ranks):
        self.model, self.group = model, group
        self.sends = dist.get_rank() == 0
        self.source = sampler_of(dist.get_rank(), sampler_ranks)
        # trainer 0's broadcasts under way, with their buffers, which must live until they end
        self.sending = []

    def send_weights(self, version, code=0):
        """Trainer 0: start sending version's weights (a copy, so the update can go on), or
        (version -1) the exit code the samplers stop with. The samplers take them in order,
        each when done with the rollouts of the version before: the trainers wait only for
        the groups they need, which versions up to K iterations older drew."""
        if not self.sends:
            return
        buffers = [torch.tensor([version, code])]
        if version >= 0:
            buffers.append(torch.cat([p.detach().reshape(-1).view(torch.uint8)
                                      for p in trainable(self.model)]))
        works = [dist.broadcast(b, src=0, group=self.group, async_op=True) for b in buffers]
        self.sending = unfinished(self.sending) + [(works, buffers)]

    def close(self, code):
        """Trainer 0: tell the samplers to exit with code, and wait until they have taken
        every version."""
        self.send_weights(version=-1, code=code)
        wait(self.sending)

    def receive(self):
        """The next rollout the sampler rank sent: {iteration: (groups, info)}."""
        sizes = torch.empty(2, dtype=torch.long)
        dist.recv(sizes, src=self.source)
        header = torch.empty(int(sizes[0]), dtype=torch.uint8)
        dist.recv(header, src=self.source)
        data = torch.empty(int(sizes[1]), dtype=torch.uint8)
        dist.recv(data, src=self.source)
        names = json.loads(header.numpy().tobytes())
        tensors = {name: torch.empty(shape, dtype=getattr(torch, dtype))
                   for name, dtype, shape in names}
        fill(tensors.values(), data)
        return rollouts_of(tensors)


def fill(tensors, data):
    """Copy the bytes data into tensors, one after the other, as the sender laid them out."""
    at = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel() * t.element_size()
            t.view(-1).view(torch.uint8).copy_(data[at:at + n])
            at += n


def send(tensors, dst):
    """Start sending flat's tensors to rank dst; returns the sends and their buffers, which
    must live until the sends are done (the trainer receives when it needs them)."""
    names = [[k, str(t.dtype).removeprefix('torch.'), list(t.shape)]
             for k, t in tensors.items()]
    header = torch.frombuffer(bytearray(json.dumps(names).encode()), dtype=torch.uint8)
    data = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])
    buffers = torch.tensor([len(header), len(data)]), header, data
    return [dist.isend(b, dst=dst) for b in buffers], buffers


def unfinished(sending):
    """The sends (works, buffers) under way: the buffers of the others are free."""
    return [(works, buffers) for works, buffers in sending
            if not all(w.is_completed() for w in works)]


def wait(sending):
    """Until the sends (works, buffers) end."""
    for works, _ in sending:
        for w in works:
            w.wait()


def receive_weights(model, group):
    """A sampler rank: trainer 0's header and, unless it says stop, the weights into model.
    Returns (version, exit code)."""
    header = torch.empty(2, dtype=torch.long)
    dist.broadcast(header, src=0, group=group)
    version, code = header.tolist()
    if version >= 0:
        params = trainable(model)
        size = sum(p.numel() * p.element_size() for p in params)
        data = torch.empty(size, dtype=torch.uint8, device=params[0].device)
        dist.broadcast(data, src=0, group=group)
        fill(params, data)
    return version, code


def start(sample, *, model, rank, cfg, seed_of, saved, group):
    """This rank's Stream (K = cfg.max_staleness); with cfg.sampler_ranks, a sampler rank
    serves the trainers instead and exits. sample(it=j, rank=r): rank r's rollout of
    iteration j, with the weights model holds then. seed_of(j, r): its seed of the global
    generator. saved(r): rank r's rollouts in flight in the checkpoint resumed, if any
    (checkpoint.load_stream). group: the samplers' and trainer 0's (parallelism.split)."""
    K, N = cfg.max_staleness, cfg.sampler_ranks
    # the trainers are the first cfg.world_size ranks
    if rank >= cfg.world_size:
        serve(sample, model=model, group=group, sampler_ranks=N, max_staleness=K,
              seed_of=seed_of, saved=saved)
    link = Link(model, group=group, sampler_ranks=N) if N else None
    return Stream(functools.partial(sample, rank=rank), max_staleness=K,
                  seed_of=lambda j: seed_of(j, rank), saved=saved(rank), link=link)


def serve(sample, *, model, group, sampler_ranks, max_staleness, seed_of, saved):
    """A sampler rank's whole run: for each version trainer 0 sends, the rollouts of
    iterations version..version + K its trainers do not hold yet, each drawn with those
    weights as the one-process Stream draws it (seeded by seed_of(j, r)), and sent to its
    trainer; then, told to stop, exit with the trainers' code. sample(it=j, rank=r): trainer
    r's rollout of iteration j. saved(r): trainer r's rollouts in flight in the checkpoint
    the run resumes (checkpoint.load_stream), not drawn again."""
    trainers = dist.get_world_size() - sampler_ranks
    mine = [r for r in range(trainers) if sampler_of(r, sampler_ranks) == dist.get_rank()]
    held = {r: set(in_flight(saved(r), max_staleness)) for r in mine}
    sending = []
    while True:
        since = time.perf_counter()
        version, code = receive_weights(model, group)
        if version < 0:
            break
        # the idle time before this version's rollouts, logged with the first of them
        waited = time.perf_counter() - since
        for j in range(version, version + max_staleness + 1):
            for r in (r for r in mine if j not in held[r]):
                torch.manual_seed(seed_of(j, r))
                groups, info = sample(it=j, rank=r)
                groups = [dict(g, version=version) for g in groups]
                info = dict(info, time=dict(info['time'], wait_weights=waited))
                sending.append(send(flat(j, groups, info), dst=r))
                held[r].add(j)
                waited = 0.0
        held = {r: {j for j in js if j >= version} for r, js in held.items()}
        sending = unfinished(sending)
    # the trainers receive every rollout before they stop the samplers
    wait(sending)
    parallelism.end(code)


def line(m):
    """What an iteration's log line adds: the staleness (mean/max) and the share of tokens
    whose correction weight was clipped; with sampler ranks, the share of the iteration the
    trainer waited for its groups, and of its sampler's time spent waiting for weights."""
    clipped = f" clipped {m['stale/clipped']:.3f}" if 'stale/clipped' in m else ''
    out = f" | stale {m['stale/mean']:.1f}/{m['stale/max']:.0f}{clipped}"
    if 'time/wait_groups' in m:
        out += f" | idle: trainer {m['time/wait_groups'] / m['dt']:.0%}"
    # a rollout a one-process run left in its checkpoint has no sampler's wait
    if 'time/wait_weights' in m:
        waited = m['time/wait_weights']
        busy = waited + m['time/generate'] + m['time/reward']
        out += f", sampler {waited / busy:.0%}"
    return out
