"""
The sampling engine behind GPT.generate: G completions per prompt from a static KV cache, each prompt prefilled
once straight into the cache rows of its samples (as nanochat's engine does), then every row decoded together one
token a step with GPT.decode, each row's token going into its own next cache column (rows are level, except that a
multi-turn row jumps ahead by each observation it reads in).

The cache is allocated once for a call's batch and sequence and never moved (finished rows are dropped by copying
the live ones into its first rows), and freed when the call returns, leaving its memory to the update. With
model.decode_graphs (train.py's cuda_graphs) the steps are replayed as CUDA graphs instead (lib/cuda_graphs.py), and
the cache is kept across calls, grown to the largest batch and sequence seen, since a graph reads the addresses it was
captured with.
"""
import contextlib
import weakref

import torch

from sampling import check_sampling, sample
from lib import cuda_graphs, multiturn

_CACHES = weakref.WeakKeyDictionary()  # model -> its static cache: off the module, so state_dict and deepcopy skip it


@torch.no_grad()
def generate(model, prompts, max_new_tokens, *, num_samples=1, temperature=1.0, top_k=None, top_p=None, eos_id=None,
             generator=None, turns=None, turn_workers=1):
    """GPT.generate: sample num_samples completions for each prompt (a list of token-id lists of any lengths).
    Returns (tokens, mask, logprobs), each (N, L) with N = len(prompts) * num_samples rows in prompt-major order
    and L <= max_new_tokens the steps taken. eos_id: one id or several (Qwen's instruct models stop on <|im_end|>
    and <|endoftext|>). A row ends at its first eos, which it keeps; after it tokens are the smallest eos id (0 if
    None), mask is False and logprobs 0. logprobs: each token's under the distribution it was drawn from (see
    sample), as logprobs() computes it with the same top_k and top_p. temperature=0 is greedy, with log-probs at
    temperature 1. generator: one torch.Generator for the whole batch, or a list of one per prompt, whose draws
    then depend on nothing else: a prompt gets the same samples alone or in any batch.
    turns (multi-turn): called as turns(row, ids) when a row samples an eos id, with the row's tokens so far;
    it returns the token ids of an observation to append (the row then goes on) or None (the row ends). The
    observation's tokens are in tokens, with mask False and logprobs 0: context, not the policy's actions. The
    calls of one step run in turn_workers threads (the observations in row order), for a turns that depends on
    its arguments alone.

    The loop is engine.py's: each prompt prefilled once, straight into the cache rows of its samples,
    right-aligned so that the rows decode level (a per-row key mask hides the left padding), in a static cache
    the model keeps across calls; an observation is read into its row's cache in one forward of its tokens.
    """
    lengths = [len(p) for p in prompts]
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"prompt {i} is empty: generate needs at least one prompt token to condition on")
        model.check_length(n + max_new_tokens, f"prompt {i} ({n} tokens) + max_new_tokens ({max_new_tokens})")
    if turns is not None and eos_id is None:
        raise ValueError("turns needs eos_id: a turn ends where a row samples one of those ids; pass them as eos_id")
    if not prompts or max_new_tokens < 1 or num_samples < 1 or temperature < 0:
        raise ValueError("generate needs at least one prompt, max_new_tokens >= 1, num_samples >= 1 and "
                         "temperature >= 0")
    check_sampling(top_k, top_p)
    was_training = model.training
    model.eval()
    try:
        with multiturn.observer(turns, turn_workers) as observe, cast_once(model):  # observe None: one turn
            return _generate(model, prompts, max_new_tokens, num_samples, temperature, top_k, top_p, eos_id, generator,
                             observe)
    finally:
        model.train(was_training)
        if not model.decode_graphs:  # only the graphs need the cache where it was
            _CACHES.pop(model, None)


