"""
Top-k and top-p: which tokens a row keeps. One rule for the sampler (sampling.py draws from the
kept tokens) and for the trainer's log-prob pass (lib/head.py, and model.py's plain head,
renormalise over them), so that both compute log q, q the truncated, renormalised distribution
that sampled (docs/on_policy.md). The trainer finds the kept set from its own logits rather than
replaying the sampler's: no per-token set to store, and its gradient is q's.
"""
import torch

# a removed token's logit: its exp is exactly 0, and 0 x its log-prob is 0 in the entropy (with
# -inf it is NaN)
REMOVED = -1e30


def candidates(p, top_k, top_p):
    """The tokens top_k and top_p keep of each row of probabilities p (B, V): (w, idx), each (B, k)
    with k = top_k or V, the candidates by descending probability, w their probabilities (0 where
    top_p removes one) and idx their ids. top_k keeps the k likeliest (torch.topk breaks ties),
    top_p then the fewest of those holding top_p of their mass: a token stays while the mass before
    it is < top_p of theirs. top_p alone sorts the whole vocabulary."""
    w, idx = p.topk(min(top_k, p.size(-1))) if top_k is not None else p.sort(-1, descending=True)
    if top_p is not None:
        w = w.masked_fill(w.cumsum(-1) - w >= top_p * w.sum(-1, keepdim=True), 0.0)
    return w, idx


def truncate_(z, top_k, top_p, targets):
    """z (n, V), logits over the temperature (float32 or float64), with the tokens top_k and top_p
    remove set to REMOVED, in place, and returned: log_softmax(z) is then log q. The kept set is
    found from z as the sampler finds it from its own logits. A target the set leaves out (logits
    that differ from the sampler's at the edge of the cut, e.g. in bf16) is kept, so that its
    log-prob stays finite: the gap between the two shows in the trainer's log. Without top_k and
    top_p, z as it is."""
    if top_k is None and top_p is None:
        return z
    w, idx = candidates(torch.softmax(z, -1), top_k, top_p)
    keep = torch.zeros_like(z, dtype=torch.bool).scatter_(1, idx, w > 0)
    keep.scatter_(1, targets[:, None], True)
    return z.masked_fill_(~keep, REMOVED)
