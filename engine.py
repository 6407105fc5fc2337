"""
The sampling engine behind GPT.generate: G completions per prompt from a static KV cache, each prompt prefilled
once straight into the cache rows of its samples (as nanochat's engine does), then every row decoded together one
token a step with GPT.decode, each row's token going into its own next cache column (rows are level, except that a
multi-turn row jumps ahead by each observation it reads in).

The cache is allocated once for a call's batch and sequence and never moved (finished rows are dropped by copying
the live ones into its first rows), and freed when the call returns, leaving its memory to the update. With
model.decode_graphs (train.py's cuda_graphs) the steps are replayed as CUDA graphs instead (lib/cuda_graphs.py), and the
cache is kept across calls, grown to the largest batch and sequence seen, since a graph reads the addresses it was
captured with.
"""
import functools
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import torch

from lib import cuda_graphs
from sampling import check_sampling, sample

_CACHES = weakref.WeakKeyDictionary()  # model -> its static cache: off the module, so state_dict and deepcopy skip it


@torch.inference_mode()
def generate(model, prompts, max_new_tokens, *, num_samples=1, temperature=1.0, top_k=None, top_p=None, eos_id=None,
             generator=None, turns=None, turn_workers=1):
    """GPT.generate's body: see its docstring."""
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
        with ThreadPoolExecutor(turn_workers) if turns is not None and turn_workers > 1 else nullcontext() as pool:
            return _generate(model, prompts, max_new_tokens, num_samples, temperature, top_k, top_p, eos_id, generator,
                             turns and functools.partial(_observe, turns, pool))
    finally:
        model.train(was_training)
        if not model.decode_graphs:  # only the graphs need the cache where it was
            _CACHES.pop(model, None)


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
    logits = torch.empty(N, cfg.vocab_size, device=dev)
    for i, p in enumerate(prompts):
        rows = slice(i * G, (i + 1) * G)
        h = model.hidden(torch.tensor(p, device=dev)[None], kv=[(k[rows], v[rows]) for k, v in kv],
                          col=P - len(p))  # (1, len, C)
        logits[rows] = model.lm_head(h[:, -1])  # one row of logits, which each sample row draws from on its own

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
            tok, lp, done, ahead = _end_turns(turns, model, live=live, tok=tok, lp=lp, j=j, done=done, eos=eos,
                                              kv=kv, key_mask=key_mask, lens=lens, P=P, tokens=tokens,
                                              observed=observed, last=last)
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


# -----------------------------------------------------------------------------
# multi-turn: a row that ends a turn (its newest token is an eos id) gets the observation turns(row, its tokens so
# far) returns. That token and the observation's but the last go into the row's cache in one forward of the new
# tokens only (the rows that end a turn at the same step together); the observation's last token is then the row's
# newest, which the next decode step feeds like any other, sampling the row's own next token from it. The row goes
# on with the others, ahead of them in its cache.

def _end_turns(turns, model, *, live, tok, lp, j, done, eos, kv, key_mask, lens, P, tokens, observed, last):
    """Call turns for the live rows whose newest token ends a turn and read in what it returns (an observation
    that runs past the last step is cut there and its row ends). Returns tok, lp and done, updated, and the largest
    j of a row that read one (0 if none); j, tokens, observed and last change in place."""
    M = tokens.size(0) - 1
    ends = (torch.isin(tok, eos) & ~done & ~observed[j, live]).nonzero().squeeze(1).tolist()  # the row's own eos
    if not ends:
        return tok, lp, done, 0
    reading, done, tok, lp = {}, done.clone(), tok.clone(), lp.clone()
    rows = [int(live[b]) for b in ends]
    observations = turns(rows, [tokens[:int(j[b]) + 1, row].tolist() for b, row in zip(ends, rows)])
    for b, row, observation in zip(ends, rows, observations):
        n = int(j[b])
        if observation is None:
            done[b], last[row] = True, n
            continue
        if n + len(observation) >= M - 1:  # no room left for the row's own tokens: cut, and the row ends
            observation, done[b] = observation[:M - 1 - n], True
        tokens[n + 1:n + 1 + len(observation), row] = torch.tensor(observation, dtype=tokens.dtype)
        observed[n + 1:n + 1 + len(observation), row] = True
        if observation and not done[b]:  # the turn's last token and the observation's but the last, from P + n
            reading[b] = (P + n, [int(tok[b])] + list(observation[:-1]))
            tok[b], lp[b], j[b] = observation[-1], 0.0, n + len(observation)
    if not reading:
        return tok, lp, done, 0
    b = torch.tensor(list(reading), device=tok.device)
    cols, chunks = zip(*reading.values())
    _read(model, list(chunks), rows=b, kv=kv, key_mask=key_mask, col=torch.tensor(cols, device=tok.device),
          lens=lens[b], P=P)
    return tok, lp, done, int(j[b].max())


def _observe(turns, pool, rows, ids):
    """turns(row, ids) of each row that ends a turn at this step, from the pool's threads where there is one (a
    tool that runs a program waits in a subprocess, not holding the GIL), the observations in the rows' order."""
    return list((pool.map if pool else map)(turns, rows, ids))


def _read(model, chunks, *, rows, kv, key_mask, col, lens, P):
    """One forward of the new tokens of rows (r,) of the cache (chunks: r token lists, from cache column col (r,)
    on), for their keys and values only: into those rows' cache."""
    r, T, dev = len(chunks), max(map(len, chunks)), rows.device
    idx = torch.tensor([c + c[-1:] * (T - len(c)) for c in chunks], device=dev)  # (r, T): padding after the end
    at = col[:, None] + torch.arange(T, device=dev)  # (r, T) the columns written; the padding's, past the end
    sub = [tuple(torch.cat((x[rows], x.new_zeros(r, x.size(1), T, x.size(3))), 2) for x in layer)
           for layer in kv]  # the rows' caches, copied, with room for the padding
    S = sub[0][0].size(2)
    mask = torch.cat((key_mask[rows], key_mask.new_zeros(r, T)), 1)[:, None, :] & \
        (torch.arange(S, device=dev) <= at[:, :, None])  # (r, T, S) causal, within each row
    pos = (lens[:, None] + at - P).clamp(max=model.config.block_size - 1)  # the padding's may run past the end
    model.hidden(idx, pos=pos, kv=sub, col=col, key_mask=mask[:, None])
    i, t = torch.tensor([(i, t) for i, c in enumerate(chunks) for t in range(len(c))], device=dev).t()  # not padding
    for layer, copied in zip(kv, sub):  # the new columns back into the cache
        for x, y in zip(layer, copied):
            x[rows[i], :, at[i, t]] = y[i, :, at[i, t]]
