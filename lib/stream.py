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
"""
import torch

from lib.errors import ConfigError


class Stream:

    def __init__(self, sample, *, max_staleness, seed_of, saved=None):
        """sample(it=j) -> (groups, info): rollout.rollout's of iteration j, with the weights
        as they are at the call. seed_of(j): iteration j's seed of the global generator
        (train.py's: rollout.prompt_seed of the run's seed, j and the rank). saved: a
        checkpoint's tensors (checkpoint.load_stream)."""
        self.sample, self.K, self.seed_of = sample, max_staleness, seed_of
        self.rollouts = rollouts_of(saved or {})
        for j, (groups, _) in self.rollouts.items():
            version = groups[0]['version']
            if j - version > max_staleness:
                raise ConfigError(
                    f"the checkpoint holds iteration {j}'s groups, sampled by version "
                    f"{version}: resume with max_staleness >= {j - version}")

    def take(self, it):
        """The groups and info iteration it trains on, with their staleness in info['stale'],
        after sampling ahead, with the weights as they are now (version it), the iterations
        up to it + K not in flight yet (K + 1 of them at the start, then one)."""
        self.rollouts = {j: r for j, r in self.rollouts.items() if j >= it}
        for j in range(it, it + self.K + 1):
            if j not in self.rollouts:
                # an iteration's randomness is its own, however far ahead it is drawn
                torch.manual_seed(self.seed_of(j))
                groups, info = self.sample(it=j)
                self.rollouts[j] = [dict(g, version=it) for g in groups], info
        torch.manual_seed(self.seed_of(it))
        groups, info = self.rollouts[it]
        stale = [it - group['version'] for group in groups]
        # admission makes this impossible: a bug if not
        assert max(stale) <= self.K, (it, stale)
        stale = {'stale/mean': sum(stale) / len(stale), 'stale/max': max(stale)}
        return groups, dict(info, stale=stale)

    def tensors(self, it):
        """What a checkpoint before iteration it keeps: the rollouts in flight for iterations
        it on that an older version sampled, as tensors ('j.g.key': group g of iteration j,
        'j.time.phase', 'j.info.dropped_groups'); the others are drawn again on resume."""
        out = {}
        for j, (groups, info) in self.rollouts.items():
            if j < it or groups[0]['version'] >= it:
                continue
            out[f'{j}.info.dropped_groups'] = torch.tensor(info['dropped_groups'])
            for phase in ('generate', 'reward'):
                out[f'{j}.time.{phase}'] = torch.tensor(info['time'][phase],
                                                          dtype=torch.float64)
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


def line(m):
    """What an iteration's log line adds: the staleness (mean/max) and the share of tokens
    whose correction weight was clipped."""
    clipped = f" clipped {m['stale/clipped']:.3f}" if 'stale/clipped' in m else ''
    return f" | stale {m['stale/mean']:.1f}/{m['stale/max']:.0f}{clipped}"