@contextlib.contextmanager
def cast_once(model):
    """Under autocast, each weight cast to bf16 once a call, not once a step: autocast keeps its casts (until its
    block ends) of parameters that require grad only, so a frozen one (LoRA's base, its output layer most of all)
    is marked as one meanwhile; under no_grad that builds no graph, and changes no number."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def static_cache(model, N, S, dtype, device):
    """The model's KV cache with at least N rows and S columns: per layer keys and values (rows, nkv, cols, hs),
    and a key mask (rows, cols). With graphs, kept for the next call and grown (to the largest rows and columns
    asked so far; cuda_graphs keeps its graphs in it, so they go with it) only when a call needs more. Zeros, not
    empty: masked columns get attention weight 0, and 0 * NaN garbage would still be NaN; after that only the
    model's own keys and values are written."""
    cfg, c = model.config, _CACHES.get(model)
    if c is None or c["kv"][0][0].shape[0] < N or c["kv"][0][0].shape[2] < S or c["kv"][0][0].dtype != dtype or \
            c["kv"][0][0].device != device:
        rows, cols = (N, S) if c is None else (max(N, c["mask"].shape[0]), max(S, c["mask"].shape[1]))
        _CACHES.pop(model, None)  # free the old one before allocating the new
        c = _CACHES[model] = dict(
            kv=[[torch.zeros(rows, cfg.n_kv_head, cols, cfg.head_dim, dtype=dtype, device=device) for _ in "kv"]
                for _ in range(cfg.n_layer)], mask=torch.zeros(rows, cols, dtype=torch.bool, device=device))
    return c


