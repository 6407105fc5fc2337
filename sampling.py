"""
Sampling: one token per row of logits, drawn exactly from the temperature softmax
restricted by top-k/top-p, with the log-prob the trainer computes for it, at every step
of GPT.generate's plain loop and of engine.py's.
"""
import math

import torch

from lib.errors import ConfigError
from lib.truncation import candidates


def check_sampling(top_k, top_p):
    """The one check of the sampler's restrictions, for the config and for generate()
    alike."""
    if top_k is not None and (not isinstance(top_k, int)
                              or isinstance(top_k, bool) or top_k < 1):
        raise ConfigError(f"top_k={top_k!r} must be None or an int > 0")
    if top_p is not None and (isinstance(top_p, bool) or not 0 < top_p <= 1):
        raise ConfigError(f"top_p={top_p!r} must be None or in (0, 1]")


def check_generate(model, prompts, max_new_tokens, *, num_samples=1,
                   temperature=1.0, top_k=None, top_p=None, eos_id=None,
                   turns=None):
    """GPT.generate's arguments (its docstring says what each means), checked once by
    its caller, not by generate on every call; each prompt with max_new_tokens must fit
    the model (GPT.check_length)."""
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: generate needs at least one "
                             f"prompt token to condition on")
        model.check_length(len(p) + max_new_tokens,
                           f"prompt {i} ({len(p)} tokens) + max_new_tokens "
                           f"({max_new_tokens})")
    if turns is not None and eos_id is None:
        raise ValueError("turns needs eos_id: a turn ends where a row samples one of "
                         "those ids; pass them as eos_id")
    if not prompts or max_new_tokens < 1 or num_samples < 1 or temperature < 0:
        raise ValueError("generate needs at least one prompt, max_new_tokens >= 1, "
                         "num_samples >= 1 and temperature >= 0")
    check_sampling(top_k, top_p)


def eos_tensor(eos_id, device):
    """generate's eos_id (None, one id or several) as a sorted tensor of ids, None for
    none: the smallest is what a finished row holds after its end."""
    if eos_id is None:
        return None
    return torch.tensor(sorted({eos_id} if isinstance(eos_id, int) else set(eos_id)),
                        device=device)


def sample(logits, temperature=1.0, top_k=None, top_p=None, u=None):
    """Draw one token per row of logits (B, V) from softmax(logits / temperature),
    restricted to the top_k most likely tokens and then to the smallest set of them
    holding top_p of their mass (lib/truncation.py), and return (tokens (B,) long,
    log-probs (B,) float32). The log-prob is under the distribution the token was drawn
    from: the temperature softmax, renormalised over the kept tokens when top_k or top_p
    restricts them (log q), the number the trainer's logprobs() computes with the same
    top_k and top_p. temperature=0 is greedy (log-probs of the full softmax at
    temperature 1). top_p without top_k sorts the whole vocabulary, which is slow on
    CPU; a top_k as well keeps it cheap. u (B, 2): the two uniforms in [0, 1) each row's
    draw uses; by default from torch's global generator."""
    x = logits.float()
    u = torch.rand(x.size(0), 2, device=x.device) if u is None else u
    if temperature not in (0, 1):
        x = x / temperature
    # (B, V) one fused pass, where an exp of its own would be a pass more
    p = torch.softmax(x, -1)
    if temperature == 0:
        tok = x.argmax(-1, keepdim=True)
    elif top_k is None and top_p is None:
        tok = _draw(p, u)
    else:
        # drawn among the kept tokens, and its log q: its weight over theirs
        w, idx = candidates(p, top_k, top_p)  # (B, k)
        at = _draw(w, u)  # (B, 1)
        q = w.gather(1, at) / w.sum(-1, keepdim=True)  # (B, 1)
        return idx.gather(1, at).squeeze(1), q.log().squeeze(1)
    return tok.squeeze(1), p.gather(1, tok).log().squeeze(1)


def draw_uniforms(generator, steps, n_prompts, samples_per_prompt, device):
    """Every uniform a generate call's sampler uses, (steps, N, 2): two per row and
    step (see _draw), drawn up front. generator: one torch.Generator for all rows, or a
    list of one per prompt, whose rows' draws then depend on nothing else, so that a
    prompt gets the same samples alone or in any batch."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != n_prompts:
            raise ValueError(f"{len(generator)} generators for {n_prompts} prompts; "
                             f"give one per prompt")
        return torch.cat([torch.rand(steps, samples_per_prompt, 2, device=device,
                                     generator=g)
                          for g in generator], 1)
    return torch.rand(steps, n_prompts * samples_per_prompt, 2, device=device,
                      generator=generator)


def _draw(w, u):
    """Exact inverse-CDF draw of one index (B, 1) per row of nonnegative weights w
    (B, V), by the uniforms u (B, k): the index i with cdf[i-1] <= u * total < cdf[i],
    so entries of zero mass are never hit. One uniform: one search of w's cumsum. Two:
    a cumsum over the whole vocabulary is slow (it is sequential), so a block of
    ~sqrt(V) tokens is drawn by its mass, then a token inside the block by its weight,
    each by its own uniform: two short cumsums instead of one over V (torch.multinomial
    is much slower still: docs/performance.md)."""
    if u.size(1) == 1:
        cdf = w.cumsum(-1)
        total = cdf[:, -1:].contiguous()  # (B, 1)
        i = torch.searchsorted(cdf, u * total, right=True)
        # u * total can round up to total: then take the last entry with positive mass
        return torch.minimum(i, torch.searchsorted(cdf, total))
    B, V = w.shape
    bs = math.isqrt(V - 1) + 1  # block size
    full = V // bs * bs
    # (B, nb)
    mass = torch.cat([w[:, :full].view(B, -1, bs).sum(-1),
                      w[:, full:].sum(-1, keepdim=True)], 1)
    block = _draw(mass, u[:, :1])  # (B, 1)
    # (B, bs) the block's token ids
    cols = block * bs + torch.arange(bs, device=w.device)
    # (B, bs) the last block may be short
    inside = w.gather(1, cols.clamp(max=V - 1)).masked_fill(cols >= V, 0.0)
    return block * bs + _draw(inside, u[:, 1:])