def _generate(model, prompts, max_new_tokens, G, temperature, top_k, top_p, eos_id, generator, turns):
    cfg, dev = model.config, model.lm_head.weight.device
    dtype = model.compute_dtype()
    N, P = len(prompts) * G, max(len(p) for p in prompts)
    S = P + max_new_tokens - 1  # the last sampled token is never fed back
    cache = static_cache(model, N, S, dtype, dev)
    kv = [(k[:N], v[:N]) for k, v in cache["kv"]]  # each layer's keys and values (N, nkv, cols, hs): views
    lens = torch.tensor([len(p) for p in prompts], device=dev).repeat_interleave(G)  # (N,)
    key_mask = cache["mask"][:N]
    key_mask.copy_(torch.arange(key_mask.size(1), device=dev) >= (P - lens)[:, None])  # (N, cols) False: left padding
    last = []  # each prompt's last hidden state (1, C)
    for i, p in enumerate(prompts):
        rows = slice(i * G, (i + 1) * G)
        h = model.hidden(torch.tensor(p, device=dev)[None], kv=[(k[rows], v[rows]) for k, v in kv],
                          col=P - len(p))  # (1, len, C)
        last.append(h[:, -1])
    # the output layer once for all prompts (its weight read, and under autocast cast, once), a row of logits a
    # prompt, which each of its sample rows draws from on its own
    logits = model.lm_head(torch.cat(last)).repeat_interleave(G, 0)  # (N, vocab_size)

    # every uniform the sampler will use, drawn up front: two per row and step (see sampling._draw)
    if isinstance(generator, (list, tuple)):
        if len(generator) != len(prompts):
            raise ValueError(f"{len(generator)} generators for {len(prompts)} prompts; give one per prompt")
        u = torch.cat([torch.rand(max_new_tokens, G, 2, device=dev, generator=g) for g in generator], 1)
    else:
        u = torch.rand(max_new_tokens, N, 2, device=dev, generator=generator)  # (steps, N, 2)
    eos = None if eos_id is None else torch.tensor(sorted({eos_id} if isinstance(eos_id, int) else set(eos_id)),
                                                   device=dev)
    fill = 0 if eos is None else int(eos[0])
    M = max_new_tokens
    tokens = torch.full((M + 1, N), fill, device=dev)  # step-major: row j holds each row's j-th token; row M is
    logps = torch.zeros(M + 1, N, device=dev)  # where the finished rows' tokens go, never returned
    live = torch.arange(N, device=dev)  # output row of each batch row; the batch shrinks as rows finish
    done = torch.zeros(N, dtype=torch.bool, device=dev)
    j = torch.zeros(N, dtype=torch.long, device=dev)  # each row's index of its newest token: in its cache at P + j
    if turns is not None:  # multi-turn: which tokens are an observation's, each row's last own token
        observed, last = torch.zeros(M + 1, N, dtype=torch.bool, device=dev), [M - 1] * N
    check_every = 8  # steps between the only host syncs of the loop: "all done?" and compaction
    graphs = model.decode_graphs
    decode = cuda_graphs.decoder(model, cache, dtype) if graphs else model.decode
    # a step attends over the cache columns written so far, rounded up to a multiple of 64 (a few shapes for a
    # compiled step or a graph): reading the keys and values is most of a decode step's time outside the matmuls
    width, top = 0, 0  # top: the largest j (an observation takes a row ahead of the others)
    tok, lp = sample(logits, temperature, top_k, top_p, u[0])  # (N,), (N,)
    for t in range(M):
        at = torch.where(done, M, j)
        tokens.index_put_((at, live), tok)
        logps.index_put_((at, live), lp)
        if turns is not None:
            tok, lp, done, ahead = multiturn.end_turns(turns, model, live=live, tok=tok, lp=lp, j=j, done=done,
                                                       eos=eos, kv=kv, key_mask=key_mask, lens=lens, P=P,
                                                       tokens=tokens, observed=observed, last=last)
            top = max(top, ahead)
            done = done | (j == M - 1)  # a row that read an observation can reach the last step before the others
        elif eos is not None:
            done = done | torch.isin(tok, eos)
        if t == M - 1:
            break
        if t % check_every == check_every - 1:
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            # drop finished rows, but not for a few: it copies the cache. Not with graphs either: a graph per batch
            # size would be captured, and a finished row costs a replayed step little (weights are read once)
            if keep.numel() <= 0.75 * done.numel() and not graphs:
                n = keep.numel()
                for k, v in kv:  # the live rows into the first n, in order: the cache never moves
                    k[:n, :, :S], v[:n, :, :S] = k[keep, :, :S], v[keep, :, :S]
                key_mask[:n] = key_mask[keep]
                kv, key_mask = [(k[:n], v[:n]) for k, v in kv], key_mask[:n]
                live, lens, tok, done, j, width = live[keep], lens[keep], tok[keep], done[keep], j[keep], 0
        if P + top + 1 > width:
            width = min(S, (P + top + 64) // 64 * 64)  # S, not the cache's columns: the same sums, call to call
            step_kv, step_mask = [(k[:, :, :width], v[:, :, :width]) for k, v in kv], key_mask[:, :width]
        col = (P + j).clamp(max=S - 1)  # a finished row writes over its last column, which nothing reads again
        tok, lp = decode(tok=tok, pos=lens + j, col=col, u=u[(j + 1).clamp(max=M - 1), live], kv=step_kv,
                         key_mask=step_mask, temperature=temperature, top_k=top_k, top_p=top_p)
        j, top = j + ~done, min(top + 1, M - 1)

    tokens, logps = tokens[:M].t(), logps[:M].t()  # (N, max_new_tokens)
    if turns is not None:  # the row's own tokens up to its last: never an observation's
        mask = ~observed[:M].t() & (torch.arange(M, device=dev) <= torch.tensor(last, device=dev)[:, None])
    elif eos is None:
        mask = torch.ones_like(tokens, dtype=torch.bool)
    else:  # real tokens: no eos strictly before them (rows end with eos, then are filled with it)
        is_eos = torch.isin(tokens, eos).int()
        mask = (is_eos.cumsum(1) - is_eos) == 0
    L = int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1  # the steps up to any row's last own token
    return tokens[:, :L].contiguous(), mask[:, :L].contiguous(), logps[:, :L].contiguous()


